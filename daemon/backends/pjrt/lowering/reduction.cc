// Reductions: sums, means, products, extremes and their positions,
// variances, norms, running (cumulative) reductions, any/all, histograms.
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

// _logcumsumexp has no meta kernel: its result has self's dims.
std::vector<std::vector<int64_t>> SameDims(const std::vector<int64_t>& self) {
  return {self};
}

}  // namespace

void RegisterReduction(OpRegistry& reg) {
  // Arguments are read by their schema names (Args, helpers.h).
  // sum / mean(self, *, dtype?) and .dim(self, dim?, keepdim, *, dtype?)
  for (bool mean : {false, true}) {
    const Rule r = [mean](Lowering& l, const tpu::DecodedOp&,
                          const Target& out) -> absl::StatusOr<std::string> {
      const Args a(l);
      if (!a.Has("self")) return Unsupported(l.op(), "expects a tensor");
      return Reduce(l, a["self"], a.Find("dim"), out, mean);
    };
    reg.Add(mean ? "aten::mean.dim" : "aten::sum.dim_IntList", r);
    reg.Add(mean ? "aten::mean" : "aten::sum", r);
  }
  // _cummax_helper / _cummin_helper(self, values!, indices!, dim): the
  // running largest (smallest) value, NaN sticking, and the last place it
  // was seen: the running largest of the positions where an element equals
  // the running value (both NaN counting as equal).
  for (bool largest : {true, false}) {
    reg.AddMulti(
        largest ? "aten::_cummax_helper" : "aten::_cummin_helper",
        [largest](Lowering& l, const tpu::DecodedOp&,
                  const std::vector<Target>& o)
            -> absl::StatusOr<std::vector<std::string>> {
          const Args a(l);
          if (o.size() != 2 || !a.Defined("self") || !a.Has("dim"))
            return Unsupported(l.op(), "arguments of a form not lowered");
          const HloType& t = *o[0].type;
          const HloType& i64 = I64();
          const std::vector<int64_t>& dims = o[0].dims;
          absl::StatusOr<std::string> x = l.Operand(a["self"], dims, t);
          if (!x.ok()) return x.status();
          if (dims.empty())
            return std::vector<std::string>{*x, l.Constant(0, {}, *o[1].type)};
          absl::StatusOr<int64_t> dim =
              CheckedDim(l.op(), a["dim"].i, dims.size());
          if (!dim.ok()) return dim.status();
          const std::string v =
              Running(l, *x, dims, *dim, largest ? "maximum" : "minimum", 0, t,
                      largest ? l.Lowest(t) : Highest(l, t));
          std::string same = l.Compare("EQ", *x, v, dims, t);
          if (t.is_float) {
            const HloType& i1 = *DTypeOf(tpu::DType::kBool);
            same = l.Binary("or", same,
                            l.Binary("and", l.Compare("NE", *x, *x, dims, t),
                                     l.Compare("NE", v, v, dims, t), dims, i1),
                            dims, i1);
          }
          const std::string at = l.Select(same, l.Iota(*dim, dims, i64),
                                          l.Constant(-1, dims, i64), dims, i64);
          const std::string idx =
              Running(l, at, dims, *dim, "maximum", -1, i64);
          return std::vector<std::string>{
              v, l.Convert(idx, dims, i64, *o[1].type)};
        });
  }
  for (bool largest : {true, false}) {
    reg.Add(
        largest ? "aten::argmax" : "aten::argmin",
        [largest](Lowering& l, const tpu::DecodedOp&,
                  const Target& o) -> absl::StatusOr<std::string> {
          // (self, dim?, keepdim): the first index of the largest (smallest)
          // value.
          const Args a(l);
          if (!a.Defined("self"))
            return Unsupported(l.op(), "arguments of a form not lowered");
          const tpu::TensorRef& x = a["self"].tensor;
          const HloType* xt = DTypeOf(x.dtype);
          if (xt == nullptr) return Unsupported(l.op(), "dtype");
          std::vector<int64_t> in = DimsOf(x);
          absl::StatusOr<std::string> v = l.Tensor(x, l.TensorIndex(a["self"]));
          if (!v.ok()) return v;
          std::string xv = *v;
          int64_t dim;
          const tpu::OpArg* dim_arg = a.Find("dim");
          const bool all =
              dim_arg == nullptr || (dim_arg->tag != tpu::ArgTag::kInt &&
                                     dim_arg->tag != tpu::ArgTag::kSymInt);
          if (!all && in.empty()) {
            // A 0-d tensor has one dimension to name: 0 or -1.
            if (absl::StatusOr<int64_t> c = CheckedDim(l.op(), dim_arg->i, 1);
                !c.ok())
              return c.status();
          }
          if (all || in.empty()) {
            int64_t n = 1;
            for (int64_t s : in) n *= s;
            xv = l.Reshape(xv, in, {n}, *xt);
            in = {n};
            dim = 0;
          } else {
            absl::StatusOr<int64_t> checked =
                CheckedDim(l.op(), dim_arg->i, in.size());
            if (!checked.ok()) return checked.status();
            dim = *checked;
          }
          const std::vector<int64_t> which = {dim};
          const std::string mx =
              largest
                  ? l.ReduceOver(xv, in, which, "maximum", l.Lowest(*xt), *xt)
                  : l.ReduceOver(xv, in, which, "minimum", Highest(l, *xt),
                                 *xt);
          const std::string mxe = l.Expand(mx, in, which, *xt);
          std::string hit = l.Compare("EQ", xv, mxe, in, *xt);
          if (xt->is_float) {
            // NaN is the largest and the smallest: its first place is the
            // answer.
            const HloType& i1 = *DTypeOf(tpu::DType::kBool);
            const std::string nan =
                l.Binary("and", l.Compare("NE", xv, xv, in, *xt),
                         l.Compare("NE", mxe, mxe, in, *xt), in, i1);
            hit = l.Binary("or", hit, nan, in, i1);
          }
          const HloType& i64 = I64();
          const std::string idx = l.Select(
              hit, l.Iota(dim, in, i64),
              l.Constant(static_cast<double>(in[dim]), in, i64), in, i64);
          const std::string r = l.ReduceOver(
              idx, in, which, "minimum",
              l.Constant(static_cast<double>(in[dim]), {}, i64), i64);
          return l.Reshape(
              l.Convert(r, Lowering::Kept(in, which), i64, *o.type),
              Lowering::Kept(in, which), o.dims, *o.type);
        });
  }
  // amax / amin over dims (all when none).
  for (bool mx : {true, false}) {
    reg.Add(
        mx ? "aten::amax" : "aten::amin",
        [mx](Lowering& l, const tpu::DecodedOp&,
             const Target& o) -> absl::StatusOr<std::string> {
          const Args a(l);
          if (!a.Defined("self"))
            return Unsupported(l.op(), "expects a tensor");
          const tpu::TensorRef& x = a["self"].tensor;
          const std::vector<int64_t> in = DimsOf(x);
          absl::StatusOr<std::vector<int64_t>> which =
              ReducedDims(l, a.Find("dim"), in.size());
          if (!which.ok()) return which.status();
          absl::StatusOr<std::string> v = l.Operand(a["self"], in, *o.type);
          if (!v.ok()) return v;
          if (in.empty())
            return l.Reshape(*v, in, o.dims,
                             *o.type);  // a 0-d tensor: dim 0 / -1 is itself
          const std::string init = mx ? l.Lowest(*o.type) : Highest(l, *o.type);
          const std::string r = l.ReduceOver(
              *v, in, *which, mx ? "maximum" : "minimum", init, *o.type);
          return l.Reshape(r, Lowering::Kept(in, *which), o.dims, *o.type);
        });
  }
  // var / std.correction(self, dim?, *, correction?, keepdim)
  for (bool root : {false, true}) {
    reg.Add(
        root ? "aten::std.correction" : "aten::var.correction",
        [root](Lowering& l, const tpu::DecodedOp&,
               const Target& o) -> absl::StatusOr<std::string> {
          const Args a(l);
          if (!a.Defined("self") || !o.type->is_float)
            return Unsupported(l.op(), "arguments of a form not lowered");
          const HloType& t = *o.type;
          const std::vector<int64_t> in = DimsOf(a["self"].tensor);
          absl::StatusOr<std::vector<int64_t>> which =
              ReducedDims(l, a.Find("dim"), in.size());
          if (!which.ok()) return which.status();
          // A complex tensor's variance is the mean of |x - mean|^2: the
          // deviations are taken in its own type.
          const HloType* st = DTypeOf(a["self"].tensor.dtype);
          const HloType& xt = st != nullptr && IsComplex(*st) ? *st : t;
          absl::StatusOr<std::string> x = l.Operand(a["self"], in, xt);
          if (!x.ok()) return x;
          const tpu::OpArg* c = a.Find("correction");
          const double correction =
              c != nullptr && c->tag != tpu::ArgTag::kNone ? NumberOf(*c) : 1.0;
          const double n = static_cast<double>(CountOf(in, *which));
          const std::vector<int64_t> kept = Lowering::Kept(in, *which);
          const std::string zero = l.Constant(0, {}, t);
          const std::string mean = l.Binary(
              "divide",
              l.ReduceOver(*x, in, *which, "add", l.Constant(0, {}, xt), xt),
              l.Constant(n, kept, xt), kept, xt);
          std::string dev =
              l.Binary("subtract", *x, l.Expand(mean, in, *which, xt), in, xt);
          if (&xt != &t) {
            dev = l.Convert(Modulus(l, dev, in, xt), in, PartOf(xt), t);
          }
          const std::string ss =
              l.ReduceOver(l.Binary("multiply", dev, dev, in, t), in, *which,
                           "add", zero, t);
          std::string v = l.Binary(
              "divide", ss, l.Constant(std::max(0.0, n - correction), kept, t),
              kept, t);
          if (root) v = l.Unary("sqrt", v, kept, t);
          return l.Reshape(v, kept, o.dims, t);
        });
  }
  // linalg_vector_norm(self, ord, dim?, keepdim, *, dtype?)
  reg.Add("aten::linalg_vector_norm",
          [](Lowering& l, const tpu::DecodedOp&,
             const Target& o) -> absl::StatusOr<std::string> {
            const Args args(l);
            if (!args.Defined("self") || !o.type->is_float)
              return Unsupported(l.op(), "arguments of a form not lowered");
            const HloType& t = *o.type;
            const std::vector<int64_t> in = DimsOf(args["self"].tensor);
            absl::StatusOr<std::vector<int64_t>> which =
                ReducedDims(l, args.Find("dim"), in.size());
            if (!which.ok()) return which.status();
            absl::StatusOr<std::string> x = AbsOperand(l, args["self"], in, t);
            if (!x.ok()) return x;
            const double p = args.Number("ord", 2.0);
            const std::vector<int64_t> kept = Lowering::Kept(in, *which);
            const std::string& a = *x;
            const std::string zero = l.Constant(0, {}, t);
            std::string v;
            if (std::isinf(p)) {
              v = l.ReduceOver(a, in, *which, p > 0 ? "maximum" : "minimum",
                               p > 0 ? l.Lowest(t) : Highest(l, t), t);
            } else if (p == 0) {
              const std::string nz =
                  l.Select(l.Compare("NE", a, l.Constant(0, in, t), in, t),
                           l.Constant(1, in, t), l.Constant(0, in, t), in, t);
              v = l.ReduceOver(nz, in, *which, "add", zero, t);
            } else if (p == 1) {
              v = l.ReduceOver(a, in, *which, "add", zero, t);
            } else if (p == 2) {
              v = l.Unary("sqrt",
                          l.ReduceOver(l.Binary("multiply", a, a, in, t), in,
                                       *which, "add", zero, t),
                          kept, t);
            } else {
              const std::string s = l.ReduceOver(
                  l.Binary("power", a, l.Constant(p, in, t), in, t), in, *which,
                  "add", zero, t);
              v = l.Binary("power", s, l.Constant(1.0 / p, kept, t), kept, t);
            }
            return l.Reshape(v, kept, o.dims, t);
          });
  // cumsum / cumprod(self, dim, *, dtype?)
  for (bool sum : {true, false}) {
    reg.Add(sum ? "aten::cumsum" : "aten::cumprod",
            [sum](Lowering& l, const tpu::DecodedOp&,
                  const Target& o) -> absl::StatusOr<std::string> {
              const Args a(l);
              if (!a.Defined("self") || !a.Has("dim"))
                return Unsupported(l.op(), "arguments of a form not lowered");
              absl::StatusOr<std::string> x =
                  l.Operand(a["self"], o.dims, *o.type);
              if (!x.ok()) return x;
              if (o.dims.empty()) return *x;
              absl::StatusOr<int64_t> checked =
                  CheckedDim(l.op(), a["dim"].i, o.dims.size());
              if (!checked.ok()) return checked.status();
              const int64_t dim = *checked;
              return Running(l, *x, o.dims, dim, sum ? "add" : "multiply",
                             sum ? 0 : 1, *o.type);
            });
  }
  // prod(self, *, dtype?) over every dimension (it has no dim) and
  // prod.dim_int(self, dim, keepdim, *, dtype?)
  for (bool all : {true, false}) {
    reg.Add(all ? "aten::prod" : "aten::prod.dim_int",
            [](Lowering& l, const tpu::DecodedOp&,
               const Target& o) -> absl::StatusOr<std::string> {
              const Args a(l);
              if (!a.Defined("self"))
                return Unsupported(l.op(), "expects a tensor");
              const std::vector<int64_t> in = DimsOf(a["self"].tensor);
              absl::StatusOr<std::vector<int64_t>> which =
                  ReducedDims(l, a.Find("dim"), in.size());
              if (!which.ok()) return which.status();
              absl::StatusOr<std::string> x = l.Operand(a["self"], in, *o.type);
              if (!x.ok()) return x;
              const std::string v =
                  l.ReduceOver(*x, in, *which, "multiply",
                               l.Constant(1, {}, *o.type), *o.type);
              return l.Reshape(v, Lowering::Kept(in, *which), o.dims, *o.type);
            });
  }
  // any / all, over everything or dims; a bool result.
  for (bool any : {true, false}) {
    Rule r = [any](Lowering& l, const tpu::DecodedOp&,
                   const Target& o) -> absl::StatusOr<std::string> {
      const Args a(l);
      if (!a.Defined("self")) return Unsupported(l.op(), "expects a tensor");
      const tpu::TensorRef& x = a["self"].tensor;
      const HloType* xt = DTypeOf(x.dtype);
      if (xt == nullptr) return Unsupported(l.op(), "dtype");
      const std::vector<int64_t> in = DimsOf(x);
      absl::StatusOr<std::vector<int64_t>> which =
          ReducedDims(l, a.Find("dim"), in.size());
      if (!which.ok()) return which.status();
      absl::StatusOr<std::string> v = l.Tensor(x, l.TensorIndex(a["self"]));
      if (!v.ok()) return v;
      const HloType& b = *DTypeOf(tpu::DType::kBool);
      const std::string truth =
          xt->dtype == tpu::DType::kBool
              ? *v
              : l.Compare("NE", *v, l.Constant(0, in, *xt), in, *xt);
      const std::string r = l.ReduceOver(truth, in, *which, any ? "or" : "and",
                                         l.Constant(any ? 0 : 1, {}, b), b);
      return l.Reshape(l.Convert(r, Lowering::Kept(in, *which), b, *o.type),
                       Lowering::Kept(in, *which), o.dims, *o.type);
    };
    const std::string base = any ? "aten::any" : "aten::all";
    for (const char* form :
         {"", ".dim", ".dims", ".all_out", ".out", ".dims_out"})
      reg.Add(base + form, r);
  }
  reg.Alias("aten::prod.int_out", "aten::prod.dim_int");
  // max / min of everything (self): amax / amin over every dimension.
  reg.Alias("aten::max", "aten::amax");
  reg.Alias("aten::min", "aten::amin");
  reg.Alias("aten::max.unary_out", "aten::max");
  reg.Alias("aten::min.unary_out", "aten::min");
  // max.out(self, other, *, out) is not max's out= form but maximum's
  // (elementwise, elementwise.cc): given here so that none is derived.
  reg.Alias("aten::max.out", "aten::maximum");
  reg.Alias("aten::min.out", "aten::minimum");
  // _logcumsumexp(self, dim): a running log-sum-exp.
  reg.Add("aten::_logcumsumexp",
          [](Lowering& l, const tpu::DecodedOp&,
             const Target& o) -> absl::StatusOr<std::string> {
            const Args a(l);
            if (!a.Defined("self") || !a.Has("dim"))
              return Unsupported(l.op(), "arguments of a form not lowered");
            absl::StatusOr<std::string> x =
                l.Operand(a["self"], o.dims, *o.type);
            if (!x.ok() || o.dims.empty()) return x;
            absl::StatusOr<int64_t> dim =
                CheckedDim(l.op(), a["dim"].i, o.dims.size());
            if (!dim.ok()) return dim.status();
            return Running(l, *x, o.dims, *dim, "logaddexp", 0, *o.type,
                           l.Lowest(*o.type));
          })
      .SizedBy(SameDims);
  // histc(self, bins, min, max): counts in `bins` equal bins over
  // [min, max] (the data's range when min = max, widened by 1 each way
  // when that is one value); the top edge falls in the last bin, what lies
  // outside (and NaN) is not counted.
  reg.Add(
      "aten::histc",
      [](Lowering& l, const tpu::DecodedOp&,
         const Target& o) -> absl::StatusOr<std::string> {
        const Args a(l);
        if (!a.Has("max") || !a.Defined("self") || o.dims.size() != 1)
          return Unsupported(l.op(), "arguments of a form not lowered");
        const HloType& t = *o.type;
        const HloType& i64 = I64();
        const int64_t bins = o.dims[0];
        if (bins <= 0)
          return absl::InvalidArgumentError(
              absl::StrCat(l.op(), ": bins must be positive"));
        const std::vector<int64_t> in = DimsOf(a["self"].tensor);
        int64_t total = 1;
        for (int64_t q : in) total *= q;
        if (total == 0) return l.Constant(0, o.dims, t);
        const std::vector<int64_t> flat = {total};
        absl::StatusOr<std::string> xs = l.Operand(a["self"], in, t);
        if (!xs.ok()) return xs;
        const std::string x = l.Reshape(*xs, in, flat, t);
        const double lo_arg = NumberOf(a["min"]), hi_arg = NumberOf(a["max"]);
        if (lo_arg > hi_arg)
          return absl::InvalidArgumentError(
              absl::StrCat(l.op(), ": max must be larger than min"));
        std::string lo = l.Constant(lo_arg, {}, t),
                    hi = l.Constant(hi_arg, {}, t);
        if (lo_arg == hi_arg) {
          lo = l.ReduceOver(x, flat, {0}, "minimum", Highest(l, t), t);
          hi = l.ReduceOver(x, flat, {0}, "maximum", l.Lowest(t), t);
        }
        const std::string same = l.Compare("EQ", lo, hi, {}, t);
        lo = l.Select(same,
                      l.Binary("subtract", lo, l.Constant(1, {}, t), {}, t), lo,
                      {}, t);
        hi = l.Select(same, l.Binary("add", hi, l.Constant(1, {}, t), {}, t),
                      hi, {}, t);
        const std::string lb = l.BroadcastTo(lo, {}, flat, t),
                          hb = l.BroadcastTo(hi, {}, flat, t);
        const HloType& i1 = *DTypeOf(tpu::DType::kBool);
        const std::string inside =
            l.Binary("and", l.Compare("GE", x, lb, flat, t),
                     l.Compare("LE", x, hb, flat, t), flat, i1);
        const std::string scaled = l.Binary(
            "divide",
            l.Binary("multiply", l.Binary("subtract", x, lb, flat, t),
                     l.Constant(static_cast<double>(bins), flat, t), flat, t),
            l.Binary("subtract", hb, lb, flat, t), flat, t);
        std::string pos =
            l.Convert(l.Select(inside, scaled, l.Constant(0, flat, t), flat, t),
                      flat, t, i64);
        pos = l.Binary("minimum", pos,
                       l.Constant(static_cast<double>(bins - 1), flat, i64),
                       flat, i64);
        const std::string ones = l.Select(inside, l.Constant(1, flat, t),
                                          l.Constant(0, flat, t), flat, t);
        return ScatterFlat(l, l.Constant(0, o.dims, t), bins, pos, ones, total,
                           true, t);
      });
  // out= overloads whose names are not the derived ones (the out tensor
  // is the written argument, after the others).
  reg.Alias("aten::sum.IntList_out", "aten::sum.dim_IntList");
  reg.Alias("aten::mean.out", "aten::mean.dim");
}

}  // namespace tpud::pjrt
