#!/usr/bin/env python3
"""vLLM serving on tpu (through tpud and plugins/vllm_tpud) against vLLM's
own CPU path, on the same tiny checkpoint, in the same run.

    .venv/bin/python bench/serving_bench.py [--tpud bazel-bin/daemon/tpud] [--reduced]

Each side is a real `vllm serve` on loopback (the .venv-vllm environment),
asked by N client threads at once; each request is a 32-token prompt and
exactly --max-tokens greedy tokens. One JSON object per line:

  serving_tokens_per_s_N           N = 1, 8, 32 concurrent requests: output
                                   tokens per second, tpu (eager) over CPU.
                                   Target 0.5.
  serving_tokens_per_s_N_compiled  the same with the model step compiled
                                   (torch.compile through the "tpu" backend)
                                   over CPU (vLLM's own compiled CPU path).
                                   Target 1.0.
  serving_latency_8                time to first token and inter-token
                                   latency, p50 and p99, at N = 8, both sides.
  two_servers_aggregate            two tpu servers sharing the host (and its
                                   chip 0), the requests split between them,
                                   against one tpu server alone with the same
                                   requests. Target 0.8.

Each figure is the median of --rounds rounds (default 2); in a round each
server runs alone on the machine (the CPU one, then the tpu one).

--reduced: N = 1 and 8, fewer requests, one round, no compiled servers (CI
runs this).
"""
import argparse
import concurrent.futures
import json
import os
import pathlib
import statistics
import subprocess
import sys
import shutil
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
from tpud_process import TpudProcess  # noqa: E402
from vllm_server import VllmServer, vllm_env  # noqa: E402

VLLM_PY = ROOT / ".venv-vllm" / "bin" / "python"
JOB = ROOT / "tests" / "python" / "vllm_job.py"


def prompt(i):
    return [(11 * i + 5 * j) % 500 + 4 for j in range(32)]


def load(servers, concurrency, requests_per_client, max_tokens):
    """N clients at once, each `requests_per_client` requests in turn, spread
    over `servers` round-robin: (output tokens per second, streams' times)."""
    def client(c):
        srv = servers[c % len(servers)]
        return [srv.stream_times(prompt(c * 97 + r), max_tokens)
                for r in range(requests_per_client)]

    t0 = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
        results = list(pool.map(client, range(concurrency)))
    wall = time.perf_counter() - t0
    streams = [s for per_client in results for s in per_client]
    tokens = sum(n for s in streams for _, n in s)
    expected = concurrency * requests_per_client * max_tokens
    if tokens != expected:
        raise RuntimeError(f"{tokens} tokens came back, {expected} were asked for")
    return tokens / wall, streams


def percentile(values, q):
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q / 100 * (len(values) - 1))))]


def latencies(streams):
    ttft = [s[0][0] for s in streams]
    itl = [(b[0] - a[0]) / b[1] for s in streams for a, b in zip(s, s[1:])]
    return {"ttft_p50_s": percentile(ttft, 50), "ttft_p99_s": percentile(ttft, 99),
            "itl_p50_s": percentile(itl, 50), "itl_p99_s": percentile(itl, 99)}


def serve(model, env, compiled, log_dir):
    args = ["--max-num-seqs", "32", "--kv-cache-memory-bytes", str(64 << 20)]
    if not compiled:
        args.append("--enforce-eager")
    return VllmServer(VLLM_PY.parent / "vllm", model, env, args, log_dir=log_dir)


def measure(servers_env, model, compiled, sizes, requests, max_tokens, log_dir, count=1):
    """`count` servers up (alone on the machine), each load of `sizes` after a
    warm-up of that size: {size: (tokens per second, streams)}."""
    servers = [serve(model, servers_env, compiled, log_dir) for _ in range(count)]
    try:
        out = {}
        for n in sizes:
            load(servers, n, 1, max_tokens)
            out[n] = load(servers, n, requests, max_tokens)
        return out
    finally:
        for s in servers:
            s.stop()


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tpud", default=str(ROOT / "bazel-bin" / "daemon" / "tpud"))
    ap.add_argument("--reduced", action="store_true")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    sizes = [1, 8] if args.reduced else [1, 8, 32]
    requests = 2 if args.reduced else 6
    rounds = 1 if args.reduced else args.rounds
    work = tempfile.mkdtemp(prefix="serving-bench.")
    model = os.path.join(work, "llama")
    subprocess.run([str(VLLM_PY), str(JOB), "checkpoint", model, "llama"], env=vllm_env(),
                   check=True, capture_output=True)
    daemon = TpudProcess(args.tpud, hbm="2GiB", prefix="tpud-serving.", log_to_file=True)
    daemon.start()
    try:
        modes = [False] if args.reduced else [False, True]
        for compiled in modes:
            # Rounds of: vLLM's CPU server alone, then the tpu server alone.
            pairs = [(measure(vllm_env(cpu=True), model, compiled, sizes, requests,
                              args.max_tokens, work),
                      measure(vllm_env(daemon), model, compiled, sizes, requests,
                              args.max_tokens, work)) for _ in range(rounds)]
            suffix = "_compiled" if compiled else ""
            for n in sizes:
                ratio = statistics.median(t[n][0] / c[n][0] for c, t in pairs)
                print(json.dumps({
                    "name": f"serving_tokens_per_s_{n}{suffix}", "speed_ratio": round(ratio, 4),
                    "target": 1.0 if compiled else 0.5,
                    "project_tokens_per_s": [round(t[n][0], 2) for _, t in pairs],
                    "baseline_tokens_per_s": [round(c[n][0], 2) for c, _ in pairs],
                    "baseline": "vLLM's CPU path, same checkpoint" + (", compiled" if compiled else ""),
                    "work": f"{n} concurrent clients x {requests} requests, 32-token prompts, "
                            f"{args.max_tokens} output tokens each; median of {rounds} rounds "
                            "(CPU server alone, then tpu server alone)"}), flush=True)
            if not compiled:
                c, t = pairs[-1]
                print(json.dumps({"name": "serving_latency_8", "concurrency": 8,
                                  "tpu": {k: round(v, 5) for k, v in latencies(t[8][1]).items()},
                                  "cpu": {k: round(v, 5) for k, v in latencies(c[8][1]).items()}}),
                      flush=True)

        # Two tpu servers sharing the host against one alone, same requests.
        pairs = [(measure(vllm_env(daemon), model, False, [8], requests, args.max_tokens, work),
                  measure(vllm_env(daemon), model, False, [8], requests, args.max_tokens, work,
                          count=2)) for _ in range(rounds)]
        ratio = statistics.median(two[8][0] / one[8][0] for one, two in pairs)
        print(json.dumps({"name": "two_servers_aggregate", "speed_ratio": round(ratio, 4),
                          "target": 0.8,
                          "project_tokens_per_s": [round(two[8][0], 2) for _, two in pairs],
                          "baseline_tokens_per_s": [round(one[8][0], 2) for one, _ in pairs],
                          "baseline": "one tpu server alone",
                          "work": f"8 clients x {requests} requests, split over two servers; "
                                  f"median of {rounds} rounds"}),
              flush=True)
    finally:
        daemon.close()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
