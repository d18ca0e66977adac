// Which workers share a host, and who pushes what when they sum among themselves first
// (hierarchical aggregation). One rule, from the job's address book, so that the scheduler
// (which admits each key's server memory), every server (which waits for one push per host)
// and every worker (which pushes its host's share) reach the same answer without a message.
//
// Hosts are the machines of the address book (MachineOf: the host name and network namespace,
// or GRADLINK_HOST), numbered by their lowest rank; a worker's local rank is its place among
// its host's workers, in rank order. A job is hierarchical when its workers span several hosts
// and some host has more than one. Then partition p of a key is pushed, for each host, by that
// host's local worker (p + key) mod L (L: the host's workers), carrying the host's partial sum
// (its workers in local-rank order); servers sum the hosts' partials in host order.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "gradlink/tensor.h"
#include "wire/messages.h"

namespace gradlink::topology {

// How a key is aggregated: a DeclareMsg / AssignMsg byte.
enum class Mode : uint8_t {
  kFlat = 0,          // every worker pushes every partition (servers sum ranks in rank order)
  kHostPartials = 1,  // hosts sum first; 16-bit tensors' host partials in fp32 (one rounding)
  kHalfPartials = 2,  // hosts sum first; 16-bit host partials in their own dtype (two roundings)
};
bool IsValidMode(uint8_t m);

struct Hosts {
  uint32_t workers = 0;
  std::vector<uint32_t> host_of;                // per rank
  std::vector<uint32_t> local_rank;             // per rank
  std::vector<std::vector<uint32_t>> ranks_on;  // per host, its ranks in rank order
  std::vector<std::string> machine;             // per host

  uint32_t hosts() const { return static_cast<uint32_t>(ranks_on.size()); }
  // Several hosts, one of them with several workers.
  bool hierarchical() const;
};

// The hosts of a welcome's workers (servers are not counted).
Hosts Of(const wire::WelcomeMsg& book);

// The rank that pushes partition `part` of `key` for host `host`.
uint32_t Pusher(const Hosts& h, uint32_t host, uint64_t key, uint32_t part);

// The ranks whose pushes a server sums for partition `part` of `key`, in the order it sums
// them: every rank under kFlat; one per host, hosts in order, otherwise.
std::vector<uint32_t> Contributors(const Hosts& h, Mode mode, uint64_t key, uint32_t part);

// The dtype of what travels for a key of `dtype` in `mode`: fp32 for a 16-bit tensor's host
// partials (kHostPartials), the tensor's own otherwise.
DataType WireType(DataType dtype, Mode mode);

}  // namespace gradlink::topology
