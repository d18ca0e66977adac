#include "gradlink/worker.h"

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <limits>
#include <map>
#include <mutex>
#include <optional>
#include <queue>
#include <thread>
#include <unordered_map>
#include <unordered_set>

#include "common/log.h"
#include "common/naming.h"
#include "transport/join.h"
#include "worker/local_reduce.h"

namespace gradlink {

namespace internal {

// Counters shared by a worker and its groups (a group may outlive its worker).
struct Counters {
  std::atomic<uint64_t> push_pulls{0}, bytes_reduced{0}, groups{0}, fused_ops{0},
      bytes_packed{0}, bytes_unpacked{0}, partitions_held{0}, peak_bytes_ahead{0};
};

// Fusion buffers, reused: a fresh multi-MiB buffer would cost its page faults on every use.
// Thread-safe; buffers come back when their last owner (a fused op) lets go.
class FusionPool {
 public:
  explicit FusionPool(size_t buffer_bytes) : buffer_bytes_(buffer_bytes) {}

  static std::shared_ptr<std::byte> Take(const std::shared_ptr<FusionPool>& pool) {
    std::byte* p = nullptr;
    {
      std::lock_guard<std::mutex> lock(pool->mu_);
      if (!pool->free_.empty()) {
        p = pool->free_.back().release();
        pool->free_.pop_back();
      }
    }
    // new[] aligns to at least 16 bytes: every member packed after it is aligned to its dtype.
    if (p == nullptr) p = new std::byte[pool->buffer_bytes_];
    return std::shared_ptr<std::byte>(p, [pool](std::byte* b) { pool->Give(b); });
  }

 private:
  // Idle buffers kept (each fusion_buffer_bytes, resident once used).
  static constexpr size_t kMaxFree = 8;

  void Give(std::byte* b) {
    std::unique_ptr<std::byte[]> owned(b);
    std::lock_guard<std::mutex> lock(mu_);
    if (free_.size() < kMaxFree) free_.push_back(std::move(owned));
  }

