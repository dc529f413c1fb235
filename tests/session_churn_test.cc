// What one session costs tpud, and that ending sessions gives all of it
// back: 1000 sessions opened and closed in a loop, and 64 open at once,
// leave the daemon's (and its executors') memory, descriptors and threads
// where they were.
#include <dirent.h>
#include <unistd.h>

#include <cstdio>
#include <fstream>
#include <memory>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "catch2_compat/catch.h"
#include "tests/daemon_harness.h"
#include "tpu/client.h"

namespace {

using tpud_test::TestDaemon;

constexpr char kAdd[] =
    "aten::add_.Tensor(Tensor(a!) self, Tensor other, *, Scalar alpha=1) -> "
    "Tensor(a!)";
constexpr int8_t kFloat = 6;

struct Usage {
  int processes = 0;
  long rss_kib = 0;  // VmRSS summed over tpud and its executors
  int fds = 0;
  int threads = 0;
};

std::vector<int> Children(int pid) {
  std::vector<int> out;
  std::string dir = absl::StrCat("/proc/", pid, "/task");
  DIR* d = opendir(dir.c_str());
  if (d == nullptr) return out;
  while (dirent* e = readdir(d)) {
    if (e->d_name[0] == '.') continue;
    std::ifstream f(absl::StrCat(dir, "/", e->d_name, "/children"));
    int child;
    while (f >> child) out.push_back(child);
  }
  closedir(d);
  return out;
}

void Add(int pid, Usage* u) {
  ++u->processes;
  std::ifstream status(absl::StrCat("/proc/", pid, "/status"));
  std::string line;
  while (std::getline(status, line)) {
    std::istringstream in(line);
    std::string key;
    long value = 0;
    in >> key >> value;
    if (key == "VmRSS:") u->rss_kib += value;
    if (key == "Threads:") u->threads += static_cast<int>(value);
  }
  DIR* d = opendir(absl::StrCat("/proc/", pid, "/fd").c_str());
  if (d != nullptr) {
    while (dirent* e = readdir(d)) u->fds += e->d_name[0] != '.';
    closedir(d);
  }
  for (int c : Children(pid)) Add(c, u);
}

Usage Measure(const TestDaemon& d) {
  Usage u;
  Add(d.pid(), &u);
  return u;
}

std::unique_ptr<tpu::Session> OpenAndRun(const TestDaemon& d) {
  tpu::ClientOptions o;
  o.socket_path = d.socket();
  o.client_name = "churn";
  absl::StatusOr<std::unique_ptr<tpu::Session>> s = tpu::Session::Open(o);
  REQUIRE(s.ok());
  tpu::Session& session = **s;
  absl::StatusOr<tpu::Segment> seg = session.Allocate(0, 4096);
  REQUIRE(seg.ok());
  std::vector<float> ones(16, 1.0f);
  REQUIRE(session.CopyToDevice(0, seg->address, ones.data(), sizeof(float) * 16)
              .ok());
  tpu::OpArg t;
  t.tag = tpu::ArgTag::kTensor;
  t.tensor.address = seg->address;
  t.tensor.dtype = kFloat;
  t.tensor.ndim = 1;
  t.tensor.sizes[0] = 16;
  t.tensor.strides[0] = 1;
  absl::StatusOr<uint32_t> add = session.DefineOp(kAdd);
  REQUIRE(add.ok());
  tpu::OpArg args[2] = {t, t};
  REQUIRE(session.EnqueueOp(0, *add, args, 2, nullptr, 0).ok());
  std::vector<float> back(16, 0.0f);
  REQUIRE(session.CopyToHost(0, back.data(), seg->address, sizeof(float) * 16)
              .ok());
  REQUIRE(back[15] == 2.0f);
  return *std::move(s);
}

void Report(const char* when, const Usage& u) {
  std::printf("%-28s %d processes, RSS %ld KiB, %d descriptors, %d threads\n",
              when, u.processes, u.rss_kib, u.fds, u.threads);
}

TEST_CASE("sessions give back every byte, descriptor and thread they cost") {
  TestDaemon d({"--topology=v6e-4", "--log_level=warn"});
  // Warm up: torch's kernels, gRPC's threads, the allocators' first pages.
  for (int i = 0; i < 20; ++i) OpenAndRun(d)->Close().IgnoreError();
  absl::SleepFor(absl::Milliseconds(300));  // the last hangups are seen
  const Usage base = Measure(d);
  Report("baseline:", base);
  REQUIRE(base.processes == 6);  // tpud, the zygote, 4 executors

  {
    // What 64 open sessions cost while they are open.
    std::vector<std::unique_ptr<tpu::Session>> open(64);
    std::vector<std::thread> threads;
    for (int t = 0; t < 8; ++t) {
      threads.emplace_back([&, t] {
        for (int i = t; i < 64; i += 8) open[i] = OpenAndRun(d);
      });
    }
    for (std::thread& t : threads) t.join();
    const Usage busy = Measure(d);
    Report("64 sessions open:", busy);
    std::printf("per session: %.1f KiB RSS, %.2f descriptors, %.2f threads\n",
                (busy.rss_kib - base.rss_kib) / 64.0,
                (busy.fds - base.fds) / 64.0,
                (busy.threads - base.threads) / 64.0);
    // No thread per session, anywhere (gRPC's pool may grow by a few).
    CHECK(busy.threads - base.threads <= 8);
    for (auto& s : open) CHECK(s->Close().ok());
  }
  for (int i = 0; i < 1000; ++i) CHECK(OpenAndRun(d)->Close().ok());

  // Everything is given back once the hangups have been seen.
  Usage after;
  const bool settled = TestDaemon::WaitFor(
      [&] {
        after = Measure(d);
        return after.fds == base.fds && after.threads <= base.threads + 8;
      },
      absl::Seconds(10));
  Report("after 1064 sessions:", after);
  CHECK(settled);
  CHECK(after.processes == base.processes);
  CHECK(after.fds == base.fds);
  CHECK(after.threads <= base.threads + 8);
  // Memory: within allocator noise of the baseline (no per-session leak:
  // 1064 sessions of even 64 KiB each would be 66 MiB).
  CHECK(after.rss_kib - base.rss_kib < 16 * 1024);
}

}  // namespace
