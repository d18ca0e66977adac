// The server's data plane: pushes in, sums, results and refusals out.
//
// A push lands straight in its partition's staging buffer (OnPushHeader picks it); once its
// payload is there the partition's owner thread sums whatever is ready (RunEngine): the push
// lane's progress thread for partitions up to kInlineSumBytes, else the engine chosen by key.
// Each completed round goes back to every participant on its pull lane, and a refused push is
// answered with a kDataError naming why. Threads: both lanes' progress threads and the
// engines; the partitions' own locks order what they share (server/partition_state.h).
#include <cstring>

#include "common/log.h"
#include "common/naming.h"
#include "server/server_impl.h"

namespace gradlink {

using server::PartitionState;
using transport::PeerId;
using wire::MsgType;

// Sends to worker `rank`'s pull lane; completes `done` with kPeerLost if it is unreachable.
void ServerImpl::SendToWorker(uint32_t rank, const wire::Header& h,
                              std::span<const std::byte> payload, transport::SendCallback done) {
  if (!worker_peers_[rank]) {
    done(PeerLost("worker " + std::to_string(rank) + " is unreachable"));
    return;
  }
  lanes_.reply().Send(*worker_peers_[rank], h, payload, std::move(done));
}

PartitionState* ServerImpl::Find(uint64_t key, uint32_t partition) {
  ReaderLock lock(parts_mu_);
  auto it = parts_.find({key, partition});
  return it == parts_.end() ? nullptr : it->second.get();
}

// Small partitions are summed on the push lane's progress thread, where their pushes land
// (see kInlineSumBytes); the others on an engine thread chosen by key.
bool ServerImpl::SummedInline(const PartitionState& p) const {
  return p.count() * DataTypeSize(p.dtype()) <= kInlineSumBytes;
}

size_t ServerImpl::EngineIndex(const PartitionState& p) const {
  const uint64_t h = (p.key() ^ (uint64_t{p.partition()} * 0x9E3779B97F4A7C15ull));
  return (h >> 17) % engines_.size();
}

WorkQueue& ServerImpl::EngineFor(const PartitionState& p) { return *engines_[EngineIndex(p)]; }

std::string ServerImpl::DescribeOwner(uint64_t key, uint32_t partition) {
  const PartitionState* p = Find(key, partition);
  if (p == nullptr) return "key " + KeyHex(key) + " partition " + std::to_string(partition);
  return "'" + p->name() + "' partition " + std::to_string(partition) + " (" +
         (SummedInline(*p) ? std::string("push lane")
                           : "engine " + std::to_string(EngineIndex(*p))) + ")";
}

// Runs `fn` on the one thread that sums `p` (its only writer).
void ServerImpl::RunOnOwner(const PartitionState& p, std::function<void()> fn) {
  if (SummedInline(p)) {
    lanes_.push().Defer(std::move(fn));
  } else {
    EngineFor(p).Post(std::move(fn));
  }
}

void ServerImpl::Answer(uint32_t rank, const wire::Header& push, const Status& error) {
  wire::Header h;
  h.type = MsgType::kDataError;
  h.job = job_hash_;
  h.sender = id_;
  h.key = push.key;
  h.partition = push.partition;
  h.round = push.round;
  h.code = static_cast<uint8_t>(error.code());
  h.cookie = push.cookie;
  auto text = std::make_shared<std::vector<std::byte>>(wire::EncodeText(error.message()));
  h.payload_bytes = text->size();
  SendToWorker(rank, h, *text, [text](const Status&) {});
}

// Where a push's (or a recovery's) payload lands; *found: its partition, when there is one
// (a partition leaves parts_ only when its key is retired, and lives kRetiredGrace longer: the
// pointer stays good through the push's callbacks).
Result<std::span<std::byte>> ServerImpl::OnPushHeader(const wire::Header& h, PartitionState** found) {
  const bool recover = h.type == MsgType::kRecover;
  if ((h.type != MsgType::kPush && !recover) || h.job != job_hash_ ||
      h.sender >= num_workers_) {
    protocol_errors_++;
    GL_LOG(kWarn) << "server " << id_ << ": dropped a frame of type "
                  << static_cast<int>(h.type) << " from sender " << h.sender;
    return ProtocolError("unexpected frame on the push lane");
  }
  PartitionState* p = Find(h.key, h.partition);
  if (p == nullptr) {
    protocol_errors_++;
    Status s = ProtocolError("server " + std::to_string(id_) + " does not own key " +
                             KeyHex(h.key) + " partition " + std::to_string(h.partition));
    Answer(h.sender, h, s);
    return s;
  }
  *found = p;
  if (recover) {
    auto span = p->BeginRecover(h);
    if (!span.ok()) {
      protocol_errors_++;
      Answer(h.sender, h, span.status());
    }
    return span;
  }
  bool run_engine = false;
  auto span = p->BeginPush(h, &run_engine);
  if (!span.ok()) {
    if (span.status().code() == Code::kMismatch) {
      mismatches_++;
    } else {
      protocol_errors_++;
      Answer(h.sender, h, span.status());
    }
    if (run_engine) RunOnOwner(*p, [this, p] { RunEngine(p); });
  }
  return span;
}

void ServerImpl::OnPushPayload(const wire::Header& h, bool ok) {
  PartitionState* p = Find(h.key, h.partition);
  if (p != nullptr) OnPushPayload(p, h, ok);
}

void ServerImpl::OnPushPayload(PartitionState* p, const wire::Header& h, bool ok) {
  const bool recover = h.type == MsgType::kRecover;
  const bool runnable = recover ? p->EndRecover(h.sender, ok) : p->EndPush(h.sender, ok);
  if (ok && !recover) {
    bytes_reduced_ += h.payload_bytes;
    summed_by_dtype_.Add(p->dtype(), h.payload_bytes);
  }
  // Each engine wake-up is a context switch; on small partitions those are most of a round.
  if (!runnable) return;
  if (SummedInline(*p)) {
    RunEngine(p);  // we are on the push lane's progress thread: its owner
  } else {
    EngineFor(*p).Post([this, p] { RunEngine(p); });
  }
}

// On p's engine thread: sum, and send every round this completes.
void ServerImpl::RunEngine(PartitionState* p) {
  while (std::optional<server::Completion> c = p->Progress()) {
    rounds_completed_++;
    wire::Header h;
    h.job = job_hash_;
    h.sender = id_;
    h.key = p->key();
    h.partition = p->partition();
    h.round = c->round;
    std::shared_ptr<std::vector<std::byte>> text;
    std::span<const std::byte> payload = c->result;
    if (c->status.ok()) {
      h.type = MsgType::kPullResponse;
      // Rounded up, so that a round summed within a microsecond still reports its server
      // time (0 on the wire means none).
      const int64_t ns =
          std::chrono::duration_cast<std::chrono::nanoseconds>(c->server_time).count();
      const uint64_t micros = (static_cast<uint64_t>(std::max<int64_t>(0, ns)) + 999) / 1000;
      h.server_time = wire::EncodeServerTime(std::max<uint64_t>(1, micros));
      h.dtype = static_cast<uint8_t>(p->dtype());
      h.count = p->count();
    } else {
      h.type = MsgType::kDataError;
      h.code = static_cast<uint8_t>(c->status.code());
      text = std::make_shared<std::vector<std::byte>>(wire::EncodeText(c->status.message()));
      payload = *text;
    }
    const uint32_t slot = c->slot;
    const std::vector<uint32_t>& to = p->participants();
    for (uint32_t i = 0; i < to.size(); ++i) {
      if (!c->absent.empty() && c->absent[i]) continue;  // it joined and sat the round out
      h.cookie = c->cookies[i];
      // A participant that receives nothing (a contributor to a relay, or to another rank's
      // reduce-scatter segment) gets a reply of 0 elements: its round is over.
      const bool empty = c->status.ok() && !p->receives(i);
      h.count = empty ? 0 : c->status.ok() ? p->count() : 0;
      h.payload_bytes = empty ? 0 : payload.size();
      const std::span<const std::byte> body = empty ? std::span<const std::byte>() : payload;
      if (text) {  // an error's text lives until its sends are done
        SendToWorker(to[i], h, body, [this, p, slot, text](const Status& s) {
          ReplySent(p, slot, s);
        });
      } else {
        // Two words of capture (the slot in the pointer's low bit): std::function keeps
        // them inline, so a reply allocates no callback.
        const uintptr_t tagged = reinterpret_cast<uintptr_t>(p) | slot;
        sent_by_dtype_.Add(h.dtype, body.size());
        SendToWorker(to[i], h, body, [this, tagged](const Status& s) {
          ReplySent(reinterpret_cast<PartitionState*>(tagged & ~uintptr_t{1}),
                    static_cast<uint32_t>(tagged & 1), s);
        });
      }
    }
  }
}

static_assert(alignof(server::PartitionState) >= 2, "RunEngine tags a PartitionState* with a slot bit");

// One reply of `p`'s round in `slot` has been sent (or failed).
void ServerImpl::ReplySent(PartitionState* p, uint32_t slot, const Status& s) {
  if (!s.ok()) GL_LOG(kInfo) << "server " << id_ << ": pull response failed: " << s.ToString();
  if (p->SendDone(slot) && p->WaitsForSlot(slot)) {
    RunOnOwner(*p, [this, p] { RunEngine(p); });
  }
}

// ---- The lanes' receivers -----------------------------------------------------------------------

Result<std::span<std::byte>> ServerImpl::PushReceiver::OnHeader(const wire::Header& h) {
  PartitionState* p = nullptr;
  return s_->OnPushHeader(h, &p);
}

void ServerImpl::PushReceiver::OnPayload(const wire::Header& h, std::span<std::byte>) {
  s_->OnPushPayload(h, true);
}

// An eager push, whole: its partition is looked up once, not again for the payload.
Result<uint64_t> ServerImpl::PushReceiver::OnFrame(const wire::Header& h,
                                                   std::span<const std::byte> payload) {
  PartitionState* p = nullptr;
  Result<std::span<std::byte>> dest = s_->OnPushHeader(h, &p);
  if (!dest.ok()) return dest.status();
  if (dest->size() != payload.size()) {
    OnReceiveFailed(h, transport::WrongSpan(dest->size(), payload.size()));
    return uint64_t{0};
  }
  if (!payload.empty()) std::memcpy(dest->data(), payload.data(), payload.size());
  s_->OnPushPayload(p, h, true);
  return uint64_t{payload.size()};
}

void ServerImpl::PushReceiver::OnReceiveFailed(const wire::Header& h, const Status& st) {
  GL_LOG(kWarn) << "server " << s_->id_ << ": receiving a push failed: " << st.ToString();
  s_->OnPushPayload(h, false);
}

// Staging buffers live as long as their partition, and Stop() leaks the partitions when the
// lane abandoned a receive: pushes need no bounce buffer (KeepsBuffersIfAbandoned).

void ServerImpl::PushReceiver::OnPeerFailed(PeerId peer, const Status& st) {
  // A worker's pull endpoint failed. The scheduler decides whether the job is lost; later
  // sends to that worker fail on their own.
  s_->peers_lost_++;
  GL_LOG(kInfo) << "server " << s_->id_ << ": peer " << peer << " failed: " << st.ToString();
}

Result<std::span<std::byte>> ServerImpl::PullReceiver::OnHeader(const wire::Header&) {
  s_->protocol_errors_++;
  return ProtocolError("the server's pull lane accepts no frames");
}

void ServerImpl::PullReceiver::OnPeerFailed(PeerId peer, const Status& st) {
  s_->peers_lost_++;
  GL_LOG(kInfo) << "server " << s_->id_ << ": peer " << peer << " failed: " << st.ToString();
}

}  // namespace gradlink
