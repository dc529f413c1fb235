// The executor's steps of captured programs (kRunProgram): a program's
// records are read once from the session's shared memory and checked, then
// run with their bindings applied, either whole by a compiling backend
// (ChipBackend::RunProgram) or record by record as RunOp and RunCopy run
// them; a failure poisons what the rest of the program would have written.
#include <spdlog/spdlog.h>

#include <algorithm>
#include <cstring>
#include <optional>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "daemon/executor/executor.h"
#include "tpu/device_address.h"

namespace tpud {

absl::StatusOr<std::shared_ptr<Executor::Program>> Executor::ProgramOf(
    Session& s, const tpu::DecodedRunProgram& run) {
  const bool eager = run.program_id == tpu::kEagerProgramId;
  auto it = s.programs.find(run.program_id);
  if (!eager && it != s.programs.end() && it->second->offset == run.offset &&
      it->second->bytes == run.bytes) {
    return it->second;
  }
  // Read once from the session's shared memory into our own copy (the
  // client could rewrite its copy meanwhile), and checked record by record.
  absl::StatusOr<char*> at = HostRange(s, run.offset, run.bytes);
  if (!at.ok()) return at.status();
  std::shared_ptr<Program> p;
  if (eager && eager_scratch_ != nullptr && eager_scratch_.use_count() == 1) {
    p = eager_scratch_;  // its string and vectors keep their capacity
    p->records.clear();
    p->calls = 0;
    p->one_by_one = false;
  } else {
    p = std::make_shared<Program>();
    if (eager) eager_scratch_ = p;
  }
  p->offset = run.offset;
  p->bytes = run.bytes;
  p->data.assign(*at, run.bytes);
  const std::string& d = p->data;
  tpu::ProgramHeader h;
  if (d.size() < sizeof(h))
    return absl::InvalidArgumentError("a program shorter than its header");
  std::memcpy(&h, d.data(), sizeof(h));
  if (h.magic != tpu::kProgramMagic || h.name_len > tpu::kMaxProgramNameBytes ||
      h.num_records > tpu::kMaxProgramRecords) {
    return absl::InvalidArgumentError(
        "not a program (bad magic, name or record count)");
  }
  if (h.num_dead != 0 && (!eager || h.num_dead > tpu::kMaxProgramDead)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "a program names ", h.num_dead,
        " dead segments (only a fused eager run names any, at most ",
        tpu::kMaxProgramDead,
        "); a client built with this tpud sends them "
        "only so"));
  }
  size_t pos = sizeof(h) + (h.name_len + 7) / 8 * 8;
  if (pos > d.size())
    return absl::InvalidArgumentError("a program's name runs past its end");
  p->name.assign(d.data() + sizeof(h), h.name_len);
  // The dead segments' addresses end it.
  const size_t dead_bytes = size_t{h.num_dead} * sizeof(uint64_t);
  if (d.size() - pos < dead_bytes)
    return absl::InvalidArgumentError(
        absl::StrCat("a program of ", d.size(), " bytes names ", h.num_dead,
                     " dead segments (", dead_bytes,
                     " bytes), more than follow its name (", d.size() - pos,
                     " bytes); a client built with this tpud writes them "
                     "after its records"));
  const size_t end = d.size() - dead_bytes;
  p->dead.resize(h.num_dead);
  if (dead_bytes != 0) std::memcpy(p->dead.data(), d.data() + end, dead_bytes);
  std::sort(p->dead.begin(), p->dead.end());
  while (pos < end) {
    tpu::RecordHeader rh;
    if (end - pos < sizeof(rh)) {
      return absl::InvalidArgumentError(
          absl::StrCat("program record ", p->records.size(), " is cut short"));
    }
    std::memcpy(&rh, d.data() + pos, sizeof(rh));
    if (absl::Status st = tpu::CheckHeader(rh, end - pos); !st.ok()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "program record ", p->records.size(), ": ", st.message()));
    }
    const auto kind = static_cast<tpu::RecordKind>(rh.kind);
    if (kind != tpu::RecordKind::kOp && kind != tpu::RecordKind::kCopy) {
      return absl::InvalidArgumentError(
          absl::StrCat("program record ", p->records.size(), " is of kind ",
                       rh.kind, "; programs hold ops and device copies"));
    }
    p->records.emplace_back(pos, rh.length);
    pos += rh.length;
  }
  if (p->records.size() != h.num_records) {
    return absl::InvalidArgumentError(
        absl::StrCat("a program of ", p->records.size(),
                     " records says it has ", h.num_records));
  }
  if (eager) return p;  // this run's own
  if (s.programs.size() >= 1024)
    s.programs.clear();  // a bound; dropped ones are read again
  s.programs[run.program_id] = p;
  return p;
}

