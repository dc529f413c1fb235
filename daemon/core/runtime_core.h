// RuntimeCore: the daemon's state and rules, with no transport.
//
// It owns the chips (HBM arena + allocator, health, drain) and the sessions
// (identity, quota, segments). The gRPC services only unpack requests and call
// in here; tests drive it directly. Every call that acts for a session names
// the connection it arrived on, and a session answers only to its own
// connection.
//
// Thread-safety: all public methods are thread-safe.
#ifndef TPUD_DAEMON_CORE_RUNTIME_CORE_H_
#define TPUD_DAEMON_CORE_RUNTIME_CORE_H_

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "daemon/core/allocation_state.h"
#include "daemon/core/shared_regions.h"
#include "daemon/hbm/hbm_allocator.h"
#include "daemon/hbm/hbm_arena.h"
#include "daemon/topology/topology.h"

namespace tpud {

// Identifies one accepted client connection for the life of the daemon.
using ConnectionId = uint64_t;

// Who is on the other end of a connection, as the kernel reports it.
struct PeerIdentity {
  int32_t pid = 0;
  uint32_t uid = 0;
  uint32_t gid = 0;
  std::string command;  // /proc/<pid>/cmdline, arguments joined by spaces
};

struct OpenedSession {
  uint64_t session_id = 0;
  uint32_t tag = 0;  // names the session in page-owner tables
  uint32_t protocol_version = 0;
  // With an allocation: the largest of its chips' quotas.
  uint64_t quota_bytes_per_chip = 0;
  std::vector<int> allowed_chips;  // empty: every chip
  // Proves to the data-plane connection that it belongs to this session.
  std::string data_plane_token;
  // OpenSessionResponse.small_pool_bytes (SetSmallPoolBytes).
  uint64_t small_pool_bytes = 0;
};

struct SegmentGrant {
  uint64_t address = 0;
  int chip = 0;
  uint64_t offset = 0;
  uint64_t size = 0;
  uint64_t requested_bytes = 0;
};

// Chips and HBM quotas set aside for one consumer (a Kubernetes container,
// from the device plugin); sessions that present its token get them.
struct AllocationSpec {
  std::vector<int> chips;
  // One per chip, or empty with `quota_bytes_per_chip` for all; 0: no quota.
  std::vector<uint64_t> chip_quota_bytes;
  uint64_t quota_bytes_per_chip = 0;
  std::string name;  // informational (the device IDs it was made for)
};

struct CreatedAllocation {
  uint64_t id = 0;
  std::string token;  // printable, secret
};

struct AllocationSnapshot {
  uint64_t id = 0;
  std::string name;
  std::vector<int> chips;
  std::vector<uint64_t> quota_bytes;  // per entry of `chips`; 0: none
  absl::Time created;
  int session_count = 0;  // open sessions that presented its token
};

struct SessionSnapshot {
  uint64_t id = 0;
  uint64_t allocation_id = 0;  // 0: none
  ConnectionId connection = 0;
  PeerIdentity peer;
  std::string client_name;
  uint32_t protocol_version = 0;
  uint64_t quota_bytes_per_chip = 0;
  absl::Time opened;
  std::vector<uint64_t> bytes_per_chip;
  std::vector<uint64_t> peak_bytes_per_chip;
  uint64_t segment_count = 0;
  uint64_t total_bytes() const;
};

struct ChipSnapshot {
  int id = 0;
  bool healthy = true;
  bool drained = false;
  HbmAllocatorStats hbm;
  int session_count = 0;  // sessions holding HBM here
};

struct ChipMemoryView {
  int chip = 0;
  uint64_t session_quota_bytes = 0;  // the session's per-chip quota; 0: none
  uint64_t session_bytes = 0;
  uint64_t session_peak_bytes = 0;
  uint64_t session_segments = 0;
  bool drained = false;
  HbmAllocatorStats hbm;
};

struct ReclaimResult {
  int sessions = 0;
  uint64_t bytes = 0;
  uint64_t segments = 0;
};

class RuntimeCore {
 public:
  struct Options {
    // Per-chip quota given to every new session; 0 means none.
    uint64_t default_quota_bytes_per_chip = 0;
    // Back each chip with an HbmArena (the simulated host). Off only in tests
    // that exercise bookkeeping with capacities no machine could reserve.
    bool back_with_memory = true;
    // Sessions one user may hold at once (0: no limit).
    uint32_t max_sessions_per_uid = 0;
  };

