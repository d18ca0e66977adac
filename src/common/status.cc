#include "gradlink/status.h"

#include <cstdio>
#include <cstdlib>

namespace gradlink {

std::string_view CodeName(Code code) {
  switch (code) {
    case Code::kOk: return "kOk";
    case Code::kInvalidArgument: return "kInvalidArgument";
    case Code::kTimeout: return "kTimeout";
    case Code::kPeerLost: return "kPeerLost";
    case Code::kProtocolError: return "kProtocolError";
    case Code::kMismatch: return "kMismatch";
    case Code::kAuthFailed: return "kAuthFailed";
    case Code::kAborted: return "kAborted";
    case Code::kResourceExhausted: return "kResourceExhausted";
    case Code::kUnavailable: return "kUnavailable";
    case Code::kInternal: return "kInternal";
  }
  return "kUnknown";
}

std::string Status::ToString() const {
  if (ok()) return "OK";
  std::string s(CodeName(code_));
  if (!message_.empty()) {
    s += ": ";
    s += message_;
  }
  return s;
}

Status InvalidArgument(std::string msg) { return Status(Code::kInvalidArgument, std::move(msg)); }
Status Timeout(std::string msg) { return Status(Code::kTimeout, std::move(msg)); }
Status PeerLost(std::string msg) { return Status(Code::kPeerLost, std::move(msg)); }
Status ProtocolError(std::string msg) { return Status(Code::kProtocolError, std::move(msg)); }
Status Mismatch(std::string msg) { return Status(Code::kMismatch, std::move(msg)); }
Status Aborted(std::string msg) { return Status(Code::kAborted, std::move(msg)); }
Status ResourceExhausted(std::string msg) { return Status(Code::kResourceExhausted, std::move(msg)); }
Status Unavailable(std::string msg) { return Status(Code::kUnavailable, std::move(msg)); }
Status Internal(std::string msg) { return Status(Code::kInternal, std::move(msg)); }

namespace internal {

void ValueOfErrorResult(const Status& status) {
  std::fprintf(stderr, "gradlink: Result::value() on an error: %s\n", status.ToString().c_str());
  std::fflush(stderr);
  std::abort();
}

}  // namespace internal

}  // namespace gradlink
