// _gradlink: the Python binding of the gradlink worker (pybind11).
//
// It does not link libtorch: a tensor crosses as its data pointer (an int), its dtype name
// ("fp32", ...) and its element count; gradlink.torch does the torch side. Blocking calls
// (Connect, Wait, Barrier, Shutdown) release the GIL. Every Status that is not OK becomes an
// exception of the class that its code maps to (gradlink.GradlinkError and subclasses).
//
// Buffer lifetime: the C++ worker writes into a buffer until the operation completes. push_pull
// takes a `keepalive` object (the torch tensor) and holds it until the operation has completed,
// even when the caller drops the returned Handle early, so the memory cannot be freed under a
// pending pull. push_pull_group holds the list of its members' tensors the same way.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "gradlink/env.h"
#include "gradlink/options.h"
#include "gradlink/scheduler.h"
#include "gradlink/status.h"
#include "gradlink/tensor.h"
#include "gradlink/worker.h"

namespace py = pybind11;
namespace gl = gradlink;

namespace {

using Clock = gl::Clock;

// The exception class of each code, created at module init. Index: the code's value.
PyObject* g_errors[gl::kMaxCode + 1] = {};

// Thrown by C++ code of this module and translated into g_errors[code].
struct StatusError {
  gl::Status status;
};

[[noreturn]] void Raise(const gl::Status& s) { throw StatusError{s}; }

void Check(const gl::Status& s) {
  if (!s.ok()) Raise(s);
}

// Seconds to a deadline, without overflowing the clock.
Clock::time_point DeadlineFrom(std::optional<double> timeout_s) {
  if (!timeout_s) return Clock::time_point::max();  // callers resolve None to a timeout first
  if (*timeout_s <= 0) return Clock::now();
  const double max_s = 1e9;  // ~31 years: "forever" without overflow
  const auto d = std::chrono::duration_cast<Clock::duration>(
      std::chrono::duration<double>(std::min(*timeout_s, max_s)));
  return Clock::now() + d;
}

gl::DataType DtypeFrom(const std::string& name) {
  auto t = gl::ParseDataType(name);
  if (!t) {
    Raise(gl::InvalidArgument("unknown dtype '" + name +
                              "' (expected fp32, fp64, fp16, bf16, int32 or int64)"));
  }
  return *t;
}

gl::Collective KindFrom(const std::string& name) {
  for (auto k : {gl::Collective::kAllreduce, gl::Collective::kBroadcast, gl::Collective::kAllgather,
                 gl::Collective::kReduceScatter, gl::Collective::kAlltoall}) {
    if (name == gl::CollectiveName(k)) return k;
  }
  Raise(gl::InvalidArgument("unknown collective '" + name +
                            "' (expected allreduce, broadcast, allgather, reduce_scatter or "
                            "alltoall)"));
}

gl::ReduceOp OpFrom(const std::string& name) {
  for (auto o : {gl::ReduceOp::kSum, gl::ReduceOp::kMin, gl::ReduceOp::kMax, gl::ReduceOp::kProduct}) {
    if (name == gl::ReduceOpName(o)) return o;
  }
  Raise(gl::InvalidArgument("unknown reduce op '" + name + "' (expected sum, min, max or product)"));
}

// How often a blocking wait wakes up (GIL taken) to let Python deliver signals (Ctrl-C).
constexpr auto kSignalPoll = std::chrono::milliseconds(100);

class Handle {
 public:
  // `default_timeout_s`: what wait(None) waits (the worker's WorkerOptions::operation_timeout).
  Handle(gl::PushPullHandle h, std::string name, py::object keepalive, double default_timeout_s)
      : h_(std::move(h)),
        name_(std::move(name)),
        keepalive_(std::move(keepalive)),
        default_timeout_s_(default_timeout_s) {}

  bool poll() const { return h_.Poll(); }

  // Blocks (GIL released) until the operation completes or `timeout_s` passes (None: the
  // worker's operation timeout, as Wait() without a deadline in C++) (TimeoutError; the
  // operation goes on and may be waited for again). Raises the operation's error.
  void wait(std::optional<double> timeout_s) {
    if (!timeout_s) timeout_s = default_timeout_s_;
    const Clock::time_point deadline = DeadlineFrom(timeout_s);
    while (!h_.Poll()) {
      const Clock::time_point now = Clock::now();
      if (now >= deadline) {
        // The C++ handle's own word on what is still running (for a group: which fused
        // tensor, and the hint that workers may group differently).
        gl::Status s = h_.Wait(now);
        if (s.code() != gl::Code::kTimeout) break;  // it ended just now
        char secs[32];
        std::snprintf(secs, sizeof(secs), "%g", timeout_s.value_or(0));
        Raise(gl::Timeout("push_pull of '" + name_ + "' not complete after " + secs +
                          " s (it goes on: wait again, or shut down): " + s.message()));
      }
      {
        py::gil_scoped_release release;
        const Clock::time_point slice = deadline - now > kSignalPoll ? now + kSignalPoll : deadline;
        h_.Wait(slice).IgnoreError();
      }
      if (PyErr_CheckSignals() != 0) throw py::error_already_set();
    }
    gl::Status s = h_.Wait(Clock::now());
    keepalive_ = py::none();  // done: the buffer is no longer written
    Check(s);
  }

