// Regression, named after what broke: a member that stops reading its control socket stalled
// the whole scheduler. The scheduler sent kWelcome/kAssign/kBarrierRelease with
// ControlChannel::Send's 10 s deadline while holding its only mutex, so once one member's socket
// was full, heartbeats and replies to everyone else stopped for up to 10 s (longer than
// kSilenceLimit) and the job failed late, naming nobody useful. Now sending is queueing on one
// event loop: the others keep hearing heartbeats and getting replies, and the member whose queue
// does not drain is failed alone (kPeerLost naming it) within about kSilenceLimit.
//
// A real Scheduler on 127.0.0.1 and raw control connections that speak the wire format: one
// server and three workers; worker 2 has a tiny receive buffer and never reads, but keeps
// sending heartbeats, declares and barriers like the others.
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "gradlink/scheduler.h"
#include "control/control_channel.h"
#include "wire/frame.h"
#include "wire/messages.h"

namespace gradlink {
namespace {

using namespace std::chrono_literals;
using transport::Clock;
using transport::ControlChannel;
using wire::MsgType;
using wire::Role;

constexpr char kJob[] = "slow-reader";

std::string Millis(Clock::duration d) {
  return std::to_string(std::chrono::duration_cast<std::chrono::milliseconds>(d).count()) + " ms";
}

// One member's control connection, and what it heard (when `reads`).
struct Member {
  Role role = Role::kWorker;
  int32_t rank = -1;
  std::string host;
  bool reads = true;
  std::unique_ptr<ControlChannel> channel;
  std::thread reader;

  std::mutex mu;
  bool welcomed = false;
  uint32_t id = 0;
  std::vector<Clock::time_point> heartbeats;
  std::map<uint64_t, Clock::time_point> assigns;   // key -> arrival (workers)
  std::map<uint64_t, Clock::time_point> releases;  // barrier round -> arrival
  std::optional<transport::Frame> abort;
  Clock::time_point abort_at;
  Status lost;  // the connection failed (not a kAbort)

  wire::Header Header(MsgType t) const {
    wire::Header h;
    h.type = t;
    h.job = wire::JobHash(kJob);
    h.sender = id;
    return h;
  }
  void Send(const wire::Header& h, std::span<const std::byte> payload = {}) {
    // Short deadline: the scheduler reads, so these never wait long (a blocked send fails).
    channel->Send(h, payload, Clock::now() + 500ms).IgnoreError();
  }

  void Read() {
    while (true) {
      auto f = channel->Receive(Clock::now() + 100ms);
      if (!f.ok()) {
        if (f.status().code() == Code::kTimeout) continue;
        std::lock_guard<std::mutex> lock(mu);
        lost = f.status();
        return;
      }
      const auto now = Clock::now();
      std::lock_guard<std::mutex> lock(mu);
      switch (f->header.type) {
        case MsgType::kWelcome: {
          auto w = wire::DecodeWelcome(f->payload);
          if (w.ok()) id = w->your_id;
          welcomed = true;
          break;
        }
        case MsgType::kHeartbeat: heartbeats.push_back(now); break;
        case MsgType::kAssign:
          if (role == Role::kServer) {
            wire::Header ack = Header(MsgType::kAssignAck);
            ack.key = f->header.key;
            Send(ack);
          } else {
            assigns[f->header.key] = now;
          }
          break;
        case MsgType::kBarrierRelease: releases[f->header.round] = now; break;
        case MsgType::kAbort:
          abort = std::move(*f);
          abort_at = now;
          return;
        default: break;
      }
    }
  }
};

std::unique_ptr<ControlChannel> ConnectTinyReceiveBuffer(uint16_t port) {
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return nullptr;
  int tiny = 1;  // the kernel rounds it up to its minimum (a few KB): the window closes at once
  ::setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &tiny, sizeof(tiny));
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(port);
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) != 0) {
    ::close(fd);
    return nullptr;
  }
  return std::make_unique<ControlChannel>(fd, "stuck client");
}

