// What gradlink chooses for the settings a user leaves unset (WorkerOptions' partition_bytes,
// max_bytes_in_flight, max_bytes_ahead): one rule, from the job's shape as the address book
// gives it, so that the scheduler (which cuts each key into partitions) and every worker (which
// paces its pushes) reach the same values without another message. How it decides and why:
// docs/operations.md, "What gradlink tunes".
#pragma once

#include <cstdint>
#include <optional>
#include <string>

#include "wire/messages.h"

namespace gradlink::tuning {

// Where the job's bytes travel.
enum class Fabric : uint8_t {
  kOneMachine,  // every worker and server on one machine: loopback, memory-bound
  kNetwork,     // some member on another machine: links shared by n flows per server
};

struct Choice {
  Fabric fabric = Fabric::kNetwork;
  uint32_t workers = 0, servers = 0;
  uint64_t partition_bytes = 0;      // the most per partition (a key's own may be smaller)
  uint64_t max_bytes_in_flight = 0;  // per worker
  uint64_t max_bytes_ahead = 0;      // per server an op spans; 0: no limit
  std::string why;                   // one line, for the log and the stats
};

// The choice for the job of this address book (a welcome's members). With `partition` (the
// worker's own partition_bytes), the window and the lead are sized for that partition instead:
// a window and a lead of fewer partitions than the rule wants would starve the pipeline.
Choice Choose(const wire::WelcomeMsg& book, std::optional<uint64_t> partition = std::nullopt);

// The partition size of one key of `tensor_bytes` spread over `servers` servers, under the job's
// most: small enough that every server gets a part of the key, never under kMinPartitionBytes.
uint64_t KeyPartitionBytes(const Choice& c, uint64_t tensor_bytes, uint32_t servers);

inline constexpr uint64_t kMinPartitionBytes = 16u << 10;

}  // namespace gradlink::tuning
