// The same-host path (local_reduce.h) as the worker uses it (worker_impl.h): the segment opened at
// join when every worker is on this host, tensors bound to channels, ops handed to it.
#include <sys/statvfs.h>

#include <algorithm>
#include <cstdio>

#include "common/log.h"
#include "common/naming.h"
#include "worker/worker_impl.h"

namespace gradlink {

Status WorkerImpl::OpenLocalPath(const wire::WelcomeMsg& welcome, Clock::time_point deadline) {
  if (opts_.local_arena_bytes == 0 || size_ < 2) return Status::Ok();
  if (hosts_.hosts() > 1) {
    GL_LOG(kInfo) << "worker " << rank_ << ": same-host path off (workers on several hosts)";
    return OpenHostPath(welcome, deadline);
  }
  const wire::Member* first = nullptr;  // worker 0
  const std::string* host = nullptr;
  bool one_host = true;
  for (const wire::Member& m : welcome.members) {
    if (m.role != wire::Role::kWorker) continue;
    if (m.id == 0) first = &m;
    if (host == nullptr) host = &m.host;
    one_host = one_host && MachineOf(m.host) == MachineOf(*host);
  }
  if (!one_host || first == nullptr || size_ > LocalReduce::kMaxRanks) {
    GL_LOG(kInfo) << "worker " << rank_ << ": same-host path off ("
                  << (one_host ? "too many workers" : "workers on several hosts") << ")";
    return Status::Ok();
  }
  // Named after this run of the job (the scheduler's random instance, worker 0's address),
  // hashed as tensor keys are.
  std::string run = std::to_string(welcome.instance) + "/";
  run.append(reinterpret_cast<const char*>(first->push_address.data()),
             first->push_address.size());
  const uint64_t h = wire::TensorKey(opts_.job, run);
  char name[40];
  std::snprintf(name, sizeof(name), "/gradlink-%016llx", static_cast<unsigned long long>(h));
  LocalReduce::Options lo;
  lo.name = name;
  lo.rank = rank_;
  lo.ranks = size_;
  lo.arena_bytes = ArenaBytes(/*creator=*/rank_ == 0);
  lo.chunk_bytes = opts_.local_chunk_bytes;
  // The workers wait here for each other, members of a running job: one that hung or died is
  // the scheduler's to name (it hears its silence within kSilenceLimit), so the wait lasts at
  // least that long, and a worker that gives up blames the right process, not a timeout.
  lo.deadline = std::max(deadline, Clock::now() + transport::kSilenceLimit + std::chrono::seconds(1));
  lo.cancelled = [this] { return verdict_.failure(); };
  GL_ASSIGN_OR_RETURN(std::shared_ptr<LocalReduce> local, LocalReduce::Open(lo));
  if (!local) return Status::Ok();  // no room in /dev/shm: the servers (Open warned)
  GL_LOG(kInfo) << "worker " << rank_ << ": same-host path on (" << size_
                << " workers on host " << MachineOf(*host) << ", " << local->arena_bytes()
                << "-byte segment)";
  MutexLock lock(mu_);  // FailAll (the control thread) reads it
  local_ = std::move(local);
  if (verdict_.failed()) local_->Fail(verdict_.failure());
  return Status::Ok();
}

uint64_t WorkerImpl::ArenaBytes(bool creator) const {
  const uint64_t asked = opts_.local_arena_bytes;
  if (asked != WorkerOptions::kDefaultLocalArenaBytes || !creator) return asked;
  // The default fits what it finds: at most half of /dev/shm's free space (a container's
  // 64 MB /dev/shm still gets a segment), in whole MiB.
  struct statvfs vfs {};
  if (statvfs("/dev/shm", &vfs) != 0) return asked;
  const uint64_t half = uint64_t{vfs.f_bavail} * vfs.f_frsize / 2 / (1u << 20) * (1u << 20);
  return std::max<uint64_t>(std::min(asked, half), 1u << 20);
}

void WorkerImpl::BindLocal(TensorState& t) {
  if (!local_ || host_path_) return;  // the host's segment binds at Declare (BindHost)
  if (!t.spec.is_sum()) return;       // the segment only sums: the rest go to the servers
  std::call_once(t.local_once, [&] {
    Result<std::optional<LocalReduce::Channel>> c = local_->Bind(t.key, t.dtype, t.count);
    if (c.ok() && !c->has_value()) {
      GL_LOG(kInfo) << "worker " << rank_ << ": '" << t.name
                    << "' goes through the servers: the same-host segment is full";
    }
    MutexLock lock(mu_);
    t.local_bound = true;
    if (c.ok()) {
      t.local = *c;
    } else {
      t.local_status = Status(c.status().code(), "key " + KeyHex(t.key) + " '" + t.name +
                                                     "': " + c.status().message());
    }
  });
}

bool WorkerImpl::LocalBindingOkLocked(TensorState& t, Op& op) {
  if (t.local_status.ok()) return true;
  FinishLocked(op, t.local_status);
  return false;
}

LocalReduce::Job WorkerImpl::SegmentJob(const TensorState& t, const Op& op) {
  LocalReduce::Job job;
  job.data = op.data;
  job.dtype = t.dtype;
  job.count = t.count;
  job.round = op.round;
  job.average = op.options.average;
  job.what = "key " + KeyHex(t.key) + " '" + t.name + "'";
  return job;
}

bool WorkerImpl::ParkForVerdictLocked(const std::shared_ptr<Op>& op, const Status& s) {
  if ((s.code() != Code::kAborted && s.code() != Code::kPeerLost) || verdict_.failed()) {
    return false;
  }
  // A worker that left mid-operation mostly left because the job failed (it heard the
  // scheduler go silent a moment before us), and a sum lost at another worker mostly means the
  // same: give the verdict, or this worker's own detection, the grace a failed data endpoint
  // gets, so the op names the cause.
  parked_ops_.push_back({op, s, Clock::now() + kVerdictGrace});
  has_parked_ops_.store(true, std::memory_order_relaxed);
  return true;
}

void WorkerImpl::EndParkedOpsLocked() {
  if (parked_ops_.empty()) return;
  const Clock::time_point now = Clock::now();
  std::vector<ParkedOp> ending;
  for (size_t i = 0; i < parked_ops_.size();) {
    if (!verdict_.failed() && now < parked_ops_[i].until) {
      ++i;
      continue;
    }
    ending.push_back(std::move(parked_ops_[i]));
    parked_ops_.erase(parked_ops_.begin() + static_cast<ptrdiff_t>(i));
  }
  has_parked_ops_.store(!parked_ops_.empty(), std::memory_order_relaxed);
  const Status failure = verdict_.failure();
  for (ParkedOp& p : ending) EndSegmentJobLocked(*p.op, failure.ok() ? p.own : failure);
}

void WorkerImpl::EndParkedOps() {
  if (!has_parked_ops_.load(std::memory_order_relaxed)) return;
  MutexLock lock(mu_);
  EndParkedOpsLocked();
}

void WorkerImpl::EndSegmentJobLocked(Op& op, const Status& s) {
  if (!op.host) {
    FinishLocked(op, s);
    return;
  }
  op.host_done = true;
  if (!s.ok()) {
    RecordFailureLocked(op, s);
    // Ended early (a local worker left, the job failed): no more answers will be awaited. A
    // host job that ended on a partition's failure ended after every partition was answered.
    if (op.outstanding != 0) op.abandoned = true;
  }
  TryFinishLocked(op);
}

void WorkerImpl::StartLocalLocked(TensorState& t, const std::shared_ptr<Op>& op) {
  t.busy = true;
  op->started = true;
  LocalReduce::Job job = SegmentJob(t, *op);
  job.channel = *t.local;
  job.done = [this, op](const Status& s, Clock::time_point first, Clock::time_point last,
                        Clock::time_point arrived) { LocalDone(op, s, first, last, arrived); };
  local_->Start(std::move(job));
}

void WorkerImpl::LocalDone(const std::shared_ptr<Op>& op, const Status& s, Clock::time_point first,
               Clock::time_point last, Clock::time_point arrived) {
  MutexLock lock(mu_);
  op->t_first_issue = first;
  op->t_pushed = last;
  op->t_arrived = arrived;
  if (s.code() == Code::kAborted && ParkForVerdictLocked(op, s)) return;
  EndSegmentJobLocked(*op, s);
}

}  // namespace gradlink
