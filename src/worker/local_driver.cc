// The same-host path's driver (local_reduce.h): which thread drives the jobs and how. One thread
// at a time holds drive_mu_ and drives (DriveOnce: take the new jobs, advance each through its
// protocol, end those done or failed); a caller that starts or polls an op drives once if the
// drive is free (Progress), a caller that waits drives until its op is done (Wait), and a
// background thread drives what nobody else does (Background). Threads that do not hold the
// drive sleep on this worker's bell in the segment (a futex) and are rung when it is free, when
// a peer posts or consumes, or when an op ends.
//
// Threads: any caller's thread (Progress, Wait), the background thread, and the thread that
// ends the LocalReduce (Stop, local_reduce.cc). drive_mu_ is never waited for by a caller: it
// is taken with try_lock (only the background thread and Stop block on it), and nobody sleeps
// holding it (Wait spins at most kSpin on the segment holding it). Job::done and Job::summed
// run under it and must not wait either. mu_ (incoming jobs, failure, the background thread's
// wake-up) is taken under drive_mu_, never the other way.
#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <climits>
#include <ctime>

#include "worker/local_reduce.h"
#include "worker/local_segment.h"

namespace gradlink::internal {

using local_path::Bell;
using local_path::CpuRelax;
using local_path::kPassSums;

namespace {

// A waiting caller spins this long on the segment before it sleeps: a peer's post or
// consumption arrives within a few microseconds when both workers are running, and a futex
// wake-up costs more than that (bench/RESULTS.md, "the same-host path").
constexpr auto kSpin = std::chrono::microseconds(50);
// Sleepers recheck failure and deadlines this often even when nothing rings.
constexpr auto kNap = std::chrono::milliseconds(20);
// What Progress(kPoll) may sum per job on the caller's thread (Python calls it holding the GIL).
constexpr uint64_t kPollSums = 2;

long Futex(std::atomic<uint32_t>* word, int op, uint32_t value, const timespec* timeout) {
  return syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), op, value, timeout, nullptr, 0);
}

}  // namespace

void LocalReduce::WantBackground() {
  MutexLock lock(mu_);
  background_wanted_ = true;
  cv_.NotifyOne();
}

bool LocalReduce::PostsLeft() {
  for (const auto& r : running_) {
    // A host job waits on the servers too: its sums come back while nobody else drives.
    if (r->job.host || r->next_post < r->job.channel.chunks) return true;
  }
  MutexLock lock(mu_);
  return !incoming_.empty();
}

void LocalReduce::ReleaseDrive(uint32_t waiters_besides_me) {
  drive_mu_.unlock();
  // A waiter that found the drive taken sleeps on the bell until it is free.
  if (callers_waiting_.load(std::memory_order_acquire) > waiters_besides_me) Ring(opts_.rank);
}

void LocalReduce::Progress(Step step) {
  if (step == Step::kBackground) {
    Ring(opts_.rank);  // a waiter spinning or asleep on the bell looks again
    WantBackground();
    return;
  }
  if (!drive_mu_.try_lock()) {
    // Another thread drives. A job just started is taken on its next pass; a poll has nothing
    // to do.
    if (step == Step::kPost) Progress(Step::kBackground);
    return;
  }
  // kPost: sums are the waiting caller's (a background wake-up per operation would cost a small
  // push_pull several microseconds); chunks not yet posted hold back the other workers.
  DriveOnce(step == Step::kPost ? 0 : kPollSums);
  const bool posts_left = PostsLeft();
  ReleaseDrive(0);
  if (posts_left) WantBackground();
}

bool LocalReduce::Wait(const std::function<bool()>& done, Clock::time_point deadline) {
  std::atomic<uint32_t>& bell = seg_->bells[opts_.rank].word;
  callers_waiting_.fetch_add(1, std::memory_order_acq_rel);
  bool ok = false;
  for (;;) {
    if (done()) {
      ok = true;
      break;
    }
    if (Clock::now() >= deadline) break;
    // Drive, and spin for the others' next move, holding the drive. Another thread driving
    // (the background thread, which steps aside for waiting callers after its pass, another
    // waiter, a Progress) rings this bell when it lets go, so sleep until then: never wait for the
    // drive itself, another waiter may hold it for a whole large tensor. Nobody sleeps holding it.
    const uint32_t before = bell.load(std::memory_order_seq_cst);
    if (!drive_mu_.try_lock()) {
      SleepOnBell(before, std::min(deadline, Clock::now() + kNap));
      continue;
    }
    bool sleep = false;
    uint32_t seen;
    for (;;) {
      seen = bell.load(std::memory_order_seq_cst);
      const bool moved = DriveOnce(kPassSums);
      if (done()) break;
      const Clock::time_point now = Clock::now();
      if (now >= deadline) break;
      if (moved) continue;
      const Clock::time_point spin_end = std::min(deadline, now + kSpin);
      while (bell.load(std::memory_order_relaxed) == seen && Clock::now() < spin_end) {
        CpuRelax();
      }
      if (bell.load(std::memory_order_relaxed) == seen) {
        sleep = true;
        break;
      }
    }
    ReleaseDrive(/*waiters_besides_me=*/1);
    if (!sleep) {
      ok = done();
      break;
    }
    SleepOnBell(seen, std::min(deadline, Clock::now() + kNap));
  }
  if (callers_waiting_.fetch_sub(1, std::memory_order_acq_rel) == 1 &&
      jobs_.load(std::memory_order_acquire) > 0) {
    WantBackground();  // operations the caller did not wait for go on in the background
  }
  return ok;
}

