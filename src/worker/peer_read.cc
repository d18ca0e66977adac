// worker/peer_link.h, same-machine reads: a matched announcement's message copied straight out
// of the sender's memory (process_vm_readv), proven by the send's cell before and after the
// copy, on the thread that matched it or, for a lane's thread, on the reader thread.
#include <sys/uio.h>
#include <unistd.h>

#include <atomic>
#include <utility>

#include "worker/peer_link.h"

namespace gradlink {

using wire::MsgType;

void PeerLink::RunReads(Actions& a) {
  if (a.on_lane) {  // not on a lane's thread: the reader's
    {
      MutexLock lock(reader_mu_);
      if (reader_stopping_) return;  // the worker is shutting down: its recvs have failed
      for (Actions::Read& r : a.reads) to_read_.push_back(std::move(r));
      if (!reader_.joinable()) reader_ = std::thread([this] { ReaderLoop(); });
    }
    reader_cv_.NotifyAll();
    a.reads.clear();
  }
  if (!a.reads.empty()) {  // here, on the caller's thread (or the reader's)
    std::vector<Actions::Read> reads = std::move(a.reads);
    Actions after;
    std::vector<bool> copied;
    for (const Actions::Read& r : reads) copied.push_back(ReadFromPeer(r));
    {
      MutexLock lock(mu_);
      for (size_t i = 0; i < reads.size(); ++i) EndReadLocked(reads[i], copied[i], &after);
    }
    Run(after);
  }
}

void PeerLink::StopReader() {
  {
    MutexLock lock(reader_mu_);
    reader_stopping_ = true;
  }
  reader_cv_.NotifyAll();
  if (reader_.joinable()) reader_.join();
}

void PeerLink::ReaderLoop() {
  for (;;) {
    Actions::Read r;
    {
      MutexLock lock(reader_mu_);
      reader_cv_.Wait(reader_mu_, [&] {
        reader_mu_.AssertHeld();  // the wait runs it under `lock`
        return reader_stopping_ || !to_read_.empty();
      });
      if (reader_stopping_) return;
      r = std::move(to_read_.front());
      to_read_.pop_front();
    }
    Actions a;
    a.reads.push_back(std::move(r));
    Run(a);  // here, on this thread
  }
}

bool PeerLink::ReadFromPeer(const Actions::Read& r) {
  const pid_t pid = static_cast<pid_t>(r.source.pid);
  const auto cell_holds_nonce = [&] {
    uint64_t value = 0;
    iovec local{&value, sizeof(value)};
    iovec remote{reinterpret_cast<void*>(r.source.cell), sizeof(value)};
    return process_vm_readv(pid, &local, 1, &remote, 1, 0) == sizeof(value) &&
           value == r.source.nonce;
  };
  // Before: the right process and a live send. After: it was still live all through the copy
  // (the sender clears the cell before its caller may touch the buffer again).
  if (!cell_holds_nonce()) return false;
  std::atomic_thread_fence(std::memory_order_seq_cst);
  size_t done = 0;
  while (done < r.into.size()) {
    iovec local{r.into.data() + done, r.into.size() - done};
    iovec remote{reinterpret_cast<void*>(r.source.address + done), r.into.size() - done};
    const ssize_t n = process_vm_readv(pid, &local, 1, &remote, 1, 0);
    if (n <= 0) return false;
    done += static_cast<size_t>(n);
  }
  std::atomic_thread_fence(std::memory_order_seq_cst);  // the copy before the second check
  return cell_holds_nonce();
}

void PeerLink::EndReadLocked(const Actions::Read& r, bool copied, Actions* a) {
  auto it = recvs_.find(r.recv);
  if (it == recvs_.end()) return;  // failed meanwhile (the lanes stopped: buffer_held)
  it->second.landing = false;
  if (copied) {
    counts_.bytes_received += r.into.size();
    AckLocked(r.from, r.send_id, r.message, Status::Ok(), a);
    EndRecvLocked(r.recv, Status::Ok(), a);
    return;
  }
  // Not readable here (another pid namespace, no permission) or no longer that send's: over
  // the lane after all.
  expected_[{r.from, r.send_id}] = r.recv;
  Outgoing o;
  o.to = r.from;
  o.header = Frame(MsgType::kPeerClear, r.message.channel, r.message.tag);
  o.header.cookie = r.send_id;
  SendLocked(std::move(o), a);
}

}  // namespace gradlink
