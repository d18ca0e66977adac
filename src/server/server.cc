#include "gradlink/server.h"

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstring>
#include <ctime>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <shared_mutex>
#include <thread>

#include "common/cpus.h"
#include "common/log.h"
#include "common/naming.h"
#include "common/work_queue.h"
#include "server/partition_state.h"
#include "server/thread_plan.h"
#include "control/join.h"
#include "control/layout.h"
#include "control/topology.h"
#include "server/start_on.h"
#include "gradlink/env.h"

namespace gradlink {
namespace {

using server::PartitionState;
using transport::Lane;
using transport::PeerId;
using wire::MsgType;

constexpr auto kPoll = std::chrono::milliseconds(100);

// Partitions of at most this many wire bytes are summed on the push lane's progress thread
// instead of an engine thread: the exception to "never sum on the I/O thread" for partitions
// where the sum costs less than the hand-off it replaces. Summing two 16 KiB fp32 pushes takes
// ~0.4 us warm (a few times that cold), about what receiving the payloads costs that thread;
// one engine wake-up costs a futex wake and two context switches, and tens of us of latency
// when cores are oversubscribed (4 KiB push_pull, 2 workers + 2 servers on 2 cores: ~11% fewer
// context switches, median 83 -> 62 us; bench/RESULTS.md, "The inline-sum exception"). Larger
// partitions keep the rule: a 4 MiB sum (~0.5 ms) would hold up every other push on the lane.
constexpr uint64_t kInlineSumBytes = 16 << 10;

// Free round buffers a server keeps for the next rounds (buffer_pool.h). The steady state of a
// job needs as many as its rounds in flight hold at their peak, which the workers' leads bound:
// 2 partitions of 64 KiB ahead per server and worker on a network (control/tuning.h).
constexpr uint64_t kPoolFreeBytes = uint64_t{256} << 20;

double ProcessCpuSeconds() {
  timespec t{};
  if (clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &t) != 0) return 0;
  return static_cast<double>(t.tv_sec) + static_cast<double>(t.tv_nsec) * 1e-9;
}

class ServerImpl final : public Server {
 public:
  ServerImpl(const ServerOptions& o, std::shared_ptr<transport::Fabric> fabric)
      : opts_(o), job_hash_(wire::JobHash(o.job)), fabric_(std::move(fabric)) {}
  ~ServerImpl() override { Stop(); }

