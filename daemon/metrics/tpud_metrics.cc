#include "daemon/metrics/tpud_metrics.h"

#include <cctype>
#include <fstream>
#include <limits>
#include <set>
#include <sstream>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "prometheus/text_serializer.h"

namespace tpud {
namespace {

using prometheus::ClientMetric;
using prometheus::MetricFamily;
using prometheus::MetricType;
using Labels = std::vector<ClientMetric::Label>;

// Builds the families in a fixed order, each created on first use.
class Families {
 public:
  MetricFamily& Get(const std::string& name, MetricType type,
                    const std::string& help) {
    auto it = index_.find(name);
    if (it != index_.end()) return out_[it->second];
    index_[name] = out_.size();
    MetricFamily f;
    f.name = name;
    f.help = help;
    f.type = type;
    out_.push_back(std::move(f));
    return out_.back();
  }
  void Gauge(const std::string& name, const std::string& help, Labels labels,
             double value) {
    ClientMetric m;
    m.label = std::move(labels);
    m.gauge.value = value;
    Get(name, MetricType::Gauge, help).metric.push_back(std::move(m));
  }
  void Counter(const std::string& name, const std::string& help, Labels labels,
               double value) {
    ClientMetric m;
    m.label = std::move(labels);
    m.counter.value = value;
    Get(name, MetricType::Counter, help).metric.push_back(std::move(m));
  }
  std::vector<MetricFamily> Take() { return std::move(out_); }

