#include "allocator.h"

#include <c10/core/impl/alloc_cpu.h>

#include <map>
#include <mutex>
#include <unordered_map>

#include "runtime.h"
#include "tpu/device_address.h"

namespace torch_tpu {
namespace {

constexpr size_t kRound = 512;
constexpr int kMaxDevices = 64;

size_t RoundUp(size_t n) { return (n + kRound - 1) / kRound * kRound; }

struct Block {
  uint64_t address;
  size_t size;       // segment size granted by tpud
  size_t requested;  // bytes the tensor asked for
  c10::DeviceIndex device;
  bool adopted;      // a daemon-made result: freed straight back
};

class TpuAllocator final : public c10::DeviceAllocator {
 public:
  c10::DataPtr allocate(size_t n) override {
    const c10::DeviceIndex device = CurrentDevice();
    if (n == 0) return {nullptr, nullptr, &Deleter, c10::Device(c10::DeviceType::PrivateUse1, device)};
    // Small requests come in whole pages (tpud's granularity), so a cached
    // block of the same class always fits.
    const size_t want = n < (1 << 20) ? (n + 4095) / 4096 * 4096 : RoundUp(n);
    Block* block = nullptr;
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto& cache = free_[device];
      // Best fit among cached segments, but not one more than twice the size.
      auto it = cache.lower_bound(want);
      if (it != cache.end() && it->first <= 2 * want) {
        block = it->second;
        cache.erase(it);
      }
    }
    if (block == nullptr) block = NewSegment(device, want);
    block->requested = n;
    {
      std::lock_guard<std::mutex> lock(mu_);
      c10::CachingDeviceAllocator::DeviceStats& s = stats_[device];
      s.allocated_bytes[0].increase(block->size);
      s.requested_bytes[0].increase(n);
      s.allocation[0].increase(1);
      s.active[0].increase(1);
      s.active_bytes[0].increase(block->size);
    }
    return {reinterpret_cast<void*>(block->address), block, &Deleter,
            c10::Device(c10::DeviceType::PrivateUse1, device)};
  }

  c10::DeleterFnPtr raw_deleter() const override { return nullptr; }

  void copy_data(void* dest, const void* src, std::size_t count) const override {
    Check(GetSession().CopyOnDevice(0, reinterpret_cast<uint64_t>(dest),
                                    reinterpret_cast<uint64_t>(src), count),
          "device copy");
  }

  bool initialized() override { return true; }

  void emptyCache(c10::MempoolId_t) override {
    // Queued work may still use cached blocks: let it finish first.
    (void)GetSession().WaitIdle();
    std::vector<Block*> release;
    {
      std::lock_guard<std::mutex> lock(mu_);
      for (int d = 0; d < kMaxDevices; ++d) {
        for (auto& [size, b] : free_[d]) release.push_back(b);
        free_[d].clear();
      }
    }
    for (Block* b : release) FreeSegment(b);
  }

  void recordStream(const c10::DataPtr&, c10::Stream) override {
    // Blocks are reused only after the op that freed them was enqueued; all
    // streams of a session run in enqueue order relative to a later
    // synchronisation, and the daemon checks every reference. Cross-stream
    // reuse hazards are the caller's, as with CUDA without recordStream.
  }

  c10::CachingDeviceAllocator::DeviceStats getDeviceStats(c10::DeviceIndex device) override {
    std::lock_guard<std::mutex> lock(mu_);
    return stats_[Index(device)];
  }

  void resetAccumulatedStats(c10::DeviceIndex device) override {
    std::lock_guard<std::mutex> lock(mu_);
    auto& s = stats_[Index(device)];
    for (auto* arr : {&s.allocation, &s.segment, &s.active, &s.allocated_bytes,
                      &s.reserved_bytes, &s.active_bytes, &s.requested_bytes}) {
      for (auto& st : *arr) {
        st.allocated = 0;
        st.freed = 0;
      }
    }
    s.num_alloc_retries = s.num_ooms = 0;
    s.num_device_alloc = s.num_device_free = 0;
  }

  void resetPeakStats(c10::DeviceIndex device) override {
    std::lock_guard<std::mutex> lock(mu_);
    auto& s = stats_[Index(device)];
    for (auto* arr : {&s.allocation, &s.segment, &s.active, &s.allocated_bytes,
                      &s.reserved_bytes, &s.active_bytes, &s.requested_bytes}) {
      for (auto& st : *arr) st.peak = st.current;
    }
  }

