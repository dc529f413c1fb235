#include "daemon/executor/control_channel.h"

#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

namespace tpud {

bool SendControl(int fd, const ControlMessage& msg, const int* fds,
                 int num_fds) {
  iovec iov{const_cast<ControlMessage*>(&msg), sizeof(msg)};
  msghdr mh{};
  mh.msg_iov = &iov;
  mh.msg_iovlen = 1;
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int) * kMaxControlFds)] = {};
  if (num_fds > 0) {
    num_fds = std::min(num_fds, kMaxControlFds);
    mh.msg_control = control;
    mh.msg_controllen = CMSG_SPACE(sizeof(int) * num_fds);
    cmsghdr* cm = CMSG_FIRSTHDR(&mh);
    cm->cmsg_level = SOL_SOCKET;
    cm->cmsg_type = SCM_RIGHTS;
    cm->cmsg_len = CMSG_LEN(sizeof(int) * num_fds);
    std::memcpy(CMSG_DATA(cm), fds, sizeof(int) * num_fds);
  }
  while (true) {
    ssize_t n = sendmsg(fd, &mh, MSG_NOSIGNAL);
    if (n == static_cast<ssize_t>(sizeof(msg))) return true;
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
      // The peer is behind: wait for room (it is gone if it never reads).
      pollfd p{fd, POLLOUT, 0};
      if (poll(&p, 1, 10000) > 0 && (p.revents & POLLOUT) != 0) continue;
    }
    return false;
  }
}

int ReceiveControl(int fd, ControlMessage* msg, std::vector<int>* fds) {
  iovec iov{msg, sizeof(*msg)};
  msghdr mh{};
  mh.msg_iov = &iov;
  mh.msg_iovlen = 1;
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int) * kMaxControlFds)] = {};
  mh.msg_control = control;
  mh.msg_controllen = sizeof(control);
  ssize_t n;
  do {
    n = recvmsg(fd, &mh, MSG_CMSG_CLOEXEC);
  } while (n < 0 && errno == EINTR);
  if (fds != nullptr) fds->clear();
  for (cmsghdr* cm = CMSG_FIRSTHDR(&mh); cm != nullptr;
       cm = CMSG_NXTHDR(&mh, cm)) {
    if (cm->cmsg_level != SOL_SOCKET || cm->cmsg_type != SCM_RIGHTS) continue;
    const size_t count = (cm->cmsg_len - CMSG_LEN(0)) / sizeof(int);
    for (size_t i = 0; i < count; ++i) {
      int f;
      std::memcpy(&f, CMSG_DATA(cm) + i * sizeof(int), sizeof(int));
      if (fds != nullptr) {
        fds->push_back(f);
      } else {
        close(f);
      }
    }
  }
  if (n == 0) return 0;
  if (n != static_cast<ssize_t>(sizeof(*msg))) {
    if (fds != nullptr) {
      for (int f : *fds) close(f);
      fds->clear();
    }
    return n < 0 && errno != EAGAIN && errno != EWOULDBLOCK ? 0 : -1;
  }
  return 1;
}

void SetControlText(ControlMessage* msg, const char* text, size_t length) {
  length = std::min(length, sizeof(msg->text) - 1);
  std::memcpy(msg->text, text, length);
  msg->text[length] = '\0';
}

}  // namespace tpud
