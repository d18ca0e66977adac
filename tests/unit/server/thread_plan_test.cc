#include "server/thread_plan.h"

#include <gtest/gtest.h>

#include <numeric>
#include <vector>

namespace gradlink::server {
namespace {

using V = std::vector<uint32_t>;

// A machine of `cpus` CPUs holding `servers` servers and `workers` workers of the job; the
// server sets `engines` (0: chosen) and is not pinned.
ThreadInputs Machine(uint32_t cpus, uint32_t servers = 1, uint32_t workers = 0,
                     uint32_t engines = 0) {
  ThreadInputs in;
  in.allowed.resize(cpus);
  std::iota(in.allowed.begin(), in.allowed.end(), 0);
  in.servers_here = servers;
  in.workers_here = workers;
  in.engines = engines;
  return in;
}

// The same server pinned to `cpus`.
ThreadInputs Pinned(ThreadInputs in, V cpus) {
  in.pinned = std::move(cpus);
  return in;
}

ThreadPlan Plan(const ThreadInputs& in) {
  auto p = PlanThreads(in);
  EXPECT_TRUE(p.ok()) << p.status().ToString();
  return p.ok() ? *p : ThreadPlan{};
}

TEST(ThreadPlanTest, ADedicatedMachineGoesToEnginesLessTheLanes) {
  const ThreadPlan p = Plan(Machine(16));
  EXPECT_EQ(p.share, 16u);
  EXPECT_EQ(p.engines, 14u);
  EXPECT_TRUE(p.lane_cpu.empty());
  EXPECT_TRUE(p.engine_cpu.empty());
  EXPECT_NE(p.why.find("not pinned"), std::string::npos) << p.why;
  // One lane (single_lane) leaves one more CPU to the engines.
  ThreadInputs one_lane = Machine(16);
  one_lane.lanes = 1;
  EXPECT_EQ(Plan(one_lane).engines, 15u);
  // Servers of the job on one machine split it.
  EXPECT_EQ(Plan(Machine(16, 2)).engines, 6u);
  // Past kMaxAutoEngines an engine more sums no faster.
  EXPECT_EQ(Plan(Machine(128)).engines, kMaxAutoEngines);
}

TEST(ThreadPlanTest, WorkersOnTheMachineTakeTheirShare) {
  // 8 workers and a server on 64 CPUs: 7 each, the server's less its 2 lanes.
  const ThreadPlan p = Plan(Machine(64, 1, 8));
  EXPECT_EQ(p.share, 7u);
  EXPECT_EQ(p.engines, 5u);
  EXPECT_NE(p.why.find("shared by 9 processes"), std::string::npos) << p.why;
  // Fewer CPUs than processes, or no more than the lanes: one engine, never none.
  EXPECT_EQ(Plan(Machine(2, 1, 2)).engines, 1u);
  EXPECT_EQ(Plan(Machine(2)).engines, 1u);
  EXPECT_EQ(Plan(Machine(1)).engines, 1u);
}

TEST(ThreadPlanTest, AnEngineCountThatIsSetWins) {
  const ThreadPlan p = Plan(Machine(16, 1, 8, 3));
  EXPECT_EQ(p.engines, 3u);
  EXPECT_NE(p.why.find("as set"), std::string::npos) << p.why;
}

TEST(ThreadPlanTest, PinnedLanesTakeTheFirstCpusAndEnginesTheRest) {
  // The list is the server's own, whoever else runs on the machine.
  ThreadPlan p = Plan(Pinned(Machine(16, 1, 8), {4, 5, 6, 7}));
  EXPECT_EQ(p.share, 4u);
  EXPECT_EQ(p.engines, 2u);
  EXPECT_EQ(p.lane_cpu, (V{4, 5}));
  EXPECT_EQ(p.engine_cpu, (V{6, 7}));
  EXPECT_NE(p.why.find("pinned to CPUs 4-7"), std::string::npos) << p.why;
  // More engines than CPUs left: round robin over them.
  p = Plan(Pinned(Machine(8, 1, 0, 5), {0, 2, 4}));
  EXPECT_EQ(p.lane_cpu, (V{0, 2}));
  EXPECT_EQ(p.engine_cpu, (V{4, 4, 4, 4, 4}));
  p = Plan(Pinned(Machine(8, 1, 0, 3), {1, 3, 5, 7}));
  EXPECT_EQ(p.engine_cpu, (V{5, 7, 5}));
  // No more CPUs than lanes: everything shares them.
  p = Plan(Pinned(Machine(8, 1, 0, 3), {3}));
  EXPECT_EQ(p.lane_cpu, (V{3, 3}));
  EXPECT_EQ(p.engine_cpu, (V{3, 3, 3}));
  p = Plan(Pinned(Machine(8), {1, 2}));
  EXPECT_EQ(p.engines, 1u);
  EXPECT_EQ(p.lane_cpu, (V{1, 2}));
  EXPECT_EQ(p.engine_cpu, (V{1}));
}

TEST(ThreadPlanTest, ACpuTheProcessMayNotUseIsRefusedByName) {
  auto p = PlanThreads(Pinned(Machine(4), {2, 3, 9}));
  ASSERT_FALSE(p.ok());
  EXPECT_EQ(p.status().code(), Code::kInvalidArgument);
  EXPECT_NE(p.status().message().find("CPU(s) 9 are not among"), std::string::npos)
      << p.status().ToString();
  EXPECT_NE(p.status().message().find("(0-3)"), std::string::npos) << p.status().ToString();
}

}  // namespace
}  // namespace gradlink::server
