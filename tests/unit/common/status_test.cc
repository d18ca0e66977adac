// Status and Result (include/gradlink/status.h): values, and what reading an error's value does.
#include <gtest/gtest.h>

#include <string>

#include "gradlink/status.h"

namespace gradlink {
namespace {

TEST(ResultTest, HoldsAValueOrAnError) {
  Result<std::string> v(std::string("sum"));
  ASSERT_TRUE(v.ok());
  EXPECT_EQ(*v, "sum");
  EXPECT_EQ(v->size(), 3u);
  Result<std::string> e(Timeout("push_pull of 'w' not complete"));
  ASSERT_FALSE(e.ok());
  EXPECT_EQ(e.status().code(), Code::kTimeout);
}

TEST(ResultTest, AnOkStatusIsNotAValue) {
  Result<int> r{Status::Ok()};
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), Code::kInternal);
}

// Regression: value() on an error read an empty std::optional (undefined behaviour); it now
// aborts naming the error.
TEST(ResultDeathTest, ValueOfAnErrorAbortsNamingIt) {
  Result<std::string> e(PeerLost("server 1 (host-a) lost"));
  EXPECT_DEATH({ (void)e.value(); }, "Result::value\\(\\) on an error: .*server 1 \\(host-a\\) lost");
  EXPECT_DEATH({ (void)*e; }, "on an error");
  EXPECT_DEATH({ (void)e->size(); }, "on an error");
  EXPECT_DEATH({ (void)std::move(e).value(); }, "on an error");
}

}  // namespace
}  // namespace gradlink
