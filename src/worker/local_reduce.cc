// Over 600 lines on purpose: the segment's layout, its claim table and the drive loop are one
// protocol over one shared structure; split, each part would expose the segment's internals.
#include "worker/local_reduce.h"

#include <fcntl.h>
#include <linux/futex.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <climits>
#include <cstdio>
#include <cstring>
#include <new>

#include "common/log.h"
#include "reduce/reduce.h"
#include "wire/frame.h"

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace gradlink::internal {

namespace {

constexpr uint64_t kMagic = 0x676c6c6f63616c31;        // "gllocal1"
constexpr uint64_t kMagicNoRoom = 0x676c6e6f726f6f6d;  // "glnoroom": header only, path off
constexpr uint32_t kTableSize = 4096;           // channels (tensors) per segment
constexpr uint64_t kNoRoom = ~uint64_t{0};
constexpr uint64_t kLine = 64;
// A waiting caller spins this long on the segment before it sleeps: a peer's post or
// consumption arrives within a few microseconds when both workers are running, and a futex
// wake-up costs more than that (bench/RESULTS.md, "the same-host path").
constexpr auto kSpin = std::chrono::microseconds(50);
// Sleepers recheck failure and deadlines this often even when nothing rings.
constexpr auto kNap = std::chrono::milliseconds(20);
// Chunks one pass sums per job at most (then deadlines and waiting callers are looked at), and
// what Poll() may sum on the caller's thread (Python calls it holding the GIL).
constexpr uint64_t kPassSums = 16;
constexpr uint64_t kPollSums = 2;

uint64_t RoundUp(uint64_t n, uint64_t to) { return (n + to - 1) / to * to; }

// Adds the time from its construction to its destruction to `total`: the segment's work
// (copies and sums) as the stats report it. Two clock reads per chunk or partition.
class BusyTimer {
 public:
  explicit BusyTimer(std::atomic<uint64_t>& total) : total_(total), start_(Clock::now()) {}
  ~BusyTimer() {
    total_.fetch_add(static_cast<uint64_t>(std::chrono::duration_cast<std::chrono::nanoseconds>(
                                               Clock::now() - start_)
                                               .count()),
                     std::memory_order_relaxed);
  }
  BusyTimer(const BusyTimer&) = delete;
  BusyTimer& operator=(const BusyTimer&) = delete;

 private:
  std::atomic<uint64_t>& total_;
  const Clock::time_point start_;
};

void CpuRelax() {
#if defined(__x86_64__)
  _mm_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

std::string Errno(const char* what) {
  return std::string(what) + ": " + std::strerror(errno);
}

}  // namespace

// Every field lies in the shared mapping. Atomics of these sizes are lock-free and
// address-free, so they work between processes.
struct alignas(kLine) Bell {
  std::atomic<uint32_t> word{0};      // bumped on every post or consumption meant for this rank
  std::atomic<uint32_t> sleepers{0};  // threads of this rank in futex_wait on `word`
};

struct TableEntry {
  enum : uint32_t { kFree = 0, kClaiming = 1, kReady = 2 };
  std::atomic<uint32_t> state{kFree};
  uint32_t dtype = 0;
  uint64_t key = 0;
  uint64_t count = 0;
  uint64_t part_elems = 0;  // host channels: the most elements per partition; 0: a channel
  uint64_t offset = 0;  // into the arena; kNoRoom
};

struct LocalReduce::Segment {
  std::atomic<uint64_t> magic{0};  // set last by rank 0
  uint32_t ranks = 0;
  uint32_t table_size = 0;
  uint64_t arena_bytes = 0;
  uint64_t chunk_bytes = 0;
  std::atomic<uint32_t> opened{0};
  std::atomic<uint64_t> arena_used{0};
  Bell bells[kMaxRanks];
  std::atomic<uint32_t> gone[kMaxRanks];  // set by a worker that stops (it will post no more)
  // Why it stopped (its failure, or that it shut down), written before its `gone` flag: a peer
  // left waiting reports the cause (the scheduler lost, a server lost), not just the departure.
  char why_gone[kMaxRanks][192] = {};
  // Set by a worker that joined (Worker::Join): it posts nothing until every rank has, and sits
  // out every chunk it has not posted. Each join is one epoch: a flag holds the epoch its worker
  // joined in (the releases it had seen, plus one), and counts only while that epoch is not
  // released (`released`, raised by the first worker to see each release). So a worker that
  // learns of its own join late, after another worker of the host saw the release and posted
  // again, sets a flag that no longer counts.
  std::atomic<uint32_t> joined[kMaxRanks];
  std::atomic<uint32_t> released{0};
  char no_room[256] = {};  // with kMagicNoRoom: why worker 0 could not reserve the arena
  TableEntry table[kTableSize];

  std::byte* arena() { return reinterpret_cast<std::byte*>(this) + RoundUp(sizeof(Segment), 4096); }
};

namespace {

// Per rank, in a channel: what it posted and consumed (chunk sequence numbers, counted over the
// channel's life), and whether the chunk in each slot is to be averaged.
struct alignas(kLine) RankState {
  std::atomic<uint64_t> posted{0};
  std::atomic<uint64_t> consumed{0};
  std::atomic<uint32_t> average[2];
};

uint64_t SlotBytes(const LocalReduce::Channel& c, DataType t) {
  return RoundUp(c.chunk_elems * DataTypeSize(t), kLine);
}

uint64_t ChannelBytes(uint32_t ranks, uint64_t slot_bytes) {
  return ranks * sizeof(RankState) + uint64_t{ranks} * 2 * slot_bytes;
}

// A host channel's head: per rank, the last partition it posted (counted over the channel's
// life, from 1) and each input slot's averaging; per input slot, the last partition summed out
// of it (the slot is free again); per result entry, the partition whose sum it holds (ready),
// with its failure code, and what each rank copied out of it.
constexpr uint32_t kHostSlots = 8;
constexpr uint32_t kHostEntries = 32;
// Input slots and result entries get this much of the arena at most (per rank for the slots),
// in whole partitions, at least one: 64 KiB partitions give 8 slots and 32 entries (2 MiB in
// flight per tensor and host, more than a host's window). On 3 hosts x 2 workers, 16 slots
// gave 3-5% more than 4 in one run, about the noise; 8 is between at half 16's memory
// (bench/RESULTS.md, "Hierarchy").
constexpr uint64_t kHostSlotBudget = 512u << 10;
constexpr uint64_t kHostEntryBudget = 2u << 20;

struct alignas(kLine) HostRank {
  std::atomic<uint64_t> posted{0};
  std::atomic<uint32_t> average[kHostSlots];
};

struct alignas(kLine) HostEntry {
  std::atomic<uint64_t> ready{0};
  std::atomic<uint32_t> code{0};
  std::atomic<uint64_t> copied[LocalReduce::kMaxRanks];
};

struct HostHead {
  HostRank rank[LocalReduce::kMaxRanks];
  alignas(kLine) std::atomic<uint64_t> in_free[kHostSlots];
  HostEntry entry[kHostEntries];
};

long Futex(std::atomic<uint32_t>* word, int op, uint32_t value, const timespec* timeout) {
  return syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), op, value, timeout, nullptr, 0);
}

}  // namespace

