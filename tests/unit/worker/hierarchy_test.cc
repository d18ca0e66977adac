// Hierarchical aggregation (control/topology.h, the host channels of worker/local_reduce.h) on
// whole jobs: the workers of each emulated host (a host name shared by several workers) sum
// among themselves first, each pushes its share of the partitions, and every rank gets the
// sum in the documented order: local ranks in rank order, then hosts in order of their lowest
// rank. Checked bit for bit against a scalar reference written from that rule; the flat mode
// against the flat (rank-order) rule; what reaches the servers (one partial per host); 16-bit
// partials; averages; mismatches; fusion and priorities; mixed placement; failures.
#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <optional>
#include <thread>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "gradlink/server.h"
#include "gradlink/worker.h"
#include "unit/support/job_harness.h"
#include "unit/support/reference.h"
#include "unit/support/rounds.h"
#include "unit/support/scenarios.h"

namespace gradlink {
namespace {

using test::ExpectSchedulerStopAbortsPendingOps;
using test::ExpectShutdownFailsOwnPendingOps;
using test::In;
using test::Job;
using test::JobConfig;
using test::kOpTimeout;
using namespace std::chrono_literals;
using test::OnEveryWorker;
using test::RefBf16ToFloat;
using test::RefFloatToBf16;
using test::RefFloatToHalf;
using test::RefHalfToFloat;

// host_of[r]: the emulated host of rank r.
JobConfig HierConfig(std::vector<uint32_t> host_of, uint32_t servers = 2) {
  JobConfig config;
  config.workers = static_cast<uint32_t>(host_of.size());
  config.servers = servers;
  config.partition_bytes = 8192;  // many partitions: more than a host channel's 32 entries
  config.local_arena_bytes = 32 << 20;
  config.per_worker = [host_of](uint32_t rank, WorkerOptions& o) {
    o.host_name = "host-" + std::to_string(host_of[rank]) + "/" + std::to_string(rank);
  };
  return config;
}

// `config` with `more` applied to each worker's options after its host name.
JobConfig With(JobConfig config, std::function<void(uint32_t, WorkerOptions&)> more) {
  config.per_worker = [named = config.per_worker, more](uint32_t rank, WorkerOptions& o) {
    named(rank, o);
    more(rank, o);
  };
  return config;
}

bool Half(DataType t) { return t == DataType::kFloat16 || t == DataType::kBFloat16; }

float Get(DataType t, const std::vector<std::byte>& b, uint64_t i) {
  if (t == DataType::kFloat32) {
    float f;
    std::memcpy(&f, &b[i * 4], 4);
    return f;
  }
  uint16_t h;
  std::memcpy(&h, &b[i * 2], 2);
  return t == DataType::kFloat16 ? RefHalfToFloat(h) : RefBf16ToFloat(h);
}

void Put(DataType t, std::vector<std::byte>& b, uint64_t i, float f) {
  if (t == DataType::kFloat32) {
    std::memcpy(&b[i * 4], &f, 4);
    return;
  }
  const uint16_t h = t == DataType::kFloat16 ? RefFloatToHalf(f) : RefFloatToBf16(f);
  std::memcpy(&b[i * 2], &h, 2);
}

float Round16(DataType t, float f) {
  return t == DataType::kFloat16 ? RefHalfToFloat(RefFloatToHalf(f))
                                 : RefBf16ToFloat(RefFloatToBf16(f));
}

// Normal values of 2^-9 .. 2^8 (16-bit: 2^-1 .. 2^8, so that no sum or average of them needs a
// subnormal, which the reference does not round), either sign: sums that depend on their order.
std::vector<std::byte> Input(DataType t, uint64_t count, uint32_t seed) {
  std::vector<std::byte> b(count * DataTypeSize(t));
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> mant(0.5f, 1.0f);
  std::uniform_int_distribution<int> exp(Half(t) ? 0 : -8, 8);
  for (uint64_t i = 0; i < count; ++i) {
    Put(t, b, i, std::ldexp(rng() % 2 ? mant(rng) : -mant(rng), exp(rng)));
  }
  return b;
}

// The documented order, written out: per host (hosts in order of their lowest rank), its ranks
// in rank order summed in fp32; `half_partials`: each host's partial rounded to the dtype; then
// the hosts' partials in host order; an average divides by every worker; one final rounding.
// `flat`: ranks in rank order, as without hierarchy.
std::vector<std::byte> Expected(DataType t, const std::vector<std::vector<std::byte>>& in,
                                const std::vector<uint32_t>& host_of, bool flat,
                                bool half_partials, bool average) {
  const uint64_t count = in[0].size() / DataTypeSize(t);
  std::vector<std::vector<uint32_t>> hosts;
  std::vector<int> index(64, -1);
  for (uint32_t r = 0; r < host_of.size(); ++r) {
    if (index[host_of[r]] < 0) {
      index[host_of[r]] = static_cast<int>(hosts.size());
      hosts.emplace_back();
    }
    hosts[index[host_of[r]]].push_back(r);
  }
  if (flat) {
    hosts.assign(1, {});
    for (uint32_t r = 0; r < host_of.size(); ++r) hosts[0].push_back(r);
  }
  std::vector<std::byte> out(in[0].size());
  for (uint64_t i = 0; i < count; ++i) {
    float total = 0;
    for (size_t h = 0; h < hosts.size(); ++h) {
      float partial = Get(t, in[hosts[h][0]], i);
      for (size_t j = 1; j < hosts[h].size(); ++j) partial += Get(t, in[hosts[h][j]], i);
      if (half_partials && Half(t)) partial = Round16(t, partial);
      total = h == 0 ? partial : total + partial;
    }
    if (average) total /= static_cast<float>(host_of.size());
    Put(t, out, i, total);
  }
  return out;
}

uint64_t BytesReduced(Job& job) {
  uint64_t n = 0;
  for (uint32_t s = 0; s < job.config().servers; ++s) n += job.server(s).stats().bytes_reduced;
  return n;
}

struct Outcome {
  std::vector<std::vector<std::byte>> in, out;
  uint64_t server_bytes = 0;
  std::vector<WorkerStats> stats;
};

// Two push_pulls of the same inputs on every rank (the second must give the same bits).
Outcome PushPullTwice(const JobConfig& config, DataType t, uint64_t count, bool average) {
  Outcome run;
  const uint32_t n = config.workers;
  run.in.resize(n);
  run.out.resize(n);
  run.stats.resize(n);
  for (uint32_t r = 0; r < n; ++r) run.in[r] = Input(t, count, 11 * r + 5);
  Job job;
  EXPECT_NO_FATAL_FAILURE(job.Start(config));
  if (::testing::Test::HasFatalFailure()) return run;
  OnEveryWorker(n, [&](uint32_t rank) {
    auto h = job.worker(rank).Declare("grad", t, count);
    ASSERT_TRUE(h.ok()) << h.status().ToString();
    std::vector<std::byte> first = run.in[rank], second = run.in[rank];
    Status s = job.worker(rank).PushPull(*h, first, {.average = average}).Wait(In(kOpTimeout));
    ASSERT_TRUE(s.ok()) << s.ToString();
    s = job.worker(rank).PushPull(*h, second, {.average = average}).Wait(In(kOpTimeout));
    ASSERT_TRUE(s.ok()) << s.ToString();
    EXPECT_TRUE(first == second) << "rank " << rank << ": two runs gave different bits";
    run.out[rank] = std::move(first);
    run.stats[rank] = job.worker(rank).Stats();
  });
  run.server_bytes = BytesReduced(job);
  job.FinishCleanly();
  return run;
}

struct Topology {
  const char* name;
  std::vector<uint32_t> host_of;
};

class HierarchyTest : public ::testing::TestWithParam<Topology> {};

// Every rank gets the documented order's bits; the servers receive one partial per host
// (H x M bytes per push_pull, where flat would send N x M).
TEST_P(HierarchyTest, EveryRankGetsTheHostOrderSum) {
  const Topology& topo = GetParam();
  const uint32_t hosts = 1 + *std::max_element(topo.host_of.begin(), topo.host_of.end());
  for (uint64_t count : {1u, 3000u, 300000u}) {
    const Outcome run = PushPullTwice(HierConfig(topo.host_of), DataType::kFloat32, count, false);
    const auto want = Expected(DataType::kFloat32, run.in, topo.host_of, false, false, false);
    for (uint32_t r = 0; r < topo.host_of.size(); ++r) {
      EXPECT_TRUE(run.out[r] == want) << topo.name << " count " << count << " rank " << r;
      EXPECT_NE(run.stats[r].in_force.hierarchy, "") << "rank " << r;
    }
    EXPECT_EQ(run.server_bytes, 2 * hosts * count * 4) << topo.name << " count " << count;
  }
}

INSTANTIATE_TEST_SUITE_P(
    Topologies, HierarchyTest,
    ::testing::Values(Topology{"2x2", {0, 0, 1, 1}}, Topology{"3+1", {0, 0, 0, 1}},
                      Topology{"3x2", {0, 0, 1, 1, 2, 2}},
                      Topology{"interleaved", {0, 1, 0, 1, 1}}),
    [](const auto& info) {
      std::string s = info.param.name;
      for (char& c : s) {
        if (c == '+') c = 'p';
      }
      return s;
    });

// The reference tells the orders apart on these inputs: hierarchical and flat sums differ.
TEST(HierarchyTest, TheTwoOrdersDifferOnTheseInputs) {
  const std::vector<uint32_t> host_of = {0, 0, 1, 1};
  std::vector<std::vector<std::byte>> in;
  for (uint32_t r = 0; r < 4; ++r) in.push_back(Input(DataType::kFloat32, 3000, 11 * r + 5));
  EXPECT_FALSE(Expected(DataType::kFloat32, in, host_of, false, false, false) ==
               Expected(DataType::kFloat32, in, host_of, true, false, false));
}

// hierarchical = false: every worker pushes everything, and the sums are the flat order's
// bits, as without hierarchy.
TEST(HierarchyTest, FlatModeIsTheRankOrderSum) {
  const std::vector<uint32_t> host_of = {0, 0, 1, 1};
  const JobConfig config =
      With(HierConfig(host_of), [](uint32_t, WorkerOptions& o) { o.hierarchical = false; });
  const Outcome run = PushPullTwice(config, DataType::kFloat32, 30000, false);
  const auto want = Expected(DataType::kFloat32, run.in, host_of, true, false, false);
  for (uint32_t r = 0; r < 4; ++r) {
    EXPECT_TRUE(run.out[r] == want) << "rank " << r;
    EXPECT_EQ(run.stats[r].in_force.hierarchy, "");
  }
  EXPECT_EQ(run.server_bytes, 2u * 4 * 30000 * 4);
}

// One worker that turns hierarchy off makes every key flat for all: still the flat bits.
TEST(HierarchyTest, OneFlatWorkerMakesTheKeyFlatForAll) {
  const std::vector<uint32_t> host_of = {0, 0, 1, 1};
  const JobConfig config = With(HierConfig(host_of), [](uint32_t rank, WorkerOptions& o) {
    if (rank == 3) o.hierarchical = false;
  });
  const Outcome run = PushPullTwice(config, DataType::kFloat32, 30000, false);
  const auto want = Expected(DataType::kFloat32, run.in, host_of, true, false, false);
  for (uint32_t r = 0; r < 4; ++r) EXPECT_TRUE(run.out[r] == want) << "rank " << r;
}

// 16-bit tensors: fp32 host partials by default (one rounding, 2x the bytes to the servers);
// 16-bit partials on request (two roundings, the tensor's bytes). Each matches its rule, and
// the fp32 partials are closer to the exact sum.
TEST(HierarchyTest, SixteenBitPartials) {
  const std::vector<uint32_t> host_of = {0, 0, 1, 1};
  constexpr uint64_t kCount = 50000;
  for (DataType t : {DataType::kFloat16, DataType::kBFloat16}) {
    for (bool average : {false, true}) {
      const Outcome fp32 = PushPullTwice(HierConfig(host_of), t, kCount, average);
      const JobConfig config =
          With(HierConfig(host_of), [](uint32_t, WorkerOptions& o) { o.half_partials = true; });
      const Outcome half = PushPullTwice(config, t, kCount, average);
      const auto want32 = Expected(t, fp32.in, host_of, false, false, average);
      const auto want16 = Expected(t, half.in, host_of, false, true, average);
      for (uint32_t r = 0; r < 4; ++r) {
        EXPECT_TRUE(fp32.out[r] == want32) << DataTypeName(t) << " fp32 partials, rank " << r;
        EXPECT_TRUE(half.out[r] == want16) << DataTypeName(t) << " 16-bit partials, rank " << r;
      }
      EXPECT_EQ(fp32.server_bytes, 2u * 2 * kCount * 4) << "fp32 partials: 4 bytes per element";
      EXPECT_EQ(half.server_bytes, 2u * 2 * kCount * 2) << "16-bit partials: 2 bytes per element";
      // Error against the exact sum (fp64), over all elements.
      double err32 = 0, err16 = 0;
      for (uint64_t i = 0; i < kCount; ++i) {
        double exact = 0;
        for (uint32_t r = 0; r < 4; ++r) exact += Get(t, fp32.in[r], i);
        if (average) exact /= 4;
        err32 += std::abs(Get(t, fp32.out[0], i) - exact);
        err16 += std::abs(Get(t, half.out[0], i) - exact);
      }
      EXPECT_LT(err32, err16) << DataTypeName(t);
      RecordProperty(std::string(DataTypeName(t)) + (average ? "_avg" : "_sum") +
                         "_mean_abs_error_fp32_vs_16bit_partials",
                     std::to_string(err32 / kCount) + " vs " + std::to_string(err16 / kCount));
    }
  }
}

// Averages divide by every worker of the job, not by the hosts.
TEST(HierarchyTest, AverageDividesByEveryWorker) {
  const std::vector<uint32_t> host_of = {0, 0, 0, 1};
  const Outcome run = PushPullTwice(HierConfig(host_of), DataType::kFloat32, 20000, true);
  const auto want = Expected(DataType::kFloat32, run.in, host_of, false, false, true);
  for (uint32_t r = 0; r < 4; ++r) EXPECT_TRUE(run.out[r] == want) << "rank " << r;
}

// Workers of one host that disagree on averaging: kMismatch on every rank of every host (the
// host's push says so, and the server fails the round for all), naming the ranks; the next
// operation on the tensor, agreed, goes through.
TEST(HierarchyTest, AHostWhoseWorkersDisagreeIsAMismatchEverywhere) {
  const std::vector<uint32_t> host_of = {0, 0, 1, 1};
  Job job;
  ASSERT_NO_FATAL_FAILURE(job.Start(HierConfig(host_of)));
  constexpr uint64_t kCount = 5000;
  OnEveryWorker(4, [&](uint32_t rank) {
    auto h = job.worker(rank).Declare("avg", DataType::kFloat32, kCount);
    ASSERT_TRUE(h.ok());
    std::vector<std::byte> buf = Input(DataType::kFloat32, kCount, rank);
    Status s = job.worker(rank)
                   .PushPull(*h, buf, {.average = rank == 1})
                   .Wait(In(kOpTimeout));
    EXPECT_EQ(s.code(), Code::kMismatch) << "rank " << rank << ": " << s.ToString();
    EXPECT_NE(s.message().find("averag"), std::string::npos) << s.ToString();
    buf = Input(DataType::kFloat32, kCount, rank);
    s = job.worker(rank).PushPull(*h, buf, {}).Wait(In(kOpTimeout));
    EXPECT_TRUE(s.ok()) << "rank " << rank << ": " << s.ToString();
  });
  job.FinishCleanly();
}

// Workers of one host that declare a tensor differently: kMismatch on every rank, naming both.
TEST(HierarchyTest, AHostWhoseWorkersDeclareDifferentlyIsAMismatch) {
  Job job;
  ASSERT_NO_FATAL_FAILURE(job.Start(HierConfig({0, 0, 1, 1})));
  OnEveryWorker(4, [&](uint32_t rank) {
    const uint64_t count = rank == 1 ? 1001 : 1000;
    auto h = job.worker(rank).Declare("shape", DataType::kFloat32, count);
    ASSERT_TRUE(h.ok());
    std::vector<std::byte> buf(count * 4);
    Status s = job.worker(rank).PushPull(*h, buf, {}).Wait(In(kOpTimeout));
    EXPECT_EQ(s.code(), Code::kMismatch) << "rank " << rank << ": " << s.ToString();
    EXPECT_NE(s.message().find("1001"), std::string::npos) << s.ToString();
  });
  job.FinishCleanly();
}

// Groups (fused members and members on their own) with priorities, servers on the workers'
// hosts (mixed placement): every member gets the host-order bits.
TEST(HierarchyTest, FusedGroupsWithPrioritiesAndServersOnTheWorkerHosts) {
  const std::vector<uint32_t> host_of = {0, 0, 1, 1};
  JobConfig config = HierConfig(host_of);
  config.per_server = [](size_t i, ServerOptions& o) {
    o.host_name = "host-" + std::to_string(i % 2) + "/server" + std::to_string(i);
  };
  Job job;
  ASSERT_NO_FATAL_FAILURE(job.Start(config));
  const std::vector<uint64_t> counts = {10, 700, 5000, 100000, 3};  // 100000: unfused
  std::vector<std::vector<std::vector<std::byte>>> in(counts.size()), out(counts.size());
  for (size_t m = 0; m < counts.size(); ++m) {
    in[m].resize(4);
    out[m].resize(4);
    for (uint32_t r = 0; r < 4; ++r) in[m][r] = Input(DataType::kFloat32, counts[m], 100 * m + r);
  }
  OnEveryWorker(4, [&](uint32_t rank) {
    std::vector<TensorHandle> handles;
    std::vector<std::vector<std::byte>> bufs;
    for (size_t m = 0; m < counts.size(); ++m) {
      auto h = job.worker(rank).Declare("g" + std::to_string(m), DataType::kFloat32, counts[m]);
      ASSERT_TRUE(h.ok());
      handles.push_back(*h);
      bufs.push_back(in[m][rank]);
    }
    std::vector<std::span<std::byte>> spans(bufs.begin(), bufs.end());
    for (int step = 0; step < 2; ++step) {
      auto copy = bufs;
      std::vector<std::span<std::byte>> s2(copy.begin(), copy.end());
      Status s = job.worker(rank)
                     .PushPullGroup(handles, s2, {.priority = step})
                     .Wait(In(kOpTimeout));
      ASSERT_TRUE(s.ok()) << s.ToString();
      for (size_t m = 0; m < counts.size(); ++m) out[m][rank] = copy[m];
    }
  });
  for (size_t m = 0; m < counts.size(); ++m) {
    const auto want = Expected(DataType::kFloat32, in[m], host_of, false, false, false);
    for (uint32_t r = 0; r < 4; ++r) EXPECT_TRUE(out[m][r] == want) << "member " << m << " rank " << r;
  }
  EXPECT_GT(job.worker(0).Stats().fused_ops, 0u);
  job.FinishCleanly();
}

// Failures: the same rules as the flat path and the same-host path.
TEST(HierarchyTest, ShutdownFailsTheWorkersOwnPendingOps) {
  ExpectShutdownFailsOwnPendingOps(HierConfig({0, 0, 1, 1}), 300000);
}

// A worker that leaves (a clean goodbye) before it pushes: its host's other worker and the
// other host's workers all fail within seconds, naming it, whether it is their partition's
// pusher or not (100000 elements: partitions pushed by both workers of each host).
TEST(HierarchyTest, AWorkerThatLeavesFailsEveryOtherWorkersPendingOpNamingIt) {
  Job job;
  ASSERT_NO_FATAL_FAILURE(job.Start(HierConfig({0, 0, 1, 1})));
  constexpr uint64_t kCount = 100000;
  std::vector<TensorHandle> t(4);
  for (uint32_t r = 0; r < 4; ++r) {
    auto h = job.worker(r).Declare("t", DataType::kFloat32, kCount);
    ASSERT_TRUE(h.ok());
    t[r] = *h;
  }
  std::vector<PushPullHandle> ops;
  for (uint32_t r : {0u, 2u, 3u}) ops.push_back(job.worker(r).PushPull(t[r], job.Buffer(kCount * 4)));
  EXPECT_EQ(ops[0].Wait(In(100ms)).code(), Code::kTimeout);
  const auto start = Clock::now();
  EXPECT_TRUE(job.worker(1).Shutdown(In(5s)).ok());
  for (PushPullHandle& op : ops) {
    Status s = op.Wait(In(5s));
    EXPECT_LT(Clock::now() - start, 5500ms);
    EXPECT_TRUE(s.code() == Code::kAborted || s.code() == Code::kPeerLost) << s.ToString();
    EXPECT_NE(s.message().find("worker 1"), std::string::npos) << s.message();
  }
}

TEST(HierarchyTest, SchedulerStopAbortsPendingOps) {
  ExpectSchedulerStopAbortsPendingOps(HierConfig({0, 0, 1, 1}));
}

// Regression (issue 41), as LocalPathTest.OneOpsVerdictGraceDoesNotStallTheOthers for host
// channels: rank 1 leaves while rank 0's two ops wait for its partitions in the host's segment;
// each of rank 0's ops waits up to the verdict grace (500 ms) for the job's failure, and that
// wait held the segment's drive, so the second ended 500 ms after the first. They end within
// 250 ms of each other.
TEST(HierarchyTest, OneOpsVerdictGraceDoesNotStallTheOthers) {
  Job job;
  ASSERT_NO_FATAL_FAILURE(job.Start(HierConfig({0, 0, 1, 1})));
  constexpr uint64_t kCount = 100000;  // partitions pushed by both workers of each host
  std::vector<TensorHandle> mine;
  for (const char* name : {"a", "b"}) {
    for (uint32_t r = 0; r < 4; ++r) {
      auto h = job.worker(r).Declare(name, DataType::kFloat32, kCount);
      ASSERT_TRUE(h.ok());
      if (r == 0) mine.push_back(*h);
    }
  }
  PushPullHandle a = job.worker(0).PushPull(mine[0], job.Buffer(kCount * 4));
  PushPullHandle b = job.worker(0).PushPull(mine[1], job.Buffer(kCount * 4));
  EXPECT_EQ(a.Wait(In(100ms)).code(), Code::kTimeout);
  EXPECT_TRUE(job.worker(1).Shutdown(In(5s)).ok());
  const test::TwoEnds ends = test::WaitBoth(a, b, In(5s));
  for (const Status& s : {ends.a, ends.b}) {
    EXPECT_TRUE(s.code() == Code::kAborted || s.code() == Code::kPeerLost) << s.ToString();
    EXPECT_NE(s.message().find("worker 1"), std::string::npos) << s.message();
  }
  const auto apart = ends.apart;
  EXPECT_LT(apart, 250ms) << "the two ops ended "
                          << std::chrono::duration_cast<std::chrono::milliseconds>(apart).count()
                          << " ms apart: one waited for the other's verdict grace";
}

// Failover of keys summed per host first (the default on multi-host jobs with several workers
// on a host). Each round of `keys` (one tensor each, of `count` elements of its dtype) on every
// rank, checked bit for bit against the host order; `hold_back`: the ranks of that host issue
// 300 ms after the others, who have pushed their host's partials by then, and `between` runs
// meanwhile, once per round (a server stopped, or one added).
class HostSummedFailover {
 public:
  HostSummedFailover(Job& job, std::vector<uint32_t> host_of, uint64_t count)
      : job_(job), host_of_(std::move(host_of)), count_(count) {}

