#include "collective_work.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <thread>
#include <utility>

#include "runtime.h"

namespace torch_tpu {

WorkTPU::WorkTPU(c10d::OpType type, std::vector<at::Tensor> outputs,
                 tpu::Event event, c10::DeviceIndex device, bool blocking,
                 Origin origin)
    : c10d::Work(-1, type),
      outputs_(std::move(outputs)),
      event_(event),
      device_(device),
      blocking_(blocking),
      origin_(std::move(origin)),
      future_(c10::make_intrusive<c10::ivalue::Future>(
          c10::ListType::create(c10::TensorType::get()))) {
  future_->markCompleted(c10::IValue(outputs_));
}

WorkTPU::~WorkTPU() { GetSession().ReleaseEvent(event_); }

bool WorkTPU::isCompleted() { return GetSession().EventDone(event_); }

bool WorkTPU::wait(std::chrono::milliseconds timeout) {
  tpu::Session& s = GetSession();
  if (timeout != kNoTimeout) WaitOnHost(timeout);
  if (blocking_) {
    // A barrier holds the host, and reports its error here.
    Check(s.SynchronizeEvent(event_), "barrier");
    return true;
  }
  Check(s.WaitEvent(SessionStream(CurrentStreamId(device_)), event_),
        "Work.wait");
  return true;
}

void WorkTPU::synchronize() {
  Check(GetSession().SynchronizeEvent(event_), "Work.synchronize");
}

void WorkTPU::WaitOnHost(std::chrono::milliseconds timeout) {
  // tpud has no timed wait for an event: poll, backing off to 1 ms.
  tpu::Session& s = GetSession();
  const auto start = std::chrono::steady_clock::now();
  std::chrono::microseconds pause(20);
  while (!s.EventDone(event_)) {
    const auto waited = std::chrono::duration_cast<std::chrono::milliseconds>(
        std::chrono::steady_clock::now() - start);
    // A peer that never comes: the collective stays posted (it runs if the
    // peer comes later, and fails at the group's timeout otherwise), but
    // this caller learns now, as with NCCL's blocking wait.
    TORCH_CHECK_WITH(
        DistBackendError, waited < timeout, "tpu backend: ", Label(),
        " did not complete within Work.wait's timeout of ", timeout.count(),
        " ms: a rank of the group has not called it (or is behind). It "
        "stays posted, and fails at the group's own timeout if the rank "
        "never comes.");
    std::this_thread::sleep_for(pause);
    pause = std::min(pause * 2, std::chrono::microseconds(1000));
  }
  Check(s.SynchronizeEvent(event_), Label().c_str());
}

std::string WorkTPU::Label() const {
  std::string label = c10d::opTypeToString(retrieveOpType());
  if (origin_.size == 0) return label;
  return label + " (call " + std::to_string(origin_.call) +
         " on process group '" + origin_.group + "', rank " +
         std::to_string(origin_.rank) + " of " + std::to_string(origin_.size) +
         ")";
}

WorkHost::WorkHost(c10d::OpType type, std::vector<Part> parts,
                   c10::intrusive_ptr<c10d::Work> local)
    : c10d::Work(-1, type),
      parts_(std::move(parts)),
      local_(std::move(local)) {}

bool WorkHost::isCompleted() {
  for (const Part& p : parts_) {
    if (!p.work->isCompleted()) return false;
  }
  if (local_ && !local_->isCompleted()) return false;
  Land();
  return true;
}

bool WorkHost::wait(std::chrono::milliseconds timeout) {
  for (Part& p : parts_) p.work->wait(timeout);
  Land();
  if (local_) local_->wait(timeout);
  return true;
}

void WorkHost::Land() {
  if (landed_) return;
  landed_ = true;
  for (Part& p : parts_) {
    if (p.dst.defined()) p.dst.copy_(p.cpu.view(p.dst.sizes()));
  }
}

}  // namespace torch_tpu
