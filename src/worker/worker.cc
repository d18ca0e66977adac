// WorkerImpl (worker_impl.h): joining the job, declaring tensors, push_pull, barriers, stats and
// shutdown.
#include <algorithm>
#include <tuple>
#include <limits>
#include <thread>

#include "common/env.h"
#include "common/log.h"
#include "metrics/endpoint.h"
#include "common/naming.h"
#include "control/join.h"
#include "control/tuning.h"
#include "gradlink/env.h"
#include "worker/worker_impl.h"

namespace gradlink {

using transport::Lane;
using transport::PeerId;
using wire::MsgType;

namespace {

constexpr uint64_t kMaxTensorBytes = uint64_t{1} << 46;

// Settings that cannot work are refused before anything connects, naming the setting (and
// its variable, for those a launcher may have set): partition 0, a window that cannot hold one
// partition, sizes beyond what the machine could hold.
Status CheckOptions(const WorkerOptions& o) {
  const auto bytes = [](uint64_t b) { return std::to_string(b) + " bytes"; };
  if (o.partition_bytes == 0u) {
    return InvalidArgument("partition_bytes (GRADLINK_PARTITION_BYTES) must be positive");
  }
  if (o.partition_bytes && *o.partition_bytes > kMaxTensorBytes) {
    return InvalidArgument("partition_bytes (GRADLINK_PARTITION_BYTES) of " +
                           bytes(*o.partition_bytes) + " is more than any tensor can hold");
  }
  if (o.max_bytes_in_flight == 0u) {
    return InvalidArgument("max_bytes_in_flight (GRADLINK_MAX_BYTES_IN_FLIGHT) must be positive");
  }
  if (o.max_bytes_in_flight && o.partition_bytes && *o.max_bytes_in_flight < *o.partition_bytes) {
    return InvalidArgument("max_bytes_in_flight (GRADLINK_MAX_BYTES_IN_FLIGHT) of " +
                           bytes(*o.max_bytes_in_flight) + " cannot hold one partition of " +
                           bytes(*o.partition_bytes) + " (partition_bytes)");
  }
  if (const uint64_t memory = AvailableMemory(); memory != 0) {
    for (const auto& [name, value] :
         {std::pair<const char*, std::optional<uint64_t>>{
              "max_bytes_ahead (GRADLINK_MAX_BYTES_AHEAD)", o.max_bytes_ahead},
          {"max_bytes_in_flight (GRADLINK_MAX_BYTES_IN_FLIGHT)", o.max_bytes_in_flight}}) {
      // A value beyond what the machine holds is a typo, not a bound.
      if (value && *value > memory) {
        return InvalidArgument(std::string(name) + " of " + bytes(*value) +
                               " is more than this machine's " + bytes(memory) + " available");
      }
    }
  }
  if (o.fusion_buffer_bytes > kMaxTensorBytes) {
    return InvalidArgument("fusion_buffer_bytes of " + std::to_string(o.fusion_buffer_bytes) +
                           " is too large");
  }
  return Status::Ok();
}

}  // namespace

Status WorkerImpl::Init() {
  GL_RETURN_IF_ERROR(CheckOptions(opts_));
  const auto deadline = Clock::now() + opts_.connect_timeout;
  GL_RETURN_IF_ERROR(lanes_.Open({"worker", job_hash_, opts_.secret, opts_.single_lane,
                                  std::move(fabric_)},
                                 &receiver_, &receiver_));

  GL_ASSIGN_OR_RETURN(metrics_, metrics::Serve("0.0.0.0", opts_.metrics_port,
                                               [this] { return CollectMetrics(); }));
  wire::RegisterMsg reg;
  reg.role = wire::Role::kWorker;
  reg.requested_rank = opts_.rank;
  reg.metrics_port = metrics_ ? metrics_->port() : 0;
  reg.host = opts_.host_name.empty() ? LocalHostName() : opts_.host_name;
  reg.push_address = lanes_.push().address();
  reg.pull_address = lanes_.reply().address();
  membership_ = std::make_unique<Membership>(
      MembershipConfig{opts_.scheduler, job_hash_, opts_.secret,
                       opts_.scheduler_reconnect_timeout},
      "worker");
  GL_ASSIGN_OR_RETURN(const wire::WelcomeMsg welcome, membership_->Join(reg, deadline));
  rank_ = welcome.your_id;
  size_ = welcome.num_workers;
  num_servers_ = welcome.num_servers;
  // Failover when the job has more than one server: a lost server's partitions can move.
  directory_.Reset(num_servers_);
  for (const wire::Member& m : welcome.members) {
    if (m.role != wire::Role::kServer) continue;
    std::string name = "server " + std::to_string(m.id) + " (" + m.host + ")";
    GL_ASSIGN_OR_RETURN(const transport::PeerId peer, lanes_.push().Connect(m.push_address, name));
    directory_.Connected(m.id, peer, std::move(name));
  }
  // What the options leave unset, chosen for this job (control/tuning.h); the scheduler makes
  // the same choice of partition size from the same address book.
  tuning_ = tuning::Choose(welcome, opts_.partition_bytes);
  max_bytes_in_flight_ = opts_.max_bytes_in_flight.value_or(tuning_.max_bytes_in_flight);
  max_bytes_ahead_ = opts_.max_bytes_ahead.value_or(tuning_.max_bytes_ahead);
  hosts_ = topology::Of(welcome);
  worker_hosts_.assign(size_, "");
  for (const wire::Member& m : welcome.members) {
    if (m.role == wire::Role::kWorker && m.id < size_) worker_hosts_[m.id] = m.host;
  }
  worker_hosts_known_.store(true, std::memory_order_release);
  membership_->Run(this);
  peer_.Start(rank_, size_, &lanes_.push());
  // After the control thread: it keeps the heartbeats going (and hears a failed job) while
  // the workers wait for each other's segment.
  GL_RETURN_IF_ERROR(OpenLocalPath(welcome, deadline));
  // Fixed from here on: Stats() copies it, and nothing rereads the options or the environment.
  WorkerStats::InForce& f = in_force_;
  f.partition_bytes = opts_.partition_bytes.value_or(tuning_.partition_bytes);
  f.max_bytes_in_flight = max_bytes_in_flight_;
  f.max_bytes_ahead = max_bytes_ahead_;
  f.chosen = (opts_.partition_bytes ? "" : "partition_bytes ") +
             std::string(opts_.max_bytes_in_flight ? "" : "max_bytes_in_flight ") +
             (opts_.max_bytes_ahead ? "" : "max_bytes_ahead ");
  if (!f.chosen.empty()) f.chosen += "chosen by gradlink: " + tuning_.why;
  f.fusion_buffer_bytes = opts_.fusion_buffer_bytes;
  f.fusion_threshold_bytes = opts_.fusion_threshold_bytes;
  f.local_arena_bytes = local_ ? local_->arena_bytes() : opts_.local_arena_bytes;
  f.same_host_path = local_ != nullptr && !host_path_;
  f.single_lane = opts_.single_lane;
  f.host = reg.host;
  f.ucx = lanes_.fabric().settings();
  f.device_memory = lanes_.fabric().device_memory();
  std::string device;
  for (const std::string& m : f.device_memory) device += (device.empty() ? "" : ", ") + m;
  std::string ucx;
  for (const std::string& v : f.ucx) ucx += " " + v;
  GL_LOG(kInfo) << "worker " << rank_ << " in force: partition_bytes " << f.partition_bytes
                << ", max_bytes_in_flight " << f.max_bytes_in_flight << ", max_bytes_ahead "
                << f.max_bytes_ahead << (f.max_bytes_ahead == 0 ? " (no limit)" : "")
                << ", fusion_buffer_bytes " << f.fusion_buffer_bytes
                << ", fusion_threshold_bytes " << f.fusion_threshold_bytes << ", same-host path "
                << (f.same_host_path ? "on" : "off") << ", hierarchy "
                << (f.hierarchy.empty() ? "off" : f.hierarchy) << ", "
                << (f.single_lane ? "one lane" : "two lanes") << ", host " << f.host
                << ", UCX:" << (ucx.empty() ? " its defaults" : ucx) << ", device memory "
                << (device.empty() ? std::string("none (host only)") : device)
                << (f.chosen.empty() ? "" : "; " + f.chosen);
  metrics_ready_.store(true, std::memory_order_release);
  if (metrics_) {
    const auto channel = membership_->channel();
    metrics::LogServing("worker " + std::to_string(rank_),
                        channel ? transport::SocketHost(channel->fd(), false) : reg.host,
                        metrics_->port());
  }
  return Status::Ok();
}

Result<TensorHandle> WorkerImpl::Declare(std::string_view name, DataType dtype, uint64_t count) {
  return DeclareShaped(name, dtype, count, {});
}

Result<TensorHandle> WorkerImpl::Declare(std::string_view name, DataType dtype,
                                         std::span<const uint64_t> shape) {
  if (shape.empty() || shape.size() > wire::kMaxShapeDims) {
    return InvalidArgument("tensor '" + std::string(name) + "': a shape has 1 to " +
                           std::to_string(wire::kMaxShapeDims) + " dimensions, not " +
                           std::to_string(shape.size()));
  }
  const uint64_t count = ShapeElements(shape);
  if (count == std::numeric_limits<uint64_t>::max()) {
    return InvalidArgument("tensor '" + std::string(name) + "' of shape " + FormatShape(shape) +
                           " is too large");
  }
  return DeclareShaped(name, dtype, count, shape);
}

Result<TensorHandle> WorkerImpl::DeclareCollective(std::string_view name, DataType dtype,
                                                   uint64_t count, const CollectiveSpec& spec) {
  if (Status s = layout::Check(spec, size_, count); !s.ok()) {
    return InvalidArgument("tensor '" + std::string(name) + "': " + s.message());
  }
  if (layout::PositionOf(spec, rank_) < 0) {
    return InvalidArgument("tensor '" + std::string(name) + "': rank " + std::to_string(rank_) +
                           " is not in the " + DescribeSpec(spec));
  }
  return DeclareShaped(name, dtype, count, {}, spec);
}

Result<TensorHandle> WorkerImpl::DeclareShaped(std::string_view name, DataType dtype,
                                               uint64_t count, std::span<const uint64_t> shape,
                                               const CollectiveSpec& spec) {
  if (name.empty() || name.size() > wire::kMaxNameLength) {
    return InvalidArgument("tensor name must have 1 to " +
                           std::to_string(wire::kMaxNameLength) + " characters");
  }
  if (DataTypeSize(dtype) == 0) return InvalidArgument("invalid dtype for '" + std::string(name) + "'");
  if (count > kMaxTensorBytes / DataTypeSize(dtype)) {
    return InvalidArgument("tensor '" + std::string(name) + "' is too large");
  }
  const uint64_t partition = opts_.partition_bytes.value_or(tuning_.partition_bytes);
  const uint64_t per_part = std::max<uint64_t>(1, partition / DataTypeSize(dtype));
  if (count / per_part >= wire::kMaxPartitionsPerTensor) {
    return InvalidArgument("tensor '" + std::string(name) + "' of " + std::to_string(count) +
                           " elements needs more than " +
                           std::to_string(wire::kMaxPartitionsPerTensor) + " partitions of " +
                           std::to_string(partition) + " bytes");
  }
  std::shared_ptr<TensorState> t;
  std::optional<uint64_t> retired;  // the earlier declaration's key, to tell the scheduler
  {
    MutexLock lock(mu_);
    if (verdict_.failed()) return verdict_.failure();
    uint32_t version = 0;
    if (auto l = labels_.find(std::string(name)); l != labels_.end()) {
      const std::shared_ptr<TensorState> old = l->second;  // a copy: retiring erases it
      // Retired (a refused plan): its label is free for a new key, and nothing to retire.
      const bool retired_already = !old->current.load(std::memory_order_acquire);
      const bool shape_differs =
          !shape.empty() && !old->shape.empty() &&
          !std::equal(shape.begin(), shape.end(), old->shape.begin(), old->shape.end());
      const bool refused = old->planned && !old->plan_status.ok();
      if (old->dtype == dtype && old->count == count && !shape_differs && old->spec == spec &&
          !refused && !retired_already) {
        return TensorHandle(old);
      }
      if (!retired_already && (old->busy || !old->queue.empty())) {
        const auto what = [](const CollectiveSpec& c) {
          return c.is_sum() ? std::string() : " for " + DescribeSpec(c);
        };
        return InvalidArgument(
            "tensor '" + std::string(name) + "' declared as " + std::string(DataTypeName(dtype)) +
            "[" + std::to_string(count) + "]" + ShapeSuffix(shape) + what(spec) + " on rank " +
            std::to_string(rank_) + " while an operation of its declaration as " +
            std::string(DataTypeName(old->dtype)) + "[" + std::to_string(old->count) + "]" +
            ShapeSuffix(old->shape) + what(old->spec) +
            " is in flight: a name takes another shape, dtype or collective once its "
            "operations have ended");
      }
      version = old->version + 1;
      if (!retired_already) retired = RetireLocked(old);
    }
    const std::string versioned = VersionedName(name, version);
    const uint64_t key = wire::TensorKey(opts_.job, versioned);
    if (auto it = tensors_.find(key); it != tensors_.end()) {
      return Mismatch("tensor names '" + it->second->name + "' and '" + versioned +
                      "' hash to the same key " + KeyHex(key));
    }
    t = std::make_shared<TensorState>();
    t->key = key;
    t->label = std::string(name);
    t->version = version;
    t->name = versioned;
    t->dtype = dtype;
    t->count = count;
    t->shape.assign(shape.begin(), shape.end());
    t->spec = spec;
    t->input_count = layout::InputCount(spec, size_, rank_, count);
    t->output_count = layout::OutputCount(spec, size_, rank_, count);
    if (!spec.is_sum()) t->copies = layout::LocalCopies(spec, size_, rank_, count);
    t->wire = dtype;
    // A key the others used while this rank had joined resumes at their round.
    if (auto resume = resume_rounds_.find(key); resume != resume_rounds_.end()) {
      t->next_round = resume->second;
      resume_rounds_.erase(resume);
    }
    tensors_[key] = t;
    labels_[t->label] = t;
  }
  if (retired) SendRetire(*retired);
  // Outside the lock: a claim in the host's segment may wait on another process. Only sums
  // have a host stage.
  const uint8_t mode =
      spec.is_sum() ? BindHost(*t) : static_cast<uint8_t>(topology::Mode::kFlat);
  uint64_t gen;
  wire::Header h;
  wire::DeclareMsg d;
  {
    MutexLock lock(mu_);
    MutexLock rendezvous_lock(rendezvous_.mu);  // a rejoin tells, or is told, t: not both
    t->declared_mode = mode;
    t->declared = true;
    // Rejoining a restarted scheduler: sent once it is back.
    t->declare_pending = rendezvous_.reconnecting;
    if (rendezvous_.reconnecting) return TensorHandle(t);
    gen = membership_->generation();
    std::tie(h, d) = DeclarationOf(*t);
  }
  Status s = membership_->SendOn(gen, h, wire::Encode(d), Clock::now() + std::chrono::seconds(10));
  if (!s.ok() && opts_.scheduler_reconnect_timeout.count() == 0) {
    FailAll(PeerLost("worker " + std::to_string(rank_) + " lost the scheduler: " + s.message()));
    return s;
  }
  // Else the control thread sees the scheduler gone too, and the declaration reaches the
  // restarted one in this worker's ResumeState (or the job fails).
  return TensorHandle(t);
}

std::string VersionedName(std::string_view label, uint32_t version) {
  if (version == 0) return std::string(label);
  std::string suffix = " (declaration " + std::to_string(version + 1) + ")";
  if (label.size() + suffix.size() <= wire::kMaxNameLength) return std::string(label) + suffix;
  // A long label: its start, and its hash to tell it from others that start alike.
  suffix = " (declaration " + std::to_string(version + 1) + " of " +
           KeyHex(wire::TensorKey("", label)) + ")";
  return std::string(label.substr(0, wire::kMaxNameLength - suffix.size())) + suffix;
}

std::optional<uint64_t> WorkerImpl::RetireLocked(std::shared_ptr<TensorState> t) {
  t->current.store(false, std::memory_order_release);
  if (t->plan_status.ok()) {  // a refusal stays what its handles' operations fail with
    t->plan_status = InvalidArgument(
        "tensor '" + t->label + "' was declared again with another dtype, shape or "
        "collective: this handle is of its earlier declaration as " +
        std::string(DataTypeName(t->dtype)) + "[" + std::to_string(t->count) + "]" +
        ShapeSuffix(t->shape) + "; declare it again for the current one");
  }
  t->planned = true;  // a kAssign still on its way is dropped (retired_keys_)
  t->results.clear();
  t->results.shrink_to_fit();
  tensors_.erase(t->key);
  retired_keys_.insert(t->key);
  // Kept: fused tensors' members and cached group layouts point at it.
  retired_tensors_.push_back(t);
  if (!t->declared || t->declare_pending) return std::nullopt;  // the scheduler never had it
  return t->key;
}

Status WorkerImpl::SendUnlessRejoining(const wire::Header& h) {
  uint64_t gen;
  {
    MutexLock lock(rendezvous_.mu);
    if (rendezvous_.reconnecting) return Unavailable("the scheduler is being replaced");
    gen = membership_->generation();
  }
  // A scheduler that is gone: the control thread sees it too (and rejoins or fails the job).
  return membership_->SendOn(gen, h, {}, Clock::now() + std::chrono::seconds(10));
}

Status WorkerImpl::LookUpPeer(uint32_t rank) {
  wire::Header h;
  h.type = MsgType::kPeerLookup;
  h.job = job_hash_;
  h.sender = rank_;
  h.count = rank;
  // Rejoining: asked again once the restarted scheduler has taken this worker back.
  return SendUnlessRejoining(h);
}

std::string WorkerImpl::PeerName(uint32_t rank) const {
  std::string name = "worker " + std::to_string(rank);
  if (worker_hosts_known_.load(std::memory_order_acquire) && rank < worker_hosts_.size() &&
      !worker_hosts_[rank].empty()) {
    name += " (" + worker_hosts_[rank] + ")";
  }
  return name;
}

bool WorkerImpl::SameHostAs(uint32_t rank) const {
  return worker_hosts_known_.load(std::memory_order_acquire) && rank < worker_hosts_.size() &&
         rank_ < worker_hosts_.size() &&
         MachineOf(worker_hosts_[rank]) == MachineOf(worker_hosts_[rank_]);
}

void WorkerImpl::SendRetire(uint64_t key) {
  wire::Header h;
  h.type = MsgType::kRetire;
  h.job = job_hash_;
  h.sender = rank_;
  h.key = key;
  // Rejoining: the restarted scheduler never hears of the retired key (nor do its servers
  // free it: docs/operations.md, "Names").
  SendUnlessRejoining(h).IgnoreError();
}

std::pair<wire::Header, wire::DeclareMsg> WorkerImpl::DeclarationOf(const TensorState& t) const {
  wire::Header h;
  h.type = MsgType::kDeclare;
  h.job = job_hash_;
  h.sender = rank_;
  h.key = t.key;
  h.dtype = static_cast<uint8_t>(t.dtype);
  h.count = t.count;
  // 0: the scheduler cuts the key as the job's tuning says.
  return {h, wire::DeclareMsg{t.name, opts_.partition_bytes.value_or(0), t.shape,
                              t.declared_mode, t.spec}};
}

PushPullHandle WorkerImpl::PushPull(const TensorHandle& tensor, std::span<std::byte> data,
                        const PushPullOptions& options) {
  return PushPullHandle(StartOp(tensor, data, options, nullptr));
}

PushPullHandle WorkerImpl::Run(const TensorHandle& tensor, std::span<const std::byte> input,
                               std::span<std::byte> output, const PushPullOptions& options) {
  return PushPullHandle(StartCollective(tensor, input, output, options));
}

WorkerStats WorkerImpl::Stats() const {
  WorkerStats s;
  s.push_pulls = counters_->push_pulls.load(std::memory_order_relaxed);
  s.bytes_reduced = counters_->bytes_reduced.load(std::memory_order_relaxed);
  s.groups = counters_->groups.load(std::memory_order_relaxed);
  s.fused_ops = counters_->fused_ops.load(std::memory_order_relaxed);
  s.bytes_packed = counters_->bytes_packed.load(std::memory_order_relaxed);
  s.bytes_unpacked = counters_->bytes_unpacked.load(std::memory_order_relaxed);
  s.bytes_copied_results = counters_->bytes_copied_results.load(std::memory_order_relaxed);
  s.protocol_errors = protocol_errors_.load(std::memory_order_relaxed);
  s.partitions_held = counters_->partitions_held.load(std::memory_order_relaxed);
  s.peak_bytes_ahead = counters_->peak_bytes_ahead.load(std::memory_order_relaxed);
  s.servers_lost = counters_->servers_lost.load(std::memory_order_relaxed);
  s.partitions_recovered = counters_->partitions_recovered.load(std::memory_order_relaxed);
  s.in_force = in_force_;
  if (local_) {
    s.bytes_copied_local = local_->bytes_copied();
    s.local_busy_ns = local_->busy_ns();
  }
  const transport::LaneStats ls = lanes_.stats();
  s.bytes_copied_eager = ls.bytes_copied_eager;
  s.bytes_copied_bounce = ls.bytes_copied_bounce;
  s.protocol_errors += ls.protocol_errors;
  return s;
}

Status WorkerImpl::Barrier(Clock::time_point deadline) {
  // Same-host ops nobody waits on go on while this caller blocks here (the others may need
  // their sums to start the next op on a tensor).
  if (local_ && local_->busy()) local_->Progress(LocalReduce::Step::kBackground);
  uint64_t seq, gen;
  bool send;
  {
    if (verdict_.failed()) return verdict_.failure();
    MutexLock lock(rendezvous_.mu);
    seq = ++rendezvous_.barrier_sent;
    send = !rendezvous_.reconnecting;  // else the rejoin tells the restarted scheduler
    gen = membership_->generation();
  }
  wire::Header h;
  h.type = MsgType::kBarrier;
  h.job = job_hash_;
  h.sender = rank_;
  h.round = seq;
  if (send) {
    Status sent = membership_->SendOn(gen, h, {}, deadline);
    if (!sent.ok() && opts_.scheduler_reconnect_timeout.count() == 0) return sent;
  }
  {
    MutexLock lock(rendezvous_.mu);
    if (!rendezvous_.cv.WaitUntil(rendezvous_.mu, deadline, [&] {
          rendezvous_.mu.AssertHeld();  // the wait runs it under `lock`
          return rendezvous_.barrier_released >= seq || verdict_.failed();
        })) {
      return Timeout("barrier " + std::to_string(seq) + " on rank " + std::to_string(rank_) +
                     ": not every worker arrived before the deadline");
    }
    if (rendezvous_.barrier_released >= seq) return Status::Ok();
  }
  return verdict_.failure();  // not under rendezvous_.mu: the verdict's lock is never taken there
}

Result<uint32_t> WorkerImpl::Join(Clock::time_point deadline) {
  bool resume = false;
  {
    MutexLock lock(rendezvous_.mu);
    if (rendezvous_.joining) return InvalidArgument("join() on rank " + std::to_string(rank_) +
                                         ": another join() of this worker is in progress");
    // An earlier join() that timed out stands (the scheduler has this rank as joined): this
    // one takes its release, come meanwhile, or waits for it.
    if (rendezvous_.join_timed_out) {
      rendezvous_.join_timed_out = false;
      if (rendezvous_.join_released) return rendezvous_.join_last;
      resume = true;
    } else {
      rendezvous_.join_released = false;
    }
    rendezvous_.joining = true;
  }
  struct Unjoin {
    internal::Rendezvous* r;
    ~Unjoin() {
      MutexLock lock(r->mu);
      r->joining = false;
    }
  } unjoin{&rendezvous_};
  if (!resume) GL_RETURN_IF_ERROR(AnnounceJoin(deadline));
  Status released;
  if (host_path_) {
    released = SitOutUntilReleased(deadline);
  } else {
    bool woken;
    {
      MutexLock lock(rendezvous_.mu);
      woken = rendezvous_.cv.WaitUntil(rendezvous_.mu, deadline, [&] {
        rendezvous_.mu.AssertHeld();  // the wait runs it under `lock`
        return rendezvous_.join_released || verdict_.failed();
      });
    }
    if (!woken) {
      released = Timeout("join() on rank " + std::to_string(rank_) +
                         ": not every worker had joined by the deadline");
    } else if (!rendezvous_.join_released) {
      released = verdict_.failure();
    }
  }
  MutexLock lock(rendezvous_.mu);
  if (released.code() == Code::kTimeout) rendezvous_.join_timed_out = true;
  if (!released.ok()) return released;
  return rendezvous_.join_last;
}

Status WorkerImpl::AnnounceJoin(Clock::time_point deadline) {
  // This worker's own operations first: they end as the others push their rounds.
  wire::JoinMsg msg;
  for (;;) {
    {
      MutexLock lock(mu_);
      if (verdict_.failed()) return verdict_.failure();
      const bool idle = std::none_of(tensors_.begin(), tensors_.end(), [](const auto& kv) {
        return kv.second->busy || !kv.second->queue.empty();
      });
      if (idle) {
        for (const auto& [key, t] : tensors_) msg.rounds.emplace_back(key, t->next_round);
        MutexLock rendezvous_lock(rendezvous_.mu);
        msg.barriers = rendezvous_.barrier_sent;
        break;
      }
    }
    if (Clock::now() >= deadline) {
      std::string busy;
      {
        MutexLock lock(mu_);
        for (const auto& [key, t] : tensors_) {
          if (!t->busy && t->queue.empty()) continue;
          busy += (busy.empty() ? ": '" : ", '") + t->name + "' (round " +
                  std::to_string(t->next_round) + (t->busy ? ", running" : ", queued") + ")";
        }
      }
      return Timeout("join() on rank " + std::to_string(rank_) +
                     ": this worker's own operations had not ended by the deadline" + busy);
    }
    if (local_) local_->Progress(LocalReduce::Step::kPoll);
    std::this_thread::sleep_for(std::chrono::microseconds(200));
  }
  if (msg.rounds.size() > wire::kMaxJoinKeys) {
    return ResourceExhausted("join() on rank " + std::to_string(rank_) + ": " +
                             std::to_string(msg.rounds.size()) + " tensors, more than the " +
                             std::to_string(wire::kMaxJoinKeys) + " a join can carry");
  }
  std::sort(msg.rounds.begin(), msg.rounds.end());
  // The same-host segment learns of the join when the scheduler has recorded it (kJoined, on
  // the control thread, in order with a release).
  wire::Header h;
  h.type = MsgType::kJoin;
  h.job = job_hash_;
  h.sender = rank_;
  uint64_t gen;
  {
    MutexLock lock(rendezvous_.mu);
    if (rendezvous_.reconnecting) {
      return Unavailable("join() on rank " + std::to_string(rank_) +
                         ": the scheduler is being restarted; a join needs it");
    }
    gen = membership_->generation();
  }
  return membership_->SendOn(gen, h, wire::Encode(msg), deadline);
}

Status WorkerImpl::Shutdown(Clock::time_point deadline) {
  if (shut_down_.exchange(true)) return Status::Ok();
  if (membership_) {
    membership_->StartLeaving();
    {
      // A goodbye needs a scheduler: one being restarted gets until the deadline to take this
      // worker back (else the job would wait for a member that is gone).
      bool rejoined;
      {
        MutexLock lock(rendezvous_.mu);
        rejoined = rendezvous_.cv.WaitUntil(rendezvous_.mu, deadline, [&] {
          rendezvous_.mu.AssertHeld();  // the wait runs it under `lock`
          return !rendezvous_.reconnecting;
        });
      }
      if (!rejoined) membership_->CancelRejoin();
    }
    membership_->Leave(deadline);
  }
  // Lanes first: once they are stopped nothing reads or writes a caller's buffer any more,
  // so the pending ops can be finished for good.
  lanes_.Stop();
  // Replies land in the copies of results directly (Receiver::KeepsBuffer): if the lane gave
  // up a receive it could not cancel (a hung server), the fabric may still write into one, so
  // they are never freed.
  if (lanes_.pull() && lanes_.pull()->stats().receives_abandoned != 0) {
    MutexLock lock(mu_);
    auto* leaked = new std::vector<std::vector<std::byte>>(std::move(orphans_));
    for (auto& [key, t] : tensors_) {
      for (auto& r : t->results) leaked->push_back(std::move(r));
    }
    GL_LOG(kWarn) << "worker " << rank_ << ": " << lanes_.pull()->stats().receives_abandoned
                  << " reply receive(s) abandoned; leaking " << leaked->size()
                  << " result copies they may still write";
  }
  FailAll(Aborted("worker " + std::to_string(rank_) + " shut down"), /*force=*/true);
  peer_.StopReader();  // before the lanes go (member order): nothing reads or sends after it
  if (lanes_.open() && lanes_.reply().stats().receives_abandoned != 0) peer_.KeepBuffersForever();
  if (sit_out_.joinable()) sit_out_.join();  // sees the failure within its 100 ms slice
  // Ends the same-host ops (the driving thread is the only one touching their buffers).
  if (local_) local_->Stop();
  return Status::Ok();
}

Result<std::unique_ptr<Worker>> ConnectWorkerOn(const WorkerOptions& options,
                                                std::shared_ptr<transport::Fabric> fabric) {
  auto w = std::make_unique<WorkerImpl>(options, std::move(fabric));
  GL_RETURN_IF_ERROR(w->Init());
  return std::unique_ptr<Worker>(std::move(w));
}

Result<std::unique_ptr<Worker>> Worker::Connect(const WorkerOptions& options) {
  return ConnectWorkerOn(options, nullptr);
}

}  // namespace gradlink
