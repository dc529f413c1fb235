#include "daemon/executor/executor_main.h"

#include <fcntl.h>
#include <malloc.h>
#include <signal.h>
#include <spdlog/spdlog.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <unistd.h>

#include <cerrno>
#include <climits>
#include <cstdlib>
#include <cstring>
#include <string>

#include "absl/strings/str_cat.h"
#include "daemon/executor/executor.h"

namespace tpud {
namespace {

ExecutorSlot* g_crash_slot = nullptr;

void OnFatalSignal(int sig, siginfo_t* info, void*) {
  // Async-signal-safe: two stores, then die of the same signal.
  if (g_crash_slot != nullptr) {
    g_crash_slot->crash_address.store(
        reinterpret_cast<uint64_t>(info->si_addr));
    g_crash_slot->crash_signal.store(sig);
  }
  signal(sig, SIG_DFL);
  raise(sig);
}

void InstallCrashHandlers(ExecutorSlot* slot) {
  g_crash_slot = slot;
  // Its own stack, so a stack overflow is reported too.
  static char alt_stack[64 * 1024];
  stack_t ss{};
  ss.ss_sp = alt_stack;
  ss.ss_size = sizeof(alt_stack);
  sigaltstack(&ss, nullptr);
  struct sigaction sa {};
  sa.sa_sigaction = &OnFatalSignal;
  sa.sa_flags = SA_SIGINFO | SA_ONSTACK | SA_RESETHAND;
  sigemptyset(&sa.sa_mask);
  for (int sig : {SIGSEGV, SIGBUS, SIGFPE, SIGILL, SIGABRT})
    sigaction(sig, &sa, nullptr);
}

// A backend's runs allocate and free large temporaries, run after run:
// XLA's CPU programs take their scratch (up to hundreds of MB for a fused
// training step) and their results from malloc. glibc serves a block over
// 32 MiB with mmap and unmaps it on free, so every run faults in, and the
// kernel zeroes, all of it again (a fused Llama step: about 350,000 page
// faults, a third of the executor's time). Here freed memory stays in the
// heap for the next run: one arena (another thread's arena holds no block
// over 64 MiB, and would map it), no mmap, no trimming on free. The
// executor hands it back once it has been idle for --executor_heap_keep
// (Executor::Run). Set before the backend starts its threads (the zygote
// that forked us had one thread: its heap is the only arena).
void KeepFreedMemory() {
  mallopt(M_ARENA_MAX, 1);
  mallopt(M_MMAP_MAX, 0);
  mallopt(M_TRIM_THRESHOLD, INT_MAX);
}

}  // namespace

int RunExecutorProcess(const ExecutorProcessConfig& config, int index,
                       int control_fd) {
  ExecutorSlot* slot = &config.shared->slots[index];
  const std::string name = absl::StrCat("tpud-exec-", index);
  prctl(PR_SET_NAME, name.c_str());
  signal(SIGINT, SIG_IGN);
  signal(SIGPIPE, SIG_IGN);
  slot->crash_signal.store(0);
  InstallCrashHandlers(slot);
  // The executor only reads page owners: a wild write there is a crash, not
  // a breach of another session's memory.
  for (const auto& [memory, bytes] : config.owner_tables)
    mprotect(memory, bytes, PROT_READ);
  fcntl(control_fd, F_SETFL, fcntl(control_fd, F_GETFL) | O_NONBLOCK);
  spdlog::set_pattern(absl::StrCat(
      "%Y-%m-%d %H:%M:%S.%e %^%l%$ [tpud executor ", index, "] %v"));
  // Every client waits for its executor: on a host full of clients it must
  // not wait its turn behind them for a core.
  errno = 0;
  const int nice_now = getpriority(PRIO_PROCESS, 0);
  if (errno == 0 && nice_now != config.nice &&
      setpriority(PRIO_PROCESS, 0, config.nice) != 0 && index == 0) {
    spdlog::warn(
        "executors keep nice {}: setting {} failed ({}); give tpud "
        "CAP_SYS_NICE, or pass --executor_nice={}",
        nice_now, config.nice, std::strerror(errno), nice_now);
  }

  ExecutorConfig ec;
  ec.index = index;
  ec.chips = config.chips_of[index];
  ec.control_fd = control_fd;
  ec.shared = config.shared;
  ec.chip_bases = config.chip_bases;
  for (size_t c = 0; c < config.owner_tables.size(); ++c) {
    ec.owners.emplace_back(config.owner_tables[c].first,
                           config.chip_capacities[c]);
  }
  ec.wake_fds = config.wake_fds;
  ec.collectives = config.collectives;
  if (config.heap_keep_ns > 0) KeepFreedMemory();
  std::unique_ptr<ChipBackend> backend = config.make_backend();
  if (backend == nullptr)
    _exit(3);  // it said why; the pool restarts us, backing off
  ec.backend = backend.get();
  ec.spin_ns = config.spin_ns;
  ec.yield_ns = config.yield_ns;
  ec.unrung = config.unrung;
  ec.quantum_ns = config.quantum_ns;
  ec.heap_keep_ns = config.heap_keep_ns;
  ec.intra_op_threads = config.intra_op_threads;
  int rc;
  {
    Executor executor(std::move(ec));
    rc = executor.Run();
  }
  // Skip static destructors of torch and friends: nothing to flush.
  _exit(rc);
}

}  // namespace tpud
