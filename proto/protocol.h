// Facts both ends of the control plane agree on: protocol versions and the
// one-to-one mapping between absl::Status and grpc::Status.
#ifndef TPUD_PROTO_PROTOCOL_H_
#define TPUD_PROTO_PROTOCOL_H_

#include <cstdint>

#include <grpcpp/support/status.h>

#include "absl/status/status.h"

namespace tpud {

// Version 1: sessions, segments, topology, admin.
inline constexpr uint32_t kMinProtocolVersion = 1;
inline constexpr uint32_t kMaxProtocolVersion = 1;

inline constexpr char kDaemonVersion[] = "0.1.0";

// absl and gRPC status codes share numbering; messages pass unchanged.
grpc::Status ToGrpcStatus(const absl::Status& status);
absl::Status FromGrpcStatus(const grpc::Status& status);

}  // namespace tpud

#endif  // TPUD_PROTO_PROTOCOL_H_
