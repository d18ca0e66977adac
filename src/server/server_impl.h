// ServerImpl: the Server of include/gradlink/server.h. One aggregation server's state, its
// member functions split by what they own over these files:
//   server.cc      its life: Init (lanes, joining, engines and where its threads run), Wait, Stop
//   control.cc     the scheduler's frames (MembershipHandler): workers leaving and joining, the
//                  join release, rejoining a restarted scheduler, the job's end
//   planning.cc    kAssign: the partitions this server sums, made or taken over from a lost one
//   data_plane.cc  pushes in (the lanes' receivers), sums on each partition's owner thread,
//                  results and refusals out
//   stats.cc       ServerStats and the figures behind them
//   metrics.cc     /metrics (Prometheus), and the stall inspector's scan of the rounds
// What it shares with the worker (the lanes, the membership with its control thread, liveness
// and rejoining) is in control/member_lanes.h and control/membership.h.
//
// Threads: the control thread (the membership's: every MembershipHandler call, kAssign),
// the push lane's progress thread (pushes; the sums of small partitions), the pull lane's
// (sends only), the engine threads (the sums of the others: each partition has exactly one
// owner thread, RunOnOwner), and the caller's (Start, Wait, Stop, stats).
//
// State, by owner:
//   - fixed in Init() before the lanes can deliver a push, published by num_workers_ (release;
//     the lanes' acquire): worker_peers_, engines_, hosts_, threads_;
//   - the control thread's alone: joined_, release_;
//   - parts_ under parts_mu_ (exclusive to add, shared to look up); each PartitionState has its
//     own lock and one owner thread (server/partition_state.h);
//   - mu_: the server's end (finished_, result_);
//   - counters: atomics.
#pragma once

#include <atomic>
#include <condition_variable>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <shared_mutex>
#include <string>
#include <thread>
#include <vector>

#include "common/mutex.h"
#include "common/thread_annotations.h"
#include "common/work_queue.h"
#include "control/member_lanes.h"
#include "control/membership.h"
#include "control/topology.h"
#include "gradlink/server.h"
#include "metrics/by_dtype.h"
#include "metrics/exposition.h"
#include "metrics/http_server.h"
#include "server/buffer_pool.h"
#include "server/partition_state.h"
#include "server/thread_plan.h"
#include "transport/transport.h"
#include "wire/messages.h"

namespace gradlink {

// Partitions of at most this many wire bytes are summed on the push lane's progress thread
// instead of an engine thread: the exception to "never sum on the I/O thread" for partitions
// where the sum costs less than the hand-off it replaces. Summing two 16 KiB fp32 pushes takes
// ~0.4 us warm (a few times that cold), about what receiving the payloads costs that thread;
// one engine wake-up costs a futex wake and two context switches, and tens of us of latency
// when cores are oversubscribed (4 KiB push_pull, 2 workers + 2 servers on 2 cores: ~11% fewer
// context switches, median 83 -> 62 us; bench/RESULTS.md, "The inline-sum exception"). Larger
// partitions keep the rule: a 4 MiB sum (~0.5 ms) would hold up every other push on the lane.
inline constexpr uint64_t kInlineSumBytes = 16 << 10;

// Free round buffers a server keeps for the next rounds (buffer_pool.h). The steady state of a
// job needs as many as its rounds in flight hold at their peak, which the workers' leads bound:
// 2 partitions of 64 KiB ahead per server and worker on a network (control/tuning.h).
inline constexpr uint64_t kPoolFreeBytes = uint64_t{256} << 20;

// How long every partition has to forget a join once all workers joined, before the server
// fails (an owner thread that stopped never runs the call).
inline constexpr auto kJoinReleaseLimit = std::chrono::seconds(10);

class ServerImpl final : public Server, private MembershipHandler {
 public:
  ServerImpl(const ServerOptions& o, std::shared_ptr<transport::Fabric> fabric);
  ~ServerImpl() override { Stop(); }

  Status Init();

  uint32_t id() const override { return id_; }
  Status Wait(std::chrono::steady_clock::time_point deadline) override;
  void Stop() override;
  ServerStats stats() const override;

 private:
  using PartitionState = server::PartitionState;

  // ---- server.cc: life ---------------------------------------------------------------------
  Status StartEngines(const wire::WelcomeMsg& book, std::string_view host);
  bool finished() EXCLUDES(mu_);
  void Finish(Status s) EXCLUDES(mu_);
  void LogSummary() const;

