// WorkerImpl: the Worker of include/gradlink/worker.h. One class, its member functions split by
// concern over these files:
//   worker.cc         joining (Init), Declare, PushPull, Barrier, Stats, Shutdown
//   fusion.cc         PushPullGroup: group layouts, fused tensors, packing
//   push_queue.cc     an op's life: start, the pending heap, bytes in flight, lead, issue, finish
//   pull_receiver.cc  the lanes' receive callbacks: pull replies and refusals written into ops
//   control_loop.cc   the scheduler's frames (MembershipHandler, on the membership's control
//                     thread): kAssign, barriers, failover, rejoining, the job's failure
//   local_binding.cc  the same-host path (local_reduce.h) bound to tensors and ops
//   handles.cc        TensorHandle / PushPullHandle: waiting, polling, timings
//   metrics.cc        /metrics (WorkerOptions::metrics_port), from Stats() and the counters
//
// Threads: the caller's (any number: Declare, PushPull*, Barrier, handles), the push lane's and
// the pull lane's progress threads (PushDone; OnHeader/OnPayload), the control thread
// (the membership's: OnControl and OnTick), and, with the same-host path, whichever thread
// drives it (LocalDone).
//
// State, owned per concern (docs/threading.md has every lock and the order):
//   directory_   ServerDirectory (server_directory.h): the servers by id, their endpoints, names
//                and which are lost; read without a lock (atomics), names under its own lock,
//                written in Init() and on the control thread.
//   verdict_     JobVerdict (job_verdict.h): the sticky failure (failed(): one atomic load) and
//                a data peer's failure waiting for the scheduler's verdict; its own leaf lock.
//   rendezvous_  Rendezvous (rendezvous.h): barriers, join(), the rejoin of a restarted
//                scheduler; its own lock and condition variable, on which Barrier(), Join()
//                and Shutdown() wait (never on mu_).
//   peer_        PeerLink (peer_link.h): point-to-point between workers (Send / Recv), its own
//                lock, taken under none of the worker's.
//   plans_       group layouts (fusion.cc) under plans_mu_.
//   mu_          the data path's state, one owner: the keys (tensors_, resume_rounds_), the op
//                table (ops_, free_op_nodes_, next_op_id_, parked_ops_, orphans_), the push
//                issuer (pending_, next_seq_, bytes_in_flight_, to_issue_, push_sent_*,
//                pumped_) and the pull receiver (error_text_), with the fields of TensorState
//                and Op (state.h). One lock, not one per concern: a partition's push and its
//                reply each touch the op, its tensor and the issuer in one critical section
//                (tests/unit/worker/lock_count_test.cc: 1.00 acquisitions per partition on each
//                lane thread, 2.02 per partition per worker in all); a lock per concern there
//                would make that 2 to 3 per thread.
//   counters_    Counters (state.h): stats, atomics, no lock.
// Lock order: plans_mu_, then the describer's, then mu_, then rendezvous_.mu, verdict_'s or
// directory_'s (leaves: nothing is taken under them). Work that waits on another process (the
// same-host segment's claims, a socket) or on the scheduler runs under none of them.
//
// Checked by clang's thread-safety analysis (tests/thread_safety/check.py): the fields below
// are GUARDED_BY their lock, every `*Locked` function REQUIRES(mu_), and the functions that take
// mu_ themselves (or wait on a socket or another process) EXCLUDES(mu_). The fields of
// TensorState and Op that mu_ guards (state.h) cannot name it, and are not checked.
#pragma once

#include <atomic>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <queue>
#include <string>
#include <thread>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "control/control_channel.h"
#include "control/member_lanes.h"
#include "control/membership.h"
#include "common/mutex.h"
#include "common/thread_annotations.h"
#include "control/topology.h"
#include "control/tuning.h"
#include "gradlink/worker.h"
#include "metrics/exposition.h"
#include "metrics/http_server.h"
#include "transport/transport.h"
#include "wire/messages.h"
#include "worker/fusion_pool.h"
#include "worker/local_reduce.h"
#include "worker/job_verdict.h"
#include "worker/peer_link.h"
#include "worker/rendezvous.h"
#include "worker/server_directory.h"
#include "worker/state.h"
#include "worker/state_mutex.h"

