// Over 600 lines on purpose: every dtype x operation x ISA against the scalar reference, one
// parameterized suite for the one dispatch table (src/reduce/).
// Tests of the element-wise reducers against independent scalar references written here (math-
// based fp16/bf16 conversions, GCC's _Float16 where the compiler has it), for every dtype and for
// every instruction set the CPU supports, plus a bit-for-bit comparison of the vector paths with
// the scalar path on random data.
#include "reduce/reduce.h"

#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <functional>
#include <limits>
#include <random>
#include <sstream>
#include <string>
#include <type_traits>
#include <vector>

namespace gradlink::reduce {
namespace {

constexpr size_t kLengths[] = {0, 1, 7, 8, 15, 16, 17, 1000, 4099};
constexpr uint32_t kDivisors[] = {1, 2, 3, 7, 8, 1000};

uint32_t Bits(float f) { return std::bit_cast<uint32_t>(f); }
uint64_t Bits(double d) { return std::bit_cast<uint64_t>(d); }
float F32(uint32_t u) { return std::bit_cast<float>(u); }
double F64(uint64_t u) { return std::bit_cast<double>(u); }

bool IsHalfNaN(uint16_t h) { return (h & 0x7c00) == 0x7c00 && (h & 0x03ff) != 0; }
bool IsBf16NaN(uint16_t b) { return (b & 0x7f80) == 0x7f80 && (b & 0x007f) != 0; }

// ------------------------------------------------------------------------------------------
// Independent references.

// fp16 -> fp32 from the definition of binary16.
float RefHalfToFloat(uint16_t h) {
  const bool neg = (h & 0x8000) != 0;
  const int e = (h >> 10) & 0x1f;
  const int m = h & 0x3ff;
  float v;
  if (e == 0x1f) {
    v = m != 0 ? std::numeric_limits<float>::quiet_NaN() : std::numeric_limits<float>::infinity();
  } else if (e == 0) {
    v = std::ldexp(static_cast<float>(m), -24);
  } else {
    v = std::ldexp(static_cast<float>(m + 1024), e - 25);
  }
  return neg ? -v : v;
}

// fp32 -> fp16, round to nearest even, computed in double with nearbyint (the default rounding
// mode is to-nearest-even). NaN maps to a quiet NaN (payload not modeled; callers compare NaN-ness).
uint16_t RefFloatToHalf(float f) {
  const uint16_t sign = std::signbit(f) ? 0x8000 : 0;
  if (std::isnan(f)) return sign | 0x7e00;
  const double a = std::fabs(static_cast<double>(f));
  if (a >= 65520.0) return sign | 0x7c00;  // Inf, and everything that rounds past 65504
  if (a < 0x1p-14) {
    // Subnormal range: a multiple of 2^-24; 1024 * 2^-24 is the smallest normal, same encoding.
    return static_cast<uint16_t>(sign | static_cast<uint16_t>(std::nearbyint(a * 0x1p24)));
  }
  int e = 0;
  std::frexp(a, &e);  // a in [2^(e-1), 2^e)
  double m = std::nearbyint(std::ldexp(a, 11 - e));  // 11 significant bits: [1024, 2048]
  int exp = e - 1;
  if (m == 2048.0) {
    m = 1024.0;
    ++exp;
  }
  return static_cast<uint16_t>(sign | ((exp + 15) << 10) | static_cast<uint16_t>(m - 1024.0));
}

// bf16 is the top half of an fp32.
float RefBf16ToFloat(uint16_t b) { return F32(static_cast<uint32_t>(b) << 16); }

// fp32 -> bf16 at the bit level: truncate, then round the dropped half-word to nearest even.
uint16_t RefFloatToBf16(float f) {
  const uint32_t u = Bits(f);
  if (std::isnan(f)) return static_cast<uint16_t>((u >> 16) | 0x40);
  uint32_t hi = u >> 16;
  const uint32_t lo = u & 0xffff;
  if (lo > 0x8000 || (lo == 0x8000 && (hi & 1))) ++hi;
  return static_cast<uint16_t>(hi);
}

// fp32 -> bf16 again, from values (8 significant bits) rather than bits, to cross-check the above.
uint16_t RefFloatToBf16Math(float f) {
  const uint16_t sign = std::signbit(f) ? 0x8000 : 0;
  const double a = std::fabs(static_cast<double>(f));
  if (std::isinf(f)) return sign | 0x7f80;
  double r;
  if (a < 0x1p-126) {
    r = std::nearbyint(a * 0x1p133) * 0x1p-133;
  } else {
    int e = 0;
    std::frexp(a, &e);
    r = std::ldexp(std::nearbyint(std::ldexp(a, 8 - e)), e - 8);
  }
  if (r >= 0x1p128) return sign | 0x7f80;
  return static_cast<uint16_t>(sign | (Bits(static_cast<float>(r)) >> 16));
}

// Integer average truncating toward zero, computed on magnitudes (independent of C++ `/`).
template <typename S>
S RefDivTrunc(S a, uint32_t d) {
  using U = std::make_unsigned_t<S>;
  const bool neg = a < 0;
  const U mag = neg ? static_cast<U>(U{0} - static_cast<U>(a)) : static_cast<U>(a);
  const U q = static_cast<U>(mag / d);
  return static_cast<S>(neg ? static_cast<U>(U{0} - q) : q);
}

template <typename S>
S WrapAdd(S a, S b) {
  using U = std::make_unsigned_t<S>;
  return static_cast<S>(static_cast<U>(static_cast<U>(a) + static_cast<U>(b)));
}

// ------------------------------------------------------------------------------------------
// Comparisons. Floats: bit-identical, except that any NaN matches any NaN (which NaN operand an
// add propagates is up to the compiler's operand order in the reference). 16-bit wire values:
// bit-identical, except that an expected NaN needs a quiet NaN.

std::string Hex(uint64_t v) {
  std::ostringstream os;
  os << "0x" << std::hex << v;
  return os.str();
}

::testing::AssertionResult Same(float e, float a) {
  if (std::isnan(e) ? std::isnan(a) : Bits(e) == Bits(a)) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << "expected " << e << " (" << Hex(Bits(e)) << "), got " << a
                                       << " (" << Hex(Bits(a)) << ")";
}
::testing::AssertionResult Same(double e, double a) {
  if (std::isnan(e) ? std::isnan(a) : Bits(e) == Bits(a)) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << "expected " << e << " (" << Hex(Bits(e)) << "), got " << a
                                       << " (" << Hex(Bits(a)) << ")";
}
::testing::AssertionResult Same(int32_t e, int32_t a) {
  if (e == a) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << "expected " << e << ", got " << a;
}
::testing::AssertionResult Same(int64_t e, int64_t a) {
  if (e == a) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << "expected " << e << ", got " << a;
}
::testing::AssertionResult SameHalf(uint16_t e, uint16_t a) {
  if (IsHalfNaN(e) ? IsHalfNaN(a) && (a & 0x0200) != 0 : e == a) {
    return ::testing::AssertionSuccess();
  }
  return ::testing::AssertionFailure() << "expected fp16 " << Hex(e) << ", got " << Hex(a);
}
::testing::AssertionResult SameBf16(uint16_t e, uint16_t a) {
  if (IsBf16NaN(e) ? IsBf16NaN(a) && (a & 0x0040) != 0 : e == a) {
    return ::testing::AssertionSuccess();
  }
  return ::testing::AssertionFailure() << "expected bf16 " << Hex(e) << ", got " << Hex(a);
}

// Reports the first mismatch only.
template <typename T, typename SameFn>
void ExpectArray(const std::vector<T>& expected, const T* actual, SameFn same,
                 const std::string& what) {
  for (size_t i = 0; i < expected.size(); ++i) {
    const ::testing::AssertionResult r = same(expected[i], actual[i]);
    if (!r) {
      ADD_FAILURE() << what << ": element " << i << " of " << expected.size() << ": "
                    << r.message();
      return;
    }
  }
}

// n elements at offset `off` (0 or 1: 1 misaligns the pointer by one element) inside a buffer
// with one guard element on each side, all of them filled with a recognizable pattern.
template <typename T>
class Padded {
 public:
  Padded(size_t n, size_t off) : n_(n), off_(off), v_(n + 2) {
    for (size_t i = 0; i < v_.size(); ++i) std::memset(&v_[i], 0xA5, sizeof(T));
  }
  Padded(const std::vector<T>& values, size_t off) : Padded(values.size(), off) {
    if (!values.empty()) std::memcpy(data(), values.data(), values.size() * sizeof(T));
  }
  T* data() { return v_.data() + off_; }
  // True if no byte outside [data(), data() + n) changed.
  bool GuardsIntact(size_t bytes_written) const {
    const auto* p = reinterpret_cast<const unsigned char*>(v_.data());
    const size_t begin = off_ * sizeof(T);
    for (size_t i = 0; i < v_.size() * sizeof(T); ++i) {
      if (i >= begin && i < begin + bytes_written) continue;
      if (p[i] != 0xA5) return false;
    }
    return true;
  }
  bool GuardsIntact() const { return GuardsIntact(n_ * sizeof(T)); }

