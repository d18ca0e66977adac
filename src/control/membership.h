// Membership: one process's membership of one job, the part the server and the worker share.
//
// It joins the job through the scheduler (control/join.h), owns the control channel and the
// control thread, keeps the scheduler's liveness both ways (heartbeats out, silence in), and,
// when the scheduler goes away without ending the job, rejoins one restarted on its address
// (scheduler/restart.cc) with what the member says it must be told. Every other frame from the
// scheduler goes to the member's MembershipHandler, on the control thread.
//
// Sends to the scheduler (Send, SendOn, Reply) may come from any thread. A reply that cannot
// be sent means the scheduler is gone: Reply closes the channel, so the control thread's next
// read fails and it rejoins (or ends) in the one place that does.
//
// Shape for a shared pool: a Membership knows one job (its hash, secret, scheduler and rank)
// and nothing of the lanes (control/member_lanes.h), so a server can hold one per job.
//
// Threads: Join() and Run() from the owner's thread, once; Leave() from any thread but the
// control thread; the handler's callbacks run on the control thread only.
// Errors: Join() returns JoinJob's (kAborted refused, kAuthFailed, kUnavailable, kTimeout);
// a membership that ends by itself hands its reason to MembershipHandler::OnLost.
#pragma once

#include <atomic>
#include <chrono>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "common/mutex.h"
#include "common/thread_annotations.h"
#include "control/control_channel.h"
#include "control/join.h"
#include "gradlink/status.h"
#include "wire/messages.h"

namespace gradlink {

struct MembershipConfig {
  std::string scheduler;  // "host:port"
  uint32_t job_hash = 0;
  std::optional<std::string> secret;
  // How long a member waits for a restarted scheduler to take it back; 0: never rejoin (the
  // scheduler's loss ends the membership at once).
  std::chrono::milliseconds reconnect_timeout{0};
};

// What a member registers again with when its scheduler restarted, and the frames that follow.
struct Rejoining {
  wire::RegisterMsg reg;
  std::vector<ControlFrame> frames;
};

// What a handler makes of a frame: carry on, or end the membership with `status` (kOk: the
// job ended normally). `hang_up` closes the channel as it ends (the scheduler then sees this
// member leave at once).
struct ControlVerdict {
  bool end = false;
  bool hang_up = false;
  Status status;

  static ControlVerdict Continue() { return {}; }
  static ControlVerdict End(Status s, bool hang_up = false) { return {true, hang_up, std::move(s)}; }
};

// The member's side, implemented by the server and the worker. All calls on the control
// thread.
class MembershipHandler {
 public:
  virtual ~MembershipHandler() = default;
  // A frame from the scheduler (never a heartbeat). An ending verdict ends the control thread
  // after the handler did what the end means to it.
  virtual ControlVerdict OnControl(const transport::Frame& f) = 0;
  // Every tick (at most 100 ms apart). Not ok: the membership ends (OnLost is called with it).
  virtual Status OnTick() { return Status::Ok(); }
  // The scheduler is gone (`why`) without ending the job: what to register again with, or the
  // status to end with instead.
  virtual Result<Rejoining> PrepareRejoin(const std::string& why) = 0;
  // A restarted scheduler welcomed us back: whether the welcome is this member's job (same
  // id, same members). Not ok: the rejoin failed with it.
  virtual Status CheckWelcome(const wire::WelcomeMsg& welcome) = 0;
  // The rejoin is over: `result` ok when the new channel (generation `generation`) is in
  // place, else why it failed (OnLost follows). Every PrepareRejoin that succeeded gets one.
  virtual void OnRejoined(const Status& result, uint64_t generation) = 0;
  // The membership ended by itself: the scheduler is lost for good (no restarted one took us
  // back, or a rejoin was cancelled by Leave()), or OnTick failed. Not called for an ending
  // verdict, nor for a lost scheduler once Leave() or StartLeaving() ran.
  virtual void OnLost(const Status& why) = 0;
};

// The scheduler's kAbort as a status: its code (kAborted when it names none) and
// "`what`: its text".
Status AbortStatus(const transport::Frame& abort, const std::string& what);

class Membership {
 public:
  Membership(MembershipConfig config, std::string name);
  ~Membership();
  Membership(const Membership&) = delete;
  Membership& operator=(const Membership&) = delete;

  // Registers `reg` with the scheduler and waits for the welcome, until `deadline`.
  Result<wire::WelcomeMsg> Join(const wire::RegisterMsg& reg, transport::Clock::time_point deadline);

  // The member's id in the job (the welcome's your_id) and how logs and errors name it
  // ("worker 3", "server 1"). Set by Join().
  uint32_t id() const { return id_.load(std::memory_order_relaxed); }
  const std::string& name() const { return name_; }

  // Starts the control thread; `on_start` runs first on it (the server pins it).
  void Run(MembershipHandler* handler, std::function<void()> on_start = {});

  // The current channel (replaced by a rejoin), for a sender that must outlive a rejoin.
  std::shared_ptr<transport::ControlChannel> channel() const EXCLUDES(channel_mu_);
  // Counts the channels: a rejoin makes the next generation.
  uint64_t generation() const { return generation_.load(); }

  // Sends on the current channel.
  Status Send(const wire::Header& h, std::span<const std::byte> payload = {},
              transport::Clock::time_point deadline = transport::Clock::now() +
                                                      std::chrono::seconds(10));
  // Sends on the channel of generation `generation`; nothing (ok) when it has been replaced:
  // whatever it said travelled in the member's ResumeState instead.
  Status SendOn(uint64_t generation, const wire::Header& h, std::span<const std::byte> payload,
                transport::Clock::time_point deadline);
  // An answer the scheduler waits for (an ack): when it cannot be sent the channel is closed,
  // so the control thread rejoins a restarted scheduler (which asks again) or ends.
  void Reply(const wire::Header& h, std::span<const std::byte> payload = {});

  // Gives up a rejoin in progress within 100 ms (the member is stopping and cannot wait).
  void CancelRejoin() { rejoin_cancel_ = true; }

  // The control thread stops at its next tick (the member is shutting down, and must not
  // rejoin or fail meanwhile); Leave() then ends the membership.
  void StartLeaving() { leaving_ = true; }
  // Ends the membership: with a `goodbye_deadline` first says kGoodbye (the scheduler then
  // knows the member left on purpose), then cancels a rejoin under way, closes the channel and
  // joins the control thread. Idempotent. The owner calls it before destroying what the
  // handler's calls touch (the destructor's own Leave comes too late for that).
  void Leave(std::optional<transport::Clock::time_point> goodbye_deadline);
  bool leaving() const { return leaving_.load(); }

 private:
  void Loop();
  // The scheduler is gone (`why`): rejoin a restarted one. False when the membership ends.
  bool Recover(const std::string& why);
  Status Rejoin(const std::string& why);

  const MembershipConfig config_;
  std::string name_;  // the role until Join(), then "role id"
  std::atomic<uint32_t> id_{0};
  MembershipHandler* handler_ = nullptr;  // set by Run(), before the thread starts

  // Replaced by a rejoin on the control thread; read by senders on any thread.
  mutable Mutex channel_mu_;
  std::shared_ptr<transport::ControlChannel> channel_ GUARDED_BY(channel_mu_);
  std::atomic<uint64_t> generation_{0};

  std::atomic<bool> leaving_{false};
  std::atomic<bool> left_{false};  // Leave() ran
  std::atomic<bool> rejoin_cancel_{false};
  std::thread thread_;
};

}  // namespace gradlink
