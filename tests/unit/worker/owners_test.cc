// The worker's state owners taken on their own (src/worker/server_directory.h,
// job_verdict.h, rendezvous.h): what each keeps, refuses and hands out, and that a waiter on the
// rendezvous is woken by the job's failure, which is set without the rendezvous lock.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <thread>

#include "worker/job_verdict.h"
#include "worker/rendezvous.h"
#include "worker/server_directory.h"

namespace gradlink::internal {
namespace {

using std::chrono::milliseconds;
using std::chrono::seconds;

TEST(WorkerServerDirectory, ResetKnowsTheJobsServersNoneLost) {
  ServerDirectory d;
  d.Reset(2);
  EXPECT_EQ(d.ids(), 2u);
  EXPECT_TRUE(d.failover());
  EXPECT_FALSE(d.lost(0));
  EXPECT_FALSE(d.lost(1));
  EXPECT_FALSE(d.lost(2));  // not known: not lost either
  d.Connected(1, 7, "server 1 (b)");
  EXPECT_EQ(d.peer(1), 7u);
  EXPECT_EQ(d.Name(1), "server 1 (b)");
  EXPECT_EQ(d.Name(0), "server 0");  // no name recorded: the id
  EXPECT_EQ(d.RecordedName(0), "");
  EXPECT_EQ(d.NameOfPeer(7), "server 1 (b)");
  EXPECT_EQ(d.NameOfPeer(9), "a server");
  EXPECT_EQ(d.IdOfPeer(7), 1);
  EXPECT_EQ(d.IdOfPeer(9), -1);

  ServerDirectory one;
  one.Reset(1);
  EXPECT_FALSE(one.failover());  // nowhere for a lost server's partitions to go
}

TEST(WorkerServerDirectory, MarkLostOnceAndOnlyKnownIds) {
  ServerDirectory d;
  d.Reset(2);
  EXPECT_TRUE(d.MarkLost(1));
  EXPECT_TRUE(d.lost(1));
  EXPECT_FALSE(d.MarkLost(1));  // twice: the caller counts a protocol error
  EXPECT_FALSE(d.MarkLost(5));  // never known
  EXPECT_FALSE(d.lost(0));
}

TEST(WorkerServerDirectory, StandbyJoinCountsTheIdsBetweenAsLost) {
  ServerDirectory d;
  d.Reset(1);
  const transport::PeerId peer = 42;
  ASSERT_TRUE(d.Join(3, "server 3 (c)", &peer));
  EXPECT_EQ(d.ids(), 4u);
  EXPECT_TRUE(d.lost(1));  // ids between: servers that never joined
  EXPECT_TRUE(d.lost(2));
  EXPECT_FALSE(d.lost(3));
  EXPECT_EQ(d.peer(3), 42u);
  EXPECT_TRUE(d.failover());  // somewhere to go now, even with one server
  EXPECT_FALSE(d.Join(3, "again", &peer));  // known and not lost
  EXPECT_EQ(d.Name(3), "server 3 (c)");
  // Unreachable: recorded by name, stays lost.
  ASSERT_TRUE(d.Join(2, "server 2 (x)", nullptr));
  EXPECT_TRUE(d.lost(2));
  EXPECT_EQ(d.Name(2), "server 2 (x)");
  // A lost one that comes back is reachable again.
  ASSERT_TRUE(d.MarkLost(3));
  const transport::PeerId again = 43;
  ASSERT_TRUE(d.Join(3, "server 3 (c)", &again));
  EXPECT_FALSE(d.lost(3));
  EXPECT_EQ(d.peer(3), 43u);
  // Past the most a job may add: refused.
  EXPECT_FALSE(d.Join(1 + wire::kMaxServersJoined, "too far", &peer));
}

TEST(WorkerJobVerdict, FirstFailureSticksAndEndsThePending) {
  JobVerdict v;
  EXPECT_FALSE(v.failed());
  EXPECT_TRUE(v.failure().ok());
  ASSERT_TRUE(v.Note(PeerLost("endpoint failed"), 3, 1));
  EXPECT_TRUE(v.pending());
  EXPECT_FALSE(v.Note(PeerLost("another")));  // one pending at a time
  EXPECT_EQ(v.Fail(Aborted("job aborted")).code(), Code::kAborted);
  EXPECT_TRUE(v.failed());
  EXPECT_FALSE(v.pending());  // the verdict came
  EXPECT_EQ(v.Fail(Timeout("later")).code(), Code::kAborted);  // the first stands
  EXPECT_EQ(v.failure().message(), "job aborted");
  EXPECT_FALSE(v.Note(PeerLost("after the end")));
  EXPECT_FALSE(v.pending());
}

TEST(WorkerJobVerdict, PendingExpiresAfterItsGrace) {
  JobVerdict v;
  ASSERT_TRUE(v.Note(PeerLost("connection reset"), 5));
  const Clock::time_point now = Clock::now();
  EXPECT_FALSE(v.ExpiredBy(now, seconds(10), seconds(10)).has_value());
  auto expired = v.ExpiredBy(now + seconds(11), seconds(10), seconds(100));
  ASSERT_TRUE(expired.has_value());  // no server named: the shorter grace
  EXPECT_EQ(expired->status.message(), "connection reset");
  ASSERT_TRUE(expired->peer.has_value());
  EXPECT_EQ(*expired->peer, 5u);
}

TEST(WorkerJobVerdict, ServerFailureWaitsTheServerGraceAndClearsOnItsLoss) {
  JobVerdict v;
  ASSERT_TRUE(v.Note(PeerLost("server 2 failed"), std::nullopt, 2));
  const Clock::time_point later = Clock::now() + seconds(11);
  EXPECT_FALSE(v.ExpiredBy(later, seconds(10), seconds(100)).has_value());
  EXPECT_TRUE(v.ExpiredBy(later, seconds(10), seconds(10)).has_value());
  v.ClearIfServer(1);  // another server's loss: still pending
  EXPECT_TRUE(v.pending());
  v.ClearIfServer(2);  // the scheduler moved its partitions: no longer the job's end
  EXPECT_FALSE(v.pending());
  EXPECT_FALSE(v.ExpiredBy(later, seconds(0), seconds(0)).has_value());
  EXPECT_FALSE(v.failed());
}

// A waiter whose predicate reads the verdict (Barrier, Join) is woken by Wake() after the
// failure, which is set under the verdict's lock only.
TEST(WorkerRendezvous, FailureWakesAWaiterWithoutItsLock) {
  Rendezvous r;
  JobVerdict v;
  std::atomic<bool> returned{false};
  bool woken = false;
  // Far beyond what the test waits below: a waiter that is not woken is still asleep then.
  const Clock::time_point deadline = Clock::now() + seconds(60);
  std::thread waiter([&] {
    MutexLock lock(r.mu);
    woken = r.cv.WaitUntil(r.mu, deadline, [&] {
      r.mu.AssertHeld();  // WaitUntil runs it under r.mu
      return r.barrier_released >= 1 || v.failed();
    });
    returned = true;
  });
  std::this_thread::sleep_for(milliseconds(20));  // most likely asleep by now; either way works
  v.Fail(PeerLost("worker 1 lost")).IgnoreError();
  r.Wake();
  const Clock::time_point give_up = Clock::now() + seconds(20);
  while (!returned && Clock::now() < give_up) std::this_thread::sleep_for(milliseconds(5));
  EXPECT_TRUE(returned) << "the job's failure did not wake the waiter";
  waiter.join();
  EXPECT_TRUE(woken);
  MutexLock lock(r.mu);
  EXPECT_EQ(r.barrier_released, 0u);
}

}  // namespace
}  // namespace gradlink::internal
