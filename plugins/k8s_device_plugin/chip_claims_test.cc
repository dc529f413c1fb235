#include "plugins/k8s_device_plugin/chip_claims.h"

#include <string>
#include <vector>

#include "catch2_compat/catch.h"

namespace tpud::k8s {
namespace {

constexpr char kChip[] = "tpud.io/chip";
constexpr char kShare[] = "tpud.io/chip-share";

bool Contains(const std::string& haystack, const std::string& needle) {
  return haystack.find(needle) != std::string::npos;
}

TEST_CASE("a chip is held whole or as shares, never both") {
  int changes = 0;
  ChipClaims claims(4, [&] { ++changes; });
  REQUIRE(claims.Claim("pod-a", kChip, {0, 1}).ok());
  CHECK(changes == 1);
  CHECK(claims.HeldByOthers(kShare) ==
        std::vector<bool>{true, true, false, false});
  CHECK(claims.HeldByOthers(kChip) == std::vector<bool>(4, false));

  // Shares on a whole chip are refused, and nothing changes.
  absl::Status st = claims.Claim("pod-b", kShare, {1});
  CHECK(st.code() == absl::StatusCode::kFailedPrecondition);
  CHECK(Contains(std::string(st.message()),
                 "chip 1 is in use as tpud.io/chip on this node"));
  CHECK(changes == 1);
  REQUIRE(claims.Claim("pod-b", kShare, {2}).ok());
  REQUIRE(claims.Claim("pod-c", kShare, {2}).ok());  // shares share a chip
  st = claims.Claim("pod-d", kChip, {2, 3});
  CHECK(Contains(std::string(st.message()),
                 "chip 2 is in use as "
                 "tpud.io/chip-share"));
  // The same resource may take more chips of its own.
  REQUIRE(claims.Claim("pod-d", kChip, {3}).ok());

  // A chip frees once every claim on it is dropped.
  claims.Drop("pod-b");
  CHECK(claims.HeldByOthers(kChip)[2]);
  claims.Drop("pod-c");
  CHECK_FALSE(claims.HeldByOthers(kChip)[2]);
  REQUIRE(claims.Claim("pod-e", kChip, {2}).ok());
  const int before = changes;
  claims.Drop("no-such-claim");
  CHECK(changes == before);
}

TEST_CASE("the kubelet's view holds chips the plugin did not claim") {
  int changes = 0;
  ChipClaims claims(4, [&] { ++changes; });
  // A restarted plugin has no claims; the kubelet knows a pod holds shares
  // on chip 3 and a whole chip 0.
  claims.SetKubeletView({{kShare, {3}}, {kChip, {0}}});
  CHECK(changes == 1);
  claims.SetKubeletView({{kShare, {3}}, {kChip, {0}}});  // no change
  CHECK(changes == 1);
  CHECK(claims.HeldByOthers(kChip) ==
        std::vector<bool>{false, false, false, true});
  CHECK(claims.HeldByOthers(kShare) ==
        std::vector<bool>{true, false, false, false});
  CHECK_FALSE(claims.Claim("x", kChip, {3}).ok());
  CHECK_FALSE(claims.Claim("y", kShare, {0}).ok());
  CHECK(claims.Claim("z", kShare, {3}).ok());
  claims.SetKubeletView({});
  CHECK(claims.Claim("x", kChip, {0}).ok());
}

}  // namespace
}  // namespace tpud::k8s
