#include "daemon/executor/executor_pool.h"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <spdlog/spdlog.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/prctl.h>
#include <sys/signalfd.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "daemon/executor/thread_share.h"
#include "tpu/shm_layout.h"

namespace tpud {
namespace {

// Zygote messages ride the control-channel format.
constexpr ControlType kSpawn =
    static_cast<ControlType>(200);  // a = executor; fd
constexpr ControlType kSpawned =
    static_cast<ControlType>(201);  // a = executor, b = pid
constexpr ControlType kExited =
    static_cast<ControlType>(202);  // a = pid, b = wait status

constexpr uint64_t kZygoteKey = 1000;
constexpr uint64_t kStopKey = 1001;

void SetNonBlocking(int fd) {
  fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) | O_NONBLOCK);
}

}  // namespace

std::string SignalDescription(int sig) {
  switch (sig) {
    case SIGSEGV:
      return "SIGSEGV (segmentation fault)";
    case SIGBUS:
      return "SIGBUS (bus error)";
    case SIGFPE:
      return "SIGFPE (arithmetic exception)";
    case SIGILL:
      return "SIGILL (illegal instruction)";
    case SIGABRT:
      return "SIGABRT (aborted, e.g. a failed internal check)";
    case SIGKILL:
      return "SIGKILL (killed)";
    case SIGTERM:
      return "SIGTERM (terminated)";
    default:
      return absl::StrCat("signal ", sig, " (", strsignal(sig), ")");
  }
}

ExecutorPool::ExecutorPool(ExecutorPoolOptions options, ExecutorShared* shared,
                           std::vector<int> wake_fds)
    : options_(std::move(options)),
      shared_(shared),
      wake_fds_(std::move(wake_fds)) {
  int num_chips = 0;
  for (const auto& chips : options_.chips_of) {
    for (int c : chips) num_chips = std::max(num_chips, c + 1);
  }
  executor_of_chip_.assign(num_chips, 0);
  for (size_t e = 0; e < options_.chips_of.size(); ++e) {
    for (int c : options_.chips_of[e])
      executor_of_chip_[c] = static_cast<int>(e);
  }
}

absl::StatusOr<std::unique_ptr<ExecutorPool>> ExecutorPool::Create(
    ExecutorPoolOptions options, ExecutorShared* shared,
    std::vector<int> wake_fds, ExecutorEntry entry) {
  if (options.chips_of.empty() || options.chips_of.size() > kMaxExecutors ||
      wake_fds.size() != options.chips_of.size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("an executor pool needs 1..", kMaxExecutors,
                     " executors, each with a wake-up eventfd"));
  }
  std::unique_ptr<ExecutorPool> pool(
      new ExecutorPool(std::move(options), shared, std::move(wake_fds)));
  int sv[2];
  if (socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, sv) != 0) {
    return absl::InternalError(
        absl::StrCat("socketpair: ", std::strerror(errno)));
  }
  const pid_t parent = getpid();
  const pid_t pid = fork();
  if (pid < 0) {
    return absl::ResourceExhaustedError(
        absl::StrCat("fork: ", std::strerror(errno)));
  }
  if (pid == 0) {
    close(sv[0]);
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (getppid() != parent) _exit(0);
    _exit(RunZygote(sv[1], entry));
  }
  close(sv[1]);
  SetNonBlocking(sv[0]);
  pool->zygote_fd_ = sv[0];
  pool->zygote_pid_ = pid;
  pool->workers_.resize(pool->options_.chips_of.size());
  return pool;
}

