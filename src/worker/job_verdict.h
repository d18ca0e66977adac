// JobVerdict: the worker's word on the job: its sticky failure, and a data peer's failure
// that waits for the scheduler's verdict (a failed endpoint is a symptom; the scheduler names
// the cause, so the worker waits a grace before reporting the symptom itself).
//
// Why its own owner: every operation checks the sticky failure (StartOp, Declare, Barrier,
// Join, the same-host path's waits), and once set it never changes: `failed()` is one atomic
// load, with no lock; the Status itself, read only once the job has failed, and the pending
// peer failure are under this owner's own `mu_`. The control thread's tick asks for an expired
// pending failure here without touching the worker's state lock.
//
// Threads: any. Fail() runs where the job fails (the control thread, a caller's Shutdown, a
// Declare that lost the scheduler), with the worker's state lock held so that the ops it ends
// and the failure agree; Note() runs on the lanes' threads and the control thread, under the
// state lock too. Lock order: `mu_` is a leaf: taken after the worker's state lock
// (WorkerImpl::mu_, declared there), never under the rendezvous lock; nothing is taken under it.
//
// Errors: none of its own; it holds the ones it is given.
#pragma once

#include <atomic>
#include <cstdint>
#include <optional>

#include "common/mutex.h"
#include "common/thread_annotations.h"
#include "gradlink/options.h"
#include "gradlink/status.h"
#include "transport/transport.h"

namespace gradlink {
class WorkerImpl;
}  // namespace gradlink

namespace gradlink::internal {

class JobVerdict {
 public:
  // Whether the job has failed (sticky). No lock.
  bool failed() const { return failed_.load(std::memory_order_acquire); }

  // The job's failure; Ok while it has none.
  Status failure() const EXCLUDES(mu_) {
    if (!failed()) return Status::Ok();
    MutexLock lock(mu_);
    return failure_;
  }

  // The job fails with `s`, unless it failed before (the first failure stands); a pending peer
  // failure is dropped (the verdict came). Returns the job's failure.
  Status Fail(const Status& s) EXCLUDES(mu_) {
    MutexLock lock(mu_);
    if (failure_.ok()) {
      failure_ = s;
      failed_.store(!failure_.ok(), std::memory_order_release);
    }
    pending_ = false;
    return failure_;
  }

  // A data endpoint failed with `s` (the endpoint `peer`, of server `server`, where known):
  // it waits for the scheduler's verdict from now on. False, changing nothing, when the job has
  // failed or another failure is pending already.
  bool Note(const Status& s, std::optional<transport::PeerId> peer = std::nullopt,
            std::optional<uint32_t> server = std::nullopt) EXCLUDES(mu_) {
    MutexLock lock(mu_);
    if (!failure_.ok() || pending_) return false;
    pending_ = true;
    pending_failure_ = s;
    pending_since_ = Clock::now();
    pending_peer_ = peer;
    pending_server_ = server;
    return true;
  }

  // Whether a peer's failure waits for the verdict.
  bool pending() const EXCLUDES(mu_) {
    MutexLock lock(mu_);
    return pending_;
  }

  // kServerLost for `server`: the failure pending for it is the scheduler's to handle now
  // (failover), not the job's end.
  void ClearIfServer(uint32_t server) EXCLUDES(mu_) {
    MutexLock lock(mu_);
    if (pending_ && pending_server_ == server) {
      pending_ = false;
      pending_server_.reset();
      pending_peer_.reset();
    }
  }

  // The pending failure whose grace has run out by `now`: `grace`, or `server_grace` where the
  // failure is a server's (failover waits for the scheduler's kServerLost longer).
  struct Expired {
    Status status;
    std::optional<transport::PeerId> peer;  // the endpoint that failed, where a lane said
  };
  std::optional<Expired> ExpiredBy(Clock::time_point now, Clock::duration grace,
                                   Clock::duration server_grace) const EXCLUDES(mu_) {
    MutexLock lock(mu_);
    const Clock::duration limit = pending_server_ ? server_grace : grace;
    if (!pending_ || now - pending_since_ < limit) return std::nullopt;
    return Expired{pending_failure_, pending_peer_};
  }

 private:
  friend class ::gradlink::WorkerImpl;  // names mu_ in its lock order (ACQUIRED_BEFORE)
  mutable Mutex mu_;
  std::atomic<bool> failed_{false};  // !failure_.ok(), written under mu_
  Status failure_ GUARDED_BY(mu_);   // sticky
  bool pending_ GUARDED_BY(mu_) = false;
  Status pending_failure_ GUARDED_BY(mu_);
  Clock::time_point pending_since_ GUARDED_BY(mu_);
  std::optional<transport::PeerId> pending_peer_ GUARDED_BY(mu_);
  std::optional<uint32_t> pending_server_ GUARDED_BY(mu_);
};

}  // namespace gradlink::internal
