// Reduction arithmetic of collectives over the wire's dtypes (tpu/dtype.h):
// what all_reduce, reduce and reduce_scatter compute per element, as torch's
// NCCL backend does (integers wrap, NaN propagates through min and max,
// bool sums are "or", half and bfloat16 round through float), and the
// bitwise and/or/xor of integer and bool tensors as gloo's does.
#ifndef TPUD_DAEMON_COLLECTIVES_REDUCTION_H_
#define TPUD_DAEMON_COLLECTIVES_REDUCTION_H_

#include <cstdint>

#include "absl/status/status.h"
#include "tpu/dtype.h"
#include "tpu/op_record.h"

namespace tpud {

// OK when `op` can reduce tensors of `dtype`; INVALID_ARGUMENT saying why
// not (avg of bool, min/max of complex, bitwise ops of floating-point and
// complex tensors, dtypes without arithmetic here).
absl::Status CheckReducible(tpu::DType dtype, tpu::ReduceOp op);

// dst[i] = dst[i] op src[i] for i < count (avg adds; DivideBy finishes it).
// REQUIRES: CheckReducible(dtype, op) is OK (otherwise nothing is written).
void ReduceInto(tpu::DType dtype, tpu::ReduceOp op, char* dst, const char* src,
                uint64_t count);

// dst[i] /= n for i < count: the last step of avg.
void DivideBy(tpu::DType dtype, char* dst, uint64_t count, uint64_t n);

}  // namespace tpud

#endif  // TPUD_DAEMON_COLLECTIVES_REDUCTION_H_
