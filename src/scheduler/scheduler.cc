#include "gradlink/scheduler.h"

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <map>
#include <mutex>
#include <random>
#include <set>
#include <sstream>
#include <thread>
#include <vector>

#include "common/log.h"
#include "common/naming.h"
#include "scheduler/placement.h"
#include "security/handshake.h"
#include "control/control_channel.h"
#include "wire/messages.h"

namespace gradlink {
namespace {

using transport::ControlChannel;
using transport::Frame;
using wire::MsgType;
using wire::Role;

constexpr auto kRegisterTimeout = std::chrono::seconds(10);
// With a job secret: the handshake must be complete this long after the connection was accepted
// (4 s, so that a stalled or slow peer is refused well within 5 s).
constexpr auto kHandshakeTimeout = std::chrono::seconds(4);
constexpr auto kPoll = std::chrono::milliseconds(100);
// Connections that have not registered yet, at most; more are closed at once.
constexpr size_t kMaxUnregistered = 256;

std::string RoleName(Role r) { return r == Role::kWorker ? "worker" : "server"; }

std::string FormatWeight(double w) {
  std::ostringstream o;
  o << w;
  return o.str();
}

struct Connection {
  std::shared_ptr<ControlChannel> channel;
  std::thread reader;
  std::atomic<bool> reader_done{false};
  transport::Clock::time_point last_heard;  // guarded by the scheduler's mutex
  bool registered = false;
  bool left = false;  // said goodbye
  // With a job secret: what the member proved in the handshake; kRegister must agree.
  Role auth_role = Role::kWorker;
  int32_t auth_rank = -1;
  Role role = Role::kWorker;
  uint32_t id = 0;  // valid once the job has started
  wire::RegisterMsg reg;
};

// One declared key: what each worker declared, and whether it has been answered.
struct Declaration {
  std::string name;
  DataType dtype{};
  uint64_t count = 0;
  uint64_t partition_bytes = 0;
  std::map<uint32_t, std::pair<wire::Header, wire::DeclareMsg>> by_rank;
  bool planned = false;
  Status status;  // kMismatch when the workers disagree
  wire::Header assign_header;
  std::vector<std::byte> assign_payload;
  std::set<uint32_t> acks;  // servers that have the plan
};

class SchedulerImpl final : public Scheduler {
 public:
  SchedulerImpl(const SchedulerOptions& o, std::unique_ptr<transport::Listener> l)
      : opts_(o), job_hash_(wire::JobHash(o.job)), listener_(std::move(l)), placer_(o.num_servers) {
    started_at_ = transport::Clock::now();
    if (!opts_.secret.has_value()) {
      GL_LOG(kWarn) << "scheduler: job '" << opts_.job << "' has no secret (GRADLINK_SECRET): "
                    << "anyone who can reach port " << listener_->port()
                    << " can join it (docs/security.md)";
    }
    acceptor_ = std::thread([this] { AcceptLoop(); });
  }
  ~SchedulerImpl() override { Stop(); }

  uint16_t port() const override { return listener_->port(); }
  uint64_t protocol_errors() const override { return protocol_errors_.load(); }
  uint64_t auth_failures() const override { return auth_failures_.load(); }

  Status Wait(Clock::time_point deadline) override {
    std::unique_lock<std::mutex> lock(mu_);
    if (!cv_.wait_until(lock, deadline, [this] { return finished_; })) {
      return Timeout("job '" + opts_.job + "' still running");
    }
    return result_;
  }

  void Stop() override {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (stopping_) return;
      stopping_ = true;
      if (!finished_) FinishLocked(Aborted("scheduler stopped"));
    }
    if (acceptor_.joinable()) acceptor_.join();
    std::vector<std::shared_ptr<Connection>> conns;
    {
      std::lock_guard<std::mutex> lock(mu_);
      conns = conns_;
    }
    for (auto& c : conns) c->channel->Close();
    for (auto& c : conns) {
      if (c->reader.joinable()) c->reader.join();
    }
    listener_->Close();
  }

 private:
  wire::Header MakeHeader(MsgType t) const {
    wire::Header h;
    h.type = t;
    h.job = job_hash_;
    h.sender = wire::kSchedulerId;
    return h;
  }

