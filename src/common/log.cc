#include "common/log.h"

#include "common/env.h"

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>

namespace gradlink::log {
namespace {

Level LevelFromEnv() {
  const std::optional<std::string> v = env::Get("GRADLINK_LOG_LEVEL");
  if (!v) return Level::kWarn;
  if (*v == "debug") return Level::kDebug;
  if (*v == "info") return Level::kInfo;
  if (*v == "error") return Level::kError;
  return Level::kWarn;
}

const char* Tag(Level l) {
  switch (l) {
    case Level::kDebug: return "D";
    case Level::kInfo: return "I";
    case Level::kWarn: return "W";
    case Level::kError: return "E";
  }
  return "?";
}

}  // namespace

bool Enabled(Level level) {
  static const Level threshold = LevelFromEnv();
  return level >= threshold;
}

void Write(Level level, const std::string& line) {
  static std::mutex mu;
  std::lock_guard<std::mutex> lock(mu);
  std::fprintf(stderr, "[gradlink %s] %s\n", Tag(level), line.c_str());
}

}  // namespace gradlink::log