  const std::string& name() const { return name_; }

  // Seconds by stage (gradlink::PushPullTiming); zeros until the operation has completed.
  py::dict timing() const {
    const gl::PushPullTiming t = h_.Timing();
    auto s = [](gl::Clock::duration d) { return std::chrono::duration<double>(d).count(); };
    py::dict d;
    d["pack"] = s(t.pack);
    d["queue"] = s(t.queue);
    d["push"] = s(t.push);
    d["reduce"] = s(t.reduce);
    d["pull"] = s(t.pull);
    d["unpack"] = s(t.unpack);
    d["total"] = s(t.total);
    d["server"] = s(t.server);  // within reduce, not a stage of its own
    return d;
  }

 private:
  gl::PushPullHandle h_;
  std::string name_;
  py::object keepalive_;
  double default_timeout_s_;
};

class PyWorker {
 public:
  // Every option: None keeps what the environment says (gl::ApplyEnvironment, the one mapping of
  // GRADLINK_* onto WorkerOptions), else the C++ default; a value given here wins over both.
  PyWorker(const std::string& scheduler, std::optional<std::string> job,
           std::optional<int32_t> rank, std::optional<uint64_t> partition_bytes,
           std::optional<uint64_t> max_bytes_in_flight, std::optional<bool> single_lane,
           std::optional<double> connect_timeout_s, const std::string& host_name,
           std::optional<uint64_t> fusion_buffer_bytes,
           std::optional<uint64_t> fusion_threshold_bytes, std::optional<uint64_t> max_bytes_ahead,
           std::optional<uint64_t> local_arena_bytes, std::optional<uint64_t> local_chunk_bytes) {
    gl::WorkerOptions o;
    Check(gl::ApplyEnvironment(&o));  // also the job secret (gradlink-run sets GRADLINK_SECRET)
    if (!scheduler.empty()) o.scheduler = scheduler;
    if (job) o.job = *job;
    if (rank) o.rank = *rank;
    if (partition_bytes) o.partition_bytes = *partition_bytes;
    if (max_bytes_in_flight) o.max_bytes_in_flight = *max_bytes_in_flight;
    if (single_lane) o.single_lane = *single_lane;
    if (connect_timeout_s) {
      o.connect_timeout = std::chrono::milliseconds(static_cast<int64_t>(*connect_timeout_s * 1000));
    }
    if (!host_name.empty()) o.host_name = host_name;
    if (fusion_buffer_bytes) o.fusion_buffer_bytes = *fusion_buffer_bytes;
    if (fusion_threshold_bytes) o.fusion_threshold_bytes = *fusion_threshold_bytes;
    if (max_bytes_ahead) o.max_bytes_ahead = *max_bytes_ahead;
    if (local_arena_bytes) o.local_arena_bytes = *local_arena_bytes;
    if (local_chunk_bytes) o.local_chunk_bytes = *local_chunk_bytes;
    fusion_buffer_bytes_ = o.fusion_buffer_bytes;
    operation_timeout_s_ = std::chrono::duration<double>(o.operation_timeout).count();
    fusion_threshold_bytes_ = o.fusion_threshold_bytes;
    gl::Result<std::unique_ptr<gl::Worker>> w = gl::Status();
    {
      py::gil_scoped_release release;
      w = gl::Worker::Connect(o);
    }
    Check(w.status());
    worker_ = std::move(w).value();
  }

  ~PyWorker() {
    if (worker_) {
      {
        py::gil_scoped_release release;
        worker_->Shutdown(Clock::now() + std::chrono::seconds(5)).IgnoreError();
        worker_.reset();
      }
      inflight_.clear();
    }
  }

  // A capsule ("gradlink.Worker") holding a new std::shared_ptr to the C++ worker, for
  // _gradlink_c10d; both modules link the one libgradlink.
  py::capsule shared() const {
    if (!worker_) Raise(gl::InvalidArgument("worker is closed"));
    auto* p = new std::shared_ptr<gl::Worker>(worker_);
    return py::capsule(p, "gradlink.Worker", [](PyObject* c) {
      delete static_cast<std::shared_ptr<gl::Worker>*>(PyCapsule_GetPointer(c, "gradlink.Worker"));
    });
  }

