// torch.distributed's "tpu" backend: a c10d::Backend whose collectives run
// inside tpud (daemon/executor/collectives.h), ordered in the caller's
// current tpu stream like any op.
//
// Each process group forms one tpud communicator per device it is used
// with, on first use: rank 0 puts a fresh key in the group's store, every
// rank joins under it. Tensors go as dense buffers; where a call hands
// lists or strided tensors, they are packed into (and unpacked from) a
// contiguous buffer with ordinary tpu ops on the same stream.
//
// A Work completes with its record: wait() orders the caller's current
// stream after it (as NCCL's does); errors (a mismatched call, a dead peer,
// a timeout) surface at the stream's next synchronisation on every rank.
#include <c10/core/ScalarType.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>
#include <torch/csrc/utils/pybind.h>
#include <pybind11/chrono.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "runtime.h"
#include "tpu/client.h"

namespace torch_tpu {
namespace {

constexpr c10::DeviceType kTpu = c10::DeviceType::PrivateUse1;

tpu::ReduceOp ToReduceOp(const c10d::ReduceOp& op) {
  switch (op.op_) {
    case c10d::ReduceOp::SUM:
      return tpu::ReduceOp::kSum;
    case c10d::ReduceOp::AVG:
      return tpu::ReduceOp::kAvg;
    case c10d::ReduceOp::PRODUCT:
      return tpu::ReduceOp::kProduct;
    case c10d::ReduceOp::MIN:
      return tpu::ReduceOp::kMin;
    case c10d::ReduceOp::MAX:
      return tpu::ReduceOp::kMax;
    default:
      TORCH_CHECK(false, "tpu backend: reduce op ", static_cast<int>(op.op_),
                  " is not supported (sum, avg, product, min and max are)");
  }
}

uint64_t Address(const at::Tensor& t) {
  return t.numel() == 0 ? 0 : reinterpret_cast<uint64_t>(t.data_ptr());
}

void CheckTpu(const at::Tensor& t, const char* what) {
  TORCH_CHECK(t.defined() && t.device().type() == kTpu, "tpu backend: ", what,
              " must be a tpu tensor, got ", t.defined() ? t.device().str() : "an undefined tensor");
  TORCH_CHECK(!t.is_sparse(), "tpu backend: ", what, " must be dense");
}

class WorkTPU : public c10d::Work {
 public:
  WorkTPU(c10d::OpType type, std::vector<at::Tensor> outputs, tpu::Event event,
          c10::DeviceIndex device, bool blocking)
      : c10d::Work(-1, type),
        outputs_(std::move(outputs)),
        event_(event),
        device_(device),
        blocking_(blocking),
        future_(c10::make_intrusive<c10::ivalue::Future>(
            c10::ListType::create(c10::TensorType::get()))) {
    future_->markCompleted(c10::IValue(outputs_));
  }
  ~WorkTPU() override { GetSession().ReleaseEvent(event_); }

  bool isCompleted() override { return GetSession().EventDone(event_); }
  bool isSuccess() const override { return true; }
  std::vector<at::Tensor> result() override { return outputs_; }

  bool wait(std::chrono::milliseconds timeout) override {
    tpu::Session& s = GetSession();
    if (blocking_) {
      // A barrier holds the host, and reports its error here.
      Check(s.SynchronizeEvent(event_), "barrier");
      return true;
    }
    Check(s.WaitEvent(SessionStream(CurrentStreamId(device_)), event_), "Work.wait");
    return true;
  }
  void synchronize() override { Check(GetSession().SynchronizeEvent(event_), "Work.synchronize"); }
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override { return future_; }

 private:
  std::vector<at::Tensor> outputs_;
  tpu::Event event_;
  c10::DeviceIndex device_;
  bool blocking_;
  c10::intrusive_ptr<c10::ivalue::Future> future_;
};

class ProcessGroupTPU : public c10d::Backend {
 public:
  ProcessGroupTPU(c10::intrusive_ptr<c10d::Store> store, int rank, int size,
                  std::chrono::milliseconds timeout)
      : c10d::Backend(rank, size), store_(std::move(store)), timeout_(timeout) {}

