// The scheduler's /metrics and /targets, read by the metrics server's thread from a view the
// loop refreshes (RefreshView), and the stall inspector: declarations some workers made and the
// others not (found here), rounds some pushed and the others not (reported by the servers).
#include <algorithm>

#include "common/log.h"
#include "common/naming.h"
#include "control/layout.h"
#include "metrics/endpoint.h"
#include "metrics/process.h"
#include "scheduler/scheduler_impl.h"

namespace gradlink::scheduler {

using metrics::Add;
using metrics::Family;
using metrics::With;
using transport::Frame;
using wire::MsgType;
using wire::Role;

namespace {

std::string RoleText(Role r) { return r == Role::kWorker ? "worker" : "server"; }

// "rank 3", "ranks 0, 1 and 4".
std::string Ranks(const std::vector<uint32_t>& ranks) {
  std::string out = ranks.size() == 1 ? "rank " : "ranks ";
  for (size_t i = 0; i < ranks.size(); ++i) {
    if (i != 0) out += i + 1 == ranks.size() ? " and " : ", ";
    out += std::to_string(ranks[i]);
  }
  return out;
}

std::string Seconds(Clock::duration d) {
  return std::to_string(std::chrono::duration_cast<std::chrono::seconds>(d).count()) + " s";
}

// A JSON string literal.
std::string Json(const std::string& s) {
  std::string out = "\"";
  for (char ch : s) {
    if (ch == '"' || ch == '\\') {
      out += '\\';
      out += ch;
    } else if (static_cast<unsigned char>(ch) < 0x20) {
      char buf[8];
      std::snprintf(buf, sizeof(buf), "\\u%04x", ch);
      out += buf;
    } else {
      out += ch;
    }
  }
  return out + "\"";
}

}  // namespace

Status SchedulerImpl::ServeMetrics() {
  std::map<std::string, metrics::Route> routes = {
      {"/targets", {"application/json", [this] { return RenderTargets(); }}}};
  GL_ASSIGN_OR_RETURN(metrics_, metrics::Serve(opts_.host, opts_.metrics_port,
                                               [this] { return CollectMetrics(); },
                                               std::move(routes)));
  if (metrics_) {
    metrics_port_.store(metrics_->port());
    metrics::LogServing("scheduler", opts_.host, metrics_->port());
  }
  return Status::Ok();
}

void SchedulerImpl::RefreshView(Clock::time_point now, bool now_too) {
  if (!now_too && now - view_refreshed_ < std::chrono::milliseconds(200)) return;
  view_refreshed_ = now;
  MetricsView v;
  v.started = started_;
  v.finished = finished();
  const bool wildcard = opts_.host.empty() || opts_.host == "0.0.0.0" || opts_.host == "::";
  v.self_host = wildcard ? std::string() : opts_.host;
  for (const auto& c : conns_) {
    if (!c->registered || c->left) continue;
    if (v.self_host.empty()) v.self_host = transport::SocketHost(c->link.fd(), false);
    if (c->role == Role::kServer && lost_servers_.count(c->id) != 0) continue;
    v.members.push_back({c->role, c->id, c->metrics_address});
    if (c->role == Role::kWorker) {
      ++v.workers;
    } else if (standby_.count(c->id) != 0 || (!started_ && c->reg.standby)) {
      ++v.standbys;
    } else {
      ++v.servers;
    }
  }
  v.keys = decls_.size();
  for (const auto& [key, decl] : decls_) v.keys_refused += decl.planned && !decl.status.ok();
  v.keys_planned = keys_planned_;
  v.barriers = barriers_released_;
  v.servers_lost = lost_servers_.size();
  v.servers_admitted = servers_admitted_;
  v.workers_lost = workers_lost_;
  v.stalls = stalls_;
  for (uint32_t id = 0; id < budget_.size() && id < held_.size(); ++id) {
    if (lost_servers_.count(id) != 0) continue;
    v.server_memory.push_back({id, {budget_[id], held_[id]}});
    v.planned_bytes += held_[id];
  }
  MutexLock lock(view_mu_);
  view_ = std::move(v);
}

metrics::Families SchedulerImpl::CollectMetrics() const {
  MetricsView v;
  {
    MutexLock lock(view_mu_);
    v = view_;
  }
  metrics::Families f;
  const metrics::Labels labels = {{"job", opts_.job}, {"role", "scheduler"}};
  metrics::AddProcessFamilies(f, labels, "gl-");
  AddGauge(f, "gradlink_scheduler_job_running",
           "1 while the job runs (every expected member joined, not ended), else 0.", labels,
           v.started && !v.finished ? 1.0 : 0.0);
  Family& members = Add(f, "gradlink_scheduler_members",
                        "Members registered and not lost, by kind: workers, servers holding "
                        "partitions, standby servers.",
                        "gauge");
  members.Put(With(labels, "kind", "worker"), static_cast<double>(v.workers));
  members.Put(With(labels, "kind", "server"), static_cast<double>(v.servers));
  members.Put(With(labels, "kind", "standby"), static_cast<double>(v.standbys));
  Family& expected = Add(f, "gradlink_scheduler_expected_members",
                         "Members the job was started for, by kind.", "gauge");
  expected.Put(With(labels, "kind", "worker"), static_cast<double>(opts_.num_workers));
  expected.Put(With(labels, "kind", "server"), static_cast<double>(opts_.num_servers));
  Family& lost =
      Add(f, "gradlink_scheduler_members_lost_total",
          "Members lost mid-job (a lost server's partitions move: failover).", "counter");
  lost.Put(With(labels, "kind", "worker"), static_cast<double>(v.workers_lost));
  lost.Put(With(labels, "kind", "server"), static_cast<double>(v.servers_lost));
  AddGauge(f, "gradlink_scheduler_membership_epoch",
           "Changes of the job's servers since it started: servers lost plus servers admitted.",
           labels, static_cast<double>(v.servers_lost + v.servers_admitted));
  AddCounter(f, "gradlink_scheduler_control_received_bytes_total",
             "Bytes of control frames received from members.", labels,
             static_cast<double>(control_counters_.bytes_in.load(std::memory_order_relaxed)));
  AddCounter(f, "gradlink_scheduler_control_received_messages_total",
             "Control frames received from members.", labels,
             static_cast<double>(control_counters_.frames_in.load(std::memory_order_relaxed)));
  AddCounter(f, "gradlink_scheduler_control_sent_bytes_total",
             "Bytes of control frames sent to members.", labels,
             static_cast<double>(control_counters_.bytes_out.load(std::memory_order_relaxed)));
  AddCounter(f, "gradlink_scheduler_control_sent_messages_total", "Control frames sent to members.",
             labels,
             static_cast<double>(control_counters_.frames_out.load(std::memory_order_relaxed)));
  AddGauge(f, "gradlink_scheduler_keys", "Keys (tensors) declared and not retired.", labels,
           static_cast<double>(v.keys));
  AddCounter(f, "gradlink_scheduler_keys_planned_total",
             "Keys planned (partitions placed), or refused once every worker declared them.",
             labels, static_cast<double>(v.keys_planned));
  AddGauge(f, "gradlink_scheduler_keys_refused",
           "Keys refused (their declarations disagreed, or no server had room).", labels,
           static_cast<double>(v.keys_refused));
  AddCounter(f, "gradlink_scheduler_barriers_total", "Barriers released.", labels,
             static_cast<double>(v.barriers));
  AddCounter(f, "gradlink_scheduler_stalls_total",
             "Stalls the stall inspector reported (tensors submitted by some ranks, not others).",
             labels, static_cast<double>(v.stalls));
  AddCounter(f, "gradlink_scheduler_protocol_errors_total",
             "Control frames that failed validation (their connections closed).", labels,
             static_cast<double>(protocol_errors_.load()));
  AddCounter(f, "gradlink_scheduler_auth_failures_total",
             "Connections refused by authentication (the job secret).", labels,
             static_cast<double>(auth_failures_.load()));
  AddGauge(f, "gradlink_scheduler_memory_quota_bytes",
           "The job's memory quota over all its servers (0: none, each server's budget only).",
           labels, static_cast<double>(opts_.memory_quota_bytes));
  AddGauge(f, "gradlink_scheduler_memory_planned_bytes",
           "Partition state the job's planned keys may hold, over all its servers (what the "
           "quota is checked against).",
           labels, static_cast<double>(v.planned_bytes));
  Family& budget = Add(f, "gradlink_scheduler_server_budget_bytes",
                       "Each server's memory budget for partition state.", "gauge");
  Family& held = Add(f, "gradlink_scheduler_server_planned_bytes",
                     "Partition state each server's planned keys may hold at most (admitted "
                     "against its budget).",
                     "gauge");
  for (const auto& [id, mem] : v.server_memory) {
    budget.Put(With(labels, "server", std::to_string(id)), static_cast<double>(mem.first));
    held.Put(With(labels, "server", std::to_string(id)), static_cast<double>(mem.second));
  }
  return f;
}

std::string SchedulerImpl::RenderTargets() const {
  std::vector<MetricsView::Member> members;
  std::string self_host;
  {
    MutexLock lock(view_mu_);
    members = view_.members;
    self_host = view_.self_host;
  }
  // Prometheus' HTTP service discovery: one group per role. The scheduler is named by its
  // --host, or on every interface by the address its members reached it at (none yet: left
  // out until one has registered).
  std::string out = "[";
  const auto group = [&](const std::string& role, const std::vector<std::string>& targets) {
    if (targets.empty()) return;
    if (out.size() > 1) out += ",";
    out += "{\"targets\":[";
    for (size_t i = 0; i < targets.size(); ++i) out += (i ? "," : "") + Json(targets[i]);
    out += "],\"labels\":{\"gradlink_job\":" + Json(opts_.job) +
           ",\"gradlink_role\":" + Json(role) + "}}";
  };
  if (const uint16_t port = metrics_port_.load(); port != 0 && !self_host.empty()) {
    group("scheduler", {metrics::HostPort(self_host, port)});
  }
  for (Role role : {Role::kServer, Role::kWorker}) {
    std::vector<std::pair<uint32_t, std::string>> listed;
    for (const MetricsView::Member& m : members) {
      if (m.role == role && !m.metrics_address.empty()) listed.push_back({m.id, m.metrics_address});
    }
    std::sort(listed.begin(), listed.end());
    std::vector<std::string> targets;
    for (auto& [id, address] : listed) targets.push_back(address);
    group(RoleText(role), targets);
  }
  return out + "]\n";
}

void SchedulerImpl::CheckStalls(Clock::time_point now) {
  const auto period = opts_.stall_check;
  if (!started_ || period.count() <= 0) return;
  if (now - stalls_checked_ < std::min<Clock::duration>(period, std::chrono::seconds(1))) return;
  stalls_checked_ = now;
  std::erase_if(rounds_told_, [&](const auto& e) { return now - e.second > 2 * period; });
  std::vector<std::string> lines;
  std::set<uint32_t> told;
  Clock::duration oldest{};
  for (auto& [key, decl] : decls_) {
    if (decl.planned || decl.by_rank.empty() || now - decl.first_declared < period) continue;
    if (decl.stall_told != Clock::time_point{} && now - decl.stall_told < period) continue;
    const CollectiveSpec& spec = decl.by_rank.begin()->second.second.spec;
    std::vector<uint32_t> missing, declared;
    const uint32_t members = layout::Members(spec, opts_.num_workers);
    for (uint32_t i = 0; i < members; ++i) {
      const uint32_t rank = layout::RankAt(spec, i);
      if (decl.by_rank.count(rank) != 0) {
        declared.push_back(rank);
      } else if (!Joined(rank)) {
        missing.push_back(rank);
      }
    }
    if (missing.empty()) continue;
    decl.stall_told = now;
    oldest = std::max(oldest, now - decl.first_declared);
    const std::string& name = decl.by_rank.begin()->second.second.name;
    lines.push_back(Ranks(missing) + (missing.size() == 1 ? " has" : " have") + " not declared '" +
                    name + "' (key " + KeyHex(key) + "), which " + Ranks(declared) + " declared " +
                    Seconds(now - decl.first_declared) + " ago");
    told.insert(declared.begin(), declared.end());
  }
  if (!lines.empty()) ReportStall(lines, told, oldest);
}

Status SchedulerImpl::OnStallReport(Connection& c, const Frame& f) {
  if (c.role != Role::kServer || !started_) return ProtocolError("unexpected kStallReport");
  Result<std::vector<wire::StalledRound>> rounds =
      wire::DecodeStallReport(f.payload, opts_.num_workers);
  if (!rounds.ok()) {
    // What only informs is not worth failing a server over: counted, logged, dropped.
    protocol_errors_++;
    GL_LOG(kWarn) << "scheduler: " << MemberName(c) << ": stall report dropped: "
                  << rounds.status().ToString();
    return Status::Ok();
  }
  // One line per key and round (its partitions stall alike; other servers may report it
  // too), once a period, naming the tensor.
  const Clock::time_point now = Clock::now();
  std::vector<std::string> lines;
  std::set<uint32_t> told;
  Clock::duration oldest{};
  for (const wire::StalledRound& r : *rounds) {
    if (r.missing.empty()) continue;
    auto [when, fresh] = rounds_told_.try_emplace({r.key, r.round}, now);
    if (!fresh) {
      // Another server's report of the same round (each reports once a period).
      if (now - when->second < opts_.stall_check / 2) continue;
      when->second = now;
    }
    const auto it = decls_.find(r.key);
    const std::string name = it == decls_.end() ? std::string("?") : it->second.name;
    const auto age = std::chrono::milliseconds(r.age_ms);
    oldest = std::max<Clock::duration>(oldest, age);
    lines.push_back(Ranks(r.missing) + (r.missing.size() == 1 ? " has" : " have") +
                    " not pushed round " + std::to_string(r.round) + " of '" + name + "' (key " +
                    KeyHex(r.key) + ", server " + std::to_string(c.id) + "), which " +
                    (r.pushed.empty() ? std::string("no rank") : Ranks(r.pushed)) + " pushed " +
                    Seconds(age) + " ago");
    told.insert(r.pushed.begin(), r.pushed.end());
  }
  if (!lines.empty()) ReportStall(lines, told, oldest);
  return Status::Ok();
}

void SchedulerImpl::ReportStall(const std::vector<std::string>& lines,
                                const std::set<uint32_t>& told, Clock::duration age) {
  ++stalls_;
  const bool shutdown = opts_.stall_shutdown.count() > 0 && age >= opts_.stall_shutdown;
  // The verdict first: a message cut short (a kAbort's text is bounded) keeps it.
  std::string text;
  if (shutdown) {
    text = "the job ends: a stall lasted " + Seconds(age) + " (GRADLINK_STALL_SHUTDOWN_SECONDS=" +
           std::to_string(
               std::chrono::duration_cast<std::chrono::seconds>(opts_.stall_shutdown).count()) +
           "); ";
  }
  text += "stall inspector: tensors were submitted by some ranks and not by the others for over " +
          Seconds(opts_.stall_check) +
          " (ranks submitting different tensors, or only some of them submitting, deadlock the "
          "job):";
  constexpr size_t kMostLines = 20;
  for (size_t i = 0; i < lines.size() && i < kMostLines; ++i) text += "\n  " + lines[i];
  if (lines.size() > kMostLines) {
    text += "\n  ... and " + std::to_string(lines.size() - kMostLines) + " more";
  }
  GL_LOG(kWarn) << "scheduler: " << text;
  wire::Header h = MakeHeader(MsgType::kStallNotice);
  const Payload payload = Share(wire::EncodeText(text));
  for (uint32_t rank : told) {
    const auto it = workers_.find(rank);
    if (it != workers_.end() && !it->second->left) {
      it->second->link.Send(h, {}, payload, Clock::now());
    }
  }
  if (shutdown) Finish(Aborted(text));
}

}  // namespace gradlink::scheduler