namespace gradlink {

using internal::Group;
using internal::LocalReduce;
using internal::Op;
using internal::TensorState;

// Internal entry for tests: a Worker on a given fabric (the inproc fabric: threads as ranks in one
// process) instead of UCX. Worker::Connect(options) is ConnectWorkerOn(options, nullptr).
Result<std::unique_ptr<Worker>> ConnectWorkerOn(const WorkerOptions& options,
                                                std::shared_ptr<transport::Fabric> fabric);

// How long a peer's loss seen on the data path (a failed endpoint, a same-host worker that
// left) waits for the job's verdict before it is reported itself (kAbort arrives within a few
// ms of the scheduler learning of a loss; the control thread polls every 100 ms).
inline constexpr auto kVerdictGrace = std::chrono::milliseconds(500);
// With more than one server, a server's loss is survivable (failover): a server seen failing
// waits this long for the scheduler's word (kServerLost, or kAbort), which comes once the
// scheduler's own liveness limit has passed for a server that stopped answering.
inline constexpr auto kFailoverGrace = transport::kSilenceLimit + std::chrono::seconds(2);

// The name a label's key hashes: the label for its first declaration (version 0), then the
// label with " (declaration N)" (N = version + 1), cut to fit wire::kMaxNameLength.
std::string VersionedName(std::string_view label, uint32_t version);

// WorkerOptions::max_bytes_ahead times the servers an op spans, saturating (push_queue.cc).
uint64_t LeadLimit(uint64_t per_server, uint32_t servers);

class WorkerImpl final : public Worker, private MembershipHandler {
 public:
  WorkerImpl(const WorkerOptions& o, std::shared_ptr<transport::Fabric> fabric)
      : opts_(o), job_hash_(wire::JobHash(o.job)), fabric_(std::move(fabric)) {}
  ~WorkerImpl() override {
    Shutdown(Clock::now() + std::chrono::seconds(5)).IgnoreError();
    describer_->Detach();
  }

  Status Init() EXCLUDES(mu_);

  uint32_t rank() const override { return rank_; }
  uint32_t size() const override { return size_; }
  uint32_t num_servers() const override { return num_servers_; }

  Result<TensorHandle> Declare(std::string_view name, DataType dtype, uint64_t count) override;
  Result<TensorHandle> Declare(std::string_view name, DataType dtype,
                               std::span<const uint64_t> shape) override;

  Result<TensorHandle> DeclareCollective(std::string_view name, DataType dtype, uint64_t count,
                                         const CollectiveSpec& spec) override;

  PushPullHandle Run(const TensorHandle& tensor, std::span<const std::byte> input,
                     std::span<std::byte> output, const PushPullOptions& options) override;

  PushPullHandle PushPull(const TensorHandle& tensor, std::span<std::byte> data,
                          const PushPullOptions& options) override;

  PushPullHandle PushPullGroup(std::span<const TensorHandle> tensors,
                               std::span<const std::span<std::byte>> data,
                               const PushPullOptions& options) override;

  WorkerStats Stats() const override;
  // /metrics (metrics.cc), on the metrics server's thread.
  metrics::Families CollectMetrics() EXCLUDES(mu_);

  Status Barrier(Clock::time_point deadline) override;
  Result<uint32_t> Join(Clock::time_point deadline) override;

  Status Shutdown(Clock::time_point deadline) override;

  PeerHandle Send(uint32_t to, const PeerMessage& message, std::span<const std::byte> data,
                  Clock::time_point deadline, PeerCallback done) override {
    return peer_.Send(to, message, data, deadline, std::move(done));
  }
  PeerHandle Recv(std::optional<uint32_t> from, const PeerMessage& message,
                  std::span<std::byte> data, Clock::time_point deadline,
                  PeerCallback done) override {
    return peer_.Recv(from, message, data, deadline, std::move(done));
  }

  // Test hook: the state lock, to count its acquisitions (state_mutex.h).
  internal::StateMutex& state_mutex_for_testing() { return mu_; }

 private:
  // A push in the lane's hands: what its completion (PushDone) needs. Kept in a free list
  // under mu_ (taken where the push is pumped, given back in PushDone, both under mu_ anyway),
  // so that the send's callback captures two words, which std::function keeps inline: a push
  // allocates nothing.
  struct PushSent {
    std::shared_ptr<Op> op;
    uint32_t part = 0;
    uint32_t server = 0;  // the server it went to
  };
  struct Outgoing {
    transport::PeerId peer;
    wire::Header header;
    std::span<const std::byte> payload;
    PushSent* sent = nullptr;  // null for a kRecover, whose payload `owned` holds
    std::shared_ptr<const std::vector<std::byte>> owned;
  };
  PushSent* NewPushSentLocked(std::shared_ptr<Op> op, uint32_t part, uint32_t server) REQUIRES(mu_);

  // How one group layout (its members, in order) is cut into operations: fused tensors, each
  // the members of one dtype that fill a fusion buffer, and members that go on their own.
  // Built once per layout, then cached.
  struct GroupPlan {
    struct Chunk {
      std::vector<uint32_t> members;  // indices into the group
      TensorHandle fused;             // invalid: one member, pushed on its own
      std::vector<uint64_t> offsets;  // fused: byte offset of each member in the buffer
      uint64_t bytes = 0;
      std::string what;  // fused: "fused tensor '<name>' (key K) of N members ('a', ...)"
    };
    std::vector<Chunk> chunks;
  };
  struct LayoutHash {
    size_t operator()(const std::vector<const TensorState*>& v) const {
      uint64_t h = v.size();
      for (const TensorState* t : v) {
        h = (h ^ reinterpret_cast<uintptr_t>(t)) * 0x9E3779B97F4A7C15ull;
        h ^= h >> 29;
      }
      return static_cast<size_t>(h);
    }
  };
  // Layouts cached at most; a program that groups ever new tensors starts over when full.
  static constexpr size_t kMaxCachedPlans = 1024;
  // Names of members shown in a fused tensor's errors.
  static constexpr size_t kMembersNamed = 8;

