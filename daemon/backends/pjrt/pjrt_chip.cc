#include "daemon/backends/pjrt/pjrt_chip.h"

#include <spdlog/spdlog.h>
#include <sys/stat.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "absl/container/inlined_vector.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "daemon/backends/pjrt/compile_cache.h"
#include "daemon/backends/pjrt/lowering/helpers.h"
#include "daemon/backends/pjrt/lowering/lowering.h"
#include "daemon/backends/pjrt/lowering/registry.h"
#include "daemon/backends/pjrt/pjrt_op.h"
#include "daemon/backends/pjrt/plan.h"
#include "tpu/device_address.h"

namespace tpud::pjrt {

absl::StatusOr<std::unique_ptr<PjrtChip>> PjrtChip::Create(
    const std::string& plugin_path, const std::vector<CreateOption>& options,
    size_t cache_capacity, bool device_memory) {
  absl::StatusOr<std::unique_ptr<PjrtPlugin>> p =
      PjrtPlugin::Load(plugin_path, options);
  if (!p.ok()) return p.status();
  return std::unique_ptr<PjrtChip>(new PjrtChip(
      *std::move(p), std::max<size_t>(1, cache_capacity), device_memory));
}

PjrtChip::~PjrtChip() = default;

std::string PjrtChip::Describe() const {
  return absl::StrCat("PJRT (", plugin_->Describe(), ")");
}

absl::StatusOr<std::shared_ptr<const BackendOp>> PjrtChip::LookupOp(
    absl::string_view schema) {
  const size_t paren = schema.find('(');
  if (paren == absl::string_view::npos || paren == 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("not an operator schema: ", schema));
  }
  std::string name(schema.substr(0, paren));
  // Every op is accepted here; one without a lowering fails when it runs,
  // naming itself (so a session can go on with the ops that have one).
  return std::make_shared<PjrtOp>(std::string(schema), std::move(name),
                                  WrittenArguments(schema));
}

absl::StatusOr<std::shared_ptr<const Executable>> PjrtChip::Compiled(
    const std::string& program, int device, const std::vector<int>& replicas) {
  CompileStats& st = stats_[replicas.empty() ? device : replicas[0]];
  // A replicated program is kept by its devices too.
  std::string replicated_key;
  if (!replicas.empty())
    replicated_key =
        absl::StrCat("replicas ", absl::StrJoin(replicas, ","), "\n", program);
  const std::string& key = replicas.empty() ? program : replicated_key;
  auto it = cache_.find(key);
  if (it != cache_.end()) {
    lru_.splice(lru_.end(), lru_, it->second);
    ++st.hits;
    return it->second->second.exe;
  }
  const auto t0 = std::chrono::steady_clock::now();
  auto since_t0 = [&t0] {
    return static_cast<uint64_t>(
        std::chrono::duration_cast<std::chrono::nanoseconds>(
            std::chrono::steady_clock::now() - t0)
            .count());
  };
  std::string disk_key, disk_path;
  absl::StatusOr<std::unique_ptr<Executable>> exe =
      absl::NotFoundError("not on disk");
  if (disk_ != nullptr) {
    disk_key =
        absl::StrCat(disk_identity_, replicas.empty() ? "portable\n" : "", key);
    if (std::optional<DiskCompileCache::Entry> e = disk_->Load(disk_key)) {
      exe = plugin_->Deserialize(e->payload, replicas);
      if (exe.ok()) {
        disk_path = disk_->PathOf(disk_key);
        const uint64_t load_ns = since_t0();
        ++st.disk_hits;
        st.saved_ns += e->compile_ns > load_ns ? e->compile_ns - load_ns : 0;
      } else {
        spdlog::warn(
            "compile cache: {}: the plugin refused an entry ({}); "
            "compiling again",
            disk_->dir(), std::string(exe.status().message()));
        disk_->Remove(disk_key);
      }
    }
  }
  if (!exe.ok()) {
    exe = replicas.empty() ? plugin_->Compile(program)
                           : plugin_->CompileReplicated(program, replicas);
    const uint64_t compile_ns = since_t0();
    st.compile_ns += compile_ns;
    ++st.compiles;
    if (exe.ok() && disk_ != nullptr) {
      absl::StatusOr<std::string> bytes = plugin_->Serialize(**exe);
      absl::Status stored = bytes.ok()
                                ? disk_->Store(disk_key, *bytes, compile_ns)
                                : bytes.status();
      if (stored.ok()) {
        ++st.disk_stores;
      } else if (!std::exchange(disk_write_error_logged_, true)) {
        // A full disk, a program over the bound, a program the plugin
        // cannot serialize: compiling goes on without the disk.
        spdlog::warn(
            "compile cache: {} (said once; tpuctl programs counts failed "
            "writes)",
            std::string(stored.message()));
      }
    }
  }
  if (!exe.ok()) return exe.status();
  if (!replicas.empty() && (*exe)->replica_devices() != replicas) {
    // Argument lists follow the executable's order; tpud gives them by rank.
    return absl::InternalError(
        absl::StrCat("the plugin placed the replicas on devices ",
                     absl::StrJoin((*exe)->replica_devices(), ","), ", not ",
                     absl::StrJoin(replicas, ",")));
  }
  if (lru_.size() >= capacity_) {
    cache_.erase(lru_.front().first);
    lru_.pop_front();
  }
  lru_.emplace_back(
      key, CachedProgram{std::shared_ptr<const Executable>(*std::move(exe)),
                         std::move(disk_path)});
  cache_[key] = std::prev(lru_.end());
  return lru_.back().second.exe;
}

