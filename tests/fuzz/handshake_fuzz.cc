// Fuzz target: the authentication handshake (src/security/handshake.h). The input plays the
// peer of one ServerHandshake (scheduler) or ClientHandshake (member) holding a fixed secret.
// Every step is checked against a reference model written from the spec in handshake.h, with the
// MACs computed here independently (OpenSSL HMAC over our own transcript encoding), so:
//   - a machine accepts a step exactly when the spec says so, and emits exactly the honest
//     answer (nonce || MAC, proof, kAuthOk);
//   - it reaches done() only if the peer's MAC was the one computed with the secret (the fuzzer
//     cannot forge one, so done() is reachable only from seeds that carry an honest MAC);
//   - every refused step leaves it failed(), and once failed it stays failed.
//
// Input layout:
//   byte 0   mode: bit 0 client (else server); client only: bit 1 role server (else worker),
//            bit 2 rank 5 (else -1), bit 3 skip the initial Start()
//   then up to kMaxSteps steps, each [op][len][len payload bytes (fewer at the end of input)]:
//     op 0xff         client: call Start() again (server: a frame of type 0x7f)
//     op < 0x80       a frame of type kHello + op % 4 (kHello, kChallenge, kProof, kAuthOk)
//     op 0x80..0xfe   a frame of raw type op & 0x7f (any value, valid or not)
#include <openssl/evp.h>
#include <openssl/hmac.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "security/handshake.h"

