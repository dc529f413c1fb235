#include "daemon/backends/pjrt/pjrt_plugin.h"

#include <cstdint>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "catch2_compat/catch.h"

namespace tpud::pjrt {
namespace {

constexpr char kAdd[] = R"(
module @add {
  func.func public @main(%a: tensor<4xf32>, %b: tensor<4xf32>) -> tensor<4xf32> {
    %0 = stablehlo.add %a, %b : tensor<4xf32>
    return %0 : tensor<4xf32>
  }
}
)";

std::unique_ptr<PjrtPlugin> LoadCpu(int devices = 4) {
  absl::StatusOr<CreateOption> o =
      ParseCreateOption("cpu_device_count=" + std::to_string(devices));
  REQUIRE(o.ok());
  absl::StatusOr<std::unique_ptr<PjrtPlugin>> p =
      PjrtPlugin::Load(TPUD_PJRT_CPU_PLUGIN, {*o});
  INFO(p.status().ToString());
  REQUIRE(p.ok());
  return *std::move(p);
}

TEST_CASE(
    "devices with coordinates are numbered in torus order, the first axis "
    "fastest") {
  auto at = [](std::vector<std::vector<int64_t>> coords) {
    std::vector<DeviceInfo> d(coords.size());
    for (size_t i = 0; i < coords.size(); ++i) {
      d[i].id = static_cast<int>(10 + i);
      d[i].coords = coords[i];
    }
    return d;
  };
  // A 2x2 host listed in an order of the plugin's own (x, y, z as libtpu gives
  // them).
  CHECK(TorusOrder(at({{1, 1, 0}, {0, 0, 0}, {0, 1, 0}, {1, 0, 0}})) ==
        std::vector<size_t>{1, 3, 2, 0});
  // A 2x4 host: chip x + 2y.
  CHECK(
      TorusOrder(at(
          {{0, 3}, {1, 3}, {0, 0}, {1, 0}, {0, 1}, {1, 1}, {0, 2}, {1, 2}})) ==
      std::vector<size_t>{2, 3, 4, 5, 6, 7, 0, 1});
  // The plugin's own order where coordinates do not decide one.
  CHECK(TorusOrder(at({{}, {}, {}})) == std::vector<size_t>{0, 1, 2});
  CHECK(TorusOrder(at({{1, 0}, {0, 0}, {1, 0}})) ==
        std::vector<size_t>{0, 1, 2});  // two share one
  CHECK(TorusOrder(at({{1, 0}, {0}})) ==
        std::vector<size_t>{0, 1});  // ranks differ
  CHECK(TorusOrder({}).empty());
}

TEST_CASE("the CPU plugin loads: API version, platform, its devices") {
  std::unique_ptr<PjrtPlugin> p = LoadCpu(3);
  CHECK(p->api_major() == 0);
  CHECK(p->api_minor() >= 81);
  CHECK(p->platform_name() == "cpu");
  REQUIRE(p->num_devices() == 3);
  for (int i = 0; i < 3; ++i) {
    CHECK(p->devices()[i].id == i);
    CHECK(!p->devices()[i].kind.empty());
  }
  CHECK(absl::StrContains(p->Describe(), "PJRT API 0."));
  CHECK(absl::StrContains(p->Describe(), "platform cpu"));
}

constexpr char kAllReduce[] = R"(
module @all_reduce {
  func.func public @main(%a: tensor<3xf32>) -> tensor<3xf32> {
    %0 = "stablehlo.all_reduce"(%a) ({
      ^bb0(%x: tensor<f32>, %y: tensor<f32>):
        %s = stablehlo.add %x, %y : tensor<f32>
        stablehlo.return %s : tensor<f32>
    }) {replica_groups = dense<[[0, 1, 2]]> : tensor<1x3xi64>} : (tensor<3xf32>) -> tensor<3xf32>
    return %0 : tensor<3xf32>
  }
}
)";

