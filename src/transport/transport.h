// The message interface between gradlink processes, independent of the fabric.
//
// A Lane is one independent channel with its own progress thread (UCX: one ucp_worker). A process
// opens one lane for pushes and one for pulls so that neither waits behind the other. Messages
// are a validated wire::Header plus a payload; the receiver chooses where each payload lands
// after seeing its header, which is how pulls are written into a worker's tensor in place.
// (UCX: eager payloads are copied from UCX's buffer, rendezvous payloads land in a lane-owned
// bounce buffer first, so that a receive a stopped lane cannot cancel never writes into
// memory its owner may already have freed; unless the receiver promises to keep that memory,
// see Receiver::KeepsBuffersIfAbandoned().)
//
// Threads: Send(), Connect() and Defer() may be called from any thread. Every Receiver and
// SendCallback call runs on the lane's progress thread and must not block.
// Errors: a failed peer is sticky: OnPeerFailed() is reported once, and every pending and later
// Send() to it completes with that Status.
#pragma once

#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "gradlink/status.h"
#include "security/lane_auth.h"
#include "wire/frame.h"

namespace gradlink::transport {

// Identifies an endpoint created by Lane::Connect(); local to that lane.
using PeerId = uint32_t;

// What OnReceiveFailed() is told when a receiver's span does not fit the payload.
inline Status WrongSpan(uint64_t span_bytes, uint64_t payload_bytes) {
  return Internal("the receiver gave a span of " + std::to_string(span_bytes) +
                  " bytes for a payload of " + std::to_string(payload_bytes));
}

class Receiver {
 public:
  virtual ~Receiver() = default;

  // A frame with a valid header arrived. Return a span of exactly h.payload_bytes bytes for its
  // payload (empty when payload_bytes is 0), valid until OnPayload() or OnReceiveFailed() for
  // this frame; or an error Status to drop the frame (its payload is discarded).
  virtual Result<std::span<std::byte>> OnHeader(const wire::Header& h) = 0;

  // The payload is in the span that OnHeader() returned.
  virtual void OnPayload(const wire::Header& h, std::span<std::byte> payload) = 0;

  // Receiving the payload failed; the span OnHeader() returned is no longer used.
  virtual void OnReceiveFailed(const wire::Header& h, const Status& status) = 0;

  // The endpoint `peer` (created by Connect() on this lane) failed. Reported once.
  virtual void OnPeerFailed(PeerId peer, const Status& status) = 0;

  // A whole frame arrived at once: its payload is in the transport's memory, readable during
  // this call only (UCX: an eager message; inproc: every frame). The lane calls this instead
  // of OnHeader() and OnPayload(). The default does just what they would: OnHeader(), the
  // copy into its span, OnPayload() (or OnReceiveFailed() when the span's size is wrong). A
  // receiver overrides it to do all of that under one acquisition of its own lock. Returns the
  // payload bytes copied out of `payload`, or the error that dropped the frame (as
  // OnHeader()'s).
  virtual Result<uint64_t> OnFrame(const wire::Header& h, std::span<const std::byte> payload) {
    Result<std::span<std::byte>> dest = OnHeader(h);
    if (!dest.ok()) return dest.status();
    if (dest->size() != payload.size()) {
      OnReceiveFailed(h, WrongSpan(dest->size(), payload.size()));
      return uint64_t{0};
    }
    if (!payload.empty()) std::memcpy(dest->data(), payload.data(), payload.size());
    OnPayload(h, *dest);
    return uint64_t{payload.size()};
  }

  // True when the receiver keeps every span OnHeader() returns allocated (never freed, never
  // handed to anything else) until the process exits whenever the lane reports abandoned
  // receives (LaneStats::receives_abandoned != 0 after Stop()). Then rendezvous payloads may
  // land in those spans directly, without the bounce buffer and its copy. Called on the
  // progress thread; must not change after Start().
  virtual bool KeepsBuffersIfAbandoned() const { return false; }
  // The same, per frame: asked right after OnHeader() returned a span for `h`, on the same
  // thread, whether that span is kept so (a worker's copies of results are; its callers'
  // tensors are not).
  virtual bool KeepsBuffer(const wire::Header& /*h*/) { return KeepsBuffersIfAbandoned(); }
};

// Runs on the progress thread when the payload may be reused (or the send failed).
using SendCallback = std::function<void(const Status&)>;

struct LaneStats {
  uint64_t frames_sent = 0;
  uint64_t frames_received = 0;
  uint64_t bytes_sent = 0;
  uint64_t bytes_received = 0;
  uint64_t protocol_errors = 0;  // frames that failed validation; their connection was closed
  // Received payload bytes the lane copied into the receiver's span (UCX: out of its eager
  // buffer, or out of a rendezvous bounce buffer); for copy accounting (WorkerStats).
  uint64_t bytes_copied_eager = 0;
  uint64_t bytes_copied_bounce = 0;
  // Receives that Stop() could neither finish nor cancel (a hung peer): the fabric may still
  // write their payloads, so their memory is leaked (see Receiver::KeepsBuffersIfAbandoned).
  uint64_t receives_abandoned = 0;