void PjrtChip::RenewDiskEntries() {
  std::vector<std::pair<uint64_t, const std::string*>> held;
  held.reserve(lru_.size());
  for (const auto& [key, p] : lru_) {
    if (!p.disk_path.empty())
      held.emplace_back(p.exe->last_run(), &p.disk_path);
  }
  std::sort(held.begin(), held.end());
  for (const auto& [last_run, path] : held) disk_->Renew(*path);
}

absl::Status PjrtChip::OpenDiskCache(const std::string& dir, uint64_t max_bytes,
                                     const std::vector<CreateOption>& options) {
  if (!plugin_->Serializes()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "the PJRT plugin ", plugin_->path(),
        " cannot serialize programs: no compilation cache on disk"));
  }
  // The plugin build: its file (a reinstall changes size or time), what it
  // says it is, and how its client was made.
  struct stat sb;
  if (::stat(plugin_->path().c_str(), &sb) != 0) {
    // A plugin found through the loader's search path: its name alone.
    std::memset(&sb, 0, sizeof(sb));
  }
  std::string identity =
      absl::StrCat("tpud compile cache 1\nplugin ", plugin_->path(), " ",
                   sb.st_size, " ", sb.st_mtim.tv_sec, ".", sb.st_mtim.tv_nsec,
                   "\n", plugin_->Describe(), "\n");
  for (const CreateOption& o : options) {
    absl::StrAppend(&identity, "option ", o.name, " ", o.type, " ",
                    o.string_value, " ", o.int64_value, " ", o.float_value, " ",
                    o.bool_value, "\n");
  }
  // What the plugin reads from the environment when it compiles: XLA's
  // flags (--xla_cpu_enable_fast_math, ...) change the code it makes.
  for (const char* name : {"XLA_FLAGS", "LIBTPU_INIT_ARGS"}) {
    if (const char* value = std::getenv(name))
      absl::StrAppend(&identity, "env ", name, " ", value, "\n");
  }
  absl::StrAppend(&identity, "devices ", plugin_->num_devices());
  for (const DeviceInfo& d : plugin_->devices())
    absl::StrAppend(&identity, " ", d.id, ":", d.kind);
  absl::StrAppend(&identity, "\n");
  absl::StatusOr<std::unique_ptr<DiskCompileCache>> cache =
      DiskCompileCache::Open(dir, max_bytes);
  if (!cache.ok()) return cache.status();
  disk_ = *std::move(cache);
  disk_identity_ = std::move(identity);
  return absl::OkStatus();
}

DiskCacheStats PjrtChip::disk_cache_stats() const {
  DiskCacheStats s;
  if (disk_ == nullptr) return s;
  s.enabled = true;
  s.entries = disk_->entries();
  s.bytes = disk_->bytes();
  s.max_bytes = disk_->max_bytes();
  s.rejected = disk_->rejected();
  s.write_errors = disk_->write_errors();
  return s;
}

