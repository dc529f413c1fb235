// The _foreach_ ops: one program for every element of the tensor lists.
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

void RegisterForeach(OpRegistry& reg) {
  // torch.optim's foreach paths: each written list element is one output.
  auto foreach =
      [](std::function<absl::StatusOr<std::string>(
             Lowering&, const tpu::DecodedOp&, const Target&, size_t e)>
             f) {
        return [f](Lowering& l, const tpu::DecodedOp& d,
                   const std::vector<Target>& outs)
                   -> absl::StatusOr<std::vector<std::string>> {
          std::vector<std::string> r;
          for (size_t e = 0; e < outs.size(); ++e) {
            absl::StatusOr<std::string> v = f(l, d, outs[e], e);
            if (!v.ok()) return v.status();
            r.push_back(*v);
          }
          return r;
        };
      };
  // Element e of list argument `name`, as a value of out's type and shape.
  auto elem = [](Lowering& l, const char* name, size_t e,
                 const Target& o) -> absl::StatusOr<std::string> {
    const tpu::OpArg* list = Args(l).Find(name);
    if (list == nullptr || list->tag != tpu::ArgTag::kTensorList ||
        e >= list->tensors.size()) {
      return Unsupported(l.op(), "list arguments of different lengths");
    }
    return l.OperandRef(list->tensors[e], l.TensorIndex(*list) + e, o.dims,
                        *o.type);
  };
  // Scalar argument `name` for element e: its e-th where it is a list.
  auto scalar = [](Lowering& l, const char* name, size_t e,
                   const Target& o) -> absl::StatusOr<std::string> {
    const tpu::OpArg* found = Args(l).Find(name);
    if (found == nullptr) return Unsupported(l.op(), "a scalar is missing");
    const tpu::OpArg& a = *found;
    if (a.tag == tpu::ArgTag::kDoubleList || a.tag == tpu::ArgTag::kIntList) {
      const size_t n =
          a.tag == tpu::ArgTag::kDoubleList ? a.doubles.size() : a.ints.size();
      if (e >= n)
        return Unsupported(l.op(),
                           "a scalar list shorter than the tensor list");
      tpu::OpArg one;
      one.tag = a.tag == tpu::ArgTag::kDoubleList ? tpu::ArgTag::kScalarDouble
                                                  : tpu::ArgTag::kScalarInt;
      one.d = a.tag == tpu::ArgTag::kDoubleList ? a.doubles[e] : 0;
      one.i = a.tag == tpu::ArgTag::kIntList ? a.ints[e] : 0;
      absl::StatusOr<std::string> s = l.Scalar(one, *o.type);
      if (!s.ok()) return s;
      return l.BroadcastTo(*s, {}, o.dims, *o.type);
    }
    return l.Operand(a, o.dims, *o.type);
  };
  for (const char* name :
       {"aten::_foreach_add_.Scalar", "aten::_foreach_mul_.Scalar",
        "aten::_foreach_div_.Scalar", "aten::_foreach_sub_.Scalar",
        "aten::_foreach_add_.ScalarList", "aten::_foreach_mul_.ScalarList",
        "aten::_foreach_div_.ScalarList", "aten::_foreach_sub_.ScalarList",
        "aten::_foreach_mul_.Tensor", "aten::_foreach_add_.Tensor",
        "aten::_foreach_add_.List", "aten::_foreach_mul_.List",
        "aten::_foreach_div_.List", "aten::_foreach_sub_.List"}) {
    const std::string n = name;
    const char* op = absl::StrContains(n, "add")   ? "add"
                     : absl::StrContains(n, "sub") ? "subtract"
                     : absl::StrContains(n, "mul") ? "multiply"
                                                   : "divide";
    const bool list = absl::EndsWith(n, ".List");
    const bool alpha = absl::EndsWith(n, ".Tensor") || list;
    const char* other = alpha                              ? "other"
                        : absl::EndsWith(n, ".ScalarList") ? "scalars"
                                                           : "scalar";
    reg.AddMulti(
        n, foreach ([=](Lowering& l, const tpu::DecodedOp&, const Target& o,
                        size_t e) -> absl::StatusOr<std::string> {
          absl::StatusOr<std::string> a = elem(l, "self", e, o);
          if (!a.ok()) return a;
          absl::StatusOr<std::string> b =
              list ? elem(l, other, e, o) : scalar(l, other, e, o);
          if (!b.ok()) return b;
          std::string rhs = *b;
          const tpu::OpArg* by = alpha ? Args(l).Find("alpha") : nullptr;
          if (by != nullptr && NumberOf(*by) != 1.0) {
            absl::StatusOr<std::string> s = l.Operand(*by, o.dims, *o.type);
            if (!s.ok()) return s;
            rhs = l.Binary("multiply", rhs, *s, o.dims, *o.type);
          }
          return l.Binary(op, *a, rhs, o.dims, *o.type);
        }));
  }
  // self + value * t1 (op) t2
  for (const char* name :
       {"aten::_foreach_addcmul_.Scalar", "aten::_foreach_addcdiv_.Scalar",
        "aten::_foreach_addcmul_.ScalarList",
        "aten::_foreach_addcdiv_.ScalarList"}) {
    const std::string n = name;
    const char* op = absl::StrContains(n, "addcmul") ? "multiply" : "divide";
    const char* value = absl::EndsWith(n, ".ScalarList") ? "scalars" : "value";
    reg.AddMulti(
        n, foreach ([=](Lowering& l, const tpu::DecodedOp&, const Target& o,
                        size_t e) -> absl::StatusOr<std::string> {
          absl::StatusOr<std::string> a = elem(l, "self", e, o),
                                      b = elem(l, "tensor1", e, o),
                                      c = elem(l, "tensor2", e, o);
          for (auto* v : {&a, &b, &c})
            if (!v->ok()) return *v;
          std::string prod = l.Binary(op, *b, *c, o.dims, *o.type);
          if (Args(l).Has(value)) {
            absl::StatusOr<std::string> s = scalar(l, value, e, o);
            if (!s.ok()) return s;
            prod = l.Binary("multiply", prod, *s, o.dims, *o.type);
          }
          return l.Binary("add", *a, prod, o.dims, *o.type);
        }));
  }
  reg.AddMulti("aten::_foreach_lerp_.Scalar",
               foreach ([=](Lowering& l, const tpu::DecodedOp&, const Target& o,
                            size_t e) -> absl::StatusOr<std::string> {
                 absl::StatusOr<std::string> a = elem(l, "self", e, o),
                                             b = elem(l, "tensors1", e, o),
                                             w = scalar(l, "weight", e, o);
                 for (auto* v : {&a, &b, &w})
                   if (!v->ok()) return *v;
                 return l.Binary(
                     "add", *a,
                     l.Binary("multiply", *w,
                              l.Binary("subtract", *b, *a, o.dims, *o.type),
                              o.dims, *o.type),
                     o.dims, *o.type);
               }));
  for (const auto& [name, op] :
       std::vector<std::pair<std::string, const char*>>{{"sqrt", "sqrt"},
                                                        {"neg", "negate"},
                                                        {"exp", "exponential"},
                                                        {"abs", "abs"}}) {
    for (const char* suffix : {"", "_"}) {
      const char* hlo = op;
      reg.AddMulti(
          "aten::_foreach_" + name + suffix,
          foreach ([=](Lowering& l, const tpu::DecodedOp&, const Target& o,
                       size_t e) -> absl::StatusOr<std::string> {
            absl::StatusOr<std::string> a = elem(l, "self", e, o);
            if (!a.ok()) return a;
            return l.Unary(hlo, *a, o.dims, *o.type);
          }));
    }
  }
}

}  // namespace tpud::pjrt
