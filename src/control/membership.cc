#include "control/membership.h"

#include "common/log.h"

namespace gradlink {
namespace {

using transport::Clock;

// The control thread wakes at least this often: liveness, and the handler's tick.
constexpr auto kPoll = std::chrono::milliseconds(100);

}  // namespace

Status AbortStatus(const transport::Frame& abort, const std::string& what) {
  Result<std::string> text = wire::DecodeText(abort.payload);
  const Code code = abort.header.code == 0 ? Code::kAborted : static_cast<Code>(abort.header.code);
  return Status(code, what + ": " + (text.ok() ? *text : std::string("(no reason)")));
}

Membership::Membership(MembershipConfig config, std::string name)
    : config_(std::move(config)), name_(std::move(name)) {}

Membership::~Membership() { Leave(std::nullopt); }

Result<wire::WelcomeMsg> Membership::Join(const wire::RegisterMsg& reg, Clock::time_point deadline) {
  GL_ASSIGN_OR_RETURN(Joined joined, JoinJob(config_.scheduler, config_.job_hash, reg, deadline,
                                             config_.secret));
  id_.store(joined.welcome.your_id, std::memory_order_relaxed);
  name_ += " " + std::to_string(joined.welcome.your_id);
  MutexLock lock(channel_mu_);
  channel_ = std::move(joined.channel);
  return std::move(joined.welcome);
}

void Membership::Run(MembershipHandler* handler, std::function<void()> on_start) {
  handler_ = handler;
  thread_ = std::thread([this, on_start = std::move(on_start)] {
    if (on_start) on_start();
    Loop();
  });
}

std::shared_ptr<transport::ControlChannel> Membership::channel() const {
  MutexLock lock(channel_mu_);
  return channel_;
}

Status Membership::Send(const wire::Header& h, std::span<const std::byte> payload,
                        Clock::time_point deadline) {
  const std::shared_ptr<transport::ControlChannel> c = channel();
  if (!c) return Unavailable(name_ + " has not joined a job");
  return c->Send(h, payload, deadline);
}

Status Membership::SendOn(uint64_t generation, const wire::Header& h,
                          std::span<const std::byte> payload, Clock::time_point deadline) {
  std::shared_ptr<transport::ControlChannel> c;
  {
    MutexLock lock(channel_mu_);
    if (generation != generation_.load()) return Status::Ok();  // told in the ResumeState
    c = channel_;
  }
  return c->Send(h, payload, deadline);
}

void Membership::Reply(const wire::Header& h, std::span<const std::byte> payload) {
  const std::shared_ptr<transport::ControlChannel> c = channel();
  if (!c) return;  // not joined
  if (Status s = c->Send(h, payload); !s.ok()) {
    // Gone before it heard: the control thread's next read fails on the closed channel and
    // rejoins a restarted scheduler, which asks again (nobody holds the answer it missed).
    GL_LOG(kInfo) << name_ << ": an answer to the scheduler failed (" << s.message()
                  << "); hanging up";
    c->Close();
  }
}

void Membership::Leave(std::optional<Clock::time_point> goodbye_deadline) {
  leaving_ = true;
  rejoin_cancel_ = true;  // a rejoin under way ends within 100 ms
  if (left_.exchange(true)) return;
  if (const std::shared_ptr<transport::ControlChannel> c = channel()) {
    if (goodbye_deadline && !c->closed()) {
      wire::Header h;
      h.type = wire::MsgType::kGoodbye;
      h.job = config_.job_hash;
      h.sender = id();
      c->Send(h, {}, *goodbye_deadline).IgnoreError();
    }
    c->Close();
  }
  if (thread_.joinable()) thread_.join();
  // A rejoin that got through as we left installed a channel of its own: close it too.
  if (const std::shared_ptr<transport::ControlChannel> c = channel()) c->Close();
}

void Membership::Loop() {
  std::shared_ptr<transport::ControlChannel> channel = this->channel();
  std::optional<Liveness> liveness;
  liveness.emplace(channel.get(), config_.job_hash, id());
  // The scheduler is gone: carry on with a restarted one, or end.
  const auto recovered = [&](const std::string& why) {
    if (!Recover(why)) return false;
    channel = this->channel();
    liveness.emplace(channel.get(), config_.job_hash, id());
    return true;
  };
  while (!leaving_.load()) {
    if (Status alive = liveness->Tick(); !alive.ok()) {
      if (recovered(name_ + ": " + alive.message())) continue;
      return;
    }
    if (Status tick = handler_->OnTick(); !tick.ok()) {
      handler_->OnLost(tick);
      return;
    }
    const Clock::time_point tick = Clock::now() + kPoll;
    if (!channel->WaitReadable(tick)) continue;  // idle: no allocation per tick
    Result<transport::Frame> f = channel->Receive(tick);
    if (!f.ok()) {
      if (f.status().code() == Code::kTimeout) continue;
      if (recovered(name_ + " lost the scheduler: " + f.status().message())) continue;
      return;
    }
    liveness->Heard();
    if (f->header.type == wire::MsgType::kHeartbeat) continue;
    const ControlVerdict verdict = handler_->OnControl(*f);
    if (verdict.end) {
      if (verdict.hang_up) channel->Close();
      return;
    }
  }
}

bool Membership::Recover(const std::string& why) {
  channel()->Close();
  if (leaving_.load()) return false;  // Leave() closed it: not a failure
  if (Status back = Rejoin(why); !back.ok()) {
    handler_->OnLost(back);
    return false;
  }
  return true;
}

Status Membership::Rejoin(const std::string& why) {
  const auto timeout = config_.reconnect_timeout;
  if (timeout.count() == 0) return PeerLost(why);
  GL_ASSIGN_OR_RETURN(Rejoining rejoining, handler_->PrepareRejoin(why));
  GL_LOG(kWarn) << why << "; rejoining the job through a restarted scheduler at "
                << config_.scheduler << " for up to " << timeout.count() / 1000.0 << " s";
  const auto start = Clock::now();
  Result<Joined> joined = RejoinJob(config_.scheduler, config_.job_hash, rejoining.reg,
                                    start + timeout, config_.secret, rejoining.frames,
                                    &rejoin_cancel_);
  Status result;
  if (!joined.ok()) {
    result = Status(joined.status().code() == Code::kAborted ? Code::kAborted : Code::kPeerLost,
                    why + "; no scheduler took " + name_ + " back within " +
                        std::to_string(timeout.count()) + " ms: " + joined.status().message());
  } else {
    result = handler_->CheckWelcome(joined->welcome);
  }
  uint64_t generation = generation_.load();
  if (result.ok()) {
    MutexLock lock(channel_mu_);
    channel_ = std::move(joined->channel);
    generation = ++generation_;
  }
  handler_->OnRejoined(result, generation);
  if (result.ok()) {
    GL_LOG(kWarn) << name_ << " rejoined the job through the restarted scheduler ("
                  << std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - start)
                         .count()
                  << " ms after it was lost)";
  }
  return result;
}

}  // namespace gradlink
