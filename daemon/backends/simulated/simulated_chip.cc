#include "daemon/backends/simulated/simulated_chip.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/core/LegacyTypeDispatch.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>
#include <c10/core/DefaultDtype.h>
#include <c10/core/GradMode.h>
#include <c10/core/RefcountedDeleter.h>
#include <c10/util/Exception.h>
#include <torch/headeronly/version.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <exception>
#include <optional>
#include <set>
#include <utility>
#include <variant>

#include "absl/base/optimization.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "daemon/backends/simulated/small_elementwise.h"
#include "tpu/op_error.h"

namespace tpud {

// One resolved operator: the dispatcher's handle and a copy of its schema.
class SimulatedOp final : public BackendOp {
 public:
  SimulatedOp(std::string schema, std::string name, c10::OperatorHandle handle)
      : schema_(std::move(schema)),
        name_(std::move(name)),
        handle_(std::move(handle)),
        function_schema_(handle_.schema()),
        packable_foreach_(IsPackableForeach(name_, function_schema_)),
        elementwise_(SmallElementwiseOf(name_)) {}

  const std::string& schema() const override { return schema_; }
  bool WritesArgument(size_t index) const override {
    const auto& args = function_schema_.arguments();
    return index < args.size() && args[index].alias_info() != nullptr &&
           args[index].alias_info()->isWrite();
  }
  bool OverwritesArgument(size_t index) const override {
    if (!WritesArgument(index)) return false;
    // out= tensors are keyword-only; the in-place ops below never read self.
    if (function_schema_.arguments()[index].kwarg_only()) return true;
    if (index != 0) return false;
    static const auto* const kOverwriteSelf = new std::set<std::string>{
        "aten::fill_",        "aten::zero_",      "aten::copy_",
        "aten::normal_",      "aten::uniform_",   "aten::random_",
        "aten::exponential_", "aten::geometric_", "aten::cauchy_",
        "aten::log_normal_",  "aten::bernoulli_"};
    return kOverwriteSelf->count(name_.substr(0, name_.find('.'))) != 0;
  }
  // "aten::add.Tensor": how messages name the op.
  const std::string& name() const { return name_; }
  const c10::OperatorHandle& handle() const { return handle_; }
  const c10::FunctionSchema& function_schema() const {
    return function_schema_;
  }
  // The op's out= variant, when it has one that takes exactly this op's
  // arguments plus one out tensor per returned tensor: outputs the client
  // allocated are then written in place instead of copied.
  const std::optional<c10::OperatorHandle>& out_variant() const {
    return out_variant_;
  }
  void set_out_variant(c10::OperatorHandle h) { out_variant_ = std::move(h); }
  // Some out= kernels compute differently from their functional op (they
  // use the out tensor as scratch of another shape): once one fails, the op
  // goes the functional way for good.
  bool out_variant_usable() const {
    return !out_variant_failed_.load(std::memory_order_relaxed);
  }
  // Ops returning more than one tensor (statistics beside a result): their
  // CPU kernels may keep the statistics in another floating type.
  bool meta_dtype_may_differ() const {
    return function_schema_.returns().size() > 1;
  }
  void disable_out_variant() const { out_variant_failed_.store(true); }
  // An elementwise _foreach_ op over tensor lists and scalars only, in place
  // on its first list or returning one new list: run as one kernel over the
  // lists packed end to end (see OpRun::TryPackedForeach).
  bool packable_foreach() const { return packable_foreach_; }
  // mul.Tensor, add.Tensor, sub.Tensor: small_elementwise.h's ops.
  SmallElementwise elementwise() const { return elementwise_; }

 private:
  static bool IsPackableForeach(const std::string& name,
                                const c10::FunctionSchema& schema);

  const std::string schema_;
  const std::string name_;
  const c10::OperatorHandle handle_;
  const c10::FunctionSchema function_schema_;
  const bool packable_foreach_;
  const SmallElementwise elementwise_;
  std::optional<c10::OperatorHandle> out_variant_;
  mutable std::atomic<bool> out_variant_failed_{false};
};

bool SimulatedOp::IsPackableForeach(const std::string& name,
                                    const c10::FunctionSchema& schema) {
  constexpr absl::string_view kPrefix = "aten::_foreach_";
  if (!absl::StartsWith(name, kPrefix)) return false;
  absl::string_view base(name);
  base.remove_prefix(kPrefix.size());
  base = base.substr(0, base.find('.'));
  const bool in_place = absl::EndsWith(base, "_");
  if (in_place) base.remove_suffix(1);
  // Element by element, each output element from the same position of each
  // input: never a reduction (_foreach_norm, _foreach_max) or a product.
  static const auto* const kElementwise =
      new std::set<std::string, std::less<>>{
          "abs",   "acos",       "add",       "addcdiv",   "addcmul", "asin",
          "atan",  "ceil",       "clamp_max", "clamp_min", "copy",    "cos",
          "cosh",  "div",        "erf",       "erfc",      "exp",     "expm1",
          "floor", "frac",       "lerp",      "lgamma",    "log",     "log10",
          "log1p", "log2",       "maximum",   "minimum",   "mul",     "neg",
          "pow",   "reciprocal", "round",     "rsqrt",     "sigmoid", "sign",
          "sin",   "sinh",       "sqrt",      "sub",       "tan",     "tanh",
          "trunc", "zero"};
  if (kElementwise->count(base) == 0) return false;
  const auto& args = schema.arguments();
  bool has_list = false;
  for (size_t i = 0; i < args.size(); ++i) {
    const c10::TypePtr& type = args[i].type();
    const bool written =
        args[i].alias_info() != nullptr && args[i].alias_info()->isWrite();
    if (written != (in_place && i == 0)) return false;
    if (type->kind() == c10::TypeKind::ListType) {
      if (type->containedType(0)->kind() != c10::TypeKind::TensorType)
        return false;
      has_list = true;
      continue;
    }
    // Scalars, numbers and flags; no single tensor broadcast against a list.
    switch (type->kind()) {
      case c10::TypeKind::NumberType:
      case c10::TypeKind::FloatType:
      case c10::TypeKind::IntType:
      case c10::TypeKind::BoolType:
        continue;
      default:
        return false;
    }
  }
  if (!has_list) return false;
  const auto& rets = schema.returns();
  if (in_place) {
    return rets.empty() && args[0].type()->kind() == c10::TypeKind::ListType;
  }
  return rets.size() == 1 &&
         rets[0].type()->kind() == c10::TypeKind::ListType &&
         rets[0].alias_info() == nullptr;
}

// Finds `functional`'s out= variant: same name, overload "<overload>_out" or
// "out", arguments identical followed by one written Tensor per return.
std::optional<c10::OperatorHandle> FindOutVariant(
    const c10::FunctionSchema& functional) {
  const auto& rets = functional.returns();
  if (rets.empty()) return std::nullopt;
  for (const c10::Argument& r : rets) {
    if (r.type()->kind() != c10::TypeKind::TensorType ||
        r.alias_info() != nullptr) {
      return std::nullopt;
    }
  }
  // In-place and out= ops write their arguments already.
  for (const c10::Argument& a : functional.arguments()) {
    if (a.alias_info() != nullptr && a.alias_info()->isWrite())
      return std::nullopt;
  }
  const std::string& overload = functional.overload_name();
  std::vector<std::string> candidates;
  if (!overload.empty()) candidates.push_back(overload + "_out");
  candidates.push_back("out");
  for (const std::string& cand : candidates) {
    auto h = c10::Dispatcher::singleton().findSchema({functional.name(), cand});
    if (!h.has_value()) continue;
    const auto& args = h->schema().arguments();
    const auto& fargs = functional.arguments();
    if (args.size() != fargs.size() + rets.size()) continue;
    bool same = true;
    for (size_t i = 0; i < fargs.size() && same; ++i) {
      same = args[i].name() == fargs[i].name() &&
             *args[i].type() == *fargs[i].type() &&
             args[i].alias_info() == nullptr;
    }
    for (size_t j = fargs.size(); j < args.size() && same; ++j) {
      same = args[j].type()->kind() == c10::TypeKind::TensorType &&
             args[j].alias_info() != nullptr && args[j].alias_info()->isWrite();
    }
    if (same) return h;
  }
  return std::nullopt;
}

namespace {

// A tensor built from one of the op's arguments, and the reference it came
// from (reported back when the op returns that very tensor).
struct ArgTensor {
  at::Tensor tensor;
  const tpu::TensorRef* ref;
};

void DeleteNothing(void*) {}

// Every tensor gets a storage of its own that ends where the tensor's
// footprint ends, so a kernel cannot resize an out= argument over its
// neighbours in the segment (ATen grows a tensor in place whenever its
// storage is large enough). The storages of tensors that share a client
// storage (same address: views of one tensor) share a
// RefcountedDeleterContext, which is how c10 marks distinct storages as
// views of one allocation (c10::isSharedStorageAlias): ATen's alias and
// overlap checks then compare their data ranges as for one storage. Not
// per segment: ATen takes aliasing storages to start at one address (copy_
// skips a copy between aliases with equal offsets, sizes and strides), and
// a client carves many tensors from one segment (its small pool).
struct SegmentAlias {
  const char* host_base;               // where the client storage starts
  c10::RefcountedDeleterContext* ctx;  // Scratch holds one reference
};

// Per-thread buffers reused from op to op, so that the success path does
// not allocate for its bookkeeping. Emptied at the end of every Run, so no
// view of HBM outlives the op that made it.
// One tensor of a packed _foreach_ op: where its bytes are, which list and
// index it is, whether the op writes it.
struct PackedTensor {
  char* data;
  uint64_t bytes;
  uint32_t list;
  uint32_t index;
  bool written;
};

struct Scratch {
  torch::jit::Stack stack;
  std::vector<ArgTensor> args;
  std::vector<SegmentAlias> segments;
  // TryPackedForeach's: the tensors of every list (list by list, then the
  // outputs), in address order for the overlap check, and one buffer per
  // list that the packed kernel reads and writes.
  std::vector<PackedTensor> packed;
  std::vector<PackedTensor> by_address;
  std::vector<std::vector<std::max_align_t>> pack_buffers;

