// CPUs: the ones this process may run on, CPU lists as Linux writes them ("0-3,8"), and pinning
// the calling thread. For sizing and pinning a process's own threads (the server's engines and
// lanes: server/thread_plan.h).
//
// Threads: any. PinThisThread and NameThisThread act on the calling thread only.
// Errors: ParseCpuList returns kInvalidArgument naming `what` and the bad part; PinThisThread
// returns kInvalidArgument (a CPU this process may not use) or kInternal with errno's text.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "gradlink/status.h"

namespace gradlink {

// The most CPUs a list may name (glibc's cpu_set_t).
inline constexpr uint32_t kMaxCpus = 1024;

// "0-3,8,10-11" -> {0, 1, 2, 3, 8, 10, 11}: ascending, each CPU once. Refused: an empty list or
// entry, anything but digits, '-' and ',', a range whose end is below its start, a CPU of
// kMaxCpus or more.
Result<std::vector<uint32_t>> ParseCpuList(std::string_view what, std::string_view list);

// The shortest list naming `cpus` (ascending): {0, 1, 2, 3, 8} -> "0-3,8".
std::string FormatCpuList(std::span<const uint32_t> cpus);

// The CPUs the calling thread may run on (its affinity mask; at least one).
std::vector<uint32_t> AllowedCpus();

// Restricts the calling thread to `cpus` (not empty).
Status PinThisThread(std::span<const uint32_t> cpus);

// Names the calling thread (as ps, top and /proc/self/task/*/comm show it); at most 15 bytes
// are kept.
void NameThisThread(const std::string& name);

}  // namespace gradlink
