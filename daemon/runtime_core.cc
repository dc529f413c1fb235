#include "daemon/runtime_core.h"

#include <algorithm>
#include <fstream>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "proto/protocol.h"
#include "tpu/device_address.h"
#include "tpu/units.h"

namespace tpud {

using ::tpu::FormatBytes;

namespace {

std::string RandomToken() {
  std::string token(16, '\0');
  std::ifstream urandom("/dev/urandom", std::ios::binary);
  urandom.read(token.data(), token.size());
  return token;
}

}  // namespace

uint64_t SessionSnapshot::total_bytes() const {
  uint64_t total = 0;
  for (uint64_t b : bytes_per_chip) total += b;
  return total;
}

absl::StatusOr<std::unique_ptr<RuntimeCore>> RuntimeCore::Create(Topology topology,
                                                                 Options options) {
  if (topology.num_chips() > tpu::kMaxChips) {
    return absl::InvalidArgumentError(absl::StrCat(
        "topology ", topology.name(), " has ", topology.num_chips(),
        " chips; a host serves at most ", tpu::kMaxChips));
  }
  if (topology.hbm_bytes_per_chip() > tpu::kDeviceAddressOffsetMask) {
    return absl::InvalidArgumentError("HBM per chip too large for device addresses");
  }
  std::unique_ptr<RuntimeCore> core(new RuntimeCore(std::move(topology), options));
  absl::MutexLock lock(&core->mu_);
  for (int c = 0; c < core->topology_.num_chips(); ++c) {
    auto chip = std::make_unique<Chip>(core->topology_.hbm_bytes_per_chip());
    if (core->back_with_memory_) {
      auto arena = HbmArena::Create(c, core->topology_.hbm_bytes_per_chip());
      if (!arena.ok()) return arena.status();
      chip->arena = *std::move(arena);
      const uint64_t capacity = core->topology_.hbm_bytes_per_chip();
      absl::StatusOr<SharedMapping> owners = SharedMapping::Create(
          absl::StrCat("tpud-owners-chip-", c), PageOwnerTable::BytesFor(capacity),
          /*seal=*/false);
      if (!owners.ok()) return owners.status();
      chip->owners_memory = *std::move(owners);
      chip->owners_memory.CloseFd();
      chip->owners = PageOwnerTable(chip->owners_memory.data(), capacity);
    }
    core->chips_.push_back(std::move(chip));
  }
  return core;
}

RuntimeCore::RuntimeCore(Topology topology, Options options)
    : topology_(std::move(topology)),
      back_with_memory_(options.back_with_memory),
      default_quota_(options.default_quota_bytes_per_chip),
      max_sessions_per_uid_(options.max_sessions_per_uid) {}

absl::StatusOr<OpenedSession> RuntimeCore::OpenSession(ConnectionId connection,
                                                       const PeerIdentity& peer,
                                                       uint32_t client_min_version,
                                                       uint32_t client_max_version,
                                                       std::string client_name) {
  if (client_min_version > client_max_version) {
    return absl::InvalidArgumentError(
        absl::StrCat("protocol version range [", client_min_version, ", ",
                     client_max_version, "] is empty"));
  }
  uint32_t version = std::min(client_max_version, kMaxProtocolVersion);
  if (version < client_min_version || version < kMinProtocolVersion) {
    return absl::FailedPreconditionError(absl::StrCat(
        "no common protocol version: this client speaks tpud protocol [", client_min_version,
        ", ", client_max_version, "], tpud ", kDaemonVersion, " speaks [",
        kMinProtocolVersion, ", ", kMaxProtocolVersion,
        "]; install the torch_tpu / libtpuclient built with this tpud, or run the tpud the "
        "client was built for"));
  }
  if (client_name.size() > 256) client_name.resize(256);
  absl::MutexLock lock(&mu_);
  if (auto it = session_by_connection_.find(connection);
      it != session_by_connection_.end()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "this connection already has session ", it->second,
        "; a connection carries one session (open another connection)"));
  }
  if (max_sessions_per_uid_ != 0) {
    uint32_t held = 0;
    for (const auto& [id, s] : sessions_) held += s->peer.uid == peer.uid ? 1 : 0;
    if (held >= max_sessions_per_uid_) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "uid ", peer.uid, " already holds ", held, " tpud sessions, the most one user may "
          "hold (--max_sessions_per_uid=", max_sessions_per_uid_,
          "); end some (exit idle processes), or ask an administrator to raise the limit"));
    }
  }
  auto session = std::make_unique<Session>();
  session->id = next_session_id_++;
  session->connection = connection;
  session->peer = peer;
  session->client_name = std::move(client_name);
  session->protocol_version = version;
  session->quota_bytes_per_chip = default_quota_;
  session->opened = absl::Now();
  session->bytes_per_chip.assign(chips_.size(), 0);
  session->peak_bytes_per_chip.assign(chips_.size(), 0);
  session->segments_per_chip.assign(chips_.size(), 0);
  session->data_plane_token = RandomToken();
  if (!free_tags_.empty()) {
    session->tag = free_tags_.back();
    free_tags_.pop_back();
  } else {
    session->tag = next_tag_++;
  }
  OpenedSession opened{session->id, session->tag, version, session->quota_bytes_per_chip,
                       session->data_plane_token};
  session_by_connection_[connection] = session->id;
  sessions_[session->id] = std::move(session);
  return opened;
}

