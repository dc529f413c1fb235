// Calls an unboxed ATen function with the boxed arguments on a stack, as
// the dispatcher's boxing of unboxed kernels reads them (c10::impl's
// ivalue_to_arg): the at::meta:: functions of native_meta_structured.cc and
// the at::meta::*_outf checks of out_checks.cc.
#pragma once

#include <ATen/core/boxing/impl/make_boxed_from_unboxed_functor.h>
#include <ATen/core/stack.h>
#include <c10/util/Exception.h>
#include <c10/util/TypeTraits.h>

#include <type_traits>
#include <utility>

namespace torch_tpu {
namespace boxed_call_internal {

template <auto F, class... Args, size_t... I>
decltype(auto) Call(torch::jit::Stack* s,
                    c10::guts::typelist::typelist<Args...>,
                    std::index_sequence<I...>) {
  TORCH_CHECK(s->size() == sizeof...(Args), "tpu: a function of ",
              sizeof...(Args), " arguments was given ", s->size());
  return (*F)(c10::impl::ivalue_to_arg<
              typename c10::impl::decay_if_not_tensor<Args>::type,
              false>::call((*s)[I])...);
}

}  // namespace boxed_call_internal

// F(arguments on *s), which must be exactly F's parameters, in order; the
// stack is left as it was (F's out= tensors on it may be written).
template <auto F>
decltype(auto) CallWithStackArguments(torch::jit::Stack* s) {
  using Traits =
      c10::guts::infer_function_traits_t<std::remove_pointer_t<decltype(F)>>;
  return boxed_call_internal::Call<F>(
      s, typename Traits::parameter_types{},
      std::make_index_sequence<Traits::number_of_parameters>());
}

}  // namespace torch_tpu
