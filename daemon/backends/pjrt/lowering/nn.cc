// Neural-network ops: layer norm, losses (nll, mse), convolutions and
// their backward, pooling (average, adaptive) and distances (cdist, pdist).
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

// A window of dimension k (of n inputs, `out` outputs) as a mask over full
// (lead + outputs' spatial dims + inputs' spatial dims; a = lead's rank).
using WindowMask = std::function<absl::StatusOr<std::string>(
    const std::vector<int64_t>& full, int64_t a, int k, int64_t n,
    int64_t out)>;

// The max poolings whose windows are masks (adaptive, fractional): the
// largest of each window and its flat position in the plane (h * W + w),
// the first one (the last NaN, where there is one), as ATen's loops find
// them. Outputs (values, indices); self is the input.
absl::StatusOr<std::vector<std::string>> WindowedMax(
    Lowering& l, int sp, const std::vector<Target>& o,
    const WindowMask& window) {
  const Args args(l);
  if (o.size() != 2 || !args.Defined("self") ||
      o[0].dims.size() < static_cast<size_t>(sp + 1))
    return Unsupported(l.op(), "arguments of a form not lowered");
  const HloType& t = *o[0].type;
  const HloType& i64 = I64();
  const HloType& i1 = *DTypeOf(tpu::DType::kBool);
  const std::vector<int64_t> in = DimsOf(args["self"].tensor);
  const std::vector<int64_t>& od = o[0].dims;
  if (in.size() != od.size())
    return Unsupported(l.op(), "an output of another rank");
  const size_t lead = in.size() - sp;
  int64_t plane = 1;
  for (size_t q = lead; q < in.size(); ++q) plane *= in[q];
  if (plane == 0) return Unsupported(l.op(), "an empty input");
  absl::StatusOr<std::string> x = l.Operand(args["self"], in, t);
  if (!x.ok()) return x.status();
  const int64_t a = static_cast<int64_t>(lead);
  std::vector<int64_t> full(in.begin(), in.begin() + lead), xmap, omap, inner;
  for (int k = 0; k < sp; ++k) full.push_back(od[lead + k]);
  for (int k = 0; k < sp; ++k) full.push_back(in[lead + k]);
  for (int64_t r = 0; r < a; ++r) xmap.push_back(r);
  for (int64_t r = 0; r < a + sp; ++r) omap.push_back(r);
  for (int k = 0; k < sp; ++k) {
    xmap.push_back(a + sp + k);
    inner.push_back(a + sp + k);
  }
  std::string mask, pos;
  int64_t stride = 1;
  for (int k = sp - 1; k >= 0; --k) {
    absl::StatusOr<std::string> win =
        window(full, a, k, in[lead + k], od[lead + k]);
    if (!win.ok()) return win.status();
    mask = mask.empty() ? *win : l.Binary("and", mask, *win, full, i1);
    const std::string p =
        l.Binary("multiply", l.Iota(a + sp + k, full, i64),
                 l.Constant(static_cast<double>(stride), full, i64), full, i64);
    pos = pos.empty() ? p : l.Binary("add", pos, p, full, i64);
    stride *= in[lead + k];
  }
  const std::string xb = BroadcastInDim(l, *x, in, full, xmap, t);
  const std::string mx = l.ReduceOver(
      l.Select(mask, xb, l.BroadcastTo(l.Lowest(t), {}, full, t), full, t),
      full, inner, "maximum", l.Lowest(t), t);
  const std::string hit = l.Binary(
      "and", mask,
      l.Compare("EQ", xb, BroadcastInDim(l, mx, od, full, omap, t), full, t),
      full, i1);
  const std::string first = l.ReduceOver(
      l.Select(hit, pos, l.Constant(static_cast<double>(plane), full, i64),
               full, i64),
      full, inner, "minimum", l.Constant(static_cast<double>(plane), {}, i64),
      i64);
  const std::string nan =
      l.Binary("and", mask, l.Compare("NE", xb, xb, full, t), full, i1);
  const std::string last_nan =
      l.ReduceOver(l.Select(nan, pos, l.Constant(-1, full, i64), full, i64),
                   full, inner, "maximum", l.Constant(-1, {}, i64), i64);
  const std::string any_nan =
      l.Compare("GE", last_nan, l.Constant(0, od, i64), od, i64);
  const std::string idx = l.Select(any_nan, last_nan, first, od, i64);
  // (XLA's CPU reduction may skip a NaN; the window's value is NaN)
  const std::string value =
      t.is_float ? l.Select(any_nan,
                            l.Binary("divide", l.Constant(0, od, t),
                                     l.Constant(0, od, t), od, t),
                            mx, od, t)
                 : mx;
  return std::vector<std::string>{value, l.Convert(idx, od, i64, *o[1].type)};
}

}  // namespace

