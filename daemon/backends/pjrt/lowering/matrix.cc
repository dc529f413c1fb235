#include "daemon/backends/pjrt/lowering/matrix.h"

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
#include "daemon/backends/pjrt/lowering/helpers.h"
#include "daemon/backends/pjrt/lowering/lowering.h"

namespace tpud::pjrt {

std::string Triangle(Lowering& l, const std::string& v,
                     const std::vector<int64_t>& in, bool lower,
                     const HloType& t) {
  const HloType& i64 = I64();
  const int64_t r = static_cast<int64_t>(in.size());
  const std::string i = l.Iota(r - 2, in, i64), j = l.Iota(r - 1, in, i64);
  const std::string keep = l.Compare(lower ? "GE" : "LE", i, j, in, i64);
  return l.Select(keep, v, l.Constant(0, in, t), in, t);
}

std::string Cholesky(Lowering& l, const std::string& v,
                     const std::vector<int64_t>& in, bool upper,
                     const HloType& t) {
  const std::string c = l.Emit(absl::StrCat(
      "stablehlo.cholesky ", v, ", lower = ", upper ? "false" : "true", " : ",
      TypeOf(in, t)));
  return Triangle(l, c, in, !upper, t);
}

std::string TriangularSolve(Lowering& l, const std::string& a,
                            const std::vector<int64_t>& ad,
                            const std::string& b,
                            const std::vector<int64_t>& bd, bool left,
                            bool lower, bool unit, bool adjoint,
                            const HloType& t) {
  const char* op = !adjoint       ? "NO_TRANSPOSE"
                   : IsComplex(t) ? "ADJOINT"
                                  : "TRANSPOSE";
  return l.Emit(absl::StrCat("\"stablehlo.triangular_solve\"(", a, ", ", b,
                             ") {left_side = ", left ? "true" : "false",
                             ", lower = ", lower ? "true" : "false",
                             ", unit_diagonal = ", unit ? "true" : "false",
                             ", transpose_a = #stablehlo<transpose ", op,
                             ">} : (", TypeOf(ad, t), ", ", TypeOf(bd, t),
                             ") -> ", TypeOf(bd, t)));
}

std::vector<int64_t> WithBatch(const std::vector<int64_t>& dims,
                               const std::vector<int64_t>& batch) {
  std::vector<int64_t> r = batch;
  r.insert(r.end(), dims.end() - 2, dims.end());
  return r;
}

absl::StatusOr<std::string> MatrixOperand(Lowering& l, const tpu::OpArg& a,
                                          const std::vector<int64_t>& batch,
                                          const HloType& t) {
  if (a.tag != tpu::ArgTag::kTensor || a.tensor.ndim < 2)
    return Unsupported(l.op(), "expects a matrix or a batch of them");
  const std::vector<int64_t> dims = DimsOf(a.tensor);
  absl::StatusOr<std::string> v = l.Operand(a, dims, t);
  if (!v.ok()) return v;
  return l.BroadcastTo(*v, dims, WithBatch(dims, batch), t);
}

std::vector<int64_t> BatchOf(const std::vector<int64_t>& dims) {
  return dims.size() < 2 ? std::vector<int64_t>{}
                         : std::vector<int64_t>(dims.begin(), dims.end() - 2);
}

std::string Identity(Lowering& l, const std::vector<int64_t>& dims,
                     const HloType& t) {
  const HloType& i64 = I64();
  const int64_t r = static_cast<int64_t>(dims.size());
  const std::string eq = l.Compare("EQ", l.Iota(r - 2, dims, i64),
                                   l.Iota(r - 1, dims, i64), dims, i64);
  return l.Select(eq, l.Constant(1, dims, t), l.Constant(0, dims, t), dims, t);
}

std::string BroadcastInDim(Lowering& l, const std::string& v,
                           const std::vector<int64_t>& from,
                           const std::vector<int64_t>& to,
                           const std::vector<int64_t>& map, const HloType& t) {
  if (from == to) return v;
  return l.Emit(absl::StrCat("stablehlo.broadcast_in_dim ", v, ", dims = [",
                             absl::StrJoin(map, ", "), "] : (", TypeOf(from, t),
                             ") -> ", TypeOf(to, t)));
}

std::string SwapRows(Lowering& l, const std::string& x, const MatrixShape& s,
                     const std::string& j, const std::string& p,
                     const HloType& t) {
  const HloType& i64 = I64();
  const std::string ri = l.Iota(s.rank() - 2, s.dims, i64);
  const std::string at_j = l.Compare(
      "EQ", ri, BroadcastInDim(l, j, s.batch, s.dims, s.batch_map, i64), s.dims,
      i64);
  const std::string at_p = l.Compare(
      "EQ", ri, BroadcastInDim(l, p, s.batch, s.dims, s.batch_map, i64), s.dims,
      i64);
  const std::string zero = l.Constant(0, s.dims, t);
  const int64_t rows = s.rank() - 2;
  const std::string row_j =
      l.ReduceOver(l.Select(at_j, x, zero, s.dims, t), s.dims, {rows}, "add",
                   l.Constant(0, {}, t), t);
  const std::string row_p =
      l.ReduceOver(l.Select(at_p, x, zero, s.dims, t), s.dims, {rows}, "add",
                   l.Constant(0, {}, t), t);
  const std::string bj = BroadcastInDim(l, row_j, s.row, s.dims, s.row_map, t);
  const std::string bp = BroadcastInDim(l, row_p, s.row, s.dims, s.row_map, t);
  return l.Select(at_j, bp, l.Select(at_p, bj, x, s.dims, t), s.dims, t);
}

std::vector<std::string> WhileLoop(
    Lowering& l, const std::vector<std::string>& init,
    const std::vector<std::string>& types,
    const std::function<std::string(const std::vector<std::string>& state)>&
        going,
    const std::function<std::vector<std::string>(
        const std::vector<std::string>& state)>& step) {
  const int id = l.NextId();
  std::vector<std::string> args, inits;
  for (size_t q = 0; q < init.size(); ++q) {
    args.push_back(absl::StrCat("%w", id, "s", q));
    inits.push_back(absl::StrCat(args.back(), " = ", init[q]));
  }
  std::string more;
  const std::string cond = l.Region([&] { more = going(args); });
  std::vector<std::string> next;
  const std::string body = l.Region([&] { next = step(args); });
  const std::string ts = absl::StrJoin(types, ", ");
  const std::string loop = l.EmitResults(
      absl::StrCat("stablehlo.while(", absl::StrJoin(inits, ", "), ") : ", ts,
                   "\n    cond {\n", cond, "      stablehlo.return ", more,
                   " : tensor<i1>\n    } do {\n", body,
                   "      stablehlo.return ", absl::StrJoin(next, ", "), " : ",
                   ts, "\n    }"),
      static_cast<int>(types.size()));
  std::vector<std::string> out;
  for (size_t q = 0; q < init.size(); ++q)
    out.push_back(absl::StrCat(loop, "#", q));
  return out;
}

std::vector<std::string> CountedLoop(
    Lowering& l, int64_t count, const std::vector<std::string>& init,
    const std::vector<std::string>& types,
    const std::function<std::vector<std::string>(
        const std::string& j, const std::vector<std::string>& state)>& step) {
  const HloType& i64 = I64();
  std::vector<std::string> all_init = {l.Constant(0, {}, i64)};
  all_init.insert(all_init.end(), init.begin(), init.end());
  std::vector<std::string> all_types = {TypeOf({}, i64)};
  all_types.insert(all_types.end(), types.begin(), types.end());
  std::vector<std::string> out = WhileLoop(
      l, all_init, all_types,
      [&](const std::vector<std::string>& st) {
        return l.Compare("LT", st[0],
                         l.Constant(static_cast<double>(count), {}, i64), {},
                         i64);
      },
      [&](const std::vector<std::string>& st) {
        std::vector<std::string> next =
            step(st[0], std::vector<std::string>(st.begin() + 1, st.end()));
        next.insert(next.begin(),
                    l.Binary("add", st[0], l.Constant(1, {}, i64), {}, i64));
        return next;
      });
  out.erase(out.begin());
  return out;
}

Lu LuFactor(Lowering& l, const std::string& a, const MatrixShape& s,
            const HloType& t) {
  const HloType& i64 = I64();
  const HloType& i1 = *DTypeOf(tpu::DType::kBool);
  const int64_t k = std::min(s.m, s.n);
  std::vector<int64_t> pdims = s.batch;
  pdims.push_back(k);
  const int64_t rows = s.rank() - 2, cols = s.rank() - 1;
  const std::vector<std::string> state = CountedLoop(
      l, k, {a, l.Constant(0, pdims, i64), l.Constant(0, s.batch, i64)},
      {TypeOf(s.dims, t), TypeOf(pdims, i64), TypeOf(s.batch, i64)},
      [&](const std::string& j, const std::vector<std::string>& st) {
        const std::string& x = st[0];
        const std::string jd = l.BroadcastTo(j, {}, s.dims, i64),
                          jc = l.BroadcastTo(j, {}, s.col, i64);
        const std::string ri = l.Iota(rows, s.dims, i64),
                          ci = l.Iota(cols, s.dims, i64);
        const std::string is_col = l.Compare("EQ", ci, jd, s.dims, i64);
        const std::string zero = l.Constant(0, s.dims, t),
                          zs = l.Constant(0, {}, t);
        // Column j, and the first row at or below j of its largest magnitude.
        const std::string colv = l.ReduceOver(
            l.Select(is_col, x, zero, s.dims, t), s.dims, {cols}, "add", zs, t);
        const std::string below =
            l.Compare("GE", l.Iota(rows, s.col, i64), jc, s.col, i64);
        const HloType& rt = RealOf(t);
        const std::string mag = l.Select(below, Cabs1(l, colv, s.col, t),
                                         l.Constant(-1, s.col, rt), s.col, rt);
        const std::string top =
            l.ReduceOver(mag, s.col, {rows}, "maximum", l.Lowest(rt), rt);
        const std::string hit = l.Compare(
            "EQ", mag, BroadcastInDim(l, top, s.batch, s.col, s.batch_map, rt),
            s.col, rt);
        const std::string p = l.ReduceOver(
            l.Select(hit, l.Iota(rows, s.col, i64),
                     l.Constant(static_cast<double>(s.m), s.col, i64), s.col,
                     i64),
            s.col, {rows}, "minimum",
            l.Constant(static_cast<double>(s.m), {}, i64), i64);
        // (A column of NaN has no largest: it keeps row j.)
        const std::string pj = l.Select(
            l.Compare("LT", p,
                      l.Constant(static_cast<double>(s.m), s.batch, i64),
                      s.batch, i64),
            p, l.BroadcastTo(j, {}, s.batch, i64), s.batch, i64);
        const std::string x1 =
            SwapRows(l, x, s, l.BroadcastTo(j, {}, s.batch, i64), pj, t);
        const std::string colv1 =
            l.ReduceOver(l.Select(is_col, x1, zero, s.dims, t), s.dims, {cols},
                         "add", zs, t);
        const std::string at_j =
            l.Compare("EQ", l.Iota(rows, s.col, i64), jc, s.col, i64);
        const std::string pv = l.ReduceOver(
            l.Select(at_j, colv1, l.Constant(0, s.col, t), s.col, t), s.col,
            {rows}, "add", zs, t);
        const std::string nonzero =
            l.Compare("NE", pv, l.Constant(0, s.batch, t), s.batch, t);
        const std::string inv =
            l.Binary("divide", l.Constant(1, s.batch, t), pv, s.batch, t);
        const std::string scaled = l.Binary(
            "multiply", colv1,
            BroadcastInDim(l, inv, s.batch, s.col, s.batch_map, t), s.col, t);
        const std::string lcol = l.Select(
            BroadcastInDim(l, nonzero, s.batch, s.col, s.batch_map, i1), scaled,
            colv1, s.col, t);
        const std::string row_j = l.ReduceOver(
            l.Select(l.Compare("EQ", ri, jd, s.dims, i64), x1, zero, s.dims, t),
            s.dims, {rows}, "add", zs, t);
        const std::string lb =
            BroadcastInDim(l, lcol, s.col, s.dims, s.col_map, t);
        const std::string rb =
            BroadcastInDim(l, row_j, s.row, s.dims, s.row_map, t);
        const std::string below_j = l.Compare("GT", ri, jd, s.dims, i64);
        const std::string right_j = l.Compare("GT", ci, jd, s.dims, i64);
        const std::string trailing =
            l.Binary("and", below_j, right_j, s.dims, i1);
        std::string x2 = l.Select(
            trailing,
            l.Binary("subtract", x1, l.Binary("multiply", lb, rb, s.dims, t),
                     s.dims, t),
            x1, s.dims, t);
        x2 = l.Select(l.Binary("and", below_j, is_col, s.dims, i1), lb, x2,
                      s.dims, t);
        const std::string is_k = l.Compare(
            "EQ", l.Iota(static_cast<int64_t>(pdims.size() - 1), pdims, i64),
            l.BroadcastTo(j, {}, pdims, i64), pdims, i64);
        const std::string one_based =
            l.Binary("add", pj, l.Constant(1, s.batch, i64), s.batch, i64);
        const std::string piv = l.Select(
            is_k,
            BroadcastInDim(l, one_based, s.batch, pdims, s.batch_map, i64),
            st[1], pdims, i64);
        const std::string first = l.Binary(
            "and",
            l.Compare("EQ", st[2], l.Constant(0, s.batch, i64), s.batch, i64),
            l.Unary("not", nonzero, s.batch, i1), s.batch, i1);
        const std::string info =
            l.Select(first,
                     l.Binary("add", l.BroadcastTo(j, {}, s.batch, i64),
                              l.Constant(1, s.batch, i64), s.batch, i64),
                     st[2], s.batch, i64);
        return std::vector<std::string>{x2, piv, info};
      });
  return {state[0], state[1], state[2]};
}

std::string ApplySwaps(Lowering& l, const std::string& x, const MatrixShape& s,
                       const std::string& pivots, int64_t k, bool reversed,
                       const HloType& t) {
  const HloType& i64 = I64();
  std::vector<int64_t> pdims = s.batch;
  pdims.push_back(k);
  return CountedLoop(
      l, k, {x}, {TypeOf(s.dims, t)},
      [&](const std::string& step, const std::vector<std::string>& st) {
        const std::string j =
            reversed ? l.Binary("subtract",
                                l.Constant(static_cast<double>(k - 1), {}, i64),
                                step, {}, i64)
                     : step;
        const std::string is_j = l.Compare(
            "EQ", l.Iota(static_cast<int64_t>(pdims.size() - 1), pdims, i64),
            l.BroadcastTo(j, {}, pdims, i64), pdims, i64);
        const std::string p = l.ReduceOver(
            l.Select(is_j, pivots, l.Constant(0, pdims, i64), pdims, i64),
            pdims, {static_cast<int64_t>(pdims.size() - 1)}, "add",
            l.Constant(0, {}, i64), i64);
        const std::string p0 =
            l.Binary("subtract", p, l.Constant(1, s.batch, i64), s.batch, i64);
        return std::vector<std::string>{
            SwapRows(l, st[0], s, l.BroadcastTo(j, {}, s.batch, i64), p0, t)};
      })[0];
}

std::string Transposed(Lowering& l, const std::string& v,
                       const std::vector<int64_t>& in, const HloType& t) {
  const size_t r = in.size();
  std::vector<int64_t> perm, out = in;
  for (size_t q = 0; q < r; ++q) perm.push_back(static_cast<int64_t>(q));
  std::swap(perm[r - 1], perm[r - 2]);
  std::swap(out[r - 1], out[r - 2]);
  return l.Emit(absl::StrCat("stablehlo.transpose ", v, ", dims = [",
                             absl::StrJoin(perm, ", "), "] : (", TypeOf(in, t),
                             ") -> ", TypeOf(out, t)));
}

std::string Adjoint(Lowering& l, const std::string& v,
                    const std::vector<int64_t>& in, const HloType& t) {
  std::vector<int64_t> out = in;
  std::swap(out[out.size() - 1], out[out.size() - 2]);
  return Conj(l, Transposed(l, v, in, t), out, t);
}

std::string LuSolve(Lowering& l, const std::string& lu,
                    const std::vector<int64_t>& ad, const std::string& pivots,
                    const std::string& b, const MatrixShape& bs, bool adjoint,
                    const HloType& t) {
  const int64_t n = ad.back();
  if (!adjoint) {
    const std::string pb = ApplySwaps(l, b, bs, pivots, n, false, t);
    const std::string y =
        TriangularSolve(l, lu, ad, pb, bs.dims, true, true, true, false, t);
    return TriangularSolve(l, lu, ad, y, bs.dims, true, false, false, false, t);
  }
  // A^H X = B: U^H L^H P^T X = B.
  const std::string y =
      TriangularSolve(l, lu, ad, b, bs.dims, true, false, false, true, t);
  const std::string z =
      TriangularSolve(l, lu, ad, y, bs.dims, true, true, true, true, t);
  return ApplySwaps(l, z, bs, pivots, n, true, t);
}

std::string ReflectorOf(Lowering& l, const std::string& a, const MatrixShape& s,
                        const std::string& j, const HloType& t) {
  const HloType& i64 = I64();
  const int64_t rows = s.rank() - 2, cols = s.rank() - 1;
  const std::string jd = l.BroadcastTo(j, {}, s.dims, i64);
  const std::string colv = l.ReduceOver(
      l.Select(l.Compare("EQ", l.Iota(cols, s.dims, i64), jd, s.dims, i64), a,
               l.Constant(0, s.dims, t), s.dims, t),
      s.dims, {cols}, "add", l.Constant(0, {}, t), t);
  const std::string ri = l.Iota(rows, s.col, i64),
                    jc = l.BroadcastTo(j, {}, s.col, i64);
  return l.Select(
      l.Compare("GT", ri, jc, s.col, i64), colv,
      l.Select(l.Compare("EQ", ri, jc, s.col, i64), l.Constant(1, s.col, t),
               l.Constant(0, s.col, t), s.col, t),
      s.col, t);
}

std::string Reflect(Lowering& l, const std::string& c, const MatrixShape& cs,
                    const std::string& v, const std::string& tau,
                    const HloType& t) {
  const int64_t rows = cs.rank() - 2;
  const std::string vb = BroadcastInDim(l, v, cs.col, cs.dims, cs.col_map, t);
  const std::string w =
      l.ReduceOver(l.Binary("multiply", Conj(l, vb, cs.dims, t), c, cs.dims, t),
                   cs.dims, {rows}, "add", l.Constant(0, {}, t), t);
  const std::string tw = l.Binary(
      "multiply", BroadcastInDim(l, tau, cs.batch, cs.row, cs.batch_map, t), w,
      cs.row, t);
  return l.Binary(
      "subtract", c,
      l.Binary("multiply", vb,
               BroadcastInDim(l, tw, cs.row, cs.dims, cs.row_map, t), cs.dims,
               t),
      cs.dims, t);
}

std::string ElementAt(Lowering& l, const std::string& v,
                      const std::vector<int64_t>& vd, const std::string& j,
                      const HloType& t) {
  const HloType& i64 = I64();
  const int64_t last = static_cast<int64_t>(vd.size() - 1);
  return l.ReduceOver(
      l.Select(l.Compare("EQ", l.Iota(last, vd, i64),
                         l.BroadcastTo(j, {}, vd, i64), vd, i64),
               v, l.Constant(0, vd, t), vd, t),
      vd, {last}, "add", l.Constant(0, {}, t), t);
}

Qr Geqrf(Lowering& l, const std::string& a, const MatrixShape& s,
         const HloType& t) {
  const HloType& i64 = I64();
  const HloType& i1 = *DTypeOf(tpu::DType::kBool);
  const int64_t k = std::min(s.m, s.n);
  std::vector<int64_t> td = s.batch;
  td.push_back(k);
  const int64_t rows = s.rank() - 2, cols = s.rank() - 1;
  const std::vector<std::string> st = CountedLoop(
      l, k, {a, l.Constant(0, td, t)}, {TypeOf(s.dims, t), TypeOf(td, t)},
      [&](const std::string& j, const std::vector<std::string>& state) {
        const std::string& x = state[0];
        const std::string jd = l.BroadcastTo(j, {}, s.dims, i64),
                          jc = l.BroadcastTo(j, {}, s.col, i64);
        const std::string ri = l.Iota(rows, s.col, i64);
        const std::string colv = l.ReduceOver(
            l.Select(
                l.Compare("EQ", l.Iota(cols, s.dims, i64), jd, s.dims, i64), x,
                l.Constant(0, s.dims, t), s.dims, t),
            s.dims, {cols}, "add", l.Constant(0, {}, t), t);
        const std::string zc = l.Constant(0, s.col, t),
                          zs = l.Constant(0, {}, t);
        const std::string alpha = l.ReduceOver(
            l.Select(l.Compare("EQ", ri, jc, s.col, i64), colv, zc, s.col, t),
            s.col, {rows}, "add", zs, t);
        const std::string tail =
            l.Select(l.Compare("GT", ri, jc, s.col, i64), colv, zc, s.col, t);
        // LAPACK's larfg: beta = -sign(re(alpha)) |(alpha, tail)|, real;
        // no reflection where the tail is zero and alpha real.
        const HloType& rt = RealOf(t);
        const std::string xnorm =
            l.Unary("sqrt",
                    l.ReduceOver(SquaredModulus(l, tail, s.col, t), s.col,
                                 {rows}, "add", l.Constant(0, {}, rt), rt),
                    s.batch, rt);
        const std::string norm =
            l.Unary("sqrt",
                    l.Binary("add", SquaredModulus(l, alpha, s.batch, t),
                             l.Binary("multiply", xnorm, xnorm, s.batch, rt),
                             s.batch, rt),
                    s.batch, rt);
        const bool complex = IsComplex(t);
        const std::string re = complex ? RealPart(l, alpha, s.batch, t) : alpha;
        const std::string neg =
            l.Compare("LT", re, l.Constant(0, s.batch, rt), s.batch, rt);
        const std::string beta =
            FromReal(l,
                     l.Select(neg, norm, l.Unary("negate", norm, s.batch, rt),
                              s.batch, rt),
                     s.batch, t);
        std::string plain =
            l.Compare("EQ", xnorm, l.Constant(0, s.batch, rt), s.batch, rt);
        if (complex)
          plain = l.Binary("and", plain,
                           l.Compare("EQ", ImagPart(l, alpha, s.batch, t),
                                     l.Constant(0, s.batch, rt), s.batch, rt),
                           s.batch, i1);
        const std::string tau = l.Select(
            plain, l.Constant(0, s.batch, t),
            l.Binary("divide", l.Binary("subtract", beta, alpha, s.batch, t),
                     beta, s.batch, t),
            s.batch, t);
        const std::string inv =
            l.Binary("divide", l.Constant(1, s.batch, t),
                     l.Binary("subtract", alpha, beta, s.batch, t), s.batch, t);
        const std::string scaled = l.Binary(
            "multiply", tail,
            BroadcastInDim(l, inv, s.batch, s.col, s.batch_map, t), s.col, t);
        const std::string vtail =
            l.Select(BroadcastInDim(l, plain, s.batch, s.col, s.batch_map, i1),
                     tail, scaled, s.col, t);
        const std::string v =
            l.Select(l.Compare("EQ", ri, jc, s.col, i64),
                     l.Constant(1, s.col, t), vtail, s.col, t);
        // The trailing columns reflected by H^H (R = Q^H A); column j
        // becomes beta over v.
        const std::string reflected =
            Reflect(l, x, s, v, Conj(l, tau, s.batch, t), t);
        const std::string cj = l.Iota(cols, s.dims, i64),
                          rj = l.Iota(rows, s.dims, i64);
        std::string x2 = l.Select(l.Compare("GT", cj, jd, s.dims, i64),
                                  reflected, x, s.dims, t);
        const std::string newcol = l.Select(
            l.Compare("EQ", ri, jc, s.col, i64),
            l.Select(BroadcastInDim(l, plain, s.batch, s.col, s.batch_map, i1),
                     BroadcastInDim(l, alpha, s.batch, s.col, s.batch_map, t),
                     BroadcastInDim(l, beta, s.batch, s.col, s.batch_map, t),
                     s.col, t),
            vtail, s.col, t);
        const std::string at_col =
            l.Binary("and", l.Compare("EQ", cj, jd, s.dims, i64),
                     l.Compare("GE", rj, jd, s.dims, i64), s.dims, i1);
        x2 = l.Select(at_col,
                      BroadcastInDim(l, newcol, s.col, s.dims, s.col_map, t),
                      x2, s.dims, t);
        const std::string taus = l.Select(
            l.Compare("EQ",
                      l.Iota(static_cast<int64_t>(td.size() - 1), td, i64),
                      l.BroadcastTo(j, {}, td, i64), td, i64),
            BroadcastInDim(l, tau, s.batch, td, s.batch_map, t), state[1], td,
            t);
        return std::vector<std::string>{x2, taus};
      });
  return {st[0], st[1]};
}

std::string ApplyQ(Lowering& l, const std::string& a, const MatrixShape& as,
                   const std::string& tau, int64_t k, const std::string& c,
                   const MatrixShape& cs, bool transposed, const HloType& t) {
  const HloType& i64 = I64();
  std::vector<int64_t> td = as.batch;
  td.push_back(k);
  return CountedLoop(
      l, k, {c}, {TypeOf(cs.dims, t)},
      [&](const std::string& step, const std::vector<std::string>& st) {
        const std::string j =
            transposed
                ? step
                : l.Binary("subtract",
                           l.Constant(static_cast<double>(k - 1), {}, i64),
                           step, {}, i64);
        const std::string v = ReflectorOf(l, a, as, j, t);
        // H^H = I - conj(tau) v v^H.
        std::string tj = ElementAt(l, tau, td, j, t);
        if (transposed) tj = Conj(l, tj, as.batch, t);
        return std::vector<std::string>{Reflect(l, st[0], cs, v, tj, t)};
      })[0];
}

std::string SwapSign(Lowering& l, const std::string& pivots,
                     const std::vector<int64_t>& batch, int64_t k,
                     const HloType& t) {
  const HloType& i64 = I64();
  std::vector<int64_t> pdims = batch;
  pdims.push_back(k);
  const int64_t last = static_cast<int64_t>(pdims.size() - 1);
  const std::string moved =
      l.Compare("NE", pivots,
                l.Binary("add", l.Iota(last, pdims, i64),
                         l.Constant(1, pdims, i64), pdims, i64),
                pdims, i64);
  const std::string count =
      l.ReduceOver(l.Select(moved, l.Constant(1, pdims, i64),
                            l.Constant(0, pdims, i64), pdims, i64),
                   pdims, {last}, "add", l.Constant(0, {}, i64), i64);
  const std::string odd = l.Compare(
      "EQ", l.Binary("remainder", count, l.Constant(2, batch, i64), batch, i64),
      l.Constant(1, batch, i64), batch, i64);
  return l.Select(odd, l.Constant(-1, batch, t), l.Constant(1, batch, t), batch,
                  t);
}

std::string Diagonal(Lowering& l, const std::string& x, const MatrixShape& s,
                     const HloType& t) {
  const HloType& i64 = I64();
  const std::string diag =
      l.Compare("EQ", l.Iota(s.rank() - 2, s.dims, i64),
                l.Iota(s.rank() - 1, s.dims, i64), s.dims, i64);
  return l.ReduceOver(l.Select(diag, x, l.Constant(0, s.dims, t), s.dims, t),
                      s.dims, {s.rank() - 2}, "add", l.Constant(0, {}, t), t);
}

}  // namespace tpud::pjrt
