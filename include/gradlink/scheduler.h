// The scheduler: rendezvous and control of one job.
//
// It accepts registrations until the expected workers and servers have joined, assigns worker
// ranks (honouring requested ranks) and server ids, sends everyone the address book, plans each
// declared tensor's partitions (checking that every worker declared it alike), runs barriers,
// and ends the job: kShutdown once every worker has said goodbye, kAbort to everyone as soon as
// a member is lost or misbehaves.
//
// Threads: all methods are thread-safe. The scheduler runs its own threads until Stop().
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>

#include "gradlink/export.h"
#include "gradlink/options.h"
#include "gradlink/status.h"

namespace gradlink {

class GRADLINK_EXPORT Scheduler {
 public:
  // Binds the port and starts accepting. kUnavailable naming the port when it is in use;
  // kInvalidArgument naming the metrics port (options.metrics_port) when that one is taken.
  static Result<std::unique_ptr<Scheduler>> Start(const SchedulerOptions& options);
  virtual ~Scheduler() = default;

  virtual uint16_t port() const = 0;

  // Blocks until the job ends: OK when every worker left cleanly, the failure otherwise,
  // kTimeout at the deadline (the job goes on).
  virtual Status Wait(std::chrono::steady_clock::time_point deadline) = 0;

  // Ends the job now (members get kAbort if it was still running) and joins the threads.
  virtual void Stop() = 0;

  // Frames that failed validation (their connections were closed).
  virtual uint64_t protocol_errors() const = 0;

  // Connections refused by authentication (options.secret set: a wrong, missing, malformed,
  // oversized or unfinished handshake; unset: a member that offered a handshake). Nothing of
  // them was processed.
  virtual uint64_t auth_failures() const = 0;
};

}  // namespace gradlink
