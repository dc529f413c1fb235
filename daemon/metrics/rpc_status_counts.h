// Counts the status of every control-plane RPC tpud answers (a gRPC server
// interceptor), for tpud_errors_total{source="rpc"}.
#ifndef TPUD_DAEMON_METRICS_RPC_STATUS_COUNTS_H_
#define TPUD_DAEMON_METRICS_RPC_STATUS_COUNTS_H_

#include <grpcpp/support/server_interceptor.h>

#include <array>
#include <atomic>
#include <cstdint>
#include <memory>

namespace tpud {

class RpcStatusCounts {
 public:
  static constexpr int kCodes =
      17;  // grpc::StatusCode 0..16 (the same numbers as absl's)
  void Add(int code) {
    if (code >= 0 && code < kCodes)
      by_code_[code].fetch_add(1, std::memory_order_relaxed);
  }
  std::array<uint64_t, kCodes> Snapshot() const {
    std::array<uint64_t, kCodes> out{};
    for (int c = 0; c < kCodes; ++c)
      out[c] = by_code_[c].load(std::memory_order_relaxed);
    return out;
  }

 private:
  std::array<std::atomic<uint64_t>, kCodes> by_code_{};
};

// For ServerBuilder::experimental().SetInterceptorCreators: counts the
// status each RPC ends with into `counts` (which must outlive the server).
std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface>
CountRpcStatuses(RpcStatusCounts* counts);

}  // namespace tpud

#endif  // TPUD_DAEMON_METRICS_RPC_STATUS_COUNTS_H_
