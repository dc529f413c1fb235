// hello_tpud: open a session, print the host, allocate HBM, hold it, exit.
//
//   hello_tpud --chip=0 --bytes=1GiB --hold_seconds=10
//
// Exits non-zero with the daemon's message when the allocation is refused.
#include <unistd.h>

#include <cstdio>
#include <string>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "tpu/client.h"
#include "tpu/units.h"

ABSL_FLAG(std::string, socket, "",
          "tpud runtime socket (default $TPUD_SOCKET)");
ABSL_FLAG(int, chip, 0, "chip to allocate on");
ABSL_FLAG(std::string, bytes, "256MiB",
          "bytes to allocate, e.g. 4096, 512MiB, 2GiB");
ABSL_FLAG(int, segments, 1, "split the allocation into this many segments");
ABSL_FLAG(double, hold_seconds, 0, "hold the memory this long before exiting");

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  absl::StatusOr<uint64_t> bytes = tpu::ParseBytes(absl::GetFlag(FLAGS_bytes));
  if (!bytes.ok()) {
    std::fprintf(stderr, "hello_tpud: --bytes: %s\n",
                 bytes.status().ToString().c_str());
    return 2;
  }
  tpu::ClientOptions options;
  options.socket_path = absl::GetFlag(FLAGS_socket);
  options.client_name = "hello_tpud";
  absl::StatusOr<std::unique_ptr<tpu::Session>> session =
      tpu::Session::Open(options);
  if (!session.ok()) {
    std::fprintf(stderr, "hello_tpud: %s\n",
                 session.status().ToString().c_str());
    return 1;
  }
  absl::StatusOr<tpu::TopologyInfo> topo = (*session)->GetTopology();
  if (!topo.ok()) {
    std::fprintf(stderr, "hello_tpud: %s\n", topo.status().ToString().c_str());
    return 1;
  }
  std::printf("session %llu (protocol v%u, tpud %s)\n",
              static_cast<unsigned long long>((*session)->id()),
              (*session)->protocol_version(),
              (*session)->daemon_version().c_str());
  std::printf(
      "host %s%s: %s, shape %s, %zu chips, %s HBM per chip, %.0f bf16 TFLOP/s "
      "per chip\n",
      topo->name.c_str(), topo->simulated ? " (simulated)" : "",
      topo->generation.name.c_str(), topo->ShapeString().c_str(),
      topo->chips.size(),
      tpu::FormatBytes(topo->generation.hbm_bytes_per_chip).c_str(),
      topo->generation.peak_bf16_tflops);
  for (const tpu::ChipInfo& c : topo->chips) {
    std::printf("  chip %d at (%s) neighbours [%s]  HBM %s / %s\n", c.id,
                absl::StrJoin(c.coords, ",").c_str(),
                absl::StrJoin(c.neighbors, ",").c_str(),
                tpu::FormatBytes(c.hbm_used_bytes).c_str(),
                tpu::FormatBytes(c.hbm_total_bytes).c_str());
  }
  const int segments = std::max(1, absl::GetFlag(FLAGS_segments));
  const int chip = absl::GetFlag(FLAGS_chip);
  uint64_t total = 0;
  for (int i = 0; i < segments; ++i) {
    uint64_t part = *bytes / segments + (i == 0 ? *bytes % segments : 0);
    absl::StatusOr<tpu::Segment> seg = (*session)->Allocate(chip, part);
    if (!seg.ok()) {
      std::fprintf(stderr, "hello_tpud: allocation refused: %s\n",
                   seg.status().ToString().c_str());
      return 1;
    }
    total += seg->size;
  }
  std::printf("allocated %s on chip %d in %d segment(s)\n",
              tpu::FormatBytes(total).c_str(), chip, segments);
  std::fflush(stdout);
  const double hold = absl::GetFlag(FLAGS_hold_seconds);
  if (hold > 0) {
    std::printf("holding for %.1f s (pid %d)\n", hold,
                static_cast<int>(getpid()));
    std::fflush(stdout);
    absl::SleepFor(absl::Seconds(hold));
  }
  absl::Status closed = (*session)->Close();
  if (!closed.ok()) {
    std::fprintf(stderr, "hello_tpud: %s\n", closed.ToString().c_str());
    return 1;
  }
  std::printf("session closed; memory returned\n");
  return 0;
}
