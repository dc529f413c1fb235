#!/usr/bin/env python3
"""Sharing benchmark: many PyTorch processes on one tpud host, against the same processes
on CPU eager PyTorch, in the same run.

Every process runs `x = x * 0.5 + y` on 64x64 float tensors with one `.item()` per 100 ops
(on tpu:i % chips, or on the CPU). Figures, one JSON object per line:

  aggregate_ratio_N  tpu ops/s of N processes over tpu ops/s of 1, steady state: one pool
                     of processes warms up, then in each round the first 1 and the first
                     N of them measure a shared window in turn; the median over rounds
                     of each round's ratio (one process alone varies by a third from
                     second to second on a busy 2-core VM, so one window says little).
  unsync_ratio_N     N processes started together, each measured as soon as it is ready
                     (while the others are still starting), over the steady figure at 1.
  pool_vs_fresh_1    the pool's N=1 over a new process alone, started after each round
                     (a check of the baseline: the pool's idle siblings keep their
                     sessions open).
  vs_cpu_N           tpu aggregate over CPU aggregate at the same N (steady).
  jain_N             Jain's fairness index over the tpu processes' mean rates over all
                     rounds (steady), with the least fair round's index beside it.
  interactive        a light job (one small op and .item() every 5 ms) beside 15 heavy
                     ones on the same chip: .item() latency p50/p99, against the same light
                     job alone on that chip.
  sync_roundtrip_contended, h2d_pageable_contended
                     dataplane_bench's scalar read and pageable copy with 1 and 2 extra
                     busy processes on the machine, each against its own baseline (a gRPC
                     ping, a memcpy) measured under the same load.

    .venv/bin/python bench/sharing_bench.py                 # full sweep, starts its own tpud
    .venv/bin/python bench/sharing_bench.py --quick         # reduced form (CI)
    .venv/bin/python bench/sharing_bench.py --counts 1,16 --window 4

Run it on a quiet machine: every figure is a ratio within one run, but other work on the
machine changes what "N processes on these cores" means.
"""
import argparse
import json
import os
import pathlib
import select
import statistics
import subprocess
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
from tpud_process import TpudProcess  # noqa: E402

OPS_PER_BURST = 100  # 50 iterations of mul + add, then one .item()


# ---------------------------------------------------------------- worker side

def worker_main(args):
    """One benchmark process. Talks to the coordinator in lines on stdin/stdout."""
    import torch
    if args.device.startswith("tpu"):
        import torch_tpu  # noqa: F401
    dev = torch.device(args.device)
    g = torch.Generator().manual_seed(args.seed)
    x = torch.randn(64, 64, generator=g).to(dev)
    y = torch.randn(64, 64, generator=g).to(dev)

    def burst():
        nonlocal x
        for _ in range(OPS_PER_BURST // 2):
            x = x * 0.5 + y
        return x[0, 0].item()

    def emit(obj):
        sys.stdout.write(json.dumps(obj) + "\n")
        sys.stdout.flush()

    if args.role == "light":
        # One small op and a scalar read every period; latency of each.
        t = torch.zeros(1, device=dev)
        for _ in range(20):
            (t + 1).item()
        emit({"ready": time.monotonic()})
        lat = []
        end = time.monotonic() + args.seconds
        while time.monotonic() < end:
            t0 = time.perf_counter()
            (t + 1).item()
            lat.append(time.perf_counter() - t0)
            time.sleep(args.period)
        emit({"latencies": lat})
        return

    if args.role == "heavy":
        w = torch.randn(256, 256, generator=g).to(dev) * 0.01
        h = torch.randn(256, 256, generator=g).to(dev)

        def burst():  # noqa: F811  (heavy jobs: 256x256 matmuls)
            nonlocal h
            for _ in range(20):
                h = torch.tanh(h @ w)
            return h[0, 0].item()

    def work_for(seconds):
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            burst()

    burst()  # warm-up: op definitions, meta caches, allocator
    if args.mode == "pool":
        # One of a pool that stays up across windows: warm up, say ready, then wait
        # (idle, its session open) for "run t0 t1": work until t1 and report the
        # bursts completed inside [t0, t1]. The lead-in before t0 warms it again.
        work_for(args.warmup)
        emit({"ready": time.monotonic()})
        for line in sys.stdin:
            if not line.startswith("run "):
                break
            _, t0, t1 = line.split()
            t0, t1 = float(t0), float(t1)
            n = 0
            while True:
                burst()
                now = time.monotonic()
                if t0 <= now <= t1:
                    n += 1
                if now > t1:
                    break
            emit({"rate": n * OPS_PER_BURST / (t1 - t0)})
        return
    if args.mode == "unsync":
        # Measured as soon as this process is ready (after --lead-in seconds of work,
        # 0 unless asked), whatever the others do.
        work_for(args.lead_in)
        start = time.monotonic()
        n = 0
        while time.monotonic() - start < args.seconds:
            burst()
            n += 1
        emit({"rate": n * OPS_PER_BURST / (time.monotonic() - start), "ready": start})
        return

    # Busy (the heavy jobs beside the interactive one): warm up, say ready, keep working
    # until the coordinator closes stdin.
    work_for(args.warmup)
    emit({"ready": time.monotonic()})
    while not select.select([sys.stdin], [], [], 0)[0]:
        burst()


# ---------------------------------------------------------------- coordinator side

def spawn(args, device, mode, seed, role="loop", extra=()):
    cmd = [sys.executable, __file__, "--worker", "--device", device, "--mode", mode,
           "--seed", str(seed), "--role", role, "--seconds", str(args.window),
           "--warmup", str(args.warmup), "--lead-in", "0", *extra]
    return subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=os.environ.copy())


