// Backward ops over the spatial dimensions that PyTorch cannot decompose.
// Resampling (upsampling: nearest, linear, cubic, antialiased; adaptive
// average pooling) is separable: along one spatial dimension of n inputs
// and m outputs it is a weight matrix W (n x m), built in the program from
// iotas with ATen's index and weight arithmetic, and the op contracts its
// input with W (forward) or the gradient with W's transpose (backward), one
// dimension after another. The max poolings' and replication padding's
// backward add each gradient where its element came from (scatter-add).
#include <algorithm>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "daemon/backends/pjrt/lowering/families.h"
#include "daemon/backends/pjrt/lowering/helpers.h"
#include "daemon/backends/pjrt/lowering/lowering.h"
#include "daemon/backends/pjrt/lowering/matrix.h"
#include "daemon/backends/pjrt/lowering/registry.h"

namespace tpud::pjrt {
namespace {

enum class Kind {
  kNearest,
  kNearestExact,
  kLinear,
  kCubic,
  kLinearAa,
  kCubicAa,
  kAdaptiveAvg,
};

// A scale argument (scales_h, ...): absent, None or a float.
std::optional<double> ScaleArg(const Args& a, const char* name) {
  const tpu::OpArg* s = a.Find(name);
  if (s == nullptr || s->tag != tpu::ArgTag::kDouble) return std::nullopt;
  return s->d;
}

// ATen's compute_scales_value and area_pixel_compute_scale, in the type of
// the op's arithmetic (float, or double for double tensors).
double ScaleValue(std::optional<double> scale, int64_t in, int64_t out,
                  bool f64) {
  if (scale.has_value() && *scale > 0) {
    return f64 ? 1.0 / *scale : static_cast<float>(1.0 / *scale);
  }
  return f64 ? static_cast<double>(in) / static_cast<double>(out)
             : static_cast<float>(in) / static_cast<float>(out);
}

double AreaScale(std::optional<double> scale, int64_t in, int64_t out,
                 bool align, bool f64) {
  if (!align) return ScaleValue(scale, in, out, f64);
  if (out <= 1) return 0;
  return f64 ? static_cast<double>(in - 1) / static_cast<double>(out - 1)
             : static_cast<float>(in - 1) / static_cast<float>(out - 1);
}

class WeightBuilder {
 public:
  // Weights of type ct (f32 or f64: ATen's arithmetic type) of a dimension
  // of `in` inputs and `out` outputs.
  WeightBuilder(Lowering& l, int64_t in, int64_t out, const HloType& ct)
      : l_(l), in_(in), out_(out), ct_(ct), grid_{in, out} {}

  // The outputs' indices along the dimension, of type t (length out).
  std::string Outputs(const HloType& t) { return l_.Iota(0, {out_}, t); }
  std::string C(double v, const std::vector<int64_t>& dims) {
    return l_.Constant(v, dims, ct_);
  }
  std::string Bin(const char* op, const std::string& a, const std::string& b) {
    return l_.Binary(op, a, b, {out_}, ct_);
  }
  std::string Floor(const std::string& v) {
    return l_.Unary("floor", v, {out_}, ct_);
  }
  std::string ToInt(const std::string& v) {
    return l_.Convert(v, {out_}, ct_, I64());
  }
  std::string IntBin(const char* op, const std::string& a,
                     const std::string& b) {
    return l_.Binary(op, a, b, {out_}, I64());
  }
  std::string IntC(int64_t v) { return l_.Constant(v, {out_}, I64()); }
  // Input index within [0, in).
  std::string Clamp(const std::string& idx) {
    return IntBin("minimum", IntBin("maximum", idx, IntC(0)), IntC(in_ - 1));
  }
  // The (in x out) matrix: weight w[o] at row idx[o], zero elsewhere.
  std::string At(const std::string& idx, const std::string& w) {
    const std::string rows = l_.Iota(0, grid_, I64());
    const std::string hit = l_.Compare(
        "EQ", rows, BroadcastInDim(l_, idx, {out_}, grid_, {1}, I64()), grid_,
        I64());
    return l_.Select(hit, BroadcastInDim(l_, w, {out_}, grid_, {1}, ct_),
                     l_.Constant(0, grid_, ct_), grid_, ct_);
  }
  std::string Ones() { return C(1, {out_}); }
  std::string Sum(const std::vector<std::string>& parts) {
    std::string s = parts[0];
    for (size_t k = 1; k < parts.size(); ++k)
      s = l_.Binary("add", s, parts[k], grid_, ct_);
    return s;
  }
  Lowering& l() { return l_; }
  const std::vector<int64_t>& grid() const { return grid_; }
  int64_t in() const { return in_; }
  int64_t out() const { return out_; }
  const HloType& ct() const { return ct_; }

