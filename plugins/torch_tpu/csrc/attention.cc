// scaled_dot_product_attention on "tpu": the fused CPU flash-attention
// kernel in the daemon, where the CPU would pick it.
//
// ATen asks each device's _fused_sdp_choice_stub which kernel runs SDPA.
// A device without one gets the math path: a dozen ops per call (matmuls,
// the scale, the mask, _safe_softmax's isneginf/all/where, dropout), each a
// pass over the (L x S) scores and a tensor in HBM. The CPU picks its fused
// flash kernel instead. tpu picks "overrideable" under the same rules, and
// its overrideable forward and backward ops run the CPU's flash kernels
// (_scaled_dot_product_flash_attention_for_cpu and its backward) in the
// daemon: the same values as CPU eager, one op each way.
#include "attention.h"

#include <ATen/ATen.h>
#include <ATen/Context.h>
#include <ATen/SDPBackend.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/native/DispatchStub.h>
#include <ATen/native/transformers/attention.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <optional>
#include <string>
#include <vector>

#include "forwarding.h"

namespace torch_tpu {
namespace {

constexpr char kFlashForward[] =
    "aten::_scaled_dot_product_flash_attention_for_cpu";
constexpr char kFlashBackward[] =
    "aten::_scaled_dot_product_flash_attention_for_cpu_backward";

// Set once the session is open (ChooseAttentionKernels).
std::atomic<bool> fused_attention{false};

bool FlashDtype(at::ScalarType t) {
  return t == at::kFloat || t == at::kDouble || t == at::kBFloat16 ||
         t == at::kHalf;
}

// A mask dim fits a score dim when equal or 1 (broadcast). Sizes are
// SymInts: under torch.compile with dynamic shapes the choice is traced,
// and each comparison becomes a guard, as in ATen's own checks.
bool Fits(const c10::SymInt& mask_dim, const c10::SymInt& dim) {
  return mask_dim == dim || mask_dim == 1;
}

// The CPU's rules for its flash kernel (ATen's use_flash_attention_cpp): no
// dropout, 4-d inputs of one float dtype with one batch size and head count
// (or GQA's grouping), equal head dims, non-empty sequences, a last dim of
// stride 1, and a 2-d or 4-d mask that broadcasts to the scores and needs no
// gradient.
bool FlashApplies(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                  const std::optional<at::Tensor>& mask, double dropout_p,
                  bool enable_gqa) {
  if (dropout_p > 0.0) return false;
  if (q.is_nested() || k.is_nested() || v.is_nested()) return false;
  if (q.dim() != 4 || k.dim() != 4 || v.dim() != 4) return false;
  if (q.scalar_type() != k.scalar_type() ||
      q.scalar_type() != v.scalar_type() || !FlashDtype(q.scalar_type())) {
    return false;
  }
  if (q.sym_size(0) != k.sym_size(0) || q.sym_size(0) != v.sym_size(0))
    return false;
  if (enable_gqa) {
    // Grouped-query attention: key and value share a head count that
    // divides the query's.
    if (k.sym_size(1) != v.sym_size(1) || k.sym_size(1) == 0 ||
        q.sym_size(1) % k.sym_size(1) != 0)
      return false;
  } else if (q.sym_size(1) != k.sym_size(1) || q.sym_size(1) != v.sym_size(1)) {
    return false;
  }
  if (q.sym_size(3) != k.sym_size(3) || q.sym_size(3) != v.sym_size(3))
    return false;
  if (q.sym_size(2) == 0 || k.sym_size(2) == 0) return false;
  if (q.sym_stride(3) != 1 || k.sym_stride(3) != 1 || v.sym_stride(3) != 1)
    return false;
  if (mask.has_value() && mask->defined()) {
    const at::Tensor& m = *mask;
    if (m.requires_grad() || (m.dim() != 2 && m.dim() != 4)) return false;
    if (!Fits(m.sym_size(-2), q.sym_size(2)) ||
        !Fits(m.sym_size(-1), k.sym_size(2))) {
      return false;
    }
    if (m.dim() == 4 && (!Fits(m.sym_size(0), q.sym_size(0)) ||
                         !Fits(m.sym_size(1), q.sym_size(1)))) {
      return false;
    }
  }
  return true;
}

// The fused kernel where it is enabled (sdpa_kernel's flash or overrideable
// switch), this backend runs it and it takes the inputs; else the math path
// if enabled; else the CPU's errors.
int64_t ChooseSdpBackend(const at::Tensor& q, const at::Tensor& k,
                         const at::Tensor& v,
                         const std::optional<at::Tensor>& mask,
                         double dropout_p, bool /*is_causal*/,
                         std::optional<double> /*scale*/, bool enable_gqa) {
  const at::Context& ctx = at::globalContext();
  const bool fused_on =
      ctx.userEnabledFlashSDP() || ctx.userEnabledOverrideableSDP();
  const bool math_on = ctx.userEnabledMathSDP();
  TORCH_CHECK(fused_on || math_on,
              "No viable backend for scaled_dot_product_attention was found. "
              "This is likely due to turning off both the math kernel and "
              "the fused kernels.");
  if (fused_on && fused_attention.load(std::memory_order_relaxed) &&
      FlashApplies(q, k, v, mask, dropout_p, enable_gqa)) {
    return static_cast<int64_t>(at::SDPBackend::overrideable);
  }
  TORCH_CHECK(math_on,
              "No available kernel. Aborting execution. (tpu: the fused flash "
              "kernel ",
              fused_attention.load(std::memory_order_relaxed)
                  ? "does not take these inputs"
                  : "does not run on this tpud's backend",
              ", and the math kernel is disabled; enable SDPBackend.MATH "
              "in sdpa_kernel(...))");
  return static_cast<int64_t>(at::SDPBackend::math);
}

const c10::OperatorHandle& FlashForward() {
  static const c10::OperatorHandle op =
      c10::Dispatcher::singleton().findSchemaOrThrow(kFlashForward, "");
  return op;
}

const c10::OperatorHandle& FlashBackward() {
  static const c10::OperatorHandle op =
      c10::Dispatcher::singleton().findSchemaOrThrow(kFlashBackward, "");
  return op;
}

// An optional tensor argument that may arrive as None or as an undefined
// tensor (autograd passes a missing attn_bias as the latter).
c10::IValue OptionalTensor(const c10::IValue& v) {
  if (v.isTensor() && v.toTensor().defined()) return v;
  return c10::IValue();
}

// `grad` in the layout of `input`, as the fused op's meta kernel promises
// (empty_like): the CPU kernel's gradients are (batch, seq, heads, dim) in
// memory, which for the usual inputs (heads split from a (batch, seq, ...)
// projection) is already so. A compiled backward graph views the gradients
// with the strides the meta kernel gave.
at::Tensor LaidOutLike(const at::Tensor& grad, const at::Tensor& input) {
  if (input.is_non_overlapping_and_dense() &&
      grad.strides() == input.strides()) {
    return grad;
  }
  at::Tensor out = at::empty_like(input);
  if (out.strides() == grad.strides()) return grad;
  out.copy_(grad);
  return out;
}

// (query, key, value, attn_bias?, dropout_p, is_causal, return_debug_mask,
//  *, scale?) -> (output, logsumexp, cum_seq_q, cum_seq_k, max_q, max_k,
//  philox_seed, philox_offset, debug_attn_mask)
void FusedAttention(const c10::OperatorHandle&, torch::jit::Stack* stack) {
  std::vector<c10::IValue> a(stack->end() - 8, stack->end());
  torch::jit::drop(*stack, 8);
  const double dropout_p = a[4].toDouble();
  TORCH_CHECK(dropout_p == 0.0,
              "_scaled_dot_product_fused_attention_overrideable on tpu runs "
              "the flash kernel, which has no dropout (got dropout_p=",
              dropout_p,
              "); call scaled_dot_product_attention, which picks "
              "the math path for dropout");
  const int64_t max_q = a[0].toTensor().size(-2);
  const int64_t max_k = a[1].toTensor().size(-2);
  torch::jit::Stack s{a[0], a[1], a[2], a[4], a[5], OptionalTensor(a[3]), a[7]};
  ForwardOp(FlashForward(), &s);  // -> (output, logsumexp)
  stack->push_back(s[0]);
  stack->push_back(s[1]);
  stack->push_back(at::Tensor());  // cum_seq_q: dense inputs have none
  stack->push_back(at::Tensor());  // cum_seq_k
  stack->push_back(max_q);
  stack->push_back(max_k);
  // No dropout, so no RNG state; still tensors (as the meta kernel gives
  // them), which torch.compile's saved values need, and on tpu, so that a
  // captured graph has no output on the host.
  const at::TensorOptions rng = a[0].toTensor().options().dtype(at::kLong);
  stack->push_back(at::empty({}, rng));  // philox_seed
  stack->push_back(at::empty({}, rng));  // philox_offset
  stack->push_back(at::Tensor());  // debug_attn_mask: the kernel keeps none
}

// (grad_out, query, key, value, attn_bias, grad_input_mask[4], out,
//  logsumexp, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal,
//  philox_seed, philox_offset, *, scale?)
//  -> (grad_query, grad_key, grad_value, grad_attn_bias)
void FusedAttentionBackward(const c10::OperatorHandle&,
                            torch::jit::Stack* stack) {
  std::vector<c10::IValue> a(stack->end() - 17, stack->end());
  torch::jit::drop(*stack, 17);
  const c10::List<bool> mask = a[5].toBoolList();
  TORCH_CHECK(mask.size() < 4 || !mask.get(3),
              "scaled_dot_product_attention on tpu: the fused kernel gives no "
              "gradient for attn_mask; a mask that requires grad runs the "
              "math path");
  torch::jit::Stack s{
      a[0], a[1], a[2], a[3], a[6], a[7], a[12], a[13], OptionalTensor(a[4]),
      a[16]};
  ForwardOp(FlashBackward(), &s);  // -> (grad_q, grad_k, grad_v)
  for (int i = 0; i < 3; ++i) {
    stack->push_back(LaidOutLike(s[i].toTensor(), a[1 + i].toTensor()));
  }
  stack->push_back(at::Tensor());
}

TORCH_LIBRARY_IMPL(aten, PrivateUse1, m) {
  m.impl("_scaled_dot_product_fused_attention_overrideable",
         torch::CppFunction::makeFromBoxedFunction<&FusedAttention>());
  m.impl("_scaled_dot_product_fused_attention_overrideable_backward",
         torch::CppFunction::makeFromBoxedFunction<&FusedAttentionBackward>());
}

}  // namespace

void ChooseAttentionKernels(const tpu::TopologyInfo& t) {
  bool lowered = true;  // both ops, on a backend that lowers ops
  for (const char* op : {kFlashForward, kFlashBackward}) {
    lowered = lowered && std::find(t.lowered_ops.begin(), t.lowered_ops.end(),
                                   std::string(op)) != t.lowered_ops.end();
  }
  fused_attention.store(t.backend != "pjrt" || lowered,
                        std::memory_order_relaxed);
}

}  // namespace torch_tpu

namespace at::native {
REGISTER_PRIVATEUSE1_DISPATCH(_fused_sdp_choice_stub,
                              &torch_tpu::ChooseSdpBackend)
}  // namespace at::native