  void AcceptLoop() {
    while (true) {
      {
        std::lock_guard<std::mutex> lock(mu_);
        if (stopping_) return;
        if (!started_ && !finished_ && transport::Clock::now() - started_at_ > opts_.join_timeout) {
          FinishLocked(Timeout("only " + std::to_string(registered_workers_) + " of " +
                               std::to_string(opts_.num_workers) + " workers and " +
                               std::to_string(registered_servers_) + " of " +
                               std::to_string(opts_.num_servers) + " servers joined within " +
                               std::to_string(opts_.join_timeout.count()) + " ms"));
        }
      }
      CheckLiveness();
      auto ch = listener_->Accept(transport::Clock::now() + kPoll);
      if (!ch.ok()) {
        if (ch.status().code() == Code::kTimeout) continue;
        GL_LOG(kWarn) << "scheduler: accept failed: " << ch.status().ToString();
        std::this_thread::sleep_for(kPoll);
        continue;
      }
      auto conn = std::make_shared<Connection>();
      conn->channel = std::shared_ptr<ControlChannel>(std::move(ch).value());
      std::vector<std::shared_ptr<Connection>> reaped = ReapClosed();
      for (auto& c : reaped) c->reader.join();  // they have returned: this does not wait
      std::lock_guard<std::mutex> lock(mu_);
      size_t unregistered = 0;
      for (auto& c : conns_) unregistered += c->registered ? 0 : 1;
      if (unregistered >= kMaxUnregistered) {
        GL_LOG(kWarn) << "scheduler: " << unregistered << " connections have not registered; "
                      << "refusing " << conn->channel->peer_name();
        continue;  // the channel closes with `conn`
      }
      conns_.push_back(conn);
      conn->reader = std::thread([this, conn] {
        ReadLoop(conn);
        conn->reader_done = true;
      });
    }
  }

  // Once the job runs: heartbeats to every member, and a member silent for kSilenceLimit
  // (hung, stopped, cut off) fails the job, naming it.
  void CheckLiveness() {
    std::lock_guard<std::mutex> lock(mu_);
    if (finished_) return;
    const auto now = transport::Clock::now();
    // Members that registered and wait for the others hear heartbeats too (they watch for a hung
    // scheduler); their own silence counts only once the job has started.
    for (auto& c : conns_) {
      if (!started_) break;
      if (!c->registered || c->left) continue;
      if (now - c->last_heard > transport::kSilenceLimit) {
        FinishLocked(PeerLost(MemberName(*c) + " sent nothing for " +
                              std::to_string(std::chrono::duration_cast<std::chrono::milliseconds>(
                                                 now - c->last_heard)
                                                 .count()) +
                              " ms: hung or cut off"));
        return;
      }
    }
    if (now - last_heartbeat_ < transport::kHeartbeatInterval) return;
    last_heartbeat_ = now;
    for (auto& c : conns_) {
      if (!c->registered || c->left) continue;
      // A member whose socket is full is hung; the silence check above will name it.
      c->channel->Send(MakeHeader(MsgType::kHeartbeat), {}, now + std::chrono::milliseconds(20))
          .IgnoreError();
    }
  }

  // Removes the connections that closed before registering (a registered member stays: the job
  // names it in errors). Their threads are to be joined by the caller, outside the lock.
  std::vector<std::shared_ptr<Connection>> ReapClosed() {
    std::vector<std::shared_ptr<Connection>> reaped;
    std::lock_guard<std::mutex> lock(mu_);
    std::erase_if(conns_, [&](const std::shared_ptr<Connection>& c) {
      if (c->registered || !c->reader_done.load()) return false;
      reaped.push_back(c);
      return true;
    });
    return reaped;
  }

