// python/c10d/process_group.h: all_reduce of a sparse COO tensor, as Gloo sums one (SUM only):
// every rank's shape and nnz gathered first, then its coalesced indices and values, summed in
// rank order and coalesced, written into the tensor.
#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <bit>
#include <cstring>
#include <limits>
#include <numeric>
#include <span>
#include <utility>

#include "flat.h"
#include "process_group.h"
#include "tensors.h"
#include "work.h"

namespace gradlink::c10d {

using ::c10d::OpType;

namespace {

// What each rank tells the others first: its nnz, then what must agree (dtype, sparse dims,
// dims, the sizes). One length for every shape, so that one key serves them all.
constexpr size_t kMaxDims = 8;
constexpr size_t kNnz = 0, kDtype = 1, kSparseDims = 2, kDims = 3, kSizes = 4;
constexpr size_t kRecord = kSizes + kMaxDims;

std::string Describe(const uint64_t* record) {
  std::string s = c10::toString(static_cast<at::ScalarType>(record[kDtype]));
  s += " [";
  for (uint64_t d = 0; d < record[kDims] && d < kMaxDims; ++d) {
    s += (d ? ", " : "") + std::to_string(record[kSizes + d]);
  }
  return s + "] of " + std::to_string(record[kSparseDims]) + " sparse dims";
}

const char* OpName(const ::c10d::ReduceOp& op) {
  switch (static_cast<::c10d::ReduceOp::RedOpType>(op)) {
    case ::c10d::ReduceOp::SUM: return "SUM";
    case ::c10d::ReduceOp::AVG: return "AVG";
    case ::c10d::ReduceOp::PRODUCT: return "PRODUCT";
    case ::c10d::ReduceOp::MIN: return "MIN";
    case ::c10d::ReduceOp::MAX: return "MAX";
    case ::c10d::ReduceOp::BAND: return "BAND";
    case ::c10d::ReduceOp::BOR: return "BOR";
    case ::c10d::ReduceOp::BXOR: return "BXOR";
    case ::c10d::ReduceOp::PREMUL_SUM: return "PREMUL_SUM";
    default: return "an unknown op";
  }
}

}  // namespace

c10::intrusive_ptr<::c10d::Work> ProcessGroupGradlink::SparseAllreduce(
    std::vector<at::Tensor>& tensors, const ::c10d::AllreduceOptions& opts) {
  at::Tensor& t = tensors[0];
  if (!t.device().is_cpu()) {
    Fail("allreduce: a sparse tensor on " + t.device().str() +
         "; this build of the gradlink backend takes CPU tensors");
  }
  if (opts.reduceOp != ::c10d::ReduceOp::SUM) {
    Fail(std::string("allreduce: a sparse tensor is reduced with ReduceOp.SUM only (as by "
                     "Gloo), not ReduceOp.") + OpName(opts.reduceOp));
  }
  if (t.dim() > static_cast<int64_t>(kMaxDims)) {
    Fail("allreduce: a sparse tensor of at most " + std::to_string(kMaxDims) + " dimensions (" +
         std::to_string(t.dim()) + ")");
  }
  const at::Tensor mine = t.coalesce();  // (itself where it already is)
  const int64_t sparse_dims = mine.sparse_dim();
  std::vector<uint64_t> record(kRecord, 0);
  record[kNnz] = static_cast<uint64_t>(mine._nnz());
  record[kDtype] = static_cast<uint64_t>(mine.scalar_type());
  record[kSparseDims] = static_cast<uint64_t>(sparse_dims);
  record[kDims] = static_cast<uint64_t>(mine.dim());
  for (int64_t d = 0; d < mine.dim(); ++d) {
    record[kSizes + d] = static_cast<uint64_t>(mine.size(d));
  }

  const Clock::time_point deadline = Deadline(opts.timeout);
  const std::vector<uint64_t> all =
      GatherCounts(record, "sparse.shape", "allreduce: exchanging the sparse tensors' shapes",
                   deadline);
  const size_t n = static_cast<size_t>(getSize());
  uint64_t entries = 1;  // of the sparse dims (at most; saturated): a bound on every nnz
  for (int64_t d = 0; d < sparse_dims; ++d) {
    if (__builtin_mul_overflow(entries, record[kSizes + d], &entries)) entries = UINT64_MAX;
  }
  std::vector<int64_t> nnz(n);
  uint64_t most = 0;
  for (size_t r = 0; r < n; ++r) {
    const uint64_t* theirs = all.data() + r * kRecord;
    if (!std::equal(theirs + kDtype, theirs + kRecord, record.data() + kDtype)) {
      Fail("allreduce: rank " + std::to_string(r) + "'s sparse tensor is " + Describe(theirs) +
           ", rank " + std::to_string(getRank()) + "'s " + Describe(record.data()));
    }
    // Checked before anything is allocated for it.
    if (theirs[kNnz] > entries || theirs[kNnz] > (uint64_t{1} << 62)) {
      Fail("allreduce: rank " + std::to_string(r) + " sends " + std::to_string(theirs[kNnz]) +
           " entries of a sparse tensor " + Describe(theirs));
    }
    nnz[r] = static_cast<int64_t>(theirs[kNnz]);
    most = std::max(most, theirs[kNnz]);
  }

  // Every rank's part padded to `capacity` entries: indices [sparse dims, capacity], values
  // [capacity, dense sizes...].
  const int64_t capacity = most == 0 ? 0 : static_cast<int64_t>(std::bit_ceil(most));
  std::vector<int64_t> value_shape = {capacity};
  for (int64_t d = sparse_dims; d < mine.dim(); ++d) value_shape.push_back(mine.size(d));
  at::Tensor indices = at::zeros({sparse_dims, capacity}, at::kLong);
  at::Tensor values = at::zeros(value_shape, mine._values().options());
  indices.narrow(1, 0, mine._nnz()).copy_(mine._indices());
  values.narrow(0, 0, mine._nnz()).copy_(mine._values());
  at::Tensor all_indices = at::empty({indices.numel() * static_cast<int64_t>(n)}, at::kLong);
  at::Tensor all_values = at::empty({values.numel() * static_cast<int64_t>(n)}, values.options());
  std::vector<Flat> flats;
  flats.push_back(Flat::Allgather(*this, all_indices, indices, "allreduce (sparse)"));
  flats.push_back(Flat::Allgather(*this, all_values, values, "allreduce (sparse)"));

  // Gloo's sum, computed as Gloo computes it (bit for bit the same): each rank's tensor added
  // in rank order (each is coalesced, so the adds merge them), then coalesced. Dtypes without
  // a sparse add in this torch (1.13: float16, bfloat16, bool) fail here, on every rank.
  const std::vector<int64_t> sizes = mine.sizes().vec();
  auto sum = [t, sizes, nnz, sparse_dims, capacity, value_shape, all_indices, all_values] {
    const int64_t row = c10::multiply_integers(value_shape.begin() + 1, value_shape.end());
    at::Tensor total;
    try {
      for (size_t r = 0; r < nnz.size(); ++r) {
        const int64_t first = static_cast<int64_t>(r) * capacity;  // its first entry
        at::Tensor i = all_indices.narrow(0, first * sparse_dims, capacity * sparse_dims)
                           .view({sparse_dims, capacity})
                           .narrow(1, 0, nnz[r])
                           .contiguous();
        at::Tensor v = all_values.narrow(0, first * row, capacity * row)
                           .view(value_shape)
                           .narrow(0, 0, nnz[r]);
        // Another rank's indices: in bounds before anything indexes with them.
        at::_validate_sparse_coo_tensor_args(i, v, sizes);
        at::Tensor part = at::sparse_coo_tensor(i, v, sizes, t.options());
        if (r == 0) {
          total = part;
        } else {
          total += part;
        }
      }
      total = total.coalesce();
    } catch (const c10::Error& e) {
      Fail(std::string("allreduce: summing every rank's sparse tensor: ") +
           e.what_without_backtrace());
    }
    t.copy_(total);
  };
  return Coalesced(OpType::ALLREDUCE, tensors, flats, "allreduce (sparse)", "sparse.",
                   opts.timeout, sum);
}

}  // namespace gradlink::c10d
