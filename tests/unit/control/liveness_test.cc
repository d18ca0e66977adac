// Tests of a member's half of control-plane liveness (src/control/join.h, Liveness): Tick()
// sends a heartbeat when one is due and not more often, kPeerLost once the scheduler has been
// silent for kSilenceLimit, and Heard() restarts that clock. The scheduler's end is a
// ControlChannel on the other side of a socketpair.
#include <gtest/gtest.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <memory>
#include <string>
#include <thread>

#include "control/control_channel.h"
#include "control/join.h"
#include "wire/frame.h"

namespace gradlink {
namespace {

using namespace std::chrono_literals;
using transport::Clock;
using transport::ControlChannel;
using transport::kHeartbeatInterval;
using transport::kSilenceLimit;

class LivenessTest : public ::testing::Test {
 protected:
  void SetUp() override {
    int fds[2];
    ASSERT_EQ(::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, fds), 0);
    member_ = std::make_unique<ControlChannel>(fds[0], "scheduler at test");
    scheduler_ = std::make_unique<ControlChannel>(fds[1], "member");
  }

  // Heartbeats that reached the scheduler's end within `wait`.
  int HeartbeatsReceived(Clock::duration wait) {
    int n = 0;
    const auto deadline = Clock::now() + wait;
    for (;;) {
      Result<transport::Frame> f = scheduler_->Receive(deadline);
      if (!f.ok()) {
        EXPECT_EQ(f.status().code(), Code::kTimeout) << f.status().ToString();
        return n;
      }
      EXPECT_EQ(f->header.type, wire::MsgType::kHeartbeat);
      EXPECT_EQ(f->header.job, kJob);
      EXPECT_EQ(f->header.sender, kSender);
      EXPECT_TRUE(f->payload.empty());
      ++n;
    }
  }

  static constexpr uint32_t kJob = 0x5EED;
  static constexpr uint32_t kSender = 3;
  std::unique_ptr<ControlChannel> member_, scheduler_;
};

TEST_F(LivenessTest, TickSendsAHeartbeatWhenDueAndNotMoreOften) {
  Liveness live(member_.get(), kJob, kSender);
  ASSERT_TRUE(live.Tick().ok());  // none sent yet: due at once
  EXPECT_EQ(HeartbeatsReceived(50ms), 1);
  // Ticks within the interval send nothing more.
  for (int i = 0; i < 10; ++i) ASSERT_TRUE(live.Tick().ok());
  EXPECT_EQ(HeartbeatsReceived(50ms), 0);
  // Once the interval has passed, the next Tick sends one.
  std::this_thread::sleep_for(kHeartbeatInterval + 50ms);
  live.Heard();
  ASSERT_TRUE(live.Tick().ok());
  ASSERT_TRUE(live.Tick().ok());
  EXPECT_EQ(HeartbeatsReceived(50ms), 1);
}

TEST_F(LivenessTest, SilenceForTheLimitIsPeerLost) {
  Liveness live(member_.get(), kJob, kSender);
  ASSERT_TRUE(live.Tick().ok());
  std::this_thread::sleep_for(kSilenceLimit + 100ms);
  Status s = live.Tick();
  EXPECT_EQ(s.code(), Code::kPeerLost) << s.ToString();
  EXPECT_NE(s.message().find("scheduler at test"), std::string::npos) << s.message();
}

TEST_F(LivenessTest, HeardRestartsTheSilenceClock) {
  Liveness live(member_.get(), kJob, kSender);
  std::this_thread::sleep_for(kSilenceLimit - 1000ms);
  live.Heard();
  // kSilenceLimit + 500 ms since the start, 1.5 s since the scheduler was heard.
  std::this_thread::sleep_for(1500ms);
  Status s = live.Tick();
  EXPECT_TRUE(s.ok()) << s.ToString();
  // Then silence for the limit, counted from Heard().
  std::this_thread::sleep_for(kSilenceLimit - 1500ms + 100ms);
  EXPECT_EQ(live.Tick().code(), Code::kPeerLost);
}

// A heartbeat that cannot go out because the scheduler's end is gone fails the Tick.
TEST_F(LivenessTest, TickOnAClosedConnectionIsPeerLost) {
  Liveness live(member_.get(), kJob, kSender);
  scheduler_.reset();
  Status s = live.Tick();
  EXPECT_EQ(s.code(), Code::kPeerLost) << s.ToString();
}

}  // namespace
}  // namespace gradlink
