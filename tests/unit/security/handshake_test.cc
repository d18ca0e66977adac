// Over 600 lines on purpose: one suite for the handshake state machine (src/security/handshake.h),
// every message and every intruder, as the code it mirrors is one state machine.
// Tests of job authentication: the pure handshake state machines (success, wrong secret both
// ways, reflection, replay, every malformed field), the secret loader (file modes, lengths, the
// environment), and whole in-process jobs with a secret: honest members join, a member with the
// wrong secret or none is refused within 5 s and counted, and a stalled handshake is closed
// within 5 s.
#include "security/handshake.h"

#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "gradlink/scheduler.h"
#include "gradlink/server.h"
#include "gradlink/worker.h"
#include "security/secret.h"
#include "control/control_channel.h"
#include "control/join.h"
#include "transport/transport.h"
#include "wire/frame.h"
#include "server/start_on.h"
#include "worker/worker_impl.h"

namespace gradlink::security {
namespace {

using namespace std::chrono_literals;
using wire::MsgType;

const std::string kSecret = "correct horse battery staple";
const std::string kOther = "incorrect donkey battery staple";
constexpr uint32_t kJob = 0x1234abcd;

HandshakeBinding Binding(wire::Role role = wire::Role::kWorker, int32_t rank = 1) {
  HandshakeBinding b;
  b.job_hash = kJob;
  b.role = role;
  b.rank = rank;
  return b;
}

Nonce Fill(uint8_t v) {
  Nonce n;
  n.fill(std::byte{v});
  return n;
}

void ExpectAuthFailed(const Status& s, const std::string& what) {
  EXPECT_EQ(s.code(), Code::kAuthFailed) << what << ": " << s.ToString();
}

// Runs a full handshake; returns the client's and the server's final status.
struct Outcome {
  Status client, server;
};
Outcome RunHandshake(ClientHandshake& c, ServerHandshake& s) {
  Outcome o;
  auto hello = c.Start();
  if (!hello.ok()) return {hello.status(), Status::Ok()};
  auto challenge = s.Step(hello->type, hello->payload);
  if (!challenge.ok()) return {Status::Ok(), challenge.status()};
  auto proof = c.Step(challenge->type, challenge->payload);
  if (!proof.ok()) return {proof.status(), Status::Ok()};
  if (!proof->has_value()) return {Internal("no proof"), Status::Ok()};
  auto ok = s.Step((*proof)->type, (*proof)->payload);
  if (!ok.ok()) return {Status::Ok(), ok.status()};
  auto done = c.Step(ok->type, ok->payload);
  if (!done.ok()) return {done.status(), Status::Ok()};
  return o;
}

// ---- The handshake -----------------------------------------------------------------------------

TEST(HandshakeTest, Succeeds) {
  ClientHandshake c(kSecret, Binding(wire::Role::kServer, -1));
  ServerHandshake s(kSecret, kJob);
  Outcome o = RunHandshake(c, s);
  ASSERT_TRUE(o.client.ok()) << o.client.ToString();
  ASSERT_TRUE(o.server.ok()) << o.server.ToString();
  EXPECT_TRUE(c.done());
  EXPECT_TRUE(s.done());
  EXPECT_EQ(s.role(), wire::Role::kServer);
  EXPECT_EQ(s.rank(), -1);
}

TEST(HandshakeTest, MessageSizesAreExact) {
  ClientHandshake c(kSecret, Binding());
  ServerHandshake s(kSecret, kJob);
  auto hello = c.Start();
  ASSERT_TRUE(hello.ok());
  EXPECT_EQ(hello->type, MsgType::kHello);
  EXPECT_EQ(hello->payload.size(), kHelloBytes);
  auto challenge = s.Step(hello->type, hello->payload);
  ASSERT_TRUE(challenge.ok());
  EXPECT_EQ(challenge->type, MsgType::kChallenge);
  EXPECT_EQ(challenge->payload.size(), kChallengeBytes);
  auto proof = c.Step(challenge->type, challenge->payload);
  ASSERT_TRUE(proof.ok() && proof->has_value());
  EXPECT_EQ((*proof)->type, MsgType::kProof);
  EXPECT_EQ((*proof)->payload.size(), kProofBytes);
  EXPECT_LE(kChallengeBytes, kMaxHandshakePayload);
}

TEST(HandshakeTest, ClientRefusesSchedulerWithAnotherSecret) {
  ClientHandshake c(kSecret, Binding());
  ServerHandshake s(kOther, kJob);
  Outcome o = RunHandshake(c, s);
  ExpectAuthFailed(o.client, "client");
  EXPECT_NE(o.client.message().find("scheduler"), std::string::npos) << o.client.message();
  EXPECT_TRUE(c.failed());
  EXPECT_FALSE(s.done());
}

TEST(HandshakeTest, ServerRefusesMemberWithAnotherSecret) {
  // A member holding kOther cannot produce a proof for kSecret, even given the challenge.
  const Nonce nc = Fill(1), ns = Fill(2);
  ServerHandshake s(kSecret, kJob, 0, ns);
  ClientHandshake c(kOther, Binding(), nc);
  auto hello = c.Start();
  ASSERT_TRUE(hello.ok());
  auto challenge = s.Step(hello->type, hello->payload);
  ASSERT_TRUE(challenge.ok());
  const Mac forged = ComputeMac(kOther, kMemberLabel, Binding(), nc, ns);
  auto r = s.Step(MsgType::kProof, forged);
  ExpectAuthFailed(r.status(), "server");
  EXPECT_TRUE(s.failed());
  // Failed stays failed, even for the right proof now.
  const Mac right = ComputeMac(kSecret, kMemberLabel, Binding(), nc, ns);
  ExpectAuthFailed(s.Step(MsgType::kProof, right).status(), "after failure");
}

TEST(HandshakeTest, ReflectedChallengeIsRefused) {
  // An attacker without the secret sends the scheduler's own MAC back as its proof.
  ClientHandshake honest(kSecret, Binding());
  ServerHandshake s(kSecret, kJob);
  auto hello = honest.Start();
  ASSERT_TRUE(hello.ok());
  auto challenge = s.Step(hello->type, hello->payload);
  ASSERT_TRUE(challenge.ok());
  std::vector<std::byte> mac_s(challenge->payload.begin() + kNonceBytes, challenge->payload.end());
  ASSERT_EQ(mac_s.size(), kProofBytes);
  ExpectAuthFailed(s.Step(MsgType::kProof, mac_s).status(), "reflection");
  // And the labels really differ: MAC_s != MAC_c over the same transcript.
  EXPECT_NE(ComputeMac(kSecret, kSchedulerLabel, Binding(), Fill(1), Fill(2)),
            ComputeMac(kSecret, kMemberLabel, Binding(), Fill(1), Fill(2)));
}

TEST(HandshakeTest, ReplayedTranscriptIsRefused) {
  // Record an honest handshake.
  ClientHandshake c1(kSecret, Binding());
  ServerHandshake s1(kSecret, kJob);
  auto hello = c1.Start();
  ASSERT_TRUE(hello.ok());
  auto challenge = s1.Step(hello->type, hello->payload);
  ASSERT_TRUE(challenge.ok());
  auto proof = c1.Step(challenge->type, challenge->payload);
  ASSERT_TRUE(proof.ok() && proof->has_value());
  ASSERT_TRUE(s1.Step((*proof)->type, (*proof)->payload).ok());
  // Replay the member's messages to a new scheduler session: its nonce is fresh.
  ServerHandshake s2(kSecret, kJob);
  auto challenge2 = s2.Step(hello->type, hello->payload);
  ASSERT_TRUE(challenge2.ok());
  EXPECT_NE(challenge2->payload, challenge->payload);
  ExpectAuthFailed(s2.Step((*proof)->type, (*proof)->payload).status(), "replayed proof");
  // Replay the scheduler's challenge to a new member session: its nonce is fresh too.
  ClientHandshake c2(kSecret, Binding());
  ASSERT_TRUE(c2.Start().ok());
  ExpectAuthFailed(c2.Step(challenge->type, challenge->payload).status(), "replayed challenge");
}

TEST(HandshakeTest, ProofBindsRoleRankAndJob) {
  const Nonce nc = Fill(1), ns = Fill(2);
  for (HandshakeBinding other : {Binding(wire::Role::kServer, 1), Binding(wire::Role::kWorker, 2)}) {
    ServerHandshake s(kSecret, kJob, 0, ns);
    ClientHandshake c(kSecret, Binding(), nc);
    auto hello = c.Start();
    ASSERT_TRUE(s.Step(hello->type, hello->payload).ok());
    ExpectAuthFailed(s.Step(MsgType::kProof, ComputeMac(kSecret, kMemberLabel, other, nc, ns)).status(),
                     "proof for another role/rank");
  }
  // A scheduler of another job: the member refuses its challenge.
  ClientHandshake c(kSecret, Binding());
  ServerHandshake s(kSecret, kJob + 1);
  ExpectAuthFailed(RunHandshake(c, s).client, "another job");
}

TEST(HandshakeTest, MalformedHelloIsRefused) {
  ClientHandshake c(kSecret, Binding());
  auto hello = c.Start();
  ASSERT_TRUE(hello.ok());
  const std::vector<std::byte> good = hello->payload;
  std::vector<std::byte> truncated(good.begin(), good.begin() + (kHelloBytes - 1));
  auto oversized = good;
  oversized.push_back(std::byte{0});
  auto bad_role = good;
  bad_role[kNonceBytes] = std::byte{7};
  auto bad_rank = good;
  for (size_t i = 0; i < 4; ++i) bad_rank[kNonceBytes + 1 + i] = std::byte{0xFE};  // -2
  for (const auto& [name, payload] : std::vector<std::pair<std::string, std::vector<std::byte>>>{
           {"empty", {}}, {"truncated", truncated}, {"oversized", oversized},
           {"bad role", bad_role}, {"bad rank", bad_rank}}) {
    ServerHandshake s(kSecret, kJob);
    ExpectAuthFailed(s.Step(MsgType::kHello, payload).status(), name);
    EXPECT_TRUE(s.failed()) << name;
  }
  // Wrong types first: kRegister (a member without a secret), kProof, kChallenge.
  for (MsgType t : {MsgType::kRegister, MsgType::kProof, MsgType::kChallenge, MsgType::kAuthOk}) {
    ServerHandshake s(kSecret, kJob);
    ExpectAuthFailed(s.Step(t, good).status(), "type " + std::to_string(int(t)));
  }
  // The scheduler's own nonce echoed back.
  ServerHandshake s(kSecret, kJob, 0, Fill(9));
  ClientHandshake echo(kSecret, Binding(), Fill(9));
  auto h = echo.Start();
  ExpectAuthFailed(s.Step(h->type, h->payload).status(), "echoed nonce");
}

TEST(HandshakeTest, MalformedChallengeAndProofAreRefused) {
  // Client side: challenge sizes and types, kAuthOk with a payload, Start twice.
  for (size_t n : {size_t{0}, kChallengeBytes - 1, kChallengeBytes + 1, size_t{1} << 16}) {
    ClientHandshake c(kSecret, Binding());
    ASSERT_TRUE(c.Start().ok());
    ExpectAuthFailed(c.Step(MsgType::kChallenge, std::vector<std::byte>(n)).status(),
                     "challenge of " + std::to_string(n));
  }
  {
    ClientHandshake c(kSecret, Binding());
    ASSERT_TRUE(c.Start().ok());
    ExpectAuthFailed(c.Step(MsgType::kAuthOk, {}).status(), "kAuthOk before the proof");
    ExpectAuthFailed(c.Start().status(), "Start after failure");
  }
  {
    ClientHandshake c(kSecret, Binding());
    ExpectAuthFailed(c.Step(MsgType::kChallenge, std::vector<std::byte>(kChallengeBytes)).status(),
                     "frame before Start");
  }
  {
    ClientHandshake c(kSecret, Binding());
    ServerHandshake s(kSecret, kJob);
    auto hello = c.Start();
    auto challenge = s.Step(hello->type, hello->payload);
    ASSERT_TRUE(c.Step(challenge->type, challenge->payload).ok());
    std::vector<std::byte> junk(1);
    ExpectAuthFailed(c.Step(MsgType::kAuthOk, junk).status(), "kAuthOk with a payload");
  }
  // Server side: proof sizes and types.
  for (size_t n : {size_t{0}, kProofBytes - 1, kProofBytes + 1}) {
    ClientHandshake c(kSecret, Binding());
    ServerHandshake s(kSecret, kJob);
    auto hello = c.Start();
    ASSERT_TRUE(s.Step(hello->type, hello->payload).ok());
    ExpectAuthFailed(s.Step(MsgType::kProof, std::vector<std::byte>(n)).status(),
                     "proof of " + std::to_string(n));
  }
  {
    ClientHandshake c(kSecret, Binding());
    ServerHandshake s(kSecret, kJob);
    auto hello = c.Start();
    ASSERT_TRUE(s.Step(hello->type, hello->payload).ok());
    ExpectAuthFailed(s.Step(MsgType::kHello, hello->payload).status(), "second hello");
  }
}

TEST(HandshakeTest, FrameAfterDoneIsRefused) {
  ClientHandshake c(kSecret, Binding());
  ServerHandshake s(kSecret, kJob);
  Outcome o = RunHandshake(c, s);
  ASSERT_TRUE(o.client.ok() && o.server.ok());
  ExpectAuthFailed(s.Step(MsgType::kProof, std::vector<std::byte>(kProofBytes)).status(), "server");
  ExpectAuthFailed(c.Step(MsgType::kAuthOk, {}).status(), "client");
}

// ---- Secrets -----------------------------------------------------------------------------------

class SecretFileTest : public ::testing::Test {
 protected:
  void SetUp() override {
    char tmpl[] = "/tmp/gradlink-secret-XXXXXX";
    ASSERT_NE(::mkdtemp(tmpl), nullptr);
    dir_ = tmpl;
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }
  std::string Write(const std::string& name, const std::string& content, mode_t mode) {
    const std::string path = dir_ + "/" + name;
    std::ofstream(path) << content;
    ::chmod(path.c_str(), mode);
    return path;
  }
  std::string dir_;
};

TEST_F(SecretFileTest, Mode0600IsAcceptedAndNewlineStripped) {
  const std::string path = Write("s", kSecret + "\n", 0600);
  auto s = SecretFromFile(path);
  ASSERT_TRUE(s.ok()) << s.status().ToString();
  EXPECT_EQ(s->value, kSecret);
  EXPECT_TRUE(SecretFromFile(Write("r", kSecret, 0400)).ok());
}

TEST_F(SecretFileTest, Mode0644IsRefusedNamingFileAndMode) {
  const std::string path = Write("s", kSecret, 0644);
  auto s = SecretFromFile(path);
  ASSERT_EQ(s.status().code(), Code::kInvalidArgument) << s.status().ToString();
  EXPECT_NE(s.status().message().find(path), std::string::npos) << s.status().message();
  EXPECT_NE(s.status().message().find("0644"), std::string::npos) << s.status().message();
  for (mode_t m : {0640, 0604, 0601, 0610}) {
    EXPECT_EQ(SecretFromFile(Write("m" + std::to_string(m), kSecret, m)).status().code(),
              Code::kInvalidArgument) << std::oct << m;
  }
}

TEST_F(SecretFileTest, ShortMissingAndDirectoryAreRefused) {
  EXPECT_EQ(SecretFromFile(Write("short", "0123456789abcde\n", 0600)).status().code(),
            Code::kInvalidArgument);
  EXPECT_TRUE(SecretFromFile(Write("exact", "0123456789abcdef\n", 0600)).ok());
  EXPECT_EQ(SecretFromFile(dir_ + "/missing").status().code(), Code::kInvalidArgument);
  EXPECT_EQ(SecretFromFile(dir_).status().code(), Code::kInvalidArgument);
  EXPECT_EQ(SecretFromString("short").status().code(), Code::kInvalidArgument);
  EXPECT_EQ(SecretFromString(std::string(kMaxSecretBytes + 1, 'x')).status().code(),
            Code::kInvalidArgument);
}

TEST_F(SecretFileTest, LoadSecretReadsTheEnvironment) {
  ::unsetenv("GRADLINK_SECRET");
  ::unsetenv("GRADLINK_SECRET_FILE");
  auto none = LoadSecret();
  ASSERT_TRUE(none.ok());
  EXPECT_FALSE(none->has_value());

  ::setenv("GRADLINK_SECRET_FILE", Write("f", kOther + "\n", 0600).c_str(), 1);
  auto from_file = LoadSecret();
  ASSERT_TRUE(from_file.ok() && from_file->has_value()) << from_file.status().ToString();
  EXPECT_EQ((*from_file)->value, kOther);

  ::setenv("GRADLINK_SECRET", kSecret.c_str(), 1);  // wins over the file
  auto from_env = LoadSecret();
  ASSERT_TRUE(from_env.ok() && from_env->has_value());
  EXPECT_EQ((*from_env)->value, kSecret);

  ::setenv("GRADLINK_SECRET", "too short", 1);
  EXPECT_EQ(LoadSecret().status().code(), Code::kInvalidArgument);
  ::unsetenv("GRADLINK_SECRET");
  ::setenv("GRADLINK_SECRET_FILE", Write("open", kSecret, 0644).c_str(), 1);
  EXPECT_EQ(LoadSecret().status().code(), Code::kInvalidArgument);
  ::unsetenv("GRADLINK_SECRET_FILE");
}

TEST(SecretTest, GenerateIsFreshHex) {
  const Secret a = Generate(), b = Generate();
  EXPECT_EQ(a.value.size(), 64u);
  EXPECT_NE(a.value, b.value);
  EXPECT_EQ(a.value.find_first_not_of("0123456789abcdef"), std::string::npos);
  EXPECT_TRUE(SecretFromString(a.value).ok());
}

// ---- Jobs with a secret (in-process, inproc fabric) --------------------------------------------

Clock::time_point In(Clock::duration d) { return Clock::now() + d; }

std::unique_ptr<Scheduler> StartScheduler(std::optional<std::string> secret, uint32_t workers,
                                          const std::string& job = "auth-job") {
  SchedulerOptions so;
  so.num_workers = workers;
  so.num_servers = 1;
  so.job = job;
  so.join_timeout = 30s;
  so.secret = std::move(secret);
  auto s = Scheduler::Start(so);
  EXPECT_TRUE(s.ok()) << s.status().ToString();
  return s.ok() ? std::move(s).value() : nullptr;
}

WorkerOptions WorkerOpts(uint16_t port, int32_t rank, std::optional<std::string> secret) {
  WorkerOptions o;
  o.scheduler = "127.0.0.1:" + std::to_string(port);
  o.job = "auth-job";
  o.rank = rank;
  o.partition_bytes = 4096;
  o.connect_timeout = 20s;
  o.secret = std::move(secret);
  return o;
}

// An honest 2-worker job with `secret`; intruders try to join while it forms. Each intruder is
// refused with kAuthFailed within 5 s; the job still completes and sums correctly.
TEST(AuthJobTest, HonestJobCompletesAndIntrudersAreRefused) {
  auto sched = StartScheduler(kSecret, 2);
  ASSERT_TRUE(sched);
  auto fabric = transport::CreateInprocFabric();

  // Intruders first, before the honest members: wrong secret, and no secret.
  for (std::optional<std::string> bad : {std::optional<std::string>(kOther), std::optional<std::string>()}) {
    const auto t0 = Clock::now();
    auto w = ConnectWorkerOn(WorkerOpts(sched->port(), 0, bad), fabric);
    const auto took = Clock::now() - t0;
    ASSERT_FALSE(w.ok());
    EXPECT_EQ(w.status().code(), Code::kAuthFailed) << w.status().ToString();
    EXPECT_LT(took, 5s);
  }
  // The refusals are counted once the scheduler has closed them.
  for (auto deadline = In(5s); sched->auth_failures() < 1 && Clock::now() < deadline;) {
    std::this_thread::sleep_for(10ms);
  }
  // A wrong-secret member refuses the scheduler's challenge itself (it never sends a proof):
  // the scheduler sees that connection close mid-handshake and counts it too.
  for (auto deadline = In(5s); sched->auth_failures() < 2 && Clock::now() < deadline;) {
    std::this_thread::sleep_for(10ms);
  }
  EXPECT_EQ(sched->auth_failures(), 2u);

  ServerOptions so;
  so.scheduler = "127.0.0.1:" + std::to_string(sched->port());
  so.job = "auth-job";
  so.connect_timeout = 20s;
  so.secret = kSecret;
  std::unique_ptr<Server> server;
  std::vector<std::unique_ptr<Worker>> workers(2);
  std::vector<Status> errors(3);
  std::vector<std::thread> threads;
  threads.emplace_back([&] {
    auto s = StartServerOn(so, fabric);
    if (s.ok()) server = std::move(s).value();
    else errors[2] = s.status();
  });
  for (int32_t r = 0; r < 2; ++r) {
    threads.emplace_back([&, r] {
      auto w = ConnectWorkerOn(WorkerOpts(sched->port(), r, kSecret), fabric);
      if (w.ok()) workers[r] = std::move(w).value();
      else errors[r] = w.status();
    });
  }
  for (auto& t : threads) t.join();
  for (const Status& s : errors) ASSERT_TRUE(s.ok()) << s.ToString();

  constexpr uint64_t kN = 3000;
  std::vector<std::vector<float>> bufs(2, std::vector<float>(kN));
  std::vector<Status> results(2);
  threads.clear();
  for (uint32_t r = 0; r < 2; ++r) {
    threads.emplace_back([&, r] {
      auto t = workers[r]->Declare("g", DataType::kFloat32, kN);
      if (!t.ok()) {
        results[r] = t.status();
        return;
      }
      for (uint64_t i = 0; i < kN; ++i) bufs[r][i] = float(i) + float(r) * 1000.0f;
      auto h = workers[r]->PushPull(*t, std::as_writable_bytes(std::span(bufs[r])));
      results[r] = h.Wait(In(20s));
    });
  }
  for (auto& t : threads) t.join();
  for (uint32_t r = 0; r < 2; ++r) {
    ASSERT_TRUE(results[r].ok()) << results[r].ToString();
    for (uint64_t i = 0; i < kN; ++i) ASSERT_EQ(bufs[r][i], 2.0f * float(i) + 1000.0f) << i;
  }
  for (auto& w : workers) EXPECT_TRUE(w->Shutdown(In(5s)).ok());
  EXPECT_TRUE(server->Wait(In(5s)).ok());
  Status st = sched->Wait(In(5s));
  EXPECT_TRUE(st.ok()) << st.ToString();
  EXPECT_EQ(sched->auth_failures(), 2u);
  server->Stop();
  sched->Stop();
}

TEST(AuthJobTest, MemberWithSecretRefusesSchedulerWithout) {
  auto sched = StartScheduler(std::nullopt, 1);
  ASSERT_TRUE(sched);
  wire::RegisterMsg reg;
  reg.role = wire::Role::kWorker;
  reg.host = "w";
  const auto t0 = Clock::now();
  auto j = JoinJob("127.0.0.1:" + std::to_string(sched->port()), wire::JobHash("auth-job"), reg,
                   In(10s), kSecret);
  ASSERT_FALSE(j.ok());
  EXPECT_EQ(j.status().code(), Code::kAuthFailed) << j.status().ToString();
  EXPECT_NE(j.status().message().find("without a job secret"), std::string::npos)
      << j.status().message();
  EXPECT_LT(Clock::now() - t0, 5s);
  EXPECT_EQ(sched->auth_failures(), 1u);
  sched->Stop();
}

TEST(AuthJobTest, MemberWithoutSecretGetsAClearMessage) {
  auto sched = StartScheduler(kSecret, 1);
  ASSERT_TRUE(sched);
  wire::RegisterMsg reg;
  reg.role = wire::Role::kWorker;
  reg.host = "w";
  auto j = JoinJob("127.0.0.1:" + std::to_string(sched->port()), wire::JobHash("auth-job"), reg,
                   In(10s));
  ASSERT_FALSE(j.ok());
  EXPECT_EQ(j.status().code(), Code::kAuthFailed) << j.status().ToString();
  EXPECT_NE(j.status().message().find("GRADLINK_SECRET"), std::string::npos) << j.status().message();
  sched->Stop();
}

// Raw connections: a stalled handshake and an oversized handshake frame are closed and counted.
int RawConnect(uint16_t port) {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(port);
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) != 0) {
    ::close(fd);
    return -1;
  }
  return fd;
}

