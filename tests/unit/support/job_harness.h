// A whole job in this process, for the unit tests that need one: a Scheduler (TCP on 127.0.0.1,
// port 0), servers and workers started on threads, talking over the inproc fabric. One harness
// for every suite that runs a job (unit/worker/*_test.cc, weighted_job_test), so that a change
// to how members start or end is made once. Every wait has a deadline: a test fails, it never
// hangs. Failures are gtest failures of the calling test; nothing here throws.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <list>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "gradlink/scheduler.h"
#include "gradlink/server.h"
#include "gradlink/worker.h"
#include "control/control_channel.h"
#include "transport/transport.h"

// Not gradlink::testing: inside namespace gradlink that name would hide gtest's ::testing.
namespace gradlink::test {

// To join the job (members), and for every member to register (scheduler).
inline constexpr std::chrono::seconds kConnectTimeout{10};
// For one operation: generous, since the tests share a loaded machine.
inline constexpr std::chrono::seconds kOpTimeout{20};

inline Clock::time_point In(Clock::duration d) { return Clock::now() + d; }

// Waits for two operations at once, each on its own thread, until `deadline`: how each ended,
// and how far apart their ends were.
struct TwoEnds {
  Status a, b;
  Clock::duration apart{};
};
TwoEnds WaitBoth(PushPullHandle& a, PushPullHandle& b, Clock::time_point deadline);

inline constexpr DataType kAllTypes[] = {DataType::kFloat32, DataType::kFloat64,
                                         DataType::kFloat16, DataType::kBFloat16,
                                         DataType::kInt32,   DataType::kInt64};

struct JobConfig {
  uint32_t workers = 2;
  uint32_t servers = 1;
  std::string job = "job-test";
  // Worker options. Small partitions let a test span many partitions and servers with little
  // data; the window and the lead are fixed too (the old defaults), so that what a test
  // measures does not move with the tuner. nullopt: gradlink chooses (control/tuning.h).
  std::optional<uint64_t> partition_bytes = 64 << 10;
  std::optional<uint64_t> max_bytes_in_flight = 32 << 20;
  std::optional<uint64_t> max_bytes_ahead = 0;
  uint64_t fusion_buffer_bytes = 4u << 20;
  uint64_t fusion_threshold_bytes = 256u << 10;
  // Placement weight of each server (by index); empty: every server has the default weight.
  std::vector<double> server_weights;
  uint64_t server_memory_budget = 0;  // ServerOptions::memory_budget_bytes of every server
  uint64_t job_memory_quota = 0;      // SchedulerOptions::memory_quota_bytes
  // The id each server (by index) claims (ServerOptions::id); empty: none claims one.
  std::vector<int32_t> server_ids;
  // The order the servers start in (indices), each `server_start_gap` after the one before, so
  // that they register in that order; empty: all at once. Workers start after the servers.
  std::vector<size_t> server_start_order;
  std::chrono::milliseconds server_start_gap{0};
  std::vector<uint32_t> fake_worker_ranks;  // ranks joined by a bare control channel (no Worker)
  // The same-host path (WorkerOptions::local_arena_bytes; 0: off). When on, the workers name
  // themselves "one-host/<rank>": one machine.
  uint64_t local_arena_bytes = 0;
  uint64_t local_chunk_bytes = 256u << 10;
  std::chrono::milliseconds operation_timeout = WorkerOptions{}.operation_timeout;
  // Last word on each worker's options (by rank), after everything above.
  std::function<void(uint32_t rank, WorkerOptions&)> per_worker;
  // Likewise for each server's (by start index).
  std::function<void(size_t index, ServerOptions&)> per_server;
  bool server_failover = true;  // SchedulerOptions::server_failover
  // The members talk over UCX (TCP loopback, in this process) instead of the inproc fabric,
  // which copies each frame into allocations of its own.
  bool ucx = false;
  // Standby servers (ServerOptions::standby), started with the others but not among the
  // scheduler's `servers`: start indices servers .. servers + standby_servers - 1.
  uint32_t standby_servers = 0;
};

// The settings the data path's per-partition figures are taken under (lock_count_test,
// allocation_count_test): whole operations in flight at once (the caller pumps every
// partition), then tight credit and a tight lead (the lanes pump as credit and lead come back,
// and take turns issuing).
struct PathLimits {
  const char* name;
  uint64_t max_bytes_in_flight;
  uint64_t max_bytes_ahead;
};
inline std::vector<PathLimits> DataPathLimits(uint64_t partition_bytes) {
  return {{"Unlimited", 32 << 20, 0},
          {"TightCredit", 4 * partition_bytes, 0},
          {"TightLead", 32 << 20, 2 * partition_bytes}};
}
// 2 workers and 1 server with partitions of `partition_bytes` under `limits`.
inline JobConfig DataPathJob(uint64_t partition_bytes, const PathLimits& limits) {
  JobConfig config;
  config.workers = 2;
  config.servers = 1;
  config.partition_bytes = partition_bytes;
  config.max_bytes_in_flight = limits.max_bytes_in_flight;
  config.max_bytes_ahead = limits.max_bytes_ahead;
  return config;
}

class Job {
 public:
  Job() = default;
  Job(const Job&) = delete;
  Job& operator=(const Job&) = delete;
  // Stops what is left, without checks: a test that ends early still tears everything down.
  ~Job();

  // Starts everything on threads; fails the test (and leaves the job partial) on error. Call
  // with ASSERT_NO_FATAL_FAILURE.
  void Start(const JobConfig& config);

  // Starts one more server now (a running job takes it as a standby); its start index, or why
  // it could not join.
  Result<size_t> AddServer(const std::function<void(ServerOptions&)>& tweak = {});
  size_t servers_started() const { return servers_.size(); }

  // Every worker says goodbye; the job must then end cleanly everywhere.
  void FinishCleanly();

  // A zeroed buffer for PushPull that lives until the workers have shut down: an operation that
  // a failing test leaves pending (or one the library still reads after failing it) never
  // touches freed memory. Thread-safe.
  std::vector<std::byte>& Buffer(size_t bytes);

  Worker& worker(uint32_t r) { return *workers_[r]; }
  Server& server(uint32_t i) { return *servers_[i]; }  // by start index, not by server id
  Scheduler& scheduler() { return *scheduler_; }
  void DropFake(uint32_t r) { fakes_[r].reset(); }  // closes without a goodbye
  const JobConfig& config() const { return config_; }

 private:
  // Server `i`'s options (by start index) from the config, joining the scheduler at `address`.
  ServerOptions ServerOptionsFor(const std::string& address, size_t i) const;

  JobConfig config_;
  std::mutex buffers_mu_;
  std::list<std::vector<std::byte>> buffers_;  // destroyed after the members below
  std::shared_ptr<transport::Fabric> fabric_;
  std::unique_ptr<Scheduler> scheduler_;
  std::vector<std::unique_ptr<Server>> servers_;
  std::vector<std::unique_ptr<Worker>> workers_;
  std::vector<std::unique_ptr<transport::ControlChannel>> fakes_;
};

// Runs fn(rank) on one thread per worker and joins them.
void OnEveryWorker(uint32_t workers, const std::function<void(uint32_t)>& fn);

}  // namespace gradlink::test
