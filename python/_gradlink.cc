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
// pending pull.
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

#include "gradlink/options.h"
#include "gradlink/status.h"
#include "gradlink/tensor.h"
#include "gradlink/worker.h"
#include "security/secret.h"

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

// Seconds (None: forever) to a deadline, without overflowing the clock.
Clock::time_point DeadlineFrom(std::optional<double> timeout_s) {
  if (!timeout_s) return Clock::time_point::max();
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

// How often a blocking wait wakes up (GIL taken) to let Python deliver signals (Ctrl-C).
constexpr auto kSignalPoll = std::chrono::milliseconds(100);

class Handle {
 public:
  Handle(gl::PushPullHandle h, std::string name, py::object keepalive)
      : h_(std::move(h)), name_(std::move(name)), keepalive_(std::move(keepalive)) {}

  bool poll() const { return h_.Poll(); }

  // Blocks (GIL released) until the operation completes or `timeout_s` passes (TimeoutError;
  // the operation goes on and may be waited for again). Raises the operation's error.
  void wait(std::optional<double> timeout_s) {
    const Clock::time_point deadline = DeadlineFrom(timeout_s);
    while (!h_.Poll()) {
      const Clock::time_point now = Clock::now();
      if (now >= deadline) {
        char secs[32];
        std::snprintf(secs, sizeof(secs), "%g", timeout_s.value_or(0));
        Raise(gl::Timeout("push_pull of '" + name_ + "' not complete after " + secs +
                          " s (it goes on: wait again, or shut down)"));
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

 private:
  gl::PushPullHandle h_;
  std::string name_;
  py::object keepalive_;
};

class PyWorker {
 public:
  PyWorker(const std::string& scheduler, const std::string& job, int32_t rank,
           uint64_t partition_bytes, uint64_t max_bytes_in_flight, bool single_lane,
           const std::string& transport, double connect_timeout_s, const std::string& host_name) {
    gl::WorkerOptions o;
    o.scheduler = scheduler;
    o.job = job;
    o.rank = rank;
    o.partition_bytes = partition_bytes;
    o.max_bytes_in_flight = max_bytes_in_flight;
    o.single_lane = single_lane;
    o.transport = transport;
    o.connect_timeout = std::chrono::milliseconds(static_cast<int64_t>(connect_timeout_s * 1000));
    o.host_name = host_name;
    // The job secret from GRADLINK_SECRET / GRADLINK_SECRET_FILE (gradlink-run sets the first).
    gl::Result<std::optional<gl::security::Secret>> secret = gl::security::LoadSecret();
    Check(secret.status());
    if (secret->has_value()) o.secret = (*secret)->value;
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

  uint32_t rank() const { return live().rank(); }
  uint32_t size() const { return live().size(); }
  uint32_t num_servers() const { return live().num_servers(); }
  bool is_shut_down() const { return shut_down_; }

  gl::TensorHandle declare(const std::string& name, const std::string& dtype, uint64_t count) {
    gl::Result<gl::TensorHandle> t = gl::Status();
    {
      py::gil_scoped_release release;
      t = live().Declare(name, DtypeFrom(dtype), count);
    }
    Check(t.status());
    return *t;
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
    return Handle(h, tensor.name(), std::move(keepalive));
  }

  void barrier(std::optional<double> timeout_s) {
    gl::Status s;
    {
      py::gil_scoped_release release;
      s = live().Barrier(DeadlineFrom(timeout_s));
    }
    Check(s);
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

  std::unique_ptr<gl::Worker> worker_;
  bool shut_down_ = false;
  // Operations not known to be complete, with the objects that own their buffers. Guarded by
  // the GIL.
  std::vector<std::pair<gl::PushPullHandle, py::object>> inflight_;
};

PyObject* NewError(py::module_& m, const char* name, py::handle bases, const char* doc) {
  const std::string qualified = std::string("gradlink.") + name;
  PyObject* cls = PyErr_NewExceptionWithDoc(qualified.c_str(), doc, bases.ptr(), nullptr);
  if (cls == nullptr) throw py::error_already_set();
  m.add_object(name, py::handle(cls));
  return cls;
}

}  // namespace

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
      .def_property_readonly("dtype", [](const gl::TensorHandle& t) {
        return std::string(gl::DataTypeName(t.dtype()));
      })
      .def_property_readonly("count", &gl::TensorHandle::count)
      .def("__repr__", [](const gl::TensorHandle& t) {
        return "<gradlink.Tensor '" + t.name() + "' " + std::string(gl::DataTypeName(t.dtype())) +
               "[" + std::to_string(t.count()) + "]>";
      });

  py::class_<Handle>(m, "Handle", "The pending result of one push_pull.")
      .def("poll", &Handle::poll, "True once wait() would return without blocking.")
      .def("wait", &Handle::wait, py::arg("timeout") = py::none(),
           "Waits (GIL released) until the sum is in the buffer; raises the operation's error, "
           "or TimeoutError after `timeout` seconds (the operation goes on).")
      .def_property_readonly("name", &Handle::name);

  py::class_<PyWorker>(m, "Worker", "One worker of a gradlink job (the C++ gradlink::Worker).")
      .def(py::init<const std::string&, const std::string&, int32_t, uint64_t, uint64_t, bool,
                    const std::string&, double, const std::string&>(),
           py::arg("scheduler"), py::arg("job") = "default", py::arg("rank") = -1,
           py::arg("partition_bytes") = uint64_t{4} << 20,
           py::arg("max_bytes_in_flight") = uint64_t{32} << 20, py::arg("single_lane") = false,
           py::arg("transport") = "ucx", py::arg("connect_timeout") = 30.0,
           py::arg("host_name") = "",
           "Joins the job (blocks, GIL released, until every member has joined).")
      .def_property_readonly("rank", &PyWorker::rank)
      .def_property_readonly("size", &PyWorker::size)
      .def_property_readonly("num_servers", &PyWorker::num_servers)
      .def_property_readonly("is_shut_down", &PyWorker::is_shut_down)
      .def("declare", &PyWorker::declare, py::arg("name"), py::arg("dtype"), py::arg("count"))
      .def("push_pull", &PyWorker::push_pull, py::arg("tensor"), py::arg("data_ptr"),
           py::arg("count"), py::arg("dtype"), py::arg("average") = false,
           py::arg("priority") = 0, py::arg("keepalive") = py::none(),
           "Starts summing count elements at data_ptr over all workers, in place. `keepalive` "
           "(the object owning the memory) is held until the operation completes.")
      .def("barrier", &PyWorker::barrier, py::arg("timeout") = py::none())
      .def("shutdown", &PyWorker::shutdown, py::arg("timeout") = 5.0)
      .def("_num_inflight", &PyWorker::num_inflight);
}
