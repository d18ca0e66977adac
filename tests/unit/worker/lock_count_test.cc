// How often each thread takes a worker's state lock (WorkerImpl::mu_) per partition, on the
// servers' path in steady state: 2 workers and 1 server over the inproc fabric (each lane its
// own progress thread, as with UCX), many partitions per operation. The design holds the data
// path to at most 1 acquisition per partition per thread (docs/architecture.md); this test
// measures every thread of both workers and prints the figures. Before the issuer protocol
// (push_queue.cc) the pull lane took it 3.0 times per partition, then 2.0 (OnHeader, then
// OnPayload); since a whole reply comes in one call (Receiver::OnFrame: inproc frames, UCX's
// eager ones) 1.0, plus one more each time two threads pump at once and the issuer must
// collect the other's pushes (1-5% of partitions under tight credit): the bound below leaves
// room for those, not for a second acquisition on every partition.
#include <gtest/gtest.h>

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <map>
#include <string>
#include <mutex>
#include <thread>
#include <vector>

#include "gradlink/worker.h"
#include "unit/support/job_harness.h"
#include "worker/worker_impl.h"

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
constexpr int kRounds = 20;
constexpr double kMaxPerPartition = 1.25;

internal::StateMutex& StateLockOf(Worker& w) {
  return dynamic_cast<WorkerImpl&>(w).state_mutex_for_testing();
}

class LockCountTest : public ::testing::TestWithParam<test::PathLimits> {};

INSTANTIATE_TEST_SUITE_P(Limits, LockCountTest,
                         ::testing::ValuesIn(test::DataPathLimits(kPartitionBytes)),
                         [](const auto& info) { return std::string(info.param.name); });

TEST_P(LockCountTest, StateLockAtMostOncePerPartitionPerThread) {
  const JobConfig config = test::DataPathJob(kPartitionBytes, GetParam());
  Job job;
  ASSERT_NO_FATAL_FAILURE(job.Start(config));
  std::vector<TensorHandle> handles(2);
  std::vector<std::vector<float>*> data(2);
  std::mutex callers_mu;
  std::map<std::thread::id, uint32_t> callers;  // the caller thread of each worker
  auto run = [&](uint32_t r, int rounds) {
    std::vector<float>& d = *data[r];
    for (int k = 0; k < rounds; ++k) {
      for (uint64_t i = 0; i < kCount; ++i) d[i] = static_cast<float>((i + r + k) % 13);
      const Status s = job.worker(r)
                           .PushPull(handles[r], std::as_writable_bytes(std::span<float>(d)))
                           .Wait(In(kOpTimeout));
      ASSERT_TRUE(s.ok()) << s.ToString();
      // The independent reference: the sum over both ranks, element by element.
      for (uint64_t i = 0; i < kCount; i += 997) {
        const float want = static_cast<float>((i + 0 + k) % 13) + static_cast<float>((i + 1 + k) % 13);
        ASSERT_EQ(d[i], want) << "element " << i << " round " << k;
      }
    }
  };
  std::vector<std::vector<float>> buffers(2, std::vector<float>(kCount));
  for (uint32_t r = 0; r < 2; ++r) data[r] = &buffers[r];
  OnEveryWorker(2, [&](uint32_t r) {
    auto h = job.worker(r).Declare("lock-count", DataType::kFloat32, kCount);
    ASSERT_TRUE(h.ok()) << h.status().ToString();
    handles[r] = *h;
    run(r, 2);  // warm up: plans, endpoints, pools
  });
  for (uint32_t r = 0; r < 2; ++r) StateLockOf(job.worker(r)).StartCounting();
  OnEveryWorker(2, [&](uint32_t r) {
    {
      std::lock_guard<std::mutex> lock(callers_mu);
      callers[std::this_thread::get_id()] = r;
    }
    run(r, kRounds);
  });
  const double partitions = static_cast<double>(kRounds * kPartitions);
  for (uint32_t r = 0; r < 2; ++r) {
    uint64_t total = 0;
    for (const auto& [id, n] : StateLockOf(job.worker(r)).Counts()) {
      const bool caller = callers.count(id) != 0;
      const double per = static_cast<double>(n) / partitions;
      std::printf("worker %u, %s thread: %llu acquisitions, %.2f per partition\n", r,
                  caller ? "caller" : "lane/control", static_cast<unsigned long long>(n), per);
      total += n;
      EXPECT_LE(per, kMaxPerPartition) << "worker " << r << (caller ? " caller" : " lane/control")
                          << " thread takes the state lock " << per << " times per partition";
    }
    std::printf("worker %u: %.2f acquisitions per partition in all\n", r,
                static_cast<double>(total) / partitions);
  }
  job.FinishCleanly();
}

}  // namespace
}  // namespace gradlink
