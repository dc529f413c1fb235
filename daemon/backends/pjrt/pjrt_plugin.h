// A PJRT plugin (XLA's PJRT C API: libtpu on TPU VMs, XLA's CPU plugin in
// tests), loaded once by the one tpud process that drives the devices.
//
// Everything here is a thin, checked layer over the C API:
//   - every function is looked up through the plugin's PJRT_Api, and one
//     past the plugin's struct_size is "not supported by this plugin", never
//     called;
//   - every PJRT_Error becomes an absl::Status with the plugin's code and
//     message (and the PJRT_Error is destroyed);
//   - every handle (client, executable, buffer, event) has one owner here
//     and is destroyed through the API.
//
// Thread-safety: a PjrtPlugin and its objects may be used from one thread
// at a time (the executor's); the plugin itself may use threads of its own.
#ifndef TPUD_DAEMON_BACKENDS_PJRT_PJRT_PLUGIN_H_
#define TPUD_DAEMON_BACKENDS_PJRT_PJRT_PLUGIN_H_

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "pjrt_c_api.h"

namespace tpud::pjrt {

// A client create option, `name=value` on tpud's command line. The value's
// type is inferred (an integer, true/false, a number with a point, else a
// string) or given: `name=int64:4`, `name=string:4`, `name=bool:true`,
// `name=float:0.5`. A plugin may abort on an option of the wrong type, so
// the type is part of the option.
struct CreateOption {
  std::string name;
  PJRT_NamedValue_Type type = PJRT_NamedValue_kString;
  std::string string_value;
  int64_t int64_value = 0;
  float float_value = 0;
  bool bool_value = false;
};
absl::StatusOr<CreateOption> ParseCreateOption(absl::string_view text);

// What a device tells about itself.
struct DeviceInfo {
  int id = 0;
  std::string kind;             // "cpu", "TPU v6 lite", ...
  std::vector<int64_t> coords;  // from the "coords" attribute, when given
  int64_t bytes_limit = 0;      // from the memory stats, 0 when not given
  std::string description;      // the plugin's ToString
};

// The order tpud numbers the plugin's devices in: by their `coords` (the
// first axis fastest, as tpud's topologies number chips: chip x + y*nx ...)
// where every device has coordinates of one rank and no two share them;
// else the plugin's own order. Entry i is the plugin's index of chip i.
std::vector<size_t> TorusOrder(const std::vector<DeviceInfo>& devices);

class PjrtPlugin;

// A device buffer of the plugin's.
class Buffer {
 public:
  Buffer() = default;
  Buffer(const PjrtPlugin* plugin, PJRT_Buffer* buffer,
         PJRT_Event* released = nullptr)
      : plugin_(plugin), buffer_(buffer), released_(released) {}
  Buffer(Buffer&& o) noexcept { *this = std::move(o); }
  Buffer& operator=(Buffer&& o) noexcept;
  ~Buffer();
  PJRT_Buffer* get() const { return buffer_; }
  // A buffer that took over the host memory `donor` aliased (the result
  // the plugin wrote into a donated buffer) waits, when destroyed, for the
  // release the donor was to wait for: only this buffer's end brings it.
  void InheritRelease(Buffer& donor) {
    if (released_ == nullptr)
      released_ = std::exchange(donor.released_, nullptr);
  }

 private:
  const PjrtPlugin* plugin_ = nullptr;
  PJRT_Buffer* buffer_ = nullptr;
  friend class PjrtPlugin;
  // For a buffer over host memory (Alias): fires once the plugin no longer
  // uses that memory; the destructor waits for it.
  PJRT_Event* released_ = nullptr;
};

// A program compiled and loaded for this client's devices.
class Executable {
 public:
  Executable(const PjrtPlugin* plugin, PJRT_LoadedExecutable* exe,
             int num_outputs)
      : plugin_(plugin), exe_(exe), num_outputs_(num_outputs) {}
  Executable(const Executable&) = delete;
  Executable& operator=(const Executable&) = delete;
  ~Executable();
  PJRT_LoadedExecutable* get() const { return exe_; }
  int num_outputs() const { return num_outputs_; }
  // A replicated program (CompileReplicated): the devices it runs on, in
  // the order its argument and output lists take them. Empty otherwise.
  const std::vector<int>& replica_devices() const { return replica_devices_; }
  // When it last ran, in the plugin's count of runs (0: never): which
  // programs are in use, whatever cache found them.
  uint64_t last_run() const { return last_run_; }

