// torch_tpu._C: registration of the "tpu" allocator and the functions behind
// torch.tpu (thin bindings; the work is in runtime, allocator, guard,
// registration and forwarding).
#include <c10/core/Allocator.h>
#include <torch/csrc/Dtype.h>
#include <torch/csrc/Generator.h>
#include <torch/extension.h>

#include <cstdlib>
#include <cstring>
#include <mutex>
#include <optional>
#include <tuple>
#include <unordered_map>

#include "allocator.h"
#include "forwarding.h"
#include "generator.h"
#include "pinned_allocator.h"
#include "registration.h"
#include "runtime.h"
#include "sparse.h"

namespace torch_tpu {
namespace {

const bool kAllocatorRegistered = [] {
  c10::SetAllocator(c10::DeviceType::PrivateUse1, GetTpuAllocator());
  RegisterHostAllocator();
  return true;
}();

py::dict Stats(c10::DeviceIndex device) {
  c10::CachingDeviceAllocator::DeviceStats s =
      GetTpuAllocator()->getDeviceStats(device);
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
              (t.backend == "pjrt" ? " (PJRT)"
               : t.simulated       ? " (simulated)"
                                   : "");
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
std::unordered_map<uint64_t, CapturedProgram>* g_programs =
    new std::unordered_map<uint64_t, CapturedProgram>();
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
  NoteCapture(true);
}

// Ends the capture; the program's handle, or raises why it failed (the
// memory the capture used goes back).
uint64_t CaptureEnd(const std::string& name,
                    const std::vector<uint64_t>& outputs) {
  const int stream = g_capture_stream;
  if (stream >= 0) NoteCapture(false);
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
  NoteCapture(false);
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

void ProgramRun(
    uint64_t id,
    const std::vector<std::tuple<uint64_t, uint64_t, uint64_t>>& bindings,
    uint64_t seed) {
  const CapturedProgram p = Find(id);
  std::vector<tpu::ProgramBinding> b;
  b.reserve(bindings.size());
  for (const auto& [from, bytes, to] : bindings) {
    if (from != to) b.push_back(tpu::ProgramBinding{from, bytes, to});
  }
  const int stream = SessionStream(CurrentStreamId(CurrentDevice()));
  Check(GetSession().RunProgram(stream, p.program, b, seed).status(),
        p.program.name.c_str());
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
  TORCH_CHECK(tg != nullptr,
              "tpu: the default generator is not a tpu generator");
  uint64_t seed = tg->NextOpSeed();
  return seed == 0 ? 1 : seed;  // 0 means "keep the captured seeds"
}

// What a captured graph's call depends on, as _compile._signature computes
// it in Python, in C++ (it runs on every call of a compiled graph): per
// argument, a tensor's device, dtype, shape, strides, offset, storage size and
// which earlier argument's storage it shares; a host scalar tensor's value; a
// Python scalar's type and value. Returns the key as bytes, None when a tensor
// sits on the host (the graph runs eagerly), or False for an argument of
// another kind (the caller computes the key in Python).
py::object ProgramSignature(const py::sequence& args) {
  std::string key;
  key.reserve(args.size() * 96);
  auto put = [&key](int64_t v) {
    key.append(reinterpret_cast<const char*>(&v), sizeof(v));
  };
  std::vector<const void*> storages;
  for (py::handle a : args) {
    PyObject* o = a.ptr();
    if (THPVariable_Check(o)) {
      const at::Tensor& t = THPVariable_Unpack(o);
      if (t.device().type() != c10::DeviceType::PrivateUse1) {
        if (t.dim() != 0 || t.numel() != 1) return py::none();
        const c10::Scalar v = t.item();
        key.push_back('c');
        put(static_cast<int64_t>(t.scalar_type()));
        if (v.isBoolean()) {
          put(v.toBool() ? 1 : 0);
        } else if (v.isIntegral(/*includeBool=*/false)) {
          put(v.toLong());
        } else if (v.isFloatingPoint()) {
          const double d = v.toDouble();
          int64_t bits;
          std::memcpy(&bits, &d, sizeof(bits));
          put(bits);
        } else {
          return py::bool_(false);
        }
        continue;
      }
      key.push_back('t');
      put(t.device().index());
      put(static_cast<int64_t>(t.scalar_type()));
      put(t.dim());
      for (int64_t d : t.sizes()) put(d);
      for (int64_t d : t.strides()) put(d);
      put(t.storage_offset());
      const c10::Storage& st = t.storage();
      put(static_cast<int64_t>(st.nbytes()));
      const void* ptr = st.data();
      size_t index = 0;
      while (index < storages.size() && storages[index] != ptr) ++index;
      if (index == storages.size()) storages.push_back(ptr);
      put(static_cast<int64_t>(index));
    } else if (o == Py_None) {
      key.push_back('n');
    } else if (PyBool_Check(o)) {
      key.push_back(o == Py_True ? 'T' : 'F');
    } else if (PyLong_CheckExact(o)) {
      int overflow = 0;
      const long long v = PyLong_AsLongLongAndOverflow(o, &overflow);
      if (overflow != 0) return py::bool_(false);
      key.push_back('i');
      put(static_cast<int64_t>(v));
    } else if (PyFloat_CheckExact(o)) {
      const double d = PyFloat_AS_DOUBLE(o);
      int64_t bits;
      std::memcpy(&bits, &d, sizeof(bits));
      key.push_back('f');
      put(bits);
    } else {
      return py::bool_(false);
    }
  }
  return py::bytes(key);
}

at::ScalarType DtypeOf(py::handle h) {
  TORCH_CHECK(THPDtype_Check(h.ptr()), "tpu: expected a torch.dtype");
  return reinterpret_cast<THPDtype*>(h.ptr())->scalar_type;
}

// One call of a captured program (what _compile._Program.run does, in C++):
// binds each input storage of the capture to the call's, allocates the
// storages its outputs need anew, runs it on the first tpu argument's device,
// and returns the outputs as tensors on those storages.
//   inputs:  [(arg index, captured address, bytes)]
//   fresh:   [(captured address, bytes, device index)]
//   outputs: [(0, value) | (1, arg index, dtype, shape, strides, offset)
//             | (2, fresh slot, dtype, shape, strides, offset)]
py::list ProgramCall(uint64_t id, const py::sequence& args,
                     const py::list& inputs, const py::list& fresh,
                     const py::list& outputs, uint64_t seed) {
  std::vector<std::tuple<uint64_t, uint64_t, uint64_t>> bindings;
  bindings.reserve(inputs.size() + fresh.size());
  std::optional<c10::Device> device;
  for (py::handle a : args) {
    if (THPVariable_Check(a.ptr())) {
      const at::Tensor& t = THPVariable_Unpack(a.ptr());
      if (t.device().type() == c10::DeviceType::PrivateUse1) {
        device = t.device();
        break;
      }
    }
  }
  auto arg_tensor = [&args](int64_t i) -> const at::Tensor& {
    py::handle h = args[static_cast<size_t>(i)];
    TORCH_CHECK(THPVariable_Check(h.ptr()), "tpu: program argument ", i,
                " is not a tensor");
    return THPVariable_Unpack(h.ptr());
  };
  for (py::handle in : inputs) {
    const auto [i, ptr, bytes] =
        in.cast<std::tuple<int64_t, uint64_t, uint64_t>>();
    bindings.emplace_back(
        ptr, bytes, reinterpret_cast<uint64_t>(arg_tensor(i).storage().data()));
  }
  std::vector<c10::Storage> storages;
  storages.reserve(fresh.size());
  for (py::handle f : fresh) {
    const auto [ptr, bytes, index] =
        f.cast<std::tuple<uint64_t, int64_t, int64_t>>();
    at::Tensor t = at::empty(
        {bytes}, at::TensorOptions().dtype(at::kByte).device(
                     c10::Device(c10::DeviceType::PrivateUse1,
                                 static_cast<c10::DeviceIndex>(index))));
    storages.push_back(t.storage());
    if (ptr != 0) {
      bindings.emplace_back(ptr, static_cast<uint64_t>(bytes),
                            reinterpret_cast<uint64_t>(storages.back().data()));
    }
  }
  {
    std::optional<c10::DeviceGuard> guard;
    if (device.has_value()) guard.emplace(*device);
    ProgramRun(id, bindings, seed);
  }
  py::list out(outputs.size());
  size_t k = 0;
  for (py::handle o : outputs) {
    const py::tuple spec = py::reinterpret_borrow<py::tuple>(o);
    const int kind = spec[0].cast<int>();
    if (kind == 0) {
      out[k++] = spec[1];
      continue;
    }
    const int64_t index = spec[1].cast<int64_t>();
    const c10::Storage storage = kind == 1
                                     ? arg_tensor(index).storage()
                                     : storages.at(static_cast<size_t>(index));
    const auto sizes = spec[3].cast<std::vector<int64_t>>();
    const auto strides = spec[4].cast<std::vector<int64_t>>();
    at::Tensor t = at::empty(
        {0},
        at::TensorOptions().dtype(DtypeOf(spec[2])).device(storage.device()));
    t.set_(storage, spec[5].cast<int64_t>(), sizes, strides);
    out[k++] =
        py::reinterpret_steal<py::object>(THPVariable_Wrap(std::move(t)));
  }
  return out;
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
  if (t.backend != "pjrt" || !Py_IsInitialized()) return;
  py::gil_scoped_acquire gil;
  try {
    py::module_::import("torch_tpu._decomp").attr("install")(t.lowered_ops);
  } catch (py::error_already_set& e) {
    TORCH_WARN(
        "tpu: PyTorch's decompositions are not in use on the PJRT backend (ops "
        "it does "
        "not lower will fail): ",
        e.what());
  }
}

// Called at exit (an atexit handler, before the interpreter finalizes).
// backward() stashes a Python object (the caller's contextvars) in the graph
// task's thread-local state, and the autograd engine's device thread can drop
// the last reference to a finished graph task after the caller has returned.
// If the interpreter is finalizing by then, that decref asks for the GIL,
// Python ends the thread with pthread_exit, and its unwinding through a
// noexcept destructor aborts the process ("terminate called without an
// active exception") after all of its work is done. So a tiny C++-only
// backward runs on every device this process used: a device thread that
// takes a new task has dropped the graph task before it, and the new one
// holds no Python object. Errors are dropped (tpud may be gone by now).
void DrainAutogradDeviceThreads() {
  py::gil_scoped_release no_gil;
  for (c10::DeviceIndex d = 0; d < kMaxDevices; ++d) {
    if (!EverAllocatedOn(d)) continue;
    try {
      at::AutoGradMode grad(true);
      torch::Tensor x = torch::zeros(
          {1}, torch::TensorOptions()
                   .device(c10::Device(c10::DeviceType::PrivateUse1, d))
                   .requires_grad(true));
      torch::autograd::grad({x.sum()}, {x});
    } catch (const std::exception&) {
    }
  }
}

// What the daemon's backend runs decides how ops reach it: installed once,
// when the session opens and the backend is known.
void OnSessionOpened(const tpu::TopologyInfo& t) {
  InstallSendWholeRoutes(t);
  InstallDecompositions(t);
}

}  // namespace
}  // namespace torch_tpu

PYBIND11_MODULE(_C, m) {
  using namespace torch_tpu;
  m.doc() = "torch_tpu native part: the \"tpu\" device through tpud";
  SetSessionOpenedHook(&OnSessionOpened);
  m.def("_device_count", [] { return static_cast<int>(DeviceCount()); });
  m.def("_ensure_session", [] { GetSession(); });
  m.def("_drain_autograd_device_threads", &DrainAutogradDeviceThreads);
  m.def("_current_device", [] { return static_cast<int>(CurrentDevice()); });
  m.def("_set_device",
        [](int d) { SetDevice(static_cast<c10::DeviceIndex>(d)); });
  m.def("_synchronize", [] {
    py::gil_scoped_release no_gil;
    Check(GetSession().SynchronizeAll(), "synchronize");
  });
  m.def("_stats",
        [](int d) { return Stats(static_cast<c10::DeviceIndex>(d)); });
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
  // What this session holds on the chip of device d and what it may hold:
  // torch.tpu.memory_budget, and vLLM's KV cache sizing through it.
  m.def("_session_memory", [](int d) {
    const SessionChipMemory m =
        GetSessionChipMemory(static_cast<c10::DeviceIndex>(d));
    py::dict out;
    out["chip_total_bytes"] = m.chip_total;
    out["session_bytes"] = m.held;
    out["quota_bytes"] = m.quota;
    out["available_bytes"] = m.available;
    return out;
  });
  m.def("_mem_get_info", [](int d) {
    return GetTpuAllocator()->getMemoryInfo(static_cast<c10::DeviceIndex>(d));
  });
  m.def("_properties",
        [](int d) { return Properties(static_cast<c10::DeviceIndex>(d)); });
  m.def("_default_generator", [](int d) {
    return py::reinterpret_steal<py::object>(THPGenerator_initDefaultGenerator(
        DefaultGenerator(static_cast<c10::DeviceIndex>(d))));
  });
  m.def("_backend", [] {
    const tpu::TopologyInfo& t = Topology();
    return py::make_tuple(
        t.backend.empty() ? std::string("simulated") : t.backend,
        t.lowered_ops);
  });
  m.def("_set_eager_fusion", [](bool on) { GetSession().SetEagerFusion(on); });
  m.def("_eager_fusion", [] { return GetSession().eager_fusion(); });
  m.def("_programs", [] {
    // Flush what is held first: its run then counts.
    Check(GetSession().SynchronizeAll(), "synchronize");
    absl::StatusOr<std::vector<tpu::ProgramInfo>> got =
        GetSession().GetPrograms();
    Check(got.status(), "programs");
    py::list out;
    for (const tpu::ProgramInfo& p : *got) {
      py::dict d;
      d["name"] = p.id == ~0u ? std::string("eager (fused)") : p.name;
      d["id"] = p.id == ~0u ? py::object(py::none()) : py::int_(p.id);
      d["chip"] = p.chip;
      d["records"] = p.records;
      d["calls"] = p.calls;
      d["busy_seconds"] = p.busy_seconds;
      d["compiles"] = p.compiles;
      d["last_compile"] = p.last_compile;
      out.append(d);
    }
    return out;
  });
  m.def("_sent_whole_ops", [] {
    std::vector<std::string> names;
    for (const std::string& op : SentWholeOps()) names.push_back("aten::" + op);
    return names;
  });
  m.def("_structured_ops_sent_whole", [] { return StructuredOpsSentWhole(); });
  m.def("_socket", [] { return GetSession().socket_path(); });
  m.def("_session_id", [] { return GetSession().id(); });
  m.def("_sparse_shared_kernels", [] { return SharedSparseKernelNames(); });
  m.def("_register_distributed",
        [m]() mutable { torch_tpu::RegisterDistributed(m); });
  m.def("_capture_begin", &CaptureBegin);
  m.def("_capture_end", &CaptureEnd, py::arg("name"), py::arg("outputs"));
  m.def("_capture_abort", &CaptureAbort);
  m.def("_program_run", &ProgramRun, py::arg("program"), py::arg("bindings"),
        py::arg("seed"));
  m.def("_program_release", &ProgramRelease);
  m.def("_program_info", &ProgramInfo);
  m.def("_next_run_seed", &NextRunSeed);
  m.def("_program_signature", &ProgramSignature);
  m.def("_program_call", &ProgramCall, py::arg("program"), py::arg("args"),
        py::arg("inputs"), py::arg("fresh"), py::arg("outputs"),
        py::arg("seed"));
}
