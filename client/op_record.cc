#include "tpu/op_record.h"

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>

#include "absl/base/optimization.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

// The wire format is little-endian and records are memcpy'd field by field.
static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__,
              "op records assume a little-endian host");

namespace tpu {
namespace {

constexpr size_t kHeaderBytes = sizeof(RecordHeader);
// u64 address, i64 storage_offset, i8 dtype, u8 ndim, 6 pad.
constexpr size_t kTensorFixedBytes = 24;
constexpr size_t kTensorPadOffset = 18;
constexpr size_t kTensorPadBytes = 6;

const char* KindName(uint16_t kind) {
  switch (static_cast<RecordKind>(kind)) {
    case RecordKind::kPad:
      return "kPad";
    case RecordKind::kDefineOp:
      return "kDefineOp";
    case RecordKind::kOp:
      return "kOp";
    case RecordKind::kCopy:
      return "kCopy";
    case RecordKind::kEventRecord:
      return "kEventRecord";
    case RecordKind::kEventWait:
      return "kEventWait";
    case RecordKind::kCollective:
      return "kCollective";
    case RecordKind::kRunProgram:
      return "kRunProgram";
  }
  return "unknown";
}

const char* KindName(RecordKind kind) {
  return KindName(static_cast<uint16_t>(kind));
}

const char* TagName(ArgTag tag) {
  switch (tag) {
    case ArgTag::kNone:
      return "kNone";
    case ArgTag::kTensor:
      return "kTensor";
    case ArgTag::kUndefinedTensor:
      return "kUndefinedTensor";
    case ArgTag::kInt:
      return "kInt";
    case ArgTag::kSymInt:
      return "kSymInt";
    case ArgTag::kDouble:
      return "kDouble";
    case ArgTag::kBool:
      return "kBool";
    case ArgTag::kComplex:
      return "kComplex";
    case ArgTag::kString:
      return "kString";
    case ArgTag::kScalarInt:
      return "kScalarInt";
    case ArgTag::kScalarDouble:
      return "kScalarDouble";
    case ArgTag::kScalarBool:
      return "kScalarBool";
    case ArgTag::kScalarComplex:
      return "kScalarComplex";
    case ArgTag::kIntList:
      return "kIntList";
    case ArgTag::kDoubleList:
      return "kDoubleList";
    case ArgTag::kBoolList:
      return "kBoolList";
    case ArgTag::kDtype:
      return "kDtype";
    case ArgTag::kLayout:
      return "kLayout";
    case ArgTag::kMemoryFormat:
      return "kMemoryFormat";
    case ArgTag::kDevice:
      return "kDevice";
    case ArgTag::kTensorList:
      return "kTensorList";
    case ArgTag::kOptionalTensorList:
      return "kOptionalTensorList";
    case ArgTag::kGenerator:
      return "kGenerator";
    case ArgTag::kScalarTensor:
      return "kScalarTensor";
  }
  return "unknown";
}

std::string DescribeHeader(const RecordHeader& h) {
  return absl::StrCat(KindName(h.kind), " record (sequence ", h.sequence,
                      ", length ", h.length, ")");
}

std::string DescribeTensor(const TensorRef& t) {
  const int ndim = std::min<int>(t.ndim, kMaxDims);
  return absl::StrCat(
      "dtype ", static_cast<int>(t.dtype), ", ndim ", static_cast<int>(t.ndim),
      ", storage_offset ", t.storage_offset, ", sizes [",
      absl::StrJoin(t.sizes, t.sizes + ndim, ", "), "], strides [",
      absl::StrJoin(t.strides, t.strides + ndim, ", "), "]");
}

// Bounds-checked cursor over a record body. Offsets are from the start of the
// record (header included), so messages point at the byte a hexdump shows.
// Methods return false on malformed input with error() describing it; the
// error string is only built on failure, so decoding allocates nothing.
class BodyReader {
 public:
  BodyReader(const char* record, size_t begin, size_t end)
      : record_(record), pos_(begin), end_(end) {}

  size_t pos() const { return pos_; }
  size_t remaining() const { return end_ - pos_; }
  const std::string& error() const { return error_; }

  bool Take(size_t n, const char* what, const char** out) {
    if (ABSL_PREDICT_FALSE(n > end_ - pos_)) return Truncated(n, what);
    *out = record_ + pos_;
    pos_ += n;
    return true;
  }

  template <typename T>
  bool Read(const char* what, T* v) {
    const char* src;
    if (!Take(sizeof(T), what, &src)) return false;
    std::memcpy(v, src, sizeof(T));
    return true;
  }

  bool ReadBool(const char* what, bool* v) {
    const size_t at = pos_;
    uint8_t byte;
    if (!Read(what, &byte)) return false;
    if (ABSL_PREDICT_FALSE(byte > 1)) {
      return Fail(at, absl::StrCat(what, " is ", static_cast<int>(byte),
                                   ", expected 0 or 1"));
    }
    *v = byte != 0;
    return true;
  }