 private:
  friend class PjrtPlugin;
  const PjrtPlugin* plugin_;
  PJRT_LoadedExecutable* exe_;
  int num_outputs_;
  std::vector<int> replica_devices_;
  mutable uint64_t last_run_ = 0;
};

class PjrtPlugin {
 public:
  // Loads `path`, checks its API version, initialises it and creates one
  // client with `options`. Errors name the plugin and carry its message.
  static absl::StatusOr<std::unique_ptr<PjrtPlugin>> Load(
      const std::string& path, const std::vector<CreateOption>& options);
  ~PjrtPlugin();
  PjrtPlugin(const PjrtPlugin&) = delete;
  PjrtPlugin& operator=(const PjrtPlugin&) = delete;

  const std::string& path() const { return path_; }
  int api_major() const { return api_major_; }
  int api_minor() const { return api_minor_; }
  const std::string& platform_name() const { return platform_name_; }
  const std::string& platform_version() const { return platform_version_; }
  // "xla_cpu_pjrt.so: PJRT API 0.81, platform cpu <version>".
  std::string Describe() const;

  const std::vector<DeviceInfo>& devices() const { return devices_; }
  int num_devices() const { return static_cast<int>(device_handles_.size()); }

  // Compiles a StableHLO module (MLIR text) for one replica and partition,
  // portable: it runs on any of the devices.
  absl::StatusOr<std::unique_ptr<Executable>> Compile(
      absl::string_view mlir) const;
  // Compiles a module for `devices.size()` replicas (one partition), replica
  // r on device devices[r] (tpud's device index): its collectives
  // (stablehlo.all_reduce, all_gather, ...) run among those devices.
  // INVALID_ARGUMENT for an unknown or repeated device.
  absl::StatusOr<std::unique_ptr<Executable>> CompileReplicated(
      absl::string_view mlir, absl::Span<const int> devices) const;

  // Whether the plugin can serialize an executable and load it again (the
  // disk cache of compiled programs needs both).
  bool Serializes() const;
  // The bytes of a compiled program, which Deserialize loads again in a
  // client of the same plugin build (and no other: the bytes are the
  // plugin's own format, not stable across its versions).
  absl::StatusOr<std::string> Serialize(const Executable& exe) const;
  // A program from Serialize's bytes, loaded for this client's devices:
  // portable where `replicas` is empty, else placed as CompileReplicated
  // places it. The bytes must come from a trusted place: a plugin may not
  // check them.
  absl::StatusOr<std::unique_ptr<Executable>> Deserialize(
      absl::string_view bytes, absl::Span<const int> replicas) const;

  // A buffer on `device` holding `dims` of `type` copied from host `data`
  // (dense, row-major). The copy is done when this returns.
  // `byte_strides` (one per dimension, or none for dense) lets the plugin
  // read a strided view.
  absl::StatusOr<Buffer> FromHost(
      int device, const void* data, PJRT_Buffer_Type type,
      absl::Span<const int64_t> dims,
      absl::Span<const int64_t> byte_strides = {}) const;
  // A buffer on `device` over host memory `data` itself (dense, row-major,
  // `dims` of `type`), no copy: the plugin reads it in place, and, where
  // `writable`, a program that takes it donated writes its aliased result
  // there. The memory must stay valid until the Buffer is destroyed (its
  // destructor waits until the plugin lets go of it). A plugin may copy
  // instead (XLA's CPU plugin does for data not aligned to 64 bytes):
  // UnsafePointer tells.
  absl::StatusOr<Buffer> Alias(int device, void* data, PJRT_Buffer_Type type,
                               absl::Span<const int64_t> dims,
                               bool writable) const;
  // Where the buffer's bytes lie, for a plugin whose devices are the host;
  // an error where it does not say.
  absl::StatusOr<uintptr_t> UnsafePointer(const Buffer& buffer) const;
  // Copies `buffer` (dense, row-major) to host `dst` of `bytes`; waits.
  absl::Status ToHost(const Buffer& buffer, void* dst, size_t bytes) const;
  // The size the buffer's host copy needs.
  absl::StatusOr<size_t> HostBytes(const Buffer& buffer) const;

