// The same-host path: when every worker of a job runs on one host, they sum each other's
// tensors through a shared-memory segment, worker to worker, and the servers are not used.
//
// Why: on one host a parameter server costs memory traffic and thread hand-offs that a
// network hides but a host does not (bench/RESULTS.md, "the same-host path"). This is what
// BytePS does within a machine (its local NCCL reduce) and what Horovod's hierarchical
// all-reduce does, with the same promise as the servers: the sum is taken in rank order with
// the servers' reducers, so the result is bit-identical to the one the servers would send
// back, whatever order the workers arrive in.
//
// The segment (created by rank 0, opened by the others, unlinked once all have it) holds a table
// of channels, one per tensor, claimed by the first worker that uses the tensor and found by
// key by the others, so no worker depends on another's declaration order. A channel has, per
// rank, two slots of up to `chunk_bytes` (double buffering) and two counters: the last chunk
// it posted, the last it consumed. A tensor goes through in chunks: each worker copies its chunk
// into its slot and posts it; once every rank has posted it, each worker sums all slots in rank
// order straight into its own tensor and marks the chunk consumed; a slot is written again
// only once every rank consumed what it held. Chunks of up to `chunk_bytes` stay in cache
// between the copy and the sums.
//
// Who drives: the thread that waits on an operation (Wait) or polls it (Progress), else a
// background thread.
// A caller that starts a small operation copies it in itself, and a caller in Wait() spins
// briefly on the segment before it sleeps on a futex there, so a small push_pull between idle
// workers costs no thread hand-off at all.
//
// Hierarchical aggregation (the job spans several hosts, some with several workers) uses the
// same segment, one per host, with host channels: every local worker copies each partition of
// its tensor into its input slot; the partition's pusher (control/topology.h) sums the slots in
// local-rank order into a result entry (fp32 for a 16-bit tensor's fp32 partials) and hands
// it to the servers (HostJob::summed); the pulled sum lands in that entry (Publish), and every
// local worker copies it into its own tensor. A host so moves each byte once each way.
//
// Errors: a worker that dies or hangs fails the job through the scheduler (its kAbort reaches
// every worker, which calls Fail()); operations that disagree on averaging fail with kMismatch
// on every worker. A segment too small for a tensor is not an error: every worker finds the
// same answer in the table (no room) and the tensor goes through the servers.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>

#include "common/mutex.h"
#include "common/thread_annotations.h"
#include <optional>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "gradlink/options.h"
#include "gradlink/status.h"
#include "gradlink/tensor.h"
#include "wire/messages.h"

namespace gradlink::internal {

class LocalReduce {
 public:
  // Most workers on one host that the segment serves.
  static constexpr uint32_t kMaxRanks = 64;

  struct Options {
    std::string name;       // shared-memory object name ("/gradlink-...")
    uint32_t rank = 0;      // this worker's rank among `ranks`; rank 0 creates the segment
    uint32_t ranks = 0;     // workers in the job (on this host, for host channels), 1..kMaxRanks
    // The job's rank of each of `ranks`, for messages; empty: the same numbers.
    std::vector<uint32_t> job_ranks;
    uint64_t arena_bytes = 0;  // bytes for channels (reserved up front: no SIGBUS later)
    uint64_t chunk_bytes = 0;  // most bytes a slot holds
    Clock::time_point deadline;  // for every rank to open the segment
    // Polled while waiting for the others: a failure (the job's) ends the wait with it.
    std::function<Status()> cancelled;
  };

  // Where a tensor's channel lies in the segment.
  struct Channel {
    uint64_t offset = 0;        // of its rank states; slots follow
    uint64_t chunk_elems = 0;   // elements per chunk (the last may hold fewer)
    uint64_t chunks = 0;        // per operation
  };

  // Where a tensor's host channel lies in the segment (hierarchical aggregation).
  struct HostChannel {
    uint64_t offset = 0;
    uint64_t part_elems = 0;   // the most elements of one partition
    uint32_t slots = 0;        // input slots per rank
    uint32_t entries = 0;      // result entries
    uint64_t in_bytes = 0;     // per input slot (the tensor's dtype)
    uint64_t entry_bytes = 0;  // per entry (what travels)
  };

