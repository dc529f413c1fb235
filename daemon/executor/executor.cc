#include "daemon/executor/executor.h"

#include <malloc.h>
#include <poll.h>
#include <sched.h>
#include <spdlog/spdlog.h>
#include <sys/epoll.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "tpu/device_address.h"
#include "tpu/op_error.h"

namespace tpud {
namespace {

constexpr uint64_t kControlKey = 0;
constexpr uint64_t kWakeKey = 1;
// Between quanta the executor looks at its epoll set at most this often.
constexpr uint64_t kEpollCheckNs = 100000;
constexpr uint64_t kActivityWindowNs = 1000000000;
constexpr uint64_t kActiveSessionNs = 2000000;
// Sleeps stay bounded (tpu::kBoundedSleepNanos) this long after work ran.
constexpr uint64_t kBoundedWindowNanos = 100000000;

void WakeFutex(std::atomic<uint32_t>* word) {
  word->fetch_add(1);
  tpu::FutexWakeAll(word);
}

// Calls `f` on each tensor an argument carries (a tensor, a list's entries,
// an optional list's present ones) until `f` returns true; returns whether
// it did.
template <typename F>
bool AnyArgTensor(const tpu::OpArg& arg, F&& f) {
  if (arg.tag == tpu::ArgTag::kTensor) return f(arg.tensor);
  if (arg.tag != tpu::ArgTag::kTensorList &&
      arg.tag != tpu::ArgTag::kOptionalTensorList) {
    return false;
  }
  const bool optional = arg.tag == tpu::ArgTag::kOptionalTensorList;
  for (size_t i = 0; i < arg.tensors.size(); ++i) {
    if (optional && !arg.tensor_present[i]) continue;
    if (f(arg.tensors[i])) return true;
  }
  return false;
}

}  // namespace

// Result memory for the synchronous path, asked of tpud (it owns the HBM
// allocator and the session's quota).
class Executor::ResultAllocatorImpl : public ResultAllocator {
 public:
  ResultAllocatorImpl(Executor* ex, Session* s, int chip)
      : ex_(ex), s_(s), chip_(chip) {}
  absl::StatusOr<Block> Allocate(uint64_t bytes) override {
    ControlMessage req;
    req.type = ControlType::kAllocRequest;
    req.request_id = ex_->next_request_++;
    req.session_id = s_->id;
    req.a = static_cast<uint64_t>(chip_);
    req.b = std::max<uint64_t>(bytes, 1);
    if (!SendControl(ex_->config_.control_fd, req)) {
      return absl::UnavailableError(
          "tpud went away while an op needed result memory");
    }
    ControlMessage reply;
    if (!ex_->AwaitReply(req.request_id, &reply)) {
      return absl::UnavailableError(
          "tpud did not answer a result-memory request");
    }
    if (reply.code != 0) {
      reply.text[sizeof(reply.text) - 1] = '\0';
      return absl::Status(static_cast<absl::StatusCode>(reply.code),
                          reply.text);
    }
    grants_.push_back(reply.a);
    return Block{reply.a, ex_->config_.chip_bases[chip_] +
                              tpu::DeviceAddressOffset(reply.a)};
  }
  // The op failed: its result memory goes straight back.
  void Discard() {
    for (uint64_t address : grants_) {
      ControlMessage m;
      m.type = ControlType::kFreeResult;
      m.session_id = s_->id;
      m.a = address;
      SendControl(ex_->config_.control_fd, m);
    }
    grants_.clear();
  }

