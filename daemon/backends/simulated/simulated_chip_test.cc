#include "daemon/backends/simulated/simulated_chip.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "catch2_compat/catch.h"
#include "tpu/device_address.h"
#include "tpu/op_record.h"

namespace tpud {
namespace {

constexpr uint64_t kMiB = uint64_t{1} << 20;
constexpr uint64_t kSegmentBytes = 32 * kMiB;

// A tensor placed in fake HBM: the reference a client would send and the
// segment the executor would resolve it to.
struct Placed {
  tpu::TensorRef ref;
  ResolvedTensor seg;
};

// Fake HBM: one host buffer cut into two segments at unrelated device
// addresses, with a bump allocator per segment.
class FakeHbm {
 public:
  FakeHbm()
      : mem_(static_cast<char*>(std::aligned_alloc(4096, 2 * kSegmentBytes))) {
    REQUIRE(mem_ != nullptr);
    std::memset(mem_, 0, 2 * kSegmentBytes);
    segs_[0] = {mem_, tpu::MakeDeviceAddress(0, 0), kSegmentBytes};
    segs_[1] = {mem_ + kSegmentBytes, tpu::MakeDeviceAddress(0, 1ull << 30),
                kSegmentBytes};
  }
  ~FakeHbm() { std::free(mem_); }
  FakeHbm(const FakeHbm&) = delete;
  FakeHbm& operator=(const FakeHbm&) = delete;

  const ResolvedTensor& segment(int s) const { return segs_[s]; }

  // `bytes` of segment `s`, 64-byte aligned: device address and host pointer.
  uint64_t Reserve(int s, uint64_t bytes, char** host) {
    const uint64_t at = used_[s];
    used_[s] += (bytes + 63) / 64 * 64;
    REQUIRE(used_[s] <= kSegmentBytes);
    *host = segs_[s].segment_host_base + at;
    return segs_[s].segment_address + at;
  }

  // Uninitialised contiguous tensor in segment `s`.
  Placed Empty(at::IntArrayRef sizes, at::ScalarType dtype, int s = 0) {
    Placed p;
    p.seg = segs_[s];
    p.ref.dtype = static_cast<int8_t>(dtype);
    p.ref.ndim = static_cast<uint8_t>(sizes.size());
    int64_t numel = 1, stride = 1;
    for (int d = p.ref.ndim - 1; d >= 0; --d) {
      p.ref.sizes[d] = sizes[d];
      p.ref.strides[d] = stride;
      stride *= std::max<int64_t>(sizes[d], 1);
    }
    for (int64_t v : sizes) numel *= v;
    char* host;
    const uint64_t bytes =
        std::max<int64_t>(numel, 1) * c10::elementSize(dtype);
    p.ref.address = Reserve(s, bytes, &host);
    return p;
  }

  // A copy of `t` (made contiguous) in segment `s`.
  Placed Put(const at::Tensor& t, int s = 0) {
    at::Tensor c = t.contiguous();
    Placed p = Empty(c.sizes(), c.scalar_type(), s);
    std::memcpy(Host(p.ref), c.data_ptr(), c.nbytes());
    return p;
  }

  char* Host(const tpu::TensorRef& ref) const {
    for (const ResolvedTensor& seg : segs_) {
      if (ref.address >= seg.segment_address &&
          ref.address < seg.segment_address + seg.segment_bytes) {
        return seg.segment_host_base + (ref.address - seg.segment_address) +
               ref.storage_offset * tpu::ElementSize(ref.dtype);
      }
    }
    REQUIRE(false);  // address outside fake HBM
    return nullptr;
  }

  // A CPU copy of what `ref` names.
  at::Tensor Get(const tpu::TensorRef& ref) const { return View(ref).clone(); }

  // A CPU tensor viewing (not copying) what `ref` names.
  at::Tensor View(const tpu::TensorRef& ref) const {
    return at::from_blob(
        Host(ref), at::IntArrayRef(ref.sizes, ref.ndim),
        at::IntArrayRef(ref.strides, ref.ndim),
        at::TensorOptions().dtype(static_cast<at::ScalarType>(ref.dtype)));
  }

 private:
  char* mem_;
  ResolvedTensor segs_[2];
  uint64_t used_[2] = {0, 0};
};

// Swaps dims 0 and 1 of a placed tensor: a transposed view, as a client
// sends `x.t()`.
Placed Transposed(Placed p) {
  std::swap(p.ref.sizes[0], p.ref.sizes[1]);
  std::swap(p.ref.strides[0], p.ref.strides[1]);
  return p;
}

// Builds a DecodedOp and its resolved tensors the way the executor would.
class OpBuilder {
 public:
  OpBuilder& Tensor(const Placed& p) {
    tpu::OpArg& a = Add(tpu::ArgTag::kTensor);
    a.tensor = p.ref;
    arg_segs_.push_back(p.seg);
    return *this;
  }
  OpBuilder& Undefined() {
    Add(tpu::ArgTag::kUndefinedTensor);
    return *this;
  }
  OpBuilder& None() {
    Add(tpu::ArgTag::kNone);
    return *this;
  }
  OpBuilder& Int(int64_t v, tpu::ArgTag tag = tpu::ArgTag::kInt) {
    Add(tag).i = v;
    return *this;
  }
  OpBuilder& Double(double v, tpu::ArgTag tag = tpu::ArgTag::kDouble) {
    Add(tag).d = v;
    return *this;
  }
  OpBuilder& Bool(bool v, tpu::ArgTag tag = tpu::ArgTag::kBool) {
    Add(tag).b = v;
    return *this;
  }
  OpBuilder& Complex(double re, double im,
                     tpu::ArgTag tag = tpu::ArgTag::kComplex) {
    tpu::OpArg& a = Add(tag);
    a.d = re;
    a.d_imag = im;
    return *this;
  }
  OpBuilder& String(const std::string& s) {
    Add(tpu::ArgTag::kString).s = s;
    return *this;
  }
  OpBuilder& IntList(std::vector<int64_t> v) {
    Add(tpu::ArgTag::kIntList).ints = std::move(v);
    return *this;
  }
  OpBuilder& Dtype(at::ScalarType t) {
    Add(tpu::ArgTag::kDtype).i = static_cast<int64_t>(t);
    return *this;
  }
  OpBuilder& Layout(at::Layout l) {
    Add(tpu::ArgTag::kLayout).i = static_cast<int64_t>(l);
    return *this;
  }
  OpBuilder& Device(c10::DeviceType type, int index) {
    tpu::OpArg& a = Add(tpu::ArgTag::kDevice);
    a.i = static_cast<int64_t>(type);
    a.device_index = index;
    return *this;
  }
  OpBuilder& TensorList(const std::vector<Placed>& ts) {
    tpu::OpArg& a = Add(tpu::ArgTag::kTensorList);
    for (const Placed& p : ts) {
      a.tensors.push_back(p.ref);
      arg_segs_.push_back(p.seg);
    }
    return *this;
  }
  // nullptr entries are absent.
  OpBuilder& OptionalTensorList(const std::vector<const Placed*>& ts) {
    tpu::OpArg& a = Add(tpu::ArgTag::kOptionalTensorList);
    for (const Placed* p : ts) {
      // As the decoder does: a placeholder for each absent entry.
      a.tensor_present.push_back(p != nullptr);
      a.tensors.push_back(p != nullptr ? p->ref : tpu::TensorRef());
      if (p != nullptr) arg_segs_.push_back(p->seg);
    }
    return *this;
  }
  OpBuilder& Output(const Placed& p) {
    op_.outputs.push_back(p.ref);
    out_segs_.push_back(p.seg);
    return *this;
  }