  ~ProcessGroupTPU() override {
    for (auto& [device, id] : comms_) (void)GetSession().LeaveCommunicator(id);
  }

  const std::string getBackendName() const override { return "tpu"; }
  bool supportsCoalescing() const override { return true; }
  void setTimeout(std::chrono::milliseconds timeout) override { timeout_ = timeout; }

  void startCoalescing() override {
    TORCH_CHECK(!coalescing_, "tpu backend: coalescing already started");
    coalescing_ = true;
    pending_.clear();
    pending_outputs_.clear();
    pending_after_.clear();
    pending_device_ = -1;
  }

  c10::intrusive_ptr<c10d::Work> endCoalescing() override {
    TORCH_CHECK(coalescing_, "tpu backend: endCoalescing without startCoalescing");
    coalescing_ = false;
    if (pending_.empty()) {
      return c10::make_intrusive<WorkTPU>(c10d::OpType::COALESCED, std::vector<at::Tensor>{},
                                          RecordOn(CurrentDevice()), CurrentDevice(), false);
    }
    return Flush(c10d::OpType::COALESCED);
  }

  c10::intrusive_ptr<c10d::Work> broadcast(std::vector<at::Tensor>& tensors,
                                           const c10d::BroadcastOptions& opts) override {
    at::Tensor& t = Single(tensors, "broadcast");
    Buffer b = Dense(t, /*write=*/true);
    tpu::CollectiveEntry e = Entry(tpu::CollectiveKind::kBroadcast, b.t);
    e.peer = static_cast<int32_t>(opts.rootRank);
    e.send = e.recv = Address(b.t);
    return Issue(c10d::OpType::BROADCAST, {e}, {t}, {b});
  }

  c10::intrusive_ptr<c10d::Work> allreduce(std::vector<at::Tensor>& tensors,
                                            const c10d::AllreduceOptions& opts) override {
    at::Tensor& t = Single(tensors, "all_reduce");
    Buffer b = Dense(t, true);
    tpu::CollectiveEntry e = Entry(tpu::CollectiveKind::kAllReduce, b.t);
    e.reduce = ToReduceOp(opts.reduceOp);
    e.send = e.recv = Address(b.t);
    return Issue(c10d::OpType::ALLREDUCE, {e}, {t}, {b});
  }

  c10::intrusive_ptr<c10d::Work> allreduce_coalesced(
      std::vector<at::Tensor>& tensors, const c10d::AllreduceCoalescedOptions& opts) override {
    TORCH_CHECK(!tensors.empty(), "tpu backend: allreduce_coalesced of no tensors");
    std::vector<tpu::CollectiveEntry> entries;
    std::vector<Buffer> buffers;
    for (at::Tensor& t : tensors) {
      CheckTpu(t, "allreduce_coalesced's tensor");
      Buffer b = Dense(t, true);
      tpu::CollectiveEntry e = Entry(tpu::CollectiveKind::kAllReduce, b.t);
      e.reduce = ToReduceOp(opts.reduceOp);
      e.send = e.recv = Address(b.t);
      entries.push_back(e);
      buffers.push_back(b);
    }
    return Issue(c10d::OpType::ALLREDUCE_COALESCED, entries, tensors, buffers);
  }

  c10::intrusive_ptr<c10d::Work> reduce(std::vector<at::Tensor>& tensors,
                                        const c10d::ReduceOptions& opts) override {
    at::Tensor& t = Single(tensors, "reduce");
    Buffer b = Dense(t, true);
    tpu::CollectiveEntry e = Entry(tpu::CollectiveKind::kReduce, b.t);
    e.reduce = ToReduceOp(opts.reduceOp);
    e.peer = static_cast<int32_t>(opts.rootRank);
    e.send = e.recv = Address(b.t);
    return Issue(c10d::OpType::REDUCE, {e}, {t}, {b});
  }

