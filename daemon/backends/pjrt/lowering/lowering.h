// The lowering builder: one op's StableHLO program, built as text, with
// the host transfers that feed its parameters; and the types it speaks
// (StableHLO and PJRT element types, Target, Rule). Op families
// (lowering/*.cc) use it through the registry (registry.h).
#ifndef TPUD_DAEMON_BACKENDS_PJRT_LOWERING_LOWERING_H_
#define TPUD_DAEMON_BACKENDS_PJRT_LOWERING_LOWERING_H_

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "daemon/backends/chip_backend.h"
#include "daemon/backends/pjrt/lowering/program.h"
#include "daemon/backends/pjrt/pjrt_plugin.h"
#include "tpu/device_address.h"
#include "tpu/dtype.h"

namespace tpud::pjrt {

// The dtypes tpud lowers, with their StableHLO and PJRT names. The other
// facts come from tpu/dtype.h (is_float and bytes are its IsFloating and
// ElementSizeOf, kept here because the rules ask for them everywhere).
struct HloType {
  constexpr HloType(tpu::DType d, const char* m, PJRT_Buffer_Type p)
      : dtype(d),
        mlir(m),
        pjrt(p),
        is_float(tpu::IsFloating(d)),
        bytes(tpu::ElementSizeOf(d)) {}
  tpu::DType dtype;
  const char* mlir;  // "f32", "complex<f64>"
  PJRT_Buffer_Type pjrt;
  bool is_float;
  int bytes;
};
// `inline`: one table for the whole program, so that a type is one address
// in every translation unit (a plain constexpr array is a copy per file).
inline constexpr HloType kHloTypes[] = {
    {tpu::DType::kUInt8, "ui8", PJRT_Buffer_Type_U8},
    {tpu::DType::kInt8, "i8", PJRT_Buffer_Type_S8},
    {tpu::DType::kInt16, "i16", PJRT_Buffer_Type_S16},
    {tpu::DType::kInt32, "i32", PJRT_Buffer_Type_S32},
    {tpu::DType::kInt64, "i64", PJRT_Buffer_Type_S64},
    {tpu::DType::kHalf, "f16", PJRT_Buffer_Type_F16},
    {tpu::DType::kFloat, "f32", PJRT_Buffer_Type_F32},
    {tpu::DType::kDouble, "f64", PJRT_Buffer_Type_F64},
    {tpu::DType::kBool, "i1", PJRT_Buffer_Type_PRED},
    {tpu::DType::kBFloat16, "bf16", PJRT_Buffer_Type_BF16},
    {tpu::DType::kComplexFloat, "complex<f32>", PJRT_Buffer_Type_C64},
    {tpu::DType::kComplexDouble, "complex<f64>", PJRT_Buffer_Type_C128},
    // complex32 (chalf) has no StableHLO type: its 4-byte elements travel
    // as ui32, and only copy_ reads or writes them, as two float16 halves
    // (ChalfToComplex, ComplexToChalf); every other op refuses them.
    {tpu::DType::kComplexHalf, "ui32", PJRT_Buffer_Type_U32},
};
// The type of `dtype`, or null where it is not lowered.
inline const HloType* DTypeOf(tpu::DType dtype) {
  for (const HloType& d : kHloTypes) {
    if (d.dtype == dtype) return &d;
  }
  return nullptr;
}
// Likewise for a record's dtype code (TensorRef::dtype, OpArg::dtype).
inline const HloType* DTypeOf(int8_t code) {
  return DTypeOf(tpu::DTypeFromCode(code));
}
inline const HloType& F64() { return *DTypeOf(tpu::DType::kDouble); }
inline const HloType& F32() { return *DTypeOf(tpu::DType::kFloat); }
inline const HloType& I64() { return *DTypeOf(tpu::DType::kInt64); }
// complex64 and complex128 (complex32 is not lowered).
// (complex32 is carried as raw ui32 elements: complex in no program.)
inline bool IsComplex(const HloType& t) {
  return tpu::IsComplex(t.dtype) && t.dtype != tpu::DType::kComplexHalf;
}
// The type of a complex type's parts (float32 for complex64).
inline const HloType& PartOf(const HloType& t) {
  return *DTypeOf(tpu::PartOf(t.dtype));
}
// The complex type whose parts are float t (complex128 for float64,
// complex64 for every other type).
inline const HloType& ComplexOf(const HloType& t) {
  return *DTypeOf(t.dtype == tpu::DType::kDouble ? tpu::DType::kComplexDouble
                                                 : tpu::DType::kComplexFloat);
}

// An MLIR float literal: it needs a point before any exponent ("1.0e-05").
inline std::string FloatLiteral(double v) {
  std::string s = absl::StrFormat("%.17g", v);
  if (s.find_first_of(".ni") ==
      std::string::npos) {  // not already 1.5, inf or nan
    const size_t e = s.find('e');
    s.insert(e == std::string::npos ? s.size() : e, ".0");
  }
  return s;
}

inline std::string TypeOf(const std::vector<int64_t>& dims, const HloType& t) {
  std::string s = "tensor<";
  for (int64_t d : dims) absl::StrAppend(&s, d, "x");
  return absl::StrCat(s, t.mlir, ">");
}

// The op's error: its name, why, and what to do.
inline absl::Status Unsupported(const std::string& op, const std::string& why) {
  return absl::UnimplementedError(absl::StrCat(
      op, ": ", why,
      " (PJRT backend; tpud --backend=simulated runs every ATen op)"));
}

class Lowering;
struct Target;
// How an op becomes StableHLO: one result (Rule) or several (MultiRule).
using Rule = std::function<absl::StatusOr<std::string>(
    Lowering&, const tpu::DecodedOp&, const Target&)>;
using MultiRule = std::function<absl::StatusOr<std::vector<std::string>>(
    Lowering&, const tpu::DecodedOp&, const std::vector<Target>&)>;

// A host transfer into one program parameter.
struct Transfer {
  const char* data = nullptr;
  const HloType* type = nullptr;
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

// The largest (`high`) or smallest value of an integer or bool type, as a
// literal.
inline std::string IntLimit(const HloType& t, bool high) {
  switch (t.dtype) {
    case tpu::DType::kBool:
      return high ? "true" : "false";
    case tpu::DType::kUInt8:
      return high ? "255" : "0";
    case tpu::DType::kInt8:
      return high ? "127" : "-128";
    case tpu::DType::kInt16:
      return high ? "32767" : "-32768";
    case tpu::DType::kInt32:
      return high ? "2147483647" : "-2147483648";
    default:
      return high ? "9223372036854775807" : "-9223372036854775808";
  }
}

// Builds one op's program and the transfers that feed it.
class Lowering {
 public:
  // arg_names: the op's arguments' names, for rules that read them by
  // name (Args, helpers.h); null where nothing reads them.
  Lowering(const std::string& op, const tpu::DecodedOp& decoded,
           const std::vector<ResolvedTensor>& tensors,
           const std::vector<std::string>* arg_names = nullptr)
      : op_(op), decoded_(decoded), tensors_(tensors), arg_names_(arg_names) {}

