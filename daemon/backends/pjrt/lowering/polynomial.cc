// The orthogonal polynomials of torch.special (Chebyshev T, U, V, W and
// their shifted forms, Hermite H and He, Laguerre, Legendre) at x, of
// degree n (truncated to an integer), as ATen computes them: its special
// cases first (n < 0, the ends of the interval, the trigonometric forms
// for large n inside it, degrees 0 and 1), else the three-term recurrence
// P_m = (a_m(x) P_{m-1} - b_m P_{m-2}) / c_m from P_0 = 1, P_1, run by a
// while loop up to the largest degree that needs it (an element stops at
// its own degree, and the loop stops once every element it still runs is
// NaN).
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

enum class Poly {
  kT,
  kU,
  kV,
  kW,
  kShiftedT,
  kShiftedU,
  kShiftedV,
  kShiftedW,
  kH,
  kHe,
  kL,
  kP
};

Rule PolynomialRule(Poly kind) {
  return [kind](Lowering& l, const tpu::DecodedOp&,
                const Target& o) -> absl::StatusOr<std::string> {
    const Args args(l);
    if (!args.Has("x") || !args.Has("n"))
      return Unsupported(l.op(), "expects x and n");
    const HloType& t = *o.type;
    const HloType& i64 = I64();
    const HloType& i1 = *DTypeOf(tpu::DType::kBool);
    const std::vector<int64_t>& dims = o.dims;
    absl::StatusOr<std::string> xs = l.Operand(args["x"], dims, t),
                                ns = l.Operand(args["n"], dims, i64);
    if (!xs.ok()) return xs;
    if (!ns.ok()) return ns;
    const std::string x = *xs;
    std::string n = *ns;
    auto c = [&](double v) { return l.Constant(v, dims, t); };
    auto ci = [&](double v) { return l.Constant(v, dims, i64); };
    auto add = [&](const std::string& a, const std::string& b) {
      return l.Binary("add", a, b, dims, t);
    };
    auto sub = [&](const std::string& a, const std::string& b) {
      return l.Binary("subtract", a, b, dims, t);
    };
    auto mul = [&](const std::string& a, const std::string& b) {
      return l.Binary("multiply", a, b, dims, t);
    };
    auto div = [&](const std::string& a, const std::string& b) {
      return l.Binary("divide", a, b, dims, t);
    };
    auto un = [&](const char* op, const std::string& a) {
      return l.Unary(op, a, dims, t);
    };
    auto cmp = [&](const char* dir, const std::string& a,
                   const std::string& b) {
      return l.Compare(dir, a, b, dims, t);
    };
    auto cmpi = [&](const char* dir, const std::string& a, double b) {
      return l.Compare(dir, a, ci(b), dims, i64);
    };
    auto both = [&](const std::string& a, const std::string& b) {
      return l.Binary("and", a, b, dims, i1);
    };
    auto sel = [&](const std::string& p, const std::string& a,
                   const std::string& b) { return l.Select(p, a, b, dims, t); };
    auto acos =
        [&](const std::string& a) {  // acos(a) = atan2(sqrt(1 - a^2), a)
          return l.Binary("atan2", un("sqrt", sub(c(1), mul(a, a))), a, dims,
                          t);
        };
    if (kind == Poly::kH && args.Defined("n") &&
        tpu::IsFloating(tpu::DTypeFromCode(args["n"].tensor.dtype))) {
      // A NaN or infinite degree counts as -1.
      absl::StatusOr<std::string> nf = l.Operand(args["n"], dims, t);
      if (!nf.ok()) return nf;
      const std::string finite =
          l.Emit(absl::StrCat("stablehlo.is_finite ", *nf, " : (",
                              TypeOf(dims, t), ") -> ", TypeOf(dims, i1)));
      n = l.Select(finite, n, ci(-1), dims, i64);
    }
    const std::string nt = l.Convert(n, dims, i64, t);
    const std::string even = l.Compare(
        "EQ", l.Binary("remainder", n, ci(2), dims, i64), ci(0), dims, i64);
    const bool shifted = kind == Poly::kShiftedT || kind == Poly::kShiftedU ||
                         kind == Poly::kShiftedV || kind == Poly::kShiftedW;
    const bool chebyshev = kind <= Poly::kShiftedW;
    // y: the argument of the Chebyshev forms (2x - 1 when shifted).
    const std::string y = shifted ? sub(add(x, x), c(1)) : x;
    const std::string two_y = add(y, y);
    std::string p1;
    switch (kind) {
      case Poly::kT:
      case Poly::kShiftedT:
      case Poly::kP:
      case Poly::kHe:
        p1 = y;
        break;
      case Poly::kU:
      case Poly::kShiftedU:
      case Poly::kH:
        p1 = two_y;
        break;
      case Poly::kV:
      case Poly::kShiftedV:
        p1 = sub(two_y, c(1));
        break;
      case Poly::kW:
      case Poly::kShiftedW:
        p1 = add(two_y, c(1));
        break;
      case Poly::kL:
        p1 = sub(c(1), x);
        break;
    }
    const std::string two_n1 = add(add(nt, nt), c(1));  // 2n + 1
    const std::string sign_even = sel(even, c(1), c(-1));
    // Special cases in ATen's order: `cases` from the first that applies.
    std::vector<std::pair<std::string, std::string>> cases;
    cases.emplace_back(cmpi("LT", n, 0), c(0));
    const std::string ax = un("abs", x);
    if (chebyshev) {
      // The ends: |x| = 1 (x = 1 and x = 0 when shifted).
      const std::string hi =
          shifted ? cmp("EQ", x, c(1))
                  : both(cmp("EQ", ax, c(1)), cmp("GT", x, c(0)));
      const std::string lo =
          shifted ? cmp("EQ", x, c(0))
                  : both(cmp("EQ", ax, c(1)), cmp("LE", x, c(0)));
      const std::string n1 = add(nt, c(1));
      const bool tk = kind == Poly::kT || kind == Poly::kShiftedT,
                 uk = kind == Poly::kU || kind == Poly::kShiftedU;
      const bool vk = kind == Poly::kV || kind == Poly::kShiftedV;
      const std::string at_hi = tk ? c(1) : uk ? n1 : vk ? c(1) : two_n1;
      const std::string at_lo = tk   ? sign_even
                                : uk ? mul(n1, sign_even)
                                : vk ? mul(two_n1, sign_even)
                                     : sign_even;
      cases.emplace_back(hi, at_hi);
      cases.emplace_back(lo, at_lo);
      const int limit = tk        ? 6
                        : shifted ? (kind == Poly::kShiftedW ? 4 : 6)
                                  : 8;
      const std::string inside =
          both(cmpi("GT", n, limit), cmp("LT", un("abs", y), c(1)));
      const std::string th = acos(y);
      std::string trig;
      if (tk) {
        trig = un("cosine", mul(nt, th));
      } else if (uk) {
        const std::string st = un("sine", th);
        trig = sel(cmp("NE", st, c(0)), div(un("sine", mul(n1, th)), st),
                   div(mul(n1, un("cosine", mul(n1, th))), y));
      } else {
        const std::string half = div(th, c(2)), nh = mul(add(nt, c(0.5)), th);
        if (vk) {
          trig = sel(cmp("NE", un("sine", half), c(1)),
                     div(un("cosine", nh), un("cosine", half)),
                     mul(two_n1, sign_even));
        } else {
          const std::string w_end =
              shifted ? sign_even : sel(cmp("GT", x, c(0)), two_n1, sign_even);
          trig = sel(cmp("NE", un("cosine", half), c(1)),
                     div(un("sine", nh), un("sine", half)), w_end);
        }
      }
      cases.emplace_back(inside, trig);
    } else if (kind == Poly::kH || kind == Poly::kHe) {
      const int limit = t.dtype == tpu::DType::kDouble ? 512 : 128;
      cases.emplace_back(both(cmpi("GT", n, limit), cmpi("GE", n, 2)),
                         div(c(0), c(0)));  // NaN
    } else if (kind == Poly::kL) {
      cases.emplace_back(cmp("EQ", ax, c(0)), c(1));
    } else {
      cases.emplace_back(cmp("EQ", ax, c(1)), sign_even);
      // (x > 0 or n even: 1; else -1.)
      cases.back().second = sel(cmp("GT", x, c(0)), c(1), sign_even);
    }
    cases.emplace_back(cmpi("EQ", n, 0), c(1));
    cases.emplace_back(cmpi("EQ", n, 1), p1);
    // The degrees the recurrence runs to: 0 where a special case answers.
    std::string special = l.Constant(0, dims, i1);
    for (const auto& [when, value] : cases)
      special = l.Binary("or", special, when, dims, i1);
    const std::string degree = l.Select(special, ci(0), n, dims, i64);
    const std::string top =
        l.ReduceOver(degree, dims, Range(dims.size()), "maximum",
                     l.Constant(0, {}, i64), i64);
    // The loop: (m, p, q) from (2, 1, P_1) while m <= top and some element
    // at m <= its degree is not NaN.
    const int id = l.NextId();
    const std::string m_arg = absl::StrCat("%w", id, "m"),
                      p_arg = absl::StrCat("%w", id, "p"),
                      q_arg = absl::StrCat("%w", id, "q");
    const std::string ts = TypeOf({}, i64), tv = TypeOf(dims, t);
    std::string going;
    const std::string cond = l.Region([&] {
      const std::string active =
          both(l.Compare("LE", l.BroadcastTo(m_arg, {}, dims, i64), degree,
                         dims, i64),
               cmp("EQ", q_arg, q_arg));
      const std::string any = l.ReduceOver(active, dims, Range(dims.size()),
                                           "or", l.Constant(0, {}, i1), i1);
      going =
          l.Binary("and", l.Compare("LE", m_arg, top, {}, i64), any, {}, i1);
    });
    std::string m_next, q_next, p_next;
    const std::string body = l.Region([&] {
      const std::string mb = l.BroadcastTo(m_arg, {}, dims, i64);
      const std::string k = l.Convert(
          l.Binary("subtract", mb, ci(1), dims, i64), dims, i64, t);  // m - 1
      std::string r;
      switch (kind) {
        case Poly::kH:
          r = sub(mul(add(x, x), q_arg), mul(add(k, k), p_arg));
          break;
        case Poly::kHe:
          r = sub(mul(x, q_arg), mul(k, p_arg));
          break;
        case Poly::kL:
          r = div(sub(mul(add(add(k, k), sub(c(1), x)), q_arg), mul(k, p_arg)),
                  add(k, c(1)));
          break;
        case Poly::kP:
          r = div(sub(mul(mul(add(add(k, k), c(1)), x), q_arg), mul(k, p_arg)),
                  add(k, c(1)));
          break;
        default:
          r = sub(mul(two_y, q_arg), p_arg);
          break;
      }
      const std::string step = l.Compare("LE", mb, degree, dims, i64);
      q_next = sel(step, r, q_arg);
      p_next = sel(step, q_arg, p_arg);
      m_next = l.Binary("add", m_arg, l.Constant(1, {}, i64), {}, i64);
    });
    const std::string loop = l.EmitResults(
        absl::StrCat("stablehlo.while(", m_arg, " = ", l.Constant(2, {}, i64),
                     ", ", p_arg, " = ", c(1), ", ", q_arg, " = ", p1,
                     ") : ", ts, ", ", tv, ", ", tv, "\n    cond {\n", cond,
                     "      stablehlo.return ", going, " : ", TypeOf({}, i1),
                     "\n    } do {\n", body, "      stablehlo.return ", m_next,
                     ", ", p_next, ", ", q_next, " : ", ts, ", ", tv, ", ", tv,
                     "\n    }"),
        3);
    std::string r = loop + "#2";
    for (size_t i = cases.size(); i-- > 0;)
      r = sel(cases[i].first, cases[i].second, r);
    return r;
  };
}

}  // namespace

void RegisterPolynomial(OpRegistry& reg) {
  const std::pair<const char*, Poly> polys[] = {
      {"chebyshev_polynomial_t", Poly::kT},
      {"chebyshev_polynomial_u", Poly::kU},
      {"chebyshev_polynomial_v", Poly::kV},
      {"chebyshev_polynomial_w", Poly::kW},
      {"shifted_chebyshev_polynomial_t", Poly::kShiftedT},
      {"shifted_chebyshev_polynomial_u", Poly::kShiftedU},
      {"shifted_chebyshev_polynomial_v", Poly::kShiftedV},
      {"shifted_chebyshev_polynomial_w", Poly::kShiftedW},
      {"hermite_polynomial_h", Poly::kH},
      {"hermite_polynomial_he", Poly::kHe},
      {"laguerre_polynomial_l", Poly::kL},
      {"legendre_polynomial_p", Poly::kP},
  };
  for (const auto& [name, kind] : polys) {
    for (const char* form : {"", ".x_scalar", ".n_scalar"})
      reg.Add(absl::StrCat("aten::special_", name, form), PolynomialRule(kind));
  }
}

}  // namespace tpud::pjrt
