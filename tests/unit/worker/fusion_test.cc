// Worker::PushPullGroup (tensor fusion) in whole jobs in one process: a Scheduler, servers and
// workers on threads over the inproc fabric. Every member of every group is checked against a
// scalar reference; the workers' copy counters against what the fusion options imply. Every
// wait has a deadline: a test fails, it never hangs.
#include <gtest/gtest.h>

#include <bit>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "gradlink/server.h"
#include "gradlink/worker.h"
#include "unit/support/job_harness.h"

namespace gradlink {
namespace {

using namespace std::chrono_literals;
using test::In;
using test::Job;
using test::JobConfig;
using test::kAllTypes;
using test::kOpTimeout;
using test::OnEveryWorker;

// ---- Reference: small integers, exact in every dtype, and so are their sums and averages over
// 1, 2 or 4 workers (multiples of 1/4 below 64 in magnitude). ------------------------------------

int64_t Value(uint64_t tensor, uint64_t i, uint32_t rank, uint64_t round) {
  return static_cast<int64_t>((tensor * 31 + i * 7 + rank * 3 + round * 5) % 17) - 8;
}

// `v` (exactly representable) as bytes of `t`.
void Encode(DataType t, double v, std::byte* out) {
  switch (t) {
    case DataType::kFloat32: {
      const float f = static_cast<float>(v);
      std::memcpy(out, &f, 4);
      return;
    }
    case DataType::kFloat64: std::memcpy(out, &v, 8); return;
    case DataType::kBFloat16: {
      const uint16_t b = static_cast<uint16_t>(std::bit_cast<uint32_t>(static_cast<float>(v)) >> 16);
      std::memcpy(out, &b, 2);
      return;
    }
    case DataType::kFloat16: {
      uint16_t h = 0;
      if (v != 0) {
        int e = 0;
        const double m = std::frexp(std::fabs(v), &e);  // |v| = m * 2^e, m in [0.5, 1)
        h = static_cast<uint16_t>((v < 0 ? 0x8000 : 0) | ((e - 1 + 15) << 10) |
                                  static_cast<uint16_t>((m * 2 - 1) * 1024));
      }
      std::memcpy(out, &h, 2);
      return;
    }
    case DataType::kInt32: {
      const int32_t x = static_cast<int32_t>(v);
      std::memcpy(out, &x, 4);
      return;
    }
    case DataType::kInt64: {
      const int64_t x = static_cast<int64_t>(v);
      std::memcpy(out, &x, 8);
      return;
    }
  }
}

void Fill(DataType t, uint64_t tensor, uint32_t rank, uint64_t round, std::span<std::byte> buf) {
  const size_t sz = DataTypeSize(t);
  for (uint64_t i = 0; i < buf.size() / sz; ++i) {
    Encode(t, static_cast<double>(Value(tensor, i, rank, round)), buf.data() + i * sz);
  }
}

// Sum over the workers in a scalar loop; averages divide as the definition says (integers
// truncate toward zero).
::testing::AssertionResult Check(DataType t, uint64_t tensor, uint32_t workers, uint64_t round,
                                 bool average, std::span<const std::byte> got) {
  const size_t sz = DataTypeSize(t);
  for (uint64_t i = 0; i < got.size() / sz; ++i) {
    int64_t sum = 0;
    for (uint32_t r = 0; r < workers; ++r) sum += Value(tensor, i, r, round);
    double want = static_cast<double>(sum);
    if (average) {
      want = (t == DataType::kInt32 || t == DataType::kInt64)
                 ? static_cast<double>(sum / static_cast<int64_t>(workers))
                 : want / workers;
    }
    std::byte w[8];
    Encode(t, want, w);
    if (std::memcmp(w, got.data() + i * sz, sz) != 0) {
      return ::testing::AssertionFailure() << DataTypeName(t) << " tensor " << tensor
                                           << " element " << i << " round " << round
                                           << ": expected " << want;
    }
  }
  return ::testing::AssertionSuccess();
}

// ---- A fusion job -------------------------------------------------------------------------------

// JobConfig with this suite's defaults: two servers, so that a group's fused tensors spread.
JobConfig FusionConfig() {
  JobConfig c;
  c.servers = 2;
  c.job = "fusion-test";
  return c;
}

struct Spec {
  std::string name;
  DataType dtype;
  uint64_t count;
  uint64_t bytes() const { return count * DataTypeSize(dtype); }
};

// Every worker declares `specs`, then for each round fills every member, pushes them all as one
// group, waits, and checks every element. Returns nothing; failures are test failures.
// Declares `specs` on `w` and gives each a zeroed buffer owned by `job`; a refused declaration
// fails the test (call with ASSERT_NO_FATAL_FAILURE).
void DeclareAll(Job& job, Worker& w, const std::vector<Spec>& specs,
                std::vector<TensorHandle>* handles, std::vector<std::span<std::byte>>* bufs) {
  for (const Spec& s : specs) {
    Result<TensorHandle> t = w.Declare(s.name, s.dtype, s.count);
    ASSERT_TRUE(t.ok()) << "'" << s.name << "': " << t.status().ToString();
    handles->push_back(*t);
    bufs->push_back(job.Buffer(s.bytes()));
  }
}

void RunGroupRounds(Job& job, const std::vector<Spec>& specs, uint64_t rounds,
                    bool average = false) {
  const uint32_t workers = job.config().workers;
  OnEveryWorker(workers, [&](uint32_t rank) {
    Worker& w = job.worker(rank);
    std::vector<TensorHandle> handles;
    std::vector<std::span<std::byte>> bufs;
    ASSERT_NO_FATAL_FAILURE(DeclareAll(job, w, specs, &handles, &bufs));
    for (uint64_t round = 0; round < rounds; ++round) {
      for (size_t i = 0; i < specs.size(); ++i) Fill(specs[i].dtype, i, rank, round, bufs[i]);
      PushPullHandle h = w.PushPullGroup(handles, bufs, {.average = average});
      Status s = h.Wait(In(kOpTimeout));
      ASSERT_TRUE(s.ok()) << "rank " << rank << " round " << round << ": " << s.ToString();
      EXPECT_TRUE(h.Poll());
      for (size_t i = 0; i < specs.size(); ++i) {
        ASSERT_TRUE(Check(specs[i].dtype, i, workers, round, average, bufs[i]))
            << "rank " << rank << " '" << specs[i].name << "'";
      }
    }
  });
}

std::vector<Spec> Uniform(const std::string& prefix, int n, DataType t, uint64_t count) {
  std::vector<Spec> v;
  for (int i = 0; i < n; ++i) v.push_back({prefix + std::to_string(i), t, count});
  return v;
}

// ---- Exact sums --------------------------------------------------------------------------------

TEST(FusionTest, ManySmallTensorsOfSeveralDtypesAndSizes) {
  JobConfig c = FusionConfig();
  c.workers = 2;
  c.servers = 2;
  c.fusion_buffer_bytes = 32 << 10;  // many buffers per group
  c.fusion_threshold_bytes = 8 << 10;
  Job job;
  ASSERT_NO_FATAL_FAILURE(job.Start(c));
  std::mt19937 rng(7);
  std::vector<Spec> specs;
  uint64_t total = 0;
  for (int i = 0; i < 300; ++i) {
    const DataType t = kAllTypes[rng() % 6];
    // Mostly small, some above the threshold, a few empty or of one element.
    const uint64_t count = i % 50 == 7 ? 0 : i % 37 == 3 ? 1 + rng() % 6000 : 1 + rng() % 700;
    specs.push_back({"layer" + std::to_string(i) + ".grad", t, count});
    total += specs.back().bytes();
  }
  const uint64_t rounds = 3;
  RunGroupRounds(job, specs, rounds);
  for (uint32_t r = 0; r < c.workers; ++r) {
    const WorkerStats s = job.worker(r).Stats();
    EXPECT_EQ(s.groups, rounds);
    EXPECT_EQ(s.push_pulls, specs.size() * rounds);
    EXPECT_EQ(s.bytes_reduced, total * rounds);
    EXPECT_GT(s.fused_ops, 6 * rounds);  // at least one buffer per dtype, and splits
    EXPECT_EQ(s.bytes_packed, s.bytes_unpacked);
    EXPECT_GT(s.bytes_packed, 0u);
    EXPECT_LT(s.bytes_packed, total * rounds);  // the large members went unfused
  }
}

TEST(FusionTest, GroupSplitAcrossBuffersInMemberOrder) {
  JobConfig c = FusionConfig();
  c.servers = 1;
  c.fusion_buffer_bytes = 4096;
  Job job;
  ASSERT_NO_FATAL_FAILURE(job.Start(c));
  // 40 members of 1000 bytes: 4 per 4096-byte buffer, so 10 fused tensors a round.
  const auto specs = Uniform("s", 40, DataType::kFloat32, 250);
  RunGroupRounds(job, specs, 4);
  for (uint32_t r = 0; r < 2; ++r) {
    const WorkerStats s = job.worker(r).Stats();
    EXPECT_EQ(s.fused_ops, 10u * 4);
    EXPECT_EQ(s.bytes_packed, 40000u * 4);
    EXPECT_EQ(s.bytes_unpacked, 40000u * 4);
    EXPECT_EQ(s.bytes_reduced, 40000u * 4);
  }
  EXPECT_EQ(job.server(0).stats().rounds_completed, 10u * 4);
}

TEST(FusionTest, LargeMemberGoesUnfusedWithoutACopy) {
  JobConfig c = FusionConfig();
  c.fusion_threshold_bytes = 64 << 10;
  Job job;
  ASSERT_NO_FATAL_FAILURE(job.Start(c));
  std::vector<Spec> specs = {{"a", DataType::kFloat32, 100},
                             {"big", DataType::kFloat32, 16 << 10},  // exactly the threshold
                             {"b", DataType::kFloat32, 300},
                             {"c", DataType::kFloat32, 7}};
  RunGroupRounds(job, specs, 3);
  for (uint32_t r = 0; r < 2; ++r) {
    const WorkerStats s = job.worker(r).Stats();
    EXPECT_EQ(s.fused_ops, 3u);
    EXPECT_EQ(s.bytes_packed, (100u + 300 + 7) * 4 * 3);
    EXPECT_EQ(s.bytes_reduced, (100u + (16 << 10) + 300 + 7) * 4 * 3);
  }
}

TEST(FusionTest, OneFusedTensorPerDtype) {
  JobConfig c = FusionConfig();
  Job job;
  ASSERT_NO_FATAL_FAILURE(job.Start(c));
  std::vector<Spec> specs;
  for (int i = 0; i < 30; ++i) {
    specs.push_back({"m" + std::to_string(i), kAllTypes[i % 6], uint64_t(10 + i)});
  }
  RunGroupRounds(job, specs, 2);
  for (uint32_t r = 0; r < 2; ++r) EXPECT_EQ(job.worker(r).Stats().fused_ops, 6u * 2);
}

TEST(FusionTest, AverageOverFourWorkers) {
  JobConfig c = FusionConfig();
  c.workers = 4;
  c.servers = 2;
  Job job;
  ASSERT_NO_FATAL_FAILURE(job.Start(c));
  std::vector<Spec> specs;
  for (int i = 0; i < 24; ++i) {
    specs.push_back({"avg" + std::to_string(i), kAllTypes[i % 6], uint64_t(1 + 37 * i)});
  }
  RunGroupRounds(job, specs, 2, /*average=*/true);
}

TEST(FusionTest, DisabledFusionPushesEveryMemberOnItsOwn) {
  JobConfig c = FusionConfig();
  c.fusion_buffer_bytes = 0;
  Job job;
  ASSERT_NO_FATAL_FAILURE(job.Start(c));
  const auto specs = Uniform("d", 20, DataType::kInt64, 33);
  RunGroupRounds(job, specs, 2);
  for (uint32_t r = 0; r < 2; ++r) {
    const WorkerStats s = job.worker(r).Stats();
    EXPECT_EQ(s.fused_ops, 0u);
    EXPECT_EQ(s.bytes_packed, 0u);
    EXPECT_EQ(s.push_pulls, 40u);
  }
}

TEST(FusionTest, TwoRoundsInFlightOnOneLayoutRunInCallOrder) {
  JobConfig c = FusionConfig();
  Job job;
  ASSERT_NO_FATAL_FAILURE(job.Start(c));
  const auto specs = Uniform("q", 16, DataType::kFloat32, 64);
  OnEveryWorker(c.workers, [&](uint32_t rank) {
    Worker& w = job.worker(rank);
    std::vector<TensorHandle> handles;
    std::vector<std::span<std::byte>> bufs[3];
    for (const Spec& s : specs) handles.push_back(*w.Declare(s.name, s.dtype, s.count));
    std::vector<PushPullHandle> ops;
    for (uint64_t round = 0; round < 3; ++round) {
      for (size_t i = 0; i < specs.size(); ++i) {
        bufs[round].push_back(job.Buffer(specs[i].bytes()));
        Fill(specs[i].dtype, i, rank, round, bufs[round][i]);
      }
      ops.push_back(w.PushPullGroup(handles, bufs[round]));
    }
    for (uint64_t round = 0; round < 3; ++round) {
      ASSERT_TRUE(ops[round].Wait(In(kOpTimeout)).ok());
      for (size_t i = 0; i < specs.size(); ++i) {
        EXPECT_TRUE(Check(specs[i].dtype, i, 2, round, false, bufs[round][i]));
      }
    }
  });
}

TEST(FusionTest, TimingStagesAddUp) {
  JobConfig c = FusionConfig();
  Job job;
  ASSERT_NO_FATAL_FAILURE(job.Start(c));
  const auto specs = Uniform("t", 50, DataType::kFloat32, 512);
  OnEveryWorker(c.workers, [&](uint32_t rank) {
    Worker& w = job.worker(rank);
    std::vector<TensorHandle> handles;
    std::vector<std::span<std::byte>> bufs;
    ASSERT_NO_FATAL_FAILURE(DeclareAll(job, w, specs, &handles, &bufs));
    const auto t0 = Clock::now();
    PushPullHandle h = w.PushPullGroup(handles, bufs);
    EXPECT_EQ(h.Timing().total, Clock::duration::zero());  // not known before the end
    ASSERT_TRUE(h.Wait(In(kOpTimeout)).ok());
    const auto wall = Clock::now() - t0;
    const PushPullTiming t = h.Timing();
    EXPECT_GT(t.total, Clock::duration::zero());
    EXPECT_LE(t.total, wall);
    EXPECT_GT(t.pack, Clock::duration::zero());
    EXPECT_EQ(t.pack + t.queue + t.push + t.reduce + t.pull + t.unpack, t.total);
    // A plain PushPull: no pack or unpack.
    PushPullHandle p = w.PushPull(handles[0], bufs[0]);
    ASSERT_TRUE(p.Wait(In(kOpTimeout)).ok());
    const PushPullTiming u = p.Timing();
    EXPECT_EQ(u.pack, Clock::duration::zero());
    EXPECT_EQ(u.unpack, Clock::duration::zero());
    EXPECT_GT(u.total, Clock::duration::zero());
    EXPECT_EQ(u.queue + u.push + u.reduce + u.pull, u.total);
    EXPECT_LE(u.server, u.total);
  });
}

// The servers' own time on a round reaches the worker's timing (from their clocks, in each
// pull reply): nonzero where summing 64 KiB partitions of two workers takes microseconds, and
// never more than the whole operation.
TEST(FusionTest, TimingCarriesTheServersOwnTime) {
  JobConfig c = FusionConfig();
  Job job;
  ASSERT_NO_FATAL_FAILURE(job.Start(c));
  OnEveryWorker(c.workers, [&](uint32_t rank) {
    Worker& w = job.worker(rank);
    const uint64_t n = 1 << 20;
    auto t = w.Declare("big", DataType::kFloat32, n);
    ASSERT_TRUE(t.ok());
    std::vector<std::byte>& buf = job.Buffer(n * 4);
    PushPullHandle h = w.PushPull(*t, buf);
    ASSERT_TRUE(h.Wait(In(kOpTimeout)).ok());
    const PushPullTiming timing = h.Timing();
    EXPECT_GT(timing.server, Clock::duration::zero()) << "rank " << rank;
    EXPECT_LE(timing.server, timing.total) << "rank " << rank;
  });
}

// ---- Errors ------------------------------------------------------------------------------------

TEST(FusionTest, BadArgumentsFailAtOnce) {
  JobConfig c = FusionConfig();
  c.workers = 1;
  c.servers = 1;
  Job job;
  ASSERT_NO_FATAL_FAILURE(job.Start(c));
  Worker& w = job.worker(0);
  TensorHandle a = *w.Declare("a", DataType::kFloat32, 10);
  TensorHandle b = *w.Declare("b", DataType::kFloat32, 20);
  std::span<std::byte> ba = job.Buffer(40), bb = job.Buffer(80), small = job.Buffer(79);
  auto expect_invalid = [&](std::vector<TensorHandle> t, std::vector<std::span<std::byte>> d,
                            const std::string& what) {
    const auto start = Clock::now();
    PushPullHandle h = w.PushPullGroup(t, d);
    EXPECT_TRUE(h.Poll());
    Status s = h.Wait(In(1s));
    EXPECT_EQ(s.code(), Code::kInvalidArgument) << s.ToString();
    EXPECT_NE(s.message().find(what), std::string::npos) << s.message();
    EXPECT_LT(Clock::now() - start, 1s);
  };
  expect_invalid({a, b}, {ba}, "2 tensors but 1 buffers");
  expect_invalid({a, TensorHandle()}, {ba, bb}, "member 1 is not a declared tensor");
  expect_invalid({a, b}, {ba, small}, "'b'");
  expect_invalid({a, b, a}, {ba, bb, ba}, "'a' is in the group twice");
  // An empty group completes at once; the members still work.
  EXPECT_TRUE(w.PushPullGroup({}, {}).Wait(In(1s)).ok());
  std::vector<TensorHandle> t = {a, b};
  std::vector<std::span<std::byte>> d = {ba, bb};
  Fill(DataType::kFloat32, 0, 0, 0, ba);
  Fill(DataType::kFloat32, 1, 0, 0, bb);
  ASSERT_TRUE(w.PushPullGroup(t, d).Wait(In(kOpTimeout)).ok());
  EXPECT_TRUE(Check(DataType::kFloat32, 0, 1, 0, false, ba));
  EXPECT_TRUE(Check(DataType::kFloat32, 1, 1, 0, false, bb));
}

TEST(FusionTest, WorkersThatGroupDifferentlyGetATimeoutNotAWrongSum) {
  JobConfig c = FusionConfig();
  Job job;
  ASSERT_NO_FATAL_FAILURE(job.Start(c));
  const auto specs = Uniform("g", 6, DataType::kFloat32, 100);
  std::vector<PushPullHandle> pending[2];
  OnEveryWorker(c.workers, [&](uint32_t rank) {
    Worker& w = job.worker(rank);
    std::vector<TensorHandle> handles;
    std::vector<std::span<std::byte>> bufs;
    ASSERT_NO_FATAL_FAILURE(DeclareAll(job, w, specs, &handles, &bufs));
    for (size_t i = 0; i < specs.size(); ++i) Fill(specs[i].dtype, i, rank, 0, bufs[i]);
    // Rank 0: one group of six. Rank 1: the same six in another order.
    if (rank == 1) {
      std::swap(handles[1], handles[2]);
      std::swap(bufs[1], bufs[2]);
    }
    const auto start = Clock::now();
    PushPullHandle h = w.PushPullGroup(handles, bufs);
    Status s = h.Wait(In(1500ms));
    EXPECT_EQ(s.code(), Code::kTimeout) << s.ToString();
    EXPECT_NE(s.message().find("group the same tensors the same way"), std::string::npos)
        << s.message();
    EXPECT_NE(s.message().find("gradlink.fused/fp32/6/"), std::string::npos) << s.message();
    EXPECT_LT(Clock::now() - start, 5s);
    pending[rank].push_back(h);
  });
  // Shutting down ends the pending groups with kAborted, promptly.
  for (uint32_t r = 0; r < 2; ++r) {
    ASSERT_TRUE(job.worker(r).Shutdown(In(5s)).ok());
    Status s = pending[r][0].Wait(In(5s));
    EXPECT_EQ(s.code(), Code::kAborted) << s.ToString();
  }
}

TEST(FusionTest, MemberShapeMismatchFailsTheGroupOnEveryRank) {
  JobConfig c = FusionConfig();
  Job job;
  ASSERT_NO_FATAL_FAILURE(job.Start(c));
  const auto start = Clock::now();
  OnEveryWorker(c.workers, [&](uint32_t rank) {
    Worker& w = job.worker(rank);
    std::vector<TensorHandle> handles = {*w.Declare("ok1", DataType::kFloat32, 10),
                                         *w.Declare("bad", DataType::kFloat32, rank ? 12 : 10),
                                         *w.Declare("ok2", DataType::kFloat32, 10)};
    std::vector<std::span<std::byte>> bufs;
    for (const TensorHandle& t : handles) bufs.push_back(job.Buffer(t.count() * 4));
    Status s = w.PushPullGroup(handles, bufs).Wait(In(5s));
    ASSERT_EQ(s.code(), Code::kMismatch) << "rank " << rank << ": " << s.ToString();
    EXPECT_NE(s.message().find("member 'bad'"), std::string::npos) << s.message();
    EXPECT_NE(s.message().find("rank 1"), std::string::npos) << s.message();
    EXPECT_NE(s.message().find("fused tensor 'gradlink.fused/fp32/3/"), std::string::npos)
        << s.message();
    // Later calls fail at once with the same error.
    Status again = w.PushPullGroup(handles, bufs).Wait(In(1s));
    EXPECT_EQ(again.code(), Code::kMismatch) << again.ToString();
  });
  EXPECT_LT(Clock::now() - start, 5s);
  // The job goes on.
  RunGroupRounds(job, Uniform("after", 5, DataType::kInt32, 9), 2);
}

TEST(FusionTest, DroppedHandleLeavesTheJobWorking) {
  JobConfig c = FusionConfig();
  Job job;
  ASSERT_NO_FATAL_FAILURE(job.Start(c));
  const auto specs = Uniform("h", 10, DataType::kFloat64, 50);
  OnEveryWorker(c.workers, [&](uint32_t rank) {
    Worker& w = job.worker(rank);
    std::vector<TensorHandle> handles;
    std::vector<std::span<std::byte>> bufs;
    ASSERT_NO_FATAL_FAILURE(DeclareAll(job, w, specs, &handles, &bufs));
    // Rank 0 drops its first handle at once (its fusion buffer stays with the operation).
    w.PushPullGroup(handles, bufs);
    if (rank == 1) std::this_thread::sleep_for(50ms);
    for (size_t i = 0; i < specs.size(); ++i) Fill(specs[i].dtype, i, rank, 1, bufs[i]);
    ASSERT_TRUE(w.PushPullGroup(handles, bufs).Wait(In(kOpTimeout)).ok());
    for (size_t i = 0; i < specs.size(); ++i) {
      EXPECT_TRUE(Check(specs[i].dtype, i, 2, 1, false, bufs[i]));
    }
  });
}

}  // namespace
}  // namespace gradlink