namespace {

// Where a key is built: its pieces (a few dozen small ones per op) gather
// in a local buffer and reach the string in one append.
class KeySink {
 public:
  explicit KeySink(std::string* out) : out_(out) { out_->clear(); }
  ~KeySink() { Flush(); }
  KeySink(const KeySink&) = delete;
  KeySink& operator=(const KeySink&) = delete;
  void Bytes(const void* p, size_t n) {
    if (n > sizeof(buf_) - used_) {
      Flush();
      if (n > sizeof(buf_)) {
        out_->append(static_cast<const char*>(p), n);
        return;
      }
    }
    std::memcpy(buf_ + used_, p, n);
    used_ += n;
  }
  void Flush() {
    out_->append(buf_, used_);
    used_ = 0;
  }

 private:
  std::string* out_;
  size_t used_ = 0;
  char buf_[1024];
};

void KeyBytes(KeySink* key, const void* p, size_t n) { key->Bytes(p, n); }

// A buffer kept over arena memory: its device, place, type, dims and
// whether it is the kind that is donated. Written into *id (a string kept
// by the caller, so that a lookup allocates nothing).
void ResidentKey(int device, const char* at, PJRT_Buffer_Type type,
                 const std::vector<int64_t>& dims, bool donate,
                 std::string* id) {
  KeySink sink(id);
  const char head[3] = {static_cast<char>(device), static_cast<char>(type),
                        static_cast<char>(donate ? 1 : 0)};
  sink.Bytes(head, sizeof(head));
  sink.Bytes(&at, sizeof(at));
  sink.Bytes(dims.data(), sizeof(int64_t) * dims.size());
}
template <typename T>
void KeyValue(KeySink* key, const T& v) {
  KeyBytes(key, &v, sizeof(v));
}
void KeyTensor(KeySink* key, const tpu::TensorRef& r) {
  KeyValue(key, r.dtype);
  KeyValue(key, r.ndim);
  const int n = std::min<int>(r.ndim, tpu::kMaxDims);
  KeyBytes(key, r.sizes, sizeof(int64_t) * n);
  KeyBytes(key, r.strides, sizeof(int64_t) * n);
}

// The signature an op's program depends on: its name, chip and every
// argument's value (scalars included: a rule may fold one into the
// program), every tensor's dtype, sizes and strides, and how the tensors
// lie: without memory, aligned to 64 bytes, or at the same place as an
// earlier one. False (not kept) for random ops, whose seed is new each time;
// their key is still made whole (the seed left out), for graph programs.
bool SignatureKey(const std::string& name, int device, const tpu::DecodedOp& d,
                  absl::Span<const tpu::TensorRef* const> all,
                  const std::vector<ResolvedTensor>& tensors,
                  absl::Span<const uintptr_t> raw, bool device_memory,
                  std::string* out) {
  KeySink sink(out);
  KeySink* const key = &sink;
  bool random = false;
  key->Bytes(name.c_str(), name.size() + 1);  // with its '\0'
  KeyValue(key, device);
  KeyValue(key, d.num_args);
  for (size_t a = 0; a < d.num_args; ++a) {
    const tpu::OpArg& arg = d.args[a];
    KeyValue(key, arg.tag);
    switch (arg.tag) {
      case tpu::ArgTag::kGenerator:
        random = true;
        break;
      case tpu::ArgTag::kTensor:
        KeyTensor(key, arg.tensor);
        break;
      case tpu::ArgTag::kTensorList:
      case tpu::ArgTag::kOptionalTensorList:
        KeyValue(key, arg.tensors.size());
        for (size_t e = 0; e < arg.tensors.size(); ++e) {
          const bool present =
              e >= arg.tensor_present.size() || arg.tensor_present[e];
          KeyValue(key, present);
          if (present) KeyTensor(key, arg.tensors[e]);
        }
        break;
      case tpu::ArgTag::kString:
        KeyValue(key, arg.s.size());
        KeyBytes(key, arg.s.data(), arg.s.size());
        break;
      case tpu::ArgTag::kIntList:
        KeyValue(key, arg.ints.size());
        KeyBytes(key, arg.ints.data(), sizeof(int64_t) * arg.ints.size());
        break;
      case tpu::ArgTag::kDoubleList:
        KeyValue(key, arg.doubles.size());
        KeyBytes(key, arg.doubles.data(), sizeof(double) * arg.doubles.size());
        break;
      case tpu::ArgTag::kBoolList:
        KeyValue(key, arg.bools.size());
        for (bool b : arg.bools) KeyValue(key, b);
        break;
      default:
        KeyValue(key, arg.i);
        KeyValue(key, arg.device_index);
        KeyValue(key, arg.d);
        KeyValue(key, arg.d_imag);
        KeyValue(key, arg.b);
        KeyValue(key, arg.dtype);
        break;
    }
  }
  KeyValue(key, d.outputs.size());
  for (const tpu::TensorRef& r : d.outputs) KeyTensor(key, r);
  for (size_t k = 0; k < all.size(); ++k) {
    const uint8_t absent = (all[k]->address == 0 ? 1 : 0) |
                           (tensors[k].segment_bytes == 0 ? 2 : 0);
    const uint8_t aligned = raw[k] % 64 == 0 ? 1 : 0;
    int32_t same = -1;
    for (size_t j = 0; j < k; ++j) {
      if (raw[j] == raw[k] && raw[k] != 0) {
        same = static_cast<int32_t>(j);
        break;
      }
    }
    KeyValue(key, absent);
    KeyValue(key, aligned);
    KeyValue(key, same);
    if (device_memory) {
      // Programs take whole segments: their sizes and which tensors share
      // one (where each tensor lies in its own is a parameter; a program
      // with those fixed in it is not kept).
      KeyValue(key, tensors[k].segment_bytes);
      int32_t shared = -1;
      for (size_t j = 0; j < k; ++j) {
        if (tensors[j].segment_bytes != 0 &&
            tensors[j].segment_address == tensors[k].segment_address) {
          shared = static_cast<int32_t>(j);
          break;
        }
      }
      KeyValue(key, shared);
    }
  }
  return !random;
}

}  // namespace

