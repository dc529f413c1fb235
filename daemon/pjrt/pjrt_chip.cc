#include "daemon/pjrt/pjrt_chip.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <functional>
#include <map>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
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
};
const DType* DTypeOf(int8_t c10) {
  for (const DType& d : kDTypes) {
    if (d.c10 == c10) return &d;
  }
  return nullptr;
}
const DType& F64() { return *DTypeOf(7); }
const DType& I64() { return *DTypeOf(4); }

std::string TypeOf(const std::vector<int64_t>& dims, const DType& t) {
  std::string s = "tensor<";
  for (int64_t d : dims) absl::StrAppend(&s, d, "x");
  return absl::StrCat(s, t.mlir, ">");
}

// The op's error: its name, then why.
absl::Status Unsupported(const std::string& op, const std::string& why) {
  return absl::UnimplementedError(absl::StrCat(op, ": ", why, " (PJRT backend)"));
}

class PjrtOp : public BackendOp {
 public:
  // written: the argument the op writes ("Tensor(a!) self" of an in-place
  // op, "Tensor(a!) out" of an out= op), or -1.
  PjrtOp(std::string schema, std::string name, int written)
      : schema_(std::move(schema)), name_(std::move(name)), written_(written) {}
  const std::string& schema() const override { return schema_; }
  const std::string& name() const { return name_; }
  int written() const { return written_; }
  bool WritesArgument(size_t index) const override {
    return written_ >= 0 && index == static_cast<size_t>(written_);
  }
  bool OverwritesArgument(size_t index) const override {
    if (!WritesArgument(index)) return false;
    // out= tensors and the targets of copy_, fill_ and zero_ are not read.
    return index > 0 || name_ == "aten::copy_" || name_ == "aten::fill_.Scalar" ||
           name_ == "aten::zero_";
  }

 private:
  std::string schema_;
  std::string name_;  // "aten::add_.Tensor"
  int written_;
};

// The index of the first argument annotated "(a!)" in `schema`, or -1.
int WrittenArgument(absl::string_view schema) {
  const size_t open = schema.find('(');
  if (open == absl::string_view::npos) return -1;
  int depth = 0, index = 0;
  bool any = false;
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
        if (arg.find("(a!)") != absl::string_view::npos) return index;
        ++index;
        any = true;
      }
      start = i + 1;
      if (c == ')') break;
    }
  }
  (void)any;
  return -1;
}

// A host transfer into one program parameter.
struct Transfer {
  const char* data = nullptr;
  const DType* type = nullptr;
  std::vector<int64_t> dims;
  std::vector<int64_t> byte_strides;
  double scalar_d = 0;  // scalars: the value (data points here)
  int64_t scalar_i = 0;
};

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
      return absl::InvalidArgumentError(
          absl::StrCat(op_, ": a tensor reaches past the end of its segment"));
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

  std::string Convert(const std::string& v, const std::vector<int64_t>& dims, const DType& from,
                      const DType& to) {
    if (from.c10 == to.c10) return v;
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
    const std::string lit = t.is_float ? absl::StrCat(value, value == static_cast<int64_t>(value) ? ".0" : "")
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

  std::string Text(const std::string& result, const std::string& type) const {
    std::vector<std::string> params;
    for (size_t i = 0; i < param_types_.size(); ++i) {
      params.push_back(absl::StrCat("%p", i, ": ", param_types_[i]));
    }
    return absl::StrCat("module @tpud_op {\n  func.func public @main(", absl::StrJoin(params, ", "),
                        ") -> ", type, " {\n", body_, "    return ", result, " : ", type,
                        "\n  }\n}\n");
  }

  std::vector<Transfer>& transfers() { return transfers_; }
  const std::string& op() const { return op_; }

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
};

struct Target {
  const tpu::TensorRef* ref;
  std::vector<int64_t> dims;
  const DType* type;
};

