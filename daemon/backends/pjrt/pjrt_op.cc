#include "daemon/backends/pjrt/pjrt_op.h"

#include "absl/strings/ascii.h"

namespace tpud::pjrt {

std::vector<int> WrittenArguments(absl::string_view schema) {
  std::vector<int> written;
  const size_t open = schema.find('(');
  if (open == absl::string_view::npos) return written;
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
      absl::string_view arg = absl::StripAsciiWhitespace(schema.substr(start, i - start));
      if (arg != "*" && !arg.empty()) {
        const size_t bang = arg.find("!)");
        if (bang != absl::string_view::npos && arg.find('(') < bang) written.push_back(index);
        ++index;
      }
      start = i + 1;
      if (c == ')') break;
    }
  }
  return written;
}

}  // namespace tpud::pjrt
