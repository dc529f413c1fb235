// The devices tpud's Kubernetes device plugin advertises, without transport.
//
// Two resources over the host's chips:
//   tpud.io/chip        one device per chip ("chip-3"), the whole chip;
//   tpud.io/chip-share  N devices per chip ("chip-3-share-1"), each a slice
//                       of the chip's HBM (chip HBM / N unless set).
// A device is healthy when its chip is healthy and not drained. This file
// picks preferred allocations (contiguous on the ICI torus for chips, packed
// onto few chips for shares) and turns a container's device IDs into what
// tpud's CreateAllocation needs.
//
// Thread-safety: a TpuResource is immutable after Create; share freely.
#ifndef TPUD_PLUGINS_K8S_DEVICE_PLUGIN_DEVICES_H_
#define TPUD_PLUGINS_K8S_DEVICE_PLUGIN_DEVICES_H_

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace tpud::k8s {

inline constexpr char kChipResource[] = "tpud.io/chip";
inline constexpr char kChipShareResource[] = "tpud.io/chip-share";

// A chip of the host as tpud reports it (Admin.GetStatus).
struct HostChip {
  int id = 0;
  std::vector<int> coords;
  std::vector<int> neighbors;  // ICI neighbours
  uint64_t hbm_bytes = 0;
};

// A chip's state from tpud's Admin.Health.
struct ChipState {
  bool healthy = true;
  bool drained = false;
  std::string detail;
  bool operator==(const ChipState& o) const {
    return healthy == o.healthy && drained == o.drained && detail == o.detail;
  }
};

struct Device {
  std::string id;
  int chip = 0;
  int share = -1;  // -1: the whole chip
};

// What one container's devices come to in tpud: its chips (ascending) and
// the HBM quota on each.
struct AllocationPlan {
  std::vector<int> chips;
  std::vector<uint64_t> quota_bytes;
};

class TpuResource {
 public:
  // tpud.io/chip: one device per chip.
  static absl::StatusOr<TpuResource> WholeChips(std::vector<HostChip> chips);
  // tpud.io/chip-share: `shares_per_chip` devices per chip, each with quota
  // `share_quota_bytes` (0: chip HBM / shares_per_chip).
  static absl::StatusOr<TpuResource> ChipShares(std::vector<HostChip> chips,
                                                int shares_per_chip,
                                                uint64_t share_quota_bytes);

  const std::string& resource_name() const { return resource_name_; }
  // The plugin's socket in the device-plugins dir ("tpud-chip.sock").
  const std::string& socket_name() const { return socket_name_; }
  const std::vector<Device>& devices() const { return devices_; }
  bool whole_chips() const { return shares_per_chip_ == 0; }
  uint64_t share_quota_bytes() const { return share_quota_bytes_; }

  // The chip of device `id`; -1 when it is not one of this resource's.
  int ChipOf(const std::string& id) const;

  // Whether each device (in devices() order) is healthy, given the chips'
  // states (indexed by chip id; a chip past the end counts as unhealthy).
  std::vector<bool> Health(const std::vector<ChipState>& chips) const;

  // The devices to give a container: `size` of `available` ∪ `must_include`,
  // all of `must_include` among them. Chips: the most compact set on the
  // torus (a full sub-box such as 2x2 first, then the most ICI links inside
  // the set, then the smallest bounding box, then the lowest ids). Shares:
  // on as few chips as possible, filling the chips that have the fewest free
  // shares that suffice (whole chips stay free for whole-chip pods). Unknown
  // IDs, or a size that cannot be met, are INVALID_ARGUMENT.
  absl::StatusOr<std::vector<std::string>> Preferred(
      const std::vector<std::string>& available,
      const std::vector<std::string>& must_include, int size) const;

  // The chips and quotas of a container given `device_ids`: a whole chip's
  // quota is the chip's HBM; a chip's shares add up. Unknown or repeated IDs
  // are INVALID_ARGUMENT naming them and the valid form.
  absl::StatusOr<AllocationPlan> Plan(
      const std::vector<std::string>& device_ids) const;

 private:
  TpuResource() = default;
  absl::StatusOr<const Device*> Find(const std::string& id) const;
  absl::StatusOr<std::vector<int>> PreferredChips(std::vector<int> candidates,
                                                  std::vector<int> must,
                                                  int size) const;

  std::string resource_name_;
  std::string socket_name_;
  std::vector<HostChip> chips_;  // by id
  int shares_per_chip_ = 0;      // 0: whole chips
  uint64_t share_quota_bytes_ = 0;
  std::vector<Device> devices_;
  std::map<std::string, size_t> index_;  // device id -> devices_ index
};

}  // namespace tpud::k8s

#endif  // TPUD_PLUGINS_K8S_DEVICE_PLUGIN_DEVICES_H_
