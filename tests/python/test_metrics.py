"""tpud's Prometheus metrics (--metrics_address), scraped by a real Prometheus.

The test starts Debian's `prometheus` on loopback with a generated
configuration that scrapes tpud every second, runs a PyTorch job through
tpud, and asks Prometheus's HTTP API for the figures while the job runs.
The Grafana dashboard in deploy/ is checked against what tpud exports.
"""
import json
import os
import pathlib
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
import urllib.parse
import urllib.request

import pytest

from conftest import ROOT, Daemon, bazel_bin, pjrt_flags

DASHBOARD = ROOT / "deploy" / "grafana" / "tpud-dashboard.json"
PROMETHEUS = shutil.which("prometheus")


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http_get(url, timeout=5):
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.status, r.read().decode()


def unix_get(path, request=b"GET /metrics HTTP/1.1\r\nHost: tpud\r\n\r\n"):
    with socket.socket(socket.AF_UNIX) as s:
        s.settimeout(10)
        s.connect(path)
        s.sendall(request)
        out = b""
        while chunk := s.recv(65536):
            out += chunk
    return out.decode()


def exported_families(text):
    """Metric names in an exposition, with histograms' series names too."""
    names = set()
    for line in text.splitlines():
        m = re.match(r"# TYPE (\S+) (\S+)", line)
        if m:
            names.add(m.group(1))
            if m.group(2) == "histogram":
                names.update(m.group(1) + s for s in ("_bucket", "_count", "_sum"))
    return names