absl::Status PjrtChip::Run(const BackendOp& base, const tpu::DecodedOp& decoded,
                           const std::vector<ResolvedTensor>& tensors,
                           std::vector<ResultValue>* results,
                           ResultAllocator* allocator) {
  const auto& op = static_cast<const PjrtOp&>(base);
  const HostKind host_kind = op.host();
  // The ops computed from the arena's bytes read them there, up to date.
  if (device_memory_ && host_kind != HostKind::kNone &&
      (host_kind != HostKind::kIndex || decoded.outputs.empty())) {
    if (absl::Status st = HostAccessAll(tensors); !st.ok()) return st;
  }
  if (host_kind == HostKind::kLocalScalar)
    return ReadScalar(op.name(), decoded, tensors, results);
  if (host_kind == HostKind::kEqual)
    return Equal(op.name(), decoded, tensors, results);
  if (host_kind == HostKind::kSelect ||
      (host_kind == HostKind::kIndex && decoded.outputs.empty())) {
    return Selected(op.name(), decoded, tensors, results, allocator);
  }
  if (host_kind == HostKind::kUnique)
    return Unique(op.name(), decoded, tensors, results, allocator);
  // An op PyTorch has no meta kernel for comes without outputs (the client
  // cannot size them): those whose outputs follow from their inputs' shapes
  // get them here, in memory the result allocator charges to the session.
  if (op.entry() != nullptr && op.entry()->output_dims != nullptr &&
      op.written().empty() && decoded.outputs.empty() && allocator != nullptr &&
      results != nullptr) {
    std::vector<tpu::TensorRef> made;
    if (decoded.num_args >= 1 && decoded.args[0].tag == tpu::ArgTag::kTensor) {
      const tpu::TensorRef& x = decoded.args[0].tensor;
      auto dense = [](const tpu::TensorRef& like,
                      const std::vector<int64_t>& dims) {
        tpu::TensorRef r;
        r.dtype = like.dtype;
        r.ndim = static_cast<uint8_t>(dims.size());
        int64_t stride = 1;
        for (size_t q = dims.size(); q-- > 0;) {
          r.sizes[q] = dims[q];
          r.strides[q] = stride;
          stride *= std::max<int64_t>(dims[q], 1);
        }
        return r;
      };
      for (const std::vector<int64_t>& dims :
           op.entry()->output_dims(DimsOf(x))) {
        made.push_back(dense(x, dims));
      }
    }
    if (!made.empty()) {
      tpu::DecodedOp sized = decoded;
      std::vector<ResolvedTensor> all = tensors;
      for (tpu::TensorRef& r : made) {
        const uint64_t bytes = static_cast<uint64_t>(Numel(r)) *
                               static_cast<uint64_t>(tpu::ElementSize(r.dtype));
        ResolvedTensor rt;
        for (const ResolvedTensor& t : tensors)
          rt.owner = std::max(rt.owner, t.owner);
        if (bytes > 0) {
          absl::StatusOr<ResultAllocator::Block> block =
              allocator->Allocate(bytes);
          if (!block.ok()) return block.status();
          r.address = block->address;
          rt.segment_host_base = block->host;
          rt.segment_address = block->address;
          rt.segment_bytes = bytes;
        }
        sized.outputs.push_back(r);
        all.push_back(rt);
      }
      absl::Status st = Run(base, sized, all, results, nullptr);
      // Device memory: the device copy of an output block is keyed by the
      // block, not by the segment the session's later ops will find it in
      // (the grant may be rounded up), so a later op would not find it and
      // drop it unread. The results go to the arena, which is then current.
      for (size_t k = tensors.size(); st.ok() && k < all.size(); ++k) {
        if (all[k].segment_bytes != 0) {
          st = HostAccess(all[k].segment_address, all[k].segment_bytes,
                          /*write=*/true, all[k].owner);
        }
      }
      return st;
    }
  }
  Lowering l(op.name(), decoded, tensors, &op.arg_names());
  OpSite site;
  if (absl::Status st = Locate(op, l, &site); !st.ok()) return st;
  // The synchronous path learns where each result lies.
  auto report = [&] {
    if (results == nullptr) return;
    for (const tpu::TensorRef* r : site.refs) {
      ResultValue v;
      v.kind = ResultValue::Kind::kTensor;
      v.tensor = *r;
      results->push_back(v);
    }
  };
  if (site.empty) {
    report();
    return absl::OkStatus();
  }
  std::shared_ptr<const Plan> kept = FindPlan(site);
  if (kept != nullptr && kept->exe == nullptr) {
    // Lowered for a graph's program only: compiled now, on its own.
    kept.reset();
  } else if (kept != nullptr) {
    ++stats_[site.device].hits;
  }
  Plan fresh;
  if (kept == nullptr) {
    if (absl::Status st = LowerPlan(site, /*compile=*/true, &fresh); !st.ok())
      return st;
  }
  const Plan& plan = kept != nullptr ? *kept : fresh;
  absl::InlinedVector<char*, 8> host(site.all_refs.size(), nullptr);
  absl::InlinedVector<int64_t, 8> offsets;
  if (absl::Status st = Place(l, site, plan, &host, &offsets); !st.ok())
    return st;
  if (plan.device) {
    auto data_of = [&](size_t i) -> const char* {
      const Plan::In& in = plan.inputs[i];
      return in.k >= 0 ? host[in.k] : in.k == -2 ? in.data : nullptr;
    };
    absl::Status st =
        RunDevice(op.name(), plan, tensors, site.device, data_of, offsets);
    if (!st.ok()) return st;
  } else {
    if (absl::Status st = Execute(site, plan, host); !st.ok()) return st;
  }
  // A plan lowered now is kept for the next op of this signature.
  if (kept == nullptr && site.keyed && fresh.keep)
    KeepPlan(key_, std::move(fresh));
  report();
  return absl::OkStatus();
}

