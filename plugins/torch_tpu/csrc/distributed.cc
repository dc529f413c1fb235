// torch.distributed's "tpu" backend: a c10d::Backend whose collectives run
// inside tpud (daemon/collectives/groups.h), ordered in the caller's
// current tpu stream like any op.
//
// Each process group forms its tpud communicator at its first collective,
// on the device of that collective's tensors (so set_device may come before
// or after init_process_group): rank 0 puts a fresh key in the group's
// store, every rank joins under it. A lone send/recv before that forms a
// communicator of the two ranks only. Tensors go as dense buffers; where a call
// hands lists or strided tensors, they are packed into (and unpacked from) a
// contiguous buffer with ordinary tpu ops on the same stream.
//
// A Work completes with its record: wait() orders the caller's current
// stream after it (as NCCL's does); errors (a mismatched call, a dead peer,
// a timeout) surface at the stream's next synchronisation on every rank.
#include <c10/core/ScalarType.h>
#include <pybind11/chrono.h>
#include <torch/csrc/utils/pybind.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <functional>
#include <map>
#include <optional>
#include <random>
#include <string>
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>
#include <tuple>
#include <utility>
#include <vector>

#include "collective_work.h"
#include "reduce_ops.h"
#include "runtime.h"
#include "tpu/client.h"

namespace torch_tpu {
namespace {

constexpr c10::DeviceType kTpu = c10::DeviceType::PrivateUse1;

uint64_t Address(const at::Tensor& t) {
  return t.numel() == 0 ? 0 : reinterpret_cast<uint64_t>(t.data_ptr());
}

void CheckTpu(const at::Tensor& t, const char* what) {
  TORCH_CHECK(t.defined() && t.device().type() == kTpu, "tpu backend: ", what,
              " must be a tpu tensor, got ",
              t.defined() ? t.device().str() : "an undefined tensor");
  TORCH_CHECK(!t.is_sparse(), "tpu backend: ", what, " must be dense");
}

class ProcessGroupTPU : public c10d::Backend {
 public:
  // `host_of[r]`: the host (tpud) of rank r, numbered by first rank; `cross`:
  // gloo among the first rank of each host, on that host's first rank only
  // (null elsewhere, and when the group has one host).
  ProcessGroupTPU(c10::intrusive_ptr<c10d::Store> store, int rank, int size,
                  std::chrono::milliseconds timeout, std::vector<int> host_of,
                  c10::intrusive_ptr<c10d::Backend> cross,
                  c10::intrusive_ptr<c10d::Backend> world)
      : c10d::Backend(rank, size),
        store_(std::move(store)),
        timeout_(timeout),
        host_of_(std::move(host_of)),
        cross_(std::move(cross)),
        world_(std::move(world)) {
    if (host_of_.empty()) host_of_.assign(size, 0);
    TORCH_CHECK(static_cast<int>(host_of_.size()) == size,
                "tpu backend: host layout of ", host_of_.size(),
                " ranks for a group of ", size);
    host_ = host_of_[rank];
    num_hosts_ = *std::max_element(host_of_.begin(), host_of_.end()) + 1;
    for (int r = 0; r < size; ++r) {
      if (host_of_[r] == host_) local_ranks_.push_back(r);
    }
    local_rank_ = static_cast<int>(
        std::find(local_ranks_.begin(), local_ranks_.end(), rank) -
        local_ranks_.begin());
    TORCH_CHECK(num_hosts_ == 1 || local_rank_ != 0 || cross_,
                "tpu backend: rank ", rank,
                " leads its host but has no cross-host group");
    TORCH_CHECK(num_hosts_ == 1 || world_,
                "tpu backend: a group across hosts needs a gloo group "
                "of all its ranks");
    // Communicators form lazily, as NCCL's do: at the group's first
    // collective, on the device of its tensors (the rank's device is often
    // set only after init_process_group). A first send/recv between two
    // ranks forms a communicator of just that pair, so the others need not
    // take part.
  }

  // A group never destroyed (often at interpreter exit): leave without
  // waiting, as NCCL's destructor aborts; a collective a peer never joined
  // would otherwise hold the exit for the group's whole timeout.
  ~ProcessGroupTPU() override { LeaveAll(/*now=*/true); }

  // destroy_process_group() and abort: the communicators go back to tpud at
  // once, however long the group object itself lives on (FSDP and
  // DeviceMesh keep references to it).
  void shutdown() override {
    LeaveAll();
    shut_down_ = true;
  }
  void abort() override {
    LeaveAll(/*now=*/true);
    shut_down_ = true;
  }

  const std::string getBackendName() const override { return "tpu"; }
  bool supportsCoalescing() const override { return true; }
  void setTimeout(std::chrono::milliseconds timeout) override {
    timeout_ = timeout;
  }

  // init_process_group(device_id=...), new_group and split_group once the
  // default group has a device: the communicator forms now, on `device`,
  // instead of at the first collective.
  void eagerConnectSingleDevice(at::Device device) override {
    if (device.type() == kTpu && device.has_index()) CommFor(device.index());
  }

  // dist.split_group, and DeviceMesh's sub-meshes once the default group
  // has a device: the ranks `ranks` of this group (sorted; a rank's index
  // is its rank in the split) become a group made as init_process_group
  // makes one (torch_tpu.distributed._create_backend), whose communicator
  // forms at once on this group's device, as NCCL's split does. A rank not
  // in `ranks` gets none and waits for nothing. Its store is this group's,
  // under the split's number (every rank of this group takes part in each
  // split), not the one torch names: that name hashes the number of groups
  // each process knows, one fewer on ranks that were outside a new_group.
  bool supportsSplitting() const override { return true; }
  c10::intrusive_ptr<c10d::Backend> split(
      const c10::intrusive_ptr<c10d::Store>&, const std::vector<int>& ranks,
      const c10::intrusive_ptr<Options>& opts) override {
    std::string name = "tpu_split" + std::to_string(splits_++);
    for (int r : ranks) name += "_" + std::to_string(r);
    const auto it = std::find(ranks.begin(), ranks.end(), getRank());
    if (it == ranks.end()) return nullptr;
    const int rank = static_cast<int>(it - ranks.begin());
    const std::chrono::milliseconds timeout = opts ? opts->timeout : timeout_;
    c10::intrusive_ptr<c10d::Backend> child;
    {
      py::gil_scoped_acquire gil;
      child =
          py::module::import("torch_tpu.distributed")
              .attr("_create_backend")(
                  c10::make_intrusive<c10d::PrefixStore>(name + "/", store_),
                  rank, static_cast<int>(ranks.size()), timeout)
              .cast<c10::intrusive_ptr<c10d::Backend>>();
    }
    const std::optional<at::Device> bound = getBoundDeviceId();
    const c10::DeviceIndex device =
        device_ >= 0 ? device_
                     : (bound && bound->type() == kTpu ? bound->index() : -1);
    if (device >= 0) child->eagerConnectSingleDevice(at::Device(kTpu, device));
    return child;
  }
  // What split_group passes on when the caller gives no options.
  c10::intrusive_ptr<Options> getBackendOptions() override {
    auto opts = c10::make_intrusive<Options>("tpu", timeout_);
    opts->group_name = getGroupUid();
    opts->group_desc = getGroupDesc();
    return opts;
  }
  // Every rank starts at 0: the number of calls on this group so far.
  void setSequenceNumberForGroup() override {}
  uint64_t getSequenceNumberForGroup() override { return calls_; }

