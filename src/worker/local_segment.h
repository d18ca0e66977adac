// The same-host path's shared-memory segment as its files see it (local_reduce.h is the public
// class): the segment's header (bells, departure and join flags, the channel table), the
// per-job bookkeeping the driving thread keeps, and small helpers the files share. Private to
// src/worker/local_*.cc; each protocol keeps its own channel layout in its file (local_flat.cc,
// local_host.cc).
//
// Threads: every field of Segment lies in memory shared between processes and is read and
// written by every worker of the host, by whichever of its threads drives (atomics only, or
// plain fields written before a release store). Running belongs to the driving thread
// (LocalReduce::drive_mu_ held).
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <vector>

#include "worker/local_reduce.h"

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace gradlink::internal {

namespace local_path {

inline constexpr uint64_t kLine = 64;  // a cache line: shared counters never share one
inline constexpr uint32_t kTableSize = 4096;  // channels (tensors) per segment
// Chunks one pass sums per job at most (then deadlines and waiting callers are looked at).
inline constexpr uint64_t kPassSums = 16;

inline uint64_t RoundUp(uint64_t n, uint64_t to) { return (n + to - 1) / to * to; }

inline void CpuRelax() {
#if defined(__x86_64__)
  _mm_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

// Adds the time from its construction to its destruction to `total`: the segment's work
// (copies and sums) as the stats report it. Two clock reads per chunk or partition.
class BusyTimer {
 public:
  explicit BusyTimer(std::atomic<uint64_t>& total) : total_(total), start_(Clock::now()) {}
  ~BusyTimer() {
    total_.fetch_add(static_cast<uint64_t>(std::chrono::duration_cast<std::chrono::nanoseconds>(
                                               Clock::now() - start_)
                                               .count()),
                     std::memory_order_relaxed);
  }
  BusyTimer(const BusyTimer&) = delete;
  BusyTimer& operator=(const BusyTimer&) = delete;

 private:
  std::atomic<uint64_t>& total_;
  const Clock::time_point start_;
};

// Every field lies in the shared mapping. Atomics of these sizes are lock-free and
// address-free, so they work between processes.
struct alignas(kLine) Bell {
  std::atomic<uint32_t> word{0};      // bumped on every post or consumption meant for this rank
  std::atomic<uint32_t> sleepers{0};  // threads of this rank in futex_wait on `word`
};

struct TableEntry {
  enum : uint32_t { kFree = 0, kClaiming = 1, kReady = 2 };
  std::atomic<uint32_t> state{kFree};
  uint32_t dtype = 0;
  uint64_t key = 0;
  uint64_t count = 0;
  uint64_t part_elems = 0;  // host channels: the most elements per partition; 0: a channel
  uint64_t offset = 0;  // into the arena; kNoRoom
};

}  // namespace local_path

struct LocalReduce::Segment {
  std::atomic<uint64_t> magic{0};  // set last by rank 0
  uint32_t ranks = 0;
  uint32_t table_size = 0;
  uint64_t arena_bytes = 0;
  uint64_t chunk_bytes = 0;
  std::atomic<uint32_t> opened{0};
  std::atomic<uint64_t> arena_used{0};
  local_path::Bell bells[kMaxRanks];
  std::atomic<uint32_t> gone[kMaxRanks];  // set by a worker that stops (it will post no more)
  // Why it stopped (its failure, or that it shut down), written before its `gone` flag: a peer
  // left waiting reports the cause (the scheduler lost, a server lost), not just the departure.
  char why_gone[kMaxRanks][192] = {};
  // Set by a worker that joined (Worker::Join): it posts nothing until every rank has, and sits
  // out every chunk it has not posted. Each join is one epoch: a flag holds the epoch its worker
  // joined in (the releases it had seen, plus one), and counts only while that epoch is not
  // released (`released`, raised by the first worker to see each release). So a worker that
  // learns of its own join late, after another worker of the host saw the release and posted
  // again, sets a flag that no longer counts.
  std::atomic<uint32_t> joined[kMaxRanks];
  std::atomic<uint32_t> released{0};
  char no_room[256] = {};  // with kMagicNoRoom: why worker 0 could not reserve the arena
  local_path::TableEntry table[local_path::kTableSize];

  std::byte* arena() {
    return reinterpret_cast<std::byte*>(this) + local_path::RoundUp(sizeof(Segment), 4096);
  }
};

// One job as the driving thread runs it (drive_mu_ held).
struct LocalReduce::Running {
  Job job;
  uint64_t next_post = 0, next_sum = 0;
  // Host jobs: this worker's partitions to sum (in order) and how far it got; which
  // partitions it has copied out, the first not yet copied, and how many are.
  std::vector<uint32_t> own_parts;
  size_t next_own = 0;
  std::vector<bool> copied;
  uint64_t copy_from = 0, copies = 0;
  bool began = false;  // host jobs: AdvanceHost has seen it once
  Status failure;
  bool abandoned = false;  // a rank it needs has left: it ends now, with `failure`
  Clock::time_point t_first_post, t_last_post, t_arrived;
};

}  // namespace gradlink::internal
