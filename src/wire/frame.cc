#include "wire/frame.h"

#include <algorithm>
#include <string>

namespace gradlink::wire {
namespace {

template <typename T>
void Put(std::byte* p, T v) {
  for (size_t i = 0; i < sizeof(T); ++i) p[i] = std::byte((v >> (8 * i)) & 0xFF);
}

template <typename T>
T Get(const std::byte* p) {
  T v = 0;
  for (size_t i = 0; i < sizeof(T); ++i) v |= T(std::to_integer<uint8_t>(p[i])) << (8 * i);
  return v;
}

// Offsets of the header fields; see docs/wire_format.md.
enum Offset : size_t {
  kOffMagic = 0,
  kOffVersion = 4,
  kOffType = 5,
  kOffFlags = 6,
  kOffJob = 8,
  kOffSender = 12,
  kOffKey = 16,
  kOffPartition = 24,
  kOffDtype = 28,
  kOffCode = 29,
  kOffTypeWord = 30,  // u16: kPullResponse's server time, kPush's ranks, else zero
  kOffRound = 32,
  kOffCount = 40,
  kOffPayload = 48,
  kOffCookie = 56,
};

bool IsKnownType(uint8_t t) {
  return (t >= 1 && t <= 27) || (t >= 32 && t <= 40);
}

}  // namespace

uint16_t EncodeServerTime(uint64_t micros) {
  uint32_t e = 0;
  while (e < 15 && (micros >> e) > 0xFFF) ++e;
  const uint64_t m = std::min<uint64_t>(micros >> e, 0xFFF);
  return static_cast<uint16_t>(e << 12 | m);
}

uint64_t DecodeServerTime(uint16_t code) { return uint64_t{code & 0xFFFu} << (code >> 12); }

bool IsControlType(MsgType t) { return static_cast<uint8_t>(t) < 32; }
bool IsDataType(MsgType t) { return static_cast<uint8_t>(t) >= 32; }
bool IsPeerType(MsgType t) { return t >= MsgType::kPeerData && t <= MsgType::kPeerAck; }

namespace {
// Bytes 30-31 of `h`'s frame: what its type keeps there.
uint16_t TypeWord(const Header& h) {
  switch (h.type) {
    case MsgType::kPullResponse: return h.server_time;
    case MsgType::kPush: return h.ranks;
    case MsgType::kPeerData:
    case MsgType::kPeerReady: return h.element;
    default: return 0;
  }
}
}  // namespace

HeaderBytes EncodeHeader(const Header& h) {
  HeaderBytes b{};
  std::byte* p = b.data();
  Put<uint32_t>(p + kOffMagic, kMagic);
  Put<uint8_t>(p + kOffVersion, kVersion);
  Put<uint8_t>(p + kOffType, static_cast<uint8_t>(h.type));
  Put<uint16_t>(p + kOffFlags, h.flags);
  Put<uint32_t>(p + kOffJob, h.job);
  Put<uint32_t>(p + kOffSender, h.sender);
  Put<uint64_t>(p + kOffKey, h.key);
  Put<uint32_t>(p + kOffPartition, h.partition);
  Put<uint8_t>(p + kOffDtype, h.dtype);
  Put<uint8_t>(p + kOffCode, h.code);
  Put<uint16_t>(p + kOffTypeWord, TypeWord(h));
  Put<uint64_t>(p + kOffRound, h.round);
  Put<uint64_t>(p + kOffCount, h.count);
  Put<uint64_t>(p + kOffPayload, h.payload_bytes);
  Put<uint64_t>(p + kOffCookie, h.cookie);
  return b;
}

Status CheckDataShape(DataType dtype, uint64_t count, uint64_t payload_bytes) {
  const uint64_t size = DataTypeSize(dtype);
  if (size == 0) return ProtocolError("invalid dtype");
  // count * size == payload_bytes, written so that no product can overflow.
  if (payload_bytes % size != 0 || payload_bytes / size != count) {
    return ProtocolError("payload of " + std::to_string(payload_bytes) + " bytes does not hold " +
                         std::to_string(count) + " elements of " +
                         std::string(DataTypeName(dtype)));
  }
  return Status::Ok();
}

namespace {
// A point-to-point frame's fields: no dtype (its bytes are the caller's), a message of at most
// kMaxDataPayload bytes, sent whole by kPeerData (payload == count) or announced by kPeerReady.
Result<Header> CheckPeerFrame(const Header& h) {
  const auto bad = [&](const std::string& what) {
    return ProtocolError("peer frame of type " + std::to_string(static_cast<int>(h.type)) + ": " +
                         what);
  };
  if (h.dtype != 0) return bad("dtype byte " + std::to_string(h.dtype) + " (must be 0)");
  if (h.count > kMaxDataPayload) return bad("a message of " + std::to_string(h.count) + " bytes");
  switch (h.type) {
    case MsgType::kPeerData:
      if (h.payload_bytes != h.count) {
        return bad("payload of " + std::to_string(h.payload_bytes) + " bytes for a message of " +
                   std::to_string(h.count));
      }
      if ((h.flags & kFlagCleared) == 0 && h.count > kPeerEagerBytes) {
        return bad("an eager message of " + std::to_string(h.count) + " bytes (at most " +
                   std::to_string(kPeerEagerBytes) + ")");
      }
      break;
    case MsgType::kPeerReady:
      if (h.payload_bytes != 0 && h.payload_bytes != kPeerLocalBytes) {
        return bad("a payload of " + std::to_string(h.payload_bytes) + " bytes");
      }
      if (h.count <= kPeerEagerBytes) {
        return bad("an announced message of " + std::to_string(h.count) + " bytes (more than " +
                   std::to_string(kPeerEagerBytes) + " only)");
      }
      break;
    case MsgType::kPeerClear:
      if (h.payload_bytes != 0) return bad("a payload");
      break;
    default:  // kPeerAck: a reason
      if (h.payload_bytes > kMaxControlPayload) return bad("reason too long");
  }
  // kFlagCleared: on a kPeerData, the data of a cleared message; on a kPeerAck, about a
  // message its receiver cleared (the send had ended).
  if ((h.flags & ~kFlagCleared) != 0 ||
      (h.flags != 0 && h.type != MsgType::kPeerData && h.type != MsgType::kPeerAck)) {
    return bad("flags " + std::to_string(h.flags));
  }
  return h;
}
}  // namespace

Result<Header> DecodeHeader(std::span<const std::byte> bytes) {
  if (bytes.size() < kHeaderSize) {
    return ProtocolError("frame header truncated: " + std::to_string(bytes.size()) + " of " +
                         std::to_string(kHeaderSize) + " bytes");
  }
  const std::byte* p = bytes.data();
  const uint32_t magic = Get<uint32_t>(p + kOffMagic);
  if (magic != kMagic) return ProtocolError("bad magic " + std::to_string(magic));
  const uint8_t version = Get<uint8_t>(p + kOffVersion);
  if (version != kVersion) {
    return ProtocolError("unsupported version " + std::to_string(version) + " (expected " +
                         std::to_string(kVersion) + ")");
  }
  const uint8_t type = Get<uint8_t>(p + kOffType);
  if (!IsKnownType(type)) return ProtocolError("unknown message type " + std::to_string(type));
  const uint16_t type_word = Get<uint16_t>(p + kOffTypeWord);
  const bool pull = type == static_cast<uint8_t>(MsgType::kPullResponse);
  const bool push = type == static_cast<uint8_t>(MsgType::kPush);
  const bool peer_message = type == static_cast<uint8_t>(MsgType::kPeerData) ||
                            type == static_cast<uint8_t>(MsgType::kPeerReady);
  if (type_word != 0 && !pull && !push && !peer_message) {
    return ProtocolError("bytes 30-31 hold " + std::to_string(type_word) + " on a frame of type " +
                         std::to_string(type) +
                         " (only a pull response, a push or a peer message uses them)");
  }

  Header h;
  h.type = static_cast<MsgType>(type);
  h.flags = Get<uint16_t>(p + kOffFlags);
  h.job = Get<uint32_t>(p + kOffJob);
  h.sender = Get<uint32_t>(p + kOffSender);
  h.key = Get<uint64_t>(p + kOffKey);
  h.partition = Get<uint32_t>(p + kOffPartition);
  h.dtype = Get<uint8_t>(p + kOffDtype);
  h.code = Get<uint8_t>(p + kOffCode);
  h.round = Get<uint64_t>(p + kOffRound);
  h.count = Get<uint64_t>(p + kOffCount);
  h.payload_bytes = Get<uint64_t>(p + kOffPayload);
  h.cookie = Get<uint64_t>(p + kOffCookie);
  h.server_time = pull ? type_word : 0;
  h.ranks = push ? type_word : 0;
  h.element = peer_message ? type_word : 0;

  if ((h.flags & ~kKnownFlags) != 0) return ProtocolError("unknown flags " + std::to_string(h.flags));
  if (h.code > kMaxCode) return ProtocolError("status code out of range: " + std::to_string(h.code));

  if (IsControlType(h.type)) {
    if (h.payload_bytes > kMaxControlPayload) {
      return ProtocolError("control payload of " + std::to_string(h.payload_bytes) +
                           " bytes exceeds " + std::to_string(kMaxControlPayload));
    }
    return h;
  }
  // Data frames.
  if (h.type == MsgType::kDataError) {
    if (h.payload_bytes > kMaxControlPayload) return ProtocolError("error message too long");
    return h;
  }
  if (h.type == MsgType::kLaneHello) {
    if (h.payload_bytes > kMaxLaneHelloPayload) return ProtocolError("lane hello too long");
    return h;
  }
  if (IsPeerType(h.type)) return CheckPeerFrame(h);
  if (h.payload_bytes > kMaxDataPayload) {
    return ProtocolError("data payload of " + std::to_string(h.payload_bytes) +
                         " bytes exceeds " + std::to_string(kMaxDataPayload));
  }
  if (!IsValidDataType(h.dtype)) return ProtocolError("invalid dtype " + std::to_string(h.dtype));
  GL_RETURN_IF_ERROR(CheckDataShape(static_cast<DataType>(h.dtype), h.count, h.payload_bytes));
  return h;
}

uint32_t JobHash(std::string_view job) {
  uint32_t h = 2166136261u;
  for (char c : job) {
    h ^= static_cast<uint8_t>(c);
    h *= 16777619u;
  }
  return h;
}

uint64_t TensorKey(std::string_view job, std::string_view name) {
  uint64_t h = 14695981039346656037ull;
  auto mix = [&h](std::string_view s) {
    for (char c : s) {
      h ^= static_cast<uint8_t>(c);
      h *= 1099511628211ull;
    }
  };
  mix(job);
  h ^= 0xFF;  // separator: ("ab","c") and ("a","bc") differ
  h *= 1099511628211ull;
  mix(name);
  return h;
}

}  // namespace gradlink::wire
