// python/c10d/process_group.h: torch.distributed's point-to-point (send, recv, recv from any
// source) on the worker's Worker::Send / Recv, straight between workers.
//
// Each call is one message of the tensor's bytes: its element type (the torch dtype) and size
// must match the peer's, or both sides fail naming both. A non-contiguous tensor is sent from a
// contiguous copy and received into one, copied back when the recv completes. The group's ranks
// are translated to the job's (members_), and a recv's source back to the group's.
#include <ATen/ATen.h>

#include <algorithm>
#include <condition_variable>
#include <deque>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <utility>

#include "process_group.h"
#include "tensors.h"
#include "work.h"

namespace gradlink::c10d {

using ::c10d::OpType;

// One Send / Recv that ended, for the p2p thread to complete.
struct ProcessGroupGradlink::PeerDone {
  c10::intrusive_ptr<Work> work;
  std::exception_ptr error;  // how it ended
  at::Tensor staged;  // a recv into a staging copy: copied into `target` once it succeeds
  at::Tensor target;
  at::Tensor keepalive;  // the bytes the worker reads or writes
  bool recv = false;
  std::string what;
};

class ProcessGroupGradlink::PeerQueue {
 public:
  void Push(std::shared_ptr<PeerDone> d) {
    {
      std::lock_guard lock(mu_);
      done_.push_back(std::move(d));
    }
    cv_.notify_one();
  }
  // The next ended operation; null once stopped and drained.
  std::shared_ptr<PeerDone> Pop() {
    std::unique_lock lock(mu_);
    cv_.wait(lock, [&] { return stopping_ || !done_.empty(); });
    if (done_.empty()) return nullptr;
    std::shared_ptr<PeerDone> d = std::move(done_.front());
    done_.pop_front();
    return d;
  }
  void Stop() {
    {
      std::lock_guard lock(mu_);
      stopping_ = true;
    }
    cv_.notify_all();
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::shared_ptr<PeerDone>> done_;
  bool stopping_ = false;
};

void ProcessGroupGradlink::StartPeerThread() {
  peer_queue_ = std::make_shared<PeerQueue>();
  peer_completion_ = std::thread([q = peer_queue_] {
    while (std::shared_ptr<PeerDone> d = q->Pop()) d->work->CompleteFuture(d->error);
  });
}

void ProcessGroupGradlink::PeerEnded(PeerDone& d, const PeerResult& r,
                                     const std::vector<uint32_t>& members) {
  // The transport may write this recv's buffer yet (PeerResult::buffer_held): kept for the life
  // of the process.
  if (r.buffer_held) new at::Tensor(d.keepalive);
  if (!r.status.ok()) {
    d.error = std::make_exception_ptr(
        std::runtime_error("gradlink: " + d.what + ": " + r.status.ToString()));
  } else {
    try {
      if (d.staged.defined()) d.target.copy_(d.staged);
    } catch (...) {
      d.error = std::current_exception();
    }
    if (d.recv) {
      int source = static_cast<int>(r.source);
      if (!members.empty()) {
        auto it = std::find(members.begin(), members.end(), r.source);
        source = it == members.end() ? -1 : static_cast<int>(it - members.begin());
      }
      d.work->SetSource(source);
    }
  }
  // wait() returns now, on the thread that ended the operation (a lane's); the Future's
  // callbacks (a Python hook's, say) run on the group's p2p thread.
  d.work->Finish(d.error);
}

void ProcessGroupGradlink::StopPeerQueue() { peer_queue_->Stop(); }

uint32_t ProcessGroupGradlink::Global(int r) const {
  if (r < 0 || r >= getSize()) {
    Fail("rank " + std::to_string(r) + " is not in this process group of " +
         std::to_string(getSize()));
  }
  return members_.empty() ? static_cast<uint32_t>(r) : members_[static_cast<size_t>(r)];
}

c10::intrusive_ptr<::c10d::Work> ProcessGroupGradlink::PointToPoint(OpType type, at::Tensor& t,
                                                                    std::optional<int> peer,
                                                                    int tag) {
  const bool recv = type != OpType::SEND;
  const std::string what =
      std::string(recv ? "recv" : "send") + " of " + c10::toString(t.scalar_type()) +
      c10::str(t.sizes()) + (recv ? " from " : " to ") +
      (peer ? "rank " + std::to_string(*peer) : std::string("any rank")) + " (tag " +
      std::to_string(tag) + ")";
  CheckTensor(t, what);
  std::optional<uint32_t> global;
  if (peer) {
    global = Global(*peer);
    if (*peer == getRank()) Fail(what + ": that is this rank");
  }
  PeerMessage m;
  m.channel = channel_;
  m.tag = static_cast<uint32_t>(tag);
  // The torch dtype (+1, so that 0 stays "none"): a recv refuses a message of another.
  m.element = static_cast<uint16_t>(static_cast<int>(t.scalar_type()) + 1);

  auto d = std::make_shared<PeerDone>();
  d->work = c10::make_intrusive<Work>(getRank(), type, std::vector<at::Tensor>{t});
  d->recv = recv;
  d->what = what;
  if (recv && !t.is_contiguous()) {
    d->staged = at::empty(t.sizes(), t.options());
    d->target = t;
    d->keepalive = d->staged;
  } else {
    d->keepalive = t.is_contiguous() ? t : t.contiguous();
  }
  const at::Tensor& bytes = d->keepalive;
  std::span<std::byte> span(static_cast<std::byte*>(bytes.data_ptr()), bytes.nbytes());
  c10::intrusive_ptr<Work> work = d->work;
  PeerCallback done = [q = peer_queue_, d, members = members_](const PeerResult& r) {
    PeerEnded(*d, r, members);
    q->Push(d);
  };
  const Clock::time_point deadline = Deadline(std::chrono::milliseconds(-1));
  if (recv) {
    worker_->Recv(global, m, span, deadline, std::move(done));
  } else {
    worker_->Send(*global, m, span, deadline, std::move(done));
  }
  return work;
}

c10::intrusive_ptr<::c10d::Work> ProcessGroupGradlink::send(std::vector<at::Tensor>& tensors,
                                                            int dst_rank, int tag) {
  return PointToPoint(OpType::SEND, const_cast<at::Tensor&>(One(tensors, "send")), dst_rank,
                      tag);
}

c10::intrusive_ptr<::c10d::Work> ProcessGroupGradlink::recv(std::vector<at::Tensor>& tensors,
                                                            int src_rank, int tag) {
  return PointToPoint(OpType::RECV, const_cast<at::Tensor&>(One(tensors, "recv")), src_rank,
                      tag);
}

c10::intrusive_ptr<::c10d::Work> ProcessGroupGradlink::recvAnysource(
    std::vector<at::Tensor>& tensors, int tag) {
  return PointToPoint(OpType::RECVANYSOURCE, const_cast<at::Tensor&>(One(tensors, "recv")),
                      std::nullopt, tag);
}

}  // namespace gradlink::c10d
