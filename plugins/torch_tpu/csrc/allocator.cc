#include "allocator.h"

#include <c10/core/DeviceGuard.h>
#include <c10/core/impl/alloc_cpu.h>

#include <algorithm>
#include <atomic>
#include <map>
#include <mutex>
#include <unordered_map>
#include <vector>

#include "runtime.h"
#include "tpu/device_address.h"

namespace torch_tpu {
namespace {

constexpr size_t kRound = 512;
// Requests under this come in whole pages and are carved from pools.
constexpr size_t kSmallLimit = 1 << 20;
// Pools per device that new blocks are carved from; older ones are full.
constexpr size_t kOpenPools = 8;

size_t RoundUp(size_t n) { return (n + kRound - 1) / kRound * kRound; }

// A large request's size class where tpud compiles programs (PJRT): four
// classes per power of two. A compiled op's signature names the size of the
// segment each of its tensors is in, so a block of a class serves only
// requests of that class: a loop's tensors then land in segments of the same
// sizes every step, whatever was freed before them, and its programs hit.
// (At most a quarter more than asked for, as PyTorch's
// roundup_power2_divisions=4.)
size_t SizeClass(size_t n) {
  size_t p = size_t{1} << 20;
  while (p * 2 < n) p *= 2;  // p < n <= 2p
  const size_t step = p / 4;
  return (n + step - 1) / step * step;
}

// Whether tpud compiles its ops per segment size (see SizeClass).
bool ClassedSegments() {
  static const bool classed = Topology().backend == "pjrt";
  return classed;
}

// A segment of the size tpud advertises (Session::small_pool_bytes) that
// small blocks are carved from at a bump offset, as CUDA's allocator carves
// its 2 MiB blocks: a new process's first tensors then cost no round trip to
// tpud each. A carved block keeps its size for good; the pool goes back to
// tpud (empty_cache) once every block carved from it is in the cache.
struct Pool {
  uint64_t address;
  size_t size;
  c10::DeviceIndex device;
  size_t used = 0;
  int blocks = 0;  // carved from it
};

struct Block {
  uint64_t address;
  size_t size;       // segment size granted by tpud
  size_t requested;  // bytes the tensor asked for
  c10::DeviceIndex device;
  bool adopted;    // a daemon-made result: freed straight back
  int stream = 0;  // the stream it was allocated on: only that stream reuses it
  std::vector<int> uses;  // other streams it was recorded on (recordStream)
  uint64_t hold = 0;      // the captured program whose memory it is (0: none)
  bool parked = false;    // held, and its tensor is gone
  Pool* pool = nullptr;   // carved from it (else a segment of its own)
};

// A freed block whose other streams may still use it: reusable once events
// recorded on those streams have passed (CUDA's rule). The events are
// recorded at the next allocation after the free, not in the deleter, which
// may run anywhere.
struct Deferred {
  Block* block;
  std::vector<tpu::Event> events;
};

class TpuAllocator final : public c10::DeviceAllocator {
 public:
  c10::DataPtr allocate(size_t n) override {
    const c10::DeviceIndex device = CurrentDevice();
    if (n == 0)
      return {nullptr, nullptr, &Deleter,
              c10::Device(c10::DeviceType::PrivateUse1, device)};
    // Small requests come in whole pages (tpud's granularity), so a cached
    // block of the same class always fits.
    const bool classed = n >= kSmallLimit && ClassedSegments();
    const size_t want = n < kSmallLimit ? (n + 4095) / 4096 * 4096
                        : classed       ? SizeClass(n)
                                        : RoundUp(n);
    // Blocks are per stream, as in CUDA's caching allocator: one freed on
    // stream A may still be in use by A's queued work, so stream B gets it
    // only after A's work is known done.
    const int stream = static_cast<int>(CurrentStreamId(device));
    SweepDeferred();
    Block* block = nullptr;
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto& cache = free_[device][stream];
      // Best fit among cached segments, but not one more than twice the size
      // (of the same class where sizes are classed).
      auto it = cache.lower_bound(want);
      if (it != cache.end() && it->first <= (classed ? want : 2 * want)) {
        block = it->second;
        cache.erase(it);
      }
    }
    if (block == nullptr && want < kSmallLimit) block = Carve(device, want);
    if (block == nullptr) block = NewSegment(device, want);
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (capturing_) captured_.push_back(block);
    }
    block->requested = n;
    block->stream = stream;
    block->uses.clear();
    {
      std::lock_guard<std::mutex> lock(mu_);
      used_[device] = true;
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

  void copy_data(void* dest, const void* src,
                 std::size_t count) const override {
    Check(GetSession().CopyOnDevice(0, reinterpret_cast<uint64_t>(dest),
                                    reinterpret_cast<uint64_t>(src), count),
          "device copy");
  }

  bool initialized() override { return true; }

  void emptyCache(c10::MempoolId_t) override {
    {
      // A capture notes the blocks it uses; none may go meanwhile.
      std::lock_guard<std::mutex> lock(mu_);
      if (capturing_) return;
    }
    // Queued work may still use cached blocks: let it finish first.
    (void)GetSession().WaitIdle();
    SweepDeferred();
    std::vector<Block*> release;
    std::vector<Pool*> pools;
    {
      std::lock_guard<std::mutex> lock(mu_);
      // A pool goes when all its blocks are cached; until then its cached
      // blocks stay.
      std::unordered_map<Pool*, int> cached;
      for (int d = 0; d < kMaxDevices; ++d) {
        for (auto& cache : free_[d]) {
          for (auto& [size, b] : cache)
            if (b->pool != nullptr) ++cached[b->pool];
        }
      }
      for (int d = 0; d < kMaxDevices; ++d) {
        for (auto& cache : free_[d]) {
          for (auto it = cache.begin(); it != cache.end();) {
            Block* b = it->second;
            if (b->pool != nullptr && cached[b->pool] != b->pool->blocks) {
              ++it;
              continue;
            }
            if (b->pool == nullptr)
              release.push_back(b);
            else
              delete b;
            it = cache.erase(it);
          }
        }
      }
      for (auto& [p, n] : cached) {
        if (n != p->blocks) continue;
        std::vector<Pool*>& open = open_pools_[p->device];
        open.erase(std::remove(open.begin(), open.end(), p), open.end());
        pools.push_back(p);
      }
    }
    for (Block* b : release) FreeSegment(b);
    for (Pool* p : pools) FreePool(p);
  }

  void recordStream(const c10::DataPtr& ptr, c10::Stream stream) override {
    auto* b = static_cast<Block*>(ptr.get_context());
    if (b == nullptr || ptr.get_deleter() != &Deleter) return;
    const int id = static_cast<int>(stream.id());
    std::lock_guard<std::mutex> lock(mu_);
    if (id != b->stream &&
        std::find(b->uses.begin(), b->uses.end(), id) == b->uses.end()) {
      b->uses.push_back(id);
    }
  }

  bool EverUsed(c10::DeviceIndex device) {
    std::lock_guard<std::mutex> lock(mu_);
    return used_[Index(device)];
  }

  c10::CachingDeviceAllocator::DeviceStats getDeviceStats(
      c10::DeviceIndex device) override {
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
    const SessionChipMemory m = GetSessionChipMemory(device);
    return {m.available, m.chip_total};
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
    if (b->hold != 0) {
      b->parked = true;  // the program's until it is released
      return;
    }
    if (capturing_) {
      // Never handed out again during the capture: each address the
      // program records then belongs to one tensor, so binding an input or
      // an output moves only that tensor's uses.
      b->parked = true;
      capture_freed_.push_back(b);
      return;
    }
    if (b->uses.empty()) {
      // Fused eager: a block freed while its stream holds a run of ops is
      // not handed out again within that run. Which of a run's tensors share
      // a segment is part of the program tpud compiles for it, so reusing
      // blocks within runs would make a loop's runs differ with whatever the
      // cache held, and compile anew; across runs it does not matter.
      tpu::Session* session = session_.load(std::memory_order_acquire);
      if (const uint64_t run =
              session == nullptr ? 0 : session->HeldRun(b->stream);
          run != 0) {
        if (run_freed_.empty() || run_freed_.back().run != run ||
            run_freed_.back().stream != b->stream) {
          run_freed_.push_back({b->stream, run, {}});
        }
        run_freed_.back().blocks.push_back(b);
        // A segment of its own: what the run writes there is dead after it
        // (tpud keeps it as the run's temporary).
        if (b->pool == nullptr)
          (void)session->FreedInRun(b->stream, run, b->address);
        return;
      }
      free_[b->device][b->stream].emplace(b->size, b);
      return;
    }
    to_record_.push_back(b);
  }

  void BeginHold() {
    std::lock_guard<std::mutex> lock(mu_);
    TORCH_CHECK(!capturing_, "tpu: a capture is in progress already");
    capturing_ = true;
    captured_.clear();
    capture_freed_.clear();
  }

  uint64_t EndHold(const std::vector<uint64_t>& outputs) {
    std::lock_guard<std::mutex> lock(mu_);
    capturing_ = false;
    const uint64_t id = ++next_hold_;
    std::vector<Block*>& held = holds_[id];
    std::sort(captured_.begin(), captured_.end());
    captured_.erase(std::unique(captured_.begin(), captured_.end()),
                    captured_.end());
    for (Block* b : captured_) {
      if (std::find(outputs.begin(), outputs.end(), b->address) !=
          outputs.end())
        continue;
      if (b->hold != 0) continue;  // another program's already
      b->hold = id;                // parked if it was freed during the capture
      held.push_back(b);
    }
    captured_.clear();
    // Blocks from before the capture that it freed: the program knows them
    // only as bound inputs, so they go back to the cache.
    for (Block* b : capture_freed_) {
      if (b->hold != 0) continue;
      b->parked = false;
      if (b->uses.empty()) {
        free_[b->device][b->stream].emplace(b->size, b);
      } else {
        to_record_.push_back(b);
      }
    }
    capture_freed_.clear();
    return id;
  }

  void ReleaseHold(uint64_t id) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = holds_.find(id);
    if (it == holds_.end()) return;
    for (Block* b : it->second) {
      b->hold = 0;
      if (b->parked) {
        b->parked = false;
        free_[b->device][b->stream].emplace(b->size, b);
      }
    }
    holds_.erase(it);
  }