  void startCoalescing() override {
    TORCH_CHECK(!coalescing_, "tpu backend: coalescing already started");
    coalescing_ = true;
    pending_.clear();
    pending_host_.clear();
    pending_outputs_.clear();
    pending_after_.clear();
    pending_device_ = -1;
  }

  c10::intrusive_ptr<c10d::Work> endCoalescing() override {
    TORCH_CHECK(coalescing_,
                "tpu backend: endCoalescing without startCoalescing");
    coalescing_ = false;
    c10::intrusive_ptr<c10d::Work> local;
    if (!pending_.empty()) local = Flush(c10d::OpType::COALESCED);
    if (!pending_host_.empty()) {
      std::vector<WorkHost::Part> parts = std::move(pending_host_);
      pending_host_.clear();
      return c10::make_intrusive<WorkHost>(c10d::OpType::COALESCED,
                                           std::move(parts), local);
    }
    if (local) return local;
    return MakeWork(c10d::OpType::COALESCED, std::vector<at::Tensor>{},
                    RecordOn(CurrentDevice()), CurrentDevice(), false);
  }

  c10::intrusive_ptr<c10d::Work> broadcast(
      std::vector<at::Tensor>& tensors,
      const c10d::BroadcastOptions& opts) override {
    if (MultiHost()) {
      at::Tensor& t = Single(tensors, "broadcast");
      Buffer b = Dense(t, true);
      HierBroadcast(b.t, static_cast<int>(opts.rootRank));
      if (b.write_back) t.copy_(b.t);
      return Done(c10d::OpType::BROADCAST, {t}, t);
    }
    at::Tensor& t = Single(tensors, "broadcast");
    Buffer b = Dense(t, /*write=*/true);
    tpu::CollectiveEntry e = Entry(tpu::CollectiveKind::kBroadcast, b.t);
    e.peer = static_cast<int32_t>(opts.rootRank);
    e.send = e.recv = Address(b.t);
    return Issue(c10d::OpType::BROADCAST, {e}, {t}, {b});
  }

  c10::intrusive_ptr<c10d::Work> allreduce(
      std::vector<at::Tensor>& tensors,
      const c10d::AllreduceOptions& opts) override {
    if (MultiHost()) {
      at::Tensor& t = Single(tensors, "all_reduce");
      Buffer b = Dense(t, true);
      HierAllReduce(b.t, ReduceInPlace(opts.reduceOp, b.t));
      if (b.write_back) t.copy_(b.t);
      return Done(c10d::OpType::ALLREDUCE, {t}, t);
    }
    at::Tensor& t = Single(tensors, "all_reduce");
    Buffer b = Dense(t, true);
    tpu::CollectiveEntry e = Entry(tpu::CollectiveKind::kAllReduce, b.t);
    e.reduce = ReduceInPlace(opts.reduceOp, b.t);
    e.send = e.recv = Address(b.t);
    return Issue(c10d::OpType::ALLREDUCE, {e}, {t}, {b});
  }

  c10::intrusive_ptr<c10d::Work> allreduce_coalesced(
      std::vector<at::Tensor>& tensors,
      const c10d::AllreduceCoalescedOptions& opts) override {
    if (MultiHost()) {
      for (at::Tensor& t : tensors) {
        CheckTpu(t, "allreduce_coalesced's tensor");
        Buffer b = Dense(t, true);
        HierAllReduce(b.t, ReduceInPlace(opts.reduceOp, b.t));
        if (b.write_back) t.copy_(b.t);
      }
      return Done(c10d::OpType::ALLREDUCE_COALESCED, tensors, tensors.at(0));
    }
    TORCH_CHECK(!tensors.empty(),
                "tpu backend: allreduce_coalesced of no tensors");
    std::vector<tpu::CollectiveEntry> entries;
    std::vector<Buffer> buffers;
    for (at::Tensor& t : tensors) {
      CheckTpu(t, "allreduce_coalesced's tensor");
      Buffer b = Dense(t, true);
      tpu::CollectiveEntry e = Entry(tpu::CollectiveKind::kAllReduce, b.t);
      e.reduce = ReduceInPlace(opts.reduceOp, b.t);
      e.send = e.recv = Address(b.t);
      entries.push_back(e);
      buffers.push_back(b);
    }
    return Issue(c10d::OpType::ALLREDUCE_COALESCED, entries, tensors, buffers);
  }

  c10::intrusive_ptr<c10d::Work> reduce(
      std::vector<at::Tensor>& tensors,
      const c10d::ReduceOptions& opts) override {
    if (MultiHost()) {
      at::Tensor& t = Single(tensors, "reduce");
      at::Tensor tmp = t.contiguous().clone();
      HierAllReduce(tmp, ReduceInPlace(opts.reduceOp, tmp));
      if (getRank() == opts.rootRank) t.copy_(tmp.view(t.sizes()));
      return Done(c10d::OpType::REDUCE, {t}, t);
    }
    at::Tensor& t = Single(tensors, "reduce");
    Buffer b = Dense(t, true);
    tpu::CollectiveEntry e = Entry(tpu::CollectiveKind::kReduce, b.t);
    e.reduce = ToReduceOp(opts.reduceOp, b.t.scalar_type());
    e.peer = static_cast<int32_t>(opts.rootRank);
    // PREMUL_SUM sends a scaled copy: the other ranks' tensors stay as they
    // were, as with NCCL.
    const at::Tensor in = PreMultiplied(opts.reduceOp, b.t);
    e.send = Address(in);
    e.recv = Address(b.t);
    return Issue(c10d::OpType::REDUCE, {e}, {t}, {b}, {}, {in});
  }

  c10::intrusive_ptr<c10d::Work> allgather(
      std::vector<std::vector<at::Tensor>>& outputs,
      std::vector<at::Tensor>& inputs, const c10d::AllgatherOptions&) override {
    at::Tensor& in = Single(inputs, "all_gather");
    TORCH_CHECK(
        outputs.size() == 1 && static_cast<int>(outputs[0].size()) == getSize(),
        "tpu backend: all_gather needs one output list of ", getSize(),
        " tensors");
    std::vector<at::Tensor>& outs = outputs[0];
    // Ranks' tensors may differ in size (as NCCL allows): each goes padded
    // to the largest, m elements.
    const int64_t m = LargestPart(in, outs, "all_gather");
    at::Tensor src = in.numel() == m ? Dense(in, false).t : Packed({in}, m);
    at::Tensor flat = at::empty({getSize() * m}, in.options());
    if (MultiHost()) {
      HierAllGather(flat, src);
      for (int r = 0; r < getSize(); ++r)
        outs[r].copy_(
            flat.narrow(0, r * m, outs[r].numel()).view(outs[r].sizes()));
      return Done(c10d::OpType::ALLGATHER, outs, in);
    }
    tpu::CollectiveEntry e = Entry(tpu::CollectiveKind::kAllGather, src);
    e.send = Address(src);
    e.recv = Address(flat);
    std::vector<std::pair<at::Tensor, at::Tensor>> after;
    for (int r = 0; r < getSize(); ++r)
      after.emplace_back(outs[r], flat.narrow(0, r * m, outs[r].numel()));
    return Issue(c10d::OpType::ALLGATHER, {e}, outs, {Buffer{src, src}}, after,
                 {flat});
  }

  c10::intrusive_ptr<c10d::Work> _allgather_base(
      at::Tensor& output, at::Tensor& input,
      const c10d::AllgatherOptions&) override {
    if (MultiHost()) {
      TORCH_CHECK(output.numel() == input.numel() * getSize(),
                  "tpu backend: all_gather_into_tensor's output must hold ",
                  getSize(), " x the input");
      Buffer dst = Dense(output, true);
      HierAllGather(dst.t, input.contiguous());
      if (dst.write_back) output.copy_(dst.t);
      return Done(c10d::OpType::_ALLGATHER_BASE, {output}, output);
    }
    std::vector<tpu::CollectiveEntry> e;
    std::vector<Buffer> b;
    AllGatherInto(output, input, &e, &b);
    return Issue(c10d::OpType::_ALLGATHER_BASE, e, {output}, b);
  }