  const tpu::DecodedOp& decoded() const { return op_; }
  std::vector<ResolvedTensor> tensors() const {
    std::vector<ResolvedTensor> all = arg_segs_;
    all.insert(all.end(), out_segs_.begin(), out_segs_.end());
    return all;
  }

 private:
  tpu::OpArg& Add(tpu::ArgTag tag) {
    op_.args.emplace_back();
    op_.args.back().tag = tag;
    op_.num_args = op_.args.size();
    return op_.args.back();
  }

  tpu::DecodedOp op_;
  std::vector<ResolvedTensor> arg_segs_;
  std::vector<ResolvedTensor> out_segs_;
};

// The schema string a client built against this same torch would send.
std::string SchemaOf(const char* name, const char* overload) {
  return c10::toString(
      c10::Dispatcher::singleton().findSchemaOrThrow(name, overload).schema());
}

// Result memory for the synchronous path, taken from segment 1.
class TestResultAllocator : public ResultAllocator {
 public:
  explicit TestResultAllocator(FakeHbm& hbm) : hbm_(hbm) {}
  absl::StatusOr<Block> Allocate(uint64_t bytes) override {
    ++calls;
    Block b;
    b.address = hbm_.Reserve(1, bytes, &b.host);
    return b;
  }
  int calls = 0;

 private:
  FakeHbm& hbm_;
};

struct Fixture {
  FakeHbm hbm;
  std::unique_ptr<SimulatedChip> chip = SimulatedChip::Create(0);

  std::shared_ptr<const BackendOp> Op(const char* name,
                                      const char* overload = "") {
    absl::StatusOr<std::shared_ptr<const BackendOp>> op =
        chip->LookupOp(SchemaOf(name, overload));
    INFO(op.status().ToString());
    REQUIRE(op.ok());
    return *op;
  }

  absl::Status Run(const std::shared_ptr<const BackendOp>& op,
                   const OpBuilder& b,
                   std::vector<ResultValue>* results = nullptr,
                   ResultAllocator* allocator = nullptr) {
    return chip->Run(*op, b.decoded(), b.tensors(), results, allocator);
  }