 private:
  Executor* ex_;
  Session* s_;
  int chip_;
  std::vector<uint64_t> grants_;
};

Executor::Executor(ExecutorConfig config)
    : config_(std::move(config)),
      slot_(&config_.shared->slots[config_.index]),
      threads_(config_.shared, config_.index, config_.intra_op_threads,
               config_.backend) {
  epoll_fd_ = epoll_create1(EPOLL_CLOEXEC);
  epoll_event ev{};
  ev.events = EPOLLIN | EPOLLRDHUP;
  ev.data.u64 = kControlKey;
  epoll_ctl(epoll_fd_, EPOLL_CTL_ADD, config_.control_fd, &ev);
  ev.events = EPOLLIN;
  ev.data.u64 = kWakeKey;
  epoll_ctl(epoll_fd_, EPOLL_CTL_ADD, config_.wake_fds[config_.index], &ev);
  next_key_ = 2;
}

Executor::~Executor() {
  while (!sessions_.empty()) Detach(sessions_.begin()->first);
  if (epoll_fd_ >= 0) close(epoll_fd_);
}

void Executor::CountError(const absl::Status& status) {
  const int code = static_cast<int>(status.code());
  if (code > 0 && code < kStatusCodes) BumpSingleWriter(slot_->op_errors[code]);
}

void Executor::RecordOpError(tpu::RingControl* ctl, uint64_t sequence,
                             const absl::Status& status) {
  CountError(status);
  RecordRingError(ctl, sequence, status);
}

std::string Executor::OpName(const BackendOp* op) {
  if (op == nullptr) return "op";
  const std::string& s = op->schema();
  return s.substr(0, s.find('('));
}

int Executor::ChipSlot(int chip) const {
  for (size_t i = 0; i < config_.chips.size(); ++i) {
    if (config_.chips[i] == chip) return static_cast<int>(i);
  }
  return -1;
}

int Executor::Run() {
  slot_->pid.store(getpid());
  // tpud sends releases only to executors that said they are ready.
  releases_seen_ = slot_->releases_sent.load(std::memory_order_seq_cst);
  slot_->state.store(ExecutorSlot::kReady);
  ControlMessage ready;
  ready.type = ControlType::kReady;
  if (!SendControl(config_.control_fd, ready)) return 1;
  uint64_t last_epoll = 0;
  while (!stopping_) {
    uint64_t now = tpu::MonotonicNanos();
    if (now - last_epoll >= kEpollCheckNs || !pending_control_.empty()) {
      DrainDoorbells(0);
      last_epoll = now;
      if (stopping_) break;
    }
    PollRings(now);
    if (now - last_activity_update_ >= 1000000) UpdateActivity(now);
    if (std::optional<FairQueue::Pick> pick = queue_.Pop()) {
      Ring* ring = handles_[pick->ring];
      if (ring != nullptr) RunRing(*ring);
      last_work_ns_ = now;
      heap_trimmed_ = false;
      continue;
    }
    // Idle, but work may come soon. CUDA's rule: spin while a core is free
    // for it; while only tpud's parties compete, yield (the core goes to
    // whoever is runnable, likely the client about to publish) for a moment;
    // when other threads need the cores, sleep at once.
    const uint32_t advice =
        config_.shared->wait_advice.load(std::memory_order_relaxed);
    if ((!polled_.empty() || !parked_.empty()) && advice != tpu::kWaitSleep) {
      const bool spin = advice == tpu::kWaitSpin;
      const uint64_t until = now + (spin ? config_.spin_ns : config_.yield_ns);
      bool found = false;
      while (!found && tpu::MonotonicNanos() < until) {
        if (spin) {
          for (int i = 0; i < 32; ++i) __builtin_ia32_pause();
        } else {
          sched_yield();
        }
        PollRings(tpu::MonotonicNanos());
        found = !queue_.empty();
      }
      if (found) continue;
    }
    UpdateActivity(now);  // what it shows holds while it sleeps
    // Idle for heap_keep_ns, it hands the memory its heap kept back to the
    // system: a training loop's short pauses keep it, a session that ended
    // does not hold it for good.
    if (!heap_trimmed_ && config_.heap_keep_ns > 0 &&
        now - last_work_ns_ >= config_.heap_keep_ns) {
      malloc_trim(0);
      heap_trimmed_ = true;
    }
    Sleep(parked_.empty() ? 100 : 10);
    last_epoll = tpu::MonotonicNanos();
  }
  slot_->state.store(ExecutorSlot::kStopped);
  return 0;
}

// ---------------------------------------------------------------- control

bool Executor::AwaitReply(uint64_t request_id, ControlMessage* reply) {
  const uint64_t deadline = tpu::MonotonicNanos() + 60ull * 1000000000ull;
  while (tpu::MonotonicNanos() < deadline) {
    pollfd p{config_.control_fd, POLLIN, 0};
    if (poll(&p, 1, 100) <= 0) continue;
    ControlMessage m;
    std::vector<int> fds;
    const int r = ReceiveControl(config_.control_fd, &m, &fds);
    if (r == 0) {
      stopping_ = true;
      return false;
    }
    if (r < 0) continue;
    if (m.type == ControlType::kAllocReply && m.request_id == request_id) {
      *reply = m;
      return true;
    }
    pending_control_.emplace_back(m, std::move(fds));
  }
  return false;
}

void Executor::HandleControl() {
  while (true) {
    ControlMessage m;
    std::vector<int> fds;
    if (!pending_control_.empty()) {
      m = pending_control_.front().first;
      fds = std::move(pending_control_.front().second);
      pending_control_.pop_front();
    } else {
      const int r = ReceiveControl(config_.control_fd, &m, &fds);
      if (r == 0) {
        stopping_ = true;  // tpud is gone
        return;
      }
      if (r < 0) return;
    }
    switch (m.type) {
      case ControlType::kAttach:
        Attach(m, fds);
        break;
      case ControlType::kDetach:
        Detach(m.session_id);
        break;
      case ControlType::kReleased:
        config_.backend->Released(m.a, m.b);
        ++releases_seen_;
        break;
      case ControlType::kStop:
        stopping_ = true;
        break;
      default:
        break;
    }
    for (int f : fds) close(f);
  }
}

void Executor::SyncReleases() {
  if (!config_.backend->DeviceMemory()) return;
  const uint64_t sent = slot_->releases_sent.load(std::memory_order_seq_cst);
  if (sent == releases_seen_) return;
  for (auto it = pending_control_.begin(); it != pending_control_.end();) {
    if (it->first.type != ControlType::kReleased) {
      ++it;
      continue;
    }
    config_.backend->Released(it->first.a, it->first.b);
    ++releases_seen_;
    it = pending_control_.erase(it);
  }
  // Each is queued before it is counted; bounded all the same.
  const uint64_t deadline = tpu::MonotonicNanos() + 1000000000ull;
  while (releases_seen_ < sent && !stopping_ &&
         tpu::MonotonicNanos() < deadline) {
    pollfd p{config_.control_fd, POLLIN, 0};
    if (poll(&p, 1, 10) <= 0) continue;
    ControlMessage m;
    std::vector<int> fds;
    const int r = ReceiveControl(config_.control_fd, &m, &fds);
    if (r == 0) {
      stopping_ = true;
      return;
    }
    if (r < 0) continue;
    if (m.type == ControlType::kReleased) {
      config_.backend->Released(m.a, m.b);
      ++releases_seen_;
      for (int f : fds) close(f);
      continue;
    }
    pending_control_.emplace_back(m, std::move(fds));
  }
}

void Executor::Attach(const ControlMessage& msg, std::vector<int>& fds) {
  if (fds.size() != 3) {
    spdlog::error(
        "executor {}: attach of session {} came with {} descriptors, not 3",
        config_.index, msg.session_id, fds.size());
    return;
  }
  if (sessions_.count(msg.session_id) != 0) return;
  auto s = std::make_unique<Session>();
  s->id = msg.session_id;
  s->tag = msg.tag;
  absl::StatusOr<SharedMapping> shm =
      SharedMapping::Map(fds[0], msg.a, /*writable=*/true);
  fds[0] = -1;
  absl::StatusOr<SharedMapping> st =
      SharedMapping::Map(fds[1], msg.b, /*writable=*/true);
  fds[1] = -1;
  if (!shm.ok() || !st.ok()) {
    spdlog::error(
        "executor {}: cannot map session {}: {}", config_.index, msg.session_id,
        std::string((shm.ok() ? st.status() : shm.status()).message()));
    return;
  }
  s->shm = *std::move(shm);
  s->shm.CloseFd();
  s->state_map = *std::move(st);
  s->state_map.CloseFd();
  s->state = SessionStateView(s->state_map.data());
  std::memcpy(&s->layout, s->shm.data(), sizeof(s->layout));
  const int num_chips = static_cast<int>(config_.chip_bases.size());
  if (s->layout.magic != tpu::kShmMagic ||
      s->layout.num_chips != static_cast<uint32_t>(num_chips) ||
      s->state.header()->magic != kSessionStateMagic) {
    spdlog::error("executor {}: session {} has an unknown memory layout",
                  config_.index, s->id);
    return;
  }
  s->doorbell_fd = fds[2];
  fds[2] = -1;
  s->epoll_key = next_key_++;
  epoll_event ev{};
  ev.events = EPOLLIN;
  ev.data.u64 = s->epoll_key;
  epoll_ctl(epoll_fd_, EPOLL_CTL_ADD, s->doorbell_fd, &ev);
  s->ops.resize(config_.chips.size());
  Session* sp = s.get();
  for (int chip : config_.chips) {
    for (int k = 0; k < tpu::kStreamsPerChip; ++k) {
      auto r = std::make_unique<Ring>();
      r->session = sp;
      r->index = tpu::RingIndex(chip, k);
      r->chip = chip;
      r->ctl = tpu::RingControlOf(sp->shm.data(), sp->layout, r->index);
      r->data = tpu::RingOf(sp->shm.data(), sp->layout, r->index);
      r->trusted = sp->state.ring(r->index);
      if (free_handles_.empty()) {
        r->handle = static_cast<int>(handles_.size());
        handles_.push_back(r.get());
      } else {
        r->handle = free_handles_.back();
        free_handles_.pop_back();
        handles_[r->handle] = r.get();
      }
      // Armed until there is work: the client rings the doorbell.
      ArmDoorbell(*r);
      r->state = Ring::State::kArmed;
      ++armed_count_;
      sp->rings.push_back(std::move(r));
    }
  }
  for (int chip : config_.chips) {
    // A predecessor that died while writing left its seqlock odd.
    PoisonTable& t = sp->state.chip(chip)->poison;
    if ((t.version.load() & 1) != 0) t.version.fetch_add(1);
  }
  by_key_[sp->epoll_key] = sp;
  sessions_[sp->id] = std::move(s);
  // Work published before we attached (or before a restart) starts now.
  for (auto& r : sp->rings) {
    if (HasWork(*r)) MakeRunnable(*r);
  }
}

void Executor::Detach(uint64_t session_id) {
  auto it = sessions_.find(session_id);
  if (it == sessions_.end()) return;
  Session* s = it->second.get();
  queue_.Forget(session_id);
  auto mine = [s](Ring* r) { return r->session == s; };
  polled_.erase(std::remove_if(polled_.begin(), polled_.end(), mine),
                polled_.end());
  parked_.erase(std::remove_if(parked_.begin(), parked_.end(), mine),
                parked_.end());
  for (auto& r : s->rings) {
    if (r->state == Ring::State::kArmed) --armed_count_;
    handles_[r->handle] = nullptr;
    free_handles_.push_back(r->handle);
  }
  if (s->doorbell_fd >= 0) {
    epoll_ctl(epoll_fd_, EPOLL_CTL_DEL, s->doorbell_fd, nullptr);
    close(s->doorbell_fd);
  }
  by_key_.erase(s->epoll_key);
  sessions_.erase(it);
}

// ---------------------------------------------------------------- scheduling

bool Executor::HasWork(const Ring& ring) const {
  // seq_cst: after arming a doorbell this load must not pass the flag's store.
  return ring.ctl->tail.load(std::memory_order_seq_cst) !=
         ring.trusted->head.load(std::memory_order_relaxed);
}

bool Executor::ParkedReady(const Ring& ring) const {
  const Session& s = *ring.session;
  if (s.failed || s.state.header()->dead.load() != 0) return true;
  if (ring.in_collective) return CollectiveReady(ring, tpu::MonotonicNanos());
  const TrustedRing* other = s.state.ring(ring.wait_ring);
  return other->last_sequence.load(std::memory_order_acquire) >=
             ring.wait_sequence ||
         tpu::RingControlOf(s.shm.data(), s.layout, ring.wait_ring)
                 ->dead.load() != 0;
}

void Executor::ArmDoorbell(Ring& ring) {
  // The epoch first: a producer that sees the flag sees this epoch too, and
  // rings once for it.
  ring.ctl->sleep_epoch.fetch_add(1, std::memory_order_release);
  ring.ctl->consumer_sleeping.store(1, std::memory_order_seq_cst);
}

void Executor::MakeRunnable(Ring& ring) {
  if (ring.state == Ring::State::kQueued) return;
  if (ring.state == Ring::State::kArmed) {
    ring.ctl->consumer_sleeping.store(0, std::memory_order_relaxed);
    --armed_count_;
  } else if (ring.in_collective) {
    ring.ctl->consumer_sleeping.store(
        0, std::memory_order_relaxed);  // armed parked (Sleep)
  }
  ring.state = Ring::State::kQueued;
  queue_.Push(ring.session->id, ring.handle);
}

void Executor::PollRings(uint64_t now) {
  if (!polled_.empty()) {
    size_t keep = 0;
    for (Ring* r : polled_) {
      if (r->state != Ring::State::kPolled) continue;
      if (HasWork(*r)) {
        MakeRunnable(*r);
        continue;
      }
      if (now - r->polled_since > config_.poll_ns) {
        // Quiet for a while: arm the doorbell, then look once more so a
        // record published in between is never missed.
        ArmDoorbell(*r);
        r->state = Ring::State::kArmed;
        ++armed_count_;
        if (HasWork(*r)) MakeRunnable(*r);
        continue;
      }
      polled_[keep++] = r;
    }
    polled_.resize(keep);
  }
  if (!parked_.empty()) {
    size_t keep = 0;
    for (Ring* r : parked_) {
      if (r->state != Ring::State::kParked) continue;
      if (ParkedReady(*r)) {
        r->state = Ring::State::kPolled;
        MakeRunnable(*r);
        continue;
      }
      parked_[keep++] = r;
    }
    parked_.resize(keep);
  }
}

void Executor::Sleep(int timeout_ms) {
  // Every polled ring gets its doorbell armed first.
  for (Ring* r : polled_) {
    if (r->state != Ring::State::kPolled) continue;
    ArmDoorbell(*r);
    r->state = Ring::State::kArmed;
    ++armed_count_;
    if (HasWork(*r)) MakeRunnable(*r);
  }
  polled_.clear();
  // A ring parked on a collective with nothing behind it: its group may be
  // completed for it by the executor that runs it, which then leaves waking
  // us to the client's next record (FinishPeerSlot). Arm, then look again.
  for (Ring* r : parked_) {
    if (r->state != Ring::State::kParked || !r->in_collective ||
        !r->collective_posted ||
        r->ctl->submitted.load(std::memory_order_relaxed) !=
            r->collective_sequence) {
      continue;
    }
    ArmDoorbell(*r);
    if (ParkedReady(*r)) {
      r->state = Ring::State::kPolled;
      MakeRunnable(*r);
    }
  }
  // Bounded while the cores are oversubscribed and work ran lately: then
  // producers may skip the doorbell, and we look at the rings ourselves.
  const uint64_t now = tpu::MonotonicNanos();
  const bool bounded = config_.unrung &&
                       config_.shared->wait_advice.load(
                           std::memory_order_relaxed) != tpu::kWaitSpin &&
                       now - last_run_ns_ < kBoundedWindowNanos;
  if (bounded != sleep_bounded_) SetSleepBounded(bounded);
  if (!queue_.empty()) return;
  slot_->sleeping.store(1);
  DrainDoorbells(bounded ? static_cast<int>(tpu::kBoundedSleepNanos / 1000000)
                         : timeout_ms);
  slot_->sleeping.store(0);
  if (bounded && WakeArmedWithWork()) BumpSingleWriter(slot_->unrung_wakes);
  if (config_.shared->sampler_sleeping.load() != 0)
    WakeFutex(&config_.shared->sampler_futex);
}

void Executor::SetSleepBounded(bool bounded) {
  sleep_bounded_ = bounded;
  for (auto& [id, session] : sessions_) {
    for (auto& r : session->rings)
      r->ctl->sleep_bounded.store(bounded ? 1 : 0, std::memory_order_seq_cst);
  }
  // A producer that still read 1 may have left a record unrung.
  if (!bounded) WakeArmedWithWork();
}

bool Executor::WakeArmedWithWork() {
  bool found = false;
  for (auto& [id, session] : sessions_) {
    for (auto& r : session->rings) {
      if (r->state == Ring::State::kArmed && HasWork(*r)) {
        MakeRunnable(*r);
        found = true;
      }
    }
  }
  return found;
}

void Executor::DrainDoorbells(int timeout_ms) {
  constexpr int kMaxEvents = 64;
  epoll_event events[kMaxEvents];
  const int n = epoll_wait(epoll_fd_, events, kMaxEvents, timeout_ms);
  bool control = !pending_control_.empty();
  for (int i = 0; i < n; ++i) {
    const uint64_t key = events[i].data.u64;
    if (key == kControlKey) {
      control = true;
      continue;
    }
    if (key == kWakeKey) {
      uint64_t v;
      (void)!read(config_.wake_fds[config_.index], &v, sizeof(v));
      continue;  // parked rings are looked at on every pass
    }
    auto it = by_key_.find(key);
    if (it == by_key_.end()) continue;
    Session* s = it->second;
    uint64_t v;
    (void)!read(s->doorbell_fd, &v, sizeof(v));
    for (auto& r : s->rings) {
      if (r->state != Ring::State::kArmed) continue;
      if (!HasWork(*r)) {
        // A producer rang for work we had already done: a new epoch, so its
        // next record rings again (it rings once per epoch).
        ArmDoorbell(*r);
      }
      if (HasWork(*r)) MakeRunnable(*r);
    }
  }
  if (control) HandleControl();
}

void Executor::UpdateActivity(uint64_t now) {
  last_activity_update_ = now;
  threads_.Apply(now);
  if (config_.backend->Compiles()) {
    slot_->compiles_ops.store(1, std::memory_order_relaxed);
    slot_->programs_cached.store(config_.backend->programs_cached(),
                                 std::memory_order_relaxed);
    slot_->device_buffer_bytes.store(config_.backend->device_buffer_bytes(),
                                     std::memory_order_relaxed);
    const DiskCacheStats d = config_.backend->disk_cache_stats();
    slot_->disk_cache_entries.store(d.entries, std::memory_order_relaxed);
    slot_->disk_cache_bytes.store(d.bytes, std::memory_order_relaxed);
    slot_->disk_cache_max_bytes.store(d.max_bytes, std::memory_order_relaxed);
    slot_->disk_cache_rejected.store(d.rejected, std::memory_order_relaxed);
    slot_->disk_cache_write_errors.store(d.write_errors,
                                         std::memory_order_relaxed);
    slot_->disk_cache_enabled.store(d.enabled ? 1 : 0,
                                    std::memory_order_relaxed);
    for (size_t i = 0; i < config_.chips.size() && i < tpu::kMaxChipsPerHost;
         ++i) {
      const CompileStats c = config_.backend->compile_stats(config_.chips[i]);
      slot_->compiles[i].store(c.compiles, std::memory_order_relaxed);
      slot_->compile_ns[i].store(c.compile_ns, std::memory_order_relaxed);
      slot_->program_hits[i].store(c.hits, std::memory_order_relaxed);
      slot_->disk_hits[i].store(c.disk_hits, std::memory_order_relaxed);
      slot_->disk_stores[i].store(c.disk_stores, std::memory_order_relaxed);
      slot_->saved_ns[i].store(c.saved_ns, std::memory_order_relaxed);
      slot_->collective_programs[i].store(c.collectives,
                                          std::memory_order_relaxed);
      slot_->graph_programs[i].store(c.graphs, std::memory_order_relaxed);
    }
  }
  uint32_t active = 0;
  for (const auto& [id, s] : sessions_) {
    if (now - s->last_active_ns < kActiveSessionNs) ++active;
  }
  slot_->active_sessions.store(active, std::memory_order_relaxed);
  // Queue depth: records clients published that are not done yet. A
  // client's `submitted` is its own word, so a hostile one moves only its own
  // figure, and by at most a ring's worth of records.
  uint64_t depth[tpu::kMaxChipsPerHost] = {};
  for (const auto& [id, s] : sessions_) {
    if (s->failed) continue;
    for (const auto& r : s->rings) {
      const int i = ChipSlot(r->chip);
      if (i < 0 || i >= tpu::kMaxChipsPerHost) continue;
      const uint64_t submitted =
          r->ctl->submitted.load(std::memory_order_relaxed);
      const uint64_t done =
          r->trusted->last_sequence.load(std::memory_order_relaxed);
      if (submitted > done) {
        depth[i] += std::min<uint64_t>(
            submitted - done, s->layout.ring_bytes / sizeof(tpu::RecordHeader));
      }
    }
  }
  for (size_t i = 0; i < config_.chips.size() && i < tpu::kMaxChipsPerHost;
       ++i) {
    slot_->queue_depth[i].store(depth[i], std::memory_order_relaxed);
  }
  if (window_start_ns_ == 0) window_start_ns_ = now;
  if (now - window_start_ns_ >= kActivityWindowNs) {
    slot_->duty_permille.store(
        window_busy_ns_ * 1000 / (now - window_start_ns_),
        std::memory_order_relaxed);
    window_start_ns_ = now;
    window_busy_ns_ = 0;
  }
}

void Executor::RunRing(Ring& ring) {
  Session& s = *ring.session;
  const uint64_t start = tpu::MonotonicNanos();
  last_run_ns_ = start;
  uint64_t now = start;
  uint64_t records = 0;
  const int chip_slot = ChipSlot(ring.chip);
  while (true) {
    if (s.failed ||
        s.state.header()->dead.load(std::memory_order_relaxed) != 0) {
      ring.state = Ring::State::kDone;
      break;
    }
    if (!HasWork(ring)) {
      ring.state = Ring::State::kPolled;
      ring.polled_since = now;
      polled_.push_back(&ring);
      break;
    }
    const uint64_t op_start = now;
    if (!Step(ring)) break;  // parked, or the session failed
    ++records;
    now = tpu::MonotonicNanos();
    if (chip_slot >= 0 && chip_slot < tpu::kMaxChipsPerHost) {
      BumpSingleWriter(
          slot_->op_latency[chip_slot][OpLatencyBucket(now - op_start)]);
      BumpSingleWriter(slot_->op_latency_sum_ns[chip_slot], now - op_start);
    }
    // At the end of its quantum a ring goes back to the queue even when no
    // other ring waits there: the loop in Run() must still look at the
    // doorbells, poll the other rings and publish activity. A client that
    // keeps its ring full would otherwise hold this loop, unseen by tpuctl
    // and ahead of sessions whose rings were never polled.
    if (now - start >= config_.quantum_ns) {
      ring.state = Ring::State::kQueued;
      queue_.Push(s.id, ring.handle);
      break;
    }
  }
  const uint64_t busy = now - start;
  threads_.Worked(now);
  queue_.Charge(s.id, busy);
  s.last_active_ns = now;
  window_busy_ns_ += busy;
  slot_->busy_ns.fetch_add(busy, std::memory_order_relaxed);
  slot_->ops.fetch_add(records, std::memory_order_relaxed);
  SessionChipState* cs = s.state.chip(ring.chip);
  cs->busy_ns.fetch_add(busy, std::memory_order_relaxed);
  cs->ops.fetch_add(records, std::memory_order_relaxed);
  cs->last_active_ns.store(now, std::memory_order_relaxed);
}

// ---------------------------------------------------------------- records

void Executor::WakeCompletionWaiters(TrustedRing* trusted,
                                     tpu::RingControl* ctl) {
  // Waiters are woken once what the earliest of them waits for is done
  // (tpu/shm_layout.h); they set wake_at again if they still wait.
  if (ctl->waiters.load() > 0 && ctl->completed.load() >= ctl->wake_at.load()) {
    ctl->wake_at.store(~uint64_t{0});
    WakeFutex(&ctl->completion_futex);
  }
  // Executors parked on this ring.
  if (trusted->watchers.load(std::memory_order_seq_cst) != 0) {
    uint64_t w = trusted->watchers.exchange(0);
    for (int e = 0; w != 0 && e < static_cast<int>(config_.wake_fds.size());
         ++e, w >>= 1) {
      if ((w & 1) != 0) WakeExecutor(config_.wake_fds, e, config_.index);
    }
  }
}

void Executor::Complete(Ring& ring, uint64_t length, uint64_t sequence) {
  const uint64_t head =
      ring.trusted->head.load(std::memory_order_relaxed) + length;
  ring.trusted->head.store(head, std::memory_order_relaxed);
  if (sequence != 0) {
    ring.trusted->last_sequence.store(sequence, std::memory_order_seq_cst);
    if (ring.trusted->completed_early.load(std::memory_order_relaxed) != 0) {
      ring.trusted->completed_early.store(0, std::memory_order_relaxed);
    }
  }
  tpu::RingControl* ctl = ring.ctl;
  ctl->head.store(head, std::memory_order_release);
  if (sequence != 0) {
    ctl->completed.store(sequence, std::memory_order_seq_cst);
    WakeCompletionWaiters(ring.trusted, ctl);
  }
  if (ctl->producer_waiting.load() != 0 && head >= ctl->wanted_head.load()) {
    ctl->producer_waiting.store(0);
    WakeFutex(&ctl->head_futex);
  }
}

void Executor::FailSession(Session& s, const absl::Status& status) {
  // A malformed record fails the whole session's data plane: the client is
  // broken or hostile. The executor and every other session go on.
  spdlog::warn("session {} failed: {}", s.id, std::string(status.message()));
  CountError(status);
  s.failed = true;
  s.state.header()->dead.store(1);
  const absl::Status st(status.code(),
                        absl::StrCat("session failed: ", status.message()));
  for (uint32_t r = 0; r < s.layout.num_rings; ++r) {
    KillRing(tpu::RingControlOf(s.shm.data(), s.layout, static_cast<int>(r)),
             st);
  }
  ControlMessage m;
  m.type = ControlType::kSessionFailed;
  m.session_id = s.id;
  const std::string text(status.message());
  SetControlText(&m, text.data(), text.size());
  SendControl(config_.control_fd, m);
}

bool Executor::Step(Ring& ring) {
  Session& s = *ring.session;
  tpu::RingControl* ctl = ring.ctl;
  const uint64_t ring_bytes = s.layout.ring_bytes;
  const uint64_t head = ring.trusted->head.load(std::memory_order_relaxed);
  const uint64_t tail = ctl->tail.load(std::memory_order_acquire);
  const int stream = ring.index;
  auto fail = [&](absl::Status st) {
    FailSession(s, st);
    ring.state = Ring::State::kDone;
    return false;
  };
  if (tail - head > ring_bytes || tail < head) {
    return fail(absl::InvalidArgumentError(absl::StrFormat(
        "ring %d: tail %d is not within one ring (%d bytes) of head %d", stream,
        tail, ring_bytes, head)));
  }
  const uint64_t pos = head & (ring_bytes - 1);
  const uint64_t available = std::min(tail - head, ring_bytes - pos);
  if (available < sizeof(tpu::RecordHeader)) {
    return fail(absl::InvalidArgumentError(
        absl::StrFormat("ring %d: %d bytes published at ring offset %d, less "
                        "than a record header",
                        stream, available, pos)));
  }
  tpu::RecordHeader header;
  std::memcpy(&header, ring.data + pos, sizeof(header));
  if (header.kind == static_cast<uint16_t>(tpu::RecordKind::kPad)) {
    // Filler to the end of the ring; nothing to run, no sequence.
    if (header.length != ring_bytes - pos) {
      return fail(absl::InvalidArgumentError(absl::StrFormat(
          "ring %d: pad record of %d bytes at offset %d does not reach the "
          "ring's end",
          stream, header.length, pos)));
    }
    Complete(ring, header.length, 0);
    return true;
  }
  if (absl::Status st = tpu::CheckHeader(header, available); !st.ok()) {
    return fail(absl::InvalidArgumentError(
        absl::StrCat("ring ", stream, ": malformed record: ", st.message())));
  }
  uint64_t last = ring.trusted->last_sequence.load(std::memory_order_acquire);
  // A collective whose group another executor completed for us early is
  // still ours to take off the ring.
  if (header.sequence == last && last != 0 &&
      header.kind == static_cast<uint16_t>(tpu::RecordKind::kCollective) &&
      ring.trusted->completed_early.load(std::memory_order_acquire) == last) {
    --last;
  }
  if (header.sequence != last + 1) {
    return fail(absl::InvalidArgumentError(absl::StrFormat(
        "ring %d: record sequence %d after %d (sequences count up by one)",
        stream, header.sequence, last)));
  }
  // Work on a private copy: the client could rewrite the ring meanwhile.
  record_.assign(ring.data + pos, header.length);
  const absl::string_view record(record_);
  switch (static_cast<tpu::RecordKind>(header.kind)) {
    case tpu::RecordKind::kDefineOp: {
      if (absl::Status st = HandleDefineOp(ring, record); !st.ok())
        return fail(st);
      break;
    }
    case tpu::RecordKind::kOp: {
      if (absl::Status st = tpu::DecodeOp(record, &op_); !st.ok())
        return fail(st);
      poison_root_.clear();
      absl::Status st = RunOp(ring, header.sequence);
      if (!st.ok()) {
        // Outputs of an op that failed on a poisoned input carry the root
        // cause, not a chain of "produced by an op that failed" prefixes.
        // A kernel's own error (an ATen exception) poisons only the new
        // outputs, and nothing when the client waits for the op and raises
        // it: tensors written in place keep what the kernel left, as on the
        // CPU (argument checks run before a kernel writes anything).
        const OpSlot& slot = LookupOp(ring, op_.op_id);
        const bool kernel_error = tpu::AtenErrorOf(st) != tpu::AtenError::kNone;
        if (!kernel_error || (op_.flags & tpu::kOpFlagChecked) == 0) {
          PoisonOutputs(
              ring, kernel_error ? nullptr : slot.op.get(),
              poison_root_.empty() ? std::string(st.message()) : poison_root_);
        }
        RecordOpError(ctl, header.sequence, st);
      }
      break;
    }
    case tpu::RecordKind::kCopy: {
      tpu::DecodedCopy copy;
      if (absl::Status st = tpu::DecodeCopy(record, &copy); !st.ok())
        return fail(st);
      BeginOp(ring, header.sequence, "copy", 4);
      absl::Status st = RunCopy(ring, copy);
      EndOp();
      if (!st.ok()) RecordOpError(ctl, header.sequence, st);
      break;
    }
    case tpu::RecordKind::kEventRecord: {
      uint32_t slot = 0;
      if (absl::Status st = tpu::DecodeEventRecord(record, &slot); !st.ok())
        return fail(st);
      if (slot >= static_cast<uint32_t>(tpu::kMaxEvents)) {
        return fail(absl::InvalidArgumentError(
            absl::StrCat("event slot ", slot, " out of range")));
      }
      tpu::EventSlot* ev =
          tpu::EventOf(s.shm.data(), s.layout, static_cast<int>(slot));
      ev->sequence.store(header.sequence);
      ev->completed_ns.store(tpu::MonotonicNanos());
      break;
    }
    case tpu::RecordKind::kCollective: {
      bool done = false, malformed = false;
      absl::Status st =
          StepCollective(ring, header.sequence, record, &done, &malformed);
      if (malformed) return fail(st);
      if (!done) {
        ring.state = Ring::State::kParked;
        parked_.push_back(&ring);
        return false;  // the record stays at the head until its group is done
      }
      if (!st.ok()) RecordOpError(ctl, header.sequence, st);
      break;
    }
    case tpu::RecordKind::kRunProgram: {
      if (absl::Status st = tpu::DecodeRunProgram(record, &run_); !st.ok())
        return fail(st);
      absl::Status st = RunProgram(ring, header.sequence, run_);
      if (!st.ok()) RecordOpError(ctl, header.sequence, st);
      break;
    }
    case tpu::RecordKind::kEventWait: {
      tpu::DecodedEventWait wait;
      if (absl::Status st = tpu::DecodeEventWait(record, &wait); !st.ok())
        return fail(st);
      bool ready = false;
      absl::Status st = CheckEventWait(ring, header.sequence, wait, &ready);
      if (!st.ok()) {
        RecordOpError(ctl, header.sequence, st);
      } else if (!ready) {
        ring.wait_ring = static_cast<int>(wait.stream);
        ring.wait_sequence = wait.sequence;
        ring.state = Ring::State::kParked;
        parked_.push_back(&ring);
        return false;  // the record stays at the head until its wait is over
      }
      break;
    }
    default:
      return fail(absl::InvalidArgumentError(
          absl::StrCat("unknown record kind ", header.kind)));
  }
  Complete(ring, header.length, header.sequence);
  return true;
}

absl::Status Executor::HandleDefineOp(Ring& ring, absl::string_view record) {
  tpu::DecodedDefineOp def;
  if (absl::Status st = tpu::DecodeDefineOp(record, &def); !st.ok()) return st;
  if (def.op_id >= kMaxOpIds) {
    return absl::InvalidArgumentError(absl::StrCat(
        "op id ", def.op_id, " out of range (at most ", kMaxOpIds - 1, ")"));
  }
  SessionChipState* cs = ring.session->state.chip(ring.chip);
  OpTableEntry& e = cs->op_table[def.op_id];
  const bool same =
      e.length == def.schema.size() &&
      std::memcmp(cs->op_arena + e.offset, def.schema.data(), e.length) == 0;
  if (!same) {
    if (def.schema.size() > kOpArenaBytes - cs->op_arena_used) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "this session defined more operator schemas than tpud keeps (",
          kOpArenaBytes / 1024, " KiB of schema text per chip); reuse op ids"));
    }
    std::memcpy(cs->op_arena + cs->op_arena_used, def.schema.data(),
                def.schema.size());
    e.offset = cs->op_arena_used;
    e.length = static_cast<uint32_t>(def.schema.size());
    cs->op_arena_used += static_cast<uint32_t>(def.schema.size());
  }
  std::vector<OpSlot>& ops = ring.session->ops[ChipSlot(ring.chip)];
  if (ops.size() <= def.op_id) ops.resize(def.op_id + 1);
  ops[def.op_id] = OpSlot{};  // looked up on first use
  return absl::OkStatus();
}