  static absl::StatusOr<std::unique_ptr<RuntimeCore>> Create(Topology topology,
                                                             Options options);

  const Topology& topology() const { return topology_; }

  // Host view of a chip's HBM (the simulated chip's arena); null when not
  // backed by memory. Stable for the life of the core.
  char* ChipHostBase(int chip) const;
  // The chip's page-owner table (shared with executors): memory and size.
  std::pair<char*, uint64_t> OwnerTableMemory(int chip) const;

  // Called when a session ends, before its memory is reclaimed, without
  // RuntimeCore's lock held: the data plane stops the session's executors
  // here. Set once, before serving.
  void SetSessionEndHook(std::function<void(uint64_t session_id)> hook);
  // Called with a session's tag after pages of it were taken out of the
  // owner tables and before they go back to the allocator, without the lock:
  // returns once no executor can still be using them (ExecutorPool::Fence).
  // Set once, before serving.
  void SetMemoryFence(std::function<void(uint32_t tag)> fence);
  // Called, without the lock, with each segment once it went back to the
  // allocator: a backend keeping device memory per segment lets it go
  // (ExecutorPool::Released). Set once, before serving.
  void SetReleaseHook(
      std::function<void(uint64_t address, uint64_t bytes)> hook);
  // The segment size clients carve small allocations from, told to each
  // session as it opens (0: a segment per allocation). Set once, before
  // serving.
  void SetSmallPoolBytes(uint64_t bytes) { small_pool_bytes_ = bytes; }

  // Binds a data-plane connection to its session: the token must match and
  // the peer must be the session's user. Once per session. Returns the
  // session's tag.
  absl::StatusOr<uint32_t> AttachDataPlane(uint64_t session_id,
                                           absl::string_view token,
                                           const PeerIdentity& peer)
      ABSL_LOCKS_EXCLUDED(mu_);

  // Allocates HBM for results the data plane computes for a session (charged
  // to it, quota included): a segment of the session like any other.
  absl::StatusOr<SegmentGrant> AllocateForResult(uint64_t session_id, int chip,
                                                 uint64_t bytes)
      ABSL_LOCKS_EXCLUDED(mu_);
  // Gives a result segment back (the op that wanted it failed). Does not
  // wait on executors, so the executors' supervisor may call it.
  void FreeResult(uint64_t session_id, uint64_t address)
      ABSL_LOCKS_EXCLUDED(mu_);

  // Why a session ended, for the counts in session_counts().
  enum class EndReason { kClosed, kDisconnected, kKilled, kFailed };
  // Ends a session (by default: its data-plane connection closed), like
  // EndConnection.
  ReclaimResult EndSession(uint64_t session_id,
                           EndReason reason = EndReason::kDisconnected)
      ABSL_LOCKS_EXCLUDED(mu_);
  // The connection a session was opened on (0 if none).
  ConnectionId ConnectionOf(uint64_t session_id) const ABSL_LOCKS_EXCLUDED(mu_);
  // The page-owner tag of a session the caller owns.
  absl::StatusOr<uint32_t> SessionTag(ConnectionId caller, uint64_t session_id)
      ABSL_LOCKS_EXCLUDED(mu_);

  // Opens a session bound to `connection`, agreeing on a protocol version.
  // One session per connection: a second one is FAILED_PRECONDITION. With an
  // `allocation_token`, the session takes that allocation's chips and quotas
  // (an unknown token is PERMISSION_DENIED); without, the default quota and
  // every chip.
  absl::StatusOr<OpenedSession> OpenSession(
      ConnectionId connection, const PeerIdentity& peer,
      uint32_t client_min_version, uint32_t client_max_version,
      std::string client_name, absl::string_view allocation_token = {})
      ABSL_LOCKS_EXCLUDED(mu_);

