// The list of ops the PJRT backend reports as lowered (LoweredOpNames) is
// part of what clients see: torch_tpu registers its fallback for exactly
// these. It must change only on purpose, so it is checked against a file.
#include <algorithm>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "catch2_compat/catch.h"
#include "daemon/backends/pjrt/pjrt_chip.h"

namespace tpud::pjrt {
namespace {

std::vector<std::string> ReadLines(const std::string& path) {
  std::ifstream in(path);
  std::vector<std::string> lines;
  for (std::string line; std::getline(in, line);) {
    if (!line.empty()) lines.push_back(line);
  }
  return lines;
}

TEST_CASE("the lowered op list equals the golden file") {
  const std::vector<std::string> golden =
      ReadLines("daemon/backends/pjrt/lowered_ops.golden");
  REQUIRE(!golden.empty());
  const std::vector<std::string> lowered = LoweredOpNames();
  for (const std::string& name : golden) {
    INFO("in the golden file, not lowered: " << name);
    CHECK(std::find(lowered.begin(), lowered.end(), name) != lowered.end());
  }
  for (const std::string& name : lowered) {
    INFO("lowered, not in the golden file: " << name);
    CHECK(std::find(golden.begin(), golden.end(), name) != golden.end());
  }
  CHECK(lowered == golden);  // sorted, no duplicates
}

}  // namespace
}  // namespace tpud::pjrt
