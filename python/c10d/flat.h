// python/c10d/process_group.h: ProcessGroupGradlink::Flat, shared by collectives.cc (the
// all-gathers and reduce-scatters) and sparse.cc (the sparse all_reduce's gathers).
#pragma once

#include <string>
#include <vector>

#include "process_group.h"
#include "tensors.h"

namespace gradlink::c10d {

// One flat all-gather (every member's `in`, in rank order, into `out`) or reduce-scatter (`in`:
// a part per member; this rank's part of the reduction into `out`), checked and converted
// before anything starts: _allgather_base and _reduce_scatter_base, and each pair of their
// coalesced forms (torch 2.x), which check every pair before starting any.
struct ProcessGroupGradlink::Flat {
  Buffer in, out;
  OpOf op;             // a reduce-scatter's reduction
  bool gather = true;  // an all-gather (else a reduce-scatter)

  static Flat Allgather(const ProcessGroupGradlink& g, at::Tensor& output, at::Tensor& input,
                        const std::string& what) {
    CheckTensor(output, what);
    CheckTensor(input, what);
    if (output.scalar_type() != input.scalar_type()) Fail(what + ": output and input dtypes differ");
    if (output.numel() != input.numel() * g.getSize()) {
      Fail(what + ": an output of " + std::to_string(output.numel()) + " elements for " +
           std::to_string(g.getSize()) + " inputs of " + std::to_string(input.numel()));
    }
    Flat f;
    f.in = RouteBuffer(input);
    f.out = RouteBuffer(output);
    return f;
  }

  static Flat ReduceScatter(const ProcessGroupGradlink& g, at::Tensor& output, at::Tensor& input,
                            const ::c10d::ReduceOp& reduce, const std::string& what) {
    CheckTensor(output, what);
    CheckTensor(input, what);
    Flat f;
    f.gather = false;
    f.op = Reduction(reduce, what);
    if (output.scalar_type() != input.scalar_type()) Fail(what + ": output and input dtypes differ");
    if (input.numel() != output.numel() * g.getSize()) {
      Fail(what + ": an input of " + std::to_string(input.numel()) + " elements for " +
           std::to_string(g.getSize()) + " outputs of " + std::to_string(output.numel()));
    }
    f.in = ReduceBuffer(input, what);
    f.out = ReduceBuffer(output, what);
    return f;
  }

  bool empty() const { return gather ? in.count() == 0 : out.count() == 0; }

  // Its key, of `prefix` + its signature; Fail()s, naming what, where that is refused. Every
  // key of a call is declared before any of its operations starts.
  TensorHandle Declare(ProcessGroupGradlink& g, const std::string& prefix,
                       const std::string& what) const {
    std::vector<uint64_t> counts(g.getSize(), gather ? in.count() : out.count());
    const CollectiveSpec spec = gather ? g.Spec(Collective::kAllgather, ReduceOp::kSum, 0, counts)
                                       : g.Spec(Collective::kReduceScatter, op.op, 0, counts);
    const std::string sig =
        prefix + (gather ? "allgather_base." : "reduce_scatter_base." + std::string(op.name) + ".") +
        std::string(DataTypeName(in.dtype)) + "." + std::to_string(counts[0]);
    Result<TensorHandle> key = g.Key(what, sig, in.dtype, gather ? out.count() : in.count(), &spec);
    if (!key.ok()) Fail(key.status().ToString());
    return *key;
  }

  // Starts it on `p`, on `key` (Declare's); returns what it is, for errors.
  std::string Start(ProcessGroupGradlink& g, Pending& p, const TensorHandle& key,
                    const std::string& what) const {
    g.Start(p, key, in.flat, out.flat, !gather && op.average);
    return gather ? what + " of " + key.name()
                  : what + " (" + std::string(op.name) + ") of " + key.name();
  }
};

}  // namespace gradlink::c10d
