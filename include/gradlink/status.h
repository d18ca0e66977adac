// Status and Result<T>: the error values of every gradlink API.
//
// A Status is a cheap value (an enum and, on failure, a message). Codes are stable: Python maps
// them to exception classes, tools map them to exit codes. Messages name the peer and the key
// that an error concerns, e.g. "kPeerLost: server 1 (127.0.0.1:4242) closed the pull lane".
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <utility>

#include "gradlink/export.h"

namespace gradlink {

enum class Code : uint8_t {
  kOk = 0,
  kInvalidArgument = 1,
  kTimeout = 2,
  kPeerLost = 3,
  kProtocolError = 4,
  kMismatch = 5,
  kAuthFailed = 6,
  kAborted = 7,
  kResourceExhausted = 8,
  kUnavailable = 9,
  kInternal = 10,
};
inline constexpr uint8_t kMaxCode = 10;

GRADLINK_EXPORT std::string_view CodeName(Code code);

class [[nodiscard]] GRADLINK_EXPORT Status {
 public:
  Status() = default;  // OK
  Status(Code code, std::string message) : code_(code), message_(std::move(message)) {}

  static Status Ok() { return Status(); }

  bool ok() const { return code_ == Code::kOk; }
  Code code() const { return code_; }
  const std::string& message() const { return message_; }
  // "kMismatch: key 0x12ab 'fc1.weight': rank 0 declared fp32[10], rank 1 declared fp32[12]"
  std::string ToString() const;

  // Marks a Status as deliberately unused.
  void IgnoreError() const {}

 private:
  Code code_ = Code::kOk;
  std::string message_;
};

GRADLINK_EXPORT Status InvalidArgument(std::string msg);
GRADLINK_EXPORT Status Timeout(std::string msg);
GRADLINK_EXPORT Status PeerLost(std::string msg);
GRADLINK_EXPORT Status ProtocolError(std::string msg);
GRADLINK_EXPORT Status Mismatch(std::string msg);
GRADLINK_EXPORT Status Aborted(std::string msg);
GRADLINK_EXPORT Status ResourceExhausted(std::string msg);
GRADLINK_EXPORT Status Unavailable(std::string msg);
GRADLINK_EXPORT Status Internal(std::string msg);

namespace internal {
// Reading the value of a Result that holds an error is a bug in the caller: this prints the
// error ("Result::value() on an error: ...") and aborts, never undefined behaviour.
[[noreturn]] GRADLINK_EXPORT void ValueOfErrorResult(const Status& status);
}  // namespace internal

// A value or the Status that explains why there is none. value(), * and -> on an error abort
// with that error (internal::ValueOfErrorResult); check ok() first.
template <typename T>
class [[nodiscard]] Result {
 public:
  Result(T value) : value_(std::move(value)) {}  // NOLINT: implicit by design
  Result(Status status) : status_(std::move(status)) {  // NOLINT
    if (status_.ok()) status_ = Status(Code::kInternal, "Result built from an OK status");
  }

  bool ok() const { return status_.ok(); }
  const Status& status() const { return status_; }
  T& value() & { return Checked(); }
  const T& value() const& { return Checked(); }
  T&& value() && { return std::move(Checked()); }
  T* operator->() { return &Checked(); }
  const T* operator->() const { return &Checked(); }
  T& operator*() { return Checked(); }
  const T& operator*() const { return Checked(); }

 private:
  T& Checked() {
    if (!value_) internal::ValueOfErrorResult(status_);
    return *value_;
  }
  const T& Checked() const {
    if (!value_) internal::ValueOfErrorResult(status_);
    return *value_;
  }

  Status status_;
  std::optional<T> value_;
};

}  // namespace gradlink

// Returns early from the enclosing function when `expr` (a Status) is not OK.
#define GL_RETURN_IF_ERROR(expr)                \
  do {                                          \
    ::gradlink::Status gl_status_ = (expr);     \
    if (!gl_status_.ok()) return gl_status_;    \
  } while (0)

#define GL_CONCAT_INNER_(a, b) a##b
#define GL_CONCAT_(a, b) GL_CONCAT_INNER_(a, b)
// `GL_ASSIGN_OR_RETURN(auto x, F())` declares x from a Result or returns its Status.
#define GL_ASSIGN_OR_RETURN(lhs, expr) \
  GL_ASSIGN_OR_RETURN_IMPL_(GL_CONCAT_(gl_result_, __LINE__), lhs, expr)
#define GL_ASSIGN_OR_RETURN_IMPL_(tmp, lhs, expr) \
  auto tmp = (expr);                              \
  if (!tmp.ok()) return tmp.status();             \
  lhs = std::move(tmp).value()
