// gl_probe_worker: one worker process of an integration test, driven by run_integration.py.
//
// It joins a job through the public API (gradlink/worker.h) and runs one scenario:
//   many-keys  declares ~500 tensors of every dtype (in a rank-dependent order), pipelines
//              two rounds of push_pull at a time over all of them and checks every element.
//   honest     one tensor, --rounds rounds, exact check (the honest side of the bad-frames test).
//   mismatch   rank r declares "t" as fp32[100 + r] (or, with --dtype-mismatch, rank 1 as int32):
//              push_pull must fail with kMismatch naming the key and both ranks; a tensor that
//              agrees must still work afterwards. Exits kExitMismatch (5) when all of that holds.
//   timeout    2 workers; rank 1 declares "t" but pushes only after rank 0 has seen kTimeout
//              from Wait(deadline); then rank 0's same handle completes with the exact sum.
//   abandon    2 workers; rank 1 never pushes: rank 0 gets kTimeout, shuts down, and the
//              pending handle then fails (kAborted) at once instead of hanging.
//   rank-order fp32/fp64 tensors of inexact values (sums depend on the order of the additions),
//              pushed with rank-dependent delays so they arrive in varying orders: the result
//              must be bit-identical to ((x0 + x1) + x2) + ... in rank order (then / n when
//              averaging), as the server promises.
//
// Values are small integers, exact in every dtype and in their sums over up to 16 workers, so
// every element is compared bit for bit with a value computed here from the definition.
// Exit codes: 0 pass, 1 a gradlink call failed unexpectedly, 3 wrong elements, 5 mismatch
// scenario passed, 2 usage.
#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <fstream>
#include <thread>
#include <vector>

#include "gradlink/env.h"
#include "gradlink/worker.h"

namespace gl = gradlink;
using Clock = std::chrono::steady_clock;

