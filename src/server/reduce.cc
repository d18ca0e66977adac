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
#include "server/reduce.h"

#include <atomic>
#include <bit>
#include <cstring>

#if defined(__x86_64__)
#include <cpuid.h>
#include <immintrin.h>
#elif defined(__aarch64__)
#include <arm_neon.h>
#endif

namespace gradlink::server {
namespace {

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
  void (*sum_u32)(uint32_t*, const uint32_t*, const uint32_t*, size_t);
  void (*acc_u32)(uint32_t*, const uint32_t*, size_t);
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

// ------------------------------------------------------------------------------------------
// Portable scalar kernels; also the tails of the vector kernels.
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

constexpr Kernels kKernels = {
    ReduceIsa::kScalar,
    Sum<float>,
    Acc<float>,
    Div<float>,
    Sum<double>,
    Acc<double>,
    Div<double>,
    SumU<uint32_t>,
    AccU<uint32_t>,
    SumU<uint64_t>,
    AccU<uint64_t>,
    Sum16<HalfToFloatImpl>,
    Acc16<HalfToFloatImpl>,
    Load16<HalfToFloatImpl>,
    Store16<FloatToHalfImpl>,
    Sum16<BFloat16ToFloatImpl>,
    Acc16<BFloat16ToFloatImpl>,
    Load16<BFloat16ToFloatImpl>,
    Store16<FloatToBFloat16Impl>,
};

}  // namespace scalar

// ------------------------------------------------------------------------------------------
// Vector kernels: x86-64 (AVX2+F16C, AVX-512F) and AArch64 (NEON).
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

#if defined(__x86_64__)

#define GL_AVX2_TARGET __attribute__((target("avx2,f16c"), always_inline))
#define GL_AVX512_TARGET __attribute__((target("avx512f,avx2,f16c"), always_inline))

// Every op of an ISA, under one name set, so that one kernel body (GL_DEFINE_VECTOR_KERNELS)
// serves every ISA. kF32 floats (or kF64 doubles, or kI32/kI64 integers) per vector.
struct Avx2Ops {
  static constexpr size_t kBytes = 32, kF32 = 8, kF64 = 4, kI32 = 8, kI64 = 4;
  using F32 = __m256;
  using F64 = __m256d;
  using I = __m256i;

  GL_AVX2_TARGET static F32 LoadF32(const float* p) { return _mm256_loadu_ps(p); }
  GL_AVX2_TARGET static void StoreF32(float* p, F32 v) { _mm256_storeu_ps(p, v); }
  GL_AVX2_TARGET static F32 AddF32(F32 a, F32 b) { return _mm256_add_ps(a, b); }
  GL_AVX2_TARGET static F32 DivF32(F32 a, F32 b) { return _mm256_div_ps(a, b); }
  GL_AVX2_TARGET static F32 SetF32(float f) { return _mm256_set1_ps(f); }

  GL_AVX2_TARGET static F64 LoadF64(const double* p) { return _mm256_loadu_pd(p); }
  GL_AVX2_TARGET static void StoreF64(double* p, F64 v) { _mm256_storeu_pd(p, v); }
  GL_AVX2_TARGET static F64 AddF64(F64 a, F64 b) { return _mm256_add_pd(a, b); }
  GL_AVX2_TARGET static F64 DivF64(F64 a, F64 b) { return _mm256_div_pd(a, b); }
  GL_AVX2_TARGET static F64 SetF64(double f) { return _mm256_set1_pd(f); }

  GL_AVX2_TARGET static I LoadI(const void* p) {
    return _mm256_loadu_si256(static_cast<const __m256i*>(p));
  }
  GL_AVX2_TARGET static void StoreI(void* p, I v) {
    _mm256_storeu_si256(static_cast<__m256i*>(p), v);
  }
  GL_AVX2_TARGET static I AddI32(I a, I b) { return _mm256_add_epi32(a, b); }
  GL_AVX2_TARGET static I AddI64(I a, I b) { return _mm256_add_epi64(a, b); }