void LocalReduce::Background() {
  std::atomic<uint32_t>& bell = seg_->bells[opts_.rank].word;
  auto stopping = [this]() EXCLUDES(mu_) {
    MutexLock lock(mu_);
    return stopping_;
  };
  for (;;) {
    {
      MutexLock lock(mu_);
      cv_.Wait(mu_, [this] {
        mu_.AssertHeld();  // the wait runs it under `lock`
        return stopping_ ||
               (background_wanted_ && callers_waiting_.load(std::memory_order_acquire) == 0);
      });
      if (stopping_) return;
      background_wanted_ = false;
    }
    // Drive until nothing is left, unless a caller takes over (it drives everything too).
    for (;;) {
      const uint32_t seen = bell.load(std::memory_order_seq_cst);
      drive_mu_.lock();
      while (DriveOnce(kPassSums) && callers_waiting_.load(std::memory_order_acquire) == 0) {
      }
      const bool work_left = !running_.empty() || PostsLeft();
      ReleaseDrive(0);
      if (!work_left || callers_waiting_.load(std::memory_order_acquire) > 0 || stopping()) break;
      SleepOnBell(seen, Clock::now() + kNap);
    }
  }
}

bool LocalReduce::AbandonIfGone(Running& r, uint32_t j, const char* path) {
  if (seg_->gone[j].load(std::memory_order_acquire) == 0) return false;
  r.failure = Aborted(r.job.what + ": " + LeftJob(j) + "; " + Name(opts_.rank) +
                      " still waits for it (" + path + ", round " +
                      std::to_string(r.job.round) + ")");
  r.abandoned = true;
  return true;
}

bool LocalReduce::DriveOnce(uint64_t sums_per_job) {
  Status failure;
  {
    MutexLock lock(mu_);
    fresh_.swap(incoming_);  // both keep their capacity: no allocation per operation
    if (failed_.load(std::memory_order_acquire)) failure = failure_;
  }
  bool moved = !fresh_.empty();
  for (Job& j : fresh_) {
    auto r = std::make_unique<Running>();
    r->job = std::move(j);
    if (r->job.host) {
      for (uint32_t p = 0; p < r->job.pusher.size(); ++p) {
        if (r->job.pusher[p] == opts_.rank) r->own_parts.push_back(p);
      }
      r->copied.assign(r->job.parts.size(), false);
    }
    running_.push_back(std::move(r));
  }
  fresh_.clear();
  bool finished_any = false;
  for (size_t i = 0; i < running_.size();) {
    Running& r = *running_[i];
    if (failure.ok() &&
        (r.job.host ? AdvanceHost(r, sums_per_job) : AdvanceFlat(r, sums_per_job))) {
      moved = true;
    }
    if (failure.ok() && !r.abandoned && !Finished(r)) {
      ++i;
      continue;
    }
    std::unique_ptr<Running> over = std::move(running_[i]);
    running_.erase(running_.begin() + static_cast<ptrdiff_t>(i));
    over->job.done(failure.ok() ? over->failure : failure, over->t_first_post,
                   over->t_last_post, over->t_arrived);
    jobs_.fetch_sub(1, std::memory_order_acq_rel);
    moved = finished_any = true;
  }
  // A caller asleep in Wait() on an operation this thread just finished.
  if (finished_any) Ring(opts_.rank);
  return moved;
}

bool LocalReduce::Finished(const Running& r) {
  if (!r.job.host) return r.next_sum >= r.job.channel.chunks;
  // A worker that has joined copies nothing out: it is done once it has handed on its sums.
  return r.job.sits_out ? r.next_own >= r.own_parts.size() : r.copies >= r.job.parts.size();
}

void LocalReduce::Ring(uint32_t rank) {
  Bell& b = seg_->bells[rank];
  b.word.fetch_add(1, std::memory_order_seq_cst);
  if (b.sleepers.load(std::memory_order_seq_cst) > 0) {
    Futex(&b.word, FUTEX_WAKE, INT_MAX, nullptr);
  }
}

void LocalReduce::RingPeers() {
  for (uint32_t j = 0; j < opts_.ranks; ++j) {
    if (j != opts_.rank) Ring(j);
  }
}

void LocalReduce::SleepOnBell(uint32_t seen, Clock::time_point until) {
  Bell& b = seg_->bells[opts_.rank];
  const auto remaining = until - Clock::now();
  if (remaining <= Clock::duration::zero()) return;
  const auto ns = std::chrono::duration_cast<std::chrono::nanoseconds>(remaining).count();
  const timespec ts{static_cast<time_t>(ns / 1000000000), static_cast<long>(ns % 1000000000)};
  b.sleepers.fetch_add(1, std::memory_order_seq_cst);
  if (b.word.load(std::memory_order_seq_cst) == seen) Futex(&b.word, FUTEX_WAIT, seen, &ts);
  b.sleepers.fetch_sub(1, std::memory_order_seq_cst);
}

}  // namespace gradlink::internal
