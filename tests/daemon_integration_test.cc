// End-to-end behaviour of a real tpud process on real unix sockets.
#include <fcntl.h>
#include <grpcpp/create_channel_posix.h>
#include <grpcpp/generic/generic_stub.h>
#include <grpcpp/grpcpp.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "catch2_compat/catch.h"
#include "proto/protocol.h"
#include "proto/tpud.grpc.pb.h"
#include "tests/daemon_harness.h"
#include "tpu/client.h"
#include "tpu/device_address.h"

namespace {

using tpud_test::BinaryPath;
using tpud_test::ChildProcess;
using tpud_test::TestDaemon;

constexpr uint64_t kMiB = 1 << 20;

std::unique_ptr<tpu::Session> OpenSession(const TestDaemon& d,
                                          std::string name = "test") {
  tpu::ClientOptions options;
  options.socket_path = d.socket();
  options.client_name = std::move(name);
  absl::StatusOr<std::unique_ptr<tpu::Session>> s = tpu::Session::Open(options);
  INFO(s.status().ToString());
  REQUIRE(s.ok());
  return *std::move(s);
}

std::unique_ptr<tpu::AdminClient> Admin(const TestDaemon& d) {
  absl::StatusOr<std::unique_ptr<tpu::AdminClient>> a =
      tpu::AdminClient::Connect(d.admin_socket());
  INFO(a.status().ToString());
  REQUIRE(a.ok());
  return *std::move(a);
}

uint64_t TotalUsed(tpu::AdminClient& admin) {
  absl::StatusOr<tpu::DaemonStatus> st = admin.GetStatus();
  REQUIRE(st.ok());
  uint64_t used = 0;
  for (const tpu::ChipInfo& c : st->topology.chips) used += c.hbm_used_bytes;
  return used;
}

size_t SessionCount(tpu::AdminClient& admin) {
  absl::StatusOr<std::vector<tpu::SessionInfo>> s = admin.ListSessions();
  REQUIRE(s.ok());
  return s->size();
}

int ConnectRaw(const std::string& path) {
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  std::strncpy(addr.sun_path, path.c_str(), sizeof(addr.sun_path) - 1);
  int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  REQUIRE(connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0);
  return fd;
}

std::shared_ptr<grpc::Channel> RawChannel(const std::string& path) {
  int fd = ConnectRaw(path);
  fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) | O_NONBLOCK);
  return grpc::CreateInsecureChannelFromFd("tpud", fd);
}

TEST_CASE("a session sees the topology, allocates, frees and closes") {
  TestDaemon d;
  auto s = OpenSession(d, "lifecycle");
  REQUIRE(s->protocol_version() == tpud::kMaxProtocolVersion);
  absl::StatusOr<tpu::TopologyInfo> t = s->GetTopology();
  REQUIRE(t.ok());
  CHECK(t->name == "v6e-4");
  CHECK(t->generation.name == "v6e");
  CHECK(t->ShapeString() == "2x2");
  REQUIRE(t->chips.size() == 4);
  CHECK(t->chips[3].coords == std::vector<int>{1, 1});
  CHECK(t->chips[0].hbm_total_bytes == 256 * kMiB);

  absl::StatusOr<tpu::Segment> seg = s->Allocate(2, 10 * kMiB + 1);
  REQUIRE(seg.ok());
  CHECK(seg->chip == 2);
  CHECK(tpu::DeviceAddressChip(seg->address) == 2);
  CHECK(seg->size == 10 * kMiB + 4096);
  absl::StatusOr<tpu::MemoryStats> m = s->GetMemoryStats();
  REQUIRE(m.ok());
  CHECK(m->chips[2].session_bytes == seg->size);
  CHECK(m->chips[2].chip_used_bytes == seg->size);

  auto admin = Admin(d);
  absl::StatusOr<tpu::DaemonStatus> st = admin->GetStatus();
  REQUIRE(st.ok());
  REQUIRE(st->sessions.size() == 1);
  // Identity comes from the socket, not from what the client says.
  CHECK(st->sessions[0].pid == getpid());
  CHECK(st->sessions[0].uid == getuid());
  CHECK(absl::StrContains(st->sessions[0].command, "daemon_integration_test"));
  CHECK(st->sessions[0].client_name == "lifecycle");
  CHECK(st->sessions[0].hbm_bytes_per_chip.at(2) == seg->size);

  REQUIRE(s->Free(seg->address).ok());
  CHECK(TotalUsed(*admin) == 0);
  REQUIRE(s->Close().ok());
  CHECK(SessionCount(*admin) == 0);
  // A closed session cannot be used.
  CHECK(s->Allocate(0, 4096).status().code() ==
        absl::StatusCode::kFailedPrecondition);
}

