// An operation's life on the servers' path (worker_impl.h): started when its tensor is planned and
// idle, its partitions queued by priority, pumped while bytes in flight and the op's lead allow,
// handed to the push lane in pump order, and finished once nothing touches its buffer.
#include <algorithm>
#include <cstring>
#include <limits>
#include <type_traits>

#include "worker/worker_impl.h"

namespace gradlink {

using transport::Lane;
using transport::PeerId;
using wire::MsgType;

// A limit too big to multiply is no limit in practice, never a wrapped-around small one.
uint64_t LeadLimit(uint64_t per_server, uint32_t servers) {
  if (servers != 0 && per_server > std::numeric_limits<uint64_t>::max() / servers) {
    return std::numeric_limits<uint64_t>::max();
  }
  return per_server * servers;
}

std::shared_ptr<Op> WorkerImpl::StartCollective(const TensorHandle& tensor,
                                                std::span<const std::byte> input,
                                                std::span<std::byte> output,
                                                const PushPullOptions& options) {
  const auto failed = [&](Status s) {
    auto op = std::make_shared<Op>();
    op->t_call = Clock::now();
    op->tensor = tensor.valid() ? tensor.state_ : std::make_shared<TensorState>();
    Complete(*op, std::move(s));
    return op;
  };
  if (!tensor.valid()) return failed(InvalidArgument("a collective on an undeclared tensor"));
  const TensorState& t = *tensor.state_;
  const uint64_t size = DataTypeSize(t.dtype);
  const std::string what = "'" + t.name + "' (" + DescribeSpec(t.spec) + ")";
  if (input.size() != t.input_count * size) {
    return failed(InvalidArgument("input of " + std::to_string(input.size()) + " bytes for " +
                                  what + ", whose input on rank " + std::to_string(rank_) +
                                  " has " + std::to_string(t.input_count * size)));
  }
  if (output.size() != t.output_count * size) {
    return failed(InvalidArgument("output of " + std::to_string(output.size()) + " bytes for " +
                                  what + ", whose output on rank " + std::to_string(rank_) +
                                  " has " + std::to_string(t.output_count * size)));
  }
  const bool reduces =
      t.spec.kind == Collective::kAllreduce || t.spec.kind == Collective::kReduceScatter;
  if (options.average && !(reduces && t.spec.op == ReduceOp::kSum)) {
    return failed(InvalidArgument("average of " + what + ": only a sum averages"));
  }
  // What this worker copies itself; the servers' results land elsewhere in the output. A sum
  // out of place is summed in place on the output.
  const std::vector<layout::LocalCopy> sum_copy = {{0, 0, t.count}};
  for (const layout::LocalCopy& c : t.spec.is_sum() ? sum_copy : t.copies) {
    const std::byte* from = input.data() + c.in_offset * size;
    std::byte* to = output.data() + c.out_offset * size;
    if (from != to) std::memmove(to, from, c.count * size);
  }
  return StartOp(tensor, output, options, nullptr, input);
}

std::shared_ptr<Op> WorkerImpl::NewOp(std::shared_ptr<TensorState> tensor) {
  auto op = std::allocate_shared<Op>(internal::OpAllocator<Op>(op_memory_));
  op->t_call = Clock::now();
  op->timeout = opts_.operation_timeout;
  op->describer = describer_;
  op->local = local_;
  op->tensor = std::move(tensor);
  return op;
}

std::shared_ptr<Op> WorkerImpl::StartOp(const TensorHandle& tensor, std::span<std::byte> data,
                            const PushPullOptions& options, std::shared_ptr<std::byte> owned,
                            std::span<const std::byte> input) {
  std::shared_ptr<Op> op = NewOp(tensor.state_);
  op->data = data;
  op->options = options;
  op->owned = std::move(owned);
  if (!tensor.valid()) {
    op->tensor = std::make_shared<TensorState>();
    Complete(*op, InvalidArgument("push_pull on an undeclared tensor"));
    return op;
  }
  // A sum pushes its tensor and pulls into it; other collectives push their input.
  op->input = tensor.spec().is_sum() ? std::span<const std::byte>(data) : input;
  const uint64_t want = tensor.output_count() * DataTypeSize(tensor.dtype());
  if (data.size() != want) {
    Complete(*op, InvalidArgument("buffer of " + std::to_string(data.size()) +
                                  " bytes for '" + tensor.name() + "', which needs " +
                                  std::to_string(want)));
    return op;
  }
  // Before the state lock: binding may wait on another worker's claim in the segment.
  BindLocal(*op->tensor);
  bool queued_behind_local = false;
  IssueBatch batch;
  {
    MutexLock lock(mu_);
    op->id = next_op_id_++;
    TensorState& t = *op->tensor;
    if (verdict_.failed()) {
      FinishLocked(*op, verdict_.failure());
    } else if (t.planned && !t.plan_status.ok()) {
      FinishLocked(*op, t.plan_status);
    } else if (!t.member_failure.ok()) {
      FinishLocked(*op, t.member_failure);
    } else {
      t.queue.push_back(op);
      StartNextLocked(t);
      PumpLocked();
      queued_behind_local = t.local && t.busy && !t.queue.empty();
      TakeIssueLocked(&batch);
    }
  }
  Issue(std::move(batch));
  if (local_) {
    local_->Progress(LocalReduce::Step::kPost);
    // The op waits for the tensor's running one, whose sums nobody may drive until someone
    // waits (kPost leaves sums to the waiter): the others need this op's chunks, so the
    // background finishes that one now, as the servers' path would.
    if (queued_behind_local) local_->Progress(LocalReduce::Step::kBackground);
  }
  return op;
}

void WorkerImpl::StartNextLocked(TensorState& t) {
  while (t.planned && !t.busy && !t.queue.empty()) {
    std::shared_ptr<Op> op = t.queue.front();
    t.queue.pop_front();
    if (!t.plan_status.ok() || !t.member_failure.ok()) {
      FinishLocked(*op, t.plan_status.ok() ? t.member_failure : t.plan_status);
      continue;
    }
    if (!LocalBindingOkLocked(t, *op)) continue;
    op->round = t.next_round++;
    if (t.local) {
      StartLocalLocked(t, op);
      continue;
    }
    if (t.mode != topology::Mode::kFlat && !t.parts.empty()) {
      StartHostLocked(t, op);
      continue;
    }
    op->parts.swap(t.spare_parts);
    op->parts.assign(t.parts.size(), Op::Part::kQueued);
    op->held.swap(t.spare_held);  // empty, with the room the last op needed
    op->outstanding = static_cast<uint32_t>(t.parts.size());
    for (uint32_t p = 0; p < t.roles.size(); ++p) {
      if (t.roles[p].participates()) continue;
      op->parts[p] = Op::Part::kDone;  // another pair of ranks' block, or copied locally
      op->outstanding--;
    }
    if (op->outstanding == 0) {
      FinishLocked(*op, Status::Ok());
      continue;
    }
    t.busy = true;
    op->started = true;
    op->max_ahead = LeadLimit(max_bytes_ahead_, t.servers_spanned);
    TrackOpLocked(op);
    if (t.order.empty()) {
      for (uint32_t p = 0; p < t.parts.size(); ++p) {
        pending_.push(Pending{op->options.priority, next_seq_++, op, p});
      }
    } else {  // in the turns of layout::Role (the partitions this worker takes part in)
      for (uint32_t p : t.order) pending_.push(Pending{op->options.priority, next_seq_++, op, p});
    }
  }
}

void WorkerImpl::PumpLocked() {
  while (!pending_.empty()) {
    const Pending& top = pending_.top();
    Op& op = *top.op;
    if (op.abandoned || op.finished) {
      pending_.pop();
      continue;
    }
    const TensorState& t = *op.tensor;
    const wire::PartitionPlan& plan = t.parts[top.part];
    const uint64_t size = DataTypeSize(t.wire);
    const layout::Role role = RoleIn(t, top.part);
    const uint64_t bytes = PartBytes(op, top.part);
    // A request (0 bytes: this worker only receives the partition) is never held back: the
    // partition's contributor may be waiting on it to have its own earlier partitions answered.
    if (!top.counted && max_bytes_ahead_ > 0 && bytes > 0) {
      // Held back behind its own op's earlier partitions, or over the op's lead: it waits
      // on the op (in order) for sums to come back, and the queue goes on with other ops.
      if (!op.held.empty() || OverLead(op, bytes)) {
        op.held.push_back({top.seq, top.part});
        counters_->partitions_held.fetch_add(1, std::memory_order_relaxed);
        pending_.pop();
        continue;
      }
    }
    if (bytes_in_flight_ > 0 && bytes_in_flight_ + bytes > max_bytes_in_flight_) break;
    bytes_in_flight_ += bytes;
    if (!top.counted) AddAheadLocked(op, bytes);
    if (op.t_first_issue == Clock::time_point{}) op.t_first_issue = Clock::now();
    op.parts[top.part] = Op::Part::kSent;
    op.sending++;
    Outgoing o;
    o.peer = directory_.peer(plan.server);
    o.header = PushHeader(op, top.part, bytes);
    // A host's partial sum lies in its segment; a flat push is the caller's input itself.
    o.payload = op.host      ? op.partial[top.part]
                : role.push ? op.input.subspan(role.in_offset * size, bytes)
                            : std::span<const std::byte>();
    o.sent = NewPushSentLocked(top.op, top.part, plan.server);
    to_issue_.push_back(std::move(o));
    pumped_ = true;
    pending_.pop();
  }
}

wire::Header WorkerImpl::PushHeader(const Op& op, uint32_t part, uint64_t bytes) const {
  const TensorState& t = *op.tensor;
  wire::Header h;
  h.type = MsgType::kPush;
  h.flags = op.host ? op.push_flags[part] : (op.options.average ? wire::kFlagAverage : 0);
  h.ranks = op.host ? op.push_ranks[part] : 0;
  h.job = job_hash_;
  h.sender = rank_;
  h.key = t.key;
  h.partition = part;
  h.dtype = static_cast<uint8_t>(t.wire);
  h.round = op.round;
  h.count = RoleIn(t, part).push ? t.parts[part].count : 0;  // 0: a request for the result
  h.payload_bytes = bytes;
  h.cookie = op.id;
  return h;
}

// The issuer protocol. Every critical section that pumped something counts one request in
// issue_requests_ (under mu_, together with its pushes in to_issue_). The thread whose request
// finds the count at 0 is the issuer: it takes to_issue_ and sends outside the lock; the others
// leave their pushes to it. After sending, the issuer releases the requests its batch covered;
// if none came meanwhile the count is back at 0 and it is done without taking the lock again,
// else it takes the lock once for everything queued since. So pushes reach the lane in pump
// order, and a partition costs its pumping thread no second acquisition of mu_.
bool WorkerImpl::TakeIssueLocked(IssueBatch* batch) {
  if (!pumped_) return false;
  pumped_ = false;
  if (issue_requests_.fetch_add(1, std::memory_order_acq_rel) != 0) return false;
  issuing_.swap(to_issue_);  // issuing_ was left empty, with its capacity, by the last issuer
  batch->items = &issuing_;
  batch->requests = 1;
  return true;
}

void WorkerImpl::TrackOpLocked(const std::shared_ptr<Op>& op) {
  if (ops_.empty()) busy_since_ = Clock::now();
  if (free_op_nodes_.empty()) {
    ops_.emplace(op->id, op);
    return;
  }
  OpsNode node = std::move(free_op_nodes_.back());
  free_op_nodes_.pop_back();
  node.key() = op->id;
  node.mapped() = op;
  ops_.insert(std::move(node));
}

void WorkerImpl::UntrackOpLocked(uint64_t id) {
  OpsNode node = ops_.extract(id);
  if (node.empty()) return;
  if (ops_.empty()) {
    counters_->busy_ns.fetch_add(
        std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now() - busy_since_).count(),
        std::memory_order_relaxed);
  }
  node.mapped().reset();
  if (free_op_nodes_.size() < kMaxFreeOpNodes) free_op_nodes_.push_back(std::move(node));
}