  // The host address of tensor `ref` (the k-th TensorRef of the record),
  // checked to lie inside its resolved segment.
  absl::StatusOr<char*> HostOf(const tpu::TensorRef& ref, size_t k) const;
  // The same for a dtype of `element_bytes` that need not be lowered (a
  // host read of raw elements: .item() of an unsigned tensor).
  absl::StatusOr<char*> HostOfElements(const tpu::TensorRef& ref, size_t k,
                                       size_t element_bytes) const;

  // Tensor argument `a` (the k-th TensorRef) as a value of its own dtype and
  // full shape. Expanded dimensions (stride 0) travel as size 1 and are
  // broadcast in the program.
  absl::StatusOr<std::string> Tensor(const tpu::TensorRef& ref, size_t k);

  // A host scalar (a Scalar argument or a wrapped number) as a 0-d value of
  // dtype `as`.
  absl::StatusOr<std::string> Scalar(const tpu::OpArg& a, const HloType& as);

  // The position in `tensors` of tensor argument `a` (one of decoded.args):
  // TensorRefs come in record order, a list's elements each, then outputs.
  size_t TensorIndex(const tpu::OpArg& a) const;

  // A tensor or scalar operand, broadcast to `dims` and converted to `as`.
  absl::StatusOr<std::string> Operand(const tpu::OpArg& a,
                                      const std::vector<int64_t>& dims,
                                      const HloType& as);

