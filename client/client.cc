#include "tpu/client.h"

#include <errno.h>
#include <fcntl.h>
#include <grpcpp/create_channel_posix.h>
#include <grpcpp/grpcpp.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <cstring>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/synchronization/mutex.h"
#include "proto/protocol.h"
#include "proto/tpud.grpc.pb.h"
#include "session_impl.h"
#include "tpu/paths.h"

namespace tpu {

using ::tpud::FromGrpcStatus;
namespace v1 = ::tpud::v1;

// Connects a unix stream socket. The error names the path, the errno text and
// what to do about it, because "connection refused" alone helps no one.
absl::StatusOr<int> internal::ConnectUnix(const std::string& path, bool admin) {
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  if (path.size() >= sizeof(addr.sun_path)) {
    return absl::InvalidArgumentError(
        absl::StrCat("tpud socket path is too long (", path.size(),
                     " bytes, limit ", sizeof(addr.sun_path) - 1, "): ", path));
  }
  std::memcpy(addr.sun_path, path.c_str(), path.size());
  int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0)
    return absl::InternalError(
        absl::StrCat("socket(): ", std::strerror(errno)));
  if (connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    int err = errno;
    close(fd);
    const char* flag = admin ? "--admin_socket" : "--socket";
    const char* env = admin ? "TPUD_ADMIN_SOCKET" : "TPUD_SOCKET";
    std::string hint =
        err == EACCES
            ? absl::StrCat("you lack permission on the socket",
                           admin ? " (the admin socket is root only)"
                                 : " (join the group that owns it)")
            : absl::StrCat("is tpud running? Start it with `tpud ", flag, "=",
                           path, "` (or `systemctl start tpud`), or set ", env,
                           " to the socket of a running tpud");
    return absl::UnavailableError(absl::StrCat("cannot connect to tpud at ",
                                               path, ": ", std::strerror(err),
                                               "; ", hint));
  }
  return fd;
}

// Adds the socket path to errors that mean the daemon is unreachable.
absl::Status internal::Annotate(const grpc::Status& status,
                                const std::string& path) {
  absl::Status st = FromGrpcStatus(status);
  if (st.code() == absl::StatusCode::kUnavailable) {
    return absl::UnavailableError(absl::StrCat(
        "lost the connection to tpud at ", path, " (", st.message(),
        "); the daemon stopped or ended this session"));
  }
  if (st.code() == absl::StatusCode::kDeadlineExceeded) {
    return absl::DeadlineExceededError(absl::StrCat(
        "tpud at ", path, " did not answer in time: ", st.message()));
  }
  return st;
}

namespace {

using internal::Annotate;
using internal::ConnectUnix;
using internal::SetDeadline;

std::shared_ptr<grpc::Channel> ChannelOnFd(int fd) {
  // gRPC expects a non-blocking descriptor.
  fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) | O_NONBLOCK);
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(16 << 20);
  return grpc::CreateCustomInsecureChannelFromFd("tpud", fd, args);
}

TopologyInfo ConvertTopology(const v1::TopologyInfo& t) {
  TopologyInfo out;
  out.name = t.name();
  out.simulated = t.simulated();
  out.backend = t.backend();
  out.lowered_ops.assign(t.lowered_ops().begin(), t.lowered_ops().end());
  out.fuses = t.fuses();
  const v1::GenerationFacts& g = t.generation();
  out.generation.name = g.name();
  out.generation.hbm_bytes_per_chip = g.hbm_bytes_per_chip();
  out.generation.hbm_bandwidth_gbytes_per_s = g.hbm_bandwidth_gbytes_per_s();
  out.generation.ici_bandwidth_gbytes_per_s = g.ici_bandwidth_gbytes_per_s();
  out.generation.peak_bf16_tflops = g.peak_bf16_tflops();
  out.generation.tensorcores_per_chip = g.tensorcores_per_chip();
  out.generation.torus_dims = g.torus_dims();
  out.shape.assign(t.shape().begin(), t.shape().end());
  out.wraparound.assign(t.wraparound().begin(), t.wraparound().end());
  for (const v1::ChipInfo& c : t.chips()) {
    ChipInfo chip;
    chip.id = c.id();
    chip.coords.assign(c.coords().begin(), c.coords().end());
    chip.neighbors.assign(c.neighbors().begin(), c.neighbors().end());
    chip.hbm_total_bytes = c.hbm_total_bytes();
    chip.hbm_used_bytes = c.hbm_used_bytes();
    chip.hbm_peak_bytes = c.hbm_peak_bytes();
    chip.hbm_largest_free_block = c.hbm_largest_free_block();
    chip.segment_count = c.segment_count();
    chip.session_count = c.session_count();
    chip.healthy = c.healthy();
    chip.drained = c.drained();
    chip.duty_cycle = c.duty_cycle();
    chip.busy_seconds = c.busy_seconds();
    chip.ops_executed = c.ops_executed();
    out.chips.push_back(std::move(chip));
  }
  for (const v1::IciLinkInfo& l : t.links()) {
    out.links.push_back(IciLinkInfo{
        static_cast<int>(l.a()), static_cast<int>(l.b()),
        static_cast<int>(l.axis()), l.bytes_a_to_b(), l.bytes_b_to_a()});
  }
  return out;
}

