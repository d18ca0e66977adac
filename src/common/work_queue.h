// A thread that runs posted closures in order. Used for the server's engine threads.
#pragma once

#include <functional>
#include <thread>
#include <vector>

#include "common/mutex.h"
#include "common/thread_annotations.h"

namespace gradlink {

class WorkQueue {
 public:
  WorkQueue() : thread_([this] { Loop(); }) {}
  ~WorkQueue() { Stop(); }
  WorkQueue(const WorkQueue&) = delete;
  WorkQueue& operator=(const WorkQueue&) = delete;

  // False once stopped: the closure is dropped.
  bool Post(std::function<void()> fn) {
    MutexLock lock(mu_);
    if (stopped_) return false;
    queue_.push_back(std::move(fn));
    cv_.NotifyOne();
    return true;
  }

  // Closures posted and not yet taken by the thread (a batch being run is not counted).
  size_t depth() {
    MutexLock lock(mu_);
    return queue_.size();
  }

  // Runs what is queued, then joins. Idempotent.
  void Stop() {
    {
      MutexLock lock(mu_);
      stopped_ = true;
      cv_.NotifyOne();
    }
    if (thread_.joinable() && thread_.get_id() != std::this_thread::get_id()) thread_.join();
  }

 private:
  // Takes the whole queue at once and runs it outside the lock: one lock per batch, and the two
  // vectors keep their capacity, so a steady stream of posts allocates nothing (a deque
  // allocated a block every few posts and freed one behind them).
  void Loop() {
    std::vector<std::function<void()>> running;
    UniqueLock lock(mu_);
    while (true) {
      while (!stopped_ && queue_.empty()) cv_.Wait(mu_);
      if (queue_.empty()) return;
      running.swap(queue_);
      lock.unlock();
      for (auto& fn : running) fn();
      running.clear();
      lock.lock();
    }
  }

  Mutex mu_;
  CondVar cv_;
  std::vector<std::function<void()>> queue_ GUARDED_BY(mu_);
  bool stopped_ GUARDED_BY(mu_) = false;
  std::thread thread_;  // last: starts after the members it uses exist
};

}  // namespace gradlink