  // Runs an op with one returned tensor into a fresh output shaped like
  // `expected`, and returns what landed there.
  at::Tensor RunInto(const std::shared_ptr<const BackendOp>& op, OpBuilder& b,
                     const at::Tensor& expected) {
    Placed out = hbm.Empty(expected.sizes(), expected.scalar_type());
    b.Output(out);
    absl::Status st = Run(op, b);
    INFO(st.ToString());
    REQUIRE(st.ok());
    return hbm.Get(out.ref);
  }
};

bool Same(const at::Tensor& got, const at::Tensor& want) {
  INFO("got " << got << "\nwant " << want);
  REQUIRE(got.scalar_type() == want.scalar_type());
  REQUIRE(got.sizes() == want.sizes());
  if (at::isFloatingType(want.scalar_type()) ||
      at::isComplexType(want.scalar_type())) {
    return at::allclose(got, want, 1e-5, 1e-6);
  }
  return at::equal(got, want);
}

TEST_CASE("element sizes of the wire format agree with c10") {
  absl::Status st = SimulatedChip::VerifyElementSizes();
  INFO(st.ToString());
  CHECK(st.ok());
}

TEST_CASE("describe names the simulated backend") {
  CHECK(SimulatedChip::Create(0)->Describe() == "simulated (ATen CPU kernels)");
}

TEST_CASE("the chip's intra-op threads are ATen's, set between ops") {
  std::unique_ptr<SimulatedChip> chip = SimulatedChip::Create(0);
  const int before = at::get_num_threads();
  CHECK(chip->intra_op_threads() == before);
  chip->set_intra_op_threads(1);
  CHECK(at::get_num_threads() == 1);
  CHECK(chip->intra_op_threads() == 1);
  at::Tensor a = at::randn({64, 64});
  CHECK(at::allclose(at::mm(a, a), at::matmul(a, a)));
  chip->set_intra_op_threads(before + 1);
  CHECK(at::get_num_threads() == before + 1);
  chip->set_intra_op_threads(before);
  CHECK(at::get_num_threads() == before);
}

TEST_CASE("elementwise ops match ATen on CPU") {
  Fixture f;
  at::Tensor a = at::randn({4, 5});
  at::Tensor b = at::randn({4, 5});
  Placed pa = f.hbm.Put(a), pb = f.hbm.Put(b, 1);

  SECTION("add.Tensor with alpha") {
    OpBuilder ob;
    ob.Tensor(pa).Tensor(pb).Double(2.5, tpu::ArgTag::kScalarDouble);
    CHECK(Same(f.RunInto(f.Op("aten::add", "Tensor"), ob, a + 2.5 * b),
               at::add(a, b, 2.5)));
  }
  SECTION("add.Tensor with alpha left to its default") {
    OpBuilder ob;
    ob.Tensor(pa).Tensor(pb);
    CHECK(Same(f.RunInto(f.Op("aten::add", "Tensor"), ob, a), a + b));
  }
  SECTION("mul.Tensor") {
    OpBuilder ob;
    ob.Tensor(pa).Tensor(pb);
    CHECK(Same(f.RunInto(f.Op("aten::mul", "Tensor"), ob, a), a * b));
  }
  SECTION("broadcasting") {
    at::Tensor col = at::randn({3, 1}), row = at::randn({1, 4});
    OpBuilder ob;
    ob.Tensor(f.hbm.Put(col)).Tensor(f.hbm.Put(row));
    at::Tensor want = at::sub(col, row, 3);
    ob.Int(3, tpu::ArgTag::kScalarInt);
    CHECK(Same(f.RunInto(f.Op("aten::sub", "Tensor"), ob, want), want));
  }
  SECTION("div with a rounding mode string") {
    OpBuilder ob;
    ob.Tensor(pa).Tensor(pb).String("floor");
    at::Tensor want = at::div(a, b, "floor");
    CHECK(Same(f.RunInto(f.Op("aten::div", "Tensor_mode"), ob, want), want));
  }
  SECTION("where.self") {
    at::Tensor cond = a > 0;
    OpBuilder ob;
    ob.Tensor(f.hbm.Put(cond)).Tensor(pa).Tensor(pb);
    at::Tensor want = at::where(cond, a, b);
    CHECK(Same(f.RunInto(f.Op("aten::where", "self"), ob, want), want));
  }
}

TEST_CASE("in-place and out= ops write the argument and copy nothing") {
  Fixture f;
  at::Tensor a = at::randn({8});
  at::Tensor b = at::randn({8});
  Placed pa = f.hbm.Put(a), pb = f.hbm.Put(b);

  SECTION("add_.Tensor") {
    OpBuilder ob;
    ob.Tensor(pa).Tensor(pb).Int(2, tpu::ArgTag::kScalarInt);
    std::vector<ResultValue> results;
    absl::Status st = f.Run(f.Op("aten::add_", "Tensor"), ob, &results);
    INFO(st.ToString());
    REQUIRE(st.ok());
    CHECK(Same(f.hbm.Get(pa.ref), a + 2 * b));
    REQUIRE(results.size() == 1);
    CHECK(results[0].kind == ResultValue::Kind::kTensor);
    CHECK(results[0].tensor.address == pa.ref.address);
  }
  SECTION("add.out") {
    Placed out = f.hbm.Empty({8}, at::kFloat, 1);
    OpBuilder ob;
    ob.Tensor(pa).Tensor(pb).Double(1.0, tpu::ArgTag::kScalarDouble);
    ob.Tensor(out);
    absl::Status st = f.Run(f.Op("aten::add", "out"), ob);
    INFO(st.ToString());
    REQUIRE(st.ok());
    CHECK(Same(f.hbm.Get(out.ref), a + b));
    CHECK(Same(f.hbm.Get(pa.ref), a));  // inputs untouched
  }
  SECTION("out= of the wrong shape is refused, not grown over its neighbour") {
    // out is elements [0, 4) of a buffer whose other elements belong to
    // other tensors of the client.
    Placed buffer = f.hbm.Put(at::full({16}, 7.0));
    Placed out = buffer;
    out.ref.sizes[0] = 4;
    OpBuilder ob;
    ob.Tensor(pa).Tensor(pb).Double(1.0, tpu::ArgTag::kScalarDouble);
    ob.Tensor(out);
    absl::Status st = f.Run(f.Op("aten::add", "out"), ob);
    INFO(st.ToString());
    CHECK(st.code() == absl::StatusCode::kInvalidArgument);
    CHECK(st.message().find("aten::add.out") != absl::string_view::npos);
    CHECK(Same(f.hbm.Get(buffer.ref), at::full({16}, 7.0)));
  }
  SECTION("tensors in one segment share a storage: partial overlap is caught") {
    // self = elements [0, 6), other = elements [2, 8) of the same memory.
    Placed self = pa, other = pa;
    self.ref.sizes[0] = 6;
    other.ref.sizes[0] = 6;
    other.ref.storage_offset = 2;
    OpBuilder ob;
    ob.Tensor(self).Tensor(other);
    absl::Status st = f.Run(f.Op("aten::add_", "Tensor"), ob);
    INFO(st.ToString());
    CHECK(st.code() == absl::StatusCode::kInvalidArgument);
    CHECK(st.message().find("aten::add_.Tensor") != absl::string_view::npos);
    CHECK(st.message().find("single memory location") !=
          absl::string_view::npos);
  }
  SECTION("the same tensors in two segments do not overlap") {
    Placed other = f.hbm.Put(a, 1);
    OpBuilder ob;
    ob.Tensor(pa).Tensor(other);
    REQUIRE(f.Run(f.Op("aten::add_", "Tensor"), ob).ok());
    CHECK(Same(f.hbm.Get(pa.ref), a * 2));
  }
  SECTION("an exact alias (x += x) is allowed, as in ATen") {
    OpBuilder ob;
    ob.Tensor(pa).Tensor(pa);
    REQUIRE(f.Run(f.Op("aten::add_", "Tensor"), ob).ok());
    CHECK(Same(f.hbm.Get(pa.ref), a * 2));
  }
}

TEST_CASE("reductions match ATen on CPU") {
  Fixture f;
  at::Tensor x = at::randn({3, 4, 5});
  Placed px = f.hbm.Put(x);

  SECTION("sum.dim_IntList with keepdim and dtype") {
    at::Tensor want = at::sum(x, {1}, /*keepdim=*/true, at::kDouble);
    OpBuilder ob;
    ob.Tensor(px).IntList({1}).Bool(true).Dtype(at::kDouble);
    CHECK(Same(f.RunInto(f.Op("aten::sum", "dim_IntList"), ob, want), want));
  }
  SECTION("sum.dim_IntList with one int for int[1]? dim") {
    at::Tensor want = at::sum(x, {2});
    OpBuilder ob;
    ob.Tensor(px).Int(2);
    CHECK(Same(f.RunInto(f.Op("aten::sum", "dim_IntList"), ob, want), want));
  }
  SECTION("sum.dim_IntList over all dims (dim=None)") {
    at::Tensor want = at::sum(x);
    OpBuilder ob;
    ob.Tensor(px).None();
    CHECK(Same(f.RunInto(f.Op("aten::sum", "dim_IntList"), ob, want), want));
  }
  SECTION("mean.dim") {
    at::Tensor want = at::mean(x, {0, 2});
    OpBuilder ob;
    ob.Tensor(px).IntList({0, 2});
    CHECK(Same(f.RunInto(f.Op("aten::mean", "dim"), ob, want), want));
  }
  SECTION("amax") {
    at::Tensor want = at::amax(x, {2}, true);
    OpBuilder ob;
    ob.Tensor(px).IntList({2}).Bool(true);
    CHECK(Same(f.RunInto(f.Op("aten::amax"), ob, want), want));
  }
  SECTION("max.dim returns two tensors into two outputs") {
    auto [values, indices] = at::max(x, 1);
    Placed ov = f.hbm.Empty(values.sizes(), values.scalar_type());
    Placed oi = f.hbm.Empty(indices.sizes(), indices.scalar_type(), 1);
    OpBuilder ob;
    ob.Tensor(px).Int(1).Output(ov).Output(oi);
    absl::Status st = f.Run(f.Op("aten::max", "dim"), ob);
    INFO(st.ToString());
    REQUIRE(st.ok());
    CHECK(Same(f.hbm.Get(ov.ref), values));
    CHECK(Same(f.hbm.Get(oi.ref), indices));
  }
  SECTION("_softmax") {
    at::Tensor want = at::_softmax(x, -1, false);
    OpBuilder ob;
    ob.Tensor(px).Int(-1).Bool(false);
    CHECK(Same(f.RunInto(f.Op("aten::_softmax"), ob, want), want));
  }
}

TEST_CASE("linear algebra and convolution match ATen on CPU") {
  Fixture f;
  SECTION("mm") {
    at::Tensor a = at::randn({6, 7}), b = at::randn({7, 3});
    OpBuilder ob;
    ob.Tensor(f.hbm.Put(a)).Tensor(f.hbm.Put(b, 1));
    at::Tensor want = at::mm(a, b);
    CHECK(Same(f.RunInto(f.Op("aten::mm"), ob, want), want));
  }
  SECTION("matmul with a batch") {
    at::Tensor a = at::randn({2, 6, 7}), b = at::randn({7, 3});
    OpBuilder ob;
    ob.Tensor(f.hbm.Put(a)).Tensor(f.hbm.Put(b));
    at::Tensor want = at::matmul(a, b);
    CHECK(Same(f.RunInto(f.Op("aten::matmul"), ob, want), want));
  }
  SECTION("a transposed input is read through its strides") {
    at::Tensor a = at::randn({7, 6}), b = at::randn({7, 3});
    Placed pt = Transposed(f.hbm.Put(a));  // a.t(): [6, 7], strides [1, 6]
    OpBuilder ob;
    ob.Tensor(pt).Tensor(f.hbm.Put(b));
    at::Tensor want = at::mm(a.t(), b);
    CHECK(Same(f.RunInto(f.Op("aten::mm"), ob, want), want));
  }
  SECTION("conv2d with bias, stride list and defaults") {
    at::Tensor in = at::randn({2, 3, 9, 9}), w = at::randn({4, 3, 3, 3}),
               bias = at::randn({4});
    at::Tensor want = at::conv2d(in, w, bias, {2, 2}, {1, 1});
    OpBuilder ob;
    ob.Tensor(f.hbm.Put(in))
        .Tensor(f.hbm.Put(w))
        .Tensor(f.hbm.Put(bias))
        .IntList({2, 2})
        .Int(1);  // padding=1 for SymInt[2], as Python would write it
    CHECK(Same(f.RunInto(f.Op("aten::conv2d"), ob, want), want));
  }
  SECTION("a result with a lazy conjugate bit lands conjugated") {
    // linalg_lu_solve(left=False) on complex input returns X^H^H as a view
    // with the conjugate bit: its raw memory holds conj(X).
    at::Tensor a = at::randn({3, 3}, at::kComplexFloat),
               b = at::randn({4, 3}, at::kComplexFloat);
    auto [lu, pivots] = at::linalg_lu_factor(a);
    at::Tensor want =
        at::linalg_lu_solve(lu, pivots, b, /*left=*/false, /*adjoint=*/false);
    REQUIRE(want.is_conj());
    OpBuilder ob;
    ob.Tensor(f.hbm.Put(lu))
        .Tensor(f.hbm.Put(pivots))
        .Tensor(f.hbm.Put(b))
        .Bool(false)
        .Bool(false);
    CHECK(
        Same(f.RunInto(f.Op("aten::linalg_lu_solve"), ob, want.resolve_conj()),
             want.resolve_conj()));
  }
  SECTION("conv2d without bias (an undefined tensor)") {
    at::Tensor in = at::randn({1, 2, 5, 5}), w = at::randn({3, 2, 3, 3});
    at::Tensor want = at::conv2d(in, w);
    OpBuilder ob;
    ob.Tensor(f.hbm.Put(in)).Tensor(f.hbm.Put(w)).Undefined();
    CHECK(Same(f.RunInto(f.Op("aten::conv2d"), ob, want), want));
  }
}

TEST_CASE("indexing and tensor lists match ATen on CPU") {
  Fixture f;
  at::Tensor x = at::randn({5, 6});
  Placed px = f.hbm.Put(x);

  SECTION("index_select") {
    at::Tensor idx = at::tensor({4, 0, 2}, at::kLong);
    at::Tensor want = at::index_select(x, 1, idx);
    OpBuilder ob;
    ob.Tensor(px).Int(1).Tensor(f.hbm.Put(idx, 1));
    CHECK(Same(f.RunInto(f.Op("aten::index_select"), ob, want), want));
  }
  SECTION("index.Tensor with an absent index") {
    at::Tensor idx = at::tensor({5, 1, 1}, at::kLong);
    Placed pidx = f.hbm.Put(idx);
    c10::List<std::optional<at::Tensor>> indices;
    indices.push_back(std::nullopt);
    indices.push_back(idx);
    at::Tensor want = at::index(x, indices);  // x[:, idx]
    OpBuilder ob;
    ob.Tensor(px).OptionalTensorList({nullptr, &pidx});
    CHECK(Same(f.RunInto(f.Op("aten::index", "Tensor"), ob, want), want));
  }
  SECTION("index.Tensor with every index present, sent as a tensor list") {
    at::Tensor rows = at::tensor({4, 0}, at::kLong);
    at::Tensor cols = at::tensor({1, 5}, at::kLong);
    c10::List<std::optional<at::Tensor>> indices;
    indices.push_back(rows);
    indices.push_back(cols);
    at::Tensor want = at::index(x, indices);  // x[rows, cols]
    OpBuilder ob;
    ob.Tensor(px).TensorList({f.hbm.Put(rows), f.hbm.Put(cols, 1)});
    CHECK(Same(f.RunInto(f.Op("aten::index", "Tensor"), ob, want), want));
  }
  SECTION("cat of a tensor list") {
    at::Tensor y = at::randn({2, 6});
    at::Tensor want = at::cat({x, y, x});
    OpBuilder ob;
    ob.TensorList({px, f.hbm.Put(y, 1), px});
    CHECK(Same(f.RunInto(f.Op("aten::cat"), ob, want), want));
  }
  SECTION("split_with_sizes: a Tensor[] return fills consecutive outputs") {
    std::vector<at::Tensor> want = at::split_with_sizes(x, {1, 3, 2}, 1);
    OpBuilder ob;
    ob.Tensor(px).IntList({1, 3, 2}).Int(1);
    std::vector<Placed> outs;
    for (const at::Tensor& w : want) {
      outs.push_back(f.hbm.Empty(w.sizes(), w.scalar_type()));
      ob.Output(outs.back());
    }
    std::vector<ResultValue> results;
    absl::Status st = f.Run(f.Op("aten::split_with_sizes"), ob, &results);
    INFO(st.ToString());
    REQUIRE(st.ok());
    REQUIRE(results.size() == 3);
    for (size_t i = 0; i < 3; ++i) {
      CHECK(Same(f.hbm.Get(outs[i].ref), want[i]));
      CHECK(results[i].tensor.address == outs[i].ref.address);
    }
  }
}

// Tensor-by-tensor reference for the packed _foreach_ path: each test runs
// the op through the chip and through ATen on CPU copies, and says whether
// the chip packed it (SimulatedChip::packed_foreach_runs).
struct ForeachCase {
  Fixture& f;
  std::vector<at::Tensor> cpu;  // the first list, as ATen sees it
  std::vector<Placed> placed;

