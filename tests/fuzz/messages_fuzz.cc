// Fuzz target: the control-payload decoders. None may crash, over-read or allocate without bound;
// whatever decodes re-encodes to the same bytes.
#include <cstddef>
#include <cstdint>
#include <algorithm>
#include <cstdlib>
#include <span>

#include "wire/messages.h"

namespace {

template <typename Msg>
void CheckRoundTrip(const gradlink::Result<Msg>& m, std::span<const std::byte> in) {
  if (!m.ok()) return;
  const std::vector<std::byte> out = gradlink::wire::Encode(*m);
  if (out.size() != in.size() || !std::equal(out.begin(), out.end(), in.begin())) std::abort();
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 1) return 0;
  const uint8_t which = data[0] % 8;
  std::span<const std::byte> b(reinterpret_cast<const std::byte*>(data + 1), size - 1);
  namespace w = gradlink::wire;
  switch (which) {
    case 0: CheckRoundTrip(w::DecodeRegister(b), b); break;
    case 1: {
      CheckRoundTrip(w::DecodeWelcome(b), b);
      // A member entry alone (kServerJoined) is the same encoding as one of the book's.
      auto m = w::DecodeMember(b);
      if (m.ok()) {
        const std::vector<std::byte> out = w::EncodeMember(*m);
        if (out.size() != b.size() || !std::equal(out.begin(), out.end(), b.begin())) std::abort();
      }
      break;
    }
    case 2: CheckRoundTrip(w::DecodeDeclare(b), b); break;
    case 3: {
      // The expected total and server count come from the header; derive them from byte 0.
      const uint64_t total = 97u * (1 + data[0] / 5 % 4);
      CheckRoundTrip(w::DecodeAssign(b, total, 1 + data[0] / 20 % 8), b);
      break;
    }
    case 4: {
      auto t = w::DecodeText(b);
      if (t.ok()) {
        auto out = w::EncodeText(*t);
        if (out.size() != b.size()) std::abort();
      }
      break;
    }
    case 5: CheckRoundTrip(w::DecodeJoin(b), b); break;
    case 6: {
      const uint64_t total = 97u * (1 + data[0] / 7 % 4);
      CheckRoundTrip(w::DecodeResumeKey(b, total, 1 + data[0] / 28 % 8), b);
      break;
    }
    case 7: CheckRoundTrip(w::DecodeStallReport(b, 1 + data[0] / 8 % 16), b); break;
  }
  return 0;
}
