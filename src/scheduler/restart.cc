// Restart (scheduler_impl.h): a scheduler started on the address of one that died rebuilds the
// job from its members' re-registrations, and the job goes on.
//
// While the scheduler is gone its members keep the data path running; each reconnects
// (control/join.h RejoinJob) and registers again with its id and a ResumeState, a worker
// following with one kResumeKey per tensor it declared: the declaration and, where it has one,
// the plan. Nothing is planned again that a worker holds a plan for, so every partition stays on
// the server that holds its rounds. The resumed job starts when every worker and every server
// the workers know (not lost) is back; then the scheduler knows what the one before it knew:
//  - the members, their ids and addresses (the address book, for standbys that join later);
//  - each key's plan, with the placer's load and the servers' memory held replayed from the
//    plans (load is a sum, so the order of replay does not matter: later keys are placed as the
//    old scheduler would have placed them);
//  - the keys declared but not yet planned everywhere: a plan some worker holds goes to the
//    workers that lack it; a key nobody holds a plan for is planned now (a server that had an
//    earlier, undelivered plan for it replaces it: no push can have come, server.cc OnAssign);
//  - the barriers: the most released, and the ones entered and not released.
// What it does not rebuild, and refuses with a clear error: a join in progress (the worker
// fails itself), a failover in progress (a plan naming a server that is lost), a worker that had
// already said goodbye.
#include <algorithm>

#include "common/log.h"
#include "common/naming.h"
#include "control/layout.h"
#include "scheduler/scheduler_impl.h"

