// python/c10d/process_group.h: torch.distributed's collectives on a gradlink worker.
#include "process_group.h"

#include <Python.h>

#include <ATen/ATen.h>
#include <ATen/core/ivalue.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cstring>
#include <exception>
#include <limits>
#include <numeric>
#include <span>
#include <stdexcept>
#include <utility>

namespace gradlink::c10d {
namespace {

using ::c10d::OpType;

// Reaches Python as RuntimeError with this message.
[[noreturn]] void Fail(const std::string& message) {
  throw std::runtime_error("gradlink: " + message);
}

// The gradlink element type of a torch dtype, if it has one.
std::optional<DataType> Native(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return DataType::kFloat32;
    case at::kDouble: return DataType::kFloat64;
    case at::kHalf: return DataType::kFloat16;
    case at::kBFloat16: return DataType::kBFloat16;
    case at::kInt: return DataType::kInt32;
    case at::kLong: return DataType::kInt64;
    default: return std::nullopt;
  }
}

void CheckTensor(const at::Tensor& t, const std::string& what) {
  if (!t.defined()) Fail(what + ": an undefined tensor");
  if (t.layout() != at::kStrided) Fail(what + ": only dense (strided) tensors, not " +
                                       c10::str(t.layout()));
  if (!t.device().is_cpu()) {
    Fail(what + ": a tensor on " + t.device().str() +
         "; this build of the gradlink backend takes CPU tensors");
  }
}

// (`what` is a C string: a reference to the result of a call that takes a temporary
// std::string trips GCC 14's -Wdangling-reference, an error under -Werror.)
const at::Tensor& One(std::vector<at::Tensor>& tensors, const char* what) {
  if (tensors.size() != 1) {
    Fail(std::string(what) + ": one tensor per process (got " + std::to_string(tensors.size()) + ")");
  }
  CheckTensor(tensors[0], what);
  return tensors[0];
}

// A tensor as gradlink moves it: a contiguous 1-D buffer of a gradlink dtype, a view of the
// caller's tensor where it can be, else a staging copy to write back once the result is in.
struct Buffer {
  at::Tensor flat;
  DataType dtype = DataType::kFloat32;
  at::Tensor back;       // defined: copy `flat` into it when done (a staging copy)
  bool bitwise = false;  // a routing buffer: its bytes are the tensor's (else its values)
  bool widened = false;  // 1-byte elements moved as 2-byte ones (a routing buffer)

