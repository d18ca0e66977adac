// The host protocol of the segment (local_reduce.h, "host channels"): hierarchical
// aggregation, where the job spans hosts and a host's workers meet in its segment. A host
// channel's layout (per rank its posts, per input slot the last partition summed out of it,
// per result entry the partition whose sum it holds), its geometry (BindHost), one pass of a
// host job on this worker (AdvanceHost: post partitions into input slots, sum this worker's
// partitions into entries and hand them to the servers, copy every returned sum out), the
// pulled sum handed back (Publish), and whether a round began without a joined worker
// (BegunWithoutMe).
//
// Threads: BindHost runs on the declaring thread (outside every lock); AdvanceHost on the
// driving thread (drive_mu_ held), which calls Job::summed; Publish on whichever thread
// received the pull (a lane's), BegunWithoutMe on the control or a joining thread: both take
// no lock and touch only the segment's atomics. What is shared with the host's other workers
// is ordered by acquire/release pairs on `posted`, `in_free`, `ready` and `copied`.
#include <algorithm>
#include <array>
#include <cstring>
#include <optional>

#include "reduce/reduce.h"
#include "wire/frame.h"
#include "worker/local_reduce.h"
#include "worker/local_segment.h"

namespace gradlink::internal {

using local_path::BusyTimer;
using local_path::kLine;
using local_path::RoundUp;

namespace {

// A host channel's head: per rank, the last partition it posted (counted over the channel's
// life, from 1) and each input slot's averaging; per input slot, the last partition summed out
// of it (the slot is free again); per result entry, the partition whose sum it holds (ready),
// with its failure code, and what each rank copied out of it.
constexpr uint32_t kHostSlots = 8;
constexpr uint32_t kHostEntries = 32;
// Input slots and result entries get this much of the arena at most (per rank for the slots),
// in whole partitions, at least one: 64 KiB partitions give 8 slots and 32 entries (2 MiB in
// flight per tensor and host, more than a host's window). On 3 hosts x 2 workers, 16 slots
// gave 3-5% more than 4 in one run, about the noise; 8 is between at half 16's memory
// (bench/RESULTS.md, "Hierarchy").
constexpr uint64_t kHostSlotBudget = 512u << 10;
constexpr uint64_t kHostEntryBudget = 2u << 20;

struct alignas(kLine) HostRank {
  std::atomic<uint64_t> posted{0};
  std::atomic<uint32_t> average[kHostSlots];
};

struct alignas(kLine) HostEntry {
  std::atomic<uint64_t> ready{0};
  std::atomic<uint32_t> code{0};
  std::atomic<uint64_t> copied[LocalReduce::kMaxRanks];
};

struct HostHead {
  HostRank rank[LocalReduce::kMaxRanks];
  alignas(kLine) std::atomic<uint64_t> in_free[kHostSlots];
  HostEntry entry[kHostEntries];
};

}  // namespace

Result<std::optional<LocalReduce::HostChannel>> LocalReduce::BindHost(uint64_t key, DataType dtype,
                                                                     DataType wire, uint64_t count,
                                                                     uint64_t part_elems) {
  HostChannel c;
  c.part_elems = std::max<uint64_t>(1, std::min(part_elems, count));
  const uint64_t parts = (count + c.part_elems - 1) / c.part_elems;
  c.in_bytes = RoundUp(c.part_elems * DataTypeSize(dtype), kLine);
  c.entry_bytes = RoundUp(c.part_elems * DataTypeSize(wire), kLine);
  const auto fit = [parts](uint64_t budget, uint64_t each, uint32_t most) {
    return static_cast<uint32_t>(
        std::max<uint64_t>(1, std::min<uint64_t>({budget / each, most, parts})));
  };
  c.slots = fit(kHostSlotBudget, c.in_bytes, kHostSlots);
  c.entries = fit(kHostEntryBudget, c.entry_bytes, kHostEntries);
  const uint64_t need = RoundUp(sizeof(HostHead), kLine) +
                        uint64_t{opts_.ranks} * c.slots * c.in_bytes + c.entries * c.entry_bytes;
  GL_ASSIGN_OR_RETURN(std::optional<uint64_t> offset,
                      Claim(key, dtype, count, c.part_elems, need));
  if (!offset) return std::optional<HostChannel>();
  c.offset = *offset;
  return std::optional<HostChannel>(c);
}

void LocalReduce::Publish(const HostChannel& c, uint64_t round, uint32_t parts, uint32_t part,
                          Code code) {
  auto* head = reinterpret_cast<HostHead*>(seg_->arena() + c.offset);
  const uint64_t n = round * parts + part + 1;
  HostEntry& e = head->entry[(n - 1) % c.entries];
  e.code.store(static_cast<uint32_t>(code), std::memory_order_relaxed);
  e.ready.store(n, std::memory_order_release);
  RingPeers();
  Ring(opts_.rank);
}

bool LocalReduce::BegunWithoutMe(const HostChannel& c, uint64_t round, uint32_t parts) const {
  const auto* head = reinterpret_cast<const HostHead*>(seg_->arena() + c.offset);
  const uint64_t first = round * parts + 1;  // partition 0 of `round`
  bool posted = false;
  for (uint32_t j = 0; j < opts_.ranks && !posted; ++j) {
    posted = j != opts_.rank && head->rank[j].posted.load(std::memory_order_acquire) >= first;
  }
  // After the post: a release (the epoch it ends), which came before any post of the next
  // epoch, is seen here.
  return posted && HasJoined(opts_.rank);
}

// One pass over a host job: post what the input slots let in, sum this worker's partitions
// (in order) once every rank posted them and their entry is free, copy out every sum that
// came back. Each step only ever waits on another, never blocks: the posts of one partition
// need the sums of an earlier one, those need the copies of an earlier one, which need the
// servers, so a worker that stopped at one step would hold up the host.
bool LocalReduce::AdvanceHost(Running& r, uint64_t max_sums) {
  const Job& job = r.job;
  const HostChannel& ch = *job.host;
  const uint32_t ranks = opts_.ranks, me = opts_.rank;
  const uint32_t parts = static_cast<uint32_t>(job.parts.size());
  const uint64_t esize = DataTypeSize(job.dtype), wsize = DataTypeSize(job.wire);
  std::byte* base = seg_->arena() + ch.offset;
  auto* head = reinterpret_cast<HostHead*>(base);
  std::byte* in = base + RoundUp(sizeof(HostHead), kLine);
  std::byte* entries = in + uint64_t{ranks} * ch.slots * ch.in_bytes;
  // Partition p of this round, counted over the channel's life from 1.
  auto number = [&](uint64_t p) { return job.round * parts + p + 1; };
  auto slot_of = [&](uint64_t n) { return static_cast<uint32_t>((n - 1) % ch.slots); };
  auto entry_of = [&](uint64_t n) { return static_cast<uint32_t>((n - 1) % ch.entries); };
  auto input = [&](uint32_t rank, uint64_t n) {
    return in + (uint64_t{rank} * ch.slots + slot_of(n)) * ch.in_bytes;
  };
  auto entry = [&](uint64_t n) { return entries + entry_of(n) * ch.entry_bytes; };
  auto abandon_if_gone = [&](uint32_t j) {
    return AbandonIfGone(r, j, "hierarchical aggregation");
  };
  // Rank j has joined (Worker::Join) and did not post partition n: it sits it out. Its flag is
  // read first: once set, its counters no longer move (it joined with no job of its own left,
  // every entry it had to copy copied).
  auto sits_out = [&](uint32_t j, uint64_t n) {
    return HasJoined(j) && head->rank[j].posted.load(std::memory_order_acquire) < n;
  };
  bool moved = false;
  if (!r.began) {
    r.began = true;
    if (job.sits_out) {
      r.next_post = parts;  // it pushes the others' partials, posting nothing
    } else {
      // Rounds of this key this worker sat out (it had joined) left its copy marks behind, and
      // rounds its whole host sat out left the slots' marks behind. Every partition before
      // this round was summed and needs no copy from this worker any more: every rank had
      // ended its part of them when this one began (it had ended its own last round, or all
      // had joined), and a partition of this round is summed only once this rank posts it.
      const uint64_t before = job.round * parts;
      for (uint32_t e = 0; e < ch.entries; ++e) {
        std::atomic<uint64_t>& mark = head->entry[e].copied[me];
        if (mark.load(std::memory_order_relaxed) < before) {
          mark.store(before, std::memory_order_release);
        }
      }
      for (uint32_t s = 0; s < ch.slots; ++s) {
        uint64_t mark = head->in_free[s].load(std::memory_order_acquire);
        while (mark < before &&
               !head->in_free[s].compare_exchange_weak(mark, before, std::memory_order_acq_rel)) {
        }
      }
    }
  }

  // Post: the next partition into its input slot, once its last user was summed.
  while (r.next_post < parts) {
    const uint64_t n = number(r.next_post);
    const uint32_t s = slot_of(n);
    if (n > ch.slots && head->in_free[s].load(std::memory_order_acquire) < n - ch.slots) {
      const uint32_t pusher = job.pusher[(n - ch.slots - 1) % parts];  // the slot's last user
      if (abandon_if_gone(pusher)) return true;
      break;
    }
    const wire::PartitionPlan& p = job.parts[r.next_post];
    {
      BusyTimer busy(busy_ns_);
      std::memcpy(input(me, n), job.data.data() + p.offset * esize, p.count * esize);
    }
    head->rank[me].average[s].store(job.average ? 1 : 0, std::memory_order_relaxed);
    head->rank[me].posted.store(n, std::memory_order_release);
    bytes_copied_.fetch_add(p.count * esize, std::memory_order_relaxed);
    const Clock::time_point now = Clock::now();
    if (r.next_post == 0) r.t_first_post = now;
    r.t_last_post = now;
    ++r.next_post;
    moved = true;
    if (ranks > 1) RingPeers();
  }

  // Sum: this worker's partitions, in order, the ranks in local-rank order, into the entry.
  for (uint64_t done = 0; r.next_own < r.own_parts.size() && done < max_sums; ++done) {
    const uint32_t part = r.own_parts[r.next_own];
    const uint64_t n = number(part);
    // Not yet: a rank has not posted it, or not copied out what its entry held. Then on to the
    // copies (ours may be what the entry waits for). The ranks in the sum, in local-rank order:
    // all but those that joined and sat it out.
    std::optional<uint32_t> waits_for;
    HostEntry& e = head->entry[entry_of(n)];
    std::array<uint32_t, kMaxRanks> in_sum;
    uint32_t n_in = 0;
    for (uint32_t j = 0; j < ranks && !waits_for; ++j) {
      if (n > ch.entries && !HasJoined(j) &&
          e.copied[j].load(std::memory_order_acquire) < n - ch.entries) {
        waits_for = j;
      } else if (!sits_out(j, n)) {
        if (head->rank[j].posted.load(std::memory_order_acquire) < n) {
          waits_for = j;
        } else {
          in_sum[n_in++] = j;
        }
      }
    }
    if (waits_for) {
      if (abandon_if_gone(*waits_for)) return true;
      break;
    }
    if (n_in == 0) {  // a round is run sat out only once begun by a post (BegunWithoutMe)
      r.failure = Internal(job.what + " partition " + std::to_string(part) + " round " +
                           std::to_string(job.round) + ": every worker of the host sat it out");
      r.abandoned = true;
      return true;
    }
    const uint32_t s = slot_of(n);
    const uint32_t first = in_sum[0];
    const uint32_t avg0 = head->rank[first].average[s].load(std::memory_order_relaxed);
    uint16_t flags = avg0 ? wire::kFlagAverage : 0;
    for (uint32_t k = 1; k < n_in; ++k) {
      const uint32_t j = in_sum[k];
      const uint32_t avg = head->rank[j].average[s].load(std::memory_order_relaxed);
      if (avg == avg0) continue;
      flags |= wire::kFlagHostDisagrees;
      if (r.failure.ok()) {
        r.failure = Mismatch(job.what + " round " + std::to_string(job.round) + ": rank " +
                             std::to_string(JobRank(first)) + " " + (avg0 ? "averages" : "sums") +
                             " but rank " + std::to_string(JobRank(j)) + " " +
                             (avg ? "averages" : "sums"));
      }
    }
    const uint64_t count = job.parts[part].count;
    std::byte* out = entry(n);
    std::optional<BusyTimer> busy(std::in_place, busy_ns_);
    // The servers' reducers, in local-rank order. The accumulator is the entry itself where it
    // has the accumulator's type (fp32 partials of a 16-bit tensor, fp32, fp64, int64).
    const DataType acc_type = reduce::AccumulatorType(job.dtype);
    std::byte* acc = out;
    if (acc_type != job.wire) {
      if (scratch_.size() < count * DataTypeSize(acc_type)) {
        scratch_.resize(ch.part_elems * DataTypeSize(acc_type));
      }
      acc = scratch_.data();
    }
    if (n_in == 1) {
      reduce::Load(job.dtype, acc, input(in_sum[0], n), count);
    } else {
      reduce::SumTwo(job.dtype, acc, input(in_sum[0], n), input(in_sum[1], n), count);
      for (uint32_t k = 2; k < n_in; ++k) {
        reduce::Accumulate(job.dtype, acc, input(in_sum[k], n), count);
      }
    }
    if (acc != out) reduce::Store(job.dtype, out, acc, count, 1);
    busy.reset();
    head->in_free[s].store(n, std::memory_order_release);
    if (ranks > 1) RingPeers();
    ++r.next_own;
    moved = true;
    job.summed(part, std::span<std::byte>(out, count * wsize), flags, n_in);
  }

  if (job.sits_out) return moved;  // it copies nothing out
  // Copy out: every sum that came back, in whatever order the servers answered. Only the
  // entries' depth can be outstanding: a partition that far ahead waits for our copy.
  const uint64_t end = std::min<uint64_t>(parts, r.copy_from + ch.entries);
  for (uint64_t part = r.copy_from; part < end; ++part) {
    if (r.copied[part]) continue;
    const uint64_t n = number(part);
    HostEntry& e = head->entry[entry_of(n)];
    if (e.ready.load(std::memory_order_acquire) != n) continue;
    const uint32_t code = e.code.load(std::memory_order_relaxed);
    const wire::PartitionPlan& p = job.parts[part];
    if (code != 0) {
      if (r.failure.ok()) {
        const uint32_t pusher = job.pusher[part];
        r.failure = Status(static_cast<Code>(code),
                           job.what + " partition " + std::to_string(part) + " round " +
                               std::to_string(job.round) + ": its sum failed at " +
                               Name(pusher) + ", which pushes it for this host" +
                               (pusher == me ? "" : " (its error names the cause)"));
      }
    } else {
      BusyTimer busy(busy_ns_);
      if (job.wire == job.dtype) {
        std::memcpy(job.data.data() + p.offset * esize, entry(n), p.count * esize);
      } else {
        reduce::Store(job.dtype, job.data.data() + p.offset * esize, entry(n), p.count, 1);
      }
      bytes_copied_.fetch_add(p.count * esize, std::memory_order_relaxed);
    }
    e.copied[me].store(n, std::memory_order_release);
    if (ranks > 1) RingPeers();
    r.copied[part] = true;
    ++r.copies;
    moved = true;
    if (r.copies == parts) r.t_arrived = Clock::now();
  }
  while (r.copy_from < parts && r.copied[r.copy_from]) ++r.copy_from;
  return moved;
}

}  // namespace gradlink::internal
