// Servers coming and going mid-job (scheduler_impl.h): standbys join (RegisterStandby,
// AdmitStandby), and a lost server's partitions move to a standby or the servers left, which
// adopt them; the workers get the new plans once those have acked (ServerFailover).
#include <algorithm>
#include <map>
#include <optional>

#include "common/log.h"
#include "common/naming.h"
#include "reduce/reduce.h"
#include "scheduler/scheduler_impl.h"

namespace gradlink::scheduler {

using wire::MsgType;
using wire::Role;

Status SchedulerImpl::RegisterStandby(Connection& c, wire::RegisterMsg reg) {
  const std::string who = started_ ? "a server joining the running job" : "a standby server";
  if (!opts_.server_failover) {
    Refuse(c, InvalidArgument("job '" + opts_.job + "' runs without server failover, so it takes " +
                              (started_ ? "no server once it has started" : "no standby server")));
    return InvalidArgument(who + ": no failover");
  }
  if (finished()) {
    Refuse(c, Aborted("job '" + opts_.job + "' has ended"));
    return Aborted(who + ": the job has ended");
  }
  if (waiting_standbys_ + standby_.size() >= kMaxStandbyServers) {
    Refuse(c, InvalidArgument("job '" + opts_.job + "' already has " +
                              std::to_string(kMaxStandbyServers) + " standby servers"));
    return InvalidArgument(who + " too many");
  }
  if (reg.requested_rank >= 0) {
    // Its own id, not one of the job's first servers' or one used before (a lost server's id
    // stays fenced). Ids of standbys waiting for the start are checked when it starts.
    const auto id = static_cast<uint32_t>(reg.requested_rank);
    if (id < opts_.num_servers || id >= opts_.num_servers + kMaxServersJoined ||
        servers_.count(id) != 0) {
      Refuse(c, InvalidArgument(
                    "server id " + std::to_string(id) + " is not free for a standby: its id is " +
                    std::to_string(opts_.num_servers) + " or more, below " +
                    std::to_string(opts_.num_servers + kMaxServersJoined) + ", and unused" +
                    (servers_.count(id) != 0 ? " (" + MemberName(*servers_.at(id)) +
                                                   " had it)" : std::string())));
      return InvalidArgument(who + ": server id not free");
    }
  }
  c.registered = true;
  c.role = Role::kServer;
  c.asked_standby = reg.standby;
  reg.standby = true;
  c.reg = std::move(reg);
  if (started_) {
    AdmitStandby(c);
  } else {
    ++waiting_standbys_;
  }
  return Status::Ok();
}

void SchedulerImpl::AdmitStandby(Connection& c) {
  uint32_t id;
  if (c.reg.requested_rank >= 0) {
    id = static_cast<uint32_t>(c.reg.requested_rank);
  } else {
    // Never a lost server's id: it stays fenced (after a restart, lost ids have no entry).
    id = std::max({opts_.num_servers, servers_.empty() ? 0u : servers_.rbegin()->first + 1,
                   lost_servers_.empty() ? 0u : *lost_servers_.rbegin() + 1});
    if (id >= opts_.num_servers + kMaxServersJoined) {
      Refuse(c, InvalidArgument("job '" + opts_.job + "' has taken " +
                                std::to_string(kMaxServersJoined) + " servers since it started"));
      c.registered = false;
      return;
    }
  }
  c.id = id;
  c.last_heard = Clock::now();
  for (auto& conn : conns_) {
    if (conn.get() == &c) servers_[id] = conn;
  }
  standby_.insert(id);
  placer_.AddStandby(id, c.reg.weight);
  if (budget_.size() <= id) {
    budget_.resize(id + 1, 0);  // holes take nothing
    held_.resize(id + 1, 0);
  }
  // Its share of its host, as if it had been there from the start.
  uint32_t on_host = 0;
  for (const auto& [sid, s] : servers_) {
    on_host += lost_servers_.count(sid) == 0 && MachineOf(s->reg.host) == MachineOf(c.reg.host);
  }
  budget_[id] = BudgetOf(c.reg, on_host);
  SendWelcome(c, server_book_, Clock::now());
  // Rounds that need a worker which left early can never complete, on this server too.
  for (const auto& [rank, w] : workers_) {
    if (!w->left) continue;
    wire::Header left = MakeHeader(MsgType::kMemberLeft);
    left.count = rank;
    Send(c, left);
  }
  // Ranks that have joined (join()) sit out the rounds of what it takes over.
  for (uint32_t rank : joined_) {
    wire::Header h = MakeHeader(MsgType::kJoined);
    h.count = rank;
    Send(c, h);
  }
  wire::Header joined = MakeHeader(MsgType::kServerJoined);
  joined.count = id;
  SendToWorkers(joined, Share(wire::EncodeMember(
                            {Role::kServer, id, c.reg.host, c.reg.push_address, {}})));
  // A server that did not ask to stand by takes its share of a running job at once, where the
  // workers keep each partition's last result (they do once the job has had two servers: a
  // one-server job's first joiner stands by).
  const bool results_kept = opts_.num_servers > 1 || servers_admitted_ > 0;
  ++servers_admitted_;
  const bool takes_share = started_ && !c.asked_standby && results_kept;
  const std::string budget =
      budget_[id] == UINT64_MAX ? std::string("unlimited") : std::to_string(budget_[id] >> 20) + " MiB";
  if (takes_share && Rebalance(id).has_value()) return;
  // A membership change, as a loss is: at the level that is on by default (gradlink-run reads
  // it: STANDBY_JOINED_RE).
  GL_LOG(kWarn) << "scheduler: " << MemberName(c) << " joined as a standby (" << standby_.size()
                << " standing by; memory budget " << budget << ")";
}

std::optional<uint64_t> SchedulerImpl::Rebalance(uint32_t id) {
  // Not while a rank has joined (its rounds are absent) or a key is still moving: then it
  // stands by.
  if (!joined_.empty() || releasing_) return std::nullopt;
  for (const auto& [key, decl] : decls_) {
    if (decl.replanning) return std::nullopt;
  }
  standby_.erase(id);
  placer_.Activate(id);
  const std::vector<double>& weight = placer_.weights();
  const auto per_weight = [&](uint32_t s) {
    return static_cast<double>(placer_.load_cost()[s]) / weight[s];
  };
  // Each partition of a delivered sum (flat or summed per host first), by the server holding
  // it. Other collectives move only when lost: a round of theirs moved mid-way could fail.
  struct Part {
    uint64_t key;
    uint32_t index;
    uint64_t bytes;  // on the wire (the placer's load)
    uint64_t held;   // in a server's memory (its budget)
  };
  std::map<uint32_t, std::vector<Part>> on;
  for (const auto& [key, decl] : decls_) {
    if (!decl.planned || !decl.status.ok() || !decl.delivered || !decl.spec.is_sum()) continue;
    const DataType wire_type = topology::WireType(decl.dtype, decl.mode);
    const uint64_t elem = DataTypeSize(wire_type);
    for (uint32_t p = 0; p < decl.plan.size(); ++p) {
      const wire::PartitionPlan& part = decl.plan[p];
      if (part.server == id) continue;
      on[part.server].push_back({key, p, part.count * elem,
                                 reduce::ServerBytesHeld(wire_type, part.count, opts_.num_workers)});
    }
  }
  // Largest first on each server, so that the fewest partitions move.
  for (auto& [s, parts] : on) {
    std::stable_sort(parts.begin(), parts.end(),
                     [](const Part& a, const Part& b) { return a.bytes > b.bytes; });
  }
  // Greedy: from the server that carries the most per weight, move a partition that leaves the
  // new server no more loaded (per weight) than that server was; until none does.
  std::map<uint64_t, std::vector<wire::PartitionPlan>> plans;
  uint64_t moved = 0;
  for (;;) {
    std::optional<uint32_t> from;
    for (const auto& [s, parts] : on) {
      if (parts.empty() || !placer_.active(s) || lost_servers_.count(s) != 0) continue;
      if (!from || per_weight(s) > per_weight(*from)) from = s;
    }
    if (!from) break;
    std::vector<Part>& parts = on[*from];
    auto it = std::find_if(parts.begin(), parts.end(), [&](const Part& p) {
      const double after = static_cast<double>(placer_.load_cost()[id] + p.bytes +
                                               Placer::kPartitionCostBytes) / weight[id];
      return after <= per_weight(*from) && p.held <= budget_[id] &&
             held_[id] <= budget_[id] - p.held;
    });
    if (it == parts.end()) break;
    std::vector<wire::PartitionPlan>& plan =
        plans.try_emplace(it->key, decls_.at(it->key).plan).first->second;
    placer_.Move(*from, id, it->bytes);
    held_[*from] -= std::min(held_[*from], it->held);
    held_[id] += it->held;
    plan[it->index].server = id;
    ++moved;
    parts.erase(it);
  }
  for (auto& [key, plan] : plans) {
    Declaration& decl = decls_.at(key);
    decl.plan = std::move(plan);
    decl.assign_header.flags = wire::kFlagReplan;
    decl.assign_header.round++;  // the plan's version, echoed in the acks
    decl.acks.clear();
    decl.replanning = true;
    SendPlanToServers(decl);
  }
  // gradlink-run reads this line (SHARE_RE).
  GL_LOG(kWarn) << "scheduler: " << MemberName(*servers_.at(id)) << " joined the running job; "
                << "server " << id << " took its share of the running job: " << moved
                << " partitions of " << plans.size() << " key(s) moved to it from the servers "
                << "that carried the most";
  return moved;
}

uint32_t SchedulerImpl::ActiveServers() const {
  return static_cast<uint32_t>(servers_.size() - lost_servers_.size() - standby_.size());
}

void SchedulerImpl::MemberLost(Connection& c, const std::string& what) {
  if (!c.registered || c.left || finished()) return;
  if (c.role == Role::kServer && c.reg.standby && !started_) {
    // A standby that leaves before the job starts holds nothing: it is forgotten.
    GL_LOG(kWarn) << "scheduler: " << what << " (a standby; the job goes on without it)";
    c.registered = false;
    c.link.Close();
    --waiting_standbys_;
    return;
  }
  if (c.role == Role::kServer && started_) {
    Status failover = ServerFailover(c, what);
    if (failover.ok()) return;
    Finish(PeerLost(what + " (no failover: " + failover.message() + ")"));
    return;
  }
  if (c.role == Role::kWorker) ++workers_lost_;
  Finish(PeerLost(what));
}

Status SchedulerImpl::ServerFailover(Connection& c, const std::string& what) {
  const uint32_t lost = c.id;
  if (!opts_.server_failover) return Unavailable("the scheduler runs without it");
  if (standby_.count(lost) != 0) {
    // It held nothing: the workers forget it, and the job goes on.
    c.left = true;
    c.link.Close();
    standby_.erase(lost);
    lost_servers_.insert(lost);
    GL_LOG(kWarn) << "scheduler: " << what << "; it was a standby (" << standby_.size()
                  << " standing by)";
    wire::Header h = MakeHeader(MsgType::kServerLost);
    h.count = lost;
    SendToWorkers(h, nullptr);
    return Status::Ok();
  }
  if (ActiveServers() <= 1 && standby_.empty()) return Unavailable("it was the last server");
  // While ranks have joined, the partitions move as at any time: their new servers learn who
  // sits out (OnAssign applies the joins it knows; a standby is told them when admitted), and
  // a joined rank reports where its rounds stand like any other. Not during the release.
  if (releasing_) return Unavailable("every rank has joined and the job is resuming (join())");
  std::vector<uint64_t> keys;
  for (auto& [key, decl] : decls_) {
    if (!decl.planned || !decl.status.ok()) continue;
    const bool there = std::any_of(decl.plan.begin(), decl.plan.end(),
                                   [&](const wire::PartitionPlan& p) { return p.server == lost; });
    if (!there) continue;
    // A key still being moved from an earlier loss moves again: its partitions on this server
    // (its own and any it was adopting) go to the servers left, under the plan's next version;
    // the workers report to whichever server has each partition last.
    keys.push_back(key);
  }
  // The new places, checked against the servers' memory budgets before anything changes.
  // A standby takes all of them: it replaces the lost server, and the load stays as planned.
  // Without one they spread over the servers left.
  const std::optional<uint32_t> standby =
      standby_.empty() ? std::nullopt : std::optional<uint32_t>(*standby_.begin());
  Placer placer = placer_;
  placer.Retire(lost);
  if (standby) placer.Activate(*standby);
  std::vector<uint64_t> held = held_;
  std::map<uint64_t, std::vector<wire::PartitionPlan>> plans;
  uint64_t moved = 0;
  for (uint64_t key : keys) {
    const Declaration& decl = decls_.at(key);
    const DataType wire_type = topology::WireType(decl.dtype, decl.mode);
    std::vector<wire::PartitionPlan>& plan = plans[key] = decl.plan;
    for (wire::PartitionPlan& p : plan) {
      if (p.server != lost) continue;
      if (standby) {
        p.server = *standby;
        placer.PlaceOn(p.server, p.count * DataTypeSize(wire_type));
      } else {
        p.server = placer.Place(p.count * DataTypeSize(wire_type));
      }
      ++moved;
      const uint64_t bytes = reduce::ServerBytesHeld(wire_type, p.count, opts_.num_workers);
      if (bytes > budget_[p.server] || held[p.server] > budget_[p.server] - bytes) {
        return Unavailable(MemberName(*servers_.at(p.server)) + " would hold more than its " +
                           std::to_string(budget_[p.server]) + "-byte memory budget with key " +
                           KeyHex(key) + " '" + decl.name + "' partition " +
                           std::to_string(&p - plan.data()));
      }
      held[p.server] += bytes;
    }
  }
  c.left = true;  // gone for good: nothing more is sent to it or expected from it
  c.link.Close();
  lost_servers_.insert(lost);
  if (standby) standby_.erase(*standby);
  placer_ = std::move(placer);
  held_ = std::move(held);
  for (uint64_t key : keys) {
    Declaration& decl = decls_.at(key);
    decl.plan = std::move(plans.at(key));
    // The workers hold rounds of a key they have: its new servers learn where they stand.
    decl.assign_header.flags = decl.delivered ? wire::kFlagReplan : 0;
    decl.assign_header.round++;  // the plan's version, echoed in the acks
    decl.acks.clear();
    decl.replanning = true;
    SendPlanToServers(decl);
  }
  // gradlink-run reads this line (FAILOVER_RE): "...; N partitions of K key(s) move to the S
  // servers left".
  GL_LOG(kWarn) << "scheduler: " << what << "; " << moved << " partitions of " << keys.size()
                << " key(s) move to the " << ActiveServers() << " servers left"
                << (standby ? ", all to standby " + MemberName(*servers_.at(*standby)) +
                                  " (" + std::to_string(standby_.size()) + " standing by)"
                            : std::string());
  wire::Header h = MakeHeader(MsgType::kServerLost);
  h.count = lost;
  SendToWorkers(h, nullptr);
  // Plans that only waited for the lost server's ack go out now.
  for (auto& [key, decl] : decls_) {
    if (decl.planned && decl.status.ok()) DeliverWhenAcked(decl);
  }
  return Status::Ok();
}

bool SchedulerImpl::AckedByAll(const Declaration& decl) const {
  for (uint32_t id : decl.sent_to) {
    if (lost_servers_.count(id) == 0 && decl.acks.count(id) == 0) return false;
  }
  return true;
}

void SchedulerImpl::DeliverWhenAcked(Declaration& decl) {
  if (!AckedByAll(decl) || !(decl.replanning || !decl.delivered)) return;
  decl.replanning = false;
  decl.delivered = true;
  SendToDeclarers(decl);
}

}  // namespace gradlink::scheduler