WorkerImpl::PushSent* WorkerImpl::NewPushSentLocked(std::shared_ptr<Op> op, uint32_t part,
                                                    uint32_t server) {
  PushSent* sent;
  if (push_sent_free_.empty()) {
    push_sent_all_.push_back(std::make_unique<PushSent>());
    sent = push_sent_all_.back().get();
    // Room to give every record back without growing in PushDone.
    push_sent_free_.reserve(push_sent_all_.size());
  } else {
    sent = push_sent_free_.back();
    push_sent_free_.pop_back();
  }
  sent->op = std::move(op);
  sent->part = part;
  sent->server = server;
  return sent;
}

void WorkerImpl::Issue(IssueBatch batch) {
  if (batch.requests == 0) return;  // not the issuer (TakeIssueLocked)
  for (;;) {
    for (Outgoing& o : *batch.items) {
      if (o.sent == nullptr) {  // a kRecover: nothing waits on it but its payload's owner
        lanes_.push().Send(o.peer, o.header, o.payload,
                         [owned = std::move(o.owned)](const Status&) {});
        continue;
      }
      counters_->pushed_by_dtype.Add(o.header.dtype, o.header.payload_bytes);
      auto done = [this, sent = o.sent](const Status& s) { PushDone(sent, s); };
      // What std::function keeps inline (libstdc++: two words, trivially copyable): a push
      // allocates no callback, on whichever thread issues it.
      static_assert(sizeof(done) <= 2 * sizeof(void*) &&
                    std::is_trivially_copyable_v<decltype(done)>);
      lanes_.push().Send(o.peer, o.header, o.payload, std::move(done));
    }
    batch.items->clear();
    if (issue_requests_.fetch_sub(batch.requests, std::memory_order_acq_rel) == batch.requests) {
      return;  // issuing_ is empty again, for the next issuer
    }
    // Others pumped while we sent: everything they queued is in to_issue_, and each of them
    // counted a request under mu_, so the count read under mu_ covers exactly that. The
    // emptied vector goes back with its capacity: no allocation per batch.
    MutexLock lock(mu_);
    batch.items->swap(to_issue_);
    batch.requests = issue_requests_.load(std::memory_order_acquire);
  }
}

