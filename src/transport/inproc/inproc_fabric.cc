// Threads as ranks: lanes of one InprocFabric deliver to each other through queues. Each lane
// has a progress thread, so the threading contract is the same as UCX's: receiver callbacks
// and send completions run on the lane's own thread.
#include <atomic>
#include <cstring>
#include <deque>
#include <map>
#include <set>
#include <thread>

#include "common/mutex.h"
#include "common/thread_annotations.h"
#include "common/log.h"
#include "transport/transport.h"

namespace gradlink::transport {
namespace {

class InprocLane;

class InprocFabric final : public Fabric, public std::enable_shared_from_this<InprocFabric> {
 public:
  Result<std::unique_ptr<Lane>> CreateLane(std::string name) override;
  std::string_view kind() const override { return "inproc"; }

  void Register(uint64_t id, InprocLane* lane) {
    MutexLock lock(mu_);
    lanes_[id] = lane;
  }
  void Unregister(uint64_t id) {
    MutexLock lock(mu_);
    lanes_.erase(id);
  }
  // Runs fn(lane) with the lane kept alive; false when there is no such (running) lane.
  template <typename Fn>
  bool WithLane(uint64_t id, Fn&& fn) {
    MutexLock lock(mu_);
    auto it = lanes_.find(id);
    if (it == lanes_.end()) return false;
    return fn(it->second);
  }

 private:
  Mutex mu_;  // taken before a lane's mu_ (WithLane's callers), never under it
  std::map<uint64_t, InprocLane*> lanes_ GUARDED_BY(mu_);
  std::atomic<uint64_t> next_id_{1};
};

class InprocLane final : public Lane {
 public:
  InprocLane(std::shared_ptr<InprocFabric> fabric, uint64_t id, std::string name)
      : fabric_(std::move(fabric)), id_(id), name_(std::move(name)) {}
  ~InprocLane() override { Stop(); }

  std::vector<std::byte> address() const override {
    std::vector<std::byte> a(sizeof(id_));
    std::memcpy(a.data(), &id_, sizeof(id_));
    return a;
  }

  void SetAuthenticator(std::shared_ptr<const security::LaneAuthenticator> auth) override {
    auth_ = std::move(auth);
  }

  Status Start(Receiver* receiver) override {
    receiver_ = receiver;
    thread_ = std::thread([this] { Loop(); });
    fabric_->Register(id_, this);
    return Status::Ok();
  }

  Result<PeerId> Connect(std::span<const std::byte> remote, std::string peer_name) override {
    if (remote.size() != sizeof(uint64_t)) return InvalidArgument("bad inproc address");
    uint64_t target;
    std::memcpy(&target, remote.data(), sizeof(target));
    PeerId id;
    {
      MutexLock lock(mu_);
      peers_.push_back(Peer{target, std::move(peer_name), Status::Ok()});
      id = static_cast<PeerId>(peers_.size() - 1);
    }
    if (auth_) {
      auto proof = std::make_shared<std::vector<std::byte>>(auth_->Prove(remote));
      wire::Header hello;
      hello.type = wire::MsgType::kLaneHello;
      hello.payload_bytes = proof->size();
      Send(id, hello, *proof, [proof](const Status&) {});
    }
    return id;
  }

  void Send(PeerId peer, const wire::Header& h, std::span<const std::byte> payload,
            SendCallback done) override {
    const wire::HeaderBytes hb = wire::EncodeHeader(h);
    SendRawForTesting(peer, hb, payload, std::move(done));
  }

  void SendRawForTesting(PeerId peer, std::span<const std::byte> header_bytes,
                         std::span<const std::byte> payload, SendCallback done) override {
    uint64_t target = 0;
    Status failed;
    {
      MutexLock lock(mu_);
      if (peer >= peers_.size()) {
        failed = InvalidArgument("unknown peer " + std::to_string(peer));
      } else {
        target = peers_[peer].target;
        failed = peers_[peer].failed;
      }
    }
    if (!failed.ok()) {
      Defer([done = std::move(done), failed] { done(failed); });
      return;
    }
    std::vector<std::byte> hdr(header_bytes.begin(), header_bytes.end());
    // Pending until the receiver has copied the payload; a lane that stops first completes
    // what is left with kAborted (Loop), so every `done` runs exactly once.
    uint64_t send_id;
    {
      MutexLock lock(mu_);
      send_id = next_send_id_++;
      pending_sends_[send_id] = {peer, std::move(done)};
    }
    // The receiver copies the payload on its own thread, then completes the send on ours.
    const bool delivered = fabric_->WithLane(target, [&](InprocLane* dst) {
      return dst->Post([dst, hdr = std::move(hdr), payload, send_id, self_id = id_,
                        fabric = fabric_]() mutable {
        dst->Deliver(self_id, hdr, payload);
        fabric->WithLane(self_id, [&](InprocLane* src) {
          return src->Post([src, send_id] { src->CompleteSend(send_id, Status::Ok()); });
        });
      });
    });
    if (!delivered) {
      SendCallback cb = TakePending(send_id);
      if (cb) FailPeer(peer, PeerLost("inproc lane of peer is gone"), std::move(cb));
    } else {
      stats_.frames_sent++;
      stats_.bytes_sent += payload.size();
    }
  }

  SendCallback TakePending(uint64_t id) {
    MutexLock lock(mu_);
    auto node = pending_sends_.extract(id);
    return node.empty() ? SendCallback() : std::move(node.mapped().second);
  }

  void CompleteSend(uint64_t id, const Status& s) {
    SendCallback cb = TakePending(id);
    if (cb) cb(s);
  }

