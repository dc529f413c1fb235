#include "daemon/backends/pjrt/compile_cache.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <ctime>
#include <tuple>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace tpud::pjrt {
namespace {

// An entry file: the magic, then four little-endian u64 (key length,
// payload length, compile time in ns, checksum), then the key, then the
// payload. A new layout gets a new magic: old entries are then misses.
constexpr char kMagic[8] = {'T', 'P', 'U', 'D', 'X', 'C', '1', '\n'};
constexpr size_t kHeaderBytes = sizeof(kMagic) + 4 * sizeof(uint64_t);
constexpr char kSuffix[] = ".xc";
constexpr char kTempPrefix[] = ".tmp-";
// A temporary file this old is left by a writer that died: removed.
constexpr time_t kStaleTempSeconds = 600;

uint64_t Mix(uint64_t h) {
  h ^= h >> 33;
  h *= 0xff51afd7ed558ccdULL;
  h ^= h >> 33;
  h *= 0xc4ceb9fe1a85ec53ULL;
  h ^= h >> 33;
  return h;
}

uint64_t Rotl(uint64_t x, int r) { return (x << r) | (x >> (64 - r)); }

void PutU64(char* p, uint64_t v) {
  for (int i = 0; i < 8; ++i) p[i] = static_cast<char>(v >> (8 * i));
}
uint64_t GetU64(const char* p) {
  uint64_t v = 0;
  for (int i = 0; i < 8; ++i)
    v |= static_cast<uint64_t>(static_cast<unsigned char>(p[i])) << (8 * i);
  return v;
}

uint64_t Checksum(absl::string_view key, absl::string_view payload) {
  return StableHash64(payload, StableHash64(key, 1));
}

std::string ErrnoText(int err) { return std::strerror(err); }

bool WriteAll(int fd, const char* p, size_t n) {
  while (n > 0) {
    const ssize_t w = ::write(fd, p, n);
    if (w < 0) {
      if (errno == EINTR) continue;
      return false;
    }
    p += w;
    n -= static_cast<size_t>(w);
  }
  return true;
}

bool ReadAll(int fd, char* p, size_t n) {
  while (n > 0) {
    const ssize_t r = ::read(fd, p, n);
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) return false;
    p += r;
    n -= static_cast<size_t>(r);
  }
  return true;
}

// mkdir -p, each new component with mode 0700.
absl::Status MakeDirs(const std::string& dir) {
  std::string path;
  for (size_t i = 0; i <= dir.size(); ++i) {
    if (i == dir.size() || (dir[i] == '/' && i > 0)) {
      path = dir.substr(0, i);
      if (::mkdir(path.c_str(), 0700) != 0 && errno != EEXIST) {
        return absl::FailedPreconditionError(
            absl::StrCat("cannot create ", path, ": ", ErrnoText(errno)));
      }
    }
  }
  return absl::OkStatus();
}

}  // namespace

uint64_t StableHash64(absl::string_view data, uint64_t seed) {
  constexpr uint64_t k1 = 0x87c37b91114253d5ULL;
  constexpr uint64_t k2 = 0x4cf5ad432745937fULL;
  uint64_t h = seed ^ (data.size() * k1);
  const char* p = data.data();
  size_t n = data.size();
  for (; n >= 8; p += 8, n -= 8) {
    uint64_t w;
    std::memcpy(&w, p, 8);
    w = Rotl(w * k1, 31) * k2;
    h = Rotl(h ^ w, 27) * 5 + 0x52dce729;
  }
  uint64_t tail = 0;
  for (size_t i = 0; i < n; ++i)
    tail |= static_cast<uint64_t>(static_cast<unsigned char>(p[i])) << (8 * i);
  h ^= Rotl(tail * k2, 33) * k1;
  return Mix(h);
}

