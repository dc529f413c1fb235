"""What a new tpu process pays against a new CPU process (issue 32).

JSON lines, each tpu figure against CPU eager measured in the same run:

  first_ops_1    one new process: its first 100 ops after its first tensor
                 (x = x * 0.5 + 1, then x.sum().item()); median of --rounds
                 processes per device. Target: tpu <= 5x CPU and < 20 ms.
  first_ops_16   16 processes that have imported torch (and torch_tpu),
                 released together by one signal: the median process's
                 first 100 ops. Target: tpu <= 10x CPU.
  import_overhead  `import torch` with torch_tpu autoloaded against
                 TORCH_DEVICE_BACKEND_AUTOLOAD=0: wall time and peak RSS.

Each tpu process talks to one tpud started here (-c opt build by default).
--reduced runs fewer processes (what CI runs); the figures are then only a
smoke test. Run it on a quiet machine for figures worth comparing.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))
from tpud_process import TpudProcess  # noqa: E402

# One job: imports, signals ready, waits for the go file, runs the first 100
# ops, prints their seconds.
JOB = r"""
import os, sys, time
t0 = time.perf_counter()
import torch
dev = sys.argv[1]
if dev == "tpu":
    import torch_tpu  # noqa: F401 (also autoloaded)
x = torch.ones(64, 64, device=dev)
x.sum().item()
ready, go = sys.argv[2], sys.argv[3]
open(ready, "w").close()
while go and not os.path.exists(go):
    time.sleep(0.001)
t = time.perf_counter()
for _ in range(100):
    x = x * 0.5 + 1
v = x.sum().item()
print(time.perf_counter() - t, v)
"""


def run_batch(device, n, env, timeout=600):
    """n processes of JOB, released together; their first-100-ops seconds."""
    with tempfile.TemporaryDirectory(prefix="lifecycle.") as d:
        go = os.path.join(d, "go")
        procs = []
        for i in range(n):
            ready = os.path.join(d, f"ready{i}")
            procs.append((ready, subprocess.Popen(
                [sys.executable, "-c", JOB, device, ready, go], env=env,
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)))
        deadline = time.time() + timeout
        while not all(os.path.exists(r) for r, _ in procs):
            if time.time() > deadline or any(p.poll() not in (None, 0) for _, p in procs):
                for _, p in procs:
                    p.kill()
                errs = [p.communicate()[1][-1500:] for _, p in procs if p.returncode]
                sys.exit(f"lifecycle_bench: a {device} job failed: {errs[:1]}")
            time.sleep(0.01)
        open(go, "w").close()
        seconds = []
        for _, p in procs:
            out, err = p.communicate(timeout=timeout)
            if p.returncode != 0:
                sys.exit(f"lifecycle_bench: a {device} job failed: {err[-1500:]}")
            secs, value = out.split()
            # 64*64 elements, each 2 - 2**-100 after 100 steps from 1.
            if abs(float(value) - 8192.0) > 1e-2:
                sys.exit(f"lifecycle_bench: a {device} job computed {value}, not 8192")
            seconds.append(float(secs))
        return seconds


def import_cost(env, autoload, rounds):
    code = ("import resource, time; t = time.perf_counter(); import torch; "
            "print(time.perf_counter() - t, "
            "resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)")
    e = dict(env, TORCH_DEVICE_BACKEND_AUTOLOAD="1" if autoload else "0")
    secs, rss = [], []
    for _ in range(rounds):
        out = subprocess.run([sys.executable, "-c", code], env=e, check=True,
                             capture_output=True, text=True, timeout=300).stdout.split()
        secs.append(float(out[0]))
        rss.append(int(out[1]) * 1024)
    return statistics.median(secs), statistics.median(rss)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tpud", default=str(ROOT / "bazel-bin" / "daemon" / "tpud"))
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--reduced", action="store_true",
                   help="2 processes for first_ops_16 and 2 rounds (CI)")
    args = p.parse_args()
    many = 2 if args.reduced else 16
    rounds = 2 if args.reduced else args.rounds
    daemon = TpudProcess(args.tpud, "4GiB", [], prefix="tpud-lifecycle.")
    daemon.start(timeout=30)
    try:
        env = dict(os.environ, TPUD_SOCKET=daemon.socket)
        one = {dev: statistics.median(
            [run_batch(dev, 1, env)[0] for _ in range(rounds)]) for dev in ("cpu", "tpu")}
        print(json.dumps({
            "name": "first_ops_1", "tpu_seconds": round(one["tpu"], 6),
            "cpu_seconds": round(one["cpu"], 6),
            "tpu_over_cpu": round(one["tpu"] / one["cpu"], 2),
            "target": "tpu <= 5x cpu and < 0.020 s",
            "work": "a new process's first 100 x = x * 0.5 + 1 and .item()"}), flush=True)
        batch = {dev: statistics.median(run_batch(dev, many, env)) for dev in ("cpu", "tpu")}
        print(json.dumps({
            "name": f"first_ops_{many}", "tpu_seconds": round(batch["tpu"], 6),
            "cpu_seconds": round(batch["cpu"], 6),
            "tpu_over_cpu": round(batch["tpu"] / batch["cpu"], 2),
            "target": "tpu <= 10x cpu" if many == 16 else None,
            "work": f"{many} imported processes released together: median first 100 ops"}),
            flush=True)
        with_tpu = import_cost(env, True, rounds)
        without = import_cost(env, False, rounds)
        print(json.dumps({
            "name": "import_overhead", "seconds_with": round(with_tpu[0], 4),
            "seconds_without": round(without[0], 4),
            "rss_with_bytes": with_tpu[1], "rss_without_bytes": without[1],
            "work": "import torch, torch_tpu autoloaded against not"}), flush=True)
    finally:
        daemon.close()


if __name__ == "__main__":
    main()
