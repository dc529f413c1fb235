// More entries of the C++ meta table (native_meta.h): structured ops whose
// at::meta:: function takes exactly the schema's arguments, boxed by one
// template instead of by hand.
//
// Without an entry, such an op's output metadata comes from the Meta key,
// where `import torch` put a Python kernel over the C++ one. For the
// pointwise ones that is a reference in torch._refs under
// elementwise_type_promotion_wrapper, whose torch._disable_dynamo imports
// torch._dynamo on its first call: 1.0-1.6 s of CPU the first time a process
// calls leaky_relu, elu, softplus, tril, hypot, ... on tpu (measured on the
// 2-core machine), and never on the CPU, whose kernels run these same meta
// functions.
#include "native_meta_structured.h"

#include <ATen/ATen.h>
#include <ATen/MetaFunctions.h>

#include <type_traits>
#include <utility>

#include "boxed_call.h"

namespace torch_tpu {
namespace {

using Stack = torch::jit::Stack;

// The boxed form of the unboxed meta function F: its results replace its
// arguments.
template <auto F>
void Boxed(Stack* s) {
  auto result = CallWithStackArguments<F>(s);
  s->clear();
  c10::impl::push_outputs<decltype(result), false>::call(std::move(result), s);
}

}  // namespace

void AddStructuredMeta(std::unordered_map<std::string, NativeMetaFn>* table) {
  // Entries written by hand (native_meta.cc) stay.
  auto add = [table](const char* name, NativeMetaFn fn) {
    table->emplace(name, fn);
  };
#define TPU_META(op) add("aten::" #op, &Boxed<&at::meta::op>)
  // Pointwise math.
  TPU_META(acos);
  TPU_META(acosh);
  TPU_META(asin);
  TPU_META(asinh);
  TPU_META(atan);
  TPU_META(atanh);
  TPU_META(sinh);
  TPU_META(cosh);
  TPU_META(erfc);
  TPU_META(erfinv);
  TPU_META(lgamma);
  TPU_META(digamma);
  TPU_META(i0);
  TPU_META(sgn);
  TPU_META(sinc);
  TPU_META(bitwise_not);
  TPU_META(hypot);
  TPU_META(logaddexp);
  TPU_META(logaddexp2);
  TPU_META(heaviside);
  TPU_META(fmax);
  TPU_META(fmin);
  TPU_META(gcd);
  TPU_META(lcm);
  TPU_META(nextafter);
  TPU_META(baddbmm);
  TPU_META(addmv);
  TPU_META(linalg_cross);
  TPU_META(igamma);
  TPU_META(igammac);
  // Activations and their backward.
  TPU_META(elu);
  TPU_META(elu_backward);
  TPU_META(leaky_relu);
  TPU_META(leaky_relu_backward);
  TPU_META(softplus);
  TPU_META(softplus_backward);
  TPU_META(hardsigmoid);
  TPU_META(hardsigmoid_backward);
  TPU_META(hardshrink);
  TPU_META(softshrink);
  TPU_META(mish);
  TPU_META(threshold);
  TPU_META(glu);
  TPU_META(logit_backward);
  // Shapes, scans, losses.
  TPU_META(tril);
  TPU_META(triu);
  TPU_META(cumprod);
  TPU_META(renorm);
  TPU_META(smooth_l1_loss);
  TPU_META(nll_loss_forward);
  TPU_META(nll_loss_backward);
  // Pooling and resampling.
  TPU_META(avg_pool2d);
  TPU_META(avg_pool2d_backward);
  TPU_META(max_pool2d_with_indices);
  TPU_META(max_pool2d_with_indices_backward);
  TPU_META(upsample_nearest1d);
  TPU_META(upsample_nearest2d);
  TPU_META(upsample_nearest3d);
  TPU_META(upsample_linear1d);
  TPU_META(upsample_bilinear2d);
  TPU_META(upsample_bicubic2d);
  TPU_META(upsample_trilinear3d);
  TPU_META(upsample_nearest1d_backward);
  TPU_META(upsample_nearest2d_backward);
  TPU_META(upsample_nearest3d_backward);
  TPU_META(upsample_linear1d_backward);
  TPU_META(upsample_bilinear2d_backward);
  TPU_META(upsample_bicubic2d_backward);
  TPU_META(upsample_trilinear3d_backward);
  TPU_META(reflection_pad1d);
  TPU_META(replication_pad1d);
  TPU_META(replication_pad2d);
  // Indexed accumulation. (Not index_add or index_copy: over meta tensors
  // their meta functions select index 0 of `dim` for a TensorIterator check,
  // and refuse an empty source the CPU takes.)
  TPU_META(scatter_add);
  // Overloaded meta functions, picked by their types: scatter's four forms
  // and clamp's in-place and Tensor-bound ones (one_hot scatters in place,
  // cosine_similarity clamps its norms in place).
#define TPU_META_AS(name, type, fn) \
  add("aten::" name, &Boxed<static_cast<type>(&at::meta::fn)>)
  using T = at::Tensor;
  using S = at::Scalar;
  using View = c10::string_view;
  using OptS = std::optional<at::Scalar>;
  using OptT = std::optional<at::Tensor>;
  TPU_META_AS("scatter.src", T(*)(const T&, int64_t, const T&, const T&),
              scatter);
  TPU_META_AS("scatter_.src", T & (*)(T&, int64_t, const T&, const T&),
              scatter_);
  TPU_META_AS("scatter.value", T(*)(const T&, int64_t, const T&, const S&),
              scatter);
  TPU_META_AS("scatter_.value", T & (*)(T&, int64_t, const T&, const S&),
              scatter_);
  TPU_META_AS("scatter.reduce",
              T(*)(const T&, int64_t, const T&, const T&, View), scatter);
  TPU_META_AS("scatter_.reduce", T & (*)(T&, int64_t, const T&, const T&, View),
              scatter_);
  TPU_META_AS("scatter.value_reduce",
              T(*)(const T&, int64_t, const T&, const S&, View), scatter);
  TPU_META_AS("scatter_.value_reduce",
              T & (*)(T&, int64_t, const T&, const S&, View), scatter_);
  TPU_META_AS("clamp_", T & (*)(T&, const OptS&, const OptS&), clamp_);
  TPU_META_AS("clamp.Tensor", T(*)(const T&, const OptT&, const OptT&), clamp);
  TPU_META_AS("clamp_.Tensor", T & (*)(T&, const OptT&, const OptT&), clamp_);
  TPU_META_AS("clamp_min_", T & (*)(T&, const S&), clamp_min_);
  TPU_META_AS("clamp_min.Tensor", T(*)(const T&, const T&), clamp_min);
  TPU_META_AS("clamp_min_.Tensor", T & (*)(T&, const T&), clamp_min_);
  TPU_META_AS("clamp_max_", T & (*)(T&, const S&), clamp_max_);
  TPU_META_AS("clamp_max.Tensor", T(*)(const T&, const T&), clamp_max);
  TPU_META_AS("clamp_max_.Tensor", T & (*)(T&, const T&), clamp_max_);
#undef TPU_META_AS
#undef TPU_META
}

}  // namespace torch_tpu
