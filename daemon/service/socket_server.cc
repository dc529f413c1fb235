#include "daemon/service/socket_server.h"

#include <errno.h>
#include <fcntl.h>
#include <grpcpp/server.h>
#include <grpcpp/server_posix.h>
#include <poll.h>
#include <spdlog/spdlog.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <fstream>
#include <iterator>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "absl/strings/strip.h"
#include "absl/time/clock.h"
#include "proto/protocol.h"
#include "tpu/shm_layout.h"

namespace tpud {
namespace {

std::string ErrnoText(int err) { return std::strerror(err); }

absl::Status MakeParentDirs(const std::string& path) {
  for (size_t pos = path.find('/', 1); pos != std::string::npos;
       pos = path.find('/', pos + 1)) {
    std::string dir = path.substr(0, pos);
    if (mkdir(dir.c_str(), 0755) != 0 && errno != EEXIST) {
      return absl::PermissionDeniedError(absl::StrCat(
          "cannot create directory ", dir, ": ", ErrnoText(errno)));
    }
  }
  return absl::OkStatus();
}

bool FillAddress(const std::string& path, sockaddr_un* addr) {
  std::memset(addr, 0, sizeof(*addr));
  addr->sun_family = AF_UNIX;
  if (path.size() >= sizeof(addr->sun_path)) return false;
  std::memcpy(addr->sun_path, path.c_str(), path.size());
  return true;
}

}  // namespace

std::string ReadCommandLine(pid_t pid) {
  std::ifstream in(absl::StrCat("/proc/", pid, "/cmdline"), std::ios::binary);
  std::string raw((std::istreambuf_iterator<char>(in)),
                  std::istreambuf_iterator<char>());
  if (raw.size() > 4096) raw.resize(4096);
  std::replace(raw.begin(), raw.end(), '\0', ' ');
  return std::string(absl::StripTrailingAsciiWhitespace(raw));
}

absl::StatusOr<int> ListenUnixSocket(const std::string& path, mode_t mode,
                                     gid_t group) {
  sockaddr_un addr;
  if (!FillAddress(path, &addr)) {
    return absl::InvalidArgumentError(
        absl::StrCat("socket path too long (", path.size(), " bytes, limit ",
                     sizeof(addr.sun_path) - 1, "): ", path));
  }
  if (absl::Status st = MakeParentDirs(path); !st.ok()) return st;
  struct stat st;
  if (lstat(path.c_str(), &st) == 0) {
    if (!S_ISSOCK(st.st_mode)) {
      return absl::FailedPreconditionError(absl::StrCat(
          path,
          " exists and is not a socket; remove it or choose another path"));
    }
    // A live tpud answers; a stale file from a crash refuses and is replaced.
    int probe = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    bool alive =
        probe >= 0 &&
        connect(probe, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0;
    if (probe >= 0) close(probe);
    if (alive) {
      return absl::AlreadyExistsError(absl::StrCat(
          "another tpud is already serving on ", path,
          "; stop it first (or choose another --socket/--admin_socket)"));
    }
    unlink(path.c_str());
  }
  int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0)
    return absl::InternalError(absl::StrCat("socket(): ", ErrnoText(errno)));
  if (bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    int err = errno;
    close(fd);
    return absl::PermissionDeniedError(
        absl::StrCat("cannot bind ", path, ": ", ErrnoText(err)));
  }
  // Set the mode before listen() so no one can connect through a wider mode.
  if (chmod(path.c_str(), mode) != 0 || (group != static_cast<gid_t>(-1) &&
                                         chown(path.c_str(), -1, group) != 0)) {
    int err = errno;
    close(fd);
    unlink(path.c_str());
    return absl::PermissionDeniedError(
        absl::StrCat("cannot set mode/group of ", path, ": ", ErrnoText(err)));
  }
  if (listen(fd, 128) != 0) {
    int err = errno;
    close(fd);
    unlink(path.c_str());
    return absl::InternalError(
        absl::StrCat("listen on ", path, ": ", ErrnoText(err)));
  }
  return fd;
}

absl::StatusOr<std::unique_ptr<SocketServer>> SocketServer::Create(
    std::vector<ListenerSpec> listeners, ConnectionTable* table,
    HangupCallback on_hangup, ConnectionLimits limits) {
  std::unique_ptr<SocketServer> server(new SocketServer(
      std::move(listeners), table, std::move(on_hangup), limits));
  for (const ListenerSpec& spec : server->listeners_) {
    absl::StatusOr<int> fd = ListenUnixSocket(spec.path, spec.mode, spec.group);
    if (!fd.ok()) {
      server->Stop();
      return fd.status();
    }
    server->listen_fds_.push_back(*fd);
  }
  server->wake_fd_ = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  server->epoll_fd_ = epoll_create1(EPOLL_CLOEXEC);
  if (server->wake_fd_ < 0 || server->epoll_fd_ < 0) {
    server->Stop();
    return absl::InternalError(
        absl::StrCat("eventfd/epoll: ", ErrnoText(errno)));
  }
  epoll_event ev{};
  ev.events = EPOLLIN;
  ev.data.u64 = 0;  // connection ids start at 1
  epoll_ctl(server->epoll_fd_, EPOLL_CTL_ADD, server->wake_fd_, &ev);
  return server;
}

SocketServer::SocketServer(std::vector<ListenerSpec> listeners,
                           ConnectionTable* table, HangupCallback on_hangup,
                           ConnectionLimits limits)
    : listeners_(std::move(listeners)),
      table_(table),
      on_hangup_(std::move(on_hangup)),
      limits_(limits) {}

SocketServer::~SocketServer() { Stop(); }

void SocketServer::Start() {
  accept_thread_ = std::thread([this] { AcceptLoop(); });
  watch_thread_ = std::thread([this] { WatchLoop(); });
}

void SocketServer::Stop() {
  if (stopping_.exchange(true)) return;
  if (wake_fd_ >= 0) {
    uint64_t one = 1;
    (void)!write(wake_fd_, &one, sizeof(one));
  }
  if (accept_thread_.joinable()) accept_thread_.join();
  if (watch_thread_.joinable()) watch_thread_.join();
  for (size_t i = 0; i < listen_fds_.size(); ++i) {
    close(listen_fds_[i]);
    unlink(listeners_[i].path.c_str());
  }
  listen_fds_.clear();
  {
    absl::MutexLock lock(&watched_mu_);
    for (auto& [id, info] : watched_) close(info.watch_fd);
    watched_.clear();
    for (auto& [id, p] : pending_) {
      close(p.info.watch_fd);
      close(p.fd);
    }
    pending_.clear();
  }
  if (epoll_fd_ >= 0) close(epoll_fd_);
  if (wake_fd_ >= 0) close(wake_fd_);
  epoll_fd_ = wake_fd_ = -1;
}

void SocketServer::Hangup(ConnectionId id) {
  absl::MutexLock lock(&watched_mu_);
  auto it = watched_.find(id);
  // shutdown() acts on the socket both descriptors share: gRPC sees EOF, the
  // peer sees its connection close, and the watcher reports the hangup.
  if (it != watched_.end()) shutdown(it->second.watch_fd, SHUT_RDWR);
}

void SocketServer::AcceptLoop() {
  std::vector<pollfd> fds;
  for (int fd : listen_fds_) fds.push_back({fd, POLLIN, 0});
  fds.push_back({wake_fd_, POLLIN, 0});
  while (!stopping_.load()) {
    int n = poll(fds.data(), fds.size(), -1);
    if (n < 0) {
      if (errno == EINTR) continue;
      spdlog::error("poll on listening sockets failed: {}", ErrnoText(errno));
      return;
    }
    if (fds.back().revents != 0) return;
    for (size_t i = 0; i + 1 < fds.size(); ++i) {
      if (fds[i].revents & POLLIN) AcceptOne(i);
    }
  }
}

void SocketServer::AcceptOne(size_t index) {
  const ListenerSpec& spec = listeners_[index];
  int fd = accept4(listen_fds_[index], nullptr, nullptr,
                   SOCK_NONBLOCK | SOCK_CLOEXEC);
  if (fd < 0) {
    if (errno != EAGAIN && errno != EINTR) {
      spdlog::warn("accept on {} failed: {}", spec.path, ErrnoText(errno));
      // Out of descriptors: back off instead of spinning on a ready listener.
      if (errno == EMFILE || errno == ENFILE) usleep(10000);
    }
    return;
  }
  ucred cred{};
  socklen_t len = sizeof(cred);
  if (getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cred, &len) != 0) {
    spdlog::warn("SO_PEERCRED on {} failed: {}; dropping connection", spec.path,
                 ErrnoText(errno));
    close(fd);
    return;
  }
  if (spec.admin && cred.uid != 0 && cred.uid != geteuid()) {
    spdlog::warn("refused admin connection from uid {} (pid {})", cred.uid,
                 cred.pid);
    close(fd);
    return;
  }
  ConnectionInfo info;
  if (!spec.admin) {
    // A few connections past the limit are kept long enough to say why;
    // beyond those, a flood is simply closed.
    constexpr int kRefusalSlack = 16;
    absl::MutexLock lock(&watched_mu_);
    const int held = per_uid_.contains(cred.uid) ? per_uid_[cred.uid] : 0;
    if (held >= limits_.max_per_uid + kRefusalSlack) {
      close(fd);
      return;
    }
    if (held >= limits_.max_per_uid) {
      info.refused = absl::StrCat(
          "tpud refused this connection: uid ", cred.uid, " already has ", held,
          " connections to tpud, the most one user may hold "
          "(--max_connections_per_uid=",
          limits_.max_per_uid,
          "); close idle connections or processes and retry");
      spdlog::warn(
          "uid {} (pid {}) is over the connection limit ({} held, limit {})",
          cred.uid, cred.pid, held, limits_.max_per_uid);
    }
    ++per_uid_[cred.uid];
  }
  int watch_fd = fcntl(fd, F_DUPFD_CLOEXEC, 0);
  if (watch_fd < 0) {
    spdlog::warn("dup of connection failed: {}", ErrnoText(errno));
    close(fd);
    absl::MutexLock lock(&watched_mu_);
    if (!spec.admin && --per_uid_[cred.uid] <= 0) per_uid_.erase(cred.uid);
    return;
  }
  info.id = next_connection_id_.fetch_add(1);
  info.peer.pid = cred.pid;
  info.peer.uid = cred.uid;
  info.peer.gid = cred.gid;
  info.peer.command = ReadCommandLine(cred.pid);
  info.admin = spec.admin;
  info.watch_fd = watch_fd;
  {
    absl::MutexLock lock(&watched_mu_);
    const absl::Time now = absl::Now();
    pending_[info.id] =
        Pending{info, fd, spec.server, now + limits_.handshake_timeout};
    if (!info.refused.empty())
      refused_until_[info.id] = now + limits_.refusal_linger;
  }
  // First readiness tells what the client speaks (see Classify).
  epoll_event ev{};
  ev.events = EPOLLIN | EPOLLRDHUP | EPOLLHUP | EPOLLERR | EPOLLONESHOT;
  ev.data.u64 = info.id;
  if (epoll_ctl(epoll_fd_, EPOLL_CTL_ADD, watch_fd, &ev) != 0) {
    spdlog::warn("cannot watch connection: {}", ErrnoText(errno));
    absl::MutexLock lock(&watched_mu_);
    pending_.erase(info.id);
    Forget(info);
    close(watch_fd);
    close(fd);
    return;
  }
  spdlog::debug("connection {} on {} from pid {} uid {}: {}", info.id,
                spec.path, cred.pid, cred.uid, info.peer.command);
}