int ExecutorPool::RunZygote(int fd, const ExecutorEntry& entry) {
  prctl(PR_SET_NAME, "tpud-zygote");
  // Ctrl-C in a terminal reaches the whole process group: tpud stops us.
  signal(SIGINT, SIG_IGN);
  sigset_t chld;
  sigemptyset(&chld);
  sigaddset(&chld, SIGCHLD);
  sigprocmask(SIG_BLOCK, &chld, nullptr);
  const int sfd = signalfd(-1, &chld, SFD_CLOEXEC | SFD_NONBLOCK);
  const pid_t self = getpid();
  while (true) {
    pollfd fds[2] = {{fd, POLLIN, 0}, {sfd, POLLIN, 0}};
    if (poll(fds, 2, -1) < 0) {
      if (errno == EINTR) continue;
      return 1;
    }
    if (fds[1].revents & POLLIN) {
      signalfd_siginfo info;
      while (read(sfd, &info, sizeof(info)) == sizeof(info)) {
      }
      int status = 0;
      pid_t p;
      while ((p = waitpid(-1, &status, WNOHANG)) > 0) {
        ControlMessage m;
        m.type = kExited;
        m.a = static_cast<uint64_t>(p);
        m.b = static_cast<uint64_t>(status);
        SendControl(fd, m);
      }
    }
    if (fds[0].revents & (POLLIN | POLLHUP | POLLERR)) {
      ControlMessage m;
      std::vector<int> got;
      const int r = ReceiveControl(fd, &m, &got);
      if (r == 0) return 0;  // tpud is gone; executors follow (PDEATHSIG)
      if (r < 0 || m.type != kSpawn || got.size() != 1) {
        for (int f : got) close(f);
        continue;
      }
      const pid_t child = fork();
      if (child == 0) {
        close(fd);
        close(sfd);
        sigprocmask(SIG_UNBLOCK, &chld, nullptr);
        prctl(PR_SET_PDEATHSIG, SIGKILL);
        if (getppid() != self) _exit(0);
        _exit(entry(static_cast<int>(m.a), got[0]));
      }
      close(got[0]);
      ControlMessage reply;
      reply.type = kSpawned;
      reply.a = m.a;
      reply.b = child > 0 ? static_cast<uint64_t>(child) : 0;
      SendControl(fd, reply);
    }
  }
}

ExecutorPool::~ExecutorPool() { Stop(); }

void ExecutorPool::SetHandlers(AllocHandler alloc, FreeHandler free,
                               CrashHandler crash) {
  alloc_ = std::move(alloc);
  free_ = std::move(free);
  crash_ = std::move(crash);
}

int ExecutorPool::ExecutorOfChip(int chip) const {
  return chip >= 0 && chip < static_cast<int>(executor_of_chip_.size())
             ? executor_of_chip_[chip]
             : 0;
}

bool ExecutorPool::SpawnLocked(int e) {
  Worker& w = workers_[e];
  int cv[2];
  if (socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, cv) != 0)
    return false;
  ControlMessage m;
  m.type = kSpawn;
  m.a = static_cast<uint64_t>(e);
  const bool sent = SendControl(zygote_fd_, m, &cv[1], 1);
  close(cv[1]);
  if (!sent) {
    close(cv[0]);
    return false;
  }
  SetNonBlocking(cv[0]);
  w.control_fd = cv[0];
  w.ready = false;
  w.hung = false;
  w.pid = 0;
  w.start_pending = false;
  ++w.generation;
  ExecutorSlot& slot = shared_->slots[e];
  slot.pid.store(0);
  slot.state.store(ExecutorSlot::kStarting);
  epoll_event ev{};
  ev.events = EPOLLIN | EPOLLRDHUP;
  ev.data.u64 = static_cast<uint64_t>(e);
  epoll_ctl(epoll_fd_, EPOLL_CTL_ADD, w.control_fd, &ev);
  return true;
}

