// worker/peer_link.h: point-to-point messages between workers.
#include "worker/peer_link.h"

#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <random>
#include <utility>

#include "wire/messages.h"

namespace gradlink {

using wire::MsgType;

namespace {

uint64_t RandomSalt() {
  std::random_device entropy;
  return uint64_t{entropy()} << 32 | entropy();
}

// splitmix64: the nonce of send `id` (distinct per send, unpredictable across processes).
uint64_t Mix(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

void PutU64(std::byte* p, uint64_t v) { std::memcpy(p, &v, 8); }
uint64_t GetU64(const std::byte* p) {
  uint64_t v;
  std::memcpy(&v, p, 8);
  return v;
}

}  // namespace

PeerLink::PeerLink(Config config) : config_(std::move(config)), nonce_salt_(RandomSalt()) {}

PeerLink::~PeerLink() { StopReader(); }

// ---- Handles ----------------------------------------------------------------------------------

Status PeerHandle::Wait(Clock::time_point deadline) const {
  if (!op_) return InvalidArgument("wait on an empty PeerHandle");
  MutexLock lock(op_->mu);
  const bool done = op_->cv.WaitUntil(op_->mu, deadline, [&] {
    op_->mu.AssertHeld();  // the wait runs it under `lock`
    return op_->done;
  });
  if (!done) return Timeout("point-to-point operation still running at the deadline");
  return op_->result.status;
}

bool PeerHandle::Poll() const {
  if (!op_) return true;
  MutexLock lock(op_->mu);
  return op_->done;
}

uint32_t PeerHandle::source() const {
  if (!op_) return 0;
  MutexLock lock(op_->mu);
  return op_->result.source;
}

void PeerLink::Complete(const OpPtr& op, const PeerResult& r) {
  {
    MutexLock lock(op->mu);
    if (op->done) return;
    op->done = true;
    op->result = r;
  }
  op->cv.NotifyAll();
  if (op->callback) op->callback(r);
}

// ---- Sending and receiving --------------------------------------------------------------------

wire::Header PeerLink::Frame(MsgType type, uint64_t channel, uint32_t tag) const {
  wire::Header h;
  h.type = type;
  h.job = config_.job_hash;
  h.sender = rank_;
  h.key = channel;
  h.partition = tag;
  return h;
}

namespace {

std::string Bytes(uint64_t n, uint16_t element) {
  return std::to_string(n) + " bytes (element type " + std::to_string(element) + ")";
}

}  // namespace

PeerHandle PeerLink::Send(uint32_t to, const PeerMessage& m, std::span<const std::byte> data,
                          Clock::time_point deadline, PeerCallback done) {
  auto op = std::make_shared<internal::PeerOp>();
  op->callback = std::move(done);
  PeerHandle handle(op);
  const std::string what = "send of " + std::to_string(data.size()) + " bytes to worker " +
                           std::to_string(to) + " (tag " + std::to_string(m.tag) + ")";
  Status refused;
  Actions a;
  {
    MutexLock lock(mu_);
    if (to >= size_) {
      refused = InvalidArgument(what + ": no worker " + std::to_string(to) + " in a job of " +
                                std::to_string(size_));
    } else if (to == rank_) {
      refused = InvalidArgument(what + ": that is this worker");
    } else if (data.size() > wire::kMaxDataPayload) {
      refused = InvalidArgument(what + ": larger than the " +
                                std::to_string(wire::kMaxDataPayload) +
                                " bytes a message may hold");
    }
    if (refused.ok() && !failed_.ok()) refused = failed_;
    if (auto it = down_.find(to); refused.ok() && it != down_.end()) refused = it->second;
    if (refused.ok()) {
      const uint64_t id = next_id_++;
      SendState& s = sends_[id];
      s.to = to;
      s.message = m;
      s.seq = out_seq_[{to, m.channel, m.tag}]++;
      s.data = data;
      s.deadline = deadline;
      s.op = op;
      s.eager = data.size() <= kEagerBytes;
      counts_.sends++;
      Outgoing o;
      o.to = to;
      o.header = Frame(s.eager ? MsgType::kPeerData : MsgType::kPeerReady, m.channel, m.tag);
      o.header.round = s.seq;
      o.header.count = data.size();
      o.header.element = m.element;
      o.header.cookie = id;
      o.send_id = id;
      if (s.eager) {
        o.header.payload_bytes = data.size();
        o.payload = data;
      } else if (config_.same_host && config_.same_host(to)) {
        // Announced with where it lies: the receiver reads it from here (the top of the file).
        if (free_cells_.empty()) free_cells_.push_back(&cells_.emplace_back(0));
        s.cell = free_cells_.back();
        free_cells_.pop_back();
        const uint64_t nonce = Mix(nonce_salt_ ^ id) | 1;  // never 0, a free cell's value
        s.cell->store(nonce, std::memory_order_release);
        o.owned = std::make_shared<std::vector<std::byte>>(wire::kPeerLocalBytes);
        std::byte* p = o.owned->data();
        PutU64(p, static_cast<uint64_t>(getpid()));
        PutU64(p + 8, reinterpret_cast<uintptr_t>(s.cell));
        PutU64(p + 16, nonce);
        PutU64(p + 24, reinterpret_cast<uintptr_t>(data.data()));
        o.payload = *o.owned;
        o.header.payload_bytes = o.owned->size();
      }
      SendLocked(std::move(o), &a);
    }
  }
  if (!refused.ok()) a.completions.emplace_back(op, PeerResult{refused, 0});
  Run(a);
  return handle;
}

PeerHandle PeerLink::Recv(std::optional<uint32_t> from, const PeerMessage& m,
                          std::span<std::byte> data, Clock::time_point deadline,
                          PeerCallback done) {
  auto op = std::make_shared<internal::PeerOp>();
  op->callback = std::move(done);
  PeerHandle handle(op);
  Status refused;
  Actions a;
  {
    MutexLock lock(mu_);
    if (from && *from >= size_) {
      refused = InvalidArgument("recv from worker " + std::to_string(*from) +
                                ": no such worker in a job of " + std::to_string(size_));
    } else if (from && *from == rank_) {
      refused = InvalidArgument("recv from worker " + std::to_string(*from) +
                                ": that is this worker");
    }
    if (refused.ok() && !failed_.ok()) refused = failed_;
    if (from) {
      if (auto it = down_.find(*from); refused.ok() && it != down_.end()) refused = it->second;
    }
    if (refused.ok()) {
      const uint64_t id = next_id_++;
      RecvState& r = recvs_[id];
      r.from = from;
      r.message = m;
      r.data = data;
      r.deadline = deadline;
      r.op = op;
      counts_.recvs++;
      auto it = std::find_if(unmatched_.begin(), unmatched_.end(),
                             [&](const Envelope& e) { return Matches(r, e); });
      if (it != unmatched_.end()) {
        Envelope e = std::move(*it);
        unmatched_.erase(it);
        if (e.eager && e.complete) counts_.unexpected_bytes -= e.bytes;
        MeetLocked(id, std::move(e), &a);
      } else {
        posted_.push_back(id);
      }
    }
  }
  if (!refused.ok()) a.completions.emplace_back(op, PeerResult{refused, 0});
  Run(a);
  return handle;
}

bool PeerLink::Matches(const RecvState& r, const Envelope& e) {
  return (!r.from || *r.from == e.from) && r.message.channel == e.channel &&
         r.message.tag == e.tag;
}

std::string PeerLink::Describe(const RecvState& r) {
  return "recv of " + Bytes(r.data.size(), r.message.element) + " from " +
         (r.from ? "worker " + std::to_string(*r.from) : std::string("any worker")) + " (tag " +
         std::to_string(r.message.tag) + ")";
}

void PeerLink::MeetLocked(uint64_t id, Envelope e, Actions* a) {
  RecvState& r = recvs_.at(id);
  r.source = e.from;
  if (e.bytes != r.data.size() || e.element != r.message.element) {
    const Status why = InvalidArgument(
        Describe(r) + " met " + config_.name(e.from) + "'s message of " +
        Bytes(e.bytes, e.element) + ": sizes and element types must agree (nothing received)");
    AckLocked(e.from, e.send_id, r.message,
              InvalidArgument("worker " + std::to_string(rank_) + "'s " + Describe(r) +
                              " refused this message of " + Bytes(e.bytes, e.element) +
                              ": sizes and element types must agree"),
              a);
    // An eager payload still arriving lands in its buffer and is dropped (incoming_, recv 0).
    EndRecvLocked(id, why, a);
    return;
  }
  r.matched = true;
  if (!e.eager && e.local && !r.data.empty()) {  // read from the sender's memory (Run)
    r.landing = true;
    a->reads.push_back({id, e.from, e.send_id, *e.local, r.data, r.message});
    return;
  }
  if (!e.eager) {
    expected_[{e.from, e.send_id}] = id;
    Outgoing o;
    o.to = e.from;
    o.header = Frame(MsgType::kPeerClear, e.channel, e.tag);
    o.header.round = e.seq;
    o.header.cookie = e.send_id;
    SendLocked(std::move(o), a);
    return;
  }
  if (!e.lost.ok()) {  // its payload failed to arrive
    EndRecvLocked(id, PeerLost(Describe(r) + ": the message from " + config_.name(e.from) +
                               " was lost arriving: " + e.lost.ToString()),
                  a);
    return;
  }
  if (!e.complete) {  // its payload is still arriving into e.data: the recv waits for it
    auto in = incoming_.find({e.from, e.send_id});
    if (in != incoming_.end()) {
      in->second.recv = id;
      return;
    }
    EndRecvLocked(id, Internal(Describe(r) + ": a message still arriving that is not"), a);
    return;
  }
  if (!r.data.empty()) std::memcpy(r.data.data(), e.data->data(), r.data.size());
  counts_.bytes_received += r.data.size();
  AckLocked(e.from, e.send_id, r.message, Status::Ok(), a);
  EndRecvLocked(id, Status::Ok(), a);
}

void PeerLink::DeliverLocked(Envelope e, Actions* a) {
  for (auto it = posted_.begin(); it != posted_.end(); ++it) {
    if (!Matches(recvs_.at(*it), e)) continue;
    const uint64_t id = *it;
    posted_.erase(it);
    MeetLocked(id, std::move(e), a);
    return;
  }
  if (e.eager && e.complete) counts_.unexpected_bytes += e.bytes;
  unmatched_.push_back(std::move(e));
}

void PeerLink::AckLocked(uint32_t to, uint64_t send_id, const PeerMessage& m, const Status& s,
                         Actions* a) {
  Outgoing o;
  o.to = to;
  o.header = Frame(MsgType::kPeerAck, m.channel, m.tag);
  o.header.cookie = send_id;
  o.header.code = static_cast<uint8_t>(s.code());
  if (!s.ok()) {
    o.owned = std::make_shared<std::vector<std::byte>>(wire::EncodeText(s.message()));
    o.payload = *o.owned;
    o.header.payload_bytes = o.owned->size();
  }
  SendLocked(std::move(o), a);
}

void PeerLink::SendLocked(Outgoing o, Actions* a) {
  a->lane = lane_;
  if (auto it = endpoints_.find(o.to); it != endpoints_.end()) {
    // A send's data in the lane's hands: it ends when the lane lets go of it, not before.
    if (o.send_id != 0 && o.header.type == MsgType::kPeerData) {
      if (auto s = sends_.find(o.send_id); s != sends_.end()) s->second.data_in_lane = true;
    }
    a->frames.emplace_back(it->second, std::move(o));
    return;
  }
  std::vector<Outgoing>& waiting = waiting_[o.to];
  if (waiting.empty()) {
    a->lookups.push_back(o.to);
    asked_[o.to] = Clock::now();
  }
  waiting.push_back(std::move(o));
}

void PeerLink::Run(Actions& a) {
  // Before Start() there is no scheduler to ask yet: Start() asks.
  for (uint32_t rank : a.lookups) {
    // Unanswered (the scheduler is being replaced): LookUpAgain asks once it is back.
    if (a.lane != nullptr) config_.lookup(rank).IgnoreError();
  }
  for (auto& [peer, o] : a.frames) {
    const uint64_t id = o.send_id;
    const bool data = o.header.type == MsgType::kPeerData;
    a.lane->Send(peer, o.header, o.payload,
                       [this, id, data, owned = std::move(o.owned)](const Status& s) {
                         if (id != 0) OnSent(id, data, s);
                       });
  }
  if (!a.reads.empty()) RunReads(a);  // peer_read.cc
  for (auto& [op, result] : a.completions) Complete(op, result);
}

void PeerLink::OnSent(uint64_t id, bool data, const Status& s) {
  Actions a;
  {
    MutexLock lock(mu_);
    auto it = sends_.find(id);
    if (it == sends_.end()) return;
    SendState& st = it->second;
    if (!data) {  // a kPeerReady: only its failure matters
      if (!s.ok()) EndSendLocked(id, s, &a);
    } else {
      st.data_in_lane = false;
      if (!st.failure.ok()) {
        EndSendLocked(id, st.failure, &a);
      } else if (!s.ok()) {
        EndSendLocked(id, s, &a);
      } else if (!st.eager || st.acked) {
        counts_.bytes_sent += st.data.size();
        EndSendLocked(id, Status::Ok(), &a);
      }
    }
  }
  Run(a);
}

void PeerLink::EndSendLocked(uint64_t id, Status s, Actions* a) {
  auto it = sends_.find(id);
  if (it == sends_.end()) return;
  SendState& st = it->second;
  if (st.data_in_lane) {  // the lane still reads its bytes: it ends when the lane lets go
    if (st.failure.ok()) st.failure = s.ok() ? Internal("send ended twice") : std::move(s);
    return;
  }
  if (st.cell != nullptr) {  // from now on no read of it passes its check
    st.cell->store(0, std::memory_order_seq_cst);
    std::atomic_thread_fence(std::memory_order_seq_cst);
    free_cells_.push_back(st.cell);
  }
  a->completions.emplace_back(st.op, PeerResult{std::move(s), st.to});
  sends_.erase(it);
}

void PeerLink::EndRecvLocked(uint64_t id, Status s, Actions* a) {
  auto it = recvs_.find(id);
  if (it == recvs_.end()) return;
  RecvState& r = it->second;
  if (r.landing) return;  // the lane still writes its buffer: OnPayload ends it
  if (!r.matched) posted_.erase(std::remove(posted_.begin(), posted_.end(), id), posted_.end());
  for (auto e = expected_.begin(); e != expected_.end();) {
    e = e->second == id ? expected_.erase(e) : std::next(e);
  }
  for (auto& [key, in] : incoming_) {
    if (in.recv == id) in.recv = 0;
  }
  a->completions.emplace_back(r.op, PeerResult{std::move(s), r.source});
  recvs_.erase(it);
}

// ---- Frames from the reply lane ---------------------------------------------------------------

Status PeerLink::CheckFrom(const wire::Header& h) const {
  // Before Start() (a peer quicker than this worker's Init) the job's hash alone is checked.
  if (h.job != config_.job_hash || (size_ != 0 && (h.sender >= size_ || h.sender == rank_))) {
    return ProtocolError("peer frame from sender " + std::to_string(h.sender) + " of job " +
                         std::to_string(h.job));
  }
  return Status::Ok();
}

Result<std::span<std::byte>> PeerLink::OnHeader(const wire::Header& h) {
  Actions a;
  a.on_lane = true;
  Result<std::span<std::byte>> out = std::span<std::byte>();
  {
    MutexLock lock(mu_);
    GL_RETURN_IF_ERROR(CheckFrom(h));
    const std::pair<uint32_t, uint64_t> key{h.sender, h.cookie};
    switch (h.type) {
      case MsgType::kPeerAck:
      case MsgType::kPeerReady: {  // a reason, or an announcement: OnPayload reads it
        auto& b = small_[{h.sender, static_cast<uint8_t>(h.type), h.cookie}];
        b = std::make_shared<std::vector<std::byte>>(h.payload_bytes);
        out = std::span<std::byte>(*b);
        break;
      }
      case MsgType::kPeerClear: {
        auto it = sends_.find(h.cookie);
        if (it == sends_.end() || it->second.to != h.sender) {
          // A send that ended meanwhile (its deadline passed): its recv fails too.
          Outgoing o;
          o.to = h.sender;
          o.header = Frame(MsgType::kPeerAck, h.key, h.partition);
          o.header.flags = wire::kFlagCleared;
          o.header.cookie = h.cookie;
          o.header.code = static_cast<uint8_t>(Code::kTimeout);
          o.owned = std::make_shared<std::vector<std::byte>>(wire::EncodeText(
              "the send of this message ended before its recv cleared it (its deadline passed)"));
          o.payload = *o.owned;
          o.header.payload_bytes = o.owned->size();
          SendLocked(std::move(o), &a);
          break;
        }
        if (it->second.eager || it->second.data_in_lane) break;  // cleared twice
        SendState& st = it->second;
        Outgoing o;
        o.to = st.to;
        o.header = Frame(MsgType::kPeerData, st.message.channel, st.message.tag);
        o.header.flags = wire::kFlagCleared;
        o.header.round = st.seq;
        o.header.count = st.data.size();
        o.header.payload_bytes = st.data.size();
        o.header.element = st.message.element;
        o.header.cookie = h.cookie;
        o.payload = st.data;
        o.send_id = h.cookie;
        SendLocked(std::move(o), &a);
        break;
      }
      case MsgType::kPeerData:
        if ((h.flags & wire::kFlagCleared) != 0) {
          auto it = expected_.find(key);
          if (it == expected_.end()) {
            out = Aborted("data of a message whose recv has ended");
            break;
          }
          RecvState& r = recvs_.at(it->second);
          if (h.count != r.data.size()) {
            out = ProtocolError("cleared data of " + std::to_string(h.count) + " bytes for a " +
                                Describe(r));
            break;
          }
          r.landing = true;
          out = r.data;
          break;
        }
        out = ArriveLocked(EnvelopeOf(h), &a);
        break;
      default:
        out = ProtocolError("not a peer frame");
    }
  }
  Run(a);
  return out;
}

PeerLink::Envelope PeerLink::EnvelopeOf(const wire::Header& h) {
  Envelope e;
  e.from = h.sender;
  e.channel = h.key;
  e.tag = h.partition;
  e.seq = h.round;
  e.bytes = h.count;
  e.element = h.element;
  e.send_id = h.cookie;
  e.eager = h.type == MsgType::kPeerData;
  e.complete = !e.eager || h.count == 0;
  return e;
}

Result<std::span<std::byte>> PeerLink::ArriveLocked(Envelope e, Actions* a) {
  Stream& stream = streams_[{e.from, e.channel, e.tag}];
  if (e.seq < stream.next || stream.early.count(e.seq) != 0) {
    return ProtocolError("message " + std::to_string(e.seq) + " of worker " +
                         std::to_string(e.from) + " (tag " + std::to_string(e.tag) +
                         ") arrived twice");
  }
  const std::pair<uint32_t, uint64_t> key{e.from, e.send_id};
  std::span<std::byte> out;
  // An eager payload that no recv takes yet lands in a buffer of its own.
  const auto buffer = [&] {
    mu_.AssertHeld();  // (run here, under mu_)
    if (!e.eager || e.bytes == 0) return;
    e.data = std::make_shared<std::vector<std::byte>>(e.bytes);
    incoming_[key] = Incoming{0, e.data};
    out = std::span<std::byte>(*e.data);
  };
  if (e.seq != stream.next) {  // ahead of its stream: waits for those before it
    buffer();
    stream.early.emplace(e.seq, std::move(e));
    return out;
  }
  stream.next++;
  auto it = posted_.end();
  if (e.eager) {
    it = std::find_if(posted_.begin(), posted_.end(), [&](uint64_t id) {
      mu_.AssertHeld();  // (run here, under mu_)
      return Matches(recvs_.at(id), e);
    });
  }
  Status dropped;
  if (it != posted_.end()) {
    const uint64_t id = *it;
    posted_.erase(it);
    RecvState& r = recvs_.at(id);
    if (e.bytes == r.data.size() && e.element == r.message.element) {
      // Straight into the recv: no copy.
      r.matched = r.landing = true;
      r.source = e.from;
      incoming_[key] = Incoming{id, nullptr};
      out = r.data;
    } else {
      MeetLocked(id, std::move(e), a);  // refuses both
      dropped = Aborted("the message met a recv that refused it");
    }
  } else {
    buffer();
    DeliverLocked(std::move(e), a);
  }
  // What arrived early and is next now follows, in order.
  for (auto n = stream.early.find(stream.next); n != stream.early.end();
       n = stream.early.find(stream.next)) {
    Envelope next = std::move(n->second);
    stream.early.erase(n);
    stream.next++;
    DeliverLocked(std::move(next), a);
  }
  if (!dropped.ok()) return dropped;
  return out;
}

void PeerLink::OnPayload(const wire::Header& h, bool ok, const Status& why) {
  Actions a;
  a.on_lane = true;
  {
    MutexLock lock(mu_);
    const std::pair<uint32_t, uint64_t> key{h.sender, h.cookie};
    const std::vector<std::byte> small =
        h.type == MsgType::kPeerAck || h.type == MsgType::kPeerReady ? TakeSmallLocked(h)
                                                                     : std::vector<std::byte>();
    if (h.type == MsgType::kPeerReady) {
      Envelope e = EnvelopeOf(h);
      // Read from the sender's memory only where it is on this machine as the address book
      // says, and another process: an announcement from elsewhere is ignored (cleared).
      const std::vector<std::byte>& ready = small;
      if (ok && ready.size() == wire::kPeerLocalBytes && config_.same_host &&
          config_.same_host(h.sender)) {
        const std::byte* p = ready.data();
        LocalSource src{GetU64(p), GetU64(p + 8), GetU64(p + 16), GetU64(p + 24)};
        if (src.pid != 0 && src.pid != static_cast<uint64_t>(getpid())) e.local = src;
      }
      // (A failed announcement is a message lost with its connection: its peer is failing.)
      if (ok) ArriveLocked(std::move(e), &a).status().IgnoreError();
    } else if (h.type == MsgType::kPeerAck && (h.flags & wire::kFlagCleared) != 0) {
      // About a message this worker cleared: its send is gone, so is its recv.
      if (auto it = expected_.find(key); it != expected_.end()) {
        const uint64_t id = it->second;
        Result<std::string> text = wire::DecodeText(small);
        EndRecvLocked(id,
                      Status(ok ? static_cast<Code>(h.code) : why.code(),
                             Describe(recvs_.at(id)) + ": " + config_.name(h.sender) + ": " +
                                 (ok && text.ok() ? *text : why.ToString())),
                      &a);
      }
    } else if (h.type == MsgType::kPeerAck) {
      auto it = sends_.find(h.cookie);
      // An eager or directly read message's acknowledgement, or a refusal of any message.
      if (it != sends_.end() && it->second.to == h.sender &&
          (it->second.eager || it->second.cell != nullptr || h.code != 0)) {
        SendState& st = it->second;
        if (!ok) {
          EndSendLocked(h.cookie, why, &a);
        } else if (h.code != 0) {
          Result<std::string> text = wire::DecodeText(small);
          EndSendLocked(h.cookie,
                        Status(static_cast<Code>(h.code), text.ok() ? *text : "(unreadable)"),
                        &a);
        } else {
          st.acked = true;
          if (!st.data_in_lane) {
            counts_.bytes_sent += st.data.size();
            EndSendLocked(h.cookie, Status::Ok(), &a);
          }
        }
      }
    } else if (h.type == MsgType::kPeerData && (h.flags & wire::kFlagCleared) != 0) {
      if (auto it = expected_.find(key); it != expected_.end()) {
        const uint64_t id = it->second;
        expected_.erase(it);
        RecvState& r = recvs_.at(id);
        r.landing = false;
        if (ok) counts_.bytes_received += r.data.size();
        EndRecvLocked(id, ok ? Status::Ok() : why, &a);
      }
    } else if (h.type == MsgType::kPeerData) {
      if (auto it = incoming_.find(key); it != incoming_.end()) {
        Incoming in = std::move(it->second);
        incoming_.erase(it);
        if (in.buffer == nullptr) {  // landed in its recv
          RecvState& r = recvs_.at(in.recv);
          r.landing = false;
          if (ok) {
            counts_.bytes_received += r.data.size();
            AckLocked(h.sender, h.cookie, r.message, Status::Ok(), &a);
          }
          EndRecvLocked(in.recv, ok ? Status::Ok() : why, &a);
        } else if (in.recv != 0) {  // a recv met it while it arrived
          RecvState& r = recvs_.at(in.recv);
          if (ok) {
            if (!r.data.empty()) std::memcpy(r.data.data(), in.buffer->data(), r.data.size());
            counts_.bytes_received += r.data.size();
            AckLocked(h.sender, h.cookie, r.message, Status::Ok(), &a);
          }
          EndRecvLocked(in.recv, ok ? Status::Ok() : why, &a);
        } else {  // still waiting for its recv, queued or early
          // Queued (counted as unexpected bytes once whole) or early (counted when it is
          // queued, DeliverLocked).
          const auto mark = [&](Envelope& e, bool queued) {
            mu_.AssertHeld();  // (run here, under mu_)
            if (e.from != h.sender || e.send_id != h.cookie) return false;
            e.complete = ok;
            if (!ok) e.lost = why;
            if (ok && queued) counts_.unexpected_bytes += e.bytes;
            return true;
          };
          bool found = false;
          for (Envelope& e : unmatched_) found = found || mark(e, true);
          if (!found) {
            auto s = streams_.find({h.sender, h.key, h.partition});
            if (s != streams_.end()) {
              for (auto& [seq, e] : s->second.early) found = found || mark(e, false);
            }
          }
          // A payload that failed to arrive leaves an incomplete message: a recv that meets it
          // waits for its deadline, and the sender for its own (the lane reports the peer).
        }
      }
    }
  }
  Run(a);
}

// ---- Control thread ---------------------------------------------------------------------------

void PeerLink::Start(uint32_t rank, uint32_t size, transport::Lane* lane) {
  {
    MutexLock lock(mu_);
    rank_ = rank;
    size_ = size;
    lane_ = lane;
    for (auto& [to, frames] : waiting_) {
      for (Outgoing& o : frames) o.header.sender = rank;  // made before the rank was known
    }
  }
  LookUpAgain();
}

void PeerLink::OnAddress(const wire::Header& h, std::span<const std::byte> payload) {
  transport::Lane* lane;
  {
    MutexLock lock(mu_);
    if (h.count >= size_ || h.count == rank_) return;
    lane = lane_;
  }
  const uint32_t rank = static_cast<uint32_t>(h.count);
  Status failed;
  std::optional<transport::PeerId> peer;
  if (h.code != 0) {
    Result<std::string> text = wire::DecodeText(payload);
    failed = Status(static_cast<Code>(h.code),
                    "the scheduler has no address for worker " + std::to_string(rank) + ": " +
                        (text.ok() ? *text : std::string("(unreadable)")));
  } else {
    {
      MutexLock lock(mu_);
      if (endpoints_.count(rank) != 0) return;  // a second answer (asked again after a rejoin)
      connecting_++;
    }
    Result<transport::PeerId> p = lane->Connect(payload, config_.name(rank));
    {
      MutexLock lock(mu_);
      connecting_--;
    }
    if (p.ok()) {
      peer = *p;
    } else {
      failed = PeerLost("connecting to " + config_.name(rank) + ": " + p.status().ToString());
    }
  }
  Actions a;
  {
    MutexLock lock(mu_);
    a.lane = lane_;
    if (peer) {
      endpoints_[rank] = *peer;
      ranks_[*peer] = rank;
      std::vector<Outgoing> frames = std::move(waiting_[rank]);
      waiting_.erase(rank);
      asked_.erase(rank);
      for (Outgoing& o : frames) SendLocked(std::move(o), &a);
      // The endpoint failed before its id was known here (held by OnPeerFailed).
      if (auto f = early_failures_.find(*peer); f != early_failures_.end()) {
        OnPeerDown(rank, PeerLost(config_.name(rank) + ": " + f->second.ToString()), &a);
        early_failures_.erase(f);
      }
      if (connecting_ == 0) early_failures_.clear();
    } else {
      OnPeerDown(rank, failed, &a);
    }
  }
  Run(a);
}

void PeerLink::LookUpAgain() {
  std::vector<uint32_t> ranks;
  {
    MutexLock lock(mu_);
    for (const auto& [rank, frames] : waiting_) {
      if (!frames.empty()) ranks.push_back(rank);
    }
  }
  for (uint32_t rank : ranks) config_.lookup(rank).IgnoreError();
}

bool PeerLink::OnPeerFailed(transport::PeerId peer, const Status& s, bool unknown_elsewhere) {
  Actions a;
  {
    MutexLock lock(mu_);
    auto it = ranks_.find(peer);
    if (it == ranks_.end()) {
      if (!unknown_elsewhere || connecting_ == 0) return false;
      early_failures_.emplace(peer, s);  // a connection of ours, still being made
      return true;
    }
    OnPeerDown(it->second, PeerLost(config_.name(it->second) + ": " + s.ToString()), &a);
  }
  Run(a);
  return true;
}

void PeerLink::OnPeerDown(uint32_t rank, const Status& s, Actions* a) {
  down_.emplace(rank, s);
  waiting_.erase(rank);  // their sends end below (none of them is in the lane's hands)
  asked_.erase(rank);
  std::vector<uint64_t> ids;
  for (const auto& [id, st] : sends_) {
    if (st.to == rank) ids.push_back(id);
  }
  for (uint64_t id : ids) EndSendLocked(id, s, a);
  ids.clear();
  for (const auto& [id, r] : recvs_) {
    if ((r.from && *r.from == rank) || (r.matched && r.source == rank)) ids.push_back(id);
  }
  for (uint64_t id : ids) EndRecvLocked(id, s, a);
}

void PeerLink::Tick(Clock::time_point now) {
  Actions a;
  {
    MutexLock lock(mu_);
    if (asked_.empty() && sends_.empty() && recvs_.empty()) return;  // idle: every tick
    // A lookup whose answer never came (its frame lost with a scheduler that went away): again.
    for (auto& [rank, when] : asked_) {
      if (now - when > std::chrono::seconds(1) && lane_ != nullptr) {
        when = now;
        a.lookups.push_back(rank);
        a.lane = lane_;
      }
    }

    std::vector<uint64_t> ids;
    for (const auto& [id, st] : sends_) {
      if (!st.data_in_lane && st.deadline <= now) ids.push_back(id);
    }
    for (uint64_t id : ids) {
      const SendState& st = sends_.at(id);
      EndSendLocked(id,
                    Timeout("send of " + Bytes(st.data.size(), st.message.element) + " to " +
                            config_.name(st.to) + " (tag " + std::to_string(st.message.tag) +
                            "): " + (st.eager ? "no recv acknowledged it" : "no recv cleared it") +
                            " by the deadline"),
                    &a);
    }
    ids.clear();
    std::vector<uint64_t> cleared;
    for (const auto& [key, id] : expected_) cleared.push_back(id);
    for (const auto& [id, r] : recvs_) {
      // A recv whose message it cleared waits for the data: its sender no longer times out,
      // and a sender that had ended says so (kPeerAck with kFlagCleared); a peer lost ends it.
      if (!r.landing && r.deadline <= now &&
          std::find(cleared.begin(), cleared.end(), id) == cleared.end()) {
        ids.push_back(id);
      }
    }
    for (uint64_t id : ids) {
      const RecvState& r = recvs_.at(id);
      EndRecvLocked(id,
                    Timeout(Describe(r) + ": " +
                            (r.matched ? "its data had not come (from " +
                                             config_.name(r.source) + ")"
                                       : std::string("no message came")) +
                            " by the deadline"),
                    &a);
    }
  }
  Run(a);
}

void PeerLink::FailAll(const Status& s, bool lanes_stopped) {
  Actions a;
  {
    MutexLock lock(mu_);
    if (failed_.ok()) failed_ = s;
    waiting_.clear();
    std::vector<uint64_t> ids;
    for (auto& [id, st] : sends_) {
      if (lanes_stopped) st.data_in_lane = false;
      ids.push_back(id);
    }
    for (uint64_t id : ids) EndSendLocked(id, failed_, &a);
    ids.clear();
    std::vector<uint64_t> held;
    for (auto& [id, r] : recvs_) {
      if (lanes_stopped && r.landing) {
        r.landing = false;
        held.push_back(id);  // the fabric may write it yet: its caller keeps it
      }
      ids.push_back(id);
    }
    const size_t first = a.completions.size();
    for (uint64_t id : ids) EndRecvLocked(id, failed_, &a);
    for (size_t i = first; i < a.completions.size(); ++i) {
      const uint64_t id = ids[i - first];
      a.completions[i].second.buffer_held =
          std::find(held.begin(), held.end(), id) != held.end();
    }
  }
  Run(a);
}

std::vector<std::byte> PeerLink::TakeSmallLocked(const wire::Header& h) {
  auto it = small_.find({h.sender, static_cast<uint8_t>(h.type), h.cookie});
  if (it == small_.end()) return {};
  std::vector<std::byte> out = std::move(*it->second);
  small_.erase(it);
  return out;
}

void PeerLink::KeepBuffersForever() {
  MutexLock lock(mu_);
  auto* kept = new std::vector<std::shared_ptr<std::vector<std::byte>>>();  // never freed
  for (auto& [key, in] : incoming_) {
    if (in.buffer) kept->push_back(std::move(in.buffer));
  }
  for (auto& [key, b] : small_) kept->push_back(std::move(b));
  small_.clear();
  incoming_.clear();
}

PeerLink::Counts PeerLink::counts() const {
  MutexLock lock(mu_);
  return counts_;
}

}  // namespace gradlink