  // ---- metrics.cc: what a scrape reads (the HTTP server's thread), and stalls --------------
  metrics::Families CollectMetrics() const;
  // On the control thread's tick: the rounds some workers have pushed and others not for
  // opts_.stall_check go to the scheduler (kStallReport), each once and then every period.
  void CheckStalls();

  // ---- control.cc: the scheduler's frames (MembershipHandler, control thread) -----------------
  ControlVerdict OnControl(const transport::Frame& f) override;
  Status OnTick() override;
  Result<Rejoining> PrepareRejoin(const std::string& why) override;
  Status CheckWelcome(const wire::WelcomeMsg& welcome) override;
  void OnRejoined(const Status&, uint64_t) override {}
  void OnLost(const Status& why) override;
  void OnMemberLeft(uint64_t rank);
  void OnJoined(uint64_t rank);
  void OnJoinRelease();
  // Answers the scheduler's kJoinRelease once every partition forgot the join (OnTick).
  void AckJoinRelease();

  // ---- planning.cc: kAssign (control thread) -------------------------------------------------
  Status OnAssign(const transport::Frame& f);
  // kRetire: every worker is done with the key (its name was declared again: Worker::Declare).
  // Its partitions leave parts_ (a push that still comes is refused, naming the key); each is
  // deleted by FreeRetired once it holds no buffer and kRetiredGrace has passed.
  void OnRetire(uint64_t key);
  // On the control thread's tick: deletes the retired partitions whose time has come.
  void FreeRetired();

  // ---- data_plane.cc: pushes in, sums, results out ---------------------------------------------
  PartitionState* Find(uint64_t key, uint32_t partition) EXCLUDES(parts_mu_);
  bool SummedInline(const PartitionState& p) const;
  WorkQueue& EngineFor(const PartitionState& p);
  size_t EngineIndex(const PartitionState& p) const;
  // "'name' partition P (push lane)" or "(engine E)"; a partition no longer held, by its key.
  std::string DescribeOwner(uint64_t key, uint32_t partition) EXCLUDES(parts_mu_);
  // Runs `fn` on the one thread that sums `p` (its only writer).
  void RunOnOwner(const PartitionState& p, std::function<void()> fn);
  // Sends to worker `rank`'s pull lane; completes `done` with kPeerLost if it is unreachable.
  void SendToWorker(uint32_t rank, const wire::Header& h, std::span<const std::byte> payload,
                    transport::SendCallback done);
  void Answer(uint32_t rank, const wire::Header& push, const Status& error);
  Result<std::span<std::byte>> OnPushHeader(const wire::Header& h, PartitionState** found);
  void OnPushPayload(const wire::Header& h, bool ok);
  void OnPushPayload(PartitionState* p, const wire::Header& h, bool ok);
  void RunEngine(PartitionState* p);
  void ReplySent(PartitionState* p, uint32_t slot, const Status& s);

  class PushReceiver final : public transport::Receiver {
   public:
    explicit PushReceiver(ServerImpl* s) : s_(s) {}
    Result<std::span<std::byte>> OnHeader(const wire::Header& h) override;
    void OnPayload(const wire::Header& h, std::span<std::byte>) override;
    Result<uint64_t> OnFrame(const wire::Header& h, std::span<const std::byte> payload) override;
    void OnReceiveFailed(const wire::Header& h, const Status& st) override;
    bool KeepsBuffersIfAbandoned() const override { return true; }
    void OnPeerFailed(transport::PeerId peer, const Status& st) override;

   private:
    ServerImpl* s_;
  };

  // The pull lane only sends; it receives nothing but endpoint failures.
  class PullReceiver final : public transport::Receiver {
   public:
    explicit PullReceiver(ServerImpl* s) : s_(s) {}
    Result<std::span<std::byte>> OnHeader(const wire::Header&) override;
    void OnPayload(const wire::Header&, std::span<std::byte>) override {}
    void OnReceiveFailed(const wire::Header&, const Status&) override {}
    void OnPeerFailed(transport::PeerId peer, const Status& st) override;

   private:
    ServerImpl* s_;
  };

