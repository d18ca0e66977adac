// The round state machine of one (key, partition) on a server.
//
// Each contributing rank (every worker, or one per host when hosts sum first) has one staging
// buffer while its push is in: a worker pushes round r+1 only after it has pulled round r, so at
// most one push per rank is ever outstanding. With the server's BufferPool, a round takes its
// buffers as its pushes come and gives them back once summed or sent (buffer_pool.h). Where the accumulator has the wire
// dtype (fp32, fp64, int64), rank 0's push lands in the accumulator itself and needs none,
// unless round r-2's result is still being sent from that accumulator. The accumulator is double-buffered
// by round parity: round r's result may still be on its way to slow workers while round r+1 is
// being summed. Summation is in rank order: acc = s0 + s1, then acc += s2, ... so the result is
// bit-identical whatever order pushes arrive in.
//
// Threads: BeginPush()/EndPush() run on the push lane's progress thread; Progress() on the one
// thread that owns this partition (an engine thread; for small partitions the push lane's
// progress thread itself). SendDone()/WaitsForSlot() from any thread. A mutex guards the per-rank
// flags only; the sums run outside it.
#pragma once

#include <atomic>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "common/mutex.h"
#include "common/thread_annotations.h"
#include "gradlink/collective.h"
#include "gradlink/options.h"
#include "gradlink/status.h"
#include "gradlink/tensor.h"
#include "server/buffer_pool.h"
#include "wire/frame.h"

namespace gradlink::server {

// A finished round, to be sent to every worker.
struct Completion {
  uint64_t round = 0;
  uint32_t slot = 0;                   // pass to SendDone()
  Status status;                       // not OK: send kDataError instead of the result
  std::span<const std::byte> result;   // in the wire dtype
  // Per participant, echoed in its pull response; valid, like `result`, until the slot's sends
  // are done.
  std::span<const uint64_t> cookies;
  // From the round's last push landing to this completion: the server's own time on it.
  Clock::duration server_time{};
  // Per participant: it had joined (Worker::Join) and sat this round out: it gets no reply.
  // Empty when nobody has joined.
  std::vector<bool> absent;
};

// What a partition does besides summing every contributor for every contributor
// (control/layout.h): the reduction, whether its one contributor's push is only routed (relay,
// gather, all-to-all: the result is that push, in its own dtype), and the participants that push
// nothing but ask for the result (a push of 0 elements), and which participants receive it (the
// others get a reply of 0 elements, so that their round ends too).
struct Routing {
  ReduceOp op = ReduceOp::kSum;
  bool copy = false;                // one contributor, its push relayed as it is
  std::vector<uint32_t> requesters; // ranks, after the contributors
  std::vector<bool> receives;       // per participant (contributors, then requesters); empty: all
};

class PartitionState {
 public:
  // `contributors`: the ranks whose pushes are summed, in summing order (every worker, or one
  // per host: control/topology.h); `workers`: the job's, the divisor of an average.
  // `host_of` (hierarchical): each worker's host, the index of its host's contributor: a worker
  // that leaves fails its host's contribution, whoever pushes it. Empty: each worker its own.
  // `pool` (the server's; outlives this): where a round takes its buffers and gives them back
  // once summed or sent; null: each buffer stays with the partition for later rounds.
  PartitionState(uint64_t key, uint32_t partition, std::string name, DataType dtype,
                 uint64_t count, std::vector<uint32_t> contributors, uint32_t workers,
                 std::vector<uint32_t> host_of = {}, Routing routing = {},
                 BufferPool* pool = nullptr);
  // Every one of `num_workers` workers contributes, in rank order (flat aggregation).
  PartitionState(uint64_t key, uint32_t partition, std::string name, DataType dtype,
                 uint64_t count, uint32_t num_workers)
      : PartitionState(key, partition, std::move(name), dtype, count, AllRanks(num_workers),
                       num_workers) {}

  uint64_t key() const { return key_; }
  uint32_t partition() const { return partition_; }
  DataType dtype() const { return dtype_; }
  uint64_t count() const { return count_; }
  // The ranks a completed round is sent to (contributors, then requesters), in the order of
  // Completion::cookies; receives(i): whether participants()[i] gets the result (else a reply of
  // 0 elements).
  const std::vector<uint32_t>& participants() const { return participants_; }
  bool receives(uint32_t i) const { return routing_.receives.empty() || routing_.receives[i]; }
  const std::string& name() const { return name_; }

  // A push header arrived. Returns the staging buffer to receive into. An error means: drop
  // the payload and answer the sender with that Status. When the push is for the current round
  // but disagrees with the declaration, the round is marked failed (every worker will get the
  // error at completion, so none waits forever); `*run_engine` is then true.
  Result<std::span<std::byte>> BeginPush(const wire::Header& h, bool* run_engine);

  // The payload of `rank`'s push has landed (ok) or failed to arrive (!ok, the round fails).
  // Returns false when Progress() would find nothing to do now (the push waits for a lower
  // rank's): the caller need not wake the engine for it. True is conservative (Progress() may
  // still find nothing, e.g. while a slot's sends are pending).
  bool EndPush(uint32_t rank, bool ok);