  // Reads a u32 element count and checks it against `limit`.
  bool ReadCount(const char* what, uint32_t limit, uint32_t* n) {
    const size_t at = pos_;
    if (!Read(what, n)) return false;
    if (ABSL_PREDICT_FALSE(*n > limit)) {
      return Fail(at,
                  absl::StrCat(what, " ", *n, " exceeds the limit of ", limit));
    }
    return true;
  }

  // Fails unless at least `n` bytes remain; used before sizing containers
  // from an untrusted count, so a lying count cannot make us allocate.
  bool Need(size_t n, const char* what) {
    if (ABSL_PREDICT_FALSE(n > end_ - pos_)) return Truncated(n, what);
    return true;
  }

  bool Zeros(const char* p, size_t n, size_t at, const char* what) {
    for (size_t i = 0; i < n; ++i) {
      if (ABSL_PREDICT_FALSE(p[i] != 0)) {
        return Fail(at + i, absl::StrCat("nonzero ", what, " byte 0x",
                                         absl::Hex(static_cast<uint8_t>(p[i]),
                                                   absl::kZeroPad2)));
      }
    }
    return true;
  }

  bool Pad(size_t n, const char* what) {
    const size_t at = pos_;
    const char* p;
    if (!Take(n, what, &p)) return false;
    return Zeros(p, n, at, what);
  }

  // After the body: only zero padding, fewer than 8 bytes, may follow.
  bool End() {
    const size_t left = end_ - pos_;
    if (left >= kRecordAlignment) {
      return Fail(pos_, absl::StrCat(left,
                                     " bytes of trailing data after the "
                                     "body (at most 7 bytes of zero "
                                     "padding allowed)"));
    }
    return Zeros(record_ + pos_, left, pos_, "padding");
  }

  bool Fail(size_t at, absl::string_view message) {
    error_ = absl::StrCat(message, " at byte ", at);
    return false;
  }

 private:
  bool Truncated(size_t n, const char* what) {
    error_ = absl::StrCat("truncated: ", what, " needs ", n, " bytes at byte ",
                          pos_, " but the record ends at byte ", end_);
    return false;
  }

  const char* record_;
  size_t pos_;
  size_t end_;
  std::string error_;
};

// Validates the header and the kind; the body is then [16, header->length).
absl::Status OpenRecord(absl::string_view record, RecordKind expected,
                        RecordHeader* header) {
  if (record.size() < kHeaderBytes) {
    return absl::InvalidArgumentError(absl::StrCat(
        "expected a ", KindName(expected), " record, got only ", record.size(),
        " bytes, fewer than the ", kHeaderBytes, "-byte header"));
  }
  std::memcpy(header, record.data(), kHeaderBytes);
  absl::Status status = CheckHeader(*header, record.size());
  if (!status.ok()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "expected a ", KindName(expected), " record: ", status.message()));
  }
  if (header->kind != static_cast<uint16_t>(expected)) {
    return absl::InvalidArgumentError(
        absl::StrCat("expected a ", KindName(expected), " record (kind ",
                     static_cast<int>(expected), "), got a ",
                     DescribeHeader(*header), " with kind ", header->kind));
  }
  return absl::OkStatus();
}

absl::Status BodyError(const RecordHeader& header, absl::string_view context,
                       const std::string& error) {
  return absl::InvalidArgumentError(
      absl::StrCat(DescribeHeader(header), ": ", context, error));
}

bool DecodeTensor(BodyReader& r, TensorRef* t) {
  const size_t at = r.pos();
  const char* p;
  if (!r.Take(kTensorFixedBytes, "tensor header", &p)) return false;
  std::memcpy(&t->address, p, 8);
  std::memcpy(&t->storage_offset, p + 8, 8);
  const int8_t dtype = static_cast<int8_t>(p[16]);
  const uint8_t ndim = static_cast<uint8_t>(p[17]);
  if (!r.Zeros(p + kTensorPadOffset, kTensorPadBytes, at + kTensorPadOffset,
               "tensor padding")) {
    return false;
  }
  if (ABSL_PREDICT_FALSE(ElementSize(dtype) == 0)) {
    return r.Fail(at + 16,
                  absl::StrCat("tensor dtype ", static_cast<int>(dtype),
                               " is not supported (unknown, quantized or "
                               "sub-byte c10::ScalarType)"));
  }
  if (ABSL_PREDICT_FALSE(ndim > kMaxDims)) {
    return r.Fail(at + 17, absl::StrCat("tensor ndim ", static_cast<int>(ndim),
                                        " exceeds the limit of ", kMaxDims));
  }
  t->dtype = dtype;
  t->ndim = ndim;
  const size_t dims_bytes = size_t{ndim} * sizeof(int64_t);
  if (!r.Take(dims_bytes, "tensor sizes", &p)) return false;
  std::memcpy(t->sizes, p, dims_bytes);
  if (!r.Take(dims_bytes, "tensor strides", &p)) return false;
  std::memcpy(t->strides, p, dims_bytes);
  // Unused dims read as 0, so a reused TensorRef equals a fresh one.
  std::fill(t->sizes + ndim, t->sizes + kMaxDims, 0);
  std::fill(t->strides + ndim, t->strides + kMaxDims, 0);
  return true;
}

