#include "daemon/backends/pjrt/pjrt_plugin.h"

#include <dlfcn.h>

#include <algorithm>
#include <cstddef>
#include <cstdlib>
#include <cstring>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace tpud::pjrt {
namespace {

// Each C API argument struct, zeroed, with its struct_size set (the size of
// this header's version: a newer plugin reads only what we gave).
template <typename T>
T Args(size_t size) {
  T args;
  std::memset(&args, 0, sizeof(args));
  args.struct_size = size;
  return args;
}
#define TPUD_ARGS(T) Args<T>(T##_STRUCT_SIZE)

absl::StatusCode CodeOf(PJRT_Error_Code code) {
  // PJRT's codes are absl's (both are Google's canonical codes).
  const int c = static_cast<int>(code);
  return c >= 0 && c <= 16 ? static_cast<absl::StatusCode>(c)
                           : absl::StatusCode::kUnknown;
}

// CompileOptionsProto, written by hand (three fields; tpud does not link
// XLA's protos): executable_build_options (3) { num_replicas (4): 1,
// num_partitions (5): 1 }, compile_portable_executable (4): true. An empty
// message aborts XLA ("replica_count > 0").
constexpr char kCompileOptions[] = {0x1a, 0x04, 0x20, 0x01,
                                    0x28, 0x01, 0x20, 0x01};

// Protobuf wire format, for the few option messages written here.
void AppendVarint(std::string* out, uint64_t v) {
  while (v >= 0x80) {
    out->push_back(static_cast<char>((v & 0x7f) | 0x80));
    v >>= 7;
  }
  out->push_back(static_cast<char>(v));
}
void AppendVarintField(std::string* out, int field, uint64_t v) {
  AppendVarint(out, static_cast<uint64_t>(field) << 3);
  AppendVarint(out, v);
}
void AppendBytesField(std::string* out, int field, const std::string& bytes) {
  AppendVarint(out, (static_cast<uint64_t>(field) << 3) | 2);
  AppendVarint(out, bytes.size());
  out->append(bytes);
}

}  // namespace

absl::StatusOr<CreateOption> ParseCreateOption(absl::string_view text) {
  const size_t eq = text.find('=');
  if (eq == absl::string_view::npos || eq == 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("--pjrt_option \"", text, "\": expected name=value"));
  }
  CreateOption o;
  o.name = std::string(text.substr(0, eq));
  absl::string_view value = text.substr(eq + 1);
  std::string type;
  for (const char* t : {"int64", "string", "bool", "float"}) {
    if (absl::StartsWith(value, absl::StrCat(t, ":"))) {
      type = t;
      value.remove_prefix(type.size() + 1);
      break;
    }
  }
  int64_t i = 0;
  float f = 0;
  if (type.empty()) {
    if (absl::SimpleAtoi(value, &i)) {
      type = "int64";
    } else if (value == "true" || value == "false") {
      type = "bool";
    } else if (value.find('.') != absl::string_view::npos &&
               absl::SimpleAtof(value, &f)) {
      type = "float";
    } else {
      type = "string";
    }
  }
  auto bad = [&] {
    return absl::InvalidArgumentError(absl::StrCat(
        "--pjrt_option ", o.name, ": \"", value, "\" is not a ", type));
  };
  if (type == "int64") {
    if (!absl::SimpleAtoi(value, &o.int64_value)) return bad();
    o.type = PJRT_NamedValue_kInt64;
  } else if (type == "bool") {
    if (value != "true" && value != "false") return bad();
    o.bool_value = value == "true";
    o.type = PJRT_NamedValue_kBool;
  } else if (type == "float") {
    if (!absl::SimpleAtof(value, &o.float_value)) return bad();
    o.type = PJRT_NamedValue_kFloat;
  } else {
    o.string_value = std::string(value);
    o.type = PJRT_NamedValue_kString;
  }
  return o;
}

// ---------------------------------------------------------------- handles

Buffer& Buffer::operator=(Buffer&& o) noexcept {
  if (this != &o) {
    this->~Buffer();
    plugin_ = o.plugin_;
    buffer_ = std::exchange(o.buffer_, nullptr);
    released_ = std::exchange(o.released_, nullptr);
  }
  return *this;
}

