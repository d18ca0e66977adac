// ServerStats: what this server has summed, held and spent, read from any thread (the
// counters are atomics; the partitions' held bytes are read under parts_mu_, shared).
#include "common/log.h"
#include "metrics/process.h"
#include "server/server_impl.h"

namespace gradlink {

ServerStats ServerImpl::stats() const {
  ServerStats s;
  s.rounds_completed = rounds_completed_.load();
  s.bytes_reduced = bytes_reduced_.load();
  s.protocol_errors = protocol_errors_.load() + lanes_.stats().protocol_errors;
  s.mismatches = mismatches_.load();
  {
    ReaderLock lock(parts_mu_);
    for (const auto& [id, part] : parts_) s.bytes_in_rounds += part->bytes_held();
    for (const Retiring& r : retiring_) s.bytes_in_rounds += r.part->bytes_held();
    s.partitions = parts_.size();
  }
  s.bytes_held = s.bytes_in_rounds + pool_.free_bytes();
  s.keys_retired = keys_retired_.load();
  s.peak_bytes_held = pool_.peak_bytes();
  s.buffer_allocations = pool_.allocations();
  s.process_cpu_seconds = metrics::ProcessCpuSeconds() - cpu_at_start_;
  if (s.bytes_reduced != 0) {
    s.cpu_seconds_per_gb = s.process_cpu_seconds / (static_cast<double>(s.bytes_reduced) / 1e9);
  }
  s.engine_threads = threads_.engines;
  s.threads = threads_.why;
  return s;
}

// The log line a server ends with, when it summed anything.
void ServerImpl::LogSummary() const {
  const ServerStats s = stats();
  if (s.bytes_reduced == 0) return;
  GL_LOG(kInfo) << "server " << id_ << ": summed " << (s.bytes_reduced >> 20)
                << " MiB of pushes with " << s.process_cpu_seconds << " s of CPU ("
                << s.cpu_seconds_per_gb << " s per GB), peak " << (s.peak_bytes_held >> 20)
                << " MiB of round buffers";
}

}  // namespace gradlink
