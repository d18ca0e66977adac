// UcxLane's progress thread: the loop that drives the worker, the queue through which other
// threads hand it work, and the work that must wait until ucp_worker_progress() has returned.
#include <poll.h>
#include <sched.h>
#include <ucp/api/ucp.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <mutex>
#include <thread>
#include <unordered_set>
#include <utility>
#include <vector>

#include "common/log.h"
#include "transport/ucx/status.h"
#include "transport/ucx/ucx_lane.h"

namespace gradlink::transport::ucx {
namespace {

// After the last progress, keep polling this long (yielding the core between polls) before
// sleeping: cuts latency for request/response patterns without burning a core...
constexpr auto kSpin = std::chrono::microseconds(20);
// ...on hosts with at least this many hardware threads. With fewer, a one-host job has more
// busy threads than cores (2 workers + 2 servers run ~10), and on a 2-core host shared with
// other jobs every spin, even a yielding one, measured worse than sleeping at once: a yielding
// thread sees its events only when it gets the core back, a sleeping one is woken by them
// (64 MiB push_pull 0.4-0.6 GB/s busbw spinning against 0.7-0.9 sleeping; 4 KiB about even).
constexpr unsigned kMinThreadsToSpin = 8;
// Progress calls in a row before the queue is looked at again.
constexpr int kMaxProgressRounds = 64;
// Upper bound on one sleep, so a missed wake-up costs at most this much.
constexpr int kPollTimeoutMs = 100;

// The lane whose progress thread is the current thread, if any.
thread_local const void* t_progress_lane = nullptr;

}  // namespace

bool UcxLane::OnProgressThread() const { return t_progress_lane == this; }

bool UcxLane::Enqueue(std::function<void()> fn) {
  bool was_empty;
  {
    MutexLock lock(queue_mu_);
    if (queue_closed_) return false;
    was_empty = queue_.empty();
    queue_.push_back(std::move(fn));
    queue_nonempty_.store(true, std::memory_order_release);
  }
  // The thread drains the whole queue each round, so only the empty -> non-empty edge needs a
  // wake-up (the eventfd stays readable until the thread next polls). On the progress thread
  // none is needed: the loop looks at the queue before it sleeps.
  if (was_empty && !OnProgressThread()) Wake();
  return true;
}

void UcxLane::Wake() {
  uint64_t one = 1;
  // EAGAIN only when the counter is saturated, i.e. a wake-up is already pending.
  ssize_t n = write(wake_fd_, &one, sizeof(one));
  (void)n;
}

void UcxLane::Defer(std::function<void()> fn) {
  if (!Enqueue(std::move(fn))) {
    GL_LOG(kDebug) << "ucx lane '" << name_ << "': dropped a deferred call after Stop()";
  }
}

void UcxLane::ProgressLoop() {
  t_progress_lane = this;
  bool arm_failure_logged = false;
  while (!stop_requested_.load(std::memory_order_acquire)) {
    RunQueued();
    // Bounded, so that a flood of incoming frames cannot starve queued sends or Stop().
    int rounds = 0;
    while (rounds < kMaxProgressRounds && ProgressOnce() != 0) ++rounds;
    if (rounds == kMaxProgressRounds) continue;

    // Short spin: a reply often arrives within microseconds, and sleeping through it would cost
    // a syscall and a context switch each way.
    bool active = false;
    static const bool spin = std::thread::hardware_concurrency() >= kMinThreadsToSpin;
    const auto spin_end = Clock::now() + kSpin;
    while (spin && Clock::now() < spin_end) {
      if (queue_nonempty_.load(std::memory_order_acquire) || ProgressOnce() != 0 ||
          stop_requested_.load(std::memory_order_relaxed)) {
        active = true;
        break;
      }
      // Spin politely: where busy threads outnumber cores, a plain busy loop holds the core
      // that the thread we are waiting for needs (on the 2-core host, the former 30 us busy
      // spin made a 4 KiB push_pull ~360 us, yielding ~50-150, not spinning ~70-150). With
      // idle cores, sched_yield returns at once and this is an ordinary busy poll.
      sched_yield();
    }
    if (active) continue;

    ucs_status_t s = ucp_worker_arm(worker_);
    if (s == UCS_ERR_BUSY) continue;  // events arrived meanwhile
    int timeout_ms = kPollTimeoutMs;
    if (s != UCS_OK) {
      // No wake-up support from some transport: fall back to a bounded 1 ms nap, never a spin.
      if (!arm_failure_logged) {
        GL_LOG(kWarn) << "ucx lane '" << name_ << "': ucp_worker_arm: " << UcsError(s)
                      << "; polling every 1 ms";
        arm_failure_logged = true;
      }
      timeout_ms = 1;
    }
    if (queue_nonempty_.load(std::memory_order_acquire)) continue;

    // The wake fd first: without a working arm only it is polled.
    pollfd fds[2] = {{wake_fd_, POLLIN, 0}, {worker_fd_, POLLIN, 0}};
    int n = poll(fds, s == UCS_OK ? 2 : 1, timeout_ms);
    if (n > 0 && (fds[0].revents & POLLIN)) {
      uint64_t v;
      ssize_t r = read(wake_fd_, &v, sizeof(v));
      (void)r;
    }
  }
  Shutdown();
  t_progress_lane = nullptr;
}

std::vector<std::function<void()>> UcxLane::TakeQueued(bool close_if_empty) {
  std::vector<std::function<void()>> batch = std::move(running_);
  batch.clear();
  MutexLock lock(queue_mu_);
  batch.swap(queue_);
  queue_nonempty_.store(false, std::memory_order_relaxed);
  if (close_if_empty && batch.empty()) queue_closed_ = true;
  return batch;
}

void UcxLane::RunBatch(std::vector<std::function<void()>> batch) {
  for (auto& fn : batch) fn();
  batch.clear();  // the closures' captures go now; the capacity stays for the next round
  if (batch.capacity() > running_.capacity()) running_ = std::move(batch);
}

bool UcxLane::RunQueued() {
  std::vector<std::function<void()>> batch = TakeQueued(false);
  bool ran = !batch.empty();
  RunBatch(std::move(batch));
  // Queued work (a send hitting a failed peer) may have scheduled closes.
  ran |= RunAfterProgress();
  return ran;
}

// Flushes the worker: every operation and wireup message in flight on it completes (or fails,
// with its peer). Bounded: a hung peer costs `timeout`. Progress thread, or the owning thread.
void UcxLane::FlushWorker(std::chrono::milliseconds timeout) {
  if (worker_ == nullptr) return;
  ucp_request_param_t fp{};
  ucs_status_ptr_t r = ucp_worker_flush_nbx(worker_, &fp);
  if (r == nullptr || UCS_PTR_IS_ERR(r)) return;
  const auto deadline = Clock::now() + timeout;
  while (ucp_request_check_status(r) == UCS_INPROGRESS && Clock::now() < deadline) {
    if (ProgressOnce() == 0) std::this_thread::sleep_for(std::chrono::microseconds(100));
  }
  if (ucp_request_check_status(r) == UCS_INPROGRESS) ucp_request_cancel(worker_, r);
  ucp_request_free(r);
}

unsigned UcxLane::ProgressOnce() {
  unsigned n = ucp_worker_progress(worker_);
  if (RunAfterProgress()) ++n;
  return n;
}

// Work that must not run inside a ucp callback (closing endpoints re-enters UCX) runs here,
// right after ucp_worker_progress() returns.
bool UcxLane::RunAfterProgress() {
  if (after_progress_.empty() && reply_eps_to_close_.empty()) return false;
  std::vector<std::function<void()>> work;
  work.swap(after_progress_);
  for (auto& fn : work) fn();
  std::unordered_set<ucp_ep_h> eps;
  eps.swap(reply_eps_to_close_);
  for (ucp_ep_h ep : eps) {
    authenticated_.erase(ep);
    CloseEp(ep);
  }
  return true;
}

}  // namespace gradlink::transport::ucx
