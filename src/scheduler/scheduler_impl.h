// The scheduler behind include/gradlink/scheduler.h: one event-loop thread that owns every
// connection and all job state.
//
// Why one loop: a member whose socket is full must never delay anyone else. Earlier the scheduler
// had a thread per connection and sent (with a 10 s deadline) while holding its one mutex, so one
// member that stopped reading stopped heartbeats to everyone. Now the loop polls the listener and
// every control socket; each connection (MemberConnection) parses frames incrementally and keeps
// a send queue, so sending is queueing and nothing waits on one member. A member whose queue does
// not drain (kMaxQueuedBytes, or its oldest frame waited kSilenceLimit) is failed alone, like a
// silent one. Gloo's tcp loop (other threads defer() work onto it) is the model: here the only
// work from other threads is Stop(), handed over through an atomic and an eventfd.
//
// Files: scheduler_loop.cc (the loop, accepting, deadlines, authentication, closing),
// scheduler.cc (the job: registration, welcome, barriers, joins, goodbyes, the end),
// planning.cc (a key's plan: declarations, partitions, placement, budgets, acks),
// failover.cc (standby servers joining; a lost server's partitions moved to a standby or the
// servers left), restart.cc (a restarted scheduler rebuilding the job from its members) and
// metrics.cc (/metrics and /targets from a view the loop refreshes; the stall inspector).
//
// Threads: everything below runs on the loop thread, except Wait(), Stop(), the counters and
// port(), which other threads call: they read only `mu_`'s fields, atomics and constants; and
// the metrics server's thread, which reads `view_` under `view_mu_` and atomics.
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "common/mutex.h"
#include "common/thread_annotations.h"
#include "gradlink/scheduler.h"
#include "metrics/exposition.h"
#include "metrics/http_server.h"
#include "scheduler/member_connection.h"
#include "scheduler/placement.h"
#include "security/handshake.h"
#include "control/control_channel.h"
#include "control/topology.h"
#include "control/tuning.h"
#include "wire/messages.h"

