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
