// What the UCX lanes of one fabric share: the ucp_context, and UCX settings read from the
// environment once per process.
#pragma once

#include <ucp/api/ucp.h>

#include "transport/ucx/segments.h"

namespace gradlink::transport::ucx {

// Shared by the fabric and its lanes; ucp_cleanup runs when the last of them is gone.
struct UcxContext {
  ucp_context_h context = nullptr;
  Segments segments;  // this process's UCX TCP segments (segments.h)
  ~UcxContext() {
    if (context != nullptr) ucp_cleanup(context);
  }
};

// UCP_ERR_HANDLING_MODE_PEER (the default) reports a dead peer on the endpoint, but UCX 1.13
// then never selects shared memory (sysv/posix/cma lack peer failure handling), so processes on
// one host talk over TCP loopback. GRADLINK_UCX_ERROR_MODE=none trades that endpoint-level
// detection (the scheduler still detects dead members) for the shared-memory path.
ucp_err_handling_mode_t PeerErrorMode();

}  // namespace gradlink::transport::ucx
