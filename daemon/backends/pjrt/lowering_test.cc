// The lowering end to end without a daemon: op records over host memory,
// lowered, compiled on XLA's CPU plugin and run by PjrtChip; the values
// that come back are checked.
#include "daemon/backends/pjrt/lowering/lowering.h"

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "catch2_compat/catch.h"
#include "daemon/backends/pjrt/lowering/registry.h"
#include "daemon/backends/pjrt/pjrt_chip.h"
#include "daemon/backends/pjrt/pjrt_op.h"
#include "tpu/device_address.h"
#include "tpu/dtype.h"
#include "tpu/op_record.h"

namespace tpud::pjrt {
namespace {

constexpr uint64_t kArenaBytes = uint64_t{1} << 20;

// A float32 tensor in the arena: what a client sends and where it lies.
struct Placed {
  tpu::TensorRef ref;
  float* host = nullptr;
};

// One segment of host memory standing in for a chip's HBM.
class Arena {
 public:
  Arena() : mem_(static_cast<char*>(std::aligned_alloc(4096, kArenaBytes))) {
    REQUIRE(mem_ != nullptr);
    std::memset(mem_, 0, kArenaBytes);
    seg_ = {mem_, tpu::MakeDeviceAddress(0, 0), kArenaBytes};
  }
  ~Arena() { std::free(mem_); }
  Arena(const Arena&) = delete;
  Arena& operator=(const Arena&) = delete;

  const ResolvedTensor& segment() const { return seg_; }

  // A contiguous float32 tensor of `sizes` holding `values` (64-byte aligned).
  Placed Floats(const std::vector<int64_t>& sizes,
                const std::vector<float>& values) {
    Placed p;
    p.ref.dtype = tpu::Code(tpu::DType::kFloat);
    p.ref.ndim = static_cast<uint8_t>(sizes.size());
    int64_t numel = 1;
    for (int d = p.ref.ndim - 1; d >= 0; --d) {
      p.ref.sizes[d] = sizes[d];
      p.ref.strides[d] = numel;
      numel *= sizes[d];
    }
    REQUIRE(static_cast<int64_t>(values.size()) == numel);
    p.host = reinterpret_cast<float*>(mem_ + used_);
    p.ref.address = seg_.segment_address + used_;
    used_ += (numel * sizeof(float) + 63) / 64 * 64;
    REQUIRE(used_ <= kArenaBytes);
    std::memcpy(p.host, values.data(), values.size() * sizeof(float));
    return p;
  }

 private:
  char* mem_;
  ResolvedTensor seg_;
  uint64_t used_ = 0;
};

std::vector<float> Read(const Placed& p, size_t n) {
  return std::vector<float>(p.host, p.host + n);
}

// An op record and its resolved tensors, as the executor hands them over.
class Record {
 public:
  explicit Record(const Arena& arena) : seg_(arena.segment()) {}
  Record& Tensor(const Placed& p) {
    Add(tpu::ArgTag::kTensor).tensor = p.ref;
    ++tensors_;
    return *this;
  }
  Record& TensorList(const std::vector<Placed>& ps) {
    tpu::OpArg& a = Add(tpu::ArgTag::kTensorList);
    for (const Placed& p : ps) a.tensors.push_back(p.ref);
    tensors_ += ps.size();
    return *this;
  }
  Record& ScalarDouble(double v) {
    Add(tpu::ArgTag::kScalarDouble).d = v;
    return *this;
  }
  Record& IntList(std::vector<int64_t> v) {
    Add(tpu::ArgTag::kIntList).ints = std::move(v);
    return *this;
  }
  Record& Bool(bool v) {
    Add(tpu::ArgTag::kBool).b = v;
    return *this;
  }
  Record& Int(int64_t v) {
    Add(tpu::ArgTag::kInt).i = v;
    return *this;
  }
  Record& String(std::string v) {
    Add(tpu::ArgTag::kString).s = std::move(v);
    return *this;
  }
  Record& None() {
    Add(tpu::ArgTag::kNone);
    return *this;
  }
  Record& Output(const Placed& p) {
    op_.outputs.push_back(p.ref);
    ++tensors_;
    return *this;
  }
  const tpu::DecodedOp& decoded() const { return op_; }
  std::vector<ResolvedTensor> tensors() const {
    return std::vector<ResolvedTensor>(tensors_, seg_);
  }

