// Joining a job through the scheduler (and again, through a restarted one) and the member's half
// of control-plane liveness: what control/membership.h is built on.
#pragma once

#include <atomic>
#include <memory>
#include <thread>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "common/mutex.h"
#include "common/thread_annotations.h"
#include "gradlink/status.h"
#include "control/control_channel.h"
#include "transport/transport.h"
#include "wire/messages.h"

namespace gradlink {

// `given` when set (tests: the inproc fabric), else a new UCX fabric.
Result<std::shared_ptr<transport::Fabric>> FabricOrUcx(std::shared_ptr<transport::Fabric> given);

struct Joined {
  std::unique_ptr<transport::ControlChannel> channel;
  wire::WelcomeMsg welcome;
};

// A frame a member sends the scheduler right after its kRegister (a resuming worker's
// kResumeKey frames).
struct ControlFrame {
  wire::Header header;
  std::vector<std::byte> payload;
};

// Connects to the scheduler at `scheduler` ("host:port"), registers, sends `after_register`,
// and waits for the welcome. kAborted (with the scheduler's reason) when the scheduler refuses
// us. With a `secret`, first runs the member's side of the handshake (src/security/handshake.h).
// kAuthFailed when the scheduler holds another secret, holds one and we do not, or holds none
// and we do.
Result<Joined> JoinJob(const std::string& scheduler, uint32_t job_hash,
                       const wire::RegisterMsg& reg, transport::Clock::time_point deadline,
                       const std::optional<std::string>& secret = std::nullopt,
                       std::span<const ControlFrame> after_register = {},
                       const std::atomic<bool>* cancel = nullptr);

// Restart: a member whose scheduler went away without ending the job (no kShutdown, no kAbort)
// joins it again as `reg` (with its ResumeState) through JoinJob, trying until `deadline`
// while nothing listens at the address or what listens closes the connection unanswered (the
// scheduler is still restarting). kAborted when a scheduler refuses us, kUnavailable or
// kTimeout naming the scheduler when none took us back by the deadline. Setting `*cancel`
// (the member is stopping) ends it within 100 ms with kAborted.
Result<Joined> RejoinJob(const std::string& scheduler, uint32_t job_hash,
                         const wire::RegisterMsg& reg, transport::Clock::time_point deadline,
                         const std::optional<std::string>& secret,
                         std::span<const ControlFrame> after_register,
                         const std::atomic<bool>* cancel);

// A member's half of control-plane liveness. The control loop calls Heard() for every frame
// from the scheduler and Tick() at least every 100 ms.
class Liveness {
 public:
  Liveness(transport::ControlChannel* channel, uint32_t job_hash, uint32_t sender);
  void Heard() { last_heard_ = transport::Clock::now(); }
  // Sends a heartbeat when one is due; kPeerLost naming the scheduler when it has been silent
  // for kSilenceLimit.
  Status Tick();

 private:
  transport::ControlChannel* channel_;
  wire::Header heartbeat_;
  transport::Clock::time_point last_heard_, last_sent_;
};

// Sends the member's heartbeats from a thread of its own while the caller does something long
// before its control loop runs (a server connecting to thousands of workers): the scheduler
// must not take a busy member for a silent one. Only sends; reads nothing from the channel, so
// nothing meant for the control loop is lost. Stops (and joins) on destruction.
class HeartbeatPump {
 public:
  HeartbeatPump(transport::ControlChannel* channel, uint32_t job_hash, uint32_t sender);
  ~HeartbeatPump();
  HeartbeatPump(const HeartbeatPump&) = delete;
  HeartbeatPump& operator=(const HeartbeatPump&) = delete;

 private:
  Mutex mu_;
  CondVar cv_;
  bool stop_ GUARDED_BY(mu_) = false;
  std::thread thread_;
};

}  // namespace gradlink
