// ConnectionTable: which accepted connection a gRPC call arrived on.
//
// tpud accepts every client connection itself, learns the peer's identity from
// the kernel (SO_PEERCRED) and only then hands the socket to gRPC. gRPC names
// such a connection "fd:<N>" in ServerContext::peer(); this table maps that
// name back to the connection and its identity.
//
// Thread-safety: thread-safe.
#ifndef TPUD_DAEMON_CORE_CONNECTION_TABLE_H_
#define TPUD_DAEMON_CORE_CONNECTION_TABLE_H_

#include <optional>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "daemon/core/runtime_core.h"

namespace tpud {

struct ConnectionInfo {
  ConnectionId id = 0;
  PeerIdentity peer;
  bool admin = false;  // arrived on the admin socket
  int watch_fd = -1;   // our duplicate of the socket, for hangup and kill
  // A data-plane connection (not gRPC), bound to this session.
  bool data_plane = false;
  uint64_t session_id = 0;
  // Non-empty: the connection is over a limit; every call on it fails with
  // RESOURCE_EXHAUSTED and this message, and tpud closes it shortly.
  std::string refused;
};

class ConnectionTable {
 public:
  // Registers a connection whose gRPC-side descriptor is `grpc_fd`. A stale
  // entry for a reused descriptor number is replaced.
  void Add(int grpc_fd, const ConnectionInfo& info) ABSL_LOCKS_EXCLUDED(mu_);
  // Forgets connection `id` (if its descriptor name still maps to it).
  void Remove(ConnectionId id) ABSL_LOCKS_EXCLUDED(mu_);
  // The connection behind a gRPC peer string, if it is one of ours.
  std::optional<ConnectionInfo> Lookup(absl::string_view grpc_peer) const
      ABSL_LOCKS_EXCLUDED(mu_);
  std::optional<ConnectionInfo> Get(ConnectionId id) const
      ABSL_LOCKS_EXCLUDED(mu_);
  size_t size() const ABSL_LOCKS_EXCLUDED(mu_);

  static std::string PeerName(int grpc_fd);

 private:
  mutable absl::Mutex mu_;
  absl::flat_hash_map<std::string, ConnectionInfo> by_peer_
      ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<ConnectionId, std::string> peer_by_id_
      ABSL_GUARDED_BY(mu_);
};

}  // namespace tpud

#endif  // TPUD_DAEMON_CORE_CONNECTION_TABLE_H_
