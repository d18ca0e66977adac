// Internal entry for tests: a Server on a given fabric (the inproc fabric: threads as ranks in one
// process) instead of UCX. Server::Start(options) is StartServerOn(options, nullptr).
#pragma once

#include <memory>

#include "gradlink/server.h"
#include "transport/transport.h"

namespace gradlink {

Result<std::unique_ptr<Server>> StartServerOn(const ServerOptions& options,
                                              std::shared_ptr<transport::Fabric> fabric);

}  // namespace gradlink
