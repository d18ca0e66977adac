// The same-host path's public class (local_reduce.h): its life (made by Open, local_segment.cc;
// ended by Stop), the jobs handed to it (Start), the job's failure (Fail), and this worker's
// join flag in the segment (SetJoined, ClearJoined, HasJoined). The rest lives by concern:
// local_segment.cc (the segment and its channel table), local_driver.cc (who drives, the
// background thread, the bells), local_flat.cc (the flat protocol), local_host.cc (the host
// protocol).
//
// Threads: Start and Fail from any thread, with the caller's own locks held or not (they take
// only mu_, briefly); SetJoined and ClearJoined on the worker's control thread; Stop from the
// thread that shuts the worker down (it joins the background thread, then drives a last pass).
#include <sys/mman.h>

#include <cstdio>

#include "worker/local_reduce.h"
#include "worker/local_segment.h"

namespace gradlink::internal {

using local_path::kPassSums;

LocalReduce::LocalReduce(const Options& o, void* base, uint64_t mapped_bytes)
    : opts_(o), seg_(static_cast<Segment*>(base)), mapped_bytes_(mapped_bytes) {
  background_ = std::thread([this] { Background(); });
}

uint64_t LocalReduce::arena_bytes() const { return seg_->arena_bytes; }

LocalReduce::~LocalReduce() {
  Stop();
  munmap(seg_, mapped_bytes_);
}

void LocalReduce::Start(Job job) {
  jobs_.fetch_add(1, std::memory_order_relaxed);
  MutexLock lock(mu_);
  incoming_.push_back(std::move(job));
}

void LocalReduce::Fail(const Status& s) {
  {
    MutexLock lock(mu_);
    if (failure_.ok()) failure_ = s;
    failed_.store(true, std::memory_order_release);
    background_wanted_ = true;
    cv_.NotifyOne();
  }
  Ring(opts_.rank);
}

void LocalReduce::Stop() {
  std::string why;
  {
    MutexLock lock(mu_);
    if (stopping_) return;
    stopping_ = true;
    if (failure_.ok()) failure_ = Aborted(Name(opts_.rank) + " shut down");
    why = failure_.ToString();
    failed_.store(true, std::memory_order_release);
    cv_.NotifyOne();
  }
  Ring(opts_.rank);  // the background thread may be asleep on the bell
  if (background_.joinable()) background_.join();
  MutexLock drive(drive_mu_);
  DriveOnce(kPassSums);  // failed: ends every job
  // The others stop waiting for this worker's chunks (AdvanceFlat, AdvanceHost), and learn why.
  std::snprintf(seg_->why_gone[opts_.rank], sizeof(seg_->why_gone[opts_.rank]), "%s",
                why.c_str());
  seg_->gone[opts_.rank].store(1, std::memory_order_release);
  RingPeers();
  Ring(opts_.rank);
}

bool LocalReduce::HasJoined(uint32_t j) const {
  const uint32_t epoch = seg_->joined[j].load(std::memory_order_acquire);
  return epoch != 0 && epoch > seg_->released.load(std::memory_order_acquire);
}

void LocalReduce::SetJoined() {
  seg_->joined[opts_.rank].store(releases_seen_ + 1, std::memory_order_release);
  RingPeers();  // a peer asleep waiting for this worker's chunk sums without it now
  Ring(opts_.rank);  // and this worker's Join(), for rounds begun without it
}

void LocalReduce::ClearJoined() {
  ++releases_seen_;
  uint32_t released = seg_->released.load(std::memory_order_acquire);
  while (released < releases_seen_ &&
         !seg_->released.compare_exchange_weak(released, releases_seen_,
                                               std::memory_order_acq_rel)) {
  }
  seg_->joined[opts_.rank].store(0, std::memory_order_release);
}

}  // namespace gradlink::internal