TEST_CASE("kill -9 of a client holding HBM returns every byte at once") {
  TestDaemon d;
  auto admin = Admin(d);
  ChildProcess child(BinaryPath("examples/cpp/hello_tpud"),
                     {"--socket=" + d.socket(), "--chip=1", "--bytes=200MiB",
                      "--segments=50", "--hold_seconds=60"});
  REQUIRE(TestDaemon::WaitFor([&] { return TotalUsed(*admin) >= 200 * kMiB; }));
  absl::StatusOr<std::vector<tpu::SessionInfo>> sessions =
      admin->ListSessions();
  REQUIRE(sessions.ok());
  REQUIRE(sessions->size() == 1);
  CHECK((*sessions)[0].pid == child.pid());
  CHECK((*sessions)[0].segment_count == 50);

  absl::Time killed = absl::Now();
  child.Signal(SIGKILL);
  REQUIRE(TestDaemon::WaitFor([&] { return TotalUsed(*admin) == 0; },
                              absl::Seconds(5)));
  double ms = absl::ToDoubleMilliseconds(absl::Now() - killed);
  std::printf("kill -9 -> HBM back to 0 in %.2f ms (200 MiB in 50 segments)\n",
              ms);
  CHECK(SessionCount(*admin) == 0);
  CHECK(ms < 2000);
}

TEST_CASE("a session cannot free or use another session's memory") {
  TestDaemon d;
  auto a = OpenSession(d, "a");
  auto b = OpenSession(d, "b");
  absl::StatusOr<tpu::Segment> seg = a->Allocate(0, 1 * kMiB);
  REQUIRE(seg.ok());
  absl::Status st = b->Free(seg->address);
  CHECK(st.code() == absl::StatusCode::kPermissionDenied);
  // Inside the segment, not at its start: still someone else's.
  CHECK(b->Free(seg->address + 4096).code() ==
        absl::StatusCode::kPermissionDenied);
  // Forged addresses.
  CHECK(b->Free(0).code() == absl::StatusCode::kInvalidArgument);
  CHECK(b->Free(0xdeadbeefULL).code() == absl::StatusCode::kInvalidArgument);
  CHECK(b->Free(tpu::MakeDeviceAddress(9, 0)).code() ==
        absl::StatusCode::kInvalidArgument);
  // A's segment is intact.
  absl::StatusOr<tpu::MemoryStats> m = a->GetMemoryStats();
  REQUIRE(m.ok());
  CHECK(m->chips[0].session_bytes == 1 * kMiB);

  // Using A's session id from B's connection: refused.
  auto channel = RawChannel(d.socket());
  auto stub = tpud::v1::Runtime::NewStub(channel);
  tpud::v1::OpenSessionRequest open;
  open.set_min_protocol_version(tpud::kMinProtocolVersion);
  open.set_max_protocol_version(tpud::kMaxProtocolVersion);
  tpud::v1::OpenSessionResponse opened;
  {
    grpc::ClientContext ctx;
    REQUIRE(stub->OpenSession(&ctx, open, &opened).ok());
  }
  tpud::v1::FreeSegmentRequest forged;
  forged.set_session_id(a->id());
  forged.set_address(seg->address);
  tpud::v1::FreeSegmentResponse freed;
  grpc::ClientContext ctx;
  grpc::Status gs = stub->FreeSegment(&ctx, forged, &freed);
  CHECK(gs.error_code() == grpc::StatusCode::PERMISSION_DENIED);
  REQUIRE(a->Free(seg->address).ok());
}

