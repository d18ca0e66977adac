// UcxLane: the UCX implementation of transport::Lane over ucp active messages (internal to
// src/transport/ucx/: no UCX type leaves this folder).
//
// One UcxFabric owns one ucp_context. Each UcxLane owns one ucp_worker (UCS_THREAD_MODE_SINGLE)
// and one progress thread, and every ucp call for that worker is made on that thread (or, before
// Start() and after the thread has exited, on the one thread that owns the lane): other threads
// hand closures to a mutex-protected queue and wake the thread through an eventfd. This is the
// Gloo pattern; it keeps UCX single-threaded per worker, which is both the fastest UCX mode and
// the only one where callbacks cannot race with our own bookkeeping.
//
// A frame is one active message (id kAmId): the 64-byte wire header as the AM header and the
// payload as the AM data. UCX chooses eager or rendezvous by size; rendezvous payloads are
// received into a bounce buffer and copied into the span the Receiver chose, or straight into
// that span when the Receiver keeps its buffers if a receive is abandoned.
//
// Lifetimes: the ucp_context is reference-counted between the fabric and its lanes, so the
// interface rule "the Fabric outlives its lanes" is not load-bearing here, but callers should
// still follow it. A lane must not be destroyed from inside one of its own callbacks. After
// Stop() a Send() runs its callback (kAborted) on the calling thread: no progress thread is left.
//
// What UCX 1.13.1 does here (observed, see tests/unit/transport/ucx_test.cc):
// - With UCP_ERR_HANDLING_MODE_PEER, sysv/posix shared memory are never selected ("no peer
//   failure handler"), so peers on one host talk over tcp/lo (cma is not used for rendezvous
//   either). UCX_TLS=sm,self makes Connect() fail with kUnavailable.
// - A bad frame makes the receiver force-close its endpoint to the sender. The sender is not
//   told at once: its later frames are dropped by the receiver (eager sends still complete OK
//   locally) until UCX keepalive (UCX_KEEPALIVE_INTERVAL, 20 s) fails its endpoint.
// - Force-closing an endpoint does not release a rendezvous send still waiting for the peer;
//   UCX warns "was not returned to mpool" when the worker is destroyed. Harmless for us.
//
// Which thread owns what: lifecycle_mu_ serializes Start(), Stop() and a Connect() before
// Start(); queue_mu_ guards the queue other threads hand closures to; everything under
// "Progress-thread state" below, the worker and every Peer, SendOp and RecvOp belong to the
// progress thread (before Start() and after it has exited, to the owning thread). The counters
// behind stats() are atomics, readable from any thread.
//
// Errors: a peer's first failure (its endpoint's error handler, a send UCX fails for the
// endpoint, or a bad frame on a connection that is one of ours) is sticky: stored in the Peer,
// reported once through Receiver::OnPeerFailed(), and returned to every pending and later
// Send() to it. A send error that concerns only that send (IsLocalSendError()) fails just that
// send. A bad incoming frame is counted (LaneStats::protocol_errors) and closes its connection;
// peer input never aborts the process. Once stopping, everything completes with kAborted.
//
// Files: context.cc (the ucp_context and UcxFabric), lane.cc (create, start, connect, stop),
// endpoint.cc (a Peer's endpoint, its failure and close), progress.cc (the progress thread and
// its queue), send.cc and receive.cc (the two directions of the active-message path),
// status.cc (ucs_status_t -> Status).
#pragma once

#include <ucp/api/ucp.h>

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <thread>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "common/mutex.h"
#include "common/thread_annotations.h"
#include "transport/transport.h"
#include "transport/ucx/context.h"
#include "wire/frame.h"

namespace gradlink::transport::ucx {

using Clock = std::chrono::steady_clock;

// All frames use one AM id; the wire header carries the message type.
constexpr unsigned kAmId = 0;

class UcxLane final : public Lane {
 public:
  static Result<std::unique_ptr<Lane>> Create(std::shared_ptr<UcxContext> context,
                                              std::string name);

  ~UcxLane() override;

  std::vector<std::byte> address() const override { return address_; }
  void SetAuthenticator(std::shared_ptr<const security::LaneAuthenticator> auth) override {
    auth_ = std::move(auth);
  }
  Status Start(Receiver* receiver) override;
  Result<PeerId> Connect(std::span<const std::byte> remote_address,
                         std::string peer_name) override;
  void Send(PeerId peer, const wire::Header& h, std::span<const std::byte> payload,
            SendCallback done) override;
  void FailPeer(PeerId peer, const Status& why) override;
  void Defer(std::function<void()> fn) override;
  void Stop() override;
  LaneStats stats() const override;
  void SendRawForTesting(PeerId peer, std::span<const std::byte> header_bytes,
                         std::span<const std::byte> payload, SendCallback done) override;

 private:
  // A place in an OpList: an op is in at most one list per Link it has.
  template <class T>
  struct OpLink {
    T* prev = nullptr;
    T* next = nullptr;
    bool linked = false;
  };