  Status Init() {
    cpu_at_start_ = ProcessCpuSeconds();
    // The CPU list is checked before anything starts: a server that cannot run where it was
    // asked to says so at once, not after joining the job.
    if (!opts_.cpus.empty()) {
      GL_ASSIGN_OR_RETURN(thread_inputs_.pinned, ParseCpuList("server CPUs", opts_.cpus));
    }
    thread_inputs_.allowed = AllowedCpus();
    thread_inputs_.engines = opts_.engine_threads;
    thread_inputs_.lanes = opts_.single_lane ? 1 : 2;
    GL_RETURN_IF_ERROR(server::PlanThreads(thread_inputs_).status());
    if (!wire::IsValidServerWeight(opts_.weight)) {
      return InvalidArgument("server " + wire::ServerWeightError(opts_.weight));
    }
    const auto deadline = transport::Clock::now() + opts_.connect_timeout;
    GL_ASSIGN_OR_RETURN(fabric_, FabricOrUcx(std::move(fabric_)));
    GL_ASSIGN_OR_RETURN(push_lane_, fabric_->CreateLane("server push lane"));
    if (!opts_.single_lane) {
      GL_ASSIGN_OR_RETURN(pull_lane_, fabric_->CreateLane("server pull lane"));
    }
    if (opts_.secret) {
      auto auth = std::make_shared<const security::LaneAuthenticator>(*opts_.secret, job_hash_);
      push_lane_->SetAuthenticator(auth);
      if (pull_lane_) pull_lane_->SetAuthenticator(auth);
    }
    GL_RETURN_IF_ERROR(push_lane_->Start(&push_receiver_));
    if (pull_lane_) GL_RETURN_IF_ERROR(pull_lane_->Start(&pull_receiver_));

    wire::RegisterMsg reg;
    reg.role = wire::Role::kServer;
    reg.requested_rank = opts_.id < 0 ? -1 : opts_.id;
    reg.host = opts_.host_name.empty() ? LocalHostName() : opts_.host_name;
    reg.push_address = push_lane_->address();
    reg.pull_address = reply_lane().address();
    reg.weight = opts_.weight;
    reg.memory_budget = opts_.memory_budget_bytes;
    reg.available_memory = AvailableMemory();
    reg.standby = opts_.standby;
    GL_ASSIGN_OR_RETURN(Joined joined, JoinJob(opts_.scheduler, job_hash_, reg, deadline, opts_.secret));
    channel_ = std::move(joined.channel);
    reg_ = reg;
    id_.store(joined.welcome.your_id, std::memory_order_relaxed);
    const uint32_t num_workers = joined.welcome.num_workers;
    hosts_ = topology::Of(joined.welcome);
    worker_peers_.assign(num_workers, std::nullopt);
    // Connecting to every worker takes a while with thousands of them: heartbeats go on
    // meanwhile, or the scheduler takes this server for a hung one (kSilenceLimit).
    std::optional<HeartbeatPump> pump;
    pump.emplace(channel_.get(), job_hash_, joined.welcome.your_id);
    for (const wire::Member& m : joined.welcome.members) {
      if (m.role != wire::Role::kWorker) continue;
      const std::string name = "worker " + std::to_string(m.id) + " (" + m.host + ")";
      // A worker that is already gone must not take the server down: the scheduler fails the
      // job if it is lost, and a reply to it fails on its own.
      auto peer = reply_lane().Connect(m.pull_address, name);
      if (peer.ok()) {
        worker_peers_[m.id] = *peer;
      } else {
        GL_LOG(kWarn) << "server " << id_ << ": cannot reach " << name << ": "
                      << peer.status().ToString();
      }
    }
    pump.reset();  // the control loop heartbeats from here on
    GL_RETURN_IF_ERROR(StartEngines(joined.welcome, reg.host));
    // Publishes the job to the lanes' threads, which started before it was known: until now
    // every push was refused (its sender >= 0 workers), and from now on the address book and
    // engines it needs are there (release; OnPushHeader's load acquires).
    num_workers_.store(num_workers, std::memory_order_release);
    control_ = std::thread([this] {
      if (!thread_inputs_.pinned.empty()) PinThisThread(thread_inputs_.pinned).IgnoreError();
      ControlLoop();
    });
    GL_LOG(kInfo) << "server " << id_ << " joined: " << num_workers_ << " workers; "
                  << threads_.why;
    return Status::Ok();
  }

  uint32_t id() const override { return id_; }

  Status Wait(Clock::time_point deadline) override {
    std::unique_lock<std::mutex> lock(mu_);
    if (!cv_.wait_until(lock, deadline, [this] { return finished_; })) {
      return Timeout("server " + std::to_string(id_) + " still serving");
    }
    return result_;
  }

  void Stop() override {
    if (stopped_.exchange(true)) return;
    if (const std::shared_ptr<transport::ControlChannel> channel = Channel()) {
      wire::Header h;
      h.type = MsgType::kGoodbye;
      h.job = job_hash_;
      h.sender = id_;
      if (!finished()) {
        channel->Send(h, {}, transport::Clock::now() + std::chrono::seconds(1)).IgnoreError();
      }
      channel->Close();
    }
    if (control_.joinable()) control_.join();
    Finish(Aborted("server stopped"));
    if (const ServerStats s = push_lane_ ? stats() : ServerStats{}; s.bytes_reduced != 0) {
      GL_LOG(kInfo) << "server " << id_ << ": summed " << (s.bytes_reduced >> 20)
                    << " MiB of pushes with " << s.process_cpu_seconds << " s of CPU ("
                    << s.cpu_seconds_per_gb << " s per GB), peak " << (s.peak_bytes_held >> 20)
                    << " MiB of round buffers";
    }
    for (auto& e : engines_) e->Stop();
    if (pull_lane_) pull_lane_->Stop();
    if (push_lane_) push_lane_->Stop();
    // Pushes land in the staging buffers directly (PushReceiver::KeepsBuffersIfAbandoned): if
    // the lane gave up a receive it could not cancel (a hung worker), the fabric may still
    // write into one, so they are never freed.
    if (push_lane_ && push_lane_->stats().receives_abandoned != 0) {
      std::unique_lock<std::shared_mutex> lock(parts_mu_);
      GL_LOG(kWarn) << "server " << id_ << ": " << push_lane_->stats().receives_abandoned
                    << " push receive(s) abandoned; leaking " << parts_.size()
                    << " partition(s) whose staging buffers they may still write";
      for (auto& [id, part] : parts_) (void)part.release();
    }
  }

