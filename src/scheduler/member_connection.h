// One member's control connection as the scheduler's event loop sees it: a non-blocking socket,
// an incremental frame parser over a read buffer, and a send queue of encoded frames.
//
// Why: the scheduler serves every member from one thread (scheduler.cc). Nothing here blocks:
// ReadSome() takes what the socket holds, NextFrame() hands out complete frames one at a time
// (validated by the rules the caller passes for that frame, so they can change between frames,
// e.g. once the handshake is done), Send() appends to the queue and writes what the socket takes
// at once, Flush() writes more when poll() says the socket is writable. A member that does not
// read is seen by its queue (queued_bytes(), oldest_queued()); the caller decides what to do.
//
// Framing and validation are exactly ControlChannel::Receive / ReceiveBounded's: the header via
// wire::DecodeHeader, control types only (kDataError too when rules.allow_data_error), a payload
// bound checked before any of the payload is read.
//
// Threads: not thread-safe; one owner thread (the scheduler's loop) calls everything.
// Errors: NextFrame() returns kProtocolError for an invalid frame and kPeerLost once the peer
// closed or the socket failed (after every complete frame before that); Flush() and
// send_error() return kPeerLost when a write failed (the queue is dropped; the socket stays
// open so that what the peer sent before it went can still be read). After an error the caller
// closes it.
#pragma once

#include <atomic>
#include <poll.h>

#include <cstddef>
#include <cstdint>
#include <deque>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "gradlink/status.h"
#include "control/control_channel.h"
#include "wire/frame.h"

namespace gradlink::scheduler {

using Clock = transport::Clock;

// What the next frame may be.
struct FrameRules {
  // Larger payloads are refused as soon as the header is in, before any payload is read.
  uint64_t max_payload = wire::kMaxControlPayload;
  // kDataError passes framing (ControlChannel::Receive does; the handler then refuses it as an
  // unexpected type). False before authentication (ReceiveBounded).
  bool allow_data_error = true;
};

// Control traffic, counted by every connection that is given them (the scheduler's metrics).
struct ControlCounters {
  std::atomic<uint64_t> frames_in{0}, bytes_in{0}, frames_out{0}, bytes_out{0};
};

class MemberConnection {
 public:
  // At most this much is read per ReadSome(), so one busy member cannot starve the others and
  // the read buffer stays within one frame plus this.
  static constexpr size_t kReadChunk = 64 * 1024;

  // Takes the accepted channel (its socket is already non-blocking); only its fd and name are
  // used, never its blocking Send/Receive.
  explicit MemberConnection(std::unique_ptr<transport::ControlChannel> channel);
  MemberConnection(const MemberConnection&) = delete;
  MemberConnection& operator=(const MemberConnection&) = delete;

  const std::string& peer_name() const { return peer_name_; }
  // Counts every frame received and queued into `counters` (which outlives this) from now on.
  void CountInto(ControlCounters* counters) { counters_ = counters; }
  // -1 once closed.
  int fd() const { return channel_ ? channel_->fd() : -1; }
  bool closed() const { return channel_ == nullptr; }
  // What to poll for: POLLIN until EOF or a read error, POLLOUT while bytes wait; 0 once closed.
  short PollEvents() const;

  // ---- Receiving ----------------------------------------------------------------------------
  // Reads what the socket holds (at most kReadChunk). EOF and errors are kept and reported by
  // NextFrame() after the frames before them. While closing, what arrives is dropped.
  void ReadSome(Clock::time_point now);
  // The next complete frame, validated by `rules`; nullopt while it is incomplete (or while
  // closing). `*header` (when given) is set as soon as a valid header is in, also when its
  // payload is then refused.
  Result<std::optional<transport::Frame>> NextFrame(const FrameRules& rules,
                                                    wire::Header* header = nullptr);
  // Since when the part of a frame that has begun to arrive (its header, or its payload once the
  // header is in) has been incomplete; nullopt when no frame has begun.
  std::optional<Clock::time_point> partial_since() const { return partial_since_; }

  // ---- Sending ------------------------------------------------------------------------------
  // Queues one frame (h.payload_bytes is set) and, when nothing was waiting, writes what the
  // socket takes at once. Dropped when closed or closing. A write error is kept (send_error()).
  void Send(wire::Header h, std::span<const std::byte> payload, Clock::time_point now);
  // The same with the payload in two parts, `head` copied and `tail` shared (a payload that many
  // members get alike is held once).
  void Send(wire::Header h, std::span<const std::byte> head,
            std::shared_ptr<const std::vector<std::byte>> tail, Clock::time_point now);
  // Writes what the socket takes. Closes the connection when it is closing and the queue is empty.
  Status Flush();
  Status send_error() const { return send_error_; }
  size_t queued_bytes() const { return queued_bytes_; }
  // When the oldest frame not completely written was queued; nullopt when nothing waits.
  std::optional<Clock::time_point> oldest_queued() const;

  // ---- Closing ------------------------------------------------------------------------------
  // Closes the socket now; what is queued is dropped.
  void Close();
  // Stops reading frames; the queue is still written, and the socket closed once it is empty
  // (Flush) or at `deadline` (ExpireClose), whichever is first: a refusal or kAbort gets out
  // when the member reads, and a member that does not cannot hold the socket open.
  void CloseAfterFlush(Clock::time_point deadline);
  bool closing() const { return close_deadline_.has_value(); }
  // Closes it when it is closing and `now` is past the deadline.
  void ExpireClose(Clock::time_point now);

 private:
  ControlCounters* counters_ = nullptr;
  struct Chunk {
    std::vector<std::byte> own;  // header (and copied payload)
    std::shared_ptr<const std::vector<std::byte>> shared;  // may be null
    size_t written = 0;  // of own + shared
    Clock::time_point queued;
    size_t size() const { return own.size() + (shared ? shared->size() : 0); }
  };
  void Enqueue(Chunk c);
  size_t unread() const { return in_.size() - in_pos_; }

  std::unique_ptr<transport::ControlChannel> channel_;
  const std::string peer_name_;

  std::vector<std::byte> in_;  // received bytes; in_[in_pos_..] are not yet handed out
  size_t in_pos_ = 0;
  bool header_in_ = false;  // the current frame's header is complete (its payload is arriving)
  Clock::time_point last_read_;
  std::optional<Clock::time_point> partial_since_;
  Status read_error_;  // EOF or a socket error, reported after the frames before it

  std::deque<Chunk> out_;
  size_t queued_bytes_ = 0;  // unwritten bytes in out_
  Status send_error_;
  std::optional<Clock::time_point> close_deadline_;
};

}  // namespace gradlink::scheduler
