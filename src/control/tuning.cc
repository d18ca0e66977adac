// src/control/tuning.h: the rule behind gradlink's defaults.
#include "control/tuning.h"

#include <algorithm>
#include <bit>

#include "common/naming.h"

namespace gradlink::tuning {
namespace {

// One machine: the bytes move through memory, and the cost to cut is per message (a partition
// is a send, a receive and a summing task): few, large partitions, a window of 8 of them, and 8
// ahead per server. No shared link makes flows drift apart there; the lead bounds what a
// server holds when one worker runs ahead (its pushes wait in staging for the other's): a
// 32 MiB lead ran as fast as none (gradlink-bench, 2 workers, 64 and 256 MiB, servers' path:
// 80-89 against 85-95 ms and 328-330 against 335-342 ms). bench/RESULTS.md: 4 MiB.
constexpr uint64_t kOneMachinePartition = 4u << 20;
// A network: a server answers a partition once all n workers' pushes of it are in, so the flows
// into it must stay in step, and the pipeline's start (the first sums wait for n partitions)
// and end (the last window drains) cost about a partition each way: small partitions, few of
// them ahead per server. 64 KiB partitions, 2 ahead per server and a 1 MiB window were within
// 1.1% of the best point of the tuned grid (P 64K/128K/1M x lead 128K/256K/512K) in all 22
// cells measured: 9 shapes from (2,1) to (6,3) and mixed placement, 1 Gbit/s and 500 Mbit/s,
// 4-64 MiB (bench/RESULTS.md, "Defaults against the hand-tuned grid").
constexpr uint64_t kNetworkPartition = 64u << 10;
constexpr uint64_t kOneMachineInFlight = 8;   // partitions per worker
constexpr uint64_t kNetworkInFlight = 16;     // partitions per worker, at least
constexpr uint64_t kPartitionsAhead = 2;      // per server an op spans, network
constexpr uint64_t kOneMachineAhead = 8;      // per server an op spans, one machine

// a x b, saturating (a partition set near 2^46 bytes must not wrap the window to a small one).
uint64_t Times(uint64_t a, uint64_t b) {
  return b != 0 && a > UINT64_MAX / b ? UINT64_MAX : a * b;
}

}  // namespace

Choice Choose(const wire::WelcomeMsg& book, std::optional<uint64_t> partition) {
  Choice c;
  c.workers = book.num_workers;
  c.servers = book.num_servers;
  const std::string_view* machine = nullptr;
  std::string_view first;
  bool one = true;
  for (const wire::Member& m : book.members) {
    const std::string_view here = MachineOf(m.host);
    if (machine == nullptr) {
      first = here;
      machine = &first;
    }
    one = one && here == *machine;
  }
  c.fabric = one ? Fabric::kOneMachine : Fabric::kNetwork;
  if (c.fabric == Fabric::kOneMachine) {
    c.partition_bytes = partition.value_or(kOneMachinePartition);
    c.max_bytes_in_flight = Times(c.partition_bytes, kOneMachineInFlight);
    c.max_bytes_ahead = Times(c.partition_bytes, kOneMachineAhead);
    c.why = "every member on machine " + std::string(first) + ": large partitions, " +
            std::to_string(kOneMachineAhead) + " ahead per server";
  } else {
    c.partition_bytes = partition.value_or(kNetworkPartition);
    // Enough in flight for every server's lead, so the window never binds before the leads do.
    c.max_bytes_in_flight = Times(
        c.partition_bytes, std::max<uint64_t>(kNetworkInFlight, kPartitionsAhead * c.servers));
    c.max_bytes_ahead = Times(c.partition_bytes, kPartitionsAhead);
    c.why = std::to_string(c.workers) + " workers and " + std::to_string(c.servers) +
            " servers over a network: small partitions, " + std::to_string(kPartitionsAhead) +
            " ahead per server";
  }
  if (partition) c.why += " (for the " + std::to_string(*partition) + "-byte partitions set)";
  return c;
}

uint64_t KeyPartitionBytes(const Choice& c, uint64_t tensor_bytes, uint32_t servers) {
  const uint64_t s = std::max<uint32_t>(servers, 1);
  const uint64_t share = tensor_bytes / s + (tensor_bytes % s != 0);
  if (share >= c.partition_bytes) return c.partition_bytes;
  return std::max(kMinPartitionBytes, std::bit_ceil(share));
}

}  // namespace gradlink::tuning
