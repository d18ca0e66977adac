// Histogram: a latency histogram a hot path observes into without a lock, and a scrape reads.
//
//   metrics::Histogram rounds;                 // kLatencyBounds: 50 us .. 60 s
//   rounds.Observe(seconds);                   // any thread: two relaxed atomic adds
//   rounds.AddTo(family, labels);              // the scrape: cumulative buckets, _sum, _count
//
// Buckets are fixed (no allocation after construction). A scrape that races an Observe may see
// the count without the sum, or one bucket ahead of the others, by one observation: Prometheus'
// rate() over a few scrapes does not notice, and the counts never go backwards.
//
// Threads: Observe from any thread; AddTo from any.
#pragma once

#include <array>
#include <atomic>
#include <cstdint>
#include <vector>

#include "metrics/exposition.h"

namespace gradlink::metrics {

// Upper bounds, in seconds, from 50 us (a 4 KiB push_pull on one host) to 60 s (a stall).
inline constexpr std::array<double, 16> kLatencyBounds = {
    50e-6, 100e-6, 250e-6, 500e-6, 1e-3,   2.5e-3, 5e-3, 10e-3,
    25e-3, 50e-3,  100e-3, 250e-3, 500e-3, 1.0,    10.0, 60.0};

class Histogram {
 public:
  void Observe(double seconds) {
    size_t i = 0;
    while (i < kLatencyBounds.size() && seconds > kLatencyBounds[i]) ++i;
    counts_[i].fetch_add(1, std::memory_order_relaxed);
    sum_ns_.fetch_add(static_cast<uint64_t>(seconds * 1e9), std::memory_order_relaxed);
  }

  uint64_t count() const {
    uint64_t n = 0;
    for (const auto& c : counts_) n += c.load(std::memory_order_relaxed);
    return n;
  }

  void AddTo(Family& family, const Labels& labels) const {
    std::vector<uint64_t> counts(counts_.size());
    for (size_t i = 0; i < counts_.size(); ++i)
      counts[i] = counts_[i].load(std::memory_order_relaxed);
    AddHistogram(family, labels, {kLatencyBounds.begin(), kLatencyBounds.end()}, counts,
                 static_cast<double>(sum_ns_.load(std::memory_order_relaxed)) * 1e-9);
  }

 private:
  std::array<std::atomic<uint64_t>, kLatencyBounds.size() + 1> counts_{};  // the last: +Inf
  std::atomic<uint64_t> sum_ns_{0};
};

}  // namespace gradlink::metrics
