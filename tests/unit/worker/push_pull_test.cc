// Whole jobs in one process (unit/support/job_harness.h): sums and averages of every dtype,
// sizes spanning partitions and servers, W x S, many keys and rounds, calls on one tensor in call
// order, the single-lane mode and Barrier(). Every element is checked against the scalar
// reference (unit/support/reference.h). Every wait has a deadline: a test fails, it never hangs.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
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

#include "gradlink/scheduler.h"
#include "gradlink/server.h"
#include "gradlink/worker.h"
#include "server/start_on.h"
#include "transport/transport.h"
#include "unit/support/job_harness.h"
#include "unit/support/reference.h"
#include "unit/support/rounds.h"
#include "unit/support/scenarios.h"
#include "worker/worker_impl.h"

namespace gradlink {
namespace {

using namespace std::chrono_literals;
using test::CheckTensor;
using test::ExpectedPartitionRounds;
using test::FillTensor;
using test::In;
using test::Job;
using test::JobConfig;
using test::kAllTypes;
using test::kConnectTimeout;
using test::kOpTimeout;
using test::ManyKeySpecs;
using test::OnEveryWorker;
using test::RunRounds;
using test::ServerRounds;
using test::TensorSpec;

// ---- every dtype, sizes spanning servers, W x S -------------------------------------------

class JobSizesTest : public ::testing::TestWithParam<std::tuple<uint32_t, uint32_t>> {};

TEST_P(JobSizesTest, AllDtypesAllSizesFiveRounds) {
  const auto [workers, servers] = GetParam();
  JobConfig config;
  config.workers = workers;
  config.servers = servers;
  config.partition_bytes = 64 << 10;  // 300000 elements span many partitions and both servers
  Job job;
  ASSERT_NO_FATAL_FAILURE(job.Start(config));
  std::vector<TensorSpec> specs;
  for (DataType t : kAllTypes) {
    for (uint64_t n : {1u, 1000u, 300000u}) {
      specs.push_back({std::string(DataTypeName(t)) + "/" + std::to_string(n), t, n});
    }
  }
  RunRounds(job, specs, 5);
  EXPECT_EQ(ServerRounds(job), ExpectedPartitionRounds(specs, *config.partition_bytes, 5));
  if (servers > 1) {
    // Both servers did work.
    for (uint32_t s = 0; s < servers; ++s) EXPECT_GT(job.server(s).stats().rounds_completed, 0u);
  }
  job.FinishCleanly();
}

INSTANTIATE_TEST_SUITE_P(WorkersServers, JobSizesTest,
                         ::testing::Combine(::testing::Values(1u, 2u, 3u),
                                            ::testing::Values(1u, 2u)),
                         [](const auto& info) {
                           return "W" + std::to_string(std::get<0>(info.param)) + "_S" +
                                  std::to_string(std::get<1>(info.param));
                         });

TEST(JobTest, AverageAllDtypes) {
  JobConfig config;
  config.workers = 3;
  config.servers = 2;
  config.partition_bytes = 4096;
  Job job;
  ASSERT_NO_FATAL_FAILURE(job.Start(config));
  std::vector<TensorSpec> specs;
  for (DataType t : kAllTypes) {
    specs.push_back({"avg/" + std::string(DataTypeName(t)), t, 5000, /*average=*/true});
  }
  RunRounds(job, specs, 3);
  job.FinishCleanly();
}

TEST(JobTest, SingleLaneMode) {
  // single_lane is a per-process option; exercise it through dedicated members.
  auto fabric = transport::CreateInprocFabric();
  SchedulerOptions so;
  so.num_workers = 2;
  so.num_servers = 1;
  so.join_timeout = kConnectTimeout;
  auto sched = Scheduler::Start(so);
  ASSERT_TRUE(sched.ok());
  const std::string address = "127.0.0.1:" + std::to_string((*sched)->port());
  std::vector<std::byte> bufs[2] = {std::vector<std::byte>(12000), std::vector<std::byte>(12000)};
  std::unique_ptr<Server> server;  // declared after the buffers: shuts down before they go
  std::unique_ptr<Worker> w[2];
  std::thread ts([&] {
    ServerOptions o;
    o.scheduler = address;
    o.single_lane = true;
    o.connect_timeout = kConnectTimeout;
    auto s = StartServerOn(o, fabric);
    EXPECT_TRUE(s.ok()) << s.status().ToString();
    if (s.ok()) server = std::move(s).value();
  });
  std::thread tw[2];
  for (int r = 0; r < 2; ++r) {
    tw[r] = std::thread([&, r] {
      WorkerOptions o;
      o.scheduler = address;
      o.rank = r;
      o.single_lane = r == 0;  // one worker of each kind
      o.partition_bytes = 1024;
      o.connect_timeout = kConnectTimeout;
      auto x = ConnectWorkerOn(o, fabric);
      EXPECT_TRUE(x.ok()) << x.status().ToString();
      if (x.ok()) w[r] = std::move(x).value();
    });
  }
  ts.join();
  tw[0].join();
  tw[1].join();
  ASSERT_TRUE(server && w[0] && w[1]);
  OnEveryWorker(2, [&](uint32_t r) {
    auto t = w[r]->Declare("single", DataType::kFloat32, 3000);
    ASSERT_TRUE(t.ok());
    std::vector<std::byte>& buf = bufs[r];
    for (uint64_t round = 0; round < 3; ++round) {
      FillTensor(DataType::kFloat32, 0, r, round, buf);
      Status s = w[r]->PushPull(*t, buf).Wait(In(kOpTimeout));
      ASSERT_TRUE(s.ok()) << s.ToString();
      EXPECT_TRUE(CheckTensor(DataType::kFloat32, 0, 2, round, false, buf));
    }
  });
  for (auto& x : w) EXPECT_TRUE(x->Shutdown(In(5s)).ok());
  EXPECT_TRUE(server->Wait(In(5s)).ok());
  EXPECT_TRUE((*sched)->Wait(In(5s)).ok());
  server->Stop();
  (*sched)->Stop();
}

// ---- many keys, many rounds ----------------------------------------------------------------

// A server holds what the rounds in flight need, not every partition it was given: with a lead
// of 256 KiB per worker, a 32 MiB tensor in 64 KiB partitions never has the server hold more
// than a few MiB (it held 3 x 32 MiB for the rest of the job before rounds shared a pool), holds
// no buffer in a round between operations, and reuses its buffers: it allocates no more of them
// than it held at once (at most 128 under the 8 MiB peak, for 3 x 512 partition rounds that
// each allocated their own before). How many it holds at once varies with scheduling: 10-20
// here alone, 82 on a loaded machine, where send completions reach the server late. Sums
// checked on every element.
TEST(JobTest, ServerMemoryFollowsTheRoundsInFlight) {
  JobConfig config;
  config.workers = 2;
  config.servers = 1;
  config.partition_bytes = 64 << 10;
  config.max_bytes_ahead = 256 << 10;
  Job job;
  ASSERT_NO_FATAL_FAILURE(job.Start(config));
  constexpr uint64_t kCount = 8u << 20;  // 32 MiB of fp32
  uint64_t allocations_after_first = 0;
  for (uint64_t round = 0; round < 3; ++round) {
    OnEveryWorker(2, [&](uint32_t rank) {
      auto t = job.worker(rank).Declare("big", DataType::kFloat32, kCount);
      ASSERT_TRUE(t.ok());
      std::vector<std::byte>& buf = job.Buffer(kCount * 4);
      FillTensor(DataType::kFloat32, 0, rank, round, buf);
      ASSERT_TRUE(job.worker(rank).PushPull(*t, buf).Wait(In(kOpTimeout)).ok());
      EXPECT_TRUE(CheckTensor(DataType::kFloat32, 0, 2, round, false, buf));
    });
    // The last replies' send completions may still be on their way to the server.
    for (auto until = In(std::chrono::seconds(5));
         job.server(0).stats().bytes_in_rounds != 0 && Clock::now() < until;) {
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    const ServerStats s = job.server(0).stats();
    EXPECT_EQ(s.bytes_in_rounds, 0u) << "round " << round;
    EXPECT_LE(s.peak_bytes_held, uint64_t{8} << 20) << "round " << round;
    if (round == 0) allocations_after_first = s.buffer_allocations;
  }
  EXPECT_GT(allocations_after_first, 0u);
  const ServerStats end = job.server(0).stats();
  // Every buffer is one partition's 64 KiB; the pool frees none (far under its cap).
  EXPECT_LE(end.buffer_allocations * (64u << 10), end.peak_bytes_held);
  // CPU per GB summed: this process's, so the workers' too here; only its presence is checked.
  EXPECT_GT(end.process_cpu_seconds, 0.0);
  EXPECT_NEAR(end.cpu_seconds_per_gb, end.process_cpu_seconds / (end.bytes_reduced / 1e9),
              1e-6 * end.cpu_seconds_per_gb + 1e-9);
  std::printf("server: %llu round-buffer allocations (%llu after the first operation), peak "
              "%llu bytes held\n", static_cast<unsigned long long>(end.buffer_allocations),
              static_cast<unsigned long long>(allocations_after_first),
              static_cast<unsigned long long>(end.peak_bytes_held));
  job.FinishCleanly();
}

TEST(JobTest, ManyKeysManyRounds) {
  JobConfig config;
  config.workers = 2;
  config.servers = 2;
  config.partition_bytes = 256;
  Job job;
  ASSERT_NO_FATAL_FAILURE(job.Start(config));
  const std::vector<TensorSpec> specs = ManyKeySpecs();
  RunRounds(job, specs, 20);
  EXPECT_EQ(ServerRounds(job), ExpectedPartitionRounds(specs, *config.partition_bytes, 20));
  job.FinishCleanly();
}

TEST(JobTest, CallsOnOneTensorRunInCallOrder) {
  JobConfig config;
  config.workers = 2;
  config.servers = 2;
  config.partition_bytes = 512;
  Job job;
  ASSERT_NO_FATAL_FAILURE(job.Start(config));
  constexpr int kRounds = 6;
  OnEveryWorker(2, [&](uint32_t rank) {
    auto t = job.worker(rank).Declare("seq", DataType::kFloat64, 700);
    ASSERT_TRUE(t.ok());
    std::vector<std::vector<std::byte>*> bufs;
    for (int k = 0; k < kRounds; ++k) bufs.push_back(&job.Buffer(5600));
    std::vector<PushPullHandle> ops;
    for (int k = 0; k < kRounds; ++k) {  // all issued before any completes
      FillTensor(DataType::kFloat64, 0, rank, k, *bufs[k]);
      ops.push_back(job.worker(rank).PushPull(*t, *bufs[k], {false, k % 2 ? 10 : -10}));
    }
    for (int k = 0; k < kRounds; ++k) {
      ASSERT_TRUE(ops[k].Wait(In(kOpTimeout)).ok());
      EXPECT_TRUE(CheckTensor(DataType::kFloat64, 0, 2, k, false, *bufs[k])) << "call " << k;
    }
  });
  job.FinishCleanly();
}

// No rank leaves Barrier() before every rank has entered it: rank r enters r x 100 ms late, and
// every return comes after the last entry. (Only checking that Barrier() returns ok could not
// fail for a barrier that returned at once.)
TEST(JobTest, Barrier) {
  JobConfig config;
  config.workers = 3;
  Job job;
  ASSERT_NO_FATAL_FAILURE(job.Start(config));
  for (int i = 0; i < 3; ++i) {
    std::vector<Clock::time_point> entered(3), left(3);
    OnEveryWorker(3, [&](uint32_t r) {
      std::this_thread::sleep_for(r * 100ms);
      entered[r] = Clock::now();
      Status s = job.worker(r).Barrier(In(kOpTimeout));
      left[r] = Clock::now();
      EXPECT_TRUE(s.ok()) << s.ToString();
    });
    const Clock::time_point last = *std::max_element(entered.begin(), entered.end());
    for (uint32_t r = 0; r < 3; ++r) {
      EXPECT_GE(left[r], last) << "rank " << r << " left barrier " << i << " "
                               << std::chrono::duration_cast<std::chrono::milliseconds>(
                                      last - left[r]).count()
                               << " ms before the last rank entered it";
    }
  }
  job.FinishCleanly();
}

// ---- the settings in force -------------------------------------------------------------

// Left unset, the partition size, window and lead are gradlink's choice for the job
// (control/tuning.h): the harness's members each have a host of their own, so a network. The
// scheduler cuts each key by the same rule, so the servers' partition rounds tell how it cut:
// 1 MiB of fp32 in 64 KiB partitions (16), 40 KiB in 32 KiB ones (2: one per server).
TEST(JobTest, UnsetSettingsAreChosenForTheJob) {
  JobConfig config;
  config.workers = 2;
  config.servers = 2;
  config.partition_bytes.reset();
  config.max_bytes_in_flight.reset();
  config.max_bytes_ahead.reset();
  Job job;
  ASSERT_NO_FATAL_FAILURE(job.Start(config));
  for (uint32_t r = 0; r < config.workers; ++r) {
    const WorkerStats::InForce f = job.worker(r).Stats().in_force;
    EXPECT_EQ(f.partition_bytes, 64u << 10);
    EXPECT_EQ(f.max_bytes_in_flight, 1u << 20);
    EXPECT_EQ(f.max_bytes_ahead, 128u << 10);
    EXPECT_NE(f.chosen.find("partition_bytes max_bytes_in_flight max_bytes_ahead chosen by "
                            "gradlink: 2 workers and 2 servers over a network"),
              std::string::npos)
        << f.chosen;
  }
  const std::vector<TensorSpec> big = {{"big", DataType::kFloat32, 262144}};
  const std::vector<TensorSpec> small = {{"small", DataType::kFloat32, 10240}};
  RunRounds(job, big, 3);
  EXPECT_EQ(ServerRounds(job), ExpectedPartitionRounds(big, 64u << 10, 3));
  RunRounds(job, small, 3);
  EXPECT_EQ(ServerRounds(job), ExpectedPartitionRounds(big, 64u << 10, 3) +
                                   ExpectedPartitionRounds(small, 32u << 10, 3));
  for (uint32_t s = 0; s < config.servers; ++s) EXPECT_GT(job.server(s).stats().rounds_completed, 3u);
  // Each worker's lead stayed within what was chosen: 128 KiB per server an op spans.
  for (uint32_t r = 0; r < config.workers; ++r) {
    EXPECT_LE(job.worker(r).Stats().peak_bytes_ahead, 2u * (128u << 10)) << "rank " << r;
  }
  job.FinishCleanly();
}

// One worker that sets the partition size while another leaves it to gradlink: the key is
// refused on both, each told what every rank declared.
TEST(JobTest, APartitionSetOnOneWorkerOnlyIsAMismatch) {
  JobConfig config;
  config.workers = 2;
  config.partition_bytes.reset();
  config.per_worker = [](uint32_t rank, WorkerOptions& o) {
    if (rank == 1) o.partition_bytes = 8192;
  };
  Job job;
  ASSERT_NO_FATAL_FAILURE(job.Start(config));
  OnEveryWorker(2, [&](uint32_t rank) {
    auto t = job.worker(rank).Declare("t", DataType::kFloat32, 4096);
    ASSERT_TRUE(t.ok());
    std::vector<std::byte>& buf = job.Buffer(4096 * 4);
    const Status s = job.worker(rank).PushPull(*t, buf).Wait();
    EXPECT_EQ(s.code(), Code::kMismatch) << s.ToString();
    EXPECT_NE(s.message().find("the partitions gradlink chooses"), std::string::npos) << s.ToString();
    EXPECT_NE(s.message().find("8192-byte partitions"), std::string::npos) << s.ToString();
  });
  job.FinishCleanly();
}

TEST(JobTest, StatsGiveTheSettingsInForce) {
  JobConfig config;
  config.workers = 2;
  config.partition_bytes = 2048;
  config.max_bytes_in_flight = 1 << 20;
  config.max_bytes_ahead = 8192;
  Job job;
  ASSERT_NO_FATAL_FAILURE(job.Start(config));
  for (uint32_t r = 0; r < config.workers; ++r) {
    const WorkerStats::InForce f = job.worker(r).Stats().in_force;
    EXPECT_EQ(f.partition_bytes, 2048u);
    EXPECT_EQ(f.max_bytes_in_flight, 1u << 20);
    EXPECT_EQ(f.max_bytes_ahead, 8192u);
    EXPECT_EQ(f.fusion_buffer_bytes, config.fusion_buffer_bytes);
    EXPECT_FALSE(f.same_host_path);
    EXPECT_FALSE(f.host.empty());
    // Threads as ranks: no UCX, so no UCX settings (test_launcher.py checks them over UCX).
    EXPECT_TRUE(f.ucx.empty());
    EXPECT_EQ(f.chosen, "");  // all three were set
  }
  job.FinishCleanly();
  // With the same-host path asked for and every worker on one host, it is in force.
  JobConfig local = config;
  local.local_arena_bytes = 8 << 20;
  Job job2;
  ASSERT_NO_FATAL_FAILURE(job2.Start(local));
  for (uint32_t r = 0; r < local.workers; ++r) {
    const WorkerStats::InForce f = job2.worker(r).Stats().in_force;
    EXPECT_TRUE(f.same_host_path) << "rank " << r;
    EXPECT_EQ(f.local_arena_bytes, 8u << 20);
  }
  job2.FinishCleanly();
}

}  // namespace
}  // namespace gradlink
