// The forwarding path (see forwarding.h). The fallback finds output shapes
// by running the op on the `meta` device, allocates the outputs here, and
// enqueues the op without a round trip; ops whose outputs depend on data,
// or that return values to the host, take the synchronous path. Nothing
// falls back to the CPU silently.
#include "forwarding.h"

#include <ATen/ATen.h>
#include <ATen/MemoryOverlap.h>
#include <c10/core/DefaultDtype.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <pybind11/pybind11.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <unordered_set>

#include "allocator.h"
#include "native_kernels.h"
#include "native_meta.h"
#include "out_checks.h"
#include "runtime.h"
#include "wire.h"

namespace torch_tpu {
namespace {

// A CPU 0-dim tensor (a wrapped Python number) used with tpu tensors goes to
// the device first, as CUDA does implicitly.
at::Tensor ToDevice(const at::Tensor& cpu, c10::DeviceIndex device,
                    int stream) {
  at::Tensor src = cpu.contiguous();
  at::Tensor dst =
      EmptyStrided(src.sizes(), src.strides(), src.scalar_type(), device);
  if (src.nbytes() > 0) {
    Check(GetSession().CopyToDevice(stream,
                                    reinterpret_cast<uint64_t>(dst.data_ptr()),
                                    src.data_ptr(), src.nbytes()),
          "copy to device");
  }
  return dst;
}

// Ops that can fail inside a fused eager run (an index out of range, which
// tpud checks on the device): their issuing Python line is recorded.
bool MayFailInFusedRun(const std::string& name) {
  for (const char* word :
       {"index", "gather", "scatter", "put", "take", "embedding"}) {
    if (name.find(word) != std::string::npos) return true;
  }
  return false;
}

// Ops whose CPU kernels check their arguments by class alone: dtypes,
// ranks, which sizes are 0, 1 or more, stride-0 dimensions and scalar
// arguments, never tensor data (ones make no division by zero): foreach
// ops, fills, and every form (out= ones too, which the structured ops'
// composite kernels call) of the ops whose meta functions check what their
// kernels check. A new argument class of such an op is checked by its CPU
// kernel on host stand-ins (HostStandIn), with ATen's own words on failure,
// instead of by a synchronous run in tpud: no wait, and in fused eager no
// cut in the run (a first training step then runs as the steps after it).
// Exact shapes are the meta kernel's to check, as for any op.
bool ChecksOnHostStandIns(const c10::FunctionSchema& schema) {
  const std::string& name = schema.name();
  return name.rfind("aten::_foreach_", 0) == 0 || name == "aten::zero_" ||
         name == "aten::fill_" || NativeMetaChecksArguments(name);
}

// A host tensor of `t`'s class (KeyTensor's coarse form): its dtype and
// rank, each size cut to 2, stride-0 dimensions expanded; ones. Undefined
// for a tensor of another layout than strided (sparse): no stand-in.
at::Tensor HostStandIn(const at::Tensor& t) {
  if (t.layout() != at::kStrided) return at::Tensor();
  std::vector<int64_t> sizes(t.dim());
  std::vector<int64_t> base(t.dim());
  for (int64_t d = 0; d < t.dim(); ++d) {
    sizes[d] = std::min<int64_t>(t.size(d), 2);
    base[d] = t.stride(d) == 0 ? std::min<int64_t>(sizes[d], 1) : sizes[d];
  }
  at::Tensor h = at::ones(base, at::TensorOptions().dtype(t.scalar_type()));
  return base == sizes ? h : h.expand(sizes);
}

// `v` with its tpu tensors replaced by stand-ins; false where one has none.
bool HostStandIn(const c10::IValue& v, c10::IValue* host) {
  auto one = [](const at::Tensor& t, at::Tensor* h) {
    *h = IsTpu(t) ? HostStandIn(t) : t;
    return h->defined() || !t.defined();
  };
  if (v.isTensor()) {
    at::Tensor h;
    if (!one(v.toTensor(), &h)) return false;
    *host = std::move(h);
    return true;
  }
  if (v.isTensorList()) {
    c10::List<at::Tensor> list;
    for (const at::Tensor& t : v.toTensorVector()) {
      at::Tensor h;
      if (!one(t, &h)) return false;
      list.push_back(std::move(h));
    }
    *host = std::move(list);
    return true;
  }
  *host = v;
  return true;
}

// "file:line" of the innermost Python frame outside torch's and torch_tpu's
// own packages on this thread (the user's line); empty without one (an
// autograd engine thread).
std::string IssuedAt() {
  if (!Py_IsInitialized()) return {};
  const PyGILState_STATE gil = PyGILState_Ensure();
  std::string out;
  PyFrameObject* f = PyEval_GetFrame();  // borrowed
  Py_XINCREF(f);
  while (f != nullptr) {
    PyCodeObject* code = PyFrame_GetCode(f);
    const char* file = PyUnicode_AsUTF8(code->co_filename);
    const bool own = file == nullptr ||
                     std::strstr(file, "-packages/torch/") != nullptr ||
                     std::strstr(file, "-packages/torch_tpu/") != nullptr;
    if (!own)
      out = std::string(file) + ":" + std::to_string(PyFrame_GetLineNumber(f));
    Py_DECREF(code);
    PyFrameObject* back = own ? PyFrame_GetBack(f) : nullptr;
    Py_DECREF(f);
    f = back;
  }
  if (PyErr_Occurred()) PyErr_Clear();
  PyGILState_Release(gil);
  return out;
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

// Whether the daemon allocates the results of a synchronous run (the
// simulated backend does; PJRT runs only into outputs allocated here), so a
// first run can say a signature's output metadata (LearnsSpecFromRun).
std::atomic<bool> g_sync_runs_allocate{false};
// Streams capturing a program (module.cc): a captured op cannot wait for
// its values, so none learns from a run meanwhile.
std::atomic<int> g_captures{0};

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

// Argument classes (ForwardedOp::CheckedClass) that ran once without an error.
// The first op of a class waits for its result, so that an error its CPU
// kernel raises from its arguments (a dtype it refuses, from >= to in
// random_) reaches the caller at the call, as on the CPU; the ops after it
// are enqueued without waiting. Data-dependent errors (an index out of
// range in a kernel) stay asynchronous, as on CUDA.
std::mutex g_checked_mu;
std::unordered_set<std::string>* g_checked =
    new std::unordered_set<std::string>();
constexpr size_t kMaxChecked = 1 << 16;

bool WasChecked(const std::string& key) {
  std::lock_guard<std::mutex> lock(g_checked_mu);
  return g_checked->count(key) != 0;
}

void MarkChecked(const std::string& key) {
  std::lock_guard<std::mutex> lock(g_checked_mu);
  if (g_checked->size() >= kMaxChecked) g_checked->clear();
  g_checked->insert(key);
}

// What of a number an argument check can look at: NaN, infinity, sign,
// zero, integral, magnitude. (Not the value: a learning rate changing every
// step would make every step's ops new.)
uint8_t NumberClass(double v) {
  if (std::isnan(v)) return 1;
  uint8_t c = std::isinf(v) ? 2 : 0;
  if (v < 0) c |= 4;
  if (v == 0) c |= 8;
  if (std::isfinite(v) && v == std::floor(v)) c |= 16;
  // Magnitude: exact in float32's mantissa, in double's, within float32's
  // range, beyond it (range checks: uniform_(from, to) of extreme bounds).
  const double a = std::fabs(v);
  c |= (a <= 0x1p24                  ? 0
        : a <= 0x1p53                ? 1
        : a <= 3.4028234663852886e38 ? 2
                                     : 3)
       << 5;
  return c;
}

template <typename T>
void Put(std::string* k, const T& v) {
  k->append(reinterpret_cast<const char*>(&v), sizeof(v));
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
    default_dtype_ = c10::get_default_dtype_as_scalartype();
    if (!forced_.empty()) CheckForcedDevices();
    // The daemon runs the op under the same default dtype.
    const uint32_t flags = default_dtype_ == at::kFloat
                               ? 0
                               : (static_cast<uint32_t>(default_dtype_) + 1)
                                     << tpu::kOpFlagDefaultDtypeShift;
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
    std::shared_ptr<const MetaSpec> spec =
        cacheable ? CacheLookup(key) : nullptr;
    const bool new_signature = spec == nullptr;
    // Learning waits for the run, so only a signature of an argument class
    // not yet checked (which waits for its check anyway) learns: a new shape
    // of a checked class keeps going without a wait.
    std::string learn_class;
    const bool learn = new_signature && cacheable && LearnsSpecFromRun() &&
                       !CheckedClass(inputs, &learn_class);
    if (new_signature && !learn) spec = ComputeSpec(inputs);
    // A signature goes into the cache once its op was enqueued without an
    // argument error (below): a hit needs no check.
    auto remember = [&] {
      if (new_signature && cacheable) CacheStore(key, spec);
    };
    ScratchVector<tpu::OpArg> wire_scratch;
    std::vector<tpu::OpArg>& wire = *wire_scratch;
    wire.resize(n);
    auto encode_args = [&] {
      for (size_t i = 0; i < n; ++i)
        ArgToWire(inputs[i], schema_, i, device_, wire[i]);
    };
    const uint32_t id = OpIdFor(schema_);
    tpu::Session& session = GetSession();
    torch::jit::drop(*stack_, n);
    if (learn || spec->sync) {
      encode_args();
      absl::StatusOr<std::vector<tpu::OpResult>> results = session.RunSync(
          stream_, id, wire.data(), wire.size(), nullptr, 0, flags);
      CheckOp(results.status(), schema_.name().c_str());
      if (learn) {
        // Results that make no spec: the meta kernel's, so that the
        // signature is not run synchronously again.
        spec = SpecFromResults(*results);
        if (spec == nullptr) spec = ComputeSpec(inputs);
        CacheStore(key, spec);
        if (!learn_class.empty()) MarkChecked(learn_class);
      } else {
        remember();
      }
      PushSyncResults(*results);
      return;
    }
    ScratchVector<tpu::TensorRef> outputs_scratch;
    std::vector<tpu::TensorRef>& outputs = *outputs_scratch;
    outputs.clear();
    std::vector<c10::IValue> returns;
    bool all_alias = true;
    for (const ReturnSpec& r : spec->returns)
      returns.push_back(Apply(r, &outputs, &all_alias));
    // After the outputs: an out= argument may just have been resized.
    encode_args();
    if (all_alias && !WritesAnArgument()) {
      // A pure view op: the result is metadata over existing data.
      remember();
      for (c10::IValue& r : returns) torch::jit::push(*stack_, std::move(r));
      return;
    }
    // An op whose C++ meta function ran had its arguments checked as its
    // CPU kernel checks them (a structured kernel's meta half): no wait.
    std::string class_key;
    const bool check =
        new_signature && !checked_by_meta_ && !CheckedClass(inputs, &class_key);
    const bool host_check =
        check && ChecksOnHostStandIns(schema_) && CheckOnHost(inputs);
    if (host_check && !class_key.empty()) MarkChecked(class_key);
    if (check && !host_check) {
      CheckOp(session.RunChecked(stream_, id, wire.data(), wire.size(),
                                 outputs.data(), outputs.size(), flags),
              schema_.name().c_str());
      if (!class_key.empty()) MarkChecked(class_key);
    } else {
      // Fused eager: where an op that may fail in its run came from.
      const std::string issued_at =
          session.eager_fusion() && MayFailInFusedRun(schema_.name())
              ? IssuedAt()
              : std::string();
      absl::StatusOr<uint64_t> seq =
          session.EnqueueOp(stream_, id, wire.data(), wire.size(),
                            outputs.data(), outputs.size(), flags, issued_at);
      Check(seq.status(), schema_.name().c_str());
    }
    remember();
    for (auto& [tmp, out] : pending_copies_)
      ForwardInPlace("aten::copy_", "", out, {tmp, false});
    for (c10::IValue& r : returns) torch::jit::push(*stack_, std::move(r));
  }

 private:
  // The op's CPU kernel on host stand-ins of `inputs` (HostStandIn): ATen's
  // error, if the arguments' classes have one, is raised here. False:
  // nothing was checked, because an argument has no stand-in (a sparse
  // tensor) or the CPU kernel lacks the dtype ("not implemented for
  // 'Float8_e4m3fn'"), which tpud's backend may have.
  bool CheckOnHost(const std::vector<c10::IValue>& inputs) {
    torch::jit::Stack host(inputs.size());
    for (size_t i = 0; i < inputs.size(); ++i) {
      if (!HostStandIn(inputs[i], &host[i])) return false;
    }
    // The CPU kernel alone: no autocast (a CPU autocast region would cast
    // the stand-ins), no autograd, no Python mode seeing an extra op.
    c10::impl::ExcludeDispatchKeyGuard only_cpu(
        c10::autocast_dispatch_keyset | c10::autograd_dispatch_keyset |
        c10::DispatchKeySet({c10::DispatchKey::ADInplaceOrView,
                             c10::DispatchKey::Python,
                             c10::DispatchKey::PythonTLSSnapshot}));
    try {
      op_.callBoxed(&host);
    } catch (const c10::NotImplementedError&) {
      return false;
    }
    return true;
  }

  // The device tensors among the inputs, in the order MetaOf visits them.
  void CollectReals(const c10::IValue& v) {
    auto add = [&](const at::Tensor& t) {
      if (t.defined() && !t.device().is_cpu()) reals_.push_back(t);
    };
    if (v.isTensor()) {
      add(v.toTensor());
    } else if (v.isTensorList()) {
      for (const at::Tensor& t : v.toTensorList()) add(t);
    } else if (v.isList() && !v.isIntList() && !v.isDoubleList() &&
               !v.isBoolList()) {
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
      if (coarse_) {
        if (v.isComplex()) {
          Put(k, NumberClass(v.toComplexDouble().real()));
          Put(k, NumberClass(v.toComplexDouble().imag()));
        } else {
          Put(k, NumberClass(v.isFloatingPoint()
                                 ? v.toDouble()
                                 : static_cast<double>(v.toLong())));
        }
        return;
      }
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
    if (coarse_) {
      // Sizes as 0, 1 or more, and where strides are 0: the exact shapes
      // are the meta kernel's to check, on every signature.
      for (int64_t d = 0; d < t.dim(); ++d) {
        Put(k, static_cast<int8_t>(std::min<int64_t>(t.size(d), 2) +
                                   (t.stride(d) == 0 ? 4 : 0)));
      }
      Put(k, t.is_contiguous());
    } else {
      for (int64_t d = 0; d < t.dim(); ++d) {
        Put(k, t.size(d));
        Put(k, t.stride(d));
      }
      Put(k, t.storage_offset());
      Put(k, t.storage().nbytes());
    }
    // Which inputs share storage matters to aliasing results.
    const void* storage = t.storage().unsafeGetStorageImpl();
    int index = 0;
    while (index < static_cast<int>(seen_storages_.size()) &&
           seen_storages_[index] != storage) {
      ++index;
    }
    if (index == static_cast<int>(seen_storages_.size()))
      seen_storages_.push_back(storage);
    Put(k, index);
  }

  // Whether the inputs' argument class (their signature with sizes as 0, 1
  // or more and numbers by NumberClass) ran once without an error; else its
  // key goes into `class_key` (left empty when it has no key form).
  bool CheckedClass(const std::vector<c10::IValue>& inputs,
                    std::string* class_key) {
    seen_storages_.clear();
    coarse_ = true;
    const bool keyed = Key(inputs, class_key);
    coarse_ = false;
    if (!keyed) {
      class_key->clear();
      return false;
    }
    return WasChecked(*class_key);
  }

  // A key for the input signature; false when an argument has no key form.
  bool Key(const std::vector<c10::IValue>& inputs, std::string* k) {
    k->reserve(256);
    Put(k, &schema_);
    Put(k, static_cast<int8_t>(default_dtype_));  // it shapes result dtypes
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
        if (coarse_) {
          Put(k, NumberClass(v.toDouble()));
        } else {
          Put(k, v.toDouble());
        }
      } else if (v.isBool()) {
        k->push_back('b');
        Put(k, v.toBool());
      } else if (v.isComplexDouble()) {
        k->push_back('c');
        if (coarse_) {
          Put(k, NumberClass(v.toComplexDouble().real()));
          Put(k, NumberClass(v.toComplexDouble().imag()));
        } else {
          Put(k, v.toComplexDouble());
        }
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
        for (double x : v.toDoubleVector()) {
          if (coarse_) {
            Put(k, NumberClass(x));
          } else {
            Put(k, x);
          }
        }
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

  // Whether a new signature's output metadata comes from running the op
  // once, synchronously, rather than from its meta kernel. For an op without
  // a C++ meta function (FindNativeMeta), the Meta key's kernel is a Python
  // one, and torch._refs' (elementwise_type_promotion_wrapper's
  // torch._disable_dynamo) and torch._decomp's import torch._dynamo and
  // sympy on first use: about a second of CPU in the first process call of
  // hardtanh, isnan, batch norm, group norm, ... A new signature of such an
  // op is checked synchronously anyway (RunChecked), so the run that checks
  // it can say what it returns. That holds for every later call of the
  // signature only where the results' shapes follow from the signature
  // (pointwise ops, and the ops named below; not nonzero's) and their
  // layout too (the daemon hands back contiguous results: contiguous
  // inputs), and where they are new tensors, not views or arguments.
  bool LearnsSpecFromRun() const {
    if (in_place_ || !g_sync_runs_allocate.load(std::memory_order_relaxed) ||
        g_captures.load() != 0) {
      return false;
    }
    const auto& returns = schema_.returns();
    if (returns.empty()) return false;
    for (const c10::Argument& r : returns) {
      if (r.alias_info() != nullptr ||
          r.real_type()->kind() != c10::TypeKind::TensorType) {
        return false;
      }
    }
    if (op_.hasTag(at::Tag::dynamic_output_shape) ||
        op_.hasTag(at::Tag::data_dependent_output)) {
      return false;
    }
    static const auto* fixed_shapes = new std::unordered_set<std::string>{
        "aten::_batch_norm_with_update",
        "aten::_batch_norm_no_update",
        "aten::native_batch_norm",
        "aten::_native_batch_norm_legit_no_training",
        "aten::native_group_norm",
        "aten::log_sigmoid_forward",
        "aten::_prelu_kernel",
        "aten::_prelu_kernel_backward",
        "aten::native_batch_norm_backward",
        "aten::native_group_norm_backward",
        "aten::hardtanh_backward",
        "aten::mish_backward",
        "aten::huber_loss",
        "aten::binary_cross_entropy",
        "aten::im2col",
        "aten::col2im",
        "aten::grid_sampler_2d",
        "aten::roll",
        "aten::diag_embed",
        "aten::flip",
        "aten::kthvalue",
        "aten::adaptive_max_pool2d",
        "aten::searchsorted",
        "aten::histc",
        "aten::std_mean",
        "aten::var_mean",
        "aten::triu_indices",
        "aten::tril_indices",
        "aten::scatter",
        "aten::multinomial",
        "aten::_scaled_dot_product_flash_attention_for_cpu",
    };
    if (!op_.hasTag(at::Tag::pointwise) &&
        fixed_shapes->count(schema_.name()) == 0) {
      return false;
    }
    const std::string& overload = schema_.overload_name();
    if (FindNativeMeta(overload.empty()
                           ? schema_.name()
                           : schema_.name() + "." + overload) != nullptr) {
      return false;
    }
    for (const at::Tensor& t : reals_) {
      if (!t.is_contiguous()) return false;
    }
    return true;
  }

  // The spec of a signature whose first run returned `results` (see
  // LearnsSpecFromRun), or null where they do not make one: a result that
  // is an argument's storage, or of another kind than a tensor.
  std::shared_ptr<const MetaSpec> SpecFromResults(
      const std::vector<tpu::OpResult>& results) const {
    if (results.size() != schema_.returns().size()) return nullptr;
    auto spec = std::make_shared<MetaSpec>();
    for (const tpu::OpResult& v : results) {
      if (v.kind == tpu::OpResult::Kind::kNone) {
        ReturnSpec undefined;  // output_mask left it out: an undefined tensor
        undefined.items.emplace_back();
        spec->returns.push_back(std::move(undefined));
        continue;
      }
      if (v.kind != tpu::OpResult::Kind::kTensor) return nullptr;
      for (const at::Tensor& real : reals_) {
        if (v.tensor.address != 0 &&
            reinterpret_cast<uint64_t>(real.storage().data_ptr().get()) ==
                v.tensor.address) {
          return nullptr;
        }
      }
      OutSpec o;
      o.kind = OutSpec::Kind::kNew;
      o.sizes.assign(v.tensor.sizes, v.tensor.sizes + v.tensor.ndim);
      const c10::DimVector strides = c10::contiguous_strides(o.sizes);
      o.strides.assign(strides.begin(), strides.end());
      o.dtype = static_cast<at::ScalarType>(v.tensor.dtype);
      ReturnSpec rs;
      rs.items.push_back(std::move(o));
      spec->returns.push_back(std::move(rs));
    }
    return spec;
  }

  std::shared_ptr<const MetaSpec> ComputeSpec(
      const std::vector<c10::IValue>& inputs) {
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
    if (name == "aten::_embedding_bag" ||
        name == "aten::_embedding_bag_forward_only") {
      // Which of offset2bag and max_indices the CPU kernel fills (and how
      // big they are) depends on the mode and fast paths the meta kernel
      // does not model: take the kernel's own results.
      spec->sync = true;
      return spec;
    }
    // Ops whose result shapes always depend on data: their Python meta
    // kernels only say so, after importing sympy (0.3 s, once a process).
    static const auto* data_shaped =
        new std::unordered_set<std::string>{"aten::nonzero",
                                            "aten::argwhere",
                                            "aten::masked_select",
                                            "aten::_unique",
                                            "aten::_unique2",
                                            "aten::unique_dim",
                                            "aten::unique_consecutive",
                                            "aten::unique_dim_consecutive"};
    if (!in_place_ && data_shaped->count(name) != 0) {
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
        for (const at::Tensor& t : m.toTensorList())
          rs.items.push_back(SpecOf(t));
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
  void MatchCpuStatistics(const std::vector<c10::IValue>& inputs,
                          MetaSpec* spec) const {
    const std::string& name = schema_.name();
    const bool batch_norm =
        name == "aten::native_batch_norm" ||
        name == "aten::_native_batch_norm_legit" ||
        name == "aten::_native_batch_norm_legit_no_training" ||
        name == "aten::_batch_norm_with_update" ||
        name == "aten::_batch_norm_no_update";
    const bool layer_norm = name == "aten::native_layer_norm";
    if (!batch_norm && !layer_norm) return;
    if (spec->returns.size() < 3 || inputs.empty() || !inputs[0].isTensor())
      return;
    const at::ScalarType in = inputs[0].toTensor().scalar_type();
    bool training = name != "aten::_native_batch_norm_legit_no_training" &&
                    name != "aten::_batch_norm_no_update";
    bool mixed = false;
    const auto& args = schema_.arguments();
    for (size_t i = 1; i < args.size() && i < inputs.size(); ++i) {
      if (args[i].name() == "training" && inputs[i].isBool())
        training = inputs[i].toBool();
      if (inputs[i].isTensor() && inputs[i].toTensor().defined() &&
          inputs[i].toTensor().scalar_type() != in &&
          at::isReducedFloatingType(in) &&
          inputs[i].toTensor().scalar_type() == at::kFloat) {
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
      if (meta_pairs_[i].first.unsafeGetTensorImpl() ==
          m.unsafeGetTensorImpl()) {
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

  at::Tensor ApplyOne(const OutSpec& o, std::vector<tpu::TensorRef>* outputs,
                      bool* all_alias) {
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
          TORCH_CHECK(!cast || at::canCast(o.dtype, out.scalar_type()),
                      "result type ", o.dtype,
                      " can't be cast to the desired output type ",
                      out.scalar_type());
          if (out.sizes() != at::IntArrayRef(o.sizes)) {
            TORCH_CHECK(!in_place_, "output with shape ", out.sizes(),
                        " doesn't match the broadcast shape ",
                        at::IntArrayRef(o.sizes));
            WarnResized(out, o.sizes);
            Resize(out, o.sizes, std::nullopt);
          }
          if (cast || !out.is_contiguous() ||
              out.strides() != at::IntArrayRef(o.strides)) {
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
            real.strides() != at::IntArrayRef(o.strides) ||
            real.storage_offset() != o.offset) {
          if (o.storage_bytes > real.storage().nbytes()) {
            ResizeStorage(real.storage(), o.storage_bytes);
          }
          real.unsafeGetTensorImpl()->set_sizes_and_strides(o.sizes, o.strides,
                                                            o.offset);
        }
        outputs->push_back(RefOf(real));
        return real;
      }
      case OutSpec::Kind::kView: {
        at::Tensor view =
            reals_.at(o.input).as_strided(o.sizes, o.strides, o.offset);
        outputs->push_back(RefOf(view));
        return view;
      }
    }
    return at::Tensor();
  }

  c10::IValue Apply(const ReturnSpec& r, std::vector<tpu::TensorRef>* outputs,
                    bool* all_alias) {
    if (r.is_none) {
      outputs->push_back(tpu::TensorRef{});
      return c10::IValue();
    }
    if (r.is_list) {
      c10::List<at::Tensor> list;
      for (const OutSpec& o : r.items)
        list.push_back(ApplyOne(o, outputs, all_alias));
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

  // ATen's out= rule (at::native::resize_output): resizing an out= tensor
  // that holds elements is deprecated, and says so.
  static void WarnResized(const at::Tensor& out, at::IntArrayRef shape) {
    if (out.numel() == 0) return;
    TORCH_WARN(
        "An output with one or more elements was resized since it had shape ",
        out.sizes(), ", which does not match the required output shape ", shape,
        ". This behavior is deprecated, and in a future PyTorch release "
        "outputs "
        "will not be resized unless they have zero elements. You can "
        "explicitly "
        "reuse an out tensor t by resizing it, inplace, to zero elements with "
        "t.resize_(0).");
  }

  // The out= tensors an op writes through its functional twin: on the op's
  // device, as ATen requires of out= tensors.
  void CheckForcedDevices() {
    const size_t n = schema_.arguments().size();
    FindDevice(torch::jit::last(*stack_, n));
    for (const at::Tensor& out : forced_) {
      TORCH_CHECK(
          IsTpu(out) && out.device().index() == device_,
          "Expected all tensors to be on the same device, but found at least "
          "two devices, ",
          c10::Device(kTpu, device_), " and ", out.device(),
          "! (tpu: the out= tensor of ", schema_.name(), ")");
    }
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
        if (v.isDevice() && v.toDevice().type() == kTpu &&
            v.toDevice().has_index()) {
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
  at::Tensor NormalizeTensor(const at::Tensor& t, size_t index,
                             bool in_list = false) {
    if (!in_list && t.defined() && t.device().is_cpu() && t.dim() == 0)
      return t;
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
      TORCH_CHECK(!t.defined() || t.device().index() == device_,
                  "tpu: ", schema_.name(),
                  ": expected all tensors on tpu:", static_cast<int>(device_),
                  ", found one on ", t.device(), " (argument ", index, ")");
      return t;
    }
    // CPU tensors inside lists (index tensors of index/index_put) and
    // integer index arguments (index_fill's, index_select's) go to the
    // device, as the CPU kernels take them; elsewhere only host scalars may.
    const std::string& formal = schema_.arguments()[index].name();
    const bool index_arg =
        (formal == "index" || formal == "indices") &&
        at::isIntegralType(t.scalar_type(), /*includeBool=*/false);
    TORCH_CHECK(t.device().is_cpu() && (t.dim() == 0 || in_list || index_arg),
                "Expected all tensors to be on the same device, but found at "
                "least two devices, ",
                c10::Device(kTpu, device_), " and ", t.device(),
                "! (tpu: ", schema_.name(), " argument ", index, ", shape ",
                t.sizes(), "; move it with .to(\"tpu\"))");
    at::Tensor moved = ToDevice(t, device_, stream_);
    keep_alive_.push_back(moved);
    return moved;
  }

  c10::IValue Normalize(const c10::IValue& v, size_t index) {
    if (v.isTensor()) return NormalizeTensor(v.toTensor(), index);
    if (v.isTensorList()) {
      c10::List<at::Tensor> out;
      for (const at::Tensor& t : v.toTensorList())
        out.push_back(NormalizeTensor(t, index, true));
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
    if (t.defined() && t.device().is_cpu() && t.dim() == 0 &&
        !t.unsafeGetTensorImpl()->is_wrapped_number() &&
        (t.is_floating_point() || t.is_complex())) {
      // A CPU 0-dim tensor beside tpu ones is a scalar operand, as on CUDA;
      // meta kernels that check devices take it as a meta one. (Integer
      // ones stay: narrow's start, for one, is read for its value.)
      return at::empty({}, t.options().device(c10::kMeta));
    }
    if (!t.defined() || t.device().is_cpu()) return t;  // host scalars stay
    const int64_t itemsize = t.element_size();
    const int64_t storage_numel =
        static_cast<int64_t>(t.storage().nbytes()) / itemsize;
    at::Tensor base =
        at::empty({storage_numel}, t.options().device(c10::kMeta));
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
    if (v.isDevice() && v.toDevice().type() == kTpu)
      return c10::Device(c10::kMeta);
    if (v.isGenerator()) return c10::IValue();
    return v;
  }

  // Output metadata from the meta kernel. False when the op cannot say
  // without looking at data (nonzero, unique, boolean indexing, ...).
  bool RunMeta(const std::vector<c10::IValue>& inputs,
               std::vector<c10::IValue>* results) {
    torch::jit::Stack meta;
    for (const c10::IValue& v : inputs) meta.push_back(MetaOf(v));
    // ATen's C++ meta function where the table has it: the Meta key's
    // kernel is often a Python one (native_meta.h). Only a data-dependent
    // shape is declined; any other error is the arguments' fault, in the
    // CPU kernel's own words, and reaches the caller.
    const std::string& overload = schema_.overload_name();
    const std::string full_name =
        overload.empty() ? schema_.name() : schema_.name() + "." + overload;
    const NativeMetaFn native = FindNativeMeta(full_name);
    if (native != nullptr) {
      try {
        native(&meta);
      } catch (const c10::NotImplementedError&) {
        if (in_place_) throw;
        return false;
      }
      *results = std::move(meta);
      checked_by_meta_ = NativeMetaChecksArguments(full_name);
      return true;
    }
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
      // An op whose meta function checks what its kernel checks (mul.out
      // of a float result into a long tensor): bad arguments, raised in
      // the CPU kernel's words where their classes show it (else the run
      // in tpud says what it finds).
      if (!data_dependent && NativeMetaChecksArguments(schema_.name()))
        (void)CheckOnHost(inputs);
      if (in_place_ || (strict_meta_ && !data_dependent)) throw;
      return false;
    } catch (const std::exception&) {
      // c10::Error from C++ meta kernels, or a Python meta registration's
      // NotImplementedError: the shape depends on data. Not so for a
      // structured op sent whole (its meta function is written for meta
      // tensors), nor for an op called in place (its result has its first
      // argument's shape): a failing meta kernel means bad arguments, and
      // its message is ATen's own. An op whose meta function checks what
      // its kernel checks: its CPU kernel's words where the arguments'
      // classes show the fault (as above).
      if (NativeMetaChecksArguments(schema_.name())) (void)CheckOnHost(inputs);
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
        while (next < results.size() &&
               results[next].kind == tpu::OpResult::Kind::kTensor) {
          list.push_back(IntoForced(Adopt(results[next++])));
        }
        torch::jit::push(*stack_, std::move(list));
        continue;
      }
      TORCH_CHECK(next < results.size(), "tpu: ", schema_.name(),
                  ": the daemon returned ", results.size(),
                  " values, fewer than the schema's");
      const tpu::OpResult& v = results[next++];
      switch (v.kind) {
        case tpu::OpResult::Kind::kTensor:
          torch::jit::push(*stack_, IntoForced(Adopt(v)));
          break;
        case tpu::OpResult::Kind::kInt:
          torch::jit::push(*stack_, v.i);
          break;
        case tpu::OpResult::Kind::kUInt:
          torch::jit::push(*stack_, c10::Scalar(static_cast<uint64_t>(v.i)));
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
          // An undefined tensor (a backward's output_mask left it out) where
          // the schema says Tensor; None where it says Tensor? or a value.
          if (t->kind() == c10::TypeKind::TensorType) {
            torch::jit::push(*stack_, at::Tensor());
          } else {
            torch::jit::push(*stack_, c10::IValue());
          }
          break;
      }
    }
  }

  // On the synchronous path of an out= op: the result goes into the
  // caller's out= tensor (resized to it), which is what the op returns.
  at::Tensor IntoForced(const at::Tensor& result) {
    if (next_forced_ >= forced_.size()) return result;
    at::Tensor& out = forced_[next_forced_++];
    // Ops whose result depends on data (nonzero, masked_select, ...) take
    // only an out= tensor of the result's dtype, as their CPU kernels do.
    TORCH_CHECK(in_place_ || out.scalar_type() == result.scalar_type(),
                schema_.name(), ": Expected out tensor to have scalar type ",
                result.scalar_type(), " but got scalar type ",
                out.scalar_type());
    if (out.sizes() != result.sizes()) {
      TORCH_CHECK(!in_place_, "output with shape ", out.sizes(),
                  " doesn't match the broadcast shape ", result.sizes());
      WarnResized(out, result.sizes());
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
      if (reinterpret_cast<uint64_t>(real.storage().data_ptr().get()) ==
              v.tensor.address &&
          v.tensor.address != 0) {
        std::vector<int64_t> strides(v.tensor.strides,
                                     v.tensor.strides + v.tensor.ndim);
        if (real.sizes() == at::IntArrayRef(sizes) &&
            real.strides() == at::IntArrayRef(strides) &&
            real.storage_offset() == v.tensor.storage_offset &&
            static_cast<int8_t>(real.scalar_type()) == v.tensor.dtype) {
          return real;
        }
        return real.as_strided(sizes, strides, v.tensor.storage_offset);
      }
    }
    const auto dtype = static_cast<at::ScalarType>(v.tensor.dtype);
    if (v.tensor.address == 0)
      return EmptyStrided(sizes, c10::contiguous_strides(sizes), dtype,
                          device_);
    c10::Storage storage(c10::Storage::use_byte_size_t(), v.nbytes,
                         AdoptSegment(v.tensor.address, v.nbytes, device_),
                         GetTpuAllocator(),
                         /*resizable=*/true);
    at::Tensor t = at::detail::make_tensor<c10::TensorImpl>(
        std::move(storage), kTpuKeys, caffe2::TypeMeta::fromScalarType(dtype));
    t.unsafeGetTensorImpl()->set_sizes_contiguous(sizes);
    return t;
  }

  const c10::OperatorHandle& op_;
  const c10::FunctionSchema& schema_;
  torch::jit::Stack* stack_;
  c10::DeviceIndex device_ = -1;
  int stream_ = 0;
  std::vector<std::pair<at::Tensor, at::Tensor>>
      meta_pairs_;  // meta twin, tpu tensor
  std::vector<at::Tensor> keep_alive_;
  std::vector<at::Tensor> reals_;   // device tensors of the inputs
  std::vector<at::Tensor> forced_;  // out= tensors to write results into
  size_t next_forced_ = 0;
  bool in_place_ = false;
  bool strict_meta_ = false;
  std::vector<std::pair<at::Tensor, at::Tensor>> pending_copies_;  // (tmp, out)
  std::vector<const void*> seen_storages_;  // for the signature key
  bool coarse_ = false;           // Key() makes the argument class's key
  bool checked_by_meta_ = false;  // ATen's C++ meta function ran (RunMeta)
  at::ScalarType default_dtype_ = at::kFloat;  // torch's, as the op began
};

// An out= op's functional twin: same name, overload "" for "out" or "X" for
// "X_out", taking exactly the out= op's leading arguments.
std::optional<c10::OperatorHandle> FunctionalOf(
    const c10::FunctionSchema& schema, size_t* num_out) {
  const std::string& overload = schema.overload_name();
  std::string base;
  if (overload == "out" || overload == "values") {
    base = "";  // mode.values -> mode
  } else if (overload.size() > 4 &&
             overload.compare(overload.size() - 4, 4, "_out") == 0) {
    base = overload.substr(0, overload.size() - 4);
  } else if (overload == "values_stable") {
    base = "stable";  // sort.values_stable -> sort.stable
  } else if (overload == "grad_input") {
    base = "";  // elu_backward.grad_input -> elu_backward
  } else if (overload.size() > 3 && overload.compare(0, 3, "Out") == 0) {
    base = overload.substr(3);  // xlogy.OutTensor -> xlogy.Tensor
  } else if (overload == "dim_max" || overload == "dim_min") {
    base = "dim";  // max.dim_max -> max.dim
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
  if (fargs.size() + outs != args.size() ||
      f->schema().returns().size() != outs) {
    return std::nullopt;
  }
  for (size_t i = 0; i < fargs.size(); ++i) {
    if (fargs[i].name() != args[i].name() || fargs[i].alias_info() != nullptr)
      return std::nullopt;
  }
  for (const c10::Argument& r : f->schema().returns()) {
    if (r.type()->kind() != c10::TypeKind::TensorType) return std::nullopt;
  }
  *num_out = outs;
  return f;
}

// The structured ops NoteStructuredSentWhole noted.
std::mutex g_structured_mu;
std::vector<c10::OperatorName>* g_structured_ops =
    new std::vector<c10::OperatorName>();

bool SentWholeStructured(const c10::OperatorName& name) {
  std::lock_guard<std::mutex> lock(g_structured_mu);
  return std::find(g_structured_ops->begin(), g_structured_ops->end(), name) !=
         g_structured_ops->end();
}

// How the fallback runs an op: as itself, or as its functional twin with
// the results written into its out= tensors, or into its first argument.
struct Twin {
  std::optional<c10::OperatorHandle> functional;
  size_t num_out = 0;            // out= tensors at the end of the arguments
  bool in_place = false;         // the result goes into argument 0
  bool structured = false;       // sent whole by SendStructuredOpsWhole
  OutCheck out_check = nullptr;  // ATen's checks of the out= tensors
};

const Twin& TwinOf(const c10::OperatorHandle& op) {
  static std::mutex mu;
  static auto* twins =
      new std::unordered_map<const c10::FunctionSchema*, Twin>();
  std::lock_guard<std::mutex> lock(mu);
  auto it = twins->find(&op.schema());
  if (it != twins->end()) return it->second;
  Twin t;
  t.functional = FunctionalOf(op.schema(), &t.num_out);
  if (t.functional.has_value()) t.out_check = FindOutCheck(op.operator_name());
  t.structured = SentWholeStructured(op.operator_name());
  if (!t.functional.has_value() && t.structured) {
    t.functional = InPlaceFunctionalOf(op.schema());
    t.in_place = t.functional.has_value();
  }
  return twins->emplace(&op.schema(), std::move(t))
      .first->second;  // (nodes stay put)
}

}  // namespace

std::optional<c10::OperatorHandle> InPlaceFunctionalOf(
    const c10::FunctionSchema& schema) {
  const std::string& name = schema.name();
  const auto& args = schema.arguments();
  if (name.size() < 2 || name.back() != '_' || args.empty() ||
      schema.returns().size() != 1) {
    return std::nullopt;
  }
  for (size_t i = 0; i < args.size(); ++i) {
    const bool writes =
        args[i].alias_info() != nullptr && args[i].alias_info()->isWrite();
    if (writes != (i == 0)) return std::nullopt;
  }
  auto f = c10::Dispatcher::singleton().findSchema(
      {name.substr(0, name.size() - 1), schema.overload_name()});
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

void NoteCapture(bool begins) { g_captures.fetch_add(begins ? 1 : -1); }

void SetSyncRunsAllocateResults(bool allocate) {
  g_sync_runs_allocate.store(allocate);
}

void NoteStructuredSentWhole(const c10::OperatorName& name) {
  std::lock_guard<std::mutex> lock(g_structured_mu);
  g_structured_ops->push_back(name);
}

std::vector<c10::OperatorName> StructuredSentWhole() {
  std::lock_guard<std::mutex> lock(g_structured_mu);
  return *g_structured_ops;
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
      if (v.isTensor() && IsTpu(v.toTensor()))
        at::assert_no_partial_overlap(self, v.toTensor());
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
    num_out = op.schema().arguments().size() -
              functional->schema().arguments().size();
    if (twin.out_check != nullptr) {
      RunOutCheck(twin.out_check,
                  torch::jit::last(*stack, op.schema().arguments().size()));
    }
    std::vector<at::Tensor> outs;
    for (size_t i = stack->size() - num_out; i < stack->size(); ++i)
      outs.push_back((*stack)[i].toTensor());
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
void ConvolutionOverrideable(const c10::OperatorHandle&,
                             torch::jit::Stack* stack) {
  static const c10::OperatorHandle conv =
      c10::Dispatcher::singleton().findSchemaOrThrow("aten::convolution", "");
  ForwardedOp(conv, stack).Run();  // same arguments
}

void ConvolutionBackwardOverrideable(const c10::OperatorHandle&,
                                     torch::jit::Stack* stack) {
  static const c10::OperatorHandle back =
      c10::Dispatcher::singleton().findSchemaOrThrow(
          "aten::convolution_backward", "");
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
  const int64_t out_channels =
      transposed ? weight.size(1) * args[8].toInt() : weight.size(0);
  if (mask.get(2)) bias_sizes = std::vector<int64_t>{out_channels};
  for (int i = 0; i < 3; ++i) stack->push_back(args[i]);
  stack->push_back(bias_sizes);
  for (int i = 3; i < 10; ++i) stack->push_back(args[i]);
  ForwardedOp(back, stack).Run();
}

void ForwardOp(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  ForwardedOp(op, stack).Run();
}

// Runs a named op through the forwarding path from C++.
at::Tensor& ForwardInPlace(const char* name, const char* overload,
                           at::Tensor& self, std::vector<c10::IValue> rest) {
  auto op = c10::Dispatcher::singleton().findSchemaOrThrow(name, overload);
  torch::jit::Stack stack;
  stack.push_back(self);
  for (auto& v : rest) stack.push_back(std::move(v));
  ForwardedOp(op, &stack).Run();
  return self;
}

}  // namespace torch_tpu
