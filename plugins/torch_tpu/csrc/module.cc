// torch_tpu._C: registration of the "tpu" allocator and the functions behind
// torch.tpu (thin bindings; the work is in runtime/allocator/guard/ops).
#include <c10/core/Allocator.h>
#include <torch/csrc/Generator.h>
#include <torch/extension.h>

#include "allocator.h"
#include "generator.h"
#include "ops.h"
#include "runtime.h"
#include "sparse.h"

namespace torch_tpu {
namespace {

const bool kAllocatorRegistered = [] {
  c10::SetAllocator(c10::DeviceType::PrivateUse1, GetTpuAllocator());
  return true;
}();

py::dict Stats(c10::DeviceIndex device) {
  c10::CachingDeviceAllocator::DeviceStats s = GetTpuAllocator()->getDeviceStats(device);
  py::dict d;
  auto put = [&](const char* name, const c10::CachingAllocator::StatArray& a) {
    d[py::str(std::string(name) + ".all.current")] = a[0].current;
    d[py::str(std::string(name) + ".all.peak")] = a[0].peak;
    d[py::str(std::string(name) + ".all.allocated")] = a[0].allocated;
    d[py::str(std::string(name) + ".all.freed")] = a[0].freed;
  };
  put("allocated_bytes", s.allocated_bytes);
  put("reserved_bytes", s.reserved_bytes);
  put("active_bytes", s.active_bytes);
  put("requested_bytes", s.requested_bytes);
  put("allocation", s.allocation);
  put("segment", s.segment);
  put("active", s.active);
  d["num_alloc_retries"] = s.num_alloc_retries;
  d["num_ooms"] = s.num_ooms;
  d["num_device_alloc"] = s.num_device_alloc;
  d["num_device_free"] = s.num_device_free;
  return d;
}

py::dict Properties(c10::DeviceIndex device) {
  const int chip = ChipOf(device);
  const tpu::TopologyInfo& t = Topology();
  const tpu::ChipInfo& c = t.chips.at(chip);
  py::dict d;
  d["name"] = "TPU " + t.generation.name +
              (t.backend == "pjrt" ? " (PJRT)" : t.simulated ? " (simulated)" : "");
  d["generation"] = t.generation.name;
  d["host"] = t.name;
  d["chip"] = chip;
  d["coords"] = c.coords;
  d["total_memory"] = c.hbm_total_bytes;
  d["hbm_bandwidth_gbytes_per_s"] = t.generation.hbm_bandwidth_gbytes_per_s;
  d["ici_bandwidth_gbytes_per_s"] = t.generation.ici_bandwidth_gbytes_per_s;
  d["peak_bf16_tflops"] = t.generation.peak_bf16_tflops;
  d["tensorcores"] = t.generation.tensorcores_per_chip;
  d["simulated"] = t.simulated;
  d["backend"] = t.backend.empty() ? std::string("simulated") : t.backend;
  return d;
}

}  // namespace

void RegisterDistributed(py::module& m);  // distributed.cc

namespace {

// On a backend that lowers ops (PJRT), every op it does not lower but
// PyTorch can decompose runs as its decomposition (torch_tpu/_decomp.py).
void InstallDecompositions(const tpu::TopologyInfo& t) {
  if (t.backend != "pjrt" || !Py_IsInitialized()) return;
  py::gil_scoped_acquire gil;
  try {
    py::module_::import("torch_tpu._decomp").attr("install")(t.lowered_ops);
  } catch (py::error_already_set& e) {
    TORCH_WARN("tpu: PyTorch's decompositions are not in use on the PJRT backend (ops it does "
               "not lower will fail): ", e.what());
  }
}

}  // namespace
}  // namespace torch_tpu

PYBIND11_MODULE(_C, m) {
  using namespace torch_tpu;
  m.doc() = "torch_tpu native part: the \"tpu\" device through tpud";
  SetSessionOpenedHook(&InstallDecompositions);
  m.def("_device_count", [] { return static_cast<int>(DeviceCount()); });
  m.def("_ensure_session", [] { GetSession(); });
  m.def("_current_device", [] { return static_cast<int>(CurrentDevice()); });
  m.def("_set_device", [](int d) { SetDevice(static_cast<c10::DeviceIndex>(d)); });
  m.def("_synchronize", [] {
    py::gil_scoped_release no_gil;
    Check(GetSession().SynchronizeAll(), "synchronize");
  });
  m.def("_stats", [](int d) { return Stats(static_cast<c10::DeviceIndex>(d)); });
  m.def("_reset_peak_stats", [](int d) {
    GetTpuAllocator()->resetPeakStats(static_cast<c10::DeviceIndex>(d));
  });
  m.def("_reset_accumulated_stats", [](int d) {
    GetTpuAllocator()->resetAccumulatedStats(static_cast<c10::DeviceIndex>(d));
  });
  m.def("_empty_cache", [] {
    py::gil_scoped_release no_gil;
    GetTpuAllocator()->emptyCache({0, 0});
  });
  m.def("_mem_get_info", [](int d) {
    return GetTpuAllocator()->getMemoryInfo(static_cast<c10::DeviceIndex>(d));
  });
  m.def("_properties", [](int d) { return Properties(static_cast<c10::DeviceIndex>(d)); });
  m.def("_default_generator", [](int d) {
    return py::reinterpret_steal<py::object>(
        THPGenerator_initDefaultGenerator(DefaultGenerator(static_cast<c10::DeviceIndex>(d))));
  });
  m.def("_backend", [] {
    const tpu::TopologyInfo& t = Topology();
    return py::make_tuple(t.backend.empty() ? std::string("simulated") : t.backend,
                          t.lowered_ops);
  });
  m.def("_sent_whole_ops", [] {
    std::vector<std::string> names;
    for (const std::string& op : SentWholeOps()) names.push_back("aten::" + op);
    return names;
  });
  m.def("_socket", [] { return GetSession().socket_path(); });
  m.def("_session_id", [] { return GetSession().id(); });
  m.def("_sparse_shared_kernels", [] { return SharedSparseKernelNames(); });
  m.def("_register_distributed", [m]() mutable { torch_tpu::RegisterDistributed(m); });
}
