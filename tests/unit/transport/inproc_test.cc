// What the inproc lanes (threads as ranks) promise beyond the contract every fabric keeps
// (lane_contract_test.cc, run on inproc too): a bad frame leaves its connection usable, a stopped
// peer is known at once (every later send fails, none is delivered), an address of no lane fails
// on the first send, and a sender that stops while its receiver holds the frame still completes
// the send. Every wait has a deadline.
#include <gtest/gtest.h>

#include <chrono>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "transport/transport.h"
#include "unit/transport/lane_recorder.h"
#include "wire/frame.h"

namespace gradlink::transport {
namespace {

using namespace std::chrono_literals;
using test::Completions;
using test::kDeadline;
using test::MakeHeader;
using test::Pattern;
using test::ProgressThread;
using test::TestReceiver;

class InprocTest : public ::testing::Test {
 protected:
  void SetUp() override {
    fabric_ = CreateInprocFabric();
    ASSERT_EQ(fabric_->kind(), "inproc");
    a_ = MakeLane("a", &ra_);
    b_ = MakeLane("b", &rb_);
    Result<PeerId> p = a_->Connect(b_->address(), "lane b");
    ASSERT_TRUE(p.ok()) << p.status().ToString();
    a_to_b_ = *p;
  }
  void TearDown() override {
    // Lanes stop before the receivers they call go away.
    if (a_) a_->Stop();
    if (b_) b_->Stop();
  }

  std::unique_ptr<Lane> MakeLane(const std::string& name, TestReceiver* r) {
    Result<std::unique_ptr<Lane>> l = fabric_->CreateLane(name);
    EXPECT_TRUE(l.ok()) << l.status().ToString();
    if (!l.ok()) return nullptr;
    Status s = (*l)->Start(r);
    EXPECT_TRUE(s.ok()) << s.ToString();
    return std::move(l).value();
  }

