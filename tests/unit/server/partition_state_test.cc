// Over 600 lines on purpose: one suite for PartitionState's round protocol (src/server/
// partition_state.h), whose cases share one model of the rounds.
// Tests of the per-(key, partition) round state machine of the server, without any transport:
// rank-order summation that is bit-identical for every arrival order, fp32 accumulation of
// fp16/bf16, averaging, refusal of stale, early and duplicate pushes, mismatched pushes failing
// the whole round for every rank, and the double-buffered accumulator.
#include "server/partition_state.h"
#include "reduce/reduce.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <bit>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <limits>
#include <numeric>
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <vector>

namespace gradlink::server {
namespace {

constexpr uint64_t kKey = 0x1234ABCDull;

template <typename T>
std::vector<std::byte> AsBytes(const std::vector<T>& v) {
  std::vector<std::byte> b(v.size() * sizeof(T));
  if (!b.empty()) std::memcpy(b.data(), v.data(), b.size());
  return b;
}

template <typename T>
std::vector<T> FromBytes(std::span<const std::byte> b) {
  std::vector<T> v(b.size() / sizeof(T));
  if (!v.empty()) std::memcpy(v.data(), b.data(), v.size() * sizeof(T));
  return v;
}

class Harness {
 public:
  Harness(DataType dtype, uint64_t count, uint32_t workers)
      : state_(kKey, 3, "layer.grad", dtype, count, workers), dtype_(dtype), count_(count) {}

  PartitionState& state() { return state_; }

  wire::Header MakePush(uint32_t rank, uint64_t round, uint16_t flags = 0) const {
    wire::Header h;
    h.type = wire::MsgType::kPush;
    h.flags = flags;
    h.sender = rank;
    h.key = kKey;
    h.partition = 3;
    h.dtype = static_cast<uint8_t>(dtype_);
    h.round = round;
    h.count = count_;
    h.payload_bytes = count_ * DataTypeSize(dtype_);
    h.cookie = 1000 * round + rank + 1;
    return h;
  }

  // BeginPush + copy; EndPush is separate so tests can interleave them.
  Status Begin(const wire::Header& h, const std::vector<std::byte>& data, bool* run_engine) {
    Result<std::span<std::byte>> span = state_.BeginPush(h, run_engine);
    if (!span.ok()) return span.status();
    EXPECT_EQ(span->size(), data.size());
    if (span->size() == data.size() && !data.empty()) {
      std::memcpy(span->data(), data.data(), data.size());
    }
    return Status::Ok();
  }

  Status Push(uint32_t rank, uint64_t round, const std::vector<std::byte>& data,
              uint16_t flags = 0) {
    bool run = false;
    Status s = Begin(MakePush(rank, round, flags), data, &run);
    if (s.ok()) state_.EndPush(rank, true);
    return s;
  }

