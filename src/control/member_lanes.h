// MemberLanes: the data lanes of one process that belongs to a job as a server or a worker.
//
// A push lane, and a pull lane unless the member runs single-lane (then the push lane carries
// both directions), created on one fabric (UCX, or the inproc fabric of unit tests), each
// proving membership with the job's lane authenticator (security/lane_auth.h) and started with
// the member's receivers. The worker and the server open them the same way; this is the one
// place that does it.
//
// Why it is apart from the membership (control/membership.h): lanes belong to a process, a
// membership to a job. A server of a shared pool will keep one MemberLanes and hold a
// Membership per job it serves; only the authenticator then has to know several jobs.
//
// Threads: Open() and Stop() from the owner's thread; the lanes themselves are thread-safe
// (transport/transport.h). The lanes live until Stop() or destruction.
// Errors: Open() returns the fabric's (kUnavailable when UCX cannot start, ...).
#pragma once

#include <memory>
#include <optional>
#include <string>

#include "gradlink/status.h"
#include "transport/transport.h"

namespace gradlink {

struct LaneConfig {
  std::string role;  // "worker" or "server": names the lanes ("worker push lane")
  uint32_t job_hash = 0;
  std::optional<std::string> secret;  // the job's: every connection proves it
  bool single_lane = false;
  std::shared_ptr<transport::Fabric> fabric;  // nullptr: a new UCX fabric
};

class MemberLanes {
 public:
  MemberLanes() = default;
  MemberLanes(const MemberLanes&) = delete;
  MemberLanes& operator=(const MemberLanes&) = delete;
  ~MemberLanes() { Stop(); }

  // Creates the lanes and starts them: pushes arrive at `push_receiver`, everything the pull
  // lane receives at `pull_receiver` (both must outlive the lanes; they may be the same).
  Status Open(const LaneConfig& config, transport::Receiver* push_receiver,
              transport::Receiver* pull_receiver);

  transport::Lane& push() { return *push_; }
  const transport::Lane& push() const { return *push_; }
  // nullptr when single-lane.
  transport::Lane* pull() { return pull_.get(); }
  const transport::Lane* pull() const { return pull_.get(); }
  // Where replies travel: the pull lane, else the push lane.
  transport::Lane& reply() { return pull_ ? *pull_ : *push_; }
  bool open() const { return push_ != nullptr; }
  transport::Fabric& fabric() { return *fabric_; }

  // Both lanes' counters added up (zeros before Open); protocol_errors among them: frames the
  // lanes refused before any receiver saw them.
  transport::LaneStats stats() const;

  // Stops the pull lane, then the push lane (their progress threads end; pending sends
  // complete with kAborted). Idempotent.
  void Stop();

 private:
  std::shared_ptr<transport::Fabric> fabric_;
  std::unique_ptr<transport::Lane> push_, pull_;
};

}  // namespace gradlink
