// The worker side of gradlink, used inside the training process.
//
//   auto w = gradlink::Worker::Connect(options);           // joins the job
//   auto t = (*w)->Declare("fc1.weight.grad", DataType::kFloat32, n);
//   auto h = (*w)->PushPull(*t, std::as_writable_bytes(std::span(grad, n)), {.average = true});
//   Status s = h.Wait(deadline);                            // sum written into grad, in place
//
// A tensor's key is a stable hash of (job, name), never its declaration order. On first use the
// scheduler checks that every worker declared the name with the same dtype and element count
// (else kMismatch naming the key and the ranks) and plans its partitions over the servers,
// balanced by bytes. PushPull cuts the tensor into partitions, pushes each from the caller's
// buffer to its server (push lane) and receives the sum straight back into the buffer (pull
// lane). Bytes in flight are bounded; higher priority partitions are sent first.
//
// Tensor fusion: PushPullGroup sums many tensors as one operation. Small members of one dtype
// are packed into pooled fusion buffers (WorkerOptions::fusion_buffer_bytes) and pushed as one
// fused tensor each; large members go on their own, without a copy. Like Horovod's
// grouped_allreduce, every worker must group the same tensors the same way, in the same order.
//
// Threads: every method is thread-safe; Wait() and Poll() may be called from any thread. An
// operation through the servers completes on a lane's progress thread (the pull lane's when its
// last sum arrives, the push lane's when its last push leaves), or on the worker's control thread
// when the job fails. On the same-host path (WorkerOptions::local_arena_bytes, every worker on
// one host) it completes on the thread driving the shared segment: a caller in Wait() or Poll()
// (of any operation of this worker), a caller starting one (PushPull), or the worker's
// background thread for the path, which drives what no caller waits on.
// Errors: failures are sticky per worker: a lost server, scheduler or worker, or a kAbort from the
// scheduler, fails every pending and later operation with that Status.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "gradlink/collective.h"
#include "gradlink/export.h"
#include "gradlink/options.h"
#include "gradlink/status.h"
#include "gradlink/tensor.h"

namespace gradlink {

class Worker;
namespace internal {
struct Group;
struct Op;
struct TensorState;
}  // namespace internal

// A declared tensor. Cheap to copy; valid while its Worker lives.
class GRADLINK_EXPORT TensorHandle {
 public:
  TensorHandle() = default;
  uint64_t key() const;
  const std::string& name() const;  // as declared (the label; key() hashes VersionedName)
  DataType dtype() const;
  uint64_t count() const;
  // The dimensions given to Declare (their product is count()); empty when none were given.
  const std::vector<uint64_t>& shape() const;
  // What the key is for (the plain sum unless declared with a spec), and the elements of this
  // worker's input and output buffers for Run() (both count() for a sum).
  const CollectiveSpec& spec() const;
  uint64_t input_count() const;
  uint64_t output_count() const;
  bool valid() const { return state_ != nullptr; }
  // False once its name was declared again with another dtype, shape or collective, or its
  // plan was refused (kMismatch, ...): its operations then fail at once, naming why, and
  // Declare() gives the name's usable handle (Horovod's names are labels matched per call).
  bool current() const;

