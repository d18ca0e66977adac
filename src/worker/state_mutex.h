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
#pragma once

#include <mutex>
#include <thread>
#include <utility>
#include <vector>

namespace gradlink::internal {

class StateMutex {
 public:
  void lock() {
    mu_.lock();
    if (counting_) Count();
  }
  bool try_lock() {
    if (!mu_.try_lock()) return false;
    if (counting_) Count();
    return true;
  }
  void unlock() { mu_.unlock(); }

  // Clears the counts and counts every acquisition from now on.
  void StartCounting() {
    std::lock_guard<std::mutex> lock(mu_);
    counts_.clear();
    counting_ = true;
  }
  // Acquisitions since StartCounting, per thread that took the lock (StartCounting's own and
  // this call's excluded).
  std::vector<std::pair<std::thread::id, uint64_t>> Counts() {
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
