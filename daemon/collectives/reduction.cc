#include "daemon/collectives/reduction.h"

#include <cmath>
#include <complex>
#include <limits>
#include <type_traits>

#include "absl/strings/str_cat.h"

namespace tpud {
namespace {

using tpu::DType;
using tpu::ReduceOp;

template <typename T>
T Apply(ReduceOp op, T a, T b) {
  switch (op) {
    case ReduceOp::kSum:
    case ReduceOp::kAvg:
      return static_cast<T>(a + b);
    case ReduceOp::kProduct:
      return static_cast<T>(a * b);
    case ReduceOp::kMin:
      // NaN propagates, as torch's minimum does.
      if constexpr (std::is_floating_point_v<T>) {
        if (std::isnan(a) || std::isnan(b))
          return std::numeric_limits<T>::quiet_NaN();
      }
      return b < a ? b : a;
    case ReduceOp::kMax:
      if constexpr (std::is_floating_point_v<T>) {
        if (std::isnan(a) || std::isnan(b))
          return std::numeric_limits<T>::quiet_NaN();
      }
      return a < b ? b : a;
    case ReduceOp::kBand:
    case ReduceOp::kBor:
    case ReduceOp::kBxor:
      // Integers only (CheckReducible); ReduceTyped does them.
      break;
  }
  return a;
}

template <typename T>
void ReduceTyped(ReduceOp op, char* dst, const char* src, uint64_t count) {
  T* d = reinterpret_cast<T*>(dst);
  const T* s = reinterpret_cast<const T*>(src);
  switch (op) {
    case ReduceOp::kSum:
    case ReduceOp::kAvg:
      for (uint64_t i = 0; i < count; ++i) d[i] = static_cast<T>(d[i] + s[i]);
      return;
    case ReduceOp::kProduct:
      for (uint64_t i = 0; i < count; ++i) d[i] = static_cast<T>(d[i] * s[i]);
      return;
    case ReduceOp::kBand:
    case ReduceOp::kBor:
    case ReduceOp::kBxor:
      if constexpr (std::is_integral_v<T>) {
        if (op == ReduceOp::kBand) {
          for (uint64_t i = 0; i < count; ++i) d[i] &= s[i];
        } else if (op == ReduceOp::kBor) {
          for (uint64_t i = 0; i < count; ++i) d[i] |= s[i];
        } else {
          for (uint64_t i = 0; i < count; ++i) d[i] ^= s[i];
        }
      }
      return;  // floating types: refused by CheckReducible
    default:
      for (uint64_t i = 0; i < count; ++i) d[i] = Apply(op, d[i], s[i]);
  }
}

template <typename T>
void ReduceComplex(ReduceOp op, char* dst, const char* src, uint64_t count) {
  auto* d = reinterpret_cast<std::complex<T>*>(dst);
  const auto* s = reinterpret_cast<const std::complex<T>*>(src);
  if (op == ReduceOp::kProduct) {
    for (uint64_t i = 0; i < count; ++i) d[i] *= s[i];
  } else {
    for (uint64_t i = 0; i < count; ++i) d[i] += s[i];
  }
}

template <float (*ToFloat)(uint16_t), uint16_t (*FromFloat)(float)>
void ReduceHalfLike(ReduceOp op, char* dst, const char* src, uint64_t count) {
  auto* d = reinterpret_cast<uint16_t*>(dst);
  const auto* s = reinterpret_cast<const uint16_t*>(src);
  for (uint64_t i = 0; i < count; ++i)
    d[i] = FromFloat(Apply(op, ToFloat(d[i]), ToFloat(s[i])));
}

void ReduceBool(ReduceOp op, char* dst, const char* src, uint64_t count) {
  // As torch's NCCL backend: sum and max are "or", product and min "and";
  // the bitwise ops are their logical selves (as gloo's).
  auto* d = reinterpret_cast<uint8_t*>(dst);
  const auto* s = reinterpret_cast<const uint8_t*>(src);
  switch (op) {
    case ReduceOp::kSum:
    case ReduceOp::kMax:
    case ReduceOp::kBor:
      for (uint64_t i = 0; i < count; ++i) d[i] = (d[i] | s[i]) != 0;
      return;
    case ReduceOp::kBxor:
      for (uint64_t i = 0; i < count; ++i) d[i] = (d[i] != 0) != (s[i] != 0);
      return;
    default:  // product, min, band (avg is refused)
      for (uint64_t i = 0; i < count; ++i) d[i] = d[i] != 0 && s[i] != 0;
  }
}

template <typename T>
void DivideTyped(char* dst, uint64_t count, uint64_t n) {
  T* d = reinterpret_cast<T*>(dst);
  for (uint64_t i = 0; i < count; ++i)
    d[i] = static_cast<T>(d[i] / static_cast<T>(n));
}

}  // namespace

absl::Status CheckReducible(DType dtype, ReduceOp op) {
  const bool bitwise =
      op == ReduceOp::kBand || op == ReduceOp::kBor || op == ReduceOp::kBxor;
  auto refuse = [&](const char* why) {
    return absl::InvalidArgumentError(
        absl::StrCat(tpu::ReduceOpName(op), " cannot reduce ",
                     tpu::DTypeName(dtype), " tensors (", why, ")"));
  };
  constexpr char kBitwise[] = "bitwise ops take integer and bool tensors";
  switch (dtype) {
    case DType::kUInt8:
    case DType::kInt8:
    case DType::kInt16:
    case DType::kInt32:
    case DType::kInt64:
    case DType::kUInt16:
    case DType::kUInt32:
    case DType::kUInt64:
      return absl::OkStatus();
    case DType::kHalf:
    case DType::kFloat:
    case DType::kDouble:
    case DType::kBFloat16:
      if (bitwise) return refuse(kBitwise);
      return absl::OkStatus();
    case DType::kBool:
      if (op == ReduceOp::kAvg) {
        return absl::InvalidArgumentError("avg cannot reduce bool tensors");
      }
      return absl::OkStatus();
    case DType::kComplexFloat:
    case DType::kComplexDouble:
      if (op == ReduceOp::kMin || op == ReduceOp::kMax)
        return refuse("complex numbers have no order");
      if (bitwise) return refuse(kBitwise);
      return absl::OkStatus();
    default:
      return absl::InvalidArgumentError(
          absl::StrCat("reductions of ", tpu::DTypeName(dtype),
                       " tensors are not supported (gather, broadcast and "
                       "all_to_all move them)"));
  }
}

void ReduceInto(DType dtype, ReduceOp op, char* dst, const char* src,
                uint64_t count) {
  switch (dtype) {
    case DType::kUInt8:
      return ReduceTyped<uint8_t>(op, dst, src, count);
    case DType::kInt8:
      return ReduceTyped<int8_t>(op, dst, src, count);
    case DType::kInt16:
      return ReduceTyped<int16_t>(op, dst, src, count);
    case DType::kInt32:
      return ReduceTyped<int32_t>(op, dst, src, count);
    case DType::kInt64:
      return ReduceTyped<int64_t>(op, dst, src, count);
    case DType::kUInt16:
      return ReduceTyped<uint16_t>(op, dst, src, count);
    case DType::kUInt32:
      return ReduceTyped<uint32_t>(op, dst, src, count);
    case DType::kUInt64:
      return ReduceTyped<uint64_t>(op, dst, src, count);
    case DType::kFloat:
      return ReduceTyped<float>(op, dst, src, count);
    case DType::kDouble:
      return ReduceTyped<double>(op, dst, src, count);
    case DType::kHalf:
      return ReduceHalfLike<tpu::HalfToFloat, tpu::FloatToHalf>(op, dst, src,
                                                                count);
    case DType::kBFloat16:
      return ReduceHalfLike<tpu::BFloat16ToFloat, tpu::FloatToBFloat16>(
          op, dst, src, count);
    case DType::kComplexFloat:
      return ReduceComplex<float>(op, dst, src, count);
    case DType::kComplexDouble:
      return ReduceComplex<double>(op, dst, src, count);
    case DType::kBool:
      return ReduceBool(op, dst, src, count);
    default:
      return;  // refused by CheckReducible
  }
}

void DivideBy(DType dtype, char* dst, uint64_t count, uint64_t n) {
  switch (dtype) {
    case DType::kUInt8:
      return DivideTyped<uint8_t>(dst, count, n);
    case DType::kInt8:
      return DivideTyped<int8_t>(dst, count, n);
    case DType::kInt16:
      return DivideTyped<int16_t>(dst, count, n);
    case DType::kInt32:
      return DivideTyped<int32_t>(dst, count, n);
    case DType::kInt64:
      return DivideTyped<int64_t>(dst, count, n);
    case DType::kUInt16:
      return DivideTyped<uint16_t>(dst, count, n);
    case DType::kUInt32:
      return DivideTyped<uint32_t>(dst, count, n);
    case DType::kUInt64:
      return DivideTyped<uint64_t>(dst, count, n);
    case DType::kFloat:
      return DivideTyped<float>(dst, count, n);
    case DType::kDouble:
      return DivideTyped<double>(dst, count, n);
    case DType::kComplexFloat:
      return DivideTyped<std::complex<float>>(dst, count, n);
    case DType::kComplexDouble:
      return DivideTyped<std::complex<double>>(dst, count, n);
    case DType::kHalf: {
      auto* d = reinterpret_cast<uint16_t*>(dst);
      for (uint64_t i = 0; i < count; ++i)
        d[i] = tpu::FloatToHalf(tpu::HalfToFloat(d[i]) / n);
      return;
    }
    case DType::kBFloat16: {
      auto* d = reinterpret_cast<uint16_t*>(dst);
      for (uint64_t i = 0; i < count; ++i)
        d[i] = tpu::FloatToBFloat16(tpu::BFloat16ToFloat(d[i]) / n);
      return;
    }
    default:
      return;
  }
}

}  // namespace tpud
