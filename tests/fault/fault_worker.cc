// gl_fault_worker: one worker process of a fault-injection trial, driven by run_fault.py.
//
// It joins a job through the public API (gradlink/worker.h), declares a few fp32 tensors
// (--sizes, in bytes) and then loops rounds until an operation fails (or --rounds rounds pass):
//   push     every round: push_pull of every tensor, wait, check every element exactly.
//   pull     the same, but with --straggle-ms this worker sleeps before issuing each round
//            (from round 1 on), so the other workers sit in Wait() for their pulls meanwhile.
//   barrier  every round: push_pull of the tensors, then Barrier(); with --straggle-ms this
//            worker sleeps before entering the barrier, so the others sit in Barrier().
// --sleep-before-connect-ms delays Connect(), so that a fault can land while the other members
// are in the join handshake.
// --die-after-connect-us / --die-after-join-us: this process SIGKILLs itself that many
// microseconds after calling Connect() (from a thread, so possibly inside the join) or after
// Connect() returned: a worker that crashes while the servers still set up their connections
// to it (the wireup case of run_fault.py).
//
// Lines on stdout (flushed at once; T is CLOCK_MONOTONIC in seconds with ns, the clock Python's
// time.monotonic() reads on Linux):
//   CONNECTING T                   Connect() is called now
//   JOINED rank size servers T     Connect() returned
//   HIERARCHY <text>               hierarchical aggregation in force (WorkerStats::InForce), or off
//   ROUND k T                      round k is issued now
//   ROUNDOK k T                    round k's sums are all in and checked
//   STRAGGLE k T                   this worker starts its straggle sleep of round k
//   BARRIER k T                    this worker enters the barrier of round k
//   FAILED T <status>              the first failed gradlink call (Connect included)
//   RELEASED <seconds>             after FAILED, the other pending handles took this long to fail
//   STUCK <seconds> <tensor> <status>  ...or one of them was still pending at the --wait-s
//                                  deadline (its buffer is still in use: exit 14 at once)
//   SHUTDOWN <seconds> <status>    with --shutdown-after-failure: Shutdown() after FAILED
//   WRONG round tensor index got want   a wrong element (then exit 12)
//   DONE rounds T                  all --rounds rounds passed (then exit 0)
// Exit codes: 0 all rounds passed, 10 an operation failed after the join, 11 Connect failed,
// 12 a wrong element, 13 Shutdown() after the failure took longer than its deadline, 14 a
// handle still pending --wait-s after the failure (STUCK), 2 usage.
//
// Values are small integers (exact in fp32, also summed over a few workers), so results are
// compared bit for bit with the sum computed here.
#include <CLI/CLI.hpp>
#include <time.h>

#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstring>
#include <memory>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "gradlink/env.h"
#include "gradlink/worker.h"

namespace gl = gradlink;
using Clock = std::chrono::steady_clock;

namespace {

constexpr int kExitOk = 0;
constexpr int kExitUsage = 2;
constexpr int kExitFailed = 10;
constexpr int kExitConnect = 11;
constexpr int kExitWrong = 12;
constexpr int kExitSlowShutdown = 13;
constexpr int kExitStuck = 14;

struct Args {
  std::string scheduler, job = "default", phase = "push", sizes = "1024,4194304";
  int32_t rank = -1;
  int rounds = 0;  // 0: until an operation fails
  int straggle_ms = 0;
  int sleep_before_connect_ms = 0;
  int64_t die_after_connect_us = -1;  // -1: off
  int64_t die_after_join_us = -1;
  double connect_timeout_s = 30;
  double wait_s = 60;
  uint64_t partition_bytes = 4u << 20;
  uint64_t max_in_flight = 32u << 20;
  uint64_t local_arena = gl::WorkerOptions().local_arena_bytes;  // 0: the servers' path
  std::string host;  // WorkerOptions::host_name; empty: the default ("machine/pid")
  bool shutdown_after_failure = false;
  int shutdown_deadline_ms = 1500;
};

std::string Now() {
  timespec ts{};
  clock_gettime(CLOCK_MONOTONIC, &ts);
  char buf[48];
  std::snprintf(buf, sizeof(buf), "%lld.%09ld", static_cast<long long>(ts.tv_sec), ts.tv_nsec);
  return buf;
}

void Line(const std::string& s) {
  std::fputs((s + "\n").c_str(), stdout);
  std::fflush(stdout);
}

// Rank `rank`'s element j of tensor t in round r: -6..6.
inline float Value(uint64_t j, uint32_t rank, uint64_t round, uint64_t t) {
  return static_cast<float>(static_cast<int64_t>((j + rank * 3 + round * 5 + t * 11) % 13) - 6);
}

struct Tensor {
  gl::TensorHandle handle;
  uint64_t count = 0;
  std::vector<float> buf;
  gl::PushPullHandle pending;
};

std::vector<uint64_t> ParseSizes(const std::string& text) {
  std::vector<uint64_t> out;
  std::stringstream ss(text);
  std::string item;
  while (std::getline(ss, item, ',')) {
    if (!item.empty()) out.push_back(std::stoull(item));
  }
  return out;
}

// A crash: no goodbye, no destructor, no flush of anything but what Line() already flushed.
[[noreturn]] void DieIn(int64_t us) {
  if (us > 0) std::this_thread::sleep_for(std::chrono::microseconds(us));
  ::raise(SIGKILL);
  std::_Exit(137);  // not reached
}

class Runner {
 public:
  explicit Runner(const Args& a) : a_(a) {}

