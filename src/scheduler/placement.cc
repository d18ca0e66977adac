#include "scheduler/placement.h"

#include <algorithm>
#include <optional>

namespace gradlink::scheduler {

Placer::Placer(std::vector<double> weights)
    : load_(weights.size(), 0),
      cost_(weights.size(), 0),
      parts_(weights.size(), 0),
      weight_(std::move(weights)) {
  uniform_ = std::all_of(weight_.begin(), weight_.end(),
                         [&](double w) { return w == weight_.front(); });
}

void Placer::Retire(uint32_t id) {
  if (retired_.empty()) retired_.assign(weight_.size(), false);
  if (id < retired_.size()) retired_[id] = true;
}

void Placer::AddStandby(uint32_t id, double weight) {
  if (retired_.empty()) retired_.assign(weight_.size(), false);
  if (id >= weight_.size()) {
    load_.resize(id + 1, 0);
    cost_.resize(id + 1, 0);
    parts_.resize(id + 1, 0);
    weight_.resize(id + 1, 1.0);
    retired_.resize(id + 1, true);
  }
  weight_[id] = weight;
  retired_[id] = true;
  uniform_ = uniform_ && weight == weight_.front();
}

void Placer::Activate(uint32_t id) {
  if (id < retired_.size()) retired_[id] = false;
}

uint32_t Placer::Place(uint64_t bytes) {
  const uint32_t s = LeastLoaded();
  PlaceOn(s, bytes);
  return s;
}

void Placer::PlaceOn(uint32_t id, uint64_t bytes) {
  load_[id] += bytes;
  cost_[id] += bytes + kPartitionCostBytes;
  ++parts_[id];
}

void Placer::Move(uint32_t from, uint32_t to, uint64_t bytes) {
  load_[from] -= bytes;
  cost_[from] -= bytes + kPartitionCostBytes;
  --parts_[from];
  PlaceOn(to, bytes);
}

void Placer::Remove(uint32_t id, uint64_t bytes) {
  if (id >= load_.size()) return;
  load_[id] -= std::min(load_[id], bytes);
  cost_[id] -= std::min(cost_[id], bytes + kPartitionCostBytes);
  if (parts_[id] > 0) --parts_[id];
}

uint32_t Placer::LeastLoaded() const {
  if (!retired_.empty()) {  // the servers left, by cost per weight (ties: lowest id)
    constexpr double kTie = 1 - 1e-12;
    std::optional<uint32_t> best;
    double best_ratio = 0;
    for (uint32_t i = 0; i < cost_.size(); ++i) {
      if (retired_[i]) continue;
      const double ratio = static_cast<double>(cost_[i]) / weight_[i];
      if (!best || ratio < best_ratio * kTie) {
        best = i;
        best_ratio = ratio;
      }
    }
    return best.value_or(0);
  }
  if (uniform_) {
    return static_cast<uint32_t>(std::min_element(cost_.begin(), cost_.end()) - cost_.begin());
  }
  // Costs stay below 2^64 and weights in [1e-6, 1e6], so each ratio is finite. Ratios within a
  // relative 1e-12 of each other are a tie, which the lowest id wins: 3/0.3 and 1/0.1 differ in
  // their last bit, and weights {0.1, 0.3} must plan like {1, 3}. The same inputs give the same
  // doubles, so the choice is deterministic.
  constexpr double kTie = 1 - 1e-12;
  uint32_t best = 0;
  double best_ratio = static_cast<double>(cost_[0]) / weight_[0];
  for (uint32_t i = 1; i < cost_.size(); ++i) {
    const double ratio = static_cast<double>(cost_[i]) / weight_[i];
    if (ratio < best_ratio * kTie) {
      best = i;
      best_ratio = ratio;
    }
  }
  return best;
}

std::vector<wire::PartitionPlan> Placer::Plan(DataType dtype, uint64_t count,
                                              uint64_t partition_bytes) {
  std::vector<wire::PartitionPlan> plan;
  const uint64_t size = DataTypeSize(dtype);
  const uint64_t per_part = std::max<uint64_t>(1, partition_bytes / size);
  for (uint64_t offset = 0; offset < count; offset += per_part) {
    wire::PartitionPlan p;
    p.offset = offset;
    p.count = std::min(per_part, count - offset);
    p.server = Place(p.count * size);
    plan.push_back(p);
  }
  return plan;
}

}  // namespace gradlink::scheduler
