// Declarations and plans on whole jobs: workers that declare in different orders or late,
// shape, dtype and average-flag mismatches (every rank fails, naming both sides; the job goes
// on), local declaration errors, and a tensor too big to plan. Every wait has a deadline.
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
using test::ExpectMismatchOnBothRanks;
using test::FillTensor;
using test::In;
using test::Job;
using test::JobConfig;
using test::kOpTimeout;
using test::LayerSpecs;
using test::OnEveryWorker;
using test::OrderOfRank;
using test::RunRounds;
using test::TensorSpec;

// ---- declaration order differs between workers -------------------------------------------

TEST(JobTest, WorkersDeclareInDifferentOrders) {
  JobConfig config;
  config.workers = 3;
  config.servers = 2;
  config.partition_bytes = 2048;
  Job job;
  ASSERT_NO_FATAL_FAILURE(job.Start(config));
  const std::vector<TensorSpec> specs = LayerSpecs();
  RunRounds(job, specs, 3, [&](uint32_t rank) { return OrderOfRank(specs.size(), rank); });
  job.FinishCleanly();
}

TEST(JobTest, PushPullRightAfterDeclareWhileOthersDeclareLate) {
  // Rank 0 declares and pushes "a" then "b"; rank 1 declares "b" first and "a" only after a
  // pause. Keys do not depend on declaration order, so nothing deadlocks.
  JobConfig config;
  config.workers = 2;
  config.servers = 1;
  Job job;
  ASSERT_NO_FATAL_FAILURE(job.Start(config));
  OnEveryWorker(2, [&](uint32_t rank) {
    Worker& w = job.worker(rank);
    const std::vector<std::string> names =
        rank == 0 ? std::vector<std::string>{"a", "b"} : std::vector<std::string>{"b", "a"};
    std::vector<std::byte>* bufs[2] = {&job.Buffer(400), &job.Buffer(400)};
    std::vector<PushPullHandle> ops;
    for (const std::string& n : names) {
      if (rank == 1 && n == "a") std::this_thread::sleep_for(200ms);
      auto t = w.Declare(n, DataType::kFloat32, 100);
      ASSERT_TRUE(t.ok());
      const size_t id = n == "a" ? 0 : 1;
      FillTensor(DataType::kFloat32, id, rank, 0, *bufs[id]);
      ops.push_back(w.PushPull(*t, *bufs[id]));
    }
    for (auto& op : ops) ASSERT_TRUE(op.Wait(In(kOpTimeout)).ok());
    EXPECT_TRUE(CheckTensor(DataType::kFloat32, 0, 2, 0, false, *bufs[0]));
    EXPECT_TRUE(CheckTensor(DataType::kFloat32, 1, 2, 0, false, *bufs[1]));
  });
  job.FinishCleanly();
}

// ---- mismatches ----------------------------------------------------------------------------

TEST(JobTest, CountMismatchFailsEveryRank) {
  JobConfig config;
  Job job;
  ASSERT_NO_FATAL_FAILURE(job.Start(config));
  ExpectMismatchOnBothRanks(job, "x", DataType::kFloat32, 10, DataType::kFloat32, 12);
  // The job goes on: a tensor they agree on still works.
  RunRounds(job, {{"z", DataType::kFloat32, 10}}, 2);
  job.FinishCleanly();
}

TEST(JobTest, DtypeMismatchFailsEveryRank) {
  JobConfig config;
  Job job;
  ASSERT_NO_FATAL_FAILURE(job.Start(config));
  ExpectMismatchOnBothRanks(job, "y", DataType::kFloat32, 10, DataType::kFloat64, 10);
  ExpectMismatchOnBothRanks(job, "w", DataType::kFloat16, 7, DataType::kBFloat16, 9);
  RunRounds(job, {{"z", DataType::kInt64, 10}}, 2);
  job.FinishCleanly();
}