  // Tensor `r` (the k-th TensorRef), broadcast to `dims` and converted to `as`.
  absl::StatusOr<std::string> OperandRef(const tpu::TensorRef& r, size_t k,
                                         const std::vector<int64_t>& dims,
                                         const HloType& as) {
    absl::StatusOr<std::string> v = Tensor(r, k);
    if (!v.ok()) return v;
    const std::vector<int64_t> from(r.sizes, r.sizes + r.ndim);
    return BroadcastTo(Convert(*v, from, *DTypeOf(r.dtype), as), from, dims,
                       as);
  }

  // `v` (dims `in`) reduced over dimensions `which` with `op` ("add",
  // "maximum", "minimum") from `init` (a value of t); dims kept in order.
  std::string ReduceOver(const std::string& v, const std::vector<int64_t>& in,
                         const std::vector<int64_t>& which, const char* op,
                         const std::string& init, const HloType& t) {
    return Emit(
        absl::StrCat("stablehlo.reduce(", v, " init: ", init,
                     ") applies stablehlo.", op, " across dimensions = [",
                     absl::StrJoin(which, ", "), "] : (", TypeOf(in, t), ", ",
                     TypeOf({}, t), ") -> ", TypeOf(Kept(in, which), t)));
  }
  static std::vector<int64_t> Kept(const std::vector<int64_t>& in,
                                   const std::vector<int64_t>& which) {
    std::vector<int64_t> kept;
    for (size_t i = 0; i < in.size(); ++i) {
      if (std::find(which.begin(), which.end(), static_cast<int64_t>(i)) ==
          which.end()) {
        kept.push_back(in[i]);
      }
    }
    return kept;
  }
  // A reduced value back to `in`, the reduced dimensions broadcast.
  std::string Expand(const std::string& v, const std::vector<int64_t>& in,
                     const std::vector<int64_t>& which, const HloType& t);
  std::string Reshape(const std::string& v, const std::vector<int64_t>& from,
                      const std::vector<int64_t>& to, const HloType& t) {
    if (from == to) return v;
    return Emit(absl::StrCat("stablehlo.reshape ", v, " : (", TypeOf(from, t),
                             ") -> ", TypeOf(to, t)));
  }
  // The comparison type stablehlo.compare takes for values of t.
  static const char* CompareKind(const HloType& t) {
    return t.is_float || IsComplex(t)
               ? "FLOAT"
               : (t.mlir[0] == 'u' || t.dtype == tpu::DType::kBool ? "UNSIGNED"
                                                                   : "SIGNED");
  }
  std::string Compare(const char* dir, const std::string& a,
                      const std::string& b, const std::vector<int64_t>& dims,
                      const HloType& t) {
    return Emit(absl::StrCat("stablehlo.compare ", dir, ", ", a, ", ", b, ", ",
                             CompareKind(t), " : (", TypeOf(dims, t), ", ",
                             TypeOf(dims, t), ") -> ",
                             TypeOf(dims, *DTypeOf(tpu::DType::kBool))));
  }
  std::string Select(const std::string& pred, const std::string& a,
                     const std::string& b, const std::vector<int64_t>& dims,
                     const HloType& t) {
    return Emit(absl::StrCat("stablehlo.select ", pred, ", ", a, ", ", b, " : ",
                             TypeOf(dims, *DTypeOf(tpu::DType::kBool)), ", ",
                             TypeOf(dims, t)));
  }
  std::string Iota(int64_t dim, const std::vector<int64_t>& dims,
                   const HloType& t) {
    return Emit(
        absl::StrCat("stablehlo.iota dim = ", dim, " : ", TypeOf(dims, t)));
  }
  // -inf (floats) or the lowest value, as a 0-d constant.
  std::string Lowest(const HloType& t) {
    // Complex: (-inf, 0), the real part's lowest.
    if (IsComplex(t)) return Convert(Lowest(PartOf(t)), {}, PartOf(t), t);
    const char* hex = t.dtype == tpu::DType::kFloat      ? "0xFF800000"
                      : t.dtype == tpu::DType::kDouble   ? "0xFFF0000000000000"
                      : t.dtype == tpu::DType::kHalf     ? "0xFC00"
                      : t.dtype == tpu::DType::kBFloat16 ? "0xFF80"
                                                         : nullptr;
    if (hex == nullptr)
      return Emit(absl::StrCat("stablehlo.constant dense<", IntLimit(t, false),
                               "> : ", TypeOf({}, t)));
    return Emit(
        absl::StrCat("stablehlo.constant dense<", hex, "> : ", TypeOf({}, t)));
  }

