#!/usr/bin/env bash
# Sets up everything, builds, and runs the main job: tpud serving a simulated
# v6e-4 host (4 chips) on temporary sockets, a short C++ client, then two
# PyTorch training processes (examples/train_tpu.py, unchanged PyTorch code on
# device "tpu") sharing the host at once, `tpuctl status` while they run, and
# their final lines next to the same run on CPU.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
tools/setup.sh
tools/bazel.sh build //daemon:tpud //tools/tpuctl:tpuctl //examples/cpp:hello_tpud 2>&1 |
  grep -E "ERROR|error:|Build completed" || true
echo "installing torch_tpu into .venv"
.venv/bin/pip install -q --no-build-isolation plugins/torch_tpu
BIN="$ROOT/bazel-bin"
PY="$ROOT/.venv/bin/python"
STEPS="${DEMO_STEPS:-200}"
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
"$BIN/daemon/tpud" --topology=v6e-4 --socket="$TPUD_SOCKET" --admin_socket="$TPUD_ADMIN_SOCKET" \
  --log_level=warn &
DAEMON=$!
for _ in $(seq 200); do [[ -S "$TPUD_ADMIN_SOCKET" ]] && break; sleep 0.05; done
"$BIN/tools/tpuctl/tpuctl" health

step "a C++ client (libtpuclient): topology, allocate 1 GiB on chip 0, release"
"$BIN/examples/cpp/hello_tpud" --chip=0 --bytes=1GiB

step "two PyTorch training processes at once: examples/train_tpu.py on tpu:0 and on tpu:1"
echo "(plain PyTorch: an MLP on synthetic spirals, AdamW, a DataLoader with pinned memory;"
echo " only the device name says \"tpu\")"
"$PY" "$ROOT/examples/train_tpu.py" --device tpu:0 --steps "$STEPS" --seed 0 > "$DIR/a.log" 2>&1 &
A=$!
PIDS+=("$A")
"$PY" "$ROOT/examples/train_tpu.py" --device tpu:1 --steps "$STEPS" --seed 0 > "$DIR/b.log" 2>&1 &
B=$!
PIDS+=("$B")
# Wait until both are training (a first progress line each), then show them.
for _ in $(seq 600); do
  grep -q '^step' "$DIR/a.log" 2>/dev/null && grep -q '^step' "$DIR/b.log" 2>/dev/null && break
  kill -0 "$A" 2>/dev/null || break
  kill -0 "$B" 2>/dev/null || break
  sleep 0.1
done
"$BIN/tools/tpuctl/tpuctl" status
rc=0
wait "$A" || rc=$?
wait "$B" || rc=$((rc ? rc : $?))
PIDS=()
for f in a b; do
  dev=$([[ $f == a ]] && echo tpu:0 || echo tpu:1)
  echo "-- $dev (progress, every 50 steps):"
  grep -E "^step (50|100|150|200|250|300)/" "$DIR/$f.log" | sed 's/^/   /' || true
  tail -n 1 "$DIR/$f.log" | sed 's/^/   /'
done
if ((rc)); then
  echo "a training process failed:"
  tail -n 5 "$DIR/a.log" "$DIR/b.log"
  exit "$rc"
fi

step "the same script on CPU with the same seed: the losses should match"
# One thread: this tiny model gains nothing from more, and avoids OpenMP spin-waits on a
# busy 2-core machine.
OMP_NUM_THREADS=1 "$PY" "$ROOT/examples/train_tpu.py" --device cpu --steps "$STEPS" --seed 0 \
  > "$DIR/cpu.log"
tail -n 1 "$DIR/cpu.log" | sed 's/^/   /'
loss_of() { tail -n 1 "$1" | sed -E 's/.* loss ([0-9.]+) .*/\1/'; }
for f in a b; do
  dev=$([[ $f == a ]] && echo tpu:0 || echo tpu:1)
  if awk -v a="$(loss_of "$DIR/$f.log")" -v b="$(loss_of "$DIR/cpu.log")" \
      'BEGIN { d = a - b; exit !(d <= 1.01e-4 && d >= -1.01e-4) }'; then
    echo "   $dev: same final loss as cpu"
  else
    echo "   $dev: final loss $(loss_of "$DIR/$f.log") differs from cpu's $(loss_of "$DIR/cpu.log")"
  fi
done
echo
echo "done: PyTorch training through tpud on a simulated host. Run tools/test.sh for the tests."
