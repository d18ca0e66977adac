// Throughput of the element-wise reducers, against memcpy of the same number of bytes.
//
// Sizes are the bytes of *input* (wire-dtype data) per call: 4 MiB (largely cache-resident on
// big-L3 servers) and 64 MiB (DRAM). bytes_per_second counts input bytes only: for Accumulate
// the n wire elements of x (the fp32 accumulator, 2x larger for fp16/bf16, is extra traffic),
// for SumTwo both inputs, for memcpy the bytes copied. Accumulate reads acc and x and writes acc
// back: three streams of traffic, like memcpy's read + write-allocate + write.
//
// The *_Isa benchmarks force one implementation (0 scalar, 1 AVX2, 2 AVX-512, 3 NEON; x86-64
// builds list 0-2, aarch64 builds 0 and 3); an ISA this CPU lacks is reported as skipped.
//
// Run e.g.: reduce_bench --benchmark_repetitions=3 --benchmark_report_aggregates_only=true
#include <benchmark/benchmark.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>

#include "gradlink/tensor.h"
#include "reduce/reduce.h"

namespace gradlink::reduce {
namespace {

constexpr int64_t kMiB = 1 << 20;

struct FreeDeleter {
  void operator()(void* p) const { std::free(p); }
};
using Buffer = std::unique_ptr<unsigned char, FreeDeleter>;

// A 64-byte-aligned buffer, every page touched (no page faults inside the timed loop).
Buffer Alloc(size_t bytes, unsigned char fill) {
  const size_t rounded = (bytes + 63) / 64 * 64;
  Buffer b(static_cast<unsigned char*>(std::aligned_alloc(64, rounded)));
  std::memset(b.get(), fill, rounded);
  return b;
}

// Fills n elements of dtype t with small normal values (no NaN, Inf or subnormals, which some
// CPUs handle slowly), so repeated accumulation stays in range.
void FillValues(DataType t, void* p, size_t n) {
  for (size_t i = 0; i < n; ++i) {
    switch (t) {
      case DataType::kFloat32: static_cast<float*>(p)[i] = 1e-3f * static_cast<float>(i % 7); break;
      case DataType::kFloat64: static_cast<double*>(p)[i] = 1e-3 * static_cast<double>(i % 7); break;
      case DataType::kFloat16:
        static_cast<uint16_t*>(p)[i] = FloatToHalf(1e-3f * static_cast<float>(i % 7 + 1));
        break;
      case DataType::kBFloat16:
        static_cast<uint16_t*>(p)[i] = FloatToBFloat16(1e-3f * static_cast<float>(i % 7 + 1));
        break;
      case DataType::kInt32: static_cast<int32_t*>(p)[i] = static_cast<int32_t>(i % 7); break;
      case DataType::kInt64: static_cast<int64_t*>(p)[i] = static_cast<int64_t>(i % 7); break;
    }
  }
}

const char* IsaName(ReduceIsa isa) {
  switch (isa) {
    case ReduceIsa::kAuto: return "auto";
    case ReduceIsa::kScalar: return "scalar";
    case ReduceIsa::kAvx2: return "avx2";
    case ReduceIsa::kAvx512: return "avx512";
    case ReduceIsa::kNeon: return "neon";
  }
  return "?";
}

// Forces `isa` for one benchmark and restores the automatic choice afterwards.
class IsaScope {
 public:
  IsaScope(benchmark::State& state, ReduceIsa isa) : ok_(SetReduceIsaForTesting(isa)) {
    if (!ok_) {
      state.SkipWithError("instruction set not supported on this CPU");
      return;
    }
    state.SetLabel(IsaName(ActiveReduceIsa()));
  }
  ~IsaScope() { SetReduceIsaForTesting(ReduceIsa::kAuto); }
  bool ok() const { return ok_; }

