// A server's heartbeats are never late, whatever else it is doing (src/server/control.cc,
// server.cc Init): the scheduler drops a member it has not heard from for kSilenceLimit (3 s).
//
// SlowConnectTest: a server that takes longer than that to connect to its workers (thousands
// of them, or a slow fabric) heartbeats while it connects (control/join.h HeartbeatPump). Here
// a fabric whose every Connect() takes 400 ms, and 10 workers: 4 s of connecting. The job must
// still be running afterwards. (The server used to start heartbeating only after connecting
// to every worker: with 192 workers the scheduler declared it hung.)
//
// JoinReleaseTest: a join release whose partitions' owner thread is busy for 4 s. The server
// used to wait for every partition to forget the join on its control thread (up to 10 s), so
// it sent no heartbeat meanwhile; the control thread must stay free, and the release's ack go
// out once the owner has run.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "common/work_queue.h"
#include "control/control_channel.h"
#include "control/join.h"
#include "gradlink/scheduler.h"
#include "server/start_on.h"
#include "transport/transport.h"
#include "wire/frame.h"
#include "wire/messages.h"

namespace gradlink {
namespace {

using namespace std::chrono_literals;
using transport::Clock;

constexpr auto kConnectDelay = 400ms;

// Forwards everything to the inproc lane, but Connect() first sleeps `connect_delay`.
class SlowConnectLane final : public transport::Lane {
 public:
  SlowConnectLane(std::unique_ptr<transport::Lane> inner, std::chrono::milliseconds connect_delay)
      : inner_(std::move(inner)), connect_delay_(connect_delay) {}
  std::vector<std::byte> address() const override { return inner_->address(); }
  void SetAuthenticator(std::shared_ptr<const security::LaneAuthenticator> a) override {
    inner_->SetAuthenticator(std::move(a));
  }
  Status Start(transport::Receiver* r) override { return inner_->Start(r); }
  Result<transport::PeerId> Connect(std::span<const std::byte> remote, std::string name) override {
    std::this_thread::sleep_for(connect_delay_);
    return inner_->Connect(remote, std::move(name));
  }
  void Send(transport::PeerId p, const wire::Header& h, std::span<const std::byte> payload,
            transport::SendCallback done) override {
    inner_->Send(p, h, payload, std::move(done));
  }
  void FailPeer(transport::PeerId p, const Status& why) override { inner_->FailPeer(p, why); }
  void Defer(std::function<void()> fn) override { inner_->Defer(std::move(fn)); }
  void Stop() override { inner_->Stop(); }
  transport::LaneStats stats() const override { return inner_->stats(); }
  void SendRawForTesting(transport::PeerId p, std::span<const std::byte> hb,
                         std::span<const std::byte> payload, transport::SendCallback done) override {
    inner_->SendRawForTesting(p, hb, payload, std::move(done));
  }

 private:
  std::unique_ptr<transport::Lane> inner_;
  const std::chrono::milliseconds connect_delay_;
};

// The inproc fabric with SlowConnectLanes; keeps the lanes it made, by name, so a test can run
// code on their threads.
class TestFabric final : public transport::Fabric {
 public:
  explicit TestFabric(std::chrono::milliseconds connect_delay) : connect_delay_(connect_delay) {}
  Result<std::unique_ptr<transport::Lane>> CreateLane(std::string name) override {
    GL_ASSIGN_OR_RETURN(auto lane, inner_->CreateLane(name));
    auto made = std::make_unique<SlowConnectLane>(std::move(lane), connect_delay_);
    std::lock_guard lock(mu_);
    lanes_[name] = made.get();
    return std::unique_ptr<transport::Lane>(std::move(made));
  }
  transport::Lane* lane(const std::string& name) {
    std::lock_guard lock(mu_);
    auto it = lanes_.find(name);
    return it == lanes_.end() ? nullptr : it->second;
  }
  std::string_view kind() const override { return "test inproc"; }

