// Device addresses: what a tpu tensor's data pointer holds.
//
// As with CUDA, device memory is not host-addressable. An address names a chip
// and a byte offset in that chip's HBM; the chip is stored +1 so that no valid
// address is null. Dereferencing one on the host is a bug.
#ifndef TPU_DEVICE_ADDRESS_H_
#define TPU_DEVICE_ADDRESS_H_

#include <cstdint>

namespace tpu {

inline constexpr int kDeviceAddressChipShift = 56;
inline constexpr uint64_t kDeviceAddressOffsetMask =
    (uint64_t{1} << kDeviceAddressChipShift) - 1;
inline constexpr int kMaxChips = 255;

constexpr uint64_t MakeDeviceAddress(int chip, uint64_t offset) {
  return (static_cast<uint64_t>(chip + 1) << kDeviceAddressChipShift) |
         (offset & kDeviceAddressOffsetMask);
}

// -1 for an address that names no chip (null or garbage high bits).
constexpr int DeviceAddressChip(uint64_t address) {
  return static_cast<int>(address >> kDeviceAddressChipShift) - 1;
}

constexpr uint64_t DeviceAddressOffset(uint64_t address) {
  return address & kDeviceAddressOffsetMask;
}

}  // namespace tpu

#endif  // TPU_DEVICE_ADDRESS_H_
