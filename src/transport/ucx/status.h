// How UCX status codes become gradlink Status values for the UCX lane.
#pragma once

#include <ucp/api/ucp.h>

#include <string>

#include "gradlink/status.h"

namespace gradlink::transport::ucx {

// ucs_status_string(), for messages.
std::string UcsError(ucs_status_t s);

// Errors that concern one send, not the endpoint; anything else means the endpoint is unusable.
bool IsLocalSendError(ucs_status_t s);

// A local send error as a Status (kResourceExhausted for UCS_ERR_NO_MEMORY, else
// kInvalidArgument), its message prefixed by `what`.
Status LocalSendError(ucs_status_t s, const std::string& what);

}  // namespace gradlink::transport::ucx
