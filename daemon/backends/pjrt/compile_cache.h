// The compilation cache on disk (--compile_cache_dir): programs the PJRT
// backend compiled, kept as the plugin's serialized executables, so that a
// restarted tpud (an upgrade, a crash, a node reboot) loads them instead of
// compiling them again.
//
// One file per program, named by a hash of its key. The key is everything
// the compiled code depends on: the plugin build (its path, size and
// modification time, platform and API version, create options, the
// XLA_FLAGS and LIBTPU_INIT_ARGS it reads), the compile options and the
// program's text. Each file holds the whole key and a
// checksum over key and payload, so
//   - a torn write (tpud killed mid-write, a power cut) or a corrupt file
//     fails the checksum or the length check,
//   - an entry of another plugin build or another program with the same
//     hash fails the key comparison,
// and such an entry is a miss: it is removed and counted, and the program
// is compiled. Files are written to a temporary name and renamed into
// place, so a reader sees a whole entry or none.
//
// The directory is the cache's alone: tpud creates it with mode 0700 and
// refuses to use one that others may write (an entry is code the plugin
// loads into tpud). Its size is bounded: storing past the bound removes the
// least recently used entries (by modification time, which a hit renews),
// so the bound holds across restarts; eviction goes down to 90% of the
// bound, so that it happens once per tenth of the bound stored, not per
// store. A write that fails (a full disk) is
// counted and logged once; compilation goes on without the cache.
//
// Not thread-safe: one executor thread uses it. Several tpud processes (or
// executors) may share a directory: each write is atomic, eviction
// tolerates files others removed, and the size is re-read from the
// directory before anything is evicted.
#ifndef TPUD_DAEMON_BACKENDS_PJRT_COMPILE_CACHE_H_
#define TPUD_DAEMON_BACKENDS_PJRT_COMPILE_CACHE_H_

#include <cstdint>
#include <memory>
#include <optional>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace tpud::pjrt {

// A stable 64-bit hash of `data` (the same on every run and build, unlike
// absl::Hash): file names and checksums.
uint64_t StableHash64(absl::string_view data, uint64_t seed = 0);

class DiskCompileCache {
 public:
  // Opens (creating where missing, mode 0700) the cache in `dir`, bounded to
  // `max_bytes`. FAILED_PRECONDITION where `dir` is not a directory, is not
  // owned by this user or may be written by others; the caller goes on
  // without a cache.
  static absl::StatusOr<std::unique_ptr<DiskCompileCache>> Open(
      const std::string& dir, uint64_t max_bytes);

  struct Entry {
    std::string payload;      // the plugin's serialized executable
    uint64_t compile_ns = 0;  // how long compiling it took when stored
  };
  // The entry stored under `key`, if a whole and matching one is there. An
  // entry that fails a check is removed and counted in rejected().
  std::optional<Entry> Load(absl::string_view key);
  // Stores `payload` under `key`, evicting the least recently used entries
  // past the bound. An error (counted in write_errors()) leaves the cache as
  // it was.
  absl::Status Store(absl::string_view key, absl::string_view payload,
                     uint64_t compile_ns);
  // Removes the entry under `key` (one the plugin refused to load).
  void Remove(absl::string_view key);
  // Where `key`'s entry lies.
  std::string PathOf(absl::string_view key) const;
  // Whether storing `bytes` more (key and payload) would evict entries: the
  // moment for the caller to Renew the entries it still uses, least
  // recently used first, since eviction goes by modification time.
  bool WouldEvict(uint64_t bytes) const;
  // Marks the entry at `path` as just used.
  void Renew(const std::string& path);

  const std::string& dir() const { return dir_; }
  uint64_t max_bytes() const { return max_bytes_; }
  uint64_t entries() const { return entries_; }
  uint64_t bytes() const { return bytes_; }
  uint64_t rejected() const { return rejected_; }
  uint64_t write_errors() const { return write_errors_; }

 private:
  DiskCompileCache(std::string dir, uint64_t max_bytes)
      : dir_(std::move(dir)), max_bytes_(max_bytes) {}
  // Re-reads the entries' count and size from the directory; with `evict`,
  // removes the oldest until `incoming` more bytes fit under the bound.
  void Scan(uint64_t incoming, bool evict);
  void Reject(const std::string& path);

  std::string dir_;
  uint64_t max_bytes_;
  uint64_t entries_ = 0;
  uint64_t bytes_ = 0;
  uint64_t rejected_ = 0;
  uint64_t write_errors_ = 0;
  uint64_t temp_counter_ = 0;
};

}  // namespace tpud::pjrt

#endif  // TPUD_DAEMON_BACKENDS_PJRT_COMPILE_CACHE_H_
