// PeerLink: a worker's point-to-point messages to and from other workers (Worker::Send / Recv,
// torch.distributed's send / recv), straight between the two, never through a server.
//
// Path: the lanes the worker already has. A message leaves on this worker's push lane for the
// peer's reply lane (its pull lane), whose receiver hands peer frames here. The endpoint is
// made on first use: the peer's reply-lane address comes from the scheduler (kPeerLookup /
// kPeerAddress; the workers' own address book leaves other workers out, which keeps it small in
// large jobs), and the connection proves membership with the job's lane hello like every data
// connection. UCX carries it over shared memory between workers of one host and over TCP (or
// RDMA) between hosts, so no same-host segment of its own is needed.
//
// Protocol (wire/frame.h, kPeer*): a message of at most kEagerBytes goes at once (kPeerData),
// lands in the recv it meets, or in a buffer here until one is posted, and is acknowledged
// (kPeerAck) once matched: the sender's Send completes then, so that a recv that disagrees on
// size or element type fails the send too. A larger message is announced (kPeerReady); the recv
// it meets clears it (kPeerClear) and its data (kPeerData with kFlagCleared) lands in the recv's
// buffer, with no copy here; the Send completes when its bytes have left. Messages are numbered
// per (sender, channel, tag) and matched in that order whatever order the lanes deliver them.
//
// Same host: a sender on the receiver's host says in its kPeerReady where the message lies
// (pid, address) and the receiver copies it once, straight from the sender's memory into its
// recv's buffer (process_vm_readv, as MPI's CMA path does), then acknowledges it; the bytes
// never cross a socket (over TCP on loopback they would be copied four times). The
// announcement names a cell in the sender's memory holding a random number while the send
// lives: read before and after the copy, it proves the copy came from that send's buffer while
// it was still the caller's (a pid reused in another pid namespace, or a send that timed out
// meanwhile, fails the check). Where the read is refused or fails the check, the receiver
// clears the message instead and it comes over the lane.
//
// Failures: a peer's failed endpoint fails the sends to it and the recvs from it, naming it; the
// job's failure (FailAll) fails everything; a deadline fails what has not begun to move (Tick,
// from the control thread), but not a recv that cleared its message (its sender no longer
// times out; one that had ended answers the clearance with kPeerAck + kFlagCleared). Bytes in the lane's hands are never abandoned while the lane runs:
// their op ends when the lane lets go.
//
// Threads: Send / Recv on callers' threads; OnHeader / OnPayload on the reply lane's progress
// thread; send completions on the push lane's; OnAddress, OnPeerFailed, Tick on the control
// thread (OnPeerFailed on a lane's); the reader thread (started on first use) copies what a
// lane's thread matched for a same-machine read. Lock: `mu_`, a leaf of the worker's (nothing of the
// worker's is taken under it, and it is never taken under the worker's state lock); frames are
// handed to the lane and callbacks run after it is released.
#pragma once

#include <atomic>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "common/mutex.h"
#include "common/thread_annotations.h"
#include "gradlink/status.h"
#include "gradlink/worker.h"
#include "transport/transport.h"
#include "wire/frame.h"

namespace gradlink {

namespace internal {

// One Send or Recv, shared with its handles.
struct PeerOp {
  Mutex mu;
  CondVar cv;
  bool done GUARDED_BY(mu) = false;
  PeerResult result GUARDED_BY(mu);
  PeerCallback callback;  // set before the op is shared, run once by Complete
};

}  // namespace internal

class PeerLink {
 public:
  // Messages up to this size go at once; larger ones wait for their recv (kPeerReady).
  static constexpr uint64_t kEagerBytes = wire::kPeerEagerBytes;

  struct Config {
    uint32_t job_hash = 0;
    // Asks the scheduler for worker `rank`'s reply-lane address (kPeerLookup); its answer
    // comes to OnAddress. Runs outside mu_.
    std::function<Status(uint32_t rank)> lookup;
    // "worker 2 (host)": how errors name a peer.
    std::function<std::string(uint32_t rank)> name;
    // Whether worker `rank` is on this worker's host (the same host identity: machine and
    // network namespace), where a large message may be read from its memory directly.
    std::function<bool(uint32_t rank)> same_host;
  };

