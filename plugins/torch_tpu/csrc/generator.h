#pragma once

#include <ATen/core/Generator.h>
#include <c10/core/GeneratorImpl.h>

namespace torch_tpu {

class TpuGenerator final : public c10::GeneratorImpl {
 public:
  explicit TpuGenerator(c10::DeviceIndex device);
  void set_current_seed(uint64_t seed) override;
  void set_offset(uint64_t offset) override;
  uint64_t get_offset() const override;
  uint64_t current_seed() const override;
  uint64_t seed() override;
  void set_state(const c10::TensorImpl& state) override;
  c10::intrusive_ptr<c10::TensorImpl> get_state() const override;
  static c10::DeviceType device_type() { return c10::DeviceType::PrivateUse1; }
  // The seed of the next op that needs randomness.
  uint64_t NextOpSeed();

 private:
  TpuGenerator* clone_impl() const override;
  uint64_t seed_ = 67280421310721ULL;
  uint64_t offset_ = 0;
};

const at::Generator& DefaultGenerator(c10::DeviceIndex device);

}  // namespace torch_tpu
