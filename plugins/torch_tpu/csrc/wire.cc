// Encoding ATen values into op records: what a tensor, a host scalar or an
// argument of any schema type becomes on the wire (see wire.h).
#include "wire.h"

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>

#include <mutex>
#include <unordered_map>

#include "generator.h"
#include "runtime.h"

namespace torch_tpu {
namespace {

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

// A tensor argument's wire form, written into `a` (just reset): a host
// scalar travels by value, a device tensor as a TensorRef.
void TensorToWire(const at::Tensor& t, tpu::OpArg& a) {
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

}  // namespace

void RefInto(const at::Tensor& t, tpu::TensorRef* r) {
  // The wire format has no lazy conjugate/negative bits: refuse rather than
  // compute with the bit silently dropped.
  TORCH_CHECK(
      !t.is_conj() && !t.is_neg(), "tpu: a tensor with a lazy ",
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

// The value of a host scalar tensor (a Python number wrapped by an op like
// `x + 1`, or a CPU 0-dim tensor), read from its memory. Going through
// item() would dispatch _local_scalar_dense twice per op (signature key and
// wire argument); item() stays for what it alone handles (lazy bits, types
// read rarely, and its error for more than one element).
at::Scalar HostScalarValue(const at::Tensor& t) {
  if (t.numel() != 1 || t.is_conj() || t.is_neg()) return t.item();
  const void* p = t.const_data_ptr();
  switch (t.scalar_type()) {
    case at::kDouble:
      return at::Scalar(*static_cast<const double*>(p));
    case at::kFloat:
      return at::Scalar(*static_cast<const float*>(p));
    case at::kLong:
      return at::Scalar(*static_cast<const int64_t*>(p));
    case at::kInt:
      return at::Scalar(*static_cast<const int32_t*>(p));
    case at::kBool:
      return at::Scalar(*static_cast<const bool*>(p));
    default:
      return t.item();
  }
}

void ArgToWire(const c10::IValue& v, const c10::FunctionSchema& schema,
               size_t index, c10::DeviceIndex device, tpu::OpArg& a) {
  const c10::Argument& formal = schema.arguments()[index];
  ResetArg(a);
  c10::TypePtr type = formal.real_type();
  if (type->kind() == c10::TypeKind::OptionalType) {
    if (v.isNone() &&
        type->containedType(0)->kind() != c10::TypeKind::GeneratorType) {
      a.tag = tpu::ArgTag::kNone;
      return;
    }
    type = type->containedType(0);
  }
  switch (type->kind()) {
    case c10::TypeKind::TensorType:
      TensorToWire(v.isNone() ? at::Tensor() : v.toTensor(), a);
      return;
    case c10::TypeKind::GeneratorType: {
      // The seed this op uses, drawn from the chosen generator here.
      at::Generator gen =
          v.isGenerator() ? v.toGenerator() : DefaultGenerator(device);
      std::lock_guard<std::mutex> lock(gen.mutex());
      auto* tg = dynamic_cast<TpuGenerator*>(gen.unsafeGetGeneratorImpl());
      TORCH_CHECK(tg != nullptr, "tpu: ", schema.name(), ": argument ", index,
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
      if (elem->kind() == c10::TypeKind::IntType ||
          elem->kind() == c10::TypeKind::SymIntType) {
        a.tag = tpu::ArgTag::kIntList;
        if (v.isIntList()) {
          a.ints = v.toIntVector();
        } else {
          for (const c10::IValue& e : v.toListRef())
            a.ints.push_back(e.toSymInt().expect_int());
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
        for (const at::Tensor& t : v.toTensorList())
          a.tensors.push_back(RefOf(t));
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
  TORCH_CHECK(false, "tpu: ", schema.name(), ": cannot forward argument ",
              index, " (", formal.name(), ") of type ", formal.type()->str());
}

// Interned op ids, per operator (the schema string is built once).
uint32_t OpIdFor(const c10::FunctionSchema& schema) {
  static std::mutex mu;
  static auto* ids =
      new std::unordered_map<const c10::FunctionSchema*, uint32_t>();
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

}  // namespace torch_tpu