  // One operation on one tensor: the caller's buffer, summed in place.
  struct Job {
    Channel channel;
    std::span<std::byte> data;
    DataType dtype{};
    uint64_t count = 0;
    uint64_t round = 0;      // the tensor's operation number (the same on every worker)
    bool average = false;
    std::string what;        // names the tensor in the failures the path finds itself
    // Called once, by the driving thread, when the job is over (OK: the sum is in `data`).
    // Times: first chunk posted, last chunk posted, last chunk posted by every rank. It runs
    // holding the drive: it must not wait (every other job of this worker waits for it).
    std::function<void(const Status&, Clock::time_point, Clock::time_point, Clock::time_point)>
        done;
    // Set for a host job (hierarchical aggregation; `channel` is then unused).
    std::optional<HostChannel> host;
    DataType wire{};                            // what travels: dtype, or fp32 partials
    std::span<const wire::PartitionPlan> parts;  // the key's partitions
    std::vector<uint32_t> pusher;                // per partition: the local rank that pushes it
    // Called on the driving thread once this worker's partition `part` is summed into `partial`
    // (`wire` dtype), which must then be pushed, and its sum pulled into the same bytes, then
    // Publish()ed. `flags`: the push's (kFlagHostDisagrees when the host's workers disagree);
    // `ranks`: the local workers summed in it (fewer than the host's when some had joined).
    std::function<void(uint32_t part, std::span<std::byte> partial, uint16_t flags,
                       uint32_t ranks)>
        summed;
    // This worker has joined (Worker::Join) and runs the round only for the others: it posts
    // nothing and copies nothing out, but sums and hands on the partitions it pushes for the
    // host (`data` is empty). Over once those are handed on.
    bool sits_out = false;
  };

  // Creates (rank 0) or opens the segment and returns once every rank has opened it; null (and
  // a warning) on every worker when worker 0 could not reserve the arena in /dev/shm: the job
  // then goes through the servers. kTimeout when a rank does not come.
  static Result<std::shared_ptr<LocalReduce>> Open(const Options& options);
  ~LocalReduce();
  LocalReduce(const LocalReduce&) = delete;
  LocalReduce& operator=(const LocalReduce&) = delete;

  // The channel of tensor `key` (`count` elements of `dtype`), claimed by the first worker to
  // ask and found by the others. nullopt: no room left in the table or the arena (every worker
  // gets the same answer). kInternal if another worker claimed the key with another shape.
  Result<std::optional<Channel>> Bind(uint64_t key, DataType dtype, uint64_t count);

  // The host channel of tensor `key`: `count` elements of `dtype` in partitions of at most
  // `part_elems`, travelling as `wire`. Claimed and found as Bind() does, with its answers.
  Result<std::optional<HostChannel>> BindHost(uint64_t key, DataType dtype, DataType wire,
                                              uint64_t count, uint64_t part_elems);
  // The pulled sum of partition `part` of round `round` (of a key of `parts` partitions) is in
  // its entry, or failed with `code`: every local worker copies it out (or fails the op with
  // `code`). Any thread; takes no lock.
  void Publish(const HostChannel& c, uint64_t round, uint32_t parts, uint32_t part, Code code);

  // Queues a job. Any thread, the caller's locks held or not; Progress() after releasing them.
  void Start(Job job);
  // What a thread that does not wait for an operation does for the queued jobs (Progress).
  enum class Step {
    // Post what the jobs can post now, on this thread, if no other thread drives (the caller's
    // PushPull: a small operation is copied in without a thread hand-off); the background
    // thread takes over chunks left to post. Sums are left to a waiter or the background.
    kPost,
    // One short pass (posts and a few sums) if no other thread drives; nothing otherwise.
    kPoll,
    // Nothing on this thread: the background thread (or a waiting caller) drives the jobs.
    kBackground,
  };
  // The one way a thread that does not wait makes the jobs progress. Never blocks. Any thread,
  // no lock held that Job::done or Job::summed takes.
  void Progress(Step step);
  // Drives the jobs until `done()` or the deadline; true if `done()`. Never sleeps holding the
  // drive: while another thread drives, it sleeps on this worker's bell. Any thread, no lock
  // held that Job::done or Job::summed takes.
  bool Wait(const std::function<bool()>& done, Clock::time_point deadline);
  // Wakes this worker's threads asleep in Wait() (an operation ended elsewhere).
  void Wake() { Ring(opts_.rank); }
  // Join (Worker::Join): this worker, with no job left, sits out the others' chunks from now on;
  // ClearJoined (every rank has joined, none is summing): every rank takes part again. On a
  // host channel a joined worker still pushes its partitions for the others (Job::sits_out).
  // Control thread only (both).
  void SetJoined();
  void ClearJoined();
  // Whether round `round` of the host channel `c` (of a key of `parts` partitions) has begun
  // on the host without this worker, which has joined: another worker posted its partition 0
  // while this worker's flag was still set. A release clears every flag before any worker
  // posts again, so a post of the next epoch is never taken for one to sit out. Any thread;
  // takes no lock.
  bool BegunWithoutMe(const HostChannel& c, uint64_t round, uint32_t parts) const;
  // The job failed: every job (queued or later) ends with `s`. Takes no lock a driver holds.
  void Fail(const Status& s);
  // Ends every job (with the failure given to Fail(), else kAborted) and joins the background
  // thread. Idempotent.
  void Stop();

