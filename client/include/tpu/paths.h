// Where tpud's sockets live by default. Shared by the daemon and its clients.
#ifndef TPU_PATHS_H_
#define TPU_PATHS_H_

#include <string>

namespace tpu {

// As root: /run/tpud/<name>; otherwise $XDG_RUNTIME_DIR/tpud/<name>, or
// /tmp/tpud-<uid>/<name> when XDG_RUNTIME_DIR is unset.
std::string DefaultSocketDir();

// $TPUD_SOCKET if set, else DefaultSocketDir()/tpud.sock.
std::string RuntimeSocketPath();
// $TPUD_ADMIN_SOCKET if set, else DefaultSocketDir()/admin.sock.
std::string AdminSocketPath();

}  // namespace tpu

#endif  // TPU_PATHS_H_
