// What the lane suites share (lane_contract_test.cc, inproc_test.cc, ucx_test.cc): a Receiver
// that records everything a lane delivers, send-completion collectors, payload patterns and
// headers the real decoder accepts. Every wait has a deadline and fails instead of hanging.
#pragma once

#include <gtest/gtest.h>

#include <chrono>
#include <condition_variable>
#include <functional>
#include <list>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "transport/transport.h"
#include "wire/frame.h"

namespace gradlink::transport::test {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

inline constexpr auto kDeadline = 10s;

inline std::vector<std::byte> Pattern(size_t n, uint32_t seed) {
  std::vector<std::byte> v(n);
  uint32_t x = seed * 2654435761u + 1;
  for (size_t i = 0; i < n; ++i) {
    x = x * 1664525u + 1013904223u;
    v[i] = std::byte(x >> 24);
  }
  return v;
}

// A header that the real decoder accepts for a payload of `bytes`: a data frame when the size
// holds whole fp32 elements, otherwise a control frame.
inline wire::Header MakeHeader(size_t bytes, uint64_t cookie) {
  wire::Header h;
  if (bytes % 4 == 0 && bytes > 0) {
    h.type = wire::MsgType::kPush;
    h.dtype = static_cast<uint8_t>(DataType::kFloat32);
    h.count = bytes / 4;
  } else {
    h.type = wire::MsgType::kDeclare;
  }
  h.flags = 0;
  h.job = 0xA1B2C3D4u;
  h.sender = 7;
  h.key = 0x1122334455667788ull;
  h.partition = 3;
  h.round = 42;
  h.payload_bytes = bytes;
  h.cookie = cookie;
  return h;
}

inline void ExpectSameHeader(const wire::Header& a, const wire::Header& b) {
  EXPECT_EQ(a.type, b.type);
  EXPECT_EQ(a.flags, b.flags);
  EXPECT_EQ(a.job, b.job);
  EXPECT_EQ(a.sender, b.sender);
  EXPECT_EQ(a.key, b.key);
  EXPECT_EQ(a.partition, b.partition);
  EXPECT_EQ(a.dtype, b.dtype);
  EXPECT_EQ(a.code, b.code);
  EXPECT_EQ(a.round, b.round);
  EXPECT_EQ(a.count, b.count);
  EXPECT_EQ(a.payload_bytes, b.payload_bytes);
  EXPECT_EQ(a.cookie, b.cookie);
}

// Records what a lane delivers, and on which thread. By default each payload gets its own
// buffer; SetPick() overrides (the pick runs without the recorder's lock held).
class TestReceiver : public Receiver {
 public:
  struct Frame {
    wire::Header header;
    std::vector<std::byte> data;
    const std::byte* where = nullptr;
    std::thread::id thread;
  };

  Result<std::span<std::byte>> OnHeader(const wire::Header& h) override {
    std::function<Result<std::span<std::byte>>(const wire::Header&)> pick;
    {
      std::lock_guard<std::mutex> lock(mu_);
      ++headers_;
      header_thread_ = std::this_thread::get_id();
      pick = pick_;
    }
    if (pick) return pick(h);
    std::lock_guard<std::mutex> lock(mu_);
    buffers_.emplace_back(h.payload_bytes);
    return std::span<std::byte>(buffers_.back());
  }

  void OnPayload(const wire::Header& h, std::span<std::byte> payload) override {
    std::lock_guard<std::mutex> lock(mu_);
    frames_.push_back(Frame{h, std::vector<std::byte>(payload.begin(), payload.end()),
                            payload.data(), std::this_thread::get_id()});
    cv_.notify_all();
  }

  void OnReceiveFailed(const wire::Header& h, const Status& status) override {
    std::lock_guard<std::mutex> lock(mu_);
    receive_failures_.emplace_back(h, status);
    cv_.notify_all();
  }

  void OnPeerFailed(PeerId peer, const Status& status) override {
    std::lock_guard<std::mutex> lock(mu_);
    peer_failures_.emplace_back(peer, status);
    peer_failed_thread_ = std::this_thread::get_id();
    cv_.notify_all();
  }

