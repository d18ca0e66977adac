// Worker::DeclareCollective / Run: broadcast, allgather, reduce-scatter, all-to-all and the
// min / max / product reductions through real scheduler and servers (inproc fabric), every
// dtype, against scalar references: a routed element must be its source rank's bytes exactly;
// a reduced one the reference fold in rank order. Small partitions make every segment span
// several partitions and servers. Every wait has a deadline.
#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>
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
using test::kAllTypes;
using test::kOpTimeout;
using test::OnEveryWorker;

constexpr uint64_t kElems = 300;  // per segment, about: 64-byte partitions cut it many times

JobConfig Config(uint32_t workers, uint32_t servers = 2) {
  JobConfig c;
  c.workers = workers;
  c.servers = servers;
  c.partition_bytes = 64;
  return c;
}

std::vector<std::byte> Filled(DataType t, uint64_t tensor, uint32_t rank, uint64_t count) {
  std::vector<std::byte> b(count * DataTypeSize(t));
  test::FillTensor(t, tensor, rank, 0, b);
  return b;
}

// Element i of what `rank` filled (Filled), as bytes.
std::vector<std::byte> Elem(DataType t, uint64_t tensor, uint32_t rank, uint64_t i) {
  std::vector<std::byte> b(DataTypeSize(t));
  test::FillValue(t, tensor, rank, 0, i, b.data());
  return b;
}

::testing::AssertionResult SameAt(const std::vector<std::byte>& got, uint64_t at,
                                  const std::vector<std::byte>& want, const std::string& what) {
  if (std::memcmp(got.data() + at * want.size(), want.data(), want.size()) == 0) {
    return ::testing::AssertionSuccess();
  }
  return ::testing::AssertionFailure() << what << ": element " << at << " differs";
}

Status RunOn(Worker& w, const std::string& name, DataType t, uint64_t count,
             const CollectiveSpec& spec, std::vector<std::byte>& in, std::vector<std::byte>& out,
             bool average = false) {
  auto h = w.DeclareCollective(name, t, count, spec);
  if (!h.ok()) return h.status();
  out.assign(h->output_count() * DataTypeSize(t), std::byte{0x5a});
  return w.Run(*h, in, out, {.average = average}).Wait(In(kOpTimeout));
}

TEST(CollectiveTest, BroadcastFromEveryRootInEveryDtype) {
  Job job;
  ASSERT_NO_FATAL_FAILURE(job.Start(Config(3)));
  for (DataType t : kAllTypes) {
    for (uint32_t root = 0; root < 3; ++root) {
      const std::string name = "bcast." + std::string(DataTypeName(t)) + "." + std::to_string(root);
      OnEveryWorker(3, [&](uint32_t r) {
        std::vector<std::byte> in = Filled(t, root, r, kElems), out;
        CollectiveSpec spec{.kind = Collective::kBroadcast, .root = root};
        ASSERT_TRUE(RunOn(job.worker(r), name, t, kElems, spec, in, out).ok()) << name;
        for (uint64_t i = 0; i < kElems; ++i) {
          ASSERT_TRUE(SameAt(out, i, Elem(t, root, root, i), name + " on rank " + std::to_string(r)));
        }
      });
    }
  }
  // In place, as Horovod's broadcast_: the non-roots' buffers are overwritten.
  OnEveryWorker(3, [&](uint32_t r) {
    std::vector<std::byte> buf = Filled(DataType::kFloat32, 9, r, kElems);
    auto h = job.worker(r).DeclareCollective("bcast.inplace", DataType::kFloat32, kElems,
                                             {.kind = Collective::kBroadcast, .root = 1});
    ASSERT_TRUE(h.ok());
    ASSERT_TRUE(job.worker(r).Run(*h, buf, buf).Wait(In(kOpTimeout)).ok());
    EXPECT_EQ(buf, Filled(DataType::kFloat32, 9, 1, kElems));
  });
  job.FinishCleanly();
}

