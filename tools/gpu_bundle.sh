#!/usr/bin/env bash
# gpu_bundle.sh: package Bazel-built binaries so they run on the lent GPU machine,
# which has the NVIDIA driver, CUDA, cuDNN and NCCL but no Bazel and none of
# the Debian libraries this project links (Abseil, Gloo, oneDNN, OpenBLAS...).
#
# Usage, from the project root:
#   tools/gpu_bundle.sh //core:ops_nn_cuda_test //examples:resnet_ddp
# It builds the targets with -c opt, copies each binary (and its .runfiles, if
# any) plus every shared library it needs that is not part of CUDA/cuDNN/NCCL/
# cuBLAS or glibc into .gpu/bundle.tar.xz, writes .gpu/run.sh and .gpu/COMMIT
# (the commit built), and makes sure .gpu/ is git-ignored locally. Then call
# the device tool's `run` with
#   carry: [".gpu"]
#   command: "bash .gpu/run.sh resnet_ddp --epochs 1"      (binary name, then args)
# Several binaries in one call: "bash .gpu/run.sh a && bash .gpu/run.sh b";
# "bash .gpu/run.sh --unpack" unpacks and runs nothing.
# run.sh unpacks once into /tmp/gpu-bundle, finds the machine's libcudnn,
# libnccl, libcublas and libcudart (system CUDA or the Python venv's nvidia
# packages) and runs the binary with them. Extra bazel flags: BAZEL_FLAGS env.
set -euo pipefail
[ $# -ge 1 ] || { sed -n '2,20p' "$0"; exit 2; }
root=$(git rev-parse --show-toplevel)
cd "$root"
tools/exclude_locally.sh /.gpu/
# The commit the binaries are built from (with +dirty for uncommitted
# changes), read before the build: gpu_perf.sh and attention_compare.py put
# it in their JSON (the binaries measured are the bundle's, whatever the
# tree's HEAD, and the tree's copy on the GPU machine need not carry .git).
built_from=$(git rev-parse --short HEAD)
[ -z "$(git status --porcelain --untracked-files=no)" ] || built_from="$built_from+dirty"
# shellcheck disable=SC2086
bazel build -c opt ${BAZEL_FLAGS:-} "$@"
stage=$(mktemp -d)
mkdir -p "$stage/bin" "$stage/lib"
skip='^(libc|libm|libdl|librt|libpthread|libgcc_s|libstdc\+\+|ld-linux.*|linux-vdso|libcuda|libcudart|libcublas|libcublasLt|libcudnn.*|libnccl|libnvrtc.*|libnvJitLink|libcufft|libcurand|libcusparse|libcusolver)\.so'
for t in "$@"; do
  pkg=${t#//}; pkg=${pkg%%:*}; name=${t##*:}
  bin="bazel-bin/${pkg:+$pkg/}$name"
  [ -x "$bin" ] || { echo "gpu_bundle: no executable at $bin for $t" >&2; exit 1; }
  cp -L "$bin" "$stage/bin/$name"
  [ -d "$bin.runfiles" ] && cp -rL "$bin.runfiles" "$stage/bin/$name.runfiles"
  ldd "$bin" | awk '/=> \//{print $1" "$3}' | while read -r so path; do
    [[ $so =~ $skip ]] && continue
    cp -L "$path" "$stage/lib/$so"
  done
done
mkdir -p .gpu
tar -C "$stage" -cJf .gpu/bundle.tar.xz bin lib
rm -rf "$stage"
cat > .gpu/run.sh <<'RUN'
#!/usr/bin/env bash
# Unpack the bundle once, find CUDA's libraries on this machine, run one binary.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
dest=/tmp/gpu-bundle
if [ ! -f "$dest/.stamp" ] || [ "$here/bundle.tar.xz" -nt "$dest/.stamp" ]; then
  rm -rf "$dest"; mkdir -p "$dest"; tar -C "$dest" -xJf "$here/bundle.tar.xz"; touch "$dest/.stamp"
fi
if [ ! -f "$dest/.ldpath" ]; then
  dirs=""
  for lib in libcudart.so.13 libcublas.so.13 libcublasLt.so.13 libcudnn.so.9 libnccl.so.2; do
    d=$(find -H /usr/local/cuda/lib64 /usr/local/cuda/targets /opt /usr/lib /usr/local/lib -name "$lib" 2>/dev/null | head -1 | xargs -r dirname)
    [ -n "$d" ] && dirs="$dirs:$d"
  done
  echo "$dirs" > "$dest/.ldpath"
fi
export LD_LIBRARY_PATH="$dest/lib$(cat "$dest/.ldpath")${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
[ "$1" = "--unpack" ] && exit 0  # unpacked, nothing to run
name=$1; shift
bin="$dest/bin/$name"
[ -x "$bin" ] || { echo "run.sh: no binary '$name' in the bundle; have: $(ls "$dest/bin" | grep -v runfiles | tr '\n' ' ')" >&2; exit 2; }
if [ -d "$bin.runfiles" ]; then
  ws=$(ls "$bin.runfiles" | grep -v MANIFEST | head -1)
  cd "$bin.runfiles/$ws"
  export TEST_SRCDIR="$bin.runfiles" TEST_WORKSPACE="$ws" RUNFILES_DIR="$bin.runfiles"
fi
exec "$bin" "$@"
RUN
chmod +x .gpu/run.sh
echo "$built_from" > .gpu/COMMIT
ls -la .gpu
echo "gpu_bundle: carry [\".gpu\"], command \"bash .gpu/run.sh <binary> [args]\" ($(du -sh .gpu | cut -f1) to carry; limit 64 MiB)"
