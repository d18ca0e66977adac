// Options of the three roles. Each field says its default; REQUIRES marks fields without one.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>

namespace gradlink {

using Clock = std::chrono::steady_clock;

namespace transport {
class Fabric;  // src/transport/transport.h
}

struct SchedulerOptions {
  std::string host = "127.0.0.1";  // address to listen on
  uint16_t port = 0;               // 0 picks a free port (see Scheduler::port())
  uint32_t num_workers = 1;        // REQUIRES >= 1: members the job waits for
  uint32_t num_servers = 1;        // REQUIRES >= 1
  std::string job = "default";     // job name; members of another job are refused
  // Every expected member must have registered within this time, or the job fails.
  std::chrono::milliseconds join_timeout{60000};
  // The job secret (docs/security.md); gradlink-scheduler fills it from GRADLINK_SECRET or
  // GRADLINK_SECRET_FILE. With one, every control connection must complete the HMAC handshake
  // before anything else it sends is processed. nullopt: the job runs unauthenticated.
  std::optional<std::string> secret;
};

struct ServerOptions {
  std::string scheduler;        // REQUIRES: "host:port" of the scheduler
  std::string job = "default";  // must equal the scheduler's
  uint32_t engine_threads = 2;  // threads that sum pushes, sharded by key; >= 1
  bool single_lane = false;     // answer pulls on the push lane (comparison mode)
  // Placement weight: the scheduler gives this server about weight / (sum of all servers'
  // weights) of every key's bytes, partition granularity permitting. Mixed placement (servers
  // on worker hosts too) gives the worker-host servers a smaller weight than dedicated ones.
  // Must be finite and in [1e-6, 1e6], else Start() fails with kInvalidArgument.
  double weight = 1.0;
  // Transport: "ucx" (default), or "inproc" with `fabric` set (threads as ranks, for tests).
  std::string transport = "ucx";
  std::shared_ptr<transport::Fabric> fabric;
  std::chrono::milliseconds connect_timeout{30000};  // to join the job
  std::string host_name;  // how this process is named in errors; default: the hostname
  // The job secret; must match the scheduler's (both set, equal; or both unset).
  std::optional<std::string> secret;
};

struct WorkerOptions {
  std::string scheduler;        // REQUIRES: "host:port" of the scheduler
  std::string job = "default";  // must equal the scheduler's
  int32_t rank = -1;            // rank to claim (e.g. torchrun's RANK); -1: assigned on join
  uint64_t partition_bytes = 4u << 20;       // tensors are cut into partitions of this size
  // Bytes of pushes handed to the transport and not yet sent; at least one partition.
  uint64_t max_bytes_in_flight = 32u << 20;
  // Bytes per server an operation may have pushed whose sums have not come back: an operation
  // whose partitions lie on k servers keeps at most k times this (and always one partition)
  // ahead; 0: no limit. A sum needs every worker's push, so this keeps the workers, and a
  // worker's flows to its servers, within that many bytes of each other, and bounds what
  // gradlink queues in the network: on links where a partition waits for the slowest of n flows,
  // the pulls then keep pace with the pushes (bench/RESULTS.md, "lead limit and receive
  // buffers", "lead per server"; docs/operations.md, "TCP fabrics"). Counted over the whole
  // operation, so the lead splits over the servers as their shares do (a server with twice the
  // share, whose flows must carry twice the bytes per second, gets twice the lead); scaled by k,
  // so one value suits any number of servers. Each operation has its own: one waiting for its
  // sums never holds back another.
  uint64_t max_bytes_ahead = 0;
  bool single_lane = false;  // push and pull on one lane (comparison mode)
  // Tensor fusion (Worker::PushPullGroup): a group's members of one dtype are packed (copied)
  // into fusion buffers of this many bytes, each pushed and pulled as one tensor, then copied
  // back. 4 MiB, the default partition size: a full buffer is one message to one server, whose
  // fixed cost is then well under 1% of its transfer, while a bigger buffer would only delay
  // the first push (a whole buffer is packed before it leaves). 0 disables fusion: every
  // member is pushed on its own.
  uint64_t fusion_buffer_bytes = 4u << 20;
  // Members of at least this many bytes are never fused: they are pushed from and pulled into
  // the caller's tensor (no copy). Fusing costs 2 copies of the member (pack, unpack: about
  // 0.1 ms per MiB from DRAM), a message of its own costs a fixed few tens of microseconds on
  // an unloaded host or a real fabric: about even at 256 KiB. On a loaded host a message costs
  // more and fusion pays up to ~1 MiB (bench/RESULTS.md, "Where fusion pays"): raise it
  // there. Values above fusion_buffer_bytes act as fusion_buffer_bytes.
  uint64_t fusion_threshold_bytes = 256u << 10;
  // The same-host path (src/worker/local_reduce.h): when every worker of the job is on one host
  // (their host names agree), they sum through a shared-memory segment of this many bytes,
  // worker to worker, instead of through the servers; results are bit-identical. 0: off, every
  // sum goes through the servers. Every worker must set it alike (worker 0's value sizes the
  // segment). A tensor takes 2 x workers x min(its bytes, local_chunk_bytes), rounded up to
  // 64 bytes; tensors that no longer fit go through the servers. The segment is reserved in
  // /dev/shm when the job starts; if it does not fit there, every worker logs a warning and
  // every sum goes through the servers.
  uint64_t local_arena_bytes = 0;
  // The most bytes of a tensor that go through the segment at a time, per worker (worker 0's
  // value counts). Small enough that a chunk stays in cache between its copy and its sums.
  uint64_t local_chunk_bytes = 256u << 10;
  std::string transport = "ucx";
  std::shared_ptr<transport::Fabric> fabric;
  std::chrono::milliseconds connect_timeout{30000};
  std::string host_name;
  // The job secret; must match the scheduler's (both set, equal; or both unset).
  std::optional<std::string> secret;
};

}  // namespace gradlink