  void Clear() {
    stack.clear();
    args.clear();
    packed.clear();
    by_address.clear();
    for (const SegmentAlias& seg : segments) c10::refcounted_deleter(seg.ctx);
    segments.clear();
  }
};

thread_local Scratch tls_scratch;

// ATen's warnings during one op (TORCH_WARN in a kernel): the first is kept
// for the client (ChipBackend::TakeWarning), none goes to tpud's stderr.
struct OpWarning {
  bool raised = false;
  bool deprecation = false;
  std::string message;
};
thread_local OpWarning tls_warning;

class KeepFirstWarning : public c10::WarningHandler {
 public:
  void process(const c10::Warning& warning) override {
    if (tls_warning.raised) return;
    tls_warning.raised = true;
    tls_warning.deprecation =
        std::holds_alternative<c10::DeprecationWarning>(warning.type());
    tls_warning.message = warning.msg();
  }
};

// Around an out= variant run into the outputs the client allocated: a
// kernel that uses its out= tensor as scratch of another shape (huber_loss,
// binary_cross_entropy, smooth_l1_loss reduce into it) resizes it and back,
// and ATen warns of the first resize. The caller never resized anything
// (OpRun checks the final shape), so that warning is dropped; others pass.
class DropScratchResizeWarning : public c10::WarningHandler {
 public:
  DropScratchResizeWarning()
      : next_(c10::WarningUtils::get_warning_handler()) {}
  void process(const c10::Warning& warning) override {
    constexpr absl::string_view kResized =
        "An output with one or more elements was resized";
    if (absl::StartsWith(warning.msg(), kResized)) return;
    next_->process(warning);
  }

 private:
  c10::WarningHandler* const next_;
};

class ClearOnExit {
 public:
  explicit ClearOnExit(Scratch& s) : s_(s) {}
  ~ClearOnExit() { s_.Clear(); }

 private:
  Scratch& s_;
};

std::string DtypeName(int64_t code) {
  if (code >= 0 && code < static_cast<int64_t>(c10::ScalarType::NumOptions)) {
    return c10::toString(static_cast<c10::ScalarType>(code));
  }
  return absl::StrCat("dtype ", code);
}

std::string ShapeString(c10::IntArrayRef sizes) {
  return absl::StrCat("[", absl::StrJoin(sizes, ", "), "]");
}

// The client's default dtype while one op runs (torch.set_default_dtype
// there); float32, the executor's own, again after it.
class DefaultDtypeScope {
 public:
  explicit DefaultDtypeScope(c10::ScalarType dtype) {
    c10::set_default_dtype(c10::scalarTypeToTypeMeta(dtype));
  }
  ~DefaultDtypeScope() {
    c10::set_default_dtype(c10::scalarTypeToTypeMeta(at::kFloat));
  }
  DefaultDtypeScope(const DefaultDtypeScope&) = delete;
  DefaultDtypeScope& operator=(const DefaultDtypeScope&) = delete;
};

// `status` marked with the class of ATen exception `e`, which the client
// raises again as ATen would have (tpu/op_error.h).
absl::Status AtenFailure(absl::Status status, const c10::Error& e) {
  tpu::AtenError kind = tpu::AtenError::kError;
  if (dynamic_cast<const c10::IndexError*>(&e) != nullptr) {
    kind = tpu::AtenError::kIndex;
  } else if (dynamic_cast<const c10::ValueError*>(&e) != nullptr) {
    kind = tpu::AtenError::kValue;
  } else if (dynamic_cast<const c10::TypeError*>(&e) != nullptr) {
    kind = tpu::AtenError::kType;
  } else if (dynamic_cast<const c10::NotImplementedError*>(&e) != nullptr) {
    kind = tpu::AtenError::kNotImplemented;
  } else if (dynamic_cast<const c10::LinAlgError*>(&e) != nullptr) {
    kind = tpu::AtenError::kLinAlg;
  } else if (dynamic_cast<const c10::OutOfMemoryError*>(&e) != nullptr) {
    kind = tpu::AtenError::kOutOfMemory;
  }
  return tpu::WithAtenError(std::move(status), kind);
}

// The first lines of an exception's text: enough to say what went wrong
// without pages of dispatcher diagnostics.
std::string FirstLines(const char* text) {
  constexpr size_t kMaxLines = 3;
  constexpr size_t kMaxChars = 1000;
  absl::string_view s(text);
  size_t end = 0;
  for (size_t line = 0; line < kMaxLines && end < s.size(); ++line) {
    const size_t nl = s.find('\n', end);
    end = nl == absl::string_view::npos ? s.size() : nl + 1;
  }
  s = s.substr(0, std::min(end, kMaxChars));
  while (!s.empty() && (s.back() == '\n' || s.back() == ' ')) {
    s.remove_suffix(1);
  }
  return std::string(s);
}

bool IsContiguous(const tpu::TensorRef& ref) {
  int64_t expected = 1;
  for (int d = ref.ndim - 1; d >= 0; --d) {
    if (ref.sizes[d] != 1 && ref.strides[d] != expected) return false;
    expected *= ref.sizes[d];
  }
  return true;
}

bool SameShape(const at::Tensor& t, const tpu::TensorRef& ref) {
  const c10::IntArrayRef sizes = t.sizes();
  if (sizes.size() != ref.ndim) return false;
  return std::equal(sizes.begin(), sizes.end(), ref.sizes);
}

// Everything one Run needs, so helpers don't take ten parameters.
class OpRun {
 public:
  OpRun(const SimulatedOp& op, const tpu::DecodedOp& decoded,
        const std::vector<ResolvedTensor>& tensors,
        std::vector<ResultValue>* results, ResultAllocator* result_allocator,
        Scratch& scratch)
      : op_(op),
        decoded_(decoded),
        tensors_(tensors),
        results_(results),
        result_allocator_(result_allocator),
        s_(scratch) {}

