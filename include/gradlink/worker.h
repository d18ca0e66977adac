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
// Threads: every method is thread-safe. Completion is signalled on the lanes' threads; Wait()
// may be called from any thread.
// Errors: failures are sticky per worker: a lost server, scheduler or worker, or a kAbort from the
// scheduler, fails every pending and later operation with that Status.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>

#include "gradlink/options.h"
#include "gradlink/status.h"
#include "gradlink/tensor.h"

namespace gradlink {

class Worker;
namespace internal {
struct Op;
struct TensorState;
}  // namespace internal

// A declared tensor. Cheap to copy; valid while its Worker lives.
class TensorHandle {
 public:
  TensorHandle() = default;
  uint64_t key() const;
  const std::string& name() const;
  DataType dtype() const;
  uint64_t count() const;
  bool valid() const { return state_ != nullptr; }

 private:
  friend class Worker;
  friend class WorkerImpl;
  explicit TensorHandle(std::shared_ptr<internal::TensorState> s) : state_(std::move(s)) {}
  std::shared_ptr<internal::TensorState> state_;
};

struct PushPullOptions {
  bool average = false;  // divide the sum by the number of workers
  int32_t priority = 0;  // higher goes first
};

// The pending result of one PushPull. Cheap to copy.
class PushPullHandle {
 public:
  PushPullHandle() = default;
  // OK once the sum is in the caller's buffer; the operation's error if it failed; kTimeout if it
  // is still running at the deadline (it goes on: the buffer must stay alive until a later
  // Wait() returns something other than kTimeout).
  Status Wait(Clock::time_point deadline = Clock::time_point::max()) const;
  // True once Wait() would return without blocking.
  bool Poll() const;

 private:
  friend class WorkerImpl;
  explicit PushPullHandle(std::shared_ptr<internal::Op> op) : op_(std::move(op)) {}
  std::shared_ptr<internal::Op> op_;
};

class Worker {
 public:
  // Joins the job; returns once the address book has arrived and the lanes are connected.
  static Result<std::unique_ptr<Worker>> Connect(const WorkerOptions& options);
  virtual ~Worker() = default;

  virtual uint32_t rank() const = 0;
  virtual uint32_t size() const = 0;  // number of workers
  virtual uint32_t num_servers() const = 0;

  // Declares a tensor (non-blocking). Declaring a name again returns the same handle if dtype and
  // count agree, kMismatch otherwise; kInvalidArgument for an empty name or too many elements.
  virtual Result<TensorHandle> Declare(std::string_view name, DataType dtype, uint64_t count) = 0;

  // Starts summing `data` (exactly count * dtype-size bytes) over all workers, in place. The
  // buffer must stay alive and untouched until the handle's Wait() has returned non-kTimeout.
  // Calls on one tensor run in call order.
  virtual PushPullHandle PushPull(const TensorHandle& tensor, std::span<std::byte> data,
                                  const PushPullOptions& options = {}) = 0;

  // Blocks until every worker has entered the barrier.
  virtual Status Barrier(Clock::time_point deadline) = 0;

  // Leaves the job cleanly; pending operations fail with kAborted. Idempotent.
  virtual Status Shutdown(Clock::time_point deadline) = 0;
};

}  // namespace gradlink
