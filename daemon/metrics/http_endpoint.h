// A small HTTP/1.1 endpoint for Prometheus scrapes: `GET /metrics` answers
// with what `render` returns, on a loopback TCP port or a unix socket.
//
// Only loopback: metrics name the commands of every session, so they stay on
// the host (a sidecar, a node agent or `kubectl port-forward` reaches them).
// Every connection is answered once and closed. A request is read within
// kRequestDeadline and up to kMaxRequestBytes, else it is answered 408 / 431
// and dropped; at most kMaxConnections are served at once (more: 503), so a
// client that opens connections and sends nothing delays no scrape for long.
#ifndef TPUD_DAEMON_METRICS_HTTP_ENDPOINT_H_
#define TPUD_DAEMON_METRICS_HTTP_ENDPOINT_H_

#include <atomic>
#include <functional>
#include <memory>
#include <string>
#include <thread>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace tpud {

// Where to listen: "127.0.0.1:9464", "localhost:9464", "[::1]:9464" (port 0:
// any free port) or a unix socket path ("/run/tpud/metrics.sock").
struct MetricsAddress {
  bool unix_socket = false;
  std::string path;  // unix_socket
  std::string host;  // numeric loopback address otherwise
  int port = 0;
  bool ipv6 = false;
};
absl::StatusOr<MetricsAddress> ParseMetricsAddress(absl::string_view text);

class HttpEndpoint {
 public:
  static constexpr int kMaxConnections = 8;
  static constexpr size_t kMaxRequestBytes = 16 << 10;
  static constexpr absl::Duration kRequestDeadline = absl::Seconds(5);

  // Binds and starts serving; the body of /metrics comes from `render` (it
  // may run on several threads at once).
  static absl::StatusOr<std::unique_ptr<HttpEndpoint>> Start(
      const MetricsAddress& address, std::function<std::string()> render);
  ~HttpEndpoint();  // stops, waits for open connections, removes a unix socket

  // "http://127.0.0.1:40123/metrics" or "unix:/run/tpud/metrics.sock".
  const std::string& url() const { return url_; }

  // The response to one raw request (exposed for tests).
  static std::string Respond(absl::string_view request,
                             const std::function<std::string()>& render);

 private:
  HttpEndpoint(int listen_fd, int stop_fd, std::string url,
               std::string unix_path, std::function<std::string()> render);
  void AcceptLoop();
  void Serve(int fd);

  const int listen_fd_;
  const int stop_fd_;  // an eventfd: readable once stopping
  const std::string url_;
  const std::string unix_path_;
  const std::function<std::string()> render_;
  std::thread acceptor_;
  // Connections being served, each on a thread of its own. Held by those
  // threads too, so the last one may finish unlocking after the endpoint is
  // gone.
  struct Connections {
    absl::Mutex mu;
    int open ABSL_GUARDED_BY(mu) = 0;
  };
  std::shared_ptr<Connections> connections_ = std::make_shared<Connections>();
};

}  // namespace tpud

#endif  // TPUD_DAEMON_METRICS_HTTP_ENDPOINT_H_
