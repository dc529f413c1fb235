// The wire form of ATen values: how a tensor, an argument and an op's name
// travel to tpud in an op record (tpu/op_record.h). Used by the forwarding
// path (forwarding.cc) and the native kernels that talk to the daemon.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/core/function_schema.h>
#include <ATen/core/ivalue.h>
#include <c10/core/Device.h>
#include <c10/core/Scalar.h>

#include <cstdint>

#include "tpu/op_record.h"

namespace torch_tpu {

// Writes t's wire form into *r: its sizes and strides up to its rank (the
// rest of the arrays is neither written nor sent). Refuses a tensor with a
// lazy conjugate or negative bit, and one of more than tpu::kMaxDims
// dimensions.
void RefInto(const at::Tensor& t, tpu::TensorRef* r);
tpu::TensorRef RefOf(const at::Tensor& t);

// The value of a host scalar tensor (a Python number wrapped by an op like
// `x + 1`, or a CPU 0-dim tensor), read from its memory.
at::Scalar HostScalarValue(const at::Tensor& t);

// Writes argument `index` of `schema` (its value `v`) over `a`, an argument
// slot kept from an earlier op: what it held is cleared first. A generator
// argument (or none, for an optional one) draws the seed this op uses, from
// `device`'s default generator when the op names none.
void ArgToWire(const c10::IValue& v, const c10::FunctionSchema& schema,
               size_t index, c10::DeviceIndex device, tpu::OpArg& a);

// The daemon's id of an operator (defined with the session on first use,
// then interned).
uint32_t OpIdFor(const c10::FunctionSchema& schema);
uint32_t OpIdFor(const char* name, const char* overload);

}  // namespace torch_tpu
