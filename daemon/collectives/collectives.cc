#include "daemon/collectives/collectives.h"

#include <errno.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <complex>
#include <cstring>
#include <limits>
#include <thread>

#include "absl/strings/str_cat.h"

namespace tpud {
namespace {

using tpu::CollectiveKind;
using tpu::ReduceOp;

// c10::ScalarType values.
enum Dtype : int8_t {
  kUInt8 = 0,
  kInt8 = 1,
  kInt16 = 2,
  kInt32 = 3,
  kInt64 = 4,
  kHalf = 5,
  kFloat = 6,
  kDouble = 7,
  kComplexHalf = 8,
  kComplexFloat = 9,
  kComplexDouble = 10,
  kBool = 11,
  kBFloat16 = 15,
  kUInt16 = 27,
  kUInt32 = 28,
  kUInt64 = 29,
};

float Bf16ToFloat(uint16_t v) {
  const uint32_t bits = static_cast<uint32_t>(v) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

uint16_t FloatToBf16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  if (std::isnan(f)) return 0x7fc0;
  bits += 0x7fff + ((bits >> 16) & 1);  // round to nearest even
  return static_cast<uint16_t>(bits >> 16);
}

template <typename T>
T Apply(ReduceOp op, T a, T b) {
  switch (op) {
    case ReduceOp::kSum:
    case ReduceOp::kAvg:
      return static_cast<T>(a + b);
    case ReduceOp::kProduct:
      return static_cast<T>(a * b);
    case ReduceOp::kMin:
      // NaN propagates, as torch's minimum does.
      if constexpr (std::is_floating_point_v<T>) {
        if (std::isnan(a) || std::isnan(b)) return std::numeric_limits<T>::quiet_NaN();
      }
      return b < a ? b : a;
    case ReduceOp::kMax:
      if constexpr (std::is_floating_point_v<T>) {
        if (std::isnan(a) || std::isnan(b)) return std::numeric_limits<T>::quiet_NaN();
      }
      return a < b ? b : a;
  }
  return a;
}

template <typename T>
void ReduceTyped(ReduceOp op, char* dst, const char* src, uint64_t count) {
  T* d = reinterpret_cast<T*>(dst);
  const T* s = reinterpret_cast<const T*>(src);
  switch (op) {
    case ReduceOp::kSum:
    case ReduceOp::kAvg:
      for (uint64_t i = 0; i < count; ++i) d[i] = static_cast<T>(d[i] + s[i]);
      return;
    case ReduceOp::kProduct:
      for (uint64_t i = 0; i < count; ++i) d[i] = static_cast<T>(d[i] * s[i]);
      return;
    default:
      for (uint64_t i = 0; i < count; ++i) d[i] = Apply(op, d[i], s[i]);
  }
}

template <typename T>
void ReduceComplex(ReduceOp op, char* dst, const char* src, uint64_t count) {
  auto* d = reinterpret_cast<std::complex<T>*>(dst);
  const auto* s = reinterpret_cast<const std::complex<T>*>(src);
  if (op == ReduceOp::kProduct) {
    for (uint64_t i = 0; i < count; ++i) d[i] *= s[i];
  } else {
    for (uint64_t i = 0; i < count; ++i) d[i] += s[i];
  }
}

template <float (*ToFloat)(uint16_t), uint16_t (*FromFloat)(float)>
void ReduceHalfLike(ReduceOp op, char* dst, const char* src, uint64_t count) {
  auto* d = reinterpret_cast<uint16_t*>(dst);
  const auto* s = reinterpret_cast<const uint16_t*>(src);
  for (uint64_t i = 0; i < count; ++i) d[i] = FromFloat(Apply(op, ToFloat(d[i]), ToFloat(s[i])));
}

float HalfToFloat(uint16_t v) {
  _Float16 h;
  std::memcpy(&h, &v, 2);
  return static_cast<float>(h);
}

uint16_t FloatToHalf(float f) {
  const _Float16 h = static_cast<_Float16>(f);
  uint16_t v;
  std::memcpy(&v, &h, 2);
  return v;
}

void ReduceBool(ReduceOp op, char* dst, const char* src, uint64_t count) {
  // As torch's NCCL backend: sum and max are "or", product and min "and".
  auto* d = reinterpret_cast<uint8_t*>(dst);
  const auto* s = reinterpret_cast<const uint8_t*>(src);
  const bool any = op == ReduceOp::kSum || op == ReduceOp::kMax;
  for (uint64_t i = 0; i < count; ++i) {
    d[i] = any ? static_cast<uint8_t>((d[i] | s[i]) != 0) : static_cast<uint8_t>(d[i] && s[i]);
  }
}

template <typename T>
void DivideTyped(char* dst, uint64_t count, uint64_t n) {
  T* d = reinterpret_cast<T*>(dst);
  for (uint64_t i = 0; i < count; ++i) d[i] = static_cast<T>(d[i] / static_cast<T>(n));
}


}  // namespace

void InitSharedMutex(pthread_mutex_t* mu) {
  pthread_mutexattr_t attr;
  pthread_mutexattr_init(&attr);
  pthread_mutexattr_setpshared(&attr, PTHREAD_PROCESS_SHARED);
  pthread_mutexattr_setrobust(&attr, PTHREAD_MUTEX_ROBUST);
  pthread_mutex_init(mu, &attr);
  pthread_mutexattr_destroy(&attr);
}

bool LockShared(pthread_mutex_t* mu) {
  const int r = pthread_mutex_lock(mu);
  if (r == EOWNERDEAD) {
    pthread_mutex_consistent(mu);
    return true;
  }
  return false;
}

const char* DtypeName(int8_t dtype) {
  switch (dtype) {
    case kUInt8: return "uint8";
    case kInt8: return "int8";
    case kInt16: return "int16";
    case kInt32: return "int32";
    case kInt64: return "int64";
    case kHalf: return "float16";
    case kFloat: return "float32";
    case kDouble: return "float64";
    case kComplexHalf: return "complex32";
    case kComplexFloat: return "complex64";
    case kComplexDouble: return "complex128";
    case kBool: return "bool";
    case kBFloat16: return "bfloat16";
    case kUInt16: return "uint16";
    case kUInt32: return "uint32";
    case kUInt64: return "uint64";
    case 23: return "float8_e5m2";
    case 24: return "float8_e4m3fn";
    case 25: return "float8_e5m2fnuz";
    case 26: return "float8_e4m3fnuz";
  }
  return "an unknown dtype";
}

void SetSlotMessage(GroupSlot& slot, const absl::Status& status) {
  slot.code = static_cast<int32_t>(status.code());
  const size_t n = std::min(status.message().size(), kCommMessageBytes - 1);
  std::memcpy(slot.message, status.message().data(), n);
  slot.message[n] = '\0';
}

void FinishRankSlot(CommSlot* comm, int rank, int k, const absl::Status& status,
                    const std::vector<int>& wake_fds, int self, bool wake) {
  GroupSlot& slot = comm->slots[rank][k];
  if (slot.code == 0) SetSlotMessage(slot, status);
  slot.state.store(GroupSlot::kDone, std::memory_order_seq_cst);
  comm->groups_done.fetch_add(1, std::memory_order_relaxed);
  const int e = comm->members[rank].executor;
  if (wake && e >= 0 && e < static_cast<int>(wake_fds.size()) && e != self) {
    const uint64_t one = 1;
    (void)!write(wake_fds[e], &one, sizeof(one));
  }
}

bool FailCommunicator(CommSlot* comm, const std::string& why, const std::vector<int>& wake_fds,
                      int self) {
  if (comm->state.load() == CommSlot::kFailed) return false;
  const size_t n = std::min(why.size(), kCommMessageBytes - 1);
  std::memcpy(comm->failure, why.data(), n);
  comm->failure[n] = '\0';
  comm->state.store(CommSlot::kFailed, std::memory_order_release);
  const absl::Status st = absl::AbortedError(why);
  for (uint32_t r = 0; r < comm->size; ++r) {
    for (int k = 0; k < kSlotsPerRank; ++k) {
      if (comm->slots[r][k].state.load() == GroupSlot::kPosted) {
        FinishRankSlot(comm, static_cast<int>(r), k, st, wake_fds, self);
      }
    }
  }
  for (uint32_t r = 0; r < comm->size; ++r) {
    const int e = comm->members[r].executor;
    if (e >= 0 && e < static_cast<int>(wake_fds.size()) && e != self) {
      const uint64_t one = 1;
      (void)!write(wake_fds[e], &one, sizeof(one));
    }
  }
  return true;
}

absl::Status CheckReducible(int8_t dtype, ReduceOp op) {
  switch (dtype) {
    case kUInt8: case kInt8: case kInt16: case kInt32: case kInt64: case kHalf: case kFloat:
    case kDouble: case kBFloat16: case kUInt16: case kUInt32: case kUInt64:
      return absl::OkStatus();
    case kBool:
      if (op == ReduceOp::kAvg) {
        return absl::InvalidArgumentError("avg cannot reduce bool tensors");
      }
      return absl::OkStatus();
    case kComplexFloat:
    case kComplexDouble:
      if (op == ReduceOp::kMin || op == ReduceOp::kMax) {
        return absl::InvalidArgumentError(absl::StrCat(
            tpu::ReduceOpName(op), " cannot reduce ", DtypeName(dtype),
            " tensors (complex numbers have no order)"));
      }
      return absl::OkStatus();
    default:
      return absl::InvalidArgumentError(absl::StrCat(
          "reductions of ", DtypeName(dtype),
          " tensors are not supported (gather, broadcast and all_to_all move them)"));
  }
}

void ReduceInto(int8_t dtype, ReduceOp op, char* dst, const char* src, uint64_t count) {
  switch (dtype) {
    case kUInt8: return ReduceTyped<uint8_t>(op, dst, src, count);
    case kInt8: return ReduceTyped<int8_t>(op, dst, src, count);
    case kInt16: return ReduceTyped<int16_t>(op, dst, src, count);
    case kInt32: return ReduceTyped<int32_t>(op, dst, src, count);
    case kInt64: return ReduceTyped<int64_t>(op, dst, src, count);
    case kUInt16: return ReduceTyped<uint16_t>(op, dst, src, count);
    case kUInt32: return ReduceTyped<uint32_t>(op, dst, src, count);
    case kUInt64: return ReduceTyped<uint64_t>(op, dst, src, count);
    case kFloat: return ReduceTyped<float>(op, dst, src, count);
    case kDouble: return ReduceTyped<double>(op, dst, src, count);
    case kHalf: return ReduceHalfLike<HalfToFloat, FloatToHalf>(op, dst, src, count);
    case kBFloat16: return ReduceHalfLike<Bf16ToFloat, FloatToBf16>(op, dst, src, count);
    case kComplexFloat: return ReduceComplex<float>(op, dst, src, count);
    case kComplexDouble: return ReduceComplex<double>(op, dst, src, count);
    case kBool: return ReduceBool(op, dst, src, count);
    default: return;  // refused by CheckReducible
  }
}

void DivideBy(int8_t dtype, char* dst, uint64_t count, uint64_t n) {
  switch (dtype) {
    case kUInt8: return DivideTyped<uint8_t>(dst, count, n);
    case kInt8: return DivideTyped<int8_t>(dst, count, n);
    case kInt16: return DivideTyped<int16_t>(dst, count, n);
    case kInt32: return DivideTyped<int32_t>(dst, count, n);
    case kInt64: return DivideTyped<int64_t>(dst, count, n);
    case kUInt16: return DivideTyped<uint16_t>(dst, count, n);
    case kUInt32: return DivideTyped<uint32_t>(dst, count, n);
    case kUInt64: return DivideTyped<uint64_t>(dst, count, n);
    case kFloat: return DivideTyped<float>(dst, count, n);
    case kDouble: return DivideTyped<double>(dst, count, n);
    case kComplexFloat: return DivideTyped<std::complex<float>>(dst, count * 1, n);
    case kComplexDouble: return DivideTyped<std::complex<double>>(dst, count, n);
    case kHalf: {
      auto* d = reinterpret_cast<uint16_t*>(dst);
      for (uint64_t i = 0; i < count; ++i) d[i] = FloatToHalf(HalfToFloat(d[i]) / n);
      return;
    }
    case kBFloat16: {
      auto* d = reinterpret_cast<uint16_t*>(dst);
      for (uint64_t i = 0; i < count; ++i) d[i] = FloatToBf16(Bf16ToFloat(d[i]) / n);
      return;
    }
    default:
      return;
  }
}

absl::Status BufferBytes(const PostedOp& op, const int64_t* send_counts,
                         const int64_t* recv_counts, int n, int rank, uint64_t* send_bytes,
                         uint64_t* recv_bytes) {
  const uint64_t esize = static_cast<uint64_t>(tpu::ElementSize(op.dtype));
  // Bounded so that n * count * esize cannot overflow: no chip has 2^48 bytes.
  constexpr uint64_t kMaxBytes = uint64_t{1} << 48;
  auto bytes = [&](uint64_t elements, uint64_t* out) -> absl::Status {
    if (elements > kMaxBytes / std::max<uint64_t>(esize, 1)) {
      return absl::InvalidArgumentError(absl::StrCat(
          tpu::CollectiveKindName(op.kind), " of ", elements,
          " elements is larger than any chip's memory"));
    }
    *out = elements * esize;
    return absl::OkStatus();
  };
  const uint64_t size = static_cast<uint64_t>(n);
  if (op.count > kMaxBytes) return bytes(op.count, send_bytes);
  const bool root = op.peer == rank;
  *send_bytes = 0;
  *recv_bytes = 0;
  switch (op.kind) {
    case CollectiveKind::kAllReduce:
      if (absl::Status s = bytes(op.count, send_bytes); !s.ok()) return s;
      return bytes(op.count, recv_bytes);
    case CollectiveKind::kBroadcast:
      if (root) {
        if (absl::Status s = bytes(op.count, send_bytes); !s.ok()) return s;
      }
      return bytes(op.count, recv_bytes);
    case CollectiveKind::kReduce:
      if (absl::Status s = bytes(op.count, send_bytes); !s.ok()) return s;
      return root ? bytes(op.count, recv_bytes) : absl::OkStatus();
    case CollectiveKind::kAllGather:
      if (absl::Status s = bytes(op.count, send_bytes); !s.ok()) return s;
      return bytes(op.count * size, recv_bytes);
    case CollectiveKind::kReduceScatter:
      if (absl::Status s = bytes(op.count * size, send_bytes); !s.ok()) return s;
      return bytes(op.count, recv_bytes);
    case CollectiveKind::kGather:
      if (absl::Status s = bytes(op.count, send_bytes); !s.ok()) return s;
      return root ? bytes(op.count * size, recv_bytes) : absl::OkStatus();
    case CollectiveKind::kScatter:
      if (root) {
        if (absl::Status s = bytes(op.count * size, send_bytes); !s.ok()) return s;
      }
      return bytes(op.count, recv_bytes);
    case CollectiveKind::kAllToAll: {
      uint64_t sends = 0, recvs = 0;
      for (int j = 0; j < n; ++j) {
        sends += static_cast<uint64_t>(send_counts[j]);
        recvs += static_cast<uint64_t>(recv_counts[j]);
        if (sends > kMaxBytes || recvs > kMaxBytes) return bytes(kMaxBytes + 1, send_bytes);
      }
      if (absl::Status s = bytes(sends, send_bytes); !s.ok()) return s;
      return bytes(recvs, recv_bytes);
    }
    case CollectiveKind::kBarrier:
      return absl::OkStatus();
    case CollectiveKind::kSend:
      return bytes(op.count, send_bytes);
    case CollectiveKind::kRecv:
      return bytes(op.count, recv_bytes);
  }
  return absl::OkStatus();
}

void CountRoute(CollectiveTable* table, const CommSlot* comm, int rank_a, int rank_b,
                uint64_t bytes) {
  if (bytes == 0) return;
  const int u = comm->members[rank_a].chip;
  const int v = comm->members[rank_b].chip;
  if (u == v || u < 0 || v < 0 || u >= kMaxTableChips || v >= kMaxTableChips) return;
  for (int k = 0; k < kMaxRouteLinks; ++k) {
    const int16_t e = table->routes[u][v][k];
    if (e < 0) break;
    const int link = e / 2;
    if (link >= static_cast<int>(table->num_links)) break;
    table->links[link].bytes[e % 2].fetch_add(bytes, std::memory_order_relaxed);
  }
}

namespace {

// Per rank, bytes of one tile: small enough that a tile of every rank's
// buffers stays in cache while the ring's steps run over it.
constexpr uint64_t kTileBytes = 64 * 1024;

struct Chunking {
  uint64_t lo, hi;
  int n;
  uint64_t begin(int c) const { return lo + (hi - lo) * c / n; }
  uint64_t end(int c) const { return lo + (hi - lo) * (c + 1) / n; }
};

int Mod(int a, int n) { return ((a % n) + n) % n; }

// Ring all-reduce of elements [lo, hi) of every rank's `buf` (in place),
// ranks in `order`: n - 1 reduce-scatter steps, then n - 1 all-gather steps.
void RingAllReduce(CollectiveTable* t, const CommSlot* comm, const std::vector<int>& order,
                   const std::vector<char*>& buf, const PostedOp& op, uint64_t esize,
                   uint64_t lo, uint64_t hi) {
  const int n = static_cast<int>(order.size());
  if (hi <= lo || n < 2) return;
  const Chunking ch{lo, hi, n};
  for (int s = 0; s < n - 1; ++s) {
    for (int p = 0; p < n; ++p) {
      const int src = order[p], dst = order[Mod(p + 1, n)], c = Mod(p - s, n);
      const uint64_t b = ch.begin(c), len = ch.end(c) - b;
      ReduceInto(op.dtype, op.reduce, buf[dst] + b * esize, buf[src] + b * esize, len);
      CountRoute(t, comm, src, dst, len * esize);
    }
  }
  if (op.reduce == ReduceOp::kAvg) {
    for (int p = 0; p < n; ++p) {
      const int c = Mod(p + 1, n);
      const uint64_t b = ch.begin(c);
      DivideBy(op.dtype, buf[order[p]] + b * esize, ch.end(c) - b, n);
    }
  }
  for (int s = 0; s < n - 1; ++s) {
    for (int p = 0; p < n; ++p) {
      const int src = order[p], dst = order[Mod(p + 1, n)], c = Mod(p + 1 - s, n);
      const uint64_t b = ch.begin(c), len = ch.end(c) - b;
      std::memcpy(buf[dst] + b * esize, buf[src] + b * esize, len * esize);
      CountRoute(t, comm, src, dst, len * esize);
    }
  }
}

// Ring all-gather of elements [lo, hi) of each rank's block: recv[r] holds n
// blocks of `count` elements; block q comes from rank q.
void RingAllGather(CollectiveTable* t, const CommSlot* comm, const std::vector<int>& order,
                   const std::vector<char*>& recv, uint64_t count, uint64_t esize, uint64_t lo,
                   uint64_t hi) {
  const int n = static_cast<int>(order.size());
  const uint64_t len = (hi - lo) * esize;
  if (len == 0) return;
  for (int s = 0; s < n - 1; ++s) {
    for (int p = 0; p < n; ++p) {
      const int src = order[p], dst = order[Mod(p + 1, n)], owner = order[Mod(p - s, n)];
      const uint64_t off = (static_cast<uint64_t>(owner) * count + lo) * esize;
      std::memcpy(recv[dst] + off, recv[src] + off, len);
      CountRoute(t, comm, src, dst, len);
    }
  }
}

// Ring reduce-scatter of elements [lo, hi) of every block: send[r] holds n
// blocks of `count` elements; rank r's recv gets block r reduced over ranks.
// Partial sums travel in `scratch` (n positions x n blocks x tile).
void RingReduceScatter(CollectiveTable* t, const CommSlot* comm, const std::vector<int>& order,
                       const std::vector<char*>& send, const std::vector<char*>& recv,
                       const PostedOp& op, uint64_t esize, uint64_t lo, uint64_t hi,
                       char* scratch) {
  const int n = static_cast<int>(order.size());
  const uint64_t len = hi - lo;
  if (len == 0) return;
  const uint64_t tile = len * esize;
  // Chunk c at position p lives at scratch + (p * n + c) * tile and holds
  // block order[c - 1]: position p ends with chunk p + 1, its own block.
  auto at = [&](int p, int c) { return scratch + (static_cast<uint64_t>(p) * n + c) * tile; };
  for (int p = 0; p < n; ++p) {
    for (int c = 0; c < n; ++c) {
      const int block = order[Mod(c - 1, n)];
      std::memcpy(at(p, c), send[order[p]] + (static_cast<uint64_t>(block) * op.count + lo) * esize,
                  tile);
    }
  }
  for (int s = 0; s < n - 1; ++s) {
    for (int p = 0; p < n; ++p) {
      const int q = Mod(p + 1, n), c = Mod(p - s, n);
      ReduceInto(op.dtype, op.reduce, at(q, c), at(p, c), len);
      CountRoute(t, comm, order[p], order[q], tile);
    }
  }
  for (int p = 0; p < n; ++p) {
    char* own = at(p, Mod(p + 1, n));
    if (op.reduce == ReduceOp::kAvg) DivideBy(op.dtype, own, len, n);
    std::memcpy(recv[order[p]] + lo * esize, own, tile);
  }
}

}  // namespace

// Bytes the ring schedules move in all, over every link, for an element-wise
// kind with `block` bytes per rank.
static uint64_t RingBytesMoved(CollectiveKind kind, int n, uint64_t block) {
  const uint64_t hops = static_cast<uint64_t>(n - 1);
  switch (kind) {
    case CollectiveKind::kAllReduce: return 2 * hops * block;
    case CollectiveKind::kAllGather:
    case CollectiveKind::kReduceScatter: return hops * block * static_cast<uint64_t>(n);
    default: return hops * block;
  }
}

void RunCollective(CollectiveTable* table, CommSlot* comm, const std::vector<const PostedOp*>& ops,
                   const std::vector<char*>& send, const std::vector<char*>& recv,
                   const std::vector<const int64_t*>& send_counts,
                   const std::vector<const int64_t*>& recv_counts, std::vector<char>* scratch) {
  const int n = static_cast<int>(comm->size);
  const PostedOp& op = *ops[0];
  const uint64_t esize = static_cast<uint64_t>(tpu::ElementSize(op.dtype));
  const uint64_t count = op.count;
  std::vector<int> order(comm->ring, comm->ring + n);
  std::vector<int> reverse(order.rbegin(), order.rend());
  const uint64_t tile = std::max<uint64_t>(kTileBytes / std::max<uint64_t>(esize, 1), 1);
  int start = 0;  // ring position of the root (rooted kinds)
  if (op.kind == CollectiveKind::kBroadcast || op.kind == CollectiveKind::kReduce) {
    while (order[start] != op.peer) ++start;
  }
  // The elements [lo, hi) of every rank's block: the element-wise kinds split
  // into ranges that run independently (on several threads when large).
  auto run_range = [&](uint64_t lo_all, uint64_t hi_all, std::vector<char>& buf) {
    switch (op.kind) {
      case CollectiveKind::kAllReduce: {
        for (int r = 0; r < n; ++r) {
          if (recv[r] != send[r]) {
            std::memmove(recv[r] + lo_all * esize, send[r] + lo_all * esize,
                         (hi_all - lo_all) * esize);
          }
        }
        // Bidirectional ring, pipelined in tiles: the first half of each
        // tile goes one way round, the second half the other.
        const uint64_t big_tile = tile * n;
        for (uint64_t lo = lo_all; lo < hi_all; lo += big_tile) {
          const uint64_t hi = std::min(hi_all, lo + big_tile);
          const uint64_t mid = lo + (hi - lo) / 2;
          RingAllReduce(table, comm, order, recv, op, esize, lo, mid);
          RingAllReduce(table, comm, reverse, recv, op, esize, mid, hi);
        }
        break;
      }
      case CollectiveKind::kAllGather: {
        for (int r = 0; r < n; ++r) {
          std::memmove(recv[r] + (static_cast<uint64_t>(r) * count + lo_all) * esize,
                       send[r] + lo_all * esize, (hi_all - lo_all) * esize);
        }
        for (uint64_t lo = lo_all; lo < hi_all; lo += tile) {
          const uint64_t hi = std::min(hi_all, lo + tile);
          const uint64_t mid = lo + (hi - lo) / 2;
          RingAllGather(table, comm, order, recv, count, esize, lo, mid);
          RingAllGather(table, comm, reverse, recv, count, esize, mid, hi);
        }
        break;
      }
      case CollectiveKind::kReduceScatter: {
        const uint64_t t = std::max<uint64_t>(tile / n, 1);
        buf.resize(static_cast<size_t>(n) * n * t * esize);
        for (uint64_t lo = lo_all; lo < hi_all; lo += t) {
          const uint64_t hi = std::min(hi_all, lo + t);
          const uint64_t mid = lo + (hi - lo) / 2;
          RingReduceScatter(table, comm, order, send, recv, op, esize, lo, mid, buf.data());
          RingReduceScatter(table, comm, reverse, send, recv, op, esize, mid, hi, buf.data());
        }
        break;
      }
      case CollectiveKind::kBroadcast: {
        // Along the ring from the root, one hop after another.
        const int root = op.peer;
        const uint64_t off = lo_all * esize, len = (hi_all - lo_all) * esize;
        if (recv[root] != send[root]) std::memmove(recv[root] + off, send[root] + off, len);
        for (int k = 0; k + 1 < n; ++k) {
          const int src = order[Mod(start + k, n)], dst = order[Mod(start + k + 1, n)];
          std::memcpy(recv[dst] + off, recv[src] + off, len);
          CountRoute(table, comm, src, dst, len);
        }
        break;
      }
      case CollectiveKind::kReduce: {
        // Partial results travel the ring towards the root, ending there.
        const int root = op.peer;
        buf.resize(tile * esize);
        for (uint64_t lo = lo_all; lo < hi_all; lo += tile) {
          const uint64_t len = std::min(hi_all, lo + tile) - lo;
          char* acc = buf.data();
          const int first = order[Mod(start + 1, n)];
          std::memcpy(acc, send[first] + lo * esize, len * esize);
          for (int k = 2; k <= n; ++k) {
            const int prev = order[Mod(start + k - 1, n)], r = order[Mod(start + k, n)];
            ReduceInto(op.dtype, op.reduce, acc, send[r] + lo * esize, len);
            CountRoute(table, comm, prev, r, len * esize);
          }
          if (n == 1) std::memcpy(acc, send[root] + lo * esize, len * esize);
          if (op.reduce == ReduceOp::kAvg) DivideBy(op.dtype, acc, len, n);
          std::memcpy(recv[root] + lo * esize, acc, len * esize);
        }
        break;
      }
      default:
        break;
    }
  };
  uint64_t moved = 0;
  switch (op.kind) {
    case CollectiveKind::kAllReduce:
    case CollectiveKind::kAllGather:
    case CollectiveKind::kReduceScatter:
    case CollectiveKind::kBroadcast:
    case CollectiveKind::kReduce: {
      // Large operations are memory-bound: split them over the host's cores
      // (contiguous element ranges, each pipelined in tiles as above).
      const uint64_t bytes = count * esize * static_cast<uint64_t>(n);
      int threads = 1;
      if (bytes >= (uint64_t{16} << 20)) {
        threads = static_cast<int>(std::min<unsigned>(std::max(1u, std::thread::hardware_concurrency()), 8u));
      }
      if (threads == 1) {
        run_range(0, count, *scratch);
      } else {
        std::vector<std::thread> pool;
        std::vector<std::vector<char>> bufs(threads);
        const uint64_t step = (count + threads - 1) / threads;
        for (int i = 0; i < threads; ++i) {
          const uint64_t lo = std::min(count, step * i), hi = std::min(count, step * (i + 1));
          if (i + 1 == threads) {
            run_range(lo, hi, bufs[i]);  // this thread takes the last range
          } else {
            pool.emplace_back([&, lo, hi, i] { run_range(lo, hi, bufs[i]); });
          }
        }
        for (std::thread& t : pool) t.join();
      }
      if (n == 1 && op.kind == CollectiveKind::kAllReduce && op.reduce == ReduceOp::kAvg) {
        DivideBy(op.dtype, recv[0], count, 1);
      }
      moved = RingBytesMoved(op.kind, n, count * esize);
      break;
    }
    case CollectiveKind::kGather:
      for (int r = 0; r < n; ++r) {
        std::memmove(recv[op.peer] + static_cast<uint64_t>(r) * count * esize, send[r],
                     count * esize);
        CountRoute(table, comm, r, op.peer, count * esize);
      }
      moved = (n - 1) * count * esize;
      break;
    case CollectiveKind::kScatter:
      for (int r = 0; r < n; ++r) {
        std::memmove(recv[r], send[op.peer] + static_cast<uint64_t>(r) * count * esize,
                     count * esize);
        CountRoute(table, comm, op.peer, r, count * esize);
      }
      moved = (n - 1) * count * esize;
      break;
    case CollectiveKind::kAllToAll:
      // Direct: block j of rank i goes to rank j's block i, by the shortest
      // route.
      for (int i = 0; i < n; ++i) {
        uint64_t send_off = 0;
        for (int j = 0; j < n; ++j) {
          uint64_t recv_off = 0;
          for (int k = 0; k < i; ++k) recv_off += static_cast<uint64_t>(recv_counts[j][k]);
          const uint64_t bytes = static_cast<uint64_t>(send_counts[i][j]) * esize;
          std::memcpy(recv[j] + recv_off * esize, send[i] + send_off * esize, bytes);
          CountRoute(table, comm, i, j, bytes);
          if (i != j) moved += bytes;
          send_off += static_cast<uint64_t>(send_counts[i][j]);
        }
      }
      break;
    case CollectiveKind::kBarrier:
    case CollectiveKind::kSend:
    case CollectiveKind::kRecv:
      break;
  }
  comm->bytes_moved.fetch_add(moved, std::memory_order_relaxed);
}

void CountCollectiveTraffic(CollectiveTable* table, CommSlot* comm, const PostedOp& op,
                            const std::vector<const int64_t*>& send_counts) {
  const int n = static_cast<int>(comm->size);
  const uint64_t esize = static_cast<uint64_t>(tpu::ElementSize(op.dtype));
  const uint64_t block = op.count * esize;
  std::vector<int> order(comm->ring, comm->ring + n);
  std::vector<int> reverse(order.rbegin(), order.rend());
  // Each link between ring neighbours, in both directions of the ring.
  auto around = [&](const std::vector<int>& ring, uint64_t per_link) {
    if (n < 2) return;
    for (int p = 0; p < n; ++p) CountRoute(table, comm, ring[p], ring[Mod(p + 1, n)], per_link);
  };
  uint64_t moved = 0;
  switch (op.kind) {
    case CollectiveKind::kAllReduce: {
      // Half each way round; 2(n - 1) steps of a 1/n share of that half.
      const uint64_t half = block / 2;
      around(order, 2 * (n - 1) * (half / n));
      around(reverse, 2 * (n - 1) * ((block - half) / n));
      moved = RingBytesMoved(op.kind, n, block);
      break;
    }
    case CollectiveKind::kAllGather:
    case CollectiveKind::kReduceScatter: {
      const uint64_t half = block / 2;
      around(order, (n - 1) * half);
      around(reverse, (n - 1) * (block - half));
      moved = RingBytesMoved(op.kind, n, block);
      break;
    }
    case CollectiveKind::kBroadcast:
    case CollectiveKind::kReduce: {
      int start = 0;
      while (start < n && order[start] != op.peer) ++start;
      for (int k = 0; k + 1 < n; ++k) {
        const int a = order[Mod(start + k, n)], b = order[Mod(start + k + 1, n)];
        if (op.kind == CollectiveKind::kBroadcast) {
          CountRoute(table, comm, a, b, block);
        } else {
          CountRoute(table, comm, b, a, block);
        }
      }
      moved = RingBytesMoved(op.kind, n, block);
      break;
    }
    case CollectiveKind::kGather:
    case CollectiveKind::kScatter:
      for (int r = 0; r < n; ++r) {
        if (op.kind == CollectiveKind::kGather) {
          CountRoute(table, comm, r, op.peer, block);
        } else {
          CountRoute(table, comm, op.peer, r, block);
        }
      }
      moved = (n - 1) * block;
      break;
    case CollectiveKind::kAllToAll:
      for (int i = 0; i < n; ++i) {
        for (int j = 0; j < n; ++j) {
          const uint64_t bytes = static_cast<uint64_t>(send_counts[i][j]) * esize;
          CountRoute(table, comm, i, j, bytes);
          if (i != j) moved += bytes;
        }
      }
      break;
    default:
      break;
  }
  comm->bytes_moved.fetch_add(moved, std::memory_order_relaxed);
}

}  // namespace tpud
