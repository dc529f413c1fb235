#include "tpu/op_record.h"

#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <new>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "catch2_compat/catch.h"

// Counts heap allocations, so tests can show that steady-state encoding and
// decoding allocate nothing and that a lying count allocates nothing big.
namespace {
std::atomic<uint64_t> g_new_calls{0};
std::atomic<uint64_t> g_new_bytes{0};
}  // namespace

// Every plain (not over-aligned) form is replaced, so that new and delete
// always pair up as malloc and free (AddressSanitizer checks the pairing).
namespace {
void* CountedAlloc(std::size_t n) noexcept {
  g_new_calls.fetch_add(1, std::memory_order_relaxed);
  g_new_bytes.fetch_add(n, std::memory_order_relaxed);
  return std::malloc(n == 0 ? 1 : n);
}
}  // namespace

void* operator new(std::size_t n) {
  if (void* p = CountedAlloc(n)) return p;
  throw std::bad_alloc();
}
void* operator new[](std::size_t n) {
  if (void* p = CountedAlloc(n)) return p;
  throw std::bad_alloc();
}
void* operator new(std::size_t n, const std::nothrow_t&) noexcept {
  return CountedAlloc(n);
}
void* operator new[](std::size_t n, const std::nothrow_t&) noexcept {
  return CountedAlloc(n);
}
void operator delete(void* p) noexcept { std::free(p); }
void operator delete[](void* p) noexcept { std::free(p); }
void operator delete(void* p, std::size_t) noexcept { std::free(p); }
void operator delete[](void* p, std::size_t) noexcept { std::free(p); }
void operator delete(void* p, const std::nothrow_t&) noexcept { std::free(p); }
void operator delete[](void* p, const std::nothrow_t&) noexcept {
  std::free(p);
}

namespace tpu {
namespace {

constexpr int8_t kFloat = Code(DType::kFloat);
constexpr int8_t kDoubleType = Code(DType::kDouble);
constexpr int8_t kByte = Code(DType::kUInt8);
constexpr int8_t kComplexDouble = Code(DType::kComplexDouble);

// ------------------------------------------------------------ helpers

TensorRef MakeTensor(std::vector<int64_t> sizes, std::vector<int64_t> strides,
                     int8_t dtype = kFloat, int64_t storage_offset = 0,
                     uint64_t address = 0x7f0000001000) {
  TensorRef t;
  t.address = address;
  t.storage_offset = storage_offset;
  t.dtype = dtype;
  t.ndim = static_cast<uint8_t>(sizes.size());
  for (size_t d = 0; d < sizes.size() && d < kMaxDims; ++d) {
    t.sizes[d] = sizes[d];
    t.strides[d] = d < strides.size() ? strides[d] : 0;
  }
  return t;
}

bool SameBits(double a, double b) { return std::memcmp(&a, &b, 8) == 0; }

bool SameTensor(const TensorRef& a, const TensorRef& b) {
  if (a.address != b.address || a.storage_offset != b.storage_offset ||
      a.dtype != b.dtype || a.ndim != b.ndim) {
    return false;
  }
  for (int d = 0; d < a.ndim; ++d) {
    if (a.sizes[d] != b.sizes[d] || a.strides[d] != b.strides[d]) return false;
  }
  return true;
}

// Compares the fields that `tag` gives meaning to.
bool SameArg(const OpArg& a, const OpArg& b) {
  if (a.tag != b.tag) return false;
  switch (a.tag) {
    case ArgTag::kNone:
    case ArgTag::kUndefinedTensor:
      return true;
    case ArgTag::kTensor:
      return SameTensor(a.tensor, b.tensor);
    case ArgTag::kInt:
    case ArgTag::kSymInt:
    case ArgTag::kScalarInt:
    case ArgTag::kGenerator:
    case ArgTag::kDtype:
    case ArgTag::kLayout:
    case ArgTag::kMemoryFormat:
      return a.i == b.i;
    case ArgTag::kDevice:
      return a.i == b.i && a.device_index == b.device_index;
    case ArgTag::kScalarTensor:
      return a.dtype == b.dtype && a.b == b.b && a.i == b.i &&
             SameBits(a.d_imag, b.d_imag);
    case ArgTag::kDouble:
    case ArgTag::kScalarDouble:
      return SameBits(a.d, b.d);
    case ArgTag::kBool:
    case ArgTag::kScalarBool:
      return a.b == b.b;
    case ArgTag::kComplex:
    case ArgTag::kScalarComplex:
      return SameBits(a.d, b.d) && SameBits(a.d_imag, b.d_imag);
    case ArgTag::kString:
      return a.s == b.s;
    case ArgTag::kIntList:
      return a.ints == b.ints;
    case ArgTag::kDoubleList:
      if (a.doubles.size() != b.doubles.size()) return false;
      for (size_t j = 0; j < a.doubles.size(); ++j) {
        if (!SameBits(a.doubles[j], b.doubles[j])) return false;
      }
      return true;
    case ArgTag::kBoolList:
      return a.bools == b.bools;
    case ArgTag::kTensorList:
      if (a.tensors.size() != b.tensors.size()) return false;
      for (size_t j = 0; j < a.tensors.size(); ++j) {
        if (!SameTensor(a.tensors[j], b.tensors[j])) return false;
      }
      return true;
    case ArgTag::kOptionalTensorList:
      if (a.tensors.size() != b.tensors.size() ||
          a.tensor_present != b.tensor_present) {
        return false;
      }
      for (size_t j = 0; j < a.tensors.size(); ++j) {
        if (a.tensor_present[j] && !SameTensor(a.tensors[j], b.tensors[j])) {
          return false;
        }
      }
      return true;
  }
  return false;
}

OpArg Arg(ArgTag tag) {
  OpArg a;
  a.tag = tag;
  return a;
}
OpArg IntArg(ArgTag tag, int64_t i) {
  OpArg a = Arg(tag);
  a.i = i;
  return a;
}
OpArg DoubleArg(ArgTag tag, double d, double imag = 0) {
  OpArg a = Arg(tag);
  a.d = d;
  a.d_imag = imag;
  return a;
}
OpArg BoolArg(ArgTag tag, bool b) {
  OpArg a = Arg(tag);
  a.b = b;
  return a;
}
OpArg TensorArg(const TensorRef& t) {
  OpArg a = Arg(ArgTag::kTensor);
  a.tensor = t;
  return a;
}

std::string EncodeOp(RecordWriter& w, uint64_t sequence, uint32_t op_id,
                     uint32_t flags, const std::vector<OpArg>& args,
                     const std::vector<TensorRef>& outputs) {
  w.Begin(RecordKind::kOp, sequence);
  w.U32(op_id);
  w.U16(static_cast<uint16_t>(args.size()));
  w.U16(static_cast<uint16_t>(outputs.size()));
  w.U32(flags);
  for (const OpArg& a : args) w.Arg(a);
  for (const TensorRef& t : outputs) w.Tensor(t);
  return std::string(w.Finish());
}

// Encodes a decoded op again, for "decode then encode gives the same bytes".
std::string ReencodeOp(RecordWriter& w, uint64_t sequence,
                       const DecodedOp& op) {
  w.Begin(RecordKind::kOp, sequence);
  w.U32(op.op_id);
  w.U16(static_cast<uint16_t>(op.num_args));
  w.U16(static_cast<uint16_t>(op.outputs.size()));
  w.U32(op.flags);
  for (size_t i = 0; i < op.num_args; ++i) w.Arg(op.args[i]);
  for (const TensorRef& t : op.outputs) w.Tensor(t);
  return std::string(w.Finish());
}

std::string EncodeDefineOp(RecordWriter& w, uint64_t sequence, uint32_t op_id,
                           absl::string_view schema) {
  w.Begin(RecordKind::kDefineOp, sequence);
  w.U32(op_id);
  w.U32(static_cast<uint32_t>(schema.size()));
  w.Bytes(schema.data(), schema.size());
  return std::string(w.Finish());
}

std::string EncodeCopy(RecordWriter& w, uint64_t sequence, uint8_t kind,
                       uint64_t src, uint64_t dst, uint64_t bytes) {
  w.Begin(RecordKind::kCopy, sequence);
  w.U8(kind);
  w.Pad(7);
  w.U64(src);
  w.U64(dst);
  w.U64(bytes);
  return std::string(w.Finish());
}

std::string EncodeEventRecord(RecordWriter& w, uint64_t sequence,
                              uint32_t slot) {
  w.Begin(RecordKind::kEventRecord, sequence);
  w.U32(slot);
  w.Pad(4);
  return std::string(w.Finish());
}

std::string EncodeEventWait(RecordWriter& w, uint64_t sequence, uint32_t slot,
                            uint32_t stream, uint64_t stream_sequence) {
  w.Begin(RecordKind::kEventWait, sequence);
  w.U32(slot);
  w.U32(stream);
  w.U64(stream_sequence);
  return std::string(w.Finish());
}

RecordHeader HeaderOf(absl::string_view record) {
  RecordHeader h;
  REQUIRE(record.size() >= sizeof(h));
  std::memcpy(&h, record.data(), sizeof(h));
  return h;
}

void SetLength(std::string* record, uint32_t length) {
  std::memcpy(&(*record)[0], &length, 4);
}

bool CleanError(const absl::Status& s) {
  return s.code() == absl::StatusCode::kInvalidArgument && !s.message().empty();
}

// Feeds `record` to CheckHeader and every decoder. Returns "" when every
// outcome is a success or a clean INVALID_ARGUMENT, else what went wrong.
struct Decoders {
  DecodedDefineOp define_op;
  DecodedOp op;
  DecodedCopy copy;
  uint32_t event_slot = 0;
  DecodedEventWait event_wait;
  int num_ok = 0;

