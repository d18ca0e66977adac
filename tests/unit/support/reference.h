// Independent scalar references for the job suites: the value every rank pushes for every
// element of every tensor in every round, the exact expected sum or average, and fp16 / bf16
// conversions written from the formats' definitions (not the library's). Shared by the suites
// that run whole jobs (unit/worker/*_test.cc); nothing here touches the library under test.
#pragma once

#include <gtest/gtest.h>

#include <cstddef>
#include <cstdint>
#include <vector>

#include "gradlink/worker.h"

namespace gradlink::test {

// Round to nearest even into binary16 / bfloat16, for normal finite values (all the tests use).
uint16_t RefFloatToHalf(float f);
uint16_t RefFloatToBf16(float f);
// Exact for the values used: k/4 with small k.
float RefHalfToFloat(uint16_t h);
float RefBf16ToFloat(uint16_t b);

uint64_t Mix(uint64_t x);  // splitmix64

// The value rank `rank` pushes for element `i` of tensor `tensor` in round `round`, as bytes of
// `dtype`. Floats are arbitrary; fp16/bf16 are quarters in [-16, 16] (exact in every type, so
// the fp32 sum is exact and rounds once), with element 0 = 2048 / 256 on rank 0 and 1 elsewhere
// so that accumulating in the narrow type would lose the ones.
void FillValue(DataType dtype, uint64_t tensor, uint32_t rank, uint64_t round, uint64_t i,
               std::byte* out);

void FillTensor(DataType dtype, uint64_t tensor, uint32_t rank, uint64_t round,
                std::vector<std::byte>& buf);

// The expected result for element i: the pushes of ranks 0..W-1 summed in rank order, in the
// accumulator type, divided by W when averaging, converted back.
void ExpectedValue(DataType dtype, uint64_t tensor, uint32_t workers, uint64_t round, uint64_t i,
                   bool average, std::byte* out);

// Checks a whole result buffer; reports at most a few bad elements.
::testing::AssertionResult CheckTensor(DataType dtype, uint64_t tensor, uint32_t workers,
                                       uint64_t round, bool average,
                                       const std::vector<std::byte>& got);

}  // namespace gradlink::test
