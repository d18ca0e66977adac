#include "scheduler/placement.h"

#include <algorithm>

namespace gradlink::scheduler {

std::vector<wire::PartitionPlan> Placer::Plan(DataType dtype, uint64_t count,
                                              uint64_t partition_bytes) {
  std::vector<wire::PartitionPlan> plan;
  const uint64_t size = DataTypeSize(dtype);
  const uint64_t per_part = std::max<uint64_t>(1, partition_bytes / size);
  for (uint64_t offset = 0; offset < count; offset += per_part) {
    wire::PartitionPlan p;
    p.offset = offset;
    p.count = std::min(per_part, count - offset);
    auto least = std::min_element(load_.begin(), load_.end());
    p.server = static_cast<uint32_t>(least - load_.begin());
    *least += p.count * size;
    plan.push_back(p);
  }
  return plan;
}

}  // namespace gradlink::scheduler
