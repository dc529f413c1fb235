#include "daemon/dataplane/data_plane.h"

#include <fcntl.h>
#include <sched.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <new>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "tpu/units.h"

namespace tpud {
namespace {

constexpr uint64_t kPage = 4096;

uint64_t RoundUpPage(uint64_t n) { return (n + kPage - 1) & ~(kPage - 1); }

int CpuCount() {
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof(set), &set) == 0)
    return std::max(1, CPU_COUNT(&set));
  return std::max(1L, sysconf(_SC_NPROCESSORS_ONLN));
}

// Runnable threads on the host right now (the 4th field of /proc/loadavg,
// "running/total"); -1 if unreadable.
int RunnableThreads(int fd) {
  char buf[128];
  const ssize_t n = pread(fd, buf, sizeof(buf) - 1, 0);
  if (n <= 0) return -1;
  buf[n] = '\0';
  const char* p = buf;
  for (int field = 0; field < 3 && p != nullptr; ++field) {
    p = std::strchr(p, ' ');
    if (p != nullptr) ++p;
  }
  return p == nullptr ? -1 : std::atoi(p);
}

}  // namespace

DataPlane::DataPlane(RuntimeCore* core, ExecutorPool* pool,
                     ExecutorShared* shared, DataPlaneOptions options)
    : core_(core), pool_(pool), shared_(shared), options_(options) {}

DataPlane::~DataPlane() { StopAll(); }

void DataPlane::Start() {
  advisor_ = std::thread([this] { AdviseLoop(); });
}