  // ---- allocations ----
  // Sets chips and quotas aside under a new random token. The chips must be
  // valid and distinct (INVALID_ARGUMENT otherwise). Chips are not reserved
  // against sessions without a token: the device plugin keeps consumers apart.
  absl::StatusOr<CreatedAllocation> CreateAllocation(AllocationSpec spec)
      ABSL_LOCKS_EXCLUDED(mu_);
  // Forgets an allocation: new sessions with its token are refused; sessions
  // already open keep their limits. An unknown token is NOT_FOUND.
  absl::Status ReleaseAllocation(absl::string_view token)
      ABSL_LOCKS_EXCLUDED(mu_);
  // The same, by the allocation's id (NOT_FOUND naming it when unknown).
  absl::Status ReleaseAllocationById(uint64_t id) ABSL_LOCKS_EXCLUDED(mu_);
  std::vector<AllocationSnapshot> Allocations() const ABSL_LOCKS_EXCLUDED(mu_);
  // Allocations kept across restarts (--allocation_state). Restore takes a
  // saved state whole or not at all: chips must exist on this host, ids and
  // tokens be distinct (INVALID_ARGUMENT otherwise, nothing applied). Call
  // it before any allocation is made.
  absl::Status RestoreAllocations(const AllocationState& state)
      ABSL_LOCKS_EXCLUDED(mu_);
  // Called, under the core's lock, with the whole state now (its error is
  // returned, and the saver not kept) and after every create and release;
  // when it fails then, the change is undone and its error returned (the
  // caller never holds a token that a restart would forget).
  using AllocationSaver = std::function<absl::Status(const AllocationState&)>;
  absl::Status SetAllocationSaver(AllocationSaver saver)
      ABSL_LOCKS_EXCLUDED(mu_);

  // Ends the session and frees all of its HBM; returns the bytes reclaimed.
  absl::StatusOr<uint64_t> CloseSession(ConnectionId caller,
                                        uint64_t session_id)
      ABSL_LOCKS_EXCLUDED(mu_);

  // Ends every session bound to `connection` (it closed, the peer may have
  // crashed) and reclaims all their HBM at once.
  ReclaimResult EndConnection(ConnectionId connection) ABSL_LOCKS_EXCLUDED(mu_);

  absl::StatusOr<SegmentGrant> Allocate(ConnectionId caller,
                                        uint64_t session_id, int chip,
                                        uint64_t bytes)
      ABSL_LOCKS_EXCLUDED(mu_);

  // Frees the segment that starts at `address`. Another session's segment is
  // PERMISSION_DENIED; an address where no segment starts, INVALID_ARGUMENT.
  absl::StatusOr<uint64_t> Free(ConnectionId caller, uint64_t session_id,
                                uint64_t address) ABSL_LOCKS_EXCLUDED(mu_);

  absl::StatusOr<std::vector<ChipMemoryView>> MemoryStats(ConnectionId caller,
                                                          uint64_t session_id)
      ABSL_LOCKS_EXCLUDED(mu_);

  // ---- administration ----
  // Sessions opened, and ended by reason, since the daemon started.
  struct SessionCounts {
    uint64_t opened = 0;
    uint64_t closed = 0;  // the client closed it
    uint64_t disconnected =
        0;                // its connection went away (exit, crash, kill -9)
    uint64_t killed = 0;  // an administrator ended it (tpuctl kill)
    uint64_t failed = 0;  // tpud ended it (its op crashed an executor)
  };
  SessionCounts session_counts() const ABSL_LOCKS_EXCLUDED(mu_);
  std::vector<ChipSnapshot> Chips() const ABSL_LOCKS_EXCLUDED(mu_);
  std::vector<SessionSnapshot> Sessions() const ABSL_LOCKS_EXCLUDED(mu_);

  // Ends a session as if its connection closed. `connection` receives the
  // session's connection so the caller can hang it up.
  absl::StatusOr<uint64_t> KillSession(uint64_t session_id,
                                       ConnectionId* connection)
      ABSL_LOCKS_EXCLUDED(mu_);
  absl::Status SetSessionQuota(uint64_t session_id,
                               uint64_t quota_bytes_per_chip)
      ABSL_LOCKS_EXCLUDED(mu_);
  void SetDefaultQuota(uint64_t quota_bytes_per_chip) ABSL_LOCKS_EXCLUDED(mu_);
  uint64_t default_quota() const ABSL_LOCKS_EXCLUDED(mu_);
  // A drained chip refuses new allocations; existing segments keep working.
  absl::Status SetDrained(int chip, bool drained) ABSL_LOCKS_EXCLUDED(mu_);