ProgramInfo FromProto(const v1::ProgramInfo& p) {
  return {p.id(),       p.name(),        static_cast<int>(p.chip()),
          p.records(),  p.calls(),       p.busy_seconds(),
          p.compiles(), p.last_compile()};
}

SessionInfo ConvertSession(const v1::SessionInfo& s) {
  SessionInfo out;
  out.id = s.id();
  out.allocation_id = s.allocation_id();
  out.pid = s.pid();
  out.uid = s.uid();
  out.command = s.command();
  out.client_name = s.client_name();
  out.hbm_bytes = s.hbm_bytes();
  for (const auto& [chip, bytes] : s.hbm_bytes_per_chip()) {
    out.hbm_bytes_per_chip[static_cast<int>(chip)] = bytes;
  }
  out.quota_bytes_per_chip = s.quota_bytes_per_chip();
  out.protocol_version = s.protocol_version();
  out.opened_unix_seconds = s.opened_unix_seconds();
  out.segment_count = s.segment_count();
  out.busy_seconds = s.busy_seconds();
  out.ops_executed = s.ops_executed();
  for (const auto& p : s.programs()) out.programs.push_back(FromProto(p));
  return out;
}

}  // namespace

std::string TopologyInfo::ShapeString() const {
  return absl::StrJoin(shape, "x");
}

// ---------------------------------------------------------------- Session