absl::StatusOr<DataPlaneGrant> DataPlane::Attach(uint64_t session_id,
                                                 absl::string_view token,
                                                 const PeerIdentity& peer,
                                                 uint64_t pinned_bytes) {
  if (pinned_bytes == 0) pinned_bytes = options_.default_pinned_bytes;
  if (pinned_bytes > options_.max_pinned_bytes) {
    return absl::ResourceExhaustedError(
        absl::StrCat("pinned pool of ", tpu::FormatBytes(pinned_bytes),
                     " asked; this daemon allows at most ",
                     tpu::FormatBytes(options_.max_pinned_bytes),
                     " per session (--max_pinned_pool_bytes)"));
  }
  absl::StatusOr<uint32_t> tag =
      core_->AttachDataPlane(session_id, token, peer);
  if (!tag.ok()) return tag.status();

  const int num_chips = core_->topology().num_chips();
  const int num_rings = num_chips * tpu::kStreamsPerChip;
  auto plane = std::make_unique<SessionPlane>();
  tpu::ShmHeader& h = plane->layout;
  h.magic = tpu::kShmMagic;
  h.layout_version = tpu::kDataPlaneVersion;
  h.num_chips = static_cast<uint32_t>(num_chips);
  h.streams_per_chip = tpu::kStreamsPerChip;
  h.num_rings = static_cast<uint32_t>(num_rings);
  h.hints_offset = 1024;
  h.rings_control_offset = kPage;
  h.events_offset = h.rings_control_offset +
                    RoundUpPage(sizeof(tpu::RingControl) * num_rings);
  h.rings_offset =
      h.events_offset + RoundUpPage(sizeof(tpu::EventSlot) * tpu::kMaxEvents);
  h.ring_bytes = options_.ring_bytes;
  h.staging_offset = h.rings_offset + h.ring_bytes * num_rings;
  h.staging_bytes = RoundUpPage(options_.staging_bytes / tpu::kStreamsPerChip) *
                    tpu::kStreamsPerChip;
  h.pinned_offset = h.staging_offset + h.staging_bytes;
  h.pinned_bytes = RoundUpPage(pinned_bytes);
  h.total_bytes = h.pinned_offset + h.pinned_bytes;

  // Sealed: the client cannot shrink the file under the executors (their
  // accesses would fault) nor grow it.
  absl::StatusOr<SharedMapping> shm = SharedMapping::Create(
      absl::StrCat("tpud-session-", session_id), h.total_bytes, true);
  if (!shm.ok()) return shm.status();
  plane->shm = *std::move(shm);
  char* base = plane->shm.data();
  std::memcpy(base, &h, sizeof(h));
  new (tpu::HintsOf(base, h)) tpu::DaemonHints();
  tpu::HintsOf(base, h)->wait_advice.store(wait_advice_.load());
  for (int r = 0; r < num_rings; ++r) {
    tpu::RingControl* ctl =
        new (tpu::RingControlOf(base, h, r)) tpu::RingControl();
    ctl->consumer_sleeping.store(
        1);  // until an executor polls it: ring the doorbell
    ctl->wake_at.store(~uint64_t{0});  // nobody waits yet
  }
  for (int e = 0; e < tpu::kMaxEvents; ++e)
    new (tpu::EventOf(base, h, e)) tpu::EventSlot();

  const uint64_t state_bytes = SessionStateView::BytesFor(num_chips);
  absl::StatusOr<SharedMapping> state = SharedMapping::Create(
      absl::StrCat("tpud-state-", session_id), state_bytes, false);
  if (!state.ok()) return state.status();
  plane->state = *std::move(state);
  SessionStateView::Initialize(plane->state.data(), session_id, *tag,
                               num_chips);

  std::vector<int> doorbells;
  auto close_all = [&] {
    for (int f : doorbells) close(f);
  };
  for (int e = 0; e < pool_->num_executors(); ++e) {
    const int fd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
    if (fd < 0) {
      close_all();
      return absl::ResourceExhaustedError(absl::StrCat(
          "eventfd for session ", session_id, ": ", std::strerror(errno)));
    }
    doorbells.push_back(fd);
  }
  DataPlaneGrant grant;
  grant.shm_bytes = h.total_bytes;
  grant.memfd = fcntl(plane->shm.fd(), F_DUPFD_CLOEXEC, 0);
  for (int c = 0; c < num_chips; ++c) {
    grant.doorbells.push_back(
        fcntl(doorbells[pool_->ExecutorOfChip(c)], F_DUPFD_CLOEXEC, 0));
  }
  const int pool_shm = fcntl(plane->shm.fd(), F_DUPFD_CLOEXEC, 0);
  const int pool_state = fcntl(plane->state.fd(), F_DUPFD_CLOEXEC, 0);
  bool dup_failed = grant.memfd < 0 || pool_shm < 0 || pool_state < 0;
  for (int f : grant.doorbells) dup_failed = dup_failed || f < 0;
  if (dup_failed) {
    for (int f : {grant.memfd, pool_shm, pool_state}) {
      if (f >= 0) close(f);
    }
    for (int f : grant.doorbells) {
      if (f >= 0) close(f);
    }
    close_all();
    return absl::ResourceExhaustedError(
        absl::StrCat("out of descriptors attaching session ", session_id));
  }
  plane->shm.CloseFd();
  plane->state.CloseFd();
  {
    absl::MutexLock lock(&mu_);
    sessions_[session_id] = std::move(plane);
  }
  pool_->Attach(session_id, *tag, pool_shm, h.total_bytes, pool_state,
                state_bytes, std::move(doorbells));
  return grant;
}

void DataPlane::FailRings(SessionPlane& plane, const absl::Status& status) {
  SessionStateView(plane.state.data())
      .header()
      ->dead.store(1, std::memory_order_seq_cst);
  for (uint32_t r = 0; r < plane.layout.num_rings; ++r) {
    KillRing(
        tpu::RingControlOf(plane.shm.data(), plane.layout, static_cast<int>(r)),
        status);
  }
}

void DataPlane::Detach(uint64_t session_id) {
  std::unique_ptr<SessionPlane> plane;
  {
    absl::MutexLock lock(&mu_);
    auto it = sessions_.find(session_id);
    if (it == sessions_.end()) return;
    plane = std::move(it->second);
    sessions_.erase(it);
  }
  // Clients still waiting on a ring learn that it is over.
  FailRings(*plane, absl::UnavailableError(
                        absl::StrCat("session ", session_id,
                                     " ended (closed, killed, or its "
                                     "connection dropped); its queued work was "
                                     "discarded")));
  pool_->Detach(session_id);
}

void DataPlane::FailSession(uint64_t session_id, const absl::Status& status) {
  absl::MutexLock lock(&mu_);
  auto it = sessions_.find(session_id);
  if (it != sessions_.end()) FailRings(*it->second, status);
}