Buffer::~Buffer() {
  if (buffer_ == nullptr || plugin_ == nullptr) return;
  auto args = TPUD_ARGS(PJRT_Buffer_Destroy_Args);
  args.buffer = buffer_;
  (void)plugin_->Check(plugin_->api()->PJRT_Buffer_Destroy(&args),
                       "destroying a buffer");
  buffer_ = nullptr;
  if (released_ != nullptr) {
    (void)plugin_->Await(std::exchange(released_, nullptr),
                         "releasing host memory");
  }
}

Executable::~Executable() {
  auto args = TPUD_ARGS(PJRT_LoadedExecutable_Destroy_Args);
  args.executable = exe_;
  (void)plugin_->Check(plugin_->api()->PJRT_LoadedExecutable_Destroy(&args),
                       "destroying an executable");
}

// ---------------------------------------------------------------- plugin

bool PjrtPlugin::Provides(size_t offset) const {
  if (api_ == nullptr || offset + sizeof(void*) > api_->struct_size)
    return false;
  void* fn = nullptr;
  std::memcpy(&fn, reinterpret_cast<const char*>(api_) + offset, sizeof(fn));
  return fn != nullptr;
}

absl::Status PjrtPlugin::Check(PJRT_Error* error,
                               absl::string_view what) const {
  if (error == nullptr) return absl::OkStatus();
  auto msg = TPUD_ARGS(PJRT_Error_Message_Args);
  msg.error = error;
  api_->PJRT_Error_Message(&msg);
  auto code = TPUD_ARGS(PJRT_Error_GetCode_Args);
  code.error = error;
  PJRT_Error* code_error = api_->PJRT_Error_GetCode(&code);
  const absl::StatusCode c =
      code_error == nullptr ? CodeOf(code.code) : absl::StatusCode::kUnknown;
  std::string text = absl::StrCat(
      what, ": ", absl::string_view(msg.message, msg.message_size));
  auto destroy = TPUD_ARGS(PJRT_Error_Destroy_Args);
  destroy.error = error;
  api_->PJRT_Error_Destroy(&destroy);
  if (code_error != nullptr) {
    destroy.error = code_error;
    api_->PJRT_Error_Destroy(&destroy);
  }
  return absl::Status(
      c == absl::StatusCode::kOk ? absl::StatusCode::kUnknown : c, text);
}

absl::StatusOr<std::unique_ptr<PjrtPlugin>> PjrtPlugin::Load(
    const std::string& path, const std::vector<CreateOption>& options) {
  std::unique_ptr<PjrtPlugin> p(new PjrtPlugin());
  p->path_ = path;
  p->handle_ = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (p->handle_ == nullptr) {
    const char* e = dlerror();
    return absl::FailedPreconditionError(
        absl::StrCat("cannot load PJRT plugin ", path, ": ",
                     e != nullptr ? e : "dlopen failed"));
  }
  using GetApi = const PJRT_Api* (*)();
  auto get = reinterpret_cast<GetApi>(dlsym(p->handle_, "GetPjrtApi"));
  if (get == nullptr) {
    return absl::FailedPreconditionError(
        absl::StrCat(path, " is not a PJRT plugin: it exports no GetPjrtApi"));
  }
  p->api_ = get();
  if (p->api_ == nullptr) {
    return absl::FailedPreconditionError(
        absl::StrCat(path, ": GetPjrtApi returned null"));
  }
  if (p->api_->struct_size <
      offsetof(PJRT_Api, PJRT_Client_BufferFromHostBuffer) + sizeof(void*)) {
    return absl::FailedPreconditionError(
        absl::StrCat(path, ": its PJRT_Api (", p->api_->struct_size,
                     " bytes) is too old for tpud"));
  }
  p->api_major_ = p->api_->pjrt_api_version.major_version;
  p->api_minor_ = p->api_->pjrt_api_version.minor_version;
  if (p->api_major_ != PJRT_API_MAJOR) {
    return absl::FailedPreconditionError(absl::StrCat(
        path, " speaks PJRT API ", p->api_major_, ".", p->api_minor_,
        "; tpud was built for ", PJRT_API_MAJOR, ".", PJRT_API_MINOR));
  }
  if (absl::Status st = p->Init(options); !st.ok()) {
    return absl::Status(st.code(),
                        absl::StrCat("PJRT plugin ", path, ": ", st.message()));
  }
  return p;
}

