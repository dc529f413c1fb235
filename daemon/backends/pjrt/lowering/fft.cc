// The FFTs ATen's torch.fft functions come down to: _fft_r2c (real to
// complex, the last transformed dimension halved when onesided), _fft_c2c
// (forward or inverse) and _fft_c2r (the inverse of a onesided r2c, of
// last_dim_size). stablehlo.fft transforms the trailing dimensions, so the
// transformed ones are moved there, in the order given, and back. XLA's
// inverse transforms divide by n; ATen's normalization (0: none, 1: by
// sqrt(n), 2: by n) is applied on top of the unnormalized transform.
// Also complex helpers: conj_physical and angle.
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

void RegisterFft(OpRegistry& reg) {
  enum class Fft { kR2C, kC2C, kC2R };
  for (Fft kind : {Fft::kR2C, Fft::kC2C, Fft::kC2R}) {
    // The last argument: onesided (r2c), forward (c2c), last_dim_size (c2r).
    const char* last = kind == Fft::kR2C   ? "onesided"
                       : kind == Fft::kC2C ? "forward"
                                           : "last_dim_size";
    Rule r = [kind, last](Lowering& l, const tpu::DecodedOp&,
                          const Target& o) -> absl::StatusOr<std::string> {
      const Args a(l);
      if (!a.Defined("self") || !a.Has("dim") || !a.Has("normalization") ||
          !a.Has(last) || a["dim"].tag != tpu::ArgTag::kIntList) {
        return Unsupported(l.op(), "arguments of a form not lowered");
      }
      const tpu::TensorRef& x = a["self"].tensor;
      const HloType* xt = DTypeOf(x.dtype);
      if (xt == nullptr ||
          (kind == Fft::kR2C ? !xt->is_float : !IsComplex(*xt))) {
        return Unsupported(l.op(), "an input of this dtype");
      }
      const std::vector<int64_t> in = DimsOf(x);
      const size_t n = in.size();
      std::vector<int64_t> fdims;
      for (int64_t dim : a["dim"].ints) {
        absl::StatusOr<int64_t> c = CheckedDim(l.op(), dim, n);
        if (!c.ok()) return c.status();
        if (std::find(fdims.begin(), fdims.end(), *c) != fdims.end())
          return Unsupported(l.op(), "a repeated dim");
        fdims.push_back(*c);
      }
      if (fdims.empty()) {
        absl::StatusOr<std::string> same = l.Operand(a["self"], in, *xt);
        if (!same.ok()) return same;
        return l.Convert(*same, in, *xt, *o.type);
      }
      const int64_t norm = a["normalization"].i;
      const HloType& part =
          kind == Fft::kC2R
              ? *o.type
              : (kind == Fft::kR2C ? (xt->dtype == tpu::DType::kDouble
                                          ? F64()
                                          : *DTypeOf(tpu::DType::kFloat))
                                   : PartOf(*xt));
      const HloType& ct = ComplexOf(part);
      if (o.dims.size() != n)
        return Unsupported(l.op(), "an output of another rank");
      // perm: the other dimensions, then the transformed ones.
      std::vector<int64_t> perm;
      for (size_t q = 0; q < n; ++q) {
        if (std::find(fdims.begin(), fdims.end(), static_cast<int64_t>(q)) ==
            fdims.end())
          perm.push_back(q);
      }
      for (int64_t q : fdims) perm.push_back(q);
      auto permuted = [&](const std::vector<int64_t>& dims) {
        std::vector<int64_t> r;
        for (int64_t q : perm) r.push_back(dims[q]);
        return r;
      };
      std::vector<int64_t> inverse(n);
      for (size_t q = 0; q < n; ++q) inverse[perm[q]] = static_cast<int64_t>(q);
      // The signal: its lengths (the output's for c2r, the input's else).
      std::vector<int64_t> length;
      int64_t count = 1;
      for (int64_t q : fdims) {
        length.push_back(kind == Fft::kC2R ? o.dims[q] : in[q]);
        count *= length.back();
      }
      const HloType& vt = kind == Fft::kR2C ? part : ct;
      absl::StatusOr<std::string> xv = l.Operand(a["self"], in, *xt);
      if (!xv.ok()) return xv;
      std::string v = l.Convert(*xv, in, *xt, vt);
      const std::vector<int64_t> pin = permuted(in), pout = permuted(o.dims);
      v = l.Emit(absl::StrCat("stablehlo.transpose ", v, ", dims = [",
                              absl::StrJoin(perm, ", "), "] : (",
                              TypeOf(in, vt), ") -> ", TypeOf(pin, vt)));
      bool inverse_fft = false;
      const char* type = "FFT";
      const HloType* rt = &ct;
      std::vector<int64_t> pres = pout;
      if (kind == Fft::kR2C) {
        const bool onesided = a[last].tag != tpu::ArgTag::kBool || a[last].b;
        if (onesided) {
          type = "RFFT";
        } else {
          v = l.Convert(v, pin, part, ct);
        }
      } else if (kind == Fft::kC2C) {
        inverse_fft = a[last].tag == tpu::ArgTag::kBool && !a[last].b;
        type = inverse_fft ? "IFFT" : "FFT";
      } else {
        type = "IRFFT";
        inverse_fft = true;
        rt = &part;
        // The input's last transformed dimension holds length / 2 + 1 values.
        const int64_t want = length.back() / 2 + 1;
        std::vector<int64_t> cut = pin;
        if (cut.back() != want) {
          if (cut.back() < want)
            return Unsupported(l.op(),
                               "an input shorter than last_dim_size / 2 + 1");
          cut.back() = want;
          v = l.Slice(v, pin, std::vector<int64_t>(n, 0), cut, ct);
        }
        pres = cut;
        pres.back() = length.back();
        if (pres != pout)
          return Unsupported(l.op(), "an output of another shape");
        std::vector<int64_t> fin = cut;
        v = l.Emit(absl::StrCat("stablehlo.fft ", v,
                                ", type = IRFFT, length = [",
                                absl::StrJoin(length, ", "), "] : (",
                                TypeOf(fin, ct), ") -> ", TypeOf(pres, part)));
      }
      if (kind != Fft::kC2R) {
        const HloType& from =
            kind == Fft::kR2C && std::string(type) == "RFFT" ? part : ct;
        v = l.Emit(absl::StrCat("stablehlo.fft ", v, ", type = ", type,
                                ", length = [", absl::StrJoin(length, ", "),
                                "] : (", TypeOf(pin, from), ") -> ",
                                TypeOf(pres, ct)));
      }
      // Undo XLA's 1/n on inverses, then apply ATen's normalization.
      double scale = inverse_fft ? static_cast<double>(count) : 1.0;
      if (norm == 1) scale /= std::sqrt(static_cast<double>(count));
      if (norm == 2) scale /= static_cast<double>(count);
      if (scale != 1.0)
        v = l.Binary("multiply", v,
                     l.Convert(l.Constant(scale, pres, part), pres, part, *rt),
                     pres, *rt);
      v = l.Emit(absl::StrCat("stablehlo.transpose ", v, ", dims = [",
                              absl::StrJoin(inverse, ", "), "] : (",
                              TypeOf(pres, *rt), ") -> ", TypeOf(o.dims, *rt)));
      return l.Convert(v, o.dims, *rt, *o.type);
    };
    reg.Add(kind == Fft::kR2C   ? "aten::_fft_r2c"
            : kind == Fft::kC2C ? "aten::_fft_c2c"
                                : "aten::_fft_c2r",
            r);
  }
  // conj_physical: the imaginary part negated (real tensors as they are).
  reg.Add("aten::conj_physical",
          [](Lowering& l, const tpu::DecodedOp&,
             const Target& o) -> absl::StatusOr<std::string> {
            const Args args(l);
            if (!args.Has("self"))
              return Unsupported(l.op(), "expects a tensor");
            absl::StatusOr<std::string> x =
                l.Operand(args["self"], o.dims, *o.type);
            if (!x.ok()) return x;
            return Conj(l, *x, o.dims, *o.type);
          });
  reg.Alias("aten::_conj_physical", "aten::conj_physical");
  // angle: atan2(imag, real) of a complex tensor; of a real one, pi where
  // it is negative, 0 elsewhere, NaN where it is NaN.
  reg.Add("aten::angle",
          [](Lowering& l, const tpu::DecodedOp&,
             const Target& o) -> absl::StatusOr<std::string> {
            const Args args(l);
            if (!args.Defined("self"))
              return Unsupported(l.op(), "expects a tensor");
            const HloType* xt = DTypeOf(args["self"].tensor.dtype);
            if (xt == nullptr)
              return Unsupported(l.op(), "an input of this dtype");
            const HloType& t = *o.type;
            if (IsComplex(*xt)) {
              absl::StatusOr<std::string> x =
                  l.Operand(args["self"], o.dims, *xt);
              if (!x.ok()) return x;
              const HloType& part = PartOf(*xt);
              const std::string re = l.Emit(absl::StrCat(
                  "stablehlo.real ", *x, " : (", TypeOf(o.dims, *xt), ") -> ",
                  TypeOf(o.dims, part)));
              const std::string im = l.Emit(absl::StrCat(
                  "stablehlo.imag ", *x, " : (", TypeOf(o.dims, *xt), ") -> ",
                  TypeOf(o.dims, part)));
              return l.Convert(l.Binary("atan2", im, re, o.dims, part), o.dims,
                               part, t);
            }
            absl::StatusOr<std::string> x = l.Operand(args["self"], o.dims, t);
            if (!x.ok()) return x;
            const std::string neg =
                l.Compare("LT", *x, l.Constant(0, o.dims, t), o.dims, t);
            const std::string nan = l.Compare("NE", *x, *x, o.dims, t);
            const std::string a = l.Select(neg, l.Constant(M_PI, o.dims, t),
                                           l.Constant(0, o.dims, t), o.dims, t);
            return l.Select(nan, *x, a, o.dims, t);
          });
}

}  // namespace tpud::pjrt
