// SimulatedChip's creation and its share of the host's cores: ATen's
// intra-op thread count (kept apart from simulated_chip.cc, which holds the
// ops).
#include <ATen/Parallel.h>

#include <memory>
#include <mutex>

#include "daemon/backends/simulated/simulated_chip.h"

namespace tpud {

std::unique_ptr<SimulatedChip> SimulatedChip::Create(int intra_op_threads) {
  if (intra_op_threads > 0) {
    static std::once_flag once;
    std::call_once(
        once, [intra_op_threads] { at::set_num_threads(intra_op_threads); });
  }
  return std::unique_ptr<SimulatedChip>(new SimulatedChip());
}

int SimulatedChip::intra_op_threads() const { return at::get_num_threads(); }

void SimulatedChip::set_intra_op_threads(int n) {
  if (n > 0 && n != at::get_num_threads()) at::set_num_threads(n);
}

}  // namespace tpud
