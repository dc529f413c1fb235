// Which ATen exception class an op's failure in tpud came from. The chip
// backends run ATen's kernels; the client raises the Python exception ATen
// would have raised (IndexError for a dimension out of range, TypeError,
// ValueError, ...), not a generic RuntimeError. It travels beside the status
// code in shared memory (RingControl::error_kind, response_kind) and as a
// payload of the absl::Status on either side.
#ifndef TPU_OP_ERROR_H_
#define TPU_OP_ERROR_H_

#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/cord.h"
#include "absl/strings/string_view.h"

namespace tpu {

enum class AtenError : uint32_t {
  kNone = 0,  // not an ATen exception (tpud's own errors, XLA's)
  kError,     // c10::Error: RuntimeError
  kIndex,     // c10::IndexError
  kValue,     // c10::ValueError
  kType,      // c10::TypeError
  kNotImplemented,
  kLinAlg,  // c10::LinAlgError: torch.linalg.LinAlgError
  kOutOfMemory,
  kCount,
};

inline constexpr absl::string_view kAtenErrorPayload =
    "type.tpud.dev/aten_error";

inline absl::Status WithAtenError(absl::Status status, AtenError kind) {
  if (!status.ok() && kind != AtenError::kNone) {
    status.SetPayload(kAtenErrorPayload,
                      absl::Cord(std::string(1, static_cast<char>(kind))));
  }
  return status;
}

// A value read from shared memory, which the client does not trust: out of
// range reads as kNone.
inline AtenError AtenErrorFromWire(uint32_t v) {
  return v < static_cast<uint32_t>(AtenError::kCount)
             ? static_cast<AtenError>(v)
             : AtenError::kNone;
}

inline AtenError AtenErrorOf(const absl::Status& status) {
  const auto p = status.GetPayload(kAtenErrorPayload);
  if (!p.has_value() || p->size() != 1) return AtenError::kNone;
  return AtenErrorFromWire(static_cast<unsigned char>((*p)[0]));
}

}  // namespace tpu

#endif  // TPU_OP_ERROR_H_
