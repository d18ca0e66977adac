// Tests of the control channel (src/control/control_channel.h) over a socketpair, with the other
// end a raw socket where a test must write bytes no ControlChannel would (bad headers, a header
// whose payload never comes), and over loopback TCP through Listener / Connect. Every wait has a
// deadline: a test fails, it never hangs.
#include "control/control_channel.h"

#include <gtest/gtest.h>
#include <sys/ioctl.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "unit/support/allocation_counter.h"
#include "wire/frame.h"

namespace gradlink::transport {
namespace {

using namespace std::chrono_literals;

Clock::time_point In(Clock::duration d) { return Clock::now() + d; }

wire::Header ControlHeader(wire::MsgType type, uint64_t cookie = 0) {
  wire::Header h;
  h.type = type;
  h.job = wire::JobHash("control-test");
  h.sender = 4;
  h.cookie = cookie;
  return h;
}

std::vector<std::byte> Bytes(size_t n, uint8_t seed) {
  std::vector<std::byte> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = std::byte(static_cast<uint8_t>(seed + 7 * i));
  return v;
}

// Bytes waiting to be read on `fd`.
int Pending(int fd) {
  int n = -1;
  EXPECT_EQ(::ioctl(fd, FIONREAD, &n), 0) << std::strerror(errno);
  return n;
}

void WriteRaw(int fd, std::span<const std::byte> bytes) {
  ASSERT_EQ(::send(fd, bytes.data(), bytes.size(), MSG_NOSIGNAL), ssize_t(bytes.size()))
      << std::strerror(errno);
}

// A ControlChannel on one end of a socketpair; the other end raw (`peer_`) or, through
// Wrap(), a second ControlChannel.
class ControlChannelTest : public ::testing::Test {
 protected:
  void SetUp() override {
    int fds[2];
    ASSERT_EQ(::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, fds), 0);
    channel_ = std::make_unique<ControlChannel>(fds[0], "the peer");
    peer_ = fds[1];
  }
  void TearDown() override {
    if (peer_ >= 0) ::close(peer_);
  }
  // The raw end as a ControlChannel (it owns the fd from then on).
  std::unique_ptr<ControlChannel> Wrap() {
    auto c = std::make_unique<ControlChannel>(peer_, "the channel");
    peer_ = -1;
    return c;
  }