using Rule = std::function<absl::StatusOr<std::string>(Lowering&, const tpu::DecodedOp&,
                                                       const Target&)>;

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
  if (listed) {
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
    for (const char* suffix : {"", "_"}) {
      const std::string s = suffix;
      (*m)["aten::add" + s + ".Tensor"] = BinaryRule("add", true);
      (*m)["aten::add" + s + ".Scalar"] = BinaryRule("add", true);
      (*m)["aten::sub" + s + ".Tensor"] = BinaryRule("subtract", true);
      (*m)["aten::sub" + s + ".Scalar"] = BinaryRule("subtract", true);
      (*m)["aten::mul" + s + ".Tensor"] = BinaryRule("multiply", false);
      (*m)["aten::mul" + s + ".Scalar"] = BinaryRule("multiply", false);
      (*m)["aten::div" + s + ".Tensor"] = BinaryRule("divide", false);
      (*m)["aten::div" + s + ".Scalar"] = BinaryRule("divide", false);
      (*m)["aten::neg" + s] = Simple("negate");
      (*m)["aten::exp" + s] = Simple("exponential");
      (*m)["aten::log" + s] = Simple("log");
      (*m)["aten::tanh" + s] = Simple("tanh");
      (*m)["aten::sqrt" + s] = Simple("sqrt");
      (*m)["aten::rsqrt" + s] = Simple("rsqrt");
      (*m)["aten::abs" + s] = Simple("abs");
      (*m)["aten::sin" + s] = Simple("sine");
      (*m)["aten::cos" + s] = Simple("cosine");
      (*m)["aten::sigmoid" + s] = Simple("logistic");
      (*m)["aten::relu" + s] = UnaryRule([](Lowering& l, const std::string& a, const Target& o) {
        return l.Binary("maximum", a, l.Constant(0, o.dims, *o.type), o.dims, *o.type);
      });
    }
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
    // out= overloads lower as their functional op does (the out tensor is
    // the written argument, after the others).
    const std::pair<const char*, const char*> outs[] = {
        {"aten::add.out", "aten::add.Tensor"},     {"aten::sub.out", "aten::sub.Tensor"},
        {"aten::mul.out", "aten::mul.Tensor"},     {"aten::div.out", "aten::div.Tensor"},
        {"aten::neg.out", "aten::neg"},            {"aten::exp.out", "aten::exp"},
        {"aten::log.out", "aten::log"},            {"aten::tanh.out", "aten::tanh"},
        {"aten::sqrt.out", "aten::sqrt"},          {"aten::rsqrt.out", "aten::rsqrt"},
        {"aten::abs.out", "aten::abs"},            {"aten::sin.out", "aten::sin"},
        {"aten::cos.out", "aten::cos"},            {"aten::sigmoid.out", "aten::sigmoid"},
        {"aten::maximum.out", "aten::maximum"},    {"aten::minimum.out", "aten::minimum"},
        {"aten::mm.out", "aten::mm"},              {"aten::addmm.out", "aten::addmm"},
        {"aten::sum.IntList_out", "aten::sum.dim_IntList"},
        {"aten::mean.out", "aten::mean.dim"},
        {"aten::threshold_backward.grad_input", "aten::threshold_backward"},
        {"aten::pow.Tensor_Scalar_out", "aten::pow.Tensor_Scalar"},
        {"aten::pow.Tensor_Tensor_out", "aten::pow.Tensor_Tensor"},
    };
    for (const auto& [out, functional] : outs) (*m)[out] = (*m)[functional];
    return m;
  }();
  return *rules;
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
absl::Status ReadScalar(const std::string& op, const tpu::DecodedOp& decoded,
                        const std::vector<ResolvedTensor>& tensors,
                        std::vector<ResultValue>* results) {
  if (decoded.num_args < 1 || decoded.args[0].tag != tpu::ArgTag::kTensor) {
    return Unsupported(op, "expects a tensor");
  }
  const tpu::TensorRef& ref = decoded.args[0].tensor;
  int64_t numel = 1;
  for (int d = 0; d < ref.ndim; ++d) numel *= ref.sizes[d];
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
  switch (ref.dtype) {
    case 0: v.kind = ResultValue::Kind::kInt; v.i = get(uint8_t{}); break;
    case 1: v.kind = ResultValue::Kind::kInt; v.i = get(int8_t{}); break;
    case 2: v.kind = ResultValue::Kind::kInt; v.i = get(int16_t{}); break;
    case 3: v.kind = ResultValue::Kind::kInt; v.i = get(int32_t{}); break;
    case 4: v.kind = ResultValue::Kind::kInt; v.i = get(int64_t{}); break;
    case 6: v.kind = ResultValue::Kind::kDouble; v.d = get(float{}); break;
    case 7: v.kind = ResultValue::Kind::kDouble; v.d = get(double{}); break;
    case 11: v.kind = ResultValue::Kind::kBool; v.b = get(uint8_t{}) != 0; break;
    default: return Unsupported(op, absl::StrCat("reading a scalar of dtype ", int(ref.dtype)));
  }
  results->push_back(v);
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::unique_ptr<PjrtChip>> PjrtChip::Create(
    const std::string& plugin_path, const std::vector<CreateOption>& options,
    size_t cache_capacity) {
  absl::StatusOr<std::unique_ptr<PjrtPlugin>> p = PjrtPlugin::Load(plugin_path, options);
  if (!p.ok()) return p.status();
  return std::unique_ptr<PjrtChip>(new PjrtChip(*std::move(p), std::max<size_t>(1, cache_capacity)));
}

std::string PjrtChip::Describe() const { return absl::StrCat("PJRT (", plugin_->Describe(), ")"); }

absl::StatusOr<std::shared_ptr<const BackendOp>> PjrtChip::LookupOp(absl::string_view schema) {
  const size_t paren = schema.find('(');
  if (paren == absl::string_view::npos || paren == 0) {
    return absl::InvalidArgumentError(absl::StrCat("not an operator schema: ", schema));
  }
  std::string name(schema.substr(0, paren));
  const size_t colons = name.find("::");
  // Every op is accepted here; one without a lowering fails when it runs,
  // naming itself (so a session can go on with the ops that have one).
  return std::make_shared<PjrtOp>(std::string(schema), std::move(name), WrittenArgument(schema));
}

absl::StatusOr<const Executable*> PjrtChip::Compiled(const std::string& program, int device) {
  CompileStats& st = stats_[device];
  auto it = cache_.find(program);
  if (it != cache_.end()) {
    lru_.splice(lru_.end(), lru_, it->second);
    ++st.hits;
    return it->second->second.get();
  }
  const auto t0 = std::chrono::steady_clock::now();
  absl::StatusOr<std::unique_ptr<Executable>> exe = plugin_->Compile(program);
  st.compile_ns += std::chrono::duration_cast<std::chrono::nanoseconds>(
                       std::chrono::steady_clock::now() - t0).count();
  ++st.compiles;
  if (!exe.ok()) return exe.status();
  if (lru_.size() >= capacity_) {
    cache_.erase(lru_.front().first);
    lru_.pop_front();
    ++evictions_;
  }
  lru_.emplace_back(program, *std::move(exe));
  cache_[program] = std::prev(lru_.end());
  return lru_.back().second.get();
}

absl::Status PjrtChip::Run(const BackendOp& base, const tpu::DecodedOp& decoded,
                           const std::vector<ResolvedTensor>& tensors,
                           std::vector<ResultValue>* results, ResultAllocator*) {
  const auto& op = static_cast<const PjrtOp&>(base);
  if (op.name() == "aten::_local_scalar_dense") return ReadScalar(op.name(), decoded, tensors, results);
  auto rule = Rules().find(op.name());
  if (rule == Rules().end()) {
    return Unsupported(op.name(), "no lowering to StableHLO yet");
  }
  // Where the result goes: self for in-place ops, else the op's output.
  Target out;
  size_t out_index = 0;  // its TensorRef's position in `tensors`
  Lowering l(op.name(), decoded, tensors);
  if (op.written() >= 0) {
    const size_t w = static_cast<size_t>(op.written());
    if (w >= decoded.num_args || decoded.args[w].tag != tpu::ArgTag::kTensor) {
      return Unsupported(op.name(), "writing something that is not a tensor");
    }
    out.ref = &decoded.args[w].tensor;
    out_index = l.TensorIndex(decoded.args[w]);
  } else {
    if (decoded.outputs.size() != 1) {
      return Unsupported(op.name(), absl::StrCat(decoded.outputs.size(), " outputs"));
    }
    out.ref = &decoded.outputs[0];
    out_index = tensors.size() - 1;
  }
  out.type = DTypeOf(out.ref->dtype);
  if (out.type == nullptr) {
    return Unsupported(op.name(), absl::StrCat("output dtype ", int(out.ref->dtype), " is not lowered"));
  }
  out.dims.assign(out.ref->sizes, out.ref->sizes + out.ref->ndim);
  // A written tensor whose layout is dense in some order of its dimensions
  // (a transpose, channels-last) gets the result transposed into that order.
  std::vector<int64_t> order;
  if (!Contiguous(*out.ref)) {
    for (int d = 0; d < out.ref->ndim; ++d) order.push_back(d);
    std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) {
      return out.ref->strides[a] > out.ref->strides[b];
    });
    int64_t expect = 1;
    for (int i = out.ref->ndim - 1; i >= 0; --i) {
      const int64_t d = order[i];
      if (out.ref->sizes[d] != 1 && out.ref->strides[d] != expect) {
        return Unsupported(op.name(), "writing a tensor whose layout has gaps or overlaps");
      }
      expect *= out.ref->sizes[d];
    }
  }
  for (size_t i = 0; i < decoded.num_args; ++i) {
    const tpu::ArgTag t = decoded.args[i].tag;
    if (t == tpu::ArgTag::kTensorList || t == tpu::ArgTag::kOptionalTensorList) {
      return Unsupported(op.name(), "tensor lists are not lowered yet");
    }
  }
  absl::StatusOr<char*> dst = l.HostOf(*out.ref, out_index);
  if (!dst.ok()) return dst.status();
  absl::StatusOr<std::string> value = rule->second(l, decoded, out);
  if (!value.ok()) return value.status();
  std::string result = *value;
  std::vector<int64_t> stored = out.dims;
  if (!order.empty()) {
    for (size_t i = 0; i < order.size(); ++i) stored[i] = out.dims[order[i]];
    result = l.Emit(absl::StrCat("stablehlo.transpose ", result, ", dims = [",
                                 absl::StrJoin(order, ", "), "] : (", TypeOf(out.dims, *out.type),
                                 ") -> ", TypeOf(stored, *out.type)));
  }
  const std::string program = l.Text(result, TypeOf(stored, *out.type));
  // The chip is the output's.
  const int device = tpu::DeviceAddressChip(out.ref->address);
  if (device < 0 || device >= plugin_->num_devices()) {
    return absl::InvalidArgumentError(absl::StrCat(op.name(), ": output on chip ", device,
                                                   ", which has no device"));
  }
  absl::StatusOr<const Executable*> exe = Compiled(program, device);
  if (!exe.ok()) {
    return absl::Status(exe.status().code(), absl::StrCat(op.name(), ": ", exe.status().message()));
  }
  std::vector<Buffer> inputs;
  std::vector<PJRT_Buffer*> args;
  for (Transfer& x : l.transfers()) {
    const void* data = x.data;
    if (data == nullptr) data = x.type->is_float ? static_cast<const void*>(&x.scalar_d)
                                                 : static_cast<const void*>(&x.scalar_i);
    absl::StatusOr<Buffer> b = plugin_->FromHost(device, data, x.type->pjrt, x.dims, x.byte_strides);
    if (!b.ok()) return absl::Status(b.status().code(), absl::StrCat(op.name(), ": ", b.status().message()));
    args.push_back(b->get());
    inputs.push_back(*std::move(b));
  }
  absl::StatusOr<std::vector<Buffer>> outs = plugin_->Execute(**exe, device, args);
  if (!outs.ok()) {
    return absl::Status(outs.status().code(), absl::StrCat(op.name(), ": ", outs.status().message()));
  }
  int64_t numel = 1;
  for (int64_t d : out.dims) numel *= d;
  const size_t bytes = static_cast<size_t>(numel) * out.type->bytes;
  if (bytes > 0) {
    if (absl::Status st = plugin_->ToHost((*outs)[0], *dst, bytes); !st.ok()) {
      return absl::Status(st.code(), absl::StrCat(op.name(), ": ", st.message()));
    }
  }
  if (results != nullptr) {
    ResultValue v;
    v.kind = ResultValue::Kind::kTensor;
    v.tensor = *out.ref;
    results->push_back(v);
  }
  return absl::OkStatus();
}

}  // namespace tpud::pjrt
