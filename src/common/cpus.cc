#include "common/cpus.h"

#include <pthread.h>
#include <sched.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

namespace gradlink {
namespace {

// A CPU number: digits only, below kMaxCpus.
Result<uint32_t> ParseCpu(std::string_view what, std::string_view list, std::string_view s) {
  const auto bad = [&](const std::string& why) {
    return InvalidArgument(std::string(what) + "='" + std::string(list) + "': '" +
                           std::string(s) + "' " + why);
  };
  if (s.empty()) return bad("is empty (expected a CPU number)");
  uint64_t v = 0;
  for (char c : s) {
    if (c < '0' || c > '9') return bad("is not a CPU number");
    v = v * 10 + static_cast<uint64_t>(c - '0');
    if (v >= kMaxCpus) return bad("is past the last CPU a list may name (" +
                                  std::to_string(kMaxCpus - 1) + ")");
  }
  return static_cast<uint32_t>(v);
}

}  // namespace

Result<std::vector<uint32_t>> ParseCpuList(std::string_view what, std::string_view list) {
  if (list.empty()) {
    return InvalidArgument(std::string(what) + " is empty (expected CPUs, e.g. '0-3,8')");
  }
  std::vector<bool> named(kMaxCpus, false);
  size_t start = 0;
  while (start <= list.size()) {
    const size_t comma = std::min(list.find(',', start), list.size());
    const std::string_view entry = list.substr(start, comma - start);
    const size_t dash = entry.find('-');
    GL_ASSIGN_OR_RETURN(uint32_t first, ParseCpu(what, list, entry.substr(0, dash)));
    uint32_t last = first;
    if (dash != std::string_view::npos) {
      GL_ASSIGN_OR_RETURN(last, ParseCpu(what, list, entry.substr(dash + 1)));
      if (last < first) {
        return InvalidArgument(std::string(what) + "='" + std::string(list) + "': the range '" +
                               std::string(entry) + "' ends before it starts");
      }
    }
    for (uint32_t c = first; c <= last; ++c) named[c] = true;
    start = comma + 1;
  }
  std::vector<uint32_t> cpus;
  for (uint32_t c = 0; c < kMaxCpus; ++c) {
    if (named[c]) cpus.push_back(c);
  }
  return cpus;
}

std::string FormatCpuList(std::span<const uint32_t> cpus) {
  std::string out;
  for (size_t i = 0; i < cpus.size();) {
    size_t j = i;
    while (j + 1 < cpus.size() && cpus[j + 1] == cpus[j] + 1) ++j;
    if (!out.empty()) out += ',';
    out += std::to_string(cpus[i]);
    if (j > i) out += '-' + std::to_string(cpus[j]);
    i = j + 1;
  }
  return out;
}

std::vector<uint32_t> AllowedCpus() {
  cpu_set_t set;
  CPU_ZERO(&set);
  std::vector<uint32_t> cpus;
  if (sched_getaffinity(0, sizeof(set), &set) == 0) {
    for (uint32_t c = 0; c < kMaxCpus; ++c) {
      if (CPU_ISSET(c, &set)) cpus.push_back(c);
    }
  }
  if (cpus.empty()) cpus.push_back(0);  // no mask to read: this thread runs somewhere
  return cpus;
}

Status PinThisThread(std::span<const uint32_t> cpus) {
  if (cpus.empty()) return InvalidArgument("no CPU to pin the thread to");
  cpu_set_t set;
  CPU_ZERO(&set);
  for (uint32_t c : cpus) {
    if (c >= kMaxCpus) return InvalidArgument("CPU " + std::to_string(c) + " is out of range");
    CPU_SET(c, &set);
  }
  if (sched_setaffinity(0, sizeof(set), &set) != 0) {
    const int err = errno;
    const std::string which = "CPUs " + FormatCpuList(cpus);
    if (err == EINVAL) {
      return InvalidArgument(which + ": none of them is one this process may run on (" +
                             FormatCpuList(AllowedCpus()) + ")");
    }
    return Internal("sched_setaffinity(" + which + "): " + std::strerror(err));
  }
  return Status::Ok();
}

void NameThisThread(const std::string& name) {
  pthread_setname_np(pthread_self(), name.substr(0, 15).c_str());
}

}  // namespace gradlink