  uint64_t count() const { return static_cast<uint64_t>(flat.numel()); }
  void WriteBack() const {
    if (!back.defined()) return;
    back.copy_(Restore(flat, back.scalar_type(), bitwise, widened).view(back.sizes()));
  }
  // `part` of a buffer as the tensor's dtype: its bytes (routing), or its values.
  static at::Tensor Restore(const at::Tensor& part, at::ScalarType t, bool bitwise, bool widened) {
    if (!bitwise) return part;
    if (widened) return part.view(at::kShort).to(at::kByte).view(t);
    return part.view(t);
  }
};

// For a reduction: the values themselves. Integers and bools without a gradlink dtype are
// widened to int32 (their sums then wrap on the way back, as in their own width; bools reduce
// as logical or/and).
Buffer ReduceBuffer(const at::Tensor& t, const std::string& what) {
  Buffer b;
  if (std::optional<DataType> d = Native(t.scalar_type())) {
    b.dtype = *d;
    if (t.is_contiguous()) {
      b.flat = t.view(-1);
    } else {
      b.flat = t.contiguous().view(-1);
      b.back = t;
    }
    return b;
  }
  switch (t.scalar_type()) {
    case at::kByte: case at::kChar: case at::kShort: case at::kBool:
      b.dtype = DataType::kInt32;
      b.flat = t.to(at::kInt).contiguous().view(-1);
      b.back = t;
      return b;
    default:
      Fail(what + ": no reduction of " + std::string(c10::toString(t.scalar_type())) + " tensors");
  }
}

// For routing (broadcast, gathers, scatter, all-to-all): the bytes, moved bit for bit. Any
// dtype: its own where gradlink has it, else the bytes as 8-, 4- or 2-byte elements (1-byte
// ones widened to 2).
Buffer RouteBuffer(const at::Tensor& t) {
  Buffer b;
  b.bitwise = true;
  at::Tensor c = t.is_contiguous() ? t.view(-1) : t.contiguous().view(-1);
  if (!t.is_contiguous()) b.back = t;
  if (std::optional<DataType> d = Native(t.scalar_type())) {
    b.dtype = *d;
    b.flat = c;
    return b;
  }
  const int64_t e = t.element_size();
  if (e % 8 == 0) {
    b.dtype = DataType::kInt64, b.flat = c.view(at::kLong);
  } else if (e % 4 == 0) {
    b.dtype = DataType::kInt32, b.flat = c.view(at::kInt);
  } else if (e % 2 == 0) {
    b.dtype = DataType::kFloat16, b.flat = c.view(at::kHalf);
  } else {
    b.dtype = DataType::kFloat16, b.flat = c.view(at::kByte).to(at::kShort).view(at::kHalf);
    b.widened = true;
    b.back = t;
  }
  return b;
}

// Elements per unit of a routing buffer: 1-byte dtypes widened keep their count; others
// scale by element size over the carrier's.
uint64_t RouteScale(const at::Tensor& t) {
  if (Native(t.scalar_type())) return 1;
  const int64_t e = t.element_size();
  if (e % 8 == 0) return e / 8;
  if (e % 4 == 0) return e / 4;
  if (e % 2 == 0) return e / 2;
  return 1;
}

struct OpOf {
  ReduceOp op = ReduceOp::kSum;
  bool average = false;
  const char* name = "sum";
};

OpOf Reduction(const ::c10d::ReduceOp& op, const std::string& what) {
  const ::c10d::ReduceOp::RedOpType t = op;
  switch (t) {
    case ::c10d::ReduceOp::SUM: return {ReduceOp::kSum, false, "sum"};
    case ::c10d::ReduceOp::AVG: return {ReduceOp::kSum, true, "avg"};
    case ::c10d::ReduceOp::MIN: return {ReduceOp::kMin, false, "min"};
    case ::c10d::ReduceOp::MAX: return {ReduceOp::kMax, false, "max"};
    case ::c10d::ReduceOp::PRODUCT: return {ReduceOp::kProduct, false, "product"};
    case ::c10d::ReduceOp::BAND: Fail(what + ": ReduceOp.BAND is not supported (SUM, AVG, MIN, MAX, PRODUCT are)");
    case ::c10d::ReduceOp::BOR: Fail(what + ": ReduceOp.BOR is not supported (SUM, AVG, MIN, MAX, PRODUCT are)");
    case ::c10d::ReduceOp::BXOR: Fail(what + ": ReduceOp.BXOR is not supported (SUM, AVG, MIN, MAX, PRODUCT are)");
    default: Fail(what + ": ReduceOp " + std::to_string(static_cast<int>(t)) + " is not supported (SUM, AVG, MIN, MAX, PRODUCT are)");
  }
}

std::string Join(const std::vector<uint64_t>& v) {
  std::string s;
  for (uint64_t x : v) s += (s.empty() ? "" : ",") + std::to_string(x);
  // Long count lists (many ranks) go by a hash: the name stays short, and equal lists agree.
  if (s.size() > 96) {
    uint64_t h = 1469598103934665603ull;  // FNV-1a
    for (char c : s) h = (h ^ static_cast<unsigned char>(c)) * 1099511628211ull;
    s = std::to_string(v.size()) + "x" + std::to_string(h);
  }
  return s;
}

std::span<std::byte> Bytes(const at::Tensor& t, DataType d) {
  return {static_cast<std::byte*>(t.data_ptr()), static_cast<size_t>(t.numel()) * DataTypeSize(d)};
}

}  // namespace

class ProcessGroupGradlink::Work final : public ::c10d::Work {
 public:
  Work(int rank, OpType type, std::vector<at::Tensor> outputs)
      : ::c10d::Work(rank, type),
        outputs_(std::move(outputs)),
        future_(c10::make_intrusive<at::ivalue::Future>(
            c10::ListType::create(c10::TensorType::get()))) {}

  std::vector<at::Tensor> result() override { return outputs_; }
  c10::intrusive_ptr<at::ivalue::Future> getFuture() override { return future_; }

  // The Work first (wait() returns), then the Future (its callbacks run here).
  void Complete(std::exception_ptr error) {
    finish(error);
    if (error) {
      future_->setError(error);
    } else {
      future_->markCompleted(c10::IValue(outputs_));
    }
  }

 private:
  std::vector<at::Tensor> outputs_;
  c10::intrusive_ptr<at::ivalue::Future> future_;
};

ProcessGroupGradlink::ProcessGroupGradlink(std::shared_ptr<Worker> worker, int rank, int size,
                                           std::vector<uint32_t> members, std::string uid,
                                           std::chrono::milliseconds timeout, uint64_t slots)
    : ProcessGroupBase(rank, size),
      worker_(std::move(worker)),
      members_(std::move(members)),
      uid_(std::move(uid)),
      timeout_(timeout),
      slots_(std::max<uint64_t>(slots, 1)) {
  completion_ = std::thread([this] { CompletionLoop(); });
}