bool DecodeArg(BodyReader& r, OpArg* a) {
  const size_t at = r.pos();
  uint8_t tag;
  if (!r.Read("arg tag", &tag)) return false;
  if (ABSL_PREDICT_FALSE(tag > static_cast<uint8_t>(ArgTag::kLast))) {
    return r.Fail(at, absl::StrCat("unknown arg tag ", static_cast<int>(tag),
                                   " (known tags are 0..",
                                   static_cast<int>(ArgTag::kLast), ")"));
  }
  a->tag = static_cast<ArgTag>(tag);
  // The slot may hold an argument of an op decoded before: none of its
  // fields may show through (a None reads as empty). clear() keeps the
  // capacity, so this allocates nothing.
  a->i = 0;
  a->device_index = 0;
  a->d = 0;
  a->d_imag = 0;
  a->b = false;
  a->dtype = 0;
  a->s.clear();
  a->ints.clear();
  a->doubles.clear();
  a->bools.clear();
  a->tensors.clear();
  a->tensor_present.clear();
  switch (a->tag) {
    case ArgTag::kNone:
    case ArgTag::kUndefinedTensor:
      return true;
    case ArgTag::kTensor:
      return DecodeTensor(r, &a->tensor);
    case ArgTag::kInt:
    case ArgTag::kSymInt:
    case ArgTag::kScalarInt:
    case ArgTag::kGenerator:
      return r.Read("int value", &a->i);
    case ArgTag::kDouble:
    case ArgTag::kScalarDouble:
      return r.Read("double value", &a->d);
    case ArgTag::kBool:
    case ArgTag::kScalarBool:
      return r.ReadBool("bool value", &a->b);
    case ArgTag::kComplex:
    case ArgTag::kScalarComplex:
      return r.Read("complex real part", &a->d) &&
             r.Read("complex imaginary part", &a->d_imag);
    case ArgTag::kString: {
      uint32_t n;
      const char* p;
      if (!r.ReadCount("string length", kMaxStringBytes, &n) ||
          !r.Take(n, "string bytes", &p)) {
        return false;
      }
      a->s.assign(p, n);
      return true;
    }
    case ArgTag::kIntList:
    case ArgTag::kDoubleList: {
      uint32_t n;
      const char* p;
      if (!r.ReadCount("list length", kMaxListLength, &n) ||
          !r.Take(size_t{n} * 8, "list elements", &p)) {
        return false;
      }
      if (a->tag == ArgTag::kIntList) {
        a->ints.resize(n);
        if (n > 0) std::memcpy(a->ints.data(), p, size_t{n} * 8);
      } else {
        a->doubles.resize(n);
        if (n > 0) std::memcpy(a->doubles.data(), p, size_t{n} * 8);
      }
      return true;
    }
    case ArgTag::kBoolList: {
      uint32_t n;
      const size_t elements_at = r.pos() + 4;
      const char* p;
      if (!r.ReadCount("list length", kMaxListLength, &n) ||
          !r.Take(n, "list elements", &p)) {
        return false;
      }
      a->bools.resize(n);
      for (uint32_t j = 0; j < n; ++j) {
        const uint8_t byte = static_cast<uint8_t>(p[j]);
        if (ABSL_PREDICT_FALSE(byte > 1)) {
          return r.Fail(
              elements_at + j,
              absl::StrCat("bool list element ", j, " is ",
                           static_cast<int>(byte), ", expected 0 or 1"));
        }
        a->bools[j] = byte != 0;
      }
      return true;
    }
    case ArgTag::kDtype:
    case ArgTag::kLayout:
    case ArgTag::kMemoryFormat: {
      int8_t v;
      if (!r.Read("enum value", &v)) return false;
      a->i = v;
      return true;
    }
    case ArgTag::kDevice: {
      int8_t type, index;
      if (!r.Read("device type", &type) || !r.Read("device index", &index)) {
        return false;
      }
      a->i = type;
      a->device_index = index;
      return true;
    }
    case ArgTag::kTensorList: {
      uint32_t n;
      if (!r.ReadCount("tensor list length", kMaxListLength, &n) ||
          !r.Need(size_t{n} * kTensorFixedBytes, "tensor list")) {
        return false;
      }
      a->tensors.resize(n);
      for (uint32_t j = 0; j < n; ++j) {
        if (!DecodeTensor(r, &a->tensors[j])) return false;
      }
      return true;
    }
    case ArgTag::kScalarTensor: {
      const char* p;
      if (!r.Take(32, "scalar tensor", &p)) return false;
      const int8_t dtype = static_cast<int8_t>(p[0]);
      if (ABSL_PREDICT_FALSE(ElementSize(dtype) == 0)) {
        return r.Fail(
            at + 1, absl::StrCat("scalar tensor dtype ",
                                 static_cast<int>(dtype), " is not supported"));
      }
      if (ABSL_PREDICT_FALSE(static_cast<uint8_t>(p[1]) > 1)) {
        return r.Fail(at + 2, "scalar tensor wrapped flag is not 0 or 1");
      }
      for (int k = 2; k < 8; ++k) {
        if (ABSL_PREDICT_FALSE(p[k] != 0))
          return r.Fail(at + 1 + k, "nonzero padding");
      }
      for (int k = 24; k < 32; ++k) {
        if (ABSL_PREDICT_FALSE(p[k] != 0))
          return r.Fail(at + 1 + k, "nonzero reserved bytes");
      }
      a->dtype = dtype;
      a->b = p[1] != 0;
      std::memcpy(&a->i, p + 8, 8);
      std::memcpy(&a->d, p + 8, 8);
      std::memcpy(&a->d_imag, p + 16, 8);
      return true;
    }
    case ArgTag::kOptionalTensorList: {
      uint32_t n;
      if (!r.ReadCount("optional tensor list length", kMaxListLength, &n) ||
          !r.Need(n, "optional tensor list")) {
        return false;
      }
      a->tensors.resize(n);
      a->tensor_present.resize(n);
      for (uint32_t j = 0; j < n; ++j) {
        bool present;
        if (!r.ReadBool("optional tensor presence", &present)) return false;
        a->tensor_present[j] = present;
        if (present) {
          if (!DecodeTensor(r, &a->tensors[j])) return false;
        } else {
          a->tensors[j] = TensorRef();
        }
      }
      return true;
    }
  }
  return r.Fail(at, "unhandled arg tag");  // unreachable: tag range checked
}

}  // namespace

