#!/bin/bash
# tools/gpu_tests.py on a made-up tree: which ember_tests it picks (the
# "cuda_emu" backend, the "cuda" and "gpu" tags; not a cuda_emu_test or a
# plain test), labels and names, --check failing on a test whose source asks
# for a GPU that nothing picks and passing once it is tagged, a test name in
# two packages refused (the bundle keeps binaries by name), a BUILD file
# that does not parse named.
set -euo pipefail
tool=$(realpath "$1")
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
fail() { echo "gpu_tests_test: $*"; exit 1; }
mkdir -p "$tmp/a/b" "$tmp/c" "$tmp/bazel-out/x"
cat >"$tmp/a/BUILD" <<'B'
load("//third_party:build_defs.bzl", "ember_test", "cuda_emu_test")
ember_test(name = "emu_test", backends = ["cpu", "cuda_emu"], deps = [":x"])
ember_test(name = "needs_test", tags = ["cuda"])
ember_test(name = "plain_test", deps = [":x"])
cuda_emu_test(name = "emulator_test", srcs = ["k.cu"])
B
cat >"$tmp/a/b/BUILD" <<'B'
ember_test(
    name = "paths_test",
    srcs = ["paths.cc", "helper.h"],
    tags = ["gpu"],
)
ember_test(name = "asks_test")
B
echo 'if (!cuda_is_available()) GTEST_SKIP();' >"$tmp/a/b/asks_test.cc"
echo 'TEST(A, B) {}' >"$tmp/a/plain_test.cc"
# A BUILD under bazel-* (an output tree) is not read.
echo 'ember_test(name = "emu_test", tags = ["cuda"])' >"$tmp/bazel-out/x/BUILD"
labels=$("$tool" --root "$tmp" | tr '\n' ' ')
[ "$labels" = "//a:emu_test //a:needs_test //a/b:paths_test " ] || fail "labels: '$labels'"
names=$("$tool" --root "$tmp" --names | tr '\n' ' ')
[ "$names" = "emu_test needs_test paths_test " ] || fail "names: '$names'"
if out=$("$tool" --root "$tmp" --check); then fail "--check passed a test with GPU paths left out: $out"; fi
grep -q '//a/b:asks_test asks cuda_is_available()' <<<"$out" || fail "--check did not name //a/b:asks_test: $out"
grep -q 'plain_test' <<<"$out" && fail "--check named a test without GPU paths: $out"
sed -i 's/ember_test(name = "asks_test")/ember_test(name = "asks_test", tags = ["gpu"])/' "$tmp/a/b/BUILD"
out=$("$tool" --root "$tmp" --check) || fail "--check failed a tagged tree: $out"
grep -q '4 of 5 tests run on a GPU' <<<"$out" || fail "--check's count: $out"
echo 'ember_test(name = "emu_test", tags = ["gpu"])' >"$tmp/c/BUILD"
if out=$("$tool" --root "$tmp" 2>&1); then fail "a name in two packages accepted: $out"; fi
grep -q 'more than one package: emu_test' <<<"$out" || fail "the duplicate's error: $out"
echo 'ember_test(name = ' >"$tmp/c/BUILD"
if out=$("$tool" --root "$tmp" 2>&1); then fail "an unreadable BUILD accepted"; fi
grep -q "cannot read $tmp/c/BUILD" <<<"$out" || fail "the unreadable BUILD's error: $out"
echo "gpu_tests: ok"
