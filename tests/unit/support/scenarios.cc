#include "unit/support/scenarios.h"

#include <gtest/gtest.h>

#include <chrono>
#include <vector>

#include "common/naming.h"
#include "unit/support/reference.h"
#include "wire/frame.h"

namespace gradlink::test {

using namespace std::chrono_literals;

void ExpectMismatchOnBothRanks(Job& job, const std::string& name, DataType t0, uint64_t n0,
                               DataType t1, uint64_t n1) {
  const auto start = Clock::now();
  OnEveryWorker(2, [&](uint32_t rank) {
    const DataType t = rank == 0 ? t0 : t1;
    const uint64_t n = rank == 0 ? n0 : n1;
    auto h = job.worker(rank).Declare(name, t, n);
    ASSERT_TRUE(h.ok()) << h.status().ToString();  // declaring is local; the check comes later
    std::vector<std::byte>& buf = job.Buffer(n * DataTypeSize(t));
    Status s = job.worker(rank).PushPull(*h, buf).Wait(In(5s));
    ASSERT_EQ(s.code(), Code::kMismatch) << "rank " << rank << ": " << s.ToString();
    const std::string& m = s.message();
    const std::string key = KeyHex(wire::TensorKey(job.config().job, name));
    EXPECT_NE(m.find(key), std::string::npos) << m;
    EXPECT_NE(m.find("'" + name + "'"), std::string::npos) << m;
    EXPECT_NE(m.find("rank 0"), std::string::npos) << m;
    EXPECT_NE(m.find("rank 1"), std::string::npos) << m;
    const std::string d0 = std::string(DataTypeName(t0)) + "[" + std::to_string(n0) + "]";
    const std::string d1 = std::string(DataTypeName(t1)) + "[" + std::to_string(n1) + "]";
    EXPECT_NE(m.find(d0), std::string::npos) << m;
    EXPECT_NE(m.find(d1), std::string::npos) << m;
    // Later calls on that tensor fail at once with the same error.
    Status again = job.worker(rank).PushPull(*h, buf).Wait(In(1s));
    EXPECT_EQ(again.code(), Code::kMismatch) << again.ToString();
  });
  EXPECT_LT(Clock::now() - start, 5s);
}

void ExpectWaitTimesOutThenCompletes(const JobConfig& config) {
  Job job;
  ASSERT_NO_FATAL_FAILURE(job.Start(config));
  auto t0 = job.worker(0).Declare("t", DataType::kFloat32, 1000);
  auto t1 = job.worker(1).Declare("t", DataType::kFloat32, 1000);
  ASSERT_TRUE(t0.ok() && t1.ok());
  std::vector<std::byte>& b0 = job.Buffer(4000);
  std::vector<std::byte>& b1 = job.Buffer(4000);
  FillTensor(DataType::kFloat32, 0, 0, 0, b0);
  FillTensor(DataType::kFloat32, 0, 1, 0, b1);
  PushPullHandle op0 = job.worker(0).PushPull(*t0, b0);

  auto start = Clock::now();
  Status s = op0.Wait(Clock::now() - 1s);  // a deadline in the past
  EXPECT_EQ(s.code(), Code::kTimeout) << s.ToString();
  EXPECT_LT(Clock::now() - start, 1s);
  EXPECT_NE(s.message().find("'t'"), std::string::npos) << s.message();

  start = Clock::now();
  s = op0.Wait(In(200ms));
  EXPECT_EQ(s.code(), Code::kTimeout) << s.ToString();
  EXPECT_GE(Clock::now() - start, 190ms);
  EXPECT_LT(Clock::now() - start, 3s);
  EXPECT_FALSE(op0.Poll());

  // The operation goes on and completes once rank 1 pushes.
  PushPullHandle op1 = job.worker(1).PushPull(*t1, b1);
  ASSERT_TRUE(op0.Wait(In(kOpTimeout)).ok());
  ASSERT_TRUE(op1.Wait(In(kOpTimeout)).ok());
  EXPECT_TRUE(CheckTensor(DataType::kFloat32, 0, 2, 0, false, b0));
  EXPECT_TRUE(CheckTensor(DataType::kFloat32, 0, 2, 0, false, b1));
  job.FinishCleanly();
}

void ExpectShutdownFailsOwnPendingOps(const JobConfig& config, uint64_t count) {
  Job job;
  ASSERT_NO_FATAL_FAILURE(job.Start(config));
  auto t = job.worker(0).Declare("t", DataType::kFloat32, count);
  ASSERT_TRUE(t.ok());
  std::vector<std::byte>& buf = job.Buffer(count * 4);
  PushPullHandle op = job.worker(0).PushPull(*t, buf);
  EXPECT_EQ(op.Wait(In(100ms)).code(), Code::kTimeout);
  const auto start = Clock::now();
  EXPECT_TRUE(job.worker(0).Shutdown(In(5s)).ok());
  Status s = op.Wait(In(5s));
  EXPECT_EQ(s.code(), Code::kAborted) << s.ToString();
  EXPECT_LT(Clock::now() - start, 5s);
  EXPECT_TRUE(job.worker(0).Shutdown(In(5s)).ok());  // idempotent
  EXPECT_EQ(job.worker(0).PushPull(*t, buf).Wait(In(1s)).code(), Code::kAborted);
}

void ExpectSchedulerStopAbortsPendingOps(const JobConfig& config) {
  Job job;
  ASSERT_NO_FATAL_FAILURE(job.Start(config));
  auto t = job.worker(0).Declare("t", DataType::kFloat32, 100);
  ASSERT_TRUE(t.ok());
  std::vector<std::byte>& buf = job.Buffer(400);
  PushPullHandle op = job.worker(0).PushPull(*t, buf);
  EXPECT_EQ(op.Wait(In(100ms)).code(), Code::kTimeout);
  const auto start = Clock::now();
  job.scheduler().Stop();
  Status s = op.Wait(In(5s));
  EXPECT_LT(Clock::now() - start, 5s);
  EXPECT_TRUE(s.code() == Code::kAborted || s.code() == Code::kPeerLost) << s.ToString();
  EXPECT_EQ(job.scheduler().Wait(In(1s)).code(), Code::kAborted);
}

void ExpectCleanGoodbyeFailsTheOthersPendingOp(const JobConfig& config, const std::string& says) {
  Job job;
  ASSERT_NO_FATAL_FAILURE(job.Start(config));
  auto t0 = job.worker(0).Declare("t", DataType::kFloat32, 100);
  auto t1 = job.worker(1).Declare("t", DataType::kFloat32, 100);
  ASSERT_TRUE(t0.ok() && t1.ok());
  std::vector<std::byte>& buf = job.Buffer(400);
  PushPullHandle op = job.worker(0).PushPull(*t0, buf);
  EXPECT_EQ(op.Wait(In(100ms)).code(), Code::kTimeout);
  const auto start = Clock::now();
  EXPECT_TRUE(job.worker(1).Shutdown(In(5s)).ok());
  Status s = op.Wait(In(5s));
  EXPECT_LT(Clock::now() - start, 5500ms);
  EXPECT_TRUE(s.code() == Code::kAborted || s.code() == Code::kPeerLost) << s.ToString();
  EXPECT_NE(s.message().find("worker 1"), std::string::npos) << s.message();
  EXPECT_NE(s.message().find(says), std::string::npos) << s.message();
}


void AverageDisagreementThenAgreement(Job& job, const std::string& name, uint64_t count) {
  OnEveryWorker(2, [&](uint32_t rank) {
    auto t = job.worker(rank).Declare(name, DataType::kFloat32, count);
    ASSERT_TRUE(t.ok());
    std::vector<std::byte>& buf = job.Buffer(count * 4);
    Status s = job.worker(rank).PushPull(*t, buf, {.average = rank == 0}).Wait(In(kOpTimeout));
    EXPECT_EQ(s.code(), Code::kMismatch) << "rank " << rank << ": " << s.ToString();
    EXPECT_NE(s.message().find("'" + name + "'"), std::string::npos) << s.message();
    EXPECT_NE(s.message().find("averages"), std::string::npos) << s.message();
    FillTensor(DataType::kFloat32, 0, rank, 0, buf);
    s = job.worker(rank).PushPull(*t, buf, {.average = true}).Wait(In(5s));
    ASSERT_TRUE(s.ok()) << "rank " << rank << ": " << s.ToString();
    EXPECT_TRUE(CheckTensor(DataType::kFloat32, 0, 2, 0, true, buf));
  });
}

}  // namespace gradlink::test
