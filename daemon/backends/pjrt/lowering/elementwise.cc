// Elementwise ops: arithmetic, comparisons, unary math, rounding, clamps,
// selection (where, masked_fill) and fills.
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

// complex32 elements (ui32, see kHloTypes) as complex64, and back (each
// part rounded to float16): the real part is the element's low half. The
// halves are split and joined with integer ops, not a bitcast between
// widths (XLA's simplifier folds two of those into one it then rejects).
constexpr HloType kU16{tpu::DType::kUInt16, "ui16", PJRT_Buffer_Type_U16};

std::string ChalfToComplex(Lowering& l, const std::string& raw,
                           const std::vector<int64_t>& dims) {
  const HloType& u32 = *DTypeOf(tpu::DType::kComplexHalf);
  const HloType& f16 = *DTypeOf(tpu::DType::kHalf);
  const HloType& f32 = F32();
  const auto half = [&](const std::string& bits) {
    const std::string h = l.Emit(absl::StrCat(
        "stablehlo.bitcast_convert ", l.Convert(bits, dims, u32, kU16), " : (",
        TypeOf(dims, kU16), ") -> ", TypeOf(dims, f16)));
    return l.Convert(h, dims, f16, f32);
  };
  const std::string re =
      half(l.Binary("and", raw, l.Constant(65535, dims, u32), dims, u32));
  const std::string im = half(l.Binary("shift_right_logical", raw,
                                       l.Constant(16, dims, u32), dims, u32));
  return l.Emit(
      absl::StrCat("stablehlo.complex ", re, ", ", im, " : ",
                   TypeOf(dims, *DTypeOf(tpu::DType::kComplexFloat))));
}

std::string ComplexToChalf(Lowering& l, const std::string& v,
                           const std::vector<int64_t>& dims) {
  const HloType& u32 = *DTypeOf(tpu::DType::kComplexHalf);
  const HloType& f16 = *DTypeOf(tpu::DType::kHalf);
  const HloType& f32 = F32();
  const HloType& c64 = *DTypeOf(tpu::DType::kComplexFloat);
  const auto bits = [&](const char* which) {
    const std::string p =
        l.Emit(absl::StrCat("stablehlo.", which, " ", v, " : (",
                            TypeOf(dims, c64), ") -> ", TypeOf(dims, f32)));
    const std::string h = l.Emit(
        absl::StrCat("stablehlo.bitcast_convert ", l.Convert(p, dims, f32, f16),
                     " : (", TypeOf(dims, f16), ") -> ", TypeOf(dims, kU16)));
    return l.Convert(h, dims, kU16, u32);
  };
  return l.Binary("or", bits("real"),
                  l.Binary("shift_left", bits("imag"),
                           l.Constant(16, dims, u32), dims, u32),
                  dims, u32);
}

// self and other of an op on integers (shifts, gcd), as its output's type.
absl::Status IntegerOperands(Lowering& l, const Target& o, std::string* a,
                             std::string* b) {
  const Args args(l);
  if (!args.Has("self") || !args.Has("other"))
    return Unsupported(l.op(), "too few arguments");
  const HloType& t = *o.type;
  if (t.is_float || IsComplex(t) || t.dtype == tpu::DType::kBool)
    return Unsupported(l.op(), "a dtype that is not lowered");
  absl::StatusOr<std::string> x = l.Operand(args["self"], o.dims, t),
                              y = l.Operand(args["other"], o.dims, t);
  if (!x.ok()) return x.status();
  if (!y.ok()) return y.status();
  *a = *x;
  *b = *y;
  return absl::OkStatus();
}

}  // namespace