// Same dtype and element count, another shape: (3, 4) against (4, 3) would be summed element by
// element if only counts were compared. Both ranks get kMismatch naming both shapes, before any
// data moves; the same shape on both still sums, as does a rank that gives none.
TEST(JobTest, ShapeMismatchFailsEveryRank) {
  JobConfig config;
  Job job;
  ASSERT_NO_FATAL_FAILURE(job.Start(config));
  const std::vector<uint64_t> shapes[2] = {{3, 4}, {4, 3}};
  test::OnEveryWorker(2, [&](uint32_t rank) {
    auto h = job.worker(rank).Declare("s", DataType::kFloat32, shapes[rank]);
    ASSERT_TRUE(h.ok()) << h.status().ToString();
    EXPECT_EQ(h->count(), 12u);
    EXPECT_EQ(h->shape(), shapes[rank]);
    std::vector<std::byte>& buf = job.Buffer(12 * 4);
    Status s = job.worker(rank).PushPull(*h, buf).Wait(In(5s));
    ASSERT_EQ(s.code(), Code::kMismatch) << "rank " << rank << ": " << s.ToString();
    EXPECT_NE(s.message().find("fp32[12] shape (3, 4)"), std::string::npos) << s.message();
    EXPECT_NE(s.message().find("fp32[12] shape (4, 3)"), std::string::npos) << s.message();
    EXPECT_NE(s.message().find("'s'"), std::string::npos) << s.message();
  });
  // The job goes on: the name again, with one shape on both ranks, is planned afresh and sums.
  test::OnEveryWorker(2, [&](uint32_t rank) {
    auto h = job.worker(rank).Declare("s", DataType::kFloat32, std::vector<uint64_t>{2, 6});
    ASSERT_TRUE(h.ok()) << h.status().ToString();
    std::vector<std::byte>& buf = job.Buffer(12 * 4);
    FillTensor(DataType::kFloat32, 0, rank, 0, buf);
    Status s = job.worker(rank).PushPull(*h, buf).Wait(In(kOpTimeout));
    ASSERT_TRUE(s.ok()) << s.ToString();
    EXPECT_TRUE(CheckTensor(DataType::kFloat32, 0, 2, 0, false, buf));
  });
  // Agreeing shapes (and a rank without one) sum as before.
  test::OnEveryWorker(2, [&](uint32_t rank) {
    auto h = rank == 0 ? job.worker(0).Declare("ok", DataType::kFloat32, std::vector<uint64_t>{3, 4})
                       : job.worker(1).Declare("ok", DataType::kFloat32, 12);
    ASSERT_TRUE(h.ok()) << h.status().ToString();
    std::vector<std::byte>& buf = job.Buffer(12 * 4);
    FillTensor(DataType::kFloat32, 0, rank, 0, buf);
    ASSERT_TRUE(job.worker(rank).PushPull(*h, buf).Wait(In(kOpTimeout)).ok());
    EXPECT_TRUE(CheckTensor(DataType::kFloat32, 0, 2, 0, false, buf));
  });
  // Bad shapes are refused locally.
  EXPECT_EQ(job.worker(0).Declare("none", DataType::kFloat32, std::vector<uint64_t>{}).status().code(),
            Code::kInvalidArgument);
  EXPECT_EQ(job.worker(0)
                .Declare("huge", DataType::kFloat32, std::vector<uint64_t>{1ull << 40, 1ull << 40})
                .status()
                .code(),
            Code::kInvalidArgument);
  job.FinishCleanly();
}

