// The GRADLINK_* environment, mapped onto the roles' options in one place. Launchers (the
// gradlink tools, gradlink-run, the Python layer) call these instead of reading variables
// themselves; which variable sets which field: docs/operations.md, "Environment".
//
// Each ApplyEnvironment sets only the fields whose variable is set, so defaults stay and flags
// applied afterwards win. kInvalidArgument naming the variable when a value is malformed (or a
// secret is too short, or its file is readable by others); the options are then unchanged.
// Threads: any (reads the environment only).
#pragma once

#include <optional>
#include <string>

#include "gradlink/export.h"
#include "gradlink/options.h"
#include "gradlink/status.h"

namespace gradlink {

// GRADLINK_JOB; the secret (GRADLINK_SECRET, else GRADLINK_SECRET_FILE's contents);
// GRADLINK_METRICS_PORT, GRADLINK_JOB_MEMORY, the stall inspector's (GRADLINK_STALL_CHECK_SECONDS,
// GRADLINK_STALL_SHUTDOWN_SECONDS, and Horovod's names for them).
GRADLINK_EXPORT Status ApplyEnvironment(SchedulerOptions* options);
// GRADLINK_SCHEDULER, GRADLINK_JOB, GRADLINK_HOST, GRADLINK_SERVER_ID, GRADLINK_SERVER_WEIGHT,
// GRADLINK_SERVER_MEMORY, GRADLINK_SERVER_ENGINES, GRADLINK_SERVER_CPUS, GRADLINK_CONNECT_TIMEOUT
// and GRADLINK_SCHEDULER_RECONNECT (seconds), the secret, GRADLINK_METRICS_PORT,
// GRADLINK_STALL_CHECK_SECONDS.
GRADLINK_EXPORT Status ApplyEnvironment(ServerOptions* options);
// GRADLINK_SCHEDULER, GRADLINK_JOB, GRADLINK_HOST, GRADLINK_RANK, GRADLINK_PARTITION_BYTES,
// GRADLINK_MAX_BYTES_IN_FLIGHT, GRADLINK_MAX_BYTES_AHEAD, GRADLINK_SINGLE_LANE,
// GRADLINK_FUSION_BUFFER_BYTES, GRADLINK_FUSION_THRESHOLD_BYTES, GRADLINK_LOCAL_ARENA_BYTES,
// GRADLINK_LOCAL_CHUNK_BYTES, GRADLINK_CONNECT_TIMEOUT, GRADLINK_SCHEDULER_RECONNECT and
// GRADLINK_TIMEOUT (seconds), the secret, GRADLINK_METRICS_PORT.
GRADLINK_EXPORT Status ApplyEnvironment(WorkerOptions* options);

// The job secret alone: GRADLINK_SECRET, else the contents of GRADLINK_SECRET_FILE, else nullopt.
GRADLINK_EXPORT Result<std::optional<std::string>> SecretFromEnvironment();
// A byte count as the GRADLINK_* variables take it: digits, optionally K, M or G (binary
// multiples). kInvalidArgument naming `what` and the value otherwise. For the tools' flags.
GRADLINK_EXPORT Result<uint64_t> ParseByteCount(const std::string& what, const std::string& value);

// What the kernel says can still be allocated without swapping (/proc/meminfo's MemAvailable),
// in bytes; 0 when unknown. Servers report it when they join (their default memory budget is a
// share of it); tools check sizes against it.
GRADLINK_EXPORT uint64_t AvailableMemory();

// The machine this process counts as (what decides which workers share a host): GRADLINK_HOST's
// machine part when it is set, else the host name, with the network namespace where it is not
// the machine's own. For launchers that place one server per host (the torch.distributed
// backend's rendezvous).
GRADLINK_EXPORT std::string LocalMachineName();
// A fresh random job secret (64 hex characters), for launchers to hand to a job's members.
GRADLINK_EXPORT std::string GenerateSecret();

}  // namespace gradlink