namespace gradlink::scheduler {

using transport::Frame;
using wire::MsgType;
using wire::Role;

Status SchedulerImpl::RegisterResume(Connection& c, wire::RegisterMsg reg) {
  const auto id = static_cast<uint32_t>(reg.requested_rank);
  const bool worker = reg.role == Role::kWorker;
  if (started_ && !worker && resuming_ && id >= opts_.num_servers) {
    // A standby the workers had not heard of when the scheduler died: it stands by again.
    reg.resume.reset();
    return RegisterStandby(c, std::move(reg));
  }
  const auto refuse = [&](const std::string& why) {
    Refuse(c, Aborted(why));
    return Aborted(why);
  };
  if (started_) {
    return refuse("job '" + opts_.job + "' is running on this scheduler without " +
                  std::string(worker ? "worker " : "server ") + std::to_string(id) +
                  " (it resumed without it, or it is not the job that member was in)");
  }
  if (!resuming_ && registered_workers_ + registered_servers_ != 0) {
    return refuse("this scheduler is starting job '" + opts_.job +
                  "' afresh (its first members registered new), not resuming it");
  }
  const uint32_t limit = worker ? opts_.num_workers : opts_.num_servers + kMaxServersJoined;
  auto& members = worker ? workers_ : servers_;
  if (id >= limit || members.count(id) != 0) {
    return refuse(std::string(worker ? "rank " : "server id ") + std::to_string(id) +
                  (id >= limit ? " is out of range for job '" + opts_.job + "'"
                               : " re-registered twice"));
  }
  if (!resuming_) {
    resuming_ = true;
    resume_began_ = Clock::now();
    GL_LOG(kWarn) << "scheduler: job '" << opts_.job
                  << "': its members are re-registering: resuming it after a restart";
  }
  c.registered = true;
  c.role = reg.role;
  c.id = id;
  c.resume_keys_left = reg.resume->keys;
  resume_keys_pending_ += reg.resume->keys;
  // Whether a server stands by is in the plans (StartResumedJob), not in how it was started.
  reg.standby = false;
  c.reg = std::move(reg);
  for (auto& conn : conns_) {
    if (conn.get() == &c) members[id] = conn;
  }
  ++(worker ? registered_workers_ : registered_servers_);
  return MaybeStartResumedJob();
}

Status SchedulerImpl::OnResumeKey(Connection& c, const Frame& f) {
  if (c.role != Role::kWorker || started_ || !c.reg.resume.has_value() ||
      c.resume_keys_left == 0) {
    return ProtocolError("unexpected kResumeKey");
  }
  const wire::Header& h = f.header;
  if (!IsValidDataType(h.dtype)) return ProtocolError("kResumeKey with an invalid dtype");
  GL_ASSIGN_OR_RETURN(wire::ResumeKeyMsg m,
                      wire::DecodeResumeKey(f.payload, h.count, c.reg.resume->server_ids));
  if (wire::TensorKey(opts_.job, m.declare.name) != h.key) {
    return ProtocolError("kResumeKey key does not match the name '" + m.declare.name + "'");
  }
  Declaration& decl = decls_[h.key];
  if (decl.by_rank.count(c.id) != 0) return ProtocolError("key resumed twice by one worker");
  // The stall inspector counts a declaration's age from the restart: when the others declared
  // it before, this scheduler cannot know.
  if (decl.by_rank.empty()) decl.first_declared = Clock::now();
  wire::Header declared = h;
  declared.type = MsgType::kDeclare;
  decl.by_rank[c.id] = {declared, m.declare};
  --c.resume_keys_left;
  --resume_keys_pending_;
  if (m.state == wire::ResumeKeyMsg::Plan::kNone) return MaybeStartResumedJob();
  const bool first = resume_planned_by_[h.key].empty();
  resume_planned_by_[h.key].insert(c.id);
  const std::string keyhex = KeyHex(h.key);
  if (m.state == wire::ResumeKeyMsg::Plan::kRefused) {
    if (first) {
      decl.planned = true;
      decl.name = m.declare.name;
      decl.status = Status(static_cast<Code>(m.refusal), m.refusal_text);
      decl.assign_header = MakeHeader(MsgType::kAssign);
      decl.assign_header.key = h.key;
      decl.assign_header.code = m.refusal;
      decl.assign_payload = Share(wire::EncodeText(m.refusal_text));
    } else if (decl.status.ok()) {
      Finish(Mismatch("resuming job '" + opts_.job + "' after a restart: key " + keyhex + " '" +
                      m.declare.name + "' was refused on rank " + std::to_string(c.id) +
                      " and planned on others"));
    }
    return MaybeStartResumedJob();
  }
  if (first) {
    decl.planned = true;
    decl.name = m.declare.name;
    decl.dtype = static_cast<DataType>(h.dtype);
    decl.count = h.count;
    decl.partition_bytes = m.declare.partition_bytes;
    decl.mode = static_cast<topology::Mode>(m.plan.mode);
    decl.spec = m.plan.spec;
    decl.plan = std::move(m.plan.partitions);
    return MaybeStartResumedJob();
  }
  const auto same = [](const wire::PartitionPlan& a, const wire::PartitionPlan& b) {
    return a.offset == b.offset && a.count == b.count && a.server == b.server;
  };
  if (!decl.status.ok() || static_cast<uint8_t>(decl.mode) != m.plan.mode ||
      decl.count != h.count || decl.plan.size() != m.plan.partitions.size() ||
      !std::equal(decl.plan.begin(), decl.plan.end(), m.plan.partitions.begin(), same)) {
    // One worker had a failover's new plan and another not: the restart came mid-failover.
    Finish(Mismatch("resuming job '" + opts_.job + "' after a restart: the workers hold " +
                    "different plans for key " + keyhex + " '" + m.declare.name + "' (rank " +
                    std::to_string(c.id) + "'s differs): the scheduler was lost during a " +
                    "failover, which a restart does not complete"));
  }
  return MaybeStartResumedJob();
}

std::string SchedulerImpl::ResumeMissing() const {
  std::string missing;
  const auto add = [&](const std::string& what) { missing += (missing.empty() ? "" : ", ") + what; };
  uint32_t server_ids = 0;
  std::set<uint32_t> lost;
  for (uint32_t r = 0; r < opts_.num_workers; ++r) {
    auto it = workers_.find(r);
    if (it == workers_.end()) {
      add("worker " + std::to_string(r));
      continue;
    }
    const Connection& w = *it->second;
    if (w.resume_keys_left != 0) {
      add("worker " + std::to_string(r) + " (" + std::to_string(w.resume_keys_left) +
          " of its tensors)");
    }
    server_ids = std::max(server_ids, w.reg.resume->server_ids);
    lost.insert(w.reg.resume->lost_servers.begin(), w.reg.resume->lost_servers.end());
  }
  for (uint32_t id = 0; id < server_ids; ++id) {
    if (lost.count(id) == 0 && servers_.count(id) == 0) add("server " + std::to_string(id));
  }
  return missing;
}

Status SchedulerImpl::MaybeStartResumedJob() {
  // Cheap until every worker and tensor is in (this runs for every kResumeKey); then the
  // servers the workers know are checked.
  if (finished() || started_ || registered_workers_ < opts_.num_workers ||
      resume_keys_pending_ != 0 || !ResumeMissing().empty()) {
    return Status::Ok();
  }
  return StartResumedJob();
}

Status SchedulerImpl::StartResumedJob() {
  // What the workers know of the servers: every id, and which are lost (a worker that had not
  // yet heard of a loss when the scheduler died learns it below, from the others').
  uint32_t known = opts_.num_servers;
  for (auto& [rank, w] : workers_) {
    known = std::max(known, w->reg.resume->server_ids);
    lost_servers_.insert(w->reg.resume->lost_servers.begin(), w->reg.resume->lost_servers.end());
  }
  for (uint32_t id = 0; id < known; ++id) {
    if (servers_.count(id) == 0) lost_servers_.insert(id);
  }
  // A standby whose joining the workers had not heard of yet when the scheduler died is back
  // too: they hear of it below.
  const uint32_t server_ids =
      std::max(known, servers_.empty() ? 0u : servers_.rbegin()->first + 1);
  for (auto& [id, s] : servers_) {
    if (lost_servers_.count(id) != 0) {
      Finish(Unavailable("resuming job '" + opts_.job + "' after a restart: " + MemberName(*s) +
                         " came back, but the workers had it as lost"));
      return Status::Ok();
    }
  }
  // A standby is a server beyond the first ones that holds no partition.
  std::set<uint32_t> holding;
  for (const auto& [key, decl] : decls_) {
    if (!decl.planned || !decl.status.ok()) continue;
    const std::vector<layout::Segment> segments =
        layout::Segments(decl.spec, opts_.num_workers, decl.count);
    for (const wire::PartitionPlan& p : decl.plan) {
      const layout::Segment& seg = segments[layout::SegmentAt(segments, p.offset)];
      if (layout::PeersOf(decl.spec, seg, opts_.num_workers).local_only()) continue;
      if (lost_servers_.count(p.server) != 0) {
        Finish(Unavailable("resuming job '" + opts_.job + "' after a restart: key " +
                           KeyHex(key) + " '" + decl.name + "' has a partition on server " +
                           std::to_string(p.server) + ", which is lost: the scheduler was " +
                           "lost during a failover, which a restart does not complete"));
        return Status::Ok();
      }
      holding.insert(p.server);
    }
  }
  std::vector<double> weights(opts_.num_servers, 1.0);
  for (uint32_t id = 0; id < opts_.num_servers; ++id) {
    if (auto it = servers_.find(id); it != servers_.end()) weights[id] = it->second->reg.weight;
  }
  placer_ = Placer(weights);
  budget_.assign(server_ids, 0);
  held_.assign(server_ids, 0);
  std::map<std::string, uint32_t, std::less<>> servers_on_host;
  for (auto& [id, s] : servers_) ++servers_on_host[std::string(MachineOf(s->reg.host))];
  for (uint32_t id = 0; id < server_ids; ++id) {
    auto it = servers_.find(id);
    if (it == servers_.end()) {
      if (id < opts_.num_servers) {
        placer_.Retire(id);
      } else {
        placer_.AddStandby(id, 1.0);  // a hole: never active
      }
      continue;
    }
    const Connection& s = *it->second;
    budget_[id] = BudgetOf(s.reg, servers_on_host.find(MachineOf(s.reg.host))->second);
    if (id < opts_.num_servers) continue;
    placer_.AddStandby(id, s.reg.weight);
    if (holding.count(id) != 0) {
      placer_.Activate(id);
    } else {
      standby_.insert(id);
    }
  }
  // The book (as StartJob's), for standbys that join from now on; a lost server's entry has
  // no address.
  wire::WelcomeMsg w;
  w.num_workers = opts_.num_workers;
  w.num_servers = opts_.num_servers;
  for (auto& [rank, c] : workers_) {
    w.members.push_back({Role::kWorker, rank, c->reg.host, c->reg.push_address,
                         c->reg.pull_address});
  }
  for (uint32_t id = 0; id < opts_.num_servers; ++id) {
    auto it = servers_.find(id);
    if (it == servers_.end()) {
      w.members.push_back({Role::kServer, id, "lost", {}, {}});
    } else {
      w.members.push_back({Role::kServer, id, it->second->reg.host, it->second->reg.push_address,
                           it->second->reg.pull_address});
    }
  }
  tuning_ = tuning::Choose(w);
  hosts_ = topology::Of(w);
  {
    std::vector<std::byte> all = wire::Encode(w);
    server_book_ = Share(std::vector<std::byte>(all.begin() + 4, all.end()));
  }
  // Each planned key as the scheduler before had it: every server that is not standing by
  // holds its plan (a plan reaches the workers only once all have acked it).
  std::set<uint32_t> active;
  for (auto& [id, s] : servers_) {
    if (standby_.count(id) == 0) active.insert(id);
  }
  uint32_t planned = 0;
  for (auto& [key, decl] : decls_) {
    if (!decl.planned) continue;
    ++planned;
    decl.delivered = true;
    if (!decl.status.ok()) continue;
    const DataType wire_type = topology::WireType(decl.dtype, decl.mode);
    const std::vector<layout::Segment> segments =
        layout::Segments(decl.spec, opts_.num_workers, decl.count);
    for (const wire::PartitionPlan& p : decl.plan) {
      const layout::Segment& seg = segments[layout::SegmentAt(segments, p.offset)];
      if (layout::PeersOf(decl.spec, seg, opts_.num_workers).local_only()) continue;
      placer_.PlaceOn(p.server, p.count * DataTypeSize(wire_type));
    }
    Admit(KeyHex(key), decl, decl.plan).IgnoreError();  // counts what the servers hold
    decl.assign_header = MakeHeader(MsgType::kAssign);
    decl.assign_header.key = key;
    decl.assign_header.dtype = static_cast<uint8_t>(decl.dtype);
    decl.assign_header.count = decl.count;
    EncodePlan(decl);
    decl.sent_to = active;
    decl.acks = active;
  }
  // Barriers: released as far as any worker saw; each worker's last one, if later, is entered.
  for (auto& [rank, c] : workers_) {
    barriers_released_ = std::max(barriers_released_, c->reg.resume->barriers_released);
  }
  for (auto& [rank, c] : workers_) {
    if (c->reg.resume->barriers_entered > barriers_released_) {
      barriers_[c->reg.resume->barriers_entered].insert(rank);
    }
  }
  started_ = true;
  const auto now = Clock::now();
  for (auto& c : conns_) c->last_heard = now;
  for (auto* members : {&workers_, &servers_}) {
    for (auto& [id, c] : *members) SendWelcome(*c, server_book_, now);
  }
  for (auto& [id, s] : servers_) {
    if (id < known) continue;
    wire::Header joined = MakeHeader(MsgType::kServerJoined);
    joined.count = id;
    SendToWorkers(joined, Share(wire::EncodeMember(
                              {Role::kServer, id, s->reg.host, s->reg.push_address, {}})));
  }
  // A worker that missed a release the others had gets it; one that lacks a plan another
  // worker had gets that plan.
  for (auto& [rank, c] : workers_) {
    if (c->reg.resume->barriers_released < barriers_released_) {
      wire::Header h = MakeHeader(MsgType::kBarrierRelease);
      h.round = barriers_released_;
      Send(*c, h);
    }
  }
  for (auto& [key, decl] : decls_) {
    if (!decl.planned) continue;
    const std::set<uint32_t>& have = resume_planned_by_[key];
    for (const auto& [rank, declared] : decl.by_rank) {
      if (have.count(rank) != 0) continue;
      workers_.at(rank)->link.Send(decl.assign_header, {}, decl.assign_payload, now);
    }
  }
  GL_LOG(kWarn) << "scheduler: job '" << opts_.job << "' resumed after a restart with "
                << workers_.size() << " workers and " << active.size() << " servers ("
                << standby_.size() << " standing by, " << lost_servers_.size() << " lost), "
                << planned << " keys planned, " << barriers_released_
                << " barriers passed, in "
                << std::chrono::duration_cast<std::chrono::milliseconds>(now - resume_began_)
                       .count()
                << " ms";
  resume_planned_by_.clear();
  // New standbys that registered while the job resumed.
  waiting_standbys_ = 0;
  for (auto& c : conns_) {
    if (c->registered && !c->left && c->role == Role::kServer && c->reg.standby &&
        !c->reg.resume.has_value()) {
      AdmitStandby(*c);
    }
  }
  // Keys nobody had a plan for: planned now, once their group has declared them.
  for (auto& [key, decl] : decls_) {
    if (decl.planned || decl.by_rank.empty()) continue;
    const CollectiveSpec& spec = decl.by_rank.begin()->second.second.spec;
    if (!layout::GroupIsValid(spec, opts_.num_workers) || ReadyToPlan(decl, spec)) {
      GL_RETURN_IF_ERROR(Plan(key, decl));
    }
  }
  ReleaseBarriers();
  return Status::Ok();
}

}  // namespace gradlink::scheduler
