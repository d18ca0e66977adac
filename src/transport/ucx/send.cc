// UcxLane's send path: a Send() becomes one active message, posted on the progress thread;
// its callback runs once, whether UCX completes it, fails it, or the peer or the lane goes first.
#include <ucp/api/ucp.h>

#include <span>
#include <string>
#include <utility>

#include "transport/ucx/status.h"
#include "transport/ucx/ucx_lane.h"
#include "wire/frame.h"

namespace gradlink::transport::ucx {

void UcxLane::Send(PeerId peer, const wire::Header& h, std::span<const std::byte> payload,
                   SendCallback done) {
  SendOp* op = NewSendOp();
  op->lane = this;
  op->peer = peer;
  op->payload = payload;
  op->done = std::move(done);
  if (h.payload_bytes != payload.size()) {
    op->early = InvalidArgument("ucx lane '" + name_ + "': header says " +
                                std::to_string(h.payload_bytes) + " payload bytes, span has " +
                                std::to_string(payload.size()));
  } else {
    op->header = wire::EncodeHeader(h);
  }
  PostSend(op);
}

void UcxLane::SendRawForTesting(PeerId peer, std::span<const std::byte> header_bytes,
                                std::span<const std::byte> payload, SendCallback done) {
  SendOp* op = NewSendOp();
  op->lane = this;
  op->peer = peer;
  op->payload = payload;
  op->done = std::move(done);
  op->raw_header.assign(header_bytes.begin(), header_bytes.end());
  op->raw = true;
  PostSend(op);
}

void UcxLane::PostSend(SendOp* op) {
  // Always through the queue, even on the progress thread: `done` then never runs inside the
  // caller's Send(), which callers holding locks would not expect.
  if (Enqueue([this, op] { StartSend(op); })) return;
  // Stopped for good: no progress thread will ever run `done`, so run it here, once.
  CompleteSend(op, Aborted("ucx lane '" + name_ + "' is stopped"));
  FreeSendOp(op);
}

void UcxLane::StartSend(SendOp* op) {
  Peer* peer = nullptr;
  if (op->peer < peers_.size()) peer = peers_[op->peer].get();
  Status reject = op->early;
  if (reject.ok()) {
    if (stopping_) {
      reject = Aborted("ucx lane '" + name_ + "' stopped");
    } else if (peer == nullptr) {
      reject = InvalidArgument("ucx lane '" + name_ + "': unknown peer " +
                               std::to_string(op->peer));
    } else if (peer->failed) {
      reject = peer->failure;
    }
  }
  if (!reject.ok()) {
    CompleteSend(op, reject);
    FreeSendOp(op);
    return;
  }

  ucp_request_param_t param{};
  param.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA |
                       UCP_OP_ATTR_FIELD_FLAGS | UCP_OP_ATTR_FIELD_MEMORY_TYPE;
  param.cb.send = &UcxLane::SendCallbackThunk;
  param.user_data = op;
  // REPLY gives the receiver our endpoint, so it can close it when we send garbage.
  param.flags = UCP_AM_SEND_FLAG_REPLY;
  param.memory_type = UCS_MEMORY_TYPE_HOST;
  const std::span<const std::byte> header = op->header_bytes();
  ucs_status_ptr_t r = ucp_am_send_nbx(peer->ep, kAmId, header.data(), header.size(),
                                       op->payload.data(), op->payload.size(), &param);
  if (r == nullptr) {
    OnSendDone(op, UCS_OK);
    return;
  }
  if (UCS_PTR_IS_ERR(r)) {
    OnSendDone(op, UCS_PTR_STATUS(r));
    return;
  }
  peer->in_flight.insert(op);
  sends_in_ucx_.insert(op);
}

void UcxLane::CompleteSend(SendOp* op, const Status& status) {
  if (op->done_called) return;
  op->done_called = true;
  if (op->done) op->done(status);
}

// UCX is done with `op`: completed, failed, or purged by an endpoint close.
void UcxLane::OnSendDone(SendOp* op, ucs_status_t status) {
  Peer* peer = op->peer < peers_.size() ? peers_[op->peer].get() : nullptr;
  if (peer != nullptr) peer->in_flight.erase(op);
  sends_in_ucx_.erase(op);
  if (status == UCS_OK) {
    frames_sent_.fetch_add(1, std::memory_order_relaxed);
    bytes_sent_.fetch_add(op->payload.size(), std::memory_order_relaxed);
    CompleteSend(op, Status::Ok());
  } else if (!op->done_called) {
    if (stopping_) {
      CompleteSend(op, Aborted("ucx lane '" + name_ + "' stopped"));
    } else if (IsLocalSendError(status)) {
      CompleteSend(op, LocalSendError(status, "ucx lane '" + name_ + "': send to '" +
                                                  (peer ? peer->name : std::string("?")) +
                                                  "'"));
    } else if (peer != nullptr) {
      // UCX reports a dead endpoint to the requests (often before the error handler runs); the
      // first report decides the peer's sticky status either way.
      FailPeer(peer, PeerLostStatus(*peer, status));
      CompleteSend(op, peer->failure);
    } else {
      CompleteSend(op, Internal("ucx lane '" + name_ + "': send failed: " + UcsError(status)));
    }
  }
  FreeSendOp(op);
}

UcxLane::SendOp* UcxLane::NewSendOp() {
  {
    MutexLock lock(free_sends_mu_);
    if (!free_sends_.empty()) {
      SendOp* op = free_sends_.back();
      free_sends_.pop_back();
      return op;
    }
  }
  return new SendOp;
}

void UcxLane::FreeSendOp(SendOp* op) {
  // As many as were in flight at once, up to a bound; each goes back as a fresh one would be.
  constexpr size_t kMaxFreeSendOps = 4096;
  op->done = nullptr;  // its captures (a payload's owner, an op) go now
  op->done_called = false;
  op->early = Status::Ok();
  op->raw = false;
  op->raw_header.clear();
  op->payload = {};
  op->peer_link = {};
  op->lane_link = {};
  {
    MutexLock lock(free_sends_mu_);
    if (free_sends_.size() < kMaxFreeSendOps) {
      free_sends_.push_back(op);
      return;
    }
  }
  delete op;
}

void UcxLane::SendCallbackThunk(void* request, ucs_status_t status, void* user_data) {
  auto* op = static_cast<SendOp*>(user_data);
  ucp_request_free(request);
  op->lane->OnSendDone(op, status);
}

}  // namespace gradlink::transport::ucx
