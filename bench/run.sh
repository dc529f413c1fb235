#!/usr/bin/env bash
# Runs tpud's benchmarks against a daemon started here on temporary sockets.
# Output: one JSON object per line (name, speed_ratio, ...): the C++ benchmarks, then
# bench/torch_bench.py (torch_tpu against CPU eager PyTorch).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
"$ROOT/tools/bazel.sh" build -c opt //daemon:tpud //bench:all >&2
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
