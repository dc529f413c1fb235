#include "daemon/collectives/registry.h"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <cstddef>
#include <cstring>
#include <deque>
#include <functional>
#include <new>
#include <set>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace tpud {
namespace {

// A cycle through every chip along links (depth-first; hosts have at most
// 16 chips), or the chips in id order when the links close no cycle.
std::vector<int> HostRing(const Topology& t) {
  const int n = t.num_chips();
  std::vector<int> path{0};
  std::vector<bool> used(n, false);
  used[0] = true;
  std::function<bool()> extend = [&]() -> bool {
    if (static_cast<int>(path.size()) == n) {
      if (n <= 2) return true;
      const std::vector<int> nb = t.Neighbors(path.back());
      return std::find(nb.begin(), nb.end(), 0) != nb.end();
    }
    for (int next : t.Neighbors(path.back())) {
      if (used[next]) continue;
      used[next] = true;
      path.push_back(next);
      if (extend()) return true;
      path.pop_back();
      used[next] = false;
    }
    return false;
  };
  if (n > 0 && extend()) return path;
  std::vector<int> ids(n);
  for (int i = 0; i < n; ++i) ids[i] = i;
  return ids;
}

}  // namespace

CommunicatorRegistry::CommunicatorRegistry(CollectiveTable* table,
                                           const Topology& topology,
                                           std::vector<int> executor_of_chip,
                                           std::vector<int> wake_fds)
    : table_(table),
      executor_of_chip_(std::move(executor_of_chip)),
      wake_fds_(std::move(wake_fds)),
      present_(table->num_comms) {
  const int n = std::min(topology.num_chips(), kMaxTableChips);
  table_->magic = kCollectiveTableMagic;
  table_->num_chips = static_cast<uint32_t>(n);
  // Links, each once (a < b, per axis).
  std::map<std::tuple<int, int, int>, int> link_id;
  for (int c = 0; c < n; ++c) {
    for (const IciLink& l : topology.Links(c)) {
      const int a = std::min(c, l.peer), b = std::max(c, l.peer);
      const auto key = std::make_tuple(a, b, l.axis);
      if (link_id.count(key) != 0 ||
          static_cast<int>(link_id.size()) >= kMaxIciLinks)
        continue;
      const int id = static_cast<int>(link_id.size());
      link_id[key] = id;
      LinkCounter& lc = table_->links[id];
      lc.a = a;
      lc.b = b;
      lc.axis = l.axis;
    }
  }
  table_->num_links = static_cast<uint32_t>(link_id.size());
  // Shortest routes, breadth first.
  for (int u = 0; u < kMaxTableChips; ++u) {
    for (int v = 0; v < kMaxTableChips; ++v) {
      for (int k = 0; k < kMaxRouteLinks; ++k) table_->routes[u][v][k] = -1;
    }
  }
  for (int u = 0; u < n; ++u) {
    std::vector<int> prev(n, -1), via(n, -1);
    std::vector<bool> seen(n, false);
    std::deque<int> q{u};
    seen[u] = true;
    while (!q.empty()) {
      const int c = q.front();
      q.pop_front();
      for (const IciLink& l : topology.Links(c)) {
        if (seen[l.peer]) continue;
        seen[l.peer] = true;
        prev[l.peer] = c;
        const int a = std::min(c, l.peer), b = std::max(c, l.peer);
        via[l.peer] =
            link_id[std::make_tuple(a, b, l.axis)] * 2 + (c == a ? 0 : 1);
        q.push_back(l.peer);
      }
    }
    for (int v = 0; v < n; ++v) {
      std::vector<int16_t> hops;
      for (int c = v; c != u && c >= 0 && prev[c] >= 0; c = prev[c]) {
        hops.push_back(static_cast<int16_t>(via[c]));
      }
      std::reverse(hops.begin(), hops.end());
      for (size_t k = 0;
           k < hops.size() && k < static_cast<size_t>(kMaxRouteLinks); ++k) {
        table_->routes[u][v][k] = hops[k];
      }
    }
  }
  host_ring_ = HostRing(topology);
  ring_position_.assign(topology.num_chips(), 0);
  for (size_t i = 0; i < host_ring_.size(); ++i)
    ring_position_[host_ring_[i]] = static_cast<int>(i);
}

