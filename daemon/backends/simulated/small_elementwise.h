// Small float32 mul, add and sub computed without ATen: the bulk of many small
// eager programs (x * 0.5 + 1), cost several times their arithmetic in ATen's
// dispatch, TensorIterator and the views built for it. Here: contiguous float32
// tensors of one shape, or a tensor and a Python number (a wrapped scalar,
// which ATen casts to float first), into a contiguous float32 output of
// that shape, at most 65536 elements, alpha 1 (ATen fuses a + alpha * b into
// one fma, which equals a + b only for alpha 1). One IEEE operation per
// element, as ATen's kernels do: the same bits. Anything else, or an output
// partly overlapping an input, goes the usual way.
#ifndef TPUD_DAEMON_BACKENDS_SIMULATED_SMALL_ELEMENTWISE_H_
#define TPUD_DAEMON_BACKENDS_SIMULATED_SMALL_ELEMENTWISE_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/functional/function_ref.h"
#include "absl/status/statusor.h"
#include "daemon/backends/chip_backend.h"
#include "tpu/op_record.h"

namespace tpud {

enum class SmallElementwise : uint8_t { kNone, kMul, kAdd, kSub };

// The kind an op of this name ("aten::mul.Tensor") is, or kNone.
SmallElementwise SmallElementwiseOf(const std::string& name);

// Where a tensor's bytes are, after the simulated chip's checks on it.
using LocateFn = absl::FunctionRef<absl::Status(const tpu::TensorRef& ref,
                                                const ResolvedTensor& seg,
                                                char** data, uint64_t* bytes)>;

// Computes `decoded` (an op of `kind`) into its output and returns true when
// the record is of the form above; false when it is not (nothing written);
// an error when a tensor fails `locate`'s checks.
absl::StatusOr<bool> TrySmallElementwise(
    SmallElementwise kind, const tpu::DecodedOp& decoded,
    const std::vector<ResolvedTensor>& tensors, LocateFn locate);

}  // namespace tpud

#endif  // TPUD_DAEMON_BACKENDS_SIMULATED_SMALL_ELEMENTWISE_H_
