// The aggregation server: sums the pushes of every worker per (key, partition) and answers
// each worker's pull with the round's result.
//
// Pushes land in per-rank staging buffers on the push lane's progress thread and are summed on
// engine threads (sharded by key), always in rank order: bit-identical results whatever order
// pushes arrive in. fp16/bf16 accumulate in fp32. Rounds r and r+1 of a partition are held at
// once (double-buffered accumulator), so a fast worker's next round never touches the result
// a slow worker is still pulling.
//
// Threads: all methods are thread-safe.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>

#include "gradlink/export.h"
#include "gradlink/options.h"
#include "gradlink/status.h"

namespace gradlink {

struct ServerStats {
  uint64_t rounds_completed = 0;   // (key, partition) rounds summed and sent
  uint64_t bytes_reduced = 0;      // bytes of pushes summed
  uint64_t protocol_errors = 0;    // bad frames (connection closed) and bad pushes (refused)
  uint64_t mismatches = 0;         // pushes that disagreed with the declaration or each other
  // Bytes of round buffers (staging, accumulators, results) held now: in the hands of rounds
  // in flight, plus those kept free for the next rounds (at most 256 MiB); the most so far.
  // Rounds take buffers as their pushes arrive and give them back once summed or sent, so this
  // follows what the workers have in flight (their leads), not what the server was ever given.
  // The scheduler admits keys by the memory budget (ServerOptions::memory_budget_bytes) as if
  // every partition held its buffers at once: the bound stays whatever the timing.
  uint64_t bytes_held = 0;
  uint64_t bytes_in_rounds = 0;
  uint64_t peak_bytes_held = 0;
  uint64_t buffer_allocations = 0;  // round buffers allocated (not reused) so far
  // (key, partition) slots this server sums now, and keys it forgot because every worker had
  // declared their names again with another shape (Worker::Declare: the key retired).
  uint64_t partitions = 0;
  uint64_t keys_retired = 0;
  // CPU time of this process since the server started (all its threads: the server's own in
  // gradlink-server, which runs nothing else), and per GB of pushes summed (bytes_reduced); 0
  // before any push. The server logs both at info level when it stops.
  double process_cpu_seconds = 0;
  double cpu_seconds_per_gb = 0;
  // The server's threads: engines summing, and how they were chosen and placed
  // (ServerOptions::engine_threads, cpus), as the server logs it when it joins.
  uint32_t engine_threads = 0;
  std::string threads;
};

class GRADLINK_EXPORT Server {
 public:
  // Joins the job through the scheduler; returns once the address book has arrived.
  // kInvalidArgument naming the metrics port (options.metrics_port) when it is taken.
  static Result<std::unique_ptr<Server>> Start(const ServerOptions& options);
  virtual ~Server() = default;

  virtual uint32_t id() const = 0;

  // Blocks until the scheduler ends the job: OK on a clean shutdown, the failure on kAbort or a
  // lost scheduler, kTimeout at the deadline (the server keeps serving).
  virtual Status Wait(std::chrono::steady_clock::time_point deadline) = 0;

  // Leaves the job and joins the threads. Idempotent.
  virtual void Stop() = 0;

  virtual ServerStats stats() const = 0;
};

}  // namespace gradlink