  // kF32 halves <-> floats.
  GL_AVX2_TARGET static F32 LoadF16(const uint16_t* p) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
  GL_AVX2_TARGET static void StoreF16(uint16_t* p, F32 v) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p),
                     _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
  // kF32 bfloat16s <-> floats.
  GL_AVX2_TARGET static F32 LoadBF16(const uint16_t* p) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    const __m256i w = _mm256_cvtepu16_epi32(h);
    return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
  }
  GL_AVX2_TARGET static void StoreBF16(uint16_t* p, F32 v) {
    const __m256i u = _mm256_castps_si256(v);
    const __m256i hi = _mm256_srli_epi32(u, 16);
    const __m256i lsb = _mm256_and_si256(hi, _mm256_set1_epi32(1));
    const __m256i biased = _mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7fff)), lsb);
    const __m256i rounded = _mm256_srli_epi32(biased, 16);
    const __m256i quiet = _mm256_or_si256(hi, _mm256_set1_epi32(0x40));
    const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    const __m256i r = _mm256_blendv_epi8(rounded, quiet, nan);  // every lane <= 0xffff
    const __m128i packed =
        _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), packed);
  }
};

// GCC 12.1/12.2 warn -Wmaybe-uninitialized inside the AVX-512 intrinsics themselves (their
// _mm512_undefined_* placeholders; GCC bug 105593, fixed in 12.3). False positive: silence it
// for the AVX-512 code only.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif

struct Avx512Ops {
  static constexpr size_t kBytes = 64, kF32 = 16, kF64 = 8, kI32 = 16, kI64 = 8;
  using F32 = __m512;
  using F64 = __m512d;
  using I = __m512i;

  GL_AVX512_TARGET static F32 LoadF32(const float* p) { return _mm512_loadu_ps(p); }
  GL_AVX512_TARGET static void StoreF32(float* p, F32 v) { _mm512_storeu_ps(p, v); }
  GL_AVX512_TARGET static F32 AddF32(F32 a, F32 b) { return _mm512_add_ps(a, b); }
  GL_AVX512_TARGET static F32 DivF32(F32 a, F32 b) { return _mm512_div_ps(a, b); }
  GL_AVX512_TARGET static F32 SetF32(float f) { return _mm512_set1_ps(f); }

  GL_AVX512_TARGET static F64 LoadF64(const double* p) { return _mm512_loadu_pd(p); }
  GL_AVX512_TARGET static void StoreF64(double* p, F64 v) { _mm512_storeu_pd(p, v); }
  GL_AVX512_TARGET static F64 AddF64(F64 a, F64 b) { return _mm512_add_pd(a, b); }
  GL_AVX512_TARGET static F64 DivF64(F64 a, F64 b) { return _mm512_div_pd(a, b); }
  GL_AVX512_TARGET static F64 SetF64(double f) { return _mm512_set1_pd(f); }

  GL_AVX512_TARGET static I LoadI(const void* p) { return _mm512_loadu_si512(p); }
  GL_AVX512_TARGET static void StoreI(void* p, I v) { _mm512_storeu_si512(p, v); }
  GL_AVX512_TARGET static I AddI32(I a, I b) { return _mm512_add_epi32(a, b); }
  GL_AVX512_TARGET static I AddI64(I a, I b) { return _mm512_add_epi64(a, b); }

  GL_AVX512_TARGET static F32 LoadF16(const uint16_t* p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
  GL_AVX512_TARGET static void StoreF16(uint16_t* p, F32 v) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p),
                        _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
  GL_AVX512_TARGET static F32 LoadBF16(const uint16_t* p) {
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    const __m512i w = _mm512_cvtepu16_epi32(h);
    return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
  }
  GL_AVX512_TARGET static void StoreBF16(uint16_t* p, F32 v) {
    const __m512i u = _mm512_castps_si512(v);
    const __m512i hi = _mm512_srli_epi32(u, 16);
    const __m512i lsb = _mm512_and_si512(hi, _mm512_set1_epi32(1));
    const __m512i biased = _mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), lsb);
    const __m512i rounded = _mm512_srli_epi32(biased, 16);
    const __m512i quiet = _mm512_or_si512(hi, _mm512_set1_epi32(0x40));
    const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    const __m512i r = _mm512_mask_blend_epi32(nan, rounded, quiet);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(r));
  }
};

#endif  // __x86_64__

#if defined(__aarch64__)

#define GL_NEON_INLINE __attribute__((always_inline)) inline

