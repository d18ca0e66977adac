// A role's metrics endpoint: /metrics (and the scheduler's /targets) on its own HttpServer,
// and the log line that says where.
//
//   GL_ASSIGN_OR_RETURN(metrics_, metrics::Serve("0.0.0.0", opts.metrics_port,
//                                                 [this] { return Collect(); }));
//   ...once the address others reach it by is known:
//   metrics::LogServing("server 1", host, metrics_->port());
//
// Errors: kInvalidArgument naming the port when it is taken (HttpServer::Start).
#pragma once

#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "gradlink/status.h"
#include "metrics/exposition.h"
#include "metrics/http_server.h"

namespace gradlink::metrics {

using Collector = std::function<Families()>;

// Serves `collect`'s families on /metrics at host:port, plus `routes`; port -1: nothing
// (nullptr), 0: a free port.
Result<std::unique_ptr<HttpServer>> Serve(const std::string& host, int32_t port, Collector collect,
                                          std::map<std::string, Route> routes = {});

// Logs "<who>: metrics: http://HOST:PORT/metrics", shown at the default log level (warn) as
// "listening on" is: where to point a scraper or gradlink-top.
void LogServing(const std::string& who, const std::string& host, uint16_t port);

// "host:port", with brackets around an IPv6 host.
std::string HostPort(const std::string& host, uint16_t port);

}  // namespace gradlink::metrics
