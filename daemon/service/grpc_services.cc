#include "daemon/service/grpc_services.h"

#include <spdlog/spdlog.h>
#include <unistd.h>

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "proto/protocol.h"
#include "tpu/shm_layout.h"
#include "tpu/units.h"

namespace tpud {
namespace {

// The connection a call arrived on. Calls that did not come through a
// connection tpud accepted itself cannot be attributed and are refused.
absl::StatusOr<ConnectionInfo> CallerOf(const ConnectionTable& table,
                                        grpc::ServerContext* ctx) {
  std::optional<ConnectionInfo> info = table.Lookup(ctx->peer());
  if (!info.has_value()) {
    return absl::UnauthenticatedError(
        absl::StrCat("call from unknown peer ", ctx->peer()));
  }
  if (!info->refused.empty())
    return absl::ResourceExhaustedError(info->refused);
  return *info;
}

void FillProgram(const ProgramActivity& p, v1::ProgramInfo* pi) {
  pi->set_id(p.id);
  pi->set_name(p.name);
  pi->set_chip(static_cast<uint32_t>(p.chip));
  pi->set_records(p.records);
  pi->set_calls(p.calls);
  pi->set_busy_seconds(p.busy_ns / 1e9);
  pi->set_compiles(p.compiles);
  pi->set_last_compile(p.last_compile);
}

void FillSession(const SessionSnapshot& s, DataPlane* data_plane,
                 v1::SessionInfo* out) {
  if (data_plane != nullptr) {
    SessionActivity a = data_plane->Activity(s.id);
    out->set_busy_seconds(a.busy_ns / 1e9);
    out->set_ops_executed(a.ops);
    for (const ProgramActivity& p : a.programs)
      FillProgram(p, out->add_programs());
  }
  out->set_id(s.id);
  out->set_allocation_id(s.allocation_id);
  out->set_pid(s.peer.pid);
  out->set_uid(s.peer.uid);
  out->set_command(s.peer.command);
  out->set_client_name(s.client_name);
  out->set_hbm_bytes(s.total_bytes());
  for (size_t c = 0; c < s.bytes_per_chip.size(); ++c) {
    if (s.bytes_per_chip[c] > 0) {
      (*out->mutable_hbm_bytes_per_chip())[static_cast<uint32_t>(c)] =
          s.bytes_per_chip[c];
    }
  }
  out->set_quota_bytes_per_chip(s.quota_bytes_per_chip);
  out->set_protocol_version(s.protocol_version);
  out->set_opened_unix_seconds(
      absl::ToDoubleSeconds(s.opened - absl::UnixEpoch()));
  out->set_segment_count(s.segment_count);
}

// Chip ids are unsigned on the wire; anything past int range is simply "no
// such chip" for the core.
int ChipIndex(uint32_t wire_chip) {
  return wire_chip > 0x7fffffffu ? -1 : static_cast<int>(wire_chip);
}

}  // namespace

void FillTopology(const RuntimeCore& core, DataPlane* data_plane,
                  const CommunicatorRegistry* comms,
                  const BackendStatus& backend, v1::TopologyInfo* out) {
  if (comms != nullptr) {
    for (const LinkStats& l : comms->Links()) {
      v1::IciLinkInfo* li = out->add_links();
      li->set_a(l.a);
      li->set_b(l.b);
      li->set_axis(l.axis);
      li->set_bytes_a_to_b(l.bytes_a_to_b);
      li->set_bytes_b_to_a(l.bytes_b_to_a);
    }
  }
  const Topology& t = core.topology();
  out->set_name(t.name());
  out->set_simulated(backend.kind != "pjrt");
  out->set_backend(backend.kind);
  for (const std::string& op : backend.lowered_ops) out->add_lowered_ops(op);
  out->set_fuses(backend.fuses);
  v1::GenerationFacts* g = out->mutable_generation();
  const GenerationFacts& f = t.facts();
  g->set_name(f.name);
  g->set_hbm_bytes_per_chip(t.hbm_bytes_per_chip());
  g->set_hbm_bandwidth_gbytes_per_s(f.hbm_bandwidth_gbytes_per_s);
  g->set_ici_bandwidth_gbytes_per_s(f.ici_bandwidth_gbytes_per_s);
  g->set_peak_bf16_tflops(f.peak_bf16_tflops);
  g->set_tensorcores_per_chip(f.tensorcores_per_chip);
  g->set_torus_dims(f.torus_dims);
  for (int d : t.shape()) out->add_shape(d);
  for (bool w : t.wraparound()) out->add_wraparound(w);
  for (const ChipSnapshot& c : core.Chips()) {
    v1::ChipInfo* chip = out->add_chips();
    chip->set_id(c.id);
    for (int x : t.coords(c.id)) chip->add_coords(x);
    for (int n : t.Neighbors(c.id)) chip->add_neighbors(n);
    chip->set_hbm_total_bytes(c.hbm.capacity_bytes);
    chip->set_hbm_used_bytes(c.hbm.used_bytes);
    chip->set_hbm_peak_bytes(c.hbm.peak_used_bytes);
    chip->set_hbm_largest_free_block(c.hbm.largest_free_block);
    chip->set_segment_count(c.hbm.segment_count);
    chip->set_session_count(c.session_count);
    chip->set_healthy(c.healthy);
    chip->set_drained(c.drained);
    if (data_plane != nullptr) {
      ChipUsage u = data_plane->ChipActivity(c.id);
      chip->set_duty_cycle(u.duty_cycle);
      chip->set_busy_seconds(u.busy_ns / 1e9);
      chip->set_ops_executed(u.ops);
    }
  }
}

// ---------------------------------------------------------------- Runtime

grpc::Status RuntimeServiceImpl::JoinCommunicator(
    grpc::ServerContext* ctx, const v1::JoinCommunicatorRequest* req,
    v1::JoinCommunicatorResponse* resp) {
  absl::StatusOr<ConnectionInfo> caller = CallerOf(*connections_, ctx);
  if (!caller.ok()) return ToGrpcStatus(caller.status());
  if (comms_ == nullptr) {
    return ToGrpcStatus(
        absl::FailedPreconditionError("this tpud runs no collectives"));
  }
  absl::StatusOr<uint32_t> tag =
      core_->SessionTag(caller->id, req->session_id());
  if (!tag.ok()) return ToGrpcStatus(tag.status());
  JoinRequest j;
  j.session_id = req->session_id();
  j.tag = *tag;
  j.pid = caller->peer.pid;
  j.key = req->key();
  j.size = static_cast<int>(std::min<uint32_t>(req->size(), 1u << 20));
  j.rank = static_cast<int>(std::min<uint32_t>(req->rank(), 1u << 20));
  j.chip = static_cast<int>(std::min<uint32_t>(req->chip(), 1u << 20));
  constexpr uint64_t kMaxMs = uint64_t{7} * 24 * 3600 * 1000;
  if (req->op_timeout_ms() != 0) {
    j.op_timeout = absl::Milliseconds(std::min(req->op_timeout_ms(), kMaxMs));
  }
  if (req->join_timeout_ms() != 0) {
    j.join_timeout =
        absl::Milliseconds(std::min(req->join_timeout_ms(), kMaxMs));
  }
  // The call's own deadline bounds the wait too.
  const absl::Time call_deadline = absl::FromChrono(ctx->deadline());
  if (call_deadline < absl::Now() + j.join_timeout) {
    j.join_timeout =
        std::max(absl::ZeroDuration(), call_deadline - absl::Now());
  }
  absl::StatusOr<uint64_t> id = comms_->Join(j);
  if (!id.ok()) return ToGrpcStatus(id.status());
  resp->set_communicator_id(*id);
  return grpc::Status::OK;
}

grpc::Status RuntimeServiceImpl::LeaveCommunicator(
    grpc::ServerContext* ctx, const v1::LeaveCommunicatorRequest* req,
    v1::LeaveCommunicatorResponse*) {
  absl::StatusOr<ConnectionInfo> caller = CallerOf(*connections_, ctx);
  if (!caller.ok()) return ToGrpcStatus(caller.status());
  if (comms_ == nullptr) return grpc::Status::OK;
  absl::StatusOr<uint32_t> tag =
      core_->SessionTag(caller->id, req->session_id());
  if (!tag.ok()) return ToGrpcStatus(tag.status());
  return ToGrpcStatus(comms_->Leave(req->session_id(), req->communicator_id()));
}

grpc::Status RuntimeServiceImpl::GetTopology(grpc::ServerContext*,
                                             const v1::GetTopologyRequest*,
                                             v1::GetTopologyResponse* resp) {
  FillTopology(*core_, data_plane_, comms_, backend_, resp->mutable_topology());
  return grpc::Status::OK;
}

grpc::Status RuntimeServiceImpl::OpenSession(grpc::ServerContext* ctx,
                                             const v1::OpenSessionRequest* req,
                                             v1::OpenSessionResponse* resp) {
  absl::StatusOr<ConnectionInfo> caller = CallerOf(*connections_, ctx);
  if (!caller.ok()) return ToGrpcStatus(caller.status());
  absl::StatusOr<OpenedSession> opened = core_->OpenSession(
      caller->id, caller->peer, req->min_protocol_version(),
      req->max_protocol_version(), req->client_name(), req->allocation_token());
  if (!opened.ok()) return ToGrpcStatus(opened.status());
  spdlog::info("session {} opened by pid {} uid {} ({}), protocol v{}",
               opened->session_id, caller->peer.pid, caller->peer.uid,
               caller->peer.command, opened->protocol_version);
  resp->set_session_id(opened->session_id);
  resp->set_protocol_version(opened->protocol_version);
  resp->set_daemon_version(kDaemonVersion);
  resp->set_quota_bytes_per_chip(opened->quota_bytes_per_chip);
  resp->set_data_plane_token(opened->data_plane_token);
  resp->set_small_pool_bytes(opened->small_pool_bytes);
  for (int c : opened->allowed_chips)
    resp->add_allowed_chips(static_cast<uint32_t>(c));
  return grpc::Status::OK;
}

grpc::Status RuntimeServiceImpl::CloseSession(
    grpc::ServerContext* ctx, const v1::CloseSessionRequest* req,
    v1::CloseSessionResponse* resp) {
  absl::StatusOr<ConnectionInfo> caller = CallerOf(*connections_, ctx);
  if (!caller.ok()) return ToGrpcStatus(caller.status());
  absl::StatusOr<uint64_t> bytes =
      core_->CloseSession(caller->id, req->session_id());
  if (!bytes.ok()) return ToGrpcStatus(bytes.status());
  spdlog::info("session {} closed; reclaimed {}", req->session_id(),
               tpu::FormatBytes(*bytes));
  resp->set_reclaimed_bytes(*bytes);
  return grpc::Status::OK;
}

grpc::Status RuntimeServiceImpl::AllocateSegment(
    grpc::ServerContext* ctx, const v1::AllocateSegmentRequest* req,
    v1::AllocateSegmentResponse* resp) {
  absl::StatusOr<ConnectionInfo> caller = CallerOf(*connections_, ctx);
  if (!caller.ok()) return ToGrpcStatus(caller.status());
  absl::StatusOr<SegmentGrant> grant = core_->Allocate(
      caller->id, req->session_id(), ChipIndex(req->chip()), req->bytes());
  if (!grant.ok()) return ToGrpcStatus(grant.status());
  v1::Segment* seg = resp->mutable_segment();
  seg->set_address(grant->address);
  seg->set_chip(grant->chip);
  seg->set_offset(grant->offset);
  seg->set_size(grant->size);
  seg->set_requested_bytes(grant->requested_bytes);
  return grpc::Status::OK;
}

grpc::Status RuntimeServiceImpl::FreeSegment(grpc::ServerContext* ctx,
                                             const v1::FreeSegmentRequest* req,
                                             v1::FreeSegmentResponse* resp) {
  absl::StatusOr<ConnectionInfo> caller = CallerOf(*connections_, ctx);
  if (!caller.ok()) return ToGrpcStatus(caller.status());
  absl::StatusOr<uint64_t> freed =
      core_->Free(caller->id, req->session_id(), req->address());
  if (!freed.ok()) return ToGrpcStatus(freed.status());
  resp->set_freed_bytes(*freed);
  return grpc::Status::OK;
}

grpc::Status RuntimeServiceImpl::GetMemoryStats(
    grpc::ServerContext* ctx, const v1::GetMemoryStatsRequest* req,
    v1::GetMemoryStatsResponse* resp) {
  absl::StatusOr<ConnectionInfo> caller = CallerOf(*connections_, ctx);
  if (!caller.ok()) return ToGrpcStatus(caller.status());
  absl::StatusOr<std::vector<ChipMemoryView>> views =
      core_->MemoryStats(caller->id, req->session_id());
  if (!views.ok()) return ToGrpcStatus(views.status());
  for (const ChipMemoryView& v : *views) {
    v1::ChipMemoryStats* c = resp->add_chips();
    c->set_chip(v.chip);
    c->set_session_bytes(v.session_bytes);
    c->set_session_peak_bytes(v.session_peak_bytes);
    c->set_session_segments(v.session_segments);
    c->set_chip_used_bytes(v.hbm.used_bytes);
    c->set_chip_total_bytes(v.hbm.capacity_bytes);
    c->set_chip_free_bytes(v.hbm.free_bytes);
    c->set_chip_largest_free_block(v.hbm.largest_free_block);
    c->set_chip_peak_bytes(v.hbm.peak_used_bytes);
    c->set_drained(v.drained);
  }
  // Quotas differ per chip only for sessions of an allocation: the largest.
  uint64_t quota = 0;
  for (const ChipMemoryView& v : *views)
    quota = std::max(quota, v.session_quota_bytes);
  resp->set_quota_bytes_per_chip(quota);
  return grpc::Status::OK;
}

grpc::Status RuntimeServiceImpl::GetPrograms(grpc::ServerContext* ctx,
                                             const v1::GetProgramsRequest* req,
                                             v1::GetProgramsResponse* resp) {
  absl::StatusOr<ConnectionInfo> caller = CallerOf(*connections_, ctx);
  if (!caller.ok()) return ToGrpcStatus(caller.status());
  // Only the caller's own session.
  absl::StatusOr<uint32_t> own =
      core_->SessionTag(caller->id, req->session_id());
  if (!own.ok()) return ToGrpcStatus(own.status());
  if (data_plane_ == nullptr) return grpc::Status::OK;
  for (const ProgramActivity& p :
       data_plane_->Activity(req->session_id()).programs)
    FillProgram(p, resp->add_programs());
  return grpc::Status::OK;
}

// ---------------------------------------------------------------- Admin

grpc::Status AdminServiceImpl::CheckAdmin(grpc::ServerContext* ctx) const {
  absl::StatusOr<ConnectionInfo> caller = CallerOf(*connections_, ctx);
  if (!caller.ok()) return ToGrpcStatus(caller.status());
  if (!caller->admin) {
    return ToGrpcStatus(absl::PermissionDeniedError(
        "administrative calls are only served on the admin socket"));
  }
  return grpc::Status::OK;
}

grpc::Status AdminServiceImpl::GetStatus(grpc::ServerContext* ctx,
                                         const v1::GetStatusRequest*,
                                         v1::GetStatusResponse* resp) {
  if (grpc::Status st = CheckAdmin(ctx); !st.ok()) return st;
  FillStatus(resp);
  return grpc::Status::OK;
}

grpc::Status AdminServiceImpl::Watch(
    grpc::ServerContext* ctx, const v1::WatchRequest* req,
    grpc::ServerWriter<v1::GetStatusResponse>* writer) {
  if (grpc::Status st = CheckAdmin(ctx); !st.ok()) return st;
  const double seconds =
      req->interval_seconds() == 0 ? 1.0 : req->interval_seconds();
  if (!(seconds >= 0.1 && seconds <= 3600)) {
    return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                        absl::StrCat("watch interval ", seconds,
                                     " s: give 0.1 to 3600 seconds"));
  }
  const absl::Duration interval = absl::Seconds(seconds);
  absl::Time next = absl::Now();
  for (uint32_t sent = 0; req->count() == 0 || sent < req->count(); ++sent) {
    if (sent > 0) {
      // Updates keep to the interval's grid, however long one took to send.
      next += interval;
      while (!ctx->IsCancelled() && !stopping_.HasBeenNotified()) {
        const absl::Duration left = next - absl::Now();
        if (left <= absl::ZeroDuration()) break;
        stopping_.WaitForNotificationWithTimeout(
            std::min(left, absl::Milliseconds(200)));
      }
    }
    if (ctx->IsCancelled() || stopping_.HasBeenNotified()) break;
    v1::GetStatusResponse resp;
    FillStatus(&resp);
    if (!writer->Write(resp)) break;  // the client went away
  }
  return grpc::Status::OK;
}

