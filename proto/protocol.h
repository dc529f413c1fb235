// Facts both ends of the control plane agree on: protocol versions and the
// one-to-one mapping between absl::Status and grpc::Status.
#ifndef TPUD_PROTO_PROTOCOL_H_
#define TPUD_PROTO_PROTOCOL_H_

#include <grpcpp/support/status.h>

#include <cstdint>

#include "absl/status/status.h"

namespace tpud {

// Version 1: sessions, segments, topology, admin.
// Version 2: the data plane has one ring per stream and chip, served by
// executor processes (tpu/shm_layout.h, kDataPlaneVersion 2).
inline constexpr uint32_t kMinProtocolVersion = 2;
inline constexpr uint32_t kMaxProtocolVersion = 2;

inline constexpr char kDaemonVersion[] = "0.2.0";

// absl and gRPC status codes share numbering; messages pass unchanged.
grpc::Status ToGrpcStatus(const absl::Status& status);
absl::Status FromGrpcStatus(const grpc::Status& status);

}  // namespace tpud

#endif  // TPUD_PROTO_PROTOCOL_H_
