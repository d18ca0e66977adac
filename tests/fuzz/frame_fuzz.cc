// Fuzz target: the frame header decoder. Whatever the bytes, DecodeHeader returns a Status or a
// header that re-encodes to the same bytes, and never reads past its input.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <span>

#include "wire/frame.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::span<const std::byte> bytes(reinterpret_cast<const std::byte*>(data), size);
  gradlink::Result<gradlink::wire::Header> h = gradlink::wire::DecodeHeader(bytes);
  if (!h.ok()) return 0;
  if (size < gradlink::wire::kHeaderSize) std::abort();  // accepted a truncated header
  const gradlink::wire::HeaderBytes again = gradlink::wire::EncodeHeader(*h);
  if (std::memcmp(again.data(), data, again.size()) != 0) std::abort();  // lossy round trip
  return 0;
}