absl::Status ExecutorPool::Start(absl::Duration timeout) {
  epoll_fd_ = epoll_create1(EPOLL_CLOEXEC);
  stop_fd_ = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  epoll_event ev{};
  ev.events = EPOLLIN;
  ev.data.u64 = kZygoteKey;
  epoll_ctl(epoll_fd_, EPOLL_CTL_ADD, zygote_fd_, &ev);
  ev.data.u64 = kStopKey;
  epoll_ctl(epoll_fd_, EPOLL_CTL_ADD, stop_fd_, &ev);
  {
    absl::MutexLock lock(&mu_);
    for (int e = 0; e < num_executors(); ++e) {
      if (!SpawnLocked(e)) {
        return absl::InternalError("the executor zygote is not answering");
      }
    }
  }
  supervisor_ = std::thread([this] { Supervise(); });
  reaper_ = std::thread([this] {
    absl::MutexLock lock(&mu_);
    while (!stopping_.load()) {
      if (doomed_.empty()) {
        doomed_cv_.WaitWithTimeout(&mu_, absl::Milliseconds(200));
        continue;
      }
      auto [id, message] = doomed_.front();
      doomed_.erase(doomed_.begin());
      mu_.Unlock();
      if (crash_) crash_(id, message);
      mu_.Lock();
    }
  });
  const absl::Time deadline = absl::Now() + timeout;
  while (absl::Now() < deadline) {
    {
      absl::MutexLock lock(&mu_);
      bool all = true;
      for (const Worker& w : workers_) all = all && w.ready;
      if (all) return absl::OkStatus();
    }
    absl::SleepFor(absl::Milliseconds(5));
  }
  std::vector<int> missing;
  absl::MutexLock lock(&mu_);
  for (int e = 0; e < num_executors(); ++e) {
    if (!workers_[e].ready) missing.push_back(e);
  }
  return absl::DeadlineExceededError(absl::StrCat(
      "executor(s) ", absl::StrJoin(missing, ", "), " did not start within ",
      absl::FormatDuration(timeout), " (see the log above)"));
}

void ExecutorPool::Stop() {
  if (stopping_.exchange(true)) return;
  if (stop_fd_ >= 0) {
    const uint64_t one = 1;
    (void)!write(stop_fd_, &one, sizeof(one));
  }
  if (supervisor_.joinable()) supervisor_.join();
  doomed_cv_.SignalAll();
  if (reaper_.joinable()) reaper_.join();
  std::vector<int> pids;
  {
    absl::MutexLock lock(&mu_);
    for (Worker& w : workers_) {
      if (w.control_fd >= 0) {
        ControlMessage m;
        m.type = ControlType::kStop;
        SendControl(w.control_fd, m);
        close(w.control_fd);
        w.control_fd = -1;
      }
      if (w.pid > 0) pids.push_back(w.pid);
      w.pid = 0;
    }
    for (auto& [id, s] : sessions_) CloseSession(s);
    sessions_.clear();
  }
  // The zygote exits when its channel closes; its executors die with it.
  if (zygote_fd_ >= 0) close(zygote_fd_);
  zygote_fd_ = -1;
  for (int pid : pids) kill(pid, SIGKILL);
  if (zygote_pid_ > 0) {
    kill(zygote_pid_, SIGKILL);
    waitpid(zygote_pid_, nullptr, 0);
    zygote_pid_ = 0;
  }
  if (epoll_fd_ >= 0) close(epoll_fd_);
  if (stop_fd_ >= 0) close(stop_fd_);
  epoll_fd_ = stop_fd_ = -1;
}

void ExecutorPool::CloseSession(SessionFds& s) {
  if (s.shm_fd >= 0) close(s.shm_fd);
  if (s.state_fd >= 0) close(s.state_fd);
  for (int f : s.doorbells) {
    if (f >= 0) close(f);
  }
  s.shm_fd = s.state_fd = -1;
  s.doorbells.clear();
}

void ExecutorPool::AttachLocked(int e, uint64_t id, const SessionFds& s) {
  Worker& w = workers_[e];
  if (!w.ready || w.control_fd < 0) return;
  ControlMessage m;
  m.type = ControlType::kAttach;
  m.session_id = id;
  m.tag = s.tag;
  m.a = s.shm_bytes;
  m.b = s.state_bytes;
  const int fds[3] = {s.shm_fd, s.state_fd, s.doorbells[e]};
  SendControl(w.control_fd, m, fds, 3);
}

void ExecutorPool::Attach(uint64_t session_id, uint32_t tag, int shm_fd,
                          uint64_t shm_bytes, int state_fd,
                          uint64_t state_bytes, std::vector<int> doorbells) {
  absl::MutexLock lock(&mu_);
  SessionFds& s = sessions_[session_id];
  CloseSession(s);
  s.tag = tag;
  s.shm_fd = shm_fd;
  s.shm_bytes = shm_bytes;
  s.state_fd = state_fd;
  s.state_bytes = state_bytes;
  s.doorbells = std::move(doorbells);
  for (int e = 0; e < num_executors(); ++e) AttachLocked(e, session_id, s);
}

