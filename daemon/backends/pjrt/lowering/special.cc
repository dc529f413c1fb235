// Special functions from XLA's CHLO dialect (which StableHLO consumers
// accept beside StableHLO: lgamma, digamma, polygamma, zeta, erf_inv, erfc,
// next_after, bessel_i1e), NaN-aware binaries built from comparisons, and
// the spherical Bessel function j0.
#include "daemon/backends/pjrt/lowering/special.h"

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

namespace {

// Cephes's Chebyshev series for exp(-|x|) I0(|x|): on [0, 8] in x / 2 - 2,
// and for exp(-x) sqrt(x) I0(x) on (8, inf) in 32 / x - 2 (the tables ATen
// and NumPy evaluate too).
constexpr double kI0eA[] = {
    -4.41534164647933937950E-18, 3.33079451882223809783E-17,
    -2.43127984654795469359E-16, 1.71539128555513303061E-15,
    -1.16853328779934516808E-14, 7.67618549860493561688E-14,
    -4.85644678311192946090E-13, 2.95505266312963983461E-12,
    -1.72682629144155570723E-11, 9.67580903537323691224E-11,
    -5.18979560163526290666E-10, 2.65982372468238665035E-9,
    -1.30002500998624804212E-8,  6.04699502254191894932E-8,
    -2.67079385394061173391E-7,  1.11738753912010371815E-6,
    -4.41673835845875056359E-6,  1.64484480707288970893E-5,
    -5.75419501008210370398E-5,  1.88502885095841655729E-4,
    -5.76375574538582365885E-4,  1.63947561694133579842E-3,
    -4.32430999505057594430E-3,  1.05464603945949983183E-2,
    -2.37374148058994688156E-2,  4.93052842396707084878E-2,
    -9.49010970480476444210E-2,  1.71620901522208775349E-1,
    -3.04682672343198398683E-1,  6.76795274409476084995E-1};
constexpr double kI0eB[] = {
    -7.23318048787475395456E-18, -4.83050448594418207126E-18,
    4.46562142029675999901E-17,  3.46122286769746109310E-17,
    -2.82762398051658348494E-16, -3.42548561967721913462E-16,
    1.77256013305652638360E-15,  3.81168066935262242075E-15,
    -9.55484669882830764870E-15, -4.15056934728722208663E-14,
    1.54008621752140982691E-14,  3.85277838274214270114E-13,
    7.18012445138366623367E-13,  -1.79417853150680611778E-12,
    -1.32158118404477131188E-11, -3.14991652796324136454E-11,
    1.18891471078464383424E-11,  4.94060238822496958910E-10,
    3.39623202570838634515E-9,   2.26666899049817806459E-8,
    2.04891858946906374183E-7,   2.89137052083475648297E-6,
    6.88975834691682398426E-5,   3.36911647825569408990E-3,
    8.04490411014108831608E-1};

}  // namespace

// exp(-|x|) I0(x), x of type t (float64).
std::string I0e(Lowering& l, const std::string& x,
                const std::vector<int64_t>& d, const HloType& t) {
  auto c = [&](double v) { return l.Constant(v, d, t); };
  const std::string ax = l.Unary("abs", x, d, t);
  const std::string near = Chebyshev(
      l,
      l.Binary("subtract", l.Binary("multiply", ax, c(0.5), d, t), c(2), d, t),
      kI0eA, d, t);
  const std::string far = l.Binary(
      "divide",
      Chebyshev(
          l,
          l.Binary("subtract", l.Binary("divide", c(32), ax, d, t), c(2), d, t),
          kI0eB, d, t),
      l.Unary("sqrt", ax, d, t), d, t);
  return l.Select(l.Compare("LE", ax, c(8), d, t), near, far, d, t);
}

// CHLO's op `op` of operands xs, all (and the result) of dims d and type t.
std::string Chlo(Lowering& l, const char* op,
                 const std::vector<std::string>& xs,
                 const std::vector<int64_t>& d, const HloType& t) {
  std::vector<std::string> types(xs.size(), TypeOf(d, t));
  return l.Emit(absl::StrCat("\"chlo.", op, "\"(", absl::StrJoin(xs, ", "),
                             ") : (", absl::StrJoin(types, ", "), ") -> ",
                             TypeOf(d, t)));
}

