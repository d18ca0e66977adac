// Mutual HMAC-SHA256 challenge-response between a member (client) and the scheduler (server).
//
// Pure and I/O-free: each side is a small state machine fed the (type, payload) of every frame
// it receives, answering the frame to send back (if any). Nothing here touches a socket, so it
// can be driven by tests and fuzzers directly. The exchange (docs/wire_format.md, docs/security.md):
//
//   member    -> scheduler  kHello      nonce_c[32] role u8 rank i32
//   scheduler -> member     kChallenge  nonce_s[32] MAC_s[32]
//   member    -> scheduler  kProof      MAC_c[32]
//   scheduler -> member     kAuthOk     (empty)
//
//   MAC_s = HMAC-SHA256(secret, "gradlink-v1 scheduler" || T)
//   MAC_c = HMAC-SHA256(secret, "gradlink-v1 member"    || T)
//   T     = job hash u32 || nonce_c || nonce_s || role u8 || rank i32 || epoch u64  (little-endian)
//
// Distinct labels per direction defeat reflection (the scheduler's MAC is never a valid member
// proof); both sides contribute a fresh random nonce, so no transcript can be replayed. Every
// payload has an exact size; any deviation (wrong type, size, order, MAC) is kAuthFailed, after
// which the machine stays failed.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "gradlink/status.h"
#include "wire/frame.h"
#include "wire/messages.h"

namespace gradlink::security {

inline constexpr size_t kNonceBytes = 32;
inline constexpr size_t kMacBytes = 32;
inline constexpr size_t kHelloBytes = kNonceBytes + 1 + 4;
inline constexpr size_t kChallengeBytes = kNonceBytes + kMacBytes;
inline constexpr size_t kProofBytes = kMacBytes;
// The largest handshake payload; a receiver refuses bigger frames before reading them.
inline constexpr size_t kMaxHandshakePayload = kChallengeBytes;

using Nonce = std::array<std::byte, kNonceBytes>;
using Mac = std::array<std::byte, kMacBytes>;

// One frame to send: the type and payload (the caller fills the rest of the header).
struct HandshakeMessage {
  wire::MsgType type{};
  std::vector<std::byte> payload;
};

// The fields both MACs cover besides the nonces.
struct HandshakeBinding {
  uint32_t job_hash = 0;
  wire::Role role = wire::Role::kWorker;
  int32_t rank = -1;   // the rank the member will ask for (-1: any)
  uint64_t epoch = 0;  // membership epoch; 0 until epochs exist
};

// HMAC-SHA256(secret, label || T) for the transcript above.
Mac ComputeMac(std::string_view secret, std::string_view label, const HandshakeBinding& b,
               const Nonce& nonce_c, const Nonce& nonce_s);

inline constexpr std::string_view kSchedulerLabel = "gradlink-v1 scheduler";
inline constexpr std::string_view kMemberLabel = "gradlink-v1 member";

// A fresh random nonce (RAND_bytes).
Nonce RandomNonce();

// The member's side.
class ClientHandshake {
 public:
  ClientHandshake(std::string secret, const HandshakeBinding& binding);
  // For tests: a fixed nonce instead of a random one.
  ClientHandshake(std::string secret, const HandshakeBinding& binding, const Nonce& nonce);

  // The first message (kHello). Once only.
  Result<HandshakeMessage> Start();
  // Feeds a received frame: kChallenge -> the kProof to send; kAuthOk -> nullopt, done().
  Result<std::optional<HandshakeMessage>> Step(wire::MsgType type,
                                              std::span<const std::byte> payload);
  bool done() const { return state_ == State::kDone; }
  bool failed() const { return state_ == State::kFailed; }

 private:
  enum class State { kNew, kSentHello, kSentProof, kDone, kFailed };
  Status Fail(std::string why);
  std::string secret_;
  HandshakeBinding binding_;
  Nonce nonce_c_;
  State state_ = State::kNew;
};

// The scheduler's side.
class ServerHandshake {
 public:
  ServerHandshake(std::string secret, uint32_t job_hash, uint64_t epoch = 0);
  ServerHandshake(std::string secret, uint32_t job_hash, uint64_t epoch, const Nonce& nonce);

  // Feeds a received frame: kHello -> the kChallenge to send; kProof -> the kAuthOk to send,
  // done(). Returns kAuthFailed on anything else.
  Result<HandshakeMessage> Step(wire::MsgType type, std::span<const std::byte> payload);
  bool done() const { return state_ == State::kDone; }
  bool failed() const { return state_ == State::kFailed; }
  // What the member proved it holds the secret for (valid once done()).
  wire::Role role() const { return binding_.role; }
  int32_t rank() const { return binding_.rank; }

 private:
  enum class State { kNew, kSentChallenge, kDone, kFailed };
  Status Fail(std::string why);
  std::string secret_;
  HandshakeBinding binding_;
  Nonce nonce_s_;
  Nonce nonce_c_{};
  State state_ = State::kNew;
};

// True when `t` is one of the four handshake types.
bool IsHandshakeType(wire::MsgType t);

}  // namespace gradlink::security
