#include "daemon/core/allocation_state.h"

#include <sys/stat.h>
#include <unistd.h>

#include <cstdlib>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "catch2_compat/catch.h"
#include "daemon/core/runtime_core.h"
#include "daemon/topology/topology.h"
#include "proto/protocol.h"

namespace tpud {
namespace {

constexpr uint64_t kMiB = uint64_t{1} << 20;

bool Contains(const std::string& haystack, const std::string& needle) {
  return haystack.find(needle) != std::string::npos;
}

std::unique_ptr<RuntimeCore> MakeCore(const std::string& preset = "v6e-4") {
  absl::StatusOr<Topology> topology = Topology::FromPreset(preset, 64 * kMiB);
  REQUIRE(topology.ok());
  RuntimeCore::Options options;
  options.back_with_memory = false;
  absl::StatusOr<std::unique_ptr<RuntimeCore>> core =
      RuntimeCore::Create(*std::move(topology), options);
  REQUIRE(core.ok());
  return *std::move(core);
}

AllocationState Sample() {
  AllocationState s;
  s.topology = "v6e-4";
  s.num_chips = 4;
  s.next_id = 9;
  AllocationRecord a;
  a.id = 3;
  a.token = "00112233445566778899aabbccddeeff";
  a.name = "tpud.io/chip-share: chip-1-share-0 chip-1-share-1 ünïcode %";
  a.chips = {1};
  a.quota_bytes = {32 * kMiB};
  a.created = absl::FromUnixMicros(1733450000123456);
  s.allocations.push_back(a);
  a.id = 7;
  a.token = "ffeeddccbbaa99887766554433221100";
  a.name = "";
  a.chips = {2, 0};
  a.quota_bytes = {0, 64 * kMiB};
  s.allocations.push_back(a);
  return s;
}

// `text` with its last line made again for its other lines (count and
// checksum), as if tpud had written them: to test what the parser does with
// contents that pass the checksum.
std::string Reseal(const std::string& text) {
  const std::string body =
      text.substr(0, text.rfind('\n', text.size() - 2) + 1);
  uint64_t h = 14695981039346656037ull;
  for (unsigned char c : body) {
    h ^= c;
    h *= 1099511628211ull;
  }
  size_t count = 0;
  for (size_t at = body.find("\nallocation "); at != std::string::npos;
       at = body.find("\nallocation ", at + 1)) {
    ++count;
  }
  char end[64];
  std::snprintf(end, sizeof(end), "end %zu %016llx\n", count,
                static_cast<unsigned long long>(h));
  return body + end;
}

std::string DecodeError(const std::string& text,
                        const std::string& topology = "v6e-4", int chips = 4) {
  absl::StatusOr<AllocationState> s =
      DecodeAllocationState(text, "/state", topology, chips);
  REQUIRE_FALSE(s.ok());
  CHECK(s.status().code() == absl::StatusCode::kFailedPrecondition);
  return std::string(s.status().message());
}

TEST_CASE("a state survives encoding and decoding exactly") {
  const AllocationState in = Sample();
  absl::StatusOr<AllocationState> out =
      DecodeAllocationState(EncodeAllocationState(in), "/state", "v6e-4", 4);
  INFO(out.status().ToString());
  REQUIRE(out.ok());
  CHECK(out->next_id == 9);
  REQUIRE(out->allocations.size() == 2);
  for (size_t i = 0; i < 2; ++i) {
    const AllocationRecord& a = in.allocations[i];
    const AllocationRecord& b = out->allocations[i];
    CHECK(a.id == b.id);
    CHECK(a.token == b.token);
    CHECK(a.name == b.name);
    CHECK(a.chips == b.chips);
    CHECK(a.quota_bytes == b.quota_bytes);
    CHECK(a.created == b.created);
  }
}

TEST_CASE("a damaged, cut or foreign file is refused, naming what is wrong") {
  const std::string good = EncodeAllocationState(Sample());
  CHECK(Contains(DecodeError("{\"allocations\": []}\n"),
                 "not a tpud allocation state file"));
  CHECK(Contains(DecodeError(""), "not a tpud allocation state file"));
  // Every cut short of the whole file is refused.
  for (size_t n = 1; n < good.size(); ++n) {
    INFO(n);
    DecodeError(good.substr(0, n));
  }
  // Any one byte changed is refused (the checksum, or the parse).
  for (size_t i = 0; i < good.size(); ++i) {
    std::string bad = good;
    bad[i] = bad[i] == 'x' ? 'y' : 'x';
    INFO(i);
    DecodeError(bad);
  }
  std::string flipped = good;
  flipped[good.find("allocation 3") + 11] = '4';
  CHECK(Contains(DecodeError(flipped), "checksum does not match"));
  // Another host's file.
  CHECK(Contains(DecodeError(good, "v6e-8", 8),
                 "written for a v6e-4 host with 4 chips; this tpud serves a "
                 "v6e-8 host with 8 chips"));
  // Resealing alone gives back the same file.
  CHECK(Reseal(good) == good);
  // A newer format, or a header that only begins like ours.
  const std::string v2 = Reseal(absl::StrReplaceAll(
      good, {{"tpud-allocation-state 1", "tpud-allocation-state 2"}}));
  CHECK(
      Contains(DecodeError(v2),
               "/state: line 1: format version 2 (this tpud reads version 1)"));
  const std::string other = Reseal(absl::StrReplaceAll(
      good, {{"tpud-allocation-state 1", "tpud-allocation-states 1"}}));
  CHECK(Contains(DecodeError(other), "line 1: a bad header"));
  // Lines that pass the checksum but not the parser.
  const std::string dropped =
      Reseal(absl::StrReplaceAll(good, {{"next_id 9\n", ""}}));
  CHECK(Contains(DecodeError(dropped), "line 3: expected \"next_id <id>\""));
  const std::string short_line =
      Reseal(absl::StrReplaceAll(good, {{" 1=33554432 ", " "}}));
  CHECK(Contains(DecodeError(short_line), "line 4: expected \"allocation"));
}

TEST_CASE("a well-formed file with impossible contents is refused") {
  AllocationState s = Sample();
  s.allocations[1].chips = {2, 2};
  CHECK(Contains(DecodeError(EncodeAllocationState(s)), "listed twice"));
  s = Sample();
  s.allocations[1].chips = {2, 4};
  CHECK(Contains(DecodeError(EncodeAllocationState(s)),
                 "chip 4 is not on this host"));
  s = Sample();
  s.allocations[1].token = s.allocations[0].token;
  CHECK(Contains(DecodeError(EncodeAllocationState(s)), "token appears twice"));
  s = Sample();
  s.next_id = 5;
  CHECK(Contains(DecodeError(EncodeAllocationState(s)), "not below next_id"));
}

TEST_CASE("written atomically, readable back, private to its owner") {
  char dir_template[] = "/tmp/allocstate.XXXXXX";
  REQUIRE(mkdtemp(dir_template) != nullptr);
  const std::string path = absl::StrCat(dir_template, "/allocations.state");
  absl::StatusOr<std::optional<std::string>> none = ReadStateFile(path);
  REQUIRE(none.ok());
  CHECK_FALSE(none->has_value());
  const std::string text = EncodeAllocationState(Sample());
  REQUIRE(WriteStateFileAtomically(path, text).ok());
  REQUIRE(WriteStateFileAtomically(path, text).ok());
  absl::StatusOr<std::optional<std::string>> back = ReadStateFile(path);
  REQUIRE(back.ok());
  CHECK(**back == text);
  struct stat st;
  REQUIRE(stat(path.c_str(), &st) == 0);
  CHECK((st.st_mode & 0777) == 0600);
  // Nothing is left beside it.
  CHECK(access(absl::StrCat(path, ".tmp.", getpid()).c_str(), F_OK) != 0);
  // Missing directories are made, private.
  const std::string deep = absl::StrCat(dir_template, "/a/b/allocations.state");
  REQUIRE(WriteStateFileAtomically(deep, text).ok());
  REQUIRE(stat(absl::StrCat(dir_template, "/a/b").c_str(), &st) == 0);
  CHECK((st.st_mode & 0777) == 0700);
  // A directory that cannot be made is a clear error.
  const std::string blocked = absl::StrCat(path, "/x/allocations.state");
  absl::Status missing = WriteStateFileAtomically(blocked, text);
  CHECK(missing.code() == absl::StatusCode::kUnavailable);
  CHECK(Contains(std::string(missing.message()),
                 absl::StrCat("cannot save ", blocked, ": mkdir")));
  unlink(deep.c_str());
  rmdir(absl::StrCat(dir_template, "/a/b").c_str());
  rmdir(absl::StrCat(dir_template, "/a").c_str());
  unlink(path.c_str());
  rmdir(dir_template);
}

TEST_CASE("a restored core honours the tokens it saved, and nothing else") {
  std::unique_ptr<RuntimeCore> first = MakeCore();
  AllocationState saved;
  int saves = 0;
  REQUIRE(first
              ->SetAllocationSaver([&](const AllocationState& s) {
                saved = s;
                ++saves;
                return absl::OkStatus();
              })
              .ok());
  CHECK(saves == 1);
  AllocationSpec spec;
  spec.chips = {1, 3};
  spec.chip_quota_bytes = {8 * kMiB, 16 * kMiB};
  spec.name = "pod-a";
  absl::StatusOr<CreatedAllocation> a = first->CreateAllocation(spec);
  REQUIRE(a.ok());
  spec.chips = {0};
  spec.chip_quota_bytes = {};
  spec.quota_bytes_per_chip = 4 * kMiB;
  spec.name = "pod-b";
  absl::StatusOr<CreatedAllocation> b = first->CreateAllocation(spec);
  REQUIRE(b.ok());
  spec.name = "pod-c";
  absl::StatusOr<CreatedAllocation> c = first->CreateAllocation(spec);
  REQUIRE(c.ok());
  REQUIRE(first->ReleaseAllocation(c->token).ok());
  CHECK(saves == 5);
  REQUIRE(saved.allocations.size() == 2);

  // Through the file format, into a new core (a restarted tpud).
  absl::StatusOr<AllocationState> loaded =
      DecodeAllocationState(EncodeAllocationState(saved), "/state", "v6e-4", 4);
  REQUIRE(loaded.ok());
  std::unique_ptr<RuntimeCore> second = MakeCore();
  REQUIRE(second->RestoreAllocations(*loaded).ok());
  std::vector<AllocationSnapshot> list = second->Allocations();
  REQUIRE(list.size() == 2);
  CHECK(list[0].id == a->id);
  CHECK(list[0].chips == std::vector<int>{1, 3});
  CHECK(list[0].quota_bytes == std::vector<uint64_t>{8 * kMiB, 16 * kMiB});
  CHECK(list[1].name == "pod-b");

  PeerIdentity peer;
  peer.pid = 1;
  absl::StatusOr<OpenedSession> s = second->OpenSession(
      1, peer, kMinProtocolVersion, kMaxProtocolVersion, "job", a->token);
  INFO(s.status().ToString());
  REQUIRE(s.ok());
  CHECK(s->allowed_chips == std::vector<int>{1, 3});
  CHECK(s->quota_bytes_per_chip == 16 * kMiB);
  // The released allocation's token stays refused.
  CHECK(second
            ->OpenSession(2, peer, kMinProtocolVersion, kMaxProtocolVersion,
                          "job", c->token)
            .status()
            .code() == absl::StatusCode::kPermissionDenied);
  // New ids follow the saved ones.
  absl::StatusOr<CreatedAllocation> d = second->CreateAllocation(spec);
  REQUIRE(d.ok());
  CHECK(d->id > c->id);
  // Restoring twice is refused; the core keeps what it has.
  CHECK(second->RestoreAllocations(*loaded).code() ==
        absl::StatusCode::kFailedPrecondition);
  CHECK(second->Allocations().size() == 3);
}

TEST_CASE("a restore is all or nothing") {
  AllocationState s = Sample();
  s.allocations[1].chips = {1, 9};  // not on a v6e-4 host
  std::unique_ptr<RuntimeCore> core = MakeCore();
  CHECK(core->RestoreAllocations(s).code() ==
        absl::StatusCode::kInvalidArgument);
  CHECK(core->Allocations().empty());
  CHECK(core->RestoreAllocations(Sample()).ok());
  CHECK(core->Allocations().size() == 2);
}

TEST_CASE("a change that cannot be saved is undone") {
  std::unique_ptr<RuntimeCore> core = MakeCore();
  bool fail = false;
  REQUIRE(core->SetAllocationSaver([&](const AllocationState&) {
                return fail ? absl::UnavailableError("disk full")
                            : absl::OkStatus();
              })
              .ok());
  AllocationSpec spec;
  spec.chips = {0};
  absl::StatusOr<CreatedAllocation> kept = core->CreateAllocation(spec);
  REQUIRE(kept.ok());
  fail = true;
  absl::StatusOr<CreatedAllocation> lost = core->CreateAllocation(spec);
  REQUIRE_FALSE(lost.ok());
  CHECK(Contains(std::string(lost.status().message()),
                 "the allocation was not made: disk full"));
  CHECK(core->Allocations().size() == 1);
  absl::Status release = core->ReleaseAllocation(kept->token);
  CHECK(release.code() == absl::StatusCode::kUnavailable);
  CHECK(core->Allocations().size() == 1);
  fail = false;
  CHECK(core->ReleaseAllocation(kept->token).ok());
  CHECK(core->Allocations().empty());
  // By id, as by token; an unknown id is NOT_FOUND naming it.
  absl::StatusOr<CreatedAllocation> by_id = core->CreateAllocation(spec);
  REQUIRE(by_id.ok());
  CHECK(core->ReleaseAllocationById(by_id->id + 100).code() ==
        absl::StatusCode::kNotFound);
  REQUIRE(core->ReleaseAllocationById(by_id->id).ok());
  CHECK(core->Allocations().empty());
  // A saver that cannot save at all is refused when it is set.
  CHECK_FALSE(core->SetAllocationSaver([](const AllocationState&) {
                    return absl::UnavailableError("read-only");
                  })
                  .ok());
}

}  // namespace
}  // namespace tpud
