// Symmetric (Hermitian) eigendecomposition through XLA's Eigh custom call,
// which its compilers expand into Jacobi rotations (EighExpander): the
// eigenvalues in ascending order and the eigenvectors as columns, as
// LAPACK's syevd / heevd give them (each vector up to its sign, or phase).
// The singular value decomposition from it, through the Hermitian matrix
// [[0, A], [A^H, 0]], whose eigenvalues are the singular values and their
// negatives (and |m - n| zeros) and whose eigenvector of sigma is [u; v] /
// sqrt(2): no A^H A, so no squared condition number.
#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "daemon/backends/pjrt/lowering/families.h"
#include "daemon/backends/pjrt/lowering/helpers.h"
#include "daemon/backends/pjrt/lowering/lowering.h"
#include "daemon/backends/pjrt/lowering/matrix.h"
#include "daemon/backends/pjrt/lowering/registry.h"

namespace tpud::pjrt {

// Eigenvectors (dims `in`, type t) and eigenvalues (`in` less its last
// dimension, real) of the symmetric (Hermitian) matrices `a` whose lower
// (or upper) triangle is read.
std::pair<std::string, std::string> Eigh(Lowering& l, const std::string& a,
                                         const std::vector<int64_t>& in,
                                         bool lower, const HloType& t) {
  std::vector<int64_t> values = in;
  values.pop_back();
  const HloType& rt = RealOf(t);
  if (rt.dtype == tpu::DType::kFloat) {
    // In double precision, rounded once at the end: a float32 Jacobi's
    // rounding reaches the eigenvectors, and through 1 / (w_i - w_j) their
    // gradients, several times over LAPACK's.
    const HloType& w = IsComplex(t) ? ComplexOf(F64()) : F64();
    auto [v, e] = Eigh(l, l.Convert(a, in, t, w), in, lower, w);
    return {l.Convert(v, in, w, t), l.Convert(e, values, F64(), rt)};
  }
  // backend_config: lower, sort the eigenvalues, sweeps at most, and the
  // off-diagonal norm (relative) the rotations stop at: the type's epsilon.
  const double tol = rt.dtype == tpu::DType::kDouble ? 2.220446049250313e-16
                                                     : 1.1920928955078125e-07;
  const std::string r = l.EmitResults(
      absl::StrFormat("stablehlo.custom_call @Eigh(%s) {backend_config = "
                      "\"%d,1,100,%.17g\"} : (%s) -> (%s, %s)",
                      a, lower ? 1 : 0, tol, TypeOf(in, t), TypeOf(in, t),
                      TypeOf(values, rt)),
      2);
  return {r + "#0", r + "#1"};
}

namespace {

// a and b (dims ad, bd) joined along `dim`.
std::string Joined(Lowering& l, const std::string& a,
                   const std::vector<int64_t>& ad, const std::string& b,
                   const std::vector<int64_t>& bd, int64_t dim,
                   const HloType& t) {
  std::vector<int64_t> out = ad;
  out[dim] += bd[dim];
  return l.Emit(absl::StrCat("stablehlo.concatenate ", a, ", ", b,
                             ", dim = ", dim, " : (", TypeOf(ad, t), ", ",
                             TypeOf(bd, t), ") -> ", TypeOf(out, t)));
}

std::string Reversed(Lowering& l, const std::string& v,
                     const std::vector<int64_t>& in, int64_t dim,
                     const HloType& t) {
  return l.Emit(absl::StrCat("stablehlo.reverse ", v, ", dims = [", dim,
                             "] : ", TypeOf(in, t)));
}

// The columns of x (dims batch + [r, c]) scaled to unit length (a zero
// column stays zero).
std::string UnitColumns(Lowering& l, const std::string& x,
                        const std::vector<int64_t>& in, const HloType& t) {
  const int64_t rows = static_cast<int64_t>(in.size()) - 2;
  const HloType& rt = RealOf(t);
  const std::string sq = SquaredModulus(l, x, in, t);
  std::vector<int64_t> cols = in;
  cols.erase(cols.begin() + rows);
  const std::string norm = l.Unary(
      "sqrt", l.ReduceOver(sq, in, {rows}, "add", l.Constant(0, {}, rt), rt),
      cols, rt);
  const std::string zero =
      l.Compare("EQ", norm, l.Constant(0, cols, rt), cols, rt);
  const std::string safe =
      l.Select(zero, l.Constant(1, cols, rt), norm, cols, rt);
  return l.Binary("divide", x,
                  FromReal(l, l.Expand(safe, in, {rows}, rt), in, t), in, t);
}

// Entry (i, j) of each matrix of x (dims s), i and j i64 per matrix.
std::string EntryAt(Lowering& l, const std::string& x, const MatrixShape& s,
                    const std::string& i, const std::string& j,
                    const HloType& t) {
  const HloType& i64 = I64();
  const HloType& i1 = *DTypeOf(tpu::DType::kBool);
  const std::string at = l.Binary(
      "and",
      l.Compare("EQ", l.Iota(s.rank() - 2, s.dims, i64),
                BroadcastInDim(l, i, s.batch, s.dims, s.batch_map, i64), s.dims,
                i64),
      l.Compare("EQ", l.Iota(s.rank() - 1, s.dims, i64),
                BroadcastInDim(l, j, s.batch, s.dims, s.batch_map, i64), s.dims,
                i64),
      s.dims, i1);
  return l.ReduceOver(l.Select(at, x, l.Constant(0, s.dims, t), s.dims, t),
                      s.dims, {s.rank() - 2, s.rank() - 1}, "add",
                      l.Constant(0, {}, t), t);
}

// x Q for the Q of a QR factorization f of matrices of shape s: (Q^H
// x^H)^H.
std::string TimesQ(Lowering& l, const Qr& f, const MatrixShape& s,
                   const std::string& x, const HloType& t) {
  return Adjoint(
      l, ApplyQ(l, f.a, s, f.tau, s.n, Adjoint(l, x, s.dims, t), s, true, t),
      s.dims, t);
}

// The eigenvalues (batch + [n]) and right eigenvectors (columns of unit
// length, the largest entry of each real, as LAPACK's geev gives them) of
// the square complex matrices `a` (dims s, type c). The complex Schur form
// A = Z T Z^H comes from shifted QR steps on the whole matrix (no
// Hessenberg form): each step factors T - mu I of the active block, the
// rows above the last converged one, and sets T to R Q + mu I, with mu the
// eigenvalue of the active block's trailing 2x2 nearest its last diagonal
// entry (Wilkinson's shift; every tenth step without progress an
// exceptional one). A row whose entries left of the diagonal fall below
// eps |A|_F is converged. T's eigenvectors come from back substitution
// (near-equal eigenvalues perturbed by eps |A|_F, as LAPACK's trevc), and
// Z takes them back to A's. Without `want_vectors`, Z is not accumulated
// and the eigenvectors are empty.
std::pair<std::string, std::string> Eig(Lowering& l, const std::string& a,
                                        const MatrixShape& s, const HloType& c,
                                        bool want_vectors) {
  const HloType& i64 = I64();
  const HloType& i1 = *DTypeOf(tpu::DType::kBool);
  const HloType& rt = RealOf(c);
  const std::vector<int64_t>& d = s.dims;
  const std::vector<int64_t>& b = s.batch;
  const int64_t n = s.n, rows = s.rank() - 2, cols = s.rank() - 1;
  const double eps =
      rt.dtype == tpu::DType::kDouble ? 2.220446049250313e-16 : 1.1920929e-07;
  const std::string ri = l.Iota(rows, d, i64), ci = l.Iota(cols, d, i64);
  auto per_matrix = [&](const std::string& v, const HloType& t) {
    return BroadcastInDim(l, v, b, d, s.batch_map, t);
  };
  auto norm_of = [&](const std::string& v, const std::string& mask) {
    return l.Unary(
        "sqrt",
        l.ReduceOver(l.Select(mask, SquaredModulus(l, v, d, c),
                              l.Constant(0, d, rt), d, rt),
                     d, {rows, cols}, "add", l.Constant(0, {}, rt), rt),
        b, rt);
  };
  const std::string everything = l.Compare("EQ", ri, ri, d, i64);
  // The smallest entry that counts: eps |A|_F (and no less than the
  // smallest normal number, for a zero matrix).
  const std::string small = l.Binary(
      "maximum",
      l.Binary("multiply", norm_of(a, everything), l.Constant(eps, b, rt), b,
               rt),
      l.Constant(rt.dtype == tpu::DType::kDouble ? 2.2250738585072014e-308
                                                 : 1.17549435e-38,
                 b, rt),
      b, rt);
  const std::string one = l.Constant(1, b, i64);
  const std::vector<std::string> st = WhileLoop(
      l,
      {l.Constant(0, {}, i64), l.Constant(static_cast<double>(n), b, i64),
       l.Constant(0, b, i64), a, Identity(l, d, c)},
      {TypeOf({}, i64), TypeOf(b, i64), TypeOf(b, i64), TypeOf(d, c),
       TypeOf(d, c)},
      [&](const std::vector<std::string>& v) {
        // Until every matrix has converged, or 30 steps per eigenvalue.
        const std::string most = l.ReduceOver(
            v[1], b, Range(b.size()), "maximum", l.Constant(0, {}, i64), i64);
        return l.Binary(
            "and",
            l.Compare("LT", v[0],
                      l.Constant(static_cast<double>(30 * n), {}, i64), {},
                      i64),
            l.Compare("GT", most, l.Constant(1, {}, i64), {}, i64), {}, i1);
      },
      [&](const std::vector<std::string>& v) {
        const std::string &m = v[1], &stall = v[2], &t = v[3], &z = v[4];
        // The last row of an active block of `size` rows, left of its
        // diagonal.
        auto last_row = [&](const std::string& size) {
          const std::string last =
              per_matrix(l.Binary("subtract", size, one, b, i64), i64);
          return l.Binary("and", l.Compare("EQ", ri, last, d, i64),
                          l.Compare("LT", ci, last, d, i64), d, i1);
        };
        const std::string row = last_row(m);
        const std::string done =
            l.Binary("and", l.Compare("LE", norm_of(t, row), small, b, rt),
                     l.Compare("GT", m, one, b, i64), b, i1);
        const std::string t1 =
            l.Select(l.Binary("and", row, per_matrix(done, i1), d, i1),
                     l.Constant(0, d, c), t, d, c);
        const std::string m1 =
            l.Select(done, l.Binary("subtract", m, one, b, i64), m, b, i64);
        const std::string stall1 =
            l.Select(done, l.Constant(0, b, i64),
                     l.Binary("add", stall, one, b, i64), b, i64);
        const std::string active = l.Compare("GT", m1, one, b, i64);
        // The shift, from the trailing 2x2 [[p, q], [r, u]] of the active
        // block: u - q r / den, den = (p - u) / 2 +- sqrt(((p - u) / 2)^2 +
        // q r), the sign giving den the larger modulus.
        const std::string hi = l.Binary("subtract", m1, one, b, i64);
        const std::string lo = l.Binary(
            "maximum", l.Binary("subtract", m1, l.Constant(2, b, i64), b, i64),
            l.Constant(0, b, i64), b, i64);
        const std::string p = EntryAt(l, t1, s, lo, lo, c),
                          q = EntryAt(l, t1, s, lo, hi, c),
                          r = EntryAt(l, t1, s, hi, lo, c),
                          u = EntryAt(l, t1, s, hi, hi, c);
        const std::string half =
            l.Binary("divide", l.Binary("subtract", p, u, b, c),
                     l.Constant(2, b, c), b, c);
        const std::string qr = l.Binary("multiply", q, r, b, c);
        const std::string root = l.Unary(
            "sqrt",
            l.Binary("add", l.Binary("multiply", half, half, b, c), qr, b, c),
            b, c);
        const std::string plus = l.Binary("add", half, root, b, c),
                          minus = l.Binary("subtract", half, root, b, c);
        const std::string den =
            l.Select(l.Compare("GE", Modulus(l, plus, b, c),
                               Modulus(l, minus, b, c), b, rt),
                     plus, minus, b, c);
        const std::string zero_den =
            l.Compare("EQ", Modulus(l, den, b, c), l.Constant(0, b, rt), b, rt);
        const std::string wilkinson = l.Select(
            zero_den, u,
            l.Binary(
                "subtract", u,
                l.Binary("divide", qr,
                         l.Select(zero_den, l.Constant(1, b, c), den, b, c), b,
                         c),
                b, c),
            b, c);
        // Exceptional: u moved by 1.5 times the last row's size.
        const std::string exceptional =
            l.Binary("add", u,
                     FromReal(l,
                              l.Binary("multiply", l.Constant(1.5, b, rt),
                                       norm_of(t1, last_row(m1)), b, rt),
                              b, c),
                     b, c);
        const std::string mu = l.Select(
            l.Compare(
                "EQ",
                l.Binary("remainder", stall1, l.Constant(10, b, i64), b, i64),
                l.Constant(9, b, i64), b, i64),
            exceptional, wilkinson, b, c);
        // T - mu I over the active block's diagonal.
        const std::string diag =
            l.Binary("and", l.Compare("EQ", ri, ci, d, i64),
                     l.Compare("LT", ri, per_matrix(m1, i64), d, i64), d, i1);
        const std::string shift =
            l.Select(diag, per_matrix(mu, c), l.Constant(0, d, c), d, c);
        const std::string x = l.Binary("subtract", t1, shift, d, c);
        const Qr f = Geqrf(l, x, s, c);
        const std::string t2 =
            l.Binary("add", TimesQ(l, f, s, Triangle(l, f.a, d, false, c), c),
                     shift, d, c);
        const std::string z2 = want_vectors ? TimesQ(l, f, s, z, c) : z;
        const std::string go = per_matrix(active, i1);
        return std::vector<std::string>{
            l.Binary("add", v[0], l.Constant(1, {}, i64), {}, i64), m1, stall1,
            l.Select(go, t2, t1, d, c), l.Select(go, z2, z, d, c)};
      });
  const std::string& t = st[3];
  const std::string& z = st[4];
  const std::string w = Diagonal(l, t, s, c);
  if (!want_vectors) return {w, ""};
  // T Y = Y diag(w), Y upper triangular with a unit diagonal, row by row
  // from the last: Y[i, k] = -(T[i, i+1:] Y[i+1:, k]) / (T[i, i] - w[k]).
  const std::string wk = BroadcastInDim(l, w, s.row, d, s.row_map, c);
  const std::vector<std::string> ys = CountedLoop(
      l, n, {l.Constant(0, d, c)}, {TypeOf(d, c)},
      [&](const std::string& step, const std::vector<std::string>& v) {
        const std::string i = l.BroadcastTo(
            l.Binary("subtract",
                     l.Constant(static_cast<double>(n - 1), {}, i64), step, {},
                     i64),
            {}, b, i64);
        const std::string id = per_matrix(i, i64);
        const std::string at_i = l.Compare("EQ", ri, id, d, i64);
        // T's row i, as a column to multiply Y's rows by.
        const std::string trow =
            l.ReduceOver(l.Select(at_i, t, l.Constant(0, d, c), d, c), d,
                         {rows}, "add", l.Constant(0, {}, c), c);
        const std::string num = l.ReduceOver(
            l.Binary("multiply",
                     BroadcastInDim(l, trow, s.row, d, s.col_map, c), v[0], d,
                     c),
            d, {rows}, "add", l.Constant(0, {}, c), c);
        const std::string tii = EntryAt(l, t, s, i, i, c);
        std::string den = l.Binary(
            "subtract", BroadcastInDim(l, tii, b, s.row, s.batch_map, c),
            l.ReduceOver(l.Select(at_i, wk, l.Constant(0, d, c), d, c), d,
                         {rows}, "add", l.Constant(0, {}, c), c),
            s.row, c);
        const std::string sm =
            BroadcastInDim(l, small, b, s.row, s.batch_map, rt);
        den =
            l.Select(l.Compare("LT", Modulus(l, den, s.row, c), sm, s.row, rt),
                     FromReal(l, sm, s.row, c), den, s.row, c);
        const std::string ki = l.Iota(rows, s.row, i64);
        const std::string ib = BroadcastInDim(l, i, b, s.row, s.batch_map, i64);
        const std::string yrow = l.Select(
            l.Compare("GT", ki, ib, s.row, i64),
            l.Unary("negate", l.Binary("divide", num, den, s.row, c), s.row, c),
            l.Select(l.Compare("EQ", ki, ib, s.row, i64),
                     l.Constant(1, s.row, c), l.Constant(0, s.row, c), s.row,
                     c),
            s.row, c);
        return std::vector<std::string>{l.Select(
            at_i, BroadcastInDim(l, yrow, s.row, d, s.row_map, c), v[0], d, c)};
      });
  std::string vectors = UnitColumns(
      l,
      l.Emit(absl::StrCat(
          "stablehlo.dot_general ", z, ", ", ys[0], ", batching_dims = [",
          absl::StrJoin(s.batch_map, ", "), "] x [",
          absl::StrJoin(s.batch_map, ", "), "], contracting_dims = [", cols,
          "] x [", rows, "], precision = [HIGHEST, HIGHEST] : (", TypeOf(d, c),
          ", ", TypeOf(d, c), ") -> ", TypeOf(d, c))),
      d, c);
  // Each column's first entry of the largest modulus made real (positive).
  const std::string mod = SquaredModulus(l, vectors, d, c);
  const std::string top =
      l.ReduceOver(mod, d, {rows}, "maximum", l.Constant(0, {}, rt), rt);
  const std::string first = l.ReduceOver(
      l.Select(
          l.Compare("EQ", mod, BroadcastInDim(l, top, s.row, d, s.row_map, rt),
                    d, rt),
          ri, l.Constant(static_cast<double>(n), d, i64), d, i64),
      d, {rows}, "minimum", l.Constant(static_cast<double>(n), {}, i64), i64);
  const std::string pivot = l.ReduceOver(
      l.Select(
          l.Compare("EQ", ri,
                    BroadcastInDim(l, first, s.row, d, s.row_map, i64), d, i64),
          vectors, l.Constant(0, d, c), d, c),
      d, {rows}, "add", l.Constant(0, {}, c), c);
  const std::string size = Modulus(l, pivot, s.row, c);
  const std::string zero =
      l.Compare("EQ", size, l.Constant(0, s.row, rt), s.row, rt);
  const std::string phase = l.Select(
      zero, l.Constant(1, s.row, c),
      l.Binary(
          "divide", Conj(l, pivot, s.row, c),
          FromReal(l, l.Select(zero, l.Constant(1, s.row, rt), size, s.row, rt),
                   s.row, c),
          s.row, c),
      s.row, c);
  vectors = l.Binary("multiply", vectors,
                     BroadcastInDim(l, phase, s.row, d, s.row_map, c), d, c);
  // (exactly real, as LAPACK sets it)
  const std::string at_first = l.Compare(
      "EQ", ri, BroadcastInDim(l, first, s.row, d, s.row_map, i64), d, i64);
  vectors = l.Select(at_first, FromReal(l, RealPart(l, vectors, d, c), d, c),
                     vectors, d, c);
  return {w, vectors};
}

// linalg_eig's and _linalg_eigvals' results: the eigenvalues as target w,
// and the eigenvectors as target *v (none: eigenvalues alone), computed in
// complex128 and rounded once at the end.
absl::StatusOr<std::vector<std::string>> EigResults(Lowering& l,
                                                    const Target& w,
                                                    const Target* v) {
  const Args args(l);
  if (!args.Defined("self") || args["self"].tensor.ndim < 2)
    return Unsupported(l.op(), "expects a matrix or a batch of them");
  const std::vector<int64_t> ad = DimsOf(args["self"].tensor);
  if (ad[ad.size() - 1] != ad[ad.size() - 2])
    return absl::InvalidArgumentError(absl::StrCat(
        l.op(), ": A must be batches of square matrices, but they are ",
        ad[ad.size() - 2], " by ", ad.back(), " matrices"));
  if (!IsComplex(*w.type) ||
      (v != nullptr && (!IsComplex(*v->type) || v->dims != ad)))
    return Unsupported(l.op(), "results of a form not lowered");
  const MatrixShape s(ad);
  std::vector<std::string> out;
  if (s.n == 0 || Numel(args["self"].tensor) == 0) {
    out.push_back(l.Constant(0, w.dims, *w.type));
    if (v != nullptr) out.push_back(l.Constant(0, ad, *v->type));
    return out;
  }
  const HloType& c = ComplexOf(F64());
  absl::StatusOr<std::string> a = l.Operand(args["self"], ad, c);
  if (!a.ok()) return a.status();
  const auto [values, vectors] = Eig(l, *a, s, c, v != nullptr);
  std::vector<int64_t> wd = s.batch;
  wd.push_back(s.n);
  out.push_back(
      l.Reshape(l.Convert(values, wd, c, *w.type), wd, w.dims, *w.type));
  if (v != nullptr) out.push_back(l.Convert(vectors, ad, c, *v->type));
  return out;
}

}  // namespace

void RegisterEigen(OpRegistry& reg) {
  // linalg_eig(self) -> (eigenvalues, eigenvectors), both complex.
  reg.AddMulti(
      "aten::linalg_eig",
      [](Lowering& l, const tpu::DecodedOp&, const std::vector<Target>& o)
          -> absl::StatusOr<std::vector<std::string>> {
        if (o.size() != 2) return Unsupported(l.op(), "expects two results");
        return EigResults(l, o[0], &o[1]);
      });
  reg.Alias("aten::linalg_eig.out", "aten::linalg_eig");
  // _linalg_eigvals(self): the eigenvalues alone.
  reg.Add("aten::_linalg_eigvals",
          [](Lowering& l, const tpu::DecodedOp&,
             const Target& o) -> absl::StatusOr<std::string> {
            absl::StatusOr<std::vector<std::string>> r =
                EigResults(l, o, nullptr);
            if (!r.ok()) return r.status();
            return (*r)[0];
          });

  // _linalg_eigh(A, UPLO, compute_v) -> (eigenvalues, eigenvectors); the
  // eigenvectors are empty without compute_v (eigvalsh).
  reg.AddMulti(
      "aten::_linalg_eigh",
      [](Lowering& l, const tpu::DecodedOp& d, const std::vector<Target>& o)
          -> absl::StatusOr<std::vector<std::string>> {
        const Args args(l);
        if (o.size() != 2 || !args.Defined("A") || args["A"].tensor.ndim < 2)
          return Unsupported(l.op(), "expects a matrix or a batch of them");
        // Eigenvalues real, eigenvectors of A's type.
        const HloType& rt = *o[0].type;
        if (rt.dtype != tpu::DType::kFloat && rt.dtype != tpu::DType::kDouble)
          return Unsupported(l.op(), "lowered for float32 and float64");
        const HloType* at = DTypeOf(args["A"].tensor.dtype);
        if (at == nullptr || (at->dtype != rt.dtype && !IsComplex(*at)))
          return Unsupported(l.op(), "A of another type");
        const HloType& t = IsComplex(*at) ? ComplexOf(rt) : rt;
        std::vector<int64_t> in = o[0].dims;
        in.push_back(in.empty() ? 0 : in.back());
        const std::string uplo =
            args.Has("UPLO") && args["UPLO"].tag == tpu::ArgTag::kString
                ? args["UPLO"].s
                : "L";
        if (uplo != "L" && uplo != "U")
          return absl::InvalidArgumentError(absl::StrCat(
              l.op(), ": UPLO is \"", uplo, "\"; it must be L or U"));
        absl::StatusOr<std::string> a = l.Operand(args["A"], in, t);
        if (!a.ok()) return a.status();
        const auto [vectors, values] = Eigh(l, *a, in, uplo == "L", t);
        return std::vector<std::string>{
            values, args.Flag("compute_v", true) ? vectors
                                                 : l.Constant(0, o[1].dims, t)};
      });
  reg.Alias("aten::_linalg_eigh.eigenvalues", "aten::_linalg_eigh");

  // _linalg_svd(A, full_matrices, compute_uv, driver) -> (U, S, Vh), S
  // descending; U and Vh empty without compute_uv. With full_matrices, the
  // columns past min(m, n) are the eigenvectors of the |m - n| zero
  // eigenvalues (a basis of what A does not reach): unique only up to a
  // rotation where there are several, as any LAPACK's.
  reg.AddMulti(
      "aten::_linalg_svd",
      [](Lowering& l, const tpu::DecodedOp& d, const std::vector<Target>& o)
          -> absl::StatusOr<std::vector<std::string>> {
        const Args args(l);
        if (o.size() != 3 || !args.Defined("A") || args["A"].tensor.ndim < 2)
          return Unsupported(l.op(), "expects a matrix or a batch of them");
        // S real, U and Vh of A's type.
        const HloType& rt = *o[1].type;
        if (rt.dtype != tpu::DType::kFloat && rt.dtype != tpu::DType::kDouble)
          return Unsupported(l.op(), "lowered for float32 and float64");
        const HloType* at = DTypeOf(args["A"].tensor.dtype);
        if (at == nullptr || (at->dtype != rt.dtype && !IsComplex(*at)))
          return Unsupported(l.op(), "A of another type");
        const HloType& t = IsComplex(*at) ? ComplexOf(rt) : rt;
        const bool full = args.Flag("full_matrices", true);
        const bool uv = args.Flag("compute_uv", true);
        const std::vector<int64_t> batch = BatchOf(std::vector<int64_t>(
            args["A"].tensor.sizes,
            args["A"].tensor.sizes + args["A"].tensor.ndim));
        const int64_t m = args["A"].tensor.sizes[args["A"].tensor.ndim - 2];
        const int64_t n = args["A"].tensor.sizes[args["A"].tensor.ndim - 1];
        const int64_t k = std::min(m, n), big = m + n;
        const int64_t r = static_cast<int64_t>(batch.size());
        auto dims = [&batch](std::vector<int64_t> tail) {
          std::vector<int64_t> v = batch;
          v.insert(v.end(), tail.begin(), tail.end());
          return v;
        };
        if (k == 0) {  // no singular values: U and V are identities
          return std::vector<std::string>{
              uv ? (full ? Identity(l, o[0].dims, t)
                         : l.Constant(0, o[0].dims, t))
                 : l.Constant(0, o[0].dims, t),
              l.Constant(0, o[1].dims, rt),
              uv ? (full ? Identity(l, o[2].dims, t)
                         : l.Constant(0, o[2].dims, t))
                 : l.Constant(0, o[2].dims, t)};
        }
        absl::StatusOr<std::string> a = l.Operand(args["A"], dims({m, n}), t);
        if (!a.ok()) return a.status();
        const std::string top =
            Joined(l, l.Constant(0, dims({m, m}), t), dims({m, m}), *a,
                   dims({m, n}), r + 1, t);
        const std::string bottom =
            Joined(l, Adjoint(l, *a, dims({m, n}), t), dims({n, m}),
                   l.Constant(0, dims({n, n}), t), dims({n, n}), r + 1, t);
        const std::string h =
            Joined(l, top, dims({m, big}), bottom, dims({n, big}), r, t);
        const auto [x, w] = Eigh(l, h, dims({big, big}), true, t);
        // The k largest eigenvalues, largest first.
        const std::string s =
            Reversed(l, l.SliceAlong(w, dims({big}), r, big - k, big, rt),
                     dims({k}), r, rt);
        if (!uv)
          return std::vector<std::string>{l.Constant(0, o[0].dims, t), s,
                                          l.Constant(0, o[2].dims, t)};
        const std::string top_k = Reversed(
            l, l.SliceAlong(x, dims({big, big}), r + 1, big - k, big, t),
            dims({big, k}), r + 1, t);
        std::string u = l.SliceAlong(top_k, dims({big, k}), r, 0, m, t);
        std::string v = l.SliceAlong(top_k, dims({big, k}), r, m, big, t);
        int64_t uc = k, vc = k;
        if (full && m != n) {
          // The eigenvectors of the zero eigenvalues, [u; 0] (m > n) or
          // [0; v] (n > m): right after the k negative ones.
          const int64_t extra = m > n ? m - n : n - m;
          const std::string zeros =
              l.SliceAlong(x, dims({big, big}), r + 1, k, k + extra, t);
          if (m > n) {
            u = Joined(l, u, dims({m, k}),
                       l.SliceAlong(zeros, dims({big, extra}), r, 0, m, t),
                       dims({m, extra}), r + 1, t);
            uc = m;
          } else {
            v = Joined(l, v, dims({n, k}),
                       l.SliceAlong(zeros, dims({big, extra}), r, m, big, t),
                       dims({n, extra}), r + 1, t);
            vc = n;
          }
        }
        u = UnitColumns(l, u, dims({m, uc}), t);
        v = UnitColumns(l, v, dims({n, vc}), t);
        return std::vector<std::string>{u, s, Adjoint(l, v, dims({n, vc}), t)};
      });
  reg.Alias("aten::_linalg_svd.U", "aten::_linalg_svd");
}

}  // namespace tpud::pjrt
