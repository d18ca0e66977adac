// gradlink-server: an aggregation server; joins a job through its scheduler.
#include <CLI/CLI.hpp>
#include <cstdio>

#include "gradlink/env.h"
#include "gradlink/server.h"

int main(int argc, char** argv) {
  CLI::App app{"gradlink aggregation server: sums the workers' pushes and answers their pulls"};
  gradlink::ServerOptions o;
  // The environment first (GRADLINK_SCHEDULER, GRADLINK_JOB, GRADLINK_SERVER_WEIGHT, the
  // secret): the flags below override it.
  if (gradlink::Status env = gradlink::ApplyEnvironment(&o); !env.ok()) {
    std::fprintf(stderr, "gradlink-server: %s\n", env.ToString().c_str());
    return 2;
  }
  app.add_option("--scheduler", o.scheduler, "scheduler host:port (default: $GRADLINK_SCHEDULER)");
  app.add_option("--job", o.job, "job name (default: $GRADLINK_JOB or 'default')");
  app.add_option("--id", o.id,
                 "server id to claim, 0..servers-1 (default: $GRADLINK_SERVER_ID, else the "
                 "scheduler assigns one)")
      ->check(CLI::Range(-1, 1 << 30));
  app.add_option("--engine-threads", o.engine_threads,
                 "summing threads; 0: chosen from the server's CPUs less its lane threads "
                 "(default: $GRADLINK_SERVER_ENGINES, else 0)")
      ->check(CLI::Range(0, 1024));
  app.add_option("--cpus", o.cpus,
                 "pin the server's threads to these CPUs, e.g. 0-3,8: a lane thread on each of "
                 "the first, the engines round robin over the rest (default: $GRADLINK_SERVER_CPUS, "
                 "else not pinned)");
  app.add_option("--weight", o.weight,
                 "placement weight: this server gets about weight/(sum of all servers' weights) "
                 "of the bytes; in [1e-6, 1e6] (default: $GRADLINK_SERVER_WEIGHT or 1)")
      ->capture_default_str();
  std::string budget;
  app.add_option("--memory-budget", budget,
                 "most bytes of partition state this server holds, e.g. 8G; keys that would "
                 "exceed it are refused (default: $GRADLINK_SERVER_MEMORY, else 3/4 of the "
                 "available memory shared by this host's servers)");
  app.add_flag("--standby", o.standby,
               "join as a standby: take no partitions until a server is lost, then take over "
               "its partitions (a server that joins a running job is one anyway); claim an id of "
               "the scheduler's server count or more, or none");
  app.add_option("--metrics-port", o.metrics_port,
                 "serve /metrics on this port; 0: a free one (logged), -1: off "
                 "(default: $GRADLINK_METRICS_PORT, else 0)")
      ->check(CLI::Range(-1, 65535));
  app.add_flag("--single-lane", o.single_lane, "answer pulls on the push lane (comparison mode)");
  CLI11_PARSE(app, argc, argv);
  if (!budget.empty()) {
    gradlink::Result<uint64_t> b = gradlink::ParseByteCount("--memory-budget", budget);
    if (!b.ok()) {
      std::fprintf(stderr, "gradlink-server: %s\n", b.status().ToString().c_str());
      return 2;
    }
    o.memory_budget_bytes = *b;
  }
  if (o.scheduler.empty()) {
    std::fprintf(stderr, "gradlink-server: no scheduler: pass --scheduler host:port or set GRADLINK_SCHEDULER\n");
    return 2;
  }
  auto s = gradlink::Server::Start(o);
  if (!s.ok()) {
    std::fprintf(stderr, "gradlink-server: %s\n", s.status().ToString().c_str());
    return 2;
  }
  gradlink::Status st = (*s)->Wait(std::chrono::steady_clock::time_point::max());
  const gradlink::ServerStats stats = (*s)->stats();
  (*s)->Stop();
  if (!st.ok()) {
    std::fprintf(stderr, "gradlink-server %u: %s\n", (*s)->id(), st.ToString().c_str());
    return 1;
  }
  if (stats.protocol_errors != 0) {
    std::fprintf(stderr, "gradlink-server %u: %llu protocol errors\n", (*s)->id(),
                 static_cast<unsigned long long>(stats.protocol_errors));
  }
  return 0;
}
