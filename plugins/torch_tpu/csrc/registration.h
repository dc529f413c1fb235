// Op registration (registration.cc): what module.cc needs of it.
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
// Sends ATen's structured ops (add.Tensor, add_.Tensor, ...), which would
// reach the fallback through ATen's default kernel and their out= op, to
// the fallback directly. Once. `lowered` (the PJRT backend's lowered ops)
// limits them to ops the daemon runs whole; nullptr: all (the simulated
// chip runs every ATen op).
void SendStructuredOpsWhole(const std::vector<std::string>* lowered);
// What SendStructuredOpsWhole registered ("aten::add_.Tensor"), or nothing.
std::vector<std::string> StructuredOpsSentWhole();

}  // namespace torch_tpu
