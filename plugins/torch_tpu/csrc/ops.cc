// The ops of "tpu": a few native kernels (creation, views, resize, set,
// copies, scalar reads) and one boxed fallback that forwards every other ATen
// op to tpud. The fallback finds output shapes by running the op on the
// `meta` device, allocates the outputs here, and enqueues the op without a
// round trip; ops whose outputs depend on data, or that return values to the
// host, take the synchronous path. Nothing falls back to the CPU silently.
#include <ATen/ATen.h>
#include <ATen/EmptyTensor.h>
#include <ATen/MemoryOverlap.h>
#include <ATen/autocast_mode.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/native/CPUFallback.h>
#include <ATen/native/TensorFactories.h>
#include <ATen/ops/_reshape_alias_native.h>
#include <ATen/ops/alias_native.h>
#include <ATen/ops/as_strided_native.h>
#include <ATen/ops/unfold_native.h>
#include <ATen/ops/view_as_complex_native.h>
#include <ATen/ops/view_as_real_native.h>
#include <ATen/ops/view_native.h>
#include <c10/core/DeviceGuard.h>
#include <torch/library.h>
#include <pybind11/pybind11.h>

#include <algorithm>
#include <mutex>
#include <unordered_map>
#include <unordered_set>

#include "ops.h"

#include "allocator.h"
#include "generator.h"
#include "runtime.h"

namespace torch_tpu {
namespace {

constexpr c10::DeviceType kTpu = c10::DeviceType::PrivateUse1;
const c10::DispatchKeySet kTpuKeys(c10::DispatchKey::PrivateUse1);

bool IsTpu(const at::Tensor& t) { return t.defined() && t.device().type() == kTpu; }

// Writes t's wire form into *r: its sizes and strides up to its rank (the
// rest of the arrays is neither written nor sent).
void RefInto(const at::Tensor& t, tpu::TensorRef* r) {
  // The wire format has no lazy conjugate/negative bits: refuse rather than
  // compute with the bit silently dropped.
  TORCH_CHECK(!t.is_conj() && !t.is_neg(), "tpu: a tensor with a lazy ",
              t.is_conj() ? "conjugate" : "negative",
              " bit cannot be forwarded yet; materialize it with .resolve_conj() / "
              ".resolve_neg() before moving it to tpu");
  const int64_t dim = t.dim();
  TORCH_CHECK(dim <= tpu::kMaxDims, "tpu: tensors of more than ", tpu::kMaxDims,
              " dimensions are not supported");
  r->address = reinterpret_cast<uint64_t>(t.storage().data_ptr().get());
  r->storage_offset = t.storage_offset();
  r->dtype = static_cast<int8_t>(t.scalar_type());
  r->ndim = static_cast<uint8_t>(dim);
  const c10::IntArrayRef sizes = t.sizes();
  const c10::IntArrayRef strides = t.strides();
  for (int64_t d = 0; d < dim; ++d) {
    r->sizes[d] = sizes[d];
    r->strides[d] = strides[d];
  }
}

tpu::TensorRef RefOf(const at::Tensor& t) {
  tpu::TensorRef r;
  RefInto(t, &r);
  return r;
}

// An argument slot made empty again (kNone), keeping its lists' capacity.
void ResetArg(tpu::OpArg& a) {
  a.tag = tpu::ArgTag::kNone;
  a.i = 0;
  a.device_index = 0;
  a.d = 0;
  a.d_imag = 0;
  a.b = false;
  a.dtype = 0;
  a.tensor.address = 0;
  a.tensor.storage_offset = 0;
  a.tensor.dtype = 0;
  a.tensor.ndim = 0;
  a.s.clear();
  a.ints.clear();
  a.doubles.clear();
  a.bools.clear();
  a.tensors.clear();
  a.tensor_present.clear();
}

// The value of a host scalar tensor (a Python number wrapped by an op like
// `x + 1`, or a CPU 0-dim tensor), read from its memory. Going through
// item() would dispatch _local_scalar_dense twice per op (signature key and
// wire argument); item() stays for what it alone handles (lazy bits, types
// read rarely, and its error for more than one element).
at::Scalar HostScalarValue(const at::Tensor& t) {
  if (t.numel() != 1 || t.is_conj() || t.is_neg()) return t.item();
  const void* p = t.const_data_ptr();
  switch (t.scalar_type()) {
    case at::kDouble: return at::Scalar(*static_cast<const double*>(p));
    case at::kFloat: return at::Scalar(*static_cast<const float*>(p));
    case at::kLong: return at::Scalar(*static_cast<const int64_t*>(p));
    case at::kInt: return at::Scalar(*static_cast<const int32_t*>(p));
    case at::kBool: return at::Scalar(*static_cast<const bool*>(p));
    default: return t.item();
  }
}

// Vectors an op on its way reuses from one op to the next on a thread, so
// that forwarding an op allocates nothing for its wire form (an OpArg holds
// a TensorRef of kMaxDims sizes and strides: a few arguments make a
// kilobyte-sized block per op, and its malloc and free cost more than the
// rest of the encoding). A vector comes as the last op left it (argument
// slots are reset one by one as they are written). An op issued while
// another is on its way (a copy_ into an out= tensor) takes another vector
// from the pool.
template <typename T>
class ScratchVector {
 public:
  ScratchVector() {
    std::vector<std::vector<T>>& pool = Pool();
    if (!pool.empty()) {
      v_ = std::move(pool.back());
      pool.pop_back();
    }
  }
  ~ScratchVector() {
    std::vector<std::vector<T>>& pool = Pool();
    // Huge lists (a foreach over thousands of tensors) are not kept.
    if (pool.size() < 8 && v_.capacity() <= 1024) pool.push_back(std::move(v_));
  }
  ScratchVector(const ScratchVector&) = delete;
  ScratchVector& operator=(const ScratchVector&) = delete;
  std::vector<T>& operator*() { return v_; }
  std::vector<T>* operator->() { return &v_; }

 private:
  static std::vector<std::vector<T>>& Pool() {
    thread_local std::vector<std::vector<T>> pool;
    return pool;
  }
  std::vector<T> v_;
};

// "aten::add.Tensor"; "aten::relu" for an op without an overload name.
std::string FullName(const c10::OperatorName& n) {
  return n.overload_name.empty() ? n.name : n.name + "." + n.overload_name;
}

// Interned op ids, per operator (the schema string is built once).
uint32_t OpIdFor(const c10::FunctionSchema& schema) {
  static std::mutex mu;
  static auto* ids = new std::unordered_map<const c10::FunctionSchema*, uint32_t>();
  std::lock_guard<std::mutex> lock(mu);
  auto it = ids->find(&schema);
  if (it != ids->end()) return it->second;
  absl::StatusOr<uint32_t> id = GetSession().DefineOp(c10::toString(schema));
  Check(id.status(), "defining an op");
  ids->emplace(&schema, *id);
  return *id;
}

uint32_t OpIdFor(const char* name, const char* overload) {
  auto op = c10::Dispatcher::singleton().findSchemaOrThrow(name, overload);
  return OpIdFor(op.schema());
}

at::Tensor EmptyStrided(at::IntArrayRef size, at::IntArrayRef stride, at::ScalarType dtype,
                        c10::DeviceIndex device) {
  c10::DeviceGuard guard(c10::Device(kTpu, device));
  return at::detail::empty_strided_generic(size, stride, GetTpuAllocator(), kTpuKeys, dtype);
}

// A CPU 0-dim tensor (a wrapped Python number) used with tpu tensors goes to
// the device first, as CUDA does implicitly.
at::Tensor ToDevice(const at::Tensor& cpu, c10::DeviceIndex device, int stream) {
  at::Tensor src = cpu.contiguous();
  at::Tensor dst = EmptyStrided(src.sizes(), src.strides(), src.scalar_type(), device);
  if (src.nbytes() > 0) {
    Check(GetSession().CopyToDevice(stream, reinterpret_cast<uint64_t>(dst.data_ptr()),
                                    src.data_ptr(), src.nbytes()),
          "copy to device");
  }
  return dst;
}

// What an op returns, as the meta kernel said, for one input signature.
struct OutSpec {
  enum class Kind : uint8_t { kNone, kNew, kSame, kView } kind = Kind::kNone;
  int input = -1;  // kSame/kView: which device tensor of the inputs
  std::vector<int64_t> sizes, strides;
  int64_t offset = 0;
  at::ScalarType dtype = at::kFloat;
  size_t storage_bytes = 0;  // kSame: room the (resized) tensor needs
};
struct ReturnSpec {
  bool is_list = false;
  bool is_none = false;
  std::vector<OutSpec> items;  // one, or a list's elements
};
struct MetaSpec {
  bool sync = false;  // the host needs values, or shapes depend on data
  std::vector<ReturnSpec> returns;
};

// Per-signature cache of MetaSpecs: running the meta kernel once per input
// signature (op, shapes, dtypes, strides, scalar arguments) instead of per op.
std::mutex g_spec_mu;
std::unordered_map<std::string, std::shared_ptr<const MetaSpec>>* g_specs =
    new std::unordered_map<std::string, std::shared_ptr<const MetaSpec>>();
constexpr size_t kMaxSpecs = 1 << 16;

std::shared_ptr<const MetaSpec> CacheLookup(const std::string& key) {
  std::lock_guard<std::mutex> lock(g_spec_mu);
  auto it = g_specs->find(key);
  return it == g_specs->end() ? nullptr : it->second;
}

void CacheStore(const std::string& key, std::shared_ptr<const MetaSpec> spec) {
  std::lock_guard<std::mutex> lock(g_spec_mu);
  if (g_specs->size() >= kMaxSpecs) g_specs->clear();
  g_specs->emplace(key, std::move(spec));
}

template <typename T>
void Put(std::string* k, const T& v) {
  k->append(reinterpret_cast<const char*>(&v), sizeof(v));
}

at::Tensor& ForwardInPlace(const char* name, const char* overload, at::Tensor& self,
                           std::vector<c10::IValue> rest);
at::Tensor Materialize(const at::Tensor& t);
const at::Tensor& Resize(const at::Tensor& self, at::IntArrayRef size,
                         std::optional<at::MemoryFormat> memory_format);

// One op on its way to the daemon.
class ForwardedOp {
 public:
  ForwardedOp(const c10::OperatorHandle& op, torch::jit::Stack* stack)
      : op_(op), schema_(op.schema()), stack_(stack) {}