absl::StatusOr<uint64_t> CommunicatorRegistry::Join(const JoinRequest& req) {
  if (req.size < 1 || req.size > kMaxCommRanks) {
    return absl::InvalidArgumentError(
        absl::StrCat("a communicator has 1 to ", kMaxCommRanks,
                     " ranks on one host, not ", req.size));
  }
  if (req.rank < 0 || req.rank >= req.size) {
    return absl::InvalidArgumentError(
        absl::StrCat("rank ", req.rank, " is not in [0, ", req.size, ")"));
  }
  if (req.chip < 0 || req.chip >= static_cast<int>(table_->num_chips)) {
    return absl::InvalidArgumentError(
        absl::StrCat("no chip ", req.chip, " on this host"));
  }
  if (req.key.empty() || req.key.size() > 256) {
    return absl::InvalidArgumentError("a communicator key is 1 to 256 bytes");
  }
  absl::MutexLock lock(&mu_);
  auto [it, fresh] = forming_.try_emplace(req.key);
  Forming& f = it->second;
  if (fresh) {
    f.size = req.size;
    f.joined.assign(req.size, false);
    f.members.assign(req.size, CommMember{});
    f.op_timeout = req.op_timeout;
  }
  auto fail_all = [&](const std::string& why) {
    f.error = why;
    formed_.SignalAll();
    return absl::InvalidArgumentError(why);
  };
  if (!f.error.empty()) return absl::FailedPreconditionError(f.error);
  if (f.id != 0) {
    return absl::AlreadyExistsError(absl::StrCat(
        "communicator ", req.key, " has already formed; use a fresh key"));
  }
  if (f.size != req.size) {
    return fail_all(absl::StrCat("ranks disagree on the size of communicator ",
                                 req.key, ": rank ", req.rank, " says ",
                                 req.size, ", others said ", f.size));
  }
  if (f.joined[req.rank]) {
    return absl::AlreadyExistsError(absl::StrCat("rank ", req.rank,
                                                 " of communicator ", req.key,
                                                 " has already joined"));
  }
  for (int r = 0; r < f.size; ++r) {
    if (f.joined[r] && f.members[r].session_id == req.session_id &&
        f.members[r].chip == req.chip) {
      return fail_all(
          absl::StrCat("ranks ", r, " and ", req.rank, " of communicator ",
                       req.key, " are the same chip ", req.chip,
                       " of one session; a session has one rank per chip"));
    }
  }
  f.joined[req.rank] = true;
  CommMember& m = f.members[req.rank];
  m.session_id = req.session_id;
  m.tag = req.tag;
  m.chip = req.chip;
  m.pid = req.pid;
  m.executor = req.chip < static_cast<int>(executor_of_chip_.size())
                   ? executor_of_chip_[req.chip]
                   : -1;
  if (std::all_of(f.joined.begin(), f.joined.end(), [](bool b) { return b; })) {
    int index = -1;
    for (int i = 0; i < NumComms(); ++i) {
      if (CommAt(table_, i)->id.load() == 0 && present_[i].empty()) {
        index = i;
        break;
      }
    }
    if (index < 0) {
      return fail_all(absl::StrCat(
          "this host has no free communicator slot (", NumComms(),
          " in use, tpud's --max_communicators); held by ", HoldersLocked(),
          "; destroy process groups that are done"));
    }
    CommSlot* c = CommAt(table_, index);
    // Zero the header and the slots of the ranks in use (the rest of the
    // slot array stays untouched, unbacked memory).
    std::memset(
        static_cast<void*>(c), 0,
        reinterpret_cast<char*>(&c->slots) - reinterpret_cast<char*>(c));
    std::memset(static_cast<void*>(&c->slots[0][0]), 0,
                sizeof(c->slots[0]) * f.size);
    InitSharedMutex(&c->mu);
    c->size = static_cast<uint32_t>(f.size);
    c->timeout_ns =
        static_cast<uint64_t>(absl::ToInt64Nanoseconds(f.op_timeout));
    std::vector<int> ring(f.size);
    for (int r = 0; r < f.size; ++r) {
      c->members[r] = f.members[r];
      ring[r] = r;
    }
    std::stable_sort(ring.begin(), ring.end(), [&](int a, int b) {
      return ring_position_[f.members[a].chip] <
             ring_position_[f.members[b].chip];
    });
    for (int r = 0; r < f.size; ++r) c->ring[r] = ring[r];
    present_[index].assign(f.size, true);
    // The slot's index is the id modulo the table's size (CommOf).
    f.id = next_serial_++ * static_cast<uint64_t>(NumComms()) +
           static_cast<uint64_t>(index);
    c->state.store(CommSlot::kReady);
    c->id.store(f.id, std::memory_order_release);
    spdlog::info("communicator {} formed: {} ranks on chips {} (key {})", f.id,
                 f.size, absl::StrJoin(ring, ","), req.key);
    formed_.SignalAll();
  }
  const absl::Time deadline = absl::Now() + req.join_timeout;
  ++f.waiting;
  while (f.id == 0 && f.error.empty()) {
    if (formed_.WaitWithDeadline(&mu_, deadline)) break;
  }
  --f.waiting;
  const uint64_t id = f.id;
  std::string error = f.error;
  const bool timed_out = id == 0 && error.empty();
  if (timed_out) {
    std::vector<int> missing;
    for (int r = 0; r < f.size; ++r) {
      if (!f.joined[r]) missing.push_back(r);
    }
    error = absl::StrCat("communicator ", req.key, " did not form within ",
                         absl::FormatDuration(req.join_timeout), ": ranks ",
                         absl::StrJoin(missing, ", "), " of ", f.size,
                         " never joined");
    f.error = error;
    formed_.SignalAll();
  }
  if (f.waiting == 0 && (id != 0 || !error.empty())) {
    // Keep the key's entry while joiners still look at it.
    forming_.erase(it);
  }
  if (id == 0) {
    return timed_out ? absl::DeadlineExceededError(error)
                     : absl::FailedPreconditionError(error);
  }
  return id;
}

