// A hostile client against a real tpud: it speaks the wire protocol itself
// (no libtpuclient on the data plane) and feeds the daemon random and
// malformed records, forged tensor references and absurd sizes, while a
// well-behaved session works beside it. The daemon must survive (this test
// also runs in the ASan build: bazel test --config=asan), refuse what is
// wrong, and keep the good session's results exact.
#include <fcntl.h>
#include <grpcpp/create_channel_posix.h>
#include <grpcpp/grpcpp.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "catch2_compat/catch.h"
#include "proto/protocol.h"
#include "proto/tpud.grpc.pb.h"
#include "tests/daemon_harness.h"
#include "tpu/client.h"
#include "tpu/device_address.h"
#include "tpu/op_record.h"
#include "tpu/shm_layout.h"

namespace {

using tpud_test::TestDaemon;

// Schemas of torch 2.x; if one ever differs, its ops just fail (still fuzz).
const char* const kSchemas[] = {
    "aten::add.Tensor(Tensor self, Tensor other, *, Scalar alpha=1) -> Tensor",
    "aten::mul.Tensor(Tensor self, Tensor other) -> Tensor",
    "aten::neg(Tensor self) -> Tensor",
    "aten::copy_(Tensor(a!) self, Tensor src, bool non_blocking=False) -> "
    "Tensor(a!)",
    "aten::sum(Tensor self, *, ScalarType? dtype=None) -> Tensor",
    "aten::mm(Tensor self, Tensor mat2) -> Tensor",
    "aten::index_select(Tensor self, int dim, Tensor index) -> Tensor",
    "aten::nonzero(Tensor self) -> Tensor",
    "aten::cat(Tensor[] tensors, int dim=0) -> Tensor",
    "aten::_local_scalar_dense(Tensor self) -> Scalar",
};
constexpr int kNumSchemas = sizeof(kSchemas) / sizeof(kSchemas[0]);

int ConnectRaw(const std::string& path) {
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  std::strncpy(addr.sun_path, path.c_str(), sizeof(addr.sun_path) - 1);
  int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    close(fd);
    return -1;
  }
  return fd;
}