  // Made before the worker's lanes open: a peer may send as soon as it has joined, before this
  // worker's Init() has finished.
  explicit PeerLink(Config config);
  ~PeerLink();
  PeerLink(const PeerLink&) = delete;
  PeerLink& operator=(const PeerLink&) = delete;

  // The worker joined as `rank` of `size`; frames leave on `lane` (its push lane). What arrived
  // before is answered now.
  void Start(uint32_t rank, uint32_t size, transport::Lane* lane) EXCLUDES(mu_);

  PeerHandle Send(uint32_t to, const PeerMessage& m, std::span<const std::byte> data,
                  Clock::time_point deadline, PeerCallback done) EXCLUDES(mu_);
  PeerHandle Recv(std::optional<uint32_t> from, const PeerMessage& m, std::span<std::byte> data,
                  Clock::time_point deadline, PeerCallback done) EXCLUDES(mu_);

  // A peer frame on the reply lane (wire::IsPeerType), as transport::Receiver's calls.
  Result<std::span<std::byte>> OnHeader(const wire::Header& h) EXCLUDES(mu_);
  void OnPayload(const wire::Header& h, bool ok, const Status& why) EXCLUDES(mu_);

  // kPeerAddress from the scheduler (control thread).
  void OnAddress(const wire::Header& h, std::span<const std::byte> payload) EXCLUDES(mu_);
  // The scheduler was replaced (a rejoin): asks again for the addresses still awaited.
  void LookUpAgain() EXCLUDES(mu_);
  // A push-lane endpoint failed: true when it was one of ours (a worker's), whose sends and
  // recvs then fail. `unknown_elsewhere`: the worker has no server on it either; while a
  // connection of ours is being made, such a failure is held for it (its id is not known
  // until Connect() returns).
  bool OnPeerFailed(transport::PeerId peer, const Status& s, bool unknown_elsewhere)
      EXCLUDES(mu_);
  // Fails what is past its deadline and not in the lane's hands (control thread, every tick).
  void Tick(Clock::time_point now) EXCLUDES(mu_);
  // The job failed (or the worker shuts down): everything fails with `s`. With `lanes_stopped`
  // no lane callback will come, so what the lanes held ends now too; otherwise it ends when
  // they let go.
  void FailAll(const Status& s, bool lanes_stopped) EXCLUDES(mu_);

  // Ends the reader thread (reads it still had are not started; their recvs have failed with
  // the job or the shutdown). After FailAll, before the lanes go. Idempotent.
  void StopReader() EXCLUDES(reader_mu_);

  // After the lanes stopped: if they gave up receives they could not cancel, whatever buffer of
  // this link's a message was arriving into is never freed (the fabric may write it yet).
  void KeepBuffersForever() EXCLUDES(mu_);

  struct Counts {
    uint64_t sends = 0, recvs = 0, bytes_sent = 0, bytes_received = 0, unexpected_bytes = 0;
  };
  Counts counts() const EXCLUDES(mu_);

 private:
  using OpPtr = std::shared_ptr<internal::PeerOp>;