  c10::intrusive_ptr<c10d::Work> allgather(std::vector<std::vector<at::Tensor>>& outputs,
                                           std::vector<at::Tensor>& inputs,
                                           const c10d::AllgatherOptions&) override {
    at::Tensor& in = Single(inputs, "all_gather");
    TORCH_CHECK(outputs.size() == 1 && static_cast<int>(outputs[0].size()) == getSize(),
                "tpu backend: all_gather needs one output list of ", getSize(), " tensors");
    for (const at::Tensor& o : outputs[0]) CheckSame(in, o, "all_gather");
    Buffer src = Dense(in, false);
    at::Tensor flat = at::empty({getSize() * in.numel()}, in.options());
    tpu::CollectiveEntry e = Entry(tpu::CollectiveKind::kAllGather, src.t);
    e.send = Address(src.t);
    e.recv = Address(flat);
    std::vector<std::pair<at::Tensor, at::Tensor>> after;
    for (int r = 0; r < getSize(); ++r) {
      after.emplace_back(outputs[0][r], flat.narrow(0, r * in.numel(), in.numel()));
    }
    return Issue(c10d::OpType::ALLGATHER, {e}, outputs[0], {src}, after, {flat});
  }

  c10::intrusive_ptr<c10d::Work> _allgather_base(at::Tensor& output, at::Tensor& input,
                                                 const c10d::AllgatherOptions&) override {
    std::vector<tpu::CollectiveEntry> e;
    std::vector<Buffer> b;
    AllGatherInto(output, input, &e, &b);
    return Issue(c10d::OpType::_ALLGATHER_BASE, e, {output}, b);
  }

  c10::intrusive_ptr<c10d::Work> allgather_into_tensor_coalesced(
      std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
      const c10d::AllgatherOptions&) override {
    TORCH_CHECK(outputs.size() == inputs.size() && !inputs.empty(),
                "tpu backend: allgather_into_tensor_coalesced needs one output per input");
    std::vector<tpu::CollectiveEntry> e;
    std::vector<Buffer> b;
    for (size_t i = 0; i < inputs.size(); ++i) AllGatherInto(outputs[i], inputs[i], &e, &b);
    return Issue(c10d::OpType::COALESCED, e, outputs, b);
  }

  c10::intrusive_ptr<c10d::Work> allgather_coalesced(
      std::vector<std::vector<at::Tensor>>& outputs, std::vector<at::Tensor>& inputs,
      const c10d::AllgatherOptions& opts) override {
    TORCH_CHECK(outputs.size() == inputs.size() && !inputs.empty(),
                "tpu backend: allgather_coalesced needs one output list per input");
    std::vector<tpu::CollectiveEntry> entries;
    std::vector<Buffer> buffers;
    std::vector<std::pair<at::Tensor, at::Tensor>> after;
    std::vector<at::Tensor> keep, all_outputs;
    for (size_t i = 0; i < inputs.size(); ++i) {
      CheckTpu(inputs[i], "allgather_coalesced's input");
      TORCH_CHECK(static_cast<int>(outputs[i].size()) == getSize(),
                  "tpu backend: allgather_coalesced needs output lists of ", getSize(), " tensors");
      Buffer src = Dense(inputs[i], false);
      at::Tensor flat = at::empty({getSize() * inputs[i].numel()}, inputs[i].options());
      tpu::CollectiveEntry e = Entry(tpu::CollectiveKind::kAllGather, src.t);
      e.send = Address(src.t);
      e.recv = Address(flat);
      entries.push_back(e);
      buffers.push_back(src);
      keep.push_back(flat);
      for (int r = 0; r < getSize(); ++r) {
        CheckSame(inputs[i], outputs[i][r], "allgather_coalesced");
        after.emplace_back(outputs[i][r], flat.narrow(0, r * inputs[i].numel(), inputs[i].numel()));
        all_outputs.push_back(outputs[i][r]);
      }
    }
    return Issue(c10d::OpType::ALLGATHER_COALESCED, entries, all_outputs, buffers, after, keep);
  }

