// The common baseline of tpud's benchmarks: a plain gRPC unary ping over a
// unix socket, served by another process (as tpud is).
#ifndef TPUD_BENCH_PING_BASELINE_H_
#define TPUD_BENCH_PING_BASELINE_H_

#include <sys/types.h>

#include <memory>
#include <string>

namespace tpud_bench {

// Forks a process that serves the ping on `path`. Call before this process
// starts any thread (gRPC's, ATen's). Returns the child's pid, or -1.
pid_t ForkPingServer(const std::string& path);
void StopPingServer(pid_t pid);

class PingClient {
 public:
  explicit PingClient(const std::string& path);
  ~PingClient();
  // Average microseconds per ping over `n` calls.
  double MicrosPerCall(int n);

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace tpud_bench

#endif  // TPUD_BENCH_PING_BASELINE_H_