absl::StatusOr<uint32_t> RuntimeCore::SessionTag(ConnectionId caller, uint64_t session_id) {
  absl::MutexLock lock(&mu_);
  absl::StatusOr<Session*> s = FindSessionLocked(caller, session_id);
  if (!s.ok()) return s.status();
  return (*s)->tag;
}

absl::StatusOr<RuntimeCore::Session*> RuntimeCore::FindSessionLocked(
    ConnectionId caller, uint64_t session_id) {
  auto it = sessions_.find(session_id);
  if (it == sessions_.end()) {
    return absl::NotFoundError(absl::StrCat(
        "no session ", session_id,
        " (it was never opened, or it ended: closed, killed, or its connection dropped)"));
  }
  if (it->second->connection != caller) {
    return absl::PermissionDeniedError(absl::StrCat(
        "session ", session_id,
        " belongs to another client connection; a session can only be used "
        "from the connection that opened it"));
  }
  return it->second.get();
}

absl::Status RuntimeCore::CheckChipLocked(int chip) const {
  if (chip < 0 || chip >= static_cast<int>(chips_.size())) {
    return absl::InvalidArgumentError(absl::StrCat(
        "no chip ", chip, ": this host (", topology_.name(), ") has chips 0..",
        chips_.size() - 1));
  }
  return absl::OkStatus();
}

void RuntimeCore::FreeBlockLocked(int chip, uint64_t offset) {
  Chip& c = *chips_[chip];
  absl::StatusOr<HbmBlock> block = c.allocator.Free(offset);
  // The session's segment map and the allocator are updated together under
  // mu_, so a segment the session holds is always allocated.
  if (block.ok() && c.arena != nullptr) {
    (void)c.arena->Release(block->offset, block->size);
  }
}

void RuntimeCore::UnlistLocked(Session& s, const SegmentGrant& seg) {
  s.segments.erase(seg.address);
  s.bytes_per_chip[seg.chip] -= seg.size;
  s.segments_per_chip[seg.chip] -= 1;
  Chip& c = *chips_[seg.chip];
  if (c.arena != nullptr) c.owners.Clear(seg.offset, seg.size);
}