  c10::intrusive_ptr<c10d::Work> gather(std::vector<std::vector<at::Tensor>>& outputs,
                                        std::vector<at::Tensor>& inputs,
                                        const c10d::GatherOptions& opts) override {
    at::Tensor& in = Single(inputs, "gather");
    Buffer src = Dense(in, false);
    tpu::CollectiveEntry e = Entry(tpu::CollectiveKind::kGather, src.t);
    e.peer = static_cast<int32_t>(opts.rootRank);
    e.send = Address(src.t);
    std::vector<std::pair<at::Tensor, at::Tensor>> after;
    std::vector<at::Tensor> keep, outs;
    if (getRank() == opts.rootRank) {
      TORCH_CHECK(outputs.size() == 1 && static_cast<int>(outputs[0].size()) == getSize(),
                  "tpu backend: gather's root needs one output list of ", getSize(), " tensors");
      at::Tensor flat = at::empty({getSize() * in.numel()}, in.options());
      e.recv = Address(flat);
      keep.push_back(flat);
      for (int r = 0; r < getSize(); ++r) {
        CheckSame(in, outputs[0][r], "gather");
        after.emplace_back(outputs[0][r], flat.narrow(0, r * in.numel(), in.numel()));
      }
      outs = outputs[0];
    } else {
      TORCH_CHECK(outputs.empty() || outputs[0].empty(),
                  "tpu backend: gather's outputs are given only on the root");
    }
    return Issue(c10d::OpType::GATHER, {e}, outs, {src}, after, keep);
  }

  c10::intrusive_ptr<c10d::Work> scatter(std::vector<at::Tensor>& outputs,
                                         std::vector<std::vector<at::Tensor>>& inputs,
                                         const c10d::ScatterOptions& opts) override {
    at::Tensor& out = Single(outputs, "scatter");
    Buffer dst = Dense(out, true);
    tpu::CollectiveEntry e = Entry(tpu::CollectiveKind::kScatter, dst.t);
    e.peer = static_cast<int32_t>(opts.rootRank);
    e.recv = Address(dst.t);
    std::vector<at::Tensor> keep;
    if (getRank() == opts.rootRank) {
      TORCH_CHECK(inputs.size() == 1 && static_cast<int>(inputs[0].size()) == getSize(),
                  "tpu backend: scatter's root needs one input list of ", getSize(), " tensors");
      std::vector<at::Tensor> parts;
      for (const at::Tensor& t : inputs[0]) {
        CheckSame(out, t, "scatter");
        parts.push_back(t.reshape({-1}));
      }
      at::Tensor flat = at::cat(parts);
      e.send = Address(flat);
      keep.push_back(flat);
    } else {
      TORCH_CHECK(inputs.empty() || inputs[0].empty(),
                  "tpu backend: scatter's inputs are given only on the root");
    }
    return Issue(c10d::OpType::SCATTER, {e}, {out}, {dst}, {}, keep);
  }

  c10::intrusive_ptr<c10d::Work> reduce_scatter(std::vector<at::Tensor>& outputs,
                                                std::vector<std::vector<at::Tensor>>& inputs,
                                                const c10d::ReduceScatterOptions& opts) override {
    at::Tensor& out = Single(outputs, "reduce_scatter");
    TORCH_CHECK(inputs.size() == 1 && static_cast<int>(inputs[0].size()) == getSize(),
                "tpu backend: reduce_scatter needs one input list of ", getSize(), " tensors");
    std::vector<at::Tensor> parts;
    for (const at::Tensor& t : inputs[0]) {
      CheckSame(out, t, "reduce_scatter");
      parts.push_back(t.reshape({-1}));
    }
    at::Tensor flat = at::cat(parts);
    Buffer dst = Dense(out, true);
    tpu::CollectiveEntry e = Entry(tpu::CollectiveKind::kReduceScatter, dst.t);
    e.reduce = ToReduceOp(opts.reduceOp);
    e.send = Address(flat);
    e.recv = Address(dst.t);
    return Issue(c10d::OpType::REDUCE_SCATTER, {e}, {out}, {dst}, {}, {flat});
  }