  // Another lane's counters added in (a member's two lanes, MemberLanes::stats).
  LaneStats& operator+=(const LaneStats& o) {
    frames_sent += o.frames_sent;
    frames_received += o.frames_received;
    bytes_sent += o.bytes_sent;
    bytes_received += o.bytes_received;
    protocol_errors += o.protocol_errors;
    bytes_copied_eager += o.bytes_copied_eager;
    bytes_copied_bounce += o.bytes_copied_bounce;
    receives_abandoned += o.receives_abandoned;
    return *this;
  }
};

class Lane {
 public:
  virtual ~Lane() = default;

  // Opaque bytes a peer passes to Connect() to reach this lane.
  virtual std::vector<std::byte> address() const = 0;

  // Makes the lane prove membership on every endpoint it creates (a kLaneHello first) and
  // process nothing from a connection whose hello has not verified (counted as protocol
  // errors, connection closed). Without one, a kLaneHello is itself a protocol error. Call
  // before Start() and Connect().
  virtual void SetAuthenticator(std::shared_ptr<const security::LaneAuthenticator> auth) = 0;

  // Starts the progress thread. `receiver` must outlive the lane (or Stop()).
  virtual Status Start(Receiver* receiver) = 0;

  // Creates an endpoint to the lane at `remote_address`. `peer_name` appears in errors.
  virtual Result<PeerId> Connect(std::span<const std::byte> remote_address,
                                 std::string peer_name) = 0;

  // Sends `h` and `payload` (h.payload_bytes must equal payload.size()). The payload must stay
  // valid and unchanged until `done` runs. Never blocks on the network.
  virtual void Send(PeerId peer, const wire::Header& h, std::span<const std::byte> payload,
                    SendCallback done) = 0;

  // Gives up on `peer` (it was declared lost, e.g. a server whose partitions moved): its sends
  // in flight complete with `why` and later ones fail at once, so a peer that hangs holds no
  // op. The transport may still read a payload whose send it had begun (the caller's buffers
  // outlive that: a tensor), until the peer is gone; its endpoint closes once the transport
  // sees the peer fail itself. The receiver may hear of it (OnPeerFailed), as of any failure.
  virtual void FailPeer(PeerId peer, const Status& why) = 0;

  // Runs `fn` on the progress thread.
  virtual void Defer(std::function<void()> fn) = 0;

  // Stops the progress thread and closes the endpoints; pending sends complete with kAborted.
  // Idempotent; the destructor calls it.
  virtual void Stop() = 0;

  virtual LaneStats stats() const = 0;

  // Test hook: sends `header_bytes` as the frame header without encoding or checks.
  virtual void SendRawForTesting(PeerId peer, std::span<const std::byte> header_bytes,
                                 std::span<const std::byte> payload, SendCallback done) = 0;
};

// Creates lanes; owns what they share (the UCX context). Outlives its lanes.
class Fabric {
 public:
  virtual ~Fabric() = default;
  virtual Result<std::unique_ptr<Lane>> CreateLane(std::string name) = 0;
  virtual std::string_view kind() const = 0;
  // The transport's settings in force that are not its defaults ("NAME='value'"), for the
  // worker's stats and log: for UCX the UCX_* variables set and those gradlink set itself.
  virtual std::vector<std::string> settings() const { return {}; }
  // Memory beyond host memory the transport can move itself ("cuda", "rocm", ...; UCX built
  // with those transports); empty: host memory only, which is what gradlink hands it (device
  // tensors are staged through host buffers: python/gradlink/torch/_staging.py).
  virtual std::vector<std::string> device_memory() const { return {}; }
};

// UCX (ucp active messages): shared memory, TCP and RDMA from one code path; honours UCX_TLS.
Result<std::unique_ptr<Fabric>> CreateUcxFabric();

// Threads as ranks: every lane created from one InprocFabric can reach the others.
// Thread-safe. For unit tests.
std::shared_ptr<Fabric> CreateInprocFabric();

}  // namespace gradlink::transport
