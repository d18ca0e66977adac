// Cutting tensors into partitions and placing them on servers, balanced by bytes (plus a fixed
// charge per partition) per unit of server weight.
#pragma once

#include <cstdint>
#include <vector>

#include "gradlink/tensor.h"
#include "wire/messages.h"

namespace gradlink::scheduler {

// Places partitions on servers. Deterministic: depends only on the weights and the sequence of
// Plan() calls, which the scheduler makes in one order for the whole job.
//
// A partition costs its bytes plus kPartitionCostBytes: a server's work per message (a receive,
// a wake-up, a reply to every worker) besides its bytes. Server i has weight w_i > 0
// (ServerOptions::weight) and should carry w_i / sum(w) of the cost. Each partition goes to the
// server with the smallest cost_i / w_i, ties to the lowest id. So a server never carries more
// than its share of the cost so far plus one partition's (it was at or below its share when it
// got its last one). With equal weights this is least-loaded placement, by bytes for large
// partitions and by count for small ones: 200,000 small keys after a large one spread over the
// servers instead of all filling the one server the large one left short (by bytes alone they
// did, up to a partition's worth of them).
class Placer {
 public:
  // About what a server core spends on one message's fixed work at its rate per byte (~12 us at
  // ~1.4 GB/s per core, bench/RESULTS.md): 0.4% of a default 4 MiB partition.
  static constexpr uint64_t kPartitionCostBytes = 16 << 10;

  // Every server weighs 1.0.
  explicit Placer(uint32_t num_servers)
      : load_(num_servers, 0), cost_(num_servers, 0), parts_(num_servers, 0),
        weight_(num_servers, 1.0) {}
  // One weight per server id; each must satisfy wire::IsValidServerWeight (the scheduler only
  // takes weights it decoded, which checks them).
  explicit Placer(std::vector<double> weights);

  // Cuts `count` elements of `dtype` into partitions of at most `partition_bytes` (at least one
  // element each; equal sizes but for the last) and gives each to the server with the least
  // load per weight (ties: lowest id). An empty tensor has no partitions.
  std::vector<wire::PartitionPlan> Plan(DataType dtype, uint64_t count, uint64_t partition_bytes);

  // Failover: server `id` was lost and takes nothing more.
  void Retire(uint32_t id);
  // A standby server `id` (ids between the last one and it are holes): it takes nothing until
  // Activate(id), when it takes over a lost server's partitions.
  void AddStandby(uint32_t id, double weight);
  void Activate(uint32_t id);
  // One partition of `bytes` to the server with the least load per weight left; counted.
  uint32_t Place(uint64_t bytes);
  // One partition of `bytes` to server `id`; counted.
  void PlaceOn(uint32_t id, uint64_t bytes);
  // A partition of `bytes` placed on `from` moves to `to` (rebalancing onto a new server).
  void Move(uint32_t from, uint32_t to, uint64_t bytes);
  // A partition of `bytes` placed on `id` is gone (its key was retired: Worker::Declare).
  void Remove(uint32_t id, uint64_t bytes);
  // Whether server `id` takes new partitions (not retired, not a standby).
  bool active(uint32_t id) const {
    return id < weight_.size() && (retired_.empty() || !retired_[id]);
  }

  const std::vector<uint64_t>& load_bytes() const { return load_; }
  const std::vector<uint64_t>& load_cost() const { return cost_; }  // bytes + charges
  const std::vector<uint64_t>& partitions() const { return parts_; }
  const std::vector<double>& weights() const { return weight_; }

 private:
  uint32_t LeastLoaded() const;

  std::vector<uint64_t> load_;   // bytes per server
  std::vector<uint64_t> cost_;   // bytes + kPartitionCostBytes per partition
  std::vector<uint64_t> parts_;  // partitions per server
  std::vector<double> weight_;
  std::vector<bool> retired_;  // empty until a server is retired
  // All weights equal: compare costs exactly, as integers.
  bool uniform_ = true;
};

}  // namespace gradlink::scheduler
