// SimulatedChip: the chip backend that runs ATen CPU kernels on HBM viewed as
// CPU tensors. The default backend, and the only one on hosts without TPUs.
//
// An op's tensor references become CPU tensors over the session's segment
// memory (no copy); the op runs through the ATen dispatcher at the CPU key,
// with autograd off. Each tensor's storage ends where its footprint ends (a
// kernel cannot grow an out= argument over its neighbours), and the storages
// of one segment are marked as aliases of one allocation, so ATen's aliasing
// and overlap checks see tensors in one segment as related.
//
// Returned values, in the order the schema returns them, flattened (a
// Tensor[] return counts as one value per element):
//  - each value of tensor type (Tensor, Tensor?, an element of Tensor[])
//    takes the next output slot, whether it is defined or not; values of other
//    types (int, float, bool, Scalar, ...) take none;
//  - a tensor that is one of the op's arguments (same data, sizes, strides and
//    dtype: in-place and out= results) is left where it is;
//  - any other tensor is copied into decoded.outputs[slot] when the client
//    allocated that slot (dtype and sizes must match exactly), and otherwise
//    only reported (the synchronous path) from memory taken from the
//    ResultAllocator. A reported tensor with no elements has address 0 and
//    takes no memory.
//
// Elementwise _foreach_ ops over same-dtype contiguous tensors run packed:
// each list copied end to end into one buffer, the op called once on those
// (see packed_foreach_runs below). Arithmetic gives the values ATen gives
// tensor by tensor bit for bit; transcendental functions may differ in the
// last bit (vector loop here, scalar tail there).
//
// This header does not include ATen; simulated_chip.cc does.
#ifndef TPUD_DAEMON_BACKENDS_SIMULATED_SIMULATED_CHIP_H_
#define TPUD_DAEMON_BACKENDS_SIMULATED_SIMULATED_CHIP_H_

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "daemon/backends/chip_backend.h"
#include "tpu/op_record.h"

namespace tpud {

class SimulatedOp;  // defined in simulated_chip.cc

class SimulatedChip : public ChipBackend {
 public:
  // `intra_op_threads` > 0 sets ATen's intra-op thread count with
  // at::set_num_threads. That setting is process-wide: it applies to every
  // SimulatedChip (and any other ATen use) in the process, and only the first
  // Create with a positive count sets it; later counts are ignored. 0 leaves
  // ATen's default (OMP_NUM_THREADS, else one thread per physical core), for
  // the executor to share out (set_intra_op_threads).
  static std::unique_ptr<SimulatedChip> Create(int intra_op_threads);

  // ATen's intra-op thread count (at::get_num_threads), and setting it
  // (at::set_num_threads, when it differs): process-wide, as above. Its
  // next parallel region uses the new count. Defined in aten_threads.cc.
  int intra_op_threads() const override;
  void set_intra_op_threads(int n) override;

  // Checks that tpu::ElementSize (the wire format's table, used to check
  // footprints) agrees with c10::elementSize for every dtype tpud accepts.
  // INTERNAL naming the first dtype that differs.
  static absl::Status VerifyElementSizes();

  // "simulated (ATen CPU kernels)".
  std::string Describe() const override;

  // Finds the operator in ATen's dispatcher by name and overload and compares
  // its schema, as c10::toString prints it, with `schema` byte for byte.
  // Results are cached per schema string. Thread-safe.
  absl::StatusOr<std::shared_ptr<const BackendOp>> LookupOp(
      absl::string_view schema) override ABSL_LOCKS_EXCLUDED(mu_);

  // See ChipBackend::Run and the top of this file. REQUIRES: `op` came from
  // this backend's LookupOp. Thread-safe; keeps no state between calls
  // except per-thread scratch buffers.
  absl::Status Run(const BackendOp& op, const tpu::DecodedOp& decoded,
                   const std::vector<ResolvedTensor>& tensors,
                   std::vector<ResultValue>* results,
                   ResultAllocator* result_allocator) override;
  // The first warning of this thread's last Run (ChipBackend::TakeWarning).
  bool TakeWarning(std::string* message, bool* deprecation) override;

  // How many _foreach_ ops ran packed: each tensor list copied end to end
  // into one buffer and the op run as one kernel call over those (an
  // elementwise _foreach_ op over same-dtype contiguous tensors, whose
  // written tensors overlap nothing else). Others run tensor by tensor.
  uint64_t packed_foreach_runs() const {
    return packed_foreach_runs_.load(std::memory_order_relaxed);
  }

 private:
  SimulatedChip() = default;

  absl::Mutex mu_;
  std::atomic<uint64_t> packed_foreach_runs_{0};
  absl::flat_hash_map<std::string, std::shared_ptr<const SimulatedOp>> ops_
      ABSL_GUARDED_BY(mu_);
};

}  // namespace tpud

#endif  // TPUD_DAEMON_BACKENDS_SIMULATED_SIMULATED_CHIP_H_
