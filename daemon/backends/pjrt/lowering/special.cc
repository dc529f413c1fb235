// Special functions from XLA's CHLO dialect (which StableHLO consumers
// accept beside StableHLO: lgamma, digamma, polygamma, zeta, erf_inv, erfc,
// next_after, bessel_i1e), NaN-aware binaries built from comparisons, and
// the spherical Bessel function j0.
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

void RegisterSpecial(OpRegistry& reg) {
  auto chlo = [](Lowering& l, const char* op,
                 const std::vector<std::string>& xs, const Target& o) {
    std::vector<std::string> types(xs.size(), TypeOf(o.dims, *o.type));
    return l.Emit(absl::StrCat("\"chlo.", op, "\"(", absl::StrJoin(xs, ", "),
                               ") : (", absl::StrJoin(types, ", "), ") -> ",
                               TypeOf(o.dims, *o.type)));
  };
  for (const auto& [name, op] :
       std::vector<std::pair<std::string, const char*>>{
           {"lgamma", "lgamma"},
           {"erfinv", "erf_inv"},
           {"erfc", "erfc"},
           {"special_i1e", "bessel_i1e"}}) {
    const char* f = op;
    reg.Add("aten::" + name,
            UnaryRule([=](Lowering& l, const std::string& x, const Target& o) {
              return chlo(l, f, {x}, o);
            }));
  }
  // digamma has poles at 0 and the negative integers: at 0 it is -inf
  // from above and +inf from below, as in ATen (-1/x gives that sign).
  auto digamma = [chlo](Lowering& l, const std::string& x, const Target& o) {
    const HloType& t = *o.type;
    const std::string pole =
        l.Binary("divide", l.Constant(-1, o.dims, t), x, o.dims, t);
    return l.Select(l.Compare("EQ", x, l.Constant(0, o.dims, t), o.dims, t),
                    pole, chlo(l, "digamma", {x}, o), o.dims, t);
  };
  reg.Add("aten::digamma", UnaryRule(digamma));
  // Two operands of the output's type, then f(a, b).
  using F2 = std::function<std::string(Lowering&, const std::string&,
                                       const std::string&, const Target&)>;
  auto binary = [&reg](const std::string& name, F2 f) {
    reg.Add(name,
            [f](Lowering& l, const tpu::DecodedOp&,
                const Target& o) -> absl::StatusOr<std::string> {
              const Args args(l);
              if (!args.Has("self") || !args.Has("other"))
                return Unsupported(l.op(), "too few arguments");
              absl::StatusOr<std::string> a =
                  l.Operand(args["self"], o.dims, *o.type);
              if (!a.ok()) return a;
              absl::StatusOr<std::string> b =
                  l.Operand(args["other"], o.dims, *o.type);
              if (!b.ok()) return b;
              return f(l, *a, *b, o);
            });
  };
  auto chlo2 = [chlo](const char* op) {
    return [=](Lowering& l, const std::string& a, const std::string& b,
               const Target& o) {
      return chlo(l, op, {a, b}, o);
    };
  };
  binary("aten::nextafter", chlo2("next_after"));
  // zeta(x, q): the Hurwitz zeta function, CHLO's operand order too.
  binary("aten::special_zeta", chlo2("zeta"));
  // polygamma(n, self): n is an int argument, a tensor of the output's
  // type for CHLO.
  reg.Add(
      "aten::polygamma",
      [=](Lowering& l, const tpu::DecodedOp&,
          const Target& o) -> absl::StatusOr<std::string> {
        const Args args(l);
        if (!args.Has("n") || !args.Defined("self"))
          return Unsupported(l.op(), "expects (int n, Tensor self)");
        absl::StatusOr<std::string> x =
            l.Operand(args["self"], o.dims, *o.type);
        if (!x.ok()) return x;
        const int64_t n = static_cast<int64_t>(args.Number("n", 0));
        if (n < 0)
          return absl::InvalidArgumentError(absl::StrCat(
              l.op(), ": n is ", n, "; polygamma(n, x) takes n >= 0"));
        if (n == 0) return digamma(l, *x, o);
        // CHLO's polygamma is inexact for x < 0, so it is taken at x + K and
        // brought back by the recurrence psi_n(x) = psi_n(x + 1) - (-1)^n n! /
        // x^(n+1) (exact for x >= -K; ATen shifts its zeta function the same
        // way).
        const HloType& t = *o.type;
        constexpr int kShift = 16;
        double factorial = 1;
        for (int64_t k = 2; k <= n; ++k) factorial *= static_cast<double>(k);
        const std::string shifted =
            l.Binary("add", *x, l.Constant(kShift, o.dims, t), o.dims, t);
        // The terms in float64: near a pole, x + j loses the digits that
        // matter.
        const HloType& w = F64();
        const std::string xw =
            t.dtype == tpu::DType::kDouble ? *x : l.Convert(*x, o.dims, t, w);
        std::string sum = l.Constant(0, o.dims, w);
        const std::string power =
            l.Constant(static_cast<double>(-(n + 1)), o.dims, w);
        for (int j = 0; j < kShift; ++j) {
          const std::string xj =
              j == 0 ? xw
                     : l.Binary("add", xw, l.Constant(j, o.dims, w), o.dims, w);
          sum = l.Binary("add", sum, l.Binary("power", xj, power, o.dims, w),
                         o.dims, w);
        }
        if (t.dtype != tpu::DType::kDouble) sum = l.Convert(sum, o.dims, w, t);
        const std::string far =
            chlo(l, "polygamma",
                 {l.Constant(static_cast<double>(n), o.dims, t), shifted}, o);
        const double sign = n % 2 == 0 ? 1 : -1;
        return l.Binary(
            "subtract", far,
            l.Binary("multiply", l.Constant(sign * factorial, o.dims, t), sum,
                     o.dims, t),
            o.dims, t);
      });
  binary("aten::hypot", [](Lowering& l, const std::string& a,
                           const std::string& b, const Target& o) {
    const HloType& t = *o.type;
    // max * sqrt(1 + (min/max)^2), without overflow; 0 where both are.
    const std::string x = l.Unary("abs", a, o.dims, t),
                      y = l.Unary("abs", b, o.dims, t);
    const std::string hi = l.Binary("maximum", x, y, o.dims, t),
                      lo = l.Binary("minimum", x, y, o.dims, t);
    const std::string zero = l.Constant(0, o.dims, t);
    const std::string q =
        l.Select(l.Compare("EQ", hi, zero, o.dims, t), zero,
                 l.Binary("divide", lo, hi, o.dims, t), o.dims, t);
    const std::string r = l.Binary(
        "multiply", hi,
        l.Unary("sqrt",
                l.Binary("add", l.Constant(1, o.dims, t),
                         l.Binary("multiply", q, q, o.dims, t), o.dims, t),
                o.dims, t),
        o.dims, t);
    // An infinite side makes it infinite, even beside a NaN.
    const std::string inf =
        l.Binary("divide", l.Constant(1, o.dims, t), zero, o.dims, t);
    const std::string any_inf =
        l.Binary("or", l.Compare("EQ", x, inf, o.dims, t),
                 l.Compare("EQ", y, inf, o.dims, t), o.dims,
                 *DTypeOf(tpu::DType::kBool));
    return l.Select(any_inf, inf, r, o.dims, t);
  });
  // fmax/fmin: the other operand where one is NaN.
  for (bool max : {true, false}) {
    binary(max ? "aten::fmax" : "aten::fmin",
           [max](Lowering& l, const std::string& a, const std::string& b,
                 const Target& o) {
             const HloType& t = *o.type;
             const std::string r =
                 l.Binary(max ? "maximum" : "minimum", a, b, o.dims, t);
             if (!t.is_float) return r;
             return l.Select(
                 l.Compare("NE", a, a, o.dims, t), b,
                 l.Select(l.Compare("NE", b, b, o.dims, t), a, r, o.dims, t),
                 o.dims, t);
           });
  }
  // special_spherical_bessel_j0: sin(x) / x, by its series below 0.5,
  // 0 at infinity (as ATen).
  reg.Add(
      "aten::special_spherical_bessel_j0",
      [](Lowering& l, const tpu::DecodedOp&,
         const Target& o) -> absl::StatusOr<std::string> {
        const Args args(l);
        if (!args.Has("x")) return Unsupported(l.op(), "expects a tensor");
        const HloType& t = *o.type;
        const std::vector<int64_t>& dims = o.dims;
        absl::StatusOr<std::string> xs = l.Operand(args["x"], dims, t);
        if (!xs.ok()) return xs;
        const std::string x = *xs, x2 = l.Binary("multiply", x, x, dims, t);
        const double coef[] = {1.0 / 6227020800.0, -1.0 / 39916800.0,
                               1.0 / 362880.0,     -1.0 / 5040.0,
                               1.0 / 120.0,        -1.0 / 6.0};
        std::string series = l.Constant(coef[0], dims, t);
        for (int q = 1; q < 6; ++q)
          series = l.Binary("add", l.Constant(coef[q], dims, t),
                            l.Binary("multiply", x2, series, dims, t), dims, t);
        series = l.Binary("add", l.Constant(1, dims, t),
                          l.Binary("multiply", x2, series, dims, t), dims, t);
        const std::string ratio =
            l.Binary("divide", l.Unary("sine", x, dims, t), x, dims, t);
        const std::string ax = l.Unary("abs", x, dims, t);
        std::string r =
            l.Select(l.Compare("LT", ax, l.Constant(0.5, dims, t), dims, t),
                     series, ratio, dims, t);
        const std::string inf = l.Compare(
            "EQ", ax, l.BroadcastTo(Highest(l, t), {}, dims, t), dims, t);
        return l.Select(inf, l.Constant(0, dims, t), r, dims, t);
      });
}

}  // namespace tpud::pjrt