  static std::string Shorten(const std::string& s);

  Result<std::shared_ptr<const GroupPlan>> PlanFor(std::vector<const TensorState*> members,
                                                   std::span<const TensorHandle> tensors);

  Result<std::shared_ptr<const GroupPlan>> BuildPlan(std::span<const TensorHandle> tensors);

  // Declares the fused tensor of `c`. Its name is derived from the layout (dtype, and each
  // member's name and count, in order), so workers that group alike meet on one key, and
  // workers that group differently never share one (no sum of unrelated elements).
  Status DeclareFused(GroupPlan::Chunk& c, std::span<const TensorHandle> tensors) EXCLUDES(mu_);
  // Both Declare()s: `shape` empty when the caller gave none.
  Result<TensorHandle> DeclareShaped(std::string_view name, DataType dtype, uint64_t count,
                                     std::span<const uint64_t> shape,
                                     const CollectiveSpec& spec = {}) EXCLUDES(mu_);

  // The label's earlier declaration `t` is over (Declare gave the label a new key): its
  // handles stop being current, a kAssign still on its way for it is dropped, and it is kept
  // (fusion points at it). Returns its key when the scheduler must hear of it (SendRetire).
  std::optional<uint64_t> RetireLocked(std::shared_ptr<TensorState> t) REQUIRES(mu_);
  // kRetire of `key` to the scheduler, which has the servers free it once every worker has.
  void SendRetire(uint64_t key) EXCLUDES(mu_);

  // Member `t` of fused tensor `f` failed its plan (e.g. another worker declared it with
  // another shape): f's key will never be planned, so its ops fail now with t's error.
  void MemberFailedLocked(TensorState& f, const TensorState& t) REQUIRES(mu_);

  // A new op on `tensor` (from op_memory_), with what every op carries: its call time, timeout,
  // describer and this worker's segment.
  std::shared_ptr<Op> NewOp(std::shared_ptr<TensorState> tensor);
  // Starts a PushPull of `data` into `tensor`; `owned` is a fusion buffer that `data` lies in.
  // `input`: what a collective other than the sum pushes (a sum pushes `data`).
  std::shared_ptr<Op> StartOp(const TensorHandle& tensor, std::span<std::byte> data,
                              const PushPullOptions& options, std::shared_ptr<std::byte> owned,
                              std::span<const std::byte> input = {}) EXCLUDES(mu_);

  struct Pending {
    int32_t priority;
    uint64_t seq;
    std::shared_ptr<Op> op;
    uint32_t part;
    bool counted = false;  // already in op->bytes_ahead (let back in by ReleaseHeldLocked)
    bool operator<(const Pending& o) const {  // max-heap: higher priority, then older first
      return priority != o.priority ? priority < o.priority : seq > o.seq;
    }
  };

  // Starts t's next queued op if t is planned and idle.
  void StartNextLocked(TensorState& t) REQUIRES(mu_);

  // Moves queued partitions to to_issue_ (for Issue) while the bytes in flight allow.
  void PumpLocked() REQUIRES(mu_);

  // Hands what PumpLocked queued to the push lane, in the order it was pumped. Outside the lock:
  // a lane may complete a send inline. Three threads pump (the caller, and the two lanes' as
  // credit comes back), so one issues at a time and takes over what the others queue meanwhile:
  // otherwise a batch pumped later could reach the lane first, while the thread holding an
  // earlier one waits for a core, and every server would wait for this worker's first
  // partitions (seen on bench/netcluster: one worker's partitions 9 and 13 reached a server
  // 9 ms before its partitions 1 and 5).
  // Pushes one issuer hands to the lane, and the issue requests they answer (push_queue.cc).
  struct IssueBatch {
    std::vector<Outgoing>* items = nullptr;  // issuing_, while this thread is the issuer
    uint32_t requests = 0;                   // 0: this thread is not the issuer
  };
  void Issue(IssueBatch batch) EXCLUDES(mu_);
  // Under mu_, after PumpLocked: counts this section's pushes as one issue request; when no
  // thread is issuing, makes this one the issuer and moves the pushes into `batch` (for Issue,
  // once the lock is released).
  bool TakeIssueLocked(IssueBatch* batch) REQUIRES(mu_);

