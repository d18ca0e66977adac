// A restarted scheduler (scheduler/restart.cc) rebuilds the job from its members' re-registration:
// it keeps every plan a worker holds, gives it to the workers that lack it, places later keys as
// the scheduler before would have, and refuses what it cannot rebuild, saying why. Members here
// are bare control connections, so the test sees exactly what the scheduler sends.
#include <gtest/gtest.h>

#include <chrono>
#include <map>
#include <optional>
#include <memory>
#include <string>
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

constexpr char kJob[] = "restart-job";

struct Member {
  std::unique_ptr<ControlChannel> ch;
  wire::Role role;
  uint32_t id;
};

std::unique_ptr<Scheduler> StartScheduler() {
  SchedulerOptions so;
  so.host = "127.0.0.1";
  so.job = kJob;
  so.num_workers = 2;
  so.num_servers = 2;
  auto s = Scheduler::Start(so);
  EXPECT_TRUE(s.ok()) << s.status().ToString();
  return s.ok() ? std::move(s).value() : nullptr;
}

wire::Header Make(MsgType t, uint32_t sender) {
  wire::Header h;
  h.type = t;
  h.job = wire::JobHash(kJob);
  h.sender = sender;
  return h;
}

// Registers (with `resume`, and then `resume_keys`) and does not wait for the welcome.
Member Register(uint16_t port, wire::Role role, uint32_t id,
                std::optional<wire::ResumeState> resume = std::nullopt,
                const std::vector<std::pair<wire::Header, wire::ResumeKeyMsg>>& keys = {}) {
  auto ch = ControlChannel::Connect("127.0.0.1", port, Clock::now() + 5s);
  EXPECT_TRUE(ch.ok()) << ch.status().ToString();
  wire::RegisterMsg reg;
  reg.role = role;
  reg.requested_rank = static_cast<int32_t>(id);
  reg.host = "host";
  reg.push_address = {std::byte{1}};
  reg.pull_address = {std::byte{2}};
  reg.resume = std::move(resume);
  EXPECT_TRUE((*ch)->Send(Make(MsgType::kRegister, 0), wire::Encode(reg), Clock::now() + 5s).ok());
  for (const auto& [h, m] : keys) {
    EXPECT_TRUE((*ch)->Send(h, wire::Encode(m), Clock::now() + 5s).ok());
  }
  return Member{std::move(ch).value(), role, id};
}

// The next frame other than a heartbeat (answering the scheduler's with ours).
transport::Frame Next(Member& m) {
  while (true) {
    auto f = m.ch->Receive(Clock::now() + 5s);
    EXPECT_TRUE(f.ok()) << f.status().ToString();
    if (!f.ok()) return transport::Frame{};
    if (f->header.type != MsgType::kHeartbeat) return std::move(f).value();
    m.ch->Send(Make(MsgType::kHeartbeat, m.id), {}, Clock::now() + 1s).IgnoreError();
  }
}

void ExpectWelcome(Member& m) {
  transport::Frame f = Next(m);
  ASSERT_EQ(f.header.type, MsgType::kWelcome);
  auto w = wire::DecodeWelcome(f.payload);
  ASSERT_TRUE(w.ok()) << w.status().ToString();
  EXPECT_EQ(w->your_id, m.id);
}

std::pair<wire::Header, wire::DeclareMsg> Declaration(const std::string& name, uint64_t count) {
  wire::Header h = Make(MsgType::kDeclare, 0);
  h.key = wire::TensorKey(kJob, name);
  h.dtype = static_cast<uint8_t>(DataType::kFloat32);
  h.count = count;
  wire::DeclareMsg d;
  d.name = name;
  d.partition_bytes = 1000;  // 250 elements per partition
  return {h, d};
}

// Every worker declares `name`; the servers ack its plan; returns the plan each worker got.
std::vector<wire::PartitionPlan> Declare(std::vector<Member>& workers, std::vector<Member>& servers,
                                         const std::string& name, uint64_t count) {
  auto [h, d] = Declaration(name, count);
  for (Member& w : workers) {
    h.sender = w.id;
    EXPECT_TRUE(w.ch->Send(h, wire::Encode(d), Clock::now() + 5s).ok());
  }
  for (Member& s : servers) {
    transport::Frame f = Next(s);
    EXPECT_EQ(f.header.type, MsgType::kAssign);
    EXPECT_EQ(f.header.key, h.key);
    wire::Header ack = Make(MsgType::kAssignAck, s.id);
    ack.key = f.header.key;
    ack.round = f.header.round;
    EXPECT_TRUE(s.ch->Send(ack, {}, Clock::now() + 5s).ok());
  }
  std::vector<wire::PartitionPlan> plan;
  for (Member& w : workers) {
    transport::Frame f = Next(w);
    EXPECT_EQ(f.header.type, MsgType::kAssign);
    EXPECT_EQ(f.header.code, 0);
    auto a = wire::DecodeAssign(f.payload, count, 2);
    EXPECT_TRUE(a.ok()) << a.status().ToString();
    if (a.ok()) plan = a->partitions;
  }
  return plan;
}

std::string Describe(const std::vector<wire::PartitionPlan>& plan) {
  std::string s;
  for (const auto& p : plan) {
    s += "[" + std::to_string(p.offset) + "+" + std::to_string(p.count) + "@" +
         std::to_string(p.server) + "]";
  }
  return s;
}

std::vector<Member> Servers(uint16_t port, bool resume) {
  std::vector<Member> servers;
  for (uint32_t i = 0; i < 2; ++i) {
    servers.push_back(Register(port, wire::Role::kServer, i,
                               resume ? std::optional(wire::ResumeState{}) : std::nullopt));
  }
  return servers;
}

