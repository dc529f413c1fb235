// torch_tpu's ATen kernels (ops.cc): what other parts need to know of them.
#pragma once

#include <string>
#include <vector>

namespace torch_tpu {

// The ops ("native_group_norm", "addr.out") that torch_tpu sends whole to
// the daemon although PyTorch would otherwise run them decomposed.
const std::vector<std::string>& SentWholeOps();
// Sends ATen's _foreach_ ops whose tensors are all in lists to the daemon
// whole (for a backend that runs every ATen op: the simulated chip). Once.
void SendForeachOpsWhole();

}  // namespace torch_tpu
