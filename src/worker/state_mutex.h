// The worker's state lock (WorkerImpl::mu_), able to count its own acquisitions per thread.
//
// Why: the data path's cost per partition is dominated by hand-offs and lock traffic between the
// caller, the two lanes' progress threads and the control thread; how often each thread takes
// the state lock per partition is a figure the design holds itself to (docs/architecture.md).
// Counting is off unless a test turns it on (StartCounting); when off, lock() is std::mutex's
// plus one predictable branch. The counts are written under the lock itself, so they need no
// atomics of their own.
//
// Threads: any. StartCounting/Counts may be called from any thread.
//
// For clang's thread-safety analysis it is a capability (common/thread_annotations.h): fields
// of WorkerImpl are GUARDED_BY it, and it is held through MutexLock / UniqueLock
// (common/mutex.h), which std::condition_variable_any also takes.
#pragma once

#include <mutex>
#include <thread>
#include <utility>
#include <vector>

#include "common/thread_annotations.h"

namespace gradlink::internal {

class CAPABILITY("mutex") StateMutex {
 public:
  void lock() ACQUIRE() {
    mu_.lock();
    if (counting_) Count();
  }
  bool try_lock() TRY_ACQUIRE(true) {
    if (!mu_.try_lock()) return false;
    if (counting_) Count();
    return true;
  }
  void unlock() RELEASE() { mu_.unlock(); }
  // Tells the analysis that the caller holds this lock (a lambda run under it); checks nothing.
  void AssertHeld() const ASSERT_CAPABILITY(this) {}

  // Clears the counts and counts every acquisition from now on.
  void StartCounting() EXCLUDES(this) {
    std::lock_guard<std::mutex> lock(mu_);
    counts_.clear();
    counting_ = true;
  }
  // Acquisitions since StartCounting, per thread that took the lock (StartCounting's own and
  // this call's excluded).
  std::vector<std::pair<std::thread::id, uint64_t>> Counts() EXCLUDES(this) {
    std::lock_guard<std::mutex> lock(mu_);
    return counts_;
  }

 private:
  void Count() {
    const std::thread::id self = std::this_thread::get_id();
    for (auto& [id, n] : counts_) {
      if (id == self) {
        ++n;
        return;
      }
    }
    counts_.emplace_back(self, 1);
  }

  std::mutex mu_;
  bool counting_ = false;  // guarded by mu_
  std::vector<std::pair<std::thread::id, uint64_t>> counts_;  // guarded by mu_
};

}  // namespace gradlink::internal
