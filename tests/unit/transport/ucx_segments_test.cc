// The UCX TCP segments in a lane address (src/transport/ucx/segments.h): parsed as UCX parses
// them, carried whole, and a peer that receives less than this process sends refused.
#include "transport/ucx/segments.h"

#include <gtest/gtest.h>

#include <vector>

namespace gradlink::transport::ucx {
namespace {

TEST(UcxSegmentsTest, SizesParseAsUcxWritesThem) {
  EXPECT_EQ(ParseUcxSize("68k"), 68u << 10);
  EXPECT_EQ(ParseUcxSize("64K"), 64u << 10);
  EXPECT_EQ(ParseUcxSize("64kb"), 64u << 10);
  EXPECT_EQ(ParseUcxSize("65536"), 65536u);
  EXPECT_EQ(ParseUcxSize("1m"), 1u << 20);
  EXPECT_EQ(ParseUcxSize("100b"), 100u);
  for (const char* bad : {"", "inf", "auto", "k", "64x", "64kk", "-1", "99999999999999999999"}) {
    EXPECT_FALSE(ParseUcxSize(bad).has_value()) << bad;
  }
}

TEST(UcxSegmentsTest, TheLargerOfTheTwoIsWhatIsSent) {
  Segments s = SegmentsOf("68k", "68k");
  EXPECT_EQ(s.send, 68u << 10);
  EXPECT_EQ(s.receive, 68u << 10);
  // Zero-copy segments go up to the receive segment: 8 KiB copied sends, 64 KiB zero-copy.
  s = SegmentsOf(std::nullopt, std::nullopt);
  EXPECT_EQ(s.send, 64u << 10);
  EXPECT_EQ(s.receive, 64u << 10);
  s = SegmentsOf("32k", std::nullopt);
  EXPECT_EQ(s.send, 64u << 10);
  s = SegmentsOf("auto", "64k");
  EXPECT_EQ(s.send, 0u);  // unknown: never refuses anyone
}

TEST(UcxSegmentsTest, TheTrailerTravelsWithTheAddressAndComesOffWhole) {
  const std::vector<std::byte> ucx = {std::byte{1}, std::byte{2}, std::byte{3}, std::byte{4},
                                      std::byte{5}, std::byte{6}, std::byte{7}, std::byte{8},
                                      std::byte{9}, std::byte{10}, std::byte{11}, std::byte{12},
                                      std::byte{13}};
  std::vector<std::byte> address = ucx;
  AppendSegments(address, Segments{70000, 69632});
  const PeerAddress p = SplitSegments(address);
  ASSERT_TRUE(p.segments.has_value());
  EXPECT_EQ(p.segments->send, 70000u);
  EXPECT_EQ(p.segments->receive, 69632u);
  EXPECT_EQ(std::vector<std::byte>(p.ucx.begin(), p.ucx.end()), ucx);
  // An address without one (an older build's) is UCX's as it is.
  const PeerAddress q = SplitSegments(ucx);
  EXPECT_FALSE(q.segments.has_value());
  EXPECT_EQ(q.ucx.size(), ucx.size());
}

TEST(UcxSegmentsTest, APeerThatReceivesLessThanThisProcessSendsIsRefused) {
  const Segments ours{68 << 10, 68 << 10}, old{64 << 10, 64 << 10};
  EXPECT_TRUE(CheckSegments(ours, ours, "server 0").ok());
  EXPECT_TRUE(CheckSegments(old, ours, "server 0").ok());  // smaller sends are fine
  const Status s = CheckSegments(ours, old, "server 0");
  EXPECT_EQ(s.code(), Code::kMismatch);
  EXPECT_NE(s.message().find("'server 0' receives segments of at most 64 KiB"), std::string::npos)
      << s.ToString();
  EXPECT_NE(s.message().find("sends up to 68 KiB"), std::string::npos) << s.ToString();
  // No trailer: an older build, which receives UCX's default 64 KiB.
  const Status older = CheckSegments(ours, std::nullopt, "worker 3");
  EXPECT_EQ(older.code(), Code::kMismatch);
  EXPECT_NE(older.message().find("an older gradlink build"), std::string::npos)
      << older.ToString();
  EXPECT_TRUE(CheckSegments(old, std::nullopt, "worker 3").ok());
  // Unknown on either side: nothing to check.
  EXPECT_TRUE(CheckSegments(Segments{}, old, "x").ok());
  EXPECT_TRUE(CheckSegments(ours, Segments{}, "x").ok());
}

}  // namespace
}  // namespace gradlink::transport::ucx
