// The server's side of its membership: what the scheduler tells it, on the control thread
// (control/membership.h calls these). Workers that leave or join, the release of a join, the
// job's end, and what a restarted scheduler must hear to take this server back.
//
// Nothing here waits for the data plane: what partitions must do (a worker gone, a join) is
// posted to each partition's owner thread, and the answer the scheduler waits for (a join
// release's ack) goes out from this thread's next tick once every owner has counted down. The
// control thread stays free to heartbeat (the scheduler drops a member silent for
// kSilenceLimit), and the owners (a lane's progress thread among them) never touch the socket.
#include "common/log.h"
#include "server/server_impl.h"

namespace gradlink {

using wire::MsgType;

ControlVerdict ServerImpl::OnControl(const transport::Frame& f) {
  switch (f.header.type) {
    case MsgType::kAssign: {
      if (Status s = OnAssign(f); !s.ok()) {
        protocol_errors_++;
        Finish(s);
        return ControlVerdict::End(s, /*hang_up=*/true);
      }
      // The slots are there: the plan's version goes back, so the scheduler can hand the plan
      // to the workers (a failover's replan too).
      wire::Header ack;
      ack.type = MsgType::kAssignAck;
      ack.job = job_hash_;
      ack.sender = id_;
      ack.key = f.header.key;
      ack.round = f.header.round;
      membership_->Reply(ack);
      break;
    }
    case MsgType::kRetire:
      OnRetire(f.header.key);
      break;
    case MsgType::kMemberLeft:
      OnMemberLeft(f.header.count);
      break;
    case MsgType::kJoined:
      OnJoined(f.header.count);
      break;
    case MsgType::kJoinRelease:
      OnJoinRelease();
      break;
    case MsgType::kShutdown:
      Finish(Status::Ok());
      return ControlVerdict::End(Status::Ok());
    case MsgType::kAbort: {
      Status s = AbortStatus(f, "job aborted by the scheduler");
      Finish(s);
      return ControlVerdict::End(s);
    }
    default:
      protocol_errors_++;
      GL_LOG(kWarn) << "server " << id_ << ": unexpected control message "
                    << static_cast<int>(f.header.type);
  }
  return ControlVerdict::Continue();
}

Status ServerImpl::OnTick() {
  FreeRetired();
  CheckStalls();
  if (!release_) return Status::Ok();
  if (const size_t left = release_->partitions_left.load(); left != 0) {
    if (transport::Clock::now() <= release_->deadline) return Status::Ok();
    std::string which;
    for (size_t i = 0; i < release_->parts.size(); ++i) {
      if (release_->done[i].load()) continue;
      if (!which.empty()) which += ", ";
      which += DescribeOwner(release_->parts[i].first, release_->parts[i].second);
    }
    return Internal(std::to_string(left) + " partitions did not forget the join within " +
                    std::to_string(kJoinReleaseLimit.count()) + " s: " + which);
  }
  release_.reset();
  AckJoinRelease();
  return Status::Ok();
}

void ServerImpl::OnLost(const Status& why) {
  Finish(why);
  if (const auto channel = membership_->channel()) channel->Close();
}

// The scheduler is gone but did not end the job: register again as this server, serving
// pushes meanwhile. A join release in progress is not answered: it was the lost scheduler's
// (a join does not survive a restart; the partitions still forget it).
Result<Rejoining> ServerImpl::PrepareRejoin(const std::string&) {
  release_.reset();
  Rejoining r;
  r.reg = reg_;
  r.reg.requested_rank = static_cast<int32_t>(id_.load());
  r.reg.resume = wire::ResumeState{};
  return r;
}

Status ServerImpl::CheckWelcome(const wire::WelcomeMsg& welcome) {
  if (welcome.your_id != id_ || welcome.num_workers != num_workers_) {
    return ProtocolError("the restarted scheduler at " + opts_.scheduler + " welcomed server " +
                         std::to_string(id_) + " back as server " +
                         std::to_string(welcome.your_id) + " of a job of " +
                         std::to_string(welcome.num_workers) + " workers");
  }
  return Status::Ok();
}

void ServerImpl::OnMemberLeft(uint64_t rank) {
  if (rank >= num_workers_) {
    protocol_errors_++;
    return;
  }
  ReaderLock lock(parts_mu_);
  for (auto& [id, part] : parts_) {
    PartitionState* p = part.get();
    RunOnOwner(*p, [this, p, rank] {
      if (p->MarkGone(static_cast<uint32_t>(rank))) RunEngine(p);
    });
  }
}

// Worker `rank` joined (Worker::Join): every partition's rounds go on without it.
void ServerImpl::OnJoined(uint64_t rank) {
  if (rank >= num_workers_ ||
      std::find(joined_.begin(), joined_.end(), rank) != joined_.end()) {
    protocol_errors_++;
    return;
  }
  joined_.push_back(static_cast<uint32_t>(rank));
  ReaderLock lock(parts_mu_);
  for (auto& [id, part] : parts_) {
    PartitionState* p = part.get();
    RunOnOwner(*p, [this, p, rank] {
      if (p->SetJoined(static_cast<uint32_t>(rank), true)) RunEngine(p);
    });
  }
}

// Every worker joined: every partition forgets it, on its own thread, before the ack lets the
// workers push again. Each owner counts down; the control thread's next tick (OnTick, at most
// 100 ms later) sends the ack once all have, or fails the server if they have not within
// kJoinReleaseLimit (an owner that stopped never runs the call). A kJoined that follows is
// posted behind these on the same owners.
void ServerImpl::OnJoinRelease() {
  auto release = std::make_shared<JoinRelease>();
  release->ranks = std::move(joined_);
  joined_.clear();
  release->deadline = transport::Clock::now() + kJoinReleaseLimit;
  if (!release->ranks.empty()) {
    ReaderLock lock(parts_mu_);
    // Counted before any owner can count down.
    release->partitions_left = parts_.size();
    release->done = std::make_unique<std::atomic<bool>[]>(parts_.size());
    for (auto& [id, part] : parts_) {
      PartitionState* p = part.get();
      const size_t i = release->parts.size();
      release->parts.emplace_back(id.first, id.second);
      RunOnOwner(*p, [p, release, i] {
        for (uint32_t rank : release->ranks) p->SetJoined(rank, false);
        release->done[i].store(true);
        release->partitions_left.fetch_sub(1);
      });
    }
  }
  if (release->partitions_left.load() == 0) {
    AckJoinRelease();  // nothing to forget
    return;
  }
  release_ = std::move(release);
}

// On the control thread.
void ServerImpl::AckJoinRelease() {
  wire::Header ack;
  ack.type = MsgType::kJoinRelease;
  ack.job = job_hash_;
  ack.sender = id_;
  membership_->Reply(ack);
}

}  // namespace gradlink
