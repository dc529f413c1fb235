// scaled_dot_product_attention on "tpu" (attention.cc): the fused kernel
// where the daemon's backend runs it, the math path elsewhere.
#pragma once

#include "tpu/client.h"

namespace torch_tpu {

// Once the session is open: SDPA takes the fused kernel (under the CPU's
// rules) when this daemon's backend runs the CPU flash-attention ops (the
// simulated chip runs every ATen op; PJRT those it lowers), else the math
// path, as before the session knew.
void ChooseAttentionKernels(const tpu::TopologyInfo& t);

}  // namespace torch_tpu
