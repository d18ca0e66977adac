// src/control/layout.h: segments, participants and roles of a key's collective.
#include "control/layout.h"

#include <algorithm>

namespace gradlink {

std::string_view CollectiveName(Collective c) {
  switch (c) {
    case Collective::kAllreduce: return "allreduce";
    case Collective::kBroadcast: return "broadcast";
    case Collective::kAllgather: return "allgather";
    case Collective::kReduceScatter: return "reduce_scatter";
    case Collective::kAlltoall: return "alltoall";
  }
  return "unknown collective";
}

std::string_view ReduceOpName(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum: return "sum";
    case ReduceOp::kMin: return "min";
    case ReduceOp::kMax: return "max";
    case ReduceOp::kProduct: return "product";
  }
  return "unknown op";
}

std::string DescribeSpec(const CollectiveSpec& s) {
  std::string out(CollectiveName(s.kind));
  if (s.kind == Collective::kAllreduce || s.kind == Collective::kReduceScatter) {
    out += " (" + std::string(ReduceOpName(s.op)) + ")";
  }
  if (s.kind == Collective::kBroadcast) {
    out += " from " + std::string(s.group.empty() ? "rank " : "position ") +
           std::to_string(s.root);
  }
  if (!s.counts.empty()) {
    out += " of [";
    const size_t shown = std::min<size_t>(s.counts.size(), 16);
    for (size_t i = 0; i < shown; ++i) out += (i ? ", " : "") + std::to_string(s.counts[i]);
    if (shown < s.counts.size()) out += ", ... (" + std::to_string(s.counts.size()) + " counts)";
    out += "]";
  }
  if (!s.group.empty()) {
    out += " in group [";
    const size_t shown = std::min<size_t>(s.group.size(), 16);
    for (size_t i = 0; i < shown; ++i) out += (i ? ", " : "") + std::to_string(s.group[i]);
    if (shown < s.group.size()) out += ", ... (" + std::to_string(s.group.size()) + " ranks)";
    out += "]";
  }
  return out;
}

