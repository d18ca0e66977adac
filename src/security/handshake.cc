#include "security/handshake.h"

#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>
#include <openssl/rand.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "wire/codec.h"

namespace gradlink::security {
namespace {

Status AuthFailed(std::string msg) { return Status(Code::kAuthFailed, std::move(msg)); }

std::string TypeName(wire::MsgType t) { return "type " + std::to_string(static_cast<int>(t)); }

bool ValidRole(uint8_t r) {
  return r == static_cast<uint8_t>(wire::Role::kWorker) ||
         r == static_cast<uint8_t>(wire::Role::kServer);
}

void PutRaw(wire::Writer& w, std::span<const std::byte> b) {
  for (std::byte x : b) w.U8(std::to_integer<uint8_t>(x));
}

bool GetRaw(wire::Reader& r, std::span<std::byte> out) {
  for (std::byte& x : out) {
    uint8_t v;
    if (!r.U8(&v)) return false;
    x = std::byte{v};
  }
  return true;
}

bool MacEqual(const Mac& a, std::span<const std::byte> b) {
  return b.size() == a.size() && CRYPTO_memcmp(a.data(), b.data(), a.size()) == 0;
}

}  // namespace

bool IsHandshakeType(wire::MsgType t) {
  return t == wire::MsgType::kHello || t == wire::MsgType::kChallenge ||
         t == wire::MsgType::kProof || t == wire::MsgType::kAuthOk;
}

Nonce RandomNonce() {
  Nonce n;
  if (RAND_bytes(reinterpret_cast<unsigned char*>(n.data()), static_cast<int>(n.size())) != 1) {
    std::fprintf(stderr, "gradlink: RAND_bytes failed: no entropy for a handshake nonce\n");
    std::abort();
  }
  return n;
}

Mac ComputeMac(std::string_view secret, std::string_view label, const HandshakeBinding& b,
               const Nonce& nonce_c, const Nonce& nonce_s) {
  wire::Writer w;
  PutRaw(w, std::as_bytes(std::span(label.data(), label.size())));
  w.U32(b.job_hash);
  PutRaw(w, nonce_c);
  PutRaw(w, nonce_s);
  w.U8(static_cast<uint8_t>(b.role));
  w.I32(b.rank);
  w.U64(b.epoch);
  const std::vector<std::byte>& msg = w.buffer();
  Mac mac{};
  unsigned int len = 0;
  const unsigned char* out =
      HMAC(EVP_sha256(), secret.data(), static_cast<int>(secret.size()),
           reinterpret_cast<const unsigned char*>(msg.data()), msg.size(),
           reinterpret_cast<unsigned char*>(mac.data()), &len);
  if (out == nullptr || len != mac.size()) {
    std::fprintf(stderr, "gradlink: HMAC-SHA256 failed\n");
    std::abort();
  }
  return mac;
}

// ---- Client -------------------------------------------------------------------------------------

ClientHandshake::ClientHandshake(std::string secret, const HandshakeBinding& binding)
    : ClientHandshake(std::move(secret), binding, RandomNonce()) {}

ClientHandshake::ClientHandshake(std::string secret, const HandshakeBinding& binding,
                                 const Nonce& nonce)
    : secret_(std::move(secret)), binding_(binding), nonce_c_(nonce) {}

Status ClientHandshake::Fail(std::string why) {
  state_ = State::kFailed;
  return AuthFailed(std::move(why));
}

Result<HandshakeMessage> ClientHandshake::Start() {
  if (state_ != State::kNew) return Fail("handshake started twice");
  wire::Writer w;
  PutRaw(w, nonce_c_);
  w.U8(static_cast<uint8_t>(binding_.role));
  w.I32(binding_.rank);
  state_ = State::kSentHello;
  return HandshakeMessage{wire::MsgType::kHello, w.Take()};
}

Result<std::optional<HandshakeMessage>> ClientHandshake::Step(wire::MsgType type,
                                                             std::span<const std::byte> payload) {
  switch (state_) {
    case State::kSentHello: {
      if (type != wire::MsgType::kChallenge) {
        return Fail("expected the scheduler's challenge, got " + TypeName(type));
      }
      if (payload.size() != kChallengeBytes) {
        return Fail("challenge of " + std::to_string(payload.size()) + " bytes (expected " +
                    std::to_string(kChallengeBytes) + ")");
      }
      Nonce nonce_s;
      std::memcpy(nonce_s.data(), payload.data(), kNonceBytes);
      if (nonce_s == nonce_c_) return Fail("the scheduler echoed our nonce");
      const Mac expected = ComputeMac(secret_, kSchedulerLabel, binding_, nonce_c_, nonce_s);
      if (!MacEqual(expected, payload.subspan(kNonceBytes))) {
        return Fail("the scheduler's proof does not verify: it holds another job secret");
      }
      const Mac proof = ComputeMac(secret_, kMemberLabel, binding_, nonce_c_, nonce_s);
      state_ = State::kSentProof;
      return std::optional<HandshakeMessage>(
          HandshakeMessage{wire::MsgType::kProof, std::vector<std::byte>(proof.begin(), proof.end())});
    }
    case State::kSentProof:
      if (type != wire::MsgType::kAuthOk) {
        return Fail("expected the scheduler's kAuthOk, got " + TypeName(type));
      }
      if (!payload.empty()) return Fail("kAuthOk with a payload");
      state_ = State::kDone;
      return std::optional<HandshakeMessage>();
    case State::kNew:
      return Fail("frame before the handshake started");
    case State::kDone:
      return Fail("frame after the handshake finished");
    case State::kFailed:
      break;
  }
  return Fail("handshake already failed");
}

// ---- Server -------------------------------------------------------------------------------------

ServerHandshake::ServerHandshake(std::string secret, uint32_t job_hash, uint64_t epoch)
    : ServerHandshake(std::move(secret), job_hash, epoch, RandomNonce()) {}

ServerHandshake::ServerHandshake(std::string secret, uint32_t job_hash, uint64_t epoch,
                                 const Nonce& nonce)
    : secret_(std::move(secret)), nonce_s_(nonce) {
  binding_.job_hash = job_hash;
  binding_.epoch = epoch;
}

Status ServerHandshake::Fail(std::string why) {
  state_ = State::kFailed;
  return AuthFailed(std::move(why));
}

Result<HandshakeMessage> ServerHandshake::Step(wire::MsgType type,
                                               std::span<const std::byte> payload) {
  switch (state_) {
    case State::kNew: {
      if (type != wire::MsgType::kHello) {
        return Fail("expected kHello (this scheduler requires the job secret), got " +
                    TypeName(type));
      }
      if (payload.size() != kHelloBytes) {
        return Fail("kHello of " + std::to_string(payload.size()) + " bytes (expected " +
                    std::to_string(kHelloBytes) + ")");
      }
      wire::Reader r(payload);
      uint8_t role = 0;
      int32_t rank = 0;
      if (!GetRaw(r, nonce_c_) || !r.U8(&role) || !r.I32(&rank) || !r.Done()) {
        return Fail("malformed kHello");
      }
      if (!ValidRole(role)) return Fail("kHello with an invalid role " + std::to_string(role));
      if (rank < -1) return Fail("kHello with an invalid rank " + std::to_string(rank));
      if (nonce_c_ == nonce_s_) return Fail("the member echoed our nonce");
      binding_.role = static_cast<wire::Role>(role);
      binding_.rank = rank;
      const Mac mac = ComputeMac(secret_, kSchedulerLabel, binding_, nonce_c_, nonce_s_);
      std::vector<std::byte> out(nonce_s_.begin(), nonce_s_.end());
      out.insert(out.end(), mac.begin(), mac.end());
      state_ = State::kSentChallenge;
      return HandshakeMessage{wire::MsgType::kChallenge, std::move(out)};
    }
    case State::kSentChallenge: {
      if (type != wire::MsgType::kProof) return Fail("expected kProof, got " + TypeName(type));
      if (payload.size() != kProofBytes) {
        return Fail("kProof of " + std::to_string(payload.size()) + " bytes (expected " +
                    std::to_string(kProofBytes) + ")");
      }
      const Mac expected = ComputeMac(secret_, kMemberLabel, binding_, nonce_c_, nonce_s_);
      if (!MacEqual(expected, payload)) {
        return Fail("the member's proof does not verify: wrong job secret");
      }
      state_ = State::kDone;
      return HandshakeMessage{wire::MsgType::kAuthOk, {}};
    }
    case State::kDone:
      return Fail("frame after the handshake finished");
    case State::kFailed:
      break;
  }
  return Fail("handshake already failed");
}

}  // namespace gradlink::security