TEST_CASE("out of memory says what was asked and what is left") {
  TestDaemon d;
  auto s = OpenSession(d);
  REQUIRE(s->Allocate(0, 200 * kMiB).ok());
  absl::StatusOr<tpu::Segment> big = s->Allocate(0, 100 * kMiB);
  REQUIRE(big.status().code() == absl::StatusCode::kResourceExhausted);
  std::string msg(big.status().message());
  INFO(msg);
  CHECK(absl::StrContains(msg, "chip 0"));
  CHECK(absl::StrContains(msg, "asked 100.00 MiB"));
  CHECK(absl::StrContains(msg, "holds 200.00 MiB"));
  CHECK(absl::StrContains(msg, "free 56.00 MiB of 256.00 MiB"));
  CHECK(absl::StrContains(msg, "largest free block 56.00 MiB"));
  // Absurd sizes are refused the same way, and the session goes on.
  CHECK(s->Allocate(0, UINT64_MAX).status().code() ==
        absl::StatusCode::kResourceExhausted);
  CHECK(s->Allocate(0, 0).status().code() ==
        absl::StatusCode::kInvalidArgument);
  CHECK(s->Allocate(77, 4096).status().code() ==
        absl::StatusCode::kInvalidArgument);
  CHECK(s->Allocate(1, 50 * kMiB).ok());
}

TEST_CASE("quotas are enforced per session and per chip") {
  TestDaemon d({"--session_quota_bytes=64MiB"});
  auto admin = Admin(d);
  auto s = OpenSession(d);
  REQUIRE(s->Allocate(0, 48 * kMiB).ok());
  absl::StatusOr<tpu::Segment> over = s->Allocate(0, 32 * kMiB);
  REQUIRE(over.status().code() == absl::StatusCode::kResourceExhausted);
  CHECK(absl::StrContains(over.status().message(), "quota"));
  CHECK(absl::StrContains(over.status().message(), "64.00 MiB"));
  CHECK(s->Allocate(1, 48 * kMiB).ok());  // per chip
  absl::StatusOr<tpu::MemoryStats> stats = s->GetMemoryStats();
  REQUIRE(stats.ok());
  CHECK(stats->quota_bytes_per_chip == 64 * kMiB);

  REQUIRE(admin->SetSessionQuota(s->id(), 128 * kMiB).ok());
  CHECK(s->Allocate(0, 32 * kMiB).ok());
  REQUIRE(admin->SetSessionQuota(s->id(), 0).ok());
  CHECK(s->Allocate(0, 100 * kMiB).ok());

  REQUIRE(admin->SetDefaultQuota(8 * kMiB).ok());
  auto t = OpenSession(d);
  CHECK(t->Allocate(2, 16 * kMiB).status().code() ==
        absl::StatusCode::kResourceExhausted);
  CHECK(admin->SetSessionQuota(12345, 1).code() == absl::StatusCode::kNotFound);
}