  ServerStats stats() const override {
    ServerStats s;
    s.rounds_completed = rounds_completed_.load();
    s.bytes_reduced = bytes_reduced_.load();
    s.protocol_errors = protocol_errors_.load() + push_lane_->stats().protocol_errors +
                        (pull_lane_ ? pull_lane_->stats().protocol_errors : 0);
    s.mismatches = mismatches_.load();
    {
      std::shared_lock<std::shared_mutex> lock(parts_mu_);
      for (const auto& [id, part] : parts_) s.bytes_in_rounds += part->bytes_held();
    }
    s.bytes_held = s.bytes_in_rounds + pool_.free_bytes();
    s.peak_bytes_held = pool_.peak_bytes();
    s.buffer_allocations = pool_.allocations();
    s.process_cpu_seconds = ProcessCpuSeconds() - cpu_at_start_;
    if (s.bytes_reduced != 0) {
      s.cpu_seconds_per_gb = s.process_cpu_seconds / (static_cast<double>(s.bytes_reduced) / 1e9);
    }
    s.engine_threads = threads_.engines;
    s.threads = threads_.why;
    return s;
  }

 private:
  // Sizes the engines from the CPUs this server has (server/thread_plan.h), starts them, and
  // names and pins every thread of the server's own (the lanes' progress threads through their
  // Defer). `host`: this server's, to find the job's other processes on this machine.
  Status StartEngines(const wire::WelcomeMsg& book, std::string_view host) {
    for (const wire::Member& m : book.members) {
      if (MachineOf(m.host) != MachineOf(host)) continue;
      if (m.role == wire::Role::kWorker) ++thread_inputs_.workers_here;
      if (m.role == wire::Role::kServer && m.id != id_) ++thread_inputs_.servers_here;
    }
    GL_ASSIGN_OR_RETURN(threads_, server::PlanThreads(thread_inputs_));
    const auto place = [this](std::string name, std::optional<uint32_t> cpu) {
      // Named once placed: a thread that has its name has its CPU (the threads test relies on it).
      return [this, name = std::move(name), cpu] {
        if (cpu) {
          const uint32_t c[] = {*cpu};
          if (Status s = PinThisThread(c); !s.ok()) {
            GL_LOG(kWarn) << "server " << id_ << ": " << name << " stays unpinned: " << s.ToString();
          }
        }
        NameThisThread(name);
      };
    };
    const auto cpu_of = [](const std::vector<uint32_t>& cpus, size_t i) {
      return i < cpus.size() ? std::optional<uint32_t>(cpus[i]) : std::nullopt;
    };
    push_lane_->Defer(place("gl-srv-push", cpu_of(threads_.lane_cpu, 0)));
    if (pull_lane_) pull_lane_->Defer(place("gl-srv-pull", cpu_of(threads_.lane_cpu, 1)));
    for (uint32_t i = 0; i < threads_.engines; ++i) {
      engines_.push_back(std::make_unique<WorkQueue>());
      // The first closure an engine runs: before any sum.
      engines_.back()->Post(place("gl-engine-" + std::to_string(i), cpu_of(threads_.engine_cpu, i)));
    }
    return Status::Ok();
  }

  Lane& reply_lane() { return pull_lane_ ? *pull_lane_ : *push_lane_; }

  bool finished() {
    std::lock_guard<std::mutex> lock(mu_);
    return finished_;
  }

  void Finish(Status s) {
    std::lock_guard<std::mutex> lock(mu_);
    if (finished_) return;
    finished_ = true;
    result_ = std::move(s);
    cv_.notify_all();
  }

  // ---- Control plane -------------------------------------------------------------------------