  // A join release in progress: the partitions that have yet to forget the join.
  struct JoinRelease {
    std::atomic<size_t> partitions_left{0};
    // Each partition (key, partition; in parts_'s order) and whether its owner has run the
    // release yet: what a release past its deadline names. Not pointers: a retired partition
    // may be freed meanwhile.
    std::vector<std::pair<uint64_t, uint32_t>> parts;
    std::unique_ptr<std::atomic<bool>[]> done;
    std::vector<uint32_t> ranks;
    transport::Clock::time_point deadline;
  };

  const ServerOptions opts_;
  const uint32_t job_hash_;
  // Written once in Init(), while the lanes already run: atomics, num_workers_ last (it
  // publishes worker_peers_ and engines_ to the lanes' callbacks).
  std::atomic<uint32_t> id_{0};
  std::atomic<uint32_t> num_workers_{0};
  std::shared_ptr<transport::Fabric> fabric_;  // the one given (tests), until Init() opens lanes
  PushReceiver push_receiver_{this};
  PullReceiver pull_receiver_{this};
  MemberLanes lanes_;
  // Left in Stop(), which the destructor calls first: its control thread calls into this object.
  std::unique_ptr<Membership> membership_;
  wire::RegisterMsg reg_;  // as it first registered (a rejoin registers it again)
  std::vector<std::optional<transport::PeerId>> worker_peers_;  // nullopt: unreachable
  topology::Hosts hosts_;  // written once in Init(), before any kAssign
  std::vector<std::unique_ptr<WorkQueue>> engines_;
  server::ThreadInputs thread_inputs_;  // Init(): what the engines are sized from
  server::ThreadPlan threads_;           // Init(): the engines and where the threads run

  // The control thread's: ranks that joined (Worker::Join), and the release in progress.
  std::vector<uint32_t> joined_;
  std::shared_ptr<JoinRelease> release_;
  // Partitions a restarted scheduler planned again differently (planning.cc): kept, not freed,
  // while closures posted to their owners may still point at them.
  std::vector<std::unique_ptr<PartitionState>> retired_ GUARDED_BY(parts_mu_);
  // Partitions of retired keys (OnRetire), with when. Kept kRetiredGrace after their key left
  // parts_, and until they hold no buffer: by then every worker had its last reply (that is
  // what let it retire the key), and what a lane's thread still ran on them (the tail of a
  // push's callback, a reply's send completion) has long returned.
  struct Retiring {
    std::unique_ptr<PartitionState> part;
    transport::Clock::time_point since;
  };
  static constexpr auto kRetiredGrace = std::chrono::seconds(5);
  std::vector<Retiring> retiring_ GUARDED_BY(parts_mu_);
  std::atomic<uint64_t> keys_retired_{0};

  // Every partition's round buffers; kept free for reuse up to kPoolFreeBytes. Declared before
  // parts_, which give their buffers back to it.
  server::BufferPool pool_{kPoolFreeBytes};
  mutable SharedMutex parts_mu_;  // taken before a PartitionState's own lock, never under it
  std::map<std::pair<uint64_t, uint32_t>, std::unique_ptr<PartitionState>> parts_
      GUARDED_BY(parts_mu_);

  double cpu_at_start_ = 0;  // ProcessCpuSeconds() when Init() began
  std::atomic<bool> stopped_{false};
  Mutex mu_;  // a leaf
  CondVar cv_;
  bool finished_ GUARDED_BY(mu_) = false;
  Status result_ GUARDED_BY(mu_);

  std::atomic<uint64_t> rounds_completed_{0}, bytes_reduced_{0}, protocol_errors_{0},
      mismatches_{0};
  // Bytes of pushes summed and of results sent, by the wire dtype (indexed by DataType's
  // value); workers' endpoints that failed, partitions taken over from lost servers, stalled
  // rounds reported.
  metrics::ByDtype summed_by_dtype_, sent_by_dtype_;
  std::atomic<uint64_t> peers_lost_{0}, partitions_adopted_{0}, stalls_reported_{0};

  // The control thread's (CheckStalls): when it last scanned, and per partition the stalled
  // round it last reported and when.
  transport::Clock::time_point last_stall_scan_{};
  std::map<std::pair<uint64_t, uint32_t>, std::pair<uint64_t, transport::Clock::time_point>>
      stalls_told_;

  // Last: stopped first, as the object goes (a scrape reads the fields above).
  std::unique_ptr<metrics::HttpServer> metrics_;
};

}  // namespace gradlink