 private:
  const std::chrono::milliseconds connect_delay_;
  std::shared_ptr<transport::Fabric> inner_ = transport::CreateInprocFabric();
  std::mutex mu_;
  std::map<std::string, transport::Lane*> lanes_;
};

TEST(SlowConnectTest, AServerThatConnectsForLongerThanTheSilenceLimitIsNotDeclaredHung) {
  constexpr uint32_t kWorkers = 10;
  static_assert(kWorkers * kConnectDelay > transport::kSilenceLimit);
  SchedulerOptions so;
  so.host = "127.0.0.1";
  so.port = 0;
  so.job = "slow-connect";
  so.num_workers = kWorkers;
  so.num_servers = 1;
  so.join_timeout = 30s;
  auto sched = Scheduler::Start(so);
  ASSERT_TRUE(sched.ok()) << sched.status().ToString();
  const std::string address = "127.0.0.1:" + std::to_string((*sched)->port());
  const uint32_t job = wire::JobHash(so.job);

  // Raw workers: they join, then heartbeat (and read) until told to stop.
  std::atomic<bool> stop{false};
  std::atomic<int> aborted{0};
  std::vector<std::thread> workers;
  for (uint32_t r = 0; r < kWorkers; ++r) {
    workers.emplace_back([&, r] {
      wire::RegisterMsg reg;
      reg.role = wire::Role::kWorker;
      reg.requested_rank = static_cast<int32_t>(r);
      reg.host = "raw-worker-" + std::to_string(r);
      reg.push_address.assign(8, std::byte{0});
      reg.pull_address.assign(8, std::byte{0});
      auto joined = JoinJob(address, job, reg, Clock::now() + 20s);
      if (!joined.ok()) {
        ADD_FAILURE() << "worker " << r << ": " << joined.status().ToString();
        return;
      }
      Liveness liveness(joined->channel.get(), job, r);
      while (!stop.load()) {
        if (!liveness.Tick().ok()) return;
        auto f = joined->channel->Receive(Clock::now() + 50ms);
        if (f.ok()) {
          liveness.Heard();
          if (f->header.type == wire::MsgType::kAbort) aborted++;
        }
      }
    });
  }
  ServerOptions svo;
  svo.scheduler = address;
  svo.job = so.job;
  svo.connect_timeout = 20s;
  const auto t0 = Clock::now();
  auto server = StartServerOn(svo, std::make_shared<TestFabric>(kConnectDelay));
  const auto took = Clock::now() - t0;
  ASSERT_TRUE(server.ok()) << server.status().ToString();
  EXPECT_GT(took, transport::kSilenceLimit);  // the case this test is for
  std::this_thread::sleep_for(500ms);         // a verdict would have gone out by now
  Status running = (*sched)->Wait(Clock::now() + 10ms);
  EXPECT_EQ(running.code(), Code::kTimeout) << "the job ended: " << running.ToString();
  EXPECT_EQ(aborted.load(), 0);
  stop = true;
  for (auto& t : workers) t.join();
  server->reset();
  (*sched)->Stop();
}

// The scheduler's side of one server's control channel, played by the test: it welcomes the
// server as server 0 of a job of one worker, sends what the test says, heartbeats, and keeps
// the longest silence it heard from the server.
class FakeScheduler {
 public:
  explicit FakeScheduler(uint32_t job) : job_(job) {
    auto l = transport::Listener::Listen("127.0.0.1", 0);
    EXPECT_TRUE(l.ok()) << l.status().ToString();
    listener_ = std::move(*l);
  }
  std::string address() const { return "127.0.0.1:" + std::to_string(listener_->port()); }

  Status Welcome() {
    GL_ASSIGN_OR_RETURN(channel_, listener_->Accept(Clock::now() + 10s));
    GL_ASSIGN_OR_RETURN(transport::Frame reg, channel_->Receive(Clock::now() + 10s));
    if (reg.header.type != wire::MsgType::kRegister) return ProtocolError("expected kRegister");
    wire::WelcomeMsg w;
    w.your_id = 0;
    w.num_workers = 1;
    w.num_servers = 1;
    w.members.push_back({wire::Role::kWorker, 0, "fake-worker", Bytes(8), Bytes(8)});
    w.members.push_back({wire::Role::kServer, 0, "fake-server", Bytes(8), Bytes(8)});
    return Send(wire::MsgType::kWelcome, wire::Encode(w));
  }

  Status Send(wire::MsgType type, std::span<const std::byte> payload = {}, uint64_t key = 0,
              uint64_t count = 0, uint8_t dtype = 0) {
    wire::Header h;
    h.type = type;
    h.job = job_;
    h.key = key;
    h.count = count;
    h.dtype = dtype;
    return channel_->Send(h, payload);
  }

