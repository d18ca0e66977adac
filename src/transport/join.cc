#include "transport/join.h"

namespace gradlink {

Result<std::shared_ptr<transport::Fabric>> MakeFabric(const std::string& kind,
                                                      std::shared_ptr<transport::Fabric> given) {
  if (given) return given;
  if (kind == "ucx") {
    GL_ASSIGN_OR_RETURN(std::unique_ptr<transport::Fabric> f, transport::CreateUcxFabric());
    return std::shared_ptr<transport::Fabric>(std::move(f));
  }
  if (kind == "inproc") return InvalidArgument("transport 'inproc' needs options.fabric");
  return InvalidArgument("unknown transport '" + kind + "' (expected ucx or inproc)");
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

Result<Joined> JoinJob(const std::string& scheduler, uint32_t job_hash,
                       const wire::RegisterMsg& reg, transport::Clock::time_point deadline) {
  std::string host;
  uint16_t port = 0;
  GL_RETURN_IF_ERROR(transport::ParseHostPort(scheduler, &host, &port));
  GL_ASSIGN_OR_RETURN(auto channel, transport::ControlChannel::Connect(host, port, deadline));
  // The channel's errors name only the address: say whom we lost.
  const auto lost = [&](const Status& s) {
    return Status(s.code(), "lost the scheduler (" + scheduler + ") while joining: " + s.message());
  };
  wire::Header h;
  h.type = wire::MsgType::kRegister;
  h.job = job_hash;
  Status sent = channel->Send(h, wire::Encode(reg), deadline);
  if (!sent.ok()) return lost(sent);
  while (true) {
    auto f = channel->Receive(deadline);
    if (!f.ok()) {
      if (f.status().code() == Code::kTimeout) {
        return Timeout("the job did not start before the deadline (scheduler " + scheduler +
                       "): are all workers and servers started?");
      }
      return lost(f.status());
    }
    if (f->header.type == wire::MsgType::kHeartbeat) continue;
    if (f->header.type == wire::MsgType::kAbort) {
      auto text = wire::DecodeText(f->payload);
      return Aborted("scheduler " + scheduler + " refused us: " +
                     (text.ok() ? *text : std::string("(no reason)")));
    }
    if (f->header.type != wire::MsgType::kWelcome || f->header.job != job_hash) {
      return ProtocolError("expected kWelcome from scheduler " + scheduler);
    }
    GL_ASSIGN_OR_RETURN(wire::WelcomeMsg w, wire::DecodeWelcome(f->payload));
    return Joined{std::move(channel), std::move(w)};
  }
}

}  // namespace gradlink