  c10::intrusive_ptr<c10d::Work> _reduce_scatter_base(
      at::Tensor& output, at::Tensor& input, const c10d::ReduceScatterOptions& opts) override {
    std::vector<tpu::CollectiveEntry> e;
    std::vector<Buffer> b;
    ReduceScatterInto(output, input, opts, &e, &b);
    return Issue(c10d::OpType::_REDUCE_SCATTER_BASE, e, {output}, b);
  }

  c10::intrusive_ptr<c10d::Work> reduce_scatter_tensor_coalesced(
      std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
      const c10d::ReduceScatterOptions& opts) override {
    TORCH_CHECK(outputs.size() == inputs.size() && !inputs.empty(),
                "tpu backend: reduce_scatter_tensor_coalesced needs one output per input");
    std::vector<tpu::CollectiveEntry> e;
    std::vector<Buffer> b;
    for (size_t i = 0; i < inputs.size(); ++i) ReduceScatterInto(outputs[i], inputs[i], opts, &e, &b);
    return Issue(c10d::OpType::COALESCED, e, outputs, b);
  }

  c10::intrusive_ptr<c10d::Work> alltoall_base(at::Tensor& output, at::Tensor& input,
                                               std::vector<int64_t>& output_splits,
                                               std::vector<int64_t>& input_splits,
                                               const c10d::AllToAllOptions&) override {
    CheckTpu(input, "all_to_all's input");
    CheckTpu(output, "all_to_all's output");
    TORCH_CHECK(input.scalar_type() == output.scalar_type(),
                "tpu backend: all_to_all's input and output differ in dtype");
    const int n = getSize();
    auto counts = [&](const at::Tensor& t, const std::vector<int64_t>& splits, const char* what) {
      std::vector<int64_t> c;
      const int64_t rows = t.dim() == 0 ? 1 : t.size(0);
      const int64_t per_row = rows == 0 ? 0 : t.numel() / rows;
      if (splits.empty()) {
        TORCH_CHECK(rows % n == 0, "tpu backend: all_to_all's ", what, " has ", rows,
                    " rows, not divisible by the group size ", n);
        c.assign(n, rows / n * per_row);
      } else {
        TORCH_CHECK(static_cast<int>(splits.size()) == n, "tpu backend: all_to_all needs ", n,
                    " ", what, " splits, got ", splits.size());
        int64_t total = 0;
        for (int64_t s : splits) {
          TORCH_CHECK(s >= 0, "tpu backend: negative all_to_all split");
          total += s;
          c.push_back(s * per_row);
        }
        TORCH_CHECK(total == rows, "tpu backend: all_to_all's ", what, " splits sum to ", total,
                    " but it has ", rows, " rows");
      }
      return c;
    };
    Buffer src = Dense(input, false);
    Buffer dst = Dense(output, true);
    tpu::CollectiveEntry e = Entry(tpu::CollectiveKind::kAllToAll, src.t);
    e.count = 0;
    e.send = Address(src.t);
    e.recv = Address(dst.t);
    e.send_counts = counts(input, input_splits, "input");
    e.recv_counts = counts(output, output_splits, "output");
    return Issue(c10d::OpType::ALLTOALL_BASE, {e}, {output}, {src, dst});
  }

  c10::intrusive_ptr<c10d::Work> alltoall(std::vector<at::Tensor>& outputs,
                                          std::vector<at::Tensor>& inputs,
                                          const c10d::AllToAllOptions&) override {
    const int n = getSize();
    TORCH_CHECK(static_cast<int>(outputs.size()) == n && static_cast<int>(inputs.size()) == n,
                "tpu backend: all_to_all needs ", n, " input and ", n, " output tensors");
    std::vector<at::Tensor> parts;
    tpu::CollectiveEntry e;
    int64_t out_total = 0;
    for (int r = 0; r < n; ++r) {
      CheckTpu(inputs[r], "all_to_all's input");
      CheckTpu(outputs[r], "all_to_all's output");
      TORCH_CHECK(inputs[r].scalar_type() == inputs[0].scalar_type() &&
                      outputs[r].scalar_type() == inputs[0].scalar_type(),
                  "tpu backend: all_to_all's tensors must share one dtype");
      parts.push_back(inputs[r].reshape({-1}));
      e.send_counts.push_back(inputs[r].numel());
      e.recv_counts.push_back(outputs[r].numel());
      out_total += outputs[r].numel();
    }
    at::Tensor in_flat = at::cat(parts);
    at::Tensor out_flat = at::empty({out_total}, inputs[0].options());
    e.kind = tpu::CollectiveKind::kAllToAll;
    e.dtype = static_cast<int8_t>(inputs[0].scalar_type());
    e.send = Address(in_flat);
    e.recv = Address(out_flat);
    std::vector<std::pair<at::Tensor, at::Tensor>> after;
    int64_t off = 0;
    for (int r = 0; r < n; ++r) {
      after.emplace_back(outputs[r], out_flat.narrow(0, off, outputs[r].numel()));
      off += outputs[r].numel();
    }
    return Issue(c10d::OpType::ALLTOALL, {e}, outputs, {}, after, {in_flat, out_flat});
  }

