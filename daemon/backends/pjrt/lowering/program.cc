#include "daemon/backends/pjrt/lowering/program.h"

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace tpud::pjrt {
namespace {

// "func.func <visibility> @<name>(<params>) -> (<types>) {...}", the text
// both forms share; `donate` marks each donated parameter for its result.
std::string Func(const ProgramPieces& p, const std::string& head, bool donate) {
  std::vector<std::string> params;
  for (const ProgramPieces::Param& q : p.params) {
    params.push_back(absl::StrCat(q.name, ": ", q.type));
    if (donate && q.alias >= 0) {
      absl::StrAppend(&params.back(), " {tf.aliasing_output = ", q.alias,
                      " : i32}");
    }
  }
  const std::string ret = absl::StrJoin(p.result_types, ", ");
  return absl::StrCat("  func.func ", head, "(", absl::StrJoin(params, ", "),
                      ") -> (", ret, ") {\n", p.body, "    return ",
                      absl::StrJoin(p.results, ", "), " : ", ret, "\n  }\n");
}

}  // namespace

std::vector<std::string> ProgramPieces::ParamTypes() const {
  std::vector<std::string> types;
  for (const Param& q : params) types.push_back(q.type);
  return types;
}

std::string ProgramPieces::Module() const {
  return absl::StrCat("module @tpud_op {\n", Func(*this, "public @main", true),
                      "}\n");
}

std::string ProgramPieces::Function(const std::string& name) const {
  return Func(*this, absl::StrCat("private @", name), false);
}

}  // namespace tpud::pjrt
