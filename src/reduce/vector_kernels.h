// The vector kernel bodies, instantiated once per ISA by x86.cc and neon.cc (a template cannot
// carry a per-instantiation target attribute, hence macros over an ISA's op set).
#pragma once

#include "reduce/kernels.h"

namespace gradlink::reduce::internal {

#if defined(__x86_64__) || defined(__aarch64__)

// How many leading elements of p (at most n) to process before p + i is kAlign-aligned, so
// that the vector loop's accesses to p (the written buffer, or the fp32 accumulator) do not
// straddle cache lines.
template <size_t kAlign, typename T>
inline size_t HeadToAlign(const T* p, size_t n) {
  const size_t mis = reinterpret_cast<uintptr_t>(p) & (kAlign - 1);
  if (mis == 0 || mis % sizeof(T) != 0) return 0;
  const size_t head = (kAlign - mis) / sizeof(T);
  return head < n ? head : n;
}

#endif  // __x86_64__ || __aarch64__

#if defined(__x86_64__) || defined(__aarch64__)

// The kernel bodies, instantiated once per ISA (a template cannot carry a per-instantiation
// target attribute). Each kernel runs the scalar kernel on a head that brings the written
// buffer (or, for Store16, the accumulator it reads) to vector alignment, then whole vectors,
// then the scalar kernel on the tail. Each vector iteration loads everything it reads before
// it stores, which is what makes the in-place Div/Store16 kernels safe. The 16-bit kernels do
// two vectors per iteration to keep more loads in flight around the conversions.
#define GL_DEFINE_VECTOR_KERNELS(V, TARGET)                                                        \
  TARGET void SumF32(float* acc, const float* a, const float* b, size_t n) {                       \
    size_t i = HeadToAlign<V::kBytes>(acc, n);                                                     \
    scalar::Sum(acc, a, b, i);                                                                     \
    for (; i + V::kF32 <= n; i += V::kF32)                                                         \
      V::StoreF32(acc + i, V::AddF32(V::LoadF32(a + i), V::LoadF32(b + i)));                       \
    scalar::Sum(acc + i, a + i, b + i, n - i);                                                     \
  }                                                                                                \
  TARGET void AccF32(float* acc, const float* x, size_t n) {                                       \
    size_t i = HeadToAlign<V::kBytes>(acc, n);                                                     \
    scalar::Acc(acc, x, i);                                                                        \
    for (; i + V::kF32 <= n; i += V::kF32)                                                         \
      V::StoreF32(acc + i, V::AddF32(V::LoadF32(acc + i), V::LoadF32(x + i)));                     \
    scalar::Acc(acc + i, x + i, n - i);                                                            \
  }                                                                                                \
  TARGET void DivF32(float* out, const float* acc, size_t n, float d) {                            \
    const V::F32 vd = V::SetF32(d);                                                                \
    size_t i = HeadToAlign<V::kBytes>(out, n);                                                     \
    scalar::Div(out, acc, i, d);                                                                   \
    for (; i + V::kF32 <= n; i += V::kF32)                                                         \
      V::StoreF32(out + i, V::DivF32(V::LoadF32(acc + i), vd));                                    \
    scalar::Div(out + i, acc + i, n - i, d);                                                       \
  }                                                                                                \
  TARGET void SumF64(double* acc, const double* a, const double* b, size_t n) {                    \
    size_t i = HeadToAlign<V::kBytes>(acc, n);                                                     \
    scalar::Sum(acc, a, b, i);                                                                     \
    for (; i + V::kF64 <= n; i += V::kF64)                                                         \
      V::StoreF64(acc + i, V::AddF64(V::LoadF64(a + i), V::LoadF64(b + i)));                       \
    scalar::Sum(acc + i, a + i, b + i, n - i);                                                     \
  }                                                                                                \
  TARGET void AccF64(double* acc, const double* x, size_t n) {                                     \
    size_t i = HeadToAlign<V::kBytes>(acc, n);                                                     \
    scalar::Acc(acc, x, i);                                                                        \
    for (; i + V::kF64 <= n; i += V::kF64)                                                         \
      V::StoreF64(acc + i, V::AddF64(V::LoadF64(acc + i), V::LoadF64(x + i)));                     \
    scalar::Acc(acc + i, x + i, n - i);                                                            \
  }                                                                                                \
  TARGET void DivF64(double* out, const double* acc, size_t n, double d) {                         \
    const V::F64 vd = V::SetF64(d);                                                                \
    size_t i = HeadToAlign<V::kBytes>(out, n);                                                     \
    scalar::Div(out, acc, i, d);                                                                   \
    for (; i + V::kF64 <= n; i += V::kF64)                                                         \
      V::StoreF64(out + i, V::DivF64(V::LoadF64(acc + i), vd));                                    \
    scalar::Div(out + i, acc + i, n - i, d);                                                       \
  }                                                                                                \
  TARGET void SumU64(uint64_t* acc, const uint64_t* a, const uint64_t* b, size_t n) {              \
    size_t i = HeadToAlign<V::kBytes>(acc, n);                                                     \
    scalar::SumU(acc, a, b, i);                                                                    \
    for (; i + V::kI64 <= n; i += V::kI64)                                                         \
      V::StoreI(acc + i, V::AddI64(V::LoadI(a + i), V::LoadI(b + i)));                             \
    scalar::SumU(acc + i, a + i, b + i, n - i);                                                    \
  }                                                                                                \
  TARGET void AccU64(uint64_t* acc, const uint64_t* x, size_t n) {                                 \
    size_t i = HeadToAlign<V::kBytes>(acc, n);                                                     \
    scalar::AccU(acc, x, i);                                                                       \
    for (; i + V::kI64 <= n; i += V::kI64)                                                         \
      V::StoreI(acc + i, V::AddI64(V::LoadI(acc + i), V::LoadI(x + i)));                           \
    scalar::AccU(acc + i, x + i, n - i);                                                           \
  }                                                                                                \
  GL_DEFINE_VECTOR_16BIT_KERNELS(V, TARGET, F16, HalfToFloatImpl, FloatToHalfImpl)                 \
  GL_DEFINE_VECTOR_16BIT_KERNELS(V, TARGET, BF16, BFloat16ToFloatImpl, FloatToBFloat16Impl)

#define GL_DEFINE_VECTOR_16BIT_KERNELS(V, TARGET, T, TO_FLOAT, FROM_FLOAT)                         \
  TARGET void Sum##T(float* acc, const uint16_t* a, const uint16_t* b, size_t n) {                 \
    constexpr size_t w = V::kF32;                                                                  \
    size_t i = HeadToAlign<V::kBytes>(acc, n);                                                     \
    scalar::Sum16<TO_FLOAT>(acc, a, b, i);                                                         \
    for (; i + 2 * w <= n; i += 2 * w) {                                                           \
      const V::F32 s0 = V::AddF32(V::Load##T(a + i), V::Load##T(b + i));                           \
      const V::F32 s1 = V::AddF32(V::Load##T(a + i + w), V::Load##T(b + i + w));                   \
      V::StoreF32(acc + i, s0);                                                                    \
      V::StoreF32(acc + i + w, s1);                                                                \
    }                                                                                              \
    for (; i + w <= n; i += w)                                                                     \
      V::StoreF32(acc + i, V::AddF32(V::Load##T(a + i), V::Load##T(b + i)));                       \
    scalar::Sum16<TO_FLOAT>(acc + i, a + i, b + i, n - i);                                         \
  }                                                                                                \
  TARGET void Acc##T(float* acc, const uint16_t* x, size_t n) {                                    \
    constexpr size_t w = V::kF32;                                                                  \
    size_t i = HeadToAlign<V::kBytes>(acc, n);                                                     \
    scalar::Acc16<TO_FLOAT>(acc, x, i);                                                            \
    for (; i + 2 * w <= n; i += 2 * w) {                                                           \
      const V::F32 s0 = V::AddF32(V::LoadF32(acc + i), V::Load##T(x + i));                         \
      const V::F32 s1 = V::AddF32(V::LoadF32(acc + i + w), V::Load##T(x + i + w));                 \
      V::StoreF32(acc + i, s0);                                                                    \
      V::StoreF32(acc + i + w, s1);                                                                \
    }                                                                                              \
    for (; i + w <= n; i += w)                                                                     \
      V::StoreF32(acc + i, V::AddF32(V::LoadF32(acc + i), V::Load##T(x + i)));                     \
    scalar::Acc16<TO_FLOAT>(acc + i, x + i, n - i);                                                \
  }                                                                                                \
  TARGET void Load##T(float* acc, const uint16_t* x, size_t n) {                                   \
    constexpr size_t w = V::kF32;                                                                  \
    size_t i = HeadToAlign<V::kBytes>(acc, n);                                                     \
    scalar::Load16<TO_FLOAT>(acc, x, i);                                                           \
    for (; i + w <= n; i += w) V::StoreF32(acc + i, V::Load##T(x + i));                            \
    scalar::Load16<TO_FLOAT>(acc + i, x + i, n - i);                                               \
  }                                                                                                \
  TARGET void Store##T(uint16_t* out, const float* acc, size_t n, float d) {                       \
    constexpr size_t w = V::kF32;                                                                  \
    size_t i = HeadToAlign<V::kBytes>(acc, n);                                                     \
    scalar::Store16<FROM_FLOAT>(out, acc, i, d);                                                   \
    if (d == 1.0f) {                                                                               \
      for (; i + w <= n; i += w) V::Store##T(out + i, V::LoadF32(acc + i));                        \
    } else {                                                                                       \
      const V::F32 vd = V::SetF32(d);                                                              \
      for (; i + w <= n; i += w) V::Store##T(out + i, V::DivF32(V::LoadF32(acc + i), vd));         \
    }                                                                                              \
    scalar::Store16<FROM_FLOAT>(out + i, acc + i, n - i, d);                                       \
  }

// int32 (widened into int64) runs the portable loops on every ISA: GCC vectorizes them at -O2,
// and copies compiled for AVX2/AVX-512 measured no faster (reduce_bench BM_Int32Accumulate).
#define GL_KERNEL_TABLE(ISA)                                                                    \
  constexpr Kernels kKernels = {ISA,      SumF32,           AccF32,           DivF32,  SumF64,  \
                                AccF64,   DivF64,           scalar::SumWiden, scalar::AccWiden, \
                                SumU64,   AccU64,           SumF16,           AccF16,  LoadF16, \
                                StoreF16, SumBF16,          AccBF16,          LoadBF16, StoreBF16};

#endif  // __x86_64__ || __aarch64__

}  // namespace gradlink::reduce::internal