TEST_CASE("a drained chip refuses new allocations and keeps existing ones") {
  TestDaemon d;
  auto admin = Admin(d);
  auto s = OpenSession(d);
  absl::StatusOr<tpu::Segment> kept = s->Allocate(1, kMiB);
  REQUIRE(kept.ok());
  REQUIRE(admin->DrainChip(1).ok());
  absl::StatusOr<tpu::Segment> refused = s->Allocate(1, kMiB);
  REQUIRE(refused.status().code() == absl::StatusCode::kFailedPrecondition);
  CHECK(absl::StrContains(refused.status().message(), "drained"));
  CHECK(s->Allocate(0, kMiB).ok());
  absl::StatusOr<tpu::DaemonStatus> st = admin->GetStatus();
  REQUIRE(st.ok());
  CHECK(st->topology.chips[1].drained);
  CHECK(st->topology.chips[1].hbm_used_bytes == kMiB);
  CHECK(s->Free(kept->address).ok());
  REQUIRE(admin->UndrainChip(1).ok());
  CHECK(s->Allocate(1, kMiB).ok());
  CHECK(admin->DrainChip(4).code() == absl::StatusCode::kInvalidArgument);
}

TEST_CASE("an administrator can kill a session; its client learns it") {
  TestDaemon d;
  auto admin = Admin(d);
  auto s = OpenSession(d);
  REQUIRE(s->Allocate(0, 32 * kMiB).ok());
  absl::StatusOr<uint64_t> reclaimed = admin->KillSession(s->id());
  REQUIRE(reclaimed.ok());
  CHECK(*reclaimed == 32 * kMiB);
  CHECK(TotalUsed(*admin) == 0);
  absl::StatusOr<tpu::Segment> after = s->Allocate(0, kMiB);
  CHECK_FALSE(after.ok());
  CHECK(admin->KillSession(s->id()).status().code() ==
        absl::StatusCode::kNotFound);
}

TEST_CASE(
    "malformed and unknown requests get errors while the daemon keeps "
    "serving") {
  TestDaemon d;
  auto good = OpenSession(d);
  REQUIRE(good->Allocate(0, kMiB).ok());

  // Garbage bytes instead of HTTP/2, a truncated preface, then hang-ups.
  for (const std::string& junk :
       {std::string("GET / HTTP/1.1\r\n\r\n"),
        std::string("PRI * HTTP/2.0\r\n"), std::string(100000, '\xff'),
        std::string("\0\0\0\0", 4)}) {
    int fd = ConnectRaw(d.socket());
    (void)!write(fd, junk.data(), junk.size());
    close(fd);
  }

  // Unknown method: UNIMPLEMENTED.
  auto channel = RawChannel(d.socket());
  grpc::GenericStub generic(channel);
  auto call = [&](const std::string& method, const std::string& payload) {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() +
                     std::chrono::seconds(5));
    grpc::Slice slice(payload);
    grpc::ByteBuffer request(&slice, 1), response;
    grpc::CompletionQueue cq;
    std::unique_ptr<grpc::GenericClientAsyncResponseReader> reader =
        generic.PrepareUnaryCall(&ctx, method, request, &cq);
    reader->StartCall();
    grpc::Status status;
    reader->Finish(&response, &status, reinterpret_cast<void*>(1));
    void* tag;
    bool ok;
    cq.Next(&tag, &ok);
    return status;
  };
  CHECK(call("/tpud.v1.Runtime/NoSuchMethod", "").error_code() ==
        grpc::StatusCode::UNIMPLEMENTED);
  // Admin calls are not served on the runtime socket.
  CHECK(call("/tpud.v1.Admin/GetStatus", "").error_code() ==
        grpc::StatusCode::UNIMPLEMENTED);
  // Bytes that are not a valid protobuf message.
  grpc::Status bad = call("/tpud.v1.Runtime/AllocateSegment",
                          std::string("\xff\xff\xff\xff", 4));
  CHECK_FALSE(bad.ok());
  // A request without a session.
  tpud::v1::AllocateSegmentRequest no_session;
  no_session.set_bytes(4096);
  CHECK(call("/tpud.v1.Runtime/AllocateSegment", no_session.SerializeAsString())
            .error_code() == grpc::StatusCode::NOT_FOUND);
  // An oversized message.
  CHECK(call("/tpud.v1.Runtime/GetTopology", std::string(8 << 20, 'x'))
            .error_code() == grpc::StatusCode::RESOURCE_EXHAUSTED);

  // No common protocol version.
  auto stub = tpud::v1::Runtime::NewStub(RawChannel(d.socket()));
  tpud::v1::OpenSessionRequest req;
  req.set_min_protocol_version(7);
  req.set_max_protocol_version(9);
  tpud::v1::OpenSessionResponse resp;
  grpc::ClientContext ctx;
  grpc::Status version = stub->OpenSession(&ctx, req, &resp);
  CHECK(version.error_code() == grpc::StatusCode::FAILED_PRECONDITION);
  CHECK(absl::StrContains(version.error_message(), "[7, 9]"));

  // The good session is untouched and the daemon still serves new ones.
  absl::StatusOr<tpu::MemoryStats> m = good->GetMemoryStats();
  REQUIRE(m.ok());
  CHECK(m->chips[0].session_bytes == kMiB);
  auto another = OpenSession(d);
  CHECK(another->Allocate(3, kMiB).ok());
}

