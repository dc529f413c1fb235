// Planning an op: its lowering to StableHLO, how each parameter of the
// program is fed, and what comes back, compiled unless the plan is for a
// graph's program (which is compiled whole). PjrtChip::Run and PlanOp
// (pjrt_chip.cc) share it; nothing here runs.
#include <algorithm>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "daemon/backends/pjrt/compile_cache.h"
#include "daemon/backends/pjrt/lowering/helpers.h"
#include "daemon/backends/pjrt/lowering/lowering.h"
#include "daemon/backends/pjrt/lowering/registry.h"
#include "daemon/backends/pjrt/pjrt_chip.h"
#include "daemon/backends/pjrt/pjrt_op.h"
#include "daemon/backends/pjrt/plan.h"

namespace tpud::pjrt {

void Plan::SetText(absl::string_view text) {
  text_hash[0] = StableHash64(text);
  text_hash[1] = StableHash64(text, 0x9e3779b97f4a7c15ULL);
}
namespace {

bool Contiguous(const tpu::TensorRef& r) {
  int64_t expect = 1;
  for (int d = r.ndim - 1; d >= 0; --d) {
    if (r.sizes[d] != 1 && r.strides[d] != expect) return false;
    expect *= r.sizes[d];
  }
  return true;
}

}  // namespace

absl::Status PjrtChip::LowerPlan(const OpSite& site, bool compile,
                                 Plan* plan_out) {
  const PjrtOp& op = *site.op;
  const tpu::DecodedOp& decoded = *site.decoded;
  const std::vector<ResolvedTensor>& tensors = *site.tensors;
  const std::vector<const tpu::TensorRef*>& refs = site.refs;
  const std::vector<size_t>& ref_index = site.ref_index;
  const absl::InlinedVector<uintptr_t, 8>& raw = site.raw;
  const int device = site.device;
  const bool host_devices = site.host_devices;
  const Rule* single = op.rule();
  const MultiRule* multi = op.multi_rule();
  Plan& plan = *plan_out;
  Lowering l(op.name(), decoded, tensors, &op.arg_names());
  if (multi == nullptr && refs.size() != 1) {
    return Unsupported(op.name(), absl::StrCat(refs.size(), " outputs"));
  }
  // complex32 tensors are carried as raw 4-byte elements that only copy_
  // converts (lowering.h, kHloTypes).
  if (op.name() != "aten::copy_") {
    const auto chalf = [](const tpu::TensorRef& r) {
      return r.dtype == tpu::Code(tpu::DType::kComplexHalf);
    };
    bool any = false;
    for (const tpu::TensorRef* r : refs) any |= chalf(*r);
    for (size_t a = 0; a < decoded.num_args; ++a) {
      const tpu::OpArg& arg = decoded.args[a];
      if (arg.tag == tpu::ArgTag::kTensor) any |= chalf(arg.tensor);
      for (const tpu::TensorRef& r : arg.tensors) any |= chalf(r);
    }
    if (any) {
      return Unsupported(op.name(),
                         "complex32 (chalf) tensors, which the PJRT backend "
                         "only copies and converts");
    }
  }
  std::vector<Target> outs(refs.size());
  std::vector<char*> dsts(refs.size());
  // A written tensor whose layout is dense in some order of its dimensions
  // (a transpose, channels-last) gets its result transposed into that order.
  std::vector<std::vector<int64_t>> orders(refs.size());
  // One with gaps between its elements (a diagonal, a slice with a step, a
  // column of a row-major matrix) is read whole over its span and its
  // elements scattered into it, so the gaps keep their bytes.
  std::vector<int64_t> spans(refs.size(), 0);
  for (size_t o = 0; o < refs.size(); ++o) {
    const tpu::TensorRef& r = *refs[o];
    outs[o].ref = &r;
    outs[o].type = DTypeOf(r.dtype);
    if (outs[o].type == nullptr) {
      return Unsupported(op.name(), absl::StrCat("output dtype ", int(r.dtype),
                                                 " is not lowered"));
    }
    outs[o].dims.assign(r.sizes, r.sizes + r.ndim);
    // (An empty one has no elements to overlap, whatever its strides.)
    if (!Contiguous(r) && Numel(r) > 0) {
      std::vector<int64_t>& order = orders[o];
      for (int d = 0; d < r.ndim; ++d) order.push_back(d);
      std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) {
        return r.strides[a] > r.strides[b];
      });
      int64_t expect = 1;
      bool dense = true;
      for (int k = r.ndim - 1; k >= 0; --k) {
        const int64_t d = order[k];
        if (r.sizes[d] != 1 && r.strides[d] != expect) dense = false;
        expect *= r.sizes[d];
      }
      if (!dense) {
        const std::vector<int64_t> by_stride = std::move(order);
        order.clear();
        // Elements apart: walking the dimensions from the smallest stride,
        // each stride passes the whole extent of the dimensions before it.
        int64_t extent = 0;  // the last element's offset so far
        for (int k = r.ndim - 1; k >= 0; --k) {
          const int64_t d = by_stride[k];
          if (r.sizes[d] == 1) continue;
          if (r.strides[d] <= extent) {
            return Unsupported(op.name(),
                               "writing a tensor whose elements overlap");
          }
          extent += (r.sizes[d] - 1) * r.strides[d];
        }
        spans[o] = extent + 1;
      }
    }
    // Nothing to write: an empty result, or one the client did not ask for
    // (an output slot without memory, e.g. a masked gradient).
    if (Numel(r) == 0) continue;
    if (ref_index[o] < tensors.size() &&
        tensors[ref_index[o]].segment_bytes == 0 && r.address == 0)
      continue;
    absl::StatusOr<char*> dst = l.HostOf(r, ref_index[o]);
    if (!dst.ok()) return dst.status();
    dsts[o] = *dst;
  }
  // How a written result lies in memory: its span when scattered into one,
  // else its dimensions in the order of their strides.
  auto stored_dims = [&](size_t o) {
    if (spans[o] > 0) return std::vector<int64_t>{spans[o]};
    std::vector<int64_t> stored = outs[o].dims;
    for (size_t d = 0; d < orders[o].size(); ++d)
      stored[d] = outs[o].dims[orders[o][d]];
    return stored;
  };
  // (index.Tensor's rule reads its list of index tensors itself.)
  if (multi == nullptr && !op.takes_list()) {
    for (size_t a = 0; a < decoded.num_args; ++a) {
      const tpu::ArgTag t = decoded.args[a].tag;
      if (t == tpu::ArgTag::kTensorList ||
          t == tpu::ArgTag::kOptionalTensorList) {
        return Unsupported(op.name(),
                           "tensor lists are not lowered for this op");
      }
    }
  }
  // Half-precision results (float16, bfloat16) are computed in float32 and
  // rounded once at the end, as ATen's CPU kernels do (their "opmath" type).
  std::vector<Target> compute = outs;
  for (Target& c : compute) {
    if (c.type->dtype == tpu::DType::kHalf ||
        c.type->dtype == tpu::DType::kBFloat16)
      c.type = DTypeOf(tpu::DType::kFloat);
  }
  // A written tensor wider than the op's own result (torch.add(bf16, 1,
  // out=float64 tensor)) gets the result as ATen computes it: in the
  // inputs' half-precision type, then cast. Taken as that type when every
  // tensor input has it, the op takes no dtype= and its output is a
  // wider float.
  const HloType* natural = nullptr;
  if (!op.written().empty() && outs.size() == 1 && outs[0].type->is_float) {
    bool dtype_arg = false;
    for (size_t a = 0; a < decoded.num_args; ++a) {
      const tpu::OpArg& arg = decoded.args[a];
      if (arg.tag == tpu::ArgTag::kDtype) dtype_arg = true;
      if (arg.tag != tpu::ArgTag::kTensor ||
          static_cast<int>(a) == op.written()[0])
        continue;
      const HloType* at = DTypeOf(arg.tensor.dtype);
      if (at == nullptr || (natural != nullptr && natural != at)) {
        natural = nullptr;
        dtype_arg = true;
        break;
      }
      natural = at;
    }
    if (dtype_arg || natural == nullptr ||
        (natural->dtype != tpu::DType::kHalf &&
         natural->dtype != tpu::DType::kBFloat16) ||
        natural->bytes >= outs[0].type->bytes) {
      natural = nullptr;
    }
  }
  std::vector<std::string> values;
  if (multi != nullptr) {
    absl::StatusOr<std::vector<std::string>> v = (*multi)(l, decoded, compute);
    if (!v.ok()) return v.status();
    values = *std::move(v);
  } else {
    absl::StatusOr<std::string> v = (*single)(l, decoded, compute[0]);
    if (!v.ok()) return v.status();
    values.push_back(*v);
  }
  if (values.size() != outs.size()) {
    return absl::InternalError(absl::StrCat(op.name(), ": the lowering made ",
                                            values.size(), " results for ",
                                            outs.size(), " outputs"));
  }
  for (size_t o = 0; o < outs.size(); ++o) {
    if (natural != nullptr) {
      values[o] = l.Convert(
          l.Convert(values[o], outs[o].dims, *compute[o].type, *natural),
          outs[o].dims, *natural, *outs[o].type);
      continue;
    }
    values[o] =
        l.Convert(values[o], outs[o].dims, *compute[o].type, *outs[o].type);
  }
  std::vector<std::string> types;
  for (size_t o = 0; o < outs.size(); ++o) {
    if (spans[o] > 0 && dsts[o] != nullptr) {
      const std::vector<int64_t> strides(refs[o]->strides,
                                         refs[o]->strides + refs[o]->ndim);
      const std::string flat = l.Flat(dsts[o], *outs[o].type, spans[o]);
      values[o] = l.ScatterStrided(flat, spans[o], values[o], outs[o].dims,
                                   strides, *outs[o].type);
      types.push_back(TypeOf({spans[o]}, *outs[o].type));
      continue;
    }
    std::vector<int64_t> stored = outs[o].dims;
    if (!orders[o].empty()) {
      for (size_t d = 0; d < orders[o].size(); ++d)
        stored[d] = outs[o].dims[orders[o][d]];
      values[o] =
          l.Emit(absl::StrCat("stablehlo.transpose ", values[o], ", dims = [",
                              absl::StrJoin(orders[o], ", "), "] : (",
                              TypeOf(outs[o].dims, *outs[o].type), ") -> ",
                              TypeOf(stored, *outs[o].type)));
    }
    types.push_back(TypeOf(stored, *outs[o].type));
  }
  // Results land in place: each dense result whose memory the plugin can
  // alias (XLA's CPU plugin: 64-byte aligned) is donated, so the program
  // writes it where it lies; the others are copied back after the run.
  std::vector<bool> donated(outs.size(), false);
  for (size_t o = 0; o < outs.size(); ++o) {
    if (!host_devices || dsts[o] == nullptr ||
        reinterpret_cast<uintptr_t>(dsts[o]) % 64 != 0)
      continue;
    l.Donate(static_cast<int>(o), dsts[o], *outs[o].type, stored_dims(o));
    donated[o] = true;
  }
  // Index checks come back as one more result, after the op's own.
  const bool checked = !l.out_of_range().empty();
  if (checked) {
    values.push_back(l.out_of_range());
    types.push_back(TypeOf({}, *DTypeOf(tpu::DType::kBool)));
  }
  std::string program;
  // Device memory: the program takes the segments its tensors lie in (see
  // Lowering::DeviceProgram); in_seg[i] is transfer i's, -1 for a scalar.
  std::vector<int> in_seg;
  if (device_memory_) {
    std::vector<Lowering::SegmentParam> segs;
    std::vector<uint64_t> seg_address;
    auto segment_of = [&](const char* p, uint64_t* offset) -> int {
      for (size_t k = 0; k < tensors.size(); ++k) {
        const ResolvedTensor& rt = tensors[k];
        if (rt.segment_bytes == 0 || p < rt.segment_host_base ||
            p >= rt.segment_host_base + rt.segment_bytes)
          continue;
        *offset = static_cast<uint64_t>(p - rt.segment_host_base);
        for (size_t j = 0; j < seg_address.size(); ++j) {
          if (seg_address[j] == rt.segment_address) return static_cast<int>(j);
        }
        seg_address.push_back(rt.segment_address);
        segs.push_back({rt.segment_bytes, -1});
        plan.segs.push_back({static_cast<int>(k), -1});
        return static_cast<int>(segs.size() - 1);
      }
      return -1;
    };
    std::vector<uint64_t> in_off;
    for (const Transfer& x : l.transfers()) {
      uint64_t offset = 0;
      in_seg.push_back(x.data == nullptr ? -1 : segment_of(x.data, &offset));
      in_off.push_back(offset);
      if (x.data != nullptr && in_seg.back() < 0) {
        return absl::InternalError(absl::StrCat(
            op.name(), ": a parameter outside every segment of the op"));
      }
    }
    std::vector<Lowering::SegmentWrite> writes;
    for (size_t o = 0; o < outs.size(); ++o) {
      if (dsts[o] == nullptr) continue;
      uint64_t offset = 0;
      const int j = segment_of(dsts[o], &offset);
      if (j < 0)
        return absl::InternalError(absl::StrCat(
            op.name(), ": a result outside every segment of the op"));
      if (segs[j].result < 0) segs[j].result = plan.segments_written++;
      writes.push_back({values[o], stored_dims(o), outs[o].type, j, offset});
    }
    for (size_t j = 0; j < segs.size(); ++j)
      plan.segs[j].result = segs[j].result;
    std::vector<std::string> extra, extra_types;
    if (checked) {
      extra.push_back(l.out_of_range());
      extra_types.push_back(TypeOf({}, *DTypeOf(tpu::DType::kBool)));
    }
    if (writes.empty() && !checked)
      return Unsupported(op.name(), "no result to write");
    // Offsets are parameters where each read and write starts at a tensor
    // of the record: the program then serves the op wherever they lie.
    bool dynamic = true;
    for (size_t i = 0; i < l.transfers().size() && dynamic; ++i) {
      if (in_seg[i] < 0) continue;
      const auto at =
          std::find(raw.begin(), raw.end(),
                    reinterpret_cast<uintptr_t>(l.transfers()[i].data));
      dynamic = at != raw.end();
      if (dynamic) plan.offset_k.push_back(static_cast<int>(at - raw.begin()));
    }
    for (size_t o = 0; o < outs.size() && dynamic; ++o) {
      if (dsts[o] == nullptr) continue;
      dynamic = reinterpret_cast<uintptr_t>(dsts[o]) == raw[ref_index[o]];
      plan.offset_k.push_back(static_cast<int>(ref_index[o]));
    }
    if (!dynamic) {
      plan.offset_k.clear();
      plan.keep = false;
      for (size_t i = 0; i < in_off.size(); ++i) {
        if (in_seg[i] >= 0) absl::StrAppend(&plan.fixed, " ", in_off[i]);
      }
      for (const Lowering::SegmentWrite& w : writes)
        absl::StrAppend(&plan.fixed, " ", w.offset);
    }
    absl::StatusOr<ProgramPieces> pieces = l.DeviceProgram(
        segs, in_seg, in_off, writes, extra, extra_types, dynamic);
    if (!pieces.ok()) return pieces.status();
    program = pieces->Module();
    plan.SetText(program);
    plan.device = true;
    plan.program = *std::move(pieces);
    plan.on_device = device;
  } else {
    program = l.Text(values, types);
  }
  // (A graph's op is compiled only within the graph's program.)
  if (compile) {
    absl::StatusOr<std::shared_ptr<const Executable>> exe =
        Compiled(program, device);
    if (!exe.ok()) {
      return absl::Status(
          exe.status().code(),
          absl::StrCat(op.name(), ": ", exe.status().message()));
    }
    plan.exe = *std::move(exe);
  }
  plan.checked = checked;
  plan.range_message = l.range_message();
  for (size_t o = 0; o < outs.size(); ++o) {
    const size_t bytes =
        static_cast<size_t>(spans[o] > 0 ? spans[o] : Numel(*refs[o])) *
        outs[o].type->bytes;
    plan.outputs.push_back(
        {dsts[o] != nullptr, bytes, static_cast<bool>(donated[o])});
    if (dsts[o] != nullptr) plan.used.push_back(static_cast<int>(ref_index[o]));
  }
  // Each parameter by where it reads: a tensor of the record (by the host
  // address it has now), a scalar, or (a plan that is not kept) the bytes.
  for (size_t i = 0; i < l.transfers().size(); ++i) {
    const Transfer& x = l.transfers()[i];
    if (plan.device && in_seg[i] >= 0) {
      // Read inside the program from its segment: only checked here.
      const auto at = std::find(raw.begin(), raw.end(),
                                reinterpret_cast<uintptr_t>(x.data));
      if (at != raw.end())
        plan.used.push_back(static_cast<int>(at - raw.begin()));
      continue;
    }
    Plan::In in;
    static_cast<Transfer&>(in) = x;
    if (x.data == nullptr) {
      in.k = -1;
    } else {
      const auto at = std::find(raw.begin(), raw.end(),
                                reinterpret_cast<uintptr_t>(x.data));
      if (at == raw.end()) {
        in.k = -2;
        plan.keep = false;
      } else {
        in.k = static_cast<int>(at - raw.begin());
        in.data = nullptr;
        plan.used.push_back(in.k);
      }
    }
    plan.inputs.push_back(std::move(in));
  }
  return absl::OkStatus();
}

}  // namespace tpud::pjrt