// Runs the job above: every 100 ms each worker declares a tensor of `partitions` partitions
// (its kAssign carries 20 bytes per partition) and enters a barrier round. Expects the stuck
// worker failed within `bound` of the traffic's start, for `why` (a part of the message), and
// at least `min_rounds` rounds measured before that.
void ExpectStuckWorkerFailedAlone(uint64_t partitions, Clock::duration bound, const char* why,
                                  size_t min_rounds) {
  SchedulerOptions so;
  so.host = "127.0.0.1";
  so.port = 0;
  so.job = kJob;
  so.num_workers = 3;
  so.num_servers = 1;
  so.join_timeout = 30s;
  auto sched = Scheduler::Start(so);
  ASSERT_TRUE(sched.ok()) << sched.status().ToString();
  const uint16_t port = (*sched)->port();

  std::vector<std::unique_ptr<Member>> members;
  const auto add = [&](Role role, int32_t rank, std::string host, bool reads) {
    auto m = std::make_unique<Member>();
    m->role = role;
    m->rank = rank;
    m->host = std::move(host);
    m->reads = reads;
    m->id = role == Role::kWorker ? static_cast<uint32_t>(rank) : 0;
    if (reads) {
      auto ch = ControlChannel::Connect("127.0.0.1", port, Clock::now() + 5s);
      if (ch.ok()) m->channel = std::move(ch).value();
    } else {
      m->channel = ConnectTinyReceiveBuffer(port);
    }
    members.push_back(std::move(m));
  };
  add(Role::kServer, -1, "server-host", true);
  add(Role::kWorker, 0, "worker0-host", true);
  add(Role::kWorker, 1, "worker1-host", true);
  add(Role::kWorker, 2, "stuck-host", false);
  for (auto& m : members) ASSERT_NE(m->channel, nullptr) << m->host << " could not connect";
  std::vector<Member*> healthy = {members[0].get(), members[1].get(), members[2].get()};
  std::vector<Member*> workers = {members[1].get(), members[2].get(), members[3].get()};

  for (auto& m : members) {
    wire::RegisterMsg reg;
    reg.role = m->role;
    reg.requested_rank = m->rank;
    reg.host = m->host;
    reg.push_address = {std::byte{1}};
    reg.pull_address = {std::byte{2}};
    m->Send(m->Header(MsgType::kRegister), wire::Encode(reg));
    if (m->reads) m->reader = std::thread([p = m.get()] { p->Read(); });
  }
  const auto all_welcomed = [&] {
    return std::all_of(healthy.begin(), healthy.end(), [](Member* m) {
      std::lock_guard<std::mutex> lock(m->mu);
      return m->welcomed;
    });
  };
  for (auto d = Clock::now() + 10s; !all_welcomed() && Clock::now() < d;) {
    std::this_thread::sleep_for(10ms);
  }
  const auto joined = [&] {
    for (auto& m : members) m->channel->Close();
    for (auto& m : members) {
      if (m->reader.joinable()) m->reader.join();
    }
  };
  if (!all_welcomed()) {
    joined();
    FAIL() << "the job did not start";
  }

  // Everyone, the stuck worker too, sends heartbeats; every 100 ms each worker declares a new
  // 8000-partition tensor and enters a new barrier round. The stuck worker's kAssigns pile up.
  std::atomic<bool> stop{false};
  std::thread heartbeats([&] {
    while (!stop) {
      for (auto& m : members) m->Send(m->Header(MsgType::kHeartbeat));
      std::this_thread::sleep_for(200ms);
    }
  });
  const auto traffic_start = Clock::now();
  std::map<uint64_t, Clock::time_point> sent;  // round -> when every worker had sent it
  std::map<uint64_t, uint64_t> key_of_round;
  const auto aborted = [&] {
    return std::all_of(healthy.begin(), healthy.end(), [](Member* m) {
      std::lock_guard<std::mutex> lock(m->mu);
      return m->abort.has_value() || !m->lost.ok();
    });
  };
  for (uint64_t round = 1; !aborted() && Clock::now() - traffic_start < 20s; ++round) {
    const std::string name = "t" + std::to_string(round);
    const uint64_t key = wire::TensorKey(kJob, name);
    for (Member* w : workers) {
      wire::Header h = w->Header(MsgType::kDeclare);
      h.key = key;
      h.dtype = static_cast<uint8_t>(DataType::kFloat32);
      h.count = partitions;
      w->Send(h, wire::Encode(wire::DeclareMsg{name, 4, {}}));  // one element per partition
      wire::Header b = w->Header(MsgType::kBarrier);
      b.round = round;
      w->Send(b);
    }
    sent[round] = Clock::now();
    key_of_round[round] = key;
    std::this_thread::sleep_for(100ms);
  }
  const auto traffic_end = Clock::now();
  stop = true;
  heartbeats.join();
  Status result = (*sched)->Wait(Clock::now() + 5s);
  joined();
  (*sched)->Stop();

  // (3) The job failed with kPeerLost naming the stuck worker, within the bound.
  EXPECT_LT(traffic_end - traffic_start, bound) << "no kAbort within " << Millis(bound);
  EXPECT_EQ(result.code(), Code::kPeerLost) << result.ToString();
  EXPECT_NE(result.message().find("worker 2"), std::string::npos) << result.message();
  EXPECT_NE(result.message().find("stuck-host"), std::string::npos) << result.message();
  EXPECT_NE(result.message().find(why), std::string::npos) << result.message();
  Clock::time_point failed_at = traffic_end;
  for (Member* m : healthy) {
    std::lock_guard<std::mutex> lock(m->mu);
    ASSERT_TRUE(m->abort.has_value()) << m->host << " got no kAbort: " << m->lost.ToString();
    EXPECT_EQ(m->abort->header.code, static_cast<uint8_t>(Code::kPeerLost)) << m->host;
    auto text = wire::DecodeText(m->abort->payload);
    ASSERT_TRUE(text.ok());
    EXPECT_NE(text->find("worker 2"), std::string::npos) << m->host << ": " << *text;
    failed_at = std::min(failed_at, m->abort_at);
  }

  // (1) The healthy members heard heartbeats throughout: no gap much over kHeartbeatInterval.
  for (Member* m : healthy) {
    std::lock_guard<std::mutex> lock(m->mu);
    Clock::time_point prev = traffic_start;
    Clock::duration worst{};
    for (Clock::time_point t : m->heartbeats) {
      if (t < traffic_start || t > m->abort_at) continue;
      worst = std::max(worst, t - prev);
      prev = t;
    }
    worst = std::max(worst, m->abort_at - prev);
    EXPECT_LT(worst, 1500ms) << m->host << ": heartbeats stopped for " << Millis(worst);
  }

  // (2) The job went on for the others until the stuck worker was failed: every barrier round
  // and every tensor declared before then (a margin for the last round in flight) came back to
  // both healthy workers promptly.
  for (Member* w : {members[1].get(), members[2].get()}) {
    std::lock_guard<std::mutex> lock(w->mu);
    size_t checked = 0;
    for (const auto& [round, at] : sent) {
      if (at > failed_at - 300ms) break;
      ++checked;
      auto r = w->releases.find(round);
      ASSERT_NE(r, w->releases.end()) << w->host << ": barrier " << round << " never released";
      EXPECT_LT(r->second - at, 1s) << w->host << ": barrier " << round << " took "
                                    << Millis(r->second - at);
      auto a = w->assigns.find(key_of_round[round]);
      ASSERT_NE(a, w->assigns.end()) << w->host << ": tensor of round " << round
                                     << " never assigned";
      EXPECT_LT(a->second - at, 1s) << w->host << ": tensor of round " << round << " took "
                                    << Millis(a->second - at);
    }
    EXPECT_GE(checked, min_rounds) << "the stuck worker was failed before the test measured much";
  }
}

// 160 KB per kAssign: the stuck worker's socket is full at once, its queue stays under
// kMaxQueuedBytes, and its oldest frame has waited kSilenceLimit after about that long.
TEST(SlowReaderTest, MemberThatStopsReadingIsFailedAloneWhileTheOthersProgress) {
  ExpectStuckWorkerFailedAlone(8000, transport::kSilenceLimit + 5s, "(the limit is 3000 ms)", 10);
}

// 900 KB per kAssign: the stuck worker's queue passes kMaxQueuedBytes (8 MiB) within about a
// second, and it is failed then, well before kSilenceLimit.
TEST(SlowReaderTest, MemberWhoseQueuePassesTheByteBoundIsFailedBeforeTheSilenceLimit) {
  ExpectStuckWorkerFailedAlone(45000, transport::kSilenceLimit, "(the limit is 8388608)",
                               3);
}

}  // namespace
}  // namespace gradlink
