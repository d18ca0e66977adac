// Small helpers for naming things in messages.
#pragma once

#include <cstdint>
#include <cstdio>
#include <limits>
#include <span>
#include <string>
#include <string_view>
#include <sys/stat.h>
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

// The inode of this process's network namespace when it is not the machine's own (a process
// started with `ip netns exec`: an emulated host); 0 when it is. The machine's own is PID 1's
// when that can be read, else the initial namespace, whose inode Linux fixes at 0xEFFFFFF9
// (PROC_NET_INIT_INO). Where neither tells (an old kernel in a container), every process of the
// container names the same namespace: still one host, with a longer name.
inline uint64_t OwnNetworkNamespace() {
  constexpr uint64_t kInitialNetworkNamespace = 0xEFFFFFF9;
  struct stat self {}, init {};
  if (::stat("/proc/self/ns/net", &self) != 0) return 0;
  const uint64_t own = static_cast<uint64_t>(self.st_ino);
  if (::stat("/proc/1/ns/net", &init) == 0) return own == init.st_ino ? 0 : own;
  return own == kInitialNetworkNamespace ? 0 : own;
}

// "machine/pid": how a process names itself in the address book unless told otherwise
// (WorkerOptions::host_name, GRADLINK_HOST). The machine part is what decides which workers
// share a host (the same-host path): the host name, and the network namespace where it is not
// the machine's own ("vm~netns4026532441/1234"), since the namespaces of one machine share its
// host name but not its network: workers in two of them are two hosts.
inline std::string LocalHostName() {
  char buf[256] = {};
  if (gethostname(buf, sizeof(buf) - 1) != 0) return "unknown-host";
  std::string name(buf);
  if (const uint64_t ns = OwnNetworkNamespace(); ns != 0) name += "~netns" + std::to_string(ns);
  return name + "/" + std::to_string(getpid());
}

// The machine part of an address-book host name ("machine/pid", or a name given by the user,
// which is all machine).
inline std::string_view MachineOf(std::string_view host) {
  return host.substr(0, host.find('/'));
}

}  // namespace gradlink
