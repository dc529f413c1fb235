#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <fstream>
#include <string>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "catch2_compat/catch.h"
#include "daemon/metrics/http_endpoint.h"
#include "daemon/metrics/tpud_metrics.h"
#include "prometheus/text_serializer.h"

namespace tpud {
namespace {

// Sends `request` to the endpoint and returns everything it answers.
std::string Exchange(const HttpEndpoint& e, const std::string& request) {
  int fd = -1;
  const std::string& url = e.url();
  if (absl::StartsWith(url, "unix:")) {
    fd = socket(AF_UNIX, SOCK_STREAM, 0);
    sockaddr_un sa{};
    sa.sun_family = AF_UNIX;
    std::strncpy(sa.sun_path, url.c_str() + 5, sizeof(sa.sun_path) - 1);
    REQUIRE(connect(fd, reinterpret_cast<sockaddr*>(&sa), sizeof(sa)) == 0);
  } else {
    // http://127.0.0.1:PORT/metrics
    const size_t colon = url.rfind(':');
    int port = 0;
    REQUIRE(absl::SimpleAtoi(
        url.substr(colon + 1, url.find('/', colon) - colon - 1), &port));
    fd = socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in sa{};
    sa.sin_family = AF_INET;
    sa.sin_port = htons(static_cast<uint16_t>(port));
    inet_pton(AF_INET, "127.0.0.1", &sa.sin_addr);
    REQUIRE(connect(fd, reinterpret_cast<sockaddr*>(&sa), sizeof(sa)) == 0);
  }
  REQUIRE(send(fd, request.data(), request.size(), MSG_NOSIGNAL) ==
          static_cast<ssize_t>(request.size()));
  std::string out;
  char buf[4096];
  while (true) {
    pollfd p{fd, POLLIN, 0};
    if (poll(&p, 1, 10000) <= 0) break;
    const ssize_t n = recv(fd, buf, sizeof(buf), 0);
    if (n <= 0) break;
    out.append(buf, static_cast<size_t>(n));
  }
  close(fd);
  return out;
}

TEST_CASE("metrics addresses are loopback or unix sockets") {
  auto a = ParseMetricsAddress("127.0.0.1:9464");
  REQUIRE(a.ok());
  CHECK(a->host == "127.0.0.1");
  CHECK(a->port == 9464);
  CHECK(ParseMetricsAddress("localhost:0").ok());
  CHECK(ParseMetricsAddress("127.3.2.1:80").ok());
  auto v6 = ParseMetricsAddress("[::1]:9464");
  REQUIRE(v6.ok());
  CHECK(v6->ipv6);
  auto u = ParseMetricsAddress("/run/tpud/metrics.sock");
  REQUIRE(u.ok());
  CHECK(u->unix_socket);

  auto wide = ParseMetricsAddress("0.0.0.0:9464");
  REQUIRE_FALSE(wide.ok());
  CHECK(absl::StrContains(wide.status().message(), "loopback"));
  CHECK_FALSE(ParseMetricsAddress("10.0.0.1:9464").ok());
  CHECK_FALSE(ParseMetricsAddress("[::]:9464").ok());
  CHECK_FALSE(ParseMetricsAddress("example.com:9464").ok());
  CHECK(absl::StrContains(
      ParseMetricsAddress("127.0.0.1:99999").status().message(), "port"));
  CHECK_FALSE(ParseMetricsAddress("127.0.0.1:").ok());
  CHECK_FALSE(ParseMetricsAddress("9464").ok());
  CHECK_FALSE(ParseMetricsAddress("").ok());
  CHECK_FALSE(ParseMetricsAddress("/" + std::string(200, 'x')).ok());
}

TEST_CASE(
    "the endpoint answers GET and HEAD of /metrics, and refuses the rest") {
  auto render = [] { return std::string("tpud_x 1\n"); };
  const std::string ok =
      HttpEndpoint::Respond("GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n", render);
  CHECK(absl::StartsWith(ok, "HTTP/1.1 200 OK\r\n"));
  CHECK(absl::StrContains(ok, "text/plain; version=0.0.4"));
  CHECK(absl::StrContains(ok, "Content-Length: 9\r\n"));
  CHECK(absl::EndsWith(ok, "\r\n\r\ntpud_x 1\n"));
  CHECK(absl::StartsWith(
      HttpEndpoint::Respond("GET /metrics?x=1 HTTP/1.0\r\n\r\n", render),
      "HTTP/1.1 200"));
  const std::string head =
      HttpEndpoint::Respond("HEAD /metrics HTTP/1.1\r\n\r\n", render);
  CHECK(absl::StrContains(head, "Content-Length: 9\r\n"));
  CHECK(absl::EndsWith(head, "\r\n\r\n"));
  const std::string post =
      HttpEndpoint::Respond("POST /metrics HTTP/1.1\r\n\r\n", render);
  CHECK(absl::StartsWith(post, "HTTP/1.1 405"));
  CHECK(absl::StrContains(post, "Allow: GET, HEAD"));
  CHECK(absl::StartsWith(
      HttpEndpoint::Respond("GET /secret HTTP/1.1\r\n\r\n", render),
      "HTTP/1.1 404"));
  CHECK(
      absl::StartsWith(HttpEndpoint::Respond("\x01\x02garbage\r\n\r\n", render),
                       "HTTP/1.1 400"));
  CHECK(absl::StartsWith(
      HttpEndpoint::Respond("GET /metrics SMTP\r\n\r\n", render),
      "HTTP/1.1 400"));
}

TEST_CASE(
    "the endpoint serves scrapes on loopback TCP and survives bad clients") {
  int scrapes = 0;
  auto e = HttpEndpoint::Start(*ParseMetricsAddress("127.0.0.1:0"), [&] {
    return absl::StrCat("tpud_scrapes ", ++scrapes, "\n");
  });
  REQUIRE(e.ok());
  CHECK(absl::StartsWith((*e)->url(), "http://127.0.0.1:"));
  CHECK(absl::EndsWith(Exchange(**e, "GET /metrics HTTP/1.1\r\n\r\n"),
                       "tpud_scrapes 1\n"));
  // Headers without end: refused once they pass the limit.
  const std::string huge =
      "GET /metrics HTTP/1.1\r\nX: " + std::string(20 << 10, 'a');
  CHECK(absl::StartsWith(Exchange(**e, huge), "HTTP/1.1 431"));
  // A client that connects and goes away sends nothing back and breaks nothing.
  {
    const std::string& url = (*e)->url();
    int port = 0;
    const size_t colon = url.rfind(':');
    REQUIRE(absl::SimpleAtoi(
        url.substr(colon + 1, url.find('/', colon) - colon - 1), &port));
    const int fd = socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in sa{};
    sa.sin_family = AF_INET;
    sa.sin_port = htons(static_cast<uint16_t>(port));
    inet_pton(AF_INET, "127.0.0.1", &sa.sin_addr);
    REQUIRE(connect(fd, reinterpret_cast<sockaddr*>(&sa), sizeof(sa)) == 0);
    (void)!send(fd, "GET /me", 7, MSG_NOSIGNAL);
    close(fd);
  }
  CHECK(absl::EndsWith(Exchange(**e, "GET /metrics HTTP/1.1\r\n\r\n"),
                       "tpud_scrapes 2\n"));
}

TEST_CASE(
    "a unix socket endpoint replaces a stale socket, refuses a live one or a "
    "file") {
  char dir[] = "/tmp/tpud-metrics-test.XXXXXX";
  REQUIRE(mkdtemp(dir) != nullptr);
  const std::string path = absl::StrCat(dir, "/metrics.sock");
  auto render = [] { return std::string("tpud_up 1\n"); };
  {
    auto e = HttpEndpoint::Start(*ParseMetricsAddress(path), render);
    REQUIRE(e.ok());
    CHECK((*e)->url() == "unix:" + path);
    CHECK(absl::EndsWith(Exchange(**e, "GET /metrics HTTP/1.1\r\n\r\n"),
                         "tpud_up 1\n"));
    auto second = HttpEndpoint::Start(*ParseMetricsAddress(path), render);
    REQUIRE_FALSE(second.ok());
    CHECK(absl::StrContains(second.status().message(), "another process"));
  }
  struct stat st;
  CHECK(stat(path.c_str(), &st) != 0);  // removed at the end
  // A stale socket (its server gone without removing it) is replaced.
  {
    const int fd = socket(AF_UNIX, SOCK_STREAM, 0);
    sockaddr_un sa{};
    sa.sun_family = AF_UNIX;
    std::strncpy(sa.sun_path, path.c_str(), sizeof(sa.sun_path) - 1);
    REQUIRE(bind(fd, reinterpret_cast<sockaddr*>(&sa), sizeof(sa)) == 0);
    close(fd);
    auto e = HttpEndpoint::Start(*ParseMetricsAddress(path), render);
    REQUIRE(e.ok());
  }
  { std::ofstream(path) << "not a socket"; }
  auto file = HttpEndpoint::Start(*ParseMetricsAddress(path), render);
  REQUIRE_FALSE(file.ok());
  CHECK(absl::StrContains(file.status().message(), "not a socket"));
  unlink(path.c_str());
  rmdir(dir);
}

TEST_CASE("pod UIDs come from cgroup paths of both cgroup drivers") {
  CHECK(PodUidFromCgroup(
            "0::/kubepods/burstable/pod0a1b2c3d-1111-2222-3333-444455556666/"
            "abcdef\n") == "0a1b2c3d-1111-2222-3333-444455556666");
  CHECK(PodUidFromCgroup(
            "0::/kubepods.slice/kubepods-besteffort.slice/"
            "kubepods-besteffort-pod0A1B2C3D_1111_2222_3333_444455556666.slice/"
            "cri-containerd-1.scope\n") ==
        "0a1b2c3d-1111-2222-3333-444455556666");
  CHECK(PodUidFromCgroup("0::/user.slice/user-0.slice/session-1.scope\n")
            .empty());
  CHECK(PodUidFromCgroup("0::/kubepods/podnot-a-uid/x\n").empty());
  CHECK(PodUidFromCgroup("").empty());
}

// Whole /proc/PID/cgroup files of a container's process, as each layout
// kubelet makes gives them: cgroup v1 (one line per hierarchy) and v2 (one
// line), under kubelet's cgroupfs and systemd drivers, for each QoS class
// (Guaranteed pods have no QoS level), with containerd, CRI-O and Docker
// scopes, and as tpud sees them from its own cgroup namespace.
TEST_CASE("pod UIDs come from real node layouts of cgroup v1 and v2") {
  const std::string uid = "3f1e2d4c-5b6a-4c7d-8e9f-0a1b2c3d4e5f";
  const std::string under = "3f1e2d4c_5b6a_4c7d_8e9f_0a1b2c3d4e5f";
  const std::string cid =
      "8a7c5e3b1f9d2c4a6e8b0d2f4a6c8e0b2d4f6a8c0e2b4d6f8a0c2e4b6d8f0a2c";
  // cgroup v1, every controller's line.
  auto v1 = [](const std::string& path) {
    std::string out;
    const char* controllers[] = {
        "12:perf_event", "11:hugetlb",    "10:pids",   "9:net_cls,net_prio",
        "8:cpuset",      "7:memory",      "6:freezer", "5:blkio",
        "4:devices",     "3:cpu,cpuacct", "2:rdma"};
    for (const char* c : controllers) out += std::string(c) + ":" + path + "\n";
    out += "1:name=systemd:" + path + "\n0::/\n";
    return out;
  };
  struct Fixture {
    std::string layout;
    std::string text;
  };
  const std::vector<Fixture> fixtures = {
      {"v1 cgroupfs burstable (containerd)",
       v1("/kubepods/burstable/pod" + uid + "/" + cid)},
      {"v1 cgroupfs besteffort (docker)",
       v1("/kubepods/besteffort/pod" + uid + "/" + cid)},
      {"v1 cgroupfs guaranteed", v1("/kubepods/pod" + uid + "/" + cid)},
      {"v1 systemd burstable (containerd)",
       v1("/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod" +
          under + ".slice/cri-containerd-" + cid + ".scope")},
      {"v1 systemd guaranteed (CRI-O)",
       v1("/kubepods.slice/kubepods-pod" + under + ".slice/crio-" + cid +
          ".scope")},
      {"v1 systemd besteffort (docker)",
       v1("/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod" +
          under + ".slice/docker-" + cid + ".scope")},
      {"v2 cgroupfs burstable",
       "0::/kubepods/burstable/pod" + uid + "/" + cid + "\n"},
      {"v2 cgroupfs guaranteed", "0::/kubepods/pod" + uid + "/" + cid + "\n"},
      {"v2 systemd besteffort (containerd)",
       "0::/kubepods.slice/kubepods-besteffort.slice/"
       "kubepods-besteffort-pod" +
           under + ".slice/cri-containerd-" + cid + ".scope\n"},
      {"v2 systemd guaranteed (CRI-O)", "0::/kubepods.slice/kubepods-pod" +
                                            under + ".slice/crio-" + cid +
                                            ".scope\n"},
      // tpud in a container of its own cgroup namespace sees other pods'
      // paths relative to its root.
      {"v2 systemd, seen from tpud's cgroup namespace",
       "0::/../../kubepods-burstable.slice/kubepods-burstable-pod" + under +
           ".slice/cri-containerd-" + cid + ".scope\n"},
      // kind and other nested nodes put kubelet's tree under a slice.
      {"v2 systemd under kubelet.slice (kind)",
       "0::/kubelet.slice/kubelet-kubepods.slice/"
       "kubelet-kubepods-besteffort.slice/kubelet-kubepods-besteffort-pod" +
           under + ".slice/cri-containerd-" + cid + ".scope\n"},
      // A process the runtime placed in the pod's cgroup itself (the sandbox).
      {"v2 systemd, the pod's own slice",
       "0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod" +
           under + ".slice\n"},
  };
  for (const Fixture& f : fixtures) {
    INFO(f.layout << ":\n" << f.text);
    CHECK(PodUidFromCgroup(f.text) == uid);
  }
  // Processes outside any pod, on the same layouts.
  const std::vector<Fixture> outside = {
      {"v1 systemd service", v1("/system.slice/tpud.service")},
      {"v1 user session", v1("/user.slice/user-1000.slice/session-3.scope")},
      {"v2 systemd service", "0::/system.slice/containerd.service\n"},
      {"v2 kubepods slice itself", "0::/kubepods.slice\n"},
      {"v2 QoS slice, no pod",
       "0::/kubepods.slice/kubepods-besteffort.slice\n"},
      {"v2 cgroupfs, a truncated uid",
       "0::/kubepods/burstable/pod3f1e2d4c-5b6a-4c7d-8e9f\n"},
      {"v2 root", "0::/\n"},
  };
  for (const Fixture& f : outside) {
    INFO(f.layout << ":\n" << f.text);
    CHECK(PodUidFromCgroup(f.text).empty());
  }
}

TEST_CASE(
    "metric families follow Prometheus conventions and carry tpud's figures") {
  MetricsInputs in;
  in.status.set_daemon_version("0.test");
  in.status.mutable_backend()->set_kind("simulated");
  v1::TopologyInfo* t = in.status.mutable_topology();
  t->set_name("v6e-4");
  for (int c = 0; c < 2; ++c) {
    v1::ChipInfo* chip = t->add_chips();
    chip->set_id(c);
    chip->set_hbm_total_bytes(1 << 30);
    chip->set_hbm_used_bytes(c == 0 ? 4096 : 0);
    chip->set_ops_executed(c == 0 ? 7 : 0);
    chip->set_healthy(true);
  }
  v1::IciLinkInfo* link = t->add_links();
  link->set_a(0);
  link->set_b(1);
  link->set_bytes_a_to_b(100);
  link->set_bytes_b_to_a(50);
  v1::SessionInfo* s = in.status.add_sessions();
  s->set_id(3);
  s->set_pid(1234);
  s->set_command("python\ntrain.py");
  s->set_hbm_bytes(4096);
  in.pod_uids[3] = "0a1b2c3d-1111-2222-3333-444455556666";
  v1::ExecutorInfo* ex = in.status.add_executors();
  ex->set_index(0);
  ex->set_restarts(2);
  ex->set_ready(true);
  ExecutorInfo e;
  e.chips = {0, 1};
  e.op_latency.resize(2);
  e.op_latency[0].fill(0);
  e.op_latency[1].fill(0);
  e.op_latency[0][OpLatencyBucket(3'000)] = 5;  // 3 µs: the 5 µs bucket
  e.op_latency[0][kOpLatencyBuckets - 1] = 1;   // above 10 s
  e.op_latency_sum_ns = {20'000'015'000, 0};
  e.queue_depth = {4, 0};
  e.intra_op_threads = 2;
  e.op_errors[static_cast<int>(absl::StatusCode::kOutOfRange)] = 2;
  in.executors.push_back(e);
  in.sessions.opened = 5;
  in.sessions.killed = 1;
  in.rpc_statuses[static_cast<int>(absl::StatusCode::kResourceExhausted)] = 3;

  const std::string text =
      prometheus::TextSerializer().Serialize(BuildMetricFamilies(in));
  INFO(text);
  CHECK(absl::StrContains(text, "# TYPE tpud_chip_hbm_used_bytes gauge"));
  CHECK(absl::StrContains(text, "tpud_chip_hbm_used_bytes{chip=\"0\"} 4096"));
  CHECK(absl::StrContains(text,
                          "tpud_chip_hbm_total_bytes{chip=\"1\"} 1073741824"));
  CHECK(absl::StrContains(text, "# TYPE tpud_chip_ops_total counter"));
  CHECK(absl::StrContains(text, "tpud_chip_ops_total{chip=\"0\"} 7"));
  CHECK(absl::StrContains(text, "tpud_chip_queue_depth{chip=\"0\"} 4"));
  CHECK(absl::StrContains(text, "tpud_chip_intra_op_threads{chip=\"1\"} 2"));
  CHECK(absl::StrContains(text,
                          "# TYPE tpud_chip_op_duration_seconds histogram"));
  CHECK(absl::StrContains(
      text,
      "tpud_chip_op_duration_seconds_bucket{chip=\"0\",le=\"2.5e-06\"} 0"));
  CHECK(absl::StrContains(
      text, "tpud_chip_op_duration_seconds_bucket{chip=\"0\",le=\"5e-06\"} 5"));
  CHECK(absl::StrContains(
      text, "tpud_chip_op_duration_seconds_bucket{chip=\"0\",le=\"10\"} 5"));
  CHECK(absl::StrContains(
      text, "tpud_chip_op_duration_seconds_bucket{chip=\"0\",le=\"+Inf\"} 6"));
  CHECK(absl::StrContains(text,
                          "tpud_chip_op_duration_seconds_count{chip=\"0\"} 6"));
  CHECK(absl::StrContains(text,
                          "tpud_ici_link_transmit_bytes_total{src=\"0\",dst="
                          "\"1\",axis=\"0\"} 100"));
  CHECK(absl::StrContains(
      text,
      "tpud_ici_link_transmit_bytes_total{src=\"1\",dst=\"0\",axis=\"0\"} 50"));
  CHECK(absl::StrContains(text, "tpud_session_hbm_bytes{session=\"3\"} 4096"));
  CHECK(absl::StrContains(text,
                          "pod_uid=\"0a1b2c3d-1111-2222-3333-444455556666\""));
  CHECK(absl::StrContains(
      text, "command=\"python?train.py\""));  // no raw newline in a label
  CHECK(absl::StrContains(text, "tpud_sessions_opened_total 5"));
  CHECK(absl::StrContains(text,
                          "tpud_sessions_ended_total{reason=\"killed\"} 1"));
  CHECK(absl::StrContains(
      text, "tpud_errors_total{source=\"op\",code=\"OUT_OF_RANGE\"} 2"));
  CHECK(absl::StrContains(
      text, "tpud_errors_total{source=\"rpc\",code=\"RESOURCE_EXHAUSTED\"} 3"));
  CHECK(absl::StrContains(text,
                          "tpud_executor_restarts_total{executor=\"0\"} 2"));
  CHECK(absl::StrContains(text, "tpud_build_info{"));
  // Counters end in _total; every family has HELP and TYPE; names are legal.
  size_t pos = 0;
  while ((pos = text.find("# TYPE ", pos)) != std::string::npos) {
    const size_t eol = text.find('\n', pos);
    const std::string line = text.substr(pos + 7, eol - pos - 7);
    const std::string name = line.substr(0, line.find(' '));
    const std::string type = line.substr(line.find(' ') + 1);
    INFO(name);
    CHECK(absl::StartsWith(name, "tpud_"));
    CHECK(absl::StrContains(text, "# HELP " + name + " "));
    if (type == "counter") CHECK(absl::EndsWith(name, "_total"));
    for (char c : name)
      CHECK((std::isalnum(static_cast<unsigned char>(c)) || c == '_'));
    pos = eol;
  }
}

TEST_CASE("compile figures, the cache on disk only where an executor has one") {
  MetricsInputs in;
  in.status.set_daemon_version("0.test");
  in.status.mutable_backend()->set_kind("pjrt");
  for (int x = 0; x < 2; ++x) {
    v1::ExecutorInfo* ex = in.status.add_executors();
    ex->set_index(x);
    ex->add_chips(x);
    ex->set_ready(true);
    v1::ChipCompileStats* c = ex->add_compile();
    c->set_chip(x);
    c->set_compiles(3);
    c->set_disk_hits(x == 0 ? 5 : 0);
    c->set_disk_stores(2);
    c->set_compile_seconds_saved(x == 0 ? 1.5 : 0);
    if (x == 0) {
      v1::CompileCacheOnDisk* d = ex->mutable_disk_cache();
      d->set_enabled(true);
      d->set_entries(7);
      d->set_bytes(4096);
      d->set_max_bytes(1 << 20);
      d->set_rejected(1);
      d->set_write_errors(2);
    }
  }
  const std::string text =
      prometheus::TextSerializer().Serialize(BuildMetricFamilies(in));
  INFO(text);
  CHECK(absl::StrContains(
      text, "# TYPE tpud_chip_compile_cache_disk_hits_total counter"));
  CHECK(absl::StrContains(
      text, "tpud_chip_compile_cache_disk_hits_total{chip=\"0\"} 5"));
  CHECK(absl::StrContains(
      text, "tpud_chip_compile_cache_disk_stores_total{chip=\"1\"} 2"));
  CHECK(absl::StrContains(
      text, "tpud_chip_compile_seconds_saved_total{chip=\"0\"} 1.5"));
  CHECK(
      absl::StrContains(text, "# TYPE tpud_compile_cache_disk_entries gauge"));
  CHECK(absl::StrContains(text,
                          "tpud_compile_cache_disk_entries{executor=\"0\"} 7"));
  CHECK(absl::StrContains(
      text, "tpud_compile_cache_disk_bytes{executor=\"0\"} 4096"));
  CHECK(absl::StrContains(
      text, "tpud_compile_cache_disk_max_bytes{executor=\"0\"} 1048576"));
  CHECK(absl::StrContains(
      text, "tpud_compile_cache_disk_rejected_total{executor=\"0\"} 1"));
  CHECK(absl::StrContains(
      text, "tpud_compile_cache_disk_write_errors_total{executor=\"0\"} 2"));
  // Executor 1 has no cache on disk: none of its figures.
  CHECK_FALSE(absl::StrContains(
      text, "tpud_compile_cache_disk_entries{executor=\"1\"}"));
  CHECK_FALSE(absl::StrContains(
      text, "tpud_compile_cache_disk_rejected_total{executor=\"1\"}"));
}

}  // namespace
}  // namespace tpud
