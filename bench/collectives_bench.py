"""Collectives inside tpud against gloo on CPU tensors, same ranks, same run.

    .venv/bin/python bench/collectives_bench.py --start-daemon [--ranks 4] [--big-mib 256]
    .venv/bin/python bench/collectives_bench.py --intra-op [--intra-op-rounds 2]

Each figure is a ratio measured in one run, in the same rank processes (one
per chip of a simulated v6e-4), whose default group has both backends
("cpu:gloo,tpu:tpu"); each side is the best of a few rounds, the two
backends' rounds taking turns:

  allreduce_small   latency of a 4-byte all_reduce (each call waited on by the
                    host) with gloo / with tpu. Target >= 5.
  allreduce_big     bus bandwidth 2(n-1)/n x bytes / time of an all_reduce of
                    --big-mib MiB per rank, tpu / gloo. Target >= 2. Also
                    reported against one single-thread memcpy of that size.
  ddp_step          time of a DistributedDataParallel training step (an MLP,
                    a few MB of gradients) with gloo on CPU / with tpu; with
                    the same step without DDP on each device, for the share
                    the all-reduce takes. Target >= 1.
  fsdp_step_4       a training step of two transformer blocks under FSDP2
                    (fully_shard) over 4 ranks, gloo on CPU / tpu. Target >= 1.
  tp_step_2         the same blocks tensor-parallel over 2 ranks (q/k/v and
                    w1 column-wise, o and w2 row-wise). Target >= 1.
                    Both rank sets set their device after init_process_group,
                    and with tpud's default flags.

With --intra-op it measures instead how executors share the host's cores
(docs/design.md, "Executors"): FSDP2 (fully_shard) training steps of an MLP
on tpu, one rank per chip, against three tpuds started together and taking
turns round by round, each the best of --intra-op-rounds:

  intra_op          step time with the old behaviour (--intra_op_threads=
                    <cores>: every executor takes every core), with the
                    default (the cores shared among busy chips) and with
                    --intra_op_threads=1; the default's speedup over the old
                    (target: about the one-thread figure), and whether the
                    three ran the same losses bit for bit.

Prints one JSON document; --out writes it to a file too.
"""
import argparse
import json
import os
import socket
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---------------------------------------------------------------- one rank

def worker(rank, world, port, big_mib, small_iters, big_iters, ddp_steps):
    """Both backends in the same rank processes ("cpu:gloo,tpu:tpu"), their
    rounds interleaved: drift on a shared machine hits both alike."""
    import datetime

    import torch
    import torch.distributed as dist
    import torch_tpu  # noqa: F401

    torch.set_num_threads(1)
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.tpu.set_device(rank % torch.tpu.device_count())
    devs = {"tpu": torch.device("tpu", rank % torch.tpu.device_count()),
            "gloo": torch.device("cpu")}
    syncs = {"tpu": torch.tpu.synchronize,
             "gloo": lambda: None}  # gloo's calls return when done
    dist.init_process_group("cpu:gloo,tpu:tpu", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=600))
    out = {"gloo": {}, "tpu": {}}

    def timed(key, fns, iters, rounds):
        # The best of a few rounds for each backend, the backends taking
        # turns (and turns at going first).
        best = {b: float("inf") for b in fns}
        order = list(fns)
        for r in range(rounds):
            for b in (order if r % 2 == 0 else order[::-1]):
                dist.barrier(device_ids=[devs["tpu"].index])
                syncs[b]()
                t0 = time.perf_counter()
                for _ in range(iters):
                    fns[b]()
                syncs[b]()
                best[b] = min(best[b], (time.perf_counter() - t0) / iters)
        for b in fns:
            out[b][key] = best[b]

    def small_step(b, t):
        def step():
            dist.all_reduce(t)
            syncs[b]()  # the host waits for each: latency, not pipelined throughput
        return step

    small = {b: small_step(b, torch.ones(1, device=devs[b])) for b in devs}
    for _ in range(20):
        for f in small.values():
            f()
    timed("small_s", small, small_iters, rounds=5)
    del small

    n = big_mib * (1 << 20) // 4
    bigs = {b: torch.ones(n, device=devs[b]) for b in devs}
    for b, t in bigs.items():
        dist.all_reduce(t)
        syncs[b]()
    timed("big_s", {b: (lambda t=t: dist.all_reduce(t)) for b, t in bigs.items()}, 1,
          rounds=big_iters)
    del bigs

    steps, local_steps = {}, {}
    for b, dev in devs.items():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.ReLU(),
                                    torch.nn.Linear(1024, 1024), torch.nn.ReLU(),
                                    torch.nn.Linear(1024, 10)).to(dev)
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
        x = torch.randn(32, 256).to(dev)
        y = torch.randint(0, 10, (32,)).to(dev)

        def step(ddp=ddp, opt=opt, x=x, y=y):
            opt.zero_grad()
            torch.nn.functional.cross_entropy(ddp(x), y).backward()
            opt.step()

        def local_step(model=model, opt=opt, x=x, y=y):  # without DDP: its compute alone
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.step()

        for _ in range(3):
            step()
            local_step()
        syncs[b]()
        steps[b], local_steps[b] = step, local_step
        out[b]["ddp_grad_bytes"] = sum(p.numel() * 4 for p in model.parameters())
    timed("ddp_step_s", steps, ddp_steps, rounds=3)
    timed("local_step_s", local_steps, ddp_steps, rounds=3)
    dist.destroy_process_group()
    print(json.dumps(out), flush=True)


