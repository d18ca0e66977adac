// Payloads of the control frames (scheduler <-> members) and of kDataError.
//
// Encode* never fails; Decode* validates everything (lengths, counts, enum ranges) and returns
// kProtocolError naming what was wrong. Bounds keep a peer from making us allocate much.
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "gradlink/collective.h"
#include "gradlink/status.h"
#include "gradlink/tensor.h"

namespace gradlink::wire {

inline constexpr uint32_t kMaxNameLength = 4096;
inline constexpr uint32_t kMaxAddressLength = 16384;
inline constexpr uint32_t kMaxMembers = 4096;
inline constexpr uint32_t kMaxPartitions = 1u << 20;
// Partitions of one tensor: its kAssign (20 bytes each) must fit in one control frame.
inline constexpr uint64_t kMaxPartitionsPerTensor = 50000;
inline constexpr uint32_t kMaxMessageLength = 8192;
inline constexpr uint32_t kMaxShapeDims = 64;
// DeclareMsg::mode / AssignMsg::mode lie in [0, kMaxAggregationMode] (control/topology.h).
inline constexpr uint8_t kMaxAggregationMode = 2;
// CollectiveSpec::counts on the wire: at most this many (an all-to-all of 256 workers).
inline constexpr uint32_t kMaxSpecCounts = 65536;
// A server's placement weight (RegisterMsg::weight) lies in [kMinServerWeight, kMaxServerWeight]:
// any ratio of two weights is at most 1e12, so load / weight never overflows a double.
inline constexpr double kMinServerWeight = 1e-6;
inline constexpr double kMaxServerWeight = 1e6;
// False for NaN too.
inline bool IsValidServerWeight(double w) { return w >= kMinServerWeight && w <= kMaxServerWeight; }
// "weight W is not a finite number in [1e-06, 1e+06]", W printed exactly: for error messages.
std::string ServerWeightError(double w);

enum class Role : uint8_t { kWorker = 1, kServer = 2 };

// Server ids run below num_servers + this: a standby's id (ServerOptions::standby, or a server
// that joined a running job) is num_servers or more, one each, never reused, so a job takes at
// most this many of them in its life.
inline constexpr uint32_t kMaxServersJoined = 1024;

// What a member that was in the job tells a restarted scheduler when it re-registers, besides
// its id (RegisterMsg::requested_rank). Servers send only `resume` being set; the rest is a
// worker's.
struct ResumeState {
  uint32_t keys = 0;  // kResumeKey frames that follow the kRegister, one per declared tensor
  uint64_t barriers_entered = 0;   // Worker::Barrier calls made
  uint64_t barriers_released = 0;  // ...and released
  uint32_t server_ids = 0;         // server ids this worker knows (the job's and standbys')
  std::vector<uint32_t> lost_servers;  // ...and those of them lost (ascending, below server_ids)
};

// kRegister payload.
struct RegisterMsg {
  Role role = Role::kWorker;
  int32_t requested_rank = -1;  // workers: a rank to claim (torchrun's RANK), -1: any
  std::string host;             // for messages and the address book
  std::vector<std::byte> push_address;  // transport lane addresses
  std::vector<std::byte> pull_address;
  // Servers: the share of the partitions this server takes, relative to the other servers'
  // weights (ServerOptions::weight). Workers send 1.0; the scheduler ignores theirs. Decoding
  // refuses a value that is not finite or lies outside [kMinServerWeight, kMaxServerWeight].
  double weight = 1.0;
  // Servers: the most bytes of partition state this server may hold (ServerOptions::
  // memory_budget_bytes); 0: not set, the scheduler gives it a share of `available_memory`.
  uint64_t memory_budget = 0;
  // Servers: what the kernel said could be allocated (MemAvailable) when the server started;
  // 0: unknown. Workers send 0.
  uint64_t available_memory = 0;
  // Servers: a standby (ServerOptions::standby), which takes no partitions until it takes over
  // a lost server's. Workers send false; decoding refuses a worker that says true.
  bool standby = false;
  // The port this member serves its metrics on (ServerOptions::metrics_port), at the address
  // its control connection comes from; 0: none. The scheduler lists them on /targets.
  uint16_t metrics_port = 0;
  // Set when the member was in the job already and re-registers with a restarted scheduler
  // (scheduler_impl.h, "Restart"): requested_rank is then its id in the job.
  std::optional<ResumeState> resume;
};

struct Member {
  Role role = Role::kWorker;
  uint32_t id = 0;  // worker rank or server id
  std::string host;
  std::vector<std::byte> push_address;
  std::vector<std::byte> pull_address;
};

// kWelcome payload: who you are and everyone's addresses.
struct WelcomeMsg {
  uint32_t your_id = 0;
  uint32_t num_workers = 0;
  uint32_t num_servers = 0;
  std::vector<Member> members;
  // Random, drawn once per job by the scheduler: names what belongs to this run of the job
  // (the same-host path's shared-memory segment).
  uint64_t instance = 0;
};

// kDeclare payload (key, dtype and count travel in the header).
struct DeclareMsg {
  std::string name;
  uint64_t partition_bytes = 0;  // 0: the scheduler chooses (control/tuning.h)
  // The tensor's dimensions as the caller gave them (at most kMaxShapeDims); empty: not given.
  // Their product is the header's count.
  std::vector<uint64_t> shape;
  // How this worker can aggregate the key (topology::Mode): kFlat, or a hierarchical mode when
  // the job's workers share hosts and this worker's host bound the key to its segment.
  uint8_t mode = 0;
  // What the key is for (gradlink/collective.h); decoding checks the enums' ranges and the
  // counts' bound, the scheduler the rest (control/layout.h).
  CollectiveSpec spec = {};
};

struct PartitionPlan {
  uint64_t offset = 0;  // first element
  uint64_t count = 0;   // elements
  uint32_t server = 0;  // owning server id
};

// kAssign payload (key, dtype and total count travel in the header).
struct AssignMsg {
  std::string name;
  std::vector<PartitionPlan> partitions;
  uint8_t mode = 0;  // topology::Mode the scheduler chose for the key (valid values only)
  // Every worker's (they agree). Decoding checks the enums' ranges and the counts' bound; the
  // receiver checks the rest against its job (layout::CheckPlan).
  CollectiveSpec spec = {};
};

// kJoin / kJoinRelease payload. From a worker: the next round of each of its keys and the
// barriers it has entered; from the scheduler: the most of each over every worker (a rank that
// sat rounds out while joined takes them up from there). Keys strictly ascending.
struct JoinMsg {
  std::vector<std::pair<uint64_t, uint64_t>> rounds;  // (key, next round)
  uint64_t barriers = 0;
};
// kResumeKey payload (key, dtype and count travel in the header): one tensor a worker declared,
// told to a restarted scheduler, with the plan the worker had for it, if any.
struct ResumeKeyMsg {
  enum class Plan : uint8_t { kNone = 0, kPlanned = 1, kRefused = 2 };
  DeclareMsg declare;  // as this worker declared it
  Plan state = Plan::kNone;
  AssignMsg plan;          // kPlanned
  uint8_t refusal = 0;     // kRefused: the Code it was refused with...
  std::string refusal_text;  // ...and why
};

// kStallReport (server -> scheduler): rounds some workers have pushed and others not, for at
// least the stall inspector's period (ServerOptions::stall_check).
struct StalledRound {
  uint64_t key = 0;
  uint32_t partition = 0;
  uint64_t round = 0;
  uint64_t age_ms = 0;            // since the round's first push landed
  std::vector<uint32_t> missing;  // ranks that have not pushed it, ascending
  std::vector<uint32_t> pushed;   // ranks that have, ascending
};
inline constexpr uint32_t kMaxStalledRounds = 1024;  // per report
// A report's bytes, at most (far below a control frame's bound, whatever the job's size: the
// rounds that do not fit go in the next report), and the most age a round may claim (a year).
inline constexpr size_t kMaxStallReportBytes = 64 << 10;
inline constexpr uint64_t kMaxStallAgeMs = uint64_t{366} * 24 * 3600 * 1000;

// Keys one kJoin can carry (16 bytes each in one control frame).
inline constexpr uint32_t kMaxJoinKeys = 60000;

std::vector<std::byte> Encode(const RegisterMsg& m);
std::vector<std::byte> Encode(const JoinMsg& m);
std::vector<std::byte> Encode(const WelcomeMsg& m);
std::vector<std::byte> Encode(const DeclareMsg& m);
std::vector<std::byte> Encode(const AssignMsg& m);
std::vector<std::byte> EncodeText(std::string_view text);
std::vector<std::byte> Encode(const ResumeKeyMsg& m);
std::vector<std::byte> Encode(const std::vector<StalledRound>& m);
// Ranks below `num_workers`, ascending, none both missing and pushed.
Result<std::vector<StalledRound>> DecodeStallReport(std::span<const std::byte> b,
                                                   uint32_t num_workers);
// Its plan is checked as DecodeAssign checks one.
Result<ResumeKeyMsg> DecodeResumeKey(std::span<const std::byte> b, uint64_t total_count,
                                     uint32_t num_servers);

// kServerJoined's payload: one member's entry of the address book, as in a WelcomeMsg.
std::vector<std::byte> EncodeMember(const Member& m);
Result<Member> DecodeMember(std::span<const std::byte> b);
Result<RegisterMsg> DecodeRegister(std::span<const std::byte> b);
Result<WelcomeMsg> DecodeWelcome(std::span<const std::byte> b);
Result<DeclareMsg> DecodeDeclare(std::span<const std::byte> b);
// Checks too that partitions are contiguous, non-empty, cover exactly `total_count` elements and
// name servers below `num_servers`.
Result<AssignMsg> DecodeAssign(std::span<const std::byte> b, uint64_t total_count,
                               uint32_t num_servers);
Result<std::string> DecodeText(std::span<const std::byte> b);
Result<JoinMsg> DecodeJoin(std::span<const std::byte> b);

}  // namespace gradlink::wire