TEST(CollectiveTest, AllgatherOfUnevenParts) {
  Job job;
  ASSERT_NO_FATAL_FAILURE(job.Start(Config(4)));
  const std::vector<uint64_t> counts = {kElems, 0, 7, 2 * kElems};  // one rank gives nothing
  const uint64_t total = std::accumulate(counts.begin(), counts.end(), uint64_t{0});
  for (DataType t : kAllTypes) {
    const std::string name = "gather." + std::string(DataTypeName(t));
    OnEveryWorker(4, [&](uint32_t r) {
      std::vector<std::byte> in = Filled(t, 3, r, counts[r]), out;
      CollectiveSpec spec{.kind = Collective::kAllgather, .counts = counts};
      ASSERT_TRUE(RunOn(job.worker(r), name, t, total, spec, in, out).ok()) << name;
      uint64_t at = 0;
      for (uint32_t src = 0; src < 4; ++src) {
        for (uint64_t i = 0; i < counts[src]; ++i) {
          ASSERT_TRUE(SameAt(out, at + i, Elem(t, 3, src, i), name + " from rank " + std::to_string(src)));
        }
        at += counts[src];
      }
    });
  }
  job.FinishCleanly();
}

TEST(CollectiveTest, ReduceScatterSumsAndAverages) {
  Job job;
  ASSERT_NO_FATAL_FAILURE(job.Start(Config(3)));
  const std::vector<uint64_t> counts = {kElems, 5, 0};
  const uint64_t total = kElems + 5;
  for (DataType t : kAllTypes) {
    for (bool average : {false, true}) {
      const std::string name = "rs." + std::string(DataTypeName(t)) + (average ? ".avg" : "");
      OnEveryWorker(3, [&](uint32_t r) {
        std::vector<std::byte> in(total * DataTypeSize(t)), out;
        test::FillTensor(t, 4, r, 0, in);
        CollectiveSpec spec{.kind = Collective::kReduceScatter, .counts = counts};
        ASSERT_TRUE(RunOn(job.worker(r), name, t, total, spec, in, out, average).ok()) << name;
        const uint64_t first = r == 0 ? 0 : r == 1 ? kElems : total;
        std::vector<std::byte> want(DataTypeSize(t));
        for (uint64_t i = 0; i < counts[r]; ++i) {
          test::ExpectedValue(t, 4, 3, 0, first + i, average, want.data());
          ASSERT_TRUE(SameAt(out, i, want, name + " on rank " + std::to_string(r)));
        }
      });
    }
  }
  job.FinishCleanly();
}

TEST(CollectiveTest, AlltoallWithSplits) {
  Job job;
  ASSERT_NO_FATAL_FAILURE(job.Start(Config(3)));
  // counts[i * 3 + j]: what rank i sends rank j, zeros and the diagonal included.
  const std::vector<uint64_t> counts = {3, 40, 0, 17, 0, kElems, 1, 2, 9};
  const uint64_t total = std::accumulate(counts.begin(), counts.end(), uint64_t{0});
  for (DataType t : kAllTypes) {
    const std::string name = "a2a." + std::string(DataTypeName(t));
    OnEveryWorker(3, [&](uint32_t r) {
      const uint64_t sends = counts[r * 3] + counts[r * 3 + 1] + counts[r * 3 + 2];
      std::vector<std::byte> in = Filled(t, 5, r, sends), out;
      CollectiveSpec spec{.kind = Collective::kAlltoall, .counts = counts};
      ASSERT_TRUE(RunOn(job.worker(r), name, t, total, spec, in, out).ok()) << name;
      ASSERT_EQ(out.size(), (counts[r] + counts[3 + r] + counts[6 + r]) * DataTypeSize(t));
      uint64_t at = 0;
      for (uint32_t src = 0; src < 3; ++src) {
        // Rank src's block for r starts after what src sends ranks 0 .. r-1.
        uint64_t from = 0;
        for (uint32_t j = 0; j < r; ++j) from += counts[src * 3 + j];
        for (uint64_t i = 0; i < counts[src * 3 + r]; ++i) {
          ASSERT_TRUE(SameAt(out, at + i, Elem(t, 5, src, from + i),
                             name + " from rank " + std::to_string(src) + " on rank " + std::to_string(r)));
        }
        at += counts[src * 3 + r];
      }
    });
  }
  job.FinishCleanly();
}

