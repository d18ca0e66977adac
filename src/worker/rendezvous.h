// Rendezvous: what the worker has entered and been released from at the scheduler: barriers,
// join(), and the rejoin of a restarted scheduler.
//
// Why its own owner: Barrier() and Join() block their callers until the scheduler's release
// (and Shutdown() waits for a rejoin in progress); they wait on this owner's condition variable
// under its own `mu`, never on the worker's state lock, which the data path needs meanwhile.
// The control thread's releases (kBarrierRelease) touch nothing else. Where a step must agree
// with the tensors (a rejoin tells the scheduler every tensor and the barriers as of one moment;
// a Declare during a rejoin is sent once it is back; a join release resumes the keys' rounds),
// the worker takes its state lock first and this one inside it.
//
// Threads: the callers (Barrier, Join, Declare, Shutdown), the control thread (releases,
// PrepareRejoin, OnRejoined) and, on a host path, the thread sitting a join out. The job's
// failure wakes every waiter (WorkerImpl::FailAll calls Wake()); a waiter's predicate reads it
// from JobVerdict::failed(), which needs no lock.
// Lock order: the worker's state lock (WorkerImpl::mu_) before `mu` (declared there); nothing
// is taken under `mu` (JobVerdict::failed() is an atomic load).
#pragma once

#include <atomic>
#include <cstdint>

#include "common/mutex.h"
#include "common/thread_annotations.h"

namespace gradlink::internal {

struct Rendezvous {
  // Wakes every waiter, after a change their predicates read that was made without `mu` (the
  // job's failure): taking `mu` orders the wake after a waiter's last look.
  void Wake() EXCLUDES(mu) {
    MutexLock lock(mu);
    cv.NotifyAll();
  }

  Mutex mu;
  CondVar cv;  // over `mu`: a release, the job's failure, a rejoin's end
  uint64_t barrier_sent GUARDED_BY(mu) = 0;
  uint64_t barrier_released GUARDED_BY(mu) = 0;
  // Restart: the scheduler is gone and the control thread is rejoining a restarted one. A
  // sender decides under `mu` (not while reconnecting), noting the membership's generation.
  bool reconnecting GUARDED_BY(mu) = false;
  // The barriers entered as the rejoin's ResumeState says.
  uint64_t rejoin_barriers_told GUARDED_BY(mu) = 0;
  // Join(): in progress; released (every rank joined) with the rank that joined last.
  bool joining GUARDED_BY(mu) = false;
  // Written under `mu`; read without it too (a host path's sit-out loop).
  std::atomic<bool> join_released{false};
  // A join() timed out after its kJoin was sent: the join stands, and the next join() takes
  // its release (or waits for it) instead of joining again.
  bool join_timed_out GUARDED_BY(mu) = false;
  uint32_t join_last GUARDED_BY(mu) = 0;
};

}  // namespace gradlink::internal
