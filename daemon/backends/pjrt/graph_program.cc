// Graph modules (device memory): a captured graph's ops as one StableHLO
// module, compiled once per signature of the whole graph.
#include <spdlog/spdlog.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <functional>
#include <map>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "daemon/backends/pjrt/lowering/helpers.h"
#include "daemon/backends/pjrt/lowering/lowering.h"
#include "daemon/backends/pjrt/lowering/registry.h"
#include "daemon/backends/pjrt/pjrt_chip.h"
#include "daemon/backends/pjrt/pjrt_op.h"
#include "daemon/backends/pjrt/plan.h"

namespace tpud::pjrt {

// A graph's module: its ops' programs as private functions of one module,
// whose main takes each segment any op names once (donated where an op
// writes it) and the ops' scalars, calls the ops in order with the
// segments' latest values, and returns the written segments and, where an
// op checks its indices, the first op whose check failed (0: none). Where
// each op reads and writes in its segments is a constant of the module, not
// a parameter: XLA then sees a value written by one op and read by the next
// as the same bytes, and fuses through them (device memory holds each
// storage in a segment of its own, so these offsets are the program's, the
// same every time it runs).
struct PjrtChip::Graph {
  std::shared_ptr<const Executable> exe;  // null: it did not compile, for `why`
  std::string why;
  std::vector<std::pair<size_t, size_t>>
      segs;                    // each parameter segment: op i's segment j
  std::vector<int> result_of;  // each segment's result (-1: read only)
  int written = 0;
  bool checked = false;
  // The ops' scalars (each an f64 or i64 value) come in two parameters
  // after the segments, one vector of each type, in the ops' order: a
  // handful of arguments per run instead of one per scalar.
  int64_t packed[2] = {0, 0};
};

namespace {
// A graph's two scalar vectors: their element type in the module and on
// the plugin.
struct ScalarPack {
  const char* elem;
  PJRT_Buffer_Type type;
};
constexpr ScalarPack kPacks[2] = {{"f64", PJRT_Buffer_Type_F64},
                                  {"i64", PJRT_Buffer_Type_S64}};
// Which of them carries a scalar parameter (one of the two types).
int PackOf(const Transfer& x) { return x.type->pjrt == kPacks[0].type ? 0 : 1; }
}  // namespace

// A copy between device addresses of one graph, as an op's plan: its bytes
// sliced out of the source segment and written into the destination's.
absl::StatusOr<PjrtChip::OpPlan> PjrtChip::CopyPlan(
    const tpu::DecodedCopy& copy, const std::vector<ResolvedTensor>& ends) {
  if (ends.size() != 2)
    return absl::InternalError("a copy without its two segments");
  const ResolvedTensor& src = ends[0];
  const ResolvedTensor& dst = ends[1];
  if (copy.src < src.segment_address ||
      copy.src - src.segment_address > src.segment_bytes ||
      copy.bytes > src.segment_bytes - (copy.src - src.segment_address) ||
      copy.dst < dst.segment_address ||
      copy.dst - dst.segment_address > dst.segment_bytes ||
      copy.bytes > dst.segment_bytes - (copy.dst - dst.segment_address)) {
    return absl::InvalidArgumentError("a copy reaches past its segments");
  }
  const int64_t from = static_cast<int64_t>(copy.src - src.segment_address);
  const int64_t to = static_cast<int64_t>(copy.dst - dst.segment_address);
  const int64_t n = static_cast<int64_t>(copy.bytes);
  const bool same = src.segment_address == dst.segment_address;
  const HloType& u8 = *DTypeOf(tpu::DType::kUInt8);
  const std::string st = TypeOf({static_cast<int64_t>(src.segment_bytes)}, u8);
  const std::string dt = TypeOf({static_cast<int64_t>(dst.segment_bytes)}, u8);
  const std::string nt = TypeOf({n}, u8);
  const std::string s = "%s0", d = same ? "%s0" : "%s1";
  auto plan = std::make_shared<Plan>();
  plan->device = true;
  plan->on_device = tpu::DeviceAddressChip(copy.dst);
  plan->segments_written = 1;
  if (same) {
    plan->segs.push_back({1, 0});
  } else {
    plan->segs.push_back({0, -1});
    plan->segs.push_back({1, 0});
  }
  // (Where it reads and writes are parameters, as an op's offsets are.)
  ProgramPieces& program = plan->program;
  if (same) {
    program.params.push_back({"%s0", dt, 0});
  } else {
    program.params.push_back({"%s0", st});
    program.params.push_back({"%s1", dt, 0});
  }
  program.params.push_back({"%from", "tensor<i64>"});
  program.params.push_back({"%to", "tensor<i64>"});
  program.body = absl::StrCat(
      "    %0 = stablehlo.dynamic_slice ", s, ", %from, sizes = [", n, "] : (",
      st, ", tensor<i64>) -> ", nt, "\n",
      "    %1 = stablehlo.dynamic_update_slice ", d, ", %0, %to : (", dt, ", ",
      nt, ", tensor<i64>) -> ", dt, "\n");
  program.results = {"%1"};
  program.result_types = {dt};
  // All its program depends on (a graph's key is its ops' texts).
  plan->SetText(absl::StrCat("copy ", src.segment_bytes, " ", dst.segment_bytes,
                             " ", n, " ", same));
  OpPlan op_plan;
  op_plan.offsets = {from, to};
  op_plan.plan = std::move(plan);
  return op_plan;
}

void PjrtChip::NoteGraphCompiled(const std::vector<ProgramOp>& ops,
                                 const std::vector<OpPlan>& plans,
                                 const std::vector<std::vector<int>>& seg_of,
                                 const std::vector<bool>& dead, int device) {
  auto name = [](const ProgramOp& op) {
    return op.op == nullptr ? std::string("copy")
                            : static_cast<const PjrtOp&>(*op.op).name();
  };
  GraphOps now;
  for (size_t i = 0; i < ops.size(); ++i) {
    now.hashes.push_back(plans[i].nothing ? 0 : plans[i].plan->text_hash[0]);
    now.names.push_back(name(ops[i]));
    now.offsets.push_back(plans[i].offsets);
    now.segs.push_back(seg_of[i]);
  }
  now.dead = dead;
  // Why: where it parts from the recent graph whose ops it follows longest
  // (a loop whose shapes changed, a new op, a run cut elsewhere).
  std::string why = "no graph was compiled on this device before";
  std::deque<GraphOps>& recent = recent_graphs_[device];
  // (The longest common start; among equals, one whose next op is the same
  // op, then the latest.)
  const GraphOps* best = nullptr;
  size_t same = 0;
  bool same_op = false;
  for (auto it = recent.rbegin(); it != recent.rend(); ++it) {
    const GraphOps& before = *it;
    size_t k = 0;
    while (k < now.hashes.size() && k < before.hashes.size() &&
           now.hashes[k] == before.hashes[k])
      ++k;
    const bool op = k < now.names.size() && k < before.names.size() &&
                    now.names[k] == before.names[k];
    if (best == nullptr || k > same || (k == same && op && !same_op)) {
      best = &before;
      same = k;
      same_op = op;
    }
  }
  if (best != nullptr) {
    const size_t k = same;
    if (k < now.hashes.size() && k < best->hashes.size()) {
      why = absl::StrCat(
          "the nearest recent graph (", best->hashes.size(),
          " ops) parts from it at op ", k + 1, ": ", now.names[k],
          now.names[k] == best->names[k]
              ? " with other shapes, dtypes, layout or a folded scalar"
              : absl::StrCat(" where it had ", best->names[k]));
    } else if (k == best->hashes.size() && k == now.hashes.size()) {
      // The same programs: the first op whose tensors lie elsewhere.
      why = now.dead != best->dead
                ? "a recent graph has the same ops, their tensors alike; other "
                  "segments are dead after the run (freed while it was held)"
                : "a recent graph is the same; its program had left the cache "
                  "(--pjrt_program_cache)";
      for (size_t i = 0; i < k; ++i) {
        if (now.offsets[i] != best->offsets[i]) {
          why = absl::StrCat("a recent graph has the same ops; op ", i + 1,
                             " (", now.names[i],
                             ") reads or writes at other offsets of its "
                             "segments (views at other storage offsets)");
          break;
        }
        if (now.segs[i] != best->segs[i]) {
          why = absl::StrCat(
              "a recent graph has the same ops; op ", i + 1, " (", now.names[i],
              ") shares segments with the ops before it otherwise (other "
              "tensors, or the same tensor where there were others)");
          break;
        }
      }
    } else {
      why = absl::StrCat("a recent graph has its first ", k, " ops, and ",
                         best->hashes.size(), " in all");
    }
  }
  spdlog::info("pjrt: device {}: compiled a graph of {} ops; {}", device,
               ops.size(), why);
  compile_note_ = absl::StrCat(ops.size(), " ops; ", why);
  if (recent.size() >= kRecentGraphs) recent.pop_front();
  recent.push_back(std::move(now));
}

absl::StatusOr<bool> PjrtChip::RunProgram(const std::vector<ProgramOp>& ops,
                                          absl::Span<const uint64_t> dead,
                                          size_t* failed,
                                          std::string* declined) {
  *failed = 0;
  auto decline = [&](size_t i, const std::string& why) {
    *failed = i;
    *declined =
        i < ops.size()
            ? absl::StrCat("record ", i + 1, " (",
                           ops[i].op == nullptr
                               ? std::string("copy")
                               : static_cast<const PjrtOp&>(*ops[i].op).name(),
                           "): ", why)
            : why;
    return false;
  };
  if (!device_memory_)
    return decline(ops.size(),
                   "segments are not in device memory (--pjrt_memory=host)");
  if (!graphs_on_) return decline(ops.size(), "--pjrt_graphs=false");
  if (ops.empty()) return decline(0, "no ops");
  // Each op's plan and signature, lowered where not seen before (not
  // compiled: the graph's module is).
  // (Kept between runs with their memory: a loop's runs are alike.)
  std::vector<OpPlan>& plans = run_plans_;
  if (plans.size() < ops.size()) plans.resize(ops.size());
  for (size_t i = 0; i < ops.size(); ++i) {
    plans[i].plan.reset();
    plans[i].offsets.clear();
    plans[i].nothing = false;
    if (ops[i].op == nullptr) {
      if (ops[i].copy == nullptr) return decline(i, "neither an op nor a copy");
      if (ops[i].copy->bytes == 0) {
        plans[i].nothing = true;
        continue;
      }
      absl::StatusOr<OpPlan> copy = CopyPlan(*ops[i].copy, *ops[i].tensors);
      if (!copy.ok()) return decline(i, std::string(copy.status().message()));
      plans[i] = *std::move(copy);
      continue;
    }
    absl::Status st =
        PlanOp(*ops[i].op, *ops[i].decoded, *ops[i].tensors, &plans[i]);
    if (!st.ok())
      return decline(
          i, std::string(st.message()));  // run one by one, the op reports it
    if (plans[i].nothing) continue;
    if (plans[i].plan == nullptr || !plans[i].plan->device ||
        plans[i].plan->program.results.empty()) {
      return decline(i, "read on the host or sized by the data");
    }
  }
  int device = -1;
  std::string& key = run_key_;
  key.clear();
  std::vector<uint64_t>& seg_address = run_seg_address_;
  seg_address.clear();
  run_seg_index_.clear();
  std::vector<std::vector<int>>& seg_of =
      run_seg_of_;  // op i's segment j: the graph's
  if (seg_of.size() < ops.size()) seg_of.resize(ops.size());
  for (size_t i = 0; i < ops.size(); ++i) seg_of[i].clear();
  for (size_t i = 0; i < ops.size(); ++i) {
    const OpPlan& pr = plans[i];
    if (pr.nothing) continue;
    const Plan& plan = *pr.plan;
    if (device >= 0 && plan.on_device != device)
      return decline(i, "on another device");
    device = plan.on_device;
    // The graph's module depends on its ops' programs, not on the values
    // of their scalars (parameters of main): a step whose learning rate
    // changes runs the module of the step before.
    // (With its index: which ops have nothing to run is part of the graph.)
    const uint32_t i32 = static_cast<uint32_t>(i);
    key.append(reinterpret_cast<const char*>(&i32), sizeof(i32));
    key.append(reinterpret_cast<const char*>(plan.text_hash),
               sizeof(plan.text_hash));
    for (const Plan::Seg& sg : plan.segs) {
      const ResolvedTensor& rt = (*ops[i].tensors)[sg.k];
      const size_t g =
          run_seg_index_.try_emplace(rt.segment_address, seg_address.size())
              .first->second;
      if (g == seg_address.size()) seg_address.push_back(rt.segment_address);
      seg_of[i].push_back(static_cast<int>(g));
      const uint32_t g32 = static_cast<uint32_t>(g);
      key.append(reinterpret_cast<const char*>(&g32), sizeof(g32));
    }
    for (int64_t offset : pr.offsets)  // constants of the module
      key.append(reinterpret_cast<const char*>(&offset), sizeof(offset));
    for (const Plan::In& x : plan.inputs) {
      if (x.k != -1) return decline(i, "a parameter from the host");
      if (!x.dims.empty() ||
          (x.type->pjrt != kPacks[0].type && x.type->pjrt != kPacks[1].type))
        return decline(i, "a scalar parameter neither f64 nor i64");
    }
  }
  if (device < 0) return decline(ops.size(), "nothing to run");
  // Which segments are dead after the run: part of the module (they are not
  // its results), so of the key.
  std::vector<bool> is_dead(seg_address.size(), false);
  for (size_t g = 0; g < seg_address.size(); ++g) {
    is_dead[g] = std::binary_search(dead.begin(), dead.end(), seg_address[g]);
    key.push_back(is_dead[g] ? 'd' : 'l');
  }
  std::shared_ptr<const Graph> graph;
  if (auto it = graphs_.find(key); it != graphs_.end()) {
    graph_lru_.splice(graph_lru_.end(), graph_lru_, it->second);
    graph = it->second->second;
    ++stats_[device].hits;
  } else {
    auto made = std::make_shared<Graph>();
    made->result_of.assign(seg_address.size(), -1);
    made->segs.resize(seg_address.size());
    std::vector<bool> named(seg_address.size(), false);
    std::vector<uint64_t> seg_bytes(seg_address.size(), 0);
    for (size_t i = 0; i < ops.size(); ++i) {
      if (plans[i].nothing) continue;
      for (size_t j = 0; j < seg_of[i].size(); ++j) {
        const int g = seg_of[i][j];
        if (!named[g]) {
          named[g] = true;
          made->segs[g] = {i, j};
          seg_bytes[g] =
              (*ops[i].tensors)[plans[i].plan->segs[j].k].segment_bytes;
        }
        if (plans[i].plan->segs[j].result >= 0 && made->result_of[g] < 0 &&
            !is_dead[g])
          made->result_of[g] = made->written++;
      }
    }
    const HloType& u8 = *DTypeOf(tpu::DType::kUInt8);
    std::string funcs, body, params;
    int64_t next[2] = {0, 0};  // each scalar vector's next element
    std::vector<std::string> now(seg_address.size()), checks;
    std::vector<size_t> check_op;
    for (size_t g = 0; g < seg_address.size(); ++g) {
      now[g] = absl::StrCat("%g", g);
      absl::StrAppend(&params, g == 0 ? "" : ", ", now[g], ": ",
                      TypeOf({static_cast<int64_t>(seg_bytes[g])}, u8));
      if (made->result_of[g] >= 0)
        absl::StrAppend(&params, " {tf.aliasing_output = ", made->result_of[g],
                        " : i32}");
    }
    for (size_t i = 0; i < ops.size(); ++i) {
      if (plans[i].nothing) continue;
      for (const Plan::In& x : plans[i].plan->inputs) ++made->packed[PackOf(x)];
    }
    for (int pack = 0; pack < 2; ++pack) {
      if (made->packed[pack] != 0)
        absl::StrAppend(&params, ", %scalars", pack, ": tensor<",
                        made->packed[pack], "x", kPacks[pack].elem, ">");
    }
    for (size_t i = 0; i < ops.size(); ++i) {
      if (plans[i].nothing) continue;
      const Plan& plan = *plans[i].plan;
      const ProgramPieces& program = plan.program;
      const std::vector<std::string> param_types = program.ParamTypes();
      const size_t ins = plan.inputs.size();
      const size_t scalars = ins + plans[i].offsets.size();
      if (param_types.size() != plan.segs.size() + scalars ||
          program.result_types.size() !=
              static_cast<size_t>(plan.segments_written) +
                  (plan.checked ? 1 : 0)) {
        return decline(i, "its program's signature does not match its plan");
      }
      absl::StrAppend(&funcs, program.Function(absl::StrCat("op", i)));
      std::vector<std::string> args;
      for (size_t j = 0; j < plan.segs.size(); ++j)
        args.push_back(now[seg_of[i][j]]);
      for (size_t m = 0; m < scalars; ++m) {
        const std::string a = absl::StrCat("%a", i, "_", m);
        args.push_back(a);
        const std::string& type = param_types[plan.segs.size() + m];
        if (m < ins) {
          // Its element of the scalars' vector of its type.
          const int pack = PackOf(plan.inputs[m]);
          const int64_t at = next[pack]++;
          const char* elem = kPacks[pack].elem;
          absl::StrAppend(&body, "    ", a, "v = stablehlo.slice %scalars",
                          pack, " [", at, ":", at + 1, "] : (tensor<",
                          made->packed[pack], "x", elem, ">) -> tensor<1x",
                          elem, ">\n", "    ", a, " = stablehlo.reshape ", a,
                          "v : (tensor<1x", elem, ">) -> ", type, "\n");
        } else {
          absl::StrAppend(&body, "    ", a, " = stablehlo.constant dense<",
                          plans[i].offsets[m - ins], "> : ", type, "\n");
        }
      }
      const std::string c = absl::StrCat("%c", i);
      const size_t nres = program.result_types.size();
      auto result = [&](size_t r) {
        return nres == 1 ? c : absl::StrCat(c, "#", r);
      };
      absl::StrAppend(&body, "    ", c,
                      nres == 1 ? "" : absl::StrCat(":", nres),
                      " = func.call @op", i, "(", absl::StrJoin(args, ", "),
                      ") : (", absl::StrJoin(param_types, ", "), ") -> (",
                      absl::StrJoin(program.result_types, ", "), ")\n");
      for (size_t j = 0; j < plan.segs.size(); ++j) {
        if (plan.segs[j].result >= 0)
          now[seg_of[i][j]] = result(plan.segs[j].result);
      }
      if (plan.checked) {
        checks.push_back(result(nres - 1));
        check_op.push_back(i);
      }
    }
    std::vector<std::string> results(made->written), types(made->written);
    for (size_t g = 0; g < seg_address.size(); ++g) {
      if (made->result_of[g] < 0) continue;
      results[made->result_of[g]] = now[g];
      types[made->result_of[g]] =
          TypeOf({static_cast<int64_t>(seg_bytes[g])}, u8);
    }
    if (!checks.empty()) {
      made->checked = true;
      std::string first = "%fail";
      absl::StrAppend(&body, "    ", first,
                      " = stablehlo.constant dense<0> : tensor<i32>\n");
      for (size_t q = checks.size(); q-- > 0;) {
        absl::StrAppend(&body, "    %at", q, " = stablehlo.constant dense<",
                        check_op[q] + 1, "> : tensor<i32>\n", "    %fail", q,
                        " = stablehlo.select ", checks[q], ", %at", q, ", ",
                        first, " : tensor<i1>, tensor<i32>\n");
        first = absl::StrCat("%fail", q);
      }
      results.push_back(first);
      types.push_back("tensor<i32>");
    }
    if (results.empty()) return decline(ops.size(), "no results");
    const std::string ret = absl::StrJoin(types, ", ");
    const std::string text = absl::StrCat(
        "module @tpud_graph {\n", funcs, "  func.func public @main(", params,
        ") -> (", ret, ") {\n", body, "    return ",
        absl::StrJoin(results, ", "), " : ", ret, "\n  }\n}\n");
    const uint64_t compiles = stats_[device].compiles;
    absl::StatusOr<std::shared_ptr<const Executable>> exe =
        Compiled(text, device);
    if (stats_[device].compiles != compiles)
      NoteGraphCompiled(ops, plans, seg_of, is_dead, device);
    if (exe.ok()) {
      made->exe = *std::move(exe);
    } else {
      made->why = std::string(exe.status().message()).substr(0, 2000);
    }
    if (graph_lru_.size() >= capacity_) {
      graphs_.erase(graph_lru_.front().first);
      graph_lru_.pop_front();
    }
    graph_lru_.emplace_back(key, made);
    graphs_[key] = std::prev(graph_lru_.end());
    graph = std::move(made);
  }
  if (graph->exe == nullptr)
    return decline(ops.size(),
                   absl::StrCat("the module did not compile: ", graph->why));
  // Segments first, then each op's scalars in order.
  if (scalars_.size() >= 4096) scalars_.clear();
  absl::InlinedVector<PJRT_Buffer*, 32> args;
  std::vector<Mirror*> segs;
  for (const auto& [i, j] : graph->segs) {
    // (The key makes these hold; a graph that broke them would read
    // another op's memory.)
    if (i >= ops.size() || plans[i].nothing ||
        j >= plans[i].plan->segs.size()) {
      return absl::InternalError(absl::StrCat(
          "a graph's segment ", j, " of op ", i, " is not this run's"));
    }
    absl::StatusOr<Mirror*> m =
        MirrorOf((*ops[i].tensors)[plans[i].plan->segs[j].k], device);
    if (!m.ok()) return m.status();
    segs.push_back(*m);
    args.push_back((*m)->buffer.get());
  }
  // The scalars' values, in the order the module takes them.
  for (std::vector<char>& v : packs_) v.clear();
  for (size_t i = 0; i < ops.size(); ++i) {
    if (plans[i].nothing) continue;
    for (const Plan::In& x : plans[i].plan->inputs) {
      const int pack = PackOf(x);
      const char* value = pack == 0
                              ? reinterpret_cast<const char*>(&x.scalar_d)
                              : reinterpret_cast<const char*>(&x.scalar_i);
      packs_[pack].insert(packs_[pack].end(), value, value + 8);
    }
  }
  for (int pack = 0; pack < 2; ++pack) {
    if (graph->packed[pack] == 0) continue;
    if (static_cast<int64_t>(packs_[pack].size()) != graph->packed[pack] * 8)
      return absl::InternalError(absl::StrCat(
          "a graph's module takes ", graph->packed[pack], " ",
          kPacks[pack].elem, " scalars; this run's ops have ",
          packs_[pack].size() / 8, " (its key should have told them apart)"));
    // (Kept while the values repeat: a loop's learning rate and betas.)
    PackedScalars& kept = packed_[pack];
    if (kept.buffer.get() == nullptr || kept.device != device ||
        kept.bytes != packs_[pack]) {
      absl::StatusOr<Buffer> b =
          plugin_->FromHost(device, packs_[pack].data(), kPacks[pack].type,
                            {graph->packed[pack]});
      if (!b.ok()) return b.status();
      kept.buffer = *std::move(b);
      kept.device = device;
      kept.bytes = packs_[pack];
    }
    args.push_back(kept.buffer.get());
  }
  absl::StatusOr<std::vector<Buffer>> out =
      plugin_->Execute(*graph->exe, device, absl::MakeConstSpan(args));
  if (!out.ok()) {
    for (size_t g = 0; g < segs.size(); ++g) {
      if (graph->result_of[g] >= 0) Drop(seg_address[g], segs[g]->bytes);
    }
    return absl::Status(
        out.status().code(),
        absl::StrCat("the graph's module: ", out.status().message()));
  }
  if (out->size() !=
      static_cast<size_t>(graph->written) + (graph->checked ? 1 : 0)) {
    return absl::InternalError(absl::StrCat("a graph's program gave ",
                                            out->size(), " results for ",
                                            graph->written));
  }
  for (size_t g = 0; g < segs.size(); ++g) {
    if (graph->result_of[g] < 0) continue;
    segs[g]->buffer = std::move((*out)[graph->result_of[g]]);
    segs[g]->host_current = false;
  }
  ++stats_[device].graphs;
  if (graph->checked) {
    int32_t first = 0;
    if (absl::Status st = plugin_->ToHost(out->back(), &first, sizeof(first));
        !st.ok())
      return st;
    if (first > 0 && static_cast<size_t>(first) <= ops.size()) {
      *failed = static_cast<size_t>(first - 1);
      const auto& op = static_cast<const PjrtOp&>(*ops[*failed].op);
      return absl::InvalidArgumentError(
          absl::StrCat(op.name(), ": ", plans[*failed].plan->range_message));
    }
  }
  return true;
}

}  // namespace tpud::pjrt
