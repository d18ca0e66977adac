// The worker's per-tensor and per-operation state, and the counters its groups share.
//
// Who touches what: every field marked "guarded by WorkerImpl::mu_" is read and written only
// under the worker's state lock (worker_impl.h says which threads take it). An Op's completion
// (`done`, `status`, `cv`) has its own small lock, `Op::mu`, which waiters take without mu_;
// a Group's results are under `Group::mu`. Lock order: Group::mu -> Op::mu, and mu_ -> Op::mu;
// never Op::mu -> mu_.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "control/layout.h"
#include "control/topology.h"
#include "gradlink/worker.h"
#include "wire/messages.h"
#include "worker/local_reduce.h"

namespace gradlink::internal {

// Counters shared by a worker and its groups (a group may outlive its worker).
struct Counters {
  std::atomic<uint64_t> push_pulls{0}, bytes_reduced{0}, groups{0}, fused_ops{0},
      bytes_packed{0}, bytes_unpacked{0}, partitions_held{0}, peak_bytes_ahead{0},
      bytes_copied_results{0}, servers_lost{0}, partitions_recovered{0};
};


struct TensorState {
  uint64_t key = 0;
  std::string name;
  DataType dtype{};
  uint64_t count = 0;
  std::vector<uint64_t> shape;  // as declared; empty when not given
  CollectiveSpec spec;          // the plain sum unless declared with one
  uint64_t input_count = 0, output_count = 0;  // this worker's buffers (layout.h)
  std::vector<layout::LocalCopy> copies;       // what this worker copies itself, per op
  // Guarded by WorkerImpl::mu_.
  bool planned = false;
  Status plan_status;                      // kMismatch when the workers disagree
  std::vector<wire::PartitionPlan> parts;  // once planned
  // Once planned, for a key that is not a plain sum: this worker's role in each partition
  // (empty for a sum: every partition pushed from and pulled into its own place).
  std::vector<layout::Role> roles;
  std::vector<uint32_t> order;  // the partitions it takes part in, in the order it pushes them
  uint32_t servers_spanned = 0;            // distinct servers among `parts`
  // The same-host path (LocalReduce): bound on the tensor's first op; `local` empty when
  // the tensor goes through the servers.
  // Bound once (local_once), by the first op's caller, outside WorkerImpl::mu_: a claim in the
  // segment may wait on another process. `local_bound` and what follows are guarded by mu_.
  std::once_flag local_once;
  bool local_bound = false;
  Status local_status;  // the bind failed (another worker bound the key with another shape)
  std::optional<LocalReduce::Channel> local;
  // Hierarchical aggregation: the host channel, bound at Declare (before the declaration says
  // whether this host can sum the key), then, once planned, how the key goes (mode), what
  // travels (wire: the dtype, or fp32 partials) and, per partition, the local rank pushing it.
  std::optional<LocalReduce::HostChannel> host;
  topology::Mode mode = topology::Mode::kFlat;
  // Restart (control_loop.cc Rejoin), under mu_: its kDeclare's mode, once the declaration is
  // made (declared); declare_pending: made while the worker was rejoining a restarted
  // scheduler, so sent once it is back.
  uint8_t declared_mode = 0;
  bool declared = false;
  bool declare_pending = false;
  DataType wire{};
  std::vector<uint32_t> pusher;
  uint32_t pushed_here = 0;  // partitions this worker pushes for its host
  uint64_t next_round = 0;
  // Failover (WorkerImpl::KeepsResults): each partition's last result as received, and its
  // round (kNoResult: none, or a receive that failed part way). A server that takes over a
  // lost one's partition gets it from every worker: those that missed it are answered with it.
  static constexpr uint64_t kNoResult = UINT64_MAX;
  std::vector<std::vector<std::byte>> results;
  std::vector<uint64_t> result_round;
  // Per partition: the server (id + 1) whose reply is being written into results[p]; 0: none.
  std::vector<uint32_t> receiving_from;
  bool busy = false;                       // an op of this tensor is in flight
  std::deque<std::shared_ptr<Op>> queue;   // ops waiting for the plan or for the busy one
  // Fusion. For a member: the fused tensors that contain it, whose ops fail when its plan does
  // (its shape differs on another worker). For a fused tensor: its members, for errors, and
  // the failure of a member's plan, which fails every op of it.
  std::vector<TensorState*> fused_in;
  std::string fused_members;
  Status member_failure;
};

struct Op;

// What an op still waits for, for the message of a Wait() that times out: the worker's
// DescribePending under its lock, while the worker lives (Detach() at its end).
class PendingDescriber {
 public:
  explicit PendingDescriber(std::function<std::string(const Op&)> describe)
      : describe_(std::move(describe)) {}
  std::string Describe(const Op& op) {
    std::lock_guard lock(mu_);
    return describe_ ? describe_(op) : std::string();
  }
  void Detach() {
    std::lock_guard lock(mu_);
    describe_ = nullptr;
  }