class Prometheus:
    """Debian's Prometheus on a loopback port, scraping `target` every second."""

    def __init__(self, target):
        self.dir = tempfile.mkdtemp(prefix="tpud-prom.", dir="/tmp")
        self.port = free_port()
        config = pathlib.Path(self.dir, "prometheus.yml")
        config.write_text(textwrap.dedent(f"""\
            global:
              scrape_interval: 1s
              evaluation_interval: 1s
            scrape_configs:
              - job_name: tpud
                scrape_interval: 1s
                scrape_timeout: 900ms
                static_configs:
                  - targets: ["{target}"]
            """))
        self.log = open(os.path.join(self.dir, "prometheus.log"), "w")
        self.proc = subprocess.Popen(
            [PROMETHEUS, f"--config.file={config}",
             f"--storage.tsdb.path={self.dir}/data",
             f"--web.listen-address=127.0.0.1:{self.port}"],
            stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.time() + 60
        while time.time() < deadline:
            assert self.proc.poll() is None, self.log_tail()
            try:
                if http_get(f"http://127.0.0.1:{self.port}/-/ready", 2)[0] == 200:
                    return
            except OSError:
                pass
            time.sleep(0.2)
        raise AssertionError("prometheus did not become ready:\n" + self.log_tail())

    def log_tail(self):
        self.log.flush()
        return pathlib.Path(self.dir, "prometheus.log").read_text()[-3000:]

    def query(self, expr):
        url = (f"http://127.0.0.1:{self.port}/api/v1/query?"
               + urllib.parse.urlencode({"query": expr}))
        try:
            _, body = http_get(url)
        except urllib.error.HTTPError as e:  # a bad expression is a 400 with a JSON error
            body = e.read().decode()
        return json.loads(body)

    def values(self, expr):
        """{frozenset(labels): value} of an instant query."""
        r = self.query(expr)
        assert r["status"] == "success", (expr, r)
        return {frozenset(s["metric"].items()): float(s["value"][1])
                for s in r["data"]["result"]}

    def wait_for(self, expr, check, timeout=40):
        deadline = time.time() + timeout
        got = None
        while time.time() < deadline:
            got = self.values(expr)
            if check(got):
                return got
            time.sleep(0.5)
        raise AssertionError(f"{expr}: still {got} after {timeout} s\n{self.log_tail()}")

    def close(self):
        self.proc.terminate()
        try:
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()
        shutil.rmtree(self.dir, ignore_errors=True)


JOB = """
import os, sys, time
import torch, torch_tpu
stop, hold = sys.argv[1], sys.argv[2]
x = torch.randn(256, 256, device="tpu")
kept = torch.empty(8 << 20, dtype=torch.uint8, device="tpu")  # 8 MiB held throughout
print("ready", os.getpid(), flush=True)
while not os.path.exists(stop):
    for _ in range(20):
        x = torch.tanh(x @ x * 0.01)
    x.sum().item()
# An op error, caught; the job goes on.
try:
    torch.zeros(4, device="tpu").index_select(0, torch.tensor([9], device="tpu")).cpu()
    print("no error", flush=True)
except Exception as e:
    print("caught", type(e).__name__, flush=True)
print("after", float(x.sum().item()) == float(x.sum().item()), flush=True)
while not os.path.exists(hold):
    time.sleep(0.05)
"""


@pytest.fixture(scope="module")
def metrics_daemon():
    port = free_port()
    d = Daemon(extra_flags=[f"--metrics_address=127.0.0.1:{port}"])
    d.metrics_target = f"127.0.0.1:{port}"
    yield d
    d.stop()


@pytest.mark.slow
@pytest.mark.skipif(PROMETHEUS is None, reason="Debian's prometheus is not installed "
                    "(tools/setup.sh installs it)")
def test_prometheus_scrapes_tpud_while_a_pytorch_job_runs(metrics_daemon, tmp_path):
    d = metrics_daemon
    prom = Prometheus(d.metrics_target)
    job = None
    try:
        prom.wait_for('up{job="tpud"}', lambda v: list(v.values()) == [1.0])
        stop, hold = tmp_path / "stop", tmp_path / "hold"
        job = subprocess.Popen([sys.executable, "-c", JOB, str(stop), str(hold)],
                               env=d.env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True)
        first = job.stdout.readline().split()
        assert first[:1] == ["ready"], first + [job.stderr.read()]
        pid = first[1]

        # The session, its process and its HBM.
        info = prom.wait_for(f'tpud_session_info{{pid="{pid}"}}', lambda v: len(v) == 1)
        labels = dict(next(iter(info)))
        session = labels["session"]
        assert "python" in labels["command"], labels
        hbm = prom.wait_for(f'tpud_session_hbm_bytes{{session="{session}"}}',
                            lambda v: v and min(v.values()) >= 8 << 20)
        assert len(hbm) == 1
        # Ops flow: counters rise between scrapes, ops per second on a chip.
        prom.wait_for('sum(rate(tpud_chip_ops_total[5s]))', lambda v: v and max(v.values()) > 0)
        prom.wait_for(f'rate(tpud_session_ops_total{{session="{session}"}}[5s])',
                      lambda v: v and max(v.values()) > 0)
        used = prom.values('tpud_chip_hbm_used_bytes')
        assert sum(used.values()) >= 8 << 20, used
        total = prom.values('tpud_chip_hbm_total_bytes')
        assert len(total) == 4 and all(t == 256 << 20 for t in total.values()), total
        # Latency histogram: buckets are cumulative and the count matches +Inf.
        prom.wait_for('sum(tpud_chip_op_duration_seconds_count)', lambda v: v and max(v.values()) > 0)
        q = prom.values('histogram_quantile(0.5, sum by (le) '
                        '(rate(tpud_chip_op_duration_seconds_bucket[10s])))')
        assert q and 0 < list(q.values())[0] <= 10, q
        inf = prom.values('sum(tpud_chip_op_duration_seconds_bucket{le="+Inf"})')
        count = prom.values('sum(tpud_chip_op_duration_seconds_count)')
        assert abs(list(inf.values())[0] - list(count.values())[0]) <= \
            0.05 * list(count.values())[0] + 100
        prom.wait_for('max(tpud_chip_duty_cycle)', lambda v: v and max(v.values()) > 0)
        assert prom.values('tpud_chip_queue_depth'), "queue depth per chip is exported"
        assert len(prom.values('tpud_chip_queue_depth')) == 4

        # The job's op error is counted by status code, and the job goes on.
        before = sum(prom.values('tpud_errors_total{source="op"}').values())
        stop.touch()
        assert job.stdout.readline().startswith("caught"), job.stderr.read()
        assert job.stdout.readline().strip() == "after True"
        prom.wait_for('sum(tpud_errors_total{source="op"})',
                      lambda v: v and max(v.values()) >= before + 1)
        hold.touch()
        assert job.wait(60) == 0, job.stderr.read()
        # Its session ended: counted, and its series go away.
        prom.wait_for('tpud_sessions_ended_total{reason=~"closed|disconnected"}',
                      lambda v: sum(v.values()) >= 1)
        prom.wait_for(f'tpud_session_info{{pid="{pid}"}}', lambda v: len(v) == 0)
        opened = prom.values('tpud_sessions_opened_total')
        assert list(opened.values())[0] >= 1
        # A refused control-plane call shows as an rpc error by code.
        r = subprocess.run([bazel_bin("tools/tpuctl/tpuctl"), f"--admin_socket={d.admin_socket}",
                            "kill", "999999"], capture_output=True, text=True)
        assert r.returncode != 0
        prom.wait_for('tpud_errors_total{source="rpc",code="NOT_FOUND"}',
                      lambda v: v and max(v.values()) >= 1)
        # Executors and the build.
        ups = prom.values('tpud_executor_up')
        assert ups and all(v == 1 for v in ups.values()), ups
        build = prom.values('tpud_build_info')
        assert dict(next(iter(build)))["backend"] == "simulated"
    finally:
        if job is not None and job.poll() is None:
            job.kill()
        prom.close()


def test_metrics_on_a_unix_socket_and_bad_requests(tmp_path):
    path = str(tmp_path / "metrics.sock")
    d = Daemon(extra_flags=[f"--metrics_address={path}"])
    try:
        reply = unix_get(path)
        head, _, body = reply.partition("\r\n\r\n")
        assert head.startswith("HTTP/1.1 200 OK"), head
        assert "text/plain; version=0.0.4" in head
        assert "tpud_chip_hbm_total_bytes{chip=\"0\"}" in body
        assert unix_get(path, b"POST /metrics HTTP/1.1\r\n\r\n").startswith("HTTP/1.1 405")
        assert unix_get(path, b"GET /other HTTP/1.1\r\n\r\n").startswith("HTTP/1.1 404")
        assert unix_get(path, b"\x00\xff junk\r\n\r\n").startswith("HTTP/1.1 400")
        assert unix_get(path, b"GET /metrics HTTP/1.1\r\nX: " + b"a" * 40000) \
            .startswith("HTTP/1.1 431")
        assert d.alive()
        assert unix_get(path).startswith("HTTP/1.1 200 OK")
    finally:
        d.stop()
    assert not os.path.exists(path), "tpud removes its metrics socket when it stops"


@pytest.mark.parametrize("address, message", [
    ("0.0.0.0:9464", "loopback"),
    ("10.1.2.3:9464", "loopback"),
    ("127.0.0.1:70000", "port"),
    ("nonsense", "HOST:PORT"),
])
def test_tpud_refuses_a_metrics_address_off_loopback(address, message, tmp_path):
    r = subprocess.run([bazel_bin("daemon/tpud"), f"--socket={tmp_path}/t.sock",
                        f"--admin_socket={tmp_path}/a.sock", "--hbm_bytes=64MiB",
                        f"--metrics_address={address}"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode != 0
    assert message in r.stderr, r.stderr
    assert not os.path.exists(tmp_path / "t.sock")


def tcp_listening_inodes(pid):
    """Socket inodes of `pid` that listen on TCP (IPv4 or IPv6)."""
    listening = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        if os.path.exists(table):
            for line in pathlib.Path(table).read_text().splitlines()[1:]:
                fields = line.split()
                if fields[3] == "0A":  # LISTEN
                    listening.add(fields[9])
    mine = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            mine.add(target[len("socket:["):-1])
    return mine & listening


def test_metrics_are_off_unless_asked(daemon, metrics_daemon):
    assert tcp_listening_inodes(daemon.proc.pid) == set(), "no TCP port without the flag"
    assert len(tcp_listening_inodes(metrics_daemon.proc.pid)) == 1


def dashboard_exprs():
    board = json.loads(DASHBOARD.read_text())
    exprs = []

    def walk(panels):
        for p in panels:
            for t in p.get("targets", []):
                exprs.append((p.get("title", "?"), t["expr"]))
            walk(p.get("panels", []))
    walk(board["panels"])
    return board, exprs


@pytest.mark.slow
def test_grafana_dashboard_names_only_metrics_tpud_exports(metrics_daemon):
    board, exprs = dashboard_exprs()
    assert board["title"] and board.get("uid")
    assert len(exprs) >= 8
    for v in board["templating"]["list"]:
        if v["type"] == "query":
            exprs.append((f"variable {v['name']}", v["definition"]))
    # Scrape after a job ran so that every family (histograms too) is there:
    # on the simulated backend, and on PJRT, which adds the compile figures.
    code = "import torch, torch_tpu; (torch.ones(64, device='tpu') * 2).sum().item()"
    subprocess.run([sys.executable, "-c", code], env=metrics_daemon.env(), check=True,
                   timeout=120)
    _, text = http_get(f"http://{metrics_daemon.metrics_target}/metrics")
    exported = exported_families(text)
    assert "tpud_chip_op_duration_seconds_bucket" in exported
    assert "tpud_chip_compiles_total" not in exported
    port = free_port()
    pjrt = Daemon(extra_flags=pjrt_flags() + [f"--metrics_address=127.0.0.1:{port}"])
    try:
        subprocess.run([sys.executable, "-c", code], env=pjrt.env(), check=True, timeout=120)
        _, pjrt_text = http_get(f"http://127.0.0.1:{port}/metrics")
    finally:
        pjrt.stop()
    assert re.search(r'^tpud_chip_compiles_total\{chip="0"\} [1-9]', pjrt_text, re.M), pjrt_text
    assert 'tpud_build_info{version=' in pjrt_text and 'backend="pjrt"' in pjrt_text
    exported |= exported_families(pjrt_text)
    promql_words = {"sum", "rate", "by", "max", "min", "avg", "histogram_quantile", "le",
                    "increase", "irate", "topk", "without", "on", "group_left", "count"}
    for title, expr in exprs:
        names = set(re.findall(r"\b(tpud_[a-z0-9_]+)\b", expr))
        assert names, f"panel {title!r}: {expr} names no tpud metric"
        missing = names - exported
        assert not missing, f"panel {title!r} uses {missing}, which tpud does not export"
        # Label names used in selectors and groupings are ones tpud sets.
        for label in re.findall(r"by \(([^)]*)\)", expr):
            for l in (x.strip() for x in label.split(",")):
                assert l in {"chip", "le", "session", "code", "source", "src", "dst", "reason",
                             "executor", "command", "pid", "pod_uid"} | promql_words, (title, l)


@pytest.mark.slow
@pytest.mark.skipif(PROMETHEUS is None, reason="Debian's prometheus is not installed")
def test_grafana_dashboard_queries_parse_in_prometheus(metrics_daemon):
    _, exprs = dashboard_exprs()
    prom = Prometheus(metrics_daemon.metrics_target)
    try:
        board = json.loads(DASHBOARD.read_text())
        variables = {v["name"]: v for v in board.get("templating", {}).get("list", [])}
        for title, expr in exprs:
            # Grafana's variables, as a user would pick them.
            concrete = expr.replace("$__rate_interval", "1m").replace("$chip", "0") \
                .replace("${chip}", "0").replace("$__interval", "1m")
            assert "$" not in concrete, (title, expr, variables.keys())
            r = prom.query(concrete)
            assert r["status"] == "success", (title, concrete, r)
    finally:
        prom.close()
