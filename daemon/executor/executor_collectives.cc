// The executor's side of collectives (see collectives.h): a kCollective
// record posts its group into the rank's slot of the communicator; whoever
// posts last moves the data; the rank's ring waits, parked, until its group
// is done, and then takes its result like any op's.
#include <unistd.h>

#include <algorithm>
#include <cstring>

#include <spdlog/spdlog.h>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "daemon/executor/executor.h"
#include "tpu/device_address.h"

namespace tpud {
namespace {

using tpu::CollectiveKind;

bool IsP2P(CollectiveKind k) { return k == CollectiveKind::kSend || k == CollectiveKind::kRecv; }

bool Reduces(CollectiveKind k) {
  return k == CollectiveKind::kAllReduce || k == CollectiveKind::kReduce ||
         k == CollectiveKind::kReduceScatter;
}

bool Rooted(CollectiveKind k) {
  return k == CollectiveKind::kBroadcast || k == CollectiveKind::kReduce ||
         k == CollectiveKind::kGather || k == CollectiveKind::kScatter;
}


std::string Describe(const PostedOp& op) {
  std::string s = absl::StrCat(tpu::CollectiveKindName(op.kind), "(");
  if (Reduces(op.kind)) absl::StrAppend(&s, tpu::ReduceOpName(op.reduce), ", ");
  absl::StrAppend(&s, DtypeName(op.dtype), ", ", op.count, " elements");
  if (Rooted(op.kind)) absl::StrAppend(&s, ", root ", op.peer);
  if (IsP2P(op.kind)) absl::StrAppend(&s, op.kind == CollectiveKind::kSend ? ", to " : ", from ",
                                      "rank ", op.peer);
  return s + ")";
}


// Calls f(begin, end) for every device range `rank`'s group `g` writes.
template <typename F>
void ForEachOutput(const GroupSlot& g, int size, int rank, F&& f) {
  for (uint32_t q = 0; q < g.num_ops; ++q) {
    uint64_t sb = 0, rb = 0;
    if (!BufferBytes(g.ops[q], g.send_counts, g.recv_counts, size, rank, &sb, &rb).ok() ||
        rb == 0) {
      continue;
    }
    f(g.ops[q].recv, g.ops[q].recv + rb);
  }
}

std::string MemberName(const CommSlot* comm, int r) {
  return absl::StrCat("rank ", r, " (pid ", comm->members[r].pid, ", chip ",
                      comm->members[r].chip, ")");
}

}  // namespace

bool Executor::CollectiveReady(const Ring& ring, uint64_t now) const {
  CommSlot* comm = CommOf(config_.collectives, ring.collective_comm);
  if (comm == nullptr || ring.collective_rank < 0) return true;
  if (comm->state.load() != CommSlot::kReady) return true;
  if (!ring.collective_posted) {
    // Waiting for a free slot of its rank.
    for (int k = 0; k < kSlotsPerRank; ++k) {
      if (comm->slots[ring.collective_rank][k].state.load() == GroupSlot::kFree) return true;
    }
    return false;
  }
  const GroupSlot& slot = comm->slots[ring.collective_rank][ring.collective_slot];
  if (slot.state.load(std::memory_order_acquire) == GroupSlot::kDone) return true;
  return now - slot.posted_ns > comm->timeout_ns;
}

void Executor::WakeRank(const CommSlot* comm, int rank) {
  const int e = comm->members[rank].executor;
  if (e < 0 || e >= static_cast<int>(config_.wake_fds.size()) || e == config_.index) return;
  const uint64_t one = 1;
  (void)!write(config_.wake_fds[e], &one, sizeof(one));
}

void Executor::FinishSlot(CommSlot* comm, int rank, int k, const absl::Status& status) {
  FinishRankSlot(comm, rank, k, status, config_.wake_fds, config_.index);
}

// A group that succeeded completes at once on every rank's ring, so each
// client goes on as soon as the data has moved, without waiting for its own
// executor to be scheduled first (on a host with few cores that wait is most
// of a small collective's latency). Only its record's sequence is published:
// the ring's owner takes the record off the ring later, as usual (it writes
// the same sequence again, and head). That is safe because the ring is
// parked on this very record, which is the next one it completes, and this
// runs before the slot is marked done, after which the owner may go on.
// Where the rank's outputs carry poison from an earlier failure, its owner
// must clear that first: such a rank waits for its owner.
tpu::RingControl* Executor::CompleteForRank(CommSlot* comm, int rank, int k) {
  const GroupSlot& g = comm->slots[rank][k];
  auto it = sessions_.find(comm->members[rank].session_id);
  if (it == sessions_.end()) return nullptr;
  Session& s = *it->second;
  if (g.ring >= s.layout.num_rings || g.record_sequence == 0) return nullptr;
  const int chip = comm->members[rank].chip;
  bool poisoned = false;
  ForEachOutput(g, static_cast<int>(comm->size), rank, [&](uint64_t begin, uint64_t end) {
    std::string cause;
    poisoned = poisoned || FindPoison(s, chip, begin, end, &cause);
  });
  if (poisoned) return nullptr;
  const int ring = static_cast<int>(g.ring);
  TrustedRing* trusted = s.state.ring(ring);
  tpu::RingControl* ctl = tpu::RingControlOf(s.shm.data(), s.layout, ring);
  if (trusted->last_sequence.load(std::memory_order_acquire) + 1 != g.record_sequence) {
    return nullptr;
  }
  trusted->completed_early.store(g.record_sequence, std::memory_order_seq_cst);
  trusted->last_sequence.store(g.record_sequence, std::memory_order_seq_cst);
  ctl->completed.store(g.record_sequence, std::memory_order_seq_cst);
  WakeCompletionWaiters(trusted, ctl);
  return ctl;
}

// Finishes a peer's slot of a group this executor ran. A rank completed
// early needs its executor only to take the record off the ring, which can
// wait for the client's next record: its executor armed the parked ring's
// doorbell before sleeping (Sleep), and looked at the slot after arming. So
// it is woken only if the client has published more already, or if its
// executor is awake anyway (then the wake is free to skip too, but cheap).
void Executor::FinishPeerSlot(CommSlot* comm, int rank, int k, const absl::Status& status) {
  const tpu::RingControl* ctl = status.ok() ? CompleteForRank(comm, rank, k) : nullptr;
  if (ctl == nullptr) {
    FinishSlot(comm, rank, k, status);
    return;
  }
  const uint64_t sequence = comm->slots[rank][k].record_sequence;
  FinishRankSlot(comm, rank, k, status, config_.wake_fds, config_.index, /*wake=*/false);
  const bool quiet = ctl->submitted.load(std::memory_order_seq_cst) == sequence &&
                     ctl->consumer_sleeping.load(std::memory_order_seq_cst) != 0;
  if (!quiet) WakeRank(comm, rank);
}

void Executor::FailComm(CommSlot* comm, const std::string& why) {
  if (FailCommunicator(comm, why, config_.wake_fds, config_.index)) {
    spdlog::warn("communicator {} failed: {}", comm->id.load(), why);
  }
}

absl::StatusOr<char*> Executor::RankRange(const CommSlot* comm, int rank, uint64_t address,
                                          uint64_t bytes, const char* what, bool input,
                                          ResolvedTensor* segment, bool host_access) {
  const CommMember& m = comm->members[rank];
  if (segment != nullptr) *segment = ResolvedTensor{};
  if (bytes == 0) return config_.chip_bases[m.chip];
  const int c = tpu::DeviceAddressChip(address);
  if (c != m.chip) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "rank %d's %s buffer 0x%x is not on its chip %d", rank, what, address, m.chip));
  }
  const uint64_t offset = tpu::DeviceAddressOffset(address);
  SyncReleases();
  const std::optional<PageOwnerTable::Segment> seg = config_.owners[c].Find(offset, bytes, m.tag);
  if (!seg.has_value()) {
    const uint32_t owner = config_.owners[c].OwnerOf(offset);
    const std::string msg = absl::StrFormat(
        "rank %d's %s buffer [0x%x, +%d bytes) is %s", rank, what, address, bytes,
        owner != 0 && owner != m.tag ? "in another session's memory"
                                     : "not inside one of that rank's segments");
    if (owner != 0 && owner != m.tag) return absl::PermissionDeniedError(msg);
    return absl::InvalidArgumentError(msg);
  }
  if (segment != nullptr) {
    *segment = ResolvedTensor{config_.chip_bases[c] + seg->offset,
                              tpu::MakeDeviceAddress(c, seg->offset), seg->bytes, m.session_id};
  }
  // A backend with memory of its own brings the arena's copy up to date (a
  // buffer written here is the arena's from now on).
  if (host_access) {
    if (absl::Status st = config_.backend->HostAccess(address, bytes, !input, m.session_id); !st.ok()) {
      return st;
    }
  }
  if (input) {
    auto it = sessions_.find(m.session_id);
    std::string cause;
    if (it != sessions_.end() && FindPoison(*it->second, c, address, address + bytes, &cause)) {
      return absl::FailedPreconditionError(absl::StrCat(
          "rank ", rank, "'s ", what, " buffer was produced by an op that failed: ", cause));
    }
  }
  return config_.chip_bases[c] + offset;
}

