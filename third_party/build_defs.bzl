"""The project's build macros: CUDA compilation, its host emulation, the
CPU-only configuration, and test wrappers.

cuda_library compiles each .cu with nvcc in a genrule (Bazel 4 has no CUDA
rules offline) for sm_90 SASS plus compute_90 PTX, so newer GPUs JIT from PTX.
It also yields <name>_emu: the same .cu files rewritten by
third_party/cuda_emu/cu2emu.py and compiled as host C++ against the CUDA
emulator, so the kernels run (and are tested) on a machine without a GPU.

Three ways a kernel library is linked:
  - default: <name> pulls in <name>_cuda_kernels (the nvcc objects) and cudart;
  - emulated: a test that depends on <name>_emu first gets the emulated objects
    (alwayslink, so their symbols are defined before the linker reaches the
    nvcc archive, whose members are then never pulled) and the emulated
    runtime, cuBLAS and cuDNN; the .cc sources are the same compiled objects;
  - CPU-only (--config=cpu, or no toolkit found by cuda_configure.bzl): no .cu,
    no CUDA library, and `no_cuda_srcs` define the *_cuda launchers as errors.
"""

load("@cuda//:defs.bzl", "CUDA_FOUND", "CUDA_PATH")

CUDA_ARCH_FLAGS = "-gencode arch=compute_90,code=sm_90 -gencode arch=compute_90,code=compute_90"

# The env of a test that compares two emulated runs bit for bit: one
# emulator thread, so atomics (the fused attention backward's dq, unless
# deterministic_algorithms() is on) add in one order in both runs and the
# comparison tests what it means to, not their order. Real GPUs order
# atomics as they like.
EMU_ONE_THREAD = {"EMU_THREADS": "1"}

def if_cuda(if_true, if_false = []):
    """A select() of if_true when CUDA code is built, else if_false.

    CUDA code is built unless the toolkit is missing (decided when the @cuda
    repository is configured) or the build runs with --config=cpu.
    """
    if not CUDA_FOUND:
        return if_false
    return select({
        str(Label("//third_party:cpu_only")): if_false,
        "//conditions:default": if_true,
    })

def cuda_required():
    """target_compatible_with for targets that need CUDA (real or emulated):
    in the CPU-only configuration they are skipped instead of built."""
    return if_cuda([], [Label("//third_party:cuda_toolkit")])

def cpu_only_required():
    """target_compatible_with for checks of the CPU-only configuration itself."""
    return if_cuda([Label("//third_party:cuda_toolkit")], [])

def _repo_root():
    # Includes are written from ember's root ("core/..."); when ember is an
    # external repository of another workspace, that root is external/<name>.
    repo = native.repository_name()
    return "." if repo == "@" else "external/" + repo[1:]

def _emu_rewrite(name, src):
    """A genrule running cu2emu.py on src; returns the rewritten file."""
    out = name + "_emu_srcs/" + src.replace(".cu", ".emu.cc")
    native.genrule(
        name = name + "_emu_" + src.replace("/", "_").replace(".", "_"),
        srcs = [src],
        outs = [out],
        tools = [Label("//third_party/cuda_emu:cu2emu.py")],
        cmd = "python3 $(location %s) $(location %s) $@" % (Label("//third_party/cuda_emu:cu2emu.py"), src),
        target_compatible_with = cuda_required(),
        testonly = 1,
    )
    return out

def _emu_copts(root):
    return [
        "-include",
        root + "/third_party/cuda_emu/cuda_emu.h",
        "-Wno-unknown-pragmas",
        "-Wno-unused-variable",
    ]