absl::Status PjrtChip::PlanOp(const BackendOp& base,
                              const tpu::DecodedOp& decoded,
                              const std::vector<ResolvedTensor>& tensors,
                              OpPlan* out) {
  const auto& op = static_cast<const PjrtOp&>(base);
  // What a plan cannot describe (results sized by the data, reads on the
  // host) leaves it empty.
  if (!device_memory_ || (op.written().empty() && decoded.outputs.empty()))
    return absl::OkStatus();
  const HostKind host_kind = op.host();
  if (host_kind != HostKind::kNone) {
    // The graph runs this op on its own, on the arena's bytes.
    if (host_kind != HostKind::kIndex || decoded.outputs.empty())
      return HostAccessAll(tensors);
    return absl::OkStatus();
  }
  Lowering l(op.name(), decoded, tensors, &op.arg_names());
  OpSite site;
  if (absl::Status st = Locate(op, l, &site); !st.ok()) return st;
  if (site.empty) {
    out->nothing = true;
    return absl::OkStatus();
  }
  std::shared_ptr<const Plan> kept = FindPlan(site);
  if (kept == nullptr) {
    Plan fresh;
    if (absl::Status st = LowerPlan(site, /*compile=*/false, &fresh); !st.ok())
      return st;
    kept = std::make_shared<const Plan>(std::move(fresh));
    if (site.keyed && kept->keep) KeepPlan(key_, kept);
  }
  absl::InlinedVector<char*, 8> host(site.all_refs.size(), nullptr);
  absl::InlinedVector<int64_t, 8> offsets;
  if (absl::Status st = Place(l, site, *kept, &host, &offsets); !st.ok())
    return st;
  // The plan and its offsets, for the graph's program.
  out->offsets.assign(offsets.begin(), offsets.end());
  out->plan = std::move(kept);
  return absl::OkStatus();
}