void ExecutorPool::Detach(uint64_t session_id) {
  absl::MutexLock lock(&mu_);
  auto it = sessions_.find(session_id);
  if (it == sessions_.end()) return;
  for (Worker& w : workers_) {
    if (!w.ready || w.control_fd < 0) continue;
    ControlMessage m;
    m.type = ControlType::kDetach;
    m.session_id = session_id;
    SendControl(w.control_fd, m);
  }
  CloseSession(it->second);
  sessions_.erase(it);
}

void ExecutorPool::Released(uint64_t address, uint64_t bytes) {
  absl::MutexLock lock(&mu_);
  for (Worker& w : workers_) {
    if (!w.ready || w.control_fd < 0) continue;
    ControlMessage m;
    m.type = ControlType::kReleased;
    m.a = address;
    m.b = bytes;
    if (SendControl(w.control_fd, m)) {
      shared_->slots[&w - workers_.data()].releases_sent.fetch_add(
          1, std::memory_order_seq_cst);
    }
  }
}

void ExecutorPool::Fence(uint32_t tag) {
  if (tag == 0) return;
  auto inside = [tag](const ExecutorSlot& slot) {
    if (slot.in_op_tag.load(std::memory_order_seq_cst) == tag) return true;
    for (const auto& t : slot.collective_tags) {
      if (t.load(std::memory_order_seq_cst) == tag) return true;
    }
    return false;
  };
  for (int e = 0; e < num_executors(); ++e) {
    ExecutorSlot& slot = shared_->slots[e];
    while (inside(slot)) {
      slot.fence_waiters.fetch_add(1, std::memory_order_seq_cst);
      const uint32_t epoch = slot.op_epoch.load();
      if (inside(slot)) {
        // Bounded: a dead executor's slot is reset by the supervisor.
        tpu::FutexWait(&slot.op_epoch, epoch, 10 * 1000 * 1000);
      }
      slot.fence_waiters.fetch_sub(1, std::memory_order_seq_cst);
    }
  }
}

void ExecutorPool::Supervise() {
  constexpr int kMaxEvents = 32;
  epoll_event events[kMaxEvents];
  while (!stopping_.load()) {
    const int n = epoll_wait(epoll_fd_, events, kMaxEvents, 100);
    for (int i = 0; i < n; ++i) {
      const uint64_t key = events[i].data.u64;
      if (key == kStopKey) return;
      if (key == kZygoteKey) {
        OnZygoteMessage();
        continue;
      }
      OnWorkerMessage(static_cast<int>(key));
    }
    CheckDeadlines();
    absl::MutexLock lock(&mu_);
    for (int e = 0; e < num_executors(); ++e) {
      Worker& w = workers_[e];
      if (w.start_pending && absl::Now() >= w.next_start && !stopping_.load()) {
        if (!SpawnLocked(e)) {
          w.next_start = absl::Now() + absl::Seconds(1);
        }
      }
    }
  }
}

void ExecutorPool::OnZygoteMessage() {
  while (!zygote_gone_) {
    ControlMessage m;
    std::vector<int> fds;
    const int r = ReceiveControl(zygote_fd_, &m, &fds);
    for (int f : fds) close(f);
    if (r == 0) {
      if (!stopping_.load())
        spdlog::critical("the executor zygote died; executors cannot restart");
      epoll_ctl(epoll_fd_, EPOLL_CTL_DEL, zygote_fd_, nullptr);
      zygote_gone_ = true;
      return;
    }
    if (r < 0) return;
    absl::MutexLock lock(&mu_);
    if (m.type == kSpawned && m.a < workers_.size()) {
      workers_[m.a].pid = static_cast<int>(m.b);
    } else if (m.type == kExited) {
      exit_status_[static_cast<int>(m.a)] = static_cast<int>(m.b);
      if (exit_status_.size() > 256) exit_status_.erase(exit_status_.begin());
    }
  }
}

