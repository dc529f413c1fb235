// DataPlane: the sessions' shared-memory op streams and their executors.
//
// When a client attaches its data-plane connection, tpud creates the
// session's shared memory (a sealed memfd; layout in tpu/shm_layout.h), hands
// it over, and starts one executor thread per stream. An executor consumes its
// ring in order: it copies each record out of shared memory, decodes and
// checks it (every tensor's whole footprint must lie in one of the session's
// own segments), waits for its chip (ChipScheduler), runs it through the chip
// backend, and publishes completion. A failing op records its error on the
// stream (reported at the client's next synchronisation) and poisons what it
// would have written; a malformed record fails the stream for good. Nothing a
// client writes can reach another session's memory or stop the daemon.
//
// Thread-safety: thread-safe.
#ifndef TPUD_DAEMON_DATA_PLANE_H_
#define TPUD_DAEMON_DATA_PLANE_H_

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "daemon/chip_backend.h"
#include "daemon/chip_scheduler.h"
#include "daemon/runtime_core.h"

namespace tpud {

struct DataPlaneOptions {
  uint64_t ring_bytes = 1 << 20;           // per stream; power of two
  uint64_t staging_bytes = 64 << 20;       // per session, split among streams
  uint64_t default_pinned_bytes = 256 << 20;
  uint64_t max_pinned_bytes = uint64_t{4} << 30;
  // How long an idle executor spins before sleeping on its doorbell.
  uint64_t spin_ns = 50000;
};

struct SessionActivity {
  uint64_t busy_ns = 0;
  uint64_t ops = 0;
};

class SessionDataPlane;

class DataPlane {
 public:
  DataPlane(RuntimeCore* core, ChipBackend* backend, DataPlaneOptions options);
  ~DataPlane();

  // Creates the session's shared memory and starts its executors. Returns the
  // memfd to send to the client (the caller closes it after sending).
  absl::StatusOr<int> Attach(uint64_t session_id, absl::string_view token,
                             const PeerIdentity& peer, uint64_t pinned_bytes)
      ABSL_LOCKS_EXCLUDED(mu_);

  // Stops the session's executors and unmaps its shared memory. Called by
  // RuntimeCore (session end hook) before the session's HBM is reclaimed.
  void Detach(uint64_t session_id) ABSL_LOCKS_EXCLUDED(mu_);

  SessionActivity Activity(uint64_t session_id) ABSL_LOCKS_EXCLUDED(mu_);
  ChipUsage ChipActivity(int chip) { return scheduler_.Usage(chip); }

  // Stops everything (daemon shutdown).
  void StopAll() ABSL_LOCKS_EXCLUDED(mu_);

 private:
  RuntimeCore* const core_;
  ChipBackend* const backend_;
  const DataPlaneOptions options_;
  ChipScheduler scheduler_;
  absl::Mutex mu_;
  absl::flat_hash_map<uint64_t, std::shared_ptr<SessionDataPlane>> sessions_
      ABSL_GUARDED_BY(mu_);
  // Activity of ended sessions is dropped; of live ones, read from here.
};

}  // namespace tpud

#endif  // TPUD_DAEMON_DATA_PLANE_H_
