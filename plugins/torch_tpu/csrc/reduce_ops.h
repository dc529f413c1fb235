// torch.distributed's reduce ops on the "tpu" backend: the ones tpud
// reduces itself, and PREMUL_SUM, which the backend runs as a SUM of inputs
// it first multiplies by the factor (tpud never sees the factor).
#pragma once

#include <ATen/core/Tensor.h>

#include <string>
#include <torch/csrc/distributed/c10d/Types.hpp>

#include "tpu/op_record.h"

namespace torch_tpu {

// `op` as Python spells it, for messages: "SUM", "BAND", "PREMUL_SUM",
// "UNUSED" (an op without a name: "reduce op 12").
std::string ReduceOpName(c10d::ReduceOp::RedOpType op);

// The tpud op that reduces tensors of `dtype` by `op` (PREMUL_SUM: kSum,
// once the inputs carry the factor). Raises, naming the op and the dtype,
// what NCCL and gloo refuse too: the bitwise ops take integer and bool
// tensors; PREMUL_SUM takes half, bfloat16, float, double and complex
// ones. Other dtypes are tpud's to check.
tpu::ReduceOp ToReduceOp(const c10d::ReduceOp& op, at::ScalarType dtype);

// ToReduceOp for a buffer the collective overwrites (all_reduce's, or a
// temporary): applies PREMUL_SUM's factor to `t` itself first, as tpu ops
// on the current stream.
tpu::ReduceOp ReduceInPlace(const c10d::ReduceOp& op, const at::Tensor& t);

// An input the caller keeps (reduce's, reduce_scatter's): `t` times
// PREMUL_SUM's factor as a new tensor, or `t` itself for any other op.
// REQUIRES: ToReduceOp(op, t.scalar_type()) did not raise.
at::Tensor PreMultiplied(const c10d::ReduceOp& op, const at::Tensor& t);

}  // namespace torch_tpu