void AdminServiceImpl::FillStatus(v1::GetStatusResponse* resp) {
  FillTopology(*core_, data_plane_, comms_, backend_, resp->mutable_topology());
  // The lowered ops' names are for clients (torch_tpu); status stays short.
  resp->mutable_topology()->clear_lowered_ops();
  for (const SessionSnapshot& s : core_->Sessions()) {
    FillSession(s, data_plane_, resp->add_sessions());
  }
  resp->set_daemon_version(kDaemonVersion);
  v1::BackendInfo* b = resp->mutable_backend();
  b->set_kind(backend_.kind);
  b->set_description(backend_.description);
  b->set_plugin_path(backend_.plugin_path);
  b->set_pjrt_api_version(backend_.pjrt_api_version);
  b->set_platform(backend_.platform);
  for (const std::string& k : backend_.device_kinds) b->add_device_kinds(k);
  resp->set_uptime_seconds(absl::ToDoubleSeconds(absl::Now() - started_));
  resp->set_daemon_pid(getpid());
  resp->set_default_quota_bytes_per_chip(core_->default_quota());
  if (data_plane_ != nullptr) {
    const uint32_t advice = data_plane_->wait_advice();
    resp->set_spin_ok(advice == tpu::kWaitSpin);
    resp->set_wait_advice(advice == tpu::kWaitSpin    ? "spin"
                          : advice == tpu::kWaitYield ? "yield"
                                                      : "sleep");
  }
  if (pool_ != nullptr) {
    for (const ExecutorInfo& e : pool_->Executors()) {
      v1::ExecutorInfo* out = resp->add_executors();
      out->set_index(e.index);
      for (int c : e.chips) out->add_chips(c);
      out->set_pid(e.pid);
      out->set_ready(e.ready);
      out->set_restarts(e.restarts);
      out->set_busy_seconds(e.busy_ns / 1e9);
      out->set_ops_executed(e.ops);
      out->set_unrung_wakes(e.unrung_wakes);
      out->set_duty_cycle(e.duty_cycle);
      out->set_programs_cached(e.programs_cached);
      out->set_device_buffer_bytes(e.device_buffer_bytes);
      out->set_intra_op_threads(e.intra_op_threads);
      out->set_intra_op_threads_max(e.intra_op_threads_max);
      out->set_busy(e.busy);
      if (e.disk_cache.enabled) {
        v1::CompileCacheOnDisk* d = out->mutable_disk_cache();
        d->set_enabled(true);
        d->set_entries(e.disk_cache.entries);
        d->set_bytes(e.disk_cache.bytes);
        d->set_max_bytes(e.disk_cache.max_bytes);
        d->set_rejected(e.disk_cache.rejected);
        d->set_write_errors(e.disk_cache.write_errors);
      }
      for (size_t i = 0; i < e.compile.size() && i < e.chips.size(); ++i) {
        v1::ChipCompileStats* c = out->add_compile();
        c->set_chip(e.chips[i]);
        c->set_compiles(e.compile[i].compiles);
        c->set_compile_seconds(e.compile[i].compile_ns / 1e9);
        c->set_cache_hits(e.compile[i].hits);
        c->set_collective_programs(e.compile[i].collectives);
        c->set_graph_programs(e.compile[i].graphs);
        c->set_disk_hits(e.compile[i].disk_hits);
        c->set_disk_stores(e.compile[i].disk_stores);
        c->set_compile_seconds_saved(e.compile[i].saved_ns / 1e9);
      }
    }
    for (const ExecutorRestart& r : pool_->Restarts()) {
      v1::ExecutorRestart* out = resp->add_executor_restarts();
      out->set_unix_seconds(absl::ToDoubleSeconds(r.when - absl::UnixEpoch()));
      out->set_executor(r.executor);
      for (int c : r.chips) out->add_chips(c);
      out->set_pid(r.pid);
      out->set_reason(r.reason);
      out->set_session_id(r.session_id);
      out->set_op(r.op);
      out->set_stream(tpu::RingStream(r.ring));
      out->set_chip(tpu::RingChip(r.ring));
      out->set_sequence(r.sequence);
    }
  }
  if (comms_ != nullptr) {
    resp->set_collectives_run(comms_->collectives_run());
    for (const CommunicatorInfo& c : comms_->Communicators()) {
      v1::CommunicatorInfo* out = resp->add_communicators();
      out->set_id(c.id);
      out->set_size(c.size);
      for (int chip : c.chips) out->add_chips(chip);
      for (uint64_t sid : c.sessions) out->add_sessions(sid);
      for (int r : c.ring) out->add_ring(r);
      out->set_failed(c.failed);
      out->set_failure(c.failure);
      out->set_groups_done(c.groups_done);
      out->set_bytes_moved(c.bytes_moved);
    }
  }
}

