// The job secret: a shared key that every member of a job and its scheduler hold.
//
// Read from the environment: GRADLINK_SECRET (the secret itself) or GRADLINK_SECRET_FILE (a file
// that holds it, owned by this user and readable by nobody else). Launchers (gradlink-run,
// gradlink-bench's local mode) generate one per job and hand it to their children. See
// docs/security.md.
#pragma once

#include <optional>
#include <string>

#include "gradlink/status.h"

namespace gradlink::security {

inline constexpr size_t kMinSecretBytes = 16;
inline constexpr size_t kMaxSecretBytes = 4096;

struct Secret {
  std::string value;  // never logged
};

// GRADLINK_SECRET if set, else the contents of GRADLINK_SECRET_FILE (one trailing newline, or
// CRLF, stripped), else nullopt. kInvalidArgument when the secret is shorter than
// kMinSecretBytes or longer than kMaxSecretBytes, or when the file cannot be read, is not a
// regular file, is owned by another user or has any group/other permission bit (the message
// names the file and its mode).
Result<std::optional<Secret>> LoadSecret();

// The same checks on explicit values (LoadSecret() is these on the environment).
Result<Secret> SecretFromString(std::string value);
Result<Secret> SecretFromFile(const std::string& path);

// 32 random bytes (RAND_bytes), hex-encoded: 64 characters.
Secret Generate();

}  // namespace gradlink::security