// NEON ops. One "vector" is a pair of 128-bit registers (32 bytes, as wide as AVX2), so that
// every loop iteration has two independent loads, adds and stores in flight (an -O2 build does
// not unroll these loops) and the 16-bit loads fill a whole register (8 halves).
//
// Bit-identical to the scalar kernels under the default floating-point environment (FPCR:
// round to nearest even, no flush-to-zero, no default-NaN), which is what Linux gives every
// thread: FADD/FDIV round as the scalar + and / do; FCVTL (half -> single) is exact, keeps NaN
// payloads and quiets signaling NaNs; FCVTN (single -> half) rounds to nearest even, overflows
// to Inf, produces half subnormals and keeps the top payload bits of a NaN, quiet, exactly as
// FloatToHalfImpl does. A process that changes FPCR (fesetround, flush-to-zero) changes what
// FCVTN and FADD return here, as it changes the scalar adds; the x86 conversion instructions
// take their rounding from the instruction instead.
struct NeonOps {
  static constexpr size_t kBytes = 32, kF32 = 8, kF64 = 4, kI32 = 8, kI64 = 4;
  using F32 = float32x4x2_t;
  using F64 = float64x2x2_t;
  using I = uint32x4x2_t;

  GL_NEON_INLINE static F32 LoadF32(const float* p) { return {{vld1q_f32(p), vld1q_f32(p + 4)}}; }
  GL_NEON_INLINE static void StoreF32(float* p, F32 v) {
    vst1q_f32(p, v.val[0]);
    vst1q_f32(p + 4, v.val[1]);
  }
  GL_NEON_INLINE static F32 AddF32(F32 a, F32 b) {
    return {{vaddq_f32(a.val[0], b.val[0]), vaddq_f32(a.val[1], b.val[1])}};
  }
  GL_NEON_INLINE static F32 DivF32(F32 a, F32 b) {
    return {{vdivq_f32(a.val[0], b.val[0]), vdivq_f32(a.val[1], b.val[1])}};
  }
  GL_NEON_INLINE static F32 SetF32(float f) { return {{vdupq_n_f32(f), vdupq_n_f32(f)}}; }

  GL_NEON_INLINE static F64 LoadF64(const double* p) { return {{vld1q_f64(p), vld1q_f64(p + 2)}}; }
  GL_NEON_INLINE static void StoreF64(double* p, F64 v) {
    vst1q_f64(p, v.val[0]);
    vst1q_f64(p + 2, v.val[1]);
  }
  GL_NEON_INLINE static F64 AddF64(F64 a, F64 b) {
    return {{vaddq_f64(a.val[0], b.val[0]), vaddq_f64(a.val[1], b.val[1])}};
  }
  GL_NEON_INLINE static F64 DivF64(F64 a, F64 b) {
    return {{vdivq_f64(a.val[0], b.val[0]), vdivq_f64(a.val[1], b.val[1])}};
  }
  GL_NEON_INLINE static F64 SetF64(double f) { return {{vdupq_n_f64(f), vdupq_n_f64(f)}}; }

  // Integers travel as 32-bit lanes; AddI64 reinterprets them as 64-bit lanes.
  GL_NEON_INLINE static I LoadI(const void* p) {
    const uint32_t* q = static_cast<const uint32_t*>(p);
    return {{vld1q_u32(q), vld1q_u32(q + 4)}};
  }
  GL_NEON_INLINE static void StoreI(void* p, I v) {
    uint32_t* q = static_cast<uint32_t*>(p);
    vst1q_u32(q, v.val[0]);
    vst1q_u32(q + 4, v.val[1]);
  }
  GL_NEON_INLINE static I AddI32(I a, I b) {
    return {{vaddq_u32(a.val[0], b.val[0]), vaddq_u32(a.val[1], b.val[1])}};
  }
  GL_NEON_INLINE static uint32x4_t Add64(uint32x4_t a, uint32x4_t b) {
    return vreinterpretq_u32_u64(vaddq_u64(vreinterpretq_u64_u32(a), vreinterpretq_u64_u32(b)));
  }
  GL_NEON_INLINE static I AddI64(I a, I b) {
    return {{Add64(a.val[0], b.val[0]), Add64(a.val[1], b.val[1])}};
  }