  int Run() {
    if (a_.sleep_before_connect_ms > 0) {
      std::this_thread::sleep_for(std::chrono::milliseconds(a_.sleep_before_connect_ms));
    }
    gl::WorkerOptions o;
    // The GRADLINK_* environment as a user's process gets it (the harnesses set
    // GRADLINK_SCHEDULER_RECONNECT); the flags below win.
    if (gl::Status env = gl::ApplyEnvironment(&o); !env.ok()) {
      Line("FAILED " + Now() + " " + env.ToString());
      return kExitConnect;
    }
    o.scheduler = a_.scheduler;
    o.job = a_.job;
    o.rank = a_.rank;
    if (a_.partition_bytes != 0) o.partition_bytes = a_.partition_bytes;  // 0: gradlink chooses
    if (a_.max_in_flight != 0) o.max_bytes_in_flight = a_.max_in_flight;
    o.local_arena_bytes = a_.local_arena;
    o.host_name = a_.host;
    o.connect_timeout = std::chrono::milliseconds(static_cast<int64_t>(a_.connect_timeout_s * 1000));
    Line("CONNECTING " + Now());
    if (a_.die_after_connect_us >= 0) {
      std::thread([us = a_.die_after_connect_us] { DieIn(us); }).detach();
    }
    auto w = gl::Worker::Connect(o);
    if (!w.ok()) {
      Line("FAILED " + Now() + " " + w.status().ToString());
      return kExitConnect;
    }
    w_ = std::move(w).value();
    rank_ = w_->rank();
    n_ = w_->size();
    Line("JOINED " + std::to_string(rank_) + " " + std::to_string(n_) + " " +
         std::to_string(w_->num_servers()) + " " + Now());
  {
    const std::string hierarchy = w_->Stats().in_force.hierarchy;
    Line("HIERARCHY " + (hierarchy.empty() ? std::string("off") : hierarchy));
  }
    if (a_.die_after_join_us >= 0) DieIn(a_.die_after_join_us);
    int rc = Loop();
    if (rc == kExitFailed && a_.shutdown_after_failure) {
      const auto t0 = Clock::now();
      gl::Status s = w_->Shutdown(t0 + std::chrono::milliseconds(a_.shutdown_deadline_ms));
      const double secs = std::chrono::duration<double>(Clock::now() - t0).count();
      char buf[64];
      std::snprintf(buf, sizeof(buf), "SHUTDOWN %.6f ", secs);
      Line(buf + s.ToString());
      if (secs * 1000 > a_.shutdown_deadline_ms) rc = kExitSlowShutdown;
    }
    w_.reset();  // the destructor shuts down too (bounded); the harness times the exit
    return rc;
  }

 private:
  // Prints the first failure (once) and returns the exit code for it.
  int Fail(const gl::Status& s) {
    if (!failed_) Line("FAILED " + Now() + " " + s.ToString());
    failed_ = true;
    return kExitFailed;
  }

  void Straggle(uint64_t round) {
    Line("STRAGGLE " + std::to_string(round) + " " + Now());
    std::this_thread::sleep_for(std::chrono::milliseconds(a_.straggle_ms));
  }

  gl::Status Declare() {
    const std::vector<uint64_t> sizes = ParseSizes(a_.sizes);
    for (size_t i = 0; i < sizes.size(); ++i) {
      Tensor t;
      t.count = sizes[i] / 4;
      t.buf.resize(t.count);
      auto h = w_->Declare("fault." + std::to_string(i) + "." + std::to_string(sizes[i]),
                           gl::DataType::kFloat32, t.count);
      if (!h.ok()) return h.status();
      t.handle = *h;
      tensors_.push_back(std::move(t));
    }
    return gl::Status::Ok();
  }

