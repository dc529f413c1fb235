// Linear algebra: products (mm, bmm, mv, dot and their add* forms),
// triangles, and the factorizations and solves built from matrix.h.
// Arguments are read by their schema names (Args, helpers.h).
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
namespace {

// geqrf has no meta kernel: (a, tau), tau of the batch + [min(m, n)].
std::vector<std::vector<int64_t>> GeqrfDims(const std::vector<int64_t>& a) {
  if (a.size() < 2) return {};
  std::vector<int64_t> tau(a.begin(), a.end() - 2);
  tau.push_back(std::min(a[a.size() - 2], a.back()));
  return {a, tau};
}

}  // namespace

void RegisterLinalg(OpRegistry& reg) {
  reg.Add("aten::mm",
          [](Lowering& l, const tpu::DecodedOp& d,
             const Target& out) -> absl::StatusOr<std::string> {
            const Args a(l);
            if (!a.Has("mat2")) return Unsupported(l.op(), "too few arguments");
            return MatMul(l, a["self"], a["mat2"], out);
          });
  reg.Add("aten::addmm",
          [](Lowering& l, const tpu::DecodedOp& d,
             const Target& out) -> absl::StatusOr<std::string> {
            const Args a(l);
            if (!a.Has("mat2")) return Unsupported(l.op(), "too few arguments");
            // beta * self + alpha * (mat1 @ mat2); self is read first (record
            // order).
            absl::StatusOr<std::string> self =
                l.Operand(a["self"], out.dims, *out.type);
            if (!self.ok()) return self;
            absl::StatusOr<std::string> prod =
                MatMul(l, a["mat1"], a["mat2"], out);
            if (!prod.ok()) return prod;
            std::string lhs = *self, rhs = *prod;
            // beta scales self, alpha the product (no beta: no alpha).
            for (const auto& [name, v] :
                 {std::pair<const char*, std::string*>{"beta", &lhs},
                  {"alpha", &rhs}}) {
              if (!a.Has(name)) break;
              absl::StatusOr<std::string> s =
                  l.Operand(a[name], out.dims, *out.type);
              if (!s.ok()) return s;
              *v = l.Binary("multiply", *v, *s, out.dims, *out.type);
            }
            return l.Binary("add", lhs, rhs, out.dims, *out.type);
          });
  // linalg_cholesky_ex(self, upper, check_errors) -> (L, info): XLA's
  // Cholesky, which leaves NaN from the first pivot that is not positive
  // on; info is that pivot's order (1-based), 0 when there is none.
  reg.AddMulti(
      "aten::linalg_cholesky_ex",
      [](Lowering& l, const tpu::DecodedOp& d, const std::vector<Target>& o)
          -> absl::StatusOr<std::vector<std::string>> {
        const Args args(l);
        if (o.size() != 2 || !args.Defined("self") ||
            args["self"].tensor.ndim < 2)
          return Unsupported(l.op(), "expects a matrix or a batch of them");
        const HloType& t = *o[0].type;
        const std::vector<int64_t> in = o[0].dims;
        const bool upper = args.Flag("upper", false);
        absl::StatusOr<std::string> a = l.Operand(args["self"], in, t);
        if (!a.ok()) return a.status();
        const std::string c = Cholesky(l, *a, in, upper, t);
        const int64_t n = in.back();
        const HloType& i64 = I64();
        const std::vector<int64_t> batch = BatchOf(in);
        // NaN on the diagonal, counted per matrix.
        const std::string nan = l.Compare("NE", c, c, in, t);
        const std::string diag =
            l.Compare("EQ", l.Iota(in.size() - 2, in, i64),
                      l.Iota(in.size() - 1, in, i64), in, i64);
        const std::string bad = l.Convert(
            l.Binary("and", nan, diag, in, *DTypeOf(tpu::DType::kBool)), in,
            *DTypeOf(tpu::DType::kBool), i64);
        const std::string count =
            l.ReduceOver(bad, in,
                         {static_cast<int64_t>(in.size() - 2),
                          static_cast<int64_t>(in.size() - 1)},
                         "add", l.Constant(0, {}, i64), i64);
        const std::string failed =
            l.Compare("GT", count, l.Constant(0, batch, i64), batch, i64);
        const std::string order = l.Binary(
            "add",
            l.Binary("subtract", l.Constant(static_cast<double>(n), batch, i64),
                     count, batch, i64),
            l.Constant(1, batch, i64), batch, i64);
        const std::string info =
            l.Select(failed, order, l.Constant(0, batch, i64), batch, i64);
        return std::vector<std::string>{
            c, l.Reshape(l.Convert(info, batch, i64, *o[1].type), batch,
                         o[1].dims, *o[1].type)};
      });
  reg.Alias("aten::linalg_cholesky_ex.L", "aten::linalg_cholesky_ex");
  // triangular_solve(self = B, A, upper, transpose, unitriangular) ->
  // (solution, cloned_coefficient).
  reg.AddMulti(
      "aten::triangular_solve",
      [](Lowering& l, const tpu::DecodedOp& d, const std::vector<Target>& o)
          -> absl::StatusOr<std::vector<std::string>> {
        const Args args(l);
        if (o.size() != 2 || !args.Has("unitriangular"))
          return Unsupported(l.op(), "arguments of a form not lowered");
        const HloType& t = *o[0].type;
        const std::vector<int64_t> batch = BatchOf(o[0].dims);
        absl::StatusOr<std::string> b =
            MatrixOperand(l, args["self"], batch, t);
        absl::StatusOr<std::string> a = MatrixOperand(l, args["A"], batch, t);
        if (!b.ok()) return b.status();
        if (!a.ok()) return a.status();
        const std::vector<int64_t> ad =
            WithBatch(DimsOf(args["A"].tensor), batch);
        const bool upper = args["upper"].b, transpose = args["transpose"].b,
                   unit = args["unitriangular"].b;
        // transpose is A^T, complex ones too: the adjoint of conj(A).
        const std::string x =
            TriangularSolve(l, transpose ? Conj(l, *a, ad, t) : *a, ad, *b,
                            o[0].dims, true, !upper, unit, transpose, t);
        return std::vector<std::string>{x, l.BroadcastTo(*a, ad, o[1].dims, t)};
      });
  reg.Alias("aten::triangular_solve.X", "aten::triangular_solve");
  // geqrf(self) -> (a, tau); linalg_qr(A, mode) -> (Q, R), mode reduced,
  // complete or r (Q empty): Householder QR as LAPACK's, Q formed by
  // applying the reflectors to the identity.
  reg.AddMulti(
         "aten::geqrf",
         [](Lowering& l, const tpu::DecodedOp& d, const std::vector<Target>& o)
             -> absl::StatusOr<std::vector<std::string>> {
           const Args args(l);
           if (o.size() != 2 || !args.Defined("self") || o[0].dims.size() < 2)
             return Unsupported(l.op(), "expects a matrix or a batch of them");
           const HloType& t = *o[0].type;
           absl::StatusOr<std::string> a =
               l.Operand(args["self"], o[0].dims, t);
           if (!a.ok()) return a.status();
           const Qr f = Geqrf(l, *a, MatrixShape(o[0].dims), t);
           return std::vector<std::string>{f.a, f.tau};
         })
      .SizedBy(GeqrfDims);
  reg.Alias("aten::geqrf.a", "aten::geqrf");
  reg.AddMulti(
      "aten::linalg_qr",
      [](Lowering& l, const tpu::DecodedOp& d, const std::vector<Target>& o)
          -> absl::StatusOr<std::vector<std::string>> {
        const Args args(l);
        if (o.size() != 2 || !args.Defined("A") || args["A"].tensor.ndim < 2)
          return Unsupported(l.op(), "expects a matrix or a batch of them");
        const std::string mode =
            args.Has("mode") && args["mode"].tag == tpu::ArgTag::kString
                ? args["mode"].s
                : "reduced";
        if (mode != "reduced" && mode != "complete" && mode != "r") {
          return absl::InvalidArgumentError(absl::StrCat(
              l.op(), ": mode \"", mode, "\" is not reduced, complete or r"));
        }
        const HloType& t = *o[1].type;
        const std::vector<int64_t> ad = DimsOf(args["A"].tensor);
        const MatrixShape as(ad);
        const int64_t k = std::min(as.m, as.n);
        absl::StatusOr<std::string> a = l.Operand(args["A"], ad, t);
        if (!a.ok()) return a.status();
        const Qr f = Geqrf(l, *a, as, t);
        const int64_t rq = mode == "complete" ? as.m : k;
        const std::vector<int64_t> rd = WithBatch({rq, as.n}, as.batch);
        std::vector<int64_t> zero(ad.size(), 0);
        std::string r = f.a;
        if (rq < as.m) r = l.Slice(f.a, ad, zero, rd, t);
        r = Triangle(l, r, rd, false, t);
        std::string q = l.Constant(0, o[0].dims, *o[0].type);
        if (mode != "r") {
          const MatrixShape qs(WithBatch({as.m, rq}, as.batch));
          const std::string eye = Identity(l, qs.dims, t);
          q = ApplyQ(l, f.a, as, f.tau, k, eye, qs, false, t);
        }
        return std::vector<std::string>{q, r};
      });
  reg.Alias("aten::linalg_qr.out", "aten::linalg_qr");
  // The LU family, from LuFactor: linalg_lu_factor_ex(A, pivot,
  // check_errors) -> (LU, pivots, info); linalg_lu(A, pivot) -> (P, L, U);
  // lu_unpack(LU, pivots, unpack_data, unpack_pivots) -> (P, L, U);
  // linalg_inv_ex(A, check_errors) -> (inverse, info); _linalg_solve_ex(A,
  // B, left, check_errors) -> (result, LU, pivots, info); _linalg_det(A)
  // -> (det, LU, pivots); _linalg_slogdet(A) -> (sign, logabsdet, LU,
  // pivots). Without pivoting is not lowered.
  enum class LuOp { kFactor, kLu, kUnpack, kInv, kSolve, kDet, kSlogdet };
  for (LuOp which : {LuOp::kFactor, LuOp::kLu, LuOp::kUnpack, LuOp::kInv,
                     LuOp::kSolve, LuOp::kDet, LuOp::kSlogdet}) {
    MultiRule r = [which](Lowering& l, const tpu::DecodedOp& d,
                          const std::vector<Target>& o)
        -> absl::StatusOr<std::vector<std::string>> {
      const size_t want = which == LuOp::kFactor || which == LuOp::kLu ||
                                  which == LuOp::kUnpack || which == LuOp::kDet
                              ? 3
                          : which == LuOp::kInv ? 2
                                                : 4;
      const Args args(l);
      // The matrix: LU_data of lu_unpack, A of the others.
      const char* const first = which == LuOp::kUnpack ? "LU_data" : "A";
      if (o.size() != want || !args.Defined(first) ||
          args[first].tensor.ndim < 2)
        return Unsupported(l.op(), "expects a matrix or a batch of them");
      if ((which == LuOp::kFactor || which == LuOp::kLu) &&
          !args.Flag("pivot", true)) {
        return Unsupported(l.op(), "LU without pivoting");
      }
      const tpu::OpArg& a0 = args[first];
      const HloType& i64 = I64();
      // The type the factorization runs in: A's (slogdet's logabsdet is
      // real where A is complex).
      const HloType& t = which == LuOp::kSlogdet && !IsComplex(*o[0].type)
                             ? *o[1].type
                             : *o[0].type;
      const HloType& rt = RealOf(t);
      // A's dims: broadcast over the batch where an output says so.
      const std::vector<int64_t> ad = which == LuOp::kFactor    ? o[0].dims
                                      : which == LuOp::kSolve   ? o[1].dims
                                      : which == LuOp::kDet     ? o[1].dims
                                      : which == LuOp::kSlogdet ? o[2].dims
                                      : which == LuOp::kInv     ? o[0].dims
                                                            : DimsOf(a0.tensor);
      if (ad.size() < 2)
        return Unsupported(l.op(), "expects a matrix or a batch of them");
      const MatrixShape as(ad);
      const int64_t k = std::min(as.m, as.n);
      if ((which == LuOp::kInv || which == LuOp::kSolve ||
           which == LuOp::kDet || which == LuOp::kSlogdet) &&
          as.m != as.n) {
        return absl::InvalidArgumentError(absl::StrCat(
            l.op(), ": A must be batches of square matrices, but they are ",
            as.m, " by ", as.n, " matrices"));
      }
      absl::StatusOr<std::string> av = l.Operand(a0, DimsOf(a0.tensor), t);
      if (!av.ok()) return av.status();
      std::string a = l.BroadcastTo(*av, DimsOf(a0.tensor), ad, t);
      // ATen's det and slogdet factor A^T when A is row-major and real
      // (det(A^T) = det(A), and LAPACK wants column-major); their backward
      // formulas take the LU they return to be A^T's then.
      if ((which == LuOp::kDet || which == LuOp::kSlogdet) &&
          RowMajor(a0.tensor) && !IsComplex(t))
        a = Transposed(l, a, ad, t);
      std::vector<int64_t> pdims = as.batch;
      pdims.push_back(k);
      Lu f;
      if (which == LuOp::kUnpack) {
        f.lu = a;
        if (!args.Defined("LU_pivots"))
          return Unsupported(l.op(), "expects pivots");
        absl::StatusOr<std::string> pv =
            l.Operand(args["LU_pivots"], pdims, i64);
        if (!pv.ok()) return pv.status();
        f.pivots = *pv;
      } else {
        f = LuFactor(l, a, as, t);
      }
      auto as_type = [&](const std::string& v, const std::vector<int64_t>& dims,
                         const HloType& from, const Target& out) {
        return l.Reshape(l.Convert(v, dims, from, *out.type), dims, out.dims,
                         *out.type);
      };
      auto unpack = [&]() {
        // P from the swaps applied to the identity (its transpose), L unit
        // lower (m x k), U upper (k x n).
        const MatrixShape ps(WithBatch({as.m, as.m}, as.batch));
        const std::string swapped =
            ApplySwaps(l, Identity(l, ps.dims, t), ps, f.pivots, k, false, t);
        std::vector<int64_t> perm = ps.batch_map;
        perm.push_back(ps.rank() - 1);
        perm.push_back(ps.rank() - 2);
        const std::string pm = l.Emit(
            absl::StrCat("stablehlo.transpose ", swapped, ", dims = [",
                         absl::StrJoin(perm, ", "), "] : (", TypeOf(ps.dims, t),
                         ") -> ", TypeOf(ps.dims, t)));
        const std::vector<int64_t> ld = WithBatch({as.m, k}, as.batch),
                                   ud = WithBatch({k, as.n}, as.batch);
        std::vector<int64_t> zero(ad.size(), 0);
        const std::string lpart = l.Slice(f.lu, ad, zero, ld, t);
        std::vector<int64_t> ustart(ad.size(), 0);
        const std::string upart = l.Slice(f.lu, ad, ustart, ud, t);
        const MatrixShape ls(ld);
        const std::string ri = l.Iota(ls.rank() - 2, ld, i64),
                          ci = l.Iota(ls.rank() - 1, ld, i64);
        std::string lower = l.Select(l.Compare("GT", ri, ci, ld, i64), lpart,
                                     l.Constant(0, ld, t), ld, t);
        lower = l.Select(l.Compare("EQ", ri, ci, ld, i64), l.Constant(1, ld, t),
                         lower, ld, t);
        const std::string upper = Triangle(l, upart, ud, false, t);
        return std::vector<std::string>{pm, lower, upper};
      };
      switch (which) {
        case LuOp::kFactor:
          return std::vector<std::string>{f.lu,
                                          as_type(f.pivots, pdims, i64, o[1]),
                                          as_type(f.info, as.batch, i64, o[2])};
        case LuOp::kLu:
        case LuOp::kUnpack: {
          std::vector<std::string> v = unpack();
          for (size_t q = 0; q < 3; ++q) {
            if (Numel(*o[q].ref) == 0 || o[q].dims != DimsOf(*o[q].ref))
              v[q] = l.Constant(0, o[q].dims, *o[q].type);
            else
              v[q] = l.Convert(v[q], o[q].dims, t, *o[q].type);
          }
          return v;
        }
        case LuOp::kInv: {
          const std::string x =
              LuSolve(l, f.lu, ad, f.pivots, Identity(l, ad, t), as, false, t);
          return std::vector<std::string>{x,
                                          as_type(f.info, as.batch, i64, o[1])};
        }
        case LuOp::kSolve: {
          if (!args.Has("left") || !args.Defined("B"))
            return Unsupported(l.op(), "expects A and B");
          if (!args.Flag("left", true))
            return Unsupported(l.op(), "left=False");
          // B as a batch of matrices: a vector gets a column dimension.
          const std::vector<int64_t>& rd = o[0].dims;
          const bool vector = rd.size() + 1 == ad.size();
          const std::vector<int64_t> bd = vector ? [&] { std::vector<int64_t> v = rd; v.push_back(1); return v; }() : rd;
          const std::vector<int64_t> bin = DimsOf(args["B"].tensor);
          absl::StatusOr<std::string> bv = l.Operand(args["B"], bin, t);
          if (!bv.ok()) return bv.status();
          std::string b = l.BroadcastTo(*bv, bin, rd, t);
          b = l.Reshape(b, rd, bd, t);
          const MatrixShape bs(bd);
          if (bs.m != as.n || bs.batch != as.batch)
            return Unsupported(l.op(), "B of a shape not lowered");
          const std::string x = l.Reshape(
              LuSolve(l, f.lu, ad, f.pivots, b, bs, false, t), bd, rd, t);
          return std::vector<std::string>{x, f.lu,
                                          as_type(f.pivots, pdims, i64, o[2]),
                                          as_type(f.info, as.batch, i64, o[3])};
        }
        case LuOp::kDet:
        case LuOp::kSlogdet: {
          const std::string diag = Diagonal(l, f.lu, as, t);
          std::vector<int64_t> dd = as.batch;
          dd.push_back(as.n);
          const int64_t last = static_cast<int64_t>(dd.size() - 1);
          const std::string sign = SwapSign(l, f.pivots, as.batch, k, t);
          if (which == LuOp::kDet) {
            const std::string prod = l.ReduceOver(diag, dd, {last}, "multiply",
                                                  l.Constant(1, {}, t), t);
            return std::vector<std::string>{
                l.Reshape(l.Binary("multiply", sign, prod, as.batch, t),
                          as.batch, o[0].dims, t),
                f.lu, as_type(f.pivots, pdims, i64, o[2])};
          }
          const std::string signs =
              l.ReduceOver(l.Unary("sign", diag, dd, t), dd, {last}, "multiply",
                           l.Constant(1, {}, t), t);
          const std::string modulus = Modulus(l, diag, dd, t);
          const std::string logabs =
              l.ReduceOver(l.Unary("log", modulus, dd, rt), dd, {last}, "add",
                           l.Constant(0, {}, rt), rt);
          return std::vector<std::string>{
              l.Reshape(l.Binary("multiply", sign, signs, as.batch, t),
                        as.batch, o[0].dims, t),
              l.Reshape(logabs, as.batch, o[1].dims, rt), f.lu,
              as_type(f.pivots, pdims, i64, o[3])};
        }
      }
      return Unsupported(l.op(), "this form");
    };
    const char* const* names;
    static const char* kFactor[] = {"aten::linalg_lu_factor_ex",
                                    "aten::linalg_lu_factor_ex.out", nullptr};
    static const char* kLu[] = {"aten::linalg_lu", "aten::linalg_lu.out",
                                nullptr};
    static const char* kUnpack[] = {"aten::lu_unpack", "aten::lu_unpack.out",
                                    nullptr};
    static const char* kInv[] = {"aten::linalg_inv_ex",
                                 "aten::linalg_inv_ex.inverse", nullptr};
    static const char* kSolve[] = {"aten::_linalg_solve_ex",
                                   "aten::_linalg_solve_ex.result", nullptr};
    static const char* kDet[] = {"aten::_linalg_det",
                                 "aten::_linalg_det.result", nullptr};
    static const char* kSlogdet[] = {"aten::_linalg_slogdet",
                                     "aten::_linalg_slogdet.sign", nullptr};
    switch (which) {
      case LuOp::kFactor:
        names = kFactor;
        break;
      case LuOp::kLu:
        names = kLu;
        break;
      case LuOp::kUnpack:
        names = kUnpack;
        break;
      case LuOp::kInv:
        names = kInv;
        break;
      case LuOp::kSolve:
        names = kSolve;
        break;
      case LuOp::kDet:
        names = kDet;
        break;
      default:
        names = kSlogdet;
        break;
    }
    for (const char* const* n = names; *n != nullptr; ++n) reg.AddMulti(*n, r);
  }
  reg.Add(
      "aten::bmm",
      [](Lowering& l, const tpu::DecodedOp& d,
         const Target& o) -> absl::StatusOr<std::string> {
        const Args args(l);
        if (!args.Defined("self") || !args.Defined("mat2") ||
            args["self"].tensor.ndim != 3 || args["mat2"].tensor.ndim != 3) {
          return Unsupported(l.op(), "expects two 3-d tensors");
        }
        const std::vector<int64_t> da = DimsOf(args["self"].tensor),
                                   db = DimsOf(args["mat2"].tensor);
        absl::StatusOr<std::string> a = l.Operand(args["self"], da, *o.type),
                                    b = l.Operand(args["mat2"], db, *o.type);
        if (!a.ok()) return a;
        if (!b.ok()) return b;
        return l.Emit(absl::StrCat(
            "stablehlo.dot_general ", *a, ", ", *b,
            ", batching_dims = [0] x [0], contracting_dims = [2] x [1] : (",
            TypeOf(da, *o.type), ", ", TypeOf(db, *o.type), ") -> ",
            TypeOf(o.dims, *o.type)));
      });
  reg.Add(
      "aten::dot",
      [](Lowering& l, const tpu::DecodedOp& d,
         const Target& o) -> absl::StatusOr<std::string> {
        const Args args(l);
        if (!args.Defined("self") || !args.Defined("tensor") ||
            args["self"].tensor.ndim != 1)
          return Unsupported(l.op(), "expects vectors");
        const std::vector<int64_t> n = DimsOf(args["self"].tensor);
        absl::StatusOr<std::string> a = l.Operand(args["self"], n, *o.type),
                                    b = l.Operand(args["tensor"], n, *o.type);
        if (!a.ok()) return a;
        if (!b.ok()) return b;
        return l.ReduceOver(l.Binary("multiply", *a, *b, n, *o.type), n, {0},
                            "add", l.Constant(0, {}, *o.type), *o.type);
      });
  // tril / triu(self, diagonal): a mask over the last two dimensions.
  for (bool lower : {true, false}) {
    reg.Add(lower ? "aten::tril" : "aten::triu",
            [lower](Lowering& l, const tpu::DecodedOp& d,
                    const Target& o) -> absl::StatusOr<std::string> {
              const Args a(l);
              if (!a.Defined("self") || o.dims.size() < 2)
                return Unsupported(l.op(), "expects a matrix");
              absl::StatusOr<std::string> x =
                  l.Operand(a["self"], o.dims, *o.type);
              if (!x.ok()) return x;
              const int64_t k = static_cast<int64_t>(a.Number("diagonal", 0));
              const HloType& i64 = I64();
              const int64_t r = static_cast<int64_t>(o.dims.size());
              const std::string diff =
                  l.Binary("subtract", l.Iota(r - 1, o.dims, i64),
                           l.Iota(r - 2, o.dims, i64), o.dims, i64);
              const std::string keep = l.Compare(
                  lower ? "LE" : "GE", diff,
                  l.Constant(static_cast<double>(k), o.dims, i64), o.dims, i64);
              return l.Select(keep, *x, l.Constant(0, o.dims, *o.type), o.dims,
                              *o.type);
            });
  }
  // addmv(self, mat, vec, *, beta, alpha) and mv(self, vec).
  for (bool add : {true, false}) {
    reg.Add(
        add ? "aten::addmv" : "aten::mv",
        [add](Lowering& l, const tpu::DecodedOp& d,
              const Target& o) -> absl::StatusOr<std::string> {
          const Args args(l);
          // The matrix: mat of addmv, self of mv.
          const char* const mat = add ? "mat" : "self";
          if (!args.Defined(mat) || !args.Defined("vec") ||
              args[mat].tensor.ndim != 2 || args["vec"].tensor.ndim != 1) {
            return Unsupported(l.op(), "expects a matrix and a vector");
          }
          const HloType& t = *o.type;
          const std::vector<int64_t> dm = DimsOf(args[mat].tensor),
                                     dv = DimsOf(args["vec"].tensor);
          absl::StatusOr<std::string> a = l.Operand(args[mat], dm, t),
                                      v = l.Operand(args["vec"], dv, t);
          if (!a.ok()) return a;
          if (!v.ok()) return v;
          std::string r = l.Emit(absl::StrCat(
              "stablehlo.dot ", *a, ", ", *v, " : (", TypeOf(dm, t), ", ",
              TypeOf(dv, t), ") -> ", TypeOf(o.dims, t)));
          if (!add) return r;
          const double beta = args.Number("beta", 1),
                       alpha = args.Number("alpha", 1);
          if (alpha != 1)
            r = l.Binary("multiply", r, l.Constant(alpha, o.dims, t), o.dims,
                         t);
          if (beta == 0)
            return r;  // self is not read (nan in it does not spread)
          absl::StatusOr<std::string> self = l.Operand(args["self"], o.dims, t);
          if (!self.ok()) return self;
          std::string b = *self;
          if (beta != 1)
            b = l.Binary("multiply", b, l.Constant(beta, o.dims, t), o.dims, t);
          return l.Binary("add", b, r, o.dims, t);
        });
  }  // cholesky(self, upper).
  reg.Add("aten::cholesky",
          [](Lowering& l, const tpu::DecodedOp& d,
             const Target& o) -> absl::StatusOr<std::string> {
            const Args args(l);
            if (!args.Defined("self") || o.dims.size() < 2)
              return Unsupported(l.op(), "expects a matrix or a batch of them");
            absl::StatusOr<std::string> a =
                l.Operand(args["self"], o.dims, *o.type);
            if (!a.ok()) return a;
            const bool upper = args.Flag("upper", false);
            return Cholesky(l, *a, o.dims, upper, *o.type);
          });
  // linalg_solve_triangular(self = A, B, *, upper, left, unitriangular).
  reg.Add("aten::linalg_solve_triangular",
          [](Lowering& l, const tpu::DecodedOp& d,
             const Target& o) -> absl::StatusOr<std::string> {
            const Args args(l);
            if (!args.Has("unitriangular") || o.dims.size() < 2)
              return Unsupported(l.op(), "arguments of a form not lowered");
            const HloType& t = *o.type;
            const std::vector<int64_t> batch = BatchOf(o.dims);
            absl::StatusOr<std::string> a =
                MatrixOperand(l, args["self"], batch, t);
            absl::StatusOr<std::string> b =
                MatrixOperand(l, args["B"], batch, t);
            if (!a.ok()) return a;
            if (!b.ok()) return b;
            const std::vector<int64_t> ad =
                WithBatch(DimsOf(args["self"].tensor), batch);
            return TriangularSolve(l, *a, ad, *b, o.dims, args["left"].b,
                                   !args["upper"].b, args["unitriangular"].b,
                                   false, t);
          });
  // _cholesky_solve_helper(self = B, A = the factor, upper): two
  // triangular solves, L (L^T X) = B or U^T (U X) = B.
  reg.Add("aten::_cholesky_solve_helper",
          [](Lowering& l, const tpu::DecodedOp& d,
             const Target& o) -> absl::StatusOr<std::string> {
            const Args args(l);
            if (!args.Has("upper") || o.dims.size() < 2)
              return Unsupported(l.op(), "arguments of a form not lowered");
            const HloType& t = *o.type;
            const std::vector<int64_t> batch = BatchOf(o.dims);
            absl::StatusOr<std::string> b =
                MatrixOperand(l, args["self"], batch, t);
            absl::StatusOr<std::string> a =
                MatrixOperand(l, args["A"], batch, t);
            if (!a.ok()) return a;
            if (!b.ok()) return b;
            const std::vector<int64_t> ad =
                WithBatch(DimsOf(args["A"].tensor), batch);
            const bool upper = args["upper"].b;
            const std::string y = TriangularSolve(l, *a, ad, *b, o.dims, true,
                                                  !upper, false, upper, t);
            return TriangularSolve(l, *a, ad, y, o.dims, true, !upper, false,
                                   !upper, t);
          });
  // cholesky_inverse(self = the factor, upper): (L L^T)^-1, the solve of
  // the identity.
  reg.Add("aten::cholesky_inverse",
          [](Lowering& l, const tpu::DecodedOp& d,
             const Target& o) -> absl::StatusOr<std::string> {
            const Args args(l);
            if (!args.Defined("self") || o.dims.size() < 2)
              return Unsupported(l.op(), "expects a matrix or a batch of them");
            const HloType& t = *o.type;
            absl::StatusOr<std::string> a = l.Operand(args["self"], o.dims, t);
            if (!a.ok()) return a;
            const bool upper = args.Flag("upper", false);
            const std::string y =
                TriangularSolve(l, *a, o.dims, Identity(l, o.dims, t), o.dims,
                                true, !upper, false, upper, t);
            return TriangularSolve(l, *a, o.dims, y, o.dims, true, !upper,
                                   false, !upper, t);
          });
  // linalg_lu_solve(LU, pivots, B, *, left, adjoint): the solve of A X = B
  // (A^T X = B) from A's factorization; left=False is not lowered.
  reg.Add(
      "aten::linalg_lu_solve",
      [](Lowering& l, const tpu::DecodedOp& d,
         const Target& o) -> absl::StatusOr<std::string> {
        const Args args(l);
        if (!args.Has("adjoint") || !args.Defined("LU") ||
            !args.Defined("pivots") || !args.Defined("B") ||
            o.dims.size() < 2) {
          return Unsupported(l.op(), "arguments of a form not lowered");
        }
        // left=False (X op(A) = B) is the left solve of the adjoints:
        // op(A)^H X^H = B^H, where op(A)^H is A^H, or A when op is the
        // adjoint.
        const bool left = args.Flag("left", true);
        const HloType& t = *o.type;
        const std::vector<int64_t> batch = BatchOf(o.dims);
        const std::vector<int64_t> ad =
            WithBatch(DimsOf(args["LU"].tensor), batch);
        absl::StatusOr<std::string> lu = MatrixOperand(l, args["LU"], batch, t),
                                    b = MatrixOperand(l, args["B"], batch, t);
        if (!lu.ok()) return lu;
        if (!b.ok()) return b;
        std::vector<int64_t> pdims = batch;
        pdims.push_back(ad.back());
        const std::vector<int64_t> pin = DimsOf(args["pivots"].tensor);
        absl::StatusOr<std::string> pv = l.Operand(args["pivots"], pin, I64());
        if (!pv.ok()) return pv;
        const std::string piv = l.BroadcastTo(*pv, pin, pdims, I64());
        const bool adjoint = args.Flag("adjoint", false);
        if (left)
          return LuSolve(l, *lu, ad, piv, *b, MatrixShape(o.dims), adjoint, t);
        std::vector<int64_t> td = o.dims;
        std::swap(td[td.size() - 1], td[td.size() - 2]);
        return Adjoint(l,
                       LuSolve(l, *lu, ad, piv, Adjoint(l, *b, o.dims, t),
                               MatrixShape(td), !adjoint, t),
                       td, t);
      });
  // linalg_householder_product(input, tau): the first n columns of
  // H_0 ... H_{k-1}; ormqr(input, tau, other, left, transpose): Q or Q^H
  // times other (left), or other times them (right, by adjoints).
  reg.Add(
      "aten::linalg_householder_product",
      [](Lowering& l, const tpu::DecodedOp& d,
         const Target& o) -> absl::StatusOr<std::string> {
        const Args args(l);
        if (!args.Defined("input") || !args.Defined("tau") || o.dims.size() < 2)
          return Unsupported(l.op(), "arguments of a form not lowered");
        const HloType& t = *o.type;
        const MatrixShape as(o.dims);
        const tpu::TensorRef& tr = args["tau"].tensor;
        const int64_t k = tr.ndim == 0 ? 1 : tr.sizes[tr.ndim - 1];
        std::vector<int64_t> td = as.batch;
        td.push_back(k);
        absl::StatusOr<std::string> a = l.Operand(args["input"], o.dims, t),
                                    tau = l.Operand(args["tau"], td, t);
        if (!a.ok()) return a;
        if (!tau.ok()) return tau;
        return ApplyQ(l, *a, as, *tau, k, Identity(l, o.dims, t), as, false, t);
      });
  reg.Add(
      "aten::ormqr",
      [](Lowering& l, const tpu::DecodedOp& d,
         const Target& o) -> absl::StatusOr<std::string> {
        // ormqr(self = the reflectors, input2 = tau, input3 = other, left,
        // transpose).
        const Args args(l);
        if (!args.Has("transpose") || !args.Defined("self") ||
            !args.Defined("input2") || !args.Defined("input3") ||
            o.dims.size() < 2) {
          return Unsupported(l.op(), "arguments of a form not lowered");
        }
        const HloType& t = *o.type;
        const std::vector<int64_t> batch = BatchOf(o.dims);
        const std::vector<int64_t> ad =
            WithBatch(DimsOf(args["self"].tensor), batch);
        const MatrixShape as(ad);
        const tpu::TensorRef& tr = args["input2"].tensor;
        const int64_t k = tr.sizes[tr.ndim - 1];
        std::vector<int64_t> td = batch;
        td.push_back(k);
        absl::StatusOr<std::string> a =
            MatrixOperand(l, args["self"], batch, t);
        absl::StatusOr<std::string> c =
            MatrixOperand(l, args["input3"], batch, t);
        if (!a.ok()) return a;
        if (!c.ok()) return c;
        const std::vector<int64_t> tin = DimsOf(tr);
        absl::StatusOr<std::string> tv = l.Operand(args["input2"], tin, t);
        if (!tv.ok()) return tv;
        const std::string tau = l.BroadcastTo(*tv, tin, td, t);
        const bool left = args["left"].b, transpose = args["transpose"].b;
        if (left)
          return ApplyQ(l, *a, as, tau, k, *c, MatrixShape(o.dims), transpose,
                        t);
        // C Q = (Q^H C^H)^H, C Q^H = (Q C^H)^H.
        std::vector<int64_t> tdims = batch;
        tdims.insert(tdims.end(), {o.dims.back(), o.dims[o.dims.size() - 2]});
        const std::string r =
            ApplyQ(l, *a, as, tau, k, Adjoint(l, *c, o.dims, t),
                   MatrixShape(tdims), !transpose, t);
        return Adjoint(l, r, tdims, t);
      });
  // addbmm(self, batch1, batch2, *, beta, alpha): beta self + alpha
  // sum_b batch1[b] @ batch2[b], one dot contracting the batch and k.
  reg.Add(
      "aten::addbmm",
      [](Lowering& l, const tpu::DecodedOp& d,
         const Target& o) -> absl::StatusOr<std::string> {
        const Args args(l);
        if (!args.Has("alpha") || !args.Defined("batch1") ||
            !args.Defined("batch2") || args["batch1"].tensor.ndim != 3 ||
            args["batch2"].tensor.ndim != 3 || o.dims.size() != 2) {
          return Unsupported(l.op(), "expects two batches of matrices");
        }
        const HloType& t = *o.type;
        const std::vector<int64_t> d1 = DimsOf(args["batch1"].tensor),
                                   d2 = DimsOf(args["batch2"].tensor);
        absl::StatusOr<std::string> a = l.Operand(args["batch1"], d1, t),
                                    b = l.Operand(args["batch2"], d2, t);
        if (!a.ok()) return a;
        if (!b.ok()) return b;
        std::string r = l.Emit(absl::StrCat(
            "stablehlo.dot_general ", *a, ", ", *b,
            ", contracting_dims = [0, 2] x [0, 1] : (", TypeOf(d1, t), ", ",
            TypeOf(d2, t), ") -> ", TypeOf(o.dims, t)));
        absl::StatusOr<std::string> alpha = l.Operand(args["alpha"], o.dims, t),
                                    beta = l.Operand(args["beta"], o.dims, t),
                                    self = l.Operand(args["self"], o.dims, t);
        for (auto* v : {&alpha, &beta, &self})
          if (!v->ok()) return *v;
        r = l.Binary("multiply", r, *alpha, o.dims, t);
        // beta = 0 ignores self (NaN included), as ATen does.
        const std::string scaled =
            l.Binary("multiply", *self, *beta, o.dims, t);
        const std::string zero =
            l.Compare("EQ", *beta, l.Constant(0, o.dims, t), o.dims, t);
        return l.Binary(
            "add", r,
            l.Select(zero, l.Constant(0, o.dims, t), scaled, o.dims, t), o.dims,
            t);
      });
}

}  // namespace tpud::pjrt
