#include "transport/ucx/status.h"

#include <utility>

namespace gradlink::transport::ucx {

std::string UcsError(ucs_status_t s) { return ucs_status_string(s); }

bool IsLocalSendError(ucs_status_t s) {
  return s == UCS_ERR_NO_MEMORY || s == UCS_ERR_INVALID_PARAM || s == UCS_ERR_EXCEEDS_LIMIT ||
         s == UCS_ERR_UNSUPPORTED;
}

Status LocalSendError(ucs_status_t s, const std::string& what) {
  std::string msg = what + ": " + UcsError(s);
  if (s == UCS_ERR_NO_MEMORY) return ResourceExhausted(std::move(msg));
  return InvalidArgument(std::move(msg));
}

}  // namespace gradlink::transport::ucx
