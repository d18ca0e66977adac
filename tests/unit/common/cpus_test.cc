#include "common/cpus.h"

#include <gtest/gtest.h>

#include <thread>
#include <vector>

namespace gradlink {
namespace {

using V = std::vector<uint32_t>;

TEST(CpuListTest, ParsesRangesAndSingles) {
  auto c = ParseCpuList("cpus", "0-3,8,10-11");
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_EQ(*c, (V{0, 1, 2, 3, 8, 10, 11}));
  // Overlaps and any order: each CPU once, ascending.
  c = ParseCpuList("cpus", "5,1-3,2");
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_EQ(*c, (V{1, 2, 3, 5}));
  c = ParseCpuList("cpus", "1023");
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_EQ(*c, (V{1023}));
}

TEST(CpuListTest, RefusesWhatIsNotAList) {
  for (const char* bad : {"", ",", "1,,2", "a", "1-", "-1", "3-1", "1024", "0-1024", "1 2", "0x1",
                          "99999999999999999999"}) {
    auto c = ParseCpuList("GRADLINK_SERVER_CPUS", bad);
    ASSERT_FALSE(c.ok()) << "'" << bad << "' was taken";
    EXPECT_EQ(c.status().code(), Code::kInvalidArgument);
    EXPECT_NE(c.status().message().find("GRADLINK_SERVER_CPUS"), std::string::npos)
        << c.status().ToString();
  }
  auto c = ParseCpuList("cpus", "3-1");
  EXPECT_NE(c.status().message().find("'3-1' ends before it starts"), std::string::npos)
      << c.status().ToString();
}

TEST(CpuListTest, FormatsTheShortestList) {
  EXPECT_EQ(FormatCpuList(V{0, 1, 2, 3, 8, 10, 11}), "0-3,8,10-11");
  EXPECT_EQ(FormatCpuList(V{7}), "7");
  EXPECT_EQ(FormatCpuList(V{}), "");
  for (const char* list : {"0-3,8,10-11", "1,3,5", "0-1023"}) {
    auto c = ParseCpuList("cpus", list);
    ASSERT_TRUE(c.ok());
    EXPECT_EQ(FormatCpuList(*c), list);
  }
}

TEST(CpuListTest, PinsTheCallingThreadOnly) {
  const V allowed = AllowedCpus();
  ASSERT_FALSE(allowed.empty());
  V seen;
  std::thread t([&] {
    const V one = {allowed.back()};
    ASSERT_TRUE(PinThisThread(one).ok());
    seen = AllowedCpus();
  });
  t.join();
  EXPECT_EQ(seen, V{allowed.back()});
  EXPECT_EQ(AllowedCpus(), allowed);  // this thread kept its mask
  EXPECT_EQ(PinThisThread(V{}).code(), Code::kInvalidArgument);
}

}  // namespace
}  // namespace gradlink
