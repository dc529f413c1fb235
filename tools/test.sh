#!/usr/bin/env bash
# Sets up everything (Debian packages, .venv), builds, and runs every test:
# the Bazel C++ suites (Catch2, real daemons on temporary sockets) and the
# pytest suites. The last line is "N passed, N failed".
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

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

echo "== torch_tpu into .venv"
if ! .venv/bin/pip install -q --no-build-isolation plugins/torch_tpu; then
  echo "installing torch_tpu failed"
  echo "0 passed, 1 failed"
  exit 1
fi

echo "== bazel test //..."
tools/bazel.sh test //... --test_output=errors 2>&1 | tee "$OUT/bazel_test.txt" |
  grep -vE "^(Loading|Analyzing|\[[0-9,]+ / [0-9,]+\]|INFO: From Testing)" || true
TESTLOGS="$(bazel info bazel-testlogs 2>/dev/null)"
cp -r "$TESTLOGS" "$OUT/testlogs-main"

echo "== pytest tests/python"
.venv/bin/python -m pytest -q tests/python --junitxml="$OUT/pytest.xml" 2>&1 | tail -25

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
