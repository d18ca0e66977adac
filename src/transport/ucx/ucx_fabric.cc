// UCX implementation of transport::Fabric and transport::Lane over ucp active messages.
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
#include <poll.h>
#include <sched.h>
#include <sys/eventfd.h>
#include <ucp/api/ucp.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <mutex>
#include <optional>
#include <thread>
#include <unordered_map>
#include <unordered_set>
#include <utility>

#include "common/log.h"
#include "transport/transport.h"
#include "wire/frame.h"

namespace gradlink::transport {
namespace {

using Clock = std::chrono::steady_clock;

// All frames use one AM id; the wire header carries the message type.
constexpr unsigned kAmId = 0;
// How long Connect() from another thread waits for the progress thread. ucp_ep_create does not
// wait for the network, so this only trips if the progress thread is stuck in a callback.
constexpr auto kConnectDeadline = std::chrono::seconds(10);
// Bound on progressing ep closes while stopping; force-closes normally finish at once.
constexpr auto kCloseDeadline = std::chrono::seconds(1);
// Bound on flushing the worker (outstanding wireup) while stopping.
constexpr auto kFlushDeadline = std::chrono::milliseconds(300);
// Bound on waiting for cancelled rendezvous receives (a dead peer's fail once UCX sees the
// connection reset).
constexpr auto kCancelDeadline = std::chrono::milliseconds(500);
// Bounce buffers kept per distinct payload size.
constexpr size_t kBouncePoolPerSize = 16;
// After the last progress, keep polling this long (yielding the core between polls) before
// sleeping: cuts latency for request/response patterns without burning a core...
constexpr auto kSpin = std::chrono::microseconds(20);
// ...on hosts with at least this many hardware threads. With fewer, a one-host job has more
// busy threads than cores (2 workers + 2 servers run ~10), and on a 2-core host shared with
// other jobs every spin, even a yielding one, measured worse than sleeping at once: a yielding
// thread sees its events only when it gets the core back, a sleeping one is woken by them
// (64 MiB push_pull 0.4-0.6 GB/s busbw spinning against 0.7-0.9 sleeping; 4 KiB about even).
constexpr unsigned kMinThreadsToSpin = 8;
// Progress calls in a row before the queue is looked at again.
constexpr int kMaxProgressRounds = 64;
// Upper bound on one sleep, so a missed wake-up costs at most this much.
constexpr int kPollTimeoutMs = 100;

// The lane whose progress thread is the current thread, if any.
thread_local const void* t_progress_lane = nullptr;

std::string UcsError(ucs_status_t s) { return ucs_status_string(s); }

// UCP_ERR_HANDLING_MODE_PEER (the default) reports a dead peer on the endpoint, but UCX 1.13
// then never selects shared memory (sysv/posix/cma lack peer failure handling), so processes on
// one host talk over TCP loopback. GRADLINK_UCX_ERROR_MODE=none trades that endpoint-level
// detection (the scheduler still detects dead members) for the shared-memory path.
ucp_err_handling_mode_t PeerErrorMode() {
  static const ucp_err_handling_mode_t mode = [] {
    const char* v = std::getenv("GRADLINK_UCX_ERROR_MODE");
    return (v != nullptr && std::strcmp(v, "none") == 0) ? UCP_ERR_HANDLING_MODE_NONE
                                                         : UCP_ERR_HANDLING_MODE_PEER;
  }();
  return mode;
}

// Errors that concern one send, not the endpoint; anything else means the endpoint is unusable.
bool IsLocalSendError(ucs_status_t s) {
  return s == UCS_ERR_NO_MEMORY || s == UCS_ERR_INVALID_PARAM || s == UCS_ERR_EXCEEDS_LIMIT ||
         s == UCS_ERR_UNSUPPORTED;
}

Status LocalSendError(ucs_status_t s, const std::string& what) {
  std::string msg = what + ": " + UcsError(s);
  if (s == UCS_ERR_NO_MEMORY) return ResourceExhausted(std::move(msg));
  return InvalidArgument(std::move(msg));
}

// Shared by the fabric and its lanes; ucp_cleanup runs when the last of them is gone.
struct UcxContext {
  ucp_context_h context = nullptr;
  ~UcxContext() {
    if (context != nullptr) ucp_cleanup(context);
  }
};

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
  void Defer(std::function<void()> fn) override;
  void Stop() override;
  LaneStats stats() const override;
  void SendRawForTesting(PeerId peer, std::span<const std::byte> header_bytes,
                         std::span<const std::byte> payload, SendCallback done) override;

