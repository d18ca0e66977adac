#include "control/member_lanes.h"

#include "control/join.h"
#include "security/lane_auth.h"

namespace gradlink {

Status MemberLanes::Open(const LaneConfig& config, transport::Receiver* push_receiver,
                         transport::Receiver* pull_receiver) {
  GL_ASSIGN_OR_RETURN(fabric_, FabricOrUcx(config.fabric));
  GL_ASSIGN_OR_RETURN(push_, fabric_->CreateLane(config.role + " push lane"));
  if (!config.single_lane) {
    GL_ASSIGN_OR_RETURN(pull_, fabric_->CreateLane(config.role + " pull lane"));
  }
  if (config.secret) {
    auto auth = std::make_shared<const security::LaneAuthenticator>(*config.secret,
                                                                      config.job_hash);
    push_->SetAuthenticator(auth);
    if (pull_) pull_->SetAuthenticator(auth);
  }
  GL_RETURN_IF_ERROR(push_->Start(push_receiver));
  if (pull_) GL_RETURN_IF_ERROR(pull_->Start(pull_receiver));
  return Status::Ok();
}

transport::LaneStats MemberLanes::stats() const {
  transport::LaneStats sum;
  for (const transport::Lane* lane : {push_.get(), pull_.get()}) {
    if (lane != nullptr) sum += lane->stats();
  }
  return sum;
}

void MemberLanes::Stop() {
  if (pull_) pull_->Stop();
  if (push_) push_->Stop();
}

}  // namespace gradlink
