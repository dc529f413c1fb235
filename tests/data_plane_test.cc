// The data plane end to end: a real tpud, libtpuclient's op streams, and the
// same ops run directly with ATen in this process as the reference.
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <signal.h>

#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/time/clock.h"
#include "catch2_compat/catch.h"
#include "tests/daemon_harness.h"
#include "tpu/client.h"
#include "tpu/device_address.h"

namespace {

using tpud_test::TestDaemon;

std::unique_ptr<tpu::Session> Open(const TestDaemon& d) {
  tpu::ClientOptions o;
  o.socket_path = d.socket();
  o.client_name = "data_plane_test";
  o.pinned_pool_bytes = 64 << 20;
  absl::StatusOr<std::unique_ptr<tpu::Session>> s = tpu::Session::Open(o);
  INFO(s.status().ToString());
  REQUIRE(s.ok());
  return *std::move(s);
}

// A device tensor: its segment and its reference.
struct DevTensor {
  tpu::TensorRef ref;
  uint64_t segment = 0;
};

tpu::TensorRef RefFor(uint64_t address, const at::Tensor& like) {
  tpu::TensorRef r;
  r.address = address;
  r.storage_offset = like.storage_offset();
  r.dtype = static_cast<int8_t>(like.scalar_type());
  r.ndim = static_cast<uint8_t>(like.dim());
  for (int d = 0; d < like.dim(); ++d) {
    r.sizes[d] = like.size(d);
    r.strides[d] = like.stride(d);
  }
  return r;
}

// Uploads a CPU tensor (its whole storage, so views keep their layout).
DevTensor Upload(tpu::Session& s, const at::Tensor& cpu, int chip = 0) {
  const uint64_t nbytes = std::max<uint64_t>(cpu.storage().nbytes(), 1);
  absl::StatusOr<tpu::Segment> seg = s.Allocate(chip, nbytes);
  REQUIRE(seg.ok());
  if (cpu.storage().nbytes() > 0) {
    REQUIRE(s.CopyToDevice(0, seg->address, cpu.storage().data(),
                           cpu.storage().nbytes())
                .ok());
  }
  return {RefFor(seg->address, cpu), seg->address};
}

// A device tensor shaped like `like` (contiguous), uninitialised.
DevTensor Empty(tpu::Session& s, const at::Tensor& like, int chip = 0) {
  return Upload(s, at::empty_like(like, at::MemoryFormat::Contiguous), chip);
}

at::Tensor Download(tpu::Session& s, const tpu::TensorRef& r) {
  std::vector<int64_t> sizes(r.sizes, r.sizes + r.ndim),
      strides(r.strides, r.strides + r.ndim);
  int64_t span = 1;
  for (int d = 0; d < r.ndim; ++d) {
    if (sizes[d] == 0) span = 0;
  }
  if (span != 0) {
    for (int d = 0; d < r.ndim; ++d) span += (sizes[d] - 1) * strides[d];
    span += r.storage_offset;
  }
  at::Tensor storage = at::empty(
      {span}, at::TensorOptions().dtype(static_cast<at::ScalarType>(r.dtype)));
  absl::Status st =
      s.CopyToHost(0, storage.data_ptr(), r.address, storage.nbytes());
  INFO(st.ToString());
  REQUIRE(st.ok());
  return storage.as_strided(sizes, strides, r.storage_offset);
}

tpu::OpArg T(const DevTensor& t) {
  tpu::OpArg a;
  a.tag = tpu::ArgTag::kTensor;
  a.tensor = t.ref;
  return a;
}
tpu::OpArg I(int64_t v) {
  tpu::OpArg a;
  a.tag = tpu::ArgTag::kInt;
  a.i = v;
  return a;
}
tpu::OpArg D(double v) {
  tpu::OpArg a;
  a.tag = tpu::ArgTag::kDouble;
  a.d = v;
  return a;
}
tpu::OpArg B(bool v) {
  tpu::OpArg a;
  a.tag = tpu::ArgTag::kBool;
  a.b = v;
  return a;
}
tpu::OpArg ScalarD(double v) {
  tpu::OpArg a;
  a.tag = tpu::ArgTag::kScalarDouble;
  a.d = v;
  return a;
}
tpu::OpArg ScalarI(int64_t v) {
  tpu::OpArg a;
  a.tag = tpu::ArgTag::kScalarInt;
  a.i = v;
  return a;
}
tpu::OpArg Ints(std::vector<int64_t> v) {
  tpu::OpArg a;
  a.tag = tpu::ArgTag::kIntList;
  a.ints = std::move(v);
  return a;
}
tpu::OpArg None() { return tpu::OpArg{}; }
tpu::OpArg Dtype(at::ScalarType t) {
  tpu::OpArg a;
  a.tag = tpu::ArgTag::kDtype;
  a.i = static_cast<int64_t>(t);
  return a;
}

std::string SchemaOf(const char* name, const char* overload) {
  auto op = c10::Dispatcher::singleton().findSchema({name, overload});
  REQUIRE(op.has_value());
  return c10::toString(op->schema());
}

// Enqueues `name.overload` with `args`, writing its result into a new device
// tensor shaped like `expected`; returns that tensor downloaded.
at::Tensor Run(tpu::Session& s, const char* name, const char* overload,
               std::vector<tpu::OpArg> args, const at::Tensor& expected) {
  absl::StatusOr<uint32_t> id = s.DefineOp(SchemaOf(name, overload));
  REQUIRE(id.ok());
  DevTensor out = Empty(s, expected);
  absl::StatusOr<uint64_t> seq =
      s.EnqueueOp(0, *id, args.data(), args.size(), &out.ref, 1);
  REQUIRE(seq.ok());
  absl::Status st = s.Synchronize(0);
  INFO(st.ToString());
  REQUIRE(st.ok());
  return Download(s, out.ref);
}

void RequireClose(const at::Tensor& got, const at::Tensor& want) {
  INFO("got " << got << "\nwant " << want);
  REQUIRE(got.scalar_type() == want.scalar_type());
  REQUIRE(got.sizes() == want.sizes());
  if (at::isFloatingType(want.scalar_type()) ||
      at::isComplexType(want.scalar_type())) {
    REQUIRE(at::allclose(got, want, 1e-3, 1e-4));
  } else {
    REQUIRE(at::equal(got, want));
  }
}

TEST_CASE("ATen ops through the daemon match ATen run directly") {
  TestDaemon d;
  auto s = Open(d);
  at::manual_seed(0);
  at::Tensor a = at::randn({17, 33});
  at::Tensor b = at::randn({17, 33});
  at::Tensor row = at::randn({33});
  DevTensor da = Upload(*s, a), db = Upload(*s, b), drow = Upload(*s, row);

  SECTION("elementwise with alpha, and broadcasting") {
    RequireClose(Run(*s, "aten::add", "Tensor", {T(da), T(db), ScalarD(2.5)},
                     a + 2.5 * b),
                 at::add(a, b, 2.5));
    RequireClose(Run(*s, "aten::mul", "Tensor", {T(da), T(drow)}, a * row),
                 a * row);
  }
  SECTION("reductions") {
    RequireClose(Run(*s, "aten::sum", "dim_IntList",
                     {T(da), Ints({1}), B(true), None()}, a.sum({1}, true)),
                 a.sum({1}, true));
    RequireClose(Run(*s, "aten::mean", "dim",
                     {T(da), Ints({0}), B(false), None()}, a.mean({0})),
                 a.mean({0}));
    RequireClose(
        Run(*s, "aten::amax", "", {T(da), Ints({1}), B(false)}, a.amax({1})),
        a.amax({1}));
  }
  SECTION("matmul and conv") {
    at::Tensor m = at::randn({33, 8});
    DevTensor dm = Upload(*s, m);
    RequireClose(Run(*s, "aten::mm", "", {T(da), T(dm)}, at::mm(a, m)),
                 at::mm(a, m));
    at::Tensor x = at::randn({2, 3, 9, 9}), w = at::randn({4, 3, 3, 3}),
               bias = at::randn({4});
    at::Tensor want = at::conv2d(x, w, bias, {1, 1}, {1, 1});
    RequireClose(Run(*s, "aten::conv2d", "",
                     {T(Upload(*s, x)), T(Upload(*s, w)), T(Upload(*s, bias)),
                      Ints({1, 1}), Ints({1, 1}), Ints({1, 1}), I(1)},
                     want),
                 want);
  }
  SECTION("views via strides: a transposed input") {
    at::Tensor t = a.t();
    DevTensor dt{RefFor(da.segment, t), da.segment};
    at::Tensor want = at::relu(t);
    RequireClose(Run(*s, "aten::relu", "", {T(dt)}, want), want);
  }
  SECTION("indexing") {
    at::Tensor idx = at::tensor({3, 0, 16, 3}, at::kLong);
    at::Tensor want = a.index_select(0, idx);
    RequireClose(Run(*s, "aten::index_select", "",
                     {T(da), I(0), T(Upload(*s, idx))}, want),
                 want);
    tpu::OpArg indices;
    indices.tag = tpu::ArgTag::kOptionalTensorList;
    indices.tensors = {tpu::TensorRef{},
                       Upload(*s, at::tensor({1, 2}, at::kLong)).ref};
    indices.tensor_present = {false, true};
    at::Tensor want2 =
        a.index({at::indexing::Slice(), at::tensor({1, 2}, at::kLong)});
    RequireClose(Run(*s, "aten::index", "Tensor", {T(da), indices}, want2),
                 want2);
  }
  SECTION("in place and out=") {
    absl::StatusOr<uint32_t> add_ =
        s->DefineOp(SchemaOf("aten::add_", "Tensor"));
    REQUIRE(add_.ok());
    std::vector<tpu::OpArg> args = {T(da), T(db), ScalarI(1)};
    REQUIRE(s->EnqueueOp(0, *add_, args.data(), args.size(), nullptr, 0).ok());
    REQUIRE(s->Synchronize(0).ok());
    RequireClose(Download(*s, da.ref), a + b);
    DevTensor out = Empty(*s, a);
    absl::StatusOr<uint32_t> add_out =
        s->DefineOp(SchemaOf("aten::add", "out"));
    REQUIRE(add_out.ok());
    std::vector<tpu::OpArg> oargs = {T(db), T(db), ScalarI(1), T(out)};
    REQUIRE(
        s->EnqueueOp(0, *add_out, oargs.data(), oargs.size(), nullptr, 0).ok());
    REQUIRE(s->Synchronize(0).ok());
    RequireClose(Download(*s, out.ref), b + b);
  }
  SECTION("dtypes: bfloat16, float16, int64, bool, complex64") {
    for (at::ScalarType t : {at::kBFloat16, at::kHalf}) {
      at::Tensor x = a.to(t), y = b.to(t);
      RequireClose(Run(*s, "aten::mul", "Tensor",
                       {T(Upload(*s, x)), T(Upload(*s, y))}, x * y),
                   x * y);
    }
    at::Tensor i = at::randint(-100, 100, {40}, at::kLong);
    RequireClose(Run(*s, "aten::mul", "Tensor",
                     {T(Upload(*s, i)), T(Upload(*s, i))}, i * i),
                 i * i);
    at::Tensor m = i > 0;
    at::Tensor want = at::where(m, i, at::zeros_like(i));
    RequireClose(Run(*s, "aten::where", "self",
                     {T(Upload(*s, m)), T(Upload(*s, i)),
                      T(Upload(*s, at::zeros_like(i)))},
                     want),
                 want);
    at::Tensor c = at::randn({12}, at::kComplexFloat);
    RequireClose(Run(*s, "aten::mul", "Tensor",
                     {T(Upload(*s, c)), T(Upload(*s, c))}, c * c),
                 c * c);
    at::Tensor mixed = a.to(at::kHalf) + b;  // type promotion: float
    RequireClose(
        Run(*s, "aten::add", "Tensor",
            {T(Upload(*s, a.to(at::kHalf))), T(db), ScalarI(1)}, mixed),
        mixed);
  }
  SECTION("softmax") {
    at::Tensor want = at::_softmax(a, 1, false);
    RequireClose(Run(*s, "aten::_softmax", "", {T(da), I(1), B(false)}, want),
                 want);
  }
}

TEST_CASE(
    "synchronous path: scalars and data-dependent shapes in one round trip") {
  TestDaemon d;
  auto s = Open(d);
  at::Tensor x = at::tensor({0.0f, 2.5f, 0.0f, -1.0f});
  DevTensor dx = Upload(*s, x);
  tpu::TensorRef one = dx.ref;
  one.ndim = 0;
  one.storage_offset = 1;
  absl::StatusOr<uint32_t> item =
      s->DefineOp(SchemaOf("aten::_local_scalar_dense", ""));
  REQUIRE(item.ok());
  tpu::OpArg arg;
  arg.tag = tpu::ArgTag::kTensor;
  arg.tensor = one;
  absl::StatusOr<std::vector<tpu::OpResult>> r =
      s->RunSync(0, *item, &arg, 1, nullptr, 0);
  INFO(r.status().ToString());
  REQUIRE(r.ok());
  REQUIRE(r->size() == 1);
  CHECK((*r)[0].kind == tpu::OpResult::Kind::kDouble);
  CHECK((*r)[0].d == 2.5);

  absl::StatusOr<uint32_t> nz = s->DefineOp(SchemaOf("aten::nonzero", ""));
  REQUIRE(nz.ok());
  tpu::OpArg xa = T(dx);
  r = s->RunSync(0, *nz, &xa, 1, nullptr, 0);
  REQUIRE(r.ok());
  REQUIRE((*r)[0].kind == tpu::OpResult::Kind::kTensor);
  const tpu::TensorRef& t = (*r)[0].tensor;
  REQUIRE(t.ndim == 2);
  CHECK(t.sizes[0] == 2);
  CHECK(t.sizes[1] == 1);
  RequireClose(Download(*s, t), at::nonzero(x));
  // The result's segment belongs to this session and is freed like any other.
  CHECK(s->Free(t.address).ok());
}

TEST_CASE(
    "copies: pageable and pinned, both ways, device to device across chips") {
  TestDaemon d({}, "512MiB");
  auto s = Open(d);
  const uint64_t n = (40 << 20) + 12345;  // several staging chunks and a tail
  std::vector<uint8_t> src(n);
  for (uint64_t i = 0; i < n; ++i)
    src[i] = static_cast<uint8_t>(i * 2654435761u >> 13);
  absl::StatusOr<tpu::Segment> a = s->Allocate(0, n);
  absl::StatusOr<tpu::Segment> b = s->Allocate(3, n);
  REQUIRE(a.ok());
  REQUIRE(b.ok());
  REQUIRE(s->CopyToDevice(0, a->address, src.data(), n).ok());
  REQUIRE(s->CopyOnDevice(0, b->address, a->address, n).ok());
  std::vector<uint8_t> back(n, 0);
  REQUIRE(s->CopyToHost(0, back.data(), b->address, n).ok());
  CHECK(back == src);

  absl::StatusOr<void*> pinned = s->AllocatePinned(n);
  REQUIRE(pinned.ok());
  CHECK(s->IsPinned(*pinned));
  CHECK_FALSE(s->IsPinned(src.data()));
  std::memset(*pinned, 0, n);
  REQUIRE(s->CopyToHost(0, *pinned, a->address, n).ok());
  CHECK(std::memcmp(*pinned, src.data(), n) == 0);
  std::memset(*pinned, 7, 4096);
  REQUIRE(s->CopyToDevice(0, a->address, *pinned, 4096).ok());
  REQUIRE(s->CopyToHost(0, back.data(), a->address, 4096).ok());
  CHECK(back[0] == 7);
  CHECK(back[4095] == 7);
  REQUIRE(s->FreePinned(*pinned).ok());
  CHECK(s->AllocatePinned(1ULL << 40).status().code() ==
        absl::StatusCode::kResourceExhausted);

  // Out of bounds: past the segment's end.
  CHECK(s->CopyToHost(0, back.data(), a->address + a->size - 100, 200).code() ==
        absl::StatusCode::kInvalidArgument);
}

TEST_CASE("streams and events: order, cross-stream waits, timing") {
  TestDaemon d;
  auto s = Open(d);
  at::Tensor x = at::ones({256, 256});
  DevTensor dx = Upload(*s, x);
  absl::StatusOr<uint32_t> mm = s->DefineOp(SchemaOf("aten::mm", ""));
  absl::StatusOr<uint32_t> add_ = s->DefineOp(SchemaOf("aten::add_", "Tensor"));
  REQUIRE(mm.ok());
  REQUIRE(add_.ok());
  DevTensor y = Empty(*s, x);
  absl::StatusOr<tpu::Event> start = s->RecordEvent(1);
  REQUIRE(start.ok());
  std::vector<tpu::OpArg> args = {T(dx), T(dx)};
  for (int i = 0; i < 20; ++i)
    REQUIRE(s->EnqueueOp(1, *mm, args.data(), 2, &y.ref, 1).ok());
  absl::StatusOr<tpu::Event> done = s->RecordEvent(1);
  REQUIRE(done.ok());
  // Stream 2 adds 1 to y only after stream 1's matmuls.
  REQUIRE(s->WaitEvent(2, *done).ok());
  std::vector<tpu::OpArg> inc = {T(y), T(dx), ScalarI(1)};
  REQUIRE(s->EnqueueOp(2, *add_, inc.data(), 3, nullptr, 0).ok());
  REQUIRE(s->Synchronize(2).ok());
  CHECK(s->EventDone(*done));
  at::Tensor got = Download(*s, y.ref);
  CHECK(at::equal(got, at::full({256, 256}, 257.0f)));
  absl::StatusOr<double> ms = s->ElapsedMillis(*start, *done);
  REQUIRE(ms.ok());
  CHECK(*ms > 0);
  // A wait with nothing to wait for publishes no record: on the event's own
  // stream (its records run in order), or for an event that is done.
  absl::StatusOr<tpu::Event> on1 = s->RecordEvent(1);
  absl::StatusOr<tpu::Event> on2 = s->RecordEvent(2);
  REQUIRE(on1.ok());
  REQUIRE(on2.ok());
  REQUIRE(s->WaitEvent(1, *on1).ok());
  REQUIRE(s->WaitEvent(2, *done).ok());
  absl::StatusOr<tpu::Event> next1 = s->RecordEvent(1);
  absl::StatusOr<tpu::Event> next2 = s->RecordEvent(2);
  REQUIRE(next1.ok());
  REQUIRE(next2.ok());
  CHECK(next1->sequence == on1->sequence + 1);
  CHECK(next2->sequence == on2->sequence + 1);
  REQUIRE(s->Synchronize(1).ok());
  REQUIRE(s->Synchronize(2).ok());
  for (const auto& e : {*on1, *on2, *next1, *next2}) s->ReleaseEvent(e);
  s->ReleaseEvent(*start);
  s->ReleaseEvent(*done);
  CHECK(s->Synchronize(tpu::kNumStreams).code() ==
        absl::StatusCode::kInvalidArgument);
}

}  // namespace

