// The baseline of the pjrt_* benchmarks: the same StableHLO programs tpud's
// PJRT backend compiles for an op, compiled and called here in-process on
// the same plugin, inputs resident on the device (what a process that owns
// the plugin pays per call).
//
//   pjrt_inprocess_bench PLUGIN [name=value ...]
// Prints one JSON object: tiny_op_s and matmul_1024_s (median seconds per
// call over rounds).
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <string>
#include <vector>

#include "daemon/backends/pjrt/pjrt_plugin.h"

namespace {

using tpud::pjrt::Buffer;
using tpud::pjrt::Executable;
using tpud::pjrt::PjrtPlugin;

constexpr char kTinyAdd[] = R"(
module @tiny {
  func.func public @main(%a: tensor<1xf32>, %b: tensor<f64>) -> tensor<1xf32> {
    %c = stablehlo.convert %b : (tensor<f64>) -> tensor<f32>
    %d = stablehlo.broadcast_in_dim %c, dims = [] : (tensor<f32>) -> tensor<1xf32>
    %0 = stablehlo.add %a, %d : tensor<1xf32>
    return %0 : tensor<1xf32>
  }
}
)";

constexpr char kMatmul[] = R"(
module @mm {
  func.func public @main(%a: tensor<1024x1024xf32>, %b: tensor<1024x1024xf32>) -> tensor<1024x1024xf32> {
    %0 = stablehlo.dot %a, %b : (tensor<1024x1024xf32>, tensor<1024x1024xf32>) -> tensor<1024x1024xf32>
    return %0 : tensor<1024x1024xf32>
  }
}
)";

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// Median over rounds of the seconds per call of `exe` on `args`.
double PerCall(const PjrtPlugin& p, const Executable& exe,
               const std::vector<PJRT_Buffer*>& args, int calls, int rounds) {
  std::vector<double> per;
  for (int r = 0; r < rounds; ++r) {
    const auto t0 = std::chrono::steady_clock::now();
    for (int i = 0; i < calls; ++i) {
      auto out = p.Execute(exe, 0, args);
      if (!out.ok()) {
        std::fprintf(stderr, "%s\n",
                     std::string(out.status().message()).c_str());
        std::exit(1);
      }
    }
    per.push_back(
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t0)
            .count() /
        calls);
  }
  return Median(per);
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fprintf(stderr,
                 "usage: pjrt_inprocess_bench PLUGIN [name=value ...]\n");
    return 2;
  }
  std::vector<tpud::pjrt::CreateOption> options;
  for (int i = 2; i < argc; ++i) {
    auto o = tpud::pjrt::ParseCreateOption(argv[i]);
    if (!o.ok()) return 2;
    options.push_back(*o);
  }
  auto plugin = PjrtPlugin::Load(argv[1], options);
  if (!plugin.ok()) {
    std::fprintf(stderr, "%s\n",
                 std::string(plugin.status().message()).c_str());
    return 1;
  }
  const PjrtPlugin& p = **plugin;
  auto tiny = p.Compile(kTinyAdd);
  auto mm = p.Compile(kMatmul);
  if (!tiny.ok() || !mm.ok()) {
    std::fprintf(stderr, "compile failed\n");
    return 1;
  }
  const float one = 1;
  const double scalar = 1;
  auto a = p.FromHost(0, &one, PJRT_Buffer_Type_F32, std::vector<int64_t>{1});
  auto s = p.FromHost(0, &scalar, PJRT_Buffer_Type_F64, std::vector<int64_t>{});
  std::vector<float> big(1024 * 1024, 0.5f);
  auto m = p.FromHost(0, big.data(), PJRT_Buffer_Type_F32,
                      std::vector<int64_t>{1024, 1024});
  if (!a.ok() || !s.ok() || !m.ok()) return 1;
  const double tiny_s = PerCall(p, **tiny, {a->get(), s->get()}, 20000, 5);
  const double mm_s = PerCall(p, **mm, {m->get(), m->get()}, 3, 5);
  std::printf("{\"tiny_op_s\": %.9g, \"matmul_1024_s\": %.9g}\n", tiny_s, mm_s);
  return 0;
}
