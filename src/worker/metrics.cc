// The worker's /metrics (off unless WorkerOptions::metrics_port is set), built per scrape on the
// metrics server's thread: Stats(), the counters (atomics), and a moment under mu_ for what is
// in flight.
#include "metrics/process.h"
#include "worker/worker_impl.h"

namespace gradlink {

using metrics::Add;
using metrics::Family;
using metrics::With;

metrics::Families WorkerImpl::CollectMetrics() {
  metrics::Families f;
  metrics::Labels labels = {{"job", opts_.job}, {"role", "worker"}};
  // Until Init() is done (metrics_ready_), the process alone: Stats() reads what it sets.
  if (!metrics_ready_.load(std::memory_order_acquire)) {
    metrics::AddProcessFamilies(f, labels, "gl-");
    return f;
  }
  labels.emplace_back("rank", std::to_string(rank_));
  metrics::AddProcessFamilies(f, labels, "gl-");
  const WorkerStats s = Stats();
  const WorkerStats::InForce& in = s.in_force;
  metrics::Labels tuning = labels;
  tuning.emplace_back("partition_bytes", std::to_string(in.partition_bytes));
  tuning.emplace_back("max_bytes_in_flight", std::to_string(in.max_bytes_in_flight));
  tuning.emplace_back("max_bytes_ahead", std::to_string(in.max_bytes_ahead));
  tuning.emplace_back("same_host_path", in.same_host_path ? "on" : "off");
  tuning.emplace_back("hierarchy", in.hierarchy.empty() ? "off" : in.hierarchy);
  tuning.emplace_back("chosen", in.chosen);
  Add(f, "gradlink_worker_tuning_info",
      "The settings in force (value 1): partition size, window (max_bytes_in_flight), lead "
      "(max_bytes_ahead; 0: none), the same-host path and hierarchy, and which gradlink chose.",
      "gauge")
      .Put(tuning, 1);
  AddCounter(f, "gradlink_worker_operations_total",
             "Operations (push_pull and collectives; each member of a group) completed OK.", labels,
             static_cast<double>(s.push_pulls));
  counters_->reduced_by_dtype.AddTo(
      Add(f, "gradlink_worker_reduced_bytes_total",
          "Bytes of operations that ended OK, by dtype (a fused group counts its fusion buffer).",
          "counter"),
      labels);
  const transport::LaneStats lanes = lanes_.stats();
  counters_->pushed_by_dtype.AddTo(
      Add(f, "gradlink_worker_pushed_bytes_total",
          "Payload bytes of pushes to the servers, by the dtype they went in.", "counter"),
      labels);
  counters_->pulled_by_dtype.AddTo(
      Add(f, "gradlink_worker_pulled_bytes_total",
          "Payload bytes of results from the servers, by the dtype they came in.", "counter"),
      labels);
  AddCounter(f, "gradlink_worker_lane_sent_bytes_total",
             "Bytes the worker's lanes sent: pushes, point-to-point messages, headers.", labels,
             static_cast<double>(lanes.bytes_sent));
  AddCounter(f, "gradlink_worker_lane_received_bytes_total",
             "Bytes the worker's lanes received: results, point-to-point messages, headers.",
             labels, static_cast<double>(lanes.bytes_received));
  Family& rounds = Add(f, "gradlink_worker_round_seconds",
                       "Each operation that ended OK: from its first push to its end (the last "
                       "pull written).",
                       "histogram");
  counters_->round_seconds.AddTo(rounds, labels);
  uint64_t busy_ns = counters_->busy_ns.load(std::memory_order_relaxed);
  uint64_t in_flight_bytes, ops, partitions_waiting;
  {
    MutexLock lock(mu_);
    in_flight_bytes = bytes_in_flight_;
    ops = ops_.size();
    partitions_waiting = pending_.size() + to_issue_.size();
    if (!ops_.empty()) {  // the busy stretch in progress
      busy_ns +=
          std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now() - busy_since_).count();
    }
  }
  AddCounter(f, "gradlink_worker_communication_seconds_total",
             "Time with at least one operation in flight (its rate: the share of a step spent "
             "communicating, overlapped or not).",
             labels, static_cast<double>(busy_ns) * 1e-9);
  AddGauge(f, "gradlink_worker_in_flight_bytes", "Bytes pushed and not yet answered.", labels,
           static_cast<double>(in_flight_bytes));
  AddGauge(f, "gradlink_worker_operations_in_flight", "Operations started and not ended.", labels,
           static_cast<double>(ops));
  AddGauge(f, "gradlink_worker_partitions_queued",
           "Partitions waiting to be pushed (the window full, or the lead reached).", labels,
           static_cast<double>(partitions_waiting));
  AddCounter(f, "gradlink_worker_fused_operations_total", "Fusion buffers pushed.", labels,
             static_cast<double>(s.fused_ops));
  AddCounter(f, "gradlink_worker_local_copied_bytes_total",
             "Bytes copied by the same-host path and hierarchical aggregation's host stage.",
             labels, static_cast<double>(s.bytes_copied_local));
  AddCounter(f, "gradlink_worker_local_busy_seconds_total",
             "Time this worker's threads spent copying and summing in the host's shared segment.",
             labels, static_cast<double>(s.local_busy_ns) * 1e-9);
  AddCounter(f, "gradlink_worker_protocol_errors_total",
             "Bad frames received by this worker's lanes.", labels,
             static_cast<double>(s.protocol_errors));
  AddCounter(f, "gradlink_worker_servers_lost_total",
             "Servers the scheduler declared lost (failover: their partitions moved).", labels,
             static_cast<double>(s.servers_lost));
  AddCounter(f, "gradlink_worker_partitions_recovered_total",
             "Partitions this worker reported to the servers that took them over.", labels,
             static_cast<double>(s.partitions_recovered));
  AddCounter(f, "gradlink_worker_partitions_held_total",
             "Partitions that waited for their operation's sums (the lead, max_bytes_ahead).",
             labels, static_cast<double>(s.partitions_held));
  AddGauge(f, "gradlink_membership_generation",
           "Control connections this member has had to its scheduler (1, plus one per rejoin).",
           labels, membership_ ? static_cast<double>(membership_->generation()) : 0);
  return f;
}

}  // namespace gradlink
