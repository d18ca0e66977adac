// Tests of the Placer: partition sizes, exact coverage, byte balance across servers, edge cases
// (empty tensors, partitions smaller than one element) and determinism.
#include "scheduler/placement.h"

#include <gtest/gtest.h>

#include <algorithm>
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

TEST(PlacementTest, BalancesBytesAcrossServers) {
  for (uint32_t servers : {1u, 2u, 3u, 5u, 8u}) {
    for (uint64_t pb : {4096ull, 65536ull, 1ull << 20}) {
      Placer placer(servers);
      std::mt19937_64 rng(servers * 1000 + pb);
      for (int i = 0; i < 300; ++i) {
        const DataType t = kAllTypes[rng() % 6];
        // Mostly small tensors, some big ones spanning many partitions.
        const uint64_t count = (rng() % 4 == 0) ? rng() % 2000000 : rng() % 3000;
        placer.Plan(t, count, pb);
        const auto& load = placer.load_bytes();
        const auto [mn, mx] = std::minmax_element(load.begin(), load.end());
        // Greedy least-loaded placement: the most loaded server was the least loaded when it got
        // its last partition, and no partition exceeds partition_bytes.
        ASSERT_LE(*mx - *mn, pb) << servers << " servers, " << pb << "-byte partitions, after "
                                 << i + 1 << " tensors";
      }
    }
  }
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

}  // namespace
}  // namespace gradlink::scheduler