void RegisterElementwise(OpRegistry& reg) {
  // Arguments are read by their schema names (Args, helpers.h).
  // (Their in-place and out= forms are derived: registry.h.)
  reg.Add("aten::add.Tensor", BinaryRule("add", true));
  reg.Add("aten::add.Scalar", BinaryRule("add", true));
  reg.Add("aten::sub.Tensor", BinaryRule("subtract", true));
  reg.Add("aten::sub.Scalar", BinaryRule("subtract", true));
  reg.Add("aten::mul.Tensor", BinaryRule("multiply", false));
  reg.Add("aten::mul.Scalar", BinaryRule("multiply", false));
  reg.Add("aten::div.Tensor", BinaryRule("divide", false));
  reg.Add("aten::div.Scalar", BinaryRule("divide", false));
  reg.Add("aten::neg", Simple("negate"));
  reg.Add("aten::exp", Simple("exponential"));
  reg.Add("aten::log", Simple("log"));
  reg.Add("aten::tanh", Simple("tanh"));
  reg.Add("aten::sqrt", Simple("sqrt"));
  reg.Add("aten::rsqrt", Simple("rsqrt"));
  // abs: of a complex tensor, its modulus (a real result).
  reg.Add("aten::abs",
          [](Lowering& l, const tpu::DecodedOp&,
             const Target& o) -> absl::StatusOr<std::string> {
            const Args args(l);
            if (!args.Defined("self"))
              return Unsupported(l.op(), "expects a tensor");
            return AbsOperand(l, args["self"], o.dims, *o.type);
          });
  reg.Add("aten::sin", Simple("sine"));
  reg.Add("aten::cos", Simple("cosine"));
  reg.Add("aten::sigmoid", Simple("logistic"));
  reg.Add("aten::relu",
          UnaryRule([](Lowering& l, const std::string& a, const Target& o) {
            return l.Binary("maximum", a, l.Constant(0, o.dims, *o.type),
                            o.dims, *o.type);
          }));
  reg.Add("aten::maximum", BinaryRule("maximum", false));
  reg.Add("aten::pow.Tensor_Scalar", BinaryRule("power", false, "exponent"));
  reg.Add("aten::pow.Tensor_Tensor", BinaryRule("power", false, "exponent"));
  reg.Add("aten::minimum", BinaryRule("minimum", false));
  // copy_(self, src), fill_.Scalar(self, value): self overwritten.
  for (const auto& [name, from] :
       std::vector<std::pair<std::string, const char*>>{
           {"aten::copy_", "src"}, {"aten::fill_.Scalar", "value"}}) {
    const char* arg = from;
    reg.Add(name,
            [arg](Lowering& l, const tpu::DecodedOp&,
                  const Target& out) -> absl::StatusOr<std::string> {
              const Args a(l);
              if (!a.Has(arg)) return Unsupported(l.op(), "too few arguments");
              const tpu::OpArg& from = a[arg];
              const HloType& c64 = *DTypeOf(tpu::DType::kComplexFloat);
              const bool chalf_in =
                  from.tag == tpu::ArgTag::kTensor &&
                  from.tensor.dtype == tpu::Code(tpu::DType::kComplexHalf);
              const bool chalf_out =
                  out.type->dtype == tpu::DType::kComplexHalf;
              if (!chalf_in && !chalf_out)
                return l.Operand(from, out.dims, *out.type);
              // complex32 in or out: through complex64.
              std::string v;
              if (chalf_in) {
                absl::StatusOr<std::string> raw =
                    l.Operand(from, out.dims, *DTypeOf(from.tensor.dtype));
                if (!raw.ok()) return raw;
                v = ChalfToComplex(l, *raw, out.dims);
              } else {
                absl::StatusOr<std::string> x = l.Operand(from, out.dims, c64);
                if (!x.ok()) return x;
                v = *x;
              }
              if (chalf_out) return ComplexToChalf(l, v, out.dims);
              return l.Convert(v, out.dims, c64, *out.type);
            })
        .OverwritesFirst();
  }
  reg.Add("aten::zero_",
          [](Lowering& l, const tpu::DecodedOp&,
             const Target& out) -> absl::StatusOr<std::string> {
            return l.Constant(0, out.dims, *out.type);
          })
      .OverwritesFirst();
  // frexp(self) -> (mantissa, exponent): x = mantissa * 2^exponent with
  // |mantissa| in [0.5, 1), from the bits (subnormals scaled up first);
  // zero, infinity and NaN keep themselves with exponent 0.
  reg.AddMulti(
      "aten::frexp.Tensor",
      [](Lowering& l, const tpu::DecodedOp&, const std::vector<Target>& o)
          -> absl::StatusOr<std::vector<std::string>> {
        const Args a(l);
        if (o.size() != 2 || !a.Defined("self"))
          return Unsupported(l.op(), "expects a tensor");
        const HloType& t = *o[0].type;
        if (t.dtype != tpu::DType::kFloat && t.dtype != tpu::DType::kDouble)
          return Unsupported(l.op(), "a dtype that is not lowered");
        const bool wide = t.dtype == tpu::DType::kDouble;
        const HloType& it = wide ? I64() : *DTypeOf(tpu::DType::kInt32);
        const std::vector<int64_t>& dims = o[0].dims;
        absl::StatusOr<std::string> xs = l.Operand(a["self"], dims, t);
        if (!xs.ok()) return xs.status();
        const int mant = wide ? 52 : 23, bias = wide ? 1022 : 126,
                  scale = wide ? 54 : 25;
        const double mask = wide ? 2047 : 255;
        const std::string x = *xs;
        const std::string tiny = l.Compare(
            "LT", l.Unary("abs", x, dims, t),
            l.Constant(wide ? 2.2250738585072014e-308 : 1.1754943508222875e-38,
                       dims, t),
            dims, t);
        const std::string up = l.Select(
            tiny,
            l.Binary("multiply", x, l.Constant(std::ldexp(1.0, scale), dims, t),
                     dims, t),
            x, dims, t);
        const std::string bits =
            l.Emit(absl::StrCat("stablehlo.bitcast_convert ", up, " : (",
                                TypeOf(dims, t), ") -> ", TypeOf(dims, it)));
        const std::string field =
            l.Binary("and",
                     l.Binary("shift_right_logical", bits,
                              l.Constant(mant, dims, it), dims, it),
                     l.Constant(mask, dims, it), dims, it);
        std::string e =
            l.Binary("subtract", field, l.Constant(bias, dims, it), dims, it);
        e = l.Select(
            tiny,
            l.Binary("subtract", e, l.Constant(scale, dims, it), dims, it), e,
            dims, it);
        // Clear the exponent field, then set it to the bias: [0.5, 1).
        const std::string keep =
            l.Unary("not",
                    l.Binary("shift_left", l.Constant(mask, dims, it),
                             l.Constant(mant, dims, it), dims, it),
                    dims, it);
        const std::string mbits =
            l.Binary("or", l.Binary("and", bits, keep, dims, it),
                     l.Binary("shift_left", l.Constant(bias, dims, it),
                              l.Constant(mant, dims, it), dims, it),
                     dims, it);
        const std::string mv =
            l.Emit(absl::StrCat("stablehlo.bitcast_convert ", mbits, " : (",
                                TypeOf(dims, it), ") -> ", TypeOf(dims, t)));
        const HloType& i1 = *DTypeOf(tpu::DType::kBool);
        const std::string finite =
            l.Emit(absl::StrCat("stablehlo.is_finite ", x, " : (",
                                TypeOf(dims, t), ") -> ", TypeOf(dims, i1)));
        const std::string plain = l.Binary(
            "and", finite, l.Compare("NE", x, l.Constant(0, dims, t), dims, t),
            dims, i1);
        return std::vector<std::string>{
            l.Select(plain, mv, x, dims, t),
            l.Convert(l.Select(plain, e, l.Constant(0, dims, it), dims, it),
                      dims, it, *o[1].type)};
      });
  reg.Alias("aten::frexp.Tensor_out", "aten::frexp.Tensor");
  for (const auto& [name, dir] :
       std::vector<std::pair<std::string, const char*>>{{"eq", "EQ"},
                                                        {"ne", "NE"},
                                                        {"lt", "LT"},
                                                        {"le", "LE"},
                                                        {"gt", "GT"},
                                                        {"ge", "GE"}}) {
    for (const char* overload :
         {".Tensor", ".Scalar", ".Tensor_out", ".Scalar_out"}) {
      const char* cmp = dir;
      reg.Add(
          "aten::" + name + overload,
          [cmp](Lowering& l, const tpu::DecodedOp&,
                const Target& o) -> absl::StatusOr<std::string> {
            const Args args(l);
            if (!args.Has("self") || !args.Has("other"))
              return Unsupported(l.op(), "arguments of a form not lowered");
            // Compared in a type both sides fit: complex128 if either is
            // complex (eq and ne), double if either is floating.
            bool floating = false, complex = false;
            for (const char* name : {"self", "other"}) {
              const tpu::OpArg& a = args[name];
              const HloType* t =
                  a.tag == tpu::ArgTag::kTensor ? DTypeOf(a.tensor.dtype)
                  : a.tag == tpu::ArgTag::kScalarTensor ? DTypeOf(a.dtype)
                                                        : nullptr;
              floating |= (t != nullptr && t->is_float) ||
                          a.tag == tpu::ArgTag::kScalarDouble;
              complex |= (t != nullptr && IsComplex(*t)) ||
                         a.tag == tpu::ArgTag::kScalarComplex;
            }
            if (complex && cmp[0] != 'E' && cmp[0] != 'N')
              return Unsupported(l.op(), "an order of complex numbers");
            const HloType& t = complex    ? *DTypeOf(tpu::DType::kComplexDouble)
                               : floating ? F64()
                                          : I64();
            absl::StatusOr<std::string> a = l.Operand(args["self"], o.dims, t),
                                        b = l.Operand(args["other"], o.dims, t);
            if (!a.ok()) return a;
            if (!b.ok()) return b;
            return l.Convert(l.Compare(cmp, *a, *b, o.dims, t), o.dims,
                             *DTypeOf(tpu::DType::kBool), *o.type);
          });
    }
  }
  // self + weight * (end - self)
  for (const char* name :
       {"aten::lerp.Scalar", "aten::lerp_.Scalar", "aten::lerp.Scalar_out",
        "aten::lerp.Tensor", "aten::lerp_.Tensor", "aten::lerp.Tensor_out"}) {
    reg.Add(
        name,
        [](Lowering& l, const tpu::DecodedOp&,
           const Target& o) -> absl::StatusOr<std::string> {
          const Args args(l);
          if (!args.Has("self") || !args.Has("end") || !args.Has("weight"))
            return Unsupported(l.op(), "arguments of a form not lowered");
          const HloType& t = *o.type;
          absl::StatusOr<std::string> a = l.Operand(args["self"], o.dims, t),
                                      b = l.Operand(args["end"], o.dims, t),
                                      w = l.Operand(args["weight"], o.dims, t);
          for (auto* v : {&a, &b, &w})
            if (!v->ok()) return *v;
          return l.Binary(
              "add", *a,
              l.Binary("multiply", *w, l.Binary("subtract", *b, *a, o.dims, t),
                       o.dims, t),
              o.dims, t);
        });
  }
  // self + value * (t1 * t2), self + value * (t1 / t2)
  for (const char* base : {"addcmul", "addcdiv"}) {
    const bool mul = std::string(base) == "addcmul";
    for (const std::string suffix : {"", "_", ".out"}) {
      reg.Add(absl::StrCat("aten::", base, suffix),
              [mul](Lowering& l, const tpu::DecodedOp&,
                    const Target& o) -> absl::StatusOr<std::string> {
                const Args args(l);
                if (!args.Has("self") || !args.Has("tensor1") ||
                    !args.Has("tensor2"))
                  return Unsupported(l.op(), "arguments of a form not lowered");
                const HloType& t = *o.type;
                absl::StatusOr<std::string> a = l.Operand(args["self"], o.dims,
                                                          t),
                                            b = l.Operand(args["tensor1"],
                                                          o.dims, t),
                                            c = l.Operand(args["tensor2"],
                                                          o.dims, t);
                for (auto* v : {&a, &b, &c})
                  if (!v->ok()) return *v;
                std::string prod =
                    l.Binary(mul ? "multiply" : "divide", *b, *c, o.dims, t);
                if (args.Number("value", 1.0) != 1.0) {
                  absl::StatusOr<std::string> v =
                      l.Operand(args["value"], o.dims, t);
                  if (!v.ok()) return v;
                  prod = l.Binary("multiply", prod, *v, o.dims, t);
                }
                return l.Binary("add", *a, prod, o.dims, t);
              });
    }
  }
  using F =
      std::function<std::string(Lowering&, const std::string&, const Target&)>;
  auto unary = [&reg](const std::string& name, F f) {
    reg.Add(name, UnaryRule(std::move(f)));
  };
  auto c = [](Lowering& l, double v, const Target& o) {
    return l.Constant(v, o.dims, *o.type);
  };
  auto B = [](Lowering& l, const char* op, const std::string& a,
              const std::string& b,
              const Target& o) { return l.Binary(op, a, b, o.dims, *o.type); };
  auto U = [](Lowering& l, const char* op, const std::string& a,
              const Target& o) { return l.Unary(op, a, o.dims, *o.type); };
  // floor, ceil, round and trunc keep an integer; sign of a bool is itself,
  // of an unsigned integer 0 or 1 (StableHLO's ops take floats, and sign
  // signed integers only).
  for (const auto& [name, op] :
       std::vector<std::pair<std::string, const char*>>{
           {"floor", "floor"},
           {"ceil", "ceil"},
           {"round", "round_nearest_even"},
           {"sign", "sign"},
           {"sgn", "sign"}}) {
    const char* hlo = op;
    const bool is_sign = std::string(op) == "sign";
    unary("aten::" + name,
          [hlo, is_sign](Lowering& l, const std::string& x, const Target& o) {
            const HloType& t = *o.type;
            if (t.is_float || IsComplex(t)) return l.Unary(hlo, x, o.dims, t);
            if (!is_sign || t.dtype == tpu::DType::kBool) return x;
            if (t.dtype != tpu::DType::kUInt8)
              return l.Unary(hlo, x, o.dims, t);
            return l.Select(
                l.Compare("EQ", x, l.Constant(0, o.dims, t), o.dims, t),
                l.Constant(0, o.dims, t), l.Constant(1, o.dims, t), o.dims, t);
          });
  }
  for (const auto& [name, op] :
       std::vector<std::pair<std::string, const char*>>{
           {"log1p", "log_plus_one"},
           {"expm1", "exponential_minus_one"},
           {"tan", "tan"}}) {
    reg.Add("aten::" + name, Simple(op));
  }
  unary("aten::reciprocal",
        [=](Lowering& l, const std::string& x, const Target& o) {
          return B(l, "divide", c(l, 1, o), x, o);
        });
  unary("aten::square",
        [=](Lowering& l, const std::string& x, const Target& o) {
          return B(l, "multiply", x, x, o);
        });
  unary("aten::trunc", [=](Lowering& l, const std::string& x, const Target& o) {
    if (!o.type->is_float) return x;  // (an integer is its own truncation)
    return B(l, "multiply", U(l, "sign", x, o),
             U(l, "floor", U(l, "abs", x, o), o), o);
  });
  unary("aten::erf", [](Lowering& l, const std::string& x, const Target& o) {
    return Erf(l, x, o.dims, *o.type);
  });
  unary("aten::atan", [=](Lowering& l, const std::string& x, const Target& o) {
    return B(l, "atan2", x, c(l, 1, o), o);
  });
  unary("aten::asin", [=](Lowering& l, const std::string& x, const Target& o) {
    return B(l, "atan2", x,
             U(l, "sqrt",
               B(l, "subtract", c(l, 1, o), B(l, "multiply", x, x, o), o), o),
             o);
  });
  unary("aten::acos", [=](Lowering& l, const std::string& x, const Target& o) {
    return B(l, "atan2",
             U(l, "sqrt",
               B(l, "subtract", c(l, 1, o), B(l, "multiply", x, x, o), o), o),
             x, o);
  });
  for (bool sinh : {true, false}) {
    unary(sinh ? "aten::sinh" : "aten::cosh",
          [=](Lowering& l, const std::string& x, const Target& o) {
            const std::string e = U(l, "exponential", x, o),
                              f = U(l, "exponential", U(l, "negate", x, o), o);
            return B(l, "multiply", B(l, sinh ? "subtract" : "add", e, f, o),
                     c(l, 0.5, o), o);
          });
  }
  unary("aten::log2", [=](Lowering& l, const std::string& x, const Target& o) {
    return B(l, "divide", U(l, "log", x, o), c(l, 0.69314718055994531, o), o);
  });
  unary("aten::log10", [=](Lowering& l, const std::string& x, const Target& o) {
    return B(l, "divide", U(l, "log", x, o), c(l, 2.3025850929940457, o), o);
  });
  unary("aten::silu", [=](Lowering& l, const std::string& x, const Target& o) {
    return B(l, "multiply", x, U(l, "logistic", x, o), o);
  });
  unary("aten::exp2", [=](Lowering& l, const std::string& x, const Target& o) {
    return B(l, "power", c(l, 2, o), x, o);
  });
  // Predicates of one tensor: computed on its own dtype, written as bool.
  for (const auto& [name, kind] : std::vector<std::pair<std::string, int>>{
           {"logical_not", 0}, {"isnan", 1}, {"isinf", 2}, {"isfinite", 3}}) {
    const int k = kind;
    reg.Add("aten::" + name,
            [k](Lowering& l, const tpu::DecodedOp&,
                const Target& o) -> absl::StatusOr<std::string> {
              const Args a(l);
              if (!a.Defined("self"))
                return Unsupported(l.op(), "expects a tensor");
              const HloType* t = DTypeOf(a["self"].tensor.dtype);
              if (t == nullptr) return Unsupported(l.op(), "dtype");
              if (k != 0 && !t->is_float) {
                return l.Convert(l.Constant(k == 3 ? 1 : 0, o.dims,
                                            *DTypeOf(tpu::DType::kBool)),
                                 o.dims, *DTypeOf(tpu::DType::kBool), *o.type);
              }
              absl::StatusOr<std::string> x = l.Operand(a["self"], o.dims, *t);
              if (!x.ok()) return x;
              std::string p;
              if (k == 0)
                p = l.Compare("EQ", *x, l.Constant(0, o.dims, *t), o.dims, *t);
              if (k == 1) p = l.Compare("NE", *x, *x, o.dims, *t);
              if (k == 2)
                p = l.Compare(
                    "EQ", l.Unary("abs", *x, o.dims, *t),
                    l.Unary("abs",
                            l.Binary("divide", l.Constant(1, o.dims, *t),
                                     l.Constant(0, o.dims, *t), o.dims, *t),
                            o.dims, *t),
                    o.dims, *t);
              if (k == 3)
                p = l.Emit(absl::StrCat(
                    "stablehlo.is_finite ", *x, " : (", TypeOf(o.dims, *t),
                    ") -> ", TypeOf(o.dims, *DTypeOf(tpu::DType::kBool))));
              return l.Convert(p, o.dims, *DTypeOf(tpu::DType::kBool), *o.type);
            });
  }
  for (const char* ov : {".Tensor", ".Scalar"}) {
    reg.Add(std::string("aten::atan2") +
                (std::string(ov) == ".Tensor" ? "" : ".Scalar"),
            BinaryRule("atan2", false));
    reg.Add(
        std::string("aten::remainder") + ov,
        [](Lowering& l, const tpu::DecodedOp&,
           const Target& o) -> absl::StatusOr<std::string> {
          // Python's %: the result has the divisor's sign.
          const Args args(l);
          if (!args.Has("self") || !args.Has("other"))
            return Unsupported(l.op(), "too few arguments");
          const HloType& t = *o.type;
          absl::StatusOr<std::string> a = l.Operand(args["self"], o.dims, t),
                                      b = l.Operand(args["other"], o.dims, t);
          if (!a.ok()) return a;
          if (!b.ok()) return b;
          const std::string r = l.Binary("remainder", *a, *b, o.dims, t);
          const std::string zero = l.Constant(0, o.dims, t);
          const std::string nz = l.Compare("NE", r, zero, o.dims, t);
          const std::string differ =
              l.Compare("NE", l.Compare("LT", r, zero, o.dims, t),
                        l.Compare("LT", *b, zero, o.dims, t), o.dims,
                        *DTypeOf(tpu::DType::kBool));
          const std::string fix =
              l.Emit(absl::StrCat("stablehlo.and ", nz, ", ", differ, " : ",
                                  TypeOf(o.dims, *DTypeOf(tpu::DType::kBool))));
          return l.Select(fix, l.Binary("add", r, *b, o.dims, t), r, o.dims, t);
        });
    for (const auto& [name, op] :
         std::vector<std::pair<std::string, const char*>>{
             {"bitwise_and", "and"},
             {"bitwise_or", "or"},
             {"bitwise_xor", "xor"}}) {
      reg.Add("aten::" + name + ov, BinaryRule(op, false));
    }
  }
  // bitwise_left_shift / bitwise_right_shift (and << >>): a shift by less
  // than the width; past it, or negative, a left shift gives 0 and a right
  // one the sign (0 for unsigned), as ATen's kernels.
  for (bool left : {true, false}) {
    Rule shift = [left](Lowering& l, const tpu::DecodedOp&,
                        const Target& o) -> absl::StatusOr<std::string> {
      std::string a, b;
      if (absl::Status st = IntegerOperands(l, o, &a, &b); !st.ok()) return st;
      const HloType& t = *o.type;
      const bool is_unsigned = t.dtype == tpu::DType::kUInt8;
      const int bits = t.bytes * 8;
      const std::string beyond = l.Binary(
          "or", l.Compare("LT", b, l.Constant(0, o.dims, t), o.dims, t),
          l.Compare("GE", b, l.Constant(bits, o.dims, t), o.dims, t), o.dims,
          *DTypeOf(tpu::DType::kBool));
      const char* op = left          ? "shift_left"
                       : is_unsigned ? "shift_right_logical"
                                     : "shift_right_arithmetic";
      const std::string far =
          left || is_unsigned
              ? l.Constant(0, o.dims, t)
              : l.Binary("shift_right_arithmetic", a,
                         l.Constant(bits - 1, o.dims, t), o.dims, t);
      return l.Select(beyond, far, l.Binary(op, a, b, o.dims, t), o.dims, t);
    };
    const std::string name =
        left ? "bitwise_left_shift" : "bitwise_right_shift";
    for (const char* form : {".Tensor", ".Tensor_Scalar", ".Scalar_Tensor"})
      reg.Add("aten::" + name + form, shift);
    const std::string dunder = left ? "__lshift__" : "__rshift__";
    for (const char* form : {".Tensor", ".Scalar"})
      reg.Add("aten::" + dunder + form, shift);
  }
  // gcd(self, other) of integers: Euclid's algorithm on |a| and |b|, a
  // while loop until every element's remainder is 0 (ATen's calc_gcd).
  reg.Add("aten::gcd",
          [](Lowering& l, const tpu::DecodedOp&,
             const Target& o) -> absl::StatusOr<std::string> {
            std::string a, b;
            if (absl::Status st = IntegerOperands(l, o, &a, &b); !st.ok())
              return st;
            const HloType& t = *o.type;
            const HloType& i1 = *DTypeOf(tpu::DType::kBool);
            const std::vector<int64_t>& d = o.dims;
            const bool is_unsigned = t.dtype == tpu::DType::kUInt8;
            const auto mag = [&](const std::string& v) {
              return is_unsigned ? v : l.Unary("abs", v, d, t);
            };
            const int id = l.NextId();
            const std::string x = absl::StrCat("%w", id, "x"),
                              y = absl::StrCat("%w", id, "y");
            const std::string tv = TypeOf(d, t);
            std::string going, x_next, y_next;
            const std::string cond = l.Region([&] {
              const std::string live =
                  l.Compare("NE", x, l.Constant(0, d, t), d, t);
              going = l.ReduceOver(live, d, Range(d.size()), "or",
                                   l.Constant(0, {}, i1), i1);
            });
            const std::string body = l.Region([&] {
              // (x, y) -> (y mod x, x) where x != 0.
              const std::string live =
                  l.Compare("NE", x, l.Constant(0, d, t), d, t);
              const std::string safe =
                  l.Select(live, x, l.Constant(1, d, t), d, t);
              x_next =
                  l.Select(live, l.Binary("remainder", y, safe, d, t), x, d, t);
              y_next = l.Select(live, x, y, d, t);
            });
            const std::string loop = l.EmitResults(
                absl::StrCat("stablehlo.while(", x, " = ", mag(a), ", ", y,
                             " = ", mag(b), ") : ", tv, ", ", tv,
                             "\n    cond {\n", cond, "      stablehlo.return ",
                             going, " : ", TypeOf({}, i1), "\n    } do {\n",
                             body, "      stablehlo.return ", x_next, ", ",
                             y_next, " : ", tv, ", ", tv, "\n    }"),
                2);
            return loop + "#1";
          });
  for (const auto& [name, op] :
       std::vector<std::pair<std::string, const char*>>{
           {"logical_and", "and"},
           {"logical_or", "or"},
           {"logical_xor", "xor"}}) {
    const char* hlo = op;
    reg.Add(
        "aten::" + name,
        [hlo](Lowering& l, const tpu::DecodedOp&,
              const Target& o) -> absl::StatusOr<std::string> {
          const Args args(l);
          if (!args.Has("self") || !args.Has("other"))
            return Unsupported(l.op(), "too few arguments");
          const HloType& f = F64();
          const HloType& pred = *DTypeOf(tpu::DType::kBool);
          absl::StatusOr<std::string> a = l.Operand(args["self"], o.dims, f),
                                      b = l.Operand(args["other"], o.dims, f);
          if (!a.ok()) return a;
          if (!b.ok()) return b;
          const std::string zero = l.Constant(0, o.dims, f);
          const std::string r = l.Emit(absl::StrCat(
              "stablehlo.", hlo, " ", l.Compare("NE", *a, zero, o.dims, f),
              ", ", l.Compare("NE", *b, zero, o.dims, f), " : ",
              TypeOf(o.dims, pred)));
          return l.Convert(r, o.dims, pred, *o.type);
        });
  }
  reg.Add(
      "aten::logaddexp",
      [](Lowering& l, const tpu::DecodedOp&,
         const Target& o) -> absl::StatusOr<std::string> {
        const Args args(l);
        if (!args.Has("self") || !args.Has("other"))
          return Unsupported(l.op(), "too few arguments");
        const HloType& t = *o.type;
        absl::StatusOr<std::string> a = l.Operand(args["self"], o.dims, t),
                                    b = l.Operand(args["other"], o.dims, t);
        if (!a.ok()) return a;
        if (!b.ok()) return b;
        if (IsComplex(t)) {
          // As ATen: the operand of the larger real part is the base,
          // hi + log1p(exp(lo - hi)).
          const HloType& part = PartOf(t);
          const std::string first =
              l.Compare("GE", l.Convert(*a, o.dims, t, part),
                        l.Convert(*b, o.dims, t, part), o.dims, part);
          const std::string hi = l.Select(first, *a, *b, o.dims, t),
                            lo = l.Select(first, *b, *a, o.dims, t);
          return l.Binary(
              "add", hi,
              l.Unary(
                  "log_plus_one",
                  l.Unary("exponential",
                          l.Binary("subtract", lo, hi, o.dims, t), o.dims, t),
                  o.dims, t),
              o.dims, t);
        }
        const std::string mx = l.Binary("maximum", *a, *b, o.dims, t);
        const std::string diff = l.Unary(
            "negate",
            l.Unary("abs", l.Binary("subtract", *a, *b, o.dims, t), o.dims, t),
            o.dims, t);
        const std::string r = l.Binary(
            "add", mx,
            l.Unary("log_plus_one", l.Unary("exponential", diff, o.dims, t),
                    o.dims, t),
            o.dims, t);
        // Two equal infinities give themselves (their difference is NaN).
        const std::string inf = l.Binary("divide", l.Constant(1, o.dims, t),
                                         l.Constant(0, o.dims, t), o.dims, t);
        const std::string same_inf = l.Binary(
            "and", l.Compare("EQ", *a, *b, o.dims, t),
            l.Compare("EQ", l.Unary("abs", *a, o.dims, t), inf, o.dims, t),
            o.dims, *DTypeOf(tpu::DType::kBool));
        return l.Select(same_inf, *a, r, o.dims, t);
      });
  // clamp(self, min?, max?): bounds are scalars or tensors, either may be
  // absent. lo and hi name the bounds an op takes (null: none).
  auto clamp = [](const char* lo, const char* hi) {
    return [lo, hi](Lowering& l, const tpu::DecodedOp&,
                    const Target& o) -> absl::StatusOr<std::string> {
      const Args a(l);
      if (!a.Has("self")) return Unsupported(l.op(), "too few arguments");
      const HloType& t = *o.type;
      absl::StatusOr<std::string> x = l.Operand(a["self"], o.dims, t);
      if (!x.ok()) return x;
      std::string r = *x;
      for (const char* name : {lo, hi}) {
        if (name == nullptr || !a.Has(name)) continue;
        const tpu::ArgTag tag = a[name].tag;
        if (tag == tpu::ArgTag::kNone || tag == tpu::ArgTag::kUndefinedTensor)
          continue;
        absl::StatusOr<std::string> b = l.Operand(a[name], o.dims, t);
        if (!b.ok()) return b;
        r = l.Binary(name == lo ? "maximum" : "minimum", r, *b, o.dims, t);
      }
      return r;
    };
  };
  reg.Add("aten::clamp", clamp("min", "max"));
  reg.Add("aten::clamp.Tensor", clamp("min", "max"));
  reg.Add("aten::clamp_min", clamp("min", nullptr));
  reg.Add("aten::clamp_min.Tensor", clamp("min", nullptr));
  reg.Add("aten::clamp_max", clamp(nullptr, "max"));
  reg.Add("aten::clamp_max.Tensor", clamp(nullptr, "max"));
  reg.Add("aten::hardtanh", clamp("min_val", "max_val"));
  reg.Add(
      "aten::where.self",
      [](Lowering& l, const tpu::DecodedOp&,
         const Target& o) -> absl::StatusOr<std::string> {
        const Args args(l);
        if (!args.Has("condition") || !args.Has("self") || !args.Has("other"))
          return Unsupported(l.op(), "arguments of a form not lowered");
        const HloType& pred = *DTypeOf(tpu::DType::kBool);
        absl::StatusOr<std::string> cnd =
            l.Operand(args["condition"], o.dims, pred);
        absl::StatusOr<std::string> a = l.Operand(args["self"], o.dims,
                                                  *o.type),
                                    b = l.Operand(args["other"], o.dims,
                                                  *o.type);
        for (auto* v : {&cnd, &a, &b})
          if (!v->ok()) return *v;
        return l.Select(*cnd, *a, *b, o.dims, *o.type);
      });
  for (const char* name :
       {"aten::masked_fill.Scalar", "aten::masked_fill.Tensor"}) {
    reg.Add(name,
            [](Lowering& l, const tpu::DecodedOp&,
               const Target& o) -> absl::StatusOr<std::string> {
              const Args a(l);
              if (!a.Has("self") || !a.Has("mask") || !a.Has("value"))
                return Unsupported(l.op(), "arguments of a form not lowered");
              absl::StatusOr<std::string> x =
                  l.Operand(a["self"], o.dims, *o.type);
              absl::StatusOr<std::string> mask =
                  l.Operand(a["mask"], o.dims, *DTypeOf(tpu::DType::kBool));
              absl::StatusOr<std::string> v =
                  l.Operand(a["value"], o.dims, *o.type);
              for (auto* p : {&x, &mask, &v})
                if (!p->ok()) return *p;
              return l.Select(*mask, *v, *x, o.dims, *o.type);
            });
  }
  for (const char* name : {"aten::rsub.Tensor", "aten::rsub.Scalar"}) {
    reg.Add(name,
            [](Lowering& l, const tpu::DecodedOp&,
               const Target& o) -> absl::StatusOr<std::string> {
              // other - alpha * self
              const Args args(l);
              if (!args.Has("self") || !args.Has("other"))
                return Unsupported(l.op(), "too few arguments");
              absl::StatusOr<std::string> a = l.Operand(args["self"], o.dims,
                                                        *o.type),
                                          b = l.Operand(args["other"], o.dims,
                                                        *o.type);
              if (!a.ok()) return a;
              if (!b.ok()) return b;
              std::string s = *a;
              if (args.Number("alpha", 1.0) != 1.0) {
                absl::StatusOr<std::string> al =
                    l.Operand(args["alpha"], o.dims, *o.type);
                if (!al.ok()) return al;
                s = l.Binary("multiply", s, *al, o.dims, *o.type);
              }
              return l.Binary("subtract", *b, s, o.dims, *o.type);
            });
  }
  reg.Add("aten::fill_.Tensor",
          [](Lowering& l, const tpu::DecodedOp&,
             const Target& o) -> absl::StatusOr<std::string> {
            const Args a(l);
            if (!a.Has("value"))
              return Unsupported(l.op(), "arguments of a form not lowered");
            return l.Operand(a["value"], o.dims, *o.type);
          });
  reg.Add("aten::bitwise_not",
          UnaryRule([](Lowering& l, const std::string& x, const Target& o) {
            return l.Unary("not", x, o.dims, *o.type);
          }));
  // Inverse hyperbolic functions from logarithms.
  reg.Add("aten::acosh",
          UnaryRule([](Lowering& l, const std::string& x, const Target& o) {
            const HloType& t = *o.type;
            const std::string s = l.Unary(
                "sqrt",
                l.Binary("subtract", l.Binary("multiply", x, x, o.dims, t),
                         l.Constant(1, o.dims, t), o.dims, t),
                o.dims, t);
            return l.Unary("log", l.Binary("add", x, s, o.dims, t), o.dims, t);
          }));
  reg.Add(
      "aten::asinh",
      UnaryRule([](Lowering& l, const std::string& x, const Target& o) {
        const HloType& t = *o.type;
        if (IsComplex(t)) {
          // asinh is odd: w = x or -x, of real part >= 0, and
          // asinh(w) = log1p(w + w^2 / (sqrt(w^2 + 1) + 1)), exact near 0.
          const HloType& part = PartOf(t);
          const std::string right =
              l.Compare("GE", l.Convert(x, o.dims, t, part),
                        l.Constant(0, o.dims, part), o.dims, part);
          const std::string w =
              l.Select(right, x, l.Unary("negate", x, o.dims, t), o.dims, t);
          const std::string one = l.Constant(1, o.dims, t);
          const std::string w2 = l.Binary("multiply", w, w, o.dims, t);
          const std::string s =
              l.Unary("sqrt", l.Binary("add", w2, one, o.dims, t), o.dims, t);
          const std::string r = l.Unary(
              "log_plus_one",
              l.Binary("add", w,
                       l.Binary("divide", w2,
                                l.Binary("add", s, one, o.dims, t), o.dims, t),
                       o.dims, t),
              o.dims, t);
          return l.Select(right, r, l.Unary("negate", r, o.dims, t), o.dims, t);
        }
        const std::string a = l.Unary("abs", x, o.dims, t);
        const std::string s =
            l.Unary("sqrt",
                    l.Binary("add", l.Binary("multiply", a, a, o.dims, t),
                             l.Constant(1, o.dims, t), o.dims, t),
                    o.dims, t);
        return l.Binary(
            "multiply", l.Unary("sign", x, o.dims, t),
            l.Unary("log", l.Binary("add", a, s, o.dims, t), o.dims, t), o.dims,
            t);
      }));
  reg.Add("aten::atanh",
          UnaryRule([](Lowering& l, const std::string& x, const Target& o) {
            const HloType& t = *o.type;
            const std::string q = l.Binary(
                "divide",
                l.Binary("add", l.Constant(1, o.dims, t), x, o.dims, t),
                l.Binary("subtract", l.Constant(1, o.dims, t), x, o.dims, t),
                o.dims, t);
            return l.Binary("multiply", l.Constant(0.5, o.dims, t),
                            l.Unary("log", q, o.dims, t), o.dims, t);
          }));
  // signbit(self): the sign bit, -0.0 and -nan included.
  reg.Add(
      "aten::signbit",
      [](Lowering& l, const tpu::DecodedOp&,
         const Target& o) -> absl::StatusOr<std::string> {
        const Args a(l);
        if (!a.Defined("self")) return Unsupported(l.op(), "expects a tensor");
        const tpu::TensorRef& x = a["self"].tensor;
        const HloType* xt = DTypeOf(x.dtype);
        if (xt == nullptr) return Unsupported(l.op(), "dtype");
        absl::StatusOr<std::string> v =
            l.OperandRef(x, l.TensorIndex(a["self"]), o.dims, *xt);
        if (!v.ok()) return v;
        const HloType& b = *DTypeOf(tpu::DType::kBool);
        std::string neg;
        if (xt->dtype == tpu::DType::kBool || xt->dtype == tpu::DType::kUInt8) {
          neg = l.Constant(0, o.dims, b);
        } else if (xt->is_float) {
          const HloType& bits = *DTypeOf(xt->bytes == 2   ? tpu::DType::kInt16
                                         : xt->bytes == 4 ? tpu::DType::kInt32
                                                          : tpu::DType::kInt64);
          const std::string i = l.Emit(
              absl::StrCat("stablehlo.bitcast_convert ", *v, " : (",
                           TypeOf(o.dims, *xt), ") -> ", TypeOf(o.dims, bits)));
          neg = l.Compare("LT", i, l.Constant(0, o.dims, bits), o.dims, bits);
        } else {
          neg = l.Compare("LT", *v, l.Constant(0, o.dims, *xt), o.dims, *xt);
        }
        return l.Convert(neg, o.dims, b, *o.type);
      });
  reg.Add("aten::pow.Scalar", BinaryRule("power", false, "exponent"));
  // div with rounding_mode "trunc" or "floor" (None: true division).
  {
    Rule r = [](Lowering& l, const tpu::DecodedOp&,
                const Target& o) -> absl::StatusOr<std::string> {
      const Args args(l);
      if (!args.Has("self") || !args.Has("other"))
        return Unsupported(l.op(), "too few arguments");
      const HloType& t = *o.type;
      absl::StatusOr<std::string> a = l.Operand(args["self"], o.dims, t),
                                  b = l.Operand(args["other"], o.dims, t);
      if (!a.ok()) return a;
      if (!b.ok()) return b;
      const tpu::OpArg* rounding = args.Find("rounding_mode");
      const std::string mode =
          rounding != nullptr && rounding->tag == tpu::ArgTag::kString
              ? rounding->s
              : "";
      const std::string q = l.Binary("divide", *a, *b, o.dims, t);
      if (mode.empty()) return q;
      if (mode != "trunc" && mode != "floor")
        return Unsupported(l.op(), "rounding_mode=\"" + mode + "\"");
      const std::string zero = l.Constant(0, o.dims, t);
      if (t.is_float) {
        if (mode == "floor") return l.Unary("floor", q, o.dims, t);
        return l.Select(l.Compare("LT", q, zero, o.dims, t),
                        l.Unary("ceil", q, o.dims, t),
                        l.Unary("floor", q, o.dims, t), o.dims, t);
      }
      if (mode == "trunc") return q;  // integer division truncates
      // Floor: one less where the remainder is nonzero and the signs differ.
      const std::string rem = l.Binary("remainder", *a, *b, o.dims, t);
      const std::string inexact = l.Compare("NE", rem, zero, o.dims, t);
      const std::string differ =
          l.Compare("NE", l.Compare("LT", *a, zero, o.dims, t),
                    l.Compare("LT", *b, zero, o.dims, t), o.dims,
                    *DTypeOf(tpu::DType::kBool));
      const std::string both =
          l.Binary("and", inexact, differ, o.dims, *DTypeOf(tpu::DType::kBool));
      return l.Select(
          both, l.Binary("subtract", q, l.Constant(1, o.dims, t), o.dims, t), q,
          o.dims, t);
    };
    for (const char* name :
         {"aten::div.Tensor_mode", "aten::div.Scalar_mode",
          "aten::div_.Tensor_mode", "aten::div_.Scalar_mode",
          "aten::div.out_mode", "aten::div.Scalar_mode_out"}) {
      reg.Add(name, r);
    }
  }
  // fmod: C's remainder, with the dividend's sign (stablehlo.remainder).
  reg.Add("aten::fmod.Tensor", BinaryRule("remainder", false));
  reg.Add("aten::fmod.Scalar", BinaryRule("remainder", false));
  // out= overloads whose names are not the derived ones (the out tensor
  // is the written argument, after the others).
  reg.Alias("aten::add.out", "aten::add.Tensor");
  reg.Alias("aten::sub.out", "aten::sub.Tensor");
  reg.Alias("aten::mul.out", "aten::mul.Tensor");
  reg.Alias("aten::div.out", "aten::div.Tensor");
}

}  // namespace tpud::pjrt
