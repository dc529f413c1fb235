#include "tests/daemon_harness.h"

#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <stdexcept>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"

extern char** environ;

namespace tpud_test {
namespace {

bool CanConnect(const std::string& path) {
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  std::strncpy(addr.sun_path, path.c_str(), sizeof(addr.sun_path) - 1);
  int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  bool ok = connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0;
  close(fd);
  return ok;
}

std::vector<char*> Argv(const std::string& binary,
                        const std::vector<std::string>& args,
                        std::vector<std::string>& storage) {
  storage.clear();
  storage.push_back(binary);
  storage.insert(storage.end(), args.begin(), args.end());
  std::vector<char*> argv;
  for (std::string& s : storage) argv.push_back(s.data());
  argv.push_back(nullptr);
  return argv;
}

std::vector<char*> Envp(const std::vector<std::string>& extra,
                        std::vector<std::string>& storage) {
  storage.clear();
  for (char** e = environ; *e != nullptr; ++e) storage.emplace_back(*e);
  storage.insert(storage.end(), extra.begin(), extra.end());
  std::vector<char*> envp;
  for (std::string& s : storage) envp.push_back(s.data());
  envp.push_back(nullptr);
  return envp;
}

}  // namespace

std::string BinaryPath(const std::string& rel) {
  const char* srcdir = std::getenv("TEST_SRCDIR");
  const char* workspace = std::getenv("TEST_WORKSPACE");
  if (srcdir != nullptr) {
    std::string p =
        absl::StrCat(srcdir, "/", workspace ? workspace : "tpud", "/", rel);
    if (access(p.c_str(), X_OK) == 0) return p;
  }
  std::string p = absl::StrCat("bazel-bin/", rel);
  if (access(p.c_str(), X_OK) == 0) return p;
  throw std::runtime_error("cannot find binary " + rel);
}

ChildProcess::ChildProcess(const std::string& binary,
                           const std::vector<std::string>& args,
                           const std::vector<std::string>& extra_env,
                           bool quiet) {
  std::vector<std::string> arg_storage, env_storage;
  std::vector<char*> argv = Argv(binary, args, arg_storage);
  std::vector<char*> envp = Envp(extra_env, env_storage);
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  if (quiet)
    posix_spawn_file_actions_addopen(&actions, 1, "/dev/null", O_WRONLY, 0);
  if (posix_spawn(&pid_, binary.c_str(), &actions, nullptr, argv.data(),
                  envp.data()) != 0) {
    pid_ = -1;
  }
  posix_spawn_file_actions_destroy(&actions);
  if (pid_ < 0) throw std::runtime_error("cannot spawn " + binary);
}

ChildProcess::ChildProcess(ChildProcess&& other) noexcept
    : pid_(other.pid_), status_(other.status_) {
  other.pid_ = -1;
}

ChildProcess& ChildProcess::operator=(ChildProcess&& other) noexcept {
  if (this != &other) {
    if (pid_ > 0 && Running()) {
      kill(pid_, SIGKILL);
      Wait();
    }
    pid_ = other.pid_;
    status_ = other.status_;
    other.pid_ = -1;
  }
  return *this;
}

ChildProcess::~ChildProcess() {
  if (pid_ > 0 && Running()) {
    kill(pid_, SIGKILL);
    Wait();
  }
}

bool ChildProcess::Running() {
  if (pid_ <= 0 || status_ >= 0) return false;
  int st = 0;
  pid_t r = waitpid(pid_, &st, WNOHANG);
  if (r == pid_) {
    status_ = WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
    return false;
  }
  return true;
}

int ChildProcess::Wait(absl::Duration timeout) {
  absl::Time deadline = absl::Now() + timeout;
  while (Running()) {
    if (absl::Now() > deadline) return -1;
    absl::SleepFor(absl::Milliseconds(2));
  }
  return status_;
}

void ChildProcess::Signal(int sig) {
  if (pid_ > 0) kill(pid_, sig);
}

CommandResult RunCommand(const std::string& binary,
                         const std::vector<std::string>& args,
                         const std::vector<std::string>& extra_env,
                         bool capture_stderr) {
  int pipefd[2];
  if (pipe2(pipefd, O_CLOEXEC) != 0) throw std::runtime_error("pipe");
  std::vector<std::string> arg_storage, env_storage;
  std::vector<char*> argv = Argv(binary, args, arg_storage);
  std::vector<char*> envp = Envp(extra_env, env_storage);
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_adddup2(&actions, pipefd[1], 1);
  if (capture_stderr) posix_spawn_file_actions_adddup2(&actions, pipefd[1], 2);
  pid_t pid = -1;
  int rc = posix_spawn(&pid, binary.c_str(), &actions, nullptr, argv.data(),
                       envp.data());
  posix_spawn_file_actions_destroy(&actions);
  close(pipefd[1]);
  CommandResult result;
  if (rc != 0) {
    close(pipefd[0]);
    throw std::runtime_error("cannot spawn " + binary);
  }
  char buf[4096];
  ssize_t n;
  while ((n = read(pipefd[0], buf, sizeof(buf))) > 0)
    result.output.append(buf, n);
  close(pipefd[0]);
  int st = 0;
  waitpid(pid, &st, 0);
  result.exit_code = WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
  return result;
}

TestDaemon::TestDaemon(std::vector<std::string> extra_flags,
                       const std::string& hbm) {
  char tmpl[] =
      "/tmp/tpud-test.XXXXXX";  // short: unix socket paths are limited
  if (mkdtemp(tmpl) == nullptr) throw std::runtime_error("mkdtemp");
  dir_ = tmpl;
  socket_ = dir_ + "/tpud.sock";
  admin_socket_ = dir_ + "/admin.sock";
  std::vector<std::string> flags = {"--socket=" + socket_,
                                    "--admin_socket=" + admin_socket_,
                                    "--hbm_bytes=" + hbm, "--log_level=warn"};
  flags.insert(flags.end(), extra_flags.begin(), extra_flags.end());
  process_ =
      ChildProcess(BinaryPath("daemon/tpud"), flags, {}, /*quiet=*/false);
  if (!WaitFor(
          [&] { return CanConnect(socket_) && CanConnect(admin_socket_); })) {
    throw std::runtime_error("tpud did not start serving on " + socket_);
  }
}

TestDaemon::~TestDaemon() {
  Stop();
  unlink(socket_.c_str());
  unlink(admin_socket_.c_str());
  rmdir(dir_.c_str());
}

int TestDaemon::Stop() {
  if (stopped_) return 0;
  stopped_ = true;
  process_.Signal(SIGTERM);
  int rc = process_.Wait(absl::Seconds(10));
  return rc;
}

bool TestDaemon::WaitFor(const std::function<bool()>& predicate,
                         absl::Duration timeout) {
  absl::Time deadline = absl::Now() + timeout;
  while (absl::Now() < deadline) {
    if (predicate()) return true;
    absl::SleepFor(absl::Milliseconds(5));
  }
  return predicate();
}

}  // namespace tpud_test
