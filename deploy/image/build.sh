#!/usr/bin/env bash
# Builds the tpud image (deploy/Containerfile) with podman, offline.
#
#   deploy/image/build.sh [--from-source | --bazel-bin DIR] [--tag TAG]
#
# No registry is needed: the Debian base image is made here with debootstrap
# from the machine's own Debian package source, of the machine's release, and
# kept as localhost/debian:<codename>-slim for later builds.
#
# By default the image takes the binaries this checkout builds (tools/bazel.sh
# build -c opt, on this machine, whose Debian release the image matches) and
# their torch libraries; --bazel-bin DIR takes the ones already built there
# (the tests pass bazel-bin, so as not to build again); --from-source builds
# them inside the image's first stage instead, as a machine with PyPI's CPU
# torch would (slow: a cold Bazel build).
#
# Podman runs with runc and without default ulimits (crun fails on hosts with
# cgroups in hybrid mode); the containers.conf that says so is written to
# $TPUD_IMAGE_CACHE (default /var/tmp/tpud-image) and exported as
# CONTAINERS_CONF. `source deploy/image/build.sh --env` sets that up alone,
# for running the image by hand.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
CACHE="${TPUD_IMAGE_CACHE:-/var/tmp/tpud-image}"

podman_env() {
  mkdir -p "$CACHE"
  cat > "$CACHE/containers.conf" <<'EOF'
[containers]
default_ulimits = []

[engine]
runtime = "runc"
EOF
  export CONTAINERS_CONF="$CACHE/containers.conf"
}

if [[ "${1:-}" == "--env" ]]; then
  podman_env
  return 0 2>/dev/null || exit 0
fi

from_source=0
bin_dir=""
tag="tpud:latest"
while (($#)); do
  case "$1" in
    --from-source) from_source=1 ;;
    --bazel-bin) bin_dir="$(cd "$2" && pwd)"; shift ;;
    --tag) tag="$2"; shift ;;
    *) echo "usage: $0 [--from-source | --bazel-bin DIR] [--tag TAG]" >&2; exit 2 ;;
  esac
  shift
done

command -v podman >/dev/null || {
  echo "build.sh: podman is not installed (apt-get install podman buildah runc debootstrap)" >&2
  exit 1
}
podman_env

# --- the base image, from this machine's Debian release ----------------------
. /etc/os-release
codename="${VERSION_CODENAME:?/etc/os-release names no Debian codename}"
base="localhost/debian:${codename}-slim"
if ! podman image exists "$base"; then
  command -v debootstrap >/dev/null || {
    echo "build.sh: debootstrap is not installed (apt-get install debootstrap)" >&2
    exit 1
  }
  mirror="$(sed -n 's/^URIs: *\(http[^ ]*debian\)$/\1/p' /etc/apt/sources.list.d/*.sources 2>/dev/null | head -1)"
  [[ -n "$mirror" ]] || mirror="$(awk '$1 == "deb" && $2 ~ /debian$/ {print $2; exit}' /etc/apt/sources.list 2>/dev/null || true)"
  mirror="${mirror:-http://deb.debian.org/debian}"
  rootfs="$CACHE/rootfs-$codename"
  rm -rf "$rootfs"
  echo "build.sh: debootstrap $codename from $mirror (a minute or two)"
  t0=$SECONDS
  debootstrap --variant=minbase "$codename" "$rootfs" "$mirror" > "$CACHE/debootstrap.log" 2>&1 || {
    tail -20 "$CACHE/debootstrap.log" >&2
    echo "build.sh: debootstrap failed (log: $CACHE/debootstrap.log)" >&2
    exit 1
  }
  # The image's apt looks where this machine's does.
  rm -f "$rootfs"/etc/apt/sources.list
  mkdir -p "$rootfs/etc/apt/sources.list.d"
  cp /etc/apt/sources.list.d/*.sources "$rootfs/etc/apt/sources.list.d/" 2>/dev/null \
    || cp /etc/apt/sources.list "$rootfs/etc/apt/sources.list"
  rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/lib/apt/lists/*
  tar -C "$rootfs" -c . | podman import -q - "$base" > /dev/null
  rm -rf "$rootfs"
  echo "build.sh: made $base in $((SECONDS - t0)) s"
fi

# --- the binaries --------------------------------------------------------------
args=(--build-arg "DEBIAN_IMAGE=$base")
if ((from_source)); then
  args+=(--build-arg BINARIES=source)
else
  cd "$ROOT"
  if [[ -z "$bin_dir" ]]; then
    tools/bazel.sh build -c opt --symlink_prefix=/tmp/tpud-image- \
      //daemon:tpud //tools/tpuctl:tpuctl //plugins/k8s_device_plugin:tpud-device-plugin
    bin_dir=/tmp/tpud-image-bin
  fi
  stage="$ROOT/.image-stage"
  rm -rf "$stage"
  mkdir -p "$stage/usr/bin" "$stage/usr/lib/tpud"
  for b in daemon/tpud tools/tpuctl/tpuctl plugins/k8s_device_plugin/tpud-device-plugin; do
    cp -L "$bin_dir/$b" "$stage/usr/bin/"
  done
  deploy/image/runtime-deps.sh "$stage"/usr/bin/* > "$stage/deps"
  grep '^copy ' "$stage/deps" | cut -d' ' -f2- | xargs -r -I{} cp -L {} "$stage/usr/lib/tpud/"
  grep '^package ' "$stage/deps" | cut -d' ' -f2 | sort -u > "$stage/runtime-packages.txt"
  rm "$stage/deps"
  trap 'rm -rf "$stage"' EXIT
  args+=(--build-arg BINARIES=host)
fi
t0=$SECONDS
podman build --network host -f "$ROOT/deploy/Containerfile" -t "$tag" "${args[@]}" "$ROOT"
echo "build.sh: built $tag in $((SECONDS - t0)) s ($(podman image inspect --format '{{.Size}}' "$tag") bytes)"
