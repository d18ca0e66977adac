// A tiny gradlink job through the installed public API only: this process starts a scheduler,
// then runs one server and two workers as processes (itself again, with a role argument). Each
// worker sums a tensor through the server (the same-host path off) and checks every element
// against a scalar loop over the ranks' inputs. Exit 0 when the job ended cleanly and every
// sum was right.
//
//   app                        the job (scheduler here; server and workers as children)
//   app server HOST:PORT       app worker HOST:PORT     (what the job starts)
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <span>
#include <string>
#include <vector>

#include "gradlink/env.h"
#include "gradlink/scheduler.h"
#include "gradlink/server.h"
#include "gradlink/worker.h"

namespace gl = gradlink;

namespace {

constexpr uint32_t kWorkers = 2;
constexpr uint64_t kCount = 100000;

std::chrono::steady_clock::time_point In(int seconds) {
  return std::chrono::steady_clock::now() + std::chrono::seconds(seconds);
}

// Rank r's input: small integers, so every sum is exact in fp32.
float Input(uint32_t rank, uint64_t i) { return static_cast<float>((i % 1000) * (rank + 1) + rank); }

int Fail(const char* what, const gl::Status& s) {
  std::fprintf(stderr, "app: %s: %s\n", what, s.ToString().c_str());
  return 1;
}

int RunServer(const std::string& scheduler) {
  gl::ServerOptions o;
  if (gl::Status s = gl::ApplyEnvironment(&o); !s.ok()) return Fail("server environment", s);
  o.scheduler = scheduler;
  auto server = gl::Server::Start(o);
  if (!server.ok()) return Fail("Server::Start", server.status());
  gl::Status s = (*server)->Wait(In(60));
  const gl::ServerStats stats = (*server)->stats();
  (*server)->Stop();
  if (!s.ok()) return Fail("server", s);
  std::printf("app: server %u summed %llu bytes in %llu rounds\n", (*server)->id(),
              static_cast<unsigned long long>(stats.bytes_reduced),
              static_cast<unsigned long long>(stats.rounds_completed));
  return stats.rounds_completed > 0 ? 0 : 1;
}

int RunWorker(const std::string& scheduler) {
  gl::WorkerOptions o;
  if (gl::Status s = gl::ApplyEnvironment(&o); !s.ok()) return Fail("worker environment", s);
  o.scheduler = scheduler;
  o.local_arena_bytes = 0;  // through the server, not the same-host path
  auto worker = gl::Worker::Connect(o);
  if (!worker.ok()) return Fail("Worker::Connect", worker.status());
  gl::Worker& w = **worker;
  auto t = w.Declare("consumer.grad", gl::DataType::kFloat32, kCount);
  if (!t.ok()) return Fail("Declare", t.status());
  std::vector<float> data(kCount);
  for (uint64_t i = 0; i < kCount; ++i) data[i] = Input(w.rank(), i);
  gl::Status s = w.PushPull(*t, std::as_writable_bytes(std::span(data))).Wait(In(60));
  if (!s.ok()) return Fail("PushPull", s);
  uint64_t wrong = 0;
  for (uint64_t i = 0; i < kCount; ++i) {
    float expected = 0;
    for (uint32_t r = 0; r < w.size(); ++r) expected += Input(r, i);
    if (data[i] != expected) {
      if (wrong++ < 3) {
        std::fprintf(stderr, "app: worker %u: element %llu is %g, expected %g\n", w.rank(),
                     static_cast<unsigned long long>(i), data[i], expected);
      }
    }
  }
  if (gl::Status st = w.Shutdown(In(30)); !st.ok()) return Fail("Shutdown", st);
  std::printf("app: worker %u of %u: %llu sums of %llu %s\n", w.rank(), w.size(),
              static_cast<unsigned long long>(kCount - wrong),
              static_cast<unsigned long long>(kCount), wrong ? "right (WRONG ones above)" : "right");
  return wrong == 0 ? 0 : 1;
}

pid_t Spawn(const char* self, const char* role, const std::string& scheduler) {
  const pid_t pid = fork();
  if (pid == 0) {
    execl(self, self, role, scheduler.c_str(), static_cast<char*>(nullptr));
    std::perror("app: exec");
    _exit(127);
  }
  return pid;
}

int RunJob() {
  gl::SchedulerOptions so;
  so.num_workers = kWorkers;
  so.num_servers = 1;
  so.job = "consumer";
  so.secret = gl::GenerateSecret();
  // For the members (set before the scheduler's threads start).
  ::setenv("GRADLINK_SECRET", so.secret->c_str(), 1);
  ::setenv("GRADLINK_JOB", so.job.c_str(), 1);
  auto scheduler = gl::Scheduler::Start(so);
  if (!scheduler.ok()) return Fail("Scheduler::Start", scheduler.status());
  const std::string address = "127.0.0.1:" + std::to_string((*scheduler)->port());
  std::vector<pid_t> children = {Spawn("/proc/self/exe", "server", address)};
  for (uint32_t w = 0; w < kWorkers; ++w) children.push_back(Spawn("/proc/self/exe", "worker", address));
  int failed = 0;
  for (pid_t pid : children) {
    int status = 0;
    waitpid(pid, &status, 0);
    if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) ++failed;
  }
  gl::Status s = (*scheduler)->Wait(In(10));
  (*scheduler)->Stop();
  if (!s.ok()) return Fail("job", s);
  if (failed) {
    std::fprintf(stderr, "app: %d of %zu processes failed\n", failed, children.size());
    return 1;
  }
  std::printf("app: OK: 1 scheduler, 1 server, %u workers through libgradlink\n", kWorkers);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc == 3 && std::strcmp(argv[1], "server") == 0) return RunServer(argv[2]);
  if (argc == 3 && std::strcmp(argv[1], "worker") == 0) return RunWorker(argv[2]);
  if (argc == 1) return RunJob();
  std::fprintf(stderr, "usage: app [server|worker HOST:PORT]\n");
  return 2;
}
