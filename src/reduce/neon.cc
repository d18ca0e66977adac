// AArch64 kernels: NEON (Advanced SIMD, part of the base architecture: chosen at compile time).
#include "reduce/vector_kernels.h"

#if defined(__aarch64__)
#include <arm_neon.h>
#endif

namespace gradlink::reduce::internal {

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
  static constexpr size_t kBytes = 32, kF32 = 8, kF64 = 4, kI64 = 4;
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



// Advanced SIMD is part of the AArch64 base architecture: no run-time check, no target
// attribute. always_inline on the ops makes them inline into these.
#define GL_NEON_KERNEL __attribute__((noinline))

namespace neon {
GL_DEFINE_VECTOR_KERNELS(NeonOps, GL_NEON_KERNEL)
GL_KERNEL_TABLE(ReduceIsa::kNeon)
}  // namespace neon


const Kernels* NeonKernels() { return &neon::kKernels; }

#else

const Kernels* NeonKernels() { return nullptr; }

#endif  // __aarch64__

}  // namespace gradlink::reduce::internal
