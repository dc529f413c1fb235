#include "daemon/service/config.h"

#include <string>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "catch2_compat/catch.h"
#include "tpu/paths.h"
#include "tpu/units.h"

namespace tpud {
namespace {

// The message ConfigFromFlags fails with, or "" when it does not fail.
std::string ErrorOf(const TpudFlags& flags) {
  absl::StatusOr<TpudConfig> config = ConfigFromFlags(flags);
  return config.ok() ? "" : std::string(config.status().message());
}

TpudFlags Pjrt() {
  TpudFlags f;
  f.backend = "pjrt";
  f.pjrt_plugin = "/opt/pjrt/plugin.so";
  return f;
}

TEST_CASE("the default flags serve a simulated v6e-4 host") {
  absl::StatusOr<TpudConfig> c = ConfigFromFlags(TpudFlags{});
  REQUIRE(c.ok());
  CHECK(c->topology.name() == "v6e-4");
  CHECK(c->topology.num_chips() == 4);
  CHECK(c->topology_preset == "v6e-4");
  CHECK(c->hbm_bytes == 0);
  CHECK(c->log_level == spdlog::level::info);
  CHECK(c->session_quota_bytes == 0);
  CHECK(c->max_sessions_per_uid == 512);
  CHECK(c->pinned_pool_bytes == 256ull << 20);
  CHECK(c->max_pinned_pool_bytes == 4ull << 30);
  CHECK(c->staging_bytes == 64ull << 20);
  CHECK(c->ring_bytes == 1ull << 20);
  CHECK(c->small_pool_bytes == 2ull << 20);
  CHECK(c->intra_op_threads == 0);
  CHECK(c->op_timeout == absl::Minutes(10));
  CHECK(c->executor_spin == absl::Microseconds(50));
  CHECK(c->executor_yield == absl::Microseconds(50));
  CHECK(c->executor_quantum == absl::Microseconds(200));
  CHECK(c->executor_heap_keep == absl::Seconds(10));
  CHECK(c->executor_nice == -10);
  CHECK(c->backend == BackendKind::kSimulated);
  CHECK(std::string(BackendName(c->backend)) == "simulated");
  CHECK(c->pjrt_options.empty());
  CHECK(c->pjrt_probe_timeout == absl::Seconds(60));
  CHECK(c->pjrt_memory == PjrtMemory::kAuto);
  CHECK(c->pjrt_program_cache == 4096);
  CHECK(c->pjrt_graphs);
  CHECK(c->socket_path == tpu::RuntimeSocketPath());
  CHECK(c->admin_socket_path == tpu::AdminSocketPath());
  CHECK(c->socket_group.empty());
  CHECK(c->max_connections_per_uid == 1024);
  CHECK(c->handshake_timeout == absl::Seconds(5));
  CHECK(!c->metrics_address.has_value());
  CHECK(c->allocation_state_path.empty());  // allocations end with tpud
}

TEST_CASE("good values are parsed") {
  TpudFlags f;
  f.topology = "v5e-8";
  f.hbm_bytes = "256MiB";
  f.session_quota_bytes = "8GiB";
  f.log_level = "debug";
  f.ring_bytes = "4KiB";
  f.staging_bytes = "1MiB";
  f.socket = "/tmp/t/tpud.sock";
  f.admin_socket = "/tmp/t/admin.sock";
  f.socket_group = "tpu";
  f.metrics_address = "localhost:9464";
  f.allocation_state = "/var/lib/tpud/allocations.state";
  absl::StatusOr<TpudConfig> c = ConfigFromFlags(f);
  REQUIRE(c.ok());
  CHECK(c->topology.num_chips() == 8);
  CHECK(c->topology.hbm_bytes_per_chip() == 256ull << 20);
  CHECK(c->hbm_bytes == 256ull << 20);
  CHECK(c->session_quota_bytes == 8ull << 30);
  CHECK(c->log_level == spdlog::level::debug);
  CHECK(c->ring_bytes == 4096);
  CHECK(c->staging_bytes == 1ull << 20);
  CHECK(c->socket_path == "/tmp/t/tpud.sock");
  CHECK(c->admin_socket_path == "/tmp/t/admin.sock");
  CHECK(c->socket_group == "tpu");  // looked up later, when the socket is made
  REQUIRE(c->metrics_address.has_value());
  CHECK(c->metrics_address->host == "127.0.0.1");
  CHECK(c->metrics_address->port == 9464);
  CHECK(c->allocation_state_path == "/var/lib/tpud/allocations.state");

  f.metrics_address = "/run/tpud/metrics.sock";
  c = ConfigFromFlags(f);
  REQUIRE(c.ok());
  CHECK(c->metrics_address->unix_socket);
  CHECK(c->metrics_address->path == "/run/tpud/metrics.sock");

  f.log_level = "off";  // spdlog's name for nothing at all
  CHECK(ErrorOf(f).empty());
}

TEST_CASE("counts are clamped to what tpud accepts") {
  TpudFlags f;
  f.max_connections_per_uid = 0;
  f.max_sessions_per_uid = -3;
  f.pjrt_program_cache = 0;
  f.intra_op_threads = -2;
  absl::StatusOr<TpudConfig> c = ConfigFromFlags(f);
  REQUIRE(c.ok());
  CHECK(c->intra_op_threads == 0);  // automatic
  CHECK(c->max_connections_per_uid == 1);
  CHECK(c->max_sessions_per_uid == 0);
  CHECK(c->pjrt_program_cache == 1);
}

TEST_CASE("the PJRT backend takes its plugin, options and memory") {
  TpudFlags f = Pjrt();
  f.pjrt_option = {"cpu_device_count=4", "name=string:4"};
  f.pjrt_memory = "device";
  f.pjrt_graphs = false;
  f.pjrt_probe_timeout = absl::Seconds(3);
  absl::StatusOr<TpudConfig> c = ConfigFromFlags(f);
  REQUIRE(c.ok());
  CHECK(c->backend == BackendKind::kPjrt);
  CHECK(std::string(BackendName(c->backend)) == "pjrt");
  CHECK(c->pjrt_plugin == "/opt/pjrt/plugin.so");
  REQUIRE(c->pjrt_options.size() == 2);  // in order
  CHECK(c->pjrt_options[0].name == "cpu_device_count");
  CHECK(c->pjrt_options[0].type == PJRT_NamedValue_kInt64);
  CHECK(c->pjrt_options[0].int64_value == 4);
  CHECK(c->pjrt_options[1].type == PJRT_NamedValue_kString);
  CHECK(c->pjrt_options[1].string_value == "4");
  CHECK(c->pjrt_memory == PjrtMemory::kDevice);
  CHECK(!c->pjrt_graphs);
  CHECK(c->pjrt_probe_timeout == absl::Seconds(3));

  f.pjrt_memory = "host";
  c = ConfigFromFlags(f);
  REQUIRE(c.ok());
  CHECK(c->pjrt_memory == PjrtMemory::kHost);
}

TEST_CASE("each bad flag fails with tpud's message") {
  TpudFlags f;
  f.log_level = "loud";
  CHECK(ErrorOf(f) == "unknown --log_level=loud");

  f = TpudFlags{};
  f.hbm_bytes = "lots";
  CHECK(ErrorOf(f) == absl::StrCat("--hbm_bytes: ",
                                   tpu::ParseBytes("lots").status().message()));

  f = TpudFlags{};
  f.session_quota_bytes = "8 parsecs";
  CHECK(ErrorOf(f) ==
        absl::StrCat("--session_quota_bytes: ",
                     tpu::ParseBytes("8 parsecs").status().message()));

  f = TpudFlags{};
  f.allocation_state = "state/allocations.state";
  CHECK(ErrorOf(f) ==
        "--allocation_state=state/allocations.state: give an absolute path "
        "(e.g. /var/lib/tpud/allocations.state)");

  f = TpudFlags{};
  f.topology = "v9z-3";
  CHECK(absl::StrContains(ErrorOf(f), "v9z-3"));
  CHECK(absl::StrContains(ErrorOf(f), "v6e-4"));  // lists the known presets

  // The data plane's sizes are named by the parser's message alone.
  for (std::string TpudFlags::*size :
       {&TpudFlags::pinned_pool_bytes, &TpudFlags::max_pinned_pool_bytes,
        &TpudFlags::staging_bytes, &TpudFlags::ring_bytes,
        &TpudFlags::small_pool_bytes}) {
    f = TpudFlags{};
    f.*size = "big";
    CHECK(ErrorOf(f) == tpu::ParseBytes("big").status().message());
  }
  for (const char* ring : {"3000", "2KiB", "0"}) {
    f = TpudFlags{};
    f.ring_bytes = ring;
    CHECK(ErrorOf(f) == "--ring_bytes must be a power of two of at least 4KiB");
  }
  for (const char* pool : {"3000", "512KiB", "2GiB", "1000000"}) {
    f = TpudFlags{};
    f.small_pool_bytes = pool;
    CAPTURE(pool);
    CHECK(ErrorOf(f) ==
          "--small_pool_bytes must be 0 or whole pages from 1MiB to 1GiB");
  }
  for (auto [pool, bytes] :
       {std::pair{"0", uint64_t{0}}, std::pair{"1MiB", uint64_t{1} << 20},
        std::pair{"1GiB", uint64_t{1} << 30}}) {
    f = TpudFlags{};
    f.small_pool_bytes = pool;
    absl::StatusOr<TpudConfig> c = ConfigFromFlags(f);
    REQUIRE(c.ok());
    CHECK(c->small_pool_bytes == bytes);
  }

  for (int nice : {-21, 20}) {
    f = TpudFlags{};
    f.executor_nice = nice;
    CHECK(ErrorOf(f) == absl::StrCat("--executor_nice=", nice,
                                     " is not a nice value (-20 to 19)"));
  }

  f = TpudFlags{};
  f.executor_heap_keep = absl::Seconds(-1);
  CHECK(ErrorOf(f) ==
        "--executor_heap_keep=-1s is negative: give how long an idle executor "
        "keeps freed memory (10s, the default), or 0 to keep none");

  f = TpudFlags{};
  f.backend = "gpu";
  CHECK(ErrorOf(f) == "unknown --backend=gpu (simulated or pjrt)");
}

TEST_CASE(
    "a metrics address must be loopback HOST:PORT or a unix socket path") {
  for (auto [address, message] : {std::pair{"0.0.0.0:9464", "loopback"},
                                  std::pair{"10.1.2.3:9464", "loopback"},
                                  std::pair{"127.0.0.1:70000", "port"},
                                  std::pair{"nonsense", "HOST:PORT"}}) {
    TpudFlags f;
    f.metrics_address = address;
    const std::string error = ErrorOf(f);
    CAPTURE(address, error);
    CHECK(absl::StartsWith(error,
                           absl::StrCat("--metrics_address=", address, ": ")));
    CHECK(absl::StrContains(error, message));
  }
}

TEST_CASE("the PJRT flags are checked only for the PJRT backend") {
  TpudFlags f = Pjrt();
  f.pjrt_memory = "sometimes";
  CHECK(ErrorOf(f) == "unknown --pjrt_memory=sometimes (auto, host or device)");

  f = Pjrt();
  f.pjrt_plugin = "";
  CHECK(ErrorOf(f) == "--backend=pjrt needs --pjrt_plugin=PATH");

  f = Pjrt();
  f.pjrt_option = {"cpu_device_count=2", "cpu_device_count=int64:x"};
  CHECK(absl::StrContains(ErrorOf(f), "is not a int64"));

  // The simulated backend ignores them, as it always has.
  f.backend = "simulated";
  f.pjrt_memory = "sometimes";
  f.pjrt_plugin = "";
  CHECK(ErrorOf(f).empty());
}

TEST_CASE("the first bad flag is the one reported") {
  TpudFlags f;
  f.log_level = "loud";
  f.hbm_bytes = "lots";
  CHECK(ErrorOf(f) == "unknown --log_level=loud");
  f.log_level = "info";
  f.topology = "v9z-3";
  CHECK(absl::StartsWith(ErrorOf(f), "--hbm_bytes: "));
  f.hbm_bytes = "0";
  f.metrics_address = "nonsense";
  CHECK(absl::StartsWith(ErrorOf(f),
                         "--metrics_address="));  // before the topology
  f.metrics_address = "";
  f.backend = "gpu";
  CHECK(absl::StrContains(ErrorOf(f),
                          "v9z-3"));  // the topology before the backend
  f.topology = "v6e-4";
  f.ring_bytes = "3000";
  CHECK(absl::StrContains(ErrorOf(f),
                          "--backend=gpu"));  // the backend before sizes
}

}  // namespace
}  // namespace tpud