  c10::intrusive_ptr<c10d::Work> send(std::vector<at::Tensor>& tensors, int dst,
                                      int tag) override {
    at::Tensor& t = Single(tensors, "send");
    Buffer b = Dense(t, false);
    tpu::CollectiveEntry e = Entry(tpu::CollectiveKind::kSend, b.t);
    e.peer = dst;
    e.send = Address(b.t);
    return Issue(c10d::OpType::SEND, {e}, {t}, {b});
  }

  c10::intrusive_ptr<c10d::Work> recv(std::vector<at::Tensor>& tensors, int src,
                                      int tag) override {
    at::Tensor& t = Single(tensors, "recv");
    Buffer b = Dense(t, true);
    tpu::CollectiveEntry e = Entry(tpu::CollectiveKind::kRecv, b.t);
    e.peer = src;
    e.recv = Address(b.t);
    return Issue(c10d::OpType::RECV, {e}, {t}, {b});
  }

  c10::intrusive_ptr<c10d::Work> recvAnysource(std::vector<at::Tensor>&, int) override {
    TORCH_CHECK(false, "tpu backend: recv from any source is not supported; name the source rank");
  }

  c10::intrusive_ptr<c10d::Work> barrier(const c10d::BarrierOptions& opts) override {
    c10::DeviceIndex device = CurrentDevice();
    if (!opts.device_ids.empty()) device = static_cast<c10::DeviceIndex>(opts.device_ids[0]);
    tpu::CollectiveEntry e;
    e.kind = tpu::CollectiveKind::kBarrier;
    e.dtype = static_cast<int8_t>(at::kByte);
    TORCH_CHECK(!coalescing_, "tpu backend: barrier inside a coalescing group");
    const int stream = SessionStream(CurrentStreamId(device));
    Check(GetSession().EnqueueCollective(stream, ChipOf(device), CommFor(device), &e, 1).status(),
          "barrier");
    return c10::make_intrusive<WorkTPU>(c10d::OpType::BARRIER, std::vector<at::Tensor>{},
                                        RecordOn(device), device, /*blocking=*/true);
  }

 private:
  // A dense view of a tensor the collective reads or writes: the tensor
  // itself, or a contiguous copy (written back after, when written).
  struct Buffer {
    at::Tensor t;
    at::Tensor original;
    bool write_back = false;
  };

  Buffer Dense(const at::Tensor& t, bool write) {
    CheckTpu(t, "a collective's tensor");
    if (t.is_contiguous() && !t.is_conj() && !t.is_neg()) return Buffer{t, t, false};
    return Buffer{t.resolve_conj().resolve_neg().contiguous(), t, write};
  }

  at::Tensor& Single(std::vector<at::Tensor>& tensors, const char* what) {
    TORCH_CHECK(tensors.size() == 1, "tpu backend: ", what,
                " takes one tensor per process (got ", tensors.size(), ")");
    CheckTpu(tensors[0], what);
    return tensors[0];
  }

