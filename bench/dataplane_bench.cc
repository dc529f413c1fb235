// Data-plane benchmark: tpud's op streams and copies against the same work
// done directly in this process (ATen, memcpy) or against a plain gRPC ping,
// each baseline measured in the same run.
//
//   TPUD_SOCKET=/path/tpud.sock dataplane_bench [--only=small_op,...]
//
// One JSON object per line: name, speed_ratio (project speed / baseline
// speed; higher is better), target, and the measurements behind it.
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "bench/ping_baseline.h"
#include "tpu/client.h"

ABSL_FLAG(std::string, only, "",
          "comma-separated figures to run (default: all)");
ABSL_FLAG(int, rounds, 5, "interleaved rounds; the median is reported");

namespace {

using Clock = std::chrono::steady_clock;

double Seconds(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

void Emit(const std::string& name, double project_s, double baseline_s,
          double target, const std::string& baseline,
          const std::string& unit_note) {
  std::printf(
      "{\"name\":\"%s\",\"speed_ratio\":%.4f,\"target\":%.2f,\"project_"
      "seconds\":%.6g,"
      "\"baseline_seconds\":%.6g,\"baseline\":\"%s\",\"work\":\"%s\"}\n",
      name.c_str(), baseline_s / project_s, target, project_s, baseline_s,
      baseline.c_str(), unit_note.c_str());
  std::fflush(stdout);
}

[[noreturn]] void Die(const absl::Status& s, const char* what) {
  std::fprintf(stderr, "dataplane_bench: %s: %s\n", what, s.ToString().c_str());
  std::exit(1);
}

template <typename T>
T Check(absl::StatusOr<T> v, const char* what) {
  if (!v.ok()) Die(v.status(), what);
  return *std::move(v);
}

void Check(const absl::Status& s, const char* what) {
  if (!s.ok()) Die(s, what);
}

std::string SchemaOf(const char* name, const char* overload) {
  auto op = c10::Dispatcher::singleton().findSchema({name, overload});
  return c10::toString(op->schema());
}

tpu::TensorRef Ref(uint64_t address, const at::Tensor& like) {
  tpu::TensorRef r;
  r.address = address;
  r.dtype = static_cast<int8_t>(like.scalar_type());
  r.ndim = static_cast<uint8_t>(like.dim());
  for (int d = 0; d < like.dim(); ++d) {
    r.sizes[d] = like.size(d);
    r.strides[d] = like.stride(d);
  }
  return r;
}

tpu::OpArg TensorArg(const tpu::TensorRef& r) {
  tpu::OpArg a;
  a.tag = tpu::ArgTag::kTensor;
  a.tensor = r;
  return a;
}

tpu::TensorRef Upload(tpu::Session& s, const at::Tensor& t) {
  tpu::Segment seg = Check(s.Allocate(0, t.nbytes()), "allocate");
  Check(s.CopyToDevice(0, seg.address, t.data_ptr(), t.nbytes()), "upload");
  return Ref(seg.address, t);
}

bool Want(const std::vector<std::string>& only, const char* name) {
  return only.empty() ||
         std::find(only.begin(), only.end(), name) != only.end();
}

}  // namespace

int main(int argc, char** argv) {
  char dir_template[] = "/tmp/tpud-dpbench.XXXXXX";
  if (mkdtemp(dir_template) == nullptr) return 1;
  const std::string ping_path = absl::StrCat(dir_template, "/ping.sock");
  const pid_t ping_server = tpud_bench::ForkPingServer(ping_path);
  absl::ParseCommandLine(argc, argv);
  std::vector<std::string> only;
  if (!absl::GetFlag(FLAGS_only).empty())
    only = absl::StrSplit(absl::GetFlag(FLAGS_only), ',');
  const int rounds = std::max(1, absl::GetFlag(FLAGS_rounds));

  tpu::ClientOptions options;
  options.client_name = "dataplane_bench";
  options.pinned_pool_bytes = 300 << 20;
  std::unique_ptr<tpu::Session> session =
      Check(tpu::Session::Open(options), "open session");
  tpu::Session& s = *session;

  if (Want(only, "small_op")) {
    constexpr int kOps = 100000;
    at::Tensor a = at::ones({1}), b = at::ones({1});
    tpu::TensorRef da = Upload(s, a), db = Upload(s, b), dout = Upload(s, a);
    const uint32_t add =
        Check(s.DefineOp(SchemaOf("aten::add", "Tensor")), "define");
    tpu::OpArg args[2] = {TensorArg(da), TensorArg(db)};
    std::vector<double> project, baseline;
    for (int r = 0; r < rounds; ++r) {
      auto t0 = Clock::now();
      for (int i = 0; i < kOps; ++i)
        Check(s.EnqueueOp(0, add, args, 2, &dout, 1), "enqueue");
      Check(s.Synchronize(0), "synchronize");
      auto t1 = Clock::now();
      for (int i = 0; i < kOps; ++i) {
        at::Tensor c = at::add(a, b);
        (void)c;
      }
      auto t2 = Clock::now();
      project.push_back(Seconds(t0, t1));
      baseline.push_back(Seconds(t1, t2));
    }
    Emit("small_op", Median(project), Median(baseline), 0.33,
         "aten_add_in_process",
         "100k aten::add.Tensor on 1-element float tensors, then synchronize");
  }

  if (Want(only, "sync_roundtrip")) {
    constexpr int kReads = 2000;
    at::Tensor x = at::full({1}, 3.5);
    tpu::TensorRef dx = Upload(s, x);
    dx.ndim = 0;
    const uint32_t item =
        Check(s.DefineOp(SchemaOf("aten::_local_scalar_dense", "")), "define");
    tpu::OpArg arg = TensorArg(dx);
    tpud_bench::PingClient ping(ping_path);
    ping.MicrosPerCall(200);
    std::vector<double> project, baseline;
    for (int r = 0; r < rounds; ++r) {
      auto t0 = Clock::now();
      for (int i = 0; i < kReads; ++i) {
        std::vector<tpu::OpResult> v =
            Check(s.RunSync(0, item, &arg, 1, nullptr, 0), "item");
        if (v.empty() || v[0].d != 3.5) std::abort();
      }
      auto t1 = Clock::now();
      project.push_back(Seconds(t0, t1) / kReads);
      baseline.push_back(ping.MicrosPerCall(kReads) / 1e6);
    }
    Emit("sync_roundtrip", Median(project), Median(baseline), 4.0,
         "grpc_unary_ping_unix",
         "read one scalar back (aten::_local_scalar_dense), per call");
  }

  const uint64_t kCopyBytes = 256ull << 20;
  const bool any_copy = Want(only, "h2d_pageable") ||
                        Want(only, "d2h_pageable") ||
                        Want(only, "h2d_pinned") || Want(only, "d2h_pinned");
  if (any_copy) {
    std::vector<char> host(kCopyBytes, 1), other(kCopyBytes, 2);
    void* pinned = Check(s.AllocatePinned(kCopyBytes), "pinned");
    std::memset(pinned, 3, kCopyBytes);
    tpu::Segment seg = Check(s.Allocate(0, kCopyBytes), "allocate 256 MiB");
    // Touch the device pages once so every figure measures steady state.
    Check(s.CopyToDevice(0, seg.address, host.data(), kCopyBytes), "warm");
    Check(s.Synchronize(0), "warm");
    auto memcpy_baseline = [&] {
      auto t0 = Clock::now();
      std::memcpy(other.data(), host.data(), kCopyBytes);
      return Seconds(t0, Clock::now());
    };
    struct Figure {
      const char* name;
      double target;
      std::function<void()> run;
    };
    std::vector<Figure> figures = {
        {"h2d_pageable", 0.45,
         [&] {
           Check(s.CopyToDevice(0, seg.address, host.data(), kCopyBytes),
                 "h2d");
           Check(s.Synchronize(0), "h2d sync");
         }},
        {"d2h_pageable", 0.45,
         [&] {
           Check(s.CopyToHost(0, other.data(), seg.address, kCopyBytes), "d2h");
         }},
        {"h2d_pinned", 0.8,
         [&] {
           Check(s.CopyToDevice(0, seg.address, pinned, kCopyBytes),
                 "h2d pinned");
           Check(s.Synchronize(0), "h2d pinned sync");
         }},
        {"d2h_pinned", 0.8,
         [&] {
           Check(s.CopyToHost(0, pinned, seg.address, kCopyBytes),
                 "d2h pinned");
         }},
    };
    for (const Figure& f : figures) {
      if (!Want(only, f.name)) continue;
      std::vector<double> project, baseline;
      for (int r = 0; r < rounds; ++r) {
        auto t0 = Clock::now();
        f.run();
        project.push_back(Seconds(t0, Clock::now()));
        baseline.push_back(memcpy_baseline());
      }
      Emit(f.name, Median(project), Median(baseline), f.target,
           "single_thread_memcpy", "256 MiB");
    }
    Check(s.FreePinned(pinned), "free pinned");
    Check(s.Free(seg.address), "free");
  }

  if (Want(only, "matmul_1024")) {
    at::Tensor a = at::randn({1024, 1024}), b = at::randn({1024, 1024});
    tpu::TensorRef da = Upload(s, a), db = Upload(s, b), dc = Upload(s, a);
    const uint32_t mm = Check(s.DefineOp(SchemaOf("aten::mm", "")), "define");
    tpu::OpArg args[2] = {TensorArg(da), TensorArg(db)};
    constexpr int kReps = 10;
    std::vector<double> project, baseline;
    at::Tensor c = at::mm(a, b);  // warm ATen
    Check(s.EnqueueOp(0, mm, args, 2, &dc, 1), "mm");
    Check(s.Synchronize(0), "mm");
    for (int r = 0; r < rounds; ++r) {
      auto t0 = Clock::now();
      for (int i = 0; i < kReps; ++i)
        Check(s.EnqueueOp(0, mm, args, 2, &dc, 1), "mm");
      Check(s.Synchronize(0), "mm");
      auto t1 = Clock::now();
      for (int i = 0; i < kReps; ++i) c = at::mm(a, b);
      auto t2 = Clock::now();
      project.push_back(Seconds(t0, t1) / kReps);
      baseline.push_back(Seconds(t1, t2) / kReps);
    }
    Emit("matmul_1024", Median(project), Median(baseline), 0.95,
         "aten_mm_in_process", "1024x1024 float32 matmul, per op");
  }

  session.reset();
  tpud_bench::StopPingServer(ping_server);
  unlink(ping_path.c_str());
  rmdir(dir_template);
  return 0;
}
