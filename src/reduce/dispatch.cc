// The reducers' entry points (reduce.h): which kernel table runs (the best the CPU supports,
// or the one a test forces), and the per-dtype switch into it.
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <type_traits>

#include "reduce/kernels.h"

namespace gradlink::reduce {
namespace {

using internal::Kernels;

const Kernels* KernelsFor(ReduceIsa isa) {
  switch (isa) {
    case ReduceIsa::kScalar: return &internal::kScalarKernels;
    case ReduceIsa::kAvx2: return internal::CpuHasAvx2F16c() ? internal::Avx2Kernels() : nullptr;
    case ReduceIsa::kAvx512: return internal::CpuHasAvx512() ? internal::Avx512Kernels() : nullptr;
    case ReduceIsa::kNeon: return internal::NeonKernels();
    case ReduceIsa::kAuto: break;
  }
  return nullptr;
}

const Kernels* BestKernels() {
  static const Kernels* const best = [] {
    for (ReduceIsa isa : {ReduceIsa::kAvx512, ReduceIsa::kAvx2, ReduceIsa::kNeon}) {
      if (const Kernels* k = KernelsFor(isa)) return k;
    }
    return &internal::kScalarKernels;
  }();
  return best;
}

std::atomic<const Kernels*> g_active{nullptr};

inline const Kernels& Active() {
  const Kernels* k = g_active.load(std::memory_order_relaxed);
  if (k == nullptr) {
    k = BestKernels();
    g_active.store(k, std::memory_order_relaxed);
  }
  return *k;
}

template <typename T>
T* As(void* p) {
  return static_cast<T*>(p);
}
template <typename T>
const T* As(const void* p) {
  return static_cast<const T*>(p);
}


}  // namespace


DataType AccumulatorType(DataType t) {
  switch (t) {
    case DataType::kFloat16:
    case DataType::kBFloat16: return DataType::kFloat32;
    case DataType::kInt32: return DataType::kInt64;
    default: return t;
  }
}

uint64_t ServerBytesHeld(DataType t, uint64_t count, uint32_t workers) {
  const unsigned __int128 wire = DataTypeSize(t);
  const unsigned __int128 acc = DataTypeSize(AccumulatorType(t));
  const unsigned __int128 per_element = workers * wire + 2 * acc + (acc != wire ? 2 * wire : 0);
  const unsigned __int128 total = per_element * count;
  return total > UINT64_MAX ? UINT64_MAX : static_cast<uint64_t>(total);
}

namespace {

// int32 accumulates in int64 (the kernels' sum_i32/acc_i32): a sum of up to 2^32 int32 values
// is exact there, so an average is the exact quotient, and a plain sum, narrowed back to int32
// (mod 2^32), is what wrapping int32 arithmetic gives. Load and narrow run once per round.
void LoadI32(int64_t* __restrict acc, const int32_t* __restrict x, size_t n) {
  for (size_t i = 0; i < n; ++i) acc[i] = x[i];
}
// Narrowing as two's complement (mod 2^32), in place when out == acc (front to back: element
// i of out ends before element i of acc, which is read first).
void NarrowI32(int32_t* out, const int64_t* acc, size_t n) {
  for (size_t i = 0; i < n; ++i) out[i] = static_cast<int32_t>(static_cast<uint32_t>(acc[i]));
}

}  // namespace

void SumTwo(DataType t, void* acc, const void* a, const void* b, size_t n) {
  if (n == 0) return;
  const Kernels& k = Active();
  switch (t) {
    case DataType::kFloat32: k.sum_f32(As<float>(acc), As<float>(a), As<float>(b), n); return;
    case DataType::kFloat64: k.sum_f64(As<double>(acc), As<double>(a), As<double>(b), n); return;
    case DataType::kFloat16: k.sum_f16(As<float>(acc), As<uint16_t>(a), As<uint16_t>(b), n); return;
    case DataType::kBFloat16:
      k.sum_bf16(As<float>(acc), As<uint16_t>(a), As<uint16_t>(b), n);
      return;
    case DataType::kInt32: k.sum_i32(As<int64_t>(acc), As<int32_t>(a), As<int32_t>(b), n); return;
    case DataType::kInt64:
      k.sum_u64(As<uint64_t>(acc), As<uint64_t>(a), As<uint64_t>(b), n);
      return;
  }
  // Not a DataType: callers validate dtypes off the wire (IsValidDataType) before this point.
}

void Accumulate(DataType t, void* acc, const void* x, size_t n) {
  if (n == 0) return;
  const Kernels& k = Active();
  switch (t) {
    case DataType::kFloat32: k.acc_f32(As<float>(acc), As<float>(x), n); return;
    case DataType::kFloat64: k.acc_f64(As<double>(acc), As<double>(x), n); return;
    case DataType::kFloat16: k.acc_f16(As<float>(acc), As<uint16_t>(x), n); return;
    case DataType::kBFloat16: k.acc_bf16(As<float>(acc), As<uint16_t>(x), n); return;
    case DataType::kInt32: k.acc_i32(As<int64_t>(acc), As<int32_t>(x), n); return;
    case DataType::kInt64: k.acc_u64(As<uint64_t>(acc), As<uint64_t>(x), n); return;
  }
}

void Load(DataType t, void* acc, const void* x, size_t n) {
  if (n == 0) return;
  switch (t) {
    case DataType::kFloat16: Active().load_f16(As<float>(acc), As<uint16_t>(x), n); return;
    case DataType::kBFloat16: Active().load_bf16(As<float>(acc), As<uint16_t>(x), n); return;
    case DataType::kInt32: LoadI32(As<int64_t>(acc), As<int32_t>(x), n); return;
    case DataType::kFloat32:
    case DataType::kFloat64:
    case DataType::kInt64:
      if (acc != x) std::memcpy(acc, x, n * DataTypeSize(t));
      return;
  }
}

namespace {

template <typename A>
A FoldOne(ReduceOp op, A a, A x) {
  if constexpr (std::is_floating_point_v<A>) {
    if (op == ReduceOp::kProduct) return a * x;
    if (std::isnan(a)) return a;
    if (std::isnan(x)) return x;
    if (a == x) {  // equal, or -0.0 and +0.0: min takes the negative zero, max the positive
      return (op == ReduceOp::kMin) == std::signbit(x) ? x : a;
    }
    return (op == ReduceOp::kMin) == (x < a) ? x : a;
  } else {
    using U = std::make_unsigned_t<A>;
    if (op == ReduceOp::kProduct) return static_cast<A>(static_cast<U>(a) * static_cast<U>(x));
    return op == ReduceOp::kMin ? std::min(a, x) : std::max(a, x);
  }
}

// acc (type A) op= x (wire type W, converted by `widen`).
template <typename A, typename W, typename Widen>
void FoldLoop(ReduceOp op, void* acc, const void* x, size_t n, Widen widen) {
  A* a = static_cast<A*>(acc);
  const W* w = static_cast<const W*>(x);
  for (size_t i = 0; i < n; ++i) a[i] = FoldOne<A>(op, a[i], widen(w[i]));
}

}  // namespace

void Fold(ReduceOp op, DataType t, void* acc, const void* x, size_t n) {
  if (op == ReduceOp::kSum) {
    Accumulate(t, acc, x, n);
    return;
  }
  auto same = [](auto v) { return v; };
  switch (t) {
    case DataType::kFloat32: FoldLoop<float, float>(op, acc, x, n, same); return;
    case DataType::kFloat64: FoldLoop<double, double>(op, acc, x, n, same); return;
    case DataType::kFloat16:
      FoldLoop<float, uint16_t>(op, acc, x, n, [](uint16_t h) { return internal::HalfToFloatImpl(h); });
      return;
    case DataType::kBFloat16:
      FoldLoop<float, uint16_t>(op, acc, x, n,
                                [](uint16_t h) { return internal::BFloat16ToFloatImpl(h); });
      return;
    case DataType::kInt32:
      FoldLoop<int64_t, int32_t>(op, acc, x, n, [](int32_t v) { return int64_t{v}; });
      return;
    case DataType::kInt64: FoldLoop<int64_t, int64_t>(op, acc, x, n, same); return;
  }
}

namespace {

// Integer average: C++ division truncates toward zero. The divisor is positive and below 2^32,
// so the 64-bit quotient neither overflows nor traps. Integer division does not vectorize on
// x86 (nor on NEON, which has no integer vector division); integer averages are rare enough
// that this stays scalar.
template <typename S>
void DivInt(void* out, const void* acc, size_t n, uint32_t divisor) {
  S* o = static_cast<S*>(out);
  const S* a = static_cast<const S*>(acc);
  const int64_t d = divisor;
  for (size_t i = 0; i < n; ++i) o[i] = static_cast<S>(static_cast<int64_t>(a[i]) / d);
}

}  // namespace

void Store(DataType t, void* out, const void* acc, size_t n, uint32_t divisor) {
  if (n == 0) return;
  if (divisor == 0) divisor = 1;  // no average of zero pushes; treat as a plain sum
  const Kernels& k = Active();
  switch (t) {
    case DataType::kFloat16:
      k.store_f16(As<uint16_t>(out), As<float>(acc), n, static_cast<float>(divisor));
      return;
    case DataType::kBFloat16:
      k.store_bf16(As<uint16_t>(out), As<float>(acc), n, static_cast<float>(divisor));
      return;
    case DataType::kInt32:
      if (divisor == 1) {
        NarrowI32(As<int32_t>(out), As<int64_t>(acc), n);
      } else {
        // The exact int64 sum divided, truncating toward zero: within int32's range.
        int32_t* o = As<int32_t>(out);
        const int64_t* a = As<int64_t>(acc);
        const int64_t d = divisor;
        for (size_t i = 0; i < n; ++i) o[i] = static_cast<int32_t>(a[i] / d);
      }
      return;
    case DataType::kFloat32:
    case DataType::kFloat64:
    case DataType::kInt64:
      break;
  }
  if (divisor == 1) {
    if (out != acc) std::memmove(out, acc, n * DataTypeSize(t));
    return;
  }
  switch (t) {
    case DataType::kFloat32:
      k.div_f32(As<float>(out), As<float>(acc), n, static_cast<float>(divisor));
      return;
    case DataType::kFloat64:
      k.div_f64(As<double>(out), As<double>(acc), n, static_cast<double>(divisor));
      return;
    case DataType::kInt32: return;  // above
    case DataType::kInt64: DivInt<int64_t>(out, acc, n, divisor); return;
    case DataType::kFloat16:
    case DataType::kBFloat16:
      return;
  }
}

float HalfToFloat(uint16_t h) { return internal::HalfToFloatImpl(h); }
uint16_t FloatToHalf(float f) { return internal::FloatToHalfImpl(f); }
float BFloat16ToFloat(uint16_t b) { return internal::BFloat16ToFloatImpl(b); }
uint16_t FloatToBFloat16(float f) { return internal::FloatToBFloat16Impl(f); }

bool SetReduceIsaForTesting(ReduceIsa isa) {
  const Kernels* k = isa == ReduceIsa::kAuto ? BestKernels() : KernelsFor(isa);
  if (k == nullptr) return false;
  g_active.store(k, std::memory_order_relaxed);
  return true;
}

ReduceIsa ActiveReduceIsa() { return Active().isa; }


}  // namespace gradlink::reduce

namespace gradlink {

float HalfToFloat(uint16_t h) { return reduce::HalfToFloat(h); }
uint16_t FloatToHalf(float f) { return reduce::FloatToHalf(f); }
float BFloat16ToFloat(uint16_t b) { return reduce::BFloat16ToFloat(b); }
uint16_t FloatToBFloat16(float f) { return reduce::FloatToBFloat16(f); }

}  // namespace gradlink