  // Ops UCX still owns, linked through one of their OpLinks: inserting and erasing allocate
  // nothing (an unordered_set did, a node per op). Progress thread only.
  template <class T>
  class OpList {
   public:
    explicit OpList(OpLink<T> T::*link) : link_(link) {}
    void insert(T* op) {
      OpLink<T>& l = op->*link_;
      if (l.linked) return;
      l = {nullptr, head_, true};
      if (head_ != nullptr) (head_->*link_).prev = op;
      head_ = op;
      ++size_;
    }
    void erase(T* op) {
      OpLink<T>& l = op->*link_;
      if (!l.linked) return;
      if (l.prev != nullptr) (l.prev->*link_).next = l.next; else head_ = l.next;
      if (l.next != nullptr) (l.next->*link_).prev = l.prev;
      l = {};
      --size_;
    }
    // The members now, for loops that complete (and so may erase) them.
    std::vector<T*> snapshot() const {
      std::vector<T*> v;
      v.reserve(size_);
      for (T* op = head_; op != nullptr; op = (op->*link_).next) v.push_back(op);
      return v;
    }
    // Forgets every member without touching it (they may be freed already).
    void clear() {
      head_ = nullptr;
      size_ = 0;
    }
    bool empty() const { return size_ == 0; }
    size_t size() const { return size_; }

   private:
    OpLink<T> T::*link_;
    T* head_ = nullptr;
    size_t size_ = 0;
  };

  // One Send(). Lives until UCX is done with it (its request completed), which may be after
  // `done` ran: a failed peer's sends complete at once, UCX releases them later.
  struct SendOp {
    UcxLane* lane = nullptr;
    PeerId peer = 0;
    // The encoded header, inline (no allocation per send); SendRawForTesting's bytes, of any
    // length, go in `raw_header` instead.
    wire::HeaderBytes header{};
    std::vector<std::byte> raw_header;
    bool raw = false;
    std::span<const std::byte> header_bytes() const {
      return raw ? std::span<const std::byte>(raw_header) : std::span<const std::byte>(header);
    }
    std::span<const std::byte> payload;
    SendCallback done;
    bool done_called = false;
    Status early;  // set when the send is rejected before reaching UCX
    // Its places in its peer's list and the lane's of sends UCX still owns (SendList).
    OpLink<SendOp> peer_link, lane_link;
  };
  using SendList = OpList<SendOp>;


  // An endpoint created by Connect(). Never freed before the worker, so ucp callbacks may
  // hold a raw pointer to it.
  struct Peer {
    UcxLane* lane = nullptr;
    PeerId id = 0;
    std::string name;
    ucp_ep_h ep = nullptr;      // null once closed
    bool failed = false;        // sticky
    // Given up by the owner (Lane::FailPeer) while UCX still had it: its endpoint is closed
    // once UCX reports the peer failed itself.
    bool given_up = false;
    Status failure;             // why, when failed
    SendList in_flight{&SendOp::peer_link};  // sends UCX still owns
  };

  // One rendezvous receive in flight.
  struct RecvOp {
    // Null once the lane has given the op up (a receive UCX would not cancel): a late callback
    // then only frees the request and the op.
    std::atomic<UcxLane*> lane{nullptr};
    wire::Header header;
    std::span<std::byte> dest;
    void* request = nullptr;     // the UCX request while in flight
    ucp_ep_h reply_ep = nullptr;  // the connection the payload comes on
    // UCX receives into this, not into `dest`: a receive that a stopped lane cannot cancel (a
    // hung or vanished peer) may still be written by UCX later, and then it must be memory the
    // lane leaks, not the receiver's (freed) buffer. Copied into `dest` on success. Null when
    // the receiver keeps its buffers if a receive is abandoned: UCX then writes `dest`.
    std::unique_ptr<std::byte[]> bounce;
    OpLink<RecvOp> link;  // in recvs_in_flight_
  };
  // RecvOps done with, kept for the next receives (progress thread only): a receive allocates
  // nothing in the steady state. A given-up op (a stopped lane's) is freed, never kept.
  RecvOp* NewRecvOp();
  void FreeRecvOp(RecvOp* op);
  // SendOps done with, kept for the next sends: Send() runs on any thread, UCX gives them back
  // on the progress thread; one small lock each way instead of an allocation per message.
  Mutex free_sends_mu_;
  std::vector<SendOp*> free_sends_ GUARDED_BY(free_sends_mu_);
  SendOp* NewSendOp();
  void FreeSendOp(SendOp* op);

  UcxLane(std::shared_ptr<UcxContext> context, std::string name)
      : context_(std::move(context)), name_(std::move(name)) {}

  bool OnProgressThread() const;

  // Queues `fn` for the progress thread. False once the lane has stopped for good.
  bool Enqueue(std::function<void()> fn);
  void Wake();
  void PostSend(SendOp* op);

