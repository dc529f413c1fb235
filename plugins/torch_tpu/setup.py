"""torch_tpu: "tpu" as a native PyTorch device through tpud.

`pip install --no-build-isolation plugins/torch_tpu` builds the native part
with the project's Bazel (against the torch installed in this environment)
and installs the package.
"""
import os
import shutil
import subprocess

from setuptools import setup
from setuptools.command.build_py import build_py

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))


class BuildWithBazel(build_py):
    def run(self):
        subprocess.check_call([os.path.join(ROOT, "tools", "bazel.sh"), "build",
                               "//plugins/torch_tpu:_C.so"], cwd=ROOT)
        bin_dir = subprocess.check_output(["bazel", "info", "bazel-bin"], cwd=ROOT,
                                          text=True).strip()
        built = os.path.join(bin_dir, "plugins", "torch_tpu", "_C.so")
        target = os.path.join(HERE, "torch_tpu", "_C.so")
        shutil.copyfile(built, target)
        super().run()


setup(
    name="torch_tpu",
    version="0.1.0",
    description="TPUs as a native, shareable PyTorch device, served by tpud",
    packages=["torch_tpu"],
    package_data={"torch_tpu": ["_C.so"]},
    cmdclass={"build_py": BuildWithBazel},
    entry_points={"torch.backends": ["torch_tpu = torch_tpu:_autoload"],
                  "torch_dynamo_backends": ["tpu = torch_tpu._compile:tpu_backend"]},
    python_requires=">=3.11",
)
