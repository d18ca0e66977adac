// control/topology.h: hosts from the address book, and who pushes each partition for a host.
#include "control/topology.h"

#include <gtest/gtest.h>

#include <set>

namespace gradlink::topology {
namespace {

wire::WelcomeMsg Book(std::vector<std::string> worker_hosts, std::vector<std::string> server_hosts = {}) {
  wire::WelcomeMsg w;
  w.num_workers = static_cast<uint32_t>(worker_hosts.size());
  w.num_servers = static_cast<uint32_t>(server_hosts.size());
  for (uint32_t i = 0; i < server_hosts.size(); ++i) {  // servers first: they must not count
    w.members.push_back({wire::Role::kServer, i, server_hosts[i], {}, {}});
  }
  for (uint32_t i = 0; i < worker_hosts.size(); ++i) {
    w.members.push_back({wire::Role::kWorker, i, worker_hosts[i], {}, {}});
  }
  return w;
}

TEST(TopologyTest, HostsAreNumberedByTheirLowestRankAndLocalRanksFollowRankOrder) {
  const Hosts h = Of(Book({"b/1", "a/2", "b/3", "c/4", "a/5"}, {"z/9"}));
  ASSERT_EQ(h.hosts(), 3u);
  EXPECT_EQ(h.host_of, (std::vector<uint32_t>{0, 1, 0, 2, 1}));
  EXPECT_EQ(h.local_rank, (std::vector<uint32_t>{0, 0, 1, 0, 1}));
  EXPECT_EQ(h.ranks_on[0], (std::vector<uint32_t>{0, 2}));
  EXPECT_EQ(h.machine[1], "a");
  EXPECT_TRUE(h.hierarchical());
}

TEST(TopologyTest, HierarchicalOnlyWithSeveralHostsAndASharedOne) {
  EXPECT_FALSE(Of(Book({"a/1", "a/2", "a/3"}, {"b/4"})).hierarchical());  // one host
  EXPECT_FALSE(Of(Book({"a/1", "b/2", "c/3"})).hierarchical());           // nobody shares
  EXPECT_TRUE(Of(Book({"a/1", "b/2", "b/3"})).hierarchical());
  // Network namespaces of one machine are hosts of their own (MachineOf).
  EXPECT_TRUE(Of(Book({"vm~netns1/1", "vm~netns1/2", "vm~netns2/3"})).hierarchical());
}

TEST(TopologyTest, ContributorsAreOnePusherPerHostInHostOrderSpreadOverLocalRanks) {
  const Hosts h = Of(Book({"a/0", "a/1", "b/2", "b/3", "b/4"}));
  std::set<uint32_t> pushers_a, pushers_b;
  for (uint32_t p = 0; p < 12; ++p) {
    const std::vector<uint32_t> c = Contributors(h, Mode::kHostPartials, 0x1234, p);
    ASSERT_EQ(c.size(), 2u);
    EXPECT_EQ(h.host_of[c[0]], 0u);
    EXPECT_EQ(h.host_of[c[1]], 1u);
    EXPECT_EQ(c[0], Pusher(h, 0, 0x1234, p));
    pushers_a.insert(c[0]);
    pushers_b.insert(c[1]);
  }
  EXPECT_EQ(pushers_a.size(), 2u);  // every local worker takes a share
  EXPECT_EQ(pushers_b.size(), 3u);
  // Flat: every rank, in rank order.
  EXPECT_EQ(Contributors(h, Mode::kFlat, 0x1234, 0), (std::vector<uint32_t>{0, 1, 2, 3, 4}));
  // One-partition keys are spread over a host's workers by key.
  std::set<uint32_t> first;
  for (uint64_t key = 0; key < 16; ++key) first.insert(Pusher(h, 1, key, 0));
  EXPECT_EQ(first.size(), 3u);
}

TEST(TopologyTest, WireTypeIsFp32OnlyForSixteenBitHostPartials) {
  EXPECT_EQ(WireType(DataType::kFloat16, Mode::kHostPartials), DataType::kFloat32);
  EXPECT_EQ(WireType(DataType::kBFloat16, Mode::kHostPartials), DataType::kFloat32);
  EXPECT_EQ(WireType(DataType::kFloat16, Mode::kHalfPartials), DataType::kFloat16);
  EXPECT_EQ(WireType(DataType::kFloat16, Mode::kFlat), DataType::kFloat16);
  EXPECT_EQ(WireType(DataType::kInt32, Mode::kHostPartials), DataType::kInt32);
}

}  // namespace
}  // namespace gradlink::topology