const Executor::OpSlot& Executor::LookupOp(Ring& ring, uint32_t op_id) {
  static const OpSlot kUndefined{
      nullptr, absl::InvalidArgumentError("op id out of range"), true};
  if (op_id >= kMaxOpIds) return kUndefined;
  std::vector<OpSlot>& ops = ring.session->ops[ChipSlot(ring.chip)];
  if (ops.size() <= op_id) ops.resize(op_id + 1);
  OpSlot& slot = ops[op_id];
  if (slot.resolved) return slot;
  slot.resolved = true;
  const SessionChipState* cs = ring.session->state.chip(ring.chip);
  const OpTableEntry& e = cs->op_table[op_id];
  if (e.length == 0) {
    slot.status = absl::InvalidArgumentError(
        absl::StrCat("op id ", op_id, " was never defined on this session"));
    return slot;
  }
  absl::StatusOr<std::shared_ptr<const BackendOp>> op =
      config_.backend->LookupOp(
          absl::string_view(cs->op_arena + e.offset, e.length));
  if (op.ok()) {
    slot.op = *std::move(op);
  } else {
    slot.status = op.status();  // the ops that use this id fail with the reason
  }
  return slot;
}

void Executor::BeginOp(Ring& ring, uint64_t sequence, const char* what,
                       size_t what_len) {
  slot_->current_session.store(ring.session->id, std::memory_order_relaxed);
  slot_->current_ring.store(static_cast<uint32_t>(ring.index),
                            std::memory_order_relaxed);
  slot_->current_sequence.store(sequence, std::memory_order_relaxed);
  what_len = std::min(what_len, sizeof(slot_->current_op) - 1);
  std::memcpy(slot_->current_op, what, what_len);
  slot_->current_op[what_len] = '\0';
  slot_->op_started_ns.store(tpu::MonotonicNanos(), std::memory_order_release);
  // The memory fence: published before any page owner is read.
  slot_->in_op_tag.store(ring.session->tag, std::memory_order_seq_cst);
}

