#include "server/thread_plan.h"

#include <algorithm>

#include "common/cpus.h"

namespace gradlink::server {

Result<ThreadPlan> PlanThreads(const ThreadInputs& in) {
  const uint32_t lanes = std::max<uint32_t>(in.lanes, 1);
  ThreadPlan plan;
  std::string cpus;
  if (!in.pinned.empty()) {
    std::vector<uint32_t> foreign;
    for (uint32_t c : in.pinned) {
      if (!std::binary_search(in.allowed.begin(), in.allowed.end(), c)) foreign.push_back(c);
    }
    if (!foreign.empty()) {
      return InvalidArgument("server CPUs " + FormatCpuList(in.pinned) + ": CPU(s) " +
                             FormatCpuList(foreign) + " are not among those this process may " +
                             "run on (" + FormatCpuList(in.allowed) + ")");
    }
    plan.share = static_cast<uint32_t>(in.pinned.size());
    cpus = "pinned to CPUs " + FormatCpuList(in.pinned);
  } else {
    const uint32_t allowed = static_cast<uint32_t>(std::max<size_t>(in.allowed.size(), 1));
    const uint32_t sharers = in.workers_here > 0 ? in.servers_here + in.workers_here
                                                 : std::max<uint32_t>(in.servers_here, 1);
    plan.share = std::max<uint32_t>(allowed / sharers, 1);
    cpus = std::to_string(allowed) + " CPUs";
    if (sharers > 1) {
      cpus += " shared by " + std::to_string(sharers) + " processes of the job on this machine (" +
              std::to_string(in.servers_here) + " server(s), " +
              std::to_string(in.workers_here) + " worker(s))";
    }
    cpus += ", not pinned";
  }
  if (in.engines != 0) {
    plan.engines = in.engines;
    plan.why = std::to_string(plan.engines) + " engine thread(s) as set; " + cpus;
  } else {
    plan.engines = std::clamp<uint32_t>(plan.share > lanes ? plan.share - lanes : 1, 1,
                                        kMaxAutoEngines);
    plan.why = std::to_string(plan.engines) + " engine thread(s) for a share of " +
               std::to_string(plan.share) + " CPU(s) less " + std::to_string(lanes) +
               " lane thread(s); " + cpus;
  }
  if (!in.pinned.empty()) {
    const auto& c = in.pinned;
    for (uint32_t i = 0; i < lanes; ++i) plan.lane_cpu.push_back(c[i % c.size()]);
    // The CPUs after the lanes' when there are any; with as few CPUs as lanes, all of them.
    const size_t first = c.size() > lanes ? lanes : 0;
    for (uint32_t e = 0; e < plan.engines; ++e) {
      plan.engine_cpu.push_back(c[first + e % (c.size() - first)]);
    }
  }
  return plan;
}

}  // namespace gradlink::server