namespace gradlink::scheduler {

using namespace std::chrono_literals;

inline constexpr auto kRegisterTimeout = 10s;
// With a job secret: the handshake must be complete this long after the connection was accepted
// (4 s, so that a stalled or slow peer is refused well within 5 s).
inline constexpr auto kHandshakeTimeout = 4s;
// Connections that have not registered yet, at most; more are closed at once.
inline constexpr size_t kMaxUnregistered = 1024;
// ...and from one source address (so one host cannot hold all the slots).
inline constexpr size_t kMaxUnregisteredPerAddress = 256;
// Once a frame has begun, the rest of its header, and then its payload, may each take this long
// (as ControlChannel::Receive allows).
inline constexpr auto kFrameGrace = 5s;
// The loop wakes at least this often to check its deadlines.
inline constexpr auto kTick = 100ms;
// A refusal or kAbort is written before the connection closes, for at most this long.
inline constexpr auto kFlushBeforeClose = 1s;
// When the scheduler stops, members get this long to read what it sent and close their end.
inline constexpr auto kLingerBeforeClose = 500ms;
// More unwritten bytes than this for one member and it does not read: it is failed. Room for a
// welcome with the largest address book (one kMaxControlPayload frame) and a burst of kAssigns.
inline constexpr size_t kMaxQueuedBytes = 8u << 20;
// Standby servers (ServerOptions::standby) waiting at once, at most; more are refused.
inline constexpr uint32_t kMaxStandbyServers = 64;
// Restart: once the first member re-registers, the rest have this long to follow.
inline constexpr auto kResumeTimeout = 15s;
using wire::kMaxServersJoined;

using Payload = std::shared_ptr<const std::vector<std::byte>>;
// One encoding shared by every member's queue that sends it.
inline Payload Share(std::vector<std::byte> bytes) {
  return std::make_shared<const std::vector<std::byte>>(std::move(bytes));
}

// One control connection and, once it registered, the member it is.
struct Connection {
  Connection(std::unique_ptr<transport::ControlChannel> channel, Clock::time_point now)
      : link(std::move(channel)), accepted(now), last_heard(now) {}
  MemberConnection link;
  Clock::time_point accepted;
  Clock::time_point last_heard;
  // With a job secret: present until the handshake is done; frames go to it, nothing else.
  std::optional<security::ServerHandshake> handshake;
  bool registered = false;
  bool left = false;  // said goodbye
  bool welcome_queued = false;  // its kWelcome is not yet all written
  // With a job secret: what the member proved in the handshake; kRegister must agree.
  wire::Role auth_role = wire::Role::kWorker;
  int32_t auth_rank = -1;
  wire::Role role = wire::Role::kWorker;
  uint32_t id = 0;  // valid once the job has started
  wire::RegisterMsg reg;
  uint32_t resume_keys_left = 0;  // restart: its kResumeKey frames still to come (of all
                                  // workers: SchedulerImpl::resume_keys_pending_)
  bool asked_standby = false;     // a server that registered with ServerOptions::standby
  std::string metrics_address;    // "host:port" of its /metrics; empty: it serves none
};

// One declared key: what each worker declared, and whether it has been answered.
struct Declaration {
  std::string name;
  DataType dtype{};
  uint64_t count = 0;
  uint64_t partition_bytes = 0;
  topology::Mode mode = topology::Mode::kFlat;  // how the servers aggregate it
  CollectiveSpec spec;                          // what the key is for (every worker's)
  std::map<uint32_t, std::pair<wire::Header, wire::DeclareMsg>> by_rank;
  bool planned = false;
  Status status;  // kMismatch when the workers disagree
  wire::Header assign_header;
  Payload assign_payload;  // the same bytes for every member
  std::set<uint32_t> acks;  // servers that have the plan
  std::set<uint32_t> sent_to;  // servers the plan went to (not the standbys)
  std::vector<wire::PartitionPlan> plan;  // once planned (its partitions' servers)
  bool delivered = false;   // the workers have the plan
  bool replanning = false;  // failover: moved partitions wait for their new servers' acks
  // Ranks of the key's group that had joined (Worker::Join) and not declared it when it was
  // planned: each may declare it later, and gets the plan if its declaration agrees.
  std::set<uint32_t> joined_at_plan;
  // Declarers that have retired the key (kRetire: its name was declared again); once all have,
  // the servers forget it and so does the scheduler (OnRetire).
  std::set<uint32_t> retired;
  // The stall inspector: when the first worker declared it, and when a stall of its
  // declaration was last reported ({}: never).
  Clock::time_point first_declared{};
  Clock::time_point stall_told{};
};

// What a scrape reads (metrics.cc): copied from the loop's state by RefreshView.
struct MetricsView {
  struct Member {
    wire::Role role = wire::Role::kWorker;
    uint32_t id = 0;
    std::string metrics_address;
  };
  std::vector<Member> members;  // registered and not lost
  bool started = false, finished = false;
  uint32_t workers = 0, servers = 0, standbys = 0;
  uint64_t keys = 0, keys_planned = 0, keys_refused = 0, barriers = 0;
  uint64_t servers_lost = 0, servers_admitted = 0, workers_lost = 0, stalls = 0;
  std::vector<std::pair<uint32_t, std::pair<uint64_t, uint64_t>>> server_memory;  // id: budget, held
  uint64_t planned_bytes = 0;  // held_ summed over every server
  // The address /targets names the scheduler by: its --host, or where it listens on every
  // interface, the address its members reached it at.
  std::string self_host;
};

class SchedulerImpl final : public Scheduler {
 public:
  // Takes the bound listener and an eventfd (Stop() wakes the loop through it); starts the loop.
  SchedulerImpl(const SchedulerOptions& options, std::unique_ptr<transport::Listener> listener,
                int wake_fd);
  ~SchedulerImpl() override;

  uint16_t port() const override { return listener_->port(); }
  uint64_t protocol_errors() const override { return protocol_errors_.load(); }
  uint64_t auth_failures() const override { return auth_failures_.load(); }
  Status Wait(Clock::time_point deadline) override;
  void Stop() override;
  // Starts the metrics server (opts_.metrics_port; Scheduler::Start, once the loop runs):
  // kInvalidArgument naming the port when it is taken.
  Status ServeMetrics();

 private:
  // ---- scheduler_loop.cc: the loop and the connections' lifecycle ----
  void Loop();
  void AcceptAll(Clock::time_point now);
  // Reads what `c`'s socket holds and handles the complete frames in it.
  void ProcessInput(Connection& c, Clock::time_point now);
  void OnFrame(Connection& c, const transport::Frame& f, Clock::time_point now);
  void OnBadInput(Connection& c, const Status& why, const wire::Header& header,
                  Clock::time_point now);
  void Authenticate(Connection& c, const transport::Frame& f, Clock::time_point now);
  // Refuses a connection that failed authentication: counts it, tells the member why (kAbort
  // with kAuthFailed) when `tell`, and closes it. Nothing it sent is processed.
  void AuthFailure(Connection& c, const std::string& why, bool tell, Clock::time_point now);
  // Deadlines: the join timeout, handshakes, registration, frames begun, closing connections,
  // members that do not read, silence, heartbeats.
  void OnTimers(Clock::time_point now);
  void CheckConnection(Connection& c, Clock::time_point now);
  // Connections whose write failed: what they sent before is handled, then they are lost.
  void CheckSendErrors(Clock::time_point now);
  // Drops the connections that closed before registering (a registered member stays: the job
  // names it in errors).
  void Reap();
  bool AllFlushed() const;
  // Half-closes every connection, waits (until `deadline`) for each member to close its end,
  // then closes them: no reset discards what a member had not read yet.
  void CloseGracefully(Clock::time_point deadline);