  // Sends already delivered to the peer's queue may still be read by it after their `done`:
  // the inproc fabric joins threads of one test, whose buffers outlive the job.
  void FailPeer(PeerId peer, const Status& why) override {
    std::vector<SendCallback> cancelled;
    {
      MutexLock lock(mu_);
      if (peer >= peers_.size()) return;
      for (auto it = pending_sends_.begin(); it != pending_sends_.end();) {
        if (it->second.first == peer) {
          cancelled.push_back(std::move(it->second.second));
          it = pending_sends_.erase(it);
        } else {
          ++it;
        }
      }
    }
    for (SendCallback& cb : cancelled) FailPeer(peer, why, std::move(cb));
    FailPeer(peer, why, [](const Status&) {});
  }

  void Defer(std::function<void()> fn) override {
    if (!Post(std::move(fn))) {
      // Stopped: nothing will run it; callers treat this as an aborted operation.
    }
  }

  void Stop() override {
    {
      MutexLock lock(mu_);
      if (stopped_) return;
      stopped_ = true;
    }
    fabric_->Unregister(id_);
    cv_.NotifyAll();
    if (thread_.joinable()) thread_.join();
  }

  LaneStats stats() const override {
    LaneStats s;
    s.frames_sent = stats_.frames_sent;
    s.frames_received = stats_.frames_received;
    s.bytes_sent = stats_.bytes_sent;
    s.bytes_received = stats_.bytes_received;
    s.protocol_errors = stats_.protocol_errors;
    return s;
  }

  bool Post(std::function<void()> fn) {
    MutexLock lock(mu_);
    if (stopped_) return false;
    queue_.push_back(std::move(fn));
    cv_.NotifyOne();
    return true;
  }

 private:
  struct Peer {
    uint64_t target;
    std::string name;
    Status failed;
  };
  struct AtomicStats {
    std::atomic<uint64_t> frames_sent{0}, frames_received{0}, bytes_sent{0}, bytes_received{0},
        protocol_errors{0};
  };

  void FailPeer(PeerId peer, Status s, SendCallback done) {
    bool first = false;
    {
      MutexLock lock(mu_);
      Peer& p = peers_[peer];
      if (p.failed.ok()) {
        p.failed = Status(s.code(), s.message() + " (" + p.name + ")");
        first = true;
      }
      s = p.failed;
    }
    Post([this, peer, s, first, done = std::move(done)] {
      if (first) receiver_->OnPeerFailed(peer, s);
      done(s);
    });
  }

  // On this lane's thread. `from` is the sending lane (the inproc "connection").
  void Deliver(uint64_t from, const std::vector<std::byte>& hdr,
               std::span<const std::byte> payload) {
    Result<wire::Header> h = wire::DecodeHeader(hdr);
    if (!h.ok() || h->payload_bytes != payload.size()) {
      stats_.protocol_errors++;
      GL_LOG(kWarn) << name_ << ": dropped a bad frame: "
                    << (h.ok() ? "payload length differs from header" : h.status().ToString());
      return;
    }
    if (h->type == wire::MsgType::kLaneHello) {
      if (!auth_ || !auth_->Verify(address(), payload)) {
        stats_.protocol_errors++;
        GL_LOG(kWarn) << name_ << ": refused a lane hello";
        return;
      }
      authenticated_.insert(from);
      return;
    }
    if (auth_ && authenticated_.count(from) == 0) {
      stats_.protocol_errors++;
      GL_LOG(kWarn) << name_ << ": dropped a frame from a connection that has not authenticated";
      return;
    }
    stats_.frames_received++;
    stats_.bytes_received += payload.size();
    (void)receiver_->OnFrame(*h, payload);  // a dropped frame is the receiver's to count
  }

  void Loop() {
    UniqueLock lock(mu_);
    while (true) {
      while (!stopped_ && queue_.empty()) cv_.Wait(mu_);
      if (queue_.empty()) break;  // stopped and drained
      auto fn = std::move(queue_.front());
      queue_.pop_front();
      lock.unlock();
      fn();
      lock.lock();
    }
    auto left = std::move(pending_sends_);
    pending_sends_.clear();
    lock.unlock();
    for (auto& [id, sent] : left) sent.second(Aborted("inproc lane '" + name_ + "' stopped"));
  }

  std::shared_ptr<InprocFabric> fabric_;
  const uint64_t id_;
  const std::string name_;
  Receiver* receiver_ = nullptr;
  std::thread thread_;
  Mutex mu_;
  CondVar cv_;
  std::deque<std::function<void()>> queue_ GUARDED_BY(mu_);
  std::vector<Peer> peers_ GUARDED_BY(mu_);
  std::map<uint64_t, std::pair<PeerId, SendCallback>> pending_sends_ GUARDED_BY(mu_);  // by id
  std::shared_ptr<const security::LaneAuthenticator> auth_;  // set before Start()
  std::set<uint64_t> authenticated_;  // sending lanes whose hello verified (lane thread only)
  uint64_t next_send_id_ GUARDED_BY(mu_) = 0;
  bool stopped_ GUARDED_BY(mu_) = false;
  AtomicStats stats_;
};

Result<std::unique_ptr<Lane>> InprocFabric::CreateLane(std::string name) {
  return std::unique_ptr<Lane>(new InprocLane(shared_from_this(), next_id_++, std::move(name)));
}

}  // namespace

std::shared_ptr<Fabric> CreateInprocFabric() { return std::make_shared<InprocFabric>(); }

}  // namespace gradlink::transport
