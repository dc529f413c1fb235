// The table of C++ meta functions (native_meta.h). Each entry reads the
// boxed arguments of its op's schema, calls ATen's meta function (or, for
// where, builds the TensorIterator the CPU kernel builds, over meta tensors)
// and leaves the results on the stack.
#include "native_meta.h"

#include <ATen/ATen.h>
#include <ATen/MetaFunctions.h>
#include <ATen/ScalarOps.h>
#include <ATen/TensorIterator.h>
#include <ATen/native/Padding.h>
#include <ATen/native/TensorFactories.h>
#include <ATen/native/layer_norm.h>

#include <optional>
#include <string>
#include <tuple>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

#include "native_meta_structured.h"

namespace torch_tpu {
namespace {

using Stack = torch::jit::Stack;

const at::Tensor& T(const Stack& s, size_t i) { return s[i].toTensor(); }
at::Scalar S(const Stack& s, size_t i) { return s[i].toScalar(); }
int64_t I(const Stack& s, size_t i) { return s[i].toInt(); }
bool B(const Stack& s, size_t i) { return s[i].toBool(); }
std::optional<at::ScalarType> Dtype(const Stack& s, size_t i) {
  return s[i].toOptional<at::ScalarType>();
}
std::optional<std::vector<int64_t>> Dims(const Stack& s, size_t i) {
  if (s[i].isNone()) return std::nullopt;
  return s[i].toIntVector();
}
at::OptionalIntArrayRef Ref(const std::optional<std::vector<int64_t>>& d) {
  if (!d) return std::nullopt;
  return at::IntArrayRef(*d);
}
// A Python number as ATen's Scalar overloads pass it on: a 0-d CPU tensor
// marked as a wrapped number (it does not decide the result's dtype).
at::Tensor Wrapped(const Stack& s, size_t i) {
  return at::native::wrapped_scalar_tensor(S(s, i));
}

void Put(Stack* s, at::Tensor r) {
  s->clear();
  s->emplace_back(std::move(r));
}
void Put(Stack* s, std::tuple<at::Tensor, at::Tensor> r) {
  s->clear();
  s->emplace_back(std::move(std::get<0>(r)));
  s->emplace_back(std::move(std::get<1>(r)));
}

using Table = std::unordered_map<std::string, NativeMetaFn>;

void AddArithmetic(Table& t) {
  // self op other (* alpha): the Tensor forms, then the Scalar ones.
  t["aten::add.Tensor"] = [](Stack* s) {
    Put(s, at::meta::add(T(*s, 0), T(*s, 1), S(*s, 2)));
  };
  t["aten::sub.Tensor"] = [](Stack* s) {
    Put(s, at::meta::sub(T(*s, 0), T(*s, 1), S(*s, 2)));
  };
  t["aten::add.Scalar"] = [](Stack* s) {
    Put(s, at::meta::add(T(*s, 0), Wrapped(*s, 1), S(*s, 2)));
  };
  t["aten::sub.Scalar"] = [](Stack* s) {
    Put(s, at::meta::sub(T(*s, 0), Wrapped(*s, 1), S(*s, 2)));
  };
  // rsub(self, other, alpha) = other - alpha * self.
  t["aten::rsub.Scalar"] = [](Stack* s) {
    Put(s, at::meta::sub(Wrapped(*s, 1), T(*s, 0), S(*s, 2)));
  };
  t["aten::rsub.Tensor"] = [](Stack* s) {
    Put(s, at::meta::sub(T(*s, 1), T(*s, 0), S(*s, 2)));
  };
  t["aten::add_.Tensor"] = [](Stack* s) {
    at::Tensor self = T(*s, 0);
    at::meta::add_(self, T(*s, 1), S(*s, 2));
    Put(s, self);
  };
  t["aten::sub_.Tensor"] = [](Stack* s) {
    at::Tensor self = T(*s, 0);
    at::meta::sub_(self, T(*s, 1), S(*s, 2));
    Put(s, self);
  };
  t["aten::add_.Scalar"] = [](Stack* s) {
    at::Tensor self = T(*s, 0);
    at::meta::add_(self, Wrapped(*s, 1), S(*s, 2));
    Put(s, self);
  };
  t["aten::sub_.Scalar"] = [](Stack* s) {
    at::Tensor self = T(*s, 0);
    at::meta::sub_(self, Wrapped(*s, 1), S(*s, 2));
    Put(s, self);
  };
  t["aten::mul.Tensor"] = [](Stack* s) {
    Put(s, at::meta::mul(T(*s, 0), T(*s, 1)));
  };
  t["aten::div.Tensor"] = [](Stack* s) {
    Put(s, at::meta::div(T(*s, 0), T(*s, 1)));
  };
  t["aten::mul.Scalar"] = [](Stack* s) {
    Put(s, at::meta::mul(T(*s, 0), Wrapped(*s, 1)));
  };
  t["aten::div.Scalar"] = [](Stack* s) {
    Put(s, at::meta::div(T(*s, 0), Wrapped(*s, 1)));
  };
  t["aten::mul_.Tensor"] = [](Stack* s) {
    at::Tensor self = T(*s, 0);
    at::meta::mul_(self, T(*s, 1));
    Put(s, self);
  };
  t["aten::div_.Tensor"] = [](Stack* s) {
    at::Tensor self = T(*s, 0);
    at::meta::div_(self, T(*s, 1));
    Put(s, self);
  };
  t["aten::mul_.Scalar"] = [](Stack* s) {
    at::Tensor self = T(*s, 0);
    at::meta::mul_(self, Wrapped(*s, 1));
    Put(s, self);
  };
  t["aten::div_.Scalar"] = [](Stack* s) {
    at::Tensor self = T(*s, 0);
    at::meta::div_(self, Wrapped(*s, 1));
    Put(s, self);
  };
  t["aten::div.Tensor_mode"] = [](Stack* s) {
    std::optional<c10::string_view> mode;
    if (!(*s)[2].isNone()) mode = (*s)[2].toStringView();
    Put(s, at::meta::div(T(*s, 0), T(*s, 1), mode));
  };
  t["aten::remainder.Tensor"] = [](Stack* s) {
    Put(s, at::meta::remainder(T(*s, 0), T(*s, 1)));
  };
  t["aten::remainder.Scalar"] = [](Stack* s) {
    Put(s, at::meta::remainder(T(*s, 0), Wrapped(*s, 1)));
  };
  t["aten::pow.Tensor_Tensor"] = [](Stack* s) {
    Put(s, at::meta::pow(T(*s, 0), T(*s, 1)));
  };
  t["aten::pow.Tensor_Scalar"] = [](Stack* s) {
    Put(s, at::meta::pow(T(*s, 0), S(*s, 1)));
  };
  t["aten::pow_.Scalar"] = [](Stack* s) {
    at::Tensor self = T(*s, 0);
    at::meta::pow_(self, S(*s, 1));
    Put(s, self);
  };
  t["aten::maximum"] = [](Stack* s) {
    Put(s, at::meta::maximum(T(*s, 0), T(*s, 1)));
  };
  t["aten::minimum"] = [](Stack* s) {
    Put(s, at::meta::minimum(T(*s, 0), T(*s, 1)));
  };
  t["aten::atan2"] = [](Stack* s) {
    Put(s, at::meta::atan2(T(*s, 0), T(*s, 1)));
  };
  // Comparisons give bool.
#define TPU_COMPARISON(op)                    \
  t["aten::" #op ".Tensor"] = [](Stack* s) {  \
    Put(s, at::meta::op(T(*s, 0), T(*s, 1))); \
  };                                          \
  t["aten::" #op ".Scalar"] = [](Stack* s) {  \
    Put(s, at::meta::op(T(*s, 0), S(*s, 1))); \
  };
  TPU_COMPARISON(eq)
  TPU_COMPARISON(ne)
  TPU_COMPARISON(lt)
  TPU_COMPARISON(le)
  TPU_COMPARISON(gt)
  TPU_COMPARISON(ge)
#undef TPU_COMPARISON
}

void AddUnary(Table& t) {
  // f(self), and f_(self) in place.
#define TPU_UNARY(op)                                                 \
  t["aten::" #op] = [](Stack* s) { Put(s, at::meta::op(T(*s, 0))); }; \
  t["aten::" #op "_"] = [](Stack* s) {                                \
    at::Tensor self = T(*s, 0);                                       \
    at::meta::op##_(self);                                            \
    Put(s, self);                                                     \
  };
  TPU_UNARY(neg)
  TPU_UNARY(exp)
  TPU_UNARY(exp2)
  TPU_UNARY(expm1)
  TPU_UNARY(log)
  TPU_UNARY(log2)
  TPU_UNARY(log10)
  TPU_UNARY(log1p)
  TPU_UNARY(sqrt)
  TPU_UNARY(rsqrt)
  TPU_UNARY(reciprocal)
  TPU_UNARY(sin)
  TPU_UNARY(cos)
  TPU_UNARY(tan)
  TPU_UNARY(tanh)
  TPU_UNARY(sigmoid)
  TPU_UNARY(erf)
  TPU_UNARY(floor)
  TPU_UNARY(ceil)
  TPU_UNARY(round)
  TPU_UNARY(trunc)
  TPU_UNARY(frac)
  TPU_UNARY(sign)
  TPU_UNARY(silu)
#undef TPU_UNARY
  // relu is clamp_min(self, 0) in ATen, after refusing bool.
  t["aten::relu"] = [](Stack* s) {
    TORCH_CHECK(T(*s, 0).scalar_type() != at::kBool,
                "Boolean inputs not supported for relu");
    Put(s, at::meta::clamp_min(T(*s, 0), 0));
  };
  t["aten::relu_"] = [](Stack* s) {
    TORCH_CHECK(T(*s, 0).scalar_type() != at::kBool,
                "Boolean inputs not supported for relu");
    at::Tensor self = T(*s, 0);
    at::meta::clamp_min_(self, 0);
    Put(s, self);
  };
  t["aten::gelu"] = [](Stack* s) {
    Put(s, at::meta::gelu(T(*s, 0), (*s)[1].toStringView()));
  };
  t["aten::clamp"] = [](Stack* s) {
    Put(s, at::meta::clamp(T(*s, 0), (*s)[1].toOptional<at::Scalar>(),
                           (*s)[2].toOptional<at::Scalar>()));
  };
  t["aten::clamp_min"] = [](Stack* s) {
    Put(s, at::meta::clamp_min(T(*s, 0), S(*s, 1)));
  };
  t["aten::clamp_max"] = [](Stack* s) {
    Put(s, at::meta::clamp_max(T(*s, 0), S(*s, 1)));
  };
  // Backward of activations: (grad_output, output or self, ...).
  t["aten::threshold_backward"] = [](Stack* s) {
    Put(s, at::meta::threshold_backward(T(*s, 0), T(*s, 1), S(*s, 2)));
  };
  t["aten::sigmoid_backward"] = [](Stack* s) {
    Put(s, at::meta::sigmoid_backward(T(*s, 0), T(*s, 1)));
  };
  t["aten::tanh_backward"] = [](Stack* s) {
    Put(s, at::meta::tanh_backward(T(*s, 0), T(*s, 1)));
  };
  t["aten::silu_backward"] = [](Stack* s) {
    Put(s, at::meta::silu_backward(T(*s, 0), T(*s, 1)));
  };
  t["aten::gelu_backward"] = [](Stack* s) {
    Put(s, at::meta::gelu_backward(T(*s, 0), T(*s, 1), (*s)[2].toStringView()));
  };
}

void AddPointwiseOthers(Table& t) {
  t["aten::lerp.Scalar"] = [](Stack* s) {
    Put(s, at::meta::lerp(T(*s, 0), T(*s, 1), S(*s, 2)));
  };
  t["aten::lerp_.Scalar"] = [](Stack* s) {
    at::Tensor self = T(*s, 0);
    at::meta::lerp_(self, T(*s, 1), S(*s, 2));
    Put(s, self);
  };
  t["aten::addcmul"] = [](Stack* s) {
    Put(s, at::meta::addcmul(T(*s, 0), T(*s, 1), T(*s, 2), S(*s, 3)));
  };
  t["aten::addcmul_"] = [](Stack* s) {
    at::Tensor self = T(*s, 0);
    at::meta::addcmul_(self, T(*s, 1), T(*s, 2), S(*s, 3));
    Put(s, self);
  };
  t["aten::addcdiv"] = [](Stack* s) {
    Put(s, at::meta::addcdiv(T(*s, 0), T(*s, 1), T(*s, 2), S(*s, 3)));
  };
  t["aten::addcdiv_"] = [](Stack* s) {
    at::Tensor self = T(*s, 0);
    at::meta::addcdiv_(self, T(*s, 1), T(*s, 2), S(*s, 3));
    Put(s, self);
  };
}

// where(condition, self, other) has no meta function: its CPU kernel's
// iterator over the promoted inputs, into an empty result of their common
// dtype that the iterator resizes, gives the result's shape and strides.
void AddWhere(Table& t) {
  t["aten::where.self"] = [](Stack* s) {
    const at::Tensor& cond = T(*s, 0);
    TORCH_CHECK(cond.scalar_type() == at::kBool,
                "where expected condition to be a boolean tensor, but got a "
                "tensor with dtype ",
                cond.scalar_type());
    const at::ScalarType type = at::result_type(T(*s, 1), T(*s, 2));
    const at::Tensor self = T(*s, 1).to(type), other = T(*s, 2).to(type);
    at::Tensor out = at::empty({0}, at::TensorOptions(at::kMeta).dtype(type));
    at::TensorIterator iter = at::TensorIteratorConfig()
                                  .check_all_same_dtype(false)
                                  .add_output(out)
                                  .add_const_input(cond)
                                  .add_const_input(self)
                                  .add_const_input(other)
                                  .build();
    Put(s, iter.output());
  };
}

// hardswish and its backward are TensorIterator ops without a meta
// function: their CPU kernels' iterators, over meta tensors, into results
// the iterators allocate.
void AddIteratorOps(Table& t) {
  t["aten::hardswish"] = [](Stack* s) {
    at::Tensor out;
    at::TensorIterator iter = at::TensorIterator::unary_op(out, T(*s, 0));
    Put(s, iter.output());
  };
  t["aten::hardswish_backward"] = [](Stack* s) {
    at::Tensor out;
    at::TensorIterator iter =
        at::TensorIterator::borrowing_binary_op(out, T(*s, 0), T(*s, 1));
    Put(s, iter.output());
  };
}

void AddReductions(Table& t) {
  t["aten::sum"] = [](Stack* s) {
    Put(s, at::meta::sum(T(*s, 0), at::IntArrayRef{}, false, Dtype(*s, 1)));
  };
  t["aten::sum.dim_IntList"] = [](Stack* s) {
    const auto dims = Dims(*s, 1);
    Put(s, at::meta::sum(T(*s, 0), Ref(dims), B(*s, 2), Dtype(*s, 3)));
  };
  t["aten::mean"] = [](Stack* s) {
    Put(s, at::meta::mean(T(*s, 0), at::IntArrayRef{}, false, Dtype(*s, 1)));
  };
  t["aten::mean.dim"] = [](Stack* s) {
    const auto dims = Dims(*s, 1);
    Put(s, at::meta::mean(T(*s, 0), Ref(dims), B(*s, 2), Dtype(*s, 3)));
  };
  t["aten::amax"] = [](Stack* s) {
    const std::vector<int64_t> dims = (*s)[1].toIntVector();
    Put(s, at::meta::amax(T(*s, 0), dims, B(*s, 2)));
  };
  t["aten::amin"] = [](Stack* s) {
    const std::vector<int64_t> dims = (*s)[1].toIntVector();
    Put(s, at::meta::amin(T(*s, 0), dims, B(*s, 2)));
  };
  t["aten::argmax"] = [](Stack* s) {
    Put(s, at::meta::argmax(T(*s, 0), (*s)[1].toOptional<int64_t>(), B(*s, 2)));
  };
  t["aten::argmin"] = [](Stack* s) {
    Put(s, at::meta::argmin(T(*s, 0), (*s)[1].toOptional<int64_t>(), B(*s, 2)));
  };
  t["aten::max.dim"] = [](Stack* s) {
    Put(s, at::meta::max(T(*s, 0), I(*s, 1), B(*s, 2)));
  };
  t["aten::min.dim"] = [](Stack* s) {
    Put(s, at::meta::min(T(*s, 0), I(*s, 1), B(*s, 2)));
  };
  t["aten::any"] = [](Stack* s) { Put(s, at::meta::any(T(*s, 0))); };
  t["aten::all"] = [](Stack* s) { Put(s, at::meta::all(T(*s, 0))); };
  t["aten::any.dim"] = [](Stack* s) {
    Put(s, at::meta::any(T(*s, 0), I(*s, 1), B(*s, 2)));
  };
  t["aten::all.dim"] = [](Stack* s) {
    Put(s, at::meta::all(T(*s, 0), I(*s, 1), B(*s, 2)));
  };
  t["aten::cumsum"] = [](Stack* s) {
    Put(s, at::meta::cumsum(T(*s, 0), I(*s, 1), Dtype(*s, 2)));
  };
  t["aten::linalg_vector_norm"] = [](Stack* s) {
    const auto dims = Dims(*s, 2);
    Put(s, at::meta::linalg_vector_norm(T(*s, 0), S(*s, 1), Ref(dims), B(*s, 3),
                                        Dtype(*s, 4)));
  };
  t["aten::_softmax"] = [](Stack* s) {
    Put(s, at::meta::_softmax(T(*s, 0), I(*s, 1), B(*s, 2)));
  };
  t["aten::_log_softmax"] = [](Stack* s) {
    Put(s, at::meta::_log_softmax(T(*s, 0), I(*s, 1), B(*s, 2)));
  };
  t["aten::_softmax_backward_data"] = [](Stack* s) {
    Put(s, at::meta::_softmax_backward_data(T(*s, 0), T(*s, 1), I(*s, 2),
                                            (*s)[3].toScalarType()));
  };
  t["aten::_log_softmax_backward_data"] = [](Stack* s) {
    Put(s, at::meta::_log_softmax_backward_data(T(*s, 0), T(*s, 1), I(*s, 2),
                                                (*s)[3].toScalarType()));
  };
}

void AddOthers(Table& t) {
  t["aten::mm"] = [](Stack* s) { Put(s, at::meta::mm(T(*s, 0), T(*s, 1))); };
  t["aten::bmm"] = [](Stack* s) { Put(s, at::meta::bmm(T(*s, 0), T(*s, 1))); };
  t["aten::addmm"] = [](Stack* s) {
    Put(s, at::meta::addmm(T(*s, 0), T(*s, 1), T(*s, 2), S(*s, 3), S(*s, 4)));
  };
  t["aten::cat"] = [](Stack* s) {
    const std::vector<at::Tensor> tensors = (*s)[0].toTensorVector();
    Put(s, at::meta::cat(tensors, I(*s, 1)));
  };
  t["aten::gather"] = [](Stack* s) {
    Put(s, at::meta::gather(T(*s, 0), I(*s, 1), T(*s, 2), B(*s, 3)));
  };
  t["aten::sort"] = [](Stack* s) {
    Put(s, at::meta::sort(T(*s, 0), false, I(*s, 1), B(*s, 2)));
  };
  t["aten::sort.stable"] = [](Stack* s) {
    Put(s, at::meta::sort(T(*s, 0), (*s)[1].toOptional<bool>(), I(*s, 2),
                          B(*s, 3)));
  };
  t["aten::topk"] = [](Stack* s) {
    Put(s, at::meta::topk(T(*s, 0), I(*s, 1), I(*s, 2), B(*s, 3), B(*s, 4)));
  };
}

// out= forms (the forms torch_tpu sends many ops as): the meta function
// resizes the meta `out` arguments, which are the results.
void AddOutForms(Table& t) {
  t["aten::sum.IntList_out"] = [](Stack* s) {
    at::Tensor out = T(*s, 4);
    const auto dims = Dims(*s, 1);
    at::meta::sum_out(out, T(*s, 0), Ref(dims), B(*s, 2), Dtype(*s, 3));
    Put(s, out);
  };
  t["aten::any.all_out"] = [](Stack* s) {
    at::Tensor out = T(*s, 1);
    at::meta::any_out(out, T(*s, 0));
    Put(s, out);
  };
  t["aten::all.all_out"] = [](Stack* s) {
    at::Tensor out = T(*s, 1);
    at::meta::all_out(out, T(*s, 0));
    Put(s, out);
  };
  t["aten::max.dim_max"] = [](Stack* s) {
    at::Tensor values = T(*s, 3), indices = T(*s, 4);
    at::meta::max_out(values, indices, T(*s, 0), I(*s, 1), B(*s, 2));
    Put(s, std::make_tuple(values, indices));
  };
  t["aten::min.dim_min"] = [](Stack* s) {
    at::Tensor values = T(*s, 3), indices = T(*s, 4);
    at::meta::min_out(values, indices, T(*s, 0), I(*s, 1), B(*s, 2));
    Put(s, std::make_tuple(values, indices));
  };
  t["aten::sort.values_stable"] = [](Stack* s) {
    at::Tensor values = T(*s, 4), indices = T(*s, 5);
    at::meta::sort_out(values, indices, T(*s, 0), (*s)[1].toOptional<bool>(),
                       I(*s, 2), B(*s, 3));
    Put(s, std::make_tuple(values, indices));
  };
  t["aten::topk.values"] = [](Stack* s) {
    at::Tensor values = T(*s, 5), indices = T(*s, 6);
    at::meta::topk_out(values, indices, T(*s, 0), I(*s, 1), I(*s, 2), B(*s, 3),
                       B(*s, 4));
    Put(s, std::make_tuple(values, indices));
  };
  t["aten::threshold_backward.grad_input"] = [](Stack* s) {
    at::Tensor out = T(*s, 3);
    at::meta::threshold_backward_out(out, T(*s, 0), T(*s, 1), S(*s, 2));
    Put(s, out);
  };
  t["aten::sigmoid_backward.grad_input"] = [](Stack* s) {
    at::Tensor out = T(*s, 2);
    at::meta::sigmoid_backward_out(out, T(*s, 0), T(*s, 1));
    Put(s, out);
  };
  t["aten::tanh_backward.grad_input"] = [](Stack* s) {
    at::Tensor out = T(*s, 2);
    at::meta::tanh_backward_out(out, T(*s, 0), T(*s, 1));
    Put(s, out);
  };
  t["aten::nll_loss_forward.output"] = [](Stack* s) {
    at::Tensor output = T(*s, 5), total_weight = T(*s, 6);
    at::meta::nll_loss_forward_out(output, total_weight, T(*s, 0), T(*s, 1),
                                   (*s)[2].toOptional<at::Tensor>(), I(*s, 3),
                                   I(*s, 4));
    Put(s, std::make_tuple(output, total_weight));
  };
  t["aten::nll_loss_backward.grad_input"] = [](Stack* s) {
    at::Tensor out = T(*s, 7);
    at::meta::nll_loss_backward_out(out, T(*s, 0), T(*s, 1), T(*s, 2),
                                    (*s)[3].toOptional<at::Tensor>(), I(*s, 4),
                                    I(*s, 5), T(*s, 6));
    Put(s, out);
  };
}

// In place with nothing to check beyond the arguments' types: the result
// is self.
void AddFills(Table& t) {
  t["aten::fill_.Scalar"] = [](Stack* s) {
    at::Tensor self = T(*s, 0);
    Put(s, self);
  };
  t["aten::zero_"] = [](Stack* s) {
    at::Tensor self = T(*s, 0);
    Put(s, self);
  };
}

// Ops without a meta function whose results follow one that has it, and
// in-place ops whose only result is self after ATen's argument checks (the
// same checks, the same words; the CPU kernel in tpud checks again).
void AddDerived(Table& t) {
  // abs: a unary op, into the real type for complex input.
  t["aten::abs"] = [](Stack* s) {
    const at::Tensor& self = T(*s, 0);
    if (self.is_complex()) {
      Put(s, at::empty_like(self, self.options().dtype(c10::toRealValueType(
                                      self.scalar_type()))));
    } else {
      Put(s, at::meta::sign(self));
    }
  };
  // floor_divide is div(rounding_mode="floor")'s iterator.
  t["aten::floor_divide"] = [](Stack* s) {
    Put(s, at::meta::div(T(*s, 0), T(*s, 1), "floor"));
  };
  t["aten::floor_divide.Scalar"] = [](Stack* s) {
    Put(s, at::meta::div(T(*s, 0), Wrapped(*s, 1), "floor"));
  };
  // var and std (self, dim, *, correction, keepdim): mean's reduction, in
  // the real type.
  for (const char* name : {"aten::var.correction", "aten::std.correction"}) {
    t[name] = [](Stack* s) {
      const at::Tensor& self = T(*s, 0);
      TORCH_CHECK(at::isFloatingType(self.scalar_type()) || self.is_complex(),
                  "std and var only support floating point and complex dtypes");
      const auto dims = Dims(*s, 1);
      at::Tensor r = at::meta::mean(self, Ref(dims), B(*s, 3), std::nullopt);
      if (self.is_complex()) {
        r = at::empty(r.sizes(), r.options().dtype(
                                     c10::toRealValueType(self.scalar_type())));
      }
      Put(s, r);
    };
  }
  // x[indices]: data-dependent for boolean indices, whose meta kernel
  // cannot say (the op then runs synchronously, as before).
  t["aten::index.Tensor"] = [](Stack* s) {
    const c10::List<std::optional<at::Tensor>> indices =
        (*s)[1].toOptionalTensorList();
    for (const std::optional<at::Tensor>& i : indices) {
      if (i.has_value() && i->defined() &&
          (i->scalar_type() == at::kBool || i->scalar_type() == at::kByte)) {
        throw c10::NotImplementedError({__func__, __FILE__, __LINE__},
                                       "boolean index: data-dependent shape");
      }
    }
    Put(s, at::meta::index(T(*s, 0), indices));
  };
  t["aten::masked_fill_.Scalar"] = [](Stack* s) {
    at::Tensor self = T(*s, 0);
    const at::Tensor& mask = T(*s, 1);
    TORCH_CHECK(mask.scalar_type() == at::kBool,
                "masked_fill_ only supports boolean masks, but got mask with "
                "dtype ",
                mask.dtype());
    const std::vector<int64_t> shape =
        at::infer_size(self.sizes(), mask.sizes());
    TORCH_CHECK(at::IntArrayRef(shape) == self.sizes(), "output with shape ",
                self.sizes(), " doesn't match the broadcast shape ",
                at::IntArrayRef(shape));
    Put(s, self);
  };
  // Random fills (self, ..., generator): the generator is not a meta value.
  t["aten::normal_"] = [](Stack* s) {
    at::Tensor self = T(*s, 0);
    at::meta::normal_(self, (*s)[1].toDouble(), (*s)[2].toDouble(),
                      std::nullopt);
    Put(s, self);
  };
  t["aten::uniform_"] = [](Stack* s) {
    at::Tensor self = T(*s, 0);
    const double from = (*s)[1].toDouble(), to = (*s)[2].toDouble();
    TORCH_CHECK(from <= to,
                "uniform_ expects to return a [from, to) range, "
                "but found from=",
                from, " > to=", to);
    Put(s, self);
  };
  t["aten::bernoulli_.float"] = [](Stack* s) {
    at::Tensor self = T(*s, 0);
    const double p = (*s)[1].toDouble();
    TORCH_CHECK(0 <= p && p <= 1,
                "bernoulli_ expects p to be in [0, 1], but got p=", p);
    Put(s, self);
  };
}

// Layer norm as its CPU kernel allocates: the result contiguous in the
// input's shape, mean and rstd over the leading dimensions (their dtype is
// corrected to the CPU kernel's afterwards, forwarding.cc); backward, each
// gradient asked for like its input, contiguous.
void AddLayerNorm(Table& t) {
  t["aten::native_layer_norm"] = [](Stack* s) {
    const at::Tensor input = T(*s, 0);
    const std::vector<int64_t> shape = (*s)[1].toIntVector();
    const std::optional<at::Tensor> weight = (*s)[2].toOptional<at::Tensor>();
    const std::optional<at::Tensor> bias = (*s)[3].toOptional<at::Tensor>();
    at::native::_check_layer_norm_inputs(input, shape,
                                         weight ? *weight : at::Tensor(),
                                         bias ? *bias : at::Tensor());
    std::vector<int64_t> stat(input.sizes().begin(),
                              input.sizes().end() - shape.size());
    stat.resize(input.dim(), 1);
    s->clear();
    s->emplace_back(at::empty(input.sizes(), input.options()));
    s->emplace_back(at::empty(stat, input.options()));
    s->emplace_back(at::empty(stat, input.options()));
  };
  t["aten::native_layer_norm_backward"] = [](Stack* s) {
    const at::Tensor input = T(*s, 1);
    const std::vector<int64_t> shape = (*s)[2].toIntVector();
    const std::optional<at::Tensor> weight = (*s)[5].toOptional<at::Tensor>();
    const std::optional<at::Tensor> bias = (*s)[6].toOptional<at::Tensor>();
    const std::vector<bool> mask = (*s)[7].toBoolList().vec();
    at::native::_check_layer_norm_inputs(input, shape,
                                         weight ? *weight : at::Tensor(),
                                         bias ? *bias : at::Tensor());
    auto like = [](const std::optional<at::Tensor>& x, bool asked) {
      return asked && x && x->defined() ? at::empty(x->sizes(), x->options())
                                        : at::Tensor();
    };
    s->clear();
    s->emplace_back(mask[0] ? at::empty(input.sizes(), input.options())
                            : at::Tensor());
    s->emplace_back(like(weight, mask[1]));
    s->emplace_back(like(bias, mask[2]));
  };
}

// randperm(n, [generator,] out): the CPU kernel's checks, then out is n
// long.
void Randperm(Stack* s, size_t out_at) {
  at::Tensor out = T(*s, out_at);
  const int64_t n = I(*s, 0);
  TORCH_CHECK(n >= 0, "n must be non-negative, got", n);
  at::native::check_supported_max_int_with_precision(n, out);
  out.resize_({n});
  Put(s, out);
}

// Factories reach tpu as their out= forms; ATen's C++ meta kernels size
// `out` (arange checks its bounds, in the CPU kernel's words).
void AddFactories(Table& t) {
  t["aten::arange.start_out"] = [](Stack* s) {
    at::Tensor out = T(*s, 3);
    at::meta::arange_out(out, S(*s, 0), S(*s, 1), S(*s, 2));
    Put(s, out);
  };
  t["aten::linspace.out"] = [](Stack* s) {
    at::Tensor out = T(*s, 3);
    at::meta::linspace_out(out, S(*s, 0), S(*s, 1), I(*s, 2));
    Put(s, out);
  };
  t["aten::logspace.out"] = [](Stack* s) {
    at::Tensor out = T(*s, 4);
    at::meta::logspace_out(out, S(*s, 0), S(*s, 1), I(*s, 2),
                           (*s)[3].toDouble());
    Put(s, out);
  };
  t["aten::eye.out"] = [](Stack* s) {
    at::Tensor out = T(*s, 1);
    at::meta::eye_out(out, I(*s, 0));
    Put(s, out);
  };
  t["aten::eye.m_out"] = [](Stack* s) {
    at::Tensor out = T(*s, 2);
    at::meta::eye_out(out, I(*s, 0), I(*s, 1));
    Put(s, out);
  };
  t["aten::randperm.out"] = [](Stack* s) { Randperm(s, 1); };
  t["aten::randperm.generator_out"] = [](Stack* s) { Randperm(s, 2); };
}

// reflection_pad2d has no structured meta function: its CPU kernel's checks
// and result, as ReflectionPad.cpp makes them (batch dim optional; the
// result in the input's suggested memory format).
struct PadDims {
  int64_t w = 2, h = 1;
};
PadDims Pad2dDims(const at::Tensor& input) {
  PadDims d;
  if (input.dim() == 4) ++d.w, ++d.h;
  return d;
}

void AddPadding(Table& t) {
  t["aten::reflection_pad2d"] = [](Stack* s) {
    const at::Tensor input = T(*s, 0);
    const std::vector<int64_t> pad = (*s)[1].toIntVector();
    at::native::padding::check_valid_input<2>(input, pad);
    const PadDims d = Pad2dDims(input);
    const int64_t in_h = input.size(d.h), in_w = input.size(d.w);
    TORCH_CHECK(pad[0] < in_w && pad[1] < in_w,
                "Argument #4: Padding size should be less than the "
                "corresponding input dimension, but got: padding (",
                pad[0], ", ", pad[1], ") at dimension ", d.w, " of input ",
                input.sizes());
    TORCH_CHECK(pad[2] < in_h && pad[3] < in_h,
                "Argument #6: Padding size should be less than the "
                "corresponding input dimension, but got: padding (",
                pad[2], ", ", pad[3], ") at dimension ", d.h, " of input ",
                input.sizes());
    const int64_t out_h = in_h + pad[2] + pad[3];
    const int64_t out_w = in_w + pad[0] + pad[1];
    TORCH_CHECK(out_w >= 1 || out_h >= 1, "input (H: ", in_h, " W: ", in_w,
                ") is too small. Calculated output H: ", out_h, " W: ", out_w);
    std::vector<int64_t> shape(input.sizes().begin(), input.sizes().end());
    shape[d.h] = out_h;
    shape[d.w] = out_w;
    Put(s, at::empty(shape, input.options().memory_format(
                                input.suggest_memory_format())));
  };
  t["aten::reflection_pad2d_backward"] = [](Stack* s) {
    const at::Tensor grad = T(*s, 0);
    const at::Tensor input = T(*s, 1);
    const std::vector<int64_t> pad = (*s)[2].toIntVector();
    TORCH_CHECK(pad.size() == 4,
                "padding size is expected to be 4, but got: ", pad.size());
    const PadDims d = Pad2dDims(input);
    const int64_t out_h = input.size(d.h) + pad[2] + pad[3];
    const int64_t out_w = input.size(d.w) + pad[0] + pad[1];
    TORCH_CHECK(grad.dim() == input.dim() && out_w == grad.size(d.w),
                "grad_output width unexpected. Expected: ", out_w,
                ", Got: ", grad.dim() == input.dim() ? grad.size(d.w) : -1);
    TORCH_CHECK(out_h == grad.size(d.h),
                "grad_output height unexpected. Expected: ", out_h,
                ", Got: ", grad.size(d.h));
    Put(s, at::empty(input.sizes(), input.options().memory_format(
                                        input.suggest_memory_format())));
  };
}

// mse_loss_backward's CPU kernel's iterator: grad_input over self, target
// and grad_output.
at::Tensor MseLossBackward(const Stack& s, at::Tensor out) {
  at::TensorIterator iter = at::TensorIteratorConfig()
                                .add_output(out)
                                .add_const_input(T(s, 1))
                                .add_const_input(T(s, 2))
                                .add_const_input(T(s, 0))
                                .build();
  return iter.output();
}

void AddLosses(Table& t) {
  t["aten::mse_loss"] = [](Stack* s) {
    Put(s, at::meta::mse_loss(T(*s, 0), T(*s, 1), I(*s, 2)));
  };
  t["aten::mse_loss.out"] = [](Stack* s) {
    at::Tensor out = T(*s, 3);
    at::meta::mse_loss_out(out, T(*s, 0), T(*s, 1), I(*s, 2));
    Put(s, out);
  };
  t["aten::mse_loss_backward"] = [](Stack* s) {
    Put(s, MseLossBackward(*s, at::empty({0}, T(*s, 1).options())));
  };
  t["aten::mse_loss_backward.grad_input"] = [](Stack* s) {
    Put(s, MseLossBackward(*s, T(*s, 4)));
  };
}

// Convolution's result and gradients, shaped as ATen's conv_output_size
// and conv_input_size work them out, laid out in the input's suggested
// memory format (as the meta kernel torch registers does). Arguments out of
// the ordinary are declined, not judged here: the op then runs at the call
// and any error is the CPU kernel's own.
std::vector<int64_t> Expanded(const c10::IValue& v, size_t n, bool* ok) {
  std::vector<int64_t> x = v.toIntVector();
  if (x.size() == 1 && n > 1) x.assign(n, x[0]);
  if (x.size() != n) *ok = false;
  return x;
}

at::Tensor ConvolutionResult(const Stack& s) {
  at::Tensor input = T(s, 0);
  const at::Tensor& weight = T(s, 1);
  const std::optional<at::Tensor> bias = s[2].toOptional<at::Tensor>();
  const bool transposed = B(s, 6);
  const int64_t groups = I(s, 8);
  const bool batched = input.dim() == weight.dim();
  bool ok = weight.dim() >= 3 && (batched || input.dim() == weight.dim() - 1) &&
            groups > 0 && input.scalar_type() == weight.scalar_type();
  if (ok && !batched) input = input.unsqueeze(0);
  const size_t n = ok ? static_cast<size_t>(weight.dim() - 2) : 0;
  const std::vector<int64_t> stride = Expanded(s[3], n, &ok);
  const std::vector<int64_t> padding = Expanded(s[4], n, &ok);
  const std::vector<int64_t> dilation = Expanded(s[5], n, &ok);
  const std::vector<int64_t> output_padding =
      transposed ? Expanded(s[7], n, &ok) : std::vector<int64_t>(n, 0);
  std::vector<int64_t> shape;
  if (ok) {
    const int64_t channels =
        transposed ? weight.size(1) * groups : weight.size(0);
    ok = weight.size(0) % groups == 0 &&
         input.size(1) ==
             (transposed ? weight.size(0) : weight.size(1) * groups) &&
         (!bias || !bias->defined() ||
          (bias->dim() == 1 && bias->size(0) == channels));
    shape = {input.size(0), channels};
    for (size_t i = 0; ok && i < n; ++i) {
      const int64_t in = input.size(i + 2);
      const int64_t k = weight.size(i + 2);
      ok = stride[i] > 0 && dilation[i] > 0 && padding[i] >= 0 &&
           output_padding[i] >= 0;
      const int64_t span = dilation[i] * (k - 1) + 1;
      const int64_t o =
          transposed
              ? (in - 1) * stride[i] - 2 * padding[i] + span + output_padding[i]
              : (in + 2 * padding[i] - span) / stride[i] + 1;
      ok = ok && o > 0 && (transposed || in + 2 * padding[i] >= span);
      shape.push_back(o);
    }
  }
  TORCH_CHECK_NOT_IMPLEMENTED(ok, "convolution: declined by the C++ meta");
  at::Tensor out = at::empty(
      shape, input.options().memory_format(input.suggest_memory_format()));
  return batched ? out : out.squeeze(0);
}

void AddConvolution(Table& t) {
  t["aten::convolution"] = [](Stack* s) { Put(s, ConvolutionResult(*s)); };
  t["aten::convolution_backward"] = [](Stack* s) {
    const at::Tensor grad = T(*s, 0), input = T(*s, 1), weight = T(*s, 2);
    const std::vector<bool> mask = (*s)[10].toBoolList().vec();
    std::optional<std::vector<int64_t>> bias_sizes = Dims(*s, 3);
    TORCH_CHECK_NOT_IMPLEMENTED(
        input.dim() == weight.dim() && grad.dim() == input.dim() &&
            (!mask[2] || bias_sizes.has_value()),
        "convolution_backward: declined by the C++ meta");
    auto like = [&grad](const at::Tensor& x) {
      return at::empty(x.sizes(),
                       grad.options().memory_format(x.suggest_memory_format()));
    };
    s->clear();
    s->emplace_back(mask[0] ? like(input) : at::Tensor());
    s->emplace_back(mask[1] ? like(weight) : at::Tensor());
    s->emplace_back(mask[2] ? at::empty(*bias_sizes, grad.options())
                            : at::Tensor());
  };
}

const Table& NativeMetaTable() {
  static const Table* table = [] {
    auto* t = new Table;
    AddArithmetic(*t);
    AddUnary(*t);
    AddPointwiseOthers(*t);
    AddWhere(*t);
    AddIteratorOps(*t);
    AddReductions(*t);
    AddOthers(*t);
    AddOutForms(*t);
    AddFills(*t);
    AddDerived(*t);
    AddLayerNorm(*t);
    AddFactories(*t);
    AddPadding(*t);
    AddLosses(*t);
    AddConvolution(*t);
    AddStructuredMeta(t);
    return t;
  }();
  return *table;
}

}  // namespace

bool NativeMetaChecksArguments(const std::string& name) {
  static const auto* checked = [] {
    auto* set = new std::unordered_set<std::string>;
    for (const char* op : {"add",
                           "sub",
                           "mul",
                           "div",
                           "rsub",
                           "remainder",
                           "pow",
                           "maximum",
                           "minimum",
                           "atan2",
                           "floor_divide",
                           "eq",
                           "ne",
                           "lt",
                           "le",
                           "gt",
                           "ge",
                           "neg",
                           "exp",
                           "exp2",
                           "expm1",
                           "log",
                           "log2",
                           "log10",
                           "log1p",
                           "sqrt",
                           "rsqrt",
                           "reciprocal",
                           "sin",
                           "cos",
                           "tan",
                           "tanh",
                           "sigmoid",
                           "erf",
                           "floor",
                           "ceil",
                           "round",
                           "trunc",
                           "frac",
                           "sign",
                           "silu",
                           "abs",
                           "relu",
                           "gelu",
                           "clamp",
                           "clamp_min",
                           "clamp_max",
                           "threshold_backward",
                           "sigmoid_backward",
                           "tanh_backward",
                           "silu_backward",
                           "gelu_backward",
                           "sum",
                           "mean",
                           "amax",
                           "amin",
                           "argmax",
                           "argmin",
                           "any",
                           "all",
                           "mm",
                           "bmm",
                           "addmm",
                           "addcmul",
                           "addcdiv",
                           "lerp",
                           "where",
                           "_softmax",
                           "_log_softmax",
                           "_softmax_backward_data",
                           "_log_softmax_backward_data"}) {
      set->insert(std::string("aten::") + op);
      set->insert(std::string("aten::") + op + "_");
    }
    return set;
  }();
  return checked->count(name.substr(0, name.find('.'))) != 0;
}

NativeMetaFn FindNativeMeta(const std::string& name) {
  const Table& table = NativeMetaTable();
  auto it = table.find(name);
  return it == table.end() ? nullptr : it->second;
}

}  // namespace torch_tpu
