#include "daemon/core/allocation_state.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <set>
#include <sstream>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"

namespace tpud {
namespace {

constexpr absl::string_view kMagic = "tpud-allocation-state";
constexpr int kVersion = 1;

uint64_t Fnv1a64(absl::string_view bytes) {
  uint64_t h = 14695981039346656037ull;
  for (unsigned char c : bytes) {
    h ^= c;
    h *= 1099511628211ull;
  }
  return h;
}

bool PlainNameChar(char c) {
  return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') ||
         (c >= '0' && c <= '9') || c == '-' || c == '_' || c == '.' ||
         c == ',' || c == '/' || c == ':';
}

std::string EncodeName(absl::string_view name) {
  if (name.empty()) return "%";  // a field is never empty
  std::string out;
  for (char c : name) {
    if (PlainNameChar(c)) {
      out.push_back(c);
    } else {
      absl::StrAppendFormat(&out, "%%%02X", static_cast<unsigned char>(c));
    }
  }
  return out;
}

bool DecodeName(absl::string_view in, std::string* out) {
  out->clear();
  if (in == "%") return true;
  for (size_t i = 0; i < in.size(); ++i) {
    if (in[i] != '%') {
      if (!PlainNameChar(in[i])) return false;
      out->push_back(in[i]);
      continue;
    }
    int v = 0;
    if (i + 2 >= in.size()) return false;
    for (int k = 1; k <= 2; ++k) {
      const char c = in[i + k];
      v <<= 4;
      if (c >= '0' && c <= '9') {
        v |= c - '0';
      } else if (c >= 'A' && c <= 'F') {
        v |= c - 'A' + 10;
      } else {
        return false;
      }
    }
    out->push_back(static_cast<char>(v));
    i += 2;
  }
  return true;
}

bool IsHexToken(absl::string_view s) {
  if (s.size() < 16) return false;
  for (char c : s) {
    if (!((c >= '0' && c <= '9') || (c >= 'a' && c <= 'f'))) return false;
  }
  return true;
}

std::string ErrnoText() { return std::strerror(errno); }

}  // namespace

std::string EncodeAllocationState(const AllocationState& state) {
  std::string out =
      absl::StrCat(kMagic, " ", kVersion, "\n", "host ", state.topology, " ",
                   state.num_chips, "\n", "next_id ", state.next_id, "\n");
  for (const AllocationRecord& a : state.allocations) {
    std::vector<std::string> chips;
    for (size_t i = 0; i < a.chips.size(); ++i) {
      chips.push_back(absl::StrCat(a.chips[i], "=", a.quota_bytes[i]));
    }
    absl::StrAppend(&out, "allocation ", a.id, " ",
                    absl::ToUnixMicros(a.created), " ", a.token, " ",
                    absl::StrJoin(chips, ","), " ", EncodeName(a.name), "\n");
  }
  absl::StrAppendFormat(&out, "end %d %016x\n", state.allocations.size(),
                        Fnv1a64(out));
  return out;
}

absl::StatusOr<AllocationState> DecodeAllocationState(
    absl::string_view text, absl::string_view path, absl::string_view topology,
    int num_chips) {
  auto bad = [&](absl::string_view what) {
    return absl::FailedPreconditionError(absl::StrCat(path, ": ", what));
  };
  if (!absl::StartsWith(text, kMagic)) {
    return bad(
        absl::StrCat("not a tpud allocation state file (it does not "
                     "begin with \"",
                     kMagic, "\")"));
  }
  // The last line: "end <count> <checksum>" over every byte before it.
  if (text.empty() || text.back() != '\n') {
    return bad("the file is cut short (no final line)");
  }
  const size_t end_at = text.rfind('\n', text.size() - 2);
  if (end_at == absl::string_view::npos) return bad("the file is cut short");
  const absl::string_view body = text.substr(0, end_at + 1);
  const absl::string_view end_line =
      text.substr(end_at + 1, text.size() - end_at - 2);
  std::vector<absl::string_view> end = absl::StrSplit(end_line, ' ');
  size_t count = 0;
  if (end.size() != 3 || end[0] != "end" || !absl::SimpleAtoi(end[1], &count)) {
    return bad("the file is cut short (its last line is not \"end\")");
  }
  if (end[2] != absl::StrFormat("%016x", Fnv1a64(body))) {
    return bad("the file is damaged (its checksum does not match)");
  }

  AllocationState state;
  std::set<uint64_t> ids;
  std::set<std::string> tokens;
  int line_no = 0;
  for (absl::string_view line : absl::StrSplit(body, '\n', absl::SkipEmpty())) {
    ++line_no;
    std::vector<absl::string_view> f = absl::StrSplit(line, ' ');
    auto at = [&](absl::string_view what) {
      return bad(absl::StrCat("line ", line_no, ": ", what));
    };
    if (line_no == 1) {
      int version = 0;
      if (f.size() != 2 || f[0] != kMagic ||
          !absl::SimpleAtoi(f[1], &version)) {
        return at("a bad header");
      }
      if (version != kVersion) {
        return at(absl::StrCat("format version ", version,
                               " (this tpud reads version ", kVersion, ")"));
      }
    } else if (line_no == 2) {
      if (f.size() != 3 || f[0] != "host" ||
          !absl::SimpleAtoi(f[2], &state.num_chips)) {
        return at("expected \"host <topology> <chips>\"");
      }
      state.topology = std::string(f[1]);
      if (state.topology != topology || state.num_chips != num_chips) {
        return bad(absl::StrCat("written for a ", state.topology, " host with ",
                                state.num_chips, " chips; this tpud serves a ",
                                topology, " host with ", num_chips, " chips"));
      }
    } else if (line_no == 3) {
      if (f.size() != 2 || f[0] != "next_id" ||
          !absl::SimpleAtoi(f[1], &state.next_id) || state.next_id == 0) {
        return at("expected \"next_id <id>\"");
      }
    } else {
      AllocationRecord a;
      int64_t created_us = 0;
      if (f.size() != 6 || f[0] != "allocation" ||
          !absl::SimpleAtoi(f[1], &a.id) ||
          !absl::SimpleAtoi(f[2], &created_us)) {
        return at(
            "expected \"allocation <id> <created> <token> <chips> "
            "<name>\"");
      }
      a.created = absl::FromUnixMicros(created_us);
      if (!IsHexToken(f[3])) return at("a malformed token");
      a.token = std::string(f[3]);
      std::set<int> seen;
      for (absl::string_view c : absl::StrSplit(f[4], ',')) {
        std::pair<absl::string_view, absl::string_view> kv =
            absl::StrSplit(c, absl::MaxSplits('=', 1));
        int chip = -1;
        uint64_t quota = 0;
        if (!absl::SimpleAtoi(kv.first, &chip) ||
            !absl::SimpleAtoi(kv.second, &quota)) {
          return at(absl::StrCat("a malformed chip \"", c, "\""));
        }
        if (chip < 0 || chip >= num_chips) {
          return at(absl::StrCat("chip ", chip, " is not on this host"));
        }
        if (!seen.insert(chip).second) {
          return at(absl::StrCat("chip ", chip, " is listed twice"));
        }
        a.chips.push_back(chip);
        a.quota_bytes.push_back(quota);
      }
      if (!DecodeName(f[5], &a.name)) return at("a malformed name");
      if (a.id == 0 || a.id >= state.next_id) {
        return at(absl::StrCat("allocation id ", a.id, " is not below next_id ",
                               state.next_id));
      }
      if (!ids.insert(a.id).second) {
        return at(absl::StrCat("allocation id ", a.id, " appears twice"));
      }
      if (!tokens.insert(a.token).second) {
        return at("a token appears twice");
      }
      state.allocations.push_back(std::move(a));
    }
  }
  if (line_no < 3) return bad("the file is cut short (no header)");
  if (state.allocations.size() != count) {
    return bad(absl::StrCat("the file lists ", state.allocations.size(),
                            " allocations; its last line says ", count));
  }
  return state;
}

absl::StatusOr<std::optional<std::string>> ReadStateFile(
    const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    if (errno == ENOENT) return std::optional<std::string>();
    return absl::FailedPreconditionError(
        absl::StrCat(path, ": cannot be read: ", ErrnoText()));
  }
  std::ostringstream buf;
  buf << in.rdbuf();
  if (in.bad()) {
    return absl::FailedPreconditionError(
        absl::StrCat(path, ": cannot be read: ", ErrnoText()));
  }
  return std::optional<std::string>(buf.str());
}

