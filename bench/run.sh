#!/usr/bin/env bash
# Runs tpud's benchmarks against a daemon started here on temporary sockets.
# Output: one JSON object per line (name, speed_ratio, ...): the C++ benchmarks,
# bench/torch_bench.py (torch_tpu against CPU eager PyTorch), then the pjrt_*
# lines of bench/pjrt_bench.py (tpud's PJRT backend on XLA's CPU plugin against
# the same programs called in-process; it starts its own daemon), then the
# compiled_* lines of bench/compile_bench.py (torch.compile on tpu; pjrt_compiled_* on
# the PJRT backend), the first_ops_*, import_overhead, short_jobs_* and test_suite_* lines of
# bench/lifecycle_bench.py, then the metrics_scrape_* lines of bench/metrics_bench.py.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
"$ROOT/tools/bazel.sh" build -c opt //daemon:tpud //bench:all //examples/cpp:hello_tpud >&2
DIR="$(mktemp -d /tmp/tpud-bench.XXXXXX)"
BIN="$(tools/bazel.sh info -c opt bazel-bin 2>/dev/null)"
"$BIN/daemon/tpud" --socket="$DIR/tpud.sock" --admin_socket="$DIR/admin.sock" \
  --hbm_bytes=1GiB --log_level=warn &
PID=$!
trap 'kill $PID 2>/dev/null; wait $PID 2>/dev/null; rm -rf "$DIR"' EXIT
for _ in $(seq 100); do [[ -S "$DIR/admin.sock" ]] && break; sleep 0.05; done
export TPUD_SOCKET="$DIR/tpud.sock"
"$BIN/bench/control_plane_bench"
"$BIN/bench/dataplane_bench" "$@"
# PyTorch level (torch_tpu as installed in .venv) against CPU eager PyTorch.
"$ROOT/.venv/bin/python" "$ROOT/bench/torch_bench.py"
# The PJRT backend, on its own daemon (bench/pjrt_bench.py starts it).
"$ROOT/.venv/bin/python" "$ROOT/bench/pjrt_bench.py" --tpud "$BIN/daemon/tpud" \
  --inprocess "$BIN/bench/pjrt_inprocess_bench"
# torch.compile on tpu (programs) against tpu eager and CPU eager.
"$ROOT/.venv/bin/python" "$ROOT/bench/compile_bench.py" --start-daemon --tpud "$BIN/daemon/tpud"
# The same on the PJRT backend with device memory (a graph is one StableHLO module).
"$ROOT/.venv/bin/python" "$ROOT/bench/compile_bench.py" --start-daemon --tpud "$BIN/daemon/tpud" --backend pjrt
# New processes: their first ops, many released together, the import cost.
"$ROOT/.venv/bin/python" "$ROOT/bench/lifecycle_bench.py" --tpud "$BIN/daemon/tpud"
# What a Prometheus scrape costs with 0, 16 and 64 sessions open.
"$ROOT/.venv/bin/python" "$ROOT/bench/metrics_bench.py" --tpud "$BIN/daemon/tpud" \
  --client "$BIN/examples/cpp/hello_tpud"