void SocketServer::Forget(const ConnectionInfo& info) {
  refused_until_.erase(info.id);
  if (info.admin) return;
  auto it = per_uid_.find(info.peer.uid);
  if (it != per_uid_.end() && --it->second <= 0) per_uid_.erase(it);
}

void SocketServer::Drop(const ConnectionInfo& info, int fd,
                        const std::string& why) {
  // A connect-and-close (a liveness probe) is routine; anything else is not.
  spdlog::log(why == "closed before speaking" ? spdlog::level::debug
                                              : spdlog::level::warn,
              "dropped connection from pid {} uid {}: {}", info.peer.pid,
              info.peer.uid, why);
  epoll_ctl(epoll_fd_, EPOLL_CTL_DEL, info.watch_fd, nullptr);
  close(info.watch_fd);
  close(fd);
  absl::MutexLock lock(&watched_mu_);
  Forget(info);
}

void SocketServer::Rearm(Pending pending) {
  const int watch_fd = pending.info.watch_fd;
  const ConnectionId id = pending.info.id;
  {
    absl::MutexLock lock(&watched_mu_);
    pending_[id] = std::move(pending);
  }
  epoll_event ev{};
  ev.events = EPOLLIN | EPOLLRDHUP | EPOLLHUP | EPOLLERR | EPOLLONESHOT;
  ev.data.u64 = id;
  epoll_ctl(epoll_fd_, EPOLL_CTL_MOD, watch_fd, &ev);
}

