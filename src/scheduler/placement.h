// Cutting tensors into partitions and placing them on servers, balanced by bytes.
#pragma once

#include <cstdint>
#include <vector>

#include "gradlink/tensor.h"
#include "wire/messages.h"

namespace gradlink::scheduler {

// Places partitions on servers. Deterministic: depends only on the sequence of Plan() calls,
// which the scheduler makes in one order for the whole job.
class Placer {
 public:
  explicit Placer(uint32_t num_servers) : load_(num_servers, 0) {}

  // Cuts `count` elements of `dtype` into partitions of at most `partition_bytes` (at least one
  // element each; equal sizes but for the last) and gives each to the least-loaded server
  // (ties: lowest id). An empty tensor has no partitions.
  std::vector<wire::PartitionPlan> Plan(DataType dtype, uint64_t count, uint64_t partition_bytes);

  const std::vector<uint64_t>& load_bytes() const { return load_; }

 private:
  std::vector<uint64_t> load_;
};

}  // namespace gradlink::scheduler