  // Runs `op` (a functional op) with its results written into `outs` (the
  // out= tensors of the op the caller asked for), resized as needed.
  // in_place: the op was called in place on the one forced output; its
  // result must then have that tensor's shape (ATen broadcasts the other
  // operands to it, never it to them).
  void SetForcedOutputs(std::vector<at::Tensor> outs, bool in_place = false) {
    forced_ = std::move(outs);
    in_place_ = in_place;
  }
  // A structured op sent whole: its meta kernel fails only on bad arguments.
  void SetStrictMeta() { strict_meta_ = true; }

  void Run() {
    const size_t n = schema_.arguments().size();
    auto args = torch::jit::last(*stack_, n);
    FindDevice(args);
    // Move stray CPU tensors of lists to the device; host scalars stay.
    std::vector<c10::IValue> inputs(args.begin(), args.end());
    for (size_t i = 0; i < n; ++i) inputs[i] = Normalize(inputs[i], i);
    for (const c10::IValue& v : inputs) CollectReals(v);
    // Output metadata: from the per-signature cache, or from the meta kernel.
    std::string key;
    const bool cacheable = Key(inputs, &key);
    std::shared_ptr<const MetaSpec> spec = cacheable ? CacheLookup(key) : nullptr;
    if (spec == nullptr) {
      spec = ComputeSpec(inputs);
      if (cacheable) CacheStore(key, spec);
    }
    ScratchVector<tpu::OpArg> wire_scratch;
    std::vector<tpu::OpArg>& wire = *wire_scratch;
    wire.resize(n);
    auto encode_args = [&] {
      for (size_t i = 0; i < n; ++i) ToWire(inputs[i], schema_.arguments()[i], i, wire[i]);
    };
    const uint32_t id = OpIdFor(schema_);
    tpu::Session& session = GetSession();
    torch::jit::drop(*stack_, n);
    if (spec->sync) {
      encode_args();
      absl::StatusOr<std::vector<tpu::OpResult>> results =
          session.RunSync(stream_, id, wire.data(), wire.size(), nullptr, 0);
      Check(results.status(), schema_.name().c_str());
      PushSyncResults(*results);
      return;
    }
    ScratchVector<tpu::TensorRef> outputs_scratch;
    std::vector<tpu::TensorRef>& outputs = *outputs_scratch;
    outputs.clear();
    std::vector<c10::IValue> returns;
    bool all_alias = true;
    for (const ReturnSpec& r : spec->returns) returns.push_back(Apply(r, &outputs, &all_alias));
    // After the outputs: an out= argument may just have been resized.
    encode_args();
    if (all_alias && !WritesAnArgument()) {
      // A pure view op: the result is metadata over existing data.
      for (c10::IValue& r : returns) torch::jit::push(*stack_, std::move(r));
      return;
    }
    absl::StatusOr<uint64_t> seq = session.EnqueueOp(stream_, id, wire.data(), wire.size(),
                                                     outputs.data(), outputs.size());
    Check(seq.status(), schema_.name().c_str());
    for (auto& [tmp, out] : pending_copies_) ForwardInPlace("aten::copy_", "", out, {tmp, false});
    for (c10::IValue& r : returns) torch::jit::push(*stack_, std::move(r));
  }

 private:
  // The device tensors among the inputs, in the order MetaOf visits them.
  void CollectReals(const c10::IValue& v) {
    auto add = [&](const at::Tensor& t) {
      if (t.defined() && !t.device().is_cpu()) reals_.push_back(t);
    };
    if (v.isTensor()) {
      add(v.toTensor());
    } else if (v.isTensorList()) {
      for (const at::Tensor& t : v.toTensorList()) add(t);
    } else if (v.isList() && !v.isIntList() && !v.isDoubleList() && !v.isBoolList()) {
      for (const c10::IValue& e : v.toListRef()) {
        if (e.isTensor()) add(e.toTensor());
      }
    }
  }

  void KeyTensor(const at::Tensor& t, std::string* k) {
    if (!t.defined()) {
      k->push_back('U');
      return;
    }
    if (t.device().is_cpu()) {
      // A host scalar's value can shape the result (narrow's start as a
      // tensor, for one): it is part of the signature.
      k->push_back('S');
      Put(k, static_cast<int8_t>(t.scalar_type()));
      Put(k, t.unsafeGetTensorImpl()->is_wrapped_number());
      const at::Scalar v = HostScalarValue(t);
      if (v.isComplex()) {
        Put(k, v.toComplexDouble());
      } else if (v.isFloatingPoint()) {
        Put(k, v.toDouble());
      } else {
        Put(k, v.toLong());
      }
      return;
    }
    k->push_back('T');
    Put(k, static_cast<int8_t>(t.scalar_type()));
    Put(k, static_cast<int8_t>(t.dim()));
    for (int64_t d = 0; d < t.dim(); ++d) {
      Put(k, t.size(d));
      Put(k, t.stride(d));
    }
    Put(k, t.storage_offset());
    Put(k, t.storage().nbytes());
    // Which inputs share storage matters to aliasing results.
    const void* storage = t.storage().unsafeGetStorageImpl();
    int index = 0;
    while (index < static_cast<int>(seen_storages_.size()) && seen_storages_[index] != storage) {
      ++index;
    }
    if (index == static_cast<int>(seen_storages_.size())) seen_storages_.push_back(storage);
    Put(k, index);
  }

  // A key for the input signature; false when an argument has no key form.
  bool Key(const std::vector<c10::IValue>& inputs, std::string* k) {
    k->reserve(256);
    Put(k, &schema_);
    for (const c10::IValue& v : inputs) {
      if (v.isTensor()) {
        KeyTensor(v.toTensor(), k);
      } else if (v.isNone()) {
        k->push_back('N');
      } else if (v.isInt()) {
        k->push_back('i');
        Put(k, v.toInt());
      } else if (v.isDouble()) {
        k->push_back('d');
        Put(k, v.toDouble());
      } else if (v.isBool()) {
        k->push_back('b');
        Put(k, v.toBool());
      } else if (v.isComplexDouble()) {
        k->push_back('c');
        Put(k, v.toComplexDouble());
      } else if (v.isString()) {
        k->push_back('s');
        k->append(v.toStringRef());
        k->push_back('\0');
      } else if (v.isIntList()) {
        k->push_back('I');
        for (int64_t x : v.toIntVector()) Put(k, x);
        k->push_back(';');
      } else if (v.isDoubleList()) {
        k->push_back('F');
        for (double x : v.toDoubleVector()) Put(k, x);
        k->push_back(';');
      } else if (v.isBoolList()) {
        k->push_back('B');
        for (bool x : v.toBoolList()) Put(k, x);
        k->push_back(';');
      } else if (v.isTensorList()) {
        k->push_back('L');
        for (const at::Tensor& t : v.toTensorList()) KeyTensor(t, k);
        k->push_back(';');
      } else if (v.isList()) {
        k->push_back('O');
        for (const c10::IValue& e : v.toListRef()) {
          if (e.isTensor()) {
            KeyTensor(e.toTensor(), k);
          } else if (e.isNone()) {
            k->push_back('N');
          } else {
            return false;
          }
        }
        k->push_back(';');
      } else if (v.isDevice()) {
        k->push_back('D');
        Put(k, static_cast<int8_t>(v.toDevice().type()));
        Put(k, v.toDevice().index());
      } else if (v.isGenerator()) {
        k->push_back('G');
      } else {
        return false;
      }
    }
    return true;
  }

  std::shared_ptr<const MetaSpec> ComputeSpec(const std::vector<c10::IValue>& inputs) {
    auto spec = std::make_shared<MetaSpec>();
    for (const c10::Argument& r : schema_.returns()) {
      const auto kind = r.real_type()->kind();
      if (kind != c10::TypeKind::TensorType && !IsTensorList(r.real_type()) &&
          !IsOptionalTensor(r.real_type())) {
        spec->sync = true;  // the host needs a value
        return spec;
      }
    }
    const std::string& name = schema_.name();
    if (name == "aten::_embedding_bag" || name == "aten::_embedding_bag_forward_only") {
      // Which of offset2bag and max_indices the CPU kernel fills (and how
      // big they are) depends on the mode and fast paths the meta kernel
      // does not model: take the kernel's own results.
      spec->sync = true;
      return spec;
    }
    std::vector<c10::IValue> results;
    if (!RunMeta(inputs, &results)) {
      spec->sync = true;
      return spec;
    }
    for (const c10::IValue& m : results) {
      ReturnSpec rs;
      if (m.isNone()) {
        rs.is_none = true;
      } else if (m.isTensor()) {
        rs.items.push_back(SpecOf(m.toTensor()));
      } else if (m.isTensorList()) {
        rs.is_list = true;
        for (const at::Tensor& t : m.toTensorList()) rs.items.push_back(SpecOf(t));
      } else {
        TORCH_CHECK(false, "tpu: ", schema_.name(), " returned ", m.tagKind(),
                    ", which tpu cannot forward");
      }
      spec->returns.push_back(std::move(rs));
    }
    MatchCpuStatistics(inputs, spec.get());
    return spec;
  }