grpc::Status AdminServiceImpl::ListSessions(grpc::ServerContext* ctx,
                                            const v1::ListSessionsRequest*,
                                            v1::ListSessionsResponse* resp) {
  if (grpc::Status st = CheckAdmin(ctx); !st.ok()) return st;
  for (const SessionSnapshot& s : core_->Sessions()) {
    FillSession(s, data_plane_, resp->add_sessions());
  }
  return grpc::Status::OK;
}

grpc::Status AdminServiceImpl::KillSession(grpc::ServerContext* ctx,
                                           const v1::KillSessionRequest* req,
                                           v1::KillSessionResponse* resp) {
  if (grpc::Status st = CheckAdmin(ctx); !st.ok()) return st;
  ConnectionId connection = 0;
  absl::StatusOr<uint64_t> bytes =
      core_->KillSession(req->session_id(), &connection);
  if (!bytes.ok()) return ToGrpcStatus(bytes.status());
  spdlog::warn("session {} killed by an administrator; reclaimed {}",
               req->session_id(), tpu::FormatBytes(*bytes));
  hangup_(connection);
  resp->set_reclaimed_bytes(*bytes);
  return grpc::Status::OK;
}

grpc::Status AdminServiceImpl::SetQuota(grpc::ServerContext* ctx,
                                        const v1::SetQuotaRequest* req,
                                        v1::SetQuotaResponse*) {
  if (grpc::Status st = CheckAdmin(ctx); !st.ok()) return st;
  if (req->apply_to_default()) {
    core_->SetDefaultQuota(req->quota_bytes_per_chip());
    spdlog::info("default quota set to {}",
                 req->quota_bytes_per_chip() == 0
                     ? std::string("none")
                     : tpu::FormatBytes(req->quota_bytes_per_chip()));
    return grpc::Status::OK;
  }
  absl::Status st =
      core_->SetSessionQuota(req->session_id(), req->quota_bytes_per_chip());
  if (st.ok()) {
    spdlog::info("session {} quota set to {}", req->session_id(),
                 req->quota_bytes_per_chip() == 0
                     ? std::string("none")
                     : tpu::FormatBytes(req->quota_bytes_per_chip()));
  }
  return ToGrpcStatus(st);
}

