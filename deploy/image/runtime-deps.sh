#!/usr/bin/env bash
# What the tpud image's final stage needs for the given binaries: one line
# per shared library they load (ldd), either
#   package NAME   the Debian package that ships it (dpkg -S), or
#   copy PATH      a library from outside Debian's packages (torch's, in
#                  .venv), to copy into the image.
# Fails, naming it, when a library cannot be found at all.
set -euo pipefail
(($#)) || { echo "usage: $0 BINARY..." >&2; exit 2; }
declare -A seen=()
status=0
for bin in "$@"; do
  while read -r line; do
    case "$line" in
      *"=> not found"*)
        echo "runtime-deps: $bin needs ${line%% *}, which is not found" >&2
        status=1
        ;;
      *"=> /"*)
        path="${line#*=> }"
        path="${path%% (*}"
        [[ -n "${seen[$path]:-}" ]] && continue
        seen[$path]=1
        if owner="$(dpkg -S "$(readlink -f "$path")" 2>/dev/null || dpkg -S "$path" 2>/dev/null)"; then
          pkg="${owner%%:*}"
          [[ -n "${seen[pkg:$pkg]:-}" ]] && continue
          seen[pkg:$pkg]=1
          echo "package $pkg"
        else
          echo "copy $path"
        fi
        ;;
    esac
  done < <(ldd "$bin")
done
exit $status
