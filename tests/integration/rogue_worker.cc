// Over 600 lines on purpose: one binary holding every misbehaviour the integration tests drive
// (run_integration.py picks one per run), so each shares the real join and wire code.
// gl_rogue_worker: a worker built from gradlink's internals (join, UCX lanes, wire codec) that
// takes part honestly in a job and, between its honest rounds, throws malformed and unexpected
// frames at every server's push and pull lanes from separate UCX endpoints.
//
// The job: --workers honest gl_probe_worker --mode honest processes (ranks 0..n-2) and this
// process as rank n-1, all summing the fp32 tensor "rogue.t" of --count elements for --rounds
// rounds. The servers must drop every bad frame (closing the connection it came on, or
// refusing it) and keep serving: this process checks every element of its own pulls, the honest
// workers check theirs, and the harness checks that every process exits 0.
//
// Exit codes: 0 pass, 1 failure (message on stderr), 3 wrong elements, 2 usage.
#include <CLI/CLI.hpp>
#include <array>
#include <atomic>
#include <chrono>
#include <initializer_list>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <map>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "control/join.h"
#include "transport/transport.h"
#include "wire/frame.h"
#include "wire/messages.h"

namespace gl = gradlink;
namespace wire = gradlink::wire;
namespace transport = gradlink::transport;
using Clock = std::chrono::steady_clock;

namespace {

constexpr char kTensor[] = "rogue.t";
// Never an op id of a real worker (those count up from 1): replies carrying it must be dropped.
constexpr uint64_t kBogusCookie = 0xFFFFFFFF00000000ull;

int64_t Value(uint64_t j, uint32_t rank, uint64_t round, uint64_t t) {
  return static_cast<int64_t>((j * 7 + rank * 3 + round * 5 + t * 11) % 13) - 6;
}

// Receives pull responses (and the servers' kDataError answers to our bad pushes).
class PullReceiver final : public transport::Receiver {
 public:
  struct Expect {
    uint64_t key = 0;
    uint32_t partition = 0;
    uint64_t round = 0;
    uint64_t count = 0;
    std::span<std::byte> dest;
    bool done = false;
    std::vector<std::byte> error_text;
    gl::Status error;
  };

  void ExpectReply(uint64_t cookie, Expect e) {
    std::lock_guard<std::mutex> lock(mu_);
    expects_[cookie] = std::move(e);
  }

  // Waits until every expected reply arrived. Returns the first error.
  gl::Status WaitAll(Clock::time_point deadline) {
    std::unique_lock<std::mutex> lock(mu_);
    const bool all = cv_.wait_until(lock, deadline, [this] {
      if (!failure_.ok()) return true;
      for (auto& [c, e] : expects_) {
        if (!e.done) return false;
      }
      return true;
    });
    if (!failure_.ok()) return failure_;
    if (!all) return gl::Timeout("pull responses missing at the deadline");
    for (auto& [c, e] : expects_) {
      if (!e.error.ok()) return e.error;
    }
    expects_.clear();
    return gl::Status::Ok();
  }

  void Fail(const gl::Status& s) {
    std::lock_guard<std::mutex> lock(mu_);
    if (failure_.ok()) failure_ = s;
    cv_.notify_all();
  }

  uint64_t ignored() const { return ignored_.load(); }

  gl::Result<std::span<std::byte>> OnHeader(const wire::Header& h) override {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = expects_.find(h.cookie);
    if (it == expects_.end() || it->second.done) {
      // The servers answer our refused bad pushes with kDataError: expected, and dropped.
      ignored_++;
      if (h.type != wire::MsgType::kDataError || h.cookie != kBogusCookie) {
        unexpected_++;
        std::fprintf(stderr, "rogue: unexpected frame type %d cookie %llx\n",
                     static_cast<int>(h.type), (unsigned long long)h.cookie);
      }
      return gl::Aborted("not expected");
    }
    Expect& e = it->second;
    if (h.key != e.key || h.partition != e.partition || h.round != e.round) {
      failure_ = gl::ProtocolError("pull reply does not match its push");
      cv_.notify_all();
      return failure_;
    }
    if (h.type == wire::MsgType::kDataError) {
      e.error_text.resize(h.payload_bytes);
      return std::span<std::byte>(e.error_text);
    }
    if (h.type != wire::MsgType::kPullResponse ||
        h.dtype != static_cast<uint8_t>(gl::DataType::kFloat32) || h.count != e.count) {
      failure_ = gl::ProtocolError("pull reply has the wrong type or shape");
      cv_.notify_all();
      return failure_;
    }
    return e.dest;
  }

  void OnPayload(const wire::Header& h, std::span<std::byte>) override {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = expects_.find(h.cookie);
    if (it == expects_.end()) return;
    Expect& e = it->second;
    e.done = true;
    if (h.type == wire::MsgType::kDataError) {
      auto text = wire::DecodeText(e.error_text);
      e.error = gl::Status(static_cast<gl::Code>(h.code == 0 ? 10 : h.code),
                           "server error: " + (text.ok() ? *text : std::string("?")));
    }
    cv_.notify_all();
  }

  void OnReceiveFailed(const wire::Header& h, const gl::Status& s) override {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = expects_.find(h.cookie);
    if (it == expects_.end()) return;
    it->second.done = true;
    it->second.error = s;
    cv_.notify_all();
  }