  uint32_t rank() const { return live().rank(); }
  uint32_t size() const { return live().size(); }
  uint32_t num_servers() const { return live().num_servers(); }
  bool is_shut_down() const { return shut_down_; }
  uint64_t fusion_buffer_bytes() const { return fusion_buffer_bytes_; }
  uint64_t fusion_threshold_bytes() const { return fusion_threshold_bytes_; }

  py::dict stats() const {
    const gl::WorkerStats s = live().Stats();
    py::dict d;
    d["push_pulls"] = s.push_pulls;
    d["bytes_reduced"] = s.bytes_reduced;
    d["groups"] = s.groups;
    d["fused_ops"] = s.fused_ops;
    d["bytes_packed"] = s.bytes_packed;
    d["bytes_unpacked"] = s.bytes_unpacked;
    d["bytes_copied_eager"] = s.bytes_copied_eager;
    d["bytes_copied_bounce"] = s.bytes_copied_bounce;
    d["bytes_copied_local"] = s.bytes_copied_local;
    d["bytes_copied_results"] = s.bytes_copied_results;
    d["local_busy_ns"] = s.local_busy_ns;
    d["protocol_errors"] = s.protocol_errors;
    d["partitions_held"] = s.partitions_held;
    d["peak_bytes_ahead"] = s.peak_bytes_ahead;
    d["servers_lost"] = s.servers_lost;
    d["partitions_recovered"] = s.partitions_recovered;
    const gl::WorkerStats::InForce& f = s.in_force;
    py::dict in_force;
    in_force["partition_bytes"] = f.partition_bytes;
    in_force["max_bytes_in_flight"] = f.max_bytes_in_flight;
    in_force["max_bytes_ahead"] = f.max_bytes_ahead;
    in_force["fusion_buffer_bytes"] = f.fusion_buffer_bytes;
    in_force["fusion_threshold_bytes"] = f.fusion_threshold_bytes;
    in_force["local_arena_bytes"] = f.local_arena_bytes;
    in_force["same_host_path"] = f.same_host_path;
    in_force["hierarchy"] = f.hierarchy;
    in_force["single_lane"] = f.single_lane;
    in_force["host"] = f.host;
    in_force["ucx"] = f.ucx;
    in_force["device_memory"] = f.device_memory;
    in_force["chosen"] = f.chosen;
    d["in_force"] = in_force;
    return d;
  }

  // `shape`: the tensor's dimensions (their product must be `count`), or None.
  gl::TensorHandle declare(const std::string& name, const std::string& dtype, uint64_t count,
                           std::optional<std::vector<uint64_t>> shape) {
    if (shape) {
      uint64_t n = 1;
      for (uint64_t d : *shape) n *= d;  // an overflow cannot equal count: Declare refuses it
      if (n != count) {
        Raise(gl::InvalidArgument("declare '" + name + "': a shape of " +
                                  std::to_string(shape->size()) + " dimensions holding " +
                                  std::to_string(n) + " elements, not " + std::to_string(count)));
      }
    }
    gl::Result<gl::TensorHandle> t = gl::Status();
    {
      py::gil_scoped_release release;
      // A 0-d tensor (shape ()) is declared as one element without a shape.
      t = shape && !shape->empty() ? live().Declare(name, DtypeFrom(dtype), *shape)
                                   : live().Declare(name, DtypeFrom(dtype), count);
    }
    Check(t.status());
    return *t;
  }

  // A key for another collective than the sum (gradlink/collective.h): kind and op by name.
  gl::TensorHandle declare_collective(const std::string& name, const std::string& dtype,
                                      uint64_t count, const std::string& kind,
                                      const std::string& op, uint32_t root,
                                      std::vector<uint64_t> counts, std::vector<uint32_t> group) {
    gl::CollectiveSpec spec;
    spec.group = std::move(group);
    spec.kind = KindFrom(kind);
    spec.op = OpFrom(op);
    spec.root = root;
    spec.counts = std::move(counts);
    gl::Result<gl::TensorHandle> t = gl::Status();
    {
      py::gil_scoped_release release;
      t = live().DeclareCollective(name, DtypeFrom(dtype), count, spec);
    }
    Check(t.status());
    return *t;
  }

