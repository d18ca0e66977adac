// src/control/topology.h: hosts from the address book, and who pushes a partition.
#include "control/topology.h"

#include <map>

#include "common/naming.h"

namespace gradlink::topology {

bool IsValidMode(uint8_t m) { return m <= static_cast<uint8_t>(Mode::kHalfPartials); }

bool Hosts::hierarchical() const {
  if (ranks_on.size() < 2) return false;
  for (const auto& r : ranks_on) {
    if (r.size() > 1) return true;
  }
  return false;
}

Hosts Of(const wire::WelcomeMsg& book) {
  Hosts h;
  h.workers = book.num_workers;
  std::vector<std::string_view> machine_of(book.num_workers);
  for (const wire::Member& m : book.members) {
    if (m.role != wire::Role::kWorker || m.id >= book.num_workers) continue;
    machine_of[m.id] = MachineOf(m.host);
  }
  h.host_of.assign(book.num_workers, 0);
  h.local_rank.assign(book.num_workers, 0);
  std::map<std::string_view, uint32_t> index;
  for (uint32_t r = 0; r < book.num_workers; ++r) {
    auto [it, fresh] = index.try_emplace(machine_of[r], static_cast<uint32_t>(h.ranks_on.size()));
    if (fresh) {
      h.ranks_on.emplace_back();
      h.machine.emplace_back(machine_of[r]);
    }
    h.host_of[r] = it->second;
    h.local_rank[r] = static_cast<uint32_t>(h.ranks_on[it->second].size());
    h.ranks_on[it->second].push_back(r);
  }
  return h;
}

uint32_t Pusher(const Hosts& h, uint32_t host, uint64_t key, uint32_t part) {
  const auto& ranks = h.ranks_on[host];
  // The key's share of the offset spreads small tensors (one partition each) over the host's
  // workers instead of giving them all to local rank 0.
  return ranks[(part + key % 65521) % ranks.size()];
}

std::vector<uint32_t> Contributors(const Hosts& h, Mode mode, uint64_t key, uint32_t part) {
  std::vector<uint32_t> out;
  if (mode == Mode::kFlat) {
    out.resize(h.workers);
    for (uint32_t r = 0; r < h.workers; ++r) out[r] = r;
    return out;
  }
  out.reserve(h.hosts());
  for (uint32_t host = 0; host < h.hosts(); ++host) out.push_back(Pusher(h, host, key, part));
  return out;
}

DataType WireType(DataType dtype, Mode mode) {
  const bool half = dtype == DataType::kFloat16 || dtype == DataType::kBFloat16;
  return half && mode == Mode::kHostPartials ? DataType::kFloat32 : dtype;
}

}  // namespace gradlink::topology