  // Normalisations return statistics beside their result. tpud runs ATen's
  // CPU kernels, whose statistics differ from the meta kernels' (which model
  // CUDA's): in the input's dtype unless a float parameter makes the kernel
  // mixed-precision, and, for batch norm in eval mode, empty.
  void MatchCpuStatistics(const std::vector<c10::IValue>& inputs, MetaSpec* spec) const {
    const std::string& name = schema_.name();
    const bool batch_norm = name == "aten::native_batch_norm" ||
                            name == "aten::_native_batch_norm_legit" ||
                            name == "aten::_native_batch_norm_legit_no_training" ||
                            name == "aten::_batch_norm_with_update" ||
                            name == "aten::_batch_norm_no_update";
    const bool layer_norm = name == "aten::native_layer_norm";
    if (!batch_norm && !layer_norm) return;
    if (spec->returns.size() < 3 || inputs.empty() || !inputs[0].isTensor()) return;
    const at::ScalarType in = inputs[0].toTensor().scalar_type();
    bool training = name != "aten::_native_batch_norm_legit_no_training" &&
                    name != "aten::_batch_norm_no_update";
    bool mixed = false;
    const auto& args = schema_.arguments();
    for (size_t i = 1; i < args.size() && i < inputs.size(); ++i) {
      if (args[i].name() == "training" && inputs[i].isBool()) training = inputs[i].toBool();
      if (inputs[i].isTensor() && inputs[i].toTensor().defined() &&
          inputs[i].toTensor().scalar_type() != in &&
          at::isReducedFloatingType(in) && inputs[i].toTensor().scalar_type() == at::kFloat) {
        mixed = true;
      }
    }
    const at::ScalarType stats = mixed ? at::kFloat : in;
    for (int r = 1; r <= 2; ++r) {
      for (OutSpec& o : spec->returns[r].items) {
        if (o.kind != OutSpec::Kind::kNew) continue;
        o.dtype = stats;
        if (batch_norm && !training) {
          o.sizes = {0};
          o.strides = {1};
          o.offset = 0;
        }
      }
    }
  }

  OutSpec SpecOf(const at::Tensor& m) {
    OutSpec o;
    if (!m.defined()) return o;
    o.sizes = m.sizes().vec();
    o.strides = m.strides().vec();
    o.offset = m.storage_offset();
    o.dtype = m.scalar_type();
    o.kind = OutSpec::Kind::kNew;
    for (size_t i = 0; i < meta_pairs_.size(); ++i) {
      if (meta_pairs_[i].first.unsafeGetTensorImpl() == m.unsafeGetTensorImpl()) {
        o.kind = OutSpec::Kind::kSame;
        o.input = static_cast<int>(i);
        o.storage_bytes = m.storage().nbytes();
        return o;
      }
    }
    for (size_t i = 0; i < meta_pairs_.size(); ++i) {
      if (meta_pairs_[i].first.is_alias_of(m)) {
        o.kind = OutSpec::Kind::kView;
        o.input = static_cast<int>(i);
        return o;
      }
    }
    return o;
  }

  at::Tensor ApplyOne(const OutSpec& o, std::vector<tpu::TensorRef>* outputs, bool* all_alias) {
    switch (o.kind) {
      case OutSpec::Kind::kNone:
        outputs->push_back(tpu::TensorRef{});  // the slot still counts
        return at::Tensor();
      case OutSpec::Kind::kNew: {
        *all_alias = false;
        if (next_forced_ < forced_.size()) {
          // The caller's out= tensor: give it the result's shape and room.
          at::Tensor& out = forced_[next_forced_++];
          // As in ATen, an out= (or in-place) tensor may have another dtype
          // than the result when the result casts to it (an in-place bfloat16
          // op with a float32 0-dim operand computes in float32).
          const bool cast = out.scalar_type() != o.dtype;
          TORCH_CHECK(!cast || at::canCast(o.dtype, out.scalar_type()), "tpu: ", schema_.name(),
                      ": result type ", o.dtype, " can't be cast to the desired output type ",
                      out.scalar_type());
          if (out.sizes() != at::IntArrayRef(o.sizes)) {
            TORCH_CHECK(!in_place_, "output with shape ", out.sizes(),
                        " doesn't match the broadcast shape ", at::IntArrayRef(o.sizes));
            Resize(out, o.sizes, std::nullopt);
          }
          if (cast || !out.is_contiguous() || out.strides() != at::IntArrayRef(o.strides)) {
            // Written through a temporary, then copied (and cast) into out.
            at::Tensor tmp = EmptyStrided(o.sizes, o.strides, o.dtype, device_);
            outputs->push_back(RefOf(tmp));
            pending_copies_.emplace_back(tmp, out);
            return out;
          }
          outputs->push_back(RefOf(out));
          return out;
        }
        at::Tensor out = EmptyStrided(o.sizes, o.strides, o.dtype, device_);
        outputs->push_back(RefOf(out));
        return out;
      }
      case OutSpec::Kind::kSame: {
        // In place or out=: the kernel may have resized it (an out= tensor of
        // the wrong shape): give the real tensor the same shape and room.
        const at::Tensor& real = reals_.at(o.input);
        if (real.sizes() != at::IntArrayRef(o.sizes) ||
            real.strides() != at::IntArrayRef(o.strides) || real.storage_offset() != o.offset) {
          if (o.storage_bytes > real.storage().nbytes()) {
            ResizeStorage(real.storage(), o.storage_bytes);
          }
          real.unsafeGetTensorImpl()->set_sizes_and_strides(o.sizes, o.strides, o.offset);
        }
        outputs->push_back(RefOf(real));
        return real;
      }
      case OutSpec::Kind::kView: {
        at::Tensor view = reals_.at(o.input).as_strided(o.sizes, o.strides, o.offset);
        outputs->push_back(RefOf(view));
        return view;
      }
    }
    return at::Tensor();
  }

  c10::IValue Apply(const ReturnSpec& r, std::vector<tpu::TensorRef>* outputs, bool* all_alias) {
    if (r.is_none) {
      outputs->push_back(tpu::TensorRef{});
      return c10::IValue();
    }
    if (r.is_list) {
      c10::List<at::Tensor> list;
      for (const OutSpec& o : r.items) list.push_back(ApplyOne(o, outputs, all_alias));
      return list;
    }
    return ApplyOne(r.items.at(0), outputs, all_alias);
  }

  static bool IsTensorList(const c10::TypePtr& t) {
    return t->kind() == c10::TypeKind::ListType &&
           t->containedType(0)->kind() == c10::TypeKind::TensorType;
  }
  static bool IsOptionalTensor(const c10::TypePtr& t) {
    return t->kind() == c10::TypeKind::OptionalType &&
           t->containedType(0)->kind() == c10::TypeKind::TensorType;
  }

  void FindDevice(c10::ArrayRef<c10::IValue> args) {
    auto visit = [&](const at::Tensor& t) {
      if (IsTpu(t) && device_ < 0) device_ = t.device().index();
    };
    for (const c10::IValue& v : args) {
      if (v.isTensor()) visit(v.toTensor());
      if (v.isTensorList()) {
        for (const at::Tensor& t : v.toTensorList()) visit(t);
      }
      if (v.isList()) {
        for (const c10::IValue& e : v.toListRef()) {
          if (e.isTensor()) visit(e.toTensor());
        }
      }
    }
    if (device_ < 0) {
      // Factory-like ops (e.g. randperm, arange.start_out): the op's device
      // argument or the current device.
      for (const c10::IValue& v : args) {
        if (v.isDevice() && v.toDevice().type() == kTpu && v.toDevice().has_index()) {
          device_ = v.toDevice().index();
        }
      }
      if (device_ < 0) device_ = CurrentDevice();
    }
    stream_ = SessionStream(CurrentStreamId(device_));
  }

