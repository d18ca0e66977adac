// gradlink-bench: push_pull bandwidth and correctness sweep, in the manner of nccl-tests'
// all_reduce_perf. Without --scheduler it starts a local job: a scheduler (in this process),
// `-s` gradlink-server processes and `-w` worker processes (this binary again).
//
// `--tensors T` splits each row's size into T tensors of size/T bytes (rounded down to whole
// elements; the row reports the bytes actually summed) pushed as one PushPullGroup, which fuses
// them (`--no-fusion`: fusion_buffer_bytes 0, so the group's T tensors go as T separate
// push_pulls). `-b 4000K -e 4000K --tensors 1000` is 1,000 tensors of 4 KiB. After each row a
// '#' line gives the bytes copied on this worker's data path per byte reduced; `--verbose` adds
// a '#' line with where the time of a round went, by stage (PushPullTiming), on rank 0.
//
// Each timed operation starts after a barrier and, unless --no-align, an untimed push_pull of
// one float: the scheduler's barrier releases the workers tens of microseconds apart (its
// messages and two thread wake-ups per worker), a skew that would be timed as part of the
// operation; after a push_pull the workers start within its completion skew, as back-to-back
// operations of a training step do (and as MPI_Barrier's shared-memory release does).
//
// `--bind` pins worker r to CPU r mod (CPUs this process may use), as mpirun binds ranks to
// cores by default: two workers that spin on shared memory must not end up on one core.
#include <sched.h>
#include <sys/wait.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <new>
#include <optional>
#include <fstream>
#include <climits>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <span>
#include <string>
#include <vector>

#include "gradlink/env.h"
#include "gradlink/scheduler.h"
#include "gradlink/worker.h"

namespace gl = gradlink;
using Clock = std::chrono::steady_clock;

namespace {

struct Config {
  uint32_t workers = 2, servers = 1;
  std::string begin = "4K", end = "64M", dtype_name = "fp32", scheduler, job = "default";
  double factor = 2;
  int iters = 20, warmup = 3;
  bool average = false, single_lane = false;
  // The library's defaults: what a user gets with no flags (unset: gradlink chooses).
  std::optional<uint64_t> partition_bytes, max_in_flight, max_ahead;
  std::optional<uint64_t> local_arena, local_chunk;
  uint64_t tensors = 1;
  bool no_fusion = false, verbose = false, no_align = false, bind = false;
  std::optional<uint64_t> fusion_buffer_bytes, fusion_threshold_bytes;
};

// "4096", "64K", "1.5M", "64G", "1T"; nullopt for anything else.
std::optional<uint64_t> ParseSizeChecked(const std::string& s) {
  char* end = nullptr;
  double v = std::strtod(s.c_str(), &end);
  if (end == s.c_str() || !(v >= 0)) return std::nullopt;
  switch (*end ? (*end | 0x20) : 0) {
    case 0: break;
    case 'k': v *= 1024; break;
    case 'm': v *= 1024.0 * 1024; break;
    case 'g': v *= 1024.0 * 1024 * 1024; break;
    case 't': v *= 1024.0 * 1024 * 1024 * 1024; break;
    default: return std::nullopt;
  }
  if (*end != 0 && end[1] != 0) return std::nullopt;
  if (v >= 18446744073709551615.0) return std::nullopt;
  return static_cast<uint64_t>(v);
}

// Sizes were checked in main().
uint64_t ParseSize(const std::string& s) { return ParseSizeChecked(s).value_or(0); }

std::string GiB(uint64_t b) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%.1f GiB", static_cast<double>(b) / (1ull << 30));
  return buf;
}

std::string HumanSize(uint64_t b) {
  char buf[32];
  if (b >= (1u << 30) && b % (1u << 30) == 0) std::snprintf(buf, sizeof(buf), "%lluG", (unsigned long long)(b >> 30));
  else if (b >= (1u << 20) && b % (1u << 20) == 0) std::snprintf(buf, sizeof(buf), "%lluM", (unsigned long long)(b >> 20));
  else if (b >= 1024 && b % 1024 == 0) std::snprintf(buf, sizeof(buf), "%lluK", (unsigned long long)(b >> 10));
  else std::snprintf(buf, sizeof(buf), "%llu", (unsigned long long)b);
  return buf;
}