  // A push has left (or failed). Credit comes back here, not at the pull: a worker waiting for
  // its pulls must never hold the credit that the other workers' rounds need. Which partitions
  // a worker pushes first depends on its own timing, so credit held until the pull can make two
  // workers each wait on partitions only the other can still send.
  void PushDone(PushSent* sent, const Status& s) EXCLUDES(mu_);
  // The kPush of `part` of `op` (its bytes: PartBytes).
  wire::Header PushHeader(const Op& op, uint32_t part, uint64_t bytes) const;

  void AnsweredLocked(const std::shared_ptr<Op>& op, uint32_t part) REQUIRES(mu_);

  // A partition of `bytes` would take the op past its lead. Never true of the first one: a
  // partition bigger than the limit is sent on its own.
  static bool OverLead(const Op& op, uint64_t bytes);

  void AddAheadLocked(Op& op, uint64_t bytes) REQUIRES(mu_);

  // The bytes this worker pushes of `part` (0 where it only asks for the result).
  uint64_t PartBytes(const Op& op, uint32_t part) const;
  // This worker's role in `part` of t (a sum's: push and pull in place).
  static layout::Role RoleIn(const TensorState& t, uint32_t part);
  // Run() of a key that is not a plain sum: checks, local copies, then the op as any other.
  std::shared_ptr<Op> StartCollective(const TensorHandle& tensor, std::span<const std::byte> input,
                                      std::span<std::byte> output, const PushPullOptions& options);

  // Lets the op's held partitions back into the queue, in order, as far as its lead allows;
  // their bytes count from now on, so the next answer does not let the same bytes in twice.
  void ReleaseHeldLocked(const std::shared_ptr<Op>& op) REQUIRES(mu_);

  // A push's send has completed (`left`: whole; else failed, or its server is lost and it
  // goes again): its bytes leave the window, and, where it left whole and is ahead only until
  // sent (AheadUntilSent), the op's lead (kLeft). A failed one keeps its lead until answered,
  // so that pushes failing fast at a lost server do not all pump at once.
  void ReleaseCreditLocked(const std::shared_ptr<Op>& op, uint32_t part, bool left) REQUIRES(mu_);

  // Whether `part` of t counts in its op's lead only until its push has left, not until its
  // reply: a push that gets no data back (an allgather's sender, an all-to-all block's) on a
  // key that brings this worker at least as many bytes as it pushes (acks_behind_data). Its
  // reply is an acknowledgement of 0 elements, which waits behind everything the servers send
  // this worker (one connection per server, one downlink): paced by it, the worker whose
  // downlink was idle pushed alone while the others' acknowledgements queued behind its data,
  // and an allgather's senders took turns with one of the n downlinks idle (0.75 of the bound).
  // Where a worker sends more than it receives (a broadcast root, a reduce-scatter), its
  // acknowledgements come back over a lightly loaded downlink, and pacing by them keeps its
  // queues short: the lead stands (measured: 0.90 of the bound without it against 0.94 with,
  // reduce-scatter at 64 MiB). What the servers hold of such pushes stays within what the
  // scheduler admitted for the key.
  static bool AheadUntilSent(const TensorState& t, uint32_t part);

  void RecordFailureLocked(Op& op, const Status& s) REQUIRES(mu_);

  void AbandonLocked(Op& op, const Status& s) REQUIRES(mu_);

  // Finishes `op` once nothing will touch its buffer any more: every partition answered (or the
  // op abandoned), no push still being read by the transport, no pull being written.
  void TryFinishLocked(Op& op) REQUIRES(mu_);

  // The op is over: release its tensor for the next op and wake its waiters.
  void FinishLocked(Op& op, const Status& s) REQUIRES(mu_);

  static void Complete(Op& op, const Status& s);

  // A data endpoint to a server failed. That server may be the lost peer, or a healthy one that
  // exited because the job failed for another reason (its kAbort may still be on the way to
  // us). The control thread waits kVerdictGrace for the scheduler's verdict before failing the
  // job with this status.
  // `peer` is a push-lane endpoint (Lane::Connect); it is named (ServerDirectory::NameOfPeer)
  // only on the control thread, which starts after every endpoint's server is recorded. The
  // failure waits in verdict_ (JobVerdict::Note).
  void OnDataPeerFailed(transport::PeerId peer, const Status& s) EXCLUDES(mu_);

  // ---- Failover (docs/operations.md, "Server failover") --------------------------------------

