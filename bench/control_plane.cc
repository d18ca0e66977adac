// control_plane_bench N...: the scheduler's control plane alone with N members each (N - 4
// workers, 4 servers) as raw control connections driven from this process: join (connect,
// register, every member welcomed with the whole address book), planning of 100 keys (every
// worker declares each; servers get and acknowledge the plan; every worker gets it), 10 barriers
// of every worker, and shutdown (every worker says goodbye; the job ends cleanly). Prints one
// table row per N with each phase's time and the join and plan time per member.
//
// Members connect from their own loopback addresses (127.0.x.y, as members on other hosts
// would), so the scheduler's cap on unregistered connections per address is not what is
// measured. One thread drives every member in turn; a second one heartbeats for all of them, as
// real members do, so that none is taken for a silent one while the others are being served.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "control/control_channel.h"
#include "gradlink/scheduler.h"
#include "wire/frame.h"
#include "wire/messages.h"

namespace {

using namespace std::chrono_literals;
using gradlink::Result;
using gradlink::Status;
using gradlink::transport::Clock;
using gradlink::transport::ControlChannel;
using gradlink::transport::Frame;
using gradlink::wire::MsgType;
using gradlink::wire::Role;

constexpr char kJob[] = "control-plane";
constexpr uint32_t kServers = 4, kKeys = 100, kBarriers = 10;

double Seconds(Clock::duration d) { return std::chrono::duration<double>(d).count(); }

gradlink::wire::Header Header(MsgType t, uint32_t sender) {
  gradlink::wire::Header h;
  h.type = t;
  h.job = gradlink::wire::JobHash(kJob);
  h.sender = sender;
  return h;
}

// A connection to 127.0.0.1:port from 127.0.(1 + i / 250).(1 + i % 250).
Result<std::unique_ptr<ControlChannel>> ConnectFrom(uint32_t i, uint16_t port) {
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return gradlink::Unavailable("socket failed");
  sockaddr_in src{}, dst{};
  src.sin_family = dst.sin_family = AF_INET;
  src.sin_addr.s_addr = htonl((127u << 24) | ((1 + i / 250) << 8) | (1 + i % 250));
  dst.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  dst.sin_port = htons(port);
  if (::bind(fd, reinterpret_cast<sockaddr*>(&src), sizeof(src)) != 0 ||
      ::connect(fd, reinterpret_cast<sockaddr*>(&dst), sizeof(dst)) != 0) {
    ::close(fd);
    return gradlink::Unavailable("member " + std::to_string(i) + " cannot connect");
  }
  return std::make_unique<ControlChannel>(fd, "scheduler");
}

// The next frame that is not a heartbeat.
Result<Frame> Next(ControlChannel& ch, Clock::time_point deadline) {
  while (true) {
    GL_ASSIGN_OR_RETURN(Frame f, ch.Receive(deadline));
    if (f.header.type != MsgType::kHeartbeat) return f;
  }
}

struct Row {
  uint32_t members = 0;
  double join = 0, plan = 0, barriers = 0, shutdown = 0;
};

#define CHECK_OK(expr, what)                                                      \
  do {                                                                            \
    if (Status s_ = (expr); !s_.ok()) {                                           \
      std::fprintf(stderr, "control_plane_bench: %s: %s\n", std::string(what).c_str(), \
                   s_.ToString().c_str());                                        \
      std::exit(1);                                                               \
    }                                                                             \
  } while (0)

Row RunJob(uint32_t members) {
  const uint32_t workers = members - kServers;
  gradlink::SchedulerOptions so;
  so.host = "127.0.0.1";
  so.job = kJob;
  so.num_workers = workers;
  so.num_servers = kServers;
  so.join_timeout = 120s;
  auto sched = gradlink::Scheduler::Start(so);
  CHECK_OK(sched.status(), "scheduler");
  const uint16_t port = (*sched)->port();
  std::vector<std::unique_ptr<ControlChannel>> ch(members);
  std::vector<uint32_t> id(members);  // worker rank or server id
  std::atomic<bool> stop{false};
  std::atomic<uint32_t> welcomed{0};
  // Heartbeats for every member welcomed so far, every 500 ms (as members send them; the
  // scheduler takes one before the welcome for a protocol error).
  std::thread heartbeats([&] {
    while (!stop.load()) {
      const uint32_t n = welcomed.load();
      for (uint32_t i = 0; i < n && !stop.load(); ++i) {
        ch[i]->Send(Header(MsgType::kHeartbeat, id[i]), {}, Clock::now() + 100ms).IgnoreError();
      }
      std::this_thread::sleep_for(gradlink::transport::kHeartbeatInterval);
    }
  });
  Row row;
  row.members = members;

  std::vector<std::byte> worker_book, server_book;
  // ---- join ----
  const auto t0 = Clock::now();
  for (uint32_t i = 0; i < members; ++i) {
    auto c = ConnectFrom(i, port);
    CHECK_OK(c.status(), "connect");
    const bool server = i >= workers;
    id[i] = server ? i - workers : i;
    gradlink::wire::RegisterMsg reg;
    reg.role = server ? Role::kServer : Role::kWorker;
    reg.requested_rank = server ? -1 : static_cast<int32_t>(i);
    reg.host = (server ? "server-" : "worker-") + std::to_string(i);
    reg.push_address.assign(24, std::byte{1});
    reg.pull_address.assign(24, std::byte{2});
    reg.memory_budget = uint64_t{1} << 40;
    CHECK_OK(c.value()->Send(Header(MsgType::kRegister, 0), gradlink::wire::Encode(reg),
                             Clock::now() + 5s),
             "register");
    ch[i] = std::move(c).value();
  }
  for (uint32_t i = 0; i < members; ++i) {
    auto f = Next(*ch[i], Clock::now() + 60s);
    CHECK_OK(f.status(), "welcome of member " + std::to_string(i));
    if (f->header.type != MsgType::kWelcome) CHECK_OK(gradlink::Internal("not a welcome"), "join");
    // Every worker's welcome is the same address book after its own id (4 bytes), and every
    // server's another: decode every 100th and each role's first in full (a real member decodes
    // its own, in parallel with the others; one thread decoding all 4,000 in turn would make
    // the last ones late with their heartbeats), and compare the rest with it byte for byte.
    std::vector<std::byte>& book = i < workers ? worker_book : server_book;
    if (i % 100 == 0 || i == workers) {
      auto w = gradlink::wire::DecodeWelcome(f->payload);
      CHECK_OK(w.status(), "welcome");
      if (w->members.size() != members) CHECK_OK(gradlink::Internal("short address book"), "join");
      for (const auto& m : w->members) {
        // Servers get every lane address; workers the servers' only (and worker 0's push).
        const bool full = i >= workers || m.role == Role::kServer;
        if ((full || m.id == 0) != !m.push_address.empty() || full != !m.pull_address.empty()) {
          CHECK_OK(gradlink::Internal("member " + std::to_string(i) + ": wrong address book"),
                   "join");
        }
      }
      book.assign(f->payload.begin() + 4, f->payload.end());
    } else if (f->payload.size() != book.size() + 4 ||
               !std::equal(book.begin(), book.end(), f->payload.begin() + 4)) {
      CHECK_OK(gradlink::Internal("member " + std::to_string(i) + "'s address book differs"),
               "join");
    }
    uint32_t your_id = 0;
    for (int b = 0; b < 4; ++b) your_id |= uint32_t(f->payload[b]) << (8 * b);
    id[i] = your_id;
    welcomed.store(i + 1);
  }
  row.join = Seconds(Clock::now() - t0);

  // ---- plan 100 keys ----
  const auto t1 = Clock::now();
  for (uint32_t i = 0; i < workers; ++i) {
    for (uint32_t k = 0; k < kKeys; ++k) {
      const std::string name = "layer" + std::to_string(k) + ".weight";
      gradlink::wire::Header h = Header(MsgType::kDeclare, id[i]);
      h.key = gradlink::wire::TensorKey(kJob, name);
      h.dtype = static_cast<uint8_t>(gradlink::DataType::kFloat32);
      h.count = 1024 * (k + 1);
      gradlink::wire::DeclareMsg d{name, 4u << 20, {h.count}};
      CHECK_OK(ch[i]->Send(h, gradlink::wire::Encode(d), Clock::now() + 10s), "declare");
    }
  }
  for (uint32_t s = workers; s < members; ++s) {
    for (uint32_t k = 0; k < kKeys; ++k) {
      auto f = Next(*ch[s], Clock::now() + 60s);
      CHECK_OK(f.status(), "server plan");
      if (f->header.type != MsgType::kAssign) CHECK_OK(gradlink::Internal("not a plan"), "server");
      gradlink::wire::Header ack = Header(MsgType::kAssignAck, id[s]);
      ack.key = f->header.key;
      CHECK_OK(ch[s]->Send(ack, {}, Clock::now() + 10s), "ack");
    }
  }
  for (uint32_t i = 0; i < workers; ++i) {
    for (uint32_t k = 0; k < kKeys; ++k) {
      auto f = Next(*ch[i], Clock::now() + 60s);
      CHECK_OK(f.status(), "worker plan");
      if (f->header.type != MsgType::kAssign || f->header.code != 0) {
        CHECK_OK(gradlink::Internal("worker got no plan"), "plan");
      }
    }
  }
  row.plan = Seconds(Clock::now() - t1);

  // ---- 10 barriers ----
  const auto t2 = Clock::now();
  for (uint32_t b = 1; b <= kBarriers; ++b) {
    for (uint32_t i = 0; i < workers; ++i) {
      gradlink::wire::Header h = Header(MsgType::kBarrier, id[i]);
      h.round = b;
      CHECK_OK(ch[i]->Send(h, {}, Clock::now() + 10s), "barrier");
    }
    for (uint32_t i = 0; i < workers; ++i) {
      auto f = Next(*ch[i], Clock::now() + 60s);
      CHECK_OK(f.status(), "barrier release");
      if (f->header.type != MsgType::kBarrierRelease || f->header.round != b) {
        CHECK_OK(gradlink::Internal("not a barrier release"), "barrier");
      }
    }
  }
  row.barriers = Seconds(Clock::now() - t2);

  // ---- shutdown ----
  const auto t3 = Clock::now();
  for (uint32_t i = 0; i < workers; ++i) {
    CHECK_OK(ch[i]->Send(Header(MsgType::kGoodbye, id[i]), {}, Clock::now() + 10s), "goodbye");
  }
  CHECK_OK((*sched)->Wait(Clock::now() + 60s), "the job's end");
  row.shutdown = Seconds(Clock::now() - t3);
  stop.store(true);
  heartbeats.join();
  (*sched)->Stop();
  return row;
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<uint32_t> sizes;
  for (int i = 1; i < argc; ++i) sizes.push_back(static_cast<uint32_t>(std::atoi(argv[i])));
  if (sizes.empty()) sizes = {1000, 4000};
  uint32_t largest = 0;
  for (uint32_t n : sizes) {
    if (n <= kServers || n > 60000) {
      std::fprintf(stderr, "control_plane_bench: %u members: want 5..60000\n", n);
      return 2;
    }
    largest = std::max(largest, n);
  }
  // Two sockets per member in this process (ours and the scheduler's end).
  rlimit nofile{};
  ::getrlimit(RLIMIT_NOFILE, &nofile);
  const rlim_t need = 2 * rlim_t{largest} + 256;
  if (nofile.rlim_cur < need) {
    nofile.rlim_cur = std::min<rlim_t>(need, nofile.rlim_max);
    ::setrlimit(RLIMIT_NOFILE, &nofile);
    ::getrlimit(RLIMIT_NOFILE, &nofile);
  }
  if (nofile.rlim_cur < need) {
    std::fprintf(stderr, "control_plane_bench: needs %llu file descriptors, may have %llu\n",
                 static_cast<unsigned long long>(need),
                 static_cast<unsigned long long>(nofile.rlim_cur));
    return 2;
  }
  std::printf("| members (workers + 4 servers) | join s | plan 100 keys s | 10 barriers s | "
              "shutdown s | join us/member | plan us/member |\n|---|---|---|---|---|---|---|\n");
  for (uint32_t n : sizes) {
    const Row r = RunJob(n);
    std::printf("| %u | %.3f | %.3f | %.3f | %.3f | %.0f | %.0f |\n", r.members, r.join, r.plan,
                r.barriers, r.shutdown, 1e6 * r.join / n, 1e6 * r.plan / n);
    std::fflush(stdout);
  }
  return 0;
}
