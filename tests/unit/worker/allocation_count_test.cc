// What a worker allocates per operation on the servers' path in steady state, counted on the
// threads that call PushPull (where an op is made, queued, pumped and, mostly, issued): 2
// workers and 1 server over UCX (TCP loopback), many partitions per operation, the same limits
// as lock_count_test (whole ops in flight; tight credit and lead, where the lanes pump and issue
// too). Before 2026-12-06 each op cost its caller about 8 allocations (the op, its partition
// states, its deque of held partitions, a map node, the issue batch's growth) and each push one
// more (its callback's captures, too big for std::function's inline storage). UCX, not the
// inproc fabric, which copies each frame into allocations of its own; the lanes' own threads are
// not counted here (bench/server_path.py counts whole processes): under tight limits they pump
// and issue most pushes, whose callback a static_assert in push_queue.cc keeps inline.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

#include "gradlink/worker.h"
#include "unit/support/allocation_counter.h"
#include "unit/support/job_harness.h"
#include "worker/state.h"

namespace gradlink {
namespace {

using test::In;
using test::Job;
using test::JobConfig;
using test::kOpTimeout;
using test::OnEveryWorker;

constexpr uint64_t kPartitionBytes = 16 << 10;
constexpr uint64_t kPartitions = 64;
constexpr uint64_t kCount = kPartitions * kPartitionBytes / sizeof(float);
constexpr int kWarmup = 10;  // plans, endpoints, and the free lists near their high-water marks
// Measured in batches: a free list that reaches a new high-water mark (more sends in flight at
// once than ever before, on a loaded machine) allocates once; the quietest batch shows what an
// operation costs. Before, each cost its caller about 8 + 1 per partition: 72 here.
constexpr int kBatches = 3;
constexpr int kRounds = 20;  // per batch
constexpr uint64_t kMaxPerBatch = kRounds / 2;

class AllocationCountTest : public ::testing::TestWithParam<test::PathLimits> {};

INSTANTIATE_TEST_SUITE_P(Limits, AllocationCountTest,
                         ::testing::ValuesIn(test::DataPathLimits(kPartitionBytes)),
                         [](const auto& info) { return std::string(info.param.name); });

TEST_P(AllocationCountTest, CallersAllocateNothingPerOperation) {
  JobConfig config = test::DataPathJob(kPartitionBytes, GetParam());
  config.ucx = true;
  Job job;
  ASSERT_NO_FATAL_FAILURE(job.Start(config));
  std::vector<TensorHandle> handles(2);
  std::vector<std::vector<float>> data(2, std::vector<float>(kCount));
  std::vector<std::vector<uint64_t>> allocations(2, std::vector<uint64_t>(kBatches, 0));
  auto run = [&](uint32_t r, int first, int rounds, uint64_t* count) {
    std::vector<float>& d = data[r];
    for (int k = first; k < first + rounds; ++k) {
      for (uint64_t i = 0; i < kCount; ++i) d[i] = static_cast<float>((i + r + k) % 13);
      Status s;
      const test::Allocations a = test::AllocationsBy([&] {
        s = job.worker(r)
                .PushPull(handles[r], std::as_writable_bytes(std::span<float>(d)))
                .Wait(In(kOpTimeout));
      });
      if (count != nullptr) *count += a.count;
      ASSERT_TRUE(s.ok()) << s.ToString();
      for (uint64_t i = 0; i < kCount; i += 997) {  // the sum over both ranks, by hand
        const float want = static_cast<float>((i + k) % 13) + static_cast<float>((i + 1 + k) % 13);
        ASSERT_EQ(d[i], want) << "element " << i << " round " << k;
      }
    }
  };
  OnEveryWorker(2, [&](uint32_t r) {
    auto h = job.worker(r).Declare("allocation-count", DataType::kFloat32, kCount);
    ASSERT_TRUE(h.ok()) << h.status().ToString();
    handles[r] = *h;
    run(r, 0, kWarmup, nullptr);
  });
  for (int b = 0; b < kBatches; ++b) {
    OnEveryWorker(2, [&](uint32_t r) { run(r, kWarmup + b * kRounds, kRounds, &allocations[r][b]); });
  }
  for (uint32_t r = 0; r < 2; ++r) {
    std::string batches;
    for (uint64_t n : allocations[r]) batches += " " + std::to_string(n);
    std::printf("worker %u: allocations on its caller per batch of %d operations of %llu "
                "partitions:%s\n", r, kRounds, static_cast<unsigned long long>(kPartitions),
                batches.c_str());
    const uint64_t quietest = *std::min_element(allocations[r].begin(), allocations[r].end());
    EXPECT_LE(quietest, kMaxPerBatch) << "worker " << r << "'s caller allocated" << batches
                                      << " times in batches of " << kRounds << " operations";
  }
  job.FinishCleanly();
}

TEST(VectorFifoTest, FirstInFirstOutReleasingWhatItHandsOut) {
  internal::VectorFifo<std::shared_ptr<int>> q;
  EXPECT_TRUE(q.empty());
  std::vector<std::weak_ptr<int>> made;
  int next = 0, expect = 0;
  // Interleaved: the queue never empties for long, so it compacts instead of starting over.
  for (int step = 0; step < 500; ++step) {
    for (int i = 0; i < 3; ++i) {
      auto p = std::make_shared<int>(next++);
      made.push_back(p);
      q.push_back(std::move(p));
    }
    for (int i = 0; i < 2; ++i) {
      ASSERT_FALSE(q.empty());
      ASSERT_EQ(*q.front(), expect);
      q.pop_front();
      EXPECT_TRUE(made[expect].expired()) << "element " << expect << " still held once popped";
      ++expect;
    }
    ASSERT_EQ(q.size(), static_cast<size_t>(next - expect));
  }
  while (!q.empty()) {
    ASSERT_EQ(*q.front(), expect++);
    q.pop_front();
  }
  EXPECT_EQ(expect, next);
}

}  // namespace
}  // namespace gradlink