  bool KeepsBuffersIfAbandoned() const override { return keeps_buffers_; }
  bool keeps_buffers_ = false;  // set before Start()

  void SetPick(std::function<Result<std::span<std::byte>>(const wire::Header&)> pick) {
    std::lock_guard<std::mutex> lock(mu_);
    pick_ = std::move(pick);
  }

  // Waits until `pred` (called under the lock: it reads the members directly) holds; false on
  // deadline.
  bool WaitFor(const std::function<bool()>& pred, std::chrono::milliseconds timeout = kDeadline) {
    std::unique_lock<std::mutex> lock(mu_);
    return cv_.wait_for(lock, timeout, pred);
  }
  bool WaitFrames(size_t n) {
    return WaitFor([&] { return frames_.size() >= n; });
  }

  size_t frame_count() {
    std::lock_guard<std::mutex> lock(mu_);
    return frames_.size();
  }
  int headers() {
    std::lock_guard<std::mutex> lock(mu_);
    return headers_;
  }
  std::vector<Frame> frames() {
    std::lock_guard<std::mutex> lock(mu_);
    return frames_;
  }
  std::vector<std::pair<wire::Header, Status>> receive_failures() {
    std::lock_guard<std::mutex> lock(mu_);
    return receive_failures_;
  }
  std::vector<std::pair<PeerId, Status>> peer_failures() {
    std::lock_guard<std::mutex> lock(mu_);
    return peer_failures_;
  }
  std::thread::id header_thread() {
    std::lock_guard<std::mutex> lock(mu_);
    return header_thread_;
  }
  std::thread::id peer_failed_thread() {
    std::lock_guard<std::mutex> lock(mu_);
    return peer_failed_thread_;
  }

  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<Frame> frames_;
  std::vector<std::pair<wire::Header, Status>> receive_failures_;
  std::vector<std::pair<PeerId, Status>> peer_failures_;
  int headers_ = 0;

 private:
  std::function<Result<std::span<std::byte>>(const wire::Header&)> pick_;
  std::list<std::vector<std::byte>> buffers_;
  std::thread::id header_thread_, peer_failed_thread_;
};

// Collects one send's completion; counts calls so a second `done` is caught.
struct SendWaiter {
  std::mutex mu;
  std::condition_variable cv;
  std::optional<Status> status;
  int calls = 0;