absl::Status PjrtPlugin::Init(const std::vector<CreateOption>& options) {
  if (auto* init = TPUD_PJRT_FN(this, PJRT_Plugin_Initialize)) {
    auto args = TPUD_ARGS(PJRT_Plugin_Initialize_Args);
    if (absl::Status st = Check(init(&args), "initialising"); !st.ok())
      return st;
  }
  std::vector<PJRT_NamedValue> values(options.size());
  for (size_t i = 0; i < options.size(); ++i) {
    const CreateOption& o = options[i];
    PJRT_NamedValue& v = values[i];
    std::memset(&v, 0, sizeof(v));
    v.struct_size = PJRT_NamedValue_STRUCT_SIZE;
    v.name = o.name.c_str();
    v.name_size = o.name.size();
    v.type = o.type;
    v.value_size = 1;
    switch (o.type) {
      case PJRT_NamedValue_kString:
        v.string_value = o.string_value.c_str();
        v.value_size = o.string_value.size();
        break;
      case PJRT_NamedValue_kInt64:
        v.int64_value = o.int64_value;
        break;
      case PJRT_NamedValue_kFloat:
        v.float_value = o.float_value;
        break;
      case PJRT_NamedValue_kBool:
        v.bool_value = o.bool_value;
        break;
      default:
        break;
    }
  }
  auto create = TPUD_ARGS(PJRT_Client_Create_Args);
  create.create_options = values.data();
  create.num_options = values.size();
  if (absl::Status st =
          Check(api_->PJRT_Client_Create(&create), "creating the client");
      !st.ok()) {
    return st;
  }
  client_ = create.client;

  auto name = TPUD_ARGS(PJRT_Client_PlatformName_Args);
  name.client = client_;
  if (absl::Status st =
          Check(api_->PJRT_Client_PlatformName(&name), "platform name");
      !st.ok()) {
    return st;
  }
  platform_name_.assign(name.platform_name, name.platform_name_size);
  auto version = TPUD_ARGS(PJRT_Client_PlatformVersion_Args);
  version.client = client_;
  if (Check(api_->PJRT_Client_PlatformVersion(&version), "platform version")
          .ok()) {
    platform_version_.assign(version.platform_version,
                             version.platform_version_size);
  }

  auto devs = TPUD_ARGS(PJRT_Client_AddressableDevices_Args);
  devs.client = client_;
  if (absl::Status st =
          Check(api_->PJRT_Client_AddressableDevices(&devs), "listing devices");
      !st.ok()) {
    return st;
  }
  if (devs.num_addressable_devices == 0) {
    return absl::NotFoundError("the plugin has no addressable devices");
  }
  for (size_t i = 0; i < devs.num_addressable_devices; ++i) {
    PJRT_Device* d = devs.addressable_devices[i];
    device_handles_.push_back(d);
    DeviceInfo info;
    auto get = TPUD_ARGS(PJRT_Device_GetDescription_Args);
    get.device = d;
    if (absl::Status st =
            Check(api_->PJRT_Device_GetDescription(&get), "device description");
        !st.ok()) {
      return st;
    }
    auto id = TPUD_ARGS(PJRT_DeviceDescription_Id_Args);
    id.device_description = get.device_description;
    if (Check(api_->PJRT_DeviceDescription_Id(&id), "device id").ok())
      info.id = id.id;
    auto kind = TPUD_ARGS(PJRT_DeviceDescription_Kind_Args);
    kind.device_description = get.device_description;
    if (Check(api_->PJRT_DeviceDescription_Kind(&kind), "device kind").ok()) {
      info.kind.assign(kind.device_kind, kind.device_kind_size);
    }
    auto str = TPUD_ARGS(PJRT_DeviceDescription_ToString_Args);
    str.device_description = get.device_description;
    if (Check(api_->PJRT_DeviceDescription_ToString(&str), "device string")
            .ok()) {
      info.description.assign(str.to_string, str.to_string_size);
    }
    auto attrs = TPUD_ARGS(PJRT_DeviceDescription_Attributes_Args);
    attrs.device_description = get.device_description;
    if (Check(api_->PJRT_DeviceDescription_Attributes(&attrs),
              "device attributes")
            .ok()) {
      for (size_t a = 0; a < attrs.num_attributes; ++a) {
        const PJRT_NamedValue& v = attrs.attributes[a];
        if (absl::string_view(v.name, v.name_size) == "coords" &&
            v.type == PJRT_NamedValue_kInt64List) {
          info.coords.assign(v.int64_array_value,
                             v.int64_array_value + v.value_size);
        }
      }
    }
    if (auto* stats_fn = TPUD_PJRT_FN(this, PJRT_Device_MemoryStats)) {
      auto stats = TPUD_ARGS(PJRT_Device_MemoryStats_Args);
      stats.device = d;
      // Not every plugin keeps stats (the CPU plugin does not): then the
      // capacity comes from --hbm.
      if (Check(stats_fn(&stats), "memory stats").ok() &&
          stats.bytes_limit_is_set) {
        info.bytes_limit = stats.bytes_limit;
      }
    }
    devices_.push_back(std::move(info));
  }
  // Chip i of tpud is device TorusOrder()[i] of the plugin (libtpu lists its
  // devices in an order of its own).
  const std::vector<size_t> order = TorusOrder(devices_);
  std::vector<DeviceInfo> devices;
  std::vector<PJRT_Device*> handles;
  for (size_t i : order) {
    devices.push_back(std::move(devices_[i]));
    handles.push_back(device_handles_[i]);
  }
  devices_ = std::move(devices);
  device_handles_ = std::move(handles);
  return absl::OkStatus();
}

