#include "daemon/topology/topology.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace tpud {
namespace {

constexpr uint64_t kGiB = uint64_t{1} << 30;

// Indexed by static_cast<int>(Generation); keep in enum order.
const std::vector<GenerationFacts>& FactsTable() {
  // Figures from the Google Cloud TPU system-architecture pages. ICI for
  // v5e, v5p and v6e is published in Gbps and converted here (/8): 1600,
  // 4800 and 3584 Gbps, one direction. v7x's is published as 1.2 TB/s
  // bidirectional (the same page lists v5p at 1200 GB/s bidirectional, twice
  // its 600 GB/s one-way figure), so it is halved here to keep one basis.
  static const auto* const kFacts = new std::vector<GenerationFacts>{
      {Generation::kV5e, "v5e", 16 * kGiB, 819.0, 1600.0 / 8, 197.0,
       /*tensorcores_per_chip=*/1, /*torus_dims=*/2,
       /*max_chips_per_host=*/8},
      {Generation::kV5p, "v5p", 95 * kGiB, 2765.0, 4800.0 / 8, 459.0,
       /*tensorcores_per_chip=*/2, /*torus_dims=*/3,
       /*max_chips_per_host=*/4},
      {Generation::kV6e, "v6e", 32 * kGiB, 1640.0, 3584.0 / 8, 918.0,
       /*tensorcores_per_chip=*/1, /*torus_dims=*/2,
       /*max_chips_per_host=*/8},
      {Generation::kV7x, "v7x", 192 * kGiB, 7380.0, 1200.0 / 2, 2307.0,
       /*tensorcores_per_chip=*/2, /*torus_dims=*/3,
       /*max_chips_per_host=*/4},
  };
  return *kFacts;
}

struct Preset {
  const char* name;
  Generation generation;
  std::vector<int> shape;
};

// A host's chips are a slice of its pod's torus. The wrap-around links of a
// torus axis only close over a full pod dimension, never within one host, so
// every preset has wraparound all false.
const std::vector<Preset>& Presets() {
  static const auto* const kPresets = new std::vector<Preset>{
      {"v5e-1", Generation::kV5e, {1, 1}},
      {"v5e-4", Generation::kV5e, {2, 2}},
      {"v5e-8", Generation::kV5e, {2, 4}},
      {"v5p-4", Generation::kV5p, {2, 2, 1}},
      {"v6e-1", Generation::kV6e, {1, 1}},
      {"v6e-4", Generation::kV6e, {2, 2}},
      {"v6e-8", Generation::kV6e, {2, 4}},
      {"v7x-4", Generation::kV7x, {2, 2, 1}},
  };
  return *kPresets;
}

std::string JoinShape(const std::vector<int>& shape) {
  return absl::StrJoin(shape, "x");
}

}  // namespace

const GenerationFacts& FactsFor(Generation g) {
  return FactsTable()[static_cast<int>(g)];
}

const std::vector<Generation>& AllGenerations() {
  static const auto* const kAll = new std::vector<Generation>{
      Generation::kV5e, Generation::kV5p, Generation::kV6e, Generation::kV7x};
  return *kAll;
}

absl::StatusOr<Generation> ParseGeneration(absl::string_view name) {
  const std::string lower = absl::AsciiStrToLower(name);
  for (const GenerationFacts& f : FactsTable()) {
    if (lower == f.name) return f.generation;
  }
  // Prefixes Google Cloud uses in accelerator types (v5litepod-8, tpu7x-8).
  if (lower == "v5litepod") return Generation::kV5e;
  if (lower == "tpu7x") return Generation::kV7x;
  std::vector<std::string> known;
  for (const GenerationFacts& f : FactsTable()) known.push_back(f.name);
  return absl::InvalidArgumentError(absl::StrCat(
      "unknown TPU generation \"", name,
      "\"; known: ", absl::StrJoin(known, ", "), " (also v5litepod, tpu7x)"));
}

absl::StatusOr<Topology> Topology::FromPreset(absl::string_view name,
                                              uint64_t hbm_bytes_override) {
  const std::string lower = absl::AsciiStrToLower(name);
  for (const Preset& p : Presets()) {
    if (lower != p.name) continue;
    return Create(p.name, p.generation, p.shape,
                  std::vector<bool>(p.shape.size(), false), hbm_bytes_override);
  }
  return absl::InvalidArgumentError(
      absl::StrCat("unknown topology preset \"", name,
                   "\"; known presets: ", absl::StrJoin(PresetNames(), ", ")));
}