  // ---- restart.cc: a scheduler restarted on a dead one's address resumes its job ----
  // A member that was in the job re-registers (RegisterMsg::resume): recorded; the resumed job
  // starts once everyone is back (MaybeStartResumedJob).
  Status RegisterResume(Connection& c, wire::RegisterMsg reg);
  Status OnResumeKey(Connection& c, const transport::Frame& f);
  // Who the resumed job still waits for ("worker 1, server 0"); empty once it can start.
  std::string ResumeMissing() const;
  Status MaybeStartResumedJob();
  // Rebuilds members, plans, placement, budgets and barriers from what the members told, and
  // welcomes them back.
  Status StartResumedJob();
  bool resuming_ = false;
  Clock::time_point resume_began_;
  uint64_t resume_keys_pending_ = 0;  // kResumeKey frames announced and not yet received
  // Per key, the ranks that said they hold its plan (until the resumed job starts).
  std::map<uint64_t, std::set<uint32_t>> resume_planned_by_;

  // ---- metrics.cc: what a scrape reads, and the stall inspector ----
  // /metrics and /targets (the metrics server's thread).
  metrics::Families CollectMetrics() const EXCLUDES(view_mu_);
  std::string RenderTargets() const EXCLUDES(view_mu_);
  // Copies the loop's state into view_ (at most every 200 ms unless `now_too`).
  void RefreshView(Clock::time_point now, bool now_too = false) EXCLUDES(view_mu_);
  Clock::time_point view_refreshed_{};
  // Declarations some workers made and the others not, for opts_.stall_check: logged, told to
  // the workers that declared, and (opts_.stall_shutdown) the job's end.
  void CheckStalls(Clock::time_point now);
  Clock::time_point stalls_checked_{};
  // kStallReport from a server: its stalled rounds, named, logged and told likewise. A key's
  // round is reported once a period, whichever servers report it (rounds_told_). A report
  // that does not decode is counted and dropped: the server is not failed for it.
  Status OnStallReport(Connection& c, const transport::Frame& f);
  std::map<std::pair<uint64_t, uint64_t>, Clock::time_point> rounds_told_;
  // Logs `lines` as one stall, tells `told` (worker ranks) and ends the job when `age` reached
  // opts_.stall_shutdown.
  void ReportStall(const std::vector<std::string>& lines, const std::set<uint32_t>& told,
                   Clock::duration age);
  uint64_t stalls_ = 0, keys_planned_ = 0, workers_lost_ = 0;