std::vector<size_t> TorusOrder(const std::vector<DeviceInfo>& devices) {
  std::vector<size_t> order(devices.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  if (devices.empty() || devices[0].coords.empty()) return order;
  for (const DeviceInfo& d : devices) {
    if (d.coords.size() != devices[0].coords.size()) return order;
  }
  // Compared from the last axis to the first: the first varies fastest.
  auto before = [&](size_t a, size_t b) {
    return std::lexicographical_compare(
        devices[a].coords.rbegin(), devices[a].coords.rend(),
        devices[b].coords.rbegin(), devices[b].coords.rend());
  };
  std::vector<size_t> sorted = order;
  std::stable_sort(sorted.begin(), sorted.end(), before);
  for (size_t i = 1; i < sorted.size(); ++i) {
    if (devices[sorted[i - 1]].coords == devices[sorted[i]].coords)
      return order;  // shared: no order
  }
  return sorted;
}

PjrtPlugin::~PjrtPlugin() {
  if (client_ != nullptr) {
    auto args = TPUD_ARGS(PJRT_Client_Destroy_Args);
    args.client = client_;
    (void)Check(api_->PJRT_Client_Destroy(&args), "destroying the client");
  }
  // The plugin stays loaded: plugins keep threads and static state that
  // do not survive dlclose.
}

std::string PjrtPlugin::Describe() const {
  std::string file = path_;
  const size_t slash = file.rfind('/');
  if (slash != std::string::npos) file = file.substr(slash + 1);
  return absl::StrCat(
      file, ": PJRT API ", api_major_, ".", api_minor_, ", platform ",
      platform_name_,
      platform_version_.empty() || platform_version_ == platform_name_
          ? ""
          : " " + platform_version_);
}

absl::Status PjrtPlugin::Await(PJRT_Event* event,
                               absl::string_view what) const {
  if (event == nullptr) return absl::OkStatus();
  auto await = TPUD_ARGS(PJRT_Event_Await_Args);
  await.event = event;
  absl::Status st = Check(api_->PJRT_Event_Await(&await), what);
  auto destroy = TPUD_ARGS(PJRT_Event_Destroy_Args);
  destroy.event = event;
  (void)Check(api_->PJRT_Event_Destroy(&destroy), "destroying an event");
  return st;
}

absl::StatusOr<std::unique_ptr<Executable>> PjrtPlugin::Compile(
    absl::string_view mlir) const {
  return CompileWith(mlir, PortableOptions());
}

std::string PjrtPlugin::PortableOptions() {
  return std::string(kCompileOptions, sizeof(kCompileOptions));
}

absl::StatusOr<std::string> PjrtPlugin::ReplicatedOptions(
    absl::Span<const int> devices) const {
  if (devices.empty())
    return absl::InvalidArgumentError("a replicated program needs a device");
  std::string
      ids;  // DeviceAssignmentProto.ComputationDevice.replica_device_ids
  for (size_t r = 0; r < devices.size(); ++r) {
    const int d = devices[r];
    if (d < 0 || d >= num_devices())
      return absl::InvalidArgumentError(absl::StrCat("no device ", d));
    for (size_t q = 0; q < r; ++q) {
      if (devices[q] == d)
        return absl::InvalidArgumentError(
            absl::StrCat("device ", d, " named twice"));
    }
    AppendVarintField(&ids, 1, static_cast<uint64_t>(devices_[d].id));
  }
  std::string assignment;                             // DeviceAssignmentProto
  AppendVarintField(&assignment, 1, devices.size());  // replica_count
  AppendVarintField(&assignment, 2, 1);               // computation_count
  AppendBytesField(&assignment, 3, ids);              // computation_devices
  std::string build;                             // ExecutableBuildOptionsProto
  AppendVarintField(&build, 4, devices.size());  // num_replicas
  AppendVarintField(&build, 5, 1);               // num_partitions
  AppendBytesField(&build, 9, assignment);       // device_assignment
  std::string
      options;  // CompileOptionsProto; not portable: its devices are fixed
  AppendBytesField(&options, 3, build);
  return options;
}

absl::StatusOr<std::unique_ptr<Executable>> PjrtPlugin::CompileReplicated(
    absl::string_view mlir, absl::Span<const int> devices) const {
  absl::StatusOr<std::string> options = ReplicatedOptions(devices);
  if (!options.ok()) return options.status();
  absl::StatusOr<std::unique_ptr<Executable>> exe = CompileWith(mlir, *options);
  if (!exe.ok()) return exe.status();
  if (absl::Status st = PlaceReplicas(**exe, devices); !st.ok()) return st;
  return exe;
}

absl::Status PjrtPlugin::PlaceReplicas(Executable& exe,
                                       absl::Span<const int> devices) const {
  // The order its argument lists take the devices in is the executable's.
  auto listed = TPUD_ARGS(PJRT_LoadedExecutable_AddressableDevices_Args);
  listed.executable = exe.get();
  if (absl::Status st =
          Check(api_->PJRT_LoadedExecutable_AddressableDevices(&listed),
                "replica devices");
      !st.ok()) {
    return st;
  }
  exe.replica_devices_.clear();
  for (size_t i = 0; i < listed.num_addressable_devices; ++i) {
    int found = -1;
    for (int d = 0; d < num_devices(); ++d) {
      if (device_handles_[d] == listed.addressable_devices[i]) found = d;
    }
    if (found < 0)
      return absl::InternalError(
          "a replicated program on a device the client does not list");
    exe.replica_devices_.push_back(found);
  }
  if (exe.replica_devices_.size() != devices.size()) {
    return absl::InternalError(
        absl::StrCat("the plugin placed a program of ", devices.size(),
                     " replicas on ", exe.replica_devices_.size(), " devices"));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<Executable>> PjrtPlugin::CompileWith(
    absl::string_view mlir, const std::string& options) const {
  auto program = TPUD_ARGS(PJRT_Program);
  std::string code(mlir);
  program.code = code.data();
  program.code_size = code.size();
  static constexpr char kFormat[] = "mlir";
  program.format = kFormat;
  program.format_size = sizeof(kFormat) - 1;
  auto args = TPUD_ARGS(PJRT_Client_Compile_Args);
  args.client = client_;
  args.program = &program;
  args.compile_options = options.data();
  args.compile_options_size = options.size();
  if (absl::Status st = Check(api_->PJRT_Client_Compile(&args), "compiling");
      !st.ok())
    return st;
  return Loaded(args.executable);
}

absl::StatusOr<std::unique_ptr<Executable>> PjrtPlugin::Loaded(
    PJRT_LoadedExecutable* loaded) const {
  // Its output count, from the executable behind it.
  auto get = TPUD_ARGS(PJRT_LoadedExecutable_GetExecutable_Args);
  get.loaded_executable = loaded;
  int outputs = -1;
  if (Check(api_->PJRT_LoadedExecutable_GetExecutable(&get), "executable")
          .ok()) {
    auto num = TPUD_ARGS(PJRT_Executable_NumOutputs_Args);
    num.executable = get.executable;
    if (Check(api_->PJRT_Executable_NumOutputs(&num), "output count").ok()) {
      outputs = static_cast<int>(num.num_outputs);
    }
    auto destroy = TPUD_ARGS(PJRT_Executable_Destroy_Args);
    destroy.executable = get.executable;
    (void)Check(api_->PJRT_Executable_Destroy(&destroy),
                "destroying an executable");
  }
  auto exe = std::make_unique<Executable>(this, loaded, outputs);
  if (outputs < 0)
    return absl::InternalError(
        "the plugin did not say how many outputs it has");
  return exe;
}

bool PjrtPlugin::Serializes() const {
  return TPUD_PJRT_FN(this, PJRT_Executable_Serialize) != nullptr &&
         TPUD_PJRT_FN(this, PJRT_Executable_DeserializeAndLoad) != nullptr;
}

absl::StatusOr<std::string> PjrtPlugin::Serialize(const Executable& exe) const {
  if (!Serializes())
    return absl::UnimplementedError(
        "the PJRT plugin cannot serialize executables");
  auto get = TPUD_ARGS(PJRT_LoadedExecutable_GetExecutable_Args);
  get.loaded_executable = exe.get();
  if (absl::Status st =
          Check(api_->PJRT_LoadedExecutable_GetExecutable(&get), "executable");
      !st.ok())
    return st;
  auto args = TPUD_ARGS(PJRT_Executable_Serialize_Args);
  args.executable = get.executable;
  absl::Status st =
      Check(api_->PJRT_Executable_Serialize(&args), "serializing a program");
  std::string bytes;
  if (st.ok()) {
    bytes.assign(args.serialized_bytes, args.serialized_bytes_size);
    if (args.serialized_executable_deleter != nullptr)
      args.serialized_executable_deleter(args.serialized_executable);
  }
  auto destroy = TPUD_ARGS(PJRT_Executable_Destroy_Args);
  destroy.executable = get.executable;
  (void)Check(api_->PJRT_Executable_Destroy(&destroy),
              "destroying an executable");
  if (!st.ok()) return st;
  return bytes;
}

absl::StatusOr<std::unique_ptr<Executable>> PjrtPlugin::Deserialize(
    absl::string_view bytes, absl::Span<const int> replicas) const {
  if (!Serializes())
    return absl::UnimplementedError(
        "the PJRT plugin cannot load serialized executables");
  std::string options = PortableOptions();
  if (!replicas.empty()) {
    absl::StatusOr<std::string> o = ReplicatedOptions(replicas);
    if (!o.ok()) return o.status();
    options = *std::move(o);
  }
  auto args = TPUD_ARGS(PJRT_Executable_DeserializeAndLoad_Args);
  args.client = client_;
  args.serialized_executable = bytes.data();
  args.serialized_executable_size = bytes.size();
  args.overridden_serialized_compile_options = options.data();
  args.overridden_serialized_compile_options_size = options.size();
  if (absl::Status st = Check(api_->PJRT_Executable_DeserializeAndLoad(&args),
                              "loading a serialized program");
      !st.ok())
    return st;
  absl::StatusOr<std::unique_ptr<Executable>> exe =
      Loaded(args.loaded_executable);
  if (!exe.ok() || replicas.empty()) return exe;
  if (absl::Status st = PlaceReplicas(**exe, replicas); !st.ok()) return st;
  return exe;
}

absl::StatusOr<Buffer> PjrtPlugin::HostBuffer(
    int device, const void* data, PJRT_Buffer_Type type,
    absl::Span<const int64_t> dims, absl::Span<const int64_t> byte_strides,
    PJRT_HostBufferSemantics semantics, PJRT_Event** done) const {
  if (device < 0 || device >= num_devices()) {
    return absl::InvalidArgumentError(absl::StrCat("no device ", device));
  }
  auto args = TPUD_ARGS(PJRT_Client_BufferFromHostBuffer_Args);
  args.client = client_;
  args.data = data;
  args.type = type;
  args.dims = dims.data();
  args.num_dims = dims.size();
  if (!byte_strides.empty()) {
    if (byte_strides.size() != dims.size()) {
      return absl::InvalidArgumentError("one byte stride per dimension");
    }
    args.byte_strides = byte_strides.data();
    args.num_byte_strides = byte_strides.size();
  }
  args.host_buffer_semantics = semantics;
  args.device = device_handles_[device];
  const bool copies =
      semantics == PJRT_HostBufferSemantics_kImmutableUntilTransferCompletes;
  if (absl::Status st =
          Check(api_->PJRT_Client_BufferFromHostBuffer(&args),
                copies ? "copying to device" : "aliasing host memory");
      !st.ok()) {
    return st;
  }
  *done = args.done_with_host_buffer;
  return Buffer(this, args.buffer);
}

absl::StatusOr<Buffer> PjrtPlugin::FromHost(
    int device, const void* data, PJRT_Buffer_Type type,
    absl::Span<const int64_t> dims,
    absl::Span<const int64_t> byte_strides) const {
  PJRT_Event* done = nullptr;
  absl::StatusOr<Buffer> b = HostBuffer(
      device, data, type, dims, byte_strides,
      PJRT_HostBufferSemantics_kImmutableUntilTransferCompletes, &done);
  if (!b.ok()) return b;
  if (absl::Status st = Await(done, "copying to device"); !st.ok()) return st;
  return b;
}

absl::StatusOr<Buffer> PjrtPlugin::Alias(int device, void* data,
                                         PJRT_Buffer_Type type,
                                         absl::Span<const int64_t> dims,
                                         bool writable) const {
  PJRT_Event* done = nullptr;
  absl::StatusOr<Buffer> b =
      HostBuffer(device, data, type, dims, {},
                 writable ? PJRT_HostBufferSemantics_kMutableZeroCopy
                          : PJRT_HostBufferSemantics_kImmutableZeroCopy,
                 &done);
  if (!b.ok()) return b;
  b->released_ = done;
  return b;
}

absl::StatusOr<uintptr_t> PjrtPlugin::UnsafePointer(
    const Buffer& buffer) const {
  auto* fn = TPUD_PJRT_FN(this, PJRT_Buffer_UnsafePointer);
  if (fn == nullptr)
    return absl::UnimplementedError(
        "the plugin has no PJRT_Buffer_UnsafePointer");
  auto args = TPUD_ARGS(PJRT_Buffer_UnsafePointer_Args);
  args.buffer = buffer.get();
  if (absl::Status st = Check(fn(&args), "buffer address"); !st.ok()) return st;
  return args.buffer_pointer;
}

absl::StatusOr<size_t> PjrtPlugin::HostBytes(const Buffer& buffer) const {
  auto args = TPUD_ARGS(PJRT_Buffer_ToHostBuffer_Args);
  args.src = buffer.get();
  args.dst = nullptr;  // asks for the size
  if (absl::Status st =
          Check(api_->PJRT_Buffer_ToHostBuffer(&args), "host size");
      !st.ok()) {
    return st;
  }
  return args.dst_size;
}

absl::Status PjrtPlugin::ToHost(const Buffer& buffer, void* dst,
                                size_t bytes) const {
  auto args = TPUD_ARGS(PJRT_Buffer_ToHostBuffer_Args);
  args.src = buffer.get();
  args.dst = dst;
  args.dst_size = bytes;
  if (absl::Status st =
          Check(api_->PJRT_Buffer_ToHostBuffer(&args), "copying to host");
      !st.ok()) {
    return st;
  }
  return Await(args.event, "copying to host");
}

absl::StatusOr<std::vector<Buffer>> PjrtPlugin::Execute(
    const Executable& exe, int device,
    absl::Span<PJRT_Buffer* const> args) const {
  if (device < 0 || device >= num_devices()) {
    return absl::InvalidArgumentError(absl::StrCat("no device ", device));
  }
  exe.last_run_ = ++runs_;
  auto options = TPUD_ARGS(PJRT_ExecuteOptions);
  std::vector<PJRT_Buffer*> outs(exe.num_outputs() + 1, nullptr);
  PJRT_Buffer** out_list = outs.data();
  PJRT_Buffer* const* arg_list = args.data();
  PJRT_Event* done = nullptr;
  auto run = TPUD_ARGS(PJRT_LoadedExecutable_Execute_Args);
  run.executable = exe.get();
  run.options = &options;
  run.argument_lists = &arg_list;
  run.num_devices = 1;
  run.num_args = args.size();
  run.output_lists = &out_list;
  run.device_complete_events = &done;
  run.execute_device = device_handles_[device];
  absl::Status st =
      Check(api_->PJRT_LoadedExecutable_Execute(&run), "executing");
  std::vector<Buffer> result;
  for (int i = 0; i < exe.num_outputs(); ++i)
    result.emplace_back(this, outs[i]);
  if (!st.ok()) return st;
  if (absl::Status w = Await(done, "executing"); !w.ok()) return w;
  return result;
}

absl::StatusOr<std::vector<std::vector<Buffer>>> PjrtPlugin::ExecuteReplicated(
    const Executable& exe,
    const std::vector<std::vector<PJRT_Buffer*>>& args) const {
  exe.last_run_ = ++runs_;
  const size_t n = exe.replica_devices().size();
  if (n == 0 || args.size() != n) {
    return absl::InvalidArgumentError(
        absl::StrCat("a program of ", n, " replicas given ", args.size(),
                     " argument lists"));
  }
  for (const auto& a : args) {
    if (a.size() != args[0].size())
      return absl::InvalidArgumentError(
          "replicas given different argument counts");
  }
  auto options = TPUD_ARGS(PJRT_ExecuteOptions);
  const size_t outputs = static_cast<size_t>(exe.num_outputs());
  std::vector<PJRT_Buffer*> outs(n * (outputs + 1), nullptr);
  std::vector<PJRT_Buffer**> out_lists(n);
  std::vector<PJRT_Buffer* const*> arg_lists(n);
  std::vector<PJRT_Event*> done(n, nullptr);
  for (size_t r = 0; r < n; ++r) {
    out_lists[r] = outs.data() + r * (outputs + 1);
    arg_lists[r] = args[r].data();
  }
  auto run = TPUD_ARGS(PJRT_LoadedExecutable_Execute_Args);
  run.executable = exe.get();
  run.options = &options;
  run.argument_lists = arg_lists.data();
  run.num_devices = n;
  run.num_args = args[0].size();
  run.output_lists = out_lists.data();
  run.device_complete_events = done.data();
  absl::Status st =
      Check(api_->PJRT_LoadedExecutable_Execute(&run), "executing");
  std::vector<std::vector<Buffer>> result(n);
  for (size_t r = 0; r < n; ++r) {
    for (size_t i = 0; i < outputs; ++i)
      result[r].emplace_back(this, out_lists[r][i]);
  }
  // Every replica's event is awaited (and destroyed), even after a failure.
  for (size_t r = 0; r < n; ++r) {
    if (done[r] == nullptr) continue;
    absl::Status w = Await(done[r], "executing");
    if (st.ok()) st = w;
  }
  if (!st.ok()) return st;
  return result;
}

}  // namespace tpud::pjrt
