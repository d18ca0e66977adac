// WorkerImpl::PushPullGroup (worker_impl.h): a group's members cut into fused tensors (packed into
// fusion buffers) and members pushed on their own; layouts planned once and cached.
#include <cstring>
#include <map>
#include <unordered_set>

#include "common/naming.h"
#include "worker/worker_impl.h"

namespace gradlink {

PushPullHandle WorkerImpl::PushPullGroup(std::span<const TensorHandle> tensors,
                             std::span<const std::span<std::byte>> data,
                             const PushPullOptions& options) {
  auto g = std::make_shared<Group>();
  g->t_call = Clock::now();
  g->timeout = opts_.operation_timeout;
  g->counters = counters_;
  PushPullHandle handle(g);
  counters_->groups.fetch_add(1, std::memory_order_relaxed);
  g->what = "push_pull group of " + std::to_string(tensors.size()) + " tensors";
  auto fail = [&](Status s) {
    MutexLock lock(g->mu);
    g->status = Status(s.code(), g->what + ": " + s.message());
    g->t_started = g->t_finished = Clock::now();
    g->finished = true;
    return handle;
  };
  if (tensors.size() != data.size()) {
    return fail(InvalidArgument(std::to_string(tensors.size()) + " tensors but " +
                                std::to_string(data.size()) + " buffers"));
  }
  std::vector<const TensorState*> members(tensors.size());
  for (size_t i = 0; i < tensors.size(); ++i) {
    if (!tensors[i].valid()) {
      return fail(InvalidArgument("member " + std::to_string(i) + " is not a declared tensor"));
    }
    const uint64_t want = tensors[i].count() * DataTypeSize(tensors[i].dtype());
    if (data[i].size() != want) {
      return fail(InvalidArgument("member " + std::to_string(i) + ": buffer of " +
                                  std::to_string(data[i].size()) + " bytes for '" +
                                  tensors[i].name() + "', which needs " + std::to_string(want)));
    }
    members[i] = tensors[i].state_.get();
  }
  if (!tensors.empty()) {
    g->what += " ('" + Shorten(tensors.front().name()) + "'" +
               (tensors.size() > 1 ? " .. '" + Shorten(tensors.back().name()) + "'" : "") + ")";
  }
  Result<std::shared_ptr<const GroupPlan>> plan = PlanFor(std::move(members), tensors);
  if (!plan.ok()) return fail(plan.status());
  g->plan = *plan;
  g->parts.reserve((*plan)->chunks.size());
  for (const GroupPlan::Chunk& c : (*plan)->chunks) {
    Group::Part part;
    if (c.fused.valid()) {
      std::shared_ptr<std::byte> buf = internal::FusionPool::Take(pool_);
      part.members.reserve(c.members.size());
      for (size_t k = 0; k < c.members.size(); ++k) {
        const std::span<std::byte> d = data[c.members[k]];
        if (!d.empty()) std::memcpy(buf.get() + c.offsets[k], d.data(), d.size());
        part.members.push_back({d, c.offsets[k]});
      }
      counters_->bytes_packed.fetch_add(c.bytes, std::memory_order_relaxed);
      counters_->fused_ops.fetch_add(1, std::memory_order_relaxed);
      part.packed = std::span<std::byte>(buf.get(), c.bytes);
      part.what = &c.what;
      part.op = StartOp(c.fused, part.packed, options, std::move(buf));
    } else {
      const uint32_t m = c.members.front();
      part.op = StartOp(tensors[m], data[m], options, nullptr);
    }
    g->parts.push_back(std::move(part));
  }
  g->t_started = Clock::now();
  return handle;
}

std::string WorkerImpl::Shorten(const std::string& s) {
  constexpr size_t kMax = 64;
  return s.size() <= kMax ? s : s.substr(0, kMax - 3) + "...";
}

Result<std::shared_ptr<const WorkerImpl::GroupPlan>> WorkerImpl::PlanFor(
    std::vector<const TensorState*> members, std::span<const TensorHandle> tensors) {
  {
    MutexLock lock(plans_mu_);
    auto it = plans_.find(members);
    if (it != plans_.end()) return it->second;
  }
  GL_ASSIGN_OR_RETURN(std::shared_ptr<const GroupPlan> plan, BuildPlan(tensors));
  MutexLock lock(plans_mu_);
  if (plans_.size() >= kMaxCachedPlans) plans_.clear();
  plans_.emplace(std::move(members), plan);
  return plan;
}

Result<std::shared_ptr<const WorkerImpl::GroupPlan>> WorkerImpl::BuildPlan(
    std::span<const TensorHandle> tensors) {
  auto plan = std::make_shared<GroupPlan>();
  std::unordered_set<const TensorState*> seen;
  const uint64_t buffer = opts_.fusion_buffer_bytes;
  const uint64_t threshold = std::min(opts_.fusion_threshold_bytes, buffer);
  std::map<DataType, size_t> open;  // dtype -> the chunk being filled
  for (uint32_t i = 0; i < tensors.size(); ++i) {
    const TensorHandle& t = tensors[i];
    if (!seen.insert(t.state_.get()).second) {
      return InvalidArgument("tensor '" + t.name() + "' is in the group twice");
    }
    const uint64_t bytes = t.count() * DataTypeSize(t.dtype());
    if (bytes >= threshold) {  // also when fusion is off (threshold 0)
      plan->chunks.push_back({{i}, {}, {}, bytes, {}});
      continue;
    }
    auto it = open.find(t.dtype());
    if (it == open.end() || plan->chunks[it->second].bytes + bytes > buffer) {
      open[t.dtype()] = plan->chunks.size();
      plan->chunks.push_back({{}, {}, {}, 0, {}});
      it = open.find(t.dtype());
    }
    GroupPlan::Chunk& c = plan->chunks[it->second];
    c.members.push_back(i);
    c.offsets.push_back(c.bytes);
    c.bytes += bytes;
  }
  for (GroupPlan::Chunk& c : plan->chunks) {
    if (c.members.size() < 2) continue;  // a buffer for one member would only add copies
    GL_RETURN_IF_ERROR(DeclareFused(c, tensors));
  }
  return std::shared_ptr<const GroupPlan>(std::move(plan));
}

Status WorkerImpl::DeclareFused(GroupPlan::Chunk& c, std::span<const TensorHandle> tensors) {
  const TensorHandle& first = tensors[c.members.front()];
  const TensorHandle& last = tensors[c.members.back()];
  const DataType dtype = first.dtype();
  std::string layout(DataTypeName(dtype));
  for (uint32_t m : c.members) {
    const std::string& n = tensors[m].name();
    layout += ";" + std::to_string(n.size()) + ":" + n + "=" + std::to_string(tensors[m].count());
  }
  const std::string name = "gradlink.fused/" + std::string(DataTypeName(dtype)) + "/" +
                           std::to_string(c.members.size()) + "/" +
                           KeyHex(wire::TensorKey("gradlink.fused", layout)).substr(2) + "/" +
                           Shorten(first.name()) + ".." + Shorten(last.name());
  std::string listed;
  for (size_t k = 0; k < c.members.size() && k < kMembersNamed; ++k) {
    listed += (k ? ", '" : "'") + Shorten(tensors[c.members[k]].name()) + "'";
  }
  if (c.members.size() > kMembersNamed) {
    listed += ", ... '" + Shorten(last.name()) + "'";
  }
  GL_ASSIGN_OR_RETURN(c.fused, Declare(name, dtype, c.bytes / DataTypeSize(dtype)));
  const std::string members = std::to_string(c.members.size()) + " members (" + listed + ")";
  c.what = "fused tensor '" + name + "' (key " + KeyHex(c.fused.key()) + ") of " + members;
  MutexLock lock(mu_);
  TensorState& f = *c.fused.state_;
  if (!f.fused_members.empty()) return Status::Ok();  // declared by an earlier plan
  f.fused_members = members;
  for (uint32_t m : c.members) {
    TensorState& t = *tensors[m].state_;
    t.fused_in.push_back(&f);
    if (t.planned && !t.plan_status.ok()) MemberFailedLocked(f, t);
  }
  return Status::Ok();
}

void WorkerImpl::MemberFailedLocked(TensorState& f, const TensorState& t) {
  if (!f.member_failure.ok()) return;
  f.member_failure = Status(t.plan_status.code(), "member '" + t.name + "': " +
                                                      t.plan_status.message());
  if (!f.planned) {
    while (!f.queue.empty()) {
      std::shared_ptr<Op> op = f.queue.front();
      f.queue.pop_front();
      FinishLocked(*op, f.member_failure);
    }
  }
}

}  // namespace gradlink