TEST(RestartTest, PlansAreKeptAndLaterKeysArePlacedAsBefore) {
  // The reference: one scheduler sees keys "a" (1000 elements: 4 partitions), "c" (10: one, on
  // the server a left lighter) and "b" (750: 3 partitions), in that order.
  std::vector<wire::PartitionPlan> a_ref, c_ref, b_ref;
  {
    auto sched = StartScheduler();
    ASSERT_TRUE(sched);
    std::vector<Member> servers = Servers(sched->port(), false);
    std::vector<Member> workers;
    for (uint32_t r = 0; r < 2; ++r) workers.push_back(Register(sched->port(), wire::Role::kWorker, r));
    for (Member& m : servers) ExpectWelcome(m);
    for (Member& m : workers) ExpectWelcome(m);
    a_ref = Declare(workers, servers, "a", 1000);
    c_ref = Declare(workers, servers, "c", 10);
    b_ref = Declare(workers, servers, "b", 750);
  }
  // A restarted scheduler: rank 0 holds a's and c's plans, rank 1 only their declarations (it
  // had not received the plans when the scheduler died). Then "b" is declared.
  auto sched = StartScheduler();
  ASSERT_TRUE(sched);
  auto [ha, da] = Declaration("a", 1000);
  auto [hc, dc] = Declaration("c", 10);
  const auto resume_key = [](wire::Header h, const wire::DeclareMsg& d,
                             const std::vector<wire::PartitionPlan>* plan) {
    wire::ResumeKeyMsg m;
    m.declare = d;
    if (plan != nullptr) {
      m.state = wire::ResumeKeyMsg::Plan::kPlanned;
      m.plan.name = d.name;
      m.plan.partitions = *plan;
    }
    h.type = MsgType::kResumeKey;
    return std::pair(h, m);
  };
  std::vector<Member> servers = Servers(sched->port(), true);
  std::vector<Member> workers;
  workers.push_back(Register(sched->port(), wire::Role::kWorker, 0,
                             wire::ResumeState{2, 0, 0, 2, {}},
                             {resume_key(ha, da, &a_ref), resume_key(hc, dc, &c_ref)}));
  workers.push_back(Register(sched->port(), wire::Role::kWorker, 1,
                             wire::ResumeState{2, 0, 0, 2, {}},
                             {resume_key(ha, da, nullptr), resume_key(hc, dc, nullptr)}));
  for (Member& m : servers) ExpectWelcome(m);
  for (Member& m : workers) ExpectWelcome(m);
  // Rank 1 gets the plans rank 0 had, unchanged; nothing is planned again.
  std::map<uint64_t, std::string> got;
  for (int i = 0; i < 2; ++i) {
    transport::Frame f = Next(workers[1]);
    ASSERT_EQ(f.header.type, MsgType::kAssign);
    auto plan = wire::DecodeAssign(f.payload, f.header.count, 2);
    ASSERT_TRUE(plan.ok()) << plan.status().ToString();
    got[f.header.key] = Describe(plan->partitions);
  }
  EXPECT_EQ(got[ha.key], Describe(a_ref));
  EXPECT_EQ(got[hc.key], Describe(c_ref));
  // A later key lands where the first scheduler put it: the load was rebuilt from the plans.
  EXPECT_EQ(Describe(Declare(workers, servers, "b", 750)), Describe(b_ref));
}

TEST(RestartTest, WorkersHoldingDifferentPlansAreRefusedNamingTheKey) {
  auto sched = StartScheduler();
  ASSERT_TRUE(sched);
  auto [h, d] = Declaration("a", 1000);
  h.type = MsgType::kResumeKey;
  wire::ResumeKeyMsg m0, m1;
  m0.declare = m1.declare = d;
  m0.state = m1.state = wire::ResumeKeyMsg::Plan::kPlanned;
  m0.plan.name = m1.plan.name = "a";
  m0.plan.partitions = {{0, 500, 0}, {500, 500, 1}};
  m1.plan.partitions = {{0, 500, 0}, {500, 500, 0}};  // one had a failover's plan, one not
  std::vector<Member> servers = Servers(sched->port(), true);
  std::vector<Member> workers;
  workers.push_back(Register(sched->port(), wire::Role::kWorker, 0,
                             wire::ResumeState{1, 0, 0, 2, {}}, {{h, m0}}));
  workers.push_back(Register(sched->port(), wire::Role::kWorker, 1,
                             wire::ResumeState{1, 0, 0, 2, {}}, {{h, m1}}));
  for (Member& w : workers) {
    transport::Frame f = Next(w);
    ASSERT_EQ(f.header.type, MsgType::kAbort);
    auto text = wire::DecodeText(f.payload);
    ASSERT_TRUE(text.ok());
    EXPECT_NE(text->find("different plans for key"), std::string::npos) << *text;
    EXPECT_NE(text->find("'a'"), std::string::npos) << *text;
  }
  EXPECT_EQ(sched->Wait(Clock::now() + 5s).code(), Code::kMismatch);
}

TEST(RestartTest, ANewWorkerCannotJoinAResumingJob) {
  auto sched = StartScheduler();
  ASSERT_TRUE(sched);
  Member resuming = Register(sched->port(), wire::Role::kWorker, 0, wire::ResumeState{0, 0, 0, 2, {}});
  Member fresh = Register(sched->port(), wire::Role::kWorker, 1);
  transport::Frame f = Next(fresh);
  ASSERT_EQ(f.header.type, MsgType::kAbort);
  auto text = wire::DecodeText(f.payload);
  ASSERT_TRUE(text.ok());
  EXPECT_NE(text->find("resuming after a scheduler restart"), std::string::npos) << *text;
}

}  // namespace
}  // namespace gradlink
