// Compiled against torch 2.x's headers only (tests/c10d/torch2_build_check.sh): the backend is
// the c10d::Backend of torch 2.x's registration, not 1.13's ProcessGroup, and its collectives
// override the Backend's (a signature that drifted would fail `override` in process_group.h).
#include <type_traits>

#include "python/c10d/process_group.h"

static_assert(TORCH_VERSION_MAJOR >= 2, "these headers are not torch 2.x's");
static_assert(std::is_base_of_v<::c10d::Backend, gradlink::c10d::ProcessGroupGradlink>,
              "on torch 2.x the backend is a c10d::Backend");
static_assert(!std::is_abstract_v<gradlink::c10d::ProcessGroupGradlink>,
              "every pure virtual of torch 2.x's Backend is implemented");