  // Refuses a connection that failed authentication: counts it, tells the member why (kAbort
  // with kAuthFailed) when `tell`, and closes it. Nothing it sent is processed.
  void AuthFailure(const std::shared_ptr<Connection>& c, const std::string& why, bool tell) {
    auth_failures_++;
    GL_LOG(kWarn) << "scheduler: authentication failed for " << c->channel->peer_name() << ": "
                  << why << "; closing";
    if (tell) {
      wire::Header h = MakeHeader(MsgType::kAbort);
      h.code = static_cast<uint8_t>(Code::kAuthFailed);
      c->channel->Send(h, wire::EncodeText("authentication failed: " + why),
                       transport::Clock::now() + std::chrono::milliseconds(500))
          .IgnoreError();
    }
    c->channel->Close();
  }

  // The scheduler's side of the handshake (src/security/handshake.h), before anything else of
  // the connection is looked at. False when it failed (the connection is closed and counted).
  bool Authenticate(const std::shared_ptr<Connection>& c) {
    const auto deadline = transport::Clock::now() + kHandshakeTimeout;
    security::ServerHandshake hs(*opts_.secret, job_hash_, /*epoch=*/0);
    const std::string no_secret =
        "this scheduler requires the job secret and the member has none: set GRADLINK_SECRET "
        "(or GRADLINK_SECRET_FILE) to the scheduler's";
    while (!hs.done()) {
      wire::Header header;
      header.type = MsgType::kHeartbeat;  // none seen yet
      auto f = c->channel->ReceiveBounded(deadline, security::kMaxHandshakePayload, &header);
      if (!f.ok()) {
        {
          std::lock_guard<std::mutex> lock(mu_);
          if (stopping_) return false;
        }
        if (header.type == MsgType::kRegister && f.status().code() == Code::kProtocolError) {
          AuthFailure(c, no_secret, true);  // a member without a secret: its kRegister
          return false;
        }
        if (f.status().code() == Code::kProtocolError) protocol_errors_++;
        AuthFailure(c,
                    f.status().code() == Code::kTimeout
                        ? "no complete handshake within " +
                              std::to_string(std::chrono::duration_cast<std::chrono::milliseconds>(
                                                 kHandshakeTimeout)
                                                 .count()) +
                              " ms"
                        : f.status().message(),
                    f.status().code() == Code::kProtocolError);
        return false;
      }
      if (f->header.job != job_hash_) {
        AuthFailure(c, "frame of another job", true);
        return false;
      }
      auto reply = hs.Step(f->header.type, f->payload);
      if (!reply.ok()) {
        AuthFailure(c,
                    f->header.type == MsgType::kRegister ? no_secret : reply.status().message(),
                    true);
        return false;
      }
      wire::Header h = MakeHeader(reply->type);
      Status sent = c->channel->Send(h, reply->payload, deadline);
      if (!sent.ok()) {
        AuthFailure(c, "sending the handshake: " + sent.message(), false);
        return false;
      }
    }
    std::lock_guard<std::mutex> lock(mu_);
    c->auth_role = hs.role();
    c->auth_rank = hs.rank();
    return true;
  }

  void ReadLoop(std::shared_ptr<Connection> c) {
    const auto register_deadline = transport::Clock::now() + kRegisterTimeout;
    if (opts_.secret.has_value() && !Authenticate(c)) return;
    while (true) {
      auto f = c->channel->Receive(transport::Clock::now() + kPoll);
      if (!f.ok()) {
        if (f.status().code() == Code::kTimeout) {
          std::lock_guard<std::mutex> lock(mu_);
          if (stopping_) return;
          if (!c->registered && transport::Clock::now() > register_deadline) {
            GL_LOG(kWarn) << "scheduler: " << c->channel->peer_name()
                          << " did not register in time; closing";
            c->channel->Close();
            return;
          }
          continue;
        }
        if (f.status().code() == Code::kProtocolError) protocol_errors_++;
        OnConnectionLost(c, f.status());
        return;
      }
      Status s = Handle(c, *f);
      if (!s.ok()) {
        if (s.code() == Code::kProtocolError) protocol_errors_++;
        GL_LOG(kWarn) << "scheduler: closing " << c->channel->peer_name() << ": " << s.ToString();
        c->channel->Close();
        OnConnectionLost(c, s);
        return;
      }
    }
  }

  std::string MemberName(const Connection& c) const {
    return RoleName(c.role) + " " + (started_ ? std::to_string(c.id) : std::string("?")) + " (" +
           c.reg.host + ", " + c.channel->peer_name() + ")";
  }