def fsdp_worker(rank, world, port, steps):
    """FSDP2 training steps on tpu: the mean step time and every loss."""
    import datetime

    import torch
    import torch.distributed as dist
    import torch_tpu  # noqa: F401
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.set_num_threads(1)
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dev = torch.device("tpu", rank % torch.tpu.device_count())
    torch.tpu.set_device(dev)
    dist.init_process_group("tpu", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=600))
    mesh = init_device_mesh("tpu", (world,))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(512, 2048), torch.nn.GELU(),
                                torch.nn.Linear(2048, 2048), torch.nn.GELU(),
                                torch.nn.Linear(2048, 512)).to(dev)
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(1 + rank)
    x = torch.randn(64, 512, generator=g).to(dev)
    y = torch.randn(64, 512, generator=g).to(dev)

    def step():
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        return loss.detach()

    for _ in range(2):
        step()
    torch.tpu.synchronize()
    dist.barrier(device_ids=[dev.index])
    t0 = time.perf_counter()
    losses = [step() for _ in range(steps)]
    torch.tpu.synchronize()
    seconds = (time.perf_counter() - t0) / steps
    dist.destroy_process_group()
    print(json.dumps({"step_s": seconds, "losses": [float(l) for l in losses]}), flush=True)


def train_worker(rank, world, port, layout, steps, rounds):
    """A transformer block's training steps, sharded by `layout` ("fsdp":
    FSDP2 over every rank; "tp": tensor parallel over every rank), once on
    CPU tensors with gloo and once on tpu, in the same rank processes, their
    rounds taking turns. Prints the best mean step time of each and their
    losses."""
    import datetime

    import torch
    import torch.distributed as dist
    import torch_tpu  # noqa: F401
    from torch.distributed.device_mesh import init_device_mesh

    torch.set_num_threads(1)
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("cpu:gloo,tpu:tpu", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=600))
    # After init_process_group, as many scripts do.
    torch.tpu.set_device(rank % torch.tpu.device_count())
    dim, heads, seq, batch = 256, 8, 128, 4

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.norm1 = torch.nn.LayerNorm(dim)
            self.q = torch.nn.Linear(dim, dim)
            self.k = torch.nn.Linear(dim, dim)
            self.v = torch.nn.Linear(dim, dim)
            self.o = torch.nn.Linear(dim, dim)
            self.norm2 = torch.nn.LayerNorm(dim)
            self.w1 = torch.nn.Linear(dim, 4 * dim)
            self.w2 = torch.nn.Linear(4 * dim, dim)

        def forward(self, x):
            b, s, _ = x.shape
            h = self.norm1(x)
            # -1 heads: tensor parallel leaves each rank its share of them.
            q, k, v = (f(h).view(b, s, -1, dim // heads).transpose(1, 2)
                       for f in (self.q, self.k, self.v))
            a = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + self.o(a.transpose(1, 2).reshape(b, s, -1))
            return x + self.w2(torch.nn.functional.gelu(self.w1(self.norm2(x))))

    steps_of, sync_of = {}, {}
    for name, dev_type in (("gloo", "cpu"), ("tpu", "tpu")):
        dev = torch.device("tpu", rank % torch.tpu.device_count()) if dev_type == "tpu" \
            else torch.device("cpu")
        mesh = init_device_mesh(dev_type, (world,))
        torch.manual_seed(0)
        model = torch.nn.Sequential(Block(), Block()).to(dev)
        if layout == "fsdp":
            from torch.distributed.fsdp import fully_shard

            for blk in model:
                fully_shard(blk, mesh=mesh)
            fully_shard(model, mesh=mesh)
            g = torch.Generator().manual_seed(1 + rank)  # each rank its own batch
        else:
            from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                           parallelize_module)

            for blk in model:
                parallelize_module(blk, mesh, {"q": ColwiseParallel(), "k": ColwiseParallel(),
                                               "v": ColwiseParallel(), "o": RowwiseParallel(),
                                               "w1": ColwiseParallel(), "w2": RowwiseParallel()})
            g = torch.Generator().manual_seed(1)  # the same batch on every rank
        # Under TP the norms' parameters stay plain tensors, which the
        # multi-tensor (foreach) step cannot mix with DTensors.
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=layout == "fsdp")
        x = torch.randn(batch, seq, dim, generator=g).to(dev)
        y = torch.randn(batch, seq, dim, generator=g).to(dev)
        losses = []

        def step(model=model, opt=opt, x=x, y=y, losses=losses):
            opt.zero_grad()
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            opt.step()
            losses.append(loss.detach())

        steps_of[name] = (step, losses)
        sync_of[name] = torch.tpu.synchronize if dev_type == "tpu" else (lambda: None)
        for _ in range(2):
            step()
        sync_of[name]()
    best = {b: float("inf") for b in steps_of}
    for r in range(rounds):
        for b in (list(steps_of) if r % 2 == 0 else list(steps_of)[::-1]):
            dist.barrier(device_ids=[torch.tpu.current_device()])
            t0 = time.perf_counter()
            for _ in range(steps):
                steps_of[b][0]()
            sync_of[b]()
            best[b] = min(best[b], (time.perf_counter() - t0) / steps)
    out = {b: {"step_s": best[b], "losses": [float(v) for v in steps_of[b][1]]} for b in best}
    dist.destroy_process_group()
    print(json.dumps(out), flush=True)