  // Sums whatever can be summed in rank order. Returns the completed round, if this call
  // completed one; the caller sends it and calls SendDone(slot) once per worker after that.
  std::optional<Completion> Progress();

  // Worker `rank` has left the job: every round that still needs its push fails with kAborted
  // (false, nothing to do, when it contributes nothing here).
  // Returns true when the caller should run Progress().
  bool MarkGone(uint32_t rank);

  // Worker `rank` has joined (Worker::Join: it ran out of data) or, with `joined` false, every
  // rank has and the job goes on. While joined, a sum's rounds go on without it: it sits each
  // out (a contribution of zeros; an average divides by the ranks that pushed), and gets no
  // reply. Other collectives' rounds fail with kInvalidArgument naming it. Summed per host
  // first, a host sits out once all its workers have joined; until then its partial sums the
  // others (its push names how many: Header::ranks). Runs on the owner thread; returns true
  // when the caller should run Progress().
  bool SetJoined(uint32_t rank, bool joined);

  // Failover: this server takes over the partition from a lost one (OnAssign with
  // kFlagReplan). Where its rounds stand comes from the contributors (every worker, or each
  // host's pusher of a key summed per host first): each sends one kRecover,
  // the result of the last round it received or, having none, the round it pushes next, and
  // says whether its push of a round it has not received follows. Nothing is summed until
  // every contributor has reported. Then the partition goes on one round past the latest result
  // (workers all hold the same: sums are deterministic, and the copies are compared), and a
  // push of that latest round is answered with it. Only sums' workers keep
  // results, so another collective's round moves only if no worker had received it (or none
  // still waits for it), else it fails, saying so. Before any push.
  void Adopt();
  bool adopting() const;
  // A kRecover header: where its result lands (empty: none); an error drops it, answered so.
  Result<std::span<std::byte>> BeginRecover(const wire::Header& h);
  // Its payload landed (or not). True when Progress() should run.
  bool EndRecover(uint32_t sender, bool ok);

  // One result send of `slot` finished. Returns true when the slot became free (call Progress()
  // if WaitsForSlot(slot)).
  bool SendDone(uint32_t slot);

  // True when the round being summed uses `slot` (round % 2 == slot): only then can freeing
  // it let Progress() go further. When false, the Progress() call that completes the round
  // before (RunEngine loops until Progress() returns nothing) finds the slot free by itself.
  bool WaitsForSlot(uint32_t slot) const;

  uint64_t round() const;

  // The stall inspector (ServerImpl::CheckStalls): the round being summed, when its first push
  // landed at least `after` before `now` and some participants have not pushed it.
  struct Waiting {
    uint64_t round = 0;
    Clock::duration age{};
    std::vector<uint32_t> missing, pushed;  // ranks, ascending
  };
  std::optional<Waiting> Stalled(Clock::time_point now, Clock::duration after) const;

  // Bytes of buffers this partition holds now (staging, accumulators, results); any thread. At
  // most reduce::ServerBytesHeld(dtype, count, workers), the figure the scheduler admits by;
  // one staging buffer less while rank 0's pushes land in the accumulator. With a pool, only
  // what its rounds in flight hold: nothing between rounds.
  uint64_t bytes_held() const { return held_.load(std::memory_order_relaxed); }

 private:
  // kAbsent: a contributor that has joined, sitting the round out (a sum's only).
  enum class Stage : uint8_t { kFree, kReceiving, kStaged, kSummed, kFailed, kAbsent };

  static std::vector<uint32_t> AllRanks(uint32_t n) {
    std::vector<uint32_t> r(n);
    for (uint32_t i = 0; i < n; ++i) r[i] = i;
    return r;
  }
  std::string Describe() const;
  // Whether contributor `i` of [next_, SummableEndLocked()), as Progress() read them under
  // mu_, pushes this round (is not kAbsent), read without mu_: the analysis cannot see it, so
  // it is not checked. Safe because only Progress()'s thread moves such a stage (to kSummed
  // under mu_, or to and from kAbsent: SetJoined, the round's reset), and the other threads
  // write other ranks' stages (a distinct byte each).
  bool StagedPresent(uint32_t i) const NO_THREAD_SAFETY_ANALYSIS {
    return stage_[i] != Stage::kAbsent;
  }
  // The contributor index of `rank`; -1 when it pushes nothing here.
  int32_t IndexOf(uint32_t rank) const {
    return rank < index_of_.size() ? index_of_[rank] : -1;
  }
  // With mu_ held (indices are contributor indices): [next_, SummableEndLocked()) can be summed
  // now; RoundOverLocked(): every contributor is summed or failed (or staged in a failed round).
  uint32_t SummableEndLocked() const REQUIRES(mu_);
  bool RoundOverLocked() const REQUIRES(mu_);
  void FailRankLocked(uint32_t index) REQUIRES(mu_);
  // With mu_ held, at the start of a round or a join: joined participants that have not pushed
  // sit a sum's round out (kAbsent); in another collective they fail it.
  void ApplyJoinedLocked() REQUIRES(mu_);
  // SetJoined() for participant `index` (-1: none).
  bool SetJoinedLocked(int32_t index, bool joined) REQUIRES(mu_);
  bool SumsWithoutAbsent() const {
    return routing_.op == ReduceOp::kSum && !routing_.copy && routing_.requesters.empty();
  }
  // The workers contributor `i`'s push sums when none sat out: 1, or its host's workers.
  uint32_t Weight(uint32_t i) const { return host_ranks_.empty() ? 1 : host_ranks_[i]; }
  // Sizes `buf` to `bytes` (from the pool, if any, when it is empty) and counts it in held_;
  // Give() hands it back to the pool (without one, it stays).
  void Take(std::vector<std::byte>& buf, size_t bytes);
  void Give(std::vector<std::byte>& buf);