struct LocalReduce::Running {
  Job job;
  uint64_t next_post = 0, next_sum = 0;
  // Host jobs: this worker's partitions to sum (in order) and how far it got; which
  // partitions it has copied out, the first not yet copied, and how many are.
  std::vector<uint32_t> own;
  size_t next_own = 0;
  std::vector<bool> copied;
  uint64_t copy_from = 0, copies = 0;
  bool began = false;  // host jobs: AdvanceHost has seen it once
  Status failure;
  bool abandoned = false;  // a rank it needs has left: it ends now, with `failure`
  Clock::time_point t_first_post, t_last_post, t_arrived;
};

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
            if (errno != ENOENT) open_error = Unavailable(Errno(("same-host path: shm_open " + o.name).c_str()));
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

LocalReduce::LocalReduce(const Options& o, void* base, uint64_t mapped_bytes)
    : opts_(o), seg_(static_cast<Segment*>(base)), mapped_bytes_(mapped_bytes) {
  background_ = std::thread([this] { Background(); });
}

uint64_t LocalReduce::arena_bytes() const { return seg_->arena_bytes; }

LocalReduce::~LocalReduce() {
  Stop();
  munmap(seg_, mapped_bytes_);
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

Result<std::optional<LocalReduce::Channel>> LocalReduce::Bind(uint64_t key, DataType dtype,
                                                             uint64_t count) {
  Channel c;
  c.chunk_elems = std::max<uint64_t>(1, seg_->chunk_bytes / DataTypeSize(dtype));
  c.chunk_elems = std::min(c.chunk_elems, std::max<uint64_t>(count, 1));
  c.chunks = (count + c.chunk_elems - 1) / c.chunk_elems;
  const uint64_t need = ChannelBytes(opts_.ranks, SlotBytes(c, dtype));
  GL_ASSIGN_OR_RETURN(std::optional<uint64_t> offset, Claim(key, dtype, count, 0, need));
  if (!offset) return std::optional<Channel>();
  c.offset = *offset;
  return std::optional<Channel>(c);
}

void LocalReduce::Start(Job job) {
  jobs_.fetch_add(1, std::memory_order_relaxed);
  std::lock_guard<std::mutex> lock(mu_);
  incoming_.push_back(std::move(job));
}

void LocalReduce::WantBackground() {
  std::lock_guard<std::mutex> lock(mu_);
  background_wanted_ = true;
  cv_.notify_one();
}

bool LocalReduce::PostsLeft() {
  for (const auto& r : running_) {
    // A host job waits on the servers too: its sums come back while nobody else drives.
    if (r->job.host || r->next_post < r->job.channel.chunks) return true;
  }
  std::lock_guard<std::mutex> lock(mu_);
  return !incoming_.empty();
}

void LocalReduce::ReleaseDrive(std::unique_lock<std::mutex>& drive, uint32_t waiters_besides_me) {
  drive.unlock();
  // A waiter that found the drive taken sleeps on the bell until it is free.
  if (callers_waiting_.load(std::memory_order_acquire) > waiters_besides_me) Ring(opts_.rank);
}

void LocalReduce::Kick() {
  std::unique_lock<std::mutex> drive(drive_mu_, std::try_to_lock);
  if (!drive.owns_lock()) {
    Nudge();  // whoever drives takes the new jobs on its next pass
    return;
  }
  DriveOnce(/*sums_per_job=*/0);
  // Sums are the waiting caller's (a background wake-up per operation would cost a small
  // push_pull several microseconds); chunks not yet posted hold back the other workers.
  const bool left = PostsLeft();
  ReleaseDrive(drive, 0);
  if (left) WantBackground();
}

void LocalReduce::Nudge() {
  Ring(opts_.rank);  // a waiter spinning or asleep on the bell looks again
  WantBackground();
}

void LocalReduce::Poll() {
  std::unique_lock<std::mutex> drive(drive_mu_, std::try_to_lock);
  if (!drive.owns_lock()) return;  // another thread drives
  DriveOnce(kPollSums);
  const bool left = PostsLeft();
  ReleaseDrive(drive, 0);
  if (left) WantBackground();
}

bool LocalReduce::Wait(const std::function<bool()>& done, Clock::time_point deadline) {
  std::atomic<uint32_t>& bell = seg_->bells[opts_.rank].word;
  callers_waiting_.fetch_add(1, std::memory_order_acq_rel);
  bool ok = false;
  for (;;) {
    if (done()) {
      ok = true;
      break;
    }
    if (Clock::now() >= deadline) break;
    // Drive, and spin for the others' next move, holding the drive. Another thread driving
    // (the background thread, which steps aside for waiting callers after its pass, another
    // waiter, a Kick) rings this bell when it lets go, so sleep until then: never wait for the
    // drive itself, another waiter may hold it for a whole large tensor. Nobody sleeps holding it.
    const uint32_t before = bell.load(std::memory_order_seq_cst);
    std::unique_lock<std::mutex> drive(drive_mu_, std::try_to_lock);
    if (!drive.owns_lock()) {
      SleepOnBell(before, std::min(deadline, Clock::now() + kNap));
      continue;
    }
    bool sleep = false;
    uint32_t seen;
    for (;;) {
      seen = bell.load(std::memory_order_seq_cst);
      const bool moved = DriveOnce(kPassSums);
      if (done()) break;
      const Clock::time_point now = Clock::now();
      if (now >= deadline) break;
      if (moved) continue;
      const Clock::time_point spin_end = std::min(deadline, now + kSpin);
      while (bell.load(std::memory_order_relaxed) == seen && Clock::now() < spin_end) {
        CpuRelax();
      }
      if (bell.load(std::memory_order_relaxed) == seen) {
        sleep = true;
        break;
      }
    }
    ReleaseDrive(drive, /*waiters_besides_me=*/1);
    if (!sleep) {
      ok = done();
      break;
    }
    SleepOnBell(seen, std::min(deadline, Clock::now() + kNap));
  }
  if (callers_waiting_.fetch_sub(1, std::memory_order_acq_rel) == 1 &&
      jobs_.load(std::memory_order_acquire) > 0) {
    WantBackground();  // operations the caller did not wait for go on in the background
  }
  return ok;
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

void LocalReduce::Fail(const Status& s) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (failure_.ok()) failure_ = s;
    failed_.store(true, std::memory_order_release);
    background_wanted_ = true;
    cv_.notify_one();
  }
  Ring(opts_.rank);
}