  // A push to, or a reply from, `server` failed. With failover the op is not given up: the
  // partition stays pushed, to be pushed again where the scheduler moves it, and the failure
  // waits kFailoverGrace for the scheduler's word. A server already declared lost: nothing.
  // False when the op must fail (no failover, or the job failed).
  bool NoteServerFailureLocked(uint32_t server, const Status& s) REQUIRES(mu_);
  // kServerLost: its replies are refused from now on; its keys' replans follow.
  void OnServerLost(uint32_t server) EXCLUDES(mu_);
  // A standby server joined (kServerJoined): connects to it; its id may name partitions from
  // now on.
  Status OnServerJoined(const transport::Frame& f) EXCLUDES(mu_);
  // kAssign with kFlagReplan: t's partitions that lay on a lost server moved to `parts`. For
  // each (of a hierarchical key: each this worker pushes for its host): this worker's standing
  // (kRecover) to its new server, then the push again of the partition of t's op in flight
  // (or of the host's partial), if it was pushed and not answered.
  Status ReplanLocked(TensorState& t, std::vector<wire::PartitionPlan> parts) REQUIRES(mu_);
  // Whether pull replies of t's partitions land in t.results first, and in the tensor (or, for
  // a hierarchical op, the host's entry) only once whole: failover needs the input intact
  // until then, and the result kept for the server that takes over.
  bool KeepsResults(const TensorState& t) const REQUIRES(mu_);

  // On the control thread: the endpoint failure whose grace has run out, if any. Takes
  // verdict_'s and directory_'s locks only, not mu_.
  std::optional<Status> ExpiredPeerFailure() EXCLUDES(mu_);

  // The job is over: fail everything now. A hung peer may never complete a transfer, so the
  // lanes are stopped (after which nothing touches a caller's buffer) and every op finishes.
  // Runs on the control thread, never on a lane's.
  void FailJob(const Status& s) EXCLUDES(mu_);

  // Sticky failure of this worker. With `force` (the lanes are stopped: no callback will come)
  // every op finishes now; otherwise each finishes when the transport lets go of its buffer.
  void FailAll(const Status& s, bool force = false) EXCLUDES(mu_);
  // FailAll's part for the ops.
  void FailOps(const Status& s, bool force) EXCLUDES(mu_);

  // ---- Point-to-point (peer_link.h) ----------------------------------------------------------

  // Sends `h` to the scheduler on the current channel; kUnavailable while rejoining one
  // restarted (a frame of the old channel would be dropped: the caller tells it again).
  Status SendUnlessRejoining(const wire::Header& h) EXCLUDES(mu_);
  // kPeerLookup of worker `rank`'s reply lane to the scheduler.
  Status LookUpPeer(uint32_t rank);
  // "worker 2 (host)".
  std::string PeerName(uint32_t rank) const;
  // Whether worker `rank` has this worker's host identity (machine and network namespace).
  bool SameHostAs(uint32_t rank) const;
  std::vector<std::string> worker_hosts_;  // by rank, from the welcome; then read-only
  std::atomic<bool> worker_hosts_known_{false};  // set once worker_hosts_ is filled

  // ---- Pull lane -----------------------------------------------------------------------------

  // A reply's frame: where its payload lands (OnHeader), what it completes (OnPayload); both
  // at once, under one acquisition of mu_, for a payload the lane already holds whole (OnFrame:
  // eager, copied from the lane's buffer). *Locked: mu_ held.
  Status CheckPullFrame(const wire::Header& h);
  Result<std::span<std::byte>> OnHeader(const wire::Header& h) EXCLUDES(mu_);
  void OnPayload(const wire::Header& h, bool ok, const Status& why) EXCLUDES(mu_);
  Result<uint64_t> OnFrame(const wire::Header& h, std::span<const std::byte> payload) EXCLUDES(mu_);
  Result<std::span<std::byte>> OnHeaderLocked(const wire::Header& h) REQUIRES(mu_);
  void OnPayloadLocked(const wire::Header& h, bool ok, const Status& why, IssueBatch* batch)
      REQUIRES(mu_);

  class Receiver final : public transport::Receiver {
   public:
    explicit Receiver(WorkerImpl* w) : w_(w) {}
    // Point-to-point frames (another worker's) go to the PeerLink, replies to the worker.
    Result<std::span<std::byte>> OnHeader(const wire::Header& h) override {
      return wire::IsPeerType(h.type) ? w_->peer_.OnHeader(h) : w_->OnHeader(h);
    }
    void OnPayload(const wire::Header& h, std::span<std::byte>) override {
      if (wire::IsPeerType(h.type)) return w_->peer_.OnPayload(h, true, Status::Ok());
      w_->OnPayload(h, true, Status::Ok());
    }
    void OnReceiveFailed(const wire::Header& h, const Status& s) override {
      if (wire::IsPeerType(h.type)) return w_->peer_.OnPayload(h, false, s);
      w_->OnPayload(h, false, s);
    }
    Result<uint64_t> OnFrame(const wire::Header& h,
                             std::span<const std::byte> payload) override {
      if (wire::IsPeerType(h.type)) return transport::Receiver::OnFrame(h, payload);
      return w_->OnFrame(h, payload);
    }
    void OnPeerFailed(transport::PeerId peer, const Status& s) override {
      // Another worker's endpoint (or one being connected, not a server's).
      if (w_->peer_.OnPeerFailed(peer, s, w_->directory_.IdOfPeer(peer) < 0)) return;
      w_->OnDataPeerFailed(peer, s);
    }
    // A reply into the worker's copy of a result (never freed while a receive may write it:
    // Shutdown leaks them if the lane gave one up) lands there directly, with no bounce copy.
    // So does a peer's message: its recv reports a buffer the lane gave up on
    // (PeerResult::buffer_held), and the PeerLink's own buffers are leaked then too.
    bool KeepsBuffer(const wire::Header& h) override {
      // (A kPeerAck's reason and a kPeerReady's announcement land in one buffer of the link's,
      // reused frame after frame: through the bounce buffer.)
      if (wire::IsPeerType(h.type)) return h.type == wire::MsgType::kPeerData;
      return w_->reply_kept_;
    }

