// Tests of the annotated locks (src/common/mutex.h): they lock and wait as the standard types
// they wrap. CondVar's waits end at their deadline or when notified, with the lock held again;
// UniqueLock lets go and takes again, also through std::condition_variable_any; MutexLock
// holds for its scope. (What the annotations check is tests/thread_safety/check.py's.)
#include "common/mutex.h"

#include <gtest/gtest.h>

#include <chrono>
#include <condition_variable>
#include <thread>

#include "worker/state_mutex.h"

namespace gradlink {
namespace {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

// Whether another thread can take `mu` now (it is free).
template <typename M>
bool FreeElsewhere(M& mu) {
  bool took = false;
  std::thread t([&] {
    if (mu.try_lock()) {
      took = true;
      mu.unlock();
    }
  });
  t.join();
  return took;
}

TEST(MutexTest, MutexLockHoldsForItsScope) {
  Mutex mu;
  {
    MutexLock lock(mu);
    EXPECT_FALSE(FreeElsewhere(mu));
  }
  EXPECT_TRUE(FreeElsewhere(mu));
}

TEST(MutexTest, ReaderLocksShareAndExcludeAWriter) {
  SharedMutex mu;
  {
    ReaderLock a(mu);
    bool shared = false;
    std::thread t([&] {
      if (mu.try_lock_shared()) {
        shared = true;
        mu.unlock_shared();
      }
    });
    t.join();
    EXPECT_TRUE(shared);
    EXPECT_FALSE(FreeElsewhere(mu));  // exclusive try_lock fails while read-held
  }
  EXPECT_TRUE(FreeElsewhere(mu));
}

TEST(MutexTest, UniqueLockLetsGoAndTakesAgain) {
  Mutex mu;
  {
    UniqueLock lock(mu);
    EXPECT_FALSE(FreeElsewhere(mu));
    lock.unlock();
    EXPECT_TRUE(FreeElsewhere(mu));
    lock.lock();
    EXPECT_FALSE(FreeElsewhere(mu));
  }
  EXPECT_TRUE(FreeElsewhere(mu));
  {
    UniqueLock lock(mu);
    lock.unlock();  // the destructor must not unlock it again
  }
  EXPECT_TRUE(FreeElsewhere(mu));
}

TEST(MutexTest, CondVarWaitUntilEndsAtTheDeadlineWithTheLockHeld) {
  Mutex mu;
  CondVar cv;
  bool flag = false;
  MutexLock lock(mu);
  const auto start = Clock::now();
  EXPECT_FALSE(cv.WaitUntil(mu, start + 20ms, [&] {
    mu.AssertHeld();
    return flag;
  }));
  EXPECT_GE(Clock::now() - start, 20ms);
  EXPECT_FALSE(FreeElsewhere(mu));
}

TEST(MutexTest, CondVarWakesAWaiterWhenNotified) {
  Mutex mu;
  CondVar cv;
  bool flag = false;
  std::thread setter([&] {
    std::this_thread::sleep_for(10ms);
    MutexLock lock(mu);
    flag = true;
    cv.NotifyAll();
  });
  bool woke;
  {
    MutexLock lock(mu);
    woke = cv.WaitUntil(mu, Clock::now() + 30s, [&] {
      mu.AssertHeld();
      return flag;
    });
    EXPECT_FALSE(FreeElsewhere(mu));
  }
  setter.join();
  EXPECT_TRUE(woke);
}

TEST(MutexTest, UniqueLockOfStateMutexWaitsOnConditionVariableAny) {
  internal::StateMutex mu;
  std::condition_variable_any cv;
  bool flag = false;
  std::thread setter([&] {
    std::this_thread::sleep_for(10ms);
    MutexLock lock(mu);
    flag = true;
    cv.notify_all();
  });
  {
    UniqueLock lock(mu);
    EXPECT_TRUE(cv.wait_until(lock, Clock::now() + 30s, [&] {
      mu.AssertHeld();
      return flag;
    }));
    EXPECT_FALSE(FreeElsewhere(mu));
  }
  setter.join();
  EXPECT_TRUE(FreeElsewhere(mu));
}

}  // namespace
}  // namespace gradlink
