#include "daemon/backends/pjrt/pjrt_op.h"

#include "absl/strings/ascii.h"

namespace tpud::pjrt {

namespace {

// Calls fn(index, text) for each argument of the schema ("Tensor(a!) self",
// "int[1]? dim=None"), the keyword-only marker "*" skipped.
template <typename Fn>
void ForEachArgument(absl::string_view schema, Fn fn) {
  const size_t open = schema.find('(');
  if (open == absl::string_view::npos) return;
  int depth = 0, index = 0;
  size_t start = open + 1;
  for (size_t i = open + 1; i < schema.size(); ++i) {
    const char c = schema[i];
    if (c == '(' || c == '[') ++depth;
    if ((c == ')' || c == ']') && depth > 0) {
      --depth;
      continue;
    }
    if ((c == ',' && depth == 0) || (c == ')' && depth == 0)) {
      absl::string_view arg =
          absl::StripAsciiWhitespace(schema.substr(start, i - start));
      if (arg != "*" && !arg.empty()) fn(index++, arg);
      start = i + 1;
      if (c == ')') break;
    }
  }
}

}  // namespace

std::vector<int> WrittenArguments(absl::string_view schema) {
  std::vector<int> written;
  ForEachArgument(schema, [&](int index, absl::string_view arg) {
    const size_t bang = arg.find("!)");
    if (bang != absl::string_view::npos && arg.find('(') < bang)
      written.push_back(index);
  });
  return written;
}

std::vector<std::string> ArgumentNames(absl::string_view schema) {
  std::vector<std::string> names;
  ForEachArgument(schema, [&](int, absl::string_view arg) {
    arg = arg.substr(0, arg.find('='));  // "bool keepdim=False": no default
    arg = absl::StripTrailingAsciiWhitespace(arg);
    const size_t space = arg.find_last_of(' ');
    names.emplace_back(
        space == absl::string_view::npos ? arg : arg.substr(space + 1));
  });
  return names;
}

}  // namespace tpud::pjrt