// Small integers: exact in every dtype, and so are their sums over up to 16 workers.
int64_t Value(uint64_t i, uint32_t rank) { return static_cast<int64_t>((i * 7 + rank * 3) % 13) - 6; }

void Encode(gl::DataType t, double v, std::byte* p) {
  switch (t) {
    case gl::DataType::kFloat32: { float f = static_cast<float>(v); std::memcpy(p, &f, 4); break; }
    case gl::DataType::kFloat64: std::memcpy(p, &v, 8); break;
    case gl::DataType::kFloat16: { uint16_t h = gl::FloatToHalf(static_cast<float>(v)); std::memcpy(p, &h, 2); break; }
    case gl::DataType::kBFloat16: { uint16_t h = gl::FloatToBFloat16(static_cast<float>(v)); std::memcpy(p, &h, 2); break; }
    case gl::DataType::kInt32: { int32_t x = static_cast<int32_t>(v); std::memcpy(p, &x, 4); break; }
    case gl::DataType::kInt64: { int64_t x = static_cast<int64_t>(v); std::memcpy(p, &x, 8); break; }
  }
}

// Value() repeats every 13 elements, so a row is filled and checked with tiles of whole periods
// (memcpy / memcmp) instead of an Encode per element: gradlink-bench shares the cores with the
// job it measures (the emulated cluster runs 4 of them beside 4 servers on 2 cores).
constexpr uint64_t kTileElements = 13 * 1024;

void FillTiled(std::vector<std::byte>& buf, const std::vector<std::byte>& tile) {
  for (size_t off = 0; off < buf.size(); off += tile.size()) {
    std::memcpy(&buf[off], tile.data(), std::min(tile.size(), buf.size() - off));
  }
}

// The expected result of element i, computed the way the definition says (not the server's code).
double Expected(gl::DataType t, uint64_t i, uint32_t workers, bool average) {
  int64_t sum = 0;
  for (uint32_t r = 0; r < workers; ++r) sum += Value(i, r);
  if (!average) return static_cast<double>(sum);
  switch (t) {
    case gl::DataType::kInt32:
    case gl::DataType::kInt64: return static_cast<double>(sum / static_cast<int64_t>(workers));
    case gl::DataType::kFloat64: return static_cast<double>(sum) / workers;
    default: return static_cast<double>(static_cast<float>(sum) / static_cast<float>(workers));
  }
}

// The elements of `buf` that differ from the tiled `want` (whole tiles compared at once, element
// by element only where a tile differs).
uint64_t CountWrong(const std::vector<std::byte>& buf, const std::vector<std::byte>& want,
                    size_t elem_size) {
  uint64_t wrong = 0;
  for (size_t off = 0; off < buf.size(); off += want.size()) {
    const size_t len = std::min(want.size(), buf.size() - off);
    if (std::memcmp(&buf[off], want.data(), len) == 0) continue;
    for (size_t i = 0; i < len; i += elem_size) {
      if (std::memcmp(&buf[off + i], &want[i], elem_size) != 0) ++wrong;
    }
  }
  return wrong;
}

// Bytes this worker copied on its data path (fusion pack and unpack, the transport's copies
// of received payloads) per byte of tensor it reduced, between two Stats().
void PrintCopies(const gl::WorkerStats& a, const gl::WorkerStats& b) {
  const double reduced = static_cast<double>(b.bytes_reduced - a.bytes_reduced);
  if (reduced <= 0) return;
  const double pack = (b.bytes_packed - a.bytes_packed) / reduced;
  const double unpack = (b.bytes_unpacked - a.bytes_unpacked) / reduced;
  const double bounce = (b.bytes_copied_bounce - a.bytes_copied_bounce) / reduced;
  const double eager = (b.bytes_copied_eager - a.bytes_copied_eager) / reduced;
  const double local = (b.bytes_copied_local - a.bytes_copied_local) / reduced;
  const double results = (b.bytes_copied_results - a.bytes_copied_results) / reduced;
  std::printf("# bytes copied per byte reduced: %.3f (pack %.3f, unpack %.3f, bounce %.3f, "
              "eager %.3f, same-host %.3f, results %.3f)\n",
              pack + unpack + bounce + eager + local + results, pack, unpack, bounce, eager, local,
              results);
}

