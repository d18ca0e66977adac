// Tests of the frame header codec: round trips of every field, the byte layout, every rejection
// DecodeHeader() makes (truncation, magic, version, type, reserved bytes, flags, code, payload
// bounds, dtype, count/payload agreement including products that would overflow), and the
// stability of the key and job hashes against an independent FNV-1a written here.
#include "wire/frame.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <limits>
#include <string>
#include <string_view>
#include <vector>

namespace gradlink::wire {
namespace {

constexpr uint64_t kU64Max = std::numeric_limits<uint64_t>::max();

// A valid data frame with every field set to a distinct, non-zero value.
Header SamplePush() {
  Header h;
  h.type = MsgType::kPush;
  h.flags = kFlagAverage;
  h.job = 0xA1B2C3D4u;
  h.sender = 0x01020304u;
  h.key = 0x1122334455667788ull;
  h.partition = 0x0A0B0C0Du;
  h.dtype = static_cast<uint8_t>(DataType::kFloat64);
  h.code = 0;
  h.round = 0x8877665544332211ull;
  h.count = 1000;
  h.payload_bytes = 8000;
  h.cookie = 0xFEDCBA9876543210ull;
  return h;
}

Header SampleControl() {
  Header h;
  h.type = MsgType::kAbort;
  h.job = 7;
  h.sender = kSchedulerId;
  h.key = 99;
  h.code = static_cast<uint8_t>(Code::kPeerLost);
  h.payload_bytes = 123;
  h.cookie = 5;
  return h;
}

void ExpectSameHeader(const Header& a, const Header& b) {
  EXPECT_EQ(a.type, b.type);
  EXPECT_EQ(a.flags, b.flags);
  EXPECT_EQ(a.job, b.job);
  EXPECT_EQ(a.sender, b.sender);
  EXPECT_EQ(a.key, b.key);
  EXPECT_EQ(a.partition, b.partition);
  EXPECT_EQ(a.dtype, b.dtype);
  EXPECT_EQ(a.code, b.code);
  EXPECT_EQ(a.round, b.round);
  EXPECT_EQ(a.count, b.count);
  EXPECT_EQ(a.payload_bytes, b.payload_bytes);
  EXPECT_EQ(a.cookie, b.cookie);
}

// Little-endian writes into raw header bytes (to build frames EncodeHeader would never emit).
void PutLe(HeaderBytes& b, size_t off, uint64_t v, size_t n) {
  for (size_t i = 0; i < n; ++i) b[off + i] = std::byte((v >> (8 * i)) & 0xFF);
}
uint64_t GetLe(const HeaderBytes& b, size_t off, size_t n) {
  uint64_t v = 0;
  for (size_t i = 0; i < n; ++i) v |= uint64_t{std::to_integer<uint8_t>(b[off + i])} << (8 * i);
  return v;
}

// Field offsets of docs/wire_format.md, restated here so a layout change fails a test.
constexpr size_t kOffMagic = 0, kOffVersion = 4, kOffType = 5, kOffFlags = 6, kOffJob = 8,
                 kOffSender = 12, kOffKey = 16, kOffPartition = 24, kOffDtype = 28, kOffCode = 29,
                 kOffTypeWord = 30, kOffRound = 32, kOffCount = 40, kOffPayload = 48,
                 kOffCookie = 56;

void ExpectProtocolError(const Result<Header>& r, const std::string& what) {
  ASSERT_FALSE(r.ok()) << what << ": accepted";
  EXPECT_EQ(r.status().code(), Code::kProtocolError) << what << ": " << r.status().ToString();
  EXPECT_FALSE(r.status().message().empty()) << what;
}

Result<Header> EncodeDecode(const Header& h) { return DecodeHeader(EncodeHeader(h)); }

// ---- Round trips -----------------------------------------------------------------------------

TEST(FrameTest, HeaderSizeIs64) {
  EXPECT_EQ(kHeaderSize, 64u);
  EXPECT_EQ(sizeof(HeaderBytes), 64u);
}

TEST(FrameTest, RoundTripDataFrameEveryField) {
  const Header h = SamplePush();
  Result<Header> d = EncodeDecode(h);
  ASSERT_TRUE(d.ok()) << d.status().ToString();
  ExpectSameHeader(h, *d);
}

TEST(FrameTest, RoundTripControlFrameEveryField) {
  const Header h = SampleControl();
  Result<Header> d = EncodeDecode(h);
  ASSERT_TRUE(d.ok()) << d.status().ToString();
  ExpectSameHeader(h, *d);
}

TEST(FrameTest, RoundTripExtremeValues) {
  Header h = SamplePush();
  h.job = 0xFFFFFFFFu;
  h.sender = 0xFFFFFFFFu;
  h.key = kU64Max;
  h.partition = 0xFFFFFFFFu;
  h.round = kU64Max;
  h.cookie = kU64Max;
  h.dtype = static_cast<uint8_t>(DataType::kInt64);
  h.count = kMaxDataPayload / 8;
  h.payload_bytes = kMaxDataPayload;
  Result<Header> d = EncodeDecode(h);
  ASSERT_TRUE(d.ok()) << d.status().ToString();
  ExpectSameHeader(h, *d);

  Header z;  // all zero but the type
  z.type = MsgType::kGoodbye;
  Result<Header> dz = EncodeDecode(z);
  ASSERT_TRUE(dz.ok()) << dz.status().ToString();
  ExpectSameHeader(z, *dz);
}

TEST(FrameTest, RoundTripEveryKnownType) {
  const MsgType control[] = {MsgType::kRegister,  MsgType::kWelcome,        MsgType::kDeclare,
                             MsgType::kAssign,    MsgType::kAssignAck,      MsgType::kBarrier,
                             MsgType::kBarrierRelease, MsgType::kGoodbye,   MsgType::kShutdown,
                             MsgType::kAbort,     MsgType::kHeartbeat};
  for (MsgType t : control) {
    Header h = SampleControl();
    h.type = t;
    EXPECT_TRUE(IsControlType(t));
    EXPECT_FALSE(IsDataType(t));
    Result<Header> d = EncodeDecode(h);
    ASSERT_TRUE(d.ok()) << int(t) << ": " << d.status().ToString();
    ExpectSameHeader(h, *d);
  }
  for (MsgType t : {MsgType::kPush, MsgType::kPullResponse}) {
    Header h = SamplePush();
    h.type = t;
    EXPECT_TRUE(IsDataType(t));
    EXPECT_FALSE(IsControlType(t));
    Result<Header> d = EncodeDecode(h);
    ASSERT_TRUE(d.ok()) << int(t) << ": " << d.status().ToString();
    ExpectSameHeader(h, *d);
  }
  Header e = SampleControl();
  e.type = MsgType::kDataError;
  e.code = static_cast<uint8_t>(Code::kMismatch);
  EXPECT_TRUE(IsDataType(MsgType::kDataError));
  Result<Header> d = EncodeDecode(e);
  ASSERT_TRUE(d.ok()) << d.status().ToString();
  ExpectSameHeader(e, *d);
}

TEST(FrameTest, RoundTripEveryDtype) {
  for (uint8_t raw = 1; raw <= 6; ++raw) {
    const auto t = static_cast<DataType>(raw);
    Header h = SamplePush();
    h.dtype = raw;
    h.count = 77;
    h.payload_bytes = 77 * DataTypeSize(t);
    Result<Header> d = EncodeDecode(h);
    ASSERT_TRUE(d.ok()) << DataTypeName(t) << ": " << d.status().ToString();
    ExpectSameHeader(h, *d);
  }
}

TEST(FrameTest, RoundTripEveryCode) {
  for (uint8_t c = 0; c <= kMaxCode; ++c) {
    Header h = SampleControl();
    h.code = c;
    Result<Header> d = EncodeDecode(h);
    ASSERT_TRUE(d.ok()) << int(c) << ": " << d.status().ToString();
    EXPECT_EQ(d->code, c);
  }
}

TEST(FrameTest, ByteLayoutIsLittleEndianAtDocumentedOffsets) {
  const Header h = SamplePush();
  const HeaderBytes b = EncodeHeader(h);
  // "GLK1" in memory order.
  EXPECT_EQ(std::to_integer<char>(b[0]), 'G');
  EXPECT_EQ(std::to_integer<char>(b[1]), 'L');
  EXPECT_EQ(std::to_integer<char>(b[2]), 'K');
  EXPECT_EQ(std::to_integer<char>(b[3]), '1');
  EXPECT_EQ(GetLe(b, kOffMagic, 4), kMagic);
  EXPECT_EQ(GetLe(b, kOffVersion, 1), kVersion);
  EXPECT_EQ(GetLe(b, kOffType, 1), static_cast<uint8_t>(h.type));
  EXPECT_EQ(GetLe(b, kOffFlags, 2), h.flags);
  EXPECT_EQ(GetLe(b, kOffJob, 4), h.job);
  EXPECT_EQ(GetLe(b, kOffSender, 4), h.sender);
  EXPECT_EQ(GetLe(b, kOffKey, 8), h.key);
  EXPECT_EQ(GetLe(b, kOffPartition, 4), h.partition);
  EXPECT_EQ(GetLe(b, kOffDtype, 1), h.dtype);
  EXPECT_EQ(GetLe(b, kOffCode, 1), h.code);
  EXPECT_EQ(GetLe(b, kOffTypeWord, 2), 0u);
  EXPECT_EQ(GetLe(b, kOffRound, 8), h.round);
  EXPECT_EQ(GetLe(b, kOffCount, 8), h.count);
  EXPECT_EQ(GetLe(b, kOffPayload, 8), h.payload_bytes);
  EXPECT_EQ(GetLe(b, kOffCookie, 8), h.cookie);
  // Spot check the byte order of one multi-byte field.
  EXPECT_EQ(std::to_integer<uint8_t>(b[kOffKey]), 0x88);
  EXPECT_EQ(std::to_integer<uint8_t>(b[kOffKey + 7]), 0x11);
}

TEST(FrameTest, DecodeAcceptsLongerSpanAndReadsOnlyTheHeader) {
  const HeaderBytes b = EncodeHeader(SamplePush());
  std::vector<std::byte> longer(b.begin(), b.end());
  longer.resize(200, std::byte{0xEE});
  Result<Header> d = DecodeHeader(longer);
  ASSERT_TRUE(d.ok()) << d.status().ToString();
  ExpectSameHeader(SamplePush(), *d);
}

// ---- Rejections ------------------------------------------------------------------------------

TEST(FrameTest, RejectsEveryTruncation) {
  const HeaderBytes b = EncodeHeader(SamplePush());
  for (size_t n = 0; n < kHeaderSize; ++n) {
    ExpectProtocolError(DecodeHeader(std::span<const std::byte>(b.data(), n)),
                        "truncated to " + std::to_string(n));
  }
}

TEST(FrameTest, RejectsBadMagic) {
  for (size_t i = 0; i < 4; ++i) {
    HeaderBytes b = EncodeHeader(SamplePush());
    b[kOffMagic + i] ^= std::byte{0x20};
    ExpectProtocolError(DecodeHeader(b), "magic byte " + std::to_string(i));
  }
  HeaderBytes z = EncodeHeader(SamplePush());
  PutLe(z, kOffMagic, 0, 4);
  ExpectProtocolError(DecodeHeader(z), "zero magic");
  HeaderBytes be = EncodeHeader(SamplePush());  // "GLK1" byte-swapped
  PutLe(be, kOffMagic, 0x474C4B31u, 4);
  ExpectProtocolError(DecodeHeader(be), "big-endian magic");
}

TEST(FrameTest, RejectsBadVersion) {
  for (uint8_t v : {uint8_t{0}, uint8_t{kVersion - 1}, uint8_t{kVersion + 1}, uint8_t{255}}) {
    HeaderBytes b = EncodeHeader(SamplePush());
    PutLe(b, kOffVersion, v, 1);
    ExpectProtocolError(DecodeHeader(b), "version " + std::to_string(v));
  }
}

TEST(FrameTest, RejectsUnknownTypes) {
  for (uint8_t t : {0, 28, 31, 41, 255}) {
    for (const Header& base : {SampleControl(), SamplePush()}) {
      HeaderBytes b = EncodeHeader(base);
      PutLe(b, kOffType, t, 1);
      ExpectProtocolError(DecodeHeader(b), "type " + std::to_string(t));
    }
  }
  // Every value outside 1..25 and 32..40.
  for (int t = 0; t < 256; ++t) {
    const bool known = (t >= 1 && t <= 27) || (t >= 32 && t <= 40);
    if (known) continue;
    HeaderBytes b = EncodeHeader(SampleControl());
    PutLe(b, kOffType, static_cast<uint64_t>(t), 1);
    ExpectProtocolError(DecodeHeader(b), "type " + std::to_string(t));
  }
}

// Bytes 30-31: a pull response's server time, a push's ranks (of a host partial), zero on every
// other frame; each decodes into its own field only.
TEST(FrameTest, TypeWordOnlyOnPullResponsesAndPushes) {
  for (size_t i = 0; i < 2; ++i) {
    for (uint8_t v : {uint8_t{1}, uint8_t{0x80}, uint8_t{0xFF}}) {
      for (MsgType t : {MsgType::kDataError, MsgType::kRecover}) {
        Header h = SamplePush();
        h.type = t;
        h.flags = 0;
        h.count = 0;
        h.payload_bytes = 0;
        HeaderBytes b = EncodeHeader(h);
        b[kOffTypeWord + i] = std::byte{v};
        ExpectProtocolError(DecodeHeader(b), "type word byte " + std::to_string(i));
      }
      HeaderBytes b = EncodeHeader(SampleControl());
      b[kOffTypeWord + i] = std::byte{v};
      ExpectProtocolError(DecodeHeader(b), "type word byte " + std::to_string(i) + " (control)");
    }
  }
  Header h = SamplePush();
  h.type = MsgType::kPullResponse;
  h.flags = 0;
  h.server_time = EncodeServerTime(123456);
  h.ranks = 7;  // not a push's: not encoded
  auto d = DecodeHeader(EncodeHeader(h));
  ASSERT_TRUE(d.ok()) << d.status().ToString();
  EXPECT_EQ(d->server_time, h.server_time);
  EXPECT_EQ(d->ranks, 0);
  Header p = SamplePush();
  p.ranks = 3;
  p.server_time = 9;  // not a pull response's: not encoded
  d = DecodeHeader(EncodeHeader(p));
  ASSERT_TRUE(d.ok()) << d.status().ToString();
  EXPECT_EQ(d->ranks, 3);
  EXPECT_EQ(d->server_time, 0);
}

TEST(FrameTest, ServerTimeCodes) {
  for (uint64_t us : {0ull, 1ull, 4095ull}) EXPECT_EQ(DecodeServerTime(EncodeServerTime(us)), us);
  uint64_t last = 0;
  for (uint64_t us = 1; us <= (uint64_t{4095} << 15); us = us * 3 + 1) {
    const uint64_t back = DecodeServerTime(EncodeServerTime(us));
    EXPECT_LE(back, us);
    EXPECT_GE(static_cast<double>(back), static_cast<double>(us) * (1 - 1.0 / 2048)) << us;
    EXPECT_GE(back, last);  // monotonic
    last = back;
  }
  // Past 134 s: saturates at the largest code.
  EXPECT_EQ(EncodeServerTime(UINT64_MAX), 0xFFFF);
  EXPECT_EQ(DecodeServerTime(0xFFFF), uint64_t{4095} << 15);
}

TEST(FrameTest, RejectsUnknownFlags) {
  for (int bit = 0; bit < 16; ++bit) {
    const uint16_t flag = static_cast<uint16_t>(1u << bit);
    Header h = SamplePush();
    h.flags = flag;
    if (flag & kKnownFlags) {
      EXPECT_TRUE(EncodeDecode(h).ok()) << "flag bit " << bit;
    } else {
      ExpectProtocolError(EncodeDecode(h), "flag bit " + std::to_string(bit));
      h.flags = static_cast<uint16_t>(flag | kFlagAverage);
      ExpectProtocolError(EncodeDecode(h), "flag bit " + std::to_string(bit) + " + average");
    }
  }
  Header h = SampleControl();
  h.flags = 0xFFFF;
  ExpectProtocolError(EncodeDecode(h), "all flags");
}

TEST(FrameTest, RejectsCodeAboveMax) {
  for (int c : {int{kMaxCode} + 1, 100, 255}) {
    for (const Header& base : {SampleControl(), SamplePush()}) {
      Header h = base;
      h.code = static_cast<uint8_t>(c);
      ExpectProtocolError(EncodeDecode(h), "code " + std::to_string(c));
    }
    Header e = SampleControl();
    e.type = MsgType::kDataError;
    e.code = static_cast<uint8_t>(c);
    ExpectProtocolError(EncodeDecode(e), "kDataError code " + std::to_string(c));
  }
}

TEST(FrameTest, ControlPayloadBound) {
  Header h = SampleControl();
  h.payload_bytes = kMaxControlPayload;
  EXPECT_TRUE(EncodeDecode(h).ok());
  h.payload_bytes = kMaxControlPayload + 1;
  ExpectProtocolError(EncodeDecode(h), "control payload max + 1");
  // kDataError carries a message: the control bound applies to it too.
  Header e = SampleControl();
  e.type = MsgType::kDataError;
  e.payload_bytes = kMaxControlPayload;
  EXPECT_TRUE(EncodeDecode(e).ok());
  e.payload_bytes = kMaxControlPayload + 1;
  ExpectProtocolError(EncodeDecode(e), "kDataError payload max + 1");
}

TEST(FrameTest, DataPayloadBound) {
  for (uint8_t raw = 1; raw <= 6; ++raw) {
    const uint64_t size = DataTypeSize(static_cast<DataType>(raw));
    Header h = SamplePush();
    h.dtype = raw;
    h.count = kMaxDataPayload / size;
    h.payload_bytes = kMaxDataPayload;
    EXPECT_TRUE(EncodeDecode(h).ok()) << int(raw);
    h.count = kMaxDataPayload / size + 1;
    h.payload_bytes = kMaxDataPayload + size;
    ExpectProtocolError(EncodeDecode(h), "data payload above the bound, dtype " +
                                             std::to_string(raw));
  }
}

TEST(FrameTest, PayloadLengthExtremes) {
  // Length 0: fine for control frames and for an empty data frame.
  Header c = SampleControl();
  c.payload_bytes = 0;
  EXPECT_TRUE(EncodeDecode(c).ok());
  Header d = SamplePush();
  d.count = 0;
  d.payload_bytes = 0;
  EXPECT_TRUE(EncodeDecode(d).ok());

  for (uint64_t len : {uint64_t{0xFFFFFFFFu}, kU64Max}) {
    c.payload_bytes = len;
    ExpectProtocolError(EncodeDecode(c), "control payload " + std::to_string(len));
    Header e = SampleControl();
    e.type = MsgType::kDataError;
    e.payload_bytes = len;
    ExpectProtocolError(EncodeDecode(e), "kDataError payload " + std::to_string(len));
    for (uint8_t raw = 1; raw <= 6; ++raw) {
      Header p = SamplePush();
      p.dtype = raw;
      p.payload_bytes = len;
      for (uint64_t count : {uint64_t{0}, len / DataTypeSize(static_cast<DataType>(raw)), len}) {
        p.count = count;
        ExpectProtocolError(EncodeDecode(p), "data payload " + std::to_string(len) + " count " +
                                                 std::to_string(count));
      }
    }
  }
}

TEST(FrameTest, RejectsInvalidDtypeOnDataFrames) {
  for (MsgType t : {MsgType::kPush, MsgType::kPullResponse}) {
    for (uint8_t dt : {uint8_t{0}, uint8_t{7}, uint8_t{8}, uint8_t{128}, uint8_t{255}}) {
      Header h = SamplePush();
      h.type = t;
      h.dtype = dt;
      ExpectProtocolError(EncodeDecode(h), "dtype " + std::to_string(dt));
      h.count = 0;  // even an empty payload needs a valid dtype
      h.payload_bytes = 0;
      ExpectProtocolError(EncodeDecode(h), "empty, dtype " + std::to_string(dt));
    }
  }
}

TEST(FrameTest, RejectsCountPayloadDisagreement) {
  struct Case {
    DataType dtype;
    uint64_t count;
    uint64_t payload;
  };
  const Case cases[] = {
      {DataType::kFloat32, 3, 11},
      {DataType::kFloat32, 3, 13},
      {DataType::kFloat32, 0, 4},
      {DataType::kFloat32, 1, 0},
      {DataType::kFloat64, 2, 12},
      {DataType::kFloat16, 5, 5},
      {DataType::kBFloat16, 5, 20},
      {DataType::kInt32, 1, 8},
      {DataType::kInt64, 1, 4},
      // count * size overflows 64 bits and wraps onto the payload length.
      {DataType::kFloat32, uint64_t{1} << 62, 0},         // 2^62 * 4 = 2^64 -> 0
      {DataType::kFloat16, uint64_t{1} << 63, 0},         // 2^63 * 2 = 2^64 -> 0
      {DataType::kFloat64, (uint64_t{1} << 61) + 2, 16},  // 2^64 + 16 -> 16
      {DataType::kFloat32, (uint64_t{1} << 62) + 1, 4},   // 2^64 + 4 -> 4
      {DataType::kInt64, uint64_t{1} << 63, 0},
      {DataType::kFloat32, uint64_t{1} << 63, 0},
      {DataType::kFloat32, kU64Max, 0},
      {DataType::kFloat32, kU64Max, kU64Max},
      {DataType::kFloat32, kU64Max, 8},
      {DataType::kFloat64, kU64Max, 8},
      {DataType::kFloat16, kU64Max, kU64Max - 1},  // (2^64-1) * 2 wraps to 2^64 - 2
      {DataType::kFloat64, kU64Max, uint64_t{0} - 8},  // (2^64-1) * 8 wraps to 2^64 - 8
      {DataType::kInt32, kU64Max, uint64_t{0} - 4},
  };
  for (const Case& c : cases) {
    const std::string what = std::string(DataTypeName(c.dtype)) + " count " +
                             std::to_string(c.count) + " payload " + std::to_string(c.payload);
    Status s = CheckDataShape(c.dtype, c.count, c.payload);
    EXPECT_EQ(s.code(), Code::kProtocolError) << what;
    Header h = SamplePush();
    h.dtype = static_cast<uint8_t>(c.dtype);
    h.count = c.count;
    h.payload_bytes = c.payload;
    ExpectProtocolError(EncodeDecode(h), what);
  }
}

TEST(FrameTest, CheckDataShapeAcceptsExactProducts) {
  for (uint8_t raw = 1; raw <= 6; ++raw) {
    const auto t = static_cast<DataType>(raw);
    const uint64_t size = DataTypeSize(t);
    for (uint64_t count : {uint64_t{0}, uint64_t{1}, uint64_t{3}, uint64_t{1} << 20,
                           kU64Max / size}) {
      EXPECT_TRUE(CheckDataShape(t, count, count * size).ok())
          << DataTypeName(t) << " count " << count;
    }
  }
  EXPECT_EQ(CheckDataShape(static_cast<DataType>(0), 0, 0).code(), Code::kProtocolError);
  EXPECT_EQ(CheckDataShape(static_cast<DataType>(9), 1, 4).code(), Code::kProtocolError);
}

TEST(FrameTest, DataErrorFrameNeedsNoDtypeOrCount) {
  Header e;
  e.type = MsgType::kDataError;
  e.code = static_cast<uint8_t>(Code::kMismatch);
  e.payload_bytes = 40;  // a text message, not elements
  Result<Header> d = EncodeDecode(e);
  ASSERT_TRUE(d.ok()) << d.status().ToString();
  EXPECT_EQ(d->payload_bytes, 40u);
}

TEST(FrameTest, MutatingAnyValidatedByteNeverCrashes) {
  // Every single-byte value at every offset: decoding either succeeds with a header that
  // re-encodes to the same bytes or fails with kProtocolError.
  const HeaderBytes base = EncodeHeader(SamplePush());
  for (size_t off = 0; off < kHeaderSize; ++off) {
    for (int v = 0; v < 256; ++v) {
      HeaderBytes b = base;
      b[off] = std::byte(v);
      Result<Header> d = DecodeHeader(b);
      if (d.ok()) {
        EXPECT_EQ(EncodeHeader(*d), b) << "offset " << off << " value " << v;
      } else {
        EXPECT_EQ(d.status().code(), Code::kProtocolError);
      }
    }
  }
}

// ---- Hashes ----------------------------------------------------------------------------------

// Straightforward FNV-1a over a byte string (http://www.isthe.com/chongo/tech/comp/fnv/).
uint64_t RefFnv1a64(std::string_view bytes) {
  uint64_t h = 0xcbf29ce484222325ull;
  for (unsigned char c : bytes) {
    h ^= c;
    h *= 0x100000001b3ull;
  }
  return h;
}
uint32_t RefFnv1a32(std::string_view bytes) {
  uint32_t h = 0x811c9dc5u;
  for (unsigned char c : bytes) {
    h ^= c;
    h *= 0x01000193u;
  }
  return h;
}

// The key hashes job, one 0xFF separator byte, then the name.
uint64_t RefTensorKey(std::string_view job, std::string_view name) {
  std::string s(job);
  s.push_back(static_cast<char>(0xFF));
  s.append(name);
  return RefFnv1a64(s);
}

TEST(FrameTest, ReferenceFnvMatchesPublishedVectors) {
  EXPECT_EQ(RefFnv1a64(""), 0xcbf29ce484222325ull);
  EXPECT_EQ(RefFnv1a64("a"), 0xaf63dc4c8601ec8cull);
  EXPECT_EQ(RefFnv1a64("foobar"), 0x85944171f73967e8ull);
  EXPECT_EQ(RefFnv1a32(""), 0x811c9dc5u);
  EXPECT_EQ(RefFnv1a32("a"), 0xe40c292cu);
  EXPECT_EQ(RefFnv1a32("foobar"), 0xbf9cf968u);
}

TEST(FrameTest, JobHashIsFnv1a32) {
  EXPECT_EQ(JobHash(""), 0x811c9dc5u);
  EXPECT_EQ(JobHash("a"), 0xe40c292cu);
  EXPECT_EQ(JobHash("foobar"), 0xbf9cf968u);
  EXPECT_EQ(JobHash("default"), 0x933b5bdeu);
  for (std::string_view j : {"job-1", "ImageNet/resnet50", "\xff\x00x"}) {
    EXPECT_EQ(JobHash(j), RefFnv1a32(j)) << j;
  }
}

TEST(FrameTest, TensorKeyIsStable) {
  // Fixed values: a change here breaks compatibility between gradlink versions.
  EXPECT_EQ(TensorKey("default", "fc1.weight"), 0xaf866f0a3e9b99afull);
  EXPECT_EQ(TensorKey("", ""), 0xaf64724c8602eb6eull);
  EXPECT_EQ(RefTensorKey("default", "fc1.weight"), 0xaf866f0a3e9b99afull);
  const std::pair<std::string_view, std::string_view> cases[] = {
      {"default", "fc1.weight"},
      {"default", "fc1.weight.grad"},
      {"job", ""},
      {"", "name"},
      {"a", "b"},
      {"unicode-\xc3\xa9", "layer.\xe2\x9c\x93"},
      {std::string_view("nul\0job", 7), std::string_view("nul\0name", 8)},
  };
  for (const auto& [job, name] : cases) {
    EXPECT_EQ(TensorKey(job, name), RefTensorKey(job, name)) << job << " / " << name;
    EXPECT_EQ(TensorKey(job, name), TensorKey(std::string(job), std::string(name)));
  }
}

TEST(FrameTest, TensorKeySeparatesJobFromName) {
  EXPECT_NE(TensorKey("ab", "c"), TensorKey("a", "bc"));
  EXPECT_NE(TensorKey("", "abc"), TensorKey("abc", ""));
  EXPECT_NE(TensorKey("job1", "w"), TensorKey("job2", "w"));
  EXPECT_NE(TensorKey("job", "w1"), TensorKey("job", "w2"));
}


// Point-to-point frames: no dtype, the message's bytes in `count`, a payload only on kPeerData
// (the whole message) and kPeerAck (a reason), the element type in bytes 30-31 of a message's
// frames only, kFlagCleared on kPeerData only.
Header SamplePeer(MsgType t) {
  Header h;
  h.type = t;
  h.job = 7;
  h.sender = 1;
  h.key = 0xABCDEF;
  h.partition = 3;
  h.round = 9;
  h.cookie = 42;
  if (t == MsgType::kPeerData || t == MsgType::kPeerReady) {
    h.count = t == MsgType::kPeerReady ? kPeerEagerBytes + 1 : 1000;
    h.element = 7;
  }
  if (t == MsgType::kPeerData) h.payload_bytes = 1000;
  return h;
}

TEST(FrameTest, PeerFramesRoundTrip) {
  for (MsgType t : {MsgType::kPeerData, MsgType::kPeerReady, MsgType::kPeerClear,
                    MsgType::kPeerAck}) {
    const Header h = SamplePeer(t);
    Result<Header> d = DecodeHeader(EncodeHeader(h));
    ASSERT_TRUE(d.ok()) << d.status().ToString();
    EXPECT_TRUE(IsPeerType(d->type));
    EXPECT_EQ(d->element, h.element);
    EXPECT_EQ(d->count, h.count);
    EXPECT_EQ(d->key, h.key);
    EXPECT_EQ(d->partition, h.partition);
    EXPECT_EQ(d->round, h.round);
    EXPECT_EQ(d->cookie, h.cookie);
    EXPECT_EQ(d->ranks, 0);
    EXPECT_EQ(d->server_time, 0);
  }
  Header cleared = SamplePeer(MsgType::kPeerData);
  cleared.flags = kFlagCleared;
  EXPECT_TRUE(DecodeHeader(EncodeHeader(cleared)).ok());
  EXPECT_FALSE(IsPeerType(MsgType::kPush));
  EXPECT_FALSE(IsPeerType(MsgType::kRecover));
}

TEST(FrameTest, RejectsMalformedPeerFrames) {
  Header h = SamplePeer(MsgType::kPeerData);
  h.payload_bytes = 999;  // not the whole message
  ExpectProtocolError(DecodeHeader(EncodeHeader(h)), "payload of 999 bytes");
  h = SamplePeer(MsgType::kPeerData);
  h.dtype = 1;
  ExpectProtocolError(DecodeHeader(EncodeHeader(h)), "dtype byte 1");
  h = SamplePeer(MsgType::kPeerReady);
  h.payload_bytes = 8;
  ExpectProtocolError(DecodeHeader(EncodeHeader(h)), "a payload of 8 bytes");
  h = SamplePeer(MsgType::kPeerReady);
  h.count = kMaxDataPayload + 1;
  ExpectProtocolError(DecodeHeader(EncodeHeader(h)), "a message of");
  // Eager up to kPeerEagerBytes, announced above it: a peer can make a receiver buffer no more.
  h = SamplePeer(MsgType::kPeerData);
  h.count = h.payload_bytes = kPeerEagerBytes + 1;
  ExpectProtocolError(DecodeHeader(EncodeHeader(h)), "an eager message");
  h.flags = kFlagCleared;
  EXPECT_TRUE(DecodeHeader(EncodeHeader(h)).ok());
  h = SamplePeer(MsgType::kPeerReady);
  h.count = kPeerEagerBytes;
  ExpectProtocolError(DecodeHeader(EncodeHeader(h)), "an announced message");
  h = SamplePeer(MsgType::kPeerClear);
  h.flags = kFlagCleared;
  ExpectProtocolError(DecodeHeader(EncodeHeader(h)), "flags");
  h = SamplePeer(MsgType::kPeerAck);
  h.payload_bytes = kMaxControlPayload + 1;
  ExpectProtocolError(DecodeHeader(EncodeHeader(h)), "reason too long");
  // The element type rides only on a message's frames: on a clear it is refused.
  HeaderBytes b = EncodeHeader(SamplePeer(MsgType::kPeerClear));
  PutLe(b, kOffTypeWord, 5, 2);
  ExpectProtocolError(DecodeHeader(b), "bytes 30-31");
}

}  // namespace
}  // namespace gradlink::wire