void RuntimeCore::ReleaseBlocks(uint32_t tag, const std::vector<SegmentGrant>& blocks) {
  if (blocks.empty()) return;
  // No executor may still be inside an op that resolved these pages.
  if (memory_fence_) memory_fence_(tag);
  {
    absl::MutexLock lock(&mu_);
    for (const SegmentGrant& seg : blocks) FreeBlockLocked(seg.chip, seg.offset);
  }
  if (release_hook_) {
    for (const SegmentGrant& seg : blocks) release_hook_(seg.address, seg.size);
  }
}

absl::StatusOr<ReclaimResult> RuntimeCore::EndSessionById(uint64_t session_id) {
  {
    absl::MutexLock lock(&mu_);
    auto it = sessions_.find(session_id);
    if (it == sessions_.end() || it->second->ending) {
      return absl::NotFoundError(absl::StrCat("no session ", session_id));
    }
    it->second->ending = true;
  }
  // The data plane marks the session dead and detaches it from the executors.
  if (session_end_hook_) session_end_hook_(session_id);
  ReclaimResult result;
  std::vector<SegmentGrant> blocks;
  uint32_t tag = 0;
  {
    absl::MutexLock lock(&mu_);
    auto it = sessions_.find(session_id);
    if (it == sessions_.end()) return result;
    Session& s = *it->second;
    tag = s.tag;
    while (!s.segments.empty()) {
      const SegmentGrant seg = s.segments.begin()->second;
      UnlistLocked(s, seg);
      blocks.push_back(seg);
      result.bytes += seg.size;
    }
    result.segments = blocks.size();
    result.sessions = 1;
    session_by_connection_.erase(s.connection);
    sessions_.erase(it);
  }
  ReleaseBlocks(tag, blocks);
  absl::MutexLock lock(&mu_);
  // Only now may another session carry this tag.
  if (tag != 0) free_tags_.push_back(tag);
  return result;
}

absl::StatusOr<uint64_t> RuntimeCore::CloseSession(ConnectionId caller,
                                                   uint64_t session_id) {
  {
    absl::MutexLock lock(&mu_);
    absl::StatusOr<Session*> s = FindSessionLocked(caller, session_id);
    if (!s.ok()) return s.status();
  }
  absl::StatusOr<ReclaimResult> r = EndSessionById(session_id);
  if (!r.ok()) return r.status();
  return r->bytes;
}

ReclaimResult RuntimeCore::EndConnection(ConnectionId connection) {
  uint64_t session_id = 0;
  {
    absl::MutexLock lock(&mu_);
    auto it = session_by_connection_.find(connection);
    if (it == session_by_connection_.end()) return {};
    session_id = it->second;
  }
  absl::StatusOr<ReclaimResult> r = EndSessionById(session_id);
  return r.ok() ? *r : ReclaimResult{};
}

ReclaimResult RuntimeCore::EndSession(uint64_t session_id) {
  absl::StatusOr<ReclaimResult> r = EndSessionById(session_id);
  return r.ok() ? *r : ReclaimResult{};
}

absl::StatusOr<SegmentGrant> RuntimeCore::Allocate(ConnectionId caller,
                                                   uint64_t session_id, int chip,
                                                   uint64_t bytes) {
  absl::MutexLock lock(&mu_);
  absl::StatusOr<Session*> found = FindSessionLocked(caller, session_id);
  if (!found.ok()) return found.status();
  return AllocateLocked(**found, chip, bytes);
}