  std::string Run(absl::string_view record) {
    num_ok = 0;
    if (record.size() >= sizeof(RecordHeader)) {
      RecordHeader h;
      std::memcpy(&h, record.data(), sizeof(h));
      absl::Status s = CheckHeader(h, record.size());
      if (!s.ok() && !CleanError(s)) return "CheckHeader: " + s.ToString();
    }
    const absl::Status results[] = {
        DecodeDefineOp(record, &define_op), DecodeOp(record, &op),
        DecodeCopy(record, &copy), DecodeEventRecord(record, &event_slot),
        DecodeEventWait(record, &event_wait)};
    for (const absl::Status& s : results) {
      if (s.ok()) {
        ++num_ok;
      } else if (!CleanError(s)) {
        return "decoder: " + s.ToString();
      }
    }
    if (num_ok > 1) return "more than one decoder accepted the record";
    return "";
  }
};

std::string Hex(absl::string_view bytes) {
  std::string out;
  for (unsigned char c : bytes)
    absl::StrAppend(&out, absl::Hex(c, absl::kZeroPad2));
  return out;
}

// One op that uses every ArgTag, edge values included.
std::vector<OpArg> EveryTagArgs(bool with_long_string) {
  std::vector<OpArg> args;
  args.push_back(Arg(ArgTag::kNone));
  args.push_back(TensorArg(MakeTensor({2, 3}, {3, 1}, kFloat, 5, 0xdead0000)));
  args.push_back(Arg(ArgTag::kUndefinedTensor));
  args.push_back(IntArg(ArgTag::kInt, std::numeric_limits<int64_t>::min()));
  args.push_back(IntArg(ArgTag::kSymInt, -7));
  args.push_back(DoubleArg(ArgTag::kDouble, -0.0));
  args.push_back(BoolArg(ArgTag::kBool, true));
  args.push_back(DoubleArg(ArgTag::kComplex, 1.5, -2.25));
  OpArg s = Arg(ArgTag::kString);
  s.s = with_long_string ? std::string(kMaxStringBytes, 'x') : "reduce";
  if (with_long_string) s.s[17] = '\0';  // bytes, not C strings
  args.push_back(s);
  args.push_back(
      IntArg(ArgTag::kScalarInt, std::numeric_limits<int64_t>::max()));
  args.push_back(DoubleArg(ArgTag::kScalarDouble,
                           std::numeric_limits<double>::quiet_NaN()));
  args.push_back(BoolArg(ArgTag::kScalarBool, false));
  args.push_back(DoubleArg(ArgTag::kScalarComplex,
                           std::numeric_limits<double>::infinity(), 1e-300));
  OpArg ints = Arg(ArgTag::kIntList);
  ints.ints = {1, -1, 0, std::numeric_limits<int64_t>::max()};
  args.push_back(ints);
  args.push_back(Arg(ArgTag::kIntList));  // empty
  OpArg doubles = Arg(ArgTag::kDoubleList);
  doubles.doubles = {0.5, -3.0};
  args.push_back(doubles);
  args.push_back(Arg(ArgTag::kDoubleList));
  OpArg bools = Arg(ArgTag::kBoolList);
  bools.bools = {true, false, true};
  args.push_back(bools);
  args.push_back(Arg(ArgTag::kBoolList));
  args.push_back(IntArg(ArgTag::kDtype, 15));
  args.push_back(IntArg(ArgTag::kLayout, 0));
  args.push_back(IntArg(ArgTag::kMemoryFormat, -1));
  OpArg device = IntArg(ArgTag::kDevice, 29);
  device.device_index = -1;
  args.push_back(device);
  OpArg list = Arg(ArgTag::kTensorList);
  std::vector<int64_t> sizes_max(kMaxDims), strides_max(kMaxDims);
  for (int d = 0; d < kMaxDims; ++d) {
    sizes_max[d] = d % 3 + 1;
    strides_max[d] = int64_t{1} << (d % 40);
  }
  list.tensors = {MakeTensor(sizes_max, strides_max, kByte),
                  MakeTensor({}, {}, kComplexDouble, 3)};
  args.push_back(list);
  args.push_back(Arg(ArgTag::kTensorList));
  OpArg optional = Arg(ArgTag::kOptionalTensorList);
  optional.tensors = {TensorRef(), MakeTensor({4}, {1}), TensorRef(),
                      MakeTensor({2, 2}, {1, 2}, kDoubleType)};
  optional.tensor_present = {false, true, false, true};
  args.push_back(optional);
  args.push_back(Arg(ArgTag::kOptionalTensorList));
  return args;
}

// ------------------------------------------------------------ tests

TEST_CASE("ElementSize knows the c10::ScalarType table and refuses the rest") {
  auto expected = [](int v) -> int {
    switch (v) {
      case 0:
      case 1:
      case 11:
      case 23:
      case 24:
      case 25:
      case 26:
        return 1;
      case 2:
      case 5:
      case 15:
      case 27:
        return 2;
      case 3:
      case 6:
      case 8:
      case 28:
        return 4;
      case 4:
      case 7:
      case 9:
      case 29:
        return 8;
      case 10:
        return 16;
      default:
        return 0;
    }
  };
  for (int v = -128; v <= 127; ++v) {
    INFO("dtype " << v);
    CHECK(ElementSize(static_cast<int8_t>(v)) == expected(v));
  }
  // Spot checks against the names.
  CHECK(ElementSize(6) == 4);   // Float
  CHECK(ElementSize(15) == 2);  // BFloat16
  CHECK(ElementSize(12) == 0);  // QInt8
  CHECK(ElementSize(21) == 0);  // Bits16
  CHECK(ElementSize(30) == 0);
  CHECK(ElementSize(-1) == 0);
}

TEST_CASE("RecordWriter lays records out as the header says") {
  RecordWriter w;
  SECTION("kEventWait, byte by byte") {
    std::string r = EncodeEventWait(w, 0x1122334455667788, 0x01020304, 7,
                                    0xa0a1a2a3a4a5a6a7);
    CHECK(Hex(r) ==
          "20000000"            // length 32
          "0500"                // kind kEventWait
          "0000"                // reserved
          "8877665544332211"    // sequence
          "04030201"            // event_slot
          "07000000"            // stream
          "a7a6a5a4a3a2a1a0");  // sequence waited for
  }
  SECTION("kOp with one int arg is padded with zeros to 8") {
    std::string r =
        EncodeOp(w, 3, 9, kOpFlagSync, {IntArg(ArgTag::kInt, -2)}, {});
    // 16 header + 12 fixed + 1 tag + 8 value = 37, padded to 40.
    REQUIRE(r.size() == 40);
    CHECK(Hex(r) ==
          "28000000"          // length 40
          "0200"              // kind kOp
          "0000"              // reserved
          "0300000000000000"  // sequence
          "09000000"          // op_id
          "0100"              // num_args
          "0000"              // num_outputs
          "01000000"          // flags: sync
          "03"                // tag kInt
          "feffffffffffffff"  // -2
          "000000");          // padding
  }
  SECTION("a tensor's layout") {
    w.Begin(RecordKind::kOp, 1);
    const size_t at = w.buffer().size();
    w.Tensor(MakeTensor({5, 6}, {6, 1}, kDoubleType, 2, 0x0102030405060708));
    CHECK(Hex(w.buffer().substr(at)) ==
          "0807060504030201"    // u64 address
          "0200000000000000"    // i64 storage_offset
          "07"                  // i8 dtype
          "02"                  // u8 ndim
          "000000000000"        // 6 pad
          "0500000000000000"    // sizes
          "0600000000000000"    //
          "0600000000000000"    // strides
          "0100000000000000");  //
  }
  SECTION("Begin starts over, so one writer serves record after record") {
    EncodeDefineOp(w, 1, 1, std::string(500, 's'));
    std::string second = EncodeEventRecord(w, 2, 4);
    CHECK(second.size() == 24);
    RecordHeader h = HeaderOf(second);
    CHECK(h.length == 24);
    CHECK(h.kind == static_cast<uint16_t>(RecordKind::kEventRecord));
    CHECK(h.sequence == 2);
    uint32_t slot = 0;
    CHECK(DecodeEventRecord(second, &slot).ok());
    CHECK(slot == 4);
  }
  SECTION("every record is a multiple of 8 long and says so") {
    for (size_t n = 0; n < 40; ++n) {
      std::string r = EncodeDefineOp(w, n, 0, std::string(n + 1, 'a'));
      INFO("schema of " << n + 1 << " bytes");
      CHECK(r.size() % kRecordAlignment == 0);
      CHECK(HeaderOf(r).length == r.size());
      CHECK(HeaderOf(r).sequence == n);
    }
  }
}

TEST_CASE("kOp round-trips every ArgTag") {
  RecordWriter w;
  DecodedOp op;
  for (bool long_string : {false, true}) {
    std::vector<OpArg> args = EveryTagArgs(long_string);
    REQUIRE(args.size() > static_cast<size_t>(ArgTag::kLast));
    std::vector<TensorRef> outputs = {MakeTensor({7}, {1}, kFloat, 0, 0xbeef00),
                                      MakeTensor({}, {}, kByte)};
    std::string r = EncodeOp(w, 77, 12345, kOpFlagSync, args, outputs);
    RecordHeader h = HeaderOf(r);
    CHECK(h.length == r.size());
    CHECK(h.kind == static_cast<uint16_t>(RecordKind::kOp));
    CHECK(h.sequence == 77);
    CHECK(CheckHeader(h, r.size()).ok());
    absl::Status s = DecodeOp(r, &op);
    INFO(s.ToString());
    REQUIRE(s.ok());
    CHECK(op.op_id == 12345);
    CHECK(op.flags == kOpFlagSync);
    REQUIRE(op.num_args == args.size());
    for (size_t i = 0; i < args.size(); ++i) {
      INFO("arg " << i << " tag " << static_cast<int>(args[i].tag));
      CHECK(SameArg(op.args[i], args[i]));
    }
    REQUIRE(op.outputs.size() == outputs.size());
    for (size_t i = 0; i < outputs.size(); ++i)
      CHECK(SameTensor(op.outputs[i], outputs[i]));
    CHECK(op.args[8].s.size() == (long_string ? kMaxStringBytes : 6));
    CHECK(op.args[23].tensors[0].ndim == kMaxDims);
    CHECK(op.args[25].tensor_present ==
          std::vector<bool>{false, true, false, true});
    CHECK(ReencodeOp(w, 77, op) == r);
  }
}

TEST_CASE("an argument decoded into a used slot keeps nothing of the last") {
  RecordWriter w;
  DecodedOp op;
  const std::vector<OpArg> every = EveryTagArgs(false);
  REQUIRE(DecodeOp(EncodeOp(w, 1, 2, 0, every, {}), &op).ok());
  const std::vector<OpArg> none(every.size(), Arg(ArgTag::kNone));
  REQUIRE(DecodeOp(EncodeOp(w, 2, 2, 0, none, {}), &op).ok());
  REQUIRE(op.num_args == every.size());
  for (size_t i = 0; i < op.num_args; ++i) {
    INFO("arg " << i << " was tag " << static_cast<int>(every[i].tag));
    const OpArg& a = op.args[i];
    CHECK(a.tag == ArgTag::kNone);
    CHECK(a.i == 0);
    CHECK(a.d == 0);
    CHECK(a.d_imag == 0);
    CHECK(!a.b);
    CHECK(a.s.empty());
    CHECK(a.ints.empty());
    CHECK(a.doubles.empty());
    CHECK(a.bools.empty());
    CHECK(a.tensors.empty());
    CHECK(a.tensor_present.empty());
  }
}

TEST_CASE("kOp limits: args, outputs and flags") {
  RecordWriter w;
  DecodedOp op;
  SECTION("kMaxArgs args and kMaxOutputs outputs decode") {
    std::vector<OpArg> args(kMaxArgs, IntArg(ArgTag::kInt, 1));
    std::vector<TensorRef> outputs(kMaxOutputs, MakeTensor({1}, {1}));
    REQUIRE(DecodeOp(EncodeOp(w, 1, 2, 0, args, outputs), &op).ok());
    CHECK(op.num_args == kMaxArgs);
    CHECK(op.outputs.size() == kMaxOutputs);
    CHECK(op.flags == 0);
  }
  SECTION("one arg too many") {
    std::vector<OpArg> args(kMaxArgs + 1, Arg(ArgTag::kNone));
    absl::Status s = DecodeOp(EncodeOp(w, 1, 2, 0, args, {}), &op);
    INFO(s.ToString());
    CHECK(CleanError(s));
    CHECK(absl::StrContains(s.message(), "num_args 257"));
    CHECK(op.num_args == 0);
  }
  SECTION("one output too many") {
    std::vector<TensorRef> outputs(kMaxOutputs + 1, MakeTensor({1}, {1}));
    absl::Status s = DecodeOp(EncodeOp(w, 1, 2, 0, {}, outputs), &op);
    INFO(s.ToString());
    CHECK(CleanError(s));
    CHECK(absl::StrContains(s.message(), "num_outputs 65"));
  }
  SECTION("unknown flags") {
    absl::Status s = DecodeOp(EncodeOp(w, 1, 2, 4, {}, {}), &op);
    INFO(s.ToString());
    CHECK(CleanError(s));
    CHECK(absl::StrContains(s.message(), "flags"));
  }
  SECTION("fewer args than before: num_args says which are valid") {
    REQUIRE(DecodeOp(EncodeOp(w, 1, 2, 0, EveryTagArgs(false), {}), &op).ok());
    REQUIRE(DecodeOp(EncodeOp(w, 2, 3, 0, {IntArg(ArgTag::kInt, 5)},
                              {MakeTensor({1}, {1})}),
                     &op)
                .ok());
    CHECK(op.num_args == 1);
    CHECK(op.op_id == 3);
    CHECK(op.args[0].tag == ArgTag::kInt);
    CHECK(op.args[0].i == 5);
    CHECK(op.outputs.size() == 1);
  }
}

TEST_CASE("kDefineOp round-trips and bounds its schema") {
  RecordWriter w;
  DecodedDefineOp def;
  const std::string schema =
      "aten::add.Tensor(Tensor self, Tensor other, *, Scalar alpha=1) -> "
      "Tensor";
  std::string r = EncodeDefineOp(w, 5, 42, schema);
  CHECK(HeaderOf(r).kind == static_cast<uint16_t>(RecordKind::kDefineOp));
  REQUIRE(DecodeDefineOp(r, &def).ok());
  CHECK(def.op_id == 42);
  CHECK(def.schema == schema);

  REQUIRE(DecodeDefineOp(
              EncodeDefineOp(w, 6, 1, std::string(kMaxSchemaBytes, 'z')), &def)
              .ok());
  CHECK(def.schema.size() == kMaxSchemaBytes);

  absl::Status too_long = DecodeDefineOp(
      EncodeDefineOp(w, 7, 1, std::string(kMaxSchemaBytes + 1, 'z')), &def);
  INFO(too_long.ToString());
  CHECK(CleanError(too_long));
  CHECK(absl::StrContains(too_long.message(), "schema_len 8193"));
  CHECK(absl::StrContains(too_long.message(), "at byte 20"));

  absl::Status empty = DecodeDefineOp(EncodeDefineOp(w, 8, 1, ""), &def);
  CHECK(CleanError(empty));

  w.Begin(RecordKind::kDefineOp, 9);
  w.U32(1);
  w.U32(0xffffffff);
  CHECK(CleanError(DecodeDefineOp(w.Finish(), &def)));
}

TEST_CASE("kCopy round-trips every kind and refuses others") {
  RecordWriter w;
  DecodedCopy copy;
  for (CopyKind kind : {CopyKind::kHostToDevice, CopyKind::kDeviceToHost,
                        CopyKind::kDeviceToDevice}) {
    std::string r = EncodeCopy(w, 11, static_cast<uint8_t>(kind), 0x1000,
                               0xffff000000000000, 1u << 30);
    CHECK(r.size() == 48);
    REQUIRE(DecodeCopy(r, &copy).ok());
    CHECK(copy.kind == kind);
    CHECK(copy.src == 0x1000);
    CHECK(copy.dst == 0xffff000000000000);
    CHECK(copy.bytes == (1u << 30));
  }
  for (int kind : {0, 4, 255}) {
    absl::Status s = DecodeCopy(EncodeCopy(w, 1, kind, 0, 0, 0), &copy);
    INFO(s.ToString());
    CHECK(CleanError(s));
    CHECK(absl::StrContains(s.message(), absl::StrCat("copy kind ", kind)));
  }
  std::string r = EncodeCopy(w, 1, 1, 0, 0, 8);
  r[19] = 1;  // padding
  absl::Status s = DecodeCopy(r, &copy);
  CHECK(CleanError(s));
  CHECK(absl::StrContains(s.message(), "at byte 19"));
}

TEST_CASE("event records round-trip") {
  RecordWriter w;
  uint32_t slot = 0;
  DecodedEventWait wait;
  std::string rec = EncodeEventRecord(w, 100, 0xfffffffe);
  CHECK(HeaderOf(rec).sequence == 100);
  REQUIRE(DecodeEventRecord(rec, &slot).ok());
  CHECK(slot == 0xfffffffe);
  rec[22] = 9;  // padding
  CHECK(CleanError(DecodeEventRecord(rec, &slot)));

  std::string wt = EncodeEventWait(w, 101, 3, 2, 999);
  CHECK(HeaderOf(wt).sequence == 101);
  REQUIRE(DecodeEventWait(wt, &wait).ok());
  CHECK(wait.event_slot == 3);
  CHECK(wait.stream == 2);
  CHECK(wait.sequence == 999);
}

TEST_CASE("CheckHeader") {
  auto header = [](uint32_t length, uint16_t kind) {
    RecordHeader h{};
    h.length = length;
    h.kind = kind;
    h.sequence = 31;
    return h;
  };
  for (uint16_t kind = 0; kind <= 5; ++kind) {
    CHECK(CheckHeader(header(16, kind), 16).ok());
    CHECK(CheckHeader(header(4096, kind), 1 << 20).ok());
  }
  struct Bad {
    RecordHeader h;
    size_t available;
    const char* mentions;
  };
  const Bad bad[] = {
      {header(0, 2), 64, "length 0"},
      {header(8, 2), 64, "length 8"},
      {header(15, 2), 64, "length 15"},
      {header(20, 2), 64, "length 20"},
      {header(33, 2), 64, "length 33"},
      {header(72, 2), 64, "72"},
      {header(16, 2), 8, "8 bytes available"},
      {header(0xfffffff8, 2), 1 << 20, "4294967288"},
      {header(16, 8), 64, "kind 8"},
      {header(16, 0xffff), 64, "kind 65535"},
  };
  for (const Bad& b : bad) {
    absl::Status s = CheckHeader(b.h, b.available);
    INFO(s.ToString());
    CHECK(CleanError(s));
    CHECK(absl::StrContains(s.message(), b.mentions));
  }
}

TEST_CASE(
    "a program run record round-trips; bad counts and cut records are "
    "refused") {
  RecordWriter w;
  w.Begin(RecordKind::kRunProgram, 9);
  w.U32(5);  // program id
  w.U32(2);  // bindings
  w.U64(4096);
  w.U64(800);
  w.U64(77);
  for (uint64_t i = 0; i < 2; ++i) {
    w.U64(0x1000 * (i + 1));
    w.U64(256);
    w.U64(0x9000 * (i + 1));
  }
  const std::string good(w.Finish());
  DecodedRunProgram run;
  REQUIRE(DecodeRunProgram(good, &run).ok());
  CHECK(run.program_id == 5);
  CHECK(run.offset == 4096);
  CHECK(run.bytes == 800);
  CHECK(run.seed == 77);
  REQUIRE(run.bindings.size() == 2);
  CHECK(run.bindings[1].from == 0x2000);
  CHECK(run.bindings[1].to == 0x12000);
  // A count that claims more bindings than the record holds.
  std::string more = good;
  const uint32_t three = 3;
  std::memcpy(&more[sizeof(RecordHeader) + 4], &three, 4);
  absl::Status s = DecodeRunProgram(more, &run);
  CHECK(CleanError(s));
  // Absurd counts are refused before anything is sized by them.
  const uint32_t absurd = 0xffffffffu;
  std::memcpy(&more[sizeof(RecordHeader) + 4], &absurd, 4);
  s = DecodeRunProgram(more, &run);
  CHECK(CleanError(s));
  CHECK(absl::StrContains(s.message(), "num_bindings"));
  // Distinct seeds per random op, and never the run's seed itself.
  CHECK(MixSeed(77, 0) != MixSeed(77, 1));
  CHECK(MixSeed(77, 0) != 77);
}

TEST_CASE("decoders refuse records of another kind") {
  RecordWriter w;
  w.Begin(RecordKind::kPad, 6);
  std::vector<std::string> records = {
      std::string(w.Finish()),
      EncodeDefineOp(w, 1, 1, "aten::relu(Tensor self) -> Tensor"),
      EncodeOp(w, 2, 1, 0, {TensorArg(MakeTensor({2}, {1}))}, {}),
      EncodeCopy(w, 3, 1, 0, 0, 0),
      EncodeEventRecord(w, 4, 0),
      EncodeEventWait(w, 5, 0, 0, 0),
  };
  Decoders d;
  for (size_t kind = 0; kind < records.size(); ++kind) {
    INFO("record kind " << kind);
    CHECK(HeaderOf(records[kind]).kind == kind);
    CHECK(CheckHeader(HeaderOf(records[kind]), records[kind].size()).ok());
    CHECK(d.Run(records[kind]) == "");
    CHECK(d.num_ok == (kind == 0 ? 0 : 1));
  }
  DecodedOp op;
  absl::Status s = DecodeOp(records[3], &op);
  INFO(s.ToString());
  CHECK(absl::StrContains(s.message(), "expected a kOp record"));
  CHECK(absl::StrContains(s.message(), "kCopy"));
}

TEST_CASE("decoders reject malformed bodies with what and where") {
  RecordWriter w;
  DecodedOp op;
  auto decode = [&](const std::string& r) { return DecodeOp(r, &op); };
  SECTION("unknown tags") {
    for (int tag = static_cast<int>(ArgTag::kLast) + 1; tag <= 255; ++tag) {
      w.Begin(RecordKind::kOp, 1);
      w.U32(0);
      w.U16(1);
      w.U16(0);
      w.U32(0);
      w.U8(static_cast<uint8_t>(tag));
      w.Pad(16);  // payload room, so only the tag can be wrong
      absl::Status s = decode(std::string(w.Finish()));
      INFO(s.ToString());
      CHECK(CleanError(s));
      CHECK(absl::StrContains(s.message(),
                              absl::StrCat("unknown arg tag ", tag)));
      CHECK(absl::StrContains(s.message(), "at byte 28"));
    }
  }
  SECTION("bools must be 0 or 1") {
    std::string r = EncodeOp(w, 1, 0, 0, {BoolArg(ArgTag::kBool, true)}, {});
    r[29] = 2;
    CHECK(CleanError(decode(r)));
    OpArg bools = Arg(ArgTag::kBoolList);
    bools.bools = {false, true};
    r = EncodeOp(w, 1, 0, 0, {bools}, {});
    r[34] = 7;
    absl::Status s = decode(r);
    INFO(s.ToString());
    CHECK(CleanError(s));
    CHECK(absl::StrContains(s.message(), "at byte 34"));
    OpArg optional = Arg(ArgTag::kOptionalTensorList);
    optional.tensors = {TensorRef()};
    optional.tensor_present = {false};
    r = EncodeOp(w, 1, 0, 0, {optional}, {});
    r[33] = 3;
    CHECK(CleanError(decode(r)));
  }
  SECTION("strings and tensors beyond their limits") {
    OpArg s = Arg(ArgTag::kString);
    s.s = std::string(kMaxStringBytes + 1, 'q');
    CHECK(CleanError(decode(EncodeOp(w, 1, 0, 0, {s}, {}))));

    TensorRef t = MakeTensor({1}, {1});
    t.ndim = kMaxDims + 1;  // the writer writes the byte, never reads past
    absl::Status st = decode(EncodeOp(w, 1, 0, 0, {TensorArg(t)}, {}));
    INFO(st.ToString());
    CHECK(CleanError(st));
    CHECK(absl::StrContains(st.message(), "ndim 65"));

    for (int dtype : {12, 13, 14, 16, 17, 22, 30, -1, 127}) {
      t = MakeTensor({1}, {1}, static_cast<int8_t>(dtype));
      st = decode(EncodeOp(w, 1, 0, 0, {}, {t}));
      INFO(st.ToString());
      CHECK(CleanError(st));
      CHECK(absl::StrContains(st.message(), absl::StrCat("dtype ", dtype)));
      CHECK(absl::StrContains(st.message(), "output 0"));
    }

    std::string r = EncodeOp(w, 1, 0, 0, {TensorArg(MakeTensor({1}, {1}))}, {});
    r[29 + 20] = 1;  // tensor padding
    CHECK(CleanError(decode(r)));
  }
  SECTION("trailing data and padding") {
    std::string r = EncodeOp(w, 1, 0, 0, {BoolArg(ArgTag::kBool, true)}, {});
    REQUIRE(r.size() == 32);  // 30 bytes of record, 2 of padding
    std::string bad_pad = r;
    bad_pad[31] = 1;
    CHECK(CleanError(decode(bad_pad)));
    std::string longer = r + std::string(8, '\0');
    SetLength(&longer, 40);
    absl::Status s = decode(longer);
    INFO(s.ToString());
    CHECK(CleanError(s));
    CHECK(absl::StrContains(s.message(), "trailing"));
    // A view longer than header.length: the decoder reads header.length.
    std::string view = r + "garbage!";
    CHECK(decode(view).ok());
  }
  SECTION("huge counts fail without allocating for them") {
    struct Case {
      ArgTag tag;
      uint32_t n;
    };
    const Case cases[] = {
        {ArgTag::kString, 0xffffffff},
        {ArgTag::kIntList, 0xffffffff},
        {ArgTag::kDoubleList, 0xffffffff},
        {ArgTag::kBoolList, 0xffffffff},
        {ArgTag::kTensorList, 0xffffffff},
        {ArgTag::kOptionalTensorList, 0xffffffff},
        {ArgTag::kString, kMaxStringBytes},
        {ArgTag::kIntList, kMaxListLength},
        {ArgTag::kDoubleList, kMaxListLength},
        {ArgTag::kBoolList, kMaxListLength},
        {ArgTag::kTensorList, kMaxListLength},
        {ArgTag::kOptionalTensorList, kMaxListLength},
    };
    for (const Case& c : cases) {
      INFO("tag " << static_cast<int>(c.tag) << " n " << c.n);
      w.Begin(RecordKind::kOp, 1);
      w.U32(0);
      w.U16(1);
      w.U16(0);
      w.U32(0);
      w.U8(static_cast<uint8_t>(c.tag));
      w.U32(c.n);
      std::string r(w.Finish());
      DecodedOp fresh;
      const uint64_t bytes_before = g_new_bytes.load();
      absl::Status s = DecodeOp(r, &fresh);
      const uint64_t allocated = g_new_bytes.load() - bytes_before;
      INFO(s.ToString());
      CHECK(CleanError(s));
      CHECK(allocated < 8192);  // an OpArg and the message, no list
      if (c.n == 0xffffffff)
        CHECK(absl::StrContains(s.message(), "4294967295"));
    }
    w.Begin(RecordKind::kOp, 1);
    w.U32(0);
    w.U16(kMaxArgs);  // within the limit, but the record is empty
    w.U16(kMaxOutputs);
    w.U32(0);
    std::string r(w.Finish());
    DecodedOp fresh;
    const uint64_t bytes_before = g_new_bytes.load();
    CHECK(CleanError(DecodeOp(r, &fresh)));
    CHECK(g_new_bytes.load() - bytes_before < 4096);
    w.Begin(RecordKind::kOp, 1);
    w.U32(0);
    w.U16(0xffff);
    w.U16(0xffff);
    w.U32(0);
    CHECK(CleanError(decode(std::string(w.Finish()))));
  }
}

TEST_CASE("truncating a kOp record anywhere is an error, never a crash") {
  RecordWriter w;
  const std::string full =
      EncodeOp(w, 9, 3, kOpFlagSync, EveryTagArgs(false),
               {MakeTensor({3, 4}, {4, 1}), MakeTensor({}, {})});
  const size_t length = full.size();
  Decoders d;
  for (size_t n = 0; n < length; ++n) {
    // The header still claims the full length.
    std::string claims_more = full.substr(0, n);
    std::string result = d.Run(claims_more);
    if (!result.empty() || d.num_ok != 0) {
      INFO("cut to " << n << " of " << length << ": " << result);
      REQUIRE(result.empty());
      REQUIRE(d.num_ok == 0);
    }
    if (n < sizeof(RecordHeader)) continue;
    // The header claims exactly what is there, aligned or not.
    for (size_t cut : {n, n & ~size_t{7}}) {
      if (cut < sizeof(RecordHeader)) continue;
      std::string shortened = full.substr(0, cut);
      SetLength(&shortened, static_cast<uint32_t>(cut));
      result = d.Run(shortened);
      if (!result.empty() || d.num_ok != 0) {
        INFO("cut to " << cut << " of " << length << ": " << result);
        REQUIRE(result.empty());
        REQUIRE(d.num_ok == 0);
      }
    }
  }
  REQUIRE(d.Run(full).empty());
  CHECK(d.num_ok == 1);
}

TEST_CASE("flipping any byte either decodes or fails cleanly") {
  RecordWriter w;
  OpArg bools = Arg(ArgTag::kBoolList);
  bools.bools = {true, false};
  OpArg optional = Arg(ArgTag::kOptionalTensorList);
  optional.tensors = {TensorRef(), MakeTensor({2}, {1})};
  optional.tensor_present = {false, true};
  OpArg str = Arg(ArgTag::kString);
  str.s = "mean";
  OpArg ints = Arg(ArgTag::kIntList);
  ints.ints = {1, 2};
  std::vector<OpArg> args = {TensorArg(MakeTensor({2, 3}, {3, 1})),
                             IntArg(ArgTag::kInt, 1),
                             bools,
                             str,
                             ints,
                             optional,
                             IntArg(ArgTag::kDevice, 1),
                             BoolArg(ArgTag::kBool, false)};
  const std::string records[] = {
      EncodeOp(w, 1, 2, 0, args, {MakeTensor({2, 3}, {3, 1})}),
      EncodeDefineOp(w, 2, 3, "aten::mean(Tensor self) -> Tensor"),
      EncodeCopy(w, 3, 2, 64, 128, 256),
      EncodeEventRecord(w, 4, 1),
      EncodeEventWait(w, 5, 1, 2, 3),
  };
  Decoders d;
  DecodedOp op;
  size_t accepted = 0, rejected = 0;
  auto try_record = [&](const std::string& r, size_t pos, int value) {
    std::string result = d.Run(r);
    if (!result.empty()) {
      INFO("byte " << pos << " set to " << value << ": " << result);
      REQUIRE(result.empty());
    }
    (d.num_ok > 0 ? accepted : rejected)++;
  };
  for (const std::string& original : records) {
    std::string r = original;
    // Every position with a few values.
    for (size_t pos = 0; pos < r.size(); ++pos) {
      for (int value : {r[pos] ^ 0x01, r[pos] ^ 0x80, 0x00, 0xff, 0x02}) {
        const char saved = r[pos];
        r[pos] = static_cast<char>(value);
        try_record(r, pos, value);
        r[pos] = saved;
      }
    }
    // All 256 values in the header, the fixed body fields and the first
    // bytes of the first arg (tag, tensor address/offset/dtype/ndim).
    for (size_t pos = 0; pos < r.size() && pos < 64; ++pos) {
      for (int value = 0; value < 256; ++value) {
        const char saved = r[pos];
        r[pos] = static_cast<char>(value);
        try_record(r, pos, value);
        r[pos] = saved;
      }
    }
    REQUIRE(r == original);
  }
  CHECK(accepted > 0);
  CHECK(rejected > 0);
}

// ------------------------------------------------------------ randomized

class RandomRecords {
 public:
  explicit RandomRecords(uint64_t seed) : rng_(seed) {}

