// Ops that rearrange or make tensors: cat, arange, flip, roll.
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

void RegisterShape(OpRegistry& reg) {
  reg.AddMulti(
      "aten::cat",
      [](Lowering& l, const tpu::DecodedOp&, const std::vector<Target>& outs)
          -> absl::StatusOr<std::vector<std::string>> {
        // (tensors, dim): one output; legacy empty 1-d inputs are skipped.
        const Args a(l);
        const tpu::OpArg* list = a.Find("tensors");
        if (outs.size() != 1 || list == nullptr ||
            list->tag != tpu::ArgTag::kTensorList) {
          return Unsupported(l.op(), "expects a list of tensors");
        }
        const Target& o = outs[0];
        const int64_t dim = WrapDim(a.Int("dim", 0), o.dims.size());
        std::vector<std::string> parts, types;
        for (size_t e = 0; e < list->tensors.size(); ++e) {
          const tpu::TensorRef& r = list->tensors[e];
          if (Numel(r) == 0) continue;
          const std::vector<int64_t> dims = DimsOf(r);
          absl::StatusOr<std::string> v =
              l.OperandRef(r, l.TensorIndex(*list) + e, dims, *o.type);
          if (!v.ok()) return v.status();
          parts.push_back(*v);
          types.push_back(TypeOf(dims, *o.type));
        }
        if (parts.empty())
          return std::vector<std::string>{l.Constant(0, o.dims, *o.type)};
        if (parts.size() == 1) return parts;
        return std::vector<std::string>{l.Emit(
            absl::StrCat("stablehlo.concatenate ", absl::StrJoin(parts, ", "),
                         ", dim = ", dim, " : (", absl::StrJoin(types, ", "),
                         ") -> ", TypeOf(o.dims, *o.type)))};
      });
  // arange.start_out(start, end, step, *, out): start + i * step, computed
  // in double (integers in int64) as the CPU kernel does.
  reg.Add("aten::arange.start_out",
          [](Lowering& l, const tpu::DecodedOp&,
             const Target& o) -> absl::StatusOr<std::string> {
            const Args a(l);
            if (!a.Has("start") || !a.Has("step") || o.dims.size() != 1)
              return Unsupported(l.op(), "arguments of a form not lowered");
            const HloType& w = o.type->is_float ? F64() : I64();
            absl::StatusOr<std::string> start =
                                            l.Operand(a["start"], o.dims, w),
                                        step = l.Operand(a["step"], o.dims, w);
            if (!start.ok()) return start;
            if (!step.ok()) return step;
            const std::string v = l.Binary(
                "add", *start,
                l.Binary("multiply", l.Iota(0, o.dims, w), *step, o.dims, w),
                o.dims, w);
            return l.Convert(v, o.dims, w, *o.type);
          });
  reg.Add("aten::flip",
          [](Lowering& l, const tpu::DecodedOp&,
             const Target& o) -> absl::StatusOr<std::string> {
            const Args a(l);
            if (!a.Defined("self") || !a.Has("dims") ||
                a["dims"].tag != tpu::ArgTag::kIntList)
              return Unsupported(l.op(), "arguments of a form not lowered");
            absl::StatusOr<std::string> x =
                l.Operand(a["self"], o.dims, *o.type);
            if (!x.ok()) return x;
            absl::StatusOr<std::vector<int64_t>> which =
                ReducedDims(l, &a["dims"], o.dims.size());
            if (!which.ok()) return which.status();
            if (a["dims"].ints.empty() || which->empty()) return *x;
            return l.Emit(absl::StrCat("stablehlo.reverse ", *x, ", dims = [",
                                       absl::StrJoin(*which, ", "),
                                       "] : ", TypeOf(o.dims, *o.type)));
          });
  // roll(self, shifts, dims): each dim rotated by its shift (no dims: the
  // flattened tensor), as two slices joined.
  reg.Add(
      "aten::roll",
      [](Lowering& l, const tpu::DecodedOp&,
         const Target& o) -> absl::StatusOr<std::string> {
        const Args a(l);
        if (!a.Defined("self") || !a.Has("shifts") || !a.Has("dims"))
          return Unsupported(l.op(), "arguments of a form not lowered");
        const HloType& t = *o.type;
        absl::StatusOr<std::string> x = l.Operand(a["self"], o.dims, t);
        if (!x.ok()) return x;
        const std::vector<int64_t>& shifts = a["shifts"].ints;
        std::vector<int64_t> dims = a["dims"].ints;
        std::vector<int64_t> in = o.dims;
        std::string v = *x;
        const bool flat = dims.empty();
        int64_t total = 1;
        for (int64_t s : in) total *= s;
        if (flat) {
          if (shifts.size() != 1)
            return absl::InvalidArgumentError(
                absl::StrCat(l.op(), ": shifts and dims must match"));
          v = l.Reshape(v, in, {total}, t);
          in = {total};
          dims = {0};
        }
        if (shifts.size() != dims.size())
          return absl::InvalidArgumentError(
              absl::StrCat(l.op(), ": shifts and dims must match"));
        for (size_t q = 0; q < dims.size(); ++q) {
          absl::StatusOr<int64_t> dim = CheckedDim(l.op(), dims[q], in.size());
          if (!dim.ok()) return dim.status();
          const int64_t size = in[*dim];
          if (size == 0) continue;
          const int64_t sh = ((shifts[q] % size) + size) % size;
          if (sh == 0) continue;
          const std::string tail =
                                l.SliceAlong(v, in, *dim, size - sh, size, t),
                            head = l.SliceAlong(v, in, *dim, 0, size - sh, t);
          std::vector<int64_t> td = in, hd = in;
          td[*dim] = sh;
          hd[*dim] = size - sh;
          v = l.Emit(absl::StrCat("stablehlo.concatenate ", tail, ", ", head,
                                  ", dim = ", *dim, " : (", TypeOf(td, t), ", ",
                                  TypeOf(hd, t), ") -> ", TypeOf(in, t)));
        }
        return flat ? l.Reshape(v, in, o.dims, t) : v;
      });
  // out= overloads whose names are not the derived ones (the out tensor
  // is the written argument, after the others).
  reg.Alias("aten::cat.out", "aten::cat");
}

}  // namespace tpud::pjrt
