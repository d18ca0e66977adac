#include "unit/support/reference.h"

#include <bit>
#include <cmath>
#include <cstring>
#include <string>

#include "common/naming.h"

namespace gradlink::test {

// Round to nearest even into binary16 / bfloat16, for normal finite values (all the tests use).
uint16_t RefFloatToHalf(float f) {
  if (f == 0.0f) return std::signbit(f) ? 0x8000 : 0;
  const uint16_t sign = std::signbit(f) ? 0x8000 : 0;
  int e;
  const double m = std::frexp(std::fabs(double(f)), &e);  // |f| = m * 2^e, m in [0.5, 1)
  double q = std::nearbyint(m * 2048.0);                  // 11 significant bits
  if (q == 2048.0) {
    q = 1024.0;
    ++e;
  }
  const int biased = (e - 1) + 15;
  EXPECT_GT(biased, 0) << f << " is not a normal fp16 value";
  EXPECT_LT(biased, 31) << f << " overflows fp16";
  return static_cast<uint16_t>(sign | (biased << 10) | (static_cast<int>(q) - 1024));
}
uint16_t RefFloatToBf16(float f) {
  if (f == 0.0f) return std::signbit(f) ? 0x8000 : 0;
  const uint16_t sign = std::signbit(f) ? 0x8000 : 0;
  int e;
  const double m = std::frexp(std::fabs(double(f)), &e);
  double q = std::nearbyint(m * 256.0);  // 8 significant bits
  if (q == 256.0) {
    q = 128.0;
    ++e;
  }
  const int biased = (e - 1) + 127;
  return static_cast<uint16_t>(sign | (biased << 7) | (static_cast<int>(q) - 128));
}
// Exact for the values used: k/4 with small k.
float RefHalfToFloat(uint16_t h) {
  const int e = (h >> 10) & 0x1F, m = h & 0x3FF;
  const float v = e == 0 ? std::ldexp(float(m), -24) : std::ldexp(float(m + 1024), e - 25);
  return (h & 0x8000) ? -v : v;
}
float RefBf16ToFloat(uint16_t b) { return std::bit_cast<float>(uint32_t{b} << 16); }

uint64_t Mix(uint64_t x) {  // splitmix64
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

// The value rank `rank` pushes for element `i` of tensor `tensor` in round `round`, as bytes of
// `dtype`. Floats are arbitrary; fp16/bf16 are quarters in [-16, 16] (exact in every type, so
// the fp32 sum is exact and rounds once), with element 0 = 2048 / 256 on rank 0 and 1 elsewhere
// so that accumulating in the narrow type would lose the ones.
void FillValue(DataType dtype, uint64_t tensor, uint32_t rank, uint64_t round, uint64_t i,
               std::byte* out) {
  const uint64_t r = Mix(Mix(Mix(tensor) ^ rank) ^ (round << 32) ^ i);
  switch (dtype) {
    case DataType::kFloat32: {
      const float v = float(int64_t(r % 2000001) - 1000000) / float(1 + (r >> 40) % 1000);
      std::memcpy(out, &v, 4);
      return;
    }
    case DataType::kFloat64: {
      const double v = double(int64_t(r % 2000000001) - 1000000000) / double(1 + (r >> 40) % 100000);
      std::memcpy(out, &v, 8);
      return;
    }
    case DataType::kFloat16:
    case DataType::kBFloat16: {
      float v = float(int64_t(r % 129) - 64) / 4.0f;
      if (i == 0) v = rank == 0 ? (dtype == DataType::kFloat16 ? 2048.0f : 256.0f) : 1.0f;
      const uint16_t bits = dtype == DataType::kFloat16 ? RefFloatToHalf(v) : RefFloatToBf16(v);
      std::memcpy(out, &bits, 2);
      return;
    }
    case DataType::kInt32: {
      const uint32_t v = static_cast<uint32_t>(r);  // full range: sums wrap
      std::memcpy(out, &v, 4);
      return;
    }
    case DataType::kInt64: {
      std::memcpy(out, &r, 8);
      return;
    }
  }
}

void FillTensor(DataType dtype, uint64_t tensor, uint32_t rank, uint64_t round,
                std::vector<std::byte>& buf) {
  const size_t size = DataTypeSize(dtype);
  for (uint64_t i = 0; i < buf.size() / size; ++i) {
    FillValue(dtype, tensor, rank, round, i, buf.data() + i * size);
  }
}

// The expected result for element i: the pushes of ranks 0..W-1 summed in rank order, in the
// accumulator type, divided by W when averaging, converted back.
void ExpectedValue(DataType dtype, uint64_t tensor, uint32_t workers, uint64_t round, uint64_t i,
                   bool average, std::byte* out) {
  std::byte v[8];
  switch (dtype) {
    case DataType::kFloat32: {
      float acc = 0, x;
      for (uint32_t r = 0; r < workers; ++r) {
        FillValue(dtype, tensor, r, round, i, v);
        std::memcpy(&x, v, 4);
        acc = r == 0 ? x : acc + x;
      }
      if (average) acc = acc / float(workers);
      std::memcpy(out, &acc, 4);
      return;
    }
    case DataType::kFloat64: {
      double acc = 0, x;
      for (uint32_t r = 0; r < workers; ++r) {
        FillValue(dtype, tensor, r, round, i, v);
        std::memcpy(&x, v, 8);
        acc = r == 0 ? x : acc + x;
      }
      if (average) acc = acc / double(workers);
      std::memcpy(out, &acc, 8);
      return;
    }
    case DataType::kFloat16:
    case DataType::kBFloat16: {
      float acc = 0;
      for (uint32_t r = 0; r < workers; ++r) {
        FillValue(dtype, tensor, r, round, i, v);
        uint16_t b;
        std::memcpy(&b, v, 2);
        const float x = dtype == DataType::kFloat16 ? RefHalfToFloat(b) : RefBf16ToFloat(b);
        acc = r == 0 ? x : acc + x;
      }
      if (average) acc = acc / float(workers);
      const uint16_t bits = dtype == DataType::kFloat16 ? RefFloatToHalf(acc) : RefFloatToBf16(acc);
      std::memcpy(out, &bits, 2);
      return;
    }
    case DataType::kInt32: {
      // Exact in int64; a sum wraps to int32 (mod 2^32), an average is the exact quotient.
      int64_t acc = 0;
      int32_t x;
      for (uint32_t r = 0; r < workers; ++r) {
        FillValue(dtype, tensor, r, round, i, v);
        std::memcpy(&x, v, 4);
        acc += x;
      }
      if (average) acc /= static_cast<int64_t>(workers);
      const int32_t res = static_cast<int32_t>(static_cast<uint32_t>(static_cast<uint64_t>(acc)));
      std::memcpy(out, &res, 4);
      return;
    }
    case DataType::kInt64: {
      uint64_t acc = 0, x;
      for (uint32_t r = 0; r < workers; ++r) {
        FillValue(dtype, tensor, r, round, i, v);
        std::memcpy(&x, v, 8);
        acc += x;
      }
      int64_t res = static_cast<int64_t>(acc);
      if (average) res = res / static_cast<int64_t>(workers);
      std::memcpy(out, &res, 8);
      return;
    }
  }
}

// Checks a whole result buffer; reports at most a few bad elements.
::testing::AssertionResult CheckTensor(DataType dtype, uint64_t tensor, uint32_t workers,
                                       uint64_t round, bool average,
                                       const std::vector<std::byte>& got) {
  const size_t size = DataTypeSize(dtype);
  int bad = 0;
  std::string detail;
  for (uint64_t i = 0; i < got.size() / size; ++i) {
    std::byte want[8];
    ExpectedValue(dtype, tensor, workers, round, i, average, want);
    if (std::memcmp(want, got.data() + i * size, size) != 0) {
      if (++bad <= 3) {
        uint64_t w = 0, g = 0;
        std::memcpy(&w, want, size);
        std::memcpy(&g, got.data() + i * size, size);
        detail += " [element " + std::to_string(i) + ": bits 0x" + KeyHex(g).substr(2) +
                  ", expected 0x" + KeyHex(w).substr(2) + "]";
      }
    }
  }
  if (bad == 0) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << DataTypeName(dtype) << " tensor " << tensor << " round "
                                       << round << ": " << bad << " wrong elements" << detail;
}

}  // namespace gradlink::test