 private:
  friend class Worker;
  friend class WorkerImpl;
  explicit TensorHandle(std::shared_ptr<internal::TensorState> s) : state_(std::move(s)) {}
  std::shared_ptr<internal::TensorState> state_;
};

struct PushPullOptions {
  // Divide the sum by the number of workers. Integers: the exact sum divided, truncated toward
  // zero (int32 sums are exact in the server's int64 accumulator; int64 sums wrap, as NCCL's).
  bool average = false;
  int32_t priority = 0;  // higher goes first
};

// Where the time of one PushPull (or PushPullGroup) went, from the call to the result being in
// the caller's buffers. The stages follow each other on one timeline and add up to `total`;
// as partitions overlap, a stage ends when the last partition (of the last member) has passed
// it: e.g. `push` ends when every push has left.
struct PushPullTiming {
  Clock::duration pack{};    // groups: packing members into fusion buffers (and starting them)
  Clock::duration queue{};   // -> first partition handed to the transport (waiting for the
                             //    plan, the tensor's previous operation, or credit)
  Clock::duration push{};    // -> every push has left (send completion)
  Clock::duration reduce{};  // -> the last pull reply arrived: the servers' sums, and waiting
                             //    for the slowest worker's push
  Clock::duration pull{};    // -> every reply written into its buffer (fused: the fusion buffer)
  Clock::duration unpack{};  // groups: -> every member written (copies out of fusion buffers,
                             //    done by the thread in Wait()/Poll(), so its wake-up is in here)
  Clock::duration total{};
  // From the servers' own clocks: the most any partition's server took from the round's last
  // push landing to sending its sum (summing it, and waiting for an engine), to within 0.05%
  // (wire::EncodeServerTime). Not a stage: it overlaps `reduce` (the last partitions' wholly;
  // earlier ones' may start during `push`), whose rest is the slowest worker's pushes and the
  // network. 0 on the same-host path (no server).
  Clock::duration server{};
};

// What a worker has done so far (monotonic counters).
struct WorkerStats {
  uint64_t push_pulls = 0;     // operations completed OK (each member of a group counts)
  uint64_t bytes_reduced = 0;  // bytes of callers' tensors whose result was written back
  uint64_t groups = 0;         // PushPullGroup calls
  uint64_t fused_ops = 0;      // fused tensors pushed (one per fusion buffer filled)
  uint64_t bytes_packed = 0;   // copied into fusion buffers
  uint64_t bytes_unpacked = 0; // copied out of fusion buffers
  // Received payload bytes the transport copied before they reached their buffer (UCX: out of
  // its eager receive buffer; out of a lane-owned bounce buffer for rendezvous payloads, see
  // src/transport/transport.h). 0 for the inproc transport.
  uint64_t bytes_copied_eager = 0;
  uint64_t bytes_copied_bounce = 0;
  // Same-host path: bytes copied into the shared segment (the sums are written straight into
  // the caller's tensor); hierarchical aggregation: into it, and the sums out of it.
  uint64_t bytes_copied_local = 0;
  // Failover: replies copied from the worker's copy of each partition's last result into the
  // caller's tensor (docs/operations.md, "Server failover"); 0 with one server.
  uint64_t bytes_copied_results = 0;
  // Time this worker's threads spent copying and summing in the shared segment (the same-host
  // path, or this host's stage of hierarchical aggregation), in nanoseconds.
  uint64_t local_busy_ns = 0;
  uint64_t protocol_errors = 0;  // bad frames received by this worker's lanes
  // WorkerOptions::max_bytes_ahead at work: partitions that waited for their operation's sums,
  // and the most bytes one operation has had pushed (or queued to push) and not answered.
  uint64_t partitions_held = 0;
  uint64_t peak_bytes_ahead = 0;
  // Failover: servers the scheduler declared lost (their partitions moved), and the partitions
  // this worker reported to the servers that took them over.
  uint64_t servers_lost = 0;
  uint64_t partitions_recovered = 0;

  // The settings in force for this worker (also logged at info level once it has joined):
  // WorkerOptions' values as given, defaulted or chosen by gradlink for the job, whether the
  // same-host path is on, the host the worker counts as, and the UCX_* variables in force
  // ("NAME='value'", the user's and those gradlink sets when unset; the rest of UCX's
  // configuration is its defaults).
  struct InForce {
    // The most per partition: the scheduler cuts a key smaller where that spreads it over
    // more servers (partition_bytes chosen by gradlink).
    uint64_t partition_bytes = 0;
    uint64_t max_bytes_in_flight = 0;
    uint64_t max_bytes_ahead = 0;  // 0: no limit
    uint64_t fusion_buffer_bytes = 0;
    uint64_t fusion_threshold_bytes = 0;
    uint64_t local_arena_bytes = 0;  // the segment's size when same_host_path, else as asked
    bool same_host_path = false;
    // Hierarchical aggregation in force (this host's workers sum first): "" when off, else
    // e.g. "host 1 of 2, local rank 0 of 2, fp32 partials".
    std::string hierarchy;
    bool single_lane = false;
    std::string host;
    std::vector<std::string> ucx;
    // Memory beyond the host's that the transport could move itself (UCX's memory types:
    // "cuda", ...); empty with Debian's UCX. gradlink hands it host memory either way (device
    // tensors are staged through host buffers).
    std::vector<std::string> device_memory;
    // Which of partition_bytes, max_bytes_in_flight and max_bytes_ahead gradlink chose (they
    // were not set), and why; empty when all three were set.
    std::string chosen;
  } in_force;
};

// The pending result of one PushPull or PushPullGroup. Cheap to copy.
class GRADLINK_EXPORT PushPullHandle {
 public:
  PushPullHandle() = default;
  // OK once the sum is in the caller's buffer; the operation's error if it failed; kTimeout if it
  // is still running at the deadline (it goes on: the buffer must stay alive until a later
  // Wait() returns something other than kTimeout). For a group, OK once every member holds its
  // sum; the first failing member's error otherwise (every member's operation has ended then).
  Status Wait(Clock::time_point deadline) const;
  // Wait() with a deadline of the worker's WorkerOptions::operation_timeout (300 s by default)
  // from now: kTimeout then, as above, never a wait without end.
  Status Wait() const;
  // True once Wait() would return without blocking. For a group whose operations have all
  // ended, Poll() first copies the results out of the fusion buffers (as Wait() would).
  bool Poll() const;
  // Where the time went; meaningful once Wait() has returned OK or Poll() true (zeros before).
  PushPullTiming Timing() const;