// Small integers (exact in every dtype, and so are their products over 4 ranks).
double Small(uint32_t rank, uint64_t i) {
  const int v = static_cast<int>((i * 7 + rank * 5) % 7) - 3;  // -3 .. 3
  return v == 0 ? 1 : v;
}

void Put(DataType t, double v, std::byte* out) {
  switch (t) {
    case DataType::kFloat32: { const float f = static_cast<float>(v); std::memcpy(out, &f, 4); return; }
    case DataType::kFloat64: std::memcpy(out, &v, 8); return;
    case DataType::kFloat16: { const uint16_t h = test::RefFloatToHalf(static_cast<float>(v)); std::memcpy(out, &h, 2); return; }
    case DataType::kBFloat16: { const uint16_t b = test::RefFloatToBf16(static_cast<float>(v)); std::memcpy(out, &b, 2); return; }
    case DataType::kInt32: { const int32_t x = static_cast<int32_t>(v); std::memcpy(out, &x, 4); return; }
    case DataType::kInt64: { const int64_t x = static_cast<int64_t>(v); std::memcpy(out, &x, 8); return; }
  }
}

TEST(CollectiveTest, MinMaxProductInEveryDtype) {
  Job job;
  ASSERT_NO_FATAL_FAILURE(job.Start(Config(4)));
  for (ReduceOp op : {ReduceOp::kMin, ReduceOp::kMax, ReduceOp::kProduct}) {
    for (DataType t : kAllTypes) {
      const std::string name = std::string(ReduceOpName(op)) + "." + std::string(DataTypeName(t));
      const size_t sz = DataTypeSize(t);
      OnEveryWorker(4, [&](uint32_t r) {
        std::vector<std::byte> in(kElems * sz), out;
        for (uint64_t i = 0; i < kElems; ++i) Put(t, Small(r, i), in.data() + i * sz);
        CollectiveSpec spec{.kind = Collective::kAllreduce, .op = op};
        ASSERT_TRUE(RunOn(job.worker(r), name, t, kElems, spec, in, out).ok()) << name;
        std::vector<std::byte> want(sz);
        for (uint64_t i = 0; i < kElems; ++i) {
          double v = Small(0, i);
          for (uint32_t k = 1; k < 4; ++k) {
            const double x = Small(k, i);
            v = op == ReduceOp::kMin ? std::min(v, x) : op == ReduceOp::kMax ? std::max(v, x) : v * x;
          }
          Put(t, v, want.data());
          ASSERT_TRUE(SameAt(out, i, want, name));
        }
      });
    }
  }
  job.FinishCleanly();
}

