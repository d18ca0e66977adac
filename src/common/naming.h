// Small helpers for naming things in messages.
#pragma once

#include <cstdint>
#include <cstdio>
#include <string>
#include <unistd.h>

namespace gradlink {

inline std::string KeyHex(uint64_t key) {
  char buf[24];
  std::snprintf(buf, sizeof(buf), "0x%016llx", static_cast<unsigned long long>(key));
  return buf;
}

inline std::string LocalHostName() {
  char buf[256] = {};
  if (gethostname(buf, sizeof(buf) - 1) != 0) return "unknown-host";
  return std::string(buf) + "/" + std::to_string(getpid());
}

}  // namespace gradlink
