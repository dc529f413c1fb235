// Pinned host memory for tensor.pin_memory(): blocks of the session's
// shared memory, from which tpud copies to the device without staging.
#pragma once

#include <c10/core/Allocator.h>

namespace torch_tpu {

at::Allocator* GetPinnedAllocator();

// Makes it torch's host allocator of the tpu device (at load).
void RegisterHostAllocator();

}  // namespace torch_tpu
