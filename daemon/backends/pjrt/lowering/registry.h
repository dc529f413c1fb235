// The registry of lowered ops: one entry per ATen op name, carrying every
// fact PjrtChip needs about it (its rule, single- or multi-output; whether
// it overwrites its first argument unread; whether it is computed on the
// host; how its outputs are sized when PyTorch has no meta kernel for it;
// whether it takes a tensor list). Each op family (lowering/*.cc) registers
// its entries in one function, called once by Registry() (families.h).
//
// A name registered twice is a programming error: registration aborts,
// naming it.
// After every family has registered, each single-output entry whose name is
// a functional op ("aten::add.Tensor") also serves its in-place and out=
// forms ("aten::add_.Tensor", "aten::add.out") under the same rule, where no
// family registered that name itself (an out= overload may belong to
// another op: aten::mean.out is mean.dim's).
#ifndef TPUD_DAEMON_BACKENDS_PJRT_LOWERING_REGISTRY_H_
#define TPUD_DAEMON_BACKENDS_PJRT_LOWERING_REGISTRY_H_

#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "absl/strings/string_view.h"
#include "daemon/backends/pjrt/lowering/lowering.h"

namespace tpud::pjrt {

// Ops that do not run as a program of their own: computed from the arena's
// bytes on the host, or with results sized by the data.
enum class HostKind : uint8_t {
  kNone,
  kLocalScalar,  // _local_scalar_dense
  kEqual,
  kSelect,  // nonzero, masked_select
  kIndex,   // index.Tensor: a selection when it comes without outputs
  kUnique,  // _unique2, unique_consecutive
};

// The dims of each output of an op PyTorch has no meta kernel for (the
// client cannot size them), from its first argument's dims; none where it
// cannot say.
using OutputDims =
    std::vector<std::vector<int64_t>> (*)(const std::vector<int64_t>& self);

struct OpEntry {
  std::string name;  // "aten::add_.Tensor"
  Rule rule;         // one of rule and multi, or neither (host-side only)
  MultiRule multi;
  HostKind host = HostKind::kNone;
  // Writes its first argument without reading it (copy_, fill_, zero_,
  // random fills): the executor need not bring its old value.
  bool overwrites_first = false;
  // Its rule reads tensor lists itself (index, index_put); other single-
  // output rules refuse a list argument.
  bool takes_list = false;
  OutputDims output_dims = nullptr;
  std::string derived_from;  // an in-place or out= form: the op it came from

  OpEntry& OverwritesFirst() {
    overwrites_first = true;
    return *this;
  }
  OpEntry& TakesList() {
    takes_list = true;
    return *this;
  }
  OpEntry& Host(HostKind kind) {
    host = kind;
    return *this;
  }
  OpEntry& SizedBy(OutputDims dims) {
    output_dims = dims;
    return *this;
  }
};

class OpRegistry {
 public:
  // REQUIRES: `name` not registered yet (aborts otherwise).
  OpEntry& Add(const std::string& name, Rule rule);
  OpEntry& AddMulti(const std::string& name, MultiRule rule);
  // An op computed on the host (host_ops.cc), without a rule.
  OpEntry& AddHost(const std::string& name, HostKind kind);
  // `name` runs registered op `of`'s rule (an out= overload, an alias):
  // the rule and whether it takes a list, not its other facts.
  // REQUIRES: `of` registered, `name` not.
  OpEntry& Alias(const std::string& name, const std::string& of);
  // Adds the derived in-place and out= forms (see above). Called once, last.
  void DeriveForms();

  // The entry of `name`, or null when it is not lowered.
  const OpEntry* Find(absl::string_view name) const;
  // Every name served, sorted.
  std::vector<std::string> Names() const;

 private:
  OpEntry& New(const std::string& name);
  std::map<std::string, OpEntry, std::less<>> entries_;
};

// The registry, built on first use from every family (and never changed).
const OpRegistry& Registry();

}  // namespace tpud::pjrt

#endif  // TPUD_DAEMON_BACKENDS_PJRT_LOWERING_REGISTRY_H_
