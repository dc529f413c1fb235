// Indexing: index_select, gather, index.Tensor, index_put, scatter and
// its reductions, put_, masked_scatter_, nonzero_static.
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

void RegisterIndexing(OpRegistry& reg) {
  // Arguments are read by their schema names (Args, helpers.h).
  // index_select(self, dim, index): a gather of whole slices.
  reg.Add("aten::index_select",
          [](Lowering& l, const tpu::DecodedOp& d,
             const Target& o) -> absl::StatusOr<std::string> {
            const Args a(l);
            if (!a.Defined("self") || !a.Defined("index") ||
                a["index"].tensor.ndim > 1)
              return Unsupported(l.op(), "arguments of a form not lowered");
            const tpu::TensorRef& x = a["self"].tensor;
            std::vector<int64_t> in = DimsOf(x);
            absl::StatusOr<std::string> v = l.Operand(a["self"], in, *o.type);
            if (!v.ok()) return v;
            std::string xv = *v;
            if (in.empty()) {
              xv = l.Reshape(xv, in, {1}, *o.type);
              in = {1};
            }
            absl::StatusOr<int64_t> checked =
                CheckedDim(l.op(), a["dim"].i, in.size());
            if (!checked.ok()) return checked.status();
            const int64_t dim = *checked;
            const tpu::TensorRef& ix = a["index"].tensor;
            const HloType* it = DTypeOf(ix.dtype);
            if (it == nullptr || it->is_float)
              return Unsupported(l.op(), "index dtype");
            const int64_t k = Numel(ix);
            absl::StatusOr<std::string> iv =
                l.OperandRef(ix, l.TensorIndex(a["index"]), DimsOf(ix), I64());
            if (!iv.ok()) return iv;
            l.CheckRange(*iv, DimsOf(ix), in[dim],
                         absl::StrCat("index out of range in self (dim ", dim,
                                      " has size ", in[dim], ")"));
            const std::string idx = l.Reshape(*iv, DimsOf(ix), {k, 1}, I64());
            std::vector<int64_t> offset, slice = in, shape = in;
            for (size_t q = 0; q < in.size(); ++q)
              if (static_cast<int64_t>(q) != dim)
                offset.push_back(static_cast<int64_t>(q));
            slice[dim] = 1;
            shape[dim] = k;
            const std::string g = l.Emit(absl::StrCat(
                "\"stablehlo.gather\"(", xv, ", ", idx,
                ") {dimension_numbers = #stablehlo.gather<offset_dims = [",
                absl::StrJoin(offset, ", "), "], collapsed_slice_dims = [", dim,
                "], start_index_map = [", dim,
                "], index_vector_dim = 1>, indices_are_sorted = false, "
                "slice_sizes = array<i64: ",
                absl::StrJoin(slice, ", "), ">} : (", TypeOf(in, *o.type), ", ",
                TypeOf({k, 1}, I64()), ") -> ", TypeOf(shape, *o.type)));
            return l.Reshape(g, shape, o.dims, *o.type);
          });
  // gather(self, dim, index, *, sparse_grad): out[i][j] = self[index[i][j]][j]
  // (dim 0).
  reg.Add("aten::gather",
          [](Lowering& l, const tpu::DecodedOp& d,
             const Target& o) -> absl::StatusOr<std::string> {
            const Args a(l);
            if (!a.Defined("self") || !a.Defined("index"))
              return Unsupported(l.op(), "arguments of a form not lowered");
            const tpu::TensorRef& x = a["self"].tensor;
            const std::vector<int64_t> in = DimsOf(x);
            absl::StatusOr<std::string> v = l.Operand(a["self"], in, *o.type);
            if (!v.ok()) return v;
            const size_t n = in.size();
            if (n == 0 || o.dims.size() != n)
              return l.Reshape(*v, in, o.dims, *o.type);
            absl::StatusOr<int64_t> checked = CheckedDim(l.op(), a["dim"].i, n);
            if (!checked.ok()) return checked.status();
            const int64_t dim = *checked;
            const tpu::TensorRef& ix = a["index"].tensor;
            const HloType& i64 = I64();
            absl::StatusOr<std::string> iv =
                l.OperandRef(ix, l.TensorIndex(a["index"]), o.dims, i64);
            if (!iv.ok()) return iv;
            l.CheckRange(*iv, o.dims, in[dim],
                         absl::StrCat("index out of bounds for dimension ", dim,
                                      " with size ", in[dim]));
            std::vector<int64_t> all = o.dims;
            all.push_back(static_cast<int64_t>(n));
            const std::string idx = ElementIndex(l, *iv, o.dims, dim);
            const std::vector<int64_t> dims_list = Range(n), ones(n, 1);
            return l.Emit(absl::StrCat(
                "\"stablehlo.gather\"(", *v, ", ", idx,
                ") {dimension_numbers = #stablehlo.gather<",
                "collapsed_slice_dims = [", absl::StrJoin(dims_list, ", "),
                "], start_index_map = [", absl::StrJoin(dims_list, ", "),
                "], index_vector_dim = ", n,
                ">, indices_are_sorted = false, slice_sizes = array<i64: ",
                absl::StrJoin(ones, ", "), ">} : (", TypeOf(in, *o.type), ", ",
                TypeOf(all, i64), ") -> ", TypeOf(o.dims, *o.type)));
          });
  // index.Tensor(self, indices): advanced indexing with integer index
  // tensors, a gather (see PlanIndex).
  reg.Add("aten::index.Tensor",
          [](Lowering& l, const tpu::DecodedOp& d,
             const Target& o) -> absl::StatusOr<std::string> {
            const Args a(l);
            if (!a.Defined("self") || !a.Has("indices"))
              return Unsupported(l.op(), "arguments of a form not lowered");
            const std::vector<int64_t> in = DimsOf(a["self"].tensor);
            absl::StatusOr<std::string> v = l.Operand(a["self"], in, *o.type);
            if (!v.ok()) return v;
            absl::StatusOr<IndexPlan> p = PlanIndex(l, a["indices"], in);
            if (!p.ok()) return p.status();
            const std::string g = l.Emit(absl::StrCat(
                "\"stablehlo.gather\"(", *v, ", ", p->indices,
                ") {dimension_numbers = #stablehlo.gather<offset_dims = [",
                absl::StrJoin(p->window, ", "), "], collapsed_slice_dims = [",
                absl::StrJoin(p->indexed, ", "), "], start_index_map = [",
                absl::StrJoin(p->indexed, ", "),
                "], index_vector_dim = ", p->batch.size(),
                ">, indices_are_sorted = false, slice_sizes = array<i64: ",
                absl::StrJoin(p->slice, ", "), ">} : (", TypeOf(in, *o.type),
                ", ", p->indices_type, ") -> ", TypeOf(p->result, *o.type)));
            return l.Reshape(g, p->result, o.dims, *o.type);
          })
      .Host(HostKind::kIndex)
      .TakesList();
  // index_put_ / _index_put_impl_(self, indices, values, accumulate[, unsafe]):
  // the values (broadcast to what index would return) scattered into
  // self, added where accumulate (embedding's backward).
  {
    Rule put = [](Lowering& l, const tpu::DecodedOp& d,
                  const Target& o) -> absl::StatusOr<std::string> {
      const Args a(l);
      if (!a.Defined("self") || !a.Defined("values"))
        return Unsupported(l.op(), "arguments of a form not lowered");
      const HloType& t = *o.type;
      const std::vector<int64_t>& in = o.dims;
      if (in.empty()) return Unsupported(l.op(), "a 0-d tensor");
      absl::StatusOr<std::string> self = l.Operand(a["self"], in, t);
      if (!self.ok()) return self;
      const tpu::OpArg* acc = a.Find("accumulate");
      const bool accumulate =
          acc != nullptr && acc->tag == tpu::ArgTag::kBool && acc->b;
      const tpu::OpArg& values = a["values"];
      // One boolean mask over the leading dimensions (x[mask] = v,
      // x[mask] += v): the k-th selected row takes the values' row k (or
      // their only row), a select whatever the mask holds; the mask's
      // count must equal the values' rows, checked after the run.
      const tpu::OpArg& list = a["indices"];
      if (list.tag == tpu::ArgTag::kOptionalTensorList &&
          !list.tensor_present.empty() && list.tensor_present[0] &&
          std::count(list.tensor_present.begin(), list.tensor_present.end(),
                     true) == 1 &&
          !list.tensors.empty() &&
          (list.tensors[0].dtype == tpu::Code(tpu::DType::kBool) ||
           list.tensors[0].dtype == tpu::Code(tpu::DType::kUInt8))) {
        const tpu::TensorRef& mr = list.tensors[0];
        const std::vector<int64_t> md = DimsOf(mr);
        if (md.size() > in.size() ||
            !std::equal(md.begin(), md.end(), in.begin())) {
          return absl::InvalidArgumentError(absl::StrCat(
              l.op(),
              ": the mask's shape does not match self's leading dimensions"));
        }
        const std::vector<int64_t> post(in.begin() + md.size(), in.end());
        const std::vector<int64_t> vd = DimsOf(values.tensor);
        const auto mismatch = [&] {
          return absl::StrCat("shape mismatch: value tensor of shape [",
                              absl::StrJoin(vd, ", "),
                              "] cannot be broadcast to indexing result of "
                              "shape [the mask's count",
                              post.empty() ? "" : ", ",
                              absl::StrJoin(post, ", "), "]");
        };
        if (vd.size() > post.size() + 1)
          return absl::InvalidArgumentError(mismatch());
        for (size_t q = 0; q < vd.size() && q < post.size(); ++q) {
          const int64_t v = vd[vd.size() - 1 - q],
                        w = post[post.size() - 1 - q];
          if (v != 1 && v != w) return absl::InvalidArgumentError(mismatch());
        }
        const int64_t rows_v = vd.size() == post.size() + 1 ? vd[0] : 1;
        int64_t rows = 1, payload = 1;
        for (int64_t m : md) rows *= m;
        for (int64_t p : post) payload *= p;
        std::vector<int64_t> vt = {rows_v}, flat = {rows};
        vt.insert(vt.end(), post.begin(), post.end());
        flat.insert(flat.end(), post.begin(), post.end());
        const HloType& i1 = *DTypeOf(tpu::DType::kBool);
        const HloType& i64 = I64();
        const HloType& mt = *DTypeOf(mr.dtype);
        absl::StatusOr<std::string> mv =
            l.OperandRef(mr, l.TensorIndex(list), md, mt);
        if (!mv.ok()) return mv;
        const std::string mb =
            l.Compare("NE", *mv, l.Constant(0, md, mt), md, mt);
        absl::StatusOr<std::string> value = l.Operand(values, vd, t);
        if (!value.ok()) return value;
        const std::string vv = l.BroadcastTo(*value, vd, vt, t);
        std::string vb;  // the value of every row, selected or not
        if (rows_v == 1) {
          vb = l.BroadcastTo(vv, vt, flat, t);
        } else {
          const std::string m1 = l.Reshape(mb, md, {rows}, i1);
          const std::string ones = l.Convert(m1, {rows}, i1, i64);
          const std::string count = l.ReduceOver(ones, {rows}, {0}, "add",
                                                 l.Constant(0, {}, i64), i64);
          l.CheckRange(
              l.Binary("subtract", count,
                       l.Constant(static_cast<double>(rows_v), {}, i64), {},
                       i64),
              {}, 1, mismatch());
          // Row r's value: the values' row (selected rows before r).
          const std::string k =
              l.Binary("subtract", Running(l, ones, {rows}, 0, "add", 0, i64),
                       ones, {rows}, i64);
          const std::string at = l.Reshape(
              l.Binary("minimum", k,
                       l.Constant(static_cast<double>(rows_v - 1), {rows}, i64),
                       {rows}, i64),
              {rows}, {rows, 1}, i64);
          vb = l.Constant(0, flat, t);  // (no values: no row is selected)
          if (rows_v > 0) {
            const std::string g = l.Emit(absl::StrCat(
                "\"stablehlo.gather\"(",
                l.Reshape(vv, vt, {rows_v, payload}, t), ", ", at,
                ") {dimension_numbers = #stablehlo.gather<offset_dims = [1], "
                "collapsed_slice_dims = [0], start_index_map = [0], "
                "index_vector_dim = 1>, indices_are_sorted = false, "
                "slice_sizes = array<i64: 1, ",
                payload, ">} : (", TypeOf({rows_v, payload}, t), ", ",
                TypeOf({rows, 1}, i64), ") -> ", TypeOf({rows, payload}, t)));
            vb = l.Reshape(g, {rows, payload}, flat, t);
          }
        }
        vb = l.Reshape(vb, flat, in, t);
        std::vector<int64_t> lead;
        for (size_t q = 0; q < md.size(); ++q)
          lead.push_back(static_cast<int64_t>(q));
        const std::string mask =
            l.Emit(absl::StrCat("stablehlo.broadcast_in_dim ", mb, ", dims = [",
                                absl::StrJoin(lead, ", "), "] : (",
                                TypeOf(md, i1), ") -> ", TypeOf(in, i1)));
        return l.Select(mask,
                        accumulate ? l.Binary("add", *self, vb, in, t) : vb,
                        *self, in, t);
      }
      absl::StatusOr<IndexPlan> p = PlanIndex(l, list, in);
      if (!p.ok()) return p.status();
      absl::StatusOr<std::string> vals = l.Operand(values, p->result, t);
      if (!vals.ok()) return vals;
      const std::string scalar = TypeOf({}, t);
      return l.Emit(absl::StrCat(
          "\"stablehlo.scatter\"(", *self, ", ", p->indices, ", ", *vals,
          ") ({\n", "    ^bb0(%old: ", scalar, ", %new: ", scalar, "):\n",
          accumulate
              ? absl::StrCat("      %sum = stablehlo.add %old, %new : ", scalar,
                             "\n      stablehlo.return %sum : ", scalar, "\n")
              : absl::StrCat("      stablehlo.return %new : ", scalar, "\n"),
          "    }) {indices_are_sorted = false, scatter_dimension_numbers = "
          "#stablehlo.scatter<update_window_dims = [",
          absl::StrJoin(p->window, ", "), "], inserted_window_dims = [",
          absl::StrJoin(p->indexed, ", "),
          "], scatter_dims_to_operand_dims = [",
          absl::StrJoin(p->indexed, ", "),
          "], index_vector_dim = ", p->batch.size(),
          ">, unique_indices = false} : (", TypeOf(in, t), ", ",
          p->indices_type, ", ", TypeOf(p->result, t), ") -> ", TypeOf(in, t)));
    };
    for (const char* name :
         {"aten::_index_put_impl_", "aten::index_put_", "aten::index_put",
          "aten::index_put.out", "aten::_index_put_impl",
          "aten::_index_put_impl.out"}) {
      reg.Add(name, put).TakesList();
    }
  }
  // scatter / scatter_add / scatter_reduce / index_reduce: self with
  // out[index[i][j]][j] combined with src[i][j] (dim 0): replaced, added,
  // multiplied, the larger or smaller kept, or averaged. src may be larger
  // than index, whose extent is what counts; index_reduce's index is one
  // list along `dim`, broadcast over source's other dimensions. Without
  // include_self, an element some index reaches starts from the combiner's
  // identity instead of self's value; mean divides by the count of what was
  // combined (flooring for integers, as the CPU kernel does).
  enum class Kind {
    kSrc,
    kValue,
    kAdd,
    kSrcReduce,
    kValueReduce,
    kScatterReduce,
    kIndexReduce
  };
  for (Kind kind :
       {Kind::kSrc, Kind::kValue, Kind::kAdd, Kind::kSrcReduce,
        Kind::kValueReduce, Kind::kScatterReduce, Kind::kIndexReduce}) {
    Rule r = [kind](Lowering& l, const tpu::DecodedOp& d,
                    const Target& o) -> absl::StatusOr<std::string> {
      const Args a(l);
      // The updates: a tensor (src, index_reduce's source) or a number.
      const char* const src_name =
          kind == Kind::kValue || kind == Kind::kValueReduce ? "value"
          : kind == Kind::kIndexReduce                       ? "source"
                                                             : "src";
      if (!a.Defined("self") || !a.Defined("index") || !a.Has(src_name))
        return Unsupported(l.op(), "arguments of a form not lowered");
      const tpu::OpArg& src = a[src_name];
      const HloType& t = *o.type;
      // A 0-d self (and its 0-d index and src) is taken as one element.
      const std::vector<int64_t> in =
          o.dims.empty() ? std::vector<int64_t>{1} : o.dims;
      const size_t n = in.size();
      auto done = [&](const std::string& v) {
        return l.Reshape(v, in, o.dims, t);
      };
      const tpu::TensorRef& ix = a["index"].tensor;
      // The reduction: "" (replace), "sum", "prod", "mean", "amax", "amin".
      std::string reduce = kind == Kind::kAdd ? "sum" : "";
      bool include_self = true;
      if (kind == Kind::kSrcReduce || kind == Kind::kValueReduce ||
          kind == Kind::kScatterReduce || kind == Kind::kIndexReduce) {
        const tpu::OpArg* how = a.Find("reduce");
        if (how == nullptr || how->tag != tpu::ArgTag::kString)
          return Unsupported(l.op(), "reduce must be a string");
        reduce = how->s;
        if (reduce == "add") reduce = "sum";
        if (reduce == "multiply") reduce = "prod";
        if (reduce != "sum" && reduce != "prod" && reduce != "mean" &&
            reduce != "amax" && reduce != "amin") {
          return absl::InvalidArgumentError(
              absl::StrCat(l.op(), ": reduce \"", how->s,
                           "\" is not one of sum, prod, mean, amax, amin"));
        }
        const tpu::OpArg* inc = a.Find("include_self");
        if (inc != nullptr && inc->tag == tpu::ArgTag::kBool)
          include_self = inc->b;
      }
      std::vector<int64_t> sd =
          kind == Kind::kValue || kind == Kind::kValueReduce
              ? DimsOf(ix)
              : (src.tag == tpu::ArgTag::kTensor ? DimsOf(src.tensor)
                                                 : std::vector<int64_t>{});
      if (sd.empty()) sd = {1};
      std::vector<int64_t> id = kind == Kind::kIndexReduce ? sd : DimsOf(ix);
      if (id.empty()) id = {1};
      if (Numel(ix) == 0 && kind != Kind::kIndexReduce) {
        // Nothing is scattered, whatever the empty index's rank (the
        // backward of gather with an empty index).
        absl::StatusOr<std::string> self = l.Operand(a["self"], in, t);
        if (!self.ok()) return self;
        return done(*self);
      }
      if (n == 0 || id.size() != n ||
          (kind == Kind::kIndexReduce && ix.ndim != 1)) {
        return Unsupported(l.op(), "arguments of a form not lowered");
      }
      absl::StatusOr<std::string> self = l.Operand(a["self"], in, t);
      if (!self.ok()) return self;
      absl::StatusOr<int64_t> checked = CheckedDim(l.op(), a["dim"].i, n);
      if (!checked.ok()) return checked.status();
      const int64_t dim = *checked;
      if (kind == Kind::kIndexReduce && id[dim] != ix.sizes[0]) {
        return absl::InvalidArgumentError(
            absl::StrCat(l.op(), ": index has ", ix.sizes[0],
                         " entries, source ", id[dim], " along dim ", dim));
      }
      if (Numel(ix) == 0) return done(*self);
      std::string upd;
      if (kind == Kind::kValue || kind == Kind::kValueReduce) {
        absl::StatusOr<std::string> v = l.Operand(src, id, t);
        if (!v.ok()) return v;
        upd = *v;
      } else {
        if (src.tag != tpu::ArgTag::kTensor)
          return Unsupported(l.op(), "arguments of a form not lowered");
        if (sd.size() != n) return Unsupported(l.op(), "src of another rank");
        absl::StatusOr<std::string> v = l.Operand(src, sd, t);
        if (!v.ok()) return v;
        upd = *v;
        if (sd != id) upd = l.Slice(upd, sd, std::vector<int64_t>(n, 0), id, t);
      }
      const HloType& i64 = I64();
      std::string along;
      if (kind == Kind::kIndexReduce) {
        absl::StatusOr<std::string> iv =
            l.OperandRef(ix, l.TensorIndex(a["index"]), {ix.sizes[0]}, i64);
        if (!iv.ok()) return iv;
        along = l.Emit(absl::StrCat(
            "stablehlo.broadcast_in_dim ", *iv, ", dims = [", dim, "] : (",
            TypeOf({ix.sizes[0]}, i64), ") -> ", TypeOf(id, i64)));
      } else {
        absl::StatusOr<std::string> iv =
            l.OperandRef(ix, l.TensorIndex(a["index"]), id, i64);
        if (!iv.ok()) return iv;
        along = *iv;
      }
      l.CheckRange(along, id, in[dim],
                   absl::StrCat("index out of bounds for dimension ", dim,
                                " with size ", in[dim]));
      std::vector<int64_t> all = id;
      all.push_back(static_cast<int64_t>(n));
      const std::string idx = ElementIndex(l, along, id, dim);
      const std::vector<int64_t> dims_list = Range(n);
      // base with the updates `u` (type ut) combined by `op` ("" replaces).
      auto scatter = [&](const std::string& base, const std::string& u,
                         const char* op, const HloType& ut) {
        const std::string scalar = TypeOf({}, ut);
        return l.Emit(absl::StrCat(
            "\"stablehlo.scatter\"(", base, ", ", idx, ", ", u, ") ({\n",
            "    ^bb0(%old: ", scalar, ", %new: ", scalar, "):\n",
            *op != 0
                ? absl::StrCat("      %r = stablehlo.", op,
                               " %old, %new : ", scalar,
                               "\n      stablehlo.return %r : ", scalar, "\n")
                : absl::StrCat("      stablehlo.return %new : ", scalar, "\n"),
            "    }) {indices_are_sorted = false, scatter_dimension_numbers = "
            "#stablehlo.scatter<",
            "inserted_window_dims = [", absl::StrJoin(dims_list, ", "),
            "], scatter_dims_to_operand_dims = [",
            absl::StrJoin(dims_list, ", "), "], index_vector_dim = ", n,
            ">, unique_indices = false} : (", TypeOf(in, ut), ", ",
            TypeOf(all, i64), ", ", TypeOf(id, ut), ") -> ", TypeOf(in, ut)));
      };
      if (reduce.empty()) return done(scatter(*self, upd, "", t));
      const char* op = reduce == "sum" || reduce == "mean" ? "add"
                       : reduce == "prod"                  ? "multiply"
                       : reduce == "amax"                  ? "maximum"
                                                           : "minimum";
      // How many updates reach each element.
      const std::string count =
          scatter(l.Constant(0, in, i64), l.Constant(1, id, i64), "add", i64);
      const std::string touched =
          l.Compare("GT", count, l.Constant(0, in, i64), in, i64);
      std::string base = *self;
      if (!include_self) {
        const std::string identity =
            reduce == "prod"   ? l.Constant(1, in, t)
            : reduce == "amax" ? l.BroadcastTo(l.Lowest(t), {}, in, t)
            : reduce == "amin" ? l.BroadcastTo(Highest(l, t), {}, in, t)
                               : l.Constant(0, in, t);
        base = l.Select(touched, identity, *self, in, t);
      }
      const std::string combined = scatter(base, upd, op, t);
      if (reduce != "mean") return done(combined);
      std::string denom = l.Convert(
          include_self ? l.Binary("add", count, l.Constant(1, in, i64), in, i64)
                       : count,
          in, i64, t);
      // Untouched elements keep self (divided by 1, or not at all).
      denom = l.Select(touched, denom, l.Constant(1, in, t), in, t);
      std::string q = l.Binary("divide", combined, denom, in, t);
      if (!t.is_float && t.dtype != tpu::DType::kBool) {
        // Floor: truncation one lower where the remainder is negative.
        const std::string rem = l.Binary("remainder", combined, denom, in, t);
        const std::string neg =
            l.Compare("LT", rem, l.Constant(0, in, t), in, t);
        q = l.Select(neg, l.Binary("subtract", q, l.Constant(1, in, t), in, t),
                     q, in, t);
      }
      return done(q);
    };
    const char* name =
        kind == Kind::kSrc             ? "aten::scatter.src"
        : kind == Kind::kValue         ? "aten::scatter.value"
        : kind == Kind::kAdd           ? "aten::scatter_add"
        : kind == Kind::kSrcReduce     ? "aten::scatter.reduce"
        : kind == Kind::kValueReduce   ? "aten::scatter.value_reduce"
        : kind == Kind::kScatterReduce ? "aten::scatter_reduce.two"
                                       : "aten::index_reduce";
    reg.Add(name, r);
  }
  reg.Alias("aten::_unsafe_index.Tensor", "aten::index.Tensor");
  // put_(self, index, source, accumulate): self flattened, source written
  // (or added) at the flat positions index gives (negative from the end).
  reg.Add(
      "aten::put_",
      [](Lowering& l, const tpu::DecodedOp& d,
         const Target& o) -> absl::StatusOr<std::string> {
        const Args a(l);
        if (!a.Has("accumulate") || !a.Defined("self") || !a.Defined("index") ||
            !a.Defined("source"))
          return Unsupported(l.op(), "arguments of a form not lowered");
        const HloType& t = *o.type;
        const HloType& i64 = I64();
        int64_t total = 1;
        for (int64_t s : o.dims) total *= s;
        const tpu::OpArg &index = a["index"], &source = a["source"];
        const int64_t n = Numel(index.tensor);
        absl::StatusOr<std::string> x = l.Operand(a["self"], o.dims, t);
        if (!x.ok() || n == 0) return x;
        if (Numel(source.tensor) != n)
          return absl::InvalidArgumentError(
              absl::StrCat(l.op(), ": source and index need as many elements"));
        absl::StatusOr<std::string> ix = l.Operand(index, DimsOf(index.tensor),
                                                   i64),
                                    src = l.Operand(source,
                                                    DimsOf(source.tensor), t);
        if (!ix.ok()) return ix;
        if (!src.ok()) return src;
        std::string idx = l.Reshape(*ix, DimsOf(index.tensor), {n}, i64);
        idx =
            l.Select(l.Compare("LT", idx, l.Constant(0, {n}, i64), {n}, i64),
                     l.Binary("add", idx,
                              l.Constant(static_cast<double>(total), {n}, i64),
                              {n}, i64),
                     idx, {n}, i64);
        l.CheckRange(idx, {n}, total,
                     absl::StrCat("an index is out of range for a tensor of ",
                                  total, " elements"));
        const tpu::OpArg& acc = a["accumulate"];
        const bool accumulate = acc.tag == tpu::ArgTag::kBool && acc.b;
        const std::string r = ScatterFlat(
            l, l.Reshape(*x, o.dims, {total}, t), total, idx,
            l.Reshape(*src, DimsOf(source.tensor), {n}, t), n, accumulate, t);
        return l.Reshape(r, {total}, o.dims, t);
      });
  // masked_scatter_(self, mask, source): the k-th selected element of self
  // (in order) becomes source's k-th.
  reg.Add(
      "aten::masked_scatter_",
      [](Lowering& l, const tpu::DecodedOp& d,
         const Target& o) -> absl::StatusOr<std::string> {
        const Args a(l);
        if (!a.Defined("self") || !a.Defined("mask") || !a.Defined("source"))
          return Unsupported(l.op(), "arguments of a form not lowered");
        const tpu::OpArg& source = a["source"];
        const HloType& t = *o.type;
        const HloType& i64 = I64();
        const HloType& i1 = *DTypeOf(tpu::DType::kBool);
        int64_t total = 1;
        for (int64_t s : o.dims) total *= s;
        const int64_t ns = Numel(source.tensor);
        absl::StatusOr<std::string> x = l.Operand(a["self"], o.dims, t),
                                    mk = l.Operand(a["mask"], o.dims, i1);
        if (!x.ok()) return x;
        if (!mk.ok()) return mk;
        if (total == 0 || ns == 0) return *x;
        absl::StatusOr<std::string> src =
            l.Operand(source, DimsOf(source.tensor), t);
        if (!src.ok()) return src;
        const std::vector<int64_t> flat = {total};
        const std::string mf = l.Reshape(*mk, o.dims, flat, i1);
        const std::string pos = l.Binary(
            "subtract",
            Running(l, l.Convert(mf, flat, i1, i64), flat, 0, "add", 0, i64),
            l.Constant(1, flat, i64), flat, i64);
        const std::string at = l.Reshape(
            l.Binary(
                "minimum",
                l.Binary("maximum", pos, l.Constant(0, flat, i64), flat, i64),
                l.Constant(static_cast<double>(ns - 1), flat, i64), flat, i64),
            flat, {total, 1}, i64);
        const std::string got = l.Emit(absl::StrCat(
            "\"stablehlo.gather\"(",
            l.Reshape(*src, DimsOf(source.tensor), {ns}, t), ", ", at,
            ") {dimension_numbers = #stablehlo.gather<collapsed_slice_dims = "
            "[0], start_index_map = [0], index_vector_dim = 1>, "
            "indices_are_sorted = false, slice_sizes = array<i64: 1>} : (",
            TypeOf({ns}, t), ", ", TypeOf({total, 1}, i64), ") -> ",
            TypeOf(flat, t)));
        return l.Select(*mk, l.Reshape(got, flat, o.dims, t), *x, o.dims, t);
      });
  // nonzero_static(self, *, size, fill_value): the first `size` positions
  // of nonzero elements, in order, the rest fill_value.
  reg.Add(
      "aten::nonzero_static",
      [](Lowering& l, const tpu::DecodedOp& d,
         const Target& o) -> absl::StatusOr<std::string> {
        const Args a(l);
        if (!a.Has("fill_value") || !a.Defined("self") || o.dims.size() != 2)
          return Unsupported(l.op(), "arguments of a form not lowered");
        const HloType& i64 = I64();
        const HloType& i1 = *DTypeOf(tpu::DType::kBool);
        const HloType* xt = DTypeOf(a["self"].tensor.dtype);
        if (xt == nullptr)
          return Unsupported(l.op(), "a dtype that is not lowered");
        const std::vector<int64_t> in = DimsOf(a["self"].tensor);
        const int64_t size = o.dims[0];
        int64_t total = 1;
        for (int64_t s : in) total *= s;
        const double fill = NumberOf(a["fill_value"]);
        if (size == 0 || o.dims[1] == 0) return l.Constant(fill, o.dims, i64);
        absl::StatusOr<std::string> x = l.Operand(a["self"], in, *xt);
        if (!x.ok()) return x;
        const int64_t len = std::max(total, size);
        const std::vector<int64_t> flat = {total};
        const std::string mf = l.Reshape(
            l.Compare("NE", *x, l.Constant(0, in, *xt), in, *xt), in, flat, i1);
        std::string key = l.Select(
            mf, l.Iota(0, flat, i64),
            l.Constant(static_cast<double>(total), flat, i64), flat, i64);
        if (len > total) {
          key = l.Emit(
              absl::StrCat("stablehlo.pad ", key, ", ",
                           l.Constant(static_cast<double>(total), {}, i64),
                           ", low = [0], high = [", len - total,
                           "], interior = [0] : (", TypeOf(flat, i64), ", ",
                           TypeOf({}, i64), ") -> ", TypeOf({len}, i64)));
        }
        const std::string keys = l.SliceAlong(
            l.Sort(key, {len}, 0, false, i64).first, {len}, 0, 0, size, i64);
        const std::vector<int64_t> sv = {size};
        const std::string missing =
            l.Compare("GE", keys,
                      l.Constant(static_cast<double>(total), sv, i64), sv, i64);
        std::vector<std::string> parts;
        int64_t stride = total;
        for (int64_t dsz : in) {
          stride /= dsz;
          const std::string c = l.Binary(
              "remainder",
              l.Binary("divide", keys,
                       l.Constant(static_cast<double>(stride), sv, i64), sv,
                       i64),
              l.Constant(static_cast<double>(dsz), sv, i64), sv, i64);
          parts.push_back(
              l.Select(missing, l.Constant(fill, sv, i64), c, sv, i64));
        }
        return l.Convert(StackIndices(l, parts, sv), o.dims, i64, *o.type);
      });
}

}  // namespace tpud::pjrt
