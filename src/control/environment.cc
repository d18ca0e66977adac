// include/gradlink/env.h: the GRADLINK_* variables onto the roles' options (read through
// src/common/env.h, the one place gradlink calls getenv).
#include "gradlink/env.h"

#include <cstdint>
#include <fstream>

#include "common/env.h"
#include "common/naming.h"
#include "security/secret.h"
#include "wire/messages.h"

namespace gradlink {
namespace {

// Sets *field from the variable `name` when it is set.
template <typename T, typename F>
Status Take(const char* name, F read, T* field) {
  auto v = read(name);
  if (!v.ok()) return v.status();
  if (v->has_value()) *field = static_cast<T>(**v);
  return Status::Ok();
}

Status TakeString(const char* name, std::string* field) {
  if (std::optional<std::string> v = env::Get(name)) *field = std::move(*v);
  return Status::Ok();
}

Status TakeSecret(std::optional<std::string>* field) {
  GL_ASSIGN_OR_RETURN(std::optional<std::string> s, SecretFromEnvironment());
  if (s) *field = std::move(*s);
  return Status::Ok();
}

// GRADLINK_METRICS_PORT: a port, 0 (a free one) or "off"/-1.
Status TakeMetricsPort(int32_t* field) {
  const std::optional<std::string> v = env::GetSet("GRADLINK_METRICS_PORT");
  if (!v) return Status::Ok();
  if (*v == "off" || *v == "-1") {
    *field = -1;
    return Status::Ok();
  }
  GL_ASSIGN_OR_RETURN(std::optional<int64_t> port, env::Int("GRADLINK_METRICS_PORT"));
  if (*port < 0 || *port > 65535) {
    return InvalidArgument("GRADLINK_METRICS_PORT=" + *v +
                           " is not a port (0-65535; 0: a free one) or off");
  }
  *field = static_cast<int32_t>(*port);
  return Status::Ok();
}

// The stall inspector's period: GRADLINK_STALL_CHECK_SECONDS, else Horovod's names.
Status TakeStallCheck(std::chrono::milliseconds* field) {
  GL_ASSIGN_OR_RETURN(std::optional<bool> disabled, env::Flag("HOROVOD_STALL_CHECK_DISABLE"));
  if (disabled.value_or(false)) *field = std::chrono::milliseconds(0);
  GL_RETURN_IF_ERROR(Take("HOROVOD_STALL_CHECK_TIME_SECONDS", env::Seconds, field));
  return Take("GRADLINK_STALL_CHECK_SECONDS", env::Seconds, field);
}

}  // namespace

Result<std::optional<std::string>> SecretFromEnvironment() {
  GL_ASSIGN_OR_RETURN(std::optional<security::Secret> s, security::LoadSecret());
  if (!s) return std::optional<std::string>();
  return std::optional<std::string>(std::move(s->value));
}

Result<uint64_t> ParseByteCount(const std::string& what, const std::string& value) {
  return env::ParseBytes(what, value);
}

uint64_t AvailableMemory() {
  std::ifstream f("/proc/meminfo");
  std::string key, unit;
  uint64_t kib = 0;
  while (f >> key >> kib >> unit) {
    if (key == "MemAvailable:") return kib * 1024;
  }
  return 0;
}

std::string LocalMachineName() {
  const std::string host = env::Get("GRADLINK_HOST").value_or(LocalHostName());
  return std::string(MachineOf(host));
}

std::string GenerateSecret() { return security::Generate().value; }

Status ApplyEnvironment(SchedulerOptions* o) {
  SchedulerOptions n = *o;
  GL_RETURN_IF_ERROR(TakeString("GRADLINK_JOB", &n.job));
  GL_RETURN_IF_ERROR(TakeSecret(&n.secret));
  GL_RETURN_IF_ERROR(TakeMetricsPort(&n.metrics_port));
  GL_RETURN_IF_ERROR(Take("GRADLINK_JOB_MEMORY", env::Bytes, &n.memory_quota_bytes));
  GL_RETURN_IF_ERROR(TakeStallCheck(&n.stall_check));
  GL_RETURN_IF_ERROR(
      Take("HOROVOD_STALL_SHUTDOWN_TIME_SECONDS", env::Seconds, &n.stall_shutdown));
  GL_RETURN_IF_ERROR(Take("GRADLINK_STALL_SHUTDOWN_SECONDS", env::Seconds, &n.stall_shutdown));
  *o = std::move(n);
  return Status::Ok();
}

Status ApplyEnvironment(ServerOptions* o) {
  ServerOptions n = *o;
  GL_RETURN_IF_ERROR(TakeString("GRADLINK_SCHEDULER", &n.scheduler));
  GL_RETURN_IF_ERROR(TakeString("GRADLINK_JOB", &n.job));
  GL_RETURN_IF_ERROR(TakeString("GRADLINK_HOST", &n.host_name));
  GL_RETURN_IF_ERROR(Take("GRADLINK_SERVER_WEIGHT", env::Number, &n.weight));
  if (!wire::IsValidServerWeight(n.weight)) {
    return InvalidArgument("GRADLINK_SERVER_WEIGHT: server " + wire::ServerWeightError(n.weight));
  }
  GL_RETURN_IF_ERROR(Take("GRADLINK_SERVER_MEMORY", env::Bytes, &n.memory_budget_bytes));
  GL_ASSIGN_OR_RETURN(std::optional<int64_t> engines, env::Int("GRADLINK_SERVER_ENGINES"));
  if (engines) {
    if (*engines < 0 || *engines > 1024) {
      return InvalidArgument("GRADLINK_SERVER_ENGINES=" + std::to_string(*engines) +
                             " is not an engine thread count (0 to choose, else 1 to 1024)");
    }
    n.engine_threads = static_cast<uint32_t>(*engines);
  }
  GL_RETURN_IF_ERROR(TakeString("GRADLINK_SERVER_CPUS", &n.cpus));
  GL_ASSIGN_OR_RETURN(std::optional<int64_t> id, env::Int("GRADLINK_SERVER_ID"));
  if (id) {
    if (*id < -1 || *id > INT32_MAX) {
      return InvalidArgument("GRADLINK_SERVER_ID=" + std::to_string(*id) +
                             " is not a server id (-1 for any, else 0 to 2147483647)");
    }
    n.id = static_cast<int32_t>(*id);
  }
  GL_RETURN_IF_ERROR(Take("GRADLINK_CONNECT_TIMEOUT", env::Seconds, &n.connect_timeout));
  GL_RETURN_IF_ERROR(
      Take("GRADLINK_SCHEDULER_RECONNECT", env::Seconds, &n.scheduler_reconnect_timeout));
  GL_RETURN_IF_ERROR(TakeSecret(&n.secret));
  GL_RETURN_IF_ERROR(TakeMetricsPort(&n.metrics_port));
  GL_RETURN_IF_ERROR(TakeStallCheck(&n.stall_check));
  *o = std::move(n);
  return Status::Ok();
}

Status ApplyEnvironment(WorkerOptions* o) {
  WorkerOptions n = *o;
  GL_RETURN_IF_ERROR(TakeString("GRADLINK_SCHEDULER", &n.scheduler));
  GL_RETURN_IF_ERROR(TakeString("GRADLINK_JOB", &n.job));
  GL_RETURN_IF_ERROR(TakeString("GRADLINK_HOST", &n.host_name));
  GL_ASSIGN_OR_RETURN(std::optional<int64_t> rank, env::Int("GRADLINK_RANK"));
  if (rank) {
    if (*rank < -1 || *rank > INT32_MAX) {
      return InvalidArgument("GRADLINK_RANK=" + std::to_string(*rank) +
                             " is not a rank (-1 for any, else 0 to 2147483647)");
    }
    n.rank = static_cast<int32_t>(*rank);
  }
  GL_RETURN_IF_ERROR(Take("GRADLINK_PARTITION_BYTES", env::Bytes, &n.partition_bytes));
  GL_RETURN_IF_ERROR(Take("GRADLINK_MAX_BYTES_IN_FLIGHT", env::Bytes, &n.max_bytes_in_flight));
  GL_RETURN_IF_ERROR(Take("GRADLINK_MAX_BYTES_AHEAD", env::Bytes, &n.max_bytes_ahead));
  GL_RETURN_IF_ERROR(Take("GRADLINK_SINGLE_LANE", env::Flag, &n.single_lane));
  GL_RETURN_IF_ERROR(Take("GRADLINK_FUSION_BUFFER_BYTES", env::Bytes, &n.fusion_buffer_bytes));
  GL_RETURN_IF_ERROR(
      Take("GRADLINK_FUSION_THRESHOLD_BYTES", env::Bytes, &n.fusion_threshold_bytes));
  GL_RETURN_IF_ERROR(Take("GRADLINK_LOCAL_ARENA_BYTES", env::Bytes, &n.local_arena_bytes));
  GL_RETURN_IF_ERROR(Take("GRADLINK_LOCAL_CHUNK_BYTES", env::Bytes, &n.local_chunk_bytes));
  GL_RETURN_IF_ERROR(Take("GRADLINK_HIERARCHICAL", env::Flag, &n.hierarchical));
  GL_RETURN_IF_ERROR(Take("GRADLINK_HALF_PARTIALS", env::Flag, &n.half_partials));
  GL_RETURN_IF_ERROR(Take("GRADLINK_CONNECT_TIMEOUT", env::Seconds, &n.connect_timeout));
  GL_RETURN_IF_ERROR(
      Take("GRADLINK_SCHEDULER_RECONNECT", env::Seconds, &n.scheduler_reconnect_timeout));
  GL_RETURN_IF_ERROR(Take("GRADLINK_TIMEOUT", env::Seconds, &n.operation_timeout));
  GL_RETURN_IF_ERROR(TakeSecret(&n.secret));
  GL_RETURN_IF_ERROR(TakeMetricsPort(&n.metrics_port));
  *o = std::move(n);
  return Status::Ok();
}

}  // namespace gradlink
