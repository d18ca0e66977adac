// Whole jobs in one process: a Scheduler (TCP on 127.0.0.1, port 0), S servers and W workers on
// threads, talking over the inproc fabric. Checks every element of every sum against a scalar
// reference, for all dtypes, many keys and rounds, mixed priorities, declaration orders that
// differ between workers, shape/dtype mismatches, deadlines, and members that leave mid-job.
// Every wait has a deadline: a test fails, it never hangs.
#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <limits>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "common/naming.h"
#include "gradlink/scheduler.h"
#include "gradlink/server.h"
#include "gradlink/worker.h"
#include "transport/transport.h"
#include "unit/support/job_harness.h"
#include "wire/frame.h"
#include "server/start_on.h"
#include "worker/worker_impl.h"

namespace gradlink {
namespace {

using namespace std::chrono_literals;
using test::In;
using test::Job;
using test::JobConfig;
using test::kAllTypes;
using test::kConnectTimeout;
using test::kOpTimeout;
using test::OnEveryWorker;

// ---- Independent references --------------------------------------------------------------------

// Round to nearest even into binary16 / bfloat16, for normal finite values (all the tests use).
uint16_t RefFloatToHalf(float f) {
  if (f == 0.0f) return std::signbit(f) ? 0x8000 : 0;
  const uint16_t sign = std::signbit(f) ? 0x8000 : 0;
  int e;
  const double m = std::frexp(std::fabs(double(f)), &e);  // |f| = m * 2^e, m in [0.5, 1)
  double q = std::nearbyint(m * 2048.0);                  // 11 significant bits
  if (q == 2048.0) {
    q = 1024.0;
    ++e;
  }
  const int biased = (e - 1) + 15;
  EXPECT_GT(biased, 0) << f << " is not a normal fp16 value";
  EXPECT_LT(biased, 31) << f << " overflows fp16";
  return static_cast<uint16_t>(sign | (biased << 10) | (static_cast<int>(q) - 1024));
}
uint16_t RefFloatToBf16(float f) {
  if (f == 0.0f) return std::signbit(f) ? 0x8000 : 0;
  const uint16_t sign = std::signbit(f) ? 0x8000 : 0;
  int e;
  const double m = std::frexp(std::fabs(double(f)), &e);
  double q = std::nearbyint(m * 256.0);  // 8 significant bits
  if (q == 256.0) {
    q = 128.0;
    ++e;
  }
  const int biased = (e - 1) + 127;
  return static_cast<uint16_t>(sign | (biased << 7) | (static_cast<int>(q) - 128));
}
// Exact for the values used: k/4 with small k.
float RefHalfToFloat(uint16_t h) {
  const int e = (h >> 10) & 0x1F, m = h & 0x3FF;
  const float v = e == 0 ? std::ldexp(float(m), -24) : std::ldexp(float(m + 1024), e - 25);
  return (h & 0x8000) ? -v : v;
}
float RefBf16ToFloat(uint16_t b) { return std::bit_cast<float>(uint32_t{b} << 16); }

uint64_t Mix(uint64_t x) {  // splitmix64
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

// The value rank `rank` pushes for element `i` of tensor `tensor` in round `round`, as bytes of
// `dtype`. Floats are arbitrary; fp16/bf16 are quarters in [-16, 16] (exact in every type, so
// the fp32 sum is exact and rounds once), with element 0 = 2048 / 256 on rank 0 and 1 elsewhere
// so that accumulating in the narrow type would lose the ones.
void FillValue(DataType dtype, uint64_t tensor, uint32_t rank, uint64_t round, uint64_t i,
               std::byte* out) {
  const uint64_t r = Mix(Mix(Mix(tensor) ^ rank) ^ (round << 32) ^ i);
  switch (dtype) {
    case DataType::kFloat32: {
      const float v = float(int64_t(r % 2000001) - 1000000) / float(1 + (r >> 40) % 1000);
      std::memcpy(out, &v, 4);
      return;
    }
    case DataType::kFloat64: {
      const double v = double(int64_t(r % 2000000001) - 1000000000) / double(1 + (r >> 40) % 100000);
      std::memcpy(out, &v, 8);
      return;
    }
    case DataType::kFloat16:
    case DataType::kBFloat16: {
      float v = float(int64_t(r % 129) - 64) / 4.0f;
      if (i == 0) v = rank == 0 ? (dtype == DataType::kFloat16 ? 2048.0f : 256.0f) : 1.0f;
      const uint16_t bits = dtype == DataType::kFloat16 ? RefFloatToHalf(v) : RefFloatToBf16(v);
      std::memcpy(out, &bits, 2);
      return;
    }
    case DataType::kInt32: {
      const uint32_t v = static_cast<uint32_t>(r);  // full range: sums wrap
      std::memcpy(out, &v, 4);
      return;
    }
    case DataType::kInt64: {
      std::memcpy(out, &r, 8);
      return;
    }
  }
}

void FillTensor(DataType dtype, uint64_t tensor, uint32_t rank, uint64_t round,
                std::vector<std::byte>& buf) {
  const size_t size = DataTypeSize(dtype);
  for (uint64_t i = 0; i < buf.size() / size; ++i) {
    FillValue(dtype, tensor, rank, round, i, buf.data() + i * size);
  }
}

// The expected result for element i: the pushes of ranks 0..W-1 summed in rank order, in the
// accumulator type, divided by W when averaging, converted back.
void ExpectedValue(DataType dtype, uint64_t tensor, uint32_t workers, uint64_t round, uint64_t i,
                   bool average, std::byte* out) {
  std::byte v[8];
  switch (dtype) {
    case DataType::kFloat32: {
      float acc = 0, x;
      for (uint32_t r = 0; r < workers; ++r) {
        FillValue(dtype, tensor, r, round, i, v);
        std::memcpy(&x, v, 4);
        acc = r == 0 ? x : acc + x;
      }
      if (average) acc = acc / float(workers);
      std::memcpy(out, &acc, 4);
      return;
    }
    case DataType::kFloat64: {
      double acc = 0, x;
      for (uint32_t r = 0; r < workers; ++r) {
        FillValue(dtype, tensor, r, round, i, v);
        std::memcpy(&x, v, 8);
        acc = r == 0 ? x : acc + x;
      }
      if (average) acc = acc / double(workers);
      std::memcpy(out, &acc, 8);
      return;
    }
    case DataType::kFloat16:
    case DataType::kBFloat16: {
      float acc = 0;
      for (uint32_t r = 0; r < workers; ++r) {
        FillValue(dtype, tensor, r, round, i, v);
        uint16_t b;
        std::memcpy(&b, v, 2);
        const float x = dtype == DataType::kFloat16 ? RefHalfToFloat(b) : RefBf16ToFloat(b);
        acc = r == 0 ? x : acc + x;
      }
      if (average) acc = acc / float(workers);
      const uint16_t bits = dtype == DataType::kFloat16 ? RefFloatToHalf(acc) : RefFloatToBf16(acc);
      std::memcpy(out, &bits, 2);
      return;
    }
    case DataType::kInt32: {
      uint32_t acc = 0, x;
      for (uint32_t r = 0; r < workers; ++r) {
        FillValue(dtype, tensor, r, round, i, v);
        std::memcpy(&x, v, 4);
        acc += x;
      }
      int32_t res = static_cast<int32_t>(acc);
      if (average) res = res / static_cast<int32_t>(workers);
      std::memcpy(out, &res, 4);
      return;
    }
    case DataType::kInt64: {
      uint64_t acc = 0, x;
      for (uint32_t r = 0; r < workers; ++r) {
        FillValue(dtype, tensor, r, round, i, v);
        std::memcpy(&x, v, 8);
        acc += x;
      }
      int64_t res = static_cast<int64_t>(acc);
      if (average) res = res / static_cast<int64_t>(workers);
      std::memcpy(out, &res, 8);
      return;
    }
  }
}

// Checks a whole result buffer; reports at most a few bad elements.
::testing::AssertionResult CheckTensor(DataType dtype, uint64_t tensor, uint32_t workers,
                                       uint64_t round, bool average,
                                       const std::vector<std::byte>& got) {
  const size_t size = DataTypeSize(dtype);
  int bad = 0;
  std::string detail;
  for (uint64_t i = 0; i < got.size() / size; ++i) {
    std::byte want[8];
    ExpectedValue(dtype, tensor, workers, round, i, average, want);
    if (std::memcmp(want, got.data() + i * size, size) != 0) {
      if (++bad <= 3) {
        uint64_t w = 0, g = 0;
        std::memcpy(&w, want, size);
        std::memcpy(&g, got.data() + i * size, size);
        detail += " [element " + std::to_string(i) + ": bits 0x" + KeyHex(g).substr(2) +
                  ", expected 0x" + KeyHex(w).substr(2) + "]";
      }
    }
  }
  if (bad == 0) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << DataTypeName(dtype) << " tensor " << tensor << " round "
                                       << round << ": " << bad << " wrong elements" << detail;
}

// ---- Rounds on a job (unit/support/job_harness.h) -----------------------------------------------

struct TensorSpec {
  std::string name;
  DataType dtype;
  uint64_t count;
  bool average = false;
  int32_t priority = 0;
};

// Each worker declares `specs` (in the order `order(rank)` gives), then for each round fills
// every tensor, PushPulls all of them at once, waits, and checks every element.
// `issue_gap` (if > 0) sleeps a rank-dependent random time up to that long between calls, as
// a backward pass produces gradients over time.
void RunRounds(Job& job, const std::vector<TensorSpec>& specs, uint64_t rounds,
               std::function<std::vector<size_t>(uint32_t)> order = nullptr,
               std::chrono::microseconds issue_gap = std::chrono::microseconds(0)) {
  const uint32_t workers = job.config().workers;
  OnEveryWorker(workers, [&](uint32_t rank) {
    Worker& w = job.worker(rank);
    std::vector<size_t> idx(specs.size());
    for (size_t i = 0; i < idx.size(); ++i) idx[i] = i;
    if (order) idx = order(rank);
    std::vector<TensorHandle> handles(specs.size());
    std::vector<std::vector<std::byte>*> bufs(specs.size());
    for (size_t i : idx) {
      Result<TensorHandle> t = w.Declare(specs[i].name, specs[i].dtype, specs[i].count);
      ASSERT_TRUE(t.ok()) << t.status().ToString();
      EXPECT_EQ(t->key(), wire::TensorKey(job.config().job, specs[i].name));
      handles[i] = *t;
      bufs[i] = &job.Buffer(specs[i].count * DataTypeSize(specs[i].dtype));
    }
    std::mt19937 gap_rng(rank + 1);
    for (uint64_t round = 0; round < rounds; ++round) {
      std::vector<PushPullHandle> ops(specs.size());
      for (size_t i : idx) {
        if (issue_gap.count() > 0) {
          std::this_thread::sleep_for(std::chrono::microseconds(gap_rng() % issue_gap.count()));
        }
        FillTensor(specs[i].dtype, i, rank, round, *bufs[i]);
        ops[i] = w.PushPull(handles[i], *bufs[i], {specs[i].average, specs[i].priority});
      }
      const auto deadline = In(kOpTimeout);
      for (size_t i : idx) {
        Status s = ops[i].Wait(deadline);
        ASSERT_TRUE(s.ok()) << "rank " << rank << " '" << specs[i].name << "' round " << round
                            << ": " << s.ToString();
        EXPECT_TRUE(ops[i].Poll());
        EXPECT_TRUE(CheckTensor(specs[i].dtype, i, workers, round, specs[i].average, *bufs[i]))
            << "rank " << rank << " '" << specs[i].name << "'";
      }
    }
  });
}

// Partition rounds the servers must have completed for `rounds` steps over `specs`.
uint64_t ExpectedPartitionRounds(const std::vector<TensorSpec>& specs, uint64_t partition_bytes,
                                 uint64_t rounds) {
  uint64_t n = 0;
  for (const TensorSpec& t : specs) {
    const uint64_t per_part = std::max<uint64_t>(1, partition_bytes / DataTypeSize(t.dtype));
    n += (t.count + per_part - 1) / per_part;
  }
  return n * rounds;
}

uint64_t ServerRounds(Job& job) {
  uint64_t n = 0;
  for (uint32_t s = 0; s < job.config().servers; ++s) n += job.server(s).stats().rounds_completed;
  return n;
}

// ---- (a) every dtype, sizes spanning servers, W x S -------------------------------------------

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
  EXPECT_EQ(ServerRounds(job), ExpectedPartitionRounds(specs, config.partition_bytes, 5));
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

// ---- (b) declaration order differs between workers -------------------------------------------

// 12 tensors of every dtype, and the order each of 3 ranks uses them in: 0 in order, 1 reversed,
// 2 shuffled.
std::vector<TensorSpec> LayerSpecs() {
  std::vector<TensorSpec> specs;
  for (int i = 0; i < 12; ++i) {
    specs.push_back({"layer" + std::to_string(i), kAllTypes[i % 6], uint64_t(100 + 300 * i)});
  }
  return specs;
}

std::vector<size_t> OrderOfRank(size_t n, uint32_t rank) {
  std::vector<size_t> idx(n);
  for (size_t i = 0; i < idx.size(); ++i) idx[i] = i;
  if (rank == 1) std::reverse(idx.begin(), idx.end());
  if (rank == 2) std::shuffle(idx.begin(), idx.end(), std::mt19937(99));
  return idx;
}

// 200 small tensors of every dtype.
std::vector<TensorSpec> ManyKeySpecs() {
  std::vector<TensorSpec> specs;
  for (int i = 0; i < 200; ++i) {
    specs.push_back({"k" + std::to_string(i), kAllTypes[i % 6], uint64_t(1 + (i * 37) % 150)});
  }
  return specs;
}

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

// ---- (c) mismatches ----------------------------------------------------------------------------

void ExpectMismatchOnBothRanks(Job& job, const std::string& name, DataType t0, uint64_t n0,
                               DataType t1, uint64_t n1) {
  const auto start = Clock::now();
  OnEveryWorker(2, [&](uint32_t rank) {
    const DataType t = rank == 0 ? t0 : t1;
    const uint64_t n = rank == 0 ? n0 : n1;
    auto h = job.worker(rank).Declare(name, t, n);
    ASSERT_TRUE(h.ok()) << h.status().ToString();  // declaring is local; the check comes later
    std::vector<std::byte>& buf = job.Buffer(n * DataTypeSize(t));
    Status s = job.worker(rank).PushPull(*h, buf).Wait(In(5s));
    ASSERT_EQ(s.code(), Code::kMismatch) << "rank " << rank << ": " << s.ToString();
    const std::string& m = s.message();
    const std::string key = KeyHex(wire::TensorKey(job.config().job, name));
    EXPECT_NE(m.find(key), std::string::npos) << m;
    EXPECT_NE(m.find("'" + name + "'"), std::string::npos) << m;
    EXPECT_NE(m.find("rank 0"), std::string::npos) << m;
    EXPECT_NE(m.find("rank 1"), std::string::npos) << m;
    const std::string d0 = std::string(DataTypeName(t0)) + "[" + std::to_string(n0) + "]";
    const std::string d1 = std::string(DataTypeName(t1)) + "[" + std::to_string(n1) + "]";
    EXPECT_NE(m.find(d0), std::string::npos) << m;
    EXPECT_NE(m.find(d1), std::string::npos) << m;
    // Later calls on that tensor fail at once with the same error.
    Status again = job.worker(rank).PushPull(*h, buf).Wait(In(1s));
    EXPECT_EQ(again.code(), Code::kMismatch) << again.ToString();
  });
  EXPECT_LT(Clock::now() - start, 5s);
}

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
  EXPECT_EQ(w.Declare("t", DataType::kFloat64, 10).status().code(), Code::kMismatch);
  EXPECT_EQ(w.Declare("t", DataType::kFloat32, 11).status().code(), Code::kMismatch);
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

// ---- (d) deadlines -----------------------------------------------------------------------------

// Rank 0's op times out while rank 1 has not pushed, and completes once it has.
void ExpectWaitTimesOutThenCompletes(const JobConfig& config) {
  Job job;
  ASSERT_NO_FATAL_FAILURE(job.Start(config));
  auto t0 = job.worker(0).Declare("t", DataType::kFloat32, 1000);
  auto t1 = job.worker(1).Declare("t", DataType::kFloat32, 1000);
  ASSERT_TRUE(t0.ok() && t1.ok());
  std::vector<std::byte>& b0 = job.Buffer(4000);
  std::vector<std::byte>& b1 = job.Buffer(4000);
  FillTensor(DataType::kFloat32, 0, 0, 0, b0);
  FillTensor(DataType::kFloat32, 0, 1, 0, b1);
  PushPullHandle op0 = job.worker(0).PushPull(*t0, b0);

  auto start = Clock::now();
  Status s = op0.Wait(Clock::now() - 1s);  // a deadline in the past
  EXPECT_EQ(s.code(), Code::kTimeout) << s.ToString();
  EXPECT_LT(Clock::now() - start, 1s);
  EXPECT_NE(s.message().find("'t'"), std::string::npos) << s.message();

  start = Clock::now();
  s = op0.Wait(In(200ms));
  EXPECT_EQ(s.code(), Code::kTimeout) << s.ToString();
  EXPECT_GE(Clock::now() - start, 190ms);
  EXPECT_LT(Clock::now() - start, 3s);
  EXPECT_FALSE(op0.Poll());

  // The operation goes on and completes once rank 1 pushes.
  PushPullHandle op1 = job.worker(1).PushPull(*t1, b1);
  ASSERT_TRUE(op0.Wait(In(kOpTimeout)).ok());
  ASSERT_TRUE(op1.Wait(In(kOpTimeout)).ok());
  EXPECT_TRUE(CheckTensor(DataType::kFloat32, 0, 2, 0, false, b0));
  EXPECT_TRUE(CheckTensor(DataType::kFloat32, 0, 2, 0, false, b1));
  job.FinishCleanly();
}

TEST(JobTest, WaitTimesOutWhenAnotherWorkerHasNotPushed) { ExpectWaitTimesOutThenCompletes({}); }

TEST(JobTest, Barrier) {
  JobConfig config;
  config.workers = 3;
  Job job;
  ASSERT_NO_FATAL_FAILURE(job.Start(config));
  for (int i = 0; i < 3; ++i) {
    OnEveryWorker(3, [&](uint32_t r) {
      Status s = job.worker(r).Barrier(In(kOpTimeout));
      EXPECT_TRUE(s.ok()) << s.ToString();
    });
  }
  job.FinishCleanly();
}

// ---- (e) many keys, many rounds ----------------------------------------------------------------

TEST(JobTest, ManyKeysManyRounds) {
  JobConfig config;
  config.workers = 2;
  config.servers = 2;
  config.partition_bytes = 256;
  Job job;
  ASSERT_NO_FATAL_FAILURE(job.Start(config));
  const std::vector<TensorSpec> specs = ManyKeySpecs();
  RunRounds(job, specs, 20);
  EXPECT_EQ(ServerRounds(job), ExpectedPartitionRounds(specs, config.partition_bytes, 20));
  job.FinishCleanly();
}

// ---- (f) priorities and credits ----------------------------------------------------------------

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
    EXPECT_LE(s.peak_bytes_ahead, config.servers * config.max_bytes_ahead) << "rank " << r;
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
    EXPECT_EQ(s.peak_bytes_ahead, config.servers * config.max_bytes_ahead) << "rank " << r;
  }
  job.FinishCleanly();
}

// A limit too big to multiply by the servers saturates: no partition is held (2^63 x 2 wrapped
// to 0 would send one partition at a time).
TEST(JobTest, HugeLeadLimitSaturates) {
  JobConfig config;
  config.servers = 2;
  config.partition_bytes = 4096;
  config.max_bytes_ahead = uint64_t{1} << 63;
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

// One worker averages, the other sums: each partition's round fails with kMismatch on every
// rank, and the next call on the tensor works.
void AverageDisagreementThenAgreement(Job& job, const std::string& name, uint64_t count) {
  OnEveryWorker(2, [&](uint32_t rank) {
    auto t = job.worker(rank).Declare(name, DataType::kFloat32, count);
    ASSERT_TRUE(t.ok());
    std::vector<std::byte>& buf = job.Buffer(count * 4);
    Status s = job.worker(rank).PushPull(*t, buf, {.average = rank == 0}).Wait(In(kOpTimeout));
    EXPECT_EQ(s.code(), Code::kMismatch) << "rank " << rank << ": " << s.ToString();
    EXPECT_NE(s.message().find("'" + name + "'"), std::string::npos) << s.message();
    EXPECT_NE(s.message().find("averages"), std::string::npos) << s.message();
    FillTensor(DataType::kFloat32, 0, rank, 0, buf);
    s = job.worker(rank).PushPull(*t, buf, {.average = true}).Wait(In(5s));
    ASSERT_TRUE(s.ok()) << "rank " << rank << ": " << s.ToString();
    EXPECT_TRUE(CheckTensor(DataType::kFloat32, 0, 2, 0, true, buf));
  });
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

// ---- (g) members that leave mid-job --------------------------------------------------------------

TEST(JobTest, UncleanWorkerLossAbortsTheJob) {
  // Rank 1 joins with a bare control connection and drops it without a goodbye: the scheduler
  // aborts the job, and rank 0's pending operation fails (naming the lost worker) instead of
  // waiting for a push that will never come.
  JobConfig config;
  config.workers = 2;
  config.servers = 2;
  config.fake_worker_ranks = {1};
  Job job;
  ASSERT_NO_FATAL_FAILURE(job.Start(config));
  auto t = job.worker(0).Declare("t", DataType::kFloat32, 100);
  ASSERT_TRUE(t.ok());
  std::vector<std::byte>& buf = job.Buffer(400);
  PushPullHandle op = job.worker(0).PushPull(*t, buf);
  EXPECT_EQ(op.Wait(In(100ms)).code(), Code::kTimeout);

  const auto start = Clock::now();
  job.DropFake(1);
  Status s = op.Wait(In(5s));
  EXPECT_LT(Clock::now() - start, 5s);
  EXPECT_TRUE(s.code() == Code::kPeerLost || s.code() == Code::kAborted) << s.ToString();
  EXPECT_NE(s.message().find("worker 1"), std::string::npos) << s.message();
  // Sticky: later operations fail at once too.
  Status later = job.worker(0).PushPull(*t, buf).Wait(In(1s));
  EXPECT_EQ(later.code(), s.code()) << later.ToString();
  EXPECT_FALSE(job.worker(0).Declare("u", DataType::kFloat32, 1).ok());
  // Everyone learns that the job failed.
  Status sched = job.scheduler().Wait(In(5s));
  EXPECT_EQ(sched.code(), Code::kPeerLost) << sched.ToString();
  for (uint32_t i = 0; i < 2; ++i) {
    Status srv = job.server(i).Wait(In(5s));
    EXPECT_FALSE(srv.ok());
    EXPECT_NE(srv.code(), Code::kTimeout) << srv.ToString();
  }
}

// Rank 0 shuts down while its op waits for rank 1: the op fails with kAborted, and so does
// every later one.
void ExpectShutdownFailsOwnPendingOps(const JobConfig& config, uint64_t count) {
  Job job;
  ASSERT_NO_FATAL_FAILURE(job.Start(config));
  auto t = job.worker(0).Declare("t", DataType::kFloat32, count);
  ASSERT_TRUE(t.ok());
  std::vector<std::byte>& buf = job.Buffer(count * 4);
  PushPullHandle op = job.worker(0).PushPull(*t, buf);
  EXPECT_EQ(op.Wait(In(100ms)).code(), Code::kTimeout);
  const auto start = Clock::now();
  EXPECT_TRUE(job.worker(0).Shutdown(In(5s)).ok());
  Status s = op.Wait(In(5s));
  EXPECT_EQ(s.code(), Code::kAborted) << s.ToString();
  EXPECT_LT(Clock::now() - start, 5s);
  EXPECT_TRUE(job.worker(0).Shutdown(In(5s)).ok());  // idempotent
  EXPECT_EQ(job.worker(0).PushPull(*t, buf).Wait(In(1s)).code(), Code::kAborted);
}

TEST(JobTest, ShutdownFailsTheWorkersOwnPendingOps) { ExpectShutdownFailsOwnPendingOps({}, 100); }

// The scheduler stops while rank 0's op waits for rank 1: the op fails within seconds.
void ExpectSchedulerStopAbortsPendingOps(const JobConfig& config) {
  Job job;
  ASSERT_NO_FATAL_FAILURE(job.Start(config));
  auto t = job.worker(0).Declare("t", DataType::kFloat32, 100);
  ASSERT_TRUE(t.ok());
  std::vector<std::byte>& buf = job.Buffer(400);
  PushPullHandle op = job.worker(0).PushPull(*t, buf);
  EXPECT_EQ(op.Wait(In(100ms)).code(), Code::kTimeout);
  const auto start = Clock::now();
  job.scheduler().Stop();
  Status s = op.Wait(In(5s));
  EXPECT_LT(Clock::now() - start, 5s);
  EXPECT_TRUE(s.code() == Code::kAborted || s.code() == Code::kPeerLost) << s.ToString();
  EXPECT_EQ(job.scheduler().Wait(In(1s)).code(), Code::kAborted);
}

TEST(JobTest, SchedulerStopAbortsPendingOps) { ExpectSchedulerStopAbortsPendingOps({}); }

// A worker that leaves cleanly while another still waits on a round that needs its push: the
// other's op fails within seconds, naming it.
void ExpectCleanGoodbyeFailsTheOthersPendingOp(const JobConfig& config) {
  Job job;
  ASSERT_NO_FATAL_FAILURE(job.Start(config));
  auto t0 = job.worker(0).Declare("t", DataType::kFloat32, 100);
  auto t1 = job.worker(1).Declare("t", DataType::kFloat32, 100);
  ASSERT_TRUE(t0.ok() && t1.ok());
  std::vector<std::byte>& buf = job.Buffer(400);
  PushPullHandle op = job.worker(0).PushPull(*t0, buf);
  EXPECT_EQ(op.Wait(In(100ms)).code(), Code::kTimeout);
  const auto start = Clock::now();
  EXPECT_TRUE(job.worker(1).Shutdown(In(5s)).ok());
  Status s = op.Wait(In(5s));
  EXPECT_LT(Clock::now() - start, 5500ms);
  EXPECT_TRUE(s.code() == Code::kAborted || s.code() == Code::kPeerLost) << s.ToString();
  EXPECT_NE(s.message().find("worker 1"), std::string::npos) << s.message();
}

// Through the servers: the scheduler tells them (kMemberLeft), and they fail the round.
TEST(JobTest, CleanGoodbyeOfOneWorkerFailsTheOthersPendingOp) {
  ExpectCleanGoodbyeFailsTheOthersPendingOp({});
}

// Regression (src/scheduler/scheduler.cc OnGoodbye): a server that left mid-job (Stop() sends a
// goodbye) is only marked as left; the job is not aborted, so a worker whose push already sits on
// that server waited forever. Now the job fails, naming the server.
TEST(JobTest, ServerLeavingMidJobFailsPendingOps) {
  JobConfig config;
  Job job;
  ASSERT_NO_FATAL_FAILURE(job.Start(config));
  auto t0 = job.worker(0).Declare("t", DataType::kFloat32, 100);
  auto t1 = job.worker(1).Declare("t", DataType::kFloat32, 100);
  ASSERT_TRUE(t0.ok() && t1.ok());
  std::vector<std::byte>& b0 = job.Buffer(400);
  std::vector<std::byte>& b1 = job.Buffer(400);
  PushPullHandle op = job.worker(0).PushPull(*t0, b0);
  EXPECT_EQ(op.Wait(In(200ms)).code(), Code::kTimeout);  // pushed; waits for rank 1
  const auto start = Clock::now();
  job.server(0).Stop();
  Status s = op.Wait(In(5s));
  EXPECT_LT(Clock::now() - start, 5500ms);
  EXPECT_TRUE(s.code() == Code::kAborted || s.code() == Code::kPeerLost) << s.ToString();
  Status s1 = job.worker(1).PushPull(*t1, b1).Wait(In(5s));
  EXPECT_TRUE(s1.code() == Code::kAborted || s1.code() == Code::kPeerLost) << s1.ToString();
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

size_t CountEntries(const char* dir) {
  size_t n = 0;
  for ([[maybe_unused]] const auto& e : std::filesystem::directory_iterator(dir)) ++n;
  return n;
}

// After a job that failed mid-round (scheduler stopped under a pending op) has been torn down,
// the process holds exactly the threads and file descriptors it had before.
TEST(JobTest, NoThreadOrFdLeaksAfterAFailedJob) {
  // Runtimes that start a helper thread with the first thread (ThreadSanitizer's background
  // thread) do so now, before the count.
  std::thread([] {}).join();
  const size_t threads_before = CountEntries("/proc/self/task");
  const size_t fds_before = CountEntries("/proc/self/fd");
  {
    JobConfig config;
    config.servers = 2;
    Job job;
    ASSERT_NO_FATAL_FAILURE(job.Start(config));
    auto t0 = job.worker(0).Declare("t", DataType::kFloat32, 100000);
    auto t1 = job.worker(1).Declare("t", DataType::kFloat32, 100000);
    ASSERT_TRUE(t0.ok() && t1.ok());
    std::vector<std::byte>& b0 = job.Buffer(400000);
    std::vector<std::byte>& b1 = job.Buffer(400000);
    PushPullHandle h0 = job.worker(0).PushPull(*t0, b0);
    PushPullHandle h1 = job.worker(1).PushPull(*t1, b1);
    ASSERT_TRUE(h0.Wait(In(5s)).ok());
    ASSERT_TRUE(h1.Wait(In(5s)).ok());
    PushPullHandle pending = job.worker(0).PushPull(*t0, b0);  // rank 1 never joins this round
    job.scheduler().Stop();
    Status s = pending.Wait(In(5s));
    EXPECT_NE(s.code(), Code::kOk);
    EXPECT_NE(s.code(), Code::kTimeout) << s.ToString();
  }
  EXPECT_EQ(CountEntries("/proc/self/task"), threads_before);
  EXPECT_EQ(CountEntries("/proc/self/fd"), fds_before);
}


// ---- (h) the same-host path (src/worker/local_reduce.h) ------------------------------------------

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
// has not started while both sum a large tensor. (A pass sums at most kPassSums chunks per
// operation before the deadline is looked at; this test does not hold a stream open long
// enough to tell that bound from a whole-tensor pass.)
TEST(LocalPathTest, WaitKeepsItsDeadlineWhileOtherTrafficFlows) {
  Job job;
  ASSERT_NO_FATAL_FAILURE(job.Start(LocalConfig(2, 1024)));
  constexpr uint64_t kBig = 4u << 20;  // floats: 16 MiB, 16384 chunks
  OnEveryWorker(2, [&](uint32_t rank) {
    auto big = job.worker(rank).Declare("big", DataType::kFloat32, kBig);
    auto lone = job.worker(rank).Declare("lone", DataType::kFloat32, 10);
    ASSERT_TRUE(big.ok() && lone.ok());
    std::vector<std::byte>& b = job.Buffer(kBig * 4);
    std::vector<std::byte>& l = job.Buffer(40);
    FillTensor(DataType::kFloat32, 0, rank, 0, b);
    PushPullHandle lone_op;
    if (rank == 0) lone_op = job.worker(0).PushPull(*lone, l);
    PushPullHandle big_op = job.worker(rank).PushPull(*big, b);
    if (rank == 0) {
      const auto start = Clock::now();
      EXPECT_EQ(lone_op.Wait(In(50ms)).code(), Code::kTimeout);
      EXPECT_LT(Clock::now() - start, 300ms);
    }
    ASSERT_TRUE(big_op.Wait(In(kOpTimeout)).ok());
    EXPECT_TRUE(CheckTensor(DataType::kFloat32, 0, 2, 0, false, b));
    if (rank == 1) lone_op = job.worker(1).PushPull(*lone, l);
    EXPECT_TRUE(lone_op.Wait(In(kOpTimeout)).ok());
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

// The scheduler's verdict fails the waiting op.
TEST(LocalPathTest, SchedulerStopAbortsPendingOps) {
  ExpectSchedulerStopAbortsPendingOps(LocalConfig(2, 1024));
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