def run_train_ranks(args, env, layout, ranks):
    """Both backends' step times for `layout`, the slowest rank's."""
    port = free_port()
    cmd = [sys.executable, os.path.abspath(__file__), "--train-worker", layout, "--ranks",
           str(ranks), "--port", str(port), "--train-steps", str(args.train_steps),
           "--train-rounds", str(args.train_rounds)]
    results = spawn_ranks(cmd, ranks, env)
    gloo = max(r["gloo"]["step_s"] for r in results)
    tpu = max(r["tpu"]["step_s"] for r in results)
    # Each step's loss on tpu against gloo's, rank 0 (the most relative).
    diff = max(abs(a - b) / max(abs(b), 1e-12)
               for a, b in zip(results[0]["tpu"]["losses"], results[0]["gloo"]["losses"]))
    return {"ranks": ranks, "gloo_ms": gloo * 1e3, "tpu_ms": tpu * 1e3, "ratio": gloo / tpu,
            "target": 1.0, "max_loss_rel_diff": diff}


# ---------------------------------------------------------------- driver

def spawn_ranks(cmd, ranks, env):
    """Runs `cmd --rank R` for every rank at once; each rank's last stdout
    line, as JSON, in rank order."""
    procs = [subprocess.Popen(cmd + ["--rank", str(r)], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for r in range(ranks)]
    results = []
    for p in procs:
        so, se = p.communicate(timeout=1800)
        if p.returncode != 0:
            raise RuntimeError(f"rank failed:\n{se[-3000:]}")
        results.append(json.loads(so.strip().splitlines()[-1]))
    return results


def run_fsdp_ranks(args, env):
    port = free_port()
    cmd = [sys.executable, os.path.abspath(__file__), "--fsdp-worker", "--ranks",
           str(args.ranks), "--port", str(port), "--intra-op-steps", str(args.intra_op_steps)]
    return spawn_ranks(cmd, args.ranks, env)


def intra_op_compare(args):
    """The same FSDP steps against tpuds that differ only in
    --intra_op_threads, their rounds taking turns."""
    sys.path.insert(0, os.path.join(ROOT, "tools"))
    from tpud_process import TpudProcess

    cores = len(os.sched_getaffinity(0))
    flags = {"old": [f"--intra_op_threads={cores}"], "default": [],
             "one": ["--intra_op_threads=1"]}
    load_before = os.getloadavg()[0]
    daemons = {}
    best, losses = {}, {}
    try:
        for name, extra in flags.items():
            daemons[name] = TpudProcess(os.path.join(ROOT, "bazel-bin", "daemon", "tpud"),
                                        hbm="1GiB", extra_flags=extra, prefix="tpud-bench.")
            daemons[name].start()
        names = list(flags)
        for r in range(args.intra_op_rounds):
            for name in (names if r % 2 == 0 else names[::-1]):
                env = dict(os.environ)
                env.update(daemons[name].env())
                results = run_fsdp_ranks(args, env)
                seconds = max(res["step_s"] for res in results)  # the slowest rank's
                best[name] = min(best.get(name, float("inf")), seconds)
                losses.setdefault(name, []).append([res["losses"] for res in results])
    finally:
        for d in daemons.values():
            d.close()
    runs = [run for name in flags for run in losses[name]]
    return {
        "ranks": args.ranks, "cores": cores, "steps": args.intra_op_steps,
        "rounds": args.intra_op_rounds,
        "old_step_ms": best["old"] * 1e3, "default_step_ms": best["default"] * 1e3,
        "one_thread_step_ms": best["one"] * 1e3,
        "default_speedup_vs_old": best["old"] / best["default"],
        "one_thread_speedup_vs_old": best["old"] / best["one"],
        "default_vs_one_thread": best["one"] / best["default"],
        "same_losses": all(run == runs[0] for run in runs),
        "loadavg_1m_before": load_before, "loadavg_1m_after": os.getloadavg()[0],
    }


def run_ranks(args, env):
    port = free_port()
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", "--ranks", str(args.ranks),
           "--port", str(port), "--big-mib", str(args.big_mib), "--small-iters",
           str(args.small_iters), "--big-iters", str(args.big_iters), "--ddp-steps",
           str(args.ddp_steps)]
    results = spawn_ranks(cmd, args.ranks, env)
    # The collective's time is its slowest rank's.
    return {b: {k: max(r[b][k] for r in results) for k in results[0][b]} for b in ("gloo", "tpu")}