TEST_CASE(
    "a replicated program runs one replica per device, its all_reduce across "
    "them") {
  std::unique_ptr<PjrtPlugin> p = LoadCpu();
  const std::vector<int> devices = {3, 0, 2};  // replica r on devices[r]
  absl::StatusOr<std::unique_ptr<Executable>> exe =
      p->CompileReplicated(kAllReduce, devices);
  INFO(exe.status().ToString());
  REQUIRE(exe.ok());
  const std::vector<int>& order = (*exe)->replica_devices();
  REQUIRE(order.size() == 3);
  std::vector<Buffer> in;
  std::vector<std::vector<PJRT_Buffer*>> args;
  const std::vector<int64_t> dims = {3};
  for (int d : order) {
    const std::vector<float> v = {float(d), 10.0f * d, 100.0f};
    absl::StatusOr<Buffer> b =
        p->FromHost(d, v.data(), PJRT_Buffer_Type_F32, dims);
    REQUIRE(b.ok());
    args.push_back({b->get()});
    in.push_back(*std::move(b));
  }
  absl::StatusOr<std::vector<std::vector<Buffer>>> out =
      p->ExecuteReplicated(**exe, args);
  INFO(out.status().ToString());
  REQUIRE(out.ok());
  REQUIRE(out->size() == 3);
  for (const std::vector<Buffer>& r : *out) {
    REQUIRE(r.size() == 1);
    std::vector<float> got(3);
    REQUIRE(p->ToHost(r[0], got.data(), 12).ok());
    CHECK(got == std::vector<float>{5, 50, 300});  // devices 3 + 0 + 2
  }
  // Bad placements are refused, not passed to the plugin.
  CHECK(p->CompileReplicated(kAllReduce, {0, 0, 1}).status().code() ==
        absl::StatusCode::kInvalidArgument);
  CHECK(p->CompileReplicated(kAllReduce, {0, 1, 9}).status().code() ==
        absl::StatusCode::kInvalidArgument);
  CHECK(p->ExecuteReplicated(**exe, {args[0]}).status().code() ==
        absl::StatusCode::kInvalidArgument);
}

TEST_CASE("a StableHLO program compiles once and runs on any device") {
  std::unique_ptr<PjrtPlugin> p = LoadCpu();
  absl::StatusOr<std::unique_ptr<Executable>> exe = p->Compile(kAdd);
  INFO(exe.status().ToString());
  REQUIRE(exe.ok());
  CHECK((*exe)->num_outputs() == 1);
  const std::vector<float> a = {1, 2, 3, 4}, b = {10, 20, 30, 40};
  const std::vector<int64_t> dims = {4};
  for (int device : {0, 3}) {
    absl::StatusOr<Buffer> ba =
        p->FromHost(device, a.data(), PJRT_Buffer_Type_F32, dims);
    absl::StatusOr<Buffer> bb =
        p->FromHost(device, b.data(), PJRT_Buffer_Type_F32, dims);
    REQUIRE(ba.ok());
    REQUIRE(bb.ok());
    std::vector<PJRT_Buffer*> args = {ba->get(), bb->get()};
    absl::StatusOr<std::vector<Buffer>> out = p->Execute(**exe, device, args);
    INFO(out.status().ToString());
    REQUIRE(out.ok());
    REQUIRE(out->size() == 1);
    absl::StatusOr<size_t> bytes = p->HostBytes((*out)[0]);
    REQUIRE(bytes.ok());
    CHECK(*bytes == 16);
    std::vector<float> got(4);
    REQUIRE(p->ToHost((*out)[0], got.data(), 16).ok());
    CHECK(got == std::vector<float>{11, 22, 33, 44});
  }
  CHECK(p->Execute(**exe, 4, {}).status().code() ==
        absl::StatusCode::kInvalidArgument);
}

// Runs kAdd's executable on `device` of `p`: {1,2,3,4} + {10,20,30,40}.
std::vector<float> RunAdd(const PjrtPlugin& p, const Executable& exe,
                          int device) {
  const std::vector<float> a = {1, 2, 3, 4}, b = {10, 20, 30, 40};
  const std::vector<int64_t> dims = {4};
  absl::StatusOr<Buffer> ba =
      p.FromHost(device, a.data(), PJRT_Buffer_Type_F32, dims);
  absl::StatusOr<Buffer> bb =
      p.FromHost(device, b.data(), PJRT_Buffer_Type_F32, dims);
  REQUIRE(ba.ok());
  REQUIRE(bb.ok());
  std::vector<PJRT_Buffer*> args = {ba->get(), bb->get()};
  absl::StatusOr<std::vector<Buffer>> out = p.Execute(exe, device, args);
  INFO(out.status().ToString());
  REQUIRE(out.ok());
  REQUIRE(out->size() == 1);
  std::vector<float> got(4);
  REQUIRE(p.ToHost((*out)[0], got.data(), 16).ok());
  return got;
}