  uint64_t HoldBytes(uint64_t id) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = holds_.find(id);
    uint64_t n = 0;
    if (it != holds_.end()) {
      for (Block* b : it->second) n += b->size;
    }
    return n;
  }

  // Blocks freed while other streams used them: an event on each of those
  // streams now, reuse once they passed.
  void SweepDeferred() {
    std::vector<Block*> record;
    {
      std::lock_guard<std::mutex> lock(mu_);
      record.swap(to_record_);
    }
    tpu::Session& session = GetSession();
    session_.store(&session, std::memory_order_release);
    for (Block* b : record) {
      Deferred d{b, {}};
      for (int s : b->uses) {
        absl::StatusOr<tpu::Event> ev = session.RecordEvent(s);
        if (ev.ok()) {
          d.events.push_back(*ev);
        } else {
          (void)session.WaitIdle();  // no event slot left: wait instead
        }
      }
      std::lock_guard<std::mutex> lock(mu_);
      deferred_.push_back(std::move(d));
    }
    std::lock_guard<std::mutex> lock(mu_);
    for (size_t i = 0; i < run_freed_.size();) {
      RunFreed& r = run_freed_[i];
      if (session.HeldRun(r.stream) == r.run) {
        ++i;
        continue;
      }
      for (Block* b : r.blocks) free_[b->device][b->stream].emplace(b->size, b);
      run_freed_.erase(run_freed_.begin() + i);
    }
    for (size_t i = 0; i < deferred_.size();) {
      Deferred& d = deferred_[i];
      bool done = true;
      for (const tpu::Event& e : d.events) done = done && session.EventDone(e);
      if (!done) {
        ++i;
        continue;
      }
      for (const tpu::Event& e : d.events) session.ReleaseEvent(e);
      d.block->uses.clear();
      free_[d.block->device][d.block->stream].emplace(d.block->size, d.block);
      deferred_[i] = std::move(deferred_.back());
      deferred_.pop_back();
    }
  }