TEST(CollectiveTest, MinMaxPropagateNanAndOrderZeros) {
  Job job;
  ASSERT_NO_FATAL_FAILURE(job.Start(Config(2)));
  const float nan = std::numeric_limits<float>::quiet_NaN();
  // Per element: rank 0's value, rank 1's.
  const std::vector<std::pair<float, float>> cases = {
      {nan, 1.0f}, {1.0f, nan}, {-0.0f, 0.0f}, {0.0f, -0.0f}, {-0.0f, -0.0f}, {2.0f, -5.0f}};
  for (ReduceOp op : {ReduceOp::kMin, ReduceOp::kMax}) {
    const std::string name = "zeros." + std::string(ReduceOpName(op));
    OnEveryWorker(2, [&](uint32_t r) {
      std::vector<float> mine;
      for (const auto& c : cases) mine.push_back(r == 0 ? c.first : c.second);
      std::vector<std::byte> in(mine.size() * 4), out;
      std::memcpy(in.data(), mine.data(), in.size());
      CollectiveSpec spec{.kind = Collective::kAllreduce, .op = op};
      ASSERT_TRUE(RunOn(job.worker(r), name, DataType::kFloat32, mine.size(), spec, in, out).ok());
      std::vector<float> got(mine.size());
      std::memcpy(got.data(), out.data(), out.size());
      EXPECT_TRUE(std::isnan(got[0]) && std::isnan(got[1])) << name;
      const bool min = op == ReduceOp::kMin;
      for (size_t i = 2; i < 5; ++i) {
        const bool negative = cases[i].first == 0 && (min ? (std::signbit(cases[i].first) || std::signbit(cases[i].second))
                                                         : (std::signbit(cases[i].first) && std::signbit(cases[i].second)));
        EXPECT_EQ(got[i], 0.0f);
        EXPECT_EQ(std::signbit(got[i]), negative) << name << " element " << i;
      }
      EXPECT_EQ(got[5], min ? -5.0f : 2.0f);
    });
  }
  job.FinishCleanly();
}

TEST(CollectiveTest, SpecsThatDisagreeAreAMismatchForEveryRank) {
  Job job;
  ASSERT_NO_FATAL_FAILURE(job.Start(Config(2)));
  OnEveryWorker(2, [&](uint32_t r) {
    // Rank 1 thinks rank 0 gathers 4 elements and itself 6; rank 0 says 6 and 4.
    const std::vector<uint64_t> counts = r == 0 ? std::vector<uint64_t>{6, 4} : std::vector<uint64_t>{4, 6};
    std::vector<std::byte> in(counts[r] * 4), out;
    CollectiveSpec spec{.kind = Collective::kAllgather, .counts = counts};
    Status s = RunOn(job.worker(r), "disagree", DataType::kFloat32, 10, spec, in, out);
    EXPECT_EQ(s.code(), Code::kMismatch) << s.ToString();
    EXPECT_NE(s.message().find("rank 1"), std::string::npos) << s.ToString();
    EXPECT_NE(s.message().find("allgather of [4, 6]"), std::string::npos) << s.ToString();
  });
  job.FinishCleanly();
}

TEST(CollectiveTest, BadSpecsAndBuffersAreRefusedNamingWhat) {
  Job job;
  ASSERT_NO_FATAL_FAILURE(job.Start(Config(2)));
  Worker& w = job.worker(0);
  auto bad_root = w.DeclareCollective("root", DataType::kFloat32, 4, {.kind = Collective::kBroadcast, .root = 2});
  EXPECT_EQ(bad_root.status().code(), Code::kInvalidArgument);
  EXPECT_NE(bad_root.status().message().find("rank 2"), std::string::npos);
  auto bad_sum = w.DeclareCollective("sum", DataType::kFloat32, 4,
                                     {.kind = Collective::kAllgather, .counts = {1, 2}});
  EXPECT_EQ(bad_sum.status().code(), Code::kInvalidArgument);
  EXPECT_NE(bad_sum.status().message().find("add up to 3"), std::string::npos);
  auto bad_op = w.DeclareCollective("op", DataType::kFloat32, 4,
                                    {.kind = Collective::kBroadcast, .op = ReduceOp::kMax});
  EXPECT_EQ(bad_op.status().code(), Code::kInvalidArgument);
  // Declared fine, run with the wrong buffers or an average it cannot have.
  OnEveryWorker(2, [&](uint32_t r) {
    auto h = job.worker(r).DeclareCollective("max", DataType::kFloat32, 4,
                                             {.kind = Collective::kAllreduce, .op = ReduceOp::kMax});
    ASSERT_TRUE(h.ok());
    std::vector<std::byte> in(16), out(12);
    Status s = job.worker(r).Run(*h, in, out).Wait(In(kOpTimeout));
    EXPECT_EQ(s.code(), Code::kInvalidArgument);
    EXPECT_NE(s.message().find("output of 12 bytes"), std::string::npos) << s.ToString();
    out.resize(16);
    s = job.worker(r).Run(*h, in, out, {.average = true}).Wait(In(kOpTimeout));
    EXPECT_EQ(s.code(), Code::kInvalidArgument);
    // Then a good run on the same key goes through: the refused ones never reached a server.
    float mine[4] = {1.0f * r, 5, -1, 2};
    std::memcpy(in.data(), mine, 16);
    ASSERT_TRUE(job.worker(r).Run(*h, in, out).Wait(In(kOpTimeout)).ok());
    float got[4];
    std::memcpy(got, out.data(), 16);
    EXPECT_EQ(got[0], 1.0f);
    EXPECT_EQ(got[1], 5.0f);
  });
  job.FinishCleanly();
}

