// How UCX status codes become gradlink Status values for the UCX lane.
#pragma once

#include <ucp/api/ucp.h>

#include <string>

#include "gradlink/status.h"

namespace gradlink::transport::ucx {

// ucs_status_string(), for messages.
std::string UcsError(ucs_status_t s);

// UCX refused to start (ucp_init, ucp_worker_create): kUnavailable, or kInvalidArgument naming
// the UCX_* variables set when UCX calls its parameters invalid (a malformed UCX_TCP_RCVBUF, say:
// UCX's own log names which), so the error points at the setting, not at gradlink.
Status StartError(ucs_status_t s, const std::string& what);

// Errors that concern one send, not the endpoint; anything else means the endpoint is unusable.
bool IsLocalSendError(ucs_status_t s);

// A local send error as a Status (kResourceExhausted for UCS_ERR_NO_MEMORY, else
// kInvalidArgument), its message prefixed by `what`.
Status LocalSendError(ucs_status_t s, const std::string& what);

}  // namespace gradlink::transport::ucx