  // A CPU 0-dim tensor (a Python number in `x + 2`) stays on the host: it
  // travels by value (kScalarTensor). Lists carry only device tensors, so
  // there it goes to the device.
  at::Tensor NormalizeTensor(const at::Tensor& t, size_t index, bool in_list = false) {
    if (!in_list && t.defined() && t.device().is_cpu() && t.dim() == 0) return t;
    if (IsTpu(t) && (t.is_conj() || t.is_neg())) {
      // Conjugate-aware ops get lazy-conjugate inputs; the daemon gets plain
      // data. (A written argument keeps its bit: RefOf refuses it.)
      const c10::Argument& formal = schema_.arguments()[index];
      if (formal.alias_info() == nullptr || !formal.alias_info()->isWrite()) {
        at::Tensor plain = Materialize(t);
        keep_alive_.push_back(plain);
        return plain;
      }
    }
    if (!t.defined() || IsTpu(t)) {
      TORCH_CHECK(!t.defined() || t.device().index() == device_, "tpu: ", schema_.name(),
                  ": expected all tensors on tpu:", static_cast<int>(device_),
                  ", found one on ", t.device(), " (argument ", index, ")");
      return t;
    }
    // CPU tensors inside lists (index tensors of index/index_put) go to the
    // device, as CUDA accepts them; elsewhere only host scalars may.
    TORCH_CHECK(t.device().is_cpu() && (t.dim() == 0 || in_list), "tpu: ", schema_.name(),
                ": expected all tensors on tpu, found one on ", t.device(), " (argument ",
                index, ", shape ", t.sizes(), "); move it with .to(\"tpu\")");
    at::Tensor moved = ToDevice(t, device_, stream_);
    keep_alive_.push_back(moved);
    return moved;
  }

  c10::IValue Normalize(const c10::IValue& v, size_t index) {
    if (v.isTensor()) return NormalizeTensor(v.toTensor(), index);
    if (v.isTensorList()) {
      c10::List<at::Tensor> out;
      for (const at::Tensor& t : v.toTensorList()) out.push_back(NormalizeTensor(t, index, true));
      return out;
    }
    if (v.isList() && !v.isIntList() && !v.isDoubleList() && !v.isBoolList()) {
      c10::List<std::optional<at::Tensor>> out;
      for (const c10::IValue& e : v.toListRef()) {
        // An absent entry may come as None or as an undefined tensor (from
        // indexing with slices: x[:, idx]).
        if (e.isNone() || (e.isTensor() && !e.toTensor().defined())) {
          out.push_back(std::nullopt);
        } else {
          out.push_back(NormalizeTensor(e.toTensor(), index, true));
        }
      }
      return out;
    }
    return v;
  }

  at::Tensor Meta(const at::Tensor& t) {
    if (!t.defined() || t.device().is_cpu()) return t;  // host scalars stay
    const int64_t itemsize = t.element_size();
    const int64_t storage_numel = static_cast<int64_t>(t.storage().nbytes()) / itemsize;
    at::Tensor base = at::empty({storage_numel}, t.options().device(c10::kMeta));
    at::Tensor m = base.as_strided(t.sizes(), t.strides(), t.storage_offset());
    meta_pairs_.emplace_back(m, t);
    return m;
  }

  c10::IValue MetaOf(const c10::IValue& v) {
    if (v.isTensor()) return Meta(v.toTensor());
    if (v.isTensorList()) {
      c10::List<at::Tensor> out;
      for (const at::Tensor& t : v.toTensorList()) out.push_back(Meta(t));
      return out;
    }
    if (v.isList() && !v.isIntList() && !v.isDoubleList() && !v.isBoolList()) {
      c10::List<std::optional<at::Tensor>> out;
      for (const c10::IValue& e : v.toListRef()) {
        if (e.isNone()) {
          out.push_back(std::nullopt);
        } else {
          out.push_back(Meta(e.toTensor()));
        }
      }
      return out;
    }
    if (v.isDevice() && v.toDevice().type() == kTpu) return c10::Device(c10::kMeta);
    if (v.isGenerator()) return c10::IValue();
    return v;
  }

  // Output metadata from the meta kernel. False when the op cannot say
  // without looking at data (nonzero, unique, boolean indexing, ...).
  bool RunMeta(const std::vector<c10::IValue>& inputs, std::vector<c10::IValue>* results) {
    torch::jit::Stack meta;
    for (const c10::IValue& v : inputs) meta.push_back(MetaOf(v));
    try {
      op_.callBoxed(&meta);
    } catch (const c10::NotImplementedError&) {
      // A meta kernel that needs data (boolean indexing calls nonzero).
      if (in_place_) throw;
      return false;
    } catch (const pybind11::error_already_set& e) {
      // The same from a Python meta registration (torch._meta_registrations).
      bool data_dependent = false;
      {
        pybind11::gil_scoped_acquire gil;
        data_dependent = e.matches(PyExc_NotImplementedError);
      }
      if (in_place_ || (strict_meta_ && !data_dependent)) throw;
      return false;
    } catch (const std::exception&) {
      // c10::Error from C++ meta kernels, or a Python meta registration's
      // NotImplementedError: the shape depends on data. Not so for a
      // structured op sent whole (its meta function is written for meta
      // tensors), nor for an op called in place (its result has its first
      // argument's shape): a failing meta kernel means bad arguments, and
      // its message is ATen's own.
      if (in_place_ || strict_meta_) throw;
      return false;
    }
    *results = std::move(meta);
    return true;
  }

  bool WritesAnArgument() const {
    for (const c10::Argument& a : schema_.arguments()) {
      if (a.alias_info() != nullptr && a.alias_info()->isWrite()) return true;
    }
    return false;
  }

  void PushSyncResults(const std::vector<tpu::OpResult>& results) {
    size_t next = 0;
    for (const c10::Argument& r : schema_.returns()) {
      const c10::TypePtr& t = r.real_type();
      if (IsTensorList(t)) {
        c10::List<at::Tensor> list;
        while (next < results.size() && results[next].kind == tpu::OpResult::Kind::kTensor) {
          list.push_back(IntoForced(Adopt(results[next++])));
        }
        torch::jit::push(*stack_, std::move(list));
        continue;
      }
      TORCH_CHECK(next < results.size(), "tpu: ", schema_.name(), ": the daemon returned ",
                  results.size(), " values, fewer than the schema's");
      const tpu::OpResult& v = results[next++];
      switch (v.kind) {
        case tpu::OpResult::Kind::kTensor:
          torch::jit::push(*stack_, IntoForced(Adopt(v)));
          break;
        case tpu::OpResult::Kind::kInt:
          torch::jit::push(*stack_, v.i);
          break;
        case tpu::OpResult::Kind::kDouble:
          torch::jit::push(*stack_, v.d);
          break;
        case tpu::OpResult::Kind::kBool:
          torch::jit::push(*stack_, v.b);
          break;
        case tpu::OpResult::Kind::kComplex:
          torch::jit::push(*stack_, c10::complex<double>(v.d, v.d_imag));
          break;
        case tpu::OpResult::Kind::kNone:
          torch::jit::push(*stack_, c10::IValue());
          break;
      }
    }
  }

  // On the synchronous path of an out= op: the result goes into the
  // caller's out= tensor (resized to it), which is what the op returns.
  at::Tensor IntoForced(const at::Tensor& result) {
    if (next_forced_ >= forced_.size()) return result;
    at::Tensor& out = forced_[next_forced_++];
    if (out.sizes() != result.sizes()) {
      TORCH_CHECK(!in_place_, "output with shape ", out.sizes(), " doesn't match the broadcast shape ",
                  result.sizes());
      Resize(out, result.sizes(), std::nullopt);
    }
    ForwardInPlace("aten::copy_", "", out, {result, false});
    return out;
  }

  at::Tensor Adopt(const tpu::OpResult& v) {
    std::vector<int64_t> sizes(v.tensor.sizes, v.tensor.sizes + v.tensor.ndim);
    // An op that returned one of its arguments (in place, out=, a view):
    // the result is that tensor's storage, not a new segment.
    for (const at::Tensor& real : reals_) {
      if (reinterpret_cast<uint64_t>(real.storage().data_ptr().get()) == v.tensor.address &&
          v.tensor.address != 0) {
        std::vector<int64_t> strides(v.tensor.strides, v.tensor.strides + v.tensor.ndim);
        if (real.sizes() == at::IntArrayRef(sizes) && real.strides() == at::IntArrayRef(strides) &&
            real.storage_offset() == v.tensor.storage_offset &&
            static_cast<int8_t>(real.scalar_type()) == v.tensor.dtype) {
          return real;
        }
        return real.as_strided(sizes, strides, v.tensor.storage_offset);
      }
    }
    const auto dtype = static_cast<at::ScalarType>(v.tensor.dtype);
    if (v.tensor.address == 0) return EmptyStrided(sizes, c10::contiguous_strides(sizes), dtype, device_);
    c10::Storage storage(c10::Storage::use_byte_size_t(), v.nbytes,
                         AdoptSegment(v.tensor.address, v.nbytes, device_), GetTpuAllocator(),
                         /*resizable=*/true);
    at::Tensor t = at::detail::make_tensor<c10::TensorImpl>(std::move(storage), kTpuKeys,
                                                            caffe2::TypeMeta::fromScalarType(dtype));
    t.unsafeGetTensorImpl()->set_sizes_contiguous(sizes);
    return t;
  }

  // The wire form of an argument, written over `a` (an argument slot kept
  // from an earlier op: what it held is cleared first).
  void TensorArg(const at::Tensor& t, tpu::OpArg& a) {
    if (!t.defined()) {
      a.tag = tpu::ArgTag::kUndefinedTensor;
      return;
    }
    if (t.device().is_cpu()) {
      a.tag = tpu::ArgTag::kScalarTensor;
      a.dtype = static_cast<int8_t>(t.scalar_type());
      a.b = t.unsafeGetTensorImpl()->is_wrapped_number();
      const at::Scalar v = HostScalarValue(t);
      if (c10::isIntegralType(t.scalar_type(), /*includeBool=*/true)) {
        a.i = v.toLong();
      } else if (c10::isComplexType(t.scalar_type())) {
        a.d = v.toComplexDouble().real();
        a.d_imag = v.toComplexDouble().imag();
      } else {
        a.d = v.toDouble();
      }
      return;
    }
    a.tag = tpu::ArgTag::kTensor;
    RefInto(t, &a.tensor);
    return;
  }