def cuda_library(name, srcs, hdrs = [], deps = [], copts = [], no_cuda_srcs = [], **kwargs):
    """A cc_library whose .cu sources are compiled by nvcc, plus <name>_emu.

    Args:
      name: target name.
      srcs: .cu files; .cc/.h files are passed to the cc_library.
      hdrs: public headers.
      deps: cc_library deps (their headers are visible to nvcc).
      copts: extra nvcc flags.
      no_cuda_srcs: .cc files compiled instead of the .cu files in the
        CPU-only configuration (launchers that raise "built without CUDA").
      **kwargs: passed to the cc_library.
    """
    root = _repo_root()
    cu_srcs = [s for s in srcs if s.endswith(".cu")]
    other_srcs = [s for s in srcs if not s.endswith(".cu")]
    visibility = kwargs.get("visibility", None)

    if CUDA_FOUND:
        objs = []
        for src in cu_srcs:
            obj = name + "_objs/" + src.replace(".cu", ".o")
            native.genrule(
                name = name + "_" + src.replace("/", "_").replace(".", "_"),
                srcs = [src] + hdrs,
                outs = [obj],
                cmd = " ".join([
                    CUDA_PATH + "/bin/nvcc",
                    "-std=c++20 -O3 --expt-relaxed-constexpr --extended-lambda",
                    CUDA_ARCH_FLAGS,
                    "-Xcompiler -fPIC -Xcompiler -fopenmp",
                    "-DEMBER_WITH_CUDA=1",
                    "-I" + root + " -I" + CUDA_PATH + "/include",
                    " ".join(copts),
                    "-c $(location " + src + ") -o $@",
                ]),
                # nvcc reads headers of deps that a genrule cannot declare: no
                # sandbox, so it sees them under any spawn strategy.
                tags = ["cuda", "no-sandbox"],
                target_compatible_with = cuda_required(),
            )
            objs.append(obj)

        # Not alwayslink: each member is pulled only by a reference from the
        # .cc code, which an emulated binary has already satisfied.
        native.cc_library(
            name = name + "_cuda_kernels",
            srcs = objs,
            deps = deps + [Label("//third_party:cudart")],
            linkstatic = 1,
            target_compatible_with = cuda_required(),
            visibility = ["//visibility:private"],
        )

        # The emulated twin: .cu -> host C++ (launches and __shared__
        # declarations rewritten, line numbers kept), compiled with the
        # emulator's header force-included.
        emu_srcs = [_emu_rewrite(name, src) for src in cu_srcs]
        native.cc_library(
            name = name + "_emu",
            srcs = emu_srcs,
            copts = _emu_copts(root),
            deps = [":" + name, Label("//third_party/cuda_emu")],
            alwayslink = 1,
            testonly = 1,
            target_compatible_with = cuda_required(),
            visibility = visibility,
        )

    native.cc_library(
        name = name,
        srcs = other_srcs + if_cuda([], no_cuda_srcs),
        hdrs = hdrs,
        deps = deps + [Label("//third_party:cuda_config")] + if_cuda([":" + name + "_cuda_kernels"]),
        **kwargs
    )

def _named_file(name, srcs, ext = ".cc"):
    """srcs as given, or the one file named after the target (the layout's
    rule: foo_test is foo_test.cc), so a BUILD file names it once."""
    return [name + ext] if srcs == None else srcs

def ember_library(name, srcs = None, hdrs = None, **kwargs):
    """A cc_library of one concept: <name>.cc and <name>.h unless srcs/hdrs
    say otherwise (srcs = [] for a header-only library)."""
    native.cc_library(
        name = name,
        srcs = _named_file(name, srcs),
        hdrs = _named_file(name, hdrs, ".h"),
        **kwargs
    )

def ember_binary(name, srcs = None, **kwargs):
    """A cc_binary whose source is <name>.cc unless srcs says otherwise."""
    native.cc_binary(name = name, srcs = _named_file(name, srcs), **kwargs)

def ember_test(name, srcs = None, deps = [], backends = ["cpu"], emu_deps = [Label("//core:core_emu")], tags = [], **kwargs):
    """A GoogleTest cc_test with the project's test main, per backend.

    Args:
      name: the test's name (…_test).
      srcs: test sources, compiled once and linked into each backend's test
        (default <name>.cc).
      deps: libraries the test uses.
      backends: "cpu" builds <name> as is (CUDA paths skip without a GPU);
        "cuda_emu" builds <name minus _test>_emu_test, linked against the
        emulated kernels and CUDA libraries, so its CUDA paths run on the CPU.
      emu_deps: the emulated twins of the cuda_library targets the test
        reaches (today only //core has .cu files).
      tags: test tags; "cuda" (needs a GPU) is dropped from the emulated test.
        "gpu": CUDA paths that run where a GPU is present and skip elsewhere,
        with no emulated twin. tools/gpu_check.sh runs, on a GPU, every test
        with the "cuda_emu" backend or either tag (tools/gpu_tests.py).
      **kwargs: passed to the cc_test rules.
    """
    srcs = _named_file(name, srcs)
    if "cuda" in tags:
        # Needs a GPU: skipped at build level in the CPU-only configuration.
        kwargs["target_compatible_with"] = cuda_required()
    # One backend: the sources go into the test itself. Several: into one
    # library that each backend's test links, so they compile once.
    single = backends == ["cpu"]
    if not single:
        native.cc_library(
            name = name + "_lib",
            srcs = srcs,
            deps = deps + [Label("//third_party:gtest")],
            alwayslink = 1,
            testonly = 1,
        )
    test_srcs = srcs if single else []
    test_deps = (deps if single else [":" + name + "_lib"]) + [Label("//third_party:gtest_main")]
    for b in backends:
        if b == "cpu":
            native.cc_test(name = name, srcs = test_srcs, deps = test_deps, tags = tags, **kwargs)
        elif b == "cuda_emu":
            if not CUDA_FOUND:
                continue  # the emulation compiles against the toolkit's headers
            base = name[:-len("_test")] if name.endswith("_test") else name
            native.cc_test(
                name = base + "_emu_test",
                # Emulated kernels first: see the module docstring.
                deps = emu_deps + test_deps,
                tags = [t for t in tags if t != "cuda"] + ["cuda_emu"],
                **dict(kwargs, target_compatible_with = cuda_required())
            )
        else:
            fail("ember_test: unknown backend '%s' (use \"cpu\" or \"cuda_emu\")" % b)

