#include "daemon/backends/pjrt/compile_cache.h"

#include <fcntl.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include <csignal>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <string>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "catch2_compat/catch.h"

namespace tpud::pjrt {
namespace {

std::string TempDir() {
  const char* base = std::getenv("TEST_TMPDIR");
  std::string tmpl =
      absl::StrCat(base != nullptr ? base : "/tmp", "/compile_cache_XXXXXX");
  REQUIRE(::mkdtemp(tmpl.data()) != nullptr);
  return tmpl;
}

// The one entry file in `dir` (the test stores one program before asking).
std::string OnlyEntry(const std::string& dir) {
  std::string found;
  int n = 0;
  std::string cmd = absl::StrCat("ls ", dir, " > ", dir, ".ls");
  REQUIRE(std::system(cmd.c_str()) == 0);
  std::ifstream ls(dir + ".ls");
  for (std::string line; std::getline(ls, line);) {
    if (absl::EndsWith(line, ".xc")) {
      found = absl::StrCat(dir, "/", line);
      ++n;
    }
  }
  REQUIRE(n == 1);
  return found;
}

std::string Read(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  std::stringstream s;
  s << f.rdbuf();
  return s.str();
}

void Write(const std::string& path, const std::string& data) {
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  f << data;
}

std::unique_ptr<DiskCompileCache> OpenCache(const std::string& dir,
                                            uint64_t max_bytes = 1 << 20) {
  absl::StatusOr<std::unique_ptr<DiskCompileCache>> c =
      DiskCompileCache::Open(dir, max_bytes);
  INFO(c.status().ToString());
  REQUIRE(c.ok());
  return *std::move(c);
}

TEST_CASE("the stable hash is the same on every run and spreads its input") {
  // Fixed values: a change here is a new on-disk layout (and a new magic).
  CHECK(StableHash64("") != StableHash64("", 1));
  CHECK(StableHash64("program a") != StableHash64("program b"));
  CHECK(StableHash64("program a") == StableHash64("program a"));
  CHECK(StableHash64(std::string(1000, 'x')) !=
        StableHash64(std::string(1001, 'x')));
}

TEST_CASE("an entry stored is loaded by a later cache on the directory") {
  const std::string dir = TempDir() + "/programs/nested";  // made, 0700
  {
    std::unique_ptr<DiskCompileCache> c = OpenCache(dir);
    CHECK(c->entries() == 0);
    CHECK(!c->Load("key a").has_value());
    REQUIRE(c->Store("key a", "payload of a", 1234).ok());
    REQUIRE(c->Store("key b", std::string(5000, 'b'), 99).ok());
    CHECK(c->entries() == 2);
    CHECK(c->bytes() > 5000);
  }
  struct stat sb;
  REQUIRE(::stat(dir.c_str(), &sb) == 0);
  CHECK((sb.st_mode & 0777) == 0700);
  std::unique_ptr<DiskCompileCache> c = OpenCache(dir);  // "after a restart"
  CHECK(c->entries() == 2);
  std::optional<DiskCompileCache::Entry> a = c->Load("key a");
  REQUIRE(a.has_value());
  CHECK(a->payload == "payload of a");
  CHECK(a->compile_ns == 1234);
  CHECK(c->Load("key b")->payload == std::string(5000, 'b'));
  CHECK(!c->Load("key c").has_value());
  CHECK(c->rejected() == 0);
  // Storing a key again replaces its entry.
  REQUIRE(c->Store("key a", "new", 1).ok());
  CHECK(c->entries() == 2);
  CHECK(c->Load("key a")->payload == "new");
}

TEST_CASE(
    "a torn, corrupt or foreign entry is a miss, removed and counted; the "
    "next store replaces it") {
  const std::string dir = TempDir();
  std::unique_ptr<DiskCompileCache> c = OpenCache(dir);
  const std::string payload(3000, 'p');
  REQUIRE(c->Store("key", payload, 5).ok());
  const std::string path = OnlyEntry(dir);
  const std::string whole = Read(path);

  SECTION("torn: cut short") {
    Write(path, whole.substr(0, whole.size() - 100));
  }
  SECTION("corrupt: one byte of the payload flipped") {
    std::string bad = whole;
    bad[bad.size() - 10] ^= 0x20;
    Write(path, bad);
  }
  SECTION("corrupt: a header length changed") {
    std::string bad = whole;
    bad[8 + 8] ^= 0x01;  // payload length
    Write(path, bad);
  }
  SECTION("empty") { Write(path, ""); }
  SECTION("foreign: another key's entry under this name") {
    // What a cache of another plugin build leaves: the same program, a
    // different key, and a valid entry of its own.
    const std::string other = TempDir();
    std::unique_ptr<DiskCompileCache> o = OpenCache(other);
    REQUIRE(o->Store("another plugin build\nkey", payload, 5).ok());
    Write(path, Read(OnlyEntry(other)));
  }
  SECTION("a link, which is never followed") {
    const std::string target = dir + ".target";
    Write(target, whole);
    REQUIRE(::unlink(path.c_str()) == 0);
    REQUIRE(::symlink(target.c_str(), path.c_str()) == 0);
  }
  CHECK(!c->Load("key").has_value());
  CHECK(c->rejected() == 1);
  CHECK(::access(path.c_str(), F_OK) != 0);  // removed
  REQUIRE(c->Store("key", payload, 5).ok());
  REQUIRE(c->Load("key").has_value());
  CHECK(c->Load("key")->payload == payload);
}

TEST_CASE(
    "past its bound the least recently used entries go; a hit or a renewal "
    "keeps one") {
  const std::string dir = TempDir();
  const std::string payload(1000, 'x');
  // Room for three entries of about 1.1 kB.
  std::unique_ptr<DiskCompileCache> c = OpenCache(dir, 3500);
  for (const char* key : {"k1", "k2", "k3"}) {
    REQUIRE(c->Store(key, payload, 1).ok());
    ::usleep(20000);  // distinct modification times
  }
  CHECK(c->entries() == 3);
  REQUIRE(c->Load("k1").has_value());  // k1 is now the most recent
  ::usleep(20000);
  REQUIRE(c->Store("k4", payload, 1).ok());
  // Eviction goes down to 90% of the bound (3150 bytes) with k4 in: the
  // least recently used, k2, went.
  CHECK(c->entries() == 3);
  CHECK(c->bytes() <= 3150);
  CHECK(!c->Load("k2").has_value());
  CHECK(c->Load("k3").has_value());
  CHECK(c->Load("k1").has_value());
  CHECK(c->Load("k4").has_value());
  CHECK(c->rejected() == 0);
  // A renewal counts as a use: k3 (loaded first above) is now the oldest,
  // unless renewed.
  ::usleep(20000);
  c->Renew(c->PathOf("k3"));
  ::usleep(20000);
  REQUIRE(c->Store("k5", payload, 1).ok());
  CHECK(c->Load("k3").has_value());
  CHECK(!c->Load("k1").has_value());
  // A program larger than the bound is not stored, and evicts nothing.
  const absl::Status big = c->Store("huge", std::string(4000, 'h'), 1);
  CHECK(big.code() == absl::StatusCode::kResourceExhausted);
  CHECK(c->entries() == 3);
  CHECK(c->write_errors() == 0);
  // A lower bound at the next start holds at once.
  c.reset();
  std::unique_ptr<DiskCompileCache> small = OpenCache(dir, 2500);
  CHECK(small->entries() == 2);
  CHECK(small->bytes() <= 2250);
}

TEST_CASE(
    "a write that fails (the disk full) is an error counted; nothing is "
    "left half-written and the cache goes on") {
  const std::string dir = TempDir();
  std::unique_ptr<DiskCompileCache> c = OpenCache(dir);
  REQUIRE(c->Store("small", "fits", 1).ok());
  // A file size limit fails writes past it with EFBIG, as a full disk fails
  // them with ENOSPC.
  struct rlimit old;
  REQUIRE(::getrlimit(RLIMIT_FSIZE, &old) == 0);
  ::signal(SIGXFSZ, SIG_IGN);
  struct rlimit limit = old;
  limit.rlim_cur = 2048;
  REQUIRE(::setrlimit(RLIMIT_FSIZE, &limit) == 0);
  const absl::Status st = c->Store("big", std::string(8192, 'b'), 1);
  REQUIRE(::setrlimit(RLIMIT_FSIZE, &old) == 0);
  CHECK(!st.ok());
  CHECK(absl::StrContains(st.message(), dir));
  CHECK(c->write_errors() == 1);
  CHECK(c->entries() == 1);
  CHECK(!c->Load("big").has_value());
  CHECK(c->Load("small")->payload == "fits");
  OnlyEntry(dir);  // no temporary file left beside it
  REQUIRE(c->Store("big", std::string(8192, 'b'), 1).ok());
}

TEST_CASE("a directory others may write, or not a directory, is refused") {
  const std::string dir = TempDir();
  REQUIRE(::chmod(dir.c_str(), 0777) == 0);
  absl::StatusOr<std::unique_ptr<DiskCompileCache>> open =
      DiskCompileCache::Open(dir, 1 << 20);
  REQUIRE(!open.ok());
  CHECK(open.status().code() == absl::StatusCode::kFailedPrecondition);
  CHECK(absl::StrContains(open.status().message(), "written by others"));
  REQUIRE(::chmod(dir.c_str(), 0755) == 0);
  CHECK(DiskCompileCache::Open(dir, 1 << 20).ok());
  const std::string file = dir + "/file";
  Write(file, "x");
  CHECK(DiskCompileCache::Open(file, 1 << 20).status().code() ==
        absl::StatusCode::kFailedPrecondition);
  CHECK(DiskCompileCache::Open("", 1 << 20).status().code() ==
        absl::StatusCode::kInvalidArgument);
}

TEST_CASE("a temporary file a dead writer left is removed once stale") {
  const std::string dir = TempDir();
  const std::string stale = dir + "/.tmp-1-0", fresh = dir + "/.tmp-2-0";
  Write(stale, "half");
  Write(fresh, "half");
  struct timespec old[2] = {{::time(nullptr) - 3600, 0},
                            {::time(nullptr) - 3600, 0}};
  REQUIRE(::utimensat(AT_FDCWD, stale.c_str(), old, 0) == 0);
  std::unique_ptr<DiskCompileCache> c = OpenCache(dir);
  CHECK(::access(stale.c_str(), F_OK) != 0);
  CHECK(::access(fresh.c_str(), F_OK) == 0);  // a live writer's, maybe
  CHECK(c->entries() == 0);
}

}  // namespace
}  // namespace tpud::pjrt
