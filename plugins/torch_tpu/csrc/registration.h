// Op registration (registration.cc): what module.cc needs of it.
#pragma once

#include <string>
#include <vector>

#include "tpu/client.h"

namespace torch_tpu {

// Once the session is open, routes to the fallback whole (instead of
// through ATen's composite and default kernels) the ops the daemon's backend
// runs whole: ATen's _foreach_ ops whose tensors are all in lists (on a
// backend that runs every ATen op: the simulated chip), and ATen's
// structured ops (add.Tensor, add_.Tensor, ...; on PJRT only those it
// lowers) unless TORCH_TPU_STRUCTURED_WHOLE=0, once; and picks the kernel
// scaled_dot_product_attention takes (attention.h).
void InstallSendWholeRoutes(const tpu::TopologyInfo& t);

// The ops ("native_group_norm", "addr.out") that torch_tpu sends whole to
// the daemon from the start although PyTorch would otherwise run them
// decomposed.
const std::vector<std::string>& SentWholeOps();
// The structured ops InstallSendWholeRoutes routed ("aten::add_.Tensor"),
// or nothing.
std::vector<std::string> StructuredOpsSentWhole();

}  // namespace torch_tpu
