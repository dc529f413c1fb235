// Control-plane round trip through libtpuclient against a plain gRPC unary
// ping on a unix socket, measured in the same run, interleaved.
//
//   TPUD_SOCKET=/path/tpud.sock control_plane_bench [--iterations=N]
//
// Prints one JSON object per line: name, speed_ratio (project speed / baseline
// speed; higher is better) and the per-call times behind it.
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include <grpcpp/grpcpp.h>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/str_cat.h"
#include "bench/ping.grpc.pb.h"
#include "tpu/client.h"

ABSL_FLAG(int, iterations, 2000, "calls per measured round");
ABSL_FLAG(int, rounds, 7, "interleaved rounds; the median round is reported");
ABSL_FLAG(std::string, serve_ping, "",
          "internal: serve the baseline ping on this unix socket path and exit on EOF of stdin");

extern char** environ;

namespace {

class PingService final : public tpud::bench::BenchPing::Service {
  grpc::Status Ping(grpc::ServerContext*, const tpud::bench::PingMessage* req,
                    tpud::bench::PingMessage* resp) override {
    resp->set_sequence(req->sequence());
    return grpc::Status::OK;
  }
};

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

void Emit(const std::string& name, double project_us, double baseline_us, int calls,
          const std::string& baseline) {
  std::printf(
      "{\"name\":\"%s\",\"speed_ratio\":%.4f,\"project_us_per_call\":%.3f,"
      "\"baseline_us_per_call\":%.3f,\"baseline\":\"%s\",\"calls_per_round\":%d}\n",
      name.c_str(), baseline_us / project_us, project_us, baseline_us, baseline.c_str(),
      calls);
  std::fflush(stdout);
}

}  // namespace

int ServePing(const std::string& path) {
  PingService service;
  grpc::ServerBuilder builder;
  builder.AddListeningPort("unix:" + path, grpc::InsecureServerCredentials());
  builder.RegisterService(&service);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  if (server == nullptr) {
    std::fprintf(stderr, "cannot start the baseline ping server on %s\n", path.c_str());
    return 1;
  }
  server->Wait();
  return 0;
}

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  if (!absl::GetFlag(FLAGS_serve_ping).empty()) return ServePing(absl::GetFlag(FLAGS_serve_ping));
  const int n = absl::GetFlag(FLAGS_iterations);
  const int rounds = std::max(1, absl::GetFlag(FLAGS_rounds));

  // Baseline: a plain gRPC server on a unix socket in another process, as
  // tpud is.
  char dir_template[] = "/tmp/tpud-bench.XXXXXX";
  if (mkdtemp(dir_template) == nullptr) return 1;
  const std::string ping_path = absl::StrCat(dir_template, "/ping.sock");
  std::string self = "/proc/self/exe";
  std::string flag = "--serve_ping=" + ping_path;
  char* child_argv[] = {self.data(), flag.data(), nullptr};
  pid_t server_pid = -1;
  if (posix_spawn(&server_pid, self.c_str(), nullptr, nullptr, child_argv, environ) != 0) {
    std::fprintf(stderr, "cannot spawn the baseline ping server\n");
    return 1;
  }
  for (int i = 0; i < 500 && access(ping_path.c_str(), F_OK) != 0; ++i) usleep(10000);
  auto stub = tpud::bench::BenchPing::NewStub(
      grpc::CreateChannel("unix:" + ping_path, grpc::InsecureChannelCredentials()));
  auto ping = [&](int i) {
    grpc::ClientContext ctx;
    tpud::bench::PingMessage req, resp;
    req.set_sequence(i);
    if (!stub->Ping(&ctx, req, &resp).ok()) std::abort();
  };

  absl::StatusOr<std::unique_ptr<tpu::Session>> session =
      tpu::Session::Open({"", "control_plane_bench"});
  if (!session.ok()) {
    std::fprintf(stderr, "control_plane_bench: %s\n", session.status().ToString().c_str());
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
  MicrosPerCall(200, ping);
  MicrosPerCall(200, stats);
  MicrosPerCall(100, alloc_free);
  std::vector<double> ping_us, stats_us, alloc_us;
  for (int r = 0; r < rounds; ++r) {
    ping_us.push_back(MicrosPerCall(n, ping));
    stats_us.push_back(MicrosPerCall(n, stats));
    alloc_us.push_back(MicrosPerCall(n / 2, alloc_free));
  }
  const double ping_median = Median(ping_us);
  Emit("control_plane_roundtrip", Median(stats_us), ping_median, n, "grpc_unary_ping_unix");
  // An allocate+free pair is two round trips: compare with two pings.
  Emit("segment_alloc_free_pair", Median(alloc_us), 2 * ping_median, n / 2,
       "2x_grpc_unary_ping_unix");

  kill(server_pid, SIGTERM);
  waitpid(server_pid, nullptr, 0);
  unlink(ping_path.c_str());
  rmdir(dir_template);
  return 0;
}
