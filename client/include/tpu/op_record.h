// The op stream's record format: what a client writes into a stream's ring
// and the daemon reads back. Shared by libtpuclient and tpud; no ATen here.
//
// Every record starts with a RecordHeader and is padded to 8 bytes. All
// integers are little-endian (the only byte order tpud runs on). Bodies:
//
//   kDefineOp   u32 op_id, u32 schema_len, schema bytes
//               Interns a full operator schema string, e.g.
//               "aten::add.Tensor(Tensor self, Tensor other, *, Scalar alpha=1)
//               -> Tensor" under op_id for the rest of the session.
//   kOp         u32 op_id, u16 num_args, u16 num_outputs, u32 flags,
//               num_args x Arg, num_outputs x TensorRef
//               Runs the op. Each returned tensor i that is not already one of
//               the arguments is copied into output i (client-allocated).
//               flags & kOpFlagSync: the result goes to the stream's response
//               area (see shm_layout.h), for ops the host waits on;
//               flags & kOpFlagChecked: the host waits for it too;
//               flags & kOpFlagDefaultDtypeMask: the client's default dtype.
//   kCopy       u8 kind (CopyKind), 7 pad, u64 src, u64 dst, u64 bytes
//               Host addresses are offsets into the session's shared memory
//               (staging area or pinned pool); device ones are device
//               addresses.
//   kEventRecord u32 event_slot, 4 pad
//   kEventWait   u32 event_slot, u32 stream, u64 sequence
//               Holds this stream until `stream` has completed `sequence`.
//   kCollective u64 communicator, u32 num_ops (1..kMaxGroupOps), u32 flags (0),
//               u64 index, num_ops x CollectiveEntry
//               `index` numbers the rank's collective groups on the
//               communicator in the order the host issued them (1, 2, ...;
//               0 for point-to-point groups): ranks' groups meet by it,
//               whichever stream each went to.
//               A group of collective or point-to-point operations on one
//               communicator (daemon/collectives/groups.h), run as one
//               unit: the stream waits until every operation of the group
//               has completed with its peers.
//   kRunProgram u32 program_id, u32 num_bindings, u64 offset, u64 bytes,
//               u64 seed, num_bindings x (u64 from, u64 bytes, u64 to)
//               Runs a captured program (Session::BeginCapture): its records
//               lie in the session's shared memory at [offset, +bytes) (a
//               ProgramHeader, then kOp and device-to-device kCopy records);
//               every device address inside [from, +bytes) of a binding is
//               moved to `to` (inputs and outputs of this run); a non-zero
//               seed reseeds the program's random ops (the k-th generator
//               argument gets MixSeed(seed, k)). program_id 0
//               (kEagerProgramId): a fused eager run's ops, read for this
//               run only.
//
// A CollectiveEntry is: u8 kind (CollectiveKind), u8 reduce op (ReduceOp),
// i8 dtype, u8 pad, i32 root or peer rank, u64 count (elements), u64 send
// address, u64 recv address (device addresses of dense buffers; 0 where the
// kind has no such buffer), u64 pair sequence (send and recv: the n-th, from
// 0, between this rank and `peer` in that direction; else 0), u32 n_splits (0,
// or the communicator's size for all_to_all), u32 pad, n_splits x i64 send
// counts, n_splits x i64 recv counts.
//
// An Arg is a u8 tag (ArgTag) followed by its payload:
//   kNone                      -
//   kTensor                    TensorRef
//   kUndefinedTensor           -
//   kInt, kSymInt              i64
//   kDouble                    f64
//   kBool                      u8
//   kComplex                   f64 real, f64 imag
//   kString                    u32 len, bytes (at most kMaxStringBytes)
//   kScalarInt / kScalarDouble / kScalarBool / kScalarComplex
//                              as kInt / kDouble / kBool / kComplex
//   kIntList                   u32 n, n x i64
//   kDoubleList                u32 n, n x f64
//   kBoolList                  u32 n, n x u8
//   kDtype, kLayout, kMemoryFormat  i8 (c10 enum value)
//   kDevice                    i8 device type (c10::DeviceType), i8 index
//   kTensorList                u32 n, n x TensorRef
//   kOptionalTensorList        u32 n, n x (u8 present, TensorRef if present)
//   kGenerator                 i64 seed
//   kScalarTensor              i8 dtype, u8 wrapped (0/1), 6 pad, f64 real
//                              (or i64 for integral/bool dtypes), f64 imag
//
// A TensorRef is: u64 device address of the storage, i64 storage offset (in
// elements), i8 dtype (c10::ScalarType value), u8 ndim (at most kMaxDims),
// 6 pad, ndim x i64 sizes, ndim x i64 strides.
//
// Decoding never trusts a byte: every length is checked against the record,
// every count against its limit. The daemon checks tensor footprints against
// the session's segments separately (see daemon/tensor_check.h).
#ifndef TPU_OP_RECORD_H_
#define TPU_OP_RECORD_H_