TEST(CollectiveTest, OneWorkerJobCopiesLocally) {
  Job job;
  ASSERT_NO_FATAL_FAILURE(job.Start(Config(1, 1)));
  Worker& w = job.worker(0);
  std::vector<std::byte> in = Filled(DataType::kInt64, 6, 0, 50), out;
  ASSERT_TRUE(RunOn(w, "one.gather", DataType::kInt64, 50,
                    {.kind = Collective::kAllgather, .counts = {50}}, in, out).ok());
  EXPECT_EQ(out, in);
  ASSERT_TRUE(RunOn(w, "one.a2a", DataType::kInt64, 50,
                    {.kind = Collective::kAlltoall, .counts = {50}}, in, out).ok());
  EXPECT_EQ(out, in);
  ASSERT_TRUE(RunOn(w, "one.bcast", DataType::kInt64, 50, {.kind = Collective::kBroadcast}, in, out).ok());
  EXPECT_EQ(out, in);
  job.FinishCleanly();
}

// The same-host path (one host, the segment on) only sums: other collectives go through the
// servers beside it, and sums on the segment keep working.
TEST(CollectiveTest, BesideTheSameHostPath) {
  JobConfig c = Config(2, 1);
  c.local_arena_bytes = 8u << 20;
  Job job;
  ASSERT_NO_FATAL_FAILURE(job.Start(c));
  OnEveryWorker(2, [&](uint32_t r) {
    std::vector<std::byte> in = Filled(DataType::kFloat32, 7, r, kElems), out;
    ASSERT_TRUE(RunOn(job.worker(r), "local.bcast", DataType::kFloat32, kElems,
                      {.kind = Collective::kBroadcast, .root = 1}, in, out).ok());
    EXPECT_EQ(out, Filled(DataType::kFloat32, 7, 1, kElems));
    std::vector<std::byte> sum(kElems * 4);
    test::FillTensor(DataType::kFloat32, 8, r, 0, sum);
    auto h = job.worker(r).Declare("local.sum", DataType::kFloat32, kElems);
    ASSERT_TRUE(h.ok());
    ASSERT_TRUE(job.worker(r).PushPull(*h, sum).Wait(In(kOpTimeout)).ok());
    EXPECT_TRUE(test::CheckTensor(DataType::kFloat32, 8, 2, 0, false, sum));
  });
  job.FinishCleanly();
}