 private:
  struct SendOp;

  // An endpoint created by Connect(). Never freed before the worker, so ucp callbacks may
  // hold a raw pointer to it.
  struct Peer {
    UcxLane* lane = nullptr;
    PeerId id = 0;
    std::string name;
    ucp_ep_h ep = nullptr;      // null once closed
    bool failed = false;        // sticky
    Status failure;             // why, when failed
    std::unordered_set<SendOp*> in_flight;  // sends UCX still owns
  };

  // One Send(). Lives until UCX is done with it (its request completed), which may be after
  // `done` ran: a failed peer's sends complete at once, UCX releases them later.
  struct SendOp {
    UcxLane* lane = nullptr;
    PeerId peer = 0;
    std::vector<std::byte> header;
    std::span<const std::byte> payload;
    SendCallback done;
    bool done_called = false;
    Status early;  // set when the send is rejected before reaching UCX
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
  };

  UcxLane(std::shared_ptr<UcxContext> context, std::string name)
      : context_(std::move(context)), name_(std::move(name)) {}

  bool OnProgressThread() const { return t_progress_lane == this; }

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
  void FailPeer(Peer* peer, Status status);
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
  std::mutex lifecycle_mu_;
  bool started_ = false;
  std::atomic<bool> shut_down_{false};  // written by the progress thread as it exits
  std::thread thread_;
  std::atomic<bool> stop_requested_{false};
  Receiver* receiver_ = nullptr;

  // Work handed to the progress thread.
  std::mutex queue_mu_;
  std::deque<std::function<void()>> queue_;
  bool queue_closed_ = false;
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
  std::unique_ptr<std::byte[]> TakeBounce(size_t bytes) {
    auto& free = bounce_pool_[bytes];
    if (free.empty()) return std::unique_ptr<std::byte[]>(new std::byte[bytes]);
    auto b = std::move(free.back());
    free.pop_back();
    return b;
  }
  void GiveBounce(size_t bytes, std::unique_ptr<std::byte[]> b) {
    auto& free = bounce_pool_[bytes];
    if (free.size() < kBouncePoolPerSize) free.push_back(std::move(b));
  }
  std::unordered_set<RecvOp*> recvs_in_flight_;
  std::unordered_set<SendOp*> sends_in_ucx_;
  int closes_in_flight_ = 0;