  void ControlLoop() {
    std::shared_ptr<transport::ControlChannel> channel = Channel();
    std::optional<Liveness> liveness;
    liveness.emplace(channel.get(), job_hash_, id_);
    // The scheduler went away without ending the job: rejoin a restarted one, or end.
    const auto rejoin = [&](const std::string& why) {
      channel->Close();
      if (stopped_.load()) return false;  // Stop() closed the channel
      if (Status back = Rejoin(why); !back.ok()) {
        Finish(back);
        return false;
      }
      channel = Channel();
      liveness.emplace(channel.get(), job_hash_, id_);
      return true;
    };
    while (!stopped_.load()) {
      Status alive = liveness->Tick();
      if (!alive.ok()) {
        if (rejoin("server " + std::to_string(id_) + ": " + alive.message())) continue;
        return;
      }
      const transport::Clock::time_point tick = transport::Clock::now() + kPoll;
      if (!channel->WaitReadable(tick)) continue;  // idle: no allocation per tick
      auto f = channel->Receive(tick);
      if (f.ok()) liveness->Heard();
      if (!f.ok()) {
        if (f.status().code() == Code::kTimeout) continue;
        if (rejoin("server " + std::to_string(id_) + " lost the scheduler: " +
                 f.status().message())) {
          continue;
        }
        return;
      }
      switch (f->header.type) {
        case MsgType::kAssign: {
          Status s = OnAssign(*f);
          if (!s.ok()) {
            protocol_errors_++;
            Finish(s);
            channel->Close();
            return;
          }
          // The slots are there: the plan's version goes back, so the scheduler can hand the
          // plan to the workers (a failover's replan too).
          wire::Header ack;
          ack.type = MsgType::kAssignAck;
          ack.job = job_hash_;
          ack.sender = id_;
          ack.key = f->header.key;
          ack.round = f->header.round;
          if (Status sent = channel->Send(ack, {}); !sent.ok()) {
            // Gone before it heard: a restarted one plans the key again (nobody has its plan).
            if (rejoin("server " + std::to_string(id_) + " lost the scheduler: " +
                       sent.message())) {
              continue;
            }
            return;
          }
          break;
        }
        case MsgType::kHeartbeat:
          break;
        case MsgType::kMemberLeft:
          OnMemberLeft(f->header.count);
          break;
        case MsgType::kJoined:
          OnJoined(f->header.count);
          break;
        case MsgType::kJoinRelease: {
          if (Status forgot = OnJoinRelease(); !forgot.ok()) {
            Finish(forgot);
            channel->Close();
            return;
          }
          wire::Header ack;
          ack.type = MsgType::kJoinRelease;
          ack.job = job_hash_;
          ack.sender = id_;
          if (Status s = channel->Send(ack, {}); !s.ok()) {
            if (rejoin("server " + std::to_string(id_) + " lost the scheduler: " +
                       s.message())) {
              continue;
            }
            return;
          }
          break;
        }
        case MsgType::kShutdown:
          Finish(Status::Ok());
          return;
        case MsgType::kAbort: {
          auto text = wire::DecodeText(f->payload);
          const Code code = static_cast<Code>(f->header.code);
          Finish(Status(code == Code::kOk ? Code::kAborted : code,
                        "job aborted by the scheduler: " + (text.ok() ? *text : "")));
          return;
        }
        default:
          protocol_errors_++;
          GL_LOG(kWarn) << "server " << id_ << ": unexpected control message "
                        << static_cast<int>(f->header.type);
      }
    }
  }

  // The scheduler is gone (`why`) but did not end the job: rejoin one restarted on its address
  // (scheduler/restart.cc) within opts_.scheduler_reconnect_timeout, serving pushes meanwhile.
  // The error names the scheduler when none took us back.
  Status Rejoin(const std::string& why) {
    if (opts_.scheduler_reconnect_timeout.count() == 0) return PeerLost(why);
    GL_LOG(kWarn) << why << "; rejoining the job through a restarted scheduler at "
                  << opts_.scheduler << " for up to "
                  << opts_.scheduler_reconnect_timeout.count() / 1000.0 << " s";
    wire::RegisterMsg reg = reg_;
    reg.requested_rank = static_cast<int32_t>(id_.load());
    reg.resume = wire::ResumeState{};
    const auto deadline = transport::Clock::now() + opts_.scheduler_reconnect_timeout;
    Result<Joined> joined =
        RejoinJob(opts_.scheduler, job_hash_, reg, deadline, opts_.secret, {}, &stopped_);
    if (!joined.ok()) {
      return Status(joined.status().code() == Code::kAborted ? Code::kAborted : Code::kPeerLost,
                    why + "; no scheduler took this server back within " +
                        std::to_string(opts_.scheduler_reconnect_timeout.count()) + " ms: " +
                        joined.status().message());
    }
    if (joined->welcome.your_id != id_ || joined->welcome.num_workers != num_workers_) {
      return ProtocolError("the restarted scheduler at " + opts_.scheduler + " welcomed server " +
                           std::to_string(id_) + " back as server " +
                           std::to_string(joined->welcome.your_id) + " of a job of " +
                           std::to_string(joined->welcome.num_workers) + " workers");
    }
    {
      std::lock_guard<std::mutex> lock(channel_mu_);
      channel_ = std::move(joined->channel);
    }
    GL_LOG(kWarn) << "server " << id_ << " rejoined the job through the restarted scheduler";
    return Status::Ok();
  }