  // Issues every tensor's push_pull of `round` and waits for all of them. On the first failure
  // prints FAILED at once, then waits (bounded) until every handle is done with its buffer.
  gl::Status PushPullAll(uint64_t round) {
    for (size_t t = 0; t < tensors_.size(); ++t) {
      Tensor& x = tensors_[t];
      for (uint64_t j = 0; j < x.count; ++j) x.buf[j] = Value(j, rank_, round, t);
      x.pending = w_->PushPull(x.handle, std::as_writable_bytes(std::span(x.buf)));
    }
    for (Tensor& x : tensors_) {
      gl::Status s = x.pending.Wait(Deadline());
      if (s.ok()) continue;
      Fail(s);
      // The failure is sticky: the other handles must fail too, at once. Their buffers may not
      // be released before they have.
      const auto t0 = Clock::now();
      for (Tensor& y : tensors_) {
        gl::Status r = y.pending.Wait(Deadline());
        if (r.code() == gl::Code::kTimeout) {
          char buf[96];
          std::snprintf(buf, sizeof(buf), "STUCK %.3f ",
                        std::chrono::duration<double>(Clock::now() - t0).count());
          Line(buf + y.handle.name() + " " + r.ToString());
          std::_Exit(kExitStuck);  // the buffer is still in use: never free it
        }
      }
      const double secs = std::chrono::duration<double>(Clock::now() - t0).count();
      if (secs > 0.5) {
        char buf[64];
        std::snprintf(buf, sizeof(buf), "RELEASED %.3f", secs);
        Line(buf);
      }
      return s;
    }
    return gl::Status::Ok();
  }

  bool Check(uint64_t round) {
    for (size_t t = 0; t < tensors_.size(); ++t) {
      const Tensor& x = tensors_[t];
      for (uint64_t j = 0; j < x.count; ++j) {
        float want = 0;
        for (uint32_t r = 0; r < n_; ++r) want += Value(j, r, round, t);
        if (std::memcmp(&want, &x.buf[j], 4) != 0) {
          Line("WRONG " + std::to_string(round) + " " + std::to_string(t) + " " +
               std::to_string(j) + " " + std::to_string(x.buf[j]) + " " + std::to_string(want));
          return false;
        }
      }
    }
    return true;
  }

  Clock::time_point Deadline() const {
    return Clock::now() + std::chrono::milliseconds(static_cast<int64_t>(a_.wait_s * 1000));
  }

  int Loop() {
    gl::Status s = Declare();
    if (!s.ok()) return Fail(s);
    for (uint64_t round = 0; a_.rounds == 0 || round < static_cast<uint64_t>(a_.rounds); ++round) {
      if (a_.phase == "pull" && a_.straggle_ms > 0 && round > 0) Straggle(round);
      Line("ROUND " + std::to_string(round) + " " + Now());
      s = PushPullAll(round);
      if (!s.ok()) return Fail(s);
      if (!Check(round)) return kExitWrong;
      Line("ROUNDOK " + std::to_string(round) + " " + Now());
      if (a_.phase == "barrier") {
        if (a_.straggle_ms > 0 && round > 0) Straggle(round);
        Line("BARRIER " + std::to_string(round) + " " + Now());
        s = w_->Barrier(Deadline());
        if (!s.ok()) return Fail(s);
      }
    }
    Line("DONE " + std::to_string(a_.rounds) + " " + Now());
    return kExitOk;
  }

  const Args& a_;
  std::unique_ptr<gl::Worker> w_;
  uint32_t rank_ = 0, n_ = 0;
  std::vector<Tensor> tensors_;
  bool failed_ = false;
};

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"gradlink fault-injection worker (tests/fault/run_fault.py)"};
  Args a;
  app.add_option("--scheduler", a.scheduler, "scheduler host:port")->required();
  app.add_option("--job", a.job);
  app.add_option("--rank", a.rank);
  app.add_option("--phase", a.phase, "push | pull | barrier")
      ->check(CLI::IsMember({"push", "pull", "barrier"}));
  app.add_option("--sizes", a.sizes, "comma-separated tensor sizes in bytes (multiples of 4)");
  app.add_option("--rounds", a.rounds, "rounds to run; 0: until an operation fails");
  app.add_option("--straggle-ms", a.straggle_ms, "pull/barrier: sleep this long each round");
  app.add_option("--sleep-before-connect-ms", a.sleep_before_connect_ms);
  app.add_option("--die-after-connect-us", a.die_after_connect_us);
  app.add_option("--die-after-join-us", a.die_after_join_us);
  app.add_option("--connect-timeout-s", a.connect_timeout_s);
  app.add_option("--wait-s", a.wait_s, "deadline of every Wait()/Barrier()");
  app.add_option("--partition-bytes", a.partition_bytes, "0: gradlink chooses");
  app.add_option("--max-in-flight", a.max_in_flight, "0: gradlink chooses");
  app.add_option("--local-arena", a.local_arena, "same-host path: bytes of shared memory; 0: off");
  app.add_option("--host", a.host, "the host this worker says it is on (workers that share one "
                                   "sum through shared memory first)");
  app.add_flag("--shutdown-after-failure", a.shutdown_after_failure);
  app.add_option("--shutdown-deadline-ms", a.shutdown_deadline_ms);
  CLI11_PARSE(app, argc, argv);
  for (uint64_t s : ParseSizes(a.sizes)) {
    if (s == 0 || s % 4 != 0) {
      std::fprintf(stderr, "gl_fault_worker: sizes must be positive multiples of 4\n");
      return kExitUsage;
    }
  }
  return Runner(a).Run();
}