  // Runs a collective key: in_count elements at in_ptr in, out_count at out_ptr out (the
  // worker checks them against the key). `keepalive` owns both buffers until it completes.
  Handle run(const gl::TensorHandle& tensor, uintptr_t in_ptr, uint64_t in_count,
             uintptr_t out_ptr, uint64_t out_count, const std::string& dtype, bool average,
             int32_t priority, py::object keepalive) {
    if (!tensor.valid()) Raise(gl::InvalidArgument("run on an undeclared tensor"));
    const gl::DataType t = DtypeFrom(dtype);
    if (t != tensor.dtype()) {
      Raise(gl::InvalidArgument("run of '" + tensor.name() + "': buffers of " + dtype +
                                ", declared " + std::string(gl::DataTypeName(tensor.dtype()))));
    }
    if ((in_ptr == 0 && in_count != 0) || (out_ptr == 0 && out_count != 0)) {
      Raise(gl::InvalidArgument("run of '" + tensor.name() + "': a null pointer"));
    }
    const size_t size = gl::DataTypeSize(t);
    std::span<const std::byte> in(reinterpret_cast<const std::byte*>(in_ptr), in_count * size);
    std::span<std::byte> out(reinterpret_cast<std::byte*>(out_ptr), out_count * size);
    gl::PushPullOptions po;
    po.average = average;
    po.priority = priority;
    gl::PushPullHandle h;
    {
      py::gil_scoped_release release;
      h = live().Run(tensor, in, out, po);
    }
    std::erase_if(inflight_, [](const auto& e) { return e.first.Poll(); });
    if (!h.Poll()) inflight_.emplace_back(h, keepalive);
    return Handle(h, tensor.name(), std::move(keepalive), operation_timeout_s_);
  }

  Handle push_pull(const gl::TensorHandle& tensor, uintptr_t data_ptr, uint64_t count,
                   const std::string& dtype, bool average, int32_t priority, py::object keepalive) {
    if (!tensor.valid()) Raise(gl::InvalidArgument("push_pull on an undeclared tensor"));
    const gl::DataType t = DtypeFrom(dtype);
    if (t != tensor.dtype() || count != tensor.count()) {
      Raise(gl::InvalidArgument("push_pull of '" + tensor.name() + "': buffer is " + dtype + "[" +
                                std::to_string(count) + "], declared " +
                                std::string(gl::DataTypeName(tensor.dtype())) + "[" +
                                std::to_string(tensor.count()) + "]"));
    }
    if (data_ptr == 0 && count != 0) Raise(gl::InvalidArgument("push_pull of a null pointer"));
    std::span<std::byte> data(reinterpret_cast<std::byte*>(data_ptr),
                              count * gl::DataTypeSize(t));
    gl::PushPullOptions po;
    po.average = average;
    po.priority = priority;
    gl::PushPullHandle h;
    {
      py::gil_scoped_release release;
      h = live().PushPull(tensor, data, po);
    }
    // Forget the buffers of completed operations; keep this one alive until it completes.
    std::erase_if(inflight_, [](const auto& e) { return e.first.Poll(); });
    if (!h.Poll()) inflight_.emplace_back(h, keepalive);
    return Handle(h, tensor.name(), std::move(keepalive), operation_timeout_s_);
  }

  // Members as for push_pull: declared tensors, data pointers, counts and dtypes (checked against
  // the declarations). `keepalive` owns every member's memory.
  Handle push_pull_group(const std::vector<gl::TensorHandle>& tensors,
                         const std::vector<uintptr_t>& data_ptrs,
                         const std::vector<uint64_t>& counts, const std::vector<std::string>& dtypes,
                         bool average, int32_t priority, py::object keepalive) {
    const size_t n = tensors.size();
    if (data_ptrs.size() != n || counts.size() != n || dtypes.size() != n) {
      Raise(gl::InvalidArgument("push_pull_group: " + std::to_string(n) + " tensors, " +
                                std::to_string(data_ptrs.size()) + " pointers, " +
                                std::to_string(counts.size()) + " counts and " +
                                std::to_string(dtypes.size()) + " dtypes"));
    }
    std::vector<std::span<std::byte>> data(n);
    for (size_t i = 0; i < n; ++i) {
      const gl::TensorHandle& t = tensors[i];
      if (!t.valid()) Raise(gl::InvalidArgument("push_pull_group: member " + std::to_string(i) +
                                                " is not a declared tensor"));
      const gl::DataType dt = DtypeFrom(dtypes[i]);
      if (dt != t.dtype() || counts[i] != t.count()) {
        Raise(gl::InvalidArgument("push_pull_group member '" + t.name() + "': buffer is " +
                                  dtypes[i] + "[" + std::to_string(counts[i]) + "], declared " +
                                  std::string(gl::DataTypeName(t.dtype())) + "[" +
                                  std::to_string(t.count()) + "]"));
      }
      if (data_ptrs[i] == 0 && counts[i] != 0) {
        Raise(gl::InvalidArgument("push_pull_group member '" + t.name() + "': null pointer"));
      }
      data[i] = std::span<std::byte>(reinterpret_cast<std::byte*>(data_ptrs[i]),
                                     counts[i] * gl::DataTypeSize(dt));
    }
    gl::PushPullOptions po;
    po.average = average;
    po.priority = priority;
    gl::PushPullHandle h;
    {
      py::gil_scoped_release release;
      h = live().PushPullGroup(tensors, data, po);
    }
    std::erase_if(inflight_, [](const auto& e) { return e.first.Poll(); });
    if (!h.Poll()) inflight_.emplace_back(h, keepalive);
    std::string name = "group of " + std::to_string(n) + " tensors";
    if (n > 0) name += " ('" + tensors.front().name() + "'" +
                       (n > 1 ? " .. '" + tensors.back().name() + "'" : "") + ")";
    return Handle(h, std::move(name), std::move(keepalive), operation_timeout_s_);
  }