  // Runs `exe` on `device` with `args`; returns its outputs once it is done.
  absl::StatusOr<std::vector<Buffer>> Execute(
      const Executable& exe, int device,
      absl::Span<PJRT_Buffer* const> args) const;
  // Runs a replicated `exe` once on each of its devices: args[r] are the
  // arguments of replica r (on exe.replica_devices()[r]); returns each
  // replica's outputs once all are done.
  absl::StatusOr<std::vector<std::vector<Buffer>>> ExecuteReplicated(
      const Executable& exe,
      const std::vector<std::vector<PJRT_Buffer*>>& args) const;

  // ---- internals shared with Buffer and Executable
  const PJRT_Api* api() const { return api_; }
  // OK, or the error's status (destroying the error); `what` prefixes it.
  absl::Status Check(PJRT_Error* error, absl::string_view what) const;
  // Whether the plugin provides the function at this PJRT_Api offset.
  bool Provides(size_t offset) const;

 private:
  PjrtPlugin() = default;
  absl::Status Init(const std::vector<CreateOption>& options);
  absl::StatusOr<std::unique_ptr<Executable>> CompileWith(
      absl::string_view mlir, const std::string& options) const;
  // The CompileOptionsProto of a portable program, and of one replicated on
  // `devices` (INVALID_ARGUMENT for an unknown or repeated device).
  static std::string PortableOptions();
  absl::StatusOr<std::string> ReplicatedOptions(
      absl::Span<const int> devices) const;
  // An Executable owning `loaded`, with its output count.
  absl::StatusOr<std::unique_ptr<Executable>> Loaded(
      PJRT_LoadedExecutable* loaded) const;
  // Records which devices a replicated program's replicas run on, checking
  // that they are `devices.size()` of the client's.
  absl::Status PlaceReplicas(Executable& exe,
                             absl::Span<const int> devices) const;
  absl::Status Await(PJRT_Event* event, absl::string_view what) const;
  // BufferFromHostBuffer with `semantics`; `done` gets its
  // done_with_host_buffer event, for the caller to await or keep.
  absl::StatusOr<Buffer> HostBuffer(int device, const void* data,
                                    PJRT_Buffer_Type type,
                                    absl::Span<const int64_t> dims,
                                    absl::Span<const int64_t> byte_strides,
                                    PJRT_HostBufferSemantics semantics,
                                    PJRT_Event** done) const;
  friend class Buffer;

  std::string path_;
  void* handle_ = nullptr;
  const PJRT_Api* api_ = nullptr;
  int api_major_ = 0;
  int api_minor_ = 0;
  PJRT_Client* client_ = nullptr;
  std::string platform_name_;
  std::string platform_version_;
  std::vector<PJRT_Device*> device_handles_;
  std::vector<DeviceInfo> devices_;
  mutable uint64_t runs_ = 0;  // Execute and ExecuteReplicated calls
};

// The PJRT_Api field `fn` of `plugin`, or a status naming it when the plugin
// is older than that field (or leaves it null).
#define TPUD_PJRT_FN(plugin, fn) \
  ((plugin)->Provides(offsetof(PJRT_Api, fn)) ? (plugin)->api()->fn : nullptr)

}  // namespace tpud::pjrt

#endif  // TPUD_DAEMON_BACKENDS_PJRT_PJRT_PLUGIN_H_
