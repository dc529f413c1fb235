// Op registration for "tpu": which ATen ops reach which kernel. A few run
// natively (native_kernels.cc) or as ATen's own view kernels; every other
// op goes to the forwarding path's boxed fallback (forwarding.cc), some of
// them routed there directly ("sent whole") instead of through ATen's
// composite or default kernels. Autocast and the lazy-bit fallthroughs are
// here too.
#include "registration.h"

#include <ATen/ATen.h>
#include <ATen/autocast_mode.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/_reshape_alias_native.h>
#include <ATen/ops/alias_native.h>
#include <ATen/ops/as_strided_native.h>
#include <ATen/ops/unfold_native.h>
#include <ATen/ops/view_as_complex_native.h>
#include <ATen/ops/view_as_real_native.h>
#include <ATen/ops/view_native.h>
#include <torch/library.h>

#include <cstdlib>
#include <mutex>
#include <optional>
#include <unordered_set>

#include "attention.h"
#include "forwarding.h"
#include "native_kernels.h"

namespace torch_tpu {
namespace {

TORCH_LIBRARY_IMPL(aten, PrivateUse1, m) {
  m.impl("empty.memory_format", Empty);
  m.impl("record_stream", RecordStream);
  m.impl("empty_strided", EmptyStridedNative);
  m.impl("_efficientzerotensor", EfficientZeroTensor);
  m.impl("as_strided", at::native::as_strided_tensorimpl);
  m.impl("view", at::native::view);
  m.impl("_reshape_alias", at::native::_reshape_alias);
  m.impl("unfold", at::native::unfold);
  m.impl("alias", at::native::alias);
  m.impl("view_as_real", at::native::view_as_real);
  m.impl("view_as_complex", at::native::view_as_complex);
  m.impl("resize_", Resize);
  m.impl("set_.source_Storage", SetSource);
  m.impl("set_.source_Storage_storage_offset", SetSourceOffset);
  m.impl("set_.source_Tensor", SetTensor);
  m.impl("set_", SetEmpty);
  m.impl("_copy_from", CopyFrom);
  m.impl("_copy_from_and_resize", CopyFromAndResize);
  m.impl("_local_scalar_dense", LocalScalarDense);
  m.impl("_has_compatible_shallow_copy_type", HasCompatibleShallowCopyType);
  // Ops with a CompositeExplicitAutograd kernel would run decomposed on tpu
  // (many small ops, and results that differ from the CPU kernel: layer norm
  // of bfloat16 with float weights came back in float); send them whole.
  // The same holds for group norm (float16 gradients differed from the CPU's
  // by 0.5%), addr, and mish's backward (CompositeImplicitAutograd), and
  // mode's out= form (its composite kernel takes only CPU, CUDA and XPU).
  for (const std::string& name : SentWholeOps()) {
    m.impl(name.c_str(),
           torch::CppFunction::makeFromBoxedFunction<&Fallback>());
  }
  m.impl("convolution_overrideable",
         torch::CppFunction::makeFromBoxedFunction<&ConvolutionOverrideable>());
  m.impl("convolution_backward_overrideable",
         torch::CppFunction::makeFromBoxedFunction<
             &ConvolutionBackwardOverrideable>());
}

// AMP: ops that run in lower precision under autocast("tpu"), the same
// list ATen uses for other accelerators; everything else falls through.
TORCH_LIBRARY_IMPL(_, AutocastPrivateUse1, m) {
  m.fallback(torch::CppFunction::makeFallthrough());
}

TORCH_LIBRARY_IMPL(aten, AutocastPrivateUse1, m){
#define TPU_AUTOCAST_LOWER(...) \
  KERNEL_PRIVATEUSEONE(__VA_ARGS__, lower_precision_fp)
    AT_FORALL_LOWER_PRECISION_FP(TPU_AUTOCAST_LOWER)
#undef TPU_AUTOCAST_LOWER
#define TPU_AUTOCAST_FP32(...) KERNEL_PRIVATEUSEONE(__VA_ARGS__, fp32)
        AT_FORALL_FP32(TPU_AUTOCAST_FP32)
#undef TPU_AUTOCAST_FP32
}

// Copies handle lazy conjugate/negative bits themselves: ATen's generic
// fallbacks for them would materialize through clone -> copy_ -> _copy_from,
// which lands here again.
TORCH_LIBRARY_IMPL(aten, Conjugate, m) {
  m.impl("_copy_from", torch::CppFunction::makeFallthrough());
}
TORCH_LIBRARY_IMPL(aten, Negative, m) {
  m.impl("_copy_from", torch::CppFunction::makeFallthrough());
}

TORCH_LIBRARY_IMPL(_, PrivateUse1, m) {
  m.fallback(torch::CppFunction::makeFromBoxedFunction<&Fallback>());
}

// "aten::add.Tensor"; "aten::relu" for an op without an overload name.
std::string FullName(const c10::OperatorName& n) {
  return n.overload_name.empty() ? n.name : n.name + "." + n.overload_name;
}

void SendForeachOpsWhole() {
  static std::once_flag once;
  std::call_once(once, [] {
    // ATen's foreach ops have, for devices other than CUDA, a composite
    // kernel that loops over the lists: one record per tensor. Sent whole
    // they are one record each, and the daemon's CPU kernel does the loop.
    // Only overloads whose tensors all come in lists and take no list of
    // scalars: a lone Tensor argument (a step size as a CPU scalar tensor)
    // travels as a scalar, and scalar lists are not forwarded as such.
    static auto* lib =
        new torch::Library(torch::Library::IMPL, "aten",
                           c10::DispatchKey::PrivateUse1, __FILE__, __LINE__);
    for (const c10::OperatorName& name :
         c10::Dispatcher::singleton().getAllOpNames()) {
      if (name.name.rfind("aten::_foreach_", 0) != 0) continue;
      std::optional<c10::OperatorHandle> op =
          c10::Dispatcher::singleton().findOp(name);
      if (!op.has_value() ||
          op->hasKernelForDispatchKey(c10::DispatchKey::PrivateUse1))
        continue;
      bool lists_only = true;
      for (const c10::Argument& a : op->schema().arguments()) {
        const c10::TypePtr& t = a.real_type();
        const bool optional_tensor =
            t->kind() == c10::TypeKind::OptionalType &&
            t->castRaw<c10::OptionalType>()->getElementType()->kind() ==
                c10::TypeKind::TensorType;
        const bool other_list =
            t->kind() == c10::TypeKind::ListType &&
            t->castRaw<c10::ListType>()->getElementType()->kind() !=
                c10::TypeKind::TensorType;
        if (t->kind() == c10::TypeKind::TensorType || optional_tensor ||
            other_list)
          lists_only = false;
      }
      if (!lists_only) continue;
      lib->impl(FullName(name).substr(6).c_str(),
                torch::CppFunction::makeFromBoxedFunction<&Fallback>());
    }
  });
}

// ATen's structured ops have, for devices other than CPU and CUDA, a default
// kernel (CompositeExplicitAutogradNonFunctional) that runs the op's meta
// function on the real tensors (a TensorIterator for pointwise ops),
// allocates the result and calls the out= op, which reaches the fallback as
// the functional op again. The fallback keeps the meta result per
// signature: sent whole, the op skips that work. What the daemon gets is
// unchanged. `lowered` (nullptr: all) limits them to ops the daemon runs.
std::vector<c10::OperatorName> StructuredOpsToSendWhole(
    const std::vector<std::string>* lowered) {
  c10::Dispatcher& d = c10::Dispatcher::singleton();
  std::unordered_set<std::string> runs;
  if (lowered != nullptr) runs.insert(lowered->begin(), lowered->end());
  // f has an out= form: f's arguments, then only written tensors ("add.out"
  // for "add.Tensor", "max.dim_max" is not looked for).
  auto structured = [&](const c10::OperatorHandle& f) {
    const c10::OperatorName& n = f.operator_name();
    const auto& fargs = f.schema().arguments();
    for (const std::string& overload :
         {std::string("out"), n.overload_name + "_out"}) {
      auto out = d.findSchema({n.name, overload});
      if (!out.has_value()) continue;
      const auto& args = out->schema().arguments();
      bool match = args.size() > fargs.size();
      for (size_t i = 0; match && i < args.size(); ++i) {
        const bool writes =
            args[i].alias_info() != nullptr && args[i].alias_info()->isWrite();
        match =
            i < fargs.size()
                ? (!writes && args[i].name() == fargs[i].name() &&
                   args[i].real_type()->str() == fargs[i].real_type()->str())
                : writes;
      }
      if (match) return true;
    }
    return false;
  };
  std::vector<c10::OperatorName> names;
  for (const c10::OperatorName& name : d.getAllOpNames()) {
    if (name.name.rfind("aten::", 0) != 0 || name.name == "aten::copy" ||
        name.name.rfind("aten::new_", 0) == 0 ||
        name.name.find("nested") != std::string::npos) {
      continue;
    }
    std::optional<c10::OperatorHandle> op = d.findOp(name);
    if (!op.has_value() ||
        op->hasKernelForDispatchKey(c10::DispatchKey::PrivateUse1) ||
        !op->hasKernelForDispatchKey(
            c10::DispatchKey::CompositeExplicitAutogradNonFunctional)) {
      continue;
    }
    std::optional<c10::OperatorHandle> functional =
        InPlaceFunctionalOf(op->schema());
    if (!functional.has_value()) functional = op;
    if (!structured(*functional)) continue;
    if (lowered != nullptr &&
        runs.count(FullName(functional->operator_name())) == 0)
      continue;
    names.push_back(name);
  }
  return names;
}

void SendStructuredOpsWhole(const std::vector<std::string>* lowered) {
  static std::once_flag once;
  std::call_once(once, [lowered] {
    static auto* lib =
        new torch::Library(torch::Library::IMPL, "aten",
                           c10::DispatchKey::PrivateUse1, __FILE__, __LINE__);
    for (const c10::OperatorName& name : StructuredOpsToSendWhole(lowered)) {
      NoteStructuredSentWhole(name);
      lib->impl(FullName(name).substr(6).c_str(),
                torch::CppFunction::makeFromBoxedFunction<&Fallback>());
    }
  });
}

}  // namespace

const std::vector<std::string>& SentWholeOps() {
  static const auto* ops = new std::vector<std::string>{
      "native_layer_norm", "native_group_norm", "addr",
      "addr.out",          "mish_backward",     "mode.values"};
  return *ops;
}

std::vector<std::string> StructuredOpsSentWhole() {
  std::vector<std::string> names;
  for (const c10::OperatorName& n : StructuredSentWhole())
    names.push_back(FullName(n));
  return names;
}

void InstallSendWholeRoutes(const tpu::TopologyInfo& t) {
  ChooseAttentionKernels(t);
  SetSyncRunsAllocateResults(t.backend != "pjrt");
  if (t.backend != "pjrt") SendForeachOpsWhole();
  const char* whole = std::getenv("TORCH_TPU_STRUCTURED_WHOLE");  // "0": off
  if (whole == nullptr || std::string(whole) != "0") {
    SendStructuredOpsWhole(t.backend == "pjrt" ? &t.lowered_ops : nullptr);
  }
}

}  // namespace torch_tpu