namespace {

// psi_1(x) as ATen computes it, in float32 for the floating types below
// float64 (which is what CUDA returns too): the reflection psi_1(x) =
// pi^2 / sin^2(pi x) - psi_1(1 - x) below 1/2, six steps of the recurrence
// psi_1(x) = 1 / x^2 + psi_1(x + 1), then the asymptotic series.
std::string Trigamma(Lowering& l, const std::string& x_in,
                     const std::vector<int64_t>& d, const HloType& t) {
  const HloType& c = t.dtype == tpu::DType::kDouble ? F64() : F32();
  const auto k = [&](double v) { return l.Constant(v, d, c); };
  const auto add = [&](const std::string& a, const std::string& b) {
    return l.Binary("add", a, b, d, c);
  };
  const auto sub = [&](const std::string& a, const std::string& b) {
    return l.Binary("subtract", a, b, d, c);
  };
  const auto mul = [&](const std::string& a, const std::string& b) {
    return l.Binary("multiply", a, b, d, c);
  };
  const auto div = [&](const std::string& a, const std::string& b) {
    return l.Binary("divide", a, b, d, c);
  };
  const std::string x0 = &c == &t ? x_in : l.Convert(x_in, d, t, c);
  // (pi rounded to the computing type first, as ATen's c10::pi<T>.)
  const double pi = c.dtype == tpu::DType::kDouble
                        ? 3.14159265358979323846
                        : static_cast<double>(3.14159265358979323846f);
  const std::string reflect = l.Compare("LT", x0, k(0.5), d, c);
  const std::string s = l.Unary("sine", mul(k(pi), x0), d, c);
  const std::string pole = div(mul(k(pi), k(pi)), mul(s, s));
  std::string result =
      l.Select(reflect, l.Unary("negate", pole, d, c), k(0), d, c);
  std::string x = l.Select(reflect, sub(k(1), x0), x0, d, c);
  for (int i = 0; i < 6; ++i) {
    result = add(result, div(k(1), mul(x, x)));
    x = add(x, k(1));
  }
  const std::string ixx = div(k(1), mul(x, x));
  const std::string tail = add(
      add(k(1), div(k(1), mul(k(2), x))),
      mul(ixx,
          sub(k(1.0 / 6), mul(ixx, sub(k(1.0 / 30), mul(ixx, k(1.0 / 42)))))));
  result = add(result, div(tail, x));
  result = l.Select(reflect, l.Unary("negate", result, d, c), result, d, c);
  return &c == &t ? result : l.Convert(result, d, c, t);
}

}  // namespace

Rule InFloat64(F64Fn f) {
  return UnaryRule([f](Lowering& l, const std::string& x, const Target& o) {
    const HloType& t = *o.type;
    const HloType& w = F64();
    if (t.dtype == tpu::DType::kDouble) return f(l, x, o.dims, w);
    return l.Convert(f(l, l.Convert(x, o.dims, t, w), o.dims, w), o.dims, w, t);
  });
}

