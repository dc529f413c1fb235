// torch_tpu's one boundary with libtpuclient: the process's tpud session,
// the mapping of visible devices to chips, and absl::Status -> c10::Error.
#pragma once

#include <c10/core/Device.h>
#include <c10/util/Exception.h>

#include <string>
#include <vector>

#include "absl/status/status.h"
#include "tpu/client.h"

namespace torch_tpu {

// The session, opened on first use. No daemon: raises a RuntimeError that
// names the socket and says how to start tpud.
tpu::Session& GetSession();

// Devices this process sees (TPU_VISIBLE_CHIPS narrows them), without
// raising: 0 when tpud cannot be reached.
c10::DeviceIndex DeviceCount() noexcept;
// The physical chip behind a visible device; raises for a bad index.
int ChipOf(c10::DeviceIndex device);
const tpu::TopologyInfo& Topology();
// Called once, by the first thread to find the session open (after the
// open, outside its lock), with what the daemon said of itself.
void SetSessionOpenedHook(void (*hook)(const tpu::TopologyInfo&));

c10::DeviceIndex CurrentDevice();
void SetDevice(c10::DeviceIndex device);

// The session stream a c10 stream id names (0 is the default stream).
inline int SessionStream(int64_t stream_id) {
  return static_cast<int>(stream_id);
}
int64_t CurrentStreamId(c10::DeviceIndex device);
void SetCurrentStreamId(c10::DeviceIndex device, int64_t id);

// Raises c10::Error (RuntimeError in Python) for a non-OK status, or
// c10::OutOfMemoryError for RESOURCE_EXHAUSTED; an ATen kernel's error
// (tpu/op_error.h) in ATen's own words.
void Check(const absl::Status& status, const char* what);
// The same for the status of the op that the caller just ran, which raises
// its ATen error as ATen's class (IndexError, TypeError, ...).
void CheckOp(const absl::Status& status, const char* what);

}  // namespace torch_tpu
