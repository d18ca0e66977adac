// The collectives the servers run besides the sum: what a key is for, declared once with it.
//
// Every key is a buffer of `count` elements (its declaration's count) laid out in segments; each
// segment has a source (the ranks that push it) and a destination (the ranks that receive it),
// and the servers combine and route each partition accordingly, with one push and one reply per
// participating worker:
//
//   kind            segments of the key's buffer        pushed by      received by
//   kAllreduce      one: the tensor                     every rank     every rank (op applied)
//   kBroadcast      one: the tensor                     root           every other rank
//   kAllgather      counts[r] elements for rank r       rank r         every other rank
//   kReduceScatter  counts[r] elements for rank r       every rank     rank r (op applied)
//   kAlltoall       counts[i*n+j] elements, i to j      rank i         rank j (i != j)
//
// A rank's own part (its allgather segment, the diagonal of an all-to-all) is copied locally, not
// sent. Bytes on the wire are therefore each operation's bound: a broadcast moves each byte once
// to each receiver (never n times, as a sum in which the others push zeros would).
//
// Reductions (kAllreduce, kReduceScatter) combine in rank order, 16-bit floats in fp32 and int32
// in int64, rounded once at the end, so results are bit-identical whatever order pushes arrive
// in. kMin/kMax propagate NaN (the lowest rank's NaN), and order the zeros -0.0 < +0.0
// (IEEE 754-2019 minimum/maximum): min(-0.0, +0.0) is -0.0, max is +0.0. kProduct of integers
// wraps (two's complement), as torch's does. Only kSum may average.
//
// Every worker (of the group, where the spec has one) must declare a key with the same spec: one
// that differs is a kMismatch naming the ranks, for every worker, like a shape that differs.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "gradlink/export.h"

namespace gradlink {

enum class Collective : uint8_t {
  kAllreduce = 0,
  kBroadcast = 1,
  kAllgather = 2,
  kReduceScatter = 3,
  kAlltoall = 4,
};

enum class ReduceOp : uint8_t { kSum = 0, kMin = 1, kMax = 2, kProduct = 3 };

// "allreduce", "broadcast", ...; "sum", "min", "max", "product".
GRADLINK_EXPORT std::string_view CollectiveName(Collective c);
GRADLINK_EXPORT std::string_view ReduceOpName(ReduceOp op);

struct CollectiveSpec {
  Collective kind = Collective::kAllreduce;
  ReduceOp op = ReduceOp::kSum;  // kAllreduce, kReduceScatter; kSum for the others
  uint32_t root = 0;             // kBroadcast: the rank whose tensor everyone receives
  // kAllgather / kReduceScatter: one count per rank (their sum is the key's count);
  // kAlltoall: n * n counts, row-major (counts[i * n + j]: what rank i sends rank j). Empty
  // for kAllreduce and kBroadcast.
  std::vector<uint64_t> counts = {};
  // The ranks that take part (Horovod's process sets, torch.distributed's new_group), in
  // ascending order; empty: every worker. Counts, the root and an average's divisor are then
  // the group's: counts[i] and root are positions in `group`, not ranks. Only the group's
  // workers declare the key (the scheduler plans it once they all have).
  std::vector<uint32_t> group = {};

  bool operator==(const CollectiveSpec&) const = default;
  // The plain sum over every worker: what Declare() without a spec means.
  bool is_sum() const {
    return kind == Collective::kAllreduce && op == ReduceOp::kSum && group.empty();
  }
};

// "allgather of [3, 5]", "broadcast from rank 2", "allreduce (max)": for error messages.
GRADLINK_EXPORT std::string DescribeSpec(const CollectiveSpec& s);

}  // namespace gradlink
