"""Shared fixtures: a real tpud started on sockets in a temporary folder."""
import pathlib
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))
from tpud_process import TpudProcess  # noqa: E402


def bazel_bin(rel):
    """A binary built by Bazel (`bazel build //...` runs before pytest)."""
    path = ROOT / "bazel-bin" / rel
    if not path.exists():
        pytest.skip(f"{rel} not built; run `bazel build //...` first")
    return str(path)


class Daemon(TpudProcess):
    """The project's tpud, started and serving (tools/tpud_process.py)."""

    def __init__(self, extra_flags=(), hbm="256MiB"):
        super().__init__(bazel_bin("daemon/tpud"), hbm, extra_flags, prefix="tpud-py.")
        self.start()

    def stop(self):
        self.close()


@pytest.fixture
def daemon():
    d = Daemon()
    yield d
    d.stop()
