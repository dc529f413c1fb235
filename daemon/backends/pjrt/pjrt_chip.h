// The PJRT chip backend: tpud's chips are a PJRT plugin's devices, and each
// op of the op stream runs as a StableHLO program lowered from it here,
// compiled once per signature and cached (see docs/design.md, "The PJRT
// backend").
//
// Memory in this version: a session's tensors stay in tpud's HBM arena
// (host memory the executor can address), so everything above the backend
// (quotas, copies, poisoning, collectives, reclaim) is unchanged. On a
// plugin whose devices are the host (XLA's CPU plugin) dense, aligned
// inputs are zero-copy buffers over the arena and results are donated, so
// the program writes them where they lie; other inputs are copied in by
// the plugin's transfer (which reads strides) and other results copied
// back. With device memory (libtpu; --pjrt_memory=device) each segment is a
// PJRT buffer on its device instead, the arena its host copy brought up to
// date when the host side touches it; programs read views out of segments
// and write results into them by donation (docs/design.md).
//
// An op without a lowering fails with an error naming it; nothing falls
// back to the CPU. The ops and how each is lowered are the registry's
// (lowering/registry.h, one file per op family under lowering/).
//
// Thread-safety: a PjrtChip is driven by one executor thread (the one that
// drives every device of the plugin). It is not thread-safe: its caches
// (compiled programs, plans, graph modules, scalar and resident buffers,
// device memory mirrors) and the key buffers it reuses have no locks, so
// every call, HostAccess and Released included, must come from that
// thread.
#ifndef TPUD_DAEMON_BACKENDS_PJRT_PJRT_CHIP_H_
#define TPUD_DAEMON_BACKENDS_PJRT_PJRT_CHIP_H_

#include <cstdint>
#include <deque>
#include <functional>
#include <list>
#include <map>
#include <memory>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/container/inlined_vector.h"
#include "absl/types/span.h"
#include "daemon/backends/chip_backend.h"
#include "daemon/backends/pjrt/compile_cache.h"
#include "daemon/backends/pjrt/pjrt_plugin.h"
#include "tpu/dtype.h"

namespace tpud::pjrt {

// The ATen ops ("aten::add.Tensor") that PjrtChip lowers whole, sorted. An
// op may still refuse some forms of its arguments, naming them.
std::vector<std::string> LoweredOpNames();

struct Transfer;  // one parameter of a program, from the host
struct Plan;      // a lowered op, kept by its signature
struct OpSite;    // an op's results and tensors, as planning starts from them
class Lowering;   // the StableHLO builder
class PjrtOp;     // an op of this backend

class PjrtChip : public ChipBackend {
 public:
  // Loads the plugin (in the calling process: the one executor that drives
  // every device). cache_capacity bounds the compiled programs kept.
  static absl::StatusOr<std::unique_ptr<PjrtChip>> Create(
      const std::string& plugin_path, const std::vector<CreateOption>& options,
      size_t cache_capacity, bool device_memory = false);

  ~PjrtChip() override;
  std::string Describe() const override;
  absl::StatusOr<std::shared_ptr<const BackendOp>> LookupOp(
      absl::string_view schema) override;
  absl::Status Run(const BackendOp& op, const tpu::DecodedOp& decoded,
                   const std::vector<ResolvedTensor>& tensors,
                   std::vector<ResultValue>* results,
                   ResultAllocator* result_allocator) override;

  bool Compiles() const override { return true; }
  CompileStats compile_stats(int chip) const override {
    return chip >= 0 && chip < static_cast<int>(stats_.size()) ? stats_[chip]
                                                               : CompileStats{};
  }
  uint64_t programs_cached() const override { return lru_.size(); }
  DiskCacheStats disk_cache_stats() const override;
  // Keeps compiled programs on disk in `dir` too (compile_cache.h), at most
  // `max_bytes`, keyed by this plugin build and `options` (its create
  // options) with each program. An error (a directory others may write, a
  // plugin that cannot serialize programs) leaves the chip without one.
  absl::Status OpenDiskCache(const std::string& dir, uint64_t max_bytes,
                             const std::vector<CreateOption>& options);