absl::Status Executor::PostGroup(Ring& ring, CommSlot* comm, int rank, uint64_t sequence,
                                 bool* posted) {
  *posted = false;
  const int n = static_cast<int>(comm->size);
  if (LockShared(&comm->mu)) {
    FailComm(comm, "an executor died while running an operation of this communicator");
  }
  struct Unlock {
    pthread_mutex_t* mu;
    ~Unlock() { pthread_mutex_unlock(mu); }
  } unlock{&comm->mu};
  if (comm->id.load() != ring.collective_comm) {
    return absl::NotFoundError("the communicator was destroyed");
  }
  if (comm->state.load() != CommSlot::kReady) {
    return absl::AbortedError(absl::StrCat("communicator failed: ", comm->failure));
  }
  int free_slot = -1;
  for (int k = 0; k < kSlotsPerRank; ++k) {
    GroupSlot& g = comm->slots[rank][k];
    const uint32_t state = g.state.load();
    if (state != GroupSlot::kFree && g.ring == static_cast<uint32_t>(ring.index) &&
        g.record_sequence == sequence) {
      // Ours already: an executor restart re-reads the record.
      ring.collective_slot = k;
      *posted = true;
      return absl::OkStatus();
    }
    if (state == GroupSlot::kFree && free_slot < 0) free_slot = k;
  }
  // Every slot busy: this rank has more groups outstanding on other streams;
  // wait for one of them.
  if (free_slot < 0) return absl::OkStatus();
  const std::vector<tpu::CollectiveEntry>& ops = collective_.ops;
  const bool p2p = IsP2P(ops[0].kind);
  // Arguments only this rank can get wrong. A collective posts anyway, so
  // that its peers fail at once naming this rank instead of waiting.
  absl::Status invalid;
  int all_to_alls = 0;
  if (!p2p && collective_.index == 0) {
    invalid = absl::InvalidArgumentError("a collective group without an index (it starts at 1)");
  }
  for (size_t i = 0; i < ops.size() && invalid.ok(); ++i) {
    const tpu::CollectiveEntry& e = ops[i];
    const std::string at = ops.size() > 1 ? absl::StrCat(" (operation ", i, " of the group)") : "";
    if (IsP2P(e.kind) != p2p) {
      invalid = absl::InvalidArgumentError(
          "a group mixes point-to-point operations with collectives; group them separately");
    } else if ((Rooted(e.kind) || IsP2P(e.kind)) && (e.peer < 0 || e.peer >= n)) {
      invalid = absl::InvalidArgumentError(absl::StrCat(
          tpu::CollectiveKindName(e.kind), IsP2P(e.kind) ? " peer " : " root ", e.peer,
          " is not a rank of this communicator of ", n, " ranks", at));
    } else if (Reduces(e.kind)) {
      invalid = CheckReducible(e.dtype, e.reduce);
    } else if (e.kind == CollectiveKind::kAllToAll) {
      if (static_cast<int>(e.send_counts.size()) != n) {
        invalid = absl::InvalidArgumentError(absl::StrCat(
            "all_to_all with ", e.send_counts.size(), " splits on a communicator of ", n,
            " ranks", at));
      } else if (++all_to_alls > 1) {
        invalid = absl::InvalidArgumentError("a group holds at most one all_to_all");
      }
    }
  }
  if (p2p && !invalid.ok()) return invalid;
  if (!p2p) {
    for (int k = 0; k < kSlotsPerRank; ++k) {
      const GroupSlot& g = comm->slots[rank][k];
      if (g.state.load() != GroupSlot::kFree && !g.p2p && g.index == collective_.index) {
        return absl::InvalidArgumentError(absl::StrCat(
            "collective group #", collective_.index, " was issued twice by this rank"));
      }
    }
  }
  GroupSlot& slot = comm->slots[rank][free_slot];
  slot.num_ops = static_cast<uint32_t>(ops.size());
  slot.p2p = p2p ? 1 : 0;
  slot.ring = static_cast<uint32_t>(ring.index);
  slot.record_sequence = sequence;
  slot.index = p2p ? 0 : collective_.index;
  slot.posted_ns = tpu::MonotonicNanos();
  slot.code = 0;
  slot.message[0] = '\0';
  if (!invalid.ok()) SetSlotMessage(slot, invalid);
  for (size_t i = 0; i < ops.size(); ++i) {
    const tpu::CollectiveEntry& e = ops[i];
    PostedOp& p = slot.ops[i];
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
      std::copy(e.send_counts.begin(), e.send_counts.end(), slot.send_counts);
      std::copy(e.recv_counts.begin(), e.recv_counts.end(), slot.recv_counts);
    }
  }
  slot.state.store(GroupSlot::kPosted, std::memory_order_release);
  ring.collective_slot = free_slot;
  *posted = true;
  RunMet(comm, rank, free_slot);
  return absl::OkStatus();
}

