// HttpServer: the small HTTP/1.1 server a gradlink process serves its metrics on (GET /metrics,
// and the scheduler's GET /targets), apart from everything else the process does.
//
//   auto s = metrics::HttpServer::Start({.host = "0.0.0.0", .port = 0},
//                                       {{"/metrics", {metrics::kContentType, render}}});
//   GL_LOG(kInfo) << "metrics: http://" << host << ":" << (*s)->port() << "/metrics";
//
// One thread of its own polls the listening socket and the connections; a route's body is
// produced on it, per request (a scrape), so a slow or idle client never reaches the data path.
// Bounded: a request must arrive whole within `request_timeout` (2 s) and be at most 8 KiB, a
// response be taken within the same time, else the connection is closed; at most
// `max_connections` are open, and a new one over the bound closes the oldest that has not sent a
// whole request (so 1,000 idle or slow clients cannot keep a scrape out). Anything but a GET of a
// route gets 405 (another method) or 404 (another path), and the connection is closed after every
// response (no keep-alive: a scrape a second needs none).
//
// Errors: Start() fails with kInvalidArgument naming the address when the port is taken or the
// host is not this machine's; nothing a client sends fails the server.
// Threads: Start() and the destructor from the owner; routes run on the server's thread.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <thread>

#include "gradlink/status.h"

namespace gradlink::metrics {

struct HttpConfig {
  std::string host = "0.0.0.0";
  uint16_t port = 0;  // 0: a free port
  size_t max_connections = 64;
  std::chrono::milliseconds request_timeout{2000};
};

struct Route {
  std::string content_type;
  std::function<std::string()> body;
};

struct HttpStats {
  uint64_t requests = 0;   // answered 200
  uint64_t refused = 0;    // answered 404 / 405 / 400
  uint64_t timed_out = 0;  // closed: no whole request, or the response not taken, in time
  uint64_t evicted = 0;    // closed to make room for a new connection
};

class HttpServer {
 public:
  static Result<std::unique_ptr<HttpServer>> Start(HttpConfig config,
                                                   std::map<std::string, Route> routes);
  ~HttpServer();
  HttpServer(const HttpServer&) = delete;
  HttpServer& operator=(const HttpServer&) = delete;

  uint16_t port() const { return port_; }
  HttpStats stats() const;

 private:
  HttpServer(HttpConfig config, std::map<std::string, Route> routes, int listen_fd, int wake_fd,
             uint16_t port);
  void Loop();

  const HttpConfig config_;
  const std::map<std::string, Route> routes_;
  const int listen_fd_;
  const int wake_fd_;  // an eventfd: the destructor wakes the loop
  const uint16_t port_;
  std::atomic<bool> stopping_{false};
  std::atomic<uint64_t> requests_{0}, refused_{0}, timed_out_{0}, evicted_{0};
  std::thread thread_;
};

}  // namespace gradlink::metrics