TEST_CASE(
    "a serialized program loads in another client of the plugin and runs "
    "there, portable or replicated") {
  std::unique_ptr<PjrtPlugin> first = LoadCpu();
  REQUIRE(first->Serializes());
  absl::StatusOr<std::unique_ptr<Executable>> exe = first->Compile(kAdd);
  REQUIRE(exe.ok());
  absl::StatusOr<std::string> bytes = first->Serialize(**exe);
  INFO(bytes.status().ToString());
  REQUIRE(bytes.ok());
  CHECK(!bytes->empty());
  exe->reset();
  first.reset();  // as a restarted tpud: a new client of the plugin

  std::unique_ptr<PjrtPlugin> second = LoadCpu();
  absl::StatusOr<std::unique_ptr<Executable>> loaded =
      second->Deserialize(*bytes, {});
  INFO(loaded.status().ToString());
  REQUIRE(loaded.ok());
  CHECK((*loaded)->num_outputs() == 1);
  for (int device : {0, 3})
    CHECK(RunAdd(*second, **loaded, device) ==
          std::vector<float>{11, 22, 33, 44});

  const std::vector<int> devices = {3, 0, 2};
  absl::StatusOr<std::unique_ptr<Executable>> rep =
      second->CompileReplicated(kAllReduce, devices);
  REQUIRE(rep.ok());
  absl::StatusOr<std::string> rep_bytes = second->Serialize(**rep);
  REQUIRE(rep_bytes.ok());
  absl::StatusOr<std::unique_ptr<Executable>> rep_loaded =
      second->Deserialize(*rep_bytes, devices);
  INFO(rep_loaded.status().ToString());
  REQUIRE(rep_loaded.ok());
  CHECK((*rep_loaded)->replica_devices() == (*rep)->replica_devices());
  std::vector<Buffer> in;
  std::vector<std::vector<PJRT_Buffer*>> args;
  for (int d : (*rep_loaded)->replica_devices()) {
    const std::vector<float> v = {float(d), 1, 2};
    absl::StatusOr<Buffer> b =
        second->FromHost(d, v.data(), PJRT_Buffer_Type_F32, {3});
    REQUIRE(b.ok());
    args.push_back({b->get()});
    in.push_back(*std::move(b));
  }
  absl::StatusOr<std::vector<std::vector<Buffer>>> out =
      second->ExecuteReplicated(**rep_loaded, args);
  REQUIRE(out.ok());
  std::vector<float> got(3);
  REQUIRE(second->ToHost((*out)[1][0], got.data(), 12).ok());
  CHECK(got == std::vector<float>{5, 3, 6});
  {
    absl::StatusOr<std::unique_ptr<Executable>> g =
        second->Deserialize("not a program", {});
    INFO(g.status().ToString());
    CHECK(!g.ok());
    absl::StatusOr<std::unique_ptr<Executable>> t =
        second->Deserialize(bytes->substr(0, bytes->size() / 2), {});
    INFO(t.status().ToString());
    CHECK(!t.ok());
  }
  CHECK(second->Deserialize(*rep_bytes, {0, 0, 1}).status().code() ==
        absl::StatusCode::kInvalidArgument);
}

TEST_CASE("a compile error is the plugin's message; the plugin goes on") {
  std::unique_ptr<PjrtPlugin> p = LoadCpu(1);
  absl::StatusOr<std::unique_ptr<Executable>> bad =
      p->Compile("module { this is not mlir }");
  REQUIRE(!bad.ok());
  CHECK(absl::StartsWith(bad.status().message(), "compiling: "));
  CHECK(bad.status().message().size() > 12);
  CHECK(p->Compile(kAdd).ok());
}

TEST_CASE("what is not a PJRT plugin is refused with a clear error") {
  absl::StatusOr<std::unique_ptr<PjrtPlugin>> missing =
      PjrtPlugin::Load("/nonexistent/libtpu.so", {});
  REQUIRE(!missing.ok());
  CHECK(missing.status().code() == absl::StatusCode::kFailedPrecondition);
  CHECK(
      absl::StrContains(missing.status().message(), "/nonexistent/libtpu.so"));
  absl::StatusOr<std::unique_ptr<PjrtPlugin>> libm =
      PjrtPlugin::Load("libm.so.6", {});
  REQUIRE(!libm.ok());
  CHECK(absl::StrContains(libm.status().message(), "exports no GetPjrtApi"));
}

TEST_CASE("create options: the type is inferred or given") {
  absl::StatusOr<CreateOption> i = ParseCreateOption("cpu_device_count=8");
  REQUIRE(i.ok());
  CHECK(i->type == PJRT_NamedValue_kInt64);
  CHECK(i->int64_value == 8);
  absl::StatusOr<CreateOption> s = ParseCreateOption("name=string:8");
  REQUIRE(s.ok());
  CHECK(s->type == PJRT_NamedValue_kString);
  CHECK(s->string_value == "8");
  absl::StatusOr<CreateOption> b = ParseCreateOption("flag=false");
  REQUIRE(b.ok());
  CHECK(b->type == PJRT_NamedValue_kBool);
  CHECK(!b->bool_value);
  absl::StatusOr<CreateOption> f = ParseCreateOption("fraction=0.75");
  REQUIRE(f.ok());
  CHECK(f->type == PJRT_NamedValue_kFloat);
  CHECK(f->float_value == 0.75f);
  CHECK(ParseCreateOption("novalue").status().code() ==
        absl::StatusCode::kInvalidArgument);
  CHECK(ParseCreateOption("n=int64:x").status().code() ==
        absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace tpud::pjrt