void Executor::RunMet(CommSlot* comm, int rank, int kmine) {
  const int n = static_cast<int>(comm->size);
  GroupSlot& mine = comm->slots[rank][kmine];
  if (mine.p2p) {
    for (uint32_t i = 0; i < mine.num_ops; ++i) {
      PostedOp& a = mine.ops[i];
      if (a.done) continue;
      const CollectiveKind want =
          a.kind == CollectiveKind::kSend ? CollectiveKind::kRecv : CollectiveKind::kSend;
      bool matched = false;
      for (int kp = 0; kp < kSlotsPerRank && !matched; ++kp) {
        GroupSlot& peer = comm->slots[a.peer][kp];
        if (peer.state.load() != GroupSlot::kPosted || !peer.p2p) continue;
        for (uint32_t j = 0; j < peer.num_ops; ++j) {
          const PostedOp& b = peer.ops[j];
          if (b.done || b.kind != want || b.peer != rank || b.pair_index != a.pair_index ||
              (&peer == &mine && j == i)) {
            continue;
          }
          RunP2P(comm, rank, kmine, static_cast<int>(i), a.peer, kp, static_cast<int>(j));
          matched = true;
          break;
        }
      }
    }
    // Every group whose operations are all done is finished.
    for (int r = 0; r < n; ++r) {
      for (int k = 0; k < kSlotsPerRank; ++k) {
        GroupSlot& g = comm->slots[r][k];
        if (g.state.load() != GroupSlot::kPosted || !g.p2p) continue;
        bool all = true;
        for (uint32_t q = 0; q < g.num_ops && all; ++q) all = g.ops[q].done != 0;
        if (!all) continue;
        const absl::Status st(static_cast<absl::StatusCode>(g.code), g.message);
        if (r != rank) {
          FinishPeerSlot(comm, r, k, st);
        } else {
          FinishSlot(comm, r, k, st);
        }
      }
    }
    return;
  }
  // A collective runs once every rank has posted the group of the same index.
  const uint64_t index = mine.index;
  std::vector<int> at(n, -1);
  for (int r = 0; r < n; ++r) {
    for (int k = 0; k < kSlotsPerRank; ++k) {
      const GroupSlot& g = comm->slots[r][k];
      if (g.state.load() == GroupSlot::kPosted && !g.p2p && g.index == index) at[r] = k;
    }
    if (at[r] < 0) return;
  }
  auto slot_of = [&](int r) -> GroupSlot& { return comm->slots[r][at[r]]; };
  auto finish_all = [&](const absl::Status& st) {
    for (int r = 0; r < n; ++r) {
      if (r != rank) {
        FinishPeerSlot(comm, r, at[r], st);
      } else {
        FinishSlot(comm, r, at[r], st);
      }
    }
  };
  const std::string where = absl::StrCat("collective #", index, " on communicator ",
                                         comm->id.load());
  for (int r = 0; r < n; ++r) {
    const GroupSlot& s = slot_of(r);
    if (s.code != 0) {
      return finish_all(absl::Status(static_cast<absl::StatusCode>(s.code),
                                     absl::StrCat(where, ": rank ", r, ": ", s.message)));
    }
  }
  // The same operations on every rank.
  const GroupSlot& first = slot_of(0);
  for (int r = 1; r < n; ++r) {
    const GroupSlot& s = slot_of(r);
    if (s.num_ops != first.num_ops) {
      return finish_all(absl::InvalidArgumentError(absl::StrCat(
          where, " does not match across ranks: rank 0 groups ", first.num_ops,
          " operations, rank ", r, " groups ", s.num_ops)));
    }
    for (uint32_t q = 0; q < s.num_ops; ++q) {
      const PostedOp& a = first.ops[q];
      const PostedOp& b = s.ops[q];
      const bool same = a.kind == b.kind && a.dtype == b.dtype &&
                        (a.kind == CollectiveKind::kAllToAll || a.count == b.count) &&
                        (!Reduces(a.kind) || a.reduce == b.reduce) &&
                        (!Rooted(a.kind) || a.peer == b.peer);
      if (!same) {
        const std::string op_at = s.num_ops > 1 ? absl::StrCat(" (operation ", q, ")") : "";
        return finish_all(absl::InvalidArgumentError(absl::StrCat(
            where, " does not match across ranks", op_at, ": rank 0 calls ", Describe(a),
            ", rank ", r, " calls ", Describe(b))));
      }
    }
  }
  for (uint32_t q = 0; q < first.num_ops; ++q) {
    if (first.ops[q].kind != CollectiveKind::kAllToAll) continue;
    for (int i = 0; i < n; ++i) {
      for (int j = 0; j < n; ++j) {
        if (slot_of(i).send_counts[j] != slot_of(j).recv_counts[i]) {
          return finish_all(absl::InvalidArgumentError(absl::StrCat(
              where, ": all_to_all splits do not match: rank ", i, " sends ",
              slot_of(i).send_counts[j], " elements to rank ", j, ", which expects ",
              slot_of(j).recv_counts[i])));
        }
      }
    }
  }
  // The fence: every rank's session tag is published before its page owners
  // are read (as in BeginOp), so none of their memory is freed under us.
  for (int r = 0; r < n; ++r) {
    slot_->collective_tags[r].store(comm->members[r].tag, std::memory_order_seq_cst);
  }
  const char* name = tpu::CollectiveKindName(first.ops[0].kind);
  std::memcpy(slot_->current_op, name, std::strlen(name) + 1);
  slot_->current_session.store(comm->members[rank].session_id, std::memory_order_relaxed);
  slot_->op_started_ns.store(tpu::MonotonicNanos(), std::memory_order_release);
  absl::Status result;
  std::vector<const PostedOp*> ops(n);
  std::vector<char*> send(n), recv(n);
  std::vector<const int64_t*> send_counts(n), recv_counts(n);
  for (uint32_t q = 0; q < first.num_ops && result.ok(); ++q) {
    CollectiveCall call;
    call.kind = first.ops[q].kind;
    call.reduce = first.ops[q].reduce;
    call.dtype = first.ops[q].dtype;
    call.count = first.ops[q].count;
    call.root = first.ops[q].peer;
    call.ranks.resize(n);
    for (int r = 0; r < n && result.ok(); ++r) {
      const GroupSlot& s = slot_of(r);
      ops[r] = &s.ops[q];
      send_counts[r] = s.send_counts;
      recv_counts[r] = s.recv_counts;
      uint64_t sb = 0, rb = 0;
      result = BufferBytes(s.ops[q], s.send_counts, s.recv_counts, n, r, &sb, &rb);
      if (!result.ok()) break;
      CollectiveRank& cr = call.ranks[r];
      cr.chip = comm->members[r].chip;
      // Checked here; the arena's copies are brought up to date only if the
      // data moves there (below).
      absl::StatusOr<char*> sp = RankRange(comm, r, s.ops[q].send, sb, "send", /*input=*/true,
                                           &cr.send_segment, /*host_access=*/false);
      if (!sp.ok()) {
        result = sp.status();
        break;
      }
      absl::StatusOr<char*> rp = RankRange(comm, r, s.ops[q].recv, rb, "recv", /*input=*/false,
                                           &cr.recv_segment, /*host_access=*/false);
      if (!rp.ok()) {
        result = rp.status();
        break;
      }
      send[r] = *sp;
      recv[r] = *rp;
      cr.send = s.ops[q].send;
      cr.send_bytes = sb;
      cr.recv = s.ops[q].recv;
      cr.recv_bytes = rb;
      cr.host_send = *sp;
      cr.host_recv = *rp;
      if (s.ops[q].kind == CollectiveKind::kAllToAll && sb != 0 && rb != 0 &&
          send[r] < recv[r] + rb && recv[r] < send[r] + sb) {
        result = absl::InvalidArgumentError(absl::StrCat(
            "rank ", r, "'s all_to_all send and recv buffers overlap; use separate tensors"));
      }
      if (s.ops[q].kind == CollectiveKind::kAllToAll) {
        call.send_counts.emplace_back(s.send_counts, s.send_counts + n);
      }
    }
    if (!result.ok()) break;
    // A backend that runs collectives as programs of its own (PJRT) moves
    // the data on its devices.
    absl::StatusOr<bool> ran = config_.backend->RunCollective(call);
    if (!ran.ok()) {
      result = ran.status();
      break;
    }
    if (*ran) {
      CountCollectiveTraffic(config_.collectives, comm, *ops[0], send_counts);
      continue;
    }
    for (int r = 0; r < n && result.ok(); ++r) {
      const CollectiveRank& cr = call.ranks[r];
      const uint64_t owner = comm->members[r].session_id;
      result = config_.backend->HostAccess(cr.send, cr.send_bytes, /*write=*/false, owner);
      if (result.ok()) result = config_.backend->HostAccess(cr.recv, cr.recv_bytes, /*write=*/true, owner);
    }
    if (!result.ok()) break;
    RunCollective(config_.collectives, comm, ops, send, recv, send_counts, recv_counts,
                  &collective_scratch_);
  }
  config_.collectives->collectives_run.fetch_add(1, std::memory_order_relaxed);
  slot_->op_started_ns.store(0, std::memory_order_relaxed);
  for (int r = 0; r < n; ++r) slot_->collective_tags[r].store(0, std::memory_order_seq_cst);
  if (slot_->fence_waiters.load(std::memory_order_seq_cst) != 0) {
    slot_->op_epoch.fetch_add(1);
    tpu::FutexWakeAll(&slot_->op_epoch);
  }
  if (!result.ok()) {
    result = absl::Status(result.code(), absl::StrCat(where, " (", name, "): ", result.message()));
  }
  finish_all(result);
}

