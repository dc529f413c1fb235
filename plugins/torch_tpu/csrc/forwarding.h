// The forwarding path: every ATen op "tpu" does not run natively goes to
// tpud through the boxed Fallback (forwarding.cc). registration.cc routes
// ops to it; the native kernels use ForwardInPlace.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>

#include <optional>
#include <vector>

namespace torch_tpu {

// The boxed kernel of every forwarded op: output shapes from the meta
// kernel (cached per input signature), outputs allocated here, the op
// enqueued without a round trip; ops whose outputs depend on data, or that
// return values to the host, take the synchronous path. An out= op runs as
// its functional twin into its out= tensors; a structured in-place op sent
// whole (NoteStructuredSentWhole) as its functional op into self.
void Fallback(const c10::OperatorHandle& op, torch::jit::Stack* stack);

// ATen sends convolutions of backends it does not know to the
// *_overrideable ops; these forward the full ATen convolution (and its
// backward) instead.
void ConvolutionOverrideable(const c10::OperatorHandle&,
                             torch::jit::Stack* stack);
void ConvolutionBackwardOverrideable(const c10::OperatorHandle&,
                                     torch::jit::Stack* stack);

// Runs `op` through the forwarding path: its arguments on `stack`, its
// results left there, as a boxed kernel leaves them.
void ForwardOp(const c10::OperatorHandle& op, torch::jit::Stack* stack);

// Runs a named op, which writes `self`, through the forwarding path from C++.
at::Tensor& ForwardInPlace(const char* name, const char* overload,
                           at::Tensor& self, std::vector<c10::IValue> rest);

// An in-place op's functional twin ("aten::add_.Tensor" ->
// "aten::add.Tensor"): the same arguments, of which the in-place op writes
// only the first, and one result. nullopt: none.
std::optional<c10::OperatorHandle> InPlaceFunctionalOf(
    const c10::FunctionSchema& schema);

// Structured ops routed to Fallback directly (registration.cc notes each
// before routing it): Fallback runs an in-place one as its functional op
// into self (an in-place op reaching it otherwise, zero_ for one, runs as
// itself), and takes a failing meta kernel of any of them for bad
// arguments, whose message is ATen's own.
void NoteStructuredSentWhole(const c10::OperatorName& name);
std::vector<c10::OperatorName> StructuredSentWhole();

// Whether tpud's backend allocates the results of a synchronous run (the
// simulated one; PJRT writes only into outputs the client allocated). Only
// then may a new signature's first run say its output metadata, in place of
// a Python meta kernel (ForwardedOp::LearnsSpecFromRun). Set at session open.
void SetSyncRunsAllocateResults(bool allocate);

// A stream's program capture begins (true) or ends (false): ops captured
// meanwhile never run synchronously to learn their output metadata.
void NoteCapture(bool begins);

}  // namespace torch_tpu