TEST_CASE(
    "no daemon: one clear error naming the socket and how to start tpud") {
  absl::StatusOr<std::unique_ptr<tpu::Session>> s =
      tpu::Session::Open({"/tmp/tpud-no-such-dir/tpud.sock", "x"});
  REQUIRE(s.status().code() == absl::StatusCode::kUnavailable);
  std::string msg(s.status().message());
  INFO(msg);
  CHECK(absl::StrContains(msg, "/tmp/tpud-no-such-dir/tpud.sock"));
  CHECK(absl::StrContains(msg, "No such file or directory"));
  CHECK(absl::StrContains(msg, "tpud --socket="));

  // A daemon that goes away mid-session: UNAVAILABLE, not a hang.
  auto d = std::make_unique<TestDaemon>();
  auto live = OpenSession(*d);
  REQUIRE(d->Stop() == 0);
  absl::StatusOr<tpu::Segment> after = live->Allocate(0, 4096);
  CHECK(after.status().code() == absl::StatusCode::kUnavailable);
}

TEST_CASE("32 client processes at once") {
  TestDaemon d({}, "512MiB");
  auto admin = Admin(d);
  std::vector<ChildProcess> children;
  for (int i = 0; i < 32; ++i) {
    children.emplace_back(
        BinaryPath("examples/cpp/hello_tpud"),
        std::vector<std::string>{"--socket=" + d.socket(),
                                 absl::StrCat("--chip=", i % 4), "--bytes=8MiB",
                                 "--segments=4", "--hold_seconds=3"});
  }
  // Each client opens its session, then allocates: wait for both.
  REQUIRE(TestDaemon::WaitFor(
      [&] {
        return SessionCount(*admin) == 32 && TotalUsed(*admin) == 32 * 8 * kMiB;
      },
      absl::Seconds(20)));
  absl::StatusOr<tpu::DaemonStatus> st = admin->GetStatus();
  REQUIRE(st.ok());
  for (const tpu::ChipInfo& c : st->topology.chips) {
    CHECK(c.hbm_used_bytes == 8 * 8 * kMiB);
    CHECK(c.session_count == 8);
  }
  for (ChildProcess& c : children) CHECK(c.Wait() == 0);
  REQUIRE(TestDaemon::WaitFor([&] { return SessionCount(*admin) == 0; }));
  CHECK(TotalUsed(*admin) == 0);
}