namespace layout {
namespace {

bool Reduces(Collective k) { return k == Collective::kAllreduce || k == Collective::kReduceScatter; }

uint64_t CountsExpected(Collective k, uint32_t workers) {
  switch (k) {
    case Collective::kAllgather:
    case Collective::kReduceScatter: return workers;
    case Collective::kAlltoall: return uint64_t{workers} * workers;
    default: return 0;
  }
}

// Sum of counts[begin, begin + n * stride) with that stride.
uint64_t SumCounts(const std::vector<uint64_t>& c, uint64_t begin, uint64_t n, uint64_t stride) {
  uint64_t s = 0;
  for (uint64_t i = 0; i < n; ++i) s += c[begin + i * stride];
  return s;
}

}  // namespace

uint32_t Members(const CollectiveSpec& spec, uint32_t workers) {
  return spec.group.empty() ? workers : static_cast<uint32_t>(spec.group.size());
}

int64_t PositionOf(const CollectiveSpec& spec, uint32_t rank) {
  if (spec.group.empty()) return rank;
  auto it = std::lower_bound(spec.group.begin(), spec.group.end(), rank);
  return it != spec.group.end() && *it == rank ? it - spec.group.begin() : -1;
}

bool GroupIsValid(const CollectiveSpec& spec, uint32_t workers) {
  for (size_t i = 0; i < spec.group.size(); ++i) {
    if (spec.group[i] >= workers || (i > 0 && spec.group[i] <= spec.group[i - 1])) return false;
  }
  return true;
}

uint32_t RankAt(const CollectiveSpec& spec, uint32_t position) {
  return spec.group.empty() ? position : spec.group[position];
}

Status Check(const CollectiveSpec& spec, uint32_t job_workers, uint64_t count) {
  const std::string what = DescribeSpec(spec);
  if (!GroupIsValid(spec, job_workers)) {
    return InvalidArgument(what + ": a group lists ranks of the job (" +
                           std::to_string(job_workers) + " workers) in ascending order, once each");
  }
  const uint32_t workers = Members(spec, job_workers);
  if (static_cast<uint8_t>(spec.kind) > static_cast<uint8_t>(Collective::kAlltoall)) {
    return InvalidArgument("unknown collective " + std::to_string(static_cast<int>(spec.kind)));
  }
  if (static_cast<uint8_t>(spec.op) > static_cast<uint8_t>(ReduceOp::kProduct)) {
    return InvalidArgument("unknown reduce op " + std::to_string(static_cast<int>(spec.op)));
  }
  if (!Reduces(spec.kind) && spec.op != ReduceOp::kSum) {
    return InvalidArgument(what + ": only allreduce and reduce_scatter take a reduce op");
  }
  if (spec.kind == Collective::kBroadcast && spec.root >= workers) {
    return InvalidArgument(what + ": the root is not one of the " + std::to_string(workers) +
                           (spec.group.empty() ? " workers" : " members of the group"));
  }
  if (spec.kind != Collective::kBroadcast && spec.root != 0) {
    return InvalidArgument(what + ": only broadcast takes a root");
  }
  const uint64_t expected = CountsExpected(spec.kind, workers);
  if (expected > kMaxCounts) {
    return InvalidArgument(what + ": " + std::to_string(workers) + " workers need " +
                           std::to_string(expected) + " counts, more than " +
                           std::to_string(kMaxCounts));
  }
  if (spec.counts.size() != expected) {
    return InvalidArgument(what + ": " + std::to_string(spec.counts.size()) + " counts for " +
                           std::to_string(workers) + " workers, which need " +
                           std::to_string(expected));
  }
  if (expected != 0) {
    uint64_t total = 0;
    for (uint64_t c : spec.counts) {
      if (c > count - std::min(total, count)) {
        return InvalidArgument(what + ": the counts add up to more than the key's " +
                               std::to_string(count) + " elements");
      }
      total += c;
    }
    if (total != count) {
      return InvalidArgument(what + ": the counts add up to " + std::to_string(total) +
                             " elements, the key has " + std::to_string(count));
    }
  }
  return Status::Ok();
}

Status CheckPlan(const CollectiveSpec& spec, uint32_t workers, uint64_t count,
                 const std::vector<wire::PartitionPlan>& partitions) {
  if (Status s = Check(spec, workers, count); !s.ok()) {
    return ProtocolError("kAssign with a bad collective: " + s.message());
  }
  const std::vector<Segment> segments = Segments(spec, workers, count);
  for (const wire::PartitionPlan& p : partitions) {  // (positions of the group below)
    const Segment& s = segments[SegmentAt(segments, p.offset)];
    if (p.offset < s.offset || p.count > s.count || p.offset - s.offset > s.count - p.count) {
      return ProtocolError("kAssign of a " + DescribeSpec(spec) + ": partition at element " +
                           std::to_string(p.offset) + " straddles a segment");
    }
  }
  return Status::Ok();
}

std::vector<Segment> Segments(const CollectiveSpec& spec, uint32_t job_workers, uint64_t count) {
  const uint32_t workers = Members(spec, job_workers);
  std::vector<Segment> out;
  uint64_t at = 0;
  auto add = [&](uint64_t n, uint32_t src, uint32_t dst) {
    out.push_back(Segment{at, n, src, dst});
    at += n;
  };
  switch (spec.kind) {
    case Collective::kAllreduce: add(count, kEveryRank, kEveryRank); break;
    case Collective::kBroadcast: add(count, spec.root, kEveryRank); break;
    case Collective::kAllgather:
      for (uint32_t r = 0; r < workers; ++r) add(spec.counts[r], r, kEveryRank);
      break;
    case Collective::kReduceScatter:
      for (uint32_t r = 0; r < workers; ++r) add(spec.counts[r], kEveryRank, r);
      break;
    case Collective::kAlltoall:
      for (uint32_t i = 0; i < workers; ++i) {
        for (uint32_t j = 0; j < workers; ++j) add(spec.counts[uint64_t{i} * workers + j], i, j);
      }
      break;
  }
  return out;
}

uint32_t SegmentAt(const std::vector<Segment>& segments, uint64_t offset) {
  // The last segment starting at or before `offset` that is not empty there.
  auto it = std::upper_bound(segments.begin(), segments.end(), offset,
                             [](uint64_t o, const Segment& s) { return o < s.offset; });
  uint32_t i = static_cast<uint32_t>(it - segments.begin());
  while (i > 0 && (segments[i - 1].count == 0 || segments[i - 1].offset > offset)) --i;
  return i == 0 ? 0 : i - 1;
}

bool Peers::local_only() const {
  return std::none_of(receives.begin(), receives.end(), [](bool r) { return r; });
}

Peers PeersOf(const CollectiveSpec& spec, const Segment& s, uint32_t job_workers) {
  const uint32_t workers = Members(spec, job_workers);
  Peers p;
  if (s.src == kEveryRank) {
    for (uint32_t r = 0; r < workers; ++r) {
      p.contributors.push_back(RankAt(spec, r));
      p.receives.push_back(s.dst == kEveryRank || s.dst == r);
    }
    return p;
  }
  p.contributors.push_back(RankAt(spec, s.src));
  p.receives.push_back(false);  // a single contributor has its own elements
  for (uint32_t r = 0; r < workers; ++r) {
    if (r == s.src || (s.dst != kEveryRank && s.dst != r)) continue;
    p.requesters.push_back(RankAt(spec, r));
    p.receives.push_back(true);
  }
  return p;
}

uint64_t InputCount(const CollectiveSpec& spec, uint32_t job_workers, uint32_t job_rank,
                    uint64_t count) {
  const int64_t at = PositionOf(spec, job_rank);
  if (at < 0) return 0;
  const uint32_t workers = Members(spec, job_workers), rank = static_cast<uint32_t>(at);
  switch (spec.kind) {
    case Collective::kAllgather: return spec.counts[rank];
    case Collective::kAlltoall: return SumCounts(spec.counts, uint64_t{rank} * workers, workers, 1);
    default: return count;
  }
}

uint64_t OutputCount(const CollectiveSpec& spec, uint32_t job_workers, uint32_t job_rank,
                     uint64_t count) {
  const int64_t at = PositionOf(spec, job_rank);
  if (at < 0) return 0;
  const uint32_t workers = Members(spec, job_workers), rank = static_cast<uint32_t>(at);
  switch (spec.kind) {
    case Collective::kReduceScatter: return spec.counts[rank];
    case Collective::kAlltoall: return SumCounts(spec.counts, rank, workers, workers);
    default: return count;
  }
}

Role RoleOf(const CollectiveSpec& spec, const std::vector<Segment>& segments, uint32_t seg,
            uint32_t job_workers, uint32_t job_rank, uint64_t offset) {
  const Segment& s = segments[seg];
  Role r;
  const int64_t at = PositionOf(spec, job_rank);
  if (at < 0) return r;  // not a member: no part in any partition
  const uint32_t workers = Members(spec, job_workers), rank = static_cast<uint32_t>(at);
  const bool source = s.src == kEveryRank || s.src == rank;
  const bool single = s.src != kEveryRank;
  const bool receiver = (s.dst == kEveryRank || s.dst == rank) && !(single && s.src == rank);
  const Peers peers = PeersOf(spec, s, job_workers);
  if (peers.local_only()) return r;  // copied locally (LocalCopies), if at all
  r.push = source;
  r.pull = receiver;
  // Only where each partition has one contributor (all-to-all): with every rank contributing
  // (reduce-scatter), ranks that push in different orders could each hold back, over their
  // lead, what the other's held partitions wait for.
  if (s.src != kEveryRank && s.dst != kEveryRank) r.turn = (s.dst + workers - rank - 1) % workers;
  const uint64_t within = offset - s.offset;
  switch (spec.kind) {
    case Collective::kAllreduce:
    case Collective::kBroadcast:
      r.in_offset = r.out_offset = offset;
      break;
    case Collective::kAllgather:
      r.in_offset = within;  // only rank s.src pushes: its input is its segment
      r.out_offset = offset;
      break;
    case Collective::kReduceScatter:
      r.in_offset = offset;
      r.out_offset = within;  // only rank s.dst receives: its output is its segment
      break;
    case Collective::kAlltoall: {
      // Row i (what i sends) is contiguous in the buffer; i's input is that row. Rank j's
      // output is column j: block (i, j) after blocks (0, j) ... (i - 1, j).
      const uint32_t i = seg / workers, j = seg % workers;
      r.in_offset = s.offset - segments[uint64_t{i} * workers].offset + within;
      r.out_offset = SumCounts(spec.counts, j, i, workers) + within;
      break;
    }
  }
  return r;
}

std::vector<LocalCopy> LocalCopies(const CollectiveSpec& spec, uint32_t job_workers,
                                   uint32_t job_rank, uint64_t count) {
  std::vector<LocalCopy> out;
  const int64_t at = PositionOf(spec, job_rank);
  if (at < 0) return out;
  const uint32_t workers = Members(spec, job_workers), rank = static_cast<uint32_t>(at);
  switch (spec.kind) {
    case Collective::kAllreduce:
      out.push_back({0, 0, count});  // out of place: the output is summed in place
      break;
    case Collective::kBroadcast:
      if (rank == spec.root) out.push_back({0, 0, count});
      break;
    case Collective::kAllgather: {
      const uint64_t at = SumCounts(spec.counts, 0, rank, 1);
      out.push_back({0, at, spec.counts[rank]});
      break;
    }
    case Collective::kReduceScatter: break;
    case Collective::kAlltoall: {
      const uint64_t in = SumCounts(spec.counts, uint64_t{rank} * workers, rank, 1);
      const uint64_t outpos = SumCounts(spec.counts, rank, rank, workers);
      out.push_back({in, outpos, spec.counts[uint64_t{rank} * workers + rank]});
      break;
    }
  }
  std::erase_if(out, [](const LocalCopy& c) { return c.count == 0; });
  return out;
}

}  // namespace layout
}  // namespace gradlink