// One hostile session: its own gRPC connection, data-plane connection and
// mapping of the shared memory.
class RawSession {
 public:
  explicit RawSession(const std::string& socket) {
    int fd = ConnectRaw(socket);
    REQUIRE(fd >= 0);
    fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) | O_NONBLOCK);
    stub_ = tpud::v1::Runtime::NewStub(
        grpc::CreateInsecureChannelFromFd("tpud", fd));
    tpud::v1::OpenSessionRequest open;
    open.set_min_protocol_version(tpud::kMinProtocolVersion);
    open.set_max_protocol_version(tpud::kMaxProtocolVersion);
    open.set_client_name("hostile");
    tpud::v1::OpenSessionResponse opened;
    {
      grpc::ClientContext ctx;
      REQUIRE(stub_->OpenSession(&ctx, open, &opened).ok());
    }
    id_ = opened.session_id();
    tpud::v1::AllocateSegmentRequest alloc;
    alloc.set_session_id(id_);
    alloc.set_chip(0);
    alloc.set_bytes(1 << 20);
    tpud::v1::AllocateSegmentResponse seg;
    {
      grpc::ClientContext ctx;
      REQUIRE(stub_->AllocateSegment(&ctx, alloc, &seg).ok());
    }
    segment_ = seg.segment().address();
    dp_ = ConnectRaw(socket);
    REQUIRE(dp_ >= 0);
    tpu::DataPlaneHello hello{};
    std::memcpy(hello.magic, tpu::kDataPlaneMagic, 8);
    hello.session_id = id_;
    std::memcpy(hello.token, opened.data_plane_token().data(), 16);
    hello.pinned_bytes = 1 << 20;
    REQUIRE(send(dp_, &hello, sizeof(hello), MSG_NOSIGNAL) == sizeof(hello));
    tpu::DataPlaneReply reply{};
    iovec iov{&reply, sizeof(reply)};
    alignas(cmsghdr) char
        control[CMSG_SPACE(sizeof(int) * (1 + tpu::kMaxChipsPerHost))] = {};
    msghdr mh{};
    mh.msg_iov = &iov;
    mh.msg_iovlen = 1;
    mh.msg_control = control;
    mh.msg_controllen = sizeof(control);
    REQUIRE(recvmsg(dp_, &mh, MSG_WAITALL) == sizeof(reply));
    REQUIRE(reply.code == 0);
    // The memfd, then one doorbell per chip; this session works on chip 0.
    cmsghdr* cm = CMSG_FIRSTHDR(&mh);
    const size_t nfds = (cm->cmsg_len - CMSG_LEN(0)) / sizeof(int);
    REQUIRE(nfds >= 2);
    std::vector<int> fds(nfds);
    std::memcpy(fds.data(), CMSG_DATA(cm), sizeof(int) * nfds);
    const int memfd = fds[0];
    doorbell_ = fds[1];
    for (size_t i = 2; i < nfds; ++i) close(fds[i]);
    shm_bytes_ = reply.shm_bytes;
    shm_ = static_cast<char*>(mmap(nullptr, shm_bytes_, PROT_READ | PROT_WRITE,
                                   MAP_SHARED, memfd, 0));
    // A hostile client may try to shrink the memory under the daemon: sealed.
    CHECK(ftruncate(memfd, 0) != 0);
    close(memfd);
    REQUIRE(shm_ != MAP_FAILED);
    std::memcpy(&layout_, shm_, sizeof(layout_));
  }
  ~RawSession() {
    munmap(shm_, shm_bytes_);
    close(doorbell_);
    close(dp_);
  }

  uint64_t segment() const { return segment_; }
  tpu::RingControl* ctl(int s) { return tpu::RingControlOf(shm_, layout_, s); }
  uint64_t next_sequence(int s) const { return next_seq_[s]; }
  uint64_t TakeSequence(int s) { return next_seq_[s]++; }
  const tpu::ShmHeader& layout() const { return layout_; }

  // Appends raw bytes to stream `s`'s ring (with a pad record at the wrap).
  void Append(int s, absl::string_view bytes) {
    const uint64_t ring = layout_.ring_bytes;
    uint64_t pos = tail_[s] & (ring - 1);
    const uint64_t after = ring - pos;
    if (bytes.size() > after ||
        (after - bytes.size() != 0 && after - bytes.size() < 16)) {
      tpu::RecordHeader pad{static_cast<uint32_t>(ring - pos),
                            static_cast<uint16_t>(tpu::RecordKind::kPad), 0, 0};
      std::memcpy(tpu::RingOf(shm_, layout_, s) + pos, &pad, sizeof(pad));
      tail_[s] += ring - pos;
      pos = 0;
    }
    std::memcpy(tpu::RingOf(shm_, layout_, s) + pos, bytes.data(),
                bytes.size());
    tail_[s] += bytes.size();
  }
  void Publish(int s) {
    ctl(s)->submitted.store(next_seq_[s] - 1);
    ctl(s)->tail.store(tail_[s]);
    if (ctl(s)->consumer_sleeping.load()) {
      const uint64_t one = 1;
      (void)!write(doorbell_, &one, sizeof(one));
    }
  }
  // Waits until the daemon consumed everything published on `s`, or the
  // stream died. Returns false on timeout (a stuck daemon).
  bool Drain(int s, bool* dead) {
    absl::Time deadline = absl::Now() + absl::Seconds(20);
    while (absl::Now() < deadline) {
      if (ctl(s)->dead.load()) {
        *dead = true;
        return true;
      }
      if (ctl(s)->head.load() == tail_[s] &&
          ctl(s)->completed.load() + 1 == next_seq_[s]) {
        return true;
      }
      usleep(20);
    }
    std::printf(
        "stuck: stream %d head %llu tail %llu completed %llu next %llu dead "
        "%u\n",
        s, (unsigned long long)ctl(s)->head.load(),
        (unsigned long long)tail_[s],
        (unsigned long long)ctl(s)->completed.load(),
        (unsigned long long)next_seq_[s], ctl(s)->dead.load());
    return false;
  }

 private:
  std::unique_ptr<tpud::v1::Runtime::Stub> stub_;
  uint64_t id_ = 0;
  uint64_t segment_ = 0;
  int dp_ = -1;
  int doorbell_ = -1;
  char* shm_ = nullptr;
  uint64_t shm_bytes_ = 0;
  tpu::ShmHeader layout_{};
  uint64_t tail_[tpu::kStreamsPerChip] = {};
  uint64_t next_seq_[tpu::kStreamsPerChip] = {1, 1, 1, 1, 1, 1, 1, 1};
};

