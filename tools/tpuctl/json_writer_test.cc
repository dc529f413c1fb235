#include "tools/tpuctl/json_writer.h"

#include "catch2_compat/catch.h"

namespace tpuctl {
namespace {

TEST_CASE(
    "JsonWriter nests objects and arrays with commas in the right places") {
  JsonWriter w;
  w.BeginObject();
  w.Key("a").Int(-1);
  w.Key("b").BeginArray().Uint(1).Uint(2).EndArray();
  w.Key("c").BeginObject().Key("x").Bool(true).Key("y").Null().EndObject();
  w.Key("d").IntArray(std::vector<int>{2, 2, 1});
  w.EndObject();
  REQUIRE(w.str() ==
          R"({"a":-1,"b":[1,2],"c":{"x":true,"y":null},"d":[2,2,1]})");
}

TEST_CASE("JsonWriter escapes strings") {
  REQUIRE(JsonWriter::Escape("a\"b\\c\nd\x01") == "\"a\\\"b\\\\c\\nd\\u0001\"");
}

TEST_CASE("JsonWriter writes non-finite doubles as null") {
  JsonWriter w;
  w.BeginArray().Double(1.5).Double(1.0 / 0.0).EndArray();
  REQUIRE(w.str() == "[1.5,null]");
}

}  // namespace
}  // namespace tpuctl

namespace tpuctl {
namespace {

TEST_CASE("JsonWriter keeps doubles exact (timestamps)") {
  JsonWriter w;
  w.BeginArray().Double(1795970000.123456).Double(0.1).EndArray();
  REQUIRE(w.str() == "[1795970000.123456,0.1]");
}

}  // namespace
}  // namespace tpuctl
