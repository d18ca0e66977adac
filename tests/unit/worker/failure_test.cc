// Whole jobs that go wrong: deadlines, a worker lost without a goodbye, a worker or server that
// leaves mid-job, the scheduler stopping, shutdown under pending operations, and no thread or fd
// left behind after a failed job. Every wait has a deadline: a test fails, it never hangs.
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "gradlink/worker.h"
#include "unit/support/job_harness.h"
#include "unit/support/reference.h"
#include "unit/support/rounds.h"
#include "unit/support/scenarios.h"

namespace gradlink {
namespace {

using namespace std::chrono_literals;
using test::ExpectCleanGoodbyeFailsTheOthersPendingOp;
using test::ExpectSchedulerStopAbortsPendingOps;
using test::ExpectShutdownFailsOwnPendingOps;
using test::ExpectWaitTimesOutThenCompletes;
using test::In;
using test::Job;
using test::JobConfig;

// ---- deadlines -----------------------------------------------------------------------------

TEST(JobTest, WaitTimesOutWhenAnotherWorkerHasNotPushed) { ExpectWaitTimesOutThenCompletes({}); }

// ---- members that leave mid-job --------------------------------------------------------------

TEST(JobTest, UncleanWorkerLossAbortsTheJob) {
  // Rank 1 joins with a bare control connection and drops it without a goodbye: the scheduler
  // aborts the job, and rank 0's pending operation fails (naming the lost worker) instead of
  // waiting for a push that will never come.
  JobConfig config;
  config.workers = 2;
  config.servers = 2;
  config.fake_worker_ranks = {1};
  Job job;
  ASSERT_NO_FATAL_FAILURE(job.Start(config));
  auto t = job.worker(0).Declare("t", DataType::kFloat32, 100);
  ASSERT_TRUE(t.ok());
  std::vector<std::byte>& buf = job.Buffer(400);
  PushPullHandle op = job.worker(0).PushPull(*t, buf);
  EXPECT_EQ(op.Wait(In(100ms)).code(), Code::kTimeout);

  const auto start = Clock::now();
  job.DropFake(1);
  Status s = op.Wait(In(5s));
  EXPECT_LT(Clock::now() - start, 5s);
  EXPECT_TRUE(s.code() == Code::kPeerLost || s.code() == Code::kAborted) << s.ToString();
  EXPECT_NE(s.message().find("worker 1"), std::string::npos) << s.message();
  // Sticky: later operations fail at once too.
  Status later = job.worker(0).PushPull(*t, buf).Wait(In(1s));
  EXPECT_EQ(later.code(), s.code()) << later.ToString();
  EXPECT_FALSE(job.worker(0).Declare("u", DataType::kFloat32, 1).ok());
  // Everyone learns that the job failed.
  Status sched = job.scheduler().Wait(In(5s));
  EXPECT_EQ(sched.code(), Code::kPeerLost) << sched.ToString();
  for (uint32_t i = 0; i < 2; ++i) {
    Status srv = job.server(i).Wait(In(5s));
    EXPECT_FALSE(srv.ok());
    EXPECT_NE(srv.code(), Code::kTimeout) << srv.ToString();
  }
}

TEST(JobTest, ShutdownFailsTheWorkersOwnPendingOps) { ExpectShutdownFailsOwnPendingOps({}, 100); }

TEST(JobTest, SchedulerStopAbortsPendingOps) { ExpectSchedulerStopAbortsPendingOps({}); }

// Through the servers: the scheduler tells them (kMemberLeft), and they fail the round.
TEST(JobTest, CleanGoodbyeOfOneWorkerFailsTheOthersPendingOp) {
  ExpectCleanGoodbyeFailsTheOthersPendingOp({});
}

// Regression (src/scheduler/scheduler.cc OnGoodbye): a server that left mid-job (Stop() sends a
// goodbye) is only marked as left; the job is not aborted, so a worker whose push already sits on
// that server waited forever. Now the job fails, naming the server.
TEST(JobTest, ServerLeavingMidJobFailsPendingOps) {
  JobConfig config;
  Job job;
  ASSERT_NO_FATAL_FAILURE(job.Start(config));
  auto t0 = job.worker(0).Declare("t", DataType::kFloat32, 100);
  auto t1 = job.worker(1).Declare("t", DataType::kFloat32, 100);
  ASSERT_TRUE(t0.ok() && t1.ok());
  std::vector<std::byte>& b0 = job.Buffer(400);
  std::vector<std::byte>& b1 = job.Buffer(400);
  PushPullHandle op = job.worker(0).PushPull(*t0, b0);
  EXPECT_EQ(op.Wait(In(200ms)).code(), Code::kTimeout);  // pushed; waits for rank 1
  const auto start = Clock::now();
  job.server(0).Stop();
  Status s = op.Wait(In(5s));
  EXPECT_LT(Clock::now() - start, 5500ms);
  EXPECT_TRUE(s.code() == Code::kAborted || s.code() == Code::kPeerLost) << s.ToString();
  Status s1 = job.worker(1).PushPull(*t1, b1).Wait(In(5s));
  EXPECT_TRUE(s1.code() == Code::kAborted || s1.code() == Code::kPeerLost) << s1.ToString();
}

size_t CountEntries(const char* dir) {
  size_t n = 0;
  for ([[maybe_unused]] const auto& e : std::filesystem::directory_iterator(dir)) ++n;
  return n;
}

// After a job that failed mid-round (scheduler stopped under a pending op) has been torn down,
// the process holds exactly the threads and file descriptors it had before.
TEST(JobTest, NoThreadOrFdLeaksAfterAFailedJob) {
  // Runtimes that start a helper thread with the first thread (ThreadSanitizer's background
  // thread) do so now, before the count.
  std::thread([] {}).join();
  const size_t threads_before = CountEntries("/proc/self/task");
  const size_t fds_before = CountEntries("/proc/self/fd");
  {
    JobConfig config;
    config.servers = 2;
    Job job;
    ASSERT_NO_FATAL_FAILURE(job.Start(config));
    auto t0 = job.worker(0).Declare("t", DataType::kFloat32, 100000);
    auto t1 = job.worker(1).Declare("t", DataType::kFloat32, 100000);
    ASSERT_TRUE(t0.ok() && t1.ok());
    std::vector<std::byte>& b0 = job.Buffer(400000);
    std::vector<std::byte>& b1 = job.Buffer(400000);
    PushPullHandle h0 = job.worker(0).PushPull(*t0, b0);
    PushPullHandle h1 = job.worker(1).PushPull(*t1, b1);
    ASSERT_TRUE(h0.Wait(In(5s)).ok());
    ASSERT_TRUE(h1.Wait(In(5s)).ok());
    PushPullHandle pending = job.worker(0).PushPull(*t0, b0);  // rank 1 never joins this round
    job.scheduler().Stop();
    Status s = pending.Wait(In(5s));
    EXPECT_NE(s.code(), Code::kOk);
    EXPECT_NE(s.code(), Code::kTimeout) << s.ToString();
  }
  EXPECT_EQ(CountEntries("/proc/self/task"), threads_before);
  EXPECT_EQ(CountEntries("/proc/self/fd"), fds_before);
}


}  // namespace
}  // namespace gradlink
