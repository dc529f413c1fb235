// SocketServer: tpud's unix-socket front door.
//
// It owns the listening sockets (creating them with the right modes and
// refusing to steal a socket another live tpud serves), accepts every
// connection itself, learns the peer's pid/uid/gid from the kernel and its
// command line from /proc, and hands the connection to the gRPC server of that
// listener. A duplicate of each connection is watched so that a peer's exit,
// crash or `kill -9` is noticed at once and reported through `on_hangup`.
//
// Thread-safety: Start/Stop from one thread; Hangup from any thread.
#ifndef TPUD_DAEMON_SERVICE_SOCKET_SERVER_H_
#define TPUD_DAEMON_SERVICE_SOCKET_SERVER_H_

#include <sys/types.h>

#include <atomic>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "daemon/core/connection_table.h"
#include "tpu/shm_layout.h"

namespace grpc {
class Server;
}

namespace tpud {

struct ListenerSpec {
  std::string path;
  mode_t mode = 0660;
  gid_t group = static_cast<gid_t>(-1);  // -1: leave the group as created
  grpc::Server* server = nullptr;        // receives accepted connections
  // Admin listeners accept only root and the daemon's own user.
  bool admin = false;
};

// Reads /proc/<pid>/cmdline, arguments joined by spaces ("" if unreadable).
std::string ReadCommandLine(pid_t pid);

// Limits that keep hostile or broken local clients from wearing tpud down.
struct ConnectionLimits {
  // Connections one user may hold on the runtime socket. Beyond it a new
  // connection is answered with a refusal (RESOURCE_EXHAUSTED naming the
  // limit) and closed shortly; far beyond it, closed at once.
  int max_per_uid = 1024;
  // A connection must send its first bytes (and a data-plane hello all of
  // it) within this time, or it is closed.
  absl::Duration handshake_timeout = absl::Seconds(5);
  // How long a refused connection is kept so its client can read why.
  absl::Duration refusal_linger = absl::Seconds(2);
};

// What a data-plane attach hands the client: its shared memory and one
// doorbell per chip (the server sends them and closes its copies).
struct DataPlaneAttachment {
  int memfd = -1;
  uint64_t shm_bytes = 0;
  std::vector<int> doorbells;
};

class SocketServer {
 public:
  using HangupCallback = std::function<void(const ConnectionInfo&)>;
  // Serves a data-plane hello: what to send, or why not.
  using DataPlaneHandler = std::function<absl::StatusOr<DataPlaneAttachment>(
      uint64_t session_id, absl::string_view token, const PeerIdentity& peer,
      uint64_t pinned_bytes)>;

  // Connections on the runtime socket that open with a data-plane hello go
  // here instead of to gRPC. Set before Start().
  void SetDataPlaneHandler(DataPlaneHandler handler) {
    data_plane_ = std::move(handler);
  }

  // Creates and binds every listener. A path already served by a live process
  // is ALREADY_EXISTS; a stale socket file left by a crash is replaced.
  static absl::StatusOr<std::unique_ptr<SocketServer>> Create(
      std::vector<ListenerSpec> listeners, ConnectionTable* table,
      HangupCallback on_hangup, ConnectionLimits limits = {});
  ~SocketServer();

  // Starts accepting and watching (two threads).
  void Start();
  // Stops both threads, closes the listeners and removes their socket files.
  void Stop();

  // Hangs up a connection (e.g. its session was killed by an administrator);
  // the hangup then flows through `on_hangup` like any other.
  void Hangup(ConnectionId id);

 private:
  struct Pending {
    ConnectionInfo info;
    int fd;
    grpc::Server* server;
    absl::Time deadline;
  };
  SocketServer(std::vector<ListenerSpec> listeners, ConnectionTable* table,
               HangupCallback on_hangup, ConnectionLimits limits);
  void AcceptLoop();
  void WatchLoop();
  void AcceptOne(size_t listener_index);
  // A new connection is readable: gRPC, data plane, neither, or not yet
  // enough bytes (then it waits, until its deadline).
  void Classify(Pending pending);
  void Rearm(Pending pending);
  void ServeDataPlane(ConnectionInfo& info, int fd,
                      const tpu::DataPlaneHello& hello);
  void ReplyDataPlane(int fd, const absl::Status& status,
                      const DataPlaneAttachment* att);
  void Drop(const ConnectionInfo& info, int fd, const std::string& why);
  // Drops connections past their handshake deadline, closes refused ones
  // past their linger time.
  void ExpireLocked(absl::Time now) ABSL_EXCLUSIVE_LOCKS_REQUIRED(watched_mu_);
  void Forget(const ConnectionInfo& info)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(watched_mu_);

  std::vector<ListenerSpec> listeners_;
  std::vector<int> listen_fds_;
  ConnectionTable* table_;
  HangupCallback on_hangup_;
  const ConnectionLimits limits_;
  DataPlaneHandler data_plane_;
  // Accepted, not yet classified (waiting for the first bytes).
  absl::flat_hash_map<ConnectionId, Pending> pending_
      ABSL_GUARDED_BY(watched_mu_);
  // Runtime-socket connections per user (pending and watched).
  absl::flat_hash_map<uint32_t, int> per_uid_ ABSL_GUARDED_BY(watched_mu_);
  // Refused connections and when to close them.
  absl::flat_hash_map<ConnectionId, absl::Time> refused_until_
      ABSL_GUARDED_BY(watched_mu_);
  int wake_fd_ = -1;   // eventfd that stops both loops
  int epoll_fd_ = -1;  // watched connection duplicates
  std::atomic<bool> stopping_{false};
  std::atomic<uint64_t> next_connection_id_{1};
  // Every connection being watched, by id. Kept apart from the table because a
  // descriptor number (the table's key) can be reused before a hangup is seen.
  absl::Mutex watched_mu_;
  absl::flat_hash_map<ConnectionId, ConnectionInfo> watched_
      ABSL_GUARDED_BY(watched_mu_);
  std::thread accept_thread_;
  std::thread watch_thread_;
};

// Creates a listening unix socket at `path` (parent directories made 0755).
absl::StatusOr<int> ListenUnixSocket(const std::string& path, mode_t mode,
                                     gid_t group);

}  // namespace tpud

#endif  // TPUD_DAEMON_SERVICE_SOCKET_SERVER_H_