def read_json(proc, timeout):
    r, _, _ = select.select([proc.stdout], [], [], timeout)
    if not r:
        raise RuntimeError("worker did not answer in time")
    line = proc.stdout.readline()
    if not line:
        err = proc.stderr.read()
        raise RuntimeError(f"worker exited ({proc.wait()}): {err[-2000:]}")
    return json.loads(line)


def finish(procs):
    for p in procs:
        try:
            p.stdin.close()
        except OSError:
            pass
    for p in procs:
        try:
            p.wait(30)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def jain(xs):
    return sum(xs) ** 2 / (len(xs) * sum(x * x for x in xs)) if xs and any(xs) else 0.0


def mean_rates(rounds):
    """Each process's mean rate over rounds (lists of the same processes' rates)."""
    return [statistics.fmean(r) for r in zip(*rounds)]


def device_of(kind, i, chips):
    return "cpu" if kind == "cpu" else f"tpu:{i % chips}"


def run_pool(args, kind, counts, chips, fresh=False):
    """Steady rates of the first n of one pool of processes, for each n in counts, in
    args.steady_rounds rounds (the order of counts reversed every other round, so that a
    drift of the machine's speed falls on every n alike). Returns {n: [rates per round]}:
    each round's list holds the n processes' rates in one shared window. With fresh,
    out["fresh"] holds, per round, the rate of a new process alone (started after the
    round, on the pool's first device, with the same lead-in): a check that the pool's
    N=1, whose siblings sit idle with open sessions, is what one process alone gets."""
    pool = [spawn(args, device_of(kind, i, chips), "pool", i) for i in range(max(counts))]
    out = {n: [] for n in counts}
    if fresh:
        out["fresh"] = []
    try:
        for p in pool:
            read_json(p, args.start_timeout)
        for r in range(args.steady_rounds):
            for n in (counts if r % 2 == 0 else counts[::-1]):
                t0 = time.monotonic() + args.lead_in
                t1 = t0 + args.window
                for p in pool[:n]:
                    p.stdin.write(f"run {t0} {t1}\n")
                    p.stdin.flush()
                out[n].append([read_json(p, args.window + 60)["rate"] for p in pool[:n]])
            if fresh:
                one = spawn(args, device_of(kind, 0, chips), "unsync", 0,
                            extra=("--lead-in", str(args.lead_in)))
                try:
                    out["fresh"].append(
                        read_json(one, args.start_timeout + args.window + 30)["rate"])
                finally:
                    finish([one])
    finally:
        finish(pool)
    return out


def run_unsync(args, kind, n, chips):
    procs = [spawn(args, device_of(kind, i, chips), "unsync", i) for i in range(n)]
    try:
        rates = [read_json(p, args.start_timeout + args.window + 30)["rate"] for p in procs]
    finally:
        finish(procs)
    return rates