absl::StatusOr<std::unique_ptr<DiskCompileCache>> DiskCompileCache::Open(
    const std::string& dir, uint64_t max_bytes) {
  if (dir.empty())
    return absl::InvalidArgumentError("the compile cache needs a directory");
  if (absl::Status st = MakeDirs(dir); !st.ok()) return st;
  struct stat sb;
  if (::stat(dir.c_str(), &sb) != 0) {
    return absl::FailedPreconditionError(
        absl::StrCat("cannot use ", dir, ": ", ErrnoText(errno)));
  }
  if (!S_ISDIR(sb.st_mode))
    return absl::FailedPreconditionError(
        absl::StrCat(dir, " is not a directory"));
  // Its entries are code the plugin loads into tpud: no one else may put
  // them there.
  if (sb.st_uid != ::geteuid()) {
    return absl::FailedPreconditionError(absl::StrFormat(
        "%s belongs to uid %d, not to tpud's (%d): its entries would be "
        "loaded as code; give tpud a directory of its own",
        dir, sb.st_uid, ::geteuid()));
  }
  if ((sb.st_mode & 022) != 0) {
    return absl::FailedPreconditionError(absl::StrFormat(
        "%s may be written by others (mode %04o): its entries would be "
        "loaded as code; chmod go-w it or give tpud a directory of its own",
        dir, sb.st_mode & 07777));
  }
  std::unique_ptr<DiskCompileCache> cache(new DiskCompileCache(dir, max_bytes));
  cache->Scan(0, /*evict=*/true);  // a lowered bound holds from the start
  return cache;
}

std::string DiskCompileCache::PathOf(absl::string_view key) const {
  return absl::StrFormat("%s/%016x%016x%s", dir_, StableHash64(key),
                         StableHash64(key, 0x9e3779b97f4a7c15ULL), kSuffix);
}

void DiskCompileCache::Reject(const std::string& path) {
  ++rejected_;
  struct stat sb;
  if (::lstat(path.c_str(), &sb) == 0 && ::unlink(path.c_str()) == 0 &&
      S_ISREG(sb.st_mode)) {
    if (entries_ > 0) --entries_;
    bytes_ -= std::min<uint64_t>(bytes_, static_cast<uint64_t>(sb.st_size));
  }
}

std::optional<DiskCompileCache::Entry> DiskCompileCache::Load(
    absl::string_view key) {
  const std::string path = PathOf(key);
  const int fd = ::open(path.c_str(), O_RDONLY | O_NOFOLLOW | O_CLOEXEC);
  if (fd < 0) {
    if (errno == ELOOP) Reject(path);  // a link: never followed
    return std::nullopt;
  }
  struct stat sb;
  std::string data;
  bool whole = ::fstat(fd, &sb) == 0 && S_ISREG(sb.st_mode) &&
               sb.st_uid == ::geteuid() &&
               static_cast<uint64_t>(sb.st_size) >= kHeaderBytes &&
               static_cast<uint64_t>(sb.st_size) <= max_bytes_;
  if (whole) {
    data.resize(static_cast<size_t>(sb.st_size));
    whole = ReadAll(fd, data.data(), data.size());
  }
  if (whole) {
    // Renew its place in the eviction order.
    (void)::futimens(fd, nullptr);
  }
  ::close(fd);
  if (!whole) {
    Reject(path);
    return std::nullopt;
  }
  const char* h = data.data() + sizeof(kMagic);
  const uint64_t key_len = GetU64(h), payload_len = GetU64(h + 8);
  Entry entry;
  entry.compile_ns = GetU64(h + 16);
  const uint64_t checksum = GetU64(h + 24);
  const bool sized = key_len <= data.size() && payload_len <= data.size() &&
                     kHeaderBytes + key_len + payload_len == data.size();
  const absl::string_view stored_key =
      sized ? absl::string_view(data).substr(kHeaderBytes, key_len)
            : absl::string_view();
  const absl::string_view payload =
      sized ? absl::string_view(data).substr(kHeaderBytes + key_len)
            : absl::string_view();
  if (std::memcmp(data.data(), kMagic, sizeof(kMagic)) != 0 || !sized ||
      Checksum(stored_key, payload) != checksum) {
    Reject(path);  // torn or corrupt
    return std::nullopt;
  }
  if (stored_key != key) {
    // Another plugin build's entry, or a hash collision: this key's program
    // is compiled and takes the file over.
    Reject(path);
    return std::nullopt;
  }
  entry.payload = std::string(payload);
  return entry;
}