namespace {

constexpr int kExitFail = 1;
constexpr int kExitWrong = 3;
constexpr int kExitMismatch = 5;

struct Args {
  std::string scheduler, job = "default", mode;
  int32_t rank = -1;
  int rounds = 3;
  int tensors = 500;
  uint64_t partition_bytes = 4096;
  uint64_t max_in_flight = 0;  // 0: max(256 KiB, partition_bytes)
  uint64_t count = 100000;
  bool dtype_mismatch = false;
  bool same_issue_order = false;
  bool corrupt = false;  // self-test of the checks: push one wrong element
  int wait_s = 60;
  // stall mode: what rank 1 holds back ("declare": it declares the second tensor late; "push":
  // it pushes it late), and for how long.
  std::string stall = "push";
  int delay_ms = 0;
  // loop mode: push_pull rounds (checked) until this file exists.
  std::string until_file;
};

Clock::time_point Deadline(int seconds) { return Clock::now() + std::chrono::seconds(seconds); }

// The value rank `rank` contributes to element j of tensor `t` in round `round`: -6..6.
int64_t Value(uint64_t j, uint32_t rank, uint64_t round, uint64_t t) {
  return static_cast<int64_t>((j * 7 + rank * 3 + round * 5 + t * 11) % 13) - 6;
}

// Exact encodings of small integers (|v| <= 2048); written from the formats' definitions, not
// with gradlink's converters.
uint16_t SmallIntToHalf(double v) {
  if (v == 0) return 0;
  uint16_t sign = v < 0 ? 0x8000 : 0;
  double a = std::fabs(v);
  int e = 0;
  while (a >= 2.0) { a /= 2; ++e; }
  while (a < 1.0) { a *= 2; --e; }
  const uint16_t mant = static_cast<uint16_t>(std::lround((a - 1.0) * 1024.0));
  return static_cast<uint16_t>(sign | ((e + 15) << 10) | mant);
}

uint16_t SmallIntToBFloat16(double v) {
  const float f = static_cast<float>(v);
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  return static_cast<uint16_t>(bits >> 16);  // exact: small integers have <= 8 significant bits
}

void Encode(gl::DataType t, double v, std::byte* p) {
  switch (t) {
    case gl::DataType::kFloat32: { float f = static_cast<float>(v); std::memcpy(p, &f, 4); break; }
    case gl::DataType::kFloat64: std::memcpy(p, &v, 8); break;
    case gl::DataType::kFloat16: { uint16_t h = SmallIntToHalf(v); std::memcpy(p, &h, 2); break; }
    case gl::DataType::kBFloat16: { uint16_t h = SmallIntToBFloat16(v); std::memcpy(p, &h, 2); break; }
    case gl::DataType::kInt32: { int32_t x = static_cast<int32_t>(v); std::memcpy(p, &x, 4); break; }
    case gl::DataType::kInt64: { int64_t x = static_cast<int64_t>(v); std::memcpy(p, &x, 8); break; }
  }
}

bool CanAverage(gl::DataType t) {
  return t == gl::DataType::kFloat32 || t == gl::DataType::kFloat64 ||
         t == gl::DataType::kInt32 || t == gl::DataType::kInt64;
}

// The expected element: the sum over all ranks, or its average as the API defines it.
void EncodeExpected(gl::DataType t, uint64_t j, uint32_t workers, uint64_t round, uint64_t tensor,
                    bool average, std::byte* p) {
  int64_t sum = 0;
  for (uint32_t r = 0; r < workers; ++r) sum += Value(j, r, round, tensor);
  if (!average) return Encode(t, static_cast<double>(sum), p);
  switch (t) {
    case gl::DataType::kFloat32: {
      float f = static_cast<float>(sum) / static_cast<float>(workers);
      std::memcpy(p, &f, 4);
      return;
    }
    case gl::DataType::kFloat64: {
      double d = static_cast<double>(sum) / workers;
      std::memcpy(p, &d, 8);
      return;
    }
    default:
      return Encode(t, static_cast<double>(sum / static_cast<int64_t>(workers)), p);
  }
}

void Fill(gl::DataType t, std::vector<std::byte>& buf, uint64_t count, uint32_t rank,
          uint64_t round, uint64_t tensor) {
  const size_t sz = gl::DataTypeSize(t);
  for (uint64_t j = 0; j < count; ++j) {
    Encode(t, static_cast<double>(Value(j, rank, round, tensor)), &buf[j * sz]);
  }
}

uint64_t CountWrong(gl::DataType t, const std::vector<std::byte>& buf, uint64_t count,
                    uint32_t workers, uint64_t round, uint64_t tensor, bool average,
                    uint64_t* first_wrong) {
  const size_t sz = gl::DataTypeSize(t);
  std::byte want[8];
  uint64_t wrong = 0;
  for (uint64_t j = 0; j < count; ++j) {
    EncodeExpected(t, j, workers, round, tensor, average, want);
    if (std::memcmp(want, &buf[j * sz], sz) != 0) {
      if (wrong == 0) *first_wrong = j;
      ++wrong;
    }
  }
  return wrong;
}

std::unique_ptr<gl::Worker> Connect(const Args& a) {
  gl::WorkerOptions o;
  // The environment first, as gradlink's own tools do: the harness turns the same-host path
  // off (GRADLINK_LOCAL_ARENA_BYTES=0) so that these jobs go through the servers, and the
  // metrics tests turn the worker's metrics on (GRADLINK_METRICS_PORT).
  if (gl::Status env = gl::ApplyEnvironment(&o); !env.ok()) {
    std::fprintf(stderr, "probe: %s\n", env.ToString().c_str());
    return nullptr;
  }
  o.scheduler = a.scheduler;
  o.job = a.job;
  o.rank = a.rank;
  o.partition_bytes = a.partition_bytes;
  // The window holds at least one partition (a smaller one is refused): 256 KiB or one
  // partition, unless --max-in-flight says otherwise.
  o.max_bytes_in_flight = a.max_in_flight != 0 ? a.max_in_flight
                                               : std::max<uint64_t>(256 * 1024, a.partition_bytes);
  o.connect_timeout = std::chrono::seconds(a.wait_s);
  auto w = gl::Worker::Connect(o);
  if (!w.ok()) {
    std::fprintf(stderr, "probe: connect: %s\n", w.status().ToString().c_str());
    return nullptr;
  }
  return std::move(w).value();
}

int Finish(gl::Worker& w, int rc) {
  gl::Status s = w.Shutdown(Deadline(10));
  if (!s.ok()) {
    std::fprintf(stderr, "probe rank %u: shutdown: %s\n", w.rank(), s.ToString().c_str());
    if (rc == 0) rc = kExitFail;
  }
  std::printf("probe rank %u: exit %d\n", w.rank(), rc);
  std::fflush(stdout);
  return rc;
}

// ---- many-keys ---------------------------------------------------------------------------

struct Tensor {
  gl::TensorHandle handle;
  gl::DataType dtype;
  uint64_t count;
  bool average;
  std::vector<std::byte> buf[2];  // rounds alternate buffers: two rounds in flight per tensor
  gl::PushPullHandle pending[2];
};

int RunManyKeys(const Args& a) {
  auto w = Connect(a);
  if (!w) return kExitFail;
  const uint32_t rank = w->rank(), n = w->size();
  const gl::DataType kTypes[] = {gl::DataType::kFloat32, gl::DataType::kFloat64,
                                 gl::DataType::kFloat16, gl::DataType::kBFloat16,
                                 gl::DataType::kInt32,   gl::DataType::kInt64};
  std::vector<Tensor> tensors(a.tensors);
  for (int i = 0; i < a.tensors; ++i) {
    Tensor& t = tensors[i];
    t.dtype = kTypes[i % 6];
    // Mostly small tensors, some spanning many partitions, a few of exactly one element.
    t.count = i % 97 == 0 ? 1 : (i % 50 == 7 ? 20000 + i : 1 + (i * 37) % 1500);
    t.average = CanAverage(t.dtype) && i % 5 == 0;
    for (auto& b : t.buf) b.resize(t.count * gl::DataTypeSize(t.dtype));
  }
  // Every rank declares and issues in its own order: keys are names, never declaration order.
  std::vector<int> order(a.tensors);
  for (int i = 0; i < a.tensors; ++i) order[i] = i;
  std::mt19937 rng(1234 + rank);
  std::shuffle(order.begin(), order.end(), rng);
  for (int i : order) {
    auto h = w->Declare("many." + std::to_string(i) + ".grad", tensors[i].dtype, tensors[i].count);
    if (!h.ok()) {
      std::fprintf(stderr, "probe rank %u: declare %d: %s\n", rank, i, h.status().ToString().c_str());
      return Finish(*w, kExitFail);
    }
    tensors[i].handle = *h;
  }
  uint64_t wrong_total = 0;
  auto check_round = [&](int round) -> bool {
    for (int i = 0; i < a.tensors; ++i) {
      Tensor& t = tensors[i];
      gl::Status s = t.pending[round % 2].Wait(Deadline(a.wait_s));
      if (!s.ok()) {
        std::fprintf(stderr, "probe rank %u: push_pull of tensor %d round %d: %s\n", rank, i,
                     round, s.ToString().c_str());
        return false;
      }
      uint64_t first = 0;
      const uint64_t wrong =
          CountWrong(t.dtype, t.buf[round % 2], t.count, n, round, i, t.average, &first);
      if (wrong != 0) {
        std::fprintf(stderr, "probe rank %u: tensor %d (%s[%llu]) round %d: %llu wrong, first at %llu\n",
                     rank, i, std::string(gl::DataTypeName(t.dtype)).c_str(),
                     (unsigned long long)t.count, round, (unsigned long long)wrong,
                     (unsigned long long)first);
        wrong_total += wrong;
      }
    }
    return true;
  };
  std::mt19937 issue_rng(a.same_issue_order ? 99 : 99 + rank);
  for (int round = 0; round < a.rounds; ++round) {
    std::shuffle(order.begin(), order.end(), issue_rng);
    for (int i : order) {
      Tensor& t = tensors[i];
      Fill(t.dtype, t.buf[round % 2], t.count, rank, round, i);
      if (a.corrupt && round == 1 && i == 3) {
        Encode(t.dtype, static_cast<double>(Value(0, rank, round, i) + 1), t.buf[round % 2].data());
      }
      gl::PushPullOptions po;
      po.average = t.average;
      po.priority = static_cast<int32_t>(i % 7);
      t.pending[round % 2] = w->PushPull(t.handle, t.buf[round % 2], po);
    }
    if (round > 0 && !check_round(round - 1)) return Finish(*w, kExitFail);
  }
  if (a.rounds > 0 && !check_round(a.rounds - 1)) return Finish(*w, kExitFail);
  std::printf("probe rank %u: %d tensors x %d rounds, %llu wrong elements\n", rank, a.tensors,
              a.rounds, (unsigned long long)wrong_total);
  return Finish(*w, wrong_total == 0 ? 0 : kExitWrong);
}

// ---- honest ------------------------------------------------------------------------------

int RunHonest(const Args& a) {
  auto w = Connect(a);
  if (!w) return kExitFail;
  const uint32_t rank = w->rank(), n = w->size();
  auto h = w->Declare("rogue.t", gl::DataType::kFloat32, a.count);
  if (!h.ok()) {
    std::fprintf(stderr, "probe: declare: %s\n", h.status().ToString().c_str());
    return Finish(*w, kExitFail);
  }
  std::vector<std::byte> buf(a.count * 4);
  uint64_t wrong_total = 0;
  for (int round = 0; round < a.rounds; ++round) {
    Fill(gl::DataType::kFloat32, buf, a.count, rank, round, 0);
    gl::Status s = w->PushPull(*h, buf).Wait(Deadline(a.wait_s));
    if (!s.ok()) {
      std::fprintf(stderr, "probe rank %u: round %d: %s\n", rank, round, s.ToString().c_str());
      return Finish(*w, kExitFail);
    }
    uint64_t first = 0;
    const uint64_t wrong = CountWrong(gl::DataType::kFloat32, buf, a.count, n, round, 0, false, &first);
    if (wrong != 0) {
      std::fprintf(stderr, "probe rank %u: round %d: %llu wrong, first at %llu\n", rank, round,
                   (unsigned long long)wrong, (unsigned long long)first);
    }
    wrong_total += wrong;
  }
  std::printf("probe rank %u: %d rounds of %llu elements, %llu wrong\n", rank, a.rounds,
              (unsigned long long)a.count, (unsigned long long)wrong_total);
  return Finish(*w, wrong_total == 0 ? 0 : kExitWrong);
}

// ---- mismatch ----------------------------------------------------------------------------

int RunMismatch(const Args& a) {
  const auto t0 = Clock::now();
  auto w = Connect(a);
  if (!w) return kExitFail;
  const uint32_t rank = w->rank(), n = w->size();
  gl::DataType dtype = gl::DataType::kFloat32;
  uint64_t count = 100;
  if (a.dtype_mismatch) {
    if (rank == 1) dtype = gl::DataType::kInt32;
  } else {
    count = 100 + rank;
  }
  auto h = w->Declare("t", dtype, count);
  if (!h.ok()) {
    std::fprintf(stderr, "probe rank %u: declare: %s\n", rank, h.status().ToString().c_str());
    return Finish(*w, kExitFail);
  }
  std::vector<std::byte> buf(count * gl::DataTypeSize(dtype));
  gl::Status s = w->PushPull(*h, buf).Wait(Deadline(10));
  const double secs = std::chrono::duration<double>(Clock::now() - t0).count();
  std::printf("probe rank %u: push_pull of 't' after %.2f s: %s\n", rank, secs, s.ToString().c_str());
  std::fflush(stdout);
  if (s.code() != gl::Code::kMismatch) {
    std::fprintf(stderr, "probe rank %u: expected kMismatch, got %s\n", rank, s.ToString().c_str());
    return Finish(*w, kExitFail);
  }
  const std::string& m = s.message();
  bool ok = true;
  for (const char* want : {"'t'", "rank 0", "rank 1", "0x"}) {
    if (m.find(want) == std::string::npos) {
      std::fprintf(stderr, "probe rank %u: kMismatch message lacks \"%s\"\n", rank, want);
      ok = false;
    }
  }
  // The failure is the key's: later calls on it fail the same way, at once...
  gl::Status again = w->PushPull(*h, buf).Wait(Deadline(5));
  if (again.code() != gl::Code::kMismatch) {
    std::fprintf(stderr, "probe rank %u: second push_pull of 't': %s\n", rank, again.ToString().c_str());
    ok = false;
  }
  // ...and a tensor that every worker declared alike still sums.
  auto good = w->Declare("t.agreed", gl::DataType::kFloat32, 64);
  if (!good.ok()) {
    std::fprintf(stderr, "probe rank %u: declare t.agreed: %s\n", rank, good.status().ToString().c_str());
    return Finish(*w, kExitFail);
  }
  std::vector<std::byte> gbuf(64 * 4);
  Fill(gl::DataType::kFloat32, gbuf, 64, rank, 0, 1);
  gl::Status gs = w->PushPull(*good, gbuf).Wait(Deadline(10));
  uint64_t first = 0;
  if (!gs.ok()) {
    std::fprintf(stderr, "probe rank %u: push_pull of t.agreed: %s\n", rank, gs.ToString().c_str());
    ok = false;
  } else if (CountWrong(gl::DataType::kFloat32, gbuf, 64, n, 0, 1, false, &first) != 0) {
    std::fprintf(stderr, "probe rank %u: t.agreed has wrong elements\n", rank);
    ok = false;
  }
  return Finish(*w, ok ? kExitMismatch : kExitFail);
}

// ---- rank-order --------------------------------------------------------------------------

// A value with a varied exponent, so that sums round and their order shows.
double Inexact(uint64_t j, uint32_t rank, uint64_t round, uint64_t t) {
  uint64_t x = (j + 1) * 0x9E3779B97F4A7C15ull ^ (rank + 1) * 0xC2B2AE3D27D4EB4Full ^
               (round + 1) * 0x165667B19E3779F9ull ^ (t + 1) * 0x27D4EB2F165667C5ull;
  x ^= x >> 29;
  x *= 0xBF58476D1CE4E5B9ull;
  x ^= x >> 32;
  const double mant = static_cast<double>(x & 0xFFFFFF) / 16777216.0 * 2.0 - 1.0;  // [-1, 1)
  const int exp = static_cast<int>((x >> 24) % 21) - 10;
  return std::ldexp(mant, exp);
}

template <typename T>
uint64_t CheckRankOrder(const std::vector<std::byte>& buf, uint64_t count, uint32_t workers,
                        uint64_t round, uint64_t t, bool average) {
  uint64_t wrong = 0;
  for (uint64_t j = 0; j < count; ++j) {
    T acc = static_cast<T>(Inexact(j, 0, round, t));
    for (uint32_t r = 1; r < workers; ++r) acc = acc + static_cast<T>(Inexact(j, r, round, t));
    if (average) acc = acc / static_cast<T>(workers);
    T got;
    std::memcpy(&got, &buf[j * sizeof(T)], sizeof(T));
    if (std::memcmp(&got, &acc, sizeof(T)) != 0) ++wrong;
  }
  return wrong;
}

int RunRankOrder(const Args& a) {
  auto w = Connect(a);
  if (!w) return kExitFail;
  const uint32_t rank = w->rank(), n = w->size();
  struct Spec {
    gl::DataType dtype;
    uint64_t count;
  };
  const Spec specs[] = {{gl::DataType::kFloat32, 1},      {gl::DataType::kFloat32, 1000},
                        {gl::DataType::kFloat32, 100003}, {gl::DataType::kFloat64, 7},
                        {gl::DataType::kFloat64, 50001}};
  std::vector<gl::TensorHandle> handles;
  std::vector<std::vector<std::byte>> bufs;
  for (size_t t = 0; t < std::size(specs); ++t) {
    auto h = w->Declare("order." + std::to_string(t), specs[t].dtype, specs[t].count);
    if (!h.ok()) {
      std::fprintf(stderr, "probe rank %u: declare: %s\n", rank, h.status().ToString().c_str());
      return Finish(*w, kExitFail);
    }
    handles.push_back(*h);
    bufs.emplace_back(specs[t].count * gl::DataTypeSize(specs[t].dtype));
  }
  uint64_t wrong_total = 0;
  for (int round = 0; round < a.rounds; ++round) {
    const bool average = round % 2 == 1;
    for (size_t t = 0; t < std::size(specs); ++t) {
      for (uint64_t j = 0; j < specs[t].count; ++j) {
        const double v = Inexact(j, rank, round, t);
        if (specs[t].dtype == gl::DataType::kFloat32) {
          const float f = static_cast<float>(v);
          std::memcpy(&bufs[t][j * 4], &f, 4);
        } else {
          std::memcpy(&bufs[t][j * 8], &v, 8);
        }
      }
    }
    // Vary who arrives first: rank-and-round dependent delays of 0-15 ms.
    std::this_thread::sleep_for(std::chrono::milliseconds(((rank * 7 + round * 3) % 4) * 5));
    std::vector<gl::PushPullHandle> ops;
    gl::PushPullOptions po;
    po.average = average;
    for (size_t t = 0; t < std::size(specs); ++t) ops.push_back(w->PushPull(handles[t], bufs[t], po));
    for (size_t t = 0; t < std::size(specs); ++t) {
      gl::Status s = ops[t].Wait(Deadline(a.wait_s));
      if (!s.ok()) {
        std::fprintf(stderr, "probe rank %u: round %d tensor %zu: %s\n", rank, round, t,
                     s.ToString().c_str());
        return Finish(*w, kExitFail);
      }
      const uint64_t wrong =
          specs[t].dtype == gl::DataType::kFloat32
              ? CheckRankOrder<float>(bufs[t], specs[t].count, n, round, t, average)
              : CheckRankOrder<double>(bufs[t], specs[t].count, n, round, t, average);
      if (wrong != 0) {
        std::fprintf(stderr, "probe rank %u: round %d tensor %zu: %llu elements differ from the "
                     "rank-order sum\n", rank, round, t, (unsigned long long)wrong);
      }
      wrong_total += wrong;
    }
  }
  std::printf("probe rank %u: %d rounds, %llu elements differ from the rank-order result\n", rank,
              a.rounds, (unsigned long long)wrong_total);
  return Finish(*w, wrong_total == 0 ? 0 : kExitWrong);
}

// ---- timeout / abandon -------------------------------------------------------------------

int RunTimeout(const Args& a, bool abandon) {
  auto w = Connect(a);
  if (!w) return kExitFail;
  const uint32_t rank = w->rank(), n = w->size();
  if (n != 2) {
    std::fprintf(stderr, "probe: the timeout scenarios need exactly 2 workers\n");
    return Finish(*w, 2);
  }
  const uint64_t count = 1000;
  auto h = w->Declare("t.slow", gl::DataType::kFloat32, count);
  if (!h.ok()) {
    std::fprintf(stderr, "probe rank %u: declare: %s\n", rank, h.status().ToString().c_str());
    return Finish(*w, kExitFail);
  }
  std::vector<std::byte> buf(count * 4);
  Fill(gl::DataType::kFloat32, buf, count, rank, 0, 0);
  if (rank == 0) {
    gl::PushPullHandle op = w->PushPull(*h, buf);
    const auto t0 = Clock::now();
    gl::Status s = op.Wait(t0 + std::chrono::milliseconds(1500));
    const double secs = std::chrono::duration<double>(Clock::now() - t0).count();
    std::printf("probe rank 0: Wait(1.5 s) returned after %.2f s: %s\n", secs, s.ToString().c_str());
    std::fflush(stdout);
    if (s.code() != gl::Code::kTimeout || secs < 1.4 || secs > 5 || op.Poll()) {
      std::fprintf(stderr, "probe rank 0: expected kTimeout after 1.5 s\n");
      return Finish(*w, kExitFail);
    }
    // Tell rank 1 that the timeout was seen.
    gl::Status bs = w->Barrier(Deadline(a.wait_s));
    if (!bs.ok()) {
      std::fprintf(stderr, "probe rank 0: barrier: %s\n", bs.ToString().c_str());
      return Finish(*w, kExitFail);
    }
    if (abandon) {
      // Rank 1 never pushes. Leaving must fail the pending operation promptly, not hang it.
      const auto t1 = Clock::now();
      gl::Status sd = w->Shutdown(Deadline(10));
      gl::Status after = op.Wait(Deadline(10));
      const double wait_s = std::chrono::duration<double>(Clock::now() - t1).count();
      std::printf("probe rank 0: after shutdown (%.2f s) the pending push_pull says: %s\n",
                  wait_s, after.ToString().c_str());
      if (!sd.ok() || after.ok() || after.code() == gl::Code::kTimeout || wait_s > 10) {
        std::fprintf(stderr, "probe rank 0: pending push_pull did not fail after shutdown\n");
        return kExitFail;
      }
      std::printf("probe rank 0: exit 0\n");
      return 0;
    }
    // Rank 1 pushes now: the same handle completes, with the right sum.
    gl::Status done = op.Wait(Deadline(a.wait_s));
    if (!done.ok()) {
      std::fprintf(stderr, "probe rank 0: after the late push: %s\n", done.ToString().c_str());
      return Finish(*w, kExitFail);
    }
  } else {
    gl::Status bs = w->Barrier(Deadline(a.wait_s));
    if (!bs.ok()) {
      std::fprintf(stderr, "probe rank 1: barrier: %s\n", bs.ToString().c_str());
      return Finish(*w, kExitFail);
    }
    if (abandon) return Finish(*w, 0);  // never pushes
    gl::Status s = w->PushPull(*h, buf).Wait(Deadline(a.wait_s));
    if (!s.ok()) {
      std::fprintf(stderr, "probe rank 1: push_pull: %s\n", s.ToString().c_str());
      return Finish(*w, kExitFail);
    }
  }
  uint64_t first = 0;
  const uint64_t wrong = CountWrong(gl::DataType::kFloat32, buf, count, n, 0, 0, false, &first);
  if (wrong != 0) {
    std::fprintf(stderr, "probe rank %u: %llu wrong elements\n", rank, (unsigned long long)wrong);
    return Finish(*w, kExitWrong);
  }
  return Finish(*w, 0);
}

// The stall inspector's scenarios: two tensors, 'grad.a' that both ranks push at once and
// 'grad.b' that rank 1 declares (--stall declare) or pushes (--stall push) --delay-ms late.
// Exit 0 when both sums are right, 4 when an operation failed naming the stall inspector (a
// GRADLINK_STALL_SHUTDOWN_SECONDS test), else kExitFail.
int RunStall(const Args& a) {
  auto w = Connect(a);
  if (!w) return kExitFail;
  const uint32_t rank = w->rank(), n = w->size();
  const uint64_t count = 1000;
  const bool late = rank == 1;
  std::vector<std::vector<std::byte>> bufs(2, std::vector<std::byte>(count * 4));
  auto fail = [&](const char* what, const gl::Status& s) {
    std::fprintf(stderr, "probe rank %u: %s: %s\n", rank, what, s.ToString().c_str());
    const bool stalled = s.message().find("stall inspector") != std::string::npos;
    return Finish(*w, stalled ? 4 : kExitFail);
  };
  auto ha = w->Declare("grad.a", gl::DataType::kFloat32, count);
  if (!ha.ok()) return fail("declare grad.a", ha.status());
  Fill(gl::DataType::kFloat32, bufs[0], count, rank, 0, 0);
  Fill(gl::DataType::kFloat32, bufs[1], count, rank, 0, 1);
  if (gl::Status s = w->PushPull(*ha, bufs[0]).Wait(Deadline(a.wait_s)); !s.ok()) {
    return fail("push_pull grad.a", s);
  }
  const auto delay = std::chrono::milliseconds(a.delay_ms);
  if (late && a.stall == "declare") std::this_thread::sleep_for(delay);
  auto hb = w->Declare("grad.b", gl::DataType::kFloat32, count);
  if (!hb.ok()) return fail("declare grad.b", hb.status());
  if (late && a.stall == "push") std::this_thread::sleep_for(delay);
  if (gl::Status s = w->PushPull(*hb, bufs[1]).Wait(Deadline(a.wait_s)); !s.ok()) {
    return fail("push_pull grad.b", s);
  }
  uint64_t first = 0;
  for (uint64_t t = 0; t < 2; ++t) {
    if (CountWrong(gl::DataType::kFloat32, bufs[t], count, n, 0, t, false, &first) != 0) {
      std::fprintf(stderr, "probe rank %u: wrong sum of tensor %llu\n", rank,
                   static_cast<unsigned long long>(t));
      return Finish(*w, kExitWrong);
    }
  }
  std::printf("probe rank %u: both sums right\n", rank);
  return Finish(*w, 0);
}

// A job that runs until told: 'loop.a' (--count floats) summed round after round, every sum
// checked, until --until-file exists (the metrics tests scrape it meanwhile). Exit 0, or
// kExitWrong / kExitFail.
int RunLoop(const Args& a) {
  auto w = Connect(a);
  if (!w) return kExitFail;
  const uint32_t rank = w->rank(), n = w->size();
  auto h = w->Declare("loop.a", gl::DataType::kFloat32, a.count);
  auto hs = w->Declare("loop.stop", gl::DataType::kInt32, 1);
  if (!h.ok() || !hs.ok()) return Finish(*w, kExitFail);
  std::vector<std::byte> buf(a.count * 4);
  uint64_t round = 0;
  for (;; ++round) {
    // Every rank runs the same rounds: rank 0 decides when to stop, at a barrier.
    if (round % 16 == 0) {
      if (gl::Status s = w->Barrier(Deadline(a.wait_s)); !s.ok()) {
        std::fprintf(stderr, "probe rank %u: barrier: %s\n", rank, s.ToString().c_str());
        return Finish(*w, kExitFail);
      }
      std::vector<std::byte> stop(4);
      stop[0] = std::byte{rank == 0 && std::ifstream(a.until_file).good() ? uint8_t{1} : uint8_t{0}};
      if (!w->PushPull(*hs, stop).Wait(Deadline(a.wait_s)).ok()) {
        return Finish(*w, kExitFail);
      }
      if (stop[0] != std::byte{0}) break;
    }
    Fill(gl::DataType::kFloat32, buf, a.count, rank, round % 8, 0);
    if (gl::Status s = w->PushPull(*h, buf).Wait(Deadline(a.wait_s)); !s.ok()) {
      std::fprintf(stderr, "probe rank %u: push_pull: %s\n", rank, s.ToString().c_str());
      return Finish(*w, kExitFail);
    }
    uint64_t first = 0;
    if (CountWrong(gl::DataType::kFloat32, buf, a.count, n, round % 8, 0, false, &first) != 0) {
      std::fprintf(stderr, "probe rank %u: wrong sum in round %llu\n", rank,
                   static_cast<unsigned long long>(round));
      return Finish(*w, kExitWrong);
    }
  }
  std::printf("probe rank %u: %llu rounds right\n", rank, static_cast<unsigned long long>(round));
  return Finish(*w, 0);
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"gradlink integration-test worker"};
  Args a;
  app.add_option("--scheduler", a.scheduler, "scheduler host:port")->required();
  app.add_option("--mode", a.mode, "many-keys | honest | mismatch | timeout | abandon | rank-order")->required();
  app.add_option("--job", a.job);
  app.add_option("--rank", a.rank);
  app.add_option("--rounds", a.rounds);
  app.add_option("--tensors", a.tensors);
  app.add_option("--count", a.count);
  app.add_option("--partition-bytes", a.partition_bytes);
  app.add_option("--max-in-flight", a.max_in_flight);
  app.add_option("--wait-s", a.wait_s);
  app.add_option("--stall", a.stall, "stall: what rank 1 does late, declare | push");
  app.add_option("--delay-ms", a.delay_ms, "stall: how late");
  app.add_option("--until-file", a.until_file, "loop: stop once this file exists");
  app.add_flag("--dtype-mismatch", a.dtype_mismatch);
  app.add_flag("--corrupt", a.corrupt, "many-keys: push one wrong element (checks the checks)");
  app.add_flag("--same-issue-order", a.same_issue_order,
               "many-keys: every rank issues its push_pulls in one order (declarations still differ)");
  CLI11_PARSE(app, argc, argv);
  if (a.mode == "many-keys") return RunManyKeys(a);
  if (a.mode == "honest") return RunHonest(a);
  if (a.mode == "mismatch") return RunMismatch(a);
  if (a.mode == "rank-order") return RunRankOrder(a);
  if (a.mode == "timeout") return RunTimeout(a, false);
  if (a.mode == "abandon") return RunTimeout(a, true);
  if (a.mode == "stall") return RunStall(a);
  if (a.mode == "loop") return RunLoop(a);
  std::fprintf(stderr, "probe: unknown mode '%s'\n", a.mode.c_str());
  return 2;
}
