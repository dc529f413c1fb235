// Collectives among ranks on distinct devices as one replicated program;
// device memory's segment reads and writes.
#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <functional>
#include <map>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "daemon/backends/pjrt/lowering/helpers.h"
#include "daemon/backends/pjrt/lowering/lowering.h"
#include "daemon/backends/pjrt/lowering/registry.h"
#include "daemon/backends/pjrt/pjrt_chip.h"
#include "daemon/backends/pjrt/pjrt_op.h"
#include "daemon/backends/pjrt/plan.h"

namespace tpud::pjrt {

namespace {

// The scalar reduction `op` over tensor<E>, as an all_reduce-style region
// (the bitwise ops never come here: RunCollective leaves them to the arena).
std::string ReduceRegion(tpu::ReduceOp op, const std::string& e) {
  const char* fn = op == tpu::ReduceOp::kProduct ? "multiply"
                   : op == tpu::ReduceOp::kMin   ? "minimum"
                   : op == tpu::ReduceOp::kMax   ? "maximum"
                                                 : "add";  // sum, avg
  return absl::StrCat("({\n      ^bb0(%a: tensor<", e, ">, %b: tensor<", e,
                      ">):\n        %c = stablehlo.", fn, " %a, %b : tensor<",
                      e, ">\n        stablehlo.return %c : tensor<", e,
                      ">\n    })");
}

// The replicated program of one collective: replica r is rank r, with one
// parameter (its input, `in` elements of `t`) and one result (`out`
// elements). Reductions of half-precision types run in float32, rounded
// once, as ATen's CPU kernels compute them.
std::string CollectiveProgram(const CollectiveCall& call, const HloType& t,
                              int64_t in, int64_t out) {
  const int n = static_cast<int>(call.ranks.size());
  std::vector<std::string> ids;
  for (int r = 0; r < n; ++r) ids.push_back(std::to_string(r));
  const std::string groups =
      absl::StrCat("replica_groups = dense<[[", absl::StrJoin(ids, ", "),
                   "]]> : tensor<1x", n, "xi64>");
  const bool half =
      t.dtype == tpu::DType::kHalf || t.dtype == tpu::DType::kBFloat16;
  const HloType& c =
      half ? *DTypeOf(tpu::DType::kFloat) : t;  // the type reduced in
  std::string body;
  std::string x = "%x";
  if (half && call.kind != tpu::CollectiveKind::kAllGather &&
      call.kind != tpu::CollectiveKind::kBroadcast &&
      call.kind != tpu::CollectiveKind::kAllToAll) {
    absl::StrAppend(&body, "    %w = stablehlo.convert %x : (", TypeOf({in}, t),
                    ") -> ", TypeOf({in}, c), "\n");
    x = "%w";
  }
  switch (call.kind) {
    case tpu::CollectiveKind::kAllReduce:
    case tpu::CollectiveKind::kReduce:
      absl::StrAppend(&body, "    %r = \"stablehlo.all_reduce\"(", x, ") ",
                      ReduceRegion(call.reduce, c.mlir), " {", groups, "} : (",
                      TypeOf({in}, c), ") -> ", TypeOf({out}, c), "\n");
      break;
    case tpu::CollectiveKind::kReduceScatter:
      absl::StrAppend(&body, "    %r = \"stablehlo.reduce_scatter\"(", x, ") ",
                      ReduceRegion(call.reduce, c.mlir),
                      " {scatter_dimension = 0 : i64, ", groups, "} : (",
                      TypeOf({in}, c), ") -> ", TypeOf({out}, c), "\n");
      break;
    case tpu::CollectiveKind::kAllGather:
      absl::StrAppend(
          &body,
          "    %r = \"stablehlo.all_gather\"(%x) {all_gather_dim = 0 : i64, ",
          groups, "} : (", TypeOf({in}, t), ") -> ", TypeOf({out}, t), "\n");
      break;
    case tpu::CollectiveKind::kAllToAll:
      absl::StrAppend(&body,
                      "    %r = \"stablehlo.all_to_all\"(%x) {split_dimension "
                      "= 0 : i64, concat_dimension = 0 : i64, ",
                      "split_count = ", n, " : i64, ", groups, "} : (",
                      TypeOf({in}, t), ") -> ", TypeOf({out}, t), "\n");
      break;
    case tpu::CollectiveKind::kBroadcast: {
      // The root's bytes, the largest against every other replica's zeros
      // (unsigned): exact for every value, signed zeros and NaN payloads
      // included. (XLA's CPU all_reduce has no bitwise or.)
      absl::StrAppend(
          &body, "    %id = stablehlo.replica_id : tensor<ui32>\n",
          "    %root = stablehlo.constant dense<", call.root,
          "> : tensor<ui32>\n",
          "    %is = stablehlo.compare EQ, %id, %root : (tensor<ui32>, "
          "tensor<ui32>) -> tensor<i1>\n",
          "    %mask = stablehlo.broadcast_in_dim %is, dims = [] : "
          "(tensor<i1>) -> ",
          TypeOf({in}, *DTypeOf(tpu::DType::kBool)),
          "\n    %zero = stablehlo.constant dense<0> : ", TypeOf({in}, t), "\n",
          "    %mine = stablehlo.select %mask, %x, %zero : ",
          TypeOf({in}, *DTypeOf(tpu::DType::kBool)), ", ", TypeOf({in}, t),
          "\n",
          "    %r = \"stablehlo.all_reduce\"(%mine) ({\n      ^bb0(%a: "
          "tensor<ui8>, %b: tensor<ui8>):\n",
          "        %c = stablehlo.maximum %a, %b : tensor<ui8>\n        "
          "stablehlo.return %c : tensor<ui8>\n    }) {",
          groups, "} : (", TypeOf({in}, t), ") -> ", TypeOf({out}, t), "\n");
      break;
    }
    default:
      break;
  }
  std::string r = "%r";
  if (call.reduce == tpu::ReduceOp::kAvg &&
      (call.kind == tpu::CollectiveKind::kAllReduce ||
       call.kind == tpu::CollectiveKind::kReduce ||
       call.kind == tpu::CollectiveKind::kReduceScatter)) {
    absl::StrAppend(&body, "    %n = stablehlo.constant dense<", n,
                    c.is_float ? ".0" : "", "> : ", TypeOf({out}, c),
                    "\n    %q = stablehlo.divide %r, %n : ", TypeOf({out}, c),
                    "\n");
    r = "%q";
  }
  if (x == "%w") {
    absl::StrAppend(&body, "    %y = stablehlo.convert ", r, " : (",
                    TypeOf({out}, c), ") -> ", TypeOf({out}, t), "\n");
    r = "%y";
  }
  return absl::StrCat(
      "module @tpud_collective {\n  func.func public @main(%x: ",
      TypeOf({in}, t), ") -> ", TypeOf({out}, t), " {\n", body, "    return ",
      r, " : ", TypeOf({out}, t), "\n  }\n}\n");
}

// `count` values of t as u8[count * bytes] and back, inside a program.
std::string BytesToValues(const std::string& v, int64_t count, const HloType& t,
                          const std::string& name) {
  const HloType& u8 = *DTypeOf(tpu::DType::kUInt8);
  if (t.dtype == tpu::DType::kUInt8)
    return absl::StrCat("    ", name, " = stablehlo.reshape ", v, " : (",
                        TypeOf({count}, u8), ") -> ", TypeOf({count}, u8),
                        "\n");
  if (t.bytes == 1)
    return absl::StrCat("    ", name, " = stablehlo.bitcast_convert ", v,
                        " : (", TypeOf({count}, u8), ") -> ",
                        TypeOf({count}, t), "\n");
  return absl::StrCat(
      "    ", name, "_g = stablehlo.reshape ", v, " : (",
      TypeOf({count * t.bytes}, u8), ") -> ", TypeOf({count, t.bytes}, u8),
      "\n    ", name, " = stablehlo.bitcast_convert ", name, "_g : (",
      TypeOf({count, t.bytes}, u8), ") -> ", TypeOf({count}, t), "\n");
}
std::string ValuesToBytes(const std::string& v, int64_t count, const HloType& t,
                          const std::string& name) {
  const HloType& u8 = *DTypeOf(tpu::DType::kUInt8);
  if (t.dtype == tpu::DType::kUInt8)
    return absl::StrCat("    ", name, " = stablehlo.reshape ", v, " : (",
                        TypeOf({count}, u8), ") -> ", TypeOf({count}, u8),
                        "\n");
  if (t.bytes == 1)
    return absl::StrCat("    ", name, " = stablehlo.bitcast_convert ", v,
                        " : (", TypeOf({count}, t), ") -> ",
                        TypeOf({count}, u8), "\n");
  return absl::StrCat(
      "    ", name, "_g = stablehlo.bitcast_convert ", v, " : (",
      TypeOf({count}, t), ") -> ", TypeOf({count, t.bytes}, u8), "\n    ", name,
      " = stablehlo.reshape ", name, "_g : (", TypeOf({count, t.bytes}, u8),
      ") -> ", TypeOf({count * t.bytes}, u8), "\n");
}

}  // namespace

absl::StatusOr<Buffer> PjrtChip::ReadSegment(const ResolvedTensor& seg,
                                             uint64_t address, int64_t count,
                                             tpu::DType dtype, int device) {
  const HloType& t = *DTypeOf(dtype);
  const HloType& u8 = *DTypeOf(tpu::DType::kUInt8);
  const int64_t seg_bytes = static_cast<int64_t>(seg.segment_bytes);
  const int64_t offset = static_cast<int64_t>(address - seg.segment_address);
  const int64_t bytes = count * t.bytes;
  const std::string program = absl::StrCat(
      "module @tpud_read {\n  func.func public @main(%s: ",
      TypeOf({seg_bytes}, u8), ") -> ", TypeOf({count}, t),
      " {\n    %b = stablehlo.slice %s [", offset, ":", offset + bytes, "] : (",
      TypeOf({seg_bytes}, u8), ") -> ", TypeOf({bytes}, u8), "\n",
      BytesToValues("%b", count, t, "%v"),
      "    return %v : ", TypeOf({count}, t), "\n  }\n}\n");
  absl::StatusOr<std::shared_ptr<const Executable>> exe =
      Compiled(program, device);
  if (!exe.ok()) return exe.status();
  absl::StatusOr<Mirror*> m = MirrorOf(seg, device);
  if (!m.ok()) return m.status();
  PJRT_Buffer* arg = (*m)->buffer.get();
  absl::StatusOr<std::vector<Buffer>> out =
      plugin_->Execute(**exe, device, absl::MakeConstSpan(&arg, 1));
  if (!out.ok()) return out.status();
  if (out->size() != 1)
    return absl::InternalError("reading a segment gave no value");
  return std::move((*out)[0]);
}

absl::Status PjrtChip::WriteSegment(const ResolvedTensor& seg, uint64_t address,
                                    const Buffer& value, int64_t count,
                                    tpu::DType dtype, int device) {
  const HloType& t = *DTypeOf(dtype);
  const HloType& u8 = *DTypeOf(tpu::DType::kUInt8);
  const int64_t seg_bytes = static_cast<int64_t>(seg.segment_bytes);
  const int64_t offset = static_cast<int64_t>(address - seg.segment_address);
  const int64_t bytes = count * t.bytes;
  const std::string program = absl::StrCat(
      "module @tpud_write {\n  func.func public @main(%s: ",
      TypeOf({seg_bytes}, u8),
      " {tf.aliasing_output = 0 : i32}, %v: ", TypeOf({count}, t), ") -> ",
      TypeOf({seg_bytes}, u8), " {\n", ValuesToBytes("%v", count, t, "%b"),
      "    %at = stablehlo.constant dense<", offset,
      "> : tensor<i64>\n    %r = stablehlo.dynamic_update_slice %s, %b, %at : "
      "(",
      TypeOf({seg_bytes}, u8), ", ", TypeOf({bytes}, u8), ", tensor<i64>) -> ",
      TypeOf({seg_bytes}, u8), "\n    return %r : ", TypeOf({seg_bytes}, u8),
      "\n  }\n}\n");
  absl::StatusOr<std::shared_ptr<const Executable>> exe =
      Compiled(program, device);
  if (!exe.ok()) return exe.status();
  absl::StatusOr<Mirror*> m = MirrorOf(seg, device);
  if (!m.ok()) return m.status();
  PJRT_Buffer* args[2] = {(*m)->buffer.get(), value.get()};
  absl::StatusOr<std::vector<Buffer>> out =
      plugin_->Execute(**exe, device, absl::MakeConstSpan(args, 2));
  if (!out.ok()) {
    // The donated segment may be gone with the failed run.
    Drop(seg.segment_address, seg.segment_bytes);
    return out.status();
  }
  if (out->size() != 1)
    return absl::InternalError("writing a segment gave no segment");
  (*m)->buffer = std::move((*out)[0]);
  (*m)->host_current = false;
  return absl::OkStatus();
}

absl::StatusOr<bool> PjrtChip::RunCollective(const CollectiveCall& call) {
  using tpu::CollectiveKind;
  const int n = static_cast<int>(call.ranks.size());
  if (n < 2 || call.count == 0) return false;
  const bool reduces = call.kind == CollectiveKind::kAllReduce ||
                       call.kind == CollectiveKind::kReduce ||
                       call.kind == CollectiveKind::kReduceScatter;
  // Reductions in the tensor's type (bool, complex and unsigned 16/32/64
  // ones go through the arena, and so do the bitwise ops: XLA's all_reduce
  // knows add, multiply, minimum and maximum regions only); data movement as
  // bytes, any type.
  const HloType* type = DTypeOf(call.dtype);
  const int64_t esize = tpu::ElementSize(call.dtype);
  const bool bitwise = call.reduce == tpu::ReduceOp::kBand ||
                       call.reduce == tpu::ReduceOp::kBor ||
                       call.reduce == tpu::ReduceOp::kBxor;
  if (esize <= 0 ||
      (reduces && (type == nullptr || type->dtype == tpu::DType::kBool ||
                   IsComplex(*type) || bitwise)))
    return false;
  const HloType& t = reduces ? *type : *DTypeOf(tpu::DType::kUInt8);
  const int64_t per = reduces ? static_cast<int64_t>(call.count)
                              : static_cast<int64_t>(call.count) * esize;
  int64_t in = per, out = per;
  switch (call.kind) {
    case CollectiveKind::kAllReduce:
    case CollectiveKind::kReduce:
    case CollectiveKind::kBroadcast:
      break;
    case CollectiveKind::kAllGather:
      out = per * n;
      break;
    case CollectiveKind::kReduceScatter:
      in = per * n;
      break;
    case CollectiveKind::kAllToAll:
      // Even splits only (stablehlo.all_to_all's); uneven ones move in the
      // arena.
      if (call.send_counts.size() != static_cast<size_t>(n)) return false;
      for (const auto& row : call.send_counts) {
        for (int64_t c : row) {
          if (c != call.send_counts[0][0]) return false;
        }
      }
      in = out = call.send_counts[0][0] * esize * n;
      if (in == 0) return false;
      break;
    default:
      return false;  // gather, scatter, barrier, point-to-point
  }
  std::vector<int> devices(n);
  for (int r = 0; r < n; ++r) {
    devices[r] = call.ranks[r].chip;
    if (devices[r] < 0 || devices[r] >= plugin_->num_devices()) return false;
    for (int q = 0; q < r; ++q) {
      if (devices[q] == devices[r]) return false;  // two ranks on one device
    }
  }
  // What each rank contributes: its send buffer (a broadcast's other ranks
  // pass their recv buffer, masked out in the program) and where its result
  // goes (a reduce's only at the root).
  struct Input {
    uint64_t address, bytes;
    const ResolvedTensor* seg;
    char* host;
  };
  auto input_of = [&](int r) {
    const CollectiveRank& cr = call.ranks[r];
    if (call.kind != CollectiveKind::kBroadcast || r == call.root) {
      return Input{cr.send, cr.send_bytes, &cr.send_segment, cr.host_send};
    }
    return Input{cr.recv, cr.recv_bytes, &cr.recv_segment, cr.host_recv};
  };
  auto writes = [&](int r) {
    return call.kind != CollectiveKind::kReduce || r == call.root;
  };
  const uint64_t in_bytes = static_cast<uint64_t>(in) * t.bytes,
                 out_bytes = static_cast<uint64_t>(out) * t.bytes;
  for (int r = 0; r < n; ++r) {
    if (input_of(r).bytes != in_bytes ||
        (writes(r) && call.ranks[r].recv_bytes != out_bytes)) {
      return absl::InternalError(
          absl::StrCat("collective: rank ", r,
                       "'s buffers do not have the operation's size"));
    }
  }
  const std::string program = CollectiveProgram(call, t, in, out);
  absl::StatusOr<std::shared_ptr<const Executable>> exe =
      Compiled(program, devices[0], devices);
  if (!exe.ok()) return exe.status();
  std::vector<Buffer> inputs;
  std::vector<std::vector<PJRT_Buffer*>> args(n);
  for (int r = 0; r < n; ++r) {
    const Input x = input_of(r);
    absl::StatusOr<Buffer> b;
    if (device_memory_) {
      // Read out of the segment on the device; its host copy may be stale.
      b = ReadSegment(*x.seg, x.address, in, t.dtype, devices[r]);
    } else if (reinterpret_cast<uintptr_t>(x.host) % 64 == 0) {
      b = plugin_->Alias(devices[r], x.host, t.pjrt, {in}, /*writable=*/false);
    } else {
      b = plugin_->FromHost(devices[r], x.host, t.pjrt, {in});
    }
    if (!b.ok())
      return absl::Status(
          b.status().code(),
          absl::StrCat("rank ", r, "'s input: ", b.status().message()));
    args[r].push_back(b->get());
    inputs.push_back(*std::move(b));
  }
  absl::StatusOr<std::vector<std::vector<Buffer>>> results =
      plugin_->ExecuteReplicated(**exe, args);
  inputs.clear();
  if (!results.ok()) return results.status();
  for (int r = 0; r < n; ++r) {
    if (!writes(r)) continue;
    if ((*results)[r].size() != 1)
      return absl::InternalError("a collective program gave no result");
    const CollectiveRank& cr = call.ranks[r];
    absl::Status st =
        device_memory_
            ? WriteSegment(cr.recv_segment, cr.recv, (*results)[r][0], out,
                           t.dtype, devices[r])
            : plugin_->ToHost((*results)[r][0], cr.host_recv, out_bytes);
    if (!st.ok())
      return absl::Status(
          st.code(), absl::StrCat("rank ", r, "'s result: ", st.message()));
  }
  for (int d : devices) ++stats_[d].collectives;
  return true;
}

}  // namespace tpud::pjrt