  const size_t buffer_bytes_;
  std::mutex mu_;
  std::vector<std::unique_ptr<std::byte[]>> free_;
};

struct TensorState {
  uint64_t key = 0;
  std::string name;
  DataType dtype{};
  uint64_t count = 0;
  // Guarded by WorkerImpl::mu_.
  bool planned = false;
  Status plan_status;                      // kMismatch when the workers disagree
  std::vector<wire::PartitionPlan> parts;  // once planned
  uint32_t servers_spanned = 0;            // distinct servers among `parts`
  // The same-host path (LocalReduce): bound on the first op after the plan; `local` empty when
  // the tensor goes through the servers.
  bool local_bound = false;
  std::optional<LocalReduce::Channel> local;
  uint64_t next_round = 0;
  bool busy = false;                       // an op of this tensor is in flight
  std::deque<std::shared_ptr<Op>> queue;   // ops waiting for the plan or for the busy one
  // Fusion. For a member: the fused tensors that contain it, whose ops fail when its plan does
  // (its shape differs on another worker). For a fused tensor: its members, for errors, and
  // the failure of a member's plan, which fails every op of it.
  std::vector<TensorState*> fused_in;
  std::string fused_members;
  Status member_failure;
};

struct Op {
  std::shared_ptr<TensorState> tensor;
  std::span<std::byte> data;
  PushPullOptions options;
  uint64_t id = 0;
  // The worker's same-host path, if it has one: waiting on the op drives it (LocalReduce::Wait),
  // whichever way the op goes (the op's tensor may not be planned yet).
  std::shared_ptr<LocalReduce> local;
  // Guarded by WorkerImpl::mu_.
  std::atomic<uint64_t> round{0};  // atomic: Wait() reads it (for its message) without mu_
  // kSent holds bytes-in-flight credit until the push has left; kPushed waits for its pull.
  enum class Part : uint8_t { kQueued, kSent, kPushed, kDone };
  std::vector<Part> parts;
  uint32_t outstanding = 0;  // partitions not yet answered (pulled, or refused by the server)
  // WorkerOptions::max_bytes_ahead: the op's limit (the option times the servers its partitions
  // lie on), the bytes sent (or let back into the queue to be sent) and not yet answered, and
  // the partitions held back meanwhile, in order (seq, partition).
  uint64_t max_ahead = 0;
  uint64_t bytes_ahead = 0;
  std::deque<std::pair<uint64_t, uint32_t>> held;
  uint32_t sending = 0;      // pushes the transport may still be reading from `data`
  uint32_t receiving = 0;    // pulls being written into `data` right now
  // The first error. The op still pushes and collects every partition, so each server's round
  // count stays in step with ours for the next op on this tensor.
  Status failure;
  // No more replies will come (this worker failed, or a push could not be sent): queued
  // partitions are dropped and the op ends once the transport no longer touches `data`.
  bool abandoned = false;
  bool started = false;   // holds its tensor's busy flag
  bool finished = false;
  // A fusion buffer that `data` points into (fused ops): it lives as long as the op.
  std::shared_ptr<std::byte> owned;
  // Where the time went (PushPullTiming); set under WorkerImpl::mu_, read once `done`.
  Clock::time_point t_call, t_first_issue, t_pushed, t_arrived, t_done;
  // Completion, guarded by `mu`.
  std::mutex mu;
  std::condition_variable cv;
  bool done = false;
  Status status;
};

// One PushPullGroup: its fused and unfused operations ("parts").
struct Group {
  struct Member {
    std::span<std::byte> data;  // the caller's tensor
    uint64_t offset;            // where it lies in the fusion buffer
  };
  struct Part {
    std::shared_ptr<Op> op;       // released once the part has ended (returns its buffer)
    std::span<std::byte> packed;  // fused: the bytes of the fusion buffer (owned by `op`)
    std::vector<Member> members;  // fused: where each member's result goes
    const std::string* what = nullptr;  // fused: names the fused tensor and its members
    // Guarded by `mu`: once the op is done, its status and times, the result unpacked.
    bool ended = false;
    Status status;
    Clock::time_point t_call, t_first_issue, t_pushed, t_arrived, t_done;
  };
  std::string what;  // "push_pull group of N tensors (...)"
  std::shared_ptr<Counters> counters;
  std::shared_ptr<const void> plan;  // keeps the `what` strings of the parts alive
  Clock::time_point t_call, t_started;
  std::vector<Part> parts;  // fixed once the group is handed out
  std::mutex mu;
  bool finished = false;
  Status status;
  Clock::time_point t_finished;
};

}  // namespace internal

using internal::Group;
using internal::LocalReduce;
using internal::Op;
using internal::TensorState;

namespace {

// WorkerOptions::max_bytes_ahead times the servers an op spans, saturating: a limit too big to
// multiply is no limit in practice, never a wrapped-around small one.
uint64_t LeadLimit(uint64_t per_server, uint32_t servers) {
  if (servers != 0 && per_server > std::numeric_limits<uint64_t>::max() / servers) {
    return std::numeric_limits<uint64_t>::max();
  }
  return per_server * servers;
}

uint32_t ServersSpanned(const std::vector<wire::PartitionPlan>& parts) {
  std::vector<uint32_t> servers;
  for (const wire::PartitionPlan& p : parts) servers.push_back(p.server);
  std::sort(servers.begin(), servers.end());
  return static_cast<uint32_t>(std::unique(servers.begin(), servers.end()) - servers.begin());
}

bool IsDone(Op& op) {
  std::lock_guard<std::mutex> lock(op.mu);
  return op.done;
}

bool WaitDone(Op& op, Clock::time_point deadline) {
  if (op.local) return op.local->Wait([&op] { return IsDone(op); }, deadline);
  std::unique_lock<std::mutex> lock(op.mu);
  return op.cv.wait_until(lock, deadline, [&op] { return op.done; });
}

// IsDone(), after driving the same-host path once on this thread.
bool PollDone(Op& op) {
  if (op.local) op.local->Poll();
  return IsDone(op);
}

// Records a done part and copies a fused part's result into its members. Group::mu held.
void EndPartLocked(Group& g, Group::Part& p) {
  Op& op = *p.op;
  {
    std::lock_guard<std::mutex> lock(op.mu);
    p.status = op.status;
  }
  p.t_call = op.t_call;
  p.t_first_issue = op.t_first_issue;
  p.t_pushed = op.t_pushed;
  p.t_arrived = op.t_arrived;
  p.t_done = op.t_done;
  if (!p.status.ok() && p.what != nullptr) {
    p.status = Status(p.status.code(), *p.what + ": " + p.status.message());
  }
  if (p.status.ok() && !p.members.empty()) {
    for (const Group::Member& m : p.members) {
      if (!m.data.empty()) std::memcpy(m.data.data(), p.packed.data() + m.offset, m.data.size());
    }
    g.counters->bytes_unpacked.fetch_add(p.packed.size(), std::memory_order_relaxed);
    g.counters->bytes_reduced.fetch_add(p.packed.size(), std::memory_order_relaxed);
    g.counters->push_pulls.fetch_add(p.members.size(), std::memory_order_relaxed);
  }
  p.ended = true;
  p.op.reset();
}

// Every part has ended: the group's result is the first failing part's. Group::mu held.
void FinishGroupLocked(Group& g) {
  if (g.finished) return;
  for (Group::Part& p : g.parts) {
    if (!p.status.ok()) {
      g.status = Status(p.status.code(), g.what + ": " + p.status.message());
      break;
    }
  }
  g.t_finished = Clock::now();
  g.finished = true;
}

Status WaitGroup(Group& g, Clock::time_point deadline) {
  // Part by part, in order: a fused part is unpacked while later ones are still on the wire.
  for (Group::Part& p : g.parts) {
    std::shared_ptr<Op> op;
    {
      std::lock_guard<std::mutex> lock(g.mu);
      if (g.finished) return g.status;
      if (p.ended) continue;
      op = p.op;
    }
    if (!WaitDone(*op, deadline)) {
      return Timeout(g.what + " not complete at the deadline" +
                     (p.what != nullptr ? " (" + *p.what + " still running; every worker must "
                                          "group the same tensors the same way, or fused "
                                          "tensors never meet)"
                                        : " ('" + op->tensor->name + "' still running)"));
    }
    std::lock_guard<std::mutex> lock(g.mu);
    if (!p.ended) EndPartLocked(g, p);
  }
  std::lock_guard<std::mutex> lock(g.mu);
  FinishGroupLocked(g);
  return g.status;
}

bool PollGroup(Group& g) {
  {
    std::lock_guard<std::mutex> lock(g.mu);
    if (g.finished) return true;
    for (Group::Part& p : g.parts) {
      if (!p.ended && !PollDone(*p.op)) return false;
    }
  }
  // Every part is done: this only unpacks.
  WaitGroup(g, Clock::time_point::max()).IgnoreError();
  return true;
}

// Stages on one timeline (see PushPullTiming): each boundary is the latest of its events,
// and never before the previous boundary.
PushPullTiming MakeTiming(Clock::time_point t0, Clock::time_point started,
                          Clock::time_point first_issue, Clock::time_point pushed,
                          Clock::time_point arrived, Clock::time_point done,
                          Clock::time_point finished) {
  PushPullTiming t;
  const Clock::time_point b1 = std::max(t0, started);
  const Clock::time_point b2 = std::max(b1, first_issue);
  const Clock::time_point b3 = std::max(b2, pushed);
  const Clock::time_point b4 = std::max(b3, arrived);
  const Clock::time_point b5 = std::max(b4, done);
  const Clock::time_point b6 = std::max(b5, finished);
  t.pack = b1 - t0;
  t.queue = b2 - b1;
  t.push = b3 - b2;
  t.reduce = b4 - b3;
  t.pull = b5 - b4;
  t.unpack = b6 - b5;
  t.total = b6 - t0;
  return t;
}

}  // namespace

uint64_t TensorHandle::key() const { return state_->key; }
const std::string& TensorHandle::name() const { return state_->name; }
DataType TensorHandle::dtype() const { return state_->dtype; }
uint64_t TensorHandle::count() const { return state_->count; }

Status PushPullHandle::Wait(Clock::time_point deadline) const {
  if (group_) return WaitGroup(*group_, deadline);
  if (!op_) return InvalidArgument("Wait() on an empty PushPullHandle");
  if (!WaitDone(*op_, deadline)) {
    return Timeout("push_pull of '" + op_->tensor->name + "' (round " +
                   std::to_string(op_->round) + ") not complete at the deadline");
  }
  std::lock_guard<std::mutex> lock(op_->mu);
  return op_->status;
}

bool PushPullHandle::Poll() const {
  if (group_) return PollGroup(*group_);
  if (!op_) return true;
  return PollDone(*op_);
}

PushPullTiming PushPullHandle::Timing() const {
  if (group_) {
    Group& g = *group_;
    std::lock_guard<std::mutex> lock(g.mu);
    if (!g.finished) return {};
    Clock::time_point first_issue{}, pushed{}, arrived{}, done{};
    for (const Group::Part& p : g.parts) {
      first_issue = std::max(first_issue, p.t_first_issue);
      pushed = std::max(pushed, p.t_pushed);
      arrived = std::max(arrived, p.t_arrived);
      done = std::max(done, p.t_done);
    }
    return MakeTiming(g.t_call, g.t_started, first_issue, pushed, arrived, done, g.t_finished);
  }
  if (!op_) return {};
  std::lock_guard<std::mutex> lock(op_->mu);
  if (!op_->done) return {};
  const Op& op = *op_;
  return MakeTiming(op.t_call, op.t_call, op.t_first_issue, op.t_pushed, op.t_arrived, op.t_done,
                    op.t_done);
}

namespace {

using transport::Lane;
using transport::PeerId;
using wire::MsgType;

constexpr auto kPoll = std::chrono::milliseconds(100);
// How long a failed data endpoint waits for the scheduler's verdict (kAbort arrives within a
// few ms of the scheduler learning of a loss; the control thread polls every kPoll).
constexpr auto kVerdictGrace = std::chrono::milliseconds(500);
constexpr uint64_t kMaxTensorBytes = uint64_t{1} << 46;

}  // namespace

class WorkerImpl final : public Worker {
 public:
  explicit WorkerImpl(const WorkerOptions& o) : opts_(o), job_hash_(wire::JobHash(o.job)) {}
  ~WorkerImpl() override { Shutdown(Clock::now() + std::chrono::seconds(5)).IgnoreError(); }

