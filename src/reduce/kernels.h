// The reducers' internals, shared by the per-ISA kernel files (scalar.cc, x86.cc, neon.cc) and
// dispatch.cc: the scalar conversions, the kernel table type, and the portable scalar kernels
// (which are also the heads and tails of the vector kernels).
//
// Element-wise reducers. Every operation has a portable scalar implementation (namespace scalar)
// and, on x86-64, hand-vectorized AVX2+F16C and AVX-512F variants compiled with
// __attribute__((target)) and chosen at run time; on AArch64 a NEON variant (Advanced SIMD is
// mandatory there, so it is chosen at compile time). The vector variants compute exactly what
// the scalar ones do, element by element, so results are bit-identical whichever one runs:
//   - sums are a single IEEE add per element (no FMA: nothing here multiplies, so nothing can be
//     contracted whatever -ffp-contract says), averages a true IEEE division;
//   - fp16 <-> fp32 in the vector paths is VCVTPH2PS / VCVTPS2PH (NEON: FCVTL / FCVTN) with
//     round-to-nearest-even, and the scalar conversions below reproduce those instructions bit
//     for bit (including NaN payloads: a NaN comes out quiet with the payload's high bits kept);
//   - bf16 uses the same integer rounding formula in both paths.
// The one exception: when both operands of a sum are NaN, which NaN's payload the result carries
// depends on the operand order the compiler emitted (IEEE 754 leaves it open; compilers treat
// float + as commutative), so it can differ between paths. Whether a result is NaN, and every
// non-NaN result, never differ.
//
// No alignment is assumed for any pointer (the vector kernels peel a scalar head so that their
// stores are aligned). Store runs in place (out == acc) for every dtype, including fp16/bf16,
// whose results are packed into the front of the fp32 buffer.
#pragma once

#include <bit>
#include <cstddef>
#include <cstdint>
#include <cstring>

#include "reduce/reduce.h"

namespace gradlink::reduce::internal {

// ------------------------------------------------------------------------------------------
// Scalar conversions.

inline float HalfToFloatImpl(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu;
  uint32_t mant = h & 0x3ffu;
  uint32_t bits;
  if (exp == 0x1f) {
    // Inf, or NaN: payload kept, made quiet (as VCVTPH2PS does).
    bits = sign | 0x7f800000u | (mant << 13) | (mant != 0 ? 0x00400000u : 0u);
  } else if (exp != 0) {
    bits = sign | ((exp + 112) << 23) | (mant << 13);
  } else if (mant == 0) {
    bits = sign;  // +-0
  } else {
    // Subnormal half: mant * 2^-24; normalize so the leading one moves to bit 10.
    const int shift = std::countl_zero(mant) - 21;  // 1..10
    mant = (mant << shift) & 0x3ffu;
    bits = sign | (static_cast<uint32_t>(113 - shift) << 23) | (mant << 13);
  }
  return std::bit_cast<float>(bits);
}

inline uint16_t FloatToHalfImpl(float f) {
  const uint32_t u = std::bit_cast<uint32_t>(f);
  const uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  const uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) {
    // NaN: quiet, top 10 payload bits kept (as VCVTPS2PH does).
    return static_cast<uint16_t>(sign | 0x7e00u | ((a >> 13) & 0x3ffu));
  }
  if (a >= 0x477ff000u) {
    // >= 65520 (halfway between 65504, the largest half, and 2^16) rounds to Inf; Inf stays Inf.
    return static_cast<uint16_t>(sign | 0x7c00u);
  }
  if (a >= 0x38800000u) {
    // Normal half (>= 2^-14): rebias the exponent (127 -> 15) and round off 13 mantissa bits.
    const uint32_t r = a - 0x38000000u;
    return static_cast<uint16_t>(sign | ((r + 0xfffu + ((r >> 13) & 1u)) >> 13));
  }
  if (a <= 0x33000000u) {
    // <= 2^-25, half the smallest subnormal: rounds (ties to even) to zero.
    return sign;
  }
  // Subnormal half: the result is round(value / 2^-24).
  const uint32_t exp = a >> 23;                          // 102..112
  const uint32_t mant = (a & 0x7fffffu) | 0x800000u;     // value = mant * 2^(exp - 150)
  const uint32_t shift = 126 - exp;                      // 14..24
  uint32_t m = mant >> shift;
  const uint32_t rem = mant & ((1u << shift) - 1);
  const uint32_t half = 1u << (shift - 1);
  if (rem > half || (rem == half && (m & 1u))) ++m;      // may carry into the smallest normal
  return static_cast<uint16_t>(sign | m);
}

