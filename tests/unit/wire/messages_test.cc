// Tests of the control-message payloads: round trips, every truncation and trailing bytes of
// every valid encoding, and the semantic checks (ranges, coverage of kAssign partitions) that
// keep a peer from confusing us or making us allocate much.
#include "wire/messages.h"

#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <string>
#include <vector>

#include "unit/support/allocation_counter.h"
#include "wire/codec.h"

// The decoders must refuse huge counts before they allocate for them: this binary counts its
// allocations (unit/support/allocation_counter.h).

namespace gradlink::wire {
namespace {

// Largest single allocation made by fn().
size_t LargestAllocation(const std::function<void()>& fn) {
  return test::AllocationsBy(fn).largest;
}

std::vector<std::byte> Bytes(std::initializer_list<int> v) {
  std::vector<std::byte> out;
  for (int x : v) out.push_back(std::byte(x));
  return out;
}

template <typename T>
void ExpectBad(const Result<T>& r, const std::string& what) {
  ASSERT_FALSE(r.ok()) << what << ": accepted";
  EXPECT_EQ(r.status().code(), Code::kProtocolError) << what << ": " << r.status().ToString();
}

// Every proper prefix of `enc` and `enc` plus one extra byte must fail to decode.
template <typename Decode>
void ExpectTruncationsAndTrailingFail(const std::vector<std::byte>& enc, Decode decode,
                                      const std::string& what) {
  for (size_t n = 0; n < enc.size(); ++n) {
    std::vector<std::byte> prefix(enc.begin(), enc.begin() + static_cast<ptrdiff_t>(n));
    auto r = decode(std::span<const std::byte>(prefix));
    EXPECT_FALSE(r.ok()) << what << " truncated to " << n << " of " << enc.size() << " bytes";
    if (!r.ok()) {
      EXPECT_EQ(r.status().code(), Code::kProtocolError) << what;
    }
  }
  for (int extra : {0, 1, 0xFF}) {
    std::vector<std::byte> longer = enc;
    longer.push_back(std::byte(extra));
    auto r = decode(std::span<const std::byte>(longer));
    EXPECT_FALSE(r.ok()) << what << " with a trailing byte";
    if (!r.ok()) {
      EXPECT_EQ(r.status().code(), Code::kProtocolError) << what;
    }
  }
}

// ---- kRegister -------------------------------------------------------------------------------

RegisterMsg SampleRegister() {
  RegisterMsg m;
  m.role = Role::kServer;
  m.requested_rank = 5;
  m.host = "node-17/4242";
  m.push_address = Bytes({0, 1, 2, 0xFF, 0x80});
  m.pull_address = Bytes({9, 8, 7});
  return m;
}

TEST(MessagesTest, JoinRoundTripAndRejects) {
  JoinMsg m;
  m.barriers = 7;
  m.rounds = {{1, 5}, {9, 0}, {UINT64_MAX, 3}};
  const std::vector<std::byte> b = Encode(m);
  auto d = DecodeJoin(b);
  ASSERT_TRUE(d.ok()) << d.status().ToString();
  EXPECT_EQ(d->barriers, 7u);
  EXPECT_EQ(d->rounds, m.rounds);
  for (size_t n = 0; n < b.size(); ++n) {
    EXPECT_FALSE(DecodeJoin(std::span(b).first(n)).ok()) << "truncated to " << n;
  }
  std::vector<std::byte> trailing = b;
  trailing.push_back(std::byte{0});
  EXPECT_FALSE(DecodeJoin(trailing).ok());
  JoinMsg unsorted;
  unsorted.rounds = {{9, 1}, {1, 1}};
  auto u = DecodeJoin(Encode(unsorted));
  ASSERT_FALSE(u.ok());
  EXPECT_NE(u.status().message().find("ascending"), std::string::npos);
  // A count past the bound is refused before anything is allocated.
  JoinMsg big;
  big.rounds.resize(kMaxJoinKeys + 1);
  for (uint64_t i = 0; i < big.rounds.size(); ++i) big.rounds[i] = {i, 0};
  EXPECT_FALSE(DecodeJoin(Encode(big)).ok());
}

TEST(MessagesTest, RegisterRoundTrip) {
  for (int32_t rank : {-1, 0, 5, std::numeric_limits<int32_t>::max()}) {
    for (Role role : {Role::kWorker, Role::kServer}) {
      RegisterMsg m = SampleRegister();
      m.role = role;
      m.requested_rank = rank;
      Result<RegisterMsg> d = DecodeRegister(Encode(m));
      ASSERT_TRUE(d.ok()) << d.status().ToString();
      EXPECT_EQ(d->role, role);
      EXPECT_EQ(d->requested_rank, rank);
      EXPECT_EQ(d->host, m.host);
      EXPECT_EQ(d->push_address, m.push_address);
      EXPECT_EQ(d->pull_address, m.pull_address);
    }
  }
  RegisterMsg empty;  // empty strings and addresses
  Result<RegisterMsg> d = DecodeRegister(Encode(empty));
  ASSERT_TRUE(d.ok()) << d.status().ToString();
  EXPECT_EQ(d->requested_rank, -1);
  EXPECT_TRUE(d->host.empty());
  EXPECT_TRUE(d->push_address.empty());
}

TEST(MessagesTest, RegisterMaximalLengths) {
  RegisterMsg m = SampleRegister();
  m.host.assign(kMaxNameLength, 'h');
  m.push_address.assign(kMaxAddressLength, std::byte{0xAB});
  m.pull_address.assign(kMaxAddressLength, std::byte{0xCD});
  Result<RegisterMsg> d = DecodeRegister(Encode(m));
  ASSERT_TRUE(d.ok()) << d.status().ToString();
  EXPECT_EQ(d->host, m.host);
  EXPECT_EQ(d->push_address, m.push_address);
}

TEST(MessagesTest, RegisterRejects) {
  RegisterMsg m = SampleRegister();
  m.requested_rank = -2;
  ExpectBad(DecodeRegister(Encode(m)), "rank -2");
  m.requested_rank = std::numeric_limits<int32_t>::min();
  ExpectBad(DecodeRegister(Encode(m)), "rank INT_MIN");

  for (int role : {0, 3, 255}) {
    std::vector<std::byte> enc = Encode(SampleRegister());
    enc[0] = std::byte(role);
    ExpectBad(DecodeRegister(enc), "role " + std::to_string(role));
  }
  m = SampleRegister();
  m.host.assign(kMaxNameLength + 1, 'h');
  ExpectBad(DecodeRegister(Encode(m)), "host too long");
  m = SampleRegister();
  m.push_address.assign(kMaxAddressLength + 1, std::byte{1});
  ExpectBad(DecodeRegister(Encode(m)), "push address too long");
  m = SampleRegister();
  m.pull_address.assign(kMaxAddressLength + 1, std::byte{1});
  ExpectBad(DecodeRegister(Encode(m)), "pull address too long");
}

TEST(MessagesTest, RegisterCarriesTheServerWeight) {
  for (double w : {1.0, 0.25, 3.0, 0.1, kMinServerWeight, kMaxServerWeight, 123456.789}) {
    RegisterMsg m = SampleRegister();
    m.weight = w;
    const std::vector<std::byte> enc = Encode(m);
    // The 8 bytes before the two memory fields, the standby flag and the metrics port: the
    // weight's IEEE 754 bits, little-endian.
    uint64_t bits = 0;
    for (int i = 0; i < 8; ++i) bits |= uint64_t(enc[enc.size() - 27 + i]) << (8 * i);
    EXPECT_EQ(bits, std::bit_cast<uint64_t>(w));
    Result<RegisterMsg> d = DecodeRegister(enc);
    ASSERT_TRUE(d.ok()) << w << ": " << d.status().ToString();
    EXPECT_EQ(d->weight, w);
  }
  EXPECT_EQ(RegisterMsg{}.weight, 1.0);
}

TEST(MessagesTest, RegisterCarriesTheStandbyFlag) {
  RegisterMsg m = SampleRegister();
  m.role = Role::kServer;
  for (bool standby : {false, true}) {
    m.standby = standby;
    const std::vector<std::byte> enc = Encode(m);
    // The byte before the metrics port (the last two).
    EXPECT_EQ(std::to_integer<uint8_t>(enc[enc.size() - 3]), standby ? 1 : 0);
    Result<RegisterMsg> d = DecodeRegister(enc);
    ASSERT_TRUE(d.ok()) << d.status().ToString();
    EXPECT_EQ(d->standby, standby);
  }
  std::vector<std::byte> enc = Encode(m);
  enc[enc.size() - 3] = std::byte{2};
  ExpectBad(DecodeRegister(enc), "standby flag 2");
  m.role = Role::kWorker;  // a worker cannot stand by
  ExpectBad(DecodeRegister(Encode(m)), "a worker's standby flag");
}

// ---- Restart: a member resuming with a restarted scheduler ------------------------------------

TEST(MessagesTest, RegisterCarriesTheResumeState) {
  RegisterMsg m = SampleRegister();
  m.role = Role::kWorker;
  m.requested_rank = 3;
  m.resume = ResumeState{7, 12, 11, 5, {1, 4}};
  Result<RegisterMsg> d = DecodeRegister(Encode(m));
  ASSERT_TRUE(d.ok()) << d.status().ToString();
  ASSERT_TRUE(d->resume.has_value());
  EXPECT_EQ(d->resume->keys, 7u);
  EXPECT_EQ(d->resume->barriers_entered, 12u);
  EXPECT_EQ(d->resume->barriers_released, 11u);
  EXPECT_EQ(d->resume->server_ids, 5u);
  EXPECT_EQ(d->resume->lost_servers, (std::vector<uint32_t>{1, 4}));
  // A first registration has none: its encoding is the resuming one's first bytes.
  const std::vector<std::byte> resuming = Encode(m);
  m.resume.reset();
  const std::vector<std::byte> first = Encode(m);
  ASSERT_LT(first.size(), resuming.size());
  EXPECT_TRUE(std::equal(first.begin(), first.end(), resuming.begin()));
  d = DecodeRegister(first);
  ASSERT_TRUE(d.ok());
  EXPECT_FALSE(d->resume.has_value());
  // Cut anywhere inside the resume state, or with a byte after it: refused.
  for (size_t n = first.size() + 1; n < resuming.size(); ++n) {
    ExpectBad(DecodeRegister(std::span(resuming.data(), n)), "resume state cut to " +
                                                                 std::to_string(n) + " bytes");
  }
  std::vector<std::byte> longer = resuming;
  longer.push_back(std::byte{0});
  ExpectBad(DecodeRegister(longer), "a byte after the resume state");
}

TEST(MessagesTest, RegisterRejectsBadResumeStates) {
  RegisterMsg m = SampleRegister();
  m.role = Role::kWorker;
  m.requested_rank = 0;
  const auto bad = [&](ResumeState st, const std::string& what) {
    m.resume = std::move(st);
    ExpectBad(DecodeRegister(Encode(m)), what);
  };
  bad({0, 1, 2, 2, {}}, "more barriers released than entered");
  bad({0, 0, 0, 2, {2}}, "a lost server id past the ids known");
  bad({0, 0, 0, 4, {3, 1}}, "lost servers out of order");
  bad({0, 0, 0, 4, {1, 1}}, "a lost server twice");
  bad({0, 0, 0, kMaxMembers + kMaxServersJoined + 1, {}}, "more server ids than a job has");
  m.requested_rank = -1;
  bad({}, "a resuming member without its id");
  m.requested_rank = 1;
  m.role = Role::kServer;
  bad({2, 0, 0, 0, {}}, "a server with keys to resume");
  // A lost-server count larger than the bytes that follow: refused before allocating.
  m.role = Role::kWorker;
  m.resume = ResumeState{0, 0, 0, 4096, {}};
  std::vector<std::byte> enc = Encode(m);
  for (size_t i = 0; i < 4; ++i) enc[enc.size() - 4 + i] = std::byte{0xFF};
  const size_t largest = LargestAllocation([&] { ExpectBad(DecodeRegister(enc), "huge count"); });
  EXPECT_LT(largest, 1u << 16);
}

ResumeKeyMsg SampleResumeKey() {
  ResumeKeyMsg m;
  m.declare = {"fc2.bias", 0, {2, 5}, 0, {}};
  m.state = ResumeKeyMsg::Plan::kPlanned;
  m.plan.name = "fc2.bias";
  m.plan.partitions = {{0, 4, 0}, {4, 4, 1}, {8, 2, 0}};
  return m;
}

TEST(MessagesTest, ResumeKeyRoundTrips) {
  ResumeKeyMsg m = SampleResumeKey();
  Result<ResumeKeyMsg> d = DecodeResumeKey(Encode(m), 10, 2);
  ASSERT_TRUE(d.ok()) << d.status().ToString();
  EXPECT_EQ(d->declare.name, "fc2.bias");
  EXPECT_EQ(d->declare.shape, (std::vector<uint64_t>{2, 5}));
  EXPECT_EQ(d->state, ResumeKeyMsg::Plan::kPlanned);
  ASSERT_EQ(d->plan.partitions.size(), 3u);
  EXPECT_EQ(d->plan.partitions[1].server, 1u);
  ExpectTruncationsAndTrailingFail(
      Encode(m), [](std::span<const std::byte> b) { return DecodeResumeKey(b, 10, 2); },
      "resume key");
  m.state = ResumeKeyMsg::Plan::kNone;
  d = DecodeResumeKey(Encode(m), 10, 2);
  ASSERT_TRUE(d.ok()) << d.status().ToString();
  EXPECT_TRUE(d->plan.partitions.empty());
  m.state = ResumeKeyMsg::Plan::kRefused;
  m.refusal = static_cast<uint8_t>(Code::kMismatch);
  m.refusal_text = "ranks disagree";
  d = DecodeResumeKey(Encode(m), 10, 2);
  ASSERT_TRUE(d.ok()) << d.status().ToString();
  EXPECT_EQ(d->refusal, static_cast<uint8_t>(Code::kMismatch));
  EXPECT_EQ(d->refusal_text, "ranks disagree");
}

TEST(MessagesTest, ResumeKeyRejects) {
  ResumeKeyMsg m = SampleResumeKey();
  ExpectBad(DecodeResumeKey(Encode(m), 11, 2), "a plan that does not tile the tensor");
  ExpectBad(DecodeResumeKey(Encode(m), 10, 1), "a plan naming a server past the ids known");
  m.plan.name = "fc1.bias";
  ExpectBad(DecodeResumeKey(Encode(m), 10, 2), "a plan for another tensor");
  m = SampleResumeKey();
  m.plan.spec.kind = Collective::kBroadcast;
  ExpectBad(DecodeResumeKey(Encode(m), 10, 2), "a plan for another collective");
  m = SampleResumeKey();
  m.state = ResumeKeyMsg::Plan::kRefused;
  m.refusal = 0;
  ExpectBad(DecodeResumeKey(Encode(m), 10, 2), "a refusal with no code");
  m.refusal = kMaxCode + 1;
  ExpectBad(DecodeResumeKey(Encode(m), 10, 2), "a refusal with a code out of range");
  std::vector<std::byte> enc = Encode(SampleResumeKey());
  const size_t declare_bytes = Encode(SampleResumeKey().declare).size();
  enc[4 + declare_bytes] = std::byte{3};  // the plan's state
  ExpectBad(DecodeResumeKey(enc, 10, 2), "plan state 3");
}

TEST(MessagesTest, MemberEntryRoundTrips) {
  const Member m{Role::kServer, 7, "standby-host", {std::byte{1}, std::byte{2}}, {}};
  Result<Member> d = DecodeMember(EncodeMember(m));
  ASSERT_TRUE(d.ok()) << d.status().ToString();
  EXPECT_EQ(d->role, m.role);
  EXPECT_EQ(d->id, 7u);
  EXPECT_EQ(d->host, m.host);
  EXPECT_EQ(d->push_address, m.push_address);
  EXPECT_TRUE(d->pull_address.empty());
  std::vector<std::byte> longer = EncodeMember(m);
  longer.push_back(std::byte{0});
  ExpectBad(DecodeMember(longer), "trailing byte");
  ExpectBad(DecodeMember(std::span(longer).first(5)), "truncated entry");
}

TEST(MessagesTest, RegisterCarriesTheServerMemory) {
  for (uint64_t budget : {uint64_t{0}, uint64_t{1}, uint64_t{64} << 20, ~uint64_t{0}}) {
    RegisterMsg m = SampleRegister();
    m.memory_budget = budget;
    m.available_memory = ~budget;
    Result<RegisterMsg> d = DecodeRegister(Encode(m));
    ASSERT_TRUE(d.ok()) << budget << ": " << d.status().ToString();
    EXPECT_EQ(d->memory_budget, budget);
    EXPECT_EQ(d->available_memory, ~budget);
  }
  // A register message from before the memory fields (weight last) is malformed, not misread.
  std::vector<std::byte> old = Encode(SampleRegister());
  old.resize(old.size() - 17);
  ExpectBad(DecodeRegister(old), "register without the memory fields");
}

TEST(MessagesTest, RegisterRejectsBadWeights) {
  const double inf = std::numeric_limits<double>::infinity();
  for (double w : {0.0, -0.0, -1.0, std::nan(""), -std::nan(""), inf, -inf, 1e-7,
                   std::nextafter(kMinServerWeight, 0.0), std::nextafter(kMaxServerWeight, inf),
                   1e300, std::numeric_limits<double>::denorm_min()}) {
    RegisterMsg m = SampleRegister();
    m.weight = w;
    Result<RegisterMsg> d = DecodeRegister(Encode(m));
    ASSERT_FALSE(d.ok()) << "weight " << w;
    EXPECT_EQ(d.status().code(), Code::kProtocolError);
    EXPECT_NE(d.status().message().find("weight"), std::string::npos) << d.status().ToString();
  }
  EXPECT_TRUE(IsValidServerWeight(1.0));
  EXPECT_FALSE(IsValidServerWeight(std::nan("")));
}

TEST(MessagesTest, RegisterTruncationsAndTrailingBytes) {
  ExpectTruncationsAndTrailingFail(Encode(SampleRegister()), DecodeRegister, "register");
}

TEST(MessagesTest, RegisterHugeLengthPrefixDoesNotAllocate) {
  Writer w;
  w.U8(1);
  w.I32(-1);
  w.U32(0xFFFFFFFFu);  // host length
  const std::vector<std::byte> enc = w.Take();
  const size_t largest = LargestAllocation([&] { ExpectBad(DecodeRegister(enc), "huge host"); });
  EXPECT_LT(largest, 64u * 1024);
}

// ---- kWelcome --------------------------------------------------------------------------------

WelcomeMsg SampleWelcome() {
  WelcomeMsg m;
  m.your_id = 1;
  m.num_workers = 2;
  m.num_servers = 1;
  m.members.push_back({Role::kWorker, 0, "w0", Bytes({1}), Bytes({2})});
  m.members.push_back({Role::kWorker, 1, "w1", Bytes({3, 4}), Bytes({})});
  m.members.push_back({Role::kServer, 0, "s0", Bytes({5, 6, 7}), Bytes({8})});
  return m;
}

TEST(MessagesTest, WelcomeRoundTrip) {
  const WelcomeMsg m = SampleWelcome();
  Result<WelcomeMsg> d = DecodeWelcome(Encode(m));
  ASSERT_TRUE(d.ok()) << d.status().ToString();
  EXPECT_EQ(d->your_id, m.your_id);
  EXPECT_EQ(d->num_workers, m.num_workers);
  EXPECT_EQ(d->num_servers, m.num_servers);
  ASSERT_EQ(d->members.size(), m.members.size());
  for (size_t i = 0; i < m.members.size(); ++i) {
    EXPECT_EQ(d->members[i].role, m.members[i].role) << i;
    EXPECT_EQ(d->members[i].id, m.members[i].id) << i;
    EXPECT_EQ(d->members[i].host, m.members[i].host) << i;
    EXPECT_EQ(d->members[i].push_address, m.members[i].push_address) << i;
    EXPECT_EQ(d->members[i].pull_address, m.members[i].pull_address) << i;
  }
}

TEST(MessagesTest, WelcomeRejectsMemberIdOutOfRange) {
  WelcomeMsg m = SampleWelcome();
  m.members[1].id = 2;  // worker id == num_workers
  ExpectBad(DecodeWelcome(Encode(m)), "worker id == num_workers");
  m = SampleWelcome();
  m.members[0].id = 0xFFFFFFFFu;
  ExpectBad(DecodeWelcome(Encode(m)), "worker id 2^32-1");
  m = SampleWelcome();
  m.members[2].id = 1;  // server id == num_servers
  ExpectBad(DecodeWelcome(Encode(m)), "server id == num_servers");
}

TEST(MessagesTest, WelcomeRejectsWrongMemberCount) {
  WelcomeMsg m = SampleWelcome();
  m.num_workers = 3;  // says 3 + 1 members but carries 3
  ExpectBad(DecodeWelcome(Encode(m)), "fewer members than announced");
  m = SampleWelcome();
  m.members.push_back({Role::kServer, 0, "extra", {}, {}});
  ExpectBad(DecodeWelcome(Encode(m)), "more members than announced");
  m = SampleWelcome();
  m.num_workers = 0xFFFFFFFFu;  // the sum overflows 32 bits
  m.num_servers = 4;
  ExpectBad(DecodeWelcome(Encode(m)), "count sum overflow");
}

TEST(MessagesTest, WelcomeRejectsBadRole) {
  std::vector<std::byte> enc = Encode(SampleWelcome());
  enc[16] = std::byte{3};  // role byte of the first member (after four u32)
  ExpectBad(DecodeWelcome(enc), "role 3");
  enc[16] = std::byte{0};
  ExpectBad(DecodeWelcome(enc), "role 0");
}

TEST(MessagesTest, WelcomeHugeMemberCountDoesNotAllocate) {
  for (uint32_t n : {kMaxMembers + 1, 0x10000000u, 0xFFFFFFFFu}) {
    Writer w;
    w.U32(0);
    w.U32(n);  // num_workers
    w.U32(0);  // num_servers
    w.U32(n);  // members
    const std::vector<std::byte> enc = w.Take();
    const size_t largest =
        LargestAllocation([&] { ExpectBad(DecodeWelcome(enc), "members " + std::to_string(n)); });
    EXPECT_LT(largest, 64u * 1024) << n;
  }
}

TEST(MessagesTest, WelcomeTruncationsAndTrailingBytes) {
  ExpectTruncationsAndTrailingFail(Encode(SampleWelcome()), DecodeWelcome, "welcome");
  ExpectBad(DecodeWelcome({}), "empty welcome");
}

// ---- kDeclare --------------------------------------------------------------------------------

TEST(MessagesTest, DeclareRoundTrip) {
  // 0: the scheduler chooses (control/tuning.h).
  for (uint64_t pb : {uint64_t{0}, uint64_t{1}, uint64_t{4} << 20, std::numeric_limits<uint64_t>::max()}) {
    DeclareMsg m{"layer1.weight.grad", pb, {}};
    Result<DeclareMsg> d = DecodeDeclare(Encode(m));
    ASSERT_TRUE(d.ok()) << d.status().ToString();
    EXPECT_EQ(d->name, m.name);
    EXPECT_EQ(d->partition_bytes, pb);
    EXPECT_TRUE(d->shape.empty());
  }
  for (const std::vector<uint64_t>& shape :
       {std::vector<uint64_t>{12}, std::vector<uint64_t>{3, 4}, std::vector<uint64_t>{2, 0, 7},
        std::vector<uint64_t>(kMaxShapeDims, 1)}) {
    Result<DeclareMsg> d = DecodeDeclare(Encode(DeclareMsg{"t", 64, shape}));
    ASSERT_TRUE(d.ok()) << d.status().ToString();
    EXPECT_EQ(d->shape, shape);
  }
}

TEST(MessagesTest, DeclareRejects) {
  ExpectBad(DecodeDeclare(Encode(DeclareMsg{std::string(kMaxNameLength + 1, 'n'), 64, {}})),
            "name too long");
  EXPECT_TRUE(DecodeDeclare(Encode(DeclareMsg{std::string(kMaxNameLength, 'n'), 64, {}})).ok());
  ExpectTruncationsAndTrailingFail(Encode(DeclareMsg{"tensor", 4096, {}}), DecodeDeclare, "declare");
  ExpectTruncationsAndTrailingFail(Encode(DeclareMsg{"tensor", 4096, {3, 4}}), DecodeDeclare,
                                   "declare");
  ExpectBad(DecodeDeclare(Encode(DeclareMsg{"x", 64, std::vector<uint64_t>(kMaxShapeDims + 1, 1)})),
            "too many dimensions");
}

// ---- kAssign ---------------------------------------------------------------------------------

AssignMsg SampleAssign() {
  AssignMsg m;
  m.name = "fc2.bias";
  m.partitions = {{0, 4, 0}, {4, 4, 1}, {8, 2, 0}};
  return m;
}

TEST(MessagesTest, AssignRoundTrip) {
  const AssignMsg m = SampleAssign();
  Result<AssignMsg> d = DecodeAssign(Encode(m), 10, 2);
  ASSERT_TRUE(d.ok()) << d.status().ToString();
  EXPECT_EQ(d->name, m.name);
  ASSERT_EQ(d->partitions.size(), 3u);
  for (size_t i = 0; i < 3; ++i) {
    EXPECT_EQ(d->partitions[i].offset, m.partitions[i].offset);
    EXPECT_EQ(d->partitions[i].count, m.partitions[i].count);
    EXPECT_EQ(d->partitions[i].server, m.partitions[i].server);
  }
  // An empty tensor has no partitions.
  AssignMsg empty{"empty", {}};
  Result<AssignMsg> e = DecodeAssign(Encode(empty), 0, 1);
  ASSERT_TRUE(e.ok()) << e.status().ToString();
  EXPECT_TRUE(e->partitions.empty());
  // One partition covering a huge tensor.
  const uint64_t big = std::numeric_limits<uint64_t>::max();
  AssignMsg one{"one", {{0, big, 3}}};
  EXPECT_TRUE(DecodeAssign(Encode(one), big, 4).ok());
}

TEST(MessagesTest, AssignRejectsBadTilings) {
  struct Case {
    const char* what;
    std::vector<PartitionPlan> parts;
    uint64_t total;
    uint32_t servers;
  };
  const uint64_t kMax = std::numeric_limits<uint64_t>::max();
  const Case cases[] = {
      {"gap", {{0, 4, 0}, {5, 5, 0}}, 10, 1},
      {"gap at the start", {{1, 9, 0}}, 10, 1},
      {"overlap", {{0, 6, 0}, {5, 5, 0}}, 10, 1},
      {"same offset twice", {{0, 5, 0}, {0, 5, 0}}, 10, 1},
      {"out of order", {{5, 5, 0}, {0, 5, 0}}, 10, 1},
      {"zero count", {{0, 0, 0}, {0, 10, 0}}, 10, 1},
      {"zero count at the end", {{0, 10, 0}, {10, 0, 0}}, 10, 1},
      {"server == num_servers", {{0, 5, 0}, {5, 5, 2}}, 10, 2},
      {"server 2^32-1", {{0, 10, 0xFFFFFFFFu}}, 10, 2},
      {"no servers", {{0, 10, 0}}, 10, 0},
      {"short of the total", {{0, 4, 0}, {4, 4, 0}}, 10, 1},
      {"past the total", {{0, 8, 0}, {8, 4, 0}}, 10, 1},
      {"single past the total", {{0, 11, 0}}, 10, 1},
      {"partitions for an empty tensor", {{0, 1, 0}}, 0, 1},
      {"no partitions for a non-empty tensor", {}, 10, 1},
      {"offset + count overflows", {{0, 4, 0}, {4, kMax, 0}}, 10, 1},
      {"count wraps back to the total", {{0, 4, 0}, {4, kMax - 3, 0}, {4, 6, 0}}, 10, 1},
      {"huge count", {{0, kMax, 0}}, 10, 1},
  };
  for (const Case& c : cases) {
    AssignMsg m{"t", c.parts};
    ExpectBad(DecodeAssign(Encode(m), c.total, c.servers), c.what);
  }
}

TEST(MessagesTest, AssignRejectsLongName) {
  AssignMsg m = SampleAssign();
  m.name.assign(kMaxNameLength + 1, 'n');
  ExpectBad(DecodeAssign(Encode(m), 10, 2), "name too long");
}

TEST(MessagesTest, AssignHugePartitionCountDoesNotAllocate) {
  for (uint32_t n : {kMaxPartitions, kMaxPartitions + 1, 0x7FFFFFFFu, 0xFFFFFFFFu}) {
    Writer w;
    w.Str("t");
    w.U32(n);
    // One real partition, the rest missing.
    w.U64(0);
    w.U64(1);
    w.U32(0);
    const std::vector<std::byte> enc = w.Take();
    const size_t largest = LargestAllocation(
        [&] { ExpectBad(DecodeAssign(enc, n, 1), "partitions " + std::to_string(n)); });
    EXPECT_LT(largest, 64u * 1024) << n;
  }
}

TEST(MessagesTest, AssignTruncationsAndTrailingBytes) {
  ExpectTruncationsAndTrailingFail(
      Encode(SampleAssign()),
      [](std::span<const std::byte> b) { return DecodeAssign(b, 10, 2); }, "assign");
}

// ---- Text ------------------------------------------------------------------------------------

TEST(MessagesTest, TextRoundTrip) {
  for (std::string s : {std::string(), std::string("kMismatch: rank 0 and rank 1"),
                        std::string("bin\0ary\xff", 8), std::string(kMaxMessageLength, 'x')}) {
    Result<std::string> d = DecodeText(EncodeText(s));
    ASSERT_TRUE(d.ok()) << d.status().ToString();
    EXPECT_EQ(*d, s);
  }
}

TEST(MessagesTest, TextIsTruncatedToTheBoundWhenEncoded) {
  const std::string long_text(kMaxMessageLength + 100, 'y');
  Result<std::string> d = DecodeText(EncodeText(long_text));
  ASSERT_TRUE(d.ok()) << d.status().ToString();
  EXPECT_EQ(d->size(), kMaxMessageLength);
}

TEST(MessagesTest, TextRejects) {
  Writer w;
  w.Str(std::string(kMaxMessageLength + 1, 'z'));  // a peer that does not truncate
  ExpectBad(DecodeText(w.Take()), "text too long");
  Writer h;
  h.U32(0xFFFFFFFFu);
  const std::vector<std::byte> huge = h.Take();
  const size_t largest = LargestAllocation([&] { ExpectBad(DecodeText(huge), "huge length"); });
  EXPECT_LT(largest, 64u * 1024);
  ExpectTruncationsAndTrailingFail(EncodeText("some error"), DecodeText, "text");
}

// ---- Codec -----------------------------------------------------------------------------------

TEST(CodecTest, ReaderStaysFailedAfterAnError) {
  const std::vector<std::byte> b = Bytes({1, 2, 3, 4, 5, 6, 7, 8});
  Reader r(b);
  uint64_t v64;
  uint32_t v32;
  EXPECT_TRUE(r.U32(&v32));
  EXPECT_EQ(v32, 0x04030201u);
  EXPECT_FALSE(r.U64(&v64));  // only 4 left
  EXPECT_FALSE(r.ok());
  EXPECT_EQ(r.remaining(), 0u);
  EXPECT_FALSE(r.U32(&v32));  // would fit, but the reader has failed
  EXPECT_FALSE(r.Done());
}

TEST(CodecTest, LittleEndianRoundTrip) {
  Writer w;
  w.U8(0xAB);
  w.U32(0x01020304u);
  w.U64(0x1122334455667788ull);
  w.I32(-5);
  w.Str("hi");
  std::vector<std::byte> b = w.Take();
  ASSERT_EQ(b.size(), 1u + 4 + 8 + 4 + 4 + 2);
  EXPECT_EQ(std::to_integer<int>(b[1]), 0x04);
  Reader r(b);
  uint8_t a;
  uint32_t c;
  uint64_t d;
  int32_t e;
  std::string s;
  ASSERT_TRUE(r.U8(&a) && r.U32(&c) && r.U64(&d) && r.I32(&e) && r.Str(&s, 10));
  EXPECT_TRUE(r.Done());
  EXPECT_EQ(a, 0xAB);
  EXPECT_EQ(c, 0x01020304u);
  EXPECT_EQ(d, 0x1122334455667788ull);
  EXPECT_EQ(e, -5);
  EXPECT_EQ(s, "hi");
}

TEST(MessagesTest, RegisterCarriesTheMetricsPort) {
  RegisterMsg m = SampleRegister();
  m.metrics_port = 9100;
  auto d = DecodeRegister(Encode(m));
  ASSERT_TRUE(d.ok()) << d.status().ToString();
  EXPECT_EQ(d->metrics_port, 9100);
  std::vector<std::byte> b = Encode(m);
  b.pop_back();  // half a port
  EXPECT_FALSE(DecodeRegister(b).ok());
}

TEST(MessagesTest, StallReportRoundTripAndRejects) {
  std::vector<StalledRound> m = {{7, 2, 9, 61000, {1, 3}, {0, 2}}, {8, 0, 0, 5, {2}, {}}};
  const std::vector<std::byte> b = Encode(m);
  auto d = DecodeStallReport(b, 4);
  ASSERT_TRUE(d.ok()) << d.status().ToString();
  ASSERT_EQ(d->size(), 2u);
  EXPECT_EQ((*d)[0].key, 7u);
  EXPECT_EQ((*d)[0].partition, 2u);
  EXPECT_EQ((*d)[0].round, 9u);
  EXPECT_EQ((*d)[0].age_ms, 61000u);
  EXPECT_EQ((*d)[0].missing, (std::vector<uint32_t>{1, 3}));
  EXPECT_EQ((*d)[0].pushed, (std::vector<uint32_t>{0, 2}));
  EXPECT_EQ((*d)[1].pushed.size(), 0u);
  for (size_t n = 0; n < b.size(); ++n) {
    EXPECT_FALSE(DecodeStallReport(std::span(b).first(n), 4).ok()) << "truncated to " << n;
  }
  std::vector<std::byte> trailing = b;
  trailing.push_back(std::byte{0});
  EXPECT_FALSE(DecodeStallReport(trailing, 4).ok());
  // Ranks out of range, unsorted, repeated, or both missing and pushed.
  EXPECT_FALSE(DecodeStallReport(b, 3).ok());
  for (const auto& [missing, pushed] :
       std::vector<std::pair<std::vector<uint32_t>, std::vector<uint32_t>>>{
           {{3, 1}, {}}, {{1, 1}, {}}, {{1}, {1}}}) {
    std::vector<StalledRound> bad = {{1, 0, 0, 0, missing, pushed}};
    EXPECT_FALSE(DecodeStallReport(Encode(bad), 4).ok());
  }
  // An age past a year (a peer's number that would overflow a duration) is refused.
  std::vector<StalledRound> old = {{1, 0, 0, kMaxStallAgeMs + 1, {1}, {}}};
  EXPECT_FALSE(DecodeStallReport(Encode(old), 4).ok());
  // A count past the bound is refused before anything is allocated.
  Writer w;
  w.U32(kMaxStalledRounds + 1);
  EXPECT_FALSE(DecodeStallReport(w.Take(), 4).ok());
}

}  // namespace
}  // namespace gradlink::wire
