// UcxFabric (transport::Fabric over one ucp_context), CreateUcxFabric(), and the UCX settings
// read from the environment.
#include "transport/ucx/context.h"

#include <algorithm>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "common/env.h"
#include "transport/transport.h"
#include "transport/ucx/status.h"
#include "transport/ucx/ucx_lane.h"

namespace gradlink::transport {
namespace ucx {

ucp_err_handling_mode_t PeerErrorMode() {
  static const ucp_err_handling_mode_t mode = [] {
    return env::Get("GRADLINK_UCX_ERROR_MODE") == std::optional<std::string>("none")
               ? UCP_ERR_HANDLING_MODE_NONE
               : UCP_ERR_HANDLING_MODE_PEER;
  }();
  return mode;
}

namespace {

// UCX settings gradlink's data path depends on for speed, applied to its own context when the
// environment does not set them (docs/operations.md, "What gradlink tunes"):
//  - TCP receive buffers of 64 KiB (the kernel doubles them): each connection keeps about
//    128 KiB in flight instead of the megabytes autotuning allows, so that the n pushes of a
//    partition reach a server together and the queues on shared links stay short;
//  - send and receive segments of 68 KiB instead of 8 and 64 KiB: a 64 KiB partition (the
//    network default) travels in one segment with gradlink's and UCP's headers. In two (UCP's
//    "long AM", as with 64 KiB segments) the receiver reassembles it in a descriptor UCX
//    mallocs: an allocation and a copy more per message (bench/RESULTS.md, "The servers' data
//    path"); 8 KiB send segments also cost 8 times the send calls. Lanes refuse a peer that
//    receives smaller segments than this process sends (segments.h).
constexpr std::pair<const char*, const char*> kGradlinkDefaults[] = {
    {"TCP_RCVBUF", "64k"},
    {"TCP_TX_SEG_SIZE", "68k"},
    {"TCP_RX_SEG_SIZE", "68k"},
};

class UcxFabric final : public Fabric {
 public:
  UcxFabric(std::shared_ptr<UcxContext> context, std::vector<std::string> settings)
      : context_(std::move(context)), settings_(std::move(settings)) {}

  Result<std::unique_ptr<Lane>> CreateLane(std::string name) override {
    return UcxLane::Create(context_, std::move(name));
  }
  std::string_view kind() const override { return "ucx"; }
  std::vector<std::string> settings() const override { return settings_; }
  std::vector<std::string> device_memory() const override {
    ucp_context_attr_t attr{};
    attr.field_mask = UCP_ATTR_FIELD_MEMORY_TYPES;
    std::vector<std::string> out;
    if (ucp_context_query(context_->context, &attr) != UCS_OK) return out;
    for (int t = 0; t < UCS_MEMORY_TYPE_LAST; ++t) {
      if (t != UCS_MEMORY_TYPE_HOST && (attr.memory_types & (uint64_t{1} << t)) != 0) {
        out.emplace_back(ucs_memory_type_names[t]);
      }
    }
    return out;
  }

 private:
  std::shared_ptr<UcxContext> context_;
  std::vector<std::string> settings_;
};

}  // namespace
}  // namespace ucx

Result<std::unique_ptr<Fabric>> CreateUcxFabric() {
  // Set in the environment, not by ucp_config_modify: on UCX 1.13 a modified TCP_RCVBUF
  // reaches the sockets a lane connects but not those its listener accepts (ss -tm). Once per
  // process, before UCX reads it, and never over the user's value.
  static const std::vector<std::string> applied = [] {
    std::vector<std::string> set;
    for (const auto& [name, value] : ucx::kGradlinkDefaults) {
      const std::string var = std::string("UCX_") + name;
      if (env::SetIfUnset(var.c_str(), value)) set.push_back(var);
    }
    return set;
  }();
  std::vector<std::string> settings = env::Listed("UCX_");
  for (std::string& v : settings) {
    const std::string var = v.substr(0, v.find('='));
    if (std::find(applied.begin(), applied.end(), var) != applied.end()) v += " (set by gradlink)";
  }
  // ucp_config_read picks up UCX_TLS, UCX_NET_DEVICES etc. from the environment.
  ucp_config_t* config = nullptr;
  ucs_status_t s = ucp_config_read(nullptr, nullptr, &config);
  if (s != UCS_OK) return ucx::StartError(s, "ucx: ucp_config_read");
  ucp_params_t params{};
  params.field_mask =
      UCP_PARAM_FIELD_FEATURES | UCP_PARAM_FIELD_MT_WORKERS_SHARED | UCP_PARAM_FIELD_NAME;
  params.features = UCP_FEATURE_AM | UCP_FEATURE_WAKEUP;
  // Lanes run their workers on different threads; shared context state must be locked.
  params.mt_workers_shared = 1;
  params.name = "gradlink";
  auto context = std::make_shared<ucx::UcxContext>();
  context->segments =
      ucx::SegmentsOf(env::GetSet("UCX_TCP_TX_SEG_SIZE"), env::GetSet("UCX_TCP_RX_SEG_SIZE"));
  s = ucp_init(&params, config, &context->context);
  ucp_config_release(config);
  if (s != UCS_OK) {
    context->context = nullptr;
    return ucx::StartError(s, "ucx: ucp_init");
  }
  return std::unique_ptr<Fabric>(new ucx::UcxFabric(std::move(context), std::move(settings)));
}

}  // namespace gradlink::transport
