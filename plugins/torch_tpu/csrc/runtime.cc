#include "runtime.h"

#include <atomic>
#include <cstdlib>
#include <memory>
#include <mutex>
#include <sstream>

#include "absl/synchronization/mutex.h"
#include "tpu/op_error.h"
#include "tpu/paths.h"

namespace torch_tpu {
namespace {

struct Runtime {
  std::once_flag once;
  std::unique_ptr<tpu::Session> session;
  absl::Status open_status;
  tpu::TopologyInfo topology;
  std::vector<int> visible;  // device index -> chip
};

Runtime& R() {
  static Runtime* r = new Runtime();  // never destroyed: ops may run at exit
  return *r;
}

std::vector<int> VisibleChips(int num_chips) {
  std::vector<int> out;
  const char* env = std::getenv("TPU_VISIBLE_CHIPS");
  if (env == nullptr || *env == '\0') {
    for (int c = 0; c < num_chips; ++c) out.push_back(c);
    return out;
  }
  std::stringstream ss(env);
  std::string item;
  while (std::getline(ss, item, ',')) {
    char* end = nullptr;
    long c = std::strtol(item.c_str(), &end, 10);
    // Like CUDA_VISIBLE_DEVICES: the list stops at the first invalid entry.
    if (end == item.c_str() || *end != '\0' || c < 0 || c >= num_chips) break;
    out.push_back(static_cast<int>(c));
  }
  return out;
}

void Open() {
  Runtime& r = R();
  std::call_once(r.once, [&r] {
    // absl's lock-order cycle detection walks a graph on every lock (the
    // library is built without NDEBUG): too dear for the per-op path, where
    // each op and synchronize locks a stream. tpud turns it off too.
    absl::SetMutexDeadlockDetectionMode(absl::OnDeadlockCycle::kIgnore);
    tpu::ClientOptions options;
    options.client_name = "torch_tpu";
    absl::StatusOr<std::unique_ptr<tpu::Session>> s =
        tpu::Session::Open(options);
    if (!s.ok()) {
      r.open_status = s.status();
      return;
    }
    absl::StatusOr<tpu::TopologyInfo> t = (*s)->GetTopology();
    if (!t.ok()) {
      r.open_status = t.status();
      return;
    }
    r.topology = *std::move(t);
    r.visible = VisibleChips(static_cast<int>(r.topology.chips.size()));
    // TPU_EAGER_MODE: direct (each op sent as it is issued) or fused (ops
    // held and sent as programs, tpu::Session::SetEagerFusion); unset or
    // auto: fused where tpud compiles a run of ops whole (PJRT with device
    // memory), else direct.
    const char* mode = std::getenv("TPU_EAGER_MODE");
    const std::string eager = mode == nullptr ? "auto" : mode;
    // TPU_EAGER_RUN_OPS: the most ops one fused run holds (1..1024).
    if (const char* n = std::getenv("TPU_EAGER_RUN_OPS")) {
      char* end = nullptr;
      const long v = std::strtol(n, &end, 10);
      if (end == n || *end != '\0' || v < 1 || v > 1024) {
        r.open_status =
            absl::InvalidArgumentError(std::string("TPU_EAGER_RUN_OPS=") + n +
                                       ": a number of ops, 1 to 1024");
        return;
      }
      (*s)->SetEagerFusion((*s)->eager_fusion(), static_cast<uint32_t>(v));
    }
    if (eager == "fused" || (eager == "auto" && r.topology.fuses)) {
      (*s)->SetEagerFusion(true);
    } else if (eager != "direct" && eager != "auto") {
      r.open_status = absl::InvalidArgumentError(
          "TPU_EAGER_MODE=" + eager + ": the modes are auto, direct and fused");
      return;
    }
    r.session = *std::move(s);
    // A kernel's warning in tpud becomes the caller's, as on the CPU: raised
    // on the thread of the synchronising call that learns of it.
    r.session->SetWarningHandler(
        [](absl::string_view message, bool deprecation) {
          const std::string text(message);
          if (deprecation) {
            c10::warn(c10::Warning(
                c10::DeprecationWarning(),
                {__func__, __FILE__, static_cast<uint32_t>(__LINE__)}, text,
                false));
          } else {
            TORCH_WARN(text);
          }
        });
  });
}

thread_local c10::DeviceIndex tls_device = 0;
thread_local int64_t tls_stream[256] = {};

}  // namespace

void CheckOp(const absl::Status& status, const char* what) {
  if (status.ok()) return;
  // The op's own ATen error: ATen's class and words (they name the op).
  const std::string aten(status.message());
  switch (tpu::AtenErrorOf(status)) {
    case tpu::AtenError::kIndex:
      TORCH_CHECK_INDEX(false, aten);
    case tpu::AtenError::kValue:
      TORCH_CHECK_VALUE(false, aten);
    case tpu::AtenError::kType:
      TORCH_CHECK_TYPE(false, aten);
    case tpu::AtenError::kNotImplemented:
      TORCH_CHECK_NOT_IMPLEMENTED(false, aten);
    case tpu::AtenError::kLinAlg:
      TORCH_CHECK_WITH(LinAlgError, false, aten);
    default:
      Check(status, what);
  }
}

void Check(const absl::Status& status, const char* what) {
  if (status.ok()) return;
  // An ATen kernel's error reported at a later call (a synchronisation):
  // ATen's words, as a RuntimeError, as CUDA reports its kernels' errors.
  const tpu::AtenError aten = tpu::AtenErrorOf(status);
  if (aten == tpu::AtenError::kOutOfMemory) {
    TORCH_CHECK_WITH(OutOfMemoryError, false, "tpu: ", status.message());
  }
  if (aten != tpu::AtenError::kNone) {
    TORCH_CHECK(false, std::string(status.message()));
  }
  if (status.code() == absl::StatusCode::kResourceExhausted) {
    TORCH_CHECK_WITH(OutOfMemoryError, false, "tpu: ", what, ": ",
                     status.ToString());
  }
  TORCH_CHECK(false, "tpu: ", what, ": ", status.ToString());
}

namespace {

std::atomic<void (*)(const tpu::TopologyInfo&)> opened_hook{nullptr};
std::atomic<bool> opened_hook_ran{false};

// After Open: the hook runs once, outside call_once, so that what it does
// (torch_tpu's runs Python under the GIL) cannot deadlock with a thread that
// holds the GIL and waits in Open.
void RunOpenedHook() {
  if (opened_hook_ran.load(std::memory_order_acquire)) return;
  if (R().session == nullptr) return;
  void (*hook)(const tpu::TopologyInfo&) = opened_hook.load();
  if (hook == nullptr || opened_hook_ran.exchange(true)) return;
  hook(R().topology);
}

}  // namespace

void SetSessionOpenedHook(void (*hook)(const tpu::TopologyInfo&)) {
  opened_hook.store(hook);
}

tpu::Session& GetSession() {
  Open();
  RunOpenedHook();
  Runtime& r = R();
  if (r.session == nullptr) {
    Check(r.open_status, "cannot use the \"tpu\" device");
  }
  return *r.session;
}

c10::DeviceIndex DeviceCount() noexcept {
  try {
    Open();
  } catch (...) {
    return 0;
  }
  return R().session == nullptr
             ? 0
             : static_cast<c10::DeviceIndex>(R().visible.size());
}

const tpu::TopologyInfo& Topology() {
  GetSession();
  return R().topology;
}

int ChipOf(c10::DeviceIndex device) {
  GetSession();
  const auto& v = R().visible;
  TORCH_CHECK(
      device >= 0 && device < static_cast<c10::DeviceIndex>(v.size()),
      "tpu: device ", static_cast<int>(device),
      " does not exist (this process sees ", v.size(), " tpu device(s)",
      std::getenv("TPU_VISIBLE_CHIPS") ? ", narrowed by TPU_VISIBLE_CHIPS" : "",
      ")");
  return v[device];
}

c10::DeviceIndex CurrentDevice() { return tls_device; }

void SetDevice(c10::DeviceIndex device) {
  ChipOf(device);  // validates
  tls_device = device;
}

int64_t CurrentStreamId(c10::DeviceIndex device) {
  return tls_stream[static_cast<uint8_t>(device)];
}

void SetCurrentStreamId(c10::DeviceIndex device, int64_t id) {
  TORCH_CHECK(id >= 0 && id < tpu::kNumStreams, "tpu: no stream ", id,
              " (streams are 0..", tpu::kNumStreams - 1,
              "; get one with torch.tpu.Stream())");
  tls_stream[static_cast<uint8_t>(device)] = id;
}

}  // namespace torch_tpu