 private:
  Lowering& l_;
  int64_t in_, out_;
  const HloType& ct_;
  std::vector<int64_t> grid_;
};

// upsample_nearest*d and _upsample_nearest_exact*d: nearest_idx and
// nearest_neighbor_exact_compute_source_index of ATen's UpSample.h.
std::string NearestWeights(WeightBuilder& b, bool exact,
                           std::optional<double> scale) {
  Lowering& l = b.l();
  std::string idx;
  if (!exact && b.out() == b.in()) {
    idx = b.Outputs(I64());
  } else if (!exact && b.out() == 2 * b.in()) {
    idx = b.IntBin("divide", b.Outputs(I64()), b.IntC(2));
  } else {
    const float s =
        static_cast<float>(ScaleValue(scale, b.in(), b.out(), false));
    std::string src;
    if (exact) {
      // (o + 0.5) * scale in double, then floorf of it as a float.
      const std::string o = b.Outputs(F64());
      src = l.Binary("multiply",
                     l.Binary("add", o, l.Constant(0.5, {b.out()}, F64()),
                              {b.out()}, F64()),
                     l.Constant(s, {b.out()}, F64()), {b.out()}, F64());
      src = l.Convert(src, {b.out()}, F64(), F32());
    } else {
      src = l.Binary("multiply", b.Outputs(F32()),
                     l.Constant(s, {b.out()}, F32()), {b.out()}, F32());
    }
    src = l.Unary("floor", src, {b.out()}, F32());
    idx = b.IntBin("minimum", l.Convert(src, {b.out()}, F32(), I64()),
                   b.IntC(b.in() - 1));
  }
  return b.At(idx, b.Ones());
}

// area_pixel_compute_source_index: the input position an output reads.
std::string SourceIndex(WeightBuilder& b, double scale, bool align,
                        bool cubic) {
  const std::string o = b.Outputs(b.ct());
  const std::string sc = b.C(scale, {b.out()});
  if (align) return b.Bin("multiply", sc, o);
  std::string src = b.Bin(
      "subtract", b.Bin("multiply", sc, b.Bin("add", o, b.C(0.5, {b.out()}))),
      b.C(0.5, {b.out()}));
  if (!cubic) src = b.Bin("maximum", src, b.C(0, {b.out()}));
  return src;
}

// upsample_linear1d / bilinear2d / trilinear3d: guard_index_and_lambda.
std::string LinearWeights(WeightBuilder& b, bool align,
                          std::optional<double> scale, bool f64) {
  if (b.in() == b.out()) return b.At(b.Outputs(I64()), b.Ones());
  const double sc = AreaScale(scale, b.in(), b.out(), align, f64);
  const std::string src = SourceIndex(b, sc, align, false);
  const std::string i0 =
      b.IntBin("minimum", b.ToInt(b.Floor(src)), b.IntC(b.in() - 1));
  Lowering& l = b.l();
  const std::string lam = b.Bin(
      "minimum",
      b.Bin("maximum",
            b.Bin("subtract", src, l.Convert(i0, {b.out()}, I64(), b.ct())),
            b.C(0, {b.out()})),
      b.C(1, {b.out()}));
  const std::string i1 = b.IntBin(
      "add", i0,
      l.Select(l.Compare("LT", i0, b.IntC(b.in() - 1), {b.out()}, I64()),
               b.IntC(1), b.IntC(0), {b.out()}, I64()));
  return b.Sum({b.At(i0, b.Bin("subtract", b.Ones(), lam)), b.At(i1, lam)});
}

// upsample_bicubic2d: get_cubic_upsample_coefficients (A = -0.75), the four
// taps' indices clamped to the input (upsample_value_bounded).
std::string CubicWeights(WeightBuilder& b, bool align,
                         std::optional<double> scale, bool f64) {
  const double sc = AreaScale(scale, b.in(), b.out(), align, f64);
  const std::string src = SourceIndex(b, sc, align, true);
  const std::string x0 = b.Floor(src);
  const std::string t = b.Bin("subtract", src, x0);
  const std::string ix = b.ToInt(x0);
  const double A = -0.75;
  auto c = [&](double v) { return b.C(v, {b.out()}); };
  // ((A + 2) x - (A + 3)) x x + 1, for |x| <= 1
  auto conv1 = [&](const std::string& x) {
    return b.Bin(
        "add",
        b.Bin("multiply",
              b.Bin("multiply",
                    b.Bin("subtract", b.Bin("multiply", c(A + 2), x), c(A + 3)),
                    x),
              x),
        c(1));
  };
  // ((A x - 5 A) x + 8 A) x - 4 A, for 1 < |x| < 2
  auto conv2 = [&](const std::string& x) {
    return b.Bin(
        "subtract",
        b.Bin(
            "multiply",
            b.Bin("add",
                  b.Bin("multiply",
                        b.Bin("subtract", b.Bin("multiply", c(A), x), c(5 * A)),
                        x),
                  c(8 * A)),
            x),
        c(4 * A));
  };
  const std::string t2 = b.Bin("subtract", c(1), t);
  const std::string w[4] = {conv2(b.Bin("add", t, c(1))), conv1(t), conv1(t2),
                            conv2(b.Bin("add", t2, c(1)))};
  std::vector<std::string> parts;
  for (int k = 0; k < 4; ++k)
    parts.push_back(b.At(b.Clamp(b.IntBin("add", ix, b.IntC(k - 1))), w[k]));
  return b.Sum(parts);
}

// _upsample_bilinear2d_aa / _upsample_bicubic2d_aa: ATen's antialiasing
// weights (a triangle, or the cubic with a = -0.5, stretched by the
// downscale), normalized per output, computed in double.
std::string AaWeights(WeightBuilder& b, bool cubic, bool align,
                      std::optional<double> scale, bool f64) {
  Lowering& l = b.l();
  const std::vector<int64_t>& g = b.grid();
  const double sc = AreaScale(scale, b.in(), b.out(), align, f64);
  const double interp = cubic ? 4 : 2;
  const double support = sc >= 1 ? interp * 0.5 * sc : interp * 0.5;
  const double inv = sc >= 1 ? 1 / sc : 1;
  const HloType& d = F64();
  const std::string center =
      l.Binary("multiply", l.Constant(sc, {b.out()}, d),
               l.Binary("add", b.Outputs(d), l.Constant(0.5, {b.out()}, d),
                        {b.out()}, d),
               {b.out()}, d);
  auto edge = [&](double shift) {  // int64(center + shift), truncated
    return l.Convert(
        l.Binary("add", center, l.Constant(shift, {b.out()}, d), {b.out()}, d),
        {b.out()}, d, I64());
  };
  const std::string lo = b.IntBin("maximum", edge(0.5 - support), b.IntC(0));
  const std::string hi =
      b.IntBin("minimum", edge(support + 0.5), b.IntC(b.in()));
  const std::string rows = l.Iota(0, g, I64());
  const std::string inside = l.Binary(
      "and",
      l.Compare("GE", rows, BroadcastInDim(l, lo, {b.out()}, g, {1}, I64()), g,
                I64()),
      l.Compare("LT", rows, BroadcastInDim(l, hi, {b.out()}, g, {1}, I64()), g,
                I64()),
      g, *DTypeOf(tpu::DType::kBool));
  // x = (i - center + 0.5) * inv, |x|
  const std::string x = l.Unary(
      "abs",
      l.Binary(
          "multiply",
          l.Binary(
              "add",
              l.Binary("subtract", l.Convert(rows, g, I64(), d),
                       BroadcastInDim(l, center, {b.out()}, g, {1}, d), g, d),
              l.Constant(0.5, g, d), g, d),
          l.Constant(inv, g, d), g, d),
      g, d);
  auto k = [&](double v) { return l.Constant(v, g, d); };
  auto mul = [&](const std::string& p, const std::string& q) {
    return l.Binary("multiply", p, q, g, d);
  };
  auto add = [&](const std::string& p, const std::string& q) {
    return l.Binary("add", p, q, g, d);
  };
  std::string w;
  if (!cubic) {
    w = l.Binary("maximum", l.Binary("subtract", k(1), x, g, d), k(0), g, d);
  } else {
    const double a = -0.5;
    // |x| < 1: ((a + 2) x - (a + 3)) x^2 + 1; |x| < 2: (((x - 5) x + 8) x - 4)
    // a
    const std::string near = add(
        mul(l.Binary("subtract", mul(k(a + 2), x), k(a + 3), g, d), mul(x, x)),
        k(1));
    const std::string far = mul(
        l.Binary("subtract",
                 mul(add(mul(l.Binary("subtract", x, k(5), g, d), x), k(8)), x),
                 k(4), g, d),
        k(a));
    w = l.Select(l.Compare("LT", x, k(1), g, d), near,
                 l.Select(l.Compare("LT", x, k(2), g, d), far, k(0), g, d), g,
                 d);
  }
  w = l.Select(inside, w, k(0), g, d);
  const std::string total =
      BroadcastInDim(l, l.ReduceOver(w, g, {0}, "add", l.Constant(0, {}, d), d),
                     {b.out()}, g, {1}, d);
  w = l.Select(l.Compare("NE", total, k(0), g, d),
               l.Binary("divide", w, total, g, d), w, g, d);
  return l.Convert(w, g, d, b.ct());
}

// adaptive average pooling: output o averages inputs
// [floor(o in / out), ceil((o + 1) in / out)).
std::string AdaptiveWeights(WeightBuilder& b) {
  Lowering& l = b.l();
  const std::string o = b.Outputs(I64());
  const std::string start = b.IntBin(
      "divide", b.IntBin("multiply", o, b.IntC(b.in())), b.IntC(b.out()));
  const std::string end = b.IntBin(
      "divide",
      b.IntBin(
          "add",
          b.IntBin("multiply", b.IntBin("add", o, b.IntC(1)), b.IntC(b.in())),
          b.IntC(b.out() - 1)),
      b.IntC(b.out()));
  const std::vector<int64_t>& g = b.grid();
  const std::string rows = l.Iota(0, g, I64());
  const std::string inside = l.Binary(
      "and",
      l.Compare("GE", rows, BroadcastInDim(l, start, {b.out()}, g, {1}, I64()),
                g, I64()),
      l.Compare("LT", rows, BroadcastInDim(l, end, {b.out()}, g, {1}, I64()), g,
                I64()),
      g, *DTypeOf(tpu::DType::kBool));
  const std::string size =
      l.Convert(b.IntBin("subtract", end, start), {b.out()}, I64(), b.ct());
  return l.Select(inside,
                  BroadcastInDim(l, b.Bin("divide", b.Ones(), size), {b.out()},
                                 g, {1}, b.ct()),
                  l.Constant(0, g, b.ct()), g, b.ct());
}

struct Resample {
  Kind kind;
  int spatial;
  bool backward;
};

// v (dims `cur`, type ct) contracted along dimension q with W (in x out):
// with W's inputs (forward: q has `in` entries and gets `out`) or its
// outputs (backward: q has `out` entries and gets `in`).
std::string ContractAlong(Lowering& l, const std::string& v,
                          std::vector<int64_t>& cur, size_t q,
                          const std::string& w, int64_t in, int64_t out,
                          bool backward, const HloType& ct) {
  std::vector<int64_t> res;
  for (size_t r = 0; r < cur.size(); ++r)
    if (r != q) res.push_back(cur[r]);
  res.push_back(backward ? in : out);
  const std::string dot = l.Emit(absl::StrCat(
      "stablehlo.dot_general ", v, ", ", w, ", contracting_dims = [", q,
      "] x [", backward ? 1 : 0, "] : (", TypeOf(cur, ct), ", ",
      TypeOf({in, out}, ct), ") -> ", TypeOf(res, ct)));
  std::vector<int64_t> perm, next(cur);
  next[q] = res.back();
  for (size_t r = 0; r < cur.size(); ++r) {
    if (r < q)
      perm.push_back(static_cast<int64_t>(r));
    else if (r == q)
      perm.push_back(static_cast<int64_t>(cur.size() - 1));
    else
      perm.push_back(static_cast<int64_t>(r - 1));
  }
  cur = next;
  return l.Emit(absl::StrCat("stablehlo.transpose ", dot, ", dims = [",
                             absl::StrJoin(perm, ", "), "] : (",
                             TypeOf(res, ct), ") -> ", TypeOf(next, ct)));
}

const char* const kScaleNames[3][3] = {{"scales", nullptr, nullptr},
                                       {"scales_h", "scales_w", nullptr},
                                       {"scales_d", "scales_h", "scales_w"}};

absl::StatusOr<std::string> LowerResample(Lowering& l, const Resample& r,
                                          const Target& o) {
  const Args a(l);
  const char* x_name = r.backward ? "grad_output" : "self";
  if (!a.Defined(x_name) || !o.type->is_float || IsComplex(*o.type))
    return Unsupported(l.op(), "arguments of a form not lowered");
  const std::vector<int64_t> xd = DimsOf(a[x_name].tensor);
  if (xd.size() != o.dims.size() || xd.size() < static_cast<size_t>(r.spatial))
    return Unsupported(l.op(), "an output of another rank");
  const size_t lead = xd.size() - r.spatial;
  for (size_t q = 0; q < lead; ++q) {
    if (xd[q] != o.dims[q])
      return Unsupported(l.op(), "batch and channel sizes that differ");
  }
  const bool align = a.Flag("align_corners", false);
  const bool f64 = o.type->dtype == tpu::DType::kDouble;
  const HloType& ct = f64 ? F64() : F32();
  absl::StatusOr<std::string> x = l.Operand(a[x_name], xd, *o.type);
  if (!x.ok()) return x;
  std::vector<int64_t> cur = xd;
  std::string v = l.Convert(*x, xd, *o.type, ct);
  for (int k = 0; k < r.spatial; ++k) {
    const size_t q = lead + k;
    const int64_t in = r.backward ? o.dims[q] : xd[q];
    const int64_t out = r.backward ? xd[q] : o.dims[q];
    if (in == 0 || out == 0) return l.Constant(0, o.dims, *o.type);
    const std::optional<double> scale =
        r.kind == Kind::kAdaptiveAvg
            ? std::nullopt
            : ScaleArg(a, kScaleNames[r.spatial - 1][k]);
    WeightBuilder b(l, in, out, ct);
    std::string w;
    switch (r.kind) {
      case Kind::kNearest:
      case Kind::kNearestExact:
        w = NearestWeights(b, r.kind == Kind::kNearestExact, scale);
        break;
      case Kind::kLinear:
        w = LinearWeights(b, align, scale, f64);
        break;
      case Kind::kCubic:
        w = CubicWeights(b, align, scale, f64);
        break;
      case Kind::kLinearAa:
      case Kind::kCubicAa:
        w = AaWeights(b, r.kind == Kind::kCubicAa, align, scale, f64);
        break;
      case Kind::kAdaptiveAvg:
        w = AdaptiveWeights(b);
        break;
    }
    v = ContractAlong(l, v, cur, q, w, in, out, r.backward, ct);
  }
  return l.Convert(v, o.dims, ct, *o.type);
}

// The gradient g (dims gd) added into an output of o's dims at the
// positions `local` (i64, dims gd) name within each (batch, channel) plane
// (the leading dims, gd's first `lead`); a position outside its plane is
// dropped.
absl::StatusOr<std::string> AddIntoPlanes(Lowering& l, const std::string& g,
                                          const std::vector<int64_t>& gd,
                                          const std::string& local, size_t lead,
                                          const Target& o) {
  int64_t planes = 1, in = 1, out = 1;
  for (size_t q = 0; q < gd.size(); ++q) {
    if (q < lead) {
      if (gd[q] != o.dims[q])
        return Unsupported(l.op(), "batch and channel sizes that differ");
      planes *= gd[q];
    } else {
      in *= o.dims[q];
      out *= gd[q];
    }
  }
  const HloType& t = *o.type;
  if (planes * in == 0) return l.Constant(0, o.dims, t);
  const std::vector<int64_t> pd = {planes, out};
  const std::string pos = l.Reshape(local, gd, pd, I64());
  const std::string ok =
      l.Binary("and", l.Compare("GE", pos, l.Constant(0, pd, I64()), pd, I64()),
               l.Compare("LT", pos, l.Constant(in, pd, I64()), pd, I64()), pd,
               *DTypeOf(tpu::DType::kBool));
  const std::string at =
      l.Select(ok,
               l.Binary("add",
                        l.Binary("multiply", l.Iota(0, pd, I64()),
                                 l.Constant(in, pd, I64()), pd, I64()),
                        pos, pd, I64()),
               l.Constant(planes * in, pd, I64()), pd, I64());
  const int64_t m = planes * out, n = planes * in;
  // (bfloat16 and half sums: XLA's CPU plugin adds in float32 and rounds
  // once, where ATen rounds every step; the result is the closer one.)
  const std::string sum =
      ScatterFlat(l, l.Constant(0, {n}, t), n, l.Reshape(at, pd, {m}, I64()),
                  l.Reshape(g, gd, {m}, t), m, true, t);
  return l.Reshape(sum, {n}, o.dims, t);
}

absl::StatusOr<std::string> MaxPoolBackward(Lowering& l, int spatial,
                                            const Target& o) {
  const Args a(l);
  if (!a.Defined("grad_output") || !a.Defined("indices"))
    return Unsupported(l.op(), "arguments of a form not lowered");
  const std::vector<int64_t> gd = DimsOf(a["grad_output"].tensor);
  if (gd != DimsOf(a["indices"].tensor) || gd.size() != o.dims.size() ||
      gd.size() < static_cast<size_t>(spatial))
    return Unsupported(l.op(), "indices of another shape than the gradient");
  absl::StatusOr<std::string> g = l.Operand(a["grad_output"], gd, *o.type),
                              idx = l.Operand(a["indices"], gd, I64());
  if (!g.ok()) return g;
  if (!idx.ok()) return idx;
  return AddIntoPlanes(l, *g, gd, *idx, gd.size() - spatial, o);
}

// replication_pad*d_backward(grad_output, self, padding): output position
// o of a dimension copies input clamp(o - before, 0, n - 1) (a negative pad
// crops); the gradients are added there.
absl::StatusOr<std::string> ReplicationPadBackward(Lowering& l, int spatial,
                                                   const Target& o) {
  const Args a(l);
  if (!a.Defined("grad_output") || !a.Has("padding") ||
      a["padding"].ints.size() != static_cast<size_t>(2 * spatial))
    return Unsupported(l.op(), "arguments of a form not lowered");
  const std::vector<int64_t> gd = DimsOf(a["grad_output"].tensor);
  if (gd.size() != o.dims.size() || gd.size() < static_cast<size_t>(spatial))
    return Unsupported(l.op(), "an output of another rank");
  const size_t lead = gd.size() - spatial;
  const std::vector<int64_t>& pad = a["padding"].ints;
  std::string local = l.Constant(0, gd, I64());
  int64_t stride = 1;
  for (int k = spatial - 1; k >= 0; --k) {
    const size_t q = lead + k;
    const int64_t n = o.dims[q], before = pad[2 * (spatial - 1 - k)];
    if (n == 0) return l.Constant(0, o.dims, *o.type);
    const std::string src =
        l.Binary("minimum",
                 l.Binary("maximum",
                          l.Binary("subtract", l.Iota(q, gd, I64()),
                                   l.Constant(before, gd, I64()), gd, I64()),
                          l.Constant(0, gd, I64()), gd, I64()),
                 l.Constant(n - 1, gd, I64()), gd, I64());
    local = l.Binary(
        "add", local,
        l.Binary("multiply", src, l.Constant(stride, gd, I64()), gd, I64()), gd,
        I64());
    stride *= n;
  }
  absl::StatusOr<std::string> g = l.Operand(a["grad_output"], gd, *o.type);
  if (!g.ok()) return g;
  return AddIntoPlanes(l, *g, gd, local, lead, o);
}

void AddResample(OpRegistry& reg, const std::string& name, Resample r,
                 const char* out_overload = nullptr) {
  reg.Add(name,
          [r](Lowering& l, const tpu::DecodedOp& d,
              const Target& o) -> absl::StatusOr<std::string> {
            return LowerResample(l, r, o);
          });
  if (out_overload == nullptr)
    out_overload = r.backward ? ".grad_input" : ".out";
  reg.Alias(absl::StrCat(name, out_overload), name);
}

}  // namespace

void RegisterResample(OpRegistry& reg) {
  // The backward ops, which PyTorch cannot decompose (their forwards run as
  // PyTorch's decompositions), and the antialiased forwards, which have none.
  for (int sp : {1, 2, 3}) {
    AddResample(reg, absl::StrCat("aten::upsample_nearest", sp, "d_backward"),
                {Kind::kNearest, sp, true});
    AddResample(reg,
                absl::StrCat("aten::_upsample_nearest_exact", sp, "d_backward"),
                {Kind::kNearestExact, sp, true});
  }
  AddResample(reg, "aten::upsample_linear1d_backward",
              {Kind::kLinear, 1, true});
  AddResample(reg, "aten::upsample_bilinear2d_backward",
              {Kind::kLinear, 2, true});
  AddResample(reg, "aten::upsample_trilinear3d_backward",
              {Kind::kLinear, 3, true});
  AddResample(reg, "aten::upsample_bicubic2d_backward",
              {Kind::kCubic, 2, true});
  for (bool backward : {false, true}) {
    AddResample(reg,
                absl::StrCat("aten::_upsample_bilinear2d_aa",
                             backward ? "_backward" : ""),
                {Kind::kLinearAa, 2, backward});
    AddResample(reg,
                absl::StrCat("aten::_upsample_bicubic2d_aa",
                             backward ? "_backward" : ""),
                {Kind::kCubicAa, 2, backward});
  }
  // _adaptive_avg_pool*d_backward(grad_output, self): the input's sizes are
  // the output's.
  for (int sp : {2, 3}) {
    AddResample(reg, absl::StrCat("aten::_adaptive_avg_pool", sp, "d_backward"),
                {Kind::kAdaptiveAvg, sp, true}, ".out");
  }
  for (int sp : {1, 2, 3}) {
    const std::string name =
        absl::StrCat("aten::replication_pad", sp, "d_backward");
    reg.Add(name,
            [sp](Lowering& l, const tpu::DecodedOp& d,
                 const Target& o) -> absl::StatusOr<std::string> {
              return ReplicationPadBackward(l, sp, o);
            });
    reg.Alias(absl::StrCat(name, ".grad_input"), name);
  }
  // The max poolings' backward (max_pool3d, adaptive and fractional ones):
  // each gradient added at the input position its index names, within its
  // (batch, channel) plane.
  for (const char* name : {"aten::max_pool3d_with_indices_backward",
                           "aten::adaptive_max_pool2d_backward",
                           "aten::adaptive_max_pool3d_backward",
                           "aten::fractional_max_pool2d_backward",
                           "aten::fractional_max_pool3d_backward"}) {
    const int sp = absl::StrContains(name, "2d") ? 2 : 3;
    reg.Add(name,
            [sp](Lowering& l, const tpu::DecodedOp& d,
                 const Target& o) -> absl::StatusOr<std::string> {
              return MaxPoolBackward(l, sp, o);
            });
    reg.Alias(absl::StrCat(name, ".grad_input"), name);
  }
}

}  // namespace tpud::pjrt