  void ToWire(const c10::IValue& v, const c10::Argument& formal, size_t index, tpu::OpArg& a) {
    ResetArg(a);
    c10::TypePtr type = formal.real_type();
    if (type->kind() == c10::TypeKind::OptionalType) {
      if (v.isNone() && type->containedType(0)->kind() != c10::TypeKind::GeneratorType) {
        a.tag = tpu::ArgTag::kNone;
        return;
      }
      type = type->containedType(0);
    }
    switch (type->kind()) {
      case c10::TypeKind::TensorType:
        TensorArg(v.isNone() ? at::Tensor() : v.toTensor(), a);
        return;
      case c10::TypeKind::GeneratorType: {
        // The seed this op uses, drawn from the chosen generator here.
        at::Generator gen = v.isGenerator() ? v.toGenerator() : DefaultGenerator(device_);
        std::lock_guard<std::mutex> lock(gen.mutex());
        auto* tg = dynamic_cast<TpuGenerator*>(gen.unsafeGetGeneratorImpl());
        TORCH_CHECK(tg != nullptr, "tpu: ", schema_.name(), ": argument ", index,
                    " is a generator of another device");
        a.tag = tpu::ArgTag::kGenerator;
        a.i = static_cast<int64_t>(tg->NextOpSeed());
        return;
      }
      case c10::TypeKind::IntType:
        a.tag = tpu::ArgTag::kInt;
        a.i = v.toInt();
        return;
      case c10::TypeKind::SymIntType:
        a.tag = tpu::ArgTag::kSymInt;
        a.i = v.toSymInt().expect_int();
        return;
      case c10::TypeKind::FloatType:
        a.tag = tpu::ArgTag::kDouble;
        a.d = v.toDouble();
        return;
      case c10::TypeKind::BoolType:
        a.tag = tpu::ArgTag::kBool;
        a.b = v.toBool();
        return;
      case c10::TypeKind::ComplexType:
        a.tag = tpu::ArgTag::kComplex;
        a.d = v.toComplexDouble().real();
        a.d_imag = v.toComplexDouble().imag();
        return;
      case c10::TypeKind::StringType:
        a.tag = tpu::ArgTag::kString;
        a.s = v.toStringRef();
        return;
      case c10::TypeKind::NumberType: {  // Scalar
        const at::Scalar s = v.toScalar();
        if (s.isBoolean()) {
          a.tag = tpu::ArgTag::kScalarBool;
          a.b = s.toBool();
        } else if (s.isIntegral(false)) {
          a.tag = tpu::ArgTag::kScalarInt;
          a.i = s.toLong();
        } else if (s.isComplex()) {
          a.tag = tpu::ArgTag::kScalarComplex;
          a.d = s.toComplexDouble().real();
          a.d_imag = s.toComplexDouble().imag();
        } else {
          a.tag = tpu::ArgTag::kScalarDouble;
          a.d = s.toDouble();
        }
        return;
      }
      case c10::TypeKind::ScalarTypeType:
        a.tag = tpu::ArgTag::kDtype;
        a.i = static_cast<int64_t>(v.toScalarType());
        return;
      case c10::TypeKind::LayoutType:
        a.tag = tpu::ArgTag::kLayout;
        a.i = static_cast<int64_t>(v.toLayout());
        return;
      case c10::TypeKind::MemoryFormatType:
        a.tag = tpu::ArgTag::kMemoryFormat;
        a.i = static_cast<int64_t>(v.toMemoryFormat());
        return;
      case c10::TypeKind::DeviceObjType:
        a.tag = tpu::ArgTag::kDevice;
        a.i = static_cast<int64_t>(v.toDevice().type());
        a.device_index = v.toDevice().index();
        return;
      case c10::TypeKind::ListType: {
        const auto elem = type->containedType(0);
        if (elem->kind() == c10::TypeKind::IntType || elem->kind() == c10::TypeKind::SymIntType) {
          a.tag = tpu::ArgTag::kIntList;
          if (v.isIntList()) {
            a.ints = v.toIntVector();
          } else {
            for (const c10::IValue& e : v.toListRef()) a.ints.push_back(e.toSymInt().expect_int());
          }
          return;
        }
        if (elem->kind() == c10::TypeKind::FloatType) {
          a.tag = tpu::ArgTag::kDoubleList;
          a.doubles = v.toDoubleVector();
          return;
        }
        if (elem->kind() == c10::TypeKind::BoolType) {
          a.tag = tpu::ArgTag::kBoolList;
          for (bool b : v.toBoolList()) a.bools.push_back(b);
          return;
        }
        if (elem->kind() == c10::TypeKind::TensorType) {
          a.tag = tpu::ArgTag::kTensorList;
          for (const at::Tensor& t : v.toTensorList()) a.tensors.push_back(RefOf(t));
          return;
        }
        if (elem->kind() == c10::TypeKind::OptionalType) {
          a.tag = tpu::ArgTag::kOptionalTensorList;
          for (const c10::IValue& e : v.toListRef()) {
            const bool present = !e.isNone() && e.toTensor().defined();
            a.tensor_present.push_back(present);
            a.tensors.push_back(present ? RefOf(e.toTensor()) : tpu::TensorRef{});
          }
          return;
        }
        break;
      }
      default:
        break;
    }
    TORCH_CHECK(false, "tpu: ", schema_.name(), ": cannot forward argument ", index, " (",
                formal.name(), ") of type ", formal.type()->str());
  }