  Block* Adopt(uint64_t address, size_t bytes, c10::DeviceIndex device) {
    auto* b = new Block{
        address, std::max<size_t>(bytes, 1), bytes, device, true, 0, {}};
    std::lock_guard<std::mutex> lock(mu_);
    used_[device] = true;
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
    TORCH_CHECK(d >= 0 && d < kMaxDevices, "tpu: bad device index ",
                static_cast<int>(d));
    return d;
  }

  // A block of `bytes` (whole pages, under kSmallLimit) carved from one of
  // the device's pools, taking a new pool from tpud when none has room;
  // nullptr when tpud advertises no pools or has no room for one (the
  // caller then asks for a segment of its own, which empties the cache and
  // retries on exhaustion).
  Block* Carve(c10::DeviceIndex device, size_t bytes) {
    tpu::Session& session = GetSession();
    const uint64_t pool_bytes = session.small_pool_bytes();
    if (pool_bytes < bytes) return nullptr;
    {
      std::lock_guard<std::mutex> lock(mu_);
      for (Pool* p : open_pools_[device]) {
        if (p->size - p->used >= bytes) return CarveFrom(p, bytes);
      }
    }
    DrainPending();
    absl::StatusOr<tpu::Segment> seg = Reserve(device, pool_bytes);
    if (!seg.ok()) return nullptr;
    std::lock_guard<std::mutex> lock(mu_);
    Pool* p = new Pool{seg->address, seg->size, device};
    std::vector<Pool*>& open = open_pools_[device];
    if (open.size() >= kOpenPools) {
      // Drop the fullest: what is left of it is too little to look at.
      auto fullest = std::min_element(
          open.begin(), open.end(), [](const Pool* a, const Pool* b) {
            return a->size - a->used < b->size - b->used;
          });
      open.erase(fullest);
    }
    open.push_back(p);
    return CarveFrom(p, bytes);
  }