void SocketServer::Classify(Pending pending) {
  static constexpr char kHttp2Preface[] = "PRI * HTTP/2.0";
  ConnectionInfo& info = pending.info;
  const int fd = pending.fd;
  tpu::DataPlaneHello hello;
  static_assert(sizeof(hello) >= 8, "a hello starts with its 8-byte magic");
  const ssize_t n = recv(fd, &hello, sizeof(hello), MSG_PEEK | MSG_DONTWAIT);
  if (n == 0) {
    Drop(info, fd, "closed before speaking");
    return;
  }
  if (n < 0) {
    if (errno == EAGAIN || errno == EINTR) {
      Rearm(std::move(pending));
    } else {
      Drop(info, fd, absl::StrCat("read failed: ", ErrnoText(errno)));
    }
    return;
  }
  if (n < 8) {
    Rearm(std::move(pending));  // a slow writer: its deadline still runs
    return;
  }
  // From here on only the connection's hangup is watched.
  auto watch_for_hangup = [&] {
    {
      absl::MutexLock lock(&watched_mu_);
      watched_[info.id] = info;
    }
    epoll_event ev{};
    ev.events = EPOLLRDHUP | EPOLLHUP | EPOLLERR;
    ev.data.u64 = info.id;
    epoll_ctl(epoll_fd_, EPOLL_CTL_MOD, info.watch_fd, &ev);
  };
  if (std::memcmp(hello.magic, kHttp2Preface, 8) == 0) {
    // Registered before gRPC sees the connection, so its first call finds it.
    table_->Add(fd, info);
    watch_for_hangup();
    grpc::AddInsecureChannelFromFd(pending.server, fd);
    return;
  }
  const int version = tpu::DataPlaneVersionOf(hello.magic);
  if (version >= 0 && !info.admin && data_plane_) {
    if (version != static_cast<int>(tpu::kDataPlaneVersion)) {
      ReplyDataPlane(
          fd,
          absl::FailedPreconditionError(absl::StrCat(
              "this client speaks tpud data-plane protocol ", version,
              " and tpud ", kDaemonVersion, " speaks ", tpu::kDataPlaneVersion,
              ": install the torch_tpu / libtpuclient built with this tpud, or "
              "run "
              "the tpud they were built for")),
          nullptr);
      Drop(info, fd,
           absl::StrCat("data-plane protocol ", version, ", expected ",
                        tpu::kDataPlaneVersion));
      return;
    }
    if (!info.refused.empty()) {
      ReplyDataPlane(fd, absl::ResourceExhaustedError(info.refused), nullptr);
      Drop(info, fd, "over the connection limit");
      return;
    }
    if (n < static_cast<ssize_t>(sizeof(hello))) {
      Rearm(std::move(pending));  // the rest of the hello is on its way
      return;
    }
    if (recv(fd, &hello, sizeof(hello), MSG_DONTWAIT) !=
        static_cast<ssize_t>(sizeof(hello))) {
      Drop(info, fd, "truncated data-plane hello");
      return;
    }
    ServeDataPlane(info, fd, hello);
    if (info.data_plane) watch_for_hangup();  // else refused and dropped
    return;
  }
  Drop(info, fd, "not a tpud protocol (neither gRPC nor a data-plane hello)");
}

