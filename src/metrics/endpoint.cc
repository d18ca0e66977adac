// metrics/endpoint.h.
#include "metrics/endpoint.h"

#include "common/log.h"

namespace gradlink::metrics {

Result<std::unique_ptr<HttpServer>> Serve(const std::string& host, int32_t port, Collector collect,
                                          std::map<std::string, Route> routes) {
  if (port < 0) return std::unique_ptr<HttpServer>();
  if (port > 65535) {
    return InvalidArgument("metrics port " + std::to_string(port) + " is not a port (0-65535)");
  }
  routes["/metrics"] = Route{std::string(kContentType),
                             [collect = std::move(collect)] { return Render(collect()); }};
  return HttpServer::Start({.host = host, .port = static_cast<uint16_t>(port)}, std::move(routes));
}

std::string HostPort(const std::string& host, uint16_t port) {
  const bool v6 = host.find(':') != std::string::npos;
  return (v6 ? "[" + host + "]" : host) + ":" + std::to_string(port);
}

void LogServing(const std::string& who, const std::string& host, uint16_t port) {
  // An announcement, like the scheduler's "listening on": shown at the default level (warn),
  // tagged as information; GRADLINK_LOG_LEVEL=error hides it.
  if (!log::Enabled(log::Level::kWarn)) return;
  log::Write(log::Level::kInfo, who + ": metrics: http://" + HostPort(host, port) + "/metrics");
}

}  // namespace gradlink::metrics