 private:
  friend class WorkerImpl;
  explicit PushPullHandle(std::shared_ptr<internal::Op> op) : op_(std::move(op)) {}
  explicit PushPullHandle(std::shared_ptr<internal::Group> g) : group_(std::move(g)) {}
  std::shared_ptr<internal::Op> op_;
  std::shared_ptr<internal::Group> group_;
};

// ---- Point-to-point (worker/peer_link.h) ---------------------------------------------------
//
// A message from one worker to another, straight between them (never through a server), as
// torch.distributed's send / recv define it: a recv takes the oldest unmatched message of its
// (sender, channel, tag), or, from any sender, the one that arrived first; messages of one
// (sender, channel, tag) are received in the order they were sent. A message and the recv it
// meets must agree on size and element type, else both fail (kInvalidArgument) naming both.

// What a Send carries and a Recv expects, besides the bytes.
struct PeerMessage {
  uint64_t channel = 0;   // messages of different channels never meet (a process group's id)
  uint32_t tag = 0;
  uint16_t element = 0;   // the caller's element type: a recv refuses a message of another
};

// What completed: the status, and the sender of a Recv (its source rank).
struct PeerResult {
  Status status;
  uint32_t source = 0;
  // A failed Recv whose bytes the transport was still writing when the worker stopped its
  // lanes (a peer that hung mid-message): the transport may write them yet, so the caller must
  // keep that buffer allocated until the process exits.
  bool buffer_held = false;
};
// Called once per Send / Recv when it ends, on whichever gradlink thread ended it (a lane's
// progress thread, the control thread) or on the caller's, before Send / Recv returns, when it
// failed at once. Must not block, nor start another Send / Recv of this worker's.
using PeerCallback = std::function<void(const PeerResult&)>;

namespace internal {
struct PeerOp;
}

// The pending result of one Send or Recv. Cheap to copy.
class GRADLINK_EXPORT PeerHandle {
 public:
  PeerHandle() = default;
  // OK once a Send's bytes may be reused (its receiver has them, or is taking them) or a Recv's
  // bytes are in the buffer; the failure otherwise; kTimeout if it is still running at the
  // deadline (it goes on until its own deadline, the one given to Send / Recv).
  Status Wait(Clock::time_point deadline) const;
  bool Poll() const;
  // A Recv's sender, once it has completed OK.
  uint32_t source() const;

 private:
  friend class PeerLink;
  explicit PeerHandle(std::shared_ptr<internal::PeerOp> op) : op_(std::move(op)) {}
  std::shared_ptr<internal::PeerOp> op_;
};

class GRADLINK_EXPORT Worker {
 public:
  // Joins the job; returns once the address book has arrived and the lanes are connected.
  static Result<std::unique_ptr<Worker>> Connect(const WorkerOptions& options);
  virtual ~Worker() = default;

  virtual uint32_t rank() const = 0;
  virtual uint32_t size() const = 0;  // number of workers
  virtual uint32_t num_servers() const = 0;

  // Declares a tensor (non-blocking); kInvalidArgument for an empty name or too many elements.
  // A name is a label matched across workers per call, as Horovod's are. Declaring it again
  // returns the same handle if dtype, count, shape and collective agree and its plan was not
  // refused (so a key repeated every step is planned once and keeps what its servers hold);
  // otherwise the name gets a new key, planned afresh, and the earlier one is retired (the
  // servers free it once every worker has moved on). Declaring again while an operation of
  // the earlier declaration is in flight is kInvalidArgument.
  virtual Result<TensorHandle> Declare(std::string_view name, DataType dtype, uint64_t count) = 0;
  // The same with the tensor's shape (at most 64 dimensions; count is their product). Workers
  // that give a shape must all give the same one, else every worker gets kMismatch naming both
  // (a worker that gives none agrees with any).
  virtual Result<TensorHandle> Declare(std::string_view name, DataType dtype,
                                       std::span<const uint64_t> shape) = 0;

  // Declares a key for another collective than the sum (gradlink/collective.h): `count`
  // elements in all (the sum of the spec's counts where it has them). Every worker must give
  // the same spec, else every worker's operations on the key fail with kMismatch naming the
  // ranks; a spec that does not fit the job (counts, root) is kInvalidArgument, here or, for
  // what only the job knows, at the plan. Such keys go through the servers, never a host's
  // segment (which only sums). Declaring again: as above, the spec must agree too.
  virtual Result<TensorHandle> DeclareCollective(std::string_view name, DataType dtype,
                                                 uint64_t count, const CollectiveSpec& spec) = 0;

