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

// What this session holds on the chip of `device` and what it may still
// allocate there, from tpud: the one rule behind torch.accelerator's
// get_memory_info (available, chip_total) and torch.tpu.memory_budget.
struct SessionChipMemory {
  uint64_t chip_total = 0;
  uint64_t chip_free = 0;
  uint64_t held = 0;   // this session's bytes on the chip
  uint64_t quota = 0;  // the session's per-chip quota; 0: none
  // The chip's free bytes, and no more than the quota less what is held.
  uint64_t available = 0;
};
SessionChipMemory GetSessionChipMemory(c10::DeviceIndex device);

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
