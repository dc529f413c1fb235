#!/usr/bin/env bash
# Bazel with the project's settings. The disk cache lives outside the checkout
# so that a fresh clone (CI) reuses outputs built earlier on this machine.
set -euo pipefail
CACHE="${TPUD_BAZEL_DISK_CACHE:-${HOME:-/root}/.cache/tpud/bazel-disk}"
mkdir -p "$CACHE"
cmd="${1:?usage: tools/bazel.sh COMMAND [ARGS...]}"
shift
case "$cmd" in
  build | test | run) exec bazel "$cmd" --disk_cache="$CACHE" "$@" ;;
  *) exec bazel "$cmd" "$@" ;;
esac
