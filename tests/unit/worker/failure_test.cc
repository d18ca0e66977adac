// Whole jobs that go wrong: deadlines, a worker lost without a goodbye, a worker or server that
// leaves mid-job, the scheduler stopping, shutdown under pending operations, and no thread or fd
// left behind after a failed job. Every wait has a deadline: a test fails, it never hangs.
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <memory>
#include <random>
#include <regex>
#include <map>
#include <atomic>
#include <string>
#include <thread>
#include <vector>

#include "control/join.h"
#include "gradlink/scheduler.h"
#include "gradlink/worker.h"
#include "transport/transport.h"
#include "worker/worker_impl.h"
#include "unit/support/job_harness.h"
#include "unit/support/reference.h"
#include "unit/support/rounds.h"
#include "unit/support/scenarios.h"

namespace gradlink {
namespace {

using namespace std::chrono_literals;
using test::ExpectCleanGoodbyeFailsTheOthersPendingOp;
using test::ExpectSchedulerStopAbortsPendingOps;
using test::ExpectShutdownFailsOwnPendingOps;
using test::ExpectWaitTimesOutThenCompletes;
using test::In;
using test::Job;
using test::JobConfig;

// ---- deadlines -----------------------------------------------------------------------------

TEST(JobTest, WaitTimesOutWhenAnotherWorkerHasNotPushed) { ExpectWaitTimesOutThenCompletes({}); }

// ---- members that leave mid-job --------------------------------------------------------------

TEST(JobTest, UncleanWorkerLossAbortsTheJob) {
  // Rank 1 joins with a bare control connection and drops it without a goodbye: the scheduler
  // aborts the job, and rank 0's pending operation fails (naming the lost worker) instead of
  // waiting for a push that will never come.
  JobConfig config;
  config.workers = 2;
  config.servers = 2;
  config.fake_worker_ranks = {1};
  Job job;
  ASSERT_NO_FATAL_FAILURE(job.Start(config));
  auto t = job.worker(0).Declare("t", DataType::kFloat32, 100);
  ASSERT_TRUE(t.ok());
  std::vector<std::byte>& buf = job.Buffer(400);
  PushPullHandle op = job.worker(0).PushPull(*t, buf);
  EXPECT_EQ(op.Wait(In(100ms)).code(), Code::kTimeout);

  const auto start = Clock::now();
  job.DropFake(1);
  Status s = op.Wait(In(5s));
  EXPECT_LT(Clock::now() - start, 5s);
  EXPECT_TRUE(s.code() == Code::kPeerLost || s.code() == Code::kAborted) << s.ToString();
  EXPECT_NE(s.message().find("worker 1"), std::string::npos) << s.message();
  // Sticky: later operations fail at once too.
  Status later = job.worker(0).PushPull(*t, buf).Wait(In(1s));
  EXPECT_EQ(later.code(), s.code()) << later.ToString();
  EXPECT_FALSE(job.worker(0).Declare("u", DataType::kFloat32, 1).ok());
  // Everyone learns that the job failed.
  Status sched = job.scheduler().Wait(In(5s));
  EXPECT_EQ(sched.code(), Code::kPeerLost) << sched.ToString();
  for (uint32_t i = 0; i < 2; ++i) {
    Status srv = job.server(i).Wait(In(5s));
    EXPECT_FALSE(srv.ok());
    EXPECT_NE(srv.code(), Code::kTimeout) << srv.ToString();
  }
}

TEST(JobTest, ShutdownFailsTheWorkersOwnPendingOps) { ExpectShutdownFailsOwnPendingOps({}, 100); }

TEST(JobTest, SchedulerStopAbortsPendingOps) { ExpectSchedulerStopAbortsPendingOps({}); }

// Through the servers: the scheduler tells them (kMemberLeft), and they fail the round.
TEST(JobTest, CleanGoodbyeOfOneWorkerFailsTheOthersPendingOp) {
  ExpectCleanGoodbyeFailsTheOthersPendingOp({});
}

// Regression (src/scheduler/scheduler.cc OnGoodbye): a server that left mid-job (Stop() sends a
// goodbye) is only marked as left; the job is not aborted, so a worker whose push already sits on
// that server waited forever. Now the job fails, naming the server.
TEST(JobTest, ServerLeavingMidJobFailsPendingOps) {
  JobConfig config;
  Job job;
  ASSERT_NO_FATAL_FAILURE(job.Start(config));
  auto t0 = job.worker(0).Declare("t", DataType::kFloat32, 100);
  auto t1 = job.worker(1).Declare("t", DataType::kFloat32, 100);
  ASSERT_TRUE(t0.ok() && t1.ok());
  std::vector<std::byte>& b0 = job.Buffer(400);
  std::vector<std::byte>& b1 = job.Buffer(400);
  PushPullHandle op = job.worker(0).PushPull(*t0, b0);
  EXPECT_EQ(op.Wait(In(200ms)).code(), Code::kTimeout);  // pushed; waits for rank 1
  const auto start = Clock::now();
  job.server(0).Stop();
  Status s = op.Wait(In(5s));
  EXPECT_LT(Clock::now() - start, 5500ms);
  EXPECT_TRUE(s.code() == Code::kAborted || s.code() == Code::kPeerLost) << s.ToString();
  Status s1 = job.worker(1).PushPull(*t1, b1).Wait(In(5s));
  EXPECT_TRUE(s1.code() == Code::kAborted || s1.code() == Code::kPeerLost) << s1.ToString();
}

size_t CountEntries(const char* dir) {
  size_t n = 0;
  for ([[maybe_unused]] const auto& e : std::filesystem::directory_iterator(dir)) ++n;
  return n;
}

// After a job that failed mid-round (scheduler stopped under a pending op) has been torn down,
// the process holds exactly the threads and file descriptors it had before.
TEST(JobTest, NoThreadOrFdLeaksAfterAFailedJob) {
  // Runtimes that start a helper thread with the first thread (ThreadSanitizer's background
  // thread) do so now, before the count.
  std::thread([] {}).join();
  const size_t threads_before = CountEntries("/proc/self/task");
  const size_t fds_before = CountEntries("/proc/self/fd");
  {
    JobConfig config;
    config.servers = 2;
    Job job;
    ASSERT_NO_FATAL_FAILURE(job.Start(config));
    auto t0 = job.worker(0).Declare("t", DataType::kFloat32, 100000);
    auto t1 = job.worker(1).Declare("t", DataType::kFloat32, 100000);
    ASSERT_TRUE(t0.ok() && t1.ok());
    std::vector<std::byte>& b0 = job.Buffer(400000);
    std::vector<std::byte>& b1 = job.Buffer(400000);
    PushPullHandle h0 = job.worker(0).PushPull(*t0, b0);
    PushPullHandle h1 = job.worker(1).PushPull(*t1, b1);
    ASSERT_TRUE(h0.Wait(In(5s)).ok());
    ASSERT_TRUE(h1.Wait(In(5s)).ok());
    PushPullHandle pending = job.worker(0).PushPull(*t0, b0);  // rank 1 never joins this round
    job.scheduler().Stop();
    Status s = pending.Wait(In(5s));
    EXPECT_NE(s.code(), Code::kOk);
    EXPECT_NE(s.code(), Code::kTimeout) << s.ToString();
  }
  EXPECT_EQ(CountEntries("/proc/self/task"), threads_before);
  EXPECT_EQ(CountEntries("/proc/self/fd"), fds_before);
}


// ---- a server lost while the worker joins ---------------------------------------------------

// Every server of the job is gone before the worker connects to it: with a secret, each
// Connect() in Init() sends the lane hello at once, the inproc fabric finds no lane behind the
// address, and the push lane reports each endpoint failed on its own thread while Init() is
// still connecting to the next server. Init() must not fail on that (the scheduler's verdict
// may still come), and within the verdict grace the worker fails with PeerLost naming the
// server behind the first failed endpoint by its id and host, as the scheduler numbered it.
// Run under ThreadSanitizer (build-tsan) this is the race of lanes that start before the
// server directory is written: callbacks that read it while Init() writes it.
TEST(JobTest, ServersLostWhileTheWorkerConnectsAreNamedAfterItJoins) {
  constexpr uint32_t kServers = 16;
  const std::string kSecret = "a secret for the lost-server test";
  SchedulerOptions so;
  so.host = "127.0.0.1";
  so.port = 0;
  so.job = "lost-servers";
  so.num_workers = 1;
  so.num_servers = kServers;
  so.join_timeout = 30s;
  so.secret = kSecret;
  auto sched = Scheduler::Start(so);
  ASSERT_TRUE(sched.ok()) << sched.status().ToString();
  const std::string address = "127.0.0.1:" + std::to_string((*sched)->port());

  // Lanes never started: their addresses lead nowhere.
  auto fabric = transport::CreateInprocFabric();
  std::vector<std::unique_ptr<transport::Lane>> dead;
  std::mutex mu;
  std::map<uint32_t, std::string> host_of_id;
  std::atomic<bool> stop{false};
  std::vector<std::thread> servers;
  for (uint32_t i = 0; i < kServers; ++i) {
    auto lane = fabric->CreateLane("dead server lane");
    ASSERT_TRUE(lane.ok()) << lane.status().ToString();
    wire::RegisterMsg reg;
    reg.role = wire::Role::kServer;
    reg.requested_rank = -1;
    reg.host = "dead-host-" + std::to_string(i);
    reg.push_address = (*lane)->address();
    reg.pull_address = (*lane)->address();
    dead.push_back(std::move(lane).value());
    servers.emplace_back([&, reg] {
      auto joined = JoinJob(address, wire::JobHash(so.job), reg, In(20s), kSecret);
      if (!joined.ok()) {
        ADD_FAILURE() << reg.host << ": " << joined.status().ToString();
        return;
      }
      {
        std::lock_guard lock(mu);
        host_of_id[joined->welcome.your_id] = reg.host;
      }
      Liveness liveness(joined->channel.get(), wire::JobHash(so.job), joined->welcome.your_id);
      while (!stop.load()) {
        if (!liveness.Tick().ok()) return;
        auto f = joined->channel->Receive(In(50ms));
        if (f.ok()) liveness.Heard();
        else if (f.status().code() != Code::kTimeout) return;
      }
    });
  }

  WorkerOptions wo;
  wo.scheduler = address;
  wo.job = so.job;
  wo.rank = 0;
  wo.secret = kSecret;
  wo.connect_timeout = 20s;
  auto worker = ConnectWorkerOn(wo, fabric);
  ASSERT_TRUE(worker.ok()) << worker.status().ToString();

  Status failed;
  for (auto deadline = In(10s); Clock::now() < deadline;) {
    auto t = (*worker)->Declare("t", DataType::kFloat32, 16);
    if (!t.ok()) {
      failed = t.status();
      break;
    }
    std::this_thread::sleep_for(20ms);
  }
  stop = true;
  for (auto& t : servers) t.join();
  ASSERT_EQ(failed.code(), Code::kPeerLost) << failed.ToString();
  std::smatch m;
  const std::string text = failed.message();
  ASSERT_TRUE(std::regex_search(text, m, std::regex(R"(connection to server (\d+) \(([^)]+)\))")))
      << text;
  const uint32_t id = static_cast<uint32_t>(std::stoul(m[1].str()));
  std::lock_guard lock(mu);
  ASSERT_EQ(host_of_id.size(), kServers);
  EXPECT_EQ(host_of_id.at(id), m[2].str()) << text;
  worker->reset();
  (*sched)->Stop();
}


}  // namespace
}  // namespace gradlink