void Executor::EndOp() {
  slot_->op_started_ns.store(0, std::memory_order_relaxed);
  slot_->in_op_tag.store(0, std::memory_order_seq_cst);
  if (slot_->fence_waiters.load(std::memory_order_seq_cst) != 0)
    WakeFutex(&slot_->op_epoch);
}

absl::Status Executor::ResolveTensors(Ring& ring) {
  refs_.clear();
  for (size_t a = 0; a < op_.num_args; ++a) {
    AnyArgTensor(op_.args[a], [&](const tpu::TensorRef& t) {
      refs_.push_back(&t);
      return false;
    });
  }
  for (const tpu::TensorRef& t : op_.outputs) refs_.push_back(&t);
  resolved_.resize(refs_.size());
  const Session& s = *ring.session;
  const int num_chips = static_cast<int>(config_.chip_bases.size());
  const size_t first_output = refs_.size() - op_.outputs.size();
  for (size_t i = 0; i < refs_.size(); ++i) {
    const tpu::TensorRef& t = *refs_[i];
    absl::StatusOr<tpu::Footprint> fp = tpu::TensorFootprint(t);
    if (!fp.ok()) return fp.status();
    // No storage: an empty tensor, or an output slot the client left empty
    // because the op returns no tensor there (convolution_backward's
    // grad_input when the input needs none). The backend never writes one.
    if (t.address == 0 && (fp->end == 0 || i >= first_output)) {
      resolved_[i] = ResolvedTensor{};
      continue;
    }
    const int c = tpu::DeviceAddressChip(t.address);
    if (c >= 0 && c < num_chips && c != ring.chip) {
      return absl::InvalidArgumentError(
          absl::StrFormat("tensors of one op must be on one chip: chips %d and "
                          "%d; copy one first",
                          ring.chip, c));
    }
    const uint64_t offset = tpu::DeviceAddressOffset(t.address);
    std::optional<PageOwnerTable::Segment> seg =
        c == ring.chip ? config_.owners[c].Find(offset, fp->end, s.tag)
                       : std::nullopt;
    if (!seg.has_value()) {
      bad_ref_ = i;
      const uint32_t owner =
          c == ring.chip ? config_.owners[c].OwnerOf(offset) : 0;
      bad_ref_foreign_ = owner != 0 && owner != s.tag;
      return absl::NotFoundError("");  // worded by the caller
    }
    resolved_[i] = ResolvedTensor{config_.chip_bases[c] + seg->offset,
                                  tpu::MakeDeviceAddress(c, seg->offset),
                                  seg->bytes, s.id};
  }
  return absl::OkStatus();
}