void LocalReduce::Stop() {
  std::string why;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (stopping_) return;
    stopping_ = true;
    if (failure_.ok()) failure_ = Aborted(Name(opts_.rank) + " shut down");
    why = failure_.ToString();
    failed_.store(true, std::memory_order_release);
    cv_.notify_one();
  }
  Ring(opts_.rank);  // the background thread may be asleep on the bell
  if (background_.joinable()) background_.join();
  std::lock_guard<std::mutex> drive(drive_mu_);
  DriveOnce(kPassSums);  // failed: ends every job
  // The others stop waiting for this worker's chunks (LocalReduce::Advance), and learn why.
  std::snprintf(seg_->why_gone[opts_.rank], sizeof(seg_->why_gone[opts_.rank]), "%s",
                why.c_str());
  seg_->gone[opts_.rank].store(1, std::memory_order_release);
  RingPeers();
  Ring(opts_.rank);
}

std::string LocalReduce::LeftJob(uint32_t j) const {
  // Read after its `gone` flag (acquire), so the text is whole; bounded whatever it holds.
  const char* why = seg_->why_gone[j];
  const std::string cause(why, strnlen(why, sizeof(seg_->why_gone[j])));
  return Name(j) + " left the job" + (cause.empty() ? "" : " (" + cause + ")");
}