  // REQUIRES: mu_ held; `bytes` fits in what is left of `p`.
  Block* CarveFrom(Pool* p, size_t bytes) {
    auto* b =
        new Block{p->address + p->used, bytes, bytes, p->device, false, 0, {}};
    b->pool = p;
    p->used += bytes;
    ++p->blocks;
    return b;
  }

  void FreePool(Pool* p) {
    Unreserve(p->device, p->address, p->size);
    delete p;
  }

  // A segment of `bytes` from tpud on `device`'s chip, counted as reserved.
  absl::StatusOr<tpu::Segment> Reserve(c10::DeviceIndex device, size_t bytes) {
    absl::StatusOr<tpu::Segment> seg =
        GetSession().Allocate(ChipOf(device), bytes);
    if (seg.ok()) {
      std::lock_guard<std::mutex> lock(mu_);
      auto& s = stats_[device];
      s.reserved_bytes[0].increase(seg->size);
      s.segment[0].increase(1);
      s.num_device_alloc += 1;
    }
    return seg;
  }

  // Gives a segment Reserve returned back to tpud.
  void Unreserve(c10::DeviceIndex device, uint64_t address, size_t size) {
    (void)GetSession().Free(address);
    std::lock_guard<std::mutex> lock(mu_);
    auto& s = stats_[device];
    s.reserved_bytes[0].decrease(size);
    s.segment[0].decrease(1);
    s.num_device_free += 1;
  }

  Block* NewSegment(c10::DeviceIndex device, size_t bytes) {
    DrainPending();
    absl::StatusOr<tpu::Segment> seg = Reserve(device, bytes);
    if (!seg.ok() &&
        seg.status().code() == absl::StatusCode::kResourceExhausted) {
      // Give the cache back and try once more, as CUDA's allocator does.
      emptyCache({0, 0});
      std::lock_guard<std::mutex> lock(mu_);
      stats_[device].num_alloc_retries += 1;
    }
    if (!seg.ok()) seg = Reserve(device, bytes);
    if (!seg.ok()) {
      std::lock_guard<std::mutex> lock(mu_);
      stats_[device].num_ooms += 1;
    }
    Check(seg.status(), "allocating device memory");
    return new Block{seg->address, seg->size, bytes, device, false, 0, {}};
  }

