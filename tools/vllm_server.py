"""`vllm serve` on loopback, in its own process group: started and waited
for, asked over HTTP (urllib), stopped or killed. For tests/python/test_vllm.py
and bench/serving_bench.py."""
import atexit
import json
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request

_scratch = None


def scratch_dir():
    """A folder of this process for what vLLM processes leave in the temporary
    folder (their IPC sockets, distributed-init files), removed at exit."""
    global _scratch
    if _scratch is None:
        _scratch = tempfile.mkdtemp(prefix="vllm-tmp.")
        atexit.register(shutil.rmtree, _scratch, True)
    return _scratch


def vllm_env(daemon=None, cpu=False):
    """os.environ for a vLLM process (.venv-vllm): pointed at `daemon` (a
    TpudProcess), or on vLLM's own CPU platform with `cpu`; vLLM's sockets
    between its own processes on loopback, its temporary files in
    scratch_dir()."""
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)
    env["VLLM_HOST_IP"] = "127.0.0.1"
    env["TMPDIR"] = scratch_dir()
    env["VLLM_RPC_BASE_PATH"] = scratch_dir()
    if cpu:
        env["VLLM_TARGET_DEVICE"] = "cpu"
    if daemon is not None:
        env = daemon.env(env)
    return env


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class VllmServer:
    """`vllm serve` on loopback, in its own process group."""

    def __init__(self, vllm, model, env, args=(), log_dir=None, timeout=300):
        self.model = model
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.log_path = os.path.join(log_dir or scratch_dir(), f"serve-{self.port}.log")
        self.log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(
            [str(vllm), "serve", model, "--host", "127.0.0.1",
             "--port", str(self.port), "--dtype", "float32", "--max-model-len", "512",
             "--seed", "0", *args],
            env=env, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"vllm serve exited with {self.proc.returncode}:\n"
                                     + self.log_tail())
            try:
                with urllib.request.urlopen(self.base + "/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.5)
        self.kill()
        raise AssertionError(f"vllm serve did not come up in {timeout} s:\n" + self.log_tail())

    def log_tail(self, n=6000):
        with open(self.log_path, errors="replace") as f:
            return f.read()[-n:]

    def post(self, path, body, stream=False):
        """The JSON answer, or with stream the list of server-sent events'
        JSON payloads. An HTTP error status comes back as (status, JSON)."""
        req = urllib.request.Request(self.base + path, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=120) as r:
                if not stream:
                    return json.loads(r.read())
                events = []
                for raw in r:
                    line = raw.decode().strip()
                    if line.startswith("data: ") and line != "data: [DONE]":
                        events.append(json.loads(line[len("data: "):]))
                return events
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read())

    def complete(self, prompt, max_tokens=12, stream=False, **kw):
        body = {"model": self.model, "prompt": prompt, "max_tokens": max_tokens,
                "temperature": 0, "return_token_ids": True, "stream": stream, **kw}
        return self.post("/v1/completions", body, stream=stream)

    def pids(self):
        """This server's processes (the API server and its engine core)."""
        out = subprocess.run(["pgrep", "-s", str(self.proc.pid)], capture_output=True,
                             text=True).stdout
        return [int(p) for p in out.split()]

    def stop(self):
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.kill()
        self.log.close()

    def kill(self):
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()

    def stream_times(self, prompt, max_tokens):
        """A streamed completion of `prompt` (token ids), greedy, exactly
        max_tokens long: [(seconds since the request, tokens in the event)]
        for each event that carried tokens."""
        body = {"model": self.model, "prompt": prompt, "max_tokens": max_tokens,
                "temperature": 0, "ignore_eos": True, "stream": True, "return_token_ids": True}
        req = urllib.request.Request(self.base + "/v1/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        t0 = time.perf_counter()
        times = []
        with urllib.request.urlopen(req, timeout=300) as r:
            for raw in r:
                line = raw.decode().strip()
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                ids = json.loads(line[len("data: "):])["choices"][0].get("token_ids") or []
                if ids:
                    times.append((time.perf_counter() - t0, len(ids)))
        return times
