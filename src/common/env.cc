#include "common/env.h"

#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <limits>

namespace gradlink::env {
namespace {

Status Bad(const char* name, const std::string& value, const char* want) {
  return InvalidArgument(std::string(name) + "='" + value + "' is not " + want);
}

}  // namespace

std::optional<std::string> Get(const char* name) {
  const char* v = std::getenv(name);
  if (v == nullptr || *v == '\0') return std::nullopt;
  return std::string(v);
}

bool SetIfUnset(const char* name, const char* value) {
  return std::getenv(name) == nullptr && setenv(name, value, /*overwrite=*/0) == 0;
}

std::vector<std::string> Listed(std::string_view prefix) {
  std::vector<std::string> out;
  for (char** e = environ; e != nullptr && *e != nullptr; ++e) {
    const std::string_view kv(*e);
    const size_t eq = kv.find('=');
    if (eq == std::string_view::npos || kv.substr(0, prefix.size()) != prefix) continue;
    out.push_back(std::string(kv.substr(0, eq)) + "='" + std::string(kv.substr(eq + 1)) + "'");
  }
  std::sort(out.begin(), out.end());
  return out;
}

std::optional<std::string> GetSet(const char* name) {
  const char* v = std::getenv(name);
  if (v == nullptr) return std::nullopt;
  return std::string(v);
}

Result<uint64_t> ParseBytes(const std::string& what, const std::string& v) {
  const char* want = "a byte count (digits, optionally K, M or G)";
  uint64_t n = 0;
  size_t i = 0;
  for (; i < v.size() && v[i] >= '0' && v[i] <= '9'; ++i) {
    const uint64_t d = static_cast<uint64_t>(v[i] - '0');
    if (n > (std::numeric_limits<uint64_t>::max() - d) / 10) return Bad(what.c_str(), v, want);
    n = n * 10 + d;
  }
  if (i == 0) return Bad(what.c_str(), v, want);
  int shift = 0;
  if (i + 1 == v.size()) {
    switch (v[i]) {
      case 'K': case 'k': shift = 10; break;
      case 'M': case 'm': shift = 20; break;
      case 'G': case 'g': shift = 30; break;
      default: return Bad(what.c_str(), v, want);
    }
  } else if (i != v.size()) {
    return Bad(what.c_str(), v, want);
  }
  if (shift != 0 && n > (std::numeric_limits<uint64_t>::max() >> shift)) {
    return Bad(what.c_str(), v, want);
  }
  return n << shift;
}

Result<std::optional<uint64_t>> Bytes(const char* name) {
  const std::optional<std::string> v = GetSet(name);
  if (!v) return std::optional<uint64_t>();
  GL_ASSIGN_OR_RETURN(uint64_t n, ParseBytes(name, *v));
  return std::optional<uint64_t>(n);
}

Result<std::optional<int64_t>> Int(const char* name) {
  const std::optional<std::string> v = GetSet(name);
  if (!v) return std::optional<int64_t>();
  char* end = nullptr;
  errno = 0;
  const long long n = std::strtoll(v->c_str(), &end, 10);
  if (*end != '\0' || errno != 0) return Bad(name, *v, "a whole number");
  return std::optional<int64_t>(n);
}

Result<std::optional<double>> Number(const char* name) {
  const std::optional<std::string> v = GetSet(name);
  if (!v) return std::optional<double>();
  char* end = nullptr;
  errno = 0;
  const double x = std::strtod(v->c_str(), &end);
  if (*end != '\0' || errno != 0 || !std::isfinite(x)) return Bad(name, *v, "a finite number");
  return std::optional<double>(x);
}

Result<std::optional<bool>> Flag(const char* name) {
  const std::optional<std::string> v = GetSet(name);
  if (!v) return std::optional<bool>();
  for (const char* t : {"1", "true", "yes", "on"}) {
    if (*v == t) return std::optional<bool>(true);
  }
  for (const char* f : {"0", "false", "no", "off"}) {
    if (*v == f) return std::optional<bool>(false);
  }
  return Bad(name, *v, "1/true/yes/on or 0/false/no/off");
}

Result<std::optional<std::chrono::milliseconds>> Seconds(const char* name) {
  GL_ASSIGN_OR_RETURN(std::optional<double> s, Number(name));
  if (!s) return std::optional<std::chrono::milliseconds>();
  if (*s < 0 || *s > 1e9) {
    return InvalidArgument(std::string(name) + "=" + *GetSet(name) +
                           " is not a number of seconds in [0, 1e9]");
  }
  return std::optional<std::chrono::milliseconds>(
      std::chrono::milliseconds(static_cast<int64_t>(*s * 1000)));
}

}  // namespace gradlink::env
