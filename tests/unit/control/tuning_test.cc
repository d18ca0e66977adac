// control/tuning.h: the rule behind gradlink's defaults, from the job's address book.
#include "control/tuning.h"

#include <gtest/gtest.h>

namespace gradlink::tuning {
namespace {

wire::WelcomeMsg Book(std::vector<std::string> worker_hosts, std::vector<std::string> server_hosts) {
  wire::WelcomeMsg w;
  w.num_workers = static_cast<uint32_t>(worker_hosts.size());
  w.num_servers = static_cast<uint32_t>(server_hosts.size());
  for (uint32_t i = 0; i < worker_hosts.size(); ++i) {
    w.members.push_back({wire::Role::kWorker, i, worker_hosts[i], {}, {}});
  }
  for (uint32_t i = 0; i < server_hosts.size(); ++i) {
    w.members.push_back({wire::Role::kServer, i, server_hosts[i], {}, {}});
  }
  return w;
}

TEST(TuningTest, OneMachineGetsLargePartitionsAndALeadOfEight) {
  // Processes of one machine: "machine/pid".
  const Choice c = Choose(Book({"vm/10", "vm/11"}, {"vm/12"}));
  EXPECT_EQ(c.fabric, Fabric::kOneMachine);
  EXPECT_EQ(c.partition_bytes, 4u << 20);
  EXPECT_EQ(c.max_bytes_in_flight, 32u << 20);
  EXPECT_EQ(c.max_bytes_ahead, 32u << 20);
  EXPECT_NE(c.why.find("machine vm"), std::string::npos) << c.why;
}

TEST(TuningTest, ANetworkGetsSmallPartitionsAndALeadPerServer) {
  // Workers on one machine, a server on another: the bytes cross a link.
  for (const wire::WelcomeMsg& book :
       {Book({"a/1", "a/2"}, {"b/3"}), Book({"a/1", "b/2", "c/3", "d/4"}, {"e/5", "f/6", "g/7", "h/8"}),
        Book({"a~netns1/1", "a~netns2/2"}, {"a~netns1/3"})}) {
    const Choice c = Choose(book);
    EXPECT_EQ(c.fabric, Fabric::kNetwork);
    EXPECT_EQ(c.partition_bytes, 64u << 10);
    EXPECT_EQ(c.max_bytes_ahead, 128u << 10);
    // The window holds every server's lead, and at least 16 partitions.
    EXPECT_EQ(c.max_bytes_in_flight, std::max<uint64_t>(16, 2 * c.servers) * (64u << 10));
  }
  EXPECT_EQ(Choose(Book({"a/1", "b/2"}, std::vector<std::string>(16, "s/1"))).max_bytes_in_flight,
            32u * (64u << 10));
}

// A partition the worker sets sizes the window and the lead it leaves to gradlink: 2 partitions
// ahead of 1 MiB, not 128 KiB (a lead under one partition would starve the pipeline).
TEST(TuningTest, WindowAndLeadFollowAPartitionThatIsSet) {
  const Choice net = Choose(Book({"a/1", "b/2"}, {"c/3", "d/4", "e/5", "f/6"}), 1u << 20);
  EXPECT_EQ(net.partition_bytes, 1u << 20);
  EXPECT_EQ(net.max_bytes_ahead, 2u << 20);
  EXPECT_EQ(net.max_bytes_in_flight, 16u << 20);
  EXPECT_NE(net.why.find("for the 1048576-byte partitions set"), std::string::npos) << net.why;
  const Choice one = Choose(Book({"a/1", "a/2"}, {"a/3"}), 4);
  EXPECT_EQ(one.max_bytes_in_flight, 32u);
  EXPECT_EQ(one.max_bytes_ahead, 32u);
  // Saturating, never wrapped around to a small window.
  EXPECT_EQ(Choose(Book({"a/1", "b/2"}, {"c/3"}), UINT64_MAX / 2).max_bytes_in_flight, UINT64_MAX);
}

TEST(TuningTest, AKeyIsCutSoThatEveryServerGetsAPart) {
  const Choice net = Choose(Book({"a/1", "b/2"}, {"c/3", "d/4"}));
  const Choice one = Choose(Book({"a/1", "a/2"}, {"a/3", "a/4"}));
  EXPECT_EQ(KeyPartitionBytes(net, 64u << 20, 4), 64u << 10);  // the job's most
  EXPECT_EQ(KeyPartitionBytes(one, 64u << 20, 4), 4u << 20);
  EXPECT_EQ(KeyPartitionBytes(one, 4u << 20, 2), 2u << 20);     // one part per server
  EXPECT_EQ(KeyPartitionBytes(one, 3u << 20, 4), 1u << 20);     // 768 KiB shares, rounded up
  EXPECT_EQ(KeyPartitionBytes(net, 40u << 10, 2), 32u << 10);
  EXPECT_EQ(KeyPartitionBytes(net, 4096, 4), kMinPartitionBytes);  // never smaller
  EXPECT_EQ(KeyPartitionBytes(net, 0, 4), kMinPartitionBytes);
  EXPECT_EQ(KeyPartitionBytes(one, UINT64_MAX, 1), 4u << 20);    // no overflow
  EXPECT_EQ(KeyPartitionBytes(one, UINT64_MAX, 3), 4u << 20);
  EXPECT_EQ(KeyPartitionBytes(one, 1u << 20, 0), 1u << 20);      // no division by zero
}

}  // namespace
}  // namespace gradlink::tuning