  void Declare(const std::string& name, DataType t) {
    std::vector<TensorHandle> handles(host_of_.size());
    OnEveryWorker(static_cast<uint32_t>(host_of_.size()), [&](uint32_t rank) {
      auto h = job_.worker(rank).Declare(name, t, count_);
      ASSERT_TRUE(h.ok()) << h.status().ToString();
      handles[rank] = *h;
    });
    keys_.push_back({t, std::move(handles)});
  }

  void Round(uint64_t round, std::optional<uint32_t> hold_back = std::nullopt,
             const std::function<void()>& between = {}) {
    const uint32_t n = static_cast<uint32_t>(host_of_.size());
    for (const Key& key : keys_) {
      std::vector<std::vector<std::byte>> in(n), out(n);
      for (uint32_t r = 0; r < n; ++r) {
        in[r] = Input(key.dtype, count_, static_cast<uint32_t>(1000 * round + 11 * r + 5));
        out[r] = in[r];
      }
      std::vector<PushPullHandle> ops(n);
      const auto issue = [&](bool held) {
        for (uint32_t r = 0; r < n; ++r) {
          const bool is_held = hold_back && host_of_[r] == *hold_back;
          if (is_held == held) ops[r] = job_.worker(r).PushPull(key.handles[r], out[r]);
        }
      };
      issue(false);
      if (hold_back) {
        std::this_thread::sleep_for(200ms);  // the other hosts' partials are pushed by now
        if (between && &key == &keys_.front()) between();  // once per round
        std::this_thread::sleep_for(100ms);
      }
      issue(true);
      const auto want = Expected(key.dtype, in, host_of_, false, false, false);
      for (uint32_t r = 0; r < n; ++r) {
        const Status s = ops[r].Wait(In(kOpTimeout));
        ASSERT_TRUE(s.ok()) << "rank " << r << " round " << round << ": " << s.ToString();
        EXPECT_TRUE(out[r] == want) << DataTypeName(key.dtype) << " rank " << r << " round "
                                    << round << ": not the host order's bits";
      }
    }
  }