  ForeachCase(Fixture& fixture, const std::vector<at::Tensor>& xs)
      : f(fixture) {
    int s = 0;
    for (const at::Tensor& x : xs) {
      cpu.push_back(x.clone());
      placed.push_back(f.hbm.Put(x, s));
      s = 1 - s;  // alternate segments
    }
  }
  std::vector<at::Tensor> Now() const {
    std::vector<at::Tensor> out;
    for (const Placed& p : placed) out.push_back(f.hbm.Get(p.ref));
    return out;
  }
};

std::vector<Placed> PutAll(Fixture& f, const std::vector<at::Tensor>& ts) {
  std::vector<Placed> out;
  for (const at::Tensor& t : ts) out.push_back(f.hbm.Put(t, 1));
  return out;
}

TEST_CASE(
    "elementwise _foreach_ ops run packed and equal ATen tensor by tensor") {
  Fixture f;
  const std::vector<at::Tensor> xs = {at::randn({16, 16}), at::randn({16}),
                                      at::randn({3, 5, 7})};
  const std::vector<at::Tensor> ys = {at::randn({16, 16}), at::randn({16}),
                                      at::randn({3, 5, 7})};
  const std::vector<at::Tensor> zs = {at::randn({16, 16}), at::randn({16}),
                                      at::randn({3, 5, 7})};
  ForeachCase c(f, xs);
  const uint64_t before = f.chip->packed_foreach_runs();

  SECTION("in place, with a scalar") {
    OpBuilder ob;
    ob.TensorList(c.placed).Double(0.25, tpu::ArgTag::kScalarDouble);
    absl::Status st = f.Run(f.Op("aten::_foreach_add_", "Scalar"), ob);
    INFO(st.ToString());
    REQUIRE(st.ok());
    at::_foreach_add_(c.cpu, 0.25);
    for (size_t k = 0; k < xs.size(); ++k)
      CHECK(at::equal(c.Now()[k], c.cpu[k]));
    CHECK(f.chip->packed_foreach_runs() == before + 1);
  }
  SECTION("in place over three lists (addcmul_), a list read twice") {
    std::vector<Placed> py = PutAll(f, ys);
    OpBuilder ob;
    ob.TensorList(c.placed).TensorList(py).TensorList(py).Double(
        0.3, tpu::ArgTag::kScalarDouble);
    absl::Status st = f.Run(f.Op("aten::_foreach_addcmul_", "Scalar"), ob);
    INFO(st.ToString());
    REQUIRE(st.ok());
    at::_foreach_addcmul_(c.cpu, ys, ys, 0.3);
    for (size_t k = 0; k < xs.size(); ++k)
      CHECK(at::equal(c.Now()[k], c.cpu[k]));
    CHECK(f.chip->packed_foreach_runs() == before + 1);
  }
  SECTION("a new list into the client's outputs, results reported") {
    std::vector<Placed> py = PutAll(f, ys);
    std::vector<at::Tensor> want = at::_foreach_mul(xs, ys);
    OpBuilder ob;
    ob.TensorList(c.placed).TensorList(py);
    std::vector<Placed> outs;
    for (const at::Tensor& w : want) {
      outs.push_back(f.hbm.Empty(w.sizes(), w.scalar_type()));
      ob.Output(outs.back());
    }
    std::vector<ResultValue> results;
    absl::Status st = f.Run(f.Op("aten::_foreach_mul", "List"), ob, &results);
    INFO(st.ToString());
    REQUIRE(st.ok());
    REQUIRE(results.size() == want.size());
    for (size_t k = 0; k < want.size(); ++k) {
      CHECK(at::equal(f.hbm.Get(outs[k].ref), want[k]));
      CHECK(results[k].tensor.address == outs[k].ref.address);
      CHECK(at::equal(c.Now()[k], xs[k]));  // inputs untouched
    }
    CHECK(f.chip->packed_foreach_runs() == before + 1);
  }
  SECTION("a scalar base raised to a list (pow.ScalarAndTensor)") {
    std::vector<at::Tensor> want = at::_foreach_pow(at::Scalar(0.9), xs);
    OpBuilder ob;
    ob.Double(0.9, tpu::ArgTag::kScalarDouble).TensorList(c.placed);
    std::vector<Placed> outs;
    for (const at::Tensor& w : want) {
      outs.push_back(f.hbm.Empty(w.sizes(), w.scalar_type()));
      ob.Output(outs.back());
    }
    absl::Status st = f.Run(f.Op("aten::_foreach_pow", "ScalarAndTensor"), ob);
    INFO(st.ToString());
    REQUIRE(st.ok());
    // pow is transcendental: run packed, an element may take the vector
    // loop where tensor by tensor it took the scalar tail, and differ in the
    // last bit (simulated_chip.h). Within one ulp, never more.
    for (size_t k = 0; k < want.size(); ++k) {
      CHECK(at::allclose(f.hbm.Get(outs[k].ref), want[k], /*rtol=*/1.2e-7,
                         /*atol=*/0));
    }
    CHECK(f.chip->packed_foreach_runs() == before + 1);
  }
}

TEST_CASE(
    "_foreach_ ops whose tensors forbid packing run tensor by tensor, as "
    "ATen") {
  Fixture f;
  const uint64_t before = f.chip->packed_foreach_runs();
  const std::vector<at::Tensor> xs = {at::randn({4, 4}), at::randn({4, 4})};
  ForeachCase c(f, xs);

  SECTION("one tensor twice in the written list is multiplied twice") {
    OpBuilder ob;
    ob.TensorList({c.placed[0], c.placed[0]})
        .Double(2.0, tpu::ArgTag::kScalarDouble);
    REQUIRE(f.Run(f.Op("aten::_foreach_mul_", "Scalar"), ob).ok());
    CHECK(at::equal(c.Now()[0], xs[0] * 4));
  }
  SECTION("a written tensor read at another index sees the earlier result") {
    // x0 += x1, then x1 += x0 (the new x0), as ATen does it in order.
    OpBuilder ob;
    ob.TensorList(c.placed)
        .TensorList({c.placed[1], c.placed[0]})
        .Int(1, tpu::ArgTag::kScalarInt);
    REQUIRE(f.Run(f.Op("aten::_foreach_add_", "List"), ob).ok());
    std::vector<at::Tensor> cpu = {xs[0].clone(), xs[1].clone()};
    at::_foreach_add_(cpu, std::vector<at::Tensor>{cpu[1], cpu[0]});
    CHECK(at::equal(c.Now()[0], cpu[0]));
    CHECK(at::equal(c.Now()[1], cpu[1]));
  }
  SECTION("a strided tensor") {
    OpBuilder ob;
    ob.TensorList({Transposed(c.placed[0]), c.placed[1]})
        .Double(3.0, tpu::ArgTag::kScalarDouble);
    REQUIRE(f.Run(f.Op("aten::_foreach_mul_", "Scalar"), ob).ok());
    CHECK(at::equal(c.Now()[0], xs[0] * 3));
    CHECK(at::equal(c.Now()[1], xs[1] * 3));
  }
  SECTION("mixed dtypes") {
    Placed d = f.hbm.Put(at::randn({4}, at::kDouble));
    at::Tensor d0 = f.hbm.Get(d.ref);
    OpBuilder ob;
    ob.TensorList({c.placed[0], d}).Double(3.0, tpu::ArgTag::kScalarDouble);
    REQUIRE(f.Run(f.Op("aten::_foreach_mul_", "Scalar"), ob).ok());
    CHECK(at::equal(c.Now()[0], xs[0] * 3));
    CHECK(at::equal(f.hbm.Get(d.ref), d0 * 3));
  }
  SECTION("a reduction (_foreach_norm) is never packed") {
    std::vector<at::Tensor> want = at::_foreach_norm(xs, 2);
    OpBuilder ob;
    ob.TensorList(c.placed).Double(2.0, tpu::ArgTag::kScalarDouble);
    std::vector<Placed> outs;
    for (const at::Tensor& w : want) {
      outs.push_back(f.hbm.Empty(w.sizes(), w.scalar_type()));
      ob.Output(outs.back());
    }
    REQUIRE(f.Run(f.Op("aten::_foreach_norm", "Scalar"), ob).ok());
    for (size_t k = 0; k < want.size(); ++k)
      CHECK(Same(f.hbm.Get(outs[k].ref), want[k]));
  }
  SECTION("an op ATen refuses fails with its message and writes nothing") {
    std::vector<Placed> ints = {f.hbm.Put(at::arange(4)),
                                f.hbm.Put(at::arange(4), 1)};
    OpBuilder ob;
    ob.TensorList(ints).Double(0.5, tpu::ArgTag::kScalarDouble);
    absl::Status st = f.Run(f.Op("aten::_foreach_mul_", "Scalar"), ob);
    CHECK(st.code() == absl::StatusCode::kInvalidArgument);
    CHECK(st.message().find("aten::_foreach_mul_") != std::string::npos);
    CHECK(at::equal(f.hbm.Get(ints[0].ref), at::arange(4)));
    CHECK(at::equal(f.hbm.Get(ints[1].ref), at::arange(4)));
  }
  CHECK(f.chip->packed_foreach_runs() == before);
}

TEST_CASE("mixed dtypes follow ATen's promotion") {
  Fixture f;
  SECTION("bfloat16 + float16 -> float32") {
    at::Tensor a = at::randn({7}).to(at::kBFloat16);
    at::Tensor b = at::randn({7}).to(at::kHalf);
    at::Tensor want = a + b;
    REQUIRE(want.scalar_type() == at::kFloat);
    OpBuilder ob;
    ob.Tensor(f.hbm.Put(a)).Tensor(f.hbm.Put(b));
    CHECK(Same(f.RunInto(f.Op("aten::add", "Tensor"), ob, want), want));
  }
  SECTION("int64 * bool") {
    at::Tensor a = at::arange(10, at::kLong);
    at::Tensor b = at::arange(10, at::kLong) % 3 == 0;
    at::Tensor want = a * b;
    OpBuilder ob;
    ob.Tensor(f.hbm.Put(a)).Tensor(f.hbm.Put(b));
    CHECK(Same(f.RunInto(f.Op("aten::mul", "Tensor"), ob, want), want));
  }
  SECTION("complex64 times a complex scalar") {
    at::Tensor a = at::randn({5}, at::kComplexFloat);
    at::Tensor want = at::mul(a, c10::Scalar(c10::complex<double>(0.5, -2)));
    OpBuilder ob;
    ob.Tensor(f.hbm.Put(a)).Complex(0.5, -2, tpu::ArgTag::kScalarComplex);
    CHECK(Same(f.RunInto(f.Op("aten::mul", "Scalar"), ob, want), want));
  }
  SECTION("ones with dtype, layout and a tpu device made on the CPU") {
    at::Tensor want = at::ones({2, 3}, at::kHalf);
    OpBuilder ob;
    ob.IntList({2, 3})
        .Dtype(at::kHalf)
        .Layout(at::kStrided)
        .Device(c10::DeviceType::PrivateUse1, 0)
        .None();
    CHECK(Same(f.RunInto(f.Op("aten::ones"), ob, want), want));
  }
}

TEST_CASE("the synchronous path reports scalars and data-dependent tensors") {
  Fixture f;
  std::shared_ptr<const BackendOp> item = f.Op("aten::_local_scalar_dense");
  std::vector<ResultValue> results;

  SECTION("float") {
    OpBuilder ob;
    ob.Tensor(f.hbm.Put(at::full({1}, 2.75)));
    REQUIRE(f.Run(item, ob, &results).ok());
    REQUIRE(results.size() == 1);
    CHECK(results[0].kind == ResultValue::Kind::kDouble);
    CHECK(results[0].d == 2.75);
  }
  SECTION("int64") {
    OpBuilder ob;
    ob.Tensor(f.hbm.Put(at::scalar_tensor(-123456789012, at::kLong)));
    REQUIRE(f.Run(item, ob, &results).ok());
    REQUIRE(results.size() == 1);
    CHECK(results[0].kind == ResultValue::Kind::kInt);
    CHECK(results[0].i == -123456789012);
  }
  SECTION("bool") {
    OpBuilder ob;
    ob.Tensor(f.hbm.Put(at::scalar_tensor(true, at::kBool)));
    REQUIRE(f.Run(item, ob, &results).ok());
    REQUIRE(results.size() == 1);
    CHECK(results[0].kind == ResultValue::Kind::kBool);
    CHECK(results[0].b);
  }
  SECTION("complex") {
    OpBuilder ob;
    ob.Tensor(f.hbm.Put(at::scalar_tensor(c10::complex<double>(1.5, -0.5),
                                          at::kComplexDouble)));
    REQUIRE(f.Run(item, ob, &results).ok());
    REQUIRE(results.size() == 1);
    CHECK(results[0].kind == ResultValue::Kind::kComplex);
    CHECK(results[0].d == 1.5);
    CHECK(results[0].d_imag == -0.5);
  }
  SECTION("nonzero goes to memory from the result allocator") {
    at::Tensor x = at::tensor({0, 3, 0, 0, 7, 1}, at::kInt).reshape({2, 3});
    at::Tensor want = at::nonzero(x);
    OpBuilder ob;
    ob.Tensor(f.hbm.Put(x));
    TestResultAllocator alloc(f.hbm);
    absl::Status st = f.Run(f.Op("aten::nonzero"), ob, &results, &alloc);
    INFO(st.ToString());
    REQUIRE(st.ok());
    CHECK(alloc.calls == 1);
    REQUIRE(results.size() == 1);
    REQUIRE(results[0].kind == ResultValue::Kind::kTensor);
    const tpu::TensorRef& r = results[0].tensor;
    CHECK(tpu::DeviceAddressChip(r.address) == 0);
    CHECK(r.address >= f.hbm.segment(1).segment_address);
    CHECK(r.storage_offset == 0);
    CHECK(r.ndim == 2);
    CHECK(r.strides[0] == 2);
    CHECK(r.strides[1] == 1);
    CHECK(Same(f.hbm.Get(r), want));
  }
  SECTION("nonzero of all zeros is empty and takes no memory") {
    OpBuilder ob;
    ob.Tensor(f.hbm.Put(at::zeros({4})));
    TestResultAllocator alloc(f.hbm);
    REQUIRE(f.Run(f.Op("aten::nonzero"), ob, &results, &alloc).ok());
    CHECK(alloc.calls == 0);
    REQUIRE(results.size() == 1);
    CHECK(results[0].kind == ResultValue::Kind::kTensor);
    CHECK(results[0].tensor.address == 0);
    CHECK(results[0].tensor.ndim == 2);
    CHECK(results[0].tensor.sizes[0] == 0);
    CHECK(results[0].tensor.sizes[1] == 1);
  }
}

TEST_CASE("a kernel's ZeroTensor result is written as zeros, never read") {
  // _efficientzerotensor returns a tensor with no memory at all: copying
  // from it would read address 0 and bring the executor down.
  Fixture f;
  std::shared_ptr<const BackendOp> zeros = f.Op("aten::_efficientzerotensor");
  SECTION("into the client's output") {
    Placed out = f.hbm.Put(at::full({2, 3}, 7.0f));
    OpBuilder ob;
    ob.IntList({2, 3}).None().None().None().None().Output(out);
    absl::Status st = f.Run(zeros, ob);
    INFO(st.ToString());
    REQUIRE(st.ok());
    CHECK(Same(f.hbm.Get(out.ref), at::zeros({2, 3})));
  }
  SECTION("into result memory on the synchronous path") {
    OpBuilder ob;
    ob.IntList({4}).None().None().None().None();
    std::vector<ResultValue> results;
    TestResultAllocator alloc(f.hbm);
    char* next;
    f.hbm.Reserve(1, 0, &next);   // where the allocator's next block starts
    std::memset(next, 0x7f, 64);  // dirty, so that zeros must be written
    REQUIRE(f.Run(zeros, ob, &results, &alloc).ok());
    REQUIRE(results.size() == 1);
    REQUIRE(results[0].kind == ResultValue::Kind::kTensor);
    CHECK(Same(f.hbm.Get(results[0].tensor), at::zeros({4})));
  }
}

TEST_CASE("lookup refuses unknown operators and schemas that differ") {
  std::unique_ptr<SimulatedChip> chip = SimulatedChip::Create(0);

  SECTION("the same schema resolves, and again from the cache") {
    const std::string s = SchemaOf("aten::add", "Tensor");
    CHECK(s ==
          "aten::add.Tensor(Tensor self, Tensor other, *, Scalar alpha=1) -> "
          "Tensor");
    auto a = chip->LookupOp(s);
    auto b = chip->LookupOp(s);
    REQUIRE(a.ok());
    REQUIRE(b.ok());
    CHECK((*a)->schema() == s);
    CHECK(a->get() == b->get());
  }
  SECTION("a changed default") {
    const std::string client =
        "aten::add.Tensor(Tensor self, Tensor other, *, Scalar alpha=2) -> "
        "Tensor";
    auto op = chip->LookupOp(client);
    REQUIRE(!op.ok());
    CHECK(op.status().code() == absl::StatusCode::kInvalidArgument);
    const std::string msg(op.status().message());
    INFO(msg);
    CHECK(msg.find("aten::add.Tensor") != std::string::npos);
    CHECK(msg.find(SchemaOf("aten::add", "Tensor")) != std::string::npos);
    CHECK(msg.find(client) != std::string::npos);
  }
  SECTION("an unknown operator") {
    auto op = chip->LookupOp("aten::no_such_op(Tensor self) -> Tensor");
    REQUIRE(!op.ok());
    CHECK(op.status().code() == absl::StatusCode::kInvalidArgument);
    INFO(op.status().message());
    CHECK(op.status().message().find("unknown operator aten::no_such_op") !=
          absl::string_view::npos);
  }
  SECTION("a malformed schema") {
    auto op = chip->LookupOp("add");
    REQUIRE(!op.ok());
    CHECK(op.status().code() == absl::StatusCode::kInvalidArgument);
  }
}

TEST_CASE("errors name the op and leave no exception") {
  Fixture f;
  SECTION("a kernel error") {
    OpBuilder ob;
    ob.Tensor(f.hbm.Put(at::randn({2, 3})));
    ob.Tensor(f.hbm.Put(at::randn({4, 5})));
    ob.Output(f.hbm.Empty({2, 5}, at::kFloat));
    absl::Status st = f.Run(f.Op("aten::mm"), ob);
    INFO(st.ToString());
    CHECK(st.code() == absl::StatusCode::kInvalidArgument);
    CHECK(st.message().find("aten::mm") != absl::string_view::npos);
    CHECK(st.message().find("Exception raised from") ==
          absl::string_view::npos);
  }
  SECTION("an output of the wrong shape") {
    OpBuilder ob;
    ob.Tensor(f.hbm.Put(at::randn({2, 3})));
    ob.Tensor(f.hbm.Put(at::randn({2, 3})));
    ob.Output(f.hbm.Empty({3, 2}, at::kFloat));
    absl::Status st = f.Run(f.Op("aten::add", "Tensor"), ob);
    INFO(st.ToString());
    CHECK(st.code() == absl::StatusCode::kInvalidArgument);
    CHECK(st.message() ==
          "aten::add.Tensor: output 0: got [2, 3] Float with strides [3, 1], "
          "client "
          "allocated [3, 2] Float with strides [2, 1]");
  }
  SECTION("an output of the wrong dtype") {
    OpBuilder ob;
    ob.Tensor(f.hbm.Put(at::randn({2}))).Tensor(f.hbm.Put(at::randn({2})));
    ob.Output(f.hbm.Empty({2}, at::kHalf));
    absl::Status st = f.Run(f.Op("aten::add", "Tensor"), ob);
    INFO(st.ToString());
    CHECK(st.code() == absl::StatusCode::kInvalidArgument);
    CHECK(st.message().find("Half") != absl::string_view::npos);
  }
  SECTION("a misaligned address") {
    Placed p = f.hbm.Put(at::randn({4}));
    p.ref.address += 2;
    p.ref.sizes[0] = 3;
    OpBuilder ob;
    ob.Tensor(p).Tensor(p).Output(f.hbm.Empty({3}, at::kFloat));
    absl::Status st = f.Run(f.Op("aten::add", "Tensor"), ob);
    INFO(st.ToString());
    CHECK(st.code() == absl::StatusCode::kInvalidArgument);
    CHECK(st.message().find("element size 4") != absl::string_view::npos);
  }
  SECTION("an address inside the segment is fine when aligned") {
    at::Tensor x = at::arange(8, at::kFloat);
    Placed p = f.hbm.Put(x);
    p.ref.address += 4 * 4;  // elements [4, 8)
    p.ref.sizes[0] = 4;
    OpBuilder ob;
    ob.Tensor(p).Tensor(p);
    CHECK(Same(f.RunInto(f.Op("aten::add", "Tensor"), ob, at::zeros({4})),
               x.slice(0, 4) * 2));
  }
  SECTION("a tensor reaching past its segment") {
    Placed p = f.hbm.Put(at::randn({4}));
    p.ref.sizes[0] = kSegmentBytes;  // elements, so far past the end
    OpBuilder ob;
    ob.Tensor(p);
    absl::Status st = f.Run(f.Op("aten::neg"), ob);
    INFO(st.ToString());
    CHECK(st.code() == absl::StatusCode::kInvalidArgument);
  }
  SECTION("too many arguments") {
    OpBuilder ob;
    Placed p = f.hbm.Put(at::randn({4}));
    ob.Tensor(p).Tensor(p);
    absl::Status st = f.Run(f.Op("aten::neg"), ob);
    INFO(st.ToString());
    CHECK(st.code() == absl::StatusCode::kInvalidArgument);
  }
  SECTION("a missing argument without default") {
    OpBuilder ob;
    ob.Tensor(f.hbm.Put(at::randn({4})));
    absl::Status st = f.Run(f.Op("aten::mm"), ob);
    INFO(st.ToString());
    CHECK(st.code() == absl::StatusCode::kInvalidArgument);
    CHECK(st.message().find("mat2") != absl::string_view::npos);
  }
  SECTION("an argument of the wrong type") {
    OpBuilder ob;
    ob.Int(3).Tensor(f.hbm.Put(at::randn({4})));
    absl::Status st = f.Run(f.Op("aten::add", "Tensor"), ob);
    INFO(st.ToString());
    CHECK(!st.ok());
  }
}

TEST_CASE("streams on several threads run at once") {
  Fixture f;
  std::shared_ptr<const BackendOp> add = f.Op("aten::add", "Tensor");
  constexpr int kThreads = 4;
  constexpr int kIters = 500;
  std::vector<OpBuilder> builders(kThreads);
  std::vector<Placed> outs;
  for (int t = 0; t < kThreads; ++t) {
    builders[t]
        .Tensor(f.hbm.Put(at::full({16}, t)))
        .Tensor(f.hbm.Put(at::ones({16})))
        .Output(f.hbm.Empty({16}, at::kFloat, 1));
    outs.push_back(Placed{builders[t].decoded().outputs[0], f.hbm.segment(1)});
  }
  std::vector<int> failures(kThreads, 0);
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < kIters; ++i) {
        if (!f.chip->LookupOp(SchemaOf("aten::add", "Tensor")).ok() ||
            !f.Run(add, builders[t]).ok()) {
          ++failures[t];
        }
      }
    });
  }
  for (std::thread& th : threads) th.join();
  for (int t = 0; t < kThreads; ++t) {
    CHECK(failures[t] == 0);
    CHECK(Same(f.hbm.Get(outs[t].ref), at::full({16}, t + 1.0)));
  }
}

