// How the data of a collective operation moves once every rank has met and
// been checked (groups.h): on the host, in the chips' HBM that every
// executor maps, along the torus as shared_table.h describes.
//
// all_reduce, all_gather and reduce_scatter run as bidirectional rings
// (half of each tile goes each way round), pipelined in tiles that stay in
// cache; broadcast and reduce travel the ring from or to the root; gather,
// scatter and all_to_all go directly, by the shortest route. Large
// operations split their elements over the host's cores. Every byte is
// counted on the links it crosses (CountRoute) and in the communicator's
// bytes moved, so tpuctl reports what the torus would carry.
//
// Thread-safety: call under the communicator's mutex (CommSlot::mu); the
// link counters are atomic.
#ifndef TPUD_DAEMON_COLLECTIVES_ALGORITHMS_H_
#define TPUD_DAEMON_COLLECTIVES_ALGORITHMS_H_

#include <cstdint>
#include <vector>

#include "daemon/collectives/shared_table.h"

namespace tpud {

// Moves the data of one collective operation (ops[r] for each rank r, all
// already checked to match). `host_send[r]`, `host_recv[r]` are the host
// views of rank r's buffers (null where the kind has none). Counts the
// bytes each link carries.
void RunCollective(CollectiveTable* table, CommSlot* comm,
                   const std::vector<const PostedOp*>& ops,
                   const std::vector<char*>& host_send,
                   const std::vector<char*>& host_recv,
                   const std::vector<const int64_t*>& send_counts,
                   const std::vector<const int64_t*>& recv_counts,
                   std::vector<char>* scratch);

// Counts, on the links and in the communicator's bytes moved, what
// RunCollective's schedule would move for `op` (ops[0] of every rank), for
// an operation a backend ran as its own program (which picks its own
// schedule on the device; these are the torus schedule's figures).
void CountCollectiveTraffic(CollectiveTable* table, CommSlot* comm,
                            const PostedOp& op,
                            const std::vector<const int64_t*>& send_counts);

}  // namespace tpud

#endif  // TPUD_DAEMON_COLLECTIVES_ALGORITHMS_H_