   private:
    WorkerImpl* w_;
  };

  // ---- Control plane -------------------------------------------------------------------------

  // MembershipHandler (control/membership.h), on the control thread.
  ControlVerdict OnControl(const transport::Frame& f) override EXCLUDES(mu_);
  // A data peer's failure whose grace for the job's verdict has passed fails the job.
  Status OnTick() override EXCLUDES(mu_);
  // The scheduler is gone (`why`) without ending the job: the membership rejoins one restarted
  // on its address (scheduler/restart.cc) within opts_.scheduler_reconnect_timeout, told every
  // tensor and plan and the barriers; the data path runs on meanwhile. What is declared or
  // entered during the rejoin is sent once it is back (OnRejoined).
  Result<Rejoining> PrepareRejoin(const std::string& why) override EXCLUDES(mu_);
  Status CheckWelcome(const wire::WelcomeMsg& welcome) override;
  void OnRejoined(const Status& result, uint64_t generation) override EXCLUDES(mu_);
  void OnLost(const Status& why) override EXCLUDES(mu_) { FailJob(why); }
  // t's kDeclare (header and payload), as Declare sends it and a rejoin tells it again.
  std::pair<wire::Header, wire::DeclareMsg> DeclarationOf(const TensorState& t) const;

  Status OnAssign(const transport::Frame& f) EXCLUDES(mu_);
  // kJoinRelease: every rank has joined; each key's rounds resume where the others left them.
  Status OnJoinRelease(const transport::Frame& f) EXCLUDES(mu_);

  // ---- Same-host path (src/worker/local_reduce.h) --------------------------------------------

  // Opens the shared-memory segment when WorkerOptions::local_arena_bytes asks for it and every
  // worker of the job is on this host (the address book's host names agree).
  Status OpenLocalPath(const wire::WelcomeMsg& welcome, Clock::time_point deadline) EXCLUDES(mu_);
  // The segment's size its creator asks for: the option, fitted to /dev/shm at its default.
  uint64_t ArenaBytes(bool creator) const;

  // ---- Hierarchical aggregation (host_binding.cc) --------------------------------------------

  // Opens this host's segment when the job is hierarchical (topology::Hosts) and the options
  // allow it; every worker of the host waits for the others there.
  Status OpenHostPath(const wire::WelcomeMsg& welcome, Clock::time_point deadline) EXCLUDES(mu_);
  // At Declare, outside mu_: binds t to its host channel; the topology::Mode to declare.
  uint8_t BindHost(TensorState& t) EXCLUDES(mu_);
  // At the plan: how the key goes, and who pushes each partition for this host.
  Status PlanHostLocked(TensorState& t, topology::Mode mode) REQUIRES(mu_);
  void StartHostLocked(TensorState& t, const std::shared_ptr<Op>& op) REQUIRES(mu_);
  // On the driving thread: this worker's partition `part` of the host's sum is ready to push.
  void HostSummed(const std::shared_ptr<Op>& op, uint32_t part, std::span<std::byte> partial,
                  uint16_t flags, uint32_t ranks) EXCLUDES(mu_);
  // Join() on a host path: until every rank has joined, runs the rounds the host's other
  // workers begin on keys this worker pushes partitions of, with nothing of its own
  // (LocalReduce::Job::sits_out), so that its share of the host's partials still goes out.
  Status SitOutUntilReleased(Clock::time_point deadline) EXCLUDES(mu_);
  // Join(): waits for this worker's own operations to end, then tells the scheduler (kJoin).
  Status AnnounceJoin(Clock::time_point deadline) EXCLUDES(mu_);
  // Under mu_: starts those rounds that have begun; returns the keys still to watch.
  struct SatOutWatch {
    LocalReduce::HostChannel channel;
    uint64_t round;
    uint32_t parts;
  };
  void StartSatOutRoundsLocked(std::vector<SatOutWatch>* watch) REQUIRES(mu_);
  // The pulled sum of `part` (or its failure) is in the host channel: the host's workers copy it.
  void PublishLocked(Op& op, uint32_t part, Code code) REQUIRES(mu_);
  void HostDone(const std::shared_ptr<Op>& op, const Status& s, Clock::time_point first,
                Clock::time_point last, Clock::time_point arrived) EXCLUDES(mu_);

