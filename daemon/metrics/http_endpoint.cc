#include "daemon/metrics/http_endpoint.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"

namespace tpud {
namespace {

// "<what>: <errno text>[; <what to do>]"
absl::Status Errno(absl::string_view what, absl::string_view todo = "") {
  return absl::InternalError(absl::StrCat(what, ": ", std::strerror(errno),
                                          todo.empty() ? "" : "; ", todo));
}

std::string StatusLine(int code) {
  switch (code) {
    case 200:
      return "200 OK";
    case 400:
      return "400 Bad Request";
    case 404:
      return "404 Not Found";
    case 405:
      return "405 Method Not Allowed";
    case 408:
      return "408 Request Timeout";
    case 431:
      return "431 Request Header Fields Too Large";
    case 503:
      return "503 Service Unavailable";
    default:
      return absl::StrCat(code, " Error");
  }
}

std::string Reply(int code, absl::string_view content_type,
                  absl::string_view body, bool head_only = false,
                  absl::string_view extra_headers = "") {
  std::string out = absl::StrCat(
      "HTTP/1.1 ", StatusLine(code), "\r\nContent-Type: ", content_type,
      "\r\nContent-Length: ", body.size(), "\r\nConnection: close\r\n",
      extra_headers, "\r\n");
  if (!head_only) out.append(body.data(), body.size());
  return out;
}

std::string PlainError(int code, absl::string_view why) {
  return Reply(code, "text/plain; charset=utf-8", absl::StrCat(why, "\n"));
}

// Milliseconds left until `deadline`, for poll (at least 0).
int MillisLeft(absl::Time deadline) {
  const int64_t ms = absl::ToInt64Milliseconds(deadline - absl::Now());
  return static_cast<int>(std::max<int64_t>(0, std::min<int64_t>(ms, 1000)));
}

}  // namespace

absl::StatusOr<MetricsAddress> ParseMetricsAddress(absl::string_view text) {
  MetricsAddress a;
  const std::string flag = absl::StrCat("--metrics_address=", text);
  if (text.empty())
    return absl::InvalidArgumentError(absl::StrCat(flag, ": empty address"));
  if (absl::StrContains(text, '/')) {
    if (text.size() >= sizeof(sockaddr_un{}.sun_path)) {
      return absl::InvalidArgumentError(
          absl::StrCat(flag, ": a unix socket path must be shorter than ",
                       sizeof(sockaddr_un{}.sun_path), " bytes"));
    }
    a.unix_socket = true;
    a.path = std::string(text);
    return a;
  }
  absl::string_view host, port;
  if (absl::StartsWith(text, "[")) {
    const size_t close = text.find("]:");
    if (close == absl::string_view::npos) {
      return absl::InvalidArgumentError(
          absl::StrCat(flag, ": write an IPv6 address as [::1]:PORT"));
    }
    host = text.substr(1, close - 1);
    port = text.substr(close + 2);
    a.ipv6 = true;
  } else {
    const size_t colon = text.rfind(':');
    if (colon == absl::string_view::npos) {
      return absl::InvalidArgumentError(
          absl::StrCat(flag,
                       ": give HOST:PORT on loopback (127.0.0.1:9464) or a "
                       "unix socket path"));
    }
    host = text.substr(0, colon);
    port = text.substr(colon + 1);
  }
  if (!absl::SimpleAtoi(port, &a.port) || a.port < 0 || a.port > 65535) {
    return absl::InvalidArgumentError(
        absl::StrCat(flag, ": port '", port, "' is not 0-65535"));
  }
  if (host == "localhost") host = "127.0.0.1";
  const std::string h(host);
  bool loopback = false;
  if (a.ipv6) {
    in6_addr v6;
    loopback =
        inet_pton(AF_INET6, h.c_str(), &v6) == 1 && IN6_IS_ADDR_LOOPBACK(&v6);
  } else {
    in_addr v4;
    loopback = inet_pton(AF_INET, h.c_str(), &v4) == 1 &&
               (ntohl(v4.s_addr) >> 24) == 127;
  }
  if (!loopback) {
    return absl::InvalidArgumentError(
        absl::StrCat(flag,
                     ": tpud serves metrics on loopback (127.0.0.0/8, [::1], "
                     "localhost) or a unix "
                     "socket only; they name every session's command. Scrape "
                     "from the host, or "
                     "reach it with a sidecar or `kubectl port-forward`"));
  }
  a.host = h;
  return a;
}

absl::StatusOr<std::unique_ptr<HttpEndpoint>> HttpEndpoint::Start(
    const MetricsAddress& address, std::function<std::string()> render) {
  int fd = -1;
  std::string url;
  if (address.unix_socket) {
    struct stat st;
    if (lstat(address.path.c_str(), &st) == 0) {
      if (!S_ISSOCK(st.st_mode)) {
        return absl::FailedPreconditionError(
            absl::StrCat("--metrics_address=", address.path,
                         ": the path exists and is not a socket"));
      }
      // A socket left by an earlier tpud is removed; one that answers is not.
      const int probe = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
      sockaddr_un sa{};
      sa.sun_family = AF_UNIX;
      std::strncpy(sa.sun_path, address.path.c_str(), sizeof(sa.sun_path) - 1);
      const bool live =
          probe >= 0 &&
          connect(probe, reinterpret_cast<sockaddr*>(&sa), sizeof(sa)) == 0;
      if (probe >= 0) close(probe);
      if (live) {
        return absl::AlreadyExistsError(
            absl::StrCat("--metrics_address=", address.path,
                         ": another process serves this socket"));
      }
      unlink(address.path.c_str());
    }
    fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0) return Errno("metrics socket");
    sockaddr_un sa{};
    sa.sun_family = AF_UNIX;
    std::strncpy(sa.sun_path, address.path.c_str(), sizeof(sa.sun_path) - 1);
    if (bind(fd, reinterpret_cast<sockaddr*>(&sa), sizeof(sa)) != 0) {
      absl::Status s =
          Errno(absl::StrCat("--metrics_address=", address.path, ": binding"),
                "give a path in a directory tpud may write");
      close(fd);
      return s;
    }
    chmod(address.path.c_str(), 0660);
    url = absl::StrCat("unix:", address.path);
  } else {
    fd = socket(address.ipv6 ? AF_INET6 : AF_INET, SOCK_STREAM | SOCK_CLOEXEC,
                0);
    if (fd < 0) return Errno("metrics socket");
    const int one = 1;
    setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    sockaddr_storage ss{};
    socklen_t len = 0;
    if (address.ipv6) {
      auto* s6 = reinterpret_cast<sockaddr_in6*>(&ss);
      s6->sin6_family = AF_INET6;
      s6->sin6_port = htons(static_cast<uint16_t>(address.port));
      inet_pton(AF_INET6, address.host.c_str(), &s6->sin6_addr);
      len = sizeof(*s6);
    } else {
      auto* s4 = reinterpret_cast<sockaddr_in*>(&ss);
      s4->sin_family = AF_INET;
      s4->sin_port = htons(static_cast<uint16_t>(address.port));
      inet_pton(AF_INET, address.host.c_str(), &s4->sin_addr);
      len = sizeof(*s4);
    }
    if (bind(fd, reinterpret_cast<sockaddr*>(&ss), len) != 0) {
      absl::Status s = Errno(absl::StrCat("--metrics_address=", address.host,
                                          ":", address.port, ": binding"),
                             "give a free port, or 0 for any free one");
      close(fd);
      return s;
    }
    socklen_t got = sizeof(ss);
    getsockname(fd, reinterpret_cast<sockaddr*>(&ss), &got);
    const int port =
        address.ipv6 ? ntohs(reinterpret_cast<sockaddr_in6*>(&ss)->sin6_port)
                     : ntohs(reinterpret_cast<sockaddr_in*>(&ss)->sin_port);
    url = address.ipv6
              ? absl::StrCat("http://[", address.host, "]:", port, "/metrics")
              : absl::StrCat("http://", address.host, ":", port, "/metrics");
  }
  if (listen(fd, 64) != 0) {
    absl::Status s = Errno("listening for metrics scrapes");
    close(fd);
    return s;
  }
  const int stop = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  if (stop < 0) {
    close(fd);
    return Errno("eventfd");
  }
  std::unique_ptr<HttpEndpoint> e(
      new HttpEndpoint(fd, stop, url, address.unix_socket ? address.path : "",
                       std::move(render)));
  e->acceptor_ = std::thread([p = e.get()] { p->AcceptLoop(); });
  return e;
}

