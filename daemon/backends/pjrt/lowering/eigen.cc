// Symmetric eigendecomposition through XLA's Eigh custom call, which its
// compilers expand into Jacobi rotations (EighExpander): the eigenvalues in
// ascending order and the eigenvectors as columns, as LAPACK's syevd gives
// them (each vector up to its sign). The singular value decomposition from
// it, through the symmetric matrix [[0, A], [A^T, 0]], whose eigenvalues are
// the singular values and their negatives (and |m - n| zeros) and whose
// eigenvector of sigma is [u; v] / sqrt(2): no A^T A, so no squared
// condition number.
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

// Eigenvectors (dims `in`) and eigenvalues (`in` less its last dimension)
// of the symmetric matrices `a` whose lower (or upper) triangle is read.
std::pair<std::string, std::string> Eigh(Lowering& l, const std::string& a,
                                         const std::vector<int64_t>& in,
                                         bool lower, const HloType& t) {
  std::vector<int64_t> values = in;
  values.pop_back();
  if (t.dtype == tpu::DType::kFloat) {
    // In float64, rounded once at the end: a float32 Jacobi's rounding
    // reaches the eigenvectors, and through 1 / (w_i - w_j) their
    // gradients, several times over LAPACK's.
    const HloType& w = F64();
    auto [v, e] = Eigh(l, l.Convert(a, in, t, w), in, lower, w);
    return {l.Convert(v, in, w, t), l.Convert(e, values, w, t)};
  }
  // backend_config: lower, sort the eigenvalues, sweeps at most, and the
  // off-diagonal norm (relative) the rotations stop at: the type's epsilon.
  const double tol = t.dtype == tpu::DType::kDouble ? 2.220446049250313e-16
                                                    : 1.1920928955078125e-07;
  const std::string r = l.EmitResults(
      absl::StrFormat("stablehlo.custom_call @Eigh(%s) {backend_config = "
                      "\"%d,1,100,%.17g\"} : (%s) -> (%s, %s)",
                      a, lower ? 1 : 0, tol, TypeOf(in, t), TypeOf(in, t),
                      TypeOf(values, t)),
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
  const std::string sq = l.Binary("multiply", x, x, in, t);
  std::vector<int64_t> cols = in;
  cols.erase(cols.begin() + rows);
  const std::string norm = l.Unary(
      "sqrt", l.ReduceOver(sq, in, {rows}, "add", l.Constant(0, {}, t), t),
      cols, t);
  const std::string zero =
      l.Compare("EQ", norm, l.Constant(0, cols, t), cols, t);
  const std::string safe =
      l.Select(zero, l.Constant(1, cols, t), norm, cols, t);
  return l.Binary("divide", x, l.Expand(safe, in, {rows}, t), in, t);
}

}  // namespace

void RegisterEigen(OpRegistry& reg) {
  // _linalg_eigh(A, UPLO, compute_v) -> (eigenvalues, eigenvectors); the
  // eigenvectors are empty without compute_v (eigvalsh).
  reg.AddMulti(
      "aten::_linalg_eigh",
      [](Lowering& l, const tpu::DecodedOp& d, const std::vector<Target>& o)
          -> absl::StatusOr<std::vector<std::string>> {
        const Args args(l);
        if (o.size() != 2 || !args.Defined("A") || args["A"].tensor.ndim < 2)
          return Unsupported(l.op(), "expects a matrix or a batch of them");
        const HloType& t = *o[0].type;
        if (t.dtype != tpu::DType::kFloat && t.dtype != tpu::DType::kDouble)
          return Unsupported(l.op(), "lowered for float32 and float64");
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
        const HloType& t = *o[1].type;
        if (t.dtype != tpu::DType::kFloat && t.dtype != tpu::DType::kDouble)
          return Unsupported(l.op(), "lowered for float32 and float64");
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
              l.Constant(0, o[1].dims, t),
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
            Joined(l, Transposed(l, *a, dims({m, n}), t), dims({n, m}),
                   l.Constant(0, dims({n, n}), t), dims({n, n}), r + 1, t);
        const std::string h =
            Joined(l, top, dims({m, big}), bottom, dims({n, big}), r, t);
        const auto [x, w] = Eigh(l, h, dims({big, big}), true, t);
        // The k largest eigenvalues, largest first.
        const std::string s =
            Reversed(l, l.SliceAlong(w, dims({big}), r, big - k, big, t),
                     dims({k}), r, t);
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
        return std::vector<std::string>{u, s,
                                        Transposed(l, v, dims({n, vc}), t)};
      });
  reg.Alias("aten::_linalg_svd.U", "aten::_linalg_svd");
  // (Hermitian complex matrices need a complex eigensolver.)
  reg.RefuseComplex({"aten::_linalg_eigh", "aten::_linalg_svd"});
}

}  // namespace tpud::pjrt
