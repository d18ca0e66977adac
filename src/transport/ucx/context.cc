// UcxFabric (transport::Fabric over one ucp_context), CreateUcxFabric(), and the UCX settings
// read from the environment.
#include "transport/ucx/context.h"

#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <utility>

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

class UcxFabric final : public Fabric {
 public:
  explicit UcxFabric(std::shared_ptr<UcxContext> context) : context_(std::move(context)) {}

  Result<std::unique_ptr<Lane>> CreateLane(std::string name) override {
    return UcxLane::Create(context_, std::move(name));
  }
  std::string_view kind() const override { return "ucx"; }

 private:
  std::shared_ptr<UcxContext> context_;
};

}  // namespace
}  // namespace ucx

Result<std::unique_ptr<Fabric>> CreateUcxFabric() {
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
  s = ucp_init(&params, config, &context->context);
  ucp_config_release(config);
  if (s != UCS_OK) {
    context->context = nullptr;
    return ucx::StartError(s, "ucx: ucp_init");
  }
  return std::unique_ptr<Fabric>(new ucx::UcxFabric(std::move(context)));
}

}  // namespace gradlink::transport