  uint64_t arena_bytes() const;  // of the segment, as worker 0 reserved it
  uint64_t bytes_copied() const { return bytes_copied_.load(std::memory_order_relaxed); }
  uint64_t busy_ns() const { return busy_ns_.load(std::memory_order_relaxed); }
  bool busy() const { return jobs_.load(std::memory_order_acquire) > 0; }  // jobs not yet done

 private:
  struct Segment;
  struct Running;
  LocalReduce(const Options& o, void* base, uint64_t mapped_bytes);

  // drive_mu_ held (local_driver.cc). One pass: takes new jobs, advances each (posting what it
  // may, summing up to `sums_per_job` chunks), ends those done or failed. True if anything moved.
  bool DriveOnce(uint64_t sums_per_job) REQUIRES(drive_mu_) EXCLUDES(mu_);
  // drive_mu_ held: one pass of a flat job (local_flat.cc) or a host job (local_host.cc).
  bool AdvanceFlat(Running& r, uint64_t max_sums) REQUIRES(drive_mu_);
  bool AdvanceHost(Running& r, uint64_t max_sums) REQUIRES(drive_mu_);
  // Rank j, which `r` waits for, has stopped (it will never post or consume again): `r` fails,
  // naming j and `path`, and true. On the driving thread (it touches only `r` and the segment).
  bool AbandonIfGone(Running& r, uint32_t j, const char* path);
  // drive_mu_ held: the job has nothing left to do on this worker.
  static bool Finished(const Running& r);
  // Claims (or finds) the table entry of `key` with `need` arena bytes: its offset, nullopt
  // when there is no room. kInternal when another worker claimed the key with another shape.
  Result<std::optional<uint64_t>> Claim(uint64_t key, DataType dtype, uint64_t count,
                                        uint64_t part_elems, uint64_t need);
  uint32_t JobRank(uint32_t local) const {
    return local < opts_.job_ranks.size() ? opts_.job_ranks[local] : local;
  }
  std::string Name(uint32_t local) const { return "worker " + std::to_string(JobRank(local)); }
  // "worker J left the job (why it stopped)", once J's `gone` flag is seen.
  std::string LeftJob(uint32_t j) const;
  // Chunks not yet posted, or jobs not yet taken.
  bool PostsLeft() REQUIRES(drive_mu_) EXCLUDES(mu_);
  // Lets go of the drive; rings this worker's bell if more than `waiters_besides_me` callers
  // wait (one of them may sleep until the drive is free).
  void ReleaseDrive(uint32_t waiters_besides_me) RELEASE(drive_mu_);
  void WantBackground() EXCLUDES(mu_);
  void Ring(uint32_t rank);
  void RingPeers();
  void SleepOnBell(uint32_t seen, Clock::time_point until);
  void Background() EXCLUDES(drive_mu_, mu_);

  // Whether worker j has joined and its join's epoch is not yet released (Segment::joined).
  bool HasJoined(uint32_t j) const;

  const Options opts_;
  Segment* const seg_;
  uint32_t releases_seen_ = 0;  // join releases this worker saw (SetJoined, ClearJoined)
  const uint64_t mapped_bytes_;
  std::vector<std::byte> scratch_ GUARDED_BY(drive_mu_);  // fp32 accumulator for fp16/bf16 chunks

  // Held by the one thread driving, which never sleeps holding it; taken before mu_ (and before
  // the worker's state lock, which Job::done takes), never under them. Callers only try it;
  // the background thread and Stop() wait for it.
  Mutex drive_mu_ ACQUIRED_BEFORE(mu_);
  std::vector<std::unique_ptr<Running>> running_ GUARDED_BY(drive_mu_);
  std::vector<Job> fresh_ GUARDED_BY(drive_mu_);  // jobs just taken from incoming_

  Mutex mu_;  // taken under drive_mu_, held briefly
  CondVar cv_;  // the background thread's wake-up (background_wanted_, stopping_)
  std::vector<Job> incoming_ GUARDED_BY(mu_);
  Status failure_ GUARDED_BY(mu_);
  bool stopping_ GUARDED_BY(mu_) = false;
  bool background_wanted_ GUARDED_BY(mu_) = false;  // work is left that no caller drives
  std::atomic<bool> failed_{false};
  std::atomic<uint32_t> callers_waiting_{0};
  std::atomic<uint64_t> jobs_{0};  // started, not yet done
  std::atomic<uint64_t> bytes_copied_{0};
  std::atomic<uint64_t> busy_ns_{0};  // time spent copying and summing (BusyTimer)
  std::thread background_;
};

}  // namespace gradlink::internal