  const c10::OperatorHandle& op_;
  const c10::FunctionSchema& schema_;
  torch::jit::Stack* stack_;
  c10::DeviceIndex device_ = -1;
  int stream_ = 0;
  std::vector<std::pair<at::Tensor, at::Tensor>> meta_pairs_;  // meta twin, tpu tensor
  std::vector<at::Tensor> keep_alive_;
  std::vector<at::Tensor> reals_;              // device tensors of the inputs
  std::vector<at::Tensor> forced_;             // out= tensors to write results into
  size_t next_forced_ = 0;
  bool in_place_ = false;
  bool strict_meta_ = false;
  std::vector<std::pair<at::Tensor, at::Tensor>> pending_copies_;  // (tmp, out)
  std::vector<const void*> seen_storages_;     // for the signature key
};

// An out= op's functional twin: same name, overload "" for "out" or "X" for
// "X_out", taking exactly the out= op's leading arguments.
std::optional<c10::OperatorHandle> FunctionalOf(const c10::FunctionSchema& schema,
                                                size_t* num_out) {
  const std::string& overload = schema.overload_name();
  std::string base;
  if (overload == "out") {
    base = "";
  } else if (overload.size() > 4 && overload.compare(overload.size() - 4, 4, "_out") == 0) {
    base = overload.substr(0, overload.size() - 4);
  } else {
    return std::nullopt;
  }
  size_t outs = 0;
  for (const c10::Argument& a : schema.arguments()) {
    if (a.alias_info() != nullptr && a.alias_info()->isWrite()) ++outs;
  }
  if (outs == 0) return std::nullopt;
  auto f = c10::Dispatcher::singleton().findSchema({schema.name(), base});
  if (!f.has_value()) return std::nullopt;
  const auto& fargs = f->schema().arguments();
  const auto& args = schema.arguments();
  if (fargs.size() + outs != args.size() || f->schema().returns().size() != outs) {
    return std::nullopt;
  }
  for (size_t i = 0; i < fargs.size(); ++i) {
    if (fargs[i].name() != args[i].name() || fargs[i].alias_info() != nullptr) return std::nullopt;
  }
  for (const c10::Argument& r : f->schema().returns()) {
    if (r.type()->kind() != c10::TypeKind::TensorType) return std::nullopt;
  }
  *num_out = outs;
  return f;
}

// An in-place op's functional twin ("aten::add_.Tensor" ->
// "aten::add.Tensor"): the same arguments, of which the in-place op writes
// only the first, and one result.
std::optional<c10::OperatorHandle> InPlaceFunctionalOf(const c10::FunctionSchema& schema) {
  const std::string& name = schema.name();
  const auto& args = schema.arguments();
  if (name.size() < 2 || name.back() != '_' || args.empty() || schema.returns().size() != 1) {
    return std::nullopt;
  }
  for (size_t i = 0; i < args.size(); ++i) {
    const bool writes = args[i].alias_info() != nullptr && args[i].alias_info()->isWrite();
    if (writes != (i == 0)) return std::nullopt;
  }
  auto f = c10::Dispatcher::singleton().findSchema({name.substr(0, name.size() - 1), schema.overload_name()});
  if (!f.has_value()) return std::nullopt;
  const auto& fargs = f->schema().arguments();
  if (fargs.size() != args.size() || f->schema().returns().size() != 1 ||
      f->schema().returns()[0].type()->kind() != c10::TypeKind::TensorType) {
    return std::nullopt;
  }
  for (size_t i = 0; i < fargs.size(); ++i) {
    if (fargs[i].name() != args[i].name() || fargs[i].alias_info() != nullptr ||
        fargs[i].real_type()->str() != args[i].real_type()->str()) {
      return std::nullopt;
    }
  }
  return f;
}

// Whether SendStructuredOpsWhole registered `name` (an in-place op reaching
// the fallback otherwise, zero_ for one, runs as itself).
std::mutex g_structured_mu;
std::vector<c10::OperatorName>* g_structured_ops = new std::vector<c10::OperatorName>();
bool SentWholeStructured(const c10::OperatorName& name) {
  std::lock_guard<std::mutex> lock(g_structured_mu);
  return std::find(g_structured_ops->begin(), g_structured_ops->end(), name) != g_structured_ops->end();
}

// How the fallback runs an op: as itself, or as its functional twin with
// the results written into its out= tensors, or into its first argument.
struct Twin {
  std::optional<c10::OperatorHandle> functional;
  size_t num_out = 0;     // out= tensors at the end of the arguments
  bool in_place = false;  // the result goes into argument 0
  bool structured = false;  // sent whole by SendStructuredOpsWhole
};

const Twin& TwinOf(const c10::OperatorHandle& op) {
  static std::mutex mu;
  static auto* twins = new std::unordered_map<const c10::FunctionSchema*, Twin>();
  std::lock_guard<std::mutex> lock(mu);
  auto it = twins->find(&op.schema());
  if (it != twins->end()) return it->second;
  Twin t;
  t.functional = FunctionalOf(op.schema(), &t.num_out);
  t.structured = SentWholeStructured(op.operator_name());
  if (!t.functional.has_value() && t.structured) {
    t.functional = InPlaceFunctionalOf(op.schema());
    t.in_place = t.functional.has_value();
  }
  return twins->emplace(&op.schema(), std::move(t)).first->second;  // (nodes stay put)
}

void Fallback(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  // out= ops run as their functional twin with the results written into
  // the out= tensors: some out= kernels use `out` as scratch of another
  // shape, which a tensor viewing fixed device memory cannot be. In-place
  // ops sent here whole (SendStructuredOpsWhole) run the same way, into
  // their first argument, as ATen's own in-place kernels for other
  // backends do through the out= op.
  const Twin& twin = TwinOf(op);
  const std::optional<c10::OperatorHandle>& functional = twin.functional;
  if (twin.in_place) {
    const size_t n = op.schema().arguments().size();
    at::Tensor self = (*stack)[stack->size() - n].toTensor();
    // What ATen's TensorIterator refuses before writing: an expanded self,
    // and an input that overlaps self in part (the functional op would
    // read it whole before the write, which no in-place kernel does).
    at::assert_no_internal_overlap(self);
    for (size_t i = stack->size() - n + 1; i < stack->size(); ++i) {
      const c10::IValue& v = (*stack)[i];
      if (v.isTensor() && IsTpu(v.toTensor())) at::assert_no_partial_overlap(self, v.toTensor());
    }
    ForwardedOp f(*functional, stack);
    f.SetForcedOutputs({self}, /*in_place=*/true);
    f.SetStrictMeta();
    f.Run();
    torch::jit::drop(*stack, 1);
    torch::jit::push(*stack, std::move(self));
    return;
  }
  size_t num_out = twin.num_out;
  if (functional.has_value()) {
    num_out = op.schema().arguments().size() - functional->schema().arguments().size();
    std::vector<at::Tensor> outs;
    for (size_t i = stack->size() - num_out; i < stack->size(); ++i) outs.push_back((*stack)[i].toTensor());
    torch::jit::drop(*stack, num_out);
    ForwardedOp f(*functional, stack);
    f.SetForcedOutputs(outs);
    f.Run();
    // The out= op returns its out tensors.
    torch::jit::drop(*stack, num_out);
    for (const at::Tensor& t : outs) torch::jit::push(*stack, t);
    return;
  }
  ForwardedOp f(op, stack);
  if (twin.structured) f.SetStrictMeta();
  f.Run();
}

// ATen sends convolutions of backends it does not know to the
// *_overrideable ops; the daemon runs the full ATen convolution instead.
void ConvolutionOverrideable(const c10::OperatorHandle&, torch::jit::Stack* stack) {
  static const c10::OperatorHandle conv =
      c10::Dispatcher::singleton().findSchemaOrThrow("aten::convolution", "");
  ForwardedOp(conv, stack).Run();  // same arguments
}

void ConvolutionBackwardOverrideable(const c10::OperatorHandle&, torch::jit::Stack* stack) {
  static const c10::OperatorHandle back =
      c10::Dispatcher::singleton().findSchemaOrThrow("aten::convolution_backward", "");
  // (grad_output, input, weight, stride, padding, dilation, transposed,
  //  output_padding, groups, output_mask): convolution_backward also takes
  // bias_sizes after weight.
  std::vector<c10::IValue> args(stack->end() - 10, stack->end());
  torch::jit::drop(*stack, 10);
  const at::Tensor& weight = args[2].toTensor();
  const auto mask = args[9].toBoolList();
  c10::IValue bias_sizes;
  // The bias has one entry per output channel: weight's first dim, or for a
  // transposed convolution (weight: in x out/groups x ...) its second times
  // the groups.
  const bool transposed = args[6].toBool();
  const int64_t out_channels = transposed ? weight.size(1) * args[8].toInt() : weight.size(0);
  if (mask.get(2)) bias_sizes = std::vector<int64_t>{out_channels};
  for (int i = 0; i < 3; ++i) stack->push_back(args[i]);
  stack->push_back(bias_sizes);
  for (int i = 3; i < 10; ++i) stack->push_back(args[i]);
  ForwardedOp(back, stack).Run();
}

// Runs a named op through the forwarding path from C++.
at::Tensor& ForwardInPlace(const char* name, const char* overload, at::Tensor& self,
                           std::vector<c10::IValue> rest) {
  auto op = c10::Dispatcher::singleton().findSchemaOrThrow(name, overload);
  torch::jit::Stack stack;
  stack.push_back(self);
  for (auto& v : rest) stack.push_back(std::move(v));
  ForwardedOp(op, &stack).Run();
  return self;
}

// ---------------------------------------------------------------- natives

// A ZeroTensor, made as CUDA makes it: no memory at all; the ZeroTensor key
// makes ops see zeros (autograd uses these for gradients known to be zero).
at::Tensor EfficientZeroTensor(at::IntArrayRef size, std::optional<at::ScalarType> dtype,
                               std::optional<at::Layout>, std::optional<at::Device> device,
                               std::optional<bool>) {
  const c10::DeviceIndex idx =
      device.has_value() && device->has_index() ? device->index() : CurrentDevice();
  at::native::ZeroTensorAllocator allocator(c10::Device(kTpu, idx));
  return at::detail::empty_generic(size, &allocator,
                                   kTpuKeys | c10::DispatchKeySet(c10::DispatchKey::ZeroTensor),
                                   dtype.value_or(at::get_default_dtype_as_scalartype()),
                                   std::nullopt);
}

at::Tensor Empty(at::IntArrayRef size, std::optional<at::ScalarType> dtype,
                 std::optional<at::Layout> layout, std::optional<at::Device> device,
                 std::optional<bool>, std::optional<at::MemoryFormat> memory_format) {
  TORCH_CHECK(!layout.has_value() || *layout == at::kStrided, "tpu: only strided tensors");
  const c10::DeviceIndex idx =
      device.has_value() && device->has_index() ? device->index() : CurrentDevice();
  c10::DeviceGuard guard(c10::Device(kTpu, idx));
  return at::detail::empty_generic(size, GetTpuAllocator(), kTpuKeys,
                                   dtype.value_or(at::get_default_dtype_as_scalartype()),
                                   memory_format);
}

at::Tensor EmptyStridedNative(at::IntArrayRef size, at::IntArrayRef stride,
                              std::optional<at::ScalarType> dtype, std::optional<at::Layout>,
                              std::optional<at::Device> device, std::optional<bool>) {
  const c10::DeviceIndex idx =
      device.has_value() && device->has_index() ? device->index() : CurrentDevice();
  return EmptyStrided(size, stride, dtype.value_or(at::get_default_dtype_as_scalartype()), idx);
}

const at::Tensor& Resize(const at::Tensor& self, at::IntArrayRef size,
                         std::optional<at::MemoryFormat> memory_format) {
  c10::TensorImpl* impl = self.unsafeGetTensorImpl();
  impl->set_sizes_contiguous(size);
  const size_t needed =
      static_cast<size_t>(self.storage_offset() + self.numel()) * self.element_size();
  if (needed > self.storage().nbytes()) ResizeStorage(self.storage(), needed);
  if (memory_format.has_value()) impl->empty_tensor_restride(*memory_format);
  return self;
}

at::Tensor& SetStorage(at::Tensor& self, at::Storage source, int64_t offset,
                       at::IntArrayRef size, at::IntArrayRef stride) {
  c10::TensorImpl* impl = self.unsafeGetTensorImpl();
  impl->set_storage_keep_dtype(std::move(source));
  impl->set_storage_offset(offset);
  if (stride.empty()) {
    impl->set_sizes_contiguous(size);
  } else {
    impl->set_sizes_and_strides(size, stride);
  }
  return self;
}

at::Tensor& SetSource(at::Tensor& self, at::Storage source) {
  const int64_t n = static_cast<int64_t>(source.nbytes()) / self.element_size();
  return SetStorage(self, std::move(source), 0, {n}, {});
}

at::Tensor& SetSourceOffset(at::Tensor& self, at::Storage source, c10::SymInt offset,
                            c10::SymIntArrayRef size, c10::SymIntArrayRef stride) {
  return SetStorage(self, std::move(source), offset.expect_int(), C10_AS_INTARRAYREF_SLOW(size),
                    C10_AS_INTARRAYREF_SLOW(stride));
}

at::Tensor& SetTensor(at::Tensor& self, const at::Tensor& src) {
  return SetStorage(self, src.storage(), src.storage_offset(), src.sizes(), src.strides());
}

at::Tensor& SetEmpty(at::Tensor& self) {
  c10::Storage storage(c10::Storage::use_byte_size_t(), 0, GetTpuAllocator(), true);
  return SetStorage(self, std::move(storage), 0, {0}, {});
}

uint64_t AddressOf(const at::Tensor& t) {
  return reinterpret_cast<uint64_t>(t.storage().data_ptr().get()) +
         static_cast<uint64_t>(t.storage_offset()) * t.element_size();
}

// A tpu tensor with a lazy conjugate or negative bit, materialized on the
// device (the wire format carries plain data only).
at::Tensor Materialize(const at::Tensor& t) {
  at::Tensor out = t;
  if (out.is_conj()) out = at::conj_physical(at::conj(out));  // conj() of a conj view clears the bit
  if (out.is_neg()) out = at::neg(at::_neg_view(out));
  return out;
}

at::Tensor CopyFrom(const at::Tensor& self_in, const at::Tensor& dst, bool non_blocking) {
  tpu::Session& session = GetSession();
  if (dst.numel() == 0) return dst;
  const at::Tensor self =
      IsTpu(self_in) && (self_in.is_conj() || self_in.is_neg()) ? Materialize(self_in) : self_in;
  if (IsTpu(dst) && !IsTpu(self)) {
    const int stream = SessionStream(CurrentStreamId(dst.device().index()));
    at::Tensor src = self.to(dst.scalar_type()).expand_as(dst).contiguous();
    if (dst.is_contiguous()) {
      Check(session.CopyToDevice(stream, AddressOf(dst), src.data_ptr(), src.nbytes()),
            "copy to device");
      if (session.IsPinned(src.data_ptr())) {
        // From pinned memory the daemon copies later, straight from the
        // source: wait, so the caller may reuse or free it at once. (A true
        // non_blocking copy would need the pinned block kept until then.)
        absl::StatusOr<tpu::Event> done = session.RecordEvent(stream);
        Check(done.status(), "copy to device");
        absl::Status waited = session.SynchronizeEvent(*done);
        session.ReleaseEvent(*done);
        Check(waited, "copy to device");
      }
      return dst;
    }
    at::Tensor tmp = EmptyStrided(src.sizes(), src.strides(), src.scalar_type(),
                                  dst.device().index());
    Check(session.CopyToDevice(stream, AddressOf(tmp), src.data_ptr(), src.nbytes()),
          "copy to device");
    at::Tensor d = dst;
    ForwardInPlace("aten::copy_", "", d, {tmp, false});
    return dst;
  }
  if (!IsTpu(dst) && IsTpu(self)) {
    const int stream = SessionStream(CurrentStreamId(self.device().index()));
    at::Tensor src = self.is_contiguous() ? self : self.contiguous();
    const bool direct = dst.is_contiguous() && dst.scalar_type() == src.scalar_type() &&
                        dst.sizes() == src.sizes() && dst.device().is_cpu();
    at::Tensor host = direct ? dst : at::empty(src.sizes(), src.options().device(at::kCPU));
    Check(session.CopyToHost(stream, host.data_ptr(), AddressOf(src), src.nbytes()),
          "copy to host");
    if (!direct) dst.copy_(host);
    return dst;
  }
  // Device to device.
  TORCH_CHECK(IsTpu(self) && IsTpu(dst), "tpu: unexpected copy from ", self.device(), " to ",
              dst.device());
  const int stream = SessionStream(CurrentStreamId(dst.device().index()));
  if (self.scalar_type() == dst.scalar_type() && self.sizes() == dst.sizes() &&
      self.is_contiguous() && dst.is_contiguous()) {
    Check(session.CopyOnDevice(stream, AddressOf(dst), AddressOf(self), self.nbytes()),
          "device copy");
    return dst;
  }
  at::Tensor src = self;
  if (self.device() != dst.device()) {
    at::Tensor c = self.contiguous();
    src = EmptyStrided(c.sizes(), c.strides(), c.scalar_type(), dst.device().index());
    Check(session.CopyOnDevice(stream, AddressOf(src), AddressOf(c), c.nbytes()), "device copy");
  }
  at::Tensor d = dst;
  c10::DeviceGuard guard(dst.device());
  ForwardInPlace("aten::copy_", "", d, {src, non_blocking});
  return dst;
}

at::Tensor CopyFromAndResize(const at::Tensor& self, const at::Tensor& dst) {
  if (dst.sizes() != self.sizes()) {
    if (IsTpu(dst)) {
      Resize(dst, self.sizes(), std::nullopt);
    } else {
      const_cast<at::Tensor&>(dst).resize_(self.sizes());
    }
  }
  return CopyFrom(self, dst, false);
}

// Whether `from`'s TensorImpl fields may be shallow-copied into `self`
// (`param.data = t`), which nn.Module.to() relies on to keep a Parameter's
// identity, and with it tied weights and optimizers made before the move.
// c10 answers true between its own dense backends only; tpu tensors are
// plain dense TensorImpls too, so they join that set.
bool HasCompatibleShallowCopyType(const at::Tensor& self, const at::Tensor& from) {
  auto is_dense = [](c10::DispatchKeySet ks) {
    constexpr auto backends = c10::DispatchKeySet(
        {c10::BackendComponent::CPUBit, c10::BackendComponent::CUDABit,
         c10::BackendComponent::MPSBit, c10::BackendComponent::HIPBit,
         c10::BackendComponent::XPUBit, c10::BackendComponent::HPUBit,
         c10::BackendComponent::MTIABit, c10::BackendComponent::PrivateUse1Bit});
    return ks.has_any(c10::DispatchKeySet(c10::DispatchKey::Dense)) && ks.has_any(backends);
  };
  if (is_dense(self.key_set()) && is_dense(from.key_set())) return true;
  return self.unsafeGetTensorImpl()->has_compatible_shallow_copy_type(from.key_set());
}

at::Scalar LocalScalarDense(const at::Tensor& self) {
  const uint32_t id = OpIdFor("aten::_local_scalar_dense", "");
  tpu::OpArg arg;
  arg.tag = tpu::ArgTag::kTensor;
  arg.tensor = RefOf(self);
  const int stream = SessionStream(CurrentStreamId(self.device().index()));
  absl::StatusOr<std::vector<tpu::OpResult>> r =
      GetSession().RunSync(stream, id, &arg, 1, nullptr, 0);
  Check(r.status(), "reading a value (.item())");
  TORCH_CHECK(!r->empty(), "tpu: _local_scalar_dense returned nothing");
  const tpu::OpResult& v = (*r)[0];
  switch (v.kind) {
    case tpu::OpResult::Kind::kInt:
      return at::Scalar(v.i);
    case tpu::OpResult::Kind::kBool:
      return at::Scalar(v.b);
    case tpu::OpResult::Kind::kComplex:
      return at::Scalar(c10::complex<double>(v.d, v.d_imag));
    default:
      return at::Scalar(v.d);
  }
}

// Tensor.record_stream: the block is reused only after `stream` passed the
// point where the tensor was freed (see allocator.cc).
void RecordStream(at::Tensor& self, c10::Stream stream) {
  GetTpuAllocator()->recordStream(self.storage().data_ptr(), stream);
}

TORCH_LIBRARY_IMPL(aten, PrivateUse1, m) {
  m.impl("empty.memory_format", Empty);
  m.impl("record_stream", RecordStream);
  m.impl("empty_strided", EmptyStridedNative);
  m.impl("_efficientzerotensor", EfficientZeroTensor);
  m.impl("as_strided", at::native::as_strided_tensorimpl);
  m.impl("view", at::native::view);
  m.impl("_reshape_alias", at::native::_reshape_alias);
  m.impl("unfold", at::native::unfold);
  m.impl("alias", at::native::alias);
  m.impl("view_as_real", at::native::view_as_real);
  m.impl("view_as_complex", at::native::view_as_complex);
  m.impl("resize_", Resize);
  m.impl("set_.source_Storage", SetSource);
  m.impl("set_.source_Storage_storage_offset", SetSourceOffset);
  m.impl("set_.source_Tensor", SetTensor);
  m.impl("set_", SetEmpty);
  m.impl("_copy_from", CopyFrom);
  m.impl("_copy_from_and_resize", CopyFromAndResize);
  m.impl("_local_scalar_dense", LocalScalarDense);
  m.impl("_has_compatible_shallow_copy_type", HasCompatibleShallowCopyType);
  // Ops with a CompositeExplicitAutograd kernel would run decomposed on tpu
  // (many small ops, and results that differ from the CPU kernel: layer norm
  // of bfloat16 with float weights came back in float); send them whole.
  // The same holds for group norm (float16 gradients differed from the CPU's
  // by 0.5%), addr, and mish's backward (CompositeImplicitAutograd).
  for (const std::string& name : SentWholeOps()) {
    m.impl(name.c_str(), torch::CppFunction::makeFromBoxedFunction<&Fallback>());
  }
  m.impl("convolution_overrideable",
         torch::CppFunction::makeFromBoxedFunction<&ConvolutionOverrideable>());
  m.impl("convolution_backward_overrideable",
         torch::CppFunction::makeFromBoxedFunction<&ConvolutionBackwardOverrideable>());
}

// AMP: ops that run in lower precision under autocast("tpu"), the same
// list ATen uses for other accelerators; everything else falls through.
TORCH_LIBRARY_IMPL(_, AutocastPrivateUse1, m) { m.fallback(torch::CppFunction::makeFallthrough()); }

TORCH_LIBRARY_IMPL(aten, AutocastPrivateUse1, m) {
#define TPU_AUTOCAST_LOWER(...) KERNEL_PRIVATEUSEONE(__VA_ARGS__, lower_precision_fp)
  AT_FORALL_LOWER_PRECISION_FP(TPU_AUTOCAST_LOWER)
#undef TPU_AUTOCAST_LOWER
#define TPU_AUTOCAST_FP32(...) KERNEL_PRIVATEUSEONE(__VA_ARGS__, fp32)
  AT_FORALL_FP32(TPU_AUTOCAST_FP32)
#undef TPU_AUTOCAST_FP32
}

// Copies handle lazy conjugate/negative bits themselves: ATen's generic
// fallbacks for them would materialize through clone -> copy_ -> _copy_from,
// which lands here again.
TORCH_LIBRARY_IMPL(aten, Conjugate, m) {
  m.impl("_copy_from", torch::CppFunction::makeFallthrough());
}
TORCH_LIBRARY_IMPL(aten, Negative, m) {
  m.impl("_copy_from", torch::CppFunction::makeFallthrough());
}

TORCH_LIBRARY_IMPL(_, PrivateUse1, m) {
  m.fallback(torch::CppFunction::makeFromBoxedFunction<&Fallback>());
}

// ---------------------------------------------------------------- pinned

class PinnedAllocator final : public at::Allocator {
 public:
  at::DataPtr allocate(size_t n) override {
    if (n == 0) return {nullptr, nullptr, &Delete, at::Device(at::kCPU)};
    absl::StatusOr<void*> p = GetSession().AllocatePinned(n);
    Check(p.status(), "pinned host memory");
    return {*p, *p, &Delete, at::Device(at::kCPU)};
  }
  at::DeleterFnPtr raw_deleter() const override { return &Delete; }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    std::memcpy(dest, src, count);
  }
  static void Delete(void* p) {
    if (p != nullptr) (void)GetSession().FreePinned(p);
  }
};

}  // namespace

