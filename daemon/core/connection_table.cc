#include "daemon/core/connection_table.h"

#include "absl/strings/str_cat.h"

namespace tpud {

std::string ConnectionTable::PeerName(int grpc_fd) {
  return absl::StrCat("fd:", grpc_fd);
}

void ConnectionTable::Add(int grpc_fd, const ConnectionInfo& info) {
  absl::MutexLock lock(&mu_);
  std::string name = PeerName(grpc_fd);
  if (auto it = by_peer_.find(name); it != by_peer_.end()) {
    peer_by_id_.erase(it->second.id);
  }
  by_peer_[name] = info;
  peer_by_id_[info.id] = name;
}

void ConnectionTable::Remove(ConnectionId id) {
  absl::MutexLock lock(&mu_);
  auto it = peer_by_id_.find(id);
  if (it == peer_by_id_.end()) return;
  auto p = by_peer_.find(it->second);
  if (p != by_peer_.end() && p->second.id == id) by_peer_.erase(p);
  peer_by_id_.erase(it);
}

std::optional<ConnectionInfo> ConnectionTable::Lookup(
    absl::string_view grpc_peer) const {
  absl::MutexLock lock(&mu_);
  auto it = by_peer_.find(grpc_peer);
  if (it == by_peer_.end()) return std::nullopt;
  return it->second;
}

std::optional<ConnectionInfo> ConnectionTable::Get(ConnectionId id) const {
  absl::MutexLock lock(&mu_);
  auto it = peer_by_id_.find(id);
  if (it == peer_by_id_.end()) return std::nullopt;
  auto p = by_peer_.find(it->second);
  if (p == by_peer_.end()) return std::nullopt;
  return p->second;
}

size_t ConnectionTable::size() const {
  absl::MutexLock lock(&mu_);
  return by_peer_.size();
}

}  // namespace tpud
