#!/usr/bin/env bash
# The CPU-only configuration's promise: its binaries link no CUDA library.
# Fails naming each binary whose dynamic section needs libcudart, libcublas,
# libcudnn, libnccl or libcurand (a dependency that bypassed if_cuda/the
# //third_party aliases).
set -uo pipefail
bad=0
for bin in "$@"; do
  libs=$(readelf -d "$bin" | grep NEEDED | grep -Eo 'lib(cudart|cublas|cublasLt|cudnn|nccl|curand)[^]]*' || true)
  if [ -n "$libs" ]; then
    echo "FAIL: $bin links $libs"
    bad=1
  else
    echo "ok: $bin links no CUDA library ($(readelf -d "$bin" | grep -c NEEDED) shared libraries)"
  fi
done
exit $bad
