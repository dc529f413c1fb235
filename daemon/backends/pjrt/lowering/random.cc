// Random fills (uniform_, normal_, bernoulli_, random_) and multinomial:
// values from XLA's rng_bit_generator, seeded per op.
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
#include "daemon/backends/pjrt/lowering/matrix.h"
#include "daemon/backends/pjrt/lowering/registry.h"

namespace tpud::pjrt {

void RegisterRandom(OpRegistry& reg) {
  // Random ops. The generator argument carries a 64-bit seed the client's
  // device generator drew for this op (torch.tpu.manual_seed makes runs
  // repeat); it travels as a parameter, so one program serves every call.
  // Values come from XLA's rng_bit_generator: reproducible on this backend,
  // not equal to the CPU's stream.
  enum class Dist { kUniform, kNormal, kBernoulli, kRandom };
  auto random_rule = [](Dist dist) -> Rule {
    return [dist](Lowering& l, const tpu::DecodedOp&,
                  const Target& o) -> absl::StatusOr<std::string> {
      const Args a(l);
      const tpu::OpArg* gen = a.Find("generator");
      if (gen == nullptr || gen->tag != tpu::ArgTag::kGenerator)
        return Unsupported(l.op(), "no generator argument");
      const HloType& t = *o.type;
      const HloType& f =
          t.dtype == tpu::DType::kDouble
              ? F64()
              : *DTypeOf(tpu::DType::kFloat);  // uniform draws in f32 or f64
      const bool normal = dist == Dist::kNormal;
      const std::string u = l.UniformBits(gen->i, o.dims, f, normal ? 2 : 1);
      std::vector<int64_t> two = o.dims;
      two.insert(two.begin(), 2);
      auto half = [&](int k) {  // the k-th of the two draws of a normal
        std::vector<int64_t> one = o.dims;
        one.insert(one.begin(), 1);
        return l.Reshape(l.SliceAlong(u, two, 0, k, k + 1, f), one, o.dims, f);
      };
      // A number argument, or `dflt` where absent or None.
      auto num = [&](const char* name, double dflt) {
        const tpu::OpArg* x = a.Find(name);
        return x != nullptr && x->tag != tpu::ArgTag::kNone ? NumberOf(*x)
                                                            : dflt;
      };
      std::string v;
      switch (dist) {
        case Dist::kUniform: {  // uniform_(self, from, to, *, generator)
          const double from = num("from", 0), to = num("to", 1);
          v = l.Binary("add", l.Constant(from, o.dims, f),
                       l.Binary("multiply", u, l.Constant(to - from, o.dims, f),
                                o.dims, f),
                       o.dims, f);
          break;
        }
        case Dist::kNormal: {  // normal_(self, mean, std, *, generator):
                               // Box-Muller
          const double mean = num("mean", 0), stdev = num("std", 1);
          const std::string u1 = l.Binary("subtract", l.Constant(1, o.dims, f),
                                          half(0), o.dims, f);  // (0, 1]
          const std::string r =
              l.Unary("sqrt",
                      l.Binary("multiply", l.Constant(-2, o.dims, f),
                               l.Unary("log", u1, o.dims, f), o.dims, f),
                      o.dims, f);
          const std::string c = l.Unary(
              "cosine",
              l.Binary("multiply", l.Constant(6.283185307179586, o.dims, f),
                       half(1), o.dims, f),
              o.dims, f);
          v = l.Binary(
              "add", l.Constant(mean, o.dims, f),
              l.Binary("multiply", l.Binary("multiply", r, c, o.dims, f),
                       l.Constant(stdev, o.dims, f), o.dims, f),
              o.dims, f);
          break;
        }
        case Dist::kBernoulli: {  // bernoulli_(self, p: float or Tensor, *,
                                  // generator)
          std::string p;
          if (a.Defined("p")) {
            absl::StatusOr<std::string> pt = l.Operand(a["p"], o.dims, f);
            if (!pt.ok()) return pt;
            p = *pt;
          } else {
            p = l.Constant(num("p", 0.5), o.dims, f);
          }
          v = l.Select(l.Compare("LT", u, p, o.dims, f),
                       l.Constant(1, o.dims, f), l.Constant(0, o.dims, f),
                       o.dims, f);
          break;
        }
        case Dist::kRandom: {  // random_.from(self, from, to?, *, generator):
                               // integers in [from, to)
          const double from = num("from", 0), to = num("to", from + 1);
          const HloType& w = F64();
          const std::string uw = l.Convert(u, o.dims, f, w);
          v = l.Binary(
              "add", l.Constant(from, o.dims, w),
              l.Unary("floor",
                      l.Binary("multiply", uw, l.Constant(to - from, o.dims, w),
                               o.dims, w),
                      o.dims, w),
              o.dims, w);
          return l.Convert(v, o.dims, w, t);
        }
      }
      return l.Convert(v, o.dims, f, t);
    };
  };
  reg.Add("aten::uniform_", random_rule(Dist::kUniform)).OverwritesFirst();
  reg.Add("aten::normal_", random_rule(Dist::kNormal)).OverwritesFirst();
  reg.Add("aten::bernoulli_.float", random_rule(Dist::kBernoulli))
      .OverwritesFirst();
  reg.Add("aten::bernoulli_.Tensor", random_rule(Dist::kBernoulli))
      .OverwritesFirst();
  reg.Add("aten::random_.from", random_rule(Dist::kRandom)).OverwritesFirst();
  // multinomial(self, num_samples, replacement, *, generator): rows of
  // weights (a 1-d self is one row). Without replacement, the k largest of
  // log(p) + Gumbel noise (sampling in order without replacement); with
  // replacement, each draw u * total placed among the running sums (a
  // zero weight covers no interval, so it is never drawn).
  reg.Add(
      "aten::multinomial",
      [](Lowering& l, const tpu::DecodedOp&,
         const Target& o) -> absl::StatusOr<std::string> {
        const Args a(l);
        const tpu::OpArg* gen = a.Find("generator");
        if (!a.Defined("self") || gen == nullptr ||
            gen->tag != tpu::ArgTag::kGenerator)
          return Unsupported(l.op(), "arguments of a form not lowered");
        const std::vector<int64_t> in = DimsOf(a["self"].tensor);
        if (in.empty() || in.size() > 2 || o.dims.size() != in.size())
          return Unsupported(l.op(), "weights of another rank");
        const int64_t rows = in.size() == 2 ? in[0] : 1, n = in.back(),
                      k = o.dims.back();
        if (rows * k == 0) return l.Constant(0, o.dims, *o.type);
        if (n == 0) return Unsupported(l.op(), "no categories");
        const bool replacement = a.Flag("replacement", false);
        if (!replacement && k > n)
          return absl::InvalidArgumentError(
              absl::StrCat(l.op(), ": cannot sample ", k, " > ", n,
                           " samples without replacement"));
        const HloType& t = *DTypeOf(a["self"].tensor.dtype);
        const HloType& f = t.dtype == tpu::DType::kDouble ? F64() : F32();
        const std::vector<int64_t> pd = {rows, n}, od = {rows, k};
        absl::StatusOr<std::string> pv = l.Operand(a["self"], in, f);
        if (!pv.ok()) return pv;
        const std::string p = l.Reshape(*pv, in, pd, f);
        const HloType& i64 = I64();
        std::string idx;
        if (!replacement) {
          // u in (0, 1): -log(-log(u)) is a Gumbel draw
          const std::string u =
              l.Binary("maximum", l.UniformBits(gen->i, pd, f, 1),
                       l.Constant(1e-30, pd, f), pd, f);
          const std::string key = l.Binary(
              "subtract", l.Unary("log", p, pd, f),
              l.Unary("log", l.Unary("negate", l.Unary("log", u, pd, f), pd, f),
                      pd, f),
              pd, f);
          auto [sorted, order] = l.Sort(key, pd, 1, /*descending=*/true, f);
          (void)sorted;
          idx = l.SliceAlong(order, pd, 1, 0, k, i64);
        } else {
          const std::string cdf = Running(l, p, pd, 1, "add", 0, f);
          const std::string total = l.SliceAlong(cdf, pd, 1, n - 1, n, f);
          const std::string target =
              l.Binary("multiply", l.UniformBits(gen->i, od, f, 1),
                       BroadcastInDim(l, l.Reshape(total, {rows, 1}, {rows}, f),
                                      {rows}, od, {0}, f),
                       od, f);
          const std::vector<int64_t> full = {rows, k, n};
          const std::string below = l.Compare(
              "LE", BroadcastInDim(l, cdf, pd, full, {0, 2}, f),
              BroadcastInDim(l, target, od, full, {0, 1}, f), full, f);
          idx = l.Binary(
              "minimum",
              l.ReduceOver(
                  l.Convert(below, full, *DTypeOf(tpu::DType::kBool), i64),
                  full, {2}, "add", l.Constant(0, {}, i64), i64),
              l.Constant(n - 1, od, i64), od, i64);
        }
        return l.Convert(l.Reshape(idx, od, o.dims, i64), o.dims, i64, *o.type);
      });
  reg.Alias("aten::multinomial.out", "aten::multinomial");
}

}  // namespace tpud::pjrt
