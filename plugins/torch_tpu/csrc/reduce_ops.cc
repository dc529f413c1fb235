#include "reduce_ops.h"

#include <ATen/ATen.h>
#include <c10/core/ScalarType.h>

namespace torch_tpu {
namespace {

bool Bitwise(c10d::ReduceOp::RedOpType op) {
  return op == c10d::ReduceOp::BAND || op == c10d::ReduceOp::BOR ||
         op == c10d::ReduceOp::BXOR;
}

// PREMUL_SUM's dtypes: NCCL's (half, bfloat16, float, double), and complex
// ones, which NCCL takes as their real and imaginary parts.
bool PreMulSumDType(at::ScalarType t) {
  switch (t) {
    case at::kHalf:
    case at::kBFloat16:
    case at::kFloat:
    case at::kDouble:
    case at::kComplexFloat:
    case at::kComplexDouble:
      return true;
    default:
      return false;
  }
}

// `t` times the factor of `op` (PREMUL_SUM), in place or as a new tensor.
at::Tensor Scale(const c10d::ReduceOp& op, const at::Tensor& t, bool in_place) {
  const auto* s =
      dynamic_cast<const c10d::PreMulSumSupplement*>(op.supplement_.get());
  TORCH_CHECK(s != nullptr,
              "tpu backend: PREMUL_SUM without its factor; make the op with "
              "torch.distributed._make_nccl_premul_sum(factor)");
  // The collective's buffers are no part of any graph.
  at::NoGradGuard no_grad;
  if (!s->tensor_factor.defined())
    return in_place ? t.mul_(s->double_factor) : t.mul(s->double_factor);
  // A one-element factor, on this device (one copy if it is elsewhere).
  at::Tensor f = s->tensor_factor.reshape({});
  if (f.device() != t.device()) f = f.to(t.device());
  TORCH_CHECK(at::result_type(t, f) == t.scalar_type(),
              "tpu backend: PREMUL_SUM's factor of dtype ", f.scalar_type(),
              " cannot scale a tensor of ", t.scalar_type(), " in its dtype",
              f.is_complex() && !t.is_complex()
                  ? " (complex tensors reach the backend as their real and "
                    "imaginary parts, view_as_real: give a real factor)"
                  : "");
  return in_place ? t.mul_(f) : t.mul(f);
}

}  // namespace

std::string ReduceOpName(c10d::ReduceOp::RedOpType op) {
  switch (op) {
    case c10d::ReduceOp::SUM:
      return "SUM";
    case c10d::ReduceOp::AVG:
      return "AVG";
    case c10d::ReduceOp::PRODUCT:
      return "PRODUCT";
    case c10d::ReduceOp::MIN:
      return "MIN";
    case c10d::ReduceOp::MAX:
      return "MAX";
    case c10d::ReduceOp::BAND:
      return "BAND";
    case c10d::ReduceOp::BOR:
      return "BOR";
    case c10d::ReduceOp::BXOR:
      return "BXOR";
    case c10d::ReduceOp::PREMUL_SUM:
      return "PREMUL_SUM";
    case c10d::ReduceOp::UNUSED:
      return "UNUSED";
  }
  return "reduce op " + std::to_string(static_cast<int>(op));
}

tpu::ReduceOp ToReduceOp(const c10d::ReduceOp& op, at::ScalarType dtype) {
  TORCH_CHECK(!Bitwise(op.op_) || at::isIntegralType(dtype, true),
              "tpu backend: ", ReduceOpName(op.op_),
              " takes integer and bool tensors, not ", dtype,
              " (as gloo's bitwise ops)");
  TORCH_CHECK(op.op_ != c10d::ReduceOp::PREMUL_SUM || PreMulSumDType(dtype),
              "tpu backend: PREMUL_SUM takes Half, BFloat16, Float, Double "
              "and complex tensors, not ",
              dtype, " (as NCCL's)");
  switch (op.op_) {
    case c10d::ReduceOp::SUM:
    case c10d::ReduceOp::PREMUL_SUM:
      return tpu::ReduceOp::kSum;
    case c10d::ReduceOp::AVG:
      return tpu::ReduceOp::kAvg;
    case c10d::ReduceOp::PRODUCT:
      return tpu::ReduceOp::kProduct;
    case c10d::ReduceOp::MIN:
      return tpu::ReduceOp::kMin;
    case c10d::ReduceOp::MAX:
      return tpu::ReduceOp::kMax;
    case c10d::ReduceOp::BAND:
      return tpu::ReduceOp::kBand;
    case c10d::ReduceOp::BOR:
      return tpu::ReduceOp::kBor;
    case c10d::ReduceOp::BXOR:
      return tpu::ReduceOp::kBxor;
    default:
      TORCH_CHECK(false, "tpu backend: ", ReduceOpName(op.op_),
                  " is not a reduce op the tpu backend supports (SUM, AVG, "
                  "PRODUCT, MIN, MAX, BAND, BOR, BXOR and PREMUL_SUM are)");
  }
}

tpu::ReduceOp ReduceInPlace(const c10d::ReduceOp& op, const at::Tensor& t) {
  const tpu::ReduceOp r = ToReduceOp(op, t.scalar_type());
  if (op.op_ == c10d::ReduceOp::PREMUL_SUM) Scale(op, t, /*in_place=*/true);
  return r;
}

at::Tensor PreMultiplied(const c10d::ReduceOp& op, const at::Tensor& t) {
  if (op.op_ != c10d::ReduceOp::PREMUL_SUM) return t;
  return Scale(op, t, /*in_place=*/false);
}

}  // namespace torch_tpu