  uint64_t U64() { return rng_(); }
  uint64_t Below(uint64_t n) { return rng_() % n; }
  bool Coin() { return (rng_() & 1) != 0; }

  double AnyDouble() {
    uint64_t bits = rng_();
    double d;
    std::memcpy(&d, &bits, 8);
    return d;
  }

  TensorRef AnyTensor() {
    // Every dtype the wire carries.
    static constexpr DType kDtypes[] = {
        DType::kUInt8,          DType::kInt8,           DType::kInt16,
        DType::kInt32,          DType::kInt64,          DType::kHalf,
        DType::kFloat,          DType::kDouble,         DType::kComplexHalf,
        DType::kComplexFloat,   DType::kComplexDouble,  DType::kBool,
        DType::kBFloat16,       DType::kFloat8E5M2,     DType::kFloat8E4M3FN,
        DType::kFloat8E5M2FNUZ, DType::kFloat8E4M3FNUZ, DType::kUInt16,
        DType::kUInt32,         DType::kUInt64};
    TensorRef t;
    t.address = rng_();
    t.storage_offset = static_cast<int64_t>(rng_());
    t.dtype = Code(kDtypes[Below(sizeof(kDtypes) / sizeof(kDtypes[0]))]);
    t.ndim =
        static_cast<uint8_t>(Below(8) == 0 ? Below(kMaxDims + 1) : Below(5));
    for (int d = 0; d < t.ndim; ++d) {
      t.sizes[d] = static_cast<int64_t>(rng_());
      t.strides[d] = static_cast<int64_t>(rng_());
    }
    return t;
  }

