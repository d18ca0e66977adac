// Whole jobs in one process (scheduler on 127.0.0.1, servers and workers on threads over the
// inproc fabric) whose servers have unequal placement weights: every sum is still exact against
// a scalar reference, each server reduces about its weight's share of the bytes, server ids
// follow the weights whatever order the servers connect in, and bad weights are refused.
#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "gradlink/scheduler.h"
#include "gradlink/server.h"
#include "gradlink/worker.h"
#include "control/join.h"
#include "transport/transport.h"
#include "unit/support/job_harness.h"
#include "server/start_on.h"

namespace gradlink {
namespace {

using namespace std::chrono_literals;
using test::In;
using test::Job;
using test::JobConfig;
using test::kConnectTimeout;
using test::OnEveryWorker;

// An operation's deadline in this suite: its rounds are small, and it has always allowed 10 s
// (the shared kOpTimeout, 20 s, would loosen that).
constexpr auto kRoundTimeout = 10s;

// What rank r pushes for element i of tensor t in round k: an integer small enough that fp32
// sums of a few ranks are exact, so the reference is an exact scalar loop.
int64_t Value(uint32_t t, uint32_t r, uint32_t k, uint64_t i) {
  return static_cast<int64_t>((i * 2654435761u + t * 97 + r * 1009 + k * 31) % 20001) - 10000;
}

struct Spec {
  std::string name;
  DataType dtype;  // kFloat32 or kInt64
  uint64_t count;
};

// Every worker declares `specs`, then runs `rounds` rounds of PushPull over all of them and
// checks every element against the scalar sum over ranks.
void RunRounds(Job& job, const std::vector<Spec>& specs, uint32_t rounds) {
  const uint32_t n = job.config().workers;
  OnEveryWorker(n, [&](uint32_t r) {
    Worker& w = job.worker(r);
    std::vector<TensorHandle> handles;
    std::vector<std::vector<std::byte>*> bufs;  // outlive an op a failing check leaves pending
    for (const Spec& s : specs) {
      auto h = w.Declare(s.name, s.dtype, s.count);
      ASSERT_TRUE(h.ok()) << h.status().ToString();
      handles.push_back(*h);
      bufs.push_back(&job.Buffer(s.count * DataTypeSize(s.dtype)));
    }
    for (uint32_t k = 0; k < rounds; ++k) {
      std::vector<PushPullHandle> ops;
      for (uint32_t t = 0; t < specs.size(); ++t) {
        for (uint64_t i = 0; i < specs[t].count; ++i) {
          const int64_t v = Value(t, r, k, i);
          if (specs[t].dtype == DataType::kFloat32) {
            const float f = static_cast<float>(v);
            std::memcpy(bufs[t]->data() + 4 * i, &f, 4);
          } else {
            std::memcpy(bufs[t]->data() + 8 * i, &v, 8);
          }
        }
        ops.push_back(w.PushPull(handles[t], *bufs[t]));
      }
      for (uint32_t t = 0; t < specs.size(); ++t) {
        Status s = ops[t].Wait(In(kRoundTimeout));
        ASSERT_TRUE(s.ok()) << "rank " << r << " " << specs[t].name << ": " << s.ToString();
        uint64_t bad = 0;
        for (uint64_t i = 0; i < specs[t].count; ++i) {
          int64_t want = 0;
          for (uint32_t q = 0; q < n; ++q) want += Value(t, q, k, i);
          if (specs[t].dtype == DataType::kFloat32) {
            float got;
            std::memcpy(&got, bufs[t]->data() + 4 * i, 4);
            bad += got != static_cast<float>(want);
          } else {
            int64_t got;
            std::memcpy(&got, bufs[t]->data() + 8 * i, 8);
            bad += got != want;
          }
        }
        EXPECT_EQ(bad, 0u) << "rank " << r << " " << specs[t].name << " round " << k;
      }
    }
  });
}

// Runs a job on `weights` and checks sums, ids and each server's share of the bytes.
void CheckWeightedJob(const std::vector<double>& weights, const std::vector<size_t>& order) {
  constexpr uint32_t kWorkers = 3, kRounds = 3;
  constexpr uint64_t kPartition = 4096;
  JobConfig config;
  config.workers = kWorkers;
  config.servers = static_cast<uint32_t>(weights.size());
  config.job = "weighted";
  config.partition_bytes = kPartition;
  config.server_weights = weights;
  config.server_start_order = order;
  config.server_start_gap = 150ms;  // far enough apart to register in that order
  Job job;
  ASSERT_NO_FATAL_FAILURE(job.Start(config));

  // Ids: heaviest first, equal weights in connection order.
  std::vector<size_t> by_id(weights.size());
  for (size_t i = 0; i < weights.size(); ++i) {
    ASSERT_LT(job.server(i).id(), weights.size());
    by_id[job.server(i).id()] = i;
  }
  for (size_t id = 1; id < by_id.size(); ++id) {
    EXPECT_GE(weights[by_id[id - 1]], weights[by_id[id]]) << "server id " << id;
  }

  std::vector<Spec> specs;
  uint64_t total = 0;
  for (uint32_t t = 0; t < 24; ++t) {
    const DataType dtype = t % 2 ? DataType::kInt64 : DataType::kFloat32;
    const uint64_t count = t % 6 == 0 ? 60000 : 500 + 700 * t;
    specs.push_back({"layer" + std::to_string(t), dtype, count});
    total += count * DataTypeSize(dtype);
  }
  RunRounds(job, specs, kRounds);

  double sum_w = 0;
  for (double w : weights) sum_w += w;
  uint64_t reduced = 0;
  for (size_t i = 0; i < weights.size(); ++i) {
    const uint64_t b = job.server(i).stats().bytes_reduced;
    reduced += b;
    ASSERT_EQ(b % (kWorkers * kRounds), 0u);
    const double load = double(b / (kWorkers * kRounds));  // bytes of the model it holds
    const double ideal = double(total) * weights[i] / sum_w;
    EXPECT_LE(load, ideal + kPartition) << "server with weight " << weights[i];
    EXPECT_GE(load, ideal - double(weights.size() - 1) * kPartition)
        << "server with weight " << weights[i];
  }
  EXPECT_EQ(reduced, total * kWorkers * kRounds);
  job.FinishCleanly();
}

TEST(WeightedJobTest, OneToThreeExactSumsAndShares) {
  CheckWeightedJob({1, 3}, {0, 1});  // the light server connects first, yet gets id 1
}

TEST(WeightedJobTest, OneToThreeHeavyConnectsFirst) { CheckWeightedJob({1, 3}, {1, 0}); }

TEST(WeightedJobTest, MixedPlacementWeights) {
  // n = 4 worker hosts, k = 2 dedicated: dedicated servers hold 0.3 each, colocated ones 0.1.
  CheckWeightedJob({0.1, 0.3, 0.1, 0.3}, {0, 2, 1, 3});
}

TEST(WeightedJobTest, ServersThatClaimIdsGetThemWhateverTheirWeightsAndOrder) {
  // gradlink-run gives server i id i, so that its "server i" is the scheduler's. The claims win
  // over "heaviest first": the light server claims 0 and connects last; sums stay exact.
  JobConfig config;
  config.workers = 2;
  config.servers = 3;
  config.job = "claimed-ids";
  config.partition_bytes = 4096;
  config.server_weights = {1, 3, 2};
  config.server_ids = {0, 2, 1};
  config.server_start_order = {1, 2, 0};
  config.server_start_gap = 100ms;
  Job job;
  ASSERT_NO_FATAL_FAILURE(job.Start(config));
  for (size_t i = 0; i < config.servers; ++i) {
    EXPECT_EQ(job.server(i).id(), static_cast<uint32_t>(config.server_ids[i])) << "server " << i;
  }
  RunRounds(job, {{"a", DataType::kFloat32, 30000}, {"b", DataType::kInt64, 7000}}, 2);
  job.FinishCleanly();
}

TEST(WeightedJobTest, AServerIdOutOfRangeIsRefusedNamingIt) {
  SchedulerOptions so;
  so.num_workers = 1;
  so.num_servers = 2;
  so.join_timeout = kConnectTimeout;
  auto sched = Scheduler::Start(so);
  ASSERT_TRUE(sched.ok()) << sched.status().ToString();
  wire::RegisterMsg reg;
  reg.role = wire::Role::kServer;
  reg.requested_rank = 2;
  reg.host = "misnumbered";
  Result<Joined> j = JoinJob("127.0.0.1:" + std::to_string((*sched)->port()),
                             wire::JobHash("default"), reg, In(3s));
  ASSERT_FALSE(j.ok());
  EXPECT_NE(j.status().message().find("server id 2 out of range for 2 servers"),
            std::string::npos) << j.status().ToString();
  (*sched)->Stop();
}

TEST(WeightedJobTest, InvalidWeightIsRefusedBeforeJoining) {
  for (double w : {0.0, -1.0, std::nan(""), std::numeric_limits<double>::infinity(),
                   -std::numeric_limits<double>::infinity(), 1e-7, 2e6}) {
    ServerOptions o;
    o.scheduler = "127.0.0.1:1";  // never contacted: the options are checked first
    o.connect_timeout = 5s;
    o.weight = w;
    const auto start = Clock::now();
    auto s = StartServerOn(o, transport::CreateInprocFabric());
    ASSERT_FALSE(s.ok()) << "weight " << w;
    EXPECT_EQ(s.status().code(), Code::kInvalidArgument) << s.status().ToString();
    EXPECT_NE(s.status().message().find("weight"), std::string::npos) << s.status().ToString();
    EXPECT_LT(Clock::now() - start, 1s);
  }
}

TEST(WeightedJobTest, SchedulerRefusesARegistrationWithABadWeight) {
  // A member that skips the option check (a bad peer): its kRegister is a protocol error, its
  // connection is closed, and it never joins.
  SchedulerOptions so;
  so.num_workers = 1;
  so.num_servers = 1;
  so.join_timeout = kConnectTimeout;
  auto sched = Scheduler::Start(so);
  ASSERT_TRUE(sched.ok()) << sched.status().ToString();
  const std::string address = "127.0.0.1:" + std::to_string((*sched)->port());
  wire::RegisterMsg reg;
  reg.role = wire::Role::kServer;
  reg.host = "rogue";
  reg.push_address.assign(8, std::byte{1});
  reg.pull_address.assign(8, std::byte{1});
  reg.weight = std::nan("");
  Result<Joined> j = JoinJob(address, wire::JobHash("default"), reg, In(3s));
  EXPECT_FALSE(j.ok());
  const auto deadline = In(3s);
  while ((*sched)->protocol_errors() == 0 && Clock::now() < deadline) {
    std::this_thread::sleep_for(10ms);
  }
  EXPECT_EQ((*sched)->protocol_errors(), 1u);
  (*sched)->Stop();
}

}  // namespace
}  // namespace gradlink