  void barrier(std::optional<double> timeout_s) {
    gl::Status s;
    {
      py::gil_scoped_release release;
      s = live().Barrier(DeadlineFrom(timeout_s ? timeout_s : operation_timeout_s_));
    }
    Check(s);
  }

  uint32_t join(std::optional<double> timeout_s) {
    gl::Result<uint32_t> last = gl::InvalidArgument("join: not run");
    {
      py::gil_scoped_release release;
      last = live().Join(DeadlineFrom(timeout_s ? timeout_s : operation_timeout_s_));
    }
    Check(last.status());
    return *last;
  }

  void shutdown(double timeout_s) {
    if (!worker_ || shut_down_) return;
    shut_down_ = true;
    gl::Status s;
    {
      py::gil_scoped_release release;
      s = worker_->Shutdown(DeadlineFrom(timeout_s));
    }
    // Pending operations have failed with kAborted and the lanes are stopped: nothing writes
    // into the buffers any more.
    inflight_.clear();
    Check(s);
  }

  size_t num_inflight() {
    std::erase_if(inflight_, [](const auto& e) { return e.first.Poll(); });
    return inflight_.size();
  }

 private:
  gl::Worker& live() const {
    if (!worker_) Raise(gl::InvalidArgument("worker is closed"));
    return *worker_;
  }

  // Shared with the torch.distributed adapter (_gradlink_c10d), which runs its process groups'
  // collectives on this worker: one rank per process, whichever front end joined first.
  std::shared_ptr<gl::Worker> worker_;
  bool shut_down_ = false;
  uint64_t fusion_buffer_bytes_ = 0, fusion_threshold_bytes_ = 0;
  double operation_timeout_s_ = 300;  // WorkerOptions::operation_timeout: wait()/barrier(None)
  // Operations not known to be complete, with the objects that own their buffers. Guarded by
  // the GIL.
  std::vector<std::pair<gl::PushPullHandle, py::object>> inflight_;
};

double Seconds(std::chrono::milliseconds d) { return std::chrono::duration<double>(d).count(); }

// A role's options with the GRADLINK_* environment applied over the C++ defaults, by
// gl::ApplyEnvironment (the one parser of those variables), as a dict; for gradlink/_env.py, so
// that Python reads them as the C++ does. Durations in seconds; the secret only as whether one
// is set. Raises InvalidArgumentError naming the variable and its value.
py::dict EnvironmentOptions(const std::string& role) {
  py::dict d;
  if (role == "worker") {
    gl::WorkerOptions o;
    Check(gl::ApplyEnvironment(&o));
    d["scheduler"] = o.scheduler;
    d["job"] = o.job;
    d["host_name"] = o.host_name;
    d["rank"] = o.rank;
    d["partition_bytes"] = o.partition_bytes;
    d["max_bytes_in_flight"] = o.max_bytes_in_flight;
    d["max_bytes_ahead"] = o.max_bytes_ahead;
    d["single_lane"] = o.single_lane;
    d["fusion_buffer_bytes"] = o.fusion_buffer_bytes;
    d["fusion_threshold_bytes"] = o.fusion_threshold_bytes;
    d["local_arena_bytes"] = o.local_arena_bytes;
    d["local_chunk_bytes"] = o.local_chunk_bytes;
    d["hierarchical"] = o.hierarchical;
    d["half_partials"] = o.half_partials;
    d["connect_timeout"] = Seconds(o.connect_timeout);
    d["scheduler_reconnect_timeout"] = Seconds(o.scheduler_reconnect_timeout);
    d["operation_timeout"] = Seconds(o.operation_timeout);
    d["has_secret"] = o.secret.has_value();
  } else if (role == "server") {
    gl::ServerOptions o;
    Check(gl::ApplyEnvironment(&o));
    d["scheduler"] = o.scheduler;
    d["job"] = o.job;
    d["host_name"] = o.host_name;
    d["id"] = o.id;
    d["weight"] = o.weight;
    d["memory_budget_bytes"] = o.memory_budget_bytes;
    d["engine_threads"] = o.engine_threads;
    d["cpus"] = o.cpus;
    d["connect_timeout"] = Seconds(o.connect_timeout);
    d["scheduler_reconnect_timeout"] = Seconds(o.scheduler_reconnect_timeout);
    d["has_secret"] = o.secret.has_value();
  } else if (role == "scheduler") {
    gl::SchedulerOptions o;
    Check(gl::ApplyEnvironment(&o));
    d["job"] = o.job;
    d["has_secret"] = o.secret.has_value();
  } else {
    Raise(gl::InvalidArgument("unknown role '" + role +
                              "' (expected worker, server or scheduler)"));
  }
  return d;
}

PyObject* NewError(py::module_& m, const char* name, py::handle bases, const char* doc) {
  const std::string qualified = std::string("gradlink.") + name;
  PyObject* cls = PyErr_NewExceptionWithDoc(qualified.c_str(), doc, bases.ptr(), nullptr);
  if (cls == nullptr) throw py::error_already_set();
  m.add_object(name, py::handle(cls));
  return cls;
}

}  // namespace