absl::Status Executor::RunProgram(Ring& ring, uint64_t sequence,
                                  const tpu::DecodedRunProgram& run) {
  Session& s = *ring.session;
  absl::StatusOr<std::shared_ptr<Program>> prog = ProgramOf(s, run);
  if (!prog.ok()) {
    return absl::Status(prog.status().code(),
                        absl::StrCat("program ", run.program_id, ": ",
                                     prog.status().message()));
  }
  Program& p = **prog;
  const bool eager = run.program_id == tpu::kEagerProgramId;
  const uint64_t started = tpu::MonotonicNanos();
  // Fused eager runs share one entry (`tpuctl programs`): their calls, time
  // and the records of the latest.
  const uint32_t stat_id = eager ? kEagerProgramStatId : run.program_id;
  ProgramStat* stat = nullptr;
  {
    ProgramStat* table = s.state.chip(ring.chip)->programs;
    for (int i = 0; i < kMaxProgramStats && stat == nullptr; ++i) {
      if (table[i].id.load(std::memory_order_relaxed) == stat_id)
        stat = &table[i];
    }
    if (stat == nullptr) {
      stat = &table[0];
      for (int i = 1; i < kMaxProgramStats; ++i) {
        if (table[i].calls.load(std::memory_order_relaxed) <
            stat->calls.load(std::memory_order_relaxed)) {
          stat = &table[i];
        }
      }
      stat->id.store(0, std::memory_order_release);
      stat->records = static_cast<uint32_t>(p.records.size());
      const size_t n = std::min(p.name.size(), sizeof(stat->name) - 1);
      std::memcpy(stat->name, p.name.data(), n);
      stat->name[n] = '\0';
      stat->calls.store(0, std::memory_order_relaxed);
      stat->busy_ns.store(0, std::memory_order_relaxed);
      stat->compiles.store(0, std::memory_order_relaxed);
      SetCompileWhy(stat, "");
      stat->id.store(stat_id, std::memory_order_release);
    }
    if (eager) stat->records = static_cast<uint32_t>(p.records.size());
  }
  struct Count {
    ProgramStat* stat;
    uint64_t started;
    ~Count() {
      stat->calls.fetch_add(1, std::memory_order_relaxed);
      stat->busy_ns.fetch_add(tpu::MonotonicNanos() - started,
                              std::memory_order_relaxed);
    }
  } count{stat, started};
  // Bindings by their captured range, which must not overlap.
  std::vector<tpu::ProgramBinding> bindings(run.bindings);
  std::sort(bindings.begin(), bindings.end(),
            [](const tpu::ProgramBinding& a, const tpu::ProgramBinding& b) {
              return a.from < b.from;
            });
  for (size_t i = 0; i < bindings.size(); ++i) {
    const tpu::ProgramBinding& b = bindings[i];
    if (b.bytes == 0 || b.from + b.bytes < b.from || b.to + b.bytes < b.to ||
        (i > 0 && bindings[i - 1].from + bindings[i - 1].bytes > b.from)) {
      return absl::InvalidArgumentError(
          absl::StrCat("program '", p.name, "': binding ", i,
                       " is empty, wraps or overlaps another"));
    }
  }
  auto move = [&](uint64_t& address) {
    if (bindings.empty() || address == 0) return;
    auto it = std::upper_bound(
        bindings.begin(), bindings.end(), address,
        [](uint64_t a, const tpu::ProgramBinding& b) { return a < b.from; });
    if (it == bindings.begin()) return;
    --it;
    if (address < it->from + it->bytes) address = it->to + (address - it->from);
  };
  uint64_t generators = 0;
  auto rebind = [&](tpu::DecodedOp& op) {
    for (size_t a = 0; a < op.num_args; ++a) {
      tpu::OpArg& arg = op.args[a];
      switch (arg.tag) {
        case tpu::ArgTag::kTensor:
          move(arg.tensor.address);
          break;
        case tpu::ArgTag::kTensorList:
        case tpu::ArgTag::kOptionalTensorList:
          for (tpu::TensorRef& t : arg.tensors) move(t.address);
          break;
        case tpu::ArgTag::kGenerator:
          if (run.seed != 0)
            arg.i = static_cast<int64_t>(tpu::MixSeed(run.seed, generators));
          ++generators;
          break;
        default:
          break;
      }
    }
    for (tpu::TensorRef& t : op.outputs) move(t.address);
  };
  const size_t n = p.records.size();
  // What record `first` and the rest of the program would have written is
  // not valid after a failure there.
  auto poison_from = [&](size_t first, const std::string& cause) {
    for (size_t j = first; j < n; ++j) {
      const absl::string_view later(p.data.data() + p.records[j].first,
                                    p.records[j].second);
      tpu::RecordHeader lh;
      std::memcpy(&lh, later.data(), sizeof(lh));
      if (lh.kind == static_cast<uint16_t>(tpu::RecordKind::kOp)) {
        if (!tpu::DecodeOp(later, &op_).ok()) continue;
        rebind(op_);
        const OpSlot& slot = LookupOp(ring, op_.op_id);
        PoisonOutputs(ring, slot.op.get(), cause);
      } else {
        tpu::DecodedCopy copy;
        if (!tpu::DecodeCopy(later, &copy).ok()) continue;
        move(copy.dst);
        if (tpu::DeviceAddressChip(copy.dst) == ring.chip)
          AddPoison(s, ring.chip, copy.dst, copy.dst + copy.bytes, cause);
      }
    }
  };
  // Where record k (`what` it is) lies, for errors.
  auto where = [&](size_t k, const std::string& what) {
    return eager ? absl::StrCat("op ", k + 1, " of a fused eager run of ", n,
                                " (", what, ")")
                 : absl::StrCat("program '", p.name, "', record ", k + 1,
                                " of ", n, " (", what, ")");
  };
  // Records [from, to) one by one, as RunOp and RunCopy run them.
  size_t first = 0;          // the first record not run whole
  absl::Status first_error;  // an eager run's
  auto run_records = [&](size_t from, size_t to) -> absl::Status {
    for (size_t k = from; k < to; ++k) {
      const absl::string_view rec(p.data.data() + p.records[k].first,
                                  p.records[k].second);
      tpu::RecordHeader rh;
      std::memcpy(&rh, rec.data(), sizeof(rh));
      absl::Status st;
      std::string what = "copy";
      if (rh.kind == static_cast<uint16_t>(tpu::RecordKind::kOp)) {
        st = tpu::DecodeOp(rec, &op_);
        if (st.ok() && (op_.flags & tpu::kOpFlagSync) != 0) {
          st = absl::InvalidArgumentError("a synchronous op in a program");
        }
        if (st.ok()) {
          rebind(op_);
          poison_root_.clear();
          st = RunOp(ring, sequence);
          const OpSlot& slot = LookupOp(ring, op_.op_id);
          what = slot.op != nullptr ? OpName(slot.op.get())
                                    : absl::StrCat("op ", op_.op_id);
          if (!st.ok())
            PoisonOutputs(ring, slot.op.get(),
                          poison_root_.empty() ? std::string(st.message())
                                               : poison_root_);
        }
      } else {
        tpu::DecodedCopy copy;
        st = tpu::DecodeCopy(rec, &copy);
        if (st.ok() && copy.kind != tpu::CopyKind::kDeviceToDevice) {
          st = absl::InvalidArgumentError("a copy with the host in a program");
        }
        if (st.ok()) {
          move(copy.src);
          move(copy.dst);
          BeginOp(ring, sequence, "copy", 4);
          st = RunCopy(ring, copy);
          EndOp();
        }
      }
      if (st.ok()) continue;
      const std::string cause =
          absl::StrCat(where(k, what), ": ", st.message());
      if (eager) {
        // As without fusion: the op's outputs are poisoned (RunOp), the ops
        // after it run, and the first error is the stream's.
        if (first_error.ok()) first_error = absl::Status(st.code(), cause);
        continue;
      }
      // What the rest of the program would have written is not valid either.
      poison_from(k + 1, cause);
      return absl::Status(st.code(), cause);
    }
    return first_error;
  };
  // A backend that runs a graph as one program of its own (PJRT with device
  // memory: one StableHLO module) gets the ops whole, resolved and checked
  // here as RunOp does; anything unusual (a poisoned input, a tensor that
  // does not resolve) runs record by record, which words it. (Only a
  // compiling backend can; the simulated chip runs records one by one.)
  if (!p.one_by_one && config_.backend->Compiles()) {
    whole_ops_.resize(n);
    whole_copies_.resize(n);
    whole_tensors_.resize(n);
    std::vector<ProgramOp> ops;
    ops.reserve(n);
    for (size_t k = 0; k < n && !p.one_by_one; ++k) {
      const absl::string_view rec(p.data.data() + p.records[k].first,
                                  p.records[k].second);
      tpu::RecordHeader rh;
      std::memcpy(&rh, rec.data(), sizeof(rh));
      if (rh.kind == static_cast<uint16_t>(tpu::RecordKind::kCopy)) {
        tpu::DecodedCopy& copy = whole_copies_[k];
        if (!tpu::DecodeCopy(rec, &copy).ok() ||
            copy.kind != tpu::CopyKind::kDeviceToDevice) {
          p.one_by_one = true;
          break;
        }
        move(copy.src);
        move(copy.dst);
        ops.push_back({nullptr, nullptr, &whole_tensors_[k], &copy});
        continue;
      }
      if (rh.kind != static_cast<uint16_t>(tpu::RecordKind::kOp) ||
          !tpu::DecodeOp(rec, &whole_ops_[k]).ok() ||
          (whole_ops_[k].flags & tpu::kOpFlagSync) != 0) {
        p.one_by_one = true;
        break;
      }
      rebind(whole_ops_[k]);
      const OpSlot& slot = LookupOp(ring, whole_ops_[k].op_id);
      if (slot.op == nullptr) p.one_by_one = true;
      ops.push_back({slot.op.get(), &whole_ops_[k], &whole_tensors_[k]});
    }
    if (p.one_by_one) {
      spdlog::info(
          "session {}: program '{}' runs op by op: it holds a copy, a "
          "synchronous op or an undefined op",
          s.id, p.name);
    }
    // Records [lo, n) resolved and checked as RunOp does, inside one
    // BeginOp that the backend's run must share: a segment the client frees
    // meanwhile is not reused before EndOp. False: something unusual (a
    // poisoned input, a tensor that does not resolve), for the records to
    // run one by one, which words it.
    auto resolve = [&](size_t lo) {
      BeginOp(ring, sequence, "program", 7);
      bool resolved =
          s.state.header()->dead.load(std::memory_order_seq_cst) == 0;
      if (resolved) SyncReleases();
      for (size_t k = lo; k < n && resolved; ++k) {
        if (ops[k].copy != nullptr) {
          // Both ends whole inside segments of the session, on this chip.
          whole_tensors_[k].clear();
          for (uint64_t at : {ops[k].copy->src, ops[k].copy->dst}) {
            const uint64_t bytes = ops[k].copy->bytes;
            std::optional<PageOwnerTable::Segment> seg;
            if (bytes != 0 && tpu::DeviceAddressChip(at) == ring.chip) {
              seg = config_.owners[ring.chip].Find(tpu::DeviceAddressOffset(at),
                                                   bytes, s.tag);
            }
            if (bytes != 0 && !seg.has_value()) resolved = false;
            std::string cause;
            if (bytes != 0 && at == ops[k].copy->src &&
                FindPoison(s, ring.chip, at, at + bytes, &cause)) {
              resolved = false;
            }
            if (resolved && at == ops[k].copy->dst)
              ClearPoison(s, ring.chip, at, at + bytes);
            if (seg.has_value()) {
              whole_tensors_[k].push_back(
                  ResolvedTensor{config_.chip_bases[ring.chip] + seg->offset,
                                 tpu::MakeDeviceAddress(ring.chip, seg->offset),
                                 seg->bytes, s.id});
            }
          }
          continue;
        }
        std::swap(op_, whole_ops_[k]);
        resolved = ResolveTensors(ring).ok() &&
                   CheckInputPoison(ring, *ops[k].op).ok();
        // What an op writes is good for the ops after it (the graph writes
        // it; or, run record by record, the op before those ops read it).
        if (resolved && s.state.chip(ring.chip)->poison.count != 0)
          UnpoisonOutputs(ring, *ops[k].op);
        std::swap(op_, whole_ops_[k]);
        whole_tensors_[k] = resolved_;
      }
      return resolved;
    };
    // The backend's run of `part`, the records `index_of` names (ascending),
    // inside resolve's BeginOp; `last`: nothing of the run comes after it.
    // On its failure, what the rest would have written is poisoned. `failed`:
    // the index, among part's, of the op that failed or was declined.
    auto run_part = [&](const std::vector<ProgramOp>& part, auto index_of,
                        bool last, size_t* failed,
                        std::string* declined) -> absl::StatusOr<bool> {
      // Dead segments are dead after the whole run: an earlier part's
      // writes there may be read by the parts after it.
      absl::StatusOr<bool> ran =
          config_.backend->RunProgram(part,
                                      last ? absl::Span<const uint64_t>(p.dead)
                                           : absl::Span<const uint64_t>(),
                                      failed, declined);
      if (std::string note = config_.backend->TakeCompileNote();
          !note.empty()) {
        stat->compiles.fetch_add(1, std::memory_order_relaxed);
        SetCompileWhy(stat, note);
      }
      if (ran.ok()) return ran;
      const size_t at = index_of(std::min(*failed, part.size() - 1));
      const std::string cause = absl::StrCat(
          where(at, ops[at].copy != nullptr ? "copy" : OpName(ops[at].op)),
          ": ", ran.status().message());
      poison_from(at, cause);
      return absl::Status(ran.status().code(), cause);
    };
    // Records [lo, hi) as one program; `failed` then a record index.
    auto run_whole = [&](size_t lo, size_t hi, size_t* failed,
                         std::string* declined) -> absl::StatusOr<bool> {
      // (The whole run, mostly: no copy then.)
      std::vector<ProgramOp> some;
      if (lo != 0 || hi != n) some.assign(ops.begin() + lo, ops.begin() + hi);
      const std::vector<ProgramOp>& part = some.empty() ? ops : some;
      absl::StatusOr<bool> ran = run_part(
          part, [lo](size_t i) { return lo + i; }, hi == n, failed, declined);
      if (ran.ok()) *failed = lo + std::min(*failed, part.size());
      return ran;
    };
    // A fused eager run's fills of segments that no earlier record of the
    // run touches and that outlive the run (an optimizer's zeros_like state,
    // made in a loop's first step) run first, as a program of their own,
    // then the rest without them: the first step then compiles the program
    // that the steps after it run. (Fills of the run's temporaries stay:
    // XLA folds them into their readers.) Empty: none, or nothing else.
    auto hoisted_fills = [&] {
      std::vector<size_t> fills;  // candidates first: lasting fills
      if (!eager) return fills;
      for (size_t k = 0; k < n; ++k) {
        const std::vector<ResolvedTensor>& ts = whole_tensors_[k];
        if (ops[k].op == nullptr || ts.empty()) continue;
        const std::string& schema = ops[k].op->schema();
        if (!absl::StartsWith(schema, "aten::zero_(") &&
            !absl::StartsWith(schema, "aten::fill_.Scalar("))
          continue;
        const uint64_t seg = ts[0].segment_address;
        bool lasting = !std::binary_search(p.dead.begin(), p.dead.end(), seg);
        for (const ResolvedTensor& t : ts)
          lasting = lasting && t.segment_address == seg;
        if (lasting) fills.push_back(k);
      }
      if (fills.empty()) return fills;
      // ... of segments no earlier record touches.
      touched_.clear();
      size_t kept = 0;
      for (size_t k = 0, f = 0; f < fills.size(); ++k) {
        const std::vector<ResolvedTensor>& ts = whole_tensors_[k];
        if (k == fills[f]) {
          if (touched_.count(ts[0].segment_address) == 0) fills[kept++] = k;
          ++f;
        }
        for (const ResolvedTensor& t : ts) touched_.insert(t.segment_address);
      }
      fills.resize(kept == n ? 0 : kept);
      return fills;
    };
    // An eager run (fused eager) splits where the backend declines an op:
    // the ops before it run whole, it runs alone, then the rest.
    size_t lo = 0;
    while (!p.one_by_one && lo < n) {
      if (!resolve(lo)) {
        EndOp();
        break;
      }
      size_t at = 0;
      std::string declined;
      if (lo == 0) {
        const std::vector<size_t> fills = hoisted_fills();
        if (!fills.empty()) {
          std::vector<ProgramOp> first_part, rest;
          std::vector<size_t> rest_at;
          for (size_t k = 0, f = 0; k < n; ++k) {
            if (f < fills.size() && fills[f] == k) {
              first_part.push_back(ops[k]);
              ++f;
            } else {
              rest.push_back(ops[k]);
              rest_at.push_back(k);
            }
          }
          absl::StatusOr<bool> ran = run_part(
              first_part, [&](size_t i) { return fills[i]; }, false, &at,
              &declined);
          if (ran.ok() && *ran) {
            ran = run_part(
                rest, [&](size_t i) { return rest_at[i]; }, true, &at,
                &declined);
          }
          if (!ran.ok() || *ran) {
            EndOp();
            if (!ran.ok()) return ran.status();
            ++p.calls;
            return absl::OkStatus();
          }
          // Declined (before anything of the rest ran): the run as it came,
          // below; its fills write again what they wrote.
          declined.clear();
        }
      }
      absl::StatusOr<bool> ran = run_whole(lo, n, &at, &declined);
      if (!ran.ok() || *ran) {
        EndOp();
        if (!ran.ok()) return ran.status();
        ++p.calls;
        return absl::OkStatus();
      }
      if (!eager || at >= n) {
        EndOp();
        if (eager) {
          spdlog::debug("session {}: eager run op by op from record {}: {}",
                        s.id, lo + 1, declined);
        } else {
          // Declined: not offered again.
          p.one_by_one = true;
          spdlog::info("session {}: program '{}' runs op by op: {}", s.id,
                       p.name, declined);
        }
        break;
      }
      bool before = false;  // the ops before it ran whole
      if (at - lo >= 2) {
        size_t again = 0;
        ran = run_whole(lo, at, &again, &declined);
        if (!ran.ok()) {
          EndOp();
          return ran.status();
        }
        before = *ran;
      }
      EndOp();
      // (An eager run's errors are kept in first_error; its ops go on.)
      if (!before) (void)run_records(lo, at);
      (void)run_records(at, at + 1);
      lo = at + 1;
    }
    if (lo >= n) {
      ++p.calls;
      return first_error;
    }
    first = lo;
  }
  generators = 0;  // the records' seeds again from the first, as the whole
                   // program had them
  if (absl::Status st = run_records(first, n); !st.ok()) return st;
  ++p.calls;
  return absl::OkStatus();
}

}  // namespace tpud