  // Binds t to its same-host channel, once, on its first op's caller; never under mu_ (a claim
  // may wait up to 5 s on another process). No-op without the same-host path.
  void BindLocal(TensorState& t) EXCLUDES(mu_);
  // False, finishing `op` with the error, if binding t failed.
  bool LocalBindingOkLocked(TensorState& t, Op& op) REQUIRES(mu_);

  void StartLocalLocked(TensorState& t, const std::shared_ptr<Op>& op) REQUIRES(mu_);
  // The fields of a segment job (same-host path or host channel) that come from t and op.
  static LocalReduce::Job SegmentJob(const TensorState& t, const Op& op);
  // A segment op that ended kAborted or kPeerLost (a peer of the segment left, or a sum was
  // lost) before the job failed mostly ended because the job is failing: it waits, parked, up
  // to kVerdictGrace for the job's failure, which names the cause. Not on the driving thread,
  // which holds the segment's drive (every same-host op would wait): the job's failure
  // (FailAll) ends it with that failure, else the control thread's tick (EndParkedOps) with its
  // own once the grace has passed.
  struct ParkedOp {
    std::shared_ptr<Op> op;
    Status own;                // its own failure, given when no verdict came
    Clock::time_point until;   // the end of its grace
  };
  // Parks `op` and returns true if `s` is such a failure and the job has not failed. mu_ held.
  bool ParkForVerdictLocked(const std::shared_ptr<Op>& op, const Status& s) REQUIRES(mu_);
  // Ends the parked ops: all with the job's failure once it has one, else those whose grace has
  // passed with their own. mu_ held.
  void EndParkedOpsLocked() REQUIRES(mu_);
  // EndParkedOpsLocked, taking mu_ only when an op is parked: the control thread, every tick.
  void EndParkedOps() EXCLUDES(mu_);
  // The segment's work on `op` is over with `s`: a same-host op finishes; a host op finishes
  // once its partitions are answered too. mu_ held.
  void EndSegmentJobLocked(Op& op, const Status& s) REQUIRES(mu_);

  // On the thread driving the same-host path (LocalReduce::Job::done); never waits.
  void LocalDone(const std::shared_ptr<Op>& op, const Status& s, Clock::time_point first,
                 Clock::time_point last, Clock::time_point arrived) EXCLUDES(mu_);

  const WorkerOptions opts_;
  const uint32_t job_hash_;
  uint32_t rank_ = 0, size_ = 0, num_servers_ = 0;
  std::shared_ptr<transport::Fabric> fabric_;  // the one given (tests), until Init() opens lanes
  // Point-to-point (peer_link.h): before the lanes, which call into it until they stop.
  PeerLink peer_{PeerLink::Config{
      job_hash_, [this](uint32_t rank) { return LookUpPeer(rank); },
      [this](uint32_t rank) { return PeerName(rank); },
      [this](uint32_t rank) { return SameHostAs(rank); }}};
  MemberLanes lanes_;
  std::shared_ptr<LocalReduce> local_;  // the same-host path or the host's segment; null when off
  std::vector<ParkedOp> parked_ops_ GUARDED_BY(mu_);  // ops, with the op table
  std::atomic<bool> has_parked_ops_{false};  // !parked_ops_.empty(), written under mu_
  topology::Hosts hosts_;               // written in Init(), then read-only
  bool host_path_ = false;              // local_ is the host's segment (hierarchical aggregation)
  WorkerStats::InForce in_force_;  // set at the end of Init(), then read-only
  Receiver receiver_{this};
  // The servers by id (server_directory.h): read without a lock on the data path; written in
  // Init() and on the control thread (a standby joins, a server is lost).
  internal::ServerDirectory directory_;
  // The job membership: the scheduler connection and the control thread. Its channel is
  // replaced (the generation counted up) when the worker rejoins a restarted scheduler. A
  // sender decides under rendezvous_.mu (not while `reconnecting`), noting the generation;
  // SendOn drops a frame of an older one: what it said reached the new scheduler in the
  // ResumeState. Left in Shutdown(), which the destructor calls first: its thread calls into
  // this object.
  std::unique_ptr<Membership> membership_;
  std::atomic<bool> shut_down_{false};
  std::atomic<uint64_t> protocol_errors_{0};