  absl::Status Run();
  bool ran_packed() const { return ran_packed_; }

 private:
  // A packable _foreach_ op (SimulatedOp::packable_foreach) run as one
  // kernel call: each tensor list copied end to end into one flat buffer,
  // the op called with one-element lists of those, the written list (or the
  // new one) copied back out. Elementwise ops give the same values as they
  // do tensor by tensor; the point is one kernel call instead of one per
  // tensor. false, having written nothing, where this op's tensors do not
  // allow it (mixed dtypes or shapes, strided tensors, a written tensor that
  // overlaps another, bad references): the usual way then runs it, and
  // reports any error.
  absl::StatusOr<bool> TryPackedForeach();
  // small_elementwise.h's ops, when the record is of their form.
  absl::StatusOr<bool> TryElementwise();
  // The host bytes of a contiguous `ref` in `seg`, after MakeView's checks.
  absl::Status Locate(const tpu::TensorRef& ref, const ResolvedTensor& seg,
                      char** data, uint64_t* bytes);
  absl::Status BuildStack();
  absl::Status PushArg(size_t index, const tpu::OpArg& arg);
  // The next argument TensorRef as a CPU tensor (recorded in s_.args).
  absl::Status TakeTensor(const tpu::TensorRef& ref, at::Tensor* out);
  // A CPU tensor viewing `ref` in `seg`, its storage an alias of the other
  // storages in that segment. `data` (optional): its first element.
  absl::Status MakeView(const tpu::TensorRef& ref, const ResolvedTensor& seg,
                        at::Tensor* out, char** data);
  absl::Status CheckPlace(const tpu::TensorRef& ref, const ResolvedTensor& seg,
                          tpu::Footprint* footprint, char** base) const;
  absl::Status HandleReturn(size_t index, const c10::IValue& value);
  absl::Status HandleTensor(const at::Tensor& t);
  absl::Status CopyToOutput(const at::Tensor& t, size_t slot);
  absl::Status ReportNewTensor(const at::Tensor& t);
  const ArgTensor* FindArgument(const at::Tensor& t) const;

  absl::Status Error(absl::string_view what) const {
    return absl::InvalidArgumentError(absl::StrCat(op_.name(), ": ", what));
  }

