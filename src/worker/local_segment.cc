// The same-host path's shared-memory segment (local_reduce.h): creating or opening it and
// meeting the host's other workers there (Open), claiming a tensor's room in the segment's
// channel table (Claim), and reading why a departed worker left (LeftJob).
//
// Threads: Open runs on the worker's joining thread (Init), before any other thread of the
// LocalReduce exists. Claim runs on the thread that binds a tensor (a caller's first PushPull
// or Declare), outside every lock: it may spin while another worker fills in the entry it
// waits for. LeftJob runs on the driving thread. What they share with other workers lies in
// the segment and is reached through atomics only.
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <new>
#include <thread>

#include "common/log.h"
#include "worker/local_reduce.h"
#include "worker/local_segment.h"

namespace gradlink::internal {

using local_path::CpuRelax;
using local_path::kLine;
using local_path::kTableSize;
using local_path::RoundUp;
using local_path::TableEntry;

namespace {

constexpr uint64_t kMagic = 0x676c6c6f63616c31;        // "gllocal1"
constexpr uint64_t kMagicNoRoom = 0x676c6e6f726f6f6d;  // "glnoroom": header only, path off
constexpr uint64_t kNoRoom = ~uint64_t{0};

std::string Errno(const char* what) {
  return std::string(what) + ": " + std::strerror(errno);
}

}  // namespace

Result<std::shared_ptr<LocalReduce>> LocalReduce::Open(const Options& o) {
  if (o.ranks < 1 || o.ranks > kMaxRanks || o.rank >= o.ranks) {
    return InvalidArgument("same-host path: " + std::to_string(o.ranks) + " workers (1.." +
                           std::to_string(kMaxRanks) + " supported), rank " +
                           std::to_string(o.rank));
  }
  if (o.chunk_bytes < kLine || o.arena_bytes == 0) {
    return InvalidArgument("same-host path: chunk of " + std::to_string(o.chunk_bytes) +
                           " bytes, arena of " + std::to_string(o.arena_bytes) +
                           " (need >= 64 and > 0)");
  }
  const uint64_t header = RoundUp(sizeof(Segment), 4096);
  // Polls until `ready()`: kTimeout at the deadline, the job's failure once it has failed.
  auto wait = [&o](const std::function<bool()>& ready, const std::string& what) -> Status {
    while (!ready()) {
      if (o.cancelled) GL_RETURN_IF_ERROR(o.cancelled());
      if (Clock::now() >= o.deadline) return Timeout("same-host path: " + what);
      std::this_thread::sleep_for(std::chrono::microseconds(200));
    }
    return Status::Ok();
  };
  int fd = -1;
  uint64_t size = 0;
  std::string no_room;  // worker 0: why the arena cannot be had (then every worker goes without)
  if (o.rank == 0) {
    size = header + RoundUp(o.arena_bytes, 4096);
    fd = shm_open(o.name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
    if (fd < 0) return Unavailable(Errno(("same-host path: shm_open " + o.name).c_str()));
    // Reserve the pages now: a tmpfs that runs out later would kill us with SIGBUS. Not more
    // than is free (fallocate would take it all first), and in slices: an interrupted
    // fallocate gives back what it had reserved, so a signal-heavy process (a profiler's
    // timer) could retry a huge one forever.
    struct statvfs vfs {};
    if (statvfs("/dev/shm", &vfs) == 0 && size > uint64_t{vfs.f_bavail} * vfs.f_frsize) {
      no_room = std::to_string(uint64_t{vfs.f_bavail} * vfs.f_frsize) + " bytes free in /dev/shm";
    }
    for (uint64_t off = 0; off < size && no_room.empty();) {
      const uint64_t len = std::min<uint64_t>(size - off, 64u << 20);
      const int err = posix_fallocate(fd, static_cast<off_t>(off), static_cast<off_t>(len));
      if (err == 0) off += len;
      if (err != 0 && err != EINTR) no_room = std::strerror(err);
      if (no_room.empty() && Clock::now() >= o.deadline) no_room = "the deadline passed";
    }
    // Without the arena, a segment of the header alone tells the others, so that every worker
    // goes through the servers alike.
    if (!no_room.empty()) {
      size = header;
      if (ftruncate(fd, static_cast<off_t>(size)) != 0) {
        const Status failed = ResourceExhausted(Errno(
            ("same-host path: " + no_room + ", and no room for the header of " + o.name).c_str()));
        close(fd);
        shm_unlink(o.name.c_str());
        return failed;
      }
    }
  } else {
    // Worker 0 creates the object, reserves it whole, then writes the header, magic last.
    Status open_error;
    const Status found = wait(
        [&] {
          fd = shm_open(o.name.c_str(), O_RDWR, 0);
          if (fd < 0) {
            if (errno != ENOENT) {
              open_error = Unavailable(Errno(("same-host path: shm_open " + o.name).c_str()));
            }
            return !open_error.ok();
          }
          struct stat st {};
          if (fstat(fd, &st) == 0 && static_cast<uint64_t>(st.st_size) >= header) return true;
          close(fd);
          fd = -1;
          return false;
        },
        "worker " + std::to_string(o.rank) + " found no shared-memory segment " + o.name +
            " from worker 0: are all workers on one host, in one /dev/shm?");
    if (!found.ok() || !open_error.ok()) {
      if (fd >= 0) close(fd);
      shm_unlink(o.name.c_str());  // worker 0 may have died after creating it
      return open_error.ok() ? found : open_error;
    }
    void* head = mmap(nullptr, header, PROT_READ, MAP_SHARED, fd, 0);
    if (head == MAP_FAILED) {
      close(fd);
      return Unavailable(Errno("same-host path: mmap"));
    }
    const auto* h = static_cast<const Segment*>(head);
    Status ready = wait(
        [h] {
          const uint64_t m = h->magic.load(std::memory_order_acquire);
          return m == kMagic || m == kMagicNoRoom;
        },
        "segment " + o.name + " was never initialised by worker 0");
    const uint32_t ranks = h->ranks, table = h->table_size;
    size = header + h->arena_bytes;
    munmap(head, header);
    struct stat st {};
    if (ready.ok() && (ranks != o.ranks || table != kTableSize || fstat(fd, &st) != 0 ||
                       static_cast<uint64_t>(st.st_size) != size)) {
      ready = Internal("same-host path: segment " + o.name + " does not match this worker: " +
                       std::to_string(ranks) + " workers (expected " + std::to_string(o.ranks) +
                       "), " + std::to_string(table) + " channels (expected " +
                       std::to_string(kTableSize) + "), " + std::to_string(st.st_size) +
                       " bytes (expected " + std::to_string(size) + ")");
    }
    if (!ready.ok()) {
      close(fd);
      shm_unlink(o.name.c_str());  // the job is over for this run: leave nothing in /dev/shm
      return ready;
    }
  }
  void* base = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  close(fd);
  if (base == MAP_FAILED) {
    const Status failed = Unavailable(Errno("same-host path: mmap"));
    shm_unlink(o.name.c_str());  // the job cannot start: leave nothing in /dev/shm
    return failed;
  }
  auto* seg = static_cast<Segment*>(base);
  if (o.rank == 0) {
    new (seg) Segment();  // the file is fresh: zeros, which every field starts as anyway
    seg->ranks = o.ranks;
    seg->table_size = kTableSize;
    seg->arena_bytes = size - header;
    seg->chunk_bytes = o.chunk_bytes;
    std::snprintf(seg->no_room, sizeof(seg->no_room), "%s", no_room.c_str());
    seg->magic.store(no_room.empty() ? kMagic : kMagicNoRoom, std::memory_order_release);
  }
  const bool room = seg->magic.load(std::memory_order_acquire) == kMagic;
  std::shared_ptr<LocalReduce> lr;
  if (room) lr.reset(new LocalReduce(o, base, size));  // unmaps the segment when it goes
  seg->opened.fetch_add(1, std::memory_order_acq_rel);
  Status all = wait([seg, &o] { return seg->opened.load(std::memory_order_acquire) >= o.ranks; },
                    "not every one of the " + std::to_string(o.ranks) +
                        " workers opened the shared-memory segment " + o.name);
  // Everyone has it mapped (or gives up): the name is no longer needed, and nothing is left
  // behind in /dev/shm if a worker dies later. A worker that gives up removes it too: worker 0
  // may have died after creating it.
  if (o.rank == 0 || !all.ok()) shm_unlink(o.name.c_str());
  if (!room) {
    GL_LOG(kWarn) << "worker " << o.rank << ": the same-host path is off, every sum goes "
                  << "through the servers: worker 0 could not reserve " << o.arena_bytes
                  << " bytes of shared memory (" << seg->no_room
                  << "; lower local_arena_bytes / GRADLINK_LOCAL_ARENA_BYTES, or enlarge /dev/shm)";
    munmap(base, size);
    if (!all.ok()) return all;
    return std::shared_ptr<LocalReduce>();
  }
  if (!all.ok()) return all;
  return lr;
}

Result<std::optional<uint64_t>> LocalReduce::Claim(uint64_t key, DataType dtype, uint64_t count,
                                                   uint64_t part_elems, uint64_t need) {
  for (uint32_t probe = 0; probe < kTableSize; ++probe) {
    TableEntry& e = seg_->table[(key + probe) % kTableSize];
    uint32_t state = e.state.load(std::memory_order_acquire);
    if (state == TableEntry::kFree) {
      uint32_t expected = TableEntry::kFree;
      if (e.state.compare_exchange_strong(expected, TableEntry::kClaiming,
                                          std::memory_order_acq_rel)) {
        e.key = key;
        e.dtype = static_cast<uint32_t>(dtype);
        e.count = count;
        e.part_elems = part_elems;
        e.offset = kNoRoom;
        uint64_t used = seg_->arena_used.load(std::memory_order_relaxed);
        while (used <= seg_->arena_bytes && need <= seg_->arena_bytes - used) {
          if (seg_->arena_used.compare_exchange_weak(used, used + RoundUp(need, kLine),
                                                     std::memory_order_relaxed)) {
            e.offset = used;
            break;
          }
        }
        e.state.store(TableEntry::kReady, std::memory_order_release);
        state = TableEntry::kReady;
      } else {
        state = expected;
      }
    }
    // Another worker is filling the entry in: a few stores away, unless it died there.
    const Clock::time_point give_up = Clock::now() + std::chrono::seconds(5);
    while (state == TableEntry::kClaiming) {
      if (Clock::now() > give_up) {
        return Internal("same-host path: the channel of key " + std::to_string(key) +
                        " was never filled in by the worker that claimed it");
      }
      CpuRelax();
      state = e.state.load(std::memory_order_acquire);
    }
    if (e.key != key) continue;
    if (e.dtype != static_cast<uint32_t>(dtype) || e.count != count ||
        e.part_elems != part_elems) {
      return Internal("same-host path: key " + std::to_string(key) + " was bound as " +
                      std::to_string(e.count) + " elements of dtype " +
                      std::to_string(e.dtype) + " (partitions of " +
                      std::to_string(e.part_elems) + ") by another worker, here as " +
                      std::to_string(count) + " of dtype " +
                      std::to_string(static_cast<uint32_t>(dtype)) + " (partitions of " +
                      std::to_string(part_elems) + ")");
    }
    if (e.offset == kNoRoom) return std::optional<uint64_t>();
    return std::optional<uint64_t>(e.offset);
  }
  return std::optional<uint64_t>();  // the table is full
}

std::string LocalReduce::LeftJob(uint32_t j) const {
  // Read after its `gone` flag (acquire), so the text is whole; bounded whatever it holds.
  const char* why = seg_->why_gone[j];
  const std::string cause(why, strnlen(why, sizeof(seg_->why_gone[j])));
  return Name(j) + " left the job" + (cause.empty() ? "" : " (" + cause + ")");
}

}  // namespace gradlink::internal
