#include "plugins/k8s_device_plugin/devices.h"

#include <string>
#include <vector>

#include "catch2_compat/catch.h"

namespace tpud::k8s {
namespace {

constexpr uint64_t kGiB = uint64_t{1} << 30;

// A 2-D host of nx x ny chips, first axis fastest (as tpud numbers them).
std::vector<HostChip> Grid(int nx, int ny) {
  std::vector<HostChip> chips;
  for (int id = 0; id < nx * ny; ++id) {
    HostChip c;
    c.id = id;
    c.coords = {id % nx, id / nx};
    c.hbm_bytes = 32 * kGiB;
    const int x = id % nx, y = id / nx;
    if (x > 0) c.neighbors.push_back(id - 1);
    if (x + 1 < nx) c.neighbors.push_back(id + 1);
    if (y > 0) c.neighbors.push_back(id - nx);
    if (y + 1 < ny) c.neighbors.push_back(id + nx);
    chips.push_back(c);
  }
  return chips;
}

std::vector<std::string> Ids(const std::vector<int>& chips) {
  std::vector<std::string> out;
  for (int c : chips) out.push_back("chip-" + std::to_string(c));
  return out;
}

TEST_CASE(
    "whole chips: one device per chip, healthy unless drained or unhealthy") {
  absl::StatusOr<TpuResource> r = TpuResource::WholeChips(Grid(2, 2));
  REQUIRE(r.ok());
  CHECK(r->resource_name() == "tpud.io/chip");
  REQUIRE(r->devices().size() == 4);
  CHECK(r->devices()[3].id == "chip-3");
  std::vector<ChipState> states(4);
  states[1].drained = true;
  states[2].healthy = false;
  CHECK(r->Health(states) == std::vector<bool>{true, false, false, true});
}

TEST_CASE("preferred chips are contiguous on the torus") {
  absl::StatusOr<TpuResource> r = TpuResource::WholeChips(Grid(2, 4));  // v6e-8
  REQUIRE(r.ok());
  const std::vector<std::string> all = Ids({0, 1, 2, 3, 4, 5, 6, 7});
  // A 2x2 sub-slice, not a 1x4 line.
  CHECK(*r->Preferred(all, {}, 4) == Ids({0, 1, 2, 3}));
  CHECK(*r->Preferred(Ids({1, 2, 3, 4, 5, 6, 7}), {}, 4) == Ids({2, 3, 4, 5}));
  CHECK(*r->Preferred(all, Ids({7}), 4) == Ids({4, 5, 6, 7}));
  CHECK(*r->Preferred(all, {}, 2) == Ids({0, 1}));
  // Pairs that are neighbours beat ones that are not.
  CHECK(*r->Preferred(Ids({0, 3, 5}), {}, 2) == Ids({3, 5}));
  CHECK(r->Preferred(all, {}, 9).status().code() ==
        absl::StatusCode::kInvalidArgument);
  CHECK(r->Preferred(Ids({0, 1}), Ids({0, 1, 2}), 2).status().code() ==
        absl::StatusCode::kInvalidArgument);
  absl::StatusOr<std::vector<std::string>> bad = r->Preferred({"gpu-0"}, {}, 1);
  REQUIRE(bad.status().code() == absl::StatusCode::kInvalidArgument);
  CHECK(std::string(bad.status().message()).find("gpu-0") != std::string::npos);
}

TEST_CASE("chip shares pack onto as few chips as possible") {
  absl::StatusOr<TpuResource> r = TpuResource::ChipShares(Grid(2, 2), 4, 0);
  REQUIRE(r.ok());
  CHECK(r->resource_name() == "tpud.io/chip-share");
  CHECK(r->devices().size() == 16);
  CHECK(r->share_quota_bytes() == 8 * kGiB);
  std::vector<std::string> all;
  for (const Device& d : r->devices()) all.push_back(d.id);
  CHECK(*r->Preferred(all, {}, 2) ==
        std::vector<std::string>{"chip-0-share-0", "chip-0-share-1"});
  // Chip 1 has one share left, chip 2 three: a single share goes where the
  // fewest are free, so whole chips stay free.
  std::vector<std::string> some = {
      "chip-1-share-3", "chip-2-share-1", "chip-2-share-2", "chip-2-share-3",
      "chip-3-share-0", "chip-3-share-1", "chip-3-share-2", "chip-3-share-3"};
  CHECK(*r->Preferred(some, {}, 1) ==
        std::vector<std::string>{"chip-1-share-3"});
  CHECK(*r->Preferred(some, {}, 3) ==
        std::vector<std::string>{"chip-2-share-1", "chip-2-share-2",
                                 "chip-2-share-3"});
  // Must-include shares pull the rest onto their chip.
  CHECK(*r->Preferred(some, {"chip-3-share-2"}, 2) ==
        std::vector<std::string>{"chip-3-share-0", "chip-3-share-2"});
  // More than any chip has: the fullest chips first.
  CHECK(r->Preferred(some, {}, 6)->size() == 6);
}

TEST_CASE("plans: chips and per-chip quotas for a container's devices") {
  absl::StatusOr<TpuResource> shares =
      TpuResource::ChipShares(Grid(2, 2), 4, 2 * kGiB);
  REQUIRE(shares.ok());
  absl::StatusOr<AllocationPlan> p =
      shares->Plan({"chip-3-share-0", "chip-1-share-2", "chip-3-share-1"});
  REQUIRE(p.ok());
  CHECK(p->chips == std::vector<int>{1, 3});
  CHECK(p->quota_bytes == std::vector<uint64_t>{2 * kGiB, 4 * kGiB});
  CHECK(shares->Plan({}).status().code() == absl::StatusCode::kInvalidArgument);
  CHECK(shares->Plan({"chip-0-share-4"}).status().code() ==
        absl::StatusCode::kInvalidArgument);
  CHECK(shares->Plan({"chip-0-share-1", "chip-0-share-1"}).status().code() ==
        absl::StatusCode::kInvalidArgument);

  absl::StatusOr<TpuResource> chips = TpuResource::WholeChips(Grid(2, 2));
  REQUIRE(chips.ok());
  p = chips->Plan({"chip-2", "chip-0"});
  REQUIRE(p.ok());
  CHECK(p->chips == std::vector<int>{0, 2});
  CHECK(p->quota_bytes == std::vector<uint64_t>{32 * kGiB, 32 * kGiB});
  CHECK(TpuResource::ChipShares(Grid(2, 2), 0, 0).status().code() ==
        absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace tpud::k8s