void LocalReduce::Background() {
  std::atomic<uint32_t>& bell = seg_->bells[opts_.rank].word;
  auto stopping = [this] {
    std::lock_guard<std::mutex> lock(mu_);
    return stopping_;
  };
  for (;;) {
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [this] {
        return stopping_ ||
               (background_wanted_ && callers_waiting_.load(std::memory_order_acquire) == 0);
      });
      if (stopping_) return;
      background_wanted_ = false;
    }
    // Drive until nothing is left, unless a caller takes over (it drives everything too).
    for (;;) {
      const uint32_t seen = bell.load(std::memory_order_seq_cst);
      std::unique_lock<std::mutex> drive(drive_mu_);
      while (DriveOnce(kPassSums) && callers_waiting_.load(std::memory_order_acquire) == 0) {
      }
      bool left = !running_.empty() || PostsLeft();
      ReleaseDrive(drive, 0);
      if (!left || callers_waiting_.load(std::memory_order_acquire) > 0 || stopping()) break;
      SleepOnBell(seen, Clock::now() + kNap);
    }
  }
}

bool LocalReduce::DriveOnce(uint64_t sums_per_job) {
  Status failure;
  {
    std::lock_guard<std::mutex> lock(mu_);
    fresh_.swap(incoming_);  // both keep their capacity: no allocation per operation
    if (failed_.load(std::memory_order_acquire)) failure = failure_;
  }
  bool moved = !fresh_.empty();
  for (Job& j : fresh_) {
    auto r = std::make_unique<Running>();
    r->job = std::move(j);
    if (r->job.host) {
      for (uint32_t p = 0; p < r->job.pusher.size(); ++p) {
        if (r->job.pusher[p] == opts_.rank) r->own.push_back(p);
      }
      r->copied.assign(r->job.parts.size(), false);
    }
    running_.push_back(std::move(r));
  }
  fresh_.clear();
  bool finished_any = false;
  for (size_t i = 0; i < running_.size();) {
    Running& r = *running_[i];
    if (failure.ok() && (r.job.host ? AdvanceHost(r, sums_per_job) : Advance(r, sums_per_job))) {
      moved = true;
    }
    if (failure.ok() && !r.abandoned && !Over(r)) {
      ++i;
      continue;
    }
    std::unique_ptr<Running> over = std::move(running_[i]);
    running_.erase(running_.begin() + static_cast<ptrdiff_t>(i));
    over->job.done(failure.ok() ? over->failure : failure, over->t_first_post,
                   over->t_last_post, over->t_arrived);
    jobs_.fetch_sub(1, std::memory_order_acq_rel);
    moved = finished_any = true;
  }
  // A caller asleep in Wait() on an operation this thread just finished.
  if (finished_any) Ring(opts_.rank);
  return moved;
}

