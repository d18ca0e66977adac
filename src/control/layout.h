// How a key's buffer is shared among the workers (gradlink/collective.h): its segments, who
// pushes and who receives each partition, and where a worker's partition lies in its own input
// and output. One pure rule from (spec, workers, count), so that the scheduler (which cuts
// partitions at segment boundaries and admits their server memory), every server (which waits
// for each participant's push and answers each) and every worker (which pushes and pulls its
// share) agree without a message.
//
// Partitions never straddle a segment: the scheduler cuts each segment on its own. A partition's
// contributors push its elements; its receivers get the result; a single contributor never
// receives its own elements back. Participants are the contributors (in rank order, the order a
// server combines them) followed by the receivers that push nothing (a request: a push of 0
// elements). A partition without receivers (a rank's own allgather segment in a one-worker job,
// the diagonal of an all-to-all) is copied by its worker and never reaches a server.
#pragma once

#include <cstdint>
#include <vector>

#include "gradlink/collective.h"
#include "gradlink/status.h"
#include "wire/messages.h"

namespace gradlink::layout {

// Counts kept in a spec at most: n * n of an all-to-all must fit one control frame.
inline constexpr uint64_t kMaxCounts = 65536;

// A spec's group, when it has one, is its set of ranks; "positions" below index it (counts,
// roots, a segment's source and destination), and every rank a function takes or returns is
// a worker's rank in the job. `workers` is always the job's.

// The number of workers taking part: the group's, or the job's.
uint32_t Members(const CollectiveSpec& spec, uint32_t workers);
// `rank`'s position in the group (the rank itself without one); -1 when it takes no part.
int64_t PositionOf(const CollectiveSpec& spec, uint32_t rank);
// The group lists ranks of the job in ascending order, once each (or is empty).
bool GroupIsValid(const CollectiveSpec& spec, uint32_t workers);
// The rank at `position`.
uint32_t RankAt(const CollectiveSpec& spec, uint32_t position);

// InvalidArgument naming what is wrong: a group that is not ascending ranks of the job, counts
// that do not match the kind and the members (size, or a sum other than `count`), a root out
// of range, an op the kind does not reduce with.
Status Check(const CollectiveSpec& spec, uint32_t workers, uint64_t count);

// A plan received from the scheduler (kAssign): its spec passes Check() and no partition
// straddles two segments. kProtocolError naming what is wrong otherwise.
Status CheckPlan(const CollectiveSpec& spec, uint32_t workers, uint64_t count,
                 const std::vector<wire::PartitionPlan>& partitions);

inline constexpr uint32_t kEveryRank = UINT32_MAX;

struct Segment {
  uint64_t offset = 0;  // first element in the key's buffer
  uint64_t count = 0;
  uint32_t src = kEveryRank;  // the one position that pushes it, or every member
  uint32_t dst = kEveryRank;  // the one position that receives it, or every member (but src)
};

// The segments of a checked spec, in buffer order (some may be empty).
std::vector<Segment> Segments(const CollectiveSpec& spec, uint32_t workers, uint64_t count);

// The index of the segment holding element `offset` (a partition's first).
uint32_t SegmentAt(const std::vector<Segment>& segments, uint64_t offset);

struct Peers {
  std::vector<uint32_t> contributors;  // rank order
  std::vector<uint32_t> requesters;    // receivers that contribute nothing, rank order
  // The receivers among contributors + requesters (in that order).
  std::vector<bool> receives;
  bool local_only() const;  // nobody receives: no server sees the partition
};
Peers PeersOf(const CollectiveSpec& spec, const Segment& s, uint32_t workers);

// What one worker does with a partition: push its elements from input[in_offset...] and/or
// receive the result into output[out_offset...] (element offsets).
struct Role {
  bool push = false;
  bool pull = false;
  uint64_t in_offset = 0;
  uint64_t out_offset = 0;
  // When this worker pushes it, relative to its other partitions (lower first): an all-to-all
  // block goes in turn (receiver - rank - 1) mod n, so that the workers start with different
  // receivers instead of all sending to rank 0 first.
  uint32_t turn = 0;
  bool participates() const { return push || pull; }
};

// Elements of `rank`'s input and output buffers.
uint64_t InputCount(const CollectiveSpec& spec, uint32_t workers, uint32_t rank, uint64_t count);
uint64_t OutputCount(const CollectiveSpec& spec, uint32_t workers, uint32_t rank, uint64_t count);

// `rank`'s role in the partition [offset, offset + n) of segment `seg`.
Role RoleOf(const CollectiveSpec& spec, const std::vector<Segment>& segments, uint32_t seg,
            uint32_t workers, uint32_t rank, uint64_t offset);

// What `rank` copies from its input to its output itself (its own allgather segment, its
// all-to-all diagonal, a broadcast root's tensor when input and output differ, an allreduce
// out of place before it runs in place on the output): element ranges.
struct LocalCopy {
  uint64_t in_offset = 0, out_offset = 0, count = 0;
};
std::vector<LocalCopy> LocalCopies(const CollectiveSpec& spec, uint32_t workers, uint32_t rank,
                                   uint64_t count);

}  // namespace gradlink::layout
