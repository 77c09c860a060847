#!/usr/bin/env bash
# Installs everything ember needs on a fresh Debian 12 machine, idempotently:
# Debian packages (skipping those present) and a check of /usr/local/cuda.
# Runs as root or through sudo. Exits non-zero, saying what is missing, if it
# cannot fix something itself.
set -euo pipefail

PACKAGES=(
  bazel-bootstrap      # Bazel 4.2.3
  bazel-rules-java     # rules_java, resolved locally (see WORKSPACE)
  g++
  libabsl-dev
  libgtest-dev
  libgmock-dev
  libbenchmark-dev
  libgloo-dev
  libdnnl-dev          # oneDNN
  libopenblas-dev
  libopenblas0-openmp  # the BLAS we link: shares OpenMP's threads (third_party/BUILD)
  nlohmann-json3-dev
  libxxhash-dev
  zlib1g-dev           # gzip-compressed datasets (data/readers.cc)
  dataset-fashion-mnist
)
# --peers: also the PyTorch the benchmarks compare against (bench/compare_peers.py,
# shared/peers/). A measuring stick, never a dependency of ember itself.
if [ "${1:-}" = "--peers" ]; then PACKAGES+=(python3-torch); fi

if [ "$(id -u)" -eq 0 ]; then SUDO=""; else SUDO="sudo"; fi

missing=()
for p in "${PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done

if [ ${#missing[@]} -gt 0 ]; then
  echo "setup: installing ${missing[*]}"
  if [ -n "$SUDO" ] && ! command -v sudo >/dev/null; then
    echo "setup: not root and no sudo; install as root: apt-get install ${missing[*]}" >&2
    exit 1
  fi
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${missing[@]}" >/dev/null
else
  echo "setup: all ${#PACKAGES[@]} Debian packages present"
fi

# CUDA is not a Debian package here: it must be at /usr/local/cuda.
cuda_ok=1
for f in bin/nvcc include/cuda_runtime.h include/cublas_v2.h include/cudnn.h include/nccl.h \
         lib64/libcudart.so lib64/libcublas.so lib64/libcudnn.so lib64/libnccl.so; do
  if [ ! -e "/usr/local/cuda/$f" ]; then
    echo "setup: missing /usr/local/cuda/$f" >&2
    cuda_ok=0
  fi
done
if [ $cuda_ok -ne 1 ]; then
  echo "setup: ember needs the CUDA 13 toolkit with cuBLAS, cuDNN 9 and NCCL at /usr/local/cuda" \
       "(it compiles CUDA code even on machines without a GPU)" >&2
  exit 1
fi

for d in /usr/share/bazel/rules/java /usr/share/datasets/fashion-mnist /usr/lib/x86_64-linux-gnu/openblas-openmp; do
  [ -d "$d" ] || { echo "setup: expected $d after installing packages" >&2; exit 1; }
done
echo "setup: ok ($(/usr/local/cuda/bin/nvcc --version | grep -o 'release [0-9.]*'), $(bazel --version 2>/dev/null || echo bazel))"