#include <complex>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "tpu/dtype.h"

namespace tpu {

inline constexpr int kMaxDims = 64;  // as a CPU tensor's
inline constexpr uint32_t kMaxStringBytes = 4096;
inline constexpr uint32_t kMaxListLength = 1 << 16;
inline constexpr uint16_t kMaxArgs = 256;
inline constexpr uint16_t kMaxOutputs = 64;
inline constexpr uint32_t kMaxSchemaBytes = 8192;
inline constexpr uint32_t kRecordAlignment = 8;

enum class RecordKind : uint16_t {
  kPad = 0,  // filler to the end of the ring; the consumer skips to offset 0
  kDefineOp = 1,
  kOp = 2,
  kCopy = 3,
  kEventRecord = 4,
  kEventWait = 5,
  kCollective = 6,
  kRunProgram = 7,
  kLastKind = kRunProgram,
};

// The start of a program's bytes in shared memory; its records follow,
// each 8-byte aligned.
struct ProgramHeader {
  uint32_t magic;  // kProgramMagic
  uint32_t num_records;
  uint32_t name_len;  // bytes of name that follow (padded to 8)
  // A fused eager run only (0 otherwise): the device addresses (u64 each,
  // after the records) of segments nothing reads after the run, freed while
  // it was held: what the run writes there need not be kept.
  uint32_t num_dead;
};
inline constexpr uint32_t kMaxProgramDead = 1 << 16;
inline constexpr uint32_t kProgramMagic = 0x47525054;  // "TPRG"
inline constexpr uint32_t kMaxProgramBindings = 1 << 16;
inline constexpr uint32_t kMaxProgramRecords = 1 << 20;
inline constexpr uint32_t kMaxProgramNameBytes = 256;
// The program id of a fused eager run (Session::SetEagerFusion): a program
// made for one run, read afresh each time and never kept by id.
inline constexpr uint32_t kEagerProgramId = 0;
// A stream holds at most this many ops (or bytes of their records) for
// fusion before it sends them on.
inline constexpr uint32_t kMaxFusedRecords = 1024;
inline constexpr uint64_t kMaxFusedBytes = 1 << 20;

// One k-th seed of a program run (splitmix64 of seed + k).
uint64_t MixSeed(uint64_t seed, uint64_t k);

// What a collective entry does. Counts are elements of `dtype`; n is the
// communicator's size. Buffers are dense; send and recv may be the same.
enum class CollectiveKind : uint8_t {
  kAllReduce = 1,      // send: count, recv: count (every rank)
  kBroadcast = 2,      // root's send: count -> every recv: count
  kReduce = 3,         // every send: count -> root's recv: count
  kAllGather = 4,      // send: count, recv: n * count, rank order
  kReduceScatter = 5,  // send: n * count, recv: count (rank r gets block r)
  kAllToAll =
      6,  // send: sum(send_counts) (block j to rank j), recv: sum(recv_counts)
  kGather = 7,   // send: count -> root's recv: n * count
  kScatter = 8,  // root's send: n * count -> recv: count
  kBarrier = 9,  // nothing moves
  kSend = 10,    // send: count to rank `peer`
  kRecv = 11,    // recv: count from rank `peer`
  kLast = kRecv,
};

enum class ReduceOp : uint8_t {
  kSum = 0,
  kProduct = 1,
  kMin = 2,
  kMax = 3,
  kAvg = 4,
  // Bitwise, of integer and bool tensors only (as gloo's; NCCL has none).
  kBand = 5,
  kBor = 6,
  kBxor = 7,
  kLast = kBxor,
};

inline constexpr uint32_t kMaxGroupOps = 64;
inline constexpr uint32_t kMaxCommRanks = 64;

struct RecordHeader {
  uint32_t length;  // whole record including this header, multiple of 8
  uint16_t kind;    // RecordKind
  uint16_t reserved;
  uint64_t
      sequence;  // 1, 2, 3, ... per stream; completion counters count these
};
static_assert(sizeof(RecordHeader) == 16, "wire format");

inline constexpr uint32_t kOpFlagSync = 1;
// The client waits for this op and raises its failure at the call
// (Session::RunChecked): a kernel error then marks nothing it wrote as
// failed, as on the CPU, where the tensors keep what the kernel left.
inline constexpr uint32_t kOpFlagChecked = 2;
// Bits 8..15: the client's default floating dtype (tpu/dtype.h code + 1),
// 0 for float32. ATen's results depend on it (1 / 2 of integers, a Python
// float times an integer tensor), so the daemon runs the op under it.
inline constexpr uint32_t kOpFlagDefaultDtypeShift = 8;
inline constexpr uint32_t kOpFlagDefaultDtypeMask = 0xff00;
inline constexpr uint32_t kOpFlagsKnown =
    kOpFlagSync | kOpFlagChecked | kOpFlagDefaultDtypeMask;

enum class ArgTag : uint8_t {
  kNone = 0,
  kTensor = 1,
  kUndefinedTensor = 2,
  kInt = 3,
  kSymInt = 4,
  kDouble = 5,
  kBool = 6,
  kComplex = 7,
  kString = 8,
  kScalarInt = 9,
  kScalarDouble = 10,
  kScalarBool = 11,
  kScalarComplex = 12,
  kIntList = 13,
  kDoubleList = 14,
  kBoolList = 15,
  kDtype = 16,
  kLayout = 17,
  kMemoryFormat = 18,
  kDevice = 19,
  kTensorList = 20,
  kOptionalTensorList = 21,
  // A random generator, sent as the seed the client drew for this op from
  // its device generator: the daemon runs the op with a generator seeded so
  // (results are reproducible per client, independent of other sessions).
  kGenerator = 22,
  // A host scalar used as a tensor (a Python number in `x + 2`, or a CPU
  // 0-dim tensor): the daemon rebuilds it as a CPU scalar tensor, keeping
  // the "wrapped number" flag that type promotion depends on.
  kScalarTensor = 23,
  kLast = kScalarTensor,
};

enum class CopyKind : uint8_t {
  kHostToDevice = 1,  // src: shared-memory offset, dst: device address
  kDeviceToHost = 2,  // src: device address, dst: shared-memory offset
  kDeviceToDevice = 3,
};

struct TensorRef {
  uint64_t address = 0;  // device address of the storage (tpu/device_address.h)
  int64_t storage_offset = 0;  // elements
  int8_t dtype = 0;            // c10::ScalarType value
  uint8_t ndim = 0;
  int64_t sizes[kMaxDims] = {};
  int64_t strides[kMaxDims] = {};
};

struct OpArg {
  ArgTag tag = ArgTag::kNone;
  int64_t i = 0;  // kInt, kSymInt, kScalarInt, kDtype, kLayout, kMemoryFormat,
                  // kDevice type
  int64_t device_index = 0;  // kDevice
  double d = 0;              // kDouble, kScalarDouble, kComplex real
  double d_imag = 0;         // kComplex imag
  bool b = false;    // kBool, kScalarBool, kScalarTensor: wrapped number
  int8_t dtype = 0;  // kScalarTensor
  TensorRef tensor;  // kTensor
  std::string s;     // kString
  std::vector<int64_t> ints;
  std::vector<double> doubles;
  std::vector<bool> bools;
  std::vector<TensorRef> tensors;    // kTensorList, kOptionalTensorList
  std::vector<bool> tensor_present;  // kOptionalTensorList
};

// Bytes per element of a wire dtype code (tpu/dtype.h); 0 for codes tpud
// does not carry (sub-byte, quantized and unknown types are refused).
int ElementSize(int8_t dtype);

// Builds one record into a caller-owned buffer. Append* calls follow the
// body layout above; Finish() pads and writes the header. Never fails: the
// caller limits what it builds (the decoder rejects anything out of range).
class RecordWriter {
 public:
  void Begin(RecordKind kind, uint64_t sequence);
  void U8(uint8_t v);
  void U16(uint16_t v);
  void U32(uint32_t v);
  void U64(uint64_t v);
  void I64(int64_t v);
  void F64(double v);
  void Bytes(const void* data, size_t n);
  void Pad(size_t n);
  void Tensor(const TensorRef& t);
  // Convenience for kOp bodies.
  void Arg(const OpArg& arg);
  // Returns the finished record (header length filled in, padded to 8).
  absl::string_view Finish();
  const std::string& buffer() const { return buf_; }