TEST(JobTest, LocalDeclarationErrors) {
  JobConfig config;
  config.workers = 1;
  Job job;
  ASSERT_NO_FATAL_FAILURE(job.Start(config));
  Worker& w = job.worker(0);
  auto a = w.Declare("t", DataType::kFloat32, 10);
  ASSERT_TRUE(a.ok());
  auto again = w.Declare("t", DataType::kFloat32, 10);
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(again->key(), a->key());
  EXPECT_TRUE(a->current());
  // The name with another dtype: a new declaration under another key; the first is retired,
  // and its operations fail at once saying why.
  auto f64 = w.Declare("t", DataType::kFloat64, 10);
  ASSERT_TRUE(f64.ok()) << f64.status().ToString();
  EXPECT_NE(f64->key(), a->key());
  EXPECT_EQ(f64->name(), "t");
  EXPECT_TRUE(f64->current());
  EXPECT_FALSE(a->current());
  {
    std::vector<std::byte>& b = job.Buffer(40);
    Status s = w.PushPull(*a, b).Wait(In(1s));
    EXPECT_EQ(s.code(), Code::kInvalidArgument) << s.ToString();
    EXPECT_NE(s.message().find("declared again"), std::string::npos) << s.ToString();
  }
  // And back as it was: a third key.
  a = w.Declare("t", DataType::kFloat32, 10);
  ASSERT_TRUE(a.ok()) << a.status().ToString();
  EXPECT_NE(a->key(), again->key());
  EXPECT_NE(a->key(), f64->key());
  EXPECT_FALSE(f64->current());
  EXPECT_EQ(w.Declare("", DataType::kFloat32, 1).status().code(), Code::kInvalidArgument);
  EXPECT_EQ(w.Declare("big", DataType::kFloat64, uint64_t{1} << 62).status().code(),
            Code::kInvalidArgument);
  EXPECT_EQ(w.Declare("bad dtype", static_cast<DataType>(0), 1).status().code(),
            Code::kInvalidArgument);
  // Wrong buffer size and empty handle fail at once.
  std::vector<std::byte>& small = job.Buffer(39);
  EXPECT_EQ(w.PushPull(*a, small).Wait(In(1s)).code(), Code::kInvalidArgument);
  std::vector<std::byte>& buf = job.Buffer(40);
  EXPECT_EQ(w.PushPull(TensorHandle(), buf).Wait(In(1s)).code(), Code::kInvalidArgument);
  EXPECT_EQ(PushPullHandle().Wait(In(1s)).code(), Code::kInvalidArgument);
  // The tensor itself still works.
  FillTensor(DataType::kFloat32, 0, 0, 0, buf);
  ASSERT_TRUE(w.PushPull(*a, buf).Wait(In(kOpTimeout)).ok());
  EXPECT_TRUE(CheckTensor(DataType::kFloat32, 0, 1, 0, false, buf));
  // An empty tensor completes at once.
  auto e = w.Declare("empty", DataType::kFloat32, 0);
  ASSERT_TRUE(e.ok());
  EXPECT_TRUE(w.PushPull(*e, {}).Wait(In(kOpTimeout)).ok());
  job.FinishCleanly();
}

// The job's memory quota (SchedulerOptions::memory_quota_bytes) holds over all its servers:
// keys spread over 2 servers are admitted until their total would pass it, then one is refused
// on every worker with kResourceExhausted naming the quota and the use, before any data moves;
// the keys admitted go on, exact, and each server alone had room for the refused one.
TEST(JobTest, TheJobsMemoryQuotaHoldsOverAllItsServers) {
  constexpr uint64_t kElements = 10000;  // fp32, 2 workers: 16 bytes per element held
  JobConfig config;
  config.servers = 2;
  config.partition_bytes = 8192;
  config.job_memory_quota = 2 * kElements * 16 + 1000;  // two such tensors, not three
  Job job;
  ASSERT_NO_FATAL_FAILURE(job.Start(config));
  auto sum = [&](const std::string& name, uint64_t step) -> Status {
    std::vector<Status> st(2);
    OnEveryWorker(2, [&](uint32_t rank) {
      auto h = job.worker(rank).Declare(name, DataType::kFloat32, kElements);
      ASSERT_TRUE(h.ok()) << h.status().ToString();
      std::vector<std::byte>& buf = job.Buffer(kElements * 4);
      FillTensor(DataType::kFloat32, 0, rank, step, buf);
      st[rank] = job.worker(rank).PushPull(*h, buf).Wait(In(kOpTimeout));
      if (st[rank].ok()) {
        EXPECT_TRUE(CheckTensor(DataType::kFloat32, 0, 2, step, false, buf));
      }
    });
    EXPECT_EQ(st[0].code(), st[1].code()) << st[0].ToString() << " / " << st[1].ToString();
    return st[0];
  };
  ASSERT_TRUE(sum("a", 0).ok());
  ASSERT_TRUE(sum("b", 1).ok());
  const Status refused = sum("c", 2);
  EXPECT_EQ(refused.code(), Code::kResourceExhausted) << refused.ToString();
  EXPECT_NE(refused.message().find("memory quota"), std::string::npos) << refused.ToString();
  EXPECT_NE(refused.message().find("holds " + std::to_string(2 * kElements * 16)),
            std::string::npos)
      << refused.ToString();
  // Nothing of "c" reached the servers; "a" and "b" go on.
  EXPECT_EQ(job.server(0).stats().bytes_reduced + job.server(1).stats().bytes_reduced,
            2 * 2 * kElements * 4);
  EXPECT_TRUE(sum("a", 3).ok());
  EXPECT_TRUE(sum("b", 4).ok());
  job.FinishCleanly();
}

