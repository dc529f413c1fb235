#include "plugins/k8s_device_plugin/chip_claims.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace tpud::k8s {

ChipClaims::ChipClaims(int num_chips, std::function<void()> on_change)
    : num_chips_(num_chips), on_change_(std::move(on_change)) {}

std::string ChipClaims::OtherHolderLocked(const std::string& resource,
                                          int chip) const {
  for (const auto& [key, c] : claims_) {
    if (c.resource == resource) continue;
    for (int held : c.chips) {
      if (held == chip) return c.resource;
    }
  }
  for (const auto& [r, chips] : kubelet_view_) {
    if (r != resource && chips.count(chip) > 0) return r;
  }
  return "";
}

absl::Status ChipClaims::Claim(const std::string& key,
                               const std::string& resource,
                               const std::vector<int>& chips) {
  {
    absl::MutexLock lock(&mu_);
    std::vector<int> taken;
    std::string holder;
    for (int chip : chips) {
      const std::string other = OtherHolderLocked(resource, chip);
      if (!other.empty()) {
        taken.push_back(chip);
        holder = other;
      }
    }
    if (!taken.empty()) {
      return absl::FailedPreconditionError(absl::StrCat(
          taken.size() == 1 ? "chip " : "chips ", absl::StrJoin(taken, ","),
          taken.size() == 1 ? " is" : " are", " in use as ", holder,
          " on this node; a chip is given whole (tpud.io/chip) or as shares "
          "(tpud.io/chip-share), never both at once. Its ",
          resource, " devices are advertised Unhealthy until it is free"));
    }
    claims_[key] = Claimed{resource, chips};
  }
  if (on_change_) on_change_();
  return absl::OkStatus();
}

void ChipClaims::Drop(const std::string& key) {
  {
    absl::MutexLock lock(&mu_);
    if (claims_.erase(key) == 0) return;
  }
  if (on_change_) on_change_();
}

void ChipClaims::SetKubeletView(std::map<std::string, std::set<int>> view) {
  {
    absl::MutexLock lock(&mu_);
    if (view == kubelet_view_) return;
    kubelet_view_ = std::move(view);
  }
  if (on_change_) on_change_();
}

std::vector<bool> ChipClaims::HeldByOthers(const std::string& resource) const {
  absl::MutexLock lock(&mu_);
  std::vector<bool> out(num_chips_, false);
  for (int chip = 0; chip < num_chips_; ++chip) {
    out[chip] = !OtherHolderLocked(resource, chip).empty();
  }
  return out;
}

}  // namespace tpud::k8s
