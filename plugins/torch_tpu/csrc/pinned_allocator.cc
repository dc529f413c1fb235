// The pinned host allocator (see pinned_allocator.h). A CPU allocator: what
// it hands out is host memory that tpud also maps. It is also torch's host
// allocator of the tpu device (torch.accelerator.empty_host_cache and the
// host memory statistics reach it).
#include "pinned_allocator.h"

#include <ATen/core/CachingHostAllocator.h>

#include <array>
#include <cstring>
#include <mutex>
#include <unordered_map>

#include "runtime.h"

namespace torch_tpu {
namespace {

class PinnedAllocator final : public at::HostAllocator {
 public:
  at::DataPtr allocate(size_t n) override {
    if (n == 0) return {nullptr, nullptr, &Delete, at::Device(at::kCPU)};
    absl::StatusOr<void*> p = GetSession().AllocatePinned(n);
    Check(p.status(), "pinned host memory");
    {
      std::lock_guard<std::mutex> lock(mu_);
      sizes_[*p] = n;
      const int64_t bytes = static_cast<int64_t>(n);
      stats_.active_requests.increase(1);
      stats_.active_bytes.increase(bytes);
      stats_.allocations.increase(1);
      stats_.allocated_bytes.increase(bytes);
      ++stats_.num_host_alloc;
    }
    return {*p, *p, &Delete, at::Device(at::kCPU)};
  }
  at::DeleterFnPtr raw_deleter() const override { return &Delete; }
  void copy_data(void* dest, const void* src,
                 std::size_t count) const override {
    std::memcpy(dest, src, count);
  }

  // Copies from pinned memory to a tpu finish before the copy call returns
  // (native_kernels.cc), so a block never outlives its last use: nothing
  // to record, and nothing cached to empty.
  bool record_event(void*, void*, c10::Stream) override { return true; }
  void empty_cache() override {}

  at::HostStats get_stats() override {
    std::lock_guard<std::mutex> lock(mu_);
    return stats_;
  }
  void reset_accumulated_stats() override {
    std::lock_guard<std::mutex> lock(mu_);
    for (c10::CachingAllocator::Stat* s : Counters()) s->reset_accumulated();
    stats_.num_host_alloc = 0;
    stats_.num_host_free = 0;
  }
  void reset_peak_stats() override {
    std::lock_guard<std::mutex> lock(mu_);
    for (c10::CachingAllocator::Stat* s : Counters()) s->reset_peak();
  }

  static void Delete(void* p);

  void Forget(void* p) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = sizes_.find(p);
    if (it == sizes_.end()) return;
    const int64_t bytes = static_cast<int64_t>(it->second);
    sizes_.erase(it);
    stats_.active_requests.decrease(1);
    stats_.active_bytes.decrease(bytes);
    stats_.allocations.decrease(1);
    stats_.allocated_bytes.decrease(bytes);
    ++stats_.num_host_free;
  }

 private:
  // The statistics kept (nothing is cached, so the active ones equal the
  // allocated ones).
  std::array<c10::CachingAllocator::Stat*, 4> Counters() {
    return {&stats_.active_requests, &stats_.active_bytes, &stats_.allocations,
            &stats_.allocated_bytes};
  }

  std::mutex mu_;
  std::unordered_map<void*, size_t> sizes_;
  at::HostStats stats_;
};

PinnedAllocator* Instance() {
  static PinnedAllocator* a = [] {
    auto* p = new PinnedAllocator();
    at::setHostAllocator(at::kPrivateUse1, p);
    return p;
  }();
  return a;
}

void PinnedAllocator::Delete(void* p) {
  if (p == nullptr) return;
  Instance()->Forget(p);
  (void)GetSession().FreePinned(p);
}

}  // namespace

at::Allocator* GetPinnedAllocator() { return Instance(); }

void RegisterHostAllocator() { Instance(); }

}  // namespace torch_tpu