ProcessGroupGradlink::~ProcessGroupGradlink() {
  {
    std::lock_guard lock(mu_);
    stopping_ = true;
  }
  cv_.notify_all();
  // A Future's callback may need the GIL (a Python DDP hook): never join holding it.
  if (Py_IsInitialized() && PyGILState_Check()) {
    Py_BEGIN_ALLOW_THREADS
    completion_.join();
    Py_END_ALLOW_THREADS
  } else {
    completion_.join();
  }
}

CollectiveSpec ProcessGroupGradlink::Spec(Collective kind, ReduceOp op, uint32_t root,
                                          std::vector<uint64_t> counts) const {
  CollectiveSpec s;
  s.kind = kind;
  s.op = op;
  s.root = root;
  s.counts = std::move(counts);
  s.group = members_;
  return s;
}

Clock::time_point ProcessGroupGradlink::Deadline(std::chrono::milliseconds op_timeout) const {
  return Clock::now() + (op_timeout.count() >= 0 ? op_timeout : timeout_);
}

Result<TensorHandle> ProcessGroupGradlink::Key(const std::string& what,
                                               const std::string& signature, DataType dtype,
                                               uint64_t count, const CollectiveSpec* spec) {
  operations_.fetch_add(1, std::memory_order_relaxed);
  std::string name;
  {
    std::lock_guard lock(mu_);
    const uint64_t call = calls_[signature]++;
    name = "c10d/" + uid_ + "/" + signature + "#" + std::to_string(call % slots_);
    if (auto it = keys_.find(name); it != keys_.end()) return it->second;
  }
  // Declaring writes to the scheduler: not under mu_, which the completion thread takes. A
  // second declaration of the name (another thread's) returns the same handle.
  Result<TensorHandle> t = spec == nullptr || spec->is_sum()
                               ? worker_->Declare(name, dtype, count)
                               : worker_->DeclareCollective(name, dtype, count, *spec);
  if (!t.ok()) return Status(t.status().code(), what + ": " + t.status().message());
  std::lock_guard lock(mu_);
  keys_.emplace(name, *t);
  return t;
}

void ProcessGroupGradlink::Start(Pending& p, const TensorHandle& key, const at::Tensor& input,
                                 const at::Tensor& output, bool average) {
  PushPullOptions o;
  o.average = average;
  // Later calls go first. DDP and Megatron launch buckets in backward's order, from the last
  // layers to the first, and the next forward needs the first layers' sums first (BytePS's
  // priority rule). Measured (train_cluster, 8 steps): 1.78 s a step with it, 1.96-2.07 s with
  // every call at one priority. The count saturates at INT32_MAX, which only evens priorities.
  o.priority = static_cast<int32_t>(
      std::min<uint64_t>(operations_.load(std::memory_order_relaxed),
                         static_cast<uint64_t>(std::numeric_limits<int32_t>::max())));
  const DataType d = key.dtype();
  std::span<std::byte> out = Bytes(output, d);
  if (key.spec().is_sum() && input.data_ptr() == output.data_ptr()) {
    p.handles.push_back(worker_->PushPull(key, out, o));
  } else {
    p.handles.push_back(worker_->Run(key, Bytes(input, d), out, o));
  }
  p.keepalive.push_back(input);
  p.keepalive.push_back(output);
}

c10::intrusive_ptr<::c10d::Work> ProcessGroupGradlink::Done(OpType type,
                                                            std::vector<at::Tensor> outputs) {
  auto w = c10::make_intrusive<Work>(getRank(), type, std::move(outputs));
  w->Complete(nullptr);
  return w;
}

c10::intrusive_ptr<::c10d::Work> ProcessGroupGradlink::Enqueue(OpType type, Pending p,
                                                               std::vector<at::Tensor> outputs) {
  auto w = c10::make_intrusive<Work>(getRank(), type, std::move(outputs));
  p.work = w;
  {
    std::lock_guard lock(mu_);
    queue_.push_back(std::move(p));
  }
  cv_.notify_all();
  return w;
}

