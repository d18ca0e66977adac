// server/fair_queue.h: deficit round robin across tenants, checked against the shares it
// promises (weights of backlogged tenants), FIFO within a tenant, and no saved-up credit.
#include "server/fair_queue.h"

#include <gtest/gtest.h>

#include <map>
#include <vector>

namespace gradlink::server {
namespace {

constexpr uint64_t kQuantum = 64 << 10;

// Pops `n` tasks (each a cost) and returns the bytes served per tenant.
std::map<uint32_t, uint64_t> Serve(FairQueue<uint64_t>& q, int n) {
  std::map<uint32_t, uint64_t> bytes;
  for (int i = 0; i < n; ++i) {
    uint32_t tenant = 0;
    std::optional<uint64_t> cost = q.Pop(&tenant);
    if (!cost) break;
    bytes[tenant] += *cost;
  }
  return bytes;
}

TEST(FairQueueTest, OneTenantIsFifoAndGetsEverything) {
  FairQueue<int> q(kQuantum);
  for (int i = 0; i < 100; ++i) q.Push(7, 1000 * (i % 5 + 1), i);
  EXPECT_EQ(q.size(), 100u);
  for (int i = 0; i < 100; ++i) {
    uint32_t tenant = 0;
    std::optional<int> t = q.Pop(&tenant);
    ASSERT_TRUE(t.has_value());
    EXPECT_EQ(*t, i);
    EXPECT_EQ(tenant, 7u);
  }
  EXPECT_FALSE(q.Pop().has_value());
  EXPECT_TRUE(q.empty());
}

TEST(FairQueueTest, BackloggedTenantsShareByWeight) {
  FairQueue<uint64_t> q(kQuantum);
  const std::map<uint32_t, double> weights = {{1, 1.0}, {2, 2.0}, {3, 4.0}};
  for (const auto& [t, w] : weights) q.SetWeight(t, w);
  // Every tenant backlogged with 16 KiB tasks (more than will be served).
  for (int i = 0; i < 4000; ++i) {
    for (const auto& [t, w] : weights) q.Push(t, 16 << 10, 16 << 10);
  }
  const std::map<uint32_t, uint64_t> served = Serve(q, 7000);
  uint64_t total = 0;
  for (const auto& [t, b] : served) total += b;
  for (const auto& [t, w] : weights) {
    const double share = static_cast<double>(served.at(t)) / static_cast<double>(total);
    EXPECT_NEAR(share, w / 7.0, 0.1 * w / 7.0) << "tenant " << t;  // within 10% of 1:2:4
  }
}

TEST(FairQueueTest, BytesNotTasksAreShared) {
  // Equal weights, one tenant's tasks 64x larger: equal bytes, not equal task counts.
  FairQueue<uint64_t> q(kQuantum);
  for (int i = 0; i < 2000; ++i) q.Push(1, 4 << 10, 4 << 10);
  for (int i = 0; i < 200; ++i) q.Push(2, 256 << 10, 256 << 10);
  const std::map<uint32_t, uint64_t> served = Serve(q, 1000);
  const double ratio = static_cast<double>(served.at(1)) / static_cast<double>(served.at(2));
  EXPECT_NEAR(ratio, 1.0, 0.1);
}

TEST(FairQueueTest, AnIdleTenantSavesNoCredit) {
  FairQueue<uint64_t> q(kQuantum);
  // Tenant 1 works alone for a long time, then tenant 2 arrives: from then on they alternate
  // by bytes; tenant 1 did not bank credit while alone (nor did 2 while idle).
  for (int i = 0; i < 1000; ++i) q.Push(1, 8 << 10, 8 << 10);
  EXPECT_EQ(Serve(q, 500).at(1), uint64_t{500} * (8 << 10));
  for (int i = 0; i < 1000; ++i) q.Push(2, 8 << 10, 8 << 10);
  const std::map<uint32_t, uint64_t> served = Serve(q, 400);
  EXPECT_NEAR(static_cast<double>(served.at(1)) / static_cast<double>(served.at(2)), 1.0, 0.1);
}

TEST(FairQueueTest, TasksLargerThanAQuantumAndTinyWeightsStillProgress) {
  FairQueue<uint64_t> q(1024);
  q.SetWeight(1, 1e-9);  // credit rounds to 1 byte a turn: still served, eventually
  q.Push(1, 4096, 4096);
  q.Push(2, 1 << 20, 1 << 20);  // 1024 turns of credit
  q.Push(3, 0, 0);              // counted as 1 byte
  const std::map<uint32_t, uint64_t> served = Serve(q, 10);
  EXPECT_EQ(served.size(), 3u);
  EXPECT_TRUE(q.empty());
}

}  // namespace
}  // namespace gradlink::server
