"""The @cuda repository: the CUDA toolkit if it is installed, else a stub.

With the toolkit (default /usr/local/cuda, or $EMBER_CUDA_PATH) the repository
links its include/, lib64/ and bin/ and uses cuda.BUILD. Without it, the
repository still exists, so that every load() and label resolves, but its
targets are empty and defs.bzl says CUDA_FOUND = False: the build then uses
the CPU-only configuration (as --config=cpu does) instead of failing. This is
how a user without a GPU toolkit builds ember at all.
"""

_REQUIRED = [
    "include/cuda_runtime.h",
    "include/cublas_v2.h",
    "include/cudnn.h",
    "include/nccl.h",
    "lib64/libcudart.so",
    "bin/nvcc",
]

_STUB_BUILD = """# No CUDA toolkit was found at {path}: empty targets, so that labels resolve
# while the build uses the CPU-only configuration.
package(default_visibility = ["//visibility:public"])
[cc_library(name = n) for n in ["headers", "cudart", "cublas", "cublaslt", "cudnn", "nccl", "curand"]]
"""

def _cuda_configure_impl(ctx):
    path = ctx.os.environ.get("EMBER_CUDA_PATH", "/usr/local/cuda")
    missing = [f for f in _REQUIRED if not ctx.path(path + "/" + f).exists]
    found = len(missing) == 0
    if found:
        for d in ["include", "lib64", "bin"]:
            ctx.symlink(path + "/" + d, d)
        ctx.symlink(ctx.attr.build_file, "BUILD.bazel")
    else:
        ctx.file("BUILD.bazel", _STUB_BUILD.format(path = path))
    ctx.file("defs.bzl", "\n".join([
        "# Written by third_party/cuda_configure.bzl.",
        "CUDA_FOUND = %s" % found,
        "CUDA_PATH = %r" % path,
        "CUDA_MISSING = %r" % missing,
        "",
    ]))

cuda_configure = repository_rule(
    implementation = _cuda_configure_impl,
    attrs = {"build_file": attr.label(allow_single_file = True)},
    environ = ["EMBER_CUDA_PATH"],
    local = True,
)