SessionActivity DataPlane::Activity(uint64_t session_id) {
  absl::MutexLock lock(&mu_);
  auto it = sessions_.find(session_id);
  if (it == sessions_.end()) return {};
  SessionStateView view(it->second->state.data());
  SessionActivity a;
  for (uint32_t c = 0; c < it->second->layout.num_chips; ++c) {
    a.busy_ns +=
        view.chip(static_cast<int>(c))->busy_ns.load(std::memory_order_relaxed);
    a.ops +=
        view.chip(static_cast<int>(c))->ops.load(std::memory_order_relaxed);
    for (const ProgramStat& p : view.chip(static_cast<int>(c))->programs) {
      const uint32_t id = p.id.load(std::memory_order_acquire);
      if (id == 0) continue;
      ProgramActivity pa;
      pa.id = id;
      pa.chip = static_cast<int>(c);
      pa.name.assign(p.name, strnlen(p.name, sizeof(p.name)));
      pa.records = p.records;
      pa.calls = p.calls.load(std::memory_order_relaxed);
      pa.busy_ns = p.busy_ns.load(std::memory_order_relaxed);
      pa.compiles = p.compiles.load(std::memory_order_relaxed);
      pa.last_compile = CompileWhy(p);
      a.programs.push_back(std::move(pa));
    }
  }
  return a;
}

ChipUsage DataPlane::ChipActivity(int chip) {
  const int e = pool_->ExecutorOfChip(chip);
  for (const ExecutorInfo& info : pool_->Executors()) {
    if (info.index == e)
      return ChipUsage{info.busy_ns, info.ops, info.duty_cycle};
  }
  return {};
}

void DataPlane::PublishWaitAdvice(uint32_t advice) {
  wait_advice_.store(advice);
  shared_->wait_advice.store(advice);
  absl::MutexLock lock(&mu_);
  for (auto& [id, plane] : sessions_) {
    tpu::HintsOf(plane->shm.data(), plane->layout)->wait_advice.store(advice);
  }
}

void DataPlane::AdviseLoop() {
  const int loadavg = open("/proc/loadavg", O_RDONLY | O_CLOEXEC);
  WaitAdvisor advisor(CpuCount());
  const int n = pool_->num_executors();
  while (!stopping_.load()) {
    int awake = 0;
    int parties = 0;
    for (int e = 0; e < n; ++e) {
      const ExecutorSlot& slot = shared_->slots[e];
      if (slot.state.load() != ExecutorSlot::kReady) continue;
      if (slot.sleeping.load() == 0) ++awake;
      parties += static_cast<int>(
          slot.active_sessions.load(std::memory_order_relaxed));
    }
    if (awake == 0) {
      // The host is idle for tpud: sleep until an executor wakes up.
      const uint32_t v = shared_->sampler_futex.load();
      shared_->sampler_sleeping.store(1);
      bool idle = true;
      for (int e = 0; e < n && idle; ++e) {
        idle = shared_->slots[e].state.load() != ExecutorSlot::kReady ||
               shared_->slots[e].sleeping.load() != 0;
      }
      if (idle && !stopping_.load())
        tpu::FutexWait(&shared_->sampler_futex, v, 100 * 1000 * 1000);
      shared_->sampler_sleeping.store(0);
      advisor.Restart();
      continue;
    }
    parties += awake;
    const int runnable = loadavg >= 0 ? RunnableThreads(loadavg) - 1 : -1;
    const uint32_t advice =
        advisor.Update(parties, runnable < 0 ? parties : runnable);
    if (advice != wait_advice_.load()) PublishWaitAdvice(advice);
    absl::SleepFor(absl::Milliseconds(1));
  }
  if (loadavg >= 0) close(loadavg);
}

void DataPlane::StopAll() {
  if (stopping_.exchange(true)) return;
  shared_->sampler_futex.fetch_add(1);
  tpu::FutexWakeAll(&shared_->sampler_futex);
  if (advisor_.joinable()) advisor_.join();
  std::map<uint64_t, std::unique_ptr<SessionPlane>> sessions;
  {
    absl::MutexLock lock(&mu_);
    sessions.swap(sessions_);
  }
  for (auto& [id, plane] : sessions) {
    FailRings(*plane, absl::UnavailableError("tpud is shutting down"));
  }
}

}  // namespace tpud
