// The lanes' receive callbacks (worker_impl.h): a pull reply is matched to its op and written into
// the caller's tensor; a refusal (kDataError) fails the op, naming the server.
#include "worker/worker_impl.h"

#include <algorithm>
#include <chrono>
#include <cstring>

namespace gradlink {

using transport::Lane;
using transport::PeerId;
using wire::MsgType;

Status WorkerImpl::CheckPullFrame(const wire::Header& h) {
  if (h.job != job_hash_ ||
      (h.type != MsgType::kPullResponse && h.type != MsgType::kDataError)) {
    protocol_errors_++;
    return ProtocolError("unexpected frame on the pull lane");
  }
  return Status::Ok();
}

Result<std::span<std::byte>> WorkerImpl::OnHeader(const wire::Header& h) {
  reply_kept_ = false;
  GL_RETURN_IF_ERROR(CheckPullFrame(h));
  MutexLock lock(mu_);
  return OnHeaderLocked(h);
}

void WorkerImpl::OnPayload(const wire::Header& h, bool ok, const Status& why) {
  IssueBatch batch;
  {
    MutexLock lock(mu_);
    OnPayloadLocked(h, ok, why, &batch);
  }
  Issue(std::move(batch));
}

Result<uint64_t> WorkerImpl::OnFrame(const wire::Header& h, std::span<const std::byte> payload) {
  reply_kept_ = false;
  GL_RETURN_IF_ERROR(CheckPullFrame(h));
  IssueBatch batch;
  {
    // One acquisition for the whole reply: where it lands, the copy, what it completes.
    MutexLock lock(mu_);
    Result<std::span<std::byte>> dest = OnHeaderLocked(h);
    if (!dest.ok()) return dest.status();
    if (dest->size() == payload.size()) {
      if (!payload.empty()) std::memcpy(dest->data(), payload.data(), payload.size());
      OnPayloadLocked(h, true, Status::Ok(), &batch);
    } else {
      OnPayloadLocked(h, false, transport::WrongSpan(dest->size(), payload.size()), &batch);
    }
  }
  Issue(std::move(batch));
  return uint64_t{payload.size()};
}

Result<std::span<std::byte>> WorkerImpl::OnHeaderLocked(const wire::Header& h) {
  // A server declared lost that comes back (it was stopped, not killed) is fenced: its
  // partitions are summed elsewhere now.
  if (directory_.lost(h.sender)) {
    return Aborted("reply from server " + std::to_string(h.sender) + ", which was declared lost");
  }
  auto it = ops_.find(h.cookie);
  if (it == ops_.end()) return Aborted("late reply for a finished push_pull");
  Op& op = *it->second;
  const TensorState& t = *op.tensor;
  if (op.abandoned) return Aborted("reply for an abandoned push_pull");
  // A partition moved to a server that joined (rebalancing) is fenced on its old owner, which is
  // still up: the new one answers it, from what the workers reported (as after a loss).
  if (h.partition < t.parts.size() && t.parts[h.partition].server != h.sender) {
    return Aborted("reply from server " + std::to_string(h.sender) + " for partition " +
                   std::to_string(h.partition) + ", which moved to server " +
                   std::to_string(t.parts[h.partition].server));
  }
  // The pull may overtake the completion of its own push (kSent) but never precede the push.
  if (h.key != t.key || h.partition >= op.parts.size() || h.round != op.round ||
      (op.parts[h.partition] != Op::Part::kSent && op.parts[h.partition] != Op::Part::kPushed &&
       op.parts[h.partition] != Op::Part::kLeft)) {
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
  const uint64_t size = DataTypeSize(t.wire);
  const layout::Role role = RoleIn(t, h.partition);
  // A partition this worker only contributes to is answered with 0 elements.
  if (h.dtype != static_cast<uint8_t>(t.wire) || h.count != (role.pull ? plan.count : 0)) {
    protocol_errors_++;
    return ProtocolError("pull reply has the wrong shape");
  }
  op.t_arrived = Clock::now();
  op.t_server = std::max<Clock::duration>(
      op.t_server, std::chrono::microseconds(wire::DecodeServerTime(h.server_time)));
  op.receiving++;
  // A hierarchical op's sum lands where its partial was pushed from: the host's segment.
  if (!op.host && !role.pull) return std::span<std::byte>();
  if (KeepsResults(t)) {
    TensorState& kept = *op.tensor;
    if (kept.results.size() != t.parts.size()) {
      kept.results.resize(t.parts.size());
      kept.result_round.assign(t.parts.size(), TensorState::kNoResult);
      kept.receiving_from.assign(t.parts.size(), 0);
    }
    std::vector<std::byte>& buf = kept.results[h.partition];
    buf.resize(plan.count * size);
    // Overwritten now: a receive that fails part way leaves no result (OnPayload).
    kept.result_round[h.partition] = TensorState::kNoResult;
    kept.receiving_from[h.partition] = h.sender + 1;
    reply_kept_ = true;
    return std::span<std::byte>(buf);
  }
  if (op.host) return op.partial[h.partition];
  return op.data.subspan(role.out_offset * size, plan.count * size);
}

std::string WorkerImpl::DescribePending(const Op& op) {
  MutexLock lock(mu_);
  if (op.finished) return "";
  if (!op.started) return "; not started (it waits for its key's plan or its tensor's op before)";
  static constexpr const char* kState[] = {"queued", "sending", "pushed", "answered"};
  std::string out;
  uint32_t listed = 0, waiting = 0;
  const TensorState& t = *op.tensor;
  for (uint32_t p = 0; p < op.parts.size(); ++p) {
    if (op.parts[p] == Op::Part::kDone) continue;
    ++waiting;
    if (listed++ == 8) continue;
    out += (out.empty() ? "" : ", ") + std::string("partition ") + std::to_string(p) + " (" +
           kState[static_cast<int>(op.parts[p])] + ") on " +
           directory_.Name(p < t.parts.size() ? t.parts[p].server : 0);
  }
  std::string tail = "; waiting for " + std::to_string(waiting) + " partition(s)" +
                     (out.empty() ? "" : ": " + out) + (waiting > 8 ? ", ..." : "");
  if (op.host && !op.host_done) tail += "; its host's sum (hierarchical) not over";
  return tail + "; " + std::to_string(op.receiving) + " replies being received";
}

bool WorkerImpl::KeepsResults(const TensorState& t) const {
  return directory_.failover() && t.spec.is_sum() && !t.local.has_value();
}

void WorkerImpl::OnPayloadLocked(const wire::Header& h, bool ok, const Status& why,
                                 IssueBatch* batch) {
  // A reply from a server declared lost was written into a buffer given up then
  // (OnServerLost), and its op no longer counts it; a refusal from it counts for nothing.
  bool from_lost = directory_.lost(h.sender);
  auto it = ops_.find(h.cookie);
  if (it == ops_.end()) return;
  std::shared_ptr<Op> op = it->second;
  // Likewise a reply from a server the partition moved away from (ReplanLocked).
  if (h.partition < op->tensor->parts.size() &&
      op->tensor->parts[h.partition].server != h.sender) {
    from_lost = true;
  }
  if (from_lost && h.type != MsgType::kDataError) return;
  op->receiving--;
  if (ok && h.type == MsgType::kPullResponse) {
    counters_->pulled_by_dtype.Add(h.dtype, h.payload_bytes);
  }
  if (from_lost) {
    error_text_.erase({h.cookie, h.partition});
    TryFinishLocked(*op);
    return;
  }
  if (KeepsResults(*op->tensor) && h.partition < op->tensor->receiving_from.size()) {
    op->tensor->receiving_from[h.partition] = 0;
  }
  // What the host's other workers learn of this partition (hierarchical ops).
  std::optional<Code> publish;
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
    const std::string server = directory_.RecordedName(op->tensor->parts[h.partition].server);
    const Status refused(code, text + " (from " + server + ")");
    RecordFailureLocked(*op, refused);
    AnsweredLocked(op, h.partition);
    publish = code;
    // A server that lost another worker's push knows only the symptom: wait for the
    // scheduler's verdict, which names the lost member.
    if (code == Code::kPeerLost) {
      verdict_.Note(refused);
      op->abandoned = true;
    }
  } else if (!ok && h.sender < directory_.ids() &&
             (directory_.lost(h.sender) || NoteServerFailureLocked(h.sender, why))) {
    // From a server lost (or maybe lost): the partition stays pushed, to be pushed again
    // where the scheduler moves it (ReplanLocked).
  } else if (!ok) {
    // The transport's error names no peer: say whose reply was lost.
    const std::string server = directory_.RecordedName(op->tensor->parts[h.partition].server);
    const Status lost(why.code(), "worker " + std::to_string(rank_) +
                                      ": receiving the sum from " + server +
                                      " failed: " + why.message());
    RecordFailureLocked(*op, lost);
    AnsweredLocked(op, h.partition);
    publish = why.code() == Code::kOk ? Code::kInternal : why.code();
    // A broken receive is a broken connection: like an endpoint failure, it waits for the
    // scheduler's verdict, which names the cause (the server may have exited because the
    // job failed elsewhere).
    if (why.code() == Code::kPeerLost) {
      verdict_.Note(lost);
      op->abandoned = true;
    }
  } else {
    TensorState& t = *op->tensor;
    const layout::Role role = RoleIn(t, h.partition);
    if (KeepsResults(t) && (op->host || role.pull)) {
      // Whole: into the caller's tensor, or the host's entry (its partial until now).
      const std::vector<std::byte>& kept = t.results[h.partition];
      std::byte* to = op->host ? op->partial[h.partition].data()
                               : op->data.data() + role.out_offset * DataTypeSize(t.wire);
      std::memcpy(to, kept.data(), kept.size());
      t.result_round[h.partition] = h.round;
      counters_->bytes_copied_results.fetch_add(kept.size(), std::memory_order_relaxed);
    }
    AnsweredLocked(op, h.partition);
    publish = Code::kOk;
  }
  if (op->host && publish) PublishLocked(*op, h.partition, *publish);
  TryFinishLocked(*op);
  PumpLocked();
  TakeIssueLocked(batch);
}

}  // namespace gradlink
