// Sorting and selection: max/min along a dimension, sort, median,
// searchsorted, topk and kthvalue.
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

// The input of a (values, indices) op along one dim of self (max.dim,
// mode): self as the values' type, its dims and the dim, wrapped; a 0-d
// self is its own value at index 0 (`done`).
struct AlongDim {
  std::string v;
  std::vector<int64_t> in;
  int64_t dim = 0;
  std::vector<std::string> done;
};

absl::StatusOr<AlongDim> AlongDimOf(Lowering& l, const Args& a,
                                    const std::vector<Target>& o, int64_t dim) {
  AlongDim r;
  const tpu::TensorRef& x = a["self"].tensor;
  const HloType& t = *o[0].type;
  r.in = DimsOf(x);
  absl::StatusOr<std::string> v = l.OperandRef(x, 0, r.in, t);
  if (!v.ok()) return v.status();
  r.v = *v;
  if (r.in.empty()) {
    r.done = {l.Reshape(r.v, r.in, o[0].dims, t),
              l.Constant(0, o[1].dims, *o[1].type)};
    return r;
  }
  absl::StatusOr<int64_t> checked = CheckedDim(l.op(), dim, r.in.size());
  if (!checked.ok()) return checked.status();
  r.dim = *checked;
  return r;
}

}  // namespace

