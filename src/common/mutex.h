// Locks that clang's thread-safety analysis understands (common/thread_annotations.h).
//
// Why: libstdc++'s std::mutex, std::lock_guard and std::unique_lock carry no annotations, so a
// field marked GUARDED_BY(mu_) would read as unguarded everywhere. These wrap them inline, with
// the attributes added and nothing else: the code GCC emits is std::mutex's.
//
//   Mutex, SharedMutex   the locks (lock()/unlock() as std::mutex, so the standard lockers and
//                        std::condition_variable_any take them too, unchecked)
//   MutexLock<M>         holds M from construction to destruction (std::lock_guard);
//                        `MutexLock lock(mu_);` deduces M (Mutex, SharedMutex exclusive,
//                        internal::StateMutex)
//   ReaderLock           holds a SharedMutex shared (std::shared_lock)
//   UniqueLock<M>        held, or let go and taken again (unlock()/lock()): for
//                        std::condition_variable_any, which calls those on it
//   CondVar              std::condition_variable over a Mutex held by the caller
//
// A condition variable's predicate is a lambda, which the analysis checks as a function of its
// own that holds nothing: a predicate that reads guarded fields says so with mu.AssertHeld()
// (the caller holds mu while the wait runs it), or the wait is written as a loop.
//
// Threads: any, as the standard types they wrap.
#pragma once

#include <chrono>
#include <condition_variable>
#include <mutex>
#include <shared_mutex>

#include "common/thread_annotations.h"

namespace gradlink {

class CAPABILITY("mutex") Mutex {
 public:
  Mutex() = default;
  Mutex(const Mutex&) = delete;
  Mutex& operator=(const Mutex&) = delete;

  void lock() ACQUIRE() { mu_.lock(); }
  bool try_lock() TRY_ACQUIRE(true) { return mu_.try_lock(); }
  void unlock() RELEASE() { mu_.unlock(); }
  // Tells the analysis that the caller holds this lock (a lambda run under it); checks nothing.
  void AssertHeld() const ASSERT_CAPABILITY(this) {}

 private:
  friend class CondVar;
  std::mutex mu_;
};

class CAPABILITY("mutex") SharedMutex {
 public:
  SharedMutex() = default;
  SharedMutex(const SharedMutex&) = delete;
  SharedMutex& operator=(const SharedMutex&) = delete;

  void lock() ACQUIRE() { mu_.lock(); }
  bool try_lock() TRY_ACQUIRE(true) { return mu_.try_lock(); }
  void unlock() RELEASE() { mu_.unlock(); }
  void lock_shared() ACQUIRE_SHARED() { mu_.lock_shared(); }
  bool try_lock_shared() TRY_ACQUIRE_SHARED(true) { return mu_.try_lock_shared(); }
  void unlock_shared() RELEASE_SHARED() { mu_.unlock_shared(); }
  void AssertHeld() const ASSERT_CAPABILITY(this) {}
  void AssertReaderHeld() const ASSERT_SHARED_CAPABILITY(this) {}

 private:
  std::shared_mutex mu_;
};

template <typename M>
class SCOPED_CAPABILITY MutexLock {
 public:
  explicit MutexLock(M& mu) ACQUIRE(mu) : mu_(mu) { mu_.lock(); }
  ~MutexLock() RELEASE() { mu_.unlock(); }
  MutexLock(const MutexLock&) = delete;
  MutexLock& operator=(const MutexLock&) = delete;

 private:
  M& mu_;
};

class SCOPED_CAPABILITY ReaderLock {
 public:
  explicit ReaderLock(SharedMutex& mu) ACQUIRE_SHARED(mu) : mu_(mu) { mu_.lock_shared(); }
  ~ReaderLock() RELEASE() { mu_.unlock_shared(); }
  ReaderLock(const ReaderLock&) = delete;
  ReaderLock& operator=(const ReaderLock&) = delete;

 private:
  SharedMutex& mu_;
};

// Held from construction, unless let go (unlock) and not taken again (lock): the destructor
// releases it only if held.
template <typename M>
class SCOPED_CAPABILITY UniqueLock {
 public:
  explicit UniqueLock(M& mu) ACQUIRE(mu) : mu_(mu) { mu_.lock(); }
  ~UniqueLock() RELEASE() {
    if (held_) mu_.unlock();
  }
  UniqueLock(const UniqueLock&) = delete;
  UniqueLock& operator=(const UniqueLock&) = delete;

  void lock() ACQUIRE() {
    mu_.lock();
    held_ = true;
  }
  void unlock() RELEASE() {
    held_ = false;
    mu_.unlock();
  }

 private:
  M& mu_;
  bool held_ = true;
};

// std::condition_variable for a Mutex the caller holds (zero-cost: the std::mutex inside is
// handed to the standard wait as already held, and taken back from it).
class CondVar {
 public:
  void Wait(Mutex& mu) REQUIRES(mu) {
    std::unique_lock<std::mutex> lock(mu.mu_, std::adopt_lock);
    cv_.wait(lock);
    lock.release();
  }
  // False when `deadline` passed first (a wakeup may be spurious: check the condition again).
  template <typename Clock, typename Duration>
  bool WaitUntil(Mutex& mu, std::chrono::time_point<Clock, Duration> deadline) REQUIRES(mu) {
    std::unique_lock<std::mutex> lock(mu.mu_, std::adopt_lock);
    const bool woken = cv_.wait_until(lock, deadline) == std::cv_status::no_timeout;
    lock.release();
    return woken;
  }
  template <typename Rep, typename Period>
  bool WaitFor(Mutex& mu, std::chrono::duration<Rep, Period> timeout) REQUIRES(mu) {
    return WaitUntil(mu, std::chrono::steady_clock::now() + timeout);
  }
  // Waits until `done()` (run with `mu` held: see the top of this file) or `deadline`; what
  // done() said last.
  template <typename Clock, typename Duration, typename Pred>
  bool WaitUntil(Mutex& mu, std::chrono::time_point<Clock, Duration> deadline, Pred done)
      REQUIRES(mu) {
    while (!done()) {
      if (!WaitUntil(mu, deadline)) return done();
    }
    return true;
  }
  template <typename Pred>
  void Wait(Mutex& mu, Pred done) REQUIRES(mu) {
    while (!done()) Wait(mu);
  }

  void NotifyOne() noexcept { cv_.notify_one(); }
  void NotifyAll() noexcept { cv_.notify_all(); }

 private:
  std::condition_variable cv_;
};

}  // namespace gradlink
