#include "transport/ucx/status.h"

#include <utility>
#include <vector>

#include "common/env.h"

namespace gradlink::transport::ucx {

std::string UcsError(ucs_status_t s) { return ucs_status_string(s); }

Status StartError(ucs_status_t s, const std::string& what) {
  std::string msg = what + ": " + UcsError(s);
  if (s == UCS_ERR_INVALID_PARAM) {
    const std::vector<std::string> set = env::Listed("UCX_");
    if (!set.empty()) {
      msg += " (UCX refused its configuration; set in the environment:";
      for (size_t i = 0; i < set.size(); ++i) msg += (i ? ", " : " ") + set[i];
      return InvalidArgument(msg + ")");
    }
  }
  return Unavailable(std::move(msg));
}

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
