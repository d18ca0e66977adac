// TensorHandle and PushPullHandle (include/gradlink/worker.h): waiting on, polling and timing
// one operation or a group of them. Runs on the caller's thread; takes Group::mu and Op::mu,
// never the worker's state lock.
#include <algorithm>
#include <cstring>

#include "worker/state.h"

namespace gradlink {

using internal::Group;
using internal::Op;

namespace {

bool IsDone(Op& op) {
  MutexLock lock(op.mu);
  return op.done;
}

bool WaitDone(Op& op, Clock::time_point deadline) {
  if (op.local) return op.local->Wait([&op] { return IsDone(op); }, deadline);
  MutexLock lock(op.mu);
  while (!op.done) {
    if (!op.cv.WaitUntil(op.mu, deadline)) return op.done;
  }
  return true;
}

// IsDone(), after driving the same-host path once on this thread.
bool PollDone(Op& op) {
  if (op.local) op.local->Progress(internal::LocalReduce::Step::kPoll);
  return IsDone(op);
}

// Records a done part and copies a fused part's result into its members. Group::mu held.
void EndPartLocked(Group& g, Group::Part& p) REQUIRES(g.mu) {
  Op& op = *p.op;
  {
    MutexLock lock(op.mu);
    p.status = op.status;
  }
  p.t_call = op.t_call;
  p.t_first_issue = op.t_first_issue;
  p.t_pushed = op.t_pushed;
  p.t_arrived = op.t_arrived;
  p.t_done = op.t_done;
  p.t_server = op.t_server;
  if (!p.status.ok() && p.what != nullptr) {
    p.status = Status(p.status.code(), *p.what + ": " + p.status.message());
  }
  if (p.status.ok() && !p.members.empty()) {
    for (const Group::Member& m : p.members) {
      if (!m.data.empty()) std::memcpy(m.data.data(), p.packed.data() + m.offset, m.data.size());
    }
    g.counters->bytes_unpacked.fetch_add(p.packed.size(), std::memory_order_relaxed);
    g.counters->bytes_reduced.fetch_add(p.packed.size(), std::memory_order_relaxed);
    g.counters->push_pulls.fetch_add(p.members.size(), std::memory_order_relaxed);
  }
  p.ended = true;
  p.op.reset();
}

// Every part has ended: the group's result is the first failing part's. Group::mu held.
void FinishGroupLocked(Group& g) REQUIRES(g.mu) {
  if (g.finished) return;
  for (Group::Part& p : g.parts) {
    if (!p.status.ok()) {
      g.status = Status(p.status.code(), g.what + ": " + p.status.message());
      break;
    }
  }
  g.t_finished = Clock::now();
  g.finished = true;
}

Status WaitGroup(Group& g, Clock::time_point deadline) {
  // Part by part, in order: a fused part is unpacked while later ones are still on the wire.
  for (Group::Part& p : g.parts) {
    std::shared_ptr<Op> op;
    {
      MutexLock lock(g.mu);
      if (g.finished) return g.status;
      if (p.ended) continue;
      op = p.op;
    }
    if (!WaitDone(*op, deadline)) {
      return Timeout(g.what + " not complete at the deadline" +
                     (p.what != nullptr ? " (" + *p.what + " still running; every worker must "
                                          "group the same tensors the same way, or fused "
                                          "tensors never meet)"
                                        : " ('" + op->tensor->name + "' still running)"));
    }
    MutexLock lock(g.mu);
    if (!p.ended) EndPartLocked(g, p);
  }
  MutexLock lock(g.mu);
  FinishGroupLocked(g);
  return g.status;
}

bool PollGroup(Group& g) {
  {
    MutexLock lock(g.mu);
    if (g.finished) return true;
    for (Group::Part& p : g.parts) {
      if (!p.ended && !PollDone(*p.op)) return false;
    }
  }
  // Every part is done: this only unpacks.
  WaitGroup(g, Clock::time_point::max()).IgnoreError();
  return true;
}

// Stages on one timeline (see PushPullTiming): each boundary is the latest of its events,
// and never before the previous boundary.
PushPullTiming MakeTiming(Clock::time_point t0, Clock::time_point started,
                          Clock::time_point first_issue, Clock::time_point pushed,
                          Clock::time_point arrived, Clock::time_point done,
                          Clock::time_point finished) {
  PushPullTiming t;
  const Clock::time_point b1 = std::max(t0, started);
  const Clock::time_point b2 = std::max(b1, first_issue);
  const Clock::time_point b3 = std::max(b2, pushed);
  const Clock::time_point b4 = std::max(b3, arrived);
  const Clock::time_point b5 = std::max(b4, done);
  const Clock::time_point b6 = std::max(b5, finished);
  t.pack = b1 - t0;
  t.queue = b2 - b1;
  t.push = b3 - b2;
  t.reduce = b4 - b3;
  t.pull = b5 - b4;
  t.unpack = b6 - b5;
  t.total = b6 - t0;
  return t;
}


}  // namespace

uint64_t TensorHandle::key() const { return state_->key; }
const std::string& TensorHandle::name() const { return state_->label; }
bool TensorHandle::current() const {
  return state_ != nullptr && state_->current.load(std::memory_order_acquire);
}
DataType TensorHandle::dtype() const { return state_->dtype; }
uint64_t TensorHandle::count() const { return state_->count; }
const std::vector<uint64_t>& TensorHandle::shape() const { return state_->shape; }
const CollectiveSpec& TensorHandle::spec() const { return state_->spec; }
uint64_t TensorHandle::input_count() const { return state_->input_count; }
uint64_t TensorHandle::output_count() const { return state_->output_count; }

Status PushPullHandle::Wait(Clock::time_point deadline) const {
  if (group_) return WaitGroup(*group_, deadline);
  if (!op_) return InvalidArgument("Wait() on an empty PushPullHandle");
  if (!WaitDone(*op_, deadline)) {
    return Timeout("push_pull of '" + op_->tensor->name + "' (round " +
                   std::to_string(op_->round) + ") not complete at the deadline" +
                   (op_->describer ? op_->describer->Describe(*op_) : std::string()));
  }
  MutexLock lock(op_->mu);
  return op_->status;
}

Status PushPullHandle::Wait() const {
  if (group_) return Wait(Clock::now() + group_->timeout);
  if (!op_) return InvalidArgument("Wait() on an empty PushPullHandle");
  return Wait(Clock::now() + op_->timeout);
}

bool PushPullHandle::Poll() const {
  if (group_) return PollGroup(*group_);
  if (!op_) return true;
  return PollDone(*op_);
}

PushPullTiming PushPullHandle::Timing() const {
  if (group_) {
    Group& g = *group_;
    MutexLock lock(g.mu);
    if (!g.finished) return {};
    Clock::time_point first_issue{}, pushed{}, arrived{}, done{};
    Clock::duration server{};
    for (const Group::Part& p : g.parts) {
      first_issue = std::max(first_issue, p.t_first_issue);
      pushed = std::max(pushed, p.t_pushed);
      arrived = std::max(arrived, p.t_arrived);
      done = std::max(done, p.t_done);
      server = std::max(server, p.t_server);
    }
    PushPullTiming t =
        MakeTiming(g.t_call, g.t_started, first_issue, pushed, arrived, done, g.t_finished);
    t.server = server;
    return t;
  }
  if (!op_) return {};
  MutexLock lock(op_->mu);
  if (!op_->done) return {};
  const Op& op = *op_;
  PushPullTiming t = MakeTiming(op.t_call, op.t_call, op.t_first_issue, op.t_pushed,
                                op.t_arrived, op.t_done, op.t_done);
  t.server = op.t_server;
  return t;
}

}  // namespace gradlink
