// The Lane / Receiver / Fabric contract (src/transport/transport.h), one suite run against every
// fabric (as Gloo runs its transport tests over each transport): round trips of every size class
// (UCX: eager and rendezvous), receiver-chosen buffers, refused and failed receives, bad frames
// counted and never delivered, dead peers (sticky, reported once), invalid sends, the threading
// contract, and concurrent senders. What one fabric alone promises is tested in its own file
// (inproc_test.cc, ucx_test.cc). Every wait has a deadline: a test fails, it never hangs.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "transport/transport.h"
#include "unit/transport/lane_recorder.h"
#include "wire/frame.h"

namespace gradlink::transport {
namespace {

using namespace std::chrono_literals;
using test::Clock;
using test::Completions;
using test::ExpectSameHeader;
using test::ExpectStoppedPeerDetected;
using test::kDeadline;
using test::MakeHeader;
using test::Pattern;
using test::ProgressThread;
using test::SendWaiter;
using test::TestReceiver;

struct FabricCase {
  const char* name;
  std::function<std::shared_ptr<Fabric>()> make;  // null on failure (the test fails)
};

std::shared_ptr<Fabric> MakeUcx() {
  Result<std::unique_ptr<Fabric>> f = CreateUcxFabric();
  EXPECT_TRUE(f.ok()) << f.status().ToString();
  if (!f.ok()) return nullptr;
  return std::shared_ptr<Fabric>(std::move(f).value());
}

class LaneContractTest : public ::testing::TestWithParam<FabricCase> {
 protected:
  void SetUp() override {
    fabric_ = GetParam().make();
    ASSERT_TRUE(fabric_);
    ASSERT_EQ(fabric_->kind(), GetParam().name);
    a_ = MakeLane("A", &ra_);
    b_ = MakeLane("B", &rb_);
    ASSERT_TRUE(a_ && b_);
    Result<PeerId> p = a_->Connect(b_->address(), "lane B");
    ASSERT_TRUE(p.ok()) << p.status().ToString();
    a_to_b_ = *p;
  }
  void TearDown() override {
    // Lanes before the fabric, receivers after the lanes.
    for (auto& l : extra_) l->Stop();
    if (a_) a_->Stop();
    if (b_) b_->Stop();
    extra_.clear();
    a_.reset();
    b_.reset();
    fabric_.reset();
  }

  std::unique_ptr<Lane> MakeLane(const std::string& name, TestReceiver* r) {
    Result<std::unique_ptr<Lane>> l = fabric_->CreateLane(name);
    EXPECT_TRUE(l.ok()) << l.status().ToString();
    if (!l.ok()) return nullptr;
    Status s = (*l)->Start(r);
    EXPECT_TRUE(s.ok()) << s.ToString();
    return std::move(l).value();
  }

  // Sends `payload` from A to B and waits for the send to complete.
  Status SendAndWait(const wire::Header& h, std::span<const std::byte> payload) {
    SendWaiter w;
    a_->Send(a_to_b_, h, payload, w.Callback());
    auto s = w.Wait();
    if (!s) return Timeout("send did not complete");
    return *s;
  }

