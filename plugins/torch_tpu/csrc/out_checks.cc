// out_checks.h: a table from out= op names to their C++ meta functions.
#include "out_checks.h"

#include <ATen/ATen.h>
#include <ATen/MetaFunctions.h>
#include <c10/util/Exception.h>

#include <string>
#include <unordered_map>

#include "boxed_call.h"

namespace torch_tpu {
namespace {

using Stack = torch::jit::Stack;

at::Tensor& T(Stack& s, size_t i) {
  // IValue hands out a reference to its tensor; the meta functions write
  // (resize) the out= ones, which are meta stand-ins.
  return s[i].toTensor();
}
int64_t I(const Stack& s, size_t i) { return s[i].toInt(); }
bool B(const Stack& s, size_t i) { return s[i].toBool(); }

// A device tensor as a meta one of the same dtype, shape and strides; a CPU
// 0-dim tensor (a scalar operand) too. Other host values stay.
at::Tensor MetaOf(const at::Tensor& t) {
  if (!t.defined() || (t.device().is_cpu() && t.dim() != 0)) return t;
  return at::empty_strided(t.sizes(), t.strides(),
                           t.options().device(c10::kMeta));
}
c10::IValue MetaOf(const c10::IValue& v) {
  if (v.isTensor()) return MetaOf(v.toTensor());
  if (v.isTensorList()) {
    c10::List<at::Tensor> list;
    for (const at::Tensor& t : v.toTensorList()) list.push_back(MetaOf(t));
    return list;
  }
  return v;
}

// ATen's checks of an out= op whose meta function takes the schema's
// arguments in order (the *_outf form).
template <auto F>
void Check(Stack& s) {
  CallWithStackArguments<F>(&s);
}

// The meta functions resize a misshapen out= stand-in and warn that they
// did; the real op warns once, later, for the real tensor.
class Quiet : public c10::WarningHandler {
 public:
  void process(const c10::Warning&) override {}
};

const std::unordered_map<std::string, OutCheck>& Table() {
  static const auto* table = new std::unordered_map<std::string, OutCheck>{
      // Iterator ops whose out= tensor must be bool.
      {"aten::isposinf.out", &Check<&at::meta::isposinf_outf>},
      {"aten::isneginf.out", &Check<&at::meta::isneginf_outf>},
      {"aten::signbit.out", &Check<&at::meta::signbit_outf>},
      // frexp's kernel checks its outputs before it computes.
      {"aten::frexp.Tensor_out",
       [](Stack& s) {
         const at::Tensor& self = T(s, 0);
         TORCH_CHECK(at::isFloatingType(self.scalar_type()),
                     "torch.frexp() only supports floating-point dtypes");
         TORCH_CHECK(T(s, 1).dtype() == self.dtype(),
                     "torch.frexp() expects mantissa to have dtype ",
                     self.dtype(), " but got ", T(s, 1).dtype());
         TORCH_CHECK(T(s, 2).scalar_type() == at::kInt,
                     "torch.frexp() expects exponent to have int dtype but "
                     "got ",
                     T(s, 2).dtype());
       }},
      // cat's out= tensor takes what the inputs' common dtype casts to (a
      // TypeError otherwise), on the inputs' device.
      {"aten::cat.out", &Check<&at::meta::cat_outf>},
      // Matrix products: out= of the result's dtype.
      {"aten::mm.out", &Check<&at::meta::mm_outf>},
      {"aten::bmm.out", &Check<&at::meta::bmm_outf>},
      {"aten::addmm.out", &Check<&at::meta::addmm_outf>},
      {"aten::baddbmm.out", &Check<&at::meta::baddbmm_outf>},
      {"aten::addmv.out", &Check<&at::meta::addmv_outf>},
      // Values and their indices: indices are int64. (sort.values has no
      // `stable` argument; the meta function does.)
      {"aten::sort.values",
       [](Stack& s) {
         at::meta::sort_out(T(s, 3), T(s, 4), T(s, 0), false, I(s, 1), B(s, 2));
       }},
      {"aten::sort.values_stable", &Check<&at::meta::sort_outf>},
      {"aten::topk.values", &Check<&at::meta::topk_outf>},
      {"aten::max.dim_max", &Check<&at::meta::max_outf>},
      {"aten::min.dim_min", &Check<&at::meta::min_outf>},
      {"aten::argmax.out", &Check<&at::meta::argmax_outf>},
      {"aten::argmin.out", &Check<&at::meta::argmin_outf>},
      {"aten::aminmax.out", &Check<&at::meta::aminmax_outf>},
  };
  return *table;
}

}  // namespace

OutCheck FindOutCheck(const c10::OperatorName& name) {
  const auto& table = Table();
  auto it = table.find(name.overload_name.empty()
                           ? name.name
                           : name.name + "." + name.overload_name);
  return it == table.end() ? nullptr : it->second;
}

void RunOutCheck(OutCheck check, c10::ArrayRef<c10::IValue> args) {
  Stack meta;
  meta.reserve(args.size());
  for (const c10::IValue& v : args) meta.push_back(MetaOf(v));
  Quiet quiet;
  c10::WarningUtils::WarningHandlerGuard guard(&quiet);
  check(meta);
}

}  // namespace torch_tpu