void WorkerImpl::PushDone(PushSent* sent, const Status& s) {
  IssueBatch batch;
  std::shared_ptr<Op> op;  // released after the lock
  {
    MutexLock lock(mu_);
    op = std::move(sent->op);
    const uint32_t part = sent->part, server = sent->server;
    push_sent_free_.push_back(sent);
    if (!op->finished) op->t_pushed = Clock::now();
    ReleaseCreditLocked(op, part, /*left=*/s.ok());
    op->sending--;
    if (!s.ok() && !NoteServerFailureLocked(server, s)) AbandonLocked(*op, s);
    TryFinishLocked(*op);
    PumpLocked();
    TakeIssueLocked(&batch);
  }
  Issue(std::move(batch));
}

void WorkerImpl::AnsweredLocked(const std::shared_ptr<Op>& op, uint32_t part) {
  const bool lead_back = op->parts[part] == Op::Part::kLeft;
  ReleaseCreditLocked(op, part, /*left=*/false);  // the pull may overtake its push's completion
  op->parts[part] = Op::Part::kDone;
  op->outstanding--;
  if (!lead_back) op->bytes_ahead -= PartBytes(*op, part);
  ReleaseHeldLocked(op);
}

bool WorkerImpl::AheadUntilSent(const TensorState& t, uint32_t part) {
  if (!t.acks_behind_data) return false;
  const layout::Role role = RoleIn(t, part);
  return role.push && !role.pull;
}