  std::shared_ptr<Fabric> fabric_;
  TestReceiver ra_, rb_;
  std::unique_ptr<Lane> a_, b_;
  PeerId a_to_b_ = 0;
};

// Inproc only: the bad frames and then a good one go on one connection, which stays usable (UCX
// closes a connection on its first bad frame, ucx_test.cc). The contract's part (counted, never
// delivered, every send completes) is BadFramesAreCountedAndNeverDelivered.
TEST_F(InprocTest, BadRawHeaderIsCountedAndNotDelivered) {
  const std::vector<std::byte> payload = Pattern(16, 1);
  const wire::HeaderBytes good = wire::EncodeHeader(MakeHeader(16, 7));
  Completions done;

  wire::HeaderBytes bad_magic = good;
  bad_magic[0] = std::byte{'X'};
  a_->SendRawForTesting(a_to_b_, bad_magic, payload, done.Callback());

  wire::HeaderBytes bad_type = good;
  bad_type[5] = std::byte{200};
  a_->SendRawForTesting(a_to_b_, bad_type, payload, done.Callback());

  // A valid header whose payload length disagrees with the bytes that follow.
  a_->SendRawForTesting(a_to_b_, good, std::span<const std::byte>(payload).first(8),
                        done.Callback());

  // A truncated header.
  a_->SendRawForTesting(a_to_b_, std::span<const std::byte>(good).first(20), payload,
                        done.Callback());

  // Then a good frame: still delivered.
  a_->Send(a_to_b_, MakeHeader(16, 77), payload, done.Callback());
  ASSERT_TRUE(rb_.WaitFrames(1));
  ASSERT_TRUE(done.WaitFor(5));
  const auto got = rb_.frames();
  ASSERT_EQ(got.size(), 1u);
  EXPECT_EQ(got[0].header.cookie, 77u);
  EXPECT_EQ(rb_.headers(), 1);  // bad frames never reach the receiver
  EXPECT_EQ(b_->stats().protocol_errors, 4u);
  EXPECT_EQ(b_->stats().frames_received, 1u);
  EXPECT_TRUE(rb_.peer_failures().empty());
  // Every send completed exactly once.
  EXPECT_EQ(done.statuses().size(), 5u);
}

// Inproc only: a stopped lane is known at once, so every send after Stop() fails (UCX may deliver
// or complete a few before it notices; the contract's SendToAStoppedLaneFailsWithPeerLost allows
// that).
TEST_F(InprocTest, SendToAStoppedLaneFailsWithPeerLost) {
  b_->Stop();
  const std::vector<std::byte> payload = Pattern(32, 2);
  Completions done;
  a_->Send(a_to_b_, MakeHeader(32, 1), payload, done.Callback());
  a_->Send(a_to_b_, MakeHeader(32, 2), payload, done.Callback());
  ASSERT_TRUE(done.WaitFor(2));
  ASSERT_TRUE(ra_.WaitFor([&] { return ra_.peer_failures_.size() >= 1; }));
  // Let any duplicate reports and completions arrive before counting.
  a_->Send(a_to_b_, MakeHeader(32, 3), payload, done.Callback());
  ASSERT_TRUE(done.WaitFor(3));
  ProgressThread(*a_);  // drains a's queue
  std::this_thread::sleep_for(20ms);
  ProgressThread(*a_);

  const auto statuses = done.statuses();
  ASSERT_EQ(statuses.size(), 3u) << "done must run exactly once per send";
  for (const Status& s : statuses) EXPECT_EQ(s.code(), Code::kPeerLost) << s.ToString();
  EXPECT_NE(statuses[0].message().find("lane b"), std::string::npos) << statuses[0].message();
  const auto failed = ra_.peer_failures();
  ASSERT_EQ(failed.size(), 1u) << "OnPeerFailed must be reported once";
  EXPECT_EQ(failed[0].first, a_to_b_);
  EXPECT_EQ(failed[0].second.code(), Code::kPeerLost);
  const std::thread::id a_thread = ProgressThread(*a_);
  EXPECT_EQ(ra_.peer_failed_thread(), a_thread);
  for (std::thread::id t : done.threads()) EXPECT_EQ(t, a_thread);
  EXPECT_TRUE(rb_.frames().empty());
}

// Inproc only in this form: the very first send to the stopped lane fails (the contract's
// OneDeadPeerDoesNotAffectAnother sends until it does).
TEST_F(InprocTest, OneDeadPeerDoesNotAffectAnother) {
  TestReceiver rc;
  std::unique_ptr<Lane> c = MakeLane("c", &rc);
  Result<PeerId> a_to_c = a_->Connect(c->address(), "lane c");
  ASSERT_TRUE(a_to_c.ok());
  b_->Stop();
  const std::vector<std::byte> payload = Pattern(8, 4);
  Completions to_b, to_c;
  a_->Send(a_to_b_, MakeHeader(8, 7), payload, to_b.Callback());
  a_->Send(*a_to_c, MakeHeader(8, 7), payload, to_c.Callback());
  ASSERT_TRUE(to_b.WaitFor(1));
  ASSERT_TRUE(to_c.WaitFor(1));
  ASSERT_TRUE(rc.WaitFrames(1));
  EXPECT_EQ(to_b.statuses()[0].code(), Code::kPeerLost);
  EXPECT_TRUE(to_c.statuses()[0].ok());
  c->Stop();
}

// Inproc only: a malformed address is kInvalidArgument (UCX refuses it with another code); the
// contract's part is InvalidSendsFailWithoutReachingTheWire.
TEST_F(InprocTest, ShortAddressIsInvalidArgument) {
  Result<PeerId> p = a_->Connect(std::vector<std::byte>(3), "short");
  EXPECT_FALSE(p.ok());
  EXPECT_EQ(p.status().code(), Code::kInvalidArgument);
}

TEST_F(InprocTest, ConnectToANeverStartedAddressFailsOnSend) {
  // An address of a lane that does not exist (never created): the send fails, nothing hangs.
  std::vector<std::byte> addr = b_->address();
  for (auto& x : addr) x = std::byte{0xEE};
  Result<PeerId> p = a_->Connect(addr, "ghost");
  ASSERT_TRUE(p.ok());
  Completions done;
  a_->Send(*p, MakeHeader(0, 7), {}, done.Callback());
  ASSERT_TRUE(done.WaitFor(1));
  EXPECT_EQ(done.statuses()[0].code(), Code::kPeerLost);
}

TEST_F(InprocTest, PendingSendCompletesWhenTheSenderStops) {
  // Transport contract: Stop() completes pending sends (with kAborted). Here the receiver holds
  // the frame while the sender stops; the sender's callback must still run exactly once.
  // Regression (src/transport/inproc/inproc_fabric.cc): the completion was posted back to the
  // stopped sender's queue, Post() refused it, and `done` never ran.
  std::mutex gate_mu;
  std::condition_variable gate_cv;
  bool open = false, entered = false;
  std::vector<std::byte> buf(16);
  rb_.SetPick([&](const wire::Header&) -> Result<std::span<std::byte>> {
    std::unique_lock<std::mutex> lock(gate_mu);
    entered = true;
    gate_cv.notify_all();
    gate_cv.wait_for(lock, kDeadline, [&] { return open; });
    return std::span<std::byte>(buf);
  });
  const std::vector<std::byte> payload = Pattern(16, 8);
  Completions done;
  a_->Send(a_to_b_, MakeHeader(16, 7), payload, done.Callback());
  {
    std::unique_lock<std::mutex> lock(gate_mu);
    ASSERT_TRUE(gate_cv.wait_for(lock, kDeadline, [&] { return entered; }));
  }
  std::thread stopper([&] { a_->Stop(); });
  // Give Stop() a chance to finish before the receiver lets go (it must not wait for us).
  std::this_thread::sleep_for(50ms);
  {
    std::lock_guard<std::mutex> lock(gate_mu);
    open = true;
    gate_cv.notify_all();
  }
  stopper.join();
  ASSERT_TRUE(rb_.WaitFrames(1));
  EXPECT_TRUE(done.WaitFor(1, 2s)) << "the send's callback never ran after its lane stopped";
  // Exactly once: a duplicate would come after the first, so look again once it had time to.
  std::this_thread::sleep_for(50ms);
  ProgressThread(*b_);
  EXPECT_EQ(done.statuses().size(), 1u);
}

}  // namespace
}  // namespace gradlink::transport