HttpEndpoint::HttpEndpoint(int listen_fd, int stop_fd, std::string url,
                           std::string unix_path,
                           std::function<std::string()> render)
    : listen_fd_(listen_fd),
      stop_fd_(stop_fd),
      url_(std::move(url)),
      unix_path_(std::move(unix_path)),
      render_(std::move(render)) {}

HttpEndpoint::~HttpEndpoint() {
  const uint64_t one = 1;
  (void)!write(stop_fd_, &one, sizeof(one));
  if (acceptor_.joinable()) acceptor_.join();
  {
    absl::MutexLock lock(&connections_->mu);
    connections_->mu.Await(absl::Condition(
        +[](int* n) { return *n == 0; }, &connections_->open));
  }
  close(listen_fd_);
  close(stop_fd_);
  if (!unix_path_.empty()) unlink(unix_path_.c_str());
}

void HttpEndpoint::AcceptLoop() {
  while (true) {
    pollfd p[2] = {{listen_fd_, POLLIN, 0}, {stop_fd_, POLLIN, 0}};
    if (poll(p, 2, -1) < 0) {
      if (errno == EINTR) continue;
      return;
    }
    if (p[1].revents != 0) return;
    const int fd =
        accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK);
    if (fd < 0) continue;
    bool admitted = false;
    {
      absl::MutexLock lock(&connections_->mu);
      if (connections_->open < kMaxConnections) {
        ++connections_->open;
        admitted = true;
      }
    }
    if (!admitted) {
      const std::string busy =
          PlainError(503, "too many metrics connections at once");
      (void)!send(fd, busy.data(), busy.size(), MSG_NOSIGNAL);
      close(fd);
      continue;
    }
    // The destructor waits for `open` to drop to 0, so `this` outlives
    // Serve; `connections` outlives the unlock after the decrement.
    std::thread([this, fd, connections = connections_] {
      Serve(fd);
      close(fd);
      absl::MutexLock lock(&connections->mu);
      --connections->open;
    }).detach();
  }
}