  std::atomic<uint64_t> frames_sent_{0};
  std::atomic<uint64_t> frames_received_{0};
  std::atomic<uint64_t> bytes_sent_{0};
  std::atomic<uint64_t> bytes_received_{0};
  std::atomic<uint64_t> bytes_copied_eager_{0}, bytes_copied_bounce_{0};
  std::atomic<uint64_t> protocol_errors_{0};
  std::atomic<uint64_t> receives_abandoned_{0};
};

Result<std::unique_ptr<Lane>> UcxLane::Create(std::shared_ptr<UcxContext> context,
                                              std::string name) {
  std::unique_ptr<UcxLane> lane(new UcxLane(std::move(context), std::move(name)));

  ucp_worker_params_t wp{};
  wp.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE | UCP_WORKER_PARAM_FIELD_NAME;
  wp.thread_mode = UCS_THREAD_MODE_SINGLE;
  wp.name = lane->name_.c_str();
  ucs_status_t s = ucp_worker_create(lane->context_->context, &wp, &lane->worker_);
  if (s != UCS_OK) {
    lane->worker_ = nullptr;
    return Unavailable("ucx lane '" + lane->name_ + "': ucp_worker_create: " + UcsError(s));
  }
  // From here on the destructor cleans up whatever is set.

  s = ucp_worker_get_efd(lane->worker_, &lane->worker_fd_);
  if (s != UCS_OK) {
    return Unavailable("ucx lane '" + lane->name_ + "': ucp_worker_get_efd: " + UcsError(s));
  }
  lane->wake_fd_ = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  if (lane->wake_fd_ < 0) {
    return Internal("ucx lane '" + lane->name_ + "': eventfd: " + std::strerror(errno));
  }

  ucp_address_t* addr = nullptr;
  size_t addr_len = 0;
  s = ucp_worker_get_address(lane->worker_, &addr, &addr_len);
  if (s != UCS_OK) {
    return Unavailable("ucx lane '" + lane->name_ + "': ucp_worker_get_address: " +
                       UcsError(s));
  }
  const auto* bytes = reinterpret_cast<const std::byte*>(addr);
  lane->address_.assign(bytes, bytes + addr_len);
  ucp_worker_release_address(lane->worker_, addr);

  ucp_am_handler_param_t hp{};
  hp.field_mask = UCP_AM_HANDLER_PARAM_FIELD_ID | UCP_AM_HANDLER_PARAM_FIELD_FLAGS |
                  UCP_AM_HANDLER_PARAM_FIELD_CB | UCP_AM_HANDLER_PARAM_FIELD_ARG;
  hp.id = kAmId;
  hp.flags = UCP_AM_FLAG_WHOLE_MSG;
  hp.cb = &UcxLane::AmCallbackThunk;
  hp.arg = lane.get();
  s = ucp_worker_set_am_recv_handler(lane->worker_, &hp);
  if (s != UCS_OK) {
    return Unavailable("ucx lane '" + lane->name_ + "': ucp_worker_set_am_recv_handler: " +
                       UcsError(s));
  }
  return std::unique_ptr<Lane>(std::move(lane));
}

UcxLane::~UcxLane() {
  Stop();
  if (OnProgressThread()) {
    // Destroyed from its own callback: the thread cannot join itself and would keep running on
    // freed memory. A caller bug, never peer input; stop here rather than corrupt memory.
    GL_LOG(kError) << "ucx lane '" << name_ << "' destroyed from its own progress thread";
    std::abort();
  }
  if (wake_fd_ >= 0) close(wake_fd_);
}

Status UcxLane::Start(Receiver* receiver) {
  if (receiver == nullptr) return InvalidArgument("ucx lane '" + name_ + "': null receiver");
  std::lock_guard<std::mutex> lock(lifecycle_mu_);
  if (shut_down_ || stop_requested_.load()) {
    return Aborted("ucx lane '" + name_ + "' is stopped");
  }
  if (started_) return InvalidArgument("ucx lane '" + name_ + "' already started");
  receiver_ = receiver;
  started_ = true;
  thread_ = std::thread([this] { ProgressLoop(); });
  return Status::Ok();
}

bool UcxLane::Enqueue(std::function<void()> fn) {
  bool was_empty;
  {
    std::lock_guard<std::mutex> lock(queue_mu_);
    if (queue_closed_) return false;
    was_empty = queue_.empty();
    queue_.push_back(std::move(fn));
    queue_nonempty_.store(true, std::memory_order_release);
  }
  // The thread drains the whole queue each round, so only the empty -> non-empty edge needs a
  // wake-up (the eventfd stays readable until the thread next polls). On the progress thread
  // none is needed: the loop looks at the queue before it sleeps.
  if (was_empty && !OnProgressThread()) Wake();
  return true;
}

void UcxLane::Wake() {
  uint64_t one = 1;
  // EAGAIN only when the counter is saturated, i.e. a wake-up is already pending.
  ssize_t n = write(wake_fd_, &one, sizeof(one));
  (void)n;
}

Result<PeerId> UcxLane::Connect(std::span<const std::byte> remote_address,
                                std::string peer_name) {
  if (OnProgressThread()) return ConnectNow(remote_address, std::move(peer_name));
  {
    std::lock_guard<std::mutex> lock(lifecycle_mu_);
    if (shut_down_) return Aborted("ucx lane '" + name_ + "' is stopped");
    if (!started_) {
      // No progress thread yet: this thread may use the worker, serialized by the lock.
      return ConnectNow(remote_address, std::move(peer_name));
    }
  }

  struct Call {
    std::mutex mu;
    std::condition_variable cv;
    bool abandoned = false;
    std::optional<Result<PeerId>> result;
  };
  auto call = std::make_shared<Call>();
  std::vector<std::byte> addr(remote_address.begin(), remote_address.end());
  bool queued = Enqueue([this, call, addr = std::move(addr), name = peer_name]() mutable {
    std::lock_guard<std::mutex> lock(call->mu);
    // A caller that gave up must not get an endpoint it will never use.
    if (call->abandoned) return;
    call->result = ConnectNow(addr, std::move(name));
    call->cv.notify_all();
  });
  if (!queued) return Aborted("ucx lane '" + name_ + "' is stopped");

  std::unique_lock<std::mutex> lock(call->mu);
  if (!call->cv.wait_until(lock, Clock::now() + kConnectDeadline,
                           [&] { return call->result.has_value(); })) {
    call->abandoned = true;
    return Timeout("ucx lane '" + name_ + "': connecting to '" + peer_name +
                   "' timed out waiting for the progress thread");
  }
  return std::move(*call->result);
}

Result<PeerId> UcxLane::ConnectNow(std::span<const std::byte> remote_address,
                                   std::string peer_name) {
  if (stopping_) return Aborted("ucx lane '" + name_ + "' is stopped");
  if (remote_address.empty()) {
    return InvalidArgument("ucx lane '" + name_ + "': empty address for '" + peer_name + "'");
  }
  auto peer = std::make_unique<Peer>();
  peer->lane = this;
  peer->id = static_cast<PeerId>(peers_.size());
  peer->name = std::move(peer_name);

  ucp_ep_params_t ep{};
  ep.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE |
                  UCP_EP_PARAM_FIELD_ERR_HANDLER | UCP_EP_PARAM_FIELD_NAME;
  ep.address = reinterpret_cast<const ucp_address_t*>(remote_address.data());
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
  const std::string peer_name_copy = peer->name;
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

void UcxLane::Send(PeerId peer, const wire::Header& h, std::span<const std::byte> payload,
                   SendCallback done) {
  auto* op = new SendOp;
  op->lane = this;
  op->peer = peer;
  op->payload = payload;
  op->done = std::move(done);
  if (h.payload_bytes != payload.size()) {
    op->early = InvalidArgument("ucx lane '" + name_ + "': header says " +
                                std::to_string(h.payload_bytes) + " payload bytes, span has " +
                                std::to_string(payload.size()));
  } else {
    wire::HeaderBytes hb = wire::EncodeHeader(h);
    op->header.assign(hb.begin(), hb.end());
  }
  PostSend(op);
}

void UcxLane::SendRawForTesting(PeerId peer, std::span<const std::byte> header_bytes,
                                std::span<const std::byte> payload, SendCallback done) {
  auto* op = new SendOp;
  op->lane = this;
  op->peer = peer;
  op->payload = payload;
  op->done = std::move(done);
  op->header.assign(header_bytes.begin(), header_bytes.end());
  PostSend(op);
}

void UcxLane::PostSend(SendOp* op) {
  // Always through the queue, even on the progress thread: `done` then never runs inside the
  // caller's Send(), which callers holding locks would not expect.
  if (Enqueue([this, op] { StartSend(op); })) return;
  // Stopped for good: no progress thread will ever run `done`, so run it here, once.
  CompleteSend(op, Aborted("ucx lane '" + name_ + "' is stopped"));
  delete op;
}

void UcxLane::Defer(std::function<void()> fn) {
  if (!Enqueue(std::move(fn))) {
    GL_LOG(kDebug) << "ucx lane '" << name_ << "': dropped a deferred call after Stop()";
  }
}

void UcxLane::Stop() {
  if (OnProgressThread()) {
    // Cannot join ourselves: ask the loop to wind down once this callback returns. A later
    // Stop() or the destructor from another thread joins it.
    stop_requested_.store(true);
    return;
  }
  std::lock_guard<std::mutex> lock(lifecycle_mu_);
  if (thread_.joinable()) {
    stop_requested_.store(true);
    Wake();
    thread_.join();
  } else if (!shut_down_) {
    // Never started: nothing else uses the worker, so clean up on this thread.
    stop_requested_.store(true);
    Shutdown();
  }
}

LaneStats UcxLane::stats() const {
  LaneStats s;
  s.frames_sent = frames_sent_.load(std::memory_order_relaxed);
  s.frames_received = frames_received_.load(std::memory_order_relaxed);
  s.bytes_sent = bytes_sent_.load(std::memory_order_relaxed);
  s.bytes_received = bytes_received_.load(std::memory_order_relaxed);
  s.bytes_copied_eager = bytes_copied_eager_.load(std::memory_order_relaxed);
  s.bytes_copied_bounce = bytes_copied_bounce_.load(std::memory_order_relaxed);
  s.protocol_errors = protocol_errors_.load(std::memory_order_relaxed);
  s.receives_abandoned = receives_abandoned_.load(std::memory_order_relaxed);
  return s;
}

// ---- Progress thread --------------------------------------------------------------------------

void UcxLane::ProgressLoop() {
  t_progress_lane = this;
  bool arm_failure_logged = false;
  while (!stop_requested_.load(std::memory_order_acquire)) {
    RunQueued();
    // Bounded, so that a flood of incoming frames cannot starve queued sends or Stop().
    int rounds = 0;
    while (rounds < kMaxProgressRounds && ProgressOnce() != 0) ++rounds;
    if (rounds == kMaxProgressRounds) continue;

    // Short spin: a reply often arrives within microseconds, and sleeping through it would cost
    // a syscall and a context switch each way.
    bool active = false;
    static const bool spin = std::thread::hardware_concurrency() >= kMinThreadsToSpin;
    const auto spin_end = Clock::now() + kSpin;
    while (spin && Clock::now() < spin_end) {
      if (queue_nonempty_.load(std::memory_order_acquire) || ProgressOnce() != 0 ||
          stop_requested_.load(std::memory_order_relaxed)) {
        active = true;
        break;
      }
      // Spin politely: where busy threads outnumber cores, a plain busy loop holds the core
      // that the thread we are waiting for needs (on the 2-core host, the former 30 us busy
      // spin made a 4 KiB push_pull ~360 us, yielding ~50-150, not spinning ~70-150). With
      // idle cores, sched_yield returns at once and this is an ordinary busy poll.
      sched_yield();
    }
    if (active) continue;

    ucs_status_t s = ucp_worker_arm(worker_);
    if (s == UCS_ERR_BUSY) continue;  // events arrived meanwhile
    int timeout_ms = kPollTimeoutMs;
    if (s != UCS_OK) {
      // No wake-up support from some transport: fall back to a bounded 1 ms nap, never a spin.
      if (!arm_failure_logged) {
        GL_LOG(kWarn) << "ucx lane '" << name_ << "': ucp_worker_arm: " << UcsError(s)
                      << "; polling every 1 ms";
        arm_failure_logged = true;
      }
      timeout_ms = 1;
    }
    if (queue_nonempty_.load(std::memory_order_acquire)) continue;

    // The wake fd first: without a working arm only it is polled.
    pollfd fds[2] = {{wake_fd_, POLLIN, 0}, {worker_fd_, POLLIN, 0}};
    int n = poll(fds, s == UCS_OK ? 2 : 1, timeout_ms);
    if (n > 0 && (fds[0].revents & POLLIN)) {
      uint64_t v;
      ssize_t r = read(wake_fd_, &v, sizeof(v));
      (void)r;
    }
  }
  Shutdown();
  t_progress_lane = nullptr;
}

bool UcxLane::RunQueued() {
  std::deque<std::function<void()>> batch;
  {
    std::lock_guard<std::mutex> lock(queue_mu_);
    batch.swap(queue_);
    queue_nonempty_.store(false, std::memory_order_relaxed);
  }
  for (auto& fn : batch) fn();
  bool ran = !batch.empty();
  // Queued work (a send hitting a failed peer) may have scheduled closes.
  ran |= RunAfterProgress();
  return ran;
}

// Flushes the worker: every operation and wireup message in flight on it completes (or fails,
// with its peer). Bounded: a hung peer costs `timeout`. Progress thread, or the owning thread.
void UcxLane::FlushWorker(std::chrono::milliseconds timeout) {
  if (worker_ == nullptr) return;
  ucp_request_param_t fp{};
  ucs_status_ptr_t r = ucp_worker_flush_nbx(worker_, &fp);
  if (r == nullptr || UCS_PTR_IS_ERR(r)) return;
  const auto deadline = Clock::now() + timeout;
  while (ucp_request_check_status(r) == UCS_INPROGRESS && Clock::now() < deadline) {
    if (ProgressOnce() == 0) std::this_thread::sleep_for(std::chrono::microseconds(100));
  }
  if (ucp_request_check_status(r) == UCS_INPROGRESS) ucp_request_cancel(worker_, r);
  ucp_request_free(r);
}

unsigned UcxLane::ProgressOnce() {
  unsigned n = ucp_worker_progress(worker_);
  if (RunAfterProgress()) ++n;
  return n;
}

// Work that must not run inside a ucp callback (closing endpoints re-enters UCX) runs here,
// right after ucp_worker_progress() returns.
bool UcxLane::RunAfterProgress() {
  if (after_progress_.empty() && reply_eps_to_close_.empty()) return false;
  std::vector<std::function<void()>> work;
  work.swap(after_progress_);
  for (auto& fn : work) fn();
  std::unordered_set<ucp_ep_h> eps;
  eps.swap(reply_eps_to_close_);
  for (ucp_ep_h ep : eps) {
    authenticated_.erase(ep);
    CloseEp(ep);
  }
  return true;
}

void UcxLane::Shutdown() {
  stopping_ = true;
  // Drain until the queue is closed while empty: everything queued before that point runs
  // (sends complete with kAborted because stopping_ is set), and every later Send() runs its
  // callback on the caller's thread.
  for (;;) {
    std::deque<std::function<void()>> batch;
    {
      std::lock_guard<std::mutex> lock(queue_mu_);
      batch.swap(queue_);
      queue_nonempty_.store(false, std::memory_order_relaxed);
      if (batch.empty()) queue_closed_ = true;
    }
    if (batch.empty()) break;
    for (auto& fn : batch) fn();
  }

  // Pending sends complete with kAborted now; UCX gives their requests back during the closes
  // below, and OnSendDone then only frees them.
  const Status aborted = Aborted("ucx lane '" + name_ + "' stopped");
  for (auto& peer : peers_) {
    std::vector<SendOp*> ops(peer->in_flight.begin(), peer->in_flight.end());
    for (SendOp* op : ops) CompleteSend(op, aborted);
  }
  RunAfterProgress();
  // Finish the wireup of our endpoints before closing them. A peer answers our wireup request
  // with a reply on a connection of its own; if we close and exit before that reply arrives,
  // its connection is refused, the peer's endpoint fails with the reply still queued, and UCX
  // 1.13 aborts the peer in ucp_request_send_state_ff (ucp_request.c:684, "got REP message";
  // the assertion is gone upstream, openucx/ucx#8175). Seen in CI: a server that left as soon as
  // the job ended took down a worker still answering its pull lane's wireup.
  FlushWorker(kFlushDeadline);
  // Note: UCX 1.13 keeps a rendezvous send that still waits for the peer's answer in its request
  // pool even after the force close below (ucp_request_cancel does not help either), and warns
  // "was not returned to mpool ucp_requests" at worker destroy. Our side is already complete.
  for (auto& peer : peers_) {
    if (peer->ep != nullptr) {
      ucp_ep_h ep = peer->ep;
      peer->ep = nullptr;
      CloseEp(ep);
    }
  }
  const auto deadline = Clock::now() + kCloseDeadline;
  while (worker_ != nullptr && closes_in_flight_ > 0 && Clock::now() < deadline) {
    if (ProgressOnce() == 0) std::this_thread::sleep_for(std::chrono::microseconds(100));
  }
  if (closes_in_flight_ > 0) {
    GL_LOG(kWarn) << "ucx lane '" << name_ << "': " << closes_in_flight_
                  << " endpoint close(s) still pending after "
                  << std::chrono::duration_cast<std::chrono::milliseconds>(kCloseDeadline)
                         .count()
                  << " ms; destroying the worker anyway";
  }

  // Let what is still in flight on the worker (wireup messages of endpoints peers opened to us
  // included) finish: UCX 1.13 asserts in ucp_worker_destroy when an endpoint still has a
  // wireup reply queued (ucp_request.c:684, "got REP message").
  FlushWorker(kFlushDeadline);

  // A rendezvous receive from a peer that hangs (SIGSTOP) never completes, and UCX 1.13 asserts
  // in ucp_worker_destroy on an endpoint that still has one (ucp_ep.c:437, proto_reqs not empty).
  // Cancel them; if UCX still holds one, leak the worker rather than abort the process. Nothing
  // writes into the receive buffer once we stop progressing the worker.
  for (RecvOp* op : std::vector<RecvOp*>(recvs_in_flight_.begin(), recvs_in_flight_.end())) {
    if (worker_ != nullptr && op->request != nullptr) ucp_request_cancel(worker_, op->request);
  }
  const auto cancel_deadline = Clock::now() + kCancelDeadline;
  while (worker_ != nullptr && !recvs_in_flight_.empty() && Clock::now() < cancel_deadline) {
    if (ProgressOnce() == 0) std::this_thread::sleep_for(std::chrono::microseconds(100));
  }
  // A peer that hangs (SIGSTOP) holds its rendezvous sends, and UCX 1.13 does not cancel a
  // receive waiting on one: force-closing the connection it comes on purges it. (A dead peer's
  // connection has failed already and its receives ended above; only live ones are closed.)
  if (worker_ != nullptr && !recvs_in_flight_.empty()) {
    std::unordered_set<ucp_ep_h> eps;
    for (RecvOp* op : recvs_in_flight_) {
      if (op->reply_ep != nullptr) eps.insert(op->reply_ep);  // CloseEp skips closed ones
    }
    for (ucp_ep_h ep : eps) {
      authenticated_.erase(ep);
      reply_eps_to_close_.erase(ep);
      CloseEp(ep);
    }
    const auto purge_deadline = Clock::now() + kCloseDeadline;
    while (!recvs_in_flight_.empty() && Clock::now() < purge_deadline) {
      if (ProgressOnce() == 0) std::this_thread::sleep_for(std::chrono::microseconds(100));
    }
  }
  const bool leak = !recvs_in_flight_.empty();
  if (leak) {
    GL_LOG(kWarn) << "ucx lane '" << name_ << "': " << recvs_in_flight_.size()
                  << " receive(s) from a lost peer could not be cancelled; leaving the UCX "
                     "worker (and its context) undestroyed";
    // UCX may still complete those requests, and write into their bounce buffers, from its
    // async thread: the ops (with their bounce buffers) stay allocated, detached from this
    // lane, and the context is never cleaned up under the live worker. The receivers' own
    // buffers were never handed to UCX, so they are told the receives failed.
    receives_abandoned_.fetch_add(recvs_in_flight_.size(), std::memory_order_relaxed);
    for (RecvOp* op : recvs_in_flight_) {
      if (receiver_ != nullptr) receiver_->OnReceiveFailed(op->header, aborted);
      op->lane = nullptr;
    }
    recvs_in_flight_.clear();
    new std::shared_ptr<UcxContext>(context_);  // intentionally leaked
  } else if (worker_ != nullptr) {
    ucp_worker_destroy(worker_);
  }
  worker_ = nullptr;

  // Whatever UCX did not give back is ours now; the worker (and with it every request) is gone.
  for (SendOp* op : sends_in_ucx_) {
    CompleteSend(op, aborted);
    delete op;
  }
  sends_in_ucx_.clear();
  for (auto& peer : peers_) peer->in_flight.clear();
  for (RecvOp* op : recvs_in_flight_) {
    if (receiver_ != nullptr) receiver_->OnReceiveFailed(op->header, aborted);
    delete op;
  }
  recvs_in_flight_.clear();
  shut_down_ = true;
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
    delete op;
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
  ucs_status_ptr_t r = ucp_am_send_nbx(peer->ep, kAmId, op->header.data(), op->header.size(),
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
  delete op;
}

Status UcxLane::PeerLostStatus(const Peer& peer, ucs_status_t s) const {
  return PeerLost("ucx lane '" + name_ + "': peer '" + peer.name + "' failed: " + UcsError(s));
}

void UcxLane::FailPeer(Peer* peer, Status status) {
  if (peer->failed) return;
  peer->failed = true;
  peer->failure = std::move(status);
  if (!stopping_) {
    GL_LOG(kInfo) << peer->failure.ToString();
    if (receiver_ != nullptr) receiver_->OnPeerFailed(peer->id, peer->failure);
  }
  std::vector<SendOp*> ops(peer->in_flight.begin(), peer->in_flight.end());
  for (SendOp* op : ops) CompleteSend(op, peer->failure);
  // UCX wants a failed endpoint closed by its owner; do it outside any ucp callback.
  after_progress_.push_back([this, peer] {
    if (peer->ep == nullptr) return;
    ucp_ep_h ep = peer->ep;
    peer->ep = nullptr;
    CloseEp(ep);
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

  Result<std::span<std::byte>> dest = receiver_->OnHeader(*h);
  if (!dest.ok()) {
    GL_LOG(kDebug) << "ucx lane '" << name_ << "': receiver dropped a frame: "
                   << dest.status().ToString();
    return UCS_OK;
  }
  if (dest->size() != length) {
    receiver_->OnReceiveFailed(
        *h, Internal("ucx lane '" + name_ + "': receiver gave a span of " +
                     std::to_string(dest->size()) + " bytes for a payload of " +
                     std::to_string(length)));
    return UCS_OK;
  }

  if (param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) {
    GL_LOG(kDebug) << "ucx lane '" << name_ << "': rendezvous receive of " << length
                   << " bytes";
    auto* op = new RecvOp;
    op->lane = this;
    op->header = *h;
    op->dest = *dest;
    op->reply_ep = reply_ep;
    void* target = dest->data();
    if (!receiver_->KeepsBuffersIfAbandoned()) {
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

  if (length > 0) std::memcpy(dest->data(), data, length);
  bytes_received_.fetch_add(length, std::memory_order_relaxed);
  bytes_copied_eager_.fetch_add(length, std::memory_order_relaxed);
  receiver_->OnPayload(*h, *dest);
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
  delete op;
}

void UcxLane::SendCallbackThunk(void* request, ucs_status_t status, void* user_data) {
  auto* op = static_cast<SendOp*>(user_data);
  ucp_request_free(request);
  op->lane->OnSendDone(op, status);
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

void UcxLane::CloseCallbackThunk(void* request, ucs_status_t /*status*/, void* user_data) {
  ucp_request_free(request);
  --static_cast<UcxLane*>(user_data)->closes_in_flight_;
}

void UcxLane::ErrorHandlerThunk(void* arg, ucp_ep_h ep, ucs_status_t status) {
  auto* peer = static_cast<Peer*>(arg);
  if (peer->ep != ep) return;  // already closed by us
  peer->lane->FailPeer(peer, peer->lane->PeerLostStatus(*peer, status));
}

ucs_status_t UcxLane::AmCallbackThunk(void* arg, const void* header, size_t header_length,
                                      void* data, size_t length,
                                      const ucp_am_recv_param_t* param) {
  return static_cast<UcxLane*>(arg)->OnActiveMessage(header, header_length, data, length,
                                                     param);
}

class UcxFabric final : public Fabric {
 public:
  explicit UcxFabric(std::shared_ptr<UcxContext> context) : context_(std::move(context)) {}

  Result<std::unique_ptr<Lane>> CreateLane(std::string name) override {
    return UcxLane::Create(context_, std::move(name));
  }
  std::string_view kind() const override { return "ucx"; }

 private:
  std::shared_ptr<UcxContext> context_;
};

}  // namespace

Result<std::unique_ptr<Fabric>> CreateUcxFabric() {
  // ucp_config_read picks up UCX_TLS, UCX_NET_DEVICES etc. from the environment.
  ucp_config_t* config = nullptr;
  ucs_status_t s = ucp_config_read(nullptr, nullptr, &config);
  if (s != UCS_OK) return Unavailable(std::string("ucx: ucp_config_read: ") + UcsError(s));

  ucp_params_t params{};
  params.field_mask =
      UCP_PARAM_FIELD_FEATURES | UCP_PARAM_FIELD_MT_WORKERS_SHARED | UCP_PARAM_FIELD_NAME;
  params.features = UCP_FEATURE_AM | UCP_FEATURE_WAKEUP;
  // Lanes run their workers on different threads; shared context state must be locked.
  params.mt_workers_shared = 1;
  params.name = "gradlink";
  auto context = std::make_shared<UcxContext>();
  s = ucp_init(&params, config, &context->context);
  ucp_config_release(config);
  if (s != UCS_OK) {
    context->context = nullptr;
    return Unavailable(std::string("ucx: ucp_init: ") + UcsError(s));
  }
  return std::unique_ptr<Fabric>(new UcxFabric(std::move(context)));
}

}  // namespace gradlink::transport
