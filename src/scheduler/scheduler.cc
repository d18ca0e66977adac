// The scheduler's job logic (scheduler_impl.h): registration, the welcome, barriers, joins,
// goodbyes and the end of the job (a key's plan: planning.cc). Everything here runs on the loop
// thread (scheduler_loop.cc); sending is queueing on the member's connection and never waits.
#include <sys/eventfd.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <cstring>
#include <random>
#include <sstream>

#include "common/log.h"
#include "common/naming.h"
#include "control/layout.h"
#include "metrics/endpoint.h"
#include "scheduler/scheduler_impl.h"

namespace gradlink {
namespace scheduler {
namespace {

using transport::Frame;
using wire::MsgType;
using wire::Role;

std::string RoleName(Role r) { return r == Role::kWorker ? "worker" : "server"; }

std::string FormatWeight(double w) {
  std::ostringstream o;
  o << w;
  return o.str();
}

}  // namespace

wire::Header SchedulerImpl::MakeHeader(MsgType t) const {
  wire::Header h;
  h.type = t;
  h.job = job_hash_;
  h.sender = wire::kSchedulerId;
  return h;
}

std::string SchedulerImpl::MemberName(const Connection& c) const {
  return RoleName(c.role) + " " + (started_ ? std::to_string(c.id) : std::string("?")) + " (" +
         c.reg.host + ", " + c.link.peer_name() + ")";
}

void SchedulerImpl::Send(Connection& c, const wire::Header& h, std::span<const std::byte> payload) {
  c.link.Send(h, payload, Clock::now());
}

void SchedulerImpl::ConnectionLost(Connection& c, const Status& why) {
  MemberLost(c, MemberName(c) + " lost its connection to the scheduler: " + why.message());
}

Status SchedulerImpl::Handle(Connection& c, const Frame& f) {
  if (f.header.job != job_hash_) {
    Refuse(c, InvalidArgument("a member of another job (job hash " +
                              std::to_string(f.header.job) + "): this scheduler runs job '" +
                              opts_.job + "'"));
    return InvalidArgument("frame of another job (job hash " + std::to_string(f.header.job) +
                           ", expected '" + opts_.job + "')");
  }
  if (!opts_.secret.has_value() && security::IsHandshakeType(f.header.type)) {
    auth_failures_++;
    const Status why(Code::kAuthFailed,
                     "authentication failed: this scheduler runs without a job secret and the "
                     "member has one: give the scheduler the same GRADLINK_SECRET, or unset it "
                     "on the member");
    Refuse(c, why);
    return why;
  }
  c.last_heard = Clock::now();
  if (!c.registered && f.header.type != MsgType::kRegister) {
    return ProtocolError("first frame must be kRegister");
  }
  switch (f.header.type) {
    case MsgType::kRegister: return OnRegister(c, f);
    case MsgType::kDeclare: return OnDeclare(c, f);
    case MsgType::kResumeKey: return OnResumeKey(c, f);
    case MsgType::kRetire: return OnRetire(c, f);
    case MsgType::kAssignAck: return OnAssignAck(c, f);
    case MsgType::kBarrier: return OnBarrier(c, f);
    case MsgType::kJoin: return OnJoin(c, f);
    case MsgType::kPeerLookup: return OnPeerLookup(c, f);
    case MsgType::kStallReport: return OnStallReport(c, f);
    case MsgType::kJoinRelease: return OnJoinReleaseAck(c);
    case MsgType::kGoodbye: return OnGoodbye(c);
    case MsgType::kHeartbeat: return started_ ? Status::Ok() : ProtocolError("early kHeartbeat");
    default:
      return ProtocolError("unexpected message type " +
                           std::to_string(static_cast<int>(f.header.type)));
  }
}

Status SchedulerImpl::OnRegister(Connection& c, const Frame& f) {
  if (c.registered) return ProtocolError("registered twice");
  GL_ASSIGN_OR_RETURN(wire::RegisterMsg reg, wire::DecodeRegister(f.payload));
  if (opts_.secret.has_value() && (reg.role != c.auth_role || reg.requested_rank != c.auth_rank)) {
    return ProtocolError("kRegister as " + RoleName(reg.role) + " rank " +
                         std::to_string(reg.requested_rank) + " after authenticating as " +
                         RoleName(c.auth_role) + " rank " + std::to_string(c.auth_rank));
  }
  if (reg.metrics_port != 0) {
    c.metrics_address = metrics::HostPort(transport::SocketHost(c.link.fd(), true),
                                          reg.metrics_port);
  }
  if (reg.resume.has_value()) return RegisterResume(c, std::move(reg));
  if (resuming_ && !started_ && reg.role == Role::kWorker) {
    Refuse(c, InvalidArgument("job '" + opts_.job + "' is resuming after a scheduler restart: "
                              "only its workers rejoin it"));
    return InvalidArgument("a new worker while the job resumes");
  }
  if (reg.role == Role::kServer && (reg.standby || started_ || resuming_)) {
    return RegisterStandby(c, std::move(reg));
  }
  uint32_t& have = reg.role == Role::kWorker ? registered_workers_ : registered_servers_;
  const uint32_t want = reg.role == Role::kWorker ? opts_.num_workers : opts_.num_servers;
  if (started_ || have >= want) {
    Refuse(c, InvalidArgument("job '" + opts_.job + "' already has its " + std::to_string(want) +
                              " " + RoleName(reg.role) + "s"));
    return InvalidArgument("a " + RoleName(reg.role) + " too many");
  }
  if (reg.requested_rank >= 0 && static_cast<uint32_t>(reg.requested_rank) >= want) {
    const std::string what = reg.role == Role::kWorker ? "rank " : "server id ";
    Refuse(c, InvalidArgument(what + std::to_string(reg.requested_rank) + " out of range for " +
                              std::to_string(want) + " " + RoleName(reg.role) + "s"));
    return InvalidArgument(what + "out of range");
  }
  c.registered = true;
  c.role = reg.role;
  c.reg = std::move(reg);
  ++have;
  if (registered_workers_ == opts_.num_workers && registered_servers_ == opts_.num_servers) {
    return StartJob();
  }
  return Status::Ok();
}

void SchedulerImpl::NoteRefusal(const Connection& c, const std::string& why) {
  constexpr size_t kMaxRefusalsNamed = 4;
  if (started_) return;
  ++refused_;
  if (refusals_.size() < kMaxRefusalsNamed) refusals_.push_back(c.link.peer_name() + ": " + why);
}

std::string SchedulerImpl::RefusalsText() const {
  if (refused_ == 0) return "";
  std::string out = "; while it waited, the scheduler refused " + std::to_string(refused_) +
                    (refused_ == 1 ? " member" : " members") + " (";
  for (size_t i = 0; i < refusals_.size(); ++i) out += (i ? "; " : "") + refusals_[i];
  if (refused_ > refusals_.size()) out += "; ...";
  return out + ")";
}

void SchedulerImpl::SendWelcome(Connection& c, const Payload& book, Clock::time_point now) {
  std::array<std::byte, 4> id;  // your_id, the first field of a WelcomeMsg
  for (size_t i = 0; i < id.size(); ++i) id[i] = std::byte((c.id >> (8 * i)) & 0xFF);
  c.link.Send(MakeHeader(MsgType::kWelcome), id, book, now);
  c.welcome_queued = true;
}

uint64_t SchedulerImpl::BudgetOf(const wire::RegisterMsg& reg, uint32_t on_host) {
  if (reg.memory_budget != 0) return reg.memory_budget;
  if (reg.available_memory != 0) return reg.available_memory / 4 * 3 / std::max(on_host, 1u);
  return UINT64_MAX;
}

void SchedulerImpl::Refuse(Connection& c, const Status& why) {
  NoteRefusal(c, why.message());
  wire::Header h = MakeHeader(MsgType::kAbort);
  h.code = static_cast<uint8_t>(why.code());
  Send(c, h, wire::EncodeText(why.message()));
}

// Everyone is here: assign ids, send the address book.
Status SchedulerImpl::StartJob() {
  std::vector<Connection*> workers(opts_.num_workers, nullptr), servers(opts_.num_servers, nullptr);
  std::vector<Connection*> unranked, unnumbered;
  std::vector<Connection*> standbys;
  for (auto& c : conns_) {
    if (!c->registered || c->left) continue;
    if (c->role == Role::kServer && c->reg.standby) {
      standbys.push_back(c.get());
      continue;
    }
    std::vector<Connection*>& by_id = c->role == Role::kServer ? servers : workers;
    if (c->reg.requested_rank >= 0) {
      const auto r = static_cast<uint32_t>(c->reg.requested_rank);
      if (by_id[r] != nullptr) {
        Finish(InvalidArgument("two " + RoleName(c->role) + "s asked for " +
                               (c->role == Role::kServer ? "server id " : "rank ") +
                               std::to_string(r) + ": " + by_id[r]->reg.host + " and " +
                               c->reg.host));
        return Status::Ok();
      }
      c->id = r;
      by_id[r] = c.get();
    } else {
      (c->role == Role::kServer ? unnumbered : unranked).push_back(c.get());
    }
  }
  // Servers that claimed no id (gradlink-run gives each its own, so that its names and the
  // scheduler's agree) take the free ones heaviest weight first, then in connection order: the
  // plan then depends only on the weights, not on which server connected first (servers of
  // equal weight are interchangeable); with equal weights the ids are in connection order.
  std::stable_sort(unnumbered.begin(), unnumbered.end(),
                   [](const Connection* a, const Connection* b) {
                     return a->reg.weight > b->reg.weight;
                   });
  size_t free_id = 0;
  for (Connection* c : unnumbered) {
    while (servers[free_id] != nullptr) ++free_id;
    c->id = static_cast<uint32_t>(free_id);
    servers[free_id] = c;
  }
  std::vector<double> weights;
  for (Connection* c : servers) weights.push_back(c->reg.weight);
  placer_ = Placer(weights);
  // Memory budgets: a server's own, else three quarters of what its host had available, split
  // between the job's servers on that host (a test, or servers beside training processes).
  std::map<std::string, uint32_t, std::less<>> servers_on_host;
  for (Connection* c : servers) ++servers_on_host[std::string(MachineOf(c->reg.host))];
  budget_.assign(servers.size(), UINT64_MAX);
  held_.assign(servers.size(), 0);
  for (Connection* c : servers) {
    budget_[c->id] = BudgetOf(c->reg, servers_on_host.find(MachineOf(c->reg.host))->second);
  }
  size_t next = 0;
  for (Connection* c : unranked) {
    while (workers[next] != nullptr) ++next;
    c->id = static_cast<uint32_t>(next);
    workers[next] = c;
  }
  started_ = true;
  const auto now = Clock::now();
  for (auto& c : conns_) c->last_heard = now;
  wire::WelcomeMsg w;
  std::random_device entropy;
  w.instance = uint64_t{entropy()} << 32 | entropy();
  w.num_workers = opts_.num_workers;
  w.num_servers = opts_.num_servers;
  for (Connection* c : workers) {
    w.members.push_back(
        {Role::kWorker, c->id, c->reg.host, c->reg.push_address, c->reg.pull_address});
  }
  for (Connection* c : servers) {
    w.members.push_back(
        {Role::kServer, c->id, c->reg.host, c->reg.push_address, c->reg.pull_address});
  }
  // The address book is the same for everyone and O(members): encoded once and shared by every
  // member's queue, or thousands of members would queue O(members^2) bytes. your_id is the
  // first field of the encoding (4 bytes little-endian, wire/messages.cc): each member's own.
  const auto share_book = [](const wire::WelcomeMsg& m) {
    std::vector<std::byte> all = wire::Encode(m);
    return Share(std::vector<std::byte>(all.begin() + 4, all.end()));
  };
  // The job's tuning, as every member will compute it from this same book (control/tuning.h).
  tuning_ = tuning::Choose(w);
  hosts_ = topology::Of(w);
  GL_LOG(kInfo) << "tuning: " << tuning_.why << " (partitions of up to " << tuning_.partition_bytes
                << " bytes where the workers do not set them)";
  server_book_ = share_book(w);
  // Workers connect to servers only, so their book leaves out the other workers' lane
  // addresses (hundreds of bytes each over UCX): it keeps every worker's host name (the
  // same-host path groups by it) and worker 0's push address (it names the run's shared
  // segment). With 4,000 members that makes each worker's welcome several times smaller.
  for (wire::Member& m : w.members) {
    if (m.role != Role::kWorker) continue;
    m.pull_address.clear();
    if (m.id != 0) m.push_address.clear();
  }
  const Payload worker_book = share_book(w);
  for (auto& c : conns_) {
    if (!c->registered || (c->role == Role::kServer && c->reg.standby)) continue;
    (c->role == Role::kWorker ? workers_ : servers_)[c->id] = c;
    SendWelcome(*c, c->role == Role::kWorker ? worker_book : server_book_, now);
  }
  // Standbys after every worker's welcome, so that each learns of them (kServerJoined) once it
  // is in the job. Two that asked for one id: the second is refused.
  waiting_standbys_ = 0;
  for (Connection* c : standbys) {
    if (c->reg.requested_rank >= 0 &&
        servers_.count(static_cast<uint32_t>(c->reg.requested_rank)) != 0) {
      Refuse(*c, InvalidArgument("two standby servers asked for server id " +
                                 std::to_string(c->reg.requested_rank)));
      c->registered = false;
      continue;
    }
    AdmitStandby(*c);
  }
  std::string weight_list;
  if (std::any_of(weights.begin(), weights.end(), [](double x) { return x != 1.0; })) {
    weight_list = "; placement weights:";
    for (Connection* c : servers) {
      weight_list += (c->id == 0 ? " server " : ", server ") + std::to_string(c->id) + " (" +
                     c->reg.host + ") " + FormatWeight(c->reg.weight);
    }
  }
  std::string budgets = "scheduler: memory budgets:";
  for (Connection* c : servers) {
    budgets += (c->id == 0 ? " server " : ", server ") + std::to_string(c->id) + " " +
               (budget_[c->id] == UINT64_MAX ? std::string("unlimited (memory unknown)")
                                             : std::to_string(budget_[c->id] >> 20) + " MiB");
  }
  GL_LOG(kInfo) << "scheduler: job '" << opts_.job << "' started with " << opts_.num_workers
                << " workers and " << opts_.num_servers << " servers" << weight_list;
  GL_LOG(kInfo) << budgets;
  return Status::Ok();
}

void SchedulerImpl::SendToWorkers(const wire::Header& h, const Payload& payload) {
  const auto now = Clock::now();
  for (auto& [rank, w] : workers_) {
    if (!w->left) w->link.Send(h, {}, payload, now);
  }
}

Status SchedulerImpl::OnBarrier(Connection& c, const Frame& f) {
  if (c.role != Role::kWorker || !started_) return ProtocolError("unexpected kBarrier");
  if (Joined(c.id)) return ProtocolError("kBarrier from a rank that has joined");
  barriers_[f.header.round].insert(c.id);
  ReleaseBarriers();
  return Status::Ok();
}

void SchedulerImpl::ReleaseBarriers() {
  // A rank that has joined counts as arrived (it resumes with the barriers' count at release).
  for (auto it = barriers_.begin(); it != barriers_.end();) {
    uint32_t arrived = static_cast<uint32_t>(it->second.size());
    for (uint32_t rank : joined_) arrived += it->second.count(rank) == 0 ? 1 : 0;
    if (arrived < opts_.num_workers) {
      ++it;
      continue;
    }
    wire::Header h = MakeHeader(MsgType::kBarrierRelease);
    h.round = it->first;
    barriers_released_ = std::max(barriers_released_, it->first);
    it = barriers_.erase(it);
    SendToWorkers(h, nullptr);
  }
}

Status SchedulerImpl::OnPeerLookup(Connection& c, const Frame& f) {
  if (c.role != Role::kWorker || !started_) return ProtocolError("unexpected kPeerLookup");
  wire::Header h = MakeHeader(MsgType::kPeerAddress);
  h.count = f.header.count;
  auto it = f.header.count < opts_.num_workers ? workers_.find(static_cast<uint32_t>(f.header.count))
                                               : workers_.end();
  if (it == workers_.end() || it->second == nullptr || it->second->left ||
      !it->second->registered) {
    // Out of range, or a worker that has left: the asker fails its sends to it.
    h.code = static_cast<uint8_t>(Code::kInvalidArgument);
    const std::string why = f.header.count < opts_.num_workers
                                ? "worker " + std::to_string(f.header.count) + " has left the job"
                                : "no worker " + std::to_string(f.header.count) + " in a job of " +
                                      std::to_string(opts_.num_workers);
    const std::vector<std::byte> text = wire::EncodeText(why);
    Send(c, h, text);
    return Status::Ok();
  }
  // Where its point-to-point frames go: the worker's reply lane (kept from its kRegister; the
  // workers' address book leaves it out).
  Send(c, h, it->second->reg.pull_address);
  return Status::Ok();
}

Status SchedulerImpl::OnJoin(Connection& c, const Frame& f) {
  if (c.role != Role::kWorker || !started_) return ProtocolError("unexpected kJoin");
  if (Joined(c.id) || releasing_) return ProtocolError("kJoin from a rank that has joined");
  GL_ASSIGN_OR_RETURN(wire::JoinMsg j, wire::DecodeJoin(f.payload));
  for (const auto& [key, round] : j.rounds) {
    uint64_t& most = join_rounds_[key];
    most = std::max(most, round);
  }
  join_barriers_ = std::max(join_barriers_, j.barriers);
  joined_.push_back(c.id);
  GL_LOG(kInfo) << "scheduler: " << MemberName(c) << " joined (" << joined_.size() << " of "
                << opts_.num_workers << ")";
  if (joined_.size() == opts_.num_workers) {
    // Nothing is in flight any more: the servers forget the join, then the workers resume.
    releasing_ = true;
    release_acks_.clear();
    for (auto& [id, s] : servers_) {
      if (lost_servers_.count(id) == 0) Send(*s, MakeHeader(MsgType::kJoinRelease));
    }
    return Status::Ok();
  }
  // Servers first: its absence must be known before a key planned without it reaches them.
  wire::Header h = MakeHeader(MsgType::kJoined);
  h.count = c.id;
  for (auto& [id, s] : servers_) Send(*s, h);
  // Then the rank itself: only now does it sit out the same-host path's chunks, so the others
  // can go on there (and join) only after this join is recorded, and the rank that joined last
  // is the last one recorded here.
  Send(c, h);
  // Keys that waited only for this rank's declaration, and barriers only for it, go on; a
  // collective other than a sum that needs it is refused now, whoever has declared it (as
  // Horovod fails it at once: whether the other ranks named it alike no longer matters).
  for (auto& [key, decl] : decls_) {
    if (decl.planned || decl.by_rank.empty()) continue;
    const CollectiveSpec& spec = decl.by_rank.begin()->second.second.spec;
    if (layout::GroupIsValid(spec, opts_.num_workers) &&
        (ReadyToPlan(decl, spec) || CannotRunWhileJoined(spec))) {
      GL_RETURN_IF_ERROR(Plan(key, decl));
    }
  }
  ReleaseBarriers();
  return Status::Ok();
}

Status SchedulerImpl::OnJoinReleaseAck(Connection& c) {
  if (c.role != Role::kServer || !releasing_) return ProtocolError("unexpected kJoinRelease");
  release_acks_.insert(c.id);
  // Every server of the job now (lost ones are not asked; standbys are: they hold the joins too).
  if (release_acks_.size() < servers_.size() - lost_servers_.size()) return Status::Ok();
  if (join_rounds_.size() > wire::kMaxJoinKeys) {
    // The workers' keys together: more than one release can carry.
    Finish(ResourceExhausted("every worker joined, with " + std::to_string(join_rounds_.size()) +
                             " keys among them: more than the " +
                             std::to_string(wire::kMaxJoinKeys) + " a join release carries"));
    return Status::Ok();
  }
  wire::JoinMsg release;
  release.rounds.assign(join_rounds_.begin(), join_rounds_.end());
  release.barriers = std::max(join_barriers_, barriers_released_);
  wire::Header h = MakeHeader(MsgType::kJoinRelease);
  h.count = joined_.back();
  GL_LOG(kInfo) << "scheduler: every worker joined (rank " << h.count << " last); resuming";
  SendToWorkers(h, Share(wire::Encode(release)));
  joined_.clear();
  join_rounds_.clear();
  join_barriers_ = 0;
  releasing_ = false;
  return Status::Ok();
}

Status SchedulerImpl::OnGoodbye(Connection& c) {
  if (!started_) {
    // Gone before the job started: its place is free again (StartJob numbers only the members
    // present, and would find a hole where it registered).
    if (c.role == Role::kServer && c.reg.standby) {
      --waiting_standbys_;
    } else {
      --(c.role == Role::kWorker ? registered_workers_ : registered_servers_);
    }
    c.registered = false;
    c.link.Close();
    return Status::Ok();
  }
  if (c.role == Role::kServer && started_ && !finished()) {
    // Its partitions move to the others, or have no other home: every worker would wait.
    Status failover = ServerFailover(c, MemberName(c) + " left");
    c.left = true;
    if (!failover.ok()) {
      Finish(PeerLost(MemberName(c) + " left while the job was running (no failover: " +
                      failover.message() + ")"));
    }
    return Status::Ok();
  }
  c.left = true;
  if (c.role == Role::kWorker && started_ && workers_left_ + 1 < opts_.num_workers) {
    // Rounds that need this worker can never complete: the servers fail them, naming it.
    wire::Header h = MakeHeader(MsgType::kMemberLeft);
    h.count = c.id;
    for (auto& [id, s] : servers_) Send(*s, h);
  }
  if (c.role == Role::kWorker && started_ && ++workers_left_ == opts_.num_workers) {
    for (auto& [id, s] : servers_) {
      s->left = true;
      Send(*s, MakeHeader(MsgType::kShutdown));
    }
    Finish(Status::Ok());
  }
  return Status::Ok();
}

void SchedulerImpl::Finish(Status result) {
  if (finished()) return;
  if (!result.ok() && !started_) result = Status(result.code(), result.message() + RefusalsText());
  if (!result.ok()) {
    GL_LOG(kWarn) << "scheduler: job '" << opts_.job << "' failed: " << result.ToString();
    abort_header_ = MakeHeader(MsgType::kAbort);
    abort_header_.code = static_cast<uint8_t>(result.code());
    abort_text_ = Share(wire::EncodeText(result.message()));
    const auto now = Clock::now();
    for (auto& c : conns_) {
      if (c->registered && !c->left && c->role == Role::kWorker) {
        c->link.Send(abort_header_, {}, abort_text_, now);
      }
    }
    server_abort_due_ = now + kFlushBeforeClose;
    SendServerAbortWhenDue(now);  // at once when every worker's socket took it
  }
  finished_ = true;
  {
    MutexLock lock(mu_);
    ended_ = true;
    result_ = std::move(result);
  }
  cv_.NotifyAll();
}

void SchedulerImpl::SendServerAbortWhenDue(Clock::time_point now) {
  if (!server_abort_due_.has_value()) return;
  const bool workers_told = std::all_of(conns_.begin(), conns_.end(), [](const auto& c) {
    return !c->registered || c->role != Role::kWorker || c->link.closed() ||
           c->link.queued_bytes() == 0;
  });
  if (!workers_told && now < *server_abort_due_) return;
  server_abort_due_.reset();
  for (auto& c : conns_) {
    if (c->registered && !c->left && c->role == Role::kServer) {
      c->link.Send(abort_header_, {}, abort_text_, now);
    }
  }
}

}  // namespace scheduler

Result<std::unique_ptr<Scheduler>> Scheduler::Start(const SchedulerOptions& options) {
  if (options.num_workers == 0 || options.num_servers == 0) {
    return InvalidArgument("a job needs at least one worker and one server");
  }
  GL_ASSIGN_OR_RETURN(auto listener, transport::Listener::Listen(options.host, options.port));
  const int wake_fd = ::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  if (wake_fd < 0) return Internal(std::string("scheduler: eventfd: ") + std::strerror(errno));
  auto s = std::make_unique<scheduler::SchedulerImpl>(options, std::move(listener), wake_fd);
  GL_RETURN_IF_ERROR(s->ServeMetrics());
  return std::unique_ptr<Scheduler>(std::move(s));
}

}  // namespace gradlink
