// Element-wise reducers: the servers sum pushes with them, the same-host path sums with them.
//
// fp16 and bf16 accumulate in fp32 (the accumulator holds fp32) and are rounded back to their
// own dtype (round to nearest even, NaN stays NaN) only in Store(). int32 accumulates in int64
// (exact for up to 2^32 pushes): a plain sum is written back mod 2^32, the same as wrapping
// int32 arithmetic; an average is the exact sum divided, so it never wraps. int64 wraps on
// overflow (two's complement), as NCCL and Horovod do. Integer averages truncate toward zero. Every function is a pure loop
// over n elements; results depend only on the inputs and their order, so summing pushes in rank
// order gives bit-identical sums whatever order they arrived in.
#pragma once

#include <cstddef>
#include <cstdint>

#include "gradlink/collective.h"
#include "gradlink/tensor.h"

namespace gradlink::reduce {

// The accumulator's element type for wire dtype t: fp32 for fp16/bf16, int64 for int32,
// otherwise t itself.
DataType AccumulatorType(DataType t);

// The most a server holds for one partition of `count` elements of wire dtype t in a job of
// `workers` workers once every rank has pushed it (server/partition_state.h): a staging buffer
// per rank in the wire dtype (rank 0's is usually not needed where the accumulator has the
// wire dtype, but may be), two accumulators (rounds r and r+1 overlap), and, where the
// accumulator's type is wider than the wire dtype, two results in the wire dtype. The scheduler
// admits keys against the servers' memory budgets with it; saturates at UINT64_MAX.
uint64_t ServerBytesHeld(DataType t, uint64_t count, uint32_t workers);

// acc[i] = a[i] + b[i]. a and b hold wire dtype t, acc holds AccumulatorType(t).
void SumTwo(DataType t, void* acc, const void* a, const void* b, size_t n);

// acc[i] += x[i]. x holds wire dtype t.
void Accumulate(DataType t, void* acc, const void* x, size_t n);

// acc[i] = x[i], converting wire dtype t to the accumulator type.
void Load(DataType t, void* acc, const void* x, size_t n);

// acc[i] = op(acc[i], x[i]) for kMin, kMax and kProduct (kSum: Accumulate). x holds wire dtype
// t, acc AccumulatorType(t). Min and max propagate NaN (acc's, if both are) and order -0.0
// below +0.0; integer products wrap (int32's in int64, narrowed by Store to what wrapping int32
// arithmetic gives). Scalar loops: these reductions are rare next to sums.
void Fold(ReduceOp op, DataType t, void* acc, const void* x, size_t n);

// out[i] = acc[i] / divisor (divisor 1: plain sum), converted to wire dtype t. out may alias acc
// when the two types have the same size.
void Store(DataType t, void* out, const void* acc, size_t n, uint32_t divisor);

// Scalar conversions (exposed for tests and for the Python layer's checks).
float HalfToFloat(uint16_t h);
uint16_t FloatToHalf(float f);
float BFloat16ToFloat(uint16_t b);
uint16_t FloatToBFloat16(float f);

// Test hook. The functions above run hand-vectorized loops for the best instruction set the CPU
// supports (x86-64: AVX-512F, else AVX2+F16C, chosen at run time; AArch64: NEON, always there)
// and portable scalar loops otherwise; all give bit-identical results. SetReduceIsaForTesting
// forces one implementation (kAuto: the best supported, the default) and returns false,
// changing nothing, when this CPU or build lacks it. For tests and benchmarks only.
enum class ReduceIsa : uint8_t { kAuto, kScalar, kAvx2, kAvx512, kNeon };
bool SetReduceIsaForTesting(ReduceIsa isa);
// The implementation the functions above use now (never kAuto).
ReduceIsa ActiveReduceIsa();

}  // namespace gradlink::reduce
