#include "control/join.h"

#include <algorithm>
#include <chrono>
#include <thread>

#include "common/log.h"

#include "security/handshake.h"

namespace gradlink {
namespace {

constexpr auto kJoinPoll = std::chrono::milliseconds(100);

}  // namespace

Result<std::shared_ptr<transport::Fabric>> FabricOrUcx(std::shared_ptr<transport::Fabric> given) {
  if (given) return given;
  GL_ASSIGN_OR_RETURN(std::unique_ptr<transport::Fabric> f, transport::CreateUcxFabric());
  return std::shared_ptr<transport::Fabric>(std::move(f));
}

Liveness::Liveness(transport::ControlChannel* channel, uint32_t job_hash, uint32_t sender)
    : channel_(channel), last_heard_(transport::Clock::now()) {
  heartbeat_.type = wire::MsgType::kHeartbeat;
  heartbeat_.job = job_hash;
  heartbeat_.sender = sender;
}

Status Liveness::Tick() {
  const auto now = transport::Clock::now();
  if (now - last_heard_ > transport::kSilenceLimit) {
    return PeerLost("the scheduler (" + channel_->peer_name() + ") sent nothing for " +
                    std::to_string(std::chrono::duration_cast<std::chrono::milliseconds>(
                                       now - last_heard_)
                                       .count()) +
                    " ms: hung or cut off");
  }
  if (now - last_sent_ >= transport::kHeartbeatInterval) {
    last_sent_ = now;
    Status s = channel_->Send(heartbeat_, {}, now + std::chrono::milliseconds(100));
    if (!s.ok() && s.code() != Code::kTimeout) return s;
  }
  return Status::Ok();
}

HeartbeatPump::HeartbeatPump(transport::ControlChannel* channel, uint32_t job_hash,
                             uint32_t sender) {
  wire::Header h;
  h.type = wire::MsgType::kHeartbeat;
  h.job = job_hash;
  h.sender = sender;
  thread_ = std::thread([this, channel, h] {
    UniqueLock lock(mu_);
    while (!stop_) {
      lock.unlock();
      // A failure is the control loop's to see (it sends and reads next): nothing to do here.
      channel->Send(h, {}, transport::Clock::now() + std::chrono::milliseconds(100)).IgnoreError();
      lock.lock();
      cv_.WaitUntil(mu_, transport::Clock::now() + transport::kHeartbeatInterval, [this] {
        mu_.AssertHeld();  // the wait runs it under `lock`
        return stop_;
      });
    }
  });
}

HeartbeatPump::~HeartbeatPump() {
  {
    MutexLock lock(mu_);
    stop_ = true;
  }
  cv_.NotifyAll();
  thread_.join();
}

namespace {

// The scheduler's kAbort: kAuthFailed when it refused us for authentication, else kAborted.
Status Refused(const std::string& scheduler, const transport::Frame& f) {
  auto text = wire::DecodeText(f.payload);
  const std::string why = text.ok() ? *text : std::string("(no reason)");
  if (f.header.code == static_cast<uint8_t>(Code::kAuthFailed)) {
    return Status(Code::kAuthFailed, "scheduler " + scheduler + " refused us: " + why);
  }
  return Aborted("scheduler " + scheduler + " refused us: " + why);
}

// The member's side of the handshake, on a fresh connection.
Status Authenticate(transport::ControlChannel& channel, const std::string& scheduler,
                    uint32_t job_hash, const wire::RegisterMsg& reg, const std::string& secret,
                    transport::Clock::time_point deadline, bool* heard) {
  security::HandshakeBinding b;
  b.job_hash = job_hash;
  b.role = reg.role;
  b.rank = reg.requested_rank;
  security::ClientHandshake hs(secret, b);
  const auto send = [&](const security::HandshakeMessage& m) {
    wire::Header h;
    h.type = m.type;
    h.job = job_hash;
    return channel.Send(h, m.payload, deadline);
  };
  const auto fail = [&](const Status& s) {
    channel.Close();
    return Status(Code::kAuthFailed,
                  "authenticating with scheduler " + scheduler + ": " + s.message());
  };
  GL_ASSIGN_OR_RETURN(security::HandshakeMessage hello, hs.Start());
  Status sent = send(hello);
  if (!sent.ok()) return Status(sent.code(), "lost the scheduler (" + scheduler + ") while authenticating: " + sent.message());
  while (!hs.done()) {
    auto f = channel.Receive(deadline);
    if (f.ok()) *heard = true;
    if (!f.ok()) {
      if (f.status().code() == Code::kTimeout) {
        return Timeout("scheduler " + scheduler + " did not answer the authentication handshake");
      }
      return Status(f.status().code(), "lost the scheduler (" + scheduler +
                                           ") while authenticating: " + f.status().message());
    }
    if (f->header.type == wire::MsgType::kAbort) return Refused(scheduler, *f);
    if (f->header.type == wire::MsgType::kHeartbeat) return fail(ProtocolError("heartbeat during the handshake"));
    auto reply = hs.Step(f->header.type, f->payload);
    if (!reply.ok()) return fail(reply.status());
    if (reply->has_value()) {
      Status s = send(**reply);
      if (!s.ok()) return Status(s.code(), "lost the scheduler (" + scheduler + ") while authenticating: " + s.message());
    }
  }
  return Status::Ok();
}

}  // namespace

namespace {

// One attempt on one connection. `connected`: whether the connection was made; `heard`: whether
// the scheduler sent anything on it.
Result<Joined> JoinOnce(const std::string& scheduler, const std::string& host, uint16_t port,
                        uint32_t job_hash, const wire::RegisterMsg& reg,
                        transport::Clock::time_point connect_deadline,
                        transport::Clock::time_point deadline,
                        const std::optional<std::string>& secret,
                        std::span<const ControlFrame> after_register,
                        const std::atomic<bool>* cancel, bool* connected, bool* heard) {
  GL_ASSIGN_OR_RETURN(auto channel,
                      transport::ControlChannel::Connect(host, port, connect_deadline,
                                                         transport::kRefusedGrace));
  *connected = true;
  // The channel's errors name only the address: say whom we lost.
  const auto lost = [&](const Status& s) {
    return Status(s.code(), "lost the scheduler (" + scheduler + ") while joining: " + s.message());
  };
  if (secret.has_value()) {
    GL_RETURN_IF_ERROR(Authenticate(*channel, scheduler, job_hash, reg, *secret, deadline, heard));
  }
  wire::Header h;
  h.type = wire::MsgType::kRegister;
  h.job = job_hash;
  Status sent = channel->Send(h, wire::Encode(reg), deadline);
  if (!sent.ok()) return lost(sent);
  for (const ControlFrame& f : after_register) {
    sent = channel->Send(f.header, f.payload, deadline);
    if (!sent.ok()) return lost(sent);
  }
  auto last_heard = transport::Clock::now();
  while (true) {
    auto f = channel->Receive(std::min(deadline, transport::Clock::now() + kJoinPoll));
    if (cancel != nullptr && cancel->load()) return Aborted("stopped while joining the job");
    if (!f.ok() && f.status().code() == Code::kTimeout && transport::Clock::now() < deadline) {
      if (transport::Clock::now() - last_heard > transport::kSilenceLimit) {
        return PeerLost("the scheduler (" + scheduler + ") sent nothing for " +
                        std::to_string(transport::kSilenceLimit.count()) +
                        " ms while we waited for the job to start: hung or cut off");
      }
      continue;
    }
    if (f.ok()) {
      last_heard = transport::Clock::now();
      *heard = true;
    }
    if (!f.ok()) {
      if (f.status().code() == Code::kTimeout) {
        return Timeout("the job did not start before the deadline (scheduler " + scheduler +
                       "): are all workers and servers started?");
      }
      return lost(f.status());
    }
    if (f->header.type == wire::MsgType::kHeartbeat) continue;
    if (f->header.type == wire::MsgType::kAbort) return Refused(scheduler, *f);
    if (f->header.type != wire::MsgType::kWelcome || f->header.job != job_hash) {
      return ProtocolError("expected kWelcome from scheduler " + scheduler);
    }
    GL_ASSIGN_OR_RETURN(wire::WelcomeMsg w, wire::DecodeWelcome(f->payload));
    return Joined{std::move(channel), std::move(w)};
  }
}

}  // namespace

// A connection the scheduler closes before it has sent anything on it was not refused (a
// refusal is a kAbort naming the reason): it made room for newer connections (a scheduler full
// of strangers' connections closes the oldest unregistered ones; scheduler_loop.cc AcceptAll).
// Such a join is tried again, until the deadline. The scheduler is still there, so a new
// connection is made at once; one refused for kReconnectLimit means it is gone: that fails.
Result<Joined> JoinJob(const std::string& scheduler, uint32_t job_hash,
                       const wire::RegisterMsg& reg, transport::Clock::time_point deadline,
                       const std::optional<std::string>& secret,
                       std::span<const ControlFrame> after_register,
                       const std::atomic<bool>* cancel) {
  constexpr auto kReconnectLimit = std::chrono::seconds(1);
  std::string host;
  uint16_t port = 0;
  GL_RETURN_IF_ERROR(transport::ParseHostPort(scheduler, &host, &port));
  auto backoff = std::chrono::milliseconds(10);
  for (int attempt = 0;; ++attempt) {
    bool connected = false, heard = false;
    const auto connect_deadline =
        attempt == 0 ? deadline : std::min(deadline, transport::Clock::now() + kReconnectLimit);
    Result<Joined> j = JoinOnce(scheduler, host, port, job_hash, reg, connect_deadline, deadline,
                                secret, after_register, cancel, &connected, &heard);
    const Code code = j.ok() ? Code::kOk : j.status().code();
    const bool closed_unheard =
        connected && !heard && (code == Code::kPeerLost || code == Code::kUnavailable);
    if (j.ok() || !closed_unheard || transport::Clock::now() + backoff >= deadline) return j;
    if (attempt == 0 || attempt % 10 == 0) {
      GL_LOG(kInfo) << "scheduler " << scheduler << " closed our connection before answering ("
                    << j.status().message() << "); joining again";
    }
    std::this_thread::sleep_for(backoff);
    backoff = std::min(backoff * 2, std::chrono::milliseconds(200));
  }
}

Result<Joined> RejoinJob(const std::string& scheduler, uint32_t job_hash,
                         const wire::RegisterMsg& reg, transport::Clock::time_point deadline,
                         const std::optional<std::string>& secret,
                         std::span<const ControlFrame> after_register,
                         const std::atomic<bool>* cancel) {
  for (;;) {
    if (cancel->load()) return Aborted("stopped while rejoining the job");
    Result<Joined> j = JoinJob(scheduler, job_hash, reg, deadline, secret, after_register, cancel);
    const Code code = j.ok() ? Code::kOk : j.status().code();
    // Nothing listens yet, or the old scheduler's port is not free yet: a restart in progress.
    const bool again = code == Code::kUnavailable || code == Code::kPeerLost;
    if (j.ok() || !again || transport::Clock::now() + kJoinPoll >= deadline) return j;
    std::this_thread::sleep_for(kJoinPoll);
  }
}

}  // namespace gradlink