absl::StatusOr<Topology> Topology::Create(std::string name,
                                          Generation generation,
                                          std::vector<int> shape,
                                          std::vector<bool> wraparound,
                                          uint64_t hbm_bytes_override) {
  const GenerationFacts& facts = FactsFor(generation);
  const std::string what =
      absl::StrCat("topology \"", name, "\" (", facts.name, ", shape ",
                   shape.empty() ? "empty" : JoinShape(shape), ")");
  const size_t dims = static_cast<size_t>(facts.torus_dims);
  if (shape.size() < dims) {
    std::vector<int> padded = shape;
    padded.resize(dims, 1);
    return absl::InvalidArgumentError(absl::StrCat(
        what, ": ", facts.name, " chips form a ", dims,
        "D torus but the shape has ", shape.size(), " dimension(s); give ",
        dims, ", e.g. ", JoinShape(padded)));
  }
  for (size_t i = dims; i < shape.size(); ++i) {
    if (shape[i] != 1) {
      return absl::InvalidArgumentError(absl::StrCat(
          what, ": ", facts.name, " chips form a ", dims, "D torus, so axis ",
          i, " must have size 1, got ", shape[i]));
    }
  }
  for (size_t i = 0; i < shape.size(); ++i) {
    if (shape[i] < 1) {
      return absl::InvalidArgumentError(absl::StrCat(
          what, ": axis ", i, " has size ", shape[i], "; each needs >= 1"));
    }
  }
  // Multiply in 64 bits and stop early so a huge shape cannot overflow.
  int64_t chips = 1;
  for (int d : shape) {
    chips *= d;
    if (chips > kMaxChips) {
      return absl::InvalidArgumentError(absl::StrCat(
          what, ": more than ", kMaxChips, " chips; not a host topology"));
    }
  }
  if (wraparound.size() != shape.size()) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, ": wraparound has ", wraparound.size(),
                     " entries but the shape has ", shape.size(), " axes"));
  }
  const uint64_t hbm =
      hbm_bytes_override > 0 ? hbm_bytes_override : facts.hbm_bytes_per_chip;
  return Topology(std::move(name), generation, std::move(shape),
                  std::move(wraparound), hbm);
}

std::vector<std::string> Topology::PresetNames() {
  std::vector<std::string> names;
  for (const Preset& p : Presets()) names.push_back(p.name);
  return names;
}

Topology::Topology(std::string name, Generation generation,
                   std::vector<int> shape, std::vector<bool> wraparound,
                   uint64_t hbm_bytes_per_chip)
    : name_(std::move(name)),
      generation_(generation),
      shape_(std::move(shape)),
      wraparound_(std::move(wraparound)),
      hbm_bytes_per_chip_(hbm_bytes_per_chip) {
  int chips = 1;
  for (int d : shape_) chips *= d;
  coords_.reserve(chips);
  for (int chip = 0; chip < chips; ++chip) {
    std::vector<int> c(shape_.size());
    int rest = chip;
    for (size_t axis = 0; axis < shape_.size(); ++axis) {
      c[axis] = rest % shape_[axis];
      rest /= shape_[axis];
    }
    coords_.push_back(std::move(c));
  }
}

void Topology::CheckChip(int chip) const {
  // The pinned abseil has no CHECK; a bad id here is a caller bug, not input.
  if (chip < 0 || chip >= num_chips()) {
    std::fprintf(stderr, "tpud: topology %s: chip %d out of range [0, %d)\n",
                 name_.c_str(), chip, num_chips());
    std::abort();
  }
}

const std::vector<int>& Topology::coords(int chip) const {
  CheckChip(chip);
  return coords_[chip];
}

absl::StatusOr<int> Topology::ChipAt(const std::vector<int>& coords) const {
  if (coords.size() != shape_.size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("topology ", name_, " (", ShapeString(), ") has ",
                     shape_.size(), " axes; got ", coords.size(),
                     " coordinates (", absl::StrJoin(coords, ","), ")"));
  }
  int chip = 0;
  int stride = 1;
  for (size_t axis = 0; axis < shape_.size(); ++axis) {
    if (coords[axis] < 0 || coords[axis] >= shape_[axis]) {
      return absl::InvalidArgumentError(
          absl::StrCat("coordinates (", absl::StrJoin(coords, ","),
                       ") are outside ", name_, " (", ShapeString(), "): axis ",
                       axis, " must be in [0, ", shape_[axis], ")"));
    }
    chip += coords[axis] * stride;
    stride *= shape_[axis];
  }
  return chip;
}

std::vector<IciLink> Topology::Links(int chip) const {
  CheckChip(chip);
  std::vector<IciLink> links;
  const std::vector<int>& c = coords_[chip];
  int stride = 1;
  for (size_t axis = 0; axis < shape_.size(); ++axis) {
    const int size = shape_[axis];
    // A ring of 2 would link the same pair twice; treat it as a line.
    const bool ring = wraparound_[axis] && size > 2;
    const int ax = static_cast<int>(axis);
    if (c[axis] > 0) {
      links.push_back({ax, -1, chip - stride, false});
    } else if (ring) {
      links.push_back({ax, -1, chip + (size - 1) * stride, true});
    }
    if (c[axis] < size - 1) {
      links.push_back({ax, +1, chip + stride, false});
    } else if (ring) {
      links.push_back({ax, +1, chip - (size - 1) * stride, true});
    }
    stride *= size;
  }
  return links;
}

std::vector<int> Topology::Neighbors(int chip) const {
  std::vector<int> peers;
  for (const IciLink& link : Links(chip)) peers.push_back(link.peer);
  std::sort(peers.begin(), peers.end());
  peers.erase(std::unique(peers.begin(), peers.end()), peers.end());
  return peers;
}

std::string Topology::ShapeString() const { return JoinShape(shape_); }

}  // namespace tpud
