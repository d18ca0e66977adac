#include "security/lane_auth.h"

#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>
#include <openssl/sha.h>

namespace gradlink::security {
namespace {

constexpr char kLabel[] = "gradlink-v1 lane";

}  // namespace

std::vector<std::byte> LaneAuthenticator::Prove(std::span<const std::byte> remote_address) const {
  unsigned char digest[SHA256_DIGEST_LENGTH];
  SHA256(reinterpret_cast<const unsigned char*>(remote_address.data()), remote_address.size(),
         digest);
  std::vector<unsigned char> msg(kLabel, kLabel + sizeof(kLabel) - 1);
  for (int i = 0; i < 4; ++i) msg.push_back(static_cast<unsigned char>(job_hash_ >> (8 * i)));
  msg.insert(msg.end(), digest, digest + sizeof(digest));
  std::vector<std::byte> mac(EVP_MAX_MD_SIZE);
  unsigned int len = 0;
  HMAC(EVP_sha256(), secret_.data(), static_cast<int>(secret_.size()), msg.data(), msg.size(),
       reinterpret_cast<unsigned char*>(mac.data()), &len);
  mac.resize(len);
  return mac;
}

bool LaneAuthenticator::Verify(std::span<const std::byte> local_address,
                               std::span<const std::byte> proof) const {
  const std::vector<std::byte> want = Prove(local_address);
  return proof.size() == want.size() && !want.empty() &&
         CRYPTO_memcmp(proof.data(), want.data(), want.size()) == 0;
}

}  // namespace gradlink::security