  void FreeSegment(Block* b) {
    Unreserve(b->device, b->address, b->size);
    delete b;
  }

  std::mutex mu_;
  std::multimap<size_t, Block*> free_[kMaxDevices][tpu::kNumStreams];
  std::vector<Pool*> open_pools_[kMaxDevices];
  std::vector<Block*> to_record_;
  std::vector<Deferred> deferred_;
  // Blocks freed during a held run (Release), by stream and run.
  struct RunFreed {
    int stream;
    uint64_t run;
    std::vector<Block*> blocks;
  };
  std::vector<RunFreed> run_freed_;
  std::atomic<tpu::Session*> session_{nullptr};  // once SweepDeferred ran
  c10::CachingDeviceAllocator::DeviceStats stats_[kMaxDevices];
  bool used_[kMaxDevices] = {};  // a block was ever handed out there
  std::vector<Block*> pending_free_;
  bool capturing_ = false;
  std::vector<Block*> captured_;
  std::vector<Block*> capture_freed_;  // freed during the capture (parked)
  uint64_t next_hold_ = 0;
  std::unordered_map<uint64_t, std::vector<Block*>> holds_;
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

bool EverAllocatedOn(c10::DeviceIndex device) {
  return device >= 0 && device < kMaxDevices && Instance().EverUsed(device);
}

void BeginCaptureHold() { Instance().BeginHold(); }
uint64_t EndCaptureHold(const std::vector<uint64_t>& outputs) {
  return Instance().EndHold(outputs);
}
void ReleaseCaptureHold(uint64_t hold) { Instance().ReleaseHold(hold); }
uint64_t CaptureHoldBytes(uint64_t hold) { return Instance().HoldBytes(hold); }

c10::DataPtr AdoptSegment(uint64_t address, size_t bytes,
                          c10::DeviceIndex device) {
  Block* b = Instance().Adopt(address, bytes, device);
  return {reinterpret_cast<void*>(address), b, &TpuAllocator::Deleter,
          c10::Device(c10::DeviceType::PrivateUse1, device)};
}

void ResizeStorage(const c10::Storage& storage, size_t newsize) {
  c10::StorageImpl* impl = storage.unsafeGetStorageImpl();
  const size_t old = impl->nbytes();
  if (newsize == old) return;
  // The allocator serves the current device: make it the storage's own.
  const c10::Device device = impl->device();
  c10::DeviceGuard guard(device);
  c10::DataPtr fresh = GetTpuAllocator()->allocate(newsize);
  const size_t keep = std::min(old, newsize);
  if (keep > 0 && impl->data_ptr().get() != nullptr) {
    const int stream = SessionStream(CurrentStreamId(device.index()));
    Check(GetSession().CopyOnDevice(
              stream, reinterpret_cast<uint64_t>(fresh.get()),
              reinterpret_cast<uint64_t>(impl->data_ptr().get()), keep),
          "resize");
  }
  impl->set_data_ptr_noswap(std::move(fresh));
  impl->set_nbytes(newsize);
}

SessionChipMemory GetSessionChipMemory(c10::DeviceIndex device) {
  const int chip = ChipOf(device);
  absl::StatusOr<tpu::MemoryStats> m = GetSession().GetMemoryStats();
  Check(m.status(), "memory statistics");
  const tpu::ChipMemoryStats& c = m->chips.at(chip);
  SessionChipMemory out;
  out.chip_total = c.chip_total_bytes;
  out.chip_free = c.chip_free_bytes;
  out.held = c.session_bytes;
  out.quota = m->quota_bytes_per_chip;
  out.available = out.chip_free;
  if (out.quota != 0) {
    out.available =
        std::min(out.available, out.quota - std::min(out.quota, out.held));
  }
  return out;
}

}  // namespace torch_tpu
