// libtorch and Debian's gRPC/protobuf in one process: the plugin will live
// exactly like this. Builds a tensor with ATen and talks to a real tpud
// through libtpuclient in the same process.
#include <ATen/ATen.h>

#include "catch2_compat/catch.h"
#include "tests/daemon_harness.h"
#include "tpu/client.h"

namespace {

TEST_CASE("ATen and libtpuclient work side by side in one process") {
  at::Tensor a = at::arange(12, at::kFloat).reshape({3, 4});
  at::Tensor b = at::ones({4, 2});
  at::Tensor c = at::matmul(a, b);
  REQUIRE(c.size(0) == 3);
  CHECK(c[2][1].item<float>() == 8 + 9 + 10 + 11);

  tpud_test::TestDaemon d;
  tpu::ClientOptions options;
  options.socket_path = d.socket();
  absl::StatusOr<std::unique_ptr<tpu::Session>> s = tpu::Session::Open(options);
  REQUIRE(s.ok());
  absl::StatusOr<tpu::Segment> seg = (*s)->Allocate(0, c.nbytes());
  REQUIRE(seg.ok());
  CHECK(seg->size >= c.nbytes());
  REQUIRE((*s)->Close().ok());
}

}  // namespace