def run_interactive(args):
    """Light job latency beside 15 heavy jobs on chip 0, and alone."""
    def light_latencies(with_heavy):
        heavy = [spawn(args, "tpu:0", "busy", 100 + i, role="heavy")
                 for i in range(15 if with_heavy else 0)]
        try:
            for p in heavy:
                read_json(p, args.start_timeout)
            light = spawn(args, "tpu:0", "busy", 7, role="light",
                          extra=("--period", "0.005"))
            try:
                read_json(light, args.start_timeout)
                return read_json(light, args.window + 60)["latencies"]
            finally:
                finish([light])
        finally:
            finish(heavy)  # closing their stdin ends them

    def pct(xs, q):
        xs = sorted(xs)
        return xs[min(len(xs) - 1, int(q * len(xs)))]

    alone = light_latencies(False)
    loaded = light_latencies(True)
    return {
        "name": "interactive",
        "p50_ms": round(pct(loaded, 0.5) * 1e3, 3),
        "p99_ms": round(pct(loaded, 0.99) * 1e3, 3),
        "alone_p50_ms": round(pct(alone, 0.5) * 1e3, 3),
        "alone_p99_ms": round(pct(alone, 0.99) * 1e3, 3),
        "samples": len(loaded),
        "work": "light: (t + 1).item() every 5 ms on tpu:0; heavy: 15 processes of "
                "20x tanh(h @ w) 256x256 + .item() on tpu:0",
    }


def busy_loops(k):
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(k)]


def run_contended(args, bench_bin):
    out = []
    for k in (1, 2):
        hogs = busy_loops(k)
        try:
            time.sleep(0.5)
            res = subprocess.run(
                [bench_bin, "--only=sync_roundtrip,h2d_pageable", f"--rounds={args.rounds}"],
                capture_output=True, text=True, timeout=600, env=os.environ.copy())
        finally:
            for h in hogs:
                h.kill()
                h.wait()
        if res.returncode != 0:
            raise RuntimeError(f"dataplane_bench failed: {res.stderr[-2000:]}")
        for line in res.stdout.splitlines():
            if not line.startswith("{"):
                continue
            d = json.loads(line)
            target = 4.0 if d["name"] == "sync_roundtrip" else 0.45
            out.append({
                "name": d["name"] + "_contended",
                "speed_ratio": d["speed_ratio"],
                "target": target,
                "busy_processes": k,
                "project_seconds": d.get("project_seconds"),
                "baseline_seconds": d.get("baseline_seconds"),
                "baseline": d.get("baseline", "") + ", under the same load",
            })
    return out