std::string CommunicatorRegistry::HoldersLocked() const {
  std::map<int32_t, int> slots;  // pid -> communicators it is in
  for (int i = 0; i < NumComms(); ++i) {
    const CommSlot* c = CommAt(table_, i);
    std::set<int32_t> pids;
    for (uint32_t r = 0; r < c->size && r < present_[i].size(); ++r) {
      if (present_[i][r]) pids.insert(c->members[r].pid);
    }
    for (int32_t pid : pids) ++slots[pid];
  }
  std::vector<std::pair<int, int32_t>> by_count;
  for (const auto& [pid, n] : slots) by_count.emplace_back(-n, pid);
  std::sort(by_count.begin(), by_count.end());
  std::vector<std::string> parts;
  for (size_t k = 0; k < by_count.size() && k < 8; ++k) {
    parts.push_back(absl::StrCat("pid ", by_count[k].second, " (",
                                 -by_count[k].first, ")"));
  }
  if (by_count.size() > 8)
    parts.push_back(absl::StrCat(by_count.size() - 8, " more processes"));
  return absl::StrCat("processes (communicators each): ",
                      absl::StrJoin(parts, ", "));
}

void CommunicatorRegistry::ReleaseLocked(int index) {
  CommSlot* c = CommAt(table_, index);
  const bool recovered = LockShared(&c->mu);
  (void)recovered;
  c->id.store(0, std::memory_order_release);
  c->state.store(CommSlot::kUnused);
  pthread_mutex_unlock(&c->mu);
  present_[index].clear();
}

