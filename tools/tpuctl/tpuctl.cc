// tpuctl: administer tpud (think nvidia-smi plus MPS control).
//
//   tpuctl status | topology | sessions | executors | health      [--json]
//   tpuctl allocations [--json]
//   tpuctl release ALLOCATION        (its token is refused from now on)
//   tpuctl kill SESSION
//   tpuctl quota SESSION SIZE        (SIZE like 8GiB; "none" removes it)
//   tpuctl quota --default SIZE      (for sessions opened from now on)
//   tpuctl drain CHIP | undrain CHIP
//
// The --json schema is stable and documented in docs/tpuctl-json.md.
#include <pwd.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "tools/tpuctl/json_writer.h"
#include "tpu/client.h"
#include "tpu/paths.h"
#include "tpu/units.h"

ABSL_FLAG(bool, json, false,
          "print machine-readable JSON (see docs/tpuctl-json.md)");
ABSL_FLAG(std::string, socket, "",
          "tpud runtime socket (default $TPUD_SOCKET)");
ABSL_FLAG(
    std::string, admin_socket, "",
    "tpud admin socket (default $TPUD_ADMIN_SOCKET, or admin.sock beside the "
    "runtime socket given by --socket/$TPUD_SOCKET)");
ABSL_FLAG(bool, default, false, "quota: set the default for new sessions");
ABSL_FLAG(double, interval, 1.0, "top, watch: seconds between updates");
ABSL_FLAG(
    uint32_t, count, 0,
    "top, watch: stop after this many updates (0: run until interrupted)");

namespace tpuctl {
namespace {

// A text table whose columns are as wide as their widest cell, so that no
// value spills into its neighbour; numbers align right. The last column is
// not padded.
class Table {
 public:
  explicit Table(std::vector<std::string> header, std::string right = "")
      : right_(std::move(right)) {
    rows_.push_back(std::move(header));
  }
  void Row(std::vector<std::string> cells) {
    rows_.push_back(std::move(cells));
  }
  void Print() const {
    std::vector<size_t> width;
    for (const auto& r : rows_) {
      if (width.size() < r.size()) width.resize(r.size(), 0);
      for (size_t c = 0; c < r.size(); ++c)
        width[c] = std::max(width[c], r[c].size());
    }
    for (const auto& r : rows_) {
      std::string line;
      for (size_t c = 0; c < r.size(); ++c) {
        const bool last = c + 1 == r.size();
        const std::string pad(width[c] - r[c].size(), ' ');
        const bool right = c < right_.size() && right_[c] == 'r';
        line += right ? pad + r[c] : (last ? r[c] : r[c] + pad);
        if (!last) line += "  ";
      }
      std::printf("%s\n", line.c_str());
    }
  }