bool LocalReduce::Advance(Running& r, uint64_t max_sums) {
  const Job& job = r.job;
  const Channel& ch = job.channel;
  const uint32_t ranks = opts_.ranks, me = opts_.rank;
  const uint64_t esize = DataTypeSize(job.dtype);
  const uint64_t slot_bytes = SlotBytes(ch, job.dtype);
  std::byte* base = seg_->arena() + ch.offset;
  auto* state = reinterpret_cast<RankState*>(base);
  std::byte* slots = base + ranks * sizeof(RankState);
  auto slot = [&](uint32_t rank, uint64_t seq) { return slots + (rank * 2 + seq % 2) * slot_bytes; };
  auto seq_of = [&](uint64_t chunk) { return job.round * ch.chunks + chunk + 1; };
  auto elems_of = [&](uint64_t chunk) {
    return std::min(ch.chunk_elems, job.count - chunk * ch.chunk_elems);
  };
  bool moved = false;
  // Rank j, which this job waits for, has stopped: it will never post or consume again.
  auto left = [&](uint32_t j) {
    if (seg_->gone[j].load(std::memory_order_acquire) == 0) return false;
    r.failure = Aborted(job.what + ": " + LeftJob(j) + "; " + Name(me) +
                        " still waits for it (same-host path, round " +
                        std::to_string(job.round) + ")");
    r.abandoned = true;
    return true;
  };

  // Rank j has joined and did not post chunk `seq`: it sits the chunk out. Its flag is read
  // first: once set, its counters no longer move.
  auto sits_out = [&](uint32_t j, uint64_t seq) {
    return HasJoined(j) && state[j].posted.load(std::memory_order_acquire) < seq;
  };
  // This worker sat rounds of the tensor out (or never used it) while it had joined: its
  // counters catch up with the round it resumes at, as if it had posted and consumed them.
  if (r.next_post == 0 && r.next_sum == 0) {
    const uint64_t resume = job.round * ch.chunks;
    if (state[me].posted.load(std::memory_order_relaxed) < resume) {
      state[me].consumed.store(resume, std::memory_order_release);
      state[me].posted.store(resume, std::memory_order_release);
    }
  }

  // Post: copy the next chunk in once every rank has consumed what its slot held.
  while (r.next_post < ch.chunks && r.next_post < r.next_sum + 2) {
    const uint64_t seq = seq_of(r.next_post);
    bool free = true;
    for (uint32_t j = 0; j < ranks && seq > 2; ++j) {
      if (state[j].consumed.load(std::memory_order_acquire) < seq - 2 && !sits_out(j, seq - 2)) {
        free = false;
        if (left(j)) return true;
        break;
      }
    }
    if (!free) break;
    const uint64_t bytes = elems_of(r.next_post) * esize;
    {
      BusyTimer busy(busy_ns_);
      std::memcpy(slot(me, seq), job.data.data() + r.next_post * ch.chunk_elems * esize, bytes);
    }
    state[me].average[seq % 2].store(job.average ? 1 : 0, std::memory_order_relaxed);
    state[me].posted.store(seq, std::memory_order_release);
    RingPeers();
    bytes_copied_.fetch_add(bytes, std::memory_order_relaxed);
    const Clock::time_point now = Clock::now();
    if (r.next_post == 0) r.t_first_post = now;
    r.t_last_post = now;
    ++r.next_post;
    moved = true;
  }

  // Sum: once every rank has posted the chunk, all slots in rank order into our tensor.
  for (uint64_t summed = 0; r.next_sum < r.next_post && summed < max_sums; ++summed) {
    const uint64_t seq = seq_of(r.next_sum);
    // The ranks in this chunk's sum, in rank order: all but those that joined and sat it out.
    std::array<uint32_t, kMaxRanks> in;
    uint32_t n_in = 0;
    for (uint32_t j = 0; j < ranks; ++j) {
      if (sits_out(j, seq)) continue;
      if (state[j].posted.load(std::memory_order_acquire) < seq) return left(j) || moved;
      in[n_in++] = j;
    }
    if (r.next_sum + 1 == ch.chunks) r.t_arrived = Clock::now();
    const uint32_t avg0 = state[in[0]].average[seq % 2].load(std::memory_order_relaxed);
    for (uint32_t k = 1; k < n_in && r.failure.ok(); ++k) {
      const uint32_t j = in[k];
      const uint32_t avg = state[j].average[seq % 2].load(std::memory_order_relaxed);
      if (avg != avg0) {
        r.failure = Mismatch(job.what + " round " + std::to_string(job.round) + ": rank " +
                             std::to_string(JobRank(in[0])) + " " + (avg0 ? "averages" : "sums") +
                             " but rank " + std::to_string(JobRank(j)) + " " +
                             (avg ? "averages" : "sums"));
      }
    }
    if (r.failure.ok()) {
      BusyTimer busy(busy_ns_);
      const uint64_t n = elems_of(r.next_sum);
      std::byte* out = job.data.data() + r.next_sum * ch.chunk_elems * esize;
      const DataType acc_type = reduce::AccumulatorType(job.dtype);
      std::byte* acc = out;
      if (DataTypeSize(acc_type) != esize) {
        if (scratch_.size() < n * DataTypeSize(acc_type)) {
          scratch_.resize(ch.chunk_elems * DataTypeSize(acc_type));
        }
        acc = scratch_.data();
      }
      // The servers' order and reducers (src/server/partition_state.cc): bit-identical sums.
      if (n_in == 1) {
        reduce::Load(job.dtype, acc, slot(in[0], seq), n);
      } else {
        reduce::SumTwo(job.dtype, acc, slot(in[0], seq), slot(in[1], seq), n);
      }
      for (uint32_t k = 2; k < n_in; ++k) reduce::Accumulate(job.dtype, acc, slot(in[k], seq), n);
      const uint32_t divisor = avg0 ? n_in : 1;
      if (acc != out || divisor != 1) reduce::Store(job.dtype, out, acc, n, divisor);
    }
    state[me].consumed.store(seq, std::memory_order_release);
    RingPeers();
    ++r.next_sum;
    moved = true;
  }
  return moved;
}

bool LocalReduce::Over(const Running& r) {
  if (!r.job.host) return r.next_sum >= r.job.channel.chunks;
  // A worker that has joined copies nothing out: it is done once it has handed on its sums.
  return r.job.sits_out ? r.next_own >= r.own.size() : r.copies >= r.job.parts.size();
}