// Names are labels matched per call (as Horovod's are): a name back with another count or dtype
// retires its earlier key and plans a new one. The scheduler frees the earlier plan's budget (a
// budget that holds only one of them admits the second), the server forgets the retired key's
// partitions, an in-flight operation blocks the change, and a name refused as a mismatch is
// usable again once the ranks agree.
TEST(JobTest, ANameBackWithAnotherShapeIsPlannedAfreshAndTheOldKeyFreed) {
  constexpr uint64_t kElements = 10000;  // fp32, 2 workers: 16 bytes per element on the server
  JobConfig config;
  config.servers = 1;
  config.partition_bytes = 8192;  // 5 partitions of the first declaration
  config.server_memory_budget = kElements * 16;
  Job job;
  ASSERT_NO_FATAL_FAILURE(job.Start(config));
  auto sum = [&](DataType dtype, uint64_t count, uint64_t step) {
    std::vector<TensorHandle> handles(2);
    OnEveryWorker(2, [&](uint32_t rank) {
      auto h = job.worker(rank).Declare("x", dtype, count);
      ASSERT_TRUE(h.ok()) << h.status().ToString();
      std::vector<std::byte>& buf = job.Buffer(count * DataTypeSize(dtype));
      FillTensor(dtype, 0, rank, step, buf);
      Status s = job.worker(rank).PushPull(*h, buf).Wait(In(kOpTimeout));
      ASSERT_TRUE(s.ok()) << "rank " << rank << ": " << s.ToString();
      EXPECT_TRUE(CheckTensor(dtype, 0, 2, step, false, buf));
      handles[rank] = *h;
    });
    return handles;
  };
  std::vector<TensorHandle> first = sum(DataType::kFloat32, kElements, 0);
  ASSERT_EQ(first.size(), 2u);
  EXPECT_EQ(job.server(0).stats().partitions, 5u);
  // The same again: the same key, nothing re-planned.
  std::vector<TensorHandle> same = sum(DataType::kFloat32, kElements, 1);
  EXPECT_EQ(same[0].key(), first[0].key());
  EXPECT_EQ(job.server(0).stats().keys_retired, 0u);
  // 9000 elements fit the budget only once the first declaration's 10000 are given back.
  std::vector<TensorHandle> second = sum(DataType::kFloat32, kElements - 1000, 2);
  EXPECT_NE(second[0].key(), first[0].key());
  EXPECT_EQ(second[0].key(), second[1].key());
  EXPECT_FALSE(first[0].current());
  EXPECT_TRUE(second[1].current());
  // The server forgets the retired key's partitions (told by the scheduler once every worker
  // has moved on).
  for (auto until = In(std::chrono::seconds(5));
       job.server(0).stats().keys_retired != 1u && Clock::now() < until;) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  EXPECT_EQ(job.server(0).stats().keys_retired, 1u);
  EXPECT_EQ(job.server(0).stats().partitions, 5u);  // 9000 fp32 in 8192-byte partitions
  // Another dtype (fp64, 8 bytes an element): again within the budget only after a retirement
  // (and leaving room for "y" below).
  constexpr uint64_t kHalf = kElements / 2 - 100;
  sum(DataType::kFloat64, kHalf, 3);
  // An operation in flight blocks the change on that rank (the other rank has not pushed).
  auto h = job.worker(0).Declare("x", DataType::kFloat64, kHalf);
  ASSERT_TRUE(h.ok());
  std::vector<std::byte>& pending = job.Buffer(kHalf * 8);
  FillTensor(DataType::kFloat64, 0, 0, 4, pending);
  PushPullHandle op = job.worker(0).PushPull(*h, pending);
  auto busy = job.worker(0).Declare("x", DataType::kFloat32, 10);
  EXPECT_EQ(busy.status().code(), Code::kInvalidArgument) << busy.status().ToString();
  EXPECT_NE(busy.status().message().find("in flight"), std::string::npos);
  {
    auto h1 = job.worker(1).Declare("x", DataType::kFloat64, kHalf);
    ASSERT_TRUE(h1.ok());
    std::vector<std::byte>& b1 = job.Buffer(kHalf * 8);
    FillTensor(DataType::kFloat64, 0, 1, 4, b1);
    ASSERT_TRUE(job.worker(1).PushPull(*h1, b1).Wait(In(kOpTimeout)).ok());
    ASSERT_TRUE(op.Wait(In(kOpTimeout)).ok());
    EXPECT_TRUE(CheckTensor(DataType::kFloat64, 0, 2, 4, false, pending));
  }
  // Ranks that disagree get kMismatch; agreeing afterwards, the name sums again.
  ExpectMismatchOnBothRanks(job, "y", DataType::kFloat32, 10, DataType::kFloat32, 12);
  OnEveryWorker(2, [&](uint32_t rank) {
    auto y = job.worker(rank).Declare("y", DataType::kFloat32, 12);
    ASSERT_TRUE(y.ok()) << y.status().ToString();
    std::vector<std::byte>& buf = job.Buffer(12 * 4);
    FillTensor(DataType::kFloat32, 0, rank, 0, buf);
    Status s = job.worker(rank).PushPull(*y, buf).Wait(In(kOpTimeout));
    ASSERT_TRUE(s.ok()) << "rank " << rank << ": " << s.ToString();
    EXPECT_TRUE(CheckTensor(DataType::kFloat32, 0, 2, 0, false, buf));
  });
  job.FinishCleanly();
}

