// Minimal leveled logging to stderr. GRADLINK_LOG_LEVEL=debug|info|warn|error (default warn).
#pragma once

#include <sstream>
#include <string>

namespace gradlink::log {

enum class Level { kDebug = 0, kInfo = 1, kWarn = 2, kError = 3 };

bool Enabled(Level level);
void Write(Level level, const std::string& line);

class Line {
 public:
  explicit Line(Level level) : level_(level) {}
  ~Line() { Write(level_, out_.str()); }
  template <typename T>
  Line& operator<<(const T& v) {
    out_ << v;
    return *this;
  }

 private:
  Level level_;
  std::ostringstream out_;
};

}  // namespace gradlink::log

// A for loop rather than an if, so that a GL_LOG inside an unbraced if/else stays unambiguous.
#define GL_LOG(level)                                                             \
  for (bool gl_log_on_ = ::gradlink::log::Enabled(::gradlink::log::Level::level); \
       gl_log_on_; gl_log_on_ = false)                                            \
  ::gradlink::log::Line(::gradlink::log::Level::level)