int ElementSize(int8_t dtype) { return ElementSizeOf(DTypeFromCode(dtype)); }

// ---------------------------------------------------------------- writer

void RecordWriter::Begin(RecordKind kind, uint64_t sequence) {
  buf_.clear();  // keeps capacity
  RecordHeader header{};
  header.kind = static_cast<uint16_t>(kind);
  header.sequence = sequence;
  buf_.append(reinterpret_cast<const char*>(&header), sizeof(header));
}

void RecordWriter::U8(uint8_t v) { buf_.push_back(static_cast<char>(v)); }

void RecordWriter::U16(uint16_t v) {
  buf_.append(reinterpret_cast<const char*>(&v), sizeof(v));
}

void RecordWriter::U32(uint32_t v) {
  buf_.append(reinterpret_cast<const char*>(&v), sizeof(v));
}

void RecordWriter::U64(uint64_t v) {
  buf_.append(reinterpret_cast<const char*>(&v), sizeof(v));
}

void RecordWriter::I64(int64_t v) {
  buf_.append(reinterpret_cast<const char*>(&v), sizeof(v));
}

void RecordWriter::F64(double v) {
  buf_.append(reinterpret_cast<const char*>(&v), sizeof(v));
}

void RecordWriter::Bytes(const void* data, size_t n) {
  if (n > 0) buf_.append(static_cast<const char*>(data), n);
}

void RecordWriter::Pad(size_t n) { buf_.append(n, '\0'); }

void RecordWriter::Tensor(const TensorRef& t) {
  char fixed[kTensorFixedBytes] = {};
  std::memcpy(fixed, &t.address, 8);
  std::memcpy(fixed + 8, &t.storage_offset, 8);
  fixed[16] = static_cast<char>(t.dtype);
  fixed[17] = static_cast<char>(t.ndim);
  buf_.append(fixed, sizeof(fixed));
  // An ndim above kMaxDims is written as is (the decoder refuses it) but
  // never read past the arrays.
  const size_t dims_bytes =
      size_t{std::min<uint8_t>(t.ndim, kMaxDims)} * sizeof(int64_t);
  buf_.append(reinterpret_cast<const char*>(t.sizes), dims_bytes);
  buf_.append(reinterpret_cast<const char*>(t.strides), dims_bytes);
}

