// The scheduler's event loop (scheduler_impl.h): accepting, polling, deadlines, authentication
// and closing. The job's own logic is in scheduler.cc.
#include <poll.h>
#include <sys/socket.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <map>
#include <thread>

#include "common/log.h"
#include "scheduler/scheduler_impl.h"

namespace gradlink::scheduler {
namespace {

using transport::Frame;
using wire::MsgType;

// Connections accepted per pass, so a burst of them does not hold up the others' traffic.
constexpr int kAcceptsPerPass = 64;

int64_t Ms(Clock::duration d) {
  return std::chrono::duration_cast<std::chrono::milliseconds>(d).count();
}

const char kNoSecret[] =
    "this scheduler requires the job secret and the member has none: set GRADLINK_SECRET "
    "(or GRADLINK_SECRET_FILE) to the scheduler's";

}  // namespace

SchedulerImpl::SchedulerImpl(const SchedulerOptions& o, std::unique_ptr<transport::Listener> l,
                             int wake_fd)
    : opts_(o),
      job_hash_(wire::JobHash(o.job)),
      listener_(std::move(l)),
      wake_fd_(wake_fd),
      placer_(o.num_servers) {
  started_at_ = Clock::now();
  if (!opts_.secret.has_value()) {
    GL_LOG(kWarn) << "scheduler: job '" << opts_.job << "' has no secret (GRADLINK_SECRET): "
                  << "anyone who can reach port " << listener_->port()
                  << " can join it (docs/security.md)";
  }
  loop_ = std::thread([this] { Loop(); });
}

SchedulerImpl::~SchedulerImpl() {
  Stop();
  ::close(wake_fd_);
}

Status SchedulerImpl::Wait(Clock::time_point deadline) {
  MutexLock lock(mu_);
  if (!cv_.WaitUntil(mu_, deadline, [this] {
        mu_.AssertHeld();  // the wait runs it under `lock`
        return ended_;
      })) {
    return Timeout("job '" + opts_.job + "' still running");
  }
  return result_;
}

void SchedulerImpl::Stop() {
  {
    MutexLock lock(mu_);
    if (stop_called_) return;
    stop_called_ = true;
  }
  // The loop ends the job (kAbort to everyone if it was running), writes what is queued for at
  // most kFlushBeforeClose, closes every connection and returns.
  stop_requested_ = true;
  const uint64_t one = 1;
  [[maybe_unused]] ssize_t n = ::write(wake_fd_, &one, sizeof(one));
  if (loop_.joinable()) loop_.join();
  listener_->Close();
}

void SchedulerImpl::Loop() {
  std::optional<Clock::time_point> drain_until;  // set once Stop() asked
  std::vector<pollfd> fds;
  std::vector<Connection*> polled;  // polled[i] owns fds[first_conn + i]
  while (true) {
    auto now = Clock::now();
    if (stop_requested_.load() && !drain_until.has_value()) {
      if (!finished()) Finish(Aborted("scheduler stopped"));
      drain_until = now + kFlushBeforeClose;
    }
    if (drain_until.has_value()) {
      SendServerAbortWhenDue(now);
      if (AllFlushed() || now >= *drain_until) break;
    } else {
      OnTimers(now);
      if (!finished()) CheckStalls(now);
    }
    Reap();
    RefreshView(now);

    fds.clear();
    polled.clear();
    fds.push_back({wake_fd_, POLLIN, 0});
    const bool accepting =
        !drain_until.has_value() && listener_->fd() >= 0 && now >= accept_paused_until_;
    if (accepting) fds.push_back({listener_->fd(), POLLIN, 0});
    const size_t first_conn = fds.size();
    for (auto& c : conns_) {
      short events = c->link.PollEvents();
      if (drain_until.has_value()) events &= POLLOUT;  // stopping: only what is queued goes out
      if (events == 0) continue;
      fds.push_back({c->link.fd(), events, 0});
      polled.push_back(c.get());
    }
    // Wake for the next heartbeat on time, and at least every kTick for the other deadlines.
    Clock::duration wait = kTick;
    if (drain_until.has_value()) {
      wait = std::min<Clock::duration>(wait, *drain_until - now);
    } else if (!finished()) {
      wait = std::min<Clock::duration>(wait, last_heartbeat_ + transport::kHeartbeatInterval - now);
    }
    const int timeout_ms = static_cast<int>(std::clamp<int64_t>(Ms(wait) + 1, 0, Ms(kTick)));
    const int ready = ::poll(fds.data(), fds.size(), timeout_ms);
    if (ready < 0 && errno != EINTR) {
      GL_LOG(kError) << "scheduler: poll failed: " << std::strerror(errno);
      std::this_thread::sleep_for(kTick);  // never spin; the deadlines still run
      continue;
    }
    now = Clock::now();
    if (fds[0].revents != 0) {
      uint64_t v;
      [[maybe_unused]] ssize_t n = ::read(wake_fd_, &v, sizeof(v));
    }
    if (accepting && fds[1].revents != 0) AcceptAll(now);
    for (size_t i = 0; i < polled.size(); ++i) {
      const short re = fds[first_conn + i].revents;
      Connection& c = *polled[i];
      if (re == 0 || c.link.closed()) continue;
      if (!drain_until.has_value() && (re & (POLLIN | POLLERR | POLLHUP)) != 0) {
        ProcessInput(c, now);
      }
      if ((re & (POLLOUT | POLLERR | POLLHUP)) != 0) c.link.Flush().IgnoreError();
    }
    if (!drain_until.has_value()) CheckSendErrors(now);
  }
  CloseGracefully(Clock::now() + kLingerBeforeClose);
}

void SchedulerImpl::CloseGracefully(Clock::time_point deadline) {
  // Closing a socket that holds unread input (a member's last heartbeat) sends a reset, and a
  // reset makes the member's kernel drop what it has not read yet: its kShutdown, so a member of
  // a job that ended well exited with "lost the scheduler" (CI, under load: 2 runs in 462). So
  // each connection is half-closed (the member reads to the end of what was sent), then read
  // and discarded until the member closes its end too, or the deadline.
  std::vector<pollfd> open;
  for (auto& c : conns_) {
    const int fd = c->link.fd();
    if (c->link.closed() || fd < 0) continue;
    ::shutdown(fd, SHUT_WR);
    open.push_back({fd, POLLIN, 0});
  }
  std::byte sink[4096];
  while (!open.empty()) {
    const auto left = deadline - Clock::now();
    if (left <= Clock::duration::zero()) break;
    if (::poll(open.data(), open.size(), static_cast<int>(Ms(left)) + 1) < 0 && errno != EINTR) {
      break;
    }
    for (size_t i = 0; i < open.size();) {
      if (open[i].revents == 0) {
        ++i;
        continue;
      }
      const ssize_t got = ::recv(open[i].fd, sink, sizeof(sink), MSG_DONTWAIT);
      if (got > 0 || (got < 0 && (errno == EAGAIN || errno == EINTR))) {
        open[i].revents = 0;
        ++i;
        continue;
      }
      open[i] = open.back();  // the member closed (or the connection failed): done with it
      open.pop_back();
    }
  }
  for (auto& c : conns_) c->link.Close();
}

namespace {

// The host part of a peer name "host:port" ("[v6]:port" keeps its brackets).
std::string SourceAddress(const std::string& peer) {
  const size_t colon = peer.rfind(':');
  return colon == std::string::npos ? peer : peer.substr(0, colon);
}

}  // namespace

// Connections that have not registered hold a slot each (kMaxUnregistered in all,
// kMaxUnregisteredPerAddress from one address). A new connection never waits for a slot: when
// its address is at its cap, that address's oldest unregistered connection is closed; when all
// slots are taken, the oldest of the address holding the most. Strangers that only connect can
// then not shut members out: an honest member registers within milliseconds of connecting, and
// to evict it a stranger needs more addresses than it has slots (members also retry a join
// whose connection was closed before the scheduler said anything: control/join.cc).
void SchedulerImpl::AcceptAll(Clock::time_point now) {
  // Only the connections that have not registered, not all of conns_: with thousands of members
  // a scan of every connection per accepted one made joining quadratic.
  std::erase_if(unregistered_, [](const std::weak_ptr<Connection>& w) {
    const auto c = w.lock();
    return c == nullptr || c->registered || c->link.closed();
  });
  std::map<std::string, std::vector<Connection*>> waiting;  // unregistered, oldest first
  size_t unregistered = 0;
  for (const auto& w : unregistered_) {
    Connection* c = w.lock().get();  // conns_ holds it
    waiting[SourceAddress(c->link.peer_name())].push_back(c);
    ++unregistered;
  }
  const auto evict = [&](std::vector<Connection*>& from) {
    Connection* victim = from.front();
    from.erase(from.begin());
    --unregistered;
    ++evicted_;
    if (evicted_ <= 10 || evicted_ % 1000 == 0) {
      GL_LOG(kWarn) << "scheduler: " << unregistered + 1 << " connections have not registered; "
                    << "closing the oldest, " << victim->link.peer_name() << " (" << evicted_
                    << " closed so far)";
    }
    victim->link.Close();
  };
  for (int i = 0; i < kAcceptsPerPass; ++i) {
    auto ch = listener_->Accept(now);  // a deadline already passed: does not wait
    if (!ch.ok()) {
      if (ch.status().code() == Code::kTimeout) return;
      GL_LOG(kWarn) << "scheduler: accept failed: " << ch.status().ToString();
      accept_paused_until_ = now + kTick;  // out of fds, say: not in a tight loop
      return;
    }
    auto c = std::make_shared<Connection>(std::move(ch).value(), now);
    c->link.CountInto(&control_counters_);
    std::vector<Connection*>& same = waiting[SourceAddress(c->link.peer_name())];
    if (same.size() >= kMaxUnregisteredPerAddress) {
      evict(same);
    } else if (unregistered >= kMaxUnregistered) {
      auto most = std::max_element(waiting.begin(), waiting.end(), [](const auto& a, const auto& b) {
        return a.second.size() < b.second.size();
      });
      evict(most->second);
    }
    if (opts_.secret.has_value()) c->handshake.emplace(*opts_.secret, job_hash_, /*epoch=*/0);
    same.push_back(c.get());
    unregistered_.push_back(c);
    conns_.push_back(std::move(c));
    ++unregistered;
  }
}

void SchedulerImpl::ProcessInput(Connection& c, Clock::time_point now) {
  c.link.ReadSome(now);
  while (!c.link.closed() && !c.link.closing()) {
    // Before authentication a frame is bounded as ControlChannel::ReceiveBounded bounds it.
    FrameRules rules;
    if (c.handshake.has_value()) {
      rules.max_payload = security::kMaxHandshakePayload;
      rules.allow_data_error = false;
    }
    wire::Header header;
    header.type = MsgType::kHeartbeat;  // none seen yet
    auto f = c.link.NextFrame(rules, &header);
    if (!f.ok()) {
      OnBadInput(c, f.status(), header, now);
      return;
    }
    if (!f->has_value()) return;
    OnFrame(c, **f, now);
  }
}

void SchedulerImpl::OnFrame(Connection& c, const Frame& f, Clock::time_point now) {
  if (c.handshake.has_value()) {
    Authenticate(c, f, now);
    return;
  }
  Status s = Handle(c, f);
  if (s.ok()) return;
  if (s.code() == Code::kProtocolError) {
    protocol_errors_++;
    // Its frames decode: it speaks the protocol and hears why (a refusal is never silent, so a
    // member tells it apart from a close that made room: control/join.cc).
    Refuse(c, s);
  }
  GL_LOG(kWarn) << "scheduler: closing " << c.link.peer_name() << ": " << s.ToString();
  c.link.CloseAfterFlush(now + kFlushBeforeClose);  // a refusal (kAbort) may be queued
  ConnectionLost(c, s);
}

void SchedulerImpl::OnBadInput(Connection& c, const Status& why, const wire::Header& header,
                               Clock::time_point now) {
  const bool protocol = why.code() == Code::kProtocolError;
  if (c.handshake.has_value()) {
    if (header.type == MsgType::kRegister && protocol) {
      AuthFailure(c, kNoSecret, true, now);  // a member without a secret: its kRegister
      return;
    }
    if (protocol) protocol_errors_++;
    // Only a frame refused for its size leaves the stream readable for the member (its header
    // was valid): then it hears why. Otherwise it is closed at once.
    const bool tell = protocol && header.payload_bytes > security::kMaxHandshakePayload;
    AuthFailure(c, why.message(), tell, now);
    return;
  }
  if (protocol) protocol_errors_++;
  c.link.Close();
  ConnectionLost(c, why);
}

void SchedulerImpl::Authenticate(Connection& c, const Frame& f, Clock::time_point now) {
  if (f.header.job != job_hash_) {
    AuthFailure(c, "frame of another job", true, now);
    return;
  }
  auto reply = c.handshake->Step(f.header.type, f.payload);
  if (!reply.ok()) {
    AuthFailure(c, f.header.type == MsgType::kRegister ? kNoSecret : reply.status().message(),
                true, now);
    return;
  }
  c.link.Send(MakeHeader(reply->type), reply->payload, now);
  if (c.handshake->done()) {
    c.auth_role = c.handshake->role();
    c.auth_rank = c.handshake->rank();
    c.handshake.reset();
  }
}

void SchedulerImpl::AuthFailure(Connection& c, const std::string& why, bool tell,
                                Clock::time_point now) {
  auth_failures_++;
  NoteRefusal(c, "authentication failed: " + why);
  GL_LOG(kWarn) << "scheduler: authentication failed for " << c.link.peer_name() << ": " << why
                << "; closing";
  c.handshake.reset();
  if (tell) {
    wire::Header h = MakeHeader(MsgType::kAbort);
    h.code = static_cast<uint8_t>(Code::kAuthFailed);
    c.link.Send(h, wire::EncodeText("authentication failed: " + why), now);
    c.link.CloseAfterFlush(now + kFlushBeforeClose);
  } else {
    c.link.Close();
  }
}

void SchedulerImpl::OnTimers(Clock::time_point now) {
  if (resuming_ && !started_ && !finished() && now - resume_began_ > kResumeTimeout) {
    Finish(Timeout("resuming job '" + opts_.job + "' after a scheduler restart: " +
                   ResumeMissing() + " did not re-register within " +
                   std::to_string(Ms(kResumeTimeout)) + " ms"));
  }
  if (!resuming_ && !started_ && !finished() && now - started_at_ > opts_.join_timeout) {
    Finish(Timeout("only " + std::to_string(registered_workers_) + " of " +
                   std::to_string(opts_.num_workers) + " workers and " +
                   std::to_string(registered_servers_) + " of " +
                   std::to_string(opts_.num_servers) + " servers joined within " +
                   std::to_string(opts_.join_timeout.count()) + " ms"));
  }
  for (size_t i = 0; i < conns_.size(); ++i) CheckConnection(*conns_[i], now);
  SendServerAbortWhenDue(now);
  if (finished()) return;
  // Once the job runs, a member silent for kSilenceLimit (hung, stopped, cut off) fails the job,
  // naming it. Members that registered and wait for the others hear heartbeats too (they watch
  // for a hung scheduler); their own silence counts only once the job has started.
  if (started_) {
    for (auto& c : conns_) {
      if (!c->registered || c->left) continue;
      if (c->welcome_queued) {
        // Busy, not silent: its welcome (O(members) bytes) is still being written to it, and a
        // member that does not read it is failed by CheckConnection. Its silence counts from
        // when the scheduler has written all of it.
        if (c->link.queued_bytes() != 0) continue;
        c->welcome_queued = false;
        c->last_heard = std::max(c->last_heard, now);
      }
      if (now - c->last_heard > transport::kSilenceLimit) {
        MemberLost(*c, MemberName(*c) + " sent nothing for " +
                           std::to_string(Ms(now - c->last_heard)) + " ms: hung or cut off");
        if (finished()) return;
      }
    }
  }
  if (now - last_heartbeat_ < transport::kHeartbeatInterval) return;
  last_heartbeat_ = now;
  for (auto& c : conns_) {
    if (c->registered && !c->left) Send(*c, MakeHeader(MsgType::kHeartbeat));
  }
}

void SchedulerImpl::CheckConnection(Connection& c, Clock::time_point now) {
  c.link.ExpireClose(now);
  if (c.link.closed()) return;
  if (c.handshake.has_value() && now - c.accepted > kHandshakeTimeout) {
    AuthFailure(c, "no complete handshake within " + std::to_string(Ms(kHandshakeTimeout)) + " ms",
                false, now);
    return;
  }
  if (!c.registered && now - c.accepted > kRegisterTimeout) {
    GL_LOG(kWarn) << "scheduler: " << c.link.peer_name() << " did not register in time; closing";
    c.link.Close();
    return;
  }
  const auto partial = c.link.partial_since();
  if (!c.link.closing() && partial.has_value() && now - *partial > kFrameGrace) {
    c.link.Close();
    ConnectionLost(c, Timeout("receiving from " + c.link.peer_name() + " timed out"));
    return;
  }
  // A member that does not read what it is sent (hung, stopped, cut off, or a socket that only
  // fills) is failed alone, as a silent one is: nothing else waits on it.
  const auto oldest = c.link.oldest_queued();
  const size_t queued = c.link.queued_bytes();
  const bool stalled = oldest.has_value() && now - *oldest > transport::kSilenceLimit;
  if (queued > kMaxQueuedBytes || stalled) {
    const std::string waited = std::to_string(oldest.has_value() ? Ms(now - *oldest) : 0) + " ms";
    const std::string why =
        queued > kMaxQueuedBytes
            ? std::to_string(queued) + " bytes wait for it (the limit is " +
                  std::to_string(kMaxQueuedBytes) + "), the oldest for " + waited
            : std::to_string(queued) + " bytes wait for it, the oldest for " + waited +
                  " (the limit is " + std::to_string(Ms(transport::kSilenceLimit)) + " ms)";
    c.link.Close();
    if (c.registered && !c.left && !finished()) {
      MemberLost(c, MemberName(c) + " does not read what the scheduler sends (" + why +
                        "): hung or cut off");
    } else {
      GL_LOG(kWarn) << "scheduler: closing " << c.link.peer_name() << ": " << why;
    }
  }
}

void SchedulerImpl::CheckSendErrors(Clock::time_point now) {
  for (size_t i = 0; i < conns_.size(); ++i) {
    Connection& c = *conns_[i];
    if (c.link.closed() || c.link.send_error().ok()) continue;
    // The peer went away; what it sent before (a goodbye) is still to be read. A few rounds
    // reach the end of it (EOF), which ProcessInput reports.
    for (int round = 0; round < 16 && !c.link.closed() && !c.link.closing(); ++round) {
      ProcessInput(c, now);
    }
    if (c.link.closed()) continue;
    const Status why = c.link.send_error();
    c.link.Close();
    if (c.handshake.has_value()) {
      AuthFailure(c, "sending the handshake: " + why.message(), false, now);
    } else {
      ConnectionLost(c, why);
    }
  }
}

void SchedulerImpl::Reap() {
  std::erase_if(conns_, [](const std::shared_ptr<Connection>& c) {
    return !c->registered && c->link.closed();
  });
}

bool SchedulerImpl::AllFlushed() const {
  if (server_abort_due_.has_value()) return false;
  return std::all_of(conns_.begin(), conns_.end(), [](const std::shared_ptr<Connection>& c) {
    return c->link.closed() || c->link.queued_bytes() == 0;
  });
}

}  // namespace gradlink::scheduler
