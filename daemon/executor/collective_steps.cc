// The executor's steps of collectives: a kCollective record posts its group
// into the rank's slot of the communicator (daemon/collectives/groups.h);
// whoever posts last checks the meeting, resolves every rank's buffers
// against that rank's session and moves the data (the backend's own
// program, or daemon/collectives/algorithms.h in the arena); the rank's
// ring waits, parked, until its group is done, and then takes its result
// like any op's. What needs no executor state (checks, matching, messages)
// lives in daemon/collectives/; what stays here touches the executor's
// sessions, rings, poison, fence and backend.
#include <pthread.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "daemon/collectives/algorithms.h"
#include "daemon/collectives/groups.h"
#include "daemon/collectives/kinds.h"
#include "daemon/executor/executor.h"
#include "tpu/device_address.h"

namespace tpud {

using tpu::CollectiveKind;

bool Executor::CollectiveReady(const Ring& ring, uint64_t now) const {
  CommSlot* comm = CommOf(config_.collectives, ring.collective_comm);
  if (comm == nullptr || ring.collective_rank < 0) return true;
  if (comm->state.load() != CommSlot::kReady) return true;
  if (!ring.collective_posted) {
    // Waiting for a free slot of its rank.
    for (int k = 0; k < kSlotsPerRank; ++k) {
      if (comm->slots[ring.collective_rank][k].state.load() == GroupSlot::kFree)
        return true;
    }
    return false;
  }
  const GroupSlot& slot =
      comm->slots[ring.collective_rank][ring.collective_slot];
  if (slot.state.load(std::memory_order_acquire) == GroupSlot::kDone)
    return true;
  return now - slot.posted_ns > comm->timeout_ns;
}

void Executor::WakeRank(const CommSlot* comm, int rank) {
  WakeExecutor(config_.wake_fds, comm->members[rank].executor, config_.index);
}

void Executor::FinishSlot(CommSlot* comm, int rank, int k,
                          const absl::Status& status) {
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
  ForEachOutput(
      g, static_cast<int>(comm->size), rank, [&](uint64_t begin, uint64_t end) {
        std::string cause;
        poisoned = poisoned || FindPoison(s, chip, begin, end, &cause);
      });
  if (poisoned) return nullptr;
  const int ring = static_cast<int>(g.ring);
  TrustedRing* trusted = s.state.ring(ring);
  tpu::RingControl* ctl = tpu::RingControlOf(s.shm.data(), s.layout, ring);
  if (trusted->last_sequence.load(std::memory_order_acquire) + 1 !=
      g.record_sequence) {
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
void Executor::FinishPeerSlot(CommSlot* comm, int rank, int k,
                              const absl::Status& status) {
  const tpu::RingControl* ctl =
      status.ok() ? CompleteForRank(comm, rank, k) : nullptr;
  if (ctl == nullptr) {
    FinishSlot(comm, rank, k, status);
    return;
  }
  const uint64_t sequence = comm->slots[rank][k].record_sequence;
  FinishRankSlot(comm, rank, k, status, config_.wake_fds, config_.index,
                 /*wake=*/false);
  const bool quiet =
      ctl->submitted.load(std::memory_order_seq_cst) == sequence &&
      ctl->consumer_sleeping.load(std::memory_order_seq_cst) != 0;
  if (!quiet) WakeRank(comm, rank);
}

void Executor::FailComm(CommSlot* comm, const std::string& why) {
  if (FailCommunicator(comm, why, config_.wake_fds, config_.index)) {
    spdlog::warn("communicator {} failed: {}", comm->id.load(), why);
  }
}

absl::StatusOr<char*> Executor::RankRange(const CommSlot* comm, int rank,
                                          uint64_t address, uint64_t bytes,
                                          const char* what, bool input,
                                          ResolvedTensor* segment,
                                          bool host_access) {
  const CommMember& m = comm->members[rank];
  if (segment != nullptr) *segment = ResolvedTensor{};
  if (bytes == 0) return config_.chip_bases[m.chip];
  const int c = tpu::DeviceAddressChip(address);
  if (c != m.chip) {
    return absl::InvalidArgumentError(
        absl::StrFormat("rank %d's %s buffer 0x%x is not on its chip %d", rank,
                        what, address, m.chip));
  }
  const uint64_t offset = tpu::DeviceAddressOffset(address);
  SyncReleases();
  const std::optional<PageOwnerTable::Segment> seg =
      config_.owners[c].Find(offset, bytes, m.tag);
  if (!seg.has_value()) {
    const uint32_t owner = config_.owners[c].OwnerOf(offset);
    const std::string msg =
        absl::StrFormat("rank %d's %s buffer [0x%x, +%d bytes) is %s", rank,
                        what, address, bytes,
                        owner != 0 && owner != m.tag
                            ? "in another session's memory"
                            : "not inside one of that rank's segments");
    if (owner != 0 && owner != m.tag) return absl::PermissionDeniedError(msg);
    return absl::InvalidArgumentError(msg);
  }
  if (segment != nullptr) {
    *segment = ResolvedTensor{config_.chip_bases[c] + seg->offset,
                              tpu::MakeDeviceAddress(c, seg->offset),
                              seg->bytes, m.session_id};
  }
  // A backend with memory of its own brings the arena's copy up to date (a
  // buffer written here is the arena's from now on).
  if (host_access) {
    if (absl::Status st =
            config_.backend->HostAccess(address, bytes, !input, m.session_id);
        !st.ok()) {
      return st;
    }
  }
  if (input) {
    auto it = sessions_.find(m.session_id);
    std::string cause;
    if (it != sessions_.end() &&
        FindPoison(*it->second, c, address, address + bytes, &cause)) {
      return absl::FailedPreconditionError(
          absl::StrCat("rank ", rank, "'s ", what,
                       " buffer was produced by an op that failed: ", cause));
    }
  }
  return config_.chip_bases[c] + offset;
}

absl::Status Executor::PostGroup(Ring& ring, CommSlot* comm, int rank,
                                 uint64_t sequence, bool* posted) {
  *posted = false;
  const int n = static_cast<int>(comm->size);
  if (LockShared(&comm->mu)) {
    FailComm(
        comm,
        "an executor died while running an operation of this communicator");
  }
  struct Unlock {
    pthread_mutex_t* mu;
    ~Unlock() { pthread_mutex_unlock(mu); }
  } unlock{&comm->mu};
  if (comm->id.load() != ring.collective_comm) {
    return absl::NotFoundError("the communicator was destroyed");
  }
  if (comm->state.load() != CommSlot::kReady) {
    return absl::AbortedError(
        absl::StrCat("communicator failed: ", comm->failure));
  }
  int free_slot = -1;
  for (int k = 0; k < kSlotsPerRank; ++k) {
    GroupSlot& g = comm->slots[rank][k];
    const uint32_t state = g.state.load();
    if (state != GroupSlot::kFree &&
        g.ring == static_cast<uint32_t>(ring.index) &&
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
  const bool p2p = IsP2P(collective_.ops[0].kind);
  // Arguments only this rank can get wrong. A collective posts anyway, so
  // that its peers fail at once naming this rank instead of waiting.
  const absl::Status invalid = CheckOwnGroup(collective_, n);
  if (p2p && !invalid.ok()) return invalid;
  if (!p2p) {
    if (absl::Status st = CheckNotIssuedTwice(*comm, rank, collective_.index);
        !st.ok()) {
      return st;
    }
  }
  WriteGroup(collective_, static_cast<uint32_t>(ring.index), sequence,
             tpu::MonotonicNanos(), invalid, &comm->slots[rank][free_slot]);
  ring.collective_slot = free_slot;
  *posted = true;
  RunMet(comm, rank, free_slot);
  return absl::OkStatus();
}

void Executor::RunMet(CommSlot* comm, int rank, int kmine) {
  const int n = static_cast<int>(comm->size);
  GroupSlot& mine = comm->slots[rank][kmine];
  if (mine.p2p) {
    MatchPointToPoint(comm, rank, kmine,
                      [&](int ka, int ia, int peer, int kb, int ib) {
                        RunP2P(comm, rank, ka, ia, peer, kb, ib);
                      });
    // Every group whose operations are all done is finished.
    ForEachCompletedPointToPoint(*comm, [&](int r, int k) {
      const GroupSlot& g = comm->slots[r][k];
      const absl::Status st(static_cast<absl::StatusCode>(g.code), g.message);
      if (r != rank) {
        FinishPeerSlot(comm, r, k, st);
      } else {
        FinishSlot(comm, r, k, st);
      }
    });
    return;
  }
  // A collective runs once every rank has posted the group of the same index.
  const uint64_t index = mine.index;
  std::vector<int> at;
  if (!FindMetGroups(*comm, index, &at)) return;
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
  const std::string where =
      absl::StrCat("collective #", index, " on communicator ", comm->id.load());
  if (absl::Status agree = CheckGroupsAgree(*comm, at, where); !agree.ok()) {
    return finish_all(agree);
  }
  const GroupSlot& first = slot_of(0);
  // The fence: every rank's session tag is published before its page owners
  // are read (as in BeginOp), so none of their memory is freed under us.
  for (int r = 0; r < n; ++r) {
    slot_->collective_tags[r].store(comm->members[r].tag,
                                    std::memory_order_seq_cst);
  }
  const char* name = tpu::CollectiveKindName(first.ops[0].kind);
  std::memcpy(slot_->current_op, name, std::strlen(name) + 1);
  slot_->current_session.store(comm->members[rank].session_id,
                               std::memory_order_relaxed);
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
      result =
          BufferBytes(s.ops[q], s.send_counts, s.recv_counts, n, r, &sb, &rb);
      if (!result.ok()) break;
      CollectiveRank& cr = call.ranks[r];
      cr.chip = comm->members[r].chip;
      // Checked here; the arena's copies are brought up to date only if the
      // data moves there (below).
      absl::StatusOr<char*> sp =
          RankRange(comm, r, s.ops[q].send, sb, "send", /*input=*/true,
                    &cr.send_segment, /*host_access=*/false);
      if (!sp.ok()) {
        result = sp.status();
        break;
      }
      absl::StatusOr<char*> rp =
          RankRange(comm, r, s.ops[q].recv, rb, "recv", /*input=*/false,
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
        result = absl::InvalidArgumentError(
            absl::StrCat("rank ", r,
                         "'s all_to_all send and recv buffers overlap; use "
                         "separate tensors"));
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
      result = config_.backend->HostAccess(cr.send, cr.send_bytes,
                                           /*write=*/false, owner);
      if (result.ok())
        result = config_.backend->HostAccess(cr.recv, cr.recv_bytes,
                                             /*write=*/true, owner);
    }
    if (!result.ok()) break;
    RunCollective(config_.collectives, comm, ops, send, recv, send_counts,
                  recv_counts, &collective_scratch_);
  }
  config_.collectives->collectives_run.fetch_add(1, std::memory_order_relaxed);
  slot_->op_started_ns.store(0, std::memory_order_relaxed);
  EndCollectiveFence(n);
  if (!result.ok()) {
    result = absl::Status(result.code(), absl::StrCat(where, " (", name,
                                                      "): ", result.message()));
  }
  finish_all(result);
}

void Executor::RunP2P(CommSlot* comm, int a, int ka, int ia, int b, int kb,
                      int ib) {
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
  absl::Status st = CheckPair(snd, rcv, sender, receiver);
  if (st.ok()) {
    const uint64_t bytes =
        snd.count * static_cast<uint64_t>(tpu::ElementSize(snd.dtype));
    slot_->collective_tags[0].store(comm->members[sender].tag,
                                    std::memory_order_seq_cst);
    slot_->collective_tags[1].store(comm->members[receiver].tag,
                                    std::memory_order_seq_cst);
    absl::StatusOr<char*> src =
        RankRange(comm, sender, snd.send, bytes, "send", true);
    absl::StatusOr<char*> dst =
        src.ok() ? RankRange(comm, receiver, rcv.recv, bytes, "recv", false)
                 : src;
    if (!src.ok() || !dst.ok()) {
      st = !src.ok() ? src.status() : dst.status();
    } else {
      std::memmove(*dst, *src, bytes);
      CountRoute(config_.collectives, comm, sender, receiver, bytes);
      comm->bytes_moved.fetch_add(bytes, std::memory_order_relaxed);
    }
    EndCollectiveFence(2);
  }
  if (!st.ok()) {
    if (sa.code == 0) SetSlotMessage(sa, st);
    if (sb.code == 0) SetSlotMessage(sb, st);
  }
}

void Executor::PoisonCollectiveOutputs(Ring& ring, const std::string& cause,
                                       bool clear) {
  CommSlot* comm = CommOf(config_.collectives, ring.collective_comm);
  if (comm == nullptr) return;
  const int rank = ring.collective_rank;
  const GroupSlot& slot = comm->slots[rank][ring.collective_slot];
  Session& s = *ring.session;
  ForEachOutput(slot, static_cast<int>(comm->size), rank,
                [&](uint64_t begin, uint64_t end) {
                  if (clear) {
                    ClearPoison(s, ring.chip, begin, end);
                  } else {
                    AddPoison(s, ring.chip, begin, end, cause);
                  }
                });
}

void Executor::EndCollectiveFence(int ranks) {
  for (int r = 0; r < ranks; ++r)
    slot_->collective_tags[r].store(0, std::memory_order_seq_cst);
  if (slot_->fence_waiters.load(std::memory_order_seq_cst) != 0) {
    slot_->op_epoch.fetch_add(1);
    tpu::FutexWakeAll(&slot_->op_epoch);
  }
}

absl::Status Executor::StepCollective(Ring& ring, uint64_t sequence,
                                      absl::string_view record, bool* done,
                                      bool* malformed) {
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
  const bool first_visit =
      !ring.in_collective || ring.collective_sequence != sequence;
  // A peer's executor ran the group and completed this record already: the
  // ranks may have left the communicator since (destroy_process_group once
  // its last collective is done), and only taking it off the ring remains.
  const bool completed_early =
      ring.trusted->completed_early.load(std::memory_order_acquire) == sequence;
  if (first_visit || !ring.collective_posted) {
    if (absl::Status st = tpu::DecodeCollective(record, &collective_);
        !st.ok()) {
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
      return finish(
          absl::FailedPreconditionError("this tpud runs no collectives"));
    }
    CommSlot* comm = CommOf(config_.collectives, collective_.communicator);
    if (comm == nullptr) {
      if (completed_early) return finish(absl::OkStatus());
      return finish(absl::NotFoundError(
          absl::StrCat("communicator ", collective_.communicator,
                       " does not exist (destroyed, or never formed)")));
    }
    for (uint32_t r = 0; r < comm->size; ++r) {
      if (comm->members[r].session_id == ring.session->id &&
          comm->members[r].chip == ring.chip) {
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
  if (comm == nullptr) {
    if (completed_early) return finish(absl::OkStatus());
    return finish(absl::NotFoundError("the communicator was destroyed"));
  }
  const int rank = ring.collective_rank;
  if (!ring.collective_posted) {
    bool posted = false;
    if (absl::Status st = PostGroup(ring, comm, rank, sequence, &posted);
        !st.ok()) {
      if (completed_early && absl::IsNotFound(st))
        return finish(absl::OkStatus());
      return finish(st);
    }
    if (!posted) {
      if (comm->state.load() != CommSlot::kReady) {
        return finish(absl::AbortedError(
            absl::StrCat("communicator failed: ", comm->failure)));
      }
      return absl::OkStatus();  // every slot of this rank is busy: wait for one
    }
    ring.collective_posted = true;
  }
  GroupSlot& slot = comm->slots[rank][ring.collective_slot];
  if (slot.state.load(std::memory_order_acquire) != GroupSlot::kDone &&
      tpu::MonotonicNanos() - slot.posted_ns > comm->timeout_ns) {
    if (LockShared(&comm->mu)) {
      FailComm(
          comm,
          "an executor died while running an operation of this communicator");
    }
    if (slot.state.load() == GroupSlot::kPosted) {
      FailComm(comm, TimeoutMessage(*comm, rank, slot));
    }
    pthread_mutex_unlock(&comm->mu);
  }
  if (slot.state.load(std::memory_order_acquire) != GroupSlot::kDone)
    return absl::OkStatus();
  if (LockShared(&comm->mu)) {
    FailComm(
        comm,
        "an executor died while running an operation of this communicator");
  }
  const absl::Status result(static_cast<absl::StatusCode>(slot.code),
                            slot.message);
  PoisonCollectiveOutputs(ring, std::string(result.message()), result.ok());
  slot.state.store(GroupSlot::kFree, std::memory_order_release);
  pthread_mutex_unlock(&comm->mu);
  return finish(result);
}

}  // namespace tpud