// A job's scheduler inside this process (the torch.distributed backend's rank 0 hosts it).
class PyScheduler {
 public:
  PyScheduler(const std::string& host, uint16_t port, uint32_t workers, uint32_t servers,
              std::optional<std::string> job, std::optional<std::string> secret,
              double join_timeout_s) {
    gl::SchedulerOptions o;
    Check(gl::ApplyEnvironment(&o));
    o.host = host;
    o.port = port;
    o.num_workers = workers;
    o.num_servers = servers;
    if (job) o.job = *job;
    if (secret) o.secret = *secret;
    o.join_timeout = std::chrono::milliseconds(static_cast<int64_t>(join_timeout_s * 1000));
    gl::Result<std::unique_ptr<gl::Scheduler>> s = gl::Status();
    {
      py::gil_scoped_release release;
      s = gl::Scheduler::Start(o);
    }
    Check(s.status());
    scheduler_ = std::move(s).value();
  }
  ~PyScheduler() { stop(); }

  uint16_t port() const { return live().port(); }

  // None while the job runs (after `timeout_s`); else "" when every worker left cleanly, or
  // the failure's message.
  std::optional<std::string> wait(double timeout_s) {
    gl::Status s;
    {
      py::gil_scoped_release release;
      s = live().Wait(DeadlineFrom(timeout_s));
    }
    if (s.code() == gl::Code::kTimeout) return std::nullopt;
    return s.ok() ? std::string() : s.ToString();
  }

  void stop() {
    if (!scheduler_) return;
    py::gil_scoped_release release;
    scheduler_->Stop();
    scheduler_.reset();
  }

 private:
  gl::Scheduler& live() const {
    if (!scheduler_) Raise(gl::InvalidArgument("scheduler is stopped"));
    return *scheduler_;
  }
  std::unique_ptr<gl::Scheduler> scheduler_;
};