  void OnConnectionLost(const std::shared_ptr<Connection>& c, const Status& why) {
    std::lock_guard<std::mutex> lock(mu_);
    if (!c->registered || c->left || finished_ || stopping_) return;
    FinishLocked(PeerLost(MemberName(*c) + " lost its connection to the scheduler: " +
                          why.message()));
  }

  Status Handle(const std::shared_ptr<Connection>& c, const Frame& f) {
    if (f.header.job != job_hash_) {
      Refuse(*c, InvalidArgument("this scheduler runs job '" + opts_.job + "'"));
      return InvalidArgument("frame of another job (job hash " + std::to_string(f.header.job) +
                             ", expected '" + opts_.job + "')");
    }
    if (!opts_.secret.has_value() && security::IsHandshakeType(f.header.type)) {
      auth_failures_++;
      const Status why(Code::kAuthFailed,
                       "authentication failed: this scheduler runs without a job secret and the "
                       "member has one: give the scheduler the same GRADLINK_SECRET, or unset it "
                       "on the member");
      Refuse(*c, why);
      return why;
    }
    std::lock_guard<std::mutex> lock(mu_);
    c->last_heard = transport::Clock::now();
    if (!c->registered && f.header.type != MsgType::kRegister) {
      return ProtocolError("first frame must be kRegister");
    }
    switch (f.header.type) {
      case MsgType::kRegister: return OnRegister(c, f);
      case MsgType::kDeclare: return OnDeclare(c, f);
      case MsgType::kAssignAck: return OnAssignAck(c, f);
      case MsgType::kBarrier: return OnBarrier(c, f);
      case MsgType::kGoodbye: return OnGoodbye(c);
      case MsgType::kHeartbeat: return started_ ? Status::Ok() : ProtocolError("early kHeartbeat");
      default:
        return ProtocolError("unexpected message type " +
                             std::to_string(static_cast<int>(f.header.type)));
    }
  }

  Status OnRegister(const std::shared_ptr<Connection>& c, const Frame& f) {
    if (c->registered) return ProtocolError("registered twice");
    GL_ASSIGN_OR_RETURN(wire::RegisterMsg reg, wire::DecodeRegister(f.payload));
    if (opts_.secret.has_value() &&
        (reg.role != c->auth_role || reg.requested_rank != c->auth_rank)) {
      return ProtocolError("kRegister as " + RoleName(reg.role) + " rank " +
                           std::to_string(reg.requested_rank) + " after authenticating as " +
                           RoleName(c->auth_role) + " rank " + std::to_string(c->auth_rank));
    }
    uint32_t& have = reg.role == Role::kWorker ? registered_workers_ : registered_servers_;
    const uint32_t want = reg.role == Role::kWorker ? opts_.num_workers : opts_.num_servers;
    if (started_ || have >= want) {
      Refuse(*c, InvalidArgument("job '" + opts_.job + "' already has its " + std::to_string(want) +
                                 " " + RoleName(reg.role) + "s"));
      return InvalidArgument("a " + RoleName(reg.role) + " too many");
    }
    if (reg.role == Role::kWorker && reg.requested_rank >= 0 &&
        static_cast<uint32_t>(reg.requested_rank) >= opts_.num_workers) {
      Refuse(*c, InvalidArgument("rank " + std::to_string(reg.requested_rank) +
                                 " out of range for " + std::to_string(opts_.num_workers) +
                                 " workers"));
      return InvalidArgument("rank out of range");
    }
    c->registered = true;
    c->role = reg.role;
    c->reg = std::move(reg);
    ++have;
    if (registered_workers_ == opts_.num_workers && registered_servers_ == opts_.num_servers) {
      return StartJobLocked();
    }
    return Status::Ok();
  }

  void Refuse(Connection& c, const Status& why) {
    wire::Header h = MakeHeader(MsgType::kAbort);
    h.code = static_cast<uint8_t>(why.code());
    c.channel->Send(h, wire::EncodeText(why.message())).IgnoreError();
  }

