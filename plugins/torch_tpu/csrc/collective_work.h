// The c10d::Work objects of the "tpu" backend (distributed.cc): one that
// completes with a record in tpud, and one whose data crosses hosts by gloo.
#pragma once

#include <ATen/core/Tensor.h>

#include <chrono>
#include <cstdint>
#include <string>
#include <torch/csrc/distributed/c10d/Work.hpp>
#include <vector>

#include "tpu/client.h"

namespace torch_tpu {

// Completes with `event` (a collective's own record, or an event recorded
// after the copies that follow it). wait() orders the caller's current
// stream after it, as NCCL's does; a barrier's (`blocking`) holds the host.
// wait(timeout) with a timeout holds the host until the collective is done,
// and raises DistBackendError naming it (`origin`) if that takes longer.
// Any thread may call it: it changes no state of its own.
class WorkTPU : public c10d::Work {
 public:
  // Where the collective was called, for the timeout's message: "ALLREDUCE
  // (call 3 on process group '0', rank 1 of 4)".
  struct Origin {
    uint64_t call = 0;  // the group's calls so far, this one included
    std::string group;  // the group's name
    int rank = 0, size = 0;
  };
  WorkTPU(c10d::OpType type, std::vector<at::Tensor> outputs, tpu::Event event,
          c10::DeviceIndex device, bool blocking, Origin origin);
  ~WorkTPU() override;

  bool isCompleted() override;
  bool isSuccess() const override { return true; }
  std::vector<at::Tensor> result() override { return outputs_; }
  bool wait(std::chrono::milliseconds timeout) override;
  void synchronize() override;
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override {
    return future_;
  }

 private:
  // Holds the host until the event completed or `timeout` passed; raises
  // for the latter.
  void WaitOnHost(std::chrono::milliseconds timeout);
  std::string Label() const;

  std::vector<at::Tensor> outputs_;
  tpu::Event event_;
  c10::DeviceIndex device_;
  bool blocking_;
  Origin origin_;
  c10::intrusive_ptr<c10::ivalue::Future> future_;
};

// A Work whose data crosses hosts over gloo: CPU copies of tpu tensors go
// by gloo; received ones are copied into their tpu tensors once gloo is
// done (at wait(), or when is_completed() first sees it done). `local`, when
// set, is the in-host part of the same coalesced group. Not thread-safe
// (one thread lands the received tensors).
class WorkHost : public c10d::Work {
 public:
  struct Part {
    c10::intrusive_ptr<c10d::Work> work;
    at::Tensor cpu;  // what gloo reads or writes
    at::Tensor dst;  // the tpu tensor to fill from `cpu` (received), or none
  };
  WorkHost(c10d::OpType type, std::vector<Part> parts,
           c10::intrusive_ptr<c10d::Work> local);

  bool isCompleted() override;
  bool isSuccess() const override { return true; }
  bool wait(std::chrono::milliseconds timeout) override;
  void synchronize() override {}

 private:
  void Land();
  std::vector<Part> parts_;
  c10::intrusive_ptr<c10d::Work> local_;
  bool landed_ = false;
};

}  // namespace torch_tpu