  std::shared_ptr<Fabric> fabric_;
  TestReceiver ra_, rb_;
  std::unique_ptr<Lane> a_, b_;
  std::vector<std::unique_ptr<Lane>> extra_;  // stopped before a_ and b_
  PeerId a_to_b_ = 0;
};

// Every size class (UCX: 0 and 1 byte, eager, rendezvous): every header field and byte arrives;
// the receiver's callbacks run on B's progress thread and the send's on A's, never on the
// caller's; stats count both sides.
TEST_P(LaneContractTest, RoundTrip) {
  const std::vector<size_t> sizes = {0, 1, 1000, 4096, 16u << 20};
  std::vector<wire::Header> sent;
  Completions done;
  for (size_t i = 0; i < sizes.size(); ++i) {
    SCOPED_TRACE("payload of " + std::to_string(sizes[i]) + " bytes");
    std::vector<std::byte> data = Pattern(sizes[i], static_cast<uint32_t>(i));
    wire::Header h = MakeHeader(sizes[i], 1000 + i);
    a_->Send(a_to_b_, h, data, done.Callback());
    ASSERT_TRUE(done.WaitFor(i + 1));
    ASSERT_TRUE(rb_.WaitFor([&] { return rb_.frames_.size() == i + 1; }));
    TestReceiver::Frame f = rb_.frames().back();
    ExpectSameHeader(f.header, h);
    ASSERT_EQ(f.data.size(), data.size());
    EXPECT_TRUE(f.data == data);
  }
  for (const Status& s : done.statuses()) EXPECT_TRUE(s.ok()) << s.ToString();

  const std::thread::id a_thread = ProgressThread(*a_);
  const std::thread::id b_thread = ProgressThread(*b_);
  EXPECT_NE(a_thread, b_thread);
  EXPECT_NE(a_thread, std::this_thread::get_id());
  EXPECT_NE(b_thread, std::this_thread::get_id());
  for (const TestReceiver::Frame& f : rb_.frames()) EXPECT_EQ(f.thread, b_thread);
  EXPECT_EQ(rb_.header_thread(), b_thread);
  for (std::thread::id t : done.threads()) EXPECT_EQ(t, a_thread);

  LaneStats sa = a_->stats();
  LaneStats sb = b_->stats();
  size_t total = 0;
  for (size_t s : sizes) total += s;
  EXPECT_EQ(sa.frames_sent, sizes.size());
  EXPECT_EQ(sa.bytes_sent, total);
  EXPECT_EQ(sb.frames_received, sizes.size());
  EXPECT_EQ(sb.bytes_received, total);
  EXPECT_EQ(sb.protocol_errors, 0u);
}

// A receiver that takes whole frames in one call (Receiver::OnFrame): the lane hands it every
// frame whose payload it already holds (inproc: all; UCX: eager ones) that way, and asks for a
// span first only for the others (UCX: rendezvous); every byte arrives either way, and the
// lane counts the bytes the receiver copied.
class WholeFrameReceiver : public TestReceiver {
 public:
  Result<uint64_t> OnFrame(const wire::Header& h, std::span<const std::byte> payload) override {
    std::lock_guard<std::mutex> lock(mu_);
    frames_.push_back(Frame{h, std::vector<std::byte>(payload.begin(), payload.end()),
                            nullptr, std::this_thread::get_id()});
    whole_.push_back(h.cookie);
    cv_.notify_all();
    return uint64_t{payload.size()};
  }
  std::vector<uint64_t> whole() {
    std::lock_guard<std::mutex> lock(mu_);
    return whole_;
  }

