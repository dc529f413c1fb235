#include "daemon/backends/pjrt/pjrt_chip.h"

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

#include "absl/container/inlined_vector.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "daemon/backends/pjrt/lowering/helpers.h"
#include "daemon/backends/pjrt/lowering/lowering.h"
#include "daemon/backends/pjrt/lowering/registry.h"
#include "daemon/backends/pjrt/pjrt_op.h"
#include "daemon/backends/pjrt/plan.h"
#include "tpu/device_address.h"

namespace tpud::pjrt {

absl::StatusOr<std::unique_ptr<PjrtChip>> PjrtChip::Create(
    const std::string& plugin_path, const std::vector<CreateOption>& options,
    size_t cache_capacity, bool device_memory) {
  absl::StatusOr<std::unique_ptr<PjrtPlugin>> p =
      PjrtPlugin::Load(plugin_path, options);
  if (!p.ok()) return p.status();
  return std::unique_ptr<PjrtChip>(new PjrtChip(
      *std::move(p), std::max<size_t>(1, cache_capacity), device_memory));
}

PjrtChip::~PjrtChip() = default;

std::string PjrtChip::Describe() const {
  return absl::StrCat("PJRT (", plugin_->Describe(), ")");
}

absl::StatusOr<std::shared_ptr<const BackendOp>> PjrtChip::LookupOp(
    absl::string_view schema) {
  const size_t paren = schema.find('(');
  if (paren == absl::string_view::npos || paren == 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("not an operator schema: ", schema));
  }
  std::string name(schema.substr(0, paren));
  // Every op is accepted here; one without a lowering fails when it runs,
  // naming itself (so a session can go on with the ops that have one).
  return std::make_shared<PjrtOp>(std::string(schema), std::move(name),
                                  WrittenArguments(schema));
}

