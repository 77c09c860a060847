#!/usr/bin/env bash
# The emulated tests must run the emulated kernels only. They are linked
# against //core like every binary, so the nvcc objects stay out only because
# the emulated objects define the same launchers first (build_defs.bzl). If
# that ever broke, an nvcc object would be linked in and register its fat
# binary with the CUDA runtime at start-up: fail naming the binary.
set -uo pipefail
bad=0
for bin in "$@"; do
  syms=$({ nm "$bin"; nm -D "$bin"; } 2>/dev/null)
  if grep -q '__cudaRegisterAll\|__cudaRegisterFatBinary' <<<"$syms"; then
    echo "FAIL: $bin contains nvcc-compiled kernels:"
    grep '__cudaRegister' <<<"$syms" | head -3
    bad=1
  else
    echo "ok: $bin holds no nvcc object"
  fi
done
exit $bad