class Fuzzer {
 public:
  explicit Fuzzer(uint64_t seed) : rng_(seed) {}

  int Pick(int n) { return static_cast<int>(rng_() % n); }
  bool Chance(int percent) { return Pick(100) < percent; }

  tpu::TensorRef RandomTensor(uint64_t segment, uint64_t foreign) {
    tpu::TensorRef t;
    const int8_t dtypes[] = {6, 6, 6, 4, 11, 15, 5, 9, 0, 7, 3};
    t.dtype =
        Chance(3) ? static_cast<int8_t>(Pick(256) - 128) : dtypes[Pick(11)];
    t.ndim = static_cast<uint8_t>(Chance(2) ? Pick(30) : Pick(4));
    for (int d = 0; d < std::min<int>(t.ndim, tpu::kMaxDims); ++d) {
      t.sizes[d] = Chance(2) ? static_cast<int64_t>(rng_()) : Pick(40);
      t.strides[d] = Chance(2) ? static_cast<int64_t>(rng_()) : Pick(40);
    }
    t.storage_offset = Chance(3) ? static_cast<int64_t>(rng_()) : Pick(100);
    switch (Pick(10)) {
      case 0:
        t.address = rng_();
        break;  // garbage
      case 1:
        t.address = foreign + Pick(4096);
        break;  // another session's
      case 2:
        t.address = tpu::MakeDeviceAddress(Pick(6), Pick(1 << 22));
        break;
      default:
        t.address = segment + 8 * Pick(1 << 16);
        break;  // our own
    }
    return t;
  }

  tpu::OpArg RandomArg(uint64_t segment, uint64_t foreign) {
    tpu::OpArg a;
    a.tag = static_cast<tpu::ArgTag>(
        Pick(static_cast<int>(tpu::ArgTag::kLast) + 1));
    a.i = Chance(20) ? static_cast<int64_t>(rng_()) : Pick(8) - 2;
    a.d = Chance(10) ? 1e308 : (Pick(1000) - 500) / 7.0;
    a.d_imag = 1.5;
    a.b = Chance(50);
    a.device_index = Pick(3);
    switch (a.tag) {
      case tpu::ArgTag::kTensor:
        a.tensor = RandomTensor(segment, foreign);
        break;
      case tpu::ArgTag::kString:
        a.s = std::string(Pick(64), 'x');
        break;
      case tpu::ArgTag::kIntList:
        for (int k = Pick(5); k > 0; --k)
          a.ints.push_back(Chance(10) ? rng_() : Pick(6) - 1);
        break;
      case tpu::ArgTag::kDoubleList:
        for (int k = Pick(5); k > 0; --k) a.doubles.push_back(Pick(100) / 3.0);
        break;
      case tpu::ArgTag::kBoolList:
        for (int k = Pick(5); k > 0; --k) a.bools.push_back(Chance(50));
        break;
      case tpu::ArgTag::kTensorList:
      case tpu::ArgTag::kOptionalTensorList:
        for (int k = Pick(4); k > 0; --k) {
          a.tensors.push_back(RandomTensor(segment, foreign));
          a.tensor_present.push_back(!Chance(30));
        }
        break;
      default:
        break;
    }
    return a;
  }