void RegisterSpecial(OpRegistry& reg) {
  auto chlo = [](Lowering& l, const char* op,
                 const std::vector<std::string>& xs,
                 const Target& o) { return Chlo(l, op, xs, o.dims, *o.type); };
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
  // zeta(x, q): the Hurwitz zeta function, CHLO's operand order too, with
  // ATen's edge rules: x < 1 is NaN, and a pole (q a non-positive integer)
  // +inf for x > 1, where CHLO gives +inf for the one and NaN for some of
  // the other (zeta(3, -2)).
  binary("aten::special_zeta", [chlo](Lowering& l, const std::string& x,
                                      const std::string& q, const Target& o) {
    const HloType& t = *o.type;
    const HloType& i1 = *DTypeOf(tpu::DType::kBool);
    auto c = [&](double v) { return l.Constant(v, o.dims, t); };
    const std::string pole =
        l.Binary("and", l.Compare("LE", q, c(0), o.dims, t),
                 l.Compare("EQ", q, l.Unary("floor", q, o.dims, t), o.dims, t),
                 o.dims, i1);
    const std::string r = l.Select(
        l.Binary("and", pole, l.Compare("GT", x, c(1), o.dims, t), o.dims, i1),
        l.Binary("divide", c(1), c(0), o.dims, t), chlo(l, "zeta", {x, q}, o),
        o.dims, t);
    return l.Select(l.Compare("LT", x, c(1), o.dims, t),
                    l.Binary("divide", c(0), c(0), o.dims, t), r, o.dims, t);
  });
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
        if (n == 1) return Trigamma(l, *x, o.dims, *o.type);
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
  // The modified Bessel functions of order 0 and 1 (and their exponentially
  // scaled forms), in float64: I0 from Cephes's series, I1 from CHLO's
  // i1e; exp(|x|) brings the scaled ones back (overflowing to inf where
  // they do).
  auto i0e = [](Lowering& l, const std::string& x,
                const std::vector<int64_t>& d,
                const HloType& t) { return I0e(l, x, d, t); };
  auto i0 = [](Lowering& l, const std::string& x, const std::vector<int64_t>& d,
               const HloType& t) {
    return l.Binary("multiply",
                    l.Unary("exponential", l.Unary("abs", x, d, t), d, t),
                    I0e(l, x, d, t), d, t);
  };
  auto i1 = [](Lowering& l, const std::string& x, const std::vector<int64_t>& d,
               const HloType& t) {
    const std::string i1e = Chlo(l, "bessel_i1e", {x}, d, t);
    return l.Binary("multiply",
                    l.Unary("exponential", l.Unary("abs", x, d, t), d, t), i1e,
                    d, t);
  };
  reg.Add("aten::special_i0e", InFloat64(i0e));
  reg.Add("aten::i0", InFloat64(i0));
  reg.Add("aten::special_modified_bessel_i0", InFloat64(i0));
  reg.Add("aten::special_i1", InFloat64(i1));
  reg.Add("aten::special_modified_bessel_i1", InFloat64(i1));
  // ndtri(p) = sqrt(2) erfinv(2p - 1), in float64 so that 2p - 1 keeps p's
  // digits near 0 and 1: -inf at 0, inf at 1, NaN outside [0, 1].
  reg.Add("aten::special_ndtri",
          InFloat64([](Lowering& l, const std::string& p,
                       const std::vector<int64_t>& d, const HloType& t) {
            const std::string y = l.Binary(
                "subtract", l.Binary("multiply", p, l.Constant(2, d, t), d, t),
                l.Constant(1, d, t), d, t);
            const std::string e = Chlo(l, "erf_inv", {y}, d, t);
            return l.Binary("multiply", l.Constant(std::sqrt(2.0), d, t), e, d,
                            t);
          }));
  // erfcx(x) = exp(x^2) erfc(x), in float64: as it is below 26, and by its
  // asymptotic series 1 / (x sqrt(pi)) (1 - 1/(2x^2) + 3/(4x^4) - 15/(8x^6))
  // above, where erfc underflows (0 at +inf; inf towards -inf, as ATen).
  reg.Add(
      "aten::special_erfcx",
      InFloat64([](Lowering& l, const std::string& x,
                   const std::vector<int64_t>& d, const HloType& t) {
        auto c = [&](double v) { return l.Constant(v, d, t); };
        const std::string x2 = l.Binary("multiply", x, x, d, t);
        const std::string erfc = Chlo(l, "erfc", {x}, d, t);
        const std::string direct =
            l.Binary("multiply", l.Unary("exponential", x2, d, t), erfc, d, t);
        const std::string r = l.Binary("divide", c(1), x2, d, t);  // 1 / x^2
        std::string series = c(-15.0 / 8);
        for (double k : {3.0 / 4, -1.0 / 2, 1.0})
          series = l.Binary("add", l.Binary("multiply", series, r, d, t), c(k),
                            d, t);
        const std::string far =
            l.Binary("divide", series,
                     l.Binary("multiply", x, c(std::sqrt(M_PI)), d, t), d, t);
        return l.Select(l.Compare("LT", x, c(26), d, t), direct, far, d, t);
      }));
}

}  // namespace tpud::pjrt