  const SimulatedOp& op_;
  const tpu::DecodedOp& decoded_;
  const std::vector<ResolvedTensor>& tensors_;
  std::vector<ResultValue>* const results_;
  ResultAllocator* const result_allocator_;
  Scratch& s_;
  size_t next_tensor_ = 0;      // next entry of tensors_ to use
  size_t num_arg_tensors_ = 0;  // where the outputs' entries start
  size_t next_slot_ = 0;        // next output slot a returned tensor takes
  bool ran_packed_ = false;
};

// The checks every tensor reference passes before its memory is touched:
// a known dtype, inside its segment, aligned, its footprint within the
// segment. On success *fp is its footprint and *base where its storage starts.
absl::Status OpRun::CheckPlace(const tpu::TensorRef& ref,
                               const ResolvedTensor& seg,
                               tpu::Footprint* footprint, char** base) const {
  const int esize = tpu::ElementSize(ref.dtype);
  if (ABSL_PREDICT_FALSE(esize == 0)) {
    return Error(absl::StrCat("tensor dtype ", static_cast<int>(ref.dtype),
                              " is not supported"));
  }
  if (ABSL_PREDICT_FALSE(ref.address < seg.segment_address ||
                         ref.address - seg.segment_address >
                             seg.segment_bytes)) {
    return Error(absl::StrCat("tensor at address 0x", absl::Hex(ref.address),
                              " is outside its segment at 0x",
                              absl::Hex(seg.segment_address), " (",
                              seg.segment_bytes, " bytes)"));
  }
  const uint64_t rel = ref.address - seg.segment_address;
  if (ABSL_PREDICT_FALSE(rel % esize != 0)) {
    return Error(absl::StrCat(
        "tensor at address 0x", absl::Hex(ref.address), " is ", rel,
        " bytes into its segment, not a multiple of its element size ", esize,
        " (", DtypeName(ref.dtype), ")"));
  }
  absl::StatusOr<tpu::Footprint> fp = tpu::TensorFootprint(ref);
  if (ABSL_PREDICT_FALSE(!fp.ok())) return Error(fp.status().message());
  if (ABSL_PREDICT_FALSE(fp->end > seg.segment_bytes - rel)) {
    return Error(absl::StrCat("tensor at address 0x", absl::Hex(ref.address),
                              " reaches ", fp->end - (seg.segment_bytes - rel),
                              " bytes past the end of its segment"));
  }
  *footprint = *fp;
  *base = seg.segment_host_base + rel;
  return absl::OkStatus();
}

absl::Status OpRun::Locate(const tpu::TensorRef& ref, const ResolvedTensor& seg,
                           char** data, uint64_t* bytes) {
  tpu::Footprint fp;
  char* base = nullptr;
  absl::Status st = CheckPlace(ref, seg, &fp, &base);
  if (ABSL_PREDICT_FALSE(!st.ok())) return st;
  *data = base + fp.begin;
  *bytes = fp.end - fp.begin;
  return absl::OkStatus();
}

absl::Status OpRun::MakeView(const tpu::TensorRef& ref,
                             const ResolvedTensor& seg, at::Tensor* out,
                             char** data) {
  tpu::Footprint fp_value;
  char* base = nullptr;
  absl::Status checked = CheckPlace(ref, seg, &fp_value, &base);
  if (ABSL_PREDICT_FALSE(!checked.ok())) return checked;
  const tpu::Footprint* fp = &fp_value;

  c10::RefcountedDeleterContext* ctx = nullptr;
  for (const SegmentAlias& sa : s_.segments) {
    if (sa.host_base == base) {
      ctx = sa.ctx;
      break;
    }
  }
  if (ctx == nullptr) {
    // Non-owning: the segment outlives the op.
    ctx = new c10::RefcountedDeleterContext(nullptr, &DeleteNothing);
    s_.segments.push_back(SegmentAlias{base, ctx});
  }
  ++ctx->refcount;  // this storage's reference
  c10::Storage storage(
      c10::Storage::use_byte_size_t(), static_cast<size_t>(fp->end),
      c10::DataPtr(base, ctx, &c10::refcounted_deleter, c10::Device(c10::kCPU)),
      /*allocator=*/nullptr, /*resizable=*/false);

  const auto dtype = static_cast<c10::ScalarType>(ref.dtype);
  auto impl = c10::make_intrusive<c10::TensorImpl>(
      std::move(storage), c10::DispatchKeySet(c10::DispatchKey::CPU),
      caffe2::TypeMeta::fromScalarType(dtype));
  impl->set_sizes_and_strides(c10::IntArrayRef(ref.sizes, ref.ndim),
                              c10::IntArrayRef(ref.strides, ref.ndim),
                              ref.storage_offset);
  *out = at::Tensor(std::move(impl));
  if (data != nullptr) *data = base + fp->begin;
  return absl::OkStatus();
}

absl::Status OpRun::TakeTensor(const tpu::TensorRef& ref, at::Tensor* out) {
  if (ABSL_PREDICT_FALSE(next_tensor_ >= tensors_.size())) {
    return absl::InternalError(
        absl::StrCat(op_.name(), ": the executor resolved ", tensors_.size(),
                     " tensors, fewer than the record references"));
  }
  absl::Status st = MakeView(ref, tensors_[next_tensor_++], out, nullptr);
  if (ABSL_PREDICT_FALSE(!st.ok())) return st;
  s_.args.push_back(ArgTensor{*out, &ref});
  return absl::OkStatus();
}

absl::Status OpRun::PushArg(size_t index, const tpu::OpArg& a) {
  using tpu::ArgTag;
  torch::jit::Stack& stack = s_.stack;
  switch (a.tag) {
    case ArgTag::kNone:
      stack.emplace_back();
      return absl::OkStatus();
    case ArgTag::kTensor: {
      at::Tensor t;
      absl::Status st = TakeTensor(a.tensor, &t);
      if (ABSL_PREDICT_FALSE(!st.ok())) return st;
      stack.emplace_back(std::move(t));
      return absl::OkStatus();
    }
    case ArgTag::kUndefinedTensor:
      stack.emplace_back(at::Tensor());
      return absl::OkStatus();
    case ArgTag::kInt:
    case ArgTag::kSymInt: {
      // An int where the schema has a fixed-size list (int[2] stride=1,
      // int[1]? dim) means that many copies, as in Python.
      const c10::Argument& formal = op_.function_schema().arguments()[index];
      if (ABSL_PREDICT_FALSE(formal.N().has_value())) {
        const c10::Type* type = formal.type().get();
        if (const auto* opt = type->castRaw<c10::OptionalType>()) {
          type = opt->getElementType().get();
        }
        if (type->kind() == c10::TypeKind::ListType) {
          stack.emplace_back(std::vector<int64_t>(*formal.N(), a.i));
          return absl::OkStatus();
        }
      }
      stack.emplace_back(a.i);
      return absl::OkStatus();
    }
    case ArgTag::kScalarInt:
      stack.emplace_back(a.i);
      return absl::OkStatus();
    case ArgTag::kDouble:
    case ArgTag::kScalarDouble:
      stack.emplace_back(a.d);
      return absl::OkStatus();
    case ArgTag::kBool:
    case ArgTag::kScalarBool:
      stack.emplace_back(a.b);
      return absl::OkStatus();
    case ArgTag::kComplex:
    case ArgTag::kScalarComplex:
      stack.emplace_back(c10::complex<double>(a.d, a.d_imag));
      return absl::OkStatus();
    case ArgTag::kString:
      stack.emplace_back(a.s);
      return absl::OkStatus();
    case ArgTag::kIntList:
      stack.emplace_back(c10::IntArrayRef(a.ints));
      return absl::OkStatus();
    case ArgTag::kScalarTensor: {
      // A host scalar used as a tensor, rebuilt here (0-dim, CPU), with the
      // wrapped-number flag type promotion looks at.
      const auto dtype = static_cast<c10::ScalarType>(a.dtype);
      at::Scalar value;
      if (c10::isIntegralType(dtype, /*includeBool=*/true)) {
        value = at::Scalar(a.i);
      } else if (c10::isComplexType(dtype)) {
        value = at::Scalar(c10::complex<double>(a.d, a.d_imag));
      } else {
        value = at::Scalar(a.d);
      }
      at::Tensor t = at::scalar_tensor(value, at::TensorOptions().dtype(dtype));
      if (a.b) t.unsafeGetTensorImpl()->set_wrapped_number(true);
      stack.emplace_back(std::move(t));
      return absl::OkStatus();
    }
    case ArgTag::kGenerator: {
      // A generator of this op's own, seeded by the client's device
      // generator: reproducible per client, untouched by other sessions.
      at::Generator gen =
          at::make_generator<at::CPUGeneratorImpl>(static_cast<uint64_t>(a.i));
      stack.emplace_back(std::move(gen));
      return absl::OkStatus();
    }
    case ArgTag::kDoubleList:
      stack.emplace_back(c10::ArrayRef<double>(a.doubles));
      return absl::OkStatus();
    case ArgTag::kBoolList: {
      c10::List<bool> list;
      list.reserve(a.bools.size());
      for (bool b : a.bools) list.push_back(b);
      stack.emplace_back(std::move(list));
      return absl::OkStatus();
    }
    case ArgTag::kDtype:
      if (ABSL_PREDICT_FALSE(
              a.i < 0 ||
              a.i >= static_cast<int64_t>(c10::ScalarType::NumOptions))) {
        return Error(absl::StrCat("argument ", index, " is dtype ", a.i,
                                  ", which is no c10::ScalarType"));
      }
      stack.emplace_back(static_cast<c10::ScalarType>(a.i));
      return absl::OkStatus();
    case ArgTag::kLayout:
      if (ABSL_PREDICT_FALSE(a.i < 0 || a.i >= static_cast<int64_t>(
                                                   c10::Layout::NumOptions))) {
        return Error(absl::StrCat("argument ", index, " is layout ", a.i,
                                  ", which is no c10::Layout"));
      }
      stack.emplace_back(static_cast<c10::Layout>(a.i));
      return absl::OkStatus();
    case ArgTag::kMemoryFormat:
      if (ABSL_PREDICT_FALSE(
              a.i < 0 ||
              a.i >= static_cast<int64_t>(c10::MemoryFormat::NumOptions))) {
        return Error(absl::StrCat("argument ", index, " is memory format ", a.i,
                                  ", which is no c10::MemoryFormat"));
      }
      stack.emplace_back(static_cast<c10::MemoryFormat>(a.i));
      return absl::OkStatus();
    case ArgTag::kDevice:
      // Every tensor here is a CPU view of HBM, so whatever device the client
      // named (its "tpu", i.e. PrivateUse1) is the CPU to the kernel.
      stack.emplace_back(c10::Device(c10::kCPU));
      return absl::OkStatus();
    case ArgTag::kTensorList: {
      const c10::Argument& formal = op_.function_schema().arguments()[index];
      const auto* list_type = formal.type()->castRaw<c10::ListType>();
      if (ABSL_PREDICT_FALSE(list_type != nullptr &&
                             list_type->getElementType()->kind() ==
                                 c10::TypeKind::OptionalType)) {
        // A Tensor?[] sent without absent entries.
        c10::List<std::optional<at::Tensor>> list;
        list.reserve(a.tensors.size());
        for (const tpu::TensorRef& ref : a.tensors) {
          at::Tensor t;
          absl::Status st = TakeTensor(ref, &t);
          if (ABSL_PREDICT_FALSE(!st.ok())) return st;
          list.push_back(std::optional<at::Tensor>(std::move(t)));
        }
        stack.emplace_back(std::move(list));
        return absl::OkStatus();
      }
      c10::List<at::Tensor> list;
      list.reserve(a.tensors.size());
      for (const tpu::TensorRef& ref : a.tensors) {
        at::Tensor t;
        absl::Status st = TakeTensor(ref, &t);
        if (ABSL_PREDICT_FALSE(!st.ok())) return st;
        list.push_back(std::move(t));
      }
      stack.emplace_back(std::move(list));
      return absl::OkStatus();
    }
    case ArgTag::kOptionalTensorList: {
      if (ABSL_PREDICT_FALSE(a.tensor_present.size() != a.tensors.size())) {
        return absl::InternalError(
            absl::StrCat(op_.name(), ": optional tensor list argument ", index,
                         " has ", a.tensors.size(), " entries but ",
                         a.tensor_present.size(), " presence flags"));
      }
      c10::List<std::optional<at::Tensor>> list;
      list.reserve(a.tensors.size());
      for (size_t k = 0; k < a.tensors.size(); ++k) {
        if (!a.tensor_present[k]) {
          list.push_back(std::nullopt);
          continue;
        }
        at::Tensor t;
        absl::Status st = TakeTensor(a.tensors[k], &t);
        if (ABSL_PREDICT_FALSE(!st.ok())) return st;
        list.push_back(std::optional<at::Tensor>(std::move(t)));
      }
      stack.emplace_back(std::move(list));
      return absl::OkStatus();
    }
  }
  return Error(absl::StrCat("argument ", index, " has unknown tag ",
                            static_cast<int>(a.tag)));
}

absl::Status OpRun::BuildStack() {
  const std::vector<c10::Argument>& formals = op_.function_schema().arguments();
  const size_t n = decoded_.num_args;
  if (ABSL_PREDICT_FALSE(n > formals.size() || n > decoded_.args.size())) {
    return Error(absl::StrCat("the client sent ", n,
                              " arguments; the schema has ", formals.size()));
  }
  s_.stack.reserve(formals.size());
  for (size_t i = 0; i < n; ++i) {
    absl::Status st = PushArg(i, decoded_.args[i]);
    if (ABSL_PREDICT_FALSE(!st.ok())) return st;
  }
  for (size_t i = n; i < formals.size(); ++i) {
    const std::optional<c10::IValue>& def = formals[i].default_value();
    if (ABSL_PREDICT_FALSE(!def.has_value())) {
      return Error(absl::StrCat("argument ", i, " (", formals[i].name(),
                                ") is missing and has no default"));
    }
    s_.stack.push_back(*def);
  }
  num_arg_tensors_ = next_tensor_;
  if (ABSL_PREDICT_FALSE(num_arg_tensors_ + decoded_.outputs.size() !=
                         tensors_.size())) {
    return absl::InternalError(absl::StrCat(
        op_.name(), ": the executor resolved ", tensors_.size(),
        " tensors; the record references ", num_arg_tensors_,
        " in arguments and ", decoded_.outputs.size(), " outputs"));
  }
  return absl::OkStatus();
}

const ArgTensor* OpRun::FindArgument(const at::Tensor& t) const {
  const c10::TensorImpl* impl = t.unsafeGetTensorImpl();
  for (const ArgTensor& a : s_.args) {
    if (a.tensor.unsafeGetTensorImpl() == impl) return &a;
  }
  const void* data = t.const_data_ptr();
  for (const ArgTensor& a : s_.args) {
    if (a.tensor.const_data_ptr() == data &&
        a.tensor.scalar_type() == t.scalar_type() &&
        a.tensor.sizes() == t.sizes() && a.tensor.strides() == t.strides()) {
      return &a;
    }
  }
  return nullptr;
}

absl::Status OpRun::CopyToOutput(const at::Tensor& t, size_t slot) {
  const tpu::TensorRef& out = decoded_.outputs[slot];
  if (ABSL_PREDICT_FALSE(out.address == 0 && t.numel() != 0)) {
    return Error(absl::StrCat("output ", slot, ": got ", ShapeString(t.sizes()),
                              " ", c10::toString(t.scalar_type()),
                              ", where the client expected no tensor"));
  }
  // The client sizes outputs with ATen's meta kernels. Where a CPU kernel
  // keeps statistics in another floating type than the meta kernel says
  // (layer_norm's mean/rstd in bfloat16), the output gets the dtype the
  // client was promised; any other mismatch is an error, never a cast.
  const auto out_type = static_cast<c10::ScalarType>(out.dtype);
  const bool float_cast =
      static_cast<int8_t>(t.scalar_type()) != out.dtype &&
      c10::isFloatingType(t.scalar_type()) && out.dtype >= 0 &&
      out.dtype < static_cast<int8_t>(c10::ScalarType::NumOptions) &&
      c10::isFloatingType(out_type) && op_.meta_dtype_may_differ();
  if (ABSL_PREDICT_FALSE(
          (static_cast<int8_t>(t.scalar_type()) != out.dtype && !float_cast) ||
          !SameShape(t, out))) {
    return Error(
        absl::StrCat("output ", slot, ": got ", ShapeString(t.sizes()), " ",
                     c10::toString(t.scalar_type()), ", client allocated ",
                     ShapeString(c10::IntArrayRef(out.sizes, out.ndim)), " ",
                     DtypeName(out.dtype)));
  }
  at::Tensor view;
  char* data = nullptr;
  absl::Status st =
      MakeView(out, tensors_[num_arg_tensors_ + slot], &view, &data);
  if (ABSL_PREDICT_FALSE(!st.ok())) return st;
  const int64_t numel = t.numel();
  if (numel == 0) return absl::OkStatus();
  if (ABSL_PREDICT_FALSE(t._is_zerotensor())) {
    // A ZeroTensor (_efficientzerotensor) has no memory: its value is zeros.
    view.zero_();
    return absl::OkStatus();
  }
  if (ABSL_PREDICT_FALSE(t.const_data_ptr() == nullptr)) {
    return Error(absl::StrCat("output ", slot,
                              ": the kernel returned a tensor without memory"));
  }
  if (t.is_contiguous() && IsContiguous(out) && !float_cast && !t.is_conj() &&
      !t.is_neg()) {
    // The common case: one memmove (the source may be a view of HBM that
    // overlaps the output). A result with a lazy conjugate or negative bit
    // (linalg_lu_solve with left=False returns one) is resolved by copy_.
    std::memmove(data, t.const_data_ptr(),
                 static_cast<size_t>(numel) * t.element_size());
  } else {
    view.copy_(t);
  }
  return absl::OkStatus();
}

absl::Status OpRun::ReportNewTensor(const at::Tensor& t) {
  const int esize = tpu::ElementSize(static_cast<int8_t>(t.scalar_type()));
  if (ABSL_PREDICT_FALSE(esize == 0 || t.dim() > tpu::kMaxDims)) {
    return absl::UnimplementedError(absl::StrCat(
        op_.name(), ": returned a ", t.dim(), "-d ",
        c10::toString(t.scalar_type()),
        " tensor, which tpud cannot return (dtype or rank unsupported)"));
  }
  ResultValue v;
  v.kind = ResultValue::Kind::kTensor;
  tpu::TensorRef& r = v.tensor;
  r.dtype = static_cast<int8_t>(t.scalar_type());
  r.ndim = static_cast<uint8_t>(t.dim());
  int64_t stride = 1;
  for (int d = r.ndim - 1; d >= 0; --d) {
    r.sizes[d] = t.size(d);
    r.strides[d] = stride;
    stride *= std::max<int64_t>(t.size(d), 1);
  }
  const uint64_t nbytes = static_cast<uint64_t>(t.numel()) * esize;
  if (nbytes > 0) {
    if (result_allocator_ == nullptr) {
      return absl::InternalError(
          absl::StrCat(op_.name(),
                       ": returned a tensor with no output for it and no "
                       "result allocator to put it in"));
    }
    absl::StatusOr<ResultAllocator::Block> block =
        result_allocator_->Allocate(nbytes);
    if (!block.ok()) return block.status();
    at::Tensor dst = at::from_blob(block->host, t.sizes(),
                                   at::TensorOptions().dtype(t.scalar_type()));
    if (t._is_zerotensor()) {
      dst.zero_();
    } else if (ABSL_PREDICT_FALSE(t.const_data_ptr() == nullptr)) {
      return Error("returned a tensor without memory");
    } else {
      dst.copy_(t);
    }
    r.address = block->address;
  }
  results_->push_back(v);
  return absl::OkStatus();
}

absl::Status OpRun::HandleTensor(const at::Tensor& t) {
  const size_t slot = next_slot_++;
  if (!t.defined()) {
    if (results_ != nullptr) results_->emplace_back();
    return absl::OkStatus();
  }
  if (const ArgTensor* arg = FindArgument(t)) {
    // In place or out=: the data is already where the client expects it.
    if (results_ != nullptr) {
      ResultValue v;
      v.kind = ResultValue::Kind::kTensor;
      v.tensor = *arg->ref;
      results_->push_back(v);
    }
    return absl::OkStatus();
  }
  if (slot < decoded_.outputs.size()) {
    absl::Status st = CopyToOutput(t, slot);
    if (ABSL_PREDICT_FALSE(!st.ok())) return st;
    if (results_ != nullptr) {
      ResultValue v;
      v.kind = ResultValue::Kind::kTensor;
      v.tensor = decoded_.outputs[slot];
      results_->push_back(v);
    }
    return absl::OkStatus();
  }
  if (results_ == nullptr) return absl::OkStatus();  // nobody wants it
  return ReportNewTensor(t);
}

absl::Status OpRun::HandleReturn(size_t index, const c10::IValue& value) {
  if (value.isTensor()) return HandleTensor(value.toTensor());
  if (value.isTensorList()) {
    for (const at::Tensor& t : value.toTensorList()) {
      absl::Status st = HandleTensor(t);
      if (ABSL_PREDICT_FALSE(!st.ok())) return st;
    }
    return absl::OkStatus();
  }
  const std::vector<c10::Argument>& formals = op_.function_schema().returns();
  if (value.isNone()) {
    // An absent Tensor? still takes its output slot.
    if (index < formals.size() &&
        formals[index].type()->kind() == c10::TypeKind::OptionalType &&
        formals[index]
                .type()
                ->castRaw<c10::OptionalType>()
                ->getElementType()
                ->kind() == c10::TypeKind::TensorType) {
      ++next_slot_;
    }
    if (results_ != nullptr) results_->emplace_back();
    return absl::OkStatus();
  }
  if (results_ == nullptr) return absl::OkStatus();
  ResultValue v;
  if (value.isInt()) {
    v.kind = ResultValue::Kind::kInt;
    v.i = value.toInt();
  } else if (value.isUnsigned()) {
    v.kind = ResultValue::Kind::kUInt;
    v.i = static_cast<int64_t>(value.toUInt());
  } else if (value.isDouble()) {
    v.kind = ResultValue::Kind::kDouble;
    v.d = value.toDouble();
  } else if (value.isBool()) {
    v.kind = ResultValue::Kind::kBool;
    v.b = value.toBool();
  } else if (value.isComplexDouble()) {
    const c10::complex<double> c = value.toComplexDouble();
    v.kind = ResultValue::Kind::kComplex;
    v.d = c.real();
    v.d_imag = c.imag();
  } else {
    return absl::UnimplementedError(
        absl::StrCat(op_.name(), ": return value ", index, " is a ",
                     value.tagKind(), ", which tpud cannot return"));
  }
  results_->push_back(v);
  return absl::OkStatus();
}

absl::StatusOr<bool> OpRun::TryPackedForeach() {
  const std::vector<c10::Argument>& formals = op_.function_schema().arguments();
  const size_t nargs = decoded_.num_args;
  if (nargs > formals.size() || nargs > decoded_.args.size()) return false;
  const bool in_place = op_.function_schema().returns().empty();

  // Every list: the same length, one dtype, contiguous, in its segment.
  std::vector<PackedTensor>& packed = s_.packed;
  size_t count = 0;
  uint32_t lists = 0;
  int8_t dtype = 0;
  size_t next = 0;
  size_t first_list = 0;
  for (size_t i = 0; i < nargs; ++i) {
    const tpu::OpArg& a = decoded_.args[i];
    switch (a.tag) {
      case tpu::ArgTag::kTensorList:
        break;
      case tpu::ArgTag::kScalarInt:
      case tpu::ArgTag::kScalarDouble:
      case tpu::ArgTag::kScalarBool:
      case tpu::ArgTag::kInt:
      case tpu::ArgTag::kDouble:
      case tpu::ArgTag::kBool:
        continue;
      default:
        return false;
    }
    if (lists == 0) {
      first_list = i;
      count = a.tensors.size();
      if (count < 2 || a.tensors[0].dtype < 0 ||
          a.tensors[0].dtype >=
              static_cast<int8_t>(c10::ScalarType::NumOptions)) {
        return false;
      }
      dtype = a.tensors[0].dtype;
    } else if (a.tensors.size() != count) {
      return false;
    }
    for (size_t k = 0; k < count; ++k) {
      const tpu::TensorRef& ref = a.tensors[k];
      if (ref.dtype != dtype || !IsContiguous(ref) || next >= tensors_.size())
        return false;
      // Element k of every list has element k of the first list's shape.
      const tpu::TensorRef& first = decoded_.args[first_list].tensors[k];
      if (ref.ndim != first.ndim ||
          !std::equal(ref.sizes, ref.sizes + ref.ndim, first.sizes)) {
        return false;
      }
      PackedTensor t{nullptr, 0, lists, static_cast<uint32_t>(k),
                     in_place && i == 0};
      if (!Locate(ref, tensors_[next++], &t.data, &t.bytes).ok()) return false;
      packed.push_back(t);
    }
    ++lists;
  }
  if (lists == 0 || next + decoded_.outputs.size() != tensors_.size())
    return false;
  // A new list goes into the outputs the client allocated, shaped as the first
  // list.
  if (in_place != decoded_.outputs.empty()) return false;
  if (!in_place) {
    if (decoded_.outputs.size() != count) return false;
    for (size_t k = 0; k < count; ++k) {
      const tpu::TensorRef& out = decoded_.outputs[k];
      const tpu::TensorRef& first = decoded_.args[first_list].tensors[k];
      if (out.dtype != dtype || !IsContiguous(out) || out.ndim != first.ndim ||
          !std::equal(out.sizes, out.sizes + out.ndim, first.sizes)) {
        return false;
      }
      PackedTensor t{nullptr, 0, lists, static_cast<uint32_t>(k), true};
      if (!Locate(out, tensors_[next++], &t.data, &t.bytes).ok()) return false;
      packed.push_back(t);
    }
  }

  // Packing reads every input before anything is written, where the kernel
  // tensor by tensor would see earlier tensors' results: so a written tensor
  // may overlap nothing but itself read at the same index.
  std::vector<PackedTensor>& by_address = s_.by_address;
  for (const PackedTensor& t : packed) {
    if (t.bytes > 0) by_address.push_back(t);
  }
  std::sort(by_address.begin(), by_address.end(),
            [](const PackedTensor& a, const PackedTensor& b) {
              return a.data < b.data;
            });
  for (size_t g = 0; g < by_address.size();) {
    const char* end = by_address[g].data + by_address[g].bytes;
    size_t h = g + 1;
    while (h < by_address.size() && by_address[h].data < end) {
      end =
          std::max<const char*>(end, by_address[h].data + by_address[h].bytes);
      ++h;
    }
    if (h - g > 1) {
      size_t writers = 0;
      bool identical = true;
      for (size_t j = g; j < h; ++j) {
        writers += by_address[j].written ? 1 : 0;
        identical = identical && by_address[j].data == by_address[g].data &&
                    by_address[j].bytes == by_address[g].bytes &&
                    by_address[j].index == by_address[g].index;
      }
      if (writers > 1 || (writers == 1 && !identical)) return false;
    }
    g = h;
  }

  // Pack: list l's elements end to end in buffer l.
  uint64_t total = 0;
  for (size_t k = 0; k < count; ++k) total += packed[k].bytes;
  const int esize = tpu::ElementSize(dtype);
  if (esize <= 0 || total % static_cast<uint64_t>(esize) != 0) return false;
  if (s_.pack_buffers.size() < lists) s_.pack_buffers.resize(lists);
  for (uint32_t l = 0; l < lists; ++l) {
    auto& buf = s_.pack_buffers[l];
    buf.resize(std::max<size_t>(
        1, (total + sizeof(std::max_align_t) - 1) / sizeof(std::max_align_t)));
    char* dst = reinterpret_cast<char*>(buf.data());
    for (size_t k = 0; k < count; ++k) {
      const PackedTensor& t = packed[l * count + k];
      if (t.bytes != packed[k].bytes) return false;
      if (t.bytes > 0) std::memcpy(dst, t.data, t.bytes);
      dst += t.bytes;
    }
  }
  const auto scalar_type = static_cast<c10::ScalarType>(dtype);
  const int64_t numel =
      static_cast<int64_t>(total / static_cast<uint64_t>(esize));
  uint32_t list = 0;
  for (size_t i = 0; i < nargs; ++i) {
    const tpu::OpArg& a = decoded_.args[i];
    if (a.tag != tpu::ArgTag::kTensorList) {
      absl::Status st = PushArg(i, a);
      if (ABSL_PREDICT_FALSE(!st.ok())) return st;
      continue;
    }
    c10::List<at::Tensor> one;
    one.push_back(at::from_blob(s_.pack_buffers[list++].data(), {numel},
                                at::TensorOptions().dtype(scalar_type)));
    s_.stack.emplace_back(std::move(one));
  }
  for (size_t i = nargs; i < formals.size(); ++i) {
    const std::optional<c10::IValue>& def = formals[i].default_value();
    if (!def.has_value()) return false;
    s_.stack.push_back(*def);
  }
  op_.handle().callBoxed(s_.stack);

  // Unpack what was written.
  const char* src = nullptr;
  if (in_place) {
    src = reinterpret_cast<const char*>(s_.pack_buffers[0].data());
  } else {
    if (s_.stack.size() != 1 || !s_.stack[0].isTensorList()) return false;
    const c10::List<at::Tensor> result = s_.stack[0].toTensorList();
    if (result.size() != 1) return false;
    const at::Tensor flat = result.get(0);
    if (!flat.defined() || flat.scalar_type() != scalar_type ||
        flat.numel() != numel || !flat.is_contiguous() || flat.is_conj() ||
        flat.is_neg() || (numel > 0 && flat.const_data_ptr() == nullptr)) {
      return false;
    }
    src = static_cast<const char*>(flat.const_data_ptr());
    s_.stack.clear();
    s_.stack.emplace_back(
        flat);  // keeps the result alive while it is copied out
  }
  const size_t first_written =
      in_place ? 0 : static_cast<size_t>(lists) * count;
  for (size_t k = 0; k < count; ++k) {
    const PackedTensor& t = packed[first_written + k];
    if (t.bytes > 0) std::memmove(t.data, src, t.bytes);
    src += t.bytes;
  }
  if (results_ != nullptr && !in_place) {
    for (const tpu::TensorRef& out : decoded_.outputs) {
      ResultValue v;
      v.kind = ResultValue::Kind::kTensor;
      v.tensor = out;
      results_->push_back(v);
    }
  }
  return true;
}

absl::StatusOr<bool> OpRun::TryElementwise() {
  absl::StatusOr<bool> done = TrySmallElementwise(
      op_.elementwise(), decoded_, tensors_,
      [this](const tpu::TensorRef& ref, const ResolvedTensor& seg, char** data,
             uint64_t* bytes) { return Locate(ref, seg, data, bytes); });
  if (done.ok() && *done && results_ != nullptr) {
    ResultValue v;
    v.kind = ResultValue::Kind::kTensor;
    v.tensor = decoded_.outputs[0];
    results_->push_back(v);
  }
  return done;
}

absl::Status OpRun::Run() {
  if (op_.elementwise() != SmallElementwise::kNone) {
    absl::StatusOr<bool> done = TryElementwise();
    if (!done.ok()) return done.status();
    if (*done) return absl::OkStatus();
  }
  // The tensors are plain CPU tensors: skip autograd and run the CPU kernel.
  at::AutoDispatchBelowADInplaceOrView below_autograd;
  c10::NoGradGuard no_grad;

  if (op_.packable_foreach()) {
    absl::StatusOr<bool> packed = TryPackedForeach();
    if (!packed.ok()) return packed.status();
    if (*packed) {
      ran_packed_ = true;
      return absl::OkStatus();
    }
    s_.Clear();  // the usual way, from the start
  }

  absl::Status st = BuildStack();
  if (ABSL_PREDICT_FALSE(!st.ok())) return st;

  const auto& out_variant = op_.out_variant();
  // Only when every tensor involved has one dtype: out= kernels cast to the
  // out tensor's dtype where the functional op would return another, and
  // the client must get an error for that, not a silent cast.
  bool one_dtype =
      out_variant.has_value() && op_.out_variant_usable() &&
      decoded_.outputs.size() == op_.function_schema().returns().size();
  for (size_t i = 0; one_dtype && i < decoded_.outputs.size(); ++i) {
    one_dtype = decoded_.outputs[i].dtype == decoded_.outputs[0].dtype;
  }
  for (size_t i = 0; one_dtype && i < s_.args.size(); ++i) {
    one_dtype = static_cast<int8_t>(s_.args[i].tensor.scalar_type()) ==
                decoded_.outputs[0].dtype;
  }
  if (one_dtype) {
    // The client allocated every output: let the kernel write them.
    for (size_t i = 0; i < decoded_.outputs.size(); ++i) {
      at::Tensor view;
      st = MakeView(decoded_.outputs[i], tensors_[num_arg_tensors_ + i], &view,
                    nullptr);
      if (ABSL_PREDICT_FALSE(!st.ok())) return st;
      s_.args.push_back(ArgTensor{view, &decoded_.outputs[i]});
      s_.stack.push_back(std::move(view));
    }
    const size_t first_out = s_.args.size() - decoded_.outputs.size();
    try {
      DropScratchResizeWarning drop_scratch_resize;
      c10::WarningUtils::WarningHandlerGuard guard(&drop_scratch_resize);
      out_variant->callBoxed(s_.stack);
    } catch (const c10::Error&) {
      // Retry the functional way (which writes every output afresh).
      op_.disable_out_variant();
      s_.Clear();
      next_tensor_ = 0;
      next_slot_ = 0;
      return Run();
    }
    // A kernel may resize or restride its out= tensor; with the client's
    // layout fixed, anything but the shape and strides it allocated is an
    // error, not a silent reshape (strides of an empty tensor place nothing).
    for (size_t i = 0; i < decoded_.outputs.size(); ++i) {
      const at::Tensor& t = s_.args[first_out + i].tensor;
      const c10::IntArrayRef want_strides(decoded_.outputs[i].strides,
                                          decoded_.outputs[i].ndim);
      if (ABSL_PREDICT_FALSE(!SameShape(t, decoded_.outputs[i]) ||
                             (t.numel() != 0 && t.strides() != want_strides))) {
        return Error(absl::StrCat(
            "output ", i, ": got ", ShapeString(t.sizes()), " ",
            c10::toString(t.scalar_type()), " with strides ",
            ShapeString(t.strides()), ", client allocated ",
            ShapeString(c10::IntArrayRef(decoded_.outputs[i].sizes,
                                         decoded_.outputs[i].ndim)),
            " ", DtypeName(decoded_.outputs[i].dtype), " with strides ",
            ShapeString(want_strides)));
      }
    }
    if (results_ != nullptr) {
      for (const tpu::TensorRef& out : decoded_.outputs) {
        ResultValue v;
        v.kind = ResultValue::Kind::kTensor;
        v.tensor = out;
        results_->push_back(v);
      }
    }
    return absl::OkStatus();
  }

  op_.handle().callBoxed(s_.stack);

  for (size_t i = 0; i < s_.stack.size(); ++i) {
    st = HandleReturn(i, s_.stack[i]);
    if (ABSL_PREDICT_FALSE(!st.ok())) return st;
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status SimulatedChip::VerifyElementSizes() {
  constexpr int kNumScalarTypes = static_cast<int>(c10::ScalarType::NumOptions);
  for (int code = INT8_MIN; code <= INT8_MAX; ++code) {
    const int ours = tpu::ElementSize(static_cast<int8_t>(code));
    if (ours == 0) continue;
    if (code < 0 || code >= kNumScalarTypes) {
      return absl::InternalError(absl::StrCat(
          "tpu::ElementSize gives ", ours, " bytes for dtype code ", code,
          ", which is no c10::ScalarType in torch " TORCH_VERSION));
    }
    const auto type = static_cast<c10::ScalarType>(code);
    size_t theirs = 0;
    try {
      theirs = c10::elementSize(type);
    } catch (const std::exception& e) {
      return absl::InternalError(absl::StrCat(
          "tpu::ElementSize gives ", ours, " bytes for dtype code ", code, " (",
          c10::toString(type),
          "); c10::elementSize refuses it: ", FirstLines(e.what())));
    }
    if (static_cast<size_t>(ours) != theirs) {
      return absl::InternalError(absl::StrCat(
          "tpu::ElementSize gives ", ours, " bytes for dtype code ", code, " (",
          c10::toString(type), "); c10::elementSize gives ", theirs));
    }
  }
  return absl::OkStatus();
}

std::string SimulatedChip::Describe() const {
  return "simulated (ATen CPU kernels)";
}

absl::StatusOr<std::shared_ptr<const BackendOp>> SimulatedChip::LookupOp(
    absl::string_view schema) {
  {
    absl::MutexLock lock(&mu_);
    auto it = ops_.find(schema);
    if (it != ops_.end()) return it->second;
  }
  const size_t paren = schema.find('(');
  const absl::string_view full =
      schema.substr(0, paren == absl::string_view::npos ? 0 : paren);
  const size_t colons = full.find("::");
  if (paren == absl::string_view::npos || colons == absl::string_view::npos ||
      colons == 0 || colons + 2 >= full.size()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "malformed operator schema \"", schema.substr(0, 200),
        "\": expected \"namespace::name[.overload](arguments) -> returns\""));
  }
  const size_t dot = full.find('.', colons + 2);
  c10::OperatorName name(
      std::string(full.substr(0, dot)),
      dot == absl::string_view::npos ? "" : std::string(full.substr(dot + 1)));
  std::optional<c10::OperatorHandle> handle;
  try {
    handle = c10::Dispatcher::singleton().findSchema(name);
  } catch (const std::exception& e) {
    return absl::InternalError(
        absl::StrCat("looking up operator ", full, ": ", FirstLines(e.what())));
  }
  if (!handle.has_value()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "unknown operator ", full,
        ": the daemon's torch " TORCH_VERSION " has no such operator"));
  }
  std::string ours = c10::toString(handle->schema());
  if (ours != schema) {
    return absl::InvalidArgumentError(absl::StrCat(
        "operator ", full, " differs: the daemon's torch ", TORCH_VERSION,
        " has ", ours, ", the client sent ", schema));
  }
  auto op = std::make_shared<SimulatedOp>(std::string(schema),
                                          std::string(full), *handle);
  if (auto out = FindOutVariant(handle->schema())) op->set_out_variant(*out);
  absl::MutexLock lock(&mu_);
  auto inserted = ops_.emplace(std::string(schema), std::move(op));
  return inserted.first->second;
}

