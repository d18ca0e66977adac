// Cutting tensors into partitions and placing them on servers, balanced by bytes per unit of
// server weight.
#pragma once

#include <cstdint>
#include <vector>

#include "gradlink/tensor.h"
#include "wire/messages.h"

namespace gradlink::scheduler {

// Places partitions on servers. Deterministic: depends only on the weights and the sequence of
// Plan() calls, which the scheduler makes in one order for the whole job.
//
// Server i has weight w_i > 0 (ServerOptions::weight) and should hold w_i / sum(w) of all bytes.
// Each partition goes to the server with the smallest load_i / w_i, ties to the lowest id. So a
// server never holds more than its share of all bytes placed so far plus one partition (it was
// at or below its share when it got its last one); with equal weights this is plain
// least-loaded-by-bytes placement.
class Placer {
 public:
  // Every server weighs 1.0.
  explicit Placer(uint32_t num_servers) : load_(num_servers, 0), weight_(num_servers, 1.0) {}
  // One weight per server id; each must satisfy wire::IsValidServerWeight (the scheduler only
  // takes weights it decoded, which checks them).
  explicit Placer(std::vector<double> weights);

  // Cuts `count` elements of `dtype` into partitions of at most `partition_bytes` (at least one
  // element each; equal sizes but for the last) and gives each to the server with the least
  // load per weight (ties: lowest id). An empty tensor has no partitions.
  std::vector<wire::PartitionPlan> Plan(DataType dtype, uint64_t count, uint64_t partition_bytes);

  const std::vector<uint64_t>& load_bytes() const { return load_; }
  const std::vector<double>& weights() const { return weight_; }

 private:
  uint32_t LeastLoaded() const;

  std::vector<uint64_t> load_;
  std::vector<double> weight_;
  // All weights equal: compare bytes exactly, as integers.
  bool uniform_ = true;
};

}  // namespace gradlink::scheduler