  Status Init() {
    if (opts_.partition_bytes == 0) return InvalidArgument("partition_bytes must be positive");
    if (opts_.fusion_buffer_bytes > kMaxTensorBytes) {
      return InvalidArgument("fusion_buffer_bytes of " + std::to_string(opts_.fusion_buffer_bytes) +
                             " is too large");
    }
    const auto deadline = Clock::now() + opts_.connect_timeout;
    GL_ASSIGN_OR_RETURN(fabric_, MakeFabric(opts_.transport, opts_.fabric));
    GL_ASSIGN_OR_RETURN(push_lane_, fabric_->CreateLane("worker push lane"));
    if (!opts_.single_lane) {
      GL_ASSIGN_OR_RETURN(pull_lane_, fabric_->CreateLane("worker pull lane"));
    }
    if (opts_.secret) {
      auto auth = std::make_shared<const security::LaneAuthenticator>(*opts_.secret, job_hash_);
      push_lane_->SetAuthenticator(auth);
      if (pull_lane_) pull_lane_->SetAuthenticator(auth);
    }
    GL_RETURN_IF_ERROR(push_lane_->Start(&receiver_));
    if (pull_lane_) GL_RETURN_IF_ERROR(pull_lane_->Start(&receiver_));

    wire::RegisterMsg reg;
    reg.role = wire::Role::kWorker;
    reg.requested_rank = opts_.rank;
    reg.host = opts_.host_name.empty() ? LocalHostName() : opts_.host_name;
    reg.push_address = push_lane_->address();
    reg.pull_address = (pull_lane_ ? *pull_lane_ : *push_lane_).address();
    GL_ASSIGN_OR_RETURN(Joined joined, JoinJob(opts_.scheduler, job_hash_, reg, deadline, opts_.secret));
    channel_ = std::move(joined.channel);
    rank_ = joined.welcome.your_id;
    size_ = joined.welcome.num_workers;
    num_servers_ = joined.welcome.num_servers;
    server_peers_.assign(num_servers_, 0);
    server_names_.assign(num_servers_, "");
    for (const wire::Member& m : joined.welcome.members) {
      if (m.role != wire::Role::kServer) continue;
      std::string name = "server " + std::to_string(m.id) + " (" + m.host + ")";
      GL_ASSIGN_OR_RETURN(server_peers_[m.id], push_lane_->Connect(m.push_address, name));
      server_names_[m.id] = std::move(name);
    }
    control_ = std::thread([this] { ControlLoop(); });
    // After the control thread: it keeps the heartbeats going (and hears a failed job) while
    // the workers wait for each other's segment.
    return OpenLocalPath(joined.welcome, deadline);
  }

  uint32_t rank() const override { return rank_; }
  uint32_t size() const override { return size_; }
  uint32_t num_servers() const override { return num_servers_; }

  Result<TensorHandle> Declare(std::string_view name, DataType dtype, uint64_t count) override {
    if (name.empty() || name.size() > wire::kMaxNameLength) {
      return InvalidArgument("tensor name must have 1 to " +
                             std::to_string(wire::kMaxNameLength) + " characters");
    }
    if (DataTypeSize(dtype) == 0) return InvalidArgument("invalid dtype for '" + std::string(name) + "'");
    if (count > kMaxTensorBytes / DataTypeSize(dtype)) {
      return InvalidArgument("tensor '" + std::string(name) + "' is too large");
    }
    const uint64_t per_part = std::max<uint64_t>(1, opts_.partition_bytes / DataTypeSize(dtype));
    if (count / per_part >= wire::kMaxPartitionsPerTensor) {
      return InvalidArgument("tensor '" + std::string(name) + "' of " + std::to_string(count) +
                             " elements needs more than " +
                             std::to_string(wire::kMaxPartitionsPerTensor) + " partitions of " +
                             std::to_string(opts_.partition_bytes) + " bytes");
    }
    const uint64_t key = wire::TensorKey(opts_.job, name);
    std::shared_ptr<TensorState> t;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (!failure_.ok()) return failure_;
      auto it = tensors_.find(key);
      if (it != tensors_.end()) {
        const TensorState& old = *it->second;
        if (old.name != name) {
          return Mismatch("tensor names '" + old.name + "' and '" + std::string(name) +
                          "' hash to the same key " + KeyHex(key));
        }
        if (old.dtype != dtype || old.count != count) {
          return Mismatch("key " + KeyHex(key) + " '" + old.name + "' was declared as " +
                          std::string(DataTypeName(old.dtype)) + "[" + std::to_string(old.count) +
                          "] on rank " + std::to_string(rank_) + ", now as " +
                          std::string(DataTypeName(dtype)) + "[" + std::to_string(count) + "]");
        }
        return TensorHandle(it->second);
      }
      t = std::make_shared<TensorState>();
      t->key = key;
      t->name = std::string(name);
      t->dtype = dtype;
      t->count = count;
      tensors_[key] = t;
    }
    wire::Header h;
    h.type = MsgType::kDeclare;
    h.job = job_hash_;
    h.sender = rank_;
    h.key = key;
    h.dtype = static_cast<uint8_t>(dtype);
    h.count = count;
    wire::DeclareMsg d{t->name, opts_.partition_bytes};
    Status s = channel_->Send(h, wire::Encode(d));
    if (!s.ok()) {
      FailAll(PeerLost("worker " + std::to_string(rank_) + " lost the scheduler: " + s.message()));
      return s;
    }
    return TensorHandle(t);
  }

  PushPullHandle PushPull(const TensorHandle& tensor, std::span<std::byte> data,
                          const PushPullOptions& options) override {
    return PushPullHandle(StartOp(tensor, data, options, nullptr));
  }

  PushPullHandle PushPullGroup(std::span<const TensorHandle> tensors,
                               std::span<const std::span<std::byte>> data,
                               const PushPullOptions& options) override {
    auto g = std::make_shared<Group>();
    g->t_call = Clock::now();
    g->counters = counters_;
    PushPullHandle handle(g);
    counters_->groups.fetch_add(1, std::memory_order_relaxed);
    g->what = "push_pull group of " + std::to_string(tensors.size()) + " tensors";
    auto fail = [&](Status s) {
      std::lock_guard<std::mutex> lock(g->mu);
      g->status = Status(s.code(), g->what + ": " + s.message());
      g->t_started = g->t_finished = Clock::now();
      g->finished = true;
      return handle;
    };
    if (tensors.size() != data.size()) {
      return fail(InvalidArgument(std::to_string(tensors.size()) + " tensors but " +
                                  std::to_string(data.size()) + " buffers"));
    }
    std::vector<const TensorState*> members(tensors.size());
    for (size_t i = 0; i < tensors.size(); ++i) {
      if (!tensors[i].valid()) {
        return fail(InvalidArgument("member " + std::to_string(i) + " is not a declared tensor"));
      }
      const uint64_t want = tensors[i].count() * DataTypeSize(tensors[i].dtype());
      if (data[i].size() != want) {
        return fail(InvalidArgument("member " + std::to_string(i) + ": buffer of " +
                                    std::to_string(data[i].size()) + " bytes for '" +
                                    tensors[i].name() + "', which needs " + std::to_string(want)));
      }
      members[i] = tensors[i].state_.get();
    }
    if (!tensors.empty()) {
      g->what += " ('" + Shorten(tensors.front().name()) + "'" +
                 (tensors.size() > 1 ? " .. '" + Shorten(tensors.back().name()) + "'" : "") + ")";
    }
    Result<std::shared_ptr<const GroupPlan>> plan = PlanFor(std::move(members), tensors);
    if (!plan.ok()) return fail(plan.status());
    g->plan = *plan;
    g->parts.reserve((*plan)->chunks.size());
    for (const GroupPlan::Chunk& c : (*plan)->chunks) {
      Group::Part part;
      if (c.fused.valid()) {
        std::shared_ptr<std::byte> buf = internal::FusionPool::Take(pool_);
        part.members.reserve(c.members.size());
        for (size_t k = 0; k < c.members.size(); ++k) {
          const std::span<std::byte> d = data[c.members[k]];
          if (!d.empty()) std::memcpy(buf.get() + c.offsets[k], d.data(), d.size());
          part.members.push_back({d, c.offsets[k]});
        }
        counters_->bytes_packed.fetch_add(c.bytes, std::memory_order_relaxed);
        counters_->fused_ops.fetch_add(1, std::memory_order_relaxed);
        part.packed = std::span<std::byte>(buf.get(), c.bytes);
        part.what = &c.what;
        part.op = StartOp(c.fused, part.packed, options, std::move(buf));
      } else {
        const uint32_t m = c.members.front();
        part.op = StartOp(tensors[m], data[m], options, nullptr);
      }
      g->parts.push_back(std::move(part));
    }
    g->t_started = Clock::now();
    return handle;
  }

