// Starts a real tpud process on sockets in a fresh temporary folder and stops
// it at the end of the test. Also spawns helper processes (hello_tpud, tpuctl).
#ifndef TPUD_TESTS_DAEMON_HARNESS_H_
#define TPUD_TESTS_DAEMON_HARNESS_H_

#include <sys/types.h>

#include <functional>
#include <string>
#include <vector>

#include "absl/time/time.h"

namespace tpud_test {

// Path of a binary built in this workspace ("daemon/tpud"), found through the
// test's runfiles, or relative to bazel-bin when run by hand.
std::string BinaryPath(const std::string& workspace_relative);

// A child process; killed (SIGKILL) on destruction if still running.
class ChildProcess {
 public:
  ChildProcess() = default;
  ChildProcess(const std::string& binary, const std::vector<std::string>& args,
               const std::vector<std::string>& extra_env = {},
               bool quiet = true);
  ChildProcess(ChildProcess&& other) noexcept;
  ChildProcess& operator=(ChildProcess&& other) noexcept;
  ~ChildProcess();

  pid_t pid() const { return pid_; }
  // Waits for exit; returns the exit code, or 128+signal. -1 on timeout.
  int Wait(absl::Duration timeout = absl::Seconds(30));
  void Signal(int sig);
  bool Running();

 private:
  pid_t pid_ = -1;
  int status_ = -1;
};

// Runs a command to completion, capturing stdout (and stderr when asked).
struct CommandResult {
  int exit_code = -1;
  std::string output;
};
CommandResult RunCommand(const std::string& binary,
                         const std::vector<std::string>& args,
                         const std::vector<std::string>& extra_env = {},
                         bool capture_stderr = false);

class TestDaemon {
 public:
  // Starts tpud with small HBM (tests run small) and waits until it serves.
  explicit TestDaemon(std::vector<std::string> extra_flags = {},
                      const std::string& hbm = "256MiB");
  ~TestDaemon();

  const std::string& dir() const { return dir_; }
  const std::string& socket() const { return socket_; }
  const std::string& admin_socket() const { return admin_socket_; }
  pid_t pid() const { return process_.pid(); }
  // Sends SIGTERM and returns the exit code.
  int Stop();

  // Waits until `predicate` holds, polling. Returns false on timeout.
  static bool WaitFor(const std::function<bool()>& predicate,
                      absl::Duration timeout = absl::Seconds(10));

 private:
  std::string dir_;
  std::string socket_;
  std::string admin_socket_;
  ChildProcess process_;
  bool stopped_ = false;
};

}  // namespace tpud_test

#endif  // TPUD_TESTS_DAEMON_HARNESS_H_