  SendCallback Callback() {
    return [this](const Status& s) {
      std::lock_guard<std::mutex> lock(mu);
      ++calls;
      status = s;
      cv.notify_all();
    };
  }
  // The status, or nullopt on deadline.
  std::optional<Status> Wait(std::chrono::milliseconds timeout = kDeadline) {
    std::unique_lock<std::mutex> lock(mu);
    cv.wait_for(lock, timeout, [&] { return status.has_value(); });
    return status;
  }
};

// Collects the completions of many sends, and the threads they ran on.
class Completions {
 public:
  SendCallback Callback() {
    return [this](const Status& s) {
      std::lock_guard<std::mutex> lock(mu_);
      statuses_.push_back(s);
      threads_.push_back(std::this_thread::get_id());
      cv_.notify_all();
    };
  }
  bool WaitFor(size_t n, Clock::duration d = kDeadline) {
    std::unique_lock<std::mutex> lock(mu_);
    return cv_.wait_for(lock, d, [&] { return statuses_.size() >= n; });
  }
  std::vector<Status> statuses() {
    std::lock_guard<std::mutex> lock(mu_);
    return statuses_;
  }
  std::vector<std::thread::id> threads() {
    std::lock_guard<std::mutex> lock(mu_);
    return threads_;
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<Status> statuses_;
  std::vector<std::thread::id> threads_;
};

// The id of a lane's progress thread, learned through Defer().
inline std::thread::id ProgressThread(Lane& lane) {
  std::mutex mu;
  std::condition_variable cv;
  std::optional<std::thread::id> id;
  lane.Defer([&] {
    std::lock_guard<std::mutex> lock(mu);
    id = std::this_thread::get_id();
    cv.notify_all();
  });
  std::unique_lock<std::mutex> lock(mu);
  EXPECT_TRUE(cv.wait_for(lock, kDeadline, [&] { return id.has_value(); }));
  return id.value_or(std::thread::id());
}

// A sends to B after B stopped: within the deadline a send fails with kPeerLost naming the
// peer, OnPeerFailed is reported exactly once (for that peer, on A's progress thread), a
// rendezvous send in flight fails too, every earlier send completes exactly once, and later
// sends fail at once with the same error. (ucx_test.cc runs it again with UCX_TLS=tcp.)
inline void ExpectStoppedPeerDetected(Fabric& fabric) {
  TestReceiver ra, rb;
  auto a = fabric.CreateLane("A");
  auto b = fabric.CreateLane("B");
  ASSERT_TRUE(a.ok() && b.ok());
  ASSERT_TRUE((*a)->Start(&ra).ok());
  ASSERT_TRUE((*b)->Start(&rb).ok());
  auto peer = (*a)->Connect((*b)->address(), "server 1 (stopped)");
  ASSERT_TRUE(peer.ok());

  std::vector<std::byte> data = Pattern(256, 1);
  SendWaiter first;
  (*a)->Send(*peer, MakeHeader(256, 1), data, first.Callback());
  ASSERT_TRUE(first.Wait().value_or(Timeout("")).ok());
  ASSERT_TRUE(rb.WaitFor([&] { return rb.frames_.size() == 1; }));

  (*b)->Stop();

  // A rendezvous send in flight when the peer goes away fails too.
  std::vector<std::byte> big = Pattern(8u << 20, 2);
  SendWaiter big_send;
  (*a)->Send(*peer, MakeHeader(big.size(), 2), big, big_send.Callback());

  std::optional<Status> failure;
  std::vector<std::unique_ptr<SendWaiter>> waiters;
  const auto deadline = Clock::now() + kDeadline;
  while (!failure && Clock::now() < deadline) {
    waiters.push_back(std::make_unique<SendWaiter>());
    (*a)->Send(*peer, MakeHeader(256, 2), data, waiters.back()->Callback());
    auto s = waiters.back()->Wait(20ms);
    if (s && !s->ok()) failure = s;
    if (!ra.peer_failures().empty()) failure = ra.peer_failures()[0].second;
  }
  ASSERT_TRUE(failure.has_value()) << "no failure reported within the deadline";
  EXPECT_EQ(failure->code(), Code::kPeerLost) << failure->ToString();
  EXPECT_NE(failure->message().find("server 1 (stopped)"), std::string::npos)
      << failure->ToString();

  // OnPeerFailed exactly once, every earlier send completes, later sends fail at once.
  ASSERT_TRUE(ra.WaitFor([&] { return ra.peer_failures_.size() == 1; }));
  EXPECT_EQ(ra.peer_failures()[0].first, *peer);
  EXPECT_EQ(ra.peer_failures()[0].second.code(), Code::kPeerLost);
  for (auto& w : waiters) ASSERT_TRUE(w->Wait().has_value());
  auto big_status = big_send.Wait();
  ASSERT_TRUE(big_status.has_value());
  EXPECT_EQ(big_status->code(), Code::kPeerLost) << big_status->ToString();
  SendWaiter after;
  (*a)->Send(*peer, MakeHeader(256, 3), data, after.Callback());
  auto s = after.Wait(1000ms);
  ASSERT_TRUE(s.has_value());
  EXPECT_EQ(s->code(), Code::kPeerLost);
  EXPECT_EQ(s->message(), ra.peer_failures()[0].second.message());
  std::this_thread::sleep_for(50ms);
  EXPECT_EQ(ra.peer_failures().size(), 1u) << "OnPeerFailed must be reported once";
  for (auto& w : waiters) EXPECT_EQ(w->calls, 1) << "done must run exactly once per send";
  EXPECT_EQ(big_send.calls, 1);
  EXPECT_EQ(ra.peer_failed_thread(), ProgressThread(**a));
  EXPECT_EQ(rb.frame_count(), 1u);
  (*a)->Stop();
}

}  // namespace gradlink::transport::test