 private:
  struct Chip {
    std::unique_ptr<HbmArena> arena;  // null when not backed by memory
    SharedMapping owners_memory;  // page-owner table (empty when not backed)
    PageOwnerTable owners;
    HbmAllocator allocator;
    bool healthy = true;
    bool drained = false;
    explicit Chip(uint64_t capacity) : allocator(capacity) {}
  };
  using Allocation = AllocationRecord;
  // The saved form of allocations_, and saving it (OK without a saver).
  AllocationState AllocationStateLocked() const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status SaveAllocationsLocked() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status ReleaseAllocationLocked(
      absl::flat_hash_map<std::string, Allocation>::iterator it)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  struct Session {
    uint64_t id = 0;
    uint64_t allocation_id = 0;
    // From an allocation: per chip of the host, whether it may allocate there
    // and its quota there (these replace quota_bytes_per_chip until an
    // administrator sets a quota). Empty: every chip, quota_bytes_per_chip.
    std::vector<bool> chip_allowed;
    std::vector<uint64_t> chip_quota;
    ConnectionId connection = 0;
    PeerIdentity peer;
    std::string client_name;
    uint32_t protocol_version = 0;
    uint64_t quota_bytes_per_chip = 0;
    absl::Time opened;
    std::vector<uint64_t> bytes_per_chip;
    std::vector<uint64_t> peak_bytes_per_chip;
    std::vector<uint64_t> segments_per_chip;
    std::string data_plane_token;
    bool data_plane_attached = false;
    bool ending = false;  // EndSession in progress
    uint32_t tag = 0;
    std::map<uint64_t, SegmentGrant> segments;  // by address
  };

  RuntimeCore(Topology topology, Options options);

  absl::StatusOr<Session*> FindSessionLocked(ConnectionId caller,
                                             uint64_t session_id)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status CheckChipLocked(int chip) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The session's quota on `chip` (0: none).
  static uint64_t QuotaOn(const Session& s, int chip);
  // Ends a session: marks it ending, runs the end hook without mu_, then
  // frees every segment and forgets it. NOT_FOUND if it is not (or no longer)
  // open; a concurrent second call for the same session returns NOT_FOUND.
  absl::StatusOr<ReclaimResult> EndSessionById(uint64_t session_id,
                                               EndReason reason)
      ABSL_LOCKS_EXCLUDED(mu_);
  // Allocates, lists and publishes (page owners) a segment of `s`.
  absl::StatusOr<SegmentGrant> AllocateLocked(Session& s, int chip,
                                              uint64_t bytes)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Takes a segment away from `s` (accounting, listing, page owners); the
  // block stays allocated until ReleaseBlocks, after the fence.
  void UnlistLocked(Session& s, const SegmentGrant& seg)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Fences `tag`, then gives the blocks back to their allocators.
  void ReleaseBlocks(uint32_t tag, const std::vector<SegmentGrant>& blocks)
      ABSL_LOCKS_EXCLUDED(mu_);
  void FreeBlockLocked(int chip, uint64_t offset)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  SessionSnapshot SnapshotLocked(const Session& s) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const Topology topology_;
  const bool back_with_memory_;

  mutable absl::Mutex mu_;
  std::vector<std::unique_ptr<Chip>> chips_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<uint64_t, std::unique_ptr<Session>> sessions_
      ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<ConnectionId, uint64_t> session_by_connection_
      ABSL_GUARDED_BY(mu_);
  uint64_t next_session_id_ ABSL_GUARDED_BY(mu_) = 1;
  absl::flat_hash_map<std::string, Allocation> allocations_
      ABSL_GUARDED_BY(mu_);  // by token
  // HBM held per chip by all open sessions of one allocation, by allocation
  // id: its quota binds them together (a pod's processes share its share).
  // Kept while any of its sessions is open, even after the allocation is
  // released.
  struct AllocationUsage {
    std::vector<uint64_t> held;  // per chip of the host
    int sessions = 0;
  };
  absl::flat_hash_map<uint64_t, AllocationUsage> allocation_usage_
      ABSL_GUARDED_BY(mu_);
  uint64_t next_allocation_id_ ABSL_GUARDED_BY(mu_) = 1;
  AllocationSaver allocation_saver_ ABSL_GUARDED_BY(mu_);
  SessionCounts counts_ ABSL_GUARDED_BY(mu_);
  uint64_t default_quota_ ABSL_GUARDED_BY(mu_) = 0;
  const uint32_t max_sessions_per_uid_;
  // Tags of ended sessions, for reuse (tags stay small and unique among
  // live sessions).
  std::vector<uint32_t> free_tags_ ABSL_GUARDED_BY(mu_);
  uint32_t next_tag_ ABSL_GUARDED_BY(mu_) = 1;
  std::function<void(uint64_t)> session_end_hook_;
  std::function<void(uint32_t)> memory_fence_;
  std::function<void(uint64_t, uint64_t)> release_hook_;
  uint64_t small_pool_bytes_ = 0;
};

}  // namespace tpud

#endif  // TPUD_DAEMON_CORE_RUNTIME_CORE_H_