  // The next frame from the server that is not a heartbeat, by `deadline`; heartbeats both
  // ways meanwhile.
  Result<transport::Frame> Next(Clock::time_point deadline) {
    while (Clock::now() < deadline) {
      if (Clock::now() - last_sent_ >= transport::kHeartbeatInterval) {
        GL_RETURN_IF_ERROR(Send(wire::MsgType::kHeartbeat));
        last_sent_ = Clock::now();
      }
      Result<transport::Frame> f = channel_->Receive(Clock::now() + 50ms);
      if (!f.ok() && f.status().code() == Code::kTimeout) continue;
      if (!f.ok()) return f.status();
      const auto now = Clock::now();
      longest_silence_ = std::max(longest_silence_, now - last_heard_);
      last_heard_ = now;
      if (f->header.type != wire::MsgType::kHeartbeat) return f;
    }
    return Timeout("no frame from the server");
  }

  // From now on, the longest time between two frames from the server.
  void StartTiming() {
    last_heard_ = Clock::now();
    longest_silence_ = {};
  }
  Clock::duration longest_silence() const { return longest_silence_; }

 private:
  static std::vector<std::byte> Bytes(size_t n) { return std::vector<std::byte>(n); }

  const uint32_t job_;
  std::unique_ptr<transport::Listener> listener_;
  std::unique_ptr<transport::ControlChannel> channel_;
  Clock::time_point last_sent_{}, last_heard_ = Clock::now();
  Clock::duration longest_silence_{};
};

TEST(JoinReleaseTest, TheServerHeartbeatsWhileABusyOwnerForgetsTheJoin) {
  constexpr auto kBusy = 4s;
  static_assert(kBusy > transport::kSilenceLimit);
  const std::string job = "join-release";
  FakeScheduler sched(wire::JobHash(job));
  auto fabric = std::make_shared<TestFabric>(0ms);
  ServerOptions svo;
  svo.scheduler = sched.address();
  svo.job = job;
  svo.connect_timeout = 10s;
  Status welcomed;
  std::thread welcome([&] { welcomed = sched.Welcome(); });
  auto server = StartServerOn(svo, fabric);
  welcome.join();
  ASSERT_TRUE(welcomed.ok()) << welcomed.ToString();
  ASSERT_TRUE(server.ok()) << server.status().ToString();

  // One 4 KiB partition: summed on the push lane's thread (kInlineSumBytes), its owner.
  wire::AssignMsg a;
  a.name = "t";
  a.partitions = {{0, 1024, 0}};
  ASSERT_TRUE(sched.Send(wire::MsgType::kAssign, wire::Encode(a), /*key=*/42, /*count=*/1024,
                         static_cast<uint8_t>(DataType::kFloat32)).ok());
  auto ack = sched.Next(Clock::now() + 5s);
  ASSERT_TRUE(ack.ok()) << ack.status().ToString();
  ASSERT_EQ(ack->header.type, wire::MsgType::kAssignAck);
  ASSERT_TRUE(sched.Send(wire::MsgType::kJoined, {}, 0, /*count=rank*/ 0).ok());

  // The owner is busy (a long sum, say) when every worker has joined.
  transport::Lane* push_lane = fabric->lane("server push lane");
  ASSERT_NE(push_lane, nullptr);
  const auto busy_from = Clock::now();
  push_lane->Defer([&] { std::this_thread::sleep_for(kBusy); });
  sched.StartTiming();
  ASSERT_TRUE(sched.Send(wire::MsgType::kJoinRelease).ok());
  auto released = sched.Next(Clock::now() + kBusy + 5s);
  ASSERT_TRUE(released.ok()) << released.status().ToString();
  EXPECT_EQ(released->header.type, wire::MsgType::kJoinRelease);
  // The ack waited for the owner to forget the join ...
  EXPECT_GE(Clock::now() - busy_from, kBusy - 100ms);
  // ... and the heartbeats did not (one every 500 ms; the control thread used to wait here).
  EXPECT_LT(sched.longest_silence(), 1500ms)
      << "the server was silent for "
      << std::chrono::duration_cast<std::chrono::milliseconds>(sched.longest_silence()).count()
      << " ms while its partitions forgot the join";
  ASSERT_TRUE(sched.Send(wire::MsgType::kShutdown).ok());
  EXPECT_TRUE((*server)->Wait(Clock::now() + 5s).ok());
}

}  // namespace
}  // namespace gradlink
