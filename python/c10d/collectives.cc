// python/c10d/process_group.h: the collectives, each checked and converted (tensors.h), then
// started on the worker (Key, Start) and handed to the completion thread (Enqueue).
#include "process_group.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <c10/util/accumulate.h>

#include <algorithm>
#include <bit>
#include <cstring>
#include <limits>
#include <numeric>
#include <span>
#include <utility>

#include "flat.h"
#include "tensors.h"
#include "work.h"

namespace gradlink::c10d {

using ::c10d::OpType;

// --- the collectives --------------------------------------------------------------------------

c10::intrusive_ptr<::c10d::Work> ProcessGroupGradlink::allreduce(
    std::vector<at::Tensor>& tensors, const ::c10d::AllreduceOptions& opts) {
  if (tensors.size() == 1 && tensors[0].defined() && tensors[0].layout() == at::kSparse) {
    return SparseAllreduce(tensors, opts);
  }
  const at::Tensor& t = One(tensors, "allreduce");
  const OpOf op = Reduction(opts.reduceOp, "allreduce");
  Buffer b = ReduceBuffer(t, "allreduce");
  if (b.count() == 0) return Done(OpType::ALLREDUCE, tensors);
  const CollectiveSpec spec = Spec(Collective::kAllreduce, op.op);
  const std::string sig = std::string("allreduce.") + (op.op == ReduceOp::kSum ? "sum" : op.name) +
                          "." + std::string(DataTypeName(b.dtype)) + "." +
                          std::to_string(b.count());
  Result<TensorHandle> key = Key("allreduce", sig, b.dtype, b.count(), &spec);
  if (!key.ok()) Fail(key.status().ToString());
  Pending p;
  p.what = "allreduce (" + std::string(op.name) + ") of " + key->name();
  p.deadline = Deadline(opts.timeout);
  Start(p, *key, b.flat, b.flat, op.average);
  if (b.back.defined()) p.finish = [b] { b.WriteBack(); };
  return Enqueue(OpType::ALLREDUCE, std::move(p), tensors);
}

c10::intrusive_ptr<::c10d::Work> ProcessGroupGradlink::allreduce_coalesced(
    std::vector<at::Tensor>& tensors, const ::c10d::AllreduceCoalescedOptions& opts) {
  const OpOf op = Reduction(opts.reduceOp, "allreduce_coalesced");
  Pending p;
  p.what = "allreduce_coalesced (" + std::string(op.name) + ") of " +
           std::to_string(tensors.size()) + " tensors";
  p.deadline = Deadline(opts.timeout);
  // Every tensor checked and every key declared before any starts: a bad tensor among them
  // fails the call with nothing in flight (no sum left writing into the tensors before it).
  std::vector<Buffer> buffers;
  std::vector<TensorHandle> keys;
  for (size_t i = 0; i < tensors.size(); ++i) {
    CheckTensor(tensors[i], "allreduce_coalesced");
    buffers.push_back(ReduceBuffer(tensors[i], "allreduce_coalesced"));
  }
  for (size_t i = 0; i < buffers.size(); ++i) {
    const Buffer& b = buffers[i];
    if (b.count() == 0) continue;
    const CollectiveSpec spec = Spec(Collective::kAllreduce, op.op);
    const std::string sig = std::string("coalesced.") + std::to_string(i) + "." +
                            (op.op == ReduceOp::kSum ? "sum" : op.name) + "." +
                            std::string(DataTypeName(b.dtype)) + "." + std::to_string(b.count());
    Result<TensorHandle> key = Key("allreduce_coalesced", sig, b.dtype, b.count(), &spec);
    if (!key.ok()) Fail(key.status().ToString());
    keys.push_back(*key);
  }
  std::vector<Buffer> backs;
  size_t k = 0;
  for (const Buffer& b : buffers) {
    if (b.count() == 0) continue;
    Start(p, keys[k++], b.flat, b.flat, op.average);
    if (b.back.defined()) backs.push_back(b);
  }
  if (!backs.empty()) p.finish = [backs] { for (const Buffer& b : backs) b.WriteBack(); };
  return Enqueue(OpType::ALLREDUCE_COALESCED, std::move(p), tensors);
}

c10::intrusive_ptr<::c10d::Work> ProcessGroupGradlink::broadcast(
    std::vector<at::Tensor>& tensors, const ::c10d::BroadcastOptions& opts) {
  const at::Tensor& t = One(tensors, "broadcast");
  if (opts.rootRank < 0 || opts.rootRank >= getSize()) {
    Fail("broadcast: root " + std::to_string(opts.rootRank) + " is not a rank of the group of " +
         std::to_string(getSize()));
  }
  Buffer b = RouteBuffer(t);
  if (b.count() == 0) return Done(OpType::BROADCAST, tensors);
  const CollectiveSpec spec =
      Spec(Collective::kBroadcast, ReduceOp::kSum, static_cast<uint32_t>(opts.rootRank));
  const std::string sig = "broadcast." + std::to_string(opts.rootRank) + "." +
                          std::string(DataTypeName(b.dtype)) + "." + std::to_string(b.count());
  Result<TensorHandle> key = Key("broadcast", sig, b.dtype, b.count(), &spec);
  if (!key.ok()) Fail(key.status().ToString());
  Pending p;
  p.what = "broadcast from " + std::to_string(opts.rootRank) + " of " + key->name();
  p.deadline = Deadline(opts.timeout);
  Start(p, *key, b.flat, b.flat, false);
  if (b.back.defined() && opts.rootRank != getRank()) p.finish = [b] { b.WriteBack(); };
  return Enqueue(OpType::BROADCAST, std::move(p), tensors);
}

c10::intrusive_ptr<::c10d::Work> ProcessGroupGradlink::_allgather_base(
    at::Tensor& output, at::Tensor& input, const ::c10d::AllgatherOptions& opts) {
  const Flat f = Flat::Allgather(*this, output, input, "_allgather_base");
  if (f.empty()) return Done(OpType::_ALLGATHER_BASE, {output});
  Pending p;
  p.deadline = Deadline(opts.timeout);
  p.what = f.Start(*this, p, f.Declare(*this, "", "_allgather_base"), "_allgather_base");
  if (f.out.back.defined()) p.finish = [out = f.out] { out.WriteBack(); };
  return Enqueue(OpType::_ALLGATHER_BASE, std::move(p), {output});
}

c10::intrusive_ptr<::c10d::Work> ProcessGroupGradlink::allgather(
    std::vector<std::vector<at::Tensor>>& outputs, std::vector<at::Tensor>& inputs,
    const ::c10d::AllgatherOptions& opts) {
  const at::Tensor& input = One(inputs, "allgather");
  if (outputs.size() != 1 || outputs[0].size() != static_cast<size_t>(getSize())) {
    Fail("allgather: one output list of " + std::to_string(getSize()) + " tensors");
  }
  std::vector<at::Tensor>& outs = outputs[0];
  std::vector<uint64_t> counts;
  const uint64_t scale = RouteScale(input);
  for (const at::Tensor& o : outs) {
    CheckTensor(o, "allgather");
    if (o.scalar_type() != input.scalar_type()) Fail("allgather: output and input dtypes differ");
    counts.push_back(static_cast<uint64_t>(o.numel()) * scale);
  }
  if (outs[getRank()].numel() != input.numel()) {
    Fail("allgather: this rank's output tensor has " + std::to_string(outs[getRank()].numel()) +
         " elements, its input " + std::to_string(input.numel()));
  }
  Buffer in = RouteBuffer(input);
  const uint64_t total = std::accumulate(counts.begin(), counts.end(), uint64_t{0});
  if (total == 0) return Done(OpType::ALLGATHER, outs);
  at::Tensor flat = at::empty({static_cast<int64_t>(total)}, in.flat.options());
  const CollectiveSpec spec = Spec(Collective::kAllgather, ReduceOp::kSum, 0, counts);
  const std::string sig = "allgather." + std::string(DataTypeName(in.dtype)) + "." + Join(counts);
  Result<TensorHandle> key = Key("allgather", sig, in.dtype, total, &spec);
  if (!key.ok()) Fail(key.status().ToString());
  Pending p;
  p.what = "allgather of " + key->name();
  p.deadline = Deadline(opts.timeout);
  Start(p, *key, in.flat, flat, false);
  const bool widened = in.widened;
  p.finish = [flat, outs, counts, widened] {
    int64_t at = 0;
    for (size_t r = 0; r < outs.size(); ++r) {
      const int64_t n = static_cast<int64_t>(counts[r]);
      at::Tensor part = Buffer::Restore(flat.narrow(0, at, n), outs[r].scalar_type(), true, widened);
      outs[r].copy_(part.view(outs[r].sizes()));
      at += n;
    }
  };
  return Enqueue(OpType::ALLGATHER, std::move(p), outs);
}

// Each input as _allgather_base would gather it, into a staging tensor of every rank's, on a
// key of its position; the parts are copied into the output lists once all have arrived.
c10::intrusive_ptr<::c10d::Work> ProcessGroupGradlink::allgather_coalesced(
    std::vector<std::vector<at::Tensor>>& outputs, std::vector<at::Tensor>& inputs,
    const ::c10d::AllgatherOptions& opts) {
  const std::string what = "allgather_coalesced";
  const size_t n = static_cast<size_t>(getSize());
  if (outputs.size() != n) {
    Fail(what + ": one output list per rank, " + std::to_string(n) + " (got " +
         std::to_string(outputs.size()) + ")");
  }
  for (size_t r = 0; r < n; ++r) {
    if (outputs[r].size() != inputs.size()) {
      Fail(what + ": rank " + std::to_string(r) + "'s output list has " +
           std::to_string(outputs[r].size()) + " tensors for " + std::to_string(inputs.size()) +
           " inputs");
    }
  }
  std::vector<at::Tensor> staging, flat_outputs;
  std::vector<Flat> flats;
  for (size_t i = 0; i < inputs.size(); ++i) {
    CheckTensor(inputs[i], what);
    for (size_t r = 0; r < n; ++r) {
      const at::Tensor& o = outputs[r][i];
      CheckTensor(o, what);
      if (o.scalar_type() != inputs[i].scalar_type() || o.sizes() != inputs[i].sizes()) {
        Fail(what + ": output " + std::to_string(i) + " of rank " + std::to_string(r) +
             "'s list differs from input " + std::to_string(i) + " in dtype or shape");
      }
    }
    at::Tensor all = at::empty({inputs[i].numel() * static_cast<int64_t>(n)}, inputs[i].options());
    flats.push_back(Flat::Allgather(*this, all, inputs[i], what));
    staging.push_back(all);
  }
  for (const std::vector<at::Tensor>& list : outputs) {
    flat_outputs.insert(flat_outputs.end(), list.begin(), list.end());
  }
  auto copy_out = [staging, outputs] {
    for (size_t i = 0; i < staging.size(); ++i) {
      for (size_t r = 0; r < outputs.size(); ++r) {
        const at::Tensor& o = outputs[r][i];
        const int64_t c = o.numel();
        o.copy_(staging[i].narrow(0, static_cast<int64_t>(r) * c, c).view(o.sizes()));
      }
    }
  };
  c10::intrusive_ptr<::c10d::Work> inner =
      Coalesced(OpType::ALLGATHER_COALESCED, flat_outputs, flats, what, "allgather_coalesced.",
                opts.timeout, copy_out);
  // The future's value is Gloo's, a list per rank: a Work of its own, completed with that one.
  auto w = c10::make_intrusive<Work>(getRank(), OpType::ALLGATHER_COALESCED, flat_outputs,
                                     n > 1 ? c10::IValue(outputs) : c10::IValue(outputs[0]));
  inner->getFuture()->addCallback([w](at::ivalue::Future& f) {
    w->Complete(f.hasError() ? f.exception_ptr() : nullptr);
  });
  return w;
}

c10::intrusive_ptr<::c10d::Work> ProcessGroupGradlink::_reduce_scatter_base(
    at::Tensor& output, at::Tensor& input, const ::c10d::ReduceScatterOptions& opts) {
  const Flat f = Flat::ReduceScatter(*this, output, input, opts.reduceOp, "_reduce_scatter_base");
  if (f.empty()) return Done(OpType::_REDUCE_SCATTER_BASE, {output});
  Pending p;
  p.deadline = Deadline(opts.timeout);
  p.what = f.Start(*this, p, f.Declare(*this, "", "_reduce_scatter_base"),
                   "_reduce_scatter_base");
  if (f.out.back.defined()) p.finish = [out = f.out] { out.WriteBack(); };
  return Enqueue(OpType::_REDUCE_SCATTER_BASE, std::move(p), {output});
}

c10::intrusive_ptr<::c10d::Work> ProcessGroupGradlink::Coalesced(
    OpType type, std::vector<at::Tensor> outputs, const std::vector<Flat>& flats,
    const std::string& what, const std::string& prefix, std::chrono::milliseconds op_timeout,
    std::function<void()> then) {
  Pending p;
  p.deadline = Deadline(op_timeout);
  p.what = what + " of " + std::to_string(flats.size()) + " tensors";
  // Every key first: a pair whose key is refused fails the call with nothing started.
  std::vector<TensorHandle> keys(flats.size());
  for (size_t i = 0; i < flats.size(); ++i) {
    if (flats[i].empty()) continue;
    keys[i] = flats[i].Declare(*this, prefix + std::to_string(i) + ".", what);
  }
  std::vector<Buffer> backs;
  try {
    for (size_t i = 0; i < flats.size(); ++i) {
      if (flats[i].empty()) continue;
      const std::string one = flats[i].Start(*this, p, keys[i], what);
      if (p.handles.size() == 1) p.what += " (the first: " + one + ")";
      if (flats[i].out.back.defined()) backs.push_back(flats[i].out);
    }
  } catch (...) {  // (out of memory: nothing else throws once the keys are declared)
    // Those started may still read and write their buffers: keep them alive until shutdown.
    if (!p.handles.empty()) {
      std::lock_guard lock(mu_);
      abandoned_.push_back(std::move(p));
    }
    throw;
  }
  if (p.handles.empty()) {
    if (then) then();
    return Done(type, std::move(outputs));
  }
  if (!backs.empty() || then) {
    p.finish = [backs, then] {
      for (const Buffer& b : backs) b.WriteBack();
      if (then) then();
    };
  }
  return Enqueue(type, std::move(p), std::move(outputs));
}

#if TORCH_VERSION_MAJOR >= 2
// `make`(outputs[i], inputs[i]) for each pair, once their counts agree: every pair checked
// before any starts.
template <typename Make>
auto EachPair(std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
              const std::string& what, Make make) {
  if (outputs.size() != inputs.size()) {
    Fail(what + ": " + std::to_string(outputs.size()) + " outputs for " +
         std::to_string(inputs.size()) + " inputs");
  }
  std::vector<decltype(make(outputs[0], inputs[0]))> each;
  for (size_t i = 0; i < inputs.size(); ++i) each.push_back(make(outputs[i], inputs[i]));
  return each;
}

c10::intrusive_ptr<::c10d::Work> ProcessGroupGradlink::allgather_into_tensor_coalesced(
    std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
    const ::c10d::AllgatherOptions& opts) {
  const std::string what = "allgather_into_tensor_coalesced";
  return Coalesced(OpType::COALESCED, outputs,
                   EachPair(outputs, inputs, what, [&](at::Tensor& out, at::Tensor& in) {
                     return Flat::Allgather(*this, out, in, what);
                   }),
                   what, "coalesced.", opts.timeout);
}

c10::intrusive_ptr<::c10d::Work> ProcessGroupGradlink::reduce_scatter_tensor_coalesced(
    std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
    const ::c10d::ReduceScatterOptions& opts) {
  const std::string what = "reduce_scatter_tensor_coalesced";
  return Coalesced(OpType::COALESCED, outputs,
                   EachPair(outputs, inputs, what, [&](at::Tensor& out, at::Tensor& in) {
                     return Flat::ReduceScatter(*this, out, in, opts.reduceOp, what);
                   }),
                   what, "coalesced.", opts.timeout);
}
#endif

c10::intrusive_ptr<::c10d::Work> ProcessGroupGradlink::reduce_scatter(
    std::vector<at::Tensor>& outputs, std::vector<std::vector<at::Tensor>>& inputs,
    const ::c10d::ReduceScatterOptions& opts) {
  const at::Tensor& output = One(outputs, "reduce_scatter");
  const OpOf op = Reduction(opts.reduceOp, "reduce_scatter");
  if (inputs.size() != 1 || inputs[0].size() != static_cast<size_t>(getSize())) {
    Fail("reduce_scatter: one input list of " + std::to_string(getSize()) + " tensors");
  }
  std::vector<uint64_t> counts;
  std::vector<at::Tensor> parts;
  for (const at::Tensor& i : inputs[0]) {
    CheckTensor(i, "reduce_scatter");
    if (i.scalar_type() != output.scalar_type()) Fail("reduce_scatter: output and input dtypes differ");
    counts.push_back(static_cast<uint64_t>(i.numel()));
    parts.push_back(i.reshape(-1));
  }
  if (inputs[0][getRank()].numel() != output.numel()) {
    Fail("reduce_scatter: this rank's input has " + std::to_string(inputs[0][getRank()].numel()) +
         " elements for its part, its output " + std::to_string(output.numel()));
  }
  const uint64_t total = std::accumulate(counts.begin(), counts.end(), uint64_t{0});
  if (total == 0) return Done(OpType::REDUCE_SCATTER, outputs);
  Buffer in = ReduceBuffer(at::cat(parts), "reduce_scatter");
  Buffer out = ReduceBuffer(output, "reduce_scatter");
  const CollectiveSpec spec = Spec(Collective::kReduceScatter, op.op, 0, counts);
  const std::string sig = "reduce_scatter." + std::string(op.name) + "." +
                          std::string(DataTypeName(in.dtype)) + "." + Join(counts);
  Result<TensorHandle> key = Key("reduce_scatter", sig, in.dtype, total, &spec);
  if (!key.ok()) Fail(key.status().ToString());
  Pending p;
  p.what = "reduce_scatter (" + std::string(op.name) + ") of " + key->name();
  p.deadline = Deadline(opts.timeout);
  Start(p, *key, in.flat, out.flat, op.average);
  if (out.back.defined()) p.finish = [out] { out.WriteBack(); };
  return Enqueue(OpType::REDUCE_SCATTER, std::move(p), outputs);
}

// A reduce is a reduce-scatter whose only part is the root's: the others push and receive
// nothing back (their tensors are left as they were).
c10::intrusive_ptr<::c10d::Work> ProcessGroupGradlink::reduce(
    std::vector<at::Tensor>& tensors, const ::c10d::ReduceOptions& opts) {
  const at::Tensor& t = One(tensors, "reduce");
  const OpOf op = Reduction(opts.reduceOp, "reduce");
  if (opts.rootRank < 0 || opts.rootRank >= getSize()) {
    Fail("reduce: root " + std::to_string(opts.rootRank) + " is not a rank of the group of " +
         std::to_string(getSize()));
  }
  Buffer b = ReduceBuffer(t, "reduce");
  if (b.count() == 0) return Done(OpType::REDUCE, tensors);
  std::vector<uint64_t> counts(getSize(), 0);
  counts[opts.rootRank] = b.count();
  const CollectiveSpec spec = Spec(Collective::kReduceScatter, op.op, 0, counts);
  const std::string sig = "reduce." + std::to_string(opts.rootRank) + "." + op.name + "." +
                          std::string(DataTypeName(b.dtype)) + "." + std::to_string(b.count());
  Result<TensorHandle> key = Key("reduce", sig, b.dtype, b.count(), &spec);
  if (!key.ok()) Fail(key.status().ToString());
  Pending p;
  p.what = "reduce (" + std::string(op.name) + ") to " + std::to_string(opts.rootRank) + " of " +
           key->name();
  p.deadline = Deadline(opts.timeout);
  const bool root = opts.rootRank == getRank();
  Start(p, *key, b.flat, root ? b.flat : b.flat.narrow(0, 0, 0), op.average);
  if (root && b.back.defined()) p.finish = [b] { b.WriteBack(); };
  return Enqueue(OpType::REDUCE, std::move(p), tensors);
}

std::vector<uint64_t> ProcessGroupGradlink::GatherCounts(const std::vector<uint64_t>& mine,
                                                          const std::string& name,
                                                          const std::string& what,
                                                          Clock::time_point deadline) {
  const uint64_t n = static_cast<uint64_t>(getSize());
  const uint64_t each = mine.size();
  std::vector<uint64_t> counts(n, each);
  const CollectiveSpec spec = Spec(Collective::kAllgather, ReduceOp::kSum, 0, counts);
  Result<TensorHandle> key = Key(what, name + "." + std::to_string(each), DataType::kInt64,
                                 n * each, &spec);
  if (!key.ok()) Fail(key.status().ToString());
  auto buffers = std::make_shared<SplitBuffers>(SplitBuffers{mine, std::vector<uint64_t>(n * each)});
  PushPullHandle h = worker_->Run(*key, std::as_bytes(std::span(buffers->mine)),
                                  std::as_writable_bytes(std::span(buffers->all)));
  if (Status s = h.Wait(deadline); !s.ok()) {
    if (s.code() == Code::kTimeout) {
      std::lock_guard lock(mu_);  // the worker may still read and write them
      abandoned_splits_.push_back(buffers);
    }
    Fail(what + ": " + s.ToString());
  }
  return std::move(buffers->all);
}

std::vector<uint64_t> ProcessGroupGradlink::SplitMatrix(const std::vector<uint64_t>& mine,
                                                        Clock::time_point deadline) {
  return GatherCounts(mine, "splits", "alltoall: exchanging the split sizes", deadline);
}

c10::intrusive_ptr<::c10d::Work> ProcessGroupGradlink::alltoall_base(
    at::Tensor& output, at::Tensor& input, std::vector<int64_t>& output_split_sizes,
    std::vector<int64_t>& input_split_sizes, const ::c10d::AllToAllOptions& opts) {
  CheckTensor(output, "alltoall_base");
  CheckTensor(input, "alltoall_base");
  if (output.scalar_type() != input.scalar_type()) Fail("alltoall_base: output and input dtypes differ");
  const uint64_t n = static_cast<uint64_t>(getSize());
  const uint64_t scale = RouteScale(input);
  // Elements per row (split sizes count rows of the first dimension).
  auto row = [&](const at::Tensor& t) -> uint64_t {
    return t.dim() == 0 || t.size(0) == 0 ? 0 : static_cast<uint64_t>(t.numel() / t.size(0)) * scale;
  };
  auto splits = [&](const at::Tensor& t, const std::vector<int64_t>& sizes, const char* which) {
    std::vector<uint64_t> out(n);
    if (sizes.empty()) {
      if (t.dim() == 0 || t.size(0) % static_cast<int64_t>(n) != 0) {
        Fail(std::string("alltoall_base: the ") + which + "'s first dimension (" +
             std::to_string(t.dim() == 0 ? 0 : t.size(0)) + ") does not split evenly over " +
             std::to_string(n) + " ranks; give split sizes");
      }
      std::fill(out.begin(), out.end(), static_cast<uint64_t>(t.size(0)) / n * row(t));
      return out;
    }
    if (sizes.size() != n) {
      Fail(std::string("alltoall_base: ") + std::to_string(sizes.size()) + " " + which +
           " split sizes for " + std::to_string(n) + " ranks");
    }
    int64_t rows = 0;
    for (size_t j = 0; j < n; ++j) {
      if (sizes[j] < 0) Fail(std::string("alltoall_base: a negative ") + which + " split size");
      out[j] = static_cast<uint64_t>(sizes[j]) * row(t);
      rows += sizes[j];
    }
    if (rows != (t.dim() == 0 ? 0 : t.size(0))) {
      Fail(std::string("alltoall_base: the ") + which + " split sizes add up to " +
           std::to_string(rows) + " rows, the tensor has " + std::to_string(t.size(0)));
    }
    return out;
  };
  const std::vector<uint64_t> send = splits(input, input_split_sizes, "input");
  const std::vector<uint64_t> recv = splits(output, output_split_sizes, "output");
  const Clock::time_point deadline = Deadline(opts.timeout);
  std::vector<uint64_t> counts(n * n);
  if (input_split_sizes.empty() && output_split_sizes.empty()) {
    std::fill(counts.begin(), counts.end(), send[0]);  // even: the same everywhere
    if (recv[0] != send[0]) {
      Fail("alltoall_base: an output of " + std::to_string(output.numel()) +
           " elements for an even all-to-all of an input of " + std::to_string(input.numel()));
    }
  } else {
    // Every rank's sends and expected receives, so that every rank finds the same
    // disagreement (and raises it) rather than some waiting for a key the others never run.
    std::vector<uint64_t> mine = send;
    mine.insert(mine.end(), recv.begin(), recv.end());
    const std::vector<uint64_t> all = SplitMatrix(mine, deadline);
    for (uint64_t i = 0; i < n; ++i) {
      for (uint64_t j = 0; j < n; ++j) {
        const uint64_t sent = all[i * 2 * n + j], expected = all[j * 2 * n + n + i];
        if (sent != expected) {
          const uint64_t unit = std::max<uint64_t>(scale, 1);
          Fail("alltoall_base: rank " + std::to_string(i) + " sends rank " + std::to_string(j) +
               " " + std::to_string(sent / unit) + " elements, rank " + std::to_string(j) +
               "'s output split sizes expect " + std::to_string(expected / unit));
        }
        counts[i * n + j] = sent;
      }
    }
  }
  const uint64_t total = std::accumulate(counts.begin(), counts.end(), uint64_t{0});
  if (total == 0) return Done(OpType::ALLTOALL_BASE, {output});
  Buffer in = RouteBuffer(input), out = RouteBuffer(output);
  const CollectiveSpec spec = Spec(Collective::kAlltoall, ReduceOp::kSum, 0, counts);
  const std::string sig = "alltoall." + std::string(DataTypeName(in.dtype)) + "." + Join(counts);
  Result<TensorHandle> key = Key("alltoall_base", sig, in.dtype, total, &spec);
  if (!key.ok()) Fail(key.status().ToString());
  Pending p;
  p.what = "alltoall_base of " + key->name();
  p.deadline = deadline;
  Start(p, *key, in.flat, out.flat, false);
  if (out.back.defined()) p.finish = [out] { out.WriteBack(); };
  return Enqueue(OpType::ALLTOALL_BASE, std::move(p), {output});
}

c10::intrusive_ptr<::c10d::Work> ProcessGroupGradlink::alltoall(
    std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
    const ::c10d::AllToAllOptions& opts) {
  const size_t n = static_cast<size_t>(getSize());
  if (outputs.size() != n || inputs.size() != n) {
    Fail("alltoall: " + std::to_string(n) + " input and output tensors (got " +
         std::to_string(inputs.size()) + " and " + std::to_string(outputs.size()) + ")");
  }
  std::vector<at::Tensor> ins;
  std::vector<int64_t> in_sizes, out_sizes;
  for (size_t j = 0; j < n; ++j) {
    CheckTensor(inputs[j], "alltoall");
    CheckTensor(outputs[j], "alltoall");
    if (inputs[j].scalar_type() != inputs[0].scalar_type() ||
        outputs[j].scalar_type() != inputs[0].scalar_type()) {
      Fail("alltoall: every tensor must have one dtype");
    }
    ins.push_back(inputs[j].reshape(-1));
    in_sizes.push_back(inputs[j].numel());
    out_sizes.push_back(outputs[j].numel());
  }
  at::Tensor in = at::cat(ins);
  at::Tensor out = at::empty({std::accumulate(out_sizes.begin(), out_sizes.end(), int64_t{0})},
                             in.options());
  ::c10d::AllToAllOptions o = opts;
  c10::intrusive_ptr<::c10d::Work> inner = alltoall_base(out, in, out_sizes, in_sizes, o);
  // Complete this Work once the inner one has, with the parts copied out.
  auto w = c10::make_intrusive<Work>(getRank(), OpType::ALLTOALL, outputs);
  std::vector<at::Tensor> outs = outputs;
  inner->getFuture()->addCallback([w, out, outs, out_sizes](at::ivalue::Future& f) {
    if (f.hasError()) {
      w->Complete(f.exception_ptr());
      return;
    }
    int64_t at = 0;
    for (size_t j = 0; j < outs.size(); ++j) {
      outs[j].copy_(out.narrow(0, at, out_sizes[j]).view(outs[j].sizes()));
      at += out_sizes[j];
    }
    w->Complete(nullptr);
  });
  return w;
}

// A gather is an all-to-all in which every rank sends its tensor to the root only.
c10::intrusive_ptr<::c10d::Work> ProcessGroupGradlink::gather(
    std::vector<std::vector<at::Tensor>>& outputs, std::vector<at::Tensor>& inputs,
    const ::c10d::GatherOptions& opts) {
  const at::Tensor& input = One(inputs, "gather");
  const uint64_t n = static_cast<uint64_t>(getSize());
  if (opts.rootRank < 0 || opts.rootRank >= getSize()) {
    Fail("gather: root " + std::to_string(opts.rootRank) + " is not a rank of the group of " +
         std::to_string(n));
  }
  const uint64_t root = static_cast<uint64_t>(opts.rootRank);
  const bool is_root = root == static_cast<uint64_t>(getRank());
  if (is_root) {
    if (outputs.size() != 1 || outputs[0].size() != n) {
      Fail("gather: the root passes one output list of " + std::to_string(n) + " tensors");
    }
    for (const at::Tensor& o : outputs[0]) {
      CheckTensor(o, "gather");
      if (o.numel() != input.numel() || o.scalar_type() != input.scalar_type()) {
        Fail("gather: every output tensor must match the input's dtype and size");
      }
    }
  } else if (!outputs.empty() && !outputs[0].empty()) {
    Fail("gather: only the root passes output tensors");
  }
  Buffer in = RouteBuffer(input);
  if (in.count() == 0) return Done(OpType::GATHER, is_root ? outputs[0] : std::vector<at::Tensor>{});
  std::vector<uint64_t> counts(n * n, 0);
  for (uint64_t i = 0; i < n; ++i) counts[i * n + root] = in.count();
  at::Tensor flat = at::empty({static_cast<int64_t>(is_root ? in.count() * n : 0)}, in.flat.options());
  const CollectiveSpec spec = Spec(Collective::kAlltoall, ReduceOp::kSum, 0, counts);
  const std::string sig = "gather." + std::to_string(root) + "." +
                          std::string(DataTypeName(in.dtype)) + "." + std::to_string(in.count());
  Result<TensorHandle> key = Key("gather", sig, in.dtype, in.count() * n, &spec);
  if (!key.ok()) Fail(key.status().ToString());
  Pending p;
  p.what = "gather to " + std::to_string(root) + " of " + key->name();
  p.deadline = Deadline(opts.timeout);
  Start(p, *key, in.flat, flat, false);
  std::vector<at::Tensor> outs = is_root ? outputs[0] : std::vector<at::Tensor>{};
  if (is_root) {
    const bool widened = in.widened;
    const int64_t c = static_cast<int64_t>(in.count());
    p.finish = [flat, outs, c, widened] {
      for (size_t r = 0; r < outs.size(); ++r) {
        at::Tensor part = flat.narrow(0, static_cast<int64_t>(r) * c, c);
        part = Buffer::Restore(part, outs[r].scalar_type(), true, widened);
        outs[r].copy_(part.view(outs[r].sizes()));
      }
    };
  }
  return Enqueue(OpType::GATHER, std::move(p), outs);
}

// A scatter is an all-to-all in which only the root sends, a part to each rank.
c10::intrusive_ptr<::c10d::Work> ProcessGroupGradlink::scatter(
    std::vector<at::Tensor>& outputs, std::vector<std::vector<at::Tensor>>& inputs,
    const ::c10d::ScatterOptions& opts) {
  const at::Tensor& output = One(outputs, "scatter");
  const uint64_t n = static_cast<uint64_t>(getSize());
  if (opts.rootRank < 0 || opts.rootRank >= getSize()) {
    Fail("scatter: root " + std::to_string(opts.rootRank) + " is not a rank of the group of " +
         std::to_string(n));
  }
  const uint64_t root = static_cast<uint64_t>(opts.rootRank);
  const bool is_root = root == static_cast<uint64_t>(getRank());
  at::Tensor in_flat;
  if (is_root) {
    if (inputs.size() != 1 || inputs[0].size() != n) {
      Fail("scatter: the root passes one input list of " + std::to_string(n) + " tensors");
    }
    std::vector<at::Tensor> parts;
    for (const at::Tensor& i : inputs[0]) {
      CheckTensor(i, "scatter");
      if (i.numel() != output.numel() || i.scalar_type() != output.scalar_type()) {
        Fail("scatter: every input tensor must match the output's dtype and size");
      }
      parts.push_back(i.reshape(-1));
    }
    in_flat = at::cat(parts);
  } else {
    if (!inputs.empty() && !inputs[0].empty()) Fail("scatter: only the root passes input tensors");
    in_flat = at::empty({0}, output.options());
  }
  Buffer out = RouteBuffer(output);
  if (out.count() == 0) return Done(OpType::SCATTER, outputs);
  Buffer in = RouteBuffer(in_flat);
  std::vector<uint64_t> counts(n * n, 0);
  for (uint64_t j = 0; j < n; ++j) counts[root * n + j] = out.count();
  const CollectiveSpec spec = Spec(Collective::kAlltoall, ReduceOp::kSum, 0, counts);
  const std::string sig = "scatter." + std::to_string(root) + "." +
                          std::string(DataTypeName(out.dtype)) + "." + std::to_string(out.count());
  Result<TensorHandle> key = Key("scatter", sig, out.dtype, out.count() * n, &spec);
  if (!key.ok()) Fail(key.status().ToString());
  Pending p;
  p.what = "scatter from " + std::to_string(root) + " of " + key->name();
  p.deadline = Deadline(opts.timeout);
  Start(p, *key, in.flat, out.flat, false);
  if (out.back.defined()) p.finish = [out] { out.WriteBack(); };
  return Enqueue(OpType::SCATTER, std::move(p), outputs);
}

c10::intrusive_ptr<::c10d::Work> ProcessGroupGradlink::barrier(const ::c10d::BarrierOptions& opts) {
  Pending p;
  p.what = "barrier";
  p.deadline = Deadline(opts.timeout);
  if (members_.empty()) {
    // Every worker of the job: the scheduler's barrier, after this group's earlier operations.
    std::shared_ptr<Worker> w = worker_;
    p.blocking = [w](Clock::time_point deadline) { return w->Barrier(deadline); };
  } else {
    // A group: a one-element sum over its members.
    const CollectiveSpec spec = Spec(Collective::kAllreduce);
    Result<TensorHandle> key = Key("barrier", "barrier", DataType::kInt32, 1, &spec);
    if (!key.ok()) Fail(key.status().ToString());
    at::Tensor one = at::ones({1}, at::kInt);
    Start(p, *key, one, one, false);
  }
  return Enqueue(OpType::BARRIER, std::move(p), {});
}

// --- all_reduce of a sparse COO tensor -----------------------------------------------------
//
// As Gloo's (ProcessGroupGloo's AsyncSparseAllreduceWork): every rank's coalesced indices and
// values are gathered, and every rank builds the coalesced sum and writes it into the tensor,
// which the Work's result() and future hold (DDP takes a sparse gradient's sum from the future).
//
// Three rounds. The shapes and nnz first, on the caller's thread (as alltoall's split sizes):
// every rank checks every other's dtype and shape, so a disagreement fails on every rank. Then
// the indices (int64) and the values (bitwise, any dtype) are gathered at once, each rank's
// part padded to one capacity, the next power of two of the largest nnz: nnz changes from step
// to step (an embedding's gradient has a row per distinct id in the batch), and a key per
// count would leave the servers a key per step; a capacity leaves them at most one per power
// of two, for at most twice the bytes of the largest part per rank.
}  // namespace gradlink::c10d