 private:
  std::vector<MetricFamily> out_;
  std::map<std::string, size_t> index_;
};

std::string Str(uint64_t v) { return absl::StrCat(v); }

// Label values are free text: keep them printable and short.
std::string Clean(absl::string_view s, size_t max = 128) {
  std::string out;
  for (char c : s.substr(0, max))
    out.push_back(std::isprint(static_cast<unsigned char>(c)) ? c : '?');
  return out;
}

}  // namespace

std::string PodUidFromCgroup(absl::string_view text) {
  // The UID: 8-4-4-4-12 hex digits, with '-' (cgroupfs) or '_' (systemd).
  auto uid_at = [&](size_t pos) -> std::string {
    if (pos + 36 > text.size()) return "";
    std::string uid(text.substr(pos, 36));
    for (size_t i = 0; i < uid.size(); ++i) {
      const bool dash = i == 8 || i == 13 || i == 18 || i == 23;
      if (dash) {
        if (uid[i] != '-' && uid[i] != '_') return "";
        uid[i] = '-';
      } else if (!std::isxdigit(static_cast<unsigned char>(uid[i]))) {
        return "";
      }
    }
    return absl::AsciiStrToLower(uid);
  };
  for (size_t at = text.find("kubepods"); at != absl::string_view::npos;
       at = text.find("kubepods", at + 1)) {
    const size_t eol = text.find('\n', at);
    const absl::string_view line =
        text.substr(at, eol == absl::string_view::npos ? eol : eol - at);
    for (size_t p = line.find("pod"); p != absl::string_view::npos;
         p = line.find("pod", p + 1)) {
      std::string uid =
          uid_at(static_cast<size_t>(line.data() - text.data()) + p + 3);
      if (!uid.empty()) return uid;
    }
  }
  return "";
}

std::vector<MetricFamily> BuildMetricFamilies(const MetricsInputs& in) {
  Families f;
  const v1::GetStatusResponse& st = in.status;
  const v1::TopologyInfo& topo = st.topology();
  const v1::BackendInfo& b = st.backend();

  f.Gauge("tpud_build_info", "tpud's version and chip backend (always 1)",
          {{"version", Clean(st.daemon_version())},
           {"backend", Clean(b.kind())},
           {"platform", Clean(b.platform())},
           {"pjrt_api_version", Clean(b.pjrt_api_version())},
           {"topology", Clean(topo.name())}},
          1);
  f.Gauge("tpud_start_time_seconds",
          "when tpud started, seconds since the Unix epoch", {},
          in.start_unix_seconds);

  // ---- chips
  for (const v1::ChipInfo& c : topo.chips()) {
    const Labels chip = {{"chip", Str(c.id())}};
    f.Gauge("tpud_chip_hbm_used_bytes", "HBM held by segments on the chip",
            chip, static_cast<double>(c.hbm_used_bytes()));
    f.Gauge("tpud_chip_hbm_total_bytes", "HBM capacity of the chip", chip,
            static_cast<double>(c.hbm_total_bytes()));
    f.Gauge("tpud_chip_hbm_peak_bytes",
            "most HBM held on the chip at once since tpud started", chip,
            static_cast<double>(c.hbm_peak_bytes()));
    f.Gauge("tpud_chip_duty_cycle",
            "fraction of the last second the chip ran ops (0-1)", chip,
            c.duty_cycle());
    f.Counter("tpud_chip_busy_seconds_total", "time the chip spent running ops",
              chip, c.busy_seconds());
    f.Counter("tpud_chip_ops_total",
              "op records the chip ran (rate() gives ops per second)", chip,
              static_cast<double>(c.ops_executed()));
    f.Gauge("tpud_chip_sessions", "sessions holding HBM on the chip", chip,
            c.session_count());
    f.Gauge("tpud_chip_healthy", "1 if the chip is healthy", chip,
            c.healthy() ? 1 : 0);
    f.Gauge("tpud_chip_drained",
            "1 if the chip is drained (refuses new allocations)", chip,
            c.drained() ? 1 : 0);
  }
  // Per chip from the executors: queue depth and op latency (all chips,
  // so a series never disappears while tpud runs).
  std::array<uint64_t, kStatusCodes> op_errors{};
  for (const ExecutorInfo& e : in.executors) {
    for (size_t i = 0; i < e.chips.size(); ++i) {
      const Labels chip = {{"chip", Str(e.chips[i])}};
      if (i < e.queue_depth.size()) {
        f.Gauge(
            "tpud_chip_queue_depth",
            "op records clients published for the chip that are not done yet",
            chip, static_cast<double>(e.queue_depth[i]));
      }
      if (e.intra_op_threads > 0) {
        f.Gauge("tpud_chip_intra_op_threads",
                "threads each op on the chip may use now (its executor's "
                "share of the cores)",
                chip, e.intra_op_threads);
      }
      if (i < e.op_latency.size() && i < e.op_latency_sum_ns.size()) {
        ClientMetric m;
        m.label = chip;
        uint64_t cumulative = 0;
        for (int k = 0; k < kOpLatencyBuckets; ++k) {
          cumulative += e.op_latency[i][k];
          ClientMetric::Bucket bucket;
          bucket.cumulative_count = cumulative;
          bucket.upper_bound =
              k + 1 < kOpLatencyBuckets
                  ? static_cast<double>(kOpLatencyBoundsNs[k]) / 1e9
                  : std::numeric_limits<double>::infinity();
          m.histogram.bucket.push_back(bucket);
        }
        m.histogram.sample_count = cumulative;
        m.histogram.sample_sum =
            static_cast<double>(e.op_latency_sum_ns[i]) / 1e9;
        f.Get("tpud_chip_op_duration_seconds", MetricType::Histogram,
              "time one op record (or captured program) took on the chip")
            .metric.push_back(std::move(m));
      }
    }
    for (int c = 0; c < kStatusCodes; ++c) op_errors[c] += e.op_errors[c];
  }
  // Compiling backends (PJRT).
  for (const v1::ExecutorInfo& e : st.executors()) {
    for (const v1::ChipCompileStats& c : e.compile()) {
      const Labels chip = {{"chip", Str(c.chip())}};
      f.Counter("tpud_chip_compiles_total",
                "programs the backend compiled for the chip", chip,
                static_cast<double>(c.compiles()));
      f.Counter("tpud_chip_compile_seconds_total",
                "time spent compiling programs for the chip", chip,
                c.compile_seconds());
      f.Counter("tpud_chip_program_cache_hits_total",
                "ops that found their program compiled already", chip,
                static_cast<double>(c.cache_hits()));
      f.Counter("tpud_chip_graph_programs_total",
                "captured graphs (torch.compile) run as one compiled module",
                chip, static_cast<double>(c.graph_programs()));
      f.Counter("tpud_chip_collective_programs_total",
                "collectives run as one replicated program", chip,
                static_cast<double>(c.collective_programs()));
      f.Counter("tpud_chip_compile_cache_disk_hits_total",
                "programs for the chip loaded from the compilation cache on "
                "disk instead of compiled",
                chip, static_cast<double>(c.disk_hits()));
      f.Counter("tpud_chip_compile_cache_disk_stores_total",
                "programs for the chip written to the compilation cache on "
                "disk",
                chip, static_cast<double>(c.disk_stores()));
      f.Counter("tpud_chip_compile_seconds_saved_total",
                "compile time for the chip that loads from the compilation "
                "cache on disk saved",
                chip, c.compile_seconds_saved());
    }
  }

  // ---- ICI links: bytes each way.
  for (const v1::IciLinkInfo& l : topo.links()) {
    const std::string help =
        "bytes collectives moved over the ICI link, from src to dst";
    f.Counter(
        "tpud_ici_link_transmit_bytes_total", help,
        {{"src", Str(l.a())}, {"dst", Str(l.b())}, {"axis", Str(l.axis())}},
        static_cast<double>(l.bytes_a_to_b()));
    f.Counter(
        "tpud_ici_link_transmit_bytes_total", help,
        {{"src", Str(l.b())}, {"dst", Str(l.a())}, {"axis", Str(l.axis())}},
        static_cast<double>(l.bytes_b_to_a()));
  }
  f.Counter("tpud_collectives_total", "collective operations tpud ran", {},
            static_cast<double>(st.collectives_run()));

  // ---- sessions
  f.Gauge("tpud_sessions", "sessions open now", {}, st.sessions_size());
  // Declared even while no session is open, so dashboards and alerts see
  // the family.
  f.Get("tpud_session_info", MetricType::Gauge,
        "an open session's process (always 1)");
  f.Get("tpud_session_hbm_bytes", MetricType::Gauge,
        "HBM the session holds, all chips");
  f.Get("tpud_session_hbm_quota_bytes", MetricType::Gauge,
        "the session's HBM quota per chip (0: none)");
  f.Get("tpud_session_busy_seconds_total", MetricType::Counter,
        "chip time the session's ops used");
  f.Get("tpud_session_ops_total", MetricType::Counter,
        "op records of the session that ran");
  for (const v1::SessionInfo& s : st.sessions()) {
    const std::string id = Str(s.id());
    auto pod = in.pod_uids.find(s.id());
    f.Gauge("tpud_session_info", "an open session's process (always 1)",
            {{"session", id},
             {"pid", absl::StrCat(s.pid())},
             {"uid", Str(s.uid())},
             {"command", Clean(s.command())},
             {"pod_uid", pod == in.pod_uids.end() ? "" : pod->second}},
            1);
    const Labels session = {{"session", id}};
    f.Gauge("tpud_session_hbm_bytes", "HBM the session holds, all chips",
            session, static_cast<double>(s.hbm_bytes()));
    f.Gauge("tpud_session_hbm_quota_bytes",
            "the session's HBM quota per chip (0: none)", session,
            static_cast<double>(s.quota_bytes_per_chip()));
    f.Counter("tpud_session_busy_seconds_total",
              "chip time the session's ops used", session, s.busy_seconds());
    f.Counter("tpud_session_ops_total", "op records of the session that ran",
              session, static_cast<double>(s.ops_executed()));
  }
  f.Counter("tpud_sessions_opened_total", "sessions opened since tpud started",
            {}, static_cast<double>(in.sessions.opened));
  const std::string ended = "sessions ended since tpud started, by why";
  f.Counter("tpud_sessions_ended_total", ended, {{"reason", "closed"}},
            static_cast<double>(in.sessions.closed));
  f.Counter("tpud_sessions_ended_total", ended, {{"reason", "disconnected"}},
            static_cast<double>(in.sessions.disconnected));
  f.Counter("tpud_sessions_ended_total", ended, {{"reason", "killed"}},
            static_cast<double>(in.sessions.killed));
  f.Counter("tpud_sessions_ended_total", ended, {{"reason", "failed"}},
            static_cast<double>(in.sessions.failed));

  // ---- errors, by where and status code (every code listed, so rate()
  // sees the first error as an increase).
  const std::string errors =
      "errors tpud returned: failed op records (source=op) and control-plane "
      "calls (source=rpc)";
  for (int c = 1; c < kStatusCodes; ++c) {
    const std::string code =
        absl::StatusCodeToString(static_cast<absl::StatusCode>(c));
    f.Counter("tpud_errors_total", errors, {{"source", "op"}, {"code", code}},
              static_cast<double>(op_errors[c]));
  }
  for (int c = 1; c < RpcStatusCounts::kCodes; ++c) {
    const std::string code =
        absl::StatusCodeToString(static_cast<absl::StatusCode>(c));
    f.Counter("tpud_errors_total", errors, {{"source", "rpc"}, {"code", code}},
              static_cast<double>(in.rpc_statuses[c]));
  }

  // ---- executors
  for (const v1::ExecutorInfo& e : st.executors()) {
    const Labels ex = {{"executor", Str(e.index())}};
    f.Gauge("tpud_executor_up",
            "1 if the executor process is running and ready", ex,
            e.ready() ? 1 : 0);
    f.Counter("tpud_executor_restarts_total",
              "times the executor process was replaced", ex,
              static_cast<double>(e.restarts()));
    if (!e.compile().empty()) {
      f.Gauge("tpud_executor_programs_cached",
              "compiled programs the executor holds", ex,
              static_cast<double>(e.programs_cached()));
      f.Gauge("tpud_executor_device_buffer_bytes",
              "bytes of segments the executor holds in device buffers", ex,
              static_cast<double>(e.device_buffer_bytes()));
    }
    // The compilation cache on disk (--compile_cache_dir), as each executor
    // sees it: executors may share one directory, so sum entries and bytes
    // over executors with care (max by directory, not sum).
    if (e.has_disk_cache() && e.disk_cache().enabled()) {
      const v1::CompileCacheOnDisk& d = e.disk_cache();
      f.Gauge("tpud_compile_cache_disk_entries",
              "programs in the compilation cache on disk", ex,
              static_cast<double>(d.entries()));
      f.Gauge("tpud_compile_cache_disk_bytes",
              "bytes the compilation cache on disk takes", ex,
              static_cast<double>(d.bytes()));
      f.Gauge("tpud_compile_cache_disk_max_bytes",
              "the bound on the compilation cache on disk "
              "(--compile_cache_bytes)",
              ex, static_cast<double>(d.max_bytes()));
      f.Counter("tpud_compile_cache_disk_rejected_total",
                "entries of the compilation cache on disk refused when read "
                "(torn, corrupt, or for another plugin build) and removed",
                ex, static_cast<double>(d.rejected()));
      f.Counter("tpud_compile_cache_disk_write_errors_total",
                "writes to the compilation cache on disk that failed", ex,
                static_cast<double>(d.write_errors()));
    }
  }
  f.Gauge("tpud_default_quota_bytes",
          "HBM quota per chip of new sessions (0: none)", {},
          static_cast<double>(st.default_quota_bytes_per_chip()));
  return f.Take();
}

std::vector<MetricFamily> TpudCollector::Collect() const {
  MetricsInputs in = gather_();
  {
    absl::MutexLock lock(&mu_);
    std::map<uint64_t, std::string> live;
    for (const v1::SessionInfo& s : in.status.sessions()) {
      auto it = pods_.find(s.id());
      if (it == pods_.end()) {
        std::ifstream cg(absl::StrCat("/proc/", s.pid(), "/cgroup"));
        std::stringstream text;
        text << cg.rdbuf();
        it = pods_.emplace(s.id(), PodUidFromCgroup(text.str())).first;
      }
      live.emplace(s.id(), it->second);
    }
    pods_ = live;  // forget ended sessions
    for (const auto& [id, uid] : live) {
      if (!uid.empty()) in.pod_uids[id] = uid;
    }
  }
  return BuildMetricFamilies(in);
}

std::string TpudCollector::Render() const {
  return prometheus::TextSerializer().Serialize(Collect());
}

}  // namespace tpud
