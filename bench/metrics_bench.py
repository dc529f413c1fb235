#!/usr/bin/env python3
"""What a Prometheus scrape of tpud costs, with N sessions open.

Starts tpud with --metrics_address on loopback, opens N sessions (the C++
example client holding a little HBM each), and times GET /metrics: the
median and p99 over many scrapes, with the exposition's size. The baseline,
in the same run, is the same scrapes with no session open. Prints one JSON
line per session count.

  .venv/bin/python bench/metrics_bench.py [--sessions 0,16,64] [--scrapes 200]
"""
import argparse
import json
import os
import pathlib
import socket
import statistics
import subprocess
import sys
import time
import urllib.request

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
from tpud_process import TpudProcess  # noqa: E402


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def scrape_times(url, n):
    times, size = [], 0
    for _ in range(n):
        t0 = time.perf_counter()
        with urllib.request.urlopen(url, timeout=10) as r:
            body = r.read()
        times.append(time.perf_counter() - t0)
        size = len(body)
    times.sort()
    return statistics.median(times), times[int(0.99 * (len(times) - 1))], size


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sessions", default="0,16,64")
    p.add_argument("--scrapes", type=int, default=200)
    p.add_argument("--tpud", default=str(ROOT / "bazel-bin" / "daemon" / "tpud"))
    p.add_argument("--client", default=str(ROOT / "bazel-bin" / "examples" / "cpp" / "hello_tpud"))
    args = p.parse_args()
    port = free_port()
    d = TpudProcess(args.tpud, "1GiB", ["--topology=v6e-8", f"--metrics_address=127.0.0.1:{port}"],
                    prefix="tpud-metrics-bench.")
    d.start()
    url = f"http://127.0.0.1:{port}/metrics"
    clients = []
    base = None
    try:
        for n in [int(x) for x in args.sessions.split(",")]:
            while len(clients) < n:
                clients.append(subprocess.Popen(
                    [args.client, f"--socket={d.socket}", f"--chip={len(clients) % 8}",
                     "--bytes=1MiB", "--hold_seconds=600"],
                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
            deadline = time.time() + 60
            while time.time() < deadline:
                with urllib.request.urlopen(url, timeout=10) as r:
                    text = r.read().decode()
                if sum(l.startswith("tpud_session_info{") for l in text.splitlines()) >= n:
                    break
                time.sleep(0.2)
            median, p99, size = scrape_times(url, args.scrapes)
            if base is None:
                base = median
            print(json.dumps({
                "name": f"metrics_scrape_{n}_sessions",
                "sessions": n,
                "median_seconds": float(f"{median:.6g}"),
                "p99_seconds": float(f"{p99:.6g}"),
                "bytes": size,
                "vs_no_sessions": round(median / base, 3),
                "baseline": "the same scrapes with no session open, same run",
            }), flush=True)
    finally:
        for c in clients:
            c.kill()
        for c in clients:
            c.wait()
        d.close()


if __name__ == "__main__":
    main()
