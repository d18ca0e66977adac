#include "transport/ucx/segments.h"

#include <algorithm>
#include <cstring>

namespace gradlink::transport::ucx {
namespace {

constexpr std::byte kMagic[4] = {std::byte{'G'}, std::byte{'L'}, std::byte{'S'}, std::byte{'1'}};
constexpr size_t kTrailerBytes = sizeof(kMagic) + 2 * sizeof(uint32_t);
constexpr uint64_t kUcxDefaultTx = 8 << 10, kUcxDefaultRx = 64 << 10;

void PutU32(std::vector<std::byte>& out, uint64_t v) {
  const uint32_t x = static_cast<uint32_t>(std::min<uint64_t>(v, UINT32_MAX));
  for (int i = 0; i < 4; ++i) out.push_back(static_cast<std::byte>((x >> (8 * i)) & 0xff));
}

uint32_t GetU32(const std::byte* p) {
  uint32_t x = 0;
  for (int i = 0; i < 4; ++i) x |= static_cast<uint32_t>(p[i]) << (8 * i);
  return x;
}

std::string Kib(uint64_t bytes) {
  return bytes % 1024 == 0 ? std::to_string(bytes / 1024) + " KiB"
                           : std::to_string(bytes) + " bytes";
}

}  // namespace

std::optional<uint64_t> ParseUcxSize(std::string_view v) {
  size_t i = 0;
  uint64_t n = 0;
  while (i < v.size() && v[i] >= '0' && v[i] <= '9') {
    if (n > (UINT64_MAX - 9) / 10) return std::nullopt;
    n = n * 10 + static_cast<uint64_t>(v[i++] - '0');
  }
  if (i == 0) return std::nullopt;
  uint64_t unit = 1;
  if (i < v.size()) {
    switch (v[i] | 0x20) {
      case 'b': break;
      case 'k': unit = 1ull << 10; break;
      case 'm': unit = 1ull << 20; break;
      case 'g': unit = 1ull << 30; break;
      default: return std::nullopt;
    }
    ++i;
    if (unit != 1 && i < v.size() && (v[i] | 0x20) == 'b') ++i;
  }
  if (i != v.size() || n > UINT64_MAX / unit) return std::nullopt;
  return n * unit;
}

Segments SegmentsOf(std::optional<std::string> tx, std::optional<std::string> rx) {
  const std::optional<uint64_t> t = tx ? ParseUcxSize(*tx) : kUcxDefaultTx;
  const std::optional<uint64_t> r = rx ? ParseUcxSize(*rx) : kUcxDefaultRx;
  if (!t || !r) return {};
  return {std::max(*t, *r), *r};
}

void AppendSegments(std::vector<std::byte>& address, const Segments& own) {
  address.insert(address.end(), std::begin(kMagic), std::end(kMagic));
  PutU32(address, own.receive);
  PutU32(address, own.send);
}

PeerAddress SplitSegments(std::span<const std::byte> address) {
  if (address.size() <= kTrailerBytes) return {address, std::nullopt};
  const std::byte* t = address.data() + address.size() - kTrailerBytes;
  if (std::memcmp(t, kMagic, sizeof(kMagic)) != 0) return {address, std::nullopt};
  Segments s;
  s.receive = GetU32(t + sizeof(kMagic));
  s.send = GetU32(t + sizeof(kMagic) + 4);
  return {address.first(address.size() - kTrailerBytes), s};
}

Status CheckSegments(const Segments& own, const std::optional<Segments>& peer,
                     const std::string& peer_name) {
  // An address without the trailer is an older build's, which left UCX's receive segment at
  // its default.
  const uint64_t receive = peer ? peer->receive : kUcxDefaultRx;
  if (own.send == 0 || receive == 0 || own.send <= receive) return Status::Ok();
  return Mismatch("UCX TCP segments differ: '" + peer_name + "' receives segments of at most " +
                  Kib(receive) + (peer ? "" : " (an older gradlink build: UCX's default)") +
                  " and this process sends up to " + Kib(own.send) +
                  " (UCX_TCP_TX_SEG_SIZE / UCX_TCP_RX_SEG_SIZE); UCX would abort the receiver. "
                  "Set them alike on every member of the job, or leave them to gradlink "
                  "(68k), and run one gradlink build");
}

}  // namespace gradlink::transport::ucx
