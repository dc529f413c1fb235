#include "daemon/backends/pjrt/lowering/helpers.h"

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
#include "daemon/backends/pjrt/lowering/lowering.h"

namespace tpud::pjrt {

const tpu::OpArg* Args::Find(absl::string_view name) const {
  if (names_ == nullptr) return nullptr;
  // (The one positional read: the schema's i-th name is the i-th argument.)
  for (size_t i = 0; i < names_->size() && i < d_.num_args; ++i) {
    if ((*names_)[i] == name) return &d_.args[i];
  }
  return nullptr;
}

bool Args::Defined(absl::string_view name) const {
  const tpu::OpArg* a = Find(name);
  return a != nullptr && a->tag == tpu::ArgTag::kTensor;
}

int64_t Args::Int(absl::string_view name, int64_t absent) const {
  const tpu::OpArg* a = Find(name);
  return a == nullptr ? absent : a->i;
}

double Args::Number(absl::string_view name, double absent) const {
  const tpu::OpArg* a = Find(name);
  return a == nullptr ? absent : NumberOf(*a);
}

bool Args::Flag(absl::string_view name, bool absent) const {
  const tpu::OpArg* v = Find(name);
  return v != nullptr && v->tag == tpu::ArgTag::kBool ? v->b : absent;
}

std::string Highest(Lowering& l, const HloType& t) {
  const char* hex = t.dtype == tpu::DType::kFloat      ? "0x7F800000"
                    : t.dtype == tpu::DType::kDouble   ? "0x7FF0000000000000"
                    : t.dtype == tpu::DType::kHalf     ? "0x7C00"
                    : t.dtype == tpu::DType::kBFloat16 ? "0x7F80"
                                                       : nullptr;
  if (hex == nullptr)
    return l.Emit(absl::StrCat("stablehlo.constant dense<", IntLimit(t, true),
                               "> : ", TypeOf({}, t)));
  return l.Emit(
      absl::StrCat("stablehlo.constant dense<", hex, "> : ", TypeOf({}, t)));
}

Rule BinaryRule(const char* op, bool has_alpha, const char* other) {
  return [op, has_alpha, other](
             Lowering& l, const tpu::DecodedOp&,
             const Target& out) -> absl::StatusOr<std::string> {
    const Args args(l);
    if (!args.Has("self") || !args.Has(other))
      return Unsupported(l.op(), "too few arguments");
    absl::StatusOr<std::string> a =
        l.Operand(args["self"], out.dims, *out.type);
    if (!a.ok()) return a;
    absl::StatusOr<std::string> b = l.Operand(args[other], out.dims, *out.type);
    if (!b.ok()) return b;
    std::string rhs = *b;
    if (has_alpha && args.Has("alpha")) {
      const tpu::OpArg& alpha = args["alpha"];
      const bool one =
          (alpha.tag == tpu::ArgTag::kScalarInt && alpha.i == 1) ||
          (alpha.tag == tpu::ArgTag::kScalarDouble && alpha.d == 1.0);
      if (!one) {
        absl::StatusOr<std::string> s = l.Operand(alpha, out.dims, *out.type);
        if (!s.ok()) return s;
        rhs = l.Binary("multiply", rhs, *s, out.dims, *out.type);
      }
    }
    return l.Binary(op, *a, rhs, out.dims, *out.type);
  };
}

Rule UnaryRule(
    std::function<std::string(Lowering&, const std::string&, const Target&)>
        f) {
  return [f](Lowering& l, const tpu::DecodedOp&,
             const Target& out) -> absl::StatusOr<std::string> {
    const Args args(l);
    // (some special functions name their operand x)
    const char* name = args.Has("self") ? "self" : "x";
    if (!args.Defined(name)) return Unsupported(l.op(), "expects a tensor");
    absl::StatusOr<std::string> a = l.Operand(args[name], out.dims, *out.type);
    if (!a.ok()) return a;
    return f(l, *a, out);
  };
}

std::string Modulus(Lowering& l, const std::string& v,
                    const std::vector<int64_t>& dims, const HloType& c) {
  if (!IsComplex(c)) return l.Unary("abs", v, dims, c);
  return l.Emit(absl::StrCat("stablehlo.abs ", v, " : (", TypeOf(dims, c),
                             ") -> ", TypeOf(dims, PartOf(c))));
}

const HloType& RealOf(const HloType& t) { return IsComplex(t) ? PartOf(t) : t; }

namespace {

std::string PartOfComplex(Lowering& l, const char* which, const std::string& v,
                          const std::vector<int64_t>& dims, const HloType& t) {
  return l.Emit(absl::StrCat("stablehlo.", which, " ", v, " : (",
                             TypeOf(dims, t), ") -> ",
                             TypeOf(dims, PartOf(t))));
}

}  // namespace

std::string RealPart(Lowering& l, const std::string& v,
                     const std::vector<int64_t>& dims, const HloType& t) {
  return PartOfComplex(l, "real", v, dims, t);
}

std::string ImagPart(Lowering& l, const std::string& v,
                     const std::vector<int64_t>& dims, const HloType& t) {
  return PartOfComplex(l, "imag", v, dims, t);
}

std::string FromReal(Lowering& l, const std::string& v,
                     const std::vector<int64_t>& dims, const HloType& t) {
  if (!IsComplex(t)) return v;
  return l.Emit(absl::StrCat("stablehlo.complex ", v, ", ",
                             l.Constant(0, dims, PartOf(t)), " : ",
                             TypeOf(dims, t)));
}

std::string Conj(Lowering& l, const std::string& v,
                 const std::vector<int64_t>& dims, const HloType& t) {
  if (!IsComplex(t)) return v;
  return l.Emit(
      absl::StrCat("stablehlo.complex ", RealPart(l, v, dims, t), ", ",
                   l.Unary("negate", ImagPart(l, v, dims, t), dims, PartOf(t)),
                   " : ", TypeOf(dims, t)));
}

std::string SquaredModulus(Lowering& l, const std::string& v,
                           const std::vector<int64_t>& dims, const HloType& t) {
  if (!IsComplex(t)) return l.Binary("multiply", v, v, dims, t);
  const HloType& p = PartOf(t);
  const std::string re = RealPart(l, v, dims, t), im = ImagPart(l, v, dims, t);
  return l.Binary("add", l.Binary("multiply", re, re, dims, p),
                  l.Binary("multiply", im, im, dims, p), dims, p);
}

std::string Cabs1(Lowering& l, const std::string& v,
                  const std::vector<int64_t>& dims, const HloType& t) {
  if (!IsComplex(t)) return l.Unary("abs", v, dims, t);
  const HloType& p = PartOf(t);
  return l.Binary("add", l.Unary("abs", RealPart(l, v, dims, t), dims, p),
                  l.Unary("abs", ImagPart(l, v, dims, t), dims, p), dims, p);
}

absl::StatusOr<std::string> AbsOperand(Lowering& l, const tpu::OpArg& a,
                                       const std::vector<int64_t>& dims,
                                       const HloType& t) {
  const HloType* in =
      a.tag == tpu::ArgTag::kTensor ? DTypeOf(a.tensor.dtype) : nullptr;
  if (in == nullptr || !IsComplex(*in) || IsComplex(t)) {
    absl::StatusOr<std::string> x = l.Operand(a, dims, t);
    if (!x.ok()) return x;
    // (unsigned and bool are their own magnitude; StableHLO's abs takes
    // neither)
    if (t.dtype == tpu::DType::kUInt8 || t.dtype == tpu::DType::kBool)
      return *x;
    return l.Unary("abs", *x, dims, t);
  }
  absl::StatusOr<std::string> z = l.Operand(a, dims, *in);
  if (!z.ok()) return z;
  return l.Convert(Modulus(l, *z, dims, *in), dims, PartOf(*in), t);
}

Rule Simple(const char* op) {
  return UnaryRule([op](Lowering& l, const std::string& a, const Target& out) {
    return l.Unary(op, a, out.dims, *out.type);
  });
}

absl::StatusOr<std::string> MatMul(Lowering& l, const tpu::OpArg& a,
                                   const tpu::OpArg& b, const Target& out) {
  if (a.tag != tpu::ArgTag::kTensor || b.tag != tpu::ArgTag::kTensor ||
      a.tensor.ndim != 2 || b.tensor.ndim != 2) {
    return Unsupported(l.op(), "expects two matrices");
  }
  const std::vector<int64_t> da(a.tensor.sizes, a.tensor.sizes + 2),
      db(b.tensor.sizes, b.tensor.sizes + 2);
  absl::StatusOr<std::string> x = l.Operand(a, da, *out.type);
  if (!x.ok()) return x;
  absl::StatusOr<std::string> y = l.Operand(b, db, *out.type);
  if (!y.ok()) return y;
  return l.Emit(absl::StrCat("stablehlo.dot ", *x, ", ", *y, " : (",
                             TypeOf(da, *out.type), ", ", TypeOf(db, *out.type),
                             ") -> ", TypeOf(out.dims, *out.type)));
}

absl::StatusOr<std::string> Reduce(Lowering& l, const tpu::OpArg& self,
                                   const tpu::OpArg* dim, const Target& out,
                                   bool mean) {
  if (self.tag != tpu::ArgTag::kTensor)
    return Unsupported(l.op(), "expects a tensor");
  const int n = self.tensor.ndim;
  const std::vector<int64_t> in(self.tensor.sizes, self.tensor.sizes + n);
  std::vector<bool> reduced(n, false);
  const bool listed =
      dim != nullptr && dim->tag == tpu::ArgTag::kIntList && !dim->ints.empty();
  for (int i = 0; i < n; ++i) reduced[i] = !listed;
  if (listed && n > 0) {  // (a 0-d tensor: dim 0 / -1 is itself)
    for (int64_t k : dim->ints) {
      const int64_t w = k < 0 ? k + n : k;
      if (w < 0 || w >= n)
        return absl::InvalidArgumentError(
            absl::StrCat(l.op(), ": dim ", k, " out of range"));
      reduced[w] = true;
    }
  }
  absl::StatusOr<std::string> x = l.Operand(self, in, *out.type);
  if (!x.ok()) return x;
  std::vector<int64_t> which, kept;
  int64_t count = 1;
  for (int i = 0; i < n; ++i) {
    if (reduced[i]) {
      which.push_back(i);
      count *= in[i];
    } else {
      kept.push_back(in[i]);
    }
  }
  if (which.empty()) return *x;
  const std::string zero = l.Constant(0, {}, *out.type);
  std::string r = l.Emit(absl::StrCat(
      "stablehlo.reduce(", *x, " init: ", zero,
      ") applies stablehlo.add across dimensions = [",
      absl::StrJoin(which, ", "), "] : (", TypeOf(in, *out.type), ", ",
      TypeOf({}, *out.type), ") -> ", TypeOf(kept, *out.type)));
  if (mean) {
    r = l.Binary("divide", r,
                 l.Constant(static_cast<double>(count), kept, *out.type), kept,
                 *out.type);
  }
  if (kept != out.dims) {
    r = l.Emit(absl::StrCat("stablehlo.reshape ", r, " : (",
                            TypeOf(kept, *out.type), ") -> ",
                            TypeOf(out.dims, *out.type)));
  }
  return r;
}

int64_t WrapDim(int64_t dim, size_t n) {
  return dim < 0 ? dim + static_cast<int64_t>(n) : dim;
}

absl::StatusOr<int64_t> CheckedDim(const std::string& op, int64_t dim,
                                   size_t rank) {
  const int64_t w = WrapDim(dim, rank);
  if (w < 0 || w >= static_cast<int64_t>(rank)) {
    return absl::InvalidArgumentError(
        absl::StrCat(op, ": dim ", dim, " is out of range for a tensor of ",
                     rank, " dimensions (expected -", rank, " to ",
                     static_cast<int64_t>(rank) - 1, ")"));
  }
  return w;
}

int64_t Numel(const tpu::TensorRef& r) {
  int64_t n = 1;
  for (int d = 0; d < r.ndim; ++d) n *= r.sizes[d];
  return n;
}

std::vector<int64_t> DimsOf(const tpu::TensorRef& r) {
  return std::vector<int64_t>(r.sizes, r.sizes + r.ndim);
}

bool RowMajor(const tpu::TensorRef& r) {
  if (Numel(r) == 0) return true;
  int64_t expected = 1;
  for (int i = r.ndim - 1; i >= 0; --i) {
    if (r.sizes[i] == 1) continue;
    if (r.strides[i] != expected) return false;
    expected *= r.sizes[i];
  }
  return true;
}

double NumberOf(const tpu::OpArg& a) {
  switch (a.tag) {
    case tpu::ArgTag::kScalarInt:
    case tpu::ArgTag::kInt:
    case tpu::ArgTag::kSymInt:
      return static_cast<double>(a.i);
    case tpu::ArgTag::kScalarBool:
    case tpu::ArgTag::kBool:
      return a.b ? 1 : 0;
    default:
      return a.d;
  }
}

absl::StatusOr<std::vector<int64_t>> ReducedDims(const Lowering& l,
                                                 const tpu::OpArg* dim,
                                                 size_t rank) {
  std::vector<int64_t> which;
  const bool listed =
      dim != nullptr && dim->tag == tpu::ArgTag::kIntList && !dim->ints.empty();
  const bool one = dim != nullptr && (dim->tag == tpu::ArgTag::kInt ||
                                      dim->tag == tpu::ArgTag::kSymInt);
  if (listed) {
    for (int64_t k : dim->ints) which.push_back(WrapDim(k, rank));
  } else if (one) {
    which.push_back(WrapDim(dim->i, rank));
  } else {
    for (size_t k = 0; k < rank; ++k) which.push_back(static_cast<int64_t>(k));
  }
  std::sort(which.begin(), which.end());
  which.erase(std::unique(which.begin(), which.end()), which.end());
  for (int64_t w : which) {
    if (rank > 0 && (w < 0 || w >= static_cast<int64_t>(rank))) {
      return absl::InvalidArgumentError(
          absl::StrCat(l.op(), ": dim out of range"));
    }
  }
  if (rank == 0) which.clear();  // a 0-d tensor: dim 0 / -1 is itself
  return which;
}

int64_t CountOf(const std::vector<int64_t>& in,
                const std::vector<int64_t>& which) {
  int64_t n = 1;
  for (int64_t w : which) n *= in[w];
  return n;
}

absl::StatusOr<ConvWindow> ConvWindowOf(const Lowering& l, const Args& a,
                                        const std::vector<int64_t>& in,
                                        const std::vector<int64_t>& wd,
                                        const std::vector<int64_t>& other,
                                        bool allow_transposed) {
  for (const char* name : {"stride", "padding", "dilation", "transposed",
                           "output_padding", "groups"}) {
    if (!a.Has(name))
      return Unsupported(l.op(), "arguments of a form not lowered");
  }
  const tpu::OpArg& transposed = a["transposed"];
  ConvWindow w;
  w.transposed = transposed.tag == tpu::ArgTag::kBool && transposed.b;
  if (w.transposed && !allow_transposed)
    return Unsupported(l.op(), "transposed convolution");
  w.sp = in.size() < 3 ? 0 : in.size() - 2;
  if (w.sp == 0 || w.sp > 3 || wd.size() != in.size() ||
      other.size() != in.size()) {
    return Unsupported(l.op(),
                       "expects a batched input of 1 to 3 spatial dimensions");
  }
  auto list = [&](const char* name, int64_t dflt) {
    const tpu::OpArg& arg = a[name];
    std::vector<int64_t> v =
        arg.tag == tpu::ArgTag::kIntList ? arg.ints : std::vector<int64_t>{};
    if (v.empty()) v.push_back(dflt);
    while (v.size() < w.sp) v.push_back(v.back());
    v.resize(w.sp);
    return v;
  };
  w.stride = list("stride", 1);
  w.pad = list("padding", 0);
  w.dilation = list("dilation", 1);
  w.output_padding = list("output_padding", 0);
  const tpu::OpArg& groups = a["groups"];
  if (groups.tag == tpu::ArgTag::kInt || groups.tag == tpu::ArgTag::kSymInt)
    w.groups = groups.i;
  if (w.groups < 1 || in[1] % w.groups != 0)
    return Unsupported(l.op(), "groups must divide the input's channels");
  return w;
}

std::string SoftmaxOf(Lowering& l, const std::string& x,
                      const std::vector<int64_t>& in, int64_t dim,
                      const HloType& t, bool log) {
  if (t.is_float && t.bytes < 4) {
    // As ATen's kernels: float16 / bfloat16 in float32, rounded once (a sum
    // of exponentials just over 1, rounded first, would give a log of 0).
    return l.Convert(
        SoftmaxOf(l, l.Convert(x, in, t, F32()), in, dim, F32(), log), in,
        F32(), t);
  }
  const std::vector<int64_t> which = {dim};
  const std::string m = l.ReduceOver(x, in, which, "maximum", l.Lowest(t), t);
  const std::string xm =
      l.Binary("subtract", x, l.Expand(m, in, which, t), in, t);
  const std::string e = l.Unary("exponential", xm, in, t);
  const std::string sum =
      l.ReduceOver(e, in, which, "add", l.Constant(0, {}, t), t);
  if (log) {
    return l.Binary("subtract", xm,
                    l.Expand(l.Unary("log", sum, Lowering::Kept(in, which), t),
                             in, which, t),
                    in, t);
  }
  return l.Binary("divide", e, l.Expand(sum, in, which, t), in, t);
}

std::string Erf(Lowering& l, const std::string& x,
                const std::vector<int64_t>& d, const HloType& t) {
  auto c = [&](double v) { return l.Constant(v, d, t); };
  const std::string ax = l.Unary("abs", x, d, t);
  const std::string tt = l.Binary(
      "divide", c(1),
      l.Binary("add", c(1), l.Binary("multiply", c(0.3275911), ax, d, t), d, t),
      d, t);
  std::string poly = c(1.061405429);
  for (double k : {-1.453152027, 1.421413741, -0.284496736, 0.254829592}) {
    poly = l.Binary("add", l.Binary("multiply", poly, tt, d, t), c(k), d, t);
  }
  poly = l.Binary("multiply", poly, tt, d, t);
  const std::string e = l.Unary(
      "exponential",
      l.Unary("negate", l.Binary("multiply", ax, ax, d, t), d, t), d, t);
  const std::string y =
      l.Binary("subtract", c(1), l.Binary("multiply", poly, e, d, t), d, t);
  return l.Binary("multiply", l.Unary("sign", x, d, t), y, d, t);
}

std::string GeluCdf(Lowering& l, const std::string& x,
                    const std::vector<int64_t>& d, const HloType& t) {
  const std::string z =
      l.Binary("multiply", x, l.Constant(0.70710678118654752, d, t), d, t);
  return l.Binary("multiply", l.Constant(0.5, d, t),
                  l.Binary("add", l.Constant(1, d, t), Erf(l, z, d, t), d, t),
                  d, t);
}

absl::StatusOr<bool> TanhGelu(const Lowering& l,
                              const tpu::OpArg* approximate) {
  if (approximate == nullptr || approximate->tag != tpu::ArgTag::kString ||
      approximate->s == "none")
    return false;
  if (approximate->s == "tanh") return true;
  return Unsupported(l.op(),
                     "approximate=\"" + approximate->s + "\" is not lowered");
}

std::string GeluTanhInner(Lowering& l, const std::string& x,
                          const std::vector<int64_t>& d, const HloType& t) {
  const std::string x3 =
      l.Binary("multiply", l.Binary("multiply", x, x, d, t), x, d, t);
  const std::string u = l.Binary(
      "add", x, l.Binary("multiply", l.Constant(0.044715, d, t), x3, d, t), d,
      t);
  return l.Unary(
      "tanh",
      l.Binary("multiply", l.Constant(0.79788456080286536, d, t), u, d, t), d,
      t);
}

absl::StatusOr<Picked> PickTargets(Lowering& l, const tpu::OpArg& target,
                                   const tpu::OpArg* weight,
                                   const tpu::OpArg* ignore_index,
                                   const std::vector<int64_t>& nc,
                                   const HloType& t) {
  // (An unbatched input comes as one row, its target 0-d.)
  if (target.tag != tpu::ArgTag::kTensor ||
      (target.tensor.ndim != 1 && !(target.tensor.ndim == 0 && nc[0] == 1))) {
    return Unsupported(l.op(), "expects a 2-d input and a 1-d target");
  }
  const HloType& i64 = I64();
  absl::StatusOr<std::string> t1 =
      l.OperandRef(target.tensor, l.TensorIndex(target), {nc[0]}, i64);
  if (!t1.ok()) return t1.status();
  // The target along the classes: dims = [0].
  absl::StatusOr<std::string> tg = l.Emit(
      absl::StrCat("stablehlo.broadcast_in_dim ", *t1, ", dims = [0] : (",
                   TypeOf({nc[0]}, i64), ") -> ", TypeOf(nc, i64)));
  const std::string iota = l.Iota(1, nc, i64);
  std::string onehot = l.Compare("EQ", *tg, iota, nc, i64);
  const int64_t ignore = ignore_index != nullptr
                             ? static_cast<int64_t>(NumberOf(*ignore_index))
                             : -100;
  const std::string keep = l.Compare(
      "NE", *tg, l.Constant(static_cast<double>(ignore), nc, i64), nc, i64);
  onehot = l.Emit(absl::StrCat("stablehlo.and ", onehot, ", ", keep, " : ",
                               TypeOf(nc, *DTypeOf(tpu::DType::kBool))));
  std::string mask = l.Convert(onehot, nc, *DTypeOf(tpu::DType::kBool), t);
  if (weight != nullptr && weight->tag == tpu::ArgTag::kTensor) {
    const tpu::TensorRef& w = weight->tensor;
    absl::StatusOr<std::string> wv =
        l.OperandRef(w, l.TensorIndex(*weight), nc, t);
    if (!wv.ok()) return wv.status();
    mask = l.Binary("multiply", mask, *wv, nc, t);
  }
  Picked p;
  p.mask = mask;
  p.row_weight = l.ReduceOver(mask, nc, {1}, "add", l.Constant(0, {}, t), t);
  return p;
}

std::string PNorm(Lowering& l, const std::string& diff,
                  const std::vector<int64_t>& full, int64_t axis, double p,
                  const HloType& t) {
  const std::vector<int64_t> kept = Lowering::Kept(full, {axis});
  const std::string zero = l.Constant(0, {}, t);
  if (p == 0) {
    const std::string nz =
        l.Select(l.Compare("NE", diff, l.Constant(0, full, t), full, t),
                 l.Constant(1, full, t), l.Constant(0, full, t), full, t);
    return l.ReduceOver(nz, full, {axis}, "add", zero, t);
  }
  if (std::isinf(p))
    return l.ReduceOver(diff, full, {axis}, "maximum", zero, t);
  if (p == 1) return l.ReduceOver(diff, full, {axis}, "add", zero, t);
  if (p == 2)
    return l.Unary("sqrt",
                   l.ReduceOver(l.Binary("multiply", diff, diff, full, t), full,
                                {axis}, "add", zero, t),
                   kept, t);
  const std::string sum =
      l.ReduceOver(l.Binary("power", diff, l.Constant(p, full, t), full, t),
                   full, {axis}, "add", zero, t);
  return l.Binary("power", sum, l.Constant(1.0 / p, kept, t), kept, t);
}

std::string ScatterFlat(Lowering& l, const std::string& into, int64_t n,
                        const std::string& at, const std::string& what,
                        int64_t m, bool add, const HloType& t) {
  const HloType& i64 = I64();
  const std::string scalar = TypeOf({}, t);
  return l.Emit(absl::StrCat(
      "\"stablehlo.scatter\"(", into, ", ", l.Reshape(at, {m}, {m, 1}, i64),
      ", ", what, ") ({\n", "    ^bb0(%old: ", scalar, ", %new: ", scalar,
      "):\n",
      add ? absl::StrCat("      %sum = stablehlo.add %old, %new : ", scalar,
                         "\n      stablehlo.return %sum : ", scalar, "\n")
          : absl::StrCat("      stablehlo.return %new : ", scalar, "\n"),
      "    }) {indices_are_sorted = false, scatter_dimension_numbers = "
      "#stablehlo.scatter<inserted_window_dims = [0], ",
      "scatter_dims_to_operand_dims = [0], index_vector_dim = 1>, "
      "unique_indices = false} : (",
      TypeOf({n}, t), ", ", TypeOf({m, 1}, i64), ", ", TypeOf({m}, t), ") -> ",
      TypeOf({n}, t)));
}

std::string AdaptiveWindow(Lowering& l, const std::vector<int64_t>& dims,
                           int64_t out_axis, int64_t in_axis, int64_t n,
                           int64_t out) {
  const HloType& i64 = I64();
  auto c = [&](double v) { return l.Constant(v, dims, i64); };
  const std::string oi = l.Iota(out_axis, dims, i64),
                    ii = l.Iota(in_axis, dims, i64);
  const std::string start = l.Binary(
      "divide", l.Binary("multiply", oi, c(static_cast<double>(n)), dims, i64),
      c(static_cast<double>(out)), dims, i64);
  const std::string end = l.Binary(
      "divide",
      l.Binary("add",
               l.Binary("multiply", l.Binary("add", oi, c(1), dims, i64),
                        c(static_cast<double>(n)), dims, i64),
               c(static_cast<double>(out - 1)), dims, i64),
      c(static_cast<double>(out)), dims, i64);
  return l.Binary("and", l.Compare("GE", ii, start, dims, i64),
                  l.Compare("LT", ii, end, dims, i64), dims,
                  *DTypeOf(tpu::DType::kBool));
}

std::string Running(Lowering& l, const std::string& x,
                    const std::vector<int64_t>& in, int64_t dim, const char* op,
                    double init, const HloType& t,
                    const std::string& init_value) {
  const std::string scalar = TypeOf({}, t);
  const std::string init_v =
      init_value.empty() ? l.Constant(init, {}, t) : init_value;
  // op "logaddexp": log(exp(acc) + exp(elt)), kept finite where it can be;
  // for complex numbers as ATen's, from the one of the larger real part.
  const std::string part = IsComplex(t) ? TypeOf({}, PartOf(t)) : std::string();
  const std::string body =
      std::string(op) == "logaddexp" && IsComplex(t)
          ? absl::StrCat(
                "      %ra = stablehlo.real %acc : (", scalar, ") -> ", part,
                "\n", "      %re = stablehlo.real %elt : (", scalar, ") -> ",
                part, "\n", "      %first = stablehlo.compare GE, %ra, %re, ",
                "FLOAT : (", part, ", ", part, ") -> tensor<i1>\n",
                "      %hi = stablehlo.select %first, %acc, %elt : "
                "tensor<i1>, ",
                scalar, "\n",
                "      %lo = stablehlo.select %first, %elt, %acc : "
                "tensor<i1>, ",
                scalar, "\n",
                "      %gap = stablehlo.subtract %lo, %hi : ", scalar, "\n",
                "      %ex = stablehlo.exponential %gap : ", scalar, "\n",
                "      %lp = stablehlo.log_plus_one %ex : ", scalar, "\n",
                "      %sum = stablehlo.add %hi, %lp : ", scalar, "\n",
                "      %rg = stablehlo.real %gap : (", scalar, ") -> ", part,
                "\n", "      %ok = stablehlo.compare EQ, %rg, %rg, ",
                "FLOAT : (", part, ", ", part, ") -> tensor<i1>\n",
                "      %run = stablehlo.select %ok, %sum, %hi : tensor<i1>, ",
                scalar, "\n")
      : std::string(op) != "logaddexp"
          ? absl::StrCat("      %run = stablehlo.", op,
                         " %acc, %elt : ", scalar, "\n")
          : absl::StrCat(
                "      %hi = stablehlo.maximum %acc, %elt : ", scalar, "\n",
                "      %gap = stablehlo.subtract %acc, %elt : ", scalar, "\n",
                "      %ag = stablehlo.abs %gap : ", scalar, "\n",
                "      %ng = stablehlo.negate %ag : ", scalar, "\n",
                "      %ex = stablehlo.exponential %ng : ", scalar, "\n",
                "      %lp = stablehlo.log_plus_one %ex : ", scalar, "\n",
                "      %sum = stablehlo.add %hi, %lp : ", scalar, "\n",
                "      %ok = stablehlo.compare EQ, %gap, %gap, FLOAT : (",
                scalar, ", ", scalar, ") -> tensor<i1>\n",
                "      %run = stablehlo.select %ok, %sum, %hi : tensor<i1>, ",
                scalar, "\n");
  std::vector<int64_t> window(in.size(), 1);
  std::vector<std::string> pad;
  for (size_t k = 0; k < in.size(); ++k) {
    if (static_cast<int64_t>(k) == dim) window[k] = in[k];
    pad.push_back(static_cast<int64_t>(k) == dim
                      ? absl::StrCat("[", in[k] - 1, ", 0]")
                      : "[0, 0]");
  }
  return l.Emit(absl::StrCat(
      "\"stablehlo.reduce_window\"(", x, ", ", init_v, ") ({\n",
      "    ^bb0(%acc: ", scalar, ", %elt: ", scalar, "):\n", body,
      "      stablehlo.return %run : ", scalar, "\n",
      "    }) {window_dimensions = array<i64: ", absl::StrJoin(window, ", "),
      ">, padding = dense<[", absl::StrJoin(pad, ", "), "]> : tensor<",
      in.size(), "x2xi64>} : (", TypeOf(in, t), ", ", scalar, ") -> ",
      TypeOf(in, t)));
}

std::string ReduceWindow(Lowering& l, const std::string& x,
                         const std::vector<int64_t>& in,
                         const std::vector<int64_t>& window,
                         const std::vector<int64_t>& strides,
                         const std::vector<std::pair<int64_t, int64_t>>& pads,
                         const char* op, double init,
                         const std::vector<int64_t>& out, const HloType& t) {
  const std::string scalar = TypeOf({}, t);
  const std::string init_v = l.Constant(init, {}, t);
  std::vector<std::string> pad;
  for (const auto& [lo, hi] : pads)
    pad.push_back(absl::StrCat("[", lo, ", ", hi, "]"));
  return l.Emit(absl::StrCat(
      "\"stablehlo.reduce_window\"(", x, ", ", init_v, ") ({\n",
      "    ^bb0(%acc: ", scalar, ", %elt: ", scalar, "):\n",
      "      %run = stablehlo.", op, " %acc, %elt : ", scalar, "\n",
      "      stablehlo.return %run : ", scalar, "\n",
      "    }) {window_dimensions = array<i64: ", absl::StrJoin(window, ", "),
      ">, window_strides = array<i64: ", absl::StrJoin(strides, ", "),
      ">, padding = dense<[", absl::StrJoin(pad, ", "), "]> : tensor<",
      in.size(), "x2xi64>} : (", TypeOf(in, t), ", ", scalar, ") -> ",
      TypeOf(out, t)));
}

std::string StackIndices(Lowering& l, const std::vector<std::string>& parts,
                         const std::vector<int64_t>& shape) {
  const HloType& i64 = I64();
  std::vector<int64_t> one = shape, all = shape;
  one.push_back(1);
  all.push_back(static_cast<int64_t>(parts.size()));
  std::vector<std::string> columns, types;
  for (const std::string& p : parts) {
    columns.push_back(l.Reshape(p, shape, one, i64));
    types.push_back(TypeOf(one, i64));
  }
  if (columns.size() == 1) return columns[0];
  return l.Emit(
      absl::StrCat("stablehlo.concatenate ", absl::StrJoin(columns, ", "),
                   ", dim = ", shape.size(), " : (", absl::StrJoin(types, ", "),
                   ") -> ", TypeOf(all, i64)));
}

std::string ElementIndex(Lowering& l, const std::string& along,
                         const std::vector<int64_t>& shape, int64_t dim) {
  std::vector<std::string> parts;
  for (size_t q = 0; q < shape.size(); ++q) {
    parts.push_back(static_cast<int64_t>(q) == dim
                        ? along
                        : l.Iota(static_cast<int64_t>(q), shape, I64()));
  }
  return StackIndices(l, parts, shape);
}

std::vector<int64_t> Range(size_t n) {
  std::vector<int64_t> r(n);
  for (size_t q = 0; q < n; ++q) r[q] = static_cast<int64_t>(q);
  return r;
}

absl::StatusOr<IndexPlan> PlanIndex(Lowering& l, const tpu::OpArg& list,
                                    const std::vector<int64_t>& in) {
  if (list.tag != tpu::ArgTag::kOptionalTensorList &&
      list.tag != tpu::ArgTag::kTensorList) {
    return Unsupported(l.op(), "arguments of a form not lowered");
  }
  IndexPlan p;
  std::vector<const tpu::TensorRef*>
      refs;  // (list.tensors has an entry per position)
  for (size_t q = 0; q < list.tensors.size(); ++q) {
    if (q < list.tensor_present.size() && !list.tensor_present[q]) continue;
    const tpu::TensorRef& r = list.tensors[q];
    const HloType* it = DTypeOf(r.dtype);
    if (it == nullptr || it->is_float || it->dtype == tpu::DType::kBool ||
        it->dtype == tpu::DType::kUInt8) {
      return Unsupported(l.op(),
                         "boolean or byte mask indices (their result's shape "
                         "depends on the data)");
    }
    p.indexed.push_back(static_cast<int64_t>(q));
    refs.push_back(&r);
  }
  if (p.indexed.empty() ||
      p.indexed.back() >= static_cast<int64_t>(in.size())) {
    return Unsupported(l.op(), "arguments of a form not lowered");
  }
  for (const tpu::TensorRef* r : refs) {
    const std::vector<int64_t> s = DimsOf(*r);
    if (s.size() > p.batch.size())
      p.batch.insert(p.batch.begin(), s.size() - p.batch.size(), 1);
    for (size_t k = 0; k < s.size(); ++k) {
      int64_t& b = p.batch[p.batch.size() - s.size() + k];
      if (b == 1) {
        b = s[k];
      } else if (s[k] != 1 && s[k] != b) {
        return absl::InvalidArgumentError(l.op() +
                                          ": index shapes do not broadcast");
      }
    }
  }
  const HloType& i64 = I64();
  const std::vector<int64_t>& bs = p.batch;
  std::vector<int64_t> all = bs;
  all.push_back(static_cast<int64_t>(p.indexed.size()));
  std::vector<std::string> parts;
  for (size_t k = 0; k < refs.size(); ++k) {
    absl::StatusOr<std::string> iv =
        l.OperandRef(*refs[k], l.TensorIndex(list) + k, bs, i64);
    if (!iv.ok()) return iv.status();
    const int64_t size = in[p.indexed[k]];
    const std::string wrapped = l.Select(
        l.Compare("LT", *iv, l.Constant(0, bs, i64), bs, i64),
        l.Binary("add", *iv, l.Constant(static_cast<double>(size), bs, i64), bs,
                 i64),
        *iv, bs, i64);
    l.CheckRange(wrapped, bs, size,
                 absl::StrCat("an index is out of bounds for dimension ",
                              p.indexed[k], " with size ", size));
    parts.push_back(wrapped);
  }
  p.indices = StackIndices(l, parts, bs);
  p.indices_type = TypeOf(all, i64);
  bool adjacent = true;
  for (size_t k = 1; k < p.indexed.size(); ++k)
    adjacent = adjacent && p.indexed[k] == p.indexed[k - 1] + 1;
  const int64_t at = adjacent ? p.indexed[0] : 0;
  const int64_t nb = static_cast<int64_t>(bs.size());
  // Walk self's dims: an indexed one contributes the batch dims (once, at
  // `at`), another its own size.
  int64_t pos = 0;
  bool batch_placed = false;
  for (size_t q = 0; q < in.size(); ++q) {
    const bool ix = std::find(p.indexed.begin(), p.indexed.end(),
                              static_cast<int64_t>(q)) != p.indexed.end();
    p.slice.push_back(ix ? 1 : in[q]);
    if (!batch_placed && pos == at && (ix || !adjacent)) {
      for (int64_t b : bs) p.result.push_back(b);
      pos += nb;
      batch_placed = true;
    }
    if (ix) continue;
    p.window.push_back(pos++);
    p.result.push_back(in[q]);
  }
  if (!batch_placed) {
    for (int64_t b : bs) p.result.push_back(b);
  }
  return p;
}

}  // namespace tpud::pjrt