  std::string Convert(const std::string& v, const std::vector<int64_t>& dims,
                      const HloType& from, const HloType& to);

  // Numpy-style: `from` aligns with the trailing dimensions of `to`.
  std::string BroadcastTo(const std::string& v,
                          const std::vector<int64_t>& from,
                          const std::vector<int64_t>& to, const HloType& t) {
    if (from == to) return v;
    std::vector<int64_t> map;
    for (size_t i = 0; i < from.size(); ++i)
      map.push_back(to.size() - from.size() + i);
    return Emit(absl::StrCat("stablehlo.broadcast_in_dim ", v, ", dims = [",
                             absl::StrJoin(map, ", "), "] : (", TypeOf(from, t),
                             ") -> ", TypeOf(to, t)));
  }

  std::string Constant(double value, const std::vector<int64_t>& dims,
                       const HloType& t) {
    const std::string lit =
        t.is_float     ? FloatLiteral(value)
        : IsComplex(t) ? absl::StrCat("(", FloatLiteral(value), ", 0.0)")
                       : absl::StrCat(static_cast<int64_t>(value));
    const std::string c = Emit(absl::StrCat(
        "stablehlo.constant dense<",
        t.dtype == tpu::DType::kBool ? (value != 0 ? "true" : "false") : lit,
        "> : ", TypeOf({}, t)));
    return BroadcastTo(c, {}, dims, t);
  }

  std::string Binary(const char* op, const std::string& a, const std::string& b,
                     const std::vector<int64_t>& dims, const HloType& t) {
    return Emit(absl::StrCat("stablehlo.", op, " ", a, ", ", b, " : ",
                             TypeOf(dims, t)));
  }
  std::string Unary(const char* op, const std::string& a,
                    const std::vector<int64_t>& dims, const HloType& t) {
    return Emit(absl::StrCat("stablehlo.", op, " ", a, " : ", TypeOf(dims, t)));
  }

  std::string Emit(const std::string& rhs) {
    const std::string v = absl::StrCat("%v", next_++);
    absl::StrAppend(&body_, "    ", v, " = ", rhs, "\n");
    return v;
  }

  std::string Text(const std::vector<std::string>& results,
                   const std::vector<std::string>& types) const;

