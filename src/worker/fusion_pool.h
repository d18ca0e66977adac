// Fusion buffers, reused across PushPullGroup calls (fusion.cc).
#pragma once

#include <cstddef>
#include <memory>
#include <vector>

#include "common/mutex.h"
#include "common/thread_annotations.h"

namespace gradlink::internal {

// Thread-safe; buffers come back when their last owner (a fused op) lets go.
class FusionPool {
 public:
  explicit FusionPool(size_t buffer_bytes) : buffer_bytes_(buffer_bytes) {}

  static std::shared_ptr<std::byte> Take(const std::shared_ptr<FusionPool>& pool) {
    std::byte* p = nullptr;
    {
      MutexLock lock(pool->mu_);
      if (!pool->free_.empty()) {
        p = pool->free_.back().release();
        pool->free_.pop_back();
      }
    }
    // new[] aligns to at least 16 bytes: every member packed after it is aligned to its dtype.
    if (p == nullptr) p = new std::byte[pool->buffer_bytes_];
    return std::shared_ptr<std::byte>(p, [pool](std::byte* b) { pool->Give(b); });
  }

 private:
  // Idle buffers kept (each fusion_buffer_bytes, resident once used).
  static constexpr size_t kMaxFree = 8;

  void Give(std::byte* b) {
    std::unique_ptr<std::byte[]> owned(b);
    MutexLock lock(mu_);
    if (free_.size() < kMaxFree) free_.push_back(std::move(owned));
  }

  const size_t buffer_bytes_;
  Mutex mu_;
  std::vector<std::unique_ptr<std::byte[]>> free_ GUARDED_BY(mu_);
};

}  // namespace gradlink::internal
