#include "daemon/backends/simulated/small_elementwise.h"

#include <cstdint>
#include <cstring>

#include "tpu/dtype.h"

namespace tpud {
namespace {

// o[i] = f(a[i], b[i]) (b null: f(a[i], value)), one IEEE operation per
// element, four lanes at a time: GCC's vector extension gives SSE's packed
// operations, which round each lane as the scalar ones do. A lane group is
// read whole before it is written; o is a's or b's own memory or apart from
// it (checked by the caller), so that changes nothing. The scalar loop
// stored one float per cycle, a quarter of a 4096-element op's time in tpud.
template <typename F>
void Apply(float* o, const float* a, const float* b, float value, int64_t n,
           F f) {
  using V = float __attribute__((vector_size(16)));
  constexpr int kLanes = sizeof(V) / sizeof(float);
  const V splat = {value, value, value, value};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    V x;
    V y = splat;
    std::memcpy(&x, a + i, sizeof(V));
    if (b != nullptr) std::memcpy(&y, b + i, sizeof(V));
    const V r = f(x, y);
    std::memcpy(o + i, &r, sizeof(V));
  }
  for (; i < n; ++i) o[i] = f(a[i], b != nullptr ? b[i] : value);
}

}  // namespace

SmallElementwise SmallElementwiseOf(const std::string& name) {
  if (name == "aten::mul.Tensor") return SmallElementwise::kMul;
  if (name == "aten::add.Tensor") return SmallElementwise::kAdd;
  if (name == "aten::sub.Tensor") return SmallElementwise::kSub;
  return SmallElementwise::kNone;
}

absl::StatusOr<bool> TrySmallElementwise(
    SmallElementwise kind, const tpu::DecodedOp& decoded,
    const std::vector<ResolvedTensor>& tensors, LocateFn locate) {
  constexpr int64_t kMaxElements = 1 << 16;
  constexpr int8_t kFloat = static_cast<int8_t>(tpu::DType::kFloat);
  using tpu::ArgTag;
  const size_t n = decoded.num_args;
  if (n < 2 || n > 3 || decoded.outputs.size() != 1 ||
      decoded.args.size() < n || decoded.args[0].tag != ArgTag::kTensor) {
    return false;
  }
  if (n == 3) {
    const tpu::OpArg& alpha = decoded.args[2];
    const bool one = (alpha.tag == ArgTag::kScalarInt && alpha.i == 1) ||
                     (alpha.tag == ArgTag::kScalarDouble && alpha.d == 1.0);
    if (kind == SmallElementwise::kMul || !one) return false;
  }
  const tpu::TensorRef& x = decoded.args[0].tensor;
  const tpu::TensorRef& out = decoded.outputs[0];
  auto dense = [](const tpu::TensorRef& t) {
    int64_t expected = 1;
    for (int d = t.ndim - 1; d >= 0; --d) {
      if (t.sizes[d] != 1 && t.strides[d] != expected) return false;
      expected *= t.sizes[d];
    }
    return true;
  };
  auto same_shape = [](const tpu::TensorRef& a, const tpu::TensorRef& b) {
    if (a.ndim != b.ndim) return false;
    for (int d = 0; d < a.ndim; ++d) {
      if (a.sizes[d] != b.sizes[d]) return false;
    }
    return true;
  };
  if (x.dtype != kFloat || out.dtype != kFloat || !dense(x) || !dense(out) ||
      !same_shape(x, out)) {
    return false;
  }
  int64_t numel = 1;
  for (int d = 0; d < x.ndim; ++d) numel *= x.sizes[d];
  if (numel == 0 || numel > kMaxElements) return false;

  const tpu::OpArg& other = decoded.args[1];
  const bool scalar = other.tag == ArgTag::kScalarTensor;
  float value = 0;
  if (scalar) {
    const auto type = static_cast<tpu::DType>(other.dtype);
    if (!other.b) return false;  // a 0-dim tensor, not a Python number
    if (type == tpu::DType::kDouble) {
      value = static_cast<float>(other.d);
    } else if (type == tpu::DType::kInt64) {
      value = static_cast<float>(other.i);
    } else {
      return false;
    }
  } else if (other.tag != ArgTag::kTensor || other.tensor.dtype != kFloat ||
             !dense(other.tensor) || !same_shape(other.tensor, x)) {
    return false;
  }
  const size_t inputs = scalar ? 1 : 2;
  if (tensors.size() != inputs + 1) return false;
  char* xd = nullptr;
  char* yd = nullptr;
  char* od = nullptr;
  uint64_t bytes = 0;
  absl::Status st = locate(x, tensors[0], &xd, &bytes);
  if (st.ok() && !scalar) st = locate(other.tensor, tensors[1], &yd, &bytes);
  if (st.ok()) st = locate(out, tensors[inputs], &od, &bytes);
  if (!st.ok()) return st;
  const uint64_t size = static_cast<uint64_t>(numel) * sizeof(float);
  auto apart = [size](const char* a, const char* b) {
    return a == b || a + size <= b || b + size <= a;
  };
  if (!apart(xd, od) || (yd != nullptr && !apart(yd, od))) return false;

  const auto* a = reinterpret_cast<const float*>(xd);
  const auto* b = reinterpret_cast<const float*>(yd);
  auto* o = reinterpret_cast<float*>(od);
  switch (kind) {
    case SmallElementwise::kMul:
      Apply(o, a, b, value, numel, [](auto p, auto q) { return p * q; });
      break;
    case SmallElementwise::kAdd:
      Apply(o, a, b, value, numel, [](auto p, auto q) { return p + q; });
      break;
    case SmallElementwise::kSub:
      Apply(o, a, b, value, numel, [](auto p, auto q) { return p - q; });
      break;
    case SmallElementwise::kNone:
      return false;
  }
  return true;
}

}  // namespace tpud