absl::StatusOr<SegmentGrant> RuntimeCore::AllocateLocked(Session& s, int chip,
                                                         uint64_t bytes) {
  const uint64_t session_id = s.id;
  if (absl::Status st = CheckChipLocked(chip); !st.ok()) return st;
  if (bytes == 0) {
    return absl::InvalidArgumentError("cannot allocate a segment of 0 bytes");
  }
  Chip& c = *chips_[chip];
  if (c.drained) {
    return absl::FailedPreconditionError(absl::StrCat(
        "chip ", chip,
        " is drained by an administrator: it refuses new allocations (existing "
        "segments keep working); use another chip, or undrain it with `tpuctl "
        "undrain ",
        chip, "`"));
  }
  if (!c.healthy) {
    return absl::UnavailableError(absl::StrCat("chip ", chip, " is unhealthy"));
  }
  const HbmAllocatorStats stats = c.allocator.stats();
  const uint64_t rounded = HbmAllocator::RoundUp(bytes, kHbmGranularity);
  const uint64_t held = s.bytes_per_chip[chip];
  if (s.quota_bytes_per_chip != 0 &&
      (rounded == 0 || held > s.quota_bytes_per_chip ||
       rounded > s.quota_bytes_per_chip - held)) {
    return absl::ResourceExhaustedError(absl::StrFormat(
        "HBM quota exceeded on chip %d: asked %s, session %d holds %s of its %s "
        "quota; free memory, or ask an administrator to raise it (tpuctl quota "
        "%d SIZE)",
        chip, FormatBytes(bytes), session_id, FormatBytes(held),
        FormatBytes(s.quota_bytes_per_chip), session_id));
  }
  std::optional<HbmBlock> block = c.allocator.Allocate(bytes, session_id);
  if (!block.has_value()) {
    std::string quota = s.quota_bytes_per_chip == 0
                            ? std::string("no quota")
                            : absl::StrCat("quota ", FormatBytes(s.quota_bytes_per_chip));
    return absl::ResourceExhaustedError(absl::StrFormat(
        "HBM exhausted on chip %d: asked %s, session %d holds %s (%s); chip has "
        "%s in use, free %s of %s (largest free block %s)",
        chip, FormatBytes(bytes), session_id, FormatBytes(held), quota,
        FormatBytes(stats.used_bytes), FormatBytes(stats.free_bytes),
        FormatBytes(stats.capacity_bytes), FormatBytes(stats.largest_free_block)));
  }
  SegmentGrant grant;
  grant.chip = chip;
  grant.offset = block->offset;
  grant.size = block->size;
  grant.requested_bytes = bytes;
  grant.address = tpu::MakeDeviceAddress(chip, block->offset);
  s.bytes_per_chip[chip] += grant.size;
  s.segments_per_chip[chip] += 1;
  s.peak_bytes_per_chip[chip] =
      std::max(s.peak_bytes_per_chip[chip], s.bytes_per_chip[chip]);
  s.segments[grant.address] = grant;
  // Executors may use the segment from now on.
  if (c.arena != nullptr) c.owners.Assign(grant.offset, grant.size, s.tag);
  return grant;
}

absl::StatusOr<uint64_t> RuntimeCore::Free(ConnectionId caller, uint64_t session_id,
                                           uint64_t address) {
  SegmentGrant seg;
  uint32_t tag = 0;
  {
    absl::MutexLock lock(&mu_);
    absl::StatusOr<Session*> found = FindSessionLocked(caller, session_id);
    if (!found.ok()) return found.status();
    Session& s = **found;
    const int chip = tpu::DeviceAddressChip(address);
    if (chip < 0 || chip >= static_cast<int>(chips_.size())) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "0x%x is not a device address on this host (chips 0..%d)", address,
          chips_.size() - 1));
    }
    auto it = s.segments.find(address);
    if (it == s.segments.end()) {
      const uint64_t offset = tpu::DeviceAddressOffset(address);
      const HbmBlock* other = chips_[chip]->allocator.FindContaining(offset);
      if (other != nullptr && other->owner != session_id) {
        return absl::PermissionDeniedError(absl::StrFormat(
            "device address 0x%x (chip %d, offset 0x%x) belongs to another "
            "session; a session can only free its own segments",
            address, chip, offset));
      }
      return absl::InvalidArgumentError(absl::StrFormat(
          "no segment of session %d starts at device address 0x%x (chip %d, "
          "offset 0x%x)",
          session_id, address, chip, offset));
    }
    seg = it->second;
    tag = s.tag;
    UnlistLocked(s, seg);
  }
  // An op of this session that is running now may still use the segment.
  ReleaseBlocks(tag, {seg});
  return seg.size;
}