absl::StatusOr<std::shared_ptr<const Executable>> PjrtChip::Compiled(
    const std::string& program, int device, const std::vector<int>& replicas) {
  CompileStats& st = stats_[replicas.empty() ? device : replicas[0]];
  // A replicated program is kept by its devices too.
  std::string replicated_key;
  if (!replicas.empty())
    replicated_key =
        absl::StrCat("replicas ", absl::StrJoin(replicas, ","), "\n", program);
  const std::string& key = replicas.empty() ? program : replicated_key;
  auto it = cache_.find(key);
  if (it != cache_.end()) {
    lru_.splice(lru_.end(), lru_, it->second);
    ++st.hits;
    return it->second->second;
  }
  const auto t0 = std::chrono::steady_clock::now();
  absl::StatusOr<std::unique_ptr<Executable>> exe =
      replicas.empty() ? plugin_->Compile(program)
                       : plugin_->CompileReplicated(program, replicas);
  st.compile_ns += std::chrono::duration_cast<std::chrono::nanoseconds>(
                       std::chrono::steady_clock::now() - t0)
                       .count();
  ++st.compiles;
  if (!exe.ok()) return exe.status();
  if (!replicas.empty() && (*exe)->replica_devices() != replicas) {
    // Argument lists follow the executable's order; tpud gives them by rank.
    return absl::InternalError(
        absl::StrCat("the plugin placed the replicas on devices ",
                     absl::StrJoin((*exe)->replica_devices(), ","), ", not ",
                     absl::StrJoin(replicas, ",")));
  }
  if (lru_.size() >= capacity_) {
    cache_.erase(lru_.front().first);
    lru_.pop_front();
  }
  lru_.emplace_back(key, std::shared_ptr<const Executable>(*std::move(exe)));
  cache_[key] = std::prev(lru_.end());
  return lru_.back().second;
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

// Where a key is built: its pieces (a few dozen small ones per op) gather
// in a local buffer and reach the string in one append.
class KeySink {
 public:
  explicit KeySink(std::string* out) : out_(out) { out_->clear(); }
  ~KeySink() { Flush(); }
  KeySink(const KeySink&) = delete;
  KeySink& operator=(const KeySink&) = delete;
  void Bytes(const void* p, size_t n) {
    if (n > sizeof(buf_) - used_) {
      Flush();
      if (n > sizeof(buf_)) {
        out_->append(static_cast<const char*>(p), n);
        return;
      }
    }
    std::memcpy(buf_ + used_, p, n);
    used_ += n;
  }
  void Flush() {
    out_->append(buf_, used_);
    used_ = 0;
  }

 private:
  std::string* out_;
  size_t used_ = 0;
  char buf_[1024];
};

void KeyBytes(KeySink* key, const void* p, size_t n) { key->Bytes(p, n); }

// A buffer kept over arena memory: its device, place, type, dims and
// whether it is the kind that is donated. Written into *id (a string kept
// by the caller, so that a lookup allocates nothing).
void ResidentKey(int device, const char* at, PJRT_Buffer_Type type,
                 const std::vector<int64_t>& dims, bool donate,
                 std::string* id) {
  KeySink sink(id);
  const char head[3] = {static_cast<char>(device), static_cast<char>(type),
                        static_cast<char>(donate ? 1 : 0)};
  sink.Bytes(head, sizeof(head));
  sink.Bytes(&at, sizeof(at));
  sink.Bytes(dims.data(), sizeof(int64_t) * dims.size());
}
template <typename T>
void KeyValue(KeySink* key, const T& v) {
  KeyBytes(key, &v, sizeof(v));
}
void KeyTensor(KeySink* key, const tpu::TensorRef& r) {
  KeyValue(key, r.dtype);
  KeyValue(key, r.ndim);
  const int n = std::min<int>(r.ndim, tpu::kMaxDims);
  KeyBytes(key, r.sizes, sizeof(int64_t) * n);
  KeyBytes(key, r.strides, sizeof(int64_t) * n);
}

// The signature an op's program depends on: its name, chip and every
// argument's value (scalars included: a rule may fold one into the
// program), every tensor's dtype, sizes and strides, and how the tensors
// lie: without memory, aligned to 64 bytes, or at the same place as an
// earlier one. False (not kept) for random ops, whose seed is new each time;
// their key is still made whole (the seed left out), for graph programs.
bool SignatureKey(const std::string& name, int device, const tpu::DecodedOp& d,
                  absl::Span<const tpu::TensorRef* const> all,
                  const std::vector<ResolvedTensor>& tensors,
                  absl::Span<const uintptr_t> raw, bool device_memory,
                  std::string* out) {
  KeySink sink(out);
  KeySink* const key = &sink;
  bool random = false;
  key->Bytes(name.c_str(), name.size() + 1);  // with its '\0'
  KeyValue(key, device);
  KeyValue(key, d.num_args);
  for (size_t a = 0; a < d.num_args; ++a) {
    const tpu::OpArg& arg = d.args[a];
    KeyValue(key, arg.tag);
    switch (arg.tag) {
      case tpu::ArgTag::kGenerator:
        random = true;
        break;
      case tpu::ArgTag::kTensor:
        KeyTensor(key, arg.tensor);
        break;
      case tpu::ArgTag::kTensorList:
      case tpu::ArgTag::kOptionalTensorList:
        KeyValue(key, arg.tensors.size());
        for (size_t e = 0; e < arg.tensors.size(); ++e) {
          const bool present =
              e >= arg.tensor_present.size() || arg.tensor_present[e];
          KeyValue(key, present);
          if (present) KeyTensor(key, arg.tensors[e]);
        }
        break;
      case tpu::ArgTag::kString:
        KeyValue(key, arg.s.size());
        KeyBytes(key, arg.s.data(), arg.s.size());
        break;
      case tpu::ArgTag::kIntList:
        KeyValue(key, arg.ints.size());
        KeyBytes(key, arg.ints.data(), sizeof(int64_t) * arg.ints.size());
        break;
      case tpu::ArgTag::kDoubleList:
        KeyValue(key, arg.doubles.size());
        KeyBytes(key, arg.doubles.data(), sizeof(double) * arg.doubles.size());
        break;
      case tpu::ArgTag::kBoolList:
        KeyValue(key, arg.bools.size());
        for (bool b : arg.bools) KeyValue(key, b);
        break;
      default:
        KeyValue(key, arg.i);
        KeyValue(key, arg.device_index);
        KeyValue(key, arg.d);
        KeyValue(key, arg.d_imag);
        KeyValue(key, arg.b);
        KeyValue(key, arg.dtype);
        break;
    }
  }
  KeyValue(key, d.outputs.size());
  for (const tpu::TensorRef& r : d.outputs) KeyTensor(key, r);
  for (size_t k = 0; k < all.size(); ++k) {
    const uint8_t absent = (all[k]->address == 0 ? 1 : 0) |
                           (tensors[k].segment_bytes == 0 ? 2 : 0);
    const uint8_t aligned = raw[k] % 64 == 0 ? 1 : 0;
    int32_t same = -1;
    for (size_t j = 0; j < k; ++j) {
      if (raw[j] == raw[k] && raw[k] != 0) {
        same = static_cast<int32_t>(j);
        break;
      }
    }
    KeyValue(key, absent);
    KeyValue(key, aligned);
    KeyValue(key, same);
    if (device_memory) {
      // Programs take whole segments: their sizes and which tensors share
      // one (where each tensor lies in its own is a parameter; a program
      // with those fixed in it is not kept).
      KeyValue(key, tensors[k].segment_bytes);
      int32_t shared = -1;
      for (size_t j = 0; j < k; ++j) {
        if (tensors[j].segment_bytes != 0 &&
            tensors[j].segment_address == tensors[k].segment_address) {
          shared = static_cast<int32_t>(j);
          break;
        }
      }
      KeyValue(key, shared);
    }
  }
  return !random;
}

}  // namespace