absl::Status Executor::RunOp(Ring& ring, uint64_t sequence) {
  Session& s = *ring.session;
  const OpSlot& slot = LookupOp(ring, op_.op_id);
  if (slot.op == nullptr) return slot.status;
  const BackendOp& op = *slot.op;
  const bool sync = (op_.flags & tpu::kOpFlagSync) != 0;
  tpu::RingControl* ctl = ring.ctl;
  const std::string& schema = op.schema();
  BeginOp(
      ring, sequence, schema.data(),
      schema.find('(') == std::string::npos ? schema.size() : schema.find('('));
  absl::Status status;
  if (s.state.header()->dead.load(std::memory_order_seq_cst) != 0) {
    status = absl::UnavailableError("the session ended");
  } else {
    SyncReleases();
    status = ResolveTensors(ring);
    if (!status.ok() && status.code() != absl::StatusCode::kNotFound) {
      status = absl::Status(status.code(),
                            absl::StrCat(OpName(&op), ": ", status.message()));
    }
  }
  if (status.ok()) status = CheckInputPoison(ring, op);
  if (status.ok()) {
    ResultAllocatorImpl alloc(this, &s, ring.chip);
    results_.clear();
    status = config_.backend->Run(op, op_, resolved_,
                                  sync ? &results_ : nullptr, &alloc);
    std::string warning;
    bool deprecation = false;
    if (config_.backend->TakeWarning(&warning, &deprecation))
      RecordRingWarning(ctl, sequence, warning, deprecation);
    if (status.ok()) {
      if (s.state.chip(ring.chip)->poison.count != 0) UnpoisonOutputs(ring, op);
    } else {
      alloc.Discard();
    }
  }
  EndOp();
  if (!status.ok() && status.code() == absl::StatusCode::kNotFound) {
    // A tensor outside the session's own segments: tell forged from foreign.
    const tpu::TensorRef& t = *refs_[bad_ref_];
    std::string what = absl::StrFormat(
        "%s: tensor %d at device address 0x%x (dtype %d, %d dims) is %s",
        OpName(&op), bad_ref_, t.address, t.dtype, t.ndim,
        bad_ref_foreign_ ? "in another session's memory"
                         : "not inside one of this session's segments");
    status = bad_ref_foreign_ ? absl::PermissionDeniedError(what)
                              : absl::InvalidArgumentError(what);
  }
  if (!sync) return status;
  ctl->response_code = static_cast<uint32_t>(status.code());
  ctl->response_kind = static_cast<uint32_t>(tpu::AtenErrorOf(status));
  ctl->num_results = 0;
  if (status.ok()) {
    const size_t n = std::min<size_t>(results_.size(), tpu::kMaxResults);
    for (size_t i = 0; i < n; ++i) {
      const ResultValue& r = results_[i];
      tpu::ShmResult& out = ctl->results[i];
      std::memset(&out, 0, sizeof(out));
      out.kind = static_cast<uint8_t>(r.kind);
      out.i = r.i;
      out.d = r.d;
      out.d_imag = r.d_imag;
      if (r.kind == ResultValue::Kind::kBool) out.i = r.b;
      if (r.kind == ResultValue::Kind::kTensor) {
        out.dtype = r.tensor.dtype;
        out.ndim = r.tensor.ndim;
        out.address = r.tensor.address;
        out.storage_offset = r.tensor.storage_offset;
        uint64_t numel = 1;
        for (int d = 0; d < r.tensor.ndim; ++d) {
          out.sizes[d] = r.tensor.sizes[d];
          out.strides[d] = r.tensor.strides[d];
          numel *= static_cast<uint64_t>(r.tensor.sizes[d]);
        }
        out.nbytes = numel * tpu::ElementSize(r.tensor.dtype);
      }
    }
    ctl->num_results = static_cast<uint32_t>(n);
    ctl->response_message[0] = '\0';
  } else {
    std::string msg(status.message());
    msg.resize(std::min<size_t>(msg.size(), tpu::kErrorMessageBytes - 1));
    std::memcpy(ctl->response_message, msg.c_str(), msg.size() + 1);
  }
  ctl->response_sequence = sequence;
  // A synchronous op's failure is reported to its caller directly; a
  // kernel's own error poisons nothing (as in Step, for a checked op).
  if (!status.ok() && tpu::AtenErrorOf(status) == tpu::AtenError::kNone) {
    PoisonOutputs(
        ring, &op,
        poison_root_.empty() ? std::string(status.message()) : poison_root_);
  }
  return absl::OkStatus();
}