namespace {

TEST_CASE(
    "an op's error surfaces at the next synchronisation, naming the op; its "
    "outputs are poisoned") {
  TestDaemon d;
  auto s = Open(d);
  at::Tensor a = at::randn({4, 5}), b = at::randn({6, 7});
  DevTensor da = Upload(*s, a), db = Upload(*s, b);
  absl::StatusOr<uint32_t> mm = s->DefineOp(SchemaOf("aten::mm", ""));
  absl::StatusOr<uint32_t> relu = s->DefineOp(SchemaOf("aten::relu", ""));
  absl::StatusOr<uint32_t> neg = s->DefineOp(SchemaOf("aten::neg", ""));
  DevTensor out = Empty(*s, at::empty({4, 7}));
  std::vector<tpu::OpArg> args = {T(da), T(db)};
  // Enqueueing succeeds: the failure is asynchronous.
  REQUIRE(s->EnqueueOp(0, *mm, args.data(), 2, &out.ref, 1).ok());
  // A later op reading the failed op's output fails with the original cause.
  DevTensor out2 = Empty(*s, at::empty({4, 7}));
  tpu::OpArg in = T(out);
  REQUIRE(s->EnqueueOp(0, *relu, &in, 1, &out2.ref, 1).ok());
  // An unrelated op still runs.
  DevTensor out3 = Empty(*s, a);
  tpu::OpArg ina = T(da);
  REQUIRE(s->EnqueueOp(0, *neg, &ina, 1, &out3.ref, 1).ok());
  absl::Status st = s->Synchronize(0);
  INFO(st.ToString());
  REQUIRE_FALSE(st.ok());
  CHECK(absl::StrContains(st.message(), "aten::mm"));
  CHECK(absl::StrContains(st.message(), "1 later error"));
  RequireClose(Download(*s, out3.ref), -a);
  // Reported once: the next synchronisation is clean.
  CHECK(s->Synchronize(0).ok());
  REQUIRE(s->EnqueueOp(0, *relu, &in, 1, &out2.ref, 1).ok());
  st = s->Synchronize(0);
  CHECK(st.code() == absl::StatusCode::kFailedPrecondition);
  CHECK(absl::StrContains(st.message(), "aten::mm"));
}

TEST_CASE(
    "a schema the daemon's torch does not have fails with both schemas named") {
  TestDaemon d;
  auto s = Open(d);
  DevTensor x = Upload(*s, at::ones({3}));
  std::string schema = SchemaOf("aten::add", "Tensor");
  std::string changed = schema;
  changed.replace(changed.find("alpha=1"), 7, "alpha=2");
  absl::StatusOr<uint32_t> id = s->DefineOp(changed);
  REQUIRE(id.ok());
  DevTensor out = Empty(*s, at::ones({3}));
  std::vector<tpu::OpArg> args = {T(x), T(x)};
  REQUIRE(s->EnqueueOp(0, *id, args.data(), 2, &out.ref, 1).ok());
  absl::Status st = s->Synchronize(0);
  CHECK(st.code() == absl::StatusCode::kInvalidArgument);
  CHECK(absl::StrContains(st.message(), schema));
  CHECK(absl::StrContains(st.message(), changed));
  absl::StatusOr<uint32_t> unknown =
      s->DefineOp("aten::no_such_op(Tensor self) -> Tensor");
  REQUIRE(s->EnqueueOp(0, *unknown, args.data(), 1, &out.ref, 1).ok());
  st = s->Synchronize(0);
  CHECK(st.code() == absl::StatusCode::kInvalidArgument);
  CHECK(absl::StrContains(st.message(), "aten::no_such_op"));
}

TEST_CASE("forged tensor references never reach another session's memory") {
  TestDaemon d;
  auto victim = Open(d);
  auto attacker = Open(d);
  at::Tensor secret = at::arange(1024, at::kFloat);
  DevTensor v = Upload(*victim, secret);
  DevTensor mine = Upload(*attacker, at::zeros({1024}));
  absl::StatusOr<uint32_t> copy =
      attacker->DefineOp(SchemaOf("aten::copy_", ""));
  REQUIRE(copy.ok());
  // Read the victim's tensor into mine.
  std::vector<tpu::OpArg> read = {T(mine), T(v), B(false)};
  REQUIRE(attacker->EnqueueOp(0, *copy, read.data(), 3, nullptr, 0).ok());
  absl::Status st = attacker->Synchronize(0);
  CHECK(st.code() == absl::StatusCode::kPermissionDenied);
  // The refused copy_ ran no kernel; what it was to write is poisoned with
  // the reason, so reading it back says so instead of handing out bytes.
  std::vector<float> back(1024, -1.0f);
  absl::Status poisoned =
      attacker->CopyToHost(0, back.data(), mine.segment, 4096);
  CHECK(poisoned.code() == absl::StatusCode::kFailedPrecondition);
  CHECK(absl::StrContains(poisoned.message(), "in another session's memory"));
  CHECK(back == std::vector<float>(1024, -1.0f));
  // Rewritten, it is good again.
  REQUIRE(
      attacker
          ->CopyToDevice(0, mine.segment, at::zeros({1024}).data_ptr(), 4096)
          .ok());
  CHECK(at::equal(Download(*attacker, mine.ref), at::zeros({1024})));
  // Write into the victim's tensor.
  std::vector<tpu::OpArg> write = {T(v), T(mine), B(false)};
  REQUIRE(attacker->EnqueueOp(0, *copy, write.data(), 3, nullptr, 0).ok());
  CHECK(attacker->Synchronize(0).code() == absl::StatusCode::kPermissionDenied);
  // A view of my own segment that reaches past its end.
  DevTensor stretched = mine;
  stretched.ref.sizes[0] = 1 << 20;
  std::vector<tpu::OpArg> over = {T(stretched), T(mine), B(false)};
  REQUIRE(attacker->EnqueueOp(0, *copy, over.data(), 3, nullptr, 0).ok());
  CHECK(attacker->Synchronize(0).code() == absl::StatusCode::kInvalidArgument);
  // Strides that wrap around, a negative offset, a garbage address.
  DevTensor wrap = mine;
  wrap.ref.strides[0] = INT64_MAX / 2;
  std::vector<tpu::OpArg> w = {T(wrap), T(mine), B(false)};
  REQUIRE(attacker->EnqueueOp(0, *copy, w.data(), 3, nullptr, 0).ok());
  CHECK(attacker->Synchronize(0).code() == absl::StatusCode::kInvalidArgument);
  DevTensor garbage = mine;
  garbage.ref.address = 0x1234;
  std::vector<tpu::OpArg> g = {T(garbage), T(mine), B(false)};
  REQUIRE(attacker->EnqueueOp(0, *copy, g.data(), 3, nullptr, 0).ok());
  CHECK(attacker->Synchronize(0).code() == absl::StatusCode::kInvalidArgument);
  // Copies too: another session's memory is PERMISSION_DENIED, as for ops.
  std::vector<float> buf(1024);
  CHECK(attacker->CopyToHost(0, buf.data(), v.segment, 4096).code() ==
        absl::StatusCode::kPermissionDenied);
  // The victim's data is intact and its session unaffected.
  CHECK(at::equal(Download(*victim, v.ref), secret));
  CHECK(victim->Synchronize(0).ok());
}

TEST_CASE("out of memory and drained chips mid-stream") {
  TestDaemon d({"--session_quota_bytes=8MiB"});
  auto s = Open(d);
  at::Tensor x = at::tensor({1.0f, 0.0f, 2.0f});
  DevTensor dx = Upload(*s, x);
  // Fill the quota, then ask for a data-dependent result: no room for it.
  absl::StatusOr<tpu::Segment> filler = s->Allocate(0, (8 << 20) - 4096);
  REQUIRE(filler.ok());
  absl::StatusOr<uint32_t> nz = s->DefineOp(SchemaOf("aten::nonzero", ""));
  tpu::OpArg xa = T(dx);
  absl::StatusOr<std::vector<tpu::OpResult>> r =
      s->RunSync(0, *nz, &xa, 1, nullptr, 0);
  CHECK(r.status().code() == absl::StatusCode::kResourceExhausted);
  CHECK(absl::StrContains(r.status().message(), "quota"));
  REQUIRE(s->Free(filler->address).ok());
  r = s->RunSync(0, *nz, &xa, 1, nullptr, 0);
  CHECK(r.ok());
  // Draining the chip stops new segments, not work on existing ones.
  absl::StatusOr<std::unique_ptr<tpu::AdminClient>> admin =
      tpu::AdminClient::Connect(d.admin_socket());
  REQUIRE(admin.ok());
  REQUIRE((*admin)->DrainChip(0).ok());
  absl::StatusOr<uint32_t> neg = s->DefineOp(SchemaOf("aten::neg", ""));
  REQUIRE(s->EnqueueOp(0, *neg, &xa, 1, &dx.ref, 1).ok());
  REQUIRE(s->Synchronize(0).ok());
  RequireClose(Download(*s, dx.ref), -x);
  r = s->RunSync(0, *nz, &xa, 1, nullptr, 0);
  CHECK(r.status().code() == absl::StatusCode::kFailedPrecondition);
}

TEST_CASE("the daemon going away mid-stream is an error, not a hang") {
  auto d = std::make_unique<TestDaemon>();
  auto s = Open(*d);
  DevTensor x = Upload(*s, at::ones({512, 512}));
  absl::StatusOr<uint32_t> mm = s->DefineOp(SchemaOf("aten::mm", ""));
  std::vector<tpu::OpArg> args = {T(x), T(x)};
  for (int i = 0; i < 50; ++i)
    REQUIRE(s->EnqueueOp(0, *mm, args.data(), 2, &x.ref, 1).ok());
  REQUIRE(d->Stop() == 0);
  absl::Status st = s->Synchronize(0);
  CHECK_FALSE(st.ok());
  CHECK((st.code() == absl::StatusCode::kUnavailable));
}

}  // namespace

