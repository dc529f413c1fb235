"""Shared fixtures: a real tpud started on sockets in a temporary folder."""
import json
import os
import pathlib
import subprocess
import sys
import textwrap

import pytest

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parents[1]
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


def pjrt_flags():
    """tpud's flags for the PJRT backend on XLA's CPU plugin (xla-cpu-pjrt,
    installed into .venv by the setup step), four devices."""
    import xla_plugins.xla_cpu_pjrt as xla_cpu

    plugin = os.path.join(os.path.dirname(xla_cpu.__file__), "xla_cpu_pjrt.so")
    return ["--backend=pjrt", f"--pjrt_plugin={plugin}", "--pjrt_option=cpu_device_count=4"]


@pytest.fixture(scope="module", params=["simulated", pytest.param("pjrt", marks=pytest.mark.slow),
                                        pytest.param("pjrt-device", marks=pytest.mark.slow)])
def any_backend(request):
    """One tpud for a whole test module, run once per chip backend: the
    simulated host, then the PJRT backend on XLA's CPU plugin computing on
    tpud's arena, then the same with every segment in a device buffer (as
    on a TPU, whose memory the host cannot address). The quick loop
    (`-m "not slow"`) runs the simulated host's only; test_pjrt.py's
    quick tests cover PJRT there."""
    flags = {"simulated": [], "pjrt": pjrt_flags(),
             "pjrt-device": pjrt_flags() + ["--pjrt_memory=device"]}[request.param]
    d = Daemon(hbm=getattr(request.module, "TPUD_HBM", "1GiB"), extra_flags=flags)
    d.backend = request.param
    yield d
    d.stop()


@pytest.fixture(scope="module")
def tpud(request):
    """One tpud for a whole test module; HBM per chip from the module's
    TPUD_HBM (default 1GiB)."""
    d = Daemon(hbm=getattr(request.module, "TPUD_HBM", "1GiB"))
    yield d
    d.stop()


def run_py(daemon, code, env_extra=None, check=True, timeout=120):
    """Runs `code` in a fresh interpreter pointed at `daemon`. For what a
    fresh process is the point of: import order, autoload, crashes."""
    env = daemon.env() if daemon is not None else dict(os.environ)
    env.update(env_extra or {})
    r = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env,
                       capture_output=True, text=True, timeout=timeout)
    if check:
        assert r.returncode == 0, r.stdout + r.stderr
    return r


def child_argv(fn, *args):
    """A command line that runs fn(*args) in a fresh interpreter: fn is a
    module-level function of a module in this folder (a test module's own),
    which the child imports by name; args go as JSON."""
    code = (f"import importlib, json, sys\n"
            f"sys.path.insert(0, {str(HERE)!r})\n"
            f"fn = getattr(importlib.import_module({fn.__module__!r}), {fn.__name__!r})\n"
            f"fn(*json.loads(sys.argv[1]))\n")
    return [sys.executable, "-c", code, json.dumps(args)]


def run_in_child(daemon, fn, *args, env_extra=None, check=True, timeout=120):
    """Runs fn(*args) (see child_argv) in a fresh interpreter pointed at
    `daemon`; with check, a failed assertion there fails the test with the
    child's traceback."""
    env = daemon.env()
    env.update(env_extra or {})
    r = subprocess.run(child_argv(fn, *args), env=env, capture_output=True, text=True,
                       timeout=timeout)
    if check:
        assert r.returncode == 0, r.stdout + r.stderr
    return r


def wait_reclaimed(daemon, timeout=10):
    """Waits until `daemon` has no session and no HBM in use (a killed
    client's reclaim); returns its last `tpuctl status --json`."""
    import time
    tpuctl = bazel_bin("tools/tpuctl/tpuctl")
    deadline = time.time() + timeout
    while True:
        doc = json.loads(subprocess.run([tpuctl, f"--admin_socket={daemon.admin_socket}", "status",
                                         "--json"], capture_output=True, text=True,
                                        timeout=30).stdout)
        if (not doc["sessions"] and all(c["hbm_used_bytes"] == 0 for c in doc["chips"])) or \
                time.time() > deadline:
            return doc
        time.sleep(0.05)