void RecordWriter::Arg(const OpArg& arg) {
  U8(static_cast<uint8_t>(arg.tag));
  switch (arg.tag) {
    case ArgTag::kNone:
    case ArgTag::kUndefinedTensor:
      break;
    case ArgTag::kTensor:
      Tensor(arg.tensor);
      break;
    case ArgTag::kGenerator:
    case ArgTag::kInt:
    case ArgTag::kSymInt:
    case ArgTag::kScalarInt:
      I64(arg.i);
      break;
    case ArgTag::kDouble:
    case ArgTag::kScalarDouble:
      F64(arg.d);
      break;
    case ArgTag::kBool:
    case ArgTag::kScalarBool:
      U8(arg.b ? 1 : 0);
      break;
    case ArgTag::kComplex:
    case ArgTag::kScalarComplex:
      F64(arg.d);
      F64(arg.d_imag);
      break;
    case ArgTag::kString:
      U32(static_cast<uint32_t>(arg.s.size()));
      Bytes(arg.s.data(), arg.s.size());
      break;
    case ArgTag::kIntList:
      U32(static_cast<uint32_t>(arg.ints.size()));
      Bytes(arg.ints.data(), arg.ints.size() * sizeof(int64_t));
      break;
    case ArgTag::kDoubleList:
      U32(static_cast<uint32_t>(arg.doubles.size()));
      Bytes(arg.doubles.data(), arg.doubles.size() * sizeof(double));
      break;
    case ArgTag::kBoolList: {
      U32(static_cast<uint32_t>(arg.bools.size()));
      const size_t at = buf_.size();
      buf_.resize(at + arg.bools.size());
      for (size_t j = 0; j < arg.bools.size(); ++j) {
        buf_[at + j] = arg.bools[j] ? 1 : 0;
      }
      break;
    }
    case ArgTag::kDtype:
    case ArgTag::kLayout:
    case ArgTag::kMemoryFormat:
      U8(static_cast<uint8_t>(static_cast<int8_t>(arg.i)));
      break;
    case ArgTag::kDevice:
      U8(static_cast<uint8_t>(static_cast<int8_t>(arg.i)));
      U8(static_cast<uint8_t>(static_cast<int8_t>(arg.device_index)));
      break;
    case ArgTag::kScalarTensor: {
      U8(static_cast<uint8_t>(arg.dtype));
      U8(arg.b ? 1 : 0);
      Pad(6);
      // Integral and bool scalars travel as i64, the rest as f64.
      if (IsIntegral(DTypeFromCode(arg.dtype))) {
        I64(arg.i);
      } else {
        F64(arg.d);
      }
      F64(arg.d_imag);
      U64(0);
      break;
    }
    case ArgTag::kTensorList:
      U32(static_cast<uint32_t>(arg.tensors.size()));
      for (const TensorRef& t : arg.tensors) Tensor(t);
      break;
    case ArgTag::kOptionalTensorList:
      // One entry per element of `tensors`; an entry missing from
      // `tensor_present` counts as present.
      U32(static_cast<uint32_t>(arg.tensors.size()));
      for (size_t j = 0; j < arg.tensors.size(); ++j) {
        const bool present =
            j >= arg.tensor_present.size() || arg.tensor_present[j];
        U8(present ? 1 : 0);
        if (present) Tensor(arg.tensors[j]);
      }
      break;
  }
  // Unknown tags are written bare; the decoder refuses them.
}

absl::string_view RecordWriter::Finish() {
  if (buf_.size() < kHeaderBytes) buf_.resize(kHeaderBytes, '\0');  // no Begin
  const size_t rem = buf_.size() % kRecordAlignment;
  if (rem != 0) buf_.append(kRecordAlignment - rem, '\0');
  const uint32_t length = static_cast<uint32_t>(buf_.size());
  std::memcpy(&buf_[0], &length, sizeof(length));
  return buf_;
}

// ---------------------------------------------------------------- reader

absl::Status CheckHeader(const RecordHeader& header, size_t bytes_available) {
  if (header.length < kHeaderBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("record length ", header.length, " is shorter than the ",
                     kHeaderBytes, "-byte header (kind ", header.kind,
                     ", sequence ", header.sequence, ")"));
  }
  if (header.length % kRecordAlignment != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("record length ", header.length, " is not a multiple of ",
                     kRecordAlignment, " (kind ", header.kind, ", sequence ",
                     header.sequence, ")"));
  }
  if (header.length > bytes_available) {
    return absl::InvalidArgumentError(
        absl::StrCat("record length ", header.length, " exceeds the ",
                     bytes_available, " bytes available (kind ", header.kind,
                     ", sequence ", header.sequence, ")"));
  }
  if (header.kind > static_cast<uint16_t>(RecordKind::kLastKind)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "unknown record kind ", header.kind, " (known kinds are 0..",
        static_cast<int>(RecordKind::kLastKind), "; length ", header.length,
        ", sequence ", header.sequence, ")"));
  }
  return absl::OkStatus();
}

absl::Status DecodeDefineOp(absl::string_view record, DecodedDefineOp* out) {
  RecordHeader h;
  absl::Status status = OpenRecord(record, RecordKind::kDefineOp, &h);
  if (!status.ok()) return status;
  BodyReader r(record.data(), kHeaderBytes, h.length);
  uint32_t schema_len;
  const char* schema;
  if (!r.Read("op_id", &out->op_id)) return BodyError(h, "", r.error());
  const size_t len_at = r.pos();
  if (!r.Read("schema_len", &schema_len)) return BodyError(h, "", r.error());
  if (schema_len == 0 || schema_len > kMaxSchemaBytes) {
    r.Fail(len_at, absl::StrCat("schema_len ", schema_len, " is outside 1..",
                                kMaxSchemaBytes));
    return BodyError(h, "", r.error());
  }
  if (!r.Take(schema_len, "schema bytes", &schema) || !r.End()) {
    return BodyError(h, "", r.error());
  }
  out->schema.assign(schema, schema_len);
  return absl::OkStatus();
}