// Mean time of a round by stage on this worker (see gradlink::PushPullTiming); `wake` is the
// rest of the measured time: from the operation's end to Wait() returning in the caller.
void PrintStages(const gl::PushPullTiming& t, double total_us, int iters) {
  const double n = std::max(1, iters);
  auto us = [n](Clock::duration d) {
    return std::chrono::duration<double, std::micro>(d).count() / n;
  };
  std::printf("# stages(us), mean of %d: pack %.1f queue %.1f push %.1f reduce+wait %.1f "
              "pull %.1f unpack %.1f wake %.1f = %.1f\n",
              iters, us(t.pack), us(t.queue), us(t.push), us(t.reduce), us(t.pull),
              us(t.unpack), total_us / n - us(t.total), total_us / n);
}

int RunWorker(const Config& c) {
  auto dtype = gl::ParseDataType(c.dtype_name);
  if (!dtype) {
    std::fprintf(stderr, "gradlink-bench: unknown dtype '%s'\n", c.dtype_name.c_str());
    return 2;
  }
  // The environment first (GRADLINK_*: the secret, the host, data-path settings), then the
  // flags given, which win; what neither sets is the library's default or its choice.
  gl::WorkerOptions o;
  if (gl::Status env = gl::ApplyEnvironment(&o); !env.ok()) {
    std::fprintf(stderr, "gradlink-bench worker: %s\n", env.ToString().c_str());
    return 2;
  }
  o.scheduler = c.scheduler;
  o.job = c.job;
  o.single_lane = c.single_lane;
  if (c.partition_bytes) o.partition_bytes = c.partition_bytes;
  if (c.max_in_flight) o.max_bytes_in_flight = c.max_in_flight;
  if (c.max_ahead) o.max_bytes_ahead = c.max_ahead;
  if (c.local_arena) o.local_arena_bytes = *c.local_arena;
  if (c.local_chunk) o.local_chunk_bytes = *c.local_chunk;
  if (c.fusion_buffer_bytes) o.fusion_buffer_bytes = *c.fusion_buffer_bytes;
  if (c.fusion_threshold_bytes) o.fusion_threshold_bytes = *c.fusion_threshold_bytes;
  if (c.no_fusion) o.fusion_buffer_bytes = 0;
  auto w = gl::Worker::Connect(o);
  if (!w.ok()) {
    std::fprintf(stderr, "gradlink-bench worker: %s\n", w.status().ToString().c_str());
    return 1;
  }
  gl::Worker& worker = **w;
  if (c.bind) {
    cpu_set_t allowed;
    CPU_ZERO(&allowed);
    if (sched_getaffinity(0, sizeof(allowed), &allowed) == 0 && CPU_COUNT(&allowed) > 0) {
      int nth = static_cast<int>(worker.rank() % static_cast<uint32_t>(CPU_COUNT(&allowed)));
      for (int cpu = 0; cpu < CPU_SETSIZE; ++cpu) {
        if (!CPU_ISSET(cpu, &allowed) || nth-- > 0) continue;
        cpu_set_t one;
        CPU_ZERO(&one);
        CPU_SET(cpu, &one);
        if (sched_setaffinity(0, sizeof(one), &one) != 0) {
          std::fprintf(stderr, "gradlink-bench: --bind: sched_setaffinity: %s\n", std::strerror(errno));
          return 1;
        }
        break;
      }
    }
  }
  const uint32_t n = worker.size();
  const size_t sz = gl::DataTypeSize(*dtype);
  const auto deadline = [] { return Clock::now() + std::chrono::seconds(120); };
  bool all_ok = true;
  auto align_tensor = worker.Declare("bench.align", gl::DataType::kFloat32, 1);
  if (!align_tensor.ok()) {
    std::fprintf(stderr, "declare: %s\n", align_tensor.status().ToString().c_str());
    return 1;
  }
  float align_value = 0;
  std::vector<std::byte> input_tile(kTileElements * sz), want_tile(kTileElements * sz);
  for (uint64_t i = 0; i < kTileElements; ++i) {
    Encode(*dtype, static_cast<double>(Value(i, worker.rank())), &input_tile[i * sz]);
    Encode(*dtype, Expected(*dtype, i, n, c.average), &want_tile[i * sz]);
  }
  if (worker.rank() == 0) {
    std::printf("# gradlink-bench: %u workers, %u servers, dtype %s, %s, %s lanes, %d iters, partitions %s\n",
                n, worker.num_servers(), c.dtype_name.c_str(), c.average ? "average" : "sum",
                c.single_lane ? "single" : "separate push/pull", c.iters,
                HumanSize(worker.Stats().in_force.partition_bytes).c_str());
    std::printf("# busbw = algbw * 2(n-1)/n, as nccl-tests reports all-reduce\n");
    if (c.tensors > 1) {
      if (c.no_fusion) {
        std::printf("# each row: %llu tensors in one group, not fused (separate push_pulls)\n",
                    (unsigned long long)c.tensors);
      } else {
        std::printf("# each row: %llu tensors in one group, fused into %s buffers (members from %s "
                    "unfused)\n",
                    (unsigned long long)c.tensors, HumanSize(o.fusion_buffer_bytes).c_str(),
                    HumanSize(std::min(o.fusion_threshold_bytes, o.fusion_buffer_bytes)).c_str());
      }
    }
    std::printf("%10s %12s %6s %11s %11s %10s %10s %8s\n", "size(B)", "count", "type", "time(us)",
                "min(us)", "algbw(GB/s)", "busbw(GB/s)", "check");
    std::fflush(stdout);
  }
  for (uint64_t bytes = std::max<uint64_t>(ParseSize(c.begin), sz); bytes <= ParseSize(c.end);
       bytes = std::max<uint64_t>(bytes + sz, static_cast<uint64_t>(bytes * c.factor))) {
    const uint64_t per_tensor = std::max<uint64_t>(1, bytes / sz / c.tensors);
    const uint64_t count = per_tensor * c.tensors;
    std::vector<std::byte> buf;
    try {
      buf.resize(count * sz);
    } catch (const std::bad_alloc&) {
      std::fprintf(stderr, "gradlink-bench worker %u: cannot allocate the %s buffer of the %s row "
                   "(%s available)\n", worker.rank(), HumanSize(count * sz).c_str(),
                   HumanSize(bytes).c_str(), GiB(gradlink::AvailableMemory()).c_str());
      return 1;
    }
    std::vector<gl::TensorHandle> handles;
    std::vector<std::span<std::byte>> spans;
    for (uint64_t i = 0; i < c.tensors; ++i) {
      std::string name = "bench." + std::to_string(count);
      if (c.tensors > 1) name += "." + std::to_string(i);
      auto t = worker.Declare(name, *dtype, per_tensor);
      if (!t.ok()) {
        std::fprintf(stderr, "declare: %s\n", t.status().ToString().c_str());
        return 1;
      }
      handles.push_back(*t);
      spans.push_back(std::span<std::byte>(buf).subspan(i * per_tensor * sz, per_tensor * sz));
    }
    gl::PushPullOptions po;
    po.average = c.average;
    double total_us = 0, min_us = 1e300;
    uint64_t wrong = 0;
    gl::PushPullTiming stages;  // summed over the timed iterations
    const gl::WorkerStats before = worker.Stats();
    for (int it = 0; it < c.warmup + c.iters; ++it) {
      FillTiled(buf, input_tile);
      gl::Status bs = worker.Barrier(deadline());
      if (!bs.ok()) {
        std::fprintf(stderr, "barrier: %s\n", bs.ToString().c_str());
        return 1;
      }
      if (!c.no_align) {
        gl::Status as = worker.PushPull(*align_tensor, std::as_writable_bytes(std::span(&align_value, 1)))
                            .Wait(deadline());
        if (!as.ok()) {
          std::fprintf(stderr, "aligning push_pull: %s\n", as.ToString().c_str());
          return 1;
        }
      }
      const auto t0 = Clock::now();
      gl::PushPullHandle h = c.tensors == 1 ? worker.PushPull(handles[0], buf, po)
                                            : worker.PushPullGroup(handles, spans, po);
      gl::Status s = h.Wait(deadline());
      const double us = std::chrono::duration<double, std::micro>(Clock::now() - t0).count();
      if (!s.ok()) {
        std::fprintf(stderr, "gradlink-bench rank %u: push_pull of %llu bytes: %s\n", worker.rank(),
                     (unsigned long long)bytes, s.ToString().c_str());
        return 1;
      }
      wrong += CountWrong(buf, want_tile, sz);
      if (it >= c.warmup) {
        total_us += us;
        min_us = std::min(min_us, us);
        const gl::PushPullTiming t = h.Timing();
        stages.pack += t.pack;
        stages.queue += t.queue;
        stages.push += t.push;
        stages.reduce += t.reduce;
        stages.pull += t.pull;
        stages.unpack += t.unpack;
        stages.total += t.total;
      }
    }
    const gl::WorkerStats after = worker.Stats();
    if (wrong != 0) all_ok = false;
    if (worker.rank() == 0) {
      const double avg_us = total_us / std::max(1, c.iters);
      const double algbw = static_cast<double>(count * sz) / (avg_us * 1e3);
      const double busbw = algbw * 2.0 * (n - 1) / n;
      char check[32];
      if (wrong == 0) std::snprintf(check, sizeof(check), "OK");
      else std::snprintf(check, sizeof(check), "WRONG:%llu", (unsigned long long)wrong);
      std::printf("%10llu %12llu %6s %11.1f %11.1f %10.3f %10.3f %8s\n",
                  (unsigned long long)(count * sz), (unsigned long long)count,
                  c.dtype_name.c_str(), avg_us, min_us, algbw, busbw, check);
      PrintCopies(before, after);
      if (after.local_busy_ns > before.local_busy_ns) {
        // Every push_pull of the size (warmup and timed) did the same work in the segment.
        const double busy_us =
            (after.local_busy_ns - before.local_busy_ns) / 1e3 / std::max(1, c.warmup + c.iters);
        std::printf("# same-host stage: %.1f us of this worker's threads per push_pull (copies "
                    "and sums in shared memory), %.1f%% of the mean time\n",
                    busy_us, 100.0 * busy_us / std::max(avg_us, 1e-9));
      }
      if (c.verbose) PrintStages(stages, total_us, c.iters);
      std::fflush(stdout);
    } else if (wrong != 0) {
      std::fprintf(stderr, "gradlink-bench rank %u: %llu wrong elements at %llu bytes\n",
                   worker.rank(), (unsigned long long)wrong, (unsigned long long)bytes);
    }
  }
  gl::Status s = worker.Shutdown(deadline());
  if (!s.ok()) std::fprintf(stderr, "shutdown: %s\n", s.ToString().c_str());
  return all_ok ? 0 : 3;
}

