// Fuzz target: the server's request handling on an in-memory store (server::PartitionState).
// Four partitions of different dtypes, element counts and worker counts receive a sequence of
// operations decoded from the input: BeginPush with arbitrary header fields, EndPush ok/failed
// with the staging buffer filled from input bytes, Progress, SendDone, MarkGone. A reference
// model written from partition_state.h predicts every answer, and the target checks:
//   - BeginPush accepts exactly the pushes the model accepts, with a span of count * size bytes;
//   - Progress completes a round exactly when every rank has staged or failed and the slot's
//     previous sends are done; the round numbers count up by one; the slot is round % 2;
//   - a completion is OK exactly when no push failed/mismatched, no rank left, and all flags
//     agree; then its result has count * size bytes and, for fp32/int32, equals a scalar sum in
//     rank order (averaged when the flag says so); the cookies echo the pushes;
//   - SendDone/MarkGone return what the model says; EndPush asks for the engine when it
//     completes the round's pushes (and never when it changed nothing).
//
// Input layout: byte 0 picks the reducer ISA (auto/scalar/AVX2/AVX-512, when the CPU has it);
// then operations, each an op byte (partition = op >> 4 & 3, kind = op & 15 % 6) and operands:
//   0 BeginPush  [m][flags][cookie] (+ [round u8] when m>>3&3 == 3, + [dtype] when m&0x20,
//                + [count u8] when m&0x40); sender = m & 7; round = current + {0,+1,-1,raw}
//   1 EndPush ok [rank]  staging filled from the next count*size input bytes (zeros past the end)
//   2 EndPush failed [rank]
//   3 Progress
//   4 SendDone [slot % 3]
//   5 MarkGone [rank]
#include <algorithm>
#include <array>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <optional>
#include <span>
#include <vector>

#include "gradlink/tensor.h"
#include "server/partition_state.h"
#include "reduce/reduce.h"
#include "wire/frame.h"

namespace {

namespace srv = gradlink::server;
using gradlink::DataType;

void Check(bool ok, const char* what) {
  if (!ok) {
    std::fprintf(stderr, "server_fuzz: invariant violated: %s\n", what);
    std::abort();
  }
}

// GRADLINK_FUZZ_TRACE=1: print every completion (to check what the seeds reach).
bool Trace() {
  static const bool on = std::getenv("GRADLINK_FUZZ_TRACE") != nullptr;
  return on;
}

struct Config {
  DataType dtype;
  uint64_t count;
  uint32_t workers;
};
constexpr std::array<Config, 4> kConfigs = {{
    {DataType::kFloat32, 5, 3},
    {DataType::kInt32, 3, 1},
    {DataType::kFloat16, 4, 2},
    {DataType::kInt32, 7, 4},
}};

enum class St { kFree, kReceiving, kStaged, kFailed };

struct Model {
  Config cfg;
  size_t bytes;  // count * size
  uint64_t round = 0;
  bool failure = false;
  std::vector<St> stage;
  std::vector<bool> gone;
  std::vector<uint16_t> flags;
  std::vector<uint64_t> cookie;
  std::vector<bool> cookie_set;         // cookie recorded this round
  std::vector<std::vector<std::byte>> data;  // staged payload per rank
  std::vector<std::span<std::byte>> span;    // the staging span BeginPush gave
  uint32_t pending[2] = {0, 0};

  explicit Model(const Config& c)
      : cfg(c),
        bytes(c.count * gradlink::DataTypeSize(c.dtype)),
        stage(c.workers, St::kFree),
        gone(c.workers, false),
        flags(c.workers, 0),
        cookie(c.workers, 0),
        cookie_set(c.workers, false),
        data(c.workers),
        span(c.workers) {}

  void FailRank(uint32_t r) {
    stage[r] = St::kFailed;
    failure = true;
  }
};

class Input {
 public:
  Input(const uint8_t* d, size_t n) : d_(d), n_(n) {}
  bool empty() const { return i_ >= n_; }
  uint8_t U8() { return i_ < n_ ? d_[i_++] : 0; }
  void Fill(std::span<std::byte> out) {
    const size_t k = std::min(out.size(), n_ - std::min(i_, n_));
    if (k > 0) std::memcpy(out.data(), d_ + i_, k);
    std::fill(out.begin() + k, out.end(), std::byte{0});
    i_ += k;
  }

