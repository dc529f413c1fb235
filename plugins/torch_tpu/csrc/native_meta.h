// Output metadata of common ops from ATen's C++ meta functions (at::meta::),
// called directly rather than through the Meta dispatch key.
//
// `import torch` registers Python meta kernels (torch._refs,
// torch._meta_registrations, torch._decomp) over the C++ ones of most ops
// on that key. Forwarding an op asks its meta kernel once per signature, so
// a tpu process ran those Python kernels, and the first reference among
// them imported torch._dynamo (some 800 modules, about a second of CPU) in
// every process. A CPU process never runs a meta kernel. For the ops below
// a tpu process no longer does either; the C++ meta functions are what the
// CPU kernels themselves run, so shapes, strides and dtypes are the CPU's.
#pragma once

#include <ATen/core/stack.h>

#include <string>

namespace torch_tpu {

// Replaces the op's arguments on `stack` (meta tensors and host values, as
// for a boxed call) with its results, as the boxed meta kernel would.
using NativeMetaFn = void (*)(torch::jit::Stack* stack);

// The C++ meta function of the op named "aten::mul.Tensor" ("aten::relu"
// for a default overload), or null: then the Meta dispatch key answers.
NativeMetaFn FindNativeMeta(const std::string& name);

// Whether the C++ meta function of the op (REQUIRES: FindNativeMeta has
// one) checks every argument its CPU kernel checks: a structured op's meta
// half whose implementation half checks nothing more (pointwise math,
// comparisons, reductions, matmuls). Not so for random fills (uniform_'s
// bounds), convolution (shapes only), and the other entries written here.
bool NativeMetaChecksArguments(const std::string& name);

}  // namespace torch_tpu
