#!/bin/bash
# tools/emu_coverage.py on a made-up tree and made-up test logs: the kernels
# it finds (templated, __launch_bounds__, a declaration before its
# definition, one commented out, a test's own kernel left out), a kernel no
# record launches named with its file and line, two kernels of one name in
# two files told apart by the launching file, a header's kernel counted for
# the file that launches it, records read zipped and unzipped (of the tests
# --tests lists, when it is given), no record at all refused; --instances on
# a small shared object built here (nm's instantiations, the launched one
# found by its offset); a __global__ it cannot read refused.
set -euo pipefail
tool=$(realpath "$1")
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
fail() { echo "emu_coverage_test: $*"; exit 1; }
mkdir -p "$tmp/src/ops" "$tmp/src/third_party/emu" "$tmp/logs/a/b_test/test.outputs" "$tmp/logs/c_test/shard_1_of_2/test.outputs"
cat >"$tmp/src/ops/a.cu" <<'C'
// __global__ void in_a_comment(int) is not a kernel
template <typename T, int V>
__global__ void __launch_bounds__(std::max(256, V)) scale_kernel(T* x, int n);
template <typename T, int V>
__global__ void __launch_bounds__(std::max(256, V)) scale_kernel(T* x, int n) {}
__global__ void reduce_rows_kernel(float* x) {}
C
cat >"$tmp/src/ops/b.cu" <<'C'
#include "ops/rows.cuh"
static __global__ void reduce_rows_kernel(float* x) {}
const char* s = "__global__ void in_a_string()"; const char q = '"';  // __global__ void after_a_quote()
C
cat >"$tmp/src/ops/rows.cuh" <<'C'
namespace cuda {
template <bool kMean>
__global__ void norm_kernel(float* y) {}
}
C
echo '__global__ void own_kernel() {}' >"$tmp/src/ops/a_test.cu"
echo '__global__ void emulator_kernel() {}' >"$tmp/src/third_party/emu/e.cu"
out=$("$tool" --root "$tmp/src" --testlogs "$tmp/logs" 2>&1) && fail "passed with no record: $out"
grep -q "no launch record" <<<"$out" || fail "no record: $out"
# b_test's records unzipped, c_test's zipped in a shard's outputs.
printf '3\tops/a.cu\t-\tscale_kernel<T, VEC>\n1\tops/a.cu\t-\treduce_rows_kernel\n' >"$tmp/logs/a/b_test/test.outputs/emu_launches.11.txt"
printf '2\tops/b.cu\t-\tcuda::norm_kernel<false>\n' >"$tmp/emu_launches.12.txt"
(cd "$tmp" && python3 -c "import zipfile; z = zipfile.ZipFile('logs/c_test/shard_1_of_2/test.outputs/outputs.zip', 'w'); z.write('emu_launches.12.txt'); z.close()")
cp "$tmp/emu_launches.12.txt" "$tmp/logs/c_test/shard_1_of_2/test.outputs/"  # as bazel leaves it: counted once
if out=$("$tool" --root "$tmp/src" --testlogs "$tmp/logs"); then fail "passed with b.cu's reduce_rows_kernel unlaunched: $out"; fi
grep -q "1 of 4 CUDA kernels launched by no emulated test (2 launch records" <<<"$out" || fail "the count: $out"
grep -q "reduce_rows_kernel (ops/b.cu:2)" <<<"$out" || fail "b.cu's kernel not named with its line: $out"
grep -q "a.cu\|norm_kernel\|own_kernel\|emulator_kernel\|in_a_" <<<"$out" && fail "named a launched kernel or a non-kernel: $out"
printf '5\tops/b.cu\t-\treduce_rows_kernel\n' >"$tmp/logs/a/b_test/test.outputs/emu_launches.13.txt"
out=$("$tool" --root "$tmp/src" --testlogs "$tmp/logs") || fail "failed with every kernel launched: $out"
grep -q "all 4 CUDA kernels launched under the emulation (11 launches by 2 tests, 3 launch records)" <<<"$out" || fail "the summary: $out"
# --tests: a test left out of the list (c_test, say deleted since) is not read.
printf '//a:b_test\n' >"$tmp/tests"
if out=$("$tool" --root "$tmp/src" --testlogs "$tmp/logs" --tests "$tmp/tests"); then fail "--tests read c_test: $out"; fi
grep -q "norm_kernel (ops/rows.cuh:3)" <<<"$out" || fail "--tests: $out"
list=$("$tool" --root "$tmp/src" --testlogs "$tmp/logs" --list)
grep -q "^norm_kernel  ops/rows.cuh:3  2 launches  c_test$" <<<"$list" || fail "--list: $list"
grep -q "^scale_kernel  ops/a.cu:3  3 launches  a/b_test$" <<<"$list" || fail "--list: $list"
# --instances: the instantiations compiled in an object that a record
# names, read with nm, and which of them a record's offset launched; an
# object cached from elsewhere found under bazel-bin by its path after /bin/.
mkdir -p "$tmp/bin/lib"
cat >"$tmp/k.cc" <<'C'
namespace ember { namespace {
template <typename T, int V> void scale_kernel(T* x, int n) { x[0] *= V; }
void reduce_rows_kernel(float* x) { x[0] = 0; }
}
void (*keep[])() = {reinterpret_cast<void (*)()>(&scale_kernel<float, 4>),
                    reinterpret_cast<void (*)()>(&scale_kernel<double, 1>),
                    reinterpret_cast<void (*)()>(&reduce_rows_kernel)};
}
C
g++ -shared -fPIC -O0 -o "$tmp/bin/lib/libk.so" "$tmp/k.cc" || fail "cannot build the object"
off() { nm -C --defined-only "$tmp/bin/lib/libk.so" | awk -v k="$1" 'index($0, k) { print $1; exit }' | sed 's/^0*//'; }
f4=$(off "scale_kernel<float, 4>")
[ -n "$f4" ] || fail "no scale_kernel<float, 4> in the object"
rm "$tmp"/logs/a/b_test/test.outputs/*.txt "$tmp/logs/c_test/shard_1_of_2/test.outputs/outputs.zip"
printf '3\tops/a.cu\t/elsewhere/bin/lib/libk.so+%s\tscale_kernel<T, VEC>\n1\tops/a.cu\t-\treduce_rows_kernel\n2\tops/b.cu\t-\treduce_rows_kernel\n1\tops/b.cu\t-\tcuda::norm_kernel<true>\n' "$f4" \
  >"$tmp/logs/a/b_test/test.outputs/emu_launches.14.txt"
out=$("$tool" --root "$tmp/src" --testlogs "$tmp/logs" --bazel-bin "$tmp/bin" --instances) || fail "--instances: $out"
grep -q "1 of 3 kernel instantiations ran under the emulation" <<<"$out" || fail "--instances' count: $out"
grep -q "^  scale_kernel: 1 of 2$" <<<"$out" || fail "--instances' scale_kernel: $out"
grep -q "not run: ember::{anon}::scale_kernel<double, 1>" <<<"$out" || fail "--instances' idle one: $out"
grep -q "^  reduce_rows_kernel: 0 of 1$" <<<"$out" || fail "--instances' reduce_rows_kernel: $out"
grep -q "not run: .*scale_kernel<float, 4>" <<<"$out" && fail "--instances named the launched one: $out"
# A __global__ whose name it cannot read fails, naming the place.
echo '__global__ void [[gnu::hot]] hot_kernel(int n) {}' >"$tmp/src/ops/c.cu"
if out=$("$tool" --root "$tmp/src" --testlogs "$tmp/logs"); then fail "passed with an unreadable kernel: $out"; fi
grep -q "cannot read the kernel's name after __global__ at ops/c.cu:1" <<<"$out" || fail "the unreadable kernel: $out"
echo "emu_coverage: ok"