  void CheckSame(const at::Tensor& a, const at::Tensor& b, const char* what) {
    CheckTpu(b, what);
    TORCH_CHECK(a.scalar_type() == b.scalar_type() && a.numel() == b.numel() &&
                    a.device() == b.device(),
                "tpu backend: ", what, "'s tensors must match in dtype, size and device (",
                a.scalar_type(), " ", a.sizes(), " vs ", b.scalar_type(), " ", b.sizes(), ")");
  }

  tpu::CollectiveEntry Entry(tpu::CollectiveKind kind, const at::Tensor& t) {
    tpu::CollectiveEntry e;
    e.kind = kind;
    e.dtype = static_cast<int8_t>(t.scalar_type());
    e.count = static_cast<uint64_t>(t.numel());
    return e;
  }

  void AllGatherInto(at::Tensor& output, at::Tensor& input,
                     std::vector<tpu::CollectiveEntry>* entries, std::vector<Buffer>* buffers) {
    CheckTpu(input, "all_gather_into_tensor's input");
    CheckTpu(output, "all_gather_into_tensor's output");
    TORCH_CHECK(output.numel() == input.numel() * getSize() &&
                    output.scalar_type() == input.scalar_type(),
                "tpu backend: all_gather_into_tensor's output must hold ", getSize(),
                " x the input's ", input.numel(), " elements of ", input.scalar_type());
    Buffer src = Dense(input, false);
    Buffer dst = Dense(output, true);
    tpu::CollectiveEntry e = Entry(tpu::CollectiveKind::kAllGather, src.t);
    e.send = Address(src.t);
    e.recv = Address(dst.t);
    entries->push_back(e);
    buffers->push_back(src);
    buffers->push_back(dst);
  }

  void ReduceScatterInto(at::Tensor& output, at::Tensor& input,
                         const c10d::ReduceScatterOptions& opts,
                         std::vector<tpu::CollectiveEntry>* entries,
                         std::vector<Buffer>* buffers) {
    CheckTpu(input, "reduce_scatter_tensor's input");
    CheckTpu(output, "reduce_scatter_tensor's output");
    TORCH_CHECK(input.numel() == output.numel() * getSize() &&
                    output.scalar_type() == input.scalar_type(),
                "tpu backend: reduce_scatter_tensor's input must hold ", getSize(),
                " x the output's ", output.numel(), " elements of ", output.scalar_type());
    Buffer src = Dense(input, false);
    Buffer dst = Dense(output, true);
    tpu::CollectiveEntry e = Entry(tpu::CollectiveKind::kReduceScatter, dst.t);
    e.reduce = ToReduceOp(opts.reduceOp);
    e.send = Address(src.t);
    e.recv = Address(dst.t);
    entries->push_back(e);
    buffers->push_back(src);
    buffers->push_back(dst);
  }

  // The communicator of this group on `device`, formed on first use.
  uint64_t CommFor(c10::DeviceIndex device) {
    auto it = comms_.find(device);
    if (it != comms_.end()) return it->second;
    // Ranks form their communicators in the same order (each rank's device
    // may differ): the n-th one of the group is named by n.
    const std::string name = "tpu_comm_" + std::to_string(generation_++);
    std::string key;
    if (getRank() == 0) {
      std::random_device rd;
      key = name + "_" + std::to_string(rd()) + std::to_string(rd());
      store_->set(name, std::vector<uint8_t>(key.begin(), key.end()));
    } else {
      std::vector<uint8_t> v = store_->get(name);
      key.assign(v.begin(), v.end());
    }
    absl::StatusOr<uint64_t> id = GetSession().JoinCommunicator(
        key, getSize(), getRank(), ChipOf(device), absl::FromChrono(timeout_),
        absl::FromChrono(timeout_));
    Check(id.status(), "forming the tpu communicator");
    comms_[device] = *id;
    return *id;
  }

  tpu::Event RecordOn(c10::DeviceIndex device) {
    absl::StatusOr<tpu::Event> ev = GetSession().RecordEvent(SessionStream(CurrentStreamId(device)));
    Check(ev.status(), "recording a collective's event");
    return *ev;
  }