void ExecutorPool::OnWorkerMessage(int e) {
  if (e < 0 || e >= num_executors()) return;
  while (true) {
    int fd;
    {
      absl::MutexLock lock(&mu_);
      fd = workers_[e].control_fd;
    }
    if (fd < 0) return;
    ControlMessage m;
    std::vector<int> fds;
    const int r = ReceiveControl(fd, &m, &fds);
    for (int f : fds) close(f);
    if (r < 0) return;
    if (r == 0) {
      // The executor is gone. Its exit status follows from the zygote at once.
      int pid;
      {
        absl::MutexLock lock(&mu_);
        pid = workers_[e].pid > 0 ? workers_[e].pid
                                  : shared_->slots[e].pid.load();
      }
      int status = -1;
      for (int waited = 0; waited < 50; ++waited) {
        OnZygoteMessage();
        {
          absl::MutexLock lock(&mu_);
          auto it = exit_status_.find(pid);
          if (pid > 0 && it != exit_status_.end()) {
            status = it->second;
            exit_status_.erase(it);
            break;
          }
        }
        pollfd p{zygote_fd_, POLLIN, 0};
        poll(&p, 1, 10);
      }
      OnWorkerDeath(e, status);
      return;
    }
    switch (m.type) {
      case ControlType::kReady: {
        absl::MutexLock lock(&mu_);
        Worker& w = workers_[e];
        w.ready = true;
        if (w.pid <= 0) w.pid = shared_->slots[e].pid.load();
        for (const auto& [id, s] : sessions_) {
          if (!s.doomed) AttachLocked(e, id, s);
        }
        if (w.restarts > 0) {
          spdlog::info("executor {} (chips {}) restarted as pid {}", e,
                       absl::StrJoin(options_.chips_of[e], ","), w.pid);
        }
        break;
      }
      case ControlType::kAllocRequest: {
        ControlMessage reply;
        reply.type = ControlType::kAllocReply;
        reply.request_id = m.request_id;
        absl::StatusOr<uint64_t> address =
            alloc_ ? alloc_(m.session_id, static_cast<int>(m.a), m.b)
                   : absl::UnavailableError("no allocator");
        if (address.ok()) {
          reply.a = *address;
          reply.b = m.b;
        } else {
          reply.code = static_cast<uint32_t>(address.status().code());
          const std::string text(address.status().message());
          SetControlText(&reply, text.data(), text.size());
        }
        SendControl(fd, reply);
        break;
      }
      case ControlType::kFreeResult:
        if (free_) free_(m.session_id, m.a);
        break;
      case ControlType::kSessionFailed:
        m.text[sizeof(m.text) - 1] = '\0';
        spdlog::warn("session {}: data plane failed: {}", m.session_id, m.text);
        break;
      default:
        break;
    }
  }
}

