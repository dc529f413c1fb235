#include "daemon/backends/pjrt/pjrt_probe.h"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/file.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"

namespace tpud::pjrt {
namespace {

// One field per line; text fields have their newlines replaced.
std::string Line(std::string s) {
  for (char& c : s) {
    if (c == '\n' || c == '\t') c = ' ';
  }
  return s + "\n";
}

void WriteAll(int fd, const std::string& s) {
  size_t done = 0;
  while (done < s.size()) {
    const ssize_t n = write(fd, s.data() + done, s.size() - done);
    if (n <= 0 && errno != EINTR) return;
    if (n > 0) done += static_cast<size_t>(n);
  }
}

[[noreturn]] void Child(int fd, const std::string& path,
                        const std::vector<CreateOption>& options) {
  absl::StatusOr<std::unique_ptr<PjrtPlugin>> p =
      PjrtPlugin::Load(path, options);
  if (!p.ok()) {
    WriteAll(
        fd, absl::StrCat("error\t", static_cast<int>(p.status().code()), "\n") +
                Line(std::string(p.status().message())));
    _exit(0);
  }
  const PjrtPlugin& plugin = **p;
  std::string out =
      Line("ok") + Line(plugin.Describe()) +
      Line(absl::StrCat(plugin.api_major(), " ", plugin.api_minor())) +
      Line(plugin.platform_name()) + Line(absl::StrCat(plugin.num_devices()));
  for (const DeviceInfo& d : plugin.devices()) {
    std::string coords;
    for (int64_t c : d.coords)
      absl::StrAppend(&coords, coords.empty() ? "" : ",", c);
    out += absl::StrCat(d.id, "\t", d.bytes_limit, "\t", coords, "\t",
                        Line(d.kind));
  }
  WriteAll(fd, out);
  // Whatever the plugin holds (libtpu's lockfile) goes with the process;
  // static destructors of a half-known library are not run.
  p->reset();
  _exit(0);
}

// libtpu's lock on the host's TPUs: a file it creates and flock()s.
constexpr char kLibtpuLockfile[] = "/tmp/libtpu_lockfile";

// Removes libtpu's lockfile after a failed probe, when the probe made it
// (it was not there before) and nobody holds its lock now; an unlocked
// file left behind reads as a TPU in use to tools that only look for it.
void RemoveLockfileLeftBehind(bool existed_before) {
  if (existed_before) return;
  const int fd = open(kLibtpuLockfile, O_RDONLY | O_CLOEXEC);
  if (fd < 0) return;
  if (flock(fd, LOCK_EX | LOCK_NB) == 0) unlink(kLibtpuLockfile);
  close(fd);
}

absl::StatusOr<ProbeResult> ProbeOnce(const std::string& path,
                                      const std::vector<CreateOption>& options,
                                      absl::Duration timeout);

}  // namespace

absl::StatusOr<ProbeResult> ProbePlugin(
    const std::string& path, const std::vector<CreateOption>& options,
    absl::Duration timeout) {
  const bool lockfile_existed = access(kLibtpuLockfile, F_OK) == 0;
  absl::StatusOr<ProbeResult> r = ProbeOnce(path, options, timeout);
  if (!r.ok()) RemoveLockfileLeftBehind(lockfile_existed);
  return r;
}

namespace {

absl::StatusOr<ProbeResult> ProbeOnce(const std::string& path,
                                      const std::vector<CreateOption>& options,
                                      absl::Duration timeout) {
  int fds[2];
  if (pipe(fds) != 0)
    return absl::InternalError(absl::StrCat("pipe: ", std::strerror(errno)));
  const pid_t pid = fork();
  if (pid < 0) {
    close(fds[0]);
    close(fds[1]);
    return absl::ResourceExhaustedError(
        absl::StrCat("fork: ", std::strerror(errno)));
  }
  if (pid == 0) {
    close(fds[0]);
    Child(fds[1], path, options);
  }
  close(fds[1]);
  std::string text;
  const absl::Time deadline = absl::Now() + timeout;
  bool eof = false;
  while (!eof) {
    const int64_t left = absl::ToInt64Milliseconds(deadline - absl::Now());
    if (left <= 0) break;
    pollfd p{fds[0], POLLIN, 0};
    const int r = poll(&p, 1, static_cast<int>(std::min<int64_t>(left, 1000)));
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) continue;
    char buf[4096];
    const ssize_t n = read(fds[0], buf, sizeof(buf));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      eof = true;
    } else {
      text.append(buf, static_cast<size_t>(n));
    }
  }
  close(fds[0]);
  if (!eof) {
    kill(pid, SIGKILL);
    waitpid(pid, nullptr, 0);
    return absl::DeadlineExceededError(
        absl::StrCat("PJRT plugin ", path, " did not come up within ",
                     absl::FormatDuration(timeout),
                     " (libtpu on a machine without a TPU waits for the "
                     "metadata server unless "
                     "TPU_SKIP_MDS_QUERY=1)"));
  }
  int status = 0;
  waitpid(pid, &status, 0);
  std::vector<std::string> lines = absl::StrSplit(text, '\n');
  if (lines.empty() || lines[0].empty()) {
    const std::string how =
        WIFSIGNALED(status)
            ? absl::StrCat("was killed by signal ", WTERMSIG(status))
            : absl::StrCat("exited with ", WEXITSTATUS(status));
    return absl::FailedPreconditionError(
        absl::StrCat("PJRT plugin ", path, ": loading it ", how,
                     " before it said anything"));
  }
  if (absl::StartsWith(lines[0], "error\t")) {
    int code = static_cast<int>(absl::StatusCode::kUnknown);
    (void)absl::SimpleAtoi(lines[0].substr(6), &code);
    return absl::Status(static_cast<absl::StatusCode>(code),
                        lines.size() > 1 ? lines[1] : "");
  }
  ProbeResult r;
  size_t count = 0;
  std::vector<std::string> version;
  if (lines.size() < 5 || lines[0] != "ok" ||
      (version = absl::StrSplit(lines[2], ' ')).size() != 2 ||
      !absl::SimpleAtoi(version[0], &r.api_major) ||
      !absl::SimpleAtoi(version[1], &r.api_minor) ||
      !absl::SimpleAtoi(lines[4], &count) || lines.size() < 5 + count) {
    return absl::InternalError(
        absl::StrCat("PJRT probe of ", path, ": garbled report"));
  }
  r.description = lines[1];
  r.platform = lines[3];
  for (size_t i = 0; i < count; ++i) {
    std::vector<std::string> f =
        absl::StrSplit(lines[5 + i], absl::MaxSplits('\t', 3));
    if (f.size() != 4)
      return absl::InternalError("PJRT probe: garbled device line");
    DeviceInfo d;
    (void)absl::SimpleAtoi(f[0], &d.id);
    (void)absl::SimpleAtoi(f[1], &d.bytes_limit);
    for (absl::string_view c : absl::StrSplit(f[2], ',', absl::SkipEmpty())) {
      int64_t v = 0;
      if (absl::SimpleAtoi(c, &v)) d.coords.push_back(v);
    }
    d.kind = f[3];
    r.devices.push_back(std::move(d));
  }
  return r;
}

}  // namespace
}  // namespace tpud::pjrt