  // One record for stream `s`. `fatal` says whether the daemon must fail the
  // session for it (malformed framing or body).
  std::string Record(RawSession& rs, int s, uint64_t foreign, bool* fatal) {
    *fatal = false;
    tpu::RecordWriter w;
    const int kind = Pick(100);
    if (kind < 1) {
      // Garbage framing: random bytes, a wrong length or a skipped sequence.
      *fatal = true;
      std::string junk(16 + 8 * Pick(8), '\0');
      for (char& c : junk) c = static_cast<char>(rng_());
      tpu::RecordHeader h;
      std::memcpy(&h, junk.data(), sizeof(h));
      if (Chance(50)) {
        h.length = static_cast<uint32_t>(junk.size());
        h.kind = static_cast<uint16_t>(1 + Pick(5));
        h.sequence = rs.next_sequence(s) + 1 + Pick(3);  // out of order
        std::memcpy(junk.data(), &h, sizeof(h));
      }
      return junk;
    }
    const uint64_t seq = rs.TakeSequence(s);
    if (kind < 8) {
      w.Begin(tpu::RecordKind::kDefineOp, seq);
      w.U32(static_cast<uint32_t>(Chance(80) ? Pick(kNumSchemas + 3) : rng_()));
      std::string schema =
          Chance(50) ? kSchemas[Pick(kNumSchemas)]
                     : std::string("aten::") + std::string(Pick(40), 'q');
      if (Chance(20)) schema.insert(schema.size() / 2, "garbage");
      w.U32(static_cast<uint32_t>(schema.size()));
      w.Bytes(schema.data(), schema.size());
    } else if (kind < 14) {
      w.Begin(tpu::RecordKind::kCopy, seq);
      w.U8(static_cast<uint8_t>(Chance(95) ? 1 + Pick(3) : Pick(256)));
      w.Pad(7);
      const uint64_t host = rs.layout().staging_offset + Pick(1 << 20);
      const uint64_t dev = Chance(70) ? rs.segment() + Pick(1 << 20) : rng_();
      const bool h2d = Chance(50);
      w.U64(Chance(10) ? rng_() : (h2d ? host : dev));
      w.U64(Chance(10) ? rng_() : (h2d ? dev : host));
      w.U64(Chance(10) ? rng_() : Pick(1 << 21));
    } else if (kind < 17) {
      w.Begin(tpu::RecordKind::kEventRecord, seq);
      w.U32(static_cast<uint32_t>(Chance(90) ? Pick(tpu::kMaxEvents) : rng_()));
      w.Pad(4);
    } else if (kind < 19) {
      // Waits only on work already done, so the stream cannot stall.
      w.Begin(tpu::RecordKind::kEventWait, seq);
      w.U32(0);
      const uint32_t other =
          static_cast<uint32_t>(Chance(90) ? Pick(tpu::kStreamsPerChip) : 99);
      w.U32(other);
      w.U64(other < static_cast<uint32_t>(tpu::kStreamsPerChip)
                ? rs.ctl(other)->completed.load()
                : 0);
    } else {
      w.Begin(tpu::RecordKind::kOp, seq);
      w.U32(static_cast<uint32_t>(Chance(95) ? Pick(kNumSchemas + 2) : rng_()));
      const int nargs = Pick(5);
      const int nouts = Pick(3);
      w.U16(static_cast<uint16_t>(nargs));
      w.U16(static_cast<uint16_t>(nouts));
      w.U32(Chance(20) ? tpu::kOpFlagSync : 0);
      for (int i = 0; i < nargs; ++i) w.Arg(RandomArg(rs.segment(), foreign));
      for (int i = 0; i < nouts; ++i)
        w.Tensor(RandomTensor(rs.segment(), foreign));
    }
    std::string rec(w.Finish());
    if (Chance(1)) {
      // Corrupt the body, keep the framing: the decoder must refuse it or
      // the op must fail cleanly (a flipped byte may still decode).
      const size_t at =
          sizeof(tpu::RecordHeader) + Pick(static_cast<int>(rec.size() - 16));
      if (at < rec.size()) rec[at] = static_cast<char>(rng_());
    }
    return rec;
  }

