// The same-host path (src/worker/local_reduce.h) on whole jobs: every dtype and size through
// shared memory, bit-identical to the servers, call orders, mismatches, fallbacks to the servers,
// deadlines, fused groups, failures and the segment's lifetime. Every wait has a deadline.
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

#include "gradlink/worker.h"
#include "unit/support/job_harness.h"
#include "unit/support/reference.h"
#include "unit/support/rounds.h"
#include "unit/support/scenarios.h"

namespace gradlink {
namespace {

using namespace std::chrono_literals;
using test::AverageDisagreementThenAgreement;
using test::CheckTensor;
using test::ExpectCleanGoodbyeFailsTheOthersPendingOp;
using test::ExpectMismatchOnBothRanks;
using test::ExpectSchedulerStopAbortsPendingOps;
using test::ExpectShutdownFailsOwnPendingOps;
using test::ExpectWaitTimesOutThenCompletes;
using test::FillTensor;
using test::In;
using test::Job;
using test::JobConfig;
using test::kAllTypes;
using test::kOpTimeout;
using test::LayerSpecs;
using test::ManyKeySpecs;
using test::OnEveryWorker;
using test::OrderOfRank;
using test::RefFloatToBf16;
using test::RefFloatToHalf;
using test::RunRounds;
using test::ServerRounds;
using test::TensorSpec;

// ---- the same-host path (src/worker/local_reduce.h) ------------------------------------------

JobConfig LocalConfig(uint32_t workers, uint64_t chunk_bytes) {
  JobConfig config;
  config.workers = workers;
  config.servers = 1;
  config.local_arena_bytes = 16 << 20;
  config.local_chunk_bytes = chunk_bytes;
  return config;
}

uint64_t LocalBytes(Job& job) {
  uint64_t n = 0;
  for (uint32_t r = 0; r < job.config().workers; ++r) n += job.worker(r).Stats().bytes_copied_local;
  return n;
}

class LocalPathTest : public ::testing::TestWithParam<uint32_t> {};

// Every dtype, sizes of one element to many chunks (1 KiB chunks: 300000 elements are 300-1200
// chunks), sums and averages: every element against the scalar reference, and no server
// summed anything.
TEST_P(LocalPathTest, AllDtypesAllSizesSumsAndAverages) {
  const uint32_t workers = GetParam();
  Job job;
  ASSERT_NO_FATAL_FAILURE(job.Start(LocalConfig(workers, 1024)));
  std::vector<TensorSpec> specs;
  for (DataType t : kAllTypes) {
    for (uint64_t n : {1u, 1000u, 300000u}) {
      for (bool average : {false, true}) {
        specs.push_back({std::string(DataTypeName(t)) + "/" + std::to_string(n) +
                             (average ? "/avg" : ""),
                         t, n, average});
      }
    }
  }
  RunRounds(job, specs, 3);
  EXPECT_EQ(ServerRounds(job), 0u);
  uint64_t bytes = 0;
  for (const TensorSpec& t : specs) bytes += t.count * DataTypeSize(t.dtype);
  EXPECT_EQ(LocalBytes(job), bytes * 3 * workers);
  job.FinishCleanly();
}

INSTANTIATE_TEST_SUITE_P(Workers, LocalPathTest, ::testing::Values(2u, 3u),
                         [](const auto& info) { return "W" + std::to_string(info.param); });

// The same values through the servers and through shared memory give the same bits, for the
// dtypes whose sums depend on the order: fp16 and bf16 (summed in fp32) and fp32, with values
// of wildly different magnitudes.
TEST(LocalPathTest, BitIdenticalToTheServers) {
  constexpr uint32_t kWorkers = 3;
  constexpr uint64_t kCount = 70001;
  auto run = [&](bool local, DataType dtype, bool average) {
    JobConfig config = local ? LocalConfig(kWorkers, 4096) : JobConfig{};
    config.workers = kWorkers;
    config.partition_bytes = 8192;
    Job job;
    EXPECT_NO_FATAL_FAILURE(job.Start(config));
    std::vector<std::vector<std::byte>> out(kWorkers);
    OnEveryWorker(kWorkers, [&](uint32_t rank) {
      auto t = job.worker(rank).Declare("w", dtype, kCount);
      ASSERT_TRUE(t.ok());
      std::vector<std::byte> buf(kCount * DataTypeSize(dtype));
      std::mt19937 rng(rank * 7 + 1);
      // Normal values of 2^-9 .. 2^8 in every dtype, either sign.
      std::uniform_real_distribution<float> mant(0.5f, 1.0f);
      std::uniform_int_distribution<int> exp(-8, 8);
      for (uint64_t i = 0; i < kCount; ++i) {
        const float x = std::ldexp(rng() % 2 ? mant(rng) : -mant(rng), exp(rng));
        if (dtype == DataType::kFloat32) std::memcpy(&buf[i * 4], &x, 4);
        if (dtype == DataType::kFloat16) {
          const uint16_t h = RefFloatToHalf(x);
          std::memcpy(&buf[i * 2], &h, 2);
        }
        if (dtype == DataType::kBFloat16) {
          const uint16_t b = RefFloatToBf16(x);
          std::memcpy(&buf[i * 2], &b, 2);
        }
      }
      ASSERT_TRUE(job.worker(rank).PushPull(*t, buf, {.average = average}).Wait(In(kOpTimeout)).ok());
      out[rank] = std::move(buf);
    });
    EXPECT_EQ(ServerRounds(job) == 0, local);
    job.FinishCleanly();
    return out;
  };
  for (DataType dtype : {DataType::kFloat32, DataType::kFloat16, DataType::kBFloat16}) {
    for (bool average : {false, true}) {
      const auto servers = run(false, dtype, average);
      const auto local = run(true, dtype, average);
      for (uint32_t r = 0; r < kWorkers; ++r) {
        EXPECT_TRUE(servers[r] == local[r]) << DataTypeName(dtype) << (average ? " avg" : "")
                                            << " rank " << r;
        EXPECT_TRUE(servers[r] == servers[0]);
      }
    }
  }
}

// Channels are found by key: workers that start their operations in different orders (and
// have several in flight at once, many chunks each) still meet.
TEST(LocalPathTest, DifferentCallOrdersMeet) {
  Job job;
  ASSERT_NO_FATAL_FAILURE(job.Start(LocalConfig(3, 512)));
  const std::vector<TensorSpec> specs = LayerSpecs();
  RunRounds(job, specs, 4, [&](uint32_t rank) { return OrderOfRank(specs.size(), rank); },
            std::chrono::microseconds(300));
  EXPECT_EQ(ServerRounds(job), 0u);
  job.FinishCleanly();
}

TEST(LocalPathTest, ManyKeysManyRounds) {
  Job job;
  ASSERT_NO_FATAL_FAILURE(job.Start(LocalConfig(2, 256)));
  RunRounds(job, ManyKeySpecs(), 20);
  EXPECT_EQ(ServerRounds(job), 0u);
  job.FinishCleanly();
}

TEST(LocalPathTest, AverageFlagDisagreementIsAMismatch) {
  Job job;
  ASSERT_NO_FATAL_FAILURE(job.Start(LocalConfig(2, 256)));
  // 1000 fp32 are 16 chunks: the mismatch is found on the first and the rest still go through,
  // so the next round on the tensor meets.
  for (int i = 0; i < 3; ++i) AverageDisagreementThenAgreement(job, "avg" + std::to_string(i), 1000);
  EXPECT_EQ(ServerRounds(job), 0u);
  job.FinishCleanly();
}

TEST(LocalPathTest, ShapeMismatchFailsEveryRank) {
  Job job;
  ASSERT_NO_FATAL_FAILURE(job.Start(LocalConfig(2, 4096)));
  ExpectMismatchOnBothRanks(job, "shape", DataType::kFloat32, 100, DataType::kFloat32, 101);
  job.FinishCleanly();
}

// Tensors that no longer fit in the segment go through the servers; every worker agrees.
TEST(LocalPathTest, FullSegmentFallsBackToTheServers) {
  JobConfig config = LocalConfig(2, 4096);
  config.local_arena_bytes = 40000;  // 2 workers x 2 slots x 4 KiB + states: 2 tensors
  Job job;
  ASSERT_NO_FATAL_FAILURE(job.Start(config));
  std::vector<TensorSpec> specs;
  for (int i = 0; i < 5; ++i) specs.push_back({"t" + std::to_string(i), DataType::kFloat32, 5000});
  RunRounds(job, specs, 3);
  EXPECT_GT(ServerRounds(job), 0u);
  EXPECT_GT(LocalBytes(job), 0u);
  EXPECT_LT(LocalBytes(job), 5u * 20000 * 3 * 2);
  job.FinishCleanly();
}

// An arena larger than /dev/shm can hold: worker 0 reserves nothing of it (it checks the free
// space first), tells the others through a header-only segment, and the whole job goes through
// the servers, correctly, with nothing left mapped.
TEST(LocalPathTest, ArenaLargerThanDevShmFallsBackToTheServers) {
  JobConfig config = LocalConfig(2, 4096);
  config.local_arena_bytes = uint64_t{1} << 50;  // 1 PiB
  Job job;
  ASSERT_NO_FATAL_FAILURE(job.Start(config));
  std::ifstream maps("/proc/self/maps");
  std::string line;
  while (std::getline(maps, line)) EXPECT_EQ(line.find("/gradlink-"), std::string::npos) << line;
  std::vector<TensorSpec> specs;
  for (int i = 0; i < 3; ++i) specs.push_back({"t" + std::to_string(i), DataType::kFloat32, 5000});
  RunRounds(job, specs, 2);
  EXPECT_GT(ServerRounds(job), 0u);
  EXPECT_EQ(LocalBytes(job), 0u);
  job.FinishCleanly();
}

TEST(LocalPathTest, WaitTimesOutThenCompletes) {
  ExpectWaitTimesOutThenCompletes(LocalConfig(2, 1024));
}

// Operations nobody waits on or polls still complete: the background thread drives them (Stats()
// does not drive).
TEST(LocalPathTest, OperationsCompleteWithoutAWaiter) {
  Job job;
  ASSERT_NO_FATAL_FAILURE(job.Start(LocalConfig(2, 1024)));
  OnEveryWorker(2, [&](uint32_t rank) {
    auto t = job.worker(rank).Declare("big", DataType::kFloat32, 100000);  // 98 chunks
    ASSERT_TRUE(t.ok());
    std::vector<std::byte>& buf = job.Buffer(400000);
    FillTensor(DataType::kFloat32, 0, rank, 0, buf);
    PushPullHandle op = job.worker(rank).PushPull(*t, buf);
    const auto deadline = In(kOpTimeout);
    while (job.worker(rank).Stats().push_pulls == 0 && Clock::now() < deadline) {
      std::this_thread::sleep_for(1ms);
    }
    EXPECT_EQ(job.worker(rank).Stats().push_pulls, 1u);
    EXPECT_TRUE(op.Wait(In(1s)).ok());
    EXPECT_TRUE(CheckTensor(DataType::kFloat32, 0, 2, 0, false, buf));
  });
  job.FinishCleanly();
}

// Wait() times out on time while it drives other traffic: rank 0 waits on an operation rank 1
// has not started while both sum a large tensor. Wait() looks at its deadline after every
// bounded pass over the running operations; a Wait() that drove the large tensor to its end
// before looking (a whole-tensor pass) returns only once that tensor is summed. So the tensor
// is made to take far longer than the deadline plus the margin (64-byte chunks: a hand-off
// between the ranks per 16 floats), and the test checks that it was still being summed when
// Wait() returned: if it was not, the test could not tell the two apart, and fails saying so.
TEST(LocalPathTest, WaitKeepsItsDeadlineWhileOtherTrafficFlows) {
  Job job;
  ASSERT_NO_FATAL_FAILURE(job.Start(LocalConfig(2, 64)));
  constexpr uint64_t kBig = 16u << 20;  // floats: 64 MiB, 1048576 chunks
  constexpr auto kDeadline = 50ms, kMargin = 250ms;
  // The large tensor takes 0.5-4 s on an idle 2-core VM and over 20 s (kOpTimeout) when the
  // suite runs beside a build: its own waits get longer, still inside ctest's 120 s.
  constexpr auto kBigTimeout = 90s;
  OnEveryWorker(2, [&](uint32_t rank) {
    auto big = job.worker(rank).Declare("big", DataType::kFloat32, kBig);
    auto lone = job.worker(rank).Declare("lone", DataType::kFloat32, 10);
    ASSERT_TRUE(big.ok() && lone.ok());
    std::vector<std::byte>& b = job.Buffer(kBig * 4);
    std::vector<std::byte>& l = job.Buffer(40);
    FillTensor(DataType::kFloat32, 0, rank, 0, b);
    PushPullHandle lone_op;
    if (rank == 0) lone_op = job.worker(0).PushPull(*lone, l);
    const auto big_start = Clock::now();
    PushPullHandle big_op = job.worker(rank).PushPull(*big, b);
    if (rank == 0) {
      const auto start = Clock::now();
      EXPECT_EQ(lone_op.Wait(In(kDeadline)).code(), Code::kTimeout);
      const auto waited = Clock::now() - start;
      const bool big_done = big_op.Poll();
      EXPECT_LT(waited, kDeadline + kMargin)
          << "Wait() with a 50 ms deadline returned after "
          << std::chrono::duration_cast<std::chrono::milliseconds>(waited).count() << " ms";
      EXPECT_FALSE(big_done) << "the large tensor was summed before the deadline: this test "
                                "cannot tell a bounded pass from a whole-tensor pass";
    }
    ASSERT_TRUE(big_op.Wait(In(kBigTimeout)).ok());
    const auto big_took = Clock::now() - big_start;
    EXPECT_GT(big_took, kDeadline + kMargin)
        << "rank " << rank << ": the large tensor took only "
        << std::chrono::duration_cast<std::chrono::milliseconds>(big_took).count()
        << " ms: too fast to tell a bounded pass from a whole-tensor pass";
    EXPECT_TRUE(CheckTensor(DataType::kFloat32, 0, 2, 0, false, b));
    if (rank == 1) lone_op = job.worker(1).PushPull(*lone, l);
    EXPECT_TRUE(lone_op.Wait(In(kBigTimeout)).ok());
  });
  job.FinishCleanly();
}

// Regression (review of the same-host path): a caller's PushPull copies its chunk in and leaves
// the sum to whoever waits. Rank 0 starts two rounds on one tensor and blocks in Barrier()
// without waiting; its second round starts only once its first is summed, and rank 1, which
// waits for that second round before it reaches the barrier, needs its chunk. Through the
// servers the lanes finish the first round; here the background thread must.
TEST(LocalPathTest, SecondRoundStartsWhileTheCallerBlocksElsewhere) {
  Job job;
  ASSERT_NO_FATAL_FAILURE(job.Start(LocalConfig(2, 1024)));
  OnEveryWorker(2, [&](uint32_t rank) {
    Worker& w = job.worker(rank);
    auto t = w.Declare("t", DataType::kFloat32, 10);
    ASSERT_TRUE(t.ok());
    // A first round, waited for, so that the tensor is planned (the plan's arrival would
    // wake the background thread by itself).
    std::vector<std::byte>& first = job.Buffer(40);
    ASSERT_TRUE(w.PushPull(*t, first).Wait(In(kOpTimeout)).ok());
    std::vector<std::byte>& b0 = job.Buffer(40);
    std::vector<std::byte>& b1 = job.Buffer(40);
    FillTensor(DataType::kFloat32, 0, rank, 0, b0);
    FillTensor(DataType::kFloat32, 0, rank, 1, b1);
    PushPullHandle r0 = w.PushPull(*t, b0);
    PushPullHandle r1 = w.PushPull(*t, b1);
    if (rank == 1) {
      ASSERT_TRUE(r0.Wait(In(kOpTimeout)).ok());
      ASSERT_TRUE(r1.Wait(In(kOpTimeout)).ok());
    }
    ASSERT_TRUE(w.Barrier(In(kOpTimeout)).ok()) << "rank " << rank;
    ASSERT_TRUE(r0.Wait(In(kOpTimeout)).ok());
    ASSERT_TRUE(r1.Wait(In(kOpTimeout)).ok());
    EXPECT_TRUE(CheckTensor(DataType::kFloat32, 0, 2, 0, false, b0));
    EXPECT_TRUE(CheckTensor(DataType::kFloat32, 0, 2, 1, false, b1));
  });
  job.FinishCleanly();
}

// Two threads of one worker wait at once, one on a large tensor (4,096 chunks), one on a small
// one: whichever holds the drive moves both, the other sleeps until it is free, and both
// complete.
TEST(LocalPathTest, TwoWaitingThreadsOfOneWorker) {
  Job job;
  ASSERT_NO_FATAL_FAILURE(job.Start(LocalConfig(2, 1024)));
  constexpr uint64_t kBig = 1u << 20;  // floats: 4 MiB, 4096 chunks
  OnEveryWorker(2, [&](uint32_t rank) {
    Worker& w = job.worker(rank);
    auto big = w.Declare("big", DataType::kFloat32, kBig);
    auto small = w.Declare("small", DataType::kFloat32, 10);
    ASSERT_TRUE(big.ok() && small.ok());
    std::vector<std::byte>& bb = job.Buffer(kBig * 4);
    std::vector<std::byte>& sb = job.Buffer(40);
    FillTensor(DataType::kFloat32, 0, rank, 0, bb);
    FillTensor(DataType::kFloat32, 1, rank, 0, sb);
    PushPullHandle big_op = w.PushPull(*big, bb);
    PushPullHandle small_op = w.PushPull(*small, sb);
    Status big_status;
    std::thread other([&] { big_status = big_op.Wait(In(kOpTimeout)); });
    EXPECT_TRUE(small_op.Wait(In(kOpTimeout)).ok());
    other.join();
    EXPECT_TRUE(big_status.ok()) << big_status.ToString();
    EXPECT_TRUE(CheckTensor(DataType::kFloat32, 0, 2, 0, false, bb));
    EXPECT_TRUE(CheckTensor(DataType::kFloat32, 1, 2, 0, false, sb));
  });
  job.FinishCleanly();
}

TEST(LocalPathTest, GroupsAreFusedAndSummed) {
  Job job;
  ASSERT_NO_FATAL_FAILURE(job.Start(LocalConfig(2, 4096)));
  OnEveryWorker(2, [&](uint32_t rank) {
    std::vector<TensorHandle> ts;
    std::vector<std::span<std::byte>> data;
    for (int i = 0; i < 50; ++i) {
      auto t = job.worker(rank).Declare("g" + std::to_string(i), DataType::kFloat32, 1000);
      ASSERT_TRUE(t.ok());
      ts.push_back(*t);
      std::vector<std::byte>& b = job.Buffer(4000);
      FillTensor(DataType::kFloat32, i, rank, 0, b);
      data.emplace_back(b);
    }
    ASSERT_TRUE(job.worker(rank).PushPullGroup(ts, data).Wait(In(kOpTimeout)).ok());
    for (int i = 0; i < 50; ++i) {
      std::vector<std::byte> got(data[i].begin(), data[i].end());
      EXPECT_TRUE(CheckTensor(DataType::kFloat32, i, 2, 0, false, got)) << i;
    }
    EXPECT_GT(job.worker(rank).Stats().fused_ops, 0u);
  });
  EXPECT_EQ(ServerRounds(job), 0u);
  job.FinishCleanly();
}

TEST(LocalPathTest, ShutdownFailsTheWorkersOwnPendingOps) {
  ExpectShutdownFailsOwnPendingOps(LocalConfig(2, 1024), 100000);  // 98 chunks
}

// Only the gone flag in the segment can fail the waiting op here: the servers see nothing.
TEST(LocalPathTest, CleanGoodbyeOfOneWorkerFailsTheOthersPendingOp) {
  ExpectCleanGoodbyeFailsTheOthersPendingOp(LocalConfig(2, 1024));
}

// The worker left waiting learns why its peer left from the segment: here a shutdown (in the
// fault trials, "lost the scheduler"), not only that it did.
TEST(LocalPathTest, AWorkerLeftWaitingIsToldWhyItsPeerLeft) {
  ExpectCleanGoodbyeFailsTheOthersPendingOp(
      LocalConfig(2, 1024), "worker 1 left the job (kAborted: worker 1 shut down)");
}

// The scheduler's verdict fails the waiting op.
TEST(LocalPathTest, SchedulerStopAbortsPendingOps) {
  ExpectSchedulerStopAbortsPendingOps(LocalConfig(2, 1024));
}

// Regression (issue 41): an op that ends kAborted because a peer left waits up to the verdict
// grace (500 ms) for the job's failure, which names the cause. That wait ran on the thread
// driving the segment, holding its drive, so every other same-host op of the worker waited
// behind it: two ops ended by one departure ended 500 ms apart, the second once the first's
// grace had run out. Each must end on its own grace, not after another's: here the two end
// within 250 ms of each other (half the stall), each naming the departure.
TEST(LocalPathTest, OneOpsVerdictGraceDoesNotStallTheOthers) {
  Job job;
  ASSERT_NO_FATAL_FAILURE(job.Start(LocalConfig(2, 1024)));
  std::vector<TensorHandle> t0, t1;
  for (const char* name : {"a", "b"}) {
    auto h0 = job.worker(0).Declare(name, DataType::kFloat32, 100);
    auto h1 = job.worker(1).Declare(name, DataType::kFloat32, 100);
    ASSERT_TRUE(h0.ok() && h1.ok());
    t0.push_back(*h0);
    t1.push_back(*h1);
  }
  PushPullHandle a = job.worker(0).PushPull(t0[0], job.Buffer(400));
  PushPullHandle b = job.worker(0).PushPull(t0[1], job.Buffer(400));
  EXPECT_EQ(a.Wait(In(100ms)).code(), Code::kTimeout);  // rank 1 never pushes either
  EXPECT_TRUE(job.worker(1).Shutdown(In(5s)).ok());
  const test::TwoEnds ends = test::WaitBoth(a, b, In(5s));
  for (const Status& s : {ends.a, ends.b}) {
    EXPECT_EQ(s.code(), Code::kAborted) << s.ToString();
    EXPECT_NE(s.message().find("worker 1 left the job"), std::string::npos) << s.message();
  }
  const auto apart = ends.apart;
  EXPECT_LT(apart, 250ms) << "the two ops ended "
                          << std::chrono::duration_cast<std::chrono::milliseconds>(apart).count()
                          << " ms apart: one waited for the other's verdict grace";
}

// The other half of that grace, kept: a verdict that comes within it is what the op reports.
// Rank 1 leaves (the segment ends rank 0's op at once, naming only the departure), then the
// scheduler stops, failing the job: rank 0's op reports the job's failure, not the departure.
TEST(LocalPathTest, AVerdictWithinTheGraceIsWhatTheFailedOpReports) {
  Job job;
  ASSERT_NO_FATAL_FAILURE(job.Start(LocalConfig(2, 1024)));
  auto t0 = job.worker(0).Declare("t", DataType::kFloat32, 100);
  auto t1 = job.worker(1).Declare("t", DataType::kFloat32, 100);
  ASSERT_TRUE(t0.ok() && t1.ok());
  PushPullHandle op = job.worker(0).PushPull(*t0, job.Buffer(400));
  EXPECT_EQ(op.Wait(In(100ms)).code(), Code::kTimeout);
  EXPECT_TRUE(job.worker(1).Shutdown(In(5s)).ok());
  job.scheduler().Stop();
  const Status s = op.Wait(In(5s));
  EXPECT_TRUE(s.code() == Code::kAborted || s.code() == Code::kPeerLost) << s.ToString();
  EXPECT_EQ(s.message().find("left the job"), std::string::npos) << s.message();
  EXPECT_NE(s.message().find("scheduler"), std::string::npos) << s.message();
}

// Once every worker has the segment mapped, its name is gone from /dev/shm: nothing is left
// behind, whatever happens to the job later.
TEST(LocalPathTest, SegmentIsUnlinkedOnceEveryoneHasIt) {
  Job job;
  ASSERT_NO_FATAL_FAILURE(job.Start(LocalConfig(2, 1024)));
  std::ifstream maps("/proc/self/maps");
  std::string line;
  int mapped = 0;
  while (std::getline(maps, line)) {
    if (line.find("/gradlink-") == std::string::npos) continue;
    ++mapped;
    EXPECT_NE(line.find("(deleted)"), std::string::npos) << line;
  }
  EXPECT_EQ(mapped, 2);  // one mapping per worker
  job.FinishCleanly();
}

}  // namespace
}  // namespace gradlink