absl::Status DecodeOp(absl::string_view record, DecodedOp* out) {
  out->num_args = 0;
  RecordHeader h;
  absl::Status status = OpenRecord(record, RecordKind::kOp, &h);
  if (!status.ok()) return status;
  BodyReader r(record.data(), kHeaderBytes, h.length);
  uint16_t num_args, num_outputs;
  if (!r.Read("op_id", &out->op_id) || !r.Read("num_args", &num_args) ||
      !r.Read("num_outputs", &num_outputs) || !r.Read("flags", &out->flags)) {
    return BodyError(h, "", r.error());
  }
  constexpr size_t kNumArgsAt = kHeaderBytes + 4;
  if (num_args > kMaxArgs) {
    r.Fail(kNumArgsAt, absl::StrCat("num_args ", num_args,
                                    " exceeds the limit of ", kMaxArgs));
    return BodyError(h, "", r.error());
  }
  if (num_outputs > kMaxOutputs) {
    r.Fail(kNumArgsAt + 2, absl::StrCat("num_outputs ", num_outputs,
                                        " exceeds the limit of ", kMaxOutputs));
    return BodyError(h, "", r.error());
  }
  if ((out->flags & ~kOpFlagsKnown) != 0) {
    r.Fail(kNumArgsAt + 4,
           absl::StrCat("unknown op flags 0x", absl::Hex(out->flags),
                        " (known: 0x", absl::Hex(kOpFlagSync), " sync, 0x",
                        absl::Hex(kOpFlagChecked), " checked, 0x",
                        absl::Hex(kOpFlagDefaultDtypeMask), " default dtype)"));
    return BodyError(h, "", r.error());
  }
  // Every arg takes at least its tag byte and every output a fixed tensor
  // header; checking that first keeps a lying count from growing `args`.
  if (!r.Need(size_t{num_args} + size_t{num_outputs} * kTensorFixedBytes,
              "args and outputs")) {
    return BodyError(h, "", r.error());
  }
  if (out->args.size() < num_args) out->args.resize(num_args);
  for (size_t i = 0; i < num_args; ++i) {
    const size_t tag_at = r.pos();
    if (!DecodeArg(r, &out->args[i])) {
      std::string context = absl::StrCat("arg ", i, " of ", num_args);
      const uint8_t tag =
          tag_at < h.length ? static_cast<uint8_t>(record[tag_at]) : 0xff;
      if (tag <= static_cast<uint8_t>(ArgTag::kLast)) {
        absl::StrAppend(&context, " (", TagName(static_cast<ArgTag>(tag)), ")");
      }
      absl::StrAppend(&context, ": ");
      return BodyError(h, context, r.error());
    }
  }
  out->outputs.resize(num_outputs);
  for (size_t i = 0; i < num_outputs; ++i) {
    if (!DecodeTensor(r, &out->outputs[i])) {
      return BodyError(h, absl::StrCat("output ", i, " of ", num_outputs, ": "),
                       r.error());
    }
  }
  if (!r.End()) return BodyError(h, "", r.error());
  out->num_args = num_args;
  return absl::OkStatus();
}

absl::Status DecodeCopy(absl::string_view record, DecodedCopy* out) {
  RecordHeader h;
  absl::Status status = OpenRecord(record, RecordKind::kCopy, &h);
  if (!status.ok()) return status;
  BodyReader r(record.data(), kHeaderBytes, h.length);
  uint8_t kind;
  if (!r.Read("copy kind", &kind)) return BodyError(h, "", r.error());
  if (kind < static_cast<uint8_t>(CopyKind::kHostToDevice) ||
      kind > static_cast<uint8_t>(CopyKind::kDeviceToDevice)) {
    r.Fail(kHeaderBytes,
           absl::StrCat("unknown copy kind ", static_cast<int>(kind),
                        " (known kinds are 1..3)"));
    return BodyError(h, "", r.error());
  }
  if (!r.Pad(7, "copy padding") || !r.Read("copy src", &out->src) ||
      !r.Read("copy dst", &out->dst) || !r.Read("copy bytes", &out->bytes) ||
      !r.End()) {
    return BodyError(h, "", r.error());
  }
  out->kind = static_cast<CopyKind>(kind);
  return absl::OkStatus();
}

uint64_t MixSeed(uint64_t seed, uint64_t k) {
  uint64_t z = seed + (k + 1) * 0x9e3779b97f4a7c15ULL;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}

absl::Status DecodeRunProgram(absl::string_view record,
                              DecodedRunProgram* out) {
  RecordHeader h;
  absl::Status status = OpenRecord(record, RecordKind::kRunProgram, &h);
  if (!status.ok()) return status;
  BodyReader r(record.data(), kHeaderBytes, h.length);
  uint32_t n = 0;
  if (!r.Read("program_id", &out->program_id) || !r.Read("num_bindings", &n)) {
    return BodyError(h, "", r.error());
  }
  if (n > kMaxProgramBindings) {
    r.Fail(kHeaderBytes + 4,
           absl::StrCat("num_bindings ", n, " exceeds the limit of ",
                        kMaxProgramBindings));
    return BodyError(h, "", r.error());
  }
  if (!r.Read("program offset", &out->offset) ||
      !r.Read("program bytes", &out->bytes) || !r.Read("seed", &out->seed)) {
    return BodyError(h, "", r.error());
  }
  out->bindings.resize(n);
  for (ProgramBinding& b : out->bindings) {
    if (!r.Read("binding from", &b.from) ||
        !r.Read("binding bytes", &b.bytes) || !r.Read("binding to", &b.to)) {
      return BodyError(h, "", r.error());
    }
  }
  if (!r.End()) return BodyError(h, "", r.error());
  return absl::OkStatus();
}