 private:
  std::mt19937_64 rng_;
};

TEST_CASE(
    "hostile records: the daemon survives and other sessions are untouched") {
  const char* env = std::getenv("TPUD_FUZZ_RECORDS");
  const uint64_t target =
      env != nullptr ? std::strtoull(env, nullptr, 10) : 100000;
  TestDaemon d({"--log_level=error"}, "256MiB");

  // The good session, with data the fuzzing must never touch.
  tpu::ClientOptions o;
  o.socket_path = d.socket();
  std::unique_ptr<tpu::Session> good = *tpu::Session::Open(o);
  std::vector<float> secret(1 << 16);
  for (size_t i = 0; i < secret.size(); ++i)
    secret[i] = static_cast<float>(i) * 0.5f;
  absl::StatusOr<tpu::Segment> seg = good->Allocate(0, secret.size() * 4);
  REQUIRE(seg.ok());
  REQUIRE(good->CopyToDevice(0, seg->address, secret.data(), secret.size() * 4)
              .ok());
  REQUIRE(good->Synchronize(0).ok());

  Fuzzer fuzz(20261129);
  uint64_t consumed = 0, sessions = 0, fatal_records = 0;
  while (consumed < target) {
    RawSession rs(d.socket());
    ++sessions;
    bool dead = false;
    while (!dead && consumed < target) {
      const int s = fuzz.Pick(2) == 0 ? 0 : fuzz.Pick(tpu::kStreamsPerChip);
      int batch = 1 + fuzz.Pick(32);
      for (; batch > 0; --batch) {
        bool fatal = false;
        std::string rec = fuzz.Record(rs, s, seg->address, &fatal);
        rs.Append(s, rec);
        ++consumed;
        if (fatal) {
          ++fatal_records;
          break;  // nothing after it would be read
        }
      }
      rs.Publish(s);
      REQUIRE(rs.Drain(s, &dead));
    }
  }
  std::printf(
      "fuzz: %llu hostile records in %llu sessions (%llu with broken "
      "framing)\n",
      static_cast<unsigned long long>(consumed),
      static_cast<unsigned long long>(sessions),
      static_cast<unsigned long long>(fatal_records));

  // The daemon still serves, the good session's data is exact, and every
  // hostile session's memory went back.
  std::vector<float> back(secret.size());
  REQUIRE(good->CopyToHost(0, back.data(), seg->address, back.size() * 4).ok());
  CHECK(back == secret);
  absl::StatusOr<std::unique_ptr<tpu::AdminClient>> admin =
      tpu::AdminClient::Connect(d.admin_socket());
  REQUIRE(admin.ok());
  absl::StatusOr<tpu::HealthReport> health = (*admin)->Health();
  REQUIRE(health.ok());
  CHECK(health->serving);
  REQUIRE(TestDaemon::WaitFor([&] {
    absl::StatusOr<std::vector<tpu::SessionInfo>> l = (*admin)->ListSessions();
    return l.ok() && l->size() == 1;
  }));
  absl::StatusOr<tpu::DaemonStatus> st = (*admin)->GetStatus();
  REQUIRE(st.ok());
  CHECK(st->topology.chips[0].hbm_used_bytes == seg->size);
  CHECK(d.Stop() == 0);
}

}  // namespace
