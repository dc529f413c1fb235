#include "daemon/backends/pjrt/lowering/registry.h"

#include <cstdio>
#include <cstdlib>
#include <utility>

#include "absl/strings/match.h"
#include "daemon/backends/pjrt/lowering/families.h"
#include "daemon/backends/pjrt/pjrt_chip.h"

namespace tpud::pjrt {
namespace {

// The name of the in-place form of `name` ("aten::add.Tensor" ->
// "aten::add_.Tensor") and of its out= form ("aten::add.out",
// "aten::eq.Tensor_out").
std::string InPlaceName(const std::string& name) {
  const size_t dot = name.find('.');
  return dot == std::string::npos
             ? name + "_"
             : name.substr(0, dot) + "_" + name.substr(dot);
}
std::string OutName(const std::string& name) {
  const size_t dot = name.find('.');
  return dot == std::string::npos ? name + ".out" : name + "_out";
}

// A registration that breaks the registry's rules is a bug in a family
// file, found the first time tpud starts (the pinned abseil has no CHECK).
void Fail(const std::string& what) {
  std::fprintf(stderr, "tpud: PJRT lowering registry: %s\n", what.c_str());
  std::abort();
}

}  // namespace

OpEntry& OpRegistry::New(const std::string& name) {
  auto [it, fresh] = entries_.try_emplace(name);
  if (!fresh) Fail(name + " is registered twice");
  it->second.name = name;
  return it->second;
}

OpEntry& OpRegistry::Add(const std::string& name, Rule rule) {
  OpEntry& e = New(name);
  e.rule = std::move(rule);
  return e;
}

OpEntry& OpRegistry::AddMulti(const std::string& name, MultiRule rule) {
  OpEntry& e = New(name);
  e.multi = std::move(rule);
  return e;
}

OpEntry& OpRegistry::AddHost(const std::string& name, HostKind kind) {
  return New(name).Host(kind);
}

OpEntry& OpRegistry::Alias(const std::string& name, const std::string& of) {
  auto it = entries_.find(of);
  if (it == entries_.end())
    Fail(name + " aliases " + of + ", which is not registered (yet)");
  const OpEntry source = it->second;
  OpEntry& e = New(name);
  e.rule = source.rule;
  e.multi = source.multi;
  e.takes_list = source.takes_list;
  return e;
}

void OpRegistry::DeriveForms() {
  std::vector<OpEntry> derived;
  for (const auto& [name, entry] : entries_) {
    if (!entry.rule || name.find("_.") != std::string::npos ||
        name.back() == '_' || absl::StrContains(name, "out")) {
      continue;
    }
    for (std::string form : {InPlaceName(name), OutName(name)}) {
      if (entries_.count(form) != 0) continue;  // the family gave it itself
      OpEntry e;
      e.name = std::move(form);
      e.rule = entry.rule;
      e.takes_list = entry.takes_list;
      e.derived_from = name;
      derived.push_back(std::move(e));
    }
  }
  for (OpEntry& e : derived) {
    const std::string name = e.name;
    entries_.emplace(name, std::move(e));
  }
}

const OpEntry* OpRegistry::Find(absl::string_view name) const {
  auto it = entries_.find(name);
  return it == entries_.end() ? nullptr : &it->second;
}

std::vector<std::string> OpRegistry::Names() const {
  std::vector<std::string> names;
  names.reserve(entries_.size());
  for (const auto& [name, entry] : entries_) names.push_back(name);
  return names;
}

const OpRegistry& Registry() {
  static const OpRegistry* registry = [] {
    auto* r = new OpRegistry;
    for (void (*family)(OpRegistry&) :
         {RegisterElementwise, RegisterActivation, RegisterReduction,
          RegisterSort,        RegisterLinalg,     RegisterNn,
          RegisterForeach,     RegisterShape,      RegisterIndexing,
          RegisterRandom,      RegisterSpecial,    RegisterFft,
          RegisterPolynomial,  RegisterEigen,      RegisterResample,
          RegisterBessel,      RegisterNnBackward, RegisterSegment,
          RegisterGamma,       RegisterMatrixExp,  RegisterHostOps}) {
      family(*r);
    }
    r->DeriveForms();
    return r;
  }();
  return *registry;
}

std::vector<std::string> LoweredOpNames() { return Registry().Names(); }

}  // namespace tpud::pjrt