  absl::Status HostAccess(uint64_t address, uint64_t bytes, bool write,
                          uint64_t owner) override;
  void Released(uint64_t address, uint64_t bytes) override;
  bool DeviceMemory() const override { return device_memory_; }
  // all_reduce, reduce, reduce_scatter, all_gather, broadcast and even
  // all_to_all among ranks on distinct devices run as one replicated
  // program (its stablehlo collective across the ranks' devices); the
  // rest, and ranks that share a device, are left to the arena.
  absl::StatusOr<bool> RunCollective(const CollectiveCall& call) override;
  uint64_t device_buffer_bytes() const override { return device_bytes_; }
  // Device memory: a captured graph's ops as one StableHLO module (each
  // op's program a function of it, the segments threaded through), compiled
  // once per signature of the whole graph and run as one execution, so XLA
  // fuses across ops. False where an op cannot be part of one (a read on
  // the host, results sized by the data) or the module does not compile.
  // Segments in `dead` are not results of the module: what the ops write
  // there stays inside it (XLA keeps it in temporaries or never writes it).
  absl::StatusOr<bool> RunProgram(const std::vector<ProgramOp>& ops,
                                  absl::Span<const uint64_t> dead,
                                  size_t* failed,
                                  std::string* declined) override;
  std::string TakeCompileNote() override {
    return std::exchange(compile_note_, std::string());
  }
  void set_graphs(bool on) { graphs_on_ = on; }  // tpud --pjrt_graphs

