// An ATen op as PjrtChip knows it: its schema, the arguments it writes and
// its registry entry, found once when the op is looked up.
#ifndef TPUD_DAEMON_BACKENDS_PJRT_PJRT_OP_H_
#define TPUD_DAEMON_BACKENDS_PJRT_PJRT_OP_H_

#include <algorithm>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/string_view.h"
#include "daemon/backends/chip_backend.h"
#include "daemon/backends/pjrt/lowering/registry.h"

namespace tpud::pjrt {
// The arguments' names ("aten::add.Tensor(Tensor self, Tensor other, *,
// Scalar alpha=1) -> Tensor": self, other, alpha).
std::vector<std::string> ArgumentNames(absl::string_view schema);

class PjrtOp : public BackendOp {
 public:
  // written: the arguments the op writes ("Tensor(a!) self" of an in-place
  // op; "Tensor(a!) out", "Tensor(b!) total_weight" of an out= op), in order.
  // What depends on the name alone is found here once, not per op run.
  PjrtOp(std::string schema, std::string name, std::vector<int> written)
      : schema_(std::move(schema)),
        name_(std::move(name)),
        written_(std::move(written)),
        arg_names_(ArgumentNames(schema_)),
        entry_(Registry().Find(name_)) {}
  const std::string& schema() const override { return schema_; }
  const std::string& name() const { return name_; }
  const std::vector<int>& written() const { return written_; }
  // Its arguments' names, in order ("self", "other", "alpha"), for rules
  // that read them by name (Args, lowering/helpers.h).
  const std::vector<std::string>& arg_names() const { return arg_names_; }
  // Its registry entry (null: not lowered); the registry lives as long as
  // the process.
  const OpEntry* entry() const { return entry_; }
  HostKind host() const {
    return entry_ == nullptr ? HostKind::kNone : entry_->host;
  }
  const Rule* rule() const {
    return entry_ != nullptr && entry_->rule ? &entry_->rule : nullptr;
  }
  const MultiRule* multi_rule() const {
    return entry_ != nullptr && entry_->multi ? &entry_->multi : nullptr;
  }
  bool takes_list() const { return entry_ != nullptr && entry_->takes_list; }
  bool WritesArgument(size_t index) const override {
    return std::find(written_.begin(), written_.end(),
                     static_cast<int>(index)) != written_.end();
  }
  bool OverwritesArgument(size_t index) const override {
    if (!WritesArgument(index)) return false;
    // out= tensors and the targets of copy_, fill_ and zero_ are not read.
    return index > 0 || (entry_ != nullptr && entry_->overwrites_first);
  }

 private:
  std::string schema_;
  std::string name_;  // "aten::add_.Tensor"
  std::vector<int> written_;
  std::vector<std::string> arg_names_;
  const OpEntry* entry_;
};

// The indices of the arguments annotated as written ("(a!)", "(b!)", ...).
std::vector<int> WrittenArguments(absl::string_view schema);

}  // namespace tpud::pjrt

#endif  // TPUD_DAEMON_BACKENDS_PJRT_PJRT_OP_H_
