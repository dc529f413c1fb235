#include "daemon/service/executors.h"

#include <sys/eventfd.h>

#include <new>
#include <string>
#include <utility>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "daemon/executor/executor_main.h"

namespace tpud {

absl::StatusOr<std::unique_ptr<ExecutorProcesses>> ExecutorProcesses::Create(
    const TpudConfig& config, const ChosenBackend& backend, RuntimeCore* core) {
  std::unique_ptr<ExecutorProcesses> e(new ExecutorProcesses);
  absl::StatusOr<SharedMapping> shared_memory = SharedMapping::Create(
      "tpud-executors", sizeof(ExecutorShared), /*seal=*/false);
  if (!shared_memory.ok()) return shared_memory.status();
  e->shared_memory_ = *std::move(shared_memory);
  e->shared_memory_.CloseFd();
  e->shared_ = new (e->shared_memory_.data()) ExecutorShared();
  e->shared_->magic = kExecutorSharedMagic;

  const int num_chips = core->topology().num_chips();
  const int num_executors = backend.one_executor ? 1 : num_chips;
  e->shared_->num_executors = static_cast<uint32_t>(num_executors);
  e->cores_ = AvailableCores();
  e->shared_->num_cpus = static_cast<uint32_t>(e->cores_.cores);
  ExecutorProcessConfig exec_config;
  exec_config.shared = e->shared_;
  std::vector<int> wake_fds;
  std::vector<int> executor_of_chip;
  exec_config.chips_of.resize(num_executors);
  for (int c = 0; c < num_chips; ++c) {
    const int executor = backend.one_executor ? 0 : c;
    exec_config.chips_of[executor].push_back(c);
    executor_of_chip.push_back(executor);
    exec_config.chip_bases.push_back(core->ChipHostBase(c));
    exec_config.chip_capacities.push_back(
        core->topology().hbm_bytes_per_chip());
    exec_config.owner_tables.push_back(core->OwnerTableMemory(c));
  }
  for (int i = 0; i < num_executors; ++i) {
    const int fd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
    if (fd < 0) return absl::InternalError("eventfd for the executors failed");
    wake_fds.push_back(fd);
  }
  exec_config.wake_fds = wake_fds;

  // Communicators: one table every executor maps (shared_table.h); the
  // registry sets up its links and routes now, before the fork.
  absl::StatusOr<SharedMapping> collective_memory = SharedMapping::Create(
      "tpud-collectives", CollectiveTableBytes(config.max_communicators),
      /*seal=*/false);
  if (!collective_memory.ok()) return collective_memory.status();
  e->collective_memory_ = *std::move(collective_memory);
  e->collective_memory_.CloseFd();
  // Default-initialised on the memfd's zero pages: writing nothing keeps
  // the table's unused communicator slots (most of its size) unbacked.
  auto* collective_table = new (e->collective_memory_.data()) CollectiveTable;
  collective_table->num_comms = static_cast<uint32_t>(config.max_communicators);
  e->communicators_ = std::make_unique<CommunicatorRegistry>(
      collective_table, core->topology(), executor_of_chip, wake_fds);
  exec_config.collectives = collective_table;
  exec_config.spin_ns = absl::ToInt64Nanoseconds(config.executor_spin);
  exec_config.yield_ns = absl::ToInt64Nanoseconds(config.executor_yield);
  exec_config.unrung = config.executor_unrung;
  exec_config.quantum_ns = absl::ToInt64Nanoseconds(config.executor_quantum);
  exec_config.heap_keep_ns =
      absl::ToInt64Nanoseconds(config.executor_heap_keep);
  exec_config.nice = config.executor_nice;
  exec_config.intra_op_threads = config.intra_op_threads;
  exec_config.make_backend = backend.make_backend;

  ExecutorPoolOptions pool_options;
  pool_options.chips_of = exec_config.chips_of;
  pool_options.op_timeout = config.op_timeout;
  pool_options.device_memory = backend.device_memory;
  absl::StatusOr<std::unique_ptr<ExecutorPool>> pool = ExecutorPool::Create(
      pool_options, e->shared_, wake_fds,
      [exec_config](int index, int control_fd) {
        return RunExecutorProcess(exec_config, index, control_fd);
      });
  if (!pool.ok()) return pool.status();
  e->pool_ = *std::move(pool);
  return e;
}

}  // namespace tpud