 private:
  std::vector<uint64_t> whole_;  // cookies of the frames taken by OnFrame
};

TEST_P(LaneContractTest, WholeFramesReachAReceiverThatTakesThemInOneCall) {
  WholeFrameReceiver rc;
  std::unique_ptr<Lane> c = MakeLane("C", &rc);
  ASSERT_TRUE(c);
  Result<PeerId> to_c = a_->Connect(c->address(), "lane C");
  ASSERT_TRUE(to_c.ok()) << to_c.status().ToString();
  const std::vector<size_t> sizes = {0, 1000, 16u << 20};
  Completions done;
  for (size_t i = 0; i < sizes.size(); ++i) {
    const std::vector<std::byte> data = Pattern(sizes[i], static_cast<uint32_t>(9 + i));
    a_->Send(*to_c, MakeHeader(sizes[i], 2000 + i), data, done.Callback());
    ASSERT_TRUE(done.WaitFor(i + 1));
    ASSERT_TRUE(rc.WaitFrames(i + 1)) << "frame of " << sizes[i] << " bytes";
  }
  const std::vector<TestReceiver::Frame> got = rc.frames();
  ASSERT_EQ(got.size(), sizes.size());
  for (size_t i = 0; i < sizes.size(); ++i) {
    EXPECT_EQ(got[i].header.cookie, 2000 + i);
    EXPECT_TRUE(got[i].data == Pattern(sizes[i], static_cast<uint32_t>(9 + i)))
        << "frame of " << sizes[i] << " bytes";
  }
  const std::vector<uint64_t> whole = rc.whole();
  // The small frames came whole on every fabric; each other frame asked for a span once.
  ASSERT_GE(whole.size(), 2u);
  EXPECT_EQ(whole[0], 2000u);
  EXPECT_EQ(whole[1], 2001u);
  EXPECT_EQ(whole.size() + static_cast<size_t>(rc.headers()), sizes.size());
  const bool ucx = GetParam().name == std::string("ucx");
  EXPECT_EQ(rc.headers(), ucx ? 1 : 0) << "16 MiB is a rendezvous under UCX only";
  if (ucx) {
    EXPECT_EQ(c->stats().bytes_copied_eager, 1000u);
  }
  for (const Status& s : done.statuses()) EXPECT_TRUE(s.ok()) << s.ToString();
  c->Stop();
}

TEST_P(LaneContractTest, BothDirectionsAndManyFramesInOrder) {
  Result<PeerId> back = b_->Connect(a_->address(), "lane A");
  ASSERT_TRUE(back.ok());
  constexpr int kFrames = 200;
  std::vector<std::vector<std::byte>> payloads;
  for (int i = 0; i < kFrames; ++i) payloads.push_back(Pattern(static_cast<size_t>(i) * 4, i));
  Completions da, db;
  for (int i = 0; i < kFrames; ++i) {
    a_->Send(a_to_b_, MakeHeader(payloads[i].size(), i), payloads[i], da.Callback());
    b_->Send(*back, MakeHeader(payloads[i].size(), i), payloads[i], db.Callback());
  }
  ASSERT_TRUE(rb_.WaitFrames(kFrames));
  ASSERT_TRUE(ra_.WaitFrames(kFrames));
  ASSERT_TRUE(da.WaitFor(kFrames));
  ASSERT_TRUE(db.WaitFor(kFrames));
  for (TestReceiver* r : {&ra_, &rb_}) {
    const auto got = r->frames();
    ASSERT_EQ(got.size(), size_t{kFrames});
    for (int i = 0; i < kFrames; ++i) {
      EXPECT_EQ(got[i].header.cookie, uint64_t(i));
      EXPECT_EQ(got[i].data, payloads[i]);
    }
  }
  for (const Status& s : da.statuses()) EXPECT_TRUE(s.ok());
  for (const Status& s : db.statuses()) EXPECT_TRUE(s.ok());
}

// Slots inside one arena (UCX: eager and rendezvous sizes): each payload lands at the start of
// the span the receiver chose, and not one byte outside the spans changes.
TEST_P(LaneContractTest, PayloadLandsInTheBufferTheReceiverChose) {
  constexpr size_t kGuard = 1000;
  const std::vector<size_t> sizes = {512, 4096, 1u << 20};
  std::vector<std::span<std::byte>> slots;
  size_t arena_size = kGuard;
  for (size_t s : sizes) arena_size += s + kGuard;
  std::vector<std::byte> arena(arena_size, std::byte{0x5A});
  size_t off = kGuard;
  for (size_t s : sizes) {
    slots.emplace_back(arena.data() + off, s);
    off += s + kGuard;
  }
  std::atomic<size_t> next{0};
  rb_.SetPick([&](const wire::Header& h) -> Result<std::span<std::byte>> {
    size_t i = next++;
    if (i >= slots.size() || slots[i].size() != h.payload_bytes) return Internal("unexpected");
    return slots[i];
  });
  std::vector<std::vector<std::byte>> data;
  for (size_t i = 0; i < sizes.size(); ++i) {
    data.push_back(Pattern(sizes[i], 77 + static_cast<uint32_t>(i)));
    ASSERT_TRUE(SendAndWait(MakeHeader(sizes[i], i), data[i]).ok());
    ASSERT_TRUE(rb_.WaitFor([&] { return rb_.frames_.size() == i + 1; }));
    TestReceiver::Frame f = rb_.frames().back();
    EXPECT_EQ(f.where, slots[i].data());
    EXPECT_EQ(std::memcmp(slots[i].data(), data[i].data(), sizes[i]), 0);
  }
  for (size_t i = 0, slot = 0; i < arena.size(); ++i) {
    if (slot < slots.size() && arena.data() + i == slots[slot].data()) {
      i += slots[slot].size() - 1;
      ++slot;
      continue;
    }
    ASSERT_EQ(arena[i], std::byte{0x5A}) << "byte " << i << " outside the slots";
  }
}

TEST_P(LaneContractTest, EmptyPayload) {
  rb_.SetPick([](const wire::Header&) -> Result<std::span<std::byte>> {
    return std::span<std::byte>();
  });
  wire::Header h = MakeHeader(0, 5);
  Completions done;
  a_->Send(a_to_b_, h, {}, done.Callback());
  ASSERT_TRUE(rb_.WaitFrames(1));
  ASSERT_TRUE(done.WaitFor(1));
  EXPECT_TRUE(rb_.frames()[0].data.empty());
  EXPECT_TRUE(done.statuses()[0].ok());
}

// A frame the receiver refuses in OnHeader() (UCX: eager and rendezvous) is dropped: its send
// still completes, OnReceiveFailed is not called, and the lane goes on.
TEST_P(LaneContractTest, RefusedFrameIsDroppedAndTheLaneGoesOn) {
  rb_.SetPick([](const wire::Header&) -> Result<std::span<std::byte>> {
    return Mismatch("not wanted");
  });
  for (size_t n : {size_t{64}, size_t{4} << 20}) {
    std::vector<std::byte> data = Pattern(n, 5);
    Status s = SendAndWait(MakeHeader(n, 9), data);
    EXPECT_TRUE(s.ok()) << s.ToString();
  }
  rb_.SetPick(nullptr);
  std::vector<std::byte> data = Pattern(128, 6);
  ASSERT_TRUE(SendAndWait(MakeHeader(128, 10), data).ok());
  ASSERT_TRUE(rb_.WaitFor([&] { return rb_.frames_.size() == 1; }));
  EXPECT_EQ(rb_.frames()[0].header.cookie, 10u);
  EXPECT_EQ(rb_.headers(), 3);
  EXPECT_TRUE(rb_.receive_failures().empty());
}

TEST_P(LaneContractTest, WrongSizeBufferFailsTheReceive) {
  std::vector<std::byte> small(10);
  rb_.SetPick([&](const wire::Header&) -> Result<std::span<std::byte>> {
    return std::span<std::byte>(small);
  });
  const std::vector<std::byte> payload = Pattern(64, 3);
  Completions done;
  a_->Send(a_to_b_, MakeHeader(64, 5), payload, done.Callback());
  ASSERT_TRUE(rb_.WaitFor([&] { return rb_.receive_failures_.size() >= 1; }));
  ASSERT_TRUE(done.WaitFor(1));
  const auto failed = rb_.receive_failures();
  ASSERT_EQ(failed.size(), 1u);
  EXPECT_EQ(failed[0].first.cookie, 5u);
  EXPECT_FALSE(failed[0].second.ok());
  EXPECT_TRUE(rb_.frames().empty());
  EXPECT_EQ(small, std::vector<std::byte>(10));  // nothing written
}

// Frames that fail validation are counted and never reach the receiver; every such send
// completes exactly once. Each goes on a fresh endpoint, since a fabric may close the
// connection a bad frame came on (UCX does, ucx_test.cc; inproc does not, inproc_test.cc).
TEST_P(LaneContractTest, BadFramesAreCountedAndNeverDelivered) {
  const wire::Header good = MakeHeader(16, 1);
  const wire::HeaderBytes good_bytes = wire::EncodeHeader(good);
  wire::HeaderBytes bad_magic = good_bytes;
  bad_magic[0] ^= std::byte{0xFF};
  wire::HeaderBytes bad_version = good_bytes;
  bad_version[4] = std::byte{99};
  wire::HeaderBytes bad_type = good_bytes;
  bad_type[5] = std::byte{200};
  // Says 16 payload bytes; the frames below carry 8, 32 (eager) and 1 MiB (rendezvous).
  const wire::HeaderBytes liar = good_bytes;
  struct Case {
    const char* name;
    std::vector<std::byte> header;
    size_t payload;
  };
  const std::vector<Case> cases = {
      {"bad magic", {bad_magic.begin(), bad_magic.end()}, 16},
      {"bad version", {bad_version.begin(), bad_version.end()}, 16},
      {"bad type", {bad_type.begin(), bad_type.end()}, 16},
      {"payload_bytes lies (shorter)", {liar.begin(), liar.end()}, 8},
      {"payload_bytes lies (eager)", {liar.begin(), liar.end()}, 32},
      {"payload_bytes lies (rendezvous)", {liar.begin(), liar.end()}, 1u << 20},
      {"20-byte header", {good_bytes.begin(), good_bytes.begin() + 20}, 16},
      {"32-byte header", {good_bytes.begin(), good_bytes.begin() + 32}, 16},
  };
  uint64_t errors = 0;
  std::vector<std::unique_ptr<SendWaiter>> waiters;
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    auto peer = a_->Connect(b_->address(), std::string("lane B for ") + c.name);
    ASSERT_TRUE(peer.ok());
    std::vector<std::byte> payload = Pattern(c.payload, 3);
    waiters.push_back(std::make_unique<SendWaiter>());
    a_->SendRawForTesting(*peer, c.header, payload, waiters.back()->Callback());
    const auto deadline = Clock::now() + kDeadline;
    while (b_->stats().protocol_errors == errors && Clock::now() < deadline) {
      std::this_thread::sleep_for(1ms);
    }
    ASSERT_EQ(b_->stats().protocol_errors, errors + 1);
    ++errors;
    // The sender's request finishes one way or another; it must not hang.
    ASSERT_TRUE(waiters.back()->Wait().has_value());
  }
  EXPECT_EQ(rb_.headers(), 0);  // bad frames never reach the receiver
  EXPECT_EQ(rb_.frame_count(), 0u);
  EXPECT_TRUE(rb_.peer_failures().empty());