 private:
  bool ok_;
};

void BM_Memcpy(benchmark::State& state) {
  const size_t bytes = static_cast<size_t>(state.range(0));
  Buffer src = Alloc(bytes, 1), dst = Alloc(bytes, 2);
  for (auto _ : state) {
    std::memcpy(dst.get(), src.get(), bytes);
    benchmark::DoNotOptimize(dst.get());
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(state.iterations() * static_cast<int64_t>(bytes));
}

void RunAccumulate(benchmark::State& state, DataType t, ReduceIsa isa) {
  IsaScope scope(state, isa);
  if (!scope.ok()) return;
  const size_t in_bytes = static_cast<size_t>(state.range(0));
  const size_t n = in_bytes / DataTypeSize(t);
  Buffer x = Alloc(in_bytes, 0);
  Buffer acc = Alloc(n * DataTypeSize(AccumulatorType(t)), 0);
  FillValues(t, x.get(), n);
  Load(t, acc.get(), x.get(), n);
  for (auto _ : state) {
    Accumulate(t, acc.get(), x.get(), n);
    benchmark::DoNotOptimize(acc.get());
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(state.iterations() * static_cast<int64_t>(in_bytes));
}

void RunSumTwo(benchmark::State& state, DataType t, ReduceIsa isa) {
  IsaScope scope(state, isa);
  if (!scope.ok()) return;
  const size_t in_bytes = static_cast<size_t>(state.range(0));  // per input
  const size_t n = in_bytes / DataTypeSize(t);
  Buffer a = Alloc(in_bytes, 0), b = Alloc(in_bytes, 0);
  Buffer acc = Alloc(n * DataTypeSize(AccumulatorType(t)), 0);
  FillValues(t, a.get(), n);
  FillValues(t, b.get(), n);
  for (auto _ : state) {
    SumTwo(t, acc.get(), a.get(), b.get(), n);
    benchmark::DoNotOptimize(acc.get());
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(state.iterations() * 2 * static_cast<int64_t>(in_bytes));
}

void BM_Fp32Accumulate(benchmark::State& s) { RunAccumulate(s, DataType::kFloat32, ReduceIsa::kAuto); }
void BM_Fp32SumTwo(benchmark::State& s) { RunSumTwo(s, DataType::kFloat32, ReduceIsa::kAuto); }
void BM_Fp16Accumulate(benchmark::State& s) { RunAccumulate(s, DataType::kFloat16, ReduceIsa::kAuto); }
void BM_Bf16Accumulate(benchmark::State& s) { RunAccumulate(s, DataType::kBFloat16, ReduceIsa::kAuto); }
void BM_Fp64Accumulate(benchmark::State& s) { RunAccumulate(s, DataType::kFloat64, ReduceIsa::kAuto); }
void BM_Int32Accumulate(benchmark::State& s) { RunAccumulate(s, DataType::kInt32, ReduceIsa::kAuto); }

// Args: {input bytes, isa (0 scalar, 1 AVX2, 2 AVX-512, 3 NEON)}.
ReduceIsa IsaArg(int64_t v) {
  switch (v) {
    case 0: return ReduceIsa::kScalar;
    case 1: return ReduceIsa::kAvx2;
    case 2: return ReduceIsa::kAvx512;
    default: return ReduceIsa::kNeon;
  }
}
void BM_Fp32Accumulate_Isa(benchmark::State& s) {
  RunAccumulate(s, DataType::kFloat32, IsaArg(s.range(1)));
}
void BM_Fp16Accumulate_Isa(benchmark::State& s) {
  RunAccumulate(s, DataType::kFloat16, IsaArg(s.range(1)));
}

void Sizes(benchmark::internal::Benchmark* b) {
  b->Arg(4 * kMiB)->Arg(64 * kMiB)->Unit(benchmark::kMicrosecond);
}
void IsaSizes(benchmark::internal::Benchmark* b) {
  for (int64_t size : {4 * kMiB, 64 * kMiB}) {
#if defined(__aarch64__)
    for (int64_t isa : {0, 3}) b->Args({size, isa});
#else
    for (int64_t isa : {0, 1, 2}) b->Args({size, isa});
#endif
  }
  b->ArgNames({"bytes", "isa"})->Unit(benchmark::kMicrosecond);
}

BENCHMARK(BM_Memcpy)->Apply(Sizes);
BENCHMARK(BM_Fp32Accumulate)->Apply(Sizes);
BENCHMARK(BM_Fp32SumTwo)->Apply(Sizes);
BENCHMARK(BM_Fp16Accumulate)->Apply(Sizes);
BENCHMARK(BM_Bf16Accumulate)->Apply(Sizes);
BENCHMARK(BM_Fp64Accumulate)->Apply(Sizes);
BENCHMARK(BM_Int32Accumulate)->Apply(Sizes);
BENCHMARK(BM_Fp32Accumulate_Isa)->Apply(IsaSizes);
BENCHMARK(BM_Fp16Accumulate_Isa)->Apply(IsaSizes);

}  // namespace
}  // namespace gradlink::reduce

BENCHMARK_MAIN();
