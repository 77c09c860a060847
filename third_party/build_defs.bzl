"""The project's build macros: CUDA compilation and test wrappers.

cuda_library compiles each .cu with nvcc in a genrule (Bazel 4 has no CUDA
rules offline) and wraps the objects in a cc_library. Targets: sm_90 SASS
plus compute_90 PTX so newer GPUs JIT from PTX.
"""

NVCC = "/usr/local/cuda/bin/nvcc"
CUDA_ARCH_FLAGS = "-gencode arch=compute_90,code=sm_90 -gencode arch=compute_90,code=compute_90"

def cuda_library(name, srcs, hdrs = [], deps = [], copts = [], **kwargs):
    """A cc_library whose .cu sources are compiled by nvcc.

    Args:
      name: target name.
      srcs: .cu files; .cc/.h files are passed to the cc_library.
      hdrs: public headers.
      deps: cc_library deps (their headers are visible to nvcc).
      copts: extra nvcc flags.
    """
    # Includes are written from ember's root ("core/..."); when ember is an
    # external repository of another workspace, that root is external/<name>.
    repo = native.repository_name()
    root = "." if repo == "@" else "external/" + repo[1:]
    cu_srcs = [s for s in srcs if s.endswith(".cu")]
    other_srcs = [s for s in srcs if not s.endswith(".cu")]
    objs = []
    for src in cu_srcs:
        obj = name + "_objs/" + src.replace(".cu", ".o")
        native.genrule(
            name = name + "_" + src.replace("/", "_").replace(".", "_"),
            srcs = [src] + hdrs,
            outs = [obj],
            cmd = " ".join([
                NVCC,
                "-std=c++20 -O3 --expt-relaxed-constexpr --extended-lambda",
                CUDA_ARCH_FLAGS,
                "-Xcompiler -fPIC -Xcompiler -fopenmp",
                "-I" + root + " -I/usr/local/cuda/include",
                " ".join(copts),
                "-c $(location " + src + ") -o $@",
            ]),
            # nvcc reads headers of deps that a genrule cannot declare: no
            # sandbox, so it sees them under any spawn strategy.
            tags = ["cuda", "no-sandbox"],
        )
        objs.append(obj)
    native.cc_library(
        name = name,
        srcs = objs + other_srcs,
        hdrs = hdrs,
        deps = deps + ["//third_party:cudart"],
        linkstatic = 1,
        alwayslink = 1,
        **kwargs
    )

def ember_test(name, srcs, deps = [], **kwargs):
    """A GoogleTest cc_test with the project's test main."""
    native.cc_test(
        name = name,
        srcs = srcs,
        deps = deps + ["//third_party:gtest_main"],
        **kwargs
    )

def ember_benchmark(name, srcs, deps = [], **kwargs):
    """A Google Benchmark binary (run with bazel run -c opt)."""
    native.cc_binary(
        name = name,
        srcs = srcs,
        deps = deps + ["//third_party:benchmark_main"],
        **kwargs
    )