  // kF32 halves <-> floats (FCVTL/FCVTL2, FCVTN/FCVTN2).
  GL_NEON_INLINE static F32 LoadF16(const uint16_t* p) {
    const float16x8_t h = vreinterpretq_f16_u16(vld1q_u16(p));
    return {{vcvt_f32_f16(vget_low_f16(h)), vcvt_high_f32_f16(h)}};
  }
  GL_NEON_INLINE static void StoreF16(uint16_t* p, F32 v) {
    const float16x8_t h = vcvt_high_f16_f32(vcvt_f16_f32(v.val[0]), v.val[1]);
    vst1q_u16(p, vreinterpretq_u16_f16(h));
  }
  // kF32 bfloat16s <-> floats: a bf16 is the high half of an fp32 (SHLL/SHLL2 by 16).
  GL_NEON_INLINE static F32 LoadBF16(const uint16_t* p) {
    const uint16x8_t h = vld1q_u16(p);
    return {{vreinterpretq_f32_u32(vshll_n_u16(vget_low_u16(h), 16)),
             vreinterpretq_f32_u32(vshll_high_n_u16(h, 16))}};
  }
  // FloatToBFloat16Impl on four lanes: (u + 0x7fff + lsb) >> 16, or the quieted high half for
  // a NaN; each result narrowed to 16 bits.
  GL_NEON_INLINE static uint32x4_t BF16Rounded(float32x4_t v) {
    const uint32x4_t u = vreinterpretq_u32_f32(v);
    const uint32x4_t lsb = vandq_u32(vshrq_n_u32(u, 16), vdupq_n_u32(1));
    return vaddq_u32(vaddq_u32(u, vdupq_n_u32(0x7fff)), lsb);
  }
  GL_NEON_INLINE static void StoreBF16(uint16_t* p, F32 v) {
    const uint32x4_t u0 = vreinterpretq_u32_f32(v.val[0]);
    const uint32x4_t u1 = vreinterpretq_u32_f32(v.val[1]);
    const uint16x8_t rounded =
        vshrn_high_n_u32(vshrn_n_u32(BF16Rounded(v.val[0]), 16), BF16Rounded(v.val[1]), 16);
    const uint16x8_t quiet =
        vorrq_u16(vshrn_high_n_u32(vshrn_n_u32(u0, 16), u1, 16), vdupq_n_u16(0x40));
    // All ones in the lanes that are not NaN (v == v), narrowed to 16-bit lanes.
    const uint16x8_t ordered =
        vmovn_high_u32(vmovn_u32(vceqq_f32(v.val[0], v.val[0])), vceqq_f32(v.val[1], v.val[1]));
    vst1q_u16(p, vbslq_u16(ordered, rounded, quiet));
  }
};

