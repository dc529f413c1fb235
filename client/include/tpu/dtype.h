// Element types as they travel on the wire: c10::ScalarType's numbering
// (the wire's `i8 dtype`), with the facts every layer needs. This is the one
// table of them; the client library, the daemon, its executors, the PJRT
// backend and the tests read dtypes here instead of spelling the numbers.
//
// Backend-specific facts (a StableHLO type name, a PJRT buffer type) stay in
// the backend, keyed by DType.
#ifndef TPU_DTYPE_H_
#define TPU_DTYPE_H_

#include <cstdint>
#include <cstring>

namespace tpu {

// c10::ScalarType values. Quantized (12-14, 16) and sub-byte (17-22) types
// are not carried by tpud.
enum class DType : int8_t {
  kUInt8 = 0,
  kInt8 = 1,
  kInt16 = 2,
  kInt32 = 3,
  kInt64 = 4,
  kHalf = 5,
  kFloat = 6,
  kDouble = 7,
  kComplexHalf = 8,
  kComplexFloat = 9,
  kComplexDouble = 10,
  kBool = 11,
  kBFloat16 = 15,
  kFloat8E5M2 = 23,
  kFloat8E4M3FN = 24,
  kFloat8E5M2FNUZ = 25,
  kFloat8E4M3FNUZ = 26,
  kUInt16 = 27,
  kUInt32 = 28,
  kUInt64 = 29,
};

// The wire code of a dtype, and the dtype of a wire code.
constexpr int8_t Code(DType t) { return static_cast<int8_t>(t); }
constexpr DType DTypeFromCode(int8_t code) { return static_cast<DType>(code); }

// Bytes per element; 0 for a code tpud does not carry (quantized, sub-byte,
// unknown).
constexpr int ElementSizeOf(DType t) {
  switch (t) {
    case DType::kUInt8:
    case DType::kInt8:
    case DType::kBool:
    case DType::kFloat8E5M2:
    case DType::kFloat8E4M3FN:
    case DType::kFloat8E5M2FNUZ:
    case DType::kFloat8E4M3FNUZ:
      return 1;
    case DType::kInt16:
    case DType::kHalf:
    case DType::kBFloat16:
    case DType::kUInt16:
      return 2;
    case DType::kInt32:
    case DType::kFloat:
    case DType::kComplexHalf:
    case DType::kUInt32:
      return 4;
    case DType::kInt64:
    case DType::kDouble:
    case DType::kComplexFloat:
    case DType::kUInt64:
      return 8;
    case DType::kComplexDouble:
      return 16;
  }
  return 0;
}

// PyTorch's name of the dtype ("float32", "bfloat16"), for messages;
// "an unknown dtype" for a code tpud does not carry.
constexpr const char* DTypeName(DType t) {
  switch (t) {
    case DType::kUInt8:
      return "uint8";
    case DType::kInt8:
      return "int8";
    case DType::kInt16:
      return "int16";
    case DType::kInt32:
      return "int32";
    case DType::kInt64:
      return "int64";
    case DType::kHalf:
      return "float16";
    case DType::kFloat:
      return "float32";
    case DType::kDouble:
      return "float64";
    case DType::kComplexHalf:
      return "complex32";
    case DType::kComplexFloat:
      return "complex64";
    case DType::kComplexDouble:
      return "complex128";
    case DType::kBool:
      return "bool";
    case DType::kBFloat16:
      return "bfloat16";
    case DType::kFloat8E5M2:
      return "float8_e5m2";
    case DType::kFloat8E4M3FN:
      return "float8_e4m3fn";
    case DType::kFloat8E5M2FNUZ:
      return "float8_e5m2fnuz";
    case DType::kFloat8E4M3FNUZ:
      return "float8_e4m3fnuz";
    case DType::kUInt16:
      return "uint16";
    case DType::kUInt32:
      return "uint32";
    case DType::kUInt64:
      return "uint64";
  }
  return "an unknown dtype";
}

constexpr bool IsFloating(DType t) {
  switch (t) {
    case DType::kHalf:
    case DType::kFloat:
    case DType::kDouble:
    case DType::kBFloat16:
    case DType::kFloat8E5M2:
    case DType::kFloat8E4M3FN:
    case DType::kFloat8E5M2FNUZ:
    case DType::kFloat8E4M3FNUZ:
      return true;
    default:
      return false;
  }
}

constexpr bool IsComplex(DType t) {
  return t == DType::kComplexHalf || t == DType::kComplexFloat ||
         t == DType::kComplexDouble;
}

// Integral types, bool included (as c10's isIntegralType(t, true)).
constexpr bool IsIntegral(DType t) {
  switch (t) {
    case DType::kUInt8:
    case DType::kInt8:
    case DType::kInt16:
    case DType::kInt32:
    case DType::kInt64:
    case DType::kBool:
    case DType::kUInt16:
    case DType::kUInt32:
    case DType::kUInt64:
      return true;
    default:
      return false;
  }
}

// The real type of a complex type's parts (float32 for complex64), and the
// complex type whose parts are a real floating type.
constexpr DType PartOf(DType complex) {
  return complex == DType::kComplexDouble ? DType::kDouble
         : complex == DType::kComplexHalf ? DType::kHalf
                                          : DType::kFloat;
}
constexpr DType ComplexOf(DType real) {
  return real == DType::kDouble ? DType::kComplexDouble
         : real == DType::kHalf ? DType::kComplexHalf
                                : DType::kComplexFloat;
}

// IEEE half and bfloat16 bit patterns to float and back (round to nearest
// even; every half and bfloat16 value is a float exactly).
inline float HalfToFloat(uint16_t bits) {
  _Float16 h;
  std::memcpy(&h, &bits, 2);
  return static_cast<float>(h);
}
inline uint16_t FloatToHalf(float f) {
  const _Float16 h = static_cast<_Float16>(f);
  uint16_t bits;
  std::memcpy(&bits, &h, 2);
  return bits;
}
inline float BFloat16ToFloat(uint16_t bits) {
  const uint32_t wide = static_cast<uint32_t>(bits) << 16;
  float f;
  std::memcpy(&f, &wide, 4);
  return f;
}
inline uint16_t FloatToBFloat16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  if (f != f) return 0x7fc0;            // NaN stays a quiet NaN
  bits += 0x7fff + ((bits >> 16) & 1);  // round to nearest even
  return static_cast<uint16_t>(bits >> 16);
}

}  // namespace tpu

#endif  // TPU_DTYPE_H_
