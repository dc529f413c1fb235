#include "daemon/collectives/reduction.h"

#include <cstdint>
#include <vector>

#include "catch2_compat/catch.h"

namespace tpud {
namespace {

using tpu::DType;
using tpu::ReduceOp;

TEST_CASE("ReduceInto per dtype and op") {
  SECTION("float32 sum, product, min, max") {
    std::vector<float> a{1, -2, 3}, b{4, 5, -6};
    auto run = [&](ReduceOp op) {
      std::vector<float> d = a;
      ReduceInto(DType::kFloat, op, reinterpret_cast<char*>(d.data()),
                 reinterpret_cast<char*>(b.data()), 3);
      return d;
    };
    CHECK(run(ReduceOp::kSum) == std::vector<float>{5, 3, -3});
    CHECK(run(ReduceOp::kProduct) == std::vector<float>{4, -10, -18});
    CHECK(run(ReduceOp::kMin) == std::vector<float>{1, -2, -6});
    CHECK(run(ReduceOp::kMax) == std::vector<float>{4, 5, 3});
  }
  SECTION("int64 and uint8 wrap like torch") {
    std::vector<int64_t> a{INT64_MAX, -7}, b{1, 3};
    ReduceInto(DType::kInt64, ReduceOp::kSum, reinterpret_cast<char*>(a.data()),
               reinterpret_cast<char*>(b.data()), 2);
    CHECK(a[0] == INT64_MIN);
    CHECK(a[1] == -4);
    std::vector<uint8_t> u{250}, v{10};
    ReduceInto(DType::kUInt8, ReduceOp::kSum, reinterpret_cast<char*>(u.data()),
               reinterpret_cast<char*>(v.data()), 1);
    CHECK(u[0] == 4);
  }
  SECTION("bfloat16 rounds to nearest even") {
    // 1.0 and 2^-8: the exact sum 1.00390625 lies halfway between bf16
    // neighbours 1.0 and 1.0078125; ties go to the even one (1.0).
    std::vector<uint16_t> a{0x3f80}, b{0x3b80};
    ReduceInto(DType::kBFloat16, ReduceOp::kSum,
               reinterpret_cast<char*>(a.data()),
               reinterpret_cast<char*>(b.data()), 1);
    CHECK(a[0] == 0x3f80);
  }
  SECTION("float16 avg divides after the sum") {
    std::vector<uint16_t> a{tpu::FloatToHalf(3.0f)}, b{tpu::FloatToHalf(5.0f)};
    ReduceInto(DType::kHalf, ReduceOp::kAvg, reinterpret_cast<char*>(a.data()),
               reinterpret_cast<char*>(b.data()), 1);
    DivideBy(DType::kHalf, reinterpret_cast<char*>(a.data()), 1, 2);
    CHECK(tpu::HalfToFloat(a[0]) == 4.0f);
  }
  SECTION("bool: sum is or, product is and") {
    std::vector<uint8_t> a{0, 1, 1}, b{1, 0, 1};
    std::vector<uint8_t> d = a;
    ReduceInto(DType::kBool, ReduceOp::kSum, reinterpret_cast<char*>(d.data()),
               reinterpret_cast<char*>(b.data()), 3);
    CHECK(d == std::vector<uint8_t>{1, 1, 1});
    d = a;
    ReduceInto(DType::kBool, ReduceOp::kProduct,
               reinterpret_cast<char*>(d.data()),
               reinterpret_cast<char*>(b.data()), 3);
    CHECK(d == std::vector<uint8_t>{0, 0, 1});
  }
  SECTION("bitwise and, or, xor of every integer dtype") {
    auto run = [](auto a, auto b, DType dtype, ReduceOp op) {
      ReduceInto(dtype, op, reinterpret_cast<char*>(a.data()),
                 reinterpret_cast<char*>(b.data()), a.size());
      return a;
    };
    // Signed: two's complement bits, -1 is all ones.
    const std::vector<int8_t> a8{0x0c, -1, 0x55}, b8{0x0a, 0x21, -86};
    CHECK(run(a8, b8, DType::kInt8, ReduceOp::kBand) ==
          std::vector<int8_t>{0x08, 0x21, 0x00});
    CHECK(run(a8, b8, DType::kInt8, ReduceOp::kBor) ==
          std::vector<int8_t>{0x0e, -1, -1});
    CHECK(run(a8, b8, DType::kInt8, ReduceOp::kBxor) ==
          std::vector<int8_t>{0x06, -34, -1});
    const std::vector<int64_t> a64{INT64_MIN, 0x0f0f}, b64{-1, 0x00ff};
    CHECK(run(a64, b64, DType::kInt64, ReduceOp::kBand) ==
          std::vector<int64_t>{INT64_MIN, 0x000f});
    CHECK(run(a64, b64, DType::kInt64, ReduceOp::kBxor) ==
          std::vector<int64_t>{INT64_MAX, 0x0ff0});
    const std::vector<uint8_t> u8{0xf0}, v8{0x3c};
    CHECK(run(u8, v8, DType::kUInt8, ReduceOp::kBor) ==
          std::vector<uint8_t>{0xfc});
    const std::vector<int16_t> a16{0x1234}, b16{0x00ff};
    CHECK(run(a16, b16, DType::kInt16, ReduceOp::kBand) ==
          std::vector<int16_t>{0x0034});
    const std::vector<int32_t> a32{0x12345678}, b32{0x0f0f0f0f};
    CHECK(run(a32, b32, DType::kInt32, ReduceOp::kBxor) ==
          std::vector<int32_t>{0x1d3b5977});
    const std::vector<uint16_t> au16{0xff00}, bu16{0x0ff0};
    CHECK(run(au16, bu16, DType::kUInt16, ReduceOp::kBxor) ==
          std::vector<uint16_t>{0xf0f0});
    const std::vector<uint32_t> au32{0xffff0000u}, bu32{0x00ffff00u};
    CHECK(run(au32, bu32, DType::kUInt32, ReduceOp::kBand) ==
          std::vector<uint32_t>{0x00ff0000u});
    const std::vector<uint64_t> au64{1ull << 63}, bu64{1};
    CHECK(run(au64, bu64, DType::kUInt64, ReduceOp::kBor) ==
          std::vector<uint64_t>{(1ull << 63) | 1});
  }
  SECTION("bool: band is and, bor is or, bxor is xor") {
    // Any nonzero byte is true; results are 0 or 1.
    const std::vector<uint8_t> a{0, 0, 1, 1, 2}, b{0, 1, 0, 1, 1};
    auto run = [&](ReduceOp op) {
      std::vector<uint8_t> d = a, s = b;
      ReduceInto(DType::kBool, op, reinterpret_cast<char*>(d.data()),
                 reinterpret_cast<char*>(s.data()), d.size());
      return d;
    };
    CHECK(run(ReduceOp::kBand) == std::vector<uint8_t>{0, 0, 0, 1, 1});
    CHECK(run(ReduceOp::kBor) == std::vector<uint8_t>{0, 1, 1, 1, 1});
    CHECK(run(ReduceOp::kBxor) == std::vector<uint8_t>{0, 1, 1, 0, 0});
    CHECK(CheckReducible(DType::kBool, ReduceOp::kBxor).ok());
  }
  SECTION("bitwise ops refuse floating-point and complex tensors") {
    for (ReduceOp op : {ReduceOp::kBand, ReduceOp::kBor, ReduceOp::kBxor}) {
      for (DType t : {DType::kUInt8, DType::kInt8, DType::kInt16, DType::kInt32,
                      DType::kInt64, DType::kUInt16, DType::kUInt32,
                      DType::kUInt64, DType::kBool}) {
        CHECK(CheckReducible(t, op).ok());
      }
      for (DType t :
           {DType::kHalf, DType::kFloat, DType::kDouble, DType::kBFloat16,
            DType::kComplexFloat, DType::kComplexDouble}) {
        CHECK(CheckReducible(t, op).code() ==
              absl::StatusCode::kInvalidArgument);
      }
    }
    CHECK(CheckReducible(DType::kBFloat16, ReduceOp::kBor).message() ==
          "bor cannot reduce bfloat16 tensors (bitwise ops take integer and "
          "bool tensors)");
    CHECK(CheckReducible(DType::kComplexFloat, ReduceOp::kBand).message() ==
          "band cannot reduce complex64 tensors (bitwise ops take integer and "
          "bool tensors)");
    // Refused means untouched, should a caller skip the check.
    std::vector<float> d{1.5f}, s{2.5f};
    ReduceInto(DType::kFloat, ReduceOp::kBxor,
               reinterpret_cast<char*>(d.data()),
               reinterpret_cast<char*>(s.data()), 1);
    CHECK(d[0] == 1.5f);
  }
  SECTION("what cannot be reduced is refused") {
    CHECK(!CheckReducible(DType::kComplexFloat, ReduceOp::kMax)
               .ok());  // complex64 has no order
    CHECK(CheckReducible(DType::kComplexFloat, ReduceOp::kSum).ok());
    CHECK(
        !CheckReducible(DType::kFloat8E4M3FN, ReduceOp::kSum).ok());  // float8
    CHECK(!CheckReducible(DType::kBool, ReduceOp::kAvg).ok());        // bool
    CHECK(CheckReducible(DType::kHalf, ReduceOp::kAvg).ok());
    CHECK(
        CheckReducible(DType::kComplexDouble, ReduceOp::kMin).message() ==
        "min cannot reduce complex128 tensors (complex numbers have no order)");
    CHECK(CheckReducible(DType::kFloat8E5M2, ReduceOp::kSum).message() ==
          "reductions of float8_e5m2 tensors are not supported (gather, "
          "broadcast and "
          "all_to_all move them)");
  }
}

}  // namespace
}  // namespace tpud