absl::StatusOr<char*> Executor::DeviceRange(Session& s, uint64_t address,
                                            uint64_t bytes, const char* what) {
  const int c = tpu::DeviceAddressChip(address);
  const uint64_t offset = tpu::DeviceAddressOffset(address);
  std::optional<PageOwnerTable::Segment> seg;
  if (c >= 0 && c < static_cast<int>(config_.owners.size())) {
    seg = config_.owners[c].Find(offset, bytes, s.tag);
  }
  if (!seg.has_value()) {
    const uint32_t owner = c >= 0 && c < static_cast<int>(config_.owners.size())
                               ? config_.owners[c].OwnerOf(offset)
                               : 0;
    std::string msg = absl::StrFormat(
        "copy of %d bytes: device %s range at 0x%x is %s", bytes, what, address,
        owner != 0 && owner != s.tag
            ? "in another session's memory"
            : "not inside one of this session's segments");
    if (owner != 0 && owner != s.tag) return absl::PermissionDeniedError(msg);
    return absl::InvalidArgumentError(msg);
  }
  return config_.chip_bases[c] + offset;
}

absl::StatusOr<char*> Executor::HostRange(Session& s, uint64_t offset,
                                          uint64_t bytes) {
  // Host sides of copies must lie in the staging area or the pinned pool.
  const uint64_t begin = s.layout.staging_offset;
  const uint64_t end = s.layout.pinned_offset + s.layout.pinned_bytes;
  if (offset < begin || offset > end || bytes > end - offset) {
    return absl::InvalidArgumentError(
        absl::StrFormat("host range [0x%x, +%d) is outside the session's "
                        "staging area and pinned pool",
                        offset, bytes));
  }
  return s.shm.data() + offset;
}

