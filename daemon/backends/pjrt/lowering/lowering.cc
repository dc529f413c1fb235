#include "daemon/backends/pjrt/lowering/lowering.h"

#include <algorithm>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace tpud::pjrt {

absl::StatusOr<char*> Lowering::HostOf(const tpu::TensorRef& ref,
                                       size_t k) const {
  const HloType* t = DTypeOf(ref.dtype);
  if (t == nullptr)
    return Unsupported(
        op_, absl::StrCat("dtype ", int(ref.dtype), " is not lowered"));
  return HostOfElements(ref, k, t->bytes);
}

absl::StatusOr<char*> Lowering::HostOfElements(const tpu::TensorRef& ref,
                                               size_t k,
                                               size_t element_bytes) const {
  if (k >= tensors_.size())
    return absl::InternalError(
        absl::StrCat(op_, ": tensor ", k, " unresolved"));
  const ResolvedTensor& seg = tensors_[k];
  const uint64_t rel = ref.address - seg.segment_address;
  absl::StatusOr<tpu::Footprint> fp = tpu::TensorFootprint(ref);
  if (!fp.ok()) return fp.status();
  if (ref.address < seg.segment_address || rel > seg.segment_bytes ||
      fp->end > seg.segment_bytes - rel) {
    return absl::InvalidArgumentError(absl::StrCat(
        op_, ": tensor ", k, " of the record (at 0x", absl::Hex(ref.address),
        ") is not inside its segment [0x", absl::Hex(seg.segment_address),
        ", +", seg.segment_bytes, " bytes)"));
  }
  for (int d = 0; d < ref.ndim; ++d) {
    if (ref.strides[d] < 0)
      return Unsupported(op_, "a tensor with a negative stride");
  }
  return seg.segment_host_base + rel + ref.storage_offset * element_bytes;
}

