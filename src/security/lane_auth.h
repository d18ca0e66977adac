// Membership proof for data-lane connections.
//
// The first frame on every data endpoint is a kLaneHello carrying
//   HMAC-SHA256(secret, "gradlink-v1 lane" ‖ job hash ‖ SHA-256(receiving lane's address)).
// A lane with an authenticator processes nothing else from a connection until its hello has
// verified. The proof is bound to the receiving lane (a UCX worker address is unique to one
// process and lane), so it cannot be moved to another lane or job; it can be replayed to the
// same lane by someone who sees the traffic, which on an unencrypted data path could read and
// rewrite frames anyway (docs/security.md). It keeps off-path hosts from injecting frames.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

namespace gradlink::security {

class LaneAuthenticator {
 public:
  LaneAuthenticator(std::string secret, uint32_t job_hash)
      : secret_(std::move(secret)), job_hash_(job_hash) {}

  // The hello payload for a connection to the lane at `remote_address`.
  std::vector<std::byte> Prove(std::span<const std::byte> remote_address) const;

  // True when `proof` is the hello for the lane at `local_address` (constant-time compare).
  bool Verify(std::span<const std::byte> local_address, std::span<const std::byte> proof) const;

 private:
  const std::string secret_;
  const uint32_t job_hash_;
};

}  // namespace gradlink::security