bool LocalReduce::BegunWithoutMe(const HostChannel& c, uint64_t round, uint32_t parts) const {
  const auto* head = reinterpret_cast<const HostHead*>(seg_->arena() + c.offset);
  const uint64_t first = round * parts + 1;  // partition 0 of `round`
  bool posted = false;
  for (uint32_t j = 0; j < opts_.ranks && !posted; ++j) {
    posted = j != opts_.rank && head->rank[j].posted.load(std::memory_order_acquire) >= first;
  }
  // After the post: a release (the epoch it ends), which came before any post of the next
  // epoch, is seen here.
  return posted && HasJoined(opts_.rank);
}

Result<std::optional<LocalReduce::HostChannel>> LocalReduce::BindHost(uint64_t key, DataType dtype,
                                                                     DataType wire, uint64_t count,
                                                                     uint64_t part_elems) {
  HostChannel c;
  c.part_elems = std::max<uint64_t>(1, std::min(part_elems, count));
  const uint64_t parts = (count + c.part_elems - 1) / c.part_elems;
  c.in_bytes = RoundUp(c.part_elems * DataTypeSize(dtype), kLine);
  c.entry_bytes = RoundUp(c.part_elems * DataTypeSize(wire), kLine);
  const auto fit = [parts](uint64_t budget, uint64_t each, uint32_t most) {
    return static_cast<uint32_t>(
        std::max<uint64_t>(1, std::min<uint64_t>({budget / each, most, parts})));
  };
  c.slots = fit(kHostSlotBudget, c.in_bytes, kHostSlots);
  c.entries = fit(kHostEntryBudget, c.entry_bytes, kHostEntries);
  const uint64_t need = RoundUp(sizeof(HostHead), kLine) +
                        uint64_t{opts_.ranks} * c.slots * c.in_bytes + c.entries * c.entry_bytes;
  GL_ASSIGN_OR_RETURN(std::optional<uint64_t> offset,
                      Claim(key, dtype, count, c.part_elems, need));
  if (!offset) return std::optional<HostChannel>();
  c.offset = *offset;
  return std::optional<HostChannel>(c);
}

void LocalReduce::Publish(const HostChannel& c, uint64_t round, uint32_t parts, uint32_t part,
                          Code code) {
  auto* head = reinterpret_cast<HostHead*>(seg_->arena() + c.offset);
  const uint64_t n = round * parts + part + 1;
  HostEntry& e = head->entry[(n - 1) % c.entries];
  e.code.store(static_cast<uint32_t>(code), std::memory_order_relaxed);
  e.ready.store(n, std::memory_order_release);
  RingPeers();
  Ring(opts_.rank);
}

