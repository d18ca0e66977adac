// UcxLane's lifecycle: creating the worker, starting the progress thread, Connect() from any
// thread, Stop() and the bounded teardown of endpoints, receives and the worker; stats().
#include <sys/eventfd.h>
#include <ucp/api/ucp.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <unordered_set>
#include <utility>
#include <vector>

#include "common/log.h"
#include "transport/ucx/context.h"
#include "transport/ucx/status.h"
#include "transport/ucx/ucx_lane.h"

namespace gradlink::transport::ucx {
namespace {

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

}  // namespace

Result<std::unique_ptr<Lane>> UcxLane::Create(std::shared_ptr<UcxContext> context,
                                              std::string name) {
  std::unique_ptr<UcxLane> lane(new UcxLane(std::move(context), std::move(name)));

  ucp_worker_params_t wp{};
  wp.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE | UCP_WORKER_PARAM_FIELD_NAME;
  // SERIALIZED, not SINGLE: the worker is created here, progressed on the progress thread and
  // destroyed by Stop()'s caller, one thread at a time (lifecycle_mu_ and the thread's join
  // order that). SINGLE promises one thread for the worker's whole life, which UCX builds with
  // assertions check from 1.14 on (ucs_async_check_owner_thread: every server aborted).
  wp.thread_mode = UCS_THREAD_MODE_SERIALIZED;
  wp.name = lane->name_.c_str();
  ucs_status_t s = ucp_worker_create(lane->context_->context, &wp, &lane->worker_);
  if (s != UCS_OK) {
    lane->worker_ = nullptr;
    return StartError(s, "ucx lane '" + lane->name_ + "': ucp_worker_create");
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
  AppendSegments(lane->address_, lane->context_->segments);
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
  for (SendOp* op : free_sends_) delete op;
}

Status UcxLane::Start(Receiver* receiver) {
  if (receiver == nullptr) return InvalidArgument("ucx lane '" + name_ + "': null receiver");
  MutexLock lock(lifecycle_mu_);
  if (shut_down_ || stop_requested_.load()) {
    return Aborted("ucx lane '" + name_ + "' is stopped");
  }
  if (started_) return InvalidArgument("ucx lane '" + name_ + "' already started");
  receiver_ = receiver;
  started_ = true;
  thread_ = std::thread([this] { ProgressLoop(); });
  return Status::Ok();
}

Result<PeerId> UcxLane::Connect(std::span<const std::byte> remote_address,
                                std::string peer_name) {
  if (OnProgressThread()) return ConnectNow(remote_address, std::move(peer_name));
  {
    MutexLock lock(lifecycle_mu_);
    if (shut_down_) return Aborted("ucx lane '" + name_ + "' is stopped");
    if (!started_) {
      // No progress thread yet: this thread may use the worker, serialized by the lock.
      return ConnectNow(remote_address, std::move(peer_name));
    }
  }

  struct Call {
    Mutex mu;
    CondVar cv;
    bool abandoned GUARDED_BY(mu) = false;
    std::optional<Result<PeerId>> result GUARDED_BY(mu);
  };
  auto call = std::make_shared<Call>();
  std::vector<std::byte> addr(remote_address.begin(), remote_address.end());
  bool queued = Enqueue([this, call, addr = std::move(addr), name = peer_name]() mutable {
    MutexLock lock(call->mu);
    // A caller that gave up must not get an endpoint it will never use.
    if (call->abandoned) return;
    call->result = ConnectNow(addr, std::move(name));
    call->cv.NotifyAll();
  });
  if (!queued) return Aborted("ucx lane '" + name_ + "' is stopped");

  MutexLock lock(call->mu);
  if (!call->cv.WaitUntil(call->mu, Clock::now() + kConnectDeadline, [&] {
        call->mu.AssertHeld();  // the wait runs it under `lock`
        return call->result.has_value();
      })) {
    call->abandoned = true;
    return Timeout("ucx lane '" + name_ + "': connecting to '" + peer_name +
                   "' timed out waiting for the progress thread");
  }
  return std::move(*call->result);
}

void UcxLane::Stop() {
  if (OnProgressThread()) {
    // Cannot join ourselves: ask the loop to wind down once this callback returns. A later
    // Stop() or the destructor from another thread joins it.
    stop_requested_.store(true);
    return;
  }
  MutexLock lock(lifecycle_mu_);
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

void UcxLane::Shutdown() {
  stopping_ = true;
  // Drain until the queue is closed while empty: everything queued before that point runs
  // (sends complete with kAborted because stopping_ is set), and every later Send() runs its
  // callback on the caller's thread.
  for (;;) {
    std::vector<std::function<void()>> batch = TakeQueued(/*close_if_empty=*/true);
    if (batch.empty()) break;
    RunBatch(std::move(batch));
  }

  // Pending sends complete with kAborted now; UCX gives their requests back during the closes
  // below, and OnSendDone then only frees them.
  const Status aborted = Aborted("ucx lane '" + name_ + "' stopped");
  for (auto& peer : peers_) {
    const std::vector<SendOp*> ops = peer->in_flight.snapshot();
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
  for (RecvOp* op : recvs_in_flight_.snapshot()) {
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
    for (RecvOp* op : recvs_in_flight_.snapshot()) {
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
    for (RecvOp* op : recvs_in_flight_.snapshot()) {
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
  for (SendOp* op : sends_in_ucx_.snapshot()) {
    CompleteSend(op, aborted);
    delete op;
  }
  sends_in_ucx_.clear();
  for (auto& peer : peers_) peer->in_flight.clear();  // their members were just freed
  for (RecvOp* op : recvs_in_flight_.snapshot()) {
    if (receiver_ != nullptr) receiver_->OnReceiveFailed(op->header, aborted);
    delete op;
  }
  recvs_in_flight_.clear();
  free_recv_ops_.clear();
  shut_down_ = true;
}

}  // namespace gradlink::transport::ucx