  std::pair<size_t, size_t> getMemoryInfo(c10::DeviceIndex device) override {
    const int chip = ChipOf(device);
    absl::StatusOr<tpu::MemoryStats> m = GetSession().GetMemoryStats();
    Check(m.status(), "memory statistics");
    const tpu::ChipMemoryStats& c = m->chips.at(chip);
    size_t free = c.chip_free_bytes;
    if (m->quota_bytes_per_chip != 0) {
      free = std::min<size_t>(free, m->quota_bytes_per_chip - std::min(m->quota_bytes_per_chip,
                                                                       c.session_bytes));
    }
    return {free, c.chip_total_bytes};
  }

  void Release(Block* b) {
    std::lock_guard<std::mutex> lock(mu_);
    c10::CachingDeviceAllocator::DeviceStats& s = stats_[b->device];
    s.allocated_bytes[0].decrease(b->size);
    s.requested_bytes[0].decrease(b->requested);
    s.allocation[0].decrease(1);
    s.active[0].decrease(1);
    s.active_bytes[0].decrease(b->size);
    if (b->adopted) {
      s.reserved_bytes[0].decrease(b->size);
      s.segment[0].decrease(1);
      pending_free_.push_back(b);
      return;
    }
    free_[b->device].emplace(b->size, b);
  }

  Block* Adopt(uint64_t address, size_t bytes, c10::DeviceIndex device) {
    auto* b = new Block{address, std::max<size_t>(bytes, 1), bytes, device, true};
    std::lock_guard<std::mutex> lock(mu_);
    auto& s = stats_[device];
    s.reserved_bytes[0].increase(b->size);
    s.segment[0].increase(1);
    s.allocated_bytes[0].increase(b->size);
    s.requested_bytes[0].increase(bytes);
    s.allocation[0].increase(1);
    s.active[0].increase(1);
    s.active_bytes[0].increase(b->size);
    return b;
  }

  // Frees adopted segments whose tensors died (outside the deleter, which
  // may run anywhere).
  void DrainPending() {
    std::vector<Block*> todo;
    {
      std::lock_guard<std::mutex> lock(mu_);
      todo.swap(pending_free_);
    }
    if (todo.empty()) return;
    (void)GetSession().WaitIdle();
    for (Block* b : todo) {
      (void)GetSession().Free(b->address);
      delete b;
    }
  }

  static void Deleter(void* ctx);

 private:
  static c10::DeviceIndex Index(c10::DeviceIndex d) {
    TORCH_CHECK(d >= 0 && d < kMaxDevices, "tpu: bad device index ", static_cast<int>(d));
    return d;
  }

  Block* NewSegment(c10::DeviceIndex device, size_t bytes) {
    DrainPending();
    tpu::Session& session = GetSession();
    const int chip = ChipOf(device);
    absl::StatusOr<tpu::Segment> seg = session.Allocate(chip, bytes);
    if (!seg.ok() && seg.status().code() == absl::StatusCode::kResourceExhausted) {
      // Give the cache back and try once more, as CUDA's allocator does.
      emptyCache({0, 0});
      std::lock_guard<std::mutex> lock(mu_);
      stats_[device].num_alloc_retries += 1;
    }
    if (!seg.ok()) seg = session.Allocate(chip, bytes);
    if (!seg.ok()) {
      std::lock_guard<std::mutex> lock(mu_);
      stats_[device].num_ooms += 1;
    }
    Check(seg.status(), "allocating device memory");
    std::lock_guard<std::mutex> lock(mu_);
    auto& s = stats_[device];
    s.reserved_bytes[0].increase(seg->size);
    s.segment[0].increase(1);
    s.num_device_alloc += 1;
    return new Block{seg->address, seg->size, bytes, device, false};
  }

  void FreeSegment(Block* b) {
    (void)GetSession().Free(b->address);
    std::lock_guard<std::mutex> lock(mu_);
    auto& s = stats_[b->device];
    s.reserved_bytes[0].decrease(b->size);
    s.segment[0].decrease(1);
    s.num_device_free += 1;
    delete b;
  }

  std::mutex mu_;
  std::multimap<size_t, Block*> free_[kMaxDevices];
  c10::CachingDeviceAllocator::DeviceStats stats_[kMaxDevices];
  std::vector<Block*> pending_free_;
};

TpuAllocator& Instance() {
  static TpuAllocator* a = new TpuAllocator();
  return *a;
}

void TpuAllocator::Deleter(void* ctx) {
  if (ctx == nullptr) return;
  Instance().Release(static_cast<Block*>(ctx));
}

}  // namespace

c10::DeviceAllocator* GetTpuAllocator() { return &Instance(); }

c10::DataPtr AdoptSegment(uint64_t address, size_t bytes, c10::DeviceIndex device) {
  Block* b = Instance().Adopt(address, bytes, device);
  return {reinterpret_cast<void*>(address), b, &TpuAllocator::Deleter,
          c10::Device(c10::DeviceType::PrivateUse1, device)};
}

}  // namespace torch_tpu