 private:
  std::string buf_;
};

struct DecodedDefineOp {
  uint32_t op_id = 0;
  std::string schema;
};

struct DecodedOp {
  uint32_t op_id = 0;
  uint32_t flags = 0;
  std::vector<OpArg> args;  // reused between decodes
  std::vector<TensorRef> outputs;
  size_t num_args = 0;  // args[0, num_args) are valid
};

struct ProgramBinding {
  uint64_t from = 0;  // device address range as captured
  uint64_t bytes = 0;
  uint64_t to = 0;  // where it lies in this run
};

struct DecodedRunProgram {
  uint32_t program_id = 0;
  uint64_t offset = 0;  // of the program in the session's shared memory
  uint64_t bytes = 0;
  uint64_t seed = 0;
  std::vector<ProgramBinding> bindings;
};

struct DecodedCopy {
  CopyKind kind = CopyKind::kHostToDevice;
  uint64_t src = 0;
  uint64_t dst = 0;
  uint64_t bytes = 0;
};

struct CollectiveEntry {
  CollectiveKind kind = CollectiveKind::kBarrier;
  ReduceOp reduce = ReduceOp::kSum;
  int8_t dtype = 0;
  int32_t peer =
      0;  // root (broadcast, reduce, gather, scatter) or peer (send, recv)
  uint64_t count = 0;
  uint64_t send = 0;  // device addresses
  uint64_t recv = 0;
  uint64_t pair_sequence = 0;        // send and recv
  std::vector<int64_t> send_counts;  // all_to_all only
  std::vector<int64_t> recv_counts;
};

struct DecodedCollective {
  uint64_t communicator = 0;
  uint64_t index = 0;
  std::vector<CollectiveEntry> ops;
};

// Name for messages: "all_reduce", "send", ...
const char* CollectiveKindName(CollectiveKind kind);
const char* ReduceOpName(ReduceOp op);

struct DecodedEventWait {
  uint32_t event_slot = 0;
  uint32_t stream = 0;
  uint64_t sequence = 0;
};

// Checks a header read from a ring: length sane and aligned, kind known.
absl::Status CheckHeader(const RecordHeader& header, size_t bytes_available);

// Decoders: the record is [data, data + header.length). INVALID_ARGUMENT
// with what was wrong and where, for anything malformed.
absl::Status DecodeDefineOp(absl::string_view record, DecodedDefineOp* out);
absl::Status DecodeOp(absl::string_view record, DecodedOp* out);
absl::Status DecodeCopy(absl::string_view record, DecodedCopy* out);
absl::Status DecodeEventRecord(absl::string_view record, uint32_t* event_slot);
absl::Status DecodeEventWait(absl::string_view record, DecodedEventWait* out);
absl::Status DecodeCollective(absl::string_view record, DecodedCollective* out);
absl::Status DecodeRunProgram(absl::string_view record, DecodedRunProgram* out);
// Writes a kCollective body (after Begin) for `ops`.
void WriteCollective(RecordWriter& w, uint64_t communicator, uint64_t index,
                     const CollectiveEntry* ops, size_t num_ops);

// Bytes a tensor touches: from the lowest to one past the highest element,
// relative to the storage start. INVALID_ARGUMENT for negative sizes or
// offsets, unknown dtypes and arithmetic overflow. An empty tensor touches
// nothing: returns {0, 0}.
struct Footprint {
  uint64_t begin = 0;
  uint64_t end = 0;
};
absl::StatusOr<Footprint> TensorFootprint(const TensorRef& t);

}  // namespace tpu

#endif  // TPU_OP_RECORD_H_