bool WorkerImpl::OverLead(const Op& op, uint64_t bytes) {
  return op.bytes_ahead > 0 && op.bytes_ahead + bytes > op.max_ahead;
}

void WorkerImpl::AddAheadLocked(Op& op, uint64_t bytes) {
  op.bytes_ahead += bytes;
  if (op.bytes_ahead > counters_->peak_bytes_ahead.load(std::memory_order_relaxed)) {
    counters_->peak_bytes_ahead.store(op.bytes_ahead, std::memory_order_relaxed);
  }
}

uint64_t WorkerImpl::PartBytes(const Op& op, uint32_t part) const {
  const TensorState& t = *op.tensor;
  return RoleIn(t, part).push ? t.parts[part].count * DataTypeSize(t.wire) : 0;
}

layout::Role WorkerImpl::RoleIn(const TensorState& t, uint32_t part) {
  if (!t.roles.empty()) return t.roles[part];
  const uint64_t at = t.parts[part].offset;
  return layout::Role{true, true, at, at};
}

void WorkerImpl::ReleaseHeldLocked(const std::shared_ptr<Op>& op) {
  while (!op->held.empty()) {
    const auto [seq, part] = op->held.front();
    const uint64_t bytes = PartBytes(*op, part);
    if (OverLead(*op, bytes)) break;
    AddAheadLocked(*op, bytes);
    op->held.pop_front();
    pending_.push(Pending{op->options.priority, seq, op, part, /*counted=*/true});
  }
}