  WorkerStats Stats() const override {
    WorkerStats s;
    s.push_pulls = counters_->push_pulls.load(std::memory_order_relaxed);
    s.bytes_reduced = counters_->bytes_reduced.load(std::memory_order_relaxed);
    s.groups = counters_->groups.load(std::memory_order_relaxed);
    s.fused_ops = counters_->fused_ops.load(std::memory_order_relaxed);
    s.bytes_packed = counters_->bytes_packed.load(std::memory_order_relaxed);
    s.bytes_unpacked = counters_->bytes_unpacked.load(std::memory_order_relaxed);
    s.protocol_errors = protocol_errors_.load(std::memory_order_relaxed);
    s.partitions_held = counters_->partitions_held.load(std::memory_order_relaxed);
    s.peak_bytes_ahead = counters_->peak_bytes_ahead.load(std::memory_order_relaxed);
    if (local_) s.bytes_copied_local = local_->bytes_copied();
    for (const Lane* lane : {push_lane_.get(), pull_lane_.get()}) {
      if (lane == nullptr) continue;
      const transport::LaneStats ls = lane->stats();
      s.bytes_copied_eager += ls.bytes_copied_eager;
      s.bytes_copied_bounce += ls.bytes_copied_bounce;
      s.protocol_errors += ls.protocol_errors;
    }
    return s;
  }