void HttpEndpoint::Serve(int fd) {
  const absl::Time deadline = absl::Now() + kRequestDeadline;
  std::string request;
  std::string response;
  char buf[4096];
  while (response.empty()) {
    if (request.find("\r\n\r\n") != std::string::npos ||
        request.find("\n\n") != std::string::npos) {
      response = Respond(request, render_);
      break;
    }
    if (request.size() > kMaxRequestBytes) {
      response = PlainError(431, "request headers too large");
      break;
    }
    if (absl::Now() >= deadline) {
      response = PlainError(408, "no complete request in time");
      break;
    }
    pollfd p[2] = {{fd, POLLIN, 0}, {stop_fd_, POLLIN, 0}};
    if (poll(p, 2, MillisLeft(deadline)) < 0 && errno != EINTR) return;
    if (p[1].revents != 0) return;
    if (p[0].revents == 0) continue;
    const ssize_t n = recv(fd, buf, sizeof(buf), 0);
    if (n == 0) return;  // closed before a whole request
    if (n < 0) {
      if (errno == EAGAIN || errno == EINTR) continue;
      return;
    }
    request.append(buf, static_cast<size_t>(n));
  }
  size_t sent = 0;
  const absl::Time write_deadline = absl::Now() + kRequestDeadline;
  while (sent < response.size() && absl::Now() < write_deadline) {
    const ssize_t n =
        send(fd, response.data() + sent, response.size() - sent, MSG_NOSIGNAL);
    if (n > 0) {
      sent += static_cast<size_t>(n);
      continue;
    }
    if (n < 0 && errno != EAGAIN && errno != EINTR) return;
    pollfd p[2] = {{fd, POLLOUT, 0}, {stop_fd_, POLLIN, 0}};
    poll(p, 2, MillisLeft(write_deadline));
    if (p[1].revents != 0) return;
  }
  // Closing with unread request bytes would reset the connection and could
  // lose the answer (an early 431): end our side, then read what the client
  // still sends until it closes (briefly).
  shutdown(fd, SHUT_WR);
  const absl::Time drain_deadline = absl::Now() + absl::Seconds(1);
  size_t drained = 0;
  while (absl::Now() < drain_deadline && drained < (1u << 20)) {
    pollfd p{fd, POLLIN, 0};
    if (poll(&p, 1, MillisLeft(drain_deadline)) <= 0) break;
    const ssize_t n = recv(fd, buf, sizeof(buf), 0);
    if (n <= 0 && !(n < 0 && (errno == EAGAIN || errno == EINTR))) break;
    if (n > 0) drained += static_cast<size_t>(n);
  }
}

std::string HttpEndpoint::Respond(absl::string_view request,
                                  const std::function<std::string()>& render) {
  const size_t eol = request.find('\n');
  absl::string_view line = request.substr(0, eol);
  if (absl::EndsWith(line, "\r")) line.remove_suffix(1);
  const std::vector<absl::string_view> parts = absl::StrSplit(line, ' ');
  if (parts.size() != 3 || !absl::StartsWith(parts[2], "HTTP/1.")) {
    return PlainError(400,
                      "expected a request line such as GET /metrics HTTP/1.1");
  }
  const bool head = parts[0] == "HEAD";
  if (parts[0] != "GET" && !head) {
    return Reply(405, "text/plain; charset=utf-8", "only GET and HEAD\n", false,
                 "Allow: GET, HEAD\r\n");
  }
  absl::string_view path = parts[1];
  path = path.substr(0, path.find('?'));
  if (path == "/metrics") {
    return Reply(200, "text/plain; version=0.0.4; charset=utf-8", render(),
                 head);
  }
  if (path == "/") {
    return Reply(200, "text/plain; charset=utf-8",
                 "tpud: metrics at /metrics\n", head);
  }
  return PlainError(
      404, absl::StrCat("no ", path, " here; metrics are at /metrics"));
}

}  // namespace tpud