  // Everyone is here: assign ids, send the address book.
  Status StartJobLocked() {
    std::vector<Connection*> workers(opts_.num_workers, nullptr), servers;
    std::vector<Connection*> unranked;
    for (auto& c : conns_) {
      if (!c->registered || c->left) continue;
      if (c->role == Role::kServer) {
        servers.push_back(c.get());
      } else if (c->reg.requested_rank >= 0) {
        const auto r = static_cast<uint32_t>(c->reg.requested_rank);
        if (workers[r] != nullptr) {
          FinishLocked(InvalidArgument("two workers asked for rank " + std::to_string(r) + ": " +
                                       workers[r]->reg.host + " and " + c->reg.host));
          return Status::Ok();
        }
        c->id = r;
        workers[r] = c.get();
      } else {
        unranked.push_back(c.get());
      }
    }
    // Server ids: heaviest weight first, then in connection order. The plan then depends only
    // on the weights, not on which server connected first (servers of equal weight are
    // interchangeable); with equal weights the ids are in connection order.
    std::stable_sort(servers.begin(), servers.end(), [](const Connection* a, const Connection* b) {
      return a->reg.weight > b->reg.weight;
    });
    std::vector<double> weights;
    for (Connection* c : servers) {
      c->id = static_cast<uint32_t>(weights.size());
      weights.push_back(c->reg.weight);
    }
    placer_ = scheduler::Placer(weights);
    size_t next = 0;
    for (Connection* c : unranked) {
      while (workers[next] != nullptr) ++next;
      c->id = static_cast<uint32_t>(next);
      workers[next] = c;
    }
    started_ = true;
    for (auto& c : conns_) c->last_heard = transport::Clock::now();
    wire::WelcomeMsg w;
    std::random_device entropy;
    w.instance = uint64_t{entropy()} << 32 | entropy();
    w.num_workers = opts_.num_workers;
    w.num_servers = opts_.num_servers;
    for (Connection* c : workers) {
      w.members.push_back({Role::kWorker, c->id, c->reg.host, c->reg.push_address, c->reg.pull_address});
    }
    for (Connection* c : servers) {
      w.members.push_back({Role::kServer, c->id, c->reg.host, c->reg.push_address, c->reg.pull_address});
    }
    for (auto& c : conns_) {
      if (!c->registered) continue;
      w.your_id = c->id;
      (c->role == Role::kWorker ? workers_ : servers_)[c->id] = c;
      Status s = c->channel->Send(MakeHeader(MsgType::kWelcome), wire::Encode(w));
      if (!s.ok()) {
        FinishLocked(PeerLost(MemberName(*c) + " unreachable: " + s.message()));
        return Status::Ok();
      }
    }
    std::string weight_list;
    if (std::any_of(weights.begin(), weights.end(), [](double x) { return x != 1.0; })) {
      weight_list = "; placement weights:";
      for (Connection* c : servers) {
        weight_list += (c->id == 0 ? " server " : ", server ") + std::to_string(c->id) + " (" +
                       c->reg.host + ") " + FormatWeight(c->reg.weight);
      }
    }
    GL_LOG(kInfo) << "scheduler: job '" << opts_.job << "' started with " << opts_.num_workers
                  << " workers and " << opts_.num_servers << " servers" << weight_list;
    return Status::Ok();
  }

  Status OnDeclare(const std::shared_ptr<Connection>& c, const Frame& f) {
    if (c->role != Role::kWorker || !started_) return ProtocolError("unexpected kDeclare");
    GL_ASSIGN_OR_RETURN(wire::DeclareMsg d, wire::DecodeDeclare(f.payload));
    const wire::Header& h = f.header;
    if (!IsValidDataType(h.dtype)) return ProtocolError("kDeclare with an invalid dtype");
    if (wire::TensorKey(opts_.job, d.name) != h.key) {
      return ProtocolError("kDeclare key does not match the name '" + d.name + "'");
    }
    Declaration& decl = decls_[h.key];
    if (decl.by_rank.count(c->id) != 0) return ProtocolError("key declared twice by one worker");
    decl.by_rank[c->id] = {h, std::move(d)};
    if (decl.by_rank.size() < opts_.num_workers) return Status::Ok();
    return PlanLocked(h.key, decl);
  }