  // Runs the key's collective: this worker's `input` (input_count() elements) goes in, its
  // result lands in `output` (output_count() elements); both must stay alive and untouched
  // until Wait() has returned non-kTimeout. `input` may be `output` where the two have the same
  // size (allreduce and broadcast in place). A broadcast's non-roots' input is not read.
  // options.average only for a sum (kInvalidArgument otherwise). Keys declared with Declare()
  // run as PushPull (out of place: the input is copied into the output first).
  virtual PushPullHandle Run(const TensorHandle& tensor, std::span<const std::byte> input,
                             std::span<std::byte> output, const PushPullOptions& options = {}) = 0;

  // Starts summing `data` (exactly count * dtype-size bytes) over all workers, in place. The
  // buffer must stay alive and untouched until the handle's Wait() has returned non-kTimeout.
  // Calls on one tensor run in call order.
  virtual PushPullHandle PushPull(const TensorHandle& tensor, std::span<std::byte> data,
                                  const PushPullOptions& options = {}) = 0;

  // Sums every tensors[i] (in data[i], as for PushPull) over all workers, in place, as one
  // operation; the handle completes once every member holds its sum. Members smaller than
  // WorkerOptions::fusion_threshold_bytes are fused: those of one dtype are copied into fusion
  // buffers of up to fusion_buffer_bytes, in member order, and each buffer is pushed and pulled
  // as one tensor, then copied back (a buffer that would hold one member is not used: that
  // member goes on its own). The others go on their own, without a copy. The members are read
  // during this call for fused ones, later for the others, so all must stay untouched until
  // Wait() has returned non-kTimeout.
  //
  // A fused tensor is declared implicitly; its name (and so its key) is derived from its
  // members' names and counts, so EVERY WORKER MUST GROUP THE SAME TENSORS THE SAME WAY (same
  // members, same order, same fusion options), as in Horovod's grouped_allreduce. Workers that
  // group differently push different fused keys, which never meet: their Wait() returns
  // kTimeout at its deadline (never a wrong sum); a member declared with another shape
  // elsewhere fails the group with that member's kMismatch. A fused tensor's failure names it
  // and its members. kInvalidArgument for mismatched lengths, an undeclared tensor, a buffer of
  // the wrong size or a tensor given twice.
  virtual PushPullHandle PushPullGroup(std::span<const TensorHandle> tensors,
                                       std::span<const std::span<std::byte>> data,
                                       const PushPullOptions& options = {}) = 0;

  // Counters since Connect().
  virtual WorkerStats Stats() const = 0;

  // Blocks until every worker has entered the barrier.
  virtual Status Barrier(Clock::time_point deadline) = 0;
  // This rank has run out of data (Horovod's hvd.join()): waits for its own operations to end,
  // then sits out every later round of the others' sums until every rank has joined, and
  // returns the rank that joined last. Meanwhile the others' sums go on without it: it adds
  // nothing (as a tensor of zeros would, but for the sign of a zero sum), and an average
  // divides by the ranks that pushed; a key first declared meanwhile is planned without it;
  // a barrier counts it as arrived; other collectives that need it fail with
  // kInvalidArgument naming it. Afterwards every rank goes on in step, the joined ones included.
  // Where hosts sum first (hierarchical aggregation), this worker meanwhile still pushes its
  // share of its host's partial sums, which hold the others' tensors only, and a host sits
  // rounds out once all its workers have joined; a key first declared meanwhile is
  // aggregated flat. kTimeout at the deadline: the join stands (on a host path this worker goes
  // on pushing in the background), and the next Join() returns its release, or waits for it.
  virtual Result<uint32_t> Join(Clock::time_point deadline) = 0;

  // Leaves the job cleanly; pending operations fail with kAborted. Idempotent.
  virtual Status Shutdown(Clock::time_point deadline) = 0;

  // Sends `data` to worker `to` (point-to-point, above). `data` must stay valid and unchanged
  // until the handle completes. Fails at `deadline` (kTimeout) if no recv has taken it by then;
  // kPeerLost when `to` leaves or its connection fails; kInvalidArgument for a message larger
  // than 1 GiB, a rank out of range, or this worker itself.
  virtual PeerHandle Send(uint32_t to, const PeerMessage& message, std::span<const std::byte> data,
                          Clock::time_point deadline, PeerCallback done = {}) = 0;
  // Receives the next message of `message`'s channel and tag from `from` (any worker when
  // empty) into `data`, which must be exactly the message's size. `data` must stay valid
  // until the handle completes.
  virtual PeerHandle Recv(std::optional<uint32_t> from, const PeerMessage& message,
                          std::span<std::byte> data, Clock::time_point deadline,
                          PeerCallback done = {}) = 0;
};

}  // namespace gradlink
