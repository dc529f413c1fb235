// Backward ops that PyTorch has no decomposition for: the distances'
// (cdist, pdist) and the margin losses' (multi_margin_loss,
// multilabel_margin_loss), with ATen's CPU formulas; and
// multilabel_margin_loss's forward, whose PyTorch decomposition disagrees
// with its CPU kernel.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "daemon/backends/pjrt/lowering/families.h"
#include "daemon/backends/pjrt/lowering/helpers.h"
#include "daemon/backends/pjrt/lowering/lowering.h"
#include "daemon/backends/pjrt/lowering/matrix.h"
#include "daemon/backends/pjrt/lowering/registry.h"

namespace tpud::pjrt {
namespace {

// The gradient of the p-norm distances dist (b..., P, R) between the rows
// of x1 (b..., P, M) and x2 (b..., R, M) with respect to x1, given their
// gradient g: the sum over R of ATen's per-element term of diff = x1 - x2.
std::string DistBackward(Lowering& l, const std::string& g,
                         const std::string& x1, const std::string& x2,
                         const std::string& dist,
                         const std::vector<int64_t>& d1,
                         const std::vector<int64_t>& d2, double p,
                         const HloType& t) {
  const size_t nb = d1.size() - 2;
  std::vector<int64_t> full(d1.begin(), d1.begin() + nb);
  const int64_t P = d1[nb], M = d1[nb + 1], R = d2[nb];
  full.insert(full.end(), {P, R, M});
  std::vector<int64_t> m1, m2, mg;  // x1, x2, (g, dist) into full
  for (size_t q = 0; q < nb; ++q) {
    m1.push_back(static_cast<int64_t>(q));
    m2.push_back(static_cast<int64_t>(q));
    mg.push_back(static_cast<int64_t>(q));
  }
  const int64_t b = static_cast<int64_t>(nb);
  m1.insert(m1.end(), {b, b + 2});
  m2.insert(m2.end(), {b + 1, b + 2});
  mg.insert(mg.end(), {b, b + 1});
  std::vector<int64_t> pr(d1.begin(), d1.begin() + nb);
  pr.insert(pr.end(), {P, R});
  auto c = [&](double v) { return l.Constant(v, full, t); };
  auto bin = [&](const char* op, const std::string& a, const std::string& b) {
    return l.Binary(op, a, b, full, t);
  };
  const std::string diff =
      bin("subtract", BroadcastInDim(l, x1, d1, full, m1, t),
          BroadcastInDim(l, x2, d2, full, m2, t));
  const std::string gf = BroadcastInDim(l, g, pr, full, mg, t);
  const std::string df = BroadcastInDim(l, dist, pr, full, mg, t);
  const std::string zero = c(0);
  const std::string sign = l.Unary("sign", diff, full, t);
  const std::string ad = l.Unary("abs", diff, full, t);
  const std::string dist0 = l.Compare("EQ", df, zero, full, t);
  std::string term;
  if (p == 0) {
    term = zero;
  } else if (p == 1) {
    term = bin("multiply", sign, gf);
  } else if (std::isinf(p)) {
    term = l.Select(l.Compare("EQ", ad, df, full, t), bin("multiply", sign, gf),
                    zero, full, t);
  } else if (p == 2) {
    term = l.Select(dist0, zero, bin("divide", bin("multiply", gf, diff), df),
                    full, t);
  } else if (p < 2) {
    // sign(diff) |diff|^(p-1) g / dist^(p-1); 0 where dist is, and where
    // diff is for p < 1
    const std::string v = bin(
        "divide",
        bin("multiply", bin("multiply", sign, bin("power", ad, c(p - 1))), gf),
        bin("power", df, c(p - 1)));
    std::string none = dist0;
    if (p < 1) {
      none = l.Binary("or", none, l.Compare("EQ", diff, zero, full, t), full,
                      *DTypeOf(tpu::DType::kBool));
    }
    term = l.Select(none, zero, v, full, t);
  } else {
    // diff |diff|^(p-2) g / dist^(p-1)
    const std::string v = bin(
        "divide",
        bin("multiply", bin("multiply", diff, bin("power", ad, c(p - 2))), gf),
        bin("power", df, c(p - 1)));
    term = l.Select(dist0, zero, v, full, t);
  }
  return l.ReduceOver(term, full, {b + 1}, "add", l.Constant(0, {}, t), t);
}

// The (n x n) matrix with the condensed pair values v (pairs i < j, in
// order) at (i, j) and (j, i), zero on the diagonal.
std::string Square(Lowering& l, const std::string& v, int64_t n,
                   const HloType& t) {
  const int64_t pairs = n * (n - 1) / 2;
  std::vector<std::string> upper, lower;
  for (int64_t i = 0; i < n; ++i) {
    for (int64_t j = i + 1; j < n; ++j) {
      upper.push_back(absl::StrCat(i * n + j));
      lower.push_back(absl::StrCat(j * n + i));
    }
  }
  auto index = [&](const std::vector<std::string>& at) {
    return l.Emit(absl::StrCat("stablehlo.constant dense<[",
                               absl::StrJoin(at, ", "),
                               "]> : ", TypeOf({pairs}, I64())));
  };
  std::string m = l.Constant(0, {n * n}, t);
  m = ScatterFlat(l, m, n * n, index(upper), v, pairs, false, t);
  m = ScatterFlat(l, m, n * n, index(lower), v, pairs, false, t);
  return l.Reshape(m, {n * n}, {n, n}, t);
}

// The reduction's scale of a loss's gradient: grad_output, a scalar for
// mean and sum (and a 0-d gradient), else one per sample (dims `rows`).
absl::StatusOr<std::string> LossGradScale(Lowering& l, const Args& a,
                                          const std::vector<int64_t>& dims,
                                          int64_t rows_axis, const HloType& t) {
  const std::vector<int64_t> gd = DimsOf(a["grad_output"].tensor);
  int64_t n = 1;
  for (int64_t v : gd) n *= v;
  if (n == 1) {
    absl::StatusOr<std::string> g = l.Operand(a["grad_output"], gd, t);
    if (!g.ok()) return g;
    return l.BroadcastTo(l.Reshape(*g, gd, {}, t), {}, dims, t);
  }
  if (gd.size() != 1 || rows_axis < 0 || gd[0] != dims[rows_axis])
    return Unsupported(l.op(), "a gradient of another shape");
  absl::StatusOr<std::string> g = l.Operand(a["grad_output"], gd, t);
  if (!g.ok()) return g;
  return BroadcastInDim(l, *g, gd, dims, {rows_axis}, t);
}

// multilabel_margin_loss's pairs: for a sample (row) of x, each target
// entry k (the target row's entries before its first -1) naming class j,
// and each class i that no entry names: z = 1 - x[j] + x[i], counted where
// it is positive. Samples are (N, C); a 1-d input is one sample.
struct MultilabelPairs {
  std::vector<int64_t> in, xd, full;  // full: (N, k, i)
  std::string onehot;                 // (N, k, c): valid entry k names c
  std::string z, pair;                // (N, k, i)
};

absl::StatusOr<MultilabelPairs> MultilabelPairsOf(Lowering& l, const Args& a,
                                                  const HloType& t) {
  MultilabelPairs r;
  r.in = DimsOf(a["self"].tensor);
  if (r.in.size() > 2 || DimsOf(a["target"].tensor) != r.in)
    return Unsupported(l.op(), "an input of another rank");
  const int64_t n = r.in.size() == 2 ? r.in[0] : 1,
                cls = r.in.empty() ? 1 : r.in.back();
  if (n * cls == 0) return Unsupported(l.op(), "an empty input");
  r.xd = {n, cls};
  r.full = {n, cls, cls};
  const std::vector<int64_t>&xd = r.xd, &full = r.full, rows = {n};
  const HloType& i1 = *DTypeOf(tpu::DType::kBool);
  const HloType& i64 = I64();
  absl::StatusOr<std::string> x = l.Operand(a["self"], r.in, t),
                              y = l.Operand(a["target"], r.in, i64);
  if (!x.ok()) return x.status();
  if (!y.ok()) return y.status();
  const std::string xv = l.Reshape(*x, r.in, xd, t),
                    yv = l.Reshape(*y, r.in, xd, i64);
  const std::string end = l.ReduceOver(
      l.Select(l.Compare("LT", yv, l.Constant(0, xd, i64), xd, i64),
               l.Iota(1, xd, i64), l.Constant(cls, xd, i64), xd, i64),
      xd, {1}, "minimum", l.Constant(cls, {}, i64), i64);
  const std::string valid =
      l.Compare("LT", l.Iota(1, xd, i64),
                BroadcastInDim(l, end, rows, xd, {0}, i64), xd, i64);
  r.onehot =
      l.Binary("and",
               l.Compare("EQ", BroadcastInDim(l, yv, xd, full, {0, 1}, i64),
                         l.Iota(2, full, i64), full, i64),
               BroadcastInDim(l, valid, xd, full, {0, 1}, i1), full, i1);
  const std::string zf = l.Constant(0, full, t);
  const std::string xk = l.ReduceOver(
      l.Select(r.onehot, BroadcastInDim(l, xv, xd, full, {0, 2}, t), zf, full,
               t),
      full, {2}, "add", l.Constant(0, {}, t), t);
  // a class is a target where any valid entry names it
  const std::string named =
      l.ReduceOver(l.Convert(r.onehot, full, i1, i64), full, {1}, "maximum",
                   l.Constant(0, {}, i64), i64);
  r.z = l.Binary("add",
                 l.Binary("subtract", l.Constant(1, full, t),
                          BroadcastInDim(l, xk, xd, full, {0, 1}, t), full, t),
                 BroadcastInDim(l, xv, xd, full, {0, 2}, t), full, t);
  r.pair = l.Binary(
      "and",
      l.Binary("and", BroadcastInDim(l, valid, xd, full, {0, 1}, i1),
               l.Compare("EQ", BroadcastInDim(l, named, xd, full, {0, 2}, i64),
                         l.Constant(0, full, i64), full, i64),
               full, i1),
      l.Compare("GT", r.z, zf, full, t), full, i1);
  return r;
}

}  // namespace

void RegisterNnBackward(OpRegistry& reg) {
  // _cdist_backward(grad, x1, x2, p, cdist): the gradient for x1 (autograd
  // asks for x2's with the roles swapped).
  reg.Add("aten::_cdist_backward",
          [](Lowering& l, const tpu::DecodedOp& d,
             const Target& o) -> absl::StatusOr<std::string> {
            const Args a(l);
            for (const char* n : {"grad", "x1", "x2", "cdist"})
              if (!a.Defined(n))
                return Unsupported(l.op(), "arguments of a form not lowered");
            const std::vector<int64_t> d1 = DimsOf(a["x1"].tensor),
                                       d2 = DimsOf(a["x2"].tensor),
                                       gd = DimsOf(a["grad"].tensor);
            const size_t nb = d1.size() - 2;
            if (d1.size() < 2 || d2.size() != d1.size() || o.dims != d1 ||
                !std::equal(d1.begin(), d1.begin() + nb, d2.begin()) ||
                d1[nb + 1] != d2[nb + 1] || gd.size() != d1.size() ||
                gd[nb] != d1[nb] || gd[nb + 1] != d2[nb] ||
                DimsOf(a["cdist"].tensor) != gd)
              return Unsupported(l.op(), "batches that broadcast");
            const HloType& t = *o.type;
            int64_t n = 1;
            for (int64_t v : o.dims) n *= v;
            if (n == 0 || d2[nb] == 0) return l.Constant(0, o.dims, t);
            absl::StatusOr<std::string> g = l.Operand(a["grad"], gd, t),
                                        x1 = l.Operand(a["x1"], d1, t),
                                        x2 = l.Operand(a["x2"], d2, t),
                                        dist = l.Operand(a["cdist"], gd, t);
            for (auto* v : {&g, &x1, &x2, &dist})
              if (!v->ok()) return v->status();
            return DistBackward(l, *g, *x1, *x2, *dist, d1, d2,
                                NumberOf(a["p"]), t);
          });
  reg.Alias("aten::_cdist_backward.out", "aten::_cdist_backward");
  // _pdist_backward(grad, self, p, pdist): pair (i, j) pulls row i one way
  // and row j the other: cdist's backward of the squared-up pairs.
  reg.Add("aten::_pdist_backward",
          [](Lowering& l, const tpu::DecodedOp& d,
             const Target& o) -> absl::StatusOr<std::string> {
            const Args a(l);
            for (const char* n : {"grad", "self", "pdist"})
              if (!a.Defined(n))
                return Unsupported(l.op(), "arguments of a form not lowered");
            const std::vector<int64_t> in = DimsOf(a["self"].tensor);
            const HloType& t = *o.type;
            if (in.size() != 2 || o.dims != in)
              return Unsupported(l.op(), "expects a matrix");
            const int64_t n = in[0], pairs = n * (n - 1) / 2;
            if (DimsOf(a["grad"].tensor) != std::vector<int64_t>{pairs} ||
                DimsOf(a["pdist"].tensor) != std::vector<int64_t>{pairs})
              return absl::InvalidArgumentError(absl::StrCat(
                  l.op(), ": the gradient does not hold every pair"));
            if (pairs == 0 || in[1] == 0) return l.Constant(0, o.dims, t);
            if (pairs > (int64_t{1} << 16))
              return Unsupported(l.op(), "more than 65536 pairs");
            absl::StatusOr<std::string> g = l.Operand(a["grad"], {pairs}, t),
                                        x = l.Operand(a["self"], in, t),
                                        dist =
                                            l.Operand(a["pdist"], {pairs}, t);
            for (auto* v : {&g, &x, &dist})
              if (!v->ok()) return v->status();
            return DistBackward(l, Square(l, *g, n, t), *x, *x,
                                Square(l, *dist, n, t), in, in,
                                NumberOf(a["p"]), t);
          });
  reg.Alias("aten::_pdist_backward.out", "aten::_pdist_backward");
  // multi_margin_loss_backward(grad_output, self, target, p, margin, weight,
  // reduction): class j != y of a sample whose margin - x[y] + x[j] > 0
  // gets h = g (p = 1) or 2 g z (p = 2), times weight[y], and class y minus
  // their sum; g = 1 / C (1 / (N C) for the mean).
  reg.Add(
      "aten::multi_margin_loss_backward",
      [](Lowering& l, const tpu::DecodedOp& d,
         const Target& o) -> absl::StatusOr<std::string> {
        const Args a(l);
        if (!a.Defined("grad_output") || !a.Defined("self") ||
            !a.Defined("target"))
          return Unsupported(l.op(), "arguments of a form not lowered");
        const std::vector<int64_t> in = DimsOf(a["self"].tensor);
        const HloType& t = *o.type;
        if (in.size() > 2 || o.dims != in)
          return Unsupported(l.op(), "an input of another rank");
        const int64_t n = in.size() == 2 ? in[0] : 1,
                      cls = in.empty() ? 1 : in.back();
        const std::vector<int64_t> xd = {n, cls}, rows = {n};
        if (n * cls == 0) return l.Constant(0, o.dims, t);
        const int64_t p = static_cast<int64_t>(a.Number("p", 1));
        if (p != 1 && p != 2)
          return absl::InvalidArgumentError("only p == 1 and p == 2 supported");
        const int64_t reduction = a.Int("reduction", 1);
        absl::StatusOr<std::string> x = l.Operand(a["self"], in, t),
                                    y = l.Operand(a["target"], rows, I64());
        if (!x.ok()) return x;
        if (!y.ok()) return y;
        const std::string xv = l.Reshape(*x, in, xd, t);
        const HloType& i1 = *DTypeOf(tpu::DType::kBool);
        const std::string is_y =
            l.Compare("EQ", l.Iota(1, xd, I64()),
                      BroadcastInDim(l, *y, rows, xd, {0}, I64()), xd, I64());
        const std::string zero = l.Constant(0, xd, t);
        const std::string xy =
            l.ReduceOver(l.Select(is_y, xv, zero, xd, t), xd, {1}, "add",
                         l.Constant(0, {}, t), t);
        const std::string z = l.Binary(
            "add",
            l.Binary("subtract", l.Constant(a.Number("margin", 1), xd, t),
                     BroadcastInDim(l, xy, rows, xd, {0}, t), xd, t),
            xv, xd, t);
        const double g =
            1.0 / static_cast<double>(reduction == 1 ? n * cls : cls);
        std::string h =
            p == 1 ? l.Constant(g, xd, t)
                   : l.Binary("multiply", l.Constant(2 * g, xd, t), z, xd, t);
        if (a.Defined("weight")) {
          absl::StatusOr<std::string> w = l.Operand(a["weight"], {cls}, t);
          if (!w.ok()) return w;
          const std::string wy = l.ReduceOver(
              l.Select(is_y, BroadcastInDim(l, *w, {cls}, xd, {1}, t), zero, xd,
                       t),
              xd, {1}, "add", l.Constant(0, {}, t), t);
          h = l.Binary("multiply", h, BroadcastInDim(l, wy, rows, xd, {0}, t),
                       xd, t);
        }
        const std::string on = l.Binary("and", l.Compare("GT", z, zero, xd, t),
                                        l.Unary("not", is_y, xd, i1), xd, i1);
        const std::string others = l.Select(on, h, zero, xd, t);
        const std::string total =
            l.ReduceOver(others, xd, {1}, "add", l.Constant(0, {}, t), t);
        std::string gi =
            l.Select(is_y,
                     l.Unary("negate",
                             BroadcastInDim(l, total, rows, xd, {0}, t), xd, t),
                     others, xd, t);
        absl::StatusOr<std::string> scale =
            LossGradScale(l, a, xd, in.size() == 2 ? 0 : -1, t);
        if (!scale.ok()) return scale;
        gi = l.Binary("multiply", gi, *scale, xd, t);
        return l.Reshape(gi, xd, o.dims, t);
      });
  reg.Alias("aten::multi_margin_loss_backward.grad_input",
            "aten::multi_margin_loss_backward");
  // multilabel_margin_loss_backward(grad_output, self, target, reduction,
  // is_target): each (target entry, class) pair that counts moves its class
  // up by g and its entry's class down by g; g = 1 / C (1 / (N C) for the
  // mean).
  reg.Add(
      "aten::multilabel_margin_loss_backward",
      [](Lowering& l, const tpu::DecodedOp& d,
         const Target& o) -> absl::StatusOr<std::string> {
        const Args a(l);
        if (!a.Defined("grad_output") || !a.Defined("self") ||
            !a.Defined("target"))
          return Unsupported(l.op(), "arguments of a form not lowered");
        absl::StatusOr<MultilabelPairs> mp = MultilabelPairsOf(l, a, *o.type);
        if (!mp.ok()) return mp.status();
        const HloType& t = *o.type;
        const std::vector<int64_t>& xd = mp->xd;
        const std::vector<int64_t>& full = mp->full;
        const std::string zf = l.Constant(0, full, t);
        const std::string ones =
            l.Select(mp->pair, l.Constant(1, full, t), zf, full, t);
        const std::string up =
            l.ReduceOver(ones, full, {1}, "add", l.Constant(0, {}, t), t);
        const std::string per_entry =
            l.ReduceOver(ones, full, {2}, "add", l.Constant(0, {}, t), t);
        const std::string down = l.ReduceOver(
            l.Select(mp->onehot,
                     BroadcastInDim(l, per_entry, xd, full, {0, 1}, t), zf,
                     full, t),
            full, {1}, "add", l.Constant(0, {}, t), t);
        const int64_t reduction = a.Int("reduction", 1);
        const double g =
            1.0 / static_cast<double>(reduction == 1 ? xd[0] * xd[1] : xd[1]);
        std::string gi = l.Binary("multiply", l.Constant(g, xd, t),
                                  l.Binary("subtract", up, down, xd, t), xd, t);
        absl::StatusOr<std::string> scale =
            LossGradScale(l, a, xd, mp->in.size() == 2 ? 0 : -1, t);
        if (!scale.ok()) return scale;
        gi = l.Binary("multiply", gi, *scale, xd, t);
        return l.Reshape(gi, xd, o.dims, t);
      });
  // multilabel_margin_loss_forward(self, target, reduction) -> (output,
  // is_target): the sum over the pairs that count of 1 - x[j] + x[i], over
  // C, per sample (reduced); is_target marks each row's target classes.
  // (PyTorch's decomposition of it disagrees with its CPU kernel where a
  // row names every class.)
  reg.AddMulti(
      "aten::multilabel_margin_loss_forward",
      [](Lowering& l, const tpu::DecodedOp& d, const std::vector<Target>& o)
          -> absl::StatusOr<std::vector<std::string>> {
        const Args a(l);
        if (o.size() != 2 || !a.Defined("self") || !a.Defined("target"))
          return Unsupported(l.op(), "arguments of a form not lowered");
        const HloType& t = *o[0].type;
        absl::StatusOr<MultilabelPairs> mp = MultilabelPairsOf(l, a, t);
        if (!mp.ok()) return mp.status();
        const std::vector<int64_t>& xd = mp->xd;
        const std::vector<int64_t>& full = mp->full;
        const std::vector<int64_t> rows = {xd[0]};
        const std::string zf = l.Constant(0, full, t);
        const std::string per_row =
            l.Binary("divide",
                     l.ReduceOver(l.Select(mp->pair, mp->z, zf, full, t), full,
                                  {1, 2}, "add", l.Constant(0, {}, t), t),
                     l.Constant(static_cast<double>(xd[1]), rows, t), rows, t);
        const int64_t reduction = a.Int("reduction", 1);
        std::string out;
        if (reduction == 0) {
          out = l.Reshape(per_row, rows, o[0].dims, t);
        } else {
          out =
              l.ReduceOver(per_row, rows, {0}, "add", l.Constant(0, {}, t), t);
          if (reduction == 1) {
            out =
                l.Binary("divide", out,
                         l.Constant(static_cast<double>(xd[0]), {}, t), {}, t);
          }
          out = l.Reshape(out, {}, o[0].dims, t);
        }
        const HloType& i1 = *DTypeOf(tpu::DType::kBool);
        const std::string marked =
            l.ReduceOver(l.Convert(mp->onehot, full, i1, t), full, {1},
                         "maximum", l.Constant(0, {}, t), t);
        return std::vector<std::string>{
            out,
            l.Convert(l.Reshape(marked, xd, mp->in, t), mp->in, t, *o[1].type)};
      });
  reg.Alias("aten::multilabel_margin_loss_backward.grad_input",
            "aten::multilabel_margin_loss_backward");
  reg.Alias("aten::multilabel_margin_loss_forward.output",
            "aten::multilabel_margin_loss_forward");
}

}  // namespace tpud::pjrt