// Process sets: a key of a group is declared and run by its members only, with the group's
// positions and divisor; the other workers meanwhile run their own keys.
TEST(CollectiveTest, GroupsRunOverTheirMembersOnly) {
  Job job;
  ASSERT_NO_FATAL_FAILURE(job.Start(Config(4)));
  const std::vector<uint32_t> group = {1, 3};
  OnEveryWorker(4, [&](uint32_t r) {
    Worker& w = job.worker(r);
    if (r == 1 || r == 3) {
      const uint32_t pos = r == 1 ? 0 : 1;
      // Sum and average over the two members (divisor 2).
      std::vector<std::byte> in(kElems * 4), out;
      test::FillTensor(DataType::kFloat32, 11, pos, 0, in);
      for (bool average : {false, true}) {
        ASSERT_TRUE(RunOn(w, average ? "g.avg" : "g.sum", DataType::kFloat32, kElems,
                          {.kind = Collective::kAllreduce, .group = group}, in, out, average).ok());
        EXPECT_TRUE(test::CheckTensor(DataType::kFloat32, 11, 2, 0, average, out)) << r;
      }
      // Broadcast from position 1 (rank 3), allgather in position order.
      std::vector<std::byte> b = Filled(DataType::kInt64, 12, r, kElems);
      ASSERT_TRUE(RunOn(w, "g.bcast", DataType::kInt64, kElems,
                        {.kind = Collective::kBroadcast, .root = 1, .group = group}, b, out).ok());
      EXPECT_EQ(out, Filled(DataType::kInt64, 12, 3, kElems));
      std::vector<std::byte> piece = Filled(DataType::kInt32, 13, r, 10 + pos);
      ASSERT_TRUE(RunOn(w, "g.gather", DataType::kInt32, 21,
                        {.kind = Collective::kAllgather, .counts = {10, 11}, .group = group},
                        piece, out).ok());
      std::vector<std::byte> want = Filled(DataType::kInt32, 13, 1, 10);
      const auto second = Filled(DataType::kInt32, 13, 3, 11);
      want.insert(want.end(), second.begin(), second.end());
      EXPECT_EQ(out, want);
    } else {
      // Not a member: declaring the group's key is refused here, naming the group.
      auto h = w.DeclareCollective("g.sum", DataType::kFloat32, kElems,
                                   {.kind = Collective::kAllreduce, .group = group});
      EXPECT_EQ(h.status().code(), Code::kInvalidArgument);
      EXPECT_NE(h.status().message().find("in group [1, 3]"), std::string::npos)
          << h.status().ToString();
      // Its own key over the other pair goes on beside the group's.
      std::vector<std::byte> in = Filled(DataType::kFloat64, 14, r, kElems), out;
      ASSERT_TRUE(RunOn(w, "other.max", DataType::kFloat64, kElems,
                        {.kind = Collective::kAllreduce, .op = ReduceOp::kMax, .group = {0, 2}},
                        in, out).ok());
      std::vector<std::byte> a = Filled(DataType::kFloat64, 14, 0, kElems);
      std::vector<std::byte> c = Filled(DataType::kFloat64, 14, 2, kElems);
      for (uint64_t i = 0; i < kElems; ++i) {
        double x, y, got;
        std::memcpy(&x, a.data() + 8 * i, 8);
        std::memcpy(&y, c.data() + 8 * i, 8);
        std::memcpy(&got, out.data() + 8 * i, 8);
        ASSERT_EQ(got, std::max(x, y)) << i;
      }
    }
  });
  // Members that disagree on the group's counts: a kMismatch for both, naming them.
  OnEveryWorker(4, [&](uint32_t r) {
    if (r != 1 && r != 3) return;
    const std::vector<uint64_t> counts = r == 1 ? std::vector<uint64_t>{2, 2} : std::vector<uint64_t>{1, 3};
    std::vector<std::byte> in(counts[r == 1 ? 0 : 1] * 4), out;
    Status s = RunOn(job.worker(r), "g.bad", DataType::kFloat32, 4,
                     {.kind = Collective::kAllgather, .counts = counts, .group = group}, in, out);
    EXPECT_EQ(s.code(), Code::kMismatch) << s.ToString();
    EXPECT_NE(s.message().find("rank 3"), std::string::npos) << s.ToString();
  });
  job.FinishCleanly();
}

