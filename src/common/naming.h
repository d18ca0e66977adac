// Small helpers for naming things in messages.
#pragma once

#include <cstdint>
#include <cstdio>
#include <limits>
#include <span>
#include <string>
#include <string_view>
#include <unistd.h>

namespace gradlink {

inline std::string KeyHex(uint64_t key) {
  char buf[24];
  std::snprintf(buf, sizeof(buf), "0x%016llx", static_cast<unsigned long long>(key));
  return buf;
}

// "(3, 4)", as Python prints a shape (a 1-D one as "(12,)").
inline std::string FormatShape(std::span<const uint64_t> shape) {
  std::string out = "(";
  for (size_t i = 0; i < shape.size(); ++i) out += (i ? ", " : "") + std::to_string(shape[i]);
  return out + (shape.size() == 1 ? ",)" : ")");
}

// " shape (3, 4)" after a dtype[count] in a message; empty for no shape.
inline std::string ShapeSuffix(std::span<const uint64_t> shape) {
  return shape.empty() ? std::string() : " shape " + FormatShape(shape);
}

// The number of elements of `shape`; UINT64_MAX when the product overflows.
inline uint64_t ShapeElements(std::span<const uint64_t> shape) {
  for (uint64_t d : shape) {
    if (d == 0) return 0;
  }
  uint64_t n = 1;
  for (uint64_t d : shape) {
    if (d != 0 && n > std::numeric_limits<uint64_t>::max() / d) {
      return std::numeric_limits<uint64_t>::max();
    }
    n *= d;
  }
  return n;
}

// "machine/pid": how a process names itself in the address book (unless told otherwise).
inline std::string LocalHostName() {
  char buf[256] = {};
  if (gethostname(buf, sizeof(buf) - 1) != 0) return "unknown-host";
  return std::string(buf) + "/" + std::to_string(getpid());
}

// The machine part of an address-book host name ("machine/pid", or a name given by the user,
// which is all machine).
inline std::string_view MachineOf(std::string_view host) {
  return host.substr(0, host.find('/'));
}

}  // namespace gradlink