namespace {

using tpud_test::BinaryPath;
using tpud_test::ChildProcess;

TEST_CASE(
    "two processes stream at once; kill -9 of one mid-stream harms nothing "
    "else") {
  TestDaemon d({}, "256MiB");
  absl::StatusOr<std::unique_ptr<tpu::AdminClient>> admin =
      tpu::AdminClient::Connect(d.admin_socket());
  REQUIRE(admin.ok());
  // Two well-behaved processes on one chip, each checking its results.
  ChildProcess a(BinaryPath("examples/cpp/stream_add"),
                 {"--socket=" + d.socket(), "--chip=0", "--iterations=3000"});
  ChildProcess b(BinaryPath("examples/cpp/stream_add"),
                 {"--socket=" + d.socket(), "--chip=0", "--iterations=3000",
                  "--stream=3"});
  CHECK(a.Wait(absl::Seconds(60)) == 0);
  CHECK(b.Wait(absl::Seconds(60)) == 0);

  // A process streaming forever on chip 1, killed mid-stream.
  ChildProcess victim(
      BinaryPath("examples/cpp/stream_add"),
      {"--socket=" + d.socket(), "--chip=1", "--iterations=500", "--forever"});
  REQUIRE(TestDaemon::WaitFor(
      [&] {
        absl::StatusOr<std::vector<tpu::SessionInfo>> s =
            (*admin)->ListSessions();
        return s.ok() && s->size() == 1 && (*s)[0].ops_executed > 1000;
      },
      absl::Seconds(20)));
  // Meanwhile this process works on chip 1 too.
  auto s = Open(d);
  at::Tensor x = at::arange(1000, at::kFloat);
  DevTensor dx = Upload(*s, x, 1);
  absl::StatusOr<uint32_t> mul = s->DefineOp(SchemaOf("aten::mul", "Tensor"));
  DevTensor out = Empty(*s, x, 1);
  std::vector<tpu::OpArg> args = {T(dx), T(dx)};
  for (int i = 0; i < 200; ++i)
    REQUIRE(s->EnqueueOp(0, *mul, args.data(), 2, &out.ref, 1).ok());
  victim.Signal(SIGKILL);
  for (int i = 0; i < 200; ++i)
    REQUIRE(s->EnqueueOp(0, *mul, args.data(), 2, &out.ref, 1).ok());
  REQUIRE(s->Synchronize(0).ok());
  CHECK(at::equal(Download(*s, out.ref), x * x));
  // The killed process's memory is back; only ours remains.
  REQUIRE(TestDaemon::WaitFor([&] {
    absl::StatusOr<std::vector<tpu::SessionInfo>> l = (*admin)->ListSessions();
    return l.ok() && l->size() == 1 && (*l)[0].pid == getpid();
  }));
  absl::StatusOr<tpu::DaemonStatus> st = (*admin)->GetStatus();
  REQUIRE(st.ok());
  absl::StatusOr<tpu::MemoryStats> mine = s->GetMemoryStats();
  REQUIRE(mine.ok());
  CHECK(st->topology.chips[1].hbm_used_bytes == mine->chips[1].session_bytes);
  CHECK(st->topology.chips[1].ops_executed > 1000);
}

}  // namespace
