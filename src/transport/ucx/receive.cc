// UcxLane's receive path: validating an incoming active message, handing its payload to the
// Receiver (copied from UCX's eager buffer, or received by rendezvous), and rejecting bad frames.
#include <ucp/api/ucp.h>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "common/log.h"
#include "transport/ucx/status.h"
#include "transport/ucx/ucx_lane.h"
#include "wire/frame.h"

namespace gradlink::transport::ucx {
namespace {

// Bounce buffers kept per distinct payload size.
constexpr size_t kBouncePoolPerSize = 16;

}  // namespace

std::unique_ptr<std::byte[]> UcxLane::TakeBounce(size_t bytes) {
  auto& free = bounce_pool_[bytes];
  if (free.empty()) return std::unique_ptr<std::byte[]>(new std::byte[bytes]);
  auto b = std::move(free.back());
  free.pop_back();
  return b;
}

void UcxLane::GiveBounce(size_t bytes, std::unique_ptr<std::byte[]> b) {
  auto& free = bounce_pool_[bytes];
  if (free.size() < kBouncePoolPerSize) free.push_back(std::move(b));
}

ucs_status_t UcxLane::OnActiveMessage(const void* header, size_t header_length, void* data,
                                      size_t length, const ucp_am_recv_param_t* param) {
  // Returning UCS_OK without receiving drops the data, rendezvous included: UCX then
  // completes the sender's request with OK.
  if (stopping_ || receiver_ == nullptr) return UCS_OK;
  if (header_length != wire::kHeaderSize || header == nullptr) {
    RejectFrame(param, "header of " + std::to_string(header_length) + " bytes");
    return UCS_OK;
  }
  Result<wire::Header> h = wire::DecodeHeader(
      std::span<const std::byte>(static_cast<const std::byte*>(header), header_length));
  if (!h.ok()) {
    RejectFrame(param, h.status().ToString());
    return UCS_OK;
  }
  if (h->payload_bytes != length) {
    RejectFrame(param, "header says " + std::to_string(h->payload_bytes) +
                           " payload bytes, frame carries " + std::to_string(length));
    return UCS_OK;
  }
  ucp_ep_h reply_ep =
      (param->recv_attr & UCP_AM_RECV_ATTR_FIELD_REPLY_EP) ? param->reply_ep : nullptr;
  if (h->type == wire::MsgType::kLaneHello) {
    const bool eager = (param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) == 0;
    if (!auth_ || reply_ep == nullptr || !eager ||
        !auth_->Verify(address_, std::span<const std::byte>(static_cast<const std::byte*>(data),
                                                             length))) {
      RejectFrame(param, auth_ ? "lane authentication failed" : "unexpected kLaneHello");
      return UCS_OK;
    }
    authenticated_.insert(reply_ep);
    return UCS_OK;
  }
  if (auth_ && (reply_ep == nullptr || authenticated_.count(reply_ep) == 0)) {
    RejectFrame(param, "frame on a connection that has not authenticated");
    return UCS_OK;
  }
  frames_received_.fetch_add(1, std::memory_order_relaxed);

  if ((param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) == 0) {
    // Eager: the whole payload is in UCX's buffer now.
    Result<uint64_t> copied = receiver_->OnFrame(
        *h, std::span<const std::byte>(static_cast<const std::byte*>(data), length));
    if (!copied.ok()) {
      GL_LOG(kDebug) << "ucx lane '" << name_ << "': receiver dropped a frame: "
                     << copied.status().ToString();
      return UCS_OK;
    }
    bytes_received_.fetch_add(length, std::memory_order_relaxed);
    bytes_copied_eager_.fetch_add(*copied, std::memory_order_relaxed);
    return UCS_OK;
  }

  Result<std::span<std::byte>> dest = receiver_->OnHeader(*h);
  if (!dest.ok()) {
    GL_LOG(kDebug) << "ucx lane '" << name_ << "': receiver dropped a frame: "
                   << dest.status().ToString();
    return UCS_OK;
  }
  if (dest->size() != length) {
    receiver_->OnReceiveFailed(*h, WrongSpan(dest->size(), length));
    return UCS_OK;
  }

  // Rendezvous: UCX receives the payload later, into the span (or a bounce buffer).
  GL_LOG(kDebug) << "ucx lane '" << name_ << "': rendezvous receive of " << length
                 << " bytes";
  RecvOp* op = NewRecvOp();
  op->lane = this;
  op->header = *h;
  op->dest = *dest;
  op->reply_ep = reply_ep;
  void* target = dest->data();
  if (!receiver_->KeepsBuffer(*h)) {
    op->bounce = TakeBounce(length);
    target = op->bounce.get();
  }
  ucp_request_param_t rp{};
  rp.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA |
                    UCP_OP_ATTR_FIELD_MEMORY_TYPE;
  rp.cb.recv_am = &UcxLane::RecvCallbackThunk;
  rp.user_data = op;
  rp.memory_type = UCS_MEMORY_TYPE_HOST;
  ucs_status_ptr_t r = ucp_am_recv_data_nbx(worker_, data, target, length, &rp);
  if (r == nullptr) {
    OnRecvDone(op, UCS_OK, length);
  } else if (UCS_PTR_IS_ERR(r)) {
    OnRecvDone(op, UCS_PTR_STATUS(r), 0);
  } else {
    op->request = r;
    recvs_in_flight_.insert(op);
  }
  return UCS_OK;
}

void UcxLane::RejectFrame(const ucp_am_recv_param_t* param, const std::string& why) {
  protocol_errors_.fetch_add(1, std::memory_order_relaxed);
  ucp_ep_h reply_ep = (param->recv_attr & UCP_AM_RECV_ATTR_FIELD_REPLY_EP) ? param->reply_ep
                                                                           : nullptr;
  // Every bad frame is counted; only the first few and then every 1000th are logged, so a
  // peer cannot flood the log.
  const uint64_t n = protocol_errors_.load(std::memory_order_relaxed);
  if (n <= 10 || n % 1000 == 0) {
    GL_LOG(kWarn) << "ucx lane '" << name_ << "': dropping bad frame #" << n << " (" << why
                  << "); "
                  << (reply_ep != nullptr ? "closing its connection"
                                          : "sender gave no reply endpoint to close");
  }
  if (reply_ep == nullptr) return;
  // UCX may have matched the sender's endpoint with one we created by Connect(): then the
  // connection is that peer's, and it fails like any other.
  for (auto& peer : peers_) {
    if (peer->ep == reply_ep) {
      FailPeer(peer.get(), ProtocolError("ucx lane '" + name_ + "': peer '" + peer->name +
                                         "' sent a bad frame (" + why + ")"));
      return;
    }
  }
  reply_eps_to_close_.insert(reply_ep);  // a set: several bad frames, one close
}

void UcxLane::OnRecvDone(RecvOp* op, ucs_status_t status, size_t length) {
  recvs_in_flight_.erase(op);
  if (receiver_ != nullptr) {
    if (status == UCS_OK && length == op->dest.size()) {
      bytes_received_.fetch_add(length, std::memory_order_relaxed);
      if (op->bounce) {
        if (length > 0) std::memcpy(op->dest.data(), op->bounce.get(), length);
        bytes_copied_bounce_.fetch_add(length, std::memory_order_relaxed);
        GiveBounce(length, std::move(op->bounce));
      }
      receiver_->OnPayload(op->header, op->dest);
    } else if (status == UCS_OK) {
      receiver_->OnReceiveFailed(
          op->header, ProtocolError("ucx lane '" + name_ + "': received " +
                                    std::to_string(length) + " of " +
                                    std::to_string(op->dest.size()) + " payload bytes"));
    } else if (stopping_) {
      receiver_->OnReceiveFailed(op->header, Aborted("ucx lane '" + name_ + "' stopped"));
    } else {
      receiver_->OnReceiveFailed(
          op->header,
          PeerLost("ucx lane '" + name_ + "': receiving a payload failed: " + UcsError(status)));
    }
  }
  FreeRecvOp(op);
}

UcxLane::RecvOp* UcxLane::NewRecvOp() {
  if (free_recv_ops_.empty()) return new RecvOp;
  RecvOp* op = free_recv_ops_.back().release();
  free_recv_ops_.pop_back();
  return op;
}

void UcxLane::FreeRecvOp(RecvOp* op) {
  // As many as were in flight at once, at most a bound's worth.
  constexpr size_t kMaxFreeRecvOps = 1024;
  if (op->bounce) GiveBounce(op->dest.size(), std::move(op->bounce));
  if (stopping_ || free_recv_ops_.size() >= kMaxFreeRecvOps) {
    delete op;
    return;
  }
  op->request = nullptr;
  op->reply_ep = nullptr;
  op->dest = {};
  op->link = {};
  op->lane.store(nullptr, std::memory_order_relaxed);
  free_recv_ops_.emplace_back(op);
}

void UcxLane::RecvCallbackThunk(void* request, ucs_status_t status, size_t length,
                                void* user_data) {
  auto* op = static_cast<RecvOp*>(user_data);
  ucp_request_free(request);
  UcxLane* lane = op->lane.load();
  if (lane == nullptr) {
    delete op;  // given up by a stopped lane
    return;
  }
  lane->OnRecvDone(op, status, length);
}

ucs_status_t UcxLane::AmCallbackThunk(void* arg, const void* header, size_t header_length,
                                      void* data, size_t length,
                                      const ucp_am_recv_param_t* param) {
  return static_cast<UcxLane*>(arg)->OnActiveMessage(header, header_length, data, length,
                                                     param);
}

}  // namespace gradlink::transport::ucx
