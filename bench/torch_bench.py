#!/usr/bin/env python3
"""PyTorch-level benchmarks of torch_tpu: work on "tpu" against the same work on CPU eager
PyTorch, measured in the same run (warm-up first, interleaved rounds, medians).

    TPUD_SOCKET=/path/tpud.sock .venv/bin/python bench/torch_bench.py
    .venv/bin/python bench/torch_bench.py --start-daemon      # starts bazel-bin/daemon/tpud

One JSON object per line: name, speed_ratio (project speed / baseline speed, i.e.
baseline_seconds / project_seconds; higher is better), target, project_seconds and
baseline_seconds (median seconds per unit of work), the per-round times, and what the
work is.
"""
import argparse
import json
import os
import pathlib
import statistics
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
from tpud_process import TpudProcess  # noqa: E402


# ---------------------------------------------------------------- daemon

class OwnDaemon(TpudProcess):
    """A tpud on sockets in a temporary folder, for --start-daemon."""

    def __init__(self, binary, hbm):
        super().__init__(binary, hbm, prefix="tpud-torch-bench.")
        if not os.access(binary, os.X_OK):
            self.close()
            sys.exit(f"torch_bench: no tpud at {binary} (build //daemon:tpud first)")
        try:
            self.start(timeout=15)
        except RuntimeError as e:
            self.close()
            sys.exit(f"torch_bench: {e}")

    def stop(self):
        self.close()


# ---------------------------------------------------------------- workloads
# Each workload is built once per device and returns run(n): do n units of work and wait
# until they are finished (on tpu: torch.tpu.synchronize(); CPU eager is synchronous).

def small_op_model(torch, device):
    """A 4-layer width-16 MLP, batch 8, several elementwise ops per layer, AdamW."""
    nn = torch.nn

    class Block(nn.Module):
        def __init__(self, w):
            super().__init__()
            self.lin = nn.Linear(w, w)
            self.scale = nn.Parameter(torch.ones(w))
            self.shift = nn.Parameter(torch.zeros(w))

        def forward(self, x):
            h = self.lin(x)
            h = h * self.scale + self.shift      # mul, add
            h = torch.tanh(h)                    # tanh
            h = h * torch.sigmoid(h)             # sigmoid, mul
            return x + 0.5 * h                   # mul, add (residual)

    torch.manual_seed(0)
    model = nn.Sequential(*[Block(16) for _ in range(4)], nn.Linear(16, 1)).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(8, 16, generator=g).to(device)
    y = torch.randn(8, 1, generator=g).to(device)

    def step():
        loss = ((model(x) - y) ** 2).mean()  # F.mse_loss fails on tpu (see report)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    return step


def matmul_model(torch, device):
    """Two Linear(1024, 1024) layers, batch 512, SGD: big matmuls dominate."""
    nn = torch.nn
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 1024)).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(512, 1024, generator=g).to(device)
    y = torch.randn(512, 1024, generator=g).to(device)

    def step():
        loss = ((model(x) - y) ** 2).mean()  # F.mse_loss fails on tpu (see report)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    return step


def tiny_op(torch, device):
    """x.add_(1) on a one-element tensor."""
    x = torch.zeros(1, device=device)

    def op():
        x.add_(1)
    return op


FIGURES = {
    # name: (builder, units per round, target, what one unit is)
    # (issue 32 raised small_op_train_step to 0.6 and tiny_op_overhead to 0.8)
    "small_op_train_step": (small_op_model, 40, 0.6,
                            "one AdamW training step of a 4-layer width-16 MLP (batch 8, "
                            "5 elementwise ops per layer)"),
    "matmul_train_step": (matmul_model, 3, 0.9,
                          "one SGD training step of 2x Linear(1024,1024), batch 512"),
    "tiny_op_overhead": (tiny_op, 20000, 0.8,
                         "one x.add_(1) on a 1-element tensor, issued from Python"),
}


def measure(torch, name, rounds, scale):
    build, units, target, work = FIGURES[name]
    units = max(1, int(units * scale))

    def runner(device):
        body = build(torch, device)
        sync = torch.tpu.synchronize if device == "tpu" else (lambda: None)

        def run():
            t0 = time.perf_counter()
            for _ in range(units):
                body()
            sync()
            return (time.perf_counter() - t0) / units
        return run

    run = {"cpu": runner("cpu"), "tpu": runner("tpu")}
    for dev in ("cpu", "tpu"):       # warm-up: caches, allocator, op definitions
        run[dev]()
    times = {"cpu": [], "tpu": []}
    for r in range(rounds):          # interleaved, alternating which goes first
        order = ("cpu", "tpu") if r % 2 == 0 else ("tpu", "cpu")
        for dev in order:
            times[dev].append(run[dev]())
    project = statistics.median(times["tpu"])
    baseline = statistics.median(times["cpu"])
    return {
        "name": name,
        "speed_ratio": round(baseline / project, 4),
        "target": target,
        "project_seconds": float(f"{project:.6g}"),
        "baseline_seconds": float(f"{baseline:.6g}"),
        "baseline": "CPU eager PyTorch, same work, same run",
        "work": work,
        "units_per_round": units,
        "rounds": rounds,
        "project_round_seconds": [float(f"{t:.6g}") for t in times["tpu"]],
        "baseline_round_seconds": [float(f"{t:.6g}") for t in times["cpu"]],
    }


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--start-daemon", action="store_true",
                   help="start bazel-bin/daemon/tpud on temporary sockets (and stop it)")
    p.add_argument("--tpud", default=str(ROOT / "bazel-bin" / "daemon" / "tpud"),
                   help="tpud binary for --start-daemon")
    p.add_argument("--hbm", default="1GiB", help="--hbm_bytes of the started daemon")
    p.add_argument("--only", default="", help="comma-separated figures (default: all)")
    p.add_argument("--rounds", type=int, default=5, help="interleaved rounds (median reported)")
    p.add_argument("--scale", type=float, default=1.0, help="multiplies the work per round")
    args = p.parse_args()
    names = [n for n in args.only.split(",") if n] or list(FIGURES)
    for n in names:
        if n not in FIGURES:
            sys.exit(f"torch_bench: unknown figure {n!r} (known: {', '.join(FIGURES)})")

    daemon = None
    if args.start_daemon:
        daemon = OwnDaemon(args.tpud, args.hbm)
        os.environ["TPUD_SOCKET"] = daemon.socket
    try:
        # Imported only now: torch's backend autoload may load torch_tpu with torch.
        import torch
        import torch_tpu  # noqa: F401
        if not torch.tpu.is_available():
            sys.exit(f"torch_bench: no tpu devices (is tpud serving "
                     f"{os.environ.get('TPUD_SOCKET', 'the default socket')}?)")
        for n in names:
            print(json.dumps(measure(torch, n, args.rounds, args.scale)), flush=True)
    finally:
        if daemon is not None:
            daemon.stop()


if __name__ == "__main__":
    main()