absl::Status PjrtChip::Locate(const PjrtOp& op, const Lowering& l,
                              OpSite* site) {
  const tpu::DecodedOp& decoded = l.decoded();
  const std::vector<ResolvedTensor>& tensors = l.tensors();
  if (op.rule() == nullptr && op.multi_rule() == nullptr) {
    return Unsupported(op.name(), "no lowering to StableHLO yet");
  }
  site->op = &op;
  site->decoded = &decoded;
  site->tensors = &tensors;
  // Where results go: the written argument (self of an in-place op, out of
  // an out= op; each element of a written list), else the op's outputs.
  std::vector<const tpu::TensorRef*>& refs = site->refs;
  std::vector<size_t>& ref_index = site->ref_index;
  for (int w : op.written()) {
    if (static_cast<size_t>(w) >= decoded.num_args) {
      return Unsupported(op.name(), "a written argument is missing");
    }
    const tpu::OpArg& a = decoded.args[w];
    if (a.tag == tpu::ArgTag::kTensor) {
      refs.push_back(&a.tensor);
      ref_index.push_back(l.TensorIndex(a));
    } else if (a.tag == tpu::ArgTag::kTensorList) {
      for (size_t e = 0; e < a.tensors.size(); ++e) {
        refs.push_back(&a.tensors[e]);
        ref_index.push_back(l.TensorIndex(a) + e);
      }
    } else {
      return Unsupported(op.name(), "writing something that is not a tensor");
    }
  }
  if (op.written().empty()) {
    for (size_t o = 0; o < decoded.outputs.size(); ++o) {
      refs.push_back(&decoded.outputs[o]);
      ref_index.push_back(tensors.size() - decoded.outputs.size() + o);
    }
  }
  if (refs.empty()) return Unsupported(op.name(), "no output to write");
  // Nothing to compute when every output is empty.
  if (std::all_of(refs.begin(), refs.end(),
                  [](const tpu::TensorRef* r) { return Numel(*r) == 0; })) {
    site->empty = true;
    return absl::OkStatus();
  }
  absl::InlinedVector<const tpu::TensorRef*, 8>& all_refs = site->all_refs;
  for (size_t a = 0; a < decoded.num_args; ++a) {
    const tpu::OpArg& arg = decoded.args[a];
    if (arg.tag == tpu::ArgTag::kTensor) {
      all_refs.push_back(&arg.tensor);
    } else if (arg.tag == tpu::ArgTag::kTensorList) {
      for (const tpu::TensorRef& t : arg.tensors) all_refs.push_back(&t);
    } else if (arg.tag == tpu::ArgTag::kOptionalTensorList) {
      for (size_t e = 0; e < arg.tensors.size(); ++e) {
        if (e >= arg.tensor_present.size() || arg.tensor_present[e])
          all_refs.push_back(&arg.tensors[e]);
      }
    }
  }
  for (const tpu::TensorRef& t : decoded.outputs) all_refs.push_back(&t);
  if (all_refs.size() != tensors.size()) {
    return absl::InternalError(absl::StrCat(op.name(), ": ", all_refs.size(),
                                            " tensors in the record, ",
                                            tensors.size(), " resolved"));
  }
  absl::InlinedVector<uintptr_t, 8>& raw = site->raw;
  raw.assign(all_refs.size(), 0);
  for (size_t k = 0; k < all_refs.size(); ++k) {
    const tpu::TensorRef& r = *all_refs[k];
    const ResolvedTensor& seg = tensors[k];
    if (r.address == 0 || seg.segment_bytes == 0 ||
        r.address < seg.segment_address)
      continue;
    raw[k] = reinterpret_cast<uintptr_t>(seg.segment_host_base) +
             (r.address - seg.segment_address) +
             static_cast<uintptr_t>(r.storage_offset) *
                 static_cast<uintptr_t>(std::max(1, tpu::ElementSize(r.dtype)));
  }
  // The chip is the outputs'; every tensor of the op is on it (the client
  // keeps an op's tensors on one device).
  // (An output the client did not ask for has no address: the first that
  // has one decides.)
  uint64_t placed = refs[0]->address;
  for (const tpu::TensorRef* r : refs) {
    if (r->address != 0) {
      placed = r->address;
      break;
    }
  }
  site->device = tpu::DeviceAddressChip(placed);
  if (site->device < 0 || site->device >= plugin_->num_devices()) {
    return absl::InvalidArgumentError(absl::StrCat(
        op.name(), ": output on chip ", site->device, ", which has no device"));
  }
  site->host_devices = plugin_->platform_name() == "cpu" && !device_memory_;
  site->keyed = SignatureKey(op.name(), site->device, decoded, all_refs,
                             tensors, raw, device_memory_, &key_);
  return absl::OkStatus();
}