grpc::Status AdminServiceImpl::DrainChip(grpc::ServerContext* ctx,
                                         const v1::DrainChipRequest* req,
                                         v1::DrainChipResponse*) {
  if (grpc::Status st = CheckAdmin(ctx); !st.ok()) return st;
  absl::Status st = core_->SetDrained(ChipIndex(req->chip()), true);
  if (st.ok()) spdlog::warn("chip {} drained", req->chip());
  return ToGrpcStatus(st);
}

grpc::Status AdminServiceImpl::UndrainChip(grpc::ServerContext* ctx,
                                           const v1::UndrainChipRequest* req,
                                           v1::UndrainChipResponse*) {
  if (grpc::Status st = CheckAdmin(ctx); !st.ok()) return st;
  absl::Status st = core_->SetDrained(ChipIndex(req->chip()), false);
  if (st.ok()) spdlog::info("chip {} undrained", req->chip());
  return ToGrpcStatus(st);
}

grpc::Status AdminServiceImpl::Health(grpc::ServerContext* ctx,
                                      const v1::HealthRequest*,
                                      v1::HealthResponse* resp) {
  if (grpc::Status st = CheckAdmin(ctx); !st.ok()) return st;
  bool all_healthy = true;
  for (const ChipSnapshot& c : core_->Chips()) {
    v1::ChipHealth* h = resp->add_chips();
    h->set_chip(c.id);
    h->set_healthy(c.healthy);
    h->set_drained(c.drained);
    h->set_detail(c.healthy ? "simulated chip ok" : "unhealthy");
    all_healthy = all_healthy && c.healthy;
  }
  resp->set_serving(all_healthy);
  resp->set_daemon_version(kDaemonVersion);
  return grpc::Status::OK;
}

