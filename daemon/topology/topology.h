// The chips of one host: their generation, HBM, coordinates in the ICI torus
// and the links between them.
#ifndef TPUD_DAEMON_TOPOLOGY_TOPOLOGY_H_
#define TPUD_DAEMON_TOPOLOGY_TOPOLOGY_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace tpud {

enum class Generation { kV5e, kV5p, kV6e, kV7x };

// Per-chip figures as Google Cloud publishes them. They describe the chip
// being modelled; the simulated backend does not run at these speeds, but
// the scheduler, metrics and tpuctl report against them.
struct GenerationFacts {
  Generation generation;
  std::string name;  // "v5e", "v5p", "v6e", "v7x"
  uint64_t hbm_bytes_per_chip;
  double hbm_bandwidth_gbytes_per_s;
  // See FactsFor() in topology.cc for how each figure was published.
  double ici_bandwidth_gbytes_per_s;
  double peak_bf16_tflops;
  int tensorcores_per_chip;
  int torus_dims;  // 2: 2D torus (v5e, v6e); 3: 3D torus (v5p, v7x)
  int max_chips_per_host;
};

// Facts for every generation; the reference stays valid for the process.
const GenerationFacts& FactsFor(Generation g);

// All generations, oldest first.
const std::vector<Generation>& AllGenerations();

// Accepts the names in GenerationFacts::name, case-insensitively, plus the
// Google Cloud accelerator-type prefixes "v5litepod" (v5e) and "tpu7x" (v7x).
// Anything else -> INVALID_ARGUMENT naming the accepted names.
absl::StatusOr<Generation> ParseGeneration(absl::string_view name);

// One ICI link from a chip to a neighbour along one torus axis.
struct IciLink {
  int axis;
  int direction;  // -1 or +1 along `axis`
  int peer;       // chip id of the neighbour
  bool wraps;     // true for the link that closes a ring (last <-> first)
};

// Immutable description of a host's chips. Cheap to copy for host-sized
// shapes; thread-safe because nothing changes after Create().
class Topology {
 public:
  // Host presets. The number counts chips: "v5e-1", "v5e-4" (2x2), "v5e-8"
  // (2x4), "v5p-4" (2x2x1), "v6e-1", "v6e-4" (2x2), "v6e-8" (2x4), "v7x-4"
  // (2x2x1). (Google Cloud's v5p accelerator types count TensorCores, so its
  // "v5p-8" is the 4-chip host called "v5p-4" here.)
  // hbm_bytes_override, when > 0, replaces the per-chip HBM so that tests and
  // small machines can serve a preset's shape with little memory.
  // Unknown name -> INVALID_ARGUMENT listing the known presets.
  static absl::StatusOr<Topology> FromPreset(absl::string_view name,
                                             uint64_t hbm_bytes_override = 0);

  // General form. shape has one entry per torus axis ({2,4}, {4,4,4});
  // trailing axes of size 1 beyond the generation's torus_dims are allowed
  // ({2,2,1} for a 2D generation). wraparound[i] says whether axis i closes
  // into a ring. Rejects with INVALID_ARGUMENT: too few or too many axes, a
  // dimension < 1, more than kMaxChips chips, wraparound.size() !=
  // shape.size().
  static absl::StatusOr<Topology> Create(std::string name,
                                         Generation generation,
                                         std::vector<int> shape,
                                         std::vector<bool> wraparound,
                                         uint64_t hbm_bytes_override = 0);

  // Names accepted by FromPreset, in a stable order.
  static std::vector<std::string> PresetNames();

  // Bound on Create() so a typo in a shape cannot ask for millions of arenas.
  static constexpr int kMaxChips = 4096;

  const std::string& name() const { return name_; }
  const GenerationFacts& facts() const { return FactsFor(generation_); }
  const std::vector<int>& shape() const { return shape_; }
  const std::vector<bool>& wraparound() const { return wraparound_; }
  int num_chips() const { return static_cast<int>(coords_.size()); }
  // Per-chip HBM after any override.
  uint64_t hbm_bytes_per_chip() const { return hbm_bytes_per_chip_; }
  // Sum over all chips.
  uint64_t total_hbm_bytes() const {
    return hbm_bytes_per_chip_ * static_cast<uint64_t>(num_chips());
  }

  // Chip ids are row-major with axis 0 fastest: chip = x + X*y + X*Y*z.
  // REQUIRES: 0 <= chip < num_chips() (aborts otherwise: a caller bug).
  const std::vector<int>& coords(int chip) const;
  // One coordinate per axis. Wrong arity or out of range -> INVALID_ARGUMENT.
  absl::StatusOr<int> ChipAt(const std::vector<int>& coords) const;

  // Links to distinct neighbours, by axis then direction (-1 before +1).
  // An axis of size 1 has none; an axis of size 2 has one (the same peer is
  // not linked twice); a wrap-around link exists only when wraparound[axis]
  // and the axis has more than 2 chips.
  // REQUIRES: 0 <= chip < num_chips().
  std::vector<IciLink> Links(int chip) const;
  // Sorted, unique peer ids of Links(chip).
  // REQUIRES: 0 <= chip < num_chips().
  std::vector<int> Neighbors(int chip) const;

  // "2x2", "2x2x1".
  std::string ShapeString() const;

 private:
  Topology(std::string name, Generation generation, std::vector<int> shape,
           std::vector<bool> wraparound, uint64_t hbm_bytes_per_chip);

  void CheckChip(int chip) const;

  std::string name_;
  Generation generation_;
  std::vector<int> shape_;
  std::vector<bool> wraparound_;
  uint64_t hbm_bytes_per_chip_;
  std::vector<std::vector<int>> coords_;  // indexed by chip id
};

}  // namespace tpud

#endif  // TPUD_DAEMON_TOPOLOGY_TOPOLOGY_H_