absl::Status Executor::RunCopy(Ring& ring, const tpu::DecodedCopy& copy) {
  if (copy.bytes == 0) return absl::OkStatus();
  Session& s = *ring.session;
  if (s.state.header()->dead.load(std::memory_order_seq_cst) != 0) {
    return absl::UnavailableError("the session ended");
  }
  const bool to_device = copy.kind != tpu::CopyKind::kDeviceToHost;
  const bool from_device = copy.kind != tpu::CopyKind::kHostToDevice;
  // Each copy runs on the ring of the chip whose poison it may change (the
  // destination's; the source's for device-to-host copies).
  const uint64_t own = to_device ? copy.dst : copy.src;
  const int own_chip = tpu::DeviceAddressChip(own);
  if (own_chip != ring.chip) {
    return absl::InvalidArgumentError(
        absl::StrFormat("copy %s device address 0x%x (chip %d) on a ring of "
                        "chip %d: copies go on a ring of "
                        "the chip they write (or, to the host, read)",
                        to_device ? "to" : "from", own, own_chip, ring.chip));
  }
  SyncReleases();
  absl::StatusOr<char*> src =
      from_device ? DeviceRange(s, copy.src, copy.bytes, "source")
                  : HostRange(s, copy.src, copy.bytes);
  if (!src.ok()) return src.status();
  absl::StatusOr<char*> dst =
      to_device ? DeviceRange(s, copy.dst, copy.bytes, "destination")
                : HostRange(s, copy.dst, copy.bytes);
  if (!dst.ok()) return dst.status();
  std::string cause;
  if (from_device && FindPoison(s, tpu::DeviceAddressChip(copy.src), copy.src,
                                copy.src + copy.bytes, &cause)) {
    // The data came from an op that failed: it stays poisoned where it goes.
    if (to_device)
      AddPoison(s, ring.chip, copy.dst, copy.dst + copy.bytes, cause);
    return absl::FailedPreconditionError(absl::StrCat(
        "the copied data was produced by an op that failed earlier: ", cause));
  }
  // A backend with memory of its own brings the arena's copy up to date.
  if (from_device) {
    if (absl::Status st =
            config_.backend->HostAccess(copy.src, copy.bytes, false, s.id);
        !st.ok())
      return st;
  }
  if (to_device) {
    if (absl::Status st =
            config_.backend->HostAccess(copy.dst, copy.bytes, true, s.id);
        !st.ok())
      return st;
  }
  std::memmove(*dst, *src, copy.bytes);
  if (to_device) ClearPoison(s, ring.chip, copy.dst, copy.dst + copy.bytes);
  return absl::OkStatus();
}

