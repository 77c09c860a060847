"""Repositories a workspace that depends on ember must declare.

In your WORKSPACE:

    local_repository(name = "ember", path = "/path/to/ember")
    load("@ember//tools:workspace.bzl", "ember_dependencies")
    ember_dependencies(ember_path = "/path/to/ember")

Everything resolves locally (Debian packages and /usr/local/cuda), so the
build stays offline, as ember's own does. Without /usr/local/cuda (or
$EMBER_CUDA_PATH) the build is CPU-only.
"""

load("@ember//third_party:cuda_configure.bzl", "cuda_configure")

def ember_dependencies(ember_path):
    """Declares rules_java, rules_cc, remote_coverage_tools and cuda.

    Args:
      ember_path: the path given to ember's local_repository.
    """
    if not native.existing_rule("rules_java"):
        native.local_repository(name = "rules_java", path = "/usr/share/bazel/rules/java")
    if not native.existing_rule("rules_cc"):
        native.local_repository(name = "rules_cc", path = ember_path + "/third_party/rules_cc")
    if not native.existing_rule("remote_coverage_tools"):
        native.local_repository(name = "remote_coverage_tools", path = ember_path + "/third_party/coverage_tools")
    if not native.existing_rule("cuda"):
        cuda_configure(name = "cuda", build_file = "@ember//third_party:cuda.BUILD")
