// PrivateUse1 hooks and the per-device random generator of "tpu".
#include <ATen/EmptyTensor.h>
#include <ATen/core/GeneratorForPrivateuseone.h>
#include <ATen/detail/PrivateUse1HooksInterface.h>
#include <c10/core/GeneratorImpl.h>

#include <cstring>
#include <mutex>
#include <vector>

#include "allocator.h"
#include "generator.h"
#include "pinned_allocator.h"
#include "runtime.h"

namespace torch_tpu {

// A counter-based generator: each op that needs randomness draws the next
// 64-bit seed (seed, offset) -> splitmix64, and the daemon runs the op with a
// CPU generator seeded from it. Same seed, same sequence of ops: same numbers.
TpuGenerator::TpuGenerator(c10::DeviceIndex device)
    : c10::GeneratorImpl(c10::Device(c10::DeviceType::PrivateUse1, device),
                         c10::DispatchKeySet(c10::DispatchKey::PrivateUse1)) {}

void TpuGenerator::set_current_seed(uint64_t seed) {
  seed_ = seed;
  offset_ = 0;
}
void TpuGenerator::set_offset(uint64_t offset) { offset_ = offset; }
uint64_t TpuGenerator::get_offset() const { return offset_; }
uint64_t TpuGenerator::current_seed() const { return seed_; }
uint64_t TpuGenerator::seed() {
  const uint64_t s = c10::detail::getNonDeterministicRandom();
  set_current_seed(s);
  return s;
}

uint64_t TpuGenerator::NextOpSeed() {
  uint64_t z = seed_ + 0x9e3779b97f4a7c15ULL * (++offset_);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}

void TpuGenerator::set_state(const c10::TensorImpl& state) {
  TORCH_CHECK(
      state.numel() == 16 && state.dtype() == caffe2::TypeMeta::Make<uint8_t>(),
      "tpu: a generator state is a uint8 tensor of 16 bytes");
  const auto* p = static_cast<const uint8_t*>(state.data());
  std::memcpy(&seed_, p, 8);
  std::memcpy(&offset_, p + 8, 8);
}

c10::intrusive_ptr<c10::TensorImpl> TpuGenerator::get_state() const {
  auto t = at::detail::empty_cpu({16}, at::ScalarType::Byte, std::nullopt,
                                 std::nullopt, std::nullopt, std::nullopt);
  auto* p = static_cast<uint8_t*>(t.data_ptr());
  std::memcpy(p, &seed_, 8);
  std::memcpy(p + 8, &offset_, 8);
  return t.getIntrusivePtr();
}

TpuGenerator* TpuGenerator::clone_impl() const {
  auto* g = new TpuGenerator(device().index());
  g->seed_ = seed_;
  g->offset_ = offset_;
  return g;
}

const at::Generator& DefaultGenerator(c10::DeviceIndex device) {
  static std::once_flag once;
  static std::vector<at::Generator>* gens = nullptr;
  std::call_once(once, [] {
    gens = new std::vector<at::Generator>();
    const c10::DeviceIndex n = std::max<c10::DeviceIndex>(DeviceCount(), 1);
    for (c10::DeviceIndex d = 0; d < n; ++d) {
      gens->push_back(at::make_generator<TpuGenerator>(d));
      (*gens)[d].set_current_seed(c10::default_rng_seed_val);
    }
  });
  if (device < 0) device = CurrentDevice();
  TORCH_CHECK(device < static_cast<c10::DeviceIndex>(gens->size()),
              "tpu: no device ", static_cast<int>(device));
  return (*gens)[device];
}

namespace {

struct TpuHooks final : public at::PrivateUse1HooksInterface {
  bool isBuilt() const override { return true; }
  bool isAvailable() const override { return DeviceCount() > 0; }
  const at::Generator& getDefaultGenerator(
      c10::DeviceIndex device) const override {
    return DefaultGenerator(device);
  }
  at::Generator getNewGenerator(c10::DeviceIndex device) const override {
    return at::make_generator<TpuGenerator>(device < 0 ? CurrentDevice()
                                                       : device);
  }
  at::Device getDeviceFromPtr(void* data) const override {
    return at::Device(c10::DeviceType::PrivateUse1, CurrentDevice());
  }
  bool isPinnedPtr(const void* data) const override {
    return DeviceCount() > 0 && GetSession().IsPinned(data);
  }
  at::Allocator* getPinnedMemoryAllocator() const override {
    return GetPinnedAllocator();
  }
  bool hasPrimaryContext(c10::DeviceIndex) const override { return true; }
  void init() const override {}
  void resizePrivateUse1Bytes(const c10::Storage& storage,
                              size_t newsize) const override {
    ResizeStorage(storage, newsize);
  }
};

const bool kRegistered = [] {
  static TpuHooks hooks;
  at::RegisterPrivateUse1HooksInterface(&hooks);
  return true;
}();

}  // namespace
}  // namespace torch_tpu