absl::Status SimulatedChip::Run(const BackendOp& op,
                                const tpu::DecodedOp& decoded,
                                const std::vector<ResolvedTensor>& tensors,
                                std::vector<ResultValue>* results,
                                ResultAllocator* result_allocator) {
  const auto* sim_op = dynamic_cast<const SimulatedOp*>(&op);
  if (ABSL_PREDICT_FALSE(sim_op == nullptr)) {
    return absl::InternalError(absl::StrCat(
        "operator ", op.schema(), " was not resolved by the simulated chip"));
  }
  Scratch& scratch = tls_scratch;
  ClearOnExit clear(scratch);
  tls_warning.raised = false;
  KeepFirstWarning keep_warning;
  c10::WarningUtils::WarningHandlerGuard warnings(&keep_warning);
  const uint32_t default_code =
      (decoded.flags & tpu::kOpFlagDefaultDtypeMask) >>
      tpu::kOpFlagDefaultDtypeShift;
  std::optional<DefaultDtypeScope> default_dtype;
  if (default_code != 0) {
    const auto dtype = static_cast<c10::ScalarType>(default_code - 1);
    if (dtype != at::kDouble && dtype != at::kHalf && dtype != at::kBFloat16) {
      return absl::InvalidArgumentError(
          absl::StrCat(sim_op->name(), ": default dtype code ", default_code,
                       " is not a floating dtype torch accepts"));
    }
    default_dtype.emplace(dtype);
  }
  try {
    OpRun run(*sim_op, decoded, tensors, results, result_allocator, scratch);
    absl::Status st = run.Run();
    if (st.ok() && run.ran_packed())
      packed_foreach_runs_.fetch_add(1, std::memory_order_relaxed);
    return st;
  } catch (const c10::OutOfMemoryError& e) {
    return AtenFailure(
        absl::ResourceExhaustedError(absl::StrCat(
            sim_op->name(), ": ", FirstLines(e.what_without_backtrace()))),
        e);
  } catch (const c10::Error& e) {
    return AtenFailure(
        absl::InvalidArgumentError(absl::StrCat(
            sim_op->name(), ": ", FirstLines(e.what_without_backtrace()))),
        e);
  } catch (const std::exception& e) {
    return absl::InternalError(
        absl::StrCat(sim_op->name(), ": ", FirstLines(e.what())));
  } catch (...) {
    return absl::InternalError(
        absl::StrCat(sim_op->name(), ": unknown exception"));
  }
}

bool SimulatedChip::TakeWarning(std::string* message, bool* deprecation) {
  if (!tls_warning.raised) return false;
  tls_warning.raised = false;
  *message = std::move(tls_warning.message);
  *deprecation = tls_warning.deprecation;
  return true;
}

}  // namespace tpud