void ProcessGroupGradlink::CompletionLoop() {
  for (;;) {
    Pending p;
    {
      std::unique_lock lock(mu_);
      cv_.wait(lock, [&] { return stopping_ || !queue_.empty(); });
      if (queue_.empty()) return;  // stopping, and every operation has ended
      p = std::move(queue_.front());
      queue_.pop_front();
    }
    Status s;
    bool timed_out = false;
    if (p.blocking) {
      s = p.blocking(p.deadline);
    } else {
      // Every handle must end before its buffers may be touched (a failure is the worker's
      // for all of them, so the rest end at once).
      for (const PushPullHandle& h : p.handles) {
        Status hs = h.Wait(p.deadline);
        if (hs.code() == Code::kTimeout) timed_out = true;
        if (!hs.ok() && s.ok()) s = hs;
      }
    }
    std::exception_ptr error;
    if (s.ok()) {
      try {
        if (p.finish) p.finish();
      } catch (...) {
        error = std::current_exception();
      }
    } else {
      std::string m = "gradlink: " + p.what + ": " + s.ToString();
      if (timed_out) m += " (the process group's timeout; the operation is abandoned)";
      error = std::make_exception_ptr(std::runtime_error(m));
    }
    c10::intrusive_ptr<Work> w = std::move(p.work);
    if (timed_out) {
      std::lock_guard lock(mu_);
      abandoned_.push_back(std::move(p));  // the worker may still write these buffers
    }
    w->Complete(error);
  }
}

// --- the collectives --------------------------------------------------------------------------

c10::intrusive_ptr<::c10d::Work> ProcessGroupGradlink::allreduce(
    std::vector<at::Tensor>& tensors, const ::c10d::AllreduceOptions& opts) {
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

#if TORCH_VERSION_MAJOR >= 2
c10::intrusive_ptr<::c10d::Work> ProcessGroupGradlink::Coalesced(
    std::vector<at::Tensor>& outputs, const std::vector<Flat>& flats, const std::string& what,
    std::chrono::milliseconds op_timeout) {
  Pending p;
  p.deadline = Deadline(op_timeout);
  p.what = what + " of " + std::to_string(flats.size()) + " tensors";
  // Every key first: a pair whose key is refused fails the call with nothing started.
  std::vector<TensorHandle> keys(flats.size());
  for (size_t i = 0; i < flats.size(); ++i) {
    if (flats[i].empty()) continue;
    keys[i] = flats[i].Declare(*this, "coalesced." + std::to_string(i) + ".", what);
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
  if (p.handles.empty()) return Done(OpType::COALESCED, outputs);
  if (!backs.empty()) p.finish = [backs] { for (const Buffer& b : backs) b.WriteBack(); };
  return Enqueue(OpType::COALESCED, std::move(p), outputs);
}

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
  return Coalesced(outputs, EachPair(outputs, inputs, what, [&](at::Tensor& out, at::Tensor& in) {
                     return Flat::Allgather(*this, out, in, what);
                   }),
                   what, opts.timeout);
}

c10::intrusive_ptr<::c10d::Work> ProcessGroupGradlink::reduce_scatter_tensor_coalesced(
    std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
    const ::c10d::ReduceScatterOptions& opts) {
  const std::string what = "reduce_scatter_tensor_coalesced";
  return Coalesced(outputs, EachPair(outputs, inputs, what, [&](at::Tensor& out, at::Tensor& in) {
                     return Flat::ReduceScatter(*this, out, in, opts.reduceOp, what);
                   }),
                   what, opts.timeout);
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

std::vector<uint64_t> ProcessGroupGradlink::SplitMatrix(const std::vector<uint64_t>& mine,
                                                        Clock::time_point deadline) {
  const uint64_t n = static_cast<uint64_t>(getSize());
  const uint64_t each = mine.size();
  std::vector<uint64_t> counts(n, each);
  const CollectiveSpec spec = Spec(Collective::kAllgather, ReduceOp::kSum, 0, counts);
  Result<TensorHandle> key = Key("alltoall splits", "splits." + std::to_string(each),
                                 DataType::kInt64, n * each, &spec);
  if (!key.ok()) Fail(key.status().ToString());
  auto buffers = std::make_shared<SplitBuffers>(SplitBuffers{mine, std::vector<uint64_t>(n * each)});
  PushPullHandle h = worker_->Run(*key, std::as_bytes(std::span(buffers->mine)),
                                  std::as_writable_bytes(std::span(buffers->all)));
  if (Status s = h.Wait(deadline); !s.ok()) {
    if (s.code() == Code::kTimeout) {
      std::lock_guard lock(mu_);  // the worker may still read and write them
      abandoned_splits_.push_back(buffers);
    }
    Fail("alltoall: exchanging the split sizes: " + s.ToString());
  }
  return std::move(buffers->all);
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

}  // namespace gradlink::c10d
