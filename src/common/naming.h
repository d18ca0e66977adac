// Small helpers for naming things in messages.
#pragma once

#include <cstdint>
#include <cstdio>
#include <string>
#include <string_view>
#include <unistd.h>

namespace gradlink {

inline std::string KeyHex(uint64_t key) {
  char buf[24];
  std::snprintf(buf, sizeof(buf), "0x%016llx", static_cast<unsigned long long>(key));
  return buf;
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
