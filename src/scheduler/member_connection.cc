#include "scheduler/member_connection.h"

#include <sys/socket.h>
#include <sys/uio.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

namespace gradlink::scheduler {
namespace {

// Chunks written per writev().
constexpr size_t kMaxIov = 32;

}  // namespace

MemberConnection::MemberConnection(std::unique_ptr<transport::ControlChannel> channel)
    : channel_(std::move(channel)), peer_name_(channel_->peer_name()) {}

short MemberConnection::PollEvents() const {
  if (closed()) return 0;
  // Once EOF or an error was read, the socket stays readable: polling for it again would spin.
  return static_cast<short>((read_error_.ok() ? POLLIN : 0) | (out_.empty() ? 0 : POLLOUT));
}

void MemberConnection::ReadSome(Clock::time_point now) {
  if (closed() || !read_error_.ok()) return;
  // Compact: what was handed out goes, so the buffer holds at most one frame plus a chunk.
  if (in_pos_ > 0) {
    in_.erase(in_.begin(), in_.begin() + static_cast<std::ptrdiff_t>(in_pos_));
    in_pos_ = 0;
  }
  const size_t had = in_.size();
  in_.resize(had + kReadChunk);
  ssize_t r;
  do {
    r = ::recv(fd(), in_.data() + had, kReadChunk, 0);
  } while (r < 0 && errno == EINTR);
  in_.resize(had + static_cast<size_t>(std::max<ssize_t>(r, 0)));
  if (r == 0) {
    read_error_ = PeerLost(peer_name_ + " closed the connection");
  } else if (r < 0 && errno != EAGAIN && errno != EWOULDBLOCK) {
    read_error_ = PeerLost("receiving from " + peer_name_ + ": " + std::strerror(errno));
  }
  if (r <= 0) return;
  last_read_ = now;
  if (closing()) {
    in_.clear();  // nothing more of it is processed; reading keeps the peer from blocking
    return;
  }
  if (had == 0) partial_since_ = now;  // a frame has begun
}

Result<std::optional<transport::Frame>> MemberConnection::NextFrame(const FrameRules& rules,
                                                                    wire::Header* header) {
  if (closed() || closing()) return std::optional<transport::Frame>();
  const auto incomplete = [&]() -> Result<std::optional<transport::Frame>> {
    if (!read_error_.ok()) return read_error_;  // the peer is gone mid-frame, or between frames
    return std::optional<transport::Frame>();
  };
  if (unread() < wire::kHeaderSize) return incomplete();
  const std::span<const std::byte> hb(in_.data() + in_pos_, wire::kHeaderSize);
  Result<wire::Header> h = wire::DecodeHeader(hb);
  if (!h.ok()) return ProtocolError("from " + peer_name_ + ": " + h.status().message());
  if (!wire::IsControlType(h->type) &&
      !(rules.allow_data_error && h->type == wire::MsgType::kDataError)) {
    return ProtocolError("from " + peer_name_ + ": data frame on the control connection");
  }
  if (header != nullptr) *header = *h;
  if (h->payload_bytes > rules.max_payload) {
    return ProtocolError("from " + peer_name_ + ": payload of " +
                         std::to_string(h->payload_bytes) + " bytes exceeds " +
                         std::to_string(rules.max_payload) + " before authentication");
  }
  // payload_bytes <= kMaxControlPayload (DecodeHeader), so the sum cannot overflow.
  const size_t frame_bytes = wire::kHeaderSize + static_cast<size_t>(h->payload_bytes);
  if (unread() < frame_bytes) {
    if (!header_in_) {
      // The payload gets its own grace from when the header was complete (as Receive allows).
      header_in_ = true;
      partial_since_ = last_read_;
    }
    return incomplete();
  }
  transport::Frame f;
  f.header = *h;
  const std::byte* p = in_.data() + in_pos_ + wire::kHeaderSize;
  f.payload.assign(p, p + h->payload_bytes);
  in_pos_ += frame_bytes;
  header_in_ = false;
  if (unread() > 0) {
    partial_since_ = last_read_;  // the next frame began with the last read
  } else {
    partial_since_.reset();
  }
  if (counters_ != nullptr) {
    counters_->frames_in.fetch_add(1, std::memory_order_relaxed);
    counters_->bytes_in.fetch_add(frame_bytes, std::memory_order_relaxed);
  }
  return std::optional<transport::Frame>(std::move(f));
}

void MemberConnection::Send(wire::Header h, std::span<const std::byte> payload,
                            Clock::time_point now) {
  Send(h, payload, nullptr, now);
}

void MemberConnection::Send(wire::Header h, std::span<const std::byte> head,
                            std::shared_ptr<const std::vector<std::byte>> tail,
                            Clock::time_point now) {
  if (closed() || closing()) return;
  h.payload_bytes = head.size() + (tail ? tail->size() : 0);
  const wire::HeaderBytes hb = wire::EncodeHeader(h);
  Chunk c;
  c.own.reserve(hb.size() + head.size());
  c.own.insert(c.own.end(), hb.begin(), hb.end());
  c.own.insert(c.own.end(), head.begin(), head.end());
  if (tail && !tail->empty()) c.shared = std::move(tail);
  c.queued = now;
  if (counters_ != nullptr) {
    counters_->frames_out.fetch_add(1, std::memory_order_relaxed);
    counters_->bytes_out.fetch_add(c.size(), std::memory_order_relaxed);
  }
  Enqueue(std::move(c));
}

void MemberConnection::Enqueue(Chunk c) {
  const bool was_empty = out_.empty();
  queued_bytes_ += c.size();
  out_.push_back(std::move(c));
  // When bytes already wait, the socket is full: poll() says when to write again.
  if (was_empty && send_error_.ok()) Flush().IgnoreError();
}

Status MemberConnection::Flush() {
  if (closed()) return send_error_;
  while (!out_.empty() && send_error_.ok()) {
    iovec iov[2 * kMaxIov];
    int n = 0;
    for (size_t i = 0; i < out_.size() && i < kMaxIov; ++i) {
      const Chunk& c = out_[i];
      size_t skip = i == 0 ? c.written : 0;
      if (skip < c.own.size()) {
        iov[n++] = {const_cast<std::byte*>(c.own.data()) + skip, c.own.size() - skip};
        skip = 0;
      } else {
        skip -= c.own.size();
      }
      if (c.shared && skip < c.shared->size()) {
        iov[n++] = {const_cast<std::byte*>(c.shared->data()) + skip, c.shared->size() - skip};
      }
    }
    msghdr msg{};
    msg.msg_iov = iov;
    msg.msg_iovlen = static_cast<size_t>(n);
    const ssize_t w = ::sendmsg(fd(), &msg, MSG_NOSIGNAL);
    if (w < 0) {
      if (errno == EINTR) continue;
      if (errno == EAGAIN || errno == EWOULDBLOCK) break;
      // Kept, not acted on here: the socket stays open for reading, since what the peer sent
      // before it went (a goodbye) is still to be read; the owner closes it after that.
      send_error_ = PeerLost("sending to " + peer_name_ + ": " + std::strerror(errno));
      out_.clear();
      queued_bytes_ = 0;
      break;
    }
    size_t left = static_cast<size_t>(w);
    queued_bytes_ -= left;
    while (left > 0) {
      Chunk& c = out_.front();
      const size_t take = std::min(left, c.size() - c.written);
      c.written += take;
      left -= take;
      if (c.written == c.size()) out_.pop_front();
    }
  }
  if (closing() && out_.empty()) Close();
  return send_error_;
}

std::optional<Clock::time_point> MemberConnection::oldest_queued() const {
  if (out_.empty()) return std::nullopt;
  return out_.front().queued;
}

void MemberConnection::Close() {
  if (closed()) return;
  // Shut down before close: a peer blocked in its own read sees the end at once.
  channel_->Close();
  channel_.reset();
  out_.clear();
  queued_bytes_ = 0;
  in_.clear();
  in_pos_ = 0;
  partial_since_.reset();
  close_deadline_.reset();
}

void MemberConnection::CloseAfterFlush(Clock::time_point deadline) {
  if (closed()) return;
  if (!close_deadline_.has_value() || deadline < *close_deadline_) close_deadline_ = deadline;
  in_.clear();
  in_pos_ = 0;
  partial_since_.reset();
  Flush().IgnoreError();  // closes it when nothing waits
}

void MemberConnection::ExpireClose(Clock::time_point now) {
  if (closing() && now >= *close_deadline_) Close();
}

}  // namespace gradlink::scheduler