def cuda_emu_test(name, srcs, deps = [], **kwargs):
    """A GoogleTest whose .cu sources (kernels and tests together) only ever
    run under the emulator: the emulator's own tests."""
    if not CUDA_FOUND:
        return
    root = _repo_root()
    native.cc_test(
        name = name,
        srcs = [_emu_rewrite(name, s) if s.endswith(".cu") else s for s in srcs],
        copts = _emu_copts(root),
        deps = deps + [Label("//third_party/cuda_emu"), Label("//third_party:gtest_main")],
        target_compatible_with = cuda_required(),
        tags = kwargs.pop("tags", []) + ["cuda_emu"],
        **kwargs
    )

def emu_link_test(name, script, tests):
    """An sh_test running `script` on the emulated test binaries (which exist
    only where the toolkit's headers do)."""
    if not CUDA_FOUND:
        return
    native.sh_test(
        name = name,
        srcs = [script],
        args = ["$(location %s)" % t for t in tests],
        data = tests,
        target_compatible_with = cuda_required(),
    )

def ember_benchmark(name, srcs = None, deps = [], **kwargs):
    """A Google Benchmark binary (run with bazel run -c opt); its source is
    <name>.cc unless srcs says otherwise."""
    native.cc_binary(
        name = name,
        srcs = _named_file(name, srcs),
        deps = deps + [Label("//third_party:benchmark_main")],
        **kwargs
    )

def ember_fuzz_test(name, srcs = None, deps = [], corpus = None, size = "small", **kwargs):
    """A fuzz target (srcs define LLVMFuzzerTestOneInput) in two forms:

    <name>: a test that replays the corpus (testdata/fuzz/<name>/ by default)
      and fixed mutations of it with any compiler: CI's smoke run;
    <name>_fuzzer (manual): with --config=fuzz (clang, libFuzzer, ASan) the
      real fuzzer, run by tools/fuzz.sh; otherwise the same replay binary.
    """
    corpus = corpus or "testdata/fuzz/" + name
    srcs = _named_file(name, srcs)
    native.cc_library(
        name = name + "_target",
        testonly = True,
        srcs = srcs,
        deps = deps,
        alwayslink = True,
    )
    corpus_files = native.glob([corpus + "/**"])
    native.cc_test(
        name = name,
        size = size,
        deps = [":" + name + "_target", "//tools/fuzz:replay_main"],
        data = corpus_files,
        args = [native.package_name() + "/" + corpus],
        # .ci/run replays these under AddressSanitizer too.
        tags = kwargs.pop("tags", []) + ["fuzz"],
        **kwargs
    )
    native.cc_binary(
        name = name + "_fuzzer",
        testonly = True,
        deps = [":" + name + "_target"] + select({
            "//tools/fuzz:fuzzing": [],
            "//conditions:default": ["//tools/fuzz:replay_main"],
        }),
        linkopts = select({
            "//tools/fuzz:fuzzing": ["-fsanitize=fuzzer"],
            "//conditions:default": [],
        }),
        data = corpus_files,
        tags = ["manual"],
    )

def cuda_emu_cc(kind, name, **kwargs):
    """A cc_binary, cc_library or cc_test (kind "binary", "library", "test")
    that links the CUDA emulation (//core:core_emu), such as
    //bench:step_counts: declared only where the CUDA toolkit is found, as the
    *_emu_test targets are (the emulation compiles against its headers)."""
    if not CUDA_FOUND:
        return
    rule = {"binary": native.cc_binary, "library": native.cc_library, "test": native.cc_test}[kind]
    rule(name = name, target_compatible_with = cuda_required(), **kwargs)
