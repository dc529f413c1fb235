// A small streaming JSON writer for tpuctl's --json output.
#ifndef TPUD_TOOLS_TPUCTL_JSON_WRITER_H_
#define TPUD_TOOLS_TPUCTL_JSON_WRITER_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/strings/string_view.h"

namespace tpuctl {

// Builds one JSON document. Calls must nest correctly (the writer tracks
// commas, not structure); Key() precedes every value inside an object.
class JsonWriter {
 public:
  JsonWriter& BeginObject();
  JsonWriter& EndObject();
  JsonWriter& BeginArray();
  JsonWriter& EndArray();
  JsonWriter& Key(absl::string_view key);
  JsonWriter& String(absl::string_view value);
  JsonWriter& Int(int64_t value);
  JsonWriter& Uint(uint64_t value);
  JsonWriter& Double(double value);
  JsonWriter& Bool(bool value);
  JsonWriter& Null();
  template <typename T>
  JsonWriter& IntArray(const std::vector<T>& values) {
    BeginArray();
    for (const T& v : values) Int(static_cast<int64_t>(v));
    return EndArray();
  }

  const std::string& str() const { return out_; }

  static std::string Escape(absl::string_view s);

 private:
  void BeforeValue();
  std::string out_;
  // Per open container: whether it already holds an element.
  std::vector<bool> has_element_;
  bool after_key_ = false;
};

}  // namespace tpuctl

#endif  // TPUD_TOOLS_TPUCTL_JSON_WRITER_H_