Session::Session(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

Session::~Session() { (void)Close(); }

absl::StatusOr<std::unique_ptr<Session>> Session::Open(ClientOptions options) {
  if (options.socket_path.empty()) options.socket_path = RuntimeSocketPath();
  auto impl = std::make_unique<Impl>();
  impl->options = options;
  absl::StatusOr<int> fd = ConnectUnix(options.socket_path, /*admin=*/false);
  if (!fd.ok()) return fd.status();
  std::shared_ptr<grpc::Channel> channel = ChannelOnFd(*fd);
  std::shared_ptr<v1::Runtime::Stub> stub = v1::Runtime::NewStub(channel);

  v1::OpenSessionRequest req;
  req.set_min_protocol_version(tpud::kMinProtocolVersion);
  req.set_max_protocol_version(tpud::kMaxProtocolVersion);
  req.set_client_name(options.client_name);
  if (options.allocation_token.empty() && getenv("TPUD_TOKEN") != nullptr) {
    options.allocation_token = getenv("TPUD_TOKEN");
  }
  req.set_allocation_token(options.allocation_token);
  v1::OpenSessionResponse resp;
  grpc::ClientContext ctx;
  grpc::Status st = stub->OpenSession(impl->Prepare(&ctx), req, &resp);
  if (!st.ok()) return Annotate(st, options.socket_path);
  impl->id = resp.session_id();
  impl->protocol_version = resp.protocol_version();
  impl->daemon_version = resp.daemon_version();
  impl->small_pool_bytes = resp.small_pool_bytes();
  if (absl::Status dp = impl->AttachDataPlane(resp.data_plane_token());
      !dp.ok()) {
    return dp;
  }
  {
    absl::MutexLock lock(&impl->mu);
    impl->channel = std::move(channel);
    impl->stub = std::move(stub);
    impl->open = true;
  }
  return std::unique_ptr<Session>(new Session(std::move(impl)));
}

uint64_t Session::id() const { return impl_->id; }
uint32_t Session::protocol_version() const { return impl_->protocol_version; }
const std::string& Session::daemon_version() const {
  return impl_->daemon_version;
}

uint64_t Session::small_pool_bytes() const { return impl_->small_pool_bytes; }
const std::string& Session::socket_path() const {
  return impl_->options.socket_path;
}

absl::StatusOr<TopologyInfo> Session::GetTopology() {
  Impl::Call call(impl_.get());
  v1::GetTopologyResponse resp;
  absl::StatusOr<std::shared_ptr<v1::Runtime::Stub>> stub = impl_->Stub();
  if (!stub.ok()) return stub.status();
  grpc::Status st = (*stub)->GetTopology(call.ctx(), {}, &resp);
  if (!st.ok()) return impl_->Annotate(st);
  return ConvertTopology(resp.topology());
}

absl::StatusOr<Segment> Session::Allocate(int chip, uint64_t bytes) {
  if (chip < 0) {
    return absl::InvalidArgumentError(absl::StrCat("no chip ", chip));
  }
  v1::AllocateSegmentRequest req;
  req.set_session_id(impl_->id);
  req.set_chip(static_cast<uint32_t>(chip));
  req.set_bytes(bytes);
  v1::AllocateSegmentResponse resp;
  Impl::Call call(impl_.get());
  absl::StatusOr<std::shared_ptr<v1::Runtime::Stub>> stub = impl_->Stub();
  if (!stub.ok()) return stub.status();
  grpc::Status st = (*stub)->AllocateSegment(call.ctx(), req, &resp);
  if (!st.ok()) return impl_->Annotate(st);
  Segment seg;
  seg.address = resp.segment().address();
  seg.chip = static_cast<int>(resp.segment().chip());
  seg.offset = resp.segment().offset();
  seg.size = resp.segment().size();
  seg.requested_bytes = resp.segment().requested_bytes();
  return seg;
}

absl::Status Session::Free(uint64_t address) {
  v1::FreeSegmentRequest req;
  req.set_session_id(impl_->id);
  req.set_address(address);
  v1::FreeSegmentResponse resp;
  Impl::Call call(impl_.get());
  absl::StatusOr<std::shared_ptr<v1::Runtime::Stub>> stub = impl_->Stub();
  if (!stub.ok()) return stub.status();
  grpc::Status st = (*stub)->FreeSegment(call.ctx(), req, &resp);
  if (!st.ok()) return impl_->Annotate(st);
  return absl::OkStatus();
}

absl::StatusOr<std::vector<ProgramInfo>> Session::GetPrograms() {
  v1::GetProgramsRequest req;
  req.set_session_id(impl_->id);
  v1::GetProgramsResponse resp;
  Impl::Call call(impl_.get());
  absl::StatusOr<std::shared_ptr<v1::Runtime::Stub>> stub = impl_->Stub();
  if (!stub.ok()) return stub.status();
  grpc::Status st = (*stub)->GetPrograms(call.ctx(), req, &resp);
  if (!st.ok()) return impl_->Annotate(st);
  std::vector<ProgramInfo> out;
  for (const v1::ProgramInfo& p : resp.programs()) out.push_back(FromProto(p));
  return out;
}

absl::StatusOr<MemoryStats> Session::GetMemoryStats() {
  v1::GetMemoryStatsRequest req;
  req.set_session_id(impl_->id);
  v1::GetMemoryStatsResponse resp;
  Impl::Call call(impl_.get());
  absl::StatusOr<std::shared_ptr<v1::Runtime::Stub>> stub = impl_->Stub();
  if (!stub.ok()) return stub.status();
  grpc::Status st = (*stub)->GetMemoryStats(call.ctx(), req, &resp);
  if (!st.ok()) return impl_->Annotate(st);
  MemoryStats out;
  out.quota_bytes_per_chip = resp.quota_bytes_per_chip();
  for (const v1::ChipMemoryStats& c : resp.chips()) {
    ChipMemoryStats m;
    m.chip = c.chip();
    m.session_bytes = c.session_bytes();
    m.session_peak_bytes = c.session_peak_bytes();
    m.session_segments = c.session_segments();
    m.chip_used_bytes = c.chip_used_bytes();
    m.chip_total_bytes = c.chip_total_bytes();
    m.chip_free_bytes = c.chip_free_bytes();
    m.chip_largest_free_block = c.chip_largest_free_block();
    m.chip_peak_bytes = c.chip_peak_bytes();
    m.drained = c.drained();
    out.chips.push_back(m);
  }
  return out;
}

absl::StatusOr<uint64_t> Session::JoinCommunicator(
    const std::string& key, int size, int rank, int chip,
    absl::Duration op_timeout, absl::Duration join_timeout) {
  if (size < 1 || rank < 0 || rank >= size || chip < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("rank ", rank, " of ", size, " on chip ", chip,
                     " is not a valid place in a communicator"));
  }
  v1::JoinCommunicatorRequest req;
  req.set_session_id(impl_->id);
  req.set_key(key);
  req.set_size(static_cast<uint32_t>(size));
  req.set_rank(static_cast<uint32_t>(rank));
  req.set_chip(static_cast<uint32_t>(chip));
  req.set_op_timeout_ms(static_cast<uint64_t>(
      std::max<int64_t>(1, absl::ToInt64Milliseconds(op_timeout))));
  req.set_join_timeout_ms(static_cast<uint64_t>(
      std::max<int64_t>(1, absl::ToInt64Milliseconds(join_timeout))));
  v1::JoinCommunicatorResponse resp;
  Impl::Call call(impl_.get());
  internal::SetDeadline(call.ctx(), join_timeout + absl::Seconds(10));
  absl::StatusOr<std::shared_ptr<v1::Runtime::Stub>> stub = impl_->Stub();
  if (!stub.ok()) return stub.status();
  grpc::Status st = (*stub)->JoinCommunicator(call.ctx(), req, &resp);
  if (!st.ok()) return impl_->Annotate(st);
  return resp.communicator_id();
}

