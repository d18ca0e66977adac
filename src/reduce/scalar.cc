// The portable scalar kernel table: every ISA's reference, and the fallback on CPUs without
// vector kernels.
#include "reduce/kernels.h"

namespace gradlink::reduce::internal {

const Kernels kScalarKernels = {
    ReduceIsa::kScalar,
    scalar::Sum<float>,
    scalar::Acc<float>,
    scalar::Div<float>,
    scalar::Sum<double>,
    scalar::Acc<double>,
    scalar::Div<double>,
    scalar::SumWiden,
    scalar::AccWiden,
    scalar::SumU<uint64_t>,
    scalar::AccU<uint64_t>,
    scalar::Sum16<HalfToFloatImpl>,
    scalar::Acc16<HalfToFloatImpl>,
    scalar::Load16<HalfToFloatImpl>,
    scalar::Store16<FloatToHalfImpl>,
    scalar::Sum16<BFloat16ToFloatImpl>,
    scalar::Acc16<BFloat16ToFloatImpl>,
    scalar::Load16<BFloat16ToFloatImpl>,
    scalar::Store16<FloatToBFloat16Impl>,
};

}  // namespace gradlink::reduce::internal