  struct SendState {
    uint32_t to = 0;
    PeerMessage message;
    uint64_t seq = 0;
    std::span<const std::byte> data;
    Clock::time_point deadline;
    OpPtr op;
    bool eager = false;
    bool data_in_lane = false;  // its payload is with the lane: ends when the lane lets go
    bool acked = false;         // eager: the receiver matched it
    Status failure;             // set when it failed while the lane held its payload
    std::atomic<uint64_t>* cell = nullptr;  // announced for a direct read: its proof (cells_)
  };
  struct RecvState {
    std::optional<uint32_t> from;
    PeerMessage message;
    std::span<std::byte> data;
    Clock::time_point deadline;
    OpPtr op;
    bool matched = false;  // met a message: waits for its data, no deadline
    bool landing = false;  // the lane is writing its data
    uint32_t source = 0;
  };
  // Where a message on this host lies: the sender's announcement (kPeerLocalBytes).
  struct LocalSource {
    uint64_t pid = 0;
    uint64_t cell = 0;   // the address of the send's cell
    uint64_t nonce = 0;  // the cell's value while the send lives
    uint64_t address = 0;
  };
  // A message that arrived before a recv for it.
  struct Envelope {
    uint32_t from = 0;
    uint64_t channel = 0;
    uint32_t tag = 0;
    uint64_t seq = 0;
    uint64_t bytes = 0;
    uint16_t element = 0;
    uint64_t send_id = 0;
    bool eager = false;
    bool complete = false;  // its payload is in `data` (a kPeerReady has none to wait for)
    Status lost;            // its payload failed to arrive
    std::shared_ptr<std::vector<std::byte>> data;  // eager: where its payload lands
    std::optional<LocalSource> local;               // readable from the sender's memory
  };
  struct StreamKey {
    uint32_t from;
    uint64_t channel;
    uint32_t tag;
    bool operator<(const StreamKey& o) const {
      return std::tie(from, channel, tag) < std::tie(o.from, o.channel, o.tag);
    }
  };
  struct Stream {
    uint64_t next = 0;                       // the next message number to deliver
    std::map<uint64_t, Envelope> early;      // arrived ahead of `next`
  };
  struct Outgoing {
    uint32_t to = 0;
    wire::Header header;
    std::span<const std::byte> payload;
    std::shared_ptr<std::vector<std::byte>> owned;  // a reason's text
    uint64_t send_id = 0;  // a send's own frame (kPeerData, kPeerReady): it hears how it went
  };
  // What a critical section leaves to do once mu_ is released.
  struct Actions {
    std::vector<std::pair<transport::PeerId, Outgoing>> frames;
    std::vector<std::pair<OpPtr, PeerResult>> completions;
    std::vector<uint32_t> lookups;
    transport::Lane* lane = nullptr;  // lane_, for the frames
    // Recvs to fill from a sender's memory (a matched announcement with a LocalSource).
    struct Read {
      uint64_t recv = 0;
      uint32_t from = 0;
      uint64_t send_id = 0;
      LocalSource source;
      std::span<std::byte> into;
      PeerMessage message;
    };
    std::vector<Read> reads;
    // On a lane's progress thread: reads go to the reader thread, never run here (a copy of up
    // to 1 GiB would hold up every frame of the lane).
    bool on_lane = false;
  };
  // Same-machine reads (peer_read.cc): a's reads, here or (on a lane's thread) on the reader.
  void RunReads(Actions& a) EXCLUDES(mu_);
  // Copies a Read's message out of the sender's memory; true when it proved to be that send's.
  static bool ReadFromPeer(const Actions::Read& r);
  // A Read is over: the recv completes, or (`copied` false) clears the message after all.
  void EndReadLocked(const Actions::Read& r, bool copied, Actions* a) REQUIRES(mu_);
  void Run(Actions& a) EXCLUDES(mu_);
  static void Complete(const OpPtr& op, const PeerResult& r);

  wire::Header Frame(wire::MsgType type, uint64_t channel, uint32_t tag) const REQUIRES(mu_);
  // Hands `o` to the lane, or keeps it until `o.to`'s address is known.
  void SendLocked(Outgoing o, Actions* a) REQUIRES(mu_);
  void AckLocked(uint32_t to, uint64_t send_id, const PeerMessage& m, const Status& s,
                 Actions* a) REQUIRES(mu_);
  // A message's first frame (`payload_bytes`: its eager payload): its stream's next lands in the
  // first posted recv it matches, or is queued for one; a later one waits for those before it.
  // Where an eager payload lands (the recv's buffer, or one of the link's), else empty.
  Result<std::span<std::byte>> ArriveLocked(Envelope e, Actions* a) REQUIRES(mu_);
  static Envelope EnvelopeOf(const wire::Header& h);
  // A message of its stream's next number: to the first posted recv it matches, else queued.
  void DeliverLocked(Envelope e, Actions* a) REQUIRES(mu_);
  // Recv `id` meets `e` (which has left the queues): checks them against each other, then
  // completes, clears or waits for the data.
  void MeetLocked(uint64_t id, Envelope e, Actions* a) REQUIRES(mu_);
  static bool Matches(const RecvState& r, const Envelope& e);
  static std::string Describe(const RecvState& r);
  void EndSendLocked(uint64_t id, Status s, Actions* a) REQUIRES(mu_);
  void EndRecvLocked(uint64_t id, Status s, Actions* a) REQUIRES(mu_);
  // A send's frame left (`data`: its kPeerData), or failed to.
  void OnSent(uint64_t id, bool data, const Status& s) EXCLUDES(mu_);
  // A frame of the reply lane's, in order (Header then Payload), for kPeerAck's reason.
  // The reader thread: copies out of senders' memory that a lane's thread matched.
  void ReaderLoop();
  Mutex reader_mu_;
  CondVar reader_cv_;
  std::deque<Actions::Read> to_read_ GUARDED_BY(reader_mu_);
  bool reader_stopping_ GUARDED_BY(reader_mu_) = false;
  std::thread reader_;  // started on first use, under reader_mu_
  // A kPeerAck's reason or a kPeerReady's announcement, from OnHeader to OnPayload, by
  // (sender, type, cookie): a buffer per frame, as frames may overlap.
  std::map<std::tuple<uint32_t, uint8_t, uint64_t>, std::shared_ptr<std::vector<std::byte>>>
      small_ GUARDED_BY(mu_);
  // Takes `h`'s buffer out of small_ (empty when there was none).
  std::vector<std::byte> TakeSmallLocked(const wire::Header& h) REQUIRES(mu_);
  void OnPeerDown(uint32_t rank, const Status& s, Actions* a) REQUIRES(mu_);
  Status CheckFrom(const wire::Header& h) const REQUIRES(mu_);