std::shared_ptr<const Plan> PjrtChip::FindPlan(const OpSite& site) {
  if (!site.keyed) return nullptr;
  auto it = plans_.find(key_);
  if (it == plans_.end()) return nullptr;
  plan_lru_.splice(plan_lru_.end(), plan_lru_, it->second);
  return it->second->second;
}

absl::Status PjrtChip::Place(const Lowering& l, const OpSite& site,
                             const Plan& plan,
                             absl::InlinedVector<char*, 8>* host,
                             absl::InlinedVector<int64_t, 8>* offsets) {
  for (int k : plan.used) {
    if ((*host)[k] != nullptr) continue;
    absl::StatusOr<char*> h = l.HostOf(*site.all_refs[k], k);
    if (!h.ok()) return h.status();
    (*host)[k] = *h;
  }
  for (int k : plan.offset_k)
    offsets->push_back((*host)[k] - (*site.tensors)[k].segment_host_base);
  return absl::OkStatus();
}

absl::Status PjrtChip::Execute(const OpSite& site, const Plan& plan,
                               absl::Span<char* const> host) {
  const std::string& name = site.op->name();
  const int device = site.device;
  absl::InlinedVector<char*, 4> dsts(site.refs.size(), nullptr);
  for (size_t o = 0; o < site.refs.size(); ++o) {
    if (plan.outputs[o].write) dsts[o] = host[site.ref_index[o]];
  }
  auto data_of = [&](const Plan::In& in) -> const char* {
    return in.k >= 0 ? host[in.k] : in.k == -2 ? in.data : nullptr;
  };
  // Inputs are read in place where they are dense and aligned, unless they
  // overlap memory a donated result is written to while the program runs
  // (the donated parameter itself aside: the plugin knows that alias).
  absl::InlinedVector<std::pair<const char*, const char*>, 4> written;
  for (const Plan::In& x : plan.inputs) {
    if (x.aliased >= 0)
      written.emplace_back(data_of(x), data_of(x) + x.Bytes());
  }
  absl::InlinedVector<Buffer, 8> inputs;
  absl::InlinedVector<PJRT_Buffer*, 8> args;
  // For each output, the position in `inputs` of the buffer donated to it.
  absl::InlinedVector<int, 4> donor(plan.outputs.size(), -1);
  // Scalars stay on the device between ops, one buffer per value.
  if (scalars_.size() >= 4096) scalars_.clear();
  if (resident_.size() >= 8192) resident_.clear();
  for (const Plan::In& x : plan.inputs) {
    const char* at = data_of(x);
    const void* data = at;
    if (data == nullptr) {
      absl::StatusOr<PJRT_Buffer*> b = ScalarBuffer(device, x);
      if (!b.ok())
        return absl::Status(b.status().code(),
                            absl::StrCat(name, ": ", b.status().message()));
      args.push_back(*b);
      continue;
    }
    bool in_place = x.aliased >= 0;
    if (!in_place && site.host_devices && at != nullptr && x.Dense() &&
        reinterpret_cast<uintptr_t>(at) % 64 == 0) {
      in_place =
          std::none_of(written.begin(), written.end(), [&](const auto& w) {
            return at < w.second && w.first < at + x.Bytes();
          });
    }
    if (!in_place) {
      absl::StatusOr<Buffer> b =
          plugin_->FromHost(device, data, x.type->pjrt, x.dims, x.byte_strides);
      if (!b.ok())
        return absl::Status(b.status().code(),
                            absl::StrCat(name, ": ", b.status().message()));
      args.push_back(b->get());
      inputs.push_back(*std::move(b));
      continue;
    }
    // Buffers over the arena are kept between ops: one that is read stays
    // in the cache; one that is donated is consumed by the run (and its
    // result, at the same place, takes its entry afterwards).
    const bool donate = x.aliased >= 0;
    std::string& id = resident_key_;
    ResidentKey(device, at, x.type->pjrt, x.dims, donate, &id);
    auto it = resident_.find(id);
    if (it == resident_.end()) {
      absl::StatusOr<Buffer> b = plugin_->Alias(device, const_cast<char*>(at),
                                                x.type->pjrt, x.dims, donate);
      if (!b.ok())
        return absl::Status(b.status().code(),
                            absl::StrCat(name, ": ", b.status().message()));
      if (donate) {
        args.push_back(b->get());
        donor[x.aliased] = static_cast<int>(inputs.size());
        inputs.push_back(*std::move(b));
        continue;
      }
      it = resident_.emplace(std::move(id), *std::move(b)).first;
    }
    args.push_back(it->second.get());
    if (donate) {
      donor[x.aliased] = static_cast<int>(inputs.size());
      inputs.push_back(std::move(it->second));
      resident_.erase(it);
    }
  }
  absl::StatusOr<std::vector<Buffer>> out_buffers =
      plugin_->Execute(*plan.exe, device, absl::MakeConstSpan(args));
  if (!out_buffers.ok()) {
    return absl::Status(
        out_buffers.status().code(),
        absl::StrCat(name, ": ", out_buffers.status().message()));
  }
  const size_t n_out = plan.outputs.size();
  if (out_buffers->size() != n_out + (plan.checked ? 1 : 0)) {
    return absl::InternalError(
        absl::StrCat(name, ": the program gave ", out_buffers->size(),
                     " results for ", n_out, " outputs"));
  }
  if (plan.checked) {
    uint8_t bad = 0;
    if (absl::Status st = plugin_->ToHost(out_buffers->back(), &bad, 1);
        !st.ok()) {
      return absl::Status(st.code(), absl::StrCat(name, ": ", st.message()));
    }
    if (bad != 0) {
      out_buffers->clear();
      inputs.clear();
      return absl::InvalidArgumentError(
          absl::StrCat(name, ": ", plan.range_message));
    }
  }
  for (size_t o = 0; o < n_out; ++o) {
    const size_t bytes = plan.outputs[o].bytes;
    if (bytes == 0 || dsts[o] == nullptr) continue;
    if (plan.outputs[o].donated) {
      absl::StatusOr<uintptr_t> at = plugin_->UnsafePointer((*out_buffers)[o]);
      if (at.ok() && *at == reinterpret_cast<uintptr_t>(dsts[o])) {
        // Written in place: the result's buffer is the one to donate there
        // next time.
        for (const Plan::In& x : plan.inputs) {
          if (x.aliased != static_cast<int>(o) || donor[o] < 0) continue;
          Buffer& result = (*out_buffers)[o];
          result.InheritRelease(inputs[donor[o]]);
          ResidentKey(device, dsts[o], x.type->pjrt, x.dims, true,
                      &resident_key_);
          resident_.insert_or_assign(resident_key_, std::move(result));
          break;
        }
        continue;
      }
    }
    if (absl::Status st = plugin_->ToHost((*out_buffers)[o], dsts[o], bytes);
        !st.ok()) {
      return absl::Status(st.code(), absl::StrCat(name, ": ", st.message()));
    }
  }
  // The results go before the inputs they may alias.
  out_buffers->clear();
  inputs.clear();
  return absl::OkStatus();
}

void PjrtChip::KeepPlan(const std::string& key, Plan&& plan) {
  KeepPlan(key, std::make_shared<const Plan>(std::move(plan)));
}

void PjrtChip::KeepPlan(const std::string& key,
                        std::shared_ptr<const Plan> plan) {
  if (auto it = plans_.find(key); it != plans_.end()) {
    plan_lru_.erase(it->second);
    plans_.erase(it);
  }
  if (plan_lru_.size() >= 4 * capacity_) {
    plans_.erase(plan_lru_.front().first);
    plan_lru_.pop_front();
  }
  plan_lru_.emplace_back(key, std::move(plan));
  plans_[key] = std::prev(plan_lru_.end());
}

}  // namespace tpud::pjrt
