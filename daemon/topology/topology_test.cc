#include "daemon/topology/topology.h"

#include <cstdint>
#include <set>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "catch2_compat/catch.h"

namespace tpud {
namespace {

constexpr uint64_t kGiB = uint64_t{1} << 30;

Topology MustPreset(const std::string& name, uint64_t hbm_override = 0) {
  absl::StatusOr<Topology> t = Topology::FromPreset(name, hbm_override);
  INFO(name << ": " << t.status().ToString());
  REQUIRE(t.ok());
  return *std::move(t);
}

Topology MustCreate(Generation g, std::vector<int> shape,
                    std::vector<bool> wrap) {
  absl::StatusOr<Topology> t =
      Topology::Create("synthetic", g, std::move(shape), std::move(wrap));
  INFO(t.status().ToString());
  REQUIRE(t.ok());
  return *std::move(t);
}

bool Contains(const std::string& haystack, const std::string& needle) {
  return haystack.find(needle) != std::string::npos;
}

TEST_CASE("generation facts match the published figures") {
  const GenerationFacts& v5e = FactsFor(Generation::kV5e);
  CHECK(v5e.name == "v5e");
  CHECK(v5e.hbm_bytes_per_chip == 16 * kGiB);
  CHECK(v5e.hbm_bandwidth_gbytes_per_s == 819.0);
  CHECK(v5e.ici_bandwidth_gbytes_per_s == 200.0);  // 1600 Gbps
  CHECK(v5e.peak_bf16_tflops == 197.0);
  CHECK(v5e.tensorcores_per_chip == 1);
  CHECK(v5e.torus_dims == 2);
  CHECK(v5e.max_chips_per_host == 8);

  const GenerationFacts& v5p = FactsFor(Generation::kV5p);
  CHECK(v5p.name == "v5p");
  CHECK(v5p.hbm_bytes_per_chip == 95 * kGiB);
  CHECK(v5p.hbm_bandwidth_gbytes_per_s == 2765.0);
  CHECK(v5p.ici_bandwidth_gbytes_per_s == 600.0);  // 4800 Gbps
  CHECK(v5p.peak_bf16_tflops == 459.0);
  CHECK(v5p.tensorcores_per_chip == 2);
  CHECK(v5p.torus_dims == 3);
  CHECK(v5p.max_chips_per_host == 4);

  const GenerationFacts& v6e = FactsFor(Generation::kV6e);
  CHECK(v6e.name == "v6e");
  CHECK(v6e.hbm_bytes_per_chip == 32 * kGiB);
  CHECK(v6e.hbm_bandwidth_gbytes_per_s == 1640.0);
  CHECK(v6e.ici_bandwidth_gbytes_per_s == 448.0);  // 3584 Gbps
  CHECK(v6e.peak_bf16_tflops == 918.0);
  CHECK(v6e.tensorcores_per_chip == 1);
  CHECK(v6e.torus_dims == 2);
  CHECK(v6e.max_chips_per_host == 8);

  const GenerationFacts& v7x = FactsFor(Generation::kV7x);
  CHECK(v7x.name == "v7x");
  CHECK(v7x.hbm_bytes_per_chip == 192 * kGiB);
  CHECK(v7x.hbm_bandwidth_gbytes_per_s == 7380.0);
  CHECK(v7x.ici_bandwidth_gbytes_per_s ==
        600.0);  // 1.2 TB/s bidirectional, one way
  CHECK(v7x.peak_bf16_tflops == 2307.0);
  CHECK(v7x.tensorcores_per_chip == 2);
  CHECK(v7x.torus_dims == 3);
  CHECK(v7x.max_chips_per_host == 4);

  for (Generation g : AllGenerations()) {
    CHECK(FactsFor(g).generation == g);
  }
}

TEST_CASE("ParseGeneration accepts names and rejects others") {
  for (Generation g : AllGenerations()) {
    absl::StatusOr<Generation> parsed = ParseGeneration(FactsFor(g).name);
    REQUIRE(parsed.ok());
    CHECK(*parsed == g);
  }
  CHECK(*ParseGeneration("V6E") == Generation::kV6e);
  CHECK(*ParseGeneration("v5litepod") == Generation::kV5e);
  CHECK(*ParseGeneration("tpu7x") == Generation::kV7x);

  absl::StatusOr<Generation> bad = ParseGeneration("v4");
  REQUIRE_FALSE(bad.ok());
  CHECK(bad.status().code() == absl::StatusCode::kInvalidArgument);
  CHECK(Contains(std::string(bad.status().message()), "v6e"));
}

TEST_CASE("every preset loads with its shape, chips, HBM and generation") {
  struct Expected {
    std::string name;
    Generation generation;
    std::vector<int> shape;
    std::string shape_string;
  };
  const std::vector<Expected> expected = {
      {"v5e-1", Generation::kV5e, {1, 1}, "1x1"},
      {"v5e-4", Generation::kV5e, {2, 2}, "2x2"},
      {"v5e-8", Generation::kV5e, {2, 4}, "2x4"},
      {"v5p-4", Generation::kV5p, {2, 2, 1}, "2x2x1"},
      {"v6e-1", Generation::kV6e, {1, 1}, "1x1"},
      {"v6e-4", Generation::kV6e, {2, 2}, "2x2"},
      {"v6e-8", Generation::kV6e, {2, 4}, "2x4"},
      {"v7x-4", Generation::kV7x, {2, 2, 1}, "2x2x1"},
  };
  std::vector<std::string> names;
  for (const Expected& e : expected) names.push_back(e.name);
  CHECK(Topology::PresetNames() == names);

  for (const Expected& e : expected) {
    INFO(e.name);
    Topology t = MustPreset(e.name);
    CHECK(t.name() == e.name);
    CHECK(t.facts().generation == e.generation);
    CHECK(t.shape() == e.shape);
    CHECK(t.ShapeString() == e.shape_string);
    // The number in a preset's name is its chip count.
    const int chips = std::stoi(e.name.substr(e.name.find('-') + 1));
    CHECK(t.num_chips() == chips);
    CHECK(t.num_chips() <= t.facts().max_chips_per_host);
    CHECK(t.hbm_bytes_per_chip() == FactsFor(e.generation).hbm_bytes_per_chip);
    CHECK(t.total_hbm_bytes() == t.hbm_bytes_per_chip() * chips);
    // Host slices never wrap around (see Presets() in topology.cc).
    CHECK(t.wraparound() == std::vector<bool>(e.shape.size(), false));
  }
}

TEST_CASE("preset names are matched case-insensitively") {
  Topology t = MustPreset("V6E-4");
  CHECK(t.name() == "v6e-4");
}

TEST_CASE("hbm override replaces per-chip HBM") {
  Topology t = MustPreset("v6e-8", 64 << 20);
  CHECK(t.hbm_bytes_per_chip() == (64u << 20));
  CHECK(t.total_hbm_bytes() == 8 * (uint64_t{64} << 20));
  CHECK(t.facts().hbm_bytes_per_chip == 32 * kGiB);  // facts stay published

  absl::StatusOr<Topology> c = Topology::Create(
      "small", Generation::kV5p, {2, 2, 1}, {false, false, false}, 4096);
  REQUIRE(c.ok());
  CHECK(c->hbm_bytes_per_chip() == 4096);
}

TEST_CASE("unknown preset error lists the known presets") {
  absl::StatusOr<Topology> t = Topology::FromPreset("v4-8");
  REQUIRE_FALSE(t.ok());
  CHECK(t.status().code() == absl::StatusCode::kInvalidArgument);
  const std::string msg(t.status().message());
  CHECK(Contains(msg, "v4-8"));
  for (const std::string& name : Topology::PresetNames()) {
    INFO(msg);
    CHECK(Contains(msg, name));
  }
}

TEST_CASE("coordinates round-trip through ChipAt, axis 0 fastest") {
  for (const std::string& name : Topology::PresetNames()) {
    INFO(name);
    Topology t = MustPreset(name);
    std::set<std::vector<int>> seen;
    for (int chip = 0; chip < t.num_chips(); ++chip) {
      const std::vector<int>& c = t.coords(chip);
      REQUIRE(c.size() == t.shape().size());
      absl::StatusOr<int> back = t.ChipAt(c);
      REQUIRE(back.ok());
      CHECK(*back == chip);
      seen.insert(c);
    }
    CHECK(static_cast<int>(seen.size()) == t.num_chips());
  }

  Topology t = MustPreset("v6e-8");  // 2x4
  CHECK(t.coords(0) == std::vector<int>{0, 0});
  CHECK(t.coords(1) == std::vector<int>{1, 0});
  CHECK(t.coords(2) == std::vector<int>{0, 1});
  CHECK(t.coords(7) == std::vector<int>{1, 3});
  CHECK(*t.ChipAt({1, 2}) == 5);
}

TEST_CASE("ChipAt rejects out-of-range and wrong-arity coordinates") {
  Topology t = MustPreset("v6e-8");
  for (const std::vector<int>& bad : std::vector<std::vector<int>>{
           {2, 0}, {0, 4}, {-1, 0}, {0, -1}, {0}, {0, 0, 0}}) {
    absl::StatusOr<int> chip = t.ChipAt(bad);
    REQUIRE_FALSE(chip.ok());
    CHECK(chip.status().code() == absl::StatusCode::kInvalidArgument);
  }
}

TEST_CASE("host preset neighbours") {
  SECTION("single chip has no links") {
    for (const char* name : {"v5e-1", "v6e-1"}) {
      Topology t = MustPreset(name);
      REQUIRE(t.num_chips() == 1);
      CHECK(t.Links(0).empty());
      CHECK(t.Neighbors(0).empty());
    }
  }
  SECTION("2x2: each chip has exactly 2 neighbours") {
    for (const char* name : {"v6e-4", "v5e-4"}) {
      Topology t = MustPreset(name);
      CHECK(t.Neighbors(0) == std::vector<int>{1, 2});
      CHECK(t.Neighbors(1) == std::vector<int>{0, 3});
      CHECK(t.Neighbors(2) == std::vector<int>{0, 3});
      CHECK(t.Neighbors(3) == std::vector<int>{1, 2});
      for (int chip = 0; chip < 4; ++chip) CHECK(t.Links(chip).size() == 2);
    }
  }
  SECTION("2x4: corners have 2 neighbours, the middle 3") {
    Topology t = MustPreset("v6e-8");
    // Chips 0,1 (y=0) and 6,7 (y=3) are corners.
    for (int chip : {0, 1, 6, 7}) {
      INFO(chip);
      CHECK(t.Neighbors(chip).size() == 2);
    }
    for (int chip : {2, 3, 4, 5}) {
      INFO(chip);
      CHECK(t.Neighbors(chip).size() == 3);
    }
    CHECK(t.Neighbors(0) == std::vector<int>{1, 2});
    CHECK(t.Neighbors(3) == std::vector<int>{1, 2, 5});
    CHECK(t.Neighbors(7) == std::vector<int>{5, 6});
  }
  SECTION("2x2x1: the size-1 axis adds no links") {
    for (const char* name : {"v5p-4", "v7x-4"}) {
      INFO(name);
      Topology t = MustPreset(name);
      REQUIRE(t.num_chips() == 4);
      CHECK(t.Neighbors(0) == std::vector<int>{1, 2});
      CHECK(t.Neighbors(3) == std::vector<int>{1, 2});
      for (int chip = 0; chip < 4; ++chip) {
        CHECK(t.Neighbors(chip).size() == 2);
        for (const IciLink& link : t.Links(chip)) CHECK(link.axis != 2);
      }
    }
  }
}

TEST_CASE("links are symmetric and never wrap in presets") {
  for (const std::string& name : Topology::PresetNames()) {
    INFO(name);
    Topology t = MustPreset(name);
    for (int chip = 0; chip < t.num_chips(); ++chip) {
      for (const IciLink& link : t.Links(chip)) {
        CHECK_FALSE(link.wraps);
        CHECK((link.direction == -1 || link.direction == 1));
        CHECK(link.peer != chip);
        // The peer has the reverse link back.
        bool reverse = false;
        for (const IciLink& back : t.Links(link.peer)) {
          if (back.peer == chip && back.axis == link.axis &&
              back.direction == -link.direction) {
            reverse = true;
          }
        }
        CHECK(reverse);
      }
    }
  }
}

TEST_CASE("synthetic 4x4 torus with wraparound") {
  Topology t = MustCreate(Generation::kV6e, {4, 4}, {true, true});
  CHECK(t.num_chips() == 16);
  for (int chip = 0; chip < t.num_chips(); ++chip) {
    INFO(chip);
    CHECK(t.Links(chip).size() == 4);
    CHECK(t.Neighbors(chip).size() == 4);
  }
  // Chip 0 (0,0) reaches (3,0)=3 and (0,3)=12 through wrap links.
  CHECK(t.Neighbors(0) == std::vector<int>{1, 3, 4, 12});
  int wrapping = 0;
  for (const IciLink& link : t.Links(0)) {
    if (link.wraps) {
      ++wrapping;
      CHECK(link.direction == -1);
      CHECK((link.peer == 3 || link.peer == 12));
    }
  }
  CHECK(wrapping == 2);
  // An interior chip does not use wrap links.
  for (const IciLink& link : t.Links(5)) CHECK_FALSE(link.wraps);
}

TEST_CASE("synthetic 4x4 mesh without wraparound") {
  Topology t = MustCreate(Generation::kV6e, {4, 4}, {false, false});
  for (int corner : {0, 3, 12, 15}) {
    INFO(corner);
    CHECK(t.Neighbors(corner).size() == 2);
  }
  CHECK(t.Neighbors(1).size() == 3);  // edge
  CHECK(t.Neighbors(5).size() == 4);  // interior
  CHECK(t.Neighbors(15) == std::vector<int>{11, 14});
}

TEST_CASE("wraparound on axes of size 1 or 2 adds no duplicate links") {
  Topology t = MustCreate(Generation::kV5p, {2, 3, 1}, {true, true, true});
  for (int chip = 0; chip < t.num_chips(); ++chip) {
    INFO(chip);
    // One link along the size-2 axis, two around the 3-ring, none on axis 2.
    CHECK(t.Links(chip).size() == 3);
    CHECK(t.Neighbors(chip).size() == 3);
  }
}

TEST_CASE("Create rejects invalid arguments") {
  auto expect_invalid = [](absl::StatusOr<Topology> t, const char* needle) {
    REQUIRE_FALSE(t.ok());
    CHECK(t.status().code() == absl::StatusCode::kInvalidArgument);
    INFO(t.status().message());
    CHECK(Contains(std::string(t.status().message()), needle));
  };
  SECTION("too few dimensions for the generation") {
    expect_invalid(
        Topology::Create("x", Generation::kV5p, {2, 2}, {false, false}),
        "3D torus");
    expect_invalid(Topology::Create("x", Generation::kV6e, {8}, {false}),
                   "2D torus");
    expect_invalid(Topology::Create("x", Generation::kV6e, {}, {}), "2D torus");
  }
  SECTION("extra dimensions must be 1") {
    expect_invalid(Topology::Create("x", Generation::kV6e, {2, 2, 2},
                                    {false, false, false}),
                   "must have size 1");
    CHECK(Topology::Create("x", Generation::kV6e, {2, 2, 1},
                           {false, false, false})
              .ok());
  }
  SECTION("zero or negative dimension") {
    expect_invalid(
        Topology::Create("x", Generation::kV6e, {2, 0}, {false, false}),
        ">= 1");
    expect_invalid(Topology::Create("x", Generation::kV5p, {-1, 2, 2},
                                    {false, false, false}),
                   ">= 1");
  }
  SECTION("too many chips") {
    expect_invalid(Topology::Create("x", Generation::kV5p, {16, 16, 17},
                                    {false, false, false}),
                   "4096");
    // Large enough to overflow 32-bit multiplication.
    expect_invalid(Topology::Create("x", Generation::kV6e, {1 << 20, 1 << 20},
                                    {false, false}),
                   "4096");
    CHECK(Topology::Create("x", Generation::kV5p, {16, 16, 16},
                           {true, true, true})
              .ok());
  }
  SECTION("wraparound size must match shape") {
    expect_invalid(Topology::Create("x", Generation::kV6e, {2, 4}, {false}),
                   "wraparound");
    expect_invalid(
        Topology::Create("x", Generation::kV6e, {2, 4}, {false, false, false}),
        "wraparound");
  }
}

}  // namespace
}  // namespace tpud