 private:
  tpu::OpArg& Add(tpu::ArgTag tag) {
    op_.args.emplace_back();
    op_.args.back().tag = tag;
    op_.num_args = op_.args.size();
    return op_.args.back();
  }
  ResolvedTensor seg_;
  tpu::DecodedOp op_;
  size_t tensors_ = 0;
};

struct Fixture {
  Arena arena;
  std::unique_ptr<PjrtChip> chip;

  Fixture() {
    absl::StatusOr<std::unique_ptr<PjrtChip>> c =
        PjrtChip::Create(TPUD_PJRT_CPU_PLUGIN, {}, /*cache_capacity=*/16);
    INFO(c.status().ToString());
    REQUIRE(c.ok());
    chip = *std::move(c);
  }

  // Looks the op up by its schema and runs the record.
  absl::Status Run(const std::string& schema, const Record& r) {
    absl::StatusOr<std::shared_ptr<const BackendOp>> op =
        chip->LookupOp(schema);
    if (!op.ok()) return op.status();
    std::vector<ResultValue> results;
    return chip->Run(**op, r.decoded(), r.tensors(), &results, nullptr);
  }
};

constexpr char kAddTensor[] =
    "aten::add.Tensor(Tensor self, Tensor other, *, Scalar alpha=1) -> Tensor";

TEST_CASE("add.Tensor scales other by alpha") {
  Fixture f;
  Placed a = f.arena.Floats({2, 2}, {1, 2, 3, 4});
  Placed b = f.arena.Floats({2, 2}, {10, 20, 30, 40});
  Placed out = f.arena.Floats({2, 2}, {0, 0, 0, 0});
  absl::Status st =
      f.Run(kAddTensor,
            Record(f.arena).Tensor(a).Tensor(b).ScalarDouble(0.5).Output(out));
  INFO(st.ToString());
  REQUIRE(st.ok());
  CHECK(Read(out, 4) == std::vector<float>{6, 12, 18, 24});
}

TEST_CASE("exp, a unary op") {
  Fixture f;
  Placed x = f.arena.Floats({3}, {0, 1, -1});
  Placed out = f.arena.Floats({3}, {0, 0, 0});
  absl::Status st = f.Run("aten::exp(Tensor self) -> Tensor",
                          Record(f.arena).Tensor(x).Output(out));
  INFO(st.ToString());
  REQUIRE(st.ok());
  const std::vector<float> got = Read(out, 3);
  CHECK(got[0] == Approx(1.0f));
  CHECK(got[1] == Approx(std::exp(1.0f)));
  CHECK(got[2] == Approx(std::exp(-1.0f)));
}

TEST_CASE("add_.Tensor, the derived in-place form, writes self") {
  Fixture f;
  Placed self = f.arena.Floats({3}, {1, 2, 3});
  Placed other = f.arena.Floats({3}, {1, 1, 1});
  const OpEntry* entry = Registry().Find("aten::add_.Tensor");
  REQUIRE(entry != nullptr);
  CHECK(entry->derived_from == "aten::add.Tensor");
  absl::Status st = f.Run(
      "aten::add_.Tensor(Tensor(a!) self, Tensor other, *, Scalar alpha=1) -> "
      "Tensor(a!)",
      Record(f.arena).Tensor(self).Tensor(other).ScalarDouble(3));
  INFO(st.ToString());
  REQUIRE(st.ok());
  CHECK(Read(self, 3) == std::vector<float>{4, 5, 6});
}

TEST_CASE("exp.out, a derived out= form, writes out") {
  Fixture f;
  Placed x = f.arena.Floats({2}, {0, 2});
  Placed out = f.arena.Floats({2}, {-7, -7});
  absl::Status st =
      f.Run("aten::exp.out(Tensor self, *, Tensor(a!) out) -> Tensor(a!)",
            Record(f.arena).Tensor(x).Tensor(out));
  INFO(st.ToString());
  REQUIRE(st.ok());
  const std::vector<float> got = Read(out, 2);
  CHECK(got[0] == Approx(1.0f));
  CHECK(got[1] == Approx(std::exp(2.0f)));
}

TEST_CASE("mul.out, an out= overload registered by name") {
  Fixture f;
  Placed a = f.arena.Floats({2}, {3, 4});
  Placed b = f.arena.Floats({2}, {5, 6});
  Placed out = f.arena.Floats({2}, {0, 0});
  absl::Status st = f.Run(
      "aten::mul.out(Tensor self, Tensor other, *, Tensor(a!) out) -> "
      "Tensor(a!)",
      Record(f.arena).Tensor(a).Tensor(b).Tensor(out));
  INFO(st.ToString());
  REQUIRE(st.ok());
  CHECK(Read(out, 2) == std::vector<float>{15, 24});
}

TEST_CASE("sum over one dimension") {
  Fixture f;
  Placed x = f.arena.Floats({2, 3}, {1, 2, 3, 4, 5, 6});
  Placed out = f.arena.Floats({2}, {0, 0});
  absl::Status st = f.Run(
      "aten::sum.dim_IntList(Tensor self, int[1]? dim, bool keepdim=False, *, "
      "ScalarType? dtype=None) -> "
      "Tensor",
      Record(f.arena).Tensor(x).IntList({1}).Bool(false).None().Output(out));
  INFO(st.ToString());
  REQUIRE(st.ok());
  CHECK(Read(out, 2) == std::vector<float>{6, 15});
}

TEST_CASE("mm multiplies matrices") {
  Fixture f;
  Placed a = f.arena.Floats({2, 3}, {1, 2, 3, 4, 5, 6});
  Placed b = f.arena.Floats({3, 2}, {1, 0, 0, 1, 1, 1});
  Placed out = f.arena.Floats({2, 2}, {0, 0, 0, 0});
  absl::Status st = f.Run("aten::mm(Tensor self, Tensor mat2) -> Tensor",
                          Record(f.arena).Tensor(a).Tensor(b).Output(out));
  INFO(st.ToString());
  REQUIRE(st.ok());
  CHECK(Read(out, 4) == std::vector<float>{4, 5, 10, 11});
}

TEST_CASE("an op without a lowering fails naming itself") {
  Fixture f;
  Placed x = f.arena.Floats({2}, {1, 2});
  Placed out = f.arena.Floats({2}, {0, 0});
  absl::Status st = f.Run("aten::not_a_lowered_op(Tensor self) -> Tensor",
                          Record(f.arena).Tensor(x).Output(out));
  CHECK(st.code() == absl::StatusCode::kUnimplemented);
  CHECK(st.message() ==
        "aten::not_a_lowered_op: no lowering to StableHLO yet (PJRT backend; "
        "tpud "
        "--backend=simulated runs every ATen op)");
}

TEST_CASE(
    "argument names come from the schema, defaults and annotations aside") {
  CHECK(
      ArgumentNames("aten::sum.IntList_out(Tensor self, int[1]? dim, bool "
                    "keepdim=False, *, "
                    "ScalarType? dtype=None, Tensor(a!) out) -> Tensor(a!)") ==
      std::vector<std::string>{"self", "dim", "keepdim", "dtype", "out"});
  CHECK(
      ArgumentNames(
          "aten::avg_pool2d(Tensor self, int[2] kernel_size, int[2] stride=[], "
          "int[2] padding=[0, 0]) -> Tensor") ==
      std::vector<std::string>{"self", "kernel_size", "stride", "padding"});
}

TEST_CASE("leaky_relu reads negative_slope by name, its default when absent") {
  Fixture f;
  Placed x = f.arena.Floats({2}, {-2, 3});
  Placed out = f.arena.Floats({2}, {0, 0});
  const char* schema =
      "aten::leaky_relu(Tensor self, Scalar negative_slope=0.01) -> Tensor";
  absl::Status st =
      f.Run(schema, Record(f.arena).Tensor(x).ScalarDouble(0.5).Output(out));
  INFO(st.ToString());
  REQUIRE(st.ok());
  CHECK(Read(out, 2) == std::vector<float>{-1, 3});
  st = f.Run(schema, Record(f.arena).Tensor(x).Output(out));
  INFO(st.ToString());
  REQUIRE(st.ok());
  CHECK(Read(out, 2)[0] == Approx(-0.02f));
}

TEST_CASE("foreach ops read their lists and scalars by name") {
  Fixture f;
  Placed x = f.arena.Floats({2}, {1, 2});
  Placed y = f.arena.Floats({3}, {3, 4, 5});
  Placed a = f.arena.Floats({2}, {10, 20});
  Placed b = f.arena.Floats({3}, {30, 40, 50});
  auto run = [&](const char* schema, const Record& r) {
    absl::Status st = f.Run(schema, r);
    INFO(st.ToString());
    REQUIRE(st.ok());
  };
  run("aten::_foreach_add_.Scalar(Tensor(a!)[] self, Scalar scalar) -> ()",
      Record(f.arena).TensorList({x, y}).ScalarDouble(0.5));
  CHECK(Read(x, 2) == std::vector<float>{1.5, 2.5});
  CHECK(Read(y, 3) == std::vector<float>{3.5, 4.5, 5.5});
  run("aten::_foreach_sub_.List(Tensor(a!)[] self, Tensor[] other, *, "
      "Scalar alpha=1) -> ()",
      Record(f.arena).TensorList({x, y}).TensorList({a, b}).ScalarDouble(0.1));
  CHECK(Read(x, 2)[1] == Approx(0.5f));
  CHECK(Read(y, 3)[2] == Approx(0.5f));
  const char* addcmul =
      "aten::_foreach_addcmul_.Scalar(Tensor(a!)[] self, Tensor[] tensor1, "
      "Tensor[] tensor2, Scalar value=1) -> ()";
  run(addcmul,
      Record(f.arena).TensorList({x, y}).TensorList({a, b}).TensorList({a, b}));
  CHECK(Read(x, 2)[0] == Approx(100.5f));
  run(addcmul, Record(f.arena)
                   .TensorList({x, y})
                   .TensorList({a, b})
                   .TensorList({a, b})
                   .ScalarDouble(-1));
  CHECK(Read(x, 2)[0] == Approx(0.5f));
  CHECK(Read(y, 3)[0] == Approx(0.5f));
  run("aten::_foreach_lerp_.Scalar(Tensor(a!)[] self, Tensor[] tensors1, "
      "Scalar weight) -> ()",
      Record(f.arena).TensorList({x, y}).TensorList({a, b}).ScalarDouble(0.5));
  CHECK(Read(x, 2)[0] == Approx(5.25f));
  CHECK(Read(y, 3)[2] == Approx(25.25f));
}

TEST_CASE("reductions read dim, keepdim and their options by name") {
  Fixture f;
  Placed x = f.arena.Floats({2, 3}, {1, 2, 3, 4, 5, 6});
  auto run = [&](const char* schema, const Record& r) {
    absl::Status st = f.Run(schema, r);
    INFO(schema);
    INFO(st.ToString());
    REQUIRE(st.ok());
  };
  // A negative dim, kept: out (1, 3).
  Placed sum = f.arena.Floats({1, 3}, {0, 0, 0});
  run("aten::sum.dim_IntList(Tensor self, int[1]? dim, bool keepdim=False, *, "
      "ScalarType? dtype=None) -> Tensor",
      Record(f.arena).Tensor(x).IntList({-2}).Bool(true).None().Output(sum));
  CHECK(Read(sum, 3) == std::vector<float>{5, 7, 9});
  Placed mx = f.arena.Floats({2, 1}, {0, 0});
  run("aten::amax(Tensor self, int[1] dim=[], bool keepdim=False) -> Tensor",
      Record(f.arena).Tensor(x).IntList({-1}).Bool(true).Output(mx));
  CHECK(Read(mx, 2) == std::vector<float>{3, 6});
  // mean of everything: no dim in the schema.
  Placed mean = f.arena.Floats({}, {0});
  run("aten::mean(Tensor self, *, ScalarType? dtype=None) -> Tensor",
      Record(f.arena).Tensor(x).None().Output(mean));
  CHECK(Read(mean, 1)[0] == Approx(3.5f));
  Placed cum = f.arena.Floats({2, 3}, {0, 0, 0, 0, 0, 0});
  run("aten::cumsum(Tensor self, int dim, *, ScalarType? dtype=None) -> Tensor",
      Record(f.arena).Tensor(x).Int(-1).None().Output(cum));
  CHECK(Read(cum, 6) == std::vector<float>{1, 3, 6, 4, 9, 15});
  Placed var = f.arena.Floats({2}, {0, 0});
  run("aten::var.correction(Tensor self, int[1]? dim=None, *, Scalar? "
      "correction=None, bool keepdim=False) -> Tensor",
      Record(f.arena).Tensor(x).IntList({1}).ScalarDouble(0).Bool(false).Output(
          var));
  CHECK(Read(var, 2)[0] == Approx(2.0f / 3));
  CHECK(Read(var, 2)[1] == Approx(2.0f / 3));
  Placed norm = f.arena.Floats({2}, {0, 0});
  run("aten::linalg_vector_norm(Tensor self, Scalar ord=2, int[1]? dim=None, "
      "bool keepdim=False, *, ScalarType? dtype=None) -> Tensor",
      Record(f.arena)
          .Tensor(x)
          .ScalarDouble(1)
          .IntList({-1})
          .Bool(false)
          .None()
          .Output(norm));
  CHECK(Read(norm, 2) == std::vector<float>{6, 15});
}

TEST_CASE("elementwise ops read alpha, value, exponent and bounds by name") {
  Fixture f;
  Placed a = f.arena.Floats({2}, {1, 2});
  Placed b = f.arena.Floats({2}, {10, 20});
  Placed out = f.arena.Floats({2}, {0, 0});
  auto run = [&](const char* schema, const Record& r) {
    absl::Status st = f.Run(schema, r);
    INFO(schema);
    INFO(st.ToString());
    REQUIRE(st.ok());
    return Read(out, 2);
  };
  // other - alpha * self
  CHECK(run("aten::rsub.Tensor(Tensor self, Tensor other, *, Scalar alpha=1) "
            "-> Tensor",
            Record(f.arena).Tensor(a).Tensor(b).ScalarDouble(2).Output(out)) ==
        std::vector<float>{8, 16});
  // self + value * tensor1 * tensor2
  CHECK(run("aten::addcmul(Tensor self, Tensor tensor1, Tensor tensor2, *, "
            "Scalar value=1) -> Tensor",
            Record(f.arena)
                .Tensor(a)
                .Tensor(a)
                .Tensor(b)
                .ScalarDouble(0.5)
                .Output(out)) == std::vector<float>{6, 22});
  CHECK(run("aten::pow.Tensor_Scalar(Tensor self, Scalar exponent) -> Tensor",
            Record(f.arena).Tensor(b).ScalarDouble(2).Output(out)) ==
        std::vector<float>{100, 400});
  CHECK(run("aten::clamp_max(Tensor self, Scalar max) -> Tensor",
            Record(f.arena).Tensor(b).ScalarDouble(15).Output(out)) ==
        std::vector<float>{10, 15});
  CHECK(run("aten::clamp(Tensor self, Scalar? min=None, Scalar? max=None) -> "
            "Tensor",
            Record(f.arena).Tensor(b).None().ScalarDouble(15).Output(out)) ==
        std::vector<float>{10, 15});
  CHECK(run("aten::lerp.Scalar(Tensor self, Tensor end, Scalar weight) -> "
            "Tensor",
            Record(f.arena).Tensor(a).Tensor(b).ScalarDouble(0.5).Output(
                out)) == std::vector<float>{5.5, 11});
  Placed cond = f.arena.Floats({2}, {1, 0});
  CHECK(run("aten::where.self(Tensor condition, Tensor self, Tensor other) -> "
            "Tensor",
            Record(f.arena).Tensor(cond).Tensor(a).Tensor(b).Output(out)) ==
        std::vector<float>{1, 20});
  Placed n = f.arena.Floats({2}, {7, -7});
  Placed two = f.arena.Floats({2}, {2, 2});
  CHECK(run("aten::div.Tensor_mode(Tensor self, Tensor other, *, str? "
            "rounding_mode) -> Tensor",
            Record(f.arena).Tensor(n).Tensor(two).String("floor").Output(
                out)) == std::vector<float>{3, -4});
}

TEST_CASE("the registry's facts: host-side ops, first arguments overwritten") {
  const OpEntry* equal = Registry().Find("aten::equal");
  REQUIRE(equal != nullptr);
  CHECK(equal->host == HostKind::kEqual);
  const OpEntry* index = Registry().Find("aten::index.Tensor");
  REQUIRE(index != nullptr);
  CHECK(index->host == HostKind::kIndex);
  CHECK(index->takes_list);
  const OpEntry* fill = Registry().Find("aten::fill_.Scalar");
  REQUIRE(fill != nullptr);
  CHECK(fill->overwrites_first);
  // aten::mean.out is mean.dim's out= form, not one derived from aten::mean.
  const OpEntry* mean_out = Registry().Find("aten::mean.out");
  REQUIRE(mean_out != nullptr);
  CHECK(mean_out->derived_from.empty());
  CHECK(Registry().Find("aten::not_a_lowered_op") == nullptr);
}

// The result of an in-place op goes where its input lies: the one
// parameter is read and donated, not copied in beside a donated twin. (A
// dtype table with one copy per file once made types differ by address
// here, and every in-place op paid a host copy.)
TEST_CASE("an in-place result is donated to the parameter it reads") {
  Arena arena;
  Placed x = arena.Floats({4}, {1, 2, 3, 4});
  Record r(arena);
  r.Tensor(x);
  const std::vector<ResolvedTensor> tensors = r.tensors();
  Lowering l("aten::neg_", r.decoded(), tensors);
  // The type as this file sees the table (DTypeOf may be one out-of-line
  // copy for the whole program when it is not inlined).
  const HloType* f32p = nullptr;
  for (const HloType& t : kHloTypes) {
    if (t.dtype == tpu::DType::kFloat) f32p = &t;
  }
  REQUIRE(f32p != nullptr);
  const HloType& f32 = *f32p;
  REQUIRE(l.Operand(r.decoded().args[0], {4}, f32).ok());
  l.Donate(0, reinterpret_cast<char*>(x.host), f32, {4});
  REQUIRE(l.transfers().size() == 1);
  CHECK(l.transfers()[0].aliased == 0);
}

// torch.max(a, b, out=c) is aten::max.out: elementwise, like maximum.
TEST_CASE("max.out and min.out are elementwise") {
  Fixture f;
  Placed a = f.arena.Floats({3}, {1, 5, -2});
  Placed b = f.arena.Floats({3}, {4, 2, -3});
  for (const bool largest : {true, false}) {
    Placed out = f.arena.Floats({3}, {0, 0, 0});
    Record r(f.arena);
    r.Tensor(a).Tensor(b).Tensor(out);
    const std::string name = largest ? "max" : "min";
    absl::Status st = f.Run("aten::" + name +
                                ".out(Tensor self, Tensor other, *, "
                                "Tensor(a!) out) -> Tensor(a!)",
                            r);
    INFO(name << ": " << st.ToString());
    REQUIRE(st.ok());
    CHECK(Read(out, 3) == (largest ? std::vector<float>{4, 5, -2}
                                   : std::vector<float>{1, 2, -3}));
  }
}

// Reached only from records (the plugin sends .grad_input): each gradient
// spread evenly over its window, or by divisor_override.
TEST_CASE("avg_pool2d_backward spreads each gradient over its window") {
  Fixture f;
  Placed grad = f.arena.Floats({1, 1, 1, 2}, {4, 8});
  Placed self = f.arena.Floats({1, 1, 2, 4}, std::vector<float>(8, 0));
  for (const bool divisor : {false, true}) {
    Placed out = f.arena.Floats({1, 1, 2, 4}, std::vector<float>(8, 0));
    Record r(f.arena);
    r.Tensor(grad).Tensor(self).IntList({2, 2}).IntList({2, 2}).IntList({0, 0});
    r.Bool(false).Bool(true);
    if (divisor) {
      r.Int(2);
    } else {
      r.None();
    }
    r.Output(out);
    absl::Status st = f.Run(
        "aten::avg_pool2d_backward(Tensor grad_output, Tensor self, int[2] "
        "kernel_size, int[2] stride, int[2] padding, bool ceil_mode, bool "
        "count_include_pad, int? divisor_override) -> Tensor",
        r);
    INFO(st.ToString());
    REQUIRE(st.ok());
    CHECK(Read(out, 8) == (divisor
                               ? std::vector<float>{2, 2, 4, 4, 2, 2, 4, 4}
                               : std::vector<float>{1, 1, 2, 2, 1, 1, 2, 2}));
  }
}

// torch.mv reaches tpud as addmv: aten::mv only comes from records.
TEST_CASE("mv multiplies a matrix by a vector") {
  Fixture f;
  Placed m = f.arena.Floats({2, 3}, {1, 2, 3, 4, 5, 6});
  Placed v = f.arena.Floats({3}, {1, 0, -1});
  Placed out = f.arena.Floats({2}, {0, 0});
  Record r(f.arena);
  r.Tensor(m).Tensor(v).Output(out);
  absl::Status st = f.Run("aten::mv(Tensor self, Tensor vec) -> Tensor", r);
  INFO(st.ToString());
  REQUIRE(st.ok());
  CHECK(Read(out, 2) == std::vector<float>{-2, -2});
}

}  // namespace
}  // namespace tpud::pjrt