 private:
  std::mutex mu_;
  std::function<std::string(const Op&)> describe_;
};

struct Op {
  std::shared_ptr<TensorState> tensor;
  std::shared_ptr<PendingDescriber> describer;  // null: the op never reached a worker
  std::span<std::byte> data;         // the output (a sum's tensor, in place)
  std::span<const std::byte> input;  // what is pushed: `data` but for other collectives
  PushPullOptions options;
  uint64_t id = 0;
  Clock::duration timeout{};  // WorkerOptions::operation_timeout: for Wait() without a deadline
  // The worker's same-host path, if it has one: waiting on the op drives it (LocalReduce::Wait),
  // whichever way the op goes (the op's tensor may not be planned yet).
  std::shared_ptr<LocalReduce> local;
  // Guarded by WorkerImpl::mu_.
  // A hierarchical op: its partitions go through the host channel. `partial[p]`: where the
  // host's partial sum of partition p lies once this worker summed it (pushed from, pulled
  // into), with its push's flags; `host_done`: the host job is over (with `host_status`).
  bool host = false;
  std::vector<std::span<std::byte>> partial;
  std::vector<uint16_t> push_flags;
  bool host_done = false;
  Status host_status;
  std::atomic<uint64_t> round{0};  // atomic: Wait() reads it (for its message) without mu_
  // kSent holds bytes-in-flight credit until the push has left; kPushed waits for its pull.
  enum class Part : uint8_t { kQueued, kSent, kPushed, kDone };
  std::vector<Part> parts;
  uint32_t outstanding = 0;  // partitions not yet answered (pulled, or refused by the server)
  // WorkerOptions::max_bytes_ahead: the op's limit (the option times the servers its partitions
  // lie on), the bytes sent (or let back into the queue to be sent) and not yet answered, and
  // the partitions held back meanwhile, in order (seq, partition).
  uint64_t max_ahead = 0;
  uint64_t bytes_ahead = 0;
  std::deque<std::pair<uint64_t, uint32_t>> held;
  uint32_t sending = 0;      // pushes the transport may still be reading from `data`
  uint32_t receiving = 0;    // pulls being written into `data` right now
  // The first error. The op still pushes and collects every partition, so each server's round
  // count stays in step with ours for the next op on this tensor.
  Status failure;
  // No more replies will come (this worker failed, or a push could not be sent): queued
  // partitions are dropped and the op ends once the transport no longer touches `data`.
  bool abandoned = false;
  bool started = false;   // holds its tensor's busy flag
  bool finished = false;
  // A fusion buffer that `data` points into (fused ops): it lives as long as the op.
  std::shared_ptr<std::byte> owned;
  // Where the time went (PushPullTiming); set under WorkerImpl::mu_, read once `done`.
  Clock::time_point t_call, t_first_issue, t_pushed, t_arrived, t_done;
  Clock::duration t_server{};  // the most a partition's server reported (PushPullTiming::server)
  // Completion, guarded by `mu`.
  std::mutex mu;
  std::condition_variable cv;
  bool done = false;
  Status status;
};

// One PushPullGroup: its fused and unfused operations ("parts").
struct Group {
  struct Member {
    std::span<std::byte> data;  // the caller's tensor
    uint64_t offset;            // where it lies in the fusion buffer
  };
  struct Part {
    std::shared_ptr<Op> op;       // released once the part has ended (returns its buffer)
    std::span<std::byte> packed;  // fused: the bytes of the fusion buffer (owned by `op`)
    std::vector<Member> members;  // fused: where each member's result goes
    const std::string* what = nullptr;  // fused: names the fused tensor and its members
    // Guarded by `mu`: once the op is done, its status and times, the result unpacked.
    bool ended = false;
    Status status;
    Clock::time_point t_call, t_first_issue, t_pushed, t_arrived, t_done;
    Clock::duration t_server{};
  };
  std::string what;  // "push_pull group of N tensors (...)"
  Clock::duration timeout{};  // WorkerOptions::operation_timeout: for Wait() without a deadline
  std::shared_ptr<Counters> counters;
  std::shared_ptr<const void> plan;  // keeps the `what` strings of the parts alive
  Clock::time_point t_call, t_started;
  std::vector<Part> parts;  // fixed once the group is handed out
  std::mutex mu;
  bool finished = false;
  Status status;
  Clock::time_point t_finished;
};

}  // namespace gradlink::internal
