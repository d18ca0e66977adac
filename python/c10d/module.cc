// _gradlink_c10d: the torch.distributed backend's C++ half (python/c10d/process_group.h). The
// Python half, python/gradlink/torch/_c10d.py, registers the backend "gradlink", does the
// rendezvous through torch's Store and calls create() with the worker that _gradlink made.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <torch/csrc/utils/pybind.h>

#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include "process_group.h"

namespace py = pybind11;

PYBIND11_MODULE(_gradlink_c10d, m) {
  m.doc() = "gradlink's torch.distributed process group (use gradlink.torch)";
  m.attr("torch_version") = TORCH_VERSION;
  m.def(
      "create",
      [](py::capsule worker, int rank, int size, std::vector<uint32_t> members, std::string uid,
         double timeout_s, uint64_t slots) -> c10::intrusive_ptr<gradlink::c10d::ProcessGroupBase> {
        if (std::string(worker.name() ? worker.name() : "") != "gradlink.Worker") {
          throw py::type_error("create: expects gradlink.Worker._shared()'s capsule");
        }
        auto shared = *static_cast<std::shared_ptr<gradlink::Worker>*>(worker.get_pointer());
        const auto timeout = std::chrono::milliseconds(static_cast<int64_t>(timeout_s * 1000));
        return c10::make_intrusive<gradlink::c10d::ProcessGroupGradlink>(
            std::move(shared), rank, size, std::move(members), std::move(uid), timeout, slots);
      },
      py::arg("worker"), py::arg("rank"), py::arg("size"), py::arg("members"), py::arg("uid"),
      py::arg("timeout"), py::arg("slots") = 1,
      "A gradlink process group of `size` ranks (this one `rank`) over `members` (global "
      "ranks, ascending; [] for every worker), named `uid` alike on every member; every "
      "operation's deadline is `timeout` seconds; `slots` keys per signature (process_group.h).");
}
