"""Brings libtorch from the project's Python environment into the build.

The repository asks the project's Python (.venv at the workspace root, or
$TPUD_PYTHON) where torch is installed and links its headers and libraries.
"""

def _torch_repository_impl(ctx):
    root = ctx.path(Label("//:WORKSPACE")).dirname
    python = ctx.os.environ.get("TPUD_PYTHON", "")
    if not python:
        python = str(root) + "/.venv/bin/python"
    res = ctx.execute([python, "-c", "import os, sysconfig, torch; print(os.path.dirname(torch.__file__)); print(torch.__version__); print(int(torch._C._GLIBCXX_USE_CXX11_ABI)); print(sysconfig.get_paths()['include'])"])
    if res.return_code != 0:
        fail("cannot import torch with %s: %s\nRun tools/setup.sh to create .venv." % (python, res.stderr))
    lines = res.stdout.strip().split("\n")
    torch_dir, version, abi, py_include = lines[0], lines[1], lines[2], lines[3]
    ctx.symlink(torch_dir + "/include", "include")
    ctx.symlink(py_include, "python_include")
    ctx.symlink(torch_dir + "/lib", "lib")
    ctx.file("WORKSPACE", "workspace(name = \"torch\")\n")
    # The include paths are not exported (no `includes`): torch bundles its
    # own protobuf and fmt headers, which must never shadow Debian's in
    # translation units that use gRPC or spdlog. Only the TUs that include
    # ATen add them, with TORCH_COPTS.
    ctx.file("defs.bzl", """TORCH_COPTS = [
    "-isystem", "external/torch/include",
    "-isystem", "external/torch/include/torch/csrc/api/include",
]

# For Python extension modules (torch_tpu's _C).
TORCH_PYTHON_COPTS = TORCH_COPTS + ["-isystem", "external/torch/python_include"]
""")
    ctx.file("BUILD.bazel", """# torch {version} from {dir}
exports_files(["defs.bzl"])

cc_library(
    name = "torch",
    hdrs = glob(["include/**/*.h", "include/**/*.hpp", "include/**/*.cuh"], allow_empty = True),
    srcs = ["lib/libtorch.so", "lib/libtorch_cpu.so", "lib/libc10.so"],
    defines = ["_GLIBCXX_USE_CXX11_ABI={abi}"],
    linkopts = ["-Wl,-rpath,{dir}/lib"],
    visibility = ["//visibility:public"],
)

# libtorch_python and the Python headers, for extension modules only.
cc_library(
    name = "torch_python",
    hdrs = glob(["python_include/**/*.h"], allow_empty = True),
    srcs = ["lib/libtorch_python.so"],
    deps = [":torch"],
    visibility = ["//visibility:public"],
)
""".format(version = version, dir = torch_dir, abi = abi))

torch_repository = repository_rule(
    implementation = _torch_repository_impl,
    environ = ["TPUD_PYTHON"],
    local = True,
)