TEST_CASE("timing of a one-element add (printed, not asserted)") {
  Fixture f;
  constexpr int kCalls = 100000;
  Placed a = f.hbm.Put(at::ones({1})), b = f.hbm.Put(at::ones({1}));
  Placed out = f.hbm.Empty({1}, at::kFloat);

  OpBuilder add_out;
  add_out.Tensor(a).Tensor(b).Int(1, tpu::ArgTag::kScalarInt).Tensor(out);
  OpBuilder add;
  add.Tensor(a).Tensor(b).Int(1, tpu::ArgTag::kScalarInt).Output(out);
  std::shared_ptr<const BackendOp> add_out_op = f.Op("aten::add", "out");
  std::shared_ptr<const BackendOp> add_op = f.Op("aten::add", "Tensor");
  const std::vector<ResolvedTensor> add_out_tensors = add_out.tensors();
  const std::vector<ResolvedTensor> add_tensors = add.tensors();

  using Clock = std::chrono::steady_clock;
  auto ns_per_op = [](Clock::time_point t0) {
    return std::chrono::duration<double, std::nano>(Clock::now() - t0).count() /
           kCalls;
  };
  int failures = 0;
  for (int i = 0; i < 1000; ++i) {  // warm up
    failures += !f.chip
                     ->Run(*add_out_op, add_out.decoded(), add_out_tensors,
                           nullptr, nullptr)
                     .ok();
  }
  Clock::time_point t0 = Clock::now();
  for (int i = 0; i < kCalls; ++i) {
    failures += !f.chip
                     ->Run(*add_out_op, add_out.decoded(), add_out_tensors,
                           nullptr, nullptr)
                     .ok();
  }
  const double run_out_ns = ns_per_op(t0);
  t0 = Clock::now();
  for (int i = 0; i < kCalls; ++i) {
    failures +=
        !f.chip->Run(*add_op, add.decoded(), add_tensors, nullptr, nullptr)
             .ok();
  }
  const double run_functional_ns = ns_per_op(t0);

  at::Tensor va = f.hbm.View(a.ref), vb = f.hbm.View(b.ref),
             vout = f.hbm.View(out.ref);
  for (int i = 0; i < 1000; ++i) at::add_out(vout, va, vb);
  t0 = Clock::now();
  for (int i = 0; i < kCalls; ++i) at::add_out(vout, va, vb);
  const double direct_ns = ns_per_op(t0);

  CHECK(failures == 0);
  CHECK(Same(f.hbm.Get(out.ref), at::full({1}, 2.0)));
  std::printf(
      "{\"bench\": \"simulated_chip_add_1elem\", \"calls\": %d, "
      "\"run_add_out_ns\": %.0f, \"run_add_tensor_ns\": %.0f, "
      "\"direct_at_add_out_ns\": %.0f}\n",
      kCalls, run_out_ns, run_functional_ns, direct_ns);
}

}  // namespace
}  // namespace tpud
