#include "tpu/units.h"

#include <cstdint>
#include <limits>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "catch2_compat/catch.h"

namespace tpu {
namespace {

constexpr uint64_t kKiB = uint64_t{1} << 10;
constexpr uint64_t kMiB = uint64_t{1} << 20;
constexpr uint64_t kGiB = uint64_t{1} << 30;
constexpr uint64_t kTiB = uint64_t{1} << 40;

uint64_t MustParse(const std::string& text) {
  absl::StatusOr<uint64_t> parsed = ParseBytes(text);
  INFO("ParseBytes(\"" << text << "\") -> " << parsed.status().ToString());
  REQUIRE(parsed.ok());
  return *parsed;
}

void RequireRejected(const std::string& text) {
  absl::StatusOr<uint64_t> parsed = ParseBytes(text);
  INFO("ParseBytes(\"" << text << "\") -> "
                       << (parsed.ok() ? std::to_string(*parsed)
                                       : parsed.status().ToString()));
  REQUIRE_FALSE(parsed.ok());
  CHECK(parsed.status().code() == absl::StatusCode::kInvalidArgument);
}

TEST_CASE("FormatBytes prints bytes below 1 KiB exactly") {
  CHECK(FormatBytes(0) == "0 B");
  CHECK(FormatBytes(1) == "1 B");
  CHECK(FormatBytes(512) == "512 B");
  CHECK(FormatBytes(1023) == "1023 B");
}

TEST_CASE("FormatBytes uses binary units with two decimals") {
  CHECK(FormatBytes(1024) == "1.00 KiB");
  CHECK(FormatBytes(4096) == "4.00 KiB");
  CHECK(FormatBytes(1536) == "1.50 KiB");
  CHECK(FormatBytes(kMiB) == "1.00 MiB");
  CHECK(FormatBytes(64 * kMiB) == "64.00 MiB");
  CHECK(FormatBytes(kGiB + kGiB / 2) == "1.50 GiB");
  CHECK(FormatBytes(31 * kGiB + kGiB / 4) == "31.25 GiB");
  CHECK(FormatBytes(192 * kGiB) == "192.00 GiB");
  CHECK(FormatBytes(2 * kTiB) == "2.00 TiB");
  CHECK(FormatBytes(std::numeric_limits<uint64_t>::max()) == "16.00 EiB");
}

TEST_CASE("ParseBytes reads plain numbers exactly") {
  CHECK(MustParse("0") == 0);
  CHECK(MustParse("4096") == 4096);
  CHECK(MustParse("4096B") == 4096);
  CHECK(MustParse("18446744073709551615") ==
        std::numeric_limits<uint64_t>::max());
}

TEST_CASE("ParseBytes reads binary suffixes as powers of 1024") {
  CHECK(MustParse("4KiB") == 4 * kKiB);
  CHECK(MustParse("4k") == 4 * kKiB);
  CHECK(MustParse("4K") == 4 * kKiB);
  CHECK(MustParse("4Ki") == 4 * kKiB);
  CHECK(MustParse("512MiB") == 512 * kMiB);
  CHECK(MustParse("512m") == 512 * kMiB);
  CHECK(MustParse("1.5GiB") == kGiB + kGiB / 2);
  CHECK(MustParse("2G") == 2 * kGiB);
  CHECK(MustParse("2gib") == 2 * kGiB);
  CHECK(MustParse("1TiB") == kTiB);
  CHECK(MustParse("0.5k") == 512);
}

TEST_CASE("ParseBytes reads KB/MB/GB/TB as powers of 1000") {
  CHECK(MustParse("16MB") == 16000000);
  CHECK(MustParse("16 MB") == 16000000);
  CHECK(MustParse("3kb") == 3000);
  CHECK(MustParse("2GB") == 2000000000);
  CHECK(MustParse("1TB") == 1000000000000);
}

TEST_CASE("ParseBytes accepts none, and surrounding whitespace") {
  CHECK(MustParse("none") == 0);
  CHECK(MustParse("None") == 0);
  CHECK(MustParse("  none\n") == 0);
  CHECK(MustParse("  4096  ") == 4096);
  CHECK(MustParse("\t2 GiB ") == 2 * kGiB);
  CHECK(MustParse(" 16 MB") == 16000000);
}

TEST_CASE("ParseBytes rejects what is not a size") {
  RequireRejected("");
  RequireRejected("   ");
  RequireRejected("-1");
  RequireRejected("-4KiB");
  RequireRejected("12XB");
  RequireRejected("abc");
  RequireRejected("KiB");
  RequireRejected("4 KiB extra");
  RequireRejected("1.2.3GiB");
  RequireRejected("1e400");
  RequireRejected("0x10");
}

TEST_CASE("ParseBytes rejects sizes that overflow 64 bits") {
  RequireRejected("99999999999TiB");
  RequireRejected("16777216TiB");  // exactly 2^64
  RequireRejected("18446744073709551616");
  RequireRejected("99999999999999999999999999");
  RequireRejected("18446744073709551616.0");
  // Just below the limit is fine.
  CHECK(MustParse("16777215TiB") == 16777215 * kTiB);
}

}  // namespace
}  // namespace tpu

namespace tpu {
namespace {

TEST_CASE("FormatBytes moves to the next unit when rounding reaches it") {
  CHECK(FormatBytes(1048575) == "1.00 MiB");
  CHECK(FormatBytes(1073741823) == "1.00 GiB");
  CHECK(FormatBytes(1048000) == "1023.44 KiB");
}

TEST_CASE(
    "ParseBytes rejects sizes below one byte instead of reading them as 0") {
  CHECK_FALSE(ParseBytes("0.4").ok());
  CHECK(ParseBytes("0").value() == 0);
  CHECK(ParseBytes("0.5KiB").value() == 512);
}

}  // namespace
}  // namespace tpu
