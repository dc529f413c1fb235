// Entries of the C++ meta table made from at::meta:: functions by one
// template (native_meta_structured.cc). Internal to native_meta.cc.
#pragma once

#include <string>
#include <unordered_map>

#include "native_meta.h"

namespace torch_tpu {

// Adds them to `table`, keeping entries it already has.
void AddStructuredMeta(std::unordered_map<std::string, NativeMetaFn>* table);

}  // namespace torch_tpu
