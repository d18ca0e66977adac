// python/c10d/process_group.h, the Work of a process group's operation: completed by its
// completion thread (process_group.cc) or, for one built on another, by that one's future
// (collectives.cc).
#pragma once

#include <ATen/core/ivalue.h>

#include <atomic>
#include <exception>
#include <vector>

#include "process_group.h"

namespace gradlink::c10d {

class ProcessGroupGradlink::Work final : public ::c10d::Work {
 public:
  Work(int rank, ::c10d::OpType type, std::vector<at::Tensor> outputs)
      : ::c10d::Work(rank, type),
        outputs_(std::move(outputs)),
        future_(c10::make_intrusive<at::ivalue::Future>(
            c10::ListType::create(c10::TensorType::get()))) {}
  // One whose future's value is `value` rather than the outputs (allgather_coalesced's list of
  // output lists, as Gloo's).
  Work(int rank, ::c10d::OpType type, std::vector<at::Tensor> outputs, c10::IValue value)
      : ::c10d::Work(rank, type),
        outputs_(std::move(outputs)),
        value_(std::move(value)),
        future_(c10::make_intrusive<at::ivalue::Future>(value_.type())) {}

  std::vector<at::Tensor> result() override { return outputs_; }
  // A recv's sender (the group's rank); -1 before it completes, and for other operations.
  int sourceRank() const override { return source_.load(); }
  void SetSource(int rank) { source_.store(rank); }
  c10::intrusive_ptr<at::ivalue::Future> getFuture() override { return future_; }

  // The Work first (wait() returns), then the Future (its callbacks run here).
  void Complete(std::exception_ptr error) {
    Finish(error);
    CompleteFuture(error);
  }
  // The two halves, for a caller that may not run the Future's callbacks where it ends the
  // Work (point-to-point ends on a lane's thread: p2p.cc).
  void Finish(std::exception_ptr error) { finish(error); }
  void CompleteFuture(std::exception_ptr error) {
    if (error) {
      future_->setError(error);
    } else {
      future_->markCompleted(value_.isNone() ? c10::IValue(outputs_) : value_);
    }
  }

 private:
  std::vector<at::Tensor> outputs_;
  c10::IValue value_;  // None: the outputs
  c10::intrusive_ptr<at::ivalue::Future> future_;
  std::atomic<int> source_{-1};
};

}  // namespace gradlink::c10d