  // Every worker declared the key: compare the declarations, plan, tell the servers.
  Status PlanLocked(uint64_t key, Declaration& decl) {
    const auto& [h0, d0] = decl.by_rank.begin()->second;
    decl.name = d0.name;
    decl.dtype = static_cast<DataType>(h0.dtype);
    decl.count = h0.count;
    decl.partition_bytes = d0.partition_bytes;
    std::string disagree;
    for (const auto& [rank, hd] : decl.by_rank) {
      const auto& [h, d] = hd;
      if (h.dtype != h0.dtype || h.count != h0.count || d.partition_bytes != d0.partition_bytes ||
          d.name != d0.name) {
        disagree += (disagree.empty() ? "" : ", ") + std::string("rank ") + std::to_string(rank) +
                    (d.name != d0.name ? " declared name '" + d.name + "' as " : " declared ") +
                    std::string(DataTypeName(static_cast<DataType>(h.dtype))) +
                    "[" + std::to_string(h.count) + "] with " +
                    std::to_string(d.partition_bytes) + "-byte partitions";
      }
    }
    decl.planned = true;

    const std::string keyhex_s = KeyHex(key);
    const char* keyhex = keyhex_s.c_str();
    const uint64_t per_part =
        std::max<uint64_t>(1, decl.partition_bytes / DataTypeSize(decl.dtype));
    if (disagree.empty() && decl.count / per_part >= wire::kMaxPartitionsPerTensor) {
      decl.status = InvalidArgument(
          "key " + keyhex_s + " '" + decl.name + "': " + std::to_string(decl.count) +
          " elements in " + std::to_string(decl.partition_bytes) + "-byte partitions exceed " +
          std::to_string(wire::kMaxPartitionsPerTensor) + " partitions; use larger partitions");
    }
    if (!decl.status.ok() || !disagree.empty()) {
      const auto& first = decl.by_rank.begin();
      if (!disagree.empty()) decl.status = Mismatch("key " + std::string(keyhex) + " '" + decl.name + "': rank " +
                             std::to_string(first->first) + " declared " +
                             std::string(DataTypeName(decl.dtype)) + "[" +
                             std::to_string(decl.count) + "] with " +
                             std::to_string(decl.partition_bytes) + "-byte partitions, " +
                             disagree);
      GL_LOG(kWarn) << "scheduler: " << decl.status.ToString();
      decl.assign_header = MakeHeader(MsgType::kAssign);
      decl.assign_header.key = key;
      decl.assign_header.code = static_cast<uint8_t>(decl.status.code());
      decl.assign_payload = wire::EncodeText(decl.status.message());
      SendToWorkersLocked(decl.assign_header, decl.assign_payload);
      return Status::Ok();
    }
    wire::AssignMsg a;
    a.name = decl.name;
    a.partitions = placer_.Plan(decl.dtype, decl.count, decl.partition_bytes);
    decl.assign_header = MakeHeader(MsgType::kAssign);
    decl.assign_header.key = key;
    decl.assign_header.dtype = h0.dtype;
    decl.assign_header.count = decl.count;
    decl.assign_payload = wire::Encode(a);
    // Servers first: a worker may push as soon as it has the plan.
    for (auto& [id, s] : servers_) {
      Status st = s->channel->Send(decl.assign_header, decl.assign_payload);
      if (!st.ok()) FinishLocked(PeerLost(MemberName(*s) + " unreachable: " + st.message()));
    }
    return Status::Ok();
  }

  Status OnAssignAck(const std::shared_ptr<Connection>& c, const Frame& f) {
    if (c->role != Role::kServer) return ProtocolError("kAssignAck from a worker");
    auto it = decls_.find(f.header.key);
    if (it == decls_.end() || !it->second.planned || !it->second.status.ok()) {
      return ProtocolError("kAssignAck for a key that was not assigned");
    }
    Declaration& decl = it->second;
    decl.acks.insert(c->id);
    if (decl.acks.size() == opts_.num_servers) {
      SendToWorkersLocked(decl.assign_header, decl.assign_payload);
    }
    return Status::Ok();
  }

