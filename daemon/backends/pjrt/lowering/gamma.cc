// The regularized incomplete gamma functions igamma(a, x) = P(a, x) and
// igammac(a, x) = Q(a, x) = 1 - P, in float64 whatever the output type:
// per element, the power series of P, the continued fraction of Q, or the
// series of Q for small x, picked by the regions ATen picks them in (its
// asymptotic expansions for a > 20 near x = a are not used: the series and
// fraction converge there too, in more steps). Each runs as a while loop
// until every element that takes it has converged (at most kMaxSteps).
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "daemon/backends/pjrt/lowering/families.h"
#include "daemon/backends/pjrt/lowering/helpers.h"
#include "daemon/backends/pjrt/lowering/lowering.h"
#include "daemon/backends/pjrt/lowering/registry.h"
#include "daemon/backends/pjrt/lowering/special.h"

namespace tpud::pjrt {
namespace {

constexpr int kMaxSteps = 2000;
constexpr double kEps = 1.11022302462515654042e-16;  // 2^-53
constexpr double kBig = 4.503599627370496e15;        // 2^52
constexpr double kBigInv = 2.22044604925031308085e-16;

using State = std::vector<std::string>;

// Float64 arithmetic on tensors of dims d.
struct F64Ops {
  Lowering& l;
  const std::vector<int64_t>& d;
  const HloType& w = F64();
  std::string k(double v) const { return l.Constant(v, d, w); }
  std::string add(const std::string& a, const std::string& b) const {
    return l.Binary("add", a, b, d, w);
  }
  std::string sub(const std::string& a, const std::string& b) const {
    return l.Binary("subtract", a, b, d, w);
  }
  std::string mul(const std::string& a, const std::string& b) const {
    return l.Binary("multiply", a, b, d, w);
  }
  std::string div(const std::string& a, const std::string& b) const {
    return l.Binary("divide", a, b, d, w);
  }
  std::string abs(const std::string& a) const {
    return l.Unary("abs", a, d, w);
  }
  std::string cmp(const char* dir, const std::string& a,
                  const std::string& b) const {
    return l.Compare(dir, a, b, d, w);
  }
  std::string sel(const std::string& c, const std::string& a,
                  const std::string& b) const {
    return l.Select(c, a, b, d, w);
  }
  std::string both(const std::string& a, const std::string& b) const {
    return l.Binary("and", a, b, d, *DTypeOf(tpu::DType::kBool));
  }
  std::string either(const std::string& a, const std::string& b) const {
    return l.Binary("or", a, b, d, *DTypeOf(tpu::DType::kBool));
  }
  std::string lgamma(const std::string& a) const {
    return Chlo(l, "lgamma", {a}, d, w);
  }
};

// Runs `step` on the float64 state (each of dims d) from `init` while an
// element where `active` holds has not converged, at most kMaxSteps times.
// step(state) gives the next state and whether each element converged
// with it; a converged element keeps its state from then on.
State Iterate(
    Lowering& l, const std::vector<int64_t>& d, const std::string& active,
    const State& init,
    const std::function<std::pair<State, std::string>(const State&)>& step) {
  const HloType& w = F64();
  const HloType& i1 = *DTypeOf(tpu::DType::kBool);
  const HloType& i64 = I64();
  const int id = l.NextId();
  const std::string n_arg = absl::StrCat("%w", id, "n"),
                    done_arg = absl::StrCat("%w", id, "d");
  State args;
  for (size_t q = 0; q < init.size(); ++q)
    args.push_back(absl::StrCat("%w", id, "s", q));
  const std::string tn = TypeOf({}, i64), tb = TypeOf(d, i1), tv = TypeOf(d, w);
  std::vector<std::string> types = {tn, tb};
  for (size_t q = 0; q < init.size(); ++q) types.push_back(tv);
  std::string going;
  const std::string cond = l.Region([&] {
    const std::string waiting =
        l.Binary("and", active, l.Unary("not", done_arg, d, i1), d, i1);
    const std::string any = l.ReduceOver(waiting, d, Range(d.size()), "or",
                                         l.Constant(0, {}, i1), i1);
    going = l.Binary(
        "and", l.Compare("LT", n_arg, l.Constant(kMaxSteps, {}, i64), {}, i64),
        any, {}, i1);
  });
  State next;
  std::string n_next, done_next;
  const std::string body = l.Region([&] {
    auto [s, converged] = step(args);
    for (size_t q = 0; q < s.size(); ++q)
      next.push_back(l.Select(done_arg, args[q], s[q], d, w));
    done_next = l.Binary("or", done_arg, converged, d, i1);
    n_next = l.Binary("add", n_arg, l.Constant(1, {}, i64), {}, i64);
  });
  std::vector<std::string> inits = {
      absl::StrCat(n_arg, " = ", l.Constant(0, {}, i64)),
      absl::StrCat(done_arg, " = ", l.Constant(0, d, i1))};
  for (size_t q = 0; q < init.size(); ++q)
    inits.push_back(absl::StrCat(args[q], " = ", init[q]));
  std::vector<std::string> rets = {n_next, done_next};
  rets.insert(rets.end(), next.begin(), next.end());
  const std::string all_types = absl::StrJoin(types, ", ");
  const std::string loop = l.EmitResults(
      absl::StrCat("stablehlo.while(", absl::StrJoin(inits, ", "),
                   ") : ", all_types, "\n    cond {\n", cond,
                   "      stablehlo.return ", going, " : ", TypeOf({}, i1),
                   "\n    } do {\n", body, "      stablehlo.return ",
                   absl::StrJoin(rets, ", "), " : ", all_types, "\n    }"),
      static_cast<int>(types.size()));
  State out;
  for (size_t q = 0; q < init.size(); ++q)
    out.push_back(absl::StrCat(loop, "#", q + 2));
  return out;
}

// x^a e^-x / Gamma(a).
std::string Prefactor(const F64Ops& f, const std::string& a,
                      const std::string& x) {
  const std::string e =
      f.sub(f.sub(f.mul(a, f.l.Unary("log", x, f.d, f.w)), x), f.lgamma(a));
  return f.l.Unary("exponential", e, f.d, f.w);
}

// P(a, x) by its power series (x <= 1 or x <= a).
std::string PSeries(const F64Ops& f, const std::string& active,
                    const std::string& a, const std::string& x) {
  // (r, c, sum) from (a, 1, 1): r += 1, c *= x / r, sum += c.
  const State s =
      Iterate(f.l, f.d, active, {a, f.k(1), f.k(1)}, [&](const State& v) {
        const std::string r = f.add(v[0], f.k(1));
        const std::string c = f.mul(v[1], f.div(x, r));
        const std::string sum = f.add(v[2], c);
        return std::make_pair(State{r, c, sum},
                              f.cmp("LE", c, f.mul(f.k(kEps), sum)));
      });
  return f.div(f.mul(s[2], Prefactor(f, a, x)), a);
}

// Q(a, x) by its continued fraction (x > 1 and x > a).
std::string QFraction(const F64Ops& f, const std::string& active,
                      const std::string& a, const std::string& x) {
  const std::string y0 = f.sub(f.k(1), a);
  const std::string z0 = f.add(f.add(x, y0), f.k(1));
  const std::string pkm1 = f.add(x, f.k(1)), qkm1 = f.mul(z0, x);
  // (c, y, z, pkm2, qkm2, pkm1, qkm1, ans)
  const State init = {f.k(0), y0, z0, f.k(1), x, pkm1, qkm1, f.div(pkm1, qkm1)};
  const State s = Iterate(f.l, f.d, active, init, [&](const State& v) {
    const std::string c = f.add(v[0], f.k(1));
    const std::string y = f.add(v[1], f.k(1));
    const std::string z = f.add(v[2], f.k(2));
    const std::string yc = f.mul(y, c);
    const std::string pk = f.sub(f.mul(v[5], z), f.mul(v[3], yc));
    const std::string qk = f.sub(f.mul(v[6], z), f.mul(v[4], yc));
    const std::string nonzero = f.cmp("NE", qk, f.k(0));
    const std::string r = f.div(pk, qk);
    const std::string t =
        f.sel(nonzero, f.abs(f.div(f.sub(v[7], r), r)), f.k(1));
    const std::string ans = f.sel(nonzero, r, v[7]);
    // Rescaled when they grow past 2^52.
    const std::string big = f.cmp("GT", f.abs(pk), f.k(kBig));
    const auto scale = [&](const std::string& u) {
      return f.sel(big, f.mul(u, f.k(kBigInv)), u);
    };
    return std::make_pair(
        State{c, y, z, scale(v[5]), scale(v[6]), scale(pk), scale(qk), ans},
        f.cmp("LE", t, f.k(kEps)));
  });
  return f.mul(s[7], Prefactor(f, a, x));
}

// Q(a, x) by the series for small x (x <= 1.1).
std::string QSeries(const F64Ops& f, const std::string& active,
                    const std::string& a, const std::string& x) {
  // (n, fac, sum) from (0, 1, 0): n += 1, fac *= -x / n, sum += fac / (a + n).
  const State s =
      Iterate(f.l, f.d, active, {f.k(0), f.k(1), f.k(0)}, [&](const State& v) {
        const std::string n = f.add(v[0], f.k(1));
        const std::string fac =
            f.mul(v[1], f.div(f.l.Unary("negate", x, f.d, f.w), n));
        const std::string term = f.div(fac, f.add(a, n));
        const std::string sum = f.add(v[2], term);
        return std::make_pair(
            State{n, fac, sum},
            f.cmp("LE", f.abs(term), f.mul(f.k(kEps), f.abs(sum))));
      });
  const std::string alogx = f.mul(a, f.l.Unary("log", x, f.d, f.w));
  const std::string head =
      f.l.Unary("negate",
                f.l.Unary("exponential_minus_one",
                          f.sub(alogx, f.lgamma(f.add(a, f.k(1)))), f.d, f.w),
                f.d, f.w);
  return f.sub(
      head, f.mul(f.l.Unary("exponential", f.sub(alogx, f.lgamma(a)), f.d, f.w),
                  s[2]));
}

// P (upper = false) or Q of float64 a and x.
std::string IncompleteGamma(const F64Ops& f, const std::string& a,
                            const std::string& x, bool upper) {
  const std::string zero = f.k(0), one = f.k(1);
  const std::string nan = f.div(zero, zero), inf = f.div(one, zero);
  const std::string pseries_region =
      f.either(f.cmp("LE", x, one), f.cmp("LE", x, a));
  std::string value;
  if (!upper) {
    // P: the series where x <= 1 or x <= a, else 1 - Q by the fraction.
    const std::string p = PSeries(f, pseries_region, a, x);
    const std::string q = QFraction(
        f, f.l.Unary("not", pseries_region, f.d, *DTypeOf(tpu::DType::kBool)),
        a, x);
    value = f.sel(pseries_region, p, f.sub(one, q));
  } else {
    // Q: above x = 1.1, 1 - P where x < a, else the fraction; below, the
    // small-x series unless a is large for x (then 1 - P).
    const std::string high = f.cmp("GT", x, f.k(1.1));
    const std::string low = f.cmp("LE", x, f.k(0.5));
    const HloType& i1 = *DTypeOf(tpu::DType::kBool);
    const auto no = [&](const std::string& c) {
      return f.l.Unary("not", c, f.d, i1);
    };
    const std::string by_p = f.either(
        f.both(high, f.cmp("LT", x, a)),
        f.both(no(high),
               f.either(f.both(low, f.cmp("LT",
                                          f.div(f.k(-0.4),
                                                f.l.Unary("log", x, f.d, f.w)),
                                          a)),
                        f.both(no(low), f.cmp("LT", f.mul(x, f.k(1.1)), a)))));
    const std::string not_p = no(by_p);
    const std::string p = PSeries(f, by_p, a, x);
    const std::string frac = QFraction(f, f.both(not_p, high), a, x);
    const std::string small = QSeries(f, f.both(not_p, no(high)), a, x);
    value = f.sel(by_p, f.sub(one, p), f.sel(high, frac, small));
  }
  // Edges, as ATen: NaN for a negative argument (or a NaN); a = 0; x = 0;
  // infinite a or x.
  const auto pick = [&](double p_value) {
    return f.k(upper ? 1 - p_value : p_value);
  };
  const std::string a_inf = f.cmp("EQ", a, inf), x_inf = f.cmp("EQ", x, inf);
  value = f.sel(x_inf, pick(1), value);
  value = f.sel(a_inf, f.sel(x_inf, nan, pick(0)), value);
  value = f.sel(f.cmp("EQ", x, zero), pick(0), value);
  value = f.sel(f.cmp("EQ", a, zero), f.sel(f.cmp("GT", x, zero), pick(1), nan),
                value);
  const std::string bad =
      f.either(f.either(f.cmp("LT", a, zero), f.cmp("LT", x, zero)),
               f.either(f.cmp("NE", a, a), f.cmp("NE", x, x)));
  return f.sel(bad, nan, value);
}

}  // namespace

void RegisterGamma(OpRegistry& reg) {
  for (bool upper : {false, true}) {
    Rule r = [upper](Lowering& l, const tpu::DecodedOp&,
                     const Target& o) -> absl::StatusOr<std::string> {
      const Args args(l);
      if (!args.Has("self") || !args.Has("other") || !o.type->is_float)
        return Unsupported(l.op(), "arguments of a form not lowered");
      const HloType& t = *o.type;
      const HloType& w = F64();
      absl::StatusOr<std::string> a = l.Operand(args["self"], o.dims, t);
      if (!a.ok()) return a;
      absl::StatusOr<std::string> x = l.Operand(args["other"], o.dims, t);
      if (!x.ok()) return x;
      const F64Ops f{l, o.dims};
      const auto wide = [&](const std::string& v) {
        return t.dtype == tpu::DType::kDouble ? v : l.Convert(v, o.dims, t, w);
      };
      const std::string v = IncompleteGamma(f, wide(*a), wide(*x), upper);
      return t.dtype == tpu::DType::kDouble ? v : l.Convert(v, o.dims, w, t);
    };
    reg.Add(upper ? "aten::igammac" : "aten::igamma", r);
  }
}

}  // namespace tpud::pjrt
