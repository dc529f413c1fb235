// linalg_matrix_exp by scaling and squaring: each matrix scaled by 2^-s
// to a 1-norm of at most theta (s per matrix, from its norm), the Taylor
// polynomial of degree 18 of exp at the scaled matrix (theta 3 in float32,
// 1 in float64: the truncation stays below the type's rounding), then
// squared s times in a while loop that runs to the batch's largest s, each
// matrix stopping at its own.
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

// a b for batches of square matrices of shape s.
std::string Product(Lowering& l, const std::string& a, const std::string& b,
                    const MatrixShape& s, const HloType& t) {
  const int64_t r = s.rank();
  return l.Emit(absl::StrCat(
      "stablehlo.dot_general ", a, ", ", b, ", batching_dims = [",
      absl::StrJoin(s.batch_map, ", "), "] x [",
      absl::StrJoin(s.batch_map, ", "), "], contracting_dims = [", r - 1,
      "] x [", r - 2, "], precision = [HIGHEST, HIGHEST] : (",
      TypeOf(s.dims, t), ", ", TypeOf(s.dims, t), ") -> ", TypeOf(s.dims, t)));
}

std::string MatrixExp(Lowering& l, const std::string& a, const MatrixShape& s,
                      const HloType& t) {
  const std::vector<int64_t>& d = s.dims;
  const HloType& i64 = I64();
  const int64_t r = s.rank();
  // The 1-norm: the largest column sum of |a| (the scaling is real).
  const HloType& rt = RealOf(t);
  const std::string cols = l.ReduceOver(Modulus(l, a, d, t), d, {r - 2}, "add",
                                        l.Constant(0, {}, rt), rt);
  const std::string norm =
      l.ReduceOver(cols, s.row, {r - 2}, "maximum", l.Constant(0, {}, rt), rt);
  // s = max(0, ceil(log2(norm / theta))), 0 for a zero or non-finite norm
  // (a NaN or infinity then spreads through the polynomial as on CPU).
  const std::vector<int64_t>& b = s.batch;
  const double theta = rt.dtype == tpu::DType::kDouble ? 1 : 3;
  const std::string logn = l.Unary(
      "ceil",
      l.Binary(
          "divide",
          l.Unary("log",
                  l.Binary("divide", norm, l.Constant(theta, b, rt), b, rt), b,
                  rt),
          l.Constant(0.69314718055994530942, b, rt), b, rt),
      b, rt);
  const std::string finite =
      l.Binary("and", l.Compare("GT", norm, l.Constant(0, b, rt), b, rt),
               l.Compare("LT", norm, l.Constant(1e300, b, rt), b, rt), b,
               *DTypeOf(tpu::DType::kBool));
  const std::string steps_f =
      l.Select(finite, l.Binary("maximum", logn, l.Constant(0, b, rt), b, rt),
               l.Constant(0, b, rt), b, rt);
  const std::string steps = l.Convert(steps_f, b, rt, i64);
  const std::string scale = l.Binary("power", l.Constant(2, b, rt),
                                     l.Unary("negate", steps_f, b, rt), b, rt);
  const std::string as = l.Binary(
      "multiply", a,
      FromReal(l, BroadcastInDim(l, scale, b, d, s.batch_map, rt), d, t), d, t);
  // Horner: e = I + A (I + A/2 (I + ... (I + A/degree))).
  constexpr int degree = 18;
  const std::string eye = Identity(l, d, t);
  std::string p = eye;
  for (int k = degree; k >= 1; --k) {
    const std::string ap = k == degree ? as : Product(l, as, p, s, t);
    p = l.Binary("add", eye, l.Binary("divide", ap, l.Constant(k, d, t), d, t),
                 d, t);
  }
  // Squaring: step j squares the matrices with steps > j.
  const std::string top = l.ReduceOver(steps, b, Range(b.size()), "maximum",
                                       l.Constant(0, {}, i64), i64);
  const int id = l.NextId();
  const std::string j_arg = absl::StrCat("%w", id, "j"),
                    x_arg = absl::StrCat("%w", id, "x");
  const std::string tj = TypeOf({}, i64), tx = TypeOf(d, t);
  std::string going, j_next, x_next;
  const std::string cond =
      l.Region([&] { going = l.Compare("LT", j_arg, top, {}, i64); });
  const std::string body = l.Region([&] {
    const std::string more =
        l.Compare("GT", steps, l.BroadcastTo(j_arg, {}, b, i64), b, i64);
    const std::string mask =
        BroadcastInDim(l, more, b, d, s.batch_map, *DTypeOf(tpu::DType::kBool));
    x_next = l.Select(mask, Product(l, x_arg, x_arg, s, t), x_arg, d, t);
    j_next = l.Binary("add", j_arg, l.Constant(1, {}, i64), {}, i64);
  });
  const std::string loop = l.EmitResults(
      absl::StrCat("stablehlo.while(", j_arg, " = ", l.Constant(0, {}, i64),
                   ", ", x_arg, " = ", p, ") : ", tj, ", ", tx,
                   "\n    cond {\n", cond, "      stablehlo.return ", going,
                   " : ", TypeOf({}, *DTypeOf(tpu::DType::kBool)),
                   "\n    } do {\n", body, "      stablehlo.return ", j_next,
                   ", ", x_next, " : ", tj, ", ", tx, "\n    }"),
      2);
  return loop + "#1";
}

}  // namespace

void RegisterMatrixExp(OpRegistry& reg) {
  reg.Add("aten::linalg_matrix_exp",
          [](Lowering& l, const tpu::DecodedOp&,
             const Target& o) -> absl::StatusOr<std::string> {
            const Args args(l);
            if (!args.Defined("self") || o.dims.size() < 2 ||
                o.dims[o.dims.size() - 1] != o.dims[o.dims.size() - 2]) {
              return absl::InvalidArgumentError(absl::StrCat(
                  l.op(), ": A must be batches of square matrices"));
            }
            if (!o.type->is_float && !IsComplex(*o.type))
              return Unsupported(l.op(), "a dtype not lowered");
            const HloType& t = *o.type;
            // Below float32, computed in float32.
            const HloType& c = IsComplex(t)                     ? t
                               : t.dtype == tpu::DType::kDouble ? F64()
                                                                : F32();
            absl::StatusOr<std::string> a = l.Operand(args["self"], o.dims, c);
            if (!a.ok()) return a;
            if (Numel(args["self"].tensor) == 0)
              return l.Convert(*a, o.dims, c, t);
            const std::string e = MatrixExp(l, *a, MatrixShape(o.dims), c);
            return &c == &t ? e : l.Convert(e, o.dims, c, t);
          });
}

}  // namespace tpud::pjrt
