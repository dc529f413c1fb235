#include "daemon/backends/pjrt/pjrt_chip.h"

#include <algorithm>
#include <array>
#include <chrono>
#include <cstring>
#include <functional>
#include <cmath>
#include <map>
#include <tuple>

#include "absl/container/inlined_vector.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "tpu/device_address.h"

namespace tpud::pjrt {
namespace {

// c10::ScalarType values tpud lowers, as StableHLO and PJRT types.
struct DType {
  int8_t c10;
  const char* mlir;
  PJRT_Buffer_Type pjrt;
  bool is_float;
  int bytes;
};
constexpr DType kDTypes[] = {
    {0, "ui8", PJRT_Buffer_Type_U8, false, 1},   {1, "i8", PJRT_Buffer_Type_S8, false, 1},
    {2, "i16", PJRT_Buffer_Type_S16, false, 2},  {3, "i32", PJRT_Buffer_Type_S32, false, 4},
    {4, "i64", PJRT_Buffer_Type_S64, false, 8},  {5, "f16", PJRT_Buffer_Type_F16, true, 2},
    {6, "f32", PJRT_Buffer_Type_F32, true, 4},   {7, "f64", PJRT_Buffer_Type_F64, true, 8},
    {11, "i1", PJRT_Buffer_Type_PRED, false, 1}, {15, "bf16", PJRT_Buffer_Type_BF16, true, 2},
    {9, "complex<f32>", PJRT_Buffer_Type_C64, false, 8}, {10, "complex<f64>", PJRT_Buffer_Type_C128, false, 16},
};
const DType* DTypeOf(int8_t c10) {
  for (const DType& d : kDTypes) {
    if (d.c10 == c10) return &d;
  }
  return nullptr;
}
const DType& F64() { return *DTypeOf(7); }
const DType& I64() { return *DTypeOf(4); }
// complex64 and complex128 (c10's ComplexFloat and ComplexDouble; its
// ComplexHalf is not lowered).
bool IsComplex(const DType& t) { return t.c10 == 9 || t.c10 == 10; }
// The type of a complex type's parts (float32 for complex64).
const DType& PartOf(const DType& t) { return *DTypeOf(t.c10 == 10 ? 7 : 6); }
// The complex type whose parts are float t (complex128 for float64).
const DType& ComplexOf(const DType& t) { return *DTypeOf(t.c10 == 7 ? 10 : 9); }

// An MLIR float literal: it needs a point before any exponent ("1.0e-05").
std::string FloatLiteral(double v) {
  std::string s = absl::StrFormat("%.17g", v);
  if (s.find_first_of(".ni") == std::string::npos) {  // not already 1.5, inf or nan
    const size_t e = s.find('e');
    s.insert(e == std::string::npos ? s.size() : e, ".0");
  }
  return s;
}

std::string TypeOf(const std::vector<int64_t>& dims, const DType& t) {
  std::string s = "tensor<";
  for (int64_t d : dims) absl::StrAppend(&s, d, "x");
  return absl::StrCat(s, t.mlir, ">");
}

// The op's error: its name, why, and what to do.
absl::Status Unsupported(const std::string& op, const std::string& why) {
  return absl::UnimplementedError(absl::StrCat(
      op, ": ", why, " (PJRT backend; tpud --backend=simulated runs every ATen op)"));
}

class Lowering;
struct Target;
// How an op becomes StableHLO: one result (Rule) or several (MultiRule).
using Rule = std::function<absl::StatusOr<std::string>(Lowering&, const tpu::DecodedOp&,
                                                       const Target&)>;
using MultiRule = std::function<absl::StatusOr<std::vector<std::string>>(
    Lowering&, const tpu::DecodedOp&, const std::vector<Target>&)>;
const std::map<std::string, Rule>& AllRules();
const std::map<std::string, MultiRule>& MultiRules();

class PjrtOp : public BackendOp {
 public:
  // The ops that do not run as a program of their own: computed from the
  // arena's bytes on the host, or with results sized by the data.
  enum class Special : uint8_t {
    kNone,
    kLocalScalar,  // _local_scalar_dense
    kEqual,
    kSelect,       // nonzero, masked_select
    kIndex,        // index.Tensor: a selection when it comes without outputs
    kUnique,       // _unique2, unique_consecutive
  };

  // written: the arguments the op writes ("Tensor(a!) self" of an in-place
  // op; "Tensor(a!) out", "Tensor(b!) total_weight" of an out= op), in order.
  // What depends on the name alone is found here once, not per op run.
  PjrtOp(std::string schema, std::string name, std::vector<int> written)
      : schema_(std::move(schema)), name_(std::move(name)), written_(std::move(written)) {
    overwrites_first_ = name_ == "aten::copy_" || name_ == "aten::fill_.Scalar" ||
                        name_ == "aten::zero_" || name_ == "aten::uniform_" ||
                        name_ == "aten::normal_" || absl::StartsWith(name_, "aten::bernoulli_.") ||
                        name_ == "aten::random_.from";
    if (name_ == "aten::_local_scalar_dense") special_ = Special::kLocalScalar;
    if (name_ == "aten::equal") special_ = Special::kEqual;
    if (name_ == "aten::nonzero" || name_ == "aten::masked_select") special_ = Special::kSelect;
    if (name_ == "aten::index.Tensor") special_ = Special::kIndex;
    if (name_ == "aten::_unique2" || name_ == "aten::unique_consecutive") special_ = Special::kUnique;
    if (auto it = AllRules().find(name_); it != AllRules().end()) rule_ = &it->second;
    if (auto it = MultiRules().find(name_); it != MultiRules().end()) multi_ = &it->second;
  }
  const std::string& schema() const override { return schema_; }
  const std::string& name() const { return name_; }
  const std::vector<int>& written() const { return written_; }
  Special special() const { return special_; }
  // Its lowering rule, if it has one (the tables live as long as the process).
  const Rule* rule() const { return rule_; }
  const MultiRule* multi_rule() const { return multi_; }
  bool WritesArgument(size_t index) const override {
    return std::find(written_.begin(), written_.end(), static_cast<int>(index)) != written_.end();
  }
  bool OverwritesArgument(size_t index) const override {
    if (!WritesArgument(index)) return false;
    // out= tensors and the targets of copy_, fill_ and zero_ are not read.
    return index > 0 || overwrites_first_;
  }

 private:
  std::string schema_;
  std::string name_;  // "aten::add_.Tensor"
  std::vector<int> written_;
  bool overwrites_first_ = false;
  Special special_ = Special::kNone;
  const Rule* rule_ = nullptr;
  const MultiRule* multi_ = nullptr;
};

// The indices of the arguments annotated as written ("(a!)", "(b!)", ...).
std::vector<int> WrittenArguments(absl::string_view schema) {
  std::vector<int> written;
  const size_t open = schema.find('(');
  if (open == absl::string_view::npos) return written;
  int depth = 0, index = 0;
  size_t start = open + 1;
  for (size_t i = open + 1; i < schema.size(); ++i) {
    const char c = schema[i];
    if (c == '(' || c == '[') ++depth;
    if ((c == ')' || c == ']') && depth > 0) {
      --depth;
      continue;
    }
    if ((c == ',' && depth == 0) || (c == ')' && depth == 0)) {
      absl::string_view arg = absl::StripAsciiWhitespace(schema.substr(start, i - start));
      if (arg != "*" && !arg.empty()) {
        const size_t bang = arg.find("!)");
        if (bang != absl::string_view::npos && arg.find('(') < bang) written.push_back(index);
        ++index;
      }
      start = i + 1;
      if (c == ')') break;
    }
  }
  return written;
}

}  // namespace

// A host transfer into one program parameter.
struct Transfer {
  const char* data = nullptr;
  const DType* type = nullptr;
  std::vector<int64_t> dims;
  std::vector<int64_t> byte_strides;
  double scalar_d = 0;  // scalars: the value (data points here)
  int64_t scalar_i = 0;
  // The result this parameter is donated to (-1: none): the program's
  // output `aliased` is written into this parameter's memory.
  int aliased = -1;

  // Whether the bytes are dense in row-major order (dimensions of size 1
  // aside), so that the plugin may read them in place.
  bool Dense() const {
    int64_t expect = type->bytes;
    for (size_t d = dims.size(); d-- > 0;) {
      if (dims[d] != 1 && byte_strides[d] != expect) return false;
      expect *= dims[d];
    }
    return true;
  }
  int64_t Bytes() const {
    int64_t n = type->bytes;
    for (int64_t d : dims) n *= d;
    return n;
  }
};

namespace {

// The largest (`high`) or smallest value of an integer or bool type, as a
// literal.
std::string IntLimit(const DType& t, bool high) {
  switch (t.c10) {
    case 11: return high ? "true" : "false";
    case 0: return high ? "255" : "0";
    case 1: return high ? "127" : "-128";
    case 2: return high ? "32767" : "-32768";
    case 3: return high ? "2147483647" : "-2147483648";
    default: return high ? "9223372036854775807" : "-9223372036854775808";
  }
}

// Builds one op's program and the transfers that feed it.
class Lowering {
 public:
  Lowering(const std::string& op, const tpu::DecodedOp& decoded,
           const std::vector<ResolvedTensor>& tensors)
      : op_(op), decoded_(decoded), tensors_(tensors) {}

  // The host address of tensor `ref` (the k-th TensorRef of the record),
  // checked to lie inside its resolved segment.
  absl::StatusOr<char*> HostOf(const tpu::TensorRef& ref, size_t k) const {
    if (k >= tensors_.size()) return absl::InternalError(absl::StrCat(op_, ": tensor ", k, " unresolved"));
    const ResolvedTensor& seg = tensors_[k];
    const DType* t = DTypeOf(ref.dtype);
    if (t == nullptr) return Unsupported(op_, absl::StrCat("dtype ", int(ref.dtype), " is not lowered"));
    const uint64_t rel = ref.address - seg.segment_address;
    absl::StatusOr<tpu::Footprint> fp = tpu::TensorFootprint(ref);
    if (!fp.ok()) return fp.status();
    if (ref.address < seg.segment_address || rel > seg.segment_bytes ||
        fp->end > seg.segment_bytes - rel) {
      return absl::InvalidArgumentError(absl::StrCat(
          op_, ": tensor ", k, " of the record (at 0x", absl::Hex(ref.address),
          ") is not inside its segment [0x", absl::Hex(seg.segment_address), ", +",
          seg.segment_bytes, " bytes)"));
    }
    for (int d = 0; d < ref.ndim; ++d) {
      if (ref.strides[d] < 0) return Unsupported(op_, "a tensor with a negative stride");
    }
    return seg.segment_host_base + rel + ref.storage_offset * t->bytes;
  }

  // Tensor argument `a` (the k-th TensorRef) as a value of its own dtype and
  // full shape. Expanded dimensions (stride 0) travel as size 1 and are
  // broadcast in the program.
  absl::StatusOr<std::string> Tensor(const tpu::TensorRef& ref, size_t k) {
    absl::StatusOr<char*> host = HostOf(ref, k);
    if (!host.ok()) return host.status();
    const DType& t = *DTypeOf(ref.dtype);
    Transfer x;
    x.data = *host;
    x.type = &t;
    std::vector<int64_t> full(ref.sizes, ref.sizes + ref.ndim);
    bool expanded = false;
    for (int d = 0; d < ref.ndim; ++d) {
      const bool bcast = ref.strides[d] == 0 && ref.sizes[d] > 1;
      expanded |= bcast;
      x.dims.push_back(bcast ? 1 : ref.sizes[d]);
      x.byte_strides.push_back(ref.strides[d] * t.bytes);
    }
    std::vector<int64_t> dims = x.dims;
    std::string v = Param(TypeOf(dims, t), std::move(x));
    if (expanded) v = BroadcastTo(v, dims, full, t);
    return v;
  }

  // A host scalar (a Scalar argument or a wrapped number) as a 0-d value of
  // dtype `as`.
  absl::StatusOr<std::string> Scalar(const tpu::OpArg& a, const DType& as) {
    Transfer x;
    const DType* t;
    switch (a.tag) {
      case tpu::ArgTag::kScalarInt: case tpu::ArgTag::kInt: case tpu::ArgTag::kSymInt:
        t = &I64();
        x.scalar_i = a.i;
        break;
      case tpu::ArgTag::kScalarBool: case tpu::ArgTag::kBool:
        t = &I64();
        x.scalar_i = a.b ? 1 : 0;
        break;
      case tpu::ArgTag::kScalarDouble: case tpu::ArgTag::kDouble:
        t = &F64();
        x.scalar_d = a.d;
        break;
      case tpu::ArgTag::kScalarTensor: {
        const DType* st = DTypeOf(a.dtype);
        if (st != nullptr && st->is_float) {
          t = &F64();
          x.scalar_d = a.d;
        } else {
          t = &I64();
          x.scalar_i = a.i;
        }
        break;
      }
      default:
        return Unsupported(op_, "a complex or missing scalar");
    }
    x.type = t;
    std::string v = Param(TypeOf({}, *t), std::move(x));
    return Convert(v, {}, *t, as);
  }

  // The position in `tensors` of tensor argument `a` (one of decoded.args):
  // TensorRefs come in record order, a list's elements each, then outputs.
  size_t TensorIndex(const tpu::OpArg& a) const {
    size_t k = 0;
      for (size_t i = 0; i < decoded_.num_args && &decoded_.args[i] != &a; ++i) {
      const tpu::OpArg& b = decoded_.args[i];
      if (b.tag == tpu::ArgTag::kTensor) {
        ++k;
      } else if (b.tag == tpu::ArgTag::kTensorList) {
        k += b.tensors.size();
      } else if (b.tag == tpu::ArgTag::kOptionalTensorList) {
        for (bool present : b.tensor_present) k += present ? 1 : 0;
      }
    }
    return k;
  }

  // A tensor or scalar operand, broadcast to `dims` and converted to `as`.
  absl::StatusOr<std::string> Operand(const tpu::OpArg& a, const std::vector<int64_t>& dims, const DType& as) {
    if (a.tag == tpu::ArgTag::kTensor) {
      absl::StatusOr<std::string> v = Tensor(a.tensor, TensorIndex(a));
      if (!v.ok()) return v;
      const std::vector<int64_t> from(a.tensor.sizes, a.tensor.sizes + a.tensor.ndim);
      std::string c = Convert(*v, from, *DTypeOf(a.tensor.dtype), as);
      return BroadcastTo(c, from, dims, as);
    }
    absl::StatusOr<std::string> s = Scalar(a, as);
    if (!s.ok()) return s;
    return BroadcastTo(*s, {}, dims, as);
  }

  // Tensor `r` (the k-th TensorRef), broadcast to `dims` and converted to `as`.
  absl::StatusOr<std::string> OperandRef(const tpu::TensorRef& r, size_t k,
                                         const std::vector<int64_t>& dims, const DType& as) {
    absl::StatusOr<std::string> v = Tensor(r, k);
    if (!v.ok()) return v;
    const std::vector<int64_t> from(r.sizes, r.sizes + r.ndim);
    return BroadcastTo(Convert(*v, from, *DTypeOf(r.dtype), as), from, dims, as);
  }

  // `v` (dims `in`) reduced over dimensions `which` with `op` ("add",
  // "maximum", "minimum") from `init` (a value of t); dims kept in order.
  std::string ReduceOver(const std::string& v, const std::vector<int64_t>& in,
                         const std::vector<int64_t>& which, const char* op,
                         const std::string& init, const DType& t) {
    return Emit(absl::StrCat("stablehlo.reduce(", v, " init: ", init, ") applies stablehlo.", op,
                             " across dimensions = [", absl::StrJoin(which, ", "), "] : (",
                             TypeOf(in, t), ", ", TypeOf({}, t), ") -> ",
                             TypeOf(Kept(in, which), t)));
  }
  static std::vector<int64_t> Kept(const std::vector<int64_t>& in, const std::vector<int64_t>& which) {
    std::vector<int64_t> kept;
    for (size_t i = 0; i < in.size(); ++i) {
      if (std::find(which.begin(), which.end(), static_cast<int64_t>(i)) == which.end()) {
        kept.push_back(in[i]);
      }
    }
    return kept;
  }
  // A reduced value back to `in`, the reduced dimensions broadcast.
  std::string Expand(const std::string& v, const std::vector<int64_t>& in,
                     const std::vector<int64_t>& which, const DType& t) {
    std::vector<int64_t> map;
    for (size_t i = 0; i < in.size(); ++i) {
      if (std::find(which.begin(), which.end(), static_cast<int64_t>(i)) == which.end()) {
        map.push_back(static_cast<int64_t>(i));
      }
    }
    return Emit(absl::StrCat("stablehlo.broadcast_in_dim ", v, ", dims = [",
                             absl::StrJoin(map, ", "), "] : (", TypeOf(Kept(in, which), t),
                             ") -> ", TypeOf(in, t)));
  }
  std::string Reshape(const std::string& v, const std::vector<int64_t>& from,
                      const std::vector<int64_t>& to, const DType& t) {
    if (from == to) return v;
    return Emit(absl::StrCat("stablehlo.reshape ", v, " : (", TypeOf(from, t), ") -> ",
                             TypeOf(to, t)));
  }
  // The comparison type stablehlo.compare takes for values of t.
  static const char* CompareKind(const DType& t) {
    return t.is_float ? "FLOAT" : (t.mlir[0] == 'u' || t.c10 == 11 ? "UNSIGNED" : "SIGNED");
  }
  std::string Compare(const char* dir, const std::string& a, const std::string& b,
                      const std::vector<int64_t>& dims, const DType& t) {
    return Emit(absl::StrCat("stablehlo.compare ", dir, ", ", a, ", ", b, ", ", CompareKind(t),
                             " : (", TypeOf(dims, t), ", ", TypeOf(dims, t), ") -> ",
                             TypeOf(dims, *DTypeOf(11))));
  }
  std::string Select(const std::string& pred, const std::string& a, const std::string& b,
                     const std::vector<int64_t>& dims, const DType& t) {
    return Emit(absl::StrCat("stablehlo.select ", pred, ", ", a, ", ", b, " : ",
                             TypeOf(dims, *DTypeOf(11)), ", ", TypeOf(dims, t)));
  }
  std::string Iota(int64_t dim, const std::vector<int64_t>& dims, const DType& t) {
    return Emit(absl::StrCat("stablehlo.iota dim = ", dim, " : ", TypeOf(dims, t)));
  }
  // -inf (floats) or the lowest value, as a 0-d constant.
  std::string Lowest(const DType& t) {
    const char* hex = t.c10 == 6 ? "0xFF800000" : t.c10 == 7 ? "0xFFF0000000000000"
                    : t.c10 == 5 ? "0xFC00" : t.c10 == 15 ? "0xFF80" : nullptr;
    if (hex == nullptr) return Emit(absl::StrCat("stablehlo.constant dense<", IntLimit(t, false), "> : ", TypeOf({}, t)));
    return Emit(absl::StrCat("stablehlo.constant dense<", hex, "> : ", TypeOf({}, t)));
  }

  std::string Convert(const std::string& v, const std::vector<int64_t>& dims, const DType& from,
                      const DType& to) {
    if (from.c10 == to.c10) return v;
    // Complex to real keeps the real part; real to complex has no imaginary
    // part (XLA converts neither way itself).
    if (IsComplex(from) && !IsComplex(to)) {
      const DType& part = PartOf(from);
      return Convert(Emit(absl::StrCat("stablehlo.real ", v, " : (", TypeOf(dims, from), ") -> ", TypeOf(dims, part))),
                     dims, part, to);
    }
    if (IsComplex(to) && !IsComplex(from)) {
      const DType& part = PartOf(to);
      const std::string re = Convert(v, dims, from, part);
      return Emit(absl::StrCat("stablehlo.complex ", re, ", ", Constant(0, dims, part), " : ", TypeOf(dims, to)));
    }
    return Emit(absl::StrCat("stablehlo.convert ", v, " : (", TypeOf(dims, from), ") -> ",
                             TypeOf(dims, to)));
  }

  // Numpy-style: `from` aligns with the trailing dimensions of `to`.
  std::string BroadcastTo(const std::string& v, const std::vector<int64_t>& from,
                          const std::vector<int64_t>& to, const DType& t) {
    if (from == to) return v;
    std::vector<int64_t> map;
    for (size_t i = 0; i < from.size(); ++i) map.push_back(to.size() - from.size() + i);
    return Emit(absl::StrCat("stablehlo.broadcast_in_dim ", v, ", dims = [",
                             absl::StrJoin(map, ", "), "] : (", TypeOf(from, t), ") -> ",
                             TypeOf(to, t)));
  }

  std::string Constant(double value, const std::vector<int64_t>& dims, const DType& t) {
    const std::string lit = t.is_float ? FloatLiteral(value)
                          : IsComplex(t) ? absl::StrCat("(", FloatLiteral(value), ", 0.0)")
                                         : absl::StrCat(static_cast<int64_t>(value));
    const std::string c = Emit(absl::StrCat("stablehlo.constant dense<",
                                            t.c10 == 11 ? (value != 0 ? "true" : "false") : lit,
                                            "> : ", TypeOf({}, t)));
    return BroadcastTo(c, {}, dims, t);
  }

  std::string Binary(const char* op, const std::string& a, const std::string& b,
                     const std::vector<int64_t>& dims, const DType& t) {
    return Emit(absl::StrCat("stablehlo.", op, " ", a, ", ", b, " : ", TypeOf(dims, t)));
  }
  std::string Unary(const char* op, const std::string& a, const std::vector<int64_t>& dims,
                    const DType& t) {
    return Emit(absl::StrCat("stablehlo.", op, " ", a, " : ", TypeOf(dims, t)));
  }

  std::string Emit(const std::string& rhs) {
    const std::string v = absl::StrCat("%v", next_++);
    absl::StrAppend(&body_, "    ", v, " = ", rhs, "\n");
    return v;
  }

  std::string Text(const std::vector<std::string>& results,
                   const std::vector<std::string>& types) const {
    std::vector<std::string> params;
    for (size_t i = 0; i < param_types_.size(); ++i) {
      params.push_back(absl::StrCat("%p", i, ": ", param_types_[i]));
      if (transfers_[i].aliased >= 0) {
        absl::StrAppend(&params.back(), " {tf.aliasing_output = ", transfers_[i].aliased, " : i32}");
      }
    }
    const std::string ret = absl::StrJoin(types, ", ");
    return absl::StrCat("module @tpud_op {\n  func.func public @main(", absl::StrJoin(params, ", "),
                        ") -> (", ret, ") {\n", body_, "    return ", absl::StrJoin(results, ", "),
                        " : ", ret, "\n  }\n}\n");
  }

  // `n` elements of type t at `host`, as a 1-d parameter.
  std::string Flat(const char* host, const DType& t, int64_t n) {
    Transfer x;
    x.data = host;
    x.type = &t;
    x.dims = {n};
    x.byte_strides = {static_cast<int64_t>(t.bytes)};
    return Param(TypeOf({n}, t), std::move(x));
  }

  // `v` (dims `dims`) written into `flat` (1-d, `span` elements) at the
  // element offsets sum_d index_d * strides[d]: a strided output with gaps,
  // its gaps keeping what `flat` holds.
  std::string ScatterStrided(const std::string& flat, int64_t span, const std::string& v,
                             const std::vector<int64_t>& dims, const std::vector<int64_t>& strides,
                             const DType& t) {
    int64_t n = 1;
    for (int64_t d : dims) n *= d;
    const DType& i64 = I64();
    std::string index = Constant(0, dims, i64);
    for (size_t d = 0; d < dims.size(); ++d) {
      if (dims[d] == 1 || strides[d] == 0) continue;
      const std::string term = Binary("multiply", Iota(static_cast<int64_t>(d), dims, i64),
                                      Constant(static_cast<double>(strides[d]), dims, i64), dims, i64);
      index = Binary("add", index, term, dims, i64);
    }
    index = Reshape(index, dims, {n, 1}, i64);
    const std::string updates = Reshape(v, dims, {n}, t);
    const std::string scalar = TypeOf({}, t);
    return Emit(absl::StrCat(
        "\"stablehlo.scatter\"(", flat, ", ", index, ", ", updates, ") ({\n",
        "    ^bb0(%old: ", scalar, ", %new: ", scalar, "):\n",
        "      stablehlo.return %new : ", scalar, "\n",
        "    }) {indices_are_sorted = false, scatter_dimension_numbers = #stablehlo.scatter<",
        "inserted_window_dims = [0], scatter_dims_to_operand_dims = [0], index_vector_dim = 1>, ",
        "unique_indices = true} : (", TypeOf({span}, t), ", ", TypeOf({n, 1}, i64), ", ",
        TypeOf({n}, t), ") -> ", TypeOf({span}, t)));
  }

  // Uniform values in [0, 1) of type f (f32 or f64), dims `dims` (with a
  // leading dimension of `draws` when that is above 1), from XLA's
  // rng_bit_generator keyed by `seed` (a parameter of the program).
  std::string UniformBits(int64_t seed, const std::vector<int64_t>& dims, const DType& f, int64_t draws) {
    Transfer x;
    x.type = &I64();
    x.scalar_i = seed;
    const std::string s = Param(TypeOf({}, I64()), std::move(x));
    const DType& i64 = I64();
    const std::string pair = Binary("add", BroadcastTo(s, {}, {2}, i64), Iota(0, {2}, i64), {2}, i64);
    const std::string key = Emit(absl::StrCat("stablehlo.bitcast_convert ", pair, " : (tensor<2xi64>) -> tensor<2xui64>"));
    std::vector<int64_t> shape = dims;
    if (draws > 1) shape.insert(shape.begin(), draws);
    const bool wide = f.c10 == 7;
    const std::string ut = wide ? "ui64" : "ui32";
    auto type = [&](const char* elt) {
      std::string r = "tensor<";
      for (int64_t d : shape) absl::StrAppend(&r, d, "x");
      return absl::StrCat(r, elt, ">");
    };
    const std::string gen = absl::StrCat("%v", next_++);
    absl::StrAppend(&body_, "    ", gen, ":2 = stablehlo.rng_bit_generator ", key,
                    ", algorithm = DEFAULT : (tensor<2xui64>) -> (tensor<2xui64>, ", type(ut.c_str()), ")\n");
    // The top mantissa bits under an exponent of 1.0: [1, 2), minus 1.
    const std::string shift = Emit(absl::StrCat("stablehlo.constant dense<", wide ? 12 : 9, "> : ", type(ut.c_str())));
    const std::string one = Emit(absl::StrCat("stablehlo.constant dense<", wide ? "4607182418800017408" : "1065353216",
                                              "> : ", type(ut.c_str())));
    const std::string m = Emit(absl::StrCat("stablehlo.shift_right_logical ", gen, "#1, ", shift, " : ", type(ut.c_str())));
    const std::string bits = Emit(absl::StrCat("stablehlo.or ", m, ", ", one, " : ", type(ut.c_str())));
    const std::string v = Emit(absl::StrCat("stablehlo.bitcast_convert ", bits, " : (", type(ut.c_str()), ") -> ",
                                            TypeOf(shape, f)));
    return Binary("subtract", v, Constant(1, shape, f), shape, f);
  }

  std::vector<Transfer>& transfers() { return transfers_; }
  const std::string& op() const { return op_; }

  // Records that every element of `idx` (i64, dims `dims`) must lie in
  // [0, size): the program returns whether one does not, and the op fails
  // with `what` after it runs (XLA itself clamps or drops such indices).
  void CheckRange(const std::string& idx, const std::vector<int64_t>& dims, int64_t size, const std::string& what) {
    const DType& i64 = I64();
    const DType& i1 = *DTypeOf(11);
    const std::string bad = Binary("or", Compare("LT", idx, Constant(0, dims, i64), dims, i64),
                                   Compare("GE", idx, Constant(static_cast<double>(size), dims, i64), dims, i64), dims, i1);
    std::vector<int64_t> all;
    for (size_t q = 0; q < dims.size(); ++q) all.push_back(static_cast<int64_t>(q));
    const std::string any = ReduceOver(bad, dims, all, "or", Constant(0, {}, i1), i1);
    out_of_range_ = out_of_range_.empty() ? any : Binary("or", out_of_range_, any, {}, i1);
    if (range_message_.empty()) range_message_ = what;
  }
  // The combined check (an i1 scalar), or "" when nothing was checked.
  const std::string& out_of_range() const { return out_of_range_; }
  const std::string& range_message() const { return range_message_; }

  // The text of the ops `emit` emits, kept apart from the body: a region
  // (of a while loop) to place in an op's text.
  std::string Region(const std::function<void()>& emit) {
    std::string saved;
    saved.swap(body_);
    emit();
    std::string region;
    region.swap(body_);
    body_.swap(saved);
    return region;
  }
  int NextId() { return next_++; }

  // An op with `n` results (`rhs` written whole); result k is `name#k`.
  std::string EmitResults(const std::string& rhs, int n) {
    const std::string v = absl::StrCat("%v", next_++);
    absl::StrAppend(&body_, "    ", v, ":", n, " = ", rhs, "\n");
    return v;
  }

  // `v` (dims `in`, type t) sorted along `dim`, stably, with NaN above
  // everything as in PyTorch; returns the values and their int64 indices.
  std::pair<std::string, std::string> Sort(const std::string& v, const std::vector<int64_t>& in,
                                           int64_t dim, bool descending, const DType& t) {
    const DType& i64 = I64();
    const std::string s = TypeOf({}, t), si = TypeOf({}, i64), b = TypeOf({}, *DTypeOf(11));
    const char* kind = CompareKind(t);
    // before(a, b): a sorts first.
    std::string cmp = absl::StrCat("      %before = stablehlo.compare ", descending ? "GT" : "LT", ", %a, %b, ", kind,
                                   " : (", s, ", ", s, ") -> ", b, "\n");
    std::string result = "%before";
    if (t.is_float) {
      // A NaN sorts last going up, first going down.
      const char* nan_first = descending ? "%a" : "%b";
      const char* other = descending ? "%b" : "%a";
      absl::StrAppend(&cmp, "      %n1 = stablehlo.compare NE, ", nan_first, ", ", nan_first, ", FLOAT : (", s, ", ", s, ") -> ", b, "\n",
                      "      %n2 = stablehlo.compare EQ, ", other, ", ", other, ", FLOAT : (", s, ", ", s, ") -> ", b, "\n",
                      "      %n3 = stablehlo.and %n1, %n2 : ", b, "\n",
                      "      %r = stablehlo.or %before, %n3 : ", b, "\n");
      result = "%r";
    }
    const std::string r = EmitResults(absl::StrCat(
        "\"stablehlo.sort\"(", v, ", ", Iota(dim, in, i64), ") ({\n",
        "    ^bb0(%a: ", s, ", %b: ", s, ", %ia: ", si, ", %ib: ", si, "):\n", cmp,
        "      stablehlo.return ", result, " : ", b, "\n",
        "    }) {dimension = ", dim, " : i64, is_stable = true} : (", TypeOf(in, t), ", ", TypeOf(in, i64),
        ") -> (", TypeOf(in, t), ", ", TypeOf(in, i64), ")"), 2);
    return {r + "#0", r + "#1"};
  }

  // Elements [start, limit) of `v` (dims `in`) in every dimension.
  std::string Slice(const std::string& v, const std::vector<int64_t>& in, const std::vector<int64_t>& start,
                    const std::vector<int64_t>& limit, const DType& t) {
    std::vector<std::string> r;
    std::vector<int64_t> out;
    for (size_t k = 0; k < in.size(); ++k) {
      r.push_back(absl::StrCat(start[k], ":", limit[k]));
      out.push_back(limit[k] - start[k]);
    }
    return Emit(absl::StrCat("stablehlo.slice ", v, " [", absl::StrJoin(r, ", "), "] : (", TypeOf(in, t), ") -> ",
                             TypeOf(out, t)));
  }
  // Elements [begin, end) of `v` along `dim`.
  std::string SliceAlong(const std::string& v, const std::vector<int64_t>& in, int64_t dim,
                         int64_t begin, int64_t end, const DType& t) {
    std::vector<int64_t> start(in.size(), 0), limit = in;
    start[dim] = begin;
    limit[dim] = end;
    return Slice(v, in, start, limit, t);
  }

  // Donates the memory of result `o` (dense, `dims` of t at `host`) to the
  // program: a parameter that already reads exactly those bytes (self of an
  // in-place op, the span of a gapped write), else one more, unused.
  void Donate(int o, char* host, const DType& t, const std::vector<int64_t>& dims) {
    for (Transfer& x : transfers_) {
      if (x.aliased < 0 && x.data == host && x.type == &t && x.dims == dims && x.Dense()) {
        x.aliased = o;
        return;
      }
    }
    Transfer x;
    x.data = host;
    x.type = &t;
    x.dims = dims;
    int64_t stride = t.bytes;
    x.byte_strides.assign(dims.size(), 0);
    for (size_t d = dims.size(); d-- > 0;) {
      x.byte_strides[d] = stride;
      stride *= dims[d];
    }
    x.aliased = o;
    Param(TypeOf(dims, t), std::move(x));
  }

  // ---- device memory (PjrtChip with device buffers; docs/design.md)
  //
  // There, a segment is one PJRT buffer of bytes (u8[segment bytes]) on its
  // device, and a program takes the segments its tensors lie in instead of
  // the tensors: each tensor parameter is read out of its segment inside the
  // program (a slice of its bytes, reinterpreted as its type, and a gather
  // where it is strided), and each result is written back into its segment
  // (its bytes updated in place: the segment is donated to the program and
  // aliased to the new segment it returns).

  // Bytes (u8[count * size of t]) as `count` values of t.
  std::string Decode(const std::string& bytes, int64_t count, const DType& t) {
    const DType& u8 = *DTypeOf(0);
    const int64_t n = count * t.bytes;
    if (t.c10 == 0) return bytes;
    if (t.c10 == 11) return Compare("NE", bytes, Constant(0, {n}, u8), {n}, u8);
    if (IsComplex(t)) {
      const DType& part = PartOf(t);
      const std::string grouped = Reshape(bytes, {n}, {count, 2, part.bytes}, u8);
      const std::string parts = Emit(absl::StrCat("stablehlo.bitcast_convert ", grouped, " : (",
                                                  TypeOf({count, 2, part.bytes}, u8), ") -> ",
                                                  TypeOf({count, 2}, part)));
      const std::string re = Reshape(SliceAlong(parts, {count, 2}, 1, 0, 1, part), {count, 1}, {count}, part);
      const std::string im = Reshape(SliceAlong(parts, {count, 2}, 1, 1, 2, part), {count, 1}, {count}, part);
      return Emit(absl::StrCat("stablehlo.complex ", re, ", ", im, " : ", TypeOf({count}, t)));
    }
    if (t.bytes == 1) {
      return Emit(absl::StrCat("stablehlo.bitcast_convert ", bytes, " : (", TypeOf({n}, u8), ") -> ", TypeOf({count}, t)));
    }
    const std::string grouped = Reshape(bytes, {n}, {count, t.bytes}, u8);
    return Emit(absl::StrCat("stablehlo.bitcast_convert ", grouped, " : (", TypeOf({count, t.bytes}, u8), ") -> ",
                             TypeOf({count}, t)));
  }
  // `count` values of t as their bytes (u8[count * size of t]).
  std::string Encode(const std::string& v, int64_t count, const DType& t) {
    const DType& u8 = *DTypeOf(0);
    const int64_t n = count * t.bytes;
    if (t.c10 == 0) return v;
    if (t.c10 == 11) return Convert(v, {count}, t, u8);
    if (IsComplex(t)) {
      const DType& part = PartOf(t);
      const std::string re = Reshape(Emit(absl::StrCat("stablehlo.real ", v, " : (", TypeOf({count}, t), ") -> ",
                                                       TypeOf({count}, part))), {count}, {count, 1}, part);
      const std::string im = Reshape(Emit(absl::StrCat("stablehlo.imag ", v, " : (", TypeOf({count}, t), ") -> ",
                                                       TypeOf({count}, part))), {count}, {count, 1}, part);
      const std::string parts = Emit(absl::StrCat("stablehlo.concatenate ", re, ", ", im, ", dim = 1 : (",
                                                  TypeOf({count, 1}, part), ", ", TypeOf({count, 1}, part), ") -> ",
                                                  TypeOf({count, 2}, part)));
      const std::string bytes = Emit(absl::StrCat("stablehlo.bitcast_convert ", parts, " : (", TypeOf({count, 2}, part),
                                                  ") -> ", TypeOf({count, 2, part.bytes}, u8)));
      return Reshape(bytes, {count, 2, part.bytes}, {n}, u8);
    }
    if (t.bytes == 1) {
      return Emit(absl::StrCat("stablehlo.bitcast_convert ", v, " : (", TypeOf({count}, t), ") -> ", TypeOf({n}, u8)));
    }
    const std::string bytes = Emit(absl::StrCat("stablehlo.bitcast_convert ", v, " : (", TypeOf({count}, t), ") -> ",
                                                TypeOf({count, t.bytes}, u8)));
    return Reshape(bytes, {count, t.bytes}, {n}, u8);
  }
  // Transfer x's tensor, read out of segment value `seg` (u8[seg_bytes])
  // where it starts `offset` bytes in; or, with `at` (a tensor<i64> value),
  // where `at` says when the program runs (`offset` is where it starts now).
  absl::StatusOr<std::string> ReadView(const std::string& seg, uint64_t seg_bytes, uint64_t offset, const Transfer& x,
                                       const std::string& at = "") {
    const DType& t = *x.type;
    const DType& u8 = *DTypeOf(0);
    int64_t n = 1;
    for (int64_t d : x.dims) n *= d;
    if (n == 0) return Constant(0, x.dims, t);
    const bool dense = x.Dense();
    std::vector<int64_t> strides(x.dims.size(), 0);  // in elements
    int64_t count = n;
    if (!dense) {
      count = 1;
      for (size_t d = 0; d < x.dims.size(); ++d) {
        if (x.dims[d] == 1) continue;
        if (x.byte_strides[d] <= 0 || x.byte_strides[d] % t.bytes != 0) {
          return Unsupported(op_, "a tensor whose strides are not whole elements");
        }
        strides[d] = x.byte_strides[d] / t.bytes;
        count += (x.dims[d] - 1) * strides[d];
      }
    }
    const uint64_t span = static_cast<uint64_t>(count) * static_cast<uint64_t>(t.bytes);
    if (offset > seg_bytes || span > seg_bytes - offset) {
      return absl::InvalidArgumentError(absl::StrCat(op_, ": a tensor reaches past its segment"));
    }
    std::string bytes = seg;
    if (!at.empty()) {
      bytes = Emit(absl::StrCat("stablehlo.dynamic_slice ", seg, ", ", at, ", sizes = [", span, "] : (",
                                TypeOf({static_cast<int64_t>(seg_bytes)}, u8), ", tensor<i64>) -> ",
                                TypeOf({static_cast<int64_t>(span)}, u8)));
    } else if (offset != 0 || span != seg_bytes) {
      bytes = Emit(absl::StrCat("stablehlo.slice ", seg, " [", offset, ":", offset + span, "] : (",
                                TypeOf({static_cast<int64_t>(seg_bytes)}, u8), ") -> ",
                                TypeOf({static_cast<int64_t>(span)}, u8)));
    }
    const std::string flat = Decode(bytes, count, t);
    if (dense) return Reshape(flat, {count}, x.dims, t);
    const DType& i64 = I64();
    std::string index = Constant(0, x.dims, i64);
    for (size_t d = 0; d < x.dims.size(); ++d) {
      if (x.dims[d] == 1) continue;
      index = Binary("add", index,
                     Binary("multiply", Iota(static_cast<int64_t>(d), x.dims, i64),
                            Constant(static_cast<double>(strides[d]), x.dims, i64), x.dims, i64),
                     x.dims, i64);
    }
    index = Reshape(index, x.dims, {n, 1}, i64);
    const std::string picked = Emit(absl::StrCat(
        "\"stablehlo.gather\"(", flat, ", ", index, ") {dimension_numbers = #stablehlo.gather<",
        "collapsed_slice_dims = [0], start_index_map = [0], index_vector_dim = 1>, indices_are_sorted = false, ",
        "slice_sizes = array<i64: 1>} : (", TypeOf({count}, t), ", ", TypeOf({n, 1}, i64), ") -> ",
        TypeOf({n}, t)));
    return Reshape(picked, {n}, x.dims, t);
  }

  // A segment parameter of a device-memory program.
  struct SegmentParam {
    uint64_t bytes = 0;
    int result = -1;  // the program's result it is donated to (-1: read only)
  };
  // A result written into a segment: `value` (dims `dims` of t, dense) at
  // byte `offset` of segment `seg`.
  struct SegmentWrite {
    std::string value;
    std::vector<int64_t> dims;
    const DType* type = nullptr;
    int seg = -1;
    uint64_t offset = 0;
  };
  // The program for device memory: parameters are the segments, then the
  // transfers with `in_seg[i]` < 0 (scalars) in order; transfer i with a
  // segment is read from it at `in_off[i]`. Results: each segment with a
  // `result`, in that order, then `extra` (typed `extra_types`). With
  // `dynamic`, the offsets are the program's last parameters (tensor<i64>,
  // each read's in transfer order, then each write's) instead of constants
  // in it, so one program serves its op wherever the tensors lie.
  absl::StatusOr<std::string> DeviceText(const std::vector<SegmentParam>& segs, const std::vector<int>& in_seg,
                                         const std::vector<uint64_t>& in_off, const std::vector<SegmentWrite>& writes,
                                         const std::vector<std::string>& extra,
                                         const std::vector<std::string>& extra_types, bool dynamic = false) {
    const DType& u8 = *DTypeOf(0);
    absl::Status failed;
    // The reads come first: the body names transfer i's value %p<i>.
    const std::string prologue = Region([&] {
      for (size_t i = 0; i < transfers_.size() && failed.ok(); ++i) {
        if (in_seg[i] < 0) continue;
        absl::StatusOr<std::string> v = ReadView(absl::StrCat("%s", in_seg[i]), segs[in_seg[i]].bytes, in_off[i],
                                                 transfers_[i], dynamic ? absl::StrCat("%o", i) : "");
        if (!v.ok()) {
          failed = v.status();
          return;
        }
        absl::StrAppend(&body_, "    %p", i, " = stablehlo.reshape ", *v, " : (", param_types_[i], ") -> ",
                        param_types_[i], "\n");
      }
    });
    if (!failed.ok()) return failed;
    std::vector<std::string> now(segs.size());
    for (size_t j = 0; j < segs.size(); ++j) now[j] = absl::StrCat("%s", j);
    for (size_t wi = 0; wi < writes.size(); ++wi) {
      const SegmentWrite& w = writes[wi];
      int64_t n = 1;
      for (int64_t d : w.dims) n *= d;
      const DType& t = *w.type;
      const int64_t seg_bytes = static_cast<int64_t>(segs[w.seg].bytes);
      const int64_t bytes = n * t.bytes;
      if (w.offset > static_cast<uint64_t>(seg_bytes) || bytes > seg_bytes - static_cast<int64_t>(w.offset)) {
        return absl::InvalidArgumentError(absl::StrCat(op_, ": a result reaches past its segment"));
      }
      const std::string enc = Encode(Reshape(w.value, w.dims, {n}, t), n, t);
      const std::string at = dynamic ? absl::StrCat("%w", wi)
                                     : Emit(absl::StrCat("stablehlo.constant dense<", w.offset, "> : tensor<i64>"));
      now[w.seg] = Emit(absl::StrCat("stablehlo.dynamic_update_slice ", now[w.seg], ", ", enc, ", ", at, " : (",
                                     TypeOf({seg_bytes}, u8), ", ", TypeOf({bytes}, u8), ", tensor<i64>) -> ",
                                     TypeOf({seg_bytes}, u8)));
    }
    std::vector<std::string> params, results, types;
    for (size_t j = 0; j < segs.size(); ++j) {
      params.push_back(absl::StrCat("%s", j, ": ", TypeOf({static_cast<int64_t>(segs[j].bytes)}, u8)));
      if (segs[j].result >= 0) {
        absl::StrAppend(&params.back(), " {tf.aliasing_output = ", segs[j].result, " : i32}");
      }
    }
    // Donated segments are results in the order of their `result`.
    std::vector<std::pair<int, size_t>> order;
    for (size_t j = 0; j < segs.size(); ++j) {
      if (segs[j].result >= 0) order.emplace_back(segs[j].result, j);
    }
    std::sort(order.begin(), order.end());
    for (const auto& [r, j] : order) {
      results.push_back(now[j]);
      types.push_back(TypeOf({static_cast<int64_t>(segs[j].bytes)}, u8));
    }
    for (size_t i = 0; i < transfers_.size(); ++i) {
      if (in_seg[i] < 0) params.push_back(absl::StrCat("%p", i, ": ", param_types_[i]));
    }
    if (dynamic) {
      for (size_t i = 0; i < transfers_.size(); ++i) {
        if (in_seg[i] >= 0) params.push_back(absl::StrCat("%o", i, ": tensor<i64>"));
      }
      for (size_t wi = 0; wi < writes.size(); ++wi) params.push_back(absl::StrCat("%w", wi, ": tensor<i64>"));
    }
    results.insert(results.end(), extra.begin(), extra.end());
    types.insert(types.end(), extra_types.begin(), extra_types.end());
    const std::string ret = absl::StrJoin(types, ", ");
    return absl::StrCat("module @tpud_op {\n  func.func public @main(", absl::StrJoin(params, ", "), ") -> (", ret,
                        ") {\n", prologue, body_, "    return ", absl::StrJoin(results, ", "), " : ", ret,
                        "\n  }\n}\n");
  }

 private:
  std::string Param(const std::string& type, Transfer x) {
    param_types_.push_back(type);
    transfers_.push_back(std::move(x));
    return absl::StrCat("%p", param_types_.size() - 1);
  }

  const std::string& op_;
  const tpu::DecodedOp& decoded_;
  const std::vector<ResolvedTensor>& tensors_;
  std::vector<std::string> param_types_;
  std::vector<Transfer> transfers_;
  std::string body_;
  int next_ = 0;
  std::string out_of_range_, range_message_;
};

struct Target {
  const tpu::TensorRef* ref;
  std::vector<int64_t> dims;
  const DType* type;
};

// +inf (floats) or the highest value, as a 0-d constant.
std::string Highest(Lowering& l, const DType& t) {
  const char* hex = t.c10 == 6 ? "0x7F800000" : t.c10 == 7 ? "0x7FF0000000000000"
                  : t.c10 == 5 ? "0x7C00" : t.c10 == 15 ? "0x7F80" : nullptr;
  if (hex == nullptr) return l.Emit(absl::StrCat("stablehlo.constant dense<", IntLimit(t, true), "> : ", TypeOf({}, t)));
  return l.Emit(absl::StrCat("stablehlo.constant dense<", hex, "> : ", TypeOf({}, t)));
}

Rule BinaryRule(const char* op, bool has_alpha) {
  return [op, has_alpha](Lowering& l, const tpu::DecodedOp& d, const Target& out) -> absl::StatusOr<std::string> {
    if (d.num_args < 2) return Unsupported(l.op(), "too few arguments");
    absl::StatusOr<std::string> a = l.Operand(d.args[0], out.dims, *out.type);
    if (!a.ok()) return a;
    absl::StatusOr<std::string> b = l.Operand(d.args[1], out.dims, *out.type);
    if (!b.ok()) return b;
    std::string rhs = *b;
    if (has_alpha && d.num_args > 2) {
      const tpu::OpArg& alpha = d.args[2];
      const bool one = (alpha.tag == tpu::ArgTag::kScalarInt && alpha.i == 1) ||
                       (alpha.tag == tpu::ArgTag::kScalarDouble && alpha.d == 1.0);
      if (!one) {
        absl::StatusOr<std::string> s = l.Operand(alpha, out.dims, *out.type);
        if (!s.ok()) return s;
        rhs = l.Binary("multiply", rhs, *s, out.dims, *out.type);
      }
    }
    return l.Binary(op, *a, rhs, out.dims, *out.type);
  };
}

Rule UnaryRule(std::function<std::string(Lowering&, const std::string&, const Target&)> f) {
  return [f](Lowering& l, const tpu::DecodedOp& d, const Target& out) -> absl::StatusOr<std::string> {
    if (d.num_args < 1 || d.args[0].tag != tpu::ArgTag::kTensor) {
      return Unsupported(l.op(), "expects a tensor");
    }
    absl::StatusOr<std::string> a = l.Operand(d.args[0], out.dims, *out.type);
    if (!a.ok()) return a;
    return f(l, *a, out);
  };
}

Rule Simple(const char* op) {
  return UnaryRule([op](Lowering& l, const std::string& a, const Target& out) {
    return l.Unary(op, a, out.dims, *out.type);
  });
}

absl::StatusOr<std::string> MatMul(Lowering& l, const tpu::OpArg& a, const tpu::OpArg& b,
                                   const Target& out) {
  if (a.tag != tpu::ArgTag::kTensor || b.tag != tpu::ArgTag::kTensor || a.tensor.ndim != 2 ||
      b.tensor.ndim != 2) {
    return Unsupported(l.op(), "expects two matrices");
  }
  const std::vector<int64_t> da(a.tensor.sizes, a.tensor.sizes + 2),
      db(b.tensor.sizes, b.tensor.sizes + 2);
  absl::StatusOr<std::string> x = l.Operand(a, da, *out.type);
  if (!x.ok()) return x;
  absl::StatusOr<std::string> y = l.Operand(b, db, *out.type);
  if (!y.ok()) return y;
  return l.Emit(absl::StrCat("stablehlo.dot ", *x, ", ", *y, " : (", TypeOf(da, *out.type), ", ",
                             TypeOf(db, *out.type), ") -> ", TypeOf(out.dims, *out.type)));
}

// sum / mean over `dims` (all when empty), keepdim or not, into out's shape.
absl::StatusOr<std::string> Reduce(Lowering& l, const tpu::DecodedOp& d, const Target& out,
                                   bool mean) {
  const tpu::OpArg& self = d.args[0];
  if (self.tag != tpu::ArgTag::kTensor) return Unsupported(l.op(), "expects a tensor");
  const int n = self.tensor.ndim;
  const std::vector<int64_t> in(self.tensor.sizes, self.tensor.sizes + n);
  std::vector<bool> reduced(n, false);
  const bool listed = d.num_args > 1 && d.args[1].tag == tpu::ArgTag::kIntList &&
                      !d.args[1].ints.empty();
  for (int i = 0; i < n; ++i) reduced[i] = !listed;
  if (listed && n > 0) {  // (a 0-d tensor: dim 0 / -1 is itself)
    for (int64_t dim : d.args[1].ints) {
      const int64_t w = dim < 0 ? dim + n : dim;
      if (w < 0 || w >= n) return absl::InvalidArgumentError(absl::StrCat(l.op(), ": dim ", dim, " out of range"));
      reduced[w] = true;
    }
  }
  absl::StatusOr<std::string> x = l.Operand(self, in, *out.type);
  if (!x.ok()) return x;
  std::vector<int64_t> which, kept;
  int64_t count = 1;
  for (int i = 0; i < n; ++i) {
    if (reduced[i]) {
      which.push_back(i);
      count *= in[i];
    } else {
      kept.push_back(in[i]);
    }
  }
  if (which.empty()) return *x;
  const std::string zero = l.Constant(0, {}, *out.type);
  std::string r = l.Emit(absl::StrCat("stablehlo.reduce(", *x, " init: ", zero,
                                      ") applies stablehlo.add across dimensions = [",
                                      absl::StrJoin(which, ", "), "] : (", TypeOf(in, *out.type),
                                      ", ", TypeOf({}, *out.type), ") -> ",
                                      TypeOf(kept, *out.type)));
  if (mean) {
    r = l.Binary("divide", r, l.Constant(static_cast<double>(count), kept, *out.type), kept,
                 *out.type);
  }
  if (kept != out.dims) {
    r = l.Emit(absl::StrCat("stablehlo.reshape ", r, " : (", TypeOf(kept, *out.type), ") -> ",
                            TypeOf(out.dims, *out.type)));
  }
  return r;
}

const std::map<std::string, Rule>& Rules() {
  static const auto* rules = [] {
    auto* m = new std::map<std::string, Rule>;
    // (Their in-place and out= forms come from AllRules.)
    (*m)["aten::add.Tensor"] = BinaryRule("add", true);
    (*m)["aten::add.Scalar"] = BinaryRule("add", true);
    (*m)["aten::sub.Tensor"] = BinaryRule("subtract", true);
    (*m)["aten::sub.Scalar"] = BinaryRule("subtract", true);
    (*m)["aten::mul.Tensor"] = BinaryRule("multiply", false);
    (*m)["aten::mul.Scalar"] = BinaryRule("multiply", false);
    (*m)["aten::div.Tensor"] = BinaryRule("divide", false);
    (*m)["aten::div.Scalar"] = BinaryRule("divide", false);
    (*m)["aten::neg"] = Simple("negate");
    (*m)["aten::exp"] = Simple("exponential");
    (*m)["aten::log"] = Simple("log");
    (*m)["aten::tanh"] = Simple("tanh");
    (*m)["aten::sqrt"] = Simple("sqrt");
    (*m)["aten::rsqrt"] = Simple("rsqrt");
    (*m)["aten::abs"] = Simple("abs");
    (*m)["aten::sin"] = Simple("sine");
    (*m)["aten::cos"] = Simple("cosine");
    (*m)["aten::sigmoid"] = Simple("logistic");
    (*m)["aten::relu"] = UnaryRule([](Lowering& l, const std::string& a, const Target& o) {
      return l.Binary("maximum", a, l.Constant(0, o.dims, *o.type), o.dims, *o.type);
    });
    (*m)["aten::maximum"] = BinaryRule("maximum", false);
    (*m)["aten::pow.Tensor_Scalar"] = BinaryRule("power", false);
    (*m)["aten::pow.Tensor_Tensor"] = BinaryRule("power", false);
    (*m)["aten::minimum"] = BinaryRule("minimum", false);
    (*m)["aten::mm"] = [](Lowering& l, const tpu::DecodedOp& d, const Target& out)
        -> absl::StatusOr<std::string> {
      if (d.num_args < 2) return Unsupported(l.op(), "too few arguments");
      return MatMul(l, d.args[0], d.args[1], out);
    };
    (*m)["aten::addmm"] = [](Lowering& l, const tpu::DecodedOp& d, const Target& out)
        -> absl::StatusOr<std::string> {
      if (d.num_args < 3) return Unsupported(l.op(), "too few arguments");
      // beta * self + alpha * (mat1 @ mat2); self is read first (record order).
      absl::StatusOr<std::string> self = l.Operand(d.args[0], out.dims, *out.type);
      if (!self.ok()) return self;
      absl::StatusOr<std::string> prod = MatMul(l, d.args[1], d.args[2], out);
      if (!prod.ok()) return prod;
      std::string lhs = *self, rhs = *prod;
      for (size_t i : {size_t{3}, size_t{4}}) {
        if (d.num_args <= i) break;
        absl::StatusOr<std::string> s = l.Operand(d.args[i], out.dims, *out.type);
        if (!s.ok()) return s;
        (i == 3 ? lhs : rhs) = l.Binary("multiply", i == 3 ? lhs : rhs, *s, out.dims, *out.type);
      }
      return l.Binary("add", lhs, rhs, out.dims, *out.type);
    };
    (*m)["aten::sum.dim_IntList"] = [](Lowering& l, const tpu::DecodedOp& d, const Target& out) { return Reduce(l, d, out, false); };
    (*m)["aten::sum"] = [](Lowering& l, const tpu::DecodedOp& d, const Target& out) {
      return Reduce(l, d, out, false);
    };
    (*m)["aten::mean.dim"] = [](Lowering& l, const tpu::DecodedOp& d, const Target& out) { return Reduce(l, d, out, true); };
    (*m)["aten::mean"] = [](Lowering& l, const tpu::DecodedOp& d, const Target& out) {
      return Reduce(l, d, out, true);
    };
    (*m)["aten::copy_"] = [](Lowering& l, const tpu::DecodedOp& d, const Target& out)
        -> absl::StatusOr<std::string> {
      if (d.num_args < 2) return Unsupported(l.op(), "too few arguments");
      return l.Operand(d.args[1], out.dims, *out.type);
    };
    (*m)["aten::fill_.Scalar"] = [](Lowering& l, const tpu::DecodedOp& d, const Target& out) -> absl::StatusOr<std::string> {
      if (d.num_args < 2) return Unsupported(l.op(), "too few arguments");
      return l.Operand(d.args[1], out.dims, *out.type);
    };
    (*m)["aten::zero_"] = [](Lowering& l, const tpu::DecodedOp& d, const Target& out) -> absl::StatusOr<std::string> {
      return l.Constant(0, out.dims, *out.type);
    };
    (*m)["aten::threshold_backward"] = [](Lowering& l, const tpu::DecodedOp& d,
                                          const Target& out) -> absl::StatusOr<std::string> {
      if (d.num_args < 3) return Unsupported(l.op(), "too few arguments");
      absl::StatusOr<std::string> grad = l.Operand(d.args[0], out.dims, *out.type);
      if (!grad.ok()) return grad;
      absl::StatusOr<std::string> self = l.Operand(d.args[1], out.dims, *out.type);
      if (!self.ok()) return self;
      absl::StatusOr<std::string> thr = l.Operand(d.args[2], out.dims, *out.type);
      if (!thr.ok()) return thr;
      const DType& pred = *DTypeOf(11);
      const std::string c = l.Emit(absl::StrCat(
          "stablehlo.compare LE, ", *self, ", ", *thr, ", ",
          out.type->is_float ? "FLOAT" : "SIGNED", " : (", TypeOf(out.dims, *out.type), ", ",
          TypeOf(out.dims, *out.type), ") -> ", TypeOf(out.dims, pred)));
      return l.Emit(absl::StrCat("stablehlo.select ", c, ", ", l.Constant(0, out.dims, *out.type),
                                 ", ", *grad, " : ", TypeOf(out.dims, pred), ", ",
                                 TypeOf(out.dims, *out.type)));
    };
    // out= overloads whose names AllRules cannot derive (the out tensor is
    // the written argument, after the others).
    const std::pair<const char*, const char*> outs[] = {
        {"aten::add.out", "aten::add.Tensor"},     {"aten::sub.out", "aten::sub.Tensor"},
        {"aten::mul.out", "aten::mul.Tensor"},     {"aten::div.out", "aten::div.Tensor"},
        {"aten::sum.IntList_out", "aten::sum.dim_IntList"},
        {"aten::mean.out", "aten::mean.dim"},
        {"aten::threshold_backward.grad_input", "aten::threshold_backward"},
    };
    for (const auto& [out, functional] : outs) (*m)[out] = (*m)[functional];
    return m;
  }();
  return *rules;
}

// ---------------------------------------------------------------- more rules

bool Defined(const tpu::DecodedOp& d, size_t i) {
  return i < d.num_args && d.args[i].tag == tpu::ArgTag::kTensor;
}

int64_t WrapDim(int64_t dim, size_t n) { return dim < 0 ? dim + static_cast<int64_t>(n) : dim; }

// Dimension argument `dim` of a tensor of `rank` dimensions, wrapped
// (-1 is the last) and checked.
absl::StatusOr<int64_t> CheckedDim(const std::string& op, int64_t dim, size_t rank) {
  const int64_t w = WrapDim(dim, rank);
  if (w < 0 || w >= static_cast<int64_t>(rank)) {
    return absl::InvalidArgumentError(absl::StrCat(op, ": dim ", dim, " is out of range for a tensor of ", rank,
                                                   " dimensions (expected -", rank, " to ", static_cast<int64_t>(rank) - 1, ")"));
  }
  return w;
}

int64_t Numel(const tpu::TensorRef& r) {
  int64_t n = 1;
  for (int d = 0; d < r.ndim; ++d) n *= r.sizes[d];
  return n;
}

std::vector<int64_t> DimsOf(const tpu::TensorRef& r) {
  return std::vector<int64_t>(r.sizes, r.sizes + r.ndim);
}

double NumberOf(const tpu::OpArg& a) {
  switch (a.tag) {
    case tpu::ArgTag::kScalarInt: case tpu::ArgTag::kInt: case tpu::ArgTag::kSymInt:
      return static_cast<double>(a.i);
    case tpu::ArgTag::kScalarBool: case tpu::ArgTag::kBool: return a.b ? 1 : 0;
    default: return a.d;
  }
}

// The dimensions an op reduces over: the int list at argument `i` (every
// dimension when absent or empty), wrapped, sorted and unique.
absl::StatusOr<std::vector<int64_t>> ReducedDims(const Lowering& l, const tpu::DecodedOp& d, size_t i,
                                                 size_t rank) {
  std::vector<int64_t> which;
  const bool listed = d.num_args > i && d.args[i].tag == tpu::ArgTag::kIntList && !d.args[i].ints.empty();
  const bool one = d.num_args > i && (d.args[i].tag == tpu::ArgTag::kInt || d.args[i].tag == tpu::ArgTag::kSymInt);
  if (listed) {
    for (int64_t dim : d.args[i].ints) which.push_back(WrapDim(dim, rank));
  } else if (one) {
    which.push_back(WrapDim(d.args[i].i, rank));
  } else {
    for (size_t k = 0; k < rank; ++k) which.push_back(static_cast<int64_t>(k));
  }
  std::sort(which.begin(), which.end());
  which.erase(std::unique(which.begin(), which.end()), which.end());
  for (int64_t w : which) {
    if (rank > 0 && (w < 0 || w >= static_cast<int64_t>(rank))) {
      return absl::InvalidArgumentError(absl::StrCat(l.op(), ": dim out of range"));
    }
  }
  if (rank == 0) which.clear();  // a 0-d tensor: dim 0 / -1 is itself
  return which;
}

int64_t CountOf(const std::vector<int64_t>& in, const std::vector<int64_t>& which) {
  int64_t n = 1;
  for (int64_t w : which) n *= in[w];
  return n;
}


// A convolution's window: its spatial dimensions and, from the arguments
// at `first` on (stride, padding, dilation, transposed, output_padding,
// groups, as convolution and convolution_backward take them), one stride,
// padding and dilation per spatial dimension. `in` is the input's dims, `wd`
// the weight's and `other` the third tensor's (the output or the gradient).
struct ConvWindow {
  size_t sp = 0;
  std::vector<int64_t> stride, pad, dilation, output_padding;
  int64_t groups = 1;
  bool transposed = false;
};

absl::StatusOr<ConvWindow> ConvWindowOf(const Lowering& l, const tpu::DecodedOp& d, size_t first,
                                        const std::vector<int64_t>& in, const std::vector<int64_t>& wd,
                                        const std::vector<int64_t>& other, bool allow_transposed = false) {
  if (d.num_args < first + 6) return Unsupported(l.op(), "arguments of a form not lowered");
  const tpu::OpArg& transposed = d.args[first + 3];
  ConvWindow w;
  w.transposed = transposed.tag == tpu::ArgTag::kBool && transposed.b;
  if (w.transposed && !allow_transposed) return Unsupported(l.op(), "transposed convolution");
  w.sp = in.size() < 3 ? 0 : in.size() - 2;
  if (w.sp == 0 || w.sp > 3 || wd.size() != in.size() || other.size() != in.size()) {
    return Unsupported(l.op(), "expects a batched input of 1 to 3 spatial dimensions");
  }
  auto list = [&](size_t i, int64_t dflt) {
    std::vector<int64_t> v = d.args[i].tag == tpu::ArgTag::kIntList ? d.args[i].ints : std::vector<int64_t>{};
    if (v.empty()) v.push_back(dflt);
    while (v.size() < w.sp) v.push_back(v.back());
    v.resize(w.sp);
    return v;
  };
  w.stride = list(first, 1);
  w.pad = list(first + 1, 0);
  w.dilation = list(first + 2, 1);
  w.output_padding = list(first + 4, 0);
  const tpu::OpArg& groups = d.args[first + 5];
  if (groups.tag == tpu::ArgTag::kInt || groups.tag == tpu::ArgTag::kSymInt) w.groups = groups.i;
  if (w.groups < 1 || in[1] % w.groups != 0) return Unsupported(l.op(), "groups must divide the input's channels");
  return w;
}

// log_softmax / softmax over `dim` of x (dims `in`, type t).
std::string SoftmaxOf(Lowering& l, const std::string& x, const std::vector<int64_t>& in,
                      int64_t dim, const DType& t, bool log) {
  const std::vector<int64_t> which = {dim};
  const std::string m = l.ReduceOver(x, in, which, "maximum", l.Lowest(t), t);
  const std::string xm = l.Binary("subtract", x, l.Expand(m, in, which, t), in, t);
  const std::string e = l.Unary("exponential", xm, in, t);
  const std::string sum = l.ReduceOver(e, in, which, "add", l.Constant(0, {}, t), t);
  if (log) {
    return l.Binary("subtract", xm, l.Expand(l.Unary("log", sum, Lowering::Kept(in, which), t),
                                             in, which, t), in, t);
  }
  return l.Binary("divide", e, l.Expand(sum, in, which, t), in, t);
}

// erf(x) for gelu: Abramowitz & Stegun 7.1.26 (absolute error below 1.5e-7).
std::string Erf(Lowering& l, const std::string& x, const std::vector<int64_t>& d, const DType& t) {
  auto c = [&](double v) { return l.Constant(v, d, t); };
  const std::string ax = l.Unary("abs", x, d, t);
  const std::string tt = l.Binary("divide", c(1), l.Binary("add", c(1), l.Binary("multiply", c(0.3275911), ax, d, t), d, t), d, t);
  std::string poly = c(1.061405429);
  for (double k : {-1.453152027, 1.421413741, -0.284496736, 0.254829592}) {
    poly = l.Binary("add", l.Binary("multiply", poly, tt, d, t), c(k), d, t);
  }
  poly = l.Binary("multiply", poly, tt, d, t);
  const std::string e = l.Unary("exponential", l.Unary("negate", l.Binary("multiply", ax, ax, d, t), d, t), d, t);
  const std::string y = l.Binary("subtract", c(1), l.Binary("multiply", poly, e, d, t), d, t);
  return l.Binary("multiply", l.Unary("sign", x, d, t), y, d, t);
}

std::string GeluCdf(Lowering& l, const std::string& x, const std::vector<int64_t>& d, const DType& t) {
  const std::string z = l.Binary("multiply", x, l.Constant(0.70710678118654752, d, t), d, t);
  return l.Binary("multiply", l.Constant(0.5, d, t),
                  l.Binary("add", l.Constant(1, d, t), Erf(l, z, d, t), d, t), d, t);
}

// gelu's approximate= argument (at i): false for "none", true for "tanh".
absl::StatusOr<bool> TanhGelu(const Lowering& l, const tpu::DecodedOp& d, size_t i) {
  if (i >= d.num_args || d.args[i].tag != tpu::ArgTag::kString || d.args[i].s == "none") return false;
  if (d.args[i].s == "tanh") return true;
  return Unsupported(l.op(), "approximate=\"" + d.args[i].s + "\" is not lowered");
}

// tanh(sqrt(2 / pi) * (x + 0.044715 x^3)), of the tanh approximation.
std::string GeluTanhInner(Lowering& l, const std::string& x, const std::vector<int64_t>& d, const DType& t) {
  const std::string x3 = l.Binary("multiply", l.Binary("multiply", x, x, d, t), x, d, t);
  const std::string u = l.Binary("add", x, l.Binary("multiply", l.Constant(0.044715, d, t), x3, d, t), d, t);
  return l.Unary("tanh", l.Binary("multiply", l.Constant(0.79788456080286536, d, t), u, d, t), d, t);
}

// The element of each row its target picks, as a mask (one-hot, and the
// target not ignore_index), weighted: x (N, C), target (N).
struct Picked {
  std::string mask;  // (N, C) of t: the picked entries, times their class weight
  std::string row_weight;  // (N) of t: the weight of each row's target, 0 when ignored
};
absl::StatusOr<Picked> PickTargets(Lowering& l, const tpu::DecodedOp& d, size_t target_i,
                                   size_t weight_i, size_t ignore_i,
                                   const std::vector<int64_t>& nc, const DType& t) {
  const tpu::OpArg& target = d.args[target_i];
  // (An unbatched input comes as one row, its target 0-d.)
  if (target.tag != tpu::ArgTag::kTensor || (target.tensor.ndim != 1 && !(target.tensor.ndim == 0 && nc[0] == 1))) {
    return Unsupported(l.op(), "expects a 2-d input and a 1-d target");
  }
  const DType& i64 = I64();
  absl::StatusOr<std::string> t1 = l.OperandRef(target.tensor, l.TensorIndex(target), {nc[0]}, i64);
  if (!t1.ok()) return t1.status();
  // The target along the classes: dims = [0].
  absl::StatusOr<std::string> tg = l.Emit(absl::StrCat(
      "stablehlo.broadcast_in_dim ", *t1, ", dims = [0] : (", TypeOf({nc[0]}, i64), ") -> ",
      TypeOf(nc, i64)));
  const std::string iota = l.Iota(1, nc, i64);
  std::string onehot = l.Compare("EQ", *tg, iota, nc, i64);
  const int64_t ignore = ignore_i < d.num_args ? static_cast<int64_t>(NumberOf(d.args[ignore_i])) : -100;
  const std::string keep = l.Compare("NE", *tg, l.Constant(static_cast<double>(ignore), nc, i64), nc, i64);
  onehot = l.Emit(absl::StrCat("stablehlo.and ", onehot, ", ", keep, " : ", TypeOf(nc, *DTypeOf(11))));
  std::string mask = l.Convert(onehot, nc, *DTypeOf(11), t);
  if (Defined(d, weight_i)) {
    const tpu::TensorRef& w = d.args[weight_i].tensor;
    absl::StatusOr<std::string> wv = l.OperandRef(w, l.TensorIndex(d.args[weight_i]), nc, t);
    if (!wv.ok()) return wv.status();
    mask = l.Binary("multiply", mask, *wv, nc, t);
  }
  Picked p;
  p.mask = mask;
  p.row_weight = l.ReduceOver(mask, nc, {1}, "add", l.Constant(0, {}, t), t);
  return p;
}

std::string Running(Lowering& l, const std::string& x, const std::vector<int64_t>& in, int64_t dim,
                    const char* op, double init, const DType& t, const std::string& init_value = "");

// The p-norm of `diff` (|a - b|, dims `full`) over dimension `axis`:
// the count of nonzero entries for p = 0, the largest for infinity.
std::string PNorm(Lowering& l, const std::string& diff, const std::vector<int64_t>& full, int64_t axis, double p,
                  const DType& t) {
  const std::vector<int64_t> kept = Lowering::Kept(full, {axis});
  const std::string zero = l.Constant(0, {}, t);
  if (p == 0) {
    const std::string nz = l.Select(l.Compare("NE", diff, l.Constant(0, full, t), full, t), l.Constant(1, full, t),
                                    l.Constant(0, full, t), full, t);
    return l.ReduceOver(nz, full, {axis}, "add", zero, t);
  }
  if (std::isinf(p)) return l.ReduceOver(diff, full, {axis}, "maximum", zero, t);
  if (p == 1) return l.ReduceOver(diff, full, {axis}, "add", zero, t);
  if (p == 2) return l.Unary("sqrt", l.ReduceOver(l.Binary("multiply", diff, diff, full, t), full, {axis}, "add", zero, t), kept, t);
  const std::string sum = l.ReduceOver(l.Binary("power", diff, l.Constant(p, full, t), full, t), full, {axis}, "add", zero, t);
  return l.Binary("power", sum, l.Constant(1.0 / p, kept, t), kept, t);
}

// 1-d: `into` (n elements) with `what` (m elements) written, or added, at
// the positions `at` (i64, m).
std::string ScatterFlat(Lowering& l, const std::string& into, int64_t n, const std::string& at, const std::string& what,
                        int64_t m, bool add, const DType& t) {
  const DType& i64 = I64();
  const std::string scalar = TypeOf({}, t);
  return l.Emit(absl::StrCat(
      "\"stablehlo.scatter\"(", into, ", ", l.Reshape(at, {m}, {m, 1}, i64), ", ", what, ") ({\n",
      "    ^bb0(%old: ", scalar, ", %new: ", scalar, "):\n",
      add ? absl::StrCat("      %sum = stablehlo.add %old, %new : ", scalar, "\n      stablehlo.return %sum : ", scalar, "\n")
          : absl::StrCat("      stablehlo.return %new : ", scalar, "\n"),
      "    }) {indices_are_sorted = false, scatter_dimension_numbers = #stablehlo.scatter<inserted_window_dims = [0], ",
      "scatter_dims_to_operand_dims = [0], index_vector_dim = 1>, unique_indices = false} : (", TypeOf({n}, t), ", ",
      TypeOf({m, 1}, i64), ", ", TypeOf({m}, t), ") -> ", TypeOf({n}, t)));
}

// Whether input i of n falls in adaptive window o of out (dims `dims`,
// o along `out_axis`, i along `in_axis`): [floor(o n / out),
// ceil((o + 1) n / out)).
std::string AdaptiveWindow(Lowering& l, const std::vector<int64_t>& dims, int64_t out_axis, int64_t in_axis, int64_t n,
                           int64_t out) {
  const DType& i64 = I64();
  auto c = [&](double v) { return l.Constant(v, dims, i64); };
  const std::string oi = l.Iota(out_axis, dims, i64), ii = l.Iota(in_axis, dims, i64);
  const std::string start = l.Binary("divide", l.Binary("multiply", oi, c(static_cast<double>(n)), dims, i64),
                                     c(static_cast<double>(out)), dims, i64);
  const std::string end = l.Binary(
      "divide",
      l.Binary("add", l.Binary("multiply", l.Binary("add", oi, c(1), dims, i64), c(static_cast<double>(n)), dims, i64),
               c(static_cast<double>(out - 1)), dims, i64),
      c(static_cast<double>(out)), dims, i64);
  return l.Binary("and", l.Compare("GE", ii, start, dims, i64), l.Compare("LT", ii, end, dims, i64), dims, *DTypeOf(11));
}

// ---------------------------------------------------------------- linear algebra
// Matrices are the last two dimensions; the ones before are a batch.

// v (dims `in`) with the other triangle zeroed: the lower (i >= j) or upper
// one kept.
std::string Triangle(Lowering& l, const std::string& v, const std::vector<int64_t>& in, bool lower, const DType& t) {
  const DType& i64 = I64();
  const int64_t r = static_cast<int64_t>(in.size());
  const std::string i = l.Iota(r - 2, in, i64), j = l.Iota(r - 1, in, i64);
  const std::string keep = l.Compare(lower ? "GE" : "LE", i, j, in, i64);
  return l.Select(keep, v, l.Constant(0, in, t), in, t);
}

// Cholesky factor of v (dims `in`): lower, or upper (L^T), the other
// triangle zero.
std::string Cholesky(Lowering& l, const std::string& v, const std::vector<int64_t>& in, bool upper, const DType& t) {
  const std::string c = l.Emit(absl::StrCat("stablehlo.cholesky ", v, ", lower = ", upper ? "false" : "true", " : ",
                                            TypeOf(in, t)));
  return Triangle(l, c, in, !upper, t);
}

// X with op(A) X = B (left) or X op(A) = B: A triangular (dims `ad`), B of
// dims `bd`, both already broadcast to one batch.
std::string TriangularSolve(Lowering& l, const std::string& a, const std::vector<int64_t>& ad, const std::string& b,
                            const std::vector<int64_t>& bd, bool left, bool lower, bool unit, bool transpose,
                            const DType& t) {
  return l.Emit(absl::StrCat("\"stablehlo.triangular_solve\"(", a, ", ", b, ") {left_side = ", left ? "true" : "false",
                             ", lower = ", lower ? "true" : "false", ", unit_diagonal = ", unit ? "true" : "false",
                             ", transpose_a = #stablehlo<transpose ", transpose ? "TRANSPOSE" : "NO_TRANSPOSE", ">} : (",
                             TypeOf(ad, t), ", ", TypeOf(bd, t), ") -> ", TypeOf(bd, t)));
}

// dims with the batch (all but the last two) replaced by `batch`.
std::vector<int64_t> WithBatch(const std::vector<int64_t>& dims, const std::vector<int64_t>& batch) {
  std::vector<int64_t> r = batch;
  r.insert(r.end(), dims.end() - 2, dims.end());
  return r;
}

// A matrix operand broadcast over `batch`, of type t.
absl::StatusOr<std::string> MatrixOperand(Lowering& l, const tpu::OpArg& a, const std::vector<int64_t>& batch,
                                          const DType& t) {
  if (a.tag != tpu::ArgTag::kTensor || a.tensor.ndim < 2) return Unsupported(l.op(), "expects a matrix or a batch of them");
  const std::vector<int64_t> dims = DimsOf(a.tensor);
  absl::StatusOr<std::string> v = l.Operand(a, dims, t);
  if (!v.ok()) return v;
  return l.BroadcastTo(*v, dims, WithBatch(dims, batch), t);
}

// The batch of an output of dims `dims`.
std::vector<int64_t> BatchOf(const std::vector<int64_t>& dims) {
  return dims.size() < 2 ? std::vector<int64_t>{} : std::vector<int64_t>(dims.begin(), dims.end() - 2);
}

// An identity matrix of dims `dims` (the last two equal).
std::string Identity(Lowering& l, const std::vector<int64_t>& dims, const DType& t) {
  const DType& i64 = I64();
  const int64_t r = static_cast<int64_t>(dims.size());
  const std::string eq = l.Compare("EQ", l.Iota(r - 2, dims, i64), l.Iota(r - 1, dims, i64), dims, i64);
  return l.Select(eq, l.Constant(1, dims, t), l.Constant(0, dims, t), dims, t);
}

// v (dims `from`) broadcast to `to`, its dimension q going to map[q].
std::string BroadcastInDim(Lowering& l, const std::string& v, const std::vector<int64_t>& from,
                           const std::vector<int64_t>& to, const std::vector<int64_t>& map, const DType& t) {
  if (from == to) return v;
  return l.Emit(absl::StrCat("stablehlo.broadcast_in_dim ", v, ", dims = [", absl::StrJoin(map, ", "), "] : (",
                             TypeOf(from, t), ") -> ", TypeOf(to, t)));
}

// The shapes of a batch of matrices (dims = batch + [m, n]) and the maps
// that broadcast a per-matrix value, a column (length m) or a row (length
// n) over it.
struct MatrixShape {
  std::vector<int64_t> dims, batch, col, row;
  std::vector<int64_t> batch_map, col_map, row_map;
  int64_t m = 0, n = 0;
  explicit MatrixShape(const std::vector<int64_t>& d) : dims(d), batch(BatchOf(d)) {
    const int64_t r = static_cast<int64_t>(d.size());
    m = d[r - 2];
    n = d[r - 1];
    col = batch;
    col.push_back(m);
    row = batch;
    row.push_back(n);
    for (int64_t q = 0; q < r - 2; ++q) batch_map.push_back(q);
    col_map = batch_map;
    col_map.push_back(r - 2);
    row_map = batch_map;
    row_map.push_back(r - 1);
  }
  int64_t rank() const { return static_cast<int64_t>(dims.size()); }
};

// The rows `j` and `p` (i64 per matrix, dims batch) of x swapped.
std::string SwapRows(Lowering& l, const std::string& x, const MatrixShape& s, const std::string& j,
                     const std::string& p, const DType& t) {
  const DType& i64 = I64();
  const std::string ri = l.Iota(s.rank() - 2, s.dims, i64);
  const std::string at_j = l.Compare("EQ", ri, BroadcastInDim(l, j, s.batch, s.dims, s.batch_map, i64), s.dims, i64);
  const std::string at_p = l.Compare("EQ", ri, BroadcastInDim(l, p, s.batch, s.dims, s.batch_map, i64), s.dims, i64);
  const std::string zero = l.Constant(0, s.dims, t);
  const int64_t rows = s.rank() - 2;
  const std::string row_j = l.ReduceOver(l.Select(at_j, x, zero, s.dims, t), s.dims, {rows}, "add", l.Constant(0, {}, t), t);
  const std::string row_p = l.ReduceOver(l.Select(at_p, x, zero, s.dims, t), s.dims, {rows}, "add", l.Constant(0, {}, t), t);
  const std::string bj = BroadcastInDim(l, row_j, s.row, s.dims, s.row_map, t);
  const std::string bp = BroadcastInDim(l, row_p, s.row, s.dims, s.row_map, t);
  return l.Select(at_j, bp, l.Select(at_p, bj, x, s.dims, t), s.dims, t);
}

// A counted loop: `count` iterations of `step` over (j, state...), j from 0.
// `step` emits the next state from j (an i64 scalar) and the current state.
std::vector<std::string> CountedLoop(Lowering& l, int64_t count, const std::vector<std::string>& init,
                                     const std::vector<std::string>& types,
                                     const std::function<std::vector<std::string>(const std::string& j,
                                                                                  const std::vector<std::string>& state)>& step) {
  const DType& i64 = I64();
  const int id = l.NextId();
  const std::string j = absl::StrCat("%w", id, "j");
  std::vector<std::string> args, inits = {absl::StrCat(j, " = ", l.Constant(0, {}, i64))};
  for (size_t q = 0; q < init.size(); ++q) {
    args.push_back(absl::StrCat("%w", id, "s", q));
    inits.push_back(absl::StrCat(args.back(), " = ", init[q]));
  }
  std::vector<std::string> all_types = {TypeOf({}, i64)};
  all_types.insert(all_types.end(), types.begin(), types.end());
  std::string going;
  const std::string cond = l.Region([&] { going = l.Compare("LT", j, l.Constant(static_cast<double>(count), {}, i64), {}, i64); });
  std::vector<std::string> next;
  const std::string body = l.Region([&] {
    next = step(j, args);
    next.insert(next.begin(), l.Binary("add", j, l.Constant(1, {}, i64), {}, i64));
  });
  const std::string ts = absl::StrJoin(all_types, ", ");
  const std::string loop = l.EmitResults(absl::StrCat(
      "stablehlo.while(", absl::StrJoin(inits, ", "), ") : ", ts, "\n    cond {\n", cond, "      stablehlo.return ", going,
      " : tensor<i1>\n    } do {\n", body, "      stablehlo.return ", absl::StrJoin(next, ", "), " : ", ts, "\n    }"),
      static_cast<int>(all_types.size()));
  std::vector<std::string> out;
  for (size_t q = 0; q < init.size(); ++q) out.push_back(absl::StrCat(loop, "#", q + 1));
  return out;
}

// LU factorization with partial pivoting, as LAPACK's getrf: for each
// column j, the first row at or below j of the largest magnitude is swapped
// up, the column below is scaled by the pivot's reciprocal, and the
// trailing block updated. Returns LU, the 1-based pivots (i64, batch +
// [min(m, n)]) and info (i64, batch: the first zero pivot's 1-based order,
// else 0).
struct Lu {
  std::string lu, pivots, info;
};
Lu LuFactor(Lowering& l, const std::string& a, const MatrixShape& s, const DType& t) {
  const DType& i64 = I64();
  const DType& i1 = *DTypeOf(11);
  const int64_t k = std::min(s.m, s.n);
  std::vector<int64_t> pdims = s.batch;
  pdims.push_back(k);
  const int64_t rows = s.rank() - 2, cols = s.rank() - 1;
  const std::vector<std::string> state = CountedLoop(
      l, k, {a, l.Constant(0, pdims, i64), l.Constant(0, s.batch, i64)},
      {TypeOf(s.dims, t), TypeOf(pdims, i64), TypeOf(s.batch, i64)},
      [&](const std::string& j, const std::vector<std::string>& st) {
        const std::string& x = st[0];
        const std::string jd = l.BroadcastTo(j, {}, s.dims, i64), jc = l.BroadcastTo(j, {}, s.col, i64);
        const std::string ri = l.Iota(rows, s.dims, i64), ci = l.Iota(cols, s.dims, i64);
        const std::string is_col = l.Compare("EQ", ci, jd, s.dims, i64);
        const std::string zero = l.Constant(0, s.dims, t), zs = l.Constant(0, {}, t);
        // Column j, and the first row at or below j of its largest magnitude.
        const std::string colv = l.ReduceOver(l.Select(is_col, x, zero, s.dims, t), s.dims, {cols}, "add", zs, t);
        const std::string below = l.Compare("GE", l.Iota(rows, s.col, i64), jc, s.col, i64);
        const std::string mag = l.Select(below, l.Unary("abs", colv, s.col, t), l.Constant(-1, s.col, t), s.col, t);
        const std::string top = l.ReduceOver(mag, s.col, {rows}, "maximum", l.Lowest(t), t);
        const std::string hit = l.Compare("EQ", mag, BroadcastInDim(l, top, s.batch, s.col, s.batch_map, t), s.col, t);
        const std::string p = l.ReduceOver(l.Select(hit, l.Iota(rows, s.col, i64), l.Constant(static_cast<double>(s.m), s.col, i64), s.col, i64),
                                           s.col, {rows}, "minimum", l.Constant(static_cast<double>(s.m), {}, i64), i64);
        // (A column of NaN has no largest: it keeps row j.)
        const std::string pj = l.Select(l.Compare("LT", p, l.Constant(static_cast<double>(s.m), s.batch, i64), s.batch, i64), p,
                                        l.BroadcastTo(j, {}, s.batch, i64), s.batch, i64);
        const std::string x1 = SwapRows(l, x, s, l.BroadcastTo(j, {}, s.batch, i64), pj, t);
        const std::string colv1 = l.ReduceOver(l.Select(is_col, x1, zero, s.dims, t), s.dims, {cols}, "add", zs, t);
        const std::string at_j = l.Compare("EQ", l.Iota(rows, s.col, i64), jc, s.col, i64);
        const std::string pv = l.ReduceOver(l.Select(at_j, colv1, l.Constant(0, s.col, t), s.col, t), s.col, {rows}, "add", zs, t);
        const std::string nonzero = l.Compare("NE", pv, l.Constant(0, s.batch, t), s.batch, t);
        const std::string inv = l.Binary("divide", l.Constant(1, s.batch, t), pv, s.batch, t);
        const std::string scaled = l.Binary("multiply", colv1, BroadcastInDim(l, inv, s.batch, s.col, s.batch_map, t), s.col, t);
        const std::string lcol = l.Select(BroadcastInDim(l, nonzero, s.batch, s.col, s.batch_map, i1), scaled, colv1, s.col, t);
        const std::string row_j = l.ReduceOver(l.Select(l.Compare("EQ", ri, jd, s.dims, i64), x1, zero, s.dims, t), s.dims, {rows},
                                               "add", zs, t);
        const std::string lb = BroadcastInDim(l, lcol, s.col, s.dims, s.col_map, t);
        const std::string rb = BroadcastInDim(l, row_j, s.row, s.dims, s.row_map, t);
        const std::string below_j = l.Compare("GT", ri, jd, s.dims, i64);
        const std::string right_j = l.Compare("GT", ci, jd, s.dims, i64);
        const std::string trailing = l.Binary("and", below_j, right_j, s.dims, i1);
        std::string x2 = l.Select(trailing, l.Binary("subtract", x1, l.Binary("multiply", lb, rb, s.dims, t), s.dims, t), x1, s.dims, t);
        x2 = l.Select(l.Binary("and", below_j, is_col, s.dims, i1), lb, x2, s.dims, t);
        const std::string is_k = l.Compare("EQ", l.Iota(static_cast<int64_t>(pdims.size() - 1), pdims, i64),
                                           l.BroadcastTo(j, {}, pdims, i64), pdims, i64);
        const std::string one_based = l.Binary("add", pj, l.Constant(1, s.batch, i64), s.batch, i64);
        const std::string piv = l.Select(is_k, BroadcastInDim(l, one_based, s.batch, pdims, s.batch_map, i64), st[1], pdims, i64);
        const std::string first = l.Binary("and", l.Compare("EQ", st[2], l.Constant(0, s.batch, i64), s.batch, i64),
                                           l.Unary("not", nonzero, s.batch, i1), s.batch, i1);
        const std::string info = l.Select(first, l.Binary("add", l.BroadcastTo(j, {}, s.batch, i64), l.Constant(1, s.batch, i64), s.batch, i64),
                                          st[2], s.batch, i64);
        return std::vector<std::string>{x2, piv, info};
      });
  return {state[0], state[1], state[2]};
}

// x (dims `s`, m = the pivots' length or more) with LAPACK's row swaps
// applied: row j with row pivots[j] - 1, for j in order (reversed: undone).
std::string ApplySwaps(Lowering& l, const std::string& x, const MatrixShape& s, const std::string& pivots, int64_t k,
                       bool reversed, const DType& t) {
  const DType& i64 = I64();
  std::vector<int64_t> pdims = s.batch;
  pdims.push_back(k);
  return CountedLoop(l, k, {x}, {TypeOf(s.dims, t)}, [&](const std::string& step, const std::vector<std::string>& st) {
    const std::string j = reversed ? l.Binary("subtract", l.Constant(static_cast<double>(k - 1), {}, i64), step, {}, i64) : step;
    const std::string is_j = l.Compare("EQ", l.Iota(static_cast<int64_t>(pdims.size() - 1), pdims, i64), l.BroadcastTo(j, {}, pdims, i64),
                                       pdims, i64);
    const std::string p = l.ReduceOver(l.Select(is_j, pivots, l.Constant(0, pdims, i64), pdims, i64), pdims,
                                       {static_cast<int64_t>(pdims.size() - 1)}, "add", l.Constant(0, {}, i64), i64);
    const std::string p0 = l.Binary("subtract", p, l.Constant(1, s.batch, i64), s.batch, i64);
    return std::vector<std::string>{SwapRows(l, st[0], s, l.BroadcastTo(j, {}, s.batch, i64), p0, t)};
  })[0];
}

// Solves A X = B from A's LU and pivots (B: dims `bs`, its batch A's).
std::string LuSolve(Lowering& l, const std::string& lu, const std::vector<int64_t>& ad, const std::string& pivots,
                    const std::string& b, const MatrixShape& bs, bool adjoint, const DType& t) {
  const int64_t n = ad.back();
  if (!adjoint) {
    const std::string pb = ApplySwaps(l, b, bs, pivots, n, false, t);
    const std::string y = TriangularSolve(l, lu, ad, pb, bs.dims, true, true, true, false, t);
    return TriangularSolve(l, lu, ad, y, bs.dims, true, false, false, false, t);
  }
  // A^T X = B: U^T L^T P^T X = B.
  const std::string y = TriangularSolve(l, lu, ad, b, bs.dims, true, false, false, true, t);
  const std::string z = TriangularSolve(l, lu, ad, y, bs.dims, true, true, true, true, t);
  return ApplySwaps(l, z, bs, pivots, n, true, t);
}

// The Householder vector of column j of a (LAPACK's storage: 1 at row j,
// a's column below it), for rows at or below j, zero above.
std::string ReflectorOf(Lowering& l, const std::string& a, const MatrixShape& s, const std::string& j, const DType& t) {
  const DType& i64 = I64();
  const int64_t rows = s.rank() - 2, cols = s.rank() - 1;
  const std::string jd = l.BroadcastTo(j, {}, s.dims, i64);
  const std::string colv = l.ReduceOver(l.Select(l.Compare("EQ", l.Iota(cols, s.dims, i64), jd, s.dims, i64), a,
                                                 l.Constant(0, s.dims, t), s.dims, t),
                                        s.dims, {cols}, "add", l.Constant(0, {}, t), t);
  const std::string ri = l.Iota(rows, s.col, i64), jc = l.BroadcastTo(j, {}, s.col, i64);
  return l.Select(l.Compare("GT", ri, jc, s.col, i64), colv,
                  l.Select(l.Compare("EQ", ri, jc, s.col, i64), l.Constant(1, s.col, t), l.Constant(0, s.col, t), s.col, t), s.col, t);
}

// (I - tau v v^T) c: v a column (dims cs.col), tau one per matrix.
std::string Reflect(Lowering& l, const std::string& c, const MatrixShape& cs, const std::string& v, const std::string& tau,
                    const DType& t) {
  const int64_t rows = cs.rank() - 2;
  const std::string vb = BroadcastInDim(l, v, cs.col, cs.dims, cs.col_map, t);
  const std::string w = l.ReduceOver(l.Binary("multiply", vb, c, cs.dims, t), cs.dims, {rows}, "add", l.Constant(0, {}, t), t);
  const std::string tw = l.Binary("multiply", BroadcastInDim(l, tau, cs.batch, cs.row, cs.batch_map, t), w, cs.row, t);
  return l.Binary("subtract", c, l.Binary("multiply", vb, BroadcastInDim(l, tw, cs.row, cs.dims, cs.row_map, t), cs.dims, t),
                  cs.dims, t);
}

// Element j of per-matrix vectors (dims batch + [k]).
std::string ElementAt(Lowering& l, const std::string& v, const std::vector<int64_t>& vd, const std::string& j, const DType& t) {
  const DType& i64 = I64();
  const int64_t last = static_cast<int64_t>(vd.size() - 1);
  return l.ReduceOver(l.Select(l.Compare("EQ", l.Iota(last, vd, i64), l.BroadcastTo(j, {}, vd, i64), vd, i64), v,
                               l.Constant(0, vd, t), vd, t),
                      vd, {last}, "add", l.Constant(0, {}, t), t);
}

// QR by Householder reflections, as LAPACK's geqrf stores it: R on and
// above the diagonal, each reflector's vector below it, and tau.
struct Qr {
  std::string a, tau;
};
Qr Geqrf(Lowering& l, const std::string& a, const MatrixShape& s, const DType& t) {
  const DType& i64 = I64();
  const DType& i1 = *DTypeOf(11);
  const int64_t k = std::min(s.m, s.n);
  std::vector<int64_t> td = s.batch;
  td.push_back(k);
  const int64_t rows = s.rank() - 2, cols = s.rank() - 1;
  const std::vector<std::string> st = CountedLoop(
      l, k, {a, l.Constant(0, td, t)}, {TypeOf(s.dims, t), TypeOf(td, t)},
      [&](const std::string& j, const std::vector<std::string>& state) {
        const std::string& x = state[0];
        const std::string jd = l.BroadcastTo(j, {}, s.dims, i64), jc = l.BroadcastTo(j, {}, s.col, i64);
        const std::string ri = l.Iota(rows, s.col, i64);
        const std::string colv = l.ReduceOver(l.Select(l.Compare("EQ", l.Iota(cols, s.dims, i64), jd, s.dims, i64), x,
                                                       l.Constant(0, s.dims, t), s.dims, t),
                                              s.dims, {cols}, "add", l.Constant(0, {}, t), t);
        const std::string zc = l.Constant(0, s.col, t), zs = l.Constant(0, {}, t);
        const std::string alpha = l.ReduceOver(l.Select(l.Compare("EQ", ri, jc, s.col, i64), colv, zc, s.col, t), s.col, {rows}, "add", zs, t);
        const std::string tail = l.Select(l.Compare("GT", ri, jc, s.col, i64), colv, zc, s.col, t);
        const std::string xnorm = l.Unary("sqrt", l.ReduceOver(l.Binary("multiply", tail, tail, s.col, t), s.col, {rows}, "add", zs, t), s.batch, t);
        const std::string norm = l.Unary("sqrt", l.Binary("add", l.Binary("multiply", alpha, alpha, s.batch, t),
                                                          l.Binary("multiply", xnorm, xnorm, s.batch, t), s.batch, t), s.batch, t);
        // beta = -sign(alpha) * |(alpha, xnorm)|
        const std::string neg = l.Compare("LT", alpha, l.Constant(0, s.batch, t), s.batch, t);
        const std::string beta = l.Select(neg, norm, l.Unary("negate", norm, s.batch, t), s.batch, t);
        const std::string plain = l.Compare("EQ", xnorm, l.Constant(0, s.batch, t), s.batch, t);
        const std::string tau = l.Select(plain, l.Constant(0, s.batch, t),
                                         l.Binary("divide", l.Binary("subtract", beta, alpha, s.batch, t), beta, s.batch, t), s.batch, t);
        const std::string inv = l.Binary("divide", l.Constant(1, s.batch, t), l.Binary("subtract", alpha, beta, s.batch, t), s.batch, t);
        const std::string scaled = l.Binary("multiply", tail, BroadcastInDim(l, inv, s.batch, s.col, s.batch_map, t), s.col, t);
        const std::string vtail = l.Select(BroadcastInDim(l, plain, s.batch, s.col, s.batch_map, i1), tail, scaled, s.col, t);
        const std::string v = l.Select(l.Compare("EQ", ri, jc, s.col, i64), l.Constant(1, s.col, t), vtail, s.col, t);
        // The trailing columns reflected; column j becomes beta over v.
        const std::string reflected = Reflect(l, x, s, v, tau, t);
        const std::string cj = l.Iota(cols, s.dims, i64), rj = l.Iota(rows, s.dims, i64);
        std::string x2 = l.Select(l.Compare("GT", cj, jd, s.dims, i64), reflected, x, s.dims, t);
        const std::string newcol = l.Select(l.Compare("EQ", ri, jc, s.col, i64),
                                            l.Select(BroadcastInDim(l, plain, s.batch, s.col, s.batch_map, i1),
                                                     BroadcastInDim(l, alpha, s.batch, s.col, s.batch_map, t),
                                                     BroadcastInDim(l, beta, s.batch, s.col, s.batch_map, t), s.col, t),
                                            vtail, s.col, t);
        const std::string at_col = l.Binary("and", l.Compare("EQ", cj, jd, s.dims, i64), l.Compare("GE", rj, jd, s.dims, i64), s.dims, i1);
        x2 = l.Select(at_col, BroadcastInDim(l, newcol, s.col, s.dims, s.col_map, t), x2, s.dims, t);
        const std::string taus = l.Select(l.Compare("EQ", l.Iota(static_cast<int64_t>(td.size() - 1), td, i64), l.BroadcastTo(j, {}, td, i64), td, i64),
                                          BroadcastInDim(l, tau, s.batch, td, s.batch_map, t), state[1], td, t);
        return std::vector<std::string>{x2, taus};
      });
  return {st[0], st[1]};
}

// H_0 ... H_{k-1} c (reversed = false applies H_{k-1} first), or
// H_{k-1} ... H_0 c (transposed): the reflectors of `a` (dims `as`) and
// tau (batch + [k]).
std::string ApplyQ(Lowering& l, const std::string& a, const MatrixShape& as, const std::string& tau, int64_t k,
                   const std::string& c, const MatrixShape& cs, bool transposed, const DType& t) {
  const DType& i64 = I64();
  std::vector<int64_t> td = as.batch;
  td.push_back(k);
  return CountedLoop(l, k, {c}, {TypeOf(cs.dims, t)}, [&](const std::string& step, const std::vector<std::string>& st) {
    const std::string j = transposed ? step : l.Binary("subtract", l.Constant(static_cast<double>(k - 1), {}, i64), step, {}, i64);
    const std::string v = ReflectorOf(l, a, as, j, t);
    return std::vector<std::string>{Reflect(l, st[0], cs, v, ElementAt(l, tau, td, j, t), t)};
  })[0];
}

// +1 or -1 per matrix: the parity of the row swaps the pivots record.
std::string SwapSign(Lowering& l, const std::string& pivots, const std::vector<int64_t>& batch, int64_t k, const DType& t) {
  const DType& i64 = I64();
  std::vector<int64_t> pdims = batch;
  pdims.push_back(k);
  const int64_t last = static_cast<int64_t>(pdims.size() - 1);
  const std::string moved = l.Compare("NE", pivots, l.Binary("add", l.Iota(last, pdims, i64), l.Constant(1, pdims, i64), pdims, i64),
                                      pdims, i64);
  const std::string count = l.ReduceOver(l.Select(moved, l.Constant(1, pdims, i64), l.Constant(0, pdims, i64), pdims, i64), pdims,
                                         {last}, "add", l.Constant(0, {}, i64), i64);
  const std::string odd = l.Compare("EQ", l.Binary("remainder", count, l.Constant(2, batch, i64), batch, i64),
                                    l.Constant(1, batch, i64), batch, i64);
  return l.Select(odd, l.Constant(-1, batch, t), l.Constant(1, batch, t), batch, t);
}

// The diagonal of square matrices (dims `s`): batch + [n].
std::string Diagonal(Lowering& l, const std::string& x, const MatrixShape& s, const DType& t) {
  const DType& i64 = I64();
  const std::string diag = l.Compare("EQ", l.Iota(s.rank() - 2, s.dims, i64), l.Iota(s.rank() - 1, s.dims, i64), s.dims, i64);
  return l.ReduceOver(l.Select(diag, x, l.Constant(0, s.dims, t), s.dims, t), s.dims, {s.rank() - 2}, "add", l.Constant(0, {}, t), t);
}

const std::map<std::string, MultiRule>& MultiRules() {
  static const auto* rules = [] {
    auto* m = new std::map<std::string, MultiRule>;
    (*m)["aten::native_layer_norm"] = [](Lowering& l, const tpu::DecodedOp& d,
                                         const std::vector<Target>& outs)
        -> absl::StatusOr<std::vector<std::string>> {
      if (outs.size() != 3 || !Defined(d, 0) || d.num_args < 5) return Unsupported(l.op(), "expects 3 outputs");
      const tpu::TensorRef& x = d.args[0].tensor;
      const DType& t = *outs[0].type;
      const std::vector<int64_t> in = DimsOf(x);
      const size_t k = d.args[1].ints.size();
      if (k == 0 || k > in.size()) return Unsupported(l.op(), "normalized_shape");
      std::vector<int64_t> which;
      int64_t count = 1;
      for (size_t i = in.size() - k; i < in.size(); ++i) {
        which.push_back(static_cast<int64_t>(i));
        count *= in[i];
      }
      absl::StatusOr<std::string> xv = l.OperandRef(x, 0, in, t);
      if (!xv.ok()) return xv.status();
      const std::vector<int64_t> kept = Lowering::Kept(in, which);
      const std::string n = l.Constant(static_cast<double>(count), kept, t);
      const std::string mean = l.Binary("divide", l.ReduceOver(*xv, in, which, "add", l.Constant(0, {}, t), t), n, kept, t);
      const std::string xc = l.Binary("subtract", *xv, l.Expand(mean, in, which, t), in, t);
      const std::string var = l.Binary("divide", l.ReduceOver(l.Binary("multiply", xc, xc, in, t), in, which, "add", l.Constant(0, {}, t), t), n, kept, t);
      const std::string rstd = l.Unary("rsqrt", l.Binary("add", var, l.Constant(NumberOf(d.args[4]), kept, t), kept, t), kept, t);
      std::string y = l.Binary("multiply", xc, l.Expand(rstd, in, which, t), in, t);
      for (size_t i : {size_t{2}, size_t{3}}) {
        if (!Defined(d, i)) continue;
        absl::StatusOr<std::string> p = l.OperandRef(d.args[i].tensor, l.TensorIndex(d.args[i]), in, t);
        if (!p.ok()) return p.status();
        y = l.Binary(i == 2 ? "multiply" : "add", y, *p, in, t);
      }
      return std::vector<std::string>{y, l.Reshape(mean, kept, outs[1].dims, *outs[1].type),
                                      l.Reshape(rstd, kept, outs[2].dims, *outs[2].type)};
    };
    (*m)["aten::native_layer_norm_backward"] = [](Lowering& l, const tpu::DecodedOp& d,
                                                  const std::vector<Target>& outs)
        -> absl::StatusOr<std::vector<std::string>> {
      // (grad_out, input, normalized_shape, mean, rstd, weight?, bias?, output_mask)
      if (d.num_args < 8 || !Defined(d, 0) || !Defined(d, 1) || !Defined(d, 3) || !Defined(d, 4)) {
        return Unsupported(l.op(), "arguments of a form not lowered");
      }
      const std::vector<bool>& mask = d.args[7].bools;
      size_t wanted = 0;
      for (bool b : mask) wanted += b ? 1 : 0;
      // Either one output per true entry of the mask, or all three (those
      // not asked for are empty and get nothing).
      const bool all_three = outs.size() == 3;
      if (mask.size() != 3 || (outs.size() != wanted && !all_three)) return Unsupported(l.op(), "output_mask");
      const DType& t = *outs[0].type;
      const std::vector<int64_t> in = DimsOf(d.args[1].tensor);
      const size_t k = d.args[2].ints.size();
      std::vector<int64_t> which, batch;
      for (size_t i = 0; i < in.size(); ++i) (i >= in.size() - k ? which : batch).push_back(static_cast<int64_t>(i));
      int64_t count = 1;
      for (int64_t w : which) count *= in[w];
      auto op = [&](size_t i) { return l.OperandRef(d.args[i].tensor, l.TensorIndex(d.args[i]), in, t); };
      absl::StatusOr<std::string> g = op(0), x = op(1), mean = op(3), rstd = op(4);
      for (auto* v : {&g, &x, &mean, &rstd}) if (!v->ok()) return v->status();
      const std::string xhat = l.Binary("multiply", l.Binary("subtract", *x, *mean, in, t), *rstd, in, t);
      std::string gw = *g;
      if (Defined(d, 5)) {
        absl::StatusOr<std::string> w = op(5);
        if (!w.ok()) return w.status();
        gw = l.Binary("multiply", gw, *w, in, t);
      }
      const std::string zero = l.Constant(0, {}, t);
      const std::vector<int64_t> kept = Lowering::Kept(in, which);
      const std::string n = l.Constant(static_cast<double>(count), kept, t);
      const std::string m1 = l.Expand(l.Binary("divide", l.ReduceOver(gw, in, which, "add", zero, t), n, kept, t), in, which, t);
      const std::string m2 = l.Expand(l.Binary("divide", l.ReduceOver(l.Binary("multiply", gw, xhat, in, t), in, which, "add", zero, t), n, kept, t), in, which, t);
      std::vector<std::string> r;
      auto skipped = [&](int j) {
        if (all_three && !mask[j]) r.push_back(l.Constant(0, outs[j].dims, *outs[j].type));
        return !mask[j];
      };
      if (!skipped(0)) {
        r.push_back(l.Binary("multiply", *rstd, l.Binary("subtract", l.Binary("subtract", gw, m1, in, t), l.Binary("multiply", xhat, m2, in, t), in, t), in, t));
      }
      for (int j : {1, 2}) {
        if (skipped(j)) continue;
        const Target& o = outs[r.size()];
        const std::string v = j == 1 ? l.Binary("multiply", *g, xhat, in, t) : *g;
        const std::string s = batch.empty() ? v : l.ReduceOver(v, in, batch, "add", zero, t);
        r.push_back(l.Reshape(s, Lowering::Kept(in, batch), o.dims, *o.type));
      }
      return r;
    };
    (*m)["aten::nll_loss_forward"] = [](Lowering& l, const tpu::DecodedOp& d,
                                        const std::vector<Target>& outs)
        -> absl::StatusOr<std::vector<std::string>> {
      // (self, target, weight?, reduction, ignore_index) -> (output, total_weight);
      // a 1-d self (one unbatched sample) is taken as one row.
      if (outs.size() != 2 || !Defined(d, 0) || d.args[0].tensor.ndim < 1 || d.args[0].tensor.ndim > 2 ||
          d.num_args < 5) {
        return Unsupported(l.op(), "expects a 1-d or 2-d input");
      }
      const DType& t = *outs[0].type;
      std::vector<int64_t> nc = DimsOf(d.args[0].tensor);
      if (nc.size() == 1) nc.insert(nc.begin(), 1);
      absl::StatusOr<std::string> x = l.OperandRef(d.args[0].tensor, 0, nc, t);
      if (!x.ok()) return x.status();
      absl::StatusOr<Picked> p = PickTargets(l, d, 1, 2, 4, nc, t);
      if (!p.ok()) return p.status();
      const std::string zero = l.Constant(0, {}, t);
      const std::vector<int64_t> n = {nc[0]};
      const std::string rows = l.Unary("negate", l.ReduceOver(l.Binary("multiply", *x, p->mask, nc, t), nc, {1}, "add", zero, t), n, t);
      const std::string total = l.ReduceOver(p->row_weight, n, {0}, "add", zero, t);
      const int64_t reduction = static_cast<int64_t>(NumberOf(d.args[3]));
      std::string out;
      if (reduction == 0) {
        out = rows;
      } else {
        out = l.ReduceOver(rows, n, {0}, "add", zero, t);
        if (reduction == 1) out = l.Binary("divide", out, total, {}, t);
      }
      return std::vector<std::string>{l.Reshape(out, reduction == 0 ? n : std::vector<int64_t>{}, outs[0].dims, t),
                                      l.Reshape(l.Convert(total, {}, t, *outs[1].type), {}, outs[1].dims, *outs[1].type)};
    };
    (*m)["aten::nll_loss_backward"] = [](Lowering& l, const tpu::DecodedOp& d,
                                         const std::vector<Target>& outs)
        -> absl::StatusOr<std::vector<std::string>> {
      // (grad_output, self, target, weight?, reduction, ignore_index, total_weight)
      if (outs.size() != 1 || !Defined(d, 1) || d.args[1].tensor.ndim < 1 || d.args[1].tensor.ndim > 2 ||
          d.num_args < 7) {
        return Unsupported(l.op(), "expects a 1-d or 2-d input");
      }
      const DType& t = *outs[0].type;
      std::vector<int64_t> nc = DimsOf(d.args[1].tensor);
      if (nc.size() == 1) nc.insert(nc.begin(), 1);
      absl::StatusOr<Picked> p = PickTargets(l, d, 2, 3, 5, nc, t);
      if (!p.ok()) return p.status();
      const int64_t reduction = static_cast<int64_t>(NumberOf(d.args[4]));
      const tpu::TensorRef& go = d.args[0].tensor;
      std::string g;
      if (reduction == 0) {
        absl::StatusOr<std::string> gv = l.OperandRef(go, 0, {nc[0]}, t);
        if (!gv.ok()) return gv.status();
        g = l.Emit(absl::StrCat("stablehlo.broadcast_in_dim ", *gv, ", dims = [0] : (",
                                TypeOf({nc[0]}, t), ") -> ", TypeOf(nc, t)));
      } else {
        absl::StatusOr<std::string> gv = l.OperandRef(go, 0, nc, t);
        if (!gv.ok()) return gv.status();
        g = *gv;
        if (reduction == 1) {
          absl::StatusOr<std::string> tw = l.OperandRef(d.args[6].tensor, l.TensorIndex(d.args[6]), nc, t);
          if (!tw.ok()) return tw.status();
          g = l.Binary("divide", g, *tw, nc, t);
        }
      }
      return std::vector<std::string>{
          l.Reshape(l.Unary("negate", l.Binary("multiply", g, p->mask, nc, t), nc, t), nc, outs[0].dims, t)};
    };
    // torch.optim's foreach paths: each written list element is one output.
    auto foreach = [](std::function<absl::StatusOr<std::string>(Lowering&, const tpu::DecodedOp&,
                                                                 const Target&, size_t e)> f) {
      return [f](Lowering& l, const tpu::DecodedOp& d, const std::vector<Target>& outs)
                 -> absl::StatusOr<std::vector<std::string>> {
        std::vector<std::string> r;
        for (size_t e = 0; e < outs.size(); ++e) {
          absl::StatusOr<std::string> v = f(l, d, outs[e], e);
          if (!v.ok()) return v.status();
          r.push_back(*v);
        }
        return r;
      };
    };
    // Element e of list argument i, as a value of out's type and shape.
    auto elem = [](Lowering& l, const tpu::DecodedOp& d, size_t i, size_t e,
                   const Target& o) -> absl::StatusOr<std::string> {
      if (i >= d.num_args || d.args[i].tag != tpu::ArgTag::kTensorList || e >= d.args[i].tensors.size()) {
        return Unsupported(l.op(), "list arguments of different lengths");
      }
      return l.OperandRef(d.args[i].tensors[e], l.TensorIndex(d.args[i]) + e, o.dims, *o.type);
    };
    auto scalar = [](Lowering& l, const tpu::DecodedOp& d, size_t i, size_t e,
                     const Target& o) -> absl::StatusOr<std::string> {
      if (i >= d.num_args) return Unsupported(l.op(), "a scalar is missing");
      const tpu::OpArg& a = d.args[i];
      if (a.tag == tpu::ArgTag::kDoubleList || a.tag == tpu::ArgTag::kIntList) {
        const size_t n = a.tag == tpu::ArgTag::kDoubleList ? a.doubles.size() : a.ints.size();
        if (e >= n) return Unsupported(l.op(), "a scalar list shorter than the tensor list");
        tpu::OpArg one;
        one.tag = a.tag == tpu::ArgTag::kDoubleList ? tpu::ArgTag::kScalarDouble : tpu::ArgTag::kScalarInt;
        one.d = a.tag == tpu::ArgTag::kDoubleList ? a.doubles[e] : 0;
        one.i = a.tag == tpu::ArgTag::kIntList ? a.ints[e] : 0;
        absl::StatusOr<std::string> s = l.Scalar(one, *o.type);
        if (!s.ok()) return s;
        return l.BroadcastTo(*s, {}, o.dims, *o.type);
      }
      return l.Operand(a, o.dims, *o.type);
    };
    for (const char* name : {"aten::_foreach_add_.Scalar", "aten::_foreach_mul_.Scalar",
                             "aten::_foreach_div_.Scalar", "aten::_foreach_sub_.Scalar",
                             "aten::_foreach_add_.ScalarList", "aten::_foreach_mul_.ScalarList",
                             "aten::_foreach_div_.ScalarList", "aten::_foreach_sub_.ScalarList",
                             "aten::_foreach_mul_.Tensor", "aten::_foreach_add_.Tensor",
                             "aten::_foreach_add_.List", "aten::_foreach_mul_.List",
                             "aten::_foreach_div_.List", "aten::_foreach_sub_.List"}) {
      const std::string n = name;
      const char* op = absl::StrContains(n, "add") ? "add" : absl::StrContains(n, "sub") ? "subtract"
                     : absl::StrContains(n, "mul") ? "multiply" : "divide";
      const bool list = absl::EndsWith(n, ".List");
      const bool alpha = absl::EndsWith(n, ".Tensor") || list;
      (*m)[n] = foreach([=](Lowering& l, const tpu::DecodedOp& d, const Target& o, size_t e)
                            -> absl::StatusOr<std::string> {
        absl::StatusOr<std::string> a = elem(l, d, 0, e, o);
        if (!a.ok()) return a;
        absl::StatusOr<std::string> b = list ? elem(l, d, 1, e, o) : scalar(l, d, 1, e, o);
        if (!b.ok()) return b;
        std::string rhs = *b;
        if (alpha && d.num_args > 2 && NumberOf(d.args[2]) != 1.0) {
          absl::StatusOr<std::string> s = l.Operand(d.args[2], o.dims, *o.type);
          if (!s.ok()) return s;
          rhs = l.Binary("multiply", rhs, *s, o.dims, *o.type);
        }
        return l.Binary(op, *a, rhs, o.dims, *o.type);
      });
    }
    // self + value * t1 (op) t2
    for (const char* name : {"aten::_foreach_addcmul_.Scalar", "aten::_foreach_addcdiv_.Scalar",
                             "aten::_foreach_addcmul_.ScalarList", "aten::_foreach_addcdiv_.ScalarList"}) {
      const std::string n = name;
      const char* op = absl::StrContains(n, "addcmul") ? "multiply" : "divide";
      (*m)[n] = foreach([=](Lowering& l, const tpu::DecodedOp& d, const Target& o, size_t e)
                            -> absl::StatusOr<std::string> {
        absl::StatusOr<std::string> a = elem(l, d, 0, e, o), b = elem(l, d, 1, e, o), c = elem(l, d, 2, e, o);
        for (auto* v : {&a, &b, &c}) if (!v->ok()) return *v;
        std::string prod = l.Binary(op, *b, *c, o.dims, *o.type);
        if (d.num_args > 3) {
          absl::StatusOr<std::string> s = scalar(l, d, 3, e, o);
          if (!s.ok()) return s;
          prod = l.Binary("multiply", prod, *s, o.dims, *o.type);
        }
        return l.Binary("add", *a, prod, o.dims, *o.type);
      });
    }
    (*m)["aten::_foreach_lerp_.Scalar"] = foreach([=](Lowering& l, const tpu::DecodedOp& d,
                                                      const Target& o, size_t e)
                                                      -> absl::StatusOr<std::string> {
      absl::StatusOr<std::string> a = elem(l, d, 0, e, o), b = elem(l, d, 1, e, o), w = scalar(l, d, 2, e, o);
      for (auto* v : {&a, &b, &w}) if (!v->ok()) return *v;
      return l.Binary("add", *a, l.Binary("multiply", *w, l.Binary("subtract", *b, *a, o.dims, *o.type), o.dims, *o.type), o.dims, *o.type);
    });
    for (const auto& [name, op] : std::vector<std::pair<std::string, const char*>>{
             {"sqrt", "sqrt"}, {"neg", "negate"}, {"exp", "exponential"}, {"abs", "abs"}}) {
      for (const char* suffix : {"", "_"}) {
        const char* hlo = op;
        (*m)["aten::_foreach_" + name + suffix] = foreach([=](Lowering& l, const tpu::DecodedOp& d,
                                                               const Target& o, size_t e)
                                                               -> absl::StatusOr<std::string> {
          absl::StatusOr<std::string> a = elem(l, d, 0, e, o);
          if (!a.ok()) return a;
          return l.Unary(hlo, *a, o.dims, *o.type);
        });
      }
    }
    (*m)["aten::cat"] = [](Lowering& l, const tpu::DecodedOp& d, const std::vector<Target>& outs)
        -> absl::StatusOr<std::vector<std::string>> {
      // (tensors, dim): one output; legacy empty 1-d inputs are skipped.
      if (outs.size() != 1 || d.num_args < 1 || d.args[0].tag != tpu::ArgTag::kTensorList) {
        return Unsupported(l.op(), "expects a list of tensors");
      }
      const Target& o = outs[0];
      const int64_t dim = WrapDim(d.num_args > 1 ? d.args[1].i : 0, o.dims.size());
      std::vector<std::string> parts, types;
      for (size_t e = 0; e < d.args[0].tensors.size(); ++e) {
        const tpu::TensorRef& r = d.args[0].tensors[e];
        if (Numel(r) == 0) continue;
        const std::vector<int64_t> dims = DimsOf(r);
        absl::StatusOr<std::string> v = l.OperandRef(r, l.TensorIndex(d.args[0]) + e, dims, *o.type);
        if (!v.ok()) return v.status();
        parts.push_back(*v);
        types.push_back(TypeOf(dims, *o.type));
      }
      if (parts.empty()) return std::vector<std::string>{l.Constant(0, o.dims, *o.type)};
      if (parts.size() == 1) return parts;
      return std::vector<std::string>{l.Emit(absl::StrCat(
          "stablehlo.concatenate ", absl::StrJoin(parts, ", "), ", dim = ", dim, " : (",
          absl::StrJoin(types, ", "), ") -> ", TypeOf(o.dims, *o.type)))};
    };
    const std::pair<const char*, const char*> outs[] = {
        {"aten::cat.out", "aten::cat"},
        {"aten::native_layer_norm.out", "aten::native_layer_norm"},
        {"aten::native_layer_norm_backward.out", "aten::native_layer_norm_backward"},
        {"aten::nll_loss_forward.output", "aten::nll_loss_forward"},
        {"aten::nll_loss_backward.grad_input", "aten::nll_loss_backward"},
    };
    for (const auto& [out, functional] : outs) (*m)[out] = (*m)[functional];
    // convolution_backward(grad_output, input, weight, bias_sizes, stride,
    // padding, dilation, transposed, output_padding, groups, output_mask):
    // the input's gradient is a convolution of the gradient, dilated by the
    // stride, with the spatially reversed weight; the weight's is one of the
    // input with the gradient, batch and features swapped; the bias's a sum.
    // Transposed convolutions and groups too (see `one` below).
    (*m)["aten::convolution_backward"] = [](Lowering& l, const tpu::DecodedOp& d, const std::vector<Target>& o)
        -> absl::StatusOr<std::vector<std::string>> {
      if (o.size() != 3 || d.num_args < 11 || !Defined(d, 0) || !Defined(d, 1) || !Defined(d, 2)) {
        return Unsupported(l.op(), "arguments of a form not lowered");
      }
      const DType& t = o[1].type != nullptr ? *o[1].type : *o[0].type;
      const std::vector<int64_t> gd = DimsOf(d.args[0].tensor), in = DimsOf(d.args[1].tensor), wd = DimsOf(d.args[2].tensor);
      absl::StatusOr<ConvWindow> cw = ConvWindowOf(l, d, 4, in, wd, gd, /*allow_transposed=*/true);
      if (!cw.ok()) return cw.status();
      const size_t sp = cw->sp;
      const std::vector<int64_t>&stride = cw->stride, &pad = cw->pad, &dilation = cw->dilation;
      const int64_t groups = cw->groups;
      const bool transposed = cw->transposed;
      absl::StatusOr<std::string> g = l.Operand(d.args[0], gd, t), x = l.Operand(d.args[1], in, t),
                                  w = l.Operand(d.args[2], wd, t);
      for (auto* v : {&g, &x, &w}) if (!v->ok()) return v->status();
      if (gd[1] % groups != 0 || wd[0] % groups != 0) return Unsupported(l.op(), "groups that do not divide the channels");
      std::vector<std::string> spatial;
      std::vector<int64_t> rev, ones(sp, 1);
      for (size_t k = 0; k < sp; ++k) {
        spatial.push_back(absl::StrCat(k));
        rev.push_back(static_cast<int64_t>(k + 2));
      }
      const std::string sd = absl::StrJoin(spatial, ", ");
      // One group's gradients: of the input and of the weight, for a
      // convolution (input `xi`, weight `wi`, output gradient `gi`) with
      // groups = 1. A transposed convolution y = conv_transpose(x, w) is the
      // input gradient of a convolution with weight w: its input's gradient
      // is that convolution of the gradient, its weight's the convolution's
      // weight gradient with the roles of input and output gradient swapped.
      auto one = [&](const std::string& gv, const std::vector<int64_t>& gdim, const std::string& xv,
                     const std::vector<int64_t>& xdim, const std::string& wv, const std::vector<int64_t>& wdim) {
        // A convolution of `a` (dims ad: the input) giving `b` (dims bd):
        // the gradient of its input from the gradient `gb`, and of its weight.
        auto weight_grad = [&](const std::string& av, const std::vector<int64_t>& ad, const std::string& bv,
                               const std::vector<int64_t>& bd) {
          std::vector<std::string> pw;
          for (size_t k = 0; k < sp; ++k) {
            const int64_t h = ad[k + 2], hout = bd[k + 2], kk = wdim[k + 2];
            pw.push_back(absl::StrCat("[", pad[k], ", ", (kk - 1) * dilation[k] + (hout - 1) * stride[k] + 1 - h - pad[k], "]"));
          }
          return l.Emit(absl::StrCat(
              "stablehlo.convolution(", av, ", ", bv, ") dim_numbers = [f, b, ", sd, "]x[i, o, ", sd, "]->[f, b, ", sd,
              "], window = {stride = [", absl::StrJoin(dilation, ", "), "], pad = [", absl::StrJoin(pw, ", "),
              "], rhs_dilate = [", absl::StrJoin(stride, ", "),
              "]} {batch_group_count = 1 : i64, feature_group_count = 1 : i64} : (", TypeOf(ad, t), ", ", TypeOf(bd, t),
              ") -> ", TypeOf(wdim, t)));
        };
        if (transposed) {
          std::vector<std::string> pads;
          for (size_t k = 0; k < sp; ++k) pads.push_back(absl::StrCat("[", pad[k], ", ", pad[k], "]"));
          const std::string gx = l.Emit(absl::StrCat(
              "stablehlo.convolution(", gv, ", ", wv, ") dim_numbers = [b, f, ", sd, "]x[o, i, ", sd, "]->[b, f, ", sd,
              "], window = {stride = [", absl::StrJoin(stride, ", "), "], pad = [", absl::StrJoin(pads, ", "), "], rhs_dilate = [",
              absl::StrJoin(dilation, ", "), "]} {batch_group_count = 1 : i64, feature_group_count = 1 : i64} : (",
              TypeOf(gdim, t), ", ", TypeOf(wdim, t), ") -> ", TypeOf(xdim, t)));
          return std::make_pair(gx, weight_grad(gv, gdim, xv, xdim));
        }
        std::vector<std::string> pin;
        for (size_t k = 0; k < sp; ++k) {
          const int64_t h = xdim[k + 2], hout = gdim[k + 2], kk = wdim[k + 2];
          const int64_t lo = dilation[k] * (kk - 1) - pad[k];
          pin.push_back(absl::StrCat("[", lo, ", ", h - (hout - 1) * stride[k] - 1 + pad[k], "]"));
        }
        const std::string wrev = l.Emit(absl::StrCat("stablehlo.reverse ", wv, ", dims = [", absl::StrJoin(rev, ", "),
                                                     "] : ", TypeOf(wdim, t)));
        const std::string gx = l.Emit(absl::StrCat(
            "stablehlo.convolution(", gv, ", ", wrev, ") dim_numbers = [b, f, ", sd, "]x[i, o, ", sd, "]->[b, f, ", sd,
            "], window = {stride = [", absl::StrJoin(ones, ", "), "], pad = [", absl::StrJoin(pin, ", "),
            "], lhs_dilate = [", absl::StrJoin(stride, ", "), "], rhs_dilate = [", absl::StrJoin(dilation, ", "),
            "]} {batch_group_count = 1 : i64, feature_group_count = 1 : i64} : (", TypeOf(gdim, t), ", ", TypeOf(wdim, t),
            ") -> ", TypeOf(xdim, t)));
        return std::make_pair(gx, weight_grad(xv, xdim, gv, gdim));
      };
      std::string grad_in, grad_w;
      if (groups == 1) {
        std::tie(grad_in, grad_w) = one(*g, gd, *x, in, *w, wd);
      } else {
        // Group q: its slice of the channels of each (the weight's first
        // dimension holds the groups one after another).
        const int64_t gc = gd[1] / groups, xc = in[1] / groups, wc = wd[0] / groups;
        std::vector<std::string> gis, gws;
        std::vector<int64_t> gdq = gd, inq = in, wdq = wd;
        gdq[1] = gc;
        inq[1] = xc;
        wdq[0] = wc;
        for (int64_t q = 0; q < groups; ++q) {
          const auto [a, b] = one(l.SliceAlong(*g, gd, 1, q * gc, (q + 1) * gc, t), gdq, l.SliceAlong(*x, in, 1, q * xc, (q + 1) * xc, t),
                                  inq, l.SliceAlong(*w, wd, 0, q * wc, (q + 1) * wc, t), wdq);
          gis.push_back(a);
          gws.push_back(b);
        }
        std::vector<std::string> tin(groups, TypeOf(inq, t)), tw(groups, TypeOf(wdq, t));
        grad_in = l.Emit(absl::StrCat("stablehlo.concatenate ", absl::StrJoin(gis, ", "), ", dim = 1 : (", absl::StrJoin(tin, ", "),
                                      ") -> ", TypeOf(in, t)));
        grad_w = l.Emit(absl::StrCat("stablehlo.concatenate ", absl::StrJoin(gws, ", "), ", dim = 0 : (", absl::StrJoin(tw, ", "),
                                     ") -> ", TypeOf(wd, t)));
      }
      std::vector<int64_t> all_but_1;
      for (size_t k = 0; k < gd.size(); ++k) if (k != 1) all_but_1.push_back(static_cast<int64_t>(k));
      const std::string gb = l.ReduceOver(*g, gd, all_but_1, "add", l.Constant(0, {}, t), t);
      // An output the mask leaves out has no shape to match: zeros of its own.
      auto fit = [&](const std::string& v, const std::vector<int64_t>& dims, size_t k) {
        return o[k].dims == dims ? v : l.Constant(0, o[k].dims, *o[k].type);
      };
      return std::vector<std::string>{fit(grad_in, in, 0), fit(grad_w, wd, 1), fit(gb, {gd[1]}, 2)};
    };
    // max.dim / min.dim(self, dim, keepdim): the values and the first index
    // of each.
    for (bool largest : {true, false}) {
      MultiRule r = [largest](Lowering& l, const tpu::DecodedOp& d, const std::vector<Target>& o)
          -> absl::StatusOr<std::vector<std::string>> {
        if (o.size() != 2 || !Defined(d, 0) || d.num_args < 2) return Unsupported(l.op(), "expects 2 outputs");
        const tpu::TensorRef& x = d.args[0].tensor;
        const DType& t = *o[0].type;
        const std::vector<int64_t> in = DimsOf(x);
        absl::StatusOr<std::string> v = l.OperandRef(x, 0, in, t);
        if (!v.ok()) return v.status();
        if (in.empty()) {
          return std::vector<std::string>{l.Reshape(*v, in, o[0].dims, t), l.Constant(0, o[1].dims, *o[1].type)};
        }
        absl::StatusOr<int64_t> checked = CheckedDim(l.op(), d.args[1].i, in.size());
        if (!checked.ok()) return checked.status();
        const int64_t dim = *checked;
        const std::vector<int64_t> which = {dim};
        const std::vector<int64_t> kept = Lowering::Kept(in, which);
        const std::string best = largest ? l.ReduceOver(*v, in, which, "maximum", l.Lowest(t), t)
                                         : l.ReduceOver(*v, in, which, "minimum", Highest(l, t), t);
        const std::string hit = l.Compare("EQ", *v, l.Expand(best, in, which, t), in, t);
        const DType& i64 = I64();
        const std::string none = l.Constant(static_cast<double>(in[dim]), in, i64);
        const std::string idx = l.ReduceOver(l.Select(hit, l.Iota(dim, in, i64), none, in, i64), in, which, "minimum",
                                             l.Constant(static_cast<double>(in[dim]), {}, i64), i64);
        return std::vector<std::string>{
            l.Reshape(best, kept, o[0].dims, t),
            l.Reshape(l.Convert(idx, kept, i64, *o[1].type), kept, o[1].dims, *o[1].type)};
      };
      (*m)[largest ? "aten::max.dim" : "aten::min.dim"] = r;
      (*m)[largest ? "aten::max.dim_max" : "aten::min.dim_min"] = r;
    }
    // sort(self, [stable,] dim, descending): a stable sort (PyTorch's CPU
    // sort is stable either way), NaN last going up.
    for (bool with_stable : {false, true}) {
      MultiRule r = [with_stable](Lowering& l, const tpu::DecodedOp& d, const std::vector<Target>& o)
          -> absl::StatusOr<std::vector<std::string>> {
        if (o.size() != 2 || !Defined(d, 0)) return Unsupported(l.op(), "expects 2 outputs");
        const size_t at = with_stable ? 2 : 1;
        const DType& t = *DTypeOf(d.args[0].tensor.dtype);
        const std::vector<int64_t> in = DimsOf(d.args[0].tensor);
        absl::StatusOr<std::string> v = l.OperandRef(d.args[0].tensor, 0, in, t);
        if (!v.ok()) return v.status();
        if (in.empty()) return std::vector<std::string>{l.Convert(*v, in, t, *o[0].type), l.Constant(0, o[1].dims, *o[1].type)};
        absl::StatusOr<int64_t> checked = CheckedDim(l.op(), d.num_args > at ? static_cast<int64_t>(NumberOf(d.args[at])) : -1, in.size());
        if (!checked.ok()) return checked.status();
        const int64_t dim = *checked;
        const bool descending = d.num_args > at + 1 && NumberOf(d.args[at + 1]) != 0;
        auto [values, indices] = l.Sort(*v, in, dim, descending, t);
        return std::vector<std::string>{l.Convert(values, in, t, *o[0].type), l.Convert(indices, in, I64(), *o[1].type)};
      };
      for (const char* name : with_stable ? std::vector<const char*>{"aten::sort.stable", "aten::sort.values_stable"}
                                          : std::vector<const char*>{"aten::sort", "aten::sort.values"}) {
        (*m)[name] = r;
      }
    }
    // median / nanmedian, of everything or along dim (values and indices):
    // the lower middle of the sorted elements. median gives NaN (and the
    // first NaN's index) where a row holds one; nanmedian skips them.
    for (bool nan : {false, true}) {
      MultiRule r = [nan](Lowering& l, const tpu::DecodedOp& d, const std::vector<Target>& o)
          -> absl::StatusOr<std::vector<std::string>> {
        if (!Defined(d, 0)) return Unsupported(l.op(), "expects a tensor");
        const DType& t = *DTypeOf(d.args[0].tensor.dtype);
        const std::vector<int64_t> given = DimsOf(d.args[0].tensor);
        absl::StatusOr<std::string> v = l.OperandRef(d.args[0].tensor, 0, given, t);
        if (!v.ok()) return v.status();
        const bool whole = o.size() == 1;
        std::vector<int64_t> in = given;
        int64_t dim = 0;
        if (whole || in.empty()) {
          int64_t n = 1;
          for (int64_t x : given) n *= x;
          in = {n};
          v = l.Reshape(*v, given, in, t);
          if (!whole && d.num_args > 1) {
            // A 0-d tensor takes dim 0 or -1, as a 1-d one.
            absl::StatusOr<int64_t> checked = CheckedDim(l.op(), static_cast<int64_t>(NumberOf(d.args[1])), 1);
            if (!checked.ok()) return checked.status();
          }
        } else {
          absl::StatusOr<int64_t> checked = CheckedDim(l.op(), d.num_args > 1 ? static_cast<int64_t>(NumberOf(d.args[1])) : -1, in.size());
          if (!checked.ok()) return checked.status();
          dim = *checked;
        }
        if (in[dim] == 0) return Unsupported(l.op(), "an empty dimension");
        auto [values, indices] = l.Sort(*v, in, dim, false, t);
        const DType& i64 = I64();
        const std::vector<int64_t> which = {dim};
        const std::vector<int64_t> kept = Lowering::Kept(in, which);
        const std::string count = l.Constant(static_cast<double>(in[dim]), kept, i64);
        std::string pos;
        if (t.is_float) {
          const std::string isnan = l.Convert(l.Compare("NE", values, values, in, t), in, *DTypeOf(11), i64);
          const std::string nans = l.ReduceOver(isnan, in, which, "add", l.Constant(0, {}, i64), i64);
          const std::string valid = l.Binary("subtract", count, nans, kept, i64);
          const std::string one = l.Constant(1, kept, i64), two = l.Constant(2, kept, i64);
          const std::string mid = l.Binary("divide", l.Binary("subtract", valid, one, kept, i64), two, kept, i64);
          if (nan) {
            // All NaN: the first (a NaN).
            pos = l.Binary("maximum", mid, l.Constant(0, kept, i64), kept, i64);
          } else {
            pos = l.Select(l.Compare("GT", nans, l.Constant(0, kept, i64), kept, i64), valid, mid, kept, i64);
          }
        } else {
          pos = l.Constant(static_cast<double>((in[dim] - 1) / 2), kept, i64);
        }
        const std::string hit = l.Compare("EQ", l.Iota(dim, in, i64), l.Expand(pos, in, which, i64), in, i64);
        const std::string value = l.ReduceOver(l.Select(hit, values, l.Constant(0, in, t), in, t), in, which, "add",
                                               l.Constant(0, {}, t), t);
        const std::string index = l.ReduceOver(l.Select(hit, indices, l.Constant(0, in, i64), in, i64), in, which, "add",
                                               l.Constant(0, {}, i64), i64);
        std::vector<std::string> out = {l.Reshape(l.Convert(value, kept, t, *o[0].type), kept, o[0].dims, *o[0].type)};
        if (!whole) out.push_back(l.Reshape(l.Convert(index, kept, i64, *o[1].type), kept, o[1].dims, *o[1].type));
        return out;
      };
      const std::string base = nan ? "aten::nanmedian" : "aten::median";
      for (const char* form : {"", ".dim", ".dim_values", ".out"}) (*m)[base + form] = r;
    }
    // searchsorted(sorted_sequence, self, out_int32, right, side, sorter):
    // for each value, how many elements of its row sort before it.
    (*m)["aten::searchsorted.Tensor"] = (*m)["aten::searchsorted.Tensor_out"] = [](Lowering& l, const tpu::DecodedOp& d, const std::vector<Target>& o)
        -> absl::StatusOr<std::vector<std::string>> {
      if (o.size() != 1 || !Defined(d, 0) || !Defined(d, 1)) return Unsupported(l.op(), "expects two tensors");
      if (Defined(d, 5)) return Unsupported(l.op(), "a sorter");
      bool right = d.num_args > 3 && NumberOf(d.args[3]) != 0;
      if (d.num_args > 4 && d.args[4].tag == tpu::ArgTag::kString) right = right || d.args[4].s == "right";
      const tpu::TensorRef& seq = d.args[0].tensor;
      const tpu::TensorRef& val = d.args[1].tensor;
      const DType& t = *DTypeOf(seq.dtype);
      const std::vector<int64_t> sd = DimsOf(seq), vd = DimsOf(val);
      if (sd.empty()) return Unsupported(l.op(), "a 0-d sequence");
      const int64_t n = sd.back();
      int64_t m = 1;
      for (int64_t x : vd) m *= x;
      // Rows: the sequence's batch dimensions (one row when it is 1-d).
      std::vector<int64_t> batch(sd.begin(), sd.end() - 1);
      int64_t rows = 1;
      for (int64_t x : batch) rows *= x;
      const int64_t per = rows == 0 ? 0 : m / std::max<int64_t>(rows, 1);
      absl::StatusOr<std::string> s = l.OperandRef(seq, 0, sd, t);
      if (!s.ok()) return s.status();
      absl::StatusOr<std::string> v = l.OperandRef(val, 1, vd, t);
      if (!v.ok()) return v.status();
      const std::vector<int64_t> s2 = {rows, n, 1}, v2 = {rows, 1, per}, full = {rows, n, per};
      const std::string sb = l.BroadcastTo(l.Reshape(*s, sd, s2, t), s2, full, t);
      const std::string vb = l.BroadcastTo(l.Reshape(*v, vd, v2, t), v2, full, t);
      const DType& i64 = I64();
      const std::string before = l.Convert(l.Compare(right ? "LE" : "LT", sb, vb, full, t), full, *DTypeOf(11), i64);
      const std::string c = l.ReduceOver(before, full, {1}, "add", l.Constant(0, {}, i64), i64);
      return std::vector<std::string>{l.Reshape(l.Convert(c, {rows, per}, i64, *o[0].type), {rows, per}, o[0].dims, *o[0].type)};
    };
    // topk(self, k, dim, largest, sorted) and kthvalue(self, k, dim,
    // keepdim): a sort, then a slice.
    for (bool top : {true, false}) {
      MultiRule r = [top](Lowering& l, const tpu::DecodedOp& d, const std::vector<Target>& o)
          -> absl::StatusOr<std::vector<std::string>> {
        if (o.size() != 2 || !Defined(d, 0) || d.num_args < 2) return Unsupported(l.op(), "expects 2 outputs");
        const DType& t = *DTypeOf(d.args[0].tensor.dtype);
        std::vector<int64_t> in = DimsOf(d.args[0].tensor);
        absl::StatusOr<std::string> v = l.OperandRef(d.args[0].tensor, 0, in, t);
        if (!v.ok()) return v.status();
        if (in.empty()) {
          in = {1};
          v = l.Reshape(*v, {}, in, t);
        }
        const int64_t k = static_cast<int64_t>(NumberOf(d.args[1]));
        absl::StatusOr<int64_t> checked = CheckedDim(l.op(), d.num_args > 2 ? static_cast<int64_t>(NumberOf(d.args[2])) : -1, in.size());
        if (!checked.ok()) return checked.status();
        const int64_t dim = *checked;
        const bool descending = top && (d.num_args <= 3 || NumberOf(d.args[3]) != 0);
        if (top ? (k < 0 || k > in[dim]) : (k < 1 || k > in[dim])) {
          return absl::InvalidArgumentError(absl::StrCat(l.op(), ": k (", k, ") is out of range for a dimension of ", in[dim]));
        }
        auto [values, indices] = l.Sort(*v, in, dim, descending, t);
        const int64_t begin = top ? 0 : k - 1;
        std::vector<int64_t> cut = in;
        cut[dim] = k - begin;
        const std::string vs = l.SliceAlong(values, in, dim, begin, k, t);
        const std::string is = l.SliceAlong(indices, in, dim, begin, k, I64());
        return std::vector<std::string>{l.Reshape(l.Convert(vs, cut, t, *o[0].type), cut, o[0].dims, *o[0].type),
                                        l.Reshape(l.Convert(is, cut, I64(), *o[1].type), cut, o[1].dims, *o[1].type)};
      };
      for (const char* name : top ? std::vector<const char*>{"aten::topk", "aten::topk.values"}
                                  : std::vector<const char*>{"aten::kthvalue", "aten::kthvalue.values"}) {
        (*m)[name] = r;
      }
    }
    // linalg_cholesky_ex(self, upper, check_errors) -> (L, info): XLA's
    // Cholesky, which leaves NaN from the first pivot that is not positive
    // on; info is that pivot's order (1-based), 0 when there is none.
    (*m)["aten::linalg_cholesky_ex"] = [](Lowering& l, const tpu::DecodedOp& d, const std::vector<Target>& o)
        -> absl::StatusOr<std::vector<std::string>> {
      if (o.size() != 2 || !Defined(d, 0) || d.args[0].tensor.ndim < 2) return Unsupported(l.op(), "expects a matrix or a batch of them");
      const DType& t = *o[0].type;
      const std::vector<int64_t> in = o[0].dims;
      const bool upper = d.num_args > 1 && d.args[1].tag == tpu::ArgTag::kBool && d.args[1].b;
      absl::StatusOr<std::string> a = l.Operand(d.args[0], in, t);
      if (!a.ok()) return a.status();
      const std::string c = Cholesky(l, *a, in, upper, t);
      const int64_t n = in.back();
      const DType& i64 = I64();
      const std::vector<int64_t> batch = BatchOf(in);
      // NaN on the diagonal, counted per matrix.
      const std::string nan = l.Compare("NE", c, c, in, t);
      const std::string diag = l.Compare("EQ", l.Iota(in.size() - 2, in, i64), l.Iota(in.size() - 1, in, i64), in, i64);
      const std::string bad = l.Convert(l.Binary("and", nan, diag, in, *DTypeOf(11)), in, *DTypeOf(11), i64);
      const std::string count = l.ReduceOver(bad, in, {static_cast<int64_t>(in.size() - 2), static_cast<int64_t>(in.size() - 1)},
                                             "add", l.Constant(0, {}, i64), i64);
      const std::string failed = l.Compare("GT", count, l.Constant(0, batch, i64), batch, i64);
      const std::string order = l.Binary("add", l.Binary("subtract", l.Constant(static_cast<double>(n), batch, i64), count, batch, i64),
                                         l.Constant(1, batch, i64), batch, i64);
      const std::string info = l.Select(failed, order, l.Constant(0, batch, i64), batch, i64);
      return std::vector<std::string>{c, l.Reshape(l.Convert(info, batch, i64, *o[1].type), batch, o[1].dims, *o[1].type)};
    };
    (*m)["aten::linalg_cholesky_ex.L"] = (*m)["aten::linalg_cholesky_ex"];
    // triangular_solve(self = B, A, upper, transpose, unitriangular) ->
    // (solution, cloned_coefficient).
    (*m)["aten::triangular_solve"] = [](Lowering& l, const tpu::DecodedOp& d, const std::vector<Target>& o)
        -> absl::StatusOr<std::vector<std::string>> {
      if (o.size() != 2 || d.num_args < 5) return Unsupported(l.op(), "arguments of a form not lowered");
      const DType& t = *o[0].type;
      const std::vector<int64_t> batch = BatchOf(o[0].dims);
      absl::StatusOr<std::string> b = MatrixOperand(l, d.args[0], batch, t), a = MatrixOperand(l, d.args[1], batch, t);
      if (!b.ok()) return b.status();
      if (!a.ok()) return a.status();
      const std::vector<int64_t> ad = WithBatch(DimsOf(d.args[1].tensor), batch);
      const bool upper = d.args[2].b, transpose = d.args[3].b, unit = d.args[4].b;
      const std::string x = TriangularSolve(l, *a, ad, *b, o[0].dims, true, !upper, unit, transpose, t);
      return std::vector<std::string>{x, l.BroadcastTo(*a, ad, o[1].dims, t)};
    };
    (*m)["aten::triangular_solve.X"] = (*m)["aten::triangular_solve"];
    // geqrf(self) -> (a, tau); linalg_qr(A, mode) -> (Q, R), mode reduced,
    // complete or r (Q empty): Householder QR as LAPACK's, Q formed by
    // applying the reflectors to the identity.
    (*m)["aten::geqrf"] = [](Lowering& l, const tpu::DecodedOp& d, const std::vector<Target>& o)
        -> absl::StatusOr<std::vector<std::string>> {
      if (o.size() != 2 || !Defined(d, 0) || o[0].dims.size() < 2) return Unsupported(l.op(), "expects a matrix or a batch of them");
      const DType& t = *o[0].type;
      absl::StatusOr<std::string> a = l.Operand(d.args[0], o[0].dims, t);
      if (!a.ok()) return a.status();
      const Qr f = Geqrf(l, *a, MatrixShape(o[0].dims), t);
      return std::vector<std::string>{f.a, f.tau};
    };
    (*m)["aten::geqrf.a"] = (*m)["aten::geqrf"];
    (*m)["aten::linalg_qr"] = [](Lowering& l, const tpu::DecodedOp& d, const std::vector<Target>& o)
        -> absl::StatusOr<std::vector<std::string>> {
      if (o.size() != 2 || !Defined(d, 0) || d.args[0].tensor.ndim < 2) return Unsupported(l.op(), "expects a matrix or a batch of them");
      const std::string mode = d.num_args > 1 && d.args[1].tag == tpu::ArgTag::kString ? d.args[1].s : "reduced";
      if (mode != "reduced" && mode != "complete" && mode != "r") {
        return absl::InvalidArgumentError(absl::StrCat(l.op(), ": mode \"", mode, "\" is not reduced, complete or r"));
      }
      const DType& t = *o[1].type;
      const std::vector<int64_t> ad = DimsOf(d.args[0].tensor);
      const MatrixShape as(ad);
      const int64_t k = std::min(as.m, as.n);
      absl::StatusOr<std::string> a = l.Operand(d.args[0], ad, t);
      if (!a.ok()) return a.status();
      const Qr f = Geqrf(l, *a, as, t);
      const int64_t rq = mode == "complete" ? as.m : k;
      const std::vector<int64_t> rd = WithBatch({rq, as.n}, as.batch);
      std::vector<int64_t> zero(ad.size(), 0);
      std::string r = f.a;
      if (rq < as.m) r = l.Slice(f.a, ad, zero, rd, t);
      r = Triangle(l, r, rd, false, t);
      std::string q = l.Constant(0, o[0].dims, *o[0].type);
      if (mode != "r") {
        const MatrixShape qs(WithBatch({as.m, rq}, as.batch));
        const std::string eye = Identity(l, qs.dims, t);
        q = ApplyQ(l, f.a, as, f.tau, k, eye, qs, false, t);
      }
      return std::vector<std::string>{q, r};
    };
    (*m)["aten::linalg_qr.out"] = (*m)["aten::linalg_qr"];
    // frexp(self) -> (mantissa, exponent): x = mantissa * 2^exponent with
    // |mantissa| in [0.5, 1), from the bits (subnormals scaled up first);
    // zero, infinity and NaN keep themselves with exponent 0.
    (*m)["aten::frexp.Tensor"] = [](Lowering& l, const tpu::DecodedOp& d, const std::vector<Target>& o)
        -> absl::StatusOr<std::vector<std::string>> {
      if (o.size() != 2 || !Defined(d, 0)) return Unsupported(l.op(), "expects a tensor");
      const DType& t = *o[0].type;
      if (t.c10 != 6 && t.c10 != 7) return Unsupported(l.op(), "a dtype that is not lowered");
      const bool wide = t.c10 == 7;
      const DType& it = wide ? I64() : *DTypeOf(3);
      const std::vector<int64_t>& dims = o[0].dims;
      absl::StatusOr<std::string> xs = l.Operand(d.args[0], dims, t);
      if (!xs.ok()) return xs.status();
      const int mant = wide ? 52 : 23, bias = wide ? 1022 : 126, scale = wide ? 54 : 25;
      const double mask = wide ? 2047 : 255;
      const std::string x = *xs;
      const std::string tiny = l.Compare("LT", l.Unary("abs", x, dims, t), l.Constant(wide ? 2.2250738585072014e-308 : 1.1754943508222875e-38, dims, t), dims, t);
      const std::string up = l.Select(tiny, l.Binary("multiply", x, l.Constant(std::ldexp(1.0, scale), dims, t), dims, t), x, dims, t);
      const std::string bits = l.Emit(absl::StrCat("stablehlo.bitcast_convert ", up, " : (", TypeOf(dims, t), ") -> ", TypeOf(dims, it)));
      const std::string field = l.Binary("and", l.Binary("shift_right_logical", bits, l.Constant(mant, dims, it), dims, it),
                                         l.Constant(mask, dims, it), dims, it);
      std::string e = l.Binary("subtract", field, l.Constant(bias, dims, it), dims, it);
      e = l.Select(tiny, l.Binary("subtract", e, l.Constant(scale, dims, it), dims, it), e, dims, it);
      // Clear the exponent field, then set it to the bias: [0.5, 1).
      const std::string keep = l.Unary("not", l.Binary("shift_left", l.Constant(mask, dims, it), l.Constant(mant, dims, it), dims, it), dims, it);
      const std::string mbits = l.Binary("or", l.Binary("and", bits, keep, dims, it),
                                         l.Binary("shift_left", l.Constant(bias, dims, it), l.Constant(mant, dims, it), dims, it), dims, it);
      const std::string mv = l.Emit(absl::StrCat("stablehlo.bitcast_convert ", mbits, " : (", TypeOf(dims, it), ") -> ", TypeOf(dims, t)));
      const DType& i1 = *DTypeOf(11);
      const std::string finite = l.Emit(absl::StrCat("stablehlo.is_finite ", x, " : (", TypeOf(dims, t), ") -> ", TypeOf(dims, i1)));
      const std::string plain = l.Binary("and", finite, l.Compare("NE", x, l.Constant(0, dims, t), dims, t), dims, i1);
      return std::vector<std::string>{l.Select(plain, mv, x, dims, t),
                                      l.Convert(l.Select(plain, e, l.Constant(0, dims, it), dims, it), dims, it, *o[1].type)};
    };
    (*m)["aten::frexp.Tensor_out"] = (*m)["aten::frexp.Tensor"];
    // adaptive_max_pool2d(self, output_size) -> (out, indices): the largest
    // of each adaptive window (as _adaptive_avg_pool2d's) and its flat
    // position h * W + w, the first one (the last NaN, where there is one).
    (*m)["aten::adaptive_max_pool2d"] = [](Lowering& l, const tpu::DecodedOp& d, const std::vector<Target>& o)
        -> absl::StatusOr<std::vector<std::string>> {
      if (o.size() != 2 || !Defined(d, 0) || o[0].dims.size() < 3) return Unsupported(l.op(), "arguments of a form not lowered");
      const DType& t = *o[0].type;
      const DType& i64 = I64();
      const DType& i1 = *DTypeOf(11);
      const std::vector<int64_t> in = DimsOf(d.args[0].tensor);
      const std::vector<int64_t>& od = o[0].dims;
      if (in.size() != od.size()) return Unsupported(l.op(), "an output of another rank");
      const size_t lead = in.size() - 2;
      const int64_t h = in[lead], w = in[lead + 1], oh = od[lead], ow = od[lead + 1];
      if (h == 0 || w == 0) return Unsupported(l.op(), "an empty input");
      absl::StatusOr<std::string> x = l.Operand(d.args[0], in, t);
      if (!x.ok()) return x.status();
      // full: lead + [oh, ow, h, w]
      std::vector<int64_t> full(in.begin(), in.begin() + lead), xmap;
      full.insert(full.end(), {oh, ow, h, w});
      for (size_t r = 0; r < lead; ++r) xmap.push_back(static_cast<int64_t>(r));
      xmap.push_back(static_cast<int64_t>(lead + 2));
      xmap.push_back(static_cast<int64_t>(lead + 3));
      const int64_t a = static_cast<int64_t>(lead);
      const std::string mask = l.Binary("and", AdaptiveWindow(l, full, a, a + 2, h, oh), AdaptiveWindow(l, full, a + 1, a + 3, w, ow),
                                        full, i1);
      const std::string xb = BroadcastInDim(l, *x, in, full, xmap, t);
      const std::vector<int64_t> last2 = {a + 2, a + 3};
      const std::string mx = l.ReduceOver(l.Select(mask, xb, l.BroadcastTo(l.Lowest(t), {}, full, t), full, t), full, last2, "maximum",
                                          l.Lowest(t), t);
      std::vector<int64_t> omap;
      for (int64_t r = 0; r < a + 2; ++r) omap.push_back(r);
      const std::string pos = l.Binary("add", l.Binary("multiply", l.Iota(a + 2, full, i64), l.Constant(static_cast<double>(w), full, i64), full, i64),
                                       l.Iota(a + 3, full, i64), full, i64);
      const std::string hit = l.Binary("and", mask, l.Compare("EQ", xb, BroadcastInDim(l, mx, od, full, omap, t), full, t), full, i1);
      const std::string first = l.ReduceOver(l.Select(hit, pos, l.Constant(static_cast<double>(h * w), full, i64), full, i64), full, last2,
                                             "minimum", l.Constant(static_cast<double>(h * w), {}, i64), i64);
      const std::string nan = l.Binary("and", mask, l.Compare("NE", xb, xb, full, t), full, i1);
      const std::string last_nan = l.ReduceOver(l.Select(nan, pos, l.Constant(-1, full, i64), full, i64), full, last2, "maximum",
                                                l.Constant(-1, {}, i64), i64);
      const std::string idx = l.Select(l.Compare("GE", last_nan, l.Constant(0, od, i64), od, i64), last_nan, first, od, i64);
      return std::vector<std::string>{mx, l.Convert(idx, od, i64, *o[1].type)};
    };
    (*m)["aten::adaptive_max_pool2d.out"] = (*m)["aten::adaptive_max_pool2d"];
    // _cummax_helper / _cummin_helper(self, values!, indices!, dim): the
    // running largest (smallest) value, NaN sticking, and the last place it
    // was seen: the running largest of the positions where an element equals
    // the running value (both NaN counting as equal).
    for (bool largest : {true, false}) {
      (*m)[largest ? "aten::_cummax_helper" : "aten::_cummin_helper"] = [largest](Lowering& l, const tpu::DecodedOp& d,
                                                                                   const std::vector<Target>& o)
          -> absl::StatusOr<std::vector<std::string>> {
        if (o.size() != 2 || !Defined(d, 0) || d.num_args < 4) return Unsupported(l.op(), "arguments of a form not lowered");
        const DType& t = *o[0].type;
        const DType& i64 = I64();
        const std::vector<int64_t>& dims = o[0].dims;
        absl::StatusOr<std::string> x = l.Operand(d.args[0], dims, t);
        if (!x.ok()) return x.status();
        if (dims.empty()) return std::vector<std::string>{*x, l.Constant(0, {}, *o[1].type)};
        absl::StatusOr<int64_t> dim = CheckedDim(l.op(), d.args[3].i, dims.size());
        if (!dim.ok()) return dim.status();
        const std::string v = Running(l, *x, dims, *dim, largest ? "maximum" : "minimum", 0, t,
                                      largest ? l.Lowest(t) : Highest(l, t));
        std::string same = l.Compare("EQ", *x, v, dims, t);
        if (t.is_float) {
          const DType& i1 = *DTypeOf(11);
          same = l.Binary("or", same, l.Binary("and", l.Compare("NE", *x, *x, dims, t), l.Compare("NE", v, v, dims, t), dims, i1), dims, i1);
        }
        const std::string at = l.Select(same, l.Iota(*dim, dims, i64), l.Constant(-1, dims, i64), dims, i64);
        const std::string idx = Running(l, at, dims, *dim, "maximum", -1, i64);
        return std::vector<std::string>{v, l.Convert(idx, dims, i64, *o[1].type)};
      };
    }
    // The LU family, from LuFactor: linalg_lu_factor_ex(A, pivot,
    // check_errors) -> (LU, pivots, info); linalg_lu(A, pivot) -> (P, L, U);
    // lu_unpack(LU, pivots, unpack_data, unpack_pivots) -> (P, L, U);
    // linalg_inv_ex(A, check_errors) -> (inverse, info); _linalg_solve_ex(A,
    // B, left, check_errors) -> (result, LU, pivots, info); _linalg_det(A)
    // -> (det, LU, pivots); _linalg_slogdet(A) -> (sign, logabsdet, LU,
    // pivots). Without pivoting is not lowered.
    enum class LuOp { kFactor, kLu, kUnpack, kInv, kSolve, kDet, kSlogdet };
    for (LuOp which : {LuOp::kFactor, LuOp::kLu, LuOp::kUnpack, LuOp::kInv, LuOp::kSolve, LuOp::kDet, LuOp::kSlogdet}) {
      MultiRule r = [which](Lowering& l, const tpu::DecodedOp& d, const std::vector<Target>& o)
          -> absl::StatusOr<std::vector<std::string>> {
        const size_t want = which == LuOp::kFactor || which == LuOp::kLu || which == LuOp::kUnpack || which == LuOp::kDet ? 3
                          : which == LuOp::kInv ? 2 : 4;
        if (o.size() != want || !Defined(d, 0) || d.args[0].tensor.ndim < 2) return Unsupported(l.op(), "expects a matrix or a batch of them");
        if ((which == LuOp::kFactor || which == LuOp::kLu) && d.num_args > 1 && d.args[1].tag == tpu::ArgTag::kBool && !d.args[1].b) {
          return Unsupported(l.op(), "LU without pivoting");
        }
        const DType& i64 = I64();
        // The type the factorization runs in: the first float output's.
        const DType& t = which == LuOp::kSlogdet ? *o[1].type : *o[0].type;
        // A's dims: broadcast over the batch where an output says so.
        const std::vector<int64_t> ad = which == LuOp::kFactor ? o[0].dims
                                      : which == LuOp::kSolve ? o[1].dims
                                      : which == LuOp::kDet ? o[1].dims
                                      : which == LuOp::kSlogdet ? o[2].dims
                                      : which == LuOp::kInv ? o[0].dims : DimsOf(d.args[0].tensor);
        if (ad.size() < 2) return Unsupported(l.op(), "expects a matrix or a batch of them");
        const MatrixShape as(ad);
        const int64_t k = std::min(as.m, as.n);
        if ((which == LuOp::kInv || which == LuOp::kSolve || which == LuOp::kDet || which == LuOp::kSlogdet) && as.m != as.n) {
          return absl::InvalidArgumentError(absl::StrCat(l.op(), ": A must be batches of square matrices, but they are ", as.m,
                                                         " by ", as.n, " matrices"));
        }
        absl::StatusOr<std::string> av = l.Operand(d.args[0], DimsOf(d.args[0].tensor), t);
        if (!av.ok()) return av.status();
        const std::string a = l.BroadcastTo(*av, DimsOf(d.args[0].tensor), ad, t);
        std::vector<int64_t> pdims = as.batch;
        pdims.push_back(k);
        Lu f;
        if (which == LuOp::kUnpack) {
          f.lu = a;
          if (!Defined(d, 1)) return Unsupported(l.op(), "expects pivots");
          absl::StatusOr<std::string> pv = l.Operand(d.args[1], pdims, i64);
          if (!pv.ok()) return pv.status();
          f.pivots = *pv;
        } else {
          f = LuFactor(l, a, as, t);
        }
        auto as_type = [&](const std::string& v, const std::vector<int64_t>& dims, const DType& from, const Target& out) {
          return l.Reshape(l.Convert(v, dims, from, *out.type), dims, out.dims, *out.type);
        };
        auto unpack = [&]() {
          // P from the swaps applied to the identity (its transpose), L unit
          // lower (m x k), U upper (k x n).
          const MatrixShape ps(WithBatch({as.m, as.m}, as.batch));
          const std::string swapped = ApplySwaps(l, Identity(l, ps.dims, t), ps, f.pivots, k, false, t);
          std::vector<int64_t> perm = ps.batch_map;
          perm.push_back(ps.rank() - 1);
          perm.push_back(ps.rank() - 2);
          const std::string pm = l.Emit(absl::StrCat("stablehlo.transpose ", swapped, ", dims = [", absl::StrJoin(perm, ", "), "] : (",
                                                     TypeOf(ps.dims, t), ") -> ", TypeOf(ps.dims, t)));
          const std::vector<int64_t> ld = WithBatch({as.m, k}, as.batch), ud = WithBatch({k, as.n}, as.batch);
          std::vector<int64_t> zero(ad.size(), 0);
          const std::string lpart = l.Slice(f.lu, ad, zero, ld, t);
          std::vector<int64_t> ustart(ad.size(), 0);
          const std::string upart = l.Slice(f.lu, ad, ustart, ud, t);
          const MatrixShape ls(ld);
          const std::string ri = l.Iota(ls.rank() - 2, ld, i64), ci = l.Iota(ls.rank() - 1, ld, i64);
          std::string lower = l.Select(l.Compare("GT", ri, ci, ld, i64), lpart, l.Constant(0, ld, t), ld, t);
          lower = l.Select(l.Compare("EQ", ri, ci, ld, i64), l.Constant(1, ld, t), lower, ld, t);
          const std::string upper = Triangle(l, upart, ud, false, t);
          return std::vector<std::string>{pm, lower, upper};
        };
        switch (which) {
          case LuOp::kFactor:
            return std::vector<std::string>{f.lu, as_type(f.pivots, pdims, i64, o[1]), as_type(f.info, as.batch, i64, o[2])};
          case LuOp::kLu:
          case LuOp::kUnpack: {
            std::vector<std::string> v = unpack();
            for (size_t q = 0; q < 3; ++q) {
              if (Numel(*o[q].ref) == 0 || o[q].dims != DimsOf(*o[q].ref)) v[q] = l.Constant(0, o[q].dims, *o[q].type);
              else v[q] = l.Convert(v[q], o[q].dims, t, *o[q].type);
            }
            return v;
          }
          case LuOp::kInv: {
            const std::string x = LuSolve(l, f.lu, ad, f.pivots, Identity(l, ad, t), as, false, t);
            return std::vector<std::string>{x, as_type(f.info, as.batch, i64, o[1])};
          }
          case LuOp::kSolve: {
            if (d.num_args < 3 || !Defined(d, 1)) return Unsupported(l.op(), "expects A and B");
            if (d.args[2].tag == tpu::ArgTag::kBool && !d.args[2].b) return Unsupported(l.op(), "left=False");
            // B as a batch of matrices: a vector gets a column dimension.
            const std::vector<int64_t>& rd = o[0].dims;
            const bool vector = rd.size() + 1 == ad.size();
            const std::vector<int64_t> bd = vector ? [&] { std::vector<int64_t> v = rd; v.push_back(1); return v; }() : rd;
            const std::vector<int64_t> bin = DimsOf(d.args[1].tensor);
            absl::StatusOr<std::string> bv = l.Operand(d.args[1], bin, t);
            if (!bv.ok()) return bv.status();
            std::string b = l.BroadcastTo(*bv, bin, rd, t);
            b = l.Reshape(b, rd, bd, t);
            const MatrixShape bs(bd);
            if (bs.m != as.n || bs.batch != as.batch) return Unsupported(l.op(), "B of a shape not lowered");
            const std::string x = l.Reshape(LuSolve(l, f.lu, ad, f.pivots, b, bs, false, t), bd, rd, t);
            return std::vector<std::string>{x, f.lu, as_type(f.pivots, pdims, i64, o[2]), as_type(f.info, as.batch, i64, o[3])};
          }
          case LuOp::kDet:
          case LuOp::kSlogdet: {
            const std::string diag = Diagonal(l, f.lu, as, t);
            std::vector<int64_t> dd = as.batch;
            dd.push_back(as.n);
            const int64_t last = static_cast<int64_t>(dd.size() - 1);
            const std::string sign = SwapSign(l, f.pivots, as.batch, k, t);
            if (which == LuOp::kDet) {
              const std::string prod = l.ReduceOver(diag, dd, {last}, "multiply", l.Constant(1, {}, t), t);
              return std::vector<std::string>{l.Reshape(l.Binary("multiply", sign, prod, as.batch, t), as.batch, o[0].dims, t), f.lu,
                                              as_type(f.pivots, pdims, i64, o[2])};
            }
            const std::string signs = l.ReduceOver(l.Unary("sign", diag, dd, t), dd, {last}, "multiply", l.Constant(1, {}, t), t);
            const std::string logabs = l.ReduceOver(l.Unary("log", l.Unary("abs", diag, dd, t), dd, t), dd, {last}, "add",
                                                    l.Constant(0, {}, t), t);
            return std::vector<std::string>{l.Reshape(l.Binary("multiply", sign, signs, as.batch, t), as.batch, o[0].dims, t),
                                            l.Reshape(logabs, as.batch, o[1].dims, t), f.lu, as_type(f.pivots, pdims, i64, o[3])};
          }
        }
        return Unsupported(l.op(), "this form");
      };
      const char* const* names;
      static const char* kFactor[] = {"aten::linalg_lu_factor_ex", "aten::linalg_lu_factor_ex.out", nullptr};
      static const char* kLu[] = {"aten::linalg_lu", "aten::linalg_lu.out", nullptr};
      static const char* kUnpack[] = {"aten::lu_unpack", "aten::lu_unpack.out", nullptr};
      static const char* kInv[] = {"aten::linalg_inv_ex", "aten::linalg_inv_ex.inverse", nullptr};
      static const char* kSolve[] = {"aten::_linalg_solve_ex", "aten::_linalg_solve_ex.result", nullptr};
      static const char* kDet[] = {"aten::_linalg_det", "aten::_linalg_det.result", nullptr};
      static const char* kSlogdet[] = {"aten::_linalg_slogdet", "aten::_linalg_slogdet.sign", nullptr};
      switch (which) {
        case LuOp::kFactor: names = kFactor; break;
        case LuOp::kLu: names = kLu; break;
        case LuOp::kUnpack: names = kUnpack; break;
        case LuOp::kInv: names = kInv; break;
        case LuOp::kSolve: names = kSolve; break;
        case LuOp::kDet: names = kDet; break;
        default: names = kSlogdet; break;
      }
      for (const char* const* n = names; *n != nullptr; ++n) (*m)[*n] = r;
    }
    return m;
  }();
  return *rules;
}

// Single-output rules that need the helpers above.
const std::map<std::string, Rule>& MoreRules() {
  static const auto* rules = [] {
    auto* m = new std::map<std::string, Rule>;
    for (bool log : {true, false}) {
      (*m)[log ? "aten::_log_softmax" : "aten::_softmax"] =
          [log](Lowering& l, const tpu::DecodedOp& d, const Target& o) -> absl::StatusOr<std::string> {
        if (!Defined(d, 0) || d.num_args < 2) return Unsupported(l.op(), "arguments of a form not lowered");
        absl::StatusOr<std::string> x = l.Operand(d.args[0], o.dims, *o.type);
        if (!x.ok()) return x;
        return SoftmaxOf(l, *x, o.dims, WrapDim(d.args[1].i, o.dims.size()), *o.type, log);
      };
      (*m)[log ? "aten::_log_softmax_backward_data" : "aten::_softmax_backward_data"] =
          [log](Lowering& l, const tpu::DecodedOp& d, const Target& o) -> absl::StatusOr<std::string> {
        // (grad_output, output, dim, input_dtype)
        if (!Defined(d, 0) || !Defined(d, 1) || d.num_args < 3) return Unsupported(l.op(), "arguments of a form not lowered");
        const DType& t = *o.type;
        absl::StatusOr<std::string> g = l.Operand(d.args[0], o.dims, t), y = l.Operand(d.args[1], o.dims, t);
        if (!g.ok()) return g;
        if (!y.ok()) return y;
        const std::vector<int64_t> which = {WrapDim(d.args[2].i, o.dims.size())};
        const std::string zero = l.Constant(0, {}, t);
        if (log) {
          const std::string sum = l.Expand(l.ReduceOver(*g, o.dims, which, "add", zero, t), o.dims, which, t);
          return l.Binary("subtract", *g, l.Binary("multiply", l.Unary("exponential", *y, o.dims, t), sum, o.dims, t), o.dims, t);
        }
        const std::string gy = l.Binary("multiply", *g, *y, o.dims, t);
        const std::string sum = l.Expand(l.ReduceOver(gy, o.dims, which, "add", zero, t), o.dims, which, t);
        return l.Binary("multiply", *y, l.Binary("subtract", *g, sum, o.dims, t), o.dims, t);
      };
    }
    for (bool largest : {true, false}) {
    (*m)[largest ? "aten::argmax" : "aten::argmin"] = [largest](Lowering& l, const tpu::DecodedOp& d, const Target& o)
        -> absl::StatusOr<std::string> {
      // (self, dim?, keepdim): the first index of the largest (smallest) value.
      if (!Defined(d, 0)) return Unsupported(l.op(), "arguments of a form not lowered");
      const tpu::TensorRef& x = d.args[0].tensor;
      const DType* xt = DTypeOf(x.dtype);
      if (xt == nullptr) return Unsupported(l.op(), "dtype");
      std::vector<int64_t> in = DimsOf(x);
      absl::StatusOr<std::string> v = l.Tensor(x, 0);
      if (!v.ok()) return v;
      std::string xv = *v;
      int64_t dim;
      const bool all = d.num_args < 2 || (d.args[1].tag != tpu::ArgTag::kInt && d.args[1].tag != tpu::ArgTag::kSymInt);
      if (!all && in.empty()) {
        // A 0-d tensor has one dimension to name: 0 or -1.
        if (absl::StatusOr<int64_t> c = CheckedDim(l.op(), d.args[1].i, 1); !c.ok()) return c.status();
      }
      if (all || in.empty()) {
        int64_t n = 1;
        for (int64_t s : in) n *= s;
        xv = l.Reshape(xv, in, {n}, *xt);
        in = {n};
        dim = 0;
      } else {
        absl::StatusOr<int64_t> checked = CheckedDim(l.op(), d.args[1].i, in.size());
        if (!checked.ok()) return checked.status();
        dim = *checked;
      }
      const std::vector<int64_t> which = {dim};
      const std::string mx = largest ? l.ReduceOver(xv, in, which, "maximum", l.Lowest(*xt), *xt)
                                     : l.ReduceOver(xv, in, which, "minimum", Highest(l, *xt), *xt);
      const std::string mxe = l.Expand(mx, in, which, *xt);
      std::string hit = l.Compare("EQ", xv, mxe, in, *xt);
      if (xt->is_float) {
        // NaN is the largest and the smallest: its first place is the answer.
        const DType& i1 = *DTypeOf(11);
        const std::string nan = l.Binary("and", l.Compare("NE", xv, xv, in, *xt), l.Compare("NE", mxe, mxe, in, *xt), in, i1);
        hit = l.Binary("or", hit, nan, in, i1);
      }
      const DType& i64 = I64();
      const std::string idx = l.Select(hit, l.Iota(dim, in, i64), l.Constant(static_cast<double>(in[dim]), in, i64), in, i64);
      const std::string r = l.ReduceOver(idx, in, which, "minimum", l.Constant(static_cast<double>(in[dim]), {}, i64), i64);
      return l.Reshape(l.Convert(r, Lowering::Kept(in, which), i64, *o.type), Lowering::Kept(in, which), o.dims, *o.type);
    };
    }
    for (const auto& [name, dir] : std::vector<std::pair<std::string, const char*>>{
             {"eq", "EQ"}, {"ne", "NE"}, {"lt", "LT"}, {"le", "LE"}, {"gt", "GT"}, {"ge", "GE"}}) {
      for (const char* overload : {".Tensor", ".Scalar", ".Tensor_out", ".Scalar_out"}) {
        const char* cmp = dir;
        (*m)["aten::" + name + overload] = [cmp](Lowering& l, const tpu::DecodedOp& d, const Target& o)
            -> absl::StatusOr<std::string> {
          if (d.num_args < 2) return Unsupported(l.op(), "arguments of a form not lowered");
          // Compared in a type both sides fit: double if either is floating.
          bool floating = false;
          for (size_t i = 0; i < 2; ++i) {
            const tpu::OpArg& a = d.args[i];
            const DType* t = a.tag == tpu::ArgTag::kTensor ? DTypeOf(a.tensor.dtype) : nullptr;
            floating |= (t != nullptr && t->is_float) || a.tag == tpu::ArgTag::kScalarDouble ||
                        (a.tag == tpu::ArgTag::kScalarTensor && DTypeOf(a.dtype) != nullptr && DTypeOf(a.dtype)->is_float);
          }
          const DType& t = floating ? F64() : I64();
          absl::StatusOr<std::string> a = l.Operand(d.args[0], o.dims, t), b = l.Operand(d.args[1], o.dims, t);
          if (!a.ok()) return a;
          if (!b.ok()) return b;
          return l.Convert(l.Compare(cmp, *a, *b, o.dims, t), o.dims, *DTypeOf(11), *o.type);
        };
      }
    }
    (*m)["aten::gelu"] = [](Lowering& l, const tpu::DecodedOp& d, const Target& o)
        -> absl::StatusOr<std::string> {
      absl::StatusOr<bool> approx = TanhGelu(l, d, 1);
      if (!approx.ok()) return approx.status();
      absl::StatusOr<std::string> x = l.Operand(d.args[0], o.dims, *o.type);
      if (!x.ok()) return x;
      if (*approx) {
        const DType& t = *o.type;
        const std::string th = GeluTanhInner(l, *x, o.dims, t);
        return l.Binary("multiply", l.Binary("multiply", l.Constant(0.5, o.dims, t), *x, o.dims, t),
                        l.Binary("add", l.Constant(1, o.dims, t), th, o.dims, t), o.dims, t);
      }
      return l.Binary("multiply", *x, GeluCdf(l, *x, o.dims, *o.type), o.dims, *o.type);
    };
    (*m)["aten::gelu_backward"] = [](Lowering& l, const tpu::DecodedOp& d, const Target& o)
        -> absl::StatusOr<std::string> {
      // (grad_output, self, approximate): grad * (cdf(x) + x * pdf(x))
      absl::StatusOr<bool> approx = TanhGelu(l, d, 2);
      if (!approx.ok()) return approx.status();
      if (d.num_args < 2) return Unsupported(l.op(), "arguments of a form not lowered");
      const DType& t = *o.type;
      absl::StatusOr<std::string> g = l.Operand(d.args[0], o.dims, t), x = l.Operand(d.args[1], o.dims, t);
      if (!g.ok()) return g;
      if (!x.ok()) return x;
      if (*approx) {
        // 0.5 (1 + th) + 0.5 x (1 - th^2) sqrt(2 / pi) (1 + 3 * 0.044715 x^2)
        const std::string th = GeluTanhInner(l, *x, o.dims, t);
        const std::string x2 = l.Binary("multiply", *x, *x, o.dims, t);
        const std::string du = l.Binary("multiply", l.Constant(0.79788456080286536, o.dims, t),
                                        l.Binary("add", l.Constant(1, o.dims, t), l.Binary("multiply", l.Constant(0.134145, o.dims, t), x2, o.dims, t), o.dims, t), o.dims, t);
        const std::string sech2 = l.Binary("subtract", l.Constant(1, o.dims, t), l.Binary("multiply", th, th, o.dims, t), o.dims, t);
        const std::string dd = l.Binary("add", l.Binary("multiply", l.Constant(0.5, o.dims, t), l.Binary("add", l.Constant(1, o.dims, t), th, o.dims, t), o.dims, t),
                                        l.Binary("multiply", l.Binary("multiply", l.Constant(0.5, o.dims, t), *x, o.dims, t), l.Binary("multiply", sech2, du, o.dims, t), o.dims, t), o.dims, t);
        return l.Binary("multiply", *g, dd, o.dims, t);
      }
      const std::string x2 = l.Binary("multiply", *x, *x, o.dims, t);
      const std::string pdf = l.Binary("multiply", l.Constant(0.39894228040143268, o.dims, t),
                                       l.Unary("exponential", l.Binary("multiply", x2, l.Constant(-0.5, o.dims, t), o.dims, t), o.dims, t), o.dims, t);
      const std::string dd = l.Binary("add", GeluCdf(l, *x, o.dims, t), l.Binary("multiply", *x, pdf, o.dims, t), o.dims, t);
      return l.Binary("multiply", *g, dd, o.dims, t);
    };
    // self + weight * (end - self)
    for (const char* name : {"aten::lerp.Scalar", "aten::lerp_.Scalar", "aten::lerp.Scalar_out",
                             "aten::lerp.Tensor", "aten::lerp_.Tensor", "aten::lerp.Tensor_out"}) {
      (*m)[name] = [](Lowering& l, const tpu::DecodedOp& d, const Target& o)
          -> absl::StatusOr<std::string> {
        if (d.num_args < 3) return Unsupported(l.op(), "arguments of a form not lowered");
        const DType& t = *o.type;
        absl::StatusOr<std::string> a = l.Operand(d.args[0], o.dims, t), b = l.Operand(d.args[1], o.dims, t),
                                    w = l.Operand(d.args[2], o.dims, t);
        for (auto* v : {&a, &b, &w}) if (!v->ok()) return *v;
        return l.Binary("add", *a, l.Binary("multiply", *w, l.Binary("subtract", *b, *a, o.dims, t), o.dims, t), o.dims, t);
      };
    }
    // self + value * (t1 * t2), self + value * (t1 / t2)
    for (const char* base : {"addcmul", "addcdiv"}) {
      const bool mul = std::string(base) == "addcmul";
      for (const std::string suffix : {"", "_", ".out"}) {
        (*m)[absl::StrCat("aten::", base, suffix)] = [mul](Lowering& l, const tpu::DecodedOp& d, const Target& o)
            -> absl::StatusOr<std::string> {
          if (d.num_args < 3) return Unsupported(l.op(), "arguments of a form not lowered");
          const DType& t = *o.type;
          absl::StatusOr<std::string> a = l.Operand(d.args[0], o.dims, t), b = l.Operand(d.args[1], o.dims, t),
                                      c = l.Operand(d.args[2], o.dims, t);
          for (auto* v : {&a, &b, &c}) if (!v->ok()) return *v;
          std::string prod = l.Binary(mul ? "multiply" : "divide", *b, *c, o.dims, t);
          if (d.num_args > 3 && NumberOf(d.args[3]) != 1.0) {
            absl::StatusOr<std::string> v = l.Operand(d.args[3], o.dims, t);
            if (!v.ok()) return v;
            prod = l.Binary("multiply", prod, *v, o.dims, t);
          }
          return l.Binary("add", *a, prod, o.dims, t);
        };
      }
    }
    (*m)["aten::gelu_backward.grad_input"] = (*m)["aten::gelu_backward"];
    return m;
  }();
  return *rules;
}

// Elementwise and reduction rules of the long tail, and the in-place and
// out= forms every functional rule gets.
const std::map<std::string, Rule>& TailRules() {
  static const auto* rules = [] {
    auto* m = new std::map<std::string, Rule>;
    using F = std::function<std::string(Lowering&, const std::string&, const Target&)>;
    auto unary = [m](const std::string& name, F f) {
      (*m)[name] = UnaryRule(std::move(f));
    };
    auto c = [](Lowering& l, double v, const Target& o) { return l.Constant(v, o.dims, *o.type); };
    auto B = [](Lowering& l, const char* op, const std::string& a, const std::string& b, const Target& o) {
      return l.Binary(op, a, b, o.dims, *o.type);
    };
    auto U = [](Lowering& l, const char* op, const std::string& a, const Target& o) {
      return l.Unary(op, a, o.dims, *o.type);
    };
    for (const auto& [name, op] : std::vector<std::pair<std::string, const char*>>{
             {"floor", "floor"}, {"ceil", "ceil"}, {"round", "round_nearest_even"},
             {"sign", "sign"}, {"sgn", "sign"}, {"log1p", "log_plus_one"},
             {"expm1", "exponential_minus_one"}, {"tan", "tan"}}) {
      (*m)["aten::" + name] = Simple(op);
    }
    unary("aten::reciprocal", [=](Lowering& l, const std::string& x, const Target& o) { return B(l, "divide", c(l, 1, o), x, o); });
    unary("aten::square", [=](Lowering& l, const std::string& x, const Target& o) { return B(l, "multiply", x, x, o); });
    unary("aten::trunc", [=](Lowering& l, const std::string& x, const Target& o) {
      return B(l, "multiply", U(l, "sign", x, o), U(l, "floor", U(l, "abs", x, o), o), o);
    });
    unary("aten::erf", [](Lowering& l, const std::string& x, const Target& o) { return Erf(l, x, o.dims, *o.type); });
    unary("aten::atan", [=](Lowering& l, const std::string& x, const Target& o) { return B(l, "atan2", x, c(l, 1, o), o); });
    unary("aten::asin", [=](Lowering& l, const std::string& x, const Target& o) {
      return B(l, "atan2", x, U(l, "sqrt", B(l, "subtract", c(l, 1, o), B(l, "multiply", x, x, o), o), o), o);
    });
    unary("aten::acos", [=](Lowering& l, const std::string& x, const Target& o) {
      return B(l, "atan2", U(l, "sqrt", B(l, "subtract", c(l, 1, o), B(l, "multiply", x, x, o), o), o), x, o);
    });
    for (bool sinh : {true, false}) {
      unary(sinh ? "aten::sinh" : "aten::cosh", [=](Lowering& l, const std::string& x, const Target& o) {
        const std::string e = U(l, "exponential", x, o), f = U(l, "exponential", U(l, "negate", x, o), o);
        return B(l, "multiply", B(l, sinh ? "subtract" : "add", e, f, o), c(l, 0.5, o), o);
      });
    }
    unary("aten::log2", [=](Lowering& l, const std::string& x, const Target& o) { return B(l, "divide", U(l, "log", x, o), c(l, 0.69314718055994531, o), o); });
    unary("aten::log10", [=](Lowering& l, const std::string& x, const Target& o) { return B(l, "divide", U(l, "log", x, o), c(l, 2.3025850929940457, o), o); });
    unary("aten::silu", [=](Lowering& l, const std::string& x, const Target& o) { return B(l, "multiply", x, U(l, "logistic", x, o), o); });
    unary("aten::exp2", [=](Lowering& l, const std::string& x, const Target& o) { return B(l, "power", c(l, 2, o), x, o); });
    // Predicates of one tensor: computed on its own dtype, written as bool.
    for (const auto& [name, kind] : std::vector<std::pair<std::string, int>>{
             {"logical_not", 0}, {"isnan", 1}, {"isinf", 2}, {"isfinite", 3}}) {
      const int k = kind;
      (*m)["aten::" + name] = [k](Lowering& l, const tpu::DecodedOp& d, const Target& o)
          -> absl::StatusOr<std::string> {
        if (!Defined(d, 0)) return Unsupported(l.op(), "expects a tensor");
        const DType* t = DTypeOf(d.args[0].tensor.dtype);
        if (t == nullptr) return Unsupported(l.op(), "dtype");
        if (k != 0 && !t->is_float) {
          return l.Convert(l.Constant(k == 3 ? 1 : 0, o.dims, *DTypeOf(11)), o.dims, *DTypeOf(11), *o.type);
        }
        absl::StatusOr<std::string> x = l.Operand(d.args[0], o.dims, *t);
        if (!x.ok()) return x;
        std::string p;
        if (k == 0) p = l.Compare("EQ", *x, l.Constant(0, o.dims, *t), o.dims, *t);
        if (k == 1) p = l.Compare("NE", *x, *x, o.dims, *t);
        if (k == 2) p = l.Compare("EQ", l.Unary("abs", *x, o.dims, *t), l.Unary("abs", l.Binary("divide", l.Constant(1, o.dims, *t), l.Constant(0, o.dims, *t), o.dims, *t), o.dims, *t), o.dims, *t);
        if (k == 3) p = l.Emit(absl::StrCat("stablehlo.is_finite ", *x, " : (", TypeOf(o.dims, *t), ") -> ", TypeOf(o.dims, *DTypeOf(11))));
        return l.Convert(p, o.dims, *DTypeOf(11), *o.type);
      };
    }
    for (const char* ov : {".Tensor", ".Scalar"}) {
      (*m)[std::string("aten::atan2") + (std::string(ov) == ".Tensor" ? "" : ".Scalar")] = BinaryRule("atan2", false);
      (*m)[std::string("aten::remainder") + ov] = [](Lowering& l, const tpu::DecodedOp& d, const Target& o)
          -> absl::StatusOr<std::string> {
        // Python's %: the result has the divisor's sign.
        const DType& t = *o.type;
        absl::StatusOr<std::string> a = l.Operand(d.args[0], o.dims, t), b = l.Operand(d.args[1], o.dims, t);
        if (!a.ok()) return a;
        if (!b.ok()) return b;
        const std::string r = l.Binary("remainder", *a, *b, o.dims, t);
        const std::string zero = l.Constant(0, o.dims, t);
        const std::string nz = l.Compare("NE", r, zero, o.dims, t);
        const std::string differ = l.Compare("NE", l.Compare("LT", r, zero, o.dims, t), l.Compare("LT", *b, zero, o.dims, t), o.dims, *DTypeOf(11));
        const std::string fix = l.Emit(absl::StrCat("stablehlo.and ", nz, ", ", differ, " : ", TypeOf(o.dims, *DTypeOf(11))));
        return l.Select(fix, l.Binary("add", r, *b, o.dims, t), r, o.dims, t);
      };
      for (const auto& [name, op] : std::vector<std::pair<std::string, const char*>>{
               {"bitwise_and", "and"}, {"bitwise_or", "or"}, {"bitwise_xor", "xor"}}) {
        (*m)["aten::" + name + ov] = BinaryRule(op, false);
      }
    }
    for (const auto& [name, op] : std::vector<std::pair<std::string, const char*>>{
             {"logical_and", "and"}, {"logical_or", "or"}, {"logical_xor", "xor"}}) {
      const char* hlo = op;
      (*m)["aten::" + name] = [hlo](Lowering& l, const tpu::DecodedOp& d, const Target& o)
          -> absl::StatusOr<std::string> {
        const DType& f = F64();
        const DType& pred = *DTypeOf(11);
        absl::StatusOr<std::string> a = l.Operand(d.args[0], o.dims, f), b = l.Operand(d.args[1], o.dims, f);
        if (!a.ok()) return a;
        if (!b.ok()) return b;
        const std::string zero = l.Constant(0, o.dims, f);
        const std::string r = l.Emit(absl::StrCat("stablehlo.", hlo, " ", l.Compare("NE", *a, zero, o.dims, f), ", ",
                                                  l.Compare("NE", *b, zero, o.dims, f), " : ", TypeOf(o.dims, pred)));
        return l.Convert(r, o.dims, pred, *o.type);
      };
    }
    (*m)["aten::logaddexp"] = [](Lowering& l, const tpu::DecodedOp& d, const Target& o)
        -> absl::StatusOr<std::string> {
      const DType& t = *o.type;
      absl::StatusOr<std::string> a = l.Operand(d.args[0], o.dims, t), b = l.Operand(d.args[1], o.dims, t);
      if (!a.ok()) return a;
      if (!b.ok()) return b;
      const std::string mx = l.Binary("maximum", *a, *b, o.dims, t);
      const std::string diff = l.Unary("negate", l.Unary("abs", l.Binary("subtract", *a, *b, o.dims, t), o.dims, t), o.dims, t);
      return l.Binary("add", mx, l.Unary("log_plus_one", l.Unary("exponential", diff, o.dims, t), o.dims, t), o.dims, t);
    };
    // clamp(self, min?, max?): bounds are scalars or tensors, either may be absent.
    auto clamp = [](bool lo, bool hi) {
      return [lo, hi](Lowering& l, const tpu::DecodedOp& d, const Target& o) -> absl::StatusOr<std::string> {
        const DType& t = *o.type;
        absl::StatusOr<std::string> x = l.Operand(d.args[0], o.dims, t);
        if (!x.ok()) return x;
        std::string r = *x;
        size_t i = 1;
        for (bool use : {lo, hi}) {
          if (!use) continue;
          const size_t k = i++;
          if (k >= d.num_args) break;
          const tpu::ArgTag tag = d.args[k].tag;
          if (tag == tpu::ArgTag::kNone || tag == tpu::ArgTag::kUndefinedTensor) continue;
          absl::StatusOr<std::string> b = l.Operand(d.args[k], o.dims, t);
          if (!b.ok()) return b;
          r = l.Binary(use && k == 1 && lo ? "maximum" : "minimum", r, *b, o.dims, t);
        }
        return r;
      };
    };
    (*m)["aten::clamp"] = clamp(true, true);
    (*m)["aten::clamp.Tensor"] = clamp(true, true);
    (*m)["aten::clamp_min"] = clamp(true, false);
    (*m)["aten::clamp_min.Tensor"] = clamp(true, false);
    (*m)["aten::clamp_max"] = clamp(false, true);
    (*m)["aten::clamp_max.Tensor"] = clamp(false, true);
    (*m)["aten::hardtanh"] = clamp(true, true);
    (*m)["aten::where.self"] = [](Lowering& l, const tpu::DecodedOp& d, const Target& o)
        -> absl::StatusOr<std::string> {
      if (d.num_args < 3) return Unsupported(l.op(), "arguments of a form not lowered");
      const DType& pred = *DTypeOf(11);
      absl::StatusOr<std::string> cnd = l.Operand(d.args[0], o.dims, pred);
      absl::StatusOr<std::string> a = l.Operand(d.args[1], o.dims, *o.type), b = l.Operand(d.args[2], o.dims, *o.type);
      for (auto* v : {&cnd, &a, &b}) if (!v->ok()) return *v;
      return l.Select(*cnd, *a, *b, o.dims, *o.type);
    };
    for (const char* name : {"aten::masked_fill.Scalar", "aten::masked_fill.Tensor"}) {
      (*m)[name] = [](Lowering& l, const tpu::DecodedOp& d, const Target& o) -> absl::StatusOr<std::string> {
        if (d.num_args < 3) return Unsupported(l.op(), "arguments of a form not lowered");
        absl::StatusOr<std::string> x = l.Operand(d.args[0], o.dims, *o.type);
        absl::StatusOr<std::string> mask = l.Operand(d.args[1], o.dims, *DTypeOf(11));
        absl::StatusOr<std::string> v = l.Operand(d.args[2], o.dims, *o.type);
        for (auto* p : {&x, &mask, &v}) if (!p->ok()) return *p;
        return l.Select(*mask, *v, *x, o.dims, *o.type);
      };
    }
    for (const char* name : {"aten::rsub.Tensor", "aten::rsub.Scalar"}) {
      (*m)[name] = [](Lowering& l, const tpu::DecodedOp& d, const Target& o) -> absl::StatusOr<std::string> {
        // other - alpha * self
        absl::StatusOr<std::string> a = l.Operand(d.args[0], o.dims, *o.type), b = l.Operand(d.args[1], o.dims, *o.type);
        if (!a.ok()) return a;
        if (!b.ok()) return b;
        std::string s = *a;
        if (d.num_args > 2 && NumberOf(d.args[2]) != 1.0) {
          absl::StatusOr<std::string> al = l.Operand(d.args[2], o.dims, *o.type);
          if (!al.ok()) return al;
          s = l.Binary("multiply", s, *al, o.dims, *o.type);
        }
        return l.Binary("subtract", *b, s, o.dims, *o.type);
      };
    }
    (*m)["aten::fill_.Tensor"] = [](Lowering& l, const tpu::DecodedOp& d, const Target& o)
        -> absl::StatusOr<std::string> {
      if (d.num_args < 2) return Unsupported(l.op(), "arguments of a form not lowered");
      return l.Operand(d.args[1], o.dims, *o.type);
    };
    (*m)["aten::leaky_relu"] = [](Lowering& l, const tpu::DecodedOp& d, const Target& o)
        -> absl::StatusOr<std::string> {
      const DType& t = *o.type;
      absl::StatusOr<std::string> x = l.Operand(d.args[0], o.dims, t);
      if (!x.ok()) return x;
      const double slope = d.num_args > 1 ? NumberOf(d.args[1]) : 0.01;
      return l.Select(l.Compare("GT", *x, l.Constant(0, o.dims, t), o.dims, t), *x,
                      l.Binary("multiply", *x, l.Constant(slope, o.dims, t), o.dims, t), o.dims, t);
    };
    (*m)["aten::elu"] = [](Lowering& l, const tpu::DecodedOp& d, const Target& o)
        -> absl::StatusOr<std::string> {
      // (self, alpha, scale, input_scale)
      const DType& t = *o.type;
      absl::StatusOr<std::string> x = l.Operand(d.args[0], o.dims, t);
      if (!x.ok()) return x;
      const double alpha = d.num_args > 1 ? NumberOf(d.args[1]) : 1, scale = d.num_args > 2 ? NumberOf(d.args[2]) : 1,
                   in_scale = d.num_args > 3 ? NumberOf(d.args[3]) : 1;
      const std::string neg = l.Binary("multiply", l.Constant(alpha, o.dims, t),
                                       l.Unary("exponential_minus_one", l.Binary("multiply", *x, l.Constant(in_scale, o.dims, t), o.dims, t), o.dims, t), o.dims, t);
      const std::string r = l.Select(l.Compare("GT", *x, l.Constant(0, o.dims, t), o.dims, t), *x, neg, o.dims, t);
      return l.Binary("multiply", r, l.Constant(scale, o.dims, t), o.dims, t);
    };
    // amax / amin over dims (all when none).
    for (bool mx : {true, false}) {
      (*m)[mx ? "aten::amax" : "aten::amin"] = [mx](Lowering& l, const tpu::DecodedOp& d, const Target& o)
          -> absl::StatusOr<std::string> {
        if (!Defined(d, 0)) return Unsupported(l.op(), "expects a tensor");
        const tpu::TensorRef& x = d.args[0].tensor;
        const std::vector<int64_t> in = DimsOf(x);
        absl::StatusOr<std::vector<int64_t>> which = ReducedDims(l, d, 1, in.size());
        if (!which.ok()) return which.status();
        absl::StatusOr<std::string> v = l.Operand(d.args[0], in, *o.type);
        if (!v.ok()) return v;
        if (in.empty()) return l.Reshape(*v, in, o.dims, *o.type);  // a 0-d tensor: dim 0 / -1 is itself
        const std::string init = mx ? l.Lowest(*o.type) : Highest(l, *o.type);
        const std::string r = l.ReduceOver(*v, in, *which, mx ? "maximum" : "minimum", init, *o.type);
        return l.Reshape(r, Lowering::Kept(in, *which), o.dims, *o.type);
      };
    }
    (*m)["aten::bmm"] = [](Lowering& l, const tpu::DecodedOp& d, const Target& o)
        -> absl::StatusOr<std::string> {
      if (!Defined(d, 0) || !Defined(d, 1) || d.args[0].tensor.ndim != 3 || d.args[1].tensor.ndim != 3) {
        return Unsupported(l.op(), "expects two 3-d tensors");
      }
      const std::vector<int64_t> da = DimsOf(d.args[0].tensor), db = DimsOf(d.args[1].tensor);
      absl::StatusOr<std::string> a = l.Operand(d.args[0], da, *o.type), b = l.Operand(d.args[1], db, *o.type);
      if (!a.ok()) return a;
      if (!b.ok()) return b;
      return l.Emit(absl::StrCat("stablehlo.dot_general ", *a, ", ", *b,
                                 ", batching_dims = [0] x [0], contracting_dims = [2] x [1] : (",
                                 TypeOf(da, *o.type), ", ", TypeOf(db, *o.type), ") -> ", TypeOf(o.dims, *o.type)));
    };
    // Backward of sigmoid and tanh from their output y: grad * y * (1 - y),
    // grad * (1 - y * y).
    for (bool sig : {true, false}) {
      (*m)[sig ? "aten::sigmoid_backward" : "aten::tanh_backward"] =
          [sig](Lowering& l, const tpu::DecodedOp& d, const Target& o) -> absl::StatusOr<std::string> {
        if (d.num_args < 2) return Unsupported(l.op(), "arguments of a form not lowered");
        const DType& t = *o.type;
        absl::StatusOr<std::string> g = l.Operand(d.args[0], o.dims, t), y = l.Operand(d.args[1], o.dims, t);
        if (!g.ok()) return g;
        if (!y.ok()) return y;
        const std::string one = l.Constant(1, o.dims, t);
        const std::string dy = sig ? l.Binary("multiply", *y, l.Binary("subtract", one, *y, o.dims, t), o.dims, t)
                                   : l.Binary("subtract", one, l.Binary("multiply", *y, *y, o.dims, t), o.dims, t);
        return l.Binary("multiply", *g, dy, o.dims, t);
      };
    }
    (*m)["aten::mse_loss"] = [](Lowering& l, const tpu::DecodedOp& d, const Target& o)
        -> absl::StatusOr<std::string> {
      // (self, target, reduction): none 0, mean 1, sum 2
      if (!Defined(d, 0) || d.num_args < 3) return Unsupported(l.op(), "arguments of a form not lowered");
      const DType& t = *o.type;
      const std::vector<int64_t> in = DimsOf(d.args[0].tensor);
      absl::StatusOr<std::string> a = l.Operand(d.args[0], in, t), b = l.Operand(d.args[1], in, t);
      if (!a.ok()) return a;
      if (!b.ok()) return b;
      const std::string diff = l.Binary("subtract", *a, *b, in, t);
      const std::string sq = l.Binary("multiply", diff, diff, in, t);
      const int64_t reduction = static_cast<int64_t>(NumberOf(d.args[2]));
      if (reduction == 0 || in.empty()) return l.Reshape(sq, in, o.dims, t);
      std::vector<int64_t> all;
      int64_t n = 1;
      for (size_t i = 0; i < in.size(); ++i) {
        all.push_back(static_cast<int64_t>(i));
        n *= in[i];
      }
      std::string r = l.ReduceOver(sq, in, all, "add", l.Constant(0, {}, t), t);
      if (reduction == 1) r = l.Binary("divide", r, l.Constant(static_cast<double>(n), {}, t), {}, t);
      return l.Reshape(r, {}, o.dims, t);
    };
    (*m)["aten::mse_loss_backward"] = [](Lowering& l, const tpu::DecodedOp& d, const Target& o)
        -> absl::StatusOr<std::string> {
      // (grad_output, self, target, reduction)
      if (d.num_args < 4) return Unsupported(l.op(), "arguments of a form not lowered");
      const DType& t = *o.type;
      absl::StatusOr<std::string> g = l.Operand(d.args[0], o.dims, t), a = l.Operand(d.args[1], o.dims, t),
                                  b = l.Operand(d.args[2], o.dims, t);
      for (auto* v : {&g, &a, &b}) if (!v->ok()) return *v;
      int64_t n = 1;
      for (int64_t v : o.dims) n *= v;
      const double scale = NumberOf(d.args[3]) == 1 ? 2.0 / static_cast<double>(n) : 2.0;
      return l.Binary("multiply", l.Binary("multiply", l.Binary("subtract", *a, *b, o.dims, t), *g, o.dims, t),
                      l.Constant(scale, o.dims, t), o.dims, t);
    };
    (*m)["aten::mse_loss_backward.grad_input"] = (*m)["aten::mse_loss_backward"];
    (*m)["aten::sigmoid_backward.grad_input"] = (*m)["aten::sigmoid_backward"];
    (*m)["aten::tanh_backward.grad_input"] = (*m)["aten::tanh_backward"];
    (*m)["aten::dot"] = [](Lowering& l, const tpu::DecodedOp& d, const Target& o)
        -> absl::StatusOr<std::string> {
      if (!Defined(d, 0) || !Defined(d, 1) || d.args[0].tensor.ndim != 1) return Unsupported(l.op(), "expects vectors");
      const std::vector<int64_t> n = DimsOf(d.args[0].tensor);
      absl::StatusOr<std::string> a = l.Operand(d.args[0], n, *o.type), b = l.Operand(d.args[1], n, *o.type);
      if (!a.ok()) return a;
      if (!b.ok()) return b;
      return l.ReduceOver(l.Binary("multiply", *a, *b, n, *o.type), n, {0}, "add", l.Constant(0, {}, *o.type), *o.type);
    };
    return m;
  }();
  return *rules;
}

// A running reduction along `dim` (cumsum, cumprod): a reduce_window whose
// window reaches back over the whole dimension.
std::string Running(Lowering& l, const std::string& x, const std::vector<int64_t>& in, int64_t dim,
                    const char* op, double init, const DType& t, const std::string& init_value) {
  const std::string scalar = TypeOf({}, t);
  const std::string init_v = init_value.empty() ? l.Constant(init, {}, t) : init_value;
  // op "logaddexp": log(exp(acc) + exp(elt)), kept finite where it can be.
  const std::string body = std::string(op) != "logaddexp"
      ? absl::StrCat("      %run = stablehlo.", op, " %acc, %elt : ", scalar, "\n")
      : absl::StrCat("      %hi = stablehlo.maximum %acc, %elt : ", scalar, "\n",
                     "      %gap = stablehlo.subtract %acc, %elt : ", scalar, "\n",
                     "      %ag = stablehlo.abs %gap : ", scalar, "\n",
                     "      %ng = stablehlo.negate %ag : ", scalar, "\n",
                     "      %ex = stablehlo.exponential %ng : ", scalar, "\n",
                     "      %lp = stablehlo.log_plus_one %ex : ", scalar, "\n",
                     "      %sum = stablehlo.add %hi, %lp : ", scalar, "\n",
                     "      %ok = stablehlo.compare EQ, %gap, %gap, FLOAT : (", scalar, ", ", scalar, ") -> tensor<i1>\n",
                     "      %run = stablehlo.select %ok, %sum, %hi : tensor<i1>, ", scalar, "\n");
  std::vector<int64_t> window(in.size(), 1);
  std::vector<std::string> pad;
  for (size_t k = 0; k < in.size(); ++k) {
    if (static_cast<int64_t>(k) == dim) window[k] = in[k];
    pad.push_back(static_cast<int64_t>(k) == dim ? absl::StrCat("[", in[k] - 1, ", 0]") : "[0, 0]");
  }
  return l.Emit(absl::StrCat(
      "\"stablehlo.reduce_window\"(", x, ", ", init_v, ") ({\n",
      "    ^bb0(%acc: ", scalar, ", %elt: ", scalar, "):\n", body,
      "      stablehlo.return %run : ", scalar, "\n",
      "    }) {window_dimensions = array<i64: ", absl::StrJoin(window, ", "), ">, padding = dense<[",
      absl::StrJoin(pad, ", "), "]> : tensor<", in.size(), "x2xi64>} : (", TypeOf(in, t), ", ",
      scalar, ") -> ", TypeOf(in, t)));
}

// `x` (dims `in`) reduced with `op` over windows of `window`, `strides`
// apart, after padding each dimension by (lo, hi) with `init`: dims `out`.
std::string ReduceWindow(Lowering& l, const std::string& x, const std::vector<int64_t>& in,
                         const std::vector<int64_t>& window, const std::vector<int64_t>& strides,
                         const std::vector<std::pair<int64_t, int64_t>>& pads, const char* op, double init,
                         const std::vector<int64_t>& out, const DType& t) {
  const std::string scalar = TypeOf({}, t);
  const std::string init_v = l.Constant(init, {}, t);
  std::vector<std::string> pad;
  for (const auto& [lo, hi] : pads) pad.push_back(absl::StrCat("[", lo, ", ", hi, "]"));
  return l.Emit(absl::StrCat(
      "\"stablehlo.reduce_window\"(", x, ", ", init_v, ") ({\n",
      "    ^bb0(%acc: ", scalar, ", %elt: ", scalar, "):\n",
      "      %run = stablehlo.", op, " %acc, %elt : ", scalar, "\n",
      "      stablehlo.return %run : ", scalar, "\n",
      "    }) {window_dimensions = array<i64: ", absl::StrJoin(window, ", "), ">, window_strides = array<i64: ",
      absl::StrJoin(strides, ", "), ">, padding = dense<[", absl::StrJoin(pad, ", "), "]> : tensor<", in.size(),
      "x2xi64>} : (", TypeOf(in, t), ", ", scalar, ") -> ", TypeOf(out, t)));
}

// Index arrays (each i64 of dims `shape`) stacked along a new last
// dimension, the layout gather and scatter take: shape + [parts.size()].
std::string StackIndices(Lowering& l, const std::vector<std::string>& parts, const std::vector<int64_t>& shape) {
  const DType& i64 = I64();
  std::vector<int64_t> one = shape, all = shape;
  one.push_back(1);
  all.push_back(static_cast<int64_t>(parts.size()));
  std::vector<std::string> columns, types;
  for (const std::string& p : parts) {
    columns.push_back(l.Reshape(p, shape, one, i64));
    types.push_back(TypeOf(one, i64));
  }
  if (columns.size() == 1) return columns[0];
  return l.Emit(absl::StrCat("stablehlo.concatenate ", absl::StrJoin(columns, ", "), ", dim = ", shape.size(),
                             " : (", absl::StrJoin(types, ", "), ") -> ", TypeOf(all, i64)));
}

// For torch.gather / scatter: the full index of every element of an index
// tensor of dims `shape` into a tensor of the same rank, its position on
// each dimension but `dim`, where `along` (i64, dims `shape`) gives it.
std::string ElementIndex(Lowering& l, const std::string& along, const std::vector<int64_t>& shape, int64_t dim) {
  std::vector<std::string> parts;
  for (size_t q = 0; q < shape.size(); ++q) {
    parts.push_back(static_cast<int64_t>(q) == dim ? along : l.Iota(static_cast<int64_t>(q), shape, I64()));
  }
  return StackIndices(l, parts, shape);
}

// 0, 1, ..., n - 1.
std::vector<int64_t> Range(size_t n) {
  std::vector<int64_t> r(n);
  for (size_t q = 0; q < n; ++q) r[q] = static_cast<int64_t>(q);
  return r;
}

// Advanced indexing by integer index tensors (an optional tensor list, one
// entry per leading dimension of self, `in`): the index tensors broadcast
// together to `batch`, negative indices counted from the end, stacked into
// one index array for gather / scatter. The result is self's dimensions with
// the indexed ones replaced by `batch` (in place when they are adjacent, else
// first: NumPy's rule). Bool and byte masks give data-dependent shapes and
// are not lowered.
struct IndexPlan {
  std::vector<int64_t> indexed;  // self's indexed dimensions, in order
  std::vector<int64_t> batch;    // the index tensors' broadcast shape
  std::string indices;           // batch + [indexed.size()] of i64
  std::string indices_type;
  std::vector<int64_t> window;   // the result's positions of self's other dims
  std::vector<int64_t> slice;    // gather's slice sizes (1 on indexed dims)
  std::vector<int64_t> result;
};

absl::StatusOr<IndexPlan> PlanIndex(Lowering& l, const tpu::OpArg& list, const std::vector<int64_t>& in) {
  if (list.tag != tpu::ArgTag::kOptionalTensorList && list.tag != tpu::ArgTag::kTensorList) {
    return Unsupported(l.op(), "arguments of a form not lowered");
  }
  IndexPlan p;
  std::vector<const tpu::TensorRef*> refs;  // (list.tensors has an entry per position)
  for (size_t q = 0; q < list.tensors.size(); ++q) {
    if (q < list.tensor_present.size() && !list.tensor_present[q]) continue;
    const tpu::TensorRef& r = list.tensors[q];
    const DType* it = DTypeOf(r.dtype);
    if (it == nullptr || it->is_float || it->c10 == 11 || it->c10 == 0) {
      return Unsupported(l.op(), "boolean or byte mask indices (their result's shape depends on the data)");
    }
    p.indexed.push_back(static_cast<int64_t>(q));
    refs.push_back(&r);
  }
  if (p.indexed.empty() || p.indexed.back() >= static_cast<int64_t>(in.size())) {
    return Unsupported(l.op(), "arguments of a form not lowered");
  }
  for (const tpu::TensorRef* r : refs) {
    const std::vector<int64_t> s = DimsOf(*r);
    if (s.size() > p.batch.size()) p.batch.insert(p.batch.begin(), s.size() - p.batch.size(), 1);
    for (size_t k = 0; k < s.size(); ++k) {
      int64_t& b = p.batch[p.batch.size() - s.size() + k];
      if (b == 1) {
        b = s[k];
      } else if (s[k] != 1 && s[k] != b) {
        return absl::InvalidArgumentError(l.op() + ": index shapes do not broadcast");
      }
    }
  }
  const DType& i64 = I64();
  const std::vector<int64_t>& bs = p.batch;
  std::vector<int64_t> all = bs;
  all.push_back(static_cast<int64_t>(p.indexed.size()));
  std::vector<std::string> parts;
  for (size_t k = 0; k < refs.size(); ++k) {
    absl::StatusOr<std::string> iv = l.OperandRef(*refs[k], l.TensorIndex(list) + k, bs, i64);
    if (!iv.ok()) return iv.status();
    const int64_t size = in[p.indexed[k]];
    const std::string wrapped = l.Select(l.Compare("LT", *iv, l.Constant(0, bs, i64), bs, i64),
                                         l.Binary("add", *iv, l.Constant(static_cast<double>(size), bs, i64), bs, i64),
                                         *iv, bs, i64);
    l.CheckRange(wrapped, bs, size, absl::StrCat("an index is out of bounds for dimension ", p.indexed[k], " with size ", size));
    parts.push_back(wrapped);
  }
  p.indices = StackIndices(l, parts, bs);
  p.indices_type = TypeOf(all, i64);
  bool adjacent = true;
  for (size_t k = 1; k < p.indexed.size(); ++k) adjacent = adjacent && p.indexed[k] == p.indexed[k - 1] + 1;
  const int64_t at = adjacent ? p.indexed[0] : 0;
  const int64_t nb = static_cast<int64_t>(bs.size());
  // Walk self's dims: an indexed one contributes the batch dims (once, at
  // `at`), another its own size.
  int64_t pos = 0;
  bool batch_placed = false;
  for (size_t q = 0; q < in.size(); ++q) {
    const bool ix = std::find(p.indexed.begin(), p.indexed.end(), static_cast<int64_t>(q)) != p.indexed.end();
    p.slice.push_back(ix ? 1 : in[q]);
    if (!batch_placed && pos == at && (ix || !adjacent)) {
      for (int64_t b : bs) p.result.push_back(b);
      pos += nb;
      batch_placed = true;
    }
    if (ix) continue;
    p.window.push_back(pos++);
    p.result.push_back(in[q]);
  }
  if (!batch_placed) {
    for (int64_t b : bs) p.result.push_back(b);
  }
  return p;
}

// Ops PyTorch's decompositions lean on (arange, var, norms, running sums,
// masks, index_select) and a few more elementwise ones.
const std::map<std::string, Rule>& ExtraRules() {
  static const auto* rules = [] {
    auto* m = new std::map<std::string, Rule>;
    // avg_pool2d / avg_pool3d(self, kernel_size, stride, padding, ceil_mode,
    // count_include_pad, divisor_override) and their backward (grad_output
    // first): window sums by reduce_window over the zero-padded input, each
    // divided by its count, which is itself a window sum of ones over the
    // input (or the padded input, with count_include_pad). The backward
    // spreads grad / count over each window: the gradient dilated by the
    // stride, summed over windows of the kernel's size.
    for (int sp : {2, 3}) {
      for (bool backward : {false, true}) {
        Rule r = [sp, backward](Lowering& l, const tpu::DecodedOp& d, const Target& o) -> absl::StatusOr<std::string> {
          const size_t a0 = backward ? 1 : 0;  // self
          if (d.num_args < a0 + 6 || !Defined(d, a0) || (backward && !Defined(d, 0))) {
            return Unsupported(l.op(), "arguments of a form not lowered");
          }
          const DType& t = *o.type;
          const std::vector<int64_t> in = DimsOf(d.args[a0].tensor);
          const std::vector<int64_t> out = backward ? DimsOf(d.args[0].tensor) : o.dims;
          if (in.size() < static_cast<size_t>(sp) || out.size() != in.size()) {
            return Unsupported(l.op(), "input of too few dimensions");
          }
          const size_t lead = in.size() - sp;
          auto list = [&](size_t i, const std::vector<int64_t>& dflt) -> absl::StatusOr<std::vector<int64_t>> {
            std::vector<int64_t> v = d.args[i].tag == tpu::ArgTag::kIntList ? d.args[i].ints : std::vector<int64_t>{};
            if (v.empty()) v = dflt;
            if (v.size() == 1) v.assign(sp, v[0]);
            if (v.size() != static_cast<size_t>(sp)) return Unsupported(l.op(), "a window list of the wrong length");
            return v;
          };
          absl::StatusOr<std::vector<int64_t>> kernel = list(a0 + 1, {});
          if (!kernel.ok()) return kernel.status();
          absl::StatusOr<std::vector<int64_t>> stride = list(a0 + 2, *kernel), pad = list(a0 + 3, {0});
          if (!stride.ok()) return stride.status();
          if (!pad.ok()) return pad.status();
          const bool include_pad = d.args[a0 + 5].tag != tpu::ArgTag::kBool || d.args[a0 + 5].b;
          const bool has_divisor = d.num_args > a0 + 6 && (d.args[a0 + 6].tag == tpu::ArgTag::kInt ||
                                                           d.args[a0 + 6].tag == tpu::ArgTag::kSymInt);
          std::vector<int64_t> window(in.size(), 1), strides(in.size(), 1), sdims, sout;
          std::vector<std::pair<int64_t, int64_t>> pads(in.size(), {0, 0}), count_pads;
          for (int k = 0; k < sp; ++k) {
            const int64_t kk = (*kernel)[k], st = (*stride)[k], p = (*pad)[k], h = in[lead + k], n = out[lead + k];
            if (kk < 1 || st < 1 || p < 0 || n < 1) return Unsupported(l.op(), "a window of this form");
            window[lead + k] = kk;
            strides[lead + k] = st;
            const int64_t extra = std::max<int64_t>(0, (n - 1) * st + kk - (h + 2 * p));
            pads[lead + k] = {p, p + extra};
            sdims.push_back(include_pad ? h + 2 * p : h);
            sout.push_back(n);
            count_pads.push_back(include_pad ? std::make_pair(int64_t{0}, extra) : std::make_pair(p, p + extra));
          }
          std::string count;
          if (has_divisor) {
            count = l.Constant(static_cast<double>(d.args[a0 + 6].i), out, t);
          } else {
            const std::vector<int64_t> sw(window.begin() + lead, window.end()), ss(strides.begin() + lead, strides.end());
            const std::string c = ReduceWindow(l, l.Constant(1, sdims, t), sdims, sw, ss, count_pads, "add", 0, sout, t);
            count = l.BroadcastTo(c, sout, out, t);
          }
          if (!backward) {
            absl::StatusOr<std::string> x = l.Operand(d.args[0], in, t);
            if (!x.ok()) return x;
            const std::string sum = ReduceWindow(l, *x, in, window, strides, pads, "add", 0, out, t);
            return l.Binary("divide", sum, count, out, t);
          }
          absl::StatusOr<std::string> g = l.Operand(d.args[0], out, t);
          if (!g.ok()) return g;
          const std::string share = l.Binary("divide", *g, count, out, t);
          // Dilated by the stride, kernel - 1 zeros before, cut or padded to
          // the padded input's extent after; windows of the kernel, stride 1.
          std::vector<int64_t> lo(in.size(), 0), hi(in.size(), 0), interior(in.size(), 0), grown = out, padded = in;
          for (int k = 0; k < sp; ++k) {
            const size_t q = lead + k;
            const int64_t kk = window[q], st = strides[q], hp = in[q] + 2 * (*pad)[k];
            lo[q] = kk - 1;
            hi[q] = hp - (out[q] - 1) * st - 1;
            interior[q] = st - 1;
            grown[q] = (kk - 1) + (out[q] - 1) * st + 1 + hi[q];
            padded[q] = hp;
          }
          const std::string zero = l.Constant(0, {}, t);
          const std::string spread = l.Emit(absl::StrCat(
              "stablehlo.pad ", share, ", ", zero, ", low = [", absl::StrJoin(lo, ", "), "], high = [",
              absl::StrJoin(hi, ", "), "], interior = [", absl::StrJoin(interior, ", "), "] : (", TypeOf(out, t), ", ",
              TypeOf({}, t), ") -> ", TypeOf(grown, t)));
          const std::string summed = ReduceWindow(l, spread, grown, window, std::vector<int64_t>(in.size(), 1),
                                                  std::vector<std::pair<int64_t, int64_t>>(in.size(), {0, 0}), "add", 0,
                                                  padded, t);
          std::vector<int64_t> start(in.size(), 0), limit = padded;
          for (int k = 0; k < sp; ++k) {
            start[lead + k] = (*pad)[k];
            limit[lead + k] = (*pad)[k] + in[lead + k];
          }
          return l.Slice(summed, padded, start, limit, t);
        };
        (*m)[absl::StrCat("aten::avg_pool", sp, "d", backward ? "_backward" : "")] = r;
      }
    }
    // arange.start_out(start, end, step, *, out): start + i * step, computed
    // in double (integers in int64) as the CPU kernel does.
    (*m)["aten::arange.start_out"] = [](Lowering& l, const tpu::DecodedOp& d, const Target& o)
        -> absl::StatusOr<std::string> {
      if (d.num_args < 3 || o.dims.size() != 1) return Unsupported(l.op(), "arguments of a form not lowered");
      const DType& w = o.type->is_float ? F64() : I64();
      absl::StatusOr<std::string> start = l.Operand(d.args[0], o.dims, w), step = l.Operand(d.args[2], o.dims, w);
      if (!start.ok()) return start;
      if (!step.ok()) return step;
      const std::string v = l.Binary("add", *start, l.Binary("multiply", l.Iota(0, o.dims, w), *step, o.dims, w), o.dims, w);
      return l.Convert(v, o.dims, w, *o.type);
    };
    (*m)["aten::flip"] = [](Lowering& l, const tpu::DecodedOp& d, const Target& o)
        -> absl::StatusOr<std::string> {
      if (!Defined(d, 0) || d.num_args < 2 || d.args[1].tag != tpu::ArgTag::kIntList) return Unsupported(l.op(), "arguments of a form not lowered");
      absl::StatusOr<std::string> x = l.Operand(d.args[0], o.dims, *o.type);
      if (!x.ok()) return x;
      absl::StatusOr<std::vector<int64_t>> which = ReducedDims(l, d, 1, o.dims.size());
      if (!which.ok()) return which.status();
      if (d.args[1].ints.empty() || which->empty()) return *x;
      return l.Emit(absl::StrCat("stablehlo.reverse ", *x, ", dims = [", absl::StrJoin(*which, ", "), "] : ",
                                 TypeOf(o.dims, *o.type)));
    };
    // tril / triu(self, diagonal): a mask over the last two dimensions.
    for (bool lower : {true, false}) {
      (*m)[lower ? "aten::tril" : "aten::triu"] = [lower](Lowering& l, const tpu::DecodedOp& d, const Target& o)
          -> absl::StatusOr<std::string> {
        if (!Defined(d, 0) || o.dims.size() < 2) return Unsupported(l.op(), "expects a matrix");
        absl::StatusOr<std::string> x = l.Operand(d.args[0], o.dims, *o.type);
        if (!x.ok()) return x;
        const int64_t k = d.num_args > 1 ? static_cast<int64_t>(NumberOf(d.args[1])) : 0;
        const DType& i64 = I64();
        const int64_t r = static_cast<int64_t>(o.dims.size());
        const std::string diff = l.Binary("subtract", l.Iota(r - 1, o.dims, i64), l.Iota(r - 2, o.dims, i64), o.dims, i64);
        const std::string keep = l.Compare(lower ? "LE" : "GE", diff, l.Constant(static_cast<double>(k), o.dims, i64), o.dims, i64);
        return l.Select(keep, *x, l.Constant(0, o.dims, *o.type), o.dims, *o.type);
      };
    }
    // var / std.correction(self, dim?, *, correction?, keepdim)
    for (bool root : {false, true}) {
      (*m)[root ? "aten::std.correction" : "aten::var.correction"] = [root](Lowering& l, const tpu::DecodedOp& d, const Target& o)
          -> absl::StatusOr<std::string> {
        if (!Defined(d, 0) || !o.type->is_float) return Unsupported(l.op(), "arguments of a form not lowered");
        const DType& t = *o.type;
        const std::vector<int64_t> in = DimsOf(d.args[0].tensor);
        absl::StatusOr<std::vector<int64_t>> which = ReducedDims(l, d, 1, in.size());
        if (!which.ok()) return which.status();
        absl::StatusOr<std::string> x = l.Operand(d.args[0], in, t);
        if (!x.ok()) return x;
        const double correction = d.num_args > 2 && d.args[2].tag != tpu::ArgTag::kNone ? NumberOf(d.args[2]) : 1.0;
        const double n = static_cast<double>(CountOf(in, *which));
        const std::vector<int64_t> kept = Lowering::Kept(in, *which);
        const std::string zero = l.Constant(0, {}, t);
        const std::string mean = l.Binary("divide", l.ReduceOver(*x, in, *which, "add", zero, t), l.Constant(n, kept, t), kept, t);
        const std::string dev = l.Binary("subtract", *x, l.Expand(mean, in, *which, t), in, t);
        const std::string ss = l.ReduceOver(l.Binary("multiply", dev, dev, in, t), in, *which, "add", zero, t);
        std::string v = l.Binary("divide", ss, l.Constant(std::max(0.0, n - correction), kept, t), kept, t);
        if (root) v = l.Unary("sqrt", v, kept, t);
        return l.Reshape(v, kept, o.dims, t);
      };
    }
    // linalg_vector_norm(self, ord, dim?, keepdim, *, dtype?)
    (*m)["aten::linalg_vector_norm"] = [](Lowering& l, const tpu::DecodedOp& d, const Target& o)
        -> absl::StatusOr<std::string> {
      if (!Defined(d, 0) || !o.type->is_float) return Unsupported(l.op(), "arguments of a form not lowered");
      const DType& t = *o.type;
      const std::vector<int64_t> in = DimsOf(d.args[0].tensor);
      absl::StatusOr<std::vector<int64_t>> which = ReducedDims(l, d, 2, in.size());
      if (!which.ok()) return which.status();
      absl::StatusOr<std::string> x = l.Operand(d.args[0], in, t);
      if (!x.ok()) return x;
      const double p = d.num_args > 1 ? NumberOf(d.args[1]) : 2.0;
      const std::vector<int64_t> kept = Lowering::Kept(in, *which);
      const std::string a = l.Unary("abs", *x, in, t);
      const std::string zero = l.Constant(0, {}, t);
      std::string v;
      if (std::isinf(p)) {
        v = l.ReduceOver(a, in, *which, p > 0 ? "maximum" : "minimum", p > 0 ? l.Lowest(t) : Highest(l, t), t);
      } else if (p == 0) {
        const std::string nz = l.Select(l.Compare("NE", a, l.Constant(0, in, t), in, t), l.Constant(1, in, t), l.Constant(0, in, t), in, t);
        v = l.ReduceOver(nz, in, *which, "add", zero, t);
      } else if (p == 1) {
        v = l.ReduceOver(a, in, *which, "add", zero, t);
      } else if (p == 2) {
        v = l.Unary("sqrt", l.ReduceOver(l.Binary("multiply", a, a, in, t), in, *which, "add", zero, t), kept, t);
      } else {
        const std::string s = l.ReduceOver(l.Binary("power", a, l.Constant(p, in, t), in, t), in, *which, "add", zero, t);
        v = l.Binary("power", s, l.Constant(1.0 / p, kept, t), kept, t);
      }
      return l.Reshape(v, kept, o.dims, t);
    };
    // cumsum / cumprod(self, dim, *, dtype?)
    for (bool sum : {true, false}) {
      (*m)[sum ? "aten::cumsum" : "aten::cumprod"] = [sum](Lowering& l, const tpu::DecodedOp& d, const Target& o)
          -> absl::StatusOr<std::string> {
        if (!Defined(d, 0) || d.num_args < 2) return Unsupported(l.op(), "arguments of a form not lowered");
        absl::StatusOr<std::string> x = l.Operand(d.args[0], o.dims, *o.type);
        if (!x.ok()) return x;
        if (o.dims.empty()) return *x;
        absl::StatusOr<int64_t> checked = CheckedDim(l.op(), d.args[1].i, o.dims.size());
        if (!checked.ok()) return checked.status();
        const int64_t dim = *checked;
        return Running(l, *x, o.dims, dim, sum ? "add" : "multiply", sum ? 0 : 1, *o.type);
      };
    }
    // prod(self, *, dtype?) and prod.dim_int(self, dim, keepdim, *, dtype?)
    for (bool all : {true, false}) {
      (*m)[all ? "aten::prod" : "aten::prod.dim_int"] = [all](Lowering& l, const tpu::DecodedOp& d, const Target& o)
          -> absl::StatusOr<std::string> {
        if (!Defined(d, 0)) return Unsupported(l.op(), "expects a tensor");
        const std::vector<int64_t> in = DimsOf(d.args[0].tensor);
        absl::StatusOr<std::vector<int64_t>> which = ReducedDims(l, d, all ? 99 : 1, in.size());
        if (!which.ok()) return which.status();
        absl::StatusOr<std::string> x = l.Operand(d.args[0], in, *o.type);
        if (!x.ok()) return x;
        const std::string v = l.ReduceOver(*x, in, *which, "multiply", l.Constant(1, {}, *o.type), *o.type);
        return l.Reshape(v, Lowering::Kept(in, *which), o.dims, *o.type);
      };
    }
    // any / all, over everything or dims; a bool result.
    for (bool any : {true, false}) {
      Rule r = [any](Lowering& l, const tpu::DecodedOp& d, const Target& o) -> absl::StatusOr<std::string> {
        if (!Defined(d, 0)) return Unsupported(l.op(), "expects a tensor");
        const tpu::TensorRef& x = d.args[0].tensor;
        const DType* xt = DTypeOf(x.dtype);
        if (xt == nullptr) return Unsupported(l.op(), "dtype");
        const std::vector<int64_t> in = DimsOf(x);
        absl::StatusOr<std::vector<int64_t>> which = ReducedDims(l, d, 1, in.size());
        if (!which.ok()) return which.status();
        absl::StatusOr<std::string> v = l.Tensor(x, 0);
        if (!v.ok()) return v;
        const DType& b = *DTypeOf(11);
        const std::string truth = xt->c10 == 11 ? *v : l.Compare("NE", *v, l.Constant(0, in, *xt), in, *xt);
        const std::string r = l.ReduceOver(truth, in, *which, any ? "or" : "and", l.Constant(any ? 0 : 1, {}, b), b);
        return l.Reshape(l.Convert(r, Lowering::Kept(in, *which), b, *o.type), Lowering::Kept(in, *which), o.dims, *o.type);
      };
      const std::string base = any ? "aten::any" : "aten::all";
      for (const char* form : {"", ".dim", ".dims", ".all_out", ".out", ".dims_out"}) (*m)[base + form] = r;
    }
    (*m)["aten::bitwise_not"] = UnaryRule([](Lowering& l, const std::string& x, const Target& o) {
      return l.Unary("not", x, o.dims, *o.type);
    });
    // Inverse hyperbolic functions from logarithms.
    (*m)["aten::acosh"] = UnaryRule([](Lowering& l, const std::string& x, const Target& o) {
      const DType& t = *o.type;
      const std::string s = l.Unary("sqrt", l.Binary("subtract", l.Binary("multiply", x, x, o.dims, t), l.Constant(1, o.dims, t), o.dims, t), o.dims, t);
      return l.Unary("log", l.Binary("add", x, s, o.dims, t), o.dims, t);
    });
    (*m)["aten::asinh"] = UnaryRule([](Lowering& l, const std::string& x, const Target& o) {
      const DType& t = *o.type;
      const std::string a = l.Unary("abs", x, o.dims, t);
      const std::string s = l.Unary("sqrt", l.Binary("add", l.Binary("multiply", a, a, o.dims, t), l.Constant(1, o.dims, t), o.dims, t), o.dims, t);
      return l.Binary("multiply", l.Unary("sign", x, o.dims, t), l.Unary("log", l.Binary("add", a, s, o.dims, t), o.dims, t), o.dims, t);
    });
    (*m)["aten::atanh"] = UnaryRule([](Lowering& l, const std::string& x, const Target& o) {
      const DType& t = *o.type;
      const std::string q = l.Binary("divide", l.Binary("add", l.Constant(1, o.dims, t), x, o.dims, t),
                                     l.Binary("subtract", l.Constant(1, o.dims, t), x, o.dims, t), o.dims, t);
      return l.Binary("multiply", l.Constant(0.5, o.dims, t), l.Unary("log", q, o.dims, t), o.dims, t);
    });
    // softplus(self, beta, threshold): linear above the threshold.
    (*m)["aten::softplus"] = [](Lowering& l, const tpu::DecodedOp& d, const Target& o) -> absl::StatusOr<std::string> {
      const DType& t = *o.type;
      absl::StatusOr<std::string> x = l.Operand(d.args[0], o.dims, t);
      if (!x.ok()) return x;
      const double beta = d.num_args > 1 ? NumberOf(d.args[1]) : 1, threshold = d.num_args > 2 ? NumberOf(d.args[2]) : 20;
      const std::string bx = l.Binary("multiply", *x, l.Constant(beta, o.dims, t), o.dims, t);
      const std::string soft = l.Binary("divide", l.Unary("log_plus_one", l.Unary("exponential", bx, o.dims, t), o.dims, t),
                                        l.Constant(beta, o.dims, t), o.dims, t);
      return l.Select(l.Compare("GT", bx, l.Constant(threshold, o.dims, t), o.dims, t), *x, soft, o.dims, t);
    };
    // index_select(self, dim, index): a gather of whole slices.
    (*m)["aten::index_select"] = [](Lowering& l, const tpu::DecodedOp& d, const Target& o) -> absl::StatusOr<std::string> {
      if (!Defined(d, 0) || !Defined(d, 2) || d.args[2].tensor.ndim > 1) return Unsupported(l.op(), "arguments of a form not lowered");
      const tpu::TensorRef& x = d.args[0].tensor;
      std::vector<int64_t> in = DimsOf(x);
      absl::StatusOr<std::string> v = l.Operand(d.args[0], in, *o.type);
      if (!v.ok()) return v;
      std::string xv = *v;
      if (in.empty()) {
        xv = l.Reshape(xv, in, {1}, *o.type);
        in = {1};
      }
      absl::StatusOr<int64_t> checked = CheckedDim(l.op(), d.args[1].i, in.size());
      if (!checked.ok()) return checked.status();
      const int64_t dim = *checked;
      const tpu::TensorRef& ix = d.args[2].tensor;
      const DType* it = DTypeOf(ix.dtype);
      if (it == nullptr || it->is_float) return Unsupported(l.op(), "index dtype");
      const int64_t k = Numel(ix);
      absl::StatusOr<std::string> iv = l.OperandRef(ix, l.TensorIndex(d.args[2]), DimsOf(ix), I64());
      if (!iv.ok()) return iv;
      l.CheckRange(*iv, DimsOf(ix), in[dim], absl::StrCat("index out of range in self (dim ", dim, " has size ", in[dim], ")"));
      const std::string idx = l.Reshape(*iv, DimsOf(ix), {k, 1}, I64());
      std::vector<int64_t> offset, slice = in, shape = in;
      for (size_t q = 0; q < in.size(); ++q) if (static_cast<int64_t>(q) != dim) offset.push_back(static_cast<int64_t>(q));
      slice[dim] = 1;
      shape[dim] = k;
      const std::string g = l.Emit(absl::StrCat(
          "\"stablehlo.gather\"(", xv, ", ", idx, ") {dimension_numbers = #stablehlo.gather<offset_dims = [",
          absl::StrJoin(offset, ", "), "], collapsed_slice_dims = [", dim, "], start_index_map = [", dim,
          "], index_vector_dim = 1>, indices_are_sorted = false, slice_sizes = array<i64: ",
          absl::StrJoin(slice, ", "), ">} : (", TypeOf(in, *o.type), ", ", TypeOf({k, 1}, I64()), ") -> ",
          TypeOf(shape, *o.type)));
      return l.Reshape(g, shape, o.dims, *o.type);
    };
    // signbit(self): the sign bit, -0.0 and -nan included.
    (*m)["aten::signbit"] = [](Lowering& l, const tpu::DecodedOp& d, const Target& o) -> absl::StatusOr<std::string> {
      if (!Defined(d, 0)) return Unsupported(l.op(), "expects a tensor");
      const tpu::TensorRef& x = d.args[0].tensor;
      const DType* xt = DTypeOf(x.dtype);
      if (xt == nullptr) return Unsupported(l.op(), "dtype");
      absl::StatusOr<std::string> v = l.OperandRef(x, l.TensorIndex(d.args[0]), o.dims, *xt);
      if (!v.ok()) return v;
      const DType& b = *DTypeOf(11);
      std::string neg;
      if (xt->c10 == 11 || xt->c10 == 0) {
        neg = l.Constant(0, o.dims, b);
      } else if (xt->is_float) {
        const DType& bits = *DTypeOf(xt->bytes == 2 ? 2 : xt->bytes == 4 ? 3 : 4);
        const std::string i = l.Emit(absl::StrCat("stablehlo.bitcast_convert ", *v, " : (", TypeOf(o.dims, *xt),
                                                  ") -> ", TypeOf(o.dims, bits)));
        neg = l.Compare("LT", i, l.Constant(0, o.dims, bits), o.dims, bits);
      } else {
        neg = l.Compare("LT", *v, l.Constant(0, o.dims, *xt), o.dims, *xt);
      }
      return l.Convert(neg, o.dims, b, *o.type);
    };
    (*m)["aten::pow.Scalar"] = BinaryRule("power", false);
    // div with rounding_mode "trunc" or "floor" (None: true division).
    {
      Rule r = [](Lowering& l, const tpu::DecodedOp& d, const Target& o) -> absl::StatusOr<std::string> {
        if (d.num_args < 2) return Unsupported(l.op(), "too few arguments");
        const DType& t = *o.type;
        absl::StatusOr<std::string> a = l.Operand(d.args[0], o.dims, t), b = l.Operand(d.args[1], o.dims, t);
        if (!a.ok()) return a;
        if (!b.ok()) return b;
        const std::string mode = d.num_args > 2 && d.args[2].tag == tpu::ArgTag::kString ? d.args[2].s : "";
        const std::string q = l.Binary("divide", *a, *b, o.dims, t);
        if (mode.empty()) return q;
        if (mode != "trunc" && mode != "floor") return Unsupported(l.op(), "rounding_mode=\"" + mode + "\"");
        const std::string zero = l.Constant(0, o.dims, t);
        if (t.is_float) {
          if (mode == "floor") return l.Unary("floor", q, o.dims, t);
          return l.Select(l.Compare("LT", q, zero, o.dims, t), l.Unary("ceil", q, o.dims, t),
                          l.Unary("floor", q, o.dims, t), o.dims, t);
        }
        if (mode == "trunc") return q;  // integer division truncates
        // Floor: one less where the remainder is nonzero and the signs differ.
        const std::string rem = l.Binary("remainder", *a, *b, o.dims, t);
        const std::string inexact = l.Compare("NE", rem, zero, o.dims, t);
        const std::string differ = l.Compare("NE", l.Compare("LT", *a, zero, o.dims, t),
                                             l.Compare("LT", *b, zero, o.dims, t), o.dims, *DTypeOf(11));
        const std::string both = l.Binary("and", inexact, differ, o.dims, *DTypeOf(11));
        return l.Select(both, l.Binary("subtract", q, l.Constant(1, o.dims, t), o.dims, t), q, o.dims, t);
      };
      for (const char* name : {"aten::div.Tensor_mode", "aten::div.Scalar_mode", "aten::div_.Tensor_mode",
                               "aten::div_.Scalar_mode", "aten::div.out_mode", "aten::div.Scalar_mode_out"}) {
        (*m)[name] = r;
      }
    }
    // gather(self, dim, index, *, sparse_grad): out[i][j] = self[index[i][j]][j] (dim 0).
    (*m)["aten::gather"] = [](Lowering& l, const tpu::DecodedOp& d, const Target& o) -> absl::StatusOr<std::string> {
      if (!Defined(d, 0) || !Defined(d, 2)) return Unsupported(l.op(), "arguments of a form not lowered");
      const tpu::TensorRef& x = d.args[0].tensor;
      const std::vector<int64_t> in = DimsOf(x);
      absl::StatusOr<std::string> v = l.Operand(d.args[0], in, *o.type);
      if (!v.ok()) return v;
      const size_t n = in.size();
      if (n == 0 || o.dims.size() != n) return l.Reshape(*v, in, o.dims, *o.type);
      absl::StatusOr<int64_t> checked = CheckedDim(l.op(), d.args[1].i, n);
      if (!checked.ok()) return checked.status();
      const int64_t dim = *checked;
      const tpu::TensorRef& ix = d.args[2].tensor;
      const DType& i64 = I64();
      absl::StatusOr<std::string> iv = l.OperandRef(ix, l.TensorIndex(d.args[2]), o.dims, i64);
      if (!iv.ok()) return iv;
      l.CheckRange(*iv, o.dims, in[dim], absl::StrCat("index out of bounds for dimension ", dim, " with size ", in[dim]));
      std::vector<int64_t> all = o.dims;
      all.push_back(static_cast<int64_t>(n));
      const std::string idx = ElementIndex(l, *iv, o.dims, dim);
      const std::vector<int64_t> dims_list = Range(n), ones(n, 1);
      return l.Emit(absl::StrCat(
          "\"stablehlo.gather\"(", *v, ", ", idx, ") {dimension_numbers = #stablehlo.gather<",
          "collapsed_slice_dims = [", absl::StrJoin(dims_list, ", "), "], start_index_map = [",
          absl::StrJoin(dims_list, ", "), "], index_vector_dim = ", n,
          ">, indices_are_sorted = false, slice_sizes = array<i64: ", absl::StrJoin(ones, ", "), ">} : (",
          TypeOf(in, *o.type), ", ", TypeOf(all, i64), ") -> ", TypeOf(o.dims, *o.type)));
    };
    // index.Tensor(self, indices): advanced indexing with integer index
    // tensors, a gather (see PlanIndex).
    (*m)["aten::index.Tensor"] = [](Lowering& l, const tpu::DecodedOp& d, const Target& o) -> absl::StatusOr<std::string> {
      if (!Defined(d, 0) || d.num_args < 2) return Unsupported(l.op(), "arguments of a form not lowered");
      const std::vector<int64_t> in = DimsOf(d.args[0].tensor);
      absl::StatusOr<std::string> v = l.Operand(d.args[0], in, *o.type);
      if (!v.ok()) return v;
      absl::StatusOr<IndexPlan> p = PlanIndex(l, d.args[1], in);
      if (!p.ok()) return p.status();
      const std::string g = l.Emit(absl::StrCat(
          "\"stablehlo.gather\"(", *v, ", ", p->indices, ") {dimension_numbers = #stablehlo.gather<offset_dims = [",
          absl::StrJoin(p->window, ", "), "], collapsed_slice_dims = [", absl::StrJoin(p->indexed, ", "),
          "], start_index_map = [", absl::StrJoin(p->indexed, ", "), "], index_vector_dim = ", p->batch.size(),
          ">, indices_are_sorted = false, slice_sizes = array<i64: ", absl::StrJoin(p->slice, ", "), ">} : (",
          TypeOf(in, *o.type), ", ", p->indices_type, ") -> ", TypeOf(p->result, *o.type)));
      return l.Reshape(g, p->result, o.dims, *o.type);
    };
    // index_put_ / _index_put_impl_(self, indices, values, accumulate[, unsafe]):
    // the values (broadcast to what index would return) scattered into
    // self, added where accumulate (embedding's backward).
    {
      Rule put = [](Lowering& l, const tpu::DecodedOp& d, const Target& o) -> absl::StatusOr<std::string> {
        if (!Defined(d, 0) || !Defined(d, 2) || d.num_args < 3) return Unsupported(l.op(), "arguments of a form not lowered");
        const DType& t = *o.type;
        const std::vector<int64_t>& in = o.dims;
        if (in.empty()) return Unsupported(l.op(), "a 0-d tensor");
        absl::StatusOr<std::string> self = l.Operand(d.args[0], in, t);
        if (!self.ok()) return self;
        const bool accumulate = d.num_args > 3 && d.args[3].tag == tpu::ArgTag::kBool && d.args[3].b;
        // One boolean mask over the leading dimensions and one value
        // (x[mask] = v, x[mask] += v): a select, whatever the mask holds.
        const tpu::OpArg& list = d.args[1];
        if (list.tag == tpu::ArgTag::kOptionalTensorList && !list.tensor_present.empty() && list.tensor_present[0] &&
            std::count(list.tensor_present.begin(), list.tensor_present.end(), true) == 1 && !list.tensors.empty() &&
            (list.tensors[0].dtype == 11 || list.tensors[0].dtype == 0) && Numel(d.args[2].tensor) == 1) {
          const tpu::TensorRef& mr = list.tensors[0];
          const std::vector<int64_t> md = DimsOf(mr);
          if (md.size() > in.size() || !std::equal(md.begin(), md.end(), in.begin())) {
            return absl::InvalidArgumentError(absl::StrCat(l.op(), ": the mask's shape does not match self's leading dimensions"));
          }
          const DType& i1 = *DTypeOf(11);
          absl::StatusOr<std::string> mv = l.OperandRef(mr, l.TensorIndex(list), md, *DTypeOf(mr.dtype));
          if (!mv.ok()) return mv;
          const std::string mb = l.Compare("NE", *mv, l.Constant(0, md, *DTypeOf(mr.dtype)), md, *DTypeOf(mr.dtype));
          std::vector<int64_t> lead;
          for (size_t q = 0; q < md.size(); ++q) lead.push_back(static_cast<int64_t>(q));
          const std::string mask = l.Emit(absl::StrCat("stablehlo.broadcast_in_dim ", mb, ", dims = [", absl::StrJoin(lead, ", "),
                                                       "] : (", TypeOf(md, i1), ") -> ", TypeOf(in, i1)));
          const std::vector<int64_t> vd = DimsOf(d.args[2].tensor);
          absl::StatusOr<std::string> value = l.Operand(d.args[2], vd, t);
          if (!value.ok()) return value;
          const std::string vb = l.BroadcastTo(l.Reshape(*value, vd, {}, t), {}, in, t);
          return l.Select(mask, accumulate ? l.Binary("add", *self, vb, in, t) : vb, *self, in, t);
        }
        absl::StatusOr<IndexPlan> p = PlanIndex(l, d.args[1], in);
        if (!p.ok()) return p.status();
        absl::StatusOr<std::string> values = l.Operand(d.args[2], p->result, t);
        if (!values.ok()) return values;
        const std::string scalar = TypeOf({}, t);
        return l.Emit(absl::StrCat(
            "\"stablehlo.scatter\"(", *self, ", ", p->indices, ", ", *values, ") ({\n",
            "    ^bb0(%old: ", scalar, ", %new: ", scalar, "):\n",
            accumulate ? absl::StrCat("      %sum = stablehlo.add %old, %new : ", scalar, "\n      stablehlo.return %sum : ", scalar, "\n")
                       : absl::StrCat("      stablehlo.return %new : ", scalar, "\n"),
            "    }) {indices_are_sorted = false, scatter_dimension_numbers = #stablehlo.scatter<update_window_dims = [",
            absl::StrJoin(p->window, ", "), "], inserted_window_dims = [", absl::StrJoin(p->indexed, ", "),
            "], scatter_dims_to_operand_dims = [", absl::StrJoin(p->indexed, ", "), "], index_vector_dim = ",
            p->batch.size(), ">, unique_indices = false} : (", TypeOf(in, t), ", ", p->indices_type, ", ",
            TypeOf(p->result, t), ") -> ", TypeOf(in, t)));
      };
      for (const char* name : {"aten::_index_put_impl_", "aten::index_put_", "aten::index_put", "aten::index_put.out",
                               "aten::_index_put_impl", "aten::_index_put_impl.out"}) {
        (*m)[name] = put;
      }
    }
    // Random ops. The generator argument carries a 64-bit seed the client's
    // device generator drew for this op (torch.tpu.manual_seed makes runs
    // repeat); it travels as a parameter, so one program serves every call.
    // Values come from XLA's rng_bit_generator: reproducible on this backend,
    // not equal to the CPU's stream.
    enum class Dist { kUniform, kNormal, kBernoulli, kRandom };
    auto random_rule = [](Dist dist) -> Rule {
      return [dist](Lowering& l, const tpu::DecodedOp& d, const Target& o) -> absl::StatusOr<std::string> {
        const tpu::OpArg* gen = nullptr;
        for (size_t i = 0; i < d.num_args; ++i) {
          if (d.args[i].tag == tpu::ArgTag::kGenerator) gen = &d.args[i];
        }
        if (gen == nullptr) return Unsupported(l.op(), "no generator argument");
        const DType& t = *o.type;
        const DType& f = t.c10 == 7 ? F64() : *DTypeOf(6);  // uniform draws in f32 or f64
        const bool normal = dist == Dist::kNormal;
        const std::string u = l.UniformBits(gen->i, o.dims, f, normal ? 2 : 1);
        std::vector<int64_t> two = o.dims;
        two.insert(two.begin(), 2);
        auto half = [&](int k) {  // the k-th of the two draws of a normal
          std::vector<int64_t> one = o.dims;
          one.insert(one.begin(), 1);
          return l.Reshape(l.SliceAlong(u, two, 0, k, k + 1, f), one, o.dims, f);
        };
        auto num = [&](size_t i, double dflt) { return i < d.num_args && d.args[i].tag != tpu::ArgTag::kNone &&
                                                       d.args[i].tag != tpu::ArgTag::kGenerator ? NumberOf(d.args[i]) : dflt; };
        std::string v;
        switch (dist) {
          case Dist::kUniform: {  // uniform_(self, from, to, *, generator)
            const double from = num(1, 0), to = num(2, 1);
            v = l.Binary("add", l.Constant(from, o.dims, f),
                         l.Binary("multiply", u, l.Constant(to - from, o.dims, f), o.dims, f), o.dims, f);
            break;
          }
          case Dist::kNormal: {  // normal_(self, mean, std, *, generator): Box-Muller
            const double mean = num(1, 0), stdev = num(2, 1);
            const std::string u1 = l.Binary("subtract", l.Constant(1, o.dims, f), half(0), o.dims, f);  // (0, 1]
            const std::string r = l.Unary("sqrt", l.Binary("multiply", l.Constant(-2, o.dims, f), l.Unary("log", u1, o.dims, f), o.dims, f), o.dims, f);
            const std::string c = l.Unary("cosine", l.Binary("multiply", l.Constant(6.283185307179586, o.dims, f), half(1), o.dims, f), o.dims, f);
            v = l.Binary("add", l.Constant(mean, o.dims, f),
                         l.Binary("multiply", l.Binary("multiply", r, c, o.dims, f), l.Constant(stdev, o.dims, f), o.dims, f), o.dims, f);
            break;
          }
          case Dist::kBernoulli: {  // bernoulli_(self, p: float or Tensor, *, generator)
            std::string p;
            if (d.num_args > 1 && d.args[1].tag == tpu::ArgTag::kTensor) {
              absl::StatusOr<std::string> pt = l.Operand(d.args[1], o.dims, f);
              if (!pt.ok()) return pt;
              p = *pt;
            } else {
              p = l.Constant(num(1, 0.5), o.dims, f);
            }
            v = l.Select(l.Compare("LT", u, p, o.dims, f), l.Constant(1, o.dims, f), l.Constant(0, o.dims, f), o.dims, f);
            break;
          }
          case Dist::kRandom: {  // random_.from(self, from, to?, *, generator): integers in [from, to)
            const double from = num(1, 0), to = num(2, from + 1);
            const DType& w = F64();
            const std::string uw = l.Convert(u, o.dims, f, w);
            v = l.Binary("add", l.Constant(from, o.dims, w),
                         l.Unary("floor", l.Binary("multiply", uw, l.Constant(to - from, o.dims, w), o.dims, w), o.dims, w), o.dims, w);
            return l.Convert(v, o.dims, w, t);
          }
        }
        return l.Convert(v, o.dims, f, t);
      };
    };
    (*m)["aten::uniform_"] = random_rule(Dist::kUniform);
    (*m)["aten::normal_"] = random_rule(Dist::kNormal);
    (*m)["aten::bernoulli_.float"] = random_rule(Dist::kBernoulli);
    (*m)["aten::bernoulli_.Tensor"] = random_rule(Dist::kBernoulli);
    (*m)["aten::random_.from"] = random_rule(Dist::kRandom);
    // convolution(input, weight, bias?, stride, padding, dilation, transposed,
    // output_padding, groups): stablehlo.convolution over NC(D)(H)W. A
    // transposed one is the gradient of a convolution: the input dilated by
    // the stride, padded by dilation * (k - 1) - padding (plus output_padding
    // at the end), under the spatially reversed weight, whose (in, out / g)
    // channels become, per group, the kernel's (in / g, out).
    (*m)["aten::convolution"] = [](Lowering& l, const tpu::DecodedOp& d, const Target& o) -> absl::StatusOr<std::string> {
      if (!Defined(d, 0) || !Defined(d, 1)) return Unsupported(l.op(), "arguments of a form not lowered");
      const DType& t = *o.type;
      const std::vector<int64_t> in = DimsOf(d.args[0].tensor), wd = DimsOf(d.args[1].tensor);
      absl::StatusOr<ConvWindow> cw = ConvWindowOf(l, d, 3, in, wd, o.dims, /*allow_transposed=*/true);
      if (!cw.ok()) return cw.status();
      const size_t sp = cw->sp;
      const std::vector<int64_t>&stride = cw->stride, &pad = cw->pad, &dilation = cw->dilation;
      const int64_t groups = cw->groups;
      absl::StatusOr<std::string> x = l.Operand(d.args[0], in, t), w = l.Operand(d.args[1], wd, t);
      if (!x.ok()) return x;
      if (!w.ok()) return w;
      std::vector<std::string> spatial, pads;
      std::vector<int64_t> ones(sp, 1), rev;
      for (size_t k = 0; k < sp; ++k) {
        spatial.push_back(absl::StrCat(k));
        rev.push_back(static_cast<int64_t>(k + 2));
        if (cw->transposed) {
          const int64_t lo = dilation[k] * (wd[k + 2] - 1) - pad[k];
          pads.push_back(absl::StrCat("[", lo, ", ", lo + cw->output_padding[k], "]"));
        } else {
          pads.push_back(absl::StrCat("[", pad[k], ", ", pad[k], "]"));
        }
      }
      const std::string dims = absl::StrJoin(spatial, ", ");
      std::string kernel = *w, layout = "o, i";
      std::vector<int64_t> kd = wd;
      if (cw->transposed) {
        kernel = l.Emit(absl::StrCat("stablehlo.reverse ", *w, ", dims = [", absl::StrJoin(rev, ", "), "] : ",
                                     TypeOf(wd, t)));
        layout = "i, o";
        if (groups > 1) {
          // (g * ci, co, k...) -> (g, ci, co, k...) -> (ci, g, co, k...) -> (ci, g * co, k...)
          const int64_t ci = wd[0] / groups, co = wd[1];
          std::vector<int64_t> split = {groups, ci, co}, perm = {1, 0, 2}, moved = {ci, groups, co};
          for (size_t k = 0; k < sp; ++k) {
            split.push_back(wd[k + 2]);
            moved.push_back(wd[k + 2]);
            perm.push_back(static_cast<int64_t>(k + 3));
          }
          kd = {ci, groups * co};
          for (size_t k = 0; k < sp; ++k) kd.push_back(wd[k + 2]);
          kernel = l.Reshape(kernel, wd, split, t);
          kernel = l.Emit(absl::StrCat("stablehlo.transpose ", kernel, ", dims = [", absl::StrJoin(perm, ", "), "] : (",
                                       TypeOf(split, t), ") -> ", TypeOf(moved, t)));
          kernel = l.Reshape(kernel, moved, kd, t);
        }
      }
      std::string r = l.Emit(absl::StrCat(
          "stablehlo.convolution(", *x, ", ", kernel, ") dim_numbers = [b, f, ", dims, "]x[", layout, ", ", dims,
          "]->[b, f, ", dims, "], window = {stride = [", absl::StrJoin(cw->transposed ? ones : stride, ", "), "], pad = [",
          absl::StrJoin(pads, ", "), "], ", cw->transposed ? absl::StrCat("lhs_dilate = [", absl::StrJoin(stride, ", "), "], ") : "",
          "rhs_dilate = [", absl::StrJoin(dilation, ", "),
          "]} {batch_group_count = 1 : i64, feature_group_count = ", groups, " : i64} : (", TypeOf(in, t), ", ",
          TypeOf(kd, t), ") -> ", TypeOf(o.dims, t)));
      if (Defined(d, 2)) {
        const tpu::TensorRef& b = d.args[2].tensor;
        absl::StatusOr<std::string> bv = l.OperandRef(b, l.TensorIndex(d.args[2]), DimsOf(b), t);
        if (!bv.ok()) return bv;
        const std::string bb = l.Emit(absl::StrCat("stablehlo.broadcast_in_dim ", *bv, ", dims = [1] : (",
                                                   TypeOf(DimsOf(b), t), ") -> ", TypeOf(o.dims, t)));
        r = l.Binary("add", r, bb, o.dims, t);
      }
      return r;
    };
    // scatter / scatter_add / scatter_reduce / index_reduce: self with
    // out[index[i][j]][j] combined with src[i][j] (dim 0): replaced, added,
    // multiplied, the larger or smaller kept, or averaged. src may be larger
    // than index, whose extent is what counts; index_reduce's index is one
    // list along `dim`, broadcast over source's other dimensions. Without
    // include_self, an element some index reaches starts from the combiner's
    // identity instead of self's value; mean divides by the count of what was
    // combined (flooring for integers, as the CPU kernel does).
    enum class Kind { kSrc, kValue, kAdd, kSrcReduce, kValueReduce, kScatterReduce, kIndexReduce };
    for (Kind kind : {Kind::kSrc, Kind::kValue, Kind::kAdd, Kind::kSrcReduce, Kind::kValueReduce,
                      Kind::kScatterReduce, Kind::kIndexReduce}) {
      Rule r = [kind](Lowering& l, const tpu::DecodedOp& d, const Target& o) -> absl::StatusOr<std::string> {
        if (!Defined(d, 0) || !Defined(d, 2) || d.num_args < 4) return Unsupported(l.op(), "arguments of a form not lowered");
        const DType& t = *o.type;
        // A 0-d self (and its 0-d index and src) is taken as one element.
        const std::vector<int64_t> in = o.dims.empty() ? std::vector<int64_t>{1} : o.dims;
        const size_t n = in.size();
        auto done = [&](const std::string& v) { return l.Reshape(v, in, o.dims, t); };
        const tpu::TensorRef& ix = d.args[2].tensor;
        // The reduction: "" (replace), "sum", "prod", "mean", "amax", "amin".
        std::string reduce = kind == Kind::kAdd ? "sum" : "";
        bool include_self = true;
        if (kind == Kind::kSrcReduce || kind == Kind::kValueReduce || kind == Kind::kScatterReduce ||
            kind == Kind::kIndexReduce) {
          if (d.num_args < 5 || d.args[4].tag != tpu::ArgTag::kString) return Unsupported(l.op(), "reduce must be a string");
          reduce = d.args[4].s;
          if (reduce == "add") reduce = "sum";
          if (reduce == "multiply") reduce = "prod";
          if (reduce != "sum" && reduce != "prod" && reduce != "mean" && reduce != "amax" && reduce != "amin") {
            return absl::InvalidArgumentError(absl::StrCat(l.op(), ": reduce \"", d.args[4].s, "\" is not one of sum, prod, mean, amax, amin"));
          }
          if (d.num_args > 5 && d.args[5].tag == tpu::ArgTag::kBool) include_self = d.args[5].b;
        }
        std::vector<int64_t> sd = kind == Kind::kValue || kind == Kind::kValueReduce
                                      ? DimsOf(ix) : (Defined(d, 3) ? DimsOf(d.args[3].tensor) : std::vector<int64_t>{});
        if (sd.empty()) sd = {1};
        std::vector<int64_t> id = kind == Kind::kIndexReduce ? sd : DimsOf(ix);
        if (id.empty()) id = {1};
        if (n == 0 || id.size() != n || (kind == Kind::kIndexReduce && ix.ndim != 1)) {
          return Unsupported(l.op(), "arguments of a form not lowered");
        }
        absl::StatusOr<std::string> self = l.Operand(d.args[0], in, t);
        if (!self.ok()) return self;
        absl::StatusOr<int64_t> checked = CheckedDim(l.op(), d.args[1].i, n);
        if (!checked.ok()) return checked.status();
        const int64_t dim = *checked;
        if (kind == Kind::kIndexReduce && id[dim] != ix.sizes[0]) {
          return absl::InvalidArgumentError(absl::StrCat(l.op(), ": index has ", ix.sizes[0], " entries, source ",
                                                         id[dim], " along dim ", dim));
        }
        if (Numel(ix) == 0) return done(*self);
        std::string upd;
        if (kind == Kind::kValue || kind == Kind::kValueReduce) {
          absl::StatusOr<std::string> v = l.Operand(d.args[3], id, t);
          if (!v.ok()) return v;
          upd = *v;
        } else {
          if (!Defined(d, 3)) return Unsupported(l.op(), "arguments of a form not lowered");
          if (sd.size() != n) return Unsupported(l.op(), "src of another rank");
          absl::StatusOr<std::string> v = l.Operand(d.args[3], sd, t);
          if (!v.ok()) return v;
          upd = *v;
          if (sd != id) upd = l.Slice(upd, sd, std::vector<int64_t>(n, 0), id, t);
        }
        const DType& i64 = I64();
        std::string along;
        if (kind == Kind::kIndexReduce) {
          absl::StatusOr<std::string> iv = l.OperandRef(ix, l.TensorIndex(d.args[2]), {ix.sizes[0]}, i64);
          if (!iv.ok()) return iv;
          along = l.Emit(absl::StrCat("stablehlo.broadcast_in_dim ", *iv, ", dims = [", dim, "] : (",
                                      TypeOf({ix.sizes[0]}, i64), ") -> ", TypeOf(id, i64)));
        } else {
          absl::StatusOr<std::string> iv = l.OperandRef(ix, l.TensorIndex(d.args[2]), id, i64);
          if (!iv.ok()) return iv;
          along = *iv;
        }
        l.CheckRange(along, id, in[dim], absl::StrCat("index out of bounds for dimension ", dim, " with size ", in[dim]));
        std::vector<int64_t> all = id;
        all.push_back(static_cast<int64_t>(n));
        const std::string idx = ElementIndex(l, along, id, dim);
        const std::vector<int64_t> dims_list = Range(n);
        // base with the updates `u` (type ut) combined by `op` ("" replaces).
        auto scatter = [&](const std::string& base, const std::string& u, const char* op, const DType& ut) {
          const std::string scalar = TypeOf({}, ut);
          return l.Emit(absl::StrCat(
              "\"stablehlo.scatter\"(", base, ", ", idx, ", ", u, ") ({\n",
              "    ^bb0(%old: ", scalar, ", %new: ", scalar, "):\n",
              *op != 0 ? absl::StrCat("      %r = stablehlo.", op, " %old, %new : ", scalar, "\n      stablehlo.return %r : ", scalar, "\n")
                       : absl::StrCat("      stablehlo.return %new : ", scalar, "\n"),
              "    }) {indices_are_sorted = false, scatter_dimension_numbers = #stablehlo.scatter<",
              "inserted_window_dims = [", absl::StrJoin(dims_list, ", "), "], scatter_dims_to_operand_dims = [",
              absl::StrJoin(dims_list, ", "), "], index_vector_dim = ", n, ">, unique_indices = false} : (",
              TypeOf(in, ut), ", ", TypeOf(all, i64), ", ", TypeOf(id, ut), ") -> ", TypeOf(in, ut)));
        };
        if (reduce.empty()) return done(scatter(*self, upd, "", t));
        const char* op = reduce == "sum" || reduce == "mean" ? "add" : reduce == "prod" ? "multiply"
                       : reduce == "amax" ? "maximum" : "minimum";
        // How many updates reach each element.
        const std::string count = scatter(l.Constant(0, in, i64), l.Constant(1, id, i64), "add", i64);
        const std::string touched = l.Compare("GT", count, l.Constant(0, in, i64), in, i64);
        std::string base = *self;
        if (!include_self) {
          const std::string identity = reduce == "prod" ? l.Constant(1, in, t)
                                     : reduce == "amax" ? l.BroadcastTo(l.Lowest(t), {}, in, t)
                                     : reduce == "amin" ? l.BroadcastTo(Highest(l, t), {}, in, t)
                                                        : l.Constant(0, in, t);
          base = l.Select(touched, identity, *self, in, t);
        }
        const std::string combined = scatter(base, upd, op, t);
        if (reduce != "mean") return done(combined);
        std::string denom = l.Convert(include_self ? l.Binary("add", count, l.Constant(1, in, i64), in, i64) : count, in, i64, t);
        // Untouched elements keep self (divided by 1, or not at all).
        denom = l.Select(touched, denom, l.Constant(1, in, t), in, t);
        std::string q = l.Binary("divide", combined, denom, in, t);
        if (!t.is_float && t.c10 != 11) {
          // Floor: truncation one lower where the remainder is negative.
          const std::string rem = l.Binary("remainder", combined, denom, in, t);
          const std::string neg = l.Compare("LT", rem, l.Constant(0, in, t), in, t);
          q = l.Select(neg, l.Binary("subtract", q, l.Constant(1, in, t), in, t), q, in, t);
        }
        return done(q);
      };
      const char* name = kind == Kind::kSrc ? "aten::scatter.src" : kind == Kind::kValue ? "aten::scatter.value"
                       : kind == Kind::kAdd ? "aten::scatter_add" : kind == Kind::kSrcReduce ? "aten::scatter.reduce"
                       : kind == Kind::kValueReduce ? "aten::scatter.value_reduce"
                       : kind == Kind::kScatterReduce ? "aten::scatter_reduce.two" : "aten::index_reduce";
      (*m)[name] = r;
    }
    (*m)["aten::prod.int_out"] = (*m)["aten::prod.dim_int"];
    // max / min of everything (self): amax / amin over every dimension.
    (*m)["aten::max"] = TailRules().at("aten::amax");
    (*m)["aten::min"] = TailRules().at("aten::amin");
    (*m)["aten::max.unary_out"] = (*m)["aten::max"];
    (*m)["aten::min.unary_out"] = (*m)["aten::min"];
    (*m)["aten::_unsafe_index.Tensor"] = (*m)["aten::index.Tensor"];
    // fmod: C's remainder, with the dividend's sign (stablehlo.remainder).
    (*m)["aten::fmod.Tensor"] = BinaryRule("remainder", false);
    (*m)["aten::fmod.Scalar"] = BinaryRule("remainder", false);
    // addmv(self, mat, vec, *, beta, alpha) and mv(self, vec).
    for (bool add : {true, false}) {
      (*m)[add ? "aten::addmv" : "aten::mv"] = [add](Lowering& l, const tpu::DecodedOp& d, const Target& o)
          -> absl::StatusOr<std::string> {
        const size_t mi = add ? 1 : 0;
        if (!Defined(d, mi) || !Defined(d, mi + 1) || d.args[mi].tensor.ndim != 2 || d.args[mi + 1].tensor.ndim != 1) {
          return Unsupported(l.op(), "expects a matrix and a vector");
        }
        const DType& t = *o.type;
        const std::vector<int64_t> dm = DimsOf(d.args[mi].tensor), dv = DimsOf(d.args[mi + 1].tensor);
        absl::StatusOr<std::string> a = l.Operand(d.args[mi], dm, t), v = l.Operand(d.args[mi + 1], dv, t);
        if (!a.ok()) return a;
        if (!v.ok()) return v;
        std::string r = l.Emit(absl::StrCat("stablehlo.dot ", *a, ", ", *v, " : (", TypeOf(dm, t), ", ",
                                            TypeOf(dv, t), ") -> ", TypeOf(o.dims, t)));
        if (!add) return r;
        const double beta = d.num_args > 3 ? NumberOf(d.args[3]) : 1, alpha = d.num_args > 4 ? NumberOf(d.args[4]) : 1;
        if (alpha != 1) r = l.Binary("multiply", r, l.Constant(alpha, o.dims, t), o.dims, t);
        if (beta == 0) return r;  // self is not read (nan in it does not spread)
        absl::StatusOr<std::string> self = l.Operand(d.args[0], o.dims, t);
        if (!self.ok()) return self;
        std::string b = *self;
        if (beta != 1) b = l.Binary("multiply", b, l.Constant(beta, o.dims, t), o.dims, t);
        return l.Binary("add", b, r, o.dims, t);
      };
    }
    return m;
  }();
  return *rules;
}

// Special functions from XLA's CHLO dialect (which StableHLO consumers
// accept beside StableHLO: lgamma, digamma, polygamma, zeta, erf_inv, erfc,
// next_after, bessel_i1e), and NaN-aware binaries built from comparisons.
const std::map<std::string, Rule>& SpecialRules() {
  static const auto* rules = [] {
    auto* m = new std::map<std::string, Rule>;
    auto chlo = [](Lowering& l, const char* op, const std::vector<std::string>& xs, const Target& o) {
      std::vector<std::string> types(xs.size(), TypeOf(o.dims, *o.type));
      return l.Emit(absl::StrCat("\"chlo.", op, "\"(", absl::StrJoin(xs, ", "), ") : (",
                                 absl::StrJoin(types, ", "), ") -> ", TypeOf(o.dims, *o.type)));
    };
    for (const auto& [name, op] : std::vector<std::pair<std::string, const char*>>{
             {"lgamma", "lgamma"}, {"erfinv", "erf_inv"},
             {"erfc", "erfc"}, {"special_i1e", "bessel_i1e"}}) {
      const char* f = op;
      (*m)["aten::" + name] = UnaryRule([=](Lowering& l, const std::string& x, const Target& o) {
        return chlo(l, f, {x}, o);
      });
    }
    // digamma has poles at 0 and the negative integers: at 0 it is -inf
    // from above and +inf from below, as in ATen (-1/x gives that sign).
    auto digamma = [chlo](Lowering& l, const std::string& x, const Target& o) {
      const DType& t = *o.type;
      const std::string pole = l.Binary("divide", l.Constant(-1, o.dims, t), x, o.dims, t);
      return l.Select(l.Compare("EQ", x, l.Constant(0, o.dims, t), o.dims, t), pole, chlo(l, "digamma", {x}, o), o.dims, t);
    };
    (*m)["aten::digamma"] = UnaryRule(digamma);
    // Two operands of the output's type, then f(a, b).
    using F2 = std::function<std::string(Lowering&, const std::string&, const std::string&, const Target&)>;
    auto binary = [m](const std::string& name, F2 f) {
      (*m)[name] = [f](Lowering& l, const tpu::DecodedOp& d, const Target& o) -> absl::StatusOr<std::string> {
        if (d.num_args < 2) return Unsupported(l.op(), "too few arguments");
        absl::StatusOr<std::string> a = l.Operand(d.args[0], o.dims, *o.type);
        if (!a.ok()) return a;
        absl::StatusOr<std::string> b = l.Operand(d.args[1], o.dims, *o.type);
        if (!b.ok()) return b;
        return f(l, *a, *b, o);
      };
    };
    auto chlo2 = [chlo](const char* op) {
      return [=](Lowering& l, const std::string& a, const std::string& b, const Target& o) { return chlo(l, op, {a, b}, o); };
    };
    binary("aten::nextafter", chlo2("next_after"));
    // zeta(x, q): the Hurwitz zeta function, CHLO's operand order too.
    binary("aten::special_zeta", chlo2("zeta"));
    // polygamma(n, self): n is an int argument, a tensor of the output's
    // type for CHLO.
    (*m)["aten::polygamma"] = [=](Lowering& l, const tpu::DecodedOp& d, const Target& o) -> absl::StatusOr<std::string> {
      if (d.num_args < 2 || d.args[1].tag != tpu::ArgTag::kTensor) return Unsupported(l.op(), "expects (int n, Tensor self)");
      absl::StatusOr<std::string> x = l.Operand(d.args[1], o.dims, *o.type);
      if (!x.ok()) return x;
      const int64_t n = static_cast<int64_t>(NumberOf(d.args[0]));
      if (n < 0) return absl::InvalidArgumentError(absl::StrCat(l.op(), ": n is ", n, "; polygamma(n, x) takes n >= 0"));
      if (n == 0) return digamma(l, *x, o);
      // CHLO's polygamma is inexact for x < 0, so it is taken at x + K and
      // brought back by the recurrence psi_n(x) = psi_n(x + 1) - (-1)^n n! / x^(n+1)
      // (exact for x >= -K; ATen shifts its zeta function the same way).
      const DType& t = *o.type;
      constexpr int kShift = 16;
      double factorial = 1;
      for (int64_t k = 2; k <= n; ++k) factorial *= static_cast<double>(k);
      const std::string shifted = l.Binary("add", *x, l.Constant(kShift, o.dims, t), o.dims, t);
      // The terms in float64: near a pole, x + j loses the digits that matter.
      const DType& w = F64();
      const std::string xw = t.c10 == 7 ? *x : l.Convert(*x, o.dims, t, w);
      std::string sum = l.Constant(0, o.dims, w);
      const std::string power = l.Constant(static_cast<double>(-(n + 1)), o.dims, w);
      for (int j = 0; j < kShift; ++j) {
        const std::string xj = j == 0 ? xw : l.Binary("add", xw, l.Constant(j, o.dims, w), o.dims, w);
        sum = l.Binary("add", sum, l.Binary("power", xj, power, o.dims, w), o.dims, w);
      }
      if (t.c10 != 7) sum = l.Convert(sum, o.dims, w, t);
      const std::string far = chlo(l, "polygamma", {l.Constant(static_cast<double>(n), o.dims, t), shifted}, o);
      const double sign = n % 2 == 0 ? 1 : -1;
      return l.Binary("subtract", far, l.Binary("multiply", l.Constant(sign * factorial, o.dims, t), sum, o.dims, t), o.dims, t);
    };
    binary("aten::hypot", [](Lowering& l, const std::string& a, const std::string& b, const Target& o) {
      const DType& t = *o.type;
      // max * sqrt(1 + (min/max)^2), without overflow; 0 where both are.
      const std::string x = l.Unary("abs", a, o.dims, t), y = l.Unary("abs", b, o.dims, t);
      const std::string hi = l.Binary("maximum", x, y, o.dims, t), lo = l.Binary("minimum", x, y, o.dims, t);
      const std::string zero = l.Constant(0, o.dims, t);
      const std::string q = l.Select(l.Compare("EQ", hi, zero, o.dims, t), zero, l.Binary("divide", lo, hi, o.dims, t), o.dims, t);
      const std::string r = l.Binary("multiply", hi, l.Unary("sqrt", l.Binary("add", l.Constant(1, o.dims, t),
                                                                              l.Binary("multiply", q, q, o.dims, t), o.dims, t), o.dims, t), o.dims, t);
      // An infinite side makes it infinite, even beside a NaN.
      const std::string inf = l.Binary("divide", l.Constant(1, o.dims, t), zero, o.dims, t);
      const std::string any_inf = l.Binary("or", l.Compare("EQ", x, inf, o.dims, t), l.Compare("EQ", y, inf, o.dims, t), o.dims, *DTypeOf(11));
      return l.Select(any_inf, inf, r, o.dims, t);
    });
    // fmax/fmin: the other operand where one is NaN.
    for (bool max : {true, false}) {
      binary(max ? "aten::fmax" : "aten::fmin", [max](Lowering& l, const std::string& a, const std::string& b, const Target& o) {
        const DType& t = *o.type;
        const std::string r = l.Binary(max ? "maximum" : "minimum", a, b, o.dims, t);
        if (!t.is_float) return r;
        return l.Select(l.Compare("NE", a, a, o.dims, t), b,
                        l.Select(l.Compare("NE", b, b, o.dims, t), a, r, o.dims, t), o.dims, t);
      });
    }
    return m;
  }();
  return *rules;
}

// The FFTs ATen's torch.fft functions come down to: _fft_r2c (real to
// complex, the last transformed dimension halved when onesided), _fft_c2c
// (forward or inverse) and _fft_c2r (the inverse of a onesided r2c, of
// last_dim_size). stablehlo.fft transforms the trailing dimensions, so the
// transformed ones are moved there, in the order given, and back. XLA's
// inverse transforms divide by n; ATen's normalization (0: none, 1: by
// sqrt(n), 2: by n) is applied on top of the unnormalized transform.
const std::map<std::string, Rule>& FftRules() {
  static const auto* rules = [] {
    auto* m = new std::map<std::string, Rule>;
    enum class Fft { kR2C, kC2C, kC2R };
    for (Fft kind : {Fft::kR2C, Fft::kC2C, Fft::kC2R}) {
      Rule r = [kind](Lowering& l, const tpu::DecodedOp& d, const Target& o) -> absl::StatusOr<std::string> {
        if (d.num_args < 4 || !Defined(d, 0) || d.args[1].tag != tpu::ArgTag::kIntList) {
          return Unsupported(l.op(), "arguments of a form not lowered");
        }
        const tpu::TensorRef& x = d.args[0].tensor;
        const DType* xt = DTypeOf(x.dtype);
        if (xt == nullptr || (kind == Fft::kR2C ? !xt->is_float : !IsComplex(*xt))) {
          return Unsupported(l.op(), "an input of this dtype");
        }
        const std::vector<int64_t> in = DimsOf(x);
        const size_t n = in.size();
        std::vector<int64_t> fdims;
        for (int64_t dim : d.args[1].ints) {
          absl::StatusOr<int64_t> c = CheckedDim(l.op(), dim, n);
          if (!c.ok()) return c.status();
          if (std::find(fdims.begin(), fdims.end(), *c) != fdims.end()) return Unsupported(l.op(), "a repeated dim");
          fdims.push_back(*c);
        }
        if (fdims.empty()) {
          absl::StatusOr<std::string> same = l.Operand(d.args[0], in, *xt);
          if (!same.ok()) return same;
          return l.Convert(*same, in, *xt, *o.type);
        }
        const int64_t norm = d.args[2].i;
        const DType& part = kind == Fft::kC2R ? *o.type : (kind == Fft::kR2C ? (xt->c10 == 7 ? F64() : *DTypeOf(6)) : PartOf(*xt));
        const DType& ct = ComplexOf(part);
        if (o.dims.size() != n) return Unsupported(l.op(), "an output of another rank");
        // perm: the other dimensions, then the transformed ones.
        std::vector<int64_t> perm;
        for (size_t q = 0; q < n; ++q) {
          if (std::find(fdims.begin(), fdims.end(), static_cast<int64_t>(q)) == fdims.end()) perm.push_back(q);
        }
        for (int64_t q : fdims) perm.push_back(q);
        auto permuted = [&](const std::vector<int64_t>& dims) {
          std::vector<int64_t> r;
          for (int64_t q : perm) r.push_back(dims[q]);
          return r;
        };
        std::vector<int64_t> inverse(n);
        for (size_t q = 0; q < n; ++q) inverse[perm[q]] = static_cast<int64_t>(q);
        // The signal: its lengths (the output's for c2r, the input's else).
        std::vector<int64_t> length;
        int64_t count = 1;
        for (int64_t q : fdims) {
          length.push_back(kind == Fft::kC2R ? o.dims[q] : in[q]);
          count *= length.back();
        }
        const DType& vt = kind == Fft::kR2C ? part : ct;
        absl::StatusOr<std::string> xv = l.Operand(d.args[0], in, *xt);
        if (!xv.ok()) return xv;
        std::string v = l.Convert(*xv, in, *xt, vt);
        const std::vector<int64_t> pin = permuted(in), pout = permuted(o.dims);
        v = l.Emit(absl::StrCat("stablehlo.transpose ", v, ", dims = [", absl::StrJoin(perm, ", "), "] : (",
                                TypeOf(in, vt), ") -> ", TypeOf(pin, vt)));
        bool inverse_fft = false;
        const char* type = "FFT";
        const DType* rt = &ct;
        std::vector<int64_t> pres = pout;
        if (kind == Fft::kR2C) {
          const bool onesided = d.args[3].tag != tpu::ArgTag::kBool || d.args[3].b;
          if (onesided) {
            type = "RFFT";
          } else {
            v = l.Convert(v, pin, part, ct);
          }
        } else if (kind == Fft::kC2C) {
          inverse_fft = d.args[3].tag == tpu::ArgTag::kBool && !d.args[3].b;
          type = inverse_fft ? "IFFT" : "FFT";
        } else {
          type = "IRFFT";
          inverse_fft = true;
          rt = &part;
          // The input's last transformed dimension holds length / 2 + 1 values.
          const int64_t want = length.back() / 2 + 1;
          std::vector<int64_t> cut = pin;
          if (cut.back() != want) {
            if (cut.back() < want) return Unsupported(l.op(), "an input shorter than last_dim_size / 2 + 1");
            cut.back() = want;
            v = l.Slice(v, pin, std::vector<int64_t>(n, 0), cut, ct);
          }
          pres = cut;
          pres.back() = length.back();
          if (pres != pout) return Unsupported(l.op(), "an output of another shape");
          std::vector<int64_t> fin = cut;
          v = l.Emit(absl::StrCat("stablehlo.fft ", v, ", type = IRFFT, length = [", absl::StrJoin(length, ", "), "] : (",
                                  TypeOf(fin, ct), ") -> ", TypeOf(pres, part)));
        }
        if (kind != Fft::kC2R) {
          const DType& from = kind == Fft::kR2C && std::string(type) == "RFFT" ? part : ct;
          v = l.Emit(absl::StrCat("stablehlo.fft ", v, ", type = ", type, ", length = [", absl::StrJoin(length, ", "),
                                  "] : (", TypeOf(pin, from), ") -> ", TypeOf(pres, ct)));
        }
        // Undo XLA's 1/n on inverses, then apply ATen's normalization.
        double scale = inverse_fft ? static_cast<double>(count) : 1.0;
        if (norm == 1) scale /= std::sqrt(static_cast<double>(count));
        if (norm == 2) scale /= static_cast<double>(count);
        if (scale != 1.0) v = l.Binary("multiply", v, l.Convert(l.Constant(scale, pres, part), pres, part, *rt), pres, *rt);
        v = l.Emit(absl::StrCat("stablehlo.transpose ", v, ", dims = [", absl::StrJoin(inverse, ", "), "] : (",
                                TypeOf(pres, *rt), ") -> ", TypeOf(o.dims, *rt)));
        return l.Convert(v, o.dims, *rt, *o.type);
      };
      (*m)[kind == Fft::kR2C ? "aten::_fft_r2c" : kind == Fft::kC2C ? "aten::_fft_c2c" : "aten::_fft_c2r"] = r;
    }
    // conj_physical: the imaginary part negated (real tensors as they are).
    (*m)["aten::conj_physical"] = [](Lowering& l, const tpu::DecodedOp& d, const Target& o) -> absl::StatusOr<std::string> {
      absl::StatusOr<std::string> x = l.Operand(d.args[0], o.dims, *o.type);
      if (!x.ok() || !IsComplex(*o.type)) return x;
      const DType& part = PartOf(*o.type);
      const std::string re = l.Emit(absl::StrCat("stablehlo.real ", *x, " : (", TypeOf(o.dims, *o.type), ") -> ", TypeOf(o.dims, part)));
      const std::string im = l.Emit(absl::StrCat("stablehlo.imag ", *x, " : (", TypeOf(o.dims, *o.type), ") -> ", TypeOf(o.dims, part)));
      return l.Emit(absl::StrCat("stablehlo.complex ", re, ", ", l.Unary("negate", im, o.dims, part), " : ", TypeOf(o.dims, *o.type)));
    };
    (*m)["aten::_conj_physical"] = (*m)["aten::conj_physical"];
    // angle: atan2(imag, real) of a complex tensor; of a real one, pi where
    // it is negative, 0 elsewhere, NaN where it is NaN.
    (*m)["aten::angle"] = [](Lowering& l, const tpu::DecodedOp& d, const Target& o) -> absl::StatusOr<std::string> {
      if (!Defined(d, 0)) return Unsupported(l.op(), "expects a tensor");
      const DType* xt = DTypeOf(d.args[0].tensor.dtype);
      if (xt == nullptr) return Unsupported(l.op(), "an input of this dtype");
      const DType& t = *o.type;
      if (IsComplex(*xt)) {
        absl::StatusOr<std::string> x = l.Operand(d.args[0], o.dims, *xt);
        if (!x.ok()) return x;
        const DType& part = PartOf(*xt);
        const std::string re = l.Emit(absl::StrCat("stablehlo.real ", *x, " : (", TypeOf(o.dims, *xt), ") -> ", TypeOf(o.dims, part)));
        const std::string im = l.Emit(absl::StrCat("stablehlo.imag ", *x, " : (", TypeOf(o.dims, *xt), ") -> ", TypeOf(o.dims, part)));
        return l.Convert(l.Binary("atan2", im, re, o.dims, part), o.dims, part, t);
      }
      absl::StatusOr<std::string> x = l.Operand(d.args[0], o.dims, t);
      if (!x.ok()) return x;
      const std::string neg = l.Compare("LT", *x, l.Constant(0, o.dims, t), o.dims, t);
      const std::string nan = l.Compare("NE", *x, *x, o.dims, t);
      const std::string a = l.Select(neg, l.Constant(M_PI, o.dims, t), l.Constant(0, o.dims, t), o.dims, t);
      return l.Select(nan, *x, a, o.dims, t);
    };
    return m;
  }();
  return *rules;
}

// The orthogonal polynomials of torch.special (Chebyshev T, U, V, W and
// their shifted forms, Hermite H and He, Laguerre, Legendre) at x, of
// degree n (truncated to an integer), as ATen computes them: its special
// cases first (n < 0, the ends of the interval, the trigonometric forms
// for large n inside it, degrees 0 and 1), else the three-term recurrence
// P_m = (a_m(x) P_{m-1} - b_m P_{m-2}) / c_m from P_0 = 1, P_1, run by a
// while loop up to the largest degree that needs it (an element stops at
// its own degree, and the loop stops once every element it still runs is
// NaN).
enum class Poly { kT, kU, kV, kW, kShiftedT, kShiftedU, kShiftedV, kShiftedW, kH, kHe, kL, kP };

Rule PolynomialRule(Poly kind) {
  return [kind](Lowering& l, const tpu::DecodedOp& d, const Target& o) -> absl::StatusOr<std::string> {
    if (d.num_args < 2) return Unsupported(l.op(), "expects x and n");
    const DType& t = *o.type;
    const DType& i64 = I64();
    const DType& i1 = *DTypeOf(11);
    const std::vector<int64_t>& dims = o.dims;
    absl::StatusOr<std::string> xs = l.Operand(d.args[0], dims, t), ns = l.Operand(d.args[1], dims, i64);
    if (!xs.ok()) return xs;
    if (!ns.ok()) return ns;
    const std::string x = *xs;
    std::string n = *ns;
    auto c = [&](double v) { return l.Constant(v, dims, t); };
    auto ci = [&](double v) { return l.Constant(v, dims, i64); };
    auto add = [&](const std::string& a, const std::string& b) { return l.Binary("add", a, b, dims, t); };
    auto sub = [&](const std::string& a, const std::string& b) { return l.Binary("subtract", a, b, dims, t); };
    auto mul = [&](const std::string& a, const std::string& b) { return l.Binary("multiply", a, b, dims, t); };
    auto div = [&](const std::string& a, const std::string& b) { return l.Binary("divide", a, b, dims, t); };
    auto un = [&](const char* op, const std::string& a) { return l.Unary(op, a, dims, t); };
    auto cmp = [&](const char* dir, const std::string& a, const std::string& b) { return l.Compare(dir, a, b, dims, t); };
    auto cmpi = [&](const char* dir, const std::string& a, double b) { return l.Compare(dir, a, ci(b), dims, i64); };
    auto both = [&](const std::string& a, const std::string& b) { return l.Binary("and", a, b, dims, i1); };
    auto sel = [&](const std::string& p, const std::string& a, const std::string& b) { return l.Select(p, a, b, dims, t); };
    auto acos = [&](const std::string& a) {  // acos(a) = atan2(sqrt(1 - a^2), a)
      return l.Binary("atan2", un("sqrt", sub(c(1), mul(a, a))), a, dims, t);
    };
    if (kind == Poly::kH && DTypeOf(d.args[1].tag == tpu::ArgTag::kTensor ? d.args[1].tensor.dtype : 4)->is_float) {
      // A NaN or infinite degree counts as -1.
      absl::StatusOr<std::string> nf = l.Operand(d.args[1], dims, t);
      if (!nf.ok()) return nf;
      const std::string finite = l.Emit(absl::StrCat("stablehlo.is_finite ", *nf, " : (", TypeOf(dims, t), ") -> ", TypeOf(dims, i1)));
      n = l.Select(finite, n, ci(-1), dims, i64);
    }
    const std::string nt = l.Convert(n, dims, i64, t);
    const std::string even = l.Compare("EQ", l.Binary("remainder", n, ci(2), dims, i64), ci(0), dims, i64);
    const bool shifted = kind == Poly::kShiftedT || kind == Poly::kShiftedU || kind == Poly::kShiftedV || kind == Poly::kShiftedW;
    const bool chebyshev = kind <= Poly::kShiftedW;
    // y: the argument of the Chebyshev forms (2x - 1 when shifted).
    const std::string y = shifted ? sub(add(x, x), c(1)) : x;
    const std::string two_y = add(y, y);
    std::string p1;
    switch (kind) {
      case Poly::kT: case Poly::kShiftedT: case Poly::kP: case Poly::kHe: p1 = y; break;
      case Poly::kU: case Poly::kShiftedU: case Poly::kH: p1 = two_y; break;
      case Poly::kV: case Poly::kShiftedV: p1 = sub(two_y, c(1)); break;
      case Poly::kW: case Poly::kShiftedW: p1 = add(two_y, c(1)); break;
      case Poly::kL: p1 = sub(c(1), x); break;
    }
    const std::string two_n1 = add(add(nt, nt), c(1));  // 2n + 1
    const std::string sign_even = sel(even, c(1), c(-1));
    // Special cases in ATen's order: `cases` from the first that applies.
    std::vector<std::pair<std::string, std::string>> cases;
    cases.emplace_back(cmpi("LT", n, 0), c(0));
    const std::string ax = un("abs", x);
    if (chebyshev) {
      // The ends: |x| = 1 (x = 1 and x = 0 when shifted).
      const std::string hi = shifted ? cmp("EQ", x, c(1)) : both(cmp("EQ", ax, c(1)), cmp("GT", x, c(0)));
      const std::string lo = shifted ? cmp("EQ", x, c(0)) : both(cmp("EQ", ax, c(1)), cmp("LE", x, c(0)));
      const std::string n1 = add(nt, c(1));
      const bool tk = kind == Poly::kT || kind == Poly::kShiftedT, uk = kind == Poly::kU || kind == Poly::kShiftedU;
      const bool vk = kind == Poly::kV || kind == Poly::kShiftedV;
      const std::string at_hi = tk ? c(1) : uk ? n1 : vk ? c(1) : two_n1;
      const std::string at_lo = tk ? sign_even : uk ? mul(n1, sign_even) : vk ? mul(two_n1, sign_even) : sign_even;
      cases.emplace_back(hi, at_hi);
      cases.emplace_back(lo, at_lo);
      const int limit = tk ? 6 : shifted ? (kind == Poly::kShiftedW ? 4 : 6) : 8;
      const std::string inside = both(cmpi("GT", n, limit), cmp("LT", un("abs", y), c(1)));
      const std::string th = acos(y);
      std::string trig;
      if (tk) {
        trig = un("cosine", mul(nt, th));
      } else if (uk) {
        const std::string st = un("sine", th);
        trig = sel(cmp("NE", st, c(0)), div(un("sine", mul(n1, th)), st), div(mul(n1, un("cosine", mul(n1, th))), y));
      } else {
        const std::string half = div(th, c(2)), nh = mul(add(nt, c(0.5)), th);
        if (vk) {
          trig = sel(cmp("NE", un("sine", half), c(1)), div(un("cosine", nh), un("cosine", half)), mul(two_n1, sign_even));
        } else {
          const std::string w_end = shifted ? sign_even : sel(cmp("GT", x, c(0)), two_n1, sign_even);
          trig = sel(cmp("NE", un("cosine", half), c(1)), div(un("sine", nh), un("sine", half)), w_end);
        }
      }
      cases.emplace_back(inside, trig);
    } else if (kind == Poly::kH || kind == Poly::kHe) {
      const int limit = t.c10 == 7 ? 512 : 128;
      cases.emplace_back(both(cmpi("GT", n, limit), cmpi("GE", n, 2)), div(c(0), c(0)));  // NaN
    } else if (kind == Poly::kL) {
      cases.emplace_back(cmp("EQ", ax, c(0)), c(1));
    } else {
      cases.emplace_back(cmp("EQ", ax, c(1)), sign_even);
      // (x > 0 or n even: 1; else -1.)
      cases.back().second = sel(cmp("GT", x, c(0)), c(1), sign_even);
    }
    cases.emplace_back(cmpi("EQ", n, 0), c(1));
    cases.emplace_back(cmpi("EQ", n, 1), p1);
    // The degrees the recurrence runs to: 0 where a special case answers.
    std::string special = l.Constant(0, dims, i1);
    for (const auto& [when, value] : cases) special = l.Binary("or", special, when, dims, i1);
    const std::string degree = l.Select(special, ci(0), n, dims, i64);
    const std::string top = l.ReduceOver(degree, dims, Range(dims.size()), "maximum", l.Constant(0, {}, i64), i64);
    // The loop: (m, p, q) from (2, 1, P_1) while m <= top and some element
    // at m <= its degree is not NaN.
    const int id = l.NextId();
    const std::string m_arg = absl::StrCat("%w", id, "m"), p_arg = absl::StrCat("%w", id, "p"), q_arg = absl::StrCat("%w", id, "q");
    const std::string ts = TypeOf({}, i64), tv = TypeOf(dims, t);
    std::string going;
    const std::string cond = l.Region([&] {
      const std::string active = both(l.Compare("LE", l.BroadcastTo(m_arg, {}, dims, i64), degree, dims, i64), cmp("EQ", q_arg, q_arg));
      const std::string any = l.ReduceOver(active, dims, Range(dims.size()), "or", l.Constant(0, {}, i1), i1);
      going = l.Binary("and", l.Compare("LE", m_arg, top, {}, i64), any, {}, i1);
    });
    std::string m_next, q_next, p_next;
    const std::string body = l.Region([&] {
      const std::string mb = l.BroadcastTo(m_arg, {}, dims, i64);
      const std::string k = l.Convert(l.Binary("subtract", mb, ci(1), dims, i64), dims, i64, t);  // m - 1
      std::string r;
      switch (kind) {
        case Poly::kH: r = sub(mul(add(x, x), q_arg), mul(add(k, k), p_arg)); break;
        case Poly::kHe: r = sub(mul(x, q_arg), mul(k, p_arg)); break;
        case Poly::kL: r = div(sub(mul(add(add(k, k), sub(c(1), x)), q_arg), mul(k, p_arg)), add(k, c(1))); break;
        case Poly::kP: r = div(sub(mul(mul(add(add(k, k), c(1)), x), q_arg), mul(k, p_arg)), add(k, c(1))); break;
        default: r = sub(mul(two_y, q_arg), p_arg); break;
      }
      const std::string step = l.Compare("LE", mb, degree, dims, i64);
      q_next = sel(step, r, q_arg);
      p_next = sel(step, q_arg, p_arg);
      m_next = l.Binary("add", m_arg, l.Constant(1, {}, i64), {}, i64);
    });
    const std::string loop = l.EmitResults(absl::StrCat(
        "stablehlo.while(", m_arg, " = ", l.Constant(2, {}, i64), ", ", p_arg, " = ", c(1), ", ", q_arg, " = ", p1, ") : ",
        ts, ", ", tv, ", ", tv, "\n    cond {\n", cond, "      stablehlo.return ", going, " : ", TypeOf({}, i1),
        "\n    } do {\n", body, "      stablehlo.return ", m_next, ", ", p_next, ", ", q_next, " : ", ts, ", ", tv, ", ", tv,
        "\n    }"), 3);
    std::string r = loop + "#2";
    for (size_t i = cases.size(); i-- > 0;) r = sel(cases[i].first, cases[i].second, r);
    return r;
  };
}

const std::map<std::string, Rule>& PolynomialRules() {
  static const auto* rules = [] {
    auto* m = new std::map<std::string, Rule>;
    const std::pair<const char*, Poly> polys[] = {
        {"chebyshev_polynomial_t", Poly::kT}, {"chebyshev_polynomial_u", Poly::kU},
        {"chebyshev_polynomial_v", Poly::kV}, {"chebyshev_polynomial_w", Poly::kW},
        {"shifted_chebyshev_polynomial_t", Poly::kShiftedT}, {"shifted_chebyshev_polynomial_u", Poly::kShiftedU},
        {"shifted_chebyshev_polynomial_v", Poly::kShiftedV}, {"shifted_chebyshev_polynomial_w", Poly::kShiftedW},
        {"hermite_polynomial_h", Poly::kH}, {"hermite_polynomial_he", Poly::kHe},
        {"laguerre_polynomial_l", Poly::kL}, {"legendre_polynomial_p", Poly::kP},
    };
    for (const auto& [name, kind] : polys) {
      for (const char* form : {"", ".x_scalar", ".n_scalar"}) (*m)[absl::StrCat("aten::special_", name, form)] = PolynomialRule(kind);
    }
    return m;
  }();
  return *rules;
}

// Flat positions and shifts: roll, put_, masked_scatter_, nonzero_static;
// running log-sum-exp; distances (cdist, pdist).
const std::map<std::string, Rule>& ReshuffleRules() {
  static const auto* rules = [] {
    auto* m = new std::map<std::string, Rule>;
    // roll(self, shifts, dims): each dim rotated by its shift (no dims: the
    // flattened tensor), as two slices joined.
    (*m)["aten::roll"] = [](Lowering& l, const tpu::DecodedOp& d, const Target& o) -> absl::StatusOr<std::string> {
      if (!Defined(d, 0) || d.num_args < 3) return Unsupported(l.op(), "arguments of a form not lowered");
      const DType& t = *o.type;
      absl::StatusOr<std::string> x = l.Operand(d.args[0], o.dims, t);
      if (!x.ok()) return x;
      const std::vector<int64_t>& shifts = d.args[1].ints;
      std::vector<int64_t> dims = d.args[2].ints;
      std::vector<int64_t> in = o.dims;
      std::string v = *x;
      const bool flat = dims.empty();
      int64_t total = 1;
      for (int64_t s : in) total *= s;
      if (flat) {
        if (shifts.size() != 1) return absl::InvalidArgumentError(absl::StrCat(l.op(), ": shifts and dims must match"));
        v = l.Reshape(v, in, {total}, t);
        in = {total};
        dims = {0};
      }
      if (shifts.size() != dims.size()) return absl::InvalidArgumentError(absl::StrCat(l.op(), ": shifts and dims must match"));
      for (size_t q = 0; q < dims.size(); ++q) {
        absl::StatusOr<int64_t> dim = CheckedDim(l.op(), dims[q], in.size());
        if (!dim.ok()) return dim.status();
        const int64_t size = in[*dim];
        if (size == 0) continue;
        const int64_t sh = ((shifts[q] % size) + size) % size;
        if (sh == 0) continue;
        const std::string tail = l.SliceAlong(v, in, *dim, size - sh, size, t), head = l.SliceAlong(v, in, *dim, 0, size - sh, t);
        std::vector<int64_t> td = in, hd = in;
        td[*dim] = sh;
        hd[*dim] = size - sh;
        v = l.Emit(absl::StrCat("stablehlo.concatenate ", tail, ", ", head, ", dim = ", *dim, " : (", TypeOf(td, t), ", ",
                                TypeOf(hd, t), ") -> ", TypeOf(in, t)));
      }
      return flat ? l.Reshape(v, in, o.dims, t) : v;
    };
    // _logcumsumexp(self, dim): a running log-sum-exp.
    (*m)["aten::_logcumsumexp"] = [](Lowering& l, const tpu::DecodedOp& d, const Target& o) -> absl::StatusOr<std::string> {
      if (!Defined(d, 0) || d.num_args < 2) return Unsupported(l.op(), "arguments of a form not lowered");
      absl::StatusOr<std::string> x = l.Operand(d.args[0], o.dims, *o.type);
      if (!x.ok() || o.dims.empty()) return x;
      absl::StatusOr<int64_t> dim = CheckedDim(l.op(), d.args[1].i, o.dims.size());
      if (!dim.ok()) return dim.status();
      return Running(l, *x, o.dims, *dim, "logaddexp", 0, *o.type, l.Lowest(*o.type));
    };
    // put_(self, index, source, accumulate): self flattened, source written
    // (or added) at the flat positions index gives (negative from the end).
    (*m)["aten::put_"] = [](Lowering& l, const tpu::DecodedOp& d, const Target& o) -> absl::StatusOr<std::string> {
      if (d.num_args < 4 || !Defined(d, 0) || !Defined(d, 1) || !Defined(d, 2)) return Unsupported(l.op(), "arguments of a form not lowered");
      const DType& t = *o.type;
      const DType& i64 = I64();
      int64_t total = 1;
      for (int64_t s : o.dims) total *= s;
      const int64_t n = Numel(d.args[1].tensor);
      absl::StatusOr<std::string> x = l.Operand(d.args[0], o.dims, t);
      if (!x.ok() || n == 0) return x;
      if (Numel(d.args[2].tensor) != n) return absl::InvalidArgumentError(absl::StrCat(l.op(), ": source and index need as many elements"));
      absl::StatusOr<std::string> ix = l.Operand(d.args[1], DimsOf(d.args[1].tensor), i64),
                                  src = l.Operand(d.args[2], DimsOf(d.args[2].tensor), t);
      if (!ix.ok()) return ix;
      if (!src.ok()) return src;
      std::string idx = l.Reshape(*ix, DimsOf(d.args[1].tensor), {n}, i64);
      idx = l.Select(l.Compare("LT", idx, l.Constant(0, {n}, i64), {n}, i64),
                     l.Binary("add", idx, l.Constant(static_cast<double>(total), {n}, i64), {n}, i64), idx, {n}, i64);
      l.CheckRange(idx, {n}, total, absl::StrCat("an index is out of range for a tensor of ", total, " elements"));
      const bool accumulate = d.args[3].tag == tpu::ArgTag::kBool && d.args[3].b;
      const std::string r = ScatterFlat(l, l.Reshape(*x, o.dims, {total}, t), total, idx,
                                        l.Reshape(*src, DimsOf(d.args[2].tensor), {n}, t), n, accumulate, t);
      return l.Reshape(r, {total}, o.dims, t);
    };
    // masked_scatter_(self, mask, source): the k-th selected element of self
    // (in order) becomes source's k-th.
    (*m)["aten::masked_scatter_"] = [](Lowering& l, const tpu::DecodedOp& d, const Target& o) -> absl::StatusOr<std::string> {
      if (d.num_args < 3 || !Defined(d, 0) || !Defined(d, 1) || !Defined(d, 2)) return Unsupported(l.op(), "arguments of a form not lowered");
      const DType& t = *o.type;
      const DType& i64 = I64();
      const DType& i1 = *DTypeOf(11);
      int64_t total = 1;
      for (int64_t s : o.dims) total *= s;
      const int64_t ns = Numel(d.args[2].tensor);
      absl::StatusOr<std::string> x = l.Operand(d.args[0], o.dims, t), mk = l.Operand(d.args[1], o.dims, i1);
      if (!x.ok()) return x;
      if (!mk.ok()) return mk;
      if (total == 0 || ns == 0) return *x;
      absl::StatusOr<std::string> src = l.Operand(d.args[2], DimsOf(d.args[2].tensor), t);
      if (!src.ok()) return src;
      const std::vector<int64_t> flat = {total};
      const std::string mf = l.Reshape(*mk, o.dims, flat, i1);
      const std::string pos = l.Binary("subtract", Running(l, l.Convert(mf, flat, i1, i64), flat, 0, "add", 0, i64),
                                       l.Constant(1, flat, i64), flat, i64);
      const std::string at = l.Reshape(l.Binary("minimum", l.Binary("maximum", pos, l.Constant(0, flat, i64), flat, i64),
                                                l.Constant(static_cast<double>(ns - 1), flat, i64), flat, i64),
                                       flat, {total, 1}, i64);
      const std::string got = l.Emit(absl::StrCat(
          "\"stablehlo.gather\"(", l.Reshape(*src, DimsOf(d.args[2].tensor), {ns}, t), ", ", at,
          ") {dimension_numbers = #stablehlo.gather<collapsed_slice_dims = [0], start_index_map = [0], index_vector_dim = 1>, "
          "indices_are_sorted = false, slice_sizes = array<i64: 1>} : (", TypeOf({ns}, t), ", ", TypeOf({total, 1}, i64),
          ") -> ", TypeOf(flat, t)));
      return l.Select(*mk, l.Reshape(got, flat, o.dims, t), *x, o.dims, t);
    };
    // nonzero_static(self, *, size, fill_value): the first `size` positions
    // of nonzero elements, in order, the rest fill_value.
    (*m)["aten::nonzero_static"] = [](Lowering& l, const tpu::DecodedOp& d, const Target& o) -> absl::StatusOr<std::string> {
      if (d.num_args < 3 || !Defined(d, 0) || o.dims.size() != 2) return Unsupported(l.op(), "arguments of a form not lowered");
      const DType& i64 = I64();
      const DType& i1 = *DTypeOf(11);
      const DType* xt = DTypeOf(d.args[0].tensor.dtype);
      if (xt == nullptr) return Unsupported(l.op(), "a dtype that is not lowered");
      const std::vector<int64_t> in = DimsOf(d.args[0].tensor);
      const int64_t size = o.dims[0];
      int64_t total = 1;
      for (int64_t s : in) total *= s;
      const double fill = NumberOf(d.args[2]);
      if (size == 0 || o.dims[1] == 0) return l.Constant(fill, o.dims, i64);
      absl::StatusOr<std::string> x = l.Operand(d.args[0], in, *xt);
      if (!x.ok()) return x;
      const int64_t len = std::max(total, size);
      const std::vector<int64_t> flat = {total};
      const std::string mf = l.Reshape(l.Compare("NE", *x, l.Constant(0, in, *xt), in, *xt), in, flat, i1);
      std::string key = l.Select(mf, l.Iota(0, flat, i64), l.Constant(static_cast<double>(total), flat, i64), flat, i64);
      if (len > total) {
        key = l.Emit(absl::StrCat("stablehlo.pad ", key, ", ", l.Constant(static_cast<double>(total), {}, i64), ", low = [0], high = [",
                                  len - total, "], interior = [0] : (", TypeOf(flat, i64), ", ", TypeOf({}, i64), ") -> ",
                                  TypeOf({len}, i64)));
      }
      const std::string keys = l.SliceAlong(l.Sort(key, {len}, 0, false, i64).first, {len}, 0, 0, size, i64);
      const std::vector<int64_t> sv = {size};
      const std::string missing = l.Compare("GE", keys, l.Constant(static_cast<double>(total), sv, i64), sv, i64);
      std::vector<std::string> parts;
      int64_t stride = total;
      for (int64_t dsz : in) {
        stride /= dsz;
        const std::string c = l.Binary("remainder", l.Binary("divide", keys, l.Constant(static_cast<double>(stride), sv, i64), sv, i64),
                                       l.Constant(static_cast<double>(dsz), sv, i64), sv, i64);
        parts.push_back(l.Select(missing, l.Constant(fill, sv, i64), c, sv, i64));
      }
      return l.Convert(StackIndices(l, parts, sv), o.dims, i64, *o.type);
    };
    // _cdist_forward(x1, x2, p, compute_mode): p-norm distances between the
    // rows of x1 (.., P, M) and x2 (.., R, M); Euclidean distances of many
    // rows go by matrix products, as ATen's do (compute_mode 0 past 25 rows,
    // 1 always, 2 never).
    (*m)["aten::_cdist_forward"] = [](Lowering& l, const tpu::DecodedOp& d, const Target& o) -> absl::StatusOr<std::string> {
      if (d.num_args < 3 || !Defined(d, 0) || !Defined(d, 1) || o.dims.size() < 2) return Unsupported(l.op(), "arguments of a form not lowered");
      const DType& t = *o.type;
      const std::vector<int64_t> batch = BatchOf(o.dims);
      const std::vector<int64_t> d1 = DimsOf(d.args[0].tensor), d2 = DimsOf(d.args[1].tensor);
      const int64_t pr = o.dims[o.dims.size() - 2], rr = o.dims.back(), mm = d1.back();
      absl::StatusOr<std::string> a = MatrixOperand(l, d.args[0], batch, t), b = MatrixOperand(l, d.args[1], batch, t);
      if (!a.ok()) return a;
      if (!b.ok()) return b;
      const double p = NumberOf(d.args[2]);
      const int64_t mode = d.num_args > 3 && (d.args[3].tag == tpu::ArgTag::kInt || d.args[3].tag == tpu::ArgTag::kSymInt) ? d.args[3].i : 0;
      const size_t nb = batch.size();
      std::vector<int64_t> ad = batch, bd = batch;
      ad.insert(ad.end(), {pr, mm});
      bd.insert(bd.end(), {rr, mm});
      std::vector<int64_t> bmap;
      for (size_t q = 0; q < nb; ++q) bmap.push_back(static_cast<int64_t>(q));
      if (p == 2 && (mode == 1 || (mode == 0 && (pr > 25 || rr > 25)))) {
        // |a|^2 + |b|^2 - 2 a.b, at least 0, square-rooted.
        const std::string an = l.ReduceOver(l.Binary("multiply", *a, *a, ad, t), ad, {static_cast<int64_t>(nb + 1)}, "add", l.Constant(0, {}, t), t);
        const std::string bn = l.ReduceOver(l.Binary("multiply", *b, *b, bd, t), bd, {static_cast<int64_t>(nb + 1)}, "add", l.Constant(0, {}, t), t);
        std::vector<int64_t> am = bmap, bm = bmap;
        am.push_back(static_cast<int64_t>(nb));
        bm.push_back(static_cast<int64_t>(nb + 1));
        std::vector<int64_t> an_d = batch, bn_d = batch;
        an_d.push_back(pr);
        bn_d.push_back(rr);
        const std::string dot = l.Emit(absl::StrCat(
            "stablehlo.dot_general ", *a, ", ", *b, ", batching_dims = [", absl::StrJoin(bmap, ", "), "] x [", absl::StrJoin(bmap, ", "),
            "], contracting_dims = [", nb + 1, "] x [", nb + 1, "] : (", TypeOf(ad, t), ", ", TypeOf(bd, t), ") -> ", TypeOf(o.dims, t)));
        std::string sq = l.Binary("add", BroadcastInDim(l, an, an_d, o.dims, am, t), BroadcastInDim(l, bn, bn_d, o.dims, bm, t), o.dims, t);
        sq = l.Binary("subtract", sq, l.Binary("multiply", l.Constant(2, o.dims, t), dot, o.dims, t), o.dims, t);
        sq = l.Binary("maximum", sq, l.Constant(0, o.dims, t), o.dims, t);
        return l.Unary("sqrt", sq, o.dims, t);
      }
      // |a_i - b_j| over (.., P, R, M).
      std::vector<int64_t> full = o.dims;
      full.push_back(mm);
      std::vector<int64_t> amap = bmap, bmap2 = bmap;
      amap.insert(amap.end(), {static_cast<int64_t>(nb), static_cast<int64_t>(nb + 2)});
      bmap2.insert(bmap2.end(), {static_cast<int64_t>(nb + 1), static_cast<int64_t>(nb + 2)});
      const std::string diff = l.Unary("abs", l.Binary("subtract", BroadcastInDim(l, *a, ad, full, amap, t),
                                                       BroadcastInDim(l, *b, bd, full, bmap2, t), full, t), full, t);
      return PNorm(l, diff, full, static_cast<int64_t>(nb + 2), p, t);
    };
    // special_spherical_bessel_j0: sin(x) / x, by its series below 0.5,
    // 0 at infinity (as ATen).
    (*m)["aten::special_spherical_bessel_j0"] = [](Lowering& l, const tpu::DecodedOp& d, const Target& o)
        -> absl::StatusOr<std::string> {
      const DType& t = *o.type;
      const std::vector<int64_t>& dims = o.dims;
      absl::StatusOr<std::string> xs = l.Operand(d.args[0], dims, t);
      if (!xs.ok()) return xs;
      const std::string x = *xs, x2 = l.Binary("multiply", x, x, dims, t);
      const double coef[] = {1.0 / 6227020800.0, -1.0 / 39916800.0, 1.0 / 362880.0, -1.0 / 5040.0, 1.0 / 120.0, -1.0 / 6.0};
      std::string series = l.Constant(coef[0], dims, t);
      for (int q = 1; q < 6; ++q) series = l.Binary("add", l.Constant(coef[q], dims, t), l.Binary("multiply", x2, series, dims, t), dims, t);
      series = l.Binary("add", l.Constant(1, dims, t), l.Binary("multiply", x2, series, dims, t), dims, t);
      const std::string ratio = l.Binary("divide", l.Unary("sine", x, dims, t), x, dims, t);
      const std::string ax = l.Unary("abs", x, dims, t);
      std::string r = l.Select(l.Compare("LT", ax, l.Constant(0.5, dims, t), dims, t), series, ratio, dims, t);
      const std::string inf = l.Compare("EQ", ax, l.BroadcastTo(Highest(l, t), {}, dims, t), dims, t);
      return l.Select(inf, l.Constant(0, dims, t), r, dims, t);
    };
    // histc(self, bins, min, max): counts in `bins` equal bins over
    // [min, max] (the data's range when min = max, widened by 1 each way
    // when that is one value); the top edge falls in the last bin, what lies
    // outside (and NaN) is not counted.
    (*m)["aten::histc"] = [](Lowering& l, const tpu::DecodedOp& d, const Target& o) -> absl::StatusOr<std::string> {
      if (d.num_args < 4 || !Defined(d, 0) || o.dims.size() != 1) return Unsupported(l.op(), "arguments of a form not lowered");
      const DType& t = *o.type;
      const DType& i64 = I64();
      const int64_t bins = o.dims[0];
      if (bins <= 0) return absl::InvalidArgumentError(absl::StrCat(l.op(), ": bins must be positive"));
      const std::vector<int64_t> in = DimsOf(d.args[0].tensor);
      int64_t total = 1;
      for (int64_t q : in) total *= q;
      if (total == 0) return l.Constant(0, o.dims, t);
      const std::vector<int64_t> flat = {total};
      absl::StatusOr<std::string> xs = l.Operand(d.args[0], in, t);
      if (!xs.ok()) return xs;
      const std::string x = l.Reshape(*xs, in, flat, t);
      const double lo_arg = NumberOf(d.args[2]), hi_arg = NumberOf(d.args[3]);
      if (lo_arg > hi_arg) return absl::InvalidArgumentError(absl::StrCat(l.op(), ": max must be larger than min"));
      std::string lo = l.Constant(lo_arg, {}, t), hi = l.Constant(hi_arg, {}, t);
      if (lo_arg == hi_arg) {
        lo = l.ReduceOver(x, flat, {0}, "minimum", Highest(l, t), t);
        hi = l.ReduceOver(x, flat, {0}, "maximum", l.Lowest(t), t);
      }
      const std::string same = l.Compare("EQ", lo, hi, {}, t);
      lo = l.Select(same, l.Binary("subtract", lo, l.Constant(1, {}, t), {}, t), lo, {}, t);
      hi = l.Select(same, l.Binary("add", hi, l.Constant(1, {}, t), {}, t), hi, {}, t);
      const std::string lb = l.BroadcastTo(lo, {}, flat, t), hb = l.BroadcastTo(hi, {}, flat, t);
      const DType& i1 = *DTypeOf(11);
      const std::string inside = l.Binary("and", l.Compare("GE", x, lb, flat, t), l.Compare("LE", x, hb, flat, t), flat, i1);
      const std::string scaled = l.Binary("divide", l.Binary("multiply", l.Binary("subtract", x, lb, flat, t),
                                                             l.Constant(static_cast<double>(bins), flat, t), flat, t),
                                          l.Binary("subtract", hb, lb, flat, t), flat, t);
      std::string pos = l.Convert(l.Select(inside, scaled, l.Constant(0, flat, t), flat, t), flat, t, i64);
      pos = l.Binary("minimum", pos, l.Constant(static_cast<double>(bins - 1), flat, i64), flat, i64);
      const std::string ones = l.Select(inside, l.Constant(1, flat, t), l.Constant(0, flat, t), flat, t);
      return ScatterFlat(l, l.Constant(0, o.dims, t), bins, pos, ones, total, true, t);
    };
    // _adaptive_avg_pool2d / 3d(self, output_size): output o of a dimension
    // of n inputs averages inputs [floor(o n / out), ceil((o + 1) n / out)),
    // one spatial dimension at a time (sums), divided by the window's size.
    for (int sp : {2, 3}) {
      (*m)[absl::StrCat("aten::_adaptive_avg_pool", sp, "d")] = [sp](Lowering& l, const tpu::DecodedOp& d, const Target& o)
          -> absl::StatusOr<std::string> {
        if (!Defined(d, 0) || o.dims.size() < static_cast<size_t>(sp)) return Unsupported(l.op(), "arguments of a form not lowered");
        const DType& t = *o.type;
        std::vector<int64_t> cur = DimsOf(d.args[0].tensor);
        if (cur.size() != o.dims.size()) return Unsupported(l.op(), "an output of another rank");
        absl::StatusOr<std::string> x = l.Operand(d.args[0], cur, t);
        if (!x.ok()) return x;
        std::string v = *x, count = l.Constant(1, o.dims, t);
        const size_t lead = cur.size() - sp;
        for (int k = 0; k < sp; ++k) {
          const size_t q = lead + k;
          const int64_t n = cur[q], out = o.dims[q];
          if (n == 0 || out == 0) return l.Constant(0, o.dims, t);
          // window mask (out, n), and its sizes
          const std::vector<int64_t> wd = {out, n};
          const std::string in_win = AdaptiveWindow(l, wd, 0, 1, n, out);
          const std::string w = l.Select(in_win, l.Constant(1, wd, t), l.Constant(0, wd, t), wd, t);
          // full: cur with (out, n) at (q, q + 1)
          std::vector<int64_t> full, xmap, wmap = {static_cast<int64_t>(q), static_cast<int64_t>(q + 1)};
          for (size_t r = 0; r < cur.size(); ++r) {
            if (r == q) full.push_back(out);
            full.push_back(cur[r]);
          }
          for (size_t r = 0; r < cur.size(); ++r) xmap.push_back(static_cast<int64_t>(r < q ? r : r + 1));
          const std::string prod = l.Binary("multiply", BroadcastInDim(l, v, cur, full, xmap, t), BroadcastInDim(l, w, wd, full, wmap, t), full, t);
          std::vector<int64_t> next = cur;
          next[q] = out;
          v = l.ReduceOver(prod, full, {static_cast<int64_t>(q + 1)}, "add", l.Constant(0, {}, t), t);
          const std::string sizes = l.ReduceOver(w, wd, {1}, "add", l.Constant(0, {}, t), t);
          count = l.Binary("multiply", count, BroadcastInDim(l, sizes, {out}, o.dims, {static_cast<int64_t>(q)}, t), o.dims, t);
          cur = next;
        }
        return l.Binary("divide", v, count, o.dims, t);
      };
    }
    // _pdist_forward(self, p): the distances of the pairs of rows i < j, in
    // order: the upper triangle of cdist(self, self), gathered.
    (*m)["aten::_pdist_forward"] = [](Lowering& l, const tpu::DecodedOp& d, const Target& o) -> absl::StatusOr<std::string> {
      if (d.num_args < 2 || !Defined(d, 0) || d.args[0].tensor.ndim != 2 || o.dims.size() != 1) {
        return Unsupported(l.op(), "expects a matrix");
      }
      const DType& t = *o.type;
      const DType& i64 = I64();
      const std::vector<int64_t> in = DimsOf(d.args[0].tensor);
      const int64_t n = in[0], mm = in[1], pairs = o.dims[0];
      if (pairs != n * (n - 1) / 2) return absl::InvalidArgumentError(absl::StrCat(l.op(), ": the output does not hold every pair"));
      if (pairs == 0) return l.Constant(0, o.dims, t);
      if (pairs > (int64_t{1} << 16)) return Unsupported(l.op(), "more than 65536 pairs");
      absl::StatusOr<std::string> x = l.Operand(d.args[0], in, t);
      if (!x.ok()) return x;
      const double p = NumberOf(d.args[1]);
      const std::vector<int64_t> full = {n, n, mm};
      const std::string diff = l.Unary("abs", l.Binary("subtract", BroadcastInDim(l, *x, in, full, {0, 2}, t),
                                                       BroadcastInDim(l, *x, in, full, {1, 2}, t), full, t), full, t);
      const std::vector<int64_t> nn = {n, n};
      const std::string dist = PNorm(l, diff, full, 2, p, t);
      std::vector<std::string> at;
      for (int64_t i = 0; i < n; ++i) {
        for (int64_t j = i + 1; j < n; ++j) at.push_back(absl::StrCat(i * n + j));
      }
      const std::string index = l.Emit(absl::StrCat("stablehlo.constant dense<[", absl::StrJoin(at, ", "), "]> : ", TypeOf({pairs}, i64)));
      return l.Emit(absl::StrCat(
          "\"stablehlo.gather\"(", l.Reshape(dist, nn, {n * n}, t), ", ", l.Reshape(index, {pairs}, {pairs, 1}, i64),
          ") {dimension_numbers = #stablehlo.gather<collapsed_slice_dims = [0], start_index_map = [0], index_vector_dim = 1>, "
          "indices_are_sorted = true, slice_sizes = array<i64: 1>} : (", TypeOf({n * n}, t), ", ", TypeOf({pairs, 1}, i64),
          ") -> ", TypeOf({pairs}, t)));
    };
    return m;
  }();
  return *rules;
}

// Factorizations and solves XLA has ops for: Cholesky and triangular
// solves (and what is built from them).
const std::map<std::string, Rule>& LinalgRules() {
  static const auto* rules = [] {
    auto* m = new std::map<std::string, Rule>;
    // cholesky(self, upper).
    (*m)["aten::cholesky"] = [](Lowering& l, const tpu::DecodedOp& d, const Target& o) -> absl::StatusOr<std::string> {
      if (!Defined(d, 0) || o.dims.size() < 2) return Unsupported(l.op(), "expects a matrix or a batch of them");
      absl::StatusOr<std::string> a = l.Operand(d.args[0], o.dims, *o.type);
      if (!a.ok()) return a;
      const bool upper = d.num_args > 1 && d.args[1].tag == tpu::ArgTag::kBool && d.args[1].b;
      return Cholesky(l, *a, o.dims, upper, *o.type);
    };
    // linalg_solve_triangular(self = A, B, *, upper, left, unitriangular).
    (*m)["aten::linalg_solve_triangular"] = [](Lowering& l, const tpu::DecodedOp& d, const Target& o)
        -> absl::StatusOr<std::string> {
      if (d.num_args < 5 || o.dims.size() < 2) return Unsupported(l.op(), "arguments of a form not lowered");
      const DType& t = *o.type;
      const std::vector<int64_t> batch = BatchOf(o.dims);
      absl::StatusOr<std::string> a = MatrixOperand(l, d.args[0], batch, t), b = MatrixOperand(l, d.args[1], batch, t);
      if (!a.ok()) return a;
      if (!b.ok()) return b;
      const std::vector<int64_t> ad = WithBatch(DimsOf(d.args[0].tensor), batch);
      return TriangularSolve(l, *a, ad, *b, o.dims, d.args[3].b, !d.args[2].b, d.args[4].b, false, t);
    };
    // _cholesky_solve_helper(self = B, A = the factor, upper): two
    // triangular solves, L (L^T X) = B or U^T (U X) = B.
    (*m)["aten::_cholesky_solve_helper"] = [](Lowering& l, const tpu::DecodedOp& d, const Target& o)
        -> absl::StatusOr<std::string> {
      if (d.num_args < 3 || o.dims.size() < 2) return Unsupported(l.op(), "arguments of a form not lowered");
      const DType& t = *o.type;
      const std::vector<int64_t> batch = BatchOf(o.dims);
      absl::StatusOr<std::string> b = MatrixOperand(l, d.args[0], batch, t), a = MatrixOperand(l, d.args[1], batch, t);
      if (!a.ok()) return a;
      if (!b.ok()) return b;
      const std::vector<int64_t> ad = WithBatch(DimsOf(d.args[1].tensor), batch);
      const bool upper = d.args[2].b;
      const std::string y = TriangularSolve(l, *a, ad, *b, o.dims, true, !upper, false, upper, t);
      return TriangularSolve(l, *a, ad, y, o.dims, true, !upper, false, !upper, t);
    };
    // cholesky_inverse(self = the factor, upper): (L L^T)^-1, the solve of
    // the identity.
    (*m)["aten::cholesky_inverse"] = [](Lowering& l, const tpu::DecodedOp& d, const Target& o)
        -> absl::StatusOr<std::string> {
      if (!Defined(d, 0) || o.dims.size() < 2) return Unsupported(l.op(), "expects a matrix or a batch of them");
      const DType& t = *o.type;
      absl::StatusOr<std::string> a = l.Operand(d.args[0], o.dims, t);
      if (!a.ok()) return a;
      const bool upper = d.num_args > 1 && d.args[1].tag == tpu::ArgTag::kBool && d.args[1].b;
      const std::string y = TriangularSolve(l, *a, o.dims, Identity(l, o.dims, t), o.dims, true, !upper, false, upper, t);
      return TriangularSolve(l, *a, o.dims, y, o.dims, true, !upper, false, !upper, t);
    };
    // linalg_lu_solve(LU, pivots, B, *, left, adjoint): the solve of A X = B
    // (A^T X = B) from A's factorization; left=False is not lowered.
    (*m)["aten::linalg_lu_solve"] = [](Lowering& l, const tpu::DecodedOp& d, const Target& o) -> absl::StatusOr<std::string> {
      if (d.num_args < 5 || !Defined(d, 0) || !Defined(d, 1) || !Defined(d, 2) || o.dims.size() < 2) {
        return Unsupported(l.op(), "arguments of a form not lowered");
      }
      if (d.args[3].tag == tpu::ArgTag::kBool && !d.args[3].b) return Unsupported(l.op(), "left=False");
      const DType& t = *o.type;
      const std::vector<int64_t> batch = BatchOf(o.dims);
      const std::vector<int64_t> ad = WithBatch(DimsOf(d.args[0].tensor), batch);
      absl::StatusOr<std::string> lu = MatrixOperand(l, d.args[0], batch, t), b = MatrixOperand(l, d.args[2], batch, t);
      if (!lu.ok()) return lu;
      if (!b.ok()) return b;
      std::vector<int64_t> pdims = batch;
      pdims.push_back(ad.back());
      const std::vector<int64_t> pin = DimsOf(d.args[1].tensor);
      absl::StatusOr<std::string> pv = l.Operand(d.args[1], pin, I64());
      if (!pv.ok()) return pv;
      const std::string piv = l.BroadcastTo(*pv, pin, pdims, I64());
      const bool adjoint = d.args[4].tag == tpu::ArgTag::kBool && d.args[4].b;
      return LuSolve(l, *lu, ad, piv, *b, MatrixShape(o.dims), adjoint, t);
    };
    // linalg_householder_product(input, tau): the first n columns of
    // H_0 ... H_{k-1}; ormqr(input, tau, other, left, transpose): Q or Q^T
    // times other (left), or other times them (right, by transposing).
    (*m)["aten::linalg_householder_product"] = [](Lowering& l, const tpu::DecodedOp& d, const Target& o)
        -> absl::StatusOr<std::string> {
      if (d.num_args < 2 || !Defined(d, 0) || !Defined(d, 1) || o.dims.size() < 2) return Unsupported(l.op(), "arguments of a form not lowered");
      const DType& t = *o.type;
      const MatrixShape as(o.dims);
      const int64_t k = d.args[1].tensor.ndim == 0 ? 1 : d.args[1].tensor.sizes[d.args[1].tensor.ndim - 1];
      std::vector<int64_t> td = as.batch;
      td.push_back(k);
      absl::StatusOr<std::string> a = l.Operand(d.args[0], o.dims, t), tau = l.Operand(d.args[1], td, t);
      if (!a.ok()) return a;
      if (!tau.ok()) return tau;
      return ApplyQ(l, *a, as, *tau, k, Identity(l, o.dims, t), as, false, t);
    };
    (*m)["aten::ormqr"] = [](Lowering& l, const tpu::DecodedOp& d, const Target& o) -> absl::StatusOr<std::string> {
      if (d.num_args < 5 || !Defined(d, 0) || !Defined(d, 1) || !Defined(d, 2) || o.dims.size() < 2) {
        return Unsupported(l.op(), "arguments of a form not lowered");
      }
      const DType& t = *o.type;
      const std::vector<int64_t> batch = BatchOf(o.dims);
      const std::vector<int64_t> ad = WithBatch(DimsOf(d.args[0].tensor), batch);
      const MatrixShape as(ad);
      const int64_t k = d.args[1].tensor.sizes[d.args[1].tensor.ndim - 1];
      std::vector<int64_t> td = batch;
      td.push_back(k);
      absl::StatusOr<std::string> a = MatrixOperand(l, d.args[0], batch, t), c = MatrixOperand(l, d.args[2], batch, t);
      if (!a.ok()) return a;
      if (!c.ok()) return c;
      const std::vector<int64_t> tin = DimsOf(d.args[1].tensor);
      absl::StatusOr<std::string> tv = l.Operand(d.args[1], tin, t);
      if (!tv.ok()) return tv;
      const std::string tau = l.BroadcastTo(*tv, tin, td, t);
      const bool left = d.args[3].b, transpose = d.args[4].b;
      if (left) return ApplyQ(l, *a, as, tau, k, *c, MatrixShape(o.dims), transpose, t);
      // C Q = (Q^T C^T)^T, C Q^T = (Q C^T)^T.
      std::vector<int64_t> perm;
      for (size_t q = 0; q + 2 < o.dims.size(); ++q) perm.push_back(static_cast<int64_t>(q));
      perm.push_back(static_cast<int64_t>(o.dims.size() - 1));
      perm.push_back(static_cast<int64_t>(o.dims.size() - 2));
      std::vector<int64_t> tdims = batch;
      tdims.insert(tdims.end(), {o.dims.back(), o.dims[o.dims.size() - 2]});
      const std::string ct = l.Emit(absl::StrCat("stablehlo.transpose ", *c, ", dims = [", absl::StrJoin(perm, ", "), "] : (",
                                                 TypeOf(o.dims, t), ") -> ", TypeOf(tdims, t)));
      const std::string r = ApplyQ(l, *a, as, tau, k, ct, MatrixShape(tdims), !transpose, t);
      return l.Emit(absl::StrCat("stablehlo.transpose ", r, ", dims = [", absl::StrJoin(perm, ", "), "] : (", TypeOf(tdims, t),
                                 ") -> ", TypeOf(o.dims, t)));
    };
    // addbmm(self, batch1, batch2, *, beta, alpha): beta self + alpha
    // sum_b batch1[b] @ batch2[b], one dot contracting the batch and k.
    (*m)["aten::addbmm"] = [](Lowering& l, const tpu::DecodedOp& d, const Target& o) -> absl::StatusOr<std::string> {
      if (d.num_args < 5 || !Defined(d, 1) || !Defined(d, 2) || d.args[1].tensor.ndim != 3 || d.args[2].tensor.ndim != 3 ||
          o.dims.size() != 2) {
        return Unsupported(l.op(), "expects two batches of matrices");
      }
      const DType& t = *o.type;
      const std::vector<int64_t> d1 = DimsOf(d.args[1].tensor), d2 = DimsOf(d.args[2].tensor);
      absl::StatusOr<std::string> a = l.Operand(d.args[1], d1, t), b = l.Operand(d.args[2], d2, t);
      if (!a.ok()) return a;
      if (!b.ok()) return b;
      std::string r = l.Emit(absl::StrCat("stablehlo.dot_general ", *a, ", ", *b,
                                          ", contracting_dims = [0, 2] x [0, 1] : (", TypeOf(d1, t), ", ",
                                          TypeOf(d2, t), ") -> ", TypeOf(o.dims, t)));
      absl::StatusOr<std::string> alpha = l.Operand(d.args[4], o.dims, t), beta = l.Operand(d.args[3], o.dims, t),
                                  self = l.Operand(d.args[0], o.dims, t);
      for (auto* v : {&alpha, &beta, &self}) if (!v->ok()) return *v;
      r = l.Binary("multiply", r, *alpha, o.dims, t);
      // beta = 0 ignores self (NaN included), as ATen does.
      const std::string scaled = l.Binary("multiply", *self, *beta, o.dims, t);
      const std::string zero = l.Compare("EQ", *beta, l.Constant(0, o.dims, t), o.dims, t);
      return l.Binary("add", r, l.Select(zero, l.Constant(0, o.dims, t), scaled, o.dims, t), o.dims, t);
    };
    return m;
  }();
  return *rules;
}

// The name of the in-place form of `name` ("aten::add.Tensor" ->
// "aten::add_.Tensor") and of its out= form ("aten::add.out",
// "aten::eq.Tensor_out").
std::string InPlaceName(const std::string& name) {
  const size_t dot = name.find('.');
  return dot == std::string::npos ? name + "_" : name.substr(0, dot) + "_" + name.substr(dot);
}
std::string OutName(const std::string& name) {
  const size_t dot = name.find('.');
  return dot == std::string::npos ? name + ".out" : name + "_out";
}

// Every single-output rule, under its own name and its in-place and out=
// forms (where no rule of that name is given).
const std::map<std::string, Rule>& AllRules() {
  static const auto* all = [] {
    auto* m = new std::map<std::string, Rule>;
    for (const std::map<std::string, Rule>* rules : {&Rules(), &MoreRules(), &TailRules(), &ExtraRules(), &SpecialRules(), &FftRules(),
                                                         &LinalgRules(), &PolynomialRules(), &ReshuffleRules()}) {
      for (const auto& [name, rule] : *rules) (*m)[name] = rule;
    }
    std::vector<std::pair<std::string, Rule>> derived;
    for (const auto& [name, rule] : *m) {
      if (name.find("_.") != std::string::npos || name.back() == '_' || absl::StrContains(name, "out")) continue;
      derived.emplace_back(InPlaceName(name), rule);
      derived.emplace_back(OutName(name), rule);
    }
    for (auto& [name, rule] : derived) m->emplace(name, rule);  // given names win
    return m;
  }();
  return *all;
}

bool Contiguous(const tpu::TensorRef& r) {
  int64_t expect = 1;
  for (int d = r.ndim - 1; d >= 0; --d) {
    if (r.sizes[d] != 1 && r.strides[d] != expect) return false;
    expect *= r.sizes[d];
  }
  return true;
}

// .item(): the one element, read where it lies (a device-to-host copy of
// one element; tensors live in tpud's arena in this version).
// An IEEE half-precision value, exactly, as a float (every half is one).
float HalfToFloat(uint16_t h) {
  const bool negative = (h & 0x8000u) != 0;
  const uint32_t exponent = (h >> 10) & 0x1fu;
  const uint32_t mantissa = h & 0x3ffu;
  if (exponent == 0) {  // zero or subnormal: mantissa * 2^-24
    const float f = std::ldexp(static_cast<float>(mantissa), -24);
    return negative ? -f : f;
  }
  // Infinity and NaN keep an all-ones exponent; normal numbers are rebiased
  // (15 to 127).
  const uint32_t bits = (negative ? 0x80000000u : 0u) |
                        (exponent == 31 ? 0x7f800000u : (exponent + 112) << 23) | (mantissa << 13);
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

absl::Status ReadScalar(const std::string& op, const tpu::DecodedOp& decoded,
                        const std::vector<ResolvedTensor>& tensors,
                        std::vector<ResultValue>* results) {
  if (decoded.num_args < 1 || decoded.args[0].tag != tpu::ArgTag::kTensor) {
    return Unsupported(op, "expects a tensor");
  }
  const tpu::TensorRef& ref = decoded.args[0].tensor;
  const int64_t numel = Numel(ref);
  if (numel != 1) {
    return absl::InvalidArgumentError(absl::StrCat(op, ": a tensor with ", numel,
                                                   " elements cannot be converted to a scalar"));
  }
  Lowering l(op, decoded, tensors);
  absl::StatusOr<char*> host = l.HostOf(ref, 0);
  if (!host.ok()) return host.status();
  if (results == nullptr) return absl::OkStatus();
  ResultValue v;
  auto get = [&](auto x) {
    std::memcpy(&x, *host, sizeof(x));
    return x;
  };
  // complex64 and complex128: the real part, then the imaginary one.
  auto complex = [&](auto pair) {
    const auto c = get(pair);
    v.kind = ResultValue::Kind::kComplex;
    v.d = c[0];
    v.d_imag = c[1];
  };
  switch (ref.dtype) {
    case 0: v.kind = ResultValue::Kind::kInt; v.i = get(uint8_t{}); break;
    case 1: v.kind = ResultValue::Kind::kInt; v.i = get(int8_t{}); break;
    case 2: v.kind = ResultValue::Kind::kInt; v.i = get(int16_t{}); break;
    case 3: v.kind = ResultValue::Kind::kInt; v.i = get(int32_t{}); break;
    case 4: v.kind = ResultValue::Kind::kInt; v.i = get(int64_t{}); break;
    case 6: v.kind = ResultValue::Kind::kDouble; v.d = get(float{}); break;
    case 7: v.kind = ResultValue::Kind::kDouble; v.d = get(double{}); break;
    case 11: v.kind = ResultValue::Kind::kBool; v.b = get(uint8_t{}) != 0; break;
    case 5: v.kind = ResultValue::Kind::kDouble; v.d = HalfToFloat(get(uint16_t{})); break;
    case 15: {  // bfloat16: the high half of a float32
      const uint32_t bits = static_cast<uint32_t>(get(uint16_t{})) << 16;
      float f;
      std::memcpy(&f, &bits, sizeof(f));
      v.kind = ResultValue::Kind::kDouble;
      v.d = f;
      break;
    }
    case 9: complex(std::array<float, 2>{}); break;
    case 10: complex(std::array<double, 2>{}); break;
    default: return Unsupported(op, absl::StrCat("reading a scalar of dtype ", int(ref.dtype)));
  }
  results->push_back(v);
  return absl::OkStatus();
}

}  // namespace

std::vector<std::string> LoweredOpNames() {
  std::vector<std::string> names = {"aten::_local_scalar_dense", "aten::equal", "aten::nonzero", "aten::masked_select",
                                    "aten::_unique2", "aten::unique_consecutive"};
  for (const auto& [name, rule] : AllRules()) names.push_back(name);
  for (const auto& [name, rule] : MultiRules()) names.push_back(name);
  std::sort(names.begin(), names.end());
  names.erase(std::unique(names.begin(), names.end()), names.end());
  return names;
}

absl::StatusOr<std::unique_ptr<PjrtChip>> PjrtChip::Create(
    const std::string& plugin_path, const std::vector<CreateOption>& options,
    size_t cache_capacity, bool device_memory) {
  absl::StatusOr<std::unique_ptr<PjrtPlugin>> p = PjrtPlugin::Load(plugin_path, options);
  if (!p.ok()) return p.status();
  return std::unique_ptr<PjrtChip>(new PjrtChip(*std::move(p), std::max<size_t>(1, cache_capacity), device_memory));
}

PjrtChip::~PjrtChip() = default;

std::string PjrtChip::Describe() const { return absl::StrCat("PJRT (", plugin_->Describe(), ")"); }

absl::StatusOr<std::shared_ptr<const BackendOp>> PjrtChip::LookupOp(absl::string_view schema) {
  const size_t paren = schema.find('(');
  if (paren == absl::string_view::npos || paren == 0) {
    return absl::InvalidArgumentError(absl::StrCat("not an operator schema: ", schema));
  }
  std::string name(schema.substr(0, paren));
  // Every op is accepted here; one without a lowering fails when it runs,
  // naming itself (so a session can go on with the ops that have one).
  return std::make_shared<PjrtOp>(std::string(schema), std::move(name), WrittenArguments(schema));
}

absl::StatusOr<std::shared_ptr<const Executable>> PjrtChip::Compiled(const std::string& program, int device,
                                                                     const std::vector<int>& replicas) {
  CompileStats& st = stats_[replicas.empty() ? device : replicas[0]];
  // A replicated program is kept by its devices too.
  std::string replicated_key;
  if (!replicas.empty()) replicated_key = absl::StrCat("replicas ", absl::StrJoin(replicas, ","), "\n", program);
  const std::string& key = replicas.empty() ? program : replicated_key;
  auto it = cache_.find(key);
  if (it != cache_.end()) {
    lru_.splice(lru_.end(), lru_, it->second);
    ++st.hits;
    return it->second->second;
  }
  const auto t0 = std::chrono::steady_clock::now();
  absl::StatusOr<std::unique_ptr<Executable>> exe =
      replicas.empty() ? plugin_->Compile(program) : plugin_->CompileReplicated(program, replicas);
  st.compile_ns += std::chrono::duration_cast<std::chrono::nanoseconds>(
                       std::chrono::steady_clock::now() - t0).count();
  ++st.compiles;
  if (!exe.ok()) return exe.status();
  if (!replicas.empty() && (*exe)->replica_devices() != replicas) {
    // Argument lists follow the executable's order; tpud gives them by rank.
    return absl::InternalError(absl::StrCat("the plugin placed the replicas on devices ",
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

// A lowered op, kept by its signature: the compiled program, where each
// parameter reads (a tensor of the record, by its index, or a scalar), and
// what comes back for each output.
struct Plan {
  // A parameter as the lowering made it; `data` is kept only for k = -2
  // (the record's tensors move between ops: a kept plan finds them by k).
  struct In : Transfer {
    int k = -1;  // the record's tensor k; -1: a scalar; -2: `data` (a plan not kept)
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
  // Device memory: the program's text (a graph's programs are composed of
  // their ops' texts: PjrtChip::RunProgram) and the device it is for.
  std::string text;
  int on_device = 0;
  // Device memory: the record tensor whose place in its segment each offset
  // parameter (the program's last) is, reads then writes; or, where a read
  // does not start at a tensor of the record, `fixed` (the offsets are in
  // the program, which is then not kept).
  std::vector<int> offset_k;
  std::string fixed;
};

namespace {

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
void ResidentKey(int device, const char* at, PJRT_Buffer_Type type, const std::vector<int64_t>& dims, bool donate,
                 std::string* id) {
  KeySink sink(id);
  const char head[3] = {static_cast<char>(device), static_cast<char>(type), static_cast<char>(donate ? 1 : 0)};
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
                  absl::Span<const tpu::TensorRef* const> all, const std::vector<ResolvedTensor>& tensors,
                  absl::Span<const uintptr_t> raw, bool device_memory, std::string* out) {
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
      case tpu::ArgTag::kGenerator: random = true; break;
      case tpu::ArgTag::kTensor: KeyTensor(key, arg.tensor); break;
      case tpu::ArgTag::kTensorList: case tpu::ArgTag::kOptionalTensorList:
        KeyValue(key, arg.tensors.size());
        for (size_t e = 0; e < arg.tensors.size(); ++e) {
          const bool present = e >= arg.tensor_present.size() || arg.tensor_present[e];
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
    const uint8_t absent = (all[k]->address == 0 ? 1 : 0) | (tensors[k].segment_bytes == 0 ? 2 : 0);
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
        if (tensors[j].segment_bytes != 0 && tensors[j].segment_address == tensors[k].segment_address) {
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

namespace {

// A result of a size only the data gave: its first `bytes` of `data` go
// into memory the session's result allocator hands out (charged to its
// quota), and `v` (its dtype and shape) points there.
absl::Status PushAllocated(ResultAllocator* allocator, ResultValue v, const void* data, uint64_t bytes,
                           std::vector<ResultValue>* results) {
  if (bytes > 0) {
    absl::StatusOr<ResultAllocator::Block> block = allocator->Allocate(bytes);
    if (!block.ok()) return block.status();
    std::memcpy(block->host, data, bytes);
    v.tensor.address = block->address;
  }
  results->push_back(v);
  return absl::OkStatus();
}

}  // namespace

// The device a tensor at device address `address` lies on.
absl::StatusOr<int> PjrtChip::DeviceOf(const std::string& name, uint64_t address) const {
  const int device = tpu::DeviceAddressChip(address);
  if (device < 0 || device >= plugin_->num_devices()) {
    return absl::InvalidArgumentError(absl::StrCat(name, ": a tensor on chip ", device, ", which has no device (this host has ",
                                                   plugin_->num_devices(), ")"));
  }
  return device;
}

// Runs `program` on `device`, its parameters copied in from `transfers`,
// and copies its results out to `dsts` (one per result: where, and how many
// bytes).
absl::Status PjrtChip::RunToHost(const std::string& name, const std::vector<Transfer>& transfers, const std::string& program,
                                 int device, const std::vector<std::pair<void*, size_t>>& dsts) {
  absl::StatusOr<std::shared_ptr<const Executable>> exe = Compiled(program, device);
  if (!exe.ok()) return absl::Status(exe.status().code(), absl::StrCat(name, ": ", exe.status().message()));
  std::vector<Buffer> inputs;
  std::vector<PJRT_Buffer*> args;
  for (const Transfer& x : transfers) {
    const void* data = x.data;
    if (data == nullptr) data = x.type->is_float ? static_cast<const void*>(&x.scalar_d) : static_cast<const void*>(&x.scalar_i);
    absl::StatusOr<Buffer> buf = plugin_->FromHost(device, data, x.type->pjrt, x.dims, x.byte_strides);
    if (!buf.ok()) return absl::Status(buf.status().code(), absl::StrCat(name, ": ", buf.status().message()));
    args.push_back(buf->get());
    inputs.push_back(*std::move(buf));
  }
  absl::StatusOr<std::vector<Buffer>> out = plugin_->Execute(**exe, device, args);
  if (!out.ok()) return absl::Status(out.status().code(), absl::StrCat(name, ": ", out.status().message()));
  if (out->size() != dsts.size()) {
    return absl::InternalError(absl::StrCat(name, ": the program gave ", out->size(), " results for ", dsts.size()));
  }
  for (size_t o = 0; o < dsts.size(); ++o) {
    if (dsts[o].second == 0) continue;
    if (absl::Status st = plugin_->ToHost((*out)[o], dsts[o].first, dsts[o].second); !st.ok()) {
      return absl::Status(st.code(), absl::StrCat(name, ": ", st.message()));
    }
  }
  return absl::OkStatus();
}

// nonzero(self) and masked_select(self, mask), whose result's length is
// the data's: one program gives the count and, for every element, the flat
// positions of the selected ones first (a stable sort of the positions,
// the others keyed past the end); the first `count` rows are copied into
// memory the result allocator charges to the session.
absl::Status PjrtChip::Selected(const std::string& name, const tpu::DecodedOp& decoded,
                                const std::vector<ResolvedTensor>& tensors, std::vector<ResultValue>* results,
                                ResultAllocator* allocator) {
  const bool select = name == "aten::masked_select";
  const bool index = name == "aten::index.Tensor";
  if (decoded.num_args < (select || index ? 2u : 1u) || decoded.args[0].tag != tpu::ArgTag::kTensor ||
      (select && decoded.args[1].tag != tpu::ArgTag::kTensor)) {
    return Unsupported(name, "expects tensors");
  }
  if (index) return MaskIndex(name, decoded, tensors, results, allocator);
  if (!decoded.outputs.empty() || allocator == nullptr || results == nullptr) {
    return Unsupported(name, "an output given in advance");
  }
  const tpu::TensorRef& x = decoded.args[0].tensor;
  const DType* xt = DTypeOf(x.dtype);
  if (xt == nullptr) return Unsupported(name, "a dtype that is not lowered");
  // The elements: self's dims, broadcast with the mask's.
  std::vector<int64_t> dims = DimsOf(x);
  if (select) {
    const std::vector<int64_t> md = DimsOf(decoded.args[1].tensor);
    std::vector<int64_t> b(std::max(dims.size(), md.size()), 1);
    for (size_t q = 0; q < b.size(); ++q) {
      const int64_t u = q + dims.size() >= b.size() ? dims[q + dims.size() - b.size()] : 1;
      const int64_t v = q + md.size() >= b.size() ? md[q + md.size() - b.size()] : 1;
      if (u != v && u != 1 && v != 1) {
        return absl::InvalidArgumentError(absl::StrCat(name, ": the shapes of self and mask do not broadcast"));
      }
      b[q] = u == 1 ? v : u;
    }
    dims = b;
  }
  int64_t total = 1;
  for (int64_t s : dims) total *= s;
  const DType& i64 = I64();
  const DType& i1 = *DTypeOf(11);
  const size_t rank = dims.size();
  ResultValue v;
  v.kind = ResultValue::Kind::kTensor;
  v.tensor.dtype = select ? x.dtype : 4;
  v.tensor.ndim = select ? 1 : 2;
  int64_t count = 0;
  std::vector<char> rows;
  const size_t row_bytes = select ? xt->bytes : rank * 8;
  if (total > 0) {
    Lowering l(name, decoded, tensors);
    const std::vector<int64_t> flat = {total};
    absl::StatusOr<std::string> xv = l.Operand(decoded.args[0], dims, *xt);
    if (!xv.ok()) return xv.status();
    std::string mask;
    if (select) {
      absl::StatusOr<std::string> mv = l.Operand(decoded.args[1], dims, i1);
      if (!mv.ok()) return mv.status();
      mask = *mv;
    } else {
      mask = l.Compare("NE", *xv, l.Constant(0, dims, *xt), dims, *xt);
    }
    const std::string mflat = l.Reshape(mask, dims, flat, i1);
    const std::string key = l.Select(mflat, l.Iota(0, flat, i64), l.Constant(static_cast<double>(total), flat, i64), flat, i64);
    const std::string n = l.ReduceOver(l.Convert(mflat, flat, i1, i64), flat, {0}, "add", l.Constant(0, {}, i64), i64);
    std::string out;
    std::string out_type;
    if (select) {
      // Sort (key, value) pairs by key.
      const std::string vs = TypeOf({}, *xt), ks = TypeOf({}, i64), b = TypeOf({}, i1);
      const std::string sorted = l.EmitResults(absl::StrCat(
          "\"stablehlo.sort\"(", key, ", ", l.Reshape(*xv, dims, flat, *xt), ") ({\n",
          "    ^bb0(%ka: ", ks, ", %kb: ", ks, ", %va: ", vs, ", %vb: ", vs, "):\n",
          "      %lt = stablehlo.compare LT, %ka, %kb, SIGNED : (", ks, ", ", ks, ") -> ", b, "\n",
          "      stablehlo.return %lt : ", b, "\n",
          "    }) {dimension = 0 : i64, is_stable = true} : (", TypeOf(flat, i64), ", ", TypeOf(flat, *xt), ") -> (",
          TypeOf(flat, i64), ", ", TypeOf(flat, *xt), ")"), 2);
      out = sorted + "#1";
      out_type = TypeOf(flat, *xt);
    } else {
      const std::string keys = l.Sort(key, flat, 0, false, i64).first;
      std::vector<std::string> parts;
      int64_t stride = total;
      for (size_t q = 0; q < rank; ++q) {
        stride /= dims[q];
        parts.push_back(l.Binary("remainder", l.Binary("divide", keys, l.Constant(static_cast<double>(stride), flat, i64), flat, i64),
                                 l.Constant(static_cast<double>(dims[q]), flat, i64), flat, i64));
      }
      if (rank == 0) {
        out = l.Constant(0, {total, 0}, i64);
        out_type = TypeOf({total, 0}, i64);
      } else {
        out = StackIndices(l, parts, flat);
        out_type = TypeOf({total, static_cast<int64_t>(rank)}, i64);
      }
    }
    const std::string program = l.Text({n, out}, {TypeOf({}, i64), out_type});
    absl::StatusOr<int> device = DeviceOf(name, x.address);
    if (!device.ok()) return device.status();
    rows.resize(static_cast<size_t>(total) * row_bytes);
    if (absl::Status st = RunToHost(name, l.transfers(), program, *device, {{&count, 8}, {rows.data(), rows.size()}}); !st.ok()) {
      return st;
    }
    if (count < 0 || count > total) return absl::InternalError(absl::StrCat(name, ": the program counted ", count));
  }
  v.tensor.sizes[0] = count;
  if (select) {
    v.tensor.strides[0] = 1;
  } else {
    v.tensor.sizes[1] = static_cast<int64_t>(rank);
    v.tensor.strides[0] = std::max<int64_t>(static_cast<int64_t>(rank), 1);
    v.tensor.strides[1] = 1;
  }
  return PushAllocated(allocator, v, rows.data(), static_cast<uint64_t>(count) * row_bytes, results);
}

// index.Tensor(self, [mask]) with one boolean (or byte) mask over self's
// leading dimensions: the rows the mask selects, in order, as the CPU
// kernel gives them (its other forms take index tensors and are lowered
// with the other rules).
absl::Status PjrtChip::MaskIndex(const std::string& name, const tpu::DecodedOp& decoded,
                                 const std::vector<ResolvedTensor>& tensors, std::vector<ResultValue>* results,
                                 ResultAllocator* allocator) {
  const tpu::OpArg& list = decoded.args[1];
  if (list.tag != tpu::ArgTag::kOptionalTensorList || list.tensor_present.empty() || !list.tensor_present[0] ||
      std::count(list.tensor_present.begin(), list.tensor_present.end(), true) != 1 || list.tensors.empty() ||
      (list.tensors[0].dtype != 11 && list.tensors[0].dtype != 0)) {
    return Unsupported(name, "a data-dependent result other than one leading boolean mask");
  }
  const tpu::TensorRef& x = decoded.args[0].tensor;
  const tpu::TensorRef& mr = list.tensors[0];
  const DType* xt = DTypeOf(x.dtype);
  if (xt == nullptr) return Unsupported(name, "a dtype that is not lowered");
  const std::vector<int64_t> xd = DimsOf(x), md = DimsOf(mr);
  if (md.size() > xd.size() || !std::equal(md.begin(), md.end(), xd.begin())) {
    return absl::InvalidArgumentError(absl::StrCat(name, ": the mask's shape does not match self's leading dimensions"));
  }
  int64_t rows_n = 1, payload = 1;
  for (int64_t s : md) rows_n *= s;
  for (size_t q = md.size(); q < xd.size(); ++q) payload *= xd[q];
  const DType& i64 = I64();
  const DType& i1 = *DTypeOf(11);
  ResultValue v;
  v.kind = ResultValue::Kind::kTensor;
  v.tensor.dtype = x.dtype;
  v.tensor.ndim = static_cast<uint8_t>(1 + xd.size() - md.size());
  int64_t count = 0;
  std::vector<char> rows;
  const size_t row_bytes = static_cast<size_t>(payload) * xt->bytes;
  if (rows_n > 0 && payload > 0) {
    Lowering l(name, decoded, tensors);
    const std::vector<int64_t> flat = {rows_n}, table = {rows_n, payload};
    absl::StatusOr<std::string> xv = l.Operand(decoded.args[0], xd, *xt);
    if (!xv.ok()) return xv.status();
    const DType& mt = *DTypeOf(mr.dtype);
    absl::StatusOr<std::string> mv = l.OperandRef(mr, 1, md, mt);
    if (!mv.ok()) return mv.status();
    const std::string mflat = l.Reshape(l.Compare("NE", *mv, l.Constant(0, md, mt), md, mt), md, flat, i1);
    const std::string key = l.Select(mflat, l.Iota(0, flat, i64), l.Constant(static_cast<double>(rows_n), flat, i64), flat, i64);
    const std::string n = l.ReduceOver(l.Convert(mflat, flat, i1, i64), flat, {0}, "add", l.Constant(0, {}, i64), i64);
    const std::string keys = l.Sort(key, flat, 0, false, i64).first;
    const std::string at = l.Reshape(l.Binary("minimum", keys, l.Constant(static_cast<double>(rows_n - 1), flat, i64), flat, i64),
                                     flat, {rows_n, 1}, i64);
    const std::string gathered = l.Emit(absl::StrCat(
        "\"stablehlo.gather\"(", l.Reshape(*xv, xd, table, *xt), ", ", at,
        ") {dimension_numbers = #stablehlo.gather<offset_dims = [1], collapsed_slice_dims = [0], start_index_map = [0], "
        "index_vector_dim = 1>, indices_are_sorted = false, slice_sizes = array<i64: 1, ", payload, ">} : (",
        TypeOf(table, *xt), ", ", TypeOf({rows_n, 1}, i64), ") -> ", TypeOf(table, *xt)));
    const std::string program = l.Text({n, gathered}, {TypeOf({}, i64), TypeOf(table, *xt)});
    absl::StatusOr<int> device = DeviceOf(name, x.address);
    if (!device.ok()) return device.status();
    rows.resize(static_cast<size_t>(rows_n) * row_bytes);
    if (absl::Status st = RunToHost(name, l.transfers(), program, *device, {{&count, 8}, {rows.data(), rows.size()}}); !st.ok()) {
      return st;
    }
    if (count < 0 || count > rows_n) return absl::InternalError(absl::StrCat(name, ": the program counted ", count));
  }
  v.tensor.sizes[0] = count;
  int64_t stride = 1;
  for (size_t q = xd.size(); q-- > md.size();) {
    const size_t o = 1 + q - md.size();
    v.tensor.sizes[o] = xd[q];
    v.tensor.strides[o] = stride;
    stride *= std::max<int64_t>(xd[q], 1);
  }
  v.tensor.strides[0] = stride;
  return PushAllocated(allocator, v, rows.data(), static_cast<uint64_t>(count) * row_bytes, results);
}

// _unique2(self, sorted, return_inverse, return_counts) and
// unique_consecutive(self, return_inverse, return_counts, dim = None) ->
// (values, inverse, counts): the elements sorted (stably, NaN last; in
// place for unique_consecutive), a new group wherever an element differs
// from the one before (each NaN its own), the groups' values, every
// element's group and the groups' sizes, computed for all elements in one
// program; the first `count` values and counts are copied into memory the
// result allocator charges to the session. (Sorted whether asked or not.)
absl::Status PjrtChip::Unique(const std::string& name, const tpu::DecodedOp& decoded,
                              const std::vector<ResolvedTensor>& tensors, std::vector<ResultValue>* results,
                              ResultAllocator* allocator) {
  const bool consecutive = name == "aten::unique_consecutive";
  if (decoded.num_args < (consecutive ? 3u : 4u) || decoded.args[0].tag != tpu::ArgTag::kTensor) {
    return Unsupported(name, "arguments of a form not lowered");
  }
  if (!decoded.outputs.empty() || allocator == nullptr || results == nullptr) {
    return Unsupported(name, "an output given in advance");
  }
  if (consecutive && decoded.num_args > 3 && decoded.args[3].tag != tpu::ArgTag::kNone) return Unsupported(name, "dim");
  const bool want_inverse = decoded.args[consecutive ? 1 : 2].b, want_counts = decoded.args[consecutive ? 2 : 3].b;
  const tpu::TensorRef& x = decoded.args[0].tensor;
  const DType* xt = DTypeOf(x.dtype);
  if (xt == nullptr || IsComplex(*xt)) return Unsupported(name, "a dtype that is not lowered");
  const std::vector<int64_t> xd = DimsOf(x);
  const int64_t total = Numel(x);
  const DType& i64 = I64();
  const DType& i1 = *DTypeOf(11);
  int64_t count = 0;
  std::vector<char> values(static_cast<size_t>(total) * xt->bytes);
  std::vector<int64_t> inverse(static_cast<size_t>(total)), counts(static_cast<size_t>(total));
  if (total > 0) {
    Lowering l(name, decoded, tensors);
    const std::vector<int64_t> flat = {total};
    absl::StatusOr<std::string> xv = l.Operand(decoded.args[0], xd, *xt);
    if (!xv.ok()) return xv.status();
    std::string sv = l.Reshape(*xv, xd, flat, *xt), perm = l.Iota(0, flat, i64);
    if (!consecutive) std::tie(sv, perm) = l.Sort(sv, flat, 0, false, *xt);
    std::string before = sv;
    if (total > 1) {
      const std::string head = l.SliceAlong(sv, flat, 0, 0, 1, *xt), body = l.SliceAlong(sv, flat, 0, 0, total - 1, *xt);
      before = l.Emit(absl::StrCat("stablehlo.concatenate ", head, ", ", body, ", dim = 0 : (", TypeOf({1}, *xt), ", ",
                                   TypeOf({total - 1}, *xt), ") -> ", TypeOf(flat, *xt)));
    }
    const std::string first = l.Compare("EQ", l.Iota(0, flat, i64), l.Constant(0, flat, i64), flat, i64);
    const std::string is_new = l.Binary("or", first, l.Compare("NE", sv, before, flat, *xt), flat, i1);
    const std::string ones = l.Convert(is_new, flat, i1, i64);
    const std::string group = l.Binary("subtract", Running(l, ones, flat, 0, "add", 0, i64), l.Constant(1, flat, i64), flat, i64);
    const std::string n = l.ReduceOver(ones, flat, {0}, "add", l.Constant(0, {}, i64), i64);
    auto scatter = [&](const std::string& into, const std::string& at, const std::string& what, const DType& t, bool add) {
      return ScatterFlat(l, into, total, at, what, total, add, t);
    };
    // Each group's value from its first element (a later element of the
    // group is sent nowhere: past the end).
    const std::string dest = l.Select(is_new, group, l.Constant(static_cast<double>(total), flat, i64), flat, i64);
    const std::string vals = scatter(l.Constant(0, flat, *xt), dest, sv, *xt, false);
    const std::string inv = scatter(l.Constant(0, flat, i64), perm, group, i64, false);
    const std::string cnt = scatter(l.Constant(0, flat, i64), group, l.Constant(1, flat, i64), i64, true);
    const std::string program = l.Text({n, vals, inv, cnt}, {TypeOf({}, i64), TypeOf(flat, *xt), TypeOf(flat, i64), TypeOf(flat, i64)});
    absl::StatusOr<int> device = DeviceOf(name, x.address);
    if (!device.ok()) return device.status();
    if (absl::Status st = RunToHost(name, l.transfers(), program, *device,
                                    {{&count, 8}, {values.data(), values.size()}, {inverse.data(), inverse.size() * 8},
                                     {counts.data(), counts.size() * 8}});
        !st.ok()) {
      return st;
    }
    if (count < 0 || count > total) return absl::InternalError(absl::StrCat(name, ": the program counted ", count));
  }
  // One result: `dims` of dtype from `data`.
  auto emit = [&](int8_t dtype, const std::vector<int64_t>& dims, const void* data, size_t esize) -> absl::Status {
    ResultValue v;
    v.kind = ResultValue::Kind::kTensor;
    v.tensor.dtype = dtype;
    v.tensor.ndim = static_cast<uint8_t>(dims.size());
    int64_t stride = 1, n = 1;
    for (size_t q = dims.size(); q-- > 0;) {
      v.tensor.sizes[q] = dims[q];
      v.tensor.strides[q] = stride;
      stride *= std::max<int64_t>(dims[q], 1);
      n *= dims[q];
    }
    return PushAllocated(allocator, v, data, static_cast<uint64_t>(n) * esize, results);
  };
  if (absl::Status st = emit(x.dtype, {count}, values.data(), xt->bytes); !st.ok()) return st;
  if (absl::Status st = emit(4, want_inverse ? xd : std::vector<int64_t>{0}, inverse.data(), 8); !st.ok()) return st;
  return emit(4, {want_counts ? count : 0}, counts.data(), 8);
}

// equal(self, other) -> bool: the same sizes and every element equal (NaN
// is not), computed on the device and read back as a host value.
absl::Status PjrtChip::Equal(const std::string& name, const tpu::DecodedOp& decoded,
                             const std::vector<ResolvedTensor>& tensors, std::vector<ResultValue>* results) {
  if (decoded.num_args < 2 || decoded.args[0].tag != tpu::ArgTag::kTensor ||
      decoded.args[1].tag != tpu::ArgTag::kTensor) {
    return Unsupported(name, "expects two tensors");
  }
  const tpu::TensorRef &a = decoded.args[0].tensor, &b = decoded.args[1].tensor;
  ResultValue v;
  v.kind = ResultValue::Kind::kBool;
  v.b = DimsOf(a) == DimsOf(b);
  if (v.b && Numel(a) > 0) {
    const DType* ta = DTypeOf(a.dtype);
    const DType* tb = DTypeOf(b.dtype);
    if (ta == nullptr || tb == nullptr) return Unsupported(name, "a dtype that is not lowered");
    // Compared in the wider kind: float64 if either is a float, else int64.
    const DType& t = ta->is_float || tb->is_float ? F64() : I64();
    const std::vector<int64_t> dims = DimsOf(a);
    Lowering l(name, decoded, tensors);
    absl::StatusOr<std::string> x = l.Operand(decoded.args[0], dims, t), y = l.Operand(decoded.args[1], dims, t);
    if (!x.ok()) return x.status();
    if (!y.ok()) return y.status();
    const DType& i1 = *DTypeOf(11);
    const std::string eq = l.Compare("EQ", *x, *y, dims, t);
    const std::string all = l.ReduceOver(eq, dims, Range(dims.size()), "and", l.Constant(1, {}, i1), i1);
    const std::string program = l.Text({all}, {TypeOf({}, i1)});
    absl::StatusOr<int> device = DeviceOf(name, a.address);
    if (!device.ok()) return device.status();
    uint8_t byte = 0;
    if (absl::Status st = RunToHost(name, l.transfers(), program, *device, {{&byte, 1}}); !st.ok()) return st;
    v.b = byte != 0;
  }
  if (results != nullptr) results->push_back(v);
  return absl::OkStatus();
}

absl::Status PjrtChip::Run(const BackendOp& base, const tpu::DecodedOp& decoded,
                           const std::vector<ResolvedTensor>& tensors,
                           std::vector<ResultValue>* results, ResultAllocator* allocator) {
  const auto& op = static_cast<const PjrtOp&>(base);
  Probe* const probe = probe_;
  probe_ = nullptr;
  // Asked for the plan only (a graph's op, RunProgram): what a plan cannot
  // describe (results sized by the data, reads on the host) leaves the probe
  // empty.
  if (probe != nullptr && (results != nullptr || !device_memory_ || (op.written().empty() && decoded.outputs.empty()))) {
    return absl::OkStatus();
  }
  using Special = PjrtOp::Special;
  const Special special = op.special();
  // The ops computed from the arena's bytes read them there, up to date.
  if (device_memory_ && special != Special::kNone && (special != Special::kIndex || decoded.outputs.empty())) {
    if (absl::Status st = HostAccessAll(tensors); !st.ok()) return st;
  }
  if (probe != nullptr && special != Special::kNone) return absl::OkStatus();
  if (special == Special::kLocalScalar) return ReadScalar(op.name(), decoded, tensors, results);
  if (special == Special::kEqual) return Equal(op.name(), decoded, tensors, results);
  if (special == Special::kSelect || (special == Special::kIndex && decoded.outputs.empty())) {
    return Selected(op.name(), decoded, tensors, results, allocator);
  }
  if (special == Special::kUnique) return Unique(op.name(), decoded, tensors, results, allocator);
  // An op PyTorch has no meta kernel for comes without outputs (the client
  // cannot size them): those whose outputs follow from their inputs' shapes
  // get them here, in memory the result allocator charges to the session.
  if (op.written().empty() && decoded.outputs.empty() && allocator != nullptr && results != nullptr) {
    std::vector<tpu::TensorRef> made;
    if (decoded.num_args >= 1 && decoded.args[0].tag == tpu::ArgTag::kTensor) {
      const tpu::TensorRef& x = decoded.args[0].tensor;
      auto dense = [](const tpu::TensorRef& like, const std::vector<int64_t>& dims) {
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
      const std::vector<int64_t> xd = DimsOf(x);
      if (op.name() == "aten::_logcumsumexp") {
        made.push_back(dense(x, xd));
      } else if (op.name() == "aten::geqrf" && xd.size() >= 2) {
        made.push_back(dense(x, xd));
        std::vector<int64_t> td(xd.begin(), xd.end() - 2);
        td.push_back(std::min(xd[xd.size() - 2], xd.back()));
        made.push_back(dense(x, td));
      }
    }
    if (!made.empty()) {
      tpu::DecodedOp sized = decoded;
      std::vector<ResolvedTensor> all = tensors;
      for (tpu::TensorRef& r : made) {
        const uint64_t bytes = static_cast<uint64_t>(Numel(r)) * static_cast<uint64_t>(tpu::ElementSize(r.dtype));
        ResolvedTensor rt;
        for (const ResolvedTensor& t : tensors) rt.owner = std::max(rt.owner, t.owner);
        if (bytes > 0) {
          absl::StatusOr<ResultAllocator::Block> block = allocator->Allocate(bytes);
          if (!block.ok()) return block.status();
          r.address = block->address;
          rt.segment_host_base = block->host;
          rt.segment_address = block->address;
          rt.segment_bytes = bytes;
        }
        sized.outputs.push_back(r);
        all.push_back(rt);
      }
      return Run(base, sized, all, results, nullptr);
    }
  }
  const Rule* single = op.rule();
  const MultiRule* multi = op.multi_rule();
  if (single == nullptr && multi == nullptr) {
    return Unsupported(op.name(), "no lowering to StableHLO yet");
  }
  Lowering l(op.name(), decoded, tensors);
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
  if (std::all_of(refs.begin(), refs.end(), [](const tpu::TensorRef* r) { return Numel(*r) == 0; })) {
    if (probe != nullptr) probe->nothing = true;
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
        if (e >= arg.tensor_present.size() || arg.tensor_present[e]) all_refs.push_back(&arg.tensors[e]);
      }
    }
  }
  for (const tpu::TensorRef& t : decoded.outputs) all_refs.push_back(&t);
  if (all_refs.size() != tensors.size()) {
    return absl::InternalError(absl::StrCat(op.name(), ": ", all_refs.size(), " tensors in the record, ", tensors.size(), " resolved"));
  }
  // Where each tensor's first element would lie (unchecked; 0 without memory).
  absl::InlinedVector<uintptr_t, 8> raw(all_refs.size(), 0);
  for (size_t k = 0; k < all_refs.size(); ++k) {
    const tpu::TensorRef& r = *all_refs[k];
    const ResolvedTensor& seg = tensors[k];
    if (r.address == 0 || seg.segment_bytes == 0 || r.address < seg.segment_address) continue;
    raw[k] = reinterpret_cast<uintptr_t>(seg.segment_host_base) + (r.address - seg.segment_address) +
             static_cast<uintptr_t>(r.storage_offset) * static_cast<uintptr_t>(std::max(1, tpu::ElementSize(r.dtype)));
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
    return absl::InvalidArgumentError(absl::StrCat(op.name(), ": output on chip ", device,
                                                   ", which has no device"));
  }
  const bool host_devices = plugin_->platform_name() == "cpu" && !device_memory_;
  std::string& key = key_;
  const bool keyed = SignatureKey(op.name(), device, decoded, all_refs, tensors, raw, device_memory_, &key);
  Plan fresh;
  const Plan* found = nullptr;
  std::shared_ptr<const Plan> kept;
  if (keyed) {
    if (auto it = plans_.find(key); it != plans_.end()) {
      plan_lru_.splice(plan_lru_.end(), plan_lru_, it->second);
      kept = it->second->second;
      found = kept.get();
      if (found->exe == nullptr && probe == nullptr) {
        // Lowered for a graph's program only: compiled now, on its own.
        kept.reset();
        found = nullptr;
      } else if (probe == nullptr) {
        ++stats_[device].hits;
      }
    }
  }
  auto lower = [&](Plan& plan) -> absl::Status {
  Lowering l(op.name(), decoded, tensors);
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
      return Unsupported(op.name(), absl::StrCat("output dtype ", int(r.dtype), " is not lowered"));
    }
    outs[o].dims.assign(r.sizes, r.sizes + r.ndim);
    if (!Contiguous(r)) {
      std::vector<int64_t>& order = orders[o];
      for (int d = 0; d < r.ndim; ++d) order.push_back(d);
      std::stable_sort(order.begin(), order.end(),
                       [&](int64_t a, int64_t b) { return r.strides[a] > r.strides[b]; });
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
            return Unsupported(op.name(), "writing a tensor whose elements overlap");
          }
          extent += (r.sizes[d] - 1) * r.strides[d];
        }
        spans[o] = extent + 1;
      }
    }
    // Nothing to write: an empty result, or one the client did not ask for
    // (an output slot without memory, e.g. a masked gradient).
    if (Numel(r) == 0) continue;
    if (ref_index[o] < tensors.size() && tensors[ref_index[o]].segment_bytes == 0 && r.address == 0) continue;
    absl::StatusOr<char*> dst = l.HostOf(r, ref_index[o]);
    if (!dst.ok()) return dst.status();
    dsts[o] = *dst;
  }
  // (index.Tensor's rule reads its list of index tensors itself.)
  const bool takes_list = absl::StartsWith(op.name(), "aten::index.Tensor") ||
                          absl::StartsWith(op.name(), "aten::_unsafe_index.Tensor") ||
                          absl::StartsWith(op.name(), "aten::index_put") ||
                          absl::StartsWith(op.name(), "aten::_index_put_impl");
  if (multi == nullptr && !takes_list) {
    for (size_t a = 0; a < decoded.num_args; ++a) {
      const tpu::ArgTag t = decoded.args[a].tag;
      if (t == tpu::ArgTag::kTensorList || t == tpu::ArgTag::kOptionalTensorList) {
        return Unsupported(op.name(), "tensor lists are not lowered for this op");
      }
    }
  }
  // Half-precision results (float16, bfloat16) are computed in float32 and
  // rounded once at the end, as ATen's CPU kernels do (their "opmath" type).
  std::vector<Target> compute = outs;
  for (Target& c : compute) {
    if (c.type->c10 == 5 || c.type->c10 == 15) c.type = DTypeOf(6);
  }
  // A written tensor wider than the op's own result (torch.add(bf16, 1,
  // out=float64 tensor)) gets the result as ATen computes it: in the
  // inputs' half-precision type, then cast. Taken as that type when every
  // tensor input has it, the op takes no dtype= and its output is a
  // wider float.
  const DType* natural = nullptr;
  if (!op.written().empty() && outs.size() == 1 && outs[0].type->is_float) {
    bool dtype_arg = false;
    for (size_t a = 0; a < decoded.num_args; ++a) {
      const tpu::OpArg& arg = decoded.args[a];
      if (arg.tag == tpu::ArgTag::kDtype) dtype_arg = true;
      if (arg.tag != tpu::ArgTag::kTensor || static_cast<int>(a) == op.written()[0]) continue;
      const DType* at = DTypeOf(arg.tensor.dtype);
      if (at == nullptr || (natural != nullptr && natural != at)) {
        natural = nullptr;
        dtype_arg = true;
        break;
      }
      natural = at;
    }
    if (dtype_arg || natural == nullptr || (natural->c10 != 5 && natural->c10 != 15) || natural->bytes >= outs[0].type->bytes) {
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
    return absl::InternalError(absl::StrCat(op.name(), ": the lowering made ", values.size(),
                                            " results for ", outs.size(), " outputs"));
  }
  for (size_t o = 0; o < outs.size(); ++o) {
    if (natural != nullptr) {
      values[o] = l.Convert(l.Convert(values[o], outs[o].dims, *compute[o].type, *natural), outs[o].dims, *natural, *outs[o].type);
      continue;
    }
    values[o] = l.Convert(values[o], outs[o].dims, *compute[o].type, *outs[o].type);
  }
  std::vector<std::string> types;
  for (size_t o = 0; o < outs.size(); ++o) {
    if (spans[o] > 0 && dsts[o] != nullptr) {
      const std::vector<int64_t> strides(refs[o]->strides, refs[o]->strides + refs[o]->ndim);
      const std::string flat = l.Flat(dsts[o], *outs[o].type, spans[o]);
      values[o] = l.ScatterStrided(flat, spans[o], values[o], outs[o].dims, strides, *outs[o].type);
      types.push_back(TypeOf({spans[o]}, *outs[o].type));
      continue;
    }
    std::vector<int64_t> stored = outs[o].dims;
    if (!orders[o].empty()) {
      for (size_t d = 0; d < orders[o].size(); ++d) stored[d] = outs[o].dims[orders[o][d]];
      values[o] = l.Emit(absl::StrCat("stablehlo.transpose ", values[o], ", dims = [",
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
    if (!host_devices || dsts[o] == nullptr || reinterpret_cast<uintptr_t>(dsts[o]) % 64 != 0) continue;
    std::vector<int64_t> stored = outs[o].dims;
    if (spans[o] > 0) {
      stored = {spans[o]};
    } else if (!orders[o].empty()) {
      for (size_t d = 0; d < orders[o].size(); ++d) stored[d] = outs[o].dims[orders[o][d]];
    }
    l.Donate(static_cast<int>(o), dsts[o], *outs[o].type, stored);
    donated[o] = true;
  }
  // Index checks come back as one more result, after the op's own.
  const bool checked = !l.out_of_range().empty();
  if (checked) {
    values.push_back(l.out_of_range());
    types.push_back(TypeOf({}, *DTypeOf(11)));
  }
  std::string program;
  // Device memory: the program takes the segments its tensors lie in (see
  // Lowering::DeviceText); in_seg[i] is transfer i's, -1 for a scalar.
  std::vector<int> in_seg;
  if (device_memory_) {
    std::vector<Lowering::SegmentParam> segs;
    std::vector<uint64_t> seg_address;
    auto segment_of = [&](const char* p, uint64_t* offset) -> int {
      for (size_t k = 0; k < tensors.size(); ++k) {
        const ResolvedTensor& rt = tensors[k];
        if (rt.segment_bytes == 0 || p < rt.segment_host_base || p >= rt.segment_host_base + rt.segment_bytes) continue;
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
        return absl::InternalError(absl::StrCat(op.name(), ": a parameter outside every segment of the op"));
      }
    }
    std::vector<Lowering::SegmentWrite> writes;
    for (size_t o = 0; o < outs.size(); ++o) {
      if (dsts[o] == nullptr) continue;
      uint64_t offset = 0;
      const int j = segment_of(dsts[o], &offset);
      if (j < 0) return absl::InternalError(absl::StrCat(op.name(), ": a result outside every segment of the op"));
      if (segs[j].result < 0) segs[j].result = plan.segments_written++;
      std::vector<int64_t> stored = outs[o].dims;
      if (spans[o] > 0) {
        stored = {spans[o]};
      } else if (!orders[o].empty()) {
        for (size_t d = 0; d < orders[o].size(); ++d) stored[d] = outs[o].dims[orders[o][d]];
      }
      writes.push_back({values[o], stored, outs[o].type, j, offset});
    }
    for (size_t j = 0; j < segs.size(); ++j) plan.segs[j].result = segs[j].result;
    std::vector<std::string> extra, extra_types;
    if (checked) {
      extra.push_back(l.out_of_range());
      extra_types.push_back(TypeOf({}, *DTypeOf(11)));
    }
    if (writes.empty() && !checked) return Unsupported(op.name(), "no result to write");
    // Offsets are parameters where each read and write starts at a tensor
    // of the record: the program then serves the op wherever they lie.
    bool dynamic = true;
    for (size_t i = 0; i < l.transfers().size() && dynamic; ++i) {
      if (in_seg[i] < 0) continue;
      const auto at = std::find(raw.begin(), raw.end(), reinterpret_cast<uintptr_t>(l.transfers()[i].data));
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
      for (const Lowering::SegmentWrite& w : writes) absl::StrAppend(&plan.fixed, " ", w.offset);
    }
    absl::StatusOr<std::string> text = l.DeviceText(segs, in_seg, in_off, writes, extra, extra_types, dynamic);
    if (!text.ok()) return text.status();
    program = *std::move(text);
    plan.device = true;
    plan.text = program;
    plan.on_device = device;
  } else {
    program = l.Text(values, types);
  }
  // (A graph's op is compiled only within the graph's program.)
  if (probe == nullptr) {
    absl::StatusOr<std::shared_ptr<const Executable>> exe = Compiled(program, device);
    if (!exe.ok()) {
      return absl::Status(exe.status().code(), absl::StrCat(op.name(), ": ", exe.status().message()));
    }
    plan.exe = *std::move(exe);
  }
  plan.checked = checked;
  plan.range_message = l.range_message();
  for (size_t o = 0; o < outs.size(); ++o) {
    const size_t bytes = static_cast<size_t>(spans[o] > 0 ? spans[o] : Numel(*refs[o])) * outs[o].type->bytes;
    plan.outputs.push_back({dsts[o] != nullptr, bytes, static_cast<bool>(donated[o])});
    if (dsts[o] != nullptr) plan.used.push_back(static_cast<int>(ref_index[o]));
  }
  // Each parameter by where it reads: a tensor of the record (by the host
  // address it has now), a scalar, or (a plan that is not kept) the bytes.
  for (size_t i = 0; i < l.transfers().size(); ++i) {
    const Transfer& x = l.transfers()[i];
    if (plan.device && in_seg[i] >= 0) {
      // Read inside the program from its segment: only checked here.
      const auto at = std::find(raw.begin(), raw.end(), reinterpret_cast<uintptr_t>(x.data));
      if (at != raw.end()) plan.used.push_back(static_cast<int>(at - raw.begin()));
      continue;
    }
    Plan::In in;
    static_cast<Transfer&>(in) = x;
    if (x.data == nullptr) {
      in.k = -1;
    } else {
      const auto at = std::find(raw.begin(), raw.end(), reinterpret_cast<uintptr_t>(x.data));
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
  for (int k : plan.offset_k) offsets.push_back(host[k] - tensors[k].segment_host_base);
  if (probe != nullptr) {
    // The plan, its signature and offsets, for the graph's program; nothing
    // runs.
    probe->offsets.assign(offsets.begin(), offsets.end());
    probe->key = key;
    probe->key.append(plan.fixed);
    if (kept == nullptr) {
      kept = std::make_shared<const Plan>(std::move(fresh));
      if (keyed && kept->keep) KeepPlan(key, kept);
    }
    probe->plan = std::move(kept);
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
    absl::Status st = RunDevice(op.name(), plan, tensors, device, [&](size_t i) { return data_of(plan.inputs[i]); },
                                offsets);
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
    if (x.aliased >= 0) written.emplace_back(data_of(x), data_of(x) + x.Bytes());
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
      if (!b.ok()) return absl::Status(b.status().code(), absl::StrCat(op.name(), ": ", b.status().message()));
      args.push_back(*b);
      continue;
    }
    bool in_place = x.aliased >= 0;
    if (!in_place && host_devices && at != nullptr && x.Dense() && reinterpret_cast<uintptr_t>(at) % 64 == 0) {
      in_place = std::none_of(written.begin(), written.end(), [&](const auto& w) {
        return at < w.second && w.first < at + x.Bytes();
      });
    }
    if (!in_place) {
      absl::StatusOr<Buffer> b = plugin_->FromHost(device, data, x.type->pjrt, x.dims, x.byte_strides);
      if (!b.ok()) return absl::Status(b.status().code(), absl::StrCat(op.name(), ": ", b.status().message()));
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
      absl::StatusOr<Buffer> b = plugin_->Alias(device, const_cast<char*>(at), x.type->pjrt, x.dims, donate);
      if (!b.ok()) return absl::Status(b.status().code(), absl::StrCat(op.name(), ": ", b.status().message()));
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
  absl::StatusOr<std::vector<Buffer>> out_buffers = plugin_->Execute(*plan.exe, device, absl::MakeConstSpan(args));
  if (!out_buffers.ok()) {
    return absl::Status(out_buffers.status().code(),
                        absl::StrCat(op.name(), ": ", out_buffers.status().message()));
  }
  const size_t n_out = plan.outputs.size();
  if (out_buffers->size() != n_out + (plan.checked ? 1 : 0)) {
    return absl::InternalError(absl::StrCat(op.name(), ": the program gave ", out_buffers->size(),
                                            " results for ", n_out, " outputs"));
  }
  if (plan.checked) {
    uint8_t bad = 0;
    if (absl::Status st = plugin_->ToHost(out_buffers->back(), &bad, 1); !st.ok()) {
      return absl::Status(st.code(), absl::StrCat(op.name(), ": ", st.message()));
    }
    if (bad != 0) {
      out_buffers->clear();
      inputs.clear();
      return absl::InvalidArgumentError(absl::StrCat(op.name(), ": ", plan.range_message));
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
          ResidentKey(device, dsts[o], x.type->pjrt, x.dims, true, &resident_key_);
          resident_.insert_or_assign(resident_key_, std::move(result));
          break;
        }
        continue;
      }
    }
    if (absl::Status st = plugin_->ToHost((*out_buffers)[o], dsts[o], bytes); !st.ok()) {
      return absl::Status(st.code(), absl::StrCat(op.name(), ": ", st.message()));
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

void PjrtChip::KeepPlan(const std::string& key, std::shared_ptr<const Plan> plan) {
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

// ---------------------------------------------------------------- device memory

absl::StatusOr<PjrtChip::Mirror*> PjrtChip::MirrorOf(const ResolvedTensor& seg, int device) {
  auto it = mirrors_.find(seg.segment_address);
  if (it != mirrors_.end() && it->second.bytes == seg.segment_bytes && it->second.owner == seg.owner &&
      it->second.device == device) {
    return &it->second;
  }
  // Nothing else may cover these pages now: a copy that does is of memory
  // freed since (releases are read before an op resolves its tensors), and
  // is dropped unread.
  Drop(seg.segment_address, seg.segment_bytes);
  absl::StatusOr<Buffer> b =
      plugin_->FromHost(device, seg.segment_host_base, PJRT_Buffer_Type_U8, {static_cast<int64_t>(seg.segment_bytes)});
  if (!b.ok()) return b.status();
  Mirror m;
  m.buffer = *std::move(b);
  m.host = seg.segment_host_base;
  m.bytes = seg.segment_bytes;
  m.owner = seg.owner;
  m.device = device;
  m.host_current = true;
  device_bytes_ += m.bytes;
  return &mirrors_.emplace(seg.segment_address, std::move(m)).first->second;
}

void PjrtChip::Drop(uint64_t address, uint64_t bytes) {
  auto it = mirrors_.upper_bound(address);
  if (it != mirrors_.begin() && std::prev(it)->first + std::prev(it)->second.bytes > address) --it;
  while (it != mirrors_.end() && it->first < address + bytes) {
    device_bytes_ -= it->second.bytes;
    it = mirrors_.erase(it);
  }
}

absl::Status PjrtChip::HostAccess(uint64_t address, uint64_t bytes, bool write, uint64_t owner) {
  if (!device_memory_ || bytes == 0) return absl::OkStatus();
  auto it = mirrors_.upper_bound(address);
  if (it != mirrors_.begin() && std::prev(it)->first + std::prev(it)->second.bytes > address) --it;
  while (it != mirrors_.end() && it->first < address + bytes) {
    Mirror& m = it->second;
    if (m.owner == owner && !m.host_current) {
      if (absl::Status st = plugin_->ToHost(m.buffer, m.host, m.bytes); !st.ok()) {
        return absl::Status(st.code(), absl::StrCat("copying device memory at 0x", absl::Hex(it->first),
                                                    " to the host: ", st.message()));
      }
      m.host_current = true;
    }
    // Another session's copy is of pages freed since: dropped unread. One
    // the host writes is the arena's from now on.
    if (m.owner != owner || write) {
      device_bytes_ -= m.bytes;
      it = mirrors_.erase(it);
      continue;
    }
    ++it;
  }
  return absl::OkStatus();
}

void PjrtChip::Released(uint64_t address, uint64_t bytes) {
  if (device_memory_) Drop(address, bytes);
}

absl::Status PjrtChip::HostAccessAll(const std::vector<ResolvedTensor>& tensors) {
  for (const ResolvedTensor& t : tensors) {
    if (t.segment_bytes == 0) continue;
    if (absl::Status st = HostAccess(t.segment_address, t.segment_bytes, false, t.owner); !st.ok()) return st;
  }
  return absl::OkStatus();
}

absl::Status PjrtChip::RunDevice(const std::string& name, const Plan& plan, const std::vector<ResolvedTensor>& tensors,
                                 int device, const std::function<const char*(size_t input)>& data_of,
                                 absl::Span<const int64_t> offsets) {
  auto named = [&](const absl::Status& st) { return absl::Status(st.code(), absl::StrCat(name, ": ", st.message())); };
  absl::InlinedVector<PJRT_Buffer*, 8> args;
  absl::InlinedVector<Mirror*, 4> segs;
  for (const Plan::Seg& s : plan.segs) {
    if (s.k < 0 || static_cast<size_t>(s.k) >= tensors.size() || tensors[s.k].segment_bytes == 0) {
      return absl::InternalError(absl::StrCat(name, ": a segment parameter without a segment"));
    }
    absl::StatusOr<Mirror*> m = MirrorOf(tensors[s.k], device);
    if (!m.ok()) return named(m.status());
    segs.push_back(*m);
    args.push_back((*m)->buffer.get());
  }
  // A segment named twice would be donated while also read.
  for (size_t a = 0; a < segs.size(); ++a) {
    for (size_t b = 0; b < a; ++b) {
      if (segs[a] == segs[b]) return absl::InternalError(absl::StrCat(name, ": a segment passed twice"));
    }
  }
  absl::InlinedVector<Buffer, 4> inputs;
  if (scalars_.size() >= 4096) scalars_.clear();
  for (size_t i = 0; i < plan.inputs.size(); ++i) {
    const Plan::In& x = plan.inputs[i];
    const char* at = data_of(i);
    if (at != nullptr) {
      absl::StatusOr<Buffer> b = plugin_->FromHost(device, at, x.type->pjrt, x.dims, x.byte_strides);
      if (!b.ok()) return named(b.status());
      args.push_back(b->get());
      inputs.push_back(*std::move(b));
      continue;
    }
    absl::StatusOr<PJRT_Buffer*> b = ScalarBuffer(device, x);
    if (!b.ok()) return named(b.status());
    args.push_back(*b);
  }
  for (int64_t offset : offsets) {
    absl::StatusOr<PJRT_Buffer*> b = OffsetBuffer(device, offset);
    if (!b.ok()) return named(b.status());
    args.push_back(*b);
  }
  absl::StatusOr<std::vector<Buffer>> out = plugin_->Execute(*plan.exe, device, absl::MakeConstSpan(args));
  if (!out.ok()) {
    // A donated segment may be gone with the failed run: what the host has
    // of it is all there is now.
    for (size_t j = 0; j < segs.size(); ++j) {
      if (plan.segs[j].result >= 0) Drop(tensors[plan.segs[j].k].segment_address, segs[j]->bytes);
    }
    return named(out.status());
  }
  const size_t want = static_cast<size_t>(plan.segments_written) + (plan.checked ? 1 : 0);
  if (out->size() != want) {
    return absl::InternalError(absl::StrCat(name, ": the program gave ", out->size(), " results for ", want));
  }
  // Each written segment's new buffer replaces the donated one.
  for (size_t j = 0; j < segs.size(); ++j) {
    const int r = plan.segs[j].result;
    if (r < 0) continue;
    segs[j]->buffer = std::move((*out)[r]);
    segs[j]->host_current = false;
  }
  if (plan.checked) {
    uint8_t bad = 0;
    if (absl::Status st = plugin_->ToHost(out->back(), &bad, 1); !st.ok()) return named(st);
    if (bad != 0) return absl::InvalidArgumentError(absl::StrCat(name, ": ", plan.range_message));
  }
  return absl::OkStatus();
}

absl::StatusOr<PJRT_Buffer*> PjrtChip::ScalarBuffer(int device, const Transfer& x) {
  const void* data = x.type->is_float ? static_cast<const void*>(&x.scalar_d) : static_cast<const void*>(&x.scalar_i);
  std::string id(1, static_cast<char>(device));
  id.push_back(static_cast<char>(x.type->pjrt));
  id.append(static_cast<const char*>(data), 8);
  auto it = scalars_.find(id);
  if (it == scalars_.end()) {
    absl::StatusOr<Buffer> b = plugin_->FromHost(device, data, x.type->pjrt, x.dims, x.byte_strides);
    if (!b.ok()) return b.status();
    it = scalars_.emplace(std::move(id), *std::move(b)).first;
  }
  return it->second.get();
}

absl::StatusOr<PJRT_Buffer*> PjrtChip::OffsetBuffer(int device, int64_t offset) {
  Transfer x;
  x.type = &I64();
  x.scalar_i = offset;
  return ScalarBuffer(device, x);
}

// ---------------------------------------------------------------- graphs

// A graph's module: its ops' programs as private functions of one module,
// whose main takes each segment any op names once (donated where an op
// writes it) and the ops' scalars, calls the ops in order with the
// segments' latest values, and returns the written segments and, where an
// op checks its indices, the first op whose check failed (0: none).
struct PjrtChip::Graph {
  std::shared_ptr<const Executable> exe;  // null: it did not compile, for `why`
  std::string why;
  std::vector<std::pair<size_t, size_t>> segs;  // each parameter segment: op i's segment j
  std::vector<int> result_of;                   // each segment's result (-1: read only)
  int written = 0;
  bool checked = false;
};

namespace {

// The parts of an op's device program (Lowering::DeviceText): its main's
// parameter types, result types and the function itself as `name`,
// private and without donation (the graph's main donates).
struct OpFunction {
  std::vector<std::string> params;
  std::vector<std::string> results;
  std::string text;
};

absl::StatusOr<OpFunction> AsFunction(const std::string& program, const std::string& name) {
  static const std::string kHead = "module @tpud_op {\n  func.func public @main(";
  static const std::string kArrow = ") -> (";
  static const std::string kOpen = ") {\n";
  static const std::string kAlias = " {tf.aliasing_output = ";
  if (!absl::StartsWith(program, kHead) || !absl::EndsWith(program, "\n}\n")) {
    return absl::InternalError("an op's program is not of the form a graph composes");
  }
  const size_t params_at = kHead.size();
  const size_t arrow = program.find(kArrow, params_at);
  const size_t open = arrow == std::string::npos ? arrow : program.find(kOpen, arrow);
  if (open == std::string::npos) return absl::InternalError("an op's program without a signature");
  OpFunction f;
  std::string header;
  for (absl::string_view p : absl::StrSplit(absl::string_view(program).substr(params_at, arrow - params_at), ", ")) {
    std::string param(p);
    if (size_t a = param.find(kAlias); a != std::string::npos) param.erase(a);
    const size_t colon = param.find(": ");
    if (colon == std::string::npos) return absl::InternalError("an op's program with an untyped parameter");
    f.params.push_back(param.substr(colon + 2));
    absl::StrAppend(&header, header.empty() ? "" : ", ", param);
  }
  for (absl::string_view r : absl::StrSplit(absl::string_view(program).substr(arrow + kArrow.size(), open - arrow - kArrow.size()), ", ")) {
    f.results.emplace_back(r);
  }
  f.text = absl::StrCat("  func.func private @", name, "(", header, program.substr(arrow, program.size() - arrow - 2));
  return f;
}

}  // namespace

// A copy between device addresses of one graph, as an op's plan: its bytes
// sliced out of the source segment and written into the destination's.
absl::StatusOr<PjrtChip::Probe> PjrtChip::CopyPlan(const tpu::DecodedCopy& copy,
                                                   const std::vector<ResolvedTensor>& ends) {
  if (ends.size() != 2) return absl::InternalError("a copy without its two segments");
  const ResolvedTensor& src = ends[0];
  const ResolvedTensor& dst = ends[1];
  if (copy.src < src.segment_address || copy.src - src.segment_address > src.segment_bytes ||
      copy.bytes > src.segment_bytes - (copy.src - src.segment_address) || copy.dst < dst.segment_address ||
      copy.dst - dst.segment_address > dst.segment_bytes ||
      copy.bytes > dst.segment_bytes - (copy.dst - dst.segment_address)) {
    return absl::InvalidArgumentError("a copy reaches past its segments");
  }
  const int64_t from = static_cast<int64_t>(copy.src - src.segment_address);
  const int64_t to = static_cast<int64_t>(copy.dst - dst.segment_address);
  const int64_t n = static_cast<int64_t>(copy.bytes);
  const bool same = src.segment_address == dst.segment_address;
  const DType& u8 = *DTypeOf(0);
  const std::string st = TypeOf({static_cast<int64_t>(src.segment_bytes)}, u8);
  const std::string dt = TypeOf({static_cast<int64_t>(dst.segment_bytes)}, u8);
  const std::string nt = TypeOf({n}, u8);
  const std::string s = "%s0", d = same ? "%s0" : "%s1";
  auto plan = std::make_shared<Plan>();
  plan->device = true;
  plan->on_device = tpu::DeviceAddressChip(copy.dst);
  plan->segments_written = 1;
  if (same) {
    plan->segs.push_back({1, 0});
  } else {
    plan->segs.push_back({0, -1});
    plan->segs.push_back({1, 0});
  }
  // (Where it reads and writes are parameters, as an op's offsets are.)
  const std::string params = same ? absl::StrCat("%s0: ", dt, " {tf.aliasing_output = 0 : i32}")
                                  : absl::StrCat("%s0: ", st, ", %s1: ", dt, " {tf.aliasing_output = 0 : i32}");
  plan->text = absl::StrCat(
      "module @tpud_op {\n  func.func public @main(", params, ", %from: tensor<i64>, %to: tensor<i64>) -> (", dt,
      ") {\n",
      "    %0 = stablehlo.dynamic_slice ", s, ", %from, sizes = [", n, "] : (", st, ", tensor<i64>) -> ", nt, "\n",
      "    %1 = stablehlo.dynamic_update_slice ", d, ", %0, %to : (", dt, ", ", nt, ", tensor<i64>) -> ", dt, "\n",
      "    return %1 : ", dt, "\n  }\n}\n");
  Probe probe;
  probe.key = absl::StrCat("copy ", src.segment_bytes, " ", dst.segment_bytes, " ", n, " ", same);
  probe.offsets = {from, to};
  probe.plan = std::move(plan);
  return probe;
}

absl::StatusOr<bool> PjrtChip::RunProgram(const std::vector<ProgramOp>& ops, size_t* failed,
                                          std::string* declined) {
  *failed = 0;
  auto decline = [&](size_t i, const std::string& why) {
    *declined = i < ops.size() ? absl::StrCat("record ", i + 1, " (", ops[i].op == nullptr ? std::string("copy")
                                              : static_cast<const PjrtOp&>(*ops[i].op).name(), "): ", why)
                               : why;
    return false;
  };
  if (!device_memory_) return decline(ops.size(), "segments are not in device memory (--pjrt_memory=host)");
  if (!graphs_on_) return decline(ops.size(), "--pjrt_graphs=false");
  if (ops.empty()) return decline(0, "no ops");
  // Each op's plan and signature, lowered where not seen before (not
  // compiled: the graph's module is).
  std::vector<Probe> probes(ops.size());
  for (size_t i = 0; i < ops.size(); ++i) {
    if (ops[i].op == nullptr) {
      if (ops[i].copy == nullptr) return decline(i, "neither an op nor a copy");
      if (ops[i].copy->bytes == 0) {
        probes[i].nothing = true;
        continue;
      }
      absl::StatusOr<Probe> copy = CopyPlan(*ops[i].copy, *ops[i].tensors);
      if (!copy.ok()) return decline(i, std::string(copy.status().message()));
      probes[i] = *std::move(copy);
      continue;
    }
    probe_ = &probes[i];
    absl::Status st = Run(*ops[i].op, *ops[i].decoded, *ops[i].tensors, nullptr, nullptr);
    probe_ = nullptr;
    if (!st.ok()) return decline(i, std::string(st.message()));  // run one by one, the op reports it
    if (probes[i].nothing) continue;
    if (probes[i].plan == nullptr || !probes[i].plan->device || probes[i].plan->text.empty()) {
      return decline(i, "read on the host or sized by the data");
    }
  }
  int device = -1;
  std::string key;
  std::vector<uint64_t> seg_address;
  std::vector<std::vector<int>> seg_of(ops.size());  // op i's segment j: the graph's
  for (size_t i = 0; i < ops.size(); ++i) {
    const Probe& pr = probes[i];
    if (pr.nothing) continue;
    const Plan& plan = *pr.plan;
    if (device >= 0 && plan.on_device != device) return decline(i, "on another device");
    device = plan.on_device;
    absl::StrAppend(&key, i, ":", pr.key.size(), ":");
    key.append(pr.key);
    for (const Plan::Seg& sg : plan.segs) {
      const ResolvedTensor& rt = (*ops[i].tensors)[sg.k];
      size_t g = std::find(seg_address.begin(), seg_address.end(), rt.segment_address) - seg_address.begin();
      if (g == seg_address.size()) seg_address.push_back(rt.segment_address);
      seg_of[i].push_back(static_cast<int>(g));
      absl::StrAppend(&key, g, ",");
    }
    for (const Plan::In& x : plan.inputs) {
      if (x.k != -1) return decline(i, "a parameter from the host");
    }
  }
  if (device < 0) return decline(ops.size(), "nothing to run");
  std::shared_ptr<const Graph> graph;
  if (auto it = graphs_.find(key); it != graphs_.end()) {
    graph_lru_.splice(graph_lru_.end(), graph_lru_, it->second);
    graph = it->second->second;
    ++stats_[device].hits;
  } else {
    auto made = std::make_shared<Graph>();
    made->result_of.assign(seg_address.size(), -1);
    made->segs.resize(seg_address.size());
    std::vector<bool> named(seg_address.size(), false);
    std::vector<uint64_t> seg_bytes(seg_address.size(), 0);
    for (size_t i = 0; i < ops.size(); ++i) {
      if (probes[i].nothing) continue;
      for (size_t j = 0; j < seg_of[i].size(); ++j) {
        const int g = seg_of[i][j];
        if (!named[g]) {
          named[g] = true;
          made->segs[g] = {i, j};
          seg_bytes[g] = (*ops[i].tensors)[probes[i].plan->segs[j].k].segment_bytes;
        }
        if (probes[i].plan->segs[j].result >= 0 && made->result_of[g] < 0) made->result_of[g] = made->written++;
      }
    }
    const DType& u8 = *DTypeOf(0);
    std::string funcs, body, params;
    std::vector<std::string> now(seg_address.size()), checks;
    std::vector<size_t> check_op;
    for (size_t g = 0; g < seg_address.size(); ++g) {
      now[g] = absl::StrCat("%g", g);
      absl::StrAppend(&params, g == 0 ? "" : ", ", now[g], ": ", TypeOf({static_cast<int64_t>(seg_bytes[g])}, u8));
      if (made->result_of[g] >= 0) absl::StrAppend(&params, " {tf.aliasing_output = ", made->result_of[g], " : i32}");
    }
    for (size_t i = 0; i < ops.size(); ++i) {
      if (probes[i].nothing) continue;
      const Plan& plan = *probes[i].plan;
      absl::StatusOr<OpFunction> f = AsFunction(plan.text, absl::StrCat("op", i));
      if (!f.ok()) return decline(i, std::string(f.status().message()));
      const size_t scalars = plan.inputs.size() + probes[i].offsets.size();
      if (f->params.size() != plan.segs.size() + scalars ||
          f->results.size() != static_cast<size_t>(plan.segments_written) + (plan.checked ? 1 : 0)) {
        return decline(i, "its program's signature does not match its plan");
      }
      absl::StrAppend(&funcs, f->text);
      std::vector<std::string> args;
      for (size_t j = 0; j < plan.segs.size(); ++j) args.push_back(now[seg_of[i][j]]);
      for (size_t m = 0; m < scalars; ++m) {
        const std::string a = absl::StrCat("%a", i, "_", m);
        args.push_back(a);
        absl::StrAppend(&params, ", ", a, ": ", f->params[plan.segs.size() + m]);
      }
      const std::string c = absl::StrCat("%c", i);
      const size_t nres = f->results.size();
      auto result = [&](size_t r) { return nres == 1 ? c : absl::StrCat(c, "#", r); };
      absl::StrAppend(&body, "    ", c, nres == 1 ? "" : absl::StrCat(":", nres), " = func.call @op", i, "(",
                      absl::StrJoin(args, ", "), ") : (", absl::StrJoin(f->params, ", "), ") -> (",
                      absl::StrJoin(f->results, ", "), ")\n");
      for (size_t j = 0; j < plan.segs.size(); ++j) {
        if (plan.segs[j].result >= 0) now[seg_of[i][j]] = result(plan.segs[j].result);
      }
      if (plan.checked) {
        checks.push_back(result(nres - 1));
        check_op.push_back(i);
      }
    }
    std::vector<std::string> results(made->written), types(made->written);
    for (size_t g = 0; g < seg_address.size(); ++g) {
      if (made->result_of[g] < 0) continue;
      results[made->result_of[g]] = now[g];
      types[made->result_of[g]] = TypeOf({static_cast<int64_t>(seg_bytes[g])}, u8);
    }
    if (!checks.empty()) {
      made->checked = true;
      std::string first = "%fail";
      absl::StrAppend(&body, "    ", first, " = stablehlo.constant dense<0> : tensor<i32>\n");
      for (size_t q = checks.size(); q-- > 0;) {
        absl::StrAppend(&body, "    %at", q, " = stablehlo.constant dense<", check_op[q] + 1, "> : tensor<i32>\n",
                        "    %fail", q, " = stablehlo.select ", checks[q], ", %at", q, ", ", first,
                        " : tensor<i1>, tensor<i32>\n");
        first = absl::StrCat("%fail", q);
      }
      results.push_back(first);
      types.push_back("tensor<i32>");
    }
    if (results.empty()) return decline(ops.size(), "no results");
    const std::string ret = absl::StrJoin(types, ", ");
    const std::string text = absl::StrCat("module @tpud_graph {\n", funcs, "  func.func public @main(", params,
                                          ") -> (", ret, ") {\n", body, "    return ", absl::StrJoin(results, ", "),
                                          " : ", ret, "\n  }\n}\n");
    absl::StatusOr<std::shared_ptr<const Executable>> exe = Compiled(text, device);
    if (exe.ok()) {
      made->exe = *std::move(exe);
    } else {
      made->why = std::string(exe.status().message()).substr(0, 2000);
    }
    if (graph_lru_.size() >= capacity_) {
      graphs_.erase(graph_lru_.front().first);
      graph_lru_.pop_front();
    }
    graph_lru_.emplace_back(key, made);
    graphs_[key] = std::prev(graph_lru_.end());
    graph = std::move(made);
  }
  if (graph->exe == nullptr) return decline(ops.size(), absl::StrCat("the module did not compile: ", graph->why));
  // Segments first, then each op's scalars and offsets in order.
  if (scalars_.size() >= 4096) scalars_.clear();
  absl::InlinedVector<PJRT_Buffer*, 32> args;
  std::vector<Mirror*> segs;
  for (const auto& [i, j] : graph->segs) {
    absl::StatusOr<Mirror*> m = MirrorOf((*ops[i].tensors)[probes[i].plan->segs[j].k], device);
    if (!m.ok()) return m.status();
    segs.push_back(*m);
    args.push_back((*m)->buffer.get());
  }
  for (size_t i = 0; i < ops.size(); ++i) {
    if (probes[i].nothing) continue;
    for (const Plan::In& x : probes[i].plan->inputs) {
      absl::StatusOr<PJRT_Buffer*> b = ScalarBuffer(device, x);
      if (!b.ok()) return b.status();
      args.push_back(*b);
    }
    for (int64_t offset : probes[i].offsets) {
      absl::StatusOr<PJRT_Buffer*> b = OffsetBuffer(device, offset);
      if (!b.ok()) return b.status();
      args.push_back(*b);
    }
  }
  absl::StatusOr<std::vector<Buffer>> out = plugin_->Execute(*graph->exe, device, absl::MakeConstSpan(args));
  if (!out.ok()) {
    for (size_t g = 0; g < segs.size(); ++g) {
      if (graph->result_of[g] >= 0) Drop(seg_address[g], segs[g]->bytes);
    }
    return absl::Status(out.status().code(), absl::StrCat("the graph's module: ", out.status().message()));
  }
  if (out->size() != static_cast<size_t>(graph->written) + (graph->checked ? 1 : 0)) {
    return absl::InternalError(absl::StrCat("a graph's program gave ", out->size(), " results for ", graph->written));
  }
  for (size_t g = 0; g < segs.size(); ++g) {
    if (graph->result_of[g] < 0) continue;
    segs[g]->buffer = std::move((*out)[graph->result_of[g]]);
    segs[g]->host_current = false;
  }
  ++stats_[device].graphs;
  if (graph->checked) {
    int32_t first = 0;
    if (absl::Status st = plugin_->ToHost(out->back(), &first, sizeof(first)); !st.ok()) return st;
    if (first > 0 && static_cast<size_t>(first) <= ops.size()) {
      *failed = static_cast<size_t>(first - 1);
      const auto& op = static_cast<const PjrtOp&>(*ops[*failed].op);
      return absl::InvalidArgumentError(absl::StrCat(op.name(), ": ", probes[*failed].plan->range_message));
    }
  }
  return true;
}

// ---------------------------------------------------------------- collectives

namespace {

// The scalar reduction `op` over tensor<E>, as an all_reduce-style region.
std::string ReduceRegion(tpu::ReduceOp op, const std::string& e) {
  const char* fn = op == tpu::ReduceOp::kProduct ? "multiply"
                   : op == tpu::ReduceOp::kMin   ? "minimum"
                   : op == tpu::ReduceOp::kMax   ? "maximum"
                                                 : "add";  // sum, avg
  return absl::StrCat("({\n      ^bb0(%a: tensor<", e, ">, %b: tensor<", e, ">):\n        %c = stablehlo.", fn,
                      " %a, %b : tensor<", e, ">\n        stablehlo.return %c : tensor<", e, ">\n    })");
}

// The replicated program of one collective: replica r is rank r, with one
// parameter (its input, `in` elements of `t`) and one result (`out`
// elements). Reductions of half-precision types run in float32, rounded
// once, as ATen's CPU kernels compute them.
std::string CollectiveProgram(const CollectiveCall& call, const DType& t, int64_t in, int64_t out) {
  const int n = static_cast<int>(call.ranks.size());
  std::vector<std::string> ids;
  for (int r = 0; r < n; ++r) ids.push_back(std::to_string(r));
  const std::string groups = absl::StrCat("replica_groups = dense<[[", absl::StrJoin(ids, ", "), "]]> : tensor<1x", n,
                                          "xi64>");
  const bool half = t.c10 == 5 || t.c10 == 15;
  const DType& c = half ? *DTypeOf(6) : t;  // the type reduced in
  std::string body;
  std::string x = "%x";
  if (half && call.kind != tpu::CollectiveKind::kAllGather && call.kind != tpu::CollectiveKind::kBroadcast &&
      call.kind != tpu::CollectiveKind::kAllToAll) {
    absl::StrAppend(&body, "    %w = stablehlo.convert %x : (", TypeOf({in}, t), ") -> ", TypeOf({in}, c), "\n");
    x = "%w";
  }
  switch (call.kind) {
    case tpu::CollectiveKind::kAllReduce:
    case tpu::CollectiveKind::kReduce:
      absl::StrAppend(&body, "    %r = \"stablehlo.all_reduce\"(", x, ") ", ReduceRegion(call.reduce, c.mlir), " {",
                      groups, "} : (", TypeOf({in}, c), ") -> ", TypeOf({out}, c), "\n");
      break;
    case tpu::CollectiveKind::kReduceScatter:
      absl::StrAppend(&body, "    %r = \"stablehlo.reduce_scatter\"(", x, ") ", ReduceRegion(call.reduce, c.mlir),
                      " {scatter_dimension = 0 : i64, ", groups, "} : (", TypeOf({in}, c), ") -> ", TypeOf({out}, c),
                      "\n");
      break;
    case tpu::CollectiveKind::kAllGather:
      absl::StrAppend(&body, "    %r = \"stablehlo.all_gather\"(%x) {all_gather_dim = 0 : i64, ", groups, "} : (",
                      TypeOf({in}, t), ") -> ", TypeOf({out}, t), "\n");
      break;
    case tpu::CollectiveKind::kAllToAll:
      absl::StrAppend(&body, "    %r = \"stablehlo.all_to_all\"(%x) {split_dimension = 0 : i64, concat_dimension = 0 : i64, ",
                      "split_count = ", n, " : i64, ", groups, "} : (", TypeOf({in}, t), ") -> ", TypeOf({out}, t), "\n");
      break;
    case tpu::CollectiveKind::kBroadcast: {
      // The root's bytes, the largest against every other replica's zeros
      // (unsigned): exact for every value, signed zeros and NaN payloads
      // included. (XLA's CPU all_reduce has no bitwise or.)
      absl::StrAppend(&body, "    %id = stablehlo.replica_id : tensor<ui32>\n",
                      "    %root = stablehlo.constant dense<", call.root, "> : tensor<ui32>\n",
                      "    %is = stablehlo.compare EQ, %id, %root : (tensor<ui32>, tensor<ui32>) -> tensor<i1>\n",
                      "    %mask = stablehlo.broadcast_in_dim %is, dims = [] : (tensor<i1>) -> ", TypeOf({in}, *DTypeOf(11)),
                      "\n    %zero = stablehlo.constant dense<0> : ", TypeOf({in}, t), "\n",
                      "    %mine = stablehlo.select %mask, %x, %zero : ", TypeOf({in}, *DTypeOf(11)), ", ",
                      TypeOf({in}, t), "\n",
                      "    %r = \"stablehlo.all_reduce\"(%mine) ({\n      ^bb0(%a: tensor<ui8>, %b: tensor<ui8>):\n",
                      "        %c = stablehlo.maximum %a, %b : tensor<ui8>\n        stablehlo.return %c : tensor<ui8>\n    }) {",
                      groups, "} : (", TypeOf({in}, t), ") -> ", TypeOf({out}, t), "\n");
      break;
    }
    default:
      break;
  }
  std::string r = "%r";
  if (call.reduce == tpu::ReduceOp::kAvg &&
      (call.kind == tpu::CollectiveKind::kAllReduce || call.kind == tpu::CollectiveKind::kReduce ||
       call.kind == tpu::CollectiveKind::kReduceScatter)) {
    absl::StrAppend(&body, "    %n = stablehlo.constant dense<", n, c.is_float ? ".0" : "", "> : ", TypeOf({out}, c),
                    "\n    %q = stablehlo.divide %r, %n : ", TypeOf({out}, c), "\n");
    r = "%q";
  }
  if (x == "%w") {
    absl::StrAppend(&body, "    %y = stablehlo.convert ", r, " : (", TypeOf({out}, c), ") -> ", TypeOf({out}, t), "\n");
    r = "%y";
  }
  return absl::StrCat("module @tpud_collective {\n  func.func public @main(%x: ", TypeOf({in}, t), ") -> ",
                      TypeOf({out}, t), " {\n", body, "    return ", r, " : ", TypeOf({out}, t), "\n  }\n}\n");
}

// `count` values of t as u8[count * bytes] and back, inside a program.
std::string BytesToValues(const std::string& v, int64_t count, const DType& t, const std::string& name) {
  const DType& u8 = *DTypeOf(0);
  if (t.c10 == 0) return absl::StrCat("    ", name, " = stablehlo.reshape ", v, " : (", TypeOf({count}, u8), ") -> ",
                                      TypeOf({count}, u8), "\n");
  if (t.bytes == 1) return absl::StrCat("    ", name, " = stablehlo.bitcast_convert ", v, " : (", TypeOf({count}, u8),
                                        ") -> ", TypeOf({count}, t), "\n");
  return absl::StrCat("    ", name, "_g = stablehlo.reshape ", v, " : (", TypeOf({count * t.bytes}, u8), ") -> ",
                      TypeOf({count, t.bytes}, u8), "\n    ", name, " = stablehlo.bitcast_convert ", name, "_g : (",
                      TypeOf({count, t.bytes}, u8), ") -> ", TypeOf({count}, t), "\n");
}
std::string ValuesToBytes(const std::string& v, int64_t count, const DType& t, const std::string& name) {
  const DType& u8 = *DTypeOf(0);
  if (t.c10 == 0) return absl::StrCat("    ", name, " = stablehlo.reshape ", v, " : (", TypeOf({count}, u8), ") -> ",
                                      TypeOf({count}, u8), "\n");
  if (t.bytes == 1) return absl::StrCat("    ", name, " = stablehlo.bitcast_convert ", v, " : (", TypeOf({count}, t),
                                        ") -> ", TypeOf({count}, u8), "\n");
  return absl::StrCat("    ", name, "_g = stablehlo.bitcast_convert ", v, " : (", TypeOf({count}, t), ") -> ",
                      TypeOf({count, t.bytes}, u8), "\n    ", name, " = stablehlo.reshape ", name, "_g : (",
                      TypeOf({count, t.bytes}, u8), ") -> ", TypeOf({count * t.bytes}, u8), "\n");
}

}  // namespace

absl::StatusOr<Buffer> PjrtChip::ReadSegment(const ResolvedTensor& seg, uint64_t address, int64_t count,
                                             int8_t dtype, int device) {
  const DType& t = *DTypeOf(dtype);
  const DType& u8 = *DTypeOf(0);
  const int64_t seg_bytes = static_cast<int64_t>(seg.segment_bytes);
  const int64_t offset = static_cast<int64_t>(address - seg.segment_address);
  const int64_t bytes = count * t.bytes;
  const std::string program = absl::StrCat(
      "module @tpud_read {\n  func.func public @main(%s: ", TypeOf({seg_bytes}, u8), ") -> ", TypeOf({count}, t),
      " {\n    %b = stablehlo.slice %s [", offset, ":", offset + bytes, "] : (", TypeOf({seg_bytes}, u8), ") -> ",
      TypeOf({bytes}, u8), "\n", BytesToValues("%b", count, t, "%v"), "    return %v : ", TypeOf({count}, t),
      "\n  }\n}\n");
  absl::StatusOr<std::shared_ptr<const Executable>> exe = Compiled(program, device);
  if (!exe.ok()) return exe.status();
  absl::StatusOr<Mirror*> m = MirrorOf(seg, device);
  if (!m.ok()) return m.status();
  PJRT_Buffer* arg = (*m)->buffer.get();
  absl::StatusOr<std::vector<Buffer>> out = plugin_->Execute(**exe, device, absl::MakeConstSpan(&arg, 1));
  if (!out.ok()) return out.status();
  if (out->size() != 1) return absl::InternalError("reading a segment gave no value");
  return std::move((*out)[0]);
}

absl::Status PjrtChip::WriteSegment(const ResolvedTensor& seg, uint64_t address, const Buffer& value, int64_t count,
                                    int8_t dtype, int device) {
  const DType& t = *DTypeOf(dtype);
  const DType& u8 = *DTypeOf(0);
  const int64_t seg_bytes = static_cast<int64_t>(seg.segment_bytes);
  const int64_t offset = static_cast<int64_t>(address - seg.segment_address);
  const int64_t bytes = count * t.bytes;
  const std::string program = absl::StrCat(
      "module @tpud_write {\n  func.func public @main(%s: ", TypeOf({seg_bytes}, u8),
      " {tf.aliasing_output = 0 : i32}, %v: ", TypeOf({count}, t), ") -> ", TypeOf({seg_bytes}, u8), " {\n",
      ValuesToBytes("%v", count, t, "%b"), "    %at = stablehlo.constant dense<", offset,
      "> : tensor<i64>\n    %r = stablehlo.dynamic_update_slice %s, %b, %at : (", TypeOf({seg_bytes}, u8), ", ",
      TypeOf({bytes}, u8), ", tensor<i64>) -> ", TypeOf({seg_bytes}, u8), "\n    return %r : ",
      TypeOf({seg_bytes}, u8), "\n  }\n}\n");
  absl::StatusOr<std::shared_ptr<const Executable>> exe = Compiled(program, device);
  if (!exe.ok()) return exe.status();
  absl::StatusOr<Mirror*> m = MirrorOf(seg, device);
  if (!m.ok()) return m.status();
  PJRT_Buffer* args[2] = {(*m)->buffer.get(), value.get()};
  absl::StatusOr<std::vector<Buffer>> out = plugin_->Execute(**exe, device, absl::MakeConstSpan(args, 2));
  if (!out.ok()) {
    // The donated segment may be gone with the failed run.
    Drop(seg.segment_address, seg.segment_bytes);
    return out.status();
  }
  if (out->size() != 1) return absl::InternalError("writing a segment gave no segment");
  (*m)->buffer = std::move((*out)[0]);
  (*m)->host_current = false;
  return absl::OkStatus();
}

absl::StatusOr<bool> PjrtChip::RunCollective(const CollectiveCall& call) {
  using tpu::CollectiveKind;
  const int n = static_cast<int>(call.ranks.size());
  if (n < 2 || call.count == 0) return false;
  const bool reduces = call.kind == CollectiveKind::kAllReduce || call.kind == CollectiveKind::kReduce ||
                       call.kind == CollectiveKind::kReduceScatter;
  // Reductions in the tensor's type (bool, complex and unsigned 16/32/64
  // ones go through the arena); data movement as bytes, any type.
  const DType* type = DTypeOf(call.dtype);
  const int64_t esize = tpu::ElementSize(call.dtype);
  if (esize <= 0 || (reduces && (type == nullptr || type->c10 == 11 || IsComplex(*type)))) return false;
  const DType& t = reduces ? *type : *DTypeOf(0);
  const int64_t per = reduces ? static_cast<int64_t>(call.count) : static_cast<int64_t>(call.count) * esize;
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
      // Even splits only (stablehlo.all_to_all's); uneven ones move in the arena.
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
  auto writes = [&](int r) { return call.kind != CollectiveKind::kReduce || r == call.root; };
  const uint64_t in_bytes = static_cast<uint64_t>(in) * t.bytes, out_bytes = static_cast<uint64_t>(out) * t.bytes;
  for (int r = 0; r < n; ++r) {
    if (input_of(r).bytes != in_bytes || (writes(r) && call.ranks[r].recv_bytes != out_bytes)) {
      return absl::InternalError(absl::StrCat("collective: rank ", r, "'s buffers do not have the operation's size"));
    }
  }
  const std::string program = CollectiveProgram(call, t, in, out);
  absl::StatusOr<std::shared_ptr<const Executable>> exe = Compiled(program, devices[0], devices);
  if (!exe.ok()) return exe.status();
  std::vector<Buffer> inputs;
  std::vector<std::vector<PJRT_Buffer*>> args(n);
  for (int r = 0; r < n; ++r) {
    const Input x = input_of(r);
    absl::StatusOr<Buffer> b;
    if (device_memory_) {
      // Read out of the segment on the device; its host copy may be stale.
      b = ReadSegment(*x.seg, x.address, in, t.c10, devices[r]);
    } else if (reinterpret_cast<uintptr_t>(x.host) % 64 == 0) {
      b = plugin_->Alias(devices[r], x.host, t.pjrt, {in}, /*writable=*/false);
    } else {
      b = plugin_->FromHost(devices[r], x.host, t.pjrt, {in});
    }
    if (!b.ok()) return absl::Status(b.status().code(), absl::StrCat("rank ", r, "'s input: ", b.status().message()));
    args[r].push_back(b->get());
    inputs.push_back(*std::move(b));
  }
  absl::StatusOr<std::vector<std::vector<Buffer>>> results = plugin_->ExecuteReplicated(**exe, args);
  inputs.clear();
  if (!results.ok()) return results.status();
  for (int r = 0; r < n; ++r) {
    if (!writes(r)) continue;
    if ((*results)[r].size() != 1) return absl::InternalError("a collective program gave no result");
    const CollectiveRank& cr = call.ranks[r];
    absl::Status st = device_memory_ ? WriteSegment(cr.recv_segment, cr.recv, (*results)[r][0], out, t.c10, devices[r])
                                     : plugin_->ToHost((*results)[r][0], cr.host_recv, out_bytes);
    if (!st.ok()) return absl::Status(st.code(), absl::StrCat("rank ", r, "'s result: ", st.message()));
  }
  for (int d : devices) ++stats_[d].collectives;
  return true;
}

}  // namespace tpud::pjrt
