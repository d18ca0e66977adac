#include "security/secret.h"

#include "common/env.h"

#include <fcntl.h>
#include <openssl/rand.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>

namespace gradlink::security {
namespace {

std::string OctalMode(mode_t m) {
  char buf[16];
  std::snprintf(buf, sizeof(buf), "%04o", static_cast<unsigned>(m & 07777));
  return buf;
}

}  // namespace

Result<Secret> SecretFromString(std::string value) {
  if (value.size() < kMinSecretBytes) {
    return InvalidArgument("the job secret is " + std::to_string(value.size()) +
                           " bytes; it needs at least " + std::to_string(kMinSecretBytes));
  }
  if (value.size() > kMaxSecretBytes) {
    return InvalidArgument("the job secret is longer than " + std::to_string(kMaxSecretBytes) +
                           " bytes");
  }
  return Secret{std::move(value)};
}

Result<Secret> SecretFromFile(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NOFOLLOW);
  if (fd < 0) {
    return InvalidArgument("cannot open the secret file " + path + ": " + std::strerror(errno));
  }
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    const int e = errno;
    ::close(fd);
    return InvalidArgument("cannot stat the secret file " + path + ": " + std::strerror(e));
  }
  if (!S_ISREG(st.st_mode)) {
    ::close(fd);
    return InvalidArgument("the secret file " + path + " is not a regular file");
  }
  if (st.st_uid != ::geteuid()) {
    ::close(fd);
    return InvalidArgument("the secret file " + path + " (mode " + OctalMode(st.st_mode) +
                           ") is owned by uid " + std::to_string(st.st_uid) + ", not by uid " +
                           std::to_string(::geteuid()));
  }
  if ((st.st_mode & 077) != 0) {
    ::close(fd);
    return InvalidArgument("the secret file " + path + " has mode " + OctalMode(st.st_mode) +
                           ": others may read it; chmod 600 " + path);
  }
  std::string value;
  char buf[1024];
  while (true) {
    const ssize_t n = ::read(fd, buf, sizeof(buf));
    if (n < 0) {
      if (errno == EINTR) continue;
      const int e = errno;
      ::close(fd);
      return InvalidArgument("cannot read the secret file " + path + ": " + std::strerror(e));
    }
    if (n == 0) break;
    value.append(buf, static_cast<size_t>(n));
    if (value.size() > kMaxSecretBytes + 2) break;
  }
  ::close(fd);
  if (!value.empty() && value.back() == '\n') value.pop_back();
  if (!value.empty() && value.back() == '\r') value.pop_back();
  auto s = SecretFromString(std::move(value));
  if (!s.ok()) return InvalidArgument("the secret file " + path + ": " + s.status().message());
  return s;
}

Result<std::optional<Secret>> LoadSecret() {
  if (std::optional<std::string> value = env::Get("GRADLINK_SECRET")) {
    auto s = SecretFromString(std::move(*value));
    if (!s.ok()) return InvalidArgument("GRADLINK_SECRET: " + s.status().message());
    return std::optional<Secret>(std::move(s).value());
  }
  if (std::optional<std::string> file = env::Get("GRADLINK_SECRET_FILE")) {
    GL_ASSIGN_OR_RETURN(Secret s, SecretFromFile(*file));
    return std::optional<Secret>(std::move(s));
  }
  return std::optional<Secret>();
}

Secret Generate() {
  unsigned char raw[32];
  if (RAND_bytes(raw, sizeof(raw)) != 1) {
    std::fprintf(stderr, "gradlink: RAND_bytes failed: no entropy for a job secret\n");
    std::abort();
  }
  static constexpr char kHex[] = "0123456789abcdef";
  std::string out;
  out.reserve(64);
  for (unsigned char c : raw) {
    out.push_back(kHex[c >> 4]);
    out.push_back(kHex[c & 15]);
  }
  return Secret{std::move(out)};
}

}  // namespace gradlink::security