 private:
  // One op of a graph, planned and not run (PlanOp, for RunProgram); left
  // empty for an op no plan describes.
  struct OpPlan {
    std::shared_ptr<const Plan> plan;
    std::vector<int64_t> offsets;  // its offset parameters' values
    bool nothing = false;          // no output has elements: nothing to run
  };
  struct Graph;  // a graph's module (graph_program.cc)
  // RunProgram's scratch, kept with its memory between runs: each op's
  // plan, the graph's key, its segments and each op's segments in it.
  std::vector<OpPlan> run_plans_;
  std::string run_key_;
  std::vector<uint64_t> run_seg_address_;
  absl::flat_hash_map<uint64_t, size_t> run_seg_index_;  // by address
  std::vector<std::vector<int>> run_seg_of_;
  // Logs that a graph's module was compiled, and why: where its ops part
  // from those of the recent graph on `device` they follow longest.
  // (seg_of: each op's segments, numbered as the graph's parameters.)
  void NoteGraphCompiled(const std::vector<ProgramOp>& ops,
                         const std::vector<OpPlan>& plans,
                         const std::vector<std::vector<int>>& seg_of,
                         const std::vector<bool>& dead, int device);
  // The op's plan, lowered if not kept yet but neither compiled nor run.
  absl::Status PlanOp(const BackendOp& op, const tpu::DecodedOp& decoded,
                      const std::vector<ResolvedTensor>& tensors, OpPlan* plan);
  // Where the op's results go and its tensors lie, and its signature (into
  // key_): what Run and PlanOp both start from.
  absl::Status Locate(const PjrtOp& op, const Lowering& l, OpSite* site);
  // The plan kept for the signature in key_, or null.
  std::shared_ptr<const Plan> FindPlan(const OpSite& site);
  // The op lowered into *plan (plan_lowering.cc); compiled unless
  // `compile` is false (a graph's op is compiled only within the graph's
  // program).
  absl::Status LowerPlan(const OpSite& site, bool compile, Plan* plan);
  // Where the tensors the plan reads and writes lie in the arena (checked
  // to lie in their segments), and its offset parameters' values.
  absl::Status Place(const Lowering& l, const OpSite& site, const Plan& plan,
                     absl::InlinedVector<char*, 8>* host,
                     absl::InlinedVector<int64_t, 8>* offsets);
  // Runs a plan without device memory: inputs aliased where they lie or
  // copied in, results donated in place or copied back.
  absl::Status Execute(const OpSite& site, const Plan& plan,
                       absl::Span<char* const> host);
  absl::StatusOr<OpPlan> CopyPlan(const tpu::DecodedCopy& copy,
                                  const std::vector<ResolvedTensor>& ends);
  // A segment's device buffer (device memory): u8[bytes] on `device`; the
  // arena at `host` is its host copy, current when `host_current`.
  struct Mirror {
    Buffer buffer;
    char* host = nullptr;
    uint64_t bytes = 0;
    uint64_t owner =
        0;  // the session (a freed segment's pages may go to another)
    int device = 0;
    bool host_current = true;
  };
  PjrtChip(std::unique_ptr<PjrtPlugin> plugin, size_t capacity,
           bool device_memory)
      : plugin_(std::move(plugin)),
        capacity_(capacity),
        device_memory_(device_memory),
        stats_(plugin_->num_devices()) {}
  void KeepPlan(const std::string& key, Plan&& plan);
  void KeepPlan(const std::string& key, std::shared_ptr<const Plan> plan);
  // A scalar parameter's device buffer (kept by device, type and value).
  absl::StatusOr<PJRT_Buffer*> ScalarBuffer(int device, const Transfer& x);
  absl::StatusOr<PJRT_Buffer*> OffsetBuffer(int device, int64_t offset);
  // The segment's device buffer, made from the arena's bytes if it has none.
  absl::StatusOr<Mirror*> MirrorOf(const ResolvedTensor& seg, int device);
  // Forgets the device buffers over [address, +bytes), unread.
  void Drop(uint64_t address, uint64_t bytes);
  // Brings the host copy of every segment of `tensors` up to date.
  absl::Status HostAccessAll(const std::vector<ResolvedTensor>& tensors);
  absl::Status RunDevice(
      const std::string& name, const Plan& plan,
      const std::vector<ResolvedTensor>& tensors, int device,
      const std::function<const char*(size_t input)>& data_of,
      absl::Span<const int64_t> offsets = {});
  // Device memory: `bytes` at `offset` of the segment's buffer, as `count`
  // values of dtype `dtype` (a buffer on `device`); and the reverse,
  // `value` written into the segment there (donated and replaced).
  absl::StatusOr<Buffer> ReadSegment(const ResolvedTensor& seg,
                                     uint64_t address, int64_t count,
                                     tpu::DType dtype, int device);
  absl::Status WriteSegment(const ResolvedTensor& seg, uint64_t address,
                            const Buffer& value, int64_t count,
                            tpu::DType dtype, int device);
  // The program, compiled (once; counted against `device`); with
  // `replicas`, for one replica on each of those devices (a collective).
  absl::StatusOr<std::shared_ptr<const Executable>> Compiled(
      const std::string& program, int device,
      const std::vector<int>& replicas = {});
  // .item(): the one element, read where it lies.
  static absl::Status ReadScalar(const std::string& op,
                                 const tpu::DecodedOp& decoded,
                                 const std::vector<ResolvedTensor>& tensors,
                                 std::vector<ResultValue>* results);
  absl::Status Equal(const std::string& name, const tpu::DecodedOp& decoded,
                     const std::vector<ResolvedTensor>& tensors,
                     std::vector<ResultValue>* results);
  absl::Status Selected(const std::string& name, const tpu::DecodedOp& decoded,
                        const std::vector<ResolvedTensor>& tensors,
                        std::vector<ResultValue>* results,
                        ResultAllocator* allocator);
  absl::Status Unique(const std::string& name, const tpu::DecodedOp& decoded,
                      const std::vector<ResolvedTensor>& tensors,
                      std::vector<ResultValue>* results,
                      ResultAllocator* allocator);
  absl::Status MaskIndex(const std::string& name, const tpu::DecodedOp& decoded,
                         const std::vector<ResolvedTensor>& tensors,
                         std::vector<ResultValue>* results,
                         ResultAllocator* allocator);
  absl::StatusOr<int> DeviceOf(const std::string& name, uint64_t address) const;
  absl::Status RunToHost(const std::string& name,
                         const std::vector<Transfer>& transfers,
                         const std::string& program, int device,
                         const std::vector<std::pair<void*, size_t>>& dsts);

