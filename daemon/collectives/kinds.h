// Facts about each kind of collective operation (tpu::CollectiveKind), the
// one place the daemon asks them: which kinds pair two ranks, which reduce,
// which have a root.
#ifndef TPUD_DAEMON_COLLECTIVES_KINDS_H_
#define TPUD_DAEMON_COLLECTIVES_KINDS_H_

#include "tpu/op_record.h"

namespace tpud {

// send and recv: matched pairwise, not by every rank of the communicator.
constexpr bool IsP2P(tpu::CollectiveKind k) {
  return k == tpu::CollectiveKind::kSend || k == tpu::CollectiveKind::kRecv;
}

// Kinds that combine the ranks' values with a ReduceOp.
constexpr bool Reduces(tpu::CollectiveKind k) {
  return k == tpu::CollectiveKind::kAllReduce ||
         k == tpu::CollectiveKind::kReduce ||
         k == tpu::CollectiveKind::kReduceScatter;
}

// Kinds whose data starts or ends at one rank, the root (the entry's peer).
constexpr bool Rooted(tpu::CollectiveKind k) {
  return k == tpu::CollectiveKind::kBroadcast ||
         k == tpu::CollectiveKind::kReduce ||
         k == tpu::CollectiveKind::kGather ||
         k == tpu::CollectiveKind::kScatter;
}

}  // namespace tpud

#endif  // TPUD_DAEMON_COLLECTIVES_KINDS_H_
