#include "tpu/units.h"

#include <cmath>
#include <cstdlib>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace tpu {

std::string FormatBytes(uint64_t bytes) {
  static constexpr const char* kUnits[] = {"KiB", "MiB", "GiB",
                                           "TiB", "PiB", "EiB"};
  if (bytes < 1024) return absl::StrCat(bytes, " B");
  double value = static_cast<double>(bytes) / 1024.0;
  int unit = 0;
  // Compare after rounding to the printed precision, so 1048575 bytes reads
  // "1.00 MiB", not "1024.00 KiB".
  while (std::round(value * 100) >= 1024.0 * 100 && unit < 5) {
    value /= 1024.0;
    ++unit;
  }
  return absl::StrFormat("%.2f %s", value, kUnits[unit]);
}

absl::StatusOr<uint64_t> ParseBytes(absl::string_view text) {
  std::string s(absl::StripAsciiWhitespace(text));
  std::string lower = absl::AsciiStrToLower(s);
  if (lower == "none" || lower == "unlimited") return 0;
  size_t pos = 0;
  while (pos < s.size() &&
         (absl::ascii_isdigit(static_cast<unsigned char>(s[pos])) ||
          s[pos] == '.')) {
    ++pos;
  }
  std::string number = s.substr(0, pos);
  std::string suffix(absl::StripAsciiWhitespace(lower.substr(pos)));
  if (number.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "not a size: \"", text, "\" (expected e.g. 4096, 512MiB, 2GiB)"));
  }
  double multiplier = 1;
  if (suffix.empty() || suffix == "b") {
    multiplier = 1;
  } else if (suffix == "k" || suffix == "ki" || suffix == "kib") {
    multiplier = 1024.0;
  } else if (suffix == "m" || suffix == "mi" || suffix == "mib") {
    multiplier = 1024.0 * 1024;
  } else if (suffix == "g" || suffix == "gi" || suffix == "gib") {
    multiplier = 1024.0 * 1024 * 1024;
  } else if (suffix == "t" || suffix == "ti" || suffix == "tib") {
    multiplier = 1024.0 * 1024 * 1024 * 1024;
  } else if (suffix == "kb") {
    multiplier = 1e3;
  } else if (suffix == "mb") {
    multiplier = 1e6;
  } else if (suffix == "gb") {
    multiplier = 1e9;
  } else if (suffix == "tb") {
    multiplier = 1e12;
  } else {
    return absl::InvalidArgumentError(
        absl::StrCat("unknown size unit \"", suffix, "\" in \"", text, "\""));
  }
  if (multiplier == 1 && number.find('.') == std::string::npos) {
    uint64_t exact = 0;
    if (!absl::SimpleAtoi(number, &exact)) {
      return absl::InvalidArgumentError(
          absl::StrCat("size out of range: \"", text, "\""));
    }
    return exact;
  }
  double value = 0;
  if (!absl::SimpleAtod(number, &value) || !std::isfinite(value) || value < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("not a size: \"", text, "\""));
  }
  double bytes = std::round(value * multiplier);
  if (bytes == 0 && value != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("size \"", text, "\" is less than one byte"));
  }
  if (bytes >= 18446744073709551615.0) {
    return absl::InvalidArgumentError(
        absl::StrCat("size out of range: \"", text, "\""));
  }
  return static_cast<uint64_t>(bytes);
}

}  // namespace tpu