  std::unique_ptr<PjrtPlugin> plugin_;
  size_t capacity_;
  // Compiled programs by their text, least recently used first, with where
  // each lies in the cache on disk (empty where it is not kept there).
  struct CachedProgram {
    std::shared_ptr<const Executable> exe;
    std::string disk_path;
  };
  std::list<std::pair<std::string, CachedProgram>> lru_;
  std::unordered_map<std::string, decltype(lru_)::iterator> cache_;
  // Lowered ops by their signature (SignatureKey), least recently used
  // first: an op seen before skips lowering and the program lookup.
  std::list<std::pair<std::string, std::shared_ptr<const Plan>>> plan_lru_;
  std::unordered_map<std::string, decltype(plan_lru_)::iterator> plans_;
  std::string key_;  // the signature being looked up (kept to reuse its memory)
  std::string resident_key_;  // likewise, a kept buffer's key
  bool graphs_on_ = true;
  // Graph modules by the graph's signature (its ops' signatures and which
  // segments they share), least recently used first.
  std::list<std::pair<std::string, std::shared_ptr<const Graph>>> graph_lru_;
  std::unordered_map<std::string, decltype(graph_lru_)::iterator> graphs_;
  // The ops of the graphs compiled last on each device (their programs'
  // hashes and names; at most kRecentGraphs), to say why another was.
  struct GraphOps {
    std::vector<uint64_t> hashes;
    std::vector<std::string> names;
    std::vector<std::vector<int64_t>> offsets;
    std::vector<std::vector<int>> segs;
    std::vector<bool> dead;  // by the graph's segment
  };
  static constexpr size_t kRecentGraphs = 32;
  std::map<int, std::deque<GraphOps>> recent_graphs_;
  std::string compile_note_;  // TakeCompileNote
  // Scalar parameters on the device, by device, type and value: never
  // donated, so one buffer serves every op that passes that value.
  std::unordered_map<std::string, Buffer> scalars_;
  // A graph's scalars as it takes them (f64s, i64s), and the last such
  // vectors sent to a device, kept while the values repeat.
  std::vector<char> packs_[2];
  struct PackedScalars {
    Buffer buffer;
    int device = -1;
    std::vector<char> bytes;
  };
  PackedScalars packed_[2];
  // Zero-copy buffers over the arena (host-memory devices), by device,
  // place, type, dims and donation: the memory outlives them, so they are
  // kept between ops instead of made and destroyed per op.
  std::unordered_map<std::string, Buffer> resident_;
  bool device_memory_;
  // Device memory: each segment's buffer, by the segment's device address.
  std::map<uint64_t, Mirror> mirrors_;
  uint64_t device_bytes_ = 0;
  std::vector<CompileStats> stats_;  // per device
  // The compilation cache on disk, where one is open, and what every key
  // starts with: the plugin build and its create options.
  std::unique_ptr<DiskCompileCache> disk_;
  std::string disk_identity_;
  bool disk_write_error_logged_ = false;
  // Before the disk cache evicts: renews the entries of the programs this
  // chip holds, in the order they last ran, so that eviction takes what
  // no one ran for longest (a program found through a plan never comes
  // back here to say it is in use).
  void RenewDiskEntries();
};

}  // namespace tpud::pjrt

#endif  // TPUD_DAEMON_BACKENDS_PJRT_PJRT_CHIP_H_