  void SendToWorkersLocked(const wire::Header& h, const std::vector<std::byte>& payload) {
    for (auto& [rank, w] : workers_) {
      if (w->left) continue;
      Status s = w->channel->Send(h, payload);
      if (!s.ok()) FinishLocked(PeerLost(MemberName(*w) + " unreachable: " + s.message()));
    }
  }

  Status OnBarrier(const std::shared_ptr<Connection>& c, const Frame& f) {
    if (c->role != Role::kWorker || !started_) return ProtocolError("unexpected kBarrier");
    auto& arrived = barriers_[f.header.round];
    arrived.insert(c->id);
    if (arrived.size() == opts_.num_workers) {
      wire::Header h = MakeHeader(MsgType::kBarrierRelease);
      h.round = f.header.round;
      barriers_.erase(f.header.round);
      SendToWorkersLocked(h, {});
    }
    return Status::Ok();
  }

  Status OnGoodbye(const std::shared_ptr<Connection>& c) {
    c->left = true;
    if (c->role == Role::kServer && started_ && !finished_) {
      // Its partitions have no other home: every worker would wait on them.
      FinishLocked(PeerLost(MemberName(*c) + " left while the job was running"));
      return Status::Ok();
    }
    if (c->role == Role::kWorker && started_ && workers_left_ + 1 < opts_.num_workers) {
      // Rounds that need this worker can never complete: the servers fail them, naming it.
      wire::Header h = MakeHeader(MsgType::kMemberLeft);
      h.count = c->id;
      for (auto& [id, s] : servers_) s->channel->Send(h, {}).IgnoreError();
    }
    if (c->role == Role::kWorker && started_ && ++workers_left_ == opts_.num_workers) {
      for (auto& [id, s] : servers_) {
        s->left = true;
        s->channel->Send(MakeHeader(MsgType::kShutdown), {}).IgnoreError();
      }
      FinishLocked(Status::Ok());
    }
    return Status::Ok();
  }

  // Ends the job with `result`; on failure every member still connected gets kAbort.
  void FinishLocked(Status result) {
    if (finished_) return;
    finished_ = true;
    result_ = result;
    if (!result.ok()) {
      GL_LOG(kWarn) << "scheduler: job '" << opts_.job << "' failed: " << result.ToString();
      wire::Header h = MakeHeader(MsgType::kAbort);
      h.code = static_cast<uint8_t>(result.code());
      const auto text = wire::EncodeText(result.message());
      // Workers first: a server that exits on kAbort closes its endpoints, and a worker that saw
      // that before its own kAbort would blame the server.
      for (Role role : {Role::kWorker, Role::kServer}) {
        for (auto& c : conns_) {
          if (c->registered && !c->left && c->role == role) {
            c->channel->Send(h, text, transport::Clock::now() + std::chrono::seconds(1))
                .IgnoreError();
          }
        }
      }
    }
    cv_.notify_all();
  }

  const SchedulerOptions opts_;
  const uint32_t job_hash_;
  std::unique_ptr<transport::Listener> listener_;
  std::thread acceptor_;
  std::atomic<uint64_t> protocol_errors_{0};
  std::atomic<uint64_t> auth_failures_{0};

  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<std::shared_ptr<Connection>> conns_;
  std::map<uint32_t, std::shared_ptr<Connection>> workers_, servers_;
  uint32_t registered_workers_ = 0, registered_servers_ = 0, workers_left_ = 0;
  bool started_ = false, finished_ = false, stopping_ = false;
  transport::Clock::time_point started_at_, last_heartbeat_;
  Status result_;
  std::map<uint64_t, Declaration> decls_;
  std::map<uint64_t, std::set<uint32_t>> barriers_;
  scheduler::Placer placer_;
};

}  // namespace

Result<std::unique_ptr<Scheduler>> Scheduler::Start(const SchedulerOptions& options) {
  if (options.num_workers == 0 || options.num_servers == 0) {
    return InvalidArgument("a job needs at least one worker and one server");
  }
  GL_ASSIGN_OR_RETURN(auto listener, transport::Listener::Listen(options.host, options.port));
  return std::unique_ptr<Scheduler>(new SchedulerImpl(options, std::move(listener)));
}

}  // namespace gradlink
