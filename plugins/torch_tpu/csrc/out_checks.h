// What ATen checks of an op's out= tensors before it computes anything.
//
// The fallback runs an out= op as its functional twin and writes the result
// into the out= tensors, casting where the result's dtype casts to theirs.
// That is TensorIterator's rule, but not every out= kernel's: the structured
// ops that build no iterator (mm, sort, topk, max.dim, argmax, ...) want an
// out= tensor of exactly the result's dtype, and some iterator ops want one
// dtype only (isposinf's bool). ATen's C++ meta functions for those out= ops
// hold these checks; here they run over meta stand-ins of the arguments, so
// the call raises what the CPU raises, in its words, before anything is sent.
#pragma once

#include <ATen/core/operator_name.h>
#include <ATen/core/stack.h>

#include <string>

namespace torch_tpu {

// ATen's checks of one out= op: its C++ meta function, called on meta
// stand-ins of the op's boxed arguments (out= tensors included).
using OutCheck = void (*)(torch::jit::Stack& meta_args);

// The check of the op named `name` ("aten::mm", overload "out"), or null
// where there is none to run.
OutCheck FindOutCheck(const c10::OperatorName& name);

// Raises ATen's error, in ATen's words, if `check` refuses `args` (the
// boxed arguments on the caller's stack).
void RunOutCheck(OutCheck check, c10::ArrayRef<c10::IValue> args);

}  // namespace torch_tpu