  const Config config_;
  mutable Mutex mu_;
  uint32_t rank_ GUARDED_BY(mu_) = 0;
  uint32_t size_ GUARDED_BY(mu_) = 0;  // 0 until Start()
  transport::Lane* lane_ GUARDED_BY(mu_) = nullptr;
  uint64_t next_id_ GUARDED_BY(mu_) = 1;
  std::unordered_map<uint64_t, SendState> sends_ GUARDED_BY(mu_);
  std::unordered_map<uint64_t, RecvState> recvs_ GUARDED_BY(mu_);
  std::deque<uint64_t> posted_ GUARDED_BY(mu_);     // unmatched recvs, in post order
  std::deque<Envelope> unmatched_ GUARDED_BY(mu_);  // unmatched messages, in arrival order
  std::map<StreamKey, Stream> streams_ GUARDED_BY(mu_);
  // Next number of each outgoing stream: (to, channel, tag).
  std::map<StreamKey, uint64_t> out_seq_ GUARDED_BY(mu_);
  // A matched recv whose data comes later, by (sender, its send id): a cleared kPeerReady's.
  std::map<std::pair<uint32_t, uint64_t>, uint64_t> expected_ GUARDED_BY(mu_);
  // An eager message whose payload the lane is writing, by (sender, send id).
  struct Incoming {
    uint64_t recv = 0;  // the recv it is for (0: none yet, or none any more)
    std::shared_ptr<std::vector<std::byte>> buffer;  // null: it lands in the recv directly
  };
  std::map<std::pair<uint32_t, uint64_t>, Incoming> incoming_ GUARDED_BY(mu_);
  std::unordered_map<uint32_t, transport::PeerId> endpoints_ GUARDED_BY(mu_);
  std::unordered_map<transport::PeerId, uint32_t> ranks_ GUARDED_BY(mu_);
  std::unordered_map<uint32_t, std::vector<Outgoing>> waiting_ GUARDED_BY(mu_);  // for address
  std::unordered_map<uint32_t, Clock::time_point> asked_ GUARDED_BY(mu_);  // lookups, when
  uint32_t connecting_ GUARDED_BY(mu_) = 0;  // Connect() calls under way (OnAddress)
  std::unordered_map<transport::PeerId, Status> early_failures_ GUARDED_BY(mu_);
  std::unordered_map<uint32_t, Status> down_ GUARDED_BY(mu_);  // peers whose endpoint failed
  Status failed_ GUARDED_BY(mu_);  // FailAll's
  // Cells of sends announced for a direct read (their addresses are stable: a deque), and those
  // free for the next one; a cell holds its send's nonce while the send lives, else 0.
  std::deque<std::atomic<uint64_t>> cells_ GUARDED_BY(mu_);
  std::vector<std::atomic<uint64_t>*> free_cells_ GUARDED_BY(mu_);
  const uint64_t nonce_salt_;  // random, per link
  Counts counts_ GUARDED_BY(mu_);
};

}  // namespace gradlink
