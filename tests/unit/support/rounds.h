// Rounds of PushPull on a whole job (unit/support/job_harness.h), every element checked
// against unit/support/reference.h, and the tensor sets the job suites share.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "unit/support/job_harness.h"

namespace gradlink::test {

struct TensorSpec {
  std::string name;
  DataType dtype;
  uint64_t count;
  bool average = false;
  int32_t priority = 0;
};

// Each worker declares `specs` (in the order `order(rank)` gives), then for each round fills
// every tensor, PushPulls all of them at once, waits, and checks every element.
// `issue_gap` (if > 0) sleeps a rank-dependent random time up to that long between calls, as
// a backward pass produces gradients over time.
void RunRounds(Job& job, const std::vector<TensorSpec>& specs, uint64_t rounds,
               std::function<std::vector<size_t>(uint32_t)> order = nullptr,
               std::chrono::microseconds issue_gap = std::chrono::microseconds(0));

// Partition rounds the servers must have completed for `rounds` steps over `specs`.
uint64_t ExpectedPartitionRounds(const std::vector<TensorSpec>& specs, uint64_t partition_bytes,
                                 uint64_t rounds);

// Partition rounds the job's servers have completed.
uint64_t ServerRounds(Job& job);

// 12 tensors of every dtype, and the order each of 3 ranks uses them in: 0 in order, 1 reversed,
// 2 shuffled.
std::vector<TensorSpec> LayerSpecs();
std::vector<size_t> OrderOfRank(size_t n, uint32_t rank);

// 200 small tensors of every dtype.
std::vector<TensorSpec> ManyKeySpecs();

}  // namespace gradlink::test
