// Activations and their backward ops: relu's threshold, softmax, gelu,
// leaky_relu, elu, softplus, sigmoid and tanh backward.
#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <functional>
#include <map>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "daemon/backends/pjrt/lowering/families.h"
#include "daemon/backends/pjrt/lowering/helpers.h"
#include "daemon/backends/pjrt/lowering/lowering.h"
#include "daemon/backends/pjrt/lowering/registry.h"

namespace tpud::pjrt {

void RegisterActivation(OpRegistry& reg) {
  // Arguments are read by their schema names (Args, helpers.h).
  reg.Add(
      "aten::threshold_backward",
      [](Lowering& l, const tpu::DecodedOp& d,
         const Target& out) -> absl::StatusOr<std::string> {
        const Args a(l);
        if (!a.Has("grad_output") || !a.Has("self") || !a.Has("threshold")) {
          return Unsupported(l.op(), "too few arguments");
        }
        absl::StatusOr<std::string> grad =
            l.Operand(a["grad_output"], out.dims, *out.type);
        if (!grad.ok()) return grad;
        absl::StatusOr<std::string> self =
            l.Operand(a["self"], out.dims, *out.type);
        if (!self.ok()) return self;
        absl::StatusOr<std::string> thr =
            l.Operand(a["threshold"], out.dims, *out.type);
        if (!thr.ok()) return thr;
        const HloType& pred = *DTypeOf(tpu::DType::kBool);
        const std::string c = l.Emit(absl::StrCat(
            "stablehlo.compare LE, ", *self, ", ", *thr, ", ",
            out.type->is_float ? "FLOAT" : "SIGNED", " : (",
            TypeOf(out.dims, *out.type), ", ", TypeOf(out.dims, *out.type),
            ") -> ", TypeOf(out.dims, pred)));
        return l.Emit(absl::StrCat("stablehlo.select ", c, ", ",
                                   l.Constant(0, out.dims, *out.type), ", ",
                                   *grad, " : ", TypeOf(out.dims, pred), ", ",
                                   TypeOf(out.dims, *out.type)));
      });
  for (bool log : {true, false}) {
    reg.Add(
        log ? "aten::_log_softmax" : "aten::_softmax",
        [log](Lowering& l, const tpu::DecodedOp& d,
              const Target& o) -> absl::StatusOr<std::string> {
          const Args a(l);
          if (!a.Defined("self") || !a.Has("dim"))
            return Unsupported(l.op(), "arguments of a form not lowered");
          absl::StatusOr<std::string> x = l.Operand(a["self"], o.dims, *o.type);
          if (!x.ok()) return x;
          return SoftmaxOf(l, *x, o.dims, WrapDim(a["dim"].i, o.dims.size()),
                           *o.type, log);
        });
    reg.Add(log ? "aten::_log_softmax_backward_data"
                : "aten::_softmax_backward_data",
            [log](Lowering& l, const tpu::DecodedOp& d,
                  const Target& o) -> absl::StatusOr<std::string> {
              const Args a(l);
              if (!a.Defined("grad_output") || !a.Defined("output") ||
                  !a.Has("dim")) {
                return Unsupported(l.op(), "arguments of a form not lowered");
              }
              // float16 / bfloat16 in float32, rounded once, as ATen's.
              const HloType& t = o.type->bytes < 4 ? F32() : *o.type;
              absl::StatusOr<std::string> g = l.Operand(a["grad_output"],
                                                        o.dims, t),
                                          y = l.Operand(a["output"], o.dims, t);
              if (!g.ok()) return g;
              if (!y.ok()) return y;
              const std::vector<int64_t> which = {
                  WrapDim(a["dim"].i, o.dims.size())};
              const std::string zero = l.Constant(0, {}, t);
              std::string r;
              if (log) {
                const std::string sum =
                    l.Expand(l.ReduceOver(*g, o.dims, which, "add", zero, t),
                             o.dims, which, t);
                r = l.Binary(
                    "subtract", *g,
                    l.Binary("multiply", l.Unary("exponential", *y, o.dims, t),
                             sum, o.dims, t),
                    o.dims, t);
              } else {
                const std::string gy = l.Binary("multiply", *g, *y, o.dims, t);
                const std::string sum =
                    l.Expand(l.ReduceOver(gy, o.dims, which, "add", zero, t),
                             o.dims, which, t);
                r = l.Binary("multiply", *y,
                             l.Binary("subtract", *g, sum, o.dims, t), o.dims,
                             t);
              }
              return l.Convert(r, o.dims, t, *o.type);
            });
  }
  reg.Add(
      "aten::gelu",
      [](Lowering& l, const tpu::DecodedOp& d,
         const Target& o) -> absl::StatusOr<std::string> {
        const Args a(l);
        absl::StatusOr<bool> approx = TanhGelu(l, a.Find("approximate"));
        if (!approx.ok()) return approx.status();
        if (!a.Has("self")) return Unsupported(l.op(), "expects a tensor");
        absl::StatusOr<std::string> x = l.Operand(a["self"], o.dims, *o.type);
        if (!x.ok()) return x;
        if (*approx) {
          const HloType& t = *o.type;
          const std::string th = GeluTanhInner(l, *x, o.dims, t);
          return l.Binary(
              "multiply",
              l.Binary("multiply", l.Constant(0.5, o.dims, t), *x, o.dims, t),
              l.Binary("add", l.Constant(1, o.dims, t), th, o.dims, t), o.dims,
              t);
        }
        return l.Binary("multiply", *x, GeluCdf(l, *x, o.dims, *o.type), o.dims,
                        *o.type);
      });
  reg.Add(
      "aten::gelu_backward",
      [](Lowering& l, const tpu::DecodedOp& d,
         const Target& o) -> absl::StatusOr<std::string> {
        // grad * (cdf(x) + x * pdf(x))
        const Args a(l);
        absl::StatusOr<bool> approx = TanhGelu(l, a.Find("approximate"));
        if (!approx.ok()) return approx.status();
        if (!a.Has("grad_output") || !a.Has("self"))
          return Unsupported(l.op(), "arguments of a form not lowered");
        const HloType& t = *o.type;
        absl::StatusOr<std::string> g = l.Operand(a["grad_output"], o.dims, t),
                                    x = l.Operand(a["self"], o.dims, t);
        if (!g.ok()) return g;
        if (!x.ok()) return x;
        if (*approx) {
          // 0.5 (1 + th) + 0.5 x (1 - th^2) sqrt(2 / pi) (1 + 3 * 0.044715 x^2)
          const std::string th = GeluTanhInner(l, *x, o.dims, t);
          const std::string x2 = l.Binary("multiply", *x, *x, o.dims, t);
          const std::string du = l.Binary(
              "multiply", l.Constant(0.79788456080286536, o.dims, t),
              l.Binary("add", l.Constant(1, o.dims, t),
                       l.Binary("multiply", l.Constant(0.134145, o.dims, t), x2,
                                o.dims, t),
                       o.dims, t),
              o.dims, t);
          const std::string sech2 =
              l.Binary("subtract", l.Constant(1, o.dims, t),
                       l.Binary("multiply", th, th, o.dims, t), o.dims, t);
          const std::string dd = l.Binary(
              "add",
              l.Binary("multiply", l.Constant(0.5, o.dims, t),
                       l.Binary("add", l.Constant(1, o.dims, t), th, o.dims, t),
                       o.dims, t),
              l.Binary("multiply",
                       l.Binary("multiply", l.Constant(0.5, o.dims, t), *x,
                                o.dims, t),
                       l.Binary("multiply", sech2, du, o.dims, t), o.dims, t),
              o.dims, t);
          return l.Binary("multiply", *g, dd, o.dims, t);
        }
        const std::string x2 = l.Binary("multiply", *x, *x, o.dims, t);
        const std::string pdf =
            l.Binary("multiply", l.Constant(0.39894228040143268, o.dims, t),
                     l.Unary("exponential",
                             l.Binary("multiply", x2,
                                      l.Constant(-0.5, o.dims, t), o.dims, t),
                             o.dims, t),
                     o.dims, t);
        const std::string dd =
            l.Binary("add", GeluCdf(l, *x, o.dims, t),
                     l.Binary("multiply", *x, pdf, o.dims, t), o.dims, t);
        return l.Binary("multiply", *g, dd, o.dims, t);
      });
  reg.Alias("aten::gelu_backward.grad_input", "aten::gelu_backward");
  reg.Add(
      "aten::leaky_relu",
      [](Lowering& l, const tpu::DecodedOp& d,
         const Target& o) -> absl::StatusOr<std::string> {
        const Args a(l);
        if (!a.Has("self")) return Unsupported(l.op(), "expects a tensor");
        const HloType& t = *o.type;
        absl::StatusOr<std::string> x = l.Operand(a["self"], o.dims, t);
        if (!x.ok()) return x;
        const double slope = a.Number("negative_slope", 0.01);
        return l.Select(
            l.Compare("GT", *x, l.Constant(0, o.dims, t), o.dims, t), *x,
            l.Binary("multiply", *x, l.Constant(slope, o.dims, t), o.dims, t),
            o.dims, t);
      });
  reg.Add(
      "aten::elu",
      [](Lowering& l, const tpu::DecodedOp& d,
         const Target& o) -> absl::StatusOr<std::string> {
        const Args a(l);
        if (!a.Has("self")) return Unsupported(l.op(), "expects a tensor");
        const HloType& t = *o.type;
        absl::StatusOr<std::string> x = l.Operand(a["self"], o.dims, t);
        if (!x.ok()) return x;
        const double alpha = a.Number("alpha", 1), scale = a.Number("scale", 1),
                     in_scale = a.Number("input_scale", 1);
        const std::string neg = l.Binary(
            "multiply", l.Constant(alpha, o.dims, t),
            l.Unary("exponential_minus_one",
                    l.Binary("multiply", *x, l.Constant(in_scale, o.dims, t),
                             o.dims, t),
                    o.dims, t),
            o.dims, t);
        const std::string r =
            l.Select(l.Compare("GT", *x, l.Constant(0, o.dims, t), o.dims, t),
                     *x, neg, o.dims, t);
        return l.Binary("multiply", r, l.Constant(scale, o.dims, t), o.dims, t);
      });
  // Backward of sigmoid and tanh from their output y: grad * y * (1 - y),
  // grad * (1 - y * y), the derivative conjugated for complex y (ATen's
  // convention for holomorphic functions).
  for (bool sig : {true, false}) {
    reg.Add(sig ? "aten::sigmoid_backward" : "aten::tanh_backward",
            [sig](Lowering& l, const tpu::DecodedOp& d,
                  const Target& o) -> absl::StatusOr<std::string> {
              const Args a(l);
              if (!a.Has("grad_output") || !a.Has("output"))
                return Unsupported(l.op(), "arguments of a form not lowered");
              const HloType& t = *o.type;
              absl::StatusOr<std::string> g = l.Operand(a["grad_output"],
                                                        o.dims, t),
                                          y = l.Operand(a["output"], o.dims, t);
              if (!g.ok()) return g;
              if (!y.ok()) return y;
              const std::string one = l.Constant(1, o.dims, t);
              const std::string dy =
                  sig ? l.Binary("multiply", *y,
                                 l.Binary("subtract", one, *y, o.dims, t),
                                 o.dims, t)
                      : l.Binary("subtract", one,
                                 l.Binary("multiply", *y, *y, o.dims, t),
                                 o.dims, t);
              return l.Binary("multiply", *g, Conj(l, dy, o.dims, t), o.dims,
                              t);
            });
  }
  reg.Alias("aten::sigmoid_backward.grad_input", "aten::sigmoid_backward");
  reg.Alias("aten::tanh_backward.grad_input", "aten::tanh_backward");
  // softplus(self, beta, threshold): linear above the threshold.
  reg.Add(
      "aten::softplus",
      [](Lowering& l, const tpu::DecodedOp& d,
         const Target& o) -> absl::StatusOr<std::string> {
        const Args a(l);
        if (!a.Has("self")) return Unsupported(l.op(), "expects a tensor");
        const HloType& t = *o.type;
        absl::StatusOr<std::string> x = l.Operand(a["self"], o.dims, t);
        if (!x.ok()) return x;
        const double beta = a.Number("beta", 1),
                     threshold = a.Number("threshold", 20);
        const std::string bx =
            l.Binary("multiply", *x, l.Constant(beta, o.dims, t), o.dims, t);
        const std::string soft =
            l.Binary("divide",
                     l.Unary("log_plus_one",
                             l.Unary("exponential", bx, o.dims, t), o.dims, t),
                     l.Constant(beta, o.dims, t), o.dims, t);
        return l.Select(
            l.Compare("GT", bx, l.Constant(threshold, o.dims, t), o.dims, t),
            *x, soft, o.dims, t);
      });
  // out= overloads whose names are not the derived ones (the out tensor
  // is the written argument, after the others).
  reg.Alias("aten::threshold_backward.grad_input", "aten::threshold_backward");
  // softshrink_backward / hardshrink_backward(grad, self, lambd): the
  // gradient where |self| > lambd, zero inside [-lambd, lambd].
  for (const char* name : {"softshrink", "hardshrink"}) {
    const std::string op = absl::StrCat("aten::", name, "_backward");
    const char* grad = name[0] == 's' ? "grad_output" : "grad_out";
    reg.Add(op,
            [grad](Lowering& l, const tpu::DecodedOp& d,
                   const Target& o) -> absl::StatusOr<std::string> {
              const Args a(l);
              if (!a.Defined(grad) || !a.Defined("self") || !a.Has("lambd"))
                return Unsupported(l.op(), "arguments of a form not lowered");
              const HloType& t = *o.type;
              absl::StatusOr<std::string> g = l.Operand(a[grad], o.dims, t),
                                          x = l.Operand(a["self"], o.dims, t);
              if (!g.ok()) return g;
              if (!x.ok()) return x;
              absl::StatusOr<std::string> lam =
                  l.Operand(a["lambd"], o.dims, t);
              if (!lam.ok()) return lam;
              const std::string inside = l.Binary(
                  "and",
                  l.Compare("GE", *x, l.Unary("negate", *lam, o.dims, t),
                            o.dims, t),
                  l.Compare("LE", *x, *lam, o.dims, t), o.dims,
                  *DTypeOf(tpu::DType::kBool));
              return l.Select(inside, l.Constant(0, o.dims, t), *g, o.dims, t);
            });
    reg.Alias(absl::StrCat(op, ".grad_input"), op);
  }
}

}  // namespace tpud::pjrt