TEST_CASE("sockets: modes, stale files, a second daemon, clean shutdown") {
  auto d = std::make_unique<TestDaemon>();
  struct stat st;
  REQUIRE(stat(d->socket().c_str(), &st) == 0);
  CHECK((st.st_mode & 0777) == 0660);
  REQUIRE(stat(d->admin_socket().c_str(), &st) == 0);
  CHECK((st.st_mode & 0777) == 0600);

  // A second daemon on the same sockets refuses to steal them.
  tpud_test::CommandResult second = tpud_test::RunCommand(
      BinaryPath("daemon/tpud"),
      {"--socket=" + d->socket(), "--admin_socket=" + d->admin_socket(),
       "--hbm_bytes=1MiB"},
      {},
      /*capture_stderr=*/true);
  CHECK(second.exit_code == 1);
  CHECK(absl::StrContains(second.output, "already serving"));

  std::string sock = d->socket();
  REQUIRE(d->Stop() == 0);
  CHECK(access(sock.c_str(), F_OK) != 0);  // removed on SIGTERM

  // A stale socket file (a crashed daemon) is replaced.
  int fd = socket(AF_UNIX, SOCK_STREAM, 0);
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  std::strncpy(addr.sun_path, sock.c_str(), sizeof(addr.sun_path) - 1);
  REQUIRE(bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0);
  close(fd);
  REQUIRE(access(sock.c_str(), F_OK) == 0);
  ChildProcess restarted(
      BinaryPath("daemon/tpud"),
      {"--socket=" + sock, "--admin_socket=" + d->admin_socket(),
       "--hbm_bytes=1MiB", "--log_level=error"});
  REQUIRE(TestDaemon::WaitFor([&] {
    tpu::ClientOptions o;
    o.socket_path = sock;
    return tpu::Session::Open(o).ok();
  }));
  restarted.Signal(SIGTERM);
  CHECK(restarted.Wait() == 0);
}

TEST_CASE("under systemd, tpud reports readiness and stopping with sd_notify") {
  char tmpl[] = "/tmp/tpud-notify.XXXXXX";
  REQUIRE(mkdtemp(tmpl) != nullptr);
  std::string dir = tmpl;
  std::string notify = dir + "/notify.sock";
  int fd = socket(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC, 0);
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  std::strncpy(addr.sun_path, notify.c_str(), sizeof(addr.sun_path) - 1);
  REQUIRE(bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0);
  timeval tv{10, 0};
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  ChildProcess daemon(BinaryPath("daemon/tpud"),
                      {"--socket=" + dir + "/tpud.sock",
                       "--admin_socket=" + dir + "/admin.sock",
                       "--hbm_bytes=1MiB", "--log_level=error"},
                      {"NOTIFY_SOCKET=" + notify});
  char buf[1024];
  ssize_t n = recv(fd, buf, sizeof(buf) - 1, 0);
  REQUIRE(n > 0);
  std::string ready(buf, n);
  CHECK(absl::StrContains(ready, "READY=1"));
  CHECK(absl::StrContains(ready, "STATUS=serving v6e-4"));
  // Readiness is only announced once the socket accepts sessions.
  tpu::ClientOptions o;
  o.socket_path = dir + "/tpud.sock";
  CHECK(tpu::Session::Open(o).ok());
  daemon.Signal(SIGTERM);
  n = recv(fd, buf, sizeof(buf) - 1, 0);
  REQUIRE(n > 0);
  CHECK(absl::StrContains(std::string(buf, n), "STOPPING=1"));
  CHECK(daemon.Wait() == 0);
  close(fd);
  unlink(notify.c_str());
  rmdir(dir.c_str());
}

TEST_CASE("tpud rejects bad flags with a clear message") {
  tpud_test::CommandResult r = tpud_test::RunCommand(
      BinaryPath("daemon/tpud"), {"--topology=v9z-3", "--socket=/tmp/x.sock"},
      {}, true);
  CHECK(r.exit_code == 1);
  CHECK(absl::StrContains(r.output, "v6e-4"));  // lists the known presets
  r = tpud_test::RunCommand(BinaryPath("daemon/tpud"), {"--hbm_bytes=lots"}, {},
                            true);
  CHECK(r.exit_code == 1);
  CHECK(absl::StrContains(r.output, "--hbm_bytes"));
}

}  // namespace
