#include "daemon/collectives/groups.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "daemon/collectives/kinds.h"
#include "daemon/collectives/reduction.h"
#include "tpu/dtype.h"

namespace tpud {

using tpu::CollectiveKind;

absl::Status BufferBytes(const PostedOp& op, const int64_t* send_counts,
                         const int64_t* recv_counts, int n, int rank,
                         uint64_t* send_bytes, uint64_t* recv_bytes) {
  const uint64_t esize = static_cast<uint64_t>(tpu::ElementSize(op.dtype));
  // Bounded so that n * count * esize cannot overflow: no chip has 2^48 bytes.
  constexpr uint64_t kMaxBytes = uint64_t{1} << 48;
  auto bytes = [&](uint64_t elements, uint64_t* out) -> absl::Status {
    if (elements > kMaxBytes / std::max<uint64_t>(esize, 1)) {
      return absl::InvalidArgumentError(
          absl::StrCat(tpu::CollectiveKindName(op.kind), " of ", elements,
                       " elements is larger than any chip's memory"));
    }
    *out = elements * esize;
    return absl::OkStatus();
  };
  const uint64_t size = static_cast<uint64_t>(n);
  if (op.count > kMaxBytes) return bytes(op.count, send_bytes);
  const bool root = op.peer == rank;
  *send_bytes = 0;
  *recv_bytes = 0;
  switch (op.kind) {
    case CollectiveKind::kAllReduce:
      if (absl::Status s = bytes(op.count, send_bytes); !s.ok()) return s;
      return bytes(op.count, recv_bytes);
    case CollectiveKind::kBroadcast:
      if (root) {
        if (absl::Status s = bytes(op.count, send_bytes); !s.ok()) return s;
      }
      return bytes(op.count, recv_bytes);
    case CollectiveKind::kReduce:
      if (absl::Status s = bytes(op.count, send_bytes); !s.ok()) return s;
      return root ? bytes(op.count, recv_bytes) : absl::OkStatus();
    case CollectiveKind::kAllGather:
      if (absl::Status s = bytes(op.count, send_bytes); !s.ok()) return s;
      return bytes(op.count * size, recv_bytes);
    case CollectiveKind::kReduceScatter:
      if (absl::Status s = bytes(op.count * size, send_bytes); !s.ok())
        return s;
      return bytes(op.count, recv_bytes);
    case CollectiveKind::kGather:
      if (absl::Status s = bytes(op.count, send_bytes); !s.ok()) return s;
      return root ? bytes(op.count * size, recv_bytes) : absl::OkStatus();
    case CollectiveKind::kScatter:
      if (root) {
        if (absl::Status s = bytes(op.count * size, send_bytes); !s.ok())
          return s;
      }
      return bytes(op.count, recv_bytes);
    case CollectiveKind::kAllToAll: {
      uint64_t sends = 0, recvs = 0;
      for (int j = 0; j < n; ++j) {
        sends += static_cast<uint64_t>(send_counts[j]);
        recvs += static_cast<uint64_t>(recv_counts[j]);
        if (sends > kMaxBytes || recvs > kMaxBytes)
          return bytes(kMaxBytes + 1, send_bytes);
      }
      if (absl::Status s = bytes(sends, send_bytes); !s.ok()) return s;
      return bytes(recvs, recv_bytes);
    }
    case CollectiveKind::kBarrier:
      return absl::OkStatus();
    case CollectiveKind::kSend:
      return bytes(op.count, send_bytes);
    case CollectiveKind::kRecv:
      return bytes(op.count, recv_bytes);
  }
  return absl::OkStatus();
}

absl::Status CheckOwnGroup(const tpu::DecodedCollective& group, int n) {
  const std::vector<tpu::CollectiveEntry>& ops = group.ops;
  const bool p2p = IsP2P(ops[0].kind);
  absl::Status invalid;
  int all_to_alls = 0;
  if (!p2p && group.index == 0) {
    invalid = absl::InvalidArgumentError(
        "a collective group without an index (it starts at 1)");
  }
  for (size_t i = 0; i < ops.size() && invalid.ok(); ++i) {
    const tpu::CollectiveEntry& e = ops[i];
    const std::string at =
        ops.size() > 1 ? absl::StrCat(" (operation ", i, " of the group)") : "";
    if (IsP2P(e.kind) != p2p) {
      invalid = absl::InvalidArgumentError(
          "a group mixes point-to-point operations with collectives; group "
          "them separately");
    } else if ((Rooted(e.kind) || IsP2P(e.kind)) &&
               (e.peer < 0 || e.peer >= n)) {
      invalid = absl::InvalidArgumentError(absl::StrCat(
          tpu::CollectiveKindName(e.kind), IsP2P(e.kind) ? " peer " : " root ",
          e.peer, " is not a rank of this communicator of ", n, " ranks", at));
    } else if (Reduces(e.kind)) {
      invalid = CheckReducible(tpu::DTypeFromCode(e.dtype), e.reduce);
    } else if (e.kind == CollectiveKind::kAllToAll) {
      if (static_cast<int>(e.send_counts.size()) != n) {
        invalid = absl::InvalidArgumentError(
            absl::StrCat("all_to_all with ", e.send_counts.size(),
                         " splits on a communicator of ", n, " ranks", at));
      } else if (++all_to_alls > 1) {
        invalid =
            absl::InvalidArgumentError("a group holds at most one all_to_all");
      }
    }
  }
  return invalid;
}

absl::Status CheckNotIssuedTwice(const CommSlot& comm, int rank,
                                 uint64_t index) {
  for (int k = 0; k < kSlotsPerRank; ++k) {
    const GroupSlot& g = comm.slots[rank][k];
    if (g.state.load() != GroupSlot::kFree && !g.p2p && g.index == index) {
      return absl::InvalidArgumentError(absl::StrCat(
          "collective group #", index, " was issued twice by this rank"));
    }
  }
  return absl::OkStatus();
}

void WriteGroup(const tpu::DecodedCollective& group, uint32_t ring,
                uint64_t sequence, uint64_t posted_ns,
                const absl::Status& invalid, GroupSlot* slot) {
  const std::vector<tpu::CollectiveEntry>& ops = group.ops;
  const bool p2p = IsP2P(ops[0].kind);
  slot->num_ops = static_cast<uint32_t>(ops.size());
  slot->p2p = p2p ? 1 : 0;
  slot->ring = ring;
  slot->record_sequence = sequence;
  slot->index = p2p ? 0 : group.index;
  slot->posted_ns = posted_ns;
  slot->code = 0;
  slot->message[0] = '\0';
  if (!invalid.ok()) SetSlotMessage(*slot, invalid);
  for (size_t i = 0; i < ops.size(); ++i) {
    const tpu::CollectiveEntry& e = ops[i];
    PostedOp& p = slot->ops[i];
    p.kind = e.kind;
    p.reduce = e.reduce;
    p.dtype = e.dtype;
    p.done = 0;
    p.peer = e.peer;
    p.count = e.count;
    p.send = e.send;
    p.recv = e.recv;
    p.pair_index = e.pair_sequence;
    if (e.kind == CollectiveKind::kAllToAll && invalid.ok()) {
      std::copy(e.send_counts.begin(), e.send_counts.end(), slot->send_counts);
      std::copy(e.recv_counts.begin(), e.recv_counts.end(), slot->recv_counts);
    }
  }
  slot->state.store(GroupSlot::kPosted, std::memory_order_release);
}

void ForEachOutput(const GroupSlot& g, int size, int rank,
                   absl::FunctionRef<void(uint64_t, uint64_t)> f) {
  for (uint32_t q = 0; q < g.num_ops; ++q) {
    uint64_t sb = 0, rb = 0;
    if (!BufferBytes(g.ops[q], g.send_counts, g.recv_counts, size, rank, &sb,
                     &rb)
             .ok() ||
        rb == 0) {
      continue;
    }
    f(g.ops[q].recv, g.ops[q].recv + rb);
  }
}

bool FindMetGroups(const CommSlot& comm, uint64_t index, std::vector<int>* at) {
  const int n = static_cast<int>(comm.size);
  at->assign(n, -1);
  for (int r = 0; r < n; ++r) {
    for (int k = 0; k < kSlotsPerRank; ++k) {
      const GroupSlot& g = comm.slots[r][k];
      if (g.state.load() == GroupSlot::kPosted && !g.p2p && g.index == index)
        (*at)[r] = k;
    }
    if ((*at)[r] < 0) return false;
  }
  return true;
}

absl::Status CheckGroupsAgree(const CommSlot& comm, const std::vector<int>& at,
                              const std::string& where) {
  const int n = static_cast<int>(comm.size);
  auto slot_of = [&](int r) -> const GroupSlot& {
    return comm.slots[r][at[r]];
  };
  for (int r = 0; r < n; ++r) {
    const GroupSlot& s = slot_of(r);
    if (s.code != 0) {
      return absl::Status(static_cast<absl::StatusCode>(s.code),
                          absl::StrCat(where, ": rank ", r, ": ", s.message));
    }
  }
  // The same operations on every rank.
  const GroupSlot& first = slot_of(0);
  for (int r = 1; r < n; ++r) {
    const GroupSlot& s = slot_of(r);
    if (s.num_ops != first.num_ops) {
      return absl::InvalidArgumentError(absl::StrCat(
          where, " does not match across ranks: rank 0 groups ", first.num_ops,
          " operations, rank ", r, " groups ", s.num_ops));
    }
    for (uint32_t q = 0; q < s.num_ops; ++q) {
      const PostedOp& a = first.ops[q];
      const PostedOp& b = s.ops[q];
      const bool same =
          a.kind == b.kind && a.dtype == b.dtype &&
          (a.kind == CollectiveKind::kAllToAll || a.count == b.count) &&
          (!Reduces(a.kind) || a.reduce == b.reduce) &&
          (!Rooted(a.kind) || a.peer == b.peer);
      if (!same) {
        const std::string op_at =
            s.num_ops > 1 ? absl::StrCat(" (operation ", q, ")") : "";
        return absl::InvalidArgumentError(absl::StrCat(
            where, " does not match across ranks", op_at, ": rank 0 calls ",
            DescribeOp(a), ", rank ", r, " calls ", DescribeOp(b)));
      }
    }
  }
  for (uint32_t q = 0; q < first.num_ops; ++q) {
    if (first.ops[q].kind != CollectiveKind::kAllToAll) continue;
    for (int i = 0; i < n; ++i) {
      for (int j = 0; j < n; ++j) {
        if (slot_of(i).send_counts[j] != slot_of(j).recv_counts[i]) {
          return absl::InvalidArgumentError(absl::StrCat(
              where, ": all_to_all splits do not match: rank ", i, " sends ",
              slot_of(i).send_counts[j], " elements to rank ", j,
              ", which expects ", slot_of(j).recv_counts[i]));
        }
      }
    }
  }
  return absl::OkStatus();
}

void MatchPointToPoint(
    CommSlot* comm, int rank, int ka,
    absl::FunctionRef<void(int ka, int ia, int peer, int kb, int ib)> run) {
  GroupSlot& mine = comm->slots[rank][ka];
  for (uint32_t i = 0; i < mine.num_ops; ++i) {
    PostedOp& a = mine.ops[i];
    if (a.done) continue;
    const CollectiveKind want = a.kind == CollectiveKind::kSend
                                    ? CollectiveKind::kRecv
                                    : CollectiveKind::kSend;
    bool matched = false;
    for (int kp = 0; kp < kSlotsPerRank && !matched; ++kp) {
      GroupSlot& peer = comm->slots[a.peer][kp];
      if (peer.state.load() != GroupSlot::kPosted || !peer.p2p) continue;
      for (uint32_t j = 0; j < peer.num_ops; ++j) {
        const PostedOp& b = peer.ops[j];
        if (b.done || b.kind != want || b.peer != rank ||
            b.pair_index != a.pair_index || (&peer == &mine && j == i)) {
          continue;
        }
        run(ka, static_cast<int>(i), a.peer, kp, static_cast<int>(j));
        matched = true;
        break;
      }
    }
  }
}

void ForEachCompletedPointToPoint(const CommSlot& comm,
                                  absl::FunctionRef<void(int, int)> f) {
  const int n = static_cast<int>(comm.size);
  for (int r = 0; r < n; ++r) {
    for (int k = 0; k < kSlotsPerRank; ++k) {
      const GroupSlot& g = comm.slots[r][k];
      if (g.state.load() != GroupSlot::kPosted || !g.p2p) continue;
      bool all = true;
      for (uint32_t q = 0; q < g.num_ops && all; ++q) all = g.ops[q].done != 0;
      if (!all) continue;
      f(r, k);
    }
  }
}

absl::Status CheckPair(const PostedOp& send, const PostedOp& recv, int sender,
                       int receiver) {
  if (send.dtype != recv.dtype || send.count != recv.count) {
    return absl::InvalidArgumentError(absl::StrCat(
        "send/recv #", send.pair_index + 1, " from rank ", sender, " to rank ",
        receiver, " does not match: the sender sends ", send.count, " ",
        tpu::DTypeName(tpu::DTypeFromCode(send.dtype)),
        " elements, the receiver expects ", recv.count, " ",
        tpu::DTypeName(tpu::DTypeFromCode(recv.dtype))));
  }
  if (send.count > (uint64_t{1} << 44)) {
    return absl::InvalidArgumentError(
        "send of more elements than any chip holds");
  }
  return absl::OkStatus();
}

std::string DescribeOp(const PostedOp& op) {
  std::string s = absl::StrCat(tpu::CollectiveKindName(op.kind), "(");
  if (Reduces(op.kind)) absl::StrAppend(&s, tpu::ReduceOpName(op.reduce), ", ");
  absl::StrAppend(&s, tpu::DTypeName(tpu::DTypeFromCode(op.dtype)), ", ",
                  op.count, " elements");
  if (Rooted(op.kind)) absl::StrAppend(&s, ", root ", op.peer);
  if (IsP2P(op.kind)) {
    absl::StrAppend(&s, op.kind == CollectiveKind::kSend ? ", to " : ", from ",
                    "rank ", op.peer);
  }
  return s + ")";
}

std::string MemberName(const CommSlot& comm, int rank) {
  return absl::StrCat("rank ", rank, " (pid ", comm.members[rank].pid,
                      ", chip ", comm.members[rank].chip, ")");
}

std::string TimeoutMessage(const CommSlot& comm, int rank,
                           const GroupSlot& slot) {
  // Who never came.
  std::vector<std::string> missing;
  for (uint32_t r = 0; r < comm.size; ++r) {
    if (static_cast<int>(r) == rank) continue;
    bool involved = !slot.p2p;
    if (slot.p2p) {
      for (uint32_t q = 0; q < slot.num_ops; ++q) {
        involved |=
            !slot.ops[q].done && slot.ops[q].peer == static_cast<int32_t>(r);
      }
    }
    if (!involved) continue;
    bool met = false;
    if (!slot.p2p) {
      for (int k = 0; k < kSlotsPerRank; ++k) {
        const GroupSlot& o = comm.slots[r][k];
        met |= o.state.load() != GroupSlot::kFree && !o.p2p &&
               o.index == slot.index;
      }
    }
    if (!met) missing.push_back(MemberName(comm, static_cast<int>(r)));
  }
  return absl::StrCat(
      slot.p2p ? std::string("point-to-point operations")
               : absl::StrCat("collective #", slot.index, " (",
                              tpu::CollectiveKindName(slot.ops[0].kind), ")"),
      " of rank ", rank, " timed out after ", comm.timeout_ns / 1000000000,
      " s on communicator ", comm.id.load(), ": waiting for ",
      absl::StrJoin(missing, ", "), ", which did not take part");
}

}  // namespace tpud
