// A lowered op as PjrtChip keeps it (by its signature) and runs it.
#ifndef TPUD_DAEMON_BACKENDS_PJRT_PLAN_H_
#define TPUD_DAEMON_BACKENDS_PJRT_PLAN_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/container/inlined_vector.h"
#include "absl/strings/string_view.h"
#include "daemon/backends/chip_backend.h"
#include "daemon/backends/pjrt/lowering/lowering.h"
#include "daemon/backends/pjrt/pjrt_op.h"
#include "daemon/backends/pjrt/pjrt_plugin.h"
#include "tpu/op_record.h"

namespace tpud::pjrt {

// A lowered op, kept by its signature: the compiled program, where each
// parameter reads (a tensor of the record, by its index, or a scalar), and
// what comes back for each output.
struct Plan {
  // A parameter as the lowering made it; `data` is kept only for k = -2
  // (the record's tensors move between ops: a kept plan finds them by k).
  struct In : Transfer {
    int k = -1;  // the record's tensor k; -1: a scalar; -2: `data` (a plan not
                 // kept)
  };
  struct Out {
    bool write = false;  // has memory to write
    size_t bytes = 0;
    bool donated = false;
  };
  std::shared_ptr<const Executable> exe;
  std::vector<In> inputs;
  std::vector<Out> outputs;
  std::vector<int> used;  // the tensors read or written, by index
  // Device memory: the program's first parameters are segments, each named
  // by a record tensor k that lies in it; `result` >= 0 for a segment the
  // program writes (donated, and returned as that result). `inputs` then
  // holds only the other parameters (scalars).
  struct Seg {
    int k = -1;
    int result = -1;
  };
  bool device = false;
  std::vector<Seg> segs;
  int segments_written = 0;
  bool checked = false;
  std::string range_message;
  bool keep = true;
  // Device memory: the program in pieces (a graph's module is composed of
  // its ops' programs: PjrtChip::RunProgram) and the device it is for.
  ProgramPieces program;
  // Hashes of the op's own module as text (two seeds of StableHash64):
  // what a graph's module takes from this plan (plans that differ only in
  // their scalars' values share it), so that it keys the graph.
  uint64_t text_hash[2] = {0, 0};
  void SetText(absl::string_view text);
  int on_device = 0;
  // Device memory: the record tensor whose place in its segment each offset
  // parameter (the program's last) is, reads then writes; or, where a read
  // does not start at a tensor of the record, `fixed` (the offsets are in
  // the program, which is then not kept).
  std::vector<int> offset_k;
  std::string fixed;
};

// An op as planning and running both start from it (PjrtChip::Locate):
// where its results go and where each of its tensors lies.
struct OpSite {
  const PjrtOp* op = nullptr;
  const tpu::DecodedOp* decoded = nullptr;
  const std::vector<ResolvedTensor>* tensors = nullptr;
  // Where results go: the written argument (self of an in-place op, out of
  // an out= op; each element of a written list), else the op's outputs;
  // and each one's position in `tensors`.
  std::vector<const tpu::TensorRef*> refs;
  std::vector<size_t> ref_index;
  // Every tensor of the record, in the order of `tensors`, and where its
  // first element would lie (unchecked; 0 without memory).
  absl::InlinedVector<const tpu::TensorRef*, 8> all_refs;
  absl::InlinedVector<uintptr_t, 8> raw;
  int device = 0;  // the plugin's device the op runs on
  // The plugin's devices are the host (XLA's CPU plugin without device
  // memory): buffers can alias the arena.
  bool host_devices = false;
  bool keyed = false;  // has a signature (PjrtChip::key_) to keep a plan by
  bool empty = false;  // no output has elements: nothing to compute
};

}  // namespace tpud::pjrt

#endif  // TPUD_DAEMON_BACKENDS_PJRT_PLAN_H_