void RegisterSort(OpRegistry& reg) {
  // max.dim / min.dim(self, dim, keepdim): the values and the first index
  // of each.
  for (bool largest : {true, false}) {
    MultiRule r = [largest](Lowering& l, const tpu::DecodedOp&,
                            const std::vector<Target>& o)
        -> absl::StatusOr<std::vector<std::string>> {
      const Args a(l);
      if (o.size() != 2 || !a.Defined("self") || !a.Has("dim"))
        return Unsupported(l.op(), "expects 2 outputs");
      absl::StatusOr<AlongDim> along = AlongDimOf(l, a, o, a["dim"].i);
      if (!along.ok()) return along.status();
      if (!along->done.empty()) return along->done;
      const HloType& t = *o[0].type;
      const std::vector<int64_t>& in = along->in;
      const std::string* v = &along->v;
      const int64_t dim = along->dim;
      const std::vector<int64_t> which = {dim};
      const std::vector<int64_t> kept = Lowering::Kept(in, which);
      const std::string best =
          largest ? l.ReduceOver(*v, in, which, "maximum", l.Lowest(t), t)
                  : l.ReduceOver(*v, in, which, "minimum", Highest(l, t), t);
      const std::string hit =
          l.Compare("EQ", *v, l.Expand(best, in, which, t), in, t);
      const HloType& i64 = I64();
      const std::string none =
          l.Constant(static_cast<double>(in[dim]), in, i64);
      const std::string idx = l.ReduceOver(
          l.Select(hit, l.Iota(dim, in, i64), none, in, i64), in, which,
          "minimum", l.Constant(static_cast<double>(in[dim]), {}, i64), i64);
      return std::vector<std::string>{
          l.Reshape(best, kept, o[0].dims, t),
          l.Reshape(l.Convert(idx, kept, i64, *o[1].type), kept, o[1].dims,
                    *o[1].type)};
    };
    reg.AddMulti(largest ? "aten::max.dim" : "aten::min.dim", r);
    reg.AddMulti(largest ? "aten::max.dim_max" : "aten::min.dim_min", r);
  }
  // mode(self, dim, keepdim) -> (values, indices): the value that occurs
  // most often along dim, the smallest of those that tie, and a position
  // of it (CPU's is whichever its unstable sort leaves last; here the last
  // one). Counted by comparing every pair of the dimension's elements.
  {
    MultiRule r = [](Lowering& l, const tpu::DecodedOp&,
                     const std::vector<Target>& o)
        -> absl::StatusOr<std::vector<std::string>> {
      const Args a(l);
      if (o.size() != 2 || !a.Defined("self"))
        return Unsupported(l.op(), "expects 2 outputs");
      absl::StatusOr<AlongDim> along =
          AlongDimOf(l, a, o, static_cast<int64_t>(a.Number("dim", -1)));
      if (!along.ok()) return along.status();
      if (!along->done.empty()) return along->done;
      const HloType& t = *o[0].type;
      const std::vector<int64_t>& in = along->in;
      const std::string* v = &along->v;
      const int64_t dim = along->dim, n = in[dim];
      if (n == 0) return Unsupported(l.op(), "an empty dimension");
      const std::vector<int64_t> which = {dim};
      const std::vector<int64_t> kept = Lowering::Kept(in, which);
      const HloType& i64 = I64();
      // full: in + [n], the element (along dim) against every other (last)
      std::vector<int64_t> full = in, self_map, other_map;
      full.push_back(n);
      const int64_t last = static_cast<int64_t>(in.size());
      for (int64_t q = 0; q < last; ++q) {
        self_map.push_back(q);
        other_map.push_back(q == dim ? last : q);
      }
      const std::string same =
          l.Compare("EQ", BroadcastInDim(l, *v, in, full, self_map, t),
                    BroadcastInDim(l, *v, in, full, other_map, t), full, t);
      const std::string count =
          l.ReduceOver(l.Convert(same, full, *DTypeOf(tpu::DType::kBool), i64),
                       full, {last}, "add", l.Constant(0, {}, i64), i64);
      const std::string most = l.ReduceOver(count, in, which, "maximum",
                                            l.Constant(0, {}, i64), i64);
      const std::string often =
          l.Compare("EQ", count, l.Expand(most, in, which, i64), in, i64);
      const std::string value = l.ReduceOver(
          l.Select(often, *v, l.BroadcastTo(Highest(l, t), {}, in, t), in, t),
          in, which, "minimum", Highest(l, t), t);
      const std::string at =
          l.Compare("EQ", *v, l.Expand(value, in, which, t), in, t);
      const std::string idx = l.ReduceOver(
          l.Select(at, l.Iota(dim, in, i64), l.Constant(0, in, i64), in, i64),
          in, which, "maximum", l.Constant(0, {}, i64), i64);
      return std::vector<std::string>{
          l.Reshape(value, kept, o[0].dims, t),
          l.Reshape(l.Convert(idx, kept, i64, *o[1].type), kept, o[1].dims,
                    *o[1].type)};
    };
    reg.AddMulti("aten::mode", r);
    reg.AddMulti("aten::mode.values", r);
  }
  // sort(self, [stable,] dim, descending): a stable sort (PyTorch's CPU
  // sort is stable either way), NaN last going up.
  for (bool with_stable : {false, true}) {
    MultiRule r = [](Lowering& l, const tpu::DecodedOp&,
                     const std::vector<Target>& o)
        -> absl::StatusOr<std::vector<std::string>> {
      const Args a(l);
      if (o.size() != 2 || !a.Defined("self"))
        return Unsupported(l.op(), "expects 2 outputs");
      const tpu::TensorRef& x = a["self"].tensor;
      const HloType& t = *DTypeOf(x.dtype);
      const std::vector<int64_t> in = DimsOf(x);
      absl::StatusOr<std::string> v = l.OperandRef(x, 0, in, t);
      if (!v.ok()) return v.status();
      if (in.empty())
        return std::vector<std::string>{l.Convert(*v, in, t, *o[0].type),
                                        l.Constant(0, o[1].dims, *o[1].type)};
      absl::StatusOr<int64_t> checked = CheckedDim(
          l.op(), static_cast<int64_t>(a.Number("dim", -1)), in.size());
      if (!checked.ok()) return checked.status();
      const int64_t dim = *checked;
      const bool descending = a.Number("descending", 0) != 0;
      auto [values, indices] = l.Sort(*v, in, dim, descending, t);
      return std::vector<std::string>{
          l.Convert(values, in, t, *o[0].type),
          l.Convert(indices, in, I64(), *o[1].type)};
    };
    for (const char* name :
         with_stable
             ? std::vector<const char*>{"aten::sort.stable",
                                        "aten::sort.values_stable"}
             : std::vector<const char*>{"aten::sort", "aten::sort.values"}) {
      reg.AddMulti(name, r);
    }
  }
  // median / nanmedian, of everything or along dim (values and indices):
  // the lower middle of the sorted elements. median gives NaN (and the
  // first NaN's index) where a row holds one; nanmedian skips them.
  for (bool nan : {false, true}) {
    MultiRule r = [nan](Lowering& l, const tpu::DecodedOp&,
                        const std::vector<Target>& o)
        -> absl::StatusOr<std::vector<std::string>> {
      const Args a(l);
      if (!a.Defined("self")) return Unsupported(l.op(), "expects a tensor");
      const tpu::TensorRef& x = a["self"].tensor;
      const HloType& t = *DTypeOf(x.dtype);
      const std::vector<int64_t> given = DimsOf(x);
      absl::StatusOr<std::string> v = l.OperandRef(x, 0, given, t);
      if (!v.ok()) return v.status();
      const bool whole = o.size() == 1;
      std::vector<int64_t> in = given;
      int64_t dim = 0;
      if (whole || in.empty()) {
        int64_t n = 1;
        for (int64_t s : given) n *= s;
        in = {n};
        v = l.Reshape(*v, given, in, t);
        if (!whole && a.Has("dim")) {
          // A 0-d tensor takes dim 0 or -1, as a 1-d one.
          absl::StatusOr<int64_t> checked =
              CheckedDim(l.op(), static_cast<int64_t>(a.Number("dim", 0)), 1);
          if (!checked.ok()) return checked.status();
        }
      } else {
        absl::StatusOr<int64_t> checked = CheckedDim(
            l.op(), static_cast<int64_t>(a.Number("dim", -1)), in.size());
        if (!checked.ok()) return checked.status();
        dim = *checked;
      }
      if (in[dim] == 0) return Unsupported(l.op(), "an empty dimension");
      auto [values, indices] = l.Sort(*v, in, dim, false, t);
      const HloType& i64 = I64();
      const std::vector<int64_t> which = {dim};
      const std::vector<int64_t> kept = Lowering::Kept(in, which);
      const std::string count =
          l.Constant(static_cast<double>(in[dim]), kept, i64);
      std::string pos;
      if (t.is_float) {
        const std::string isnan =
            l.Convert(l.Compare("NE", values, values, in, t), in,
                      *DTypeOf(tpu::DType::kBool), i64);
        const std::string nans =
            l.ReduceOver(isnan, in, which, "add", l.Constant(0, {}, i64), i64);
        const std::string valid = l.Binary("subtract", count, nans, kept, i64);
        const std::string one = l.Constant(1, kept, i64),
                          two = l.Constant(2, kept, i64);
        const std::string mid =
            l.Binary("divide", l.Binary("subtract", valid, one, kept, i64), two,
                     kept, i64);
        if (nan) {
          // All NaN: the first (a NaN).
          pos = l.Binary("maximum", mid, l.Constant(0, kept, i64), kept, i64);
        } else {
          pos = l.Select(
              l.Compare("GT", nans, l.Constant(0, kept, i64), kept, i64), valid,
              mid, kept, i64);
        }
      } else {
        pos = l.Constant(static_cast<double>((in[dim] - 1) / 2), kept, i64);
      }
      const std::string hit = l.Compare("EQ", l.Iota(dim, in, i64),
                                        l.Expand(pos, in, which, i64), in, i64);
      const std::string value =
          l.ReduceOver(l.Select(hit, values, l.Constant(0, in, t), in, t), in,
                       which, "add", l.Constant(0, {}, t), t);
      const std::string index =
          l.ReduceOver(l.Select(hit, indices, l.Constant(0, in, i64), in, i64),
                       in, which, "add", l.Constant(0, {}, i64), i64);
      std::vector<std::string> out = {l.Reshape(
          l.Convert(value, kept, t, *o[0].type), kept, o[0].dims, *o[0].type)};
      if (!whole)
        out.push_back(l.Reshape(l.Convert(index, kept, i64, *o[1].type), kept,
                                o[1].dims, *o[1].type));
      return out;
    };
    const std::string base = nan ? "aten::nanmedian" : "aten::median";
    for (const char* form : {"", ".dim", ".dim_values", ".out"})
      reg.AddMulti(base + form, r);
  }
  // searchsorted(sorted_sequence, self, out_int32, right, side, sorter):
  // for each value, how many elements of its row sort before it.
  reg.AddMulti(
      "aten::searchsorted.Tensor_out",
      [](Lowering& l, const tpu::DecodedOp&, const std::vector<Target>& o)
          -> absl::StatusOr<std::vector<std::string>> {
        const Args a(l);
        if (o.size() != 1 || !a.Defined("sorted_sequence") ||
            !a.Defined("self"))
          return Unsupported(l.op(), "expects two tensors");
        if (a.Defined("sorter")) return Unsupported(l.op(), "a sorter");
        bool right = a.Number("right", 0) != 0;
        if (const tpu::OpArg* side = a.Find("side");
            side != nullptr && side->tag == tpu::ArgTag::kString)
          right = right || side->s == "right";
        const tpu::TensorRef& seq = a["sorted_sequence"].tensor;
        const tpu::TensorRef& val = a["self"].tensor;
        const HloType& t = *DTypeOf(seq.dtype);
        const std::vector<int64_t> sd = DimsOf(seq), vd = DimsOf(val);
        if (sd.empty()) return Unsupported(l.op(), "a 0-d sequence");
        const int64_t n = sd.back();
        int64_t m = 1;
        for (int64_t x : vd) m *= x;
        // Rows: the sequence's batch dimensions (one row when it is 1-d).
        std::vector<int64_t> batch(sd.begin(), sd.end() - 1);
        int64_t rows = 1;
        for (int64_t x : batch) rows *= x;
        const int64_t per = rows == 0 ? 0 : m / std::max<int64_t>(rows, 1);
        absl::StatusOr<std::string> s = l.OperandRef(seq, 0, sd, t);
        if (!s.ok()) return s.status();
        absl::StatusOr<std::string> v = l.OperandRef(val, 1, vd, t);
        if (!v.ok()) return v.status();
        const std::vector<int64_t> s2 = {rows, n, 1}, v2 = {rows, 1, per},
                                   full = {rows, n, per};
        const std::string sb =
            l.BroadcastTo(l.Reshape(*s, sd, s2, t), s2, full, t);
        const std::string vb =
            l.BroadcastTo(l.Reshape(*v, vd, v2, t), v2, full, t);
        const HloType& i64 = I64();
        const std::string before =
            l.Convert(l.Compare(right ? "LE" : "LT", sb, vb, full, t), full,
                      *DTypeOf(tpu::DType::kBool), i64);
        const std::string c =
            l.ReduceOver(before, full, {1}, "add", l.Constant(0, {}, i64), i64);
        return std::vector<std::string>{
            l.Reshape(l.Convert(c, {rows, per}, i64, *o[0].type), {rows, per},
                      o[0].dims, *o[0].type)};
      });
  reg.Alias("aten::searchsorted.Tensor", "aten::searchsorted.Tensor_out");
  // topk(self, k, dim, largest, sorted) and kthvalue(self, k, dim,
  // keepdim): a sort, then a slice.
  for (bool top : {true, false}) {
    MultiRule r = [top](Lowering& l, const tpu::DecodedOp&,
                        const std::vector<Target>& o)
        -> absl::StatusOr<std::vector<std::string>> {
      const Args a(l);
      if (o.size() != 2 || !a.Defined("self") || !a.Has("k"))
        return Unsupported(l.op(), "expects 2 outputs");
      const tpu::TensorRef& x = a["self"].tensor;
      const HloType& t = *DTypeOf(x.dtype);
      std::vector<int64_t> in = DimsOf(x);
      absl::StatusOr<std::string> v = l.OperandRef(x, 0, in, t);
      if (!v.ok()) return v.status();
      if (in.empty()) {
        in = {1};
        v = l.Reshape(*v, {}, in, t);
      }
      const int64_t k = static_cast<int64_t>(a.Number("k", 0));
      absl::StatusOr<int64_t> checked = CheckedDim(
          l.op(), static_cast<int64_t>(a.Number("dim", -1)), in.size());
      if (!checked.ok()) return checked.status();
      const int64_t dim = *checked;
      const bool descending = top && a.Number("largest", 1) != 0;
      if (top ? (k < 0 || k > in[dim]) : (k < 1 || k > in[dim])) {
        return absl::InvalidArgumentError(
            absl::StrCat(l.op(), ": k (", k,
                         ") is out of range for a dimension of ", in[dim]));
      }
      auto [values, indices] = l.Sort(*v, in, dim, descending, t);
      const int64_t begin = top ? 0 : k - 1;
      std::vector<int64_t> cut = in;
      cut[dim] = k - begin;
      const std::string vs = l.SliceAlong(values, in, dim, begin, k, t);
      const std::string is = l.SliceAlong(indices, in, dim, begin, k, I64());
      return std::vector<std::string>{
          l.Reshape(l.Convert(vs, cut, t, *o[0].type), cut, o[0].dims,
                    *o[0].type),
          l.Reshape(l.Convert(is, cut, I64(), *o[1].type), cut, o[1].dims,
                    *o[1].type)};
    };
    for (const char* name :
         top ? std::vector<const char*>{"aten::topk", "aten::topk.values"}
             : std::vector<const char*>{"aten::kthvalue",
                                        "aten::kthvalue.values"}) {
      reg.AddMulti(name, r);
    }
  }
}

}  // namespace tpud::pjrt