absl::Status Executor::CheckEventWait(Ring& ring, uint64_t sequence,
                                      const tpu::DecodedEventWait& wait,
                                      bool* ready) {
  Session& s = *ring.session;
  *ready = false;
  if (wait.stream >= s.layout.num_rings) {
    return absl::InvalidArgumentError(absl::StrCat(
        "event wait on ring ", wait.stream, " (this session has rings 0..",
        s.layout.num_rings - 1, ")"));
  }
  if (static_cast<int>(wait.stream) == ring.index &&
      wait.sequence >= sequence) {
    return absl::InvalidArgumentError(absl::StrCat(
        "ring ", ring.index, " waits on its own later work (sequence ",
        wait.sequence, " at record ", sequence, "): it would wait forever"));
  }
  TrustedRing* other = s.state.ring(static_cast<int>(wait.stream));
  tpu::RingControl* other_ctl =
      tpu::RingControlOf(s.shm.data(), s.layout, wait.stream);
  if (other->last_sequence.load(std::memory_order_acquire) >= wait.sequence ||
      other_ctl->dead.load() != 0) {
    *ready = true;
    return absl::OkStatus();
  }
  if (wait.sequence > other_ctl->submitted.load()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "event wait on ring ", wait.stream, " sequence ", wait.sequence,
        ", which that ring was never given (submitted ",
        other_ctl->submitted.load(),
        "); record the event before waiting on it"));
  }
  // Park: the ring's executor wakes us when it progresses. Look once more
  // after registering so progress in between is never missed.
  other->watchers.fetch_or(uint64_t{1} << config_.index,
                           std::memory_order_seq_cst);
  *ready =
      other->last_sequence.load(std::memory_order_seq_cst) >= wait.sequence;
  return absl::OkStatus();
}

// ---------------------------------------------------------------- poison

bool Executor::FindPoison(Session& s, int chip, uint64_t begin, uint64_t end,
                          std::string* cause) const {
  if (chip < 0 || chip >= static_cast<int>(s.layout.num_chips) || end <= begin)
    return false;
  const PoisonTable& t = s.state.chip(chip)->poison;
  const bool own = ChipSlot(chip) >= 0;
  for (int attempt = 0;; ++attempt) {
    const uint64_t v = t.version.load(std::memory_order_acquire);
    // Odd: its executor is writing (or died writing: then read it anyway).
    if (!own && (v & 1) != 0 && attempt < 100000) continue;
    const uint32_t n = std::min<uint32_t>(t.count, kMaxPoisoned);
    bool hit = false;
    uint64_t id = 0;
    for (uint32_t i = 0; i < n && !hit; ++i) {
      if (t.entries[i].begin < end && begin < t.entries[i].end) {
        hit = true;
        id = t.entries[i].cause;
      }
    }
    std::string text;
    if (hit) {
      const PoisonCause& c = t.causes[id % kPoisonCauses];
      text = c.id == id
                 ? std::string(c.text, strnlen(c.text, sizeof(c.text)))
                 : std::string(
                       "(an op that failed long ago; its message is no longer "
                       "kept)");
    }
    std::atomic_thread_fence(std::memory_order_acquire);
    if (own || attempt >= 100000 ||
        t.version.load(std::memory_order_relaxed) == v) {
      if (hit) *cause = std::move(text);
      return hit;
    }
  }
}

void Executor::AddPoison(Session& s, int chip, uint64_t begin, uint64_t end,
                         const std::string& cause) {
  if (end <= begin) return;
  ClearPoison(s, chip, begin, end);
  PoisonTable& t = s.state.chip(chip)->poison;
  t.version.fetch_add(1, std::memory_order_acq_rel);
  const uint64_t id = ++t.next_cause;
  PoisonCause& c = t.causes[id % kPoisonCauses];
  c.id = id;
  const size_t n = std::min<size_t>(cause.size(), sizeof(c.text) - 1);
  std::memcpy(c.text, cause.data(), n);
  c.text[n] = '\0';
  uint32_t i = t.count;
  if (i >= kMaxPoisoned) {
    // Full: the oldest entries make room (their memory then reads as data).
    i = t.next_victim++ % kMaxPoisoned;
  } else {
    ++t.count;
  }
  t.entries[i] = PoisonEntry{begin, end, id};
  t.version.fetch_add(1, std::memory_order_release);
}

void Executor::ClearPoison(Session& s, int chip, uint64_t begin, uint64_t end) {
  PoisonTable& t = s.state.chip(chip)->poison;
  if (t.count == 0) return;
  // Whatever overlaps a freshly written range is good again (memory that a
  // failed op poisoned is often reused by the client's allocator).
  t.version.fetch_add(1, std::memory_order_acq_rel);
  uint32_t i = 0;
  while (i < t.count) {
    if (t.entries[i].begin < end && begin < t.entries[i].end) {
      t.entries[i] = t.entries[--t.count];
    } else {
      ++i;
    }
  }
  t.version.fetch_add(1, std::memory_order_release);
}

namespace {
template <typename F>
void ForWritten(const tpu::DecodedOp& op, const BackendOp* backend_op, F&& f) {
  for (const tpu::TensorRef& t : op.outputs) f(t);
  if (backend_op == nullptr) return;
  for (size_t a = 0; a < op.num_args; ++a) {
    if (!backend_op->WritesArgument(a)) continue;
    const tpu::OpArg& arg = op.args[a];
    if (arg.tag == tpu::ArgTag::kTensor) f(arg.tensor);
    if (arg.tag == tpu::ArgTag::kTensorList) {
      for (const tpu::TensorRef& t : arg.tensors) f(t);
    }
  }
}
}  // namespace

void Executor::PoisonOutputs(Ring& ring, const BackendOp* op,
                             const std::string& cause) {
  ForWritten(op_, op, [&](const tpu::TensorRef& t) {
    absl::StatusOr<tpu::Footprint> fp = tpu::TensorFootprint(t);
    if (!fp.ok() || fp->end == fp->begin ||
        tpu::DeviceAddressChip(t.address) != ring.chip) {
      return;
    }
    AddPoison(*ring.session, ring.chip, t.address + fp->begin,
              t.address + fp->end, cause);
  });
}

void Executor::UnpoisonOutputs(Ring& ring, const BackendOp& op) {
  // A successful op rewrote its outputs: they are good again.
  ForWritten(op_, &op, [&](const tpu::TensorRef& t) {
    absl::StatusOr<tpu::Footprint> fp = tpu::TensorFootprint(t);
    if (!fp.ok() || fp->end == fp->begin) return;
    ClearPoison(*ring.session, ring.chip, t.address + fp->begin,
                t.address + fp->end);
  });
}

absl::Status Executor::CheckInputPoison(Ring& ring, const BackendOp& op) {
  Session& s = *ring.session;
  if (s.state.chip(ring.chip)->poison.count == 0) return absl::OkStatus();
  // What the op reads: its arguments, except those it only overwrites (out=
  // tensors, the target of a fill or a random fill): outputs often reuse
  // memory whose earlier contents failed, and writing them makes them good.
  auto check = [&](const tpu::TensorRef& t) -> bool {
    absl::StatusOr<tpu::Footprint> fp = tpu::TensorFootprint(t);
    if (!fp.ok() || fp->end == fp->begin) return false;
    std::string cause;
    if (!FindPoison(s, ring.chip, t.address + fp->begin, t.address + fp->end,
                    &cause)) {
      return false;
    }
    poison_root_ = cause;
    return true;
  };
  for (size_t a = 0; a < op_.num_args; ++a) {
    if (!op.OverwritesArgument(a) && AnyArgTensor(op_.args[a], check)) {
      return absl::FailedPreconditionError(
          absl::StrCat("an input was produced by an op that failed earlier: ",
                       poison_root_));
    }
  }
  return absl::OkStatus();
}

}  // namespace tpud
