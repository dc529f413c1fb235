"""Brings XLA's PJRT C API header (and its CPU plugin, for tests) from the
project's Python environment into the build, the way torch comes in.

The PyPI package xla-cpu-pjrt (installed into .venv by tools/setup.sh) ships
the plugin xla_cpu_pjrt.so and the pjrt_c_api.h it was built with.
"""

def _pjrt_repository_impl(ctx):
    root = ctx.path(Label("//:WORKSPACE")).dirname
    python = ctx.os.environ.get("TPUD_PYTHON", "")
    if not python:
        python = str(root) + "/.venv/bin/python"
    res = ctx.execute([python, "-c", "import os, xla_plugins.xla_cpu_pjrt as m; print(os.path.dirname(m.__file__))"])
    if res.return_code != 0:
        fail("cannot import xla_plugins.xla_cpu_pjrt with %s: %s\nRun tools/setup.sh (it installs xla-cpu-pjrt into .venv)." % (python, res.stderr))
    pkg = res.stdout.strip()
    ctx.symlink(pkg + "/include", "include")
    ctx.file("WORKSPACE", "workspace(name = \"pjrt\")\n")
    ctx.file("defs.bzl", """# Where XLA's CPU PJRT plugin lies (for tests and examples).
PJRT_CPU_PLUGIN = "{pkg}/xla_cpu_pjrt.so"
""".format(pkg = pkg))
    ctx.file("BUILD.bazel", """# PJRT C API header from {pkg}
exports_files(["defs.bzl"])

cc_library(
    name = "c_api",
    hdrs = ["include/pjrt_c_api.h"],
    includes = ["include"],
    visibility = ["//visibility:public"],
)
""".format(pkg = pkg))

pjrt_repository = repository_rule(
    implementation = _pjrt_repository_impl,
    environ = ["TPUD_PYTHON"],
    local = True,
)
