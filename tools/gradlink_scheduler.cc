// gradlink-scheduler: the rendezvous and control process of one job.
#include <sys/resource.h>

#include <CLI/CLI.hpp>
#include <cstdio>

#include "gradlink/env.h"
#include "gradlink/scheduler.h"

int main(int argc, char** argv) {
  CLI::App app{"gradlink scheduler: rendezvous, address book, barriers and shutdown of one job"};
  gradlink::SchedulerOptions o;
  // The environment first (GRADLINK_JOB, the secret): the flags below override it.
  if (gradlink::Status env = gradlink::ApplyEnvironment(&o); !env.ok()) {
    std::fprintf(stderr, "gradlink-scheduler: %s\n", env.ToString().c_str());
    return 2;
  }
  int64_t join_timeout_ms = o.join_timeout.count();
  app.add_option("--host", o.host, "address to listen on")->capture_default_str();
  app.add_option("--port", o.port, "TCP port; 0 picks a free one (printed)")->capture_default_str();
  app.add_option("-w,--workers", o.num_workers, "number of workers")->required()->check(CLI::PositiveNumber);
  app.add_option("-s,--servers", o.num_servers, "number of servers")->required()->check(CLI::PositiveNumber);
  app.add_option("--job", o.job, "job name")->capture_default_str();
  app.add_option("--join-timeout-ms", join_timeout_ms, "time for every member to join")->capture_default_str();
  app.add_option("--metrics-port", o.metrics_port,
                 "serve /metrics and /targets on this port; 0: a free one (logged), -1: off "
                 "(default: $GRADLINK_METRICS_PORT, else 0)")
      ->check(CLI::Range(-1, 65535));
  double stall_check = o.stall_check.count() / 1000.0, stall_shutdown = o.stall_shutdown.count() / 1000.0;
  app.add_option("--stall-check-seconds", stall_check,
                 "log tensors some ranks submitted and others not for this long; 0: off "
                 "(default: $GRADLINK_STALL_CHECK_SECONDS, else 60)")
      ->check(CLI::Range(0.0, 1e9));
  app.add_option("--stall-shutdown-seconds", stall_shutdown,
                 "end the job when such a stall lasts this long; 0: never "
                 "(default: $GRADLINK_STALL_SHUTDOWN_SECONDS, else 0)")
      ->check(CLI::Range(0.0, 1e9));
  std::string quota;
  app.add_option("--memory-quota", quota,
                 "most bytes of partition state the job's keys may hold on all its servers, "
                 "e.g. 4G; keys past it are refused (default: $GRADLINK_JOB_MEMORY, else none)");
  bool no_failover = false;
  app.add_flag("--no-failover", no_failover,
               "a lost server fails the job (default: its partitions move to the others)");
  CLI11_PARSE(app, argc, argv);
  o.server_failover = !no_failover;
  if (!quota.empty()) {
    gradlink::Result<uint64_t> q = gradlink::ParseByteCount("--memory-quota", quota);
    if (!q.ok()) {
      std::fprintf(stderr, "gradlink-scheduler: %s\n", q.status().ToString().c_str());
      return 2;
    }
    o.memory_quota_bytes = *q;
  }
  o.stall_check = std::chrono::milliseconds(static_cast<int64_t>(stall_check * 1000));
  o.stall_shutdown = std::chrono::milliseconds(static_cast<int64_t>(stall_shutdown * 1000));
  // One socket per member (thousands of them) plus strangers' connections: the soft limit of
  // open files is often 1024; take what the hard limit allows.
  rlimit nofile{};
  if (::getrlimit(RLIMIT_NOFILE, &nofile) == 0 && nofile.rlim_cur < nofile.rlim_max) {
    nofile.rlim_cur = nofile.rlim_max;
    ::setrlimit(RLIMIT_NOFILE, &nofile);
  }
  o.join_timeout = std::chrono::milliseconds(join_timeout_ms);

  auto s = gradlink::Scheduler::Start(o);
  if (!s.ok()) {
    std::fprintf(stderr, "gradlink-scheduler: %s\n", s.status().ToString().c_str());
    return 2;
  }
  std::printf("gradlink-scheduler listening on %s:%u\n", o.host.c_str(), (*s)->port());
  std::fflush(stdout);
  gradlink::Status st = (*s)->Wait(std::chrono::steady_clock::time_point::max());
  (*s)->Stop();
  if (!st.ok()) {
    std::fprintf(stderr, "gradlink-scheduler: job failed: %s\n", st.ToString().c_str());
    return 1;
  }
  return 0;
}