// One pass over a host job: post what the input slots let in, sum this worker's partitions
// (in order) once every rank posted them and their entry is free, copy out every sum that
// came back. Each step only ever waits on another, never blocks: the posts of one partition
// need the sums of an earlier one, those need the copies of an earlier one, which need the
// servers, so a worker that stopped at one step would hold up the host.
bool LocalReduce::AdvanceHost(Running& r, uint64_t max_sums) {
  const Job& job = r.job;
  const HostChannel& ch = *job.host;
  const uint32_t ranks = opts_.ranks, me = opts_.rank;
  const uint32_t parts = static_cast<uint32_t>(job.parts.size());
  const uint64_t esize = DataTypeSize(job.dtype), wsize = DataTypeSize(job.wire);
  std::byte* base = seg_->arena() + ch.offset;
  auto* head = reinterpret_cast<HostHead*>(base);
  std::byte* in = base + RoundUp(sizeof(HostHead), kLine);
  std::byte* entries = in + uint64_t{ranks} * ch.slots * ch.in_bytes;
  // Partition p of this round, counted over the channel's life from 1.
  auto number = [&](uint64_t p) { return job.round * parts + p + 1; };
  auto slot_of = [&](uint64_t n) { return static_cast<uint32_t>((n - 1) % ch.slots); };
  auto entry_of = [&](uint64_t n) { return static_cast<uint32_t>((n - 1) % ch.entries); };
  auto input = [&](uint32_t rank, uint64_t n) {
    return in + (uint64_t{rank} * ch.slots + slot_of(n)) * ch.in_bytes;
  };
  auto entry = [&](uint64_t n) { return entries + entry_of(n) * ch.entry_bytes; };
  auto left = [&](uint32_t j) {
    if (seg_->gone[j].load(std::memory_order_acquire) == 0) return false;
    r.failure = Aborted(job.what + ": " + LeftJob(j) + "; " + Name(me) +
                        " still waits for it (hierarchical aggregation, round " +
                        std::to_string(job.round) + ")");
    r.abandoned = true;
    return true;
  };
  // Rank j has joined (Worker::Join) and did not post partition n: it sits it out. Its flag is
  // read first: once set, its counters no longer move (it joined with no job of its own left,
  // every entry it had to copy copied).
  auto sits_out = [&](uint32_t j, uint64_t n) {
    return HasJoined(j) && head->rank[j].posted.load(std::memory_order_acquire) < n;
  };
  bool moved = false;
  if (!r.began) {
    r.began = true;
    if (job.sits_out) {
      r.next_post = parts;  // it pushes the others' partials, posting nothing
    } else {
      // Rounds of this key this worker sat out (it had joined) left its copy marks behind, and
      // rounds its whole host sat out left the slots' marks behind. Every partition before
      // this round was summed and needs no copy from this worker any more: every rank had
      // ended its part of them when this one began (it had ended its own last round, or all
      // had joined), and a partition of this round is summed only once this rank posts it.
      const uint64_t before = job.round * parts;
      for (uint32_t e = 0; e < ch.entries; ++e) {
        std::atomic<uint64_t>& mark = head->entry[e].copied[me];
        if (mark.load(std::memory_order_relaxed) < before) {
          mark.store(before, std::memory_order_release);
        }
      }
      for (uint32_t s = 0; s < ch.slots; ++s) {
        uint64_t mark = head->in_free[s].load(std::memory_order_acquire);
        while (mark < before &&
               !head->in_free[s].compare_exchange_weak(mark, before, std::memory_order_acq_rel)) {
        }
      }
    }
  }

  // Post: the next partition into its input slot, once its last user was summed.
  while (r.next_post < parts) {
    const uint64_t n = number(r.next_post);
    const uint32_t s = slot_of(n);
    if (n > ch.slots && head->in_free[s].load(std::memory_order_acquire) < n - ch.slots) {
      const uint32_t pusher = job.pusher[(n - ch.slots - 1) % parts];  // the slot's last user
      if (left(pusher)) return true;
      break;
    }
    const wire::PartitionPlan& p = job.parts[r.next_post];
    {
      BusyTimer busy(busy_ns_);
      std::memcpy(input(me, n), job.data.data() + p.offset * esize, p.count * esize);
    }
    head->rank[me].average[s].store(job.average ? 1 : 0, std::memory_order_relaxed);
    head->rank[me].posted.store(n, std::memory_order_release);
    bytes_copied_.fetch_add(p.count * esize, std::memory_order_relaxed);
    const Clock::time_point now = Clock::now();
    if (r.next_post == 0) r.t_first_post = now;
    r.t_last_post = now;
    ++r.next_post;
    moved = true;
    if (ranks > 1) RingPeers();
  }

  // Sum: this worker's partitions, in order, the ranks in local-rank order, into the entry.
  for (uint64_t done = 0; r.next_own < r.own.size() && done < max_sums; ++done) {
    const uint32_t part = r.own[r.next_own];
    const uint64_t n = number(part);
    // Not yet: a rank has not posted it, or not copied out what its entry held. Then on to the
    // copies (ours may be what the entry waits for). The ranks in the sum, in local-rank order:
    // all but those that joined and sat it out.
    std::optional<uint32_t> waits_for;
    HostEntry& e = head->entry[entry_of(n)];
    std::array<uint32_t, kMaxRanks> in_sum;
    uint32_t n_in = 0;
    for (uint32_t j = 0; j < ranks && !waits_for; ++j) {
      if (n > ch.entries && !HasJoined(j) &&
          e.copied[j].load(std::memory_order_acquire) < n - ch.entries) {
        waits_for = j;
      } else if (!sits_out(j, n)) {
        if (head->rank[j].posted.load(std::memory_order_acquire) < n) {
          waits_for = j;
        } else {
          in_sum[n_in++] = j;
        }
      }
    }
    if (waits_for) {
      if (left(*waits_for)) return true;
      break;
    }
    if (n_in == 0) {  // a round is run sat out only once begun by a post (BegunWithoutMe)
      r.failure = Internal(job.what + " partition " + std::to_string(part) + " round " +
                           std::to_string(job.round) + ": every worker of the host sat it out");
      r.abandoned = true;
      return true;
    }
    const uint32_t s = slot_of(n);
    const uint32_t first = in_sum[0];
    const uint32_t avg0 = head->rank[first].average[s].load(std::memory_order_relaxed);
    uint16_t flags = avg0 ? wire::kFlagAverage : 0;
    for (uint32_t k = 1; k < n_in; ++k) {
      const uint32_t j = in_sum[k];
      const uint32_t avg = head->rank[j].average[s].load(std::memory_order_relaxed);
      if (avg == avg0) continue;
      flags |= wire::kFlagHostDisagrees;
      if (r.failure.ok()) {
        r.failure = Mismatch(job.what + " round " + std::to_string(job.round) + ": rank " +
                             std::to_string(JobRank(first)) + " " + (avg0 ? "averages" : "sums") +
                             " but rank " + std::to_string(JobRank(j)) + " " +
                             (avg ? "averages" : "sums"));
      }
    }
    const uint64_t count = job.parts[part].count;
    std::byte* out = entry(n);
    std::optional<BusyTimer> busy(std::in_place, busy_ns_);
    // The servers' reducers, in local-rank order. The accumulator is the entry itself where it
    // has the accumulator's type (fp32 partials of a 16-bit tensor, fp32, fp64, int64).
    const DataType acc_type = reduce::AccumulatorType(job.dtype);
    std::byte* acc = out;
    if (acc_type != job.wire) {
      if (scratch_.size() < count * DataTypeSize(acc_type)) {
        scratch_.resize(ch.part_elems * DataTypeSize(acc_type));
      }
      acc = scratch_.data();
    }
    if (n_in == 1) {
      reduce::Load(job.dtype, acc, input(in_sum[0], n), count);
    } else {
      reduce::SumTwo(job.dtype, acc, input(in_sum[0], n), input(in_sum[1], n), count);
      for (uint32_t k = 2; k < n_in; ++k) {
        reduce::Accumulate(job.dtype, acc, input(in_sum[k], n), count);
      }
    }
    if (acc != out) reduce::Store(job.dtype, out, acc, count, 1);
    busy.reset();
    head->in_free[s].store(n, std::memory_order_release);
    if (ranks > 1) RingPeers();
    ++r.next_own;
    moved = true;
    job.summed(part, std::span<std::byte>(out, count * wsize), flags, n_in);
  }

  if (job.sits_out) return moved;  // it copies nothing out
  // Copy out: every sum that came back, in whatever order the servers answered. Only the
  // entries' depth can be outstanding: a partition that far ahead waits for our copy.
  const uint64_t end = std::min<uint64_t>(parts, r.copy_from + ch.entries);
  for (uint64_t part = r.copy_from; part < end; ++part) {
    if (r.copied[part]) continue;
    const uint64_t n = number(part);
    HostEntry& e = head->entry[entry_of(n)];
    if (e.ready.load(std::memory_order_acquire) != n) continue;
    const uint32_t code = e.code.load(std::memory_order_relaxed);
    const wire::PartitionPlan& p = job.parts[part];
    if (code != 0) {
      if (r.failure.ok()) {
        const uint32_t pusher = job.pusher[part];
        r.failure = Status(static_cast<Code>(code),
                           job.what + " partition " + std::to_string(part) + " round " +
                               std::to_string(job.round) + ": its sum failed at " +
                               Name(pusher) + ", which pushes it for this host" +
                               (pusher == me ? "" : " (its error names the cause)"));
      }
    } else {
      BusyTimer busy(busy_ns_);
      if (job.wire == job.dtype) {
        std::memcpy(job.data.data() + p.offset * esize, entry(n), p.count * esize);
      } else {
        reduce::Store(job.dtype, job.data.data() + p.offset * esize, entry(n), p.count, 1);
      }
      bytes_copied_.fetch_add(p.count * esize, std::memory_order_relaxed);
    }
    e.copied[me].store(n, std::memory_order_release);
    if (ranks > 1) RingPeers();
    r.copied[part] = true;
    ++r.copies;
    moved = true;
    if (r.copies == parts) r.t_arrived = Clock::now();
  }
  while (r.copy_from < parts && r.copied[r.copy_from]) ++r.copy_from;
  return moved;
}

