// The allocation state file: the device plugin's allocations (tokens, chips,
// HBM quotas), kept on disk so that a restarted tpud honours the tokens its
// pods already hold (--allocation_state).
//
// A text file written whole and renamed into place (never half-written),
// mode 0600 (it holds the tokens):
//
//   tpud-allocation-state 1
//   host <topology> <chips>
//   next_id <id>
//   allocation <id> <created µs since epoch> <token> <chip>=<quota>,... <name>
//   ...
//   end <allocations> <FNV-1a 64 of every byte before this line, hex>
//
// The name is percent-encoded. Decoding is all or nothing: a file that is
// not this format, is damaged or cut short, or was written for another host
// layout is refused with an error that names the file and what is wrong.
//
// Thread-safety: plain functions over values.
#ifndef TPUD_DAEMON_CORE_ALLOCATION_STATE_H_
#define TPUD_DAEMON_CORE_ALLOCATION_STATE_H_

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"

namespace tpud {

// One allocation as RuntimeCore holds it, token included.
struct AllocationRecord {
  uint64_t id = 0;
  std::string token;
  std::string name;
  std::vector<int> chips;
  std::vector<uint64_t> quota_bytes;  // per entry of `chips`; 0: none
  absl::Time created;
};

struct AllocationState {
  std::string topology;  // the host's topology name (Topology::name)
  int num_chips = 0;
  uint64_t next_id = 1;
  std::vector<AllocationRecord> allocations;  // by id
};

std::string EncodeAllocationState(const AllocationState& state);

// Decodes what EncodeAllocationState wrote, checking it against the host it
// is loaded on (`topology`, `num_chips`). Errors are FAILED_PRECONDITION and
// begin with `path`.
absl::StatusOr<AllocationState> DecodeAllocationState(
    absl::string_view text, absl::string_view path, absl::string_view topology,
    int num_chips);

// Reads `path`; nullopt when it does not exist.
absl::StatusOr<std::optional<std::string>> ReadStateFile(
    const std::string& path);

// Replaces `path` with `contents` atomically: a temporary file in the same
// directory, written, flushed to disk and renamed over `path` (then the
// directory is flushed). Readers see the old file or the new one. Missing
// directories are made, mode 0700.
absl::Status WriteStateFileAtomically(const std::string& path,
                                      absl::string_view contents);

}  // namespace tpud

#endif  // TPUD_DAEMON_CORE_ALLOCATION_STATE_H_
