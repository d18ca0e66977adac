// Server failover on whole jobs (in one process, on the inproc fabric): a server that leaves
// mid-job has its partitions moved to the servers left, and training goes on. Every round's sum
// is checked on every element against the scalar reference (rank order, so bit-identical to a
// run without the loss). The fork-and-kill trials (tests/fault) kill real processes.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "gradlink/scheduler.h"
#include "gradlink/server.h"
#include "gradlink/worker.h"
#include "reduce/reduce.h"
#include "unit/support/job_harness.h"
#include "unit/support/reference.h"

namespace gradlink {
namespace {

using namespace std::chrono_literals;
using test::CheckTensor;
using test::FillTensor;
using test::In;
using test::Job;
using test::JobConfig;
using test::kOpTimeout;
using test::OnEveryWorker;

constexpr uint64_t kCount = 100000;  // 400 KB of fp32: 7 partitions of 64 KiB over the servers

JobConfig ThreeServers() {
  JobConfig config;
  config.workers = 2;
  config.servers = 3;
  return config;
}

// Round `round` of tensor `name` on every worker, checked; fails the test on an error.
void Round(Job& job, const std::vector<TensorHandle>& t, uint64_t round, DataType dtype,
           bool average = false) {
  OnEveryWorker(2, [&](uint32_t rank) {
    std::vector<std::byte>& buf = job.Buffer(kCount * DataTypeSize(dtype));
    FillTensor(dtype, 0, rank, round, buf);
    const Status s = job.worker(rank).PushPull(t[rank], buf, {.average = average}).Wait(In(kOpTimeout));
    ASSERT_TRUE(s.ok()) << "rank " << rank << " round " << round << ": " << s.ToString();
    EXPECT_TRUE(CheckTensor(dtype, 0, 2, round, average, buf)) << "rank " << rank << " round " << round;
  });
}

std::vector<TensorHandle> DeclareOnEvery(Job& job, DataType dtype,
                                         const std::string& name = "grads") {
  std::vector<TensorHandle> t;
  for (uint32_t r = 0; r < 2; ++r) {
    auto h = job.worker(r).Declare(name, dtype, kCount);
    EXPECT_TRUE(h.ok()) << h.status().ToString();
    if (h.ok()) t.push_back(*h);
  }
  return t;
}

// Round `round` with servers lost in the middle of it: rank 0 pushes and waits on rank 1, the
// servers (by start index) leave, and `settle` later rank 1 pushes; both get the exact sum.
void RoundAcrossLoss(Job& job, const std::vector<TensorHandle>& t, uint64_t round,
                     const std::vector<uint32_t>& lost, std::chrono::milliseconds settle) {
  std::vector<std::byte>& b0 = job.Buffer(kCount * 4);
  std::vector<std::byte>& b1 = job.Buffer(kCount * 4);
  FillTensor(DataType::kFloat32, 0, 0, round, b0);
  FillTensor(DataType::kFloat32, 0, 1, round, b1);
  PushPullHandle op0 = job.worker(0).PushPull(t[0], b0);
  const Status waiting = op0.Wait(In(200ms));  // pushed; waits for rank 1
  EXPECT_EQ(waiting.code(), Code::kTimeout);
  // The timeout names what the op waits for: all 7 partitions, pushed, and their servers.
  EXPECT_NE(waiting.message().find("waiting for 7 partition(s): partition 0 (pushed) on server "),
            std::string::npos) << waiting.message();
  for (uint32_t i : lost) job.server(i).Stop();
  std::this_thread::sleep_for(settle);
  PushPullHandle op1 = job.worker(1).PushPull(t[1], b1);
  const Status s0 = op0.Wait(In(kOpTimeout)), s1 = op1.Wait(In(kOpTimeout));
  ASSERT_TRUE(s0.ok()) << s0.ToString();
  ASSERT_TRUE(s1.ok()) << s1.ToString();
  EXPECT_TRUE(CheckTensor(DataType::kFloat32, 0, 2, round, false, b0));
  EXPECT_TRUE(CheckTensor(DataType::kFloat32, 0, 2, round, false, b1));
}

// The next operation fails on every worker with kPeerLost, its message containing `why`.
void ExpectTheJobFailed(Job& job, const std::vector<TensorHandle>& t, const std::string& why) {
  OnEveryWorker(2, [&](uint32_t rank) {
    std::vector<std::byte>& buf = job.Buffer(kCount * 4);
    const Status s = job.worker(rank).PushPull(t[rank], buf).Wait(In(10s));
    EXPECT_EQ(s.code(), Code::kPeerLost) << s.ToString();
    EXPECT_NE(s.message().find(why), std::string::npos) << s.message();
  });
}

// The surviving members end cleanly: the lost server is not waited for.
void FinishWithout(Job& job, std::vector<uint32_t> lost) {
  for (uint32_t r = 0; r < 2; ++r) EXPECT_TRUE(job.worker(r).Shutdown(In(5s)).ok());
  for (uint32_t i = 0; i < job.servers_started(); ++i) {
    if (std::find(lost.begin(), lost.end(), i) != lost.end()) continue;
    const Status s = job.server(i).Wait(In(5s));
    EXPECT_TRUE(s.ok()) << "server " << i << ": " << s.ToString();
    EXPECT_EQ(job.server(i).stats().protocol_errors, 0u);
  }
  const Status s = job.scheduler().Wait(In(5s));
  EXPECT_TRUE(s.ok()) << s.ToString();
}

// Lost between operations: the next rounds go to the servers left, with no round lost.
TEST(FailoverTest, AServerLostBetweenOperationsCostsNoRound) {
  Job job;
  ASSERT_NO_FATAL_FAILURE(job.Start(ThreeServers()));
  const std::vector<TensorHandle> t = DeclareOnEvery(job, DataType::kFloat32);
  ASSERT_EQ(t.size(), 2u);
  for (uint64_t round = 0; round < 2; ++round) ASSERT_NO_FATAL_FAILURE(Round(job, t, round, DataType::kFloat32));
  const uint64_t before =
      job.server(0).stats().rounds_completed + job.server(2).stats().rounds_completed;
  job.server(1).Stop();
  for (uint64_t round = 2; round < 5; ++round) ASSERT_NO_FATAL_FAILURE(Round(job, t, round, DataType::kFloat32));
  // Every partition of rounds 2-4 was summed on servers 0 and 2: 7 per round.
  const uint64_t after =
      job.server(0).stats().rounds_completed + job.server(2).stats().rounds_completed;
  EXPECT_EQ(after - before, 3u * 7u);
  for (uint32_t r = 0; r < 2; ++r) {
    const WorkerStats st = job.worker(r).Stats();
    EXPECT_EQ(st.servers_lost, 1u);
    EXPECT_GE(st.partitions_recovered, 1u);  // the partitions that lay on the lost server
    EXPECT_EQ(st.bytes_copied_results, 5u * kCount * 4);  // 5 rounds, each result copied once
  }
  FinishWithout(job, {1});
}

// Lost while rank 0's push waits on it for rank 1's: rank 0 pushes that round again to the
// new servers, rank 1 pushes it there for the first time, and both get the exact sum. Then two
// more rounds, and fp16 averages (fp32 accumulation) keep their bits too.
TEST(FailoverTest, AServerLostMidOperationLosesNoStep) {
  Job job;
  ASSERT_NO_FATAL_FAILURE(job.Start(ThreeServers()));
  const std::vector<TensorHandle> t = DeclareOnEvery(job, DataType::kFloat32);
  ASSERT_EQ(t.size(), 2u);
  ASSERT_NO_FATAL_FAILURE(Round(job, t, 0, DataType::kFloat32));
  ASSERT_NO_FATAL_FAILURE(RoundAcrossLoss(job, t, 1, {1}, 100ms));
  for (uint64_t round = 2; round < 4; ++round) ASSERT_NO_FATAL_FAILURE(Round(job, t, round, DataType::kFloat32));
  const std::vector<TensorHandle> h = DeclareOnEvery(job, DataType::kFloat16, "halves");
  ASSERT_EQ(h.size(), 2u);
  for (uint64_t round = 0; round < 2; ++round) {
    ASSERT_NO_FATAL_FAILURE(Round(job, h, round, DataType::kFloat16, /*average=*/true));
  }
  FinishWithout(job, {1});
}

// Two servers lost one after the other: the third carries the job alone; losing it too fails
// every worker with an error that says so, within seconds.
TEST(FailoverTest, TwoLossesAreSurvivedAndTheLastServerLostFailsClearly) {
  Job job;
  ASSERT_NO_FATAL_FAILURE(job.Start(ThreeServers()));
  const std::vector<TensorHandle> t = DeclareOnEvery(job, DataType::kFloat32);
  ASSERT_EQ(t.size(), 2u);
  ASSERT_NO_FATAL_FAILURE(Round(job, t, 0, DataType::kFloat32));
  job.server(0).Stop();
  ASSERT_NO_FATAL_FAILURE(Round(job, t, 1, DataType::kFloat32));
  job.server(2).Stop();
  ASSERT_NO_FATAL_FAILURE(Round(job, t, 2, DataType::kFloat32));
  ASSERT_NO_FATAL_FAILURE(Round(job, t, 3, DataType::kFloat32));
  job.server(1).Stop();
  const auto start = Clock::now();
  ExpectTheJobFailed(job, t, "it was the last server");
  EXPECT_LT(Clock::now() - start, 7s);
}

// Two servers lost back to back while an operation waits on them, the second before the
// first's partitions are adopted, or while they are: the key moves again, each worker reports
// to whichever server has each partition last, and the sums stay exact.
TEST(FailoverTest, ASecondLossWhileTheFirstIsBeingTakenOverIsSurvived) {
  JobConfig config = ThreeServers();
  config.servers = 4;
  Job job;
  ASSERT_NO_FATAL_FAILURE(job.Start(config));
  const std::vector<TensorHandle> t = DeclareOnEvery(job, DataType::kFloat32);
  ASSERT_EQ(t.size(), 2u);
  for (uint64_t round = 0; round < 2; ++round) {
    ASSERT_NO_FATAL_FAILURE(Round(job, t, round, DataType::kFloat32));
  }
  ASSERT_NO_FATAL_FAILURE(RoundAcrossLoss(job, t, 2, {0, 3}, 0ms));
  for (uint64_t round = 3; round < 5; ++round) {
    ASSERT_NO_FATAL_FAILURE(Round(job, t, round, DataType::kFloat32));
  }
  FinishWithout(job, {0, 3});
}

// The servers left must have room for what moves to them: when their memory budgets cannot take
// the lost server's partitions, the job fails, saying so, instead of one running out of memory.
TEST(FailoverTest, NoRoomOnTheServersLeftFailsClearly) {
  JobConfig config = ThreeServers();
  // 7 partitions (6 of 16384 elements and one of 1696) placed 3-2-2: each server's budget holds
  // its own, and no server can take 2 more full ones.
  config.server_memory_budget = 2 * reduce::ServerBytesHeld(DataType::kFloat32, 16384, 2) +
                                reduce::ServerBytesHeld(DataType::kFloat32, 1696, 2);
  Job job;
  ASSERT_NO_FATAL_FAILURE(job.Start(config));
  const std::vector<TensorHandle> t = DeclareOnEvery(job, DataType::kFloat32);
  ASSERT_EQ(t.size(), 2u);
  ASSERT_NO_FATAL_FAILURE(Round(job, t, 0, DataType::kFloat32));
  job.server(1).Stop();
  ExpectTheJobFailed(job, t, "memory budget with key");
}

// With failover off (SchedulerOptions::server_failover) a lost server fails the job, as before,
// and the error says why it did not move.
TEST(FailoverTest, OffALostServerFailsTheJob) {
  JobConfig config = ThreeServers();
  config.server_failover = false;
  Job job;
  ASSERT_NO_FATAL_FAILURE(job.Start(config));
  const std::vector<TensorHandle> t = DeclareOnEvery(job, DataType::kFloat32);
  ASSERT_EQ(t.size(), 2u);
  ASSERT_NO_FATAL_FAILURE(Round(job, t, 0, DataType::kFloat32));
  job.server(1).Stop();
  ExpectTheJobFailed(job, t, "the scheduler runs without it");
}

// Standbys (ServerOptions::standby): two wait, holding nothing. One is lost while it stands by,
// which costs nothing; then a server is lost mid-operation and the other standby takes over all
// of its partitions: the surviving server sums exactly its own partitions before and after, the
// standby exactly the lost server's, and every sum is exact.
TEST(FailoverTest, AStandbyTakesOverALostServersPartitions) {
  JobConfig config = ThreeServers();
  config.servers = 2;
  config.standby_servers = 2;
  config.server_ids = {-1, -1, 2, 3};  // the standbys by start index: 2 and 3
  Job job;
  ASSERT_NO_FATAL_FAILURE(job.Start(config));
  EXPECT_EQ(job.server(2).id(), 2u);
  EXPECT_EQ(job.server(3).id(), 3u);
  const std::vector<TensorHandle> t = DeclareOnEvery(job, DataType::kFloat32);
  ASSERT_EQ(t.size(), 2u);
  for (uint64_t round = 0; round < 2; ++round) ASSERT_NO_FATAL_FAILURE(Round(job, t, round, DataType::kFloat32));
  const uint64_t own = job.server(0).stats().rounds_completed / 2;  // server 0's partitions
  EXPECT_EQ(own + job.server(1).stats().rounds_completed / 2, 7u);
  EXPECT_EQ(job.server(2).stats().rounds_completed, 0u);
  EXPECT_EQ(job.server(3).stats().rounds_completed, 0u);
  job.server(2).Stop();  // a standby lost: nothing moves
  ASSERT_NO_FATAL_FAILURE(Round(job, t, 2, DataType::kFloat32));
  ASSERT_NO_FATAL_FAILURE(RoundAcrossLoss(job, t, 3, {1}, 100ms));
  for (uint64_t round = 4; round < 6; ++round) ASSERT_NO_FATAL_FAILURE(Round(job, t, round, DataType::kFloat32));
  // Rounds 3-5 of server 1's partitions on standby 3 (round 3 could not complete on server 1:
  // rank 1 had not pushed); server 0 took nothing more.
  EXPECT_EQ(job.server(0).stats().rounds_completed, 6 * own);
  EXPECT_EQ(job.server(3).stats().rounds_completed, 3 * (7 - own));
  for (uint32_t r = 0; r < 2; ++r) {
    const WorkerStats st = job.worker(r).Stats();
    EXPECT_EQ(st.servers_lost, 2u);  // the standby and server 1
    EXPECT_EQ(st.partitions_recovered, 7 - own);
  }
  FinishWithout(job, {1, 2});
}

// A server started while the job runs (not told it is a standby) joins as one. A one-server job
// then survives losing its server: the new one takes over every partition. Losing that one too
// fails the job, saying it was the last server.
TEST(FailoverTest, AServerJoiningTheRunningJobTakesOverTheNextLoss) {
  JobConfig config = ThreeServers();
  config.servers = 1;
  Job job;
  ASSERT_NO_FATAL_FAILURE(job.Start(config));
  const std::vector<TensorHandle> t = DeclareOnEvery(job, DataType::kFloat32);
  ASSERT_EQ(t.size(), 2u);
  ASSERT_NO_FATAL_FAILURE(Round(job, t, 0, DataType::kFloat32));
  Result<size_t> added = job.AddServer();
  ASSERT_TRUE(added.ok()) << added.status().ToString();
  EXPECT_EQ(job.server(*added).id(), 1u);  // the first id after the job's servers
  ASSERT_NO_FATAL_FAILURE(Round(job, t, 1, DataType::kFloat32));
  EXPECT_EQ(job.server(*added).stats().rounds_completed, 0u);
  job.server(0).Stop();
  for (uint64_t round = 2; round < 4; ++round) ASSERT_NO_FATAL_FAILURE(Round(job, t, round, DataType::kFloat32));
  EXPECT_EQ(job.server(*added).stats().rounds_completed, 2u * 7u);
  // A new key after the takeover is planned on the server that took over.
  const std::vector<TensorHandle> h = DeclareOnEvery(job, DataType::kFloat32, "later");
  ASSERT_EQ(h.size(), 2u);
  ASSERT_NO_FATAL_FAILURE(Round(job, h, 0, DataType::kFloat32));
  EXPECT_EQ(job.server(*added).stats().rounds_completed, 3u * 7u);
  job.server(*added).Stop();
  ExpectTheJobFailed(job, t, "it was the last server");
}

// A standby must not claim one of the job's first servers' ids (or a lost one's), and a job
// without failover takes no server once it runs: each is refused, saying why, and the job goes
// on.
TEST(FailoverTest, AServerThatCannotStandByIsRefusedClearly) {
  {
    Job job;
    ASSERT_NO_FATAL_FAILURE(job.Start(ThreeServers()));
    Result<size_t> taken = job.AddServer([](ServerOptions& o) {
      o.standby = true;
      o.id = 1;
    });
    ASSERT_FALSE(taken.ok());
    EXPECT_NE(taken.status().message().find("server id 1 is not free for a standby"),
              std::string::npos)
        << taken.status().ToString();
    const std::vector<TensorHandle> t = DeclareOnEvery(job, DataType::kFloat32);
    ASSERT_EQ(t.size(), 2u);
    ASSERT_NO_FATAL_FAILURE(Round(job, t, 0, DataType::kFloat32));
    job.FinishCleanly();
  }
  JobConfig config = ThreeServers();
  config.server_failover = false;
  Job job;
  ASSERT_NO_FATAL_FAILURE(job.Start(config));
  Result<size_t> late = job.AddServer();
  ASSERT_FALSE(late.ok());
  EXPECT_NE(late.status().message().find("runs without server failover"), std::string::npos)
      << late.status().ToString();
  job.FinishCleanly();
}

// Keys other than sums move too (a broadcast, an allgather and a max, as DDP's and torch's
// collectives are) when their server is lost between their rounds: every round after the loss
// gives the scalar reference's result.
TEST(FailoverTest, OtherCollectivesMoveBetweenRounds) {
  Job job;
  ASSERT_NO_FATAL_FAILURE(job.Start(ThreeServers()));
  const std::vector<CollectiveSpec> specs = {
      {.kind = Collective::kBroadcast, .root = 1},
      {.kind = Collective::kAllgather, .counts = {kCount / 2, kCount / 2}},
      {.kind = Collective::kAllreduce, .op = ReduceOp::kMax}};
  std::vector<std::vector<TensorHandle>> keys(specs.size());
  for (size_t k = 0; k < specs.size(); ++k) {
    for (uint32_t r = 0; r < 2; ++r) {
      auto h = job.worker(r).DeclareCollective("collective" + std::to_string(k),
                                               DataType::kFloat32, kCount, specs[k]);
      ASSERT_TRUE(h.ok()) << h.status().ToString();
      keys[k].push_back(*h);
    }
  }
  // Rank r's input element i in round `round`: distinct per rank, round and element.
  const auto input = [](uint32_t r, uint64_t round, uint64_t i) {
    return static_cast<float>(r * 1000 + round * 10 + i % 7);
  };
  const auto run_round = [&](uint64_t round) {
    for (size_t k = 0; k < specs.size(); ++k) {
      OnEveryWorker(2, [&](uint32_t r) {
        const uint64_t in_count = specs[k].kind == Collective::kAllgather ? kCount / 2 : kCount;
        std::vector<float> in(in_count), out(kCount, -1.0f);
        for (uint64_t i = 0; i < in_count; ++i) in[i] = input(r, round, i);
        const Status s =
            job.worker(r)
                .Run(keys[k][r], std::as_bytes(std::span(in)), std::as_writable_bytes(std::span(out)))
                .Wait(In(kOpTimeout));
        ASSERT_TRUE(s.ok()) << DescribeSpec(specs[k]) << " round " << round << ": " << s.ToString();
        for (uint64_t i = 0; i < kCount; ++i) {
          float want = 0;
          switch (specs[k].kind) {
            case Collective::kBroadcast: want = input(1, round, i); break;
            case Collective::kAllgather: want = input(i / (kCount / 2), round, i % (kCount / 2)); break;
            default: want = std::max(input(0, round, i), input(1, round, i)); break;
          }
          ASSERT_EQ(out[i], want) << DescribeSpec(specs[k]) << " round " << round << " rank " << r
                                  << " element " << i;
        }
      });
    }
  };
  for (uint64_t round = 0; round < 2; ++round) ASSERT_NO_FATAL_FAILURE(run_round(round));
  job.server(1).Stop();
  for (uint64_t round = 2; round < 4; ++round) ASSERT_NO_FATAL_FAILURE(run_round(round));
  for (uint32_t r = 0; r < 2; ++r) EXPECT_GE(job.worker(r).Stats().partitions_recovered, 3u);
  FinishWithout(job, {1});
}

}  // namespace
}  // namespace gradlink
