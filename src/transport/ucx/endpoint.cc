// UcxLane's endpoints: one Peer per Connect(), failed once and for good (the failure sticks),
// closed by force and outside any ucp callback.
#include <ucp/api/ucp.h>

#include <memory>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "common/log.h"
#include "transport/ucx/context.h"
#include "transport/ucx/status.h"
#include "transport/ucx/ucx_lane.h"
#include "wire/frame.h"

namespace gradlink::transport::ucx {

Result<PeerId> UcxLane::ConnectNow(std::span<const std::byte> remote_address,
                                   std::string peer_name) {
  if (stopping_) return Aborted("ucx lane '" + name_ + "' is stopped");
  if (remote_address.empty()) {
    return InvalidArgument("ucx lane '" + name_ + "': empty address for '" + peer_name + "'");
  }
  const PeerAddress remote = SplitSegments(remote_address);
  GL_RETURN_IF_ERROR(CheckSegments(context_->segments, remote.segments,
                                   peer_name + " (from ucx lane '" + name_ + "')"));
  auto peer = std::make_unique<Peer>();
  peer->lane = this;
  peer->id = static_cast<PeerId>(peers_.size());
  peer->name = std::move(peer_name);

  ucp_ep_params_t ep{};
  ep.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE |
                  UCP_EP_PARAM_FIELD_ERR_HANDLER | UCP_EP_PARAM_FIELD_NAME;
  ep.address = reinterpret_cast<const ucp_address_t*>(remote.ucx.data());
  ep.err_mode = PeerErrorMode();
  ep.err_handler.cb = &UcxLane::ErrorHandlerThunk;
  ep.err_handler.arg = peer.get();
  ep.name = peer->name.c_str();
  ucs_status_t s = ucp_ep_create(worker_, &ep, &peer->ep);
  if (s != UCS_OK) {
    return Unavailable("ucx lane '" + name_ + "': connecting to '" + peer->name +
                       "': " + UcsError(s));
  }
  PeerId id = peer->id;
  peers_.push_back(std::move(peer));
  if (auth_) {
    // Queued before anything the caller can send on this endpoint, so it goes first.
    auto proof = std::make_shared<std::vector<std::byte>>(auth_->Prove(remote_address));
    wire::Header hello;
    hello.type = wire::MsgType::kLaneHello;
    hello.payload_bytes = proof->size();
    Send(id, hello, *proof, [proof](const Status&) {});
  }
  return id;
}

Status UcxLane::PeerLostStatus(const Peer& peer, ucs_status_t s) const {
  return PeerLost("ucx lane '" + name_ + "': peer '" + peer.name + "' failed: " + UcsError(s));
}

void UcxLane::FailPeer(Peer* peer, Status status, bool close) {
  // Failed once; a peer given up (close false) is closed when UCX reports it too.
  if (peer->failed && (!peer->given_up || !close)) return;
  if (!peer->failed) {
    peer->failed = true;
    peer->failure = std::move(status);
    if (!stopping_) {
      GL_LOG(kInfo) << peer->failure.ToString();
      if (receiver_ != nullptr) receiver_->OnPeerFailed(peer->id, peer->failure);
    }
  }
  peer->given_up = !close;
  const std::vector<SendOp*> ops = peer->in_flight.snapshot();
  for (SendOp* op : ops) CompleteSend(op, peer->failure);
  if (!close) return;
  // UCX wants a failed endpoint closed by its owner; do it outside any ucp callback.
  after_progress_.push_back([this, peer] {
    if (peer->ep == nullptr) return;
    ucp_ep_h ep = peer->ep;
    peer->ep = nullptr;
    CloseEp(ep);
  });
}

void UcxLane::FailPeer(PeerId id, const Status& why) {
  // On the progress thread: the sends' callbacks run now, later sends fail at once. The
  // endpoint is not closed yet: UCX 1.13 crashed (SIGSEGV in libuct's TCP transport) in 2 of 16
  // trials when a TCP endpoint with a rendezvous waiting on a hung (SIGSTOPped) peer was
  // force-closed, and in none of 16 left open. It is closed once UCX reports the peer failed
  // (the peer exits, or resumes and is refused), like any failed one.
  Enqueue([this, id, why] {
    if (id < peers_.size()) FailPeer(peers_[id].get(), why, /*close=*/false);
  });
}

void UcxLane::CloseEp(ucp_ep_h ep) {
  // Never twice: a reply endpoint can be one of our own (UCX matched the connections), and a
  // failed peer's endpoint is closed once already.
  if (!closed_eps_.insert(ep).second) return;
  ucp_request_param_t param{};
  param.op_attr_mask =
      UCP_OP_ATTR_FIELD_FLAGS | UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
  // FORCE: do not flush towards a peer that is dead or hostile; pending requests are purged.
  param.flags = UCP_EP_CLOSE_FLAG_FORCE;
  param.cb.send = &UcxLane::CloseCallbackThunk;
  param.user_data = this;
  ucs_status_ptr_t r = ucp_ep_close_nbx(ep, &param);
  if (r == nullptr) return;
  if (UCS_PTR_IS_ERR(r)) {
    GL_LOG(kDebug) << "ucx lane '" << name_ << "': ucp_ep_close_nbx: "
                   << UcsError(UCS_PTR_STATUS(r));
    return;
  }
  ++closes_in_flight_;
}

void UcxLane::CloseCallbackThunk(void* request, ucs_status_t /*status*/, void* user_data) {
  ucp_request_free(request);
  --static_cast<UcxLane*>(user_data)->closes_in_flight_;
}

void UcxLane::ErrorHandlerThunk(void* arg, ucp_ep_h ep, ucs_status_t status) {
  auto* peer = static_cast<Peer*>(arg);
  if (peer->ep != ep) return;  // already closed by us
  peer->lane->FailPeer(peer, peer->lane->PeerLostStatus(*peer, status));
}

}  // namespace gradlink::transport::ucx