 private:
  size_t n_, off_;
  std::vector<T> v_;
};

// ------------------------------------------------------------------------------------------
// Random data with the special values mixed in.

class Gen {
 public:
  explicit Gen(uint64_t seed) : rng_(seed) {}
  uint64_t Bits64() { return rng_(); }
  size_t Below(size_t n) { return static_cast<size_t>(rng_() % n); }
  bool OneIn(size_t n) { return Below(n) == 0; }
  double Uniform(double lo, double hi) {
    return std::uniform_real_distribution<double>(lo, hi)(rng_);
  }
  template <typename T>
  T Pick(const std::vector<T>& v) {
    return v[Below(v.size())];
  }

 private:
  std::mt19937_64 rng_;
};

const std::vector<uint32_t> kF32Specials = {
    0x00000000, 0x80000000,  // +-0
    0x7f800000, 0xff800000,  // +-Inf
    0x7fc00000, 0xffc00000, 0x7fc12345, 0x7f800001,  // NaNs (last: signaling)
    0x00000001, 0x80000001, 0x007fffff, 0x807fffff,  // subnormals
    0x00800000, 0x7f7fffff, 0xff7fffff,              // FLT_MIN, +-FLT_MAX
    0x3f800000, 0xbf800000, 0x3dcccccd,              // 1, -1, 0.1
};

const std::vector<uint64_t> kF64Specials = {
    0x0000000000000000, 0x8000000000000000, 0x7ff0000000000000, 0xfff0000000000000,
    0x7ff8000000000000, 0xfff8000000000000, 0x7ff0000000000001, 0x0000000000000001,
    0x8000000000000001, 0x000fffffffffffff, 0x0010000000000000, 0x7fefffffffffffff,
    0xffefffffffffffff, 0x3ff0000000000000, 0xbff0000000000000,
};

const std::vector<uint16_t> kF16Specials = {
    0x0000, 0x8000, 0x7c00, 0xfc00,          // +-0, +-Inf
    0x7e00, 0xfe00, 0x7c01, 0x7d55,          // NaNs (0x7c01, 0x7d55: signaling)
    0x0001, 0x8001, 0x03ff, 0x83ff, 0x0400,  // subnormals, smallest normal
    0x7bff, 0xfbff, 0x3c00, 0xbc00,          // +-65504, +-1
};

const std::vector<uint16_t> kBf16Specials = {
    0x0000, 0x8000, 0x7f80, 0xff80, 0x7fc0, 0xffc0, 0x7f81,  // +-0, +-Inf, NaNs
    0x0001, 0x8001, 0x007f, 0x0080, 0x7f7f, 0xff7f, 0x3f80, 0xbf80,
};

// Accumulator values that exercise fp16 rounding: overflow, ties, subnormal results.
const std::vector<uint32_t> kF16StoreSpecials = {
    0x477fe000,  // 65504, the largest half
    0x477fefff,  // just below the 65504/65536 tie: 65504
    0x477ff000,  // 65520, the tie: rounds (to even) to Inf
    0x47800000,  // 65536: Inf
    0x4f000000,  // 2^31: Inf
    0xc7800000,  // -65536: -Inf
    0x33800000,  // 2^-24, smallest subnormal half
    0x33000000,  // 2^-25: tie between 0 and 2^-24, rounds to 0
    0x33000001,  // just above: 2^-24
    0x33c00000,  // 1.5 * 2^-24: tie, rounds to 2 * 2^-24
    0x34200000,  // 2.5 * 2^-24: tie, rounds to 2 * 2^-24
    0x387fc000,  // largest subnormal half
    0x387fe000,  // tie between largest subnormal and smallest normal: rounds to normal (even)
    0x38800000,  // 2^-14, smallest normal half
    0x3f801000,  // 1 + 2^-11: tie, rounds to 1
    0x3f803000,  // 1 + 3*2^-11: tie, rounds up
    0x00000001,  // fp32 subnormal: 0
    0x80000001,  // -0
};

const std::vector<uint32_t> kBf16StoreSpecials = {
    0x7f7fffff,  // FLT_MAX rounds to Inf
    0x7f7f7fff,  // stays at the largest bf16
    0x7f7f8000,  // tie with an odd last bit: rounds up, to Inf
    0x3f808000,  // tie, even: stays 1
    0x3f818000,  // tie, odd: rounds up
    0x00008000,  // subnormal tie, even: 0
    0x00018000,  // subnormal tie, odd: rounds up
    0x007fffff,  // largest subnormal: rounds to the smallest normal
    0x7f800001,  // signaling NaN: must come out quiet
    0xff812345,  // negative NaN whose payload has no bit in the top 7 kept
};

float RandomF32(Gen& g) {
  switch (g.Below(8)) {
    case 0: return F32(g.Pick(kF32Specials));
    case 1:
    case 2:
    case 3: return F32(static_cast<uint32_t>(g.Bits64()));
    default: return static_cast<float>(g.Uniform(-1000.0, 1000.0));
  }
}

double RandomF64(Gen& g) {
  switch (g.Below(8)) {
    case 0: return F64(g.Pick(kF64Specials));
    case 1:
    case 2:
    case 3: return F64(g.Bits64());
    default: return g.Uniform(-1000.0, 1000.0);
  }
}

uint16_t RandomF16(Gen& g) {
  return g.OneIn(8) ? g.Pick(kF16Specials) : static_cast<uint16_t>(g.Bits64());
}
uint16_t RandomBf16(Gen& g) {
  return g.OneIn(8) ? g.Pick(kBf16Specials) : static_cast<uint16_t>(g.Bits64());
}

// fp32 accumulator values for an fp16 Store: mostly within or near the fp16 range.
float RandomF16Acc(Gen& g) {
  switch (g.Below(8)) {
    case 0: return F32(g.Pick(kF16StoreSpecials));
    case 1: return F32(g.Pick(kF32Specials));
    case 2: return static_cast<float>(g.Uniform(-70000.0, 70000.0));
    case 3: {  // random bits with an exponent from fp16-subnormal to just past fp16 overflow
      const uint32_t exp = 100 + static_cast<uint32_t>(g.Below(145 - 100));
      return F32((static_cast<uint32_t>(g.Bits64()) & 0x807fffffu) | (exp << 23));
    }
    default: return RefHalfToFloat(RandomF16(g)) + RefHalfToFloat(RandomF16(g));
  }
}
float RandomBf16Acc(Gen& g) {
  switch (g.Below(6)) {
    case 0: return F32(g.Pick(kBf16StoreSpecials));
    case 1: return F32(g.Pick(kF32Specials));
    case 2: return static_cast<float>(g.Uniform(-1e6, 1e6));
    default: return F32(static_cast<uint32_t>(g.Bits64()));
  }
}

template <typename S>
S RandomInt(Gen& g) {
  static const std::vector<S> specials = {0,
                                          1,
                                          -1,
                                          -7,
                                          std::numeric_limits<S>::max(),
                                          std::numeric_limits<S>::min(),
                                          std::numeric_limits<S>::max() - 1,
                                          std::numeric_limits<S>::min() + 1};
  switch (g.Below(4)) {
    case 0: return g.Pick(specials);
    case 1: return static_cast<S>(static_cast<int64_t>(g.Below(2001)) - 1000);
    default: return static_cast<S>(g.Bits64());
  }
}

// ------------------------------------------------------------------------------------------
// One description per dtype: W is the wire element, A the accumulator element.

template <typename W, typename A>
struct DtypeSpec {
  DataType type;
  std::function<W(Gen&)> wire;         // random wire value
  std::function<A(Gen&)> acc;          // random accumulator value
  std::function<A(W)> to_acc;          // wire -> accumulator
  std::function<A(A, A)> add;          // accumulator sum
  std::function<W(A, uint32_t)> store; // accumulator / divisor -> wire
  std::function<::testing::AssertionResult(A, A)> same_acc;
  std::function<::testing::AssertionResult(W, W)> same_wire;
};

DtypeSpec<float, float> Fp32Spec() {
  return {DataType::kFloat32,
          RandomF32,
          RandomF32,
          [](float x) { return x; },
          [](float a, float b) { return a + b; },
          [](float a, uint32_t d) { return d == 1 ? a : a / static_cast<float>(d); },
          [](float e, float a) { return Same(e, a); },
          [](float e, float a) { return Same(e, a); }};
}
DtypeSpec<double, double> Fp64Spec() {
  return {DataType::kFloat64,
          RandomF64,
          RandomF64,
          [](double x) { return x; },
          [](double a, double b) { return a + b; },
          [](double a, uint32_t d) { return d == 1 ? a : a / static_cast<double>(d); },
          [](double e, double a) { return Same(e, a); },
          [](double e, double a) { return Same(e, a); }};
}
DtypeSpec<uint16_t, float> Fp16Spec() {
  return {DataType::kFloat16,
          RandomF16,
          RandomF16Acc,
          RefHalfToFloat,
          [](float a, float b) { return a + b; },
          [](float a, uint32_t d) { return RefFloatToHalf(a / static_cast<float>(d)); },
          [](float e, float a) { return Same(e, a); },
          SameHalf};
}
DtypeSpec<uint16_t, float> Bf16Spec() {
  return {DataType::kBFloat16,
          RandomBf16,
          RandomBf16Acc,
          RefBf16ToFloat,
          [](float a, float b) { return a + b; },
          [](float a, uint32_t d) { return RefFloatToBf16(a / static_cast<float>(d)); },
          [](float e, float a) { return Same(e, a); },
          SameBf16};
}
template <typename S>
DtypeSpec<S, S> IntSpec(DataType t) {
  return {t,
          RandomInt<S>,
          RandomInt<S>,
          [](S x) { return x; },
          WrapAdd<S>,
          [](S a, uint32_t d) { return RefDivTrunc<S>(a, d); },
          [](S e, S a) { return Same(e, a); },
          [](S e, S a) { return Same(e, a); }};
}

// int32 accumulates in int64: exact sums, written back mod 2^32 (a plain sum) or as the exact
// quotient, truncated toward zero and then narrowed (an average).
DtypeSpec<int32_t, int64_t> Int32Spec() {
  return {DataType::kInt32,
          RandomInt<int32_t>,
          [](Gen& g) {
            // Sums of a few int32 values, beyond int32 on both sides.
            return int64_t{RandomInt<int32_t>(g)} * 3 + RandomInt<int32_t>(g);
          },
          [](int32_t x) { return int64_t{x}; },
          WrapAdd<int64_t>,
          [](int64_t a, uint32_t d) {
            return static_cast<int32_t>(static_cast<uint32_t>(
                static_cast<uint64_t>(d == 1 ? a : RefDivTrunc<int64_t>(a, d))));
          },
          [](int64_t e, int64_t a) { return Same(e, a); },
          [](int32_t e, int32_t a) { return Same(e, a); }};
}

template <typename T>
std::vector<T> Fill(size_t n, const std::function<T(Gen&)>& f, Gen& g) {
  std::vector<T> v(n);
  for (auto& x : v) x = f(g);
  return v;
}

// SumTwo, Accumulate, Load and Store (every divisor, out of place and in place) for all lengths
// and both alignments, against the reference.
template <typename W, typename A>
void CheckAllOps(const DtypeSpec<W, A>& s, uint64_t seed) {
  Gen g(seed);
  const std::string name(DataTypeName(s.type));
  ASSERT_EQ(DataTypeSize(AccumulatorType(s.type)), sizeof(A));
  for (size_t n : kLengths) {
    for (size_t off : {0, 1}) {
      const std::string ctx = name + " n=" + std::to_string(n) + " off=" + std::to_string(off);
      const std::vector<W> a = Fill(n, s.wire, g), b = Fill(n, s.wire, g);
      const std::vector<A> acc0 = Fill(n, s.acc, g);
      Padded<W> pa(a, off), pb(b, off);

      {  // SumTwo
        std::vector<A> expected(n);
        for (size_t i = 0; i < n; ++i) expected[i] = s.add(s.to_acc(a[i]), s.to_acc(b[i]));
        Padded<A> acc(n, off);
        SumTwo(s.type, acc.data(), pa.data(), pb.data(), n);
        ExpectArray(expected, acc.data(), s.same_acc, "SumTwo " + ctx);
        EXPECT_TRUE(acc.GuardsIntact()) << "SumTwo " << ctx;
      }
      {  // SumTwo with both inputs the same buffer
        std::vector<A> expected(n);
        for (size_t i = 0; i < n; ++i) expected[i] = s.add(s.to_acc(a[i]), s.to_acc(a[i]));
        Padded<A> acc(n, off);
        SumTwo(s.type, acc.data(), pa.data(), pa.data(), n);
        ExpectArray(expected, acc.data(), s.same_acc, "SumTwo(a, a) " + ctx);
      }
      {  // Accumulate
        std::vector<A> expected(n);
        for (size_t i = 0; i < n; ++i) expected[i] = s.add(acc0[i], s.to_acc(a[i]));
        Padded<A> acc(acc0, off);
        Accumulate(s.type, acc.data(), pa.data(), n);
        ExpectArray(expected, acc.data(), s.same_acc, "Accumulate " + ctx);
        EXPECT_TRUE(acc.GuardsIntact()) << "Accumulate " << ctx;
      }
      {  // Load
        std::vector<A> expected(n);
        for (size_t i = 0; i < n; ++i) expected[i] = s.to_acc(a[i]);
        Padded<A> acc(n, off);
        Load(s.type, acc.data(), pa.data(), n);
        ExpectArray(expected, acc.data(), s.same_acc, "Load " + ctx);
        EXPECT_TRUE(acc.GuardsIntact()) << "Load " << ctx;
      }
      for (uint32_t d : kDivisors) {
        const std::string sctx = "Store d=" + std::to_string(d) + " " + ctx;
        std::vector<W> expected(n);
        for (size_t i = 0; i < n; ++i) expected[i] = s.store(acc0[i], d);
        {
          Padded<A> acc(acc0, off);
          Padded<W> out(n, off);
          Store(s.type, out.data(), acc.data(), n, d);
          ExpectArray(expected, out.data(), s.same_wire, sctx);
          EXPECT_TRUE(out.GuardsIntact()) << sctx;
          ExpectArray(acc0, acc.data(), s.same_acc, "acc unchanged by " + sctx);
        }
        {  // In place: out == acc (for fp16/bf16, the results are packed into the front).
          Padded<A> acc(acc0, off);
          Store(s.type, acc.data(), acc.data(), n, d);
          std::vector<W> got(n);
          if (n > 0) std::memcpy(got.data(), acc.data(), n * sizeof(W));
          ExpectArray(expected, got.data(), s.same_wire, "in place " + sctx);
          EXPECT_TRUE(acc.GuardsIntact()) << "in place " << sctx;
        }
      }
    }
  }
}

// ------------------------------------------------------------------------------------------
// Every op test runs once per instruction set; those the CPU lacks are skipped.

std::string IsaName(ReduceIsa isa) {
  switch (isa) {
    case ReduceIsa::kAuto: return "Auto";
    case ReduceIsa::kScalar: return "Scalar";
    case ReduceIsa::kAvx2: return "Avx2";
    case ReduceIsa::kAvx512: return "Avx512";
    case ReduceIsa::kNeon: return "Neon";
  }
  return "Unknown";
}

class ReduceTest : public ::testing::TestWithParam<ReduceIsa> {
 protected:
  void SetUp() override {
    if (!SetReduceIsaForTesting(GetParam())) {
      GTEST_SKIP() << IsaName(GetParam()) << " not supported here";
    }
    ASSERT_EQ(ActiveReduceIsa(), GetParam());
  }
  void TearDown() override { SetReduceIsaForTesting(ReduceIsa::kAuto); }
};

INSTANTIATE_TEST_SUITE_P(Isa, ReduceTest,
                         ::testing::Values(ReduceIsa::kScalar, ReduceIsa::kAvx2, ReduceIsa::kAvx512,
                                           ReduceIsa::kNeon),
                         [](const ::testing::TestParamInfo<ReduceIsa>& info) {
                           return IsaName(info.param);
                         });

TEST_P(ReduceTest, Fp32AllOps) { CheckAllOps(Fp32Spec(), 1); }
TEST_P(ReduceTest, Fp64AllOps) { CheckAllOps(Fp64Spec(), 2); }
TEST_P(ReduceTest, Fp16AllOps) { CheckAllOps(Fp16Spec(), 3); }
TEST_P(ReduceTest, Bf16AllOps) { CheckAllOps(Bf16Spec(), 4); }
TEST_P(ReduceTest, Int32AllOps) { CheckAllOps(Int32Spec(), 5); }
TEST_P(ReduceTest, Int64AllOps) { CheckAllOps(IntSpec<int64_t>(DataType::kInt64), 6); }

// The same checks spelled out on specific values (every value repeated to fill vectors, tail
// included).
template <typename T>
std::vector<T> Repeat(const std::vector<T>& v, size_t copies) {
  std::vector<T> out;
  for (size_t c = 0; c < copies; ++c) out.insert(out.end(), v.begin(), v.end());
  return out;
}

TEST_P(ReduceTest, Fp16Specials) {
  const float inf = std::numeric_limits<float>::infinity();
  // Sums in fp32: Inf - Inf is NaN; 65504 + 65504 is fine in fp32 but Inf once stored as fp16.
  const std::vector<uint16_t> a = Repeat<uint16_t>({0x7c00, 0x7bff, 0x8000, 0x0001, 0x7e00}, 7);
  const std::vector<uint16_t> b = Repeat<uint16_t>({0xfc00, 0x7bff, 0x8000, 0x0001, 0x3c00}, 7);
  std::vector<float> acc(a.size());
  SumTwo(DataType::kFloat16, acc.data(), a.data(), b.data(), a.size());
  std::vector<uint16_t> out(a.size());
  Store(DataType::kFloat16, out.data(), acc.data(), acc.size(), 1);
  for (size_t i = 0; i < a.size(); i += 5) {
    EXPECT_TRUE(std::isnan(acc[i]));
    EXPECT_TRUE(IsHalfNaN(out[i]) && (out[i] & 0x200)) << Hex(out[i]);
    EXPECT_EQ(acc[i + 1], 131008.0f);
    EXPECT_EQ(out[i + 1], 0x7c00);  // fp16 overflow: Inf
    EXPECT_EQ(Bits(acc[i + 2]), 0x80000000u);  // -0 + -0 = -0
    EXPECT_EQ(out[i + 2], 0x8000);
    EXPECT_EQ(acc[i + 3], 0x1p-23f);  // subnormal + subnormal
    EXPECT_EQ(out[i + 3], 0x0002);
    EXPECT_TRUE(std::isnan(acc[i + 4]));  // NaN + 1
    EXPECT_TRUE(IsHalfNaN(out[i + 4]) && (out[i + 4] & 0x200)) << Hex(out[i + 4]);
  }
  // Store of specific accumulator values, divisor 1 and 2.
  const std::vector<float> vals = {65504.0f, 65519.0f, 65520.0f, -1e6f, inf, -inf,
                                   0x1p-24f, 0x1p-25f, 0x1.8p-24f, 0x1.4p-23f, 0x1p-14f, -0.0f};
  const std::vector<uint16_t> want1 = {0x7bff, 0x7bff, 0x7c00, 0xfc00, 0x7c00, 0xfc00,
                                       0x0001, 0x0000, 0x0002, 0x0002, 0x0400, 0x8000};
  const std::vector<uint16_t> want2 = {0x77ff, 0x77ff, 0x7800, 0xfc00, 0x7c00, 0xfc00,
                                       0x0000, 0x0000, 0x0001, 0x0001, 0x0200, 0x8000};
  const std::vector<float> acc2 = Repeat(vals, 5);
  std::vector<uint16_t> out2(acc2.size());
  Store(DataType::kFloat16, out2.data(), acc2.data(), acc2.size(), 1);
  ExpectArray(Repeat(want1, 5), out2.data(), SameHalf, "fp16 Store d=1");
  Store(DataType::kFloat16, out2.data(), acc2.data(), acc2.size(), 2);
  ExpectArray(Repeat(want2, 5), out2.data(), SameHalf, "fp16 Store d=2");
  // Load: subnormals, -0, Inf, NaN quiet.
  const std::vector<uint16_t> h = Repeat<uint16_t>({0x0001, 0x83ff, 0x8000, 0xfc00, 0x7c01}, 7);
  std::vector<float> f(h.size());
  Load(DataType::kFloat16, f.data(), h.data(), h.size());
  for (size_t i = 0; i < h.size(); i += 5) {
    EXPECT_EQ(f[i], 0x1p-24f);
    EXPECT_EQ(f[i + 1], -0x3ffp-24f);
    EXPECT_EQ(Bits(f[i + 2]), 0x80000000u);
    EXPECT_EQ(f[i + 3], -inf);
    EXPECT_TRUE(std::isnan(f[i + 4]));
  }
}

TEST_P(ReduceTest, Bf16Specials) {
  const std::vector<uint16_t> a = Repeat<uint16_t>({0x7f80, 0x7f7f, 0x8000, 0x0001, 0x7f81}, 7);
  const std::vector<uint16_t> b = Repeat<uint16_t>({0xff80, 0x7f7f, 0x8000, 0x0001, 0x3f80}, 7);
  std::vector<float> acc(a.size());
  SumTwo(DataType::kBFloat16, acc.data(), a.data(), b.data(), a.size());
  std::vector<uint16_t> out(a.size());
  Store(DataType::kBFloat16, out.data(), acc.data(), acc.size(), 1);
  for (size_t i = 0; i < a.size(); i += 5) {
    EXPECT_TRUE(std::isnan(acc[i]));
    EXPECT_TRUE(IsBf16NaN(out[i]) && (out[i] & 0x40)) << Hex(out[i]);
    EXPECT_EQ(out[i + 1], 0x7f80);  // max + max overflows fp32 too: Inf
    EXPECT_EQ(out[i + 2], 0x8000);
    EXPECT_EQ(out[i + 3], 0x0002);
    EXPECT_TRUE(IsBf16NaN(out[i + 4]) && (out[i + 4] & 0x40)) << Hex(out[i + 4]);
  }
  std::vector<float> vals;
  std::vector<uint16_t> want;
  for (uint32_t u : kBf16StoreSpecials) {
    vals.push_back(F32(u));
    want.push_back(RefFloatToBf16(F32(u)));
  }
  EXPECT_EQ(want[0], 0x7f80);
  EXPECT_EQ(want[2], 0x7f80);
  EXPECT_EQ(want[3], 0x3f80);
  EXPECT_EQ(want[6], 0x0002);
  EXPECT_EQ(want[7], 0x0080);
  std::vector<uint16_t> out2(vals.size() * 5);
  Store(DataType::kBFloat16, out2.data(), Repeat(vals, 5).data(), out2.size(), 1);
  ExpectArray(Repeat(want, 5), out2.data(), SameBf16, "bf16 Store");
}

// int32 accumulates exactly in int64; the sum written back wraps (mod 2^32), as int32
// arithmetic would. int64 wraps in its accumulator.
TEST_P(ReduceTest, IntegerOverflowWraps) {
  constexpr int32_t kMax32 = std::numeric_limits<int32_t>::max();
  constexpr int32_t kMin32 = std::numeric_limits<int32_t>::min();
  constexpr int64_t kMax32L = kMax32, kMin32L = kMin32;
  ASSERT_EQ(AccumulatorType(DataType::kInt32), DataType::kInt64);
  const std::vector<int32_t> a = Repeat<int32_t>({kMax32, kMin32, -1, kMax32}, 5);
  const std::vector<int32_t> b = Repeat<int32_t>({1, -1, kMin32, kMax32}, 5);
  std::vector<int64_t> acc(a.size());
  SumTwo(DataType::kInt32, acc.data(), a.data(), b.data(), a.size());
  ExpectArray(Repeat<int64_t>({kMax32L + 1, kMin32L - 1, kMin32L - 1, 2 * kMax32L}, 5),
              acc.data(), [](int64_t e, int64_t x) { return Same(e, x); }, "int32 SumTwo");
  Accumulate(DataType::kInt32, acc.data(), b.data(), b.size());
  ExpectArray(Repeat<int64_t>({kMax32L + 2, kMin32L - 2, 2 * kMin32L - 1, 3 * kMax32L}, 5),
              acc.data(), [](int64_t e, int64_t x) { return Same(e, x); }, "int32 Accumulate");
  std::vector<int32_t> out(a.size());
  Store(DataType::kInt32, out.data(), acc.data(), acc.size(), 1);
  ExpectArray(Repeat<int32_t>({kMin32 + 1, kMax32 - 1, -1, 2147483645}, 5), out.data(),
              [](int32_t e, int32_t x) { return Same(e, x); }, "int32 sum stored");
  std::vector<int64_t> loaded(a.size());
  Load(DataType::kInt32, loaded.data(), a.data(), a.size());
  ExpectArray(Repeat<int64_t>({kMax32L, kMin32L, -1, kMax32L}, 5), loaded.data(),
              [](int64_t e, int64_t x) { return Same(e, x); }, "int32 Load");

  constexpr int64_t kMax64 = std::numeric_limits<int64_t>::max();
  constexpr int64_t kMin64 = std::numeric_limits<int64_t>::min();
  const std::vector<int64_t> c = Repeat<int64_t>({kMax64, kMin64, kMax64}, 5);
  const std::vector<int64_t> d = Repeat<int64_t>({1, -1, kMax64}, 5);
  std::vector<int64_t> acc64(c.size());
  SumTwo(DataType::kInt64, acc64.data(), c.data(), d.data(), c.size());
  ExpectArray(Repeat<int64_t>({kMin64, kMax64, -2}, 5), acc64.data(),
              [](int64_t e, int64_t x) { return Same(e, x); }, "int64 SumTwo");
}

// An integer average is the exact sum divided, truncating toward zero: for int32 that includes
// sums beyond int32 (the average of two INT32_MAX is INT32_MAX, not the -1 of a wrapped sum).
TEST_P(ReduceTest, IntegerAverageTruncatesTowardZero) {
  constexpr int64_t kMax32L = std::numeric_limits<int32_t>::max();
  constexpr int64_t kMin32L = std::numeric_limits<int32_t>::min();
  const std::vector<int64_t> a =
      Repeat<int64_t>({-7, 7, -1, 1, -8, kMin32L, kMax32L, 2 * kMax32L, 2 * kMin32L}, 3);
  std::vector<int32_t> out(a.size());
  Store(DataType::kInt32, out.data(), a.data(), a.size(), 2);
  ExpectArray(Repeat<int32_t>({-3, 3, 0, 0, -4, -1073741824, 1073741823,
                               std::numeric_limits<int32_t>::max(),
                               std::numeric_limits<int32_t>::min()},
                              3),
              out.data(), [](int32_t e, int32_t x) { return Same(e, x); }, "int32 /2");
  // Pushed, summed and averaged as the servers do: two ranks of INT32_MAX average to INT32_MAX.
  const std::vector<int32_t> top(9, std::numeric_limits<int32_t>::max());
  std::vector<int64_t> acc(top.size());
  SumTwo(DataType::kInt32, acc.data(), top.data(), top.data(), top.size());
  Store(DataType::kInt32, out.data(), acc.data(), top.size(), 2);
  for (size_t i = 0; i < top.size(); ++i) EXPECT_EQ(out[i], std::numeric_limits<int32_t>::max());
  const std::vector<int64_t> b =
      Repeat<int64_t>({-7, 7, -5, std::numeric_limits<int64_t>::min()}, 5);
  std::vector<int64_t> out64(b.size());
  Store(DataType::kInt64, out64.data(), b.data(), b.size(), 3);
  ExpectArray(Repeat<int64_t>({-2, 2, -1, -3074457345618258602}, 5), out64.data(),
              [](int64_t e, int64_t x) { return Same(e, x); }, "int64 /3");
  // Divisor bigger than INT32_MAX.
  const std::vector<int64_t> c = {kMin32L, -5, 5};
  std::vector<int32_t> c_out(c.size(), 7);
  Store(DataType::kInt32, c_out.data(), c.data(), c.size(), 3000000000u);
  EXPECT_EQ(c_out, (std::vector<int32_t>{0, 0, 0}));
}

TEST_P(ReduceTest, FloatAverageIsATrueDivision) {
  // Find values where x / 3 and x * (1/3) differ, and check Store gives x / 3.
  std::vector<float> xs;
  std::vector<double> ys;
  Gen g(7);
  const float r = 1.0f / 3.0f;
  const double rd = 1.0 / 3.0;
  while (xs.size() < 40 || ys.size() < 40) {
    const float x = static_cast<float>(g.Uniform(-100.0, 100.0));
    const double y = g.Uniform(-100.0, 100.0);
    if (xs.size() < 40 && x / 3.0f != x * r) xs.push_back(x);
    if (ys.size() < 40 && y / 3.0 != y * rd) ys.push_back(y);
  }
  std::vector<float> out(xs.size());
  Store(DataType::kFloat32, out.data(), xs.data(), xs.size(), 3);
  for (size_t i = 0; i < xs.size(); ++i) EXPECT_EQ(Bits(out[i]), Bits(xs[i] / 3.0f)) << i;
  std::vector<double> out64(ys.size());
  Store(DataType::kFloat64, out64.data(), ys.data(), ys.size(), 3);
  for (size_t i = 0; i < ys.size(); ++i) EXPECT_EQ(Bits(out64[i]), Bits(ys[i] / 3.0)) << i;
}

TEST_P(ReduceTest, DivisorZeroIsAPlainSum) {
  std::vector<int64_t> a = {5, -5, 7, 9, 11, 13, 15, 17, 19};
  std::vector<int32_t> out(a.size());
  Store(DataType::kInt32, out.data(), a.data(), a.size(), 0);
  EXPECT_EQ(out, (std::vector<int32_t>{5, -5, 7, 9, 11, 13, 15, 17, 19}));
  std::vector<float> f = {1.5f, -2.5f, 0.1f};
  std::vector<uint16_t> h(f.size());
  Store(DataType::kFloat16, h.data(), f.data(), f.size(), 0);
  EXPECT_EQ(h, (std::vector<uint16_t>{0x3e00, 0xc100, 0x2e66}));
}

// ------------------------------------------------------------------------------------------
// Scalar conversions against the references.

TEST(ReduceConversionTest, HalfToFloatExhaustive) {
  for (uint32_t h = 0; h <= 0xffff; ++h) {
    const float got = HalfToFloat(static_cast<uint16_t>(h));
    const float want = RefHalfToFloat(static_cast<uint16_t>(h));
    ASSERT_TRUE(Same(want, got)) << "fp16 " << Hex(h);
    if (IsHalfNaN(static_cast<uint16_t>(h))) {
      // Quiet, same sign, payload kept in the high bits.
      EXPECT_EQ(Bits(got) & 0xffc00000u, ((h & 0x8000u) << 16) | 0x7fc00000u) << Hex(h);
      EXPECT_EQ((Bits(got) >> 13) & 0x1ffu, h & 0x1ffu) << Hex(h);
    }
#if defined(__x86_64__) && defined(__FLT16_MAX__)
    const _Float16 hf = std::bit_cast<_Float16>(static_cast<uint16_t>(h));
    ASSERT_TRUE(Same(static_cast<float>(hf), got)) << "_Float16 " << Hex(h);
#endif
  }
}

// Every fp16 value, and the fp32 values at, just below and just above every midpoint between
// two neighbouring fp16 values, plus random fp32 bit patterns.
std::vector<float> HalfBoundaryFloats() {
  std::vector<float> v;
  for (uint32_t h = 0; h < 0x7c00; ++h) {
    const float lo = RefHalfToFloat(static_cast<uint16_t>(h));
    const float hi = h + 1 < 0x7c00 ? RefHalfToFloat(static_cast<uint16_t>(h + 1)) : 65536.0f;
    const float mid = static_cast<float>((static_cast<double>(lo) + hi) / 2);  // exact
    for (float x : {lo, mid, std::nextafter(mid, 0.0f), std::nextafter(mid, 1e9f)}) {
      v.push_back(x);
      v.push_back(-x);
    }
  }
  Gen g(11);
  for (int i = 0; i < 1000000; ++i) v.push_back(F32(static_cast<uint32_t>(g.Bits64())));
  for (uint32_t u : kF32Specials) v.push_back(F32(u));
  for (uint32_t u : kF16StoreSpecials) v.push_back(F32(u));
  return v;
}

TEST(ReduceConversionTest, FloatToHalf) {
  for (float f : HalfBoundaryFloats()) {
    const uint16_t got = FloatToHalf(f);
    ASSERT_TRUE(SameHalf(RefFloatToHalf(f), got)) << "fp32 " << Hex(Bits(f));
    if (std::isnan(f)) {
      EXPECT_EQ(got & 0x8000u, (Bits(f) >> 16) & 0x8000u) << Hex(Bits(f));
    }
#if defined(__x86_64__) && defined(__FLT16_MAX__)
    const uint16_t ref16 = std::bit_cast<uint16_t>(static_cast<_Float16>(f));
    ASSERT_TRUE(SameHalf(ref16, got)) << "_Float16 of fp32 " << Hex(Bits(f));
#endif
  }
}

TEST(ReduceConversionTest, BFloat16) {
  for (uint32_t b = 0; b <= 0xffff; ++b) {
    ASSERT_EQ(Bits(BFloat16ToFloat(static_cast<uint16_t>(b))), b << 16);
  }
  Gen g(13);
  std::vector<float> v;
  for (int i = 0; i < 1000000; ++i) v.push_back(F32(static_cast<uint32_t>(g.Bits64())));
  for (uint32_t b = 0; b <= 0xffff; ++b) {  // every bf16, and the midpoints around it
    for (uint32_t lo : {0x0000u, 0x7fffu, 0x8000u, 0x8001u}) v.push_back(F32((b << 16) | lo));
  }
  for (uint32_t u : kBf16StoreSpecials) v.push_back(F32(u));
  for (float f : v) {
    const uint16_t got = FloatToBFloat16(f);
    ASSERT_TRUE(SameBf16(RefFloatToBf16(f), got)) << "fp32 " << Hex(Bits(f));
    if (std::isnan(f)) {
      EXPECT_EQ(got, static_cast<uint16_t>((Bits(f) >> 16) | 0x40)) << Hex(Bits(f));
    } else {
      ASSERT_EQ(RefFloatToBf16Math(f), got) << "fp32 " << Hex(Bits(f));
    }
  }
}

TEST(ReduceConversionTest, AccumulatorType) {
  EXPECT_EQ(AccumulatorType(DataType::kFloat16), DataType::kFloat32);
  EXPECT_EQ(AccumulatorType(DataType::kBFloat16), DataType::kFloat32);
  EXPECT_EQ(AccumulatorType(DataType::kInt32), DataType::kInt64);
  for (DataType t : {DataType::kFloat32, DataType::kFloat64, DataType::kInt64}) {
    EXPECT_EQ(AccumulatorType(t), t);
  }
}

// ------------------------------------------------------------------------------------------
// The vector implementations against the scalar one, bit for bit (NaN payloads included, but
// for NaN + NaN: see below), on random bit patterns of random lengths and misalignments.

TEST(ReduceDispatchTest, AutoPicksTheBestSupported) {
  ASSERT_TRUE(SetReduceIsaForTesting(ReduceIsa::kAuto));
  const ReduceIsa best = ActiveReduceIsa();
  EXPECT_NE(best, ReduceIsa::kAuto);
  ASSERT_TRUE(SetReduceIsaForTesting(ReduceIsa::kScalar));
  EXPECT_EQ(ActiveReduceIsa(), ReduceIsa::kScalar);
  if (SetReduceIsaForTesting(ReduceIsa::kAvx512)) {
    EXPECT_EQ(best, ReduceIsa::kAvx512);
  } else if (SetReduceIsaForTesting(ReduceIsa::kAvx2)) {
    EXPECT_EQ(best, ReduceIsa::kAvx2);
  } else if (SetReduceIsaForTesting(ReduceIsa::kNeon)) {
    EXPECT_EQ(best, ReduceIsa::kNeon);
  } else {
    EXPECT_EQ(best, ReduceIsa::kScalar);
  }
  ASSERT_TRUE(SetReduceIsaForTesting(ReduceIsa::kAuto));
  EXPECT_EQ(ActiveReduceIsa(), best);
  std::printf("reduce ISA in use: %s\n", IsaName(best).c_str());
}

bool IsNaNAt(DataType t, const unsigned char* p) {
  switch (t) {
    case DataType::kFloat32: {
      float f;
      std::memcpy(&f, p, 4);
      return std::isnan(f);
    }
    case DataType::kFloat64: {
      double d;
      std::memcpy(&d, p, 8);
      return std::isnan(d);
    }
    case DataType::kFloat16:
    case DataType::kBFloat16: {
      uint16_t h;
      std::memcpy(&h, p, 2);
      return t == DataType::kFloat16 ? IsHalfNaN(h) : IsBf16NaN(h);
    }
    case DataType::kInt32:
    case DataType::kInt64: return false;
  }
  return false;
}

// A raw buffer: the comparison below is on bytes.
struct Bytes {
  std::vector<unsigned char> b;
  unsigned char* at(size_t off) { return b.data() + off; }
};

// The vector ISAs this build has (whether this CPU runs them is checked when they are set).
constexpr ReduceIsa kVectorIsas[] = {ReduceIsa::kAvx2, ReduceIsa::kAvx512, ReduceIsa::kNeon};

// fp32 accumulator values for a 16-bit Store that sit exactly on a rounding tie of the 16-bit
// type (and their neighbours one ulp away), so that round-to-nearest-even decides.
float TieF32(DataType t, Gen& g) {
  uint32_t u;
  if (t == DataType::kBFloat16) {
    u = (static_cast<uint32_t>(g.Bits64()) & 0xffff0000u) | 0x8000u;  // bf16 keeps 16 bits
  } else {
    // A normal or subnormal fp16 magnitude; the dropped 13 bits (normal) are exactly half.
    const uint32_t exp = 103 + static_cast<uint32_t>(g.Below(143 - 103));
    u = (static_cast<uint32_t>(g.Bits64()) & 0x807fe000u) | (exp << 23) | 0x1000u;
  }
  switch (g.Below(4)) {
    case 0: --u; break;
    case 1: ++u; break;
    default: break;
  }
  return F32(u);
}

// Runs SumTwo, Accumulate, Load, Store and Store in place on n random elements of t at element
// offset off, once with `isa` and once with the scalar kernels, and fails on the first byte that
// differs (but for the NaN + NaN case below). Returns false if `isa` is not available.
bool CompareWithScalar(ReduceIsa isa, DataType t, size_t n, size_t off, uint32_t divisor, Gen& g,
                       int& nan_nan) {
  if (!SetReduceIsaForTesting(isa)) return false;
  const size_t ws = DataTypeSize(t), as = DataTypeSize(AccumulatorType(t));
  auto random_bytes = [&](size_t count) {
    Bytes r{std::vector<unsigned char>(count)};
    for (auto& c : r.b) c = static_cast<unsigned char>(g.Bits64());
    return r;
  };
  // fp16/bf16 accumulators: also mix in values within the 16-bit types' range, and ties.
  Bytes a = random_bytes((n + 17) * ws), b = random_bytes((n + 17) * ws);
  Bytes acc0 = random_bytes((n + 17) * as);
  if (as == 4 && ws == 2) {
    for (size_t i = 0; i < n + 17; ++i) {
      const size_t kind = g.Below(4);
      if (kind == 0) continue;  // random bits
      const float f = kind == 1 ? TieF32(t, g)
                                : (t == DataType::kFloat16 ? RandomF16Acc(g) : RandomBf16Acc(g));
      std::memcpy(acc0.at(i * 4), &f, 4);
    }
  }

  auto run_all = [&](ReduceIsa which) {
    EXPECT_TRUE(SetReduceIsaForTesting(which));
    std::vector<Bytes> results;
    Bytes acc = acc0;
    SumTwo(t, acc.at(off * as), a.at(off * ws), b.at(off * ws), n);
    results.push_back(acc);
    acc = acc0;
    Accumulate(t, acc.at(off * as), a.at(off * ws), n);
    results.push_back(acc);
    acc = acc0;
    Load(t, acc.at(off * as), a.at(off * ws), n);
    results.push_back(acc);
    Bytes out = b;
    Store(t, out.at(off * ws), acc0.at(off * as), n, divisor);
    results.push_back(out);
    acc = acc0;
    Store(t, acc.at(off * as), acc.at(off * as), n, divisor);
    results.push_back(acc);
    return results;
  };
  const std::vector<Bytes> vec = run_all(isa);
  const std::vector<Bytes> ref = run_all(ReduceIsa::kScalar);
  const char* ops[] = {"SumTwo", "Accumulate", "Load", "Store", "Store in place"};
  for (size_t k = 0; k < ref.size(); ++k) {
    // Element size of what op k writes: accumulators, or wire values for Store.
    const size_t es = k == 3 ? ws : as;
    const DataType et = k == 3 ? t : AccumulatorType(t);
    const auto& x = vec[k].b;
    const auto& y = ref[k].b;
    EXPECT_EQ(x.size(), y.size());
    if (x.size() != y.size()) return true;
    for (size_t j = 0; j * es < x.size(); ++j) {
      if (std::memcmp(&x[j * es], &y[j * es], es) == 0) continue;
      // The one allowed difference: a sum of two NaNs is a NaN, but which operand's payload
      // it carries depends on the operand order the compiler picked (IEEE 754 leaves it
      // open, and compilers treat + as commutative).
      const size_t i = j - off;  // element index within the n processed (wraps if j < off)
      bool both_nan = false;
      if (k <= 1 && j >= off && i < n) {
        const bool first = k == 0 ? IsNaNAt(t, a.at((off + i) * ws))
                                  : IsNaNAt(AccumulatorType(t), acc0.at((off + i) * as));
        const bool second =
            k == 0 ? IsNaNAt(t, b.at((off + i) * ws)) : IsNaNAt(t, a.at((off + i) * ws));
        both_nan = first && second && IsNaNAt(et, &x[j * es]) && IsNaNAt(et, &y[j * es]);
      }
      if (both_nan) {
        ++nan_nan;
        continue;
      }
      ADD_FAILURE() << IsaName(isa) << " " << DataTypeName(t) << " " << ops[k] << " n=" << n
                    << " off=" << off << " d=" << divisor << ": first differing element " << j;
      break;
    }
  }
  return true;
}

TEST(ReduceDispatchTest, VectorMatchesScalarBitForBit) {
  Gen g(17);
  int compared = 0;
  int nan_nan = 0;
  for (ReduceIsa isa : kVectorIsas) {
    if (!SetReduceIsaForTesting(isa)) continue;
    for (int round = 0; round < 40; ++round) {
      for (uint8_t raw = 1; raw <= 6; ++raw) {
        const auto t = static_cast<DataType>(raw);
        const size_t n = round < 10 ? round : (round < 20 ? 4099 : g.Below(3000));
        const size_t off = g.Below(17);  // in elements: every head length to 64-byte alignment
        const uint32_t divisor = static_cast<uint32_t>(g.Pick(std::vector<uint32_t>{1, 2, 3, 5}));
        if (CompareWithScalar(isa, t, n, off, divisor, g, nan_nan)) ++compared;
      }
    }
  }
  SetReduceIsaForTesting(ReduceIsa::kAuto);
  std::printf("NaN + NaN sums whose payload differed: %d\n", nan_nan);
  if (compared == 0) GTEST_SKIP() << "no vector implementation on this CPU";
}

// Every length from 0 to 1000 (every head and tail length of every vector width, both vector
// loops of the 16-bit kernels), each at a random misalignment, every dtype, sum and average.
TEST(ReduceDispatchTest, VectorMatchesScalarEveryLength) {
  Gen g(23);
  int compared = 0;
  int nan_nan = 0;
  for (ReduceIsa isa : kVectorIsas) {
    if (!SetReduceIsaForTesting(isa)) continue;
    for (size_t n = 0; n <= 1000; ++n) {
      for (uint8_t raw = 1; raw <= 6; ++raw) {
        const auto t = static_cast<DataType>(raw);
        const size_t off = g.Below(17);
        const uint32_t divisor = n % 2 == 0 ? 1 : static_cast<uint32_t>(2 + g.Below(6));
        if (CompareWithScalar(isa, t, n, off, divisor, g, nan_nan)) ++compared;
        if (::testing::Test::HasFailure()) {  // one report, not thousands
          SetReduceIsaForTesting(ReduceIsa::kAuto);
          return;
        }
      }
    }
  }
  SetReduceIsaForTesting(ReduceIsa::kAuto);
  std::printf("compared %d runs; NaN + NaN sums whose payload differed: %d\n", compared, nan_nan);
  if (compared == 0) GTEST_SKIP() << "no vector implementation on this CPU";
}

// Integer products wrap as two's complement arithmetic in the tensor's own width does: int32's
// product, formed in the int64 accumulator and narrowed by Store, is the wrapped int32 product.
TEST(ReduceFoldTest, IntegerProductsWrapLikeTheirOwnWidth) {
  const int32_t a[3] = {65536, -7, std::numeric_limits<int32_t>::min()};
  const int32_t b[3] = {65536 + 3, 1 << 30, -1};
  int64_t acc[3];
  Load(DataType::kInt32, acc, a, 3);
  Fold(ReduceOp::kProduct, DataType::kInt32, acc, b, 3);
  int32_t out[3];
  Store(DataType::kInt32, out, acc, 3, 1);
  for (int i = 0; i < 3; ++i) {
    const uint32_t want = static_cast<uint32_t>(a[i]) * static_cast<uint32_t>(b[i]);
    EXPECT_EQ(static_cast<uint32_t>(out[i]), want) << i;
  }
  int64_t x[2] = {std::numeric_limits<int64_t>::max(), -3};
  const int64_t y[2] = {2, std::numeric_limits<int64_t>::min()};
  Fold(ReduceOp::kProduct, DataType::kInt64, x, y, 2);
  EXPECT_EQ(x[0], -2);  // (2^63 - 1) * 2 mod 2^64
  EXPECT_EQ(x[1], std::numeric_limits<int64_t>::min());
}

TEST(ReduceFoldTest, HalfMinMaxIsExactInTheAccumulator) {
  const uint16_t h[2] = {FloatToHalf(-0.5f), FloatToHalf(65504.0f)};
  float acc[2] = {0.25f, 1.0f};
  Fold(ReduceOp::kMin, DataType::kFloat16, acc, h, 2);
  EXPECT_EQ(acc[0], -0.5f);
  EXPECT_EQ(acc[1], 1.0f);
  Fold(ReduceOp::kMax, DataType::kFloat16, acc, h, 2);
  EXPECT_EQ(acc[0], -0.5f);
  EXPECT_EQ(acc[1], 65504.0f);
}

}  // namespace
}  // namespace gradlink::reduce