inline float BFloat16ToFloatImpl(uint16_t b) {
  return std::bit_cast<float>(static_cast<uint32_t>(b) << 16);
}

inline uint16_t FloatToBFloat16Impl(float f) {
  const uint32_t u = std::bit_cast<uint32_t>(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) {
    return static_cast<uint16_t>((u >> 16) | 0x40u);  // NaN: keep sign and high payload, quiet
  }
  // Round to nearest even; a carry out of the mantissa bumps the exponent (up to Inf).
  return static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

// ------------------------------------------------------------------------------------------
// Kernel table. Integer kernels work on the unsigned type of the same width: the bits are the
// same, unsigned arithmetic wraps without UB, and int32_t/uint32_t may alias each other.

struct Kernels {
  ReduceIsa isa;
  void (*sum_f32)(float*, const float*, const float*, size_t);
  void (*acc_f32)(float*, const float*, size_t);
  void (*div_f32)(float*, const float*, size_t, float);  // out may equal acc
  void (*sum_f64)(double*, const double*, const double*, size_t);
  void (*acc_f64)(double*, const double*, size_t);
  void (*div_f64)(double*, const double*, size_t, double);  // out may equal acc
  // int32 widens into an int64 accumulator (exact sums; reduce.h).
  void (*sum_i32)(int64_t*, const int32_t*, const int32_t*, size_t);
  void (*acc_i32)(int64_t*, const int32_t*, size_t);
  void (*sum_u64)(uint64_t*, const uint64_t*, const uint64_t*, size_t);
  void (*acc_u64)(uint64_t*, const uint64_t*, size_t);
  void (*sum_f16)(float*, const uint16_t*, const uint16_t*, size_t);
  void (*acc_f16)(float*, const uint16_t*, size_t);
  void (*load_f16)(float*, const uint16_t*, size_t);
  void (*store_f16)(uint16_t*, const float*, size_t, float);  // out may equal acc (in place)
  void (*sum_bf16)(float*, const uint16_t*, const uint16_t*, size_t);
  void (*acc_bf16)(float*, const uint16_t*, size_t);
  void (*load_bf16)(float*, const uint16_t*, size_t);
  void (*store_bf16)(uint16_t*, const float*, size_t, float);  // out may equal acc (in place)
};

// Portable scalar kernels; also the heads and tails of the vector kernels.
//
// Sum/Accumulate/Load write a buffer distinct from what they read, hence __restrict. Store-type
// kernels may run in place, so they take no __restrict: a same-size kernel reads element i
// before writing element i; a 16-bit store writes bytes [2i, 2i+2) after reading [4i, 4i+4),
// never touching an element not yet read.
namespace scalar {

// The loops run in fixed-length blocks, then one by one: GCC's -O2 vectorizer (cost model "very
// cheap") only takes loops that need no scalar epilogue, and a fixed-length inner loop needs
// none. That matters where these are the only implementation (neither x86-64 nor AArch64);
// elsewhere they serve as the reference for the vector kernels and for their tails.
constexpr size_t kBlock = 16;

template <typename T>
void Sum(T* __restrict acc, const T* __restrict a, const T* __restrict b, size_t n) {
  size_t i = 0;
  for (; i + kBlock <= n; i += kBlock) {
    for (size_t j = i; j < i + kBlock; ++j) acc[j] = a[j] + b[j];
  }
  for (; i < n; ++i) acc[i] = a[i] + b[i];
}
template <typename T>
void Acc(T* __restrict acc, const T* __restrict x, size_t n) {
  size_t i = 0;
  for (; i + kBlock <= n; i += kBlock) {
    for (size_t j = i; j < i + kBlock; ++j) acc[j] += x[j];
  }
  for (; i < n; ++i) acc[i] += x[i];
}
template <typename T>
void Div(T* out, const T* acc, size_t n, T d) {
  for (size_t i = 0; i < n; ++i) out[i] = acc[i] / d;
}

// Unsigned sums: operands are promoted to at least unsigned int, so no signed overflow either.
template <typename T>
void SumU(T* __restrict acc, const T* __restrict a, const T* __restrict b, size_t n) {
  size_t i = 0;
  for (; i + kBlock <= n; i += kBlock) {
    for (size_t j = i; j < i + kBlock; ++j) acc[j] = static_cast<T>(a[j] + b[j]);
  }
  for (; i < n; ++i) acc[i] = static_cast<T>(a[i] + b[i]);
}
template <typename T>
void AccU(T* __restrict acc, const T* __restrict x, size_t n) {
  size_t i = 0;
  for (; i + kBlock <= n; i += kBlock) {
    for (size_t j = i; j < i + kBlock; ++j) acc[j] = static_cast<T>(acc[j] + x[j]);
  }
  for (; i < n; ++i) acc[i] = static_cast<T>(acc[i] + x[i]);
}

// int32 into int64: exact for two values, and for up to 2^32 accumulated ones (an int64
// overflow would need more pushes than a job has workers).
inline void SumWiden(int64_t* __restrict acc, const int32_t* __restrict a,
                     const int32_t* __restrict b, size_t n) {
  for (size_t i = 0; i < n; ++i) acc[i] = int64_t{a[i]} + int64_t{b[i]};
}
inline void AccWiden(int64_t* __restrict acc, const int32_t* __restrict x, size_t n) {
  for (size_t i = 0; i < n; ++i) acc[i] += x[i];
}

// (Only the bf16 instances vectorize: the fp16 conversion is too branchy.)
template <float (*ToFloat)(uint16_t)>
void Sum16(float* __restrict acc, const uint16_t* __restrict a, const uint16_t* __restrict b,
           size_t n) {
  size_t i = 0;
  for (; i + kBlock <= n; i += kBlock) {
    for (size_t j = i; j < i + kBlock; ++j) acc[j] = ToFloat(a[j]) + ToFloat(b[j]);
  }
  for (; i < n; ++i) acc[i] = ToFloat(a[i]) + ToFloat(b[i]);
}
template <float (*ToFloat)(uint16_t)>
void Acc16(float* __restrict acc, const uint16_t* __restrict x, size_t n) {
  size_t i = 0;
  for (; i + kBlock <= n; i += kBlock) {
    for (size_t j = i; j < i + kBlock; ++j) acc[j] += ToFloat(x[j]);
  }
  for (; i < n; ++i) acc[i] += ToFloat(x[i]);
}
template <float (*ToFloat)(uint16_t)>
void Load16(float* __restrict acc, const uint16_t* __restrict x, size_t n) {
  size_t i = 0;
  for (; i + kBlock <= n; i += kBlock) {
    for (size_t j = i; j < i + kBlock; ++j) acc[j] = ToFloat(x[j]);
  }
  for (; i < n; ++i) acc[i] = ToFloat(x[i]);
}
template <uint16_t (*FromFloat)(float)>
void Store16(uint16_t* out, const float* acc, size_t n, float d) {
  if (d == 1.0f) {
    for (size_t i = 0; i < n; ++i) out[i] = FromFloat(acc[i]);
  } else {
    for (size_t i = 0; i < n; ++i) out[i] = FromFloat(acc[i] / d);
  }
}


}  // namespace scalar

// The kernel tables, one per ISA. Avx2/Avx512/Neon return nullptr where this build has no
// such kernels (another architecture); whether the CPU runs them is dispatch.cc's question.
extern const Kernels kScalarKernels;
const Kernels* Avx2Kernels();
const Kernels* Avx512Kernels();
const Kernels* NeonKernels();
bool CpuHasAvx2F16c();
bool CpuHasAvx512();

}  // namespace gradlink::reduce::internal
