// The body of an executor process (forked by the pool's zygote).
#ifndef TPUD_DAEMON_EXECUTOR_EXECUTOR_MAIN_H_
#define TPUD_DAEMON_EXECUTOR_EXECUTOR_MAIN_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <utility>
#include <vector>

#include "daemon/backends/chip_backend.h"
#include "daemon/collectives/shared_table.h"
#include "daemon/core/shared_regions.h"

namespace tpud {

// What every executor starts from: set up by tpud before the zygote forks,
// so each process finds it in its own (inherited) memory.
struct ExecutorProcessConfig {
  ExecutorShared* shared = nullptr;
  std::vector<std::vector<int>> chips_of;  // per executor
  std::vector<char*> chip_bases;           // HBM of every chip
  std::vector<uint64_t> chip_capacities;
  // Page-owner tables of every chip: memory and mapped size. Mapped
  // read-only in executors.
  std::vector<std::pair<char*, uint64_t>> owner_tables;
  std::vector<int> wake_fds;  // per executor
  CollectiveTable* collectives = nullptr;
  // Makes the chip backend (in the executor process, after the fork).
  std::function<std::unique_ptr<ChipBackend>()> make_backend;
  uint64_t spin_ns = 50000;
  uint64_t yield_ns = 50000;
  bool unrung = false;  // ExecutorConfig::unrung
  uint64_t quantum_ns = 200000;
  uint64_t heap_keep_ns = 0;  // ExecutorConfig::heap_keep_ns
  int intra_op_threads = 0;   // ExecutorConfig::intra_op_threads
  // The executors' nice value, set before any thread starts (so ATen's and
  // a PJRT plugin's threads have it too).
  int nice = 0;
};

// Serves as executor `index` until tpud stops it or goes away. Installs
// crash handlers that record the signal in the executor's slot before the
// process dies of it.
int RunExecutorProcess(const ExecutorProcessConfig& config, int index,
                       int control_fd);

}  // namespace tpud

#endif  // TPUD_DAEMON_EXECUTOR_EXECUTOR_MAIN_H_
