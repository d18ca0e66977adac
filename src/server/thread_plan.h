// How many engine threads a server runs, and where its threads run when it is pinned.
//
// A server has its lanes' progress threads (push and pull: 2, or 1 with single_lane), which
// receive pushes and send sums, and engine threads, which sum (sharded by partition). Its CPUs
// are the list it is pinned to (ServerOptions::cpus), else the CPUs the process may run on,
// shared by the job's processes on this machine: with workers here (colocated, BytePS's mixed
// placement) each process of the job here gets an equal share; with servers only, each server
// does. Engines get the share less the lanes, at least 1 and at most kMaxAutoEngines; an engine
// count the user sets wins. Pinned, each lane gets one CPU of the list and the engines the
// CPUs after them, round robin (with fewer CPUs than threads, they share). The rule and how to
// override it: docs/operations.md, "What gradlink tunes".
//
// Pure: no system calls (the server gives it AllowedCpus() and the address book's counts).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "gradlink/status.h"

namespace gradlink::server {

// Beyond this an engine more sums no faster: one core sums ~8 GB/s of fp32 pushes, so 16 keep
// up with 1 Tbit/s, more than the fabric delivers to one server.
inline constexpr uint32_t kMaxAutoEngines = 16;

struct ThreadInputs {
  uint32_t engines = 0;               // ServerOptions::engine_threads; 0: choose
  std::vector<uint32_t> pinned;       // ServerOptions::cpus parsed; empty: not pinned
  std::vector<uint32_t> allowed;      // the CPUs the process may run on (not empty)
  uint32_t lanes = 2;                 // 1 or 2
  uint32_t servers_here = 1;          // the job's servers on this machine, this one included
  uint32_t workers_here = 0;          // the job's workers on this machine
};

struct ThreadPlan {
  uint32_t engines = 1;
  uint32_t share = 1;                 // CPUs this server counts as its own
  std::vector<uint32_t> lane_cpu;     // per lane (push, then pull), when pinned
  std::vector<uint32_t> engine_cpu;   // per engine, when pinned
  std::string why;                    // one line for the log and ServerStats::threads
};

// kInvalidArgument when a pinned CPU is not one the process may run on (named).
Result<ThreadPlan> PlanThreads(const ThreadInputs& in);

}  // namespace gradlink::server
