// The buffers of a server's rounds, shared by all its partitions.
//
// A round takes its staging, accumulator and result buffers when it needs them and gives each
// back as soon as it is done with it: a push's staging buffer once it is summed, the
// accumulator and the result once every reply has been sent. So what a server holds follows
// the rounds in flight, which the workers' leads bound (WorkerOptions::max_bytes_ahead), and
// not every partition it was ever given (a 4 GiB tensor once cost its server 12 GiB for the
// rest of the job). Free buffers are kept by size for the next round (a key's partitions share
// one size), so the steady state allocates nothing, up to `max_free_bytes`; past that a buffer
// given back is freed.
//
// Threads: any; one mutex, taken once per Take or Give and never while waiting on anything.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <unordered_map>
#include <utility>
#include <vector>

#include "common/mutex.h"
#include "common/thread_annotations.h"

namespace gradlink::server {

class BufferPool {
 public:
  explicit BufferPool(uint64_t max_free_bytes) : max_free_bytes_(max_free_bytes) {}

  // A buffer of exactly `bytes` (a reused one keeps what it held; a new one is zeroed).
  std::vector<std::byte> Take(size_t bytes) {
    std::vector<std::byte> buf;
    {
      MutexLock lock(mu_);
      auto it = free_.find(bytes);
      if (it != free_.end() && !it->second.empty()) {
        buf = std::move(it->second.back());
        it->second.pop_back();
        free_bytes_ -= bytes;
      }
      in_use_bytes_ += bytes;
      peak_bytes_ = std::max(peak_bytes_.load(std::memory_order_relaxed), in_use_bytes_ + free_bytes_);
    }
    if (buf.size() != bytes) {
      allocations_.fetch_add(1, std::memory_order_relaxed);
      buf = std::vector<std::byte>(bytes);
    }
    return buf;
  }

  // Gives `buf` back (it is left empty). A buffer of size 0 is nothing to give.
  void Give(std::vector<std::byte>& buf) {
    const size_t bytes = buf.size();
    if (bytes == 0) return;
    std::vector<std::byte> freed;  // freed outside the lock
    {
      MutexLock lock(mu_);
      in_use_bytes_ -= bytes;
      if (free_bytes_ + bytes <= max_free_bytes_) {
        free_[bytes].push_back(std::move(buf));
        free_bytes_ += bytes;
      } else {
        freed = std::move(buf);
      }
    }
    buf = std::vector<std::byte>();
  }

  // Bytes in the rounds' hands, kept free for reuse, and the most of the two together so far.
  uint64_t in_use_bytes() const {
    MutexLock lock(mu_);
    return in_use_bytes_;
  }
  uint64_t free_bytes() const {
    MutexLock lock(mu_);
    return free_bytes_;
  }
  uint64_t peak_bytes() const { return peak_bytes_.load(std::memory_order_relaxed); }
  uint64_t allocations() const { return allocations_.load(std::memory_order_relaxed); }

 private:
  const uint64_t max_free_bytes_;
  mutable Mutex mu_;
  std::unordered_map<size_t, std::vector<std::vector<std::byte>>> free_ GUARDED_BY(mu_);
  uint64_t free_bytes_ GUARDED_BY(mu_) = 0;
  uint64_t in_use_bytes_ GUARDED_BY(mu_) = 0;
  std::atomic<uint64_t> peak_bytes_{0};  // written under mu_, read without it
  std::atomic<uint64_t> allocations_{0};
};

}  // namespace gradlink::server
