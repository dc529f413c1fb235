// Control-plane round trip through libtpuclient against a plain gRPC unary
// ping on a unix socket, measured in the same run, interleaved.
//
//   TPUD_SOCKET=/path/tpud.sock control_plane_bench [--iterations=N]
//
// Prints one JSON object per line: name, speed_ratio (project speed / baseline
// speed; higher is better) and the per-call times behind it.
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/str_cat.h"
#include "bench/ping_baseline.h"
#include "tpu/client.h"

ABSL_FLAG(int, iterations, 2000, "calls per measured round");
ABSL_FLAG(int, rounds, 7, "interleaved rounds; the median round is reported");

namespace {

template <typename F>
double MicrosPerCall(int n, F&& f) {
  auto start = std::chrono::steady_clock::now();
  for (int i = 0; i < n; ++i) f(i);
  auto end = std::chrono::steady_clock::now();
  return std::chrono::duration<double, std::micro>(end - start).count() / n;
}

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

void Emit(const std::string& name, double project_us, double baseline_us,
          int calls, const std::string& baseline) {
  std::printf(
      "{\"name\":\"%s\",\"speed_ratio\":%.4f,\"project_us_per_call\":%.3f,"
      "\"baseline_us_per_call\":%.3f,\"baseline\":\"%s\",\"calls_per_round\":%"
      "d}\n",
      name.c_str(), baseline_us / project_us, project_us, baseline_us,
      baseline.c_str(), calls);
  std::fflush(stdout);
}

}  // namespace

int main(int argc, char** argv) {
  // The baseline server is forked before any thread exists.
  char dir_template[] = "/tmp/tpud-bench.XXXXXX";
  if (mkdtemp(dir_template) == nullptr) return 1;
  const std::string ping_path = absl::StrCat(dir_template, "/ping.sock");
  const pid_t server = tpud_bench::ForkPingServer(ping_path);
  absl::ParseCommandLine(argc, argv);
  const int n = absl::GetFlag(FLAGS_iterations);
  const int rounds = std::max(1, absl::GetFlag(FLAGS_rounds));

  tpud_bench::PingClient ping(ping_path);
  absl::StatusOr<std::unique_ptr<tpu::Session>> session =
      tpu::Session::Open({"", "control_plane_bench"});
  if (!session.ok()) {
    std::fprintf(stderr, "control_plane_bench: %s\n",
                 session.status().ToString().c_str());
    tpud_bench::StopPingServer(server);
    return 1;
  }
  tpu::Session& s = **session;
  auto stats = [&](int) {
    if (!s.GetMemoryStats().ok()) std::abort();
  };
  auto alloc_free = [&](int) {
    absl::StatusOr<tpu::Segment> seg = s.Allocate(0, 1 << 20);
    if (!seg.ok() || !s.Free(seg->address).ok()) std::abort();
  };

  // Warm both paths, then interleave rounds so drift hits both alike.
  ping.MicrosPerCall(200);
  MicrosPerCall(200, stats);
  MicrosPerCall(100, alloc_free);
  std::vector<double> ping_us, stats_us, alloc_us;
  for (int r = 0; r < rounds; ++r) {
    ping_us.push_back(ping.MicrosPerCall(n));
    stats_us.push_back(MicrosPerCall(n, stats));
    alloc_us.push_back(MicrosPerCall(n / 2, alloc_free));
  }
  const double ping_median = Median(ping_us);
  Emit("control_plane_roundtrip", Median(stats_us), ping_median, n,
       "grpc_unary_ping_unix");
  // An allocate+free pair is two round trips: compare with two pings.
  Emit("segment_alloc_free_pair", Median(alloc_us), 2 * ping_median, n / 2,
       "2x_grpc_unary_ping_unix");

  tpud_bench::StopPingServer(server);
  unlink(ping_path.c_str());
  rmdir(dir_template);
  return 0;
}