  // ---- scheduler.cc: the job (and planning.cc: a key's plan) ----
  Status Handle(Connection& c, const transport::Frame& f);
  Status OnRegister(Connection& c, const transport::Frame& f);
  Status StartJob();
  // A standby server's registration (ServerOptions::standby, or any server once the job has
  // started): checked, then admitted (AdmitStandby) now or when the job starts.
  Status RegisterStandby(Connection& c, wire::RegisterMsg reg);
  // Gives standby `c` its id, budget and welcome, and tells every worker (kServerJoined).
  void AdmitStandby(Connection& c);
  // Servers that hold partitions or may be given new ones: not lost, not standing by.
  uint32_t ActiveServers() const;
  // A server that joined the running job without asking to stand by takes its share now:
  // partitions of flat sums move to it from the servers that carry the most per weight, as a
  // failover moves a lost server's (the workers report where they stand, and the old owner's
  // late replies are refused). Returns the partitions moved; nullopt when nothing may move now
  // (a rank has joined, a key is still moving): then it stands by.
  std::optional<uint64_t> Rebalance(uint32_t id);
  // Servers admitted into the running job so far (the workers keep results once one has).
  uint32_t servers_admitted_ = 0;
  Status OnDeclare(Connection& c, const transport::Frame& f);
  // Every worker declared the key: compare the declarations, plan, tell the servers.
  Status Plan(uint64_t key, Declaration& decl);
  Status OnAssignAck(Connection& c, const transport::Frame& f);
  // kRetire from a worker: it is done with the key (its name was declared again, the key's
  // declaration retired: Worker::Declare). Once every worker that declared it is, its servers
  // get kRetire and free it, its bytes leave their budgets and the placer, and the declaration
  // is forgotten (a later kAssignAck of it is dropped: retired_keys_).
  Status OnRetire(Connection& c, const transport::Frame& f);
  std::set<uint64_t> retired_keys_;
  // The bytes each server holds of `plan` of `decl` (reduce::ServerBytesHeld, per server id).
  std::vector<uint64_t> HeldBy(const Declaration& decl,
                               const std::vector<wire::PartitionPlan>& plan) const;
  Status OnBarrier(Connection& c, const transport::Frame& f);
  // kPeerLookup: the reply lane of worker `count`, for a point-to-point sender or receiver.
  Status OnPeerLookup(Connection& c, const transport::Frame& f);
  // Join (Worker::Join): a rank that ran out of data is absent from every later round, and
  // counts as declared and arrived, until every rank has joined; then the servers forget it
  // (each acks), and every worker learns where the keys' rounds stand (kJoinRelease).
  Status OnJoin(Connection& c, const transport::Frame& f);
  Status OnJoinReleaseAck(Connection& c);
  // Every member of `spec`'s group that has not joined has declared the key.
  bool ReadyToPlan(const Declaration& decl, const CollectiveSpec& spec) const;
  // A collective other than a sum whose group holds a rank that has joined: it cannot run
  // until the join is over, so its declaration is refused at once (Plan says why).
  bool CannotRunWhileJoined(const CollectiveSpec& spec) const;
  // Releases every barrier that every worker has entered or joined past.
  void ReleaseBarriers();
  Status OnGoodbye(Connection& c);
  void Refuse(Connection& c, const Status& why);
  void SendToWorkers(const wire::Header& h, const Payload& payload);
  // The key's plan (or refusal) to every worker that declared it: all of the job's, or the
  // group's (a key of a group is not declared by the others).
  void SendToDeclarers(const Declaration& decl);
  void Send(Connection& c, const wire::Header& h, std::span<const std::byte> payload = {});
  // A registered member's connection failed: the job fails, naming it (unless it had left);
  // a server's partitions move to the others instead where they can (ServerFailover).
  void ConnectionLost(Connection& c, const Status& why);
  // Likewise, `what` saying what happened (naming the member).
  void MemberLost(Connection& c, const std::string& what);
  // Server `c` is lost mid-job: its partitions move to the servers left (by weight, as
  // placement does), those servers adopt them (kAssign with kFlagReplan, acked), then every
  // worker gets kServerLost and each moved key's new plan. An error says why it cannot be (the
  // last server, a key that is not a flat sum, a rank that joined, no room on the others).
  Status ServerFailover(Connection& c, const std::string& what);
  // Every server the key's plan went to and not lost since has acked it.
  bool AckedByAll(const Declaration& decl) const;
  // Sends the key's plan (a first one, or a failover's) to its workers once every server
  // left has acked it.
  void DeliverWhenAcked(Declaration& decl);
  // Ends the job with `result`; on failure every member still connected gets kAbort, workers
  // first (SendServerAbortWhenDue).
  void Finish(Status result);
  // Servers get their kAbort once the workers' is written (or after kFlushBeforeClose): a server
  // that exits on kAbort closes its endpoints, and a worker that saw that before its own kAbort
  // would blame the server.
  void SendServerAbortWhenDue(Clock::time_point now);
  std::string MemberName(const Connection& c) const;
  wire::Header MakeHeader(wire::MsgType t) const;
  bool finished() const { return finished_; }  // loop thread only

  const SchedulerOptions opts_;
  const uint32_t job_hash_;
  const std::unique_ptr<transport::Listener> listener_;
  const int wake_fd_;
  std::atomic<uint64_t> protocol_errors_{0};
  std::atomic<uint64_t> auth_failures_{0};
  std::atomic<bool> stop_requested_{false};
  ControlCounters control_counters_;  // every connection's frames (MemberConnection::CountInto)
  mutable Mutex view_mu_;
  MetricsView view_ GUARDED_BY(view_mu_);

  // What Wait() and Stop() read; written by the loop thread (Finish: ended_, result_) and Stop().
  Mutex mu_;
  CondVar cv_;
  bool ended_ GUARDED_BY(mu_) = false;  // finished_, as Wait() sees it
  Status result_ GUARDED_BY(mu_);
  bool stop_called_ GUARDED_BY(mu_) = false;
  bool finished_ = false;  // loop thread only: Finish() ran

