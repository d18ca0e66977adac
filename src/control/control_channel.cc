#include "control/control_channel.h"

#include <arpa/inet.h>
#include <cerrno>
#include <cstring>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <thread>
#include <unistd.h>

namespace gradlink::transport {
namespace {

// Once a frame has begun, the rest of it may take this long to arrive.
constexpr auto kFrameGrace = std::chrono::seconds(5);

int MillisLeft(Clock::time_point deadline) {
  auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
  if (left.count() <= 0) return 0;
  // Wake at least every 100 ms so Close() from another thread is noticed.
  return static_cast<int>(std::min<int64_t>(left.count(), 100));
}

std::string Errno(const char* what) { return std::string(what) + ": " + std::strerror(errno); }

Result<sockaddr_in> Resolve(const std::string& host, uint16_t port) {
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(port);
  if (inet_pton(AF_INET, host.c_str(), &addr.sin_addr) == 1) return addr;
  addrinfo hints{};
  hints.ai_family = AF_INET;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* res = nullptr;
  if (getaddrinfo(host.c_str(), nullptr, &hints, &res) != 0 || res == nullptr) {
    return InvalidArgument("cannot resolve host '" + host + "'");
  }
  addr.sin_addr = reinterpret_cast<sockaddr_in*>(res->ai_addr)->sin_addr;
  freeaddrinfo(res);
  return addr;
}

}  // namespace

ControlChannel::ControlChannel(int fd, std::string peer_name)
    : fd_(fd), peer_name_(std::move(peer_name)) {
  int one = 1;
  setsockopt(fd_, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
  fcntl(fd_, F_SETFL, fcntl(fd_, F_GETFL) | O_NONBLOCK);
}

ControlChannel::~ControlChannel() {
  Close();
  ::close(fd_);
}

void ControlChannel::Close() {
  if (!closed_.exchange(true)) ::shutdown(fd_, SHUT_RDWR);
}

Result<std::unique_ptr<ControlChannel>> ControlChannel::Connect(const std::string& host,
                                                                uint16_t port,
                                                                Clock::time_point deadline,
                                                                Clock::duration refused_grace) {
  GL_ASSIGN_OR_RETURN(sockaddr_in addr, Resolve(host, port));
  const std::string name = host + ":" + std::to_string(port);
  std::string last_error;
  bool refused = false;  // every attempt since refused_since was refused
  Clock::time_point refused_since;
  while (true) {
    int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0) return Unavailable(Errno("socket"));
    if (::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0) {
      return std::make_unique<ControlChannel>(fd, name);
    }
    const int err = errno;
    last_error = std::strerror(err);
    ::close(fd);
    const auto now = Clock::now();
    if (err != ECONNREFUSED) {
      refused = false;
    } else if (!refused) {
      refused = true;
      refused_since = now;
    } else if (now - refused_since >= refused_grace) {
      return Unavailable(
          "nothing listens at " + name + " (every connection refused for " +
          std::to_string(std::chrono::duration_cast<std::chrono::milliseconds>(now - refused_since)
                             .count()) +
          " ms): no gradlink job is running there; it has ended, or its scheduler was not "
          "started (or GRADLINK_SCHEDULER names the wrong address)");
    }
    if (now >= deadline) {
      return Unavailable("cannot connect to scheduler at " + name + ": " + last_error);
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
}

Status ControlChannel::WriteAll(const std::byte* p, size_t n, Clock::time_point deadline) {
  while (n > 0) {
    if (closed_.load()) return PeerLost("connection to " + peer_name_ + " closed");
    ssize_t w = ::send(fd_, p, n, MSG_NOSIGNAL);
    if (w > 0) {
      p += w;
      n -= static_cast<size_t>(w);
      continue;
    }
    if (w < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) {
      return PeerLost("sending to " + peer_name_ + ": " + std::strerror(errno));
    }
    if (Clock::now() >= deadline) return Timeout("sending to " + peer_name_ + " timed out");
    pollfd pfd{fd_, POLLOUT, 0};
    ::poll(&pfd, 1, MillisLeft(deadline));
  }
  return Status::Ok();
}

Status ControlChannel::ReadExact(std::byte* p, size_t n, Clock::time_point deadline,
                                 size_t* done_out) {
  size_t& done = *done_out;
  while (done < n) {
    if (closed_.load()) return PeerLost("connection to " + peer_name_ + " closed");
    ssize_t r = ::recv(fd_, p + done, n - done, 0);
    if (r > 0) {
      done += static_cast<size_t>(r);
      continue;
    }
    if (r == 0) return PeerLost(peer_name_ + " closed the connection");
    if (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) {
      return PeerLost("receiving from " + peer_name_ + ": " + std::strerror(errno));
    }
    if (Clock::now() >= deadline) return Timeout("receiving from " + peer_name_ + " timed out");
    pollfd pfd{fd_, POLLIN, 0};
    ::poll(&pfd, 1, MillisLeft(deadline));
  }
  return Status::Ok();
}

bool ControlChannel::WaitReadable(Clock::time_point deadline) {
  for (;;) {
    if (closed_.load()) return true;
    pollfd pfd{fd_, POLLIN, 0};
    const int r = ::poll(&pfd, 1, MillisLeft(deadline));
    if (r > 0 || (r < 0 && errno != EINTR)) return true;  // data, EOF or an error: Receive's
    if (Clock::now() >= deadline) return false;
  }
}

Status ControlChannel::Send(wire::Header h, std::span<const std::byte> payload,
                            Clock::time_point deadline) {
  h.payload_bytes = payload.size();
  const wire::HeaderBytes hb = wire::EncodeHeader(h);
  MutexLock lock(send_mu_);
  GL_RETURN_IF_ERROR(WriteAll(hb.data(), hb.size(), deadline));
  return WriteAll(payload.data(), payload.size(), deadline);
}

Result<Frame> ControlChannel::Receive(Clock::time_point deadline) {
  wire::HeaderBytes hb;
  size_t got = 0;
  Status s = ReadExact(hb.data(), hb.size(), deadline, &got);
  if (!s.ok() && s.code() == Code::kTimeout && got > 0) {
    // The caller's deadline fell inside a header (a TCP segment can arrive late). The rest of
    // the frame gets the same grace as a payload; only then is the stream given up.
    s = ReadExact(hb.data(), hb.size(), Clock::now() + kFrameGrace, &got);
    if (!s.ok()) Close();
  }
  if (!s.ok()) return s;
  Result<wire::Header> h = wire::DecodeHeader(hb);
  if (!h.ok()) {
    Close();
    return ProtocolError("from " + peer_name_ + ": " + h.status().message());
  }
  if (!wire::IsControlType(h->type) && h->type != wire::MsgType::kDataError) {
    Close();
    return ProtocolError("from " + peer_name_ + ": data frame on the control connection");
  }
  Frame f;
  f.header = *h;
  f.payload.resize(h->payload_bytes);
  // The payload follows its header; allow it a little more time than the caller's wait.
  got = 0;
  s = ReadExact(f.payload.data(), f.payload.size(), std::max(deadline, Clock::now() + kFrameGrace),
                &got);
  if (!s.ok()) {
    Close();
    return s;
  }
  return f;
}

Result<Frame> ControlChannel::ReceiveBounded(Clock::time_point deadline, uint64_t max_payload,
                                             wire::Header* header) {
  wire::HeaderBytes hb;
  size_t got = 0;
  Status s = ReadExact(hb.data(), hb.size(), deadline, &got);
  if (!s.ok()) {
    if (got > 0) Close();  // stalled inside a header
    return s;
  }
  Result<wire::Header> h = wire::DecodeHeader(hb);
  if (!h.ok()) {
    Close();
    return ProtocolError("from " + peer_name_ + ": " + h.status().message());
  }
  if (!wire::IsControlType(h->type)) {
    Close();
    return ProtocolError("from " + peer_name_ + ": data frame on the control connection");
  }
  if (header != nullptr) *header = *h;
  if (h->payload_bytes > max_payload) {
    // Left open, its payload unread: the caller may answer (kAbort) before it closes it.
    return ProtocolError("from " + peer_name_ + ": payload of " +
                         std::to_string(h->payload_bytes) + " bytes exceeds " +
                         std::to_string(max_payload) + " before authentication");
  }
  Frame f;
  f.header = *h;
  f.payload.resize(h->payload_bytes);
  got = 0;
  s = ReadExact(f.payload.data(), f.payload.size(), deadline, &got);
  if (!s.ok()) {
    Close();
    return s;
  }
  return f;
}

Listener::~Listener() { Close(); }

void Listener::Close() {
  if (fd_ >= 0) {
    ::close(fd_);
    fd_ = -1;
  }
}

Result<std::unique_ptr<Listener>> Listener::Listen(const std::string& host, uint16_t port) {
  GL_ASSIGN_OR_RETURN(sockaddr_in addr, Resolve(host, port));
  int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return Unavailable(Errno("socket"));
  int one = 1;
  setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  if (::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    std::string err = std::strerror(errno);
    ::close(fd);
    return Unavailable("cannot listen on " + host + ":" + std::to_string(port) + ": " + err +
                       (port != 0 ? " (is another scheduler using port " + std::to_string(port) +
                                        "? pick another with --port, or 0 for a free one)"
                                  : ""));
  }
  // A backlog for thousands of members joining at once: a connection the full backlog drops
  // is retried by TCP only after a second (the SYN timeout), which made 1,000 members take 1 s
  // to join and 4,000 about 5 s. The kernel caps it at net.core.somaxconn (4096 by default).
  if (::listen(fd, 4096) != 0) {
    std::string err = std::strerror(errno);
    ::close(fd);
    return Unavailable("listen on port " + std::to_string(port) + ": " + err);
  }
  socklen_t len = sizeof(addr);
  getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len);
  fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) | O_NONBLOCK);
  return std::unique_ptr<Listener>(new Listener(fd, ntohs(addr.sin_port)));
}