  void OnPeerFailed(transport::PeerId, const gl::Status& s) override { Fail(s); }

  uint64_t unexpected() const { return unexpected_.load(); }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  std::map<uint64_t, Expect> expects_;
  gl::Status failure_;
  std::atomic<uint64_t> ignored_{0}, unexpected_{0};
};

// For lanes that should receive nothing (our push lane, the evil lane).
class CountingReceiver final : public transport::Receiver {
 public:
  gl::Result<std::span<std::byte>> OnHeader(const wire::Header&) override {
    frames_++;
    return gl::Aborted("not expected");
  }
  void OnPayload(const wire::Header&, std::span<std::byte>) override {}
  void OnReceiveFailed(const wire::Header&, const gl::Status&) override {}
  void OnPeerFailed(transport::PeerId, const gl::Status&) override { peer_failures_++; }
  std::atomic<uint64_t> frames_{0}, peer_failures_{0};
};

// One malformed or unexpected frame.
struct BadFrame {
  std::string what;
  std::vector<std::byte> header;
  std::vector<std::byte> payload;
};

template <typename T>
void Patch(std::vector<std::byte>& b, size_t off, T v) {
  for (size_t i = 0; i < sizeof(T); ++i) b[off + i] = std::byte((v >> (8 * i)) & 0xFF);
}

std::vector<std::byte> Enc(const wire::Header& h) {
  const wire::HeaderBytes hb = wire::EncodeHeader(h);
  return std::vector<std::byte>(hb.begin(), hb.end());
}

// ---- The barrage (--barrage N) -----------------------------------------------------------------
// Thousands of deterministic bad frames, sent between the rogue's honest rounds r (after it has
// pulled round r-1, before it pushes round r: every partition of the real key is then summing
// round r on its server, so "the current round" is well defined). A frame either fails the
// transport's validation (wire::DecodeHeader, or a payload that differs from payload_bytes):
// the server closes the connection it came on, so it goes on a fresh endpoint; or it has a valid
// header that the server must refuse (wrong lane, type, job, sender, key, partition, round):
// those share one endpoint per server lane. Either way each frame is one protocol error at the
// server it was sent to, which the harness checks against the servers' totals.
constexpr uint64_t kNoRound = ~uint64_t{0};
struct BarrageFrame {
  std::string kind;  // for the per-kind counts
  std::vector<std::byte> header;
  std::vector<std::byte> payload;
  bool round_relative = false;  // header round = current round + round_delta
  int64_t round_delta = 0;
  bool closes = false;  // fails transport validation: the server closes its connection
};

struct BarrageCtx {
  uint32_t job, rank, n;
  uint64_t key;
  std::vector<wire::PartitionPlan> plan;
};

std::vector<BarrageFrame> MakeBarrage(const BarrageCtx& c) {
  std::vector<BarrageFrame> v;
  // A push the server refuses on its merits alone (an undeclared key), so that a variant
  // which slipped through validation could still not change any sum.
  wire::Header base;
  base.type = wire::MsgType::kPush;
  base.job = c.job;
  base.sender = c.rank;
  base.key = wire::TensorKey("bogus-job", "bogus-tensor");
  base.partition = 0;
  base.dtype = static_cast<uint8_t>(gl::DataType::kFloat32);
  base.round = 1000000;
  base.count = 4;
  base.payload_bytes = 16;
  base.cookie = kBogusCookie;
  const std::vector<std::byte> p16(16, std::byte{0x41});
  auto add = [&](std::string kind, std::vector<std::byte> h, std::vector<std::byte> payload) {
    v.push_back({std::move(kind), std::move(h), std::move(payload)});
  };
  auto patched = [&](std::string kind, size_t off, auto value) {
    std::vector<std::byte> h = Enc(base);
    Patch(h, off, value);
    add(std::move(kind), std::move(h), p16);
  };
  // Truncated and overlong headers: every length 0..63, and a few beyond.
  {
    const std::vector<std::byte> full = Enc(base);
    for (size_t len = 0; len < wire::kHeaderSize; ++len) {
      add("truncated header", std::vector<std::byte>(full.begin(), full.begin() + len), p16);
    }
    for (size_t len : {65, 72, 128, 1024}) {
      std::vector<std::byte> h = full;
      h.resize(len, std::byte{0});
      add("overlong header", std::move(h), p16);
    }
  }
  // magic: boundaries and every single-bit flip.
  for (uint32_t m : {0u, 0xFFFFFFFFu, 0x324B4C47u, 0x304B4C47u, wire::kMagic + 1, wire::kMagic - 1}) {
    patched("magic", 0, m);
  }
  for (int b = 0; b < 32; ++b) patched("magic", 0, wire::kMagic ^ (1u << b));
  // version: every value but the right one.
  for (int x = 0; x < 256; ++x) {
    if (x != wire::kVersion) patched("version", 4, static_cast<uint8_t>(x));
  }
  // type: all 256 (known types pass validation and are refused by the receiver).
  for (int x = 0; x < 256; ++x) patched("type", 5, static_cast<uint8_t>(x));
  // flags: each bit, none, all.
  for (int b = 0; b < 16; ++b) patched("flags", 6, static_cast<uint16_t>(1u << b));
  patched("flags", 6, uint16_t{0});
  patched("flags", 6, uint16_t{0xFFFF});
  // job hash.
  for (uint32_t j : {0u, 0xFFFFFFFFu, c.job ^ 1u, c.job + 1, wire::JobHash("another-job")}) {
    patched("job", 8, j);
  }
  // sender: 0, n-1, n, 2^32-1 (and the others in between).
  for (uint32_t r : {0u, c.n - 1, c.n, c.n + 1, 0x7FFFFFFFu, 0xFFFFFFFFu}) patched("sender", 12, r);
  // key.
  for (uint64_t k : {uint64_t{0}, uint64_t{1}, ~uint64_t{0}, c.key ^ 1, c.key + 1}) patched("key", 16, k);
  // dtype and code: every value.
  for (int x = 0; x < 256; ++x) patched("dtype", 28, static_cast<uint8_t>(x));
  for (int x = 0; x < 256; ++x) patched("code", 29, static_cast<uint8_t>(x));
  // reserved: each bit, all.
  for (int b = 0; b < 16; ++b) patched("reserved", 30, static_cast<uint16_t>(1u << b));
  patched("reserved", 30, uint16_t{0xFFFF});
  // cookie is opaque: any value is valid (the frame is refused for its key).
  // count with the 16-byte payload: 0, 1, 2^32-1, 2^64-1, and near the right 4.
  for (uint64_t n : {uint64_t{0}, uint64_t{1}, uint64_t{3}, uint64_t{5}, uint64_t{0xFFFFFFFF},
                     ~uint64_t{0}, uint64_t{1} << 62, uint64_t{1} << 63}) {
    patched("count", 40, n);
  }
  // payload_bytes against the 16 bytes carried.
  for (uint64_t b : {uint64_t{0}, uint64_t{1}, uint64_t{15}, uint64_t{17}, uint64_t{32},
                     uint64_t{0xFFFFFFFF}, ~uint64_t{0}, wire::kMaxDataPayload,
                     wire::kMaxDataPayload + 4, wire::kMaxControlPayload + 4}) {
    patched("payload_bytes", 48, b);
  }
  // Headers that agree with themselves but lie about the payload carried.
  for (auto [count, bytes, carried] : std::initializer_list<std::array<uint64_t, 3>>{
           {0, 0, 4}, {0, 0, 512}, {1, 4, 0}, {1, 4, 8}, {4, 16, 0}, {4, 16, 15}, {4, 16, 17},
           {64, 256, 255}, {64, 256, 257}, {64, 256, 16}, {256, 1024, 512},
           {0x3FFFFFFF, 0xFFFFFFFC, 16}, {1u << 28, 1u << 30, 64}}) {
    wire::Header h = base;
    h.count = count;
    h.payload_bytes = bytes;
    add("payload lies", Enc(h), std::vector<std::byte>(carried, std::byte{0x42}));
  }
  // Control-sized lies: a kDataError / control frame over 1 MiB.
  for (auto t : {wire::MsgType::kDataError, wire::MsgType::kRegister, wire::MsgType::kHeartbeat}) {
    wire::Header h = base;
    h.type = t;
    h.payload_bytes = wire::kMaxControlPayload + 1;
    add("payload lies", Enc(h), p16);
  }
  // Well-formed data frames with every header field valid on its own, that the servers must
  // refuse: the real key at rounds other than the current one, partitions that do not exist,
  // senders that are not workers, and every dtype/count shape.
  const uint32_t np = static_cast<uint32_t>(c.plan.size());
  const uint64_t pc = c.plan.empty() ? 4 : c.plan[0].count;
  auto real = [&](std::string kind, uint32_t partition, uint32_t sender, bool rel, int64_t delta,
                  uint64_t round, uint8_t dtype, uint64_t count) {
    wire::Header h = base;
    h.key = c.key;
    h.partition = partition;
    h.sender = sender;
    h.round = round;
    h.dtype = dtype;
    h.count = count;
    h.payload_bytes = count * gl::DataTypeSize(static_cast<gl::DataType>(dtype));
    BarrageFrame f{std::move(kind), Enc(h),
                   std::vector<std::byte>(h.payload_bytes, std::byte{0x43})};
    f.round_relative = rel;
    f.round_delta = delta;
    v.push_back(std::move(f));
  };
  const uint8_t f32 = static_cast<uint8_t>(gl::DataType::kFloat32);
  // Rounds relative to the one about to be pushed: the past, or far ahead. Not the next one or
  // two: a barrage frame that arrives on its own endpoint after the rogue's real push of this
  // round (endpoints do not order against each other) would be a well-formed push of the round
  // the server sums next, from this rank: its own contribution, however wrong (seen once under
  // load: "round 11: 16384 wrong" on the honest workers).
  for (uint32_t p : {0u, np - 1}) {
    for (uint32_t r : {c.rank, 0u}) {
      for (int64_t d : {-2, -1, 1000, 1001}) real("round", p, r, true, d, 0, f32, c.plan[p].count);
      for (uint64_t abs : {uint64_t{0}, ~uint64_t{0}, uint64_t{1} << 63}) {
        real("round", p, r, false, 0, abs, f32, c.plan[p].count);
      }
    }
  }
  // partition 0 / last / past the end / 2^32-1, at the current round from non-workers, or at
  // the current round from this rank where the partition does not exist.
  for (uint32_t p : {np, np + 1, 0x7FFFFFFFu, 0xFFFFFFFEu, 0xFFFFFFFFu}) {
    real("partition", p, c.rank, true, 0, 0, f32, pc);
  }
  for (uint32_t p : {0u, np - 1}) {
    for (uint32_t s : {c.n, 0xFFFFFFFFu}) real("partition", p, s, true, 0, 0, f32, c.plan[p].count);
  }
  // Wrong shapes under good headers: every dtype, counts 0/1/right-1/right+1/2x, on a partition
  // that does not exist or at a round that is not the current one.
  for (int dt = 1; dt <= 6; ++dt) {
    for (uint64_t n : {uint64_t{0}, uint64_t{1}, pc - 1, pc, pc + 1, 2 * pc}) {
      real("shape", np, c.rank, true, 0, 0, static_cast<uint8_t>(dt), n);
      real("shape", 0, c.rank, true, -1, 0, static_cast<uint8_t>(dt), n);
    }
  }
  for (BarrageFrame& f : v) {
    bool closes = f.header.size() != wire::kHeaderSize;
    if (!closes) {
      auto h = wire::DecodeHeader(f.header);
      // A kLaneHello is a transport-level frame too: a lane without an authenticator (this
      // job has no secret) treats it as a bad frame and closes the connection.
      closes = !h.ok() || h->payload_bytes != f.payload.size() ||
               h->type == wire::MsgType::kLaneHello;
    }
    f.closes = closes;
  }
  return v;
}

std::vector<BadFrame> MakeBadFrames(uint32_t job, uint32_t rank, uint32_t num_workers,
                                    uint64_t key, uint32_t num_partitions) {
  // A push that the server would refuse on its merits alone (a round far in the future), so
  // that a variant which slipped through validation could still not change any sum.
  wire::Header base;
  base.type = wire::MsgType::kPush;
  base.job = job;
  base.sender = rank;
  base.key = wire::TensorKey("bogus-job", "bogus-tensor");
  base.partition = 0;
  base.dtype = static_cast<uint8_t>(gl::DataType::kFloat32);
  base.round = 1000000;
  base.count = 4;
  base.payload_bytes = 16;
  base.cookie = kBogusCookie;
  const std::vector<std::byte> p16(16, std::byte{0x41});
  std::vector<BadFrame> v;
  auto patched = [&](std::string what, size_t off, auto value, std::vector<std::byte> payload) {
    std::vector<std::byte> h = Enc(base);
    Patch(h, off, value);
    v.push_back({std::move(what), std::move(h), std::move(payload)});
  };
  // Offsets from src/wire/frame.cc.
  patched("bad magic 0", 0, uint32_t{0}, p16);
  patched("bad magic GLK2", 0, uint32_t{0x324B4C47}, p16);
  patched("bad magic all ones", 0, uint32_t{0xFFFFFFFF}, p16);
  patched("version 0", 4, uint8_t{0}, p16);
  patched("version 2", 4, uint8_t{2}, p16);
  patched("version 255", 4, uint8_t{255}, p16);
  for (uint8_t t : {0, 11, 31, 35, 200, 255}) {
    patched("message type " + std::to_string(t), 5, t, p16);
  }
  patched("unknown flag", 6, uint16_t{0x8000}, p16);
  patched("reserved bytes set", 30, uint16_t{1}, p16);
  patched("status code out of range", 29, uint8_t{200}, p16);
  patched("dtype 0", 28, uint8_t{0}, p16);
  patched("dtype 7", 28, uint8_t{7}, p16);
  patched("count does not match the payload", 40, uint64_t{5}, p16);
  patched("count overflows", 40, uint64_t{1} << 62, p16);
  patched("payload length says 100, carries 16", 48, uint64_t{100}, p16);
  patched("payload length says 0, carries 16", 48, uint64_t{0}, p16);
  patched("payload length says 2^40", 48, uint64_t{1} << 40, p16);
  patched("payload length says 2^64-1", 48, ~uint64_t{0}, p16);
  {
    wire::Header h = base;  // length agrees with count but not with what is carried
    h.count = 8;
    h.payload_bytes = 32;
    v.push_back({"count and length agree, 16 bytes carried", Enc(h), p16});
  }
  {
    wire::Header h = base;  // a rendezvous-sized payload under a header that lies about it
    h.count = 256 * 1024;
    h.payload_bytes = 1 << 20;
    v.push_back({"2 MiB carried, header says 1 MiB", Enc(h), std::vector<std::byte>(2 << 20)});
  }
  {
    std::vector<std::byte> h = Enc(base);
    h.resize(32);
    v.push_back({"32-byte header", h, p16});
    h = Enc(base);
    h.push_back(std::byte{0});
    v.push_back({"65-byte header", h, p16});
    v.push_back({"empty header", {}, p16});
  }
  // Well-formed frames that the server must refuse.
  {
    wire::Header h = base;
    h.type = wire::MsgType::kPullResponse;
    v.push_back({"kPullResponse sent to a server", Enc(h), p16});
    h.type = wire::MsgType::kRegister;
    h.dtype = 0;
    h.count = 0;
    v.push_back({"control frame on a data lane", Enc(h), p16});
    h = base;
    h.job = job ^ 1;
    v.push_back({"push of another job", Enc(h), p16});
    h = base;
    h.sender = num_workers;
    v.push_back({"push from rank == num_workers", Enc(h), p16});
    h.sender = 0xFFFFFFFF;
    v.push_back({"push from rank 2^32-1", Enc(h), p16});
    h = base;
    v.push_back({"push of an undeclared key", Enc(h), p16});
    h.sender = 0;  // the servers answer rank 0, an honest worker, which must drop the answer
    v.push_back({"push of an undeclared key as rank 0", Enc(h), p16});
    h = base;
    h.key = key;
    h.partition = num_partitions + 5;
    v.push_back({"push of a partition that does not exist", Enc(h), p16});
    h.partition = 0xFFFFFFFF;
    v.push_back({"push of partition 2^32-1", Enc(h), p16});
    h = base;
    h.count = 1 << 20;
    h.payload_bytes = 4 << 20;
    v.push_back({"4 MiB push of an undeclared key", Enc(h), std::vector<std::byte>(4 << 20)});
  }
  return v;
}

struct Args {
  std::string scheduler, job = "default";
  uint32_t rank = 1;
  uint64_t count = 300000;
  uint64_t partition_bytes = 256 * 1024;
  int rounds = 5;
  int wait_s = 60;
  uint64_t barrage = 0;  // > 0: send at least this many barrage frames instead of the usual few
  int tail_rounds = 2;   // barrage: honest rounds after the last bad frame
};

int Run(const Args& a) {
  const uint32_t job = wire::JobHash(a.job);
  const auto join_deadline = Clock::now() + std::chrono::seconds(a.wait_s);
  auto fabric = gl::FabricOrUcx(nullptr);
  if (!fabric.ok()) {
    std::fprintf(stderr, "rogue: fabric: %s\n", fabric.status().ToString().c_str());
    return 1;
  }
  PullReceiver pulls;
  CountingReceiver push_rx, evil_rx;
  auto push_lane = (*fabric)->CreateLane("rogue push lane");
  auto pull_lane = (*fabric)->CreateLane("rogue pull lane");
  auto evil_lane = (*fabric)->CreateLane("rogue evil lane");
  if (!push_lane.ok() || !pull_lane.ok() || !evil_lane.ok()) {
    std::fprintf(stderr, "rogue: cannot create lanes\n");
    return 1;
  }
  gl::Status st = (*push_lane)->Start(&push_rx);
  if (st.ok()) st = (*pull_lane)->Start(&pulls);
  if (st.ok()) st = (*evil_lane)->Start(&evil_rx);
  if (!st.ok()) {
    std::fprintf(stderr, "rogue: start lanes: %s\n", st.ToString().c_str());
    return 1;
  }

  wire::RegisterMsg reg;
  reg.role = wire::Role::kWorker;
  reg.requested_rank = static_cast<int32_t>(a.rank);
  reg.host = "rogue";
  reg.push_address = (*push_lane)->address();
  reg.pull_address = (*pull_lane)->address();
  auto joined = gl::JoinJob(a.scheduler, job, reg, join_deadline);
  if (!joined.ok()) {
    std::fprintf(stderr, "rogue: join: %s\n", joined.status().ToString().c_str());
    return 1;
  }
  transport::ControlChannel& ch = *joined->channel;
  const wire::WelcomeMsg& welcome = joined->welcome;
  const uint32_t rank = welcome.your_id, n = welcome.num_workers;
  std::vector<const wire::Member*> servers(welcome.num_servers, nullptr);
  for (const wire::Member& m : welcome.members) {
    if (m.role == wire::Role::kServer) servers[m.id] = &m;
  }
  std::vector<transport::PeerId> server_peer(servers.size());
  for (size_t s = 0; s < servers.size(); ++s) {
    auto p = (*push_lane)->Connect(servers[s]->push_address, "server " + std::to_string(s));
    if (!p.ok()) {
      std::fprintf(stderr, "rogue: connect: %s\n", p.status().ToString().c_str());
      return 1;
    }
    server_peer[s] = *p;
  }
  std::printf("rogue: joined as rank %u of %u, %zu servers\n", rank, n, servers.size());
  std::fflush(stdout);

  // Declare, exactly as gradlink's worker does, and wait for the plan.
  const uint64_t key = wire::TensorKey(a.job, kTensor);
  {
    wire::Header h;
    h.type = wire::MsgType::kDeclare;
    h.job = job;
    h.sender = rank;
    h.key = key;
    h.dtype = static_cast<uint8_t>(gl::DataType::kFloat32);
    h.count = a.count;
    st = ch.Send(h, wire::Encode(wire::DeclareMsg{kTensor, a.partition_bytes, {}}));
    if (!st.ok()) {
      std::fprintf(stderr, "rogue: declare: %s\n", st.ToString().c_str());
      return 1;
    }
  }
  std::vector<wire::PartitionPlan> plan;
  while (plan.empty()) {
    auto f = ch.Receive(join_deadline);
    if (!f.ok()) {
      std::fprintf(stderr, "rogue: waiting for the plan: %s\n", f.status().ToString().c_str());
      return 1;
    }
    if (f->header.type != wire::MsgType::kAssign || f->header.key != key) continue;
    if (f->header.code != 0) {
      std::fprintf(stderr, "rogue: the scheduler refused the declaration (code %d)\n", f->header.code);
      return 1;
    }
    auto am = wire::DecodeAssign(f->payload, a.count, welcome.num_servers);
    if (!am.ok()) {
      std::fprintf(stderr, "rogue: bad plan: %s\n", am.status().ToString().c_str());
      return 1;
    }
    plan = am->partitions;
  }
  // From here the control channel only matters if the job is aborted.
  std::atomic<bool> stop{false};
  std::thread control([&] {
    // Heartbeats, like every member: the scheduler fails a job whose member is silent.
    gl::Liveness liveness(&ch, job, rank);
    while (!stop.load()) {
      gl::Status alive = liveness.Tick();
      if (!alive.ok()) {
        if (!stop.load()) pulls.Fail(alive);
        return;
      }
      auto f = ch.Receive(Clock::now() + std::chrono::milliseconds(100));
      if (f.ok()) liveness.Heard();
      if (!f.ok()) {
        if (f.status().code() == gl::Code::kTimeout) continue;
        if (!stop.load()) pulls.Fail(gl::PeerLost("rogue lost the scheduler: " + f.status().message()));
        return;
      }
      if (f->header.type == wire::MsgType::kAbort) {
        auto text = wire::DecodeText(f->payload);
        pulls.Fail(gl::Aborted("job aborted: " + (text.ok() ? *text : std::string("?"))));
        return;
      }
    }
  });
  auto finish = [&](int rc) {
    stop = true;
    wire::Header h;
    h.type = wire::MsgType::kGoodbye;
    h.job = job;
    h.sender = rank;
    ch.Send(h, {}, Clock::now() + std::chrono::seconds(5)).IgnoreError();
    ch.Close();
    control.join();
    (*evil_lane)->Stop();
    (*pull_lane)->Stop();
    (*push_lane)->Stop();
    std::printf("rogue: exit %d\n", rc);
    return rc;
  };

  const std::vector<BadFrame> bad =
      MakeBadFrames(job, rank, n, key, static_cast<uint32_t>(plan.size()));

  // ---- barrage mode ----
  const std::vector<BarrageFrame> catalogue =
      a.barrage > 0 ? MakeBarrage(BarrageCtx{job, rank, n, key, plan}) : std::vector<BarrageFrame>{};
  struct Shot {
    uint32_t frame, server, lane;
  };
  std::vector<Shot> schedule;
  std::vector<size_t> chunk_end;  // chunk_end[r]: schedule index where round r's frames end
  const int barrage_rounds = a.rounds - 1 - a.tail_rounds;  // frames before rounds 1..this
  if (a.barrage > 0) {
    if (barrage_rounds < 1) {
      std::fprintf(stderr, "rogue: --barrage needs --rounds >= %d\n", a.tail_rounds + 2);
      return finish(2);
    }
    const uint64_t per_pass = catalogue.size() * servers.size() * 2;
    const uint64_t passes = (a.barrage + per_pass - 1) / per_pass;
    for (uint64_t pass = 0; pass < passes; ++pass) {
      for (uint32_t f = 0; f < catalogue.size(); ++f) {
        for (uint32_t s = 0; s < servers.size(); ++s) {
          for (uint32_t lane = 0; lane < 2; ++lane) schedule.push_back({f, s, lane});
        }
      }
    }
    chunk_end.assign(a.rounds + 1, 0);
    for (int r = 1; r <= barrage_rounds; ++r) {
      chunk_end[r] = schedule.size() * r / barrage_rounds;
    }
    for (int r = barrage_rounds + 1; r <= a.rounds; ++r) chunk_end[r] = schedule.size();
    std::printf("rogue: barrage of %zu frames (%zu distinct x %zu servers x 2 lanes x %llu passes) "
                "before rounds 1..%d\n", schedule.size(), catalogue.size(), servers.size(),
                (unsigned long long)passes, barrage_rounds);
    std::fflush(stdout);
  }
  // One endpoint per server lane for frames whose header is valid (no connection is closed).
  std::vector<std::array<transport::PeerId, 2>> refused_peer(servers.size());
  if (a.barrage > 0) {
    for (size_t s = 0; s < servers.size(); ++s) {
      for (int lane = 0; lane < 2; ++lane) {
        auto p = (*evil_lane)->Connect(lane == 0 ? servers[s]->push_address : servers[s]->pull_address,
                                       "server " + std::to_string(s) + " (refused frames)");
        if (!p.ok()) {
          std::fprintf(stderr, "rogue: connect: %s\n", p.status().ToString().c_str());
          return finish(1);
        }
        refused_peer[s][lane] = *p;
      }
    }
  }
  std::map<std::string, uint64_t> by_kind;
  std::vector<uint64_t> to_server(servers.size(), 0);
  uint64_t barrage_sent = 0, barrage_closing = 0, barrage_errors = 0;
  double barrage_seconds = 0;
  size_t next_shot = 0;
  struct Window {
    std::mutex mu;
    std::condition_variable cv;
    int outstanding = 0;
    uint64_t errors = 0;
  };
  auto window = std::make_shared<Window>();
  constexpr int kWindow = 64;
  constexpr uint64_t kPerLane = 256;
  std::vector<std::unique_ptr<transport::Lane>> closing_lanes;
  uint64_t on_lane = 0;
  auto drain = [&]() -> bool {
    std::unique_lock<std::mutex> lock(window->mu);
    if (!window->cv.wait_until(lock, Clock::now() + std::chrono::seconds(30),
                               [&] { return window->outstanding == 0; })) {
      std::fprintf(stderr, "rogue: %d barrage sends did not complete in 30 s\n",
                   window->outstanding);
      return false;
    }
    barrage_errors = window->errors;
    return true;
  };
  auto send_barrage = [&](int round) -> bool {
    const auto t0 = Clock::now();
    const size_t end = chunk_end[round];
    const size_t first = next_shot;
    for (; next_shot < end; ++next_shot) {
      const Shot& shot = schedule[next_shot];
      const BarrageFrame& f = catalogue[shot.frame];
      transport::PeerId peer;
      transport::Lane* lane = evil_lane->get();
      if (f.closes) {
        // Our side of a connection that the server closed lingers (UCX keepalive notices it
        // after 20 s), holding a socket at both ends: rotate the lane (one ucp worker) that the
        // closing frames go on every kPerLane frames, and stop the lane two generations back,
        // whose frames the servers have long since taken, so no process holds thousands of fds.
        if (closing_lanes.empty() || on_lane >= kPerLane) {
          if (!drain()) return false;
          auto l = (*fabric)->CreateLane("rogue closing lane " + std::to_string(closing_lanes.size()));
          if (!l.ok() || !(*l)->Start(&evil_rx).ok()) {
            std::fprintf(stderr, "rogue: cannot create a closing lane\n");
            return false;
          }
          closing_lanes.push_back(std::move(*l));
          if (closing_lanes.size() >= 3) closing_lanes[closing_lanes.size() - 3].reset();
          on_lane = 0;
        }
        lane = closing_lanes.back().get();
        ++on_lane;
        auto p = lane->Connect(
            shot.lane == 0 ? servers[shot.server]->push_address : servers[shot.server]->pull_address,
            "server " + std::to_string(shot.server) + " (closing frame)");
        if (!p.ok()) {
          std::fprintf(stderr, "rogue: barrage connect: %s\n", p.status().ToString().c_str());
          return false;
        }
        peer = *p;
      } else {
        peer = refused_peer[shot.server][shot.lane];
      }
      std::vector<std::byte> header = f.header;
      if (f.round_relative) Patch(header, 32, static_cast<uint64_t>(round + f.round_delta));
      {
        std::unique_lock<std::mutex> lock(window->mu);
        if (!window->cv.wait_until(lock, Clock::now() + std::chrono::seconds(30),
                                   [&] { return window->outstanding < kWindow; })) {
          std::fprintf(stderr, "rogue: barrage sends stuck\n");
          return false;
        }
        window->outstanding++;
      }
      lane->SendRawForTesting(peer, header, f.payload, [w = window](const gl::Status& s2) {
        std::lock_guard<std::mutex> lock(w->mu);
        w->outstanding--;
        if (!s2.ok()) w->errors++;
        w->cv.notify_all();
      });
      ++barrage_sent;
      if (f.closes) ++barrage_closing;
      by_kind[f.kind]++;
      to_server[servers[shot.server]->id]++;
    }
    if (!drain()) return false;
    const double secs = std::chrono::duration<double>(Clock::now() - t0).count();
    barrage_seconds += secs;
    if (end > first) {
      std::printf("rogue: before round %d: %zu barrage frames in %.2f s (%llu so far)\n", round,
                  end - first, secs, (unsigned long long)barrage_sent);
      std::fflush(stdout);
    }
    return true;
  };
  uint64_t bad_sent = 0, bad_send_errors = 0;
  // Each bad frame goes on a fresh endpoint: the server closes the connection a bad frame
  // came on, and we want every frame to reach it.
  auto throw_bad_frames = [&](int round) -> bool {
    for (size_t s = 0; s < servers.size(); ++s) {
      for (int lane = 0; lane < 2; ++lane) {
        const auto& addr = lane == 0 ? servers[s]->push_address : servers[s]->pull_address;
        for (const BadFrame& b : bad) {
          auto peer = (*evil_lane)->Connect(addr, "server " + std::to_string(s) + " (bad frames)");
          if (!peer.ok()) {
            std::fprintf(stderr, "rogue: evil connect: %s\n", peer.status().ToString().c_str());
            return false;
          }
          std::mutex mu;
          std::condition_variable cv;
          bool done = false;
          gl::Status result;
          (*evil_lane)->SendRawForTesting(*peer, b.header, b.payload, [&](const gl::Status& s2) {
            std::lock_guard<std::mutex> lock(mu);
            done = true;
            result = s2;
            cv.notify_all();
          });
          std::unique_lock<std::mutex> lock(mu);
          if (!cv.wait_until(lock, Clock::now() + std::chrono::seconds(10), [&] { return done; })) {
            std::fprintf(stderr, "rogue: sending bad frame '%s' did not complete in 10 s\n",
                         b.what.c_str());
            return false;
          }
          ++bad_sent;
          if (!result.ok()) ++bad_send_errors;
        }
      }
    }
    std::printf("rogue: before round %d: %zu bad frames to each lane of %zu servers\n", round,
                bad.size(), servers.size());
    std::fflush(stdout);
    return true;
  };

  std::vector<float> data(a.count), result(a.count);
  uint64_t wrong_total = 0;
  for (int round = 0; round < a.rounds; ++round) {
    if (a.barrage > 0) {
      if (!send_barrage(round)) return finish(1);
    } else if (!throw_bad_frames(round)) {
      return finish(1);
    }
    for (uint64_t j = 0; j < a.count; ++j) data[j] = static_cast<float>(Value(j, rank, round, 0));
    std::fill(result.begin(), result.end(), -1000.0f);
    std::mutex send_mu;
    gl::Status send_failure;
    for (uint32_t p = 0; p < plan.size(); ++p) {
      wire::Header h;
      h.type = wire::MsgType::kPush;
      h.job = job;
      h.sender = rank;
      h.key = key;
      h.partition = p;
      h.dtype = static_cast<uint8_t>(gl::DataType::kFloat32);
      h.round = static_cast<uint64_t>(round);
      h.count = plan[p].count;
      h.payload_bytes = plan[p].count * 4;
      h.cookie = (uint64_t{1} << 40) | (static_cast<uint64_t>(round) << 20) | p;
      PullReceiver::Expect e;
      e.key = key;
      e.partition = p;
      e.round = static_cast<uint64_t>(round);
      e.count = plan[p].count;
      e.dest = std::as_writable_bytes(std::span(result).subspan(plan[p].offset, plan[p].count));
      pulls.ExpectReply(h.cookie, std::move(e));
      auto payload = std::as_bytes(std::span(data).subspan(plan[p].offset, plan[p].count));
      (*push_lane)->Send(server_peer[plan[p].server], h, payload, [&](const gl::Status& s2) {
        if (!s2.ok()) pulls.Fail(s2);
      });
    }
    st = pulls.WaitAll(Clock::now() + std::chrono::seconds(a.wait_s));
    if (!st.ok()) {
      std::fprintf(stderr, "rogue: round %d: %s\n", round, st.ToString().c_str());
      return finish(1);
    }
    uint64_t wrong = 0;
    for (uint64_t j = 0; j < a.count; ++j) {
      int64_t sum = 0;
      for (uint32_t r = 0; r < n; ++r) sum += Value(j, r, round, 0);
      if (result[j] != static_cast<float>(sum)) ++wrong;
    }
    if (wrong != 0) std::fprintf(stderr, "rogue: round %d: %llu wrong elements\n", round, (unsigned long long)wrong);
    wrong_total += wrong;
  }
  std::printf("rogue: %d rounds, %llu wrong elements; %llu bad frames sent (%llu sends failed), "
              "%llu server answers to them dropped, %llu frames on lanes that expect none\n",
              a.rounds, (unsigned long long)wrong_total, (unsigned long long)bad_sent,
              (unsigned long long)bad_send_errors, (unsigned long long)pulls.ignored(),
              (unsigned long long)(push_rx.frames_.load() + evil_rx.frames_.load()));
  if (a.barrage > 0) {
    std::printf("rogue: barrage: %llu bad frames sent in %.2f s (%llu on fresh endpoints that the "
                "server closes, %llu refused on %zu shared endpoints; %llu sends failed)\n",
                (unsigned long long)barrage_sent, barrage_seconds,
                (unsigned long long)barrage_closing,
                (unsigned long long)(barrage_sent - barrage_closing), refused_peer.size() * 2,
                (unsigned long long)barrage_errors);
    for (auto& [kind, c] : by_kind) {
      std::printf("rogue: barrage kind %-16s %llu\n", kind.c_str(), (unsigned long long)c);
    }
    for (size_t s = 0; s < to_server.size(); ++s) {
      std::printf("rogue: barrage to server %zu: %llu\n", s, (unsigned long long)to_server[s]);
    }
    std::fflush(stdout);
    if (barrage_sent < a.barrage) {
      std::fprintf(stderr, "rogue: only %llu barrage frames sent\n", (unsigned long long)barrage_sent);
      return finish(1);
    }
  }
  if (pulls.unexpected() != 0) {
    std::fprintf(stderr, "rogue: %llu unexpected frames on the pull lane\n",
                 (unsigned long long)pulls.unexpected());
    return finish(1);
  }
  return finish(wrong_total == 0 ? 0 : 3);
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"gradlink integration test: a worker that also sends bad frames to the servers"};
  Args a;
  app.add_option("--scheduler", a.scheduler)->required();
  app.add_option("--job", a.job);
  app.add_option("--rank", a.rank);
  app.add_option("--count", a.count);
  app.add_option("--partition-bytes", a.partition_bytes);
  app.add_option("--rounds", a.rounds);
  app.add_option("--wait-s", a.wait_s);
  app.add_option("--barrage", a.barrage, "send at least this many barrage frames");
  app.add_option("--tail-rounds", a.tail_rounds, "barrage: honest rounds after the last bad frame");
  CLI11_PARSE(app, argc, argv);
  return Run(a);
}
