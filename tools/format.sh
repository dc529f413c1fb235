#!/usr/bin/env bash
# Formats the project's C++ (Google style, .clang-format) with the pinned
# clang-format that tools/setup.sh installs into .venv.
#   tools/format.sh            format every tracked .cc/.h file in place
#   tools/format.sh --check    change nothing; list the files that are not
#                              formatted and exit 1 if there are any
#   tools/format.sh FILE...    format just these files
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
CF="$ROOT/.venv/bin/clang-format"
[[ -x "$CF" ]] || { echo "format: $CF is missing; run tools/setup.sh first" >&2; exit 2; }

check=0
if [[ "${1:-}" == "--check" ]]; then
  check=1
  shift
fi
if (($#)); then
  files=("$@")
else
  mapfile -t files < <(git ls-files '*.cc' '*.h' | grep -v '^third_party/')
fi

if ((check)); then
  # One clang-format for every file; its warnings name each file it would
  # change ("FILE:LINE:COL: error: code should be clang-formatted").
  if ! out="$("$CF" --style=file --dry-run -Werror "${files[@]}" 2>&1)"; then
    echo "$out" | sed -n 's/^\([^:]*\):[0-9]*:[0-9]*: error: code should be clang-formatted.*/\1/p' |
      sort -u | sed 's/^/format: not formatted (run tools\/format.sh): /'
    exit 1
  fi
  echo "format: ${#files[@]} files formatted"
else
  "$CF" --style=file -i "${files[@]}"
fi
