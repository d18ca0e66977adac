// A server that takes longer than the scheduler's silence limit (3 s) to connect to its
// workers (thousands of them, or a slow fabric) must still be heard: it heartbeats while it
// connects (control/join.h HeartbeatPump). Here a fabric whose every Connect() takes 400 ms,
// and 10 workers: 4 s of connecting. The job must still be running afterwards. (The server
// used to start heartbeating only after connecting to every worker: with 192 workers the
// scheduler declared it hung.)
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <memory>
#include <string>
#include <thread>
#include <vector>

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

// Forwards everything to the inproc lane, but Connect() first sleeps kConnectDelay.
class SlowConnectLane final : public transport::Lane {
 public:
  explicit SlowConnectLane(std::unique_ptr<transport::Lane> inner) : inner_(std::move(inner)) {}
  std::vector<std::byte> address() const override { return inner_->address(); }
  void SetAuthenticator(std::shared_ptr<const security::LaneAuthenticator> a) override {
    inner_->SetAuthenticator(std::move(a));
  }
  Status Start(transport::Receiver* r) override { return inner_->Start(r); }
  Result<transport::PeerId> Connect(std::span<const std::byte> remote, std::string name) override {
    std::this_thread::sleep_for(kConnectDelay);
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
};

class SlowConnectFabric final : public transport::Fabric {
 public:
  Result<std::unique_ptr<transport::Lane>> CreateLane(std::string name) override {
    GL_ASSIGN_OR_RETURN(auto lane, inner_->CreateLane(std::move(name)));
    return std::unique_ptr<transport::Lane>(new SlowConnectLane(std::move(lane)));
  }
  std::string_view kind() const override { return "slow-connect inproc"; }

 private:
  std::shared_ptr<transport::Fabric> inner_ = transport::CreateInprocFabric();
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
  auto server = StartServerOn(svo, std::make_shared<SlowConnectFabric>());
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

}  // namespace
}  // namespace gradlink
