#include "daemon/executor/thread_share.h"

#include <fcntl.h>
#include <sched.h>
#include <unistd.h>

#include <algorithm>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"

namespace tpud {
namespace {

std::string ReadSmallFile(const std::string& path) {
  const int fd = open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return "";
  char buf[4096];
  const ssize_t n = read(fd, buf, sizeof(buf));
  close(fd);
  return n > 0 ? std::string(buf, static_cast<size_t>(n)) : "";
}

int64_t ReadNumber(const std::string& path) {
  int64_t v = 0;
  return absl::SimpleAtoi(absl::StripAsciiWhitespace(ReadSmallFile(path)), &v)
             ? v
             : 0;
}

// The smallest CPU quota on the way from the process's cgroups to their
// roots (a limit anywhere above applies too); 0: none.
int CgroupQuotaCores() {
  int best = 0;
  const auto take = [&best](int q) {
    if (q > 0 && (best == 0 || q < best)) best = q;
  };
  // Lines "hierarchy:controllers:path"; cgroup v2's is "0::path".
  for (absl::string_view line :
       absl::StrSplit(ReadSmallFile("/proc/self/cgroup"), '\n')) {
    std::vector<absl::string_view> f =
        absl::StrSplit(line, absl::MaxSplits(':', 2));
    if (f.size() != 3) continue;
    const bool v2 = f[0] == "0" && f[1].empty();
    bool v1_cpu = false;
    for (absl::string_view c : absl::StrSplit(f[1], ','))
      v1_cpu = v1_cpu || c == "cpu";
    if (!v2 && !v1_cpu) continue;
    const std::string root =
        v2 ? "/sys/fs/cgroup" : absl::StrCat("/sys/fs/cgroup/", f[1]);
    std::string path(f[2]);
    while (true) {
      const std::string dir = path == "/" ? root : root + path;
      if (v2) {
        take(CpuMaxCores(ReadSmallFile(dir + "/cpu.max")));
      } else {
        take(CfsQuotaCores(ReadNumber(dir + "/cpu.cfs_quota_us"),
                           ReadNumber(dir + "/cpu.cfs_period_us")));
      }
      if (path.empty() || path == "/") break;
      path.resize(path.rfind('/'));
    }
  }
  return best;
}

}  // namespace

int IntraOpThreadsFor(int fixed, int cores, int busy, int position) {
  if (fixed > 0) return fixed;
  cores = std::max(cores, 1);
  busy = std::max(busy, 1);
  position = std::clamp(position, 0, busy - 1);
  return std::max(1, cores / busy + (position < cores % busy ? 1 : 0));
}

bool ExecutorBusy(const ExecutorSlot& slot, uint64_t now) {
  if (slot.state.load(std::memory_order_relaxed) != ExecutorSlot::kReady)
    return false;
  if (slot.op_started_ns.load(std::memory_order_relaxed) != 0) return true;
  const uint64_t last = slot.last_work_ns.load(std::memory_order_relaxed);
  return last != 0 && (last >= now || now - last < kBusyWindowNs);
}

int CpuMaxCores(absl::string_view cpu_max) {
  std::vector<absl::string_view> f = absl::StrSplit(
      absl::StripAsciiWhitespace(cpu_max), ' ', absl::SkipEmpty());
  int64_t quota = 0;
  int64_t period = 100000;  // cpu.max may give the quota alone
  if (f.empty() || !absl::SimpleAtoi(f[0], &quota)) return 0;  // "max" too
  if (f.size() > 1 && !absl::SimpleAtoi(f[1], &period)) return 0;
  return CfsQuotaCores(quota, period);
}

int CfsQuotaCores(int64_t quota_us, int64_t period_us) {
  if (quota_us <= 0 || period_us <= 0) return 0;
  return static_cast<int>((quota_us + period_us - 1) / period_us);
}

HostCores AvailableCores() {
  HostCores h;
  cpu_set_t set;
  h.affinity = sched_getaffinity(0, sizeof(set), &set) == 0
                   ? CPU_COUNT(&set)
                   : static_cast<int>(sysconf(_SC_NPROCESSORS_ONLN));
  h.affinity = std::max(h.affinity, 1);
  h.quota = CgroupQuotaCores();
  h.cores = h.quota > 0 ? std::min(h.affinity, h.quota) : h.affinity;
  return h;
}

std::string DescribeThreadPolicy(int fixed, const HostCores& cores) {
  if (fixed > 0) {
    return absl::StrCat(fixed, " per executor (--intra_op_threads=", fixed,
                        ")");
  }
  return absl::StrCat(
      "automatic: ", cores.cores, " cores (CPU affinity ", cores.affinity,
      cores.quota > 0 ? absl::StrCat(", cgroup quota ", cores.quota)
                      : std::string(", no cgroup quota"),
      ") shared among busy chips, cores / busy chips each, at least 1");
}

ThreadShare::ThreadShare(ExecutorShared* shared, int index, int fixed,
                         ChipBackend* backend)
    : shared_(shared),
      slot_(&shared->slots[index]),
      index_(index),
      fixed_(fixed),
      backend_(backend) {
  applied_ = backend_->intra_op_threads();
  if (applied_ > 0) {
    // Automatic never gives an op more than the backend would by itself
    // (ATen: OMP_NUM_THREADS, else the physical cores), nor more than the
    // cores tpud may use.
    ceiling_ = fixed_ > 0 ? fixed_ : applied_;
    if (fixed_ <= 0 && shared_->num_cpus > 0)
      ceiling_ = std::min(ceiling_, static_cast<int>(shared_->num_cpus));
  }
  wanted_ = applied_;
  slot_->last_work_ns.store(0, std::memory_order_relaxed);
  slot_->intra_op_threads.store(applied_, std::memory_order_relaxed);
  slot_->intra_op_threads_max.store(ceiling_, std::memory_order_relaxed);
}

int ThreadShare::Wanted(uint64_t now) const {
  if (ceiling_ == 0 || fixed_ > 0) return ceiling_;
  int busy = 1;  // this one: it works now, or will when it wakes
  int position = 0;
  const int n = std::min<int>(shared_->num_executors, kMaxExecutors);
  for (int e = 0; e < n; ++e) {
    if (e == index_ || !ExecutorBusy(shared_->slots[e], now)) continue;
    ++busy;
    if (e < index_) ++position;
  }
  const int cores =
      shared_->num_cpus > 0 ? static_cast<int>(shared_->num_cpus) : ceiling_;
  return std::min(ceiling_, IntraOpThreadsFor(0, cores, busy, position));
}

void ThreadShare::Apply(uint64_t now) {
  const int want = Wanted(now);
  if (want <= 0 || want == wanted_) return;
  wanted_ = want;
  backend_->set_intra_op_threads(want);
  applied_ = backend_->intra_op_threads();
  slot_->intra_op_threads.store(applied_, std::memory_order_relaxed);
}

}  // namespace tpud
