// How ranks' groups meet in the shared table (shared_table.h): what one
// rank can get wrong in its own group, how it is posted into the rank's
// slot, what must agree across the ranks of a collective before any data
// moves, how point-to-point operations pair, and how the failures read.
//
// The executor drives these (daemon/executor/collective_steps.cc): it posts
// a group, and whoever posts last checks the meeting here, resolves every
// rank's buffers against that rank's session, and moves the data
// (algorithms.h, or the backend's own program).
//
// Thread-safety: every function that takes a CommSlot is called under its
// mutex (CommSlot::mu).
#ifndef TPUD_DAEMON_COLLECTIVES_GROUPS_H_
#define TPUD_DAEMON_COLLECTIVES_GROUPS_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "daemon/collectives/shared_table.h"
#include "tpu/op_record.h"

namespace tpud {

// ---- one rank's group ----

// Bytes the buffers of one op span on its rank (send, recv), for the
// communicator's size `n`; INVALID_ARGUMENT on overflow or absurd counts.
absl::Status BufferBytes(const PostedOp& op, const int64_t* send_counts,
                         const int64_t* recv_counts, int n, int rank,
                         uint64_t* send_bytes, uint64_t* recv_bytes);

// What a rank can get wrong on its own in `group`, on a communicator of `n`
// ranks: INVALID_ARGUMENT naming it (a root or peer that is no rank, a
// reduction its dtype cannot do, all_to_all splits of the wrong size, a
// group that mixes point-to-point operations with collectives, ...).
// REQUIRES: group.ops is not empty.
absl::Status CheckOwnGroup(const tpu::DecodedCollective& group, int n);

// INVALID_ARGUMENT when `rank` has collective group `index` posted already.
absl::Status CheckNotIssuedTwice(const CommSlot& comm, int rank,
                                 uint64_t index);

// Writes `group` into `slot` (a free one) and marks it posted, for record
// `sequence` of ring `ring`, at `posted_ns`. A group that failed
// CheckOwnGroup is posted with that error (`invalid`), so that its peers
// fail at once naming this rank.
void WriteGroup(const tpu::DecodedCollective& group, uint32_t ring,
                uint64_t sequence, uint64_t posted_ns,
                const absl::Status& invalid, GroupSlot* slot);

// Calls f(begin, end) for every device range `rank`'s group `g` writes.
void ForEachOutput(const GroupSlot& g, int size, int rank,
                   absl::FunctionRef<void(uint64_t, uint64_t)> f);

// ---- collectives: every rank posts the same operations ----

// Whether every rank has posted collective group `index`; then (*at)[r] is
// rank r's slot.
bool FindMetGroups(const CommSlot& comm, uint64_t index, std::vector<int>* at);

// OK when the met groups (slots `at`) may run: no rank posted an error, and
// every rank calls the same operations (kind, dtype, count, reduction,
// root) with matching all_to_all splits. Otherwise the error, worded from
// `where` ("collective #3 on communicator 7").
absl::Status CheckGroupsAgree(const CommSlot& comm, const std::vector<int>& at,
                              const std::string& where);

// ---- point-to-point: sends and receives pair up ----

// Calls run(ka, ia, peer, kb, ib) for each operation ia of `rank`'s slot ka
// that has no partner yet and whose partner is posted: op ib of the peer's
// slot kb, the same pair index in the opposite direction. `run` marks both
// done.
void MatchPointToPoint(
    CommSlot* comm, int rank, int ka,
    absl::FunctionRef<void(int ka, int ia, int peer, int kb, int ib)> run);

// Calls f(rank, slot) for every posted point-to-point group whose
// operations are all done.
void ForEachCompletedPointToPoint(const CommSlot& comm,
                                  absl::FunctionRef<void(int, int)> f);

// OK when a send and the recv it met agree (dtype, count) and fit a chip.
absl::Status CheckPair(const PostedOp& send, const PostedOp& recv, int sender,
                       int receiver);

// ---- messages ----

// "all_reduce(sum, float32, 1024 elements)", for mismatch messages.
std::string DescribeOp(const PostedOp& op);
// "rank 1 (pid 4242, chip 3)".
std::string MemberName(const CommSlot& comm, int rank);
// Why `rank`'s group in `slot` timed out, naming the ranks that never took
// part.
std::string TimeoutMessage(const CommSlot& comm, int rank,
                           const GroupSlot& slot);

}  // namespace tpud

#endif  // TPUD_DAEMON_COLLECTIVES_GROUPS_H_