void Executor::RunP2P(CommSlot* comm, int a, int ka, int ia, int b, int kb, int ib) {
  GroupSlot& sa = comm->slots[a][ka];
  GroupSlot& sb = comm->slots[b][kb];
  PostedOp& oa = sa.ops[ia];
  PostedOp& ob = sb.ops[ib];
  const bool a_sends = oa.kind == CollectiveKind::kSend;
  const int sender = a_sends ? a : b, receiver = a_sends ? b : a;
  const PostedOp& snd = a_sends ? oa : ob;
  const PostedOp& rcv = a_sends ? ob : oa;
  oa.done = 1;
  ob.done = 1;
  absl::Status st;
  if (snd.dtype != rcv.dtype || snd.count != rcv.count) {
    st = absl::InvalidArgumentError(absl::StrCat(
        "send/recv #", snd.pair_index + 1, " from rank ", sender, " to rank ", receiver,
        " does not match: the sender sends ", snd.count, " ", DtypeName(snd.dtype),
        " elements, the receiver expects ", rcv.count, " ", DtypeName(rcv.dtype)));
  } else if (snd.count > (uint64_t{1} << 44)) {
    st = absl::InvalidArgumentError("send of more elements than any chip holds");
  } else {
    const uint64_t bytes = snd.count * static_cast<uint64_t>(tpu::ElementSize(snd.dtype));
    slot_->collective_tags[0].store(comm->members[sender].tag, std::memory_order_seq_cst);
    slot_->collective_tags[1].store(comm->members[receiver].tag, std::memory_order_seq_cst);
    absl::StatusOr<char*> src = RankRange(comm, sender, snd.send, bytes, "send", true);
    absl::StatusOr<char*> dst =
        src.ok() ? RankRange(comm, receiver, rcv.recv, bytes, "recv", false) : src;
    if (!src.ok() || !dst.ok()) {
      st = !src.ok() ? src.status() : dst.status();
    } else {
      std::memmove(*dst, *src, bytes);
      CountRoute(config_.collectives, comm, sender, receiver, bytes);
      comm->bytes_moved.fetch_add(bytes, std::memory_order_relaxed);
    }
    slot_->collective_tags[0].store(0, std::memory_order_seq_cst);
    slot_->collective_tags[1].store(0, std::memory_order_seq_cst);
    if (slot_->fence_waiters.load(std::memory_order_seq_cst) != 0) {
      slot_->op_epoch.fetch_add(1);
      tpu::FutexWakeAll(&slot_->op_epoch);
    }
  }
  if (!st.ok()) {
    if (sa.code == 0) SetSlotMessage(sa, st);
    if (sb.code == 0) SetSlotMessage(sb, st);
  }
}

