// A key's plan (scheduler_impl.h): the workers' declarations compared, the key cut into
// partitions and placed, admitted against the servers' memory budgets, sent to the servers, and
// handed to the workers once every server has acked it. Runs on the loop thread.
#include <algorithm>
#include <string>

#include "common/log.h"
#include "common/naming.h"
#include "control/layout.h"
#include "reduce/reduce.h"
#include "scheduler/scheduler_impl.h"

namespace gradlink::scheduler {

using transport::Frame;
using wire::MsgType;
using wire::Role;

Status SchedulerImpl::OnDeclare(Connection& c, const Frame& f) {
  if (c.role != Role::kWorker || !started_) return ProtocolError("unexpected kDeclare");
  GL_ASSIGN_OR_RETURN(wire::DeclareMsg d, wire::DecodeDeclare(f.payload));
  const wire::Header& h = f.header;
  if (!IsValidDataType(h.dtype)) return ProtocolError("kDeclare with an invalid dtype");
  if (wire::TensorKey(opts_.job, d.name) != h.key) {
    return ProtocolError("kDeclare key does not match the name '" + d.name + "'");
  }
  if (!d.shape.empty() && ShapeElements(d.shape) != h.count) {
    return ProtocolError("kDeclare of '" + d.name + "': shape " + FormatShape(d.shape) +
                         " does not hold " + std::to_string(h.count) + " elements");
  }
  Declaration& decl = decls_[h.key];
  if (decl.by_rank.count(c.id) != 0) return ProtocolError("key declared twice by one worker");
  if (decl.planned && decl.joined_at_plan.erase(c.id) != 0) {
    // Planned while this rank had joined: it gets the plan if it declared what the others did.
    const auto& [h0, d0] = decl.by_rank.begin()->second;
    if (decl.status.ok() && (h.dtype != h0.dtype || h.count != h0.count || d.spec != d0.spec ||
                             d.partition_bytes != d0.partition_bytes ||
                             (!d.shape.empty() && !d0.shape.empty() && d.shape != d0.shape))) {
      wire::Header refusal = MakeHeader(MsgType::kAssign);
      refusal.key = h.key;
      refusal.code = static_cast<uint8_t>(Code::kMismatch);
      const std::string why =
          "key " + KeyHex(h.key) + " '" + d.name + "': rank " + std::to_string(c.id) +
          " declared " + std::string(DataTypeName(static_cast<DataType>(h.dtype))) + "[" +
          std::to_string(h.count) + "]" + ShapeSuffix(d.shape) + " for " + DescribeSpec(d.spec) +
          " after rank " + std::to_string(decl.by_rank.begin()->first) + " and the others had " +
          "declared " + std::string(DataTypeName(decl.dtype)) + "[" + std::to_string(decl.count) +
          "]" + ShapeSuffix(d0.shape) + " for " + DescribeSpec(decl.spec) +
          " while it had joined";
      GL_LOG(kWarn) << "scheduler: kMismatch: " << why;
      c.link.Send(refusal, {}, Share(wire::EncodeText(why)), Clock::now());
      return Status::Ok();
    }
    decl.by_rank[c.id] = {h, std::move(d)};
    // A refusal, or a plan every server has: at once; else with the others' at the last ack.
    if (!decl.status.ok() || AckedByAll(decl)) {
      c.link.Send(decl.assign_header, {}, decl.assign_payload, Clock::now());
    }
    return Status::Ok();
  }
  if (decl.planned && !decl.status.ok()) {
    // Refused (the ranks disagreed, or it cannot run while a rank has joined): a worker that
    // declares it late gets the same refusal, and is not one of its declarers (its kRetire is
    // not waited for).
    c.link.Send(decl.assign_header, {}, decl.assign_payload, Clock::now());
    return Status::Ok();
  }
  if (decl.planned) {
    // Only a worker outside the key's group declares it now (every member had, or the key
    // would not be planned): its plan is a refusal naming the group.
    wire::Header refusal = MakeHeader(MsgType::kAssign);
    refusal.key = h.key;
    refusal.code = static_cast<uint8_t>(Code::kMismatch);
    const std::string why = "key " + KeyHex(h.key) + " '" + d.name + "': rank " +
                            std::to_string(c.id) + " declared it after the ranks of its " +
                            DescribeSpec(decl.spec) + " had; rank " + std::to_string(c.id) +
                            " declared " + DescribeSpec(d.spec);
    GL_LOG(kWarn) << "scheduler: kMismatch: " << why;
    c.link.Send(refusal, {}, Share(wire::EncodeText(why)), Clock::now());
    return Status::Ok();
  }
  // A key of a group is planned once the group's workers have declared it (the first
  // declaration names the group; one that names another is a mismatch in Plan).
  const CollectiveSpec first = decl.by_rank.empty() ? d.spec : decl.by_rank.begin()->second.second.spec;
  if (decl.by_rank.empty()) decl.first_declared = Clock::now();
  decl.by_rank[c.id] = {h, std::move(d)};
  // A group that cannot be (ranks out of range) is refused at once: Plan names it.
  if (layout::GroupIsValid(first, opts_.num_workers) && !ReadyToPlan(decl, first) &&
      !CannotRunWhileJoined(first)) {
    return Status::Ok();
  }
  return Plan(h.key, decl);
}

bool SchedulerImpl::CannotRunWhileJoined(const CollectiveSpec& spec) const {
  if (spec.is_sum()) return false;
  for (uint32_t rank : joined_) {
    if (layout::PositionOf(spec, rank) >= 0) return true;
  }
  return false;
}

bool SchedulerImpl::ReadyToPlan(const Declaration& decl, const CollectiveSpec& spec) const {
  const uint32_t members = layout::Members(spec, opts_.num_workers);
  uint32_t accounted = static_cast<uint32_t>(decl.by_rank.size());
  for (uint32_t rank : joined_) {
    if (layout::PositionOf(spec, rank) >= 0 && decl.by_rank.count(rank) == 0) ++accounted;
  }
  return accounted >= members;
}

namespace {

std::string ModeText(uint8_t mode) {
  return mode == static_cast<uint8_t>(topology::Mode::kHalfPartials)
             ? " and 16-bit host partials"
             : " and fp32 host partials";
}

std::string PartitionsText(uint64_t declared) {
  return declared == 0 ? std::string("the partitions gradlink chooses")
                       : std::to_string(declared) + "-byte partitions";
}

}  // namespace

Status SchedulerImpl::Plan(uint64_t key, Declaration& decl) {
  ++keys_planned_;
  const auto& [h0, d0] = decl.by_rank.begin()->second;
  decl.name = d0.name;
  decl.dtype = static_cast<DataType>(h0.dtype);
  decl.count = h0.count;
  // Hierarchical only if every worker's host can sum the key (each bound it to its segment)
  // and all ask for the same partials; a worker that cannot (or was told not to) makes the
  // key flat for every worker. Two hierarchical modes that differ are a mismatch below.
  decl.mode = static_cast<topology::Mode>(d0.mode);
  decl.spec = d0.spec;
  bool modes_differ = false;
  for (const auto& [rank, hd] : decl.by_rank) {
    const auto m = static_cast<topology::Mode>(hd.second.mode);
    if (m == topology::Mode::kFlat) decl.mode = topology::Mode::kFlat;
    if (m != topology::Mode::kFlat && m != static_cast<topology::Mode>(d0.mode)) modes_differ = true;
  }
  // Hosts sum first only for sums: a host stage has no min, max or routing. Nor for a key
  // planned without a rank that has joined (Worker::Join): it has no host channel for it, and
  // may be the one to push some of its host's partitions.
  if (!hosts_.hierarchical() || !decl.spec.is_sum() ||
      decl.by_rank.size() < opts_.num_workers) {
    decl.mode = topology::Mode::kFlat;
  }
  if (decl.mode == topology::Mode::kFlat) modes_differ = false;
  // Partitions are cut in what travels (fp32 for a 16-bit tensor's host partials), so that the
  // tuned partition size is the bytes on the wire.
  const DataType wire_type = topology::WireType(decl.dtype, decl.mode);
  // 0 from every worker: the job's choice, cut to this key (every worker sent the same, or
  // the declarations disagree below, naming what each gave).
  const uint64_t elem = DataTypeSize(wire_type);
  const uint64_t tensor_bytes = elem != 0 && h0.count > UINT64_MAX / elem ? UINT64_MAX : h0.count * elem;
  decl.partition_bytes = d0.partition_bytes != 0
                             ? d0.partition_bytes
                             : tuning::KeyPartitionBytes(tuning_, tensor_bytes, opts_.num_servers);
  // Shapes: every rank that gave one must give the same (a rank that gave none agrees with
  // any); the first one given is the reference the others are named against.
  const std::vector<uint64_t>* shape0 = nullptr;
  for (const auto& [rank, hd] : decl.by_rank) {
    if (!hd.second.shape.empty()) {
      shape0 = &hd.second.shape;
      break;
    }
  }
  std::string disagree;
  bool specs_differ = false;
  for (const auto& [rank, hd] : decl.by_rank) {
    const auto& [h, d] = hd;
    const bool shape_differs = shape0 != nullptr && !d.shape.empty() && d.shape != *shape0;
    const bool mode_differs = modes_differ && d.mode != d0.mode;
    const bool spec_differs = d.spec != d0.spec;
    if (h.dtype != h0.dtype || h.count != h0.count || d.partition_bytes != d0.partition_bytes ||
        d.name != d0.name || shape_differs || mode_differs || spec_differs) {
      disagree += (disagree.empty() ? "" : ", ") + std::string("rank ") + std::to_string(rank) +
                  (d.name != d0.name ? " declared name '" + d.name + "' as " : " declared ") +
                  std::string(DataTypeName(static_cast<DataType>(h.dtype))) + "[" +
                  std::to_string(h.count) + "]" + ShapeSuffix(d.shape) + " with " +
                  PartitionsText(d.partition_bytes) + (mode_differs ? ModeText(d.mode) : "") +
                  (spec_differs || !d0.spec.is_sum() ? " for " + DescribeSpec(d.spec) : "");
      if (spec_differs) specs_differ = true;
    }
  }
  decl.planned = true;
  std::string joined_ranks;
  for (uint32_t rank : joined_) {
    if (layout::PositionOf(d0.spec, rank) < 0 || decl.by_rank.count(rank) != 0) continue;
    decl.joined_at_plan.insert(rank);
    joined_ranks += (joined_ranks.empty() ? "" : ", ") + std::to_string(rank);
  }

  const std::string keyhex = KeyHex(key);
  const uint64_t per_part = std::max<uint64_t>(1, decl.partition_bytes / DataTypeSize(wire_type));
  if (disagree.empty()) decl.status = layout::Check(decl.spec, opts_.num_workers, decl.count);
  if (disagree.empty() && decl.status.ok() && !joined_ranks.empty() &&
      (!decl.spec.is_sum() || decl.mode != topology::Mode::kFlat)) {
    decl.status = InvalidArgument(DescribeSpec(decl.spec) + " while rank(s) " + joined_ranks +
                                  " have joined (join()): only sums and averages run then");
  }
  if (!decl.status.ok()) {
    decl.status = InvalidArgument("key " + keyhex + " '" + decl.name + "': " +
                                  decl.status.message());
  } else if (disagree.empty() && decl.count / per_part >= wire::kMaxPartitionsPerTensor) {
    decl.status = InvalidArgument(
        "key " + keyhex + " '" + decl.name + "': " + std::to_string(decl.count) +
        " elements in " + std::to_string(decl.partition_bytes) + "-byte partitions exceed " +
        std::to_string(wire::kMaxPartitionsPerTensor) + " partitions; use larger partitions");
  }
  if (!decl.status.ok() || !disagree.empty()) {
    const auto& first = decl.by_rank.begin();
    if (!disagree.empty()) {
      decl.status = Mismatch("key " + keyhex + " '" + decl.name + "': rank " +
                             std::to_string(first->first) + " declared " +
                             std::string(DataTypeName(decl.dtype)) + "[" +
                             std::to_string(decl.count) + "]" +
                             ShapeSuffix(first->second.second.shape) + " with " +
                             PartitionsText(d0.partition_bytes) +
                             (modes_differ ? ModeText(d0.mode) : "") +
                             (specs_differ || !d0.spec.is_sum()
                                  ? " for " + DescribeSpec(d0.spec)
                                  : std::string()) +
                             ", " + disagree);
    }
    RefuseKey(key, decl);
    return Status::Ok();
  }
  const Placer before = placer_;
  std::vector<wire::PartitionPlan> plan = PlanSegments(decl, wire_type);
  if (Status admitted = Admit(keyhex, decl, plan); !admitted.ok()) {
    placer_ = before;  // the refused key takes no room
    decl.status = std::move(admitted);
    RefuseKey(key, decl);
    return Status::Ok();
  }
  decl.plan = std::move(plan);
  decl.assign_header = MakeHeader(MsgType::kAssign);
  decl.assign_header.key = key;
  decl.assign_header.dtype = h0.dtype;
  decl.assign_header.count = decl.count;
  // Servers first: a worker may push as soon as it has the plan.
  SendPlanToServers(decl);
  return Status::Ok();
}

void SchedulerImpl::EncodePlan(Declaration& decl) {
  wire::AssignMsg a;
  a.name = decl.name;
  a.mode = static_cast<uint8_t>(decl.mode);
  a.spec = decl.spec;
  a.partitions = decl.plan;
  decl.assign_payload = Share(wire::Encode(a));
}

void SchedulerImpl::SendPlanToServers(Declaration& decl) {
  EncodePlan(decl);
  const auto now = Clock::now();
  decl.sent_to.clear();
  for (auto& [id, s] : servers_) {
    if (lost_servers_.count(id) != 0 || standby_.count(id) != 0) continue;
    s->link.Send(decl.assign_header, {}, decl.assign_payload, now);
    decl.sent_to.insert(id);
  }
}

void SchedulerImpl::RefuseKey(uint64_t key, Declaration& decl) {
  GL_LOG(kWarn) << "scheduler: " << decl.status.ToString();
  decl.assign_header = MakeHeader(MsgType::kAssign);
  decl.assign_header.key = key;
  decl.assign_header.code = static_cast<uint8_t>(decl.status.code());
  decl.assign_payload = Share(wire::EncodeText(decl.status.message()));
  SendToDeclarers(decl);
}

std::vector<wire::PartitionPlan> SchedulerImpl::PlanSegments(const Declaration& decl,
                                                              DataType wire_type) {
  // Each segment is cut on its own, so no partition straddles two (control/layout.h). One that
  // no server sees (nobody receives it) is one unplaced partition on server 0, costing nothing.
  std::vector<wire::PartitionPlan> plan;
  for (const layout::Segment& seg : layout::Segments(decl.spec, opts_.num_workers, decl.count)) {
    if (seg.count == 0) continue;
    if (layout::PeersOf(decl.spec, seg, opts_.num_workers).local_only()) {
      plan.push_back(wire::PartitionPlan{seg.offset, seg.count, 0});
      continue;
    }
    for (wire::PartitionPlan p : placer_.Plan(wire_type, seg.count, decl.partition_bytes)) {
      p.offset += seg.offset;
      plan.push_back(p);
    }
  }
  return plan;
}

std::vector<uint64_t> SchedulerImpl::HeldBy(const Declaration& decl,
                                            const std::vector<wire::PartitionPlan>& plan) const {
  std::vector<uint64_t> need(held_.size(), 0);
  const std::vector<layout::Segment> segments =
      layout::Segments(decl.spec, opts_.num_workers, decl.count);
  for (const wire::PartitionPlan& p : plan) {
    const layout::Peers peers =
        layout::PeersOf(decl.spec, segments[layout::SegmentAt(segments, p.offset)],
                        opts_.num_workers);
    if (peers.local_only()) continue;
    const uint32_t contributors =
        decl.mode != topology::Mode::kFlat ? hosts_.hosts()
                                           : static_cast<uint32_t>(peers.contributors.size());
    const uint64_t bytes = reduce::ServerBytesHeld(topology::WireType(decl.dtype, decl.mode),
                                                   p.count, contributors);
    if (p.server >= need.size()) continue;
    need[p.server] = bytes > UINT64_MAX - need[p.server] ? UINT64_MAX : need[p.server] + bytes;
  }
  return need;
}

Status SchedulerImpl::Admit(const std::string& keyhex, const Declaration& decl,
                            const std::vector<wire::PartitionPlan>& plan) {
  const std::vector<uint64_t> need = HeldBy(decl, plan);
  if (const uint64_t quota = opts_.memory_quota_bytes; quota != 0) {
    uint64_t needed = 0, held = 0;
    for (uint32_t s = 0; s < need.size(); ++s) {
      needed += need[s];
      held += held_[s];
    }
    if (needed > quota || held > quota - needed) {
      const uint64_t tensor_bytes = decl.count * DataTypeSize(decl.dtype);
      return ResourceExhausted(
          "key " + keyhex + " '" + decl.name + "': " + std::string(DataTypeName(decl.dtype)) +
          "[" + std::to_string(decl.count) + "] (" + std::to_string(tensor_bytes) +
          " bytes) needs " + std::to_string(needed) + " bytes of server memory, and job '" +
          opts_.job + "' holds " + std::to_string(held) + " bytes of its " +
          std::to_string(quota) + "-byte memory quota (GRADLINK_JOB_MEMORY, " +
          "gradlink-scheduler --memory-quota)");
    }
  }
  for (uint32_t s = 0; s < need.size(); ++s) {
    if (need[s] > budget_[s] || held_[s] > budget_[s] - need[s]) {
      const Connection& server = *servers_.at(s);
      const uint64_t tensor_bytes = decl.count * DataTypeSize(decl.dtype);
      return ResourceExhausted(
          "key " + keyhex + " '" + decl.name + "': " +
          std::string(DataTypeName(decl.dtype)) + "[" + std::to_string(decl.count) + "] (" +
          std::to_string(tensor_bytes) + " bytes) needs " + std::to_string(need[s]) +
          " bytes on " + MemberName(server) + ", which holds " + std::to_string(held_[s]) +
          " bytes of its " + std::to_string(budget_[s]) +
          "-byte memory budget (gradlink-server --memory-budget, GRADLINK_SERVER_MEMORY)");
    }
  }
  for (uint32_t s = 0; s < need.size(); ++s) held_[s] += need[s];
  return Status::Ok();
}

Status SchedulerImpl::OnAssignAck(Connection& c, const Frame& f) {
  if (c.role != Role::kServer) return ProtocolError("kAssignAck from a worker");
  auto it = decls_.find(f.header.key);
  if (it == decls_.end() && retired_keys_.count(f.header.key) != 0) return Status::Ok();
  if (it == decls_.end() || !it->second.planned || !it->second.status.ok()) {
    return ProtocolError("kAssignAck for a key that was not assigned");
  }
  Declaration& decl = it->second;
  // An ack of the plan a failover has replaced says nothing about the new one.
  if (f.header.round != decl.assign_header.round) return Status::Ok();
  decl.acks.insert(c.id);
  DeliverWhenAcked(decl);
  return Status::Ok();
}

Status SchedulerImpl::OnRetire(Connection& c, const Frame& f) {
  if (c.role != Role::kWorker || !started_) return ProtocolError("unexpected kRetire");
  auto it = decls_.find(f.header.key);
  if (it == decls_.end() || it->second.by_rank.count(c.id) == 0) {
    // A key this worker declared late and was refused with the others' refusal (OnDeclare),
    // or one already forgotten: nothing of it is held for this worker.
    return Status::Ok();
  }
  Declaration& decl = it->second;
  decl.retired.insert(c.id);
  if (decl.retired.size() < decl.by_rank.size()) return Status::Ok();  // others still use it
  if (decl.planned && decl.status.ok()) {
    const std::vector<uint64_t> held = HeldBy(decl, decl.plan);
    for (uint32_t s = 0; s < held.size(); ++s) held_[s] -= std::min(held_[s], held[s]);
    const uint64_t size = DataTypeSize(topology::WireType(decl.dtype, decl.mode));
    for (const wire::PartitionPlan& p : decl.plan) placer_.Remove(p.server, p.count * size);
    wire::Header h = MakeHeader(MsgType::kRetire);
    h.key = f.header.key;
    const auto now = Clock::now();
    for (auto& [id, s] : servers_) {
      if (lost_servers_.count(id) == 0 && !s->left) s->link.Send(h, {}, {}, now);
    }
  }
  GL_LOG(kDebug) << "scheduler: key " << KeyHex(f.header.key) << " '" << decl.name
                 << "' retired by every worker that declared it";
  retired_keys_.insert(f.header.key);
  decls_.erase(it);
  return Status::Ok();
}

void SchedulerImpl::SendToDeclarers(const Declaration& decl) {
  const auto now = Clock::now();
  for (const auto& [rank, hd] : decl.by_rank) {
    auto it = workers_.find(rank);
    if (it != workers_.end() && !it->second->left) {
      it->second->link.Send(decl.assign_header, {}, decl.assign_payload, now);
    }
  }
}

}  // namespace gradlink::scheduler