  std::shared_ptr<transport::ControlChannel> Channel() {
    std::lock_guard<std::mutex> lock(channel_mu_);
    return channel_;
  }

  Status OnAssign(const transport::Frame& f) {
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
      std::unique_lock<std::shared_mutex> lock(parts_mu_);
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
          slot.reset();
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
          if (f.header.flags & wire::kFlagReplan) slot->Adopt();
        }
      }
    }
    return Status::Ok();
  }

  void OnMemberLeft(uint64_t rank) {
    if (rank >= num_workers_) {
      protocol_errors_++;
      return;
    }
    std::shared_lock<std::shared_mutex> lock(parts_mu_);
    for (auto& [id, part] : parts_) {
      PartitionState* p = part.get();
      RunOnOwner(*p, [this, p, rank] {
        if (p->MarkGone(static_cast<uint32_t>(rank))) RunEngine(p);
      });
    }
  }

  // Worker `rank` joined (Worker::Join): every partition's rounds go on without it.
  void OnJoined(uint64_t rank) {
    if (rank >= num_workers_ ||
        std::find(joined_.begin(), joined_.end(), rank) != joined_.end()) {
      protocol_errors_++;
      return;
    }
    joined_.push_back(static_cast<uint32_t>(rank));
    std::shared_lock<std::shared_mutex> lock(parts_mu_);
    for (auto& [id, part] : parts_) {
      PartitionState* p = part.get();
      RunOnOwner(*p, [this, p, rank] {
        if (p->SetJoined(static_cast<uint32_t>(rank), true)) RunEngine(p);
      });
    }
  }

  // Every worker joined: forget it, on every partition's own thread, before the ack lets the
  // workers push again. Bounded: an owner that never runs the call (a lane or engine that has
  // stopped drops it) fails this server instead of hanging its control thread.
  Status OnJoinRelease() {
    std::vector<uint32_t> ranks = std::move(joined_);
    joined_.clear();
    if (ranks.empty()) return Status::Ok();
    struct Countdown {
      std::mutex mu;
      std::condition_variable cv;
      size_t left = 0;
    };
    auto left = std::make_shared<Countdown>();
    auto shared_ranks = std::make_shared<const std::vector<uint32_t>>(std::move(ranks));
    {
      std::shared_lock<std::shared_mutex> lock(parts_mu_);
      left->left = parts_.size();
      for (auto& [id, part] : parts_) {
        PartitionState* p = part.get();
        RunOnOwner(*p, [p, shared_ranks, left] {
          for (uint32_t rank : *shared_ranks) p->SetJoined(rank, false);
          std::lock_guard<std::mutex> g(left->mu);
          if (--left->left == 0) left->cv.notify_all();
        });
      }
    }
    std::unique_lock<std::mutex> wait(left->mu);
    if (!left->cv.wait_for(wait, std::chrono::seconds(10), [&] { return left->left == 0; })) {
      return Internal("server " + std::to_string(id_) + ": " + std::to_string(left->left) +
                      " partitions did not forget the join within 10 s");
    }
    return Status::Ok();
  }

  // Sends to worker `rank`'s pull lane; completes `done` with kPeerLost if it is unreachable.
  void SendToWorker(uint32_t rank, const wire::Header& h, std::span<const std::byte> payload,
                    transport::SendCallback done) {
    if (!worker_peers_[rank]) {
      done(PeerLost("worker " + std::to_string(rank) + " is unreachable"));
      return;
    }
    reply_lane().Send(*worker_peers_[rank], h, payload, std::move(done));
  }

  // ---- Data plane ----------------------------------------------------------------------------

  PartitionState* Find(uint64_t key, uint32_t partition) {
    std::shared_lock<std::shared_mutex> lock(parts_mu_);
    auto it = parts_.find({key, partition});
    return it == parts_.end() ? nullptr : it->second.get();
  }

  // Small partitions are summed on the push lane's progress thread, where their pushes land
  // (see kInlineSumBytes); the others on an engine thread chosen by key.
  bool SummedInline(const PartitionState& p) const {
    return p.count() * DataTypeSize(p.dtype()) <= kInlineSumBytes;
  }

  WorkQueue& EngineFor(const PartitionState& p) {
    const uint64_t h = (p.key() ^ (uint64_t{p.partition()} * 0x9E3779B97F4A7C15ull));
    return *engines_[(h >> 17) % engines_.size()];
  }

  // Runs `fn` on the one thread that sums `p` (its only writer).
  void RunOnOwner(const PartitionState& p, std::function<void()> fn) {
    if (SummedInline(p)) {
      push_lane_->Defer(std::move(fn));
    } else {
      EngineFor(p).Post(std::move(fn));
    }
  }

  void Answer(uint32_t rank, const wire::Header& push, const Status& error) {
    wire::Header h;
    h.type = MsgType::kDataError;
    h.job = job_hash_;
    h.sender = id_;
    h.key = push.key;
    h.partition = push.partition;
    h.round = push.round;
    h.code = static_cast<uint8_t>(error.code());
    h.cookie = push.cookie;
    auto text = std::make_shared<std::vector<std::byte>>(wire::EncodeText(error.message()));
    h.payload_bytes = text->size();
    SendToWorker(rank, h, *text, [text](const Status&) {});
  }

  // Where a push's (or a recovery's) payload lands; *found: its partition, when there is one
  // (partitions are never erased while the lanes run, so the pointer stays good).
  Result<std::span<std::byte>> OnPushHeader(const wire::Header& h, PartitionState** found) {
    const bool recover = h.type == MsgType::kRecover;
    if ((h.type != MsgType::kPush && !recover) || h.job != job_hash_ ||
        h.sender >= num_workers_) {
      protocol_errors_++;
      GL_LOG(kWarn) << "server " << id_ << ": dropped a frame of type "
                    << static_cast<int>(h.type) << " from sender " << h.sender;
      return ProtocolError("unexpected frame on the push lane");
    }
    PartitionState* p = Find(h.key, h.partition);
    if (p == nullptr) {
      protocol_errors_++;
      Status s = ProtocolError("server " + std::to_string(id_) + " does not own key " +
                               KeyHex(h.key) + " partition " + std::to_string(h.partition));
      Answer(h.sender, h, s);
      return s;
    }
    *found = p;
    if (recover) {
      auto span = p->BeginRecover(h);
      if (!span.ok()) {
        protocol_errors_++;
        Answer(h.sender, h, span.status());
      }
      return span;
    }
    bool run_engine = false;
    auto span = p->BeginPush(h, &run_engine);
    if (!span.ok()) {
      if (span.status().code() == Code::kMismatch) {
        mismatches_++;
      } else {
        protocol_errors_++;
        Answer(h.sender, h, span.status());
      }
      if (run_engine) RunOnOwner(*p, [this, p] { RunEngine(p); });
    }
    return span;
  }

  void OnPushPayload(const wire::Header& h, bool ok) {
    PartitionState* p = Find(h.key, h.partition);
    if (p != nullptr) OnPushPayload(p, h, ok);
  }

  void OnPushPayload(PartitionState* p, const wire::Header& h, bool ok) {
    const bool recover = h.type == MsgType::kRecover;
    const bool runnable = recover ? p->EndRecover(h.sender, ok) : p->EndPush(h.sender, ok);
    if (ok && !recover) bytes_reduced_ += h.payload_bytes;
    // Each engine wake-up is a context switch; on small partitions those are most of a round.
    if (!runnable) return;
    if (SummedInline(*p)) {
      RunEngine(p);  // we are on the push lane's progress thread: its owner
    } else {
      EngineFor(*p).Post([this, p] { RunEngine(p); });
    }
  }

  // On p's engine thread: sum, and send every round this completes.
  void RunEngine(PartitionState* p) {
    while (std::optional<server::Completion> c = p->Progress()) {
      rounds_completed_++;
      wire::Header h;
      h.job = job_hash_;
      h.sender = id_;
      h.key = p->key();
      h.partition = p->partition();
      h.round = c->round;
      std::shared_ptr<std::vector<std::byte>> text;
      std::span<const std::byte> payload = c->result;
      if (c->status.ok()) {
        h.type = MsgType::kPullResponse;
        // Rounded up, so that a round summed within a microsecond still reports its server
        // time (0 on the wire means none).
        const int64_t ns =
            std::chrono::duration_cast<std::chrono::nanoseconds>(c->server_time).count();
        const uint64_t micros = (static_cast<uint64_t>(std::max<int64_t>(0, ns)) + 999) / 1000;
        h.server_time = wire::EncodeServerTime(std::max<uint64_t>(1, micros));
        h.dtype = static_cast<uint8_t>(p->dtype());
        h.count = p->count();
      } else {
        h.type = MsgType::kDataError;
        h.code = static_cast<uint8_t>(c->status.code());
        text = std::make_shared<std::vector<std::byte>>(wire::EncodeText(c->status.message()));
        payload = *text;
      }
      const uint32_t slot = c->slot;
      const std::vector<uint32_t>& to = p->participants();
      for (uint32_t i = 0; i < to.size(); ++i) {
        if (!c->absent.empty() && c->absent[i]) continue;  // it joined and sat the round out
        h.cookie = c->cookies[i];
        // A participant that receives nothing (a contributor to a relay, or to another rank's
        // reduce-scatter segment) gets a reply of 0 elements: its round is over.
        const bool empty = c->status.ok() && !p->receives(i);
        h.count = empty ? 0 : c->status.ok() ? p->count() : 0;
        h.payload_bytes = empty ? 0 : payload.size();
        const std::span<const std::byte> body = empty ? std::span<const std::byte>() : payload;
        if (text) {  // an error's text lives until its sends are done
          SendToWorker(to[i], h, body, [this, p, slot, text](const Status& s) {
            ReplySent(p, slot, s);
          });
        } else {
          // Two words of capture (the slot in the pointer's low bit): std::function keeps
          // them inline, so a reply allocates no callback.
          const uintptr_t tagged = reinterpret_cast<uintptr_t>(p) | slot;
          SendToWorker(to[i], h, body, [this, tagged](const Status& s) {
            ReplySent(reinterpret_cast<PartitionState*>(tagged & ~uintptr_t{1}),
                      static_cast<uint32_t>(tagged & 1), s);
          });
        }
      }
    }
  }

  static_assert(alignof(PartitionState) >= 2, "RunEngine tags a PartitionState* with a slot bit");

  // One reply of `p`'s round in `slot` has been sent (or failed).
  void ReplySent(PartitionState* p, uint32_t slot, const Status& s) {
    if (!s.ok()) GL_LOG(kInfo) << "server " << id_ << ": pull response failed: " << s.ToString();
    if (p->SendDone(slot) && p->WaitsForSlot(slot)) {
      RunOnOwner(*p, [this, p] { RunEngine(p); });
    }
  }

  class PushReceiver final : public transport::Receiver {
   public:
    explicit PushReceiver(ServerImpl* s) : s_(s) {}
    Result<std::span<std::byte>> OnHeader(const wire::Header& h) override {
      PartitionState* p = nullptr;
      return s_->OnPushHeader(h, &p);
    }
    void OnPayload(const wire::Header& h, std::span<std::byte>) override {
      s_->OnPushPayload(h, true);
    }
    // An eager push, whole: its partition is looked up once, not again for the payload.
    Result<uint64_t> OnFrame(const wire::Header& h,
                             std::span<const std::byte> payload) override {
      PartitionState* p = nullptr;
      Result<std::span<std::byte>> dest = s_->OnPushHeader(h, &p);
      if (!dest.ok()) return dest.status();
      if (dest->size() != payload.size()) {
        OnReceiveFailed(h, transport::WrongSpan(dest->size(), payload.size()));
        return uint64_t{0};
      }
      if (!payload.empty()) std::memcpy(dest->data(), payload.data(), payload.size());
      s_->OnPushPayload(p, h, true);
      return uint64_t{payload.size()};
    }
    void OnReceiveFailed(const wire::Header& h, const Status& st) override {
      GL_LOG(kWarn) << "server " << s_->id_ << ": receiving a push failed: " << st.ToString();
      s_->OnPushPayload(h, false);
    }
    // Staging buffers live as long as their partition, and Stop() leaks the partitions when
    // the lane abandoned a receive: pushes need no bounce buffer.
    bool KeepsBuffersIfAbandoned() const override { return true; }
    void OnPeerFailed(PeerId peer, const Status& st) override {
      // A worker's pull endpoint failed. The scheduler decides whether the job is lost;
      // later sends to that worker fail on their own.
      GL_LOG(kInfo) << "server " << s_->id_ << ": peer " << peer << " failed: " << st.ToString();
    }

   private:
    ServerImpl* s_;
  };

  // The pull lane only sends; it receives nothing but endpoint failures.
  class PullReceiver final : public transport::Receiver {
   public:
    explicit PullReceiver(ServerImpl* s) : s_(s) {}
    Result<std::span<std::byte>> OnHeader(const wire::Header&) override {
      s_->protocol_errors_++;
      return ProtocolError("the server's pull lane accepts no frames");
    }
    void OnPayload(const wire::Header&, std::span<std::byte>) override {}
    void OnReceiveFailed(const wire::Header&, const Status&) override {}
    void OnPeerFailed(PeerId peer, const Status& st) override {
      GL_LOG(kInfo) << "server " << s_->id_ << ": peer " << peer << " failed: " << st.ToString();
    }

   private:
    ServerImpl* s_;
  };

  const ServerOptions opts_;
  const uint32_t job_hash_;
  // Written once in Init(), while the lanes already run: atomics, num_workers_ last (it
  // publishes worker_peers_ and engines_ to the lanes' callbacks).
  std::atomic<uint32_t> id_{0};
  std::atomic<uint32_t> num_workers_{0};
  std::shared_ptr<transport::Fabric> fabric_;
  std::unique_ptr<Lane> push_lane_, pull_lane_;
  PushReceiver push_receiver_{this};
  PullReceiver pull_receiver_{this};
  std::vector<std::optional<PeerId>> worker_peers_;  // nullopt: unreachable
  std::vector<uint32_t> joined_;  // control thread: ranks that joined (Worker::Join)
  topology::Hosts hosts_;  // written once in Init(), before any kAssign
  // Replaced when the server rejoins a restarted scheduler (Rejoin, on the control thread);
  // Stop() reads it from another thread.
  std::mutex channel_mu_;
  std::shared_ptr<transport::ControlChannel> channel_;
  wire::RegisterMsg reg_;  // as it first registered
  std::thread control_;
  std::vector<std::unique_ptr<WorkQueue>> engines_;
  server::ThreadInputs thread_inputs_;  // Init(): what the engines are sized from
  server::ThreadPlan threads_;           // Init(): the engines and where the threads run

  // Every partition's round buffers; kept free for reuse up to kPoolFreeBytes. Declared before
  // parts_, which give their buffers back to it.
  server::BufferPool pool_{kPoolFreeBytes};
  mutable std::shared_mutex parts_mu_;
  std::map<std::pair<uint64_t, uint32_t>, std::unique_ptr<PartitionState>> parts_;

  double cpu_at_start_ = 0;  // ProcessCpuSeconds() when Init() began
  std::atomic<bool> stopped_{false};
  std::mutex mu_;
  std::condition_variable cv_;
  bool finished_ = false;
  Status result_;

  std::atomic<uint64_t> rounds_completed_{0}, bytes_reduced_{0}, protocol_errors_{0},
      mismatches_{0};
};

}  // namespace

Result<std::unique_ptr<Server>> StartServerOn(const ServerOptions& options,
                                              std::shared_ptr<transport::Fabric> fabric) {
  auto s = std::make_unique<ServerImpl>(options, std::move(fabric));
  GL_RETURN_IF_ERROR(s->Init());
  return std::unique_ptr<Server>(std::move(s));
}

Result<std::unique_ptr<Server>> Server::Start(const ServerOptions& options) {
  return StartServerOn(options, nullptr);
}

}  // namespace gradlink