// Waits until the peer closes `fd` (EOF or reset); the time it took, or nullopt at the limit.
std::optional<Clock::duration> WaitClosed(int fd, Clock::duration limit) {
  const auto t0 = Clock::now();
  char buf[4096];
  while (Clock::now() - t0 < limit) {
    pollfd p{fd, POLLIN, 0};
    ::poll(&p, 1, 50);
    if (p.revents == 0) continue;
    const ssize_t n = ::recv(fd, buf, sizeof(buf), MSG_DONTWAIT);
    if (n == 0 || (n < 0 && errno != EAGAIN && errno != EINTR)) return Clock::now() - t0;
  }
  return std::nullopt;
}

wire::HeaderBytes HelloHeader(uint64_t payload_bytes) {
  wire::Header h;
  h.type = MsgType::kHello;
  h.job = wire::JobHash("auth-job");
  h.payload_bytes = payload_bytes;
  return wire::EncodeHeader(h);
}

TEST(AuthJobTest, StalledHandshakeIsClosedWithinFiveSeconds) {
  auto sched = StartScheduler(kSecret, 1);
  ASSERT_TRUE(sched);
  for (size_t sent_bytes : {wire::kHeaderSize / 2, wire::kHeaderSize + kHelloBytes / 2}) {
    const uint64_t before = sched->auth_failures();
    const int fd = RawConnect(sched->port());
    ASSERT_GE(fd, 0);
    const auto t0 = Clock::now();
    std::vector<std::byte> bytes(wire::kHeaderSize + kHelloBytes);
    const wire::HeaderBytes hb = HelloHeader(kHelloBytes);
    std::memcpy(bytes.data(), hb.data(), hb.size());
    ASSERT_EQ(::send(fd, bytes.data(), sent_bytes, MSG_NOSIGNAL), ssize_t(sent_bytes));
    auto closed = WaitClosed(fd, 8s);
    const auto total = Clock::now() - t0;
    ::close(fd);
    ASSERT_TRUE(closed.has_value()) << "a stalled handshake (" << sent_bytes
                                    << " bytes) was not closed within 8 s";
    EXPECT_GE(total, 3500ms);  // the scheduler's handshake deadline is 4 s after accept
    EXPECT_LT(total, 5s);
    for (auto d = In(2s); sched->auth_failures() == before && Clock::now() < d;) {
      std::this_thread::sleep_for(10ms);
    }
    EXPECT_EQ(sched->auth_failures(), before + 1);
  }
  sched->Stop();
}

