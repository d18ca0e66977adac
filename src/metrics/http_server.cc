// metrics/http_server.h: GET /metrics (and /targets) over plain HTTP/1.1.
#include "metrics/http_server.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <list>
#include <string_view>
#include <vector>

namespace gradlink::metrics {
namespace {

using SteadyClock = std::chrono::steady_clock;

constexpr size_t kMaxRequestBytes = 8 * 1024;

struct Connection {
  int fd = -1;
  SteadyClock::time_point deadline;  // the request, then the response, must be done by then
  std::string in;
  std::string out;  // the response; written once the request is whole
  size_t written = 0;
  bool responding = false;
};

std::string Response(int code, std::string_view reason, std::string_view type,
                     const std::string& body) {
  std::string r = "HTTP/1.1 " + std::to_string(code) + " " + std::string(reason) + "\r\n";
  r += "Content-Type: " + std::string(type) + "\r\n";
  r += "Content-Length: " + std::to_string(body.size()) + "\r\n";
  if (code == 405) r += "Allow: GET\r\n";
  r += "Connection: close\r\n\r\n";
  r += body;
  return r;
}

}  // namespace

Result<std::unique_ptr<HttpServer>> HttpServer::Start(HttpConfig config,
                                                      std::map<std::string, Route> routes) {
  const std::string where = config.host + ":" + std::to_string(config.port);
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE | AI_NUMERICSERV;
  addrinfo* found = nullptr;
  const std::string port = std::to_string(config.port);
  if (int e = getaddrinfo(config.host.c_str(), port.c_str(), &hints, &found); e != 0) {
    return InvalidArgument("metrics: cannot listen on " + where + ": " + gai_strerror(e));
  }
  int fd = -1;
  std::string why = "no address";
  for (addrinfo* a = found; a != nullptr && fd < 0; a = a->ai_next) {
    fd = socket(a->ai_family, a->ai_socktype | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (fd < 0) continue;
    const int one = 1;
    setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    if (bind(fd, a->ai_addr, a->ai_addrlen) != 0 || listen(fd, 128) != 0) {
      why = errno == EADDRINUSE ? "the port is taken (another process listens on it)"
                                : std::string(std::strerror(errno));
      close(fd);
      fd = -1;
    }
  }
  freeaddrinfo(found);
  if (fd < 0) return InvalidArgument("metrics: cannot listen on " + where + ": " + why);
  sockaddr_storage bound{};
  socklen_t len = sizeof(bound);
  getsockname(fd, reinterpret_cast<sockaddr*>(&bound), &len);
  const uint16_t actual = ntohs(bound.ss_family == AF_INET6
                                    ? reinterpret_cast<sockaddr_in6*>(&bound)->sin6_port
                                    : reinterpret_cast<sockaddr_in*>(&bound)->sin_port);
  const int wake = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  if (wake < 0) {
    close(fd);
    return Internal(std::string("metrics: eventfd: ") + std::strerror(errno));
  }
  std::unique_ptr<HttpServer> s(
      new HttpServer(std::move(config), std::move(routes), fd, wake, actual));
  s->thread_ = std::thread([p = s.get()] { p->Loop(); });
  return s;
}

HttpServer::HttpServer(HttpConfig config, std::map<std::string, Route> routes, int listen_fd,
                       int wake_fd, uint16_t port)
    : config_(std::move(config)),
      routes_(std::move(routes)),
      listen_fd_(listen_fd),
      wake_fd_(wake_fd),
      port_(port) {}

HttpServer::~HttpServer() {
  stopping_ = true;
  const uint64_t one = 1;
  if (write(wake_fd_, &one, sizeof(one)) < 0) {
    // (The loop also looks at stopping_ every 100 ms.)
  }
  if (thread_.joinable()) thread_.join();
  close(listen_fd_);
  close(wake_fd_);
}

HttpStats HttpServer::stats() const {
  return {requests_.load(), refused_.load(), timed_out_.load(), evicted_.load()};
}

void HttpServer::Loop() {
  std::list<Connection> conns;  // oldest first
  std::vector<pollfd> fds;
  std::vector<std::list<Connection>::iterator> of;
  const auto drop = [&](std::list<Connection>::iterator it) {
    close(it->fd);
    return conns.erase(it);
  };
  // The request in `c.in` is whole (or too large, or malformed): the response to send.
  const auto answer = [&](Connection& c) {
    const size_t end = c.in.find("\r\n");
    const std::string_view line(c.in.data(), end == std::string::npos ? c.in.size() : end);
    const size_t sp1 = line.find(' ');
    const size_t sp2 = sp1 == std::string_view::npos ? sp1 : line.find(' ', sp1 + 1);
    if (sp2 == std::string_view::npos) {
      refused_++;
      return Response(400, "Bad Request", "text/plain", "a request line: METHOD PATH VERSION\n");
    }
    const std::string_view method = line.substr(0, sp1);
    std::string_view path = line.substr(sp1 + 1, sp2 - sp1 - 1);
    path = path.substr(0, path.find('?'));
    auto route = routes_.find(std::string(path));
    if (route == routes_.end()) {
      refused_++;
      return Response(404, "Not Found", "text/plain", "not found\n");
    }
    if (method != "GET") {
      refused_++;
      return Response(405, "Method Not Allowed", "text/plain", "GET only\n");
    }
    requests_++;
    return Response(200, "OK", route->second.content_type, route->second.body());
  };

  while (!stopping_) {
    const auto now = SteadyClock::now();
    // Past their deadline: closed.
    for (auto it = conns.begin(); it != conns.end();) {
      if (now >= it->deadline) {
        timed_out_++;
        it = drop(it);
      } else {
        ++it;
      }
    }
    fds.clear();
    of.clear();
    fds.push_back({wake_fd_, POLLIN, 0});
    fds.push_back({listen_fd_, POLLIN, 0});
    int timeout_ms = 100;
    for (auto it = conns.begin(); it != conns.end(); ++it) {
      fds.push_back({it->fd, static_cast<short>(it->responding ? POLLOUT : POLLIN), 0});
      of.push_back(it);
      const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(it->deadline - now);
      timeout_ms = std::min<int>(timeout_ms, static_cast<int>(std::max<int64_t>(left.count(), 0)) + 1);
    }
    if (poll(fds.data(), fds.size(), timeout_ms) < 0 && errno != EINTR) break;
    if (stopping_) break;
    // Connections first (their iterators), then new ones.
    for (size_t i = 0; i < of.size(); ++i) {
      const short ev = fds[i + 2].revents;
      if (ev == 0) continue;
      Connection& c = *of[i];
      bool close_it = (ev & (POLLERR | POLLNVAL)) != 0;
      if (!close_it && !c.responding && (ev & (POLLIN | POLLHUP))) {
        char buf[4096];
        const ssize_t n = recv(c.fd, buf, sizeof(buf), 0);
        if (n <= 0) {
          close_it = n == 0 || (errno != EAGAIN && errno != EINTR);
        } else {
          c.in.append(buf, static_cast<size_t>(n));
          const bool whole = c.in.find("\r\n\r\n") != std::string::npos;
          if (whole || c.in.size() > kMaxRequestBytes) {
            c.out = whole ? answer(c)
                          : (refused_++, Response(400, "Bad Request", "text/plain",
                                                  "request too large\n"));
            c.responding = true;
            c.deadline = SteadyClock::now() + config_.request_timeout;
          }
        }
      }
      if (!close_it && c.responding && (ev & POLLOUT)) {
        const ssize_t n =
            send(c.fd, c.out.data() + c.written, c.out.size() - c.written, MSG_NOSIGNAL);
        if (n < 0) {
          close_it = errno != EAGAIN && errno != EINTR;
        } else {
          c.written += static_cast<size_t>(n);
          close_it = c.written == c.out.size();  // done: Connection: close
        }
      } else if (!close_it && c.responding && (ev & POLLHUP)) {
        close_it = true;
      }
      if (close_it) drop(of[i]);
    }
    if (fds[1].revents & POLLIN) {
      for (;;) {
        const int fd = accept4(listen_fd_, nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC);
        if (fd < 0) break;
        if (conns.size() >= config_.max_connections) {
          // Room for it: the oldest that has not sent a whole request (else the oldest).
          auto victim = std::find_if(conns.begin(), conns.end(),
                                     [](const Connection& c) { return !c.responding; });
          if (victim == conns.end()) victim = conns.begin();
          evicted_++;
          drop(victim);
        }
        Connection c;
        c.fd = fd;
        c.deadline = SteadyClock::now() + config_.request_timeout;
        conns.push_back(std::move(c));
      }
    }
  }
  for (auto it = conns.begin(); it != conns.end();) it = drop(it);
}

}  // namespace gradlink::metrics
