// The scheduler's frames as the worker takes them (worker_impl.h), on the membership's control
// thread (control/membership.h): plans (kAssign), barrier releases, failover, the scheduler's
// verdicts, rejoining a restarted scheduler; the job's failure, sticky, handed to every op.
#include <algorithm>

#include "common/log.h"
#include "control/join.h"
#include "worker/worker_impl.h"

namespace gradlink {

using transport::Lane;
using transport::PeerId;
using wire::MsgType;

namespace {

uint32_t ServersSpanned(const std::vector<wire::PartitionPlan>& parts) {
  std::vector<uint32_t> servers;
  for (const wire::PartitionPlan& p : parts) servers.push_back(p.server);
  std::sort(servers.begin(), servers.end());
  return static_cast<uint32_t>(std::unique(servers.begin(), servers.end()) - servers.begin());
}

}  // namespace

void WorkerImpl::OnDataPeerFailed(transport::PeerId peer, const Status& s) {
  MutexLock lock(mu_);
  const int64_t id = directory_.IdOfPeer(peer);
  if (id >= 0) {
    if (directory_.lost(static_cast<uint32_t>(id))) return;  // declared lost: its partitions moved
    verdict_.Note(s, peer, static_cast<uint32_t>(id));
    return;
  }
  verdict_.Note(s, peer);
}

bool WorkerImpl::NoteServerFailureLocked(uint32_t server, const Status& s) {
  if (directory_.lost(server)) return true;
  if (!directory_.failover() || verdict_.failed() || server >= directory_.ids()) return false;
  if (!verdict_.pending()) {
    verdict_.Note(PeerLost("worker " + std::to_string(rank_) + ": " +
                           directory_.RecordedName(server) + " failed: " + s.message()),
                  std::nullopt, server);
  }
  return true;
}

void WorkerImpl::OnServerLost(uint32_t server) {
  MutexLock lock(mu_);
  if (!directory_.MarkLost(server)) {
    protocol_errors_++;
    return;
  }
  counters_->servers_lost.fetch_add(1, std::memory_order_relaxed);
  const std::string name = directory_.RecordedName(server);
  GL_LOG(kWarn) << "worker " << rank_ << ": " << name
                << " was lost; what it held moves to the other servers (failover)";
  // Replies it is still writing (a receive cannot be cancelled) land in buffers given up
  // now, kept until the worker ends: a server that hangs (SIGSTOP) holds no op.
  for (auto& [id, op] : ops_) {
    TensorState& t = *op->tensor;
    if (!KeepsResults(t)) continue;
    for (uint32_t p = 0; p < t.receiving_from.size(); ++p) {
      if (t.receiving_from[p] != server + 1) continue;
      orphans_.push_back(std::move(t.results[p]));
      t.results[p] = std::vector<std::byte>();
      t.result_round[p] = TensorState::kNoResult;
      t.receiving_from[p] = 0;
      op->receiving--;
    }
  }
  // Likewise the pushes in flight to it: given up now, and pushed again where the key moves.
  lanes_.push().FailPeer(directory_.peer(server),
                         PeerLost(name + " was declared lost by the scheduler"));
  verdict_.ClearIfServer(server);
}

Status WorkerImpl::OnServerJoined(const transport::Frame& f) {
  GL_ASSIGN_OR_RETURN(const wire::Member m, wire::DecodeMember(f.payload));
  const uint64_t id = f.header.count;
  if (m.role != wire::Role::kServer || m.id != id || id < num_servers_ ||
      id >= num_servers_ + wire::kMaxServersJoined) {
    return ProtocolError("kServerJoined naming server " + std::to_string(id) +
                         ", not a new server's entry");
  }
  std::string name = "server " + std::to_string(id) + " (" + m.host + ")";
  // Through the lane's progress thread: not under mu_.
  Result<PeerId> peer = lanes_.push().Connect(m.push_address, name);
  // Under mu_ (as every change of the directory): an op's critical section sees one version.
  MutexLock lock(mu_);
  // Ids between the ones known and this one are servers that never joined: never planned.
  if (!directory_.Join(static_cast<uint32_t>(id), name, peer.ok() ? &*peer : nullptr)) {
    return ProtocolError("kServerJoined for " + name + ", which this worker knows already");
  }
  if (!peer.ok()) {
    // It stays unreachable (lost) here: a plan that moves partitions to it fails this worker
    // (ReplanLocked), naming it, instead of pushing into nothing.
    GL_LOG(kWarn) << "worker " << rank_ << ": cannot reach standby " << name << ": "
                  << peer.status().ToString();
    return Status::Ok();
  }
  GL_LOG(kInfo) << "worker " << rank_ << ": " << name << " joined as a standby";
  return Status::Ok();
}

Status WorkerImpl::ReplanLocked(TensorState& t, std::vector<wire::PartitionPlan> parts) {
  if (!t.planned || !t.plan_status.ok() || parts.size() != t.parts.size()) {
    return ProtocolError("kAssign replan of '" + t.name +
                         "', which is not a planned key of as many partitions");
  }
  std::vector<uint32_t> moved;
  for (uint32_t p = 0; p < parts.size(); ++p) {
    if (parts[p].offset != t.parts[p].offset || parts[p].count != t.parts[p].count ||
        parts[p].server >= directory_.ids()) {
      return ProtocolError("kAssign replan of '" + t.name + "' changes partition " +
                           std::to_string(p) + " other than by its server");
    }
    if (directory_.lost(parts[p].server)) {
      return PeerLost("kAssign replan of '" + t.name + "' moves partition " + std::to_string(p) +
                      " to " + directory_.Name(parts[p].server) +
                      ", which is lost or which this worker cannot reach");
    }
    if (parts[p].server != t.parts[p].server) moved.push_back(p);
  }
  std::vector<uint32_t> old_owner(t.parts.size());
  for (uint32_t p = 0; p < t.parts.size(); ++p) old_owner[p] = t.parts[p].server;
  // In place: a hierarchical op's host job reads the partitions' offsets and counts through a
  // span of t.parts, without mu_; only the servers change.
  for (uint32_t p = 0; p < parts.size(); ++p) t.parts[p].server = parts[p].server;
  t.servers_spanned = ServersSpanned(t.parts);
  if (t.local.has_value()) return Status::Ok();  // summed on this host: no server sees it
  std::shared_ptr<Op> op;
  for (auto& [id, o] : ops_) {
    if (o->tensor.get() == &t && o->started && !o->finished) op = o;
  }
  const uint64_t size = DataTypeSize(t.wire);
  // A key summed per host first: the new server hears of each partition from its host's
  // pusher only (its contributors), which reports the host's last result and pushes the
  // host's partial again (op->partial: a pulled sum lands there only once whole).
  const bool by_host = t.mode != topology::Mode::kFlat;
  uint64_t reported = 0;
  for (uint32_t p : moved) {
    if (by_host && t.pusher[p] != hosts_.local_rank[rank_]) continue;
    ++reported;
    // Moved off a server that is still up (rebalancing onto one that joined): a reply it is
    // still writing lands in a buffer given up now, as after a loss (OnServerLost); its later
    // replies are refused (OnHeader, OnPayload).
    if (op && KeepsResults(t) && p < t.receiving_from.size() &&
        t.receiving_from[p] == old_owner[p] + 1) {
      orphans_.push_back(std::move(t.results[p]));
      t.results[p] = std::vector<std::byte>();
      t.result_round[p] = TensorState::kNoResult;
      t.receiving_from[p] = 0;
      op->receiving--;
    }
    const wire::PartitionPlan& plan = t.parts[p];
    // A collective's partition that this rank neither pushes nor pulls: no server waits for it
    // (nor for anyone, when nobody receives it).
    if (!t.spec.is_sum() && !t.roles[p].participates()) continue;
    Outgoing r;
    r.peer = directory_.peer(plan.server);
    r.header.type = MsgType::kRecover;
    r.header.job = job_hash_;
    r.header.sender = rank_;
    r.header.key = t.key;
    r.header.partition = p;
    r.header.dtype = static_cast<uint8_t>(t.wire);
    r.header.cookie = op ? op->id : 0;
    const bool has_result =
        p < t.result_round.size() && t.result_round[p] != TensorState::kNoResult;
    const bool repush = op && !op->abandoned &&
                        (op->parts[p] == Op::Part::kSent || op->parts[p] == Op::Part::kPushed ||
                         op->parts[p] == Op::Part::kLeft);
    if (has_result) {
      r.header.flags = wire::kFlagHasResult;
      r.header.round = t.result_round[p];
      r.header.count = plan.count;
      // A copy: this worker's next reply for the partition lands in t.results[p].
      auto copy = std::make_shared<const std::vector<std::byte>>(t.results[p]);
      r.payload = *copy;
      r.header.payload_bytes = r.payload.size();
      r.owned = std::move(copy);
    } else if (op && op->parts[p] == Op::Part::kDone) {
      // Received this round's result for it, which only a sum keeps: the round it pushes next
      // is the one after. A rank that has not received it then fails the round, saying so.
      r.header.round = op->round.load() + 1;
    } else {
      r.header.round = op ? op->round.load() : t.next_round;  // the round it pushes next
    }
    if (repush) r.header.flags |= wire::kFlagInputFollows;
    to_issue_.push_back(std::move(r));
    if (repush) {
      ReleaseCreditLocked(op, p, /*left=*/false);  // a send to the lost server may never complete
      const uint64_t bytes = PartBytes(*op, p);
      Outgoing o;
      o.peer = directory_.peer(plan.server);
      o.header = PushHeader(*op, p, bytes);
      o.payload = op->host ? op->partial[p] : op->input.subspan(plan.offset * size, bytes);
      o.sent = NewPushSentLocked(op, p, plan.server);
      op->sending++;
      to_issue_.push_back(std::move(o));
    }
  }
  pumped_ = pumped_ || reported > 0;
  counters_->partitions_recovered.fetch_add(reported, std::memory_order_relaxed);
  return Status::Ok();
}

std::optional<Status> WorkerImpl::ExpiredPeerFailure() {
  // No state lock: the verdict and the directory have their own.
  std::optional<internal::JobVerdict::Expired> expired = verdict_.ExpiredBy(
      Clock::now(), kVerdictGrace, directory_.failover() ? kFailoverGrace : kVerdictGrace);
  if (!expired) return std::nullopt;
  if (expired->peer) {
    return PeerLost("worker " + std::to_string(rank_) + ": connection to " +
                    directory_.NameOfPeer(*expired->peer) +
                    " failed: " + expired->status.message());
  }
  return expired->status;
}

void WorkerImpl::FailJob(const Status& s) {
  FailAll(s);
  lanes_.Stop();
  FailAll(s, /*force=*/true);
}

void WorkerImpl::FailAll(const Status& s, bool force) {
  FailOps(s, force);
  // Point-to-point after the ops, with the job's failure (the first one stands).
  peer_.FailAll(verdict_.failure(), /*lanes_stopped=*/force);
}

void WorkerImpl::FailOps(const Status& s, bool force) {
  MutexLock lock(mu_);
  // Set under mu_: an op starting (StartOp) sees either the failure or every op ended here.
  const Status failure = verdict_.Fail(s);
  // Same-host ops end on their driving thread, which alone touches their buffers.
  if (local_) local_->Fail(failure);
  EndParkedOpsLocked();  // with the verdict (before the loop: a parked host op is not yet done)
  auto ops = ops_;
  for (auto& [id, op] : ops) {
    // An endpoint's loss is a symptom; the job's failure names the cause.
    if (op->failure.code() == Code::kPeerLost) op->failure = failure;
    AbandonLocked(*op, failure);
    // Even when forced, an op with a pull still being written (a receive the stopped lane
    // could not cancel) stays pending: its buffer must outlive that write.
    // A hierarchical op's host job writes its tensor until it ends (LocalReduce::Fail ends it).
    if (force && op->receiving == 0 && (!op->host || op->host_done)) {
      FinishLocked(*op, op->failure);
    } else {
      TryFinishLocked(*op);
    }
  }
  for (auto& [key, t] : tensors_) {
    while (!t->queue.empty()) {
      auto op = t->queue.front();
      t->queue.pop_front();
      FinishLocked(*op, failure);
    }
  }
  rendezvous_.Wake();  // Barrier(), Join() and Shutdown() see the failure
}

ControlVerdict WorkerImpl::OnControl(const transport::Frame& f) {
  switch (f.header.type) {
    case MsgType::kAssign:
    case MsgType::kJoinRelease: {
      Status s = f.header.type == MsgType::kAssign ? OnAssign(f) : OnJoinRelease(f);
      if (!s.ok()) {
        FailAll(s);
        return ControlVerdict::End(s);
      }
      break;
    }
    case MsgType::kServerLost:
      OnServerLost(static_cast<uint32_t>(f.header.count));
      break;
    case MsgType::kPeerAddress:
      peer_.OnAddress(f.header, f.payload);
      break;
    case MsgType::kStallNotice: {
      // The stall inspector's message: this worker has pushed (or declared) what others have not.
      Result<std::string> text = wire::DecodeText(f.payload);
      if (text.ok()) {
        GL_LOG(kWarn) << "worker " << rank_ << ": " << *text;
      } else {
        protocol_errors_++;
      }
      break;
    }
    case MsgType::kServerJoined:
      if (Status s = OnServerJoined(f); !s.ok()) {
        FailAll(s);
        return ControlVerdict::End(s);
      }
      break;
    case MsgType::kBarrierRelease: {
      MutexLock lock(rendezvous_.mu);
      rendezvous_.barrier_released = std::max(rendezvous_.barrier_released, f.header.round);
      rendezvous_.cv.NotifyAll();
      break;
    }
    case MsgType::kJoined:
      // Our join is recorded: the others' same-host chunks go on without us from now on.
      if (f.header.count != rank_) {
        protocol_errors_++;
      } else if (local_) {
        local_->SetJoined();
      }
      break;
    case MsgType::kAbort: {
      Status s = AbortStatus(f, "job aborted");
      FailJob(s);
      return ControlVerdict::End(s);
    }
    default:
      protocol_errors_++;
      GL_LOG(kWarn) << "worker " << rank_ << ": unexpected control message "
                    << static_cast<int>(f.header.type);
  }
  return ControlVerdict::Continue();
}

Status WorkerImpl::OnTick() {
  if (std::optional<Status> lost = ExpiredPeerFailure()) return *lost;
  EndParkedOps();  // same-host ops whose verdict grace has passed
  peer_.Tick(Clock::now());  // point-to-point operations past their deadline
  return Status::Ok();
}

Result<Rejoining> WorkerImpl::PrepareRejoin(const std::string& why) {
  wire::RegisterMsg reg;
  reg.role = wire::Role::kWorker;
  reg.requested_rank = static_cast<int32_t>(rank_);
  reg.host = in_force_.host;
  reg.push_address = lanes_.push().address();
  reg.pull_address = lanes_.reply().address();
  wire::ResumeState st;
  std::vector<ControlFrame> frames;
  {
    MutexLock lock(mu_);
    if (verdict_.failed()) return verdict_.failure();
    MutexLock rendezvous_lock(rendezvous_.mu);  // the tensors and the barriers of one moment
    if (rendezvous_.joining) {
      return PeerLost(why + "; this rank had joined (join()), and a join does not survive a "
                            "scheduler restart");
    }
    rendezvous_.reconnecting = true;
    // Everything the restarted scheduler must know, as of now; what this worker declares or
    // enters from here on is sent once it is back.
    for (const auto& [key, t] : tensors_) {
      if (!t->declared) continue;
      t->declare_pending = false;
      auto [declared, declaration] = DeclarationOf(*t);
      wire::ResumeKeyMsg m;
      m.declare = std::move(declaration);
      if (t->planned && t->plan_status.ok()) {
        m.state = wire::ResumeKeyMsg::Plan::kPlanned;
        m.plan = {t->name, t->parts, static_cast<uint8_t>(t->mode), t->spec};
      } else if (t->planned) {
        m.state = wire::ResumeKeyMsg::Plan::kRefused;
        m.refusal = static_cast<uint8_t>(t->plan_status.code());
        m.refusal_text = t->plan_status.message();
      }
      ControlFrame f;
      f.header = declared;
      f.header.type = MsgType::kResumeKey;
      f.payload = wire::Encode(m);
      frames.push_back(std::move(f));
    }
    st.keys = static_cast<uint32_t>(frames.size());
    st.barriers_entered = rendezvous_.barrier_sent;
    st.barriers_released = rendezvous_.barrier_released;
    st.server_ids = directory_.ids();
    for (uint32_t id = 0; id < st.server_ids; ++id) {
      if (directory_.lost(id)) st.lost_servers.push_back(id);
    }
    rendezvous_.rejoin_barriers_told = rendezvous_.barrier_sent;
  }
  reg.resume = std::move(st);
  return Rejoining{std::move(reg), std::move(frames)};
}

Status WorkerImpl::CheckWelcome(const wire::WelcomeMsg& w) {
  if (w.your_id != rank_ || w.num_workers != size_ || w.num_servers != num_servers_) {
    return ProtocolError(
        "the restarted scheduler at " + opts_.scheduler + " welcomed rank " +
        std::to_string(rank_) + " back as rank " + std::to_string(w.your_id) + " of " +
        std::to_string(w.num_workers) + " workers and " + std::to_string(w.num_servers) +
        " servers");
  }
  return Status::Ok();
}

void WorkerImpl::OnRejoined(const Status& result, uint64_t generation) {
  std::vector<std::pair<wire::Header, wire::DeclareMsg>> declares;
  uint64_t barrier = 0;
  {
    MutexLock lock(mu_);
    MutexLock rendezvous_lock(rendezvous_.mu);  // the tensors declared while it was away
    rendezvous_.reconnecting = false;
    rendezvous_.cv.NotifyAll();
    if (!result.ok()) return;
    for (const auto& [key, t] : tensors_) {
      if (!t->declare_pending) continue;
      t->declare_pending = false;
      declares.push_back(DeclarationOf(*t));
    }
    if (rendezvous_.barrier_sent > rendezvous_.rejoin_barriers_told) {
      barrier = rendezvous_.barrier_sent;
    }
  }
  // A send that fails means this scheduler is gone too: the next rejoin tells the one after it
  // everything declared (each is `declared`).
  const auto deadline = Clock::now() + std::chrono::seconds(10);
  for (const auto& [h, d] : declares) {
    membership_->SendOn(generation, h, wire::Encode(d), deadline).IgnoreError();
  }
  if (barrier != 0) {
    wire::Header h;
    h.type = MsgType::kBarrier;
    h.job = job_hash_;
    h.sender = rank_;
    h.round = barrier;
    membership_->SendOn(generation, h, {}, deadline).IgnoreError();
  }
  peer_.LookUpAgain();  // point-to-point addresses asked of the scheduler that went away
}

Status WorkerImpl::OnJoinRelease(const transport::Frame& f) {
  GL_ASSIGN_OR_RETURN(wire::JoinMsg release, wire::DecodeJoin(f.payload));
  if (f.header.count >= size_) return ProtocolError("kJoinRelease naming rank " +
                                                    std::to_string(f.header.count));
  // Every rank has joined, so none is summing: the segment forgets who joined before anyone
  // starts again (each catches its own counters up as it starts a tensor's next round).
  if (local_) local_->ClearJoined();
  MutexLock lock(mu_);
  for (const auto& [key, round] : release.rounds) {
    auto it = tensors_.find(key);
    if (it == tensors_.end()) {
      resume_rounds_[key] = round;
    } else {
      it->second->next_round = std::max(it->second->next_round, round);
    }
  }
  {
    MutexLock rendezvous_lock(rendezvous_.mu);
    rendezvous_.barrier_sent = std::max(rendezvous_.barrier_sent, release.barriers);
    rendezvous_.barrier_released = std::max(rendezvous_.barrier_released, release.barriers);
    rendezvous_.join_last = static_cast<uint32_t>(f.header.count);
    rendezvous_.join_released = true;
    rendezvous_.cv.NotifyAll();
  }
  if (local_) local_->Wake();  // a joined worker of a host path waits on the segment
  return Status::Ok();
}

Status WorkerImpl::OnAssign(const transport::Frame& f) {
  std::shared_ptr<TensorState> t;
  {
    MutexLock lock(mu_);
    auto it = tensors_.find(f.header.key);
    if (it == tensors_.end()) {
      // The plan of a declaration since retired (its label declared again): nothing uses it.
      if (retired_keys_.count(f.header.key) != 0) return Status::Ok();
      return ProtocolError("kAssign for a key this worker never declared");
    }
    t = it->second;
  }
  Status plan_status;
  std::vector<wire::PartitionPlan> parts;
  std::vector<layout::Role> roles;
  topology::Mode mode = topology::Mode::kFlat;
  if (f.header.code != 0) {
    auto text = wire::DecodeText(f.payload);
    plan_status = Status(static_cast<Code>(f.header.code), text.ok() ? *text : "(no reason)");
  } else {
    if (f.header.dtype != static_cast<uint8_t>(t->dtype) || f.header.count != t->count) {
      return ProtocolError("kAssign shape differs from the declaration");
    }
    uint32_t server_ids;  // the job's servers and the standbys that joined it
    {
      MutexLock lock(mu_);  // as the plan below: one version of the directory
      server_ids = directory_.ids();
    }
    GL_ASSIGN_OR_RETURN(wire::AssignMsg a, wire::DecodeAssign(f.payload, t->count, server_ids));
    if (a.spec != t->spec) return ProtocolError("kAssign of another collective than declared");
    GL_RETURN_IF_ERROR(layout::CheckPlan(a.spec, size_, t->count, a.partitions));
    if (!a.spec.is_sum()) {
      const std::vector<layout::Segment> segments = layout::Segments(a.spec, size_, t->count);
      for (const wire::PartitionPlan& p : a.partitions) {
        const uint32_t seg = layout::SegmentAt(segments, p.offset);
        roles.push_back(layout::RoleOf(a.spec, segments, seg, size_, rank_, p.offset));
      }
    }
    parts = std::move(a.partitions);
    mode = static_cast<topology::Mode>(a.mode);
  }
  IssueBatch batch;
  std::optional<uint64_t> retired;
  if (f.header.flags & wire::kFlagReplan) {
    if (!plan_status.ok()) return ProtocolError("a refusal sent as a replan");
    {
      MutexLock lock(mu_);
      GL_RETURN_IF_ERROR(ReplanLocked(*t, std::move(parts)));
      PumpLocked();  // what the replan let back into the queue
      TakeIssueLocked(&batch);
    }
    Issue(std::move(batch));
    return Status::Ok();
  }
  {
    MutexLock lock(mu_);
    if (t->planned) return ProtocolError("key assigned twice");
    for (const wire::PartitionPlan& p : parts) {
      if (directory_.lost(p.server)) {
        return PeerLost("kAssign of '" + t->name + "' places a partition on " +
                        directory_.Name(p.server) +
                        ", which is lost or which this worker cannot reach");
      }
    }
    t->planned = true;
    t->plan_status = plan_status;
    t->parts = std::move(parts);
    t->roles = std::move(roles);
    uint64_t pushed = 0, pulled = 0;
    for (uint32_t p = 0; p < t->roles.size(); ++p) {
      pushed += t->roles[p].push ? t->parts[p].count : 0;
      pulled += t->roles[p].pull ? t->parts[p].count : 0;
    }
    t->acks_behind_data = pushed > 0 && pulled >= pushed;
    t->order.clear();
    for (uint32_t p = 0; p < t->roles.size(); ++p) {
      if (t->roles[p].participates()) t->order.push_back(p);
    }
    std::stable_sort(t->order.begin(), t->order.end(), [&](uint32_t a, uint32_t b) {
      return t->roles[a].turn < t->roles[b].turn;
    });
    t->servers_spanned = ServersSpanned(t->parts);
    if (t->plan_status.ok()) t->plan_status = PlanHostLocked(*t, mode);
    if (!plan_status.ok()) {
      for (TensorState* f : t->fused_in) MemberFailedLocked(*f, *t);
    }
    StartNextLocked(*t);
    PumpLocked();
    TakeIssueLocked(&batch);
    // A refused plan retires its key at once (its queued ops have just failed with the
    // refusal, and so will later ones on its handles): the next Declare of the label gets a
    // new key, and the scheduler forgets this one once every declarer has retired it, so that
    // a rank that had joined meanwhile and declares it later is planned afresh, not refused
    // for what happened while it sat out.
    if (!plan_status.ok()) retired = RetireLocked(t);
  }
  Issue(std::move(batch));
  if (retired) SendRetire(*retired);
  // The control thread does not copy tensors.
  if (local_) local_->Progress(LocalReduce::Step::kBackground);
  return Status::Ok();
}

}  // namespace gradlink