  c10::intrusive_ptr<c10d::Work> allgather_into_tensor_coalesced(
      std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
      const c10d::AllgatherOptions& opts) override {
    TORCH_CHECK(outputs.size() == inputs.size() && !inputs.empty(),
                "tpu backend: allgather_into_tensor_coalesced needs one output "
                "per input");
    if (MultiHost()) {
      c10::intrusive_ptr<c10d::Work> last;
      for (size_t i = 0; i < inputs.size(); ++i)
        last = _allgather_base(outputs[i], inputs[i], opts);
      return last;
    }
    std::vector<tpu::CollectiveEntry> e;
    std::vector<Buffer> b;
    for (size_t i = 0; i < inputs.size(); ++i)
      AllGatherInto(outputs[i], inputs[i], &e, &b);
    return Issue(c10d::OpType::COALESCED, e, outputs, b);
  }

  // all_gather_coalesced: outputs[r][i] receives rank r's inputs[i].
  c10::intrusive_ptr<c10d::Work> allgather_coalesced(
      std::vector<std::vector<at::Tensor>>& outputs,
      std::vector<at::Tensor>& inputs,
      const c10d::AllgatherOptions& opts) override {
    TORCH_CHECK(
        !inputs.empty() && static_cast<int>(outputs.size()) == getSize(),
        "tpu backend: all_gather_coalesced needs ", getSize(),
        " output lists (one per rank), got ", outputs.size());
    for (int r = 0; r < getSize(); ++r) {
      TORCH_CHECK(outputs[r].size() == inputs.size(),
                  "tpu backend: all_gather_coalesced's output list for rank ",
                  r, " holds ", outputs[r].size(), " tensors, one per input (",
                  inputs.size(), ") expected");
      for (size_t i = 0; i < inputs.size(); ++i)
        CheckSame(inputs[i], outputs[r][i], "all_gather_coalesced");
    }
    if (MultiHost()) {
      c10::intrusive_ptr<c10d::Work> last;
      for (size_t i = 0; i < inputs.size(); ++i) {
        std::vector<at::Tensor> in{inputs[i]};
        std::vector<std::vector<at::Tensor>> outs(1);
        for (int r = 0; r < getSize(); ++r) outs[0].push_back(outputs[r][i]);
        last = allgather(outs, in, opts);
      }
      return last;
    }
    std::vector<tpu::CollectiveEntry> entries;
    std::vector<Buffer> buffers;
    std::vector<std::pair<at::Tensor, at::Tensor>> after;
    std::vector<at::Tensor> keep, all_outputs;
    for (size_t i = 0; i < inputs.size(); ++i) {
      CheckTpu(inputs[i], "all_gather_coalesced's input");
      const int64_t n = inputs[i].numel();
      Buffer src = Dense(inputs[i], false);
      at::Tensor flat = at::empty({getSize() * n}, inputs[i].options());
      tpu::CollectiveEntry e = Entry(tpu::CollectiveKind::kAllGather, src.t);
      e.send = Address(src.t);
      e.recv = Address(flat);
      entries.push_back(e);
      buffers.push_back(src);
      keep.push_back(flat);
      for (int r = 0; r < getSize(); ++r)
        after.emplace_back(outputs[r][i], flat.narrow(0, r * n, n));
    }
    for (const std::vector<at::Tensor>& list : outputs)
      all_outputs.insert(all_outputs.end(), list.begin(), list.end());
    return Issue(c10d::OpType::ALLGATHER_COALESCED, entries, all_outputs,
                 buffers, after, keep);
  }

  c10::intrusive_ptr<c10d::Work> gather(
      std::vector<std::vector<at::Tensor>>& outputs,
      std::vector<at::Tensor>& inputs,
      const c10d::GatherOptions& opts) override {
    if (MultiHost()) {
      at::Tensor& in = Single(inputs, "gather");
      at::Tensor flat = at::empty({getSize() * in.numel()}, in.options());
      HierAllGather(flat, in.contiguous());
      std::vector<at::Tensor> outs;
      if (getRank() == opts.rootRank) {
        TORCH_CHECK(outputs.size() == 1 &&
                        static_cast<int>(outputs[0].size()) == getSize(),
                    "tpu backend: gather's root needs one output list of ",
                    getSize(), " tensors");
        for (int r = 0; r < getSize(); ++r) {
          outputs[0][r].copy_(flat.narrow(0, r * in.numel(), in.numel())
                                  .view(outputs[0][r].sizes()));
        }
        outs = outputs[0];
      }
      return Done(c10d::OpType::GATHER, outs, in);
    }
    at::Tensor& in = Single(inputs, "gather");
    Buffer src = Dense(in, false);
    tpu::CollectiveEntry e = Entry(tpu::CollectiveKind::kGather, src.t);
    e.peer = static_cast<int32_t>(opts.rootRank);
    e.send = Address(src.t);
    std::vector<std::pair<at::Tensor, at::Tensor>> after;
    std::vector<at::Tensor> keep, outs;
    if (getRank() == opts.rootRank) {
      TORCH_CHECK(outputs.size() == 1 &&
                      static_cast<int>(outputs[0].size()) == getSize(),
                  "tpu backend: gather's root needs one output list of ",
                  getSize(), " tensors");
      at::Tensor flat = at::empty({getSize() * in.numel()}, in.options());
      e.recv = Address(flat);
      keep.push_back(flat);
      for (int r = 0; r < getSize(); ++r) {
        CheckSame(in, outputs[0][r], "gather");
        after.emplace_back(outputs[0][r],
                           flat.narrow(0, r * in.numel(), in.numel()));
      }
      outs = outputs[0];
    } else {
      TORCH_CHECK(outputs.empty() || outputs[0].empty(),
                  "tpu backend: gather's outputs are given only on the root");
    }
    return Issue(c10d::OpType::GATHER, {e}, outs, {src}, after, keep);
  }