  // The op table, the push issuer, the keys (docs/threading.md): the data path's one lock.
  // Taken after plans_mu_ and the describer's lock; rendezvous_.mu, directory_'s and
  // verdict_'s locks are taken under it, never it under them.
  internal::StateMutex mu_ ACQUIRED_BEFORE(rendezvous_.mu, verdict_.mu_, directory_.mu_);
  // The job's sticky failure and a data peer's failure waiting for the verdict (job_verdict.h).
  internal::JobVerdict verdict_;
  // Barriers, join() and the scheduler's rejoin, with their own lock and condition variable
  // (rendezvous.h).
  internal::Rendezvous rendezvous_;
  // Result buffers that a lost server's unfinished replies may still write into (taken from
  // TensorState::results, under mu_ with them).
  std::vector<std::vector<std::byte>> orphans_ GUARDED_BY(mu_);
  // Pull lane's progress thread only: the span the last OnHeader() returned is a kept result.
  bool reply_kept_ = false;
  std::unordered_map<uint64_t, std::shared_ptr<TensorState>> tensors_ GUARDED_BY(mu_);
  // Each label's latest declaration (in tensors_ unless retired: declared again, or refused),
  // and the declarations retired.
  std::unordered_map<std::string, std::shared_ptr<TensorState>> labels_ GUARDED_BY(mu_);
  std::unordered_set<uint64_t> retired_keys_ GUARDED_BY(mu_);
  std::vector<std::shared_ptr<TensorState>> retired_tensors_ GUARDED_BY(mu_);
  std::unordered_map<uint64_t, std::shared_ptr<Op>> ops_ GUARDED_BY(mu_);  // by id; in flight
  // ops_'s nodes, kept when an op ends for the next one (a node per op otherwise).
  using OpsNode = decltype(ops_)::node_type;
  static constexpr size_t kMaxFreeOpNodes = 1024;
  std::vector<OpsNode> free_op_nodes_ GUARDED_BY(mu_);
  // Where ops are made (state.h OpMemory): shared with every op, which may outlive the worker.
  const std::shared_ptr<internal::OpMemory> op_memory_ = std::make_shared<internal::OpMemory>();
  void TrackOpLocked(const std::shared_ptr<Op>& op) REQUIRES(mu_);  // into ops_
  void UntrackOpLocked(uint64_t id) REQUIRES(mu_);  // out of ops_ (the op lives on elsewhere)
  std::map<std::pair<uint64_t, uint32_t>, std::vector<std::byte>> error_text_ GUARDED_BY(mu_);
  std::priority_queue<Pending> pending_ GUARDED_BY(mu_);
  uint64_t next_op_id_ GUARDED_BY(mu_) = 1;
  uint64_t next_seq_ GUARDED_BY(mu_) = 0;
  uint64_t bytes_in_flight_ GUARDED_BY(mu_) = 0;
  Clock::time_point busy_since_ GUARDED_BY(mu_){};  // when ops_ last became non-empty
  // Fixed at Init: the options' values, or what tuning_ chose where they are unset.
  tuning::Choice tuning_;
  uint64_t max_bytes_in_flight_ = 0, max_bytes_ahead_ = 0;
  // Pumped, not yet handed to the push lane (Issue).
  std::vector<Outgoing> to_issue_ GUARDED_BY(mu_);
  // The issuer's batch: swapped with to_issue_, so both keep their capacity (no allocation per
  // batch). Only the issuer touches it outside mu_ (issue_requests_ makes one at a time).
  std::vector<Outgoing> issuing_;
  // PushSent records: every one made (for the destructor), and those free for the next push.
  std::vector<std::unique_ptr<PushSent>> push_sent_all_ GUARDED_BY(mu_);
  std::vector<PushSent*> push_sent_free_ GUARDED_BY(mu_);
  bool pumped_ GUARDED_BY(mu_) = false;  // PumpLocked queued pushes this critical section
  // Requests to issue not yet answered; nonzero while a thread is in Issue() (push_queue.cc).
  std::atomic<uint32_t> issue_requests_{0};
  // Join() on a host path that timed out: goes on running the sat-out rounds until the release
  // (SitOutUntilReleased); joined in Shutdown().
  std::thread sit_out_;
  std::atomic<bool> sit_out_running_{false};
  // Rounds of keys not declared yet, from a join release (for Declare): with tensors_.
  std::unordered_map<uint64_t, uint64_t> resume_rounds_ GUARDED_BY(mu_);

  const std::shared_ptr<internal::Counters> counters_ = std::make_shared<internal::Counters>();
  // "; waiting for partition 3 on server 1 (pushed), ...": what a timed-out Wait() names.
  std::string DescribePending(const Op& op) EXCLUDES(mu_);
  const std::shared_ptr<internal::PendingDescriber> describer_ =
      std::make_shared<internal::PendingDescriber>(
      [this](const Op& op) { return DescribePending(op); });
  const std::shared_ptr<internal::FusionPool> pool_ =
      std::make_shared<internal::FusionPool>(opts_.fusion_buffer_bytes);
  Mutex plans_mu_ ACQUIRED_BEFORE(mu_);  // taken before mu_ (BuildPlan declares), never under it
  std::unordered_map<std::vector<const TensorState*>, std::shared_ptr<const GroupPlan>, LayoutHash>
      plans_ GUARDED_BY(plans_mu_);

  // /metrics: set once Init() has set what CollectMetrics reads; the server, declared last so
  // that it stops first as the worker goes.
  std::atomic<bool> metrics_ready_{false};
  std::unique_ptr<metrics::HttpServer> metrics_;
};

}  // namespace gradlink