 private:
  PartitionState state_;
  DataType dtype_;
  uint64_t count_;
};

// Frees a completion's slot: one SendDone per worker.
void ReleaseSlot(PartitionState& st, const Completion& c, uint32_t workers) {
  for (uint32_t i = 0; i < workers; ++i) {
    const bool freed = st.SendDone(c.slot);
    EXPECT_EQ(freed, i + 1 == workers) << "SendDone #" << i;
  }
}

// Runs one round: pushes in `order`, calling Progress() after each push; returns the completion
// (expects exactly the last push to complete the round) with its result copied out.
struct Done {
  Completion c;
  std::vector<std::byte> result;
};
Done RunRound(Harness& h, uint64_t round, const std::vector<std::vector<std::byte>>& pushes,
              const std::vector<uint32_t>& order, uint16_t flags = 0) {
  Done d;
  for (size_t i = 0; i < order.size(); ++i) {
    const uint32_t r = order[i];
    Status s = h.Push(r, round, pushes[r], flags);
    EXPECT_TRUE(s.ok()) << s.ToString();
    std::optional<Completion> c = h.state().Progress();
    if (i + 1 < order.size()) {
      EXPECT_FALSE(c.has_value()) << "round completed after " << i + 1 << " pushes";
      if (c) d.c = *c;
    } else {
      EXPECT_TRUE(c.has_value()) << "round not complete after every push";
      if (c) {
        d.c = *c;
        d.result.assign(c->result.begin(), c->result.end());
      }
    }
  }
  return d;
}

// One whole push of `count` elements (0: a requester's) from `sender` into a PartitionState
// without a Harness: BeginPush, the payload copied in, EndPush.
Status PushTo(PartitionState& st, uint32_t sender, uint64_t round, DataType dtype,
              uint64_t count, const void* data = nullptr, bool* runnable = nullptr) {
  wire::Header h;
  h.type = wire::MsgType::kPush;
  h.key = st.key();
  h.partition = st.partition();
  h.sender = sender;
  h.round = round;
  h.dtype = static_cast<uint8_t>(dtype);
  h.count = count;
  h.payload_bytes = count * DataTypeSize(dtype);
  bool run = false;
  Result<std::span<std::byte>> span = st.BeginPush(h, &run);
  if (!span.ok()) return span.status();
  if (data != nullptr && !span->empty()) std::memcpy(span->data(), data, span->size());
  const bool run_engine = st.EndPush(sender, true);
  if (runnable != nullptr) *runnable = run_engine;
  return Status::Ok();
}

std::vector<uint32_t> Iota(uint32_t n) {
  std::vector<uint32_t> v(n);
  std::iota(v.begin(), v.end(), 0u);
  return v;
}

// ---- Rank-order summation --------------------------------------------------------------------

// Per rank values. Element 0 makes the fp32 result depend on the summation order:
// ((1e8 + 1) - 1e8) + 1 = 1 in rank order, but (1e8 - 1e8) + 1 + 1 = 2.
std::vector<std::vector<float>> OrderSensitiveF32(uint32_t workers, size_t n) {
  const float tricky[4] = {1e8f, 1.0f, -1e8f, 1.0f};
  std::mt19937 rng(workers);
  std::uniform_real_distribution<float> dist(-1000.0f, 1000.0f);
  std::vector<std::vector<float>> v(workers, std::vector<float>(n));
  for (uint32_t r = 0; r < workers; ++r) {
    v[r][0] = tricky[r];
    v[r][1] = r == 0 ? 3.0e7f : 0.7f * float(r + 1);  // more absorption-sensitive values
    for (size_t i = 2; i < n; ++i) v[r][i] = dist(rng) * (i % 3 == 0 ? 1e-4f : 1.0f);
  }
  return v;
}

TEST(PartitionStateTest, Fp32SumIsRankOrderForEveryArrivalOrder) {
  constexpr size_t kN = 64;
  for (uint32_t w = 1; w <= 4; ++w) {
    const auto vals = OrderSensitiveF32(w, kN);
    std::vector<std::vector<std::byte>> pushes;
    for (const auto& v : vals) pushes.push_back(AsBytes(v));
    // Scalar reference, strictly in rank order: ((s0 + s1) + s2) + s3 in fp32.
    std::vector<float> ref(kN);
    for (size_t i = 0; i < kN; ++i) {
      float acc = vals[0][i];
      for (uint32_t r = 1; r < w; ++r) acc = acc + vals[r][i];
      ref[i] = acc;
    }
    if (w >= 3) {
      // The test would be vacuous if the order did not matter.
      float alt = vals[0][0] + vals[2][0];
      for (uint32_t r = 1; r < w; ++r) {
        if (r != 2) alt = alt + vals[r][0];
      }
      EXPECT_NE(alt, ref[0]);
    }

    Harness h(DataType::kFloat32, kN, w);
    std::vector<uint32_t> order = Iota(w);
    uint64_t round = 0;
    std::optional<std::vector<std::byte>> first;
    do {
      Done d = RunRound(h, round, pushes, order);
      ASSERT_TRUE(d.c.status.ok()) << d.c.status.ToString();
      EXPECT_EQ(d.c.round, round);
      const std::vector<float> got = FromBytes<float>(d.result);
      ASSERT_EQ(got.size(), kN);
      for (size_t i = 0; i < kN; ++i) {
        EXPECT_EQ(std::bit_cast<uint32_t>(got[i]), std::bit_cast<uint32_t>(ref[i]))
            << "W=" << w << " element " << i << ": " << got[i] << " vs " << ref[i];
      }
      if (!first) first = d.result;
      EXPECT_EQ(*first, d.result) << "not bit-identical across arrival orders";
      // Cookies come back per rank.
      ASSERT_EQ(d.c.cookies.size(), w);
      for (uint32_t r = 0; r < w; ++r) EXPECT_EQ(d.c.cookies[r], 1000 * round + r + 1);
      ReleaseSlot(h.state(), d.c, w);
      ++round;
      EXPECT_EQ(h.state().round(), round);
    } while (std::next_permutation(order.begin(), order.end()));
  }
}

TEST(PartitionStateTest, InterleavedBeginAndEndInAnyOrder) {
  // All headers arrive first (in one order), payloads land in another, Progress() runs between.
  constexpr uint32_t kW = 4;
  constexpr size_t kN = 16;
  const auto vals = OrderSensitiveF32(kW, kN);
  std::vector<std::vector<std::byte>> pushes;
  for (const auto& v : vals) pushes.push_back(AsBytes(v));
  std::vector<float> ref(kN);
  for (size_t i = 0; i < kN; ++i) ref[i] = ((vals[0][i] + vals[1][i]) + vals[2][i]) + vals[3][i];

  Harness h(DataType::kFloat32, kN, kW);
  std::vector<uint32_t> begin_order = Iota(kW);
  uint64_t round = 0;
  do {
    std::vector<uint32_t> end_order(begin_order.rbegin(), begin_order.rend());
    std::rotate(end_order.begin(), end_order.begin() + 1, end_order.end());
    for (uint32_t r : begin_order) {
      bool run = false;
      ASSERT_TRUE(h.Begin(h.MakePush(r, round), pushes[r], &run).ok());
      EXPECT_FALSE(run);
      EXPECT_FALSE(h.state().Progress().has_value());  // nothing has landed yet
    }
    std::optional<Completion> c;
    for (size_t i = 0; i < kW; ++i) {
      h.state().EndPush(end_order[i], true);
      c = h.state().Progress();
      EXPECT_EQ(c.has_value(), i + 1 == kW);
      EXPECT_FALSE(h.state().Progress().has_value());  // idempotent
    }
    ASSERT_TRUE(c.has_value());
    ASSERT_TRUE(c->status.ok());
    const std::vector<float> got = FromBytes<float>(c->result);
    for (size_t i = 0; i < kN; ++i) {
      EXPECT_EQ(std::bit_cast<uint32_t>(got[i]), std::bit_cast<uint32_t>(ref[i])) << i;
    }
    ReleaseSlot(h.state(), *c, kW);
    ++round;
  } while (std::next_permutation(begin_order.begin(), begin_order.end()));
}

TEST(PartitionStateTest, ProgressOnlyAtTheEnd) {
  // The engine may run once, after every push has landed.
  constexpr uint32_t kW = 3;
  Harness h(DataType::kFloat32, 1, kW);
  const std::vector<std::vector<std::byte>> pushes = {
      AsBytes(std::vector<float>{1e8f}), AsBytes(std::vector<float>{1.0f}),
      AsBytes(std::vector<float>{-1e8f})};
  for (uint32_t r : {2u, 0u, 1u}) ASSERT_TRUE(h.Push(r, 0, pushes[r]).ok());
  std::optional<Completion> c = h.state().Progress();
  ASSERT_TRUE(c.has_value());
  EXPECT_EQ(FromBytes<float>(c->result)[0], 0.0f);  // (1e8 + 1) - 1e8 in fp32
}

// ---- What a partition holds: the figure the scheduler admits keys by --------------------------

TEST(PartitionStateTest, RankZeroIntoTheAccumulatorOrStagedGivesTheSameBits) {
  // 3 workers, order-sensitive fp32 values. Rounds 0 and 1 find their accumulator free (rank
  // 0's push lands in it); round 2 comes while round 0's result is still being sent from slot
  // 0, so rank 0 is staged. All three sums must be the rank-order reference, bit for bit.
  constexpr uint32_t kW = 3;
  constexpr size_t kN = 64;
  const auto vals = OrderSensitiveF32(kW, kN);
  std::vector<std::vector<std::byte>> pushes;
  for (const auto& v : vals) pushes.push_back(AsBytes(v));
  std::vector<float> ref(kN);
  for (size_t i = 0; i < kN; ++i) ref[i] = (vals[0][i] + vals[1][i]) + vals[2][i];
  Harness h(DataType::kFloat32, kN, kW);
  Done d0 = RunRound(h, 0, pushes, {2, 0, 1});
  Done d1 = RunRound(h, 1, pushes, {0, 1, 2});
  ReleaseSlot(h.state(), d1.c, kW);
  const uint64_t before = h.state().bytes_held();
  EXPECT_EQ(before, (2 /*staging 1, 2*/ + 2 /*accumulators*/) * kN * 4);
  // Round 2: slot 0 still sends round 0's result.
  for (uint32_t r : {1u, 0u, 2u}) ASSERT_TRUE(h.Push(r, 2, pushes[r]).ok());
  EXPECT_EQ(h.state().bytes_held(), before + kN * 4);  // rank 0 staged
  EXPECT_FALSE(h.state().Progress().has_value());      // waits for slot 0
  ReleaseSlot(h.state(), d0.c, kW);
  std::optional<Completion> c2 = h.state().Progress();
  ASSERT_TRUE(c2.has_value());
  ASSERT_TRUE(c2->status.ok()) << c2->status.ToString();
  for (const Done* d : {&d0, &d1}) {
    ASSERT_TRUE(d->c.status.ok());
    const auto got = FromBytes<float>(d->result);
    for (size_t i = 0; i < kN; ++i) {
      ASSERT_EQ(std::bit_cast<uint32_t>(got[i]), std::bit_cast<uint32_t>(ref[i])) << i;
    }
  }
  const auto got2 = FromBytes<float>(c2->result);
  for (size_t i = 0; i < kN; ++i) {
    ASSERT_EQ(std::bit_cast<uint32_t>(got2[i]), std::bit_cast<uint32_t>(ref[i])) << i;
  }
}

TEST(PartitionStateTest, HoldsExactlyServerBytesHeldOnceBothSlotsAreUsed) {
  constexpr uint64_t kCount = 37;
  for (DataType t : {DataType::kFloat32, DataType::kFloat64, DataType::kFloat16,
                     DataType::kBFloat16, DataType::kInt32, DataType::kInt64}) {
    for (uint32_t workers : {1u, 2u, 5u}) {
      SCOPED_TRACE(std::string(DataTypeName(t)) + " x " + std::to_string(workers));
      Harness h(t, kCount, workers);
      EXPECT_EQ(h.state().bytes_held(), 0u);  // nothing until a push comes
      const std::vector<std::vector<std::byte>> pushes(
          workers, std::vector<std::byte>(kCount * DataTypeSize(t)));
      // Rounds 0 and 1 use both accumulator slots; round 2 reuses slot 0 and grows nothing.
      for (uint64_t round = 0; round < 3; ++round) {
        Done d = RunRound(h, round, pushes, Iota(workers));
        ASSERT_TRUE(d.c.status.ok()) << d.c.status.ToString();
        ReleaseSlot(h.state(), d.c, workers);
        if (round == 0) {
          EXPECT_LT(h.state().bytes_held(), reduce::ServerBytesHeld(t, kCount, workers));
        }
      }
      // Every round found its accumulator free, so where it has the wire dtype rank 0's pushes
      // landed in it and rank 0 has no staging buffer.
      const bool direct = reduce::AccumulatorType(t) == t;
      EXPECT_EQ(h.state().bytes_held(), reduce::ServerBytesHeld(t, kCount, workers) -
                                            (direct ? kCount * DataTypeSize(t) : 0));
    }
  }
  // By hand, for 2 workers: fp32 holds 2 staging + 2 accumulators; fp16 2 staging (2 bytes), 2
  // fp32 accumulators and 2 fp16 results; int32 2 staging, 2 int64 accumulators, 2 results.
  EXPECT_EQ(reduce::ServerBytesHeld(DataType::kFloat32, 1, 2), 16u);
  EXPECT_EQ(reduce::ServerBytesHeld(DataType::kFloat16, 1, 2), 16u);
  EXPECT_EQ(reduce::ServerBytesHeld(DataType::kInt32, 1, 2), 32u);
  EXPECT_EQ(reduce::ServerBytesHeld(DataType::kFloat32, uint64_t{1} << 62, 64), UINT64_MAX);
}

TEST(PartitionStateTest, Fp64SumIsRankOrder) {
  constexpr uint32_t kW = 4;
  const std::vector<std::vector<double>> vals = {{1e17, 0.1}, {1.0, 0.2}, {-1e17, 0.3}, {1.0, 0.4}};
  std::vector<std::vector<std::byte>> pushes;
  for (const auto& v : vals) pushes.push_back(AsBytes(v));
  std::vector<double> ref(2);
  for (size_t i = 0; i < 2; ++i) ref[i] = ((vals[0][i] + vals[1][i]) + vals[2][i]) + vals[3][i];
  Harness h(DataType::kFloat64, 2, kW);
  std::vector<uint32_t> order = Iota(kW);
  uint64_t round = 0;
  do {
    Done d = RunRound(h, round++, pushes, order);
    ASSERT_TRUE(d.c.status.ok());
    const auto got = FromBytes<double>(d.result);
    EXPECT_EQ(std::bit_cast<uint64_t>(got[0]), std::bit_cast<uint64_t>(ref[0]));
    EXPECT_EQ(std::bit_cast<uint64_t>(got[1]), std::bit_cast<uint64_t>(ref[1]));
    ReleaseSlot(h.state(), d.c, kW);
  } while (std::next_permutation(order.begin(), order.end()));
}

TEST(PartitionStateTest, IntegersWrap) {
  Harness h(DataType::kInt32, 2, 2);
  const int32_t kMax = std::numeric_limits<int32_t>::max();
  Done d = RunRound(h, 0,
                    {AsBytes(std::vector<int32_t>{kMax, -5}), AsBytes(std::vector<int32_t>{1, 3})},
                    {1, 0});
  ASSERT_TRUE(d.c.status.ok());
  EXPECT_EQ(FromBytes<int32_t>(d.result), (std::vector<int32_t>{std::numeric_limits<int32_t>::min(), -2}));

  Harness h64(DataType::kInt64, 1, 3);
  const int64_t kMax64 = std::numeric_limits<int64_t>::max();
  Done d64 = RunRound(h64, 0,
                      {AsBytes(std::vector<int64_t>{kMax64}), AsBytes(std::vector<int64_t>{2}),
                       AsBytes(std::vector<int64_t>{-1})},
                      {2, 1, 0});
  ASSERT_TRUE(d64.c.status.ok());
  EXPECT_EQ(FromBytes<int64_t>(d64.result)[0], std::numeric_limits<int64_t>::min());
}

// ---- fp16 / bf16 accumulate in fp32 ----------------------------------------------------------

// binary16 bit patterns.
constexpr uint16_t kH1 = 0x3C00;     // 1
constexpr uint16_t kH3 = 0x4200;     // 3
constexpr uint16_t kH2048 = 0x6800;  // 2048 (spacing 2 from here)
constexpr uint16_t kH2050 = 0x6801;
constexpr uint16_t kH2052 = 0x6802;
// bfloat16 bit patterns.
constexpr uint16_t kB1 = 0x3F80;    // 1
constexpr uint16_t kB256 = 0x4380;  // 256 (spacing 2 from here)
constexpr uint16_t kB258 = 0x4381;

TEST(PartitionStateTest, Fp16AccumulatesInFp32) {
  // 2048 + 1 + 1: in fp16 each +1 would round away (2049 ties to 2048); in fp32 the sum is 2050,
  // which fp16 holds exactly. Every arrival order gives the same bits.
  const std::vector<std::vector<std::byte>> pushes = {AsBytes(std::vector<uint16_t>{kH2048, kH1}),
                                                      AsBytes(std::vector<uint16_t>{kH1, kH1}),
                                                      AsBytes(std::vector<uint16_t>{kH1, kH1})};
  Harness h(DataType::kFloat16, 2, 3);
  std::vector<uint32_t> order = Iota(3);
  uint64_t round = 0;
  do {
    Done d = RunRound(h, round++, pushes, order);
    ASSERT_TRUE(d.c.status.ok());
    ASSERT_EQ(d.result.size(), 4u);  // returned in the wire dtype
    EXPECT_EQ(FromBytes<uint16_t>(d.result), (std::vector<uint16_t>{kH2050, kH3}));
    ReleaseSlot(h.state(), d.c, 3);
  } while (std::next_permutation(order.begin(), order.end()));
}

TEST(PartitionStateTest, Fp16RoundsOnceToNearestEven) {
  // 2048 + 1 = 2049: a tie between 2048 and 2050, to even -> 2048.
  // 2048 + 3 = 2051: a tie between 2050 and 2052, to even -> 2052.
  Harness h(DataType::kFloat16, 2, 2);
  Done d = RunRound(h, 0,
                    {AsBytes(std::vector<uint16_t>{kH2048, kH2048}),
                     AsBytes(std::vector<uint16_t>{kH1, kH3})},
                    {0, 1});
  ASSERT_TRUE(d.c.status.ok());
  EXPECT_EQ(FromBytes<uint16_t>(d.result), (std::vector<uint16_t>{kH2048, kH2052}));
}

TEST(PartitionStateTest, Bf16AccumulatesInFp32) {
  const std::vector<std::vector<std::byte>> pushes = {AsBytes(std::vector<uint16_t>{kB256}),
                                                      AsBytes(std::vector<uint16_t>{kB1}),
                                                      AsBytes(std::vector<uint16_t>{kB1})};
  Harness h(DataType::kBFloat16, 1, 3);
  std::vector<uint32_t> order = Iota(3);
  uint64_t round = 0;
  do {
    Done d = RunRound(h, round++, pushes, order);
    ASSERT_TRUE(d.c.status.ok());
    EXPECT_EQ(FromBytes<uint16_t>(d.result), (std::vector<uint16_t>{kB258}));
    ReleaseSlot(h.state(), d.c, 3);
  } while (std::next_permutation(order.begin(), order.end()));
}

// ---- Average ---------------------------------------------------------------------------------

TEST(PartitionStateTest, Average) {
  {
    Harness h(DataType::kFloat32, 2, 4);
    Done d = RunRound(h, 0,
                      {AsBytes(std::vector<float>{1, -8}), AsBytes(std::vector<float>{2, 0}),
                       AsBytes(std::vector<float>{3, 0}), AsBytes(std::vector<float>{4, 2})},
                      {3, 1, 0, 2}, wire::kFlagAverage);
    ASSERT_TRUE(d.c.status.ok()) << d.c.status.ToString();
    EXPECT_EQ(FromBytes<float>(d.result), (std::vector<float>{2.5f, -1.5f}));
  }
  {
    // fp16: (2048 + 1 + 1) / 3 = 683.33 in fp32, rounded once to fp16: 683.5 (0x6157).
    Harness h(DataType::kFloat16, 1, 3);
    Done d = RunRound(h, 0,
                      {AsBytes(std::vector<uint16_t>{kH2048}), AsBytes(std::vector<uint16_t>{kH1}),
                       AsBytes(std::vector<uint16_t>{kH1})},
                      {1, 2, 0}, wire::kFlagAverage);
    ASSERT_TRUE(d.c.status.ok());
    EXPECT_EQ(FromBytes<uint16_t>(d.result)[0], 0x6157);
  }
  {
    // Integer averages truncate toward zero.
    Harness h(DataType::kInt32, 2, 2);
    Done d = RunRound(h, 0, {AsBytes(std::vector<int32_t>{-7, 7}), AsBytes(std::vector<int32_t>{0, 0})},
                      {0, 1}, wire::kFlagAverage);
    ASSERT_TRUE(d.c.status.ok());
    EXPECT_EQ(FromBytes<int32_t>(d.result), (std::vector<int32_t>{-3, 3}));
  }
  {
    // One worker: the average is the value.
    Harness h(DataType::kFloat64, 1, 1);
    Done d = RunRound(h, 0, {AsBytes(std::vector<double>{0.1})}, {0}, wire::kFlagAverage);
    ASSERT_TRUE(d.c.status.ok());
    EXPECT_EQ(FromBytes<double>(d.result)[0], 0.1);
  }
}

TEST(PartitionStateTest, AverageFlagDisagreementIsAMismatch) {
  Harness h(DataType::kFloat32, 1, 2);
  const auto one = AsBytes(std::vector<float>{1});
  ASSERT_TRUE(h.Push(0, 0, one, wire::kFlagAverage).ok());
  EXPECT_FALSE(h.state().Progress().has_value());
  ASSERT_TRUE(h.Push(1, 0, one, 0).ok());
  std::optional<Completion> c = h.state().Progress();
  ASSERT_TRUE(c.has_value());
  EXPECT_EQ(c->status.code(), Code::kMismatch);
  EXPECT_NE(c->status.message().find("rank 1"), std::string::npos) << c->status.message();
}

// ---- Refused pushes --------------------------------------------------------------------------

TEST(PartitionStateTest, PushForTheWrongRoundIsRefused) {
  Harness h(DataType::kFloat32, 1, 2);
  const auto v = AsBytes(std::vector<float>{1});
  bool run = true;
  // Early: round 1 while the server sums round 0.
  Status s = h.Begin(h.MakePush(0, 1), v, &run);
  EXPECT_EQ(s.code(), Code::kProtocolError) << s.ToString();
  EXPECT_FALSE(run);
  s = h.Begin(h.MakePush(0, std::numeric_limits<uint64_t>::max()), v, &run);
  EXPECT_EQ(s.code(), Code::kProtocolError);
  // Round 0 completes normally; a stale round-0 push is then refused too.
  Done d = RunRound(h, 0, {v, v}, {1, 0});
  ASSERT_TRUE(d.c.status.ok());
  EXPECT_EQ(FromBytes<float>(d.result)[0], 2.0f);
  ReleaseSlot(h.state(), d.c, 2);
  s = h.Begin(h.MakePush(1, 0), v, &run);
  EXPECT_EQ(s.code(), Code::kProtocolError) << s.ToString();
  EXPECT_NE(s.message().find("round 0"), std::string::npos) << s.message();
  EXPECT_FALSE(run);
  // Round 1 is unaffected.
  Done d1 = RunRound(h, 1, {v, v}, {0, 1});
  ASSERT_TRUE(d1.c.status.ok());
  EXPECT_EQ(FromBytes<float>(d1.result)[0], 2.0f);
}

TEST(PartitionStateTest, PushTwiceInOneRoundIsRefused) {
  Harness h(DataType::kFloat32, 1, 2);
  const auto one = AsBytes(std::vector<float>{1});
  const auto hundred = AsBytes(std::vector<float>{100});
  bool run = true;
  ASSERT_TRUE(h.Push(0, 0, one).ok());
  // Again after landing...
  Status s = h.Begin(h.MakePush(0, 0), hundred, &run);
  EXPECT_EQ(s.code(), Code::kProtocolError) << s.ToString();
  EXPECT_NE(s.message().find("twice"), std::string::npos) << s.message();
  EXPECT_FALSE(run);
  // ...and while the first is still being received.
  ASSERT_TRUE(h.Begin(h.MakePush(1, 0), one, &run).ok());
  s = h.Begin(h.MakePush(1, 0), hundred, &run);
  EXPECT_EQ(s.code(), Code::kProtocolError);
  h.state().EndPush(1, true);
  // The refused pushes changed nothing.
  std::optional<Completion> c = h.state().Progress();
  ASSERT_TRUE(c.has_value());
  ASSERT_TRUE(c->status.ok());
  EXPECT_EQ(FromBytes<float>(c->result)[0], 2.0f);
}

TEST(PartitionStateTest, PushFromUnknownRankIsRefused) {
  Harness h(DataType::kFloat32, 1, 2);
  bool run = true;
  for (uint32_t rank : {2u, 1000u, 0xFFFFFFFFu}) {
    Status s = h.Begin(h.MakePush(rank, 0), AsBytes(std::vector<float>{1}), &run);
    EXPECT_EQ(s.code(), Code::kProtocolError) << rank;
    EXPECT_FALSE(run);
  }
  h.state().EndPush(2, true);  // ignored: out of range
  h.state().EndPush(0, true);  // ignored: rank 0 has not begun a push
  EXPECT_FALSE(h.state().Progress().has_value());
}

// ---- Mismatched pushes fail the round for everyone -------------------------------------------

struct BadPush {
  const char* what;
  DataType dtype;  // as pushed
  uint8_t raw_dtype;
  uint64_t count;
};

TEST(PartitionStateTest, MismatchedPushFailsTheWholeRound) {
  const BadPush bads[] = {
      {"count", DataType::kFloat32, 1, 5},
      {"dtype", DataType::kInt32, 5, 4},
      {"dtype and count", DataType::kFloat64, 2, 2},
      {"invalid dtype", DataType::kFloat32, 9, 4},
  };
  for (uint32_t w = 1; w <= 4; ++w) {
    for (const BadPush& bad : bads) {
      for (uint32_t bad_rank = 0; bad_rank < w; ++bad_rank) {
        std::vector<uint32_t> order = Iota(w);
        do {
          SCOPED_TRACE(std::string(bad.what) + " W=" + std::to_string(w) + " bad rank " +
                       std::to_string(bad_rank));
          Harness h(DataType::kFloat32, 4, w);
          const auto good = AsBytes(std::vector<float>{1, 2, 3, 4});
          std::optional<Completion> c;
          for (size_t i = 0; i < order.size(); ++i) {
            const uint32_t r = order[i];
            if (r == bad_rank) {
              wire::Header hd = h.MakePush(r, 0);
              hd.dtype = bad.raw_dtype;
              hd.count = bad.count;
              bool run = false;
              Result<std::span<std::byte>> span = h.state().BeginPush(hd, &run);
              ASSERT_FALSE(span.ok());
              EXPECT_EQ(span.status().code(), Code::kMismatch);
              EXPECT_TRUE(run);  // the engine must look: the round may be over now
            } else {
              ASSERT_TRUE(h.Push(r, 0, good).ok());
            }
            c = h.state().Progress();
            EXPECT_EQ(c.has_value(), i + 1 == order.size()) << "after push " << i;
            if (c.has_value()) break;
          }
          ASSERT_TRUE(c.has_value()) << "the round hangs";
          EXPECT_EQ(c->status.code(), Code::kMismatch);
          const std::string& msg = c->status.message();
          EXPECT_NE(msg.find("rank " + std::to_string(bad_rank)), std::string::npos) << msg;
          EXPECT_NE(msg.find("0x00000000" "1234abcd"), std::string::npos) << msg;
          EXPECT_NE(msg.find("layer.grad"), std::string::npos) << msg;
          EXPECT_TRUE(c->result.empty());
          ASSERT_EQ(c->cookies.size(), w);  // every rank gets the error
          for (uint32_t r = 0; r < w; ++r) EXPECT_EQ(c->cookies[r], r + 1);

          // The next round works.
          ReleaseSlot(h.state(), *c, w);
          EXPECT_EQ(h.state().round(), 1u);
          std::vector<std::vector<std::byte>> pushes(w, good);
          Done d = RunRound(h, 1, pushes, Iota(w));
          ASSERT_TRUE(d.c.status.ok()) << d.c.status.ToString();
          const auto got = FromBytes<float>(d.result);
          for (size_t i = 0; i < 4; ++i) EXPECT_EQ(got[i], float(w) * float(i + 1));
        } while (w <= 3 && std::next_permutation(order.begin(), order.end()));
      }
    }
  }
}

TEST(PartitionStateTest, FailedReceiveFailsTheRound) {
  Harness h(DataType::kFloat32, 1, 3);
  const auto v = AsBytes(std::vector<float>{1});
  ASSERT_TRUE(h.Push(0, 0, v).ok());
  ASSERT_TRUE(h.Push(1, 0, v).ok());
  EXPECT_FALSE(h.state().Progress().has_value());  // ranks 0 and 1 summed
  bool run = false;
  ASSERT_TRUE(h.Begin(h.MakePush(2, 0), v, &run).ok());
  h.state().EndPush(2, false);
  std::optional<Completion> c = h.state().Progress();
  ASSERT_TRUE(c.has_value());
  EXPECT_FALSE(c->status.ok());
  EXPECT_NE(c->status.message().find("rank 2"), std::string::npos) << c->status.message();
  ReleaseSlot(h.state(), *c, 3);
  Done d = RunRound(h, 1, {v, v, v}, {2, 1, 0});
  ASSERT_TRUE(d.c.status.ok());
  EXPECT_EQ(FromBytes<float>(d.result)[0], 3.0f);
}

// ---- Double-buffered accumulator -------------------------------------------------------------

TEST(PartitionStateTest, DoubleBufferedRounds) {
  for (DataType t : {DataType::kFloat32, DataType::kFloat16}) {
    SCOPED_TRACE(std::string(DataTypeName(t)));
    constexpr uint32_t kW = 2;
    auto value = [t](float f) {
      if (t == DataType::kFloat32) return AsBytes(std::vector<float>{f, f});
      // Small integers in fp16: 1 -> 0x3C00, 2 -> 0x4000, 4 -> 0x4400, 8 -> 0x4800.
      const uint16_t bits = f == 1 ? 0x3C00 : f == 2 ? 0x4000 : f == 4 ? 0x4400 : 0x4800;
      return AsBytes(std::vector<uint16_t>{bits, bits});
    };
    auto expect_value = [t](std::span<const std::byte> r, float f) {
      if (t == DataType::kFloat32) {
        EXPECT_EQ(FromBytes<float>(r), (std::vector<float>{f, f}));
      } else {
        const uint16_t bits = f == 2 ? 0x4000 : f == 4 ? 0x4400 : f == 8 ? 0x4800 : 0x4C00;
        EXPECT_EQ(FromBytes<uint16_t>(r), (std::vector<uint16_t>{bits, bits}));
      }
    };
    Harness h(t, 2, kW);
    // Round 0 = 1 + 1 = 2 (slot 0).
    Done d0 = RunRound(h, 0, {value(1), value(1)}, {0, 1});
    ASSERT_TRUE(d0.c.status.ok());
    const std::span<const std::byte> live0 = d0.c.result;  // what the sends are reading
    expect_value(live0, 2);
    EXPECT_EQ(h.state().round(), 1u);

    // Round 1 = 2 + 2 = 4 is summed while round 0's sends are pending (slot 1).
    Done d1 = RunRound(h, 1, {value(2), value(2)}, {1, 0});
    ASSERT_TRUE(d1.c.status.ok());
    EXPECT_NE(d1.c.slot, d0.c.slot);
    expect_value(d1.c.result, 4);
    expect_value(live0, 2);  // round 0's result untouched
    EXPECT_EQ(h.state().round(), 2u);

    // Round 2 = 4 + 4 = 8 needs slot 0: pushes are accepted, but it cannot complete yet.
    ASSERT_TRUE(h.Push(0, 2, value(4)).ok());
    EXPECT_FALSE(h.state().Progress().has_value());
    ASSERT_TRUE(h.Push(1, 2, value(4)).ok());
    EXPECT_FALSE(h.state().Progress().has_value());
    expect_value(live0, 2);  // still untouched: the sends of round 0 may still read it
    // A third round can't be pushed before round 2 completes.
    bool run = false;
    EXPECT_EQ(h.Begin(h.MakePush(0, 3), value(8), &run).code(), Code::kProtocolError);

    // Round 1's sends finishing frees slot 1, not slot 0: round 2 still waits.
    ReleaseSlot(h.state(), d1.c, kW);
    EXPECT_FALSE(h.state().Progress().has_value());
    // First of round 0's two sends.
    EXPECT_FALSE(h.state().SendDone(d0.c.slot));
    EXPECT_FALSE(h.state().Progress().has_value());
    // The last one frees slot 0: round 2 completes.
    EXPECT_TRUE(h.state().SendDone(d0.c.slot));
    std::optional<Completion> c2 = h.state().Progress();
    ASSERT_TRUE(c2.has_value());
    ASSERT_TRUE(c2->status.ok());
    EXPECT_EQ(c2->round, 2u);
    EXPECT_EQ(c2->slot, d0.c.slot);
    expect_value(c2->result, 8);
    EXPECT_EQ(h.state().round(), 3u);
  }
}

// EndPush() says when the engine has nothing to do, so the server skips that wake-up; a false
// must be exact (Progress() then changes nothing), a true may be conservative.
TEST(PartitionStateTest, EndPushSaysWhenProgressHasWork) {
  constexpr uint32_t kW = 3;
  Harness h(DataType::kFloat32, 4, kW);
  const auto value = [](float v) { return AsBytes(std::vector<float>(4, v)); };
  bool run = false;
  // Rank 2 first: ranks 0 and 1 are missing, nothing to sum.
  ASSERT_TRUE(h.Begin(h.MakePush(2, 0), value(4), &run).ok());
  EXPECT_FALSE(h.state().EndPush(2, true));
  // Rank 0 alone: the first step needs ranks 0 and 1 together.
  ASSERT_TRUE(h.Begin(h.MakePush(0, 0), value(1), &run).ok());
  EXPECT_FALSE(h.state().EndPush(0, true));
  EXPECT_FALSE(h.state().Progress().has_value());
  // Rank 1: all three can be summed and the round completes.
  ASSERT_TRUE(h.Begin(h.MakePush(1, 0), value(2), &run).ok());
  EXPECT_TRUE(h.state().EndPush(1, true));
  std::optional<Completion> c = h.state().Progress();
  ASSERT_TRUE(c.has_value());
  ASSERT_TRUE(c->status.ok());
  EXPECT_EQ(FromBytes<float>(c->result), std::vector<float>(4, 7.0f));
  // Round 1 uses slot 1, so freeing slot 0 needs no engine run; round 2 will wait for slot 0.
  EXPECT_FALSE(h.state().WaitsForSlot(c->slot));
  EXPECT_TRUE(h.state().WaitsForSlot(1 - c->slot));
  ReleaseSlot(h.state(), *c, kW);

  // Round 1: rank 0 then 1 can be summed at once (a partial sum); a failed push completes the
  // round (with an error), so it asks for the engine too.
  ASSERT_TRUE(h.Begin(h.MakePush(1, 1), value(2), &run).ok());
  EXPECT_FALSE(h.state().EndPush(1, true));
  ASSERT_TRUE(h.Begin(h.MakePush(0, 1), value(1), &run).ok());
  EXPECT_TRUE(h.state().EndPush(0, true));
  EXPECT_FALSE(h.state().Progress().has_value());  // sums ranks 0 and 1, waits for rank 2
  ASSERT_TRUE(h.Begin(h.MakePush(2, 1), value(4), &run).ok());
  EXPECT_TRUE(h.state().EndPush(2, false));
  c = h.state().Progress();
  ASSERT_TRUE(c.has_value());
  EXPECT_EQ(c->status.code(), Code::kPeerLost) << c->status.ToString();
  // EndPush of a rank that has no push in flight changes nothing.
  EXPECT_FALSE(h.state().EndPush(0, true));
  EXPECT_FALSE(h.state().EndPush(kW, true));
}

TEST(PartitionStateTest, SendDoneWithoutPendingSends) {
  Harness h(DataType::kFloat32, 1, 2);
  EXPECT_FALSE(h.state().SendDone(0));
  EXPECT_FALSE(h.state().SendDone(1));
  EXPECT_FALSE(h.state().SendDone(2));
  EXPECT_FALSE(h.state().SendDone(0xFFFFFFFFu));
}

TEST(PartitionStateTest, ManyRoundsWithAlternatingSlots) {
  constexpr uint32_t kW = 3;
  Harness h(DataType::kFloat32, 8, kW);
  std::mt19937 rng(5);
  for (uint64_t round = 0; round < 100; ++round) {
    std::vector<std::vector<float>> vals(kW, std::vector<float>(8));
    for (auto& v : vals)
      for (float& x : v) x = float(rng() % 1000) / 8.0f;
    std::vector<std::vector<std::byte>> pushes;
    for (const auto& v : vals) pushes.push_back(AsBytes(v));
    std::vector<uint32_t> order = Iota(kW);
    std::shuffle(order.begin(), order.end(), rng);
    Done d = RunRound(h, round, pushes, order);
    ASSERT_TRUE(d.c.status.ok());
    EXPECT_EQ(d.c.slot, round % 2);
    const auto got = FromBytes<float>(d.result);
    for (size_t i = 0; i < 8; ++i) EXPECT_EQ(got[i], (vals[0][i] + vals[1][i]) + vals[2][i]);
    ReleaseSlot(h.state(), d.c, kW);
  }
}

// Routing (control/layout.h): a relay's one contributor (rank 2) and its requesters (0, 1, 3)
// that push 0 elements; the round ends once all have pushed, the result is rank 2's push as it
// came (fp16, no widening), and only the requesters receive it.
TEST(PartitionStateRoutingTest, RelayWaitsForEveryRequesterAndAnswersEachParticipant) {
  Routing routing{ReduceOp::kSum, true, {0, 1, 3}, {false, true, true, true}};
  PartitionState p(kKey, 0, "bcast", DataType::kFloat16, 4, {2}, 4, {}, routing);
  ASSERT_EQ(p.participants(), (std::vector<uint32_t>{2, 0, 1, 3}));
  EXPECT_FALSE(p.receives(0));
  EXPECT_TRUE(p.receives(3));
  auto push = [&](uint32_t rank, uint64_t count, const std::vector<uint16_t>& data,
                  uint64_t round = 0) {
    wire::Header h;
    h.type = wire::MsgType::kPush;
    h.round = round;
    h.sender = rank;
    h.key = kKey;
    h.dtype = static_cast<uint8_t>(DataType::kFloat16);
    h.count = count;
    h.payload_bytes = count * 2;
    h.cookie = 100 + rank;
    bool run = false;
    auto span = p.BeginPush(h, &run);
    if (!span.ok()) return span.status();
    EXPECT_EQ(span->size(), count * 2);
    if (count) std::memcpy(span->data(), data.data(), count * 2);
    p.EndPush(rank, true);
    return Status::Ok();
  };
  const std::vector<uint16_t> nan_payload = {0x7e01, 0x8000, 0x3c00, 0xfbff};  // NaN bits kept
  ASSERT_TRUE(push(0, 0, {}).ok());
  ASSERT_TRUE(push(2, 4, nan_payload).ok());
  ASSERT_TRUE(push(1, 0, {}).ok());
  EXPECT_FALSE(p.Progress().has_value());  // rank 3 has not asked yet
  ASSERT_TRUE(push(3, 0, {}).ok());
  std::optional<Completion> c = p.Progress();
  ASSERT_TRUE(c.has_value());
  ASSERT_TRUE(c->status.ok()) << c->status.ToString();
  EXPECT_EQ(FromBytes<uint16_t>(c->result), nan_payload);
  EXPECT_EQ(std::vector<uint64_t>(c->cookies.begin(), c->cookies.end()),
            (std::vector<uint64_t>{102, 100, 101, 103}));
  // A requester that pushes elements fails the next round for everyone, naming it.
  for (int i = 0; i < 4; ++i) p.SendDone(c->slot);
  EXPECT_EQ(push(1, 4, nan_payload, 1).code(), Code::kMismatch);
}

// Min over three contributors in rank order, int32 in the int64 accumulator.
TEST(PartitionStateRoutingTest, MinFoldsInRankOrder) {
  Routing routing{ReduceOp::kMin, false, {}, {}};
  PartitionState p(kKey, 0, "min", DataType::kInt32, 3, {0, 1, 2}, 3, {}, routing);
  const std::vector<std::vector<int32_t>> in = {{5, -7, 0}, {3, 9, 0}, {4, -8, -1}};
  for (uint32_t r : {2u, 0u, 1u}) {  // any arrival order
    Status pushed = PushTo(p, r, 0, DataType::kInt32, 3, in[r].data());
    ASSERT_TRUE(pushed.ok()) << pushed.ToString();
  }
  std::optional<Completion> c;
  while (auto next = p.Progress()) c = next;
  ASSERT_TRUE(c.has_value());
  EXPECT_EQ(FromBytes<int32_t>(c->result), (std::vector<int32_t>{3, -8, -1}));
}

// A rank that joined (Worker::Join) sits rounds out: the others' round completes without it,
// in rank order, an average divides by every rank (the joined add zeros, as under Horovod's
// join and torch's Join), it gets no reply, and a push from
// it is refused; a round it alone would start never begins; once every rank has joined and the
// join is over, it takes part again.
TEST(PartitionStateTest, AJoinedRankSitsRoundsOut) {
  Harness h(DataType::kFloat32, 3, 4);
  const std::vector<std::vector<std::byte>> pushes = {
      AsBytes(std::vector<float>{1.5f, 2, 3}), AsBytes(std::vector<float>{10, 20, 30}),
      AsBytes(std::vector<float>{100, 200, 300}), AsBytes(std::vector<float>{0.25f, 0.5f, 1})};
  // Round 0 with everyone.
  Done d0 = RunRound(h, 0, pushes, {2, 0, 3, 1});
  EXPECT_TRUE(d0.c.absent.empty());
  ReleaseSlot(h.state(), d0.c, 4);
  // Ranks 1 and 3 join: round 1 averages ranks 0 and 2 only.
  EXPECT_TRUE(h.state().SetJoined(1, true));
  EXPECT_FALSE(h.state().Progress().has_value());  // nobody has pushed: no round
  EXPECT_TRUE(h.state().SetJoined(3, true));
  EXPECT_FALSE(h.state().Progress().has_value());
  bool run = false;
  EXPECT_EQ(h.Begin(h.MakePush(1, 1), pushes[1], &run).code(), Code::kProtocolError);
  Done d1 = RunRound(h, 1, pushes, {2, 0}, wire::kFlagAverage);
  ASSERT_TRUE(d1.c.status.ok()) << d1.c.status.ToString();
  EXPECT_EQ(FromBytes<float>(d1.result),
            (std::vector<float>{(1.5f + 100) / 4, 202.0f / 4, 303.0f / 4}));  // zeros from 1 and 3
  EXPECT_EQ(d1.c.absent, (std::vector<bool>{false, true, false, true}));
  ReleaseSlot(h.state(), d1.c, 2);  // two replies, not four
  // The join is over: round 2 has every rank again.
  EXPECT_FALSE(h.state().SetJoined(1, false));
  EXPECT_FALSE(h.state().SetJoined(3, false));
  Done d2 = RunRound(h, 2, pushes, {3, 1, 0, 2});
  EXPECT_TRUE(d2.c.absent.empty());
  EXPECT_EQ(FromBytes<float>(d2.result), (std::vector<float>{111.75f, 222.5f, 334}));
}

// Summed per host first (hosts {0, 0, 1, 1, 1}, pushed by ranks 0 and 2): a host's partial that
// leaves joined workers out says how many it sums (Header::ranks), and an average divides by
// every worker (the joined add zeros); a host sits out only once all its workers have joined; a
// partial naming more workers than its host has, or a flat push naming any, is refused.
TEST(PartitionStateTest, HostPartialsLeaveJoinedWorkersOut) {
  PartitionState st(kKey, 0, "h", DataType::kFloat32, 2, {0, 2}, 5, {0, 0, 1, 1, 1});
  const float host0[2] = {3, 6}, host1[2] = {12, 24};
  auto push = [&](uint32_t sender, uint64_t round, uint16_t ranks, const float* data) {
    wire::Header h;
    h.type = wire::MsgType::kPush;
    h.flags = wire::kFlagAverage;
    h.key = kKey;
    h.sender = sender;
    h.round = round;
    h.dtype = static_cast<uint8_t>(DataType::kFloat32);
    h.count = 2;
    h.payload_bytes = 8;
    h.ranks = ranks;
    bool run = false;
    Result<std::span<std::byte>> span = st.BeginPush(h, &run);
    if (!span.ok()) return span.status();
    std::memcpy(span->data(), data, 8);
    st.EndPush(sender, true);
    return Status::Ok();
  };
  auto round = [&](uint64_t r, std::vector<std::pair<uint32_t, uint16_t>> pushes) {
    for (const auto& [sender, ranks] : pushes) {
      EXPECT_TRUE(push(sender, r, ranks, sender == 0 ? host0 : host1).ok()) << r;
    }
    std::optional<Completion> c = st.Progress();
    EXPECT_TRUE(c.has_value()) << "round " << r;
    std::vector<float> out;
    if (!c) return std::make_pair(out, std::vector<bool>());
    EXPECT_TRUE(c->status.ok()) << c->status.ToString();
    out = FromBytes<float>(c->result);
    const uint32_t replies = static_cast<uint32_t>(
        c->absent.empty() ? 2 : std::count(c->absent.begin(), c->absent.end(), false));
    for (uint32_t i = 0; i < replies; ++i) st.SendDone(c->slot);
    return std::make_pair(out, c->absent);
  };
  EXPECT_EQ(round(0, {{0, 0}, {2, 0}}).first, (std::vector<float>{15.0f / 5, 30.0f / 5}));
  // Ranks 1 (host 0) and 3 (host 1) join: both hosts still push, for 1 and 2 workers.
  EXPECT_FALSE(st.SetJoined(1, true));
  EXPECT_FALSE(st.SetJoined(3, true));
  EXPECT_EQ(push(0, 1, 3, host0).code(), Code::kProtocolError);  // host 0 has 2 workers
  auto [r1, absent1] = round(1, {{2, 2}, {0, 1}});
  EXPECT_EQ(r1, (std::vector<float>{15.0f / 5, 30.0f / 5}));  // joined ranks add zeros
  EXPECT_TRUE(absent1.empty());
  // Rank 0 joins too: host 0 has no worker left, and sits out.
  EXPECT_TRUE(st.SetJoined(0, true));
  EXPECT_EQ(push(0, 2, 0, host0).code(), Code::kProtocolError);
  auto [r2, absent2] = round(2, {{2, 2}});
  EXPECT_EQ(r2, (std::vector<float>{12.0f / 5, 24.0f / 5}));
  EXPECT_EQ(absent2, (std::vector<bool>{true, false}));
  // The join is over: every worker again.
  for (uint32_t r : {0u, 1u, 3u}) EXPECT_FALSE(st.SetJoined(r, false));
  EXPECT_EQ(round(3, {{2, 0}, {0, 0}}).first, (std::vector<float>{15.0f / 5, 30.0f / 5}));
  // A flat partition has no host partials.
  PartitionState flat(kKey, 1, "f", DataType::kFloat32, 2, 3);
  wire::Header h;
  h.type = wire::MsgType::kPush;
  h.key = kKey;
  h.partition = 1;
  h.dtype = static_cast<uint8_t>(DataType::kFloat32);
  h.count = 2;
  h.payload_bytes = 8;
  h.ranks = 1;
  bool run = false;
  Result<std::span<std::byte>> refused = flat.BeginPush(h, &run);
  EXPECT_EQ(refused.status().code(), Code::kProtocolError);
  EXPECT_NE(refused.status().message().find("only a host's partial sum"), std::string::npos)
      << refused.status().ToString();
}

// A collective other than a sum cannot leave a rank out: its round fails naming the joined rank,
// and the failure is forgotten once the join is over.
TEST(PartitionStateRoutingTest, AJoinedRankFailsARelayUntilTheJoinIsOver) {
  Routing routing{ReduceOp::kSum, true, {1, 2}, {}};
  PartitionState st(kKey, 0, "b", DataType::kFloat32, 2, {0}, 3, {}, routing);
  EXPECT_TRUE(st.SetJoined(2, true));
  const float root[2] = {1, 2};
  ASSERT_TRUE(PushTo(st, 0, 0, DataType::kFloat32, 2, root).ok());
  ASSERT_TRUE(PushTo(st, 1, 0, DataType::kFloat32, 0).ok());  // a requester
  std::optional<Completion> c = st.Progress();
  ASSERT_TRUE(c.has_value());
  EXPECT_EQ(c->status.code(), Code::kInvalidArgument);
  EXPECT_NE(c->status.message().find("rank 2 has joined"), std::string::npos);
  EXPECT_EQ(c->absent, (std::vector<bool>{false, false, true}));  // no reply to rank 2
  EXPECT_FALSE(st.SendDone(c->slot));
  EXPECT_TRUE(st.SendDone(c->slot));
  // Round 1 starts failed while rank 2 is joined; once the join is over, it runs.
  EXPECT_FALSE(st.SetJoined(2, false));
  for (uint32_t r : {0u, 1u, 2u}) {
    ASSERT_TRUE(PushTo(st, r, 1, DataType::kFloat32, r == 0 ? 2 : 0, root).ok()) << r;
  }
  c = st.Progress();
  ASSERT_TRUE(c.has_value());
  EXPECT_TRUE(c->status.ok()) << c->status.ToString();
}

// Every participant of a relay has joined: no round begins (nobody pushes, nobody is answered).
// Completing a round that every rank failed only by having joined started the next one failed
// the same way, so Progress() never returned nullopt: the owner thread spun, and the join's
// release queued behind it never ran (3 workers, a broadcast before every rank joined).
TEST(PartitionStateRoutingTest, ARelayEveryRankHasJoinedBeginsNoRound) {
  Routing routing{ReduceOp::kSum, true, {1, 2}, {}};
  PartitionState st(kKey, 0, "b", DataType::kFloat32, 2, {0}, 3, {}, routing);
  for (uint32_t r : {0u, 1u, 2u}) st.SetJoined(r, true);
  EXPECT_FALSE(st.Progress().has_value());
  EXPECT_FALSE(st.Progress().has_value());
  EXPECT_EQ(st.round(), 0u);
  // The join is over: round 0 runs as any other.
  for (uint32_t r : {0u, 1u, 2u}) EXPECT_FALSE(st.SetJoined(r, false));
  const float root[2] = {3, 4};
  for (uint32_t r : {0u, 1u, 2u}) {
    ASSERT_TRUE(PushTo(st, r, 0, DataType::kFloat32, r == 0 ? 2 : 0, root).ok()) << r;
  }
  std::optional<Completion> c = st.Progress();
  ASSERT_TRUE(c.has_value());
  ASSERT_TRUE(c->status.ok()) << c->status.ToString();
  EXPECT_EQ(FromBytes<float>(c->result), (std::vector<float>{3, 4}));
}

// The pool hands out buffers of the size asked, reuses what was given back (by size), frees
// what would pass its free bound, and counts what is in use, free and at most both.
TEST(BufferPoolTest, ReusesBySizeAndBoundsWhatItKeeps) {
  BufferPool pool(100);
  std::vector<std::byte> a = pool.Take(60), b = pool.Take(60), c = pool.Take(30);
  EXPECT_EQ(a.size(), 60u);
  EXPECT_EQ(pool.in_use_bytes(), 150u);
  EXPECT_EQ(pool.allocations(), 3u);
  const std::byte* a_data = a.data();
  pool.Give(a);
  EXPECT_TRUE(a.empty());
  pool.Give(b);  // 60 + 60 > 100: freed, not kept
  pool.Give(c);
  EXPECT_EQ(pool.free_bytes(), 90u);
  EXPECT_EQ(pool.in_use_bytes(), 0u);
  EXPECT_EQ(pool.peak_bytes(), 150u);
  std::vector<std::byte> again = pool.Take(60);
  EXPECT_EQ(again.data(), a_data);  // the one given back, not a new one
  EXPECT_EQ(pool.allocations(), 3u);
  std::vector<std::byte> other = pool.Take(45);  // no free buffer of that size
  EXPECT_EQ(pool.allocations(), 4u);
  EXPECT_EQ(pool.free_bytes(), 30u);
}

// With the server's pool, a partition holds nothing between rounds: its staging goes back once
// summed, its accumulator once every reply is sent, and the next round takes them again.
TEST(PartitionStateTest, WithAPoolBuffersGoBackBetweenRounds) {
  BufferPool pool(1 << 20);
  PartitionState st(kKey, 3, "g", DataType::kFloat16, 4, {0, 1, 2}, 3, {}, {}, &pool);
  const std::vector<uint16_t> one(4, 0x3C00);  // 1.0 in fp16
  for (uint64_t round = 0; round < 3; ++round) {
    for (uint32_t r = 0; r < 3; ++r) {
      Status pushed = PushTo(st, r, round, DataType::kFloat16, 4, one.data());
      ASSERT_TRUE(pushed.ok()) << pushed.ToString();
    }
    EXPECT_GT(st.bytes_held(), 0u);
    std::optional<Completion> c = st.Progress();
    ASSERT_TRUE(c.has_value());
    EXPECT_EQ(FromBytes<uint16_t>(c->result), std::vector<uint16_t>(4, 0x4200));  // 3.0
    for (int i = 0; i < 3; ++i) st.SendDone(c->slot);
    EXPECT_EQ(st.bytes_held(), 0u) << "round " << round;
    EXPECT_EQ(pool.in_use_bytes(), 0u) << "round " << round;
  }
  // Round 0 allocated 3 stagings (8 bytes) and the fp32 accumulator (16 bytes); its fp16
  // result (8 bytes) took a staging summed just before. Later rounds allocated nothing.
  EXPECT_EQ(pool.allocations(), 4u);
}

// ---- failover: a partition taken over from a lost server (Adopt) ------------------------

// One kRecover from `sender`: the result of `round` (when `result` is given) or, without, the
// round it pushes next; `input_follows`: its push of a round it was not answered follows.
Status RecoverTo(PartitionState& st, uint32_t sender, uint64_t round,
                 const std::vector<float>* result, bool input_follows, bool* ready) {
  wire::Header h;
  h.type = wire::MsgType::kRecover;
  h.key = st.key();
  h.partition = st.partition();
  h.sender = sender;
  h.round = round;
  h.dtype = static_cast<uint8_t>(DataType::kFloat32);
  h.flags = (result ? wire::kFlagHasResult : 0) | (input_follows ? wire::kFlagInputFollows : 0);
  h.count = result ? result->size() : 0;
  h.payload_bytes = h.count * 4;
  Result<std::span<std::byte>> span = st.BeginRecover(h);
  if (!span.ok()) return span.status();
  if (result) std::memcpy(span->data(), result->data(), span->size());
  *ready = st.EndRecover(sender, true);
  return Status::Ok();
}

// The lost server had answered rank 0's round 4 but not rank 1's or rank 2's. Rank 0 reports
// the result; ranks 1 and 2 report that they hold round 3's and push round 4 again. Nothing is
// summed before the last report; then ranks 1 and 2 get rank 0's round-4 result (not a new sum
// of the pushes: rank 0 pushes round 5 now), and round 5 is summed as usual.
TEST(PartitionStateFailoverTest, WorkersThatMissedTheLatestResultGetAnothersCopy) {
  PartitionState st(kKey, 2, "f", DataType::kFloat32, 3, 3);
  st.Adopt();
  const std::vector<float> r3 = {7, 8, 9}, r4 = {1.5f, -2, 1e30f};
  const std::vector<float> in4 = {100, 100, 100}, in5[3] = {{1, 2, 3}, {10, 20, 30}, {0.5f, 0, 0}};
  bool ready = false;
  ASSERT_TRUE(RecoverTo(st, 1, 3, &r3, true, &ready).ok());
  EXPECT_FALSE(ready);
  ASSERT_TRUE(PushTo(st, 1, 4, DataType::kFloat32, 3, in4.data()).ok());  // before the others
  ASSERT_TRUE(RecoverTo(st, 0, 4, &r4, false, &ready).ok());
  EXPECT_FALSE(ready);
  EXPECT_FALSE(st.Progress().has_value());
  ASSERT_TRUE(RecoverTo(st, 2, 3, &r3, true, &ready).ok());
  EXPECT_FALSE(ready);  // its push is still to come
  bool runnable = false;
  ASSERT_TRUE(PushTo(st, 2, 4, DataType::kFloat32, 3, in4.data(), &runnable).ok());
  EXPECT_TRUE(runnable);  // the last thing the adoption waited for: the server wakes its engine
  std::optional<Completion> c = st.Progress();
  ASSERT_TRUE(c.has_value());
  ASSERT_TRUE(c->status.ok()) << c->status.ToString();
  EXPECT_EQ(c->round, 4u);
  EXPECT_EQ(FromBytes<float>(c->result), r4);
  EXPECT_EQ(c->absent, (std::vector<bool>{true, false, false}));
  EXPECT_FALSE(st.adopting());
  EXPECT_EQ(st.round(), 5u);
  EXPECT_FALSE(st.SendDone(c->slot));
  EXPECT_TRUE(st.SendDone(c->slot));
  for (uint32_t r = 0; r < 3; ++r) ASSERT_TRUE(PushTo(st, r, 5, DataType::kFloat32, 3, in5[r].data()).ok());
  std::optional<Completion> c5 = st.Progress();
  ASSERT_TRUE(c5.has_value());
  EXPECT_EQ(c5->round, 5u);
  EXPECT_TRUE(c5->absent.empty());
  EXPECT_EQ(FromBytes<float>(c5->result), (std::vector<float>{11.5f, 22, 33}));
}

// Found by fault.joins (hierarchical, a server joining as round 3 began): the rank that had the
// latest result reported first and pushes nothing more; the other's push landed after every
// report. Its EndPush must say the engine has work (the adoption is ready), else the server
// never finishes the adoption and the rank waits for its answer until the deadline.
TEST(PartitionStateFailoverTest, APushLandingLastFinishesTheAdoption) {
  PartitionState st(kKey, 0, "f", DataType::kFloat32, 2, 2);
  st.Adopt();
  const std::vector<float> r2 = {1, 2}, r3 = {3, 4}, in3 = {9, 9};
  bool ready = true;
  ASSERT_TRUE(RecoverTo(st, 1, 3, &r3, false, &ready).ok());
  EXPECT_FALSE(ready);
  ASSERT_TRUE(RecoverTo(st, 0, 2, &r2, true, &ready).ok());
  EXPECT_FALSE(ready);  // its push is still to come
  bool runnable = false;
  ASSERT_TRUE(PushTo(st, 0, 3, DataType::kFloat32, 2, in3.data(), &runnable).ok());
  EXPECT_TRUE(runnable);
  std::optional<Completion> c = st.Progress();
  ASSERT_TRUE(c.has_value());
  ASSERT_TRUE(c->status.ok()) << c->status.ToString();
  EXPECT_EQ(c->round, 3u);
  EXPECT_EQ(FromBytes<float>(c->result), r3);
  EXPECT_EQ(c->absent, (std::vector<bool>{false, true}));
  EXPECT_EQ(st.round(), 4u);
}

// Nobody had received round 2 (every copy says round 1): round 2 is summed from the pushes
// again, in rank order, and goes to everyone; a rank whose op had not pushed the partition
// yet reports the round it pushes next and pushes it as usual once adoption is over.
TEST(PartitionStateFailoverTest, WithoutANewerResultTheRoundIsSummedAgain) {
  PartitionState st(kKey, 0, "f", DataType::kFloat32, 2, 2);
  st.Adopt();
  const std::vector<float> r1 = {3, 4}, a = {0.1f, 1e8f}, b = {0.2f, -1e8f};
  bool ready = false;
  ASSERT_TRUE(RecoverTo(st, 0, 1, &r1, true, &ready).ok());
  ASSERT_TRUE(PushTo(st, 0, 2, DataType::kFloat32, 2, a.data()).ok());
  ASSERT_TRUE(RecoverTo(st, 1, 2, nullptr, false, &ready).ok());  // had no result; pushes 2 next
  EXPECT_TRUE(ready);
  EXPECT_FALSE(st.Progress().has_value());  // adopted: round 2, rank 1's push to come
  EXPECT_EQ(st.round(), 2u);
  ASSERT_TRUE(PushTo(st, 1, 2, DataType::kFloat32, 2, b.data()).ok());
  std::optional<Completion> c = st.Progress();
  ASSERT_TRUE(c.has_value());
  EXPECT_EQ(c->round, 2u);
  EXPECT_EQ(FromBytes<float>(c->result), (std::vector<float>{0.1f + 0.2f, 1e8f + -1e8f}));
}

// Copies of one round's result that differ are not summed over: every waiting worker gets an
// error naming the ranks, and the round after fails too (none waits for a result that will
// never be right).
TEST(PartitionStateFailoverTest, DifferentCopiesOfOneResultFailTheRound) {
  PartitionState st(kKey, 0, "f", DataType::kFloat32, 2, 3);
  st.Adopt();
  const std::vector<float> good = {1, 2}, bad = {1, 2.5f}, in = {5, 5};
  bool ready = false;
  ASSERT_TRUE(RecoverTo(st, 0, 6, &good, false, &ready).ok());
  ASSERT_TRUE(RecoverTo(st, 1, 6, &bad, false, &ready).ok());
  ASSERT_TRUE(RecoverTo(st, 2, 5, nullptr, true, &ready).ok());
  ASSERT_TRUE(PushTo(st, 2, 6, DataType::kFloat32, 2, in.data()).ok());
  std::optional<Completion> c = st.Progress();
  ASSERT_TRUE(c.has_value());
  EXPECT_EQ(c->status.code(), Code::kInternal);
  EXPECT_NE(c->status.message().find("ranks 0 and 1 hold different results of round 6"),
            std::string::npos) << c->status.message();
  EXPECT_EQ(c->absent, (std::vector<bool>{true, true, false}));
}

// A kRecover where no failover is going on, or a second one from a rank, is refused.
TEST(PartitionStateFailoverTest, UnexpectedReportsAreRefused) {
  PartitionState st(kKey, 0, "f", DataType::kFloat32, 2, 2);
  bool ready = false;
  EXPECT_EQ(RecoverTo(st, 0, 0, nullptr, false, &ready).code(), Code::kProtocolError);
  st.Adopt();
  ASSERT_TRUE(RecoverTo(st, 0, 0, nullptr, false, &ready).ok());
  EXPECT_EQ(RecoverTo(st, 0, 0, nullptr, false, &ready).code(), Code::kProtocolError);
  const std::vector<float> wrong = {1, 2, 3};
  EXPECT_EQ(RecoverTo(st, 1, 0, &wrong, false, &ready).code(), Code::kProtocolError);
  EXPECT_EQ(RecoverTo(st, 1, UINT64_MAX, nullptr, false, &ready).code(), Code::kProtocolError);
}

// Regression (found by clang's thread-safety analysis): Progress() set acc_started_ outside the
// lock while it summed, and a push landing meanwhile read it under the lock (EndPush ->
// SummableEndLocked): a data race, which ThreadSanitizer reported here on the old code
// (make test-tsan). Rank 2's push lands while the engine thread sums ranks 0 and 1, at varying
// points of the sum; every round's result must still be the sum of all three.
TEST(PartitionStateTest, PushLandingWhileTheEngineSumsIsNoRace) {
  constexpr uint64_t kCount = 1 << 16;
  constexpr uint32_t kWorkers = 3;
  constexpr uint64_t kRounds = 16;
  PartitionState st(kKey, 0, "layer.grad", DataType::kFloat32, kCount, kWorkers);
  const std::vector<float> ones(kCount, 1.0f);
  const auto push = [&](uint32_t rank, uint64_t round) {
    wire::Header h;
    h.type = wire::MsgType::kPush;
    h.sender = rank;
    h.key = kKey;
    h.partition = 0;
    h.dtype = static_cast<uint8_t>(DataType::kFloat32);
    h.round = round;
    h.count = kCount;
    h.payload_bytes = kCount * sizeof(float);
    h.cookie = 10 * round + rank + 1;
    bool run_engine = false;
    Result<std::span<std::byte>> dest = st.BeginPush(h, &run_engine);
    ASSERT_TRUE(dest.ok()) << dest.status().ToString();
    ASSERT_EQ(dest->size(), kCount * sizeof(float));
    std::memcpy(dest->data(), ones.data(), dest->size());
    st.EndPush(rank, true);
  };
  std::atomic<uint64_t> summing{0}, finished{0};
  std::vector<float> sums;  // element 0 and the last of each round's result (engine thread)
  std::thread engine([&] {
    for (uint64_t r = 0; r < kRounds; ++r) {
      while (summing.load() <= r) std::this_thread::yield();
      const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
      std::optional<Completion> c;
      while (!c && std::chrono::steady_clock::now() < deadline) c = st.Progress();
      if (!c) break;  // the main thread's wait fails the test
      const std::vector<float> out = FromBytes<float>(c->result);
      sums.push_back(out.empty() ? 0.0f : out.front());
      sums.push_back(out.empty() ? 0.0f : out.back());
      for (uint32_t i = 0; i < kWorkers; ++i) st.SendDone(c->slot);
      finished = r + 1;
    }
  });
  for (uint64_t r = 0; r < kRounds; ++r) {
    push(0, r);
    push(1, r);
    summing = r + 1;  // the engine sums ranks 0 and 1 now
    std::this_thread::sleep_for(std::chrono::microseconds(50 * (r % 8)));
    push(2, r);  // lands before, during or after that sum
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
    while (finished.load() <= r && std::chrono::steady_clock::now() < deadline) {
      std::this_thread::yield();
    }
    if (finished.load() <= r) break;  // the engine gives up too (its own deadline)
  }
  engine.join();
  ASSERT_EQ(finished.load(), kRounds) << "a round never completed";
  ASSERT_EQ(sums.size(), 2 * kRounds);
  for (float v : sums) EXPECT_EQ(v, 3.0f);
}

}  // namespace
}  // namespace gradlink::server