namespace {

namespace sec = gradlink::security;
namespace wire = gradlink::wire;
using Bytes = std::vector<std::byte>;

constexpr std::string_view kSecret = "fuzz-job-secret-0123456789";
constexpr uint32_t kJobHash = 0x12345678u;
constexpr uint64_t kEpoch = 7;
constexpr int kMaxSteps = 16;

sec::Nonce Fill(uint8_t v) {
  sec::Nonce n;
  n.fill(std::byte{v});
  return n;
}
const sec::Nonce kServerNonce = Fill(0x22);
const sec::Nonce kClientNonce = Fill(0x11);

void Check(bool ok, const char* what) {
  if (!ok) {
    std::fprintf(stderr, "handshake_fuzz: invariant violated: %s\n", what);
    std::abort();
  }
}

void PutLe(Bytes& out, uint64_t v, int n) {
  for (int i = 0; i < n; ++i) out.push_back(std::byte(static_cast<uint8_t>(v >> (8 * i))));
}

// HMAC-SHA256(secret, label || job u32 || nonce_c || nonce_s || role u8 || rank i32 || epoch u64),
// written from the spec, independent of security::ComputeMac.
Bytes RefMac(std::string_view label, uint8_t role, int32_t rank, const sec::Nonce& nc,
             const sec::Nonce& ns) {
  Bytes msg;
  for (char c : label) msg.push_back(std::byte(static_cast<uint8_t>(c)));
  PutLe(msg, kJobHash, 4);
  msg.insert(msg.end(), nc.begin(), nc.end());
  msg.insert(msg.end(), ns.begin(), ns.end());
  PutLe(msg, role, 1);
  PutLe(msg, static_cast<uint32_t>(rank), 4);
  PutLe(msg, kEpoch, 8);
  Bytes mac(32);
  unsigned int len = 0;
  HMAC(EVP_sha256(), kSecret.data(), static_cast<int>(kSecret.size()),
       reinterpret_cast<const unsigned char*>(msg.data()), msg.size(),
       reinterpret_cast<unsigned char*>(mac.data()), &len);
  Check(len == 32, "reference HMAC length");
  return mac;
}

// GRADLINK_FUZZ_TRACE=1: say how far each input got (to check that seeds reach success).
bool Trace() {
  static const bool on = std::getenv("GRADLINK_FUZZ_TRACE") != nullptr;
  return on;
}

bool Eq(std::span<const std::byte> a, std::span<const std::byte> b) {
  return a.size() == b.size() && std::equal(a.begin(), a.end(), b.begin());
}

struct Step {
  bool start = false;  // client: call Start()
  wire::MsgType type{};
  std::span<const std::byte> payload;
};

std::vector<Step> Decode(const uint8_t* data, size_t size) {
  std::vector<Step> steps;
  size_t i = 1;
  while (i < size && steps.size() < kMaxSteps) {
    const uint8_t op = data[i++];
    const size_t want = i < size ? data[i++] : 0;
    const size_t len = std::min(want, size - i);
    Step s;
    s.start = op == 0xff;
    s.type = static_cast<wire::MsgType>(op < 0x80 ? 13 + op % 4 : op & 0x7f);
    s.payload = std::span(reinterpret_cast<const std::byte*>(data + i), len);
    i += len;
    steps.push_back(s);
  }
  return steps;
}

// ---- The scheduler's side ----------------------------------------------------------------------

void RunServer(const std::vector<Step>& steps) {
  sec::ServerHandshake hs(std::string(kSecret), kJobHash, kEpoch, kServerNonce);
  enum { kNew, kSentChallenge, kDone, kFailed } model = kNew;
  sec::Nonce nc{};
  uint8_t role = 0;
  int32_t rank = 0;
  bool proof_seen = false;  // a kProof equal to the honest member MAC was fed
  for (const Step& s : steps) {
    const auto out = hs.Step(s.type, s.payload);
    bool expect_ok = false;
    switch (model) {
      case kNew: {
        if (s.type == wire::MsgType::kHello && s.payload.size() == sec::kHelloBytes) {
          std::memcpy(nc.data(), s.payload.data(), 32);
          role = std::to_integer<uint8_t>(s.payload[32]);
          uint32_t r = 0;
          for (int k = 0; k < 4; ++k) r |= std::to_integer<uint32_t>(s.payload[33 + k]) << (8 * k);
          rank = static_cast<int32_t>(r);
          expect_ok = (role == 1 || role == 2) && rank >= -1 && nc != kServerNonce;
        }
        if (expect_ok) {
          Check(out.ok(), "a valid kHello was refused");
          Check(out->type == wire::MsgType::kChallenge, "kHello not answered by kChallenge");
          Bytes want(kServerNonce.begin(), kServerNonce.end());
          const Bytes mac = RefMac(sec::kSchedulerLabel, role, rank, nc, kServerNonce);
          want.insert(want.end(), mac.begin(), mac.end());
          Check(Eq(out->payload, want), "kChallenge is not nonce_s || MAC_s of the spec");
          model = kSentChallenge;
        }
        break;
      }
      case kSentChallenge:
        if (s.type == wire::MsgType::kProof) {
          expect_ok = Eq(s.payload, RefMac(sec::kMemberLabel, role, rank, nc, kServerNonce));
        }
        if (expect_ok) {
          Check(out.ok(), "the honest member proof was refused");
          Check(out->type == wire::MsgType::kAuthOk && out->payload.empty(), "bad kAuthOk");
          proof_seen = true;
          model = kDone;
        }
        break;
      case kDone:
      case kFailed:
        break;
    }
    if (!expect_ok) {
      Check(!out.ok(), "the server accepted a step the spec refuses (forged or malformed)");
      Check(out.status().code() == gradlink::Code::kAuthFailed, "refusal is not kAuthFailed");
      model = kFailed;
    }
    Check(hs.failed() == (model == kFailed), "server failed() disagrees with the model");
    Check(hs.done() == (model == kDone), "server done() disagrees with the model");
    Check(!hs.done() || proof_seen, "server done without the honest member MAC");
    if (hs.done()) {
      Check(static_cast<uint8_t>(hs.role()) == role && hs.rank() == rank,
            "server reports a role/rank other than the proven one");
    }
  }
  if (Trace()) std::fprintf(stderr, "server: proof_seen=%d failed=%d\n", proof_seen, hs.failed());
}

// ---- The member's side -------------------------------------------------------------------------

void RunClient(uint8_t mode, const std::vector<Step>& steps) {
  sec::HandshakeBinding b;
  b.job_hash = kJobHash;
  b.epoch = kEpoch;
  b.role = (mode & 2) ? wire::Role::kServer : wire::Role::kWorker;
  b.rank = (mode & 4) ? 5 : -1;
  const uint8_t role = static_cast<uint8_t>(b.role);
  sec::ClientHandshake hs(std::string(kSecret), b, kClientNonce);
  enum { kNew, kSentHello, kSentProof, kDone, kFailed } model = kNew;
  bool mac_seen = false;  // a kChallenge carrying the honest scheduler MAC was fed

  auto check_state = [&] {
    Check(hs.failed() == (model == kFailed), "client failed() disagrees with the model");
    Check(hs.done() == (model == kDone), "client done() disagrees with the model");
    Check(!hs.done() || mac_seen, "client done without the honest scheduler MAC");
  };
  auto start = [&] {
    const auto out = hs.Start();
    if (model == kNew) {
      Check(out.ok() && out->type == wire::MsgType::kHello, "Start() did not give kHello");
      Bytes want(kClientNonce.begin(), kClientNonce.end());
      PutLe(want, role, 1);
      PutLe(want, static_cast<uint32_t>(b.rank), 4);
      Check(Eq(out->payload, want), "kHello is not nonce_c || role || rank");
      model = kSentHello;
    } else {
      Check(!out.ok(), "Start() twice accepted");
      model = kFailed;
    }
    check_state();
  };

  if (!(mode & 8)) start();
  for (const Step& s : steps) {
    if (s.start) {
      start();
      continue;
    }
    const auto out = hs.Step(s.type, s.payload);
    bool expect_ok = false;
    switch (model) {
      case kSentHello:
        if (s.type == wire::MsgType::kChallenge && s.payload.size() == sec::kChallengeBytes) {
          sec::Nonce ns;
          std::memcpy(ns.data(), s.payload.data(), 32);
          expect_ok = ns != kClientNonce &&
                      Eq(s.payload.subspan(32),
                         RefMac(sec::kSchedulerLabel, role, b.rank, kClientNonce, ns));
          if (expect_ok) {
            Check(out.ok() && out->has_value(), "the honest kChallenge was refused");
            Check((*out)->type == wire::MsgType::kProof, "kChallenge not answered by kProof");
            Check(Eq((*out)->payload, RefMac(sec::kMemberLabel, role, b.rank, kClientNonce, ns)),
                  "kProof is not MAC_c of the spec");
            mac_seen = true;
            model = kSentProof;
          }
        }
        break;
      case kSentProof:
        expect_ok = s.type == wire::MsgType::kAuthOk && s.payload.empty();
        if (expect_ok) {
          Check(out.ok() && !out->has_value(), "kAuthOk refused or answered");
          model = kDone;
        }
        break;
      case kNew:
      case kDone:
      case kFailed:
        break;
    }
    if (!expect_ok) {
      Check(!out.ok(), "the client accepted a step the spec refuses (forged or malformed)");
      Check(out.status().code() == gradlink::Code::kAuthFailed, "refusal is not kAuthFailed");
      model = kFailed;
    }
    check_state();
  }
  if (Trace()) std::fprintf(stderr, "client: mac_seen=%d done=%d\n", mac_seen, hs.done());
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 1) return 0;
  const std::vector<Step> steps = Decode(data, size);
  if (data[0] & 1) {
    RunClient(data[0], steps);
  } else {
    RunServer(steps);
  }
  return 0;
}