Result<std::unique_ptr<ControlChannel>> Listener::Accept(Clock::time_point deadline) {
  while (true) {
    if (fd_ < 0) return Aborted("listener closed");
    sockaddr_in peer{};
    socklen_t len = sizeof(peer);
    int fd = ::accept4(fd_, reinterpret_cast<sockaddr*>(&peer), &len, SOCK_CLOEXEC);
    if (fd >= 0) {
      char buf[INET_ADDRSTRLEN] = {};
      inet_ntop(AF_INET, &peer.sin_addr, buf, sizeof(buf));
      return std::make_unique<ControlChannel>(fd, std::string(buf) + ":" +
                                                      std::to_string(ntohs(peer.sin_port)));
    }
    if (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR && errno != ECONNABORTED) {
      return Unavailable(Errno("accept"));
    }
    if (Clock::now() >= deadline) return Timeout("no connection");
    pollfd pfd{fd_, POLLIN, 0};
    ::poll(&pfd, 1, MillisLeft(deadline));
  }
}

Status ParseHostPort(const std::string& text, std::string* host, uint16_t* port) {
  const size_t colon = text.rfind(':');
  if (colon == std::string::npos || colon == 0 || colon + 1 == text.size()) {
    return InvalidArgument("'" + text + "' is not host:port");
  }
  const std::string p = text.substr(colon + 1);
  unsigned long v = 0;
  for (char c : p) {
    if (c < '0' || c > '9' || v > 65535) return InvalidArgument("bad port in '" + text + "'");
    v = v * 10 + static_cast<unsigned long>(c - '0');
  }
  if (v == 0 || v > 65535) return InvalidArgument("bad port in '" + text + "'");
  *host = text.substr(0, colon);
  *port = static_cast<uint16_t>(v);
  return Status::Ok();
}

std::string SocketHost(int fd, bool peer) {
  sockaddr_storage a{};
  socklen_t len = sizeof(a);
  auto* sa = reinterpret_cast<sockaddr*>(&a);
  if ((peer ? getpeername(fd, sa, &len) : getsockname(fd, sa, &len)) != 0) return {};
  char host[NI_MAXHOST];
  if (getnameinfo(sa, len, host, sizeof(host), nullptr, 0, NI_NUMERICHOST) != 0) return {};
  std::string h = host;
  // An IPv4 peer of a dual-stack socket: its plain dotted form.
  if (h.rfind("::ffff:", 0) == 0 && h.find('.') != std::string::npos) h = h.substr(7);
  return h;
}

}  // namespace gradlink::transport
