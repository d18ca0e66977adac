// A server's threads as it runs them: how many engines it started, their names, and the CPUs
// each may run on, read back from /proc/self/task (what the kernel enforces, not what the
// server says it asked for).
#include <gtest/gtest.h>

#include <dirent.h>

#include <algorithm>
#include <chrono>
#include <fstream>
#include <map>
#include <string>
#include <thread>
#include <vector>

#include "common/cpus.h"
#include "gradlink/server.h"
#include "server/start_on.h"
#include "unit/support/job_harness.h"

namespace gradlink {
namespace {

using test::In;
using test::Job;
using test::JobConfig;
using test::kOpTimeout;
using test::OnEveryWorker;

// Every thread of this process named `prefix`*: its name -> the CPUs it may run on.
std::multimap<std::string, std::vector<uint32_t>> ThreadsNamed(const std::string& prefix) {
  std::multimap<std::string, std::vector<uint32_t>> out;
  DIR* d = opendir("/proc/self/task");
  if (d == nullptr) return out;
  while (dirent* e = readdir(d)) {
    if (e->d_name[0] == '.') continue;
    const std::string dir = std::string("/proc/self/task/") + e->d_name;
    std::string name;
    std::getline(std::ifstream(dir + "/comm"), name);
    if (name.rfind(prefix, 0) != 0) continue;
    std::ifstream status(dir + "/status");
    for (std::string line; std::getline(status, line);) {
      if (line.rfind("Cpus_allowed_list:", 0) != 0) continue;
      const std::string list = line.substr(line.find_first_not_of(" \t", 18));
      auto cpus = ParseCpuList("Cpus_allowed_list", list);
      EXPECT_TRUE(cpus.ok()) << cpus.status().ToString();
      out.emplace(name, cpus.ok() ? *cpus : std::vector<uint32_t>{});
    }
  }
  closedir(d);
  return out;
}

// The server's threads are named and placed by closures queued to them: wait until `want`
// threads have a name starting with "gl-engine" or "gl-srv".
std::multimap<std::string, std::vector<uint32_t>> ServerThreads(size_t want) {
  const auto deadline = In(std::chrono::seconds(5));
  std::multimap<std::string, std::vector<uint32_t>> t;
  while (true) {
    t = ThreadsNamed("gl-engine");
    t.merge(ThreadsNamed("gl-srv"));
    if (t.size() >= want || Clock::now() > deadline) return t;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
}

// One push_pull of 4 partitions of 64 KiB (summed on engines, not inline), checked.
void SumOnce(Job& job) {
  constexpr uint64_t kCount = 4 * (64 << 10) / sizeof(float);
  OnEveryWorker(2, [&](uint32_t r) {
    auto h = job.worker(r).Declare("threads", DataType::kFloat32, kCount);
    ASSERT_TRUE(h.ok()) << h.status().ToString();
    std::vector<float> d(kCount);
    for (uint64_t i = 0; i < kCount; ++i) d[i] = static_cast<float>((i * 7 + r) % 101);
    const Status s =
        job.worker(r).PushPull(*h, std::as_writable_bytes(std::span<float>(d))).Wait(In(kOpTimeout));
    ASSERT_TRUE(s.ok()) << s.ToString();
    for (uint64_t i = 0; i < kCount; ++i) {
      ASSERT_EQ(d[i], static_cast<float>((i * 7) % 101) + static_cast<float>((i * 7 + 1) % 101))
          << "element " << i;
    }
  });
}

TEST(ServerThreadsTest, APinnedServerRunsEachThreadOnOneCpuOfItsList) {
  const std::vector<uint32_t> allowed = AllowedCpus();
  JobConfig config;
  config.per_server = [&](size_t, ServerOptions& o) {
    o.engine_threads = 0;
    o.cpus = FormatCpuList(allowed);
  };
  Job job;
  ASSERT_NO_FATAL_FAILURE(job.Start(config));
  ASSERT_NO_FATAL_FAILURE(SumOnce(job));
  const ServerStats stats = job.server(0).stats();
  ASSERT_GE(stats.engine_threads, 1u);
  EXPECT_NE(stats.threads.find("pinned to CPUs " + FormatCpuList(allowed)), std::string::npos)
      << stats.threads;
  const auto threads = ServerThreads(stats.engine_threads + 2);
  ASSERT_EQ(threads.count("gl-srv-push"), 1u);
  ASSERT_EQ(threads.count("gl-srv-pull"), 1u);
  size_t engines = 0;
  for (const auto& [name, cpus] : threads) {
    engines += name.rfind("gl-engine", 0) == 0;
    ASSERT_EQ(cpus.size(), 1u) << name << " may run on " << FormatCpuList(cpus);
    EXPECT_TRUE(std::binary_search(allowed.begin(), allowed.end(), cpus[0])) << name;
  }
  EXPECT_EQ(engines, stats.engine_threads);
  // Each lane on a CPU of its own where there are two.
  if (allowed.size() >= 2) {
    EXPECT_NE(threads.find("gl-srv-push")->second, threads.find("gl-srv-pull")->second);
  }
  job.FinishCleanly();
}

TEST(ServerThreadsTest, AnUnpinnedServerSizesItsEnginesAndLeavesTheirCpusAlone) {
  const std::vector<uint32_t> allowed = AllowedCpus();
  JobConfig config;
  config.per_server = [](size_t, ServerOptions& o) { o.engine_threads = 0; };
  // The workers on the server's machine (mixed placement): "server-host-0" is its machine.
  config.per_worker = [](uint32_t r, WorkerOptions& o) {
    o.host_name = "server-host-0/" + std::to_string(r);
  };
  Job job;
  ASSERT_NO_FATAL_FAILURE(job.Start(config));
  ASSERT_NO_FATAL_FAILURE(SumOnce(job));
  const ServerStats stats = job.server(0).stats();
  // One machine holds the job's 2 workers and its server: a third of the CPUs each, less the
  // server's 2 lanes, and never fewer than one engine.
  const uint32_t share = std::max<uint32_t>(static_cast<uint32_t>(allowed.size()) / 3, 1);
  EXPECT_EQ(stats.engine_threads, std::min<uint32_t>(share > 2 ? share - 2 : 1, 16))
      << stats.threads;
  EXPECT_NE(stats.threads.find("not pinned"), std::string::npos) << stats.threads;
  EXPECT_NE(stats.threads.find("shared by 3 processes"), std::string::npos) << stats.threads;
  const auto threads = ServerThreads(stats.engine_threads + 2);
  size_t engines = 0;
  for (const auto& [name, cpus] : threads) {
    engines += name.rfind("gl-engine", 0) == 0;
    EXPECT_EQ(cpus, allowed) << name;
  }
  EXPECT_EQ(engines, stats.engine_threads);
  job.FinishCleanly();
}

TEST(ServerThreadsTest, AnEngineCountThatIsSetIsWhatRuns) {
  JobConfig config;
  config.per_server = [](size_t, ServerOptions& o) { o.engine_threads = 3; };
  Job job;
  ASSERT_NO_FATAL_FAILURE(job.Start(config));
  ASSERT_NO_FATAL_FAILURE(SumOnce(job));
  EXPECT_EQ(job.server(0).stats().engine_threads, 3u);
  const auto threads = ServerThreads(5);
  EXPECT_EQ(threads.size(), 5u);  // 3 engines and 2 lanes
  job.FinishCleanly();
}

TEST(ServerThreadsTest, ABadCpuListFailsTheStartNamingIt) {
  for (const char* bad : {"0-x", "3-1", "1023"}) {
    ServerOptions o;
    o.scheduler = "127.0.0.1:1";  // never reached: the list is checked first
    o.cpus = bad;
    if (std::string(bad) == "1023" && AllowedCpus().back() == 1023) continue;
    auto s = StartServerOn(o, nullptr);
    ASSERT_FALSE(s.ok()) << bad;
    EXPECT_EQ(s.status().code(), Code::kInvalidArgument) << s.status().ToString();
    EXPECT_NE(s.status().message().find("server CPUs"), std::string::npos)
        << s.status().ToString();
  }
}

}  // namespace
}  // namespace gradlink
