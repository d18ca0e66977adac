// MemberConnection (src/scheduler/member_connection.h) over a socketpair: frames that arrive in
// pieces are reassembled in order, frames are validated as ControlChannel validates them, EOF
// comes after the frames before it, the send queue holds what a full socket does not take and
// writes it in order once the peer reads, shared payload tails arrive intact, and closing waits
// for the queue or its deadline.
#include "scheduler/member_connection.h"

#include <gtest/gtest.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cstring>
#include <memory>
#include <thread>
#include <vector>

#include "wire/messages.h"

namespace gradlink::scheduler {
namespace {

using namespace std::chrono_literals;
using wire::MsgType;

class MemberConnectionTest : public ::testing::Test {
 protected:
  void SetUp() override {
    int sv[2];
    ASSERT_EQ(::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv), 0);
    conn_ = std::make_unique<MemberConnection>(
        std::make_unique<transport::ControlChannel>(sv[0], "peer"));
    peer_ = sv[1];
  }
  void TearDown() override {
    if (peer_ >= 0) ::close(peer_);
  }

  static std::vector<std::byte> Encoded(MsgType t, std::span<const std::byte> payload,
                                        uint64_t round = 0) {
    wire::Header h;
    h.type = t;
    h.job = 7;
    h.round = round;
    h.payload_bytes = payload.size();
    const wire::HeaderBytes hb = wire::EncodeHeader(h);
    std::vector<std::byte> out(hb.begin(), hb.end());
    out.insert(out.end(), payload.begin(), payload.end());
    return out;
  }
  void PeerWrite(std::span<const std::byte> bytes) {
    ASSERT_EQ(::send(peer_, bytes.data(), bytes.size(), MSG_NOSIGNAL), ssize_t(bytes.size()));
  }
  // Reads until the connection has something for NextFrame (or 1 s passed).
  void ReadWhenReady() {
    pollfd p{conn_->fd(), POLLIN, 0};
    ::poll(&p, 1, 1000);
    conn_->ReadSome(Clock::now());
  }
  // Everything the peer can read within `wait`.
  std::vector<std::byte> PeerReadAll(std::chrono::milliseconds wait) {
    std::vector<std::byte> got;
    std::byte buf[65536];
    const auto deadline = Clock::now() + wait;
    while (Clock::now() < deadline) {
      conn_->Flush().IgnoreError();
      const ssize_t n = ::recv(peer_, buf, sizeof(buf), MSG_DONTWAIT);
      if (n > 0) {
        got.insert(got.end(), buf, buf + n);
        continue;
      }
      if (n == 0) break;
      if (conn_->queued_bytes() == 0 && !got.empty()) break;
      std::this_thread::sleep_for(1ms);
    }
    return got;
  }

