// Hierarchical aggregation (local_reduce.h, "host channels") as the worker uses it
// (worker_impl.h): the host's segment opened at join when the job spans several hosts and some
// host has several workers, tensors bound to host channels at Declare, ops handed to it, and
// this worker's share of the partitions pushed from (and pulled into) the segment.
#include <algorithm>
#include <cstdio>

#include "common/log.h"
#include "common/naming.h"
#include "worker/worker_impl.h"

namespace gradlink {

Status WorkerImpl::OpenHostPath(const wire::WelcomeMsg& welcome, Clock::time_point deadline) {
  // Opened even with hierarchical = false: the host's other workers wait for every one of its
  // workers to open it. Such a worker declares every key flat, which makes it flat for all.
  if (!hosts_.hierarchical()) return Status::Ok();
  const uint32_t host = hosts_.host_of[rank_];
  const std::vector<uint32_t>& ranks = hosts_.ranks_on[host];
  // Named after this run of the job (the scheduler's random instance) and the host, hashed as
  // tensor keys are: the hosts of an emulated cluster share one /dev/shm.
  const std::string run = std::to_string(welcome.instance) + "/host/" + hosts_.machine[host];
  const uint64_t h = wire::TensorKey(opts_.job, run);
  char name[40];
  std::snprintf(name, sizeof(name), "/gradlink-%016llx", static_cast<unsigned long long>(h));
  LocalReduce::Options lo;
  lo.name = name;
  lo.rank = hosts_.local_rank[rank_];
  lo.ranks = static_cast<uint32_t>(ranks.size());
  lo.job_ranks = ranks;
  lo.arena_bytes = ArenaBytes(/*creator=*/lo.rank == 0);
  lo.chunk_bytes = opts_.local_chunk_bytes;
  // As for the same-host path: a host's worker that hung or died is the scheduler's to name.
  lo.deadline = std::max(deadline, Clock::now() + transport::kSilenceLimit + std::chrono::seconds(1));
  lo.cancelled = [this] { return verdict_.failure(); };
  if (ranks.size() > LocalReduce::kMaxRanks) {
    GL_LOG(kInfo) << "worker " << rank_ << ": hierarchical aggregation off (" << ranks.size()
                  << " workers on host " << hosts_.machine[host] << ", at most "
                  << LocalReduce::kMaxRanks << ")";
    return Status::Ok();
  }
  GL_ASSIGN_OR_RETURN(std::shared_ptr<LocalReduce> local, LocalReduce::Open(lo));
  if (!local) return Status::Ok();  // no room in /dev/shm: flat (Open warned)
  const std::string what = !opts_.hierarchical ? std::string() : "host " + std::to_string(host) + " of " +
                           std::to_string(hosts_.hosts()) + ", local rank " +
                           std::to_string(lo.rank) + " of " + std::to_string(lo.ranks) + ", " +
                           (opts_.half_partials ? "16-bit" : "fp32") + " partials";
  if (what.empty()) {
    GL_LOG(kInfo) << "worker " << rank_ << ": hierarchical aggregation off (hierarchical = "
                  << "false): every key of the job is aggregated flat";
  } else {
    GL_LOG(kInfo) << "worker " << rank_ << ": hierarchical on (" << what << ", host "
                  << hosts_.machine[host] << ", " << local->arena_bytes() << "-byte segment)";
  }
  MutexLock lock(mu_);  // FailAll (the control thread) reads it
  local_ = std::move(local);
  host_path_ = true;
  in_force_.hierarchy = what;
  if (verdict_.failed()) local_->Fail(verdict_.failure());
  return Status::Ok();
}

uint8_t WorkerImpl::BindHost(TensorState& t) {
  if (!host_path_ || !opts_.hierarchical) return static_cast<uint8_t>(topology::Mode::kFlat);
  const bool half = t.dtype == DataType::kFloat16 || t.dtype == DataType::kBFloat16;
  // For other dtypes the two modes are one: say kHostPartials, so that workers that differ in
  // half_partials do not disagree on an fp32 key.
  const topology::Mode mode = half && opts_.half_partials ? topology::Mode::kHalfPartials
                                                          : topology::Mode::kHostPartials;
  const DataType wire = topology::WireType(t.dtype, mode);
  // The partitions the scheduler will cut (scheduler.cc, Plan): the same rule from the same book.
  const uint64_t wsize = DataTypeSize(wire);
  const uint64_t bytes = t.count * wsize;
  const uint64_t partition =
      opts_.partition_bytes.value_or(tuning::KeyPartitionBytes(tuning_, bytes, num_servers_));
  const uint64_t part_elems = std::max<uint64_t>(1, partition / wsize);
  Result<std::optional<LocalReduce::HostChannel>> c =
      local_->BindHost(t.key, t.dtype, wire, t.count, part_elems);
  if (!c.ok() || !c->has_value()) {
    // Another worker of this host declared the key otherwise (the scheduler names the
    // mismatch), or the segment is full: the key goes flat, for every worker.
    GL_LOG(kInfo) << "worker " << rank_ << ": '" << t.name << "' is aggregated flat: "
                  << (c.ok() ? "the host's segment is full" : c.status().ToString());
    return static_cast<uint8_t>(topology::Mode::kFlat);
  }
  MutexLock lock(mu_);
  t.host = **c;
  return static_cast<uint8_t>(mode);
}

Status WorkerImpl::PlanHostLocked(TensorState& t, topology::Mode mode) {
  t.mode = mode;
  t.wire = topology::WireType(t.dtype, mode);
  if (mode == topology::Mode::kFlat) return Status::Ok();
  if (!host_path_ || !t.host) {
    return Internal("key " + KeyHex(t.key) + " '" + t.name + "': planned hierarchical, but " +
                    "worker " + std::to_string(rank_) + " has no host channel for it");
  }
  const uint32_t host = hosts_.host_of[rank_];
  t.pusher.resize(t.parts.size());
  t.pushed_here = 0;
  for (uint32_t p = 0; p < t.parts.size(); ++p) {
    if (t.parts[p].count > t.host->part_elems) {
      return Internal("key " + KeyHex(t.key) + " '" + t.name + "': partition " +
                      std::to_string(p) + " of " + std::to_string(t.parts[p].count) +
                      " elements exceeds its host channel's " +
                      std::to_string(t.host->part_elems));
    }
    const uint32_t pusher = topology::Pusher(hosts_, host, t.key, p);
    t.pusher[p] = hosts_.local_rank[pusher];
    if (pusher == rank_) ++t.pushed_here;
  }
  return Status::Ok();
}

void WorkerImpl::StartHostLocked(TensorState& t, const std::shared_ptr<Op>& op) {
  const uint32_t me = hosts_.local_rank[rank_];
  t.busy = true;
  op->started = true;
  op->host = true;
  // Partitions another worker of this host pushes need no answer here.
  op->parts.swap(t.spare_parts);
  op->parts.assign(t.parts.size(), Op::Part::kDone);
  op->held.swap(t.spare_held);
  for (uint32_t p = 0; p < t.parts.size(); ++p) {
    if (t.pusher[p] == me) op->parts[p] = Op::Part::kQueued;
  }
  op->outstanding = t.pushed_here;
  op->partial.assign(t.parts.size(), {});
  op->push_flags.assign(t.parts.size(), 0);
  op->push_ranks.assign(t.parts.size(), 0);
  op->max_ahead = LeadLimit(max_bytes_ahead_, t.servers_spanned);
  TrackOpLocked(op);
  LocalReduce::Job job = SegmentJob(t, *op);
  job.host = *t.host;
  job.wire = t.wire;
  job.parts = t.parts;
  job.pusher = t.pusher;
  job.sits_out = op->sits_out;
  job.summed = [this, op](uint32_t part, std::span<std::byte> partial, uint16_t flags,
                          uint32_t ranks) { HostSummed(op, part, partial, flags, ranks); };
  job.done = [this, op](const Status& s, Clock::time_point first, Clock::time_point last,
                        Clock::time_point arrived) { HostDone(op, s, first, last, arrived); };
  local_->Start(std::move(job));
}

void WorkerImpl::HostSummed(const std::shared_ptr<Op>& op, uint32_t part,
                            std::span<std::byte> partial, uint16_t flags, uint32_t ranks) {
  IssueBatch batch;
  {
    MutexLock lock(mu_);
    if (op->finished || op->abandoned) return;
    op->partial[part] = partial;
    op->push_flags[part] = flags;
    // Fewer than the host's workers (some joined): the servers divide an average by the ranks
    // summed, so the push says how many.
    const size_t host_ranks = hosts_.ranks_on[hosts_.host_of[rank_]].size();
    op->push_ranks[part] = ranks < host_ranks ? static_cast<uint16_t>(ranks) : 0;
    pending_.push(Pending{op->options.priority, next_seq_++, op, part});
    PumpLocked();
    TakeIssueLocked(&batch);
  }
  Issue(std::move(batch));
}

void WorkerImpl::PublishLocked(Op& op, uint32_t part, Code code) {
  const TensorState& t = *op.tensor;
  local_->Publish(*t.host, op.round, static_cast<uint32_t>(t.parts.size()), part, code);
}

void WorkerImpl::HostDone(const std::shared_ptr<Op>& op, const Status& s, Clock::time_point first,
                          Clock::time_point last, Clock::time_point arrived) {
  MutexLock lock(mu_);
  if (op->t_first_issue == Clock::time_point{}) op->t_first_issue = first;
  (void)last;
  op->t_arrived = arrived;
  if (ParkForVerdictLocked(op, s)) return;
  EndSegmentJobLocked(*op, s);
}

void WorkerImpl::StartSatOutRoundsLocked(std::vector<SatOutWatch>* watch) {
  watch->clear();
  for (const auto& [key, ts] : tensors_) {
    TensorState& t = *ts;
    if (!t.planned || !t.plan_status.ok() || t.mode == topology::Mode::kFlat || !t.host ||
        t.pushed_here == 0 || t.parts.empty()) {
      continue;
    }
    const auto parts = static_cast<uint32_t>(t.parts.size());
    // Busy: the round it runs for the others ends first (by the time they begin the next one,
    // it has: they begin it once every sum of this one is in, this worker's published too).
    if (t.busy || !t.queue.empty() || !local_->BegunWithoutMe(*t.host, t.next_round, parts)) {
      watch->push_back({*t.host, t.next_round, parts});
      continue;
    }
    std::shared_ptr<Op> op = NewOp(ts);
    op->sits_out = true;
    op->id = next_op_id_++;
    op->round = t.next_round++;
    StartHostLocked(t, op);
  }
}

Status WorkerImpl::SitOutUntilReleased(Clock::time_point deadline) {
  std::vector<SatOutWatch> watch;
  UniqueLock lock(mu_);
  while (!rendezvous_.join_released && !verdict_.failed() && !shut_down_.load()) {
    if (Clock::now() >= deadline) {
      // The host's other workers still need this one's pushes: a thread goes on with them
      // until the release (or the job's end), and the caller gets its timeout.
      if (!sit_out_running_.load()) {
        if (sit_out_.joinable()) sit_out_.join();  // an earlier join's, over
        sit_out_running_ = true;
        sit_out_ = std::thread([this] {
          SitOutUntilReleased(Clock::time_point::max()).IgnoreError();
          sit_out_running_ = false;
        });
      }
      return Timeout("join() on rank " + std::to_string(rank_) +
                     ": not every worker had joined by the deadline (this worker goes on "
                     "pushing its share of its host's sums in the background until they have)");
    }
    StartSatOutRoundsLocked(&watch);
    lock.unlock();
    local_->Progress(LocalReduce::Step::kPost);
    // Asleep on the segment's bell, which the host's workers ring as they post and which the
    // release rings; a plan that arrives meanwhile is seen within the slice.
    const auto begun = [&] {
      if (rendezvous_.join_released) return true;
      return std::any_of(watch.begin(), watch.end(), [&](const SatOutWatch& w) {
        return local_->BegunWithoutMe(w.channel, w.round, w.parts);
      });
    };
    local_->Wait(begun, std::min(deadline, Clock::now() + std::chrono::milliseconds(100)));
    lock.lock();
  }
  if (rendezvous_.join_released) return Status::Ok();
  if (verdict_.failed()) return verdict_.failure();
  return Aborted("join() on rank " + std::to_string(rank_) + ": the worker was shut down");
}

}  // namespace gradlink
