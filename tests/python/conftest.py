"""Shared fixtures: a real tpud started on sockets in a temporary folder."""
import os
import pathlib
import signal
import socket
import subprocess
import tempfile
import time

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]


def bazel_bin(rel):
    """A binary built by Bazel (`bazel build //...` runs before pytest)."""
    path = ROOT / "bazel-bin" / rel
    if not path.exists():
        pytest.skip(f"{rel} not built; run `bazel build //...` first")
    return str(path)


def _can_connect(path):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.connect(path)
        return True
    except OSError:
        return False
    finally:
        s.close()


class Daemon:
    def __init__(self, extra_flags=(), hbm="256MiB"):
        self.dir = tempfile.mkdtemp(prefix="tpud-py.", dir="/tmp")
        self.socket = os.path.join(self.dir, "tpud.sock")
        self.admin_socket = os.path.join(self.dir, "admin.sock")
        self.proc = subprocess.Popen(
            [bazel_bin("daemon/tpud"), f"--socket={self.socket}",
             f"--admin_socket={self.admin_socket}", f"--hbm_bytes={hbm}",
             "--log_level=warn", *extra_flags])
        deadline = time.time() + 10
        while time.time() < deadline:
            if _can_connect(self.socket) and _can_connect(self.admin_socket):
                return
            if self.proc.poll() is not None:
                raise RuntimeError(f"tpud exited with {self.proc.returncode}")
            time.sleep(0.01)
        self.stop()
        raise RuntimeError("tpud did not start")

    def env(self):
        env = dict(os.environ)
        env["TPUD_SOCKET"] = self.socket
        env["TPUD_ADMIN_SOCKET"] = self.admin_socket
        return env

    def stop(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        for p in (self.socket, self.admin_socket):
            if os.path.exists(p):
                os.unlink(p)
        os.rmdir(self.dir)


@pytest.fixture
def daemon():
    d = Daemon()
    yield d
    d.stop()