#endif  // __aarch64__

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
  TARGET void SumU32(uint32_t* acc, const uint32_t* a, const uint32_t* b, size_t n) {              \
    size_t i = HeadToAlign<V::kBytes>(acc, n);                                                     \
    scalar::SumU(acc, a, b, i);                                                                    \
    for (; i + V::kI32 <= n; i += V::kI32)                                                         \
      V::StoreI(acc + i, V::AddI32(V::LoadI(a + i), V::LoadI(b + i)));                             \
    scalar::SumU(acc + i, a + i, b + i, n - i);                                                    \
  }                                                                                                \
  TARGET void AccU32(uint32_t* acc, const uint32_t* x, size_t n) {                                 \
    size_t i = HeadToAlign<V::kBytes>(acc, n);                                                     \
    scalar::AccU(acc, x, i);                                                                       \
    for (; i + V::kI32 <= n; i += V::kI32)                                                         \
      V::StoreI(acc + i, V::AddI32(V::LoadI(acc + i), V::LoadI(x + i)));                           \
    scalar::AccU(acc + i, x + i, n - i);                                                           \
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

#define GL_KERNEL_TABLE(ISA)                                                               \
  constexpr Kernels kKernels = {ISA,     SumF32,  AccF32,  DivF32,   SumF64,  AccF64,  DivF64, \
                                SumU32,  AccU32,  SumU64,  AccU64,   SumF16,  AccF16,  LoadF16, \
                                StoreF16, SumBF16, AccBF16, LoadBF16, StoreBF16};

#endif  // __x86_64__ || __aarch64__

#if defined(__x86_64__)

// Kernels are noinline targets; always_inline on the ops makes them inline into these.
#define GL_AVX2_KERNEL __attribute__((target("avx2,f16c"), noinline))
#define GL_AVX512_KERNEL __attribute__((target("avx512f,avx2,f16c"), noinline))

namespace avx2 {
GL_DEFINE_VECTOR_KERNELS(Avx2Ops, GL_AVX2_KERNEL)
GL_KERNEL_TABLE(ReduceIsa::kAvx2)
}  // namespace avx2

namespace avx512 {
GL_DEFINE_VECTOR_KERNELS(Avx512Ops, GL_AVX512_KERNEL)
GL_KERNEL_TABLE(ReduceIsa::kAvx512)
}  // namespace avx512

#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic pop
#endif

#endif  // __x86_64__

#if defined(__aarch64__)

// Advanced SIMD is part of the AArch64 base architecture: no run-time check, no target
// attribute. always_inline on the ops makes them inline into these.
#define GL_NEON_KERNEL __attribute__((noinline))

namespace neon {
GL_DEFINE_VECTOR_KERNELS(NeonOps, GL_NEON_KERNEL)
GL_KERNEL_TABLE(ReduceIsa::kNeon)
}  // namespace neon

#endif  // __aarch64__

#if defined(__x86_64__) || defined(__aarch64__)
#undef GL_DEFINE_VECTOR_KERNELS
#undef GL_DEFINE_VECTOR_16BIT_KERNELS
#undef GL_KERNEL_TABLE
#endif

#if defined(__x86_64__)

bool CpuHasAvx2F16c() {
  __builtin_cpu_init();
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  if (!__get_cpuid(1, &eax, &ebx, &ecx, &edx)) return false;
  // __builtin_cpu_supports also checks that the OS saves the YMM/ZMM state.
  return (ecx & bit_F16C) != 0 && __builtin_cpu_supports("avx2");
}

bool CpuHasAvx512() { return CpuHasAvx2F16c() && __builtin_cpu_supports("avx512f"); }

#endif  // __x86_64__

const Kernels* KernelsFor(ReduceIsa isa) {
  switch (isa) {
    case ReduceIsa::kScalar: return &scalar::kKernels;
#if defined(__x86_64__)
    case ReduceIsa::kAvx2: return CpuHasAvx2F16c() ? &avx2::kKernels : nullptr;
    case ReduceIsa::kAvx512: return CpuHasAvx512() ? &avx512::kKernels : nullptr;
#else
    case ReduceIsa::kAvx2:
    case ReduceIsa::kAvx512: return nullptr;
#endif
#if defined(__aarch64__)
    case ReduceIsa::kNeon: return &neon::kKernels;
#else
    case ReduceIsa::kNeon: return nullptr;
#endif
    case ReduceIsa::kAuto: break;
  }
  return nullptr;
}

const Kernels* BestKernels() {
  static const Kernels* const best = [] {
    for (ReduceIsa isa : {ReduceIsa::kAvx512, ReduceIsa::kAvx2, ReduceIsa::kNeon}) {
      if (const Kernels* k = KernelsFor(isa)) return k;
    }
    return &scalar::kKernels;
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
  return (t == DataType::kFloat16 || t == DataType::kBFloat16) ? DataType::kFloat32 : t;
}

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
    case DataType::kInt32:
      k.sum_u32(As<uint32_t>(acc), As<uint32_t>(a), As<uint32_t>(b), n);
      return;
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
    case DataType::kInt32: k.acc_u32(As<uint32_t>(acc), As<uint32_t>(x), n); return;
    case DataType::kInt64: k.acc_u64(As<uint64_t>(acc), As<uint64_t>(x), n); return;
  }
}

void Load(DataType t, void* acc, const void* x, size_t n) {
  if (n == 0) return;
  switch (t) {
    case DataType::kFloat16: Active().load_f16(As<float>(acc), As<uint16_t>(x), n); return;
    case DataType::kBFloat16: Active().load_bf16(As<float>(acc), As<uint16_t>(x), n); return;
    case DataType::kFloat32:
    case DataType::kFloat64:
    case DataType::kInt32:
    case DataType::kInt64:
      if (acc != x) std::memcpy(acc, x, n * DataTypeSize(t));
      return;
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
    case DataType::kFloat32:
    case DataType::kFloat64:
    case DataType::kInt32:
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
    case DataType::kInt32: DivInt<int32_t>(out, acc, n, divisor); return;
    case DataType::kInt64: DivInt<int64_t>(out, acc, n, divisor); return;
    case DataType::kFloat16:
    case DataType::kBFloat16:
      return;
  }
}

float HalfToFloat(uint16_t h) { return HalfToFloatImpl(h); }
uint16_t FloatToHalf(float f) { return FloatToHalfImpl(f); }
float BFloat16ToFloat(uint16_t b) { return BFloat16ToFloatImpl(b); }
uint16_t FloatToBFloat16(float f) { return FloatToBFloat16Impl(f); }

bool SetReduceIsaForTesting(ReduceIsa isa) {
  const Kernels* k = isa == ReduceIsa::kAuto ? BestKernels() : KernelsFor(isa);
  if (k == nullptr) return false;
  g_active.store(k, std::memory_order_relaxed);
  return true;
}

ReduceIsa ActiveReduceIsa() { return Active().isa; }

}  // namespace gradlink::server