absl::StatusOr<std::string> Lowering::Tensor(const tpu::TensorRef& ref,
                                             size_t k) {
  // An empty tensor is a constant: no bytes to pass (in device memory a
  // parameter without a segment's bytes would be taken for a scalar).
  bool empty = false;
  for (int d = 0; d < ref.ndim; ++d) empty |= ref.sizes[d] == 0;
  if (empty) {
    const HloType* et = DTypeOf(ref.dtype);
    if (et == nullptr)
      return Unsupported(
          op_, absl::StrCat("dtype ", int(ref.dtype), " is not lowered"));
    return Constant(0, std::vector<int64_t>(ref.sizes, ref.sizes + ref.ndim),
                    *et);
  }
  absl::StatusOr<char*> host = HostOf(ref, k);
  if (!host.ok()) return host.status();
  const HloType& t = *DTypeOf(ref.dtype);
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

absl::StatusOr<std::string> Lowering::Scalar(const tpu::OpArg& a,
                                             const HloType& as) {
  const bool complex = a.tag == tpu::ArgTag::kComplex ||
                       a.tag == tpu::ArgTag::kScalarComplex ||
                       (a.tag == tpu::ArgTag::kScalarTensor &&
                        tpu::IsComplex(static_cast<tpu::DType>(a.dtype)));
  if (complex) {
    // Two float64 parameters, the parts, made one complex<f64> here.
    std::string parts[2];
    for (int k = 0; k < 2; ++k) {
      Transfer x;
      x.type = &F64();
      x.scalar_d = k == 0 ? a.d : a.d_imag;
      parts[k] = Param(TypeOf({}, F64()), std::move(x));
    }
    const HloType& c128 = *DTypeOf(tpu::DType::kComplexDouble);
    return Convert(Emit(absl::StrCat("stablehlo.complex ", parts[0], ", ",
                                     parts[1], " : ", TypeOf({}, c128))),
                   {}, c128, as);
  }
  Transfer x;
  const HloType* t;
  switch (a.tag) {
    case tpu::ArgTag::kScalarInt:
    case tpu::ArgTag::kInt:
    case tpu::ArgTag::kSymInt:
      t = &I64();
      x.scalar_i = a.i;
      break;
    case tpu::ArgTag::kScalarBool:
    case tpu::ArgTag::kBool:
      t = &I64();
      x.scalar_i = a.b ? 1 : 0;
      break;
    case tpu::ArgTag::kScalarDouble:
    case tpu::ArgTag::kDouble:
      t = &F64();
      x.scalar_d = a.d;
      break;
    case tpu::ArgTag::kScalarTensor: {
      const HloType* st = DTypeOf(a.dtype);
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
      return Unsupported(op_, "a missing scalar");
  }
  x.type = t;
  std::string v = Param(TypeOf({}, *t), std::move(x));
  return Convert(v, {}, *t, as);
}

size_t Lowering::TensorIndex(const tpu::OpArg& a) const {
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

absl::StatusOr<std::string> Lowering::Operand(const tpu::OpArg& a,
                                              const std::vector<int64_t>& dims,
                                              const HloType& as) {
  if (a.tag == tpu::ArgTag::kTensor) {
    absl::StatusOr<std::string> v = Tensor(a.tensor, TensorIndex(a));
    if (!v.ok()) return v;
    const std::vector<int64_t> from(a.tensor.sizes,
                                    a.tensor.sizes + a.tensor.ndim);
    std::string c = Convert(*v, from, *DTypeOf(a.tensor.dtype), as);
    return BroadcastTo(c, from, dims, as);
  }
  absl::StatusOr<std::string> s = Scalar(a, as);
  if (!s.ok()) return s;
  return BroadcastTo(*s, {}, dims, as);
}

std::string Lowering::Expand(const std::string& v,
                             const std::vector<int64_t>& in,
                             const std::vector<int64_t>& which,
                             const HloType& t) {
  std::vector<int64_t> map;
  for (size_t i = 0; i < in.size(); ++i) {
    if (std::find(which.begin(), which.end(), static_cast<int64_t>(i)) ==
        which.end()) {
      map.push_back(static_cast<int64_t>(i));
    }
  }
  return Emit(absl::StrCat("stablehlo.broadcast_in_dim ", v, ", dims = [",
                           absl::StrJoin(map, ", "), "] : (",
                           TypeOf(Kept(in, which), t), ") -> ", TypeOf(in, t)));
}

std::string Lowering::Convert(const std::string& v,
                              const std::vector<int64_t>& dims,
                              const HloType& from, const HloType& to) {
  if (from.dtype == to.dtype) return v;
  // Complex to real keeps the real part; real to complex has no imaginary
  // part (XLA converts neither way itself).
  if (IsComplex(from) && !IsComplex(to)) {
    const HloType& part = PartOf(from);
    return Convert(
        Emit(absl::StrCat("stablehlo.real ", v, " : (", TypeOf(dims, from),
                          ") -> ", TypeOf(dims, part))),
        dims, part, to);
  }
  if (IsComplex(to) && !IsComplex(from)) {
    const HloType& part = PartOf(to);
    const std::string re = Convert(v, dims, from, part);
    return Emit(absl::StrCat("stablehlo.complex ", re, ", ",
                             Constant(0, dims, part), " : ", TypeOf(dims, to)));
  }
  return Emit(absl::StrCat("stablehlo.convert ", v, " : (", TypeOf(dims, from),
                           ") -> ", TypeOf(dims, to)));
}

std::string Lowering::Text(const std::vector<std::string>& results,
                           const std::vector<std::string>& types) const {
  std::vector<std::string> params;
  for (size_t i = 0; i < param_types_.size(); ++i) {
    params.push_back(absl::StrCat("%p", i, ": ", param_types_[i]));
    if (transfers_[i].aliased >= 0) {
      absl::StrAppend(&params.back(),
                      " {tf.aliasing_output = ", transfers_[i].aliased,
                      " : i32}");
    }
  }
  const std::string ret = absl::StrJoin(types, ", ");
  return absl::StrCat("module @tpud_op {\n  func.func public @main(",
                      absl::StrJoin(params, ", "), ") -> (", ret, ") {\n",
                      body_, "    return ", absl::StrJoin(results, ", "), " : ",
                      ret, "\n  }\n}\n");
}

std::string Lowering::ScatterStrided(const std::string& flat, int64_t span,
                                     const std::string& v,
                                     const std::vector<int64_t>& dims,
                                     const std::vector<int64_t>& strides,
                                     const HloType& t) {
  int64_t n = 1;
  for (int64_t d : dims) n *= d;
  const HloType& i64 = I64();
  std::string index = Constant(0, dims, i64);
  for (size_t d = 0; d < dims.size(); ++d) {
    if (dims[d] == 1 || strides[d] == 0) continue;
    const std::string term =
        Binary("multiply", Iota(static_cast<int64_t>(d), dims, i64),
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
      "    }) {indices_are_sorted = false, scatter_dimension_numbers = "
      "#stablehlo.scatter<",
      "inserted_window_dims = [0], scatter_dims_to_operand_dims = [0], "
      "index_vector_dim = 1>, ",
      "unique_indices = true} : (", TypeOf({span}, t), ", ",
      TypeOf({n, 1}, i64), ", ", TypeOf({n}, t), ") -> ", TypeOf({span}, t)));
}

std::string Lowering::UniformBits(int64_t seed,
                                  const std::vector<int64_t>& dims,
                                  const HloType& f, int64_t draws) {
  Transfer x;
  x.type = &I64();
  x.scalar_i = seed;
  const std::string s = Param(TypeOf({}, I64()), std::move(x));
  const HloType& i64 = I64();
  const std::string pair =
      Binary("add", BroadcastTo(s, {}, {2}, i64), Iota(0, {2}, i64), {2}, i64);
  const std::string key =
      Emit(absl::StrCat("stablehlo.bitcast_convert ", pair,
                        " : (tensor<2xi64>) -> tensor<2xui64>"));
  std::vector<int64_t> shape = dims;
  if (draws > 1) shape.insert(shape.begin(), draws);
  const bool wide = f.dtype == tpu::DType::kDouble;
  const std::string ut = wide ? "ui64" : "ui32";
  auto type = [&](const char* elt) {
    std::string r = "tensor<";
    for (int64_t d : shape) absl::StrAppend(&r, d, "x");
    return absl::StrCat(r, elt, ">");
  };
  const std::string gen = absl::StrCat("%v", next_++);
  absl::StrAppend(
      &body_, "    ", gen, ":2 = stablehlo.rng_bit_generator ", key,
      ", algorithm = DEFAULT : (tensor<2xui64>) -> (tensor<2xui64>, ",
      type(ut.c_str()), ")\n");
  // The top mantissa bits under an exponent of 1.0: [1, 2), minus 1.
  const std::string shift = Emit(absl::StrCat(
      "stablehlo.constant dense<", wide ? 12 : 9, "> : ", type(ut.c_str())));
  const std::string one = Emit(absl::StrCat(
      "stablehlo.constant dense<", wide ? "4607182418800017408" : "1065353216",
      "> : ", type(ut.c_str())));
  const std::string m =
      Emit(absl::StrCat("stablehlo.shift_right_logical ", gen, "#1, ", shift,
                        " : ", type(ut.c_str())));
  const std::string bits = Emit(
      absl::StrCat("stablehlo.or ", m, ", ", one, " : ", type(ut.c_str())));
  const std::string v =
      Emit(absl::StrCat("stablehlo.bitcast_convert ", bits, " : (",
                        type(ut.c_str()), ") -> ", TypeOf(shape, f)));
  return Binary("subtract", v, Constant(1, shape, f), shape, f);
}

void Lowering::CheckRange(const std::string& idx,
                          const std::vector<int64_t>& dims, int64_t size,
                          const std::string& what) {
  const HloType& i64 = I64();
  const HloType& i1 = *DTypeOf(tpu::DType::kBool);
  const std::string bad =
      Binary("or", Compare("LT", idx, Constant(0, dims, i64), dims, i64),
             Compare("GE", idx, Constant(static_cast<double>(size), dims, i64),
                     dims, i64),
             dims, i1);
  std::vector<int64_t> all;
  for (size_t q = 0; q < dims.size(); ++q)
    all.push_back(static_cast<int64_t>(q));
  const std::string any =
      ReduceOver(bad, dims, all, "or", Constant(0, {}, i1), i1);
  out_of_range_ =
      out_of_range_.empty() ? any : Binary("or", out_of_range_, any, {}, i1);
  if (range_message_.empty()) range_message_ = what;
}

std::pair<std::string, std::string> Lowering::Sort(
    const std::string& v, const std::vector<int64_t>& in, int64_t dim,
    bool descending, const HloType& t) {
  const HloType& i64 = I64();
  const std::string s = TypeOf({}, t), si = TypeOf({}, i64),
                    b = TypeOf({}, *DTypeOf(tpu::DType::kBool));
  const char* kind = CompareKind(t);
  // before(a, b): a sorts first.
  std::string cmp = absl::StrCat("      %before = stablehlo.compare ",
                                 descending ? "GT" : "LT", ", %a, %b, ", kind,
                                 " : (", s, ", ", s, ") -> ", b, "\n");
  std::string result = "%before";
  if (t.is_float) {
    // A NaN sorts last going up, first going down.
    const char* nan_first = descending ? "%a" : "%b";
    const char* other = descending ? "%b" : "%a";
    absl::StrAppend(&cmp, "      %n1 = stablehlo.compare NE, ", nan_first, ", ",
                    nan_first, ", FLOAT : (", s, ", ", s, ") -> ", b, "\n",
                    "      %n2 = stablehlo.compare EQ, ", other, ", ", other,
                    ", FLOAT : (", s, ", ", s, ") -> ", b, "\n",
                    "      %n3 = stablehlo.and %n1, %n2 : ", b, "\n",
                    "      %r = stablehlo.or %before, %n3 : ", b, "\n");
    result = "%r";
  }
  const std::string r = EmitResults(
      absl::StrCat("\"stablehlo.sort\"(", v, ", ", Iota(dim, in, i64), ") ({\n",
                   "    ^bb0(%a: ", s, ", %b: ", s, ", %ia: ", si,
                   ", %ib: ", si, "):\n", cmp, "      stablehlo.return ",
                   result, " : ", b, "\n", "    }) {dimension = ", dim,
                   " : i64, is_stable = true} : (", TypeOf(in, t), ", ",
                   TypeOf(in, i64), ") -> (", TypeOf(in, t), ", ",
                   TypeOf(in, i64), ")"),
      2);
  return {r + "#0", r + "#1"};
}

std::string Lowering::Slice(const std::string& v,
                            const std::vector<int64_t>& in,
                            const std::vector<int64_t>& start,
                            const std::vector<int64_t>& limit,
                            const HloType& t) {
  std::vector<std::string> r;
  std::vector<int64_t> out;
  for (size_t k = 0; k < in.size(); ++k) {
    r.push_back(absl::StrCat(start[k], ":", limit[k]));
    out.push_back(limit[k] - start[k]);
  }
  return Emit(absl::StrCat("stablehlo.slice ", v, " [", absl::StrJoin(r, ", "),
                           "] : (", TypeOf(in, t), ") -> ", TypeOf(out, t)));
}

void Lowering::Donate(int o, char* host, const HloType& t,
                      const std::vector<int64_t>& dims) {
  for (Transfer& x : transfers_) {
    if (x.aliased < 0 && x.data == host && x.type->dtype == t.dtype &&
        x.dims == dims && x.Dense()) {
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

std::string Lowering::Decode(const std::string& bytes, int64_t count,
                             const HloType& t) {
  const HloType& u8 = *DTypeOf(tpu::DType::kUInt8);
  const int64_t n = count * t.bytes;
  if (t.dtype == tpu::DType::kUInt8) return bytes;
  if (t.dtype == tpu::DType::kBool)
    return Compare("NE", bytes, Constant(0, {n}, u8), {n}, u8);
  if (IsComplex(t)) {
    const HloType& part = PartOf(t);
    const std::string grouped = Reshape(bytes, {n}, {count, 2, part.bytes}, u8);
    const std::string parts = Emit(absl::StrCat(
        "stablehlo.bitcast_convert ", grouped, " : (",
        TypeOf({count, 2, part.bytes}, u8), ") -> ", TypeOf({count, 2}, part)));
    const std::string re = Reshape(SliceAlong(parts, {count, 2}, 1, 0, 1, part),
                                   {count, 1}, {count}, part);
    const std::string im = Reshape(SliceAlong(parts, {count, 2}, 1, 1, 2, part),
                                   {count, 1}, {count}, part);
    return Emit(absl::StrCat("stablehlo.complex ", re, ", ", im, " : ",
                             TypeOf({count}, t)));
  }
  if (t.bytes == 1) {
    return Emit(absl::StrCat("stablehlo.bitcast_convert ", bytes, " : (",
                             TypeOf({n}, u8), ") -> ", TypeOf({count}, t)));
  }
  const std::string grouped = Reshape(bytes, {n}, {count, t.bytes}, u8);
  return Emit(absl::StrCat("stablehlo.bitcast_convert ", grouped, " : (",
                           TypeOf({count, t.bytes}, u8), ") -> ",
                           TypeOf({count}, t)));
}

std::string Lowering::Encode(const std::string& v, int64_t count,
                             const HloType& t) {
  const HloType& u8 = *DTypeOf(tpu::DType::kUInt8);
  const int64_t n = count * t.bytes;
  if (t.dtype == tpu::DType::kUInt8) return v;
  if (t.dtype == tpu::DType::kBool) return Convert(v, {count}, t, u8);
  if (IsComplex(t)) {
    const HloType& part = PartOf(t);
    const std::string re = Reshape(
        Emit(absl::StrCat("stablehlo.real ", v, " : (", TypeOf({count}, t),
                          ") -> ", TypeOf({count}, part))),
        {count}, {count, 1}, part);
    const std::string im = Reshape(
        Emit(absl::StrCat("stablehlo.imag ", v, " : (", TypeOf({count}, t),
                          ") -> ", TypeOf({count}, part))),
        {count}, {count, 1}, part);
    const std::string parts = Emit(
        absl::StrCat("stablehlo.concatenate ", re, ", ", im, ", dim = 1 : (",
                     TypeOf({count, 1}, part), ", ", TypeOf({count, 1}, part),
                     ") -> ", TypeOf({count, 2}, part)));
    const std::string bytes = Emit(absl::StrCat(
        "stablehlo.bitcast_convert ", parts, " : (", TypeOf({count, 2}, part),
        ") -> ", TypeOf({count, 2, part.bytes}, u8)));
    return Reshape(bytes, {count, 2, part.bytes}, {n}, u8);
  }
  if (t.bytes == 1) {
    return Emit(absl::StrCat("stablehlo.bitcast_convert ", v, " : (",
                             TypeOf({count}, t), ") -> ", TypeOf({n}, u8)));
  }
  const std::string bytes = Emit(
      absl::StrCat("stablehlo.bitcast_convert ", v, " : (", TypeOf({count}, t),
                   ") -> ", TypeOf({count, t.bytes}, u8)));
  return Reshape(bytes, {count, t.bytes}, {n}, u8);
}

absl::StatusOr<std::string> Lowering::ReadView(const std::string& seg,
                                               uint64_t seg_bytes,
                                               uint64_t offset,
                                               const Transfer& x,
                                               const std::string& at) {
  const HloType& t = *x.type;
  const HloType& u8 = *DTypeOf(tpu::DType::kUInt8);
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
        return Unsupported(op_,
                           "a tensor whose strides are not whole elements");
      }
      strides[d] = x.byte_strides[d] / t.bytes;
      count += (x.dims[d] - 1) * strides[d];
    }
  }
  const uint64_t span =
      static_cast<uint64_t>(count) * static_cast<uint64_t>(t.bytes);
  if (offset > seg_bytes || span > seg_bytes - offset) {
    return absl::InvalidArgumentError(
        absl::StrCat(op_, ": a tensor reaches past its segment"));
  }
  std::string bytes = seg;
  if (!at.empty()) {
    bytes = Emit(absl::StrCat(
        "stablehlo.dynamic_slice ", seg, ", ", at, ", sizes = [", span, "] : (",
        TypeOf({static_cast<int64_t>(seg_bytes)}, u8), ", tensor<i64>) -> ",
        TypeOf({static_cast<int64_t>(span)}, u8)));
  } else if (offset != 0 || span != seg_bytes) {
    bytes = Emit(
        absl::StrCat("stablehlo.slice ", seg, " [", offset, ":", offset + span,
                     "] : (", TypeOf({static_cast<int64_t>(seg_bytes)}, u8),
                     ") -> ", TypeOf({static_cast<int64_t>(span)}, u8)));
  }
  const std::string flat = Decode(bytes, count, t);
  if (dense) return Reshape(flat, {count}, x.dims, t);
  const HloType& i64 = I64();
  std::string index = Constant(0, x.dims, i64);
  for (size_t d = 0; d < x.dims.size(); ++d) {
    if (x.dims[d] == 1) continue;
    index =
        Binary("add", index,
               Binary("multiply", Iota(static_cast<int64_t>(d), x.dims, i64),
                      Constant(static_cast<double>(strides[d]), x.dims, i64),
                      x.dims, i64),
               x.dims, i64);
  }
  index = Reshape(index, x.dims, {n, 1}, i64);
  const std::string picked =
      Emit(absl::StrCat("\"stablehlo.gather\"(", flat, ", ", index,
                        ") {dimension_numbers = #stablehlo.gather<",
                        "collapsed_slice_dims = [0], start_index_map = [0], "
                        "index_vector_dim = 1>, indices_are_sorted = false, ",
                        "slice_sizes = array<i64: 1>} : (", TypeOf({count}, t),
                        ", ", TypeOf({n, 1}, i64), ") -> ", TypeOf({n}, t)));
  return Reshape(picked, {n}, x.dims, t);
}

absl::StatusOr<ProgramPieces> Lowering::DeviceProgram(
    const std::vector<SegmentParam>& segs, const std::vector<int>& in_seg,
    const std::vector<uint64_t>& in_off,
    const std::vector<SegmentWrite>& writes,
    const std::vector<std::string>& extra,
    const std::vector<std::string>& extra_types, bool dynamic) {
  const HloType& u8 = *DTypeOf(tpu::DType::kUInt8);
  absl::Status failed;
  // The reads come first: the body names transfer i's value %p<i>.
  const std::string prologue = Region([&] {
    for (size_t i = 0; i < transfers_.size() && failed.ok(); ++i) {
      if (in_seg[i] < 0) continue;
      absl::StatusOr<std::string> v = ReadView(
          absl::StrCat("%s", in_seg[i]), segs[in_seg[i]].bytes, in_off[i],
          transfers_[i], dynamic ? absl::StrCat("%o", i) : "");
      if (!v.ok()) {
        failed = v.status();
        return;
      }
      absl::StrAppend(&body_, "    %p", i, " = stablehlo.reshape ", *v, " : (",
                      param_types_[i], ") -> ", param_types_[i], "\n");
    }
  });
  if (!failed.ok()) return failed;
  std::vector<std::string> now(segs.size());
  for (size_t j = 0; j < segs.size(); ++j) now[j] = absl::StrCat("%s", j);
  for (size_t wi = 0; wi < writes.size(); ++wi) {
    const SegmentWrite& w = writes[wi];
    int64_t n = 1;
    for (int64_t d : w.dims) n *= d;
    const HloType& t = *w.type;
    const int64_t seg_bytes = static_cast<int64_t>(segs[w.seg].bytes);
    const int64_t bytes = n * t.bytes;
    if (w.offset > static_cast<uint64_t>(seg_bytes) ||
        bytes > seg_bytes - static_cast<int64_t>(w.offset)) {
      return absl::InvalidArgumentError(
          absl::StrCat(op_, ": a result reaches past its segment"));
    }
    const std::string enc = Encode(Reshape(w.value, w.dims, {n}, t), n, t);
    const std::string at =
        dynamic ? absl::StrCat("%w", wi)
                : Emit(absl::StrCat("stablehlo.constant dense<", w.offset,
                                    "> : tensor<i64>"));
    now[w.seg] = Emit(absl::StrCat(
        "stablehlo.dynamic_update_slice ", now[w.seg], ", ", enc, ", ", at,
        " : (", TypeOf({seg_bytes}, u8), ", ", TypeOf({bytes}, u8),
        ", tensor<i64>) -> ", TypeOf({seg_bytes}, u8)));
  }
  ProgramPieces program;
  for (size_t j = 0; j < segs.size(); ++j) {
    program.params.push_back({absl::StrCat("%s", j),
                              TypeOf({static_cast<int64_t>(segs[j].bytes)}, u8),
                              segs[j].result});
  }
  // Donated segments are results in the order of their `result`.
  std::vector<std::pair<int, size_t>> order;
  for (size_t j = 0; j < segs.size(); ++j) {
    if (segs[j].result >= 0) order.emplace_back(segs[j].result, j);
  }
  std::sort(order.begin(), order.end());
  for (const auto& [r, j] : order) {
    program.results.push_back(now[j]);
    program.result_types.push_back(
        TypeOf({static_cast<int64_t>(segs[j].bytes)}, u8));
  }
  for (size_t i = 0; i < transfers_.size(); ++i) {
    if (in_seg[i] < 0)
      program.params.push_back({absl::StrCat("%p", i), param_types_[i]});
  }
  if (dynamic) {
    for (size_t i = 0; i < transfers_.size(); ++i) {
      if (in_seg[i] >= 0)
        program.params.push_back({absl::StrCat("%o", i), "tensor<i64>"});
    }
    for (size_t wi = 0; wi < writes.size(); ++wi)
      program.params.push_back({absl::StrCat("%w", wi), "tensor<i64>"});
  }
  program.results.insert(program.results.end(), extra.begin(), extra.end());
  program.result_types.insert(program.result_types.end(), extra_types.begin(),
                              extra_types.end());
  program.body = absl::StrCat(prologue, body_);
  return program;
}

}  // namespace tpud::pjrt