// Regression: with a lead (max_bytes_ahead) a receiver's request of 0 bytes was held behind its
// own pushes over the lead, while the pushes it waited on needed that request: an all-to-all
// of 4 workers hung (bench/collectives.py, gradlink's defaults). Requests are never held now,
// and only all-to-all pushes in turns (ranks pushing a reduce-scatter in different orders could
// hold back what each other's held partitions wait for).
TEST(CollectiveTest, RequestsAreNeverHeldBehindTheLead) {
  JobConfig c = Config(4);
  c.max_bytes_ahead = 128;  // two 64-byte partitions per server
  Job job;
  ASSERT_NO_FATAL_FAILURE(job.Start(c));
  std::vector<uint64_t> counts(16, 200);
  const uint64_t total = 16 * 200;
  OnEveryWorker(4, [&](uint32_t r) {
    for (int round = 0; round < 3; ++round) {
      std::vector<std::byte> in = Filled(DataType::kFloat32, 20 + round, r, 800), out;
      ASSERT_TRUE(RunOn(job.worker(r), "lead.a2a", DataType::kFloat32, total,
                        {.kind = Collective::kAlltoall, .counts = counts}, in, out).ok());
      for (uint32_t src = 0; src < 4; ++src) {
        for (uint64_t i = 0; i < 200; ++i) {
          ASSERT_TRUE(SameAt(out, src * 200 + i, Elem(DataType::kFloat32, 20 + round, src, r * 200 + i),
                             "a2a under a lead"));
        }
      }
      std::vector<std::byte> rsin(800 * 4), rsout;
      test::FillTensor(DataType::kFloat32, 30 + round, r, 0, rsin);
      ASSERT_TRUE(RunOn(job.worker(r), "lead.rs", DataType::kFloat32, 800,
                        {.kind = Collective::kReduceScatter, .counts = {200, 200, 200, 200}},
                        rsin, rsout).ok());
      std::vector<std::byte> want(4);
      for (uint64_t i = 0; i < 200; ++i) {
        test::ExpectedValue(DataType::kFloat32, 30 + round, 4, 0, r * 200 + i, false, want.data());
        ASSERT_TRUE(SameAt(rsout, i, want, "reduce-scatter under a lead"));
      }
    }
  });
  job.FinishCleanly();
}

