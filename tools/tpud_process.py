"""A tpud process on sockets in a temporary folder.

One launcher for the pytest fixtures, the OpInfo conformance tool and the
PyTorch benchmark: start, wait until both sockets answer, point clients at it,
stop (SIGTERM, then SIGKILL) and remove the folder.
"""
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time


def can_connect(path):
    """Whether a unix stream socket at `path` accepts a connection."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.connect(path)
        return True
    except OSError:
        return False
    finally:
        s.close()


class TpudProcess:
    def __init__(self, binary, hbm="256MiB", extra_flags=(), prefix="tpud.", log_to_file=False):
        self.binary = str(binary)
        self.hbm = hbm
        self.extra_flags = list(extra_flags)
        self.dir = tempfile.mkdtemp(prefix=prefix, dir="/tmp")
        self.socket = os.path.join(self.dir, "tpud.sock")
        self.admin_socket = os.path.join(self.dir, "admin.sock")
        # Otherwise tpud's log goes to this process's stderr.
        self.log_path = os.path.join(self.dir, "tpud.log") if log_to_file else None
        self.proc = None

    def start(self, timeout=10):
        """Starts tpud and waits until it serves; RuntimeError if it does not."""
        for p in (self.socket, self.admin_socket):
            if os.path.exists(p):
                os.unlink(p)
        log = open(self.log_path, "ab") if self.log_path else None
        self.proc = subprocess.Popen(
            [self.binary, f"--socket={self.socket}", f"--admin_socket={self.admin_socket}",
             f"--hbm_bytes={self.hbm}", "--log_level=warn", *self.extra_flags],
            stdin=subprocess.DEVNULL, stdout=log, stderr=log)
        if log is not None:
            log.close()
        deadline = time.time() + timeout
        while time.time() < deadline:
            if can_connect(self.socket) and can_connect(self.admin_socket):
                return
            if self.proc.poll() is not None:
                tail = self.log_tail()
                raise RuntimeError(f"tpud exited with {self.proc.returncode}"
                                   + (f": {tail}" if tail else ""))
            time.sleep(0.01)
        self.stop_process()
        raise RuntimeError(f"tpud did not start serving on {self.socket} within {timeout} s")

    def alive(self):
        return self.proc is not None and self.proc.poll() is None

    def log_tail(self, n=5):
        if not self.log_path:
            return ""
        try:
            with open(self.log_path, errors="replace") as f:
                return " | ".join(line.strip() for line in f.readlines()[-n:])
        except OSError:
            return ""

    def env(self, base=None):
        """`base` (default: a copy of os.environ) pointed at this daemon."""
        env = dict(os.environ) if base is None else base
        env["TPUD_SOCKET"] = self.socket
        env["TPUD_ADMIN_SOCKET"] = self.admin_socket
        return env

    def stop_process(self):
        if self.alive():
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def close(self):
        """Stops tpud and removes its folder."""
        self.stop_process()
        shutil.rmtree(self.dir, ignore_errors=True)