void SocketServer::ReplyDataPlane(int fd, const absl::Status& status,
                                  const DataPlaneAttachment* att) {
  tpu::DataPlaneReply reply{};
  reply.code = static_cast<uint32_t>(status.code());
  reply.daemon_version = tpu::kDataPlaneVersion;
  std::string msg(status.message());
  msg.resize(std::min(msg.size(), sizeof(reply.message) - 1));
  std::memcpy(reply.message, msg.c_str(), msg.size() + 1);
  iovec iov{&reply, sizeof(reply)};
  msghdr mh{};
  mh.msg_iov = &iov;
  mh.msg_iovlen = 1;
  std::vector<int> fds;
  constexpr size_t kMaxFds = 1 + tpu::kMaxChipsPerHost;
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int) * kMaxFds)] = {};
  if (att != nullptr) {
    reply.shm_bytes = att->shm_bytes;
    fds.push_back(att->memfd);
    fds.insert(fds.end(), att->doorbells.begin(), att->doorbells.end());
    fds.resize(std::min(fds.size(), kMaxFds));
    mh.msg_control = control;
    mh.msg_controllen = CMSG_SPACE(sizeof(int) * fds.size());
    cmsghdr* cm = CMSG_FIRSTHDR(&mh);
    cm->cmsg_level = SOL_SOCKET;
    cm->cmsg_type = SCM_RIGHTS;
    cm->cmsg_len = CMSG_LEN(sizeof(int) * fds.size());
    std::memcpy(CMSG_DATA(cm), fds.data(), sizeof(int) * fds.size());
  }
  (void)sendmsg(fd, &mh, MSG_NOSIGNAL | MSG_DONTWAIT);
  // Let the client read the reply before a close.
  if (att == nullptr) shutdown(fd, SHUT_WR);
}

