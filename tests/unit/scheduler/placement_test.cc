// Tests of the Placer: partition sizes, exact coverage, byte balance across servers, edge cases
// (empty tensors, partitions smaller than one element) and determinism; with server weights,
// shares against the ideal w_i / sum(w) and against a brute-force search over all placements.
#include "scheduler/placement.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <cstdint>
#include <numeric>
#include <random>
#include <vector>

namespace gradlink::scheduler {
namespace {

constexpr DataType kAllTypes[] = {DataType::kFloat32, DataType::kFloat64, DataType::kFloat16,
                                  DataType::kBFloat16, DataType::kInt32,  DataType::kInt64};

// Partitions are contiguous, non-empty, cover [0, count) exactly, all but the last have exactly
// `per_part` elements, and name existing servers.
void ExpectTiling(const std::vector<wire::PartitionPlan>& plan, uint64_t count, uint64_t per_part,
                  uint32_t num_servers) {
  uint64_t next = 0;
  for (size_t i = 0; i < plan.size(); ++i) {
    const wire::PartitionPlan& p = plan[i];
    EXPECT_EQ(p.offset, next) << "partition " << i;
    EXPECT_GT(p.count, 0u) << "partition " << i;
    EXPECT_LT(p.server, num_servers) << "partition " << i;
    if (i + 1 < plan.size()) {
      EXPECT_EQ(p.count, per_part) << "partition " << i;
    } else {
      EXPECT_LE(p.count, per_part) << "last partition";
    }
    next += p.count;
  }
  EXPECT_EQ(next, count);
  EXPECT_EQ(plan.size(), (count + per_part - 1) / per_part);
}

TEST(PlacementTest, SplitsIntoPartitionsOfPartitionBytes) {
  Placer placer(3);
  // 1000 fp32 = 4000 bytes in 1024-byte partitions: 256 elements each, the last 232.
  auto plan = placer.Plan(DataType::kFloat32, 1000, 1024);
  ASSERT_EQ(plan.size(), 4u);
  ExpectTiling(plan, 1000, 256, 3);
  EXPECT_EQ(plan.back().count, 1000u - 3 * 256);
}

TEST(PlacementTest, ExactMultipleHasNoSmallerLastPartition) {
  Placer placer(2);
  auto plan = placer.Plan(DataType::kFloat64, 512, 1024);  // 4096 bytes = 4 x 1024
  ASSERT_EQ(plan.size(), 4u);
  for (const auto& p : plan) EXPECT_EQ(p.count, 128u);
}

TEST(PlacementTest, PartitionBytesNotAMultipleOfTheElementSize) {
  Placer placer(1);
  auto plan = placer.Plan(DataType::kFloat32, 10, 10);  // 2 elements (8 bytes) fit in 10
  ExpectTiling(plan, 10, 2, 1);
  EXPECT_EQ(plan.size(), 5u);
}

TEST(PlacementTest, CoversExactlyForManyShapes) {
  for (DataType t : kAllTypes) {
    const uint64_t size = DataTypeSize(t);
    for (uint64_t count : {1ull, 2ull, 7ull, 1000ull, 4097ull, 300000ull}) {
      for (uint64_t pb : {1ull, 8ull, 100ull, 4096ull, 65536ull, 1ull << 30}) {
        if (count / std::max<uint64_t>(1, pb / size) > 100000) continue;  // keep it fast
        Placer placer(4);
        auto plan = placer.Plan(t, count, pb);
        ExpectTiling(plan, count, std::max<uint64_t>(1, pb / size), 4);
      }
    }
  }
}

TEST(PlacementTest, WholeTensorInOnePartitionWhenItFits) {
  Placer placer(2);
  auto plan = placer.Plan(DataType::kInt64, 100, 4u << 20);
  ASSERT_EQ(plan.size(), 1u);
  EXPECT_EQ(plan[0].offset, 0u);
  EXPECT_EQ(plan[0].count, 100u);
  EXPECT_EQ(plan[0].server, 0u);
}

TEST(PlacementTest, EmptyTensorHasNoPartitions) {
  Placer placer(2);
  EXPECT_TRUE(placer.Plan(DataType::kFloat32, 0, 1024).empty());
  EXPECT_TRUE(placer.Plan(DataType::kFloat16, 0, 1).empty());
  EXPECT_EQ(placer.load_bytes(), (std::vector<uint64_t>{0, 0}));
}

TEST(PlacementTest, PartitionSmallerThanOneElementHoldsOneElement) {
  for (DataType t : kAllTypes) {
    for (uint64_t pb : {uint64_t{1}, uint64_t{DataTypeSize(t) - 1}}) {
      if (pb == 0) continue;
      Placer placer(3);
      auto plan = placer.Plan(t, 10, pb);
      ASSERT_EQ(plan.size(), 10u) << DataTypeName(t) << " pb " << pb;
      ExpectTiling(plan, 10, 1, 3);
    }
  }
}

TEST(PlacementTest, TiesGoToTheLowestServerId) {
  Placer placer(3);
  auto plan = placer.Plan(DataType::kFloat32, 12, 16);  // 3 equal partitions
  ASSERT_EQ(plan.size(), 3u);
  EXPECT_EQ(plan[0].server, 0u);
  EXPECT_EQ(plan[1].server, 1u);
  EXPECT_EQ(plan[2].server, 2u);
  // A small tensor next goes to server 0 (all tied again), then 1.
  EXPECT_EQ(placer.Plan(DataType::kFloat32, 1, 16)[0].server, 0u);
  EXPECT_EQ(placer.Plan(DataType::kFloat32, 1, 16)[0].server, 1u);
}

TEST(PlacementTest, SmallTensorsSpreadOverServers) {
  // Many one-partition tensors: without balancing they would all land on server 0.
  Placer placer(4);
  std::vector<int> per_server(4, 0);
  for (int i = 0; i < 40; ++i) per_server[placer.Plan(DataType::kFloat32, 100, 1 << 20)[0].server]++;
  for (int n : per_server) EXPECT_EQ(n, 10);
}

TEST(PlacementTest, LoadBytesAccountForEveryPartition) {
  Placer placer(3);
  uint64_t total = 0;
  std::mt19937_64 rng(7);
  std::vector<uint64_t> expected(3, 0);
  for (int i = 0; i < 50; ++i) {
    const DataType t = kAllTypes[rng() % 6];
    const uint64_t count = rng() % 5000;
    auto plan = placer.Plan(t, count, 1 + rng() % 8192);
    for (const auto& p : plan) expected[p.server] += p.count * DataTypeSize(t);
    total += count * DataTypeSize(t);
  }
  EXPECT_EQ(placer.load_bytes(), expected);
  EXPECT_EQ(std::accumulate(expected.begin(), expected.end(), uint64_t{0}), total);
}

TEST(PlacementTest, BalancesCostAcrossServers) {
  constexpr uint64_t kCharge = Placer::kPartitionCostBytes;
  for (uint32_t servers : {1u, 2u, 3u, 5u, 8u}) {
    for (uint64_t pb : {4096ull, 65536ull, 1ull << 20}) {
      Placer placer(servers);
      std::mt19937_64 rng(servers * 1000 + pb);
      for (int i = 0; i < 300; ++i) {
        const DataType t = kAllTypes[rng() % 6];
        // Mostly small tensors, some big ones spanning many partitions.
        const uint64_t count = (rng() % 4 == 0) ? rng() % 2000000 : rng() % 3000;
        placer.Plan(t, count, pb);
        const auto& cost = placer.load_cost();
        const auto [mn, mx] = std::minmax_element(cost.begin(), cost.end());
        // Greedy least-cost placement: the costliest server was the cheapest when it got its
        // last partition, which costs at most partition_bytes plus the charge.
        ASSERT_LE(*mx - *mn, pb + kCharge) << servers << " servers, " << pb
                                           << "-byte partitions, after " << i + 1 << " tensors";
        // Bytes then differ by at most that plus the charges of the partitions counts differ by.
        const auto& bytes = placer.load_bytes();
        const auto& parts = placer.partitions();
        for (uint32_t a = 0; a < servers; ++a) {
          for (uint32_t b = 0; b < servers; ++b) {
            ASSERT_EQ(cost[a], bytes[a] + kCharge * parts[a]);
            if (bytes[a] > bytes[b]) {
              const uint64_t more_parts = parts[b] > parts[a] ? parts[b] - parts[a] : 0;
              ASSERT_LE(bytes[a] - bytes[b], pb + kCharge + kCharge * more_parts);
            }
          }
        }
      }
    }
  }
}

TEST(PlacementTest, SmallKeysAfterALargeOneSpreadByCount) {
  // A tensor of 1.5 partitions leaves server 1 a half partition (2 MiB) short. By bytes alone,
  // the next 20,000 one-element keys (80 KB in all) would all go to server 1.
  Placer placer(2);
  placer.Plan(DataType::kFloat32, 3 << 19, 4 << 20);
  ASSERT_EQ(placer.load_bytes(), (std::vector<uint64_t>{4 << 20, 2 << 20}));
  for (int i = 0; i < 20000; ++i) placer.Plan(DataType::kFloat32, 1, 4 << 20);
  const auto& parts = placer.partitions();
  // The 2 MiB gap costs 2 MiB / (16 KiB + 4 B) = 128 charges; then the keys alternate.
  EXPECT_NEAR(static_cast<double>(parts[1]) - static_cast<double>(parts[0]), 128.0, 2.0);
  EXPECT_GE(parts[0], 9900u);
}

TEST(PlacementTest, IsDeterministic) {
  auto run = [] {
    Placer placer(5);
    std::mt19937_64 rng(1234);
    std::vector<std::vector<wire::PartitionPlan>> plans;
    for (int i = 0; i < 200; ++i) {
      plans.push_back(placer.Plan(kAllTypes[rng() % 6], rng() % 100000, 1 + rng() % 65536));
    }
    return std::make_pair(plans, placer.load_bytes());
  };
  const auto a = run();
  const auto b = run();
  ASSERT_EQ(a.first.size(), b.first.size());
  for (size_t i = 0; i < a.first.size(); ++i) {
    ASSERT_EQ(a.first[i].size(), b.first[i].size()) << i;
    for (size_t j = 0; j < a.first[i].size(); ++j) {
      EXPECT_EQ(a.first[i][j].offset, b.first[i][j].offset);
      EXPECT_EQ(a.first[i][j].count, b.first[i][j].count);
      EXPECT_EQ(a.first[i][j].server, b.first[i][j].server);
    }
  }
  EXPECT_EQ(a.second, b.second);
}

TEST(PlacementTest, PlanDependsOnCallHistoryOnly) {
  // Two placers fed the same sequence agree even when interleaved with each other.
  Placer a(3), b(3);
  for (int i = 1; i <= 20; ++i) {
    auto pa = a.Plan(DataType::kFloat32, 100 * i, 256);
    auto pb = b.Plan(DataType::kFloat32, 100 * i, 256);
    ASSERT_EQ(pa.size(), pb.size());
    for (size_t j = 0; j < pa.size(); ++j) EXPECT_EQ(pa[j].server, pb[j].server);
  }
}

TEST(PlacementTest, MoveShiftsLoadToANewServer) {
  // Rebalancing: a partition moved to a standby activated mid-job leaves the load, cost and
  // count exactly as if it had been placed there, and later partitions see it.
  Placer p(2);
  p.PlaceOn(0, 4000);
  p.PlaceOn(1, 4000);
  p.PlaceOn(0, 1000);
  p.AddStandby(2, 1.0);
  EXPECT_FALSE(p.active(2));
  p.Activate(2);
  EXPECT_TRUE(p.active(2));
  p.Move(0, 2, 4000);
  EXPECT_EQ(p.load_bytes(), (std::vector<uint64_t>{1000, 4000, 4000}));
  EXPECT_EQ(p.partitions(), (std::vector<uint64_t>{1, 1, 1}));
  EXPECT_EQ(p.load_cost()[0], 1000 + Placer::kPartitionCostBytes);
  EXPECT_EQ(p.load_cost()[2], 4000 + Placer::kPartitionCostBytes);
  EXPECT_EQ(p.Place(10), 0u);  // the lightest now
  p.Retire(1);
  EXPECT_FALSE(p.active(1));
}

// ---- Weighted placement -----------------------------------------------------------------------

// Runs the same random sequence of Plan() calls on `a` and `b`; they must agree on everything.
void ExpectSamePlans(Placer& a, Placer& b, uint64_t seed, int tensors) {
  std::mt19937_64 rng(seed);
  for (int i = 0; i < tensors; ++i) {
    const DataType t = kAllTypes[rng() % 6];
    const uint64_t count = rng() % 4 == 0 ? rng() % 500000 : rng() % 3000;
    const uint64_t pb = 1 + rng() % 65536;
    const auto pa = a.Plan(t, count, pb);
    const auto pbb = b.Plan(t, count, pb);
    ASSERT_EQ(pa.size(), pbb.size()) << "tensor " << i;
    for (size_t j = 0; j < pa.size(); ++j) {
      ASSERT_EQ(pa[j].offset, pbb[j].offset) << "tensor " << i << " partition " << j;
      ASSERT_EQ(pa[j].count, pbb[j].count) << "tensor " << i << " partition " << j;
      ASSERT_EQ(pa[j].server, pbb[j].server) << "tensor " << i << " partition " << j;
    }
  }
  EXPECT_EQ(a.load_bytes(), b.load_bytes());
}

TEST(WeightedPlacementTest, EqualWeightsPlanExactlyAsUnweighted) {
  for (double w : {1.0, 0.3, 7.0, 1e-6, 1e6}) {
    for (uint32_t n : {1u, 2u, 5u}) {
      Placer plain(n);
      Placer weighted(std::vector<double>(n, w));
      ExpectSamePlans(plain, weighted, 99 + n, 300);
    }
  }
}

TEST(WeightedPlacementTest, ScalingAllWeightsChangesNothing) {
  // Only ratios matter, even where the scaled weights are not exact in binary (0.1, 0.3).
  for (const auto& scaled : std::vector<std::vector<double>>{
           {0.1, 0.3, 0.2}, {0.5, 1.5, 1.0}, {1e-5, 3e-5, 2e-5}, {1e5, 3e5, 2e5}}) {
    Placer a(std::vector<double>{1, 3, 2});
    Placer b(scaled);
    ExpectSamePlans(a, b, 5, 300);
  }
}

TEST(WeightedPlacementTest, TiesGoToTheLowestServerId) {
  // One-element partitions of 4 bytes on weights {0.3, 0.3, 0.1, 0.1}: the empty servers first
  // in id order, then by bytes / weight; 12/0.3 and 4/0.1 tie (though not in binary) at the end.
  Placer placer(std::vector<double>{0.3, 0.3, 0.1, 0.1});
  std::vector<uint32_t> got;
  for (int i = 0; i < 9; ++i) got.push_back(placer.Plan(DataType::kFloat32, 1, 4)[0].server);
  EXPECT_EQ(got, (std::vector<uint32_t>{0, 1, 2, 3, 0, 1, 0, 1, 0}));
}

// The ideal bytes of server i: total * w_i / sum(w), computed independently of the Placer.
std::vector<double> IdealShares(const std::vector<double>& w, double total) {
  double sum = 0;
  for (double x : w) sum += x;
  std::vector<double> out;
  for (double x : w) out.push_back(total * x / sum);
  return out;
}

TEST(WeightedPlacementTest, WeightsOneAndThreeGiveAQuarterAndThreeQuarters) {
  // Shares are of the cost: bytes plus Placer::kPartitionCostBytes per partition.
  constexpr uint64_t kCharge = Placer::kPartitionCostBytes;
  for (uint64_t pb : {4ull, 1000ull, 4096ull, 1ull << 20}) {
    Placer placer(std::vector<double>{1, 3});
    std::mt19937_64 rng(pb);
    double total = 0;
    uint64_t largest = 0;
    for (int i = 0; i < 400; ++i) {
      // Some tensors of up to 300 partitions, most of a few elements.
      const uint64_t per_part = std::max<uint64_t>(1, pb / 4);
      const uint64_t count = rng() % 3 == 0 ? rng() % (300 * per_part) : 1 + rng() % 5000;
      for (const auto& p : placer.Plan(DataType::kFloat32, count, pb)) {
        largest = std::max(largest, p.count * 4 + kCharge);
        total += double(p.count * 4 + kCharge);
      }
      const auto ideal = IdealShares({1, 3}, total);
      for (int s = 0; s < 2; ++s) {
        // Two servers: each within one partition of its share (a quarter, three quarters).
        ASSERT_LE(std::fabs(double(placer.load_cost()[s]) - ideal[s]), double(largest))
            << "server " << s << " after " << i + 1 << " tensors, " << pb << "-byte partitions";
      }
    }
    // With this many partitions, one is a small fraction of the whole.
    if (pb <= 4096) {
      EXPECT_NEAR(double(placer.load_cost()[0]) / total, 0.25, 1e-3) << pb;
    }
  }
}

TEST(WeightedPlacementTest, ManySmallPartitionsOnMixedWeights) {
  // BytePS-style mixed placement, n = 4 worker hosts, k = 2 dedicated server hosts: each
  // dedicated server holds 0.3 of the model, each worker-colocated one 0.1.
  const std::vector<double> w = {0.3, 0.3, 0.1, 0.1};
  Placer placer(w);
  const uint64_t part = 4096;
  for (int i = 1; i <= 8000; ++i) {
    placer.Plan(DataType::kFloat32, part / 4, part);  // one partition each
    const auto ideal = IdealShares(w, double(i) * part);
    for (size_t s = 0; s < w.size(); ++s) {
      const double load = double(placer.load_bytes()[s]);
      // Never more than one partition above its share; never below by more than the others
      // together can be above theirs.
      ASSERT_LE(load, ideal[s] + part + 1e-6) << "server " << s << " after " << i;
      ASSERT_GE(load, ideal[s] - 3.0 * part - 1e-6) << "server " << s << " after " << i;
    }
    if (i % 8 == 0) {
      // Whole multiples of the weights' denominator: the shares are met exactly.
      const auto want = IdealShares(w, double(i));
      for (size_t s = 0; s < w.size(); ++s) {
        ASSERT_EQ(placer.load_bytes()[s], uint64_t(std::llround(want[s])) * part)
            << "server " << s << " after " << i;
      }
    }
  }
  const auto& load = placer.load_bytes();
  EXPECT_EQ(load, (std::vector<uint64_t>{3000 * part, 3000 * part, 1000 * part, 1000 * part}));
}

TEST(WeightedPlacementTest, RandomWeightsAndSizesStayWithinOnePartitionAboveTheShare) {
  // Shares are of the cost: bytes plus Placer::kPartitionCostBytes per partition.
  constexpr uint64_t kCharge = Placer::kPartitionCostBytes;
  std::mt19937_64 rng(2024);
  for (int trial = 0; trial < 60; ++trial) {
    const uint32_t n = 2 + rng() % 7;
    std::vector<double> w(n);
    for (double& x : w) x = std::exp(std::uniform_real_distribution<double>(-3, 3)(rng));
    Placer placer(w);
    std::vector<uint64_t> bytes(n, 0), expected(n, 0), last_part(n, 0);
    double total = 0;
    uint64_t largest = 0;
    for (int i = 0; i < 200; ++i) {
      const DataType t = kAllTypes[rng() % 6];
      const uint64_t count = rng() % 4 == 0 ? rng() % 200000 : rng() % 3000;
      const uint64_t pb = 1 + rng() % 16384;
      auto plan = placer.Plan(t, count, pb);
      ExpectTiling(plan, count, std::max<uint64_t>(1, pb / DataTypeSize(t)), n);
      for (const auto& p : plan) {
        const uint64_t cost = p.count * DataTypeSize(t) + kCharge;
        bytes[p.server] += p.count * DataTypeSize(t);
        expected[p.server] += cost;
        last_part[p.server] = cost;
        largest = std::max(largest, cost);
        total += double(cost);
      }
      ASSERT_EQ(placer.load_bytes(), bytes);
      ASSERT_EQ(placer.load_cost(), expected);
      const auto ideal = IdealShares(w, total);
      for (uint32_t s = 0; s < n; ++s) {
        const double load = double(expected[s]);
        // At or below its share when it got its last partition (up to the 1e-12 tie margin).
        ASSERT_LE(load, ideal[s] * (1 + 1e-9) + double(last_part[s]))
            << "trial " << trial << " server " << s << " of " << n << " after " << i + 1;
        ASSERT_GE(load, ideal[s] - double(n - 1) * double(largest) - 1e-6)
            << "trial " << trial << " server " << s << " of " << n << " after " << i + 1;
      }
    }
  }
}

// Every way of giving `parts` equal partitions to w.size() servers, as partition counts.
void ForEachPlacement(size_t servers, uint32_t parts,
                      const std::function<void(const std::vector<uint32_t>&)>& fn) {
  std::vector<uint32_t> c(servers, 0);
  std::function<void(size_t, uint32_t)> rec = [&](size_t i, uint32_t left) {
    if (i + 1 == servers) {
      c[i] = left;
      fn(c);
      return;
    }
    for (uint32_t k = 0; k <= left; ++k) {
      c[i] = k;
      rec(i + 1, left - k);
    }
  };
  rec(0, parts);
}

TEST(WeightedPlacementTest, EqualPartitionsMatchBruteForce) {
  // Against every possible placement of P equal partitions: the Placer's placement (1) keeps
  // each server within one partition above its share, which some placement always can, and
  // (2) has the largest smallest partitions-per-weight of all placements: no server is left
  // further behind its share than it must be.
  std::mt19937_64 rng(77);
  const double choices[] = {0.1, 0.3, 1, 2, 3, 5, 0.25};
  for (int trial = 0; trial < 200; ++trial) {
    const size_t n = 2 + rng() % 3;
    std::vector<double> w(n);
    for (double& x : w) x = choices[rng() % 7];
    const uint32_t parts = 1 + rng() % 10;
    Placer placer(w);
    std::vector<uint32_t> got(n, 0);
    for (uint32_t i = 0; i < parts; ++i) got[placer.Plan(DataType::kInt64, 1, 8)[0].server]++;
    const auto ideal = IdealShares(w, parts);
    auto min_ratio = [&](const std::vector<uint32_t>& c) {
      double m = INFINITY;
      for (size_t s = 0; s < n; ++s) m = std::min(m, c[s] / w[s]);
      return m;
    };
    double best = -1;
    bool upper_quota_possible = false;
    ForEachPlacement(n, parts, [&](const std::vector<uint32_t>& c) {
      best = std::max(best, min_ratio(c));
      bool ok = true;
      for (size_t s = 0; s < n; ++s) ok = ok && c[s] <= ideal[s] + 1 + 1e-9;
      upper_quota_possible = upper_quota_possible || ok;
    });
    ASSERT_TRUE(upper_quota_possible);
    for (size_t s = 0; s < n; ++s) {
      EXPECT_LT(double(got[s]), ideal[s] + 1) << "trial " << trial << " server " << s;
    }
    EXPECT_NEAR(min_ratio(got), best, 1e-9 * best) << "trial " << trial;
  }
}

}  // namespace
}  // namespace gradlink::scheduler
