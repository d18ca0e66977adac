// The worker's per-tensor and per-operation state, and the counters its groups share.
//
// Who touches what: every field marked "guarded by WorkerImpl::mu_" is read and written only
// under the worker's state lock (worker_impl.h says which threads take it). An Op's completion
// (`done`, `status`, `cv`) has its own small lock, `Op::mu`, which waiters take without mu_;
// a Group's results are under `Group::mu`. Lock order: Group::mu -> Op::mu, and mu_ -> Op::mu;
// never Op::mu -> mu_. The fields under Op::mu, Group::mu and the small locks here are
// GUARDED_BY them (checked by clang: tests/thread_safety/check.py); those under the worker's
// mu_, and a Group::Part's under its group's mu, cannot name their lock from here and are not.
#pragma once

#include <atomic>
#include <cstdint>
#include <cstddef>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "common/mutex.h"
#include "common/thread_annotations.h"
#include "control/layout.h"
#include "metrics/by_dtype.h"
#include "metrics/histogram.h"
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
  // For /metrics: bytes of ops that ended OK by dtype (indexed by DataType's value; a fused
  // op counts its fusion buffer), each such op's time from its first push to its end, and the
  // time with at least one op in flight (nanoseconds).
  metrics::ByDtype reduced_by_dtype;
  // Payload bytes of pushes handed to the push lane and of results received, by wire dtype.
  metrics::ByDtype pushed_by_dtype, pulled_by_dtype;
  metrics::Histogram round_seconds;
  std::atomic<uint64_t> busy_ns{0};
};

// A first-in first-out queue in a vector that keeps its capacity: it starts over at its front
// once emptied, and moves what is left to the front once half of it has been taken. A
// std::deque allocates its map and a block as it is constructed, and a block each time its end
// crosses into a new one (an allocation per op, or per 32 ops, for these queues).
template <typename T>
class VectorFifo {
 public:
  bool empty() const { return head_ == items_.size(); }
  size_t size() const { return items_.size() - head_; }
  const T& front() const { return items_[head_]; }
  void push_back(T v) { items_.push_back(std::move(v)); }
  void clear() {
    items_.clear();
    head_ = 0;
  }
  void swap(VectorFifo& other) {
    items_.swap(other.items_);
    std::swap(head_, other.head_);
  }
  size_t capacity() const { return items_.capacity(); }
  void pop_front() {
    items_[head_] = T();  // what it holds (an op) goes now, not when the queue empties
    if (++head_ == items_.size()) {
      items_.clear();
      head_ = 0;
    } else if (head_ >= kCompactAfter && 2 * head_ >= items_.size()) {
      items_.erase(items_.begin(), items_.begin() + static_cast<std::ptrdiff_t>(head_));
      head_ = 0;
    }
  }

 private:
  static constexpr size_t kCompactAfter = 32;
  std::vector<T> items_;
  size_t head_ = 0;
};

// Where each partition of an op stands (Op::parts). kSent holds bytes-in-flight credit until
// the push has left; kPushed waits for its pull.
// kPushed: its send has completed (or will not, its server lost), its window credit is back;
// kLeft: the same for a push ahead only until sent (WorkerImpl::AheadUntilSent) that was sent
// whole, whose lead is back too.
enum class PartStage : uint8_t { kQueued, kSent, kPushed, kLeft, kDone };

struct TensorState {
  uint64_t key = 0;
  // Names are labels matched per call, as Horovod's are: `label` is the name the caller gave,
  // `name` what the key hashes (VersionedName): the label itself when first declared, then a
  // new name each time the label comes back with another dtype, shape or collective, or after
  // its plan was refused (`version` counts those). The earlier declaration is then retired.
  std::string label;
  uint32_t version = 0;
  std::string name;
  DataType dtype{};
  uint64_t count = 0;
  std::vector<uint64_t> shape;  // as declared; empty when not given
  CollectiveSpec spec;          // the plain sum unless declared with one
  uint64_t input_count = 0, output_count = 0;  // this worker's buffers (layout.h)
  std::vector<layout::LocalCopy> copies;       // what this worker copies itself, per op
  // False once the label was declared again or this declaration's plan was refused: its
  // handles (TensorHandle::current) no longer start ops that can succeed. Written under
  // WorkerImpl::mu_, read without it.
  std::atomic<bool> current{true};
  // Guarded by WorkerImpl::mu_.
  bool planned = false;
  Status plan_status;                      // kMismatch when the workers disagree
  std::vector<wire::PartitionPlan> parts;  // once planned
  // Once planned, for a key that is not a plain sum: this worker's role in each partition
  // (empty for a sum: every partition pushed from and pulled into its own place).
  std::vector<layout::Role> roles;
  // Its pushes that get no data back count in their op's lead only until sent
  // (WorkerImpl::AheadUntilSent): this worker receives at least as many bytes of the key as it
  // pushes (an allgather's or all-to-all's, not a broadcast root's or a reduce-scatter's).
  bool acks_behind_data = false;
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
  // The running op's `parts` came from here and go back when it ends (FinishLocked): one op of
  // a tensor runs at a time, and its vector keeps its capacity for the next.
  std::vector<PartStage> spare_parts;
  VectorFifo<std::pair<uint64_t, uint32_t>> spare_held;  // likewise for its `held`
  VectorFifo<std::shared_ptr<Op>> queue;   // ops waiting for the plan or for the busy one
  // Fusion. For a member: the fused tensors that contain it, whose ops fail when its plan does
  // (its shape differs on another worker). For a fused tensor: its members, for errors, and
  // the failure of a member's plan, which fails every op of it.
  std::vector<TensorState*> fused_in;
  std::string fused_members;
  Status member_failure;
};