void ExecutorPool::OnWorkerDeath(int e, int wait_status) {
  ExecutorRestart rec;
  rec.when = absl::Now();
  rec.executor = e;
  rec.chips = options_.chips_of[e];
  std::string message;
  {
    absl::MutexLock lock(&mu_);
    Worker& w = workers_[e];
    if (w.control_fd < 0) return;
    epoll_ctl(epoll_fd_, EPOLL_CTL_DEL, w.control_fd, nullptr);
    close(w.control_fd);
    w.control_fd = -1;
    w.ready = false;
    ExecutorSlot& slot = shared_->slots[e];
    rec.pid = w.pid > 0 ? w.pid : slot.pid.load();
    const int sig = slot.crash_signal.load();
    if (w.hung) {
      rec.reason = absl::StrCat("ran past the op deadline of ",
                                absl::FormatDuration(options_.op_timeout),
                                " (--op_timeout)");
    } else if (sig != 0) {
      rec.reason = SignalDescription(sig);
    } else if (wait_status >= 0 && WIFSIGNALED(wait_status)) {
      rec.reason =
          absl::StrCat("killed by ", SignalDescription(WTERMSIG(wait_status)));
    } else if (wait_status >= 0 && WIFEXITED(wait_status)) {
      rec.reason =
          absl::StrCat("exited with status ", WEXITSTATUS(wait_status));
    } else {
      rec.reason = "exited";
    }
    if (slot.op_started_ns.load() != 0) {
      rec.session_id = slot.current_session.load();
      rec.ring = static_cast<int>(slot.current_ring.load());
      rec.sequence = slot.current_sequence.load();
      rec.op.assign(slot.current_op,
                    strnlen(slot.current_op, sizeof(slot.current_op)));
    }
    // The dead executor is inside no op any more.
    slot.op_started_ns.store(0);
    slot.in_op_tag.store(0, std::memory_order_seq_cst);
    for (auto& t : slot.collective_tags) t.store(0, std::memory_order_seq_cst);
    slot.crash_signal.store(0);
    slot.state.store(ExecutorSlot::kDead);
    slot.sleeping.store(0);
    slot.active_sessions.store(0);
    slot.last_work_ns.store(0);
    slot.intra_op_threads.store(0);
    slot.op_epoch.fetch_add(1);
    tpu::FutexWakeAll(&slot.op_epoch);
    w.busy_base_ns += slot.busy_ns.exchange(0);
    w.ops_base += slot.ops.exchange(0);
    w.unrung_base += slot.unrung_wakes.exchange(0);
    for (int i = 0; i < tpu::kMaxChipsPerHost; ++i) {
      for (int b = 0; b < kOpLatencyBuckets; ++b) {
        w.latency_base[i][b] += slot.op_latency[i][b].exchange(0);
      }
      w.latency_sum_base[i] += slot.op_latency_sum_ns[i].exchange(0);
      slot.queue_depth[i].store(0);
    }
    for (int c = 0; c < kStatusCodes; ++c)
      w.errors_base[c] += slot.op_errors[c].exchange(0);
    ++w.restarts;
    // Back off when an executor keeps dying (e.g. at start-up).
    int recent = 0;
    for (const ExecutorRestart& r : restarts_) {
      if (r.executor == e && rec.when - r.when < absl::Seconds(10)) ++recent;
    }
    w.next_start =
        rec.when + (recent < 3 ? absl::ZeroDuration()
                               : std::min(absl::Seconds(5),
                                          absl::Milliseconds(100) *
                                              (1 << std::min(recent, 6))));
    w.start_pending = true;
    if (rec.session_id != 0) {
      auto it = sessions_.find(rec.session_id);
      if (it != sessions_.end()) it->second.doomed = true;
      message = absl::StrFormat(
          "%s (stream %d on chip %d, record %d) %s; tpud ended session %d for "
          "it and "
          "restarted the chip's executor (every other session goes on). Avoid "
          "this call with "
          "these arguments on tpu.",
          rec.op.empty() ? "an op" : rec.op, tpu::RingStream(rec.ring),
          tpu::RingChip(rec.ring), rec.sequence,
          w.hung ? absl::StrCat(
                       "ran past the op deadline of ",
                       absl::FormatDuration(options_.op_timeout),
                       " (--op_timeout), so its executor process was killed")
                 : absl::StrCat("crashed its tpud executor process with ",
                                rec.reason),
          rec.session_id);
      doomed_.emplace_back(rec.session_id, message);
      doomed_cv_.Signal();
    }
    if (options_.device_memory) {
      // Every other session's tensors on these chips lived only in the dead
      // process's device buffers: reading them now would give the arena's
      // stale bytes. End them too, before the new executor attaches them.
      const std::string lost = absl::StrFormat(
          "tpud's executor for chips %s %s; it kept this session's tensors in "
          "device memory (PJRT, --pjrt_memory=device), so they are lost and "
          "tpud ended the session (new sessions are served)",
          absl::StrJoin(rec.chips, ","),
          rec.session_id != 0
              ? absl::StrCat("crashed in session ", rec.session_id, "'s op ",
                             rec.op.empty() ? "" : rec.op)
              : absl::StrCat("died (", rec.reason, ")"));
      for (auto& [id, s] : sessions_) {
        if (s.doomed || id == rec.session_id) continue;
        s.doomed = true;
        doomed_.emplace_back(id, lost);
      }
      doomed_cv_.Signal();
    }
    restarts_.push_back(rec);
    if (restarts_.size() > 1000) restarts_.erase(restarts_.begin());
  }
  if (stopping_.load()) return;
  if (rec.session_id != 0) {
    spdlog::error(
        "executor {} (pid {}) died: {} in {} of session {}; restarting it", e,
        rec.pid, rec.reason, rec.op, rec.session_id);
  } else {
    spdlog::error("executor {} (pid {}) died: {}; restarting it", e, rec.pid,
                  rec.reason);
  }
}

