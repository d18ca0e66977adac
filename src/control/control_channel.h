// The control plane: framed messages over one TCP connection (scheduler <-> member).
//
// Blocking I/O with deadlines. Send() may be called from several threads (it serialises);
// Receive() from one thread at a time. Close() from any thread wakes a blocked Receive().
#pragma once

#include <atomic>
#include <chrono>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "common/mutex.h"
#include "common/thread_annotations.h"
#include "gradlink/status.h"
#include "wire/frame.h"

namespace gradlink::transport {

using Clock = std::chrono::steady_clock;

// Liveness on the control plane: once a job has started, the scheduler and every member send
// kHeartbeat this often, and a side that hears nothing from the other for kSilenceLimit takes
// it for dead (a hung process: SIGSTOP, a partition). A crashed process is seen at once, by
// its closed connection.
inline constexpr auto kHeartbeatInterval = std::chrono::milliseconds(500);
inline constexpr auto kSilenceLimit = std::chrono::milliseconds(3000);
// A scheduler address that refuses every connection this long has no job behind it (it ended,
// or was never started): a member joining says so instead of retrying to its connect timeout.
// Long enough for launchers that start members and the scheduler together.
inline constexpr auto kRefusedGrace = std::chrono::seconds(5);

struct Frame {
  wire::Header header;
  std::vector<std::byte> payload;
};

class ControlChannel {
 public:
  // Takes ownership of a connected socket.
  ControlChannel(int fd, std::string peer_name);
  ~ControlChannel();
  ControlChannel(const ControlChannel&) = delete;
  ControlChannel& operator=(const ControlChannel&) = delete;

  // Connects to host:port, retrying refused connections until `deadline`, or until they have
  // been refused for `refused_grace` without a break: then kUnavailable saying that nothing
  // listens there.
  static Result<std::unique_ptr<ControlChannel>> Connect(
      const std::string& host, uint16_t port, Clock::time_point deadline,
      Clock::duration refused_grace = Clock::duration::max());

  // Sends one frame (h.payload_bytes is set from payload). kPeerLost when the peer is gone,
  // kTimeout when the socket stays full past the deadline.
  Status Send(wire::Header h, std::span<const std::byte> payload,
              Clock::time_point deadline = Clock::now() + std::chrono::seconds(10));

  // Receives one frame. kTimeout at the deadline (the stream stays usable), kPeerLost on EOF
  // or error, kProtocolError on a frame that fails validation (the channel is closed).
  Result<Frame> Receive(Clock::time_point deadline);

  // Waits until a frame can be received, the stream has ended or failed, or the channel is
  // closed (true: Receive() then says which), or until `deadline` (false). Allocates nothing,
  // so a loop that mostly waits (the members' control loops, woken every 100 ms) polls with it
  // and calls Receive() only when there is something to read: Receive()'s kTimeout carries a
  // message, which costs two allocations a tick.
  bool WaitReadable(Clock::time_point deadline);

  // Receives one frame for a peer that has not authenticated yet: a frame whose payload exceeds
  // `max_payload` is a kProtocolError before any of it is read (the channel is left open for a
  // last answer; the caller must close it), and `deadline` is hard (no grace
  // for a frame that has started: a peer that stalls mid-frame gets kTimeout and the channel is
  // closed). kTimeout with nothing read leaves the stream usable. `*header` (when given) is set
  // as soon as a valid header has arrived, also when its payload is then refused.
  Result<Frame> ReceiveBounded(Clock::time_point deadline, uint64_t max_payload,
                               wire::Header* header = nullptr);

  void Close();
  bool closed() const { return closed_.load(); }
  const std::string& peer_name() const { return peer_name_; }
  // The socket (non-blocking), for a caller that polls many channels in one thread and does its
  // own framing (the scheduler's event loop). Such a caller must not also use Send/Receive.
  int fd() const { return fd_; }

 private:
  // Reads until `*done == n`; `*done` counts what has arrived, also on failure.
  Status ReadExact(std::byte* p, size_t n, Clock::time_point deadline, size_t* done);
  Status WriteAll(const std::byte* p, size_t n, Clock::time_point deadline) REQUIRES(send_mu_);

  int fd_;
  std::string peer_name_;
  Mutex send_mu_;  // one frame at a time on fd_
  std::atomic<bool> closed_{false};
};

// The numeric address of a connected socket's own end (`peer` false) or its peer's ("10.0.0.2",
// "::1"); empty when the socket has none.
std::string SocketHost(int fd, bool peer);

// A listening TCP socket.
class Listener {
 public:
  ~Listener();
  // Binds host:port (port 0 picks a free port). kUnavailable naming the port when it is taken.
  static Result<std::unique_ptr<Listener>> Listen(const std::string& host, uint16_t port);
  // Waits for a connection until `deadline`; kTimeout when none came.
  Result<std::unique_ptr<ControlChannel>> Accept(Clock::time_point deadline);
  uint16_t port() const { return port_; }
  // The listening socket (non-blocking), to poll for POLLIN; -1 once closed.
  int fd() const { return fd_; }
  void Close();

 private:
  Listener(int fd, uint16_t port) : fd_(fd), port_(port) {}
  int fd_;
  uint16_t port_;
};

// Splits "host:port". kInvalidArgument naming the text when it is not one.
Status ParseHostPort(const std::string& text, std::string* host, uint16_t* port);

}  // namespace gradlink::transport
