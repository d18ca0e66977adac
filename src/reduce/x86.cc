// x86-64 kernels: AVX2+F16C and AVX-512F, compiled with __attribute__((target)) so that one
// binary runs on any x86-64 CPU; dispatch.cc picks them at run time (CpuHas*).
#include "reduce/vector_kernels.h"

#if defined(__x86_64__)
#include <cpuid.h>
#include <immintrin.h>
#endif

namespace gradlink::reduce::internal {

#if defined(__x86_64__)

#define GL_AVX2_TARGET __attribute__((target("avx2,f16c"), always_inline))
#define GL_AVX512_TARGET __attribute__((target("avx512f,avx2,f16c"), always_inline))

// Every op of an ISA, under one name set, so that one kernel body (GL_DEFINE_VECTOR_KERNELS)
// serves every ISA. kF32 floats (or kF64 doubles, or kI64 integers) per vector.
struct Avx2Ops {
  static constexpr size_t kBytes = 32, kF32 = 8, kF64 = 4, kI64 = 4;
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
  static constexpr size_t kBytes = 64, kF32 = 16, kF64 = 8, kI64 = 8;
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


bool CpuHasAvx2F16c() {
  __builtin_cpu_init();
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  if (!__get_cpuid(1, &eax, &ebx, &ecx, &edx)) return false;
  // __builtin_cpu_supports also checks that the OS saves the YMM/ZMM state.
  return (ecx & bit_F16C) != 0 && __builtin_cpu_supports("avx2");
}

bool CpuHasAvx512() { return CpuHasAvx2F16c() && __builtin_cpu_supports("avx512f"); }


const Kernels* Avx2Kernels() { return &avx2::kKernels; }
const Kernels* Avx512Kernels() { return &avx512::kKernels; }

#else

const Kernels* Avx2Kernels() { return nullptr; }
const Kernels* Avx512Kernels() { return nullptr; }
bool CpuHasAvx2F16c() { return false; }
bool CpuHasAvx512() { return false; }

#endif  // __x86_64__

}  // namespace gradlink::reduce::internal