def emit(obj):
    print(json.dumps(obj), flush=True)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--device", default="cpu", help=argparse.SUPPRESS)
    p.add_argument("--mode", default="pool", help=argparse.SUPPRESS)
    p.add_argument("--role", default="loop", help=argparse.SUPPRESS)
    p.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--seconds", type=float, default=6.0, help=argparse.SUPPRESS)
    p.add_argument("--period", type=float, default=0.005, help=argparse.SUPPRESS)
    p.add_argument("--counts", default="1,2,4,8,16,32,64", help="process counts")
    p.add_argument("--window", type=float, default=6.0, help="measured seconds")
    p.add_argument("--warmup", type=float, default=2.0, help="steady warm-up seconds")
    p.add_argument("--steady-rounds", type=int, default=5,
                   help="rounds of the steady figures (each measures every N in turn)")
    p.add_argument("--lead-in", type=float, default=0.5,
                   help="seconds each steady window's processes work before it opens")
    p.add_argument("--rounds", type=int, default=5, help="dataplane_bench rounds")
    p.add_argument("--start-timeout", type=float, default=240.0)
    p.add_argument("--topology", default="v6e-8")
    p.add_argument("--hbm", default="1GiB")
    p.add_argument("--only", default="", help="comma-separated: steady,unsync,interactive,"
                                              "contended (default all)")
    p.add_argument("--quick", action="store_true",
                   help="reduced form: N in {1, 4, 16}, 3 s windows")
    p.add_argument("--tpud", default="", help="tpud binary (default: bazel-bin's, -c opt "
                                              "if bench/run.sh built it)")
    p.add_argument("--dataplane-bench", default="")
    p.add_argument("--socket", default="", help="use a running tpud instead of starting one")
    args = p.parse_args()
    if args.worker:
        worker_main(args)
        return
    if args.quick:
        args.counts, args.window, args.warmup, args.rounds = "1,4,16", 3.0, 1.0, 3
        args.steady_rounds = 1
    counts = [int(c) for c in args.counts.split(",") if c]
    want = set(filter(None, args.only.split(","))) or {"steady", "unsync", "interactive",
                                                        "contended"}
    bin_dir = ROOT / "bazel-bin"
    tpud = args.tpud or str(bin_dir / "daemon" / "tpud")
    bench_bin = args.dataplane_bench or str(bin_dir / "bench" / "dataplane_bench")

    daemon = None
    if args.socket:
        os.environ["TPUD_SOCKET"] = args.socket
    else:
        daemon = TpudProcess(tpud, args.hbm, [f"--topology={args.topology}"],
                             prefix="tpud-sharing-bench.", log_to_file=True)
        daemon.start(timeout=30)
        os.environ["TPUD_SOCKET"] = daemon.socket
    chips = int(args.topology.split("-")[1]) if "-" in args.topology else 1
    try:
        base_tpu = None
        if want & {"steady", "unsync"}:
            steady_counts = counts if "steady" in want else [1]
            if 1 not in steady_counts:
                steady_counts = [1] + steady_counts
            tpu = run_pool(args, "tpu", steady_counts, chips, fresh="steady" in want)
            base_tpu = statistics.median(sum(rates) for rates in tpu[1])
            if "fresh" in tpu:
                # The pool's N=1 against a new process alone, round by round.
                pairs = [sum(a) / b for a, b in zip(tpu[1], tpu["fresh"])]
                emit({"name": "pool_vs_fresh_1", "speed_ratio": round(
                          statistics.median(pairs), 4), "target": None,
                      "round_ratios": [round(r, 4) for r in pairs],
                      "fresh_ops_per_s": [round(r) for r in tpu["fresh"]],
                      "baseline": "a new tpu process alone, measured after each round "
                                  "with the same lead-in"})
            cpu = run_pool(args, "cpu", steady_counts, chips) if "steady" in want else {}
            for n in steady_counts if "steady" in want else []:
                aggs = [sum(rates) for rates in tpu[n]]
                agg = statistics.median_low(aggs)  # a round's own figure, listed below
                agg_cpu = statistics.median_low(sum(rates) for rates in cpu[n])
                ratios = [a / sum(b) for a, b in zip(aggs, tpu[1])]
                rec = {"n": n, "tpu_ops_per_s": round(agg), "cpu_ops_per_s": round(agg_cpu),
                       "rounds": args.steady_rounds,
                       "tpu_rates": [round(r) for r in tpu[n][aggs.index(agg)]]}
                target = 0.8 if n == 16 else 0.6 if n == 64 else None
                emit({"name": f"aggregate_ratio_{n}",
                      "speed_ratio": round(statistics.median(ratios), 4),
                      "target": target, "round_ratios": [round(r, 4) for r in ratios],
                      "baseline": "tpu aggregate at N=1 in the same round (one pool of "
                                  "processes, N=1 and N measured in turn)", **rec})
                emit({"name": f"vs_cpu_{n}", "speed_ratio": round(agg / agg_cpu, 4),
                      "target": None, "baseline": "CPU eager, same N, same run "
                                                  "(medians over rounds)", **rec})
                # Fairness of the shares over the whole run (each process's mean rate
                # over all rounds), and the least fair single window beside it.
                emit({"name": f"jain_{n}", "value": round(jain(mean_rates(tpu[n])), 4),
                      "target": 0.95, "worst_round": round(min(jain(r) for r in tpu[n]), 4),
                      "cpu_jain": round(jain(mean_rates(cpu[n])), 4)})
        if "unsync" in want:
            for n in counts:
                tpu = run_unsync(args, "tpu", n, chips)
                cpu = run_unsync(args, "cpu", n, chips)
                emit({"name": f"unsync_ratio_{n}", "speed_ratio": round(sum(tpu) / base_tpu, 4),
                      "target": 0.5 if n == 16 else None,
                      "baseline": "steady tpu aggregate at N=1, same run",
                      "tpu_ops_per_s": round(sum(tpu)), "cpu_ops_per_s": round(sum(cpu)),
                      "jain": round(jain(tpu), 4), "tpu_rates": [round(r) for r in tpu]})
        if "interactive" in want:
            emit(run_interactive(args))
        if "contended" in want:
            for rec in run_contended(args, bench_bin):
                emit(rec)
    finally:
        if daemon is not None:
            daemon.close()


if __name__ == "__main__":
    main()
