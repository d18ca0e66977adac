// A member the scheduler refuses before the job starts (another job's name, a rank out of
// range) fails at once; the honest members keep waiting, and when the join timeout ends the
// job, their kAbort names the refused members and why, instead of blaming an honest member.
#include <gtest/gtest.h>

#include <chrono>
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

std::unique_ptr<ControlChannel> Register(uint16_t port, const std::string& job,
                                         wire::Role role, int32_t rank) {
  auto ch = ControlChannel::Connect("127.0.0.1", port, Clock::now() + 5s);
  EXPECT_TRUE(ch.ok()) << ch.status().ToString();
  if (!ch.ok()) return nullptr;
  wire::Header h;
  h.type = MsgType::kRegister;
  h.job = wire::JobHash(job);
  wire::RegisterMsg reg;
  reg.role = role;
  reg.requested_rank = rank;
  reg.host = "host-" + job;
  reg.push_address = {std::byte{1}};
  reg.pull_address = {std::byte{2}};
  EXPECT_TRUE((*ch)->Send(h, wire::Encode(reg), Clock::now() + 5s).ok());
  return std::move(ch).value();
}

// The text of the first kAbort on `ch` before `deadline` (heartbeats skipped).
std::string AbortText(ControlChannel& ch, Clock::time_point deadline) {
  while (true) {
    auto f = ch.Receive(deadline);
    if (!f.ok()) return "(no kAbort: " + f.status().ToString() + ")";
    if (f->header.type != MsgType::kAbort) continue;
    auto text = wire::DecodeText(f->payload);
    return text.ok() ? *text : "(undecodable)";
  }
}

TEST(JoinRefusalTest, TheJobThatNeverStartsNamesTheRefusedMembers) {
  SchedulerOptions so;
  so.host = "127.0.0.1";
  so.port = 0;
  so.job = "right-job";
  so.num_workers = 2;
  so.num_servers = 1;
  so.join_timeout = 1500ms;
  auto sched = Scheduler::Start(so);
  ASSERT_TRUE(sched.ok()) << sched.status().ToString();
  const uint16_t port = (*sched)->port();

  auto server = Register(port, "right-job", wire::Role::kServer, -1);
  auto honest = Register(port, "right-job", wire::Role::kWorker, 0);
  auto wrong_job = Register(port, "wrong-job", wire::Role::kWorker, 1);
  auto wrong_rank = Register(port, "right-job", wire::Role::kWorker, 7);
  ASSERT_TRUE(server && honest && wrong_job && wrong_rank);

  // The misconfigured ones hear why at once.
  const auto t0 = Clock::now();
  const std::string job_refusal = AbortText(*wrong_job, Clock::now() + 2s);
  EXPECT_NE(job_refusal.find("this scheduler runs job 'right-job'"), std::string::npos)
      << job_refusal;
  const std::string rank_refusal = AbortText(*wrong_rank, Clock::now() + 2s);
  EXPECT_NE(rank_refusal.find("rank 7 out of range"), std::string::npos) << rank_refusal;
  EXPECT_LT(Clock::now() - t0, 1s);

  // The honest ones wait for the join timeout; then their abort names both refusals.
  for (ControlChannel* ch : {honest.get(), server.get()}) {
    const std::string text = AbortText(*ch, Clock::now() + 5s);
    EXPECT_NE(text.find("1 of 2 workers"), std::string::npos) << text;
    EXPECT_NE(text.find("refused 2 members"), std::string::npos) << text;
    EXPECT_NE(text.find("runs job 'right-job'"), std::string::npos) << text;
    EXPECT_NE(text.find("rank 7 out of range"), std::string::npos) << text;
  }
  Status result = (*sched)->Wait(Clock::now() + 5s);
  EXPECT_EQ(result.code(), Code::kTimeout) << result.ToString();
  EXPECT_NE(result.message().find("refused 2 members"), std::string::npos) << result.ToString();
}

// A member that says goodbye before the job starts frees its place: another takes its rank (or
// a server its id), and the job starts with the members present. (Before, the scheduler kept
// counting the one that left and numbered a hole where it had been.)
TEST(JoinRefusalTest, AMemberThatLeavesBeforeTheStartIsReplaced) {
  SchedulerOptions so;
  so.job = "replaced";
  so.num_workers = 2;
  so.num_servers = 2;
  so.join_timeout = 10s;
  auto sched = Scheduler::Start(so);
  ASSERT_TRUE(sched.ok()) << sched.status().ToString();
  const uint16_t port = (*sched)->port();
  wire::Header bye;
  bye.type = MsgType::kGoodbye;
  bye.job = wire::JobHash("replaced");
  for (wire::Role role : {wire::Role::kWorker, wire::Role::kServer}) {
    auto gone = Register(port, "replaced", role, 0);
    ASSERT_NE(gone, nullptr);
    ASSERT_TRUE(gone->Send(bye, {}, Clock::now() + 5s).ok());
    auto f = gone->Receive(Clock::now() + 5s);  // the scheduler closes it
    EXPECT_FALSE(f.ok() && f->header.type == MsgType::kWelcome);
  }
  std::vector<std::unique_ptr<ControlChannel>> members;
  members.push_back(Register(port, "replaced", wire::Role::kWorker, 0));
  members.push_back(Register(port, "replaced", wire::Role::kWorker, 1));
  members.push_back(Register(port, "replaced", wire::Role::kServer, 0));
  members.push_back(Register(port, "replaced", wire::Role::kServer, 1));
  for (size_t i = 0; i < members.size(); ++i) {
    ASSERT_NE(members[i], nullptr);
    Result<transport::Frame> f = members[i]->Receive(Clock::now() + 5s);
    while (f.ok() && f->header.type == MsgType::kHeartbeat) {
      f = members[i]->Receive(Clock::now() + 5s);
    }
    ASSERT_TRUE(f.ok()) << "member " << i << ": " << f.status().ToString();
    ASSERT_EQ(f->header.type, MsgType::kWelcome) << "member " << i;
    auto w = wire::DecodeWelcome(f->payload);
    ASSERT_TRUE(w.ok()) << w.status().ToString();
    EXPECT_EQ(w->your_id, i % 2) << "member " << i;
    EXPECT_EQ(w->members.size(), 4u);
  }
  (*sched)->Stop();
}

}  // namespace
}  // namespace gradlink
