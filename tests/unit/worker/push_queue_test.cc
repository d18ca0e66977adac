// What the push queue (src/worker/push_queue.cc) decides, on whole jobs: priorities, credits
// (max_bytes_in_flight) and the lead limit (max_bytes_ahead), with results that stay exact and
// orders that must not deadlock. Every wait has a deadline: a test fails, it never hangs.
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "gradlink/env.h"
#include "gradlink/worker.h"
#include "unit/support/job_harness.h"
#include "unit/support/reference.h"
#include "unit/support/rounds.h"
#include "unit/support/scenarios.h"

namespace gradlink {
namespace {

using namespace std::chrono_literals;
using test::Job;
using test::JobConfig;
using test::kAllTypes;
using test::RunRounds;
using test::TensorSpec;

// ---- priorities and credits ----------------------------------------------------------------

std::vector<TensorSpec> PrioritySpecs(int n, bool increasing) {
  std::vector<TensorSpec> specs;
  std::mt19937 rng(3);
  for (int i = 0; i < n; ++i) {
    TensorSpec s{"p" + std::to_string(i), kAllTypes[i % 6], uint64_t(1 + rng() % 3000)};
    s.priority = increasing ? i : static_cast<int32_t>(rng() % 11) - 5;
    if (!increasing && i % 4 == 0) s.priority = std::numeric_limits<int32_t>::max();
    if (!increasing && i % 7 == 0) s.priority = std::numeric_limits<int32_t>::min();
    s.average = i % 3 == 0;
    specs.push_back(s);
  }
  return specs;
}

TEST(JobTest, MixedPriorities) {
  JobConfig config;
  config.workers = 3;
  config.servers = 2;
  config.partition_bytes = 1024;  // many partitions, all in flight at once (default credits)
  Job job;
  ASSERT_NO_FATAL_FAILURE(job.Start(config));
  RunRounds(job, PrioritySpecs(30, false), 4, nullptr, 300us);
  job.FinishCleanly();
}

// Regression (credits): a partition used to hold its credit until its pull arrived, which needs
// every worker's push of it. With a window smaller than a step and workers choosing different
// partitions to send next (an op issued later with a higher priority jumps the queue at a
// different moment on each worker), every window could fill with partitions the others had not
// pushed yet: all waited forever. Credit now returns when the push has left.
TEST(JobTest, CreditsWithIncreasingPrioritiesDoNotDeadlock) {
  JobConfig config;
  config.workers = 3;
  config.servers = 2;
  config.partition_bytes = 4096;
  config.max_bytes_in_flight = 16 * 4096;  // 16 partitions; a step has 120
  Job job;
  ASSERT_NO_FATAL_FAILURE(job.Start(config));
  std::vector<TensorSpec> specs;
  for (int i = 0; i < 60; ++i) {
    TensorSpec s{"g" + std::to_string(i), DataType::kFloat32, 2048};
    s.priority = i;  // the layers the next forward pass needs first come last
    specs.push_back(s);
  }
  RunRounds(job, specs, 4, nullptr, 300us);
  job.FinishCleanly();
}

TEST(JobTest, OneCreditWithIncreasingPrioritiesDoesNotDeadlock) {
  JobConfig config;
  config.workers = 3;
  config.servers = 2;
  config.partition_bytes = 1024;
  config.max_bytes_in_flight = 1024;  // one partition in flight: everything queues
  Job job;
  ASSERT_NO_FATAL_FAILURE(job.Start(config));
  RunRounds(job, PrioritySpecs(30, true), 4, nullptr, 300us);
  job.FinishCleanly();
}

TEST(JobTest, FewCreditsSamePriority) {
  JobConfig config;
  config.workers = 3;
  config.servers = 2;
  config.partition_bytes = 4096;
  config.max_bytes_in_flight = 4 * 4096;
  Job job;
  ASSERT_NO_FATAL_FAILURE(job.Start(config));
  std::vector<TensorSpec> specs;
  for (int i = 0; i < 20; ++i) specs.push_back({"c" + std::to_string(i), DataType::kFloat32, 3000});
  RunRounds(job, specs, 3, nullptr, 300us);
  job.FinishCleanly();
}

// max_bytes_ahead: an op holds partitions back until its sums come back, never more than the
// limit per server it spans ahead (one partition when that is smaller), and the results stay
// exact.
TEST(JobTest, LeadLimitHoldsPartitionsBackAndStaysExact) {
  JobConfig config;
  config.workers = 3;
  config.servers = 2;
  config.partition_bytes = 4096;
  config.max_bytes_ahead = 3 * 4096;
  Job job;
  ASSERT_NO_FATAL_FAILURE(job.Start(config));
  // 40 partitions of 4 KiB (the last one 1 KiB), and a tensor smaller than one partition.
  RunRounds(job, {{"big", DataType::kFloat32, 39 * 1024 + 256}, {"small", DataType::kFloat16, 100}},
            3);
  for (uint32_t r = 0; r < config.workers; ++r) {
    const WorkerStats s = job.worker(r).Stats();
    EXPECT_GT(s.partitions_held, 0u) << "rank " << r;
    EXPECT_GT(s.peak_bytes_ahead, 0u) << "rank " << r;
    EXPECT_LE(s.peak_bytes_ahead, config.servers * *config.max_bytes_ahead) << "rank " << r;
  }
  job.FinishCleanly();
}

// The limit is per server the op spans: with one partition's limit and 4 servers, an op of 16
// partitions sends 4 at once and holds back the other 12 (a limit counted once per op would
// send one and hold 15), never more than 4 partitions ahead.
TEST(JobTest, LeadLimitScalesWithTheServersAnOpSpans) {
  JobConfig config;
  config.servers = 4;
  config.partition_bytes = 4096;
  config.max_bytes_ahead = 4096;
  constexpr uint32_t kRounds = 3, kParts = 16;
  Job job;
  ASSERT_NO_FATAL_FAILURE(job.Start(config));
  RunRounds(job, {{"big", DataType::kFloat32, kParts * 1024}}, kRounds);
  for (uint32_t r = 0; r < config.workers; ++r) {
    const WorkerStats s = job.worker(r).Stats();
    // Deterministic: the op's 16 partitions are queued and pumped under one lock, before any
    // sum can come back.
    EXPECT_EQ(s.partitions_held, kRounds * (kParts - config.servers)) << "rank " << r;
    EXPECT_EQ(s.peak_bytes_ahead, config.servers * *config.max_bytes_ahead) << "rank " << r;
  }
  job.FinishCleanly();
}

// About the largest lead a worker accepts (half the available memory; more than all of it is
// refused, declare_test) holds nothing back. (The lead times the servers saturates: 2^63 x 2
// wrapped to 0 once sent one partition at a time; such a lead is now refused before that.)
TEST(JobTest, HugeLeadLimitHoldsNothingBack) {
  JobConfig config;
  config.servers = 2;
  config.partition_bytes = 4096;
  config.max_bytes_ahead = AvailableMemory() != 0 ? AvailableMemory() / 2 : uint64_t{1} << 62;
  Job job;
  ASSERT_NO_FATAL_FAILURE(job.Start(config));
  RunRounds(job, {{"big", DataType::kFloat32, 16 * 1024}}, 2);
  for (uint32_t r = 0; r < config.workers; ++r) {
    EXPECT_EQ(job.worker(r).Stats().partitions_held, 0u) << "rank " << r;
  }
  job.FinishCleanly();
}

TEST(JobTest, NoLeadLimitHoldsNothing) {
  JobConfig config;
  config.partition_bytes = 4096;
  Job job;
  ASSERT_NO_FATAL_FAILURE(job.Start(config));
  RunRounds(job, {{"big", DataType::kFloat32, 40 * 1024}}, 2);
  for (uint32_t r = 0; r < config.workers; ++r) {
    EXPECT_EQ(job.worker(r).Stats().partitions_held, 0u) << "rank " << r;
  }
  job.FinishCleanly();
}

// A limit below one partition still lets one partition of each op go at a time.
TEST(JobTest, LeadLimitBelowOnePartitionSendsOneAtATime) {
  JobConfig config;
  config.partition_bytes = 4096;
  config.max_bytes_ahead = 1;
  Job job;
  ASSERT_NO_FATAL_FAILURE(job.Start(config));
  RunRounds(job, {{"big", DataType::kFloat32, 12 * 1024}}, 2);
  for (uint32_t r = 0; r < config.workers; ++r) {
    EXPECT_EQ(job.worker(r).Stats().peak_bytes_ahead, 4096u) << "rank " << r;
  }
  job.FinishCleanly();
}

// Each op's lead is its own: with the workers issuing the tensors in opposite orders, priorities
// that let later calls jump the queue, a one-partition window and a two-partition lead, an op
// waiting for its sums must never keep another op's partitions from leaving (a lead shared by
// all ops, or a queue that stopped at a held partition, would hang here).
TEST(JobTest, LeadLimitWithOppositeOrdersAndPrioritiesDoesNotDeadlock) {
  JobConfig config;
  config.workers = 3;
  config.servers = 2;
  config.partition_bytes = 1024;
  config.max_bytes_in_flight = 1024;
  config.max_bytes_ahead = 2 * 1024;
  Job job;
  ASSERT_NO_FATAL_FAILURE(job.Start(config));
  std::vector<TensorSpec> specs;
  for (int i = 0; i < 24; ++i) {
    TensorSpec s{"lead" + std::to_string(i), DataType::kFloat32, 256u * (1 + i % 5)};
    s.priority = i % 3;
    specs.push_back(s);
  }
  auto order = [&](uint32_t rank) {
    std::vector<size_t> idx(specs.size());
    for (size_t i = 0; i < idx.size(); ++i) idx[i] = rank % 2 ? idx.size() - 1 - i : i;
    return idx;
  };
  RunRounds(job, specs, 3, order);
  RunRounds(job, specs, 2, order, 300us);
  job.FinishCleanly();
}

}  // namespace
}  // namespace gradlink
