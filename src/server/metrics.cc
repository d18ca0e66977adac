// The server's /metrics, built per scrape on the HTTP server's thread from the counters (atomics)
// and ServerStats; and the stall inspector's scan of the rounds, on the control thread.
#include <algorithm>

#include "common/log.h"
#include "metrics/process.h"
#include "server/server_impl.h"

namespace gradlink {

using metrics::Add;
using metrics::Family;
using metrics::With;

metrics::Families ServerImpl::CollectMetrics() const {
  metrics::Families f;
  const metrics::Labels labels = {
      {"job", opts_.job}, {"role", "server"}, {"server", std::to_string(id_.load())}};
  metrics::AddProcessFamilies(f, labels, "gl-");
  // Until the job is known (num_workers_ publishes what stats() reads), the process alone.
  if (num_workers_.load(std::memory_order_acquire) == 0) return f;
  const ServerStats s = stats();
  Add(f, "gradlink_server_info", "The server's threads as chosen and placed (value 1).", "gauge")
      .Put(With(With(labels, "engine_threads", std::to_string(s.engine_threads)), "threads",
                s.threads),
           1);
  AddGauge(f, "gradlink_server_workers", "Workers of the job this server serves.", labels,
           static_cast<double>(num_workers_.load()));
  const transport::LaneStats lanes = lanes_.stats();
  AddCounter(f, "gradlink_server_received_bytes_total",
             "Bytes the server's lanes received: pushes (and the workers' failover reports).",
             labels, static_cast<double>(lanes.bytes_received));
  AddCounter(f, "gradlink_server_sent_bytes_total",
             "Bytes the server's lanes sent: the sums the workers pull.", labels,
             static_cast<double>(lanes.bytes_sent));
  summed_by_dtype_.AddTo(Add(f, "gradlink_server_summed_bytes_total",
                             "Bytes of pushes summed, by the dtype they came in.", "counter"),
                         labels);
  sent_by_dtype_.AddTo(Add(f, "gradlink_server_results_sent_bytes_total",
                           "Bytes of results sent to the workers, by the dtype they went in.",
                           "counter"),
                       labels);
  AddCounter(f, "gradlink_server_rounds_total", "Rounds of (key, partition) summed and sent.",
             labels, static_cast<double>(s.rounds_completed));
  AddGauge(f, "gradlink_server_partitions", "(key, partition) slots this server sums now.", labels,
           static_cast<double>(s.partitions));
  AddCounter(f, "gradlink_server_keys_retired_total",
             "Keys forgotten because every worker declared their names again.", labels,
             static_cast<double>(s.keys_retired));
  AddGauge(f, "gradlink_server_state_bytes",
           "Round buffers held now: those of rounds in flight and those kept free for the next "
           "(the scheduler admits keys against gradlink_scheduler_server_budget_bytes).",
           labels, static_cast<double>(s.bytes_held));
  AddGauge(f, "gradlink_server_state_in_rounds_bytes", "Round buffers held by rounds in flight.",
           labels, static_cast<double>(s.bytes_in_rounds));
  AddGauge(f, "gradlink_server_state_peak_bytes", "The most round-buffer bytes held so far.",
           labels, static_cast<double>(s.peak_bytes_held));
  AddCounter(f, "gradlink_server_buffer_allocations_total", "Round buffers allocated (not reused).",
             labels, static_cast<double>(s.buffer_allocations));
  AddGauge(f, "gradlink_server_cpu_seconds_per_gigabyte",
           "CPU seconds of the server per GB of pushes summed, since it started (0 before any).",
           labels, s.cpu_seconds_per_gb);
  AddGauge(f, "gradlink_server_engine_threads", "Threads that sum pushes.", labels,
           static_cast<double>(s.engine_threads));
  Family& depth = Add(f, "gradlink_server_engine_queue_depth",
                      "Partitions posted to each engine thread and not yet taken up.", "gauge");
  for (size_t e = 0; e < engines_.size(); ++e) {
    depth.Put(With(labels, "engine", std::to_string(e)),
              static_cast<double>(engines_[e]->depth()));
  }
  AddCounter(f, "gradlink_server_protocol_errors_total",
             "Bad frames (connection closed) and bad pushes (refused).", labels,
             static_cast<double>(s.protocol_errors));
  AddCounter(f, "gradlink_server_mismatches_total",
             "Pushes that disagreed with their declaration or with each other.", labels,
             static_cast<double>(s.mismatches));
  AddCounter(f, "gradlink_server_peers_lost_total", "Workers' endpoints that failed.", labels,
             static_cast<double>(peers_lost_.load()));
  AddCounter(f, "gradlink_server_partitions_adopted_total",
             "Partitions taken over from lost servers (failover).", labels,
             static_cast<double>(partitions_adopted_.load()));
  AddCounter(f, "gradlink_server_stalled_rounds_total",
             "Rounds reported to the scheduler as stalled (pushed by some workers, not others).",
             labels, static_cast<double>(stalls_reported_.load()));
  AddGauge(f, "gradlink_membership_generation",
           "Control connections this member has had to its scheduler (1, plus one per rejoin).",
           labels, membership_ ? static_cast<double>(membership_->generation()) : 0);
  return f;
}

void ServerImpl::CheckStalls() {
  const auto period = opts_.stall_check;
  if (period.count() <= 0) return;
  const auto now = transport::Clock::now();
  // A scan a second at most (a lock per partition), and no more often than the period.
  const auto every = std::min<transport::Clock::duration>(period, std::chrono::seconds(1));
  if (now - last_stall_scan_ < every) return;
  last_stall_scan_ = now;
  std::vector<wire::StalledRound> report;
  size_t bytes = 4;
  std::map<std::pair<uint64_t, uint32_t>, std::pair<uint64_t, transport::Clock::time_point>> told;
  {
    ReaderLock lock(parts_mu_);
    for (const auto& [id, part] : parts_) {
      std::optional<PartitionState::Waiting> w = part->Stalled(now, period);
      if (!w) continue;
      // Each stalled round once, then again every period while it lasts.
      auto it = stalls_told_.find(id);
      const bool again = it != stalls_told_.end() && it->second.first == w->round;
      if (again && now - it->second.second < period) {
        told[id] = it->second;
        continue;
      }
      // A key's partitions stall alike: its first stalled partition speaks for the round.
      const bool key_in = !report.empty() && report.back().key == id.first &&
                          report.back().round == w->round;
      const size_t size = 36 + 4 * (w->missing.size() + w->pushed.size());
      if (!key_in && (report.size() == wire::kMaxStalledRounds ||
                      bytes + size > wire::kMaxStallReportBytes)) {
        continue;  // not told: it goes in a later report
      }
      told[id] = {w->round, now};
      if (key_in) continue;
      bytes += size;
      report.push_back({id.first, id.second, w->round,
                        static_cast<uint64_t>(
                            std::chrono::duration_cast<std::chrono::milliseconds>(w->age).count()),
                        std::move(w->missing), std::move(w->pushed)});
    }
  }
  stalls_told_ = std::move(told);  // rounds that moved on are forgotten
  if (report.empty()) return;
  stalls_reported_ += report.size();
  wire::Header h;
  h.type = wire::MsgType::kStallReport;
  h.job = job_hash_;
  h.sender = id_;
  h.count = report.size();
  membership_->Reply(h, wire::Encode(report));
}

}  // namespace gradlink
