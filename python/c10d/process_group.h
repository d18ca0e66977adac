// The torch.distributed backend "gradlink": a c10d process group whose collectives run on a
// gradlink::Worker, through the servers' own operations (gradlink/collective.h).
//
//   torch 1.13 (Debian 12): a c10d::ProcessGroup;  torch 2.x: a c10d::Backend.
//   The collective signatures are the same; only the base class (and its registration, done in
//   python/gradlink/torch/_c10d.py) differs.
//
// One worker serves every gradlink process group of a process (the default group and each
// new_group), and gradlink.torch's own calls. A group's collectives are keys named after the
// group, the operation and its shapes; the k-th call with one signature takes slot k mod
// `slots`, so a training loop reuses a fixed set of keys (each planned once). Calls on one key
// run one after another, in call order, so up to `slots` calls of one signature run at once;
// each slot costs the servers that key's memory, and its first use a plan. torch.distributed
// requires every member to issue a group's collectives in one order, which makes these names
// agree across ranks.
//
// Threads: the collectives start on the caller's thread; one completion thread per group waits
// for them in issue order, copies results out where a staging buffer was needed, then
// completes the Work and its Future (whose callbacks, DDP's, run there). Nothing the
// communication needs waits on that thread.
#pragma once

#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/Types.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>
#include <torch/version.h>
#if TORCH_VERSION_MAJOR >= 2
#include <torch/csrc/distributed/c10d/Backend.hpp>
#endif

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "gradlink/status.h"
#include "gradlink/worker.h"

namespace gradlink::c10d {

#if TORCH_VERSION_MAJOR >= 2
using ProcessGroupBase = ::c10d::Backend;
#else
using ProcessGroupBase = ::c10d::ProcessGroup;
#endif

class ProcessGroupGradlink final : public ProcessGroupBase {
 public:
  // `members`: the group's global ranks, ascending (empty: every worker of the job); `rank`
  // and `size` are the caller's place in the group and its size. `uid` names the group
  // identically on every member. `timeout`: every operation's deadline. `slots` (>= 1): keys
  // per signature (above).
  ProcessGroupGradlink(std::shared_ptr<Worker> worker, int rank, int size,
                       std::vector<uint32_t> members, std::string uid,
                       std::chrono::milliseconds timeout, uint64_t slots = 1);
  ~ProcessGroupGradlink() override;

  const std::string getBackendName() const override { return "gradlink"; }