void SendForeachOpsWhole() {
  static std::once_flag once;
  std::call_once(once, [] {
    // ATen's foreach ops have, for devices other than CUDA, a composite
    // kernel that loops over the lists: one record per tensor. Sent whole
    // they are one record each, and the daemon's CPU kernel does the loop.
    // Only overloads whose tensors all come in lists and take no list of
    // scalars: a lone Tensor argument (a step size as a CPU scalar tensor)
    // travels as a scalar, and scalar lists are not forwarded as such.
    static auto* lib = new torch::Library(torch::Library::IMPL, "aten", c10::DispatchKey::PrivateUse1,
                                          __FILE__, __LINE__);
    for (const c10::OperatorName& name : c10::Dispatcher::singleton().getAllOpNames()) {
      if (name.name.rfind("aten::_foreach_", 0) != 0) continue;
      std::optional<c10::OperatorHandle> op = c10::Dispatcher::singleton().findOp(name);
      if (!op.has_value() || op->hasKernelForDispatchKey(c10::DispatchKey::PrivateUse1)) continue;
      bool lists_only = true;
      for (const c10::Argument& a : op->schema().arguments()) {
        const c10::TypePtr& t = a.real_type();
        const bool optional_tensor =
            t->kind() == c10::TypeKind::OptionalType &&
            t->castRaw<c10::OptionalType>()->getElementType()->kind() == c10::TypeKind::TensorType;
        const bool other_list = t->kind() == c10::TypeKind::ListType &&
                                t->castRaw<c10::ListType>()->getElementType()->kind() !=
                                    c10::TypeKind::TensorType;
        if (t->kind() == c10::TypeKind::TensorType || optional_tensor || other_list) lists_only = false;
      }
      if (!lists_only) continue;
      lib->impl(FullName(name).substr(6).c_str(), torch::CppFunction::makeFromBoxedFunction<&Fallback>());
    }
  });
}