  std::unique_ptr<ControlChannel> channel_;
  int peer_ = -1;
};

TEST_F(ControlChannelTest, FramesGoBothWaysInOrder) {
  std::unique_ptr<ControlChannel> other = Wrap();
  const std::vector<std::byte> payload = Bytes(5000, 3);
  ASSERT_TRUE(channel_->Send(ControlHeader(wire::MsgType::kDeclare, 1), payload).ok());
  ASSERT_TRUE(channel_->Send(ControlHeader(wire::MsgType::kBarrier, 2), {}).ok());
  Result<Frame> f1 = other->Receive(In(5s));
  ASSERT_TRUE(f1.ok()) << f1.status().ToString();
  EXPECT_EQ(f1->header.type, wire::MsgType::kDeclare);
  EXPECT_EQ(f1->header.cookie, 1u);
  EXPECT_EQ(f1->header.sender, 4u);
  EXPECT_EQ(f1->header.payload_bytes, payload.size());  // set by Send()
  EXPECT_EQ(f1->payload, payload);
  Result<Frame> f2 = other->Receive(In(5s));
  ASSERT_TRUE(f2.ok()) << f2.status().ToString();
  EXPECT_EQ(f2->header.type, wire::MsgType::kBarrier);
  EXPECT_TRUE(f2->payload.empty());
  // And back.
  ASSERT_TRUE(other->Send(ControlHeader(wire::MsgType::kBarrierRelease, 3), payload).ok());
  Result<Frame> f3 = channel_->Receive(In(5s));
  ASSERT_TRUE(f3.ok()) << f3.status().ToString();
  EXPECT_EQ(f3->header.cookie, 3u);
  EXPECT_EQ(f3->payload, payload);
}

// A payload larger than the socket buffers: Send() waits for the reader instead of failing.
TEST_F(ControlChannelTest, PayloadLargerThanTheSocketBuffer) {
  std::unique_ptr<ControlChannel> other = Wrap();
  const std::vector<std::byte> payload = Bytes(wire::kMaxControlPayload, 9);
  Status sent;
  std::thread sender([&] { sent = channel_->Send(ControlHeader(wire::MsgType::kAssign), payload); });
  Result<Frame> f = other->Receive(In(10s));
  sender.join();
  EXPECT_TRUE(sent.ok()) << sent.ToString();
  ASSERT_TRUE(f.ok()) << f.status().ToString();
  EXPECT_EQ(f->payload, payload);
}

TEST_F(ControlChannelTest, DeadlineIsTimeoutAndTheStreamStaysUsable) {
  const auto start = Clock::now();
  Result<Frame> f = channel_->Receive(In(150ms));
  EXPECT_EQ(f.status().code(), Code::kTimeout) << f.status().ToString();
  EXPECT_GE(Clock::now() - start, 140ms);
  EXPECT_LT(Clock::now() - start, 2s);
  EXPECT_FALSE(channel_->closed());
  // A deadline already past: kTimeout at once.
  EXPECT_EQ(channel_->Receive(Clock::now() - 1s).status().code(), Code::kTimeout);
  // The next frame is read whole, as if nothing had happened.
  std::unique_ptr<ControlChannel> other = Wrap();
  const std::vector<std::byte> payload = Bytes(100, 1);
  ASSERT_TRUE(other->Send(ControlHeader(wire::MsgType::kDeclare, 77), payload).ok());
  Result<Frame> g = channel_->Receive(In(5s));
  ASSERT_TRUE(g.ok()) << g.status().ToString();
  EXPECT_EQ(g->header.cookie, 77u);
  EXPECT_EQ(g->payload, payload);
}

// A deadline that falls inside a header is not the end of the stream: the rest of the frame
// gets a grace period and the frame arrives whole.
TEST_F(ControlChannelTest, DeadlineInsideAHeaderWaitsForTheRest) {
  const wire::HeaderBytes hb = wire::EncodeHeader(ControlHeader(wire::MsgType::kBarrier, 5));
  WriteRaw(peer_, std::span<const std::byte>(hb).first(10));
  std::thread rest([&] {
    std::this_thread::sleep_for(300ms);
    WriteRaw(peer_, std::span<const std::byte>(hb).subspan(10));
  });
  Result<Frame> f = channel_->Receive(In(50ms));
  rest.join();
  ASSERT_TRUE(f.ok()) << f.status().ToString();
  EXPECT_EQ(f->header.cookie, 5u);
  EXPECT_FALSE(channel_->closed());
}

TEST_F(ControlChannelTest, BadHeaderIsProtocolErrorAndCloses) {
  wire::HeaderBytes hb = wire::EncodeHeader(ControlHeader(wire::MsgType::kDeclare));
  hb[0] = std::byte{'X'};  // magic
  WriteRaw(peer_, hb);
  Result<Frame> f = channel_->Receive(In(5s));
  EXPECT_EQ(f.status().code(), Code::kProtocolError) << f.status().ToString();
  EXPECT_NE(f.status().message().find("the peer"), std::string::npos) << f.status().message();
  EXPECT_TRUE(channel_->closed());
  // Closed for real: the peer reads end of stream, and a later Receive fails at once.
  char c;
  EXPECT_EQ(::recv(peer_, &c, 1, 0), 0);
  const auto start = Clock::now();
  EXPECT_EQ(channel_->Receive(In(5s)).status().code(), Code::kPeerLost);
  EXPECT_LT(Clock::now() - start, 1s);
}

TEST_F(ControlChannelTest, DataFrameOnTheControlChannelIsProtocolErrorAndCloses) {
  wire::Header h;
  h.type = wire::MsgType::kPush;
  h.dtype = static_cast<uint8_t>(DataType::kFloat32);
  h.count = 1;
  h.payload_bytes = 4;
  WriteRaw(peer_, wire::EncodeHeader(h));
  WriteRaw(peer_, Bytes(4, 0));
  Result<Frame> f = channel_->Receive(In(5s));
  EXPECT_EQ(f.status().code(), Code::kProtocolError) << f.status().ToString();
  EXPECT_TRUE(channel_->closed());
}

TEST_F(ControlChannelTest, PeerThatClosesIsPeerLost) {
  ::close(peer_);
  peer_ = -1;
  const auto start = Clock::now();
  Result<Frame> f = channel_->Receive(In(5s));
  EXPECT_EQ(f.status().code(), Code::kPeerLost) << f.status().ToString();
  EXPECT_LT(Clock::now() - start, 1s);
  EXPECT_EQ(channel_->Send(ControlHeader(wire::MsgType::kBarrier), Bytes(10, 0)).code(),
            Code::kPeerLost);
}

// The oversize payload is refused from its header alone: its bytes were never sent, and the
// answer comes long before the deadline; the header is handed out and the channel left open.
TEST_F(ControlChannelTest, ReceiveBoundedRefusesAnOversizePayloadBeforeReadingIt) {
  wire::Header h = ControlHeader(wire::MsgType::kHello, 21);
  h.payload_bytes = 1000;
  WriteRaw(peer_, wire::EncodeHeader(h));
  wire::Header seen;
  const auto start = Clock::now();
  Result<Frame> f = channel_->ReceiveBounded(In(5s), /*max_payload=*/100, &seen);
  EXPECT_LT(Clock::now() - start, 1s) << "waited for a payload it should not read";
  EXPECT_EQ(f.status().code(), Code::kProtocolError) << f.status().ToString();
  EXPECT_NE(f.status().message().find("1000"), std::string::npos) << f.status().message();
  EXPECT_EQ(seen.type, wire::MsgType::kHello);
  EXPECT_EQ(seen.cookie, 21u);
  EXPECT_FALSE(channel_->closed());  // left open for a last answer
  // Nothing of the payload was taken off the stream.
  WriteRaw(peer_, Bytes(1000, 5));
  const auto deadline = In(5s);
  while (Pending(channel_->fd()) < 1000 && Clock::now() < deadline) std::this_thread::sleep_for(1ms);
  EXPECT_EQ(Pending(channel_->fd()), 1000);
  // The last answer goes out.
  ASSERT_TRUE(channel_->Send(ControlHeader(wire::MsgType::kAbort), {}).ok());
  std::byte got[wire::kHeaderSize];
  EXPECT_EQ(::recv(peer_, got, sizeof(got), MSG_WAITALL), ssize_t(sizeof(got)));
}

TEST_F(ControlChannelTest, ReceiveBoundedTakesAPayloadWithinTheLimit) {
  std::unique_ptr<ControlChannel> other = Wrap();
  const std::vector<std::byte> payload = Bytes(100, 2);
  ASSERT_TRUE(other->Send(ControlHeader(wire::MsgType::kHello, 1), payload).ok());
  Result<Frame> f = channel_->ReceiveBounded(In(5s), 100);
  ASSERT_TRUE(f.ok()) << f.status().ToString();
  EXPECT_EQ(f->payload, payload);
  // Nothing read: kTimeout, and the stream stays usable.
  EXPECT_EQ(channel_->ReceiveBounded(In(50ms), 100).status().code(), Code::kTimeout);
  EXPECT_FALSE(channel_->closed());
}

// The deadline is hard for an unauthenticated peer: one that stalls mid-frame gets kTimeout at
// the deadline (no grace), and the channel is closed.
TEST_F(ControlChannelTest, ReceiveBoundedDeadlineIsHardInsideAFrame) {
  wire::Header h = ControlHeader(wire::MsgType::kHello);
  h.payload_bytes = 50;
  WriteRaw(peer_, wire::EncodeHeader(h));
  WriteRaw(peer_, Bytes(10, 0));  // 40 bytes short
  const auto start = Clock::now();
  Result<Frame> f = channel_->ReceiveBounded(In(200ms), 100);
  EXPECT_EQ(f.status().code(), Code::kTimeout) << f.status().ToString();
  EXPECT_LT(Clock::now() - start, 2s);
  EXPECT_TRUE(channel_->closed());
}

TEST_F(ControlChannelTest, CloseWakesABlockedReceive) {
  Status got;
  Clock::time_point returned;
  std::thread reader([&] {
    got = channel_->Receive(In(20s)).status();
    returned = Clock::now();
  });
  std::this_thread::sleep_for(100ms);
  const auto closed_at = Clock::now();
  channel_->Close();
  reader.join();
  EXPECT_EQ(got.code(), Code::kPeerLost) << got.ToString();
  EXPECT_LT(returned - closed_at, 1s);
  EXPECT_TRUE(channel_->closed());
  channel_->Close();  // idempotent
}

// The members' control loops wait with WaitReadable every 100 ms while nothing comes: an idle
// wait allocates nothing (a Receive() that times out builds its message: this test's reference).
TEST_F(ControlChannelTest, WaitReadableIsFalseAtTheDeadlineAndAllocatesNothing) {
  bool readable = false;
  const auto started = Clock::now();
  EXPECT_EQ(test::AllocationsBy([&] {
              for (int i = 0; i < 5; ++i) readable |= channel_->WaitReadable(In(2ms));
            }).count,
            0u);
  EXPECT_FALSE(readable);
  EXPECT_GE(Clock::now() - started, 10ms);
  Status timed_out;
  EXPECT_GT(test::AllocationsBy([&] { timed_out = channel_->Receive(In(2ms)).status(); }).count,
            0u);
  EXPECT_EQ(timed_out.code(), Code::kTimeout) << timed_out.ToString();
}

TEST_F(ControlChannelTest, WaitReadableSeesAFrameAnEndAndAClose) {
  std::unique_ptr<ControlChannel> other = Wrap();
  ASSERT_TRUE(other->Send(ControlHeader(wire::MsgType::kHeartbeat, 5), {}, In(1s)).ok());
  ASSERT_TRUE(channel_->WaitReadable(In(5s)));
  Result<Frame> f = channel_->Receive(In(1s));
  ASSERT_TRUE(f.ok()) << f.status().ToString();
  EXPECT_EQ(f->header.cookie, 5u);
  EXPECT_FALSE(channel_->WaitReadable(In(5ms)));  // that frame was all

  other.reset();  // the peer's end closes: readable, and Receive says so
  ASSERT_TRUE(channel_->WaitReadable(In(5s)));
  EXPECT_EQ(channel_->Receive(In(1s)).status().code(), Code::kPeerLost);
}

TEST_F(ControlChannelTest, CloseWakesAWaitReadable) {
  bool readable = false;
  Clock::time_point returned;
  std::thread waiter([&] {
    readable = channel_->WaitReadable(In(20s));
    returned = Clock::now();
  });
  std::this_thread::sleep_for(100ms);
  const auto closed_at = Clock::now();
  channel_->Close();
  waiter.join();
  EXPECT_TRUE(readable);
  EXPECT_LT(returned - closed_at, 1s);
  EXPECT_EQ(channel_->Receive(In(1s)).status().code(), Code::kPeerLost);
}

TEST(ListenerTest, ConnectAcceptAndTalkOverLoopback) {
  Result<std::unique_ptr<Listener>> l = Listener::Listen("127.0.0.1", 0);
  ASSERT_TRUE(l.ok()) << l.status().ToString();
  const uint16_t port = (*l)->port();
  ASSERT_NE(port, 0);
  Result<std::unique_ptr<ControlChannel>> client = ControlChannel::Connect("127.0.0.1", port, In(5s));
  ASSERT_TRUE(client.ok()) << client.status().ToString();
  Result<std::unique_ptr<ControlChannel>> server = (*l)->Accept(In(5s));
  ASSERT_TRUE(server.ok()) << server.status().ToString();
  const std::vector<std::byte> payload = Bytes(3000, 8);
  ASSERT_TRUE((*client)->Send(ControlHeader(wire::MsgType::kRegister, 9), payload).ok());
  Result<Frame> f = (*server)->Receive(In(5s));
  ASSERT_TRUE(f.ok()) << f.status().ToString();
  EXPECT_EQ(f->header.cookie, 9u);
  EXPECT_EQ(f->payload, payload);
  // Nobody else comes: Accept times out.
  EXPECT_EQ((*l)->Accept(In(100ms)).status().code(), Code::kTimeout);
}

TEST(ListenerTest, ConnectToNothingFailsAtTheDeadline) {
  Result<std::unique_ptr<Listener>> l = Listener::Listen("127.0.0.1", 0);
  ASSERT_TRUE(l.ok());
  const uint16_t port = (*l)->port();
  (*l)->Close();  // the port is free again, nobody listens
  const auto start = Clock::now();
  auto c = ControlChannel::Connect("127.0.0.1", port, In(300ms));
  EXPECT_EQ(c.status().code(), Code::kUnavailable) << c.status().ToString();
  EXPECT_GE(Clock::now() - start, 250ms);
  EXPECT_LT(Clock::now() - start, 3s);
}

TEST(ListenerTest, ConnectGivesUpOnAnAddressThatRefusesForTheGrace) {
  Result<std::unique_ptr<Listener>> l = Listener::Listen("127.0.0.1", 0);
  ASSERT_TRUE(l.ok());
  const uint16_t port = (*l)->port();
  (*l)->Close();
  const auto start = Clock::now();
  auto c = ControlChannel::Connect("127.0.0.1", port, In(60s), 400ms);
  const auto took = Clock::now() - start;
  EXPECT_EQ(c.status().code(), Code::kUnavailable) << c.status().ToString();
  EXPECT_NE(c.status().message().find("no gradlink job is running there"), std::string::npos)
      << c.status().ToString();
  EXPECT_GE(took, 400ms);
  EXPECT_LT(took, 5s);  // not the 60 s deadline
  // A listener that appears within the grace is found.
  std::unique_ptr<Listener> late;
  std::thread t([&] {
    std::this_thread::sleep_for(200ms);
    auto relisten = Listener::Listen("127.0.0.1", port);
    if (relisten.ok()) late = std::move(relisten).value();
  });
  auto d = ControlChannel::Connect("127.0.0.1", port, In(10s), 2s);
  t.join();
  if (late) {  // (else another process took the port meanwhile)
    EXPECT_TRUE(d.ok()) << d.status().ToString();
  }
}

TEST(ParseHostPortTest, SplitsAndRefuses) {
  std::string host;
  uint16_t port = 0;
  ASSERT_TRUE(ParseHostPort("10.0.0.1:7000", &host, &port).ok());
  EXPECT_EQ(host, "10.0.0.1");
  EXPECT_EQ(port, 7000);
  for (const char* bad : {"", "host", "host:", ":80", "host:99999", "host:8x"}) {
    EXPECT_EQ(ParseHostPort(bad, &host, &port).code(), Code::kInvalidArgument) << bad;
  }
}

}  // namespace
}  // namespace gradlink::transport
