// The pinned host allocator (see pinned_allocator.h). A CPU allocator: what
// it hands out is host memory that tpud also maps.
#include "pinned_allocator.h"

#include <cstring>

#include "runtime.h"

namespace torch_tpu {
namespace {

class PinnedAllocator final : public at::Allocator {
 public:
  at::DataPtr allocate(size_t n) override {
    if (n == 0) return {nullptr, nullptr, &Delete, at::Device(at::kCPU)};
    absl::StatusOr<void*> p = GetSession().AllocatePinned(n);
    Check(p.status(), "pinned host memory");
    return {*p, *p, &Delete, at::Device(at::kCPU)};
  }
  at::DeleterFnPtr raw_deleter() const override { return &Delete; }
  void copy_data(void* dest, const void* src,
                 std::size_t count) const override {
    std::memcpy(dest, src, count);
  }
  static void Delete(void* p) {
    if (p != nullptr) (void)GetSession().FreePinned(p);
  }
};

}  // namespace

at::Allocator* GetPinnedAllocator() {
  static PinnedAllocator* a = new PinnedAllocator();
  return a;
}

}  // namespace torch_tpu