absl::Status Session::LeaveCommunicator(uint64_t communicator) {
  v1::LeaveCommunicatorRequest req;
  req.set_session_id(impl_->id);
  req.set_communicator_id(communicator);
  v1::LeaveCommunicatorResponse resp;
  Impl::Call call(impl_.get());
  absl::StatusOr<std::shared_ptr<v1::Runtime::Stub>> stub = impl_->Stub();
  if (!stub.ok()) return stub.status();
  grpc::Status st = (*stub)->LeaveCommunicator(call.ctx(), req, &resp);
  if (!st.ok()) return impl_->Annotate(st);
  return absl::OkStatus();
}

absl::Status Session::Close() {
  std::shared_ptr<v1::Runtime::Stub> stub;
  std::shared_ptr<grpc::Channel> channel;
  {
    absl::MutexLock lock(&impl_->mu);
    if (!impl_->open) return absl::OkStatus();
    impl_->open = false;
    stub = std::move(impl_->stub);
    channel = std::move(impl_->channel);
  }
  v1::CloseSessionRequest req;
  req.set_session_id(impl_->id);
  v1::CloseSessionResponse resp;
  grpc::ClientContext ctx;
  SetDeadline(&ctx, absl::Seconds(5));
  grpc::Status st = stub->CloseSession(&ctx, req, &resp);
  // Dropping the channel (and the data-plane connection, in ~Impl) closes
  // the connections; the daemon would reclaim everything then anyway, so a
  // failed close loses nothing.
  if (!st.ok()) return Annotate(st, impl_->options.socket_path);
  return absl::OkStatus();
}

// ---------------------------------------------------------------- Admin

struct AdminClient::Impl {
  std::string path;
  absl::Duration timeout;
  std::shared_ptr<grpc::Channel> channel;
  std::unique_ptr<v1::Admin::Stub> stub;

  grpc::ClientContext* Prepare(grpc::ClientContext* ctx) {
    SetDeadline(ctx, timeout);
    return ctx;
  }
};