// A sender that gets no data back, on a key that brings it at least as much as it sends (an
// allgather here), is ahead only until its pushes have left: its acknowledgements (replies of
// 0 elements) wait behind whatever the servers send it, and pacing by them made an allgather's
// senders take turns. A broadcast's root, which receives nothing, and a reduce-scatter, which
// receives a part of what it sends, keep their lead. Under a lead of two 64-byte partitions,
// with the other rank not yet taking part: the allgather sender's whole segment reaches the
// server; the broadcast root and the reduce-scatter (whose first pushes are to the other
// rank's segment) stop at their lead.
TEST(CollectiveTest, OnlySendersThatReceiveAsMuchAreAheadOnlyUntilTheirPushesLeave) {
  JobConfig c = Config(2, 1);
  c.max_bytes_ahead = 128;
  Job job;
  ASSERT_NO_FATAL_FAILURE(job.Start(c));
  constexpr uint64_t kCount = 512;  // per rank: 2 KiB, 32 partitions
  constexpr DataType kF32 = DataType::kFloat32;
  const CollectiveSpec gather{.kind = Collective::kAllgather, .counts = {kCount, kCount}};
  const CollectiveSpec bcast{.kind = Collective::kBroadcast, .root = 0};
  const CollectiveSpec scatter{.kind = Collective::kReduceScatter, .counts = {kCount, kCount}};
  std::vector<TensorHandle> g, b, rs;
  for (uint32_t r = 0; r < 2; ++r) {
    auto gr = job.worker(r).DeclareCollective("ahead.gather", kF32, 2 * kCount, gather);
    auto br = job.worker(r).DeclareCollective("ahead.bcast", kF32, kCount, bcast);
    auto rsr = job.worker(r).DeclareCollective("ahead.scatter", kF32, 2 * kCount, scatter);
    ASSERT_TRUE(gr.ok() && br.ok() && rsr.ok());
    g.push_back(*gr);
    b.push_back(*br);
    rs.push_back(*rsr);
  }
  std::vector<std::byte> in[2] = {Filled(kF32, 7, 0, kCount), Filled(kF32, 7, 1, kCount)};
  std::vector<std::byte> rsin[2] = {Filled(kF32, 9, 0, 2 * kCount), Filled(kF32, 9, 1, 2 * kCount)};
  const auto landed = [&](uint64_t want) {  // what the server has received, once it has `want`
    const auto deadline = In(kOpTimeout);
    while (job.server(0).stats().bytes_reduced < want && Clock::now() < deadline) {
      std::this_thread::sleep_for(std::chrono::milliseconds(2));
    }
    return job.server(0).stats().bytes_reduced;
  };
  const auto stays = [&](uint64_t want) {  // it gets `want` and, for a while, no more
    landed(want);
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    return job.server(0).stats().bytes_reduced;
  };
  std::vector<std::byte>& out0 = job.Buffer(2 * kCount * 4);
  PushPullHandle gathering = job.worker(0).Run(g[0], in[0], out0, {});
  EXPECT_EQ(landed(kCount * 4), kCount * 4)
      << "the allgather's sender held its pushes back until the other rank's acknowledgements";
  std::vector<std::byte>& root = job.Buffer(kCount * 4);
  test::FillTensor(kF32, 8, 0, 0, root);
  PushPullHandle broadcasting = job.worker(0).Run(b[0], root, root, {});
  EXPECT_EQ(stays(kCount * 4 + 128), kCount * 4 + 128)
      << "a broadcast root ran past its lead of two partitions";
  std::vector<std::byte>& part1 = job.Buffer(kCount * 4);
  PushPullHandle scattering = job.worker(1).Run(rs[1], rsin[1], part1, {});
  EXPECT_EQ(stays(kCount * 4 + 256), kCount * 4 + 256)
      << "a reduce-scatter ran past its lead of two partitions";

  std::vector<std::byte>& out1 = job.Buffer(2 * kCount * 4);
  ASSERT_TRUE(job.worker(1).Run(g[1], in[1], out1, {}).Wait(In(kOpTimeout)).ok());
  ASSERT_TRUE(gathering.Wait(In(kOpTimeout)).ok());
  std::vector<std::byte>& got = job.Buffer(kCount * 4);
  ASSERT_TRUE(job.worker(1).Run(b[1], got, got, {}).Wait(In(kOpTimeout)).ok());
  ASSERT_TRUE(broadcasting.Wait(In(kOpTimeout)).ok());
  std::vector<std::byte>& part0 = job.Buffer(kCount * 4);
  ASSERT_TRUE(job.worker(0).Run(rs[0], rsin[0], part0, {}).Wait(In(kOpTimeout)).ok());
  ASSERT_TRUE(scattering.Wait(In(kOpTimeout)).ok());
  std::vector<std::byte> both = in[0];
  both.insert(both.end(), in[1].begin(), in[1].end());
  EXPECT_EQ(out0, both);
  EXPECT_EQ(out1, both);
  EXPECT_EQ(got, root);
  for (uint32_t r = 0; r < 2; ++r) {
    const std::vector<std::byte>& part = r == 0 ? part0 : part1;
    for (uint64_t i = 0; i < kCount; ++i) {
      float x0, x1;
      std::memcpy(&x0, rsin[0].data() + (r * kCount + i) * 4, 4);
      std::memcpy(&x1, rsin[1].data() + (r * kCount + i) * 4, 4);
      const float sum = x0 + x1;
      ASSERT_TRUE(SameAt(part, i, std::vector<std::byte>(reinterpret_cast<const std::byte*>(&sum),
                                                          reinterpret_cast<const std::byte*>(&sum) + 4),
                         "reduce-scatter on rank " + std::to_string(r)));
    }
  }
  job.FinishCleanly();
}

}  // namespace
}  // namespace gradlink