def memcpy_gbytes_per_s(mib):
    import torch

    torch.set_num_threads(1)
    src = torch.ones(mib * (1 << 20) // 4)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t0)
    return mib * (1 << 20) / best / 1e9


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--start-daemon", action="store_true")
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--big-mib", type=int, default=256)
    ap.add_argument("--small-iters", type=int, default=100)
    ap.add_argument("--big-iters", type=int, default=3)
    ap.add_argument("--ddp-steps", type=int, default=10)
    ap.add_argument("--intra-op", action="store_true",
                    help="compare --intra_op_threads settings instead (starts its own tpuds)")
    ap.add_argument("--intra-op-steps", type=int, default=5)
    ap.add_argument("--intra-op-rounds", type=int, default=2)
    ap.add_argument("--train-steps", type=int, default=5)
    ap.add_argument("--train-rounds", type=int, default=3)
    ap.add_argument("--train-worker", choices=("fsdp", "tp"))
    ap.add_argument("--out")
    ap.add_argument("--worker", action="store_true")
    ap.add_argument("--fsdp-worker", action="store_true")
    ap.add_argument("--rank", type=int)
    ap.add_argument("--port", type=int)
    args = ap.parse_args()
    if args.worker:
        worker(args.rank, args.ranks, args.port, args.big_mib, args.small_iters,
               args.big_iters, args.ddp_steps)
        return
    if args.train_worker:
        train_worker(args.rank, args.ranks, args.port, args.train_worker, args.train_steps,
                     args.train_rounds)
        return
    if args.fsdp_worker:
        fsdp_worker(args.rank, args.ranks, args.port, args.intra_op_steps)
        return
    if args.intra_op:
        text = json.dumps({"intra_op": intra_op_compare(args)}, indent=2)
        print(text)
        if args.out:
            with open(args.out, "w") as f:
                f.write(text + "\n")
        return
    env = dict(os.environ)
    daemon = None
    if args.start_daemon:
        sys.path.insert(0, os.path.join(ROOT, "tools"))
        from tpud_process import TpudProcess

        hbm_mib = max(1024, 4 * args.big_mib + 512)
        daemon = TpudProcess(os.path.join(ROOT, "bazel-bin", "daemon", "tpud"),
                             hbm=f"{hbm_mib}MiB", prefix="tpud-bench.")
        daemon.start()
        env.update(daemon.env())
    try:
        both = run_ranks(args, env)
        gloo, tpu = both["gloo"], both["tpu"]
        fsdp = run_train_ranks(args, env, "fsdp", 4)
        tp = run_train_ranks(args, env, "tp", 2)
    finally:
        if daemon is not None:
            daemon.close()
    n = args.ranks
    nbytes = args.big_mib * (1 << 20)
    bus = lambda t: 2 * (n - 1) / n * nbytes / t / 1e9  # noqa: E731
    memcpy = memcpy_gbytes_per_s(args.big_mib)
    doc = {
        "ranks": n,
        "allreduce_small": {"gloo_us": gloo["small_s"] * 1e6, "tpu_us": tpu["small_s"] * 1e6,
                            "ratio": gloo["small_s"] / tpu["small_s"], "target": 5.0},
        "allreduce_big": {"mib": args.big_mib, "gloo_busbw_gbytes_per_s": bus(gloo["big_s"]),
                          "tpu_busbw_gbytes_per_s": bus(tpu["big_s"]),
                          "ratio": gloo["big_s"] / tpu["big_s"], "target": 2.0,
                          "memcpy_gbytes_per_s": memcpy,
                          "tpu_busbw_vs_memcpy": bus(tpu["big_s"]) / memcpy},
        "ddp_step": {"gloo_ms": gloo["ddp_step_s"] * 1e3, "tpu_ms": tpu["ddp_step_s"] * 1e3,
                     "ratio": gloo["ddp_step_s"] / tpu["ddp_step_s"],
                     # The same step without DDP, on each backend's device:
                     # what the step costs apart from its gradient all-reduce.
                     "cpu_local_ms": gloo["local_step_s"] * 1e3,
                     "tpu_local_ms": tpu["local_step_s"] * 1e3,
                     "grad_bytes": tpu["ddp_grad_bytes"], "target": 1.0},
        "fsdp_step_4": fsdp,
        "tp_step_2": tp,
        "loadavg_1m_after": os.getloadavg()[0],
    }
    text = json.dumps(doc, indent=2)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