absl::Status WriteStateFileAtomically(const std::string& path,
                                      absl::string_view contents) {
  const size_t slash = path.rfind('/');
  const std::string dir =
      slash == std::string::npos ? "." : path.substr(0, slash);
  const std::string tmp = absl::StrCat(path, ".tmp.", getpid());
  auto fail = [&](absl::string_view what) {
    const std::string why = ErrnoText();
    unlink(tmp.c_str());
    return absl::UnavailableError(
        absl::StrCat("cannot save ", path, ": ", what, ": ", why));
  };
  // The directory, and any missing above it, private to tpud (0700).
  for (size_t at = dir.find('/', 1); !dir.empty(); at = dir.find('/', at + 1)) {
    const std::string part = dir.substr(0, at);
    if (mkdir(part.c_str(), 0700) != 0 && errno != EEXIST) return fail("mkdir");
    if (at == std::string::npos) break;
  }
  const int fd =
      open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
  if (fd < 0) return fail("open");
  for (size_t done = 0; done < contents.size();) {
    const ssize_t n = write(fd, contents.data() + done, contents.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      close(fd);
      return fail("write");
    }
    done += static_cast<size_t>(n);
  }
  if (fsync(fd) != 0) {
    close(fd);
    return fail("fsync");
  }
  if (close(fd) != 0) return fail("close");
  if (rename(tmp.c_str(), path.c_str()) != 0) return fail("rename");
  const int dfd = open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dfd >= 0) {
    fsync(dfd);
    close(dfd);
  }
  return absl::OkStatus();
}

}  // namespace tpud