  void AnyArg(OpArg* a) {
    *a = OpArg();
    a->tag = static_cast<ArgTag>(Below(static_cast<int>(ArgTag::kLast) + 1));
    switch (a->tag) {
      case ArgTag::kNone:
      case ArgTag::kUndefinedTensor:
        break;
      case ArgTag::kScalarTensor:
        // Integral dtypes travel as i64; compare those bit for bit.
        a->dtype = Below(2) == 0 ? 4 : 3;
        a->b = Below(2) == 0;
        a->i = static_cast<int64_t>(U64());
        a->d_imag = 0.5;
        break;
      case ArgTag::kTensor:
        a->tensor = AnyTensor();
        break;
      case ArgTag::kInt:
      case ArgTag::kSymInt:
      case ArgTag::kScalarInt:
      case ArgTag::kGenerator:
        a->i = static_cast<int64_t>(rng_());
        break;
      case ArgTag::kDouble:
      case ArgTag::kScalarDouble:
        a->d = AnyDouble();
        break;
      case ArgTag::kBool:
      case ArgTag::kScalarBool:
        a->b = Coin();
        break;
      case ArgTag::kComplex:
      case ArgTag::kScalarComplex:
        a->d = AnyDouble();
        a->d_imag = AnyDouble();
        break;
      case ArgTag::kString:
        a->s.resize(Below(50) == 0 ? Below(kMaxStringBytes + 1) : Below(24));
        for (char& c : a->s) c = static_cast<char>(rng_());
        break;
      case ArgTag::kIntList:
        a->ints.resize(Below(9));
        for (int64_t& v : a->ints) v = static_cast<int64_t>(rng_());
        break;
      case ArgTag::kDoubleList:
        a->doubles.resize(Below(9));
        for (double& v : a->doubles) v = AnyDouble();
        break;
      case ArgTag::kBoolList:
        a->bools.resize(Below(9));
        for (size_t j = 0; j < a->bools.size(); ++j) a->bools[j] = Coin();
        break;
      case ArgTag::kDtype:
      case ArgTag::kLayout:
      case ArgTag::kMemoryFormat:
        a->i = static_cast<int8_t>(rng_());
        break;
      case ArgTag::kDevice:
        a->i = static_cast<int8_t>(rng_());
        a->device_index = static_cast<int8_t>(rng_());
        break;
      case ArgTag::kTensorList:
        a->tensors.resize(Below(4));
        for (TensorRef& t : a->tensors) t = AnyTensor();
        break;
      case ArgTag::kOptionalTensorList:
        a->tensors.resize(Below(4));
        a->tensor_present.resize(a->tensors.size());
        for (size_t j = 0; j < a->tensors.size(); ++j) {
          a->tensor_present[j] = Coin();
          if (a->tensor_present[j]) a->tensors[j] = AnyTensor();
        }
        break;
    }
  }

