#include "plugins/k8s_device_plugin/devices.h"

#include <algorithm>
#include <functional>
#include <optional>
#include <set>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace tpud::k8s {
namespace {

// Combinations a preferred allocation may try before it goes greedy.
constexpr uint64_t kMaxCombinations = 200000;

uint64_t Choose(uint64_t n, uint64_t k) {
  if (k > n) return 0;
  uint64_t r = 1;
  for (uint64_t i = 1; i <= k; ++i) {
    r = r * (n - k + i) / i;
    if (r > kMaxCombinations) return kMaxCombinations + 1;
  }
  return r;
}

std::string ChipId(int chip) { return absl::StrCat("chip-", chip); }
std::string ShareId(int chip, int share) {
  return absl::StrCat("chip-", chip, "-share-", share);
}

absl::Status CheckChips(const std::vector<HostChip>& chips) {
  if (chips.empty()) return absl::InvalidArgumentError("tpud reports no chips");
  for (size_t i = 0; i < chips.size(); ++i) {
    if (chips[i].id != static_cast<int>(i)) {
      return absl::InvalidArgumentError(
          absl::StrCat("tpud's chips are not numbered 0..", chips.size() - 1));
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<TpuResource> TpuResource::WholeChips(
    std::vector<HostChip> chips) {
  if (absl::Status st = CheckChips(chips); !st.ok()) return st;
  TpuResource r;
  r.resource_name_ = kChipResource;
  r.socket_name_ = "tpud-chip.sock";
  r.chips_ = std::move(chips);
  for (const HostChip& c : r.chips_) {
    r.index_[ChipId(c.id)] = r.devices_.size();
    r.devices_.push_back({ChipId(c.id), c.id, -1});
  }
  return r;
}

absl::StatusOr<TpuResource> TpuResource::ChipShares(
    std::vector<HostChip> chips, int shares_per_chip,
    uint64_t share_quota_bytes) {
  if (absl::Status st = CheckChips(chips); !st.ok()) return st;
  if (shares_per_chip < 1 || shares_per_chip > 1024) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--shares_per_chip=", shares_per_chip, ": give 1 to 1024"));
  }
  TpuResource r;
  r.resource_name_ = kChipShareResource;
  r.socket_name_ = "tpud-chip-share.sock";
  r.shares_per_chip_ = shares_per_chip;
  const uint64_t hbm = chips.front().hbm_bytes;
  r.share_quota_bytes_ =
      share_quota_bytes != 0 ? share_quota_bytes : hbm / shares_per_chip;
  if (r.share_quota_bytes_ == 0) {
    return absl::InvalidArgumentError("a chip share would have no HBM");
  }
  if (r.share_quota_bytes_ > hbm) {
    return absl::InvalidArgumentError(
        absl::StrCat("--share_quota_bytes=", share_quota_bytes,
                     " is more than a chip's HBM (", hbm, " bytes)"));
  }
  r.chips_ = std::move(chips);
  for (const HostChip& c : r.chips_) {
    for (int s = 0; s < shares_per_chip; ++s) {
      r.index_[ShareId(c.id, s)] = r.devices_.size();
      r.devices_.push_back({ShareId(c.id, s), c.id, s});
    }
  }
  return r;
}

std::vector<bool> TpuResource::Health(
    const std::vector<ChipState>& chips) const {
  std::vector<bool> out;
  out.reserve(devices_.size());
  for (const Device& d : devices_) {
    const bool known = d.chip < static_cast<int>(chips.size());
    out.push_back(known && chips[d.chip].healthy && !chips[d.chip].drained);
  }
  return out;
}

int TpuResource::ChipOf(const std::string& id) const {
  auto it = index_.find(id);
  return it == index_.end() ? -1 : devices_[it->second].chip;
}

absl::StatusOr<const Device*> TpuResource::Find(const std::string& id) const {
  auto it = index_.find(id);
  if (it == index_.end()) {
    const std::string form =
        whole_chips() ? absl::StrCat("chip-0 .. chip-", chips_.size() - 1)
                      : absl::StrCat("chip-<0..", chips_.size() - 1,
                                     ">-share-<0..", shares_per_chip_ - 1, ">");
    return absl::InvalidArgumentError(absl::StrCat("unknown device ID \"", id,
                                                   "\" for ", resource_name_,
                                                   ": its devices are ", form));
  }
  return &devices_[it->second];
}

absl::StatusOr<std::vector<int>> TpuResource::PreferredChips(
    std::vector<int> candidates, std::vector<int> must, int size) const {
  // Whether two chips are ICI neighbours.
  auto linked = [this](int a, int b) {
    const std::vector<int>& n = chips_[a].neighbors;
    return std::find(n.begin(), n.end(), b) != n.end();
  };
  struct Score {
    bool box = false;
    int links = 0;
    int64_t bbox = 0;
    std::vector<int> ids;
  };
  auto score = [&](const std::vector<int>& set) {
    Score s;
    s.ids = set;
    std::sort(s.ids.begin(), s.ids.end());
    for (size_t i = 0; i < set.size(); ++i) {
      for (size_t j = i + 1; j < set.size(); ++j)
        s.links += linked(set[i], set[j]) ? 1 : 0;
    }
    const size_t dims = chips_[set.front()].coords.size();
    s.bbox = 1;
    for (size_t d = 0; d < dims; ++d) {
      int lo = chips_[set.front()].coords[d], hi = lo;
      for (int c : set) {
        lo = std::min(lo, chips_[c].coords[d]);
        hi = std::max(hi, chips_[c].coords[d]);
      }
      s.bbox *= hi - lo + 1;
    }
    s.box = s.bbox == static_cast<int64_t>(set.size());
    return s;
  };
  auto better = [](const Score& a, const Score& b) {
    if (a.box != b.box) return a.box;
    if (a.links != b.links) return a.links > b.links;
    if (a.bbox != b.bbox) return a.bbox < b.bbox;
    return a.ids < b.ids;
  };

  const int need = size - static_cast<int>(must.size());
  if (need == 0) return must;
  if (Choose(candidates.size(), need) <= kMaxCombinations) {
    std::vector<int> set = must;
    std::optional<Score> best;
    std::function<void(size_t)> pick = [&](size_t from) {
      if (static_cast<int>(set.size()) == size) {
        Score s = score(set);
        if (!best.has_value() || better(s, *best)) best = std::move(s);
        return;
      }
      for (size_t i = from; i < candidates.size(); ++i) {
        if (candidates.size() - i < static_cast<size_t>(size) - set.size())
          break;
        set.push_back(candidates[i]);
        pick(i + 1);
        set.pop_back();
      }
    };
    pick(0);
    return best->ids;
  }
  // Too many to try (a big host): grow from the required chips (or the
  // lowest one) by the chip with the most links into the set.
  std::vector<int> set = must;
  std::set<int> left(candidates.begin(), candidates.end());
  if (set.empty()) {
    set.push_back(*left.begin());
    left.erase(left.begin());
  }
  while (static_cast<int>(set.size()) < size) {
    int best = -1, best_links = -1;
    for (int c : left) {
      int links = 0;
      for (int s : set) links += linked(c, s) ? 1 : 0;
      if (links > best_links) best = c, best_links = links;
    }
    set.push_back(best);
    left.erase(best);
  }
  std::sort(set.begin(), set.end());
  return set;
}

absl::StatusOr<std::vector<std::string>> TpuResource::Preferred(
    const std::vector<std::string>& available,
    const std::vector<std::string>& must_include, int size) const {
  std::set<size_t> must_set, pool;  // device indices
  for (const std::string& id : must_include) {
    absl::StatusOr<const Device*> d = Find(id);
    if (!d.ok()) return d.status();
    must_set.insert(*d - devices_.data());
  }
  for (const std::string& id : available) {
    absl::StatusOr<const Device*> d = Find(id);
    if (!d.ok()) return d.status();
    const size_t i = *d - devices_.data();
    if (must_set.count(i) == 0) pool.insert(i);
  }
  if (size < static_cast<int>(must_set.size()) ||
      size > static_cast<int>(must_set.size() + pool.size())) {
    return absl::InvalidArgumentError(absl::StrCat(
        "cannot pick ", size, " ", resource_name_, " devices from ",
        pool.size() + must_set.size(), " available of which ", must_set.size(),
        " must be included"));
  }
  std::vector<std::string> out;
  if (whole_chips()) {
    std::vector<int> candidates, must;
    for (size_t i : pool) candidates.push_back(devices_[i].chip);
    for (size_t i : must_set) must.push_back(devices_[i].chip);
    absl::StatusOr<std::vector<int>> chips =
        PreferredChips(candidates, must, size);
    if (!chips.ok()) return chips.status();
    for (int c : *chips) out.push_back(ChipId(c));
    return out;
  }
  // Shares: free shares per chip, lowest share first.
  std::map<int, std::vector<size_t>> free;
  for (size_t i : pool) free[devices_[i].chip].push_back(i);
  std::vector<size_t> chosen(must_set.begin(), must_set.end());
  int need = size - static_cast<int>(chosen.size());
  auto take = [&](int chip) {
    std::vector<size_t>& f = free[chip];
    while (need > 0 && !f.empty()) {
      chosen.push_back(f.front());
      f.erase(f.begin());
      --need;
    }
    free.erase(chip);
  };
  // Chips the container already has shares on come first.
  for (size_t i : must_set) {
    if (need > 0 && free.count(devices_[i].chip)) take(devices_[i].chip);
  }
  while (need > 0) {
    // The chip with the fewest free shares that suffice; if none suffices,
    // the one with the most.
    int fit = -1, largest = -1;
    for (const auto& [chip, f] : free) {
      const int n = static_cast<int>(f.size());
      if (n >= need && (fit < 0 || n < static_cast<int>(free[fit].size())))
        fit = chip;
      if (largest < 0 || n > static_cast<int>(free[largest].size()))
        largest = chip;
    }
    take(fit >= 0 ? fit : largest);
  }
  std::sort(chosen.begin(), chosen.end());
  for (size_t i : chosen) out.push_back(devices_[i].id);
  return out;
}

absl::StatusOr<AllocationPlan> TpuResource::Plan(
    const std::vector<std::string>& device_ids) const {
  if (device_ids.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("no ", resource_name_, " devices to allocate"));
  }
  std::map<int, uint64_t> per_chip;
  std::set<std::string> seen;
  for (const std::string& id : device_ids) {
    absl::StatusOr<const Device*> d = Find(id);
    if (!d.ok()) return d.status();
    if (!seen.insert(id).second) {
      return absl::InvalidArgumentError(
          absl::StrCat("device ID \"", id, "\" is listed twice"));
    }
    per_chip[(*d)->chip] +=
        whole_chips() ? chips_[(*d)->chip].hbm_bytes : share_quota_bytes_;
  }
  AllocationPlan plan;
  for (const auto& [chip, quota] : per_chip) {
    plan.chips.push_back(chip);
    plan.quota_bytes.push_back(quota);
  }
  return plan;
}

}  // namespace tpud::k8s