absl::StatusOr<std::vector<ChipMemoryView>> RuntimeCore::MemoryStats(
    ConnectionId caller, uint64_t session_id) {
  absl::MutexLock lock(&mu_);
  absl::StatusOr<Session*> found = FindSessionLocked(caller, session_id);
  if (!found.ok()) return found.status();
  const Session& s = **found;
  const std::vector<uint64_t>& segments = s.segments_per_chip;
  std::vector<ChipMemoryView> views;
  for (size_t c = 0; c < chips_.size(); ++c) {
    ChipMemoryView v;
    v.chip = static_cast<int>(c);
    v.session_quota_bytes = s.quota_bytes_per_chip;
    v.session_bytes = s.bytes_per_chip[c];
    v.session_peak_bytes = s.peak_bytes_per_chip[c];
    v.session_segments = segments[c];
    v.drained = chips_[c]->drained;
    v.hbm = chips_[c]->allocator.stats();
    views.push_back(v);
  }
  return views;
}

std::vector<ChipSnapshot> RuntimeCore::Chips() const {
  absl::MutexLock lock(&mu_);
  std::vector<ChipSnapshot> out;
  for (size_t c = 0; c < chips_.size(); ++c) {
    ChipSnapshot snap;
    snap.id = static_cast<int>(c);
    snap.healthy = chips_[c]->healthy;
    snap.drained = chips_[c]->drained;
    snap.hbm = chips_[c]->allocator.stats();
    for (const auto& [id, s] : sessions_) {
      if (s->bytes_per_chip[c] > 0) ++snap.session_count;
    }
    out.push_back(snap);
  }
  return out;
}

SessionSnapshot RuntimeCore::SnapshotLocked(const Session& s) const {
  SessionSnapshot snap;
  snap.id = s.id;
  snap.connection = s.connection;
  snap.peer = s.peer;
  snap.client_name = s.client_name;
  snap.protocol_version = s.protocol_version;
  snap.quota_bytes_per_chip = s.quota_bytes_per_chip;
  snap.opened = s.opened;
  snap.bytes_per_chip = s.bytes_per_chip;
  snap.peak_bytes_per_chip = s.peak_bytes_per_chip;
  for (uint64_t n : s.segments_per_chip) snap.segment_count += n;
  return snap;
}

std::vector<SessionSnapshot> RuntimeCore::Sessions() const {
  absl::MutexLock lock(&mu_);
  std::vector<SessionSnapshot> out;
  for (const auto& [id, s] : sessions_) out.push_back(SnapshotLocked(*s));
  std::sort(out.begin(), out.end(),
            [](const SessionSnapshot& a, const SessionSnapshot& b) { return a.id < b.id; });
  return out;
}

absl::StatusOr<uint64_t> RuntimeCore::KillSession(uint64_t session_id,
                                                  ConnectionId* connection) {
  {
    absl::MutexLock lock(&mu_);
    auto it = sessions_.find(session_id);
    if (it == sessions_.end()) {
      return absl::NotFoundError(absl::StrCat("no session ", session_id));
    }
    if (connection != nullptr) *connection = it->second->connection;
  }
  absl::StatusOr<ReclaimResult> r = EndSessionById(session_id);
  if (!r.ok()) return r.status();
  return r->bytes;
}

char* RuntimeCore::ChipHostBase(int chip) const {
  absl::MutexLock lock(&mu_);
  if (chip < 0 || chip >= static_cast<int>(chips_.size()) || chips_[chip]->arena == nullptr) {
    return nullptr;
  }
  return chips_[chip]->arena->base();
}

std::pair<char*, uint64_t> RuntimeCore::OwnerTableMemory(int chip) const {
  absl::MutexLock lock(&mu_);
  if (chip < 0 || chip >= static_cast<int>(chips_.size())) return {nullptr, 0};
  return {chips_[chip]->owners_memory.data(), chips_[chip]->owners_memory.size()};
}