  c10::intrusive_ptr<::c10d::Work> broadcast(std::vector<at::Tensor>& tensors,
                                             const ::c10d::BroadcastOptions& opts) override;
  c10::intrusive_ptr<::c10d::Work> allreduce(std::vector<at::Tensor>& tensors,
                                             const ::c10d::AllreduceOptions& opts) override;
  c10::intrusive_ptr<::c10d::Work> allreduce_coalesced(
      std::vector<at::Tensor>& tensors, const ::c10d::AllreduceCoalescedOptions& opts) override;
  c10::intrusive_ptr<::c10d::Work> reduce(std::vector<at::Tensor>& tensors,
                                          const ::c10d::ReduceOptions& opts) override;
  c10::intrusive_ptr<::c10d::Work> allgather(std::vector<std::vector<at::Tensor>>& outputs,
                                             std::vector<at::Tensor>& inputs,
                                             const ::c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<::c10d::Work> _allgather_base(at::Tensor& output, at::Tensor& input,
                                                   const ::c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<::c10d::Work> gather(std::vector<std::vector<at::Tensor>>& outputs,
                                          std::vector<at::Tensor>& inputs,
                                          const ::c10d::GatherOptions& opts) override;
  c10::intrusive_ptr<::c10d::Work> scatter(std::vector<at::Tensor>& outputs,
                                           std::vector<std::vector<at::Tensor>>& inputs,
                                           const ::c10d::ScatterOptions& opts) override;
  c10::intrusive_ptr<::c10d::Work> reduce_scatter(std::vector<at::Tensor>& outputs,
                                                  std::vector<std::vector<at::Tensor>>& inputs,
                                                  const ::c10d::ReduceScatterOptions& opts) override;
  c10::intrusive_ptr<::c10d::Work> _reduce_scatter_base(
      at::Tensor& output, at::Tensor& input, const ::c10d::ReduceScatterOptions& opts) override;
  c10::intrusive_ptr<::c10d::Work> alltoall_base(at::Tensor& output, at::Tensor& input,
                                                 std::vector<int64_t>& output_split_sizes,
                                                 std::vector<int64_t>& input_split_sizes,
                                                 const ::c10d::AllToAllOptions& opts) override;
  c10::intrusive_ptr<::c10d::Work> alltoall(std::vector<at::Tensor>& outputs,
                                            std::vector<at::Tensor>& inputs,
                                            const ::c10d::AllToAllOptions& opts) override;
  c10::intrusive_ptr<::c10d::Work> barrier(const ::c10d::BarrierOptions& opts) override;

  // Point-to-point (p2p.cc): worker to worker, never through a server (Worker::Send / Recv).
  // Each completes on the group's point-to-point thread as soon as it ends, in no order with
  // the others (a recv waiting for its peer holds up nothing else).
  c10::intrusive_ptr<::c10d::Work> send(std::vector<at::Tensor>& tensors, int dst_rank,
                                        int tag) override;
  c10::intrusive_ptr<::c10d::Work> recv(std::vector<at::Tensor>& tensors, int src_rank,
                                        int tag) override;
  c10::intrusive_ptr<::c10d::Work> recvAnysource(std::vector<at::Tensor>& tensors,
                                                 int tag) override;
#if TORCH_VERSION_MAJOR >= 2
  // torch 2.x only: several all_gather_into_tensor / reduce_scatter_tensor calls as one Work
  // (dist._coalescing_manager's fast path; functional collectives, hence DTensor, issue even a
  // single one this way). Each pair runs as _allgather_base / _reduce_scatter_base would, on a
  // key of its position in the call, all at once.
  c10::intrusive_ptr<::c10d::Work> allgather_into_tensor_coalesced(
      std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
      const ::c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<::c10d::Work> reduce_scatter_tensor_coalesced(
      std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
      const ::c10d::ReduceScatterOptions& opts) override;
#endif

 private:
  class Work;
  struct Flat;  // one flat all-gather or reduce-scatter, checked, before it starts
  // What one operation waits for, then does once its handles have completed (copies out of
  // staging buffers), on the completion thread.
  struct Pending {
    c10::intrusive_ptr<Work> work;
    std::vector<PushPullHandle> handles;
    std::function<Status(Clock::time_point)> blocking;  // barrier: runs instead of handles
    std::function<void()> finish;
    std::vector<at::Tensor> keepalive;  // every buffer the handles write or read
    Clock::time_point deadline;
    std::string what;
  };

  // The key for a call of `signature` (its slot taken in issue order), declared once.
  Result<TensorHandle> Key(const std::string& what, const std::string& signature,
                           DataType dtype, uint64_t count, const CollectiveSpec* spec);
  CollectiveSpec Spec(Collective kind, ReduceOp op = ReduceOp::kSum, uint32_t root = 0,
                      std::vector<uint64_t> counts = {}) const;
  Clock::time_point Deadline(std::chrono::milliseconds op_timeout) const;
  c10::intrusive_ptr<::c10d::Work> Enqueue(::c10d::OpType type, Pending p,
                                           std::vector<at::Tensor> outputs);
  c10::intrusive_ptr<::c10d::Work> Done(::c10d::OpType type, std::vector<at::Tensor> outputs);
  // Runs a collective key from `input` into `output` (gradlink dtype `dtype`), adding its handle.
  void Start(Pending& p, const TensorHandle& key, const at::Tensor& input,
             const at::Tensor& output, bool average);
  // Every member's `mine` (the same length on each), in rank order: an allgather on a key of
  // its own, waited for here (alltoall's split sizes).
  std::vector<uint64_t> SplitMatrix(const std::vector<uint64_t>& mine, Clock::time_point deadline);
  void CompletionLoop();
  // Several flat gathers or reduce-scatters as one Work of `type` on `outputs`: every non-empty
  // one on a key named `prefix` + its position, all declared before any starts, then started
  // at once on one Pending; `then` runs once they have ended and their staging copies are
  // written back (at once, here, where every one is empty). The torch 2.x coalesced forms,
  // allgather_coalesced and a sparse allreduce's gathers.
  c10::intrusive_ptr<::c10d::Work> Coalesced(::c10d::OpType type, std::vector<at::Tensor> outputs,
                                             const std::vector<Flat>& flats,
                                             const std::string& what, const std::string& prefix,
                                             std::chrono::milliseconds op_timeout,
                                             std::function<void()> then = nullptr);

  // Point-to-point: a Send / Recv ended; its Work completes there, its Future on the group's
  // p2p thread.
  struct PeerDone;
  class PeerQueue;
  c10::intrusive_ptr<::c10d::Work> PointToPoint(::c10d::OpType type, at::Tensor& tensor,
                                                std::optional<int> peer, int tag);
  void StartPeerThread();
  // A Send / Recv ended with `r`: the Work completes (the Future follows on the p2p thread).
  static void PeerEnded(PeerDone& d, const PeerResult& r, const std::vector<uint32_t>& members);
  void StopPeerQueue();
  // The worker's rank of the group's rank `r`.
  uint32_t Global(int r) const;

  std::shared_ptr<Worker> worker_;
  const std::vector<uint32_t> members_;
  const std::string uid_;
  const std::chrono::milliseconds timeout_;
  const uint64_t slots_;
  const uint64_t channel_;  // the group's point-to-point channel (a hash of uid_)
  std::atomic<uint64_t> operations_{0};  // calls started: later ones get higher priority

  mutable std::mutex mu_;  // guards what follows
  std::map<std::string, uint64_t> calls_;         // signature -> calls so far
  std::map<std::string, TensorHandle> keys_;      // name -> declared key
  std::deque<Pending> queue_;
  std::vector<Pending> abandoned_;  // timed out: their buffers stay alive until shutdown
  struct SplitBuffers {
    std::vector<uint64_t> mine, all;
  };
  std::vector<std::shared_ptr<SplitBuffers>> abandoned_splits_;  // likewise
  bool stopping_ = false;
  std::condition_variable cv_;
  std::thread completion_;
  // Shared with the Send / Recv callbacks, which may come after the group is gone.
  std::shared_ptr<PeerQueue> peer_queue_;
  std::thread peer_completion_;

  // --- all_gather_coalesced and sparse all_reduce (collectives.cc) ----------------------------
 public:
  // dist.all_gather_coalesced: outputs[r][i] gets rank r's inputs[i] (the same dtype and shape
  // on every rank), each input gathered on a key of its position, one Work. Its future's value
  // is the list of output lists (one list where the group has one rank), as Gloo's.
  c10::intrusive_ptr<::c10d::Work> allgather_coalesced(
      std::vector<std::vector<at::Tensor>>& outputs, std::vector<at::Tensor>& inputs,
      const ::c10d::AllgatherOptions& opts) override;

 private:
  // allreduce() of one sparse COO tensor, as Gloo's: SUM only; every rank's coalesced indices
  // and values gathered, summed here, the coalesced sum written into the tensor.
  c10::intrusive_ptr<::c10d::Work> SparseAllreduce(std::vector<at::Tensor>& tensors,
                                                   const ::c10d::AllreduceOptions& opts);
  // Every member's `mine` (the same length on each), in rank order: an allgather on a key of
  // `name` and that length, waited for here (alltoall's split sizes, a sparse tensor's shape).
  // `what` says what failed.
  std::vector<uint64_t> GatherCounts(const std::vector<uint64_t>& mine, const std::string& name,
                                     const std::string& what, Clock::time_point deadline);
};

}  // namespace gradlink::c10d
