// The flat protocol of the same-host path (local_reduce.h): every worker of the job on one
// host, each tensor through its channel in chunks. A channel's layout (per rank: the last chunk
// posted and consumed, and two slots), its geometry (Bind), and one pass of a flat job on this
// worker (AdvanceFlat): post the next chunks into this worker's slots, then, once every rank
// posted a chunk, sum all slots in rank order into the worker's own tensor.
//
// Threads: Bind runs on the thread that binds a tensor (outside every lock); AdvanceFlat on the
// driving thread (drive_mu_ held). The counters and slots are shared with the other workers'
// driving threads through the segment: a slot is written only after its counters say every
// rank consumed what it held (acquire/release pairs on `posted` and `consumed`).
#include <algorithm>
#include <array>
#include <cstring>

#include "reduce/reduce.h"
#include "worker/local_reduce.h"
#include "worker/local_segment.h"

namespace gradlink::internal {

using local_path::BusyTimer;
using local_path::kLine;
using local_path::RoundUp;

namespace {

// Per rank, in a channel: what it posted and consumed (chunk sequence numbers, counted over the
// channel's life), and whether the chunk in each slot is to be averaged.
struct alignas(kLine) RankState {
  std::atomic<uint64_t> posted{0};
  std::atomic<uint64_t> consumed{0};
  std::atomic<uint32_t> average[2];
};

uint64_t SlotBytes(const LocalReduce::Channel& c, DataType t) {
  return RoundUp(c.chunk_elems * DataTypeSize(t), kLine);
}

uint64_t ChannelBytes(uint32_t ranks, uint64_t slot_bytes) {
  return ranks * sizeof(RankState) + uint64_t{ranks} * 2 * slot_bytes;
}

}  // namespace

Result<std::optional<LocalReduce::Channel>> LocalReduce::Bind(uint64_t key, DataType dtype,
                                                             uint64_t count) {
  Channel c;
  c.chunk_elems = std::max<uint64_t>(1, seg_->chunk_bytes / DataTypeSize(dtype));
  c.chunk_elems = std::min(c.chunk_elems, std::max<uint64_t>(count, 1));
  c.chunks = (count + c.chunk_elems - 1) / c.chunk_elems;
  const uint64_t need = ChannelBytes(opts_.ranks, SlotBytes(c, dtype));
  GL_ASSIGN_OR_RETURN(std::optional<uint64_t> offset, Claim(key, dtype, count, 0, need));
  if (!offset) return std::optional<Channel>();
  c.offset = *offset;
  return std::optional<Channel>(c);
}

bool LocalReduce::AdvanceFlat(Running& r, uint64_t max_sums) {
  const Job& job = r.job;
  const Channel& ch = job.channel;
  const uint32_t ranks = opts_.ranks, me = opts_.rank;
  const uint64_t esize = DataTypeSize(job.dtype);
  const uint64_t slot_bytes = SlotBytes(ch, job.dtype);
  std::byte* base = seg_->arena() + ch.offset;
  auto* state = reinterpret_cast<RankState*>(base);
  std::byte* slots = base + ranks * sizeof(RankState);
  auto slot = [&](uint32_t rank, uint64_t seq) {
    return slots + (rank * 2 + seq % 2) * slot_bytes;
  };
  auto seq_of = [&](uint64_t chunk) { return job.round * ch.chunks + chunk + 1; };
  auto elems_of = [&](uint64_t chunk) {
    return std::min(ch.chunk_elems, job.count - chunk * ch.chunk_elems);
  };
  bool moved = false;
  auto abandon_if_gone = [&](uint32_t j) { return AbandonIfGone(r, j, "same-host path"); };

  // Rank j has joined and did not post chunk `seq`: it sits the chunk out. Its flag is read
  // first: once set, its counters no longer move.
  auto sits_out = [&](uint32_t j, uint64_t seq) {
    return HasJoined(j) && state[j].posted.load(std::memory_order_acquire) < seq;
  };
  // This worker sat rounds of the tensor out (or never used it) while it had joined: its
  // counters catch up with the round it resumes at, as if it had posted and consumed them.
  if (r.next_post == 0 && r.next_sum == 0) {
    const uint64_t resume = job.round * ch.chunks;
    if (state[me].posted.load(std::memory_order_relaxed) < resume) {
      state[me].consumed.store(resume, std::memory_order_release);
      state[me].posted.store(resume, std::memory_order_release);
    }
  }

  // Post: copy the next chunk in once every rank has consumed what its slot held.
  while (r.next_post < ch.chunks && r.next_post < r.next_sum + 2) {
    const uint64_t seq = seq_of(r.next_post);
    bool free = true;
    for (uint32_t j = 0; j < ranks && seq > 2; ++j) {
      if (state[j].consumed.load(std::memory_order_acquire) < seq - 2 && !sits_out(j, seq - 2)) {
        free = false;
        if (abandon_if_gone(j)) return true;
        break;
      }
    }
    if (!free) break;
    const uint64_t bytes = elems_of(r.next_post) * esize;
    {
      BusyTimer busy(busy_ns_);
      std::memcpy(slot(me, seq), job.data.data() + r.next_post * ch.chunk_elems * esize, bytes);
    }
    state[me].average[seq % 2].store(job.average ? 1 : 0, std::memory_order_relaxed);
    state[me].posted.store(seq, std::memory_order_release);
    RingPeers();
    bytes_copied_.fetch_add(bytes, std::memory_order_relaxed);
    const Clock::time_point now = Clock::now();
    if (r.next_post == 0) r.t_first_post = now;
    r.t_last_post = now;
    ++r.next_post;
    moved = true;
  }

  // Sum: once every rank has posted the chunk, all slots in rank order into our tensor.
  for (uint64_t summed = 0; r.next_sum < r.next_post && summed < max_sums; ++summed) {
    const uint64_t seq = seq_of(r.next_sum);
    // The ranks in this chunk's sum, in rank order: all but those that joined and sat it out.
    std::array<uint32_t, kMaxRanks> in;
    uint32_t n_in = 0;
    for (uint32_t j = 0; j < ranks; ++j) {
      if (sits_out(j, seq)) continue;
      if (state[j].posted.load(std::memory_order_acquire) < seq) {
        return abandon_if_gone(j) || moved;
      }
      in[n_in++] = j;
    }
    if (r.next_sum + 1 == ch.chunks) r.t_arrived = Clock::now();
    const uint32_t avg0 = state[in[0]].average[seq % 2].load(std::memory_order_relaxed);
    for (uint32_t k = 1; k < n_in && r.failure.ok(); ++k) {
      const uint32_t j = in[k];
      const uint32_t avg = state[j].average[seq % 2].load(std::memory_order_relaxed);
      if (avg != avg0) {
        r.failure = Mismatch(job.what + " round " + std::to_string(job.round) + ": rank " +
                             std::to_string(JobRank(in[0])) + " " + (avg0 ? "averages" : "sums") +
                             " but rank " + std::to_string(JobRank(j)) + " " +
                             (avg ? "averages" : "sums"));
      }
    }
    if (r.failure.ok()) {
      BusyTimer busy(busy_ns_);
      const uint64_t n = elems_of(r.next_sum);
      std::byte* out = job.data.data() + r.next_sum * ch.chunk_elems * esize;
      const DataType acc_type = reduce::AccumulatorType(job.dtype);
      std::byte* acc = out;
      if (DataTypeSize(acc_type) != esize) {
        if (scratch_.size() < n * DataTypeSize(acc_type)) {
          scratch_.resize(ch.chunk_elems * DataTypeSize(acc_type));
        }
        acc = scratch_.data();
      }
      // The servers' order and reducers (src/server/partition_state.cc): bit-identical sums.
      if (n_in == 1) {
        reduce::Load(job.dtype, acc, slot(in[0], seq), n);
      } else {
        reduce::SumTwo(job.dtype, acc, slot(in[0], seq), slot(in[1], seq), n);
      }
      for (uint32_t k = 2; k < n_in; ++k) reduce::Accumulate(job.dtype, acc, slot(in[k], seq), n);
      // Every rank, joined ones included (they add zeros: PartitionState's average).
      const uint32_t divisor = avg0 ? ranks : 1;
      if (acc != out || divisor != 1) reduce::Store(job.dtype, out, acc, n, divisor);
    }
    state[me].consumed.store(seq, std::memory_order_release);
    RingPeers();
    ++r.next_sum;
    moved = true;
  }
  return moved;
}

}  // namespace gradlink::internal