  std::unique_ptr<MemberConnection> conn_;
  int peer_ = -1;
};

TEST_F(MemberConnectionTest, FramesArrivingInPiecesAreReassembledInOrder) {
  std::vector<std::byte> stream;
  for (uint64_t r = 1; r <= 3; ++r) {
    const auto text = wire::EncodeText("frame " + std::to_string(r));
    const auto f = Encoded(MsgType::kBarrier, text, r);
    stream.insert(stream.end(), f.begin(), f.end());
  }
  EXPECT_FALSE(conn_->partial_since().has_value());
  std::vector<uint64_t> rounds;
  size_t consumed = 0;
  // Byte pieces of 7: every header and payload is split at least once.
  for (size_t off = 0; off < stream.size(); off += 7) {
    const size_t n = std::min<size_t>(7, stream.size() - off);
    PeerWrite(std::span(stream).subspan(off, n));
    ReadWhenReady();
    while (true) {
      auto f = conn_->NextFrame({});
      ASSERT_TRUE(f.ok()) << f.status().ToString();
      if (!f->has_value()) break;
      rounds.push_back((*f)->header.round);
      consumed += wire::kHeaderSize + (*f)->payload.size();
      auto text = wire::DecodeText((*f)->payload);
      ASSERT_TRUE(text.ok());
      EXPECT_EQ(*text, "frame " + std::to_string((*f)->header.round));
    }
    // A frame has begun exactly when bytes arrived that no frame handed out has covered.
    EXPECT_EQ(conn_->partial_since().has_value(), consumed < off + n) << off;
  }
  EXPECT_EQ(rounds, (std::vector<uint64_t>{1, 2, 3}));
  EXPECT_FALSE(conn_->partial_since().has_value());
}

TEST_F(MemberConnectionTest, PayloadOverTheBoundIsRefusedOnItsHeader) {
  wire::Header h;
  h.type = MsgType::kHello;
  h.job = 7;
  h.payload_bytes = 1000;
  const wire::HeaderBytes hb = wire::EncodeHeader(h);
  PeerWrite(hb);  // the payload never comes: the header alone is refused
  ReadWhenReady();
  FrameRules rules;
  rules.max_payload = 68;
  wire::Header seen;
  auto f = conn_->NextFrame(rules, &seen);
  ASSERT_FALSE(f.ok());
  EXPECT_EQ(f.status().code(), Code::kProtocolError);
  EXPECT_NE(f.status().message().find("exceeds 68"), std::string::npos) << f.status().message();
  EXPECT_EQ(seen.type, MsgType::kHello);
  EXPECT_EQ(seen.payload_bytes, 1000u);
}

TEST_F(MemberConnectionTest, DataFramesAreRefusedAndKDataErrorOnlyWhenAllowed) {
  const auto text = wire::EncodeText("x");
  PeerWrite(Encoded(MsgType::kDataError, text));
  ReadWhenReady();
  FrameRules before_auth;
  before_auth.allow_data_error = false;
  auto refused = conn_->NextFrame(before_auth);
  ASSERT_FALSE(refused.ok());
  EXPECT_NE(refused.status().message().find("data frame"), std::string::npos);
  auto allowed = conn_->NextFrame({});
  ASSERT_TRUE(allowed.ok()) << allowed.status().ToString();
  ASSERT_TRUE(allowed->has_value());
  EXPECT_EQ((*allowed)->header.type, MsgType::kDataError);

  wire::HeaderBytes bad = wire::EncodeHeader(wire::Header{.type = MsgType::kBarrier});
  bad[0] = std::byte{0};  // magic
  PeerWrite(bad);
  ReadWhenReady();
  auto f = conn_->NextFrame({});
  ASSERT_FALSE(f.ok());
  EXPECT_EQ(f.status().code(), Code::kProtocolError);
  EXPECT_NE(f.status().message().find("from peer"), std::string::npos) << f.status().message();
}

TEST_F(MemberConnectionTest, EofComesAfterTheFramesBeforeIt) {
  PeerWrite(Encoded(MsgType::kGoodbye, {}));
  ::close(peer_);
  peer_ = -1;
  ReadWhenReady();
  ReadWhenReady();
  auto f = conn_->NextFrame({});
  ASSERT_TRUE(f.ok()) << f.status().ToString();
  ASSERT_TRUE(f->has_value());
  EXPECT_EQ((*f)->header.type, MsgType::kGoodbye);
  auto eof = conn_->NextFrame({});
  ASSERT_FALSE(eof.ok());
  EXPECT_EQ(eof.status().code(), Code::kPeerLost);
}

TEST_F(MemberConnectionTest, FullSocketQueuesAndDrainsInOrderWithSharedTails) {
  const auto tail = std::make_shared<const std::vector<std::byte>>(50000, std::byte{0x5A});
  const std::array<std::byte, 3> head = {std::byte{1}, std::byte{2}, std::byte{3}};
  constexpr uint64_t kFrames = 200;  // 10 MB: far more than the socket holds
  const auto t0 = Clock::now();
  for (uint64_t r = 0; r < kFrames; ++r) {
    wire::Header h;
    h.type = MsgType::kAssign;
    h.job = 7;
    h.round = r;
    conn_->Send(h, head, tail, t0);
  }
  EXPECT_GT(conn_->queued_bytes(), 0u) << "the socket took it all: nothing was queued";
  ASSERT_TRUE(conn_->oldest_queued().has_value());
  EXPECT_EQ(*conn_->oldest_queued(), t0);
  EXPECT_EQ(conn_->PollEvents() & POLLOUT, POLLOUT);

  const std::vector<std::byte> got = PeerReadAll(10s);
  EXPECT_EQ(conn_->queued_bytes(), 0u);
  EXPECT_FALSE(conn_->oldest_queued().has_value());
  const size_t frame = wire::kHeaderSize + head.size() + tail->size();
  ASSERT_EQ(got.size(), kFrames * frame);
  for (uint64_t r = 0; r < kFrames; ++r) {
    const std::byte* p = got.data() + r * frame;
    auto h = wire::DecodeHeader(std::span(p, wire::kHeaderSize));
    ASSERT_TRUE(h.ok()) << r << ": " << h.status().ToString();
    EXPECT_EQ(h->round, r);
    ASSERT_EQ(h->payload_bytes, head.size() + tail->size());
    EXPECT_EQ(std::memcmp(p + wire::kHeaderSize, head.data(), head.size()), 0) << r;
    EXPECT_EQ(std::memcmp(p + wire::kHeaderSize + head.size(), tail->data(), tail->size()), 0)
        << r;
  }
  EXPECT_TRUE(conn_->send_error().ok());
}

TEST_F(MemberConnectionTest, CloseAfterFlushWaitsForTheQueueOrItsDeadline) {
  const auto text = wire::EncodeText("refused");
  conn_->Send(wire::Header{.type = MsgType::kAbort, .job = 7}, text, Clock::now());
  EXPECT_EQ(conn_->queued_bytes(), 0u);  // a small frame goes out at once
  conn_->CloseAfterFlush(Clock::now() + 1s);
  EXPECT_TRUE(conn_->closed());  // nothing waited
  const std::vector<std::byte> got = PeerReadAll(1s);
  EXPECT_EQ(got.size(), wire::kHeaderSize + text.size());

  // A peer that does not read: closed at the deadline, not before.
  ::close(peer_);
  SetUp();
  const auto tail = std::make_shared<const std::vector<std::byte>>(1 << 20, std::byte{1});
  for (int i = 0; i < 8; ++i) {
    conn_->Send(wire::Header{.type = MsgType::kAssign, .job = 7}, {}, tail, Clock::now());
  }
  ASSERT_GT(conn_->queued_bytes(), 0u);
  const auto deadline = Clock::now() + 200ms;
  conn_->CloseAfterFlush(deadline);
  EXPECT_TRUE(conn_->closing());
  EXPECT_FALSE(conn_->closed());
  conn_->ExpireClose(deadline - 1ms);
  EXPECT_FALSE(conn_->closed());
  conn_->ExpireClose(deadline);
  EXPECT_TRUE(conn_->closed());
  EXPECT_EQ(conn_->PollEvents(), 0);
}

TEST_F(MemberConnectionTest, WriteToAClosedPeerIsKeptAndWhatItSentIsStillRead) {
  PeerWrite(Encoded(MsgType::kGoodbye, {}));
  ::close(peer_);
  peer_ = -1;
  conn_->Send(wire::Header{.type = MsgType::kHeartbeat, .job = 7}, {}, Clock::now());
  EXPECT_EQ(conn_->send_error().code(), Code::kPeerLost) << conn_->send_error().ToString();
  EXPECT_EQ(conn_->queued_bytes(), 0u);
  EXPECT_FALSE(conn_->closed());  // the goodbye is still to be read
  ReadWhenReady();
  auto f = conn_->NextFrame({});
  ASSERT_TRUE(f.ok()) << f.status().ToString();
  ASSERT_TRUE(f->has_value());
  EXPECT_EQ((*f)->header.type, MsgType::kGoodbye);
}

}  // namespace
}  // namespace gradlink::scheduler
