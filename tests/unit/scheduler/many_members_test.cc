// The scheduler's one event loop with many members: 1,000 workers and 4 servers as raw control
// connections (one client thread drives them all, so the test itself needs no thread per
// member). Every member is welcomed with the full address book, every worker's barrier is
// released to every worker, every member keeps hearing heartbeats, and the job ends cleanly when
// all say goodbye. (The old scheduler ran a thread per connection.)
#include <gtest/gtest.h>
#include <sys/resource.h>

#include <chrono>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "control/control_channel.h"
#include "gradlink/scheduler.h"
#include "wire/frame.h"
#include "wire/messages.h"

namespace gradlink {
namespace {

using namespace std::chrono_literals;
using transport::Clock;
using transport::ControlChannel;
using wire::MsgType;
using wire::Role;

constexpr char kJob[] = "many-members";
constexpr uint32_t kWorkers = 1000, kServers = 4;

std::string Millis(Clock::duration d) {
  return std::to_string(std::chrono::duration_cast<std::chrono::milliseconds>(d).count()) + " ms";
}

wire::Header Header(MsgType t, uint32_t sender) {
  wire::Header h;
  h.type = t;
  h.job = wire::JobHash(kJob);
  h.sender = sender;
  return h;
}

// The next frame of `ch` that is not a heartbeat; counts the heartbeats skipped.
Result<transport::Frame> NextNonHeartbeat(ControlChannel& ch, Clock::time_point deadline,
                                          uint64_t* heartbeats) {
  while (true) {
    GL_ASSIGN_OR_RETURN(transport::Frame f, ch.Receive(deadline));
    if (f.header.type != MsgType::kHeartbeat) return f;
    ++*heartbeats;
  }
}

TEST(ManyMembersTest, AThousandWorkersJoinMeetAtABarrierAndLeave) {
  // Two sockets per member in this process (client and scheduler ends).
  rlimit nofile{};
  ASSERT_EQ(::getrlimit(RLIMIT_NOFILE, &nofile), 0);
  const rlim_t need = 2 * (kWorkers + kServers) + 256;
  if (nofile.rlim_cur < need) {
    nofile.rlim_cur = std::min<rlim_t>(need, nofile.rlim_max);
    ::setrlimit(RLIMIT_NOFILE, &nofile);
    ::getrlimit(RLIMIT_NOFILE, &nofile);
  }
  if (nofile.rlim_cur < need) GTEST_SKIP() << "needs " << need << " file descriptors";

  SchedulerOptions so;
  so.host = "127.0.0.1";
  so.port = 0;
  so.job = kJob;
  so.num_workers = kWorkers;
  so.num_servers = kServers;
  so.join_timeout = 60s;
  auto sched = Scheduler::Start(so);
  ASSERT_TRUE(sched.ok()) << sched.status().ToString();
  const uint16_t port = (*sched)->port();

  const uint32_t n = kWorkers + kServers;
  std::vector<std::unique_ptr<ControlChannel>> ch(n);
  const auto t_join = Clock::now();
  for (uint32_t i = 0; i < n; ++i) {
    auto c = ControlChannel::Connect("127.0.0.1", port, Clock::now() + 10s);
    ASSERT_TRUE(c.ok()) << "member " << i << ": " << c.status().ToString();
    ch[i] = std::move(c).value();
    const bool server = i >= kWorkers;
    wire::RegisterMsg reg;
    reg.role = server ? Role::kServer : Role::kWorker;
    reg.requested_rank = server ? -1 : static_cast<int32_t>(i);
    reg.host = (server ? "server-" : "worker-") + std::to_string(i);
    reg.push_address = {std::byte{1}, std::byte{2}, std::byte{3}, std::byte{4}};
    reg.pull_address = {std::byte{5}, std::byte{6}, std::byte{7}, std::byte{8}};
    ASSERT_TRUE(ch[i]->Send(Header(MsgType::kRegister, 0), wire::Encode(reg),
                            Clock::now() + 5s).ok());
    // At most kMaxUnregisteredPerAddress (256) connections from one address may wait for their
    // kRegister to be read (more close the oldest of them).
    if (i % 100 == 99) std::this_thread::sleep_for(20ms);
  }
  uint64_t heartbeats = 0;
  for (uint32_t i = 0; i < n; ++i) {
    auto f = NextNonHeartbeat(*ch[i], Clock::now() + 30s, &heartbeats);
    ASSERT_TRUE(f.ok()) << "member " << i << ": " << f.status().ToString();
    ASSERT_EQ(f->header.type, MsgType::kWelcome) << "member " << i;
    auto w = wire::DecodeWelcome(f->payload);
    ASSERT_TRUE(w.ok()) << w.status().ToString();
    ASSERT_EQ(w->members.size(), n);
    if (i < kWorkers) {
      ASSERT_EQ(w->your_id, i);
    }
    ch[i]->Send(Header(MsgType::kHeartbeat, w->your_id), {}, Clock::now() + 1s).IgnoreError();
  }
  const auto joined_in = Clock::now() - t_join;
  // Members heartbeat as real ones do (the scheduler takes one silent for kSilenceLimit as hung).
  const auto heartbeat_all = [&] {
    for (uint32_t i = 0; i < n; ++i) {
      ch[i]->Send(Header(MsgType::kHeartbeat, i < kWorkers ? i : i - kWorkers), {},
                  Clock::now() + 1s).IgnoreError();
    }
  };
  heartbeat_all();

  // Every worker enters barrier 1; every worker hears its release.
  const auto t_barrier = Clock::now();
  wire::Header b = Header(MsgType::kBarrier, 0);
  b.round = 1;
  for (uint32_t i = 0; i < kWorkers; ++i) {
    b.sender = i;
    ASSERT_TRUE(ch[i]->Send(b, {}, Clock::now() + 5s).ok());
  }
  for (uint32_t i = 0; i < kWorkers; ++i) {
    auto f = NextNonHeartbeat(*ch[i], Clock::now() + 20s, &heartbeats);
    ASSERT_TRUE(f.ok()) << "worker " << i << ": " << f.status().ToString();
    ASSERT_EQ(f->header.type, MsgType::kBarrierRelease) << "worker " << i;
    ASSERT_EQ(f->header.round, 1u);
  }
  const auto barrier_in = Clock::now() - t_barrier;
  heartbeat_all();

  // Quiet for 1.2 s: every member must hear at least one heartbeat (every 500 ms) meanwhile.
  std::this_thread::sleep_for(1200ms);
  uint32_t heard = 0;
  for (uint32_t i = 0; i < n; ++i) {
    auto f = ch[i]->Receive(Clock::now() + 2s);
    if (f.ok() && f->header.type == MsgType::kHeartbeat) ++heard;
  }
  EXPECT_EQ(heard, n);

  for (uint32_t i = 0; i < kWorkers; ++i) {
    ASSERT_TRUE(ch[i]->Send(Header(MsgType::kGoodbye, i), {}, Clock::now() + 5s).ok());
  }
  const Status end = (*sched)->Wait(Clock::now() + 20s);
  EXPECT_TRUE(end.ok()) << end.ToString();
  std::printf("%u workers + %u servers: all welcomed in %s, a barrier of all in %s, "
              "%u of %u heard a heartbeat in a quiet 1.2 s\n",
              kWorkers, kServers, Millis(joined_in).c_str(), Millis(barrier_in).c_str(), heard, n);
  EXPECT_LT(joined_in, 30s);
  EXPECT_LT(barrier_in, 5s);
  (*sched)->Stop();
}

}  // namespace
}  // namespace gradlink
