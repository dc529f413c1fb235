// libtpuclient internals shared by client.cc (control plane) and
// data_plane_client.cc (op streams). Not installed; not part of the API.
#ifndef TPU_CLIENT_SESSION_IMPL_H_
#define TPU_CLIENT_SESSION_IMPL_H_

#include <chrono>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include <grpcpp/grpcpp.h>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "proto/tpud.grpc.pb.h"
#include "tpu/client.h"
#include "tpu/op_record.h"
#include "tpu/shm_layout.h"

namespace tpu {
namespace internal {

inline void SetDeadline(grpc::ClientContext* ctx, absl::Duration timeout) {
  ctx->set_deadline(std::chrono::system_clock::now() +
                    std::chrono::microseconds(absl::ToInt64Microseconds(timeout)));
}

// Connects a unix stream socket; errors name the path, errno and a remedy.
absl::StatusOr<int> ConnectUnix(const std::string& path, bool admin);

// The producer side of one stream's ring.
struct StreamProducer {
  absl::Mutex mu;
  RecordWriter writer ABSL_GUARDED_BY(mu);
  uint64_t next_sequence ABSL_GUARDED_BY(mu) = 1;
  uint64_t tail ABSL_GUARDED_BY(mu) = 0;
  // Staging slots of this stream: the sequence of the last copy that used each.
  std::vector<uint64_t> slot_sequence ABSL_GUARDED_BY(mu);
  size_t next_slot ABSL_GUARDED_BY(mu) = 0;
  // Ops whose definition this stream already carried: each stream's executor
  // learns a schema from its own ring, so no stream runs an op whose
  // definition is still queued on another.
  std::vector<bool> defined ABSL_GUARDED_BY(mu);
  // One synchronous op at a time per stream (they share the response area).
  absl::Mutex sync_mu;
};

}  // namespace internal

struct Session::Impl {
  ClientOptions options;
  std::shared_ptr<grpc::Channel> channel ABSL_GUARDED_BY(mu);
  std::shared_ptr<tpud::v1::Runtime::Stub> stub ABSL_GUARDED_BY(mu);
  uint64_t id = 0;
  uint32_t protocol_version = 0;
  std::string daemon_version;
  absl::Mutex mu;
  bool open ABSL_GUARDED_BY(mu) = false;

  // ---- data plane ----
  int data_plane_fd = -1;  // the connection; closing it ends the session
  char* shm = nullptr;
  uint64_t shm_bytes = 0;
  ShmHeader layout{};
  internal::StreamProducer streams[kMaxStreams];
  uint64_t staging_slot_bytes = 0;
  int staging_slots = 0;

  absl::Mutex ops_mu;
  absl::flat_hash_map<std::string, uint32_t> op_ids ABSL_GUARDED_BY(ops_mu);
  std::vector<std::string> op_schemas ABSL_GUARDED_BY(ops_mu);  // by id

  absl::Mutex pinned_mu;
  std::map<uint64_t, uint64_t> pinned_free ABSL_GUARDED_BY(pinned_mu);  // offset -> size
  std::map<uint64_t, uint64_t> pinned_used ABSL_GUARDED_BY(pinned_mu);

  absl::Mutex events_mu;
  std::vector<uint32_t> free_events ABSL_GUARDED_BY(events_mu);

  ~Impl();

  grpc::ClientContext* Prepare(grpc::ClientContext* ctx) {
    internal::SetDeadline(ctx, options.call_timeout);
    return ctx;
  }

  // The stub while the session is open; calls in flight keep it alive.
  absl::StatusOr<std::shared_ptr<tpud::v1::Runtime::Stub>> Stub() ABSL_LOCKS_EXCLUDED(mu) {
    absl::MutexLock lock(&mu);
    if (!open) {
      return absl::FailedPreconditionError(
          absl::StrCat("session ", id, " is closed; open a new one"));
    }
    return stub;
  }

  // Connects the data plane with the token from OpenSession and maps the
  // session's shared memory.
  absl::Status AttachDataPlane(const std::string& token);

  StreamControl* Control(int stream) { return StreamOf(shm, layout, stream); }
  absl::Status CheckStream(int stream) const;
  // Appends the record built in producer.writer (Begin() already called
  // with `sequence`). REQUIRES: producer.mu held.
  absl::Status Publish(int stream, internal::StreamProducer& producer)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(producer.mu);
  // Waits until `stream` completed `sequence` (or died, or the daemon left).
  absl::Status WaitCompleted(int stream, uint64_t sequence);
  // The stream's sticky error, cleared; OK when none.
  absl::Status TakeError(int stream);
  // Builds and publishes an op record (and the op's definition, the first
  // time this stream carries it). Returns its sequence.
  absl::StatusOr<uint64_t> EnqueueOpLocked(int stream, internal::StreamProducer& p,
                                           uint32_t op_id, uint32_t flags, const OpArg* args,
                                           size_t num_args, const TensorRef* outputs,
                                           size_t num_outputs)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(p.mu);
  // Publishes a copy record. Returns its sequence.
  absl::StatusOr<uint64_t> EnqueueCopyLocked(int stream, internal::StreamProducer& p,
                                             CopyKind kind, uint64_t src, uint64_t dst,
                                             uint64_t bytes)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(p.mu);
  // Offset of `ptr` in the shared memory if [ptr, ptr+bytes) lies in the
  // pinned pool.
  bool PinnedOffset(const void* ptr, uint64_t bytes, uint64_t* offset) const;
};

}  // namespace tpu

#endif  // TPU_CLIENT_SESSION_IMPL_H_
