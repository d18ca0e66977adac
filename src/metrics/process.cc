// metrics/process.h: /proc/self, read per scrape.
#include "metrics/process.h"

#include <dirent.h>
#include <unistd.h>

#include <ctime>
#include <fstream>
#include <map>
#include <sstream>

namespace gradlink::metrics {
namespace {

// utime + stime of a /proc/.../stat line, in seconds; the command name may hold spaces and
// parentheses, so the fields are counted from the last ')'.
double StatCpuSeconds(const std::string& stat) {
  const size_t close = stat.rfind(')');
  if (close == std::string::npos) return 0;
  std::istringstream in(stat.substr(close + 1));
  std::string field;
  unsigned long long utime = 0, stime = 0;
  // After ")": state(3) ppid pgrp session tty_nr tpgid flags minflt cminflt majflt cmajflt
  // utime(14) stime(15).
  for (int i = 3; i <= 15 && (in >> field); ++i) {
    if (i == 14) utime = std::stoull(field);
    if (i == 15) stime = std::stoull(field);
  }
  static const double tick = static_cast<double>(sysconf(_SC_CLK_TCK));
  return static_cast<double>(utime + stime) / (tick > 0 ? tick : 100.0);
}

std::string ReadFirstLine(const std::string& path) {
  std::ifstream f(path);
  std::string line;
  std::getline(f, line);
  return line;
}

}  // namespace

double ProcessCpuSeconds() {
  timespec t{};
  if (clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &t) != 0) return 0;
  return static_cast<double>(t.tv_sec) + static_cast<double>(t.tv_nsec) * 1e-9;
}

double ResidentBytes() {
  std::ifstream f("/proc/self/statm");
  unsigned long long size = 0, resident = 0;
  if (!(f >> size >> resident)) return 0;
  return static_cast<double>(resident) * static_cast<double>(sysconf(_SC_PAGESIZE));
}

std::vector<ThreadCpu> ThreadsCpu(const std::string& prefix) {
  std::map<std::string, double> by_name;
  DIR* d = opendir("/proc/self/task");
  if (d == nullptr) return {};
  while (dirent* e = readdir(d)) {
    if (e->d_name[0] == '.') continue;
    const std::string dir = std::string("/proc/self/task/") + e->d_name;
    const std::string name = ReadFirstLine(dir + "/comm");
    if (name.compare(0, prefix.size(), prefix) != 0) continue;
    try {
      by_name[name] += StatCpuSeconds(ReadFirstLine(dir + "/stat"));
    } catch (const std::exception&) {
      // A thread that ended between the two reads: left out.
    }
  }
  closedir(d);
  std::vector<ThreadCpu> out;
  for (auto& [name, s] : by_name) out.push_back({name, s});
  return out;
}

void AddProcessFamilies(Families& f, const Labels& labels,
                        const std::string& thread_prefix) {
  AddCounter(f, "gradlink_process_cpu_seconds_total", "CPU time of this process, all its threads.",
             labels, ProcessCpuSeconds());
  AddGauge(f, "gradlink_process_resident_memory_bytes", "Resident memory of this process.", labels,
           ResidentBytes());
  Family& threads = Add(f, "gradlink_thread_cpu_seconds_total",
                        "CPU time of each of gradlink's own threads, by thread name.", "counter");
  for (const ThreadCpu& t : ThreadsCpu(thread_prefix)) {
    threads.Put(With(labels, "thread", t.name), t.seconds);
  }
}

}  // namespace gradlink::metrics