TEST(JobTest, AverageFlagDisagreementIsAMismatch) {
  JobConfig config;
  config.partition_bytes = 1024;
  Job job;
  ASSERT_NO_FATAL_FAILURE(job.Start(config));
  for (int i = 0; i < 5; ++i) AverageDisagreementThenAgreement(job, "avg" + std::to_string(i), 100);
  job.FinishCleanly();
}

// Regression (src/worker/worker.cc): when one partition of a multi-partition op got a
// kDataError, the worker finished the op at once, although the other partitions' round is
// still open on their servers (their replies are in flight, or their pushes were never sent).
// The next call on the tensor then pushes round r+1 to a server still summing round r: refused
// with kProtocolError ("pushed round 1 while the server sums round 0"), or accepted on one rank
// and refused on the other, which leaves the first waiting forever. Worse, the op completes while
// pushes of its other partitions are still being sent from the caller's buffer: a caller that
// frees the buffer once Wait() has returned (as the API allows) gets a use-after-free inside the
// lane (seen under ASan in inproc Deliver's memcpy). The fix: a failed op keeps pushing and
// collecting all its partitions, and waits for its send completions, before it completes.
// (Fixed: a failed op keeps going until the transport no longer touches its buffer.)
TEST(JobTest, MultiPartitionMismatchDoesNotBreakLaterRounds) {
  JobConfig config;
  config.servers = 2;
  config.partition_bytes = 1024;
  Job job;
  ASSERT_NO_FATAL_FAILURE(job.Start(config));
  for (int i = 0; i < 10; ++i) {
    AverageDisagreementThenAgreement(job, "avg" + std::to_string(i), 1000);  // 4 partitions
  }
  job.FinishCleanly();
}