absl::Status DecodeEventRecord(absl::string_view record, uint32_t* event_slot) {
  RecordHeader h;
  absl::Status status = OpenRecord(record, RecordKind::kEventRecord, &h);
  if (!status.ok()) return status;
  BodyReader r(record.data(), kHeaderBytes, h.length);
  if (!r.Read("event_slot", event_slot) || !r.Pad(4, "event padding") ||
      !r.End()) {
    return BodyError(h, "", r.error());
  }
  return absl::OkStatus();
}

absl::Status DecodeEventWait(absl::string_view record, DecodedEventWait* out) {
  RecordHeader h;
  absl::Status status = OpenRecord(record, RecordKind::kEventWait, &h);
  if (!status.ok()) return status;
  BodyReader r(record.data(), kHeaderBytes, h.length);
  if (!r.Read("event_slot", &out->event_slot) ||
      !r.Read("stream", &out->stream) || !r.Read("sequence", &out->sequence) ||
      !r.End()) {
    return BodyError(h, "", r.error());
  }
  return absl::OkStatus();
}

const char* CollectiveKindName(CollectiveKind kind) {
  switch (kind) {
    case CollectiveKind::kAllReduce:
      return "all_reduce";
    case CollectiveKind::kBroadcast:
      return "broadcast";
    case CollectiveKind::kReduce:
      return "reduce";
    case CollectiveKind::kAllGather:
      return "all_gather";
    case CollectiveKind::kReduceScatter:
      return "reduce_scatter";
    case CollectiveKind::kAllToAll:
      return "all_to_all";
    case CollectiveKind::kGather:
      return "gather";
    case CollectiveKind::kScatter:
      return "scatter";
    case CollectiveKind::kBarrier:
      return "barrier";
    case CollectiveKind::kSend:
      return "send";
    case CollectiveKind::kRecv:
      return "recv";
  }
  return "unknown collective";
}

const char* ReduceOpName(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum:
      return "sum";
    case ReduceOp::kProduct:
      return "product";
    case ReduceOp::kMin:
      return "min";
    case ReduceOp::kMax:
      return "max";
    case ReduceOp::kAvg:
      return "avg";
    case ReduceOp::kBand:
      return "band";
    case ReduceOp::kBor:
      return "bor";
    case ReduceOp::kBxor:
      return "bxor";
  }
  return "unknown reduce op";
}

void WriteCollective(RecordWriter& w, uint64_t communicator, uint64_t index,
                     const CollectiveEntry* ops, size_t num_ops) {
  w.U64(communicator);
  w.U32(static_cast<uint32_t>(num_ops));
  w.U32(0);
  w.U64(index);
  for (size_t i = 0; i < num_ops; ++i) {
    const CollectiveEntry& e = ops[i];
    w.U8(static_cast<uint8_t>(e.kind));
    w.U8(static_cast<uint8_t>(e.reduce));
    w.U8(static_cast<uint8_t>(e.dtype));
    w.U8(0);
    w.U32(static_cast<uint32_t>(e.peer));
    w.U64(e.count);
    w.U64(e.send);
    w.U64(e.recv);
    w.U64(e.pair_sequence);
    w.U32(static_cast<uint32_t>(e.send_counts.size()));
    w.U32(0);
    for (int64_t c : e.send_counts) w.I64(c);
    for (int64_t c : e.recv_counts) w.I64(c);
  }
}