 private:
  std::vector<std::vector<std::string>> rows_;
  std::string right_;  // 'r' at a column's index: right-aligned
};

constexpr int kJsonSchemaVersion = 1;

std::string UserName(uint32_t uid) {
  struct passwd* pw = getpwuid(uid);
  return pw != nullptr ? pw->pw_name : absl::StrCat(uid);
}

std::string Duration(double seconds) {
  int64_t s = static_cast<int64_t>(seconds);
  if (s < 60) return absl::StrCat(s, "s");
  if (s < 3600) return absl::StrCat(s / 60, "m ", s % 60, "s");
  return absl::StrCat(s / 3600, "h ", (s % 3600) / 60, "m");
}

std::string AdminPath() {
  std::string path = absl::GetFlag(FLAGS_admin_socket);
  if (!path.empty()) return path;
  if (getenv("TPUD_ADMIN_SOCKET") != nullptr) return tpu::AdminSocketPath();
  // A runtime socket given explicitly implies its sibling admin socket.
  std::string runtime = absl::GetFlag(FLAGS_socket);
  if (runtime.empty() && getenv("TPUD_SOCKET") != nullptr)
    runtime = getenv("TPUD_SOCKET");
  if (!runtime.empty()) {
    size_t slash = runtime.rfind('/');
    return (slash == std::string::npos ? std::string(".")
                                       : runtime.substr(0, slash)) +
           "/admin.sock";
  }
  return tpu::AdminSocketPath();
}

int Error(const absl::Status& status) {
  std::fprintf(stderr, "tpuctl: %s\n", status.ToString().c_str());
  return 1;
}

void WriteTopology(JsonWriter& w, const tpu::TopologyInfo& t) {
  w.Key("topology").BeginObject();
  w.Key("name").String(t.name);
  w.Key("generation").String(t.generation.name);
  w.Key("shape").IntArray(t.shape);
  w.Key("wraparound").BeginArray();
  for (bool b : t.wraparound) w.Bool(b);
  w.EndArray();
  w.Key("simulated").Bool(t.simulated);
  w.Key("num_chips").Int(static_cast<int64_t>(t.chips.size()));
  w.Key("hbm_bytes_per_chip").Uint(t.generation.hbm_bytes_per_chip);
  w.Key("hbm_bandwidth_gbytes_per_s")
      .Double(t.generation.hbm_bandwidth_gbytes_per_s);
  w.Key("ici_bandwidth_gbytes_per_s")
      .Double(t.generation.ici_bandwidth_gbytes_per_s);
  w.Key("peak_bf16_tflops").Double(t.generation.peak_bf16_tflops);
  w.Key("tensorcores_per_chip").Int(t.generation.tensorcores_per_chip);
  w.EndObject();
}

void WriteChips(JsonWriter& w, const tpu::TopologyInfo& t) {
  w.Key("chips").BeginArray();
  for (const tpu::ChipInfo& c : t.chips) {
    w.BeginObject();
    w.Key("id").Int(c.id);
    w.Key("coords").IntArray(c.coords);
    w.Key("neighbors").IntArray(c.neighbors);
    w.Key("hbm_total_bytes").Uint(c.hbm_total_bytes);
    w.Key("hbm_used_bytes").Uint(c.hbm_used_bytes);
    w.Key("hbm_peak_bytes").Uint(c.hbm_peak_bytes);
    w.Key("hbm_largest_free_block").Uint(c.hbm_largest_free_block);
    w.Key("segment_count").Uint(c.segment_count);
    w.Key("session_count").Int(c.session_count);
    w.Key("healthy").Bool(c.healthy);
    w.Key("drained").Bool(c.drained);
    w.Key("duty_cycle").Double(c.duty_cycle);
    w.Key("busy_seconds").Double(c.busy_seconds);
    w.Key("ops_executed").Uint(c.ops_executed);
    w.EndObject();
  }
  w.EndArray();
}

void WriteLinks(JsonWriter& w, const tpu::TopologyInfo& t) {
  w.Key("links").BeginArray();
  for (const tpu::IciLinkInfo& l : t.links) {
    w.BeginObject();
    w.Key("a").Int(l.a);
    w.Key("b").Int(l.b);
    w.Key("axis").Int(l.axis);
    w.Key("bytes_a_to_b").Uint(l.bytes_a_to_b);
    w.Key("bytes_b_to_a").Uint(l.bytes_b_to_a);
    w.EndObject();
  }
  w.EndArray();
}

void WriteCommunicators(JsonWriter& w, const tpu::DaemonStatus& st) {
  w.Key("collectives_run").Uint(st.collectives_run);
  w.Key("communicators").BeginArray();
  for (const tpu::CommunicatorInfo& c : st.communicators) {
    w.BeginObject();
    w.Key("id").Uint(c.id);
    w.Key("size").Int(c.size);
    w.Key("chips").IntArray(c.chips);
    w.Key("sessions").BeginArray();
    for (uint64_t s : c.sessions) w.Uint(s);
    w.EndArray();
    w.Key("ring").IntArray(c.ring);
    w.Key("failed").Bool(c.failed);
    w.Key("failure").String(c.failure);
    w.Key("groups_done").Uint(c.groups_done);
    w.Key("bytes_moved").Uint(c.bytes_moved);
    w.EndObject();
  }
  w.EndArray();
}

void PrintLinks(const tpu::TopologyInfo& t) {
  std::printf("%-10s %-5s %14s %14s\n", "ICI LINK", "AXIS", "BYTES A->B",
              "BYTES B->A");
  for (const tpu::IciLinkInfo& l : t.links) {
    std::printf("%-10s %-5d %14s %14s\n", absl::StrCat(l.a, " - ", l.b).c_str(),
                l.axis, tpu::FormatBytes(l.bytes_a_to_b).c_str(),
                tpu::FormatBytes(l.bytes_b_to_a).c_str());
  }
}

// The torus as a picture: each plane of the first two axes a grid of chips
// (id, HBM in use, duty), the links between grid neighbours labelled with
// the bytes they carried (both ways). Wrap-around links and links along a
// third axis are in the link table below it.
void DrawTorus(const tpu::TopologyInfo& t) {
  const int nx = t.shape.empty() ? 1 : t.shape[0];
  const int ny = t.shape.size() > 1 ? t.shape[1] : 1;
  const int nz = t.shape.size() > 2 ? t.shape[2] : 1;
  std::map<std::vector<int>, const tpu::ChipInfo*> at;
  for (const tpu::ChipInfo& c : t.chips) {
    std::vector<int> xyz = c.coords;
    xyz.resize(3, 0);
    at[xyz] = &c;
  }
  // Bytes on the link between chips a and b (both ways); -1: no link.
  auto carried = [&](const tpu::ChipInfo* a,
                     const tpu::ChipInfo* b) -> int64_t {
    if (a == nullptr || b == nullptr) return -1;
    for (const tpu::IciLinkInfo& l : t.links) {
      if ((l.a == a->id && l.b == b->id) || (l.a == b->id && l.b == a->id)) {
        return static_cast<int64_t>(l.bytes_a_to_b + l.bytes_b_to_a);
      }
    }
    return -1;
  };
  auto cell = [](const tpu::ChipInfo* c) -> std::string {
    if (c == nullptr) return "[  absent  ]";
    const double pct = c->hbm_total_bytes == 0
                           ? 0
                           : 100.0 * c->hbm_used_bytes / c->hbm_total_bytes;
    return absl::StrFormat("[%2d %3.0f%% %3.0f%%%s]", c->id, pct,
                           100 * c->duty_cycle,
                           !c->healthy  ? " !"
                           : c->drained ? " d"
                                        : "");
  };
  auto label = [](int64_t bytes) {
    return bytes < 0 ? std::string()
                     : tpu::FormatBytes(static_cast<uint64_t>(bytes));
  };
  // Column widths: cells and the horizontal links' labels.
  size_t cw = 0, lw = 0;
  for (const tpu::ChipInfo& c : t.chips) cw = std::max(cw, cell(&c).size());
  for (const tpu::IciLinkInfo& l : t.links)
    lw = std::max(
        lw,
        label(static_cast<int64_t>(l.bytes_a_to_b + l.bytes_b_to_a)).size());
  lw += 4;
  auto centred = [](const std::string& s, size_t w) {
    const size_t left = s.size() >= w ? 0 : (w - s.size()) / 2;
    return std::string(left, ' ') + s +
           std::string(s.size() + left >= w ? 0 : w - s.size() - left, ' ');
  };
  std::printf(
      "chips as [id HBM%% duty%%] (! unhealthy, d drained); links: bytes "
      "carried, both ways\n");
  for (int z = 0; z < nz; ++z) {
    if (nz > 1) std::printf("\nz = %d\n", z);
    for (int y = 0; y < ny; ++y) {
      std::string row;
      for (int x = 0; x < nx; ++x) {
        const tpu::ChipInfo* c = at.count({x, y, z}) ? at[{x, y, z}] : nullptr;
        row += centred(cell(c), cw);
        if (x + 1 < nx) {
          const tpu::ChipInfo* r =
              at.count({x + 1, y, z}) ? at[{x + 1, y, z}] : nullptr;
          const int64_t b = carried(c, r);
          std::string link =
              b < 0 ? std::string(lw, ' ') : centred(" " + label(b) + " ", lw);
          if (b >= 0) {
            for (char& ch : link) {
              if (ch != ' ') break;
              ch = '-';
            }
            for (size_t i = link.size(); i-- > 0 && link[i] == ' ';)
              link[i] = '-';
          }
          row += link;
        }
      }
      std::printf("%s\n", row.c_str());
      if (y + 1 == ny) break;
      // The links down to the next row: a bar, the bytes, a bar.
      std::string bars, bytes;
      for (int x = 0; x < nx; ++x) {
        const tpu::ChipInfo* c = at.count({x, y, z}) ? at[{x, y, z}] : nullptr;
        const tpu::ChipInfo* d =
            at.count({x, y + 1, z}) ? at[{x, y + 1, z}] : nullptr;
        const int64_t b = carried(c, d);
        bars += centred(b < 0 ? "" : "|", cw);
        bytes += centred(label(b), cw);
        if (x + 1 < nx) {
          bars += std::string(lw, ' ');
          bytes += std::string(lw, ' ');
        }
      }
      for (std::string* s : {&bars, &bytes})
        s->erase(s->find_last_not_of(' ') + 1);
      std::printf("%s\n%s\n%s\n", bars.c_str(), bytes.c_str(), bars.c_str());
    }
  }
}

void WriteSessions(JsonWriter& w,
                   const std::vector<tpu::SessionInfo>& sessions) {
  w.Key("sessions").BeginArray();
  for (const tpu::SessionInfo& s : sessions) {
    w.BeginObject();
    w.Key("id").Uint(s.id);
    w.Key("pid").Int(s.pid);
    w.Key("uid").Uint(s.uid);
    w.Key("user").String(UserName(s.uid));
    w.Key("command").String(s.command);
    w.Key("client_name").String(s.client_name);
    w.Key("hbm_bytes").Uint(s.hbm_bytes);
    w.Key("hbm_bytes_per_chip").BeginObject();
    for (const auto& [chip, bytes] : s.hbm_bytes_per_chip) {
      w.Key(absl::StrCat(chip)).Uint(bytes);
    }
    w.EndObject();
    w.Key("quota_bytes_per_chip");
    if (s.quota_bytes_per_chip == 0) {
      w.Null();
    } else {
      w.Uint(s.quota_bytes_per_chip);
    }
    w.Key("allocation_id");
    if (s.allocation_id == 0) {
      w.Null();
    } else {
      w.Uint(s.allocation_id);
    }
    w.Key("segment_count").Uint(s.segment_count);
    w.Key("protocol_version").Uint(s.protocol_version);
    w.Key("opened_unix_seconds").Double(s.opened_unix_seconds);
    w.Key("busy_seconds").Double(s.busy_seconds);
    w.Key("ops_executed").Uint(s.ops_executed);
    w.Key("programs").BeginArray();
    for (const tpu::SessionInfo::Program& p : s.programs) {
      w.BeginObject();
      w.Key("id").Uint(p.id);
      w.Key("name").String(p.name);
      w.Key("chip").Int(p.chip);
      w.Key("records").Uint(p.records);
      w.Key("calls").Uint(p.calls);
      w.Key("busy_seconds").Double(p.busy_seconds);
      w.Key("compiles").Uint(p.compiles);
      w.Key("last_compile").String(p.last_compile);
      w.EndObject();
    }
    w.EndArray();
    w.EndObject();
  }
  w.EndArray();
}

// Captured programs (torch.compile) and fused eager runs, per session.
void PrintProgramTable(const std::vector<tpu::SessionInfo>& sessions) {
  Table table({"SESSION", "PID", "CHIP", "PROGRAM", "RECORDS", "CALLS", "BUSY",
               "PER CALL", "COMPILES"},
              "rrr.rrrrr");
  size_t n = 0;
  std::vector<std::string> why;  // each program's latest compile
  for (const tpu::SessionInfo& s : sessions) {
    for (const tpu::SessionInfo::Program& p : s.programs) {
      ++n;
      // Fused eager runs: one entry, with no program id of its own.
      const std::string name =
          p.id == ~0u ? "- eager (fused)" : absl::StrCat(p.id, " ", p.name);
      table.Row({absl::StrCat(s.id), absl::StrCat(s.pid), absl::StrCat(p.chip),
                 name, absl::StrCat(p.records), absl::StrCat(p.calls),
                 absl::StrFormat("%.3fs", p.busy_seconds),
                 p.calls == 0 ? "-"
                              : absl::StrFormat("%.1fus",
                                                1e6 * p.busy_seconds / p.calls),
                 absl::StrCat(p.compiles)});
      if (!p.last_compile.empty()) {
        why.push_back(absl::StrCat("session ", s.id, " chip ", p.chip, " ",
                                   name, ": ", p.last_compile));
      }
    }
  }
  if (n == 0) {
    std::printf(
        "No captured programs (torch.compile) or fused eager runs in any "
        "session.\n");
    return;
  }
  table.Print();
  if (!why.empty()) std::printf("\nLatest compile, and why:\n");
  for (const std::string& w : why) std::printf("  %s\n", w.c_str());
}

void PrintChipTable(const tpu::TopologyInfo& t) {
  Table table({"CHIP", "COORDS", "HBM USED", "HBM TOTAL", "HBM%", "SESSIONS",
               "DUTY", "OPS", "STATE"},
              "r.rrrrrr.");
  for (const tpu::ChipInfo& c : t.chips) {
    double pct =
        c.hbm_total_bytes == 0
            ? 0
            : 100.0 * static_cast<double>(c.hbm_used_bytes) / c.hbm_total_bytes;
    std::string state = c.healthy ? "healthy" : "UNHEALTHY";
    if (c.drained) state += ", drained";
    table.Row({absl::StrCat(c.id),
               absl::StrCat("(", absl::StrJoin(c.coords, ","), ")"),
               tpu::FormatBytes(c.hbm_used_bytes),
               tpu::FormatBytes(c.hbm_total_bytes),
               absl::StrFormat("%.0f%%", pct), absl::StrCat(c.session_count),
               absl::StrFormat("%.0f%%", 100 * c.duty_cycle),
               absl::StrCat(c.ops_executed), state});
  }
  table.Print();
}

void PrintSessionTable(const std::vector<tpu::SessionInfo>& sessions) {
  if (sessions.empty()) {
    std::printf("No sessions.\n");
    return;
  }
  Table table({"SESSION", "PID", "USER", "HBM", "HBM PER CHIP", "QUOTA", "BUSY",
               "OPS", "COMMAND"},
              "rr.r.rrr.");
  for (const tpu::SessionInfo& s : sessions) {
    std::vector<std::string> per_chip;
    for (const auto& [chip, bytes] : s.hbm_bytes_per_chip) {
      per_chip.push_back(absl::StrCat(chip, ": ", tpu::FormatBytes(bytes)));
    }
    std::string command =
        s.command.size() > 60 ? s.command.substr(0, 57) + "..." : s.command;
    table.Row({absl::StrCat(s.id), absl::StrCat(s.pid), UserName(s.uid),
               tpu::FormatBytes(s.hbm_bytes),
               per_chip.empty() ? "-" : absl::StrJoin(per_chip, ", "),
               s.quota_bytes_per_chip == 0
                   ? "none"
                   : tpu::FormatBytes(s.quota_bytes_per_chip),
               absl::StrFormat("%.2fs", s.busy_seconds),
               absl::StrCat(s.ops_executed), command});
  }
  table.Print();
}

void WriteExecutors(JsonWriter& w, const tpu::DaemonStatus& st) {
  w.Key("executors").BeginArray();
  for (const tpu::ExecutorInfo& e : st.executors) {
    w.BeginObject();
    w.Key("index").Int(e.index);
    w.Key("chips").BeginArray();
    for (int c : e.chips) w.Int(c);
    w.EndArray();
    w.Key("pid").Int(e.pid);
    w.Key("ready").Bool(e.ready);
    w.Key("restarts").Uint(e.restarts);
    w.Key("busy_seconds").Double(e.busy_seconds);
    w.Key("ops_executed").Uint(e.ops_executed);
    w.Key("unrung_wakes").Uint(e.unrung_wakes);
    w.Key("duty_cycle").Double(e.duty_cycle);
    w.Key("busy").Bool(e.busy);
    w.Key("intra_op_threads").Int(e.intra_op_threads);
    w.Key("intra_op_threads_max").Int(e.intra_op_threads_max);
    if (!e.compile.empty()) {
      w.Key("programs_cached").Uint(e.programs_cached);
      w.Key("device_buffer_bytes").Uint(e.device_buffer_bytes);
      w.Key("compile").BeginArray();
      for (const tpu::ExecutorInfo::Compile& c : e.compile) {
        w.BeginObject();
        w.Key("chip").Int(c.chip);
        w.Key("compiles").Uint(c.compiles);
        w.Key("compile_seconds").Double(c.compile_seconds);
        w.Key("cache_hits").Uint(c.cache_hits);
        w.Key("collective_programs").Uint(c.collective_programs);
        w.Key("graph_programs").Uint(c.graph_programs);
        w.Key("disk_hits").Uint(c.disk_hits);
        w.Key("disk_stores").Uint(c.disk_stores);
        w.Key("compile_seconds_saved").Double(c.compile_seconds_saved);
        w.EndObject();
      }
      w.EndArray();
    }
    if (e.disk_cache.enabled) {
      w.Key("disk_cache").BeginObject();
      w.Key("entries").Uint(e.disk_cache.entries);
      w.Key("bytes").Uint(e.disk_cache.bytes);
      w.Key("max_bytes").Uint(e.disk_cache.max_bytes);
      w.Key("rejected").Uint(e.disk_cache.rejected);
      w.Key("write_errors").Uint(e.disk_cache.write_errors);
      w.EndObject();
    }
    w.EndObject();
  }
  w.EndArray();
  w.Key("executor_restarts").BeginArray();
  for (const tpu::ExecutorRestart& r : st.executor_restarts) {
    w.BeginObject();
    w.Key("unix_seconds").Double(r.unix_seconds);
    w.Key("executor").Int(r.executor);
    w.Key("pid").Int(r.pid);
    w.Key("reason").String(r.reason);
    w.Key("session_id");
    if (r.session_id == 0) {
      w.Null();
    } else {
      w.Uint(r.session_id);
    }
    w.Key("op");
    if (r.session_id == 0) {
      w.Null();
    } else {
      w.String(r.op);
    }
    w.Key("chip").Int(r.chip);
    w.Key("stream").Int(r.stream);
    w.Key("sequence").Uint(r.sequence);
    w.EndObject();
  }
  w.EndArray();
}

std::string Ago(double unix_seconds) {
  const double now = absl::ToDoubleSeconds(absl::Now() - absl::UnixEpoch());
  return absl::StrCat(Duration(std::max(0.0, now - unix_seconds)), " ago");
}

void PrintRestart(const tpu::ExecutorRestart& r) {
  std::printf("  %s: executor %d (pid %d) %s", Ago(r.unix_seconds).c_str(),
              r.executor, r.pid, r.reason.c_str());
  if (r.session_id != 0) {
    std::printf(
        " in %s of session %llu (chip %d, stream %d, record %llu); that "
        "session was ended",
        r.op.c_str(), static_cast<unsigned long long>(r.session_id), r.chip,
        r.stream, static_cast<unsigned long long>(r.sequence));
  }
  std::printf("\n");
}

// Compiled programs per chip, where the backend compiles (PJRT), and its
// compilation cache on disk; nothing otherwise.
void PrintCompiledPrograms(const tpu::DaemonStatus& st) {
  bool compiling = false;
  for (const tpu::ExecutorInfo& e : st.executors)
    compiling |= !e.compile.empty();
  if (compiling) {
    std::printf("\n");
    Table programs(
        {"CHIP", "EXECUTOR", "COMPILES", "COMPILE TIME", "CACHE HITS",
         "DISK HITS", "SAVED", "COLLECTIVES", "GRAPHS"},
        "rrrrrrrrr");
    uint64_t cached = 0, device_bytes = 0;
    // The compilation cache on disk. Executors may share one directory
    // (--compile_cache_dir), each seeing all of it: take the largest
    // entries, bytes and bound rather than their sum. Rejections and failed
    // writes are each executor's own, so those add up.
    bool on_disk = false;
    uint64_t disk_entries = 0, disk_bytes = 0, disk_max_bytes = 0;
    uint64_t disk_rejected = 0, disk_write_errors = 0;
    for (const tpu::ExecutorInfo& e : st.executors) {
      cached += e.programs_cached;
      device_bytes += e.device_buffer_bytes;
      if (e.disk_cache.enabled) {
        on_disk = true;
        disk_entries = std::max(disk_entries, e.disk_cache.entries);
        disk_bytes = std::max(disk_bytes, e.disk_cache.bytes);
        disk_max_bytes = std::max(disk_max_bytes, e.disk_cache.max_bytes);
        disk_rejected += e.disk_cache.rejected;
        disk_write_errors += e.disk_cache.write_errors;
      }
      for (const tpu::ExecutorInfo::Compile& c : e.compile) {
        programs.Row({absl::StrCat(c.chip), absl::StrCat(e.index),
                      absl::StrCat(c.compiles),
                      absl::StrFormat("%.3fs", c.compile_seconds),
                      absl::StrCat(c.cache_hits), absl::StrCat(c.disk_hits),
                      absl::StrFormat("%.3fs", c.compile_seconds_saved),
                      absl::StrCat(c.collective_programs),
                      absl::StrCat(c.graph_programs)});
      }
    }
    programs.Print();
    std::printf("%llu compiled programs cached\n",
                static_cast<unsigned long long>(cached));
    if (on_disk) {
      std::printf("compilation cache on disk: %llu programs, %s of %s",
                  static_cast<unsigned long long>(disk_entries),
                  tpu::FormatBytes(disk_bytes).c_str(),
                  tpu::FormatBytes(disk_max_bytes).c_str());
      if (disk_rejected != 0 || disk_write_errors != 0) {
        std::printf(", %llu rejected, %llu failed writes",
                    static_cast<unsigned long long>(disk_rejected),
                    static_cast<unsigned long long>(disk_write_errors));
      }
      std::printf("\n");
    }
    if (device_bytes != 0) {
      std::printf("%s of segments in device buffers\n",
                  tpu::FormatBytes(device_bytes).c_str());
    }
  }
}

int CmdExecutors(tpu::AdminClient& admin, bool json) {
  absl::StatusOr<tpu::DaemonStatus> st = admin.GetStatus();
  if (!st.ok()) return Error(st.status());
  if (json) {
    JsonWriter w;
    w.BeginObject();
    w.Key("schema_version").Int(kJsonSchemaVersion);
    w.Key("spin_ok").Bool(st->spin_ok);
    w.Key("wait_advice").String(st->wait_advice);
    WriteExecutors(w, *st);
    w.EndObject();
    std::printf("%s\n", w.str().c_str());
    return 0;
  }
  Table table({"EXECUTOR", "CHIPS", "PID", "STATE", "RESTARTS", "DUTY", "OPS",
               "BUSY", "THREADS"},
              "r.r.rrrrr");
  for (const tpu::ExecutorInfo& e : st->executors) {
    table.Row(
        {absl::StrCat(e.index), absl::StrJoin(e.chips, ","),
         absl::StrCat(e.pid), e.ready ? "ready" : "STARTING",
         absl::StrCat(e.restarts),
         absl::StrFormat("%.0f%%", 100 * e.duty_cycle),
         absl::StrCat(e.ops_executed), absl::StrFormat("%.2fs", e.busy_seconds),
         e.intra_op_threads == 0
             ? std::string("-")
             : absl::StrCat(e.intra_op_threads, "/", e.intra_op_threads_max)});
  }
  table.Print();
  PrintCompiledPrograms(*st);
  const char* advice =
      st->wait_advice == "spin" ? "spin (a core is free for them)"
      : st->wait_advice == "yield"
          ? "yield, then block (only tpud's parties compete for the cores)"
          : "block at once (other threads need the cores)";
  std::printf("\nwaiting parties %s\n", advice);
  if (st->executor_restarts.empty()) {
    std::printf("No executor restarts.\n");
  } else {
    std::printf("Executor restarts (oldest first):\n");
    for (const tpu::ExecutorRestart& r : st->executor_restarts) PrintRestart(r);
  }
  return 0;
}

// `tpuctl status --json` of `st`, on one line.
std::string StatusJson(const tpu::DaemonStatus& status) {
  const tpu::DaemonStatus* st = &status;
  JsonWriter w;
  w.BeginObject();
  w.Key("schema_version").Int(kJsonSchemaVersion);
  w.Key("daemon").BeginObject();
  w.Key("version").String(st->daemon_version);
  w.Key("backend").BeginObject();
  w.Key("kind").String(st->backend.kind);
  w.Key("description").String(st->backend.description);
  if (st->backend.kind == "pjrt") {
    w.Key("plugin_path").String(st->backend.plugin_path);
    w.Key("pjrt_api_version").String(st->backend.pjrt_api_version);
    w.Key("platform").String(st->backend.platform);
  }
  w.EndObject();
  w.Key("pid").Int(st->daemon_pid);
  w.Key("uptime_seconds").Double(st->uptime_seconds);
  w.Key("default_quota_bytes_per_chip");
  if (st->default_quota_bytes_per_chip == 0) {
    w.Null();
  } else {
    w.Uint(st->default_quota_bytes_per_chip);
  }
  w.EndObject();
  WriteTopology(w, st->topology);
  WriteChips(w, st->topology);
  WriteLinks(w, st->topology);
  WriteSessions(w, st->sessions);
  WriteExecutors(w, *st);
  WriteCommunicators(w, *st);
  w.EndObject();
  return w.str();
}

int CmdStatus(tpu::AdminClient& admin, bool json) {
  absl::StatusOr<tpu::DaemonStatus> st = admin.GetStatus();
  if (!st.ok()) return Error(st.status());
  if (json) {
    std::printf("%s\n", StatusJson(*st).c_str());
    return 0;
  }
  const tpu::TopologyInfo& t = st->topology;
  const std::string on = st->backend.kind == "pjrt"
                             ? absl::StrCat(" on ", st->backend.description)
                             : (t.simulated ? " (simulated)" : "");
  std::printf(
      "tpud %s  pid %d  up %s  |  %s%s: %s, %s, %zu chips, %s HBM each\n",
      st->daemon_version.c_str(), st->daemon_pid,
      Duration(st->uptime_seconds).c_str(), t.name.c_str(), on.c_str(),
      t.generation.name.c_str(), t.ShapeString().c_str(), t.chips.size(),
      tpu::FormatBytes(t.generation.hbm_bytes_per_chip).c_str());
  std::printf("\n");
  PrintChipTable(t);
  std::printf("\n");
  PrintSessionTable(st->sessions);
  uint64_t ici = 0;
  for (const tpu::IciLinkInfo& l : t.links)
    ici += l.bytes_a_to_b + l.bytes_b_to_a;
  std::printf(
      "\n%llu collective(s) run, %s over ICI links (`tpuctl topology` per "
      "link); "
      "%zu communicator(s) now\n",
      static_cast<unsigned long long>(st->collectives_run),
      tpu::FormatBytes(ici).c_str(), st->communicators.size());
  for (const tpu::CommunicatorInfo& c : st->communicators) {
    std::printf(
        "  communicator %llu: %d ranks on chips %s, %llu groups, %s "
        "moved%s%s\n",
        static_cast<unsigned long long>(c.id), c.size,
        absl::StrJoin(c.chips, ",").c_str(),
        static_cast<unsigned long long>(c.groups_done),
        tpu::FormatBytes(c.bytes_moved).c_str(), c.failed ? "; FAILED: " : "",
        c.failed ? c.failure.c_str() : "");
  }
  uint64_t restarts = 0;
  for (const tpu::ExecutorInfo& e : st->executors) restarts += e.restarts;
  std::printf(
      "\n%zu executor processes, %llu restart(s)%s\n", st->executors.size(),
      static_cast<unsigned long long>(restarts),
      restarts == 0 ? "" : "; the last (`tpuctl executors` lists all):");
  if (!st->executor_restarts.empty())
    PrintRestart(st->executor_restarts.back());
  return 0;
}

// Rates between two updates of the status: per chip ops/s, per session
// ops/s and the share of the interval its ops kept a chip busy.
struct Rates {
  double seconds = 0;  // between the two updates (0: the first update)
  std::map<int, double> chip_ops;
  std::map<uint64_t, double> session_ops, session_busy;
};

Rates RatesBetween(const tpu::DaemonStatus* before,
                   const tpu::DaemonStatus& now) {
  Rates r;
  if (before == nullptr || now.uptime_seconds <= before->uptime_seconds)
    return r;
  r.seconds = now.uptime_seconds - before->uptime_seconds;
  std::map<int, uint64_t> chip_ops;
  for (const tpu::ChipInfo& c : before->topology.chips)
    chip_ops[c.id] = c.ops_executed;
  for (const tpu::ChipInfo& c : now.topology.chips) {
    auto it = chip_ops.find(c.id);
    if (it != chip_ops.end() && c.ops_executed >= it->second)
      r.chip_ops[c.id] = (c.ops_executed - it->second) / r.seconds;
  }
  std::map<uint64_t, const tpu::SessionInfo*> sessions;
  for (const tpu::SessionInfo& s : before->sessions) sessions[s.id] = &s;
  for (const tpu::SessionInfo& s : now.sessions) {
    auto it = sessions.find(s.id);
    const uint64_t ops0 = it == sessions.end() ? 0 : it->second->ops_executed;
    const double busy0 = it == sessions.end() ? 0 : it->second->busy_seconds;
    r.session_ops[s.id] =
        s.ops_executed >= ops0 ? (s.ops_executed - ops0) / r.seconds : 0;
    r.session_busy[s.id] = std::max(0.0, s.busy_seconds - busy0) / r.seconds;
  }
  return r;
}

std::string Rate(const std::map<int, double>& m, int k, double seconds) {
  if (seconds == 0) return "-";
  auto it = m.find(k);
  return it == m.end() ? "-" : absl::StrFormat("%.0f", it->second);
}

// tpuctl watch: `--json` prints each update as one line of `status --json`;
// without it, one line per chip per update, like nvidia-smi dmon.
int CmdWatch(tpu::AdminClient& admin, bool json) {
  std::optional<tpu::DaemonStatus> last;
  bool header = false;
  absl::Status st = admin.Watch(
      absl::GetFlag(FLAGS_interval), absl::GetFlag(FLAGS_count),
      [&](const tpu::DaemonStatus& now) {
        if (json) {
          std::printf("%s\n", StatusJson(now).c_str());
        } else {
          if (!header) {
            std::printf("# %9s %5s %10s %5s %5s %8s %8s\n", "uptime_s", "chip",
                        "hbm_used", "hbm%", "duty%", "ops/s", "sessions");
            header = true;
          }
          const Rates r = RatesBetween(last ? &*last : nullptr, now);
          for (const tpu::ChipInfo& c : now.topology.chips) {
            const double pct =
                c.hbm_total_bytes == 0
                    ? 0
                    : 100.0 * c.hbm_used_bytes / c.hbm_total_bytes;
            std::printf(
                "  %9.1f %5d %10s %5.0f %5.0f %8s %8d\n", now.uptime_seconds,
                c.id, tpu::FormatBytes(c.hbm_used_bytes).c_str(), pct,
                100 * c.duty_cycle, Rate(r.chip_ops, c.id, r.seconds).c_str(),
                c.session_count);
          }
        }
        std::fflush(stdout);
        last = now;
        return true;
      });
  if (!st.ok()) return Error(st);
  return 0;
}

// tpuctl top: a refreshing view of the chips and of the sessions, busiest
// first, like htop (on a terminal the screen is redrawn; otherwise each
// update follows the last).
int CmdTop(tpu::AdminClient& admin) {
  std::optional<tpu::DaemonStatus> last;
  const bool tty = isatty(STDOUT_FILENO) != 0;
  absl::Status st = admin.Watch(
      absl::GetFlag(FLAGS_interval), absl::GetFlag(FLAGS_count),
      [&](const tpu::DaemonStatus& now) {
        const Rates r = RatesBetween(last ? &*last : nullptr, now);
        const tpu::TopologyInfo& t = now.topology;
        std::printf(tty ? "\033[H\033[2J" : "\n");
        uint64_t used = 0, total = 0;
        for (const tpu::ChipInfo& c : t.chips) {
          used += c.hbm_used_bytes;
          total += c.hbm_total_bytes;
        }
        std::printf(
            "tpud %s  up %s  |  %s: %zu chips, HBM %s of %s, %zu session(s)  | "
            " every %.1fs\n\n",
            now.daemon_version.c_str(), Duration(now.uptime_seconds).c_str(),
            t.name.c_str(), t.chips.size(), tpu::FormatBytes(used).c_str(),
            tpu::FormatBytes(total).c_str(), now.sessions.size(),
            absl::GetFlag(FLAGS_interval));
        Table chips(
            {"CHIP", "HBM USED", "HBM%", "DUTY", "OPS/S", "SESSIONS", "STATE"},
            "rrrrrr.");
        for (const tpu::ChipInfo& c : t.chips) {
          const double pct = c.hbm_total_bytes == 0
                                 ? 0
                                 : 100.0 * c.hbm_used_bytes / c.hbm_total_bytes;
          std::string state = c.healthy ? "healthy" : "UNHEALTHY";
          if (c.drained) state += ", drained";
          chips.Row({absl::StrCat(c.id), tpu::FormatBytes(c.hbm_used_bytes),
                     absl::StrFormat("%.0f%%", pct),
                     absl::StrFormat("%.0f%%", 100 * c.duty_cycle),
                     Rate(r.chip_ops, c.id, r.seconds),
                     absl::StrCat(c.session_count), state});
        }
        chips.Print();
        std::printf("\n");
        std::vector<const tpu::SessionInfo*> order;
        for (const tpu::SessionInfo& s : now.sessions) order.push_back(&s);
        auto busy = [&](const tpu::SessionInfo* s) {
          auto it = r.session_busy.find(s->id);
          return it == r.session_busy.end() ? 0.0 : it->second;
        };
        std::stable_sort(
            order.begin(), order.end(),
            [&](const tpu::SessionInfo* a, const tpu::SessionInfo* b) {
              return busy(a) != busy(b) ? busy(a) > busy(b)
                                        : a->hbm_bytes > b->hbm_bytes;
            });
        if (order.empty()) {
          std::printf("No sessions.\n");
        } else {
          Table sessions({"SESSION", "PID", "USER", "HBM", "BUSY", "OPS/S",
                          "OPS", "COMMAND"},
                         "rr.rrrr.");
          for (const tpu::SessionInfo* s : order) {
            const std::string command = s->command.size() > 50
                                            ? s->command.substr(0, 47) + "..."
                                            : s->command;
            auto ops = r.session_ops.find(s->id);
            sessions.Row({absl::StrCat(s->id), absl::StrCat(s->pid),
                          UserName(s->uid), tpu::FormatBytes(s->hbm_bytes),
                          r.seconds == 0
                              ? "-"
                              : absl::StrFormat("%.0f%%", 100 * busy(s)),
                          r.seconds == 0 || ops == r.session_ops.end()
                              ? "-"
                              : absl::StrFormat("%.0f", ops->second),
                          absl::StrCat(s->ops_executed), command});
          }
          sessions.Print();
        }
        std::fflush(stdout);
        last = now;
        return true;
      });
  if (!st.ok()) return Error(st);
  return 0;
}

int CmdTopology(tpu::AdminClient& admin, bool json) {
  absl::StatusOr<tpu::DaemonStatus> st = admin.GetStatus();
  if (!st.ok()) return Error(st.status());
  const tpu::TopologyInfo& t = st->topology;
  if (json) {
    JsonWriter w;
    w.BeginObject();
    w.Key("schema_version").Int(kJsonSchemaVersion);
    WriteTopology(w, t);
    WriteChips(w, t);
    WriteLinks(w, t);
    w.EndObject();
    std::printf("%s\n", w.str().c_str());
    return 0;
  }
  const tpu::GenerationInfo& g = t.generation;
  std::printf("%s%s: generation %s, shape %s (wrap-around: %s)\n",
              t.name.c_str(), t.simulated ? " (simulated)" : "", g.name.c_str(),
              t.ShapeString().c_str(),
              std::any_of(t.wraparound.begin(), t.wraparound.end(),
                          [](bool b) { return b; })
                  ? "yes"
                  : "none");
  std::printf(
      "per chip: %s HBM at %.0f GB/s, ICI %.0f GB/s, %.0f bf16 TFLOP/s, %d "
      "TensorCore(s)\n",
      tpu::FormatBytes(g.hbm_bytes_per_chip).c_str(),
      g.hbm_bandwidth_gbytes_per_s, g.ici_bandwidth_gbytes_per_s,
      g.peak_bf16_tflops, g.tensorcores_per_chip);
  std::printf("\n");
  DrawTorus(t);
  std::printf("\n%-5s %-10s %s\n", "CHIP", "COORDS", "ICI NEIGHBOURS");
  for (const tpu::ChipInfo& c : t.chips) {
    std::printf(
        "%-5d %-10s %s\n", c.id,
        absl::StrCat("(", absl::StrJoin(c.coords, ","), ")").c_str(),
        c.neighbors.empty() ? "-" : absl::StrJoin(c.neighbors, ", ").c_str());
  }
  if (!t.links.empty()) {
    std::printf("\n");
    PrintLinks(t);
  }
  return 0;
}

int CmdSessions(tpu::AdminClient& admin, bool json) {
  absl::StatusOr<std::vector<tpu::SessionInfo>> sessions = admin.ListSessions();
  if (!sessions.ok()) return Error(sessions.status());
  if (json) {
    JsonWriter w;
    w.BeginObject();
    w.Key("schema_version").Int(kJsonSchemaVersion);
    WriteSessions(w, *sessions);
    w.EndObject();
    std::printf("%s\n", w.str().c_str());
    return 0;
  }
  PrintSessionTable(*sessions);
  return 0;
}

int CmdPrograms(tpu::AdminClient& admin, bool json) {
  absl::StatusOr<std::vector<tpu::SessionInfo>> sessions = admin.ListSessions();
  if (!sessions.ok()) return Error(sessions.status());
  if (json) return CmdSessions(admin, true);  // programs are in each session
  PrintProgramTable(*sessions);
  absl::StatusOr<tpu::DaemonStatus> st = admin.GetStatus();
  if (!st.ok()) return Error(st.status());
  PrintCompiledPrograms(*st);
  return 0;
}

int CmdHealth(tpu::AdminClient& admin, bool json) {
  absl::StatusOr<tpu::HealthReport> h = admin.Health();
  if (!h.ok()) return Error(h.status());
  if (json) {
    JsonWriter w;
    w.BeginObject();
    w.Key("schema_version").Int(kJsonSchemaVersion);
    w.Key("serving").Bool(h->serving);
    w.Key("version").String(h->daemon_version);
    w.Key("chips").BeginArray();
    for (const tpu::ChipHealth& c : h->chips) {
      w.BeginObject();
      w.Key("id").Int(c.chip);
      w.Key("healthy").Bool(c.healthy);
      w.Key("drained").Bool(c.drained);
      w.Key("detail").String(c.detail);
      w.EndObject();
    }
    w.EndArray();
    w.EndObject();
    std::printf("%s\n", w.str().c_str());
  } else {
    std::printf("tpud %s: %s\n", h->daemon_version.c_str(),
                h->serving ? "serving" : "NOT SERVING");
    for (const tpu::ChipHealth& c : h->chips) {
      std::printf("  chip %d: %s%s (%s)\n", c.chip,
                  c.healthy ? "healthy" : "UNHEALTHY",
                  c.drained ? ", drained" : "", c.detail.c_str());
    }
  }
  return h->serving ? 0 : 1;
}

int CmdAllocations(tpu::AdminClient& admin, bool json) {
  absl::StatusOr<std::vector<tpu::AllocationInfo>> all =
      admin.ListAllocations();
  if (!all.ok()) return Error(all.status());
  if (json) {
    JsonWriter w;
    w.BeginObject();
    w.Key("schema_version").Int(kJsonSchemaVersion);
    w.Key("allocations").BeginArray();
    for (const tpu::AllocationInfo& a : *all) {
      w.BeginObject();
      w.Key("id").Uint(a.id);
      w.Key("name").String(a.name);
      w.Key("chips").BeginArray();
      for (const tpu::AllocationInfo::Chip& c : a.chips) {
        w.BeginObject();
        w.Key("chip").Int(c.chip);
        w.Key("quota_bytes");
        if (c.quota_bytes == 0) {
          w.Null();
        } else {
          w.Uint(c.quota_bytes);
        }
        w.EndObject();
      }
      w.EndArray();
      w.Key("created_unix_seconds").Double(a.created_unix_seconds);
      w.Key("session_count").Int(a.session_count);
      w.EndObject();
    }
    w.EndArray();
    w.EndObject();
    std::printf("%s\n", w.str().c_str());
    return 0;
  }
  if (all->empty()) {
    std::printf(
        "no allocations (the Kubernetes device plugin makes one per "
        "container)\n");
    return 0;
  }
  Table table({"ID", "CHIPS (QUOTA)", "SESSIONS", "AGE", "NAME"}, "rlrr");
  const double now = absl::ToDoubleSeconds(absl::Now() - absl::UnixEpoch());
  for (const tpu::AllocationInfo& a : *all) {
    std::vector<std::string> chips;
    for (const tpu::AllocationInfo::Chip& c : a.chips) {
      const std::string quota = c.quota_bytes == 0
                                    ? std::string("no quota")
                                    : tpu::FormatBytes(c.quota_bytes);
      chips.push_back(absl::StrCat(c.chip, " (", quota, ")"));
    }
    table.Row({absl::StrCat(a.id), absl::StrJoin(chips, ", "),
               absl::StrCat(a.session_count),
               Duration(now - a.created_unix_seconds), a.name});
  }
  table.Print();
  return 0;
}

int Usage() {
  std::fprintf(stderr, "%s\n", absl::ProgramUsageMessage().data());
  return 2;
}

bool ParseUint(const std::string& text, uint64_t* out) {
  return absl::SimpleAtoi(text, out);
}

int Main(std::vector<std::string> args) {
  if (args.empty()) return Usage();
  const std::string cmd = args[0];
  const bool json = absl::GetFlag(FLAGS_json);
  absl::StatusOr<std::unique_ptr<tpu::AdminClient>> admin =
      tpu::AdminClient::Connect(AdminPath());
  if (!admin.ok()) return Error(admin.status());
  tpu::AdminClient& a = **admin;
  if (cmd == "status" && args.size() == 1) return CmdStatus(a, json);
  if (cmd == "executors" && args.size() == 1) return CmdExecutors(a, json);
  if (cmd == "topology" && args.size() == 1) return CmdTopology(a, json);
  if (cmd == "sessions" && args.size() == 1) return CmdSessions(a, json);
  if (cmd == "programs" && args.size() == 1) return CmdPrograms(a, json);
  if (cmd == "health" && args.size() == 1) return CmdHealth(a, json);
  if (cmd == "allocations" && args.size() == 1) return CmdAllocations(a, json);
  if (cmd == "watch" && args.size() == 1) return CmdWatch(a, json);
  if (cmd == "top" && args.size() == 1) return CmdTop(a);
  if (cmd == "kill" && args.size() == 2) {
    uint64_t id = 0;
    if (!ParseUint(args[1], &id)) return Usage();
    absl::StatusOr<uint64_t> bytes = a.KillSession(id);
    if (!bytes.ok()) return Error(bytes.status());
    std::printf("killed session %llu; reclaimed %s\n",
                static_cast<unsigned long long>(id),
                tpu::FormatBytes(*bytes).c_str());
    return 0;
  }
  if (cmd == "release" && args.size() == 2) {
    uint64_t id = 0;
    if (!ParseUint(args[1], &id) || id == 0) return Usage();
    if (absl::Status st = a.ReleaseAllocationById(id); !st.ok())
      return Error(st);
    std::printf(
        "released allocation %llu: new sessions with its token are refused\n",
        static_cast<unsigned long long>(id));
    return 0;
  }
  if (cmd == "quota") {
    const bool to_default = absl::GetFlag(FLAGS_default);
    if (args.size() != (to_default ? 2u : 3u)) return Usage();
    absl::StatusOr<uint64_t> size = tpu::ParseBytes(args.back());
    if (!size.ok()) return Error(size.status());
    std::string shown =
        *size == 0 ? "none" : tpu::FormatBytes(*size) + " per chip";
    if (to_default) {
      if (absl::Status st = a.SetDefaultQuota(*size); !st.ok())
        return Error(st);
      std::printf("default quota for new sessions: %s\n", shown.c_str());
      return 0;
    }
    uint64_t id = 0;
    if (!ParseUint(args[1], &id)) return Usage();
    if (absl::Status st = a.SetSessionQuota(id, *size); !st.ok())
      return Error(st);
    std::printf("session %llu quota: %s\n", static_cast<unsigned long long>(id),
                shown.c_str());
    return 0;
  }
  if ((cmd == "drain" || cmd == "undrain") && args.size() == 2) {
    uint64_t chip = 0;
    if (!ParseUint(args[1], &chip) || chip > 0x7fffffff) return Usage();
    absl::Status st = cmd == "drain" ? a.DrainChip(static_cast<int>(chip))
                                     : a.UndrainChip(static_cast<int>(chip));
    if (!st.ok()) return Error(st);
    std::printf(
        "chip %llu %s\n", static_cast<unsigned long long>(chip),
        cmd == "drain"
            ? "drained: new allocations refused, existing ones keep working"
            : "undrained");
    return 0;
  }
  return Usage();
}

}  // namespace
}  // namespace tpuctl

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(
      "administer tpud\n"
      "  tpuctl status    [--json]   chips and processes, like nvidia-smi\n"
      "  tpuctl executors [--json]   executor processes and why any was "
      "restarted\n"
      "  tpuctl topology  [--json]   host shape, chip coordinates, ICI "
      "neighbours\n"
      "  tpuctl sessions  [--json]   client sessions\n"
      "  tpuctl programs  [--json]   captured programs (torch.compile) per "
      "session: calls, time\n"
      "  tpuctl health    [--json]   exit 0 when serving\n"
      "  tpuctl allocations [--json] chips and quotas set aside per container "
      "(device plugin)\n"
      "  tpuctl release ALLOCATION   release an allocation by id: new "
      "sessions with its token are refused\n"
      "  tpuctl top                  live view of chips and sessions "
      "(--interval S, --count N)\n"
      "  tpuctl watch     [--json]   the status every --interval seconds: a "
      "line per chip, or\n"
      "                              with --json one status document per line\n"
      "  tpuctl kill SESSION         end a session, reclaim its HBM\n"
      "  tpuctl quota SESSION SIZE   per-chip HBM quota (SIZE e.g. 8GiB, or "
      "none)\n"
      "  tpuctl quota --default SIZE default quota for new sessions\n"
      "  tpuctl drain CHIP | undrain CHIP\n"
      "flags: --socket, --admin_socket (or TPUD_SOCKET, TPUD_ADMIN_SOCKET)");
  std::vector<char*> rest = absl::ParseCommandLine(argc, argv);
  std::vector<std::string> args(rest.begin() + 1, rest.end());
  return tpuctl::Main(args);
}
