#include "wire/messages.h"

#include <bit>
#include <iomanip>
#include <sstream>

#include "wire/codec.h"
#include "wire/frame.h"

namespace gradlink::wire {
namespace {

Status Bad(std::string_view what) { return ProtocolError("malformed " + std::string(what)); }

void PutMember(Writer& w, Role role, uint32_t id, const std::string& host,
               const std::vector<std::byte>& push, const std::vector<std::byte>& pull) {
  w.U8(static_cast<uint8_t>(role));
  w.U32(id);
  w.Str(host);
  w.Bytes(push);
  w.Bytes(pull);
}

bool GetRole(Reader& r, Role* role) {
  uint8_t v;
  if (!r.U8(&v) || (v != 1 && v != 2)) return false;
  *role = static_cast<Role>(v);
  return true;
}

void PutSpec(Writer& w, const CollectiveSpec& s) {
  w.U8(static_cast<uint8_t>(s.kind));
  w.U8(static_cast<uint8_t>(s.op));
  w.U32(s.root);
  w.U32(static_cast<uint32_t>(s.counts.size()));
  for (uint64_t c : s.counts) w.U64(c);
  w.U32(static_cast<uint32_t>(s.group.size()));
  for (uint32_t r : s.group) w.U32(r);
}

bool GetSpec(Reader& r, CollectiveSpec* s) {
  uint8_t kind, op;
  uint32_t n;
  if (!r.U8(&kind) || kind > static_cast<uint8_t>(Collective::kAlltoall) || !r.U8(&op) ||
      op > static_cast<uint8_t>(ReduceOp::kProduct) || !r.U32(&s->root) || !r.U32(&n) ||
      n > kMaxSpecCounts || r.remaining() / 8 < n) {
    return false;
  }
  s->kind = static_cast<Collective>(kind);
  s->op = static_cast<ReduceOp>(op);
  s->counts.resize(n);
  for (uint64_t& c : s->counts) {
    if (!r.U64(&c)) return false;
  }
  uint32_t g;
  if (!r.U32(&g) || g > kMaxMembers || r.remaining() / 4 < g) return false;
  s->group.resize(g);
  for (uint32_t& rank : s->group) {
    if (!r.U32(&rank)) return false;
  }
  return true;
}

}  // namespace

std::string ServerWeightError(double w) {
  std::ostringstream o;
  o << "weight " << std::setprecision(17) << w << " is not a finite number in ["
    << std::setprecision(6) << kMinServerWeight << ", " << kMaxServerWeight << "]";
  return o.str();
}

std::vector<std::byte> Encode(const RegisterMsg& m) {
  Writer w;
  w.U8(static_cast<uint8_t>(m.role));
  w.I32(m.requested_rank);
  w.Str(m.host);
  w.Bytes(m.push_address);
  w.Bytes(m.pull_address);
  w.U64(std::bit_cast<uint64_t>(m.weight));
  w.U64(m.memory_budget);
  w.U64(m.available_memory);
  w.U8(m.standby ? 1 : 0);
  w.U16(m.metrics_port);
  if (m.resume.has_value()) {
    const ResumeState& st = *m.resume;
    w.U8(1);
    w.U32(st.keys);
    w.U64(st.barriers_entered);
    w.U64(st.barriers_released);
    w.U32(st.server_ids);
    w.U32(static_cast<uint32_t>(st.lost_servers.size()));
    for (uint32_t id : st.lost_servers) w.U32(id);
  }
  return w.Take();
}

Result<RegisterMsg> DecodeRegister(std::span<const std::byte> b) {
  Reader r(b);
  RegisterMsg m;
  uint64_t weight_bits;
  uint8_t standby;
  if (!GetRole(r, &m.role) || !r.I32(&m.requested_rank) || !r.Str(&m.host, kMaxNameLength) ||
      !r.Bytes(&m.push_address, kMaxAddressLength) ||
      !r.Bytes(&m.pull_address, kMaxAddressLength) || !r.U64(&weight_bits) || !r.U64(&m.memory_budget) ||
      !r.U64(&m.available_memory) || !r.U8(&standby) || !r.U16(&m.metrics_port)) {
    return Bad("register message");
  }
  if (!r.Done()) {
    // A member resuming with a restarted scheduler.
    ResumeState st;
    uint8_t tag;
    uint32_t lost;
    if (!r.U8(&tag) || tag != 1 || !r.U32(&st.keys) || !r.U64(&st.barriers_entered) ||
        !r.U64(&st.barriers_released) || !r.U32(&st.server_ids) ||
        st.server_ids > kMaxMembers + kMaxServersJoined || !r.U32(&lost) ||
        lost > st.server_ids || r.remaining() / 4 < lost) {
      return Bad("register message (resume state)");
    }
    st.lost_servers.resize(lost);
    for (uint32_t i = 0; i < lost; ++i) {
      if (!r.U32(&st.lost_servers[i]) || st.lost_servers[i] >= st.server_ids ||
          (i > 0 && st.lost_servers[i] <= st.lost_servers[i - 1])) {
        return Bad("register message (resume state: lost servers)");
      }
    }
    if (!r.Done() || m.requested_rank < 0 || st.barriers_released > st.barriers_entered ||
        (m.role == Role::kServer && (st.keys != 0 || st.server_ids != 0))) {
      return Bad("register message (resume state)");
    }
    m.resume = std::move(st);
  }
  if (m.requested_rank < -1) return Bad("register message (negative rank)");
  if (standby > 1 || (standby == 1 && m.role != Role::kServer)) {
    return Bad("register message (standby flag " + std::to_string(standby) + " for a " +
               (m.role == Role::kServer ? "server" : "worker") + ")");
  }
  m.standby = standby == 1;
  m.weight = std::bit_cast<double>(weight_bits);
  if (!IsValidServerWeight(m.weight)) {
    return Bad("register message (" + ServerWeightError(m.weight) + ")");
  }
  return m;
}

std::vector<std::byte> Encode(const WelcomeMsg& m) {
  Writer w;
  w.U32(m.your_id);
  w.U32(m.num_workers);
  w.U32(m.num_servers);
  w.U32(static_cast<uint32_t>(m.members.size()));
  for (const Member& x : m.members) PutMember(w, x.role, x.id, x.host, x.push_address, x.pull_address);
  w.U64(m.instance);
  return w.Take();
}

Result<WelcomeMsg> DecodeWelcome(std::span<const std::byte> b) {
  Reader r(b);
  WelcomeMsg m;
  uint32_t n;
  if (!r.U32(&m.your_id) || !r.U32(&m.num_workers) || !r.U32(&m.num_servers) || !r.U32(&n) ||
      n > kMaxMembers || uint64_t{m.num_workers} + m.num_servers != n) {
    return Bad("welcome message");
  }
  m.members.resize(n);
  std::vector<bool> seen_worker(m.num_workers, false), seen_server(m.num_servers, false);
  for (Member& x : m.members) {
    if (!GetRole(r, &x.role) || !r.U32(&x.id) || !r.Str(&x.host, kMaxNameLength) ||
        !r.Bytes(&x.push_address, kMaxAddressLength) ||
        !r.Bytes(&x.pull_address, kMaxAddressLength)) {
      return Bad("welcome message member");
    }
    const uint32_t limit = x.role == Role::kWorker ? m.num_workers : m.num_servers;
    if (x.id >= limit) return Bad("welcome message (member id out of range)");
    std::vector<bool>& seen = x.role == Role::kWorker ? seen_worker : seen_server;
    if (seen[x.id]) return Bad("welcome message (duplicate member id)");
    seen[x.id] = true;
  }
  if (!r.U64(&m.instance)) return Bad("welcome message (no instance)");
  if (!r.Done()) return Bad("welcome message (trailing bytes)");
  return m;
}

std::vector<std::byte> EncodeMember(const Member& m) {
  Writer w;
  PutMember(w, m.role, m.id, m.host, m.push_address, m.pull_address);
  return w.Take();
}

Result<Member> DecodeMember(std::span<const std::byte> b) {
  Reader r(b);
  Member x;
  if (!GetRole(r, &x.role) || !r.U32(&x.id) || !r.Str(&x.host, kMaxNameLength) ||
      !r.Bytes(&x.push_address, kMaxAddressLength) ||
      !r.Bytes(&x.pull_address, kMaxAddressLength) || !r.Done()) {
    return Bad("member entry");
  }
  return x;
}

std::vector<std::byte> Encode(const DeclareMsg& m) {
  Writer w;
  w.Str(m.name);
  w.U64(m.partition_bytes);
  w.U32(static_cast<uint32_t>(m.shape.size()));
  for (uint64_t d : m.shape) w.U64(d);
  w.U8(m.mode);
  PutSpec(w, m.spec);
  return w.Take();
}

Result<DeclareMsg> DecodeDeclare(std::span<const std::byte> b) {
  Reader r(b);
  DeclareMsg m;
  uint32_t dims = 0;
  if (!r.Str(&m.name, kMaxNameLength) || !r.U64(&m.partition_bytes) ||
      !r.U32(&dims) || dims > kMaxShapeDims) {
    return Bad("declare message");
  }
  m.shape.resize(dims);
  for (uint64_t& d : m.shape) {
    if (!r.U64(&d)) return Bad("declare message (shape)");
  }
  if (!r.U8(&m.mode) || m.mode > kMaxAggregationMode) return Bad("declare message (aggregation mode)");
  if (!GetSpec(r, &m.spec)) return Bad("declare message (collective)");
  if (!r.Done()) return Bad("declare message (trailing bytes)");
  return m;
}

std::vector<std::byte> Encode(const AssignMsg& m) {
  Writer w;
  w.Str(m.name);
  w.U32(static_cast<uint32_t>(m.partitions.size()));
  for (const PartitionPlan& p : m.partitions) {
    w.U64(p.offset);
    w.U64(p.count);
    w.U32(p.server);
  }
  w.U8(m.mode);
  PutSpec(w, m.spec);
  return w.Take();
}

Result<AssignMsg> DecodeAssign(std::span<const std::byte> b, uint64_t total_count,
                               uint32_t num_servers) {
  Reader r(b);
  AssignMsg m;
  uint32_t n;
  if (!r.Str(&m.name, kMaxNameLength) || !r.U32(&n) || n > kMaxPartitions) {
    return Bad("assign message");
  }
  // Each partition takes 20 bytes: check before allocating.
  if (r.remaining() / 20 < n) return Bad("assign message (truncated)");
  m.partitions.resize(n);
  uint64_t next = 0;
  for (PartitionPlan& p : m.partitions) {
    if (!r.U64(&p.offset) || !r.U64(&p.count) || !r.U32(&p.server)) return Bad("assign message");
    if (p.offset != next || p.count == 0 || p.count > total_count - next ||
        p.server >= num_servers) {
      return Bad("assign message (partitions do not tile the tensor)");
    }
    next += p.count;
  }
  if (next != total_count) return Bad("assign message (coverage)");
  if (!r.U8(&m.mode) || m.mode > kMaxAggregationMode) return Bad("assign message (aggregation mode)");
  if (!GetSpec(r, &m.spec)) return Bad("assign message (collective)");
  if (!r.Done()) return Bad("assign message (trailing bytes)");
  return m;
}

std::vector<std::byte> Encode(const ResumeKeyMsg& m) {
  Writer w;
  w.Bytes(Encode(m.declare));
  w.U8(static_cast<uint8_t>(m.state));
  if (m.state == ResumeKeyMsg::Plan::kPlanned) w.Bytes(Encode(m.plan));
  if (m.state == ResumeKeyMsg::Plan::kRefused) {
    w.U8(m.refusal);
    w.Str(std::string_view(m.refusal_text).substr(0, kMaxMessageLength));
  }
  return w.Take();
}

Result<ResumeKeyMsg> DecodeResumeKey(std::span<const std::byte> b, uint64_t total_count,
                                     uint32_t num_servers) {
  Reader r(b);
  ResumeKeyMsg m;
  std::vector<std::byte> part;
  uint8_t state;
  if (!r.Bytes(&part, static_cast<uint32_t>(kMaxControlPayload)) || !r.U8(&state) ||
      state > static_cast<uint8_t>(ResumeKeyMsg::Plan::kRefused)) {
    return Bad("resume-key message");
  }
  GL_ASSIGN_OR_RETURN(m.declare, DecodeDeclare(part));
  m.state = static_cast<ResumeKeyMsg::Plan>(state);
  if (m.state == ResumeKeyMsg::Plan::kPlanned) {
    if (!r.Bytes(&part, static_cast<uint32_t>(kMaxControlPayload))) {
      return Bad("resume-key message (plan)");
    }
    GL_ASSIGN_OR_RETURN(m.plan, DecodeAssign(part, total_count, num_servers));
    if (m.plan.name != m.declare.name || m.plan.spec != m.declare.spec) {
      return Bad("resume-key message (a plan for another tensor than declared)");
    }
  } else if (m.state == ResumeKeyMsg::Plan::kRefused) {
    if (!r.U8(&m.refusal) || m.refusal == 0 || m.refusal > kMaxCode ||
        !r.Str(&m.refusal_text, kMaxMessageLength)) {
      return Bad("resume-key message (refusal)");
    }
  }
  if (!r.Done()) return Bad("resume-key message (trailing bytes)");
  return m;
}

std::vector<std::byte> EncodeText(std::string_view text) {
  Writer w;
  w.Str(text.substr(0, kMaxMessageLength));
  return w.Take();
}

std::vector<std::byte> Encode(const JoinMsg& m) {
  Writer w;
  w.U64(m.barriers);
  w.U32(static_cast<uint32_t>(m.rounds.size()));
  for (const auto& [key, round] : m.rounds) {
    w.U64(key);
    w.U64(round);
  }
  return w.Take();
}

Result<JoinMsg> DecodeJoin(std::span<const std::byte> b) {
  Reader r(b);
  JoinMsg m;
  uint32_t n;
  if (!r.U64(&m.barriers) || !r.U32(&n) || n > kMaxJoinKeys || r.remaining() / 16 < n) {
    return Bad("join message");
  }
  m.rounds.resize(n);
  for (uint32_t i = 0; i < n; ++i) {
    if (!r.U64(&m.rounds[i].first) || !r.U64(&m.rounds[i].second)) return Bad("join message");
    if (i > 0 && m.rounds[i].first <= m.rounds[i - 1].first) {
      return ProtocolError("malformed join message: keys not strictly ascending");
    }
  }
  if (!r.Done()) return Bad("join message");
  return m;
}

std::vector<std::byte> Encode(const std::vector<StalledRound>& m) {
  Writer w;
  w.U32(static_cast<uint32_t>(m.size()));
  for (const StalledRound& s : m) {
    w.U64(s.key);
    w.U32(s.partition);
    w.U64(s.round);
    w.U64(s.age_ms);
    for (const std::vector<uint32_t>* ranks : {&s.missing, &s.pushed}) {
      w.U32(static_cast<uint32_t>(ranks->size()));
      for (uint32_t r : *ranks) w.U32(r);
    }
  }
  return w.Take();
}

Result<std::vector<StalledRound>> DecodeStallReport(std::span<const std::byte> b,
                                                   uint32_t num_workers) {
  Reader r(b);
  uint32_t n;
  if (!r.U32(&n) || n > kMaxStalledRounds) return Bad("stall report");
  std::vector<StalledRound> out(n);
  for (StalledRound& s : out) {
    if (!r.U64(&s.key) || !r.U32(&s.partition) || !r.U64(&s.round) || !r.U64(&s.age_ms) ||
        s.age_ms > kMaxStallAgeMs) {
      return Bad("stall report");
    }
    std::vector<bool> seen(num_workers, false);
    for (std::vector<uint32_t>* ranks : {&s.missing, &s.pushed}) {
      uint32_t count;
      if (!r.U32(&count) || count > num_workers || r.remaining() / 4 < count) {
        return Bad("stall report (rank count)");
      }
      ranks->resize(count);
      for (uint32_t i = 0; i < count; ++i) {
        uint32_t& rank = (*ranks)[i];
        if (!r.U32(&rank) || rank >= num_workers || seen[rank] ||
            (i > 0 && rank <= (*ranks)[i - 1])) {
          return Bad("stall report (ranks)");
        }
        seen[rank] = true;
      }
    }
  }
  if (!r.Done()) return Bad("stall report (trailing bytes)");
  return out;
}

Result<std::string> DecodeText(std::span<const std::byte> b) {
  Reader r(b);
  std::string s;
  if (!r.Str(&s, kMaxMessageLength) || !r.Done()) return Bad("text message");
  return s;
}

}  // namespace gradlink::wire