absl::Status DecodeCollective(absl::string_view record,
                              DecodedCollective* out) {
  RecordHeader h;
  absl::Status status = OpenRecord(record, RecordKind::kCollective, &h);
  if (!status.ok()) return status;
  BodyReader r(record.data(), kHeaderBytes, h.length);
  uint32_t n = 0;
  size_t at = 0;
  if (!r.Read("communicator", &out->communicator))
    return BodyError(h, "", r.error());
  at = r.pos();
  if (!r.ReadCount("num_ops", kMaxGroupOps, &n) || !r.Pad(4, "flags") ||
      !r.Read("index", &out->index)) {
    return BodyError(h, "", r.error());
  }
  if (n == 0) {
    r.Fail(at, "num_ops is 0 (a group has at least one operation)");
    return BodyError(h, "", r.error());
  }
  out->ops.resize(n);
  for (uint32_t i = 0; i < n; ++i) {
    CollectiveEntry& e = out->ops[i];
    const std::string ctx = absl::StrCat("operation ", i, ": ");
    uint8_t kind = 0, reduce = 0;
    int8_t dtype = 0;
    uint32_t peer = 0, splits = 0;
    at = r.pos();
    if (!r.Read("kind", &kind)) return BodyError(h, ctx, r.error());
    if (kind < static_cast<uint8_t>(CollectiveKind::kAllReduce) ||
        kind > static_cast<uint8_t>(CollectiveKind::kLast)) {
      r.Fail(at, absl::StrCat("unknown collective kind ", kind));
      return BodyError(h, ctx, r.error());
    }
    at = r.pos();
    if (!r.Read("reduce op", &reduce)) return BodyError(h, ctx, r.error());
    if (reduce > static_cast<uint8_t>(ReduceOp::kLast)) {
      r.Fail(at, absl::StrCat("unknown reduce op ", reduce));
      return BodyError(h, ctx, r.error());
    }
    at = r.pos();
    if (!r.Read("dtype", &dtype)) return BodyError(h, ctx, r.error());
    if (ElementSize(dtype) == 0) {
      r.Fail(at, absl::StrCat("unknown dtype ", static_cast<int>(dtype)));
      return BodyError(h, ctx, r.error());
    }
    if (!r.Pad(1, "pad") || !r.Read("peer", &peer) ||
        !r.Read("count", &e.count) || !r.Read("send", &e.send) ||
        !r.Read("recv", &e.recv) ||
        !r.Read("pair sequence", &e.pair_sequence)) {
      return BodyError(h, ctx, r.error());
    }
    at = r.pos();
    if (!r.ReadCount("n_splits", kMaxCommRanks, &splits) || !r.Pad(4, "pad")) {
      return BodyError(h, ctx, r.error());
    }
    e.kind = static_cast<CollectiveKind>(kind);
    e.reduce = static_cast<ReduceOp>(reduce);
    e.dtype = dtype;
    e.peer = static_cast<int32_t>(peer);
    if (splits != 0 && e.kind != CollectiveKind::kAllToAll) {
      r.Fail(at,
             absl::StrCat(splits, " splits on a ", CollectiveKindName(e.kind),
                          " (only all_to_all has splits)"));
      return BodyError(h, ctx, r.error());
    }
    if (!r.Need(size_t{16} * splits, "splits"))
      return BodyError(h, ctx, r.error());
    e.send_counts.resize(splits);
    e.recv_counts.resize(splits);
    for (auto* v : {&e.send_counts, &e.recv_counts}) {
      for (uint32_t k = 0; k < splits; ++k) {
        at = r.pos();
        if (!r.Read("split", &(*v)[k])) return BodyError(h, ctx, r.error());
        if ((*v)[k] < 0) {
          r.Fail(at, absl::StrCat("negative split ", (*v)[k]));
          return BodyError(h, ctx, r.error());
        }
      }
    }
  }
  if (!r.End()) return BodyError(h, "", r.error());
  return absl::OkStatus();
}

absl::StatusOr<Footprint> TensorFootprint(const TensorRef& t) {
  const uint64_t esize = static_cast<uint64_t>(ElementSize(t.dtype));
  if (esize == 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "tensor dtype ", static_cast<int>(t.dtype),
        " is not supported (unknown, quantized or sub-byte c10::ScalarType)"));
  }
  if (t.ndim > kMaxDims) {
    return absl::InvalidArgumentError(
        absl::StrCat("tensor ndim ", static_cast<int>(t.ndim),
                     " exceeds the limit of ", kMaxDims));
  }
  if (t.storage_offset < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("tensor storage_offset is negative: ", DescribeTensor(t)));
  }
  bool empty = false;
  for (int d = 0; d < t.ndim; ++d) {
    if (t.sizes[d] < 0 || t.strides[d] < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("tensor ", t.sizes[d] < 0 ? "size" : "stride",
                       " of dim ", d, " is negative: ", DescribeTensor(t)));
    }
    if (t.sizes[d] == 0) empty = true;
  }
  if (empty) return Footprint{};
  // Index of the last element touched, then bytes; all unsigned, all checked.
  uint64_t last = static_cast<uint64_t>(t.storage_offset);
  bool overflow = false;
  for (int d = 0; d < t.ndim && !overflow; ++d) {
    uint64_t extent;
    overflow =
        __builtin_mul_overflow(static_cast<uint64_t>(t.sizes[d] - 1),
                               static_cast<uint64_t>(t.strides[d]), &extent) ||
        __builtin_add_overflow(last, extent, &last);
  }
  Footprint fp;
  overflow = overflow ||
             __builtin_mul_overflow(static_cast<uint64_t>(t.storage_offset),
                                    esize, &fp.begin) ||
             __builtin_add_overflow(last, uint64_t{1}, &last) ||
             __builtin_mul_overflow(last, esize, &fp.end);
  if (overflow) {
    return absl::InvalidArgumentError(
        absl::StrCat("tensor extent overflows 64 bits: ", DescribeTensor(t),
                     ", element size ", esize));
  }
  return fp;
}

}  // namespace tpu