absl::Status DiskCompileCache::Store(absl::string_view key,
                                     absl::string_view payload,
                                     uint64_t compile_ns) {
  const uint64_t size = kHeaderBytes + key.size() + payload.size();
  if (size > max_bytes_) {
    return absl::ResourceExhaustedError(absl::StrFormat(
        "a program of %d bytes does not fit the compile cache's bound of %d",
        size, max_bytes_));
  }
  if (bytes_ + size > max_bytes_) Scan(size, /*evict=*/true);
  const std::string path = PathOf(key);
  const std::string temp =
      absl::StrCat(dir_, "/", kTempPrefix, ::getpid(), "-", temp_counter_++);
  std::string header(kHeaderBytes, '\0');
  std::memcpy(header.data(), kMagic, sizeof(kMagic));
  PutU64(header.data() + sizeof(kMagic), key.size());
  PutU64(header.data() + sizeof(kMagic) + 8, payload.size());
  PutU64(header.data() + sizeof(kMagic) + 16, compile_ns);
  PutU64(header.data() + sizeof(kMagic) + 24, Checksum(key, payload));
  const int fd = ::open(
      temp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600);
  int err = fd < 0 ? errno : 0;
  if (fd >= 0) {
    if (!WriteAll(fd, header.data(), header.size()) ||
        !WriteAll(fd, key.data(), key.size()) ||
        !WriteAll(fd, payload.data(), payload.size()) || ::fsync(fd) != 0) {
      err = errno;
    }
    if (::close(fd) != 0 && err == 0) err = errno;
  }
  struct stat old;
  const bool replaces = err == 0 && ::lstat(path.c_str(), &old) == 0;
  if (err == 0 && ::rename(temp.c_str(), path.c_str()) != 0) err = errno;
  if (err != 0) {
    ::unlink(temp.c_str());
    ++write_errors_;
    return absl::ResourceExhaustedError(absl::StrCat(
        "cannot write to the compile cache ", dir_, ": ", ErrnoText(err)));
  }
  if (replaces && S_ISREG(old.st_mode)) {
    bytes_ -= std::min<uint64_t>(bytes_, static_cast<uint64_t>(old.st_size));
  } else {
    ++entries_;
  }
  bytes_ += size;
  return absl::OkStatus();
}

void DiskCompileCache::Remove(absl::string_view key) { Reject(PathOf(key)); }

bool DiskCompileCache::WouldEvict(uint64_t bytes) const {
  return bytes_ + kHeaderBytes + bytes > max_bytes_;
}

void DiskCompileCache::Renew(const std::string& path) {
  (void)::utimensat(AT_FDCWD, path.c_str(), nullptr, AT_SYMLINK_NOFOLLOW);
}

void DiskCompileCache::Scan(uint64_t incoming, bool evict) {
  DIR* d = ::opendir(dir_.c_str());
  if (d == nullptr) return;
  // (modification time, size, name) of each entry.
  std::vector<std::tuple<struct timespec, uint64_t, std::string>> found;
  const time_t now = ::time(nullptr);
  uint64_t total = 0;
  while (const struct dirent* e = ::readdir(d)) {
    const std::string name = e->d_name;
    const bool temp = absl::StartsWith(name, kTempPrefix);
    if (!temp && !absl::EndsWith(name, kSuffix)) continue;
    const std::string path = absl::StrCat(dir_, "/", name);
    struct stat sb;
    if (::lstat(path.c_str(), &sb) != 0 || !S_ISREG(sb.st_mode)) continue;
    if (temp) {
      if (now - sb.st_mtime > kStaleTempSeconds) ::unlink(path.c_str());
      continue;
    }
    total += static_cast<uint64_t>(sb.st_size);
    found.emplace_back(sb.st_mtim, static_cast<uint64_t>(sb.st_size), name);
  }
  ::closedir(d);
  if (evict && total + incoming > max_bytes_) {
    const uint64_t target = max_bytes_ - max_bytes_ / 10;
    std::sort(found.begin(), found.end(), [](const auto& a, const auto& b) {
      const struct timespec &x = std::get<0>(a), &y = std::get<0>(b);
      return std::tie(x.tv_sec, x.tv_nsec) < std::tie(y.tv_sec, y.tv_nsec);
    });
    size_t gone = 0;
    for (; gone < found.size() && total + incoming > target; ++gone) {
      const std::string path =
          absl::StrCat(dir_, "/", std::get<2>(found[gone]));
      // One another process removed first is gone all the same.
      ::unlink(path.c_str());
      total -= std::get<1>(found[gone]);
    }
    found.erase(found.begin(), found.begin() + gone);
  }
  entries_ = found.size();
  bytes_ = total;
}

}  // namespace tpud::pjrt