namespace {

// ATen's structured ops have, for devices other than CPU and CUDA, a default
// kernel (CompositeExplicitAutogradNonFunctional) that runs the op's meta
// function on the real tensors (a TensorIterator for pointwise ops),
// allocates the result and calls the out= op, which reaches the fallback as
// the functional op again. The fallback keeps the meta result per
// signature: sent whole, the op skips that work. What the daemon gets is
// unchanged. `lowered` (nullptr: all) limits them to ops the daemon runs.
std::vector<c10::OperatorName> StructuredOpsToSendWhole(const std::vector<std::string>* lowered) {
  c10::Dispatcher& d = c10::Dispatcher::singleton();
  std::unordered_set<std::string> runs;
  if (lowered != nullptr) runs.insert(lowered->begin(), lowered->end());
  // f has an out= form: f's arguments, then only written tensors ("add.out"
  // for "add.Tensor", "max.dim_max" is not looked for).
  auto structured = [&](const c10::OperatorHandle& f) {
    const c10::OperatorName& n = f.operator_name();
    const auto& fargs = f.schema().arguments();
    for (const std::string& overload : {std::string("out"), n.overload_name + "_out"}) {
      auto out = d.findSchema({n.name, overload});
      if (!out.has_value()) continue;
      const auto& args = out->schema().arguments();
      bool match = args.size() > fargs.size();
      for (size_t i = 0; match && i < args.size(); ++i) {
        const bool writes = args[i].alias_info() != nullptr && args[i].alias_info()->isWrite();
        match = i < fargs.size() ? (!writes && args[i].name() == fargs[i].name() &&
                                    args[i].real_type()->str() == fargs[i].real_type()->str())
                                 : writes;
      }
      if (match) return true;
    }
    return false;
  };
  std::vector<c10::OperatorName> names;
  for (const c10::OperatorName& name : d.getAllOpNames()) {
    if (name.name.rfind("aten::", 0) != 0 || name.name == "aten::copy" ||
        name.name.rfind("aten::new_", 0) == 0 || name.name.find("nested") != std::string::npos) {
      continue;
    }
    std::optional<c10::OperatorHandle> op = d.findOp(name);
    if (!op.has_value() || op->hasKernelForDispatchKey(c10::DispatchKey::PrivateUse1) ||
        !op->hasKernelForDispatchKey(c10::DispatchKey::CompositeExplicitAutogradNonFunctional)) {
      continue;
    }
    std::optional<c10::OperatorHandle> functional = InPlaceFunctionalOf(op->schema());
    if (!functional.has_value()) functional = op;
    if (!structured(*functional)) continue;
    if (lowered != nullptr && runs.count(FullName(functional->operator_name())) == 0) continue;
    names.push_back(name);
  }
  return names;
}

}  // namespace

void SendStructuredOpsWhole(const std::vector<std::string>* lowered) {
  static std::once_flag once;
  std::call_once(once, [lowered] {
    static auto* lib = new torch::Library(torch::Library::IMPL, "aten", c10::DispatchKey::PrivateUse1,
                                          __FILE__, __LINE__);
    for (const c10::OperatorName& name : StructuredOpsToSendWhole(lowered)) {
      {
        std::lock_guard<std::mutex> lock(g_structured_mu);
        g_structured_ops->push_back(name);
      }
      lib->impl(FullName(name).substr(6).c_str(), torch::CppFunction::makeFromBoxedFunction<&Fallback>());
    }
  });
}

std::vector<std::string> StructuredOpsSentWhole() {
  std::lock_guard<std::mutex> lock(g_structured_mu);
  std::vector<std::string> names;
  for (const c10::OperatorName& n : *g_structured_ops) names.push_back(FullName(n));
  return names;
}

const std::vector<std::string>& SentWholeOps() {
  static const auto* ops = new std::vector<std::string>{"native_layer_norm", "native_group_norm", "addr",
                                                        "addr.out", "mish_backward"};
  return *ops;
}

at::Allocator* GetPinnedAllocator() {
  static PinnedAllocator* a = new PinnedAllocator();
  return a;
}

void ResizeStorage(const c10::Storage& storage, size_t newsize) {
  c10::StorageImpl* impl = storage.unsafeGetStorageImpl();
  const size_t old = impl->nbytes();
  if (newsize == old) return;
  // The allocator serves the current device: make it the storage's own.
  const c10::Device device = impl->device();
  c10::DeviceGuard guard(device);
  c10::DataPtr fresh = GetTpuAllocator()->allocate(newsize);
  const size_t keep = std::min(old, newsize);
  if (keep > 0 && impl->data_ptr().get() != nullptr) {
    const int stream = SessionStream(CurrentStreamId(device.index()));
    Check(GetSession().CopyOnDevice(stream, reinterpret_cast<uint64_t>(fresh.get()),
                                    reinterpret_cast<uint64_t>(impl->data_ptr().get()), keep),
          "resize");
  }
  impl->set_data_ptr_noswap(std::move(fresh));
  impl->set_nbytes(newsize);
}

}  // namespace torch_tpu