void ExecutorPool::CheckDeadlines() {
  if (options_.op_timeout <= absl::ZeroDuration()) return;
  const uint64_t limit =
      static_cast<uint64_t>(absl::ToInt64Nanoseconds(options_.op_timeout));
  const uint64_t now = tpu::MonotonicNanos();
  absl::MutexLock lock(&mu_);
  for (int e = 0; e < num_executors(); ++e) {
    Worker& w = workers_[e];
    if (!w.ready || w.hung || w.pid <= 0) continue;
    const uint64_t started = shared_->slots[e].op_started_ns.load();
    if (started != 0 && now > started && now - started > limit) {
      w.hung = true;
      spdlog::error(
          "executor {} (pid {}) has run {} for {:.1f} s, past --op_timeout; "
          "killing it",
          e, w.pid, std::string(shared_->slots[e].current_op),
          static_cast<double>(now - started) / 1e9);
      kill(w.pid, SIGKILL);
    }
  }
}

std::vector<ExecutorInfo> ExecutorPool::Executors() const {
  absl::MutexLock lock(&mu_);
  std::vector<ExecutorInfo> out;
  for (int e = 0; e < num_executors(); ++e) {
    const Worker& w = workers_[e];
    const ExecutorSlot& slot = shared_->slots[e];
    ExecutorInfo info;
    info.index = e;
    info.chips = options_.chips_of[e];
    info.pid = w.pid;
    info.ready = w.ready;
    info.restarts = w.restarts;
    info.busy_ns = w.busy_base_ns + slot.busy_ns.load();
    info.ops = w.ops_base + slot.ops.load();
    info.unrung_wakes = w.unrung_base + slot.unrung_wakes.load();
    info.duty_cycle = static_cast<double>(slot.duty_permille.load()) / 1000.0;
    info.intra_op_threads = w.ready ? slot.intra_op_threads.load() : 0;
    info.intra_op_threads_max = slot.intra_op_threads_max.load();
    info.busy = ExecutorBusy(slot, tpu::MonotonicNanos());
    for (size_t i = 0; i < info.chips.size() && i < tpu::kMaxChipsPerHost;
         ++i) {
      std::array<uint64_t, kOpLatencyBuckets> buckets;
      for (int b = 0; b < kOpLatencyBuckets; ++b) {
        buckets[b] = w.latency_base[i][b] + slot.op_latency[i][b].load();
      }
      info.op_latency.push_back(buckets);
      info.op_latency_sum_ns.push_back(w.latency_sum_base[i] +
                                       slot.op_latency_sum_ns[i].load());
      info.queue_depth.push_back(w.ready ? slot.queue_depth[i].load() : 0);
    }
    for (int c = 0; c < kStatusCodes; ++c) {
      info.op_errors[c] = w.errors_base[c] + slot.op_errors[c].load();
    }
    if (slot.compiles_ops.load() != 0) {
      info.programs_cached = slot.programs_cached.load();
      info.device_buffer_bytes = w.ready ? slot.device_buffer_bytes.load() : 0;
      if (slot.disk_cache_enabled.load() != 0) {
        info.disk_cache.enabled = true;
        info.disk_cache.entries = slot.disk_cache_entries.load();
        info.disk_cache.bytes = slot.disk_cache_bytes.load();
        info.disk_cache.max_bytes = slot.disk_cache_max_bytes.load();
        info.disk_cache.rejected = slot.disk_cache_rejected.load();
        info.disk_cache.write_errors = slot.disk_cache_write_errors.load();
      }
      for (size_t i = 0; i < info.chips.size() && i < tpu::kMaxChipsPerHost;
           ++i) {
        CompileStats c;
        c.compiles = slot.compiles[i].load();
        c.compile_ns = slot.compile_ns[i].load();
        c.hits = slot.program_hits[i].load();
        c.disk_hits = slot.disk_hits[i].load();
        c.disk_stores = slot.disk_stores[i].load();
        c.saved_ns = slot.saved_ns[i].load();
        c.collectives = slot.collective_programs[i].load();
        c.graphs = slot.graph_programs[i].load();
        info.compile.push_back(c);
      }
    }
    out.push_back(info);
  }
  return out;
}

std::vector<ExecutorRestart> ExecutorPool::Restarts() const {
  absl::MutexLock lock(&mu_);
  return restarts_;
}

}  // namespace tpud