  c10::intrusive_ptr<c10d::Work> Issue(c10d::OpType type,
                                       const std::vector<tpu::CollectiveEntry>& entries,
                                       const std::vector<at::Tensor>& outputs,
                                       const std::vector<Buffer>& buffers,
                                       const std::vector<std::pair<at::Tensor, at::Tensor>>& after = {},
                                       const std::vector<at::Tensor>& keep = {}) {
    c10::DeviceIndex device = -1;
    for (const Buffer& b : buffers) {
      if (b.t.defined()) device = b.t.device().index();
    }
    if (device < 0 && !after.empty()) device = after[0].second.device().index();
    if (device < 0 && !keep.empty()) device = keep[0].device().index();
    if (device < 0) device = CurrentDevice();
    if (coalescing_) {
      TORCH_CHECK(pending_device_ < 0 || pending_device_ == device,
                  "tpu backend: a coalesced group spans devices");
      pending_device_ = device;
      pending_.insert(pending_.end(), entries.begin(), entries.end());
      for (const Buffer& b : buffers) {
        if (b.write_back) pending_after_.emplace_back(b.original, b.t);
      }
      pending_after_.insert(pending_after_.end(), after.begin(), after.end());
      pending_outputs_.insert(pending_outputs_.end(), outputs.begin(), outputs.end());
      pending_keep_.insert(pending_keep_.end(), keep.begin(), keep.end());
      // Each call inside the group returns a Work that completes with it.
      return c10::make_intrusive<WorkTPU>(type, outputs, RecordOn(device), device, false);
    }
    const int stream = SessionStream(CurrentStreamId(device));
    absl::StatusOr<uint64_t> seq = GetSession().EnqueueCollective(
        stream, ChipOf(device), CommFor(device), entries.data(), entries.size());
    Check(seq.status(), c10d::opTypeToString(type).c_str());
    for (const Buffer& b : buffers) {
      if (b.write_back) b.original.copy_(b.t);
    }
    for (const auto& [dst, src] : after) dst.copy_(src.view(dst.sizes()));
    return c10::make_intrusive<WorkTPU>(type, outputs, RecordOn(device), device, false);
  }

  c10::intrusive_ptr<c10d::Work> Flush(c10d::OpType type) {
    const c10::DeviceIndex device = pending_device_;
    const int stream = SessionStream(CurrentStreamId(device));
    absl::StatusOr<uint64_t> seq = GetSession().EnqueueCollective(
        stream, ChipOf(device), CommFor(device), pending_.data(), pending_.size());
    Check(seq.status(), "coalesced collectives");
    for (const auto& [dst, src] : pending_after_) dst.copy_(src.view(dst.sizes()));
    std::vector<at::Tensor> outputs = std::move(pending_outputs_);
    pending_.clear();
    pending_after_.clear();
    pending_keep_.clear();
    pending_outputs_.clear();
    return c10::make_intrusive<WorkTPU>(type, outputs, RecordOn(device), device, false);
  }

  c10::intrusive_ptr<c10d::Store> store_;
  std::chrono::milliseconds timeout_;
  std::map<c10::DeviceIndex, uint64_t> comms_;
  uint64_t generation_ = 0;
  bool coalescing_ = false;
  c10::DeviceIndex pending_device_ = -1;
  std::vector<tpu::CollectiveEntry> pending_;
  std::vector<std::pair<at::Tensor, at::Tensor>> pending_after_;
  std::vector<at::Tensor> pending_outputs_;
  std::vector<at::Tensor> pending_keep_;
};

}  // namespace

void RegisterDistributed(py::module& m) {
  py::module::import("torch._C._distributed_c10d");
  py::class_<ProcessGroupTPU, c10d::Backend, c10::intrusive_ptr<ProcessGroupTPU>>(
      m, "_ProcessGroupTPU")
      .def(py::init([](const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                       std::chrono::milliseconds timeout) {
             return c10::make_intrusive<ProcessGroupTPU>(store, rank, size, timeout);
           }),
           py::arg("store"), py::arg("rank"), py::arg("size"), py::arg("timeout"),
           py::call_guard<py::gil_scoped_release>());
}

}  // namespace torch_tpu