  // Progress thread only (or the owning thread when no progress thread runs).
  void ProgressLoop();
  bool RunQueued();
  unsigned ProgressOnce();
  void FlushWorker(std::chrono::milliseconds timeout);
  bool RunAfterProgress();
  void Shutdown();
  Result<PeerId> ConnectNow(std::span<const std::byte> remote_address, std::string peer_name);
  void StartSend(SendOp* op);
  void CompleteSend(SendOp* op, const Status& status);
  void OnSendDone(SendOp* op, ucs_status_t status);
  // The peer failed for good (sticky): its sends complete with `status`, and, unless `close`
  // is false (the owner gave it up: Lane::FailPeer), its endpoint is closed.
  void FailPeer(Peer* peer, Status status, bool close = true);
  void CloseEp(ucp_ep_h ep);
  ucs_status_t OnActiveMessage(const void* header, size_t header_length, void* data,
                               size_t length, const ucp_am_recv_param_t* param);
  void RejectFrame(const ucp_am_recv_param_t* param, const std::string& why);
  void OnRecvDone(RecvOp* op, ucs_status_t status, size_t length);
  Status PeerLostStatus(const Peer& peer, ucs_status_t s) const;

  static void SendCallbackThunk(void* request, ucs_status_t status, void* user_data);
  static void RecvCallbackThunk(void* request, ucs_status_t status, size_t length,
                                void* user_data);
  static void CloseCallbackThunk(void* request, ucs_status_t status, void* user_data);
  static void ErrorHandlerThunk(void* arg, ucp_ep_h ep, ucs_status_t status);
  static ucs_status_t AmCallbackThunk(void* arg, const void* header, size_t header_length,
                                      void* data, size_t length,
                                      const ucp_am_recv_param_t* param);

  const std::shared_ptr<UcxContext> context_;
  const std::string name_;
  ucp_worker_h worker_ = nullptr;
  int worker_fd_ = -1;
  int wake_fd_ = -1;
  std::vector<std::byte> address_;

  // Start/Stop/pre-start Connect.
  Mutex lifecycle_mu_;
  bool started_ GUARDED_BY(lifecycle_mu_) = false;
  std::atomic<bool> shut_down_{false};  // written by the progress thread as it exits
  std::thread thread_;
  std::atomic<bool> stop_requested_{false};
  Receiver* receiver_ = nullptr;

  // Work handed to the progress thread. The progress thread swaps the whole queue out into
  // `running_` (progress thread only), which it empties and keeps: both keep their capacity, so
  // handing work over allocates nothing in the steady state (a fresh deque per round did, twice).
  Mutex queue_mu_;
  std::vector<std::function<void()>> queue_ GUARDED_BY(queue_mu_);
  std::vector<std::function<void()>> running_;
  // Takes what is queued (running_'s capacity reused); then RunBatch() runs it and gives the
  // vector back. A nested call (queued work that drains the queue) gets a vector of its own.
  std::vector<std::function<void()>> TakeQueued(bool close_if_empty);
  void RunBatch(std::vector<std::function<void()>> batch);
  bool queue_closed_ GUARDED_BY(queue_mu_) = false;
  std::atomic<bool> queue_nonempty_{false};

  // Progress-thread state.
  bool stopping_ = false;
  std::vector<std::unique_ptr<Peer>> peers_;
  std::vector<std::function<void()>> after_progress_;
  std::unordered_set<ucp_ep_h> reply_eps_to_close_;
  std::shared_ptr<const security::LaneAuthenticator> auth_;  // set before Start()
  // Incoming connections whose kLaneHello verified (progress thread only).
  std::unordered_set<ucp_ep_h> authenticated_;
  std::unordered_set<ucp_ep_h> closed_eps_;  // every endpoint CloseEp() has closed
  // Bounce buffers for rendezvous receives, by size, kept for reuse: a fresh multi-MiB
  // allocation per partition costs its page faults every time (progress thread only).
  std::unordered_map<size_t, std::vector<std::unique_ptr<std::byte[]>>> bounce_pool_;
  std::unique_ptr<std::byte[]> TakeBounce(size_t bytes);
  void GiveBounce(size_t bytes, std::unique_ptr<std::byte[]> b);
  OpList<RecvOp> recvs_in_flight_{&RecvOp::link};
  std::vector<std::unique_ptr<RecvOp>> free_recv_ops_;
  SendList sends_in_ucx_{&SendOp::lane_link};
  int closes_in_flight_ = 0;

  std::atomic<uint64_t> frames_sent_{0};
  std::atomic<uint64_t> frames_received_{0};
  std::atomic<uint64_t> bytes_sent_{0};
  std::atomic<uint64_t> bytes_received_{0};
  std::atomic<uint64_t> bytes_copied_eager_{0}, bytes_copied_bounce_{0};
  std::atomic<uint64_t> protocol_errors_{0};
  std::atomic<uint64_t> receives_abandoned_{0};
};

}  // namespace gradlink::transport::ucx