void RuntimeCore::SetSessionEndHook(std::function<void(uint64_t)> hook) {
  session_end_hook_ = std::move(hook);
}

void RuntimeCore::SetMemoryFence(std::function<void(uint32_t)> fence) {
  memory_fence_ = std::move(fence);
}

void RuntimeCore::SetReleaseHook(std::function<void(uint64_t, uint64_t)> hook) {
  release_hook_ = std::move(hook);
}

ConnectionId RuntimeCore::ConnectionOf(uint64_t session_id) const {
  absl::MutexLock lock(&mu_);
  auto it = sessions_.find(session_id);
  return it == sessions_.end() ? 0 : it->second->connection;
}

absl::StatusOr<uint32_t> RuntimeCore::AttachDataPlane(uint64_t session_id,
                                                      absl::string_view token,
                                                      const PeerIdentity& peer) {
  absl::MutexLock lock(&mu_);
  auto it = sessions_.find(session_id);
  // The same answer for "no such session" and "wrong token": a guesser
  // learns nothing about which sessions exist.
  if (it == sessions_.end() || it->second->ending ||
      it->second->data_plane_token.size() != token.size() ||
      it->second->data_plane_token != token || it->second->peer.uid != peer.uid) {
    return absl::PermissionDeniedError(absl::StrCat(
        "data-plane attach refused for session ", session_id,
        ": no such session for this user, or a wrong token"));
  }
  if (it->second->data_plane_attached) {
    return absl::FailedPreconditionError(
        absl::StrCat("session ", session_id, " already has a data-plane connection"));
  }
  it->second->data_plane_attached = true;
  return it->second->tag;
}

absl::StatusOr<SegmentGrant> RuntimeCore::AllocateForResult(uint64_t session_id, int chip,
                                                            uint64_t bytes) {
  absl::MutexLock lock(&mu_);
  auto it = sessions_.find(session_id);
  if (it == sessions_.end() || it->second->ending) {
    return absl::NotFoundError(absl::StrCat("session ", session_id, " ended"));
  }
  return AllocateLocked(*it->second, chip, bytes);
}

void RuntimeCore::FreeResult(uint64_t session_id, uint64_t address) {
  // No fence: the failed op that asked for this memory is done with it, and
  // no other op can name it (its address never reached the client).
  absl::MutexLock lock(&mu_);
  auto it = sessions_.find(session_id);
  if (it == sessions_.end()) return;
  auto s = it->second->segments.find(address);
  if (s == it->second->segments.end()) return;
  const SegmentGrant seg = s->second;
  UnlistLocked(*it->second, seg);
  FreeBlockLocked(seg.chip, seg.offset);
}

absl::Status RuntimeCore::SetSessionQuota(uint64_t session_id,
                                          uint64_t quota_bytes_per_chip) {
  absl::MutexLock lock(&mu_);
  auto it = sessions_.find(session_id);
  if (it == sessions_.end()) {
    return absl::NotFoundError(absl::StrCat("no session ", session_id));
  }
  // A quota below current holdings is allowed: it blocks new allocations
  // until the session frees enough, and never takes memory away.
  it->second->quota_bytes_per_chip = quota_bytes_per_chip;
  return absl::OkStatus();
}

void RuntimeCore::SetDefaultQuota(uint64_t quota_bytes_per_chip) {
  absl::MutexLock lock(&mu_);
  default_quota_ = quota_bytes_per_chip;
}

uint64_t RuntimeCore::default_quota() const {
  absl::MutexLock lock(&mu_);
  return default_quota_;
}

absl::Status RuntimeCore::SetDrained(int chip, bool drained) {
  absl::MutexLock lock(&mu_);
  if (absl::Status st = CheckChipLocked(chip); !st.ok()) return st;
  chips_[chip]->drained = drained;
  return absl::OkStatus();
}

}  // namespace tpud