// Regression (src/scheduler/scheduler.cc PlanLocked): an Assign must fit in one control frame
// (kMaxControlPayload, about 52000 partitions) and in kMaxPartitions. A tensor with more
// partitions makes the scheduler send an oversized frame; the server drops its scheduler
// connection as a protocol error and the whole job dies with a misleading kPeerLost ("server 0
// lost its connection"). Now this tensor alone fails, with kInvalidArgument saying why.
TEST(JobTest, TensorWithTooManyPartitionsFailsCleanly) {
  JobConfig config;
  config.workers = 1;
  config.partition_bytes = 4;  // one fp32 per partition
  Job job;
  ASSERT_NO_FATAL_FAILURE(job.Start(config));
  // 60000 partitions x 20 bytes > kMaxControlPayload (1 MiB).
  auto t = job.worker(0).Declare("huge", DataType::kFloat32, 60000);
  Status s;
  std::vector<std::byte>& buf = job.Buffer(240000);
  if (t.ok()) s = job.worker(0).PushPull(*t, buf).Wait(In(kOpTimeout));
  else s = t.status();
  EXPECT_FALSE(s.ok());
  EXPECT_NE(s.code(), Code::kTimeout) << s.ToString();
  // The job survives: another tensor still works.
  auto ok = job.worker(0).Declare("small", DataType::kFloat32, 10);
  ASSERT_TRUE(ok.ok()) << ok.status().ToString();
  std::vector<std::byte>& b = job.Buffer(40);
  Status s2 = job.worker(0).PushPull(*ok, b).Wait(In(kOpTimeout));
  EXPECT_TRUE(s2.ok()) << s2.ToString();
}

// ---- options that cannot work ---------------------------------------------------------------

TEST(JobTest, NonsensicalOptionsAreRefusedNamingTheSettingBeforeConnecting) {
  struct Case {
    const char* what;
    void (*set)(WorkerOptions&);
    const char* names;
  };
  const Case cases[] = {
      {"partition 0", [](WorkerOptions& o) { o.partition_bytes = 0; },
       "partition_bytes (GRADLINK_PARTITION_BYTES) must be positive"},
      {"window below a partition",
       [](WorkerOptions& o) {
         o.partition_bytes = 8u << 20;
         o.max_bytes_in_flight = 1u << 20;
       },
       "max_bytes_in_flight (GRADLINK_MAX_BYTES_IN_FLIGHT) of 1048576 bytes cannot hold one "
       "partition of 8388608 bytes"},
      {"lead beyond memory", [](WorkerOptions& o) { o.max_bytes_ahead = uint64_t{1} << 60; },
       "max_bytes_ahead (GRADLINK_MAX_BYTES_AHEAD) of 1152921504606846976 bytes is more than"},
      {"partition beyond any tensor", [](WorkerOptions& o) {
         o.partition_bytes = uint64_t{1} << 50;
         o.max_bytes_in_flight = uint64_t{1} << 50;
       },
       "partition_bytes (GRADLINK_PARTITION_BYTES) of 1125899906842624 bytes is more than"},
  };
  for (const Case& c : cases) {
    WorkerOptions o;
    o.scheduler = "127.0.0.1:1";  // never contacted: the options are checked first
    o.connect_timeout = 10s;
    c.set(o);
    const auto start = Clock::now();
    auto w = Worker::Connect(o);
    ASSERT_FALSE(w.ok()) << c.what;
    EXPECT_EQ(w.status().code(), Code::kInvalidArgument) << c.what << ": " << w.status().ToString();
    EXPECT_NE(w.status().message().find(c.names), std::string::npos)
        << c.what << ": " << w.status().ToString();
    EXPECT_LT(Clock::now() - start, 1s) << c.what;
  }
}

