// control/layout.h: segments, peers, roles and local copies, checked by hand on small cases.
#include "control/layout.h"

#include <gtest/gtest.h>

namespace gradlink::layout {
namespace {

TEST(LayoutTest, CheckNamesWhatIsWrong) {
  EXPECT_TRUE(Check({}, 4, 10).ok());
  EXPECT_TRUE(Check({.kind = Collective::kAllgather, .counts = {1, 2, 3, 4}}, 4, 10).ok());
  Status s = Check({.kind = Collective::kAllgather, .counts = {1, 2, 3}}, 4, 6);
  EXPECT_NE(s.message().find("3 counts for 4 workers, which need 4"), std::string::npos) << s.ToString();
  s = Check({.kind = Collective::kReduceScatter, .counts = {5, 5}}, 2, 9);
  EXPECT_NE(s.message().find("more than the key's 9"), std::string::npos) << s.ToString();
  s = Check({.kind = Collective::kAlltoall, .counts = {1, 1, 1}}, 2, 3);
  EXPECT_EQ(s.code(), Code::kInvalidArgument);
  s = Check({.kind = Collective::kBroadcast, .root = 4}, 4, 1);
  EXPECT_NE(s.message().find("rank 4"), std::string::npos);
  s = Check({.kind = Collective::kAllgather, .op = ReduceOp::kMin, .counts = {1}}, 1, 1);
  EXPECT_NE(s.message().find("only allreduce and reduce_scatter"), std::string::npos);
}

TEST(LayoutTest, AlltoallRolesAndCopies) {
  // 2 workers: 0 sends 1 to itself and 2 to rank 1; 1 sends 3 to rank 0 and 4 to itself.
  const CollectiveSpec spec{.kind = Collective::kAlltoall, .counts = {1, 2, 3, 4}};
  const auto seg = Segments(spec, 2, 10);
  ASSERT_EQ(seg.size(), 4u);
  EXPECT_EQ(seg[2].offset, 3u);
  EXPECT_EQ(SegmentAt(seg, 4), 2u);
  EXPECT_TRUE(PeersOf(spec, seg[0], 2).local_only());
  const Peers p = PeersOf(spec, seg[2], 2);  // 1 -> 0
  EXPECT_EQ(p.contributors, std::vector<uint32_t>{1});
  EXPECT_EQ(p.requesters, std::vector<uint32_t>{0});
  // Element 4 lies in block (1, 0) at 1: rank 1 pushes its input[1], rank 0 receives output[1+1].
  const Role sender = RoleOf(spec, seg, 2, 2, 1, 4);
  EXPECT_TRUE(sender.push && !sender.pull);
  EXPECT_EQ(sender.in_offset, 1u);
  const Role receiver = RoleOf(spec, seg, 2, 2, 0, 4);
  EXPECT_TRUE(receiver.pull && !receiver.push);
  EXPECT_EQ(receiver.out_offset, 2u);
  EXPECT_EQ(InputCount(spec, 2, 1, 10), 7u);
  EXPECT_EQ(OutputCount(spec, 2, 1, 10), 6u);
  const auto copies = LocalCopies(spec, 2, 1, 10);
  ASSERT_EQ(copies.size(), 1u);
  EXPECT_EQ(copies[0].in_offset, 3u);
  EXPECT_EQ(copies[0].out_offset, 2u);
  EXPECT_EQ(copies[0].count, 4u);
}

TEST(LayoutTest, ReduceScatterPeersAndStraddlingPlans) {
  const CollectiveSpec spec{.kind = Collective::kReduceScatter, .counts = {4, 0, 6}};
  const auto seg = Segments(spec, 3, 10);
  EXPECT_EQ(SegmentAt(seg, 4), 2u);  // past the empty segment of rank 1
  const Peers p = PeersOf(spec, seg[2], 3);
  EXPECT_EQ(p.contributors, (std::vector<uint32_t>{0, 1, 2}));
  EXPECT_EQ(p.receives, (std::vector<bool>{false, false, true}));
  EXPECT_TRUE(CheckPlan(spec, 3, 10, {{0, 4, 0}, {4, 6, 0}}).ok());
  Status s = CheckPlan(spec, 3, 10, {{0, 5, 0}, {5, 5, 0}});
  EXPECT_EQ(s.code(), Code::kProtocolError);
  EXPECT_NE(s.message().find("straddles"), std::string::npos);
}

TEST(LayoutTest, GroupsMapPositionsToRanks) {
  // Ranks 1, 3 and 4 of a 5-worker job gather 2, 0 and 5 elements.
  const CollectiveSpec spec{.kind = Collective::kAllgather, .counts = {2, 0, 5}, .group = {1, 3, 4}};
  EXPECT_TRUE(Check(spec, 5, 7).ok());
  EXPECT_EQ(Members(spec, 5), 3u);
  EXPECT_EQ(PositionOf(spec, 4), 2);
  EXPECT_EQ(PositionOf(spec, 2), -1);
  const auto seg = Segments(spec, 5, 7);
  const Peers p = PeersOf(spec, seg[2], 5);  // position 2 = rank 4 gives, ranks 1 and 3 receive
  EXPECT_EQ(p.contributors, std::vector<uint32_t>{4});
  EXPECT_EQ(p.requesters, (std::vector<uint32_t>{1, 3}));
  EXPECT_EQ(InputCount(spec, 5, 4, 7), 5u);
  EXPECT_EQ(OutputCount(spec, 5, 2, 7), 0u);  // not a member
  EXPECT_FALSE(RoleOf(spec, seg, 2, 5, 2, 2).participates());
  const Role r = RoleOf(spec, seg, 2, 5, 1, 3);  // element 3 = rank 4's element 1
  EXPECT_TRUE(r.pull && !r.push);
  EXPECT_EQ(r.out_offset, 3u);
  EXPECT_FALSE(Check({.group = {3, 1}}, 5, 1).ok());
  EXPECT_FALSE(Check({.group = {1, 5}}, 5, 1).ok());
  EXPECT_NE(DescribeSpec(spec).find("in group [1, 3, 4]"), std::string::npos);
}

}  // namespace
}  // namespace gradlink::layout
