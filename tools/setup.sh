#!/usr/bin/env bash
# Installs everything ember needs on a fresh Debian 12 machine, idempotently:
# Debian packages (skipping those present), then says which configuration the
# build will use: with CUDA (toolkit at /usr/local/cuda or $EMBER_CUDA_PATH)
# or CPU-only.
# Runs as root or through sudo. Exits non-zero, saying what is missing, if it
# cannot fix something itself.
set -euo pipefail

PACKAGES=(
  bazel-bootstrap      # Bazel 4.2.3
  bazel-rules-java     # rules_java, resolved locally (see WORKSPACE)
  g++
  python3              # third_party/cuda_emu/cu2emu.py rewrites kernel launches
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
  libpcre2-dev         # the tokenizers' split regexes (//text): Unicode classes and JIT
  libcurl4-openssl-dev # EtcdStore's requests to etcd's HTTP gateway (--rdzv-backend etcd)
  zlib1g-dev           # gzip-compressed datasets (data/readers.cc)
  dataset-fashion-mnist
  fortunes             # the corpus of //examples:gpt_fsdp (/usr/share/games/fortunes)
  clang-format-14      # tools/lint.sh: clang-format and git-clang-format
)
# --peers: also the PyTorch the benchmarks compare against (bench/compare_peers.py,
# bench/peers/). A measuring stick, never a dependency of ember itself.
# --plots: matplotlib, for bench/plot_scaling.py's PNGs (the plots of bench/README.md).
# --etcd: an etcd server and client, for the etcd rendezvous's tests (.ci/run
# passes it) and for users who choose --rdzv-backend etcd; curl for the test
# cluster's health check.
for arg in "$@"; do
  case "$arg" in
    --peers) PACKAGES+=(python3-torch) ;;
    --plots) PACKAGES+=(python3-matplotlib) ;;
    --etcd) PACKAGES+=(etcd-server etcd-client curl) ;;
    *) echo "setup: unknown flag '$arg' (known: --peers, --plots, --etcd)" >&2; exit 2 ;;
  esac
done

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

# CUDA is not a Debian package: it is the toolkit at $EMBER_CUDA_PATH (default
# /usr/local/cuda). Without it ember builds CPU-only (third_party/
# cuda_configure.bzl decides the same way), so its absence is not an error.
cuda=${EMBER_CUDA_PATH:-/usr/local/cuda}
cuda_missing=()
for f in bin/nvcc include/cuda_runtime.h include/cublas_v2.h include/cudnn.h include/nccl.h lib64/libcudart.so; do
  [ -e "$cuda/$f" ] || cuda_missing+=("$cuda/$f")
done
if [ ${#cuda_missing[@]} -eq 0 ]; then
  config="default (CUDA $("$cuda/bin/nvcc" --version | grep -o 'release [0-9.]*' | cut -d' ' -f2) at $cuda, plus the emulated CUDA tests)"
else
  config="CPU-only (no CUDA toolkit: missing ${cuda_missing[0]}${cuda_missing[1]:+ and $(( ${#cuda_missing[@]} - 1 )) more})"
fi

for d in /usr/share/bazel/rules/java /usr/share/datasets/fashion-mnist /usr/lib/x86_64-linux-gnu/openblas-openmp; do
  [ -d "$d" ] || { echo "setup: expected $d after installing packages" >&2; exit 1; }
done
echo "setup: ok; bazel will build the $config configuration"