  // Loop thread only.
  std::vector<std::shared_ptr<Connection>> conns_;
  // The connections of conns_ that had not registered when last seen (AcceptAll prunes it).
  std::vector<std::weak_ptr<Connection>> unregistered_;
  std::map<uint32_t, std::shared_ptr<Connection>> workers_, servers_;
  std::set<uint32_t> lost_servers_;  // failover: servers whose partitions moved
  // Standby servers admitted (by id; the lowest takes over first), and those registered before
  // the job started that wait for it (they are admitted when it starts).
  std::set<uint32_t> standby_;
  uint32_t waiting_standbys_ = 0;
  // The servers' address book (everything after your_id): a standby admitted later gets it.
  Payload server_book_;
  uint32_t registered_workers_ = 0, registered_servers_ = 0, workers_left_ = 0;
  bool started_ = false;
  Clock::time_point started_at_, last_heartbeat_, accept_paused_until_;
  uint64_t evicted_ = 0;  // unregistered connections closed to make room (AcceptAll)
  // Members refused before the job started (Refuse, AuthFailure): the first kMaxRefusalsNamed
  // as "peer: why", and how many in all. A job that fails before it starts names them, so the
  // members that were refused are blamed, not an honest member that gave up waiting.
  std::vector<std::string> refusals_;
  uint64_t refused_ = 0;
  void NoteRefusal(const Connection& c, const std::string& why);
  std::string RefusalsText() const;
  std::map<uint64_t, Declaration> decls_;
  std::map<uint64_t, std::set<uint32_t>> barriers_;
  uint64_t barriers_released_ = 0;  // the last barrier round released
  // Join: the ranks that joined (in the order they did), the most of each key's next round and
  // of the barriers entered that they reported, and the servers that have forgotten the join
  // (while `releasing_`).
  std::vector<uint32_t> joined_;
  std::map<uint64_t, uint64_t> join_rounds_;
  uint64_t join_barriers_ = 0;
  std::set<uint32_t> release_acks_;
  bool releasing_ = false;
  bool Joined(uint32_t rank) const {
    return std::find(joined_.begin(), joined_.end(), rank) != joined_.end();
  }
  Placer placer_;
  tuning::Choice tuning_;  // from the address book, once the job starts
  topology::Hosts hosts_;  // likewise: who shares a host (hierarchical keys)
  // Per server id: its memory budget (ServerOptions::memory_budget_bytes, or the default share
  // of its host's memory) and the bytes its planned partitions hold (reduce::ServerBytesHeld).
  std::vector<uint64_t> budget_, held_;
  // The key's partitions, each segment cut on its own and placed (control/layout.h).
  std::vector<wire::PartitionPlan> PlanSegments(const Declaration& decl, DataType wire_type);
  // kResourceExhausted naming the tensor, its bytes and the first server whose budget `plan`
  // would exceed; OK when every server can hold its share (then held_ counts it).
  Status Admit(const std::string& keyhex, const Declaration& decl,
               const std::vector<wire::PartitionPlan>& plan);
  // decl.assign_payload: decl.plan as a kAssign payload, encoded once for everyone it goes to.
  static void EncodePlan(Declaration& decl);
  // Encodes decl.plan (EncodePlan; with decl.assign_header) and sends it to every active server.
  void SendPlanToServers(Declaration& decl);
  // kWelcome to `c`: its id, then `book` (shared by every member's queue).
  void SendWelcome(Connection& c, const Payload& book, Clock::time_point now);
  // A server's memory budget: its own, else three quarters of what its host had available split
  // between the job's `on_host` servers there, else unlimited (memory unknown).
  static uint64_t BudgetOf(const wire::RegisterMsg& reg, uint32_t on_host);
  // decl.status is the key's failure: every worker gets it in place of the plan.
  void RefuseKey(uint64_t key, Declaration& decl);
  // A failed job's kAbort for the servers, held until the workers' is out (or this deadline).
  std::optional<Clock::time_point> server_abort_due_;
  wire::Header abort_header_;
  Payload abort_text_;

  // Started last, once every field above is set.
  std::thread loop_;

  // The metrics server's port, for /targets (0 until it serves), and the server (ServeMetrics),
  // stopped first as the object goes.
  std::atomic<uint16_t> metrics_port_{0};
  std::unique_ptr<metrics::HttpServer> metrics_;
};

}  // namespace gradlink::scheduler
