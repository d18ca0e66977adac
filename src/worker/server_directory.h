// ServerDirectory: the worker's map of the job's servers by id (their push-lane endpoints,
// their names, which are lost, whether failover is possible), read on every partition and
// written a handful of times in a job's life.
//
// Why its own owner: the data path reads an id's endpoint (PumpLocked) and whether it is lost
// (the pull lane's OnHeader/OnPayload) per partition; the writes are the joining in Init() and
// the scheduler's kServerJoined / kServerLost, all rare. So the endpoints and the lost flags
// are atomics in arrays sized once (Reset: the job's servers plus the most standbys a job may
// add, wire::kMaxServersJoined), read without any lock; the names, which only errors and logs
// read, are strings under this directory's own `mu_`. Nothing is ever freed or moved while the
// worker lives, so a reader needs no lock to stay safe.
//
// Threads: Reset() and the first Connected() calls run in WorkerImpl::Init() before the control
// thread starts and before any op exists; from then on the writers (Join, MarkLost) run on the
// control thread only, one at a time, under the worker's state lock too (so that a reader
// holding that lock sees one version for its whole critical section). Readers: any thread.
// Lock order: the worker's state lock (WorkerImpl::mu_) before `mu_`; nothing is taken under
// `mu_`.
//
// Errors: none; an id out of range reads as "not known" (peer 0, not lost, named "server N").
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "common/mutex.h"
#include "common/thread_annotations.h"
#include "transport/transport.h"
#include "wire/messages.h"

namespace gradlink {
class WorkerImpl;
}  // namespace gradlink

namespace gradlink::internal {

class ServerDirectory {
 public:
  // Sizes the directory for a job of `servers` servers (ids 0..servers-1, none lost, no
  // endpoint yet) and the standbys that may join it. Failover: the job has more than one server.
  // Init() only, before any reader runs.
  void Reset(uint32_t servers) EXCLUDES(mu_) {
    capacity_ = servers + wire::kMaxServersJoined;
    peers_ = std::make_unique<std::atomic<transport::PeerId>[]>(capacity_);
    lost_ = std::make_unique<std::atomic<bool>[]>(capacity_);
    for (uint32_t id = 0; id < capacity_; ++id) {
      peers_[id].store(0, std::memory_order_relaxed);
      // Ids past the known ones are servers that never joined: lost once they are counted.
      lost_[id].store(id >= servers, std::memory_order_relaxed);
    }
    MutexLock lock(mu_);
    names_.assign(servers, "");
    failover_.store(servers > 1, std::memory_order_relaxed);
    ids_.store(servers, std::memory_order_release);
  }

  // Server `id` of the job's own is reachable at `peer` (Init()).
  void Connected(uint32_t id, transport::PeerId peer, std::string name) EXCLUDES(mu_) {
    if (id >= ids()) return;
    MutexLock lock(mu_);
    peers_[id].store(peer, std::memory_order_release);
    names_[id] = std::move(name);
  }

  // A standby `id` joined (kServerJoined), reachable at `*peer`, or unreachable (null: it stays
  // lost, so that a plan naming it fails instead of pushing into nothing). False, changing
  // nothing, when `id` is known and not lost. The caller checked `id` against the job's bounds.
  bool Join(uint32_t id, std::string name, const transport::PeerId* peer) EXCLUDES(mu_) {
    if (id >= capacity_) return false;
    MutexLock lock(mu_);
    const uint32_t known = ids();
    if (id < known && !lost(id)) return false;
    if (id >= known) {
      names_.resize(id + 1);
      ids_.store(id + 1, std::memory_order_release);
    }
    names_[id] = std::move(name);
    if (peer == nullptr) return true;
    peers_[id].store(*peer, std::memory_order_release);
    lost_[id].store(false, std::memory_order_release);
    // A lost server's partitions have somewhere to go now, even with one server.
    failover_.store(true, std::memory_order_release);
    return true;
  }

  // kServerLost: false when `id` is unknown or lost already.
  bool MarkLost(uint32_t id) EXCLUDES(mu_) {
    if (id >= ids()) return false;
    MutexLock lock(mu_);
    if (lost_[id].load(std::memory_order_relaxed)) return false;
    lost_[id].store(true, std::memory_order_release);
    return true;
  }

  // The ids known: the job's servers and the standbys that joined (with the ids between).
  uint32_t ids() const { return ids_.load(std::memory_order_acquire); }
  transport::PeerId peer(uint32_t id) const {
    return id < capacity_ ? peers_[id].load(std::memory_order_acquire) : 0;
  }
  bool lost(uint32_t id) const {
    return id < ids() && lost_[id].load(std::memory_order_acquire);
  }
  bool failover() const { return failover_.load(std::memory_order_acquire); }

  // "server 3 (host)", or "server 3" for an id that never joined.
  std::string Name(uint32_t id) const EXCLUDES(mu_) {
    MutexLock lock(mu_);
    if (id < names_.size() && !names_[id].empty()) return names_[id];
    return "server " + std::to_string(id);
  }
  // The name recorded for `id`, empty when none (as the directory holds it).
  std::string RecordedName(uint32_t id) const EXCLUDES(mu_) {
    MutexLock lock(mu_);
    return id < names_.size() ? names_[id] : std::string();
  }
  // The name of the server whose push-lane endpoint is `peer` ("a server" if none is).
  std::string NameOfPeer(transport::PeerId peer) const EXCLUDES(mu_) {
    MutexLock lock(mu_);
    for (uint32_t id = 0; id < names_.size(); ++id) {
      if (peers_[id].load(std::memory_order_relaxed) == peer) return names_[id];
    }
    return "a server";
  }
  // The id whose endpoint is `peer`, or -1.
  int64_t IdOfPeer(transport::PeerId peer) const {
    const uint32_t known = ids();
    for (uint32_t id = 0; id < known; ++id) {
      if (peers_[id].load(std::memory_order_acquire) == peer) return id;
    }
    return -1;
  }

 private:
  friend class ::gradlink::WorkerImpl;  // names mu_ in its lock order (ACQUIRED_BEFORE)
  // Fixed by Reset(), before any reader.
  uint32_t capacity_ = 0;
  std::unique_ptr<std::atomic<transport::PeerId>[]> peers_;
  std::unique_ptr<std::atomic<bool>[]> lost_;
  std::atomic<uint32_t> ids_{0};
  std::atomic<bool> failover_{false};
  mutable Mutex mu_;  // the writers, one at a time; the names
  std::vector<std::string> names_ GUARDED_BY(mu_);
};

}  // namespace gradlink::internal