void SocketServer::ServeDataPlane(ConnectionInfo& info, int fd,
                                  const tpu::DataPlaneHello& hello) {
  absl::StatusOr<DataPlaneAttachment> att =
      data_plane_(hello.session_id,
                  absl::string_view(reinterpret_cast<const char*>(hello.token),
                                    sizeof(hello.token)),
                  info.peer, hello.pinned_bytes);
  if (!att.ok()) {
    spdlog::warn("data-plane attach refused for pid {}: {}", info.peer.pid,
                 std::string(att.status().message()));
    ReplyDataPlane(fd, att.status(), nullptr);
    Drop(info, fd, "data-plane attach refused");
    return;
  }
  ReplyDataPlane(fd, absl::OkStatus(), &*att);
  close(att->memfd);
  for (int d : att->doorbells) close(d);
  // Attached: from now on this connection's hangup ends the session.
  info.data_plane = true;
  info.session_id = hello.session_id;
  close(fd);  // the watch duplicate keeps the connection
}

void SocketServer::ExpireLocked(absl::Time now) {
  for (auto it = refused_until_.begin(); it != refused_until_.end();) {
    auto w = watched_.find(it->first);
    if (now >= it->second && w != watched_.end()) {
      shutdown(w->second.watch_fd,
               SHUT_RDWR);  // the hangup then flows as usual
      refused_until_.erase(it++);
    } else {
      ++it;
    }
  }
}

void SocketServer::WatchLoop() {
  constexpr int kMaxEvents = 64;
  epoll_event events[kMaxEvents];
  while (!stopping_.load()) {
    // Wakes at least every 100 ms to enforce the handshake deadline.
    int n = epoll_wait(epoll_fd_, events, kMaxEvents, 100);
    if (n < 0) {
      if (errno == EINTR) continue;
      spdlog::error("epoll_wait failed: {}", ErrnoText(errno));
      return;
    }
    for (int i = 0; i < n; ++i) {
      ConnectionId id = events[i].data.u64;
      if (id == 0) return;  // wake_fd_: stopping
      std::optional<Pending> pending;
      {
        absl::MutexLock lock(&watched_mu_);
        auto it = pending_.find(id);
        if (it != pending_.end()) {
          pending = it->second;
          pending_.erase(it);
        }
      }
      if (pending.has_value()) {
        Classify(*std::move(pending));
        continue;
      }
      ConnectionInfo info;
      {
        absl::MutexLock lock(&watched_mu_);
        auto it = watched_.find(id);
        if (it == watched_.end()) continue;
        info = it->second;
        watched_.erase(it);
        Forget(info);
      }
      epoll_ctl(epoll_fd_, EPOLL_CTL_DEL, info.watch_fd, nullptr);
      table_->Remove(id);
      on_hangup_(info);
      close(info.watch_fd);
    }
    std::vector<Pending> late;
    {
      absl::MutexLock lock(&watched_mu_);
      const absl::Time now = absl::Now();
      for (auto it = pending_.begin(); it != pending_.end();) {
        const bool refused_done = refused_until_.contains(it->first) &&
                                  now >= refused_until_[it->first];
        if (now >= it->second.deadline || refused_done) {
          late.push_back(it->second);
          pending_.erase(it++);
        } else {
          ++it;
        }
      }
      ExpireLocked(now);
    }
    for (Pending& p : late) {
      Drop(p.info, p.fd,
           absl::StrCat("sent no complete greeting within ",
                        absl::FormatDuration(limits_.handshake_timeout),
                        " (--handshake_timeout)"));
    }
  }
}

}  // namespace tpud