  Status Barrier(Clock::time_point deadline) override {
    // Same-host ops nobody waits on go on while this caller blocks here (the others may need
    // their sums to start the next op on a tensor).
    if (local_ && local_->busy()) local_->Nudge();
    uint64_t seq;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (!failure_.ok()) return failure_;
      seq = ++barrier_sent_;
    }
    wire::Header h;
    h.type = MsgType::kBarrier;
    h.job = job_hash_;
    h.sender = rank_;
    h.round = seq;
    GL_RETURN_IF_ERROR(channel_->Send(h, {}, deadline));
    std::unique_lock<std::mutex> lock(mu_);
    if (!cv_.wait_until(lock, deadline,
                        [&] { return barrier_released_ >= seq || !failure_.ok(); })) {
      return Timeout("barrier " + std::to_string(seq) + " on rank " + std::to_string(rank_) +
                     ": not every worker arrived before the deadline");
    }
    return barrier_released_ >= seq ? Status::Ok() : failure_;
  }

  Status Shutdown(Clock::time_point deadline) override {
    if (shut_down_.exchange(true)) return Status::Ok();
    if (channel_) {
      wire::Header h;
      h.type = MsgType::kGoodbye;
      h.job = job_hash_;
      h.sender = rank_;
      channel_->Send(h, {}, deadline).IgnoreError();
      channel_->Close();
    }
    if (control_.joinable()) control_.join();
    // Lanes first: once they are stopped nothing reads or writes a caller's buffer any more,
    // so the pending ops can be finished for good.
    if (pull_lane_) pull_lane_->Stop();
    if (push_lane_) push_lane_->Stop();
    FailAll(Aborted("worker " + std::to_string(rank_) + " shut down"), /*force=*/true);
    // Ends the same-host ops (the driving thread is the only one touching their buffers).
    if (local_) local_->Stop();
    return Status::Ok();
  }

 private:
  struct Outgoing {
    PeerId peer;
    wire::Header header;
    std::span<const std::byte> payload;
    std::shared_ptr<Op> op;
  };

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

  static std::string Shorten(const std::string& s) {
    constexpr size_t kMax = 64;
    return s.size() <= kMax ? s : s.substr(0, kMax - 3) + "...";
  }

  Result<std::shared_ptr<const GroupPlan>> PlanFor(std::vector<const TensorState*> members,
                                                   std::span<const TensorHandle> tensors) {
    {
      std::lock_guard<std::mutex> lock(plans_mu_);
      auto it = plans_.find(members);
      if (it != plans_.end()) return it->second;
    }
    GL_ASSIGN_OR_RETURN(std::shared_ptr<const GroupPlan> plan, BuildPlan(tensors));
    std::lock_guard<std::mutex> lock(plans_mu_);
    if (plans_.size() >= kMaxCachedPlans) plans_.clear();
    plans_.emplace(std::move(members), plan);
    return plan;
  }

  Result<std::shared_ptr<const GroupPlan>> BuildPlan(std::span<const TensorHandle> tensors) {
    auto plan = std::make_shared<GroupPlan>();
    std::unordered_set<const TensorState*> seen;
    const uint64_t buffer = opts_.fusion_buffer_bytes;
    const uint64_t threshold = std::min(opts_.fusion_threshold_bytes, buffer);
    std::map<DataType, size_t> open;  // dtype -> the chunk being filled
    for (uint32_t i = 0; i < tensors.size(); ++i) {
      const TensorHandle& t = tensors[i];
      if (!seen.insert(t.state_.get()).second) {
        return InvalidArgument("tensor '" + t.name() + "' is in the group twice");
      }
      const uint64_t bytes = t.count() * DataTypeSize(t.dtype());
      if (bytes >= threshold) {  // also when fusion is off (threshold 0)
        plan->chunks.push_back({{i}, {}, {}, bytes, {}});
        continue;
      }
      auto it = open.find(t.dtype());
      if (it == open.end() || plan->chunks[it->second].bytes + bytes > buffer) {
        open[t.dtype()] = plan->chunks.size();
        plan->chunks.push_back({{}, {}, {}, 0, {}});
        it = open.find(t.dtype());
      }
      GroupPlan::Chunk& c = plan->chunks[it->second];
      c.members.push_back(i);
      c.offsets.push_back(c.bytes);
      c.bytes += bytes;
    }
    for (GroupPlan::Chunk& c : plan->chunks) {
      if (c.members.size() < 2) continue;  // a buffer for one member would only add copies
      GL_RETURN_IF_ERROR(DeclareFused(c, tensors));
    }
    return std::shared_ptr<const GroupPlan>(std::move(plan));
  }

  // Declares the fused tensor of `c`. Its name is derived from the layout (dtype, and each
  // member's name and count, in order), so workers that group alike meet on one key, and
  // workers that group differently never share one (no sum of unrelated elements).
  Status DeclareFused(GroupPlan::Chunk& c, std::span<const TensorHandle> tensors) {
    const TensorHandle& first = tensors[c.members.front()];
    const TensorHandle& last = tensors[c.members.back()];
    const DataType dtype = first.dtype();
    std::string layout(DataTypeName(dtype));
    for (uint32_t m : c.members) {
      const std::string& n = tensors[m].name();
      layout += ";" + std::to_string(n.size()) + ":" + n + "=" + std::to_string(tensors[m].count());
    }
    const std::string name = "gradlink.fused/" + std::string(DataTypeName(dtype)) + "/" +
                             std::to_string(c.members.size()) + "/" +
                             KeyHex(wire::TensorKey("gradlink.fused", layout)).substr(2) + "/" +
                             Shorten(first.name()) + ".." + Shorten(last.name());
    std::string listed;
    for (size_t k = 0; k < c.members.size() && k < kMembersNamed; ++k) {
      listed += (k ? ", '" : "'") + Shorten(tensors[c.members[k]].name()) + "'";
    }
    if (c.members.size() > kMembersNamed) {
      listed += ", ... '" + Shorten(last.name()) + "'";
    }
    GL_ASSIGN_OR_RETURN(c.fused, Declare(name, dtype, c.bytes / DataTypeSize(dtype)));
    const std::string members = std::to_string(c.members.size()) + " members (" + listed + ")";
    c.what = "fused tensor '" + name + "' (key " + KeyHex(c.fused.key()) + ") of " + members;
    std::lock_guard<std::mutex> lock(mu_);
    TensorState& f = *c.fused.state_;
    if (!f.fused_members.empty()) return Status::Ok();  // declared by an earlier plan
    f.fused_members = members;
    for (uint32_t m : c.members) {
      TensorState& t = *tensors[m].state_;
      t.fused_in.push_back(&f);
      if (t.planned && !t.plan_status.ok()) MemberFailedLocked(f, t);
    }
    return Status::Ok();
  }

  // Member `t` of fused tensor `f` failed its plan (e.g. another worker declared it with
  // another shape): f's key will never be planned, so its ops fail now with t's error.
  void MemberFailedLocked(TensorState& f, const TensorState& t) {
    if (!f.member_failure.ok()) return;
    f.member_failure = Status(t.plan_status.code(), "member '" + t.name + "': " +
                                                        t.plan_status.message());
    if (!f.planned) {
      while (!f.queue.empty()) {
        std::shared_ptr<Op> op = f.queue.front();
        f.queue.pop_front();
        FinishLocked(*op, f.member_failure);
      }
    }
  }

  // Starts a PushPull of `data` into `tensor`; `owned` is a fusion buffer that `data` lies in.
  std::shared_ptr<Op> StartOp(const TensorHandle& tensor, std::span<std::byte> data,
                              const PushPullOptions& options, std::shared_ptr<std::byte> owned) {
    auto op = std::make_shared<Op>();
    op->t_call = Clock::now();
    op->local = local_;
    op->tensor = tensor.state_;
    op->data = data;
    op->options = options;
    op->owned = std::move(owned);
    if (!tensor.valid()) {
      op->tensor = std::make_shared<TensorState>();
      Complete(*op, InvalidArgument("push_pull on an undeclared tensor"));
      return op;
    }
    const uint64_t want = tensor.count() * DataTypeSize(tensor.dtype());
    if (data.size() != want) {
      Complete(*op, InvalidArgument("buffer of " + std::to_string(data.size()) +
                                    " bytes for '" + tensor.name() + "', which needs " +
                                    std::to_string(want)));
      return op;
    }
    bool queued_behind_local = false;
    {
      std::lock_guard<std::mutex> lock(mu_);
      op->id = next_op_id_++;
      TensorState& t = *op->tensor;
      if (!failure_.ok()) {
        FinishLocked(*op, failure_);
      } else if (t.planned && !t.plan_status.ok()) {
        FinishLocked(*op, t.plan_status);
      } else if (!t.member_failure.ok()) {
        FinishLocked(*op, t.member_failure);
      } else {
        t.queue.push_back(op);
        StartNextLocked(t);
        PumpLocked();
        queued_behind_local = t.local && t.busy && !t.queue.empty();
      }
    }
    Issue();
    if (local_) {
      local_->Kick();
      // The op waits for the tensor's running one, whose sums nobody may drive until someone
      // waits (Kick leaves sums to the waiter): the others need this op's chunks, so the
      // background finishes that one now, as the servers' path would.
      if (queued_behind_local) local_->Nudge();
    }
    return op;
  }

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
  void StartNextLocked(TensorState& t) {
    while (t.planned && !t.busy && !t.queue.empty()) {
      std::shared_ptr<Op> op = t.queue.front();
      t.queue.pop_front();
      if (!t.plan_status.ok() || !t.member_failure.ok()) {
        FinishLocked(*op, t.plan_status.ok() ? t.member_failure : t.plan_status);
        continue;
      }
      if (!BindLocalLocked(t, *op)) continue;
      op->round = t.next_round++;
      if (t.local) {
        StartLocalLocked(t, op);
        continue;
      }
      op->parts.assign(t.parts.size(), Op::Part::kQueued);
      op->outstanding = static_cast<uint32_t>(t.parts.size());
      if (op->outstanding == 0) {
        FinishLocked(*op, Status::Ok());
        continue;
      }
      t.busy = true;
      op->started = true;
      op->max_ahead = LeadLimit(opts_.max_bytes_ahead, t.servers_spanned);
      ops_[op->id] = op;
      for (uint32_t p = 0; p < t.parts.size(); ++p) {
        pending_.push(Pending{op->options.priority, next_seq_++, op, p});
      }
    }
  }

  // Moves queued partitions to to_issue_ (for Issue) while the bytes in flight allow.
  void PumpLocked() {
    while (!pending_.empty()) {
      const Pending& top = pending_.top();
      Op& op = *top.op;
      if (op.abandoned || op.finished) {
        pending_.pop();
        continue;
      }
      const TensorState& t = *op.tensor;
      const wire::PartitionPlan& plan = t.parts[top.part];
      const uint64_t size = DataTypeSize(t.dtype);
      const uint64_t bytes = plan.count * size;
      if (!top.counted && opts_.max_bytes_ahead > 0) {
        // Held back behind its own op's earlier partitions, or over the op's lead: it waits
        // on the op (in order) for sums to come back, and the queue goes on with other ops.
        if (!op.held.empty() || OverLead(op, bytes)) {
          op.held.emplace_back(top.seq, top.part);
          counters_->partitions_held.fetch_add(1, std::memory_order_relaxed);
          pending_.pop();
          continue;
        }
      }
      if (bytes_in_flight_ > 0 && bytes_in_flight_ + bytes > opts_.max_bytes_in_flight) break;
      bytes_in_flight_ += bytes;
      if (!top.counted) AddAheadLocked(op, bytes);
      if (op.t_first_issue == Clock::time_point{}) op.t_first_issue = Clock::now();
      op.parts[top.part] = Op::Part::kSent;
      op.sending++;
      Outgoing o;
      o.peer = server_peers_[plan.server];
      o.header.type = MsgType::kPush;
      o.header.flags = op.options.average ? wire::kFlagAverage : 0;
      o.header.job = job_hash_;
      o.header.sender = rank_;
      o.header.key = t.key;
      o.header.partition = top.part;
      o.header.dtype = static_cast<uint8_t>(t.dtype);
      o.header.round = op.round;
      o.header.count = plan.count;
      o.header.payload_bytes = bytes;
      o.header.cookie = op.id;
      o.payload = op.data.subspan(plan.offset * size, bytes);
      o.op = top.op;
      to_issue_.push_back(std::move(o));
      pending_.pop();
    }
  }

  // Hands what PumpLocked queued to the push lane, in the order it was pumped. Outside the lock:
  // a lane may complete a send inline. Three threads pump (the caller, and the two lanes' as
  // credit comes back), so one issues at a time and takes over what the others queue meanwhile:
  // otherwise a batch pumped later could reach the lane first, while the thread holding an
  // earlier one waits for a core, and every server would wait for this worker's first
  // partitions (seen on bench/netcluster: one worker's partitions 9 and 13 reached a server
  // 9 ms before its partitions 1 and 5).
  void Issue() {
    std::vector<Outgoing> batch;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (issuing_ || to_issue_.empty()) return;
      issuing_ = true;
      batch.swap(to_issue_);
    }
    for (;;) {
      for (Outgoing& o : batch) {
        push_lane_->Send(o.peer, o.header, o.payload,
                         [this, op = o.op, part = o.header.partition](const Status& s) {
                           PushDone(op, part, s);
                         });
      }
      batch.clear();
      std::lock_guard<std::mutex> lock(mu_);
      if (to_issue_.empty()) {
        issuing_ = false;
        return;
      }
      batch.swap(to_issue_);
    }
  }

  // A push has left (or failed). Credit comes back here, not at the pull: a worker waiting for
  // its pulls must never hold the credit that the other workers' rounds need. Which partitions
  // a worker pushes first depends on its own timing, so credit held until the pull can make two
  // workers each wait on partitions only the other can still send.
  void PushDone(const std::shared_ptr<Op>& op, uint32_t part, const Status& s) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (!op->finished) op->t_pushed = Clock::now();
      ReleaseCreditLocked(*op, part);
      op->sending--;
      if (!s.ok()) AbandonLocked(*op, s);
      TryFinishLocked(*op);
      PumpLocked();
    }
    Issue();
  }

  void AnsweredLocked(const std::shared_ptr<Op>& op, uint32_t part) {
    ReleaseCreditLocked(*op, part);  // the pull may overtake its push's completion
    op->parts[part] = Op::Part::kDone;
    op->outstanding--;
    op->bytes_ahead -= PartBytes(*op, part);
    ReleaseHeldLocked(op);
  }

  // A partition of `bytes` would take the op past its lead. Never true of the first one: a
  // partition bigger than the limit is sent on its own.
  static bool OverLead(const Op& op, uint64_t bytes) {
    return op.bytes_ahead > 0 && op.bytes_ahead + bytes > op.max_ahead;
  }

  void AddAheadLocked(Op& op, uint64_t bytes) {
    op.bytes_ahead += bytes;
    if (op.bytes_ahead > counters_->peak_bytes_ahead.load(std::memory_order_relaxed)) {
      counters_->peak_bytes_ahead.store(op.bytes_ahead, std::memory_order_relaxed);
    }
  }

  uint64_t PartBytes(const Op& op, uint32_t part) const {
    return op.tensor->parts[part].count * DataTypeSize(op.tensor->dtype);
  }

  // Lets the op's held partitions back into the queue, in order, as far as its lead allows;
  // their bytes count from now on, so the next answer does not let the same bytes in twice.
  void ReleaseHeldLocked(const std::shared_ptr<Op>& op) {
    while (!op->held.empty()) {
      const auto [seq, part] = op->held.front();
      const uint64_t bytes = PartBytes(*op, part);
      if (OverLead(*op, bytes)) break;
      AddAheadLocked(*op, bytes);
      op->held.pop_front();
      pending_.push(Pending{op->options.priority, seq, op, part, /*counted=*/true});
    }
  }

  void ReleaseCreditLocked(Op& op, uint32_t part) {
    if (op.parts[part] != Op::Part::kSent) return;
    op.parts[part] = Op::Part::kPushed;
    bytes_in_flight_ -= op.tensor->parts[part].count * DataTypeSize(op.tensor->dtype);
  }

  void RecordFailureLocked(Op& op, const Status& s) {
    if (op.failure.ok()) op.failure = s;
  }

  void AbandonLocked(Op& op, const Status& s) {
    RecordFailureLocked(op, s);
    op.abandoned = true;
  }

  // Finishes `op` once nothing will touch its buffer any more: every partition answered (or the
  // op abandoned), no push still being read by the transport, no pull being written.
  void TryFinishLocked(Op& op) {
    if (op.finished || !op.started) return;
    // Waiting for the scheduler's word on a lost endpoint: the op's own error may name the
    // wrong peer (see OnDataPeerFailed).
    if (op.abandoned && verdict_pending_) return;
    if ((op.outstanding == 0 || op.abandoned) && op.sending == 0 && op.receiving == 0) {
      FinishLocked(op, op.failure);
    }
  }

  // The op is over: release its tensor for the next op and wake its waiters.
  void FinishLocked(Op& op, const Status& s) {
    if (op.finished) return;
    op.finished = true;
    op.t_done = Clock::now();
    if (s.ok() && !op.owned) {  // fused ops count when their members are unpacked
      counters_->push_pulls.fetch_add(1, std::memory_order_relaxed);
      counters_->bytes_reduced.fetch_add(op.data.size(), std::memory_order_relaxed);
    }
    ops_.erase(op.id);  // callers hold a reference to `op`
    Complete(op, s);
    if (op.started) {
      op.tensor->busy = false;
      StartNextLocked(*op.tensor);
    }
  }

  static void Complete(Op& op, const Status& s) {
    {
      std::lock_guard<std::mutex> lock(op.mu);
      op.done = true;
      op.status = s;
      op.cv.notify_all();
    }
    if (op.local) op.local->Wake();  // a waiter may sleep on the segment (LocalReduce::Wait)
  }

  // A data endpoint to a server failed. That server may be the lost peer, or a healthy one that
  // exited because the job failed for another reason (its kAbort may still be on the way to
  // us). The control thread waits kVerdictGrace for the scheduler's verdict before failing the
  // job with this status.
  void OnDataPeerFailed(const Status& s) {
    std::lock_guard<std::mutex> lock(mu_);
    NoteDataPeerFailureLocked(s);
  }

  void NoteDataPeerFailureLocked(const Status& s) {
    if (!failure_.ok() || verdict_pending_) return;
    verdict_pending_ = true;
    pending_peer_failure_ = s;
    pending_since_ = Clock::now();
  }

  // On the control thread: the endpoint failure whose grace has run out, if any.
  std::optional<Status> ExpiredPeerFailure() {
    std::lock_guard<std::mutex> lock(mu_);
    if (!verdict_pending_ || Clock::now() - pending_since_ < kVerdictGrace) return std::nullopt;
    return pending_peer_failure_;
  }

  // The job is over: fail everything now. A hung peer may never complete a transfer, so the
  // lanes are stopped (after which nothing touches a caller's buffer) and every op finishes.
  // Runs on the control thread, never on a lane's.
  void FailJob(const Status& s) {
    FailAll(s);
    if (pull_lane_) pull_lane_->Stop();
    if (push_lane_) push_lane_->Stop();
    FailAll(s, /*force=*/true);
  }

  // Sticky failure of this worker. With `force` (the lanes are stopped: no callback will come)
  // every op finishes now; otherwise each finishes when the transport lets go of its buffer.
  void FailAll(const Status& s, bool force = false) {
    std::lock_guard<std::mutex> lock(mu_);
    if (failure_.ok()) failure_ = s;
    verdict_pending_ = false;
    // Same-host ops end on their driving thread, which alone touches their buffers.
    if (local_) local_->Fail(failure_);
    auto ops = ops_;
    for (auto& [id, op] : ops) {
      // An endpoint's loss is a symptom; the job's failure names the cause.
      if (op->failure.code() == Code::kPeerLost) op->failure = failure_;
      AbandonLocked(*op, failure_);
      // Even when forced, an op with a pull still being written (a receive the stopped lane
      // could not cancel) stays pending: its buffer must outlive that write.
      if (force && op->receiving == 0) {
        FinishLocked(*op, op->failure);
      } else {
        TryFinishLocked(*op);
      }
    }
    for (auto& [key, t] : tensors_) {
      while (!t->queue.empty()) {
        auto op = t->queue.front();
        t->queue.pop_front();
        FinishLocked(*op, failure_);
      }
    }
    cv_.notify_all();
  }

  // ---- Pull lane -----------------------------------------------------------------------------

  Result<std::span<std::byte>> OnHeader(const wire::Header& h) {
    if (h.job != job_hash_ ||
        (h.type != MsgType::kPullResponse && h.type != MsgType::kDataError)) {
      protocol_errors_++;
      return ProtocolError("unexpected frame on the pull lane");
    }
    std::lock_guard<std::mutex> lock(mu_);
    auto it = ops_.find(h.cookie);
    if (it == ops_.end()) return Aborted("late reply for a finished push_pull");
    Op& op = *it->second;
    const TensorState& t = *op.tensor;
    if (op.abandoned) return Aborted("reply for an abandoned push_pull");
    // The pull may overtake the completion of its own push (kSent) but never precede the push.
    if (h.key != t.key || h.partition >= op.parts.size() || h.round != op.round ||
        (op.parts[h.partition] != Op::Part::kSent && op.parts[h.partition] != Op::Part::kPushed)) {
      protocol_errors_++;
      return ProtocolError("pull reply does not match its push");
    }
    if (h.type == MsgType::kDataError) {
      auto& buf = error_text_[{h.cookie, h.partition}];
      buf.resize(h.payload_bytes);
      op.receiving++;
      return std::span<std::byte>(buf);
    }
    const wire::PartitionPlan& plan = t.parts[h.partition];
    const uint64_t size = DataTypeSize(t.dtype);
    if (h.dtype != static_cast<uint8_t>(t.dtype) || h.count != plan.count) {
      protocol_errors_++;
      return ProtocolError("pull reply has the wrong shape");
    }
    op.t_arrived = Clock::now();
    op.receiving++;
    return op.data.subspan(plan.offset * size, plan.count * size);
  }

  void OnPayload(const wire::Header& h, bool ok, const Status& why) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = ops_.find(h.cookie);
      if (it == ops_.end()) return;
      std::shared_ptr<Op> op = it->second;
      op->receiving--;
      if (op->parts[h.partition] == Op::Part::kDone) {
        // Answered already: a duplicate from a confused server changes nothing.
      } else if (h.type == MsgType::kDataError) {
        auto node = error_text_.extract({h.cookie, h.partition});
        std::string text = "(unreadable error)";
        if (ok && !node.empty()) {
          auto decoded = wire::DecodeText(node.mapped());
          if (decoded.ok()) text = *decoded;
        }
        const Code code = h.code == 0 ? Code::kInternal : static_cast<Code>(h.code);
        const std::string& server = server_names_[op->tensor->parts[h.partition].server];
        const Status refused(code, text + " (from " + server + ")");
        RecordFailureLocked(*op, refused);
        AnsweredLocked(op, h.partition);
        // A server that lost another worker's push knows only the symptom: wait for the
        // scheduler's verdict, which names the lost member.
        if (code == Code::kPeerLost) {
          NoteDataPeerFailureLocked(refused);
          op->abandoned = true;
        }
      } else if (!ok) {
        // The transport's error names no peer: say whose reply was lost.
        const std::string& server = server_names_[op->tensor->parts[h.partition].server];
        const Status lost(why.code(), "worker " + std::to_string(rank_) +
                                          ": receiving the sum from " + server +
                                          " failed: " + why.message());
        RecordFailureLocked(*op, lost);
        AnsweredLocked(op, h.partition);
        // A broken receive is a broken connection: like an endpoint failure, it waits for the
        // scheduler's verdict, which names the cause (the server may have exited because the
        // job failed elsewhere).
        if (why.code() == Code::kPeerLost) {
          NoteDataPeerFailureLocked(lost);
          op->abandoned = true;
        }
      } else {
        AnsweredLocked(op, h.partition);
      }
      TryFinishLocked(*op);
      PumpLocked();
    }
    Issue();
  }

  class Receiver final : public transport::Receiver {
   public:
    explicit Receiver(WorkerImpl* w) : w_(w) {}
    Result<std::span<std::byte>> OnHeader(const wire::Header& h) override { return w_->OnHeader(h); }
    void OnPayload(const wire::Header& h, std::span<std::byte>) override {
      w_->OnPayload(h, true, Status::Ok());
    }
    void OnReceiveFailed(const wire::Header& h, const Status& s) override {
      w_->OnPayload(h, false, s);
    }
    void OnPeerFailed(PeerId peer, const Status& s) override {
      w_->OnDataPeerFailed(PeerLost(
          "worker " + std::to_string(w_->rank_) + ": connection to " +
          (peer < w_->server_names_.size() ? w_->server_names_[peer] : "a server") +
          " failed: " + s.message()));
    }

   private:
    WorkerImpl* w_;
  };

  // ---- Control plane -------------------------------------------------------------------------

  void ControlLoop() {
    Liveness liveness(channel_.get(), job_hash_, rank_);
    while (!shut_down_.load()) {
      Status alive = liveness.Tick();
      if (!alive.ok()) {
        // While shutting down, Shutdown() itself closed the channel: not a failure.
        if (!shut_down_.load()) {
          FailJob(PeerLost("worker " + std::to_string(rank_) + ": " + alive.message()));
        }
        channel_->Close();
        return;
      }
      if (std::optional<Status> lost = ExpiredPeerFailure()) {
        FailJob(*lost);
        return;
      }
      auto f = channel_->Receive(Clock::now() + kPoll);
      if (f.ok()) liveness.Heard();
      if (!f.ok()) {
        if (f.status().code() == Code::kTimeout) continue;
        if (!shut_down_.load()) {
          FailJob(PeerLost("worker " + std::to_string(rank_) + " lost the scheduler: " +
                           f.status().message()));
        }
        return;
      }
      switch (f->header.type) {
        case MsgType::kAssign: {
          Status s = OnAssign(*f);
          if (!s.ok()) {
            FailAll(s);
            return;
          }
          break;
        }
        case MsgType::kHeartbeat:
          break;
        case MsgType::kBarrierRelease: {
          std::lock_guard<std::mutex> lock(mu_);
          barrier_released_ = std::max(barrier_released_, f->header.round);
          cv_.notify_all();
          break;
        }
        case MsgType::kAbort: {
          auto text = wire::DecodeText(f->payload);
          const Code code = f->header.code == 0 ? Code::kAborted : static_cast<Code>(f->header.code);
          FailJob(Status(code, "job aborted: " + (text.ok() ? *text : std::string("(no reason)"))));
          return;
        }
        default:
          protocol_errors_++;
          GL_LOG(kWarn) << "worker " << rank_ << ": unexpected control message "
                        << static_cast<int>(f->header.type);
      }
    }
  }

  Status OnAssign(const transport::Frame& f) {
    std::shared_ptr<TensorState> t;
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = tensors_.find(f.header.key);
      if (it == tensors_.end()) return ProtocolError("kAssign for a key this worker never declared");
      t = it->second;
    }
    Status plan_status;
    std::vector<wire::PartitionPlan> parts;
    if (f.header.code != 0) {
      auto text = wire::DecodeText(f.payload);
      plan_status = Status(static_cast<Code>(f.header.code), text.ok() ? *text : "(no reason)");
    } else {
      if (f.header.dtype != static_cast<uint8_t>(t->dtype) || f.header.count != t->count) {
        return ProtocolError("kAssign shape differs from the declaration");
      }
      GL_ASSIGN_OR_RETURN(wire::AssignMsg a, wire::DecodeAssign(f.payload, t->count, num_servers_));
      parts = std::move(a.partitions);
    }
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (t->planned) return ProtocolError("key assigned twice");
      t->planned = true;
      t->plan_status = plan_status;
      t->parts = std::move(parts);
      t->servers_spanned = ServersSpanned(t->parts);
      if (!plan_status.ok()) {
        for (TensorState* f : t->fused_in) MemberFailedLocked(*f, *t);
      }
      StartNextLocked(*t);
      PumpLocked();
    }
    Issue();
    if (local_) local_->Nudge();  // the control thread does not copy tensors
    return Status::Ok();
  }

  // ---- Same-host path (src/worker/local_reduce.h) --------------------------------------------

  // Opens the shared-memory segment when WorkerOptions::local_arena_bytes asks for it and every
  // worker of the job is on this host (the address book's host names agree).
  Status OpenLocalPath(const wire::WelcomeMsg& welcome, Clock::time_point deadline) {
    if (opts_.local_arena_bytes == 0 || size_ < 2) return Status::Ok();
    const wire::Member* first = nullptr;  // worker 0
    const std::string* host = nullptr;
    bool one_host = true;
    for (const wire::Member& m : welcome.members) {
      if (m.role != wire::Role::kWorker) continue;
      if (m.id == 0) first = &m;
      if (host == nullptr) host = &m.host;
      one_host = one_host && MachineOf(m.host) == MachineOf(*host);
    }
    if (!one_host || first == nullptr || size_ > LocalReduce::kMaxRanks) {
      GL_LOG(kInfo) << "worker " << rank_ << ": same-host path off ("
                    << (one_host ? "too many workers" : "workers on several hosts") << ")";
      return Status::Ok();
    }
    // Named after this run of the job (the scheduler's random instance, worker 0's address),
    // hashed as tensor keys are.
    std::string run = std::to_string(welcome.instance) + "/";
    run.append(reinterpret_cast<const char*>(first->push_address.data()),
               first->push_address.size());
    const uint64_t h = wire::TensorKey(opts_.job, run);
    char name[40];
    std::snprintf(name, sizeof(name), "/gradlink-%016llx", static_cast<unsigned long long>(h));
    LocalReduce::Options lo;
    lo.name = name;
    lo.rank = rank_;
    lo.ranks = size_;
    lo.arena_bytes = opts_.local_arena_bytes;
    lo.chunk_bytes = opts_.local_chunk_bytes;
    lo.deadline = deadline;
    lo.cancelled = [this] {
      std::lock_guard<std::mutex> lock(mu_);
      return failure_;
    };
    GL_ASSIGN_OR_RETURN(std::shared_ptr<LocalReduce> local, LocalReduce::Open(lo));
    if (!local) return Status::Ok();  // no room in /dev/shm: the servers (Open warned)
    std::lock_guard<std::mutex> lock(mu_);  // FailAll (the control thread) reads it
    local_ = std::move(local);
    if (!failure_.ok()) local_->Fail(failure_);
    return Status::Ok();
  }

  // Binds t to its same-host channel on its first op. False if `op` failed instead (finished).
  bool BindLocalLocked(TensorState& t, Op& op) {
    if (!local_ || t.local_bound) return true;
    Result<std::optional<LocalReduce::Channel>> c = local_->Bind(t.key, t.dtype, t.count);
    if (!c.ok()) {
      FinishLocked(op, Status(c.status().code(), "key " + KeyHex(t.key) + " '" + t.name +
                                                     "': " + c.status().message()));
      return false;
    }
    t.local_bound = true;
    t.local = *c;
    if (!t.local) {
      GL_LOG(kInfo) << "worker " << rank_ << ": '" << t.name
                    << "' goes through the servers: the same-host segment is full";
    }
    return true;
  }

  void StartLocalLocked(TensorState& t, const std::shared_ptr<Op>& op) {
    t.busy = true;
    op->started = true;
    LocalReduce::Job job;
    job.channel = *t.local;
    job.data = op->data;
    job.dtype = t.dtype;
    job.count = t.count;
    job.round = op->round;
    job.average = op->options.average;
    job.what = "key " + KeyHex(t.key) + " '" + t.name + "'";
    job.done = [this, op](const Status& s, Clock::time_point first, Clock::time_point last,
                          Clock::time_point arrived) { LocalDone(op, s, first, last, arrived); };
    local_->Start(std::move(job));
  }

  // On the thread driving the same-host path.
  void LocalDone(const std::shared_ptr<Op>& op, const Status& s, Clock::time_point first,
                 Clock::time_point last, Clock::time_point arrived) {
    std::lock_guard<std::mutex> lock(mu_);
    op->t_first_issue = first;
    op->t_pushed = last;
    op->t_arrived = arrived;
    FinishLocked(*op, s);
  }

  const WorkerOptions opts_;
  const uint32_t job_hash_;
  uint32_t rank_ = 0, size_ = 0, num_servers_ = 0;
  std::shared_ptr<transport::Fabric> fabric_;
  std::unique_ptr<Lane> push_lane_, pull_lane_;
  std::shared_ptr<LocalReduce> local_;  // the same-host path; null when off
  Receiver receiver_{this};
  std::vector<PeerId> server_peers_;
  std::vector<std::string> server_names_;
  std::unique_ptr<transport::ControlChannel> channel_;
  std::thread control_;
  std::atomic<bool> shut_down_{false};
  std::atomic<uint64_t> protocol_errors_{0};

  std::mutex mu_;
  std::condition_variable cv_;
  Status failure_;  // sticky
  bool verdict_pending_ = false;  // a data endpoint failed; see OnDataPeerFailed
  Status pending_peer_failure_;
  Clock::time_point pending_since_;
  std::unordered_map<uint64_t, std::shared_ptr<TensorState>> tensors_;
  std::unordered_map<uint64_t, std::shared_ptr<Op>> ops_;  // by id; in flight
  std::map<std::pair<uint64_t, uint32_t>, std::vector<std::byte>> error_text_;
  std::priority_queue<Pending> pending_;
  uint64_t next_op_id_ = 1, next_seq_ = 0, bytes_in_flight_ = 0;
  std::vector<Outgoing> to_issue_;  // pumped, not yet handed to the push lane (Issue)
  bool issuing_ = false;            // a thread is in Issue(), handing them over
  uint64_t barrier_sent_ = 0, barrier_released_ = 0;

  const std::shared_ptr<internal::Counters> counters_ = std::make_shared<internal::Counters>();
  const std::shared_ptr<internal::FusionPool> pool_ =
      std::make_shared<internal::FusionPool>(opts_.fusion_buffer_bytes);
  std::mutex plans_mu_;  // taken before mu_ (BuildPlan declares), never under it
  std::unordered_map<std::vector<const TensorState*>, std::shared_ptr<const GroupPlan>, LayoutHash>
      plans_;
};

Result<std::unique_ptr<Worker>> Worker::Connect(const WorkerOptions& options) {
  auto w = std::make_unique<WorkerImpl>(options);
  GL_RETURN_IF_ERROR(w->Init());
  return std::unique_ptr<Worker>(std::move(w));
}

}  // namespace gradlink