 private:
  const uint8_t* d_;
  size_t n_;
  size_t i_ = 0;
};

template <typename T>
T Get(const std::vector<std::byte>& v, size_t i) {
  T x;
  std::memcpy(&x, v.data() + i * sizeof(T), sizeof(T));
  return x;
}

// The scalar reference: rank-order sum, then the average when asked. Only fp32 and int32.
void CheckResult(const Model& m, std::span<const std::byte> result) {
  const uint32_t w = m.cfg.workers;
  const bool avg = m.flags[0] & gradlink::wire::kFlagAverage;
  for (size_t i = 0; i < m.cfg.count; ++i) {
    if (m.cfg.dtype == DataType::kFloat32) {
      float acc = Get<float>(m.data[0], i);
      for (uint32_t r = 1; r < w; ++r) acc = acc + Get<float>(m.data[r], i);
      if (avg) acc = acc / static_cast<float>(w);
      float got;
      std::memcpy(&got, result.data() + 4 * i, 4);
      if (std::isnan(acc) || std::isnan(got)) {
        // Which NaN payload survives NaN + NaN depends on operand order (reduce.cc).
        Check(std::isnan(acc) && std::isnan(got), "fp32 result NaN-ness differs from reference");
      } else {
        Check(std::memcmp(&acc, &got, 4) == 0, "fp32 result differs from the rank-order sum");
      }
    } else if (m.cfg.dtype == DataType::kInt32) {
      uint32_t acc = Get<uint32_t>(m.data[0], i);
      for (uint32_t r = 1; r < w; ++r) acc += Get<uint32_t>(m.data[r], i);
      int32_t want = static_cast<int32_t>(acc);
      if (avg) want = want / static_cast<int32_t>(w);
      int32_t got;
      std::memcpy(&got, result.data() + 4 * i, 4);
      Check(want == got, "int32 result differs from the rank-order sum");
    }
  }
}

void BeginPush(srv::PartitionState& ps, Model& m, Input& in) {
  const uint8_t mb = in.U8();
  gradlink::wire::Header h;
  h.type = gradlink::wire::MsgType::kPush;
  h.key = ps.key();
  h.partition = ps.partition();
  h.sender = mb & 7;
  h.flags = in.U8() & 3;
  h.cookie = 0x1000u + in.U8();
  switch (mb >> 3 & 3) {
    case 0: h.round = m.round; break;
    case 1: h.round = m.round + 1; break;
    case 2: h.round = m.round - 1; break;  // wraps at round 0: a huge round
    case 3: h.round = in.U8(); break;
  }
  h.dtype = (mb & 0x20) ? in.U8() : static_cast<uint8_t>(m.cfg.dtype);
  h.count = (mb & 0x40) ? in.U8() : m.cfg.count;
  if (mb & 0x80) h.count |= uint64_t{1} << 63;  // huge counts
  const size_t size = gradlink::DataTypeSize(m.cfg.dtype);
  h.payload_bytes = h.count * size;

  bool run_engine = true;
  auto span = ps.BeginPush(h, &run_engine);
  const uint32_t r = h.sender;
  if (r >= m.cfg.workers || h.round != m.round || m.stage[r] != St::kFree) {
    Check(!span.ok(), "BeginPush accepted a bad sender, round, or a second push");
    Check(!run_engine, "BeginPush asked for the engine on a dropped push");
    return;
  }
  m.cookie[r] = h.cookie;
  m.cookie_set[r] = true;
  m.flags[r] = h.flags;
  if (h.dtype != static_cast<uint8_t>(m.cfg.dtype) || h.count != m.cfg.count) {
    Check(!span.ok(), "BeginPush accepted a push that disagrees with the declaration");
    Check(span.status().code() == gradlink::Code::kMismatch, "mismatch is not kMismatch");
    Check(run_engine, "a mismatched push did not ask for the engine");
    m.FailRank(r);
    return;
  }
  Check(span.ok(), "BeginPush refused a valid push");
  Check(!run_engine, "a valid push asked for the engine");
  Check(span->size() == m.bytes, "staging span is not count * size bytes");
  m.span[r] = *span;
  m.stage[r] = St::kReceiving;
}

void EndPush(srv::PartitionState& ps, Model& m, Input& in, bool ok) {
  const uint32_t r = in.U8() % (m.cfg.workers + 1);  // sometimes out of range
  const bool effective = r < m.cfg.workers && m.stage[r] == St::kReceiving;
  if (effective) {
    if (ok) {
      in.Fill(m.span[r]);  // the payload lands in the staging buffer
      m.data[r].assign(m.span[r].begin(), m.span[r].end());
      m.stage[r] = St::kStaged;
    } else {
      m.FailRank(r);
    }
  }
  const bool runnable = ps.EndPush(r, ok);
  // A false lets the server skip waking the engine, so it must never hide a completable round.
  bool all_in = true;
  for (St s : m.stage) all_in = all_in && (s == St::kStaged || s == St::kFailed);
  Check(runnable || !effective || !all_in,
        "EndPush said there is nothing to do, but it completed the round");
  Check(!runnable || effective, "EndPush that changed nothing asked for the engine");
}

void Progress(srv::PartitionState& ps, Model& m) {
  const std::optional<srv::Completion> c = ps.Progress();
  const uint32_t slot = static_cast<uint32_t>(m.round % 2);
  bool all_in = true;
  for (St s : m.stage) all_in = all_in && (s == St::kStaged || s == St::kFailed);
  const bool expect = all_in && m.pending[slot] == 0;
  Check(c.has_value() == expect, "Progress completed (or not) against the model");
  if (!c) return;
  Check(c->round == m.round, "completion round is not the current round");
  Check(c->slot == slot, "completion slot is not round % 2");
  Check(c->cookies.size() == m.cfg.workers, "one cookie per rank");
  for (uint32_t r = 0; r < m.cfg.workers; ++r) {
    if (m.cookie_set[r]) Check(c->cookies[r] == m.cookie[r], "cookie not echoed");
  }
  bool flags_agree = true;
  for (uint16_t f : m.flags) flags_agree = flags_agree && f == m.flags[0];
  const bool expect_ok = !m.failure && flags_agree;
  Check(c->status.ok() == expect_ok, "completion status disagrees with the model");
  if (Trace()) {
    std::fprintf(stderr, "partition %u round %llu: %s\n", ps.partition(),
                 static_cast<unsigned long long>(m.round), c->status.ToString().c_str());
  }
  if (expect_ok) {
    Check(c->result.size() == m.bytes, "result is not count * size bytes");
    CheckResult(m, c->result);
  } else {
    Check(c->status.code() != gradlink::Code::kOk, "failed completion with code kOk");
  }
  // The next round.
  m.pending[slot] = m.cfg.workers;
  ++m.round;
  Check(ps.round() == m.round, "round did not advance by one");
  m.failure = false;
  std::fill(m.stage.begin(), m.stage.end(), St::kFree);
  std::fill(m.cookie_set.begin(), m.cookie_set.end(), false);
  for (uint32_t r = 0; r < m.cfg.workers; ++r) {
    if (m.gone[r]) m.FailRank(r);
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 1) return 0;
  Input in(data, size);
  static const gradlink::reduce::ReduceIsa kIsas[] = {gradlink::reduce::ReduceIsa::kAuto, gradlink::reduce::ReduceIsa::kScalar,
                                         gradlink::reduce::ReduceIsa::kAvx2, gradlink::reduce::ReduceIsa::kAvx512};
  if (!gradlink::reduce::SetReduceIsaForTesting(kIsas[in.U8() % 4])) {
    gradlink::reduce::SetReduceIsaForTesting(gradlink::reduce::ReduceIsa::kAuto);
  }

  std::vector<std::unique_ptr<srv::PartitionState>> parts;
  std::vector<Model> models;
  for (size_t i = 0; i < kConfigs.size(); ++i) {
    const Config& c = kConfigs[i];
    parts.push_back(std::make_unique<srv::PartitionState>(0xabc0 + i, static_cast<uint32_t>(i),
                                                          "t" + std::to_string(i), c.dtype,
                                                          c.count, c.workers));
    models.emplace_back(c);
  }

  for (int ops = 0; !in.empty() && ops < 256; ++ops) {
    const uint8_t op = in.U8();
    const size_t p = (op >> 4) & 3;
    srv::PartitionState& ps = *parts[p];
    Model& m = models[p];
    const uint64_t before = ps.round();
    switch ((op & 15) % 6) {
      case 0: BeginPush(ps, m, in); break;
      case 1: EndPush(ps, m, in, true); break;
      case 2: EndPush(ps, m, in, false); break;
      case 3: Progress(ps, m); break;
      case 4: {
        const uint32_t slot = in.U8() % 3;
        const bool want = slot <= 1 && m.pending[slot] == 1;
        if (slot <= 1 && m.pending[slot] > 0) --m.pending[slot];
        Check(ps.SendDone(slot) == want, "SendDone return disagrees with the model");
        break;
      }
      case 5: {
        const uint32_t r = in.U8() % (m.cfg.workers + 1);
        const bool want = r < m.cfg.workers && !m.gone[r];
        if (want) {
          m.gone[r] = true;
          if (m.stage[r] == St::kFree) m.FailRank(r);
        }
        Check(ps.MarkGone(r) == want, "MarkGone return disagrees with the model");
        break;
      }
    }
    Check(ps.round() >= before, "round went backwards");
    Check(ps.round() == m.round, "round disagrees with the model");
  }
  return 0;
}