struct Op;

// Memory for ops (each with its shared_ptr's control block: std::allocate_shared), kept when an
// op ends for the next one, so that starting an op allocates nothing in the steady state. Any
// thread gives memory back (the last reference to an op may be a handle's), hence the lock:
// once per op, never per partition. Shared by the worker and every op it made, so it outlives
// them all.
class OpMemory {
 public:
  OpMemory() = default;
  OpMemory(const OpMemory&) = delete;
  OpMemory& operator=(const OpMemory&) = delete;
  ~OpMemory() {
    for (void* p : free_) ::operator delete(p);
  }
  void* Take(size_t bytes) {
    {
      MutexLock lock(mu_);
      if (block_ == 0) block_ = bytes;
      if (bytes == block_ && !free_.empty()) {
        void* p = free_.back();
        free_.pop_back();
        return p;
      }
    }
    return ::operator new(bytes);
  }
  void Give(void* p, size_t bytes) {
    {
      MutexLock lock(mu_);
      if (bytes == block_ && free_.size() < kMaxFree) {
        free_.push_back(p);
        return;
      }
    }
    ::operator delete(p);
  }

 private:
  static constexpr size_t kMaxFree = 1024;
  Mutex mu_;
  size_t block_ GUARDED_BY(mu_) = 0;  // the one size it keeps (an op's, with its control block)
  std::vector<void*> free_ GUARDED_BY(mu_);
};

template <typename T>
struct OpAllocator {
  using value_type = T;
  explicit OpAllocator(std::shared_ptr<OpMemory> m) : memory(std::move(m)) {}
  template <typename U>
  OpAllocator(const OpAllocator<U>& other) : memory(other.memory) {}  // NOLINT: rebinding
  T* allocate(size_t n) { return static_cast<T*>(memory->Take(n * sizeof(T))); }
  void deallocate(T* p, size_t n) { memory->Give(p, n * sizeof(T)); }
  template <typename U>
  bool operator==(const OpAllocator<U>& other) const { return memory == other.memory; }
  std::shared_ptr<OpMemory> memory;
};

// What an op still waits for, for the message of a Wait() that times out: the worker's
// DescribePending under its lock, while the worker lives (Detach() at its end).
class PendingDescriber {
 public:
  explicit PendingDescriber(std::function<std::string(const Op&)> describe)
      : describe_(std::move(describe)) {}
  std::string Describe(const Op& op) {
    MutexLock lock(mu_);
    return describe_ ? describe_(op) : std::string();
  }
  void Detach() {
    MutexLock lock(mu_);
    describe_ = nullptr;
  }

 private:
  // Taken before WorkerImpl::mu_ (describe_ takes it: DescribePending), never under it.
  Mutex mu_;
  std::function<std::string(const Op&)> describe_ GUARDED_BY(mu_);
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
  std::vector<uint16_t> push_ranks;  // per partition: its push's wire::Header::ranks
  // This worker has joined (Worker::Join) and runs the round only to push its share of the
  // host's partials for the others (LocalReduce::Job::sits_out): no data, no caller.
  bool sits_out = false;
  bool host_done = false;
  Status host_status;
  std::atomic<uint64_t> round{0};  // atomic: Wait() reads it (for its message) without mu_
  using Part = PartStage;
  std::vector<Part> parts;  // emptied when the op ends (its tensor keeps the vector)
  uint32_t outstanding = 0;  // partitions not yet answered (pulled, or refused by the server)
  // WorkerOptions::max_bytes_ahead: the op's limit (the option times the servers its partitions
  // lie on), the bytes sent (or let back into the queue to be sent) and not yet answered (or,
  // where no data comes back, not yet sent: WorkerImpl::AheadUntilSent), and the partitions
  // held back meanwhile, in order (seq, partition).
  uint64_t max_ahead = 0;
  uint64_t bytes_ahead = 0;
  VectorFifo<std::pair<uint64_t, uint32_t>> held;
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
  Mutex mu;
  CondVar cv;
  bool done GUARDED_BY(mu) = false;
  Status status GUARDED_BY(mu);
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
    // Guarded by the group's `mu` (which the analysis cannot name from here): once the op is
    // done, its status and times, the result unpacked.
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
  Mutex mu;
  bool finished GUARDED_BY(mu) = false;
  Status status GUARDED_BY(mu);
  Clock::time_point t_finished GUARDED_BY(mu);
};

}  // namespace gradlink::internal
