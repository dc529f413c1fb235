// TpuAllocator: a caching allocator over daemon HBM segments, as PyTorch's
// CUDA caching allocator sits on cudaMalloc. A tpu tensor's data pointer is a
// device address (never host-dereferenceable). Freed blocks return to the
// cache; empty_cache() gives cached segments back to tpud. Never takes the GIL.
#pragma once

#include <c10/core/CachingDeviceAllocator.h>

namespace torch_tpu {

c10::DeviceAllocator* GetTpuAllocator();

// Wraps a segment the daemon already allocated for this session (a
// data-dependent result) as a DataPtr whose deleter frees the segment.
c10::DataPtr AdoptSegment(uint64_t address, size_t bytes, c10::DeviceIndex device);

}  // namespace torch_tpu
