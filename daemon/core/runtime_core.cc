#include "daemon/core/runtime_core.h"

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

// A printable secret (it travels in environment variables): 128 random bits
// in hex.
std::string HexToken() {
  const std::string raw = RandomToken();
  static constexpr char kHex[] = "0123456789abcdef";
  std::string out;
  for (unsigned char c : raw) {
    out.push_back(kHex[c >> 4]);
    out.push_back(kHex[c & 15]);
  }
  return out;
}

std::string ChipList(const std::vector<int>& chips) {
  std::string out;
  for (size_t i = 0; i < chips.size(); ++i)
    absl::StrAppend(&out, i ? ", " : "", chips[i]);
  return out;
}

}  // namespace

uint64_t SessionSnapshot::total_bytes() const {
  uint64_t total = 0;
  for (uint64_t b : bytes_per_chip) total += b;
  return total;
}

absl::StatusOr<std::unique_ptr<RuntimeCore>> RuntimeCore::Create(
    Topology topology, Options options) {
  if (topology.num_chips() > tpu::kMaxChips) {
    return absl::InvalidArgumentError(absl::StrCat(
        "topology ", topology.name(), " has ", topology.num_chips(),
        " chips; a host serves at most ", tpu::kMaxChips));
  }
  if (topology.hbm_bytes_per_chip() > tpu::kDeviceAddressOffsetMask) {
    return absl::InvalidArgumentError(
        "HBM per chip too large for device addresses");
  }
  std::unique_ptr<RuntimeCore> core(
      new RuntimeCore(std::move(topology), options));
  absl::MutexLock lock(&core->mu_);
  for (int c = 0; c < core->topology_.num_chips(); ++c) {
    auto chip = std::make_unique<Chip>(core->topology_.hbm_bytes_per_chip());
    if (core->back_with_memory_) {
      auto arena = HbmArena::Create(c, core->topology_.hbm_bytes_per_chip());
      if (!arena.ok()) return arena.status();
      chip->arena = *std::move(arena);
      const uint64_t capacity = core->topology_.hbm_bytes_per_chip();
      absl::StatusOr<SharedMapping> owners =
          SharedMapping::Create(absl::StrCat("tpud-owners-chip-", c),
                                PageOwnerTable::BytesFor(capacity),
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

absl::StatusOr<OpenedSession> RuntimeCore::OpenSession(
    ConnectionId connection, const PeerIdentity& peer,
    uint32_t client_min_version, uint32_t client_max_version,
    std::string client_name, absl::string_view allocation_token) {
  if (client_min_version > client_max_version) {
    return absl::InvalidArgumentError(
        absl::StrCat("protocol version range [", client_min_version, ", ",
                     client_max_version, "] is empty"));
  }
  uint32_t version = std::min(client_max_version, kMaxProtocolVersion);
  if (version < client_min_version || version < kMinProtocolVersion) {
    return absl::FailedPreconditionError(absl::StrCat(
        "no common protocol version: this client speaks tpud protocol [",
        client_min_version, ", ", client_max_version, "], tpud ",
        kDaemonVersion, " speaks [", kMinProtocolVersion, ", ",
        kMaxProtocolVersion,
        "]; install the torch_tpu / libtpuclient built with this tpud, or run "
        "the tpud the "
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
    for (const auto& [id, s] : sessions_)
      held += s->peer.uid == peer.uid ? 1 : 0;
    if (held >= max_sessions_per_uid_) {
      return absl::ResourceExhaustedError(
          absl::StrCat("uid ", peer.uid, " already holds ", held,
                       " tpud sessions, the most one user may "
                       "hold (--max_sessions_per_uid=",
                       max_sessions_per_uid_,
                       "); end some (exit idle processes), or ask an "
                       "administrator to raise the limit"));
    }
  }
  const Allocation* allocation = nullptr;
  if (!allocation_token.empty()) {
    auto a = allocations_.find(allocation_token);
    if (a == allocations_.end()) {
      return absl::PermissionDeniedError(
          "the allocation token given (TPUD_TOKEN) names no allocation of this "
          "tpud: it was "
          "released, or tpud restarted since the device plugin made it; "
          "restart the pod to get "
          "a fresh allocation, or unset TPUD_TOKEN to run without one");
    }
    allocation = &a->second;
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
  if (allocation != nullptr) {
    AllocationUsage& usage = allocation_usage_[allocation->id];
    if (usage.held.empty()) usage.held.assign(chips_.size(), 0);
    ++usage.sessions;
    session->allocation_id = allocation->id;
    session->chip_allowed.assign(chips_.size(), false);
    session->chip_quota.assign(chips_.size(), 0);
    session->quota_bytes_per_chip = 0;
    for (size_t i = 0; i < allocation->chips.size(); ++i) {
      session->chip_allowed[allocation->chips[i]] = true;
      session->chip_quota[allocation->chips[i]] = allocation->quota_bytes[i];
      session->quota_bytes_per_chip =
          std::max(session->quota_bytes_per_chip, allocation->quota_bytes[i]);
    }
  }
  session->data_plane_token = RandomToken();
  if (!free_tags_.empty()) {
    session->tag = free_tags_.back();
    free_tags_.pop_back();
  } else {
    session->tag = next_tag_++;
  }
  OpenedSession opened;
  opened.session_id = session->id;
  opened.tag = session->tag;
  opened.protocol_version = version;
  opened.quota_bytes_per_chip = session->quota_bytes_per_chip;
  if (allocation != nullptr) opened.allowed_chips = allocation->chips;
  opened.data_plane_token = session->data_plane_token;
  opened.small_pool_bytes = small_pool_bytes_;
  session_by_connection_[connection] = session->id;
  sessions_[session->id] = std::move(session);
  ++counts_.opened;
  return opened;
}

absl::StatusOr<uint32_t> RuntimeCore::SessionTag(ConnectionId caller,
                                                 uint64_t session_id) {
  absl::MutexLock lock(&mu_);
  absl::StatusOr<Session*> s = FindSessionLocked(caller, session_id);
  if (!s.ok()) return s.status();
  return (*s)->tag;
}

absl::StatusOr<RuntimeCore::Session*> RuntimeCore::FindSessionLocked(
    ConnectionId caller, uint64_t session_id) {
  auto it = sessions_.find(session_id);
  if (it == sessions_.end()) {
    return absl::NotFoundError(
        absl::StrCat("no session ", session_id,
                     " (it was never opened, or it ended: closed, killed, or "
                     "its connection dropped)"));
  }
  if (it->second->connection != caller) {
    return absl::PermissionDeniedError(absl::StrCat(
        "session ", session_id,
        " belongs to another client connection; a session can only be used "
        "from the connection that opened it"));
  }
  return it->second.get();
}

uint64_t RuntimeCore::QuotaOn(const Session& s, int chip) {
  if (!s.chip_quota.empty()) return s.chip_quota[chip];
  return s.quota_bytes_per_chip;
}

absl::StatusOr<CreatedAllocation> RuntimeCore::CreateAllocation(
    AllocationSpec spec) {
  absl::MutexLock lock(&mu_);
  if (spec.chips.empty()) {
    return absl::InvalidArgumentError("an allocation needs at least one chip");
  }
  if (!spec.chip_quota_bytes.empty() &&
      spec.chip_quota_bytes.size() != spec.chips.size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("an allocation of ", spec.chips.size(),
                     " chips was given ", spec.chip_quota_bytes.size(),
                     " per-chip quotas; give one per chip, or none"));
  }
  std::vector<bool> seen(chips_.size(), false);
  for (int chip : spec.chips) {
    if (absl::Status st = CheckChipLocked(chip); !st.ok()) return st;
    if (seen[chip]) {
      return absl::InvalidArgumentError(
          absl::StrCat("chip ", chip, " is listed twice in the allocation"));
    }
    seen[chip] = true;
  }
  Allocation a;
  a.id = next_allocation_id_++;
  a.token = HexToken();
  a.name = std::move(spec.name);
  a.chips = std::move(spec.chips);
  a.quota_bytes =
      spec.chip_quota_bytes.empty()
          ? std::vector<uint64_t>(a.chips.size(), spec.quota_bytes_per_chip)
          : std::move(spec.chip_quota_bytes);
  a.created = absl::Now();
  CreatedAllocation created{a.id, a.token};
  allocations_[a.token] = std::move(a);
  if (absl::Status st = SaveAllocationsLocked(); !st.ok()) {
    allocations_.erase(created.token);
    --next_allocation_id_;
    return absl::UnavailableError(
        absl::StrCat("the allocation was not made: ", st.message()));
  }
  return created;
}

absl::Status RuntimeCore::ReleaseAllocation(absl::string_view token) {
  absl::MutexLock lock(&mu_);
  auto it = allocations_.find(token);
  if (it == allocations_.end()) {
    return absl::NotFoundError(
        "no allocation has this token (already released?)");
  }
  return ReleaseAllocationLocked(it);
}

absl::Status RuntimeCore::ReleaseAllocationById(uint64_t id) {
  absl::MutexLock lock(&mu_);
  for (auto it = allocations_.begin(); it != allocations_.end(); ++it) {
    if (it->second.id == id) return ReleaseAllocationLocked(it);
  }
  return absl::NotFoundError(
      absl::StrCat("no allocation ", id, " (already released?)"));
}

absl::Status RuntimeCore::ReleaseAllocationLocked(
    absl::flat_hash_map<std::string, Allocation>::iterator it) {
  Allocation released = std::move(it->second);
  allocations_.erase(it);
  if (absl::Status st = SaveAllocationsLocked(); !st.ok()) {
    allocations_[released.token] = std::move(released);
    return absl::UnavailableError(
        absl::StrCat("the allocation was not released: ", st.message()));
  }
  return absl::OkStatus();
}

AllocationState RuntimeCore::AllocationStateLocked() const {
  AllocationState state;
  state.topology = topology_.name();
  state.num_chips = static_cast<int>(chips_.size());
  state.next_id = next_allocation_id_;
  for (const auto& [token, a] : allocations_) state.allocations.push_back(a);
  std::sort(
      state.allocations.begin(), state.allocations.end(),
      [](const Allocation& x, const Allocation& y) { return x.id < y.id; });
  return state;
}

absl::Status RuntimeCore::SaveAllocationsLocked() const {
  if (!allocation_saver_) return absl::OkStatus();
  return allocation_saver_(AllocationStateLocked());
}

absl::Status RuntimeCore::SetAllocationSaver(AllocationSaver saver) {
  absl::MutexLock lock(&mu_);
  if (absl::Status st = saver(AllocationStateLocked()); !st.ok()) return st;
  allocation_saver_ = std::move(saver);
  return absl::OkStatus();
}

absl::Status RuntimeCore::RestoreAllocations(const AllocationState& state) {
  absl::MutexLock lock(&mu_);
  if (!allocations_.empty()) {
    return absl::FailedPreconditionError(
        "allocations are restored only before any is made");
  }
  absl::flat_hash_map<std::string, Allocation> restored;
  absl::flat_hash_map<uint64_t, bool> ids;
  uint64_t next_id = state.next_id;
  for (const AllocationRecord& a : state.allocations) {
    if (a.chips.empty() || a.chips.size() != a.quota_bytes.size()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "allocation ", a.id, " has no chips or no quota per chip"));
    }
    std::vector<bool> seen(chips_.size(), false);
    for (int chip : a.chips) {
      if (absl::Status st = CheckChipLocked(chip); !st.ok()) return st;
      if (seen[chip]) {
        return absl::InvalidArgumentError(
            absl::StrCat("allocation ", a.id, " lists chip ", chip, " twice"));
      }
      seen[chip] = true;
    }
    if (a.token.empty() || !restored.emplace(a.token, a).second ||
        !ids.emplace(a.id, true).second) {
      return absl::InvalidArgumentError(absl::StrCat(
          "allocation ", a.id, " repeats another's id or token, or has none"));
    }
    next_id = std::max(next_id, a.id + 1);
  }
  allocations_ = std::move(restored);
  next_allocation_id_ = std::max<uint64_t>(next_id, 1);
  return absl::OkStatus();
}

std::vector<AllocationSnapshot> RuntimeCore::Allocations() const {
  absl::MutexLock lock(&mu_);
  std::vector<AllocationSnapshot> out;
  for (const auto& [token, a] : allocations_) {
    AllocationSnapshot snap;
    snap.id = a.id;
    snap.name = a.name;
    snap.chips = a.chips;
    snap.quota_bytes = a.quota_bytes;
    snap.created = a.created;
    if (auto u = allocation_usage_.find(a.id); u != allocation_usage_.end()) {
      snap.session_count = u->second.sessions;
    }
    out.push_back(std::move(snap));
  }
  std::sort(out.begin(), out.end(),
            [](const AllocationSnapshot& x, const AllocationSnapshot& y) {
              return x.id < y.id;
            });
  return out;
}

absl::Status RuntimeCore::CheckChipLocked(int chip) const {
  if (chip < 0 || chip >= static_cast<int>(chips_.size())) {
    return absl::InvalidArgumentError(
        absl::StrCat("no chip ", chip, ": this host (", topology_.name(),
                     ") has chips 0..", chips_.size() - 1));
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
  if (s.allocation_id != 0) {
    if (auto u = allocation_usage_.find(s.allocation_id);
        u != allocation_usage_.end()) {
      u->second.held[seg.chip] -= seg.size;
    }
  }
  s.segments_per_chip[seg.chip] -= 1;
  Chip& c = *chips_[seg.chip];
  if (c.arena != nullptr) c.owners.Clear(seg.offset, seg.size);
}

void RuntimeCore::ReleaseBlocks(uint32_t tag,
                                const std::vector<SegmentGrant>& blocks) {
  if (blocks.empty()) return;
  // No executor may still be inside an op that resolved these pages.
  if (memory_fence_) memory_fence_(tag);
  {
    absl::MutexLock lock(&mu_);
    for (const SegmentGrant& seg : blocks)
      FreeBlockLocked(seg.chip, seg.offset);
  }
  if (release_hook_) {
    for (const SegmentGrant& seg : blocks) release_hook_(seg.address, seg.size);
  }
}

absl::StatusOr<ReclaimResult> RuntimeCore::EndSessionById(uint64_t session_id,
                                                          EndReason reason) {
  {
    absl::MutexLock lock(&mu_);
    auto it = sessions_.find(session_id);
    if (it == sessions_.end() || it->second->ending) {
      return absl::NotFoundError(absl::StrCat("no session ", session_id));
    }
    it->second->ending = true;
    switch (reason) {
      case EndReason::kClosed:
        ++counts_.closed;
        break;
      case EndReason::kDisconnected:
        ++counts_.disconnected;
        break;
      case EndReason::kKilled:
        ++counts_.killed;
        break;
      case EndReason::kFailed:
        ++counts_.failed;
        break;
    }
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
    if (s.allocation_id != 0) {
      if (auto u = allocation_usage_.find(s.allocation_id);
          u != allocation_usage_.end() && --u->second.sessions == 0) {
        allocation_usage_.erase(u);
      }
    }
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
  absl::StatusOr<ReclaimResult> r =
      EndSessionById(session_id, EndReason::kClosed);
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
  absl::StatusOr<ReclaimResult> r =
      EndSessionById(session_id, EndReason::kDisconnected);
  return r.ok() ? *r : ReclaimResult{};
}

ReclaimResult RuntimeCore::EndSession(uint64_t session_id, EndReason reason) {
  absl::StatusOr<ReclaimResult> r = EndSessionById(session_id, reason);
  return r.ok() ? *r : ReclaimResult{};
}

absl::StatusOr<SegmentGrant> RuntimeCore::Allocate(ConnectionId caller,
                                                   uint64_t session_id,
                                                   int chip, uint64_t bytes) {
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
  if (!s.chip_allowed.empty() && !s.chip_allowed[chip]) {
    std::vector<int> allowed;
    for (size_t i = 0; i < s.chip_allowed.size(); ++i) {
      if (s.chip_allowed[i]) allowed.push_back(static_cast<int>(i));
    }
    return absl::PermissionDeniedError(
        absl::StrCat("chip ", chip, " is not in this session's allocation ",
                     s.allocation_id, " (chips ", ChipList(allowed),
                     "): a session opened with an allocation token "
                     "(TPUD_TOKEN) may allocate only on its "
                     "chips; use those (TPU_VISIBLE_CHIPS lists them), or "
                     "request more chips for the pod"));
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
  const uint64_t quota = QuotaOn(s, chip);
  // An allocation's quota binds all of its sessions together (unless an
  // administrator gave this session a quota of its own). Their holdings are
  // counted either way, as UnlistLocked takes them off.
  AllocationUsage* usage = nullptr;
  if (s.allocation_id != 0) {
    if (auto u = allocation_usage_.find(s.allocation_id);
        u != allocation_usage_.end()) {
      usage = &u->second;
    }
  }
  if (usage != nullptr && !s.chip_quota.empty() && quota != 0) {
    const uint64_t together = usage->held[chip];
    if (rounded == 0 || together > quota || rounded > quota - together) {
      return absl::ResourceExhaustedError(absl::StrFormat(
          "HBM quota exceeded on chip %d: asked %s; the sessions of allocation "
          "%d hold %s of "
          "its %s quota (session %d holds %s of it). The quota covers every "
          "process of the "
          "pod; free memory, or request more chip shares for the pod",
          chip, FormatBytes(bytes), s.allocation_id, FormatBytes(together),
          FormatBytes(quota), session_id, FormatBytes(held)));
    }
  } else if (quota != 0 &&
             (rounded == 0 || held > quota || rounded > quota - held)) {
    const std::string from =
        s.allocation_id != 0 && !s.chip_quota.empty()
            ? absl::StrCat(" (set by its allocation ", s.allocation_id,
                           "; a pod gets more by requesting more chip shares)")
            : std::string();
    return absl::ResourceExhaustedError(
        absl::StrFormat("HBM quota exceeded on chip %d: asked %s, session %d "
                        "holds %s of its %s "
                        "quota%s; free memory, or ask an administrator to "
                        "raise it (tpuctl quota "
                        "%d SIZE)",
                        chip, FormatBytes(bytes), session_id, FormatBytes(held),
                        FormatBytes(quota), from, session_id));
  }
  std::optional<HbmBlock> block = c.allocator.Allocate(bytes, session_id);
  if (!block.has_value()) {
    std::string quota_text = quota == 0
                                 ? std::string("no quota")
                                 : absl::StrCat("quota ", FormatBytes(quota));
    return absl::ResourceExhaustedError(absl::StrFormat(
        "HBM exhausted on chip %d: asked %s, session %d holds %s (%s); chip "
        "has "
        "%s in use, free %s of %s (largest free block %s)",
        chip, FormatBytes(bytes), session_id, FormatBytes(held), quota_text,
        FormatBytes(stats.used_bytes), FormatBytes(stats.free_bytes),
        FormatBytes(stats.capacity_bytes),
        FormatBytes(stats.largest_free_block)));
  }
  SegmentGrant grant;
  grant.chip = chip;
  grant.offset = block->offset;
  grant.size = block->size;
  grant.requested_bytes = bytes;
  grant.address = tpu::MakeDeviceAddress(chip, block->offset);
  s.bytes_per_chip[chip] += grant.size;
  if (usage != nullptr) usage->held[chip] += grant.size;
  s.segments_per_chip[chip] += 1;
  s.peak_bytes_per_chip[chip] =
      std::max(s.peak_bytes_per_chip[chip], s.bytes_per_chip[chip]);
  s.segments[grant.address] = grant;
  // Executors may use the segment from now on.
  if (c.arena != nullptr) c.owners.Assign(grant.offset, grant.size, s.tag);
  return grant;
}

absl::StatusOr<uint64_t> RuntimeCore::Free(ConnectionId caller,
                                           uint64_t session_id,
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
    v.session_quota_bytes = QuotaOn(s, static_cast<int>(c));
    v.session_bytes = s.bytes_per_chip[c];
    v.session_peak_bytes = s.peak_bytes_per_chip[c];
    v.session_segments = segments[c];
    v.drained = chips_[c]->drained;
    v.hbm = chips_[c]->allocator.stats();
    views.push_back(v);
  }
  return views;
}

RuntimeCore::SessionCounts RuntimeCore::session_counts() const {
  absl::MutexLock lock(&mu_);
  return counts_;
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
  snap.allocation_id = s.allocation_id;
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
            [](const SessionSnapshot& a, const SessionSnapshot& b) {
              return a.id < b.id;
            });
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
  absl::StatusOr<ReclaimResult> r =
      EndSessionById(session_id, EndReason::kKilled);
  if (!r.ok()) return r.status();
  return r->bytes;
}

char* RuntimeCore::ChipHostBase(int chip) const {
  absl::MutexLock lock(&mu_);
  if (chip < 0 || chip >= static_cast<int>(chips_.size()) ||
      chips_[chip]->arena == nullptr) {
    return nullptr;
  }
  return chips_[chip]->arena->base();
}

std::pair<char*, uint64_t> RuntimeCore::OwnerTableMemory(int chip) const {
  absl::MutexLock lock(&mu_);
  if (chip < 0 || chip >= static_cast<int>(chips_.size())) return {nullptr, 0};
  return {chips_[chip]->owners_memory.data(),
          chips_[chip]->owners_memory.size()};
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

absl::StatusOr<uint32_t> RuntimeCore::AttachDataPlane(
    uint64_t session_id, absl::string_view token, const PeerIdentity& peer) {
  absl::MutexLock lock(&mu_);
  auto it = sessions_.find(session_id);
  // The same answer for "no such session" and "wrong token": a guesser
  // learns nothing about which sessions exist.
  if (it == sessions_.end() || it->second->ending ||
      it->second->data_plane_token.size() != token.size() ||
      it->second->data_plane_token != token ||
      it->second->peer.uid != peer.uid) {
    return absl::PermissionDeniedError(
        absl::StrCat("data-plane attach refused for session ", session_id,
                     ": no such session for this user, or a wrong token"));
  }
  if (it->second->data_plane_attached) {
    return absl::FailedPreconditionError(absl::StrCat(
        "session ", session_id, " already has a data-plane connection"));
  }
  it->second->data_plane_attached = true;
  return it->second->tag;
}

absl::StatusOr<SegmentGrant> RuntimeCore::AllocateForResult(uint64_t session_id,
                                                            int chip,
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
  // until the session frees enough, and never takes memory away. It replaces
  // an allocation's per-chip quotas (the allocation's chips still bind).
  it->second->quota_bytes_per_chip = quota_bytes_per_chip;
  it->second->chip_quota.clear();
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