absl::Status CommunicatorRegistry::Leave(uint64_t session_id, uint64_t id) {
  absl::MutexLock lock(&mu_);
  CommSlot* c = CommOf(table_, id);
  const int index = static_cast<int>(id % NumComms());
  if (c == nullptr || present_[index].empty()) {
    return absl::NotFoundError(absl::StrCat("no communicator ", id));
  }
  bool member = false;
  for (uint32_t r = 0; r < c->size; ++r) {
    if (c->members[r].session_id == session_id && present_[index][r]) {
      present_[index][r] = false;
      member = true;
    }
  }
  if (!member) {
    return absl::PermissionDeniedError(
        absl::StrCat("this session is not a member of communicator ", id));
  }
  if (std::none_of(present_[index].begin(), present_[index].end(),
                   [](bool b) { return b; })) {
    ReleaseLocked(index);
  }
  return absl::OkStatus();
}

void CommunicatorRegistry::OnSessionEnd(uint64_t session_id) {
  absl::MutexLock lock(&mu_);
  for (int i = 0; i < NumComms(); ++i) {
    if (present_[i].empty()) continue;
    CommSlot* c = CommAt(table_, i);
    // Ranks that left already (destroy_process_group) end nothing.
    std::vector<int> ranks;
    for (uint32_t r = 0; r < c->size; ++r) {
      if (c->members[r].session_id == session_id && present_[i][r])
        ranks.push_back(static_cast<int>(r));
    }
    if (ranks.empty()) continue;
    bool others = false;
    for (uint32_t r = 0; r < c->size; ++r) {
      others |= present_[i][r] && c->members[r].session_id != session_id;
    }
    if (others) {
      const CommMember& m = c->members[ranks[0]];
      const std::string why = absl::StrCat(
          ranks.size() == 1 ? "rank " : "ranks ", absl::StrJoin(ranks, ", "),
          " (pid ", m.pid, ", session ", session_id,
          ") ended while the communicator was in use; its peers' "
          "operations cannot complete");
      LockShared(&c->mu);
      const bool failed_now = FailCommunicator(c, why, wake_fds_, -1);
      pthread_mutex_unlock(&c->mu);
      if (failed_now)
        spdlog::warn("communicator {} failed: {}", c->id.load(), why);
    }
    for (int r : ranks) present_[i][r] = false;
    if (std::none_of(present_[i].begin(), present_[i].end(),
                     [](bool b) { return b; })) {
      ReleaseLocked(i);
    }
  }
}

std::vector<LinkStats> CommunicatorRegistry::Links() const {
  std::vector<LinkStats> out;
  for (uint32_t i = 0; i < table_->num_links; ++i) {
    const LinkCounter& l = table_->links[i];
    out.push_back(
        LinkStats{l.a, l.b, l.axis, l.bytes[0].load(), l.bytes[1].load()});
  }
  return out;
}

std::vector<CommunicatorInfo> CommunicatorRegistry::Communicators() const {
  absl::MutexLock lock(&mu_);
  std::vector<CommunicatorInfo> out;
  for (int i = 0; i < NumComms(); ++i) {
    if (present_[i].empty()) continue;
    const CommSlot& c = *CommAt(table_, i);
    CommunicatorInfo info;
    info.id = c.id.load();
    info.size = static_cast<int>(c.size);
    info.failed = c.state.load() == CommSlot::kFailed;
    if (info.failed)
      info.failure.assign(c.failure, strnlen(c.failure, sizeof(c.failure)));
    for (uint32_t r = 0; r < c.size; ++r) {
      info.chips.push_back(c.members[r].chip);
      info.sessions.push_back(c.members[r].session_id);
      info.ring.push_back(c.ring[r]);
    }
    info.groups_done = c.groups_done.load();
    info.bytes_moved = c.bytes_moved.load();
    out.push_back(std::move(info));
  }
  return out;
}

uint64_t CommunicatorRegistry::collectives_run() const {
  return table_->collectives_run.load();
}

}  // namespace tpud
