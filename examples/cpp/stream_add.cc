// stream_add: the data plane from C++. Puts two vectors on a chip, adds one
// into the other `--iterations` times as queued ops on a stream, reads the
// result back and checks it.
//
//   stream_add --chip=0 --elements=4096 --iterations=1000 [--forever]
//
// Ops are named by their full ATen schema; a daemon whose torch has another
// schema for aten::add_.Tensor refuses them with both schemas in the message.
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "tpu/client.h"

ABSL_FLAG(std::string, socket, "",
          "tpud runtime socket (default $TPUD_SOCKET)");
ABSL_FLAG(int, chip, 0, "chip to run on");
ABSL_FLAG(int, stream, 0, "stream to use");
ABSL_FLAG(int64_t, elements, 4096, "vector length");
ABSL_FLAG(int64_t, iterations, 1000, "additions per round");
ABSL_FLAG(bool, forever, false, "keep running rounds until killed");

namespace {

constexpr char kAddInPlace[] =
    "aten::add_.Tensor(Tensor(a!) self, Tensor other, *, Scalar alpha=1) -> "
    "Tensor(a!)";
constexpr int8_t kFloat32 = 6;  // c10::ScalarType::Float

int Fail(const char* what, const absl::Status& s) {
  std::fprintf(stderr, "stream_add: %s: %s\n", what, s.ToString().c_str());
  return 1;
}

}  // namespace

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  const int chip = absl::GetFlag(FLAGS_chip);
  const int stream = absl::GetFlag(FLAGS_stream);
  const int64_t n = absl::GetFlag(FLAGS_elements);
  const int64_t iterations = absl::GetFlag(FLAGS_iterations);
  absl::StatusOr<std::unique_ptr<tpu::Session>> opened =
      tpu::Session::Open({absl::GetFlag(FLAGS_socket), "stream_add"});
  if (!opened.ok()) return Fail("open", opened.status());
  tpu::Session& s = **opened;

  const uint64_t bytes = n * sizeof(float);
  absl::StatusOr<tpu::Segment> xs = s.Allocate(chip, bytes);
  absl::StatusOr<tpu::Segment> ys = s.Allocate(chip, bytes);
  if (!xs.ok()) return Fail("allocate", xs.status());
  if (!ys.ok()) return Fail("allocate", ys.status());
  std::vector<float> x(n), y(n, 1.0f);
  for (int64_t i = 0; i < n; ++i) x[i] = static_cast<float>(i % 1000);
  if (auto st = s.CopyToDevice(stream, xs->address, x.data(), bytes);
      !st.ok()) {
    return Fail("upload", st);
  }
  if (auto st = s.CopyToDevice(stream, ys->address, y.data(), bytes);
      !st.ok()) {
    return Fail("upload", st);
  }

  tpu::TensorRef xr, yr;
  xr.address = xs->address;
  yr.address = ys->address;
  xr.dtype = yr.dtype = kFloat32;
  xr.ndim = yr.ndim = 1;
  xr.sizes[0] = yr.sizes[0] = n;
  xr.strides[0] = yr.strides[0] = 1;
  tpu::OpArg args[3];
  args[0].tag = tpu::ArgTag::kTensor;
  args[0].tensor = xr;
  args[1].tag = tpu::ArgTag::kTensor;
  args[1].tensor = yr;
  args[2].tag = tpu::ArgTag::kScalarInt;
  args[2].i = 1;
  absl::StatusOr<uint32_t> add = s.DefineOp(kAddInPlace);
  if (!add.ok()) return Fail("define", add.status());

  int64_t rounds = 0;
  do {
    auto t0 = std::chrono::steady_clock::now();
    for (int64_t k = 0; k < iterations; ++k) {
      absl::StatusOr<uint64_t> seq =
          s.EnqueueOp(stream, *add, args, 3, nullptr, 0);
      if (!seq.ok()) return Fail("enqueue", seq.status());
    }
    if (auto st = s.Synchronize(stream); !st.ok())
      return Fail("synchronize", st);
    auto t1 = std::chrono::steady_clock::now();
    std::vector<float> back(n);
    if (auto st = s.CopyToHost(stream, back.data(), xs->address, bytes);
        !st.ok()) {
      return Fail("download", st);
    }
    ++rounds;
    for (int64_t i = 0; i < n; ++i) {
      const float want = static_cast<float>(i % 1000) +
                         static_cast<float>(rounds * iterations);
      if (back[i] != want) {
        std::fprintf(stderr,
                     "stream_add: wrong result at %lld: %f, expected %f\n",
                     static_cast<long long>(i), back[i], want);
        return 2;
      }
    }
    const double secs = std::chrono::duration<double>(t1 - t0).count();
    std::printf(
        "round %lld: %lld adds of %lld floats on chip %d in %.3f s (%.0f "
        "ops/s), result ok\n",
        static_cast<long long>(rounds), static_cast<long long>(iterations),
        static_cast<long long>(n), chip, secs, iterations / secs);
    std::fflush(stdout);
  } while (absl::GetFlag(FLAGS_forever));
  return 0;
}