void LocalReduce::Ring(uint32_t rank) {
  Bell& b = seg_->bells[rank];
  b.word.fetch_add(1, std::memory_order_seq_cst);
  if (b.sleepers.load(std::memory_order_seq_cst) > 0) {
    Futex(&b.word, FUTEX_WAKE, INT_MAX, nullptr);
  }
}

void LocalReduce::RingPeers() {
  for (uint32_t j = 0; j < opts_.ranks; ++j) {
    if (j != opts_.rank) Ring(j);
  }
}

void LocalReduce::SleepOnBell(uint32_t seen, Clock::time_point until) {
  Bell& b = seg_->bells[opts_.rank];
  const auto left = until - Clock::now();
  if (left <= Clock::duration::zero()) return;
  const auto ns = std::chrono::duration_cast<std::chrono::nanoseconds>(left).count();
  const timespec ts{static_cast<time_t>(ns / 1000000000), static_cast<long>(ns % 1000000000)};
  b.sleepers.fetch_add(1, std::memory_order_seq_cst);
  if (b.word.load(std::memory_order_seq_cst) == seen) Futex(&b.word, FUTEX_WAIT, seen, &ts);
  b.sleepers.fetch_sub(1, std::memory_order_seq_cst);
}

}  // namespace gradlink::internal