// ---- admission: the servers' memory budgets ----------------------------------------------

TEST(JobTest, TensorOverTheServersMemoryBudgetIsRefusedOnEveryRankBeforeAnyDataMoves) {
  // fp32 with 2 workers: a server holds 2 staging + 2 accumulator bytes per byte of tensor, 16
  // bytes per element (reduce::ServerBytesHeld). The budget holds exactly 10000 elements.
  constexpr uint64_t kElements = 10000;
  JobConfig config;
  config.workers = 2;
  config.servers = 1;
  config.server_memory_budget = kElements * 16;
  Job job;
  ASSERT_NO_FATAL_FAILURE(job.Start(config));
  auto run = [&](const std::string& name, uint64_t count) {
    std::vector<Status> result(config.workers);
    OnEveryWorker(config.workers, [&](uint32_t rank) {
      auto t = job.worker(rank).Declare(name, DataType::kFloat32, count);
      if (!t.ok()) {
        result[rank] = t.status();
        return;
      }
      std::vector<std::byte>& buf = job.Buffer(count * 4);
      FillTensor(DataType::kFloat32, 0, rank, 0, buf);
      result[rank] = job.worker(rank).PushPull(*t, buf).Wait(In(kOpTimeout));
      if (result[rank].ok()) {
        EXPECT_TRUE(CheckTensor(DataType::kFloat32, 0, 2, 0, false, buf));
      }
    });
    return result;
  };
  // One element more than the budget holds: every rank is refused, naming the tensor, its
  // bytes and the budget, and the server never held a byte of it.
  for (const Status& s : run("over", kElements + 1)) {
    EXPECT_EQ(s.code(), Code::kResourceExhausted) << s.ToString();
    EXPECT_NE(s.message().find("'over'"), std::string::npos) << s.ToString();
    EXPECT_NE(s.message().find("(40004 bytes)"), std::string::npos) << s.ToString();
    EXPECT_NE(s.message().find("160016 bytes on server 0"), std::string::npos) << s.ToString();
    EXPECT_NE(s.message().find("holds 0 bytes of its 160000-byte memory budget"),
              std::string::npos) << s.ToString();
  }
  EXPECT_EQ(job.server(0).stats().bytes_held, 0u);
  EXPECT_EQ(job.server(0).stats().rounds_completed, 0u);
  // Exactly the budget: admitted and summed.
  for (const Status& s : run("edge", kElements)) EXPECT_TRUE(s.ok()) << s.ToString();
  // Nothing more fits; the refusal counts what is held.
  for (const Status& s : run("one-more", 1)) {
    EXPECT_EQ(s.code(), Code::kResourceExhausted) << s.ToString();
    EXPECT_NE(s.message().find("holds 160000 bytes of its 160000-byte"), std::string::npos)
        << s.ToString();
  }
  // The refused keys took no room and the job goes on: "edge" runs again. Each round gave its
  // buffers back, and the next took them again: what one round needs stays free for the next,
  // its accumulator and rank 1's staging (rank 0's push lands in the accumulator), 8 bytes per
  // element of the 16 admitted, none of them in a round now.
  for (const Status& s : run("edge", kElements)) EXPECT_TRUE(s.ok()) << s.ToString();
  // The last replies' send completions may still be on their way to the server.
  for (auto until = In(std::chrono::seconds(5));
       job.server(0).stats().bytes_in_rounds != 0 && Clock::now() < until;) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  EXPECT_EQ(job.server(0).stats().bytes_in_rounds, 0u);
  EXPECT_EQ(job.server(0).stats().bytes_held, kElements * 8);
  job.FinishCleanly();
}

}  // namespace
}  // namespace gradlink
