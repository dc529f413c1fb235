// Human units for byte counts, used in messages and tables.
#ifndef TPU_UNITS_H_
#define TPU_UNITS_H_

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace tpu {

// "0 B", "512 B", "4.00 KiB", "1.50 GiB", "31.25 GiB".
std::string FormatBytes(uint64_t bytes);

// Parses "1024", "4KiB", "4k", "1.5GiB", "2G", "16 MB" (decimal), "none"->0.
// Binary suffixes (K, Ki, KiB, M, MiB, G, GiB, T, TiB) are powers of 1024;
// KB/MB/GB/TB are powers of 1000. Rejects negatives, garbage and overflow.
absl::StatusOr<uint64_t> ParseBytes(absl::string_view text);

}  // namespace tpu

#endif  // TPU_UNITS_H_