  c10::intrusive_ptr<c10d::Work> scatter(
      std::vector<at::Tensor>& outputs,
      std::vector<std::vector<at::Tensor>>& inputs,
      const c10d::ScatterOptions& opts) override {
    if (MultiHost()) {
      at::Tensor& out = Single(outputs, "scatter");
      at::Tensor flat = at::empty({getSize() * out.numel()}, out.options());
      if (getRank() == opts.rootRank) {
        TORCH_CHECK(inputs.size() == 1 &&
                        static_cast<int>(inputs[0].size()) == getSize(),
                    "tpu backend: scatter's root needs one input list of ",
                    getSize(), " tensors");
        std::vector<at::Tensor> parts;
        for (const at::Tensor& t : inputs[0]) parts.push_back(t.reshape({-1}));
        flat.copy_(at::cat(parts));
      }
      HierBroadcast(flat, static_cast<int>(opts.rootRank));
      out.copy_(flat.narrow(0, getRank() * out.numel(), out.numel())
                    .view(out.sizes()));
      return Done(c10d::OpType::SCATTER, {out}, out);
    }
    at::Tensor& out = Single(outputs, "scatter");
    Buffer dst = Dense(out, true);
    tpu::CollectiveEntry e = Entry(tpu::CollectiveKind::kScatter, dst.t);
    e.peer = static_cast<int32_t>(opts.rootRank);
    e.recv = Address(dst.t);
    std::vector<at::Tensor> keep;
    if (getRank() == opts.rootRank) {
      TORCH_CHECK(
          inputs.size() == 1 && static_cast<int>(inputs[0].size()) == getSize(),
          "tpu backend: scatter's root needs one input list of ", getSize(),
          " tensors");
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

  c10::intrusive_ptr<c10d::Work> reduce_scatter(
      std::vector<at::Tensor>& outputs,
      std::vector<std::vector<at::Tensor>>& inputs,
      const c10d::ReduceScatterOptions& opts) override {
    at::Tensor& out = Single(outputs, "reduce_scatter");
    TORCH_CHECK(
        inputs.size() == 1 && static_cast<int>(inputs[0].size()) == getSize(),
        "tpu backend: reduce_scatter needs one input list of ", getSize(),
        " tensors");
    // Parts may differ in size (as NCCL allows): each goes padded to the
    // largest, m elements.
    const int64_t m = LargestPart(out, inputs[0], "reduce_scatter");
    at::Tensor flat = Packed(inputs[0], m);  // a copy: PREMUL_SUM scales it
    const tpu::ReduceOp op = ReduceInPlace(opts.reduceOp, flat);
    if (MultiHost()) {
      HierAllReduce(flat, op);
      out.copy_(flat.narrow(0, getRank() * m, out.numel()).view(out.sizes()));
      return Done(c10d::OpType::REDUCE_SCATTER, {out}, out);
    }
    Buffer dst = m == out.numel() ? Dense(out, true)
                                  : Buffer{at::empty({m}, out.options()), out};
    tpu::CollectiveEntry e = Entry(tpu::CollectiveKind::kReduceScatter, dst.t);
    e.reduce = op;
    e.send = Address(flat);
    e.recv = Address(dst.t);
    std::vector<std::pair<at::Tensor, at::Tensor>> after;
    if (m != out.numel())
      after.emplace_back(out, dst.t.narrow(0, 0, out.numel()));
    return Issue(c10d::OpType::REDUCE_SCATTER, {e}, {out}, {dst}, after,
                 {flat});
  }

  c10::intrusive_ptr<c10d::Work> _reduce_scatter_base(
      at::Tensor& output, at::Tensor& input,
      const c10d::ReduceScatterOptions& opts) override {
    if (MultiHost()) {
      TORCH_CHECK(input.numel() == output.numel() * getSize(),
                  "tpu backend: reduce_scatter_tensor's input must hold ",
                  getSize(), " x the output");
      at::Tensor tmp = input.contiguous().clone().view({-1});
      HierAllReduce(tmp, ReduceInPlace(opts.reduceOp, tmp));
      output.copy_(tmp.narrow(0, getRank() * output.numel(), output.numel())
                       .view(output.sizes()));
      return Done(c10d::OpType::_REDUCE_SCATTER_BASE, {output}, output);
    }
    std::vector<tpu::CollectiveEntry> e;
    std::vector<Buffer> b;
    ReduceScatterInto(output, input, opts, &e, &b);
    return Issue(c10d::OpType::_REDUCE_SCATTER_BASE, e, {output}, b);
  }

  c10::intrusive_ptr<c10d::Work> reduce_scatter_tensor_coalesced(
      std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
      const c10d::ReduceScatterOptions& opts) override {
    TORCH_CHECK(outputs.size() == inputs.size() && !inputs.empty(),
                "tpu backend: reduce_scatter_tensor_coalesced needs one output "
                "per input");
    if (MultiHost()) {
      c10::intrusive_ptr<c10d::Work> last;
      for (size_t i = 0; i < inputs.size(); ++i)
        last = _reduce_scatter_base(outputs[i], inputs[i], opts);
      return last;
    }
    std::vector<tpu::CollectiveEntry> e;
    std::vector<Buffer> b;
    for (size_t i = 0; i < inputs.size(); ++i)
      ReduceScatterInto(outputs[i], inputs[i], opts, &e, &b);
    return Issue(c10d::OpType::COALESCED, e, outputs, b);
  }

  c10::intrusive_ptr<c10d::Work> alltoall_base(
      at::Tensor& output, at::Tensor& input,
      std::vector<int64_t>& output_splits, std::vector<int64_t>& input_splits,
      const c10d::AllToAllOptions&) override {
    if (MultiHost()) {
      // Across hosts every rank exchanges with every other: through the
      // host's memory, by gloo over all ranks.
      CheckTpu(input, "all_to_all's input");
      CheckTpu(output, "all_to_all's output");
      at::Tensor in_cpu = input.to(at::kCPU).contiguous();
      at::Tensor out_cpu =
          at::empty(output.sizes(), output.options().device(at::kCPU));
      c10d::AllToAllOptions o;
      o.timeout = timeout_;
      world_->alltoall_base(out_cpu, in_cpu, output_splits, input_splits, o)
          ->wait();
      output.copy_(out_cpu);
      return Done(c10d::OpType::ALLTOALL_BASE, {output}, output);
    }
    CheckTpu(input, "all_to_all's input");
    CheckTpu(output, "all_to_all's output");
    TORCH_CHECK(input.scalar_type() == output.scalar_type(),
                "tpu backend: all_to_all's input and output differ in dtype");
    const int n = getSize();
    auto counts = [&](const at::Tensor& t, const std::vector<int64_t>& splits,
                      const char* what) {
      std::vector<int64_t> c;
      const int64_t rows = t.dim() == 0 ? 1 : t.size(0);
      const int64_t per_row = rows == 0 ? 0 : t.numel() / rows;
      if (splits.empty()) {
        TORCH_CHECK(rows % n == 0, "tpu backend: all_to_all's ", what, " has ",
                    rows, " rows, not divisible by the group size ", n);
        c.assign(n, rows / n * per_row);
      } else {
        TORCH_CHECK(static_cast<int>(splits.size()) == n,
                    "tpu backend: all_to_all needs ", n, " ", what,
                    " splits, got ", splits.size());
        int64_t total = 0;
        for (int64_t s : splits) {
          TORCH_CHECK(s >= 0, "tpu backend: negative all_to_all split");
          total += s;
          c.push_back(s * per_row);
        }
        TORCH_CHECK(total == rows, "tpu backend: all_to_all's ", what,
                    " splits sum to ", total, " but it has ", rows, " rows");
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

  c10::intrusive_ptr<c10d::Work> alltoall(
      std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
      const c10d::AllToAllOptions&) override {
    if (MultiHost()) {
      TORCH_CHECK(outputs.size() == inputs.size() &&
                      static_cast<int>(inputs.size()) == getSize(),
                  "tpu backend: all_to_all needs ", getSize(), " input and ",
                  getSize(), " output tensors");
      std::vector<at::Tensor> in_cpu, out_cpu;
      for (size_t r = 0; r < inputs.size(); ++r) {
        CheckTpu(inputs[r], "all_to_all's input");
        CheckTpu(outputs[r], "all_to_all's output");
        in_cpu.push_back(inputs[r].to(at::kCPU).contiguous());
        out_cpu.push_back(at::empty(outputs[r].sizes(),
                                    outputs[r].options().device(at::kCPU)));
      }
      c10d::AllToAllOptions o;
      o.timeout = timeout_;
      world_->alltoall(out_cpu, in_cpu, o)->wait();
      for (size_t r = 0; r < outputs.size(); ++r) outputs[r].copy_(out_cpu[r]);
      return Done(c10d::OpType::ALLTOALL, outputs, outputs.at(0));
    }
    const int n = getSize();
    TORCH_CHECK(static_cast<int>(outputs.size()) == n &&
                    static_cast<int>(inputs.size()) == n,
                "tpu backend: all_to_all needs ", n, " input and ", n,
                " output tensors");
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
      after.emplace_back(outputs[r],
                         out_flat.narrow(0, off, outputs[r].numel()));
      off += outputs[r].numel();
    }
    return Issue(c10d::OpType::ALLTOALL, {e}, outputs, {}, after,
                 {in_flat, out_flat});
  }

  c10::intrusive_ptr<c10d::Work> send(std::vector<at::Tensor>& tensors, int dst,
                                      int tag) override {
    at::Tensor& t = Single(tensors, "send");
    TORCH_CHECK(dst >= 0 && dst < getSize(), "tpu backend: send to rank ", dst,
                " (the group has ranks 0..", getSize() - 1, ")");
    if (MultiHost() && host_of_[dst] != host_) {
      // To another host: a CPU copy goes by gloo (asynchronously, so that
      // batched sends and receives around a ring cannot deadlock).
      std::vector<at::Tensor> cpu{t.to(at::kCPU).contiguous()};
      return HostPart(c10d::OpType::SEND,
                      {world_->send(cpu, dst, tag), cpu[0], at::Tensor()});
    }
    Buffer b = Dense(t, false);
    tpu::CollectiveEntry e = Entry(tpu::CollectiveKind::kSend, b.t);
    e.peer = LocalIndex(dst);
    e.send = Address(b.t);
    return Issue(c10d::OpType::SEND, {e}, {t}, {b}, {}, {}, e.peer);
  }

  c10::intrusive_ptr<c10d::Work> recv(std::vector<at::Tensor>& tensors, int src,
                                      int tag) override {
    at::Tensor& t = Single(tensors, "recv");
    TORCH_CHECK(src >= 0 && src < getSize(), "tpu backend: recv from rank ",
                src, " (the group has ranks 0..", getSize() - 1, ")");
    if (MultiHost() && host_of_[src] != host_) {
      std::vector<at::Tensor> cpu{
          at::empty(t.sizes(), t.options().device(at::kCPU))};
      return HostPart(c10d::OpType::RECV,
                      {world_->recv(cpu, src, tag), cpu[0], t});
    }
    Buffer b = Dense(t, true);
    tpu::CollectiveEntry e = Entry(tpu::CollectiveKind::kRecv, b.t);
    e.peer = LocalIndex(src);
    e.recv = Address(b.t);
    return Issue(c10d::OpType::RECV, {e}, {t}, {b}, {}, {}, e.peer);
  }

  c10::intrusive_ptr<c10d::Work> recvAnysource(std::vector<at::Tensor>&,
                                               int) override {
    TORCH_CHECK(false,
                "tpu backend: recv from any source is not supported; name the "
                "source rank");
  }

  c10::intrusive_ptr<c10d::Work> barrier(
      const c10d::BarrierOptions& opts) override {
    if (MultiHost()) {
      const c10::DeviceIndex device = BarrierDevice(opts);
      tpu::CollectiveEntry e;
      e.kind = tpu::CollectiveKind::kBarrier;
      e.dtype = static_cast<int8_t>(at::kByte);
      const at::Tensor anchor =
          at::empty({0}, at::TensorOptions().device(kTpu, device));
      LocalOp(e, anchor);
      if (local_rank_ == 0) {
        Check(GetSession().Synchronize(SessionStream(CurrentStreamId(device))),
              "barrier");
        cross_->barrier()->wait();
      }
      LocalOp(e, anchor);
      return Done(c10d::OpType::BARRIER, {}, anchor, /*blocking=*/true);
    }
    const c10::DeviceIndex device = BarrierDevice(opts);
    tpu::CollectiveEntry e;
    e.kind = tpu::CollectiveKind::kBarrier;
    e.dtype = static_cast<int8_t>(at::kByte);
    TORCH_CHECK(!coalescing_, "tpu backend: barrier inside a coalescing group");
    const int stream = SessionStream(CurrentStreamId(device));
    Enqueue(stream, device, CommFor(device), &e, 1, "barrier");
    return MakeWork(c10d::OpType::BARRIER, std::vector<at::Tensor>{},
                    RecordOn(device), device, /*blocking=*/true);
  }

 private:
  // A barrier has no tensors: the group's device once it has one, else the
  // device the caller names (torch passes the current one).
  c10::DeviceIndex BarrierDevice(const c10d::BarrierOptions& opts) const {
    if (device_ >= 0) return device_;
    if (!opts.device_ids.empty())
      return static_cast<c10::DeviceIndex>(opts.device_ids[0]);
    if (opts.device && opts.device->type() == kTpu && opts.device->has_index())
      return opts.device->index();
    return CurrentDevice();
  }

  // A dense view of a tensor the collective reads or writes: the tensor
  // itself, or a contiguous copy (written back after, when written).
  struct Buffer {
    at::Tensor t;
    at::Tensor original;
    bool write_back = false;
  };

  Buffer Dense(const at::Tensor& t, bool write) {
    CheckTpu(t, "a collective's tensor");
    if (t.is_contiguous() && !t.is_conj() && !t.is_neg())
      return Buffer{t, t, false};
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
                "tpu backend: ", what,
                "'s tensors must match in dtype, size and device (",
                a.scalar_type(), " ", a.sizes(), " vs ", b.scalar_type(), " ",
                b.sizes(), ")");
  }

  // The size of the largest of `parts` (one per rank, of one dtype and
  // device with `mine`); this rank's own part is as large as `mine`.
  int64_t LargestPart(const at::Tensor& mine,
                      const std::vector<at::Tensor>& parts, const char* what) {
    int64_t m = 0;
    for (const at::Tensor& p : parts) {
      CheckTpu(p, what);
      TORCH_CHECK(
          p.scalar_type() == mine.scalar_type() && p.device() == mine.device(),
          "tpu backend: ", what, "'s tensors must match in dtype and device (",
          mine.scalar_type(), " on ", mine.device(), " vs ", p.scalar_type(),
          " on ", p.device(), ")");
      m = std::max(m, p.numel());
    }
    TORCH_CHECK(parts[getRank()].numel() == mine.numel(), "tpu backend: ", what,
                "'s tensor of rank ", getRank(), " holds ",
                parts[getRank()].numel(), " elements, but this rank's own ",
                mine.numel());
    return m;
  }

  // `parts` one after another in a new dense tensor, each padded (with
  // zeros) to m elements.
  at::Tensor Packed(const std::vector<at::Tensor>& parts, int64_t m) {
    bool even = true;
    for (const at::Tensor& p : parts) even &= p.numel() == m;
    std::vector<at::Tensor> flat;
    for (const at::Tensor& p : parts) flat.push_back(p.reshape({-1}));
    if (even) return at::cat(flat);
    at::Tensor out =
        at::zeros({static_cast<int64_t>(parts.size()) * m}, parts[0].options());
    for (size_t i = 0; i < parts.size(); ++i)
      out.narrow(0, static_cast<int64_t>(i) * m, parts[i].numel())
          .copy_(flat[i]);
    return out;
  }

  tpu::CollectiveEntry Entry(tpu::CollectiveKind kind, const at::Tensor& t) {
    tpu::CollectiveEntry e;
    e.kind = kind;
    e.dtype = static_cast<int8_t>(t.scalar_type());
    e.count = static_cast<uint64_t>(t.numel());
    return e;
  }

  void AllGatherInto(at::Tensor& output, at::Tensor& input,
                     std::vector<tpu::CollectiveEntry>* entries,
                     std::vector<Buffer>* buffers) {
    CheckTpu(input, "all_gather_into_tensor's input");
    CheckTpu(output, "all_gather_into_tensor's output");
    TORCH_CHECK(output.numel() == input.numel() * getSize() &&
                    output.scalar_type() == input.scalar_type(),
                "tpu backend: all_gather_into_tensor's output must hold ",
                getSize(), " x the input's ", input.numel(), " elements of ",
                input.scalar_type());
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
                "tpu backend: reduce_scatter_tensor's input must hold ",
                getSize(), " x the output's ", output.numel(), " elements of ",
                output.scalar_type());
    Buffer src = Dense(input, false);
    Buffer dst = Dense(output, true);
    tpu::CollectiveEntry e = Entry(tpu::CollectiveKind::kReduceScatter, dst.t);
    e.reduce = ToReduceOp(opts.reduceOp, input.scalar_type());
    src.t = PreMultiplied(opts.reduceOp, src.t);  // the input stays as it was
    e.send = Address(src.t);
    e.recv = Address(dst.t);
    entries->push_back(e);
    buffers->push_back(src);
    buffers->push_back(dst);
  }

  // The device this rank uses the group on: the group's device_id if it was
  // given one, otherwise that of its first collective's tensors. One device
  // per rank and group, as with NCCL.
  void Bind(c10::DeviceIndex device) {
    TORCH_CHECK(!shut_down_,
                "tpu backend: this process group was destroyed "
                "(destroy_process_group or abort); make a new one");
    if (device_ < 0) {
      const std::optional<at::Device> bound = getBoundDeviceId();
      device_ = bound && bound->type() == kTpu ? bound->index() : device;
    }
    TORCH_CHECK_WITH(
        DistBackendError, device == device_, "tpu backend: rank ", getRank(),
        " uses this process group on tpu:", static_cast<int>(device_),
        " (chip ", ChipOf(device_),
        "), but this call's tensors are on tpu:", static_cast<int>(device),
        " (chip ", ChipOf(device),
        "). A process uses one device per group: call "
        "torch.tpu.set_device(local_rank) before the group's first "
        "collective, or make a group for the other device.");
  }

  // The group's communicator (this host's ranks), formed on first use.
  uint64_t CommFor(c10::DeviceIndex device) {
    Bind(device);
    if (comm_ == 0) {
      std::vector<int> members(LocalSize());
      for (int i = 0; i < LocalSize(); ++i) members[i] = i;
      comm_ = Form("tpu_comm_host" + std::to_string(host_), members,
                   local_rank_, device);
    }
    return comm_;
  }

  // A send or recv outside a coalesced group, with `peer` (this host's
  // index): the group's communicator once it formed, otherwise one of just
  // the pair (formed by the two). Returns the communicator and the peer's
  // rank in it.
  std::pair<uint64_t, int> PairComm(c10::DeviceIndex device, int peer) {
    Bind(device);
    if (comm_ != 0) return {comm_, peer};
    TORCH_CHECK(peer != local_rank_,
                "tpu backend: a send or recv to this rank itself");
    auto it = pair_comms_.find(peer);
    if (it == pair_comms_.end()) {
      const int lo = std::min(peer, local_rank_);
      const int hi = std::max(peer, local_rank_);
      const uint64_t id =
          Form("tpu_pair_" + std::to_string(lo) + "_" + std::to_string(hi) +
                   "_host" + std::to_string(host_),
               {lo, hi}, local_rank_ == lo ? 0 : 1, device);
      it = pair_comms_.emplace(peer, id).first;
    }
    return {it->second, peer < local_rank_ ? 0 : 1};
  }

  // Forms a communicator of this host's ranks `members` (indices into
  // local_ranks_; this rank is members[me]) on `device`, under `name` in
  // the group's store: its first member draws the key. Every member also
  // publishes its chip, so that two ranks on one chip (ranks that never set
  // their device) fail at once on every rank, as NCCL's duplicate-GPU check
  // does, unless TPU_DIST_SHARED_CHIPS=1 asks for it.
  uint64_t Form(const std::string& name, const std::vector<int>& members,
                int me, c10::DeviceIndex device) {
    std::string key;
    if (me == 0) {
      std::random_device rd;
      key = name + "_" + std::to_string(rd()) + std::to_string(rd());
      store_->set(name, std::vector<uint8_t>(key.begin(), key.end()));
    } else {
      std::vector<uint8_t> v;
      try {
        v = store_->get(name);
      } catch (const c10::Error& e) {
        TORCH_CHECK_WITH(
            DistBackendError, false,
            "tpu backend: timed out forming the communicator: rank ",
            local_ranks_[members[0]],
            " never came within the group's timeout (ranks form it at the "
            "group's first collective, or two ranks at their first "
            "send/recv): ",
            e.what_without_backtrace());
      }
      key.assign(v.begin(), v.end());
    }
    const int chip = ChipOf(device);
    const std::string mine =
        std::to_string(chip) + " " + std::to_string(device);
    store_->set(name + "/chip" + std::to_string(me),
                std::vector<uint8_t>(mine.begin(), mine.end()));
    absl::StatusOr<uint64_t> id = GetSession().JoinCommunicator(
        key, static_cast<int>(members.size()), me, chip,
        absl::FromChrono(timeout_), absl::FromChrono(timeout_));
    Check(id.status(), "forming the tpu communicator");
    const char* shared = std::getenv("TPU_DIST_SHARED_CHIPS");
    if (shared == nullptr || std::string(shared) != "1") {
      std::vector<std::string> keys;
      for (size_t i = 0; i < members.size(); ++i)
        keys.push_back(name + "/chip" + std::to_string(i));
      const std::vector<std::vector<uint8_t>> chips = store_->multiGet(keys);
      std::map<std::string, std::vector<std::string>> on;  // chip -> ranks
      for (size_t i = 0; i < chips.size(); ++i) {
        const std::string v(chips[i].begin(), chips[i].end());
        on[v.substr(0, v.find(' '))].push_back(
            std::to_string(local_ranks_[members[i]]) +
            " (tpu:" + v.substr(v.find(' ') + 1) + ")");
      }
      const auto join = [](const std::vector<std::string>& parts) {
        std::string out;
        for (size_t i = 0; i < parts.size(); ++i)
          out += (i == 0                  ? ""
                  : i + 1 == parts.size() ? " and "
                                          : ", ") +
                 parts[i];
        return out;
      };
      for (const auto& [c, ranks] : on) {
        if (ranks.size() < 2) continue;
        (void)GetSession().LeaveCommunicator(*id);
        // Every rank sees the same keys and fails here alike; none leaves
        // before all have read them, since a rank that exits may take the
        // store's server with it (rank 0 hosts it) and its peers would get
        // a bare "Failed to recv" instead of this error.
        store_->set(name + "/read" + std::to_string(me),
                    std::vector<uint8_t>());
        std::vector<std::string> read;
        for (size_t i = 0; i < members.size(); ++i)
          read.push_back(name + "/read" + std::to_string(i));
        try {
          store_->wait(
              read,
              std::chrono::duration_cast<std::chrono::milliseconds>(timeout_));
        } catch (const c10::Error&) {
          // A peer gone meanwhile: report the chips all the same.
        }
        TORCH_CHECK_WITH(
            DistBackendError, false, "tpu backend: ranks ", join(ranks),
            " of this process group are all on chip ", c,
            "; each rank needs a chip of its own. Call "
            "torch.tpu.set_device(local_rank) in every rank, before or after "
            "init_process_group, or pass device_id=torch.device(\"tpu\", "
            "local_rank) to it; to share chips between ranks on purpose, set "
            "TPU_DIST_SHARED_CHIPS=1.");
      }
    }
    return *id;
  }

  // Enqueues a group on `comm`; returns its record's sequence.
  uint64_t Enqueue(int stream, c10::DeviceIndex device, uint64_t comm,
                   const tpu::CollectiveEntry* entries, size_t n,
                   const char* what) {
    absl::StatusOr<uint64_t> seq = GetSession().EnqueueCollective(
        stream, ChipOf(device), comm, entries, n);
    Check(seq.status(), what);
    last_[stream] = *seq;
    return *seq;
  }

  // Gives the communicators back to tpud; unless `now`, once the groups
  // this rank enqueued have run (a destroyed communicator fails them).
  void LeaveAll(bool now = false) {
    if (!now && device_ >= 0) {
      for (const auto& [stream, seq] : last_) {
        const tpu::Event done =
            GetSession().EventAt(stream, ChipOf(device_), seq);
        (void)GetSession().SynchronizeEvent(done);  // errors stay the stream's
        GetSession().ReleaseEvent(done);
      }
    }
    last_.clear();
    if (comm_ != 0) (void)GetSession().LeaveCommunicator(comm_);
    comm_ = 0;
    for (auto& [peer, id] : pair_comms_)
      (void)GetSession().LeaveCommunicator(id);
    pair_comms_.clear();
  }

  tpu::Event RecordOn(c10::DeviceIndex device) {
    absl::StatusOr<tpu::Event> ev =
        GetSession().RecordEvent(SessionStream(CurrentStreamId(device)));
    Check(ev.status(), "recording a collective's event");
    return *ev;
  }

  c10::intrusive_ptr<c10d::Work> Issue(
      c10d::OpType type, const std::vector<tpu::CollectiveEntry>& entries,
      const std::vector<at::Tensor>& outputs,
      const std::vector<Buffer>& buffers,
      const std::vector<std::pair<at::Tensor, at::Tensor>>& after = {},
      const std::vector<at::Tensor>& keep = {}, int p2p_peer = -1) {
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
      pending_outputs_.insert(pending_outputs_.end(), outputs.begin(),
                              outputs.end());
      pending_keep_.insert(pending_keep_.end(), keep.begin(), keep.end());
      // Each call inside the group returns a Work that completes with it.
      return MakeWork(type, outputs, RecordOn(device), device, false);
    }
    const int stream = SessionStream(CurrentStreamId(device));
    uint64_t comm;
    std::vector<tpu::CollectiveEntry> p2p;
    if (p2p_peer >= 0) {
      // A lone send or recv: `peer` becomes the peer's rank in the pair's
      // communicator if that is the one it takes.
      int peer;
      std::tie(comm, peer) = PairComm(device, p2p_peer);
      p2p = entries;
      p2p[0].peer = peer;
    } else {
      comm = CommFor(device);
    }
    const std::vector<tpu::CollectiveEntry>& sent = p2p.empty() ? entries : p2p;
    const uint64_t seq = Enqueue(stream, device, comm, sent.data(), sent.size(),
                                 c10d::opTypeToString(type).c_str());
    bool copied = !after.empty();
    for (const Buffer& b : buffers) {
      if (b.write_back) b.original.copy_(b.t);
      copied |= b.write_back;
    }
    for (const auto& [dst, src] : after) dst.copy_(src.view(dst.sizes()));
    // The Work completes with the collective's own record unless copies into
    // the caller's tensors follow it (no extra record per call: tpud
    // completes the record on every rank as soon as the data has moved).
    const tpu::Event done =
        copied ? RecordOn(device)
               : GetSession().EventAt(stream, ChipOf(device), seq);
    return MakeWork(type, outputs, done, device, false);
  }

  // A Work labelled for Work.wait's timeout: "ALLREDUCE (call 3 on process
  // group '0', rank 1 of 4)".
  c10::intrusive_ptr<c10d::Work> MakeWork(c10d::OpType type,
                                          std::vector<at::Tensor> outputs,
                                          tpu::Event event,
                                          c10::DeviceIndex device,
                                          bool blocking) {
    return c10::make_intrusive<WorkTPU>(
        type, std::move(outputs), event, device, blocking,
        WorkTPU::Origin{++calls_, getGroupUid(), getRank(), getSize()});
  }

  c10::intrusive_ptr<c10d::Work> Flush(c10d::OpType type) {
    const c10::DeviceIndex device = pending_device_;
    const int stream = SessionStream(CurrentStreamId(device));
    const uint64_t seq =
        Enqueue(stream, device, CommFor(device), pending_.data(),
                pending_.size(), "coalesced collectives");
    const bool copied = !pending_after_.empty();
    for (const auto& [dst, src] : pending_after_)
      dst.copy_(src.view(dst.sizes()));
    std::vector<at::Tensor> outputs = std::move(pending_outputs_);
    pending_.clear();
    pending_after_.clear();
    pending_keep_.clear();
    pending_outputs_.clear();
    const tpu::Event done =
        copied ? RecordOn(device)
               : GetSession().EventAt(stream, ChipOf(device), seq);
    return MakeWork(type, outputs, done, device, false);
  }

  // ---- across hosts: in-daemon collectives inside each host, gloo between
  // the hosts' first ranks (hierarchical, as NCCL does across nodes) ----

  // Enqueues one collective among this host's ranks on t's device.
  void LocalOp(tpu::CollectiveEntry e, const at::Tensor& t) {
    if (LocalSize() == 1 && e.kind != tpu::CollectiveKind::kBarrier) return;
    const c10::DeviceIndex device =
        t.defined() ? t.device().index() : CurrentDevice();
    const int stream = SessionStream(CurrentStreamId(device));
    Enqueue(stream, device, CommFor(device), &e, 1,
            tpu::CollectiveKindName(e.kind));
  }

  tpu::CollectiveEntry LocalEntry(tpu::CollectiveKind kind, const at::Tensor& t,
                                  int root,
                                  tpu::ReduceOp op = tpu::ReduceOp::kSum) {
    tpu::CollectiveEntry e = Entry(kind, t);
    e.peer = root;
    e.reduce = op;
    e.send = e.recv = Address(t);
    return e;
  }

  // On the host's first rank: t (after this host's step) through the host's
  // memory, `fn` over gloo, and back.
  void Cross(at::Tensor& t, const std::function<c10::intrusive_ptr<c10d::Work>(
                                std::vector<at::Tensor>&)>& fn) {
    std::vector<at::Tensor> cpu{t.to(at::kCPU)};  // waits for the host's step
    fn(cpu)->wait();
    t.copy_(cpu[0]);
  }

  static c10d::ReduceOp::RedOpType Gloo(tpu::ReduceOp op) {
    switch (op) {
      case tpu::ReduceOp::kProduct:
        return c10d::ReduceOp::PRODUCT;
      case tpu::ReduceOp::kMin:
        return c10d::ReduceOp::MIN;
      case tpu::ReduceOp::kMax:
        return c10d::ReduceOp::MAX;
      case tpu::ReduceOp::kBand:
        return c10d::ReduceOp::BAND;
      case tpu::ReduceOp::kBor:
        return c10d::ReduceOp::BOR;
      case tpu::ReduceOp::kBxor:
        return c10d::ReduceOp::BXOR;
      default:
        return c10d::ReduceOp::SUM;
    }
  }

  void HierAllReduce(at::Tensor& t, tpu::ReduceOp op) {
    const bool avg = op == tpu::ReduceOp::kAvg;
    TORCH_CHECK(!avg || at::isFloatingType(t.scalar_type()) ||
                    at::isComplexType(t.scalar_type()),
                "tpu backend: avg across hosts needs a floating-point tensor");
    const tpu::ReduceOp local = avg ? tpu::ReduceOp::kSum : op;
    LocalOp(LocalEntry(tpu::CollectiveKind::kReduce, t, 0, local), t);
    if (local_rank_ == 0) {
      Cross(t, [&](std::vector<at::Tensor>& v) {
        c10d::AllreduceOptions o;
        o.reduceOp = c10d::ReduceOp(Gloo(local));
        return cross_->allreduce(v, o);
      });
    }
    LocalOp(LocalEntry(tpu::CollectiveKind::kBroadcast, t, 0), t);
    if (avg) t.div_(getSize());
  }

  void HierBroadcast(at::Tensor& t, int root) {
    const int root_host = host_of_[root];
    const std::vector<int> ranks = RanksOf(root_host);
    const int root_local = static_cast<int>(
        std::find(ranks.begin(), ranks.end(), root) - ranks.begin());
    if (host_ == root_host)
      LocalOp(LocalEntry(tpu::CollectiveKind::kBroadcast, t, root_local), t);
    if (local_rank_ == 0) {
      Cross(t, [&](std::vector<at::Tensor>& v) {
        c10d::BroadcastOptions o;
        o.rootRank =
            root_host;  // the cross group's ranks are the hosts, in order
        return cross_->broadcast(v, o);
      });
    }
    if (host_ != root_host)
      LocalOp(LocalEntry(tpu::CollectiveKind::kBroadcast, t, 0), t);
  }

  // out: size x in.numel() elements, in global rank order.
  void HierAllGather(at::Tensor& out, const at::Tensor& in) {
    for (int h = 0; h < num_hosts_; ++h) {
      TORCH_CHECK(static_cast<int>(RanksOf(h).size()) == LocalSize(),
                  "tpu backend: all_gather across hosts needs the same number "
                  "of ranks on each");
    }
    const int64_t n = in.numel();
    at::Tensor local = at::empty({LocalSize() * n}, in.options());
    tpu::CollectiveEntry e = Entry(tpu::CollectiveKind::kAllGather, in);
    e.send = Address(in);
    e.recv = Address(local);
    if (LocalSize() > 1) {
      LocalOp(e, in);
    } else {
      local.copy_(in.reshape({-1}));
    }
    at::Tensor full = at::empty({getSize() * n}, in.options());
    if (local_rank_ == 0) {
      std::vector<at::Tensor> mine{local.to(at::kCPU)};
      std::vector<std::vector<at::Tensor>> hosts(1);
      for (int h = 0; h < num_hosts_; ++h)
        hosts[0].push_back(at::empty_like(mine[0]));
      cross_->allgather(hosts, mine)->wait();
      at::Tensor cpu = at::empty({getSize() * n}, mine[0].options());
      for (int h = 0; h < num_hosts_; ++h) {
        const std::vector<int> ranks = RanksOf(h);
        for (size_t j = 0; j < ranks.size(); ++j) {
          cpu.narrow(0, ranks[j] * n, n).copy_(hosts[0][h].narrow(0, j * n, n));
        }
      }
      full.copy_(cpu);
    }
    LocalOp(LocalEntry(tpu::CollectiveKind::kBroadcast, full, 0), full);
    out.view({-1}).copy_(full);
  }

  std::vector<int> RanksOf(int host) const {
    std::vector<int> r;
    for (int i = 0; i < getSize(); ++i) {
      if (host_of_[i] == host) r.push_back(i);
    }
    return r;
  }

  c10::intrusive_ptr<c10d::Work> Done(c10d::OpType type,
                                      const std::vector<at::Tensor>& outputs,
                                      const at::Tensor& anchor,
                                      bool blocking = false) {
    const c10::DeviceIndex device =
        anchor.defined() ? anchor.device().index() : CurrentDevice();
    return MakeWork(type, outputs, RecordOn(device), device, blocking);
  }

  // Every collective of a group that spans hosts.
  c10::intrusive_ptr<c10d::Work> Hier(c10d::OpType type,
                                      const std::vector<at::Tensor>& outputs,
                                      const std::function<void()>& body,
                                      const at::Tensor& anchor) {
    body();
    return Done(type, outputs, anchor);
  }

  // A rank of this host, as its rank in the host's communicator.
  int LocalIndex(int rank) const {
    return static_cast<int>(
        std::find(local_ranks_.begin(), local_ranks_.end(), rank) -
        local_ranks_.begin());
  }

  // A point-to-point operation that crosses hosts; inside a coalesced
  // group it joins the group's Work.
  c10::intrusive_ptr<c10d::Work> HostPart(c10d::OpType type,
                                          WorkHost::Part part) {
    if (coalescing_) {
      pending_host_.push_back(part);
      return c10::make_intrusive<WorkHost>(
          type, std::vector<WorkHost::Part>{part}, nullptr);
    }
    return c10::make_intrusive<WorkHost>(
        type, std::vector<WorkHost::Part>{std::move(part)}, nullptr);
  }

  int LocalSize() const { return static_cast<int>(local_ranks_.size()); }
  bool MultiHost() const { return num_hosts_ > 1; }

  c10::intrusive_ptr<c10d::Store> store_;
  std::chrono::milliseconds timeout_;
  std::vector<int> host_of_;
  c10::intrusive_ptr<c10d::Backend> cross_;
  c10::intrusive_ptr<c10d::Backend>
      world_;  // gloo over all ranks, across hosts only
  std::vector<WorkHost::Part>
      pending_host_;  // cross-host p2p of a coalesced group
  int host_ = 0, num_hosts_ = 1, local_rank_ = 0;
  std::vector<int> local_ranks_;  // global ranks on this host, in order
  c10::DeviceIndex device_ = -1;  // see Bind
  uint64_t comm_ = 0;             // this host's ranks, formed on first use
  std::map<int, uint64_t> pair_comms_;  // by peer (host index), see PairComm
  bool shut_down_ = false;
  int splits_ = 0;                // see split
  uint64_t calls_ = 0;            // Works made, see MakeWork
  std::map<int, uint64_t> last_;  // stream -> its last group's sequence
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
  py::class_<ProcessGroupTPU, c10d::Backend,
             c10::intrusive_ptr<ProcessGroupTPU>>(m, "_ProcessGroupTPU")
      .def(py::init([](const c10::intrusive_ptr<c10d::Store>& store, int rank,
                       int size, std::chrono::milliseconds timeout,
                       std::vector<int> host_of,
                       c10::intrusive_ptr<c10d::Backend> cross,
                       c10::intrusive_ptr<c10d::Backend> world) {
             return c10::make_intrusive<ProcessGroupTPU>(
                 store, rank, size, timeout, std::move(host_of),
                 std::move(cross), std::move(world));
           }),
           py::arg("store"), py::arg("rank"), py::arg("size"),
           py::arg("timeout"), py::arg("host_of"), py::arg("cross"),
           py::arg("world") = nullptr, py::call_guard<py::gil_scoped_release>())
      // split_group deep-copies this (c10d's Options cannot be copied from
      // Python); None makes it ask getBackendOptions() instead.
      .def_property_readonly("options",
                             [](const ProcessGroupTPU&) { return py::none(); })
      // new_group's ranks outside the new group, once the default group has
      // a device: tpud forms a group among its members only, so they have
      // nothing to do (NCCL's must take part in the split).
      .def("perform_nocolor_split", [](ProcessGroupTPU&, at::Device) {});
}

}  // namespace torch_tpu
