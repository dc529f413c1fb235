#!/usr/bin/env bash
# Sets up everything, builds, and runs the main job: tpud serving a simulated
# v6e-4 host (4 chips) on temporary sockets, two client processes sharing it,
# `tpuctl status` while they run, and a kill -9 whose HBM comes straight back.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
tools/setup.sh
tools/bazel.sh build //daemon:tpud //tools/tpuctl:tpuctl //examples/cpp:hello_tpud \
  //examples/cpp:stream_add 2>&1 |
  grep -E "ERROR|error:|Build completed" || true
BIN="$ROOT/bazel-bin"
DIR="$(mktemp -d /tmp/tpud-demo.XXXXXX)"
export TPUD_SOCKET="$DIR/tpud.sock" TPUD_ADMIN_SOCKET="$DIR/admin.sock"
PIDS=()
cleanup() {
  for p in "${PIDS[@]}"; do kill -9 "$p" 2>/dev/null || true; done
  [[ -n "${DAEMON:-}" ]] && kill "$DAEMON" 2>/dev/null && wait "$DAEMON" 2>/dev/null
  rm -rf "$DIR"
}
trap cleanup EXIT

step() { printf '\n\033[1m== %s\033[0m\n' "$*"; }

step "starting tpud on a simulated v6e-4 host ($TPUD_SOCKET)"
"$BIN/daemon/tpud" --topology=v6e-4 --socket="$TPUD_SOCKET" --admin_socket="$TPUD_ADMIN_SOCKET" &
DAEMON=$!
for _ in $(seq 200); do [[ -S "$TPUD_ADMIN_SOCKET" ]] && break; sleep 0.05; done
"$BIN/tools/tpuctl/tpuctl" health

step "a client: topology, allocate 1 GiB on chip 0, release"
"$BIN/examples/cpp/hello_tpud" --chip=0 --bytes=1GiB

step "two clients holding HBM at once (chip 1: 6 GiB in 3 segments, chip 2: 2.5 GiB)"
"$BIN/examples/cpp/hello_tpud" --chip=1 --bytes=6GiB --segments=3 --hold_seconds=60 >/dev/null &
PIDS+=($!)
"$BIN/examples/cpp/hello_tpud" --chip=2 --bytes=2.5GiB --hold_seconds=60 >/dev/null &
PIDS+=($!)
for _ in $(seq 200); do
  [[ "$("$BIN/tools/tpuctl/tpuctl" sessions --json | grep -o '"hbm_bytes":[1-9]' | wc -l)" -ge 2 ]] && break
  sleep 0.05
done
"$BIN/tools/tpuctl/tpuctl" status

step "a third client asks for more than chip 1 has left: a clear refusal"
"$BIN/examples/cpp/hello_tpud" --chip=1 --bytes=30GiB 2>&1 >/dev/null | grep refused || true

step "kill -9 of the first client: its 6 GiB come back at once"
kill -9 "${PIDS[0]}"
sleep 0.2
"$BIN/tools/tpuctl/tpuctl" status

step "the data plane: two processes stream ops to chip 0 at once (shared memory, no gRPC per op)"
"$BIN/examples/cpp/stream_add" --chip=0 --elements=65536 --iterations=3000 --forever > "$DIR/a.log" &
PIDS+=($!)
"$BIN/examples/cpp/stream_add" --chip=0 --elements=1024 --iterations=20000 --forever > "$DIR/b.log" &
PIDS+=($!)
sleep 2.5
tail -n 2 "$DIR/a.log" "$DIR/b.log"
"$BIN/tools/tpuctl/tpuctl" status
echo
echo "done: tpud, libtpuclient and tpuctl on a simulated host. Run tools/test.sh for the tests."