AdminClient::AdminClient(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
AdminClient::~AdminClient() = default;

absl::StatusOr<std::unique_ptr<AdminClient>> AdminClient::Connect(
    std::string admin_socket_path, absl::Duration call_timeout) {
  if (admin_socket_path.empty()) admin_socket_path = AdminSocketPath();
  absl::StatusOr<int> fd = ConnectUnix(admin_socket_path, /*admin=*/true);
  if (!fd.ok()) return fd.status();
  auto impl = std::make_unique<Impl>();
  impl->path = admin_socket_path;
  impl->timeout = call_timeout;
  impl->channel = ChannelOnFd(*fd);
  impl->stub = v1::Admin::NewStub(impl->channel);
  return std::unique_ptr<AdminClient>(new AdminClient(std::move(impl)));
}

namespace {

DaemonStatus ConvertStatus(const v1::GetStatusResponse& resp) {
  DaemonStatus out;
  out.topology = ConvertTopology(resp.topology());
  out.backend.kind = resp.backend().kind();
  out.backend.description = resp.backend().description();
  out.backend.plugin_path = resp.backend().plugin_path();
  out.backend.pjrt_api_version = resp.backend().pjrt_api_version();
  out.backend.platform = resp.backend().platform();
  for (const v1::SessionInfo& s : resp.sessions())
    out.sessions.push_back(ConvertSession(s));
  out.daemon_version = resp.daemon_version();
  out.uptime_seconds = resp.uptime_seconds();
  out.daemon_pid = resp.daemon_pid();
  out.default_quota_bytes_per_chip = resp.default_quota_bytes_per_chip();
  out.spin_ok = resp.spin_ok();
  out.wait_advice = resp.wait_advice();
  for (const v1::ExecutorInfo& e : resp.executors()) {
    ExecutorInfo info;
    info.index = static_cast<int>(e.index());
    info.chips.assign(e.chips().begin(), e.chips().end());
    info.pid = e.pid();
    info.ready = e.ready();
    info.restarts = e.restarts();
    info.busy_seconds = e.busy_seconds();
    info.ops_executed = e.ops_executed();
    info.unrung_wakes = e.unrung_wakes();
    info.duty_cycle = e.duty_cycle();
    info.programs_cached = e.programs_cached();
    info.device_buffer_bytes = e.device_buffer_bytes();
    info.intra_op_threads = static_cast<int>(e.intra_op_threads());
    info.intra_op_threads_max = static_cast<int>(e.intra_op_threads_max());
    info.busy = e.busy();
    for (const v1::ChipCompileStats& c : e.compile()) {
      ExecutorInfo::Compile compile;
      compile.chip = static_cast<int>(c.chip());
      compile.compiles = c.compiles();
      compile.compile_seconds = c.compile_seconds();
      compile.cache_hits = c.cache_hits();
      compile.collective_programs = c.collective_programs();
      compile.graph_programs = c.graph_programs();
      compile.disk_hits = c.disk_hits();
      compile.disk_stores = c.disk_stores();
      compile.compile_seconds_saved = c.compile_seconds_saved();
      info.compile.push_back(compile);
    }
    if (e.has_disk_cache() && e.disk_cache().enabled()) {
      const v1::CompileCacheOnDisk& d = e.disk_cache();
      info.disk_cache.enabled = true;
      info.disk_cache.entries = d.entries();
      info.disk_cache.bytes = d.bytes();
      info.disk_cache.max_bytes = d.max_bytes();
      info.disk_cache.rejected = d.rejected();
      info.disk_cache.write_errors = d.write_errors();
    }
    out.executors.push_back(std::move(info));
  }
  for (const v1::ExecutorRestart& r : resp.executor_restarts()) {
    ExecutorRestart rec;
    rec.unix_seconds = r.unix_seconds();
    rec.executor = static_cast<int>(r.executor());
    rec.chips.assign(r.chips().begin(), r.chips().end());
    rec.pid = r.pid();
    rec.reason = r.reason();
    rec.session_id = r.session_id();
    rec.op = r.op();
    rec.stream = static_cast<int>(r.stream());
    rec.chip = static_cast<int>(r.chip());
    rec.sequence = r.sequence();
    out.executor_restarts.push_back(std::move(rec));
  }
  out.collectives_run = resp.collectives_run();
  for (const v1::CommunicatorInfo& c : resp.communicators()) {
    CommunicatorInfo info;
    info.id = c.id();
    info.size = static_cast<int>(c.size());
    info.chips.assign(c.chips().begin(), c.chips().end());
    info.sessions.assign(c.sessions().begin(), c.sessions().end());
    info.ring.assign(c.ring().begin(), c.ring().end());
    info.failed = c.failed();
    info.failure = c.failure();
    info.groups_done = c.groups_done();
    info.bytes_moved = c.bytes_moved();
    out.communicators.push_back(std::move(info));
  }
  return out;
}

}  // namespace

absl::StatusOr<DaemonStatus> AdminClient::GetStatus() {
  grpc::ClientContext ctx;
  v1::GetStatusResponse resp;
  grpc::Status st = impl_->stub->GetStatus(impl_->Prepare(&ctx), {}, &resp);
  if (!st.ok()) return Annotate(st, impl_->path);
  return ConvertStatus(resp);
}

absl::Status AdminClient::Watch(
    double interval_seconds, uint32_t count,
    const std::function<bool(const DaemonStatus&)>& on_update) {
  // No deadline: the stream lasts as long as the caller wants updates.
  grpc::ClientContext ctx;
  v1::WatchRequest req;
  req.set_interval_seconds(interval_seconds);
  req.set_count(count);
  std::unique_ptr<grpc::ClientReader<v1::GetStatusResponse>> reader =
      impl_->stub->Watch(&ctx, req);
  v1::GetStatusResponse resp;
  while (reader->Read(&resp)) {
    if (!on_update(ConvertStatus(resp))) {
      ctx.TryCancel();
      break;
    }
  }
  grpc::Status st = reader->Finish();
  if (!st.ok() && st.error_code() != grpc::StatusCode::CANCELLED)
    return Annotate(st, impl_->path);
  return absl::OkStatus();
}

absl::StatusOr<std::vector<SessionInfo>> AdminClient::ListSessions() {
  grpc::ClientContext ctx;
  v1::ListSessionsResponse resp;
  grpc::Status st = impl_->stub->ListSessions(impl_->Prepare(&ctx), {}, &resp);
  if (!st.ok()) return Annotate(st, impl_->path);
  std::vector<SessionInfo> out;
  for (const v1::SessionInfo& s : resp.sessions())
    out.push_back(ConvertSession(s));
  return out;
}

absl::StatusOr<uint64_t> AdminClient::KillSession(uint64_t session_id) {
  grpc::ClientContext ctx;
  v1::KillSessionRequest req;
  req.set_session_id(session_id);
  v1::KillSessionResponse resp;
  grpc::Status st = impl_->stub->KillSession(impl_->Prepare(&ctx), req, &resp);
  if (!st.ok()) return Annotate(st, impl_->path);
  return resp.reclaimed_bytes();
}

absl::Status AdminClient::SetSessionQuota(uint64_t session_id, uint64_t quota) {
  grpc::ClientContext ctx;
  v1::SetQuotaRequest req;
  req.set_session_id(session_id);
  req.set_quota_bytes_per_chip(quota);
  v1::SetQuotaResponse resp;
  grpc::Status st = impl_->stub->SetQuota(impl_->Prepare(&ctx), req, &resp);
  return st.ok() ? absl::OkStatus() : Annotate(st, impl_->path);
}

absl::Status AdminClient::SetDefaultQuota(uint64_t quota) {
  grpc::ClientContext ctx;
  v1::SetQuotaRequest req;
  req.set_apply_to_default(true);
  req.set_quota_bytes_per_chip(quota);
  v1::SetQuotaResponse resp;
  grpc::Status st = impl_->stub->SetQuota(impl_->Prepare(&ctx), req, &resp);
  return st.ok() ? absl::OkStatus() : Annotate(st, impl_->path);
}

absl::Status AdminClient::DrainChip(int chip) {
  if (chip < 0)
    return absl::InvalidArgumentError(absl::StrCat("no chip ", chip));
  grpc::ClientContext ctx;
  v1::DrainChipRequest req;
  req.set_chip(static_cast<uint32_t>(chip));
  v1::DrainChipResponse resp;
  grpc::Status st = impl_->stub->DrainChip(impl_->Prepare(&ctx), req, &resp);
  return st.ok() ? absl::OkStatus() : Annotate(st, impl_->path);
}

absl::Status AdminClient::UndrainChip(int chip) {
  if (chip < 0)
    return absl::InvalidArgumentError(absl::StrCat("no chip ", chip));
  grpc::ClientContext ctx;
  v1::UndrainChipRequest req;
  req.set_chip(static_cast<uint32_t>(chip));
  v1::UndrainChipResponse resp;
  grpc::Status st = impl_->stub->UndrainChip(impl_->Prepare(&ctx), req, &resp);
  return st.ok() ? absl::OkStatus() : Annotate(st, impl_->path);
}

absl::StatusOr<HealthReport> AdminClient::Health() {
  grpc::ClientContext ctx;
  v1::HealthResponse resp;
  grpc::Status st = impl_->stub->Health(impl_->Prepare(&ctx), {}, &resp);
  if (!st.ok()) return Annotate(st, impl_->path);
  HealthReport out;
  out.serving = resp.serving();
  out.daemon_version = resp.daemon_version();
  for (const v1::ChipHealth& c : resp.chips()) {
    out.chips.push_back(
        {static_cast<int>(c.chip()), c.healthy(), c.drained(), c.detail()});
  }
  return out;
}

absl::StatusOr<CreatedAllocation> AdminClient::CreateAllocation(
    const std::vector<int>& chips, const std::vector<uint64_t>& quota_bytes,
    const std::string& name) {
  v1::CreateAllocationRequest req;
  for (int c : chips) {
    if (c < 0) return absl::InvalidArgumentError(absl::StrCat("no chip ", c));
    req.add_chips(static_cast<uint32_t>(c));
  }
  for (uint64_t q : quota_bytes) req.add_chip_quota_bytes(q);
  req.set_name(name);
  grpc::ClientContext ctx;
  v1::CreateAllocationResponse resp;
  grpc::Status st =
      impl_->stub->CreateAllocation(impl_->Prepare(&ctx), req, &resp);
  if (!st.ok()) return Annotate(st, impl_->path);
  return CreatedAllocation{resp.id(), resp.token()};
}

namespace {

// Admin.ReleaseAllocation with `req` (a token or an id) on `impl`'s stub.
template <typename Impl>
absl::Status SendRelease(Impl& impl, const v1::ReleaseAllocationRequest& req) {
  grpc::ClientContext ctx;
  v1::ReleaseAllocationResponse resp;
  grpc::Status st =
      impl.stub->ReleaseAllocation(impl.Prepare(&ctx), req, &resp);
  return st.ok() ? absl::OkStatus() : Annotate(st, impl.path);
}

}  // namespace

absl::Status AdminClient::ReleaseAllocation(const std::string& token) {
  v1::ReleaseAllocationRequest req;
  req.set_token(token);
  return SendRelease(*impl_, req);
}

absl::Status AdminClient::ReleaseAllocationById(uint64_t id) {
  v1::ReleaseAllocationRequest req;
  req.set_id(id);
  return SendRelease(*impl_, req);
}

absl::StatusOr<std::vector<AllocationInfo>> AdminClient::ListAllocations() {
  grpc::ClientContext ctx;
  v1::ListAllocationsResponse resp;
  grpc::Status st =
      impl_->stub->ListAllocations(impl_->Prepare(&ctx), {}, &resp);
  if (!st.ok()) return Annotate(st, impl_->path);
  std::vector<AllocationInfo> out;
  for (const v1::AllocationInfo& a : resp.allocations()) {
    AllocationInfo info;
    info.id = a.id();
    info.name = a.name();
    for (const v1::AllocationChip& c : a.chips()) {
      info.chips.push_back({static_cast<int>(c.chip()), c.quota_bytes()});
    }
    info.created_unix_seconds = a.created_unix_seconds();
    info.session_count = static_cast<int>(a.session_count());
    out.push_back(std::move(info));
  }
  return out;
}

}  // namespace tpu