void Executor::PoisonCollectiveOutputs(Ring& ring, const std::string& cause, bool clear) {
  CommSlot* comm = CommOf(config_.collectives, ring.collective_comm);
  if (comm == nullptr) return;
  const int rank = ring.collective_rank;
  const GroupSlot& slot = comm->slots[rank][ring.collective_slot];
  Session& s = *ring.session;
  ForEachOutput(slot, static_cast<int>(comm->size), rank, [&](uint64_t begin, uint64_t end) {
    if (clear) {
      ClearPoison(s, ring.chip, begin, end);
    } else {
      AddPoison(s, ring.chip, begin, end, cause);
    }
  });
}

absl::Status Executor::StepCollective(Ring& ring, uint64_t sequence, absl::string_view record,
                                      bool* done, bool* malformed) {
  *done = false;
  *malformed = false;
  auto finish = [&](absl::Status st) {
    *done = true;
    ring.in_collective = false;
    ring.collective_posted = false;
    ring.collective_rank = -1;
    ring.collective_slot = -1;
    return st;
  };
  const bool first_visit = !ring.in_collective || ring.collective_sequence != sequence;
  if (first_visit || !ring.collective_posted) {
    if (absl::Status st = tpu::DecodeCollective(record, &collective_); !st.ok()) {
      *malformed = true;
      return finish(st);
    }
  }
  if (first_visit) {
    ring.in_collective = true;
    ring.collective_posted = false;
    ring.collective_sequence = sequence;
    ring.collective_comm = collective_.communicator;
    ring.collective_rank = -1;
    ring.collective_slot = -1;
    if (config_.collectives == nullptr) {
      return finish(absl::FailedPreconditionError("this tpud runs no collectives"));
    }
    CommSlot* comm = CommOf(config_.collectives, collective_.communicator);
    if (comm == nullptr) {
      return finish(absl::NotFoundError(absl::StrCat(
          "communicator ", collective_.communicator, " does not exist (destroyed, or never formed)")));
    }
    for (uint32_t r = 0; r < comm->size; ++r) {
      if (comm->members[r].session_id == ring.session->id && comm->members[r].chip == ring.chip) {
        ring.collective_rank = static_cast<int>(r);
        break;
      }
    }
    if (ring.collective_rank < 0) {
      return finish(absl::PermissionDeniedError(absl::StrCat(
          "this session has no rank on chip ", ring.chip, " in communicator ",
          collective_.communicator, "; join it first")));
    }
  }
  CommSlot* comm = CommOf(config_.collectives, ring.collective_comm);
  if (comm == nullptr) return finish(absl::NotFoundError("the communicator was destroyed"));
  const int rank = ring.collective_rank;
  if (!ring.collective_posted) {
    bool posted = false;
    if (absl::Status st = PostGroup(ring, comm, rank, sequence, &posted); !st.ok()) {
      return finish(st);
    }
    if (!posted) {
      if (comm->state.load() != CommSlot::kReady) {
        return finish(absl::AbortedError(absl::StrCat("communicator failed: ", comm->failure)));
      }
      return absl::OkStatus();  // every slot of this rank is busy: wait for one
    }
    ring.collective_posted = true;
  }
  GroupSlot& slot = comm->slots[rank][ring.collective_slot];
  if (slot.state.load(std::memory_order_acquire) != GroupSlot::kDone &&
      tpu::MonotonicNanos() - slot.posted_ns > comm->timeout_ns) {
    if (LockShared(&comm->mu)) {
      FailComm(comm, "an executor died while running an operation of this communicator");
    }
    if (slot.state.load() == GroupSlot::kPosted) {
      // Who never came.
      std::vector<std::string> missing;
      for (uint32_t r = 0; r < comm->size; ++r) {
        if (static_cast<int>(r) == rank) continue;
        bool involved = !slot.p2p;
        if (slot.p2p) {
          for (uint32_t q = 0; q < slot.num_ops; ++q) {
            involved |= !slot.ops[q].done && slot.ops[q].peer == static_cast<int32_t>(r);
          }
        }
        if (!involved) continue;
        bool met = false;
        if (!slot.p2p) {
          for (int k = 0; k < kSlotsPerRank; ++k) {
            const GroupSlot& o = comm->slots[r][k];
            met |= o.state.load() != GroupSlot::kFree && !o.p2p && o.index == slot.index;
          }
        }
        if (!met) missing.push_back(MemberName(comm, static_cast<int>(r)));
      }
      FailComm(comm, absl::StrCat(
          slot.p2p ? std::string("point-to-point operations")
                   : absl::StrCat("collective #", slot.index, " (",
                                  tpu::CollectiveKindName(slot.ops[0].kind), ")"),
          " of rank ", rank, " timed out after ", comm->timeout_ns / 1000000000,
          " s on communicator ", comm->id.load(), ": waiting for ",
          absl::StrJoin(missing, ", "), ", which did not take part"));
    }
    pthread_mutex_unlock(&comm->mu);
  }
  if (slot.state.load(std::memory_order_acquire) != GroupSlot::kDone) return absl::OkStatus();
  if (LockShared(&comm->mu)) {
    FailComm(comm, "an executor died while running an operation of this communicator");
  }
  const absl::Status result(static_cast<absl::StatusCode>(slot.code), slot.message);
  PoisonCollectiveOutputs(ring, std::string(result.message()), result.ok());
  slot.state.store(GroupSlot::kFree, std::memory_order_release);
  pthread_mutex_unlock(&comm->mu);
  return finish(result);
}

}  // namespace tpud
