// Options of the three roles. Each field says its default; REQUIRES marks fields without one.
// Why each default is what it is: docs/operations.md, "Options".
#pragma once

#include <chrono>
#include <cstdint>
#include <optional>
#include <string>

namespace gradlink {

using Clock = std::chrono::steady_clock;

struct SchedulerOptions {
  std::string host = "127.0.0.1";  // address to listen on
  uint16_t port = 0;               // 0 picks a free port (see Scheduler::port())
  uint32_t num_workers = 1;        // REQUIRES >= 1: members the job waits for
  uint32_t num_servers = 1;        // REQUIRES >= 1
  std::string job = "default";     // job name; members of another job are refused
  // Every expected member must have registered within this time, or the job fails.
  std::chrono::milliseconds join_timeout{60000};
  // The job secret (docs/security.md): members must prove it before anything else they send is
  // processed. nullopt: unauthenticated. gradlink-scheduler reads GRADLINK_SECRET(_FILE).
  std::optional<std::string> secret;
  // A lost server's partitions move to the servers left, and training goes on (docs/
  // operations.md, "Server failover"); false: a lost server fails the job.
  bool server_failover = true;
  // The most bytes of partition state the job's keys may hold on all its servers together (a
  // tenant's memory quota: docs/operations.md, "Server memory"), besides each server's own
  // budget. A key past it fails on every worker with kResourceExhausted naming the quota and
  // what the job holds, before any data moves. 0: no quota. GRADLINK_JOB_MEMORY (K/M/G).
  uint64_t memory_quota_bytes = 0;
  // Metrics (docs/operations.md, "Watching a job"): the port /metrics and /targets (every
  // member's metrics address, for Prometheus' HTTP service discovery) are served on, at `host`;
  // 0 picks a free one, logged as "metrics: http://HOST:PORT/metrics"; -1: not served.
  // A port that is taken fails Start(). GRADLINK_METRICS_PORT ("off" for -1).
  int32_t metrics_port = 0;
  // The stall inspector: a tensor declared, or a round of it pushed, by some workers and not by
  // the others for this long is logged, naming the ranks that have not and the tensors, and
  // told to the workers that have; again every period while it lasts. 0: off.
  // GRADLINK_STALL_CHECK_SECONDS (HOROVOD_STALL_CHECK_TIME_SECONDS; HOROVOD_STALL_CHECK_DISABLE).
  std::chrono::milliseconds stall_check{60000};
  // A stall this old fails the job with that message. 0: never.
  // GRADLINK_STALL_SHUTDOWN_SECONDS (HOROVOD_STALL_SHUTDOWN_TIME_SECONDS).
  std::chrono::milliseconds stall_shutdown{0};
};

struct ServerOptions {
  std::string scheduler;        // REQUIRES: "host:port" of the scheduler
  std::string job = "default";  // must equal the scheduler's
  // Server id to claim (0 .. servers - 1), as a worker claims a rank: launchers give each
  // server its own so that their names and the scheduler's agree; -1: the scheduler assigns
  // the free ids, heaviest weight first.
  int32_t id = -1;
  // Threads that sum pushes, sharded by partition. 0: chosen from the CPUs this server has
  // (its pinned list, else the machine's shared by the job's processes on it) less its lane
  // threads, at least 1 (docs/operations.md, "What gradlink tunes"). GRADLINK_SERVER_ENGINES.
  uint32_t engine_threads = 0;
  // Pin the server's threads to these CPUs ("0-3,8", as Linux lists them): each lane's progress
  // thread to one, the engines round robin over the rest. Empty: not pinned. Start() fails with
  // kInvalidArgument on a malformed list or a CPU the process may not run on.
  // GRADLINK_SERVER_CPUS.
  std::string cpus;
  bool single_lane = false;     // answer pulls on the push lane (comparison mode)
  // Placement weight: this server gets about weight / (sum of weights) of every key's bytes.
  // Finite, in [1e-6, 1e6], else Start() fails with kInvalidArgument.
  double weight = 1.0;
  // The most bytes of partition state (staging, accumulators, results) this server may hold:
  // the scheduler refuses a key whose partitions would take a server past its budget
  // (kResourceExhausted on every worker, before any data moves). 0: three quarters of the
  // machine's available memory when the server starts, split evenly between the job's servers
  // on this host. What a server holds per byte: docs/operations.md, "Server memory".
  uint64_t memory_budget_bytes = 0;
  // A standby: joins the job (before it starts, or a running one) without taking partitions,
  // and takes over the next lost server's (failover, docs/operations.md). It is not one of the
  // scheduler's `num_servers`; its id, if it claims one, is `num_servers` or more. A server
  // that joins a running job is a standby whether or not it says so.
  bool standby = false;
  std::chrono::milliseconds connect_timeout{30000};  // to join the job
  // Restart: when the scheduler goes away without ending the job (its process died), keep the
  // data path running and rejoin a scheduler restarted on the same address for this long;
  // then the job fails, naming the scheduler. 0: fail at once. GRADLINK_SCHEDULER_RECONNECT
  // (seconds). docs/operations.md, "Scheduler restart".
  std::chrono::milliseconds scheduler_reconnect_timeout{30000};
  // The host this process is on: workers whose host names agree share a machine (the same-host
  // path). Also how it is named in errors. Default: the hostname, with the network namespace
  // where it is not the machine's own, and the pid ("vm/1234"); GRADLINK_HOST sets it.
  std::string host_name;
  // The job secret; must match the scheduler's (both set, equal; or both unset).
  std::optional<std::string> secret;
  // Metrics: as SchedulerOptions::metrics_port, on every interface (the scheduler lists the
  // address it knows this server by). On by default, on a free port. GRADLINK_METRICS_PORT.
  int32_t metrics_port = 0;
  // The stall inspector's period (SchedulerOptions::stall_check): a round some workers have
  // pushed and others not for this long is reported to the scheduler, which names the tensors.
  // GRADLINK_STALL_CHECK_SECONDS, as the scheduler's.
  std::chrono::milliseconds stall_check{60000};
};

struct WorkerOptions {
  std::string scheduler;        // REQUIRES: "host:port" of the scheduler
  std::string job = "default";  // must equal the scheduler's
  int32_t rank = -1;            // rank to claim (e.g. torchrun's RANK); -1: assigned on join
  // The next three, left unset, are chosen by gradlink for the job it joins, from the job's
  // shape (every member on one machine, or a network; workers, servers): docs/operations.md,
  // "What gradlink tunes". A value set here (or by its GRADLINK_* variable) wins.
  // Tensors are cut into partitions of this size (every worker must give the same, or none).
  std::optional<uint64_t> partition_bytes;
  // Bytes of pushes handed to the transport and not yet sent; at least one partition.
  std::optional<uint64_t> max_bytes_in_flight;
  // Per server an operation spans: bytes pushed whose sums have not come back (always at least
  // one partition); 0: no limit. Keeps the workers' flows in step on shared links.
  std::optional<uint64_t> max_bytes_ahead;
  bool single_lane = false;  // push and pull on one lane (comparison mode)
  // PushPullGroup packs a group's small members of one dtype into buffers of this many bytes,
  // each pushed as one tensor; 0: no fusion, every member on its own.
  uint64_t fusion_buffer_bytes = 4u << 20;
  // Members of at least this many bytes are never fused (no copy); above fusion_buffer_bytes it
  // acts as fusion_buffer_bytes.
  uint64_t fusion_threshold_bytes = 256u << 10;
  // The same-host path: when every worker of the job is on one host, they sum through a
  // shared-memory segment of this many bytes instead of the servers (bit-identical results);
  // 0: off. Worker 0's value sizes the segment (at the default, at most half of what /dev/shm
  // has free; a value that does not fit there turns the path off, with a warning); tensors that
  // no longer fit use the servers.
  static constexpr uint64_t kDefaultLocalArenaBytes = 64u << 20;
  uint64_t local_arena_bytes = kDefaultLocalArenaBytes;
  // The most bytes of a tensor in the segment at a time, per worker (worker 0's value counts).
  uint64_t local_chunk_bytes = 256u << 10;
  // Hierarchical aggregation: when the job spans several hosts and some host has several
  // workers, the workers of a host sum among themselves through a shared-memory segment of
  // local_arena_bytes first (each pushes and pulls its share of the partitions for the host),
  // so each host moves a tensor's bytes once each way. false: every worker pushes everything
  // (flat, bit-identical to gradlink without hierarchy). GRADLINK_HIERARCHICAL. A key is
  // hierarchical only if every worker's host could take it (docs/operations.md).
  bool hierarchical = true;
  // With hierarchy, 16-bit (fp16/bf16) host partial sums are sent in fp32 (every value rounded
  // once, as the flat path does; a host then moves 2x the tensor's bytes). true: in their own
  // dtype (half the bytes, a second rounding). Every worker must agree. GRADLINK_HALF_PARTIALS.
  bool half_partials = false;
  std::chrono::milliseconds connect_timeout{30000};  // to join the job
  // Restart: when the scheduler goes away without ending the job (its process died), keep the
  // data path running and rejoin a scheduler restarted on the same address for this long;
  // then the job fails, naming the scheduler. 0: fail at once. GRADLINK_SCHEDULER_RECONNECT
  // (seconds). docs/operations.md, "Scheduler restart".
  std::chrono::milliseconds scheduler_reconnect_timeout{30000};
  // PushPullHandle::Wait() without a deadline waits this long, then returns kTimeout.
  std::chrono::milliseconds operation_timeout{300000};
  // The host this process is on: workers whose host names agree share a machine (the same-host
  // path). Also how it is named in errors. Default: the hostname, with the network namespace
  // where it is not the machine's own, and the pid ("vm/1234"); GRADLINK_HOST sets it.
  std::string host_name;
  // The job secret; must match the scheduler's (both set, equal; or both unset).
  std::optional<std::string> secret;
  // Metrics: as ServerOptions::metrics_port, but off by default (-1): a job of a thousand
  // workers is watched through its servers and scheduler. GRADLINK_METRICS_PORT turns it on.
  int32_t metrics_port = -1;
};

}  // namespace gradlink
