#include "common/log.h"

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>

namespace gradlink::log {
namespace {

Level LevelFromEnv() {
  const char* v = std::getenv("GRADLINK_LOG_LEVEL");
  if (v == nullptr) return Level::kWarn;
  if (std::strcmp(v, "debug") == 0) return Level::kDebug;
  if (std::strcmp(v, "info") == 0) return Level::kInfo;
  if (std::strcmp(v, "error") == 0) return Level::kError;
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
