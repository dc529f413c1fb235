// The control channel between tpud and one executor process: a
// SOCK_SEQPACKET socketpair carrying fixed-size messages, with descriptors
// (SCM_RIGHTS) where a message names them. Ops never travel here: only
// session attach/detach, result allocations for the synchronous path, and
// reports.
//
// Thread-safety: SendControl/ReceiveControl are plain syscalls; callers
// serialise use of one descriptor.
#ifndef TPUD_DAEMON_EXECUTOR_CONTROL_CHANNEL_H_
#define TPUD_DAEMON_EXECUTOR_CONTROL_CHANNEL_H_

#include <cstddef>
#include <cstdint>
#include <vector>

namespace tpud {

enum class ControlType : uint32_t {
  // tpud -> executor
  kAttach = 1,      // session_id, tag, a = shm bytes, b = state bytes;
                    // fds: [shm memfd, state memfd, doorbell eventfd]
  kDetach = 2,      // session_id
  kAllocReply = 3,  // request_id, code, a = device address, b = bytes, text
  kStop = 4,
  kReleased = 5,  // a = device address, b = bytes: a freed segment
  // executor -> tpud
  kReady = 100,
  kAllocRequest = 101,   // request_id, session_id, a = chip, b = bytes
  kFreeResult = 102,     // session_id, a = device address
  kSessionFailed = 103,  // session_id, text: why its data plane failed
};

struct ControlMessage {
  ControlType type = ControlType::kReady;
  uint32_t tag = 0;
  uint32_t code = 0;  // absl::StatusCode of a reply
  uint32_t pad = 0;
  uint64_t session_id = 0;
  uint64_t request_id = 0;
  uint64_t a = 0;
  uint64_t b = 0;
  char text[480] = {};
};

inline constexpr int kMaxControlFds = 4;

// Sends one message (blocking). Returns false if the peer is gone.
bool SendControl(int fd, const ControlMessage& msg, const int* fds = nullptr,
                 int num_fds = 0);

// Receives one message. Returns 1 with a message (and its descriptors in
// `fds`, close-on-exec), 0 when the peer closed, -1 when nothing is waiting
// (non-blocking descriptors) or on error.
int ReceiveControl(int fd, ControlMessage* msg, std::vector<int>* fds);

// Copies `text` into msg->text, cut to fit.
void SetControlText(ControlMessage* msg, const char* text, size_t length);

}  // namespace tpud

#endif  // TPUD_DAEMON_EXECUTOR_CONTROL_CHANNEL_H_