absl::Status PjrtChip::Run(const BackendOp& op, const tpu::DecodedOp& decoded,
                           const std::vector<ResolvedTensor>& tensors,
                           std::vector<ResultValue>* results,
                           ResultAllocator* allocator) {
  return RunOrPlan(op, decoded, tensors, results, allocator, nullptr);
}

absl::Status PjrtChip::PlanOp(const BackendOp& op,
                              const tpu::DecodedOp& decoded,
                              const std::vector<ResolvedTensor>& tensors,
                              OpPlan* plan) {
  return RunOrPlan(op, decoded, tensors, nullptr, nullptr, plan);
}

absl::Status PjrtChip::RunOrPlan(const BackendOp& base,
                                 const tpu::DecodedOp& decoded,
                                 const std::vector<ResolvedTensor>& tensors,
                                 std::vector<ResultValue>* results,
                                 ResultAllocator* allocator,
                                 OpPlan* const plan_only) {
  const auto& op = static_cast<const PjrtOp&>(base);
  // Asked for the plan only (a graph's op, PlanOp): what a plan cannot
  // describe (results sized by the data, reads on the host) leaves it
  // empty.
  if (plan_only != nullptr &&
      (results != nullptr || !device_memory_ ||
       (op.written().empty() && decoded.outputs.empty()))) {
    return absl::OkStatus();
  }
  const HostKind host_kind = op.host();
  // The ops computed from the arena's bytes read them there, up to date.
  if (device_memory_ && host_kind != HostKind::kNone &&
      (host_kind != HostKind::kIndex || decoded.outputs.empty())) {
    if (absl::Status st = HostAccessAll(tensors); !st.ok()) return st;
  }
  if (plan_only != nullptr && host_kind != HostKind::kNone)
    return absl::OkStatus();
  if (host_kind == HostKind::kLocalScalar)
    return ReadScalar(op.name(), decoded, tensors, results);
  if (host_kind == HostKind::kEqual)
    return Equal(op.name(), decoded, tensors, results);
  if (host_kind == HostKind::kSelect ||
      (host_kind == HostKind::kIndex && decoded.outputs.empty())) {
    return Selected(op.name(), decoded, tensors, results, allocator);
  }
  if (host_kind == HostKind::kUnique)
    return Unique(op.name(), decoded, tensors, results, allocator);
  // An op PyTorch has no meta kernel for comes without outputs (the client
  // cannot size them): those whose outputs follow from their inputs' shapes
  // get them here, in memory the result allocator charges to the session.
  if (op.entry() != nullptr && op.entry()->output_dims != nullptr &&
      op.written().empty() && decoded.outputs.empty() && allocator != nullptr &&
      results != nullptr) {
    std::vector<tpu::TensorRef> made;
    if (decoded.num_args >= 1 && decoded.args[0].tag == tpu::ArgTag::kTensor) {
      const tpu::TensorRef& x = decoded.args[0].tensor;
      auto dense = [](const tpu::TensorRef& like,
                      const std::vector<int64_t>& dims) {
        tpu::TensorRef r;
        r.dtype = like.dtype;
        r.ndim = static_cast<uint8_t>(dims.size());
        int64_t stride = 1;
        for (size_t q = dims.size(); q-- > 0;) {
          r.sizes[q] = dims[q];
          r.strides[q] = stride;
          stride *= std::max<int64_t>(dims[q], 1);
        }
        return r;
      };
      for (const std::vector<int64_t>& dims :
           op.entry()->output_dims(DimsOf(x))) {
        made.push_back(dense(x, dims));
      }
    }
    if (!made.empty()) {
      tpu::DecodedOp sized = decoded;
      std::vector<ResolvedTensor> all = tensors;
      for (tpu::TensorRef& r : made) {
        const uint64_t bytes = static_cast<uint64_t>(Numel(r)) *
                               static_cast<uint64_t>(tpu::ElementSize(r.dtype));
        ResolvedTensor rt;
        for (const ResolvedTensor& t : tensors)
          rt.owner = std::max(rt.owner, t.owner);
        if (bytes > 0) {
          absl::StatusOr<ResultAllocator::Block> block =
              allocator->Allocate(bytes);
          if (!block.ok()) return block.status();
          r.address = block->address;
          rt.segment_host_base = block->host;
          rt.segment_address = block->address;
          rt.segment_bytes = bytes;
        }
        sized.outputs.push_back(r);
        all.push_back(rt);
      }
      return RunOrPlan(base, sized, all, results, nullptr, nullptr);
    }
  }
  const Rule* single = op.rule();
  const MultiRule* multi = op.multi_rule();
  if (single == nullptr && multi == nullptr) {
    return Unsupported(op.name(), "no lowering to StableHLO yet");
  }
  Lowering l(op.name(), decoded, tensors, &op.arg_names());
  // Where results go: the written argument (self of an in-place op, out of
  // an out= op; each element of a written list), else the op's outputs.
  std::vector<const tpu::TensorRef*> refs;
  std::vector<size_t> ref_index;  // each one's position in `tensors`
  for (int w : op.written()) {
    if (static_cast<size_t>(w) >= decoded.num_args) {
      return Unsupported(op.name(), "a written argument is missing");
    }
    const tpu::OpArg& a = decoded.args[w];
    if (a.tag == tpu::ArgTag::kTensor) {
      refs.push_back(&a.tensor);
      ref_index.push_back(l.TensorIndex(a));
    } else if (a.tag == tpu::ArgTag::kTensorList) {
      for (size_t e = 0; e < a.tensors.size(); ++e) {
        refs.push_back(&a.tensors[e]);
        ref_index.push_back(l.TensorIndex(a) + e);
      }
    } else {
      return Unsupported(op.name(), "writing something that is not a tensor");
    }
  }
  if (op.written().empty()) {
    for (size_t o = 0; o < decoded.outputs.size(); ++o) {
      refs.push_back(&decoded.outputs[o]);
      ref_index.push_back(tensors.size() - decoded.outputs.size() + o);
    }
  }
  if (refs.empty()) return Unsupported(op.name(), "no output to write");
  // The synchronous path learns where each result lies.
  auto report = [&] {
    if (results == nullptr) return;
    for (const tpu::TensorRef* r : refs) {
      ResultValue v;
      v.kind = ResultValue::Kind::kTensor;
      v.tensor = *r;
      results->push_back(v);
    }
  };
  // Nothing to compute when every output is empty.
  if (std::all_of(refs.begin(), refs.end(),
                  [](const tpu::TensorRef* r) { return Numel(*r) == 0; })) {
    if (plan_only != nullptr) plan_only->nothing = true;
    report();
    return absl::OkStatus();
  }
  // The program and how to feed it: from the plan cache when this op's
  // signature (its arguments' values, dtypes, shapes and strides, and how
  // its tensors lie: aligned, shared, absent) has run before, else lowered.
  absl::InlinedVector<const tpu::TensorRef*, 8> all_refs;
  for (size_t a = 0; a < decoded.num_args; ++a) {
    const tpu::OpArg& arg = decoded.args[a];
    if (arg.tag == tpu::ArgTag::kTensor) {
      all_refs.push_back(&arg.tensor);
    } else if (arg.tag == tpu::ArgTag::kTensorList) {
      for (const tpu::TensorRef& t : arg.tensors) all_refs.push_back(&t);
    } else if (arg.tag == tpu::ArgTag::kOptionalTensorList) {
      for (size_t e = 0; e < arg.tensors.size(); ++e) {
        if (e >= arg.tensor_present.size() || arg.tensor_present[e])
          all_refs.push_back(&arg.tensors[e]);
      }
    }
  }
  for (const tpu::TensorRef& t : decoded.outputs) all_refs.push_back(&t);
  if (all_refs.size() != tensors.size()) {
    return absl::InternalError(absl::StrCat(op.name(), ": ", all_refs.size(),
                                            " tensors in the record, ",
                                            tensors.size(), " resolved"));
  }
  // Where each tensor's first element would lie (unchecked; 0 without memory).
  absl::InlinedVector<uintptr_t, 8> raw(all_refs.size(), 0);
  for (size_t k = 0; k < all_refs.size(); ++k) {
    const tpu::TensorRef& r = *all_refs[k];
    const ResolvedTensor& seg = tensors[k];
    if (r.address == 0 || seg.segment_bytes == 0 ||
        r.address < seg.segment_address)
      continue;
    raw[k] = reinterpret_cast<uintptr_t>(seg.segment_host_base) +
             (r.address - seg.segment_address) +
             static_cast<uintptr_t>(r.storage_offset) *
                 static_cast<uintptr_t>(std::max(1, tpu::ElementSize(r.dtype)));
  }
  // The chip is the outputs'; every tensor of the op is on it (the client
  // keeps an op's tensors on one device).
  // (An output the client did not ask for has no address: the first that
  // has one decides.)
  uint64_t placed = refs[0]->address;
  for (const tpu::TensorRef* r : refs) {
    if (r->address != 0) {
      placed = r->address;
      break;
    }
  }
  const int device = tpu::DeviceAddressChip(placed);
  if (device < 0 || device >= plugin_->num_devices()) {
    return absl::InvalidArgumentError(absl::StrCat(
        op.name(), ": output on chip ", device, ", which has no device"));
  }
  const bool host_devices =
      plugin_->platform_name() == "cpu" && !device_memory_;
  std::string& key = key_;
  const bool keyed = SignatureKey(op.name(), device, decoded, all_refs, tensors,
                                  raw, device_memory_, &key);
  Plan fresh;
  const Plan* found = nullptr;
  std::shared_ptr<const Plan> kept;
  if (keyed) {
    if (auto it = plans_.find(key); it != plans_.end()) {
      plan_lru_.splice(plan_lru_.end(), plan_lru_, it->second);
      kept = it->second->second;
      found = kept.get();
      if (found->exe == nullptr && plan_only == nullptr) {
        // Lowered for a graph's program only: compiled now, on its own.
        kept.reset();
        found = nullptr;
      } else if (plan_only == nullptr) {
        ++stats_[device].hits;
      }
    }
  }
  auto lower = [&](Plan& plan) -> absl::Status {
    Lowering l(op.name(), decoded, tensors, &op.arg_names());
    if (multi == nullptr && refs.size() != 1) {
      return Unsupported(op.name(), absl::StrCat(refs.size(), " outputs"));
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
        return Unsupported(
            op.name(),
            absl::StrCat("output dtype ", int(r.dtype), " is not lowered"));
      }
      outs[o].dims.assign(r.sizes, r.sizes + r.ndim);
      if (!Contiguous(r)) {
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
      absl::StatusOr<std::vector<std::string>> v =
          (*multi)(l, decoded, compute);
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
      std::vector<int64_t> stored = outs[o].dims;
      if (spans[o] > 0) {
        stored = {spans[o]};
      } else if (!orders[o].empty()) {
        for (size_t d = 0; d < orders[o].size(); ++d)
          stored[d] = outs[o].dims[orders[o][d]];
      }
      l.Donate(static_cast<int>(o), dsts[o], *outs[o].type, stored);
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
            if (seg_address[j] == rt.segment_address)
              return static_cast<int>(j);
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
        std::vector<int64_t> stored = outs[o].dims;
        if (spans[o] > 0) {
          stored = {spans[o]};
        } else if (!orders[o].empty()) {
          for (size_t d = 0; d < orders[o].size(); ++d)
            stored[d] = outs[o].dims[orders[o][d]];
        }
        writes.push_back({values[o], stored, outs[o].type, j, offset});
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
        if (dynamic)
          plan.offset_k.push_back(static_cast<int>(at - raw.begin()));
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
      plan.device = true;
      plan.program = *std::move(pieces);
      plan.on_device = device;
    } else {
      program = l.Text(values, types);
    }
    // (A graph's op is compiled only within the graph's program.)
    if (plan_only == nullptr) {
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
      if (dsts[o] != nullptr)
        plan.used.push_back(static_cast<int>(ref_index[o]));
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
  };
  if (found == nullptr) {
    if (absl::Status st = lower(fresh); !st.ok()) return st;
    found = &fresh;
  }
  const Plan& plan = *found;
  // The tensors the program reads and writes, checked to lie in their
  // segments.
  absl::InlinedVector<char*, 8> host(all_refs.size(), nullptr);
  for (int k : plan.used) {
    if (host[k] != nullptr) continue;
    absl::StatusOr<char*> h = l.HostOf(*all_refs[k], k);
    if (!h.ok()) return h.status();
    host[k] = *h;
  }
  // Device memory: where in its segment each offset parameter's tensor lies.
  absl::InlinedVector<int64_t, 8> offsets;
  for (int k : plan.offset_k)
    offsets.push_back(host[k] - tensors[k].segment_host_base);
  if (plan_only != nullptr) {
    // The plan, its signature and offsets, for the graph's program; nothing
    // runs.
    plan_only->offsets.assign(offsets.begin(), offsets.end());
    plan_only->key = key;
    plan_only->key.append(plan.fixed);
    if (kept == nullptr) {
      kept = std::make_shared<const Plan>(std::move(fresh));
      if (keyed && kept->keep) KeepPlan(key, kept);
    }
    plan_only->plan = std::move(kept);
    return absl::OkStatus();
  }
  absl::InlinedVector<char*, 4> dsts(refs.size(), nullptr);
  for (size_t o = 0; o < refs.size(); ++o) {
    if (plan.outputs[o].write) dsts[o] = host[ref_index[o]];
  }
  auto data_of = [&](const Plan::In& in) -> const char* {
    return in.k >= 0 ? host[in.k] : in.k == -2 ? in.data : nullptr;
  };
  if (plan.device) {
    absl::Status st = RunDevice(
        op.name(), plan, tensors, device,
        [&](size_t i) { return data_of(plan.inputs[i]); }, offsets);
    if (!st.ok()) return st;
    if (found == &fresh && keyed && fresh.keep) KeepPlan(key, std::move(fresh));
    report();
    return absl::OkStatus();
  }
  // Inputs are read in place where they are dense and aligned, unless they
  // overlap memory a donated result is written to while the program runs
  // (the donated parameter itself aside: the plugin knows that alias).
  absl::InlinedVector<std::pair<const char*, const char*>, 4> written;
  for (const Plan::In& x : plan.inputs) {
    if (x.aliased >= 0)
      written.emplace_back(data_of(x), data_of(x) + x.Bytes());
  }
  absl::InlinedVector<Buffer, 8> inputs;
  absl::InlinedVector<PJRT_Buffer*, 8> args;
  // For each output, the position in `inputs` of the buffer donated to it.
  absl::InlinedVector<int, 4> donor(plan.outputs.size(), -1);
  // Scalars stay on the device between ops, one buffer per value.
  if (scalars_.size() >= 4096) scalars_.clear();
  if (resident_.size() >= 8192) resident_.clear();
  for (const Plan::In& x : plan.inputs) {
    const char* at = data_of(x);
    const void* data = at;
    if (data == nullptr) {
      absl::StatusOr<PJRT_Buffer*> b = ScalarBuffer(device, x);
      if (!b.ok())
        return absl::Status(
            b.status().code(),
            absl::StrCat(op.name(), ": ", b.status().message()));
      args.push_back(*b);
      continue;
    }
    bool in_place = x.aliased >= 0;
    if (!in_place && host_devices && at != nullptr && x.Dense() &&
        reinterpret_cast<uintptr_t>(at) % 64 == 0) {
      in_place =
          std::none_of(written.begin(), written.end(), [&](const auto& w) {
            return at < w.second && w.first < at + x.Bytes();
          });
    }
    if (!in_place) {
      absl::StatusOr<Buffer> b =
          plugin_->FromHost(device, data, x.type->pjrt, x.dims, x.byte_strides);
      if (!b.ok())
        return absl::Status(
            b.status().code(),
            absl::StrCat(op.name(), ": ", b.status().message()));
      args.push_back(b->get());
      inputs.push_back(*std::move(b));
      continue;
    }
    // Buffers over the arena are kept between ops: one that is read stays
    // in the cache; one that is donated is consumed by the run (and its
    // result, at the same place, takes its entry afterwards).
    const bool donate = x.aliased >= 0;
    std::string& id = resident_key_;
    ResidentKey(device, at, x.type->pjrt, x.dims, donate, &id);
    auto it = resident_.find(id);
    if (it == resident_.end()) {
      absl::StatusOr<Buffer> b = plugin_->Alias(device, const_cast<char*>(at),
                                                x.type->pjrt, x.dims, donate);
      if (!b.ok())
        return absl::Status(
            b.status().code(),
            absl::StrCat(op.name(), ": ", b.status().message()));
      if (donate) {
        args.push_back(b->get());
        donor[x.aliased] = static_cast<int>(inputs.size());
        inputs.push_back(*std::move(b));
        continue;
      }
      it = resident_.emplace(std::move(id), *std::move(b)).first;
    }
    args.push_back(it->second.get());
    if (donate) {
      donor[x.aliased] = static_cast<int>(inputs.size());
      inputs.push_back(std::move(it->second));
      resident_.erase(it);
    }
  }
  absl::StatusOr<std::vector<Buffer>> out_buffers =
      plugin_->Execute(*plan.exe, device, absl::MakeConstSpan(args));
  if (!out_buffers.ok()) {
    return absl::Status(
        out_buffers.status().code(),
        absl::StrCat(op.name(), ": ", out_buffers.status().message()));
  }
  const size_t n_out = plan.outputs.size();
  if (out_buffers->size() != n_out + (plan.checked ? 1 : 0)) {
    return absl::InternalError(
        absl::StrCat(op.name(), ": the program gave ", out_buffers->size(),
                     " results for ", n_out, " outputs"));
  }
  if (plan.checked) {
    uint8_t bad = 0;
    if (absl::Status st = plugin_->ToHost(out_buffers->back(), &bad, 1);
        !st.ok()) {
      return absl::Status(st.code(),
                          absl::StrCat(op.name(), ": ", st.message()));
    }
    if (bad != 0) {
      out_buffers->clear();
      inputs.clear();
      return absl::InvalidArgumentError(
          absl::StrCat(op.name(), ": ", plan.range_message));
    }
  }
  for (size_t o = 0; o < n_out; ++o) {
    const size_t bytes = plan.outputs[o].bytes;
    if (bytes == 0 || dsts[o] == nullptr) continue;
    if (plan.outputs[o].donated) {
      absl::StatusOr<uintptr_t> at = plugin_->UnsafePointer((*out_buffers)[o]);
      if (at.ok() && *at == reinterpret_cast<uintptr_t>(dsts[o])) {
        // Written in place: the result's buffer is the one to donate there
        // next time.
        for (const Plan::In& x : plan.inputs) {
          if (x.aliased != static_cast<int>(o) || donor[o] < 0) continue;
          Buffer& result = (*out_buffers)[o];
          result.InheritRelease(inputs[donor[o]]);
          ResidentKey(device, dsts[o], x.type->pjrt, x.dims, true,
                      &resident_key_);
          resident_.insert_or_assign(resident_key_, std::move(result));
          break;
        }
        continue;
      }
    }
    if (absl::Status st = plugin_->ToHost((*out_buffers)[o], dsts[o], bytes);
        !st.ok()) {
      return absl::Status(st.code(),
                          absl::StrCat(op.name(), ": ", st.message()));
    }
  }
  // The results go before the inputs they may alias.
  out_buffers->clear();
  inputs.clear();
  // A plan lowered now is kept for the next op of this signature.
  if (found == &fresh && keyed && fresh.keep) KeepPlan(key, std::move(fresh));
  report();
  return absl::OkStatus();
}

void PjrtChip::KeepPlan(const std::string& key, Plan&& plan) {
  KeepPlan(key, std::make_shared<const Plan>(std::move(plan)));
}

void PjrtChip::KeepPlan(const std::string& key,
                        std::shared_ptr<const Plan> plan) {
  if (auto it = plans_.find(key); it != plans_.end()) {
    plan_lru_.erase(it->second);
    plans_.erase(it);
  }
  if (plan_lru_.size() >= 4 * capacity_) {
    plans_.erase(plan_lru_.front().first);
    plan_lru_.pop_front();
  }
  plan_lru_.emplace_back(key, std::move(plan));
  plans_[key] = std::prev(plan_lru_.end());
}

}  // namespace tpud::pjrt
