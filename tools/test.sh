#!/usr/bin/env bash
# Sets up everything (Debian packages, .venv), builds, and runs the tests:
# the Bazel C++ suites (Catch2, real daemons on temporary sockets) and the
# pytest suites. The last line is "N passed, N failed".
#
# usage: tools/test.sh [--quick]
#   (no flag)  the full run, what CI runs (.ci/run): every Bazel test, every
#              pytest, then the decoder and data-plane fuzz again under ASan.
#   --quick    the edit-and-test loop: the same setup check, build and Bazel
#              tests, the pytests not marked slow (the marker pytest.ini
#              registers), no ASan rebuild; torch_tpu is reinstalled only when
#              what Bazel built differs from what .venv holds.
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

QUICK=0
case "${1:-}" in
  "") ;;
  --quick) QUICK=1 ;;
  *)
    echo "usage: tools/test.sh [--quick]" >&2
    exit 2
    ;;
esac
if ((QUICK)); then
  echo "== tools/test.sh --quick: Bazel tests and the pytests not marked slow, no ASan"
else
  echo "== tools/test.sh: the full run (every Bazel test, every pytest, ASan)"
fi

if ! tools/setup.sh; then
  echo "setup failed"
  echo "0 passed, 1 failed"
  exit 1
fi

OUT="$(mktemp -d /tmp/tpud-test-results.XXXXXX)"
trap 'rm -rf "$OUT"' EXIT

echo "== bazel build //..."
if ! tools/bazel.sh build //... 2>&1 | tee "$OUT/build.txt" | grep -E "ERROR|error:|Elapsed|Build completed"; then
  :
fi
if ! grep -q "Build completed successfully" "$OUT/build.txt"; then
  tail -40 "$OUT/build.txt"
  echo "build failed"
  echo "0 passed, 1 failed"
  exit 1
fi

# Whether .venv's torch_tpu is what this checkout builds: the same _C.so
# (built by `bazel build //...` above) and the same Python sources.
torch_tpu_installed_is_current() {
  local installed
  installed="$(.venv/bin/python -c 'import importlib.util, os
spec = importlib.util.find_spec("torch_tpu")
print(os.path.dirname(spec.origin) if spec and spec.origin else "")' 2>/dev/null)" || return 1
  [[ -n "$installed" ]] || return 1
  cmp -s "$(bazel info bazel-bin 2>/dev/null)/plugins/torch_tpu/_C.so" "$installed/_C.so" || return 1
  local f
  for f in plugins/torch_tpu/torch_tpu/*.py; do
    cmp -s "$f" "$installed/$(basename "$f")" || return 1
  done
}

if ((QUICK)) && torch_tpu_installed_is_current; then
  echo "== torch_tpu in .venv is current"
else
  echo "== torch_tpu into .venv"
  if ! .venv/bin/pip install -q --no-build-isolation plugins/torch_tpu; then
    echo "installing torch_tpu failed"
    echo "0 passed, 1 failed"
    exit 1
  fi
fi

# The vLLM environment gets the same torch_tpu, and the vLLM platform plugin.
echo "== torch_tpu and vllm_tpud into .venv-vllm"
if ! .venv-vllm/bin/pip install -q --no-build-isolation --no-deps plugins/torch_tpu plugins/vllm_tpud; then
  echo "installing torch_tpu and vllm_tpud into .venv-vllm failed"
  echo "0 passed, 1 failed"
  exit 1
fi

echo "== bazel test //..."
tools/bazel.sh test //... --test_output=errors 2>&1 | tee "$OUT/bazel_test.txt" |
  grep -vE "^(Loading|Analyzing|\[[0-9,]+ / [0-9,]+\]|INFO: From Testing)" || true
TESTLOGS="$(bazel info bazel-testlogs 2>/dev/null)"
cp -r "$TESTLOGS" "$OUT/testlogs-main"

if ((QUICK)); then
  echo "== pytest -m \"not slow\" tests/python"
  .venv/bin/python -m pytest -q -m "not slow" tests/python --junitxml="$OUT/pytest.xml" 2>&1 | tail -25
  echo "== summary (quick: slow pytests and the ASan run left out)"
  .venv/bin/python tools/summarize_tests.py \
    --bazel "$OUT/bazel_test.txt" "$OUT/testlogs-main" "" \
    "$OUT/pytest.xml"
  exit $?
fi

echo "== pytest tests/python"
# (The slowest tests first, then the end of pytest's report.)
.venv/bin/python -m pytest -q --durations=25 tests/python --junitxml="$OUT/pytest.xml" \
  > "$OUT/pytest.txt" 2>&1
awk '/slowest 25 durations/ {on = 1; print; next} on && /^=/ {exit} on' "$OUT/pytest.txt"
tail -25 "$OUT/pytest.txt"

# The wire-format decoder and the hostile-client fuzz again, in an ASan build
# (the daemon under test is built with ASan too).
echo "== bazel test --config=asan (decoder and data-plane fuzz)"
tools/bazel.sh test --config=asan //client:op_record_test //tests:dataplane_fuzz_test \
  --test_output=errors 2>&1 | tee "$OUT/bazel_asan.txt" |
  grep -vE "^(Loading|Analyzing|\[[0-9,]+ / [0-9,]+\]|INFO: From Testing)" || true
cp -r "$(bazel info --config=asan bazel-testlogs 2>/dev/null)" "$OUT/testlogs-asan"

echo "== summary"
.venv/bin/python tools/summarize_tests.py \
  --bazel "$OUT/bazel_test.txt" "$OUT/testlogs-main" "" \
  --bazel "$OUT/bazel_asan.txt" "$OUT/testlogs-asan" "asan " \
  "$OUT/pytest.xml"