void WorkerImpl::ReleaseCreditLocked(const std::shared_ptr<Op>& op, uint32_t part, bool left) {
  if (op->parts[part] != Op::Part::kSent) return;
  const uint64_t bytes = PartBytes(*op, part);
  bytes_in_flight_ -= bytes;
  if (left && AheadUntilSent(*op->tensor, part)) {
    op->parts[part] = Op::Part::kLeft;
    op->bytes_ahead -= bytes;
    ReleaseHeldLocked(op);
  } else {
    op->parts[part] = Op::Part::kPushed;
  }
}

void WorkerImpl::RecordFailureLocked(Op& op, const Status& s) {
  if (op.failure.ok()) op.failure = s;
}

void WorkerImpl::AbandonLocked(Op& op, const Status& s) {
  RecordFailureLocked(op, s);
  op.abandoned = true;
}

void WorkerImpl::TryFinishLocked(Op& op) {
  if (op.finished || !op.started) return;
  // Waiting for the scheduler's word on a lost endpoint: the op's own error may name the
  // wrong peer (see OnDataPeerFailed).
  if (op.abandoned && verdict_.pending()) return;
  // A hierarchical op also waits for its host job, which writes the tensor until it ends.
  if (op.host && !op.host_done) return;
  if ((op.outstanding == 0 || op.abandoned) && op.sending == 0 && op.receiving == 0) {
    FinishLocked(op, op.failure);
  }
}

void WorkerImpl::FinishLocked(Op& op, const Status& s) {
  if (op.finished) return;
  op.finished = true;
  op.t_done = Clock::now();
  if (s.ok() && !op.owned && !op.sits_out) {  // fused ops count when their members are unpacked
    counters_->push_pulls.fetch_add(1, std::memory_order_relaxed);
    counters_->bytes_reduced.fetch_add(op.data.size(), std::memory_order_relaxed);
  }
  if (s.ok() && !op.sits_out && op.tensor) {
    counters_->reduced_by_dtype.Add(op.tensor->dtype, op.data.size());
    const Clock::time_point began =
        op.t_first_issue != Clock::time_point{} ? op.t_first_issue : op.t_call;
    counters_->round_seconds.Observe(std::chrono::duration<double>(op.t_done - began).count());
  }
  UntrackOpLocked(op.id);  // callers hold a reference to `op`
  Complete(op, s);
  // Its parts' vector goes back to its tensor, for the next op: nothing reads an ended op's
  // parts, unless the transport may still report on one (a failed job's forced end).
  if (op.tensor && op.sending == 0 && op.receiving == 0) {
    if (op.parts.capacity() > op.tensor->spare_parts.capacity()) {
      op.parts.clear();
      op.tensor->spare_parts.swap(op.parts);
    }
    if (op.held.capacity() > op.tensor->spare_held.capacity()) {
      op.held.clear();
      op.tensor->spare_held.swap(op.held);
    }
  }
  if (op.started) {
    op.tensor->busy = false;
    StartNextLocked(*op.tensor);
  }
}

void WorkerImpl::Complete(Op& op, const Status& s) {
  {
    MutexLock lock(op.mu);
    op.done = true;
    op.status = s;
    op.cv.NotifyAll();
  }
  if (op.local) op.local->Wake();  // a waiter may sleep on the segment (LocalReduce::Wait)
}

}  // namespace gradlink