  // `n` elements of type t at `host`, as a 1-d parameter.
  std::string Flat(const char* host, const HloType& t, int64_t n) {
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
  std::string ScatterStrided(const std::string& flat, int64_t span,
                             const std::string& v,
                             const std::vector<int64_t>& dims,
                             const std::vector<int64_t>& strides,
                             const HloType& t);

  // Uniform values in [0, 1) of type f (f32 or f64), dims `dims` (with a
  // leading dimension of `draws` when that is above 1), from XLA's
  // rng_bit_generator keyed by `seed` (a parameter of the program).
  std::string UniformBits(int64_t seed, const std::vector<int64_t>& dims,
                          const HloType& f, int64_t draws);

  std::vector<Transfer>& transfers() { return transfers_; }
  const std::string& op() const { return op_; }
  const tpu::DecodedOp& decoded() const { return decoded_; }
  const std::vector<ResolvedTensor>& tensors() const { return tensors_; }
  const std::vector<std::string>* arg_names() const { return arg_names_; }

  // Records that every element of `idx` (i64, dims `dims`) must lie in
  // [0, size): the program returns whether one does not, and the op fails
  // with `what` after it runs (XLA itself clamps or drops such indices).
  void CheckRange(const std::string& idx, const std::vector<int64_t>& dims,
                  int64_t size, const std::string& what);
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
  std::pair<std::string, std::string> Sort(const std::string& v,
                                           const std::vector<int64_t>& in,
                                           int64_t dim, bool descending,
                                           const HloType& t);

  // Elements [start, limit) of `v` (dims `in`) in every dimension.
  std::string Slice(const std::string& v, const std::vector<int64_t>& in,
                    const std::vector<int64_t>& start,
                    const std::vector<int64_t>& limit, const HloType& t);
  // Elements [begin, end) of `v` along `dim`.
  std::string SliceAlong(const std::string& v, const std::vector<int64_t>& in,
                         int64_t dim, int64_t begin, int64_t end,
                         const HloType& t) {
    std::vector<int64_t> start(in.size(), 0), limit = in;
    start[dim] = begin;
    limit[dim] = end;
    return Slice(v, in, start, limit, t);
  }

  // Donates the memory of result `o` (dense, `dims` of t at `host`) to the
  // program: a parameter that already reads exactly those bytes (self of an
  // in-place op, the span of a gapped write), else one more, unused.
  void Donate(int o, char* host, const HloType& t,
              const std::vector<int64_t>& dims);

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
  std::string Decode(const std::string& bytes, int64_t count, const HloType& t);
  // `count` values of t as their bytes (u8[count * size of t]).
  std::string Encode(const std::string& v, int64_t count, const HloType& t);
  // Transfer x's tensor, read out of segment value `seg` (u8[seg_bytes])
  // where it starts `offset` bytes in; or, with `at` (a tensor<i64> value),
  // where `at` says when the program runs (`offset` is where it starts now).
  absl::StatusOr<std::string> ReadView(const std::string& seg,
                                       uint64_t seg_bytes, uint64_t offset,
                                       const Transfer& x,
                                       const std::string& at = "");

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
    const HloType* type = nullptr;
    int seg = -1;
    uint64_t offset = 0;
  };
  // The program for device memory, in pieces (its Module() is the op's
  // module, its Function() a graph's): parameters are the segments, then the
  // transfers with `in_seg[i]` < 0 (scalars) in order; transfer i with a
  // segment is read from it at `in_off[i]`. Results: each segment with a
  // `result`, in that order, then `extra` (typed `extra_types`). With
  // `dynamic`, the offsets are the program's last parameters (tensor<i64>,
  // each read's in transfer order, then each write's) instead of constants
  // in it, so one program serves its op wherever the tensors lie.
  absl::StatusOr<ProgramPieces> DeviceProgram(
      const std::vector<SegmentParam>& segs, const std::vector<int>& in_seg,
      const std::vector<uint64_t>& in_off,
      const std::vector<SegmentWrite>& writes,
      const std::vector<std::string>& extra,
      const std::vector<std::string>& extra_types, bool dynamic = false);

 private:
  std::string Param(const std::string& type, Transfer x) {
    param_types_.push_back(type);
    transfers_.push_back(std::move(x));
    return absl::StrCat("%p", param_types_.size() - 1);
  }

  const std::string& op_;
  const tpu::DecodedOp& decoded_;
  const std::vector<ResolvedTensor>& tensors_;
  const std::vector<std::string>* arg_names_;
  std::vector<std::string> param_types_;
  std::vector<Transfer> transfers_;
  std::string body_;
  int next_ = 0;
  std::string out_of_range_, range_message_;
};

struct Target {
  const tpu::TensorRef* ref;
  std::vector<int64_t> dims;
  const HloType* type;
};

}  // namespace tpud::pjrt

#endif  // TPUD_DAEMON_BACKENDS_PJRT_LOWERING_LOWERING_H_