TEST(AuthJobTest, OversizedHandshakeFrameIsClosedAtOnce) {
  auto sched = StartScheduler(kSecret, 1);
  ASSERT_TRUE(sched);
  const int fd = RawConnect(sched->port());
  ASSERT_GE(fd, 0);
  const wire::HeaderBytes hb = HelloHeader(wire::kMaxControlPayload);  // valid for the header
  ASSERT_EQ(::send(fd, hb.data(), hb.size(), MSG_NOSIGNAL), ssize_t(hb.size()));
  auto closed = WaitClosed(fd, 3s);
  ::close(fd);
  ASSERT_TRUE(closed.has_value());
  for (auto d = In(2s); sched->auth_failures() == 0 && Clock::now() < d;) {
    std::this_thread::sleep_for(10ms);
  }
  EXPECT_EQ(sched->auth_failures(), 1u);
  EXPECT_EQ(sched->protocol_errors(), 1u);
  sched->Stop();
}

// After the handshake, kRegister must repeat the role and rank the member authenticated as.
TEST(AuthJobTest, RegisterMustMatchTheAuthenticatedRoleAndRank) {
  auto sched = StartScheduler(kSecret, 2);
  ASSERT_TRUE(sched);
  auto ch = transport::ControlChannel::Connect("127.0.0.1", sched->port(), In(5s));
  ASSERT_TRUE(ch.ok()) << ch.status().ToString();
  const uint32_t job = wire::JobHash("auth-job");
  HandshakeBinding b;
  b.job_hash = job;
  b.role = wire::Role::kWorker;
  b.rank = 0;
  ClientHandshake hs(kSecret, b);
  wire::Header h;
  h.job = job;
  auto hello = hs.Start();
  ASSERT_TRUE(hello.ok());
  h.type = hello->type;
  ASSERT_TRUE((*ch)->Send(h, hello->payload).ok());
  while (!hs.done()) {
    auto f = (*ch)->Receive(In(5s));
    ASSERT_TRUE(f.ok()) << f.status().ToString();
    auto reply = hs.Step(f->header.type, f->payload);
    ASSERT_TRUE(reply.ok()) << reply.status().ToString();
    if (reply->has_value()) {
      h.type = (*reply)->type;
      ASSERT_TRUE((*ch)->Send(h, (*reply)->payload).ok());
    }
  }
  wire::RegisterMsg reg;
  reg.role = wire::Role::kWorker;
  reg.requested_rank = 1;  // authenticated as rank 0
  reg.host = "liar";
  h.type = MsgType::kRegister;
  ASSERT_TRUE((*ch)->Send(h, wire::Encode(reg)).ok());
  // It hears why (a kAbort naming the lie), then the connection closes.
  auto f = (*ch)->Receive(In(5s));
  ASSERT_TRUE(f.ok()) << f.status().ToString();
  EXPECT_EQ(f->header.type, MsgType::kAbort);
  EXPECT_EQ(f->header.code, static_cast<uint8_t>(Code::kProtocolError));
  auto why = wire::DecodeText(f->payload);
  ASSERT_TRUE(why.ok());
  EXPECT_NE(why->find("after authenticating as worker rank 0"), std::string::npos) << *why;
  f = (*ch)->Receive(In(5s));
  EXPECT_FALSE(f.ok());
  EXPECT_EQ(f.status().code(), Code::kPeerLost) << f.status().ToString();
  EXPECT_EQ(sched->protocol_errors(), 1u);
  EXPECT_EQ(sched->auth_failures(), 0u);
  sched->Stop();
}

}  // namespace
}  // namespace gradlink::security
