// torch_tpu._C: registration of the "tpu" allocator and the functions behind
// torch.tpu (thin bindings; the work is in runtime/allocator/guard/ops).
#include <c10/core/Allocator.h>
#include <torch/csrc/Generator.h>
#include <torch/extension.h>

#include <mutex>
#include <tuple>
#include <unordered_map>

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

// ---- captured programs (torch.compile(backend="tpu"); torch_tpu/_compile.py)

struct CapturedProgram {
  tpu::Program program;
  uint64_t hold = 0;
  int stream = 0;
};
std::mutex g_programs_mu;
std::unordered_map<uint64_t, CapturedProgram>* g_programs = new std::unordered_map<uint64_t, CapturedProgram>();
uint64_t g_next_program = 0;
int g_capture_stream = -1;

void CaptureBegin() {
  const c10::DeviceIndex device = CurrentDevice();
  const int stream = SessionStream(CurrentStreamId(device));
  BeginCaptureHold();
  absl::Status st = GetSession().BeginCapture(stream);
  if (!st.ok()) ReleaseCaptureHold(EndCaptureHold({}));
  Check(st, "beginning a capture");
  g_capture_stream = stream;
}

// Ends the capture; the program's handle, or raises why it failed (the
// memory the capture used goes back).
uint64_t CaptureEnd(const std::string& name, const std::vector<uint64_t>& outputs) {
  const int stream = g_capture_stream;
  g_capture_stream = -1;
  absl::StatusOr<tpu::Program> p = GetSession().EndCapture(stream, name);
  const uint64_t hold = EndCaptureHold(outputs);
  if (!p.ok()) {
    ReleaseCaptureHold(hold);
    Check(p.status(), "capturing a program");
  }
  std::lock_guard<std::mutex> lock(g_programs_mu);
  const uint64_t id = ++g_next_program;
  (*g_programs)[id] = CapturedProgram{*p, hold, stream};
  return id;
}

void CaptureAbort() {
  if (g_capture_stream < 0) return;
  (void)GetSession().EndCapture(g_capture_stream, "");
  g_capture_stream = -1;
  ReleaseCaptureHold(EndCaptureHold({}));
}

CapturedProgram Find(uint64_t id) {
  std::lock_guard<std::mutex> lock(g_programs_mu);
  auto it = g_programs->find(id);
  TORCH_CHECK(it != g_programs->end(), "tpu: no program ", id, " (released?)");
  return it->second;
}

void ProgramRun(uint64_t id, const std::vector<std::tuple<uint64_t, uint64_t, uint64_t>>& bindings,
                uint64_t seed) {
  const CapturedProgram p = Find(id);
  std::vector<tpu::ProgramBinding> b;
  b.reserve(bindings.size());
  for (const auto& [from, bytes, to] : bindings) {
    if (from != to) b.push_back(tpu::ProgramBinding{from, bytes, to});
  }
  const int stream = SessionStream(CurrentStreamId(CurrentDevice()));
  Check(GetSession().RunProgram(stream, p.program, b, seed).status(), p.program.name.c_str());
}

void ProgramRelease(uint64_t id) {
  CapturedProgram p;
  {
    std::lock_guard<std::mutex> lock(g_programs_mu);
    auto it = g_programs->find(id);
    if (it == g_programs->end()) return;
    p = it->second;
    g_programs->erase(it);
  }
  // Runs still queued read its records and its memory.
  (void)GetSession().WaitIdle();
  (void)GetSession().ReleaseProgram(p.program);
  ReleaseCaptureHold(p.hold);
}

// A program run's seed, from the device's default generator (what its
// random ops would have drawn one by one in eager mode).
uint64_t NextRunSeed() {
  at::Generator gen = DefaultGenerator(CurrentDevice());
  std::lock_guard<std::mutex> lock(gen.mutex());
  auto* tg = dynamic_cast<TpuGenerator*>(gen.unsafeGetGeneratorImpl());
  TORCH_CHECK(tg != nullptr, "tpu: the default generator is not a tpu generator");
  uint64_t seed = tg->NextOpSeed();
  return seed == 0 ? 1 : seed;  // 0 means "keep the captured seeds"
}

py::dict ProgramInfo(uint64_t id) {
  const CapturedProgram p = Find(id);
  py::dict d;
  d["name"] = p.program.name;
  d["records"] = p.program.num_records;
  d["bytes"] = p.program.bytes;
  d["chip"] = p.program.chip;
  d["held_bytes"] = CaptureHoldBytes(p.hold);
  return d;
}

}  // namespace

namespace {

// On a backend that lowers ops (PJRT), every op it does not lower but
// PyTorch can decompose runs as its decomposition (torch_tpu/_decomp.py).
void InstallDecompositions(const tpu::TopologyInfo& t) {
  if (t.backend != "pjrt") SendForeachOpsWhole();
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
  m.def("_capture_begin", &CaptureBegin);
  m.def("_capture_end", &CaptureEnd, py::arg("name"), py::arg("outputs"));
  m.def("_capture_abort", &CaptureAbort);
  m.def("_program_run", &ProgramRun, py::arg("program"), py::arg("bindings"), py::arg("seed"));
  m.def("_program_release", &ProgramRelease);
  m.def("_program_info", &ProgramInfo);
  m.def("_next_run_seed", &NextRunSeed);
}
