// What every role reports about its process: CPU seconds (all threads, and each thread of its
// own by name), resident memory. Read from /proc at scrape time: nothing on the data path.
//
// Threads: any.
#pragma once

#include <string>
#include <vector>

#include "metrics/exposition.h"

namespace gradlink::metrics {

struct ThreadCpu {
  std::string name;  // the thread's name (NameThisThread: "gl-engine-0", "gl-srv-push")
  double seconds = 0;
};

// CPU seconds of the whole process (user + system); 0 if unknown.
double ProcessCpuSeconds();
// Resident set size in bytes; 0 if unknown.
double ResidentBytes();
// Every thread of this process whose name starts with `prefix`, with its CPU seconds; threads
// that share a name are added up.
std::vector<ThreadCpu> ThreadsCpu(const std::string& prefix);

// gradlink_process_cpu_seconds_total, gradlink_process_resident_memory_bytes and, per thread
// named `prefix`*, gradlink_thread_cpu_seconds_total{thread=...}, each with `labels`.
void AddProcessFamilies(Families& families, const Labels& labels,
                        const std::string& thread_prefix);

}  // namespace gradlink::metrics