  // A good frame on a fresh endpoint still arrives.
  auto fresh = a_->Connect(b_->address(), "lane B, fresh");
  ASSERT_TRUE(fresh.ok());
  std::vector<std::byte> data = Pattern(16, 4);
  SendWaiter w;
  a_->Send(*fresh, good, data, w.Callback());
  auto s = w.Wait();
  ASSERT_TRUE(s.has_value());
  EXPECT_TRUE(s->ok()) << s->ToString();
  ASSERT_TRUE(rb_.WaitFor([&] { return rb_.frames_.size() == 1; }));
  EXPECT_TRUE(rb_.frames()[0].data == data);
  EXPECT_EQ(b_->stats().protocol_errors, errors);
  EXPECT_EQ(b_->stats().frames_received, 1u);
  // Every send completed exactly once.
  std::this_thread::sleep_for(50ms);
  for (auto& x : waiters) EXPECT_EQ(x->calls, 1);
}

TEST_P(LaneContractTest, SendToAStoppedLaneFailsWithPeerLost) { ExpectStoppedPeerDetected(*fabric_); }

TEST_P(LaneContractTest, OneDeadPeerDoesNotAffectAnother) {
  TestReceiver rc;
  extra_.push_back(MakeLane("C", &rc));
  Lane& c = *extra_.back();
  Result<PeerId> a_to_c = a_->Connect(c.address(), "lane C");
  ASSERT_TRUE(a_to_c.ok());
  b_->Stop();
  const std::vector<std::byte> payload = Pattern(8, 4);
  // The failure of B may take a few sends to show (UCX notices a closed socket late).
  std::optional<Status> to_b_failure;
  std::vector<std::unique_ptr<SendWaiter>> to_b;
  const auto deadline = Clock::now() + kDeadline;
  while (!to_b_failure && Clock::now() < deadline) {
    to_b.push_back(std::make_unique<SendWaiter>());
    a_->Send(a_to_b_, MakeHeader(8, 1), payload, to_b.back()->Callback());
    auto s = to_b.back()->Wait(20ms);
    if (s && !s->ok()) to_b_failure = s;
  }
  ASSERT_TRUE(to_b_failure.has_value());
  EXPECT_EQ(to_b_failure->code(), Code::kPeerLost);
  SendWaiter to_c;
  a_->Send(*a_to_c, MakeHeader(8, 2), payload, to_c.Callback());
  auto s = to_c.Wait();
  ASSERT_TRUE(s.has_value());
  EXPECT_TRUE(s->ok()) << s->ToString();
  ASSERT_TRUE(rc.WaitFrames(1));
  for (auto& w : to_b) ASSERT_TRUE(w->Wait().has_value());
  c.Stop();
}

// A send to an unknown peer fails with kInvalidArgument and reaches nobody, exactly once; and
// Connect() to a malformed address fails. (The fabrics differ beyond that: UCX refuses a payload
// that disagrees with its header in Send() itself, ucx_test.cc, where inproc sends it and the
// receiver counts a protocol error; inproc says kInvalidArgument for a short address, UCX another
// code, inproc_test.cc.)
TEST_P(LaneContractTest, InvalidSendsFailWithoutReachingTheWire) {
  std::vector<std::byte> data(8);
  SendWaiter w2;
  a_->Send(a_to_b_ + 12345, MakeHeader(8, 1), data, w2.Callback());
  auto s2 = w2.Wait();
  ASSERT_TRUE(s2.has_value());
  EXPECT_EQ(s2->code(), Code::kInvalidArgument);
  EXPECT_TRUE(ra_.peer_failures().empty());

  Result<PeerId> p = a_->Connect(std::vector<std::byte>(3), "short");
  EXPECT_FALSE(p.ok());
  auto bad = a_->Connect({}, "nobody");
  EXPECT_FALSE(bad.ok());
  std::this_thread::sleep_for(50ms);
  EXPECT_EQ(rb_.headers(), 0);
  EXPECT_EQ(w2.calls, 1);
}

// Defer() runs on the progress thread: the same thread every time, not the caller's, and the
// one the receiver's callbacks run on.
TEST_P(LaneContractTest, DeferRunsOnTheProgressThread) {
  std::vector<std::byte> data(4);
  ASSERT_TRUE(SendAndWait(MakeHeader(4, 1), data).ok());
  ASSERT_TRUE(rb_.WaitFrames(1));
  const std::thread::id t1 = ProgressThread(*b_);
  const std::thread::id t2 = ProgressThread(*b_);
  EXPECT_EQ(t1, t2);
  EXPECT_NE(t1, std::this_thread::get_id());
  EXPECT_EQ(t1, rb_.header_thread());
}

TEST_P(LaneContractTest, StopIsIdempotentAndAddressesAreDistinct) {
  EXPECT_NE(a_->address(), b_->address());
  a_->Stop();
  a_->Stop();
  b_->Stop();
  // A lane that was never started can be stopped and destroyed.
  Result<std::unique_ptr<Lane>> l = fabric_->CreateLane("unstarted");
  ASSERT_TRUE(l.ok());
  (*l)->Stop();
  l = fabric_->CreateLane("unstarted2");
  ASSERT_TRUE(l.ok());
}

// Sends of every size class from several threads at once, on several lanes and on one lane
// from two threads (Send() is thread-safe): every frame arrives once and intact, every send
// completes exactly once.
TEST_P(LaneContractTest, ConcurrentSendsCompleteExactlyOnce) {
  constexpr int kThreads = 4;
  constexpr int kPerThread = 300;
  constexpr int kTotal = kThreads * kPerThread;
  auto size_of = [](int i) -> size_t {
    static const size_t kSizes[] = {0, 8, 1000, 4096, 64 << 10, 256 << 10};
    return kSizes[i % 6];
  };
  std::vector<TestReceiver> recorders(kThreads);
  std::vector<Lane*> senders;
  std::vector<PeerId> peers;
  for (int t = 0; t < kThreads; ++t) {
    extra_.push_back(MakeLane("s" + std::to_string(t), &recorders[t]));
    senders.push_back(extra_.back().get());
    Result<PeerId> p = senders.back()->Connect(b_->address(), "lane B");
    ASSERT_TRUE(p.ok());
    peers.push_back(*p);
  }
  std::vector<std::vector<std::byte>> payloads(kTotal);
  for (int i = 0; i < kTotal; ++i) payloads[i] = Pattern(size_of(i), i);
  std::vector<std::atomic<int>> calls(kTotal);
  std::atomic<int> done{0}, failed{0};
  std::mutex mu;
  std::condition_variable cv;
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      for (int k = 0; k < kPerThread; ++k) {
        const int i = t * kPerThread + k;
        Lane& lane = (k % 2 == 0) ? *senders[t] : *a_;
        const PeerId peer = (k % 2 == 0) ? peers[t] : a_to_b_;
        lane.Send(peer, MakeHeader(payloads[i].size(), i), payloads[i], [&, i](const Status& s) {
          calls[i].fetch_add(1);
          if (!s.ok()) failed.fetch_add(1);
          if (done.fetch_add(1) + 1 == kTotal) {
            std::lock_guard<std::mutex> lock(mu);
            cv.notify_all();
          }
        });
      }
    });
  }
  for (auto& th : threads) th.join();
  {
    std::unique_lock<std::mutex> lock(mu);
    ASSERT_TRUE(cv.wait_for(lock, kDeadline, [&] { return done.load() >= kTotal; }))
        << done.load() << " of " << kTotal << " sends completed";
  }
  ASSERT_TRUE(rb_.WaitFor([&] { return rb_.frames_.size() == kTotal; }))
      << rb_.frame_count() << " of " << kTotal << " frames arrived";
  std::this_thread::sleep_for(50ms);  // a late duplicate `done` would show up here
  EXPECT_EQ(failed.load(), 0);
  for (int i = 0; i < kTotal; ++i) EXPECT_EQ(calls[i].load(), 1) << "send " << i;
  std::vector<bool> seen(kTotal, false);
  for (const auto& f : rb_.frames()) {
    ASSERT_LT(f.header.cookie, static_cast<uint64_t>(kTotal));
    const int i = static_cast<int>(f.header.cookie);
    EXPECT_FALSE(seen[i]) << "frame " << i << " delivered twice";
    seen[i] = true;
    EXPECT_TRUE(f.data == payloads[i]) << "frame " << i;
  }
  EXPECT_EQ(b_->stats().frames_received, uint64_t{kTotal});
}