  std::mt19937_64& rng() { return rng_; }

 private:
  std::mt19937_64 rng_;
};

TEST_CASE("random bytes never crash a decoder and every error has a message") {
  RandomRecords random(0x5eed0001);
  Decoders d;
  std::string bytes;
  int plausible_accepted = 0;
  for (int iteration = 0; iteration < 100000; ++iteration) {
    size_t length = 16 + random.Below(512 - 16 + 1);
    const bool plausible = random.Coin();
    if (plausible) length &= ~size_t{7};
    bytes.resize(length);
    for (size_t i = 0; i < length; i += 8) {
      const uint64_t v = random.U64();
      std::memcpy(&bytes[i], &v, std::min<size_t>(8, length - i));
    }
    if (plausible) {
      RecordHeader h{};
      h.length = static_cast<uint32_t>(length);
      h.kind = static_cast<uint16_t>(random.Below(9));
      h.sequence = random.U64();
      std::memcpy(&bytes[0], &h, sizeof(h));
      if (h.kind == static_cast<uint16_t>(RecordKind::kOp) && length >= 32 &&
          random.Coin()) {
        // Small counts and valid flags, so decoding gets into the args.
        const uint16_t num_args = static_cast<uint16_t>(random.Below(6));
        const uint16_t num_outputs = static_cast<uint16_t>(random.Below(3));
        const uint32_t flags = static_cast<uint32_t>(random.Below(2));
        std::memcpy(&bytes[20], &num_args, 2);
        std::memcpy(&bytes[22], &num_outputs, 2);
        std::memcpy(&bytes[24], &flags, 4);
        bytes[28] = static_cast<char>(random.Below(22));
      }
    }
    std::string result = d.Run(bytes);
    if (!result.empty()) {
      INFO("iteration " << iteration << " bytes " << Hex(bytes) << ": "
                        << result);
      REQUIRE(result.empty());
    }
    if (plausible && d.num_ok > 0) ++plausible_accepted;
  }
  // Random event records (any slot) and some copies do decode.
  CHECK(plausible_accepted > 0);
}

TEST_CASE(
    "random valid records round-trip exactly; mutated ones fail cleanly") {
  RandomRecords random(0x5eed0002);
  RecordWriter w, w2;
  Decoders d;
  DecodedOp op;
  DecodedDefineOp def;
  DecodedCopy copy;
  DecodedEventWait wait;
  uint32_t slot;
  std::vector<OpArg> args(12);
  std::vector<TensorRef> outputs;
  std::string record, mutated;
  int mutated_accepted = 0;
  for (int iteration = 0; iteration < 100000; ++iteration) {
    const uint64_t sequence = random.U64();
    const uint64_t kind_roll = random.Below(10);
    std::string reencoded;
    absl::Status s;
    if (kind_roll < 7) {
      const size_t num_args = random.Below(random.Below(10) == 0 ? 13 : 6);
      for (size_t i = 0; i < num_args; ++i) random.AnyArg(&args[i]);
      outputs.resize(random.Below(4));
      for (TensorRef& t : outputs) t = random.AnyTensor();
      const uint32_t op_id = static_cast<uint32_t>(random.U64());
      const uint32_t flags = static_cast<uint32_t>(random.Below(2));
      std::vector<OpArg> used(args.begin(), args.begin() + num_args);
      record = EncodeOp(w, sequence, op_id, flags, used, outputs);
      s = DecodeOp(record, &op);
      bool same = s.ok() && op.op_id == op_id && op.flags == flags &&
                  op.num_args == num_args &&
                  op.outputs.size() == outputs.size();
      for (size_t i = 0; same && i < num_args; ++i)
        same = SameArg(op.args[i], args[i]);
      for (size_t i = 0; same && i < outputs.size(); ++i) {
        same = SameTensor(op.outputs[i], outputs[i]);
      }
      if (!same) {
        INFO("iteration " << iteration << ": " << s.ToString() << " record "
                          << Hex(record));
        REQUIRE(same);
      }
      reencoded = ReencodeOp(w2, sequence, op);
    } else if (kind_roll == 7) {
      std::string schema(1 + random.Below(100), 'a');
      for (char& c : schema) c = static_cast<char>(random.U64());
      const uint32_t op_id = static_cast<uint32_t>(random.U64());
      record = EncodeDefineOp(w, sequence, op_id, schema);
      s = DecodeDefineOp(record, &def);
      REQUIRE(s.ok());
      REQUIRE(def.op_id == op_id);
      REQUIRE(def.schema == schema);
      reencoded = EncodeDefineOp(w2, sequence, def.op_id, def.schema);
    } else if (kind_roll == 8) {
      const uint8_t kind = static_cast<uint8_t>(1 + random.Below(3));
      const uint64_t src = random.U64(), dst = random.U64(),
                     bytes = random.U64();
      record = EncodeCopy(w, sequence, kind, src, dst, bytes);
      s = DecodeCopy(record, &copy);
      REQUIRE(s.ok());
      REQUIRE(static_cast<uint8_t>(copy.kind) == kind);
      REQUIRE(copy.src == src);
      REQUIRE(copy.dst == dst);
      REQUIRE(copy.bytes == bytes);
      reencoded =
          EncodeCopy(w2, sequence, kind, copy.src, copy.dst, copy.bytes);
    } else if (random.Coin()) {
      const uint32_t event = static_cast<uint32_t>(random.U64());
      record = EncodeEventRecord(w, sequence, event);
      s = DecodeEventRecord(record, &slot);
      REQUIRE(s.ok());
      REQUIRE(slot == event);
      reencoded = EncodeEventRecord(w2, sequence, slot);
    } else {
      const uint32_t event = static_cast<uint32_t>(random.U64());
      const uint32_t stream = static_cast<uint32_t>(random.U64());
      const uint64_t seq = random.U64();
      record = EncodeEventWait(w, sequence, event, stream, seq);
      s = DecodeEventWait(record, &wait);
      REQUIRE(s.ok());
      REQUIRE(wait.event_slot == event);
      REQUIRE(wait.stream == stream);
      REQUIRE(wait.sequence == seq);
      reencoded = EncodeEventWait(w2, sequence, wait.event_slot, wait.stream,
                                  wait.sequence);
    }
    if (reencoded != record) {
      INFO("iteration " << iteration << " re-encoding differs: " << Hex(record)
                        << " vs " << Hex(reencoded));
      REQUIRE(reencoded == record);
    }
    CHECK(HeaderOf(record).sequence == sequence);

    // Mutate: a few random bytes, sometimes a cut.
    mutated = record;
    const int flips = 1 + static_cast<int>(random.Below(3));
    for (int f = 0; f < flips; ++f) {
      mutated[random.Below(mutated.size())] = static_cast<char>(random.U64());
    }
    if (random.Below(4) == 0) mutated.resize(random.Below(mutated.size()));
    std::string result = d.Run(mutated);
    if (!result.empty()) {
      INFO("iteration " << iteration << " mutated " << Hex(mutated) << ": "
                        << result);
      REQUIRE(result.empty());
    }
    if (d.num_ok > 0) ++mutated_accepted;
  }
  CHECK(mutated_accepted > 0);
}

TEST_CASE("steady-state encoding and decoding allocate nothing") {
  RecordWriter w;
  DecodedOp op;
  std::vector<OpArg> args = {
      TensorArg(MakeTensor({64, 128}, {128, 1})),
      TensorArg(MakeTensor({128}, {1}, kFloat, 0, 0x2000)),
      DoubleArg(ArgTag::kScalarDouble, 1.0),
      IntArg(ArgTag::kDtype, kFloat),
  };
  OpArg dims = Arg(ArgTag::kIntList);
  dims.ints = {0, 1};
  args.push_back(dims);
  const std::vector<TensorRef> outputs = {MakeTensor({64, 128}, {128, 1})};
  // Warm up: buffers reach their working sizes.
  for (int i = 0; i < 3; ++i) {
    w.Begin(RecordKind::kOp, i);
    w.U32(1);
    w.U16(static_cast<uint16_t>(args.size()));
    w.U16(1);
    w.U32(0);
    for (const OpArg& a : args) w.Arg(a);
    w.Tensor(outputs[0]);
    REQUIRE(DecodeOp(w.Finish(), &op).ok());
  }
  // The counter sees allocations at all (so a 0 below means something).
  uint64_t calls_before = g_new_calls.load();
  std::vector<int64_t>* probe = new std::vector<int64_t>(100);
  delete probe;
  REQUIRE(g_new_calls.load() - calls_before == 2);

  calls_before = g_new_calls.load();
  bool all_ok = true;
  for (int i = 0; i < 10000; ++i) {
    w.Begin(RecordKind::kOp, 3 + i);
    w.U32(1);
    w.U16(static_cast<uint16_t>(args.size()));
    w.U16(1);
    w.U32(kOpFlagSync);
    for (const OpArg& a : args) w.Arg(a);
    w.Tensor(outputs[0]);
    all_ok = DecodeOp(w.Finish(), &op).ok() && all_ok;
  }
  const uint64_t calls = g_new_calls.load() - calls_before;
  CHECK(all_ok);
  CHECK(calls == 0);
}

TEST_CASE("TensorFootprint") {
  auto footprint = [](const TensorRef& t) {
    absl::StatusOr<Footprint> fp = TensorFootprint(t);
    INFO(fp.status().ToString());
    REQUIRE(fp.ok());
    return std::make_pair(fp->begin, fp->end);
  };
  auto refused = [](const TensorRef& t, const char* mentions) {
    absl::StatusOr<Footprint> fp = TensorFootprint(t);
    INFO(fp.status().ToString());
    REQUIRE_FALSE(fp.ok());
    CHECK(CleanError(fp.status()));
    CHECK(absl::StrContains(fp.status().message(), mentions));
  };
  using P = std::pair<uint64_t, uint64_t>;
  constexpr int64_t k62 = int64_t{1} << 62;
  constexpr int64_t kMax = std::numeric_limits<int64_t>::max();

  SECTION("dense and strided layouts") {
    CHECK(footprint(MakeTensor({2, 3}, {3, 1})) == P(0, 24));
    CHECK(footprint(MakeTensor({2, 3}, {6, 2})) == P(0, 44));     // every other
    CHECK(footprint(MakeTensor({3, 2}, {1, 3})) == P(0, 24));     // transposed
    CHECK(footprint(MakeTensor({1000, 3}, {0, 1})) == P(0, 12));  // expanded
    CHECK(footprint(MakeTensor({4}, {1}, kDoubleType, 5)) == P(40, 72));
    CHECK(footprint(MakeTensor({}, {}, kFloat, 7)) == P(28, 32));  // 0-dim
    CHECK(footprint(MakeTensor({2}, {1}, kComplexDouble)) == P(0, 32));
    CHECK(footprint(MakeTensor({1, 1}, {kMax, kMax}, kFloat)) == P(0, 4));
    // The most dimensions: 25 of size 2 (strides 1, 2, 4, ...), the rest 1.
    std::vector<int64_t> sizes(kMaxDims, 1), strides(kMaxDims, 1);
    for (int d = 0; d < 25; ++d) {
      sizes[d] = 2;
      strides[d] = int64_t{1} << d;
    }
    CHECK(footprint(MakeTensor(sizes, strides, kByte)) == P(0, 1 << 25));
  }
  SECTION("empty tensors touch nothing, whatever their other dims") {
    CHECK(footprint(MakeTensor({0, 5}, {5, 1}, kFloat, 100)) == P(0, 0));
    CHECK(footprint(MakeTensor({k62, 0}, {k62, k62})) == P(0, 0));
  }
  SECTION("the largest byte offset that fits") {
    // Last element at 2^64 - 2, so one past it is 2^64 - 1.
    CHECK(footprint(MakeTensor({2}, {kMax}, kByte, kMax)) ==
          P(static_cast<uint64_t>(kMax), std::numeric_limits<uint64_t>::max()));
  }
  SECTION("overflow") {
    refused(MakeTensor({k62}, {k62}), "overflow");
    refused(MakeTensor({(int64_t{1} << 32) + 1, (int64_t{1} << 32) + 1},
                       {int64_t{1} << 31, int64_t{1} << 31}, kByte),
            "overflow");
    refused(MakeTensor({2, 2}, {kMax, 1}, kByte, kMax), "overflow");  // +1
    refused(MakeTensor({1}, {1}, kDoubleType, k62), "overflow");      // begin
    refused(MakeTensor({2}, {kMax}, kFloat, kMax), "overflow");       // end
  }
  SECTION("negative and unknown values") {
    refused(MakeTensor({2}, {1}, kFloat, -1), "storage_offset");
    refused(MakeTensor({2, -1}, {1, 1}), "size of dim 1");
    refused(MakeTensor({2, 3}, {-3, 1}), "stride of dim 0");
    refused(MakeTensor({0, 3}, {-3, 1}), "stride");  // negative beats empty
    refused(MakeTensor({2}, {1}, 12), "dtype 12");
    refused(MakeTensor({2}, {1}, -5), "dtype -5");
    TensorRef t = MakeTensor({2}, {1});
    t.ndim = kMaxDims + 1;
    refused(t, "ndim 65");
  }
}

}  // namespace
}  // namespace tpu