pid_t Spawn(const std::vector<std::string>& args) {
  pid_t pid = fork();
  if (pid == 0) {
    std::vector<char*> argv;
    for (const auto& a : args) argv.push_back(const_cast<char*>(a.c_str()));
    argv.push_back(nullptr);
    execv(argv[0], argv.data());
    std::perror(("exec " + args[0]).c_str());
    _exit(127);
  }
  return pid;
}

int RunLocalJob(const Config& c, const std::vector<std::string>& worker_args) {
  gl::SchedulerOptions so;
  so.num_workers = c.workers;
  so.num_servers = c.servers;
  so.job = c.job;
  // A fresh secret per job, for the scheduler (options) and the children (their environment;
  // set before the scheduler's threads start).
  so.secret = gl::GenerateSecret();
  ::setenv("GRADLINK_SECRET", so.secret->c_str(), 1);
  ::unsetenv("GRADLINK_SECRET_FILE");
  auto sched = gl::Scheduler::Start(so);
  if (!sched.ok()) {
    std::fprintf(stderr, "gradlink-bench: %s\n", sched.status().ToString().c_str());
    return 2;
  }
  const std::string addr = "127.0.0.1:" + std::to_string((*sched)->port());
  const std::filesystem::path self = std::filesystem::read_symlink("/proc/self/exe");
  const std::string server_bin = (self.parent_path() / "gradlink-server").string();
  std::vector<pid_t> pids;
  for (uint32_t s = 0; s < c.servers; ++s) {
    std::vector<std::string> a = {server_bin, "--scheduler", addr, "--job", c.job};
    if (c.single_lane) a.push_back("--single-lane");
    pids.push_back(Spawn(a));
  }
  for (uint32_t w = 0; w < c.workers; ++w) {
    std::vector<std::string> a = {self.string(), "--scheduler", addr};
    a.insert(a.end(), worker_args.begin(), worker_args.end());
    pids.push_back(Spawn(a));
  }
  int rc = 0;
  std::vector<std::string> lost;  // servers that ended badly: the job's failure, unless it went on
  for (size_t i = 0; i < pids.size(); ++i) {
    int status = 0;
    waitpid(pids[i], &status, 0);
    const int code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
    if (code == 0) continue;
    if (i < c.servers) {
      lost.push_back("server process " + std::to_string(i) + " (pid " + std::to_string(pids[i]) +
                     ", " + (WIFEXITED(status) ? "exit code " + std::to_string(code)
                                                : std::string(strsignal(WTERMSIG(status)))) + ")");
    } else if (rc == 0) {
      rc = code;
    }
  }
  gl::Status st = (*sched)->Wait(Clock::now() + std::chrono::seconds(5));
  (*sched)->Stop();
  if (!st.ok()) {
    std::fprintf(stderr, "gradlink-bench: job: %s\n", st.ToString().c_str());
    if (rc == 0) rc = 1;
  }
  // Failover: a lost server whose partitions moved is an event, not the job's failure.
  const bool went_on = st.ok() && rc == 0;
  for (const std::string& s : lost) {
    std::fprintf(stderr, "gradlink-bench: %s ended %s\n", s.c_str(),
                 went_on ? "during the job, which went on without it" : "with the job");
  }
  return rc;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"gradlink-bench: push_pull bandwidth and correctness sweep (like all_reduce_perf)"};
  Config c;
  app.add_option("-w,--workers", c.workers, "workers of the local job")->capture_default_str();
  app.add_option("-s,--servers", c.servers, "servers of the local job")->capture_default_str();
  app.add_option("-b,--minbytes", c.begin, "smallest size (K, M, G suffixes)")->capture_default_str();
  app.add_option("-e,--maxbytes", c.end, "largest size")->capture_default_str();
  app.add_option("-f,--stepfactor", c.factor, "size multiplier between rows")->capture_default_str();
  app.add_option("-d,--dtype", c.dtype_name, "fp32 fp64 fp16 bf16 int32 int64")->capture_default_str();
  app.add_option("-n,--iters", c.iters, "timed iterations per size")->capture_default_str();
  app.add_option("--warmup", c.warmup, "untimed iterations per size")->capture_default_str();
  app.add_flag("--average", c.average, "average instead of sum");
  app.add_flag("--single-lane", c.single_lane, "push and pull on one lane");
  app.add_option("--partition-bytes", c.partition_bytes, "partition size (default: gradlink chooses)");
  app.add_option("--max-in-flight", c.max_in_flight,
                 "bytes in flight per worker (default: gradlink chooses)");
  app.add_option("--max-ahead", c.max_ahead,
                 "bytes per server an operation may have pushed whose sums are not back (0: no "
                 "limit; default: gradlink chooses)");
  app.add_option("--local-arena", c.local_arena,
                 "same-host path: bytes of shared memory (0: off, every sum through the servers; "
                 "default 64 MiB, at most half of /dev/shm's free space)");
  app.add_option("--local-chunk", c.local_chunk, "same-host path: bytes per chunk (default 256 KiB)");
  app.add_option("--tensors", c.tensors, "split each row into this many tensors, pushed as one group")
      ->capture_default_str()->check(CLI::PositiveNumber);
  app.add_flag("--no-fusion", c.no_fusion, "do not fuse a group's tensors (fusion_buffer_bytes 0)");
  app.add_option("--fusion-buffer-bytes", c.fusion_buffer_bytes, "fusion buffer size (default 4 MiB)");
  app.add_option("--fusion-threshold", c.fusion_threshold_bytes,
                 "members of this size go unfused (default 256 KiB)");
  app.add_flag("-v,--verbose", c.verbose, "print where the time of a round went, by stage");
  app.add_flag("--bind", c.bind, "pin worker r to CPU r mod (usable CPUs), as mpirun binds to cores");
  app.add_flag("--no-align", c.no_align,
               "start each timed operation right after the barrier (no untimed push_pull first)");
  app.add_option("--scheduler", c.scheduler, "join this job as one worker instead of starting one");
  app.add_option("--job", c.job, "job name")->capture_default_str();
  CLI11_PARSE(app, argc, argv);
  if (c.factor <= 1.0) {
    std::fprintf(stderr, "gradlink-bench: --stepfactor must be > 1\n");
    return 2;
  }
  const std::optional<uint64_t> begin = ParseSizeChecked(c.begin), end = ParseSizeChecked(c.end);
  if (!begin || !end) {
    std::fprintf(stderr, "gradlink-bench: bad size '%s' (bytes, or with a K, M, G or T suffix)\n",
                 (!begin ? c.begin : c.end).c_str());
    return 2;
  }
  // Every worker holds one buffer of the largest row (plus small tiles): refuse before joining,
  // so that no job is started only to lose its workers to an allocation failure.
  const uint64_t workers_here = c.scheduler.empty() ? std::max<uint64_t>(c.workers, 1) : 1;
  const uint64_t available = gradlink::AvailableMemory();
  if (available != 0 && *end > available / 2 / workers_here) {
    std::fprintf(stderr,
                 "gradlink-bench: -e/--maxbytes %s needs a %s buffer in each of %llu worker(s) "
                 "here; this machine has %s available (MemAvailable), and gradlink-bench uses at "
                 "most half of it: lower -e\n",
                 c.end.c_str(), HumanSize(*end).c_str(), (unsigned long long)workers_here,
                 GiB(available).c_str());
    return 2;
  }
  if (!c.scheduler.empty()) return RunWorker(c);
  if (c.workers == 0 || c.servers == 0) {
    std::fprintf(stderr, "gradlink-bench: need at least one worker and one server\n");
    return 2;
  }
  std::vector<std::string> worker_args = {
      "-b", c.begin, "-e", c.end, "-f", std::to_string(c.factor), "-d", c.dtype_name,
      "-n", std::to_string(c.iters), "--warmup", std::to_string(c.warmup), "--job", c.job,
      "--tensors", std::to_string(c.tensors)};
  for (const auto& [flag, value] : {std::pair{"--partition-bytes", c.partition_bytes},
                                     {"--max-in-flight", c.max_in_flight},
                                     {"--max-ahead", c.max_ahead},
                                     {"--local-arena", c.local_arena},
                                     {"--local-chunk", c.local_chunk},
                                     {"--fusion-buffer-bytes", c.fusion_buffer_bytes},
                                     {"--fusion-threshold", c.fusion_threshold_bytes}}) {
    if (value) worker_args.insert(worker_args.end(), {flag, std::to_string(*value)});
  }
  if (c.no_fusion) worker_args.push_back("--no-fusion");
  if (c.verbose) worker_args.push_back("--verbose");
  if (c.no_align) worker_args.push_back("--no-align");
  if (c.bind) worker_args.push_back("--bind");
  if (c.average) worker_args.push_back("--average");
  if (c.single_lane) worker_args.push_back("--single-lane");
  return RunLocalJob(c, worker_args);
}
