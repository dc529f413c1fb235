// Sparse COO tensors on tpu (see sparse.cc).
#pragma once

#include <string>
#include <vector>

namespace torch_tpu {

// The ops whose tpu sparse kernel is ATen's shared SparseCPU/SparseCUDA one.
std::vector<std::string> SharedSparseKernelNames();

}  // namespace torch_tpu