 private:
  struct Key {
    DataType dtype;
    std::vector<TensorHandle> handles;
  };
  Job& job_;
  const std::vector<uint32_t> host_of_;
  const uint64_t count_;
  std::vector<Key> keys_;
};

// A server lost while the other host's partials wait on it: its partitions of host-summed keys
// (fp32, and fp16 with fp32 partials) move to the servers left; each host's pusher reports the
// host's last result and pushes the host's partial again; every rank gets the host order's bits
// in that round and the ones after, as without the loss. A second loss between rounds too.
TEST(HierarchyTest, ALostServerMovesHostSummedKeysWithoutLosingARound) {
  const std::vector<uint32_t> host_of = {0, 0, 1, 1};
  Job job;
  ASSERT_NO_FATAL_FAILURE(job.Start(HierConfig(host_of, 4)));
  constexpr uint64_t kCount = 300000;  // 147 partitions of 8 KiB per fp32 key
  HostSummedFailover rounds(job, host_of, kCount);
  ASSERT_NO_FATAL_FAILURE(rounds.Declare("grad32", DataType::kFloat32));
  ASSERT_NO_FATAL_FAILURE(rounds.Declare("grad16", DataType::kFloat16));
  ASSERT_NO_FATAL_FAILURE(rounds.Round(0));
  // Server 1's partitions of both keys, each summed once in round 0.
  const uint64_t on_lost = job.server(1).stats().rounds_completed;
  ASSERT_GT(on_lost, 0u);
  ASSERT_NO_FATAL_FAILURE(rounds.Round(1, /*hold_back=*/1, [&] { job.server(1).Stop(); }));
  ASSERT_NO_FATAL_FAILURE(rounds.Round(2));
  uint64_t recovered = 0;
  for (uint32_t r = 0; r < host_of.size(); ++r) {
    const WorkerStats st = job.worker(r).Stats();
    EXPECT_EQ(st.servers_lost, 1u) << "rank " << r;
    recovered += st.partitions_recovered;
  }
  // Each moved partition reported once per host, by that host's pusher of it.
  EXPECT_EQ(recovered, 2 * on_lost);
  job.server(3).Stop();
  for (uint64_t round = 3; round < 5; ++round) ASSERT_NO_FATAL_FAILURE(rounds.Round(round));
  for (uint32_t r = 0; r < host_of.size(); ++r) {
    EXPECT_TRUE(job.worker(r).Shutdown(In(5s)).ok());
  }
  for (uint32_t s : {0u, 2u}) {
    const Status done = job.server(s).Wait(In(5s));
    EXPECT_TRUE(done.ok()) << "server " << s << ": " << done.ToString();
    EXPECT_EQ(job.server(s).stats().protocol_errors, 0u);
  }
  EXPECT_TRUE(job.scheduler().Wait(In(5s)).ok());
}

// A server joining the running job takes its share of host-summed keys too, mid-round: the
// partitions that move are answered by it from the hosts' reports, and every round keeps the
// host order's bits.
TEST(HierarchyTest, AJoiningServerTakesItsShareOfHostSummedKeys) {
  const std::vector<uint32_t> host_of = {0, 0, 0, 1};
  Job job;
  ASSERT_NO_FATAL_FAILURE(job.Start(HierConfig(host_of, 2)));
  HostSummedFailover rounds(job, host_of, 200000);
  ASSERT_NO_FATAL_FAILURE(rounds.Declare("grad32", DataType::kFloat32));
  ASSERT_NO_FATAL_FAILURE(rounds.Declare("gradbf16", DataType::kBFloat16));
  ASSERT_NO_FATAL_FAILURE(rounds.Round(0));
  std::optional<Result<size_t>> added;
  ASSERT_NO_FATAL_FAILURE(rounds.Round(1, /*hold_back=*/0, [&] { added = job.AddServer(); }));
  ASSERT_TRUE(added.has_value() && added->ok()) << (added ? added->status().ToString() : "");
  for (uint64_t round = 2; round < 4; ++round) ASSERT_NO_FATAL_FAILURE(rounds.Round(round));
  EXPECT_GT(job.server(**added).stats().rounds_completed, 0u);
  job.FinishCleanly();
}

}  // namespace
}  // namespace gradlink