// Connect() and Send() from inside a receiver callback (on the progress thread) run inline
// rather than waiting on the thread itself.
TEST_P(LaneContractTest, ConnectAndSendFromReceiverCallback) {
  std::optional<Result<PeerId>> inner;
  std::vector<std::byte> reply = Pattern(32, 9);
  SendWaiter reply_done;
  std::vector<std::byte> sink;
  rb_.SetPick([&](const wire::Header& h) -> Result<std::span<std::byte>> {
    if (!inner) {
      inner = b_->Connect(a_->address(), "lane A");
      if (inner->ok()) b_->Send(**inner, MakeHeader(32, 99), reply, reply_done.Callback());
    }
    sink.resize(h.payload_bytes);
    return std::span<std::byte>(sink);
  });
  std::vector<std::byte> data = Pattern(16, 1);
  ASSERT_TRUE(SendAndWait(MakeHeader(16, 1), data).ok());
  ASSERT_TRUE(ra_.WaitFor([&] { return ra_.frames_.size() == 1; }));
  ASSERT_TRUE(inner.has_value() && inner->ok());
  EXPECT_EQ(ra_.frames()[0].header.cookie, 99u);
  EXPECT_TRUE(reply_done.Wait().value_or(Timeout("")).ok());
}

INSTANTIATE_TEST_SUITE_P(Fabrics, LaneContractTest,
                         ::testing::Values(FabricCase{"inproc", [] { return CreateInprocFabric(); }},
                                           FabricCase{"ucx", MakeUcx}),
                         [](const auto& info) { return std::string(info.param.name); });

}  // namespace
}  // namespace gradlink::transport
