// Worker::Join (Horovod's hvd.join) on whole jobs, through the servers and through the
// same-host path: ranks that run out of data sit the others' rounds out, sums and averages go
// on over the ranks that pushed (each checked against a scalar loop over those ranks, in rank
// order), a key first used meanwhile is planned without the joined ranks, and once every rank
// has joined all go on in step. Every wait has a deadline.
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "gradlink/worker.h"
#include "unit/support/job_harness.h"
#include "unit/support/reference.h"

namespace gradlink {
namespace {

using test::In;
using test::Job;
using test::JobConfig;
using test::kOpTimeout;
using test::OnEveryWorker;
using namespace std::chrono_literals;

constexpr uint32_t kWorkers = 3;
// Rounds each rank runs before it joins: rank 0 stops first, rank 2 last.
constexpr uint64_t kRounds[kWorkers] = {2, 4, 6};
constexpr uint64_t kElems = 50000;  // 200 KB of fp32: several partitions on each server

// Rank r's value of element i in round k: not integers, so that the order of the sum shows.
float Value(uint32_t r, uint64_t k, uint64_t i) {
  const uint64_t m = test::Mix((uint64_t{r} << 40) ^ (k << 20) ^ i);
  return static_cast<float>(static_cast<int64_t>(m % 2001) - 1000) / 64.0f + 1.0f / 3.0f;
}
int32_t IntValue(uint32_t r, uint64_t k, uint64_t i) {
  return static_cast<int32_t>(test::Mix((uint64_t{r} << 40) ^ (k << 20) ^ i ^ 7) % 100000) - 50000;
}

// The ranks that push round k of a tensor every rank runs `rounds` of (its own count for
// `solo`, the tensor only rank 2 runs while the others have joined).
std::vector<uint32_t> Present(uint64_t k) {
  std::vector<uint32_t> in;
  for (uint32_t r = 0; r < kWorkers; ++r) {
    if (k < kRounds[r]) in.push_back(r);
  }
  return in;
}

// What the servers' reducers give over the ranks in `in`: fp32 summed in fp32, divided by every
// rank (those that joined add zeros); int32 summed exactly, divided with truncation toward zero. The order: rank
// order (`host_of` empty: flat), or, where hosts sum first, each host's ranks in rank order
// into an fp32 partial, then the hosts' partials in order of each host's lowest rank.
float ExpectedAverage(const std::vector<uint32_t>& in, uint64_t k, uint64_t i,
                      const std::vector<uint32_t>& host_of = {}) {
  std::vector<uint32_t> hosts;  // in order of their lowest rank
  for (uint32_t r = 0; r < kWorkers; ++r) {
    const uint32_t h = host_of.empty() ? r : host_of[r];
    if (std::find(hosts.begin(), hosts.end(), h) == hosts.end()) hosts.push_back(h);
  }
  std::vector<std::optional<float>> partial(hosts.size());
  for (uint32_t r : in) {
    const size_t h = std::find(hosts.begin(), hosts.end(), host_of.empty() ? r : host_of[r]) -
                     hosts.begin();
    partial[h] = partial[h] ? *partial[h] + Value(r, k, i) : Value(r, k, i);
  }
  std::optional<float> acc;
  for (const std::optional<float>& p : partial) {
    if (p) acc = acc ? *acc + *p : *p;
  }
  return *acc / static_cast<float>(kWorkers);  // the joined add zeros
}
int32_t ExpectedSum(const std::vector<uint32_t>& in, uint64_t k, uint64_t i) {
  int64_t acc = 0;
  for (uint32_t r : in) acc += IntValue(r, k, i);
  return static_cast<int32_t>(acc);
}

// One round of the averaged fp32 tensor and the summed int32 one on `rank`, checked.
// `host_of`: the hosts that sum first, for a key summed so (empty: flat).
void RunRound(Worker& w, const TensorHandle& avg, const TensorHandle& sum, uint64_t k,
              const std::vector<uint32_t>& in, const std::vector<uint32_t>& host_of = {}) {
  const uint32_t rank = w.rank();
  std::vector<float> a(kElems);
  std::vector<int32_t> b(kElems);
  for (uint64_t i = 0; i < kElems; ++i) {
    a[i] = Value(rank, k, i);
    b[i] = IntValue(rank, k, i);
  }
  PushPullHandle ha = w.PushPull(avg, std::as_writable_bytes(std::span(a)), {.average = true});
  PushPullHandle hb = w.PushPull(sum, std::as_writable_bytes(std::span(b)));
  const Status sa = ha.Wait(In(kOpTimeout)), sb = hb.Wait(In(kOpTimeout));
  ASSERT_TRUE(sa.ok()) << "rank " << rank << " round " << k << ": " << sa.ToString();
  ASSERT_TRUE(sb.ok()) << "rank " << rank << " round " << k << ": " << sb.ToString();
  uint64_t wrong = 0;
  for (uint64_t i = 0; i < kElems; ++i) {
    const float want = ExpectedAverage(in, k, i, host_of);
    if (std::memcmp(&a[i], &want, sizeof(float)) != 0 || b[i] != ExpectedSum(in, k, i)) {
      if (wrong++ == 0) {
        ADD_FAILURE() << "rank " << rank << " round " << k << " element " << i << ": average "
                      << a[i] << " (want " << want << "), sum " << b[i] << " (want "
                      << ExpectedSum(in, k, i) << ") over " << in.size() << " ranks";
      }
    }
  }
  EXPECT_EQ(wrong, 0u) << "rank " << rank << " round " << k;
}

// `lose_server` (a start index): that server is stopped once ranks 0 and 1 have joined, before
// rank 2's round 5 (round 4 needed their joins recorded): its partitions move while two ranks
// sit out, and the rest of the job (rank 2's rounds, the release, the rounds in step, the
// second join) runs on the servers left. `host_of`: the emulated host of each rank, whose
// workers sum first (the job's keys; a key first declared while ranks have joined is flat).
void RunUnevenJob(const JobConfig& config, int lose_server = -1,
                  const std::vector<uint32_t>& host_of = {}) {
  Job job;
  ASSERT_NO_FATAL_FAILURE(job.Start(config));
  OnEveryWorker(kWorkers, [&](uint32_t rank) {
    Worker& w = job.worker(rank);
    auto avg = w.Declare("grad.avg", DataType::kFloat32, kElems);
    auto sum = w.Declare("grad.sum", DataType::kInt32, kElems);
    ASSERT_TRUE(avg.ok() && sum.ok());
    for (uint64_t k = 0; k < kRounds[rank]; ++k) {
      if (lose_server >= 0 && rank == kWorkers - 1 && k == 5) {
        job.server(static_cast<uint32_t>(lose_server)).Stop();
      }
      ASSERT_NO_FATAL_FAILURE(RunRound(w, *avg, *sum, k, Present(k), host_of));
    }
    // The last rank also runs a tensor nobody else has declared: planned without the others.
    if (rank == kWorkers - 1) {
      auto solo_avg = w.Declare("late.avg", DataType::kFloat32, kElems);
      auto solo_sum = w.Declare("late.sum", DataType::kInt32, kElems);
      ASSERT_TRUE(solo_avg.ok() && solo_sum.ok());
      for (uint64_t k = 0; k < 2; ++k) {
        ASSERT_NO_FATAL_FAILURE(RunRound(w, *solo_avg, *solo_sum, k, {rank}));
      }
    }
    Result<uint32_t> last = w.Join(In(kOpTimeout));
    ASSERT_TRUE(last.ok()) << "rank " << rank << ": " << last.status().ToString();
    EXPECT_EQ(*last, kWorkers - 1) << "rank " << rank;
    // Everyone in step again: the next round of every tensor sums all three ranks, the late
    // ones included (ranks 0 and 1 declare them now and resume at their round).
    const std::vector<uint32_t> all = {0, 1, 2};
    ASSERT_NO_FATAL_FAILURE(RunRound(w, *avg, *sum, kRounds[kWorkers - 1], all, host_of));
    auto late_avg = w.Declare("late.avg", DataType::kFloat32, kElems);
    auto late_sum = w.Declare("late.sum", DataType::kInt32, kElems);
    ASSERT_TRUE(late_avg.ok() && late_sum.ok());
    ASSERT_NO_FATAL_FAILURE(RunRound(w, *late_avg, *late_sum, 2, all));
    EXPECT_TRUE(w.Barrier(In(kOpTimeout)).ok()) << "rank " << rank;
    // A second join, with nothing left to sit out.
    Result<uint32_t> again = w.Join(In(kOpTimeout));
    EXPECT_TRUE(again.ok()) << "rank " << rank << ": " << again.status().ToString();
    if (config.local_arena_bytes != 0) {
      EXPECT_GT(w.Stats().bytes_copied_local, 0u) << "rank " << rank << ": not the same-host path";
    }
    if (!host_of.empty()) {
      EXPECT_NE(w.Stats().in_force.hierarchy, "") << "rank " << rank << ": not summed per host";
    }
    if (lose_server >= 0) {
      EXPECT_EQ(w.Stats().servers_lost, 1u) << "rank " << rank;
      EXPECT_GT(w.Stats().partitions_recovered, 0u) << "rank " << rank;
    }
  });
  if (lose_server < 0) {
    job.FinishCleanly();
    return;
  }
  for (uint32_t r = 0; r < kWorkers; ++r) EXPECT_TRUE(job.worker(r).Shutdown(In(5s)).ok());
  for (uint32_t i = 0; i < job.servers_started(); ++i) {
    if (static_cast<int>(i) == lose_server) continue;
    const Status s = job.server(i).Wait(In(5s));
    EXPECT_TRUE(s.ok()) << "server " << i << ": " << s.ToString();
    EXPECT_EQ(job.server(i).stats().protocol_errors, 0u);
  }
  EXPECT_TRUE(job.scheduler().Wait(In(5s)).ok());
}

JobConfig ServersConfig() {
  JobConfig config;
  config.workers = kWorkers;
  config.servers = 2;
  config.partition_bytes = 16 << 10;
  return config;
}

TEST(JoinTest, UnevenRoundsThroughTheServers) { RunUnevenJob(ServersConfig()); }

// Failover while ranks have joined: a server lost while ranks 0 and 1 sit out; every round of
// every rank still gives the scalar loop's result over the ranks that pushed it, and the job
// joins and resumes on the servers left.
TEST(JoinTest, AServerLostWhileRanksHaveJoined) {
  JobConfig config = ServersConfig();
  config.servers = 3;
  RunUnevenJob(config, /*lose_server=*/1);
}

TEST(JoinTest, UnevenRoundsOnTheSameHostPath) {
  JobConfig config = ServersConfig();
  config.local_arena_bytes = 16 << 20;
  config.local_chunk_bytes = 64 << 10;
  RunUnevenJob(config);
}

// Hosts summing first (the default where a job spans hosts, some with several workers): ranks
// 0 and 2 share a host, rank 1 is alone on another. Rank 0 joins first: it still pushes its
// share of its host's partials, which hold rank 2's tensors only; then rank 1 joins, and its
// host sits rounds out whole. Every round is the hosts' order over the ranks that pushed it
// (an average divides by every rank), which differs from the rank order on these inputs.
JobConfig HostsConfig(const std::vector<uint32_t>& host_of) {
  JobConfig config = ServersConfig();
  config.partition_bytes = 4096;  // 49 partitions: more than a host channel's 32 entries
  config.local_arena_bytes = 32 << 20;
  config.per_worker = [host_of](uint32_t rank, WorkerOptions& o) {
    o.host_name = "host-" + std::to_string(host_of[rank]) + "/" + std::to_string(rank);
  };
  return config;
}

TEST(JoinTest, UnevenRoundsOnHostsSummingFirst) {
  const std::vector<uint32_t> host_of = {0, 1, 0};
  uint64_t differ = 0;
  for (uint64_t i = 0; i < kElems; ++i) {
    const float hosts = ExpectedAverage({0, 1, 2}, 0, i, host_of);
    const float ranks = ExpectedAverage({0, 1, 2}, 0, i);
    differ += std::memcmp(&hosts, &ranks, sizeof(float)) != 0 ? 1 : 0;
  }
  ASSERT_GT(differ, 0u) << "the two orders agree on these inputs: the test could not tell them apart";
  RunUnevenJob(HostsConfig(host_of), /*lose_server=*/-1, host_of);
}

// The same with a server lost while ranks 0 and 1 have joined: rank 0, joined, reports and
// re-pushes its host's partials for the partitions that move, and host 1, sitting out whole,
// reports where its rounds stand.
TEST(JoinTest, AServerLostWhileHostsSumFirstAndRanksHaveJoined) {
  const std::vector<uint32_t> host_of = {0, 1, 0};
  JobConfig config = HostsConfig(host_of);
  config.servers = 3;
  RunUnevenJob(config, /*lose_server=*/1, host_of);
}

// A join() that times out on a host path stands: the worker goes on pushing its share of its
// host's partials in the background (rank 2, on its host, keeps getting its sums), and a second
// join() waits for the same release instead of joining twice.
TEST(JoinTest, AJoinThatTimesOutOnAHostGoesOnPushingAndResumes) {
  const std::vector<uint32_t> host_of = {0, 1, 0};
  Job job;
  ASSERT_NO_FATAL_FAILURE(job.Start(HostsConfig(host_of)));
  std::atomic<bool> rounds_done{false};  // rank 2's rounds 1-4, before its join
  OnEveryWorker(kWorkers, [&](uint32_t rank) {
    Worker& w = job.worker(rank);
    auto avg = w.Declare("grad.avg", DataType::kFloat32, kElems);
    auto sum = w.Declare("grad.sum", DataType::kInt32, kElems);
    ASSERT_TRUE(avg.ok() && sum.ok());
    ASSERT_NO_FATAL_FAILURE(RunRound(w, *avg, *sum, 0, {0, 1, 2}, host_of));
    if (rank == 0) {
      Result<uint32_t> early = w.Join(In(300ms));
      EXPECT_EQ(early.status().code(), Code::kTimeout) << early.status().ToString();
      // Rank 2's rounds end without this rank in join(): its pushes went on in the background.
      const auto until = In(10s);
      while (!rounds_done.load() && Clock::now() < until) std::this_thread::sleep_for(10ms);
      EXPECT_TRUE(rounds_done.load()) << "rank 2's rounds did not end while rank 0 was out of join()";
      Result<uint32_t> again = w.Join(In(kOpTimeout));
      ASSERT_TRUE(again.ok()) << again.status().ToString();
      EXPECT_EQ(*again, 2u);
    } else if (rank == 1) {
      ASSERT_TRUE(w.Join(In(kOpTimeout)).ok());
    } else {
      for (uint64_t k = 1; k <= 4; ++k) {  // 600 ms: past rank 0's first deadline
        std::this_thread::sleep_for(150ms);
        ASSERT_NO_FATAL_FAILURE(RunRound(w, *avg, *sum, k, {2}, host_of));
      }
      rounds_done = true;
      ASSERT_TRUE(w.Join(In(kOpTimeout)).ok());
    }
    ASSERT_NO_FATAL_FAILURE(RunRound(w, *avg, *sum, 5, {0, 1, 2}, host_of));
  });
  job.FinishCleanly();
}

// A barrier counts a joined rank as arrived: the others' barriers do not wait for it, and the
// counts agree afterwards.
TEST(JoinTest, BarriersWhileARankHasJoined) {
  Job job;
  ASSERT_NO_FATAL_FAILURE(job.Start(ServersConfig()));
  OnEveryWorker(kWorkers, [&](uint32_t rank) {
    Worker& w = job.worker(rank);
    for (uint32_t b = 0; b < rank; ++b) {
      ASSERT_TRUE(w.Barrier(In(kOpTimeout)).ok()) << "rank " << rank << " barrier " << b;
    }
    ASSERT_TRUE(w.Join(In(kOpTimeout)).ok()) << "rank " << rank;
    EXPECT_TRUE(w.Barrier(In(kOpTimeout)).ok()) << "rank " << rank;
  });
  job.FinishCleanly();
}

// Collectives other than sums cannot sit a rank out: they fail, naming the joined rank, and
// never hang.
TEST(JoinTest, OtherCollectivesFailWhileARankHasJoined) {
  Job job;
  ASSERT_NO_FATAL_FAILURE(job.Start(ServersConfig()));
  CollectiveSpec bcast;
  bcast.kind = Collective::kBroadcast;
  bcast.root = 1;
  OnEveryWorker(kWorkers, [&](uint32_t rank) {
    Worker& w = job.worker(rank);
    std::vector<float> buf(1000);
    auto bytes = std::as_writable_bytes(std::span(buf));
    auto run = [&](const TensorHandle& t) {
      std::fill(buf.begin(), buf.end(), static_cast<float>(rank));
      return w.Run(t, bytes, bytes).Wait(In(kOpTimeout));
    };
    // Planned before anyone joined: the servers fail its round.
    auto early = w.DeclareCollective("bcast.early", DataType::kFloat32, 1000, bcast);
    ASSERT_TRUE(early.ok()) << early.status().ToString();
    ASSERT_TRUE(run(*early).ok());
    EXPECT_EQ(buf[999], 1.0f);
    ASSERT_TRUE(w.Barrier(In(kOpTimeout)).ok());
    if (rank == 0) {
      ASSERT_TRUE(w.Join(In(kOpTimeout)).ok());
    } else {
      Status s = run(*early);
      EXPECT_EQ(s.code(), Code::kInvalidArgument) << "rank " << rank << ": " << s.ToString();
      EXPECT_NE(s.message().find("rank 0 has joined"), std::string::npos) << s.ToString();
      // First declared meanwhile: the scheduler refuses it.
      auto late = w.DeclareCollective("bcast.late", DataType::kFloat32, 1000, bcast);
      ASSERT_TRUE(late.ok()) << late.status().ToString();
      s = run(*late);
      EXPECT_EQ(s.code(), Code::kInvalidArgument) << "rank " << rank << ": " << s.ToString();
      EXPECT_NE(s.message().find("have joined"), std::string::npos) << s.ToString();
      ASSERT_TRUE(w.Join(In(kOpTimeout)).ok());
    }
    // Once everyone has joined, the early key's next round runs whole again.
    Status again = run(*early);
    EXPECT_TRUE(again.ok()) << "rank " << rank << ": " << again.ToString();
    EXPECT_EQ(buf[0], 1.0f) << "rank " << rank;
  });
  job.FinishCleanly();
}

}  // namespace
}  // namespace gradlink
