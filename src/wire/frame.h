// The one frame header of every gradlink message, its codec and its validation.
//
// Pure functions, no I/O: everything a peer sends passes through DecodeHeader() before any other
// code looks at it. A header that fails validation is a kProtocolError; the caller closes that
// connection and counts it. Layout (little-endian, 64 bytes) is documented in docs/wire_format.md.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <span>

#include "gradlink/status.h"
#include "gradlink/tensor.h"

namespace gradlink::wire {

inline constexpr uint32_t kMagic = 0x314B4C47;  // "GLK1" little-endian
inline constexpr uint8_t kVersion = 2;
inline constexpr size_t kHeaderSize = 64;

// Upper bounds on payloads a receiver accepts. Data frames carry one partition.
inline constexpr uint64_t kMaxControlPayload = 1u << 20;        // 1 MiB
inline constexpr uint64_t kMaxDataPayload = uint64_t{1} << 30;  // 1 GiB per partition
inline constexpr uint64_t kMaxLaneHelloPayload = 64;
// Point-to-point: the largest message sent at once (kPeerData without kFlagCleared); larger
// ones are announced (kPeerReady), and an announced one is larger.
inline constexpr uint64_t kPeerEagerBytes = 64 * 1024;
// A kPeerReady's payload when the receiver may read the message from the sender's memory.
inline constexpr uint64_t kPeerLocalBytes = 32;

// Sender id used by the scheduler.
inline constexpr uint32_t kSchedulerId = 0xFFFFFFFFu;

enum class MsgType : uint8_t {
  // Control plane (TCP, scheduler <-> members).
  kRegister = 1,       // member -> scheduler: role, addresses
  kWelcome = 2,        // scheduler -> member: your id + the address book
  kDeclare = 3,        // worker -> scheduler: key, name, dtype, count
  kAssign = 4,         // scheduler -> servers (acked) and workers: partitions of a key
  kAssignAck = 5,      // server -> scheduler
  kBarrier = 6,        // worker -> scheduler
  kBarrierRelease = 7, // scheduler -> worker
  kGoodbye = 8,        // member -> scheduler: I am done (clean leave)
  kShutdown = 9,       // scheduler -> members: the job is over
  kAbort = 10,         // scheduler -> members: the job failed (status code + message)
  kHeartbeat = 11,     // both ways, every kHeartbeatInterval once the job has started
  kMemberLeft = 12,    // scheduler -> servers: worker `count` left cleanly before the others
  // Authentication handshake (src/security/handshake.h), first on a connection when the
  // scheduler holds a job secret.
  kHello = 13,         // member -> scheduler: nonce_c, role, requested rank
  kChallenge = 14,     // scheduler -> member: nonce_s, MAC_s
  kProof = 15,         // member -> scheduler: MAC_c
  kAuthOk = 16,        // scheduler -> member: proof accepted
  // Join (Worker::Join, Horovod's hvd.join): ranks that ran out of data.
  kJoin = 17,          // worker -> scheduler: this rank joined (JoinMsg: its tensors' rounds)
  kJoined = 18,        // scheduler -> servers, then that worker: worker `count` joined (recorded):
                       // absent from later rounds
  // Every rank joined. scheduler -> servers: forget who joined (each server echoes it back
  // once it has); then scheduler -> workers: the rank that joined last (`count`) and where
  // every key's rounds stand (JoinMsg), so that a rank that sat rounds out resumes in step.
  kJoinRelease = 19,
  // Failover: scheduler -> workers: server `count` is lost; each key with partitions on it
  // follows as a kAssign with kFlagReplan, once the servers that take them over have acked.
  kServerLost = 20,
  // scheduler -> workers: a server joined as a standby (before the job started, or later, to a
  // running job): `count` is its id, the payload its address-book entry (wire::EncodeMember). It has no
  // partitions until it takes over a lost server's (kServerLost, then kAssign with kFlagReplan).
  kServerJoined = 21,
  // Restart: worker -> a restarted scheduler, after its kRegister with ResumeState: one tensor
  // it declared and the plan it has for it (wire::ResumeKeyMsg), before the welcome.
  kResumeKey = 22,
  // A tensor's name declared again with another shape, dtype or collective (a name is a label
  // per call, as Horovod's are): worker -> scheduler, this worker is done with `key`, the earlier
  // declaration's (it runs no op of it again); once every worker that declared it is, scheduler
  // -> the servers that sum it: forget it (its partitions and their buffers).
  kRetire = 23,
  // Point-to-point (worker/peer_link.h): worker -> scheduler, the reply lane of worker `count`
  // please; scheduler -> worker, that address as the payload (or `code` and a reason when
  // there is no such worker).
  kPeerLookup = 24,
  kPeerAddress = 25,
  // The stall inspector (docs/operations.md, "Watching a job"): server -> scheduler, rounds
  // some workers pushed and others not (wire::StalledRound); scheduler -> the workers that
  // have pushed or declared, the inspector's message (text) to log.
  kStallReport = 26,
  kStallNotice = 27,
  // Data plane (transport lanes).
  kPush = 32,          // worker -> server: one partition of one round (+ pull request)
  kPullResponse = 33,  // server -> worker: the round's result for that partition
  kDataError = 34,     // server -> worker: the partition's round failed (status + message)
  kLaneHello = 35,     // first frame on a data endpoint of an authenticated job (lane_auth.h)
  // worker -> the server that took over a lost server's partition: this worker's standing on
  // it (PartitionState::BeginRecover): with kFlagHasResult, the result of `round`, the last
  // round it received; else `round` is the round it pushes next. kFlagInputFollows: its push
  // of that round follows.
  kRecover = 36,
  // Point-to-point between workers (worker/peer_link.h), on the lanes the workers already
  // have: sent from the push lane to the peer's reply lane. `key` is the channel (a process
  // group), `partition` the tag, `round` the message's number in its (sender, channel, tag)
  // stream, `cookie` the sender's send, `count` the message's bytes, bytes 30-31 the caller's
  // element type (`element`).
  kPeerData = 37,   // the message (kFlagCleared: answering a kPeerClear; else sent eagerly)
  kPeerReady = 38,  // a message too big to send eagerly is ready: its size; from a worker on
                    // the receiver's host, where to read it (kPeerLocalBytes, peer_link.h)
  kPeerClear = 39,  // receiver -> sender: a recv matched your kPeerReady, send the data
  kPeerAck = 40,    // receiver -> sender: a recv matched your eager kPeerData (`code` 0), or
                    // refused your message (`code`, and the reason as the payload)
};

// A duration in microseconds in 16 bits: a 12-bit mantissa and a 4-bit exponent (m << e), so
// 0-4095 us exactly and up to 134 s within 0.05%; longer saturates.
uint16_t EncodeServerTime(uint64_t micros);
uint64_t DecodeServerTime(uint16_t code);

bool IsControlType(MsgType t);
bool IsDataType(MsgType t);
// kPeerData, kPeerReady, kPeerClear, kPeerAck.
bool IsPeerType(MsgType t);

// Flag bits.
inline constexpr uint16_t kFlagAverage = 1u << 0;  // kPush: divide the sum by the worker count
// kPush of a host's partial sum: the workers of that host disagreed on averaging (the server
// fails the round with kMismatch for every host, so no host keeps a sum the others refuse).
inline constexpr uint16_t kFlagHostDisagrees = 1u << 1;
// kAssign to a key's members after a server was lost: the key's partitions that lay on it
// have moved (the offsets and counts are unchanged).
inline constexpr uint16_t kFlagReplan = 1u << 2;
// kRecover: the payload is the result of `round` / the worker's push of that round follows.
inline constexpr uint16_t kFlagHasResult = 1u << 3;
inline constexpr uint16_t kFlagInputFollows = 1u << 4;
// kPeerData: the data of a message whose kPeerReady a receiver cleared.
inline constexpr uint16_t kFlagCleared = 1u << 5;
inline constexpr uint16_t kKnownFlags = kFlagAverage | kFlagHostDisagrees | kFlagReplan |
                                        kFlagHasResult | kFlagInputFollows | kFlagCleared;

struct Header {
  MsgType type{};
  uint16_t flags = 0;
  uint32_t job = 0;         // hash of the job name; every frame of a job carries it
  uint32_t sender = 0;      // worker rank, server id, or kSchedulerId
  uint64_t key = 0;         // tensor key (hash of job and name)
  uint32_t partition = 0;   // partition index within the key
  uint8_t dtype = 0;        // DataType on data frames, 0 on control frames
  uint8_t code = 0;         // Code on kAbort / kDataError, else 0
  // kPullResponse: the server's own time on the round, from its last push landing to the
  // reply being sent (EncodeServerTime). Same bytes as `ranks`; 0 on every other frame.
  uint16_t server_time = 0;
  // kPush of a host's partial sum: how many of the host's workers it sums, when some sat the
  // round out (they had joined: Worker::Join); 0: all of them. Same bytes as `server_time`; 0
  // on every other frame.
  uint16_t ranks = 0;
  // kPeerData / kPeerReady: the element type the sender's caller gave (compared with the
  // receiver's, opaque to gradlink). Same bytes; 0 on every other frame.
  uint16_t element = 0;
  uint64_t round = 0;       // round number on data frames
  uint64_t count = 0;       // elements in the payload (data frames)
  uint64_t payload_bytes = 0;
  uint64_t cookie = 0;      // opaque to the receiver, echoed in the reply
};

using HeaderBytes = std::array<std::byte, kHeaderSize>;

HeaderBytes EncodeHeader(const Header& h);

// Decodes and validates a header: magic, version, type, flags, reserved bytes, dtype and code
// ranges, payload bounds for the type, and for data frames count * dtype size == payload_bytes
// (computed without overflow). `bytes` must hold at least kHeaderSize bytes.
Result<Header> DecodeHeader(std::span<const std::byte> bytes);

// Element count that fits in `bytes` of `dtype`; payload_bytes / size with overflow checks.
// Returns kProtocolError when the product of count and size would not fit or differs.
Status CheckDataShape(DataType dtype, uint64_t count, uint64_t payload_bytes);

// 32-bit and 64-bit FNV-1a hashes; stable across runs, platforms and versions.
uint32_t JobHash(std::string_view job);
uint64_t TensorKey(std::string_view job, std::string_view name);

}  // namespace gradlink::wire
