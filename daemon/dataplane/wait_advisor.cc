#include "daemon/dataplane/wait_advisor.h"

#include <algorithm>

namespace tpud {

uint32_t WaitAdvisor::Update(int active_parties, int runnable) {
  constexpr double kWeight = 0.25;
  const double others = std::max(0, runnable - active_parties);
  if (fresh_) {
    others_ = others;
    fresh_ = false;
  } else {
    others_ += kWeight * (others - others_);
  }
  const int free_cores = num_cpus_ - active_parties;
  const bool spinning = advice_ == tpu::kWaitSpin;
  if (free_cores >= 0 && others_ < free_cores + (spinning ? 0.75 : 0.5)) {
    advice_ = tpu::kWaitSpin;
  } else if (others_ < (advice_ == tpu::kWaitSleep ? 0.5 : 0.75)) {
    advice_ = tpu::kWaitYield;
  } else {
    advice_ = tpu::kWaitSleep;
  }
  return advice_;
}

}  // namespace tpud
