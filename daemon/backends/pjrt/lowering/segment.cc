// segment_reduce and its backward: data reduced over consecutive segments
// along one axis, the segments given by their lengths or offsets (batched
// over the axes before it). Each element finds its segment by comparing its
// position with the segments' starts: a mask (segments x positions) that
// the reductions select through. And histogram with a bin count: each
// element finds its bin by comparing it with the edges.
#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "daemon/backends/pjrt/lowering/families.h"
#include "daemon/backends/pjrt/lowering/helpers.h"
#include "daemon/backends/pjrt/lowering/lowering.h"
#include "daemon/backends/pjrt/lowering/matrix.h"
#include "daemon/backends/pjrt/lowering/registry.h"

namespace tpud::pjrt {
namespace {

enum class Combine { kSum, kMean, kMax, kMin, kProd };

absl::StatusOr<Combine> ReduceOf(const Lowering& l, const Args& a) {
  const tpu::OpArg* r = a.Find("reduce");
  if (r == nullptr || r->tag != tpu::ArgTag::kString)
    return Unsupported(l.op(), "a reduction that is not named");
  if (r->s == "sum") return Combine::kSum;
  if (r->s == "mean") return Combine::kMean;
  if (r->s == "max") return Combine::kMax;
  if (r->s == "min") return Combine::kMin;
  if (r->s == "prod") return Combine::kProd;
  return absl::InvalidArgumentError(
      absl::StrCat(l.op(), ": unknown reduction ", r->s));
}

// The shapes of one segment_reduce: data dims d, the axis, the segments'
// count; `full` is the data's dims with (segments, positions) in place of
// the axis, where the mask and the selected data live.
struct Segments {
  std::vector<int64_t> d, lead, lens, full, out;
  int64_t axis = 0, count = 0, length = 0;
  std::string lengths;  // i64, dims lens (lead + [count])
  std::string mask;     // i1, dims full
  std::vector<int64_t> data_map, out_map, lens_map;  // into full
};

absl::StatusOr<Segments> SegmentsOf(Lowering& l, const Args& a,
                                    const std::vector<int64_t>& data_dims) {
  Segments s;
  s.d = data_dims;
  if (s.d.empty()) return Unsupported(l.op(), "a 0-d input");
  absl::StatusOr<int64_t> axis =
      CheckedDim(l.op(), a.Int("axis", 0), s.d.size());
  if (!axis.ok()) return axis.status();
  s.axis = *axis;
  s.length = s.d[s.axis];
  s.lead.assign(s.d.begin(), s.d.begin() + s.axis);
  const HloType& i64 = I64();
  const bool by_lengths = a.Defined("lengths");
  const char* name = by_lengths ? "lengths" : "offsets";
  if (!a.Defined(name))
    return Unsupported(l.op(), "segments given by neither lengths nor offsets");
  const std::vector<int64_t> ld = DimsOf(a[name].tensor);
  if (ld.size() != s.lead.size() + 1 ||
      !std::equal(s.lead.begin(), s.lead.end(), ld.begin()))
    return Unsupported(l.op(), "segments of another shape than the data's");
  absl::StatusOr<std::string> given = l.Operand(a[name], ld, i64);
  if (!given.ok()) return given.status();
  const int64_t last = static_cast<int64_t>(ld.size()) - 1;
  std::string starts;
  if (by_lengths) {
    s.count = ld.back();
    s.lens = ld;
    s.lengths = *given;
    starts = l.Binary("subtract", Running(l, *given, ld, last, "add", 0, i64),
                      *given, ld, i64);
  } else {
    if (ld.back() < 1) return Unsupported(l.op(), "offsets without an end");
    s.count = ld.back() - 1;
    s.lens = ld;
    s.lens.back() = s.count;
    starts = l.SliceAlong(*given, ld, last, 0, s.count, i64);
    s.lengths = l.Binary("subtract",
                         l.SliceAlong(*given, ld, last, 1, s.count + 1, i64),
                         starts, s.lens, i64);
  }
  // full = lead + [count, length] + trailing
  s.full = s.lead;
  s.full.push_back(s.count);
  s.full.push_back(s.length);
  s.out = s.lead;
  s.out.push_back(s.count);
  for (size_t q = s.axis + 1; q < s.d.size(); ++q) {
    s.full.push_back(s.d[q]);
    s.out.push_back(s.d[q]);
  }
  const int64_t ax = s.axis;
  for (int64_t q = 0; q < static_cast<int64_t>(s.d.size()); ++q)
    s.data_map.push_back(q < ax ? q : q + 1);
  for (int64_t q = 0; q < static_cast<int64_t>(s.out.size()); ++q)
    s.out_map.push_back(q <= ax ? q : q + 1);
  for (int64_t q = 0; q <= ax; ++q) s.lens_map.push_back(q);
  const std::string start =
      BroadcastInDim(l, starts, s.lens, s.full, s.lens_map, i64);
  const std::string end =
      l.Binary("add", start,
               BroadcastInDim(l, s.lengths, s.lens, s.full, s.lens_map, i64),
               s.full, i64);
  const std::string pos = l.Iota(ax + 1, s.full, i64);
  s.mask = l.Binary("and", l.Compare("GE", pos, start, s.full, i64),
                    l.Compare("LT", pos, end, s.full, i64), s.full,
                    *DTypeOf(tpu::DType::kBool));
  return s;
}

std::string ReduceIdentity(Lowering& l, Combine r,
                           const std::vector<int64_t>& dims, const HloType& t) {
  switch (r) {
    case Combine::kMax:
      return l.BroadcastTo(l.Lowest(t), {}, dims, t);
    case Combine::kMin:
      return l.BroadcastTo(Highest(l, t), {}, dims, t);
    case Combine::kProd:
      return l.Constant(1, dims, t);
    default:
      return l.Constant(0, dims, t);
  }
}

const char* Combiner(Combine r) {
  switch (r) {
    case Combine::kMax:
      return "maximum";
    case Combine::kMin:
      return "minimum";
    case Combine::kProd:
      return "multiply";
    default:
      return "add";
  }
}

// ATen's linspace(left, right, bins + 1) of 0-d left and right: left +
// step i for the first half, right - step (bins - i) for the rest.
std::string Linspace(Lowering& l, const std::string& left,
                     const std::string& right, int64_t bins, const HloType& t) {
  const std::vector<int64_t> ed = {bins + 1};
  const HloType& i64 = I64();
  const std::string lo = l.BroadcastTo(left, {}, ed, t),
                    hi = l.BroadcastTo(right, {}, ed, t);
  const std::string step = l.BroadcastTo(
      l.Binary("divide", l.Binary("subtract", right, left, {}, t),
               l.Constant(static_cast<double>(bins), {}, t), {}, t),
      {}, ed, t);
  const std::string i = l.Iota(0, ed, i64);
  const std::string it = l.Convert(i, ed, i64, t);
  return l.Select(
      l.Compare("LT", i, l.Constant((bins + 1) / 2, ed, i64), ed, i64),
      l.Binary("add", lo, l.Binary("multiply", step, it, ed, t), ed, t),
      l.Binary("subtract", hi,
               l.Binary("multiply", step,
                        l.Binary("subtract",
                                 l.Constant(static_cast<double>(bins), ed, t),
                                 it, ed, t),
                        ed, t),
               ed, t),
      ed, t);
}

}  // namespace

void RegisterSegment(OpRegistry& reg) {
  // segment_reduce(data, reduce, *, lengths, indices, offsets, axis, unsafe,
  // initial): each segment's elements combined, starting from `initial`
  // where given (else the reduction's identity); the mean divides by the
  // length (an empty segment gives initial, or NaN without one).
  reg.Add("aten::segment_reduce",
          [](Lowering& l, const tpu::DecodedOp& d,
             const Target& o) -> absl::StatusOr<std::string> {
            const Args a(l);
            if (!a.Defined("data") || !o.type->is_float)
              return Unsupported(l.op(), "arguments of a form not lowered");
            absl::StatusOr<Combine> r = ReduceOf(l, a);
            if (!r.ok()) return r.status();
            const HloType& t = *o.type;
            const std::vector<int64_t> dd = DimsOf(a["data"].tensor);
            absl::StatusOr<Segments> s = SegmentsOf(l, a, dd);
            if (!s.ok()) return s.status();
            if (s->out != o.dims)
              return Unsupported(l.op(), "an output of another shape");
            absl::StatusOr<std::string> x = l.Operand(a["data"], dd, t);
            if (!x.ok()) return x;
            const tpu::OpArg* init = a.Find("initial");
            const bool has_init =
                init != nullptr && init->tag != tpu::ArgTag::kNone;
            std::string start = ReduceIdentity(l, *r, {}, t);
            if (has_init) {
              absl::StatusOr<std::string> v = l.Scalar(*init, t);
              if (!v.ok()) return v;
              start = *v;
            }
            const std::vector<int64_t>& full = s->full;
            const std::string picked = l.Select(
                s->mask, BroadcastInDim(l, *x, dd, full, s->data_map, t),
                ReduceIdentity(l, *r, full, t), full, t);
            const char* op = Combiner(*r);
            std::string v = l.ReduceOver(picked, full, {s->axis + 1}, op,
                                         ReduceIdentity(l, *r, {}, t), t);
            v = l.Binary(op, v, l.BroadcastTo(start, {}, o.dims, t), o.dims, t);
            if (*r == Combine::kMean) {
              const std::string len =
                  BroadcastInDim(l, l.Convert(s->lengths, s->lens, I64(), t),
                                 s->lens, o.dims, s->lens_map, t);
              const std::string empty =
                  l.Compare("EQ", len, l.Constant(0, o.dims, t), o.dims, t);
              v = l.Binary("divide", v, len, o.dims, t);
              if (has_init)
                v = l.Select(empty, l.BroadcastTo(start, {}, o.dims, t), v,
                             o.dims, t);
            }
            return v;
          });
  reg.Alias("aten::segment_reduce.out", "aten::segment_reduce");
  // _segment_reduce_backward(grad, output, data, reduce, *, lengths,
  // offsets, axis, initial): the gradient of each element from its
  // segment's: as is (sum), over the length (mean), shared by the elements
  // equal to the result (max, min; ATen divides only the positive shares),
  // times the product of the others (prod).
  reg.Add(
      "aten::_segment_reduce_backward",
      [](Lowering& l, const tpu::DecodedOp& d,
         const Target& o) -> absl::StatusOr<std::string> {
        const Args a(l);
        if (!a.Defined("grad") || !a.Defined("output") || !a.Defined("data") ||
            !o.type->is_float)
          return Unsupported(l.op(), "arguments of a form not lowered");
        absl::StatusOr<Combine> r = ReduceOf(l, a);
        if (!r.ok()) return r.status();
        const HloType& t = *o.type;
        const std::vector<int64_t> dd = DimsOf(a["data"].tensor);
        if (dd != o.dims)
          return Unsupported(l.op(), "an output of another shape");
        absl::StatusOr<Segments> s = SegmentsOf(l, a, dd);
        if (!s.ok()) return s.status();
        const std::vector<int64_t>&full = s->full, &od = s->out;
        absl::StatusOr<std::string> x = l.Operand(a["data"], dd, t),
                                    g = l.Operand(a["grad"], od, t),
                                    y = l.Operand(a["output"], od, t);
        for (auto* v : {&x, &g, &y})
          if (!v->ok()) return v->status();
        const HloType& i1 = *DTypeOf(tpu::DType::kBool);
        const std::string zero = l.Constant(0, full, t);
        const std::string xf = BroadcastInDim(l, *x, dd, full, s->data_map, t);
        const std::string gf = BroadcastInDim(l, *g, od, full, s->out_map, t);
        const std::string yf = BroadcastInDim(l, *y, od, full, s->out_map, t);
        const std::string lenf =
            BroadcastInDim(l, l.Convert(s->lengths, s->lens, I64(), t), s->lens,
                           full, s->lens_map, t);
        std::string per;  // each element's gradient, in its segment's row
        switch (*r) {
          case Combine::kSum:
            per = gf;
            break;
          case Combine::kMean:
            per = l.Binary("divide", gf, lenf, full, t);
            break;
          case Combine::kMax:
          case Combine::kMin: {
            const std::string hit =
                l.Binary("and", s->mask,
                         l.Binary("or", l.Compare("EQ", xf, yf, full, t),
                                  l.Compare("NE", xf, xf, full, t), full, i1),
                         full, i1);
            const std::string count = l.ReduceOver(
                l.Select(hit, l.Constant(1, full, t), zero, full, t), full,
                {s->axis + 1}, "add", l.Constant(0, {}, t), t);
            const std::string countf =
                BroadcastInDim(l, count, od, full, s->out_map, t);
            const std::string share = l.Select(
                l.Binary(
                    "and", l.Compare("GT", gf, zero, full, t),
                    l.Compare("GE", countf, l.Constant(2, full, t), full, t),
                    full, i1),
                l.Binary("divide", gf, countf, full, t), gf, full, t);
            per = l.Select(hit, share, zero, full, t);
            break;
          }
          case Combine::kProd: {
            // x != 0: g * y / x; the one zero of a segment: g times the
            // product of the rest (initial included); with two zeros, 0
            const std::string is_zero = l.Binary(
                "and", s->mask, l.Compare("EQ", xf, zero, full, t), full, i1);
            const std::string zeros = BroadcastInDim(
                l,
                l.ReduceOver(
                    l.Select(is_zero, l.Constant(1, full, t), zero, full, t),
                    full, {s->axis + 1}, "add", l.Constant(0, {}, t), t),
                od, full, s->out_map, t);
            std::string rest = l.ReduceOver(
                l.Select(l.Binary("and", s->mask,
                                  l.Compare("NE", xf, zero, full, t), full, i1),
                         xf, l.Constant(1, full, t), full, t),
                full, {s->axis + 1}, "multiply", l.Constant(1, {}, t), t);
            const tpu::OpArg* init = a.Find("initial");
            if (init != nullptr && init->tag != tpu::ArgTag::kNone) {
              absl::StatusOr<std::string> v = l.Scalar(*init, t);
              if (!v.ok()) return v;
              rest = l.Binary("multiply", rest, l.BroadcastTo(*v, {}, od, t),
                              od, t);
            }
            const std::string restf =
                BroadcastInDim(l, rest, od, full, s->out_map, t);
            per = l.Select(
                is_zero,
                l.Select(
                    l.Compare("EQ", zeros, l.Constant(1, full, t), full, t),
                    l.Binary("multiply", gf, restf, full, t), zero, full, t),
                l.Binary("divide", l.Binary("multiply", gf, yf, full, t), xf,
                         full, t),
                full, t);
            break;
          }
        }
        per = l.Select(s->mask, per, zero, full, t);
        // each element belongs to at most one segment: the sum over them
        return l.ReduceOver(per, full, {s->axis}, "add", l.Constant(0, {}, t),
                            t);
      });
  reg.Alias("aten::_segment_reduce_backward.out",
            "aten::_segment_reduce_backward");
  // histogram.bin_ct(self, bins, *, range, weight, density) -> (hist,
  // bin_edges), and .bins_tensor, whose bins are the edges: `bins` equal
  // bins over range (else the data's min and
  // max, widened by 0.5 each way where they are equal; [0, 1] for no
  // data), the edges as ATen's linspace computes them; an element's bin is
  // the last edge at or below it (the top edge closes the last bin), those
  // outside the edges are not counted. Density divides by the total and
  // the bins' widths.
  reg.AddMulti(
      "aten::histogram.bin_ct",
      [](Lowering& l, const tpu::DecodedOp& d, const std::vector<Target>& o)
          -> absl::StatusOr<std::vector<std::string>> {
        const Args a(l);
        if (o.size() != 2 || !a.Defined("self") || !o[0].type->is_float ||
            o[0].dims.size() != 1 || o[1].dims.size() != 1)
          return Unsupported(l.op(), "arguments of a form not lowered");
        const HloType& t = *o[0].type;
        const int64_t bins = o[0].dims[0];
        if (bins < 1 || o[1].dims[0] != bins + 1)
          return Unsupported(l.op(), "outputs of other sizes");
        const std::vector<int64_t> in = DimsOf(a["self"].tensor);
        int64_t n = 1;
        for (int64_t v : in) n *= v;
        const std::vector<int64_t> nd = {n}, ed = {bins + 1}, hd = {bins};
        const HloType& i64 = I64();
        std::string x;
        if (n > 0) {
          absl::StatusOr<std::string> xv = l.Operand(a["self"], in, t);
          if (!xv.ok()) return xv.status();
          x = l.Reshape(*xv, in, nd, t);
        }
        std::string edges;
        if (a.Defined("bins")) {  // bins_tensor: the edges themselves
          absl::StatusOr<std::string> ev = l.Operand(a["bins"], ed, t);
          if (!ev.ok()) return ev.status();
          edges = *ev;
        } else {
          const tpu::OpArg* range = a.Find("range");
          const bool ranged = range != nullptr &&
                              range->tag == tpu::ArgTag::kDoubleList &&
                              range->doubles.size() == 2;
          std::string left, right;  // 0-d, of type t
          if (ranged) {
            left = l.Constant(range->doubles[0], {}, t);
            right = l.Constant(range->doubles[1], {}, t);
          } else if (n == 0) {
            left = l.Constant(0, {}, t);
            right = l.Constant(1, {}, t);
          } else {
            left = l.ReduceOver(x, nd, {0}, "minimum", Highest(l, t), t);
            right = l.ReduceOver(x, nd, {0}, "maximum", l.Lowest(t), t);
            const std::string same = l.Compare("EQ", left, right, {}, t);
            left = l.Select(
                same, l.Binary("subtract", left, l.Constant(0.5, {}, t), {}, t),
                left, {}, t);
            right = l.Select(
                same, l.Binary("add", right, l.Constant(0.5, {}, t), {}, t),
                right, {}, t);
          }
          edges = Linspace(l, left, right, bins, t);
        }
        if (n == 0)
          return std::vector<std::string>{l.Constant(0, hd, t), edges};
        const std::vector<int64_t> full = {n, bins + 1};
        const std::string at_or_below =
            l.Compare("LE", BroadcastInDim(l, edges, ed, full, {1}, t),
                      BroadcastInDim(l, x, nd, full, {0}, t), full, t);
        std::string bin = l.Binary(
            "subtract",
            l.ReduceOver(
                l.Convert(at_or_below, full, *DTypeOf(tpu::DType::kBool), i64),
                full, {1}, "add", l.Constant(0, {}, i64), i64),
            l.Constant(1, nd, i64), nd, i64);
        bin = l.Binary("minimum", bin, l.Constant(bins - 1, nd, i64), nd, i64);
        const std::string first = l.SliceAlong(edges, ed, 0, 0, 1, t),
                          last = l.SliceAlong(edges, ed, 0, bins, bins + 1, t);
        const std::string inside = l.Binary(
            "and",
            l.Compare("GE", x,
                      l.BroadcastTo(l.Reshape(first, {1}, {}, t), {}, nd, t),
                      nd, t),
            l.Compare("LE", x,
                      l.BroadcastTo(l.Reshape(last, {1}, {}, t), {}, nd, t), nd,
                      t),
            nd, *DTypeOf(tpu::DType::kBool));
        bin = l.Select(inside, bin, l.Constant(bins, nd, i64), nd, i64);
        std::string w = l.Constant(1, nd, t);
        if (a.Defined("weight")) {
          absl::StatusOr<std::string> wv = l.Operand(a["weight"], in, t);
          if (!wv.ok()) return wv.status();
          w = l.Reshape(*wv, in, nd, t);
        }
        std::string hist =
            ScatterFlat(l, l.Constant(0, hd, t), bins, bin, w, n, true, t);
        if (a.Flag("density", false)) {
          const std::string widths =
              l.Binary("subtract", l.SliceAlong(edges, ed, 0, 1, bins + 1, t),
                       l.SliceAlong(edges, ed, 0, 0, bins, t), hd, t);
          const std::string total = l.BroadcastTo(
              l.ReduceOver(hist, hd, {0}, "add", l.Constant(0, {}, t), t), {},
              hd, t);
          hist = l.Binary("divide", hist,
                          l.Binary("multiply", total, widths, hd, t), hd, t);
        }
        return std::vector<std::string>{hist, edges};
      });
  reg.Alias("aten::histogram.bin_ct_out", "aten::histogram.bin_ct");
  reg.Alias("aten::histogram.bins_tensor", "aten::histogram.bin_ct");
  reg.Alias("aten::histogram.bins_tensor_out", "aten::histogram.bin_ct");
}

}  // namespace tpud::pjrt