  BufferPool* const pool_;
  const uint64_t key_;
  const uint32_t partition_;
  const std::string name_;
  const DataType dtype_;
  const uint64_t count_;
  const std::vector<uint32_t> contributors_;
  const uint32_t num_workers_;  // contributors
  const Routing routing_;
  std::vector<uint32_t> participants_;  // contributors_, then routing_.requesters
  uint32_t num_part_ = 0;       // participants
  const uint32_t divisor_;      // the job's workers
  std::vector<int32_t> index_of_;  // by rank: its push's contributor index, or -1
  const std::vector<uint32_t> host_of_;  // by rank (hierarchical); empty: index_of_
  std::vector<uint32_t> left_;     // per contributor: the rank whose leaving failed it
  const size_t wire_bytes_;
  const size_t acc_bytes_;

  mutable Mutex mu_;
  uint64_t round_ GUARDED_BY(mu_) = 0;  // the round being summed
  // Per contributor, from here on.
  std::vector<Stage> stage_ GUARDED_BY(mu_);
  std::vector<uint64_t> cookie_ GUARDED_BY(mu_);
  std::vector<uint64_t> sent_cookies_[2] GUARDED_BY(mu_);  // per slot: cookie_ as it completed
  std::vector<uint16_t> flags_ GUARDED_BY(mu_);
  std::vector<uint16_t> ranks_ GUARDED_BY(mu_);  // its push's Header::ranks (0: all)
  std::string failure_ GUARDED_BY(mu_);  // why the current round fails; empty: it does not
  Code failure_code_ GUARDED_BY(mu_) = Code::kOk;
  std::vector<bool> gone_ GUARDED_BY(mu_);  // left the job
  std::vector<bool> joined_ GUARDED_BY(mu_);  // joined (SetJoined), per participant
  uint32_t joined_count_ GUARDED_BY(mu_) = 0;  // how many are
  // Summed per host first (host_of_ set): per contributor (host), its workers (set by the
  // constructor, then read-only) and how many of them have joined; per rank, whether it has.
  std::vector<uint32_t> host_ranks_;
  std::vector<uint32_t> host_joined_ GUARDED_BY(mu_);
  std::vector<bool> rank_joined_ GUARDED_BY(mu_);
  // The accumulator holds this round's first contributions.
  bool acc_started_ GUARDED_BY(mu_) = false;
  Clock::time_point last_landed_ GUARDED_BY(mu_){};  // this round's latest push payload (EndPush)
  Clock::time_point first_push_ GUARDED_BY(mu_){};   // this round's first push header; {}: none
  uint32_t next_ GUARDED_BY(mu_) = 0;  // ranks [0, next_) are in the accumulator
  uint32_t sends_pending_[2] GUARDED_BY(mu_) = {0, 0};
  bool direct_ GUARDED_BY(mu_) = false;  // rank 0's push of round_ landed in acc_[round_ % 2]

  // Failover (Adopt()): per worker, whether its kRecover is in (0 no, 1 landing, 2 in), the
  // round it named, whether that is a result's (in reported_result_[i]), whether its push
  // follows; and each push's round while adopting.
  bool adopting_ GUARDED_BY(mu_) = false;
  std::vector<uint8_t> reported_ GUARDED_BY(mu_);
  std::vector<uint64_t> reported_round_ GUARDED_BY(mu_);
  std::vector<uint64_t> push_round_ GUARDED_BY(mu_);
  std::vector<bool> has_result_ GUARDED_BY(mu_);
  std::vector<bool> input_follows_ GUARDED_BY(mu_);
  std::vector<std::vector<std::byte>> reported_result_ GUARDED_BY(mu_);
  bool AdoptionReadyLocked() const REQUIRES(mu_);
  // Every worker has reported: sets the round, and returns the completion that answers the
  // pushes of the latest result's round, if any.
  std::optional<Completion> FinishAdoptionLocked() REQUIRES(mu_);

  std::vector<std::vector<std::byte>> staging_;  // wire dtype
  std::vector<std::byte> acc_[2];                // accumulator dtype
  std::vector<std::byte> out_[2];                // wire dtype, only where it differs from acc
  std::atomic<uint64_t> held_{0};
};

}  // namespace gradlink::server