grpc::Status AdminServiceImpl::CreateAllocation(
    grpc::ServerContext* ctx, const v1::CreateAllocationRequest* req,
    v1::CreateAllocationResponse* resp) {
  if (grpc::Status st = CheckAdmin(ctx); !st.ok()) return st;
  AllocationSpec spec;
  for (uint32_t c : req->chips()) spec.chips.push_back(ChipIndex(c));
  spec.chip_quota_bytes.assign(req->chip_quota_bytes().begin(),
                               req->chip_quota_bytes().end());
  spec.quota_bytes_per_chip = req->quota_bytes_per_chip();
  spec.name = req->name();
  absl::StatusOr<CreatedAllocation> created =
      core_->CreateAllocation(std::move(spec));
  if (!created.ok()) return ToGrpcStatus(created.status());
  spdlog::info("allocation {} created for \"{}\"", created->id, req->name());
  resp->set_token(created->token);
  resp->set_id(created->id);
  return grpc::Status::OK;
}

grpc::Status AdminServiceImpl::ReleaseAllocation(
    grpc::ServerContext* ctx, const v1::ReleaseAllocationRequest* req,
    v1::ReleaseAllocationResponse*) {
  if (grpc::Status st = CheckAdmin(ctx); !st.ok()) return st;
  if (req->token().empty() == (req->id() == 0)) {
    return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                        "give an allocation's token or its id, not both");
  }
  absl::Status st = req->id() != 0 ? core_->ReleaseAllocationById(req->id())
                                   : core_->ReleaseAllocation(req->token());
  if (st.ok() && req->id() != 0) {
    spdlog::info("allocation {} released by id", req->id());
  }
  return ToGrpcStatus(st);
}

grpc::Status AdminServiceImpl::ListAllocations(
    grpc::ServerContext* ctx, const v1::ListAllocationsRequest*,
    v1::ListAllocationsResponse* resp) {
  if (grpc::Status st = CheckAdmin(ctx); !st.ok()) return st;
  for (const AllocationSnapshot& a : core_->Allocations()) {
    v1::AllocationInfo* out = resp->add_allocations();
    out->set_id(a.id);
    out->set_name(a.name);
    for (size_t i = 0; i < a.chips.size(); ++i) {
      v1::AllocationChip* c = out->add_chips();
      c->set_chip(static_cast<uint32_t>(a.chips[i]));
      c->set_quota_bytes(a.quota_bytes[i]);
    }
    out->set_created_unix_seconds(
        absl::ToDoubleSeconds(a.created - absl::UnixEpoch()));
    out->set_session_count(static_cast<uint32_t>(a.session_count));
  }
  return grpc::Status::OK;
}

}  // namespace tpud
