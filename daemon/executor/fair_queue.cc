#include "daemon/executor/fair_queue.h"

#include <algorithm>

namespace tpud {

void FairQueue::Push(uint64_t session, int ring) {
  SessionEntry& e = sessions_[session];
  if (e.rings.empty()) {
    // (Re)activating: no banked idle time beyond the credit.
    e.vtime = std::max(e.vtime, now_ - kReturnCreditNs);
    order_.emplace(e.vtime, session);
  }
  e.rings.push_back(ring);
}

std::optional<FairQueue::Pick> FairQueue::Pop() {
  if (order_.empty()) return std::nullopt;
  const auto [vtime, session] = *order_.begin();
  SessionEntry& e = sessions_[session];
  now_ = std::max(now_, vtime);
  Pick pick{session, e.rings.front()};
  e.rings.pop_front();
  if (e.rings.empty()) order_.erase(order_.begin());
  return pick;
}

void FairQueue::Reorder(uint64_t session, SessionEntry& e, double new_vtime) {
  if (!e.rings.empty()) {
    order_.erase({e.vtime, session});
    order_.emplace(new_vtime, session);
  }
  e.vtime = new_vtime;
}

void FairQueue::Charge(uint64_t session, uint64_t busy_ns) {
  auto it = sessions_.find(session);
  if (it == sessions_.end()) return;
  Reorder(session, it->second, it->second.vtime + static_cast<double>(busy_ns));
}

void FairQueue::Forget(uint64_t session) {
  auto it = sessions_.find(session);
  if (it == sessions_.end()) return;
  if (!it->second.rings.empty()) order_.erase({it->second.vtime, session});
  sessions_.erase(it);
}

double FairQueue::vtime(uint64_t session) const {
  auto it = sessions_.find(session);
  return it == sessions_.end() ? 0 : it->second.vtime;
}

}  // namespace tpud
