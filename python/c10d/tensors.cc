// python/c10d/tensors.h: torch tensors as gradlink moves them.
#include "tensors.h"

#include <c10/util/Exception.h>

#include <stdexcept>

namespace gradlink::c10d {

// Reaches Python as RuntimeError with this message.
[[noreturn]] void Fail(const std::string& message) {
  throw std::runtime_error("gradlink: " + message);
}

// The gradlink element type of a torch dtype, if it has one.
std::optional<DataType> Native(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return DataType::kFloat32;
    case at::kDouble: return DataType::kFloat64;
    case at::kHalf: return DataType::kFloat16;
    case at::kBFloat16: return DataType::kBFloat16;
    case at::kInt: return DataType::kInt32;
    case at::kLong: return DataType::kInt64;
    default: return std::nullopt;
  }
}

void CheckTensor(const at::Tensor& t, const std::string& what) {
  if (!t.defined()) Fail(what + ": an undefined tensor");
  if (t.layout() != at::kStrided) Fail(what + ": only dense (strided) tensors, not " +
                                       c10::str(t.layout()));
  if (!t.device().is_cpu()) {
    Fail(what + ": a tensor on " + t.device().str() +
         "; this build of the gradlink backend takes CPU tensors");
  }
}

// (`what` is a C string: a reference to the result of a call that takes a temporary
// std::string trips GCC 14's -Wdangling-reference, an error under -Werror.)
const at::Tensor& One(std::vector<at::Tensor>& tensors, const char* what) {
  if (tensors.size() != 1) {
    Fail(std::string(what) + ": one tensor per process (got " + std::to_string(tensors.size()) + ")");
  }
  CheckTensor(tensors[0], what);
  return tensors[0];
}


// For a reduction: the values themselves. Integers and bools without a gradlink dtype are
// widened to int32 (their sums then wrap on the way back, as in their own width; bools reduce
// as logical or/and).
Buffer ReduceBuffer(const at::Tensor& t, const std::string& what) {
  Buffer b;
  if (std::optional<DataType> d = Native(t.scalar_type())) {
    b.dtype = *d;
    if (t.is_contiguous()) {
      b.flat = t.view(-1);
    } else {
      b.flat = t.contiguous().view(-1);
      b.back = t;
    }
    return b;
  }
  switch (t.scalar_type()) {
    case at::kByte: case at::kChar: case at::kShort: case at::kBool:
      b.dtype = DataType::kInt32;
      b.flat = t.to(at::kInt).contiguous().view(-1);
      b.back = t;
      return b;
    default:
      Fail(what + ": no reduction of " + std::string(c10::toString(t.scalar_type())) + " tensors");
  }
}

// For routing (broadcast, gathers, scatter, all-to-all): the bytes, moved bit for bit. Any
// dtype: its own where gradlink has it, else the bytes as 8-, 4- or 2-byte elements (1-byte
// ones widened to 2).
Buffer RouteBuffer(const at::Tensor& t) {
  Buffer b;
  b.bitwise = true;
  at::Tensor c = t.is_contiguous() ? t.view(-1) : t.contiguous().view(-1);
  if (!t.is_contiguous()) b.back = t;
  if (std::optional<DataType> d = Native(t.scalar_type())) {
    b.dtype = *d;
    b.flat = c;
    return b;
  }
  const int64_t e = t.element_size();
  if (e % 8 == 0) {
    b.dtype = DataType::kInt64, b.flat = c.view(at::kLong);
  } else if (e % 4 == 0) {
    b.dtype = DataType::kInt32, b.flat = c.view(at::kInt);
  } else if (e % 2 == 0) {
    b.dtype = DataType::kFloat16, b.flat = c.view(at::kHalf);
  } else {
    b.dtype = DataType::kFloat16, b.flat = c.view(at::kByte).to(at::kShort).view(at::kHalf);
    b.widened = true;
    b.back = t;
  }
  return b;
}

// Elements per unit of a routing buffer: 1-byte dtypes widened keep their count; others
// scale by element size over the carrier's.
uint64_t RouteScale(const at::Tensor& t) {
  if (Native(t.scalar_type())) return 1;
  const int64_t e = t.element_size();
  if (e % 8 == 0) return e / 8;
  if (e % 4 == 0) return e / 4;
  if (e % 2 == 0) return e / 2;
  return 1;
}


OpOf Reduction(const ::c10d::ReduceOp& op, const std::string& what) {
  const ::c10d::ReduceOp::RedOpType t = op;
  switch (t) {
    case ::c10d::ReduceOp::SUM: return {ReduceOp::kSum, false, "sum"};
    case ::c10d::ReduceOp::AVG: return {ReduceOp::kSum, true, "avg"};
    case ::c10d::ReduceOp::MIN: return {ReduceOp::kMin, false, "min"};
    case ::c10d::ReduceOp::MAX: return {ReduceOp::kMax, false, "max"};
    case ::c10d::ReduceOp::PRODUCT: return {ReduceOp::kProduct, false, "product"};
    case ::c10d::ReduceOp::BAND: Fail(what + ": ReduceOp.BAND is not supported (SUM, AVG, MIN, MAX, PRODUCT are)");
    case ::c10d::ReduceOp::BOR: Fail(what + ": ReduceOp.BOR is not supported (SUM, AVG, MIN, MAX, PRODUCT are)");
    case ::c10d::ReduceOp::BXOR: Fail(what + ": ReduceOp.BXOR is not supported (SUM, AVG, MIN, MAX, PRODUCT are)");
    default: Fail(what + ": ReduceOp " + std::to_string(static_cast<int>(t)) + " is not supported (SUM, AVG, MIN, MAX, PRODUCT are)");
  }
}

std::string Join(const std::vector<uint64_t>& v) {
  std::string s;
  for (uint64_t x : v) s += (s.empty() ? "" : ",") + std::to_string(x);
  // Long count lists (many ranks) go by a hash: the name stays short, and equal lists agree.
  if (s.size() > 96) {
    uint64_t h = 1469598103934665603ull;  // FNV-1a
    for (char c : s) h = (h ^ static_cast<unsigned char>(c)) * 1099511628211ull;
    s = std::to_string(v.size()) + "x" + std::to_string(h);
  }
  return s;
}

std::span<std::byte> Bytes(const at::Tensor& t, DataType d) {
  return {static_cast<std::byte*>(t.data_ptr()), static_cast<size_t>(t.numel()) * DataTypeSize(d)};
}

}  // namespace gradlink::c10d
