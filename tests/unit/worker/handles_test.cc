// PushPullHandle (include/gradlink/worker.h) in whole jobs in one process: a Wait() without a
// deadline waits WorkerOptions::operation_timeout, never forever.
#include <gtest/gtest.h>

#include <chrono>
#include <cstring>
#include <vector>

#include "gradlink/worker.h"
#include "unit/support/job_harness.h"

namespace gradlink {
namespace {

using namespace std::chrono_literals;
using test::In;
using test::Job;
using test::JobConfig;
using test::kOpTimeout;

// Regression: Wait() defaulted to Clock::time_point::max(): a sum that never completes (here,
// the other worker never pushes) blocked its caller forever.
TEST(HandlesTest, WaitWithoutADeadlineUsesTheOperationTimeout) {
  JobConfig config;
  config.operation_timeout = 800ms;
  Job job;
  ASSERT_NO_FATAL_FAILURE(job.Start(config));
  std::vector<TensorHandle> h(2);
  for (uint32_t r = 0; r < 2; ++r) {
    auto d = job.worker(r).Declare("never-met", DataType::kFloat32, 1024);
    ASSERT_TRUE(d.ok()) << d.status().ToString();
    h[r] = *d;
  }
  std::vector<std::byte>& buf = job.Buffer(4096);
  const auto start = Clock::now();
  PushPullHandle op = job.worker(0).PushPull(h[0], buf);
  const Status s = op.Wait();
  const auto waited = Clock::now() - start;
  EXPECT_EQ(s.code(), Code::kTimeout) << s.ToString();
  EXPECT_NE(s.message().find("never-met"), std::string::npos) << s.ToString();
  EXPECT_GE(waited, 800ms);
  EXPECT_LT(waited, 10s);
  // The other worker's push completes the sum: the same handle then succeeds.
  std::vector<std::byte>& other = job.Buffer(4096);
  ASSERT_TRUE(job.worker(1).PushPull(h[1], other).Wait(In(kOpTimeout)).ok());
  EXPECT_TRUE(op.Wait(In(kOpTimeout)).ok());
  job.FinishCleanly();
}

TEST(HandlesTest, WaitOnAnEmptyHandleIsAnError) {
  EXPECT_EQ(PushPullHandle().Wait().code(), Code::kInvalidArgument);
}

}  // namespace
}  // namespace gradlink