PYBIND11_MODULE(_gradlink, m) {
  m.doc() = "gradlink worker binding (use the gradlink and gradlink.torch modules)";

  // Exceptions. GradlinkError is the base of all; a few also derive from the builtin that a
  // Python user would catch (TimeoutError, ValueError).
  PyObject* base = NewError(m, "GradlinkError", py::handle(PyExc_RuntimeError),
                            "Base class of every gradlink error; .code is the C++ Code name.");
  auto bases = [&](PyObject* extra) {
    return extra ? py::make_tuple(py::handle(base), py::handle(extra))
                 : py::make_tuple(py::handle(base));
  };
  struct Spec {
    gl::Code code;
    const char* name;
    PyObject* extra;
    const char* doc;
  };
  const Spec specs[] = {
      {gl::Code::kInvalidArgument, "InvalidArgumentError", PyExc_ValueError,
       "A bad argument (kInvalidArgument)."},
      {gl::Code::kTimeout, "TimeoutError", PyExc_TimeoutError,
       "A deadline passed (kTimeout)."},
      {gl::Code::kPeerLost, "PeerLostError", nullptr,
       "A server, worker or the scheduler was lost (kPeerLost)."},
      {gl::Code::kProtocolError, "ProtocolError", nullptr,
       "A peer sent something invalid (kProtocolError)."},
      {gl::Code::kMismatch, "MismatchError", nullptr,
       "Workers disagree on a tensor's dtype or shape (kMismatch)."},
      {gl::Code::kAuthFailed, "AuthFailedError", nullptr,
       "Authentication failed (kAuthFailed)."},
      {gl::Code::kAborted, "AbortedError", nullptr,
       "The job was aborted or the worker shut down (kAborted)."},
      {gl::Code::kResourceExhausted, "ResourceExhaustedError", nullptr,
       "Out of a resource (kResourceExhausted)."},
      {gl::Code::kUnavailable, "UnavailableError", nullptr,
       "A peer cannot be reached (kUnavailable)."},
      {gl::Code::kInternal, "InternalError", nullptr, "A bug in gradlink (kInternal)."},
  };
  py::setattr(py::handle(base), "code", py::str("kInternal"));
  for (size_t i = 0; i <= gl::kMaxCode; ++i) g_errors[i] = base;
  for (const Spec& s : specs) {
    PyObject* cls = NewError(m, s.name, bases(s.extra), s.doc);
    py::setattr(py::handle(cls), "code", py::str(std::string(gl::CodeName(s.code))));
    g_errors[static_cast<size_t>(s.code)] = cls;
  }
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const StatusError& e) {
      const auto code = static_cast<size_t>(e.status.code());
      PyObject* cls = code <= gl::kMaxCode ? g_errors[code] : g_errors[0];
      PyErr_SetString(cls, e.status.ToString().c_str());
    }
  });

  m.def("code_name", [](int code) {
    if (code < 0 || code > gl::kMaxCode) Raise(gl::InvalidArgument("no such code"));
    return std::string(gl::CodeName(static_cast<gl::Code>(code)));
  });
  m.def("_raise_status", [](int code, const std::string& message) {
    if (code <= 0 || code > gl::kMaxCode) Raise(gl::InvalidArgument("no such error code"));
    Raise(gl::Status(static_cast<gl::Code>(code), message));
  }, "Raises the exception of a Status (for tests).");
  m.def("dtype_size", [](const std::string& dtype) { return gl::DataTypeSize(DtypeFrom(dtype)); });

  py::class_<gl::TensorHandle>(m, "Tensor", "A declared tensor: name, dtype and count.")
      .def_property_readonly("name", [](const gl::TensorHandle& t) { return t.name(); })
      .def_property_readonly("key", &gl::TensorHandle::key)
      .def_property_readonly("current", &gl::TensorHandle::current,
                             "False once its name was declared again otherwise (or its plan "
                             "was refused): declare it again for the current declaration")
      .def_property_readonly("dtype", [](const gl::TensorHandle& t) {
        return std::string(gl::DataTypeName(t.dtype()));
      })
      .def_property_readonly("count", &gl::TensorHandle::count)
      .def_property_readonly("input_count", &gl::TensorHandle::input_count)
      .def_property_readonly("output_count", &gl::TensorHandle::output_count)
      .def_property_readonly("shape", [](const gl::TensorHandle& t) {
        return t.shape().empty() ? py::object(py::none()) : py::object(py::tuple(py::cast(t.shape())));
      })
      .def("__repr__", [](const gl::TensorHandle& t) {
        return "<gradlink.Tensor '" + t.name() + "' " + std::string(gl::DataTypeName(t.dtype())) +
               "[" + std::to_string(t.count()) + "]>";
      });

  py::class_<Handle>(m, "Handle", "The pending result of one push_pull.")
      .def("poll", &Handle::poll, "True once wait() would return without blocking.")
      .def("wait", &Handle::wait, py::arg("timeout") = py::none(),
           "Waits (GIL released) until the sum is in the buffer; raises the operation's error, "
           "or TimeoutError after `timeout` seconds (the operation goes on).")
      .def_property_readonly("name", &Handle::name)
      .def("timing", &Handle::timing,
           "Seconds by stage: pack, queue, push, reduce, pull, unpack, total (zeros until done).");

  py::class_<PyWorker>(m, "Worker", "One worker of a gradlink job (the C++ gradlink::Worker).")
      .def(py::init<const std::string&, std::optional<std::string>, std::optional<int32_t>,
                    std::optional<uint64_t>, std::optional<uint64_t>, std::optional<bool>,
                    std::optional<double>, const std::string&, std::optional<uint64_t>,
                    std::optional<uint64_t>, std::optional<uint64_t>, std::optional<uint64_t>,
                    std::optional<uint64_t>>(),
           py::arg("scheduler") = "", py::arg("job") = py::none(), py::arg("rank") = py::none(),
           py::arg("partition_bytes") = py::none(), py::arg("max_bytes_in_flight") = py::none(),
           py::arg("single_lane") = py::none(), py::arg("connect_timeout") = py::none(),
           py::arg("host_name") = "", py::arg("fusion_buffer_bytes") = py::none(),
           py::arg("fusion_threshold_bytes") = py::none(), py::arg("max_bytes_ahead") = py::none(),
           py::arg("local_arena_bytes") = py::none(), py::arg("local_chunk_bytes") = py::none(),
           "Joins the job (blocks, GIL released, until every member has joined). Every option "
           "left None takes its GRADLINK_* variable if set (docs/operations.md, 'Environment'), "
           "else the C++ default (include/gradlink/options.h); scheduler '' likewise "
           "(GRADLINK_SCHEDULER).")
      .def_property_readonly("rank", &PyWorker::rank)
      .def_property_readonly("size", &PyWorker::size)
      .def_property_readonly("num_servers", &PyWorker::num_servers)
      .def_property_readonly("is_shut_down", &PyWorker::is_shut_down)
      .def_property_readonly("fusion_buffer_bytes", &PyWorker::fusion_buffer_bytes)
      .def_property_readonly("fusion_threshold_bytes", &PyWorker::fusion_threshold_bytes)
      .def("_shared", &PyWorker::shared,
           "A capsule sharing the C++ worker with the torch.distributed adapter.")
      .def("stats", &PyWorker::stats, "Counters of the C++ worker (gradlink::WorkerStats).")
      .def("declare", &PyWorker::declare, py::arg("name"), py::arg("dtype"), py::arg("count"),
           py::arg("shape") = py::none())
      .def("declare_collective", &PyWorker::declare_collective, py::arg("name"),
           py::arg("dtype"), py::arg("count"), py::arg("kind"), py::arg("op") = "sum",
           py::arg("root") = 0, py::arg("counts") = std::vector<uint64_t>(),
           py::arg("group") = std::vector<uint32_t>(),
           "Declares a key for a collective (kind: allreduce, broadcast, allgather, "
           "reduce_scatter, alltoall; op: sum, min, max, product; group: the ranks taking part, "
           "ascending, empty for all); see gradlink/collective.h.")
      .def("run", &PyWorker::run, py::arg("tensor"), py::arg("in_ptr"), py::arg("in_count"),
           py::arg("out_ptr"), py::arg("out_count"), py::arg("dtype"), py::arg("average") = false,
           py::arg("priority") = 0, py::arg("keepalive") = py::none(),
           "Starts a declared collective from in_count elements at in_ptr into out_count at "
           "out_ptr. `keepalive` (owning both) is held until the operation completes.")
      .def("push_pull", &PyWorker::push_pull, py::arg("tensor"), py::arg("data_ptr"),
           py::arg("count"), py::arg("dtype"), py::arg("average") = false,
           py::arg("priority") = 0, py::arg("keepalive") = py::none(),
           "Starts summing count elements at data_ptr over all workers, in place. `keepalive` "
           "(the object owning the memory) is held until the operation completes.")
      .def("push_pull_group", &PyWorker::push_pull_group, py::arg("tensors"),
           py::arg("data_ptrs"), py::arg("counts"), py::arg("dtypes"), py::arg("average") = false,
           py::arg("priority") = 0, py::arg("keepalive") = py::none(),
           "Starts summing every member over all workers, in place, as one operation: small "
           "members are fused (see gradlink::Worker::PushPullGroup; every worker must group the "
           "same tensors the same way). `keepalive` (owning every member's memory) is held until "
           "the operation completes.")
      .def("barrier", &PyWorker::barrier, py::arg("timeout") = py::none())
      .def("join", &PyWorker::join, py::arg("timeout") = py::none(),
           "This rank ran out of data (Horovod's join): waits for its own operations, sits "
           "the others' sums out until every rank has joined, and returns the rank that "
           "joined last.")
      .def("shutdown", &PyWorker::shutdown, py::arg("timeout") = 5.0)
      .def("_num_inflight", &PyWorker::num_inflight);

  py::class_<PyScheduler>(m, "Scheduler", "A job's scheduler in this process (gradlink::Scheduler).")
      .def(py::init<const std::string&, uint16_t, uint32_t, uint32_t, std::optional<std::string>,
                    std::optional<std::string>, double>(),
           py::arg("host") = "127.0.0.1", py::arg("port") = 0, py::arg("workers") = 1,
           py::arg("servers") = 1, py::arg("job") = py::none(), py::arg("secret") = py::none(),
           py::arg("join_timeout") = 60.0,
           "Binds host:port (0: a free port) and runs the job's control plane until stop(). "
           "job and secret: None takes GRADLINK_JOB / GRADLINK_SECRET, else the defaults.")
      .def_property_readonly("port", &PyScheduler::port)
      .def("wait", &PyScheduler::wait, py::arg("timeout") = 0.0,
           "None while the job runs; '' once every worker left cleanly; else the failure.")
      .def("stop", &PyScheduler::stop, "Ends the job now and joins the scheduler's threads.");
  m.def("machine_name", &gl::LocalMachineName,
        "The machine this process counts as (GRADLINK_HOST's machine part, else the host name "
        "with a network namespace that is not the machine's own).");
  m.def("generate_secret", &gl::GenerateSecret, "A fresh random job secret.");
  m.def("environment_options", &EnvironmentOptions, py::arg("role"),
        "The options of `role` (worker, server, scheduler) with the GRADLINK_* environment "
        "applied, parsed by gradlink::ApplyEnvironment; raises InvalidArgumentError naming a "
        "malformed variable. For gradlink/_env.py.");
}