void RegisterNn(OpRegistry& reg) {
  // Arguments are read by their schema names (Args, helpers.h).
  reg.AddMulti(
      "aten::native_layer_norm",
      [](Lowering& l, const tpu::DecodedOp& d, const std::vector<Target>& outs)
          -> absl::StatusOr<std::vector<std::string>> {
        const Args a(l);
        if (outs.size() != 3 || !a.Defined("input") || !a.Has("eps"))
          return Unsupported(l.op(), "expects 3 outputs");
        const tpu::TensorRef& x = a["input"].tensor;
        const HloType& t = *outs[0].type;
        const std::vector<int64_t> in = DimsOf(x);
        const size_t k = a["normalized_shape"].ints.size();
        if (k == 0 || k > in.size())
          return Unsupported(l.op(), "normalized_shape");
        std::vector<int64_t> which;
        int64_t count = 1;
        for (size_t i = in.size() - k; i < in.size(); ++i) {
          which.push_back(static_cast<int64_t>(i));
          count *= in[i];
        }
        absl::StatusOr<std::string> xv =
            l.OperandRef(x, l.TensorIndex(a["input"]), in, t);
        if (!xv.ok()) return xv.status();
        const std::vector<int64_t> kept = Lowering::Kept(in, which);
        const std::string n = l.Constant(static_cast<double>(count), kept, t);
        const std::string mean = l.Binary(
            "divide",
            l.ReduceOver(*xv, in, which, "add", l.Constant(0, {}, t), t), n,
            kept, t);
        const std::string xc =
            l.Binary("subtract", *xv, l.Expand(mean, in, which, t), in, t);
        const std::string var =
            l.Binary("divide",
                     l.ReduceOver(l.Binary("multiply", xc, xc, in, t), in,
                                  which, "add", l.Constant(0, {}, t), t),
                     n, kept, t);
        const std::string rstd =
            l.Unary("rsqrt",
                    l.Binary("add", var,
                             l.Constant(NumberOf(a["eps"]), kept, t), kept, t),
                    kept, t);
        std::string y =
            l.Binary("multiply", xc, l.Expand(rstd, in, which, t), in, t);
        // Times weight, plus bias, where given.
        for (const auto& [name, how] :
             {std::pair<const char*, const char*>{"weight", "multiply"},
              {"bias", "add"}}) {
          if (!a.Defined(name)) continue;
          const tpu::OpArg& arg = a[name];
          absl::StatusOr<std::string> p =
              l.OperandRef(arg.tensor, l.TensorIndex(arg), in, t);
          if (!p.ok()) return p.status();
          y = l.Binary(how, y, *p, in, t);
        }
        return std::vector<std::string>{
            y, l.Reshape(mean, kept, outs[1].dims, *outs[1].type),
            l.Reshape(rstd, kept, outs[2].dims, *outs[2].type)};
      });
  reg.AddMulti(
      "aten::native_layer_norm_backward",
      [](Lowering& l, const tpu::DecodedOp& d, const std::vector<Target>& outs)
          -> absl::StatusOr<std::vector<std::string>> {
        // (grad_out, input, normalized_shape, mean, rstd, weight?, bias?,
        // output_mask)
        const Args a(l);
        if (!a.Has("output_mask") || !a.Defined("grad_out") ||
            !a.Defined("input") || !a.Defined("mean") || !a.Defined("rstd")) {
          return Unsupported(l.op(), "arguments of a form not lowered");
        }
        const std::vector<bool>& mask = a["output_mask"].bools;
        size_t wanted = 0;
        for (bool b : mask) wanted += b ? 1 : 0;
        // Either one output per true entry of the mask, or all three (those
        // not asked for are empty and get nothing).
        const bool all_three = outs.size() == 3;
        if (mask.size() != 3 || (outs.size() != wanted && !all_three))
          return Unsupported(l.op(), "output_mask");
        const HloType& t = *outs[0].type;
        const std::vector<int64_t> in = DimsOf(a["input"].tensor);
        const size_t k = a["normalized_shape"].ints.size();
        std::vector<int64_t> which, batch;
        for (size_t i = 0; i < in.size(); ++i)
          (i >= in.size() - k ? which : batch)
              .push_back(static_cast<int64_t>(i));
        int64_t count = 1;
        for (int64_t w : which) count *= in[w];
        auto op = [&](const char* name) {
          const tpu::OpArg& arg = a[name];
          return l.OperandRef(arg.tensor, l.TensorIndex(arg), in, t);
        };
        absl::StatusOr<std::string> g = op("grad_out"), x = op("input"),
                                    mean = op("mean"), rstd = op("rstd");
        for (auto* v : {&g, &x, &mean, &rstd})
          if (!v->ok()) return v->status();
        const std::string xhat = l.Binary(
            "multiply", l.Binary("subtract", *x, *mean, in, t), *rstd, in, t);
        std::string gw = *g;
        if (a.Defined("weight")) {
          absl::StatusOr<std::string> w = op("weight");
          if (!w.ok()) return w.status();
          gw = l.Binary("multiply", gw, *w, in, t);
        }
        const std::string zero = l.Constant(0, {}, t);
        const std::vector<int64_t> kept = Lowering::Kept(in, which);
        const std::string n = l.Constant(static_cast<double>(count), kept, t);
        const std::string m1 = l.Expand(
            l.Binary("divide", l.ReduceOver(gw, in, which, "add", zero, t), n,
                     kept, t),
            in, which, t);
        const std::string m2 = l.Expand(
            l.Binary("divide",
                     l.ReduceOver(l.Binary("multiply", gw, xhat, in, t), in,
                                  which, "add", zero, t),
                     n, kept, t),
            in, which, t);
        std::vector<std::string> r;
        auto skipped = [&](int j) {
          if (all_three && !mask[j])
            r.push_back(l.Constant(0, outs[j].dims, *outs[j].type));
          return !mask[j];
        };
        if (!skipped(0)) {
          r.push_back(
              l.Binary("multiply", *rstd,
                       l.Binary("subtract", l.Binary("subtract", gw, m1, in, t),
                                l.Binary("multiply", xhat, m2, in, t), in, t),
                       in, t));
        }
        for (int j : {1, 2}) {
          if (skipped(j)) continue;
          const Target& o = outs[r.size()];
          const std::string v =
              j == 1 ? l.Binary("multiply", *g, xhat, in, t) : *g;
          const std::string s =
              batch.empty() ? v : l.ReduceOver(v, in, batch, "add", zero, t);
          r.push_back(l.Reshape(s, Lowering::Kept(in, batch), o.dims, *o.type));
        }
        return r;
      });
  reg.AddMulti(
      "aten::nll_loss_forward",
      [](Lowering& l, const tpu::DecodedOp& d, const std::vector<Target>& outs)
          -> absl::StatusOr<std::vector<std::string>> {
        // (self, target, weight?, reduction, ignore_index) -> (output,
        // total_weight); a 1-d self (one unbatched sample) is taken as one row.
        const Args a(l);
        if (outs.size() != 2 || !a.Defined("self") ||
            a["self"].tensor.ndim < 1 || a["self"].tensor.ndim > 2 ||
            !a.Has("ignore_index")) {
          return Unsupported(l.op(), "expects a 1-d or 2-d input");
        }
        const HloType& t = *outs[0].type;
        const tpu::OpArg& self = a["self"];
        std::vector<int64_t> nc = DimsOf(self.tensor);
        if (nc.size() == 1) nc.insert(nc.begin(), 1);
        absl::StatusOr<std::string> x =
            l.OperandRef(self.tensor, l.TensorIndex(self), nc, t);
        if (!x.ok()) return x.status();
        absl::StatusOr<Picked> p = PickTargets(l, a["target"], a.Find("weight"),
                                               a.Find("ignore_index"), nc, t);
        if (!p.ok()) return p.status();
        const std::string zero = l.Constant(0, {}, t);
        const std::vector<int64_t> n = {nc[0]};
        const std::string rows =
            l.Unary("negate",
                    l.ReduceOver(l.Binary("multiply", *x, p->mask, nc, t), nc,
                                 {1}, "add", zero, t),
                    n, t);
        const std::string total =
            l.ReduceOver(p->row_weight, n, {0}, "add", zero, t);
        const int64_t reduction =
            static_cast<int64_t>(NumberOf(a["reduction"]));
        std::string out;
        if (reduction == 0) {
          out = rows;
        } else {
          out = l.ReduceOver(rows, n, {0}, "add", zero, t);
          if (reduction == 1) out = l.Binary("divide", out, total, {}, t);
        }
        return std::vector<std::string>{
            l.Reshape(out, reduction == 0 ? n : std::vector<int64_t>{},
                      outs[0].dims, t),
            l.Reshape(l.Convert(total, {}, t, *outs[1].type), {}, outs[1].dims,
                      *outs[1].type)};
      });
  reg.AddMulti(
      "aten::nll_loss_backward",
      [](Lowering& l, const tpu::DecodedOp& d, const std::vector<Target>& outs)
          -> absl::StatusOr<std::vector<std::string>> {
        // (grad_output, self, target, weight?, reduction, ignore_index,
        // total_weight)
        const Args a(l);
        if (outs.size() != 1 || !a.Defined("self") ||
            a["self"].tensor.ndim < 1 || a["self"].tensor.ndim > 2 ||
            !a.Has("total_weight")) {
          return Unsupported(l.op(), "expects a 1-d or 2-d input");
        }
        const HloType& t = *outs[0].type;
        std::vector<int64_t> nc = DimsOf(a["self"].tensor);
        if (nc.size() == 1) nc.insert(nc.begin(), 1);
        absl::StatusOr<Picked> p = PickTargets(l, a["target"], a.Find("weight"),
                                               a.Find("ignore_index"), nc, t);
        if (!p.ok()) return p.status();
        const int64_t reduction =
            static_cast<int64_t>(NumberOf(a["reduction"]));
        const tpu::TensorRef& go = a["grad_output"].tensor;
        const size_t go_index = l.TensorIndex(a["grad_output"]);
        std::string g;
        if (reduction == 0) {
          absl::StatusOr<std::string> gv =
              l.OperandRef(go, go_index, {nc[0]}, t);
          if (!gv.ok()) return gv.status();
          g = l.Emit(absl::StrCat("stablehlo.broadcast_in_dim ", *gv,
                                  ", dims = [0] : (", TypeOf({nc[0]}, t),
                                  ") -> ", TypeOf(nc, t)));
        } else {
          absl::StatusOr<std::string> gv = l.OperandRef(go, go_index, nc, t);
          if (!gv.ok()) return gv.status();
          g = *gv;
          if (reduction == 1) {
            const tpu::OpArg& total_weight = a["total_weight"];
            absl::StatusOr<std::string> tw = l.OperandRef(
                total_weight.tensor, l.TensorIndex(total_weight), nc, t);
            if (!tw.ok()) return tw.status();
            g = l.Binary("divide", g, *tw, nc, t);
          }
        }
        return std::vector<std::string>{l.Reshape(
            l.Unary("negate", l.Binary("multiply", g, p->mask, nc, t), nc, t),
            nc, outs[0].dims, t)};
      });
  // convolution_backward(grad_output, input, weight, bias_sizes, stride,
  // padding, dilation, transposed, output_padding, groups, output_mask):
  // the input's gradient is a convolution of the gradient, dilated by the
  // stride, with the spatially reversed weight; the weight's is one of the
  // input with the gradient, batch and features swapped; the bias's a sum.
  // Transposed convolutions and groups too (see `one` below).
  reg.AddMulti(
      "aten::convolution_backward",
      [](Lowering& l, const tpu::DecodedOp& d, const std::vector<Target>& o)
          -> absl::StatusOr<std::vector<std::string>> {
        const Args a(l);
        if (o.size() != 3 || !a.Has("output_mask") ||
            !a.Defined("grad_output") || !a.Defined("input") ||
            !a.Defined("weight")) {
          return Unsupported(l.op(), "arguments of a form not lowered");
        }
        // The gradient's type (an output the mask leaves out may have none
        // worth the name).
        const HloType* gt = DTypeOf(a["grad_output"].tensor.dtype);
        if (gt == nullptr || !gt->is_float)
          return Unsupported(l.op(), "a gradient of a type not lowered");
        // (computed in float32 for the half types, as every op's results
        // are: plan_lowering.cc)
        const HloType& t = gt->bytes < 4 ? F32() : *gt;
        const std::vector<int64_t> gd = DimsOf(a["grad_output"].tensor),
                                   in = DimsOf(a["input"].tensor),
                                   wd = DimsOf(a["weight"].tensor);
        absl::StatusOr<ConvWindow> cw =
            ConvWindowOf(l, a, in, wd, gd, /*allow_transposed=*/true);
        if (!cw.ok()) return cw.status();
        const size_t sp = cw->sp;
        const std::vector<int64_t>&stride = cw->stride, &pad = cw->pad,
              &dilation = cw->dilation;
        const int64_t groups = cw->groups;
        const bool transposed = cw->transposed;
        absl::StatusOr<std::string> g = l.Operand(a["grad_output"], gd, t),
                                    x = l.Operand(a["input"], in, t),
                                    w = l.Operand(a["weight"], wd, t);
        for (auto* v : {&g, &x, &w})
          if (!v->ok()) return v->status();
        if (gd[1] % groups != 0 || wd[0] % groups != 0)
          return Unsupported(l.op(), "groups that do not divide the channels");
        std::vector<std::string> spatial;
        std::vector<int64_t> rev, ones(sp, 1);
        for (size_t k = 0; k < sp; ++k) {
          spatial.push_back(absl::StrCat(k));
          rev.push_back(static_cast<int64_t>(k + 2));
        }
        const std::string sd = absl::StrJoin(spatial, ", ");
        // One group's gradients: of the input and of the weight, for a
        // convolution (input `xi`, weight `wi`, output gradient `gi`) with
        // groups = 1. A transposed convolution y = conv_transpose(x, w) is the
        // input gradient of a convolution with weight w: its input's gradient
        // is that convolution of the gradient, its weight's the convolution's
        // weight gradient with the roles of input and output gradient swapped.
        auto one = [&](const std::string& gv, const std::vector<int64_t>& gdim,
                       const std::string& xv, const std::vector<int64_t>& xdim,
                       const std::string& wv,
                       const std::vector<int64_t>& wdim) {
          // A convolution of `a` (dims ad: the input) giving `b` (dims bd):
          // the gradient of its input from the gradient `gb`, and of its
          // weight.
          auto weight_grad = [&](const std::string& av,
                                 const std::vector<int64_t>& ad,
                                 const std::string& bv,
                                 const std::vector<int64_t>& bd) {
            std::vector<std::string> pw;
            for (size_t k = 0; k < sp; ++k) {
              const int64_t h = ad[k + 2], hout = bd[k + 2], kk = wdim[k + 2];
              pw.push_back(absl::StrCat("[", pad[k], ", ",
                                        (kk - 1) * dilation[k] +
                                            (hout - 1) * stride[k] + 1 - h -
                                            pad[k],
                                        "]"));
            }
            return l.Emit(absl::StrCat(
                "stablehlo.convolution(", av, ", ", bv,
                ") dim_numbers = [f, b, ", sd, "]x[i, o, ", sd, "]->[f, b, ",
                sd, "], window = {stride = [", absl::StrJoin(dilation, ", "),
                "], pad = [", absl::StrJoin(pw, ", "), "], rhs_dilate = [",
                absl::StrJoin(stride, ", "),
                "]} {batch_group_count = 1 : i64, feature_group_count = 1 : "
                "i64} : (",
                TypeOf(ad, t), ", ", TypeOf(bd, t), ") -> ", TypeOf(wdim, t)));
          };
          if (transposed) {
            // (the output_padding rows at the end reach no input; they may
            // outnumber the stride where the dilation is larger)
            std::vector<std::string> pads;
            for (size_t k = 0; k < sp; ++k)
              pads.push_back(absl::StrCat("[", pad[k], ", ",
                                          pad[k] - cw->output_padding[k], "]"));
            const std::string gx = l.Emit(absl::StrCat(
                "stablehlo.convolution(", gv, ", ", wv,
                ") dim_numbers = [b, f, ", sd, "]x[o, i, ", sd, "]->[b, f, ",
                sd, "], window = {stride = [", absl::StrJoin(stride, ", "),
                "], pad = [", absl::StrJoin(pads, ", "), "], rhs_dilate = [",
                absl::StrJoin(dilation, ", "),
                "]} {batch_group_count = 1 : i64, feature_group_count = 1 : "
                "i64} : (",
                TypeOf(gdim, t), ", ", TypeOf(wdim, t), ") -> ",
                TypeOf(xdim, t)));
            return std::make_pair(gx, weight_grad(gv, gdim, xv, xdim));
          }
          std::vector<std::string> pin;
          for (size_t k = 0; k < sp; ++k) {
            const int64_t h = xdim[k + 2], hout = gdim[k + 2], kk = wdim[k + 2];
            const int64_t lo = dilation[k] * (kk - 1) - pad[k];
            pin.push_back(absl::StrCat(
                "[", lo, ", ", h - (hout - 1) * stride[k] - 1 + pad[k], "]"));
          }
          const std::string wrev = l.Emit(
              absl::StrCat("stablehlo.reverse ", wv, ", dims = [",
                           absl::StrJoin(rev, ", "), "] : ", TypeOf(wdim, t)));
          const std::string gx = l.Emit(absl::StrCat(
              "stablehlo.convolution(", gv, ", ", wrev,
              ") dim_numbers = [b, f, ", sd, "]x[i, o, ", sd, "]->[b, f, ", sd,
              "], window = {stride = [", absl::StrJoin(ones, ", "),
              "], pad = [", absl::StrJoin(pin, ", "), "], lhs_dilate = [",
              absl::StrJoin(stride, ", "), "], rhs_dilate = [",
              absl::StrJoin(dilation, ", "),
              "]} {batch_group_count = 1 : i64, feature_group_count = 1 : i64} "
              ": (",
              TypeOf(gdim, t), ", ", TypeOf(wdim, t), ") -> ",
              TypeOf(xdim, t)));
          return std::make_pair(gx, weight_grad(xv, xdim, gv, gdim));
        };
        std::string grad_in, grad_w;
        if (groups == 1) {
          std::tie(grad_in, grad_w) = one(*g, gd, *x, in, *w, wd);
        } else {
          // Group q: its slice of the channels of each (the weight's first
          // dimension holds the groups one after another).
          const int64_t gc = gd[1] / groups, xc = in[1] / groups,
                        wc = wd[0] / groups;
          std::vector<std::string> gis, gws;
          std::vector<int64_t> gdq = gd, inq = in, wdq = wd;
          gdq[1] = gc;
          inq[1] = xc;
          wdq[0] = wc;
          for (int64_t q = 0; q < groups; ++q) {
            const auto [a, b] =
                one(l.SliceAlong(*g, gd, 1, q * gc, (q + 1) * gc, t), gdq,
                    l.SliceAlong(*x, in, 1, q * xc, (q + 1) * xc, t), inq,
                    l.SliceAlong(*w, wd, 0, q * wc, (q + 1) * wc, t), wdq);
            gis.push_back(a);
            gws.push_back(b);
          }
          std::vector<std::string> tin(groups, TypeOf(inq, t)),
              tw(groups, TypeOf(wdq, t));
          grad_in = l.Emit(
              absl::StrCat("stablehlo.concatenate ", absl::StrJoin(gis, ", "),
                           ", dim = 1 : (", absl::StrJoin(tin, ", "), ") -> ",
                           TypeOf(in, t)));
          grad_w = l.Emit(absl::StrCat("stablehlo.concatenate ",
                                       absl::StrJoin(gws, ", "),
                                       ", dim = 0 : (", absl::StrJoin(tw, ", "),
                                       ") -> ", TypeOf(wd, t)));
        }
        std::vector<int64_t> all_but_1;
        for (size_t k = 0; k < gd.size(); ++k)
          if (k != 1) all_but_1.push_back(static_cast<int64_t>(k));
        const std::string gb =
            l.ReduceOver(*g, gd, all_but_1, "add", l.Constant(0, {}, t), t);
        // An output the mask leaves out has no shape to match: zeros of its
        // own.
        auto fit = [&](const std::string& v, const std::vector<int64_t>& dims,
                       size_t k) {
          return o[k].dims == dims ? v : l.Constant(0, o[k].dims, *o[k].type);
        };
        return std::vector<std::string>{fit(grad_in, in, 0), fit(grad_w, wd, 1),
                                        fit(gb, {gd[1]}, 2)};
      });
  // adaptive_max_pool2d / 3d(self, output_size) -> (out, indices): the
  // largest of each adaptive window (as _adaptive_avg_pool2d's).
  for (int sp : {2, 3}) {
    const std::string name = absl::StrCat("aten::adaptive_max_pool", sp, "d");
    reg.AddMulti(
        name,
        [sp](Lowering& l, const tpu::DecodedOp& d, const std::vector<Target>& o)
            -> absl::StatusOr<std::vector<std::string>> {
          return WindowedMax(
              l, sp, o,
              [&](const std::vector<int64_t>& full, int64_t a, int k, int64_t n,
                  int64_t out) -> absl::StatusOr<std::string> {
                return AdaptiveWindow(l, full, a + k, a + sp + k, n, out);
              });
        });
    reg.Alias(absl::StrCat(name, ".out"), name);
  }
  // fractional_max_pool2d / 3d(self, kernel_size, output_size,
  // random_samples) -> (out, indices): the windows of kernel_size start at
  // ATen's pseudo-random intervals, one sequence per plane and dimension
  // from its sample u: int((o + u) alpha) - int(u alpha), alpha = (n -
  // kernel) / (out - 1), the last window at the end. The samples are for W
  // then H (2d), T, H, W (3d).
  for (int sp : {2, 3}) {
    const std::string name = absl::StrCat("aten::fractional_max_pool", sp, "d");
    reg.AddMulti(
        name,
        [sp](Lowering& l, const tpu::DecodedOp& d, const std::vector<Target>& o)
            -> absl::StatusOr<std::vector<std::string>> {
          const Args args(l);
          if (!args.Defined("random_samples") || !args.Has("kernel_size") ||
              args["kernel_size"].ints.size() != static_cast<size_t>(sp) ||
              o.empty())
            return Unsupported(l.op(), "arguments of a form not lowered");
          const std::vector<int64_t>& kernel = args["kernel_size"].ints;
          const std::vector<int64_t> rd = DimsOf(args["random_samples"].tensor);
          const size_t lead = o[0].dims.size() - sp;
          int64_t planes = 1;
          for (size_t q = 0; q < lead; ++q) planes *= o[0].dims[q];
          int64_t samples = 1;
          for (int64_t v : rd) samples *= v;
          if (rd.empty() || rd.back() != sp || samples != planes * sp)
            return Unsupported(l.op(), "samples of another shape");
          const HloType& t = *o[0].type;
          const bool f64 = t.dtype == tpu::DType::kDouble;
          const HloType& ct = f64 ? F64() : F32();
          absl::StatusOr<std::string> u =
              l.Operand(args["random_samples"], rd, ct);
          if (!u.ok()) return u.status();
          const std::vector<int64_t> ps = {planes, sp};
          const std::string uv = l.Reshape(*u, rd, ps, ct);
          std::vector<int64_t> lead_dims(o[0].dims.begin(),
                                         o[0].dims.begin() + lead);
          return WindowedMax(
              l, sp, o,
              [&](const std::vector<int64_t>& full, int64_t a, int k, int64_t n,
                  int64_t out) -> absl::StatusOr<std::string> {
                const int64_t pool = kernel[k];
                if (pool < 1 || pool > n)
                  return absl::InvalidArgumentError(absl::StrCat(
                      l.op(), ": kernel_size ", pool, " does not fit in ", n));
                // this dimension's sample per plane: (planes, out)
                const int which = sp == 2 ? 1 - k : k;
                const std::vector<int64_t> po = {planes, out};
                const std::string s = BroadcastInDim(
                    l,
                    l.Reshape(l.SliceAlong(uv, ps, 1, which, which + 1, ct),
                              {planes, 1}, {planes}, ct),
                    {planes}, po, {0}, ct);
                const double alpha =
                    out > 1 ? (f64 ? static_cast<double>(n - pool) /
                                         static_cast<double>(out - 1)
                                   : static_cast<float>(n - pool) /
                                         static_cast<float>(out - 1))
                            : 0;
                const std::string al = l.Constant(alpha, po, ct);
                auto trunc = [&](const std::string& v) {
                  return l.Convert(v, po, ct, I64());
                };
                const std::string seq = l.Binary(
                    "subtract",
                    trunc(
                        l.Binary("multiply",
                                 l.Binary("add", l.Iota(1, po, ct), s, po, ct),
                                 al, po, ct)),
                    trunc(l.Binary("multiply", s, al, po, ct)), po, I64());
                const std::string start = l.Select(
                    l.Compare("EQ", l.Iota(1, po, I64()),
                              l.Constant(out - 1, po, I64()), po, I64()),
                    l.Constant(n - pool, po, I64()), seq, po, I64());
                // start per (lead..., o_k), broadcast over full
                std::vector<int64_t> sd = lead_dims, smap;
                sd.push_back(out);
                for (int64_t q = 0; q < a; ++q) smap.push_back(q);
                smap.push_back(a + k);
                const std::string sb = BroadcastInDim(
                    l, l.Reshape(start, po, sd, I64()), sd, full, smap, I64());
                const std::string i = l.Iota(a + sp + k, full, I64());
                return l.Binary(
                    "and", l.Compare("GE", i, sb, full, I64()),
                    l.Compare("LT", i,
                              l.Binary("add", sb, l.Constant(pool, full, I64()),
                                       full, I64()),
                              full, I64()),
                    full, *DTypeOf(tpu::DType::kBool));
              });
        });
    reg.Alias(absl::StrCat(name, ".output"), name);
  }
  reg.Add("aten::mse_loss",
          [](Lowering& l, const tpu::DecodedOp& d,
             const Target& o) -> absl::StatusOr<std::string> {
            // (self, target, reduction): none 0, mean 1, sum 2
            const Args args(l);
            if (!args.Defined("self") || !args.Has("reduction"))
              return Unsupported(l.op(), "arguments of a form not lowered");
            const HloType& t = *o.type;
            const std::vector<int64_t> in = DimsOf(args["self"].tensor);
            absl::StatusOr<std::string> a = l.Operand(args["self"], in, t),
                                        b = l.Operand(args["target"], in, t);
            if (!a.ok()) return a;
            if (!b.ok()) return b;
            const std::string diff = l.Binary("subtract", *a, *b, in, t);
            const std::string sq = l.Binary("multiply", diff, diff, in, t);
            const int64_t reduction =
                static_cast<int64_t>(NumberOf(args["reduction"]));
            if (reduction == 0 || in.empty())
              return l.Reshape(sq, in, o.dims, t);
            std::vector<int64_t> all;
            int64_t n = 1;
            for (size_t i = 0; i < in.size(); ++i) {
              all.push_back(static_cast<int64_t>(i));
              n *= in[i];
            }
            std::string r =
                l.ReduceOver(sq, in, all, "add", l.Constant(0, {}, t), t);
            if (reduction == 1)
              r = l.Binary("divide", r,
                           l.Constant(static_cast<double>(n), {}, t), {}, t);
            return l.Reshape(r, {}, o.dims, t);
          });
  reg.Add("aten::mse_loss_backward",
          [](Lowering& l, const tpu::DecodedOp& d,
             const Target& o) -> absl::StatusOr<std::string> {
            // (grad_output, self, target, reduction)
            const Args args(l);
            if (!args.Has("reduction"))
              return Unsupported(l.op(), "arguments of a form not lowered");
            const HloType& t = *o.type;
            absl::StatusOr<std::string> g = l.Operand(args["grad_output"],
                                                      o.dims, t),
                                        a = l.Operand(args["self"], o.dims, t),
                                        b = l.Operand(args["target"], o.dims,
                                                      t);
            for (auto* v : {&g, &a, &b})
              if (!v->ok()) return *v;
            int64_t n = 1;
            for (int64_t v : o.dims) n *= v;
            const double scale = NumberOf(args["reduction"]) == 1
                                     ? 2.0 / static_cast<double>(n)
                                     : 2.0;
            return l.Binary(
                "multiply",
                l.Binary("multiply", l.Binary("subtract", *a, *b, o.dims, t),
                         *g, o.dims, t),
                l.Constant(scale, o.dims, t), o.dims, t);
          });
  reg.Alias("aten::mse_loss_backward.grad_input", "aten::mse_loss_backward");
  // avg_pool2d / avg_pool3d(self, kernel_size, stride, padding, ceil_mode,
  // count_include_pad, divisor_override) and their backward (grad_output
  // first): window sums by reduce_window over the zero-padded input, each
  // divided by its count, which is itself a window sum of ones over the
  // input (or the padded input, with count_include_pad). The backward
  // spreads grad / count over each window: the gradient dilated by the
  // stride, summed over windows of the kernel's size.
  for (int sp : {2, 3}) {
    for (bool backward : {false, true}) {
      Rule r = [sp, backward](Lowering& l, const tpu::DecodedOp& d,
                              const Target& o) -> absl::StatusOr<std::string> {
        const Args a(l);
        if (!a.Has("count_include_pad") || !a.Defined("self") ||
            (backward && !a.Defined("grad_output"))) {
          return Unsupported(l.op(), "arguments of a form not lowered");
        }
        const HloType& t = *o.type;
        const std::vector<int64_t> in = DimsOf(a["self"].tensor);
        const std::vector<int64_t> out =
            backward ? DimsOf(a["grad_output"].tensor) : o.dims;
        if (in.size() < static_cast<size_t>(sp) || out.size() != in.size()) {
          return Unsupported(l.op(), "input of too few dimensions");
        }
        const size_t lead = in.size() - sp;
        auto list = [&](const char* name, const std::vector<int64_t>& dflt)
            -> absl::StatusOr<std::vector<int64_t>> {
          const tpu::OpArg& arg = a[name];
          std::vector<int64_t> v = arg.tag == tpu::ArgTag::kIntList
                                       ? arg.ints
                                       : std::vector<int64_t>{};
          if (v.empty()) v = dflt;
          if (v.size() == 1) v.assign(sp, v[0]);
          if (v.size() != static_cast<size_t>(sp))
            return Unsupported(l.op(), "a window list of the wrong length");
          return v;
        };
        absl::StatusOr<std::vector<int64_t>> kernel = list("kernel_size", {});
        if (!kernel.ok()) return kernel.status();
        absl::StatusOr<std::vector<int64_t>> stride = list("stride", *kernel),
                                             pad = list("padding", {0});
        if (!stride.ok()) return stride.status();
        if (!pad.ok()) return pad.status();
        const tpu::OpArg& cip = a["count_include_pad"];
        const bool include_pad = cip.tag != tpu::ArgTag::kBool || cip.b;
        const tpu::OpArg* divisor = a.Find("divisor_override");
        const bool has_divisor =
            divisor != nullptr && (divisor->tag == tpu::ArgTag::kInt ||
                                   divisor->tag == tpu::ArgTag::kSymInt);
        std::vector<int64_t> window(in.size(), 1), strides(in.size(), 1), sdims,
            sout;
        std::vector<std::pair<int64_t, int64_t>> pads(in.size(), {0, 0}),
            count_pads;
        for (int k = 0; k < sp; ++k) {
          const int64_t kk = (*kernel)[k], st = (*stride)[k], p = (*pad)[k],
                        h = in[lead + k], n = out[lead + k];
          if (kk < 1 || st < 1 || p < 0 || n < 1)
            return Unsupported(l.op(), "a window of this form");
          window[lead + k] = kk;
          strides[lead + k] = st;
          const int64_t extra =
              std::max<int64_t>(0, (n - 1) * st + kk - (h + 2 * p));
          pads[lead + k] = {p, p + extra};
          sdims.push_back(include_pad ? h + 2 * p : h);
          sout.push_back(n);
          count_pads.push_back(include_pad ? std::make_pair(int64_t{0}, extra)
                                           : std::make_pair(p, p + extra));
        }
        std::string count;
        if (has_divisor) {
          count = l.Constant(static_cast<double>(divisor->i), out, t);
        } else {
          const std::vector<int64_t> sw(window.begin() + lead, window.end()),
              ss(strides.begin() + lead, strides.end());
          const std::string c =
              ReduceWindow(l, l.Constant(1, sdims, t), sdims, sw, ss,
                           count_pads, "add", 0, sout, t);
          count = l.BroadcastTo(c, sout, out, t);
        }
        if (!backward) {
          absl::StatusOr<std::string> x = l.Operand(a["self"], in, t);
          if (!x.ok()) return x;
          const std::string sum =
              ReduceWindow(l, *x, in, window, strides, pads, "add", 0, out, t);
          return l.Binary("divide", sum, count, out, t);
        }
        absl::StatusOr<std::string> g = l.Operand(a["grad_output"], out, t);
        if (!g.ok()) return g;
        const std::string share = l.Binary("divide", *g, count, out, t);
        // Dilated by the stride, kernel - 1 zeros before, cut or padded to
        // the padded input's extent after; windows of the kernel, stride 1.
        std::vector<int64_t> lo(in.size(), 0), hi(in.size(), 0),
            interior(in.size(), 0), grown = out, padded = in;
        for (int k = 0; k < sp; ++k) {
          const size_t q = lead + k;
          const int64_t kk = window[q], st = strides[q],
                        hp = in[q] + 2 * (*pad)[k];
          lo[q] = kk - 1;
          hi[q] = hp - (out[q] - 1) * st - 1;
          interior[q] = st - 1;
          grown[q] = (kk - 1) + (out[q] - 1) * st + 1 + hi[q];
          padded[q] = hp;
        }
        const std::string zero = l.Constant(0, {}, t);
        const std::string spread = l.Emit(absl::StrCat(
            "stablehlo.pad ", share, ", ", zero, ", low = [",
            absl::StrJoin(lo, ", "), "], high = [", absl::StrJoin(hi, ", "),
            "], interior = [", absl::StrJoin(interior, ", "), "] : (",
            TypeOf(out, t), ", ", TypeOf({}, t), ") -> ", TypeOf(grown, t)));
        const std::string summed = ReduceWindow(
            l, spread, grown, window, std::vector<int64_t>(in.size(), 1),
            std::vector<std::pair<int64_t, int64_t>>(in.size(), {0, 0}), "add",
            0, padded, t);
        std::vector<int64_t> start(in.size(), 0), limit = padded;
        for (int k = 0; k < sp; ++k) {
          start[lead + k] = (*pad)[k];
          limit[lead + k] = (*pad)[k] + in[lead + k];
        }
        return l.Slice(summed, padded, start, limit, t);
      };
      reg.Add(
          absl::StrCat("aten::avg_pool", sp, "d", backward ? "_backward" : ""),
          r);
    }
  }
  // convolution(input, weight, bias?, stride, padding, dilation, transposed,
  // output_padding, groups): stablehlo.convolution over NC(D)(H)W. A
  // transposed one is the gradient of a convolution: the input dilated by
  // the stride, padded by dilation * (k - 1) - padding (plus output_padding
  // at the end), under the spatially reversed weight, whose (in, out / g)
  // channels become, per group, the kernel's (in / g, out).
  reg.Add(
      "aten::convolution",
      [](Lowering& l, const tpu::DecodedOp& d,
         const Target& o) -> absl::StatusOr<std::string> {
        const Args a(l);
        if (!a.Defined("input") || !a.Defined("weight"))
          return Unsupported(l.op(), "arguments of a form not lowered");
        const HloType& t = *o.type;
        const std::vector<int64_t> in = DimsOf(a["input"].tensor),
                                   wd = DimsOf(a["weight"].tensor);
        absl::StatusOr<ConvWindow> cw =
            ConvWindowOf(l, a, in, wd, o.dims, /*allow_transposed=*/true);
        if (!cw.ok()) return cw.status();
        const size_t sp = cw->sp;
        const std::vector<int64_t>&stride = cw->stride, &pad = cw->pad,
              &dilation = cw->dilation;
        const int64_t groups = cw->groups;
        absl::StatusOr<std::string> x = l.Operand(a["input"], in, t),
                                    w = l.Operand(a["weight"], wd, t);
        if (!x.ok()) return x;
        if (!w.ok()) return w;
        std::vector<std::string> spatial, pads;
        std::vector<int64_t> ones(sp, 1), rev;
        for (size_t k = 0; k < sp; ++k) {
          spatial.push_back(absl::StrCat(k));
          rev.push_back(static_cast<int64_t>(k + 2));
          if (cw->transposed) {
            const int64_t lo = dilation[k] * (wd[k + 2] - 1) - pad[k];
            pads.push_back(
                absl::StrCat("[", lo, ", ", lo + cw->output_padding[k], "]"));
          } else {
            pads.push_back(absl::StrCat("[", pad[k], ", ", pad[k], "]"));
          }
        }
        const std::string dims = absl::StrJoin(spatial, ", ");
        std::string kernel = *w, layout = "o, i";
        std::vector<int64_t> kd = wd;
        if (cw->transposed) {
          kernel = l.Emit(absl::StrCat("stablehlo.reverse ", *w, ", dims = [",
                                       absl::StrJoin(rev, ", "),
                                       "] : ", TypeOf(wd, t)));
          layout = "i, o";
          if (groups > 1) {
            // (g * ci, co, k...) -> (g, ci, co, k...) -> (ci, g, co, k...) ->
            // (ci, g * co, k...)
            const int64_t ci = wd[0] / groups, co = wd[1];
            std::vector<int64_t> split = {groups, ci, co}, perm = {1, 0, 2},
                                 moved = {ci, groups, co};
            for (size_t k = 0; k < sp; ++k) {
              split.push_back(wd[k + 2]);
              moved.push_back(wd[k + 2]);
              perm.push_back(static_cast<int64_t>(k + 3));
            }
            kd = {ci, groups * co};
            for (size_t k = 0; k < sp; ++k) kd.push_back(wd[k + 2]);
            kernel = l.Reshape(kernel, wd, split, t);
            kernel = l.Emit(
                absl::StrCat("stablehlo.transpose ", kernel, ", dims = [",
                             absl::StrJoin(perm, ", "), "] : (",
                             TypeOf(split, t), ") -> ", TypeOf(moved, t)));
            kernel = l.Reshape(kernel, moved, kd, t);
          }
        }
        std::string r = l.Emit(absl::StrCat(
            "stablehlo.convolution(", *x, ", ", kernel,
            ") dim_numbers = [b, f, ", dims, "]x[", layout, ", ", dims,
            "]->[b, f, ", dims, "], window = {stride = [",
            absl::StrJoin(cw->transposed ? ones : stride, ", "), "], pad = [",
            absl::StrJoin(pads, ", "), "], ",
            cw->transposed ? absl::StrCat("lhs_dilate = [",
                                          absl::StrJoin(stride, ", "), "], ")
                           : "",
            "rhs_dilate = [", absl::StrJoin(dilation, ", "),
            "]} {batch_group_count = 1 : i64, feature_group_count = ", groups,
            " : i64} : (", TypeOf(in, t), ", ", TypeOf(kd, t), ") -> ",
            TypeOf(o.dims, t)));
        if (a.Defined("bias")) {
          const tpu::TensorRef& b = a["bias"].tensor;
          absl::StatusOr<std::string> bv =
              l.OperandRef(b, l.TensorIndex(a["bias"]), DimsOf(b), t);
          if (!bv.ok()) return bv;
          const std::string bb = l.Emit(absl::StrCat(
              "stablehlo.broadcast_in_dim ", *bv, ", dims = [1] : (",
              TypeOf(DimsOf(b), t), ") -> ", TypeOf(o.dims, t)));
          r = l.Binary("add", r, bb, o.dims, t);
        }
        return r;
      });
  // _cdist_forward(x1, x2, p, compute_mode): p-norm distances between the
  // rows of x1 (.., P, M) and x2 (.., R, M); Euclidean distances of many
  // rows go by matrix products, as ATen's do (compute_mode 0 past 25 rows,
  // 1 always, 2 never).
  reg.Add(
      "aten::_cdist_forward",
      [](Lowering& l, const tpu::DecodedOp& d,
         const Target& o) -> absl::StatusOr<std::string> {
        const Args args(l);
        if (!args.Has("p") || !args.Defined("x1") || !args.Defined("x2") ||
            o.dims.size() < 2)
          return Unsupported(l.op(), "arguments of a form not lowered");
        const HloType& t = *o.type;
        const std::vector<int64_t> batch = BatchOf(o.dims);
        const std::vector<int64_t> d1 = DimsOf(args["x1"].tensor),
                                   d2 = DimsOf(args["x2"].tensor);
        const int64_t pr = o.dims[o.dims.size() - 2], rr = o.dims.back(),
                      mm = d1.back();
        absl::StatusOr<std::string> a = MatrixOperand(l, args["x1"], batch, t),
                                    b = MatrixOperand(l, args["x2"], batch, t);
        if (!a.ok()) return a;
        if (!b.ok()) return b;
        const double p = NumberOf(args["p"]);
        const tpu::OpArg* cm = args.Find("compute_mode");
        const int64_t mode = cm != nullptr && (cm->tag == tpu::ArgTag::kInt ||
                                               cm->tag == tpu::ArgTag::kSymInt)
                                 ? cm->i
                                 : 0;
        const size_t nb = batch.size();
        std::vector<int64_t> ad = batch, bd = batch;
        ad.insert(ad.end(), {pr, mm});
        bd.insert(bd.end(), {rr, mm});
        std::vector<int64_t> bmap;
        for (size_t q = 0; q < nb; ++q) bmap.push_back(static_cast<int64_t>(q));
        if (p == 2 && (mode == 1 || (mode == 0 && (pr > 25 || rr > 25)))) {
          // |a|^2 + |b|^2 - 2 a.b, at least 0, square-rooted.
          const std::string an = l.ReduceOver(
              l.Binary("multiply", *a, *a, ad, t), ad,
              {static_cast<int64_t>(nb + 1)}, "add", l.Constant(0, {}, t), t);
          const std::string bn = l.ReduceOver(
              l.Binary("multiply", *b, *b, bd, t), bd,
              {static_cast<int64_t>(nb + 1)}, "add", l.Constant(0, {}, t), t);
          std::vector<int64_t> am = bmap, bm = bmap;
          am.push_back(static_cast<int64_t>(nb));
          bm.push_back(static_cast<int64_t>(nb + 1));
          std::vector<int64_t> an_d = batch, bn_d = batch;
          an_d.push_back(pr);
          bn_d.push_back(rr);
          const std::string dot = l.Emit(absl::StrCat(
              "stablehlo.dot_general ", *a, ", ", *b, ", batching_dims = [",
              absl::StrJoin(bmap, ", "), "] x [", absl::StrJoin(bmap, ", "),
              "], contracting_dims = [", nb + 1, "] x [", nb + 1, "] : (",
              TypeOf(ad, t), ", ", TypeOf(bd, t), ") -> ", TypeOf(o.dims, t)));
          std::string sq =
              l.Binary("add", BroadcastInDim(l, an, an_d, o.dims, am, t),
                       BroadcastInDim(l, bn, bn_d, o.dims, bm, t), o.dims, t);
          sq = l.Binary(
              "subtract", sq,
              l.Binary("multiply", l.Constant(2, o.dims, t), dot, o.dims, t),
              o.dims, t);
          sq = l.Binary("maximum", sq, l.Constant(0, o.dims, t), o.dims, t);
          return l.Unary("sqrt", sq, o.dims, t);
        }
        // |a_i - b_j| over (.., P, R, M).
        std::vector<int64_t> full = o.dims;
        full.push_back(mm);
        std::vector<int64_t> amap = bmap, bmap2 = bmap;
        amap.insert(amap.end(),
                    {static_cast<int64_t>(nb), static_cast<int64_t>(nb + 2)});
        bmap2.insert(bmap2.end(), {static_cast<int64_t>(nb + 1),
                                   static_cast<int64_t>(nb + 2)});
        const std::string diff = l.Unary(
            "abs",
            l.Binary("subtract", BroadcastInDim(l, *a, ad, full, amap, t),
                     BroadcastInDim(l, *b, bd, full, bmap2, t), full, t),
            full, t);
        return PNorm(l, diff, full, static_cast<int64_t>(nb + 2), p, t);
      });
  // _adaptive_avg_pool2d / 3d(self, output_size): output o of a dimension
  // of n inputs averages inputs [floor(o n / out), ceil((o + 1) n / out)),
  // one spatial dimension at a time (sums), divided by the window's size.
  for (int sp : {2, 3}) {
    reg.Add(
        absl::StrCat("aten::_adaptive_avg_pool", sp, "d"),
        [sp](Lowering& l, const tpu::DecodedOp& d,
             const Target& o) -> absl::StatusOr<std::string> {
          const Args a(l);
          if (!a.Defined("self") || o.dims.size() < static_cast<size_t>(sp))
            return Unsupported(l.op(), "arguments of a form not lowered");
          const HloType& t = *o.type;
          std::vector<int64_t> cur = DimsOf(a["self"].tensor);
          if (cur.size() != o.dims.size())
            return Unsupported(l.op(), "an output of another rank");
          absl::StatusOr<std::string> x = l.Operand(a["self"], cur, t);
          if (!x.ok()) return x;
          std::string v = *x, count = l.Constant(1, o.dims, t);
          const size_t lead = cur.size() - sp;
          for (int k = 0; k < sp; ++k) {
            const size_t q = lead + k;
            const int64_t n = cur[q], out = o.dims[q];
            if (n == 0 || out == 0) return l.Constant(0, o.dims, t);
            // window mask (out, n), and its sizes
            const std::vector<int64_t> wd = {out, n};
            const std::string in_win = AdaptiveWindow(l, wd, 0, 1, n, out);
            const std::string w = l.Select(in_win, l.Constant(1, wd, t),
                                           l.Constant(0, wd, t), wd, t);
            // full: cur with (out, n) at (q, q + 1)
            std::vector<int64_t> full, xmap,
                wmap = {static_cast<int64_t>(q), static_cast<int64_t>(q + 1)};
            for (size_t r = 0; r < cur.size(); ++r) {
              if (r == q) full.push_back(out);
              full.push_back(cur[r]);
            }
            for (size_t r = 0; r < cur.size(); ++r)
              xmap.push_back(static_cast<int64_t>(r < q ? r : r + 1));
            const std::string prod =
                l.Binary("multiply", BroadcastInDim(l, v, cur, full, xmap, t),
                         BroadcastInDim(l, w, wd, full, wmap, t), full, t);
            std::vector<int64_t> next = cur;
            next[q] = out;
            v = l.ReduceOver(prod, full, {static_cast<int64_t>(q + 1)}, "add",
                             l.Constant(0, {}, t), t);
            const std::string sizes =
                l.ReduceOver(w, wd, {1}, "add", l.Constant(0, {}, t), t);
            count = l.Binary("multiply", count,
                             BroadcastInDim(l, sizes, {out}, o.dims,
                                            {static_cast<int64_t>(q)}, t),
                             o.dims, t);
            cur = next;
          }
          return l.Binary("divide", v, count, o.dims, t);
        });
  }
  // _pdist_forward(self, p): the distances of the pairs of rows i < j, in
  // order: the upper triangle of cdist(self, self), gathered.
  reg.Add("aten::_pdist_forward",
          [](Lowering& l, const tpu::DecodedOp& d,
             const Target& o) -> absl::StatusOr<std::string> {
            const Args a(l);
            if (!a.Has("p") || !a.Defined("self") ||
                a["self"].tensor.ndim != 2 || o.dims.size() != 1) {
              return Unsupported(l.op(), "expects a matrix");
            }
            const HloType& t = *o.type;
            const HloType& i64 = I64();
            const std::vector<int64_t> in = DimsOf(a["self"].tensor);
            const int64_t n = in[0], mm = in[1], pairs = o.dims[0];
            if (pairs != n * (n - 1) / 2)
              return absl::InvalidArgumentError(absl::StrCat(
                  l.op(), ": the output does not hold every pair"));
            if (pairs == 0) return l.Constant(0, o.dims, t);
            if (pairs > (int64_t{1} << 16))
              return Unsupported(l.op(), "more than 65536 pairs");
            absl::StatusOr<std::string> x = l.Operand(a["self"], in, t);
            if (!x.ok()) return x;
            const double p = NumberOf(a["p"]);
            const std::vector<int64_t> full = {n, n, mm};
            const std::string diff = l.Unary(
                "abs",
                l.Binary("subtract", BroadcastInDim(l, *x, in, full, {0, 2}, t),
                         BroadcastInDim(l, *x, in, full, {1, 2}, t), full, t),
                full, t);
            const std::vector<int64_t> nn = {n, n};
            const std::string dist = PNorm(l, diff, full, 2, p, t);
            std::vector<std::string> at;
            for (int64_t i = 0; i < n; ++i) {
              for (int64_t j = i + 1; j < n; ++j)
                at.push_back(absl::StrCat(i * n + j));
            }
            const std::string index = l.Emit(absl::StrCat(
                "stablehlo.constant dense<[", absl::StrJoin(at, ", "),
                "]> : ", TypeOf({pairs}, i64)));
            return l.Emit(absl::StrCat(
                "\"stablehlo.gather\"(", l.Reshape(dist, nn, {n * n}, t), ", ",
                l.Reshape(index, {pairs}, {pairs, 1}, i64),
                ") {dimension_numbers = #stablehlo.gather<collapsed_slice_dims "
                "= [0], start_index_map = [0], index_vector_dim = 1>, "
                "indices_are_sorted = true, slice_sizes = array<i64: 1>} : (",
                TypeOf({n * n}, t), ", ", TypeOf({pairs, 1}, i64), ") -> ",
                TypeOf({pairs}, t)));
          });
  // out= overloads whose names are not the derived ones (the out tensor
  // is the written argument, after the others).
  reg.Alias("aten::native_layer_norm.out", "aten::native_layer_norm");
  reg.Alias("aten::native_layer_norm_backward.out",
            "aten::native_layer_norm_backward");
  reg.Alias("aten::nll_loss_forward.output", "aten::nll_loss_forward");
  reg.Alias("aten::nll_loss_backward.grad_input", "aten::nll_loss_backward");
}

}  // namespace tpud::pjrt