TEST_CASE("kCollective round trip and malformed groups") {
  using tpu::CollectiveEntry;
  using tpu::CollectiveKind;
  std::vector<CollectiveEntry> ops(2);
  ops[0].kind = CollectiveKind::kAllToAll;
  ops[0].dtype = Code(tpu::DType::kFloat);
  ops[0].send = 0x1000;
  ops[0].recv = 0x2000;
  ops[0].send_counts = {1, 2, 3};
  ops[0].recv_counts = {3, 2, 1};
  ops[1].kind = CollectiveKind::kAllReduce;
  ops[1].reduce = tpu::ReduceOp::kMax;
  ops[1].dtype = Code(tpu::DType::kBFloat16);
  ops[1].count = 77;
  auto build = [](const std::vector<CollectiveEntry>& es, uint64_t index) {
    tpu::RecordWriter w;
    w.Begin(tpu::RecordKind::kCollective, 9);
    tpu::WriteCollective(w, 0xabc, index, es.data(), es.size());
    return std::string(w.Finish());
  };
  const std::string rec = build(ops, 5);
  tpu::DecodedCollective d;
  REQUIRE(tpu::DecodeCollective(rec, &d).ok());
  CHECK(d.communicator == 0xabc);
  CHECK(d.index == 5);
  REQUIRE(d.ops.size() == 2);
  CHECK(d.ops[0].send_counts == std::vector<int64_t>{1, 2, 3});
  CHECK(d.ops[0].recv_counts == std::vector<int64_t>{3, 2, 1});
  CHECK(d.ops[1].count == 77);
  CHECK(d.ops[1].reduce == tpu::ReduceOp::kMax);

  SECTION("every truncation is refused") {
    for (size_t n = 0; n < rec.size(); n += 8) {
      std::string cut = rec.substr(0, n);
      if (cut.size() >= sizeof(tpu::RecordHeader)) {
        const uint32_t len = static_cast<uint32_t>(cut.size());
        std::memcpy(&cut[0], &len, 4);
      }
      CHECK(!tpu::DecodeCollective(cut, &d).ok());
    }
  }
  SECTION("bad kinds, ops, dtypes, splits and empty groups") {
    std::vector<CollectiveEntry> bad = ops;
    bad[1].kind = static_cast<CollectiveKind>(99);
    CHECK(absl::StrContains(tpu::DecodeCollective(build(bad, 1), &d).message(),
                            "unknown collective kind"));
    bad = ops;
    bad[1].reduce = static_cast<tpu::ReduceOp>(9);
    CHECK(!tpu::DecodeCollective(build(bad, 1), &d).ok());
    bad[1].reduce = static_cast<tpu::ReduceOp>(8);  // PREMUL_SUM: the client's
    CHECK(absl::StrContains(tpu::DecodeCollective(build(bad, 1), &d).message(),
                            "unknown reduce op 8"));
    bad[1].reduce = tpu::ReduceOp::kBxor;  // the last one
    REQUIRE(tpu::DecodeCollective(build(bad, 1), &d).ok());
    CHECK(d.ops[1].reduce == tpu::ReduceOp::kBxor);
    bad = ops;
    bad[1].dtype = 13;  // quantized
    CHECK(absl::StrContains(tpu::DecodeCollective(build(bad, 1), &d).message(),
                            "dtype"));
    bad = ops;
    bad[1].send_counts = {1};
    bad[1].recv_counts = {1};
    CHECK(absl::StrContains(tpu::DecodeCollective(build(bad, 1), &d).message(),
                            "only all_to_all has splits"));
    bad = ops;
    bad[0].send_counts[1] = -4;
    CHECK(absl::StrContains(tpu::DecodeCollective(build(bad, 1), &d).message(),
                            "negative"));
    CHECK(!tpu::DecodeCollective(build({}, 1), &d).ok());
    std::vector<CollectiveEntry> many(tpu::kMaxGroupOps + 1, ops[1]);
    CHECK(absl::StrContains(tpu::DecodeCollective(build(many, 1), &d).message(),
                            "exceeds"));
  }
}
