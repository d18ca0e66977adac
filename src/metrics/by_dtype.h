// ByDtype: a byte counter per dtype that a hot path adds to without a lock, and a scrape reads
// as one sample per dtype (dtype="fp32", ...), as the roles count bytes pushed, pulled, summed.
//
//   metrics::ByDtype summed;
//   summed.Add(header.dtype, header.payload_bytes);   // any thread: one relaxed atomic add
//   summed.AddTo(family, labels);                     // the scrape
//
// Threads: Add and AddTo from any thread.
#pragma once

#include <array>
#include <atomic>
#include <cstdint>
#include <string>

#include "gradlink/tensor.h"
#include "metrics/exposition.h"

namespace gradlink::metrics {

class ByDtype {
 public:
  // `dtype`: a DataType's value (a header's dtype byte); one that is not counts nowhere seen.
  void Add(uint8_t dtype, uint64_t bytes) {
    counts_[dtype & 7].fetch_add(bytes, std::memory_order_relaxed);
  }
  void Add(DataType dtype, uint64_t bytes) { Add(static_cast<uint8_t>(dtype), bytes); }

  void AddTo(Family& family, const Labels& labels) const {
    for (uint8_t t = 0; t < counts_.size(); ++t) {
      if (!IsValidDataType(t)) continue;
      family.Put(With(labels, "dtype", std::string(DataTypeName(static_cast<DataType>(t)))),
                 static_cast<double>(counts_[t].load(std::memory_order_relaxed)));
    }
  }

 private:
  std::array<std::atomic<uint64_t>, 8> counts_{};
};

}  // namespace gradlink::metrics
