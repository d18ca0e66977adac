// kAssign: the partitions of a key this server sums, as the scheduler planned them (control/
// layout.h), made here before the ack lets any worker push them; or taken over from a lost
// server (kFlagReplan: the workers then say where its rounds stand, PartitionState::Adopt).
// Control thread only; partitions are added under parts_mu_, and erased only when every worker
// has retired their key (kRetire: OnRetire), then deleted some seconds later (FreeRetired).
#include "common/naming.h"
#include "control/layout.h"
#include "server/server_impl.h"

namespace gradlink {

Status ServerImpl::OnAssign(const transport::Frame& f) {
  if (f.header.code != 0 || !IsValidDataType(f.header.dtype)) {
    return ProtocolError("bad kAssign from the scheduler");
  }
  GL_ASSIGN_OR_RETURN(wire::AssignMsg a,
                      wire::DecodeAssign(f.payload, f.header.count, UINT32_MAX));
  const auto mode = static_cast<topology::Mode>(a.mode);
  if (mode != topology::Mode::kFlat && !hosts_.hierarchical()) {
    return ProtocolError("kAssign of a hierarchical key in a job whose workers do not share hosts");
  }
  if (mode != topology::Mode::kFlat && !a.spec.is_sum()) {
    return ProtocolError("kAssign of a hierarchical " + DescribeSpec(a.spec));
  }
  const uint32_t workers = num_workers_;
  GL_RETURN_IF_ERROR(layout::CheckPlan(a.spec, workers, f.header.count, a.partitions));
  const std::vector<layout::Segment> segments = layout::Segments(a.spec, workers, f.header.count);
  const bool copy = a.spec.kind == Collective::kBroadcast ||
                    a.spec.kind == Collective::kAllgather || a.spec.kind == Collective::kAlltoall;
  // What travels: the tensor's dtype, or fp32 for a 16-bit tensor's host partials.
  const DataType dtype = topology::WireType(static_cast<DataType>(f.header.dtype), mode);
  {
    MutexLock lock(parts_mu_);
    for (uint32_t p = 0; p < a.partitions.size(); ++p) {
      if (a.partitions[p].server != id_) continue;
      const layout::Peers peers =
          layout::PeersOf(a.spec, segments[layout::SegmentAt(segments, a.partitions[p].offset)],
                          workers);
      if (peers.local_only()) continue;  // its worker copies it: no push ever comes
      auto& slot = parts_[{f.header.key, p}];
      if (slot && (slot->count() != a.partitions[p].count || slot->name() != a.name ||
                   slot->dtype() != dtype)) {
        // Restart: a plan no worker received (the scheduler died before it was acked by
        // every server), planned again differently. No push can have come for it.
        if (slot->round() != 0 || slot->bytes_held() != 0) {
          return ProtocolError("kAssign of '" + a.name + "' partition " + std::to_string(p) +
                               " unlike the one this server sums");
        }
        retired_.push_back(std::move(slot));  // posted closures may still point at it
      }
      const bool fresh = !slot;
      if (!slot) {
        if (a.spec.is_sum()) {
          slot = std::make_unique<PartitionState>(
              f.header.key, p, a.name, dtype, a.partitions[p].count,
              topology::Contributors(hosts_, mode, f.header.key, p), workers,
              mode == topology::Mode::kFlat ? std::vector<uint32_t>() : hosts_.host_of,
              server::Routing{}, &pool_);
        } else {
          server::Routing routing{a.spec.op, copy, peers.requesters, peers.receives};
          // An average divides by the group's members (every worker without a group).
          slot = std::make_unique<PartitionState>(f.header.key, p, a.name, dtype,
                                                  a.partitions[p].count, peers.contributors,
                                                  layout::Members(a.spec, workers),
                                                  std::vector<uint32_t>(), std::move(routing),
                                                  &pool_);
        }
      }
      // No push can come before the ack below: this thread is still its only user.
      if (fresh) {
        for (uint32_t rank : joined_) slot->SetJoined(rank, true);
        // Taken over from a lost server: the workers say where its rounds stand.
        if (f.header.flags & wire::kFlagReplan) {
          slot->Adopt();
          partitions_adopted_++;
        }
      }
    }
  }
  return Status::Ok();
}

void ServerImpl::OnRetire(uint64_t key) {
  const auto now = transport::Clock::now();
  MutexLock lock(parts_mu_);
  auto it = parts_.lower_bound({key, 0});
  bool any = false;
  while (it != parts_.end() && it->first.first == key) {
    retiring_.push_back(Retiring{std::move(it->second), now});
    it = parts_.erase(it);
    any = true;
  }
  if (any) keys_retired_++;
}

void ServerImpl::FreeRetired() {
  const auto now = transport::Clock::now();
  MutexLock lock(parts_mu_);
  std::erase_if(retiring_, [&](const Retiring& r) {
    return now - r.since >= kRetiredGrace && r.part->bytes_held() == 0;
  });
}

}  // namespace gradlink
