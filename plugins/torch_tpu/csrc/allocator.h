// TpuAllocator: a caching allocator over daemon HBM segments, as PyTorch's
// CUDA caching allocator sits on cudaMalloc. A tpu tensor's data pointer is a
// device address (never host-dereferenceable). Freed blocks return to the
// cache; empty_cache() gives cached segments back to tpud. Never takes the GIL.
#pragma once

#include <c10/core/CachingDeviceAllocator.h>
#include <c10/core/Storage.h>

namespace torch_tpu {

// Device indices the allocator keeps state for.
constexpr int kMaxDevices = 64;

c10::DeviceAllocator* GetTpuAllocator();

// Whether this process ever had a block on `device` (without opening the
// session).
bool EverAllocatedOn(c10::DeviceIndex device);

// Wraps a segment the daemon already allocated for this session (a
// data-dependent result) as a DataPtr whose deleter frees the segment.
c10::DataPtr AdoptSegment(uint64_t address, size_t bytes,
                          c10::DeviceIndex device);

// Resizes a tpu storage, keeping its bytes (resize_ on a tpu tensor): a new
// block from this allocator on the storage's device, the kept bytes copied
// on the device.
void ResizeStorage(const c10::Storage& storage, size_t newsize);

// Memory of captured programs (as CUDA graphs' private pools). Between
// BeginCaptureHold and EndCaptureHold every block handed out is noted, and
// none freed is handed out again (so each address the program records is
// one tensor's); at the end, those not at an address in `outputs` (a run
// binds outputs anew) become the program's: they never go back to the
// cache, freed or not, until ReleaseCaptureHold, since the program's
// records keep their addresses. The cache is not emptied while a capture
// runs.
void BeginCaptureHold();
uint64_t EndCaptureHold(const std::vector<uint64_t>& outputs);
void ReleaseCaptureHold(uint64_t hold);
// Bytes the program holds.
uint64_t CaptureHoldBytes(uint64_t hold);

}  // namespace torch_tpu
