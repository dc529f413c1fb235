#!/usr/bin/env python3
"""The pjrt_* figures: tpud's PJRT backend on XLA's CPU plugin (xla-cpu-pjrt in
.venv) against calling the same compiled program on the same plugin in-process
(bench/pjrt_inprocess_bench, inputs resident on the device), in the same run.

    .venv/bin/python bench/pjrt_bench.py [--tpud bazel-bin/daemon/tpud] [--rounds 5]

The in-process baseline and the tpud figure are measured in pairs, one
after the other, --rounds times; speed_ratio is the median of the pairs'
ratios (pair_ratios lists them). Within a pair, both sides time the tiny
op alike: the median of 5 rounds of 20000 calls.

One JSON object per line (as bench/torch_bench.py):
  pjrt_tiny_op       x.add_(1) on a 1-element tensor, issued from Python through
                     tpud, against one in-process call of the program tpud
                     compiles for it. Target 0.5.
  pjrt_matmul_1024   a 1024x1024 float32 matmul through tpud against the same
                     dot in-process. Target 0.95.
  pjrt_train_step    torch_bench's small-op AdamW training step on tpu (PJRT)
                     against CPU eager PyTorch, reported as it is (no target).
  pjrt_second_process_first_step
                     the first AdamW step of a 6-block MLP in a new process, on a
                     tpud where another process already took that step, against
                     the first process's first step (it compiled every program).
                     Target 10.
  pjrt_restart_first_step
                     the same first step in a new process after tpud restarted
                     with --compile_cache_dir, against the first process's first
                     step before the restart. Target 5.
  (--first-steps-only runs just these two.)

Fused eager (TPU_EAGER_MODE=fused), on a tpud with --pjrt_memory=device (what
fusion compiles whole), against CPU eager and against direct eager on the same
tpud, in the same run (--fused-only runs just these):
  pjrt_fused_train_step_vs_cpu
                     the small-op AdamW step above, fused, against CPU eager.
                     Target 1.0.
  pjrt_fused_vs_direct_train_step
                     the same step fused against direct. Target 3.
  pjrt_fused_llama_step_vs_cpu
                     a Llama (hidden 512, 4 layers, seq 128, batch 4; as
                     bench/models_bench.py) AdamW step ending in loss.item(),
                     fused, against CPU eager. Target 1.0.
  pjrt_fused_recompiles
                     programs compiled during 50 steps of each (loss.item()
                     after each) after the first step, and after the third.
                     Target 0.
"""
import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
sys.path.insert(0, str(ROOT / "bench"))
from tpud_process import TpudProcess  # noqa: E402


def plugin_path():
    import xla_plugins.xla_cpu_pjrt as m

    return os.path.join(os.path.dirname(m.__file__), "xla_cpu_pjrt.so")


def figure(name, project, baseline, target, work, baseline_what):
    return {"name": name, "speed_ratio": round(baseline / project, 4), "target": target,
            "project_seconds": float(f"{project:.6g}"), "baseline_seconds": float(f"{baseline:.6g}"),
            "baseline": baseline_what, "work": work}


def per_unit_seconds(fn, units, sync, rounds):
    """Median seconds per call of fn over `rounds` rounds of `units` calls
    (after one warm-up call), each round ended by sync()."""
    times = []
    fn()
    sync()
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(units):
            fn()
        sync()
        times.append((time.perf_counter() - t0) / units)
    return statistics.median(times)


# One process's first training step on tpu. A first AdamW step costs about a
# second on the CPU too (PyTorch imports torch._dynamo and more on first
# use), the same on every device; one step of a copy on the CPU pays that
# first, so the figure is what the device path adds: its programs.
FIRST_STEP = r"""
import copy, json, time
import torch
import torch_tpu  # noqa: F401
torch.manual_seed(0)
nn = torch.nn
blocks = [nn.Sequential(nn.Linear(256, 256), nn.LayerNorm(256), nn.GELU()) for _ in range(6)]
model = nn.Sequential(*blocks, nn.Linear(256, 10))
x, y = torch.randn(64, 256), torch.randint(0, 10, (64,))
def step(model, dev):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loss = nn.functional.cross_entropy(model(x.to(dev)), y.to(dev))
    loss.backward()
    opt.step()
    return loss.item()
step(copy.deepcopy(model), "cpu")
t0 = time.perf_counter()
value = step(model.to("tpu"), "tpu")
print(json.dumps({"seconds": time.perf_counter() - t0, "loss": value}))
"""


# The fused eager figures' measurements, in one process on a tpud with device
# memory: {"argv": [rounds, llama steps, recompile steps, tpuctl]} in, one
# JSON object out.
FUSED = r"""
import copy, json, statistics, subprocess, sys, time
import torch
import torch_tpu  # noqa: F401
import transformers
sys.path.insert(0, sys.argv[2])
import torch_bench
rounds, llama_steps, recompile_steps, tpuctl = json.loads(sys.argv[1])
transformers.logging.set_verbosity_error()
out = {}

def compiles():
    doc = json.loads(subprocess.run([tpuctl, "status", "--json"], capture_output=True, text=True,
                                    check=True).stdout)
    return sum(c["compiles"] for e in doc["executors"] for c in e.get("compile", []))

def timed(fn, units, sync):
    t0 = time.perf_counter()
    for _ in range(units):
        fn()
    sync()
    return (time.perf_counter() - t0) / units

# The small-op MLP: 10 steps then a synchronisation, rounds of CPU, direct
# and fused one after the other.
torch.tpu.set_eager_mode("direct")
steps = {"cpu": torch_bench.small_op_model(torch, "cpu"), "direct": torch_bench.small_op_model(torch, "tpu")}
torch.tpu.set_eager_mode("fused")
steps["fused"] = torch_bench.small_op_model(torch, "tpu")
sync = {"cpu": lambda: None, "direct": torch.tpu.synchronize, "fused": torch.tpu.synchronize}
small = {k: [] for k in steps}
for r in range(rounds + 1):
    for k in steps:
        torch.tpu.set_eager_mode("fused" if k == "fused" else "direct")
        t = timed(steps[k], 10, sync[k])
        if r > 0:  # the first round compiles and warms up
            small[k].append(t)
out["small"] = small

# The Llama step of models_bench.py, each step ending in loss.item().
cfg = transformers.LlamaConfig(hidden_size=512, intermediate_size=1376, num_hidden_layers=4,
                               num_attention_heads=8, num_key_value_heads=8, vocab_size=32000,
                               max_position_embeddings=256)
torch.manual_seed(0)
base = transformers.LlamaForCausalLM(cfg)
ids = torch.randint(0, 32000, (4, 128), generator=torch.Generator().manual_seed(1))

def llama(device):
    model = copy.deepcopy(base).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    batch = {"input_ids": ids.to(device), "labels": ids.to(device)}
    def step():
        opt.zero_grad()
        loss = model(**batch).loss
        loss.backward()
        opt.step()
        return loss.item()
    return step

llama_steps_of = {"cpu": llama("cpu"), "fused": llama("tpu")}
llama_t = {k: [] for k in llama_steps_of}
losses = {k: [] for k in llama_steps_of}
for k, step in llama_steps_of.items():
    torch.tpu.set_eager_mode("fused" if k == "fused" else "direct")
    for i in range(3 + llama_steps):
        t0 = time.perf_counter()
        losses[k].append(step())
        if i >= 3:  # three steps warm up (the first two runs compile)
            llama_t[k].append(time.perf_counter() - t0)
out["llama"] = llama_t
out["llama_losses"] = losses

# Recompiles: programs compiled while each model takes recompile_steps more
# steps, after its first step and after its third.
torch.tpu.set_eager_mode("fused")
torch.manual_seed(0)
fresh = {"small": torch_bench.small_op_model(torch, "tpu"), "llama": llama("tpu")}
recompiles = {}
for name, step in fresh.items():
    def one():
        v = step()
        torch.tpu.synchronize()
        return v
    one()
    c1 = compiles()
    one(); one()
    c3 = compiles()
    for _ in range(recompile_steps):
        one()
    c_end = compiles()
    recompiles[name] = {"after_first_step": c_end - c1, "after_third_step": c_end - c3}
out["recompiles"] = recompiles
print(json.dumps(out))
"""


def fused_figures(args, plugin):
    """The pjrt_fused_* figures (see the module's docstring)."""
    tpud = pathlib.Path(args.tpud)
    tpuctl = tpud.parents[1] / "tools" / "tpuctl" / "tpuctl"
    daemon = TpudProcess(args.tpud, "4GiB", ["--backend=pjrt", f"--pjrt_plugin={plugin}",
                                             "--pjrt_option=cpu_device_count=4",
                                             "--pjrt_memory=device"],
                         prefix="tpud-pjrt-fused-bench.")
    daemon.start(timeout=30)
    try:
        conf = [args.rounds, max(1, int(5 * args.scale)), max(1, int(50 * args.scale)), str(tpuctl)]
        r = subprocess.run([sys.executable, "-c", FUSED, json.dumps(conf), str(ROOT / "bench")],
                           env=daemon.env(), capture_output=True, text=True, timeout=3600)
        if r.returncode != 0:
            sys.exit(f"pjrt_bench: the fused figures failed: {r.stderr[-3000:]}")
        got = json.loads(r.stdout.strip().splitlines()[-1])
    finally:
        daemon.close()
    med = {k: statistics.median(v) for k, v in got["small"].items()}
    rounds = {k: [round(x, 6) for x in v] for k, v in got["small"].items()}
    f = figure("pjrt_fused_train_step_vs_cpu", med["fused"], med["cpu"], 1.0,
               "one AdamW step of torch_bench's small-op MLP, fused eager (10 steps, then a synchronize)",
               "CPU eager PyTorch, same work, same run")
    f["rounds_seconds"] = rounds
    print(json.dumps(f), flush=True)
    f = figure("pjrt_fused_vs_direct_train_step", med["fused"], med["direct"], 3.0,
               "the same step, fused eager", "direct eager on the same tpud (--pjrt_memory=device), same run")
    f["rounds_seconds"] = rounds
    print(json.dumps(f), flush=True)
    llama = {k: statistics.median(v) for k, v in got["llama"].items()}
    f = figure("pjrt_fused_llama_step_vs_cpu", llama["fused"], llama["cpu"], 1.0,
               "an AdamW step of Llama h512 / 4 layers / seq 128 / batch 4, fused eager, ending in loss.item()",
               "CPU eager PyTorch, same model and batch, same run")
    f["rounds_seconds"] = {k: [round(x, 4) for x in v] for k, v in got["llama"].items()}
    f["losses"] = got["llama_losses"]
    print(json.dumps(f), flush=True)
    rc = got["recompiles"]
    print(json.dumps({"name": "pjrt_fused_recompiles", "target": 0,
                      "recompiles": sum(v["after_first_step"] for v in rc.values()),
                      "recompiles_after_third_step": sum(v["after_third_step"] for v in rc.values()),
                      "by_model": rc, "steps": max(1, int(50 * args.scale)),
                      "work": "fused eager steps of the small-op MLP and the Llama, each ending in a synchronize"}),
          flush=True)


def first_steps(args, plugin):
    """pjrt_second_process_first_step and pjrt_restart_first_step: new
    processes' first training steps, on one tpud and on a restarted one that
    keeps its programs on disk. Each is one process's one step; --rounds
    fresh cache directories give the medians."""
    import tempfile

    def step(daemon):
        r = subprocess.run([sys.executable, "-c", FIRST_STEP], env=daemon.env(), capture_output=True,
                           text=True, timeout=600)
        if r.returncode != 0:
            sys.exit(f"pjrt_bench: a first step failed: {r.stderr[-2000:]}")
        return json.loads(r.stdout.strip().splitlines()[-1])

    runs = {"first": [], "second": [], "restart": []}
    for _ in range(args.rounds):
        with tempfile.TemporaryDirectory(prefix="tpud-compile-cache.") as tmp:
            flags = ["--backend=pjrt", f"--pjrt_plugin={plugin}", "--pjrt_option=cpu_device_count=4",
                     f"--compile_cache_dir={tmp}/programs"]
            daemon = TpudProcess(args.tpud, "1GiB", flags, prefix="tpud-pjrt-bench.")
            daemon.start(timeout=30)
            try:
                first, second = step(daemon), step(daemon)
            finally:
                daemon.close()
            daemon = TpudProcess(args.tpud, "1GiB", flags, prefix="tpud-pjrt-bench.")
            daemon.start(timeout=30)
            try:
                restart = step(daemon)
            finally:
                daemon.close()
        if not first["loss"] == second["loss"] == restart["loss"]:
            sys.exit(f"pjrt_bench: the first steps' losses differ: {first}, {second}, {restart}")
        for key, r in (("first", first), ("second", second), ("restart", restart)):
            runs[key].append(r["seconds"])
    t_first = statistics.median(runs["first"])
    for key, name, target, work in (
            ("second", "pjrt_second_process_first_step", 10.0,
             "the first AdamW step of a 6-block MLP in a second process on the same tpud"),
            ("restart", "pjrt_restart_first_step", 5.0,
             "the same first step after tpud restarted with --compile_cache_dir")):
        f = figure(name, statistics.median(runs[key]), t_first, target, work,
                   "the first process's first step on a fresh tpud (it compiled every program), same run")
        f["rounds_seconds"] = {k: [round(v, 4) for v in vs] for k, vs in runs.items()}
        print(json.dumps(f), flush=True)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tpud", default=str(ROOT / "bazel-bin" / "daemon" / "tpud"))
    p.add_argument("--inprocess", default=str(ROOT / "bazel-bin" / "bench" / "pjrt_inprocess_bench"))
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--scale", type=float, default=1.0)
    p.add_argument("--first-steps-only", action="store_true")
    p.add_argument("--fused-only", action="store_true")
    args = p.parse_args()
    plugin = plugin_path()
    if not args.fused_only:
        first_steps(args, plugin)
    if args.first_steps_only:
        return
    fused_figures(args, plugin)
    if args.fused_only:
        return

    def inprocess():
        r = subprocess.run([args.inprocess, plugin, "cpu_device_count=4"], capture_output=True,
                           text=True, timeout=600)
        if r.returncode != 0:
            sys.exit(f"pjrt_bench: {args.inprocess} failed: {r.stderr[-2000:]}")
        return json.loads(r.stdout.strip().splitlines()[-1])

    daemon = TpudProcess(args.tpud, "1GiB", ["--backend=pjrt", f"--pjrt_plugin={plugin}",
                                             "--pjrt_option=cpu_device_count=4"],
                         prefix="tpud-pjrt-bench.")
    daemon.start(timeout=30)
    os.environ["TPUD_SOCKET"] = daemon.socket
    try:
        import torch
        import torch_tpu  # noqa: F401
        import torch_bench

        def per_unit(fn, units, sync):
            return per_unit_seconds(fn, units, sync, args.rounds)

        sync = torch.tpu.synchronize
        x = torch.zeros(1, device="tpu")
        a = torch.full((1024, 1024), 0.5, device="tpu")
        # Pairs of (in-process baseline, the same through tpud), one after the
        # other, so that a machine whose speed drifts during the run slows
        # both sides of each pair alike; medians over the pairs.
        pairs = {"tiny": [], "mm": [], "base_tiny": [], "base_mm": []}
        for _ in range(args.rounds):
            base = inprocess()
            pairs["base_tiny"].append(base["tiny_op_s"])
            pairs["base_mm"].append(base["matmul_1024_s"])
            # As many calls and rounds as the in-process side makes (20000 x 5).
            pairs["tiny"].append(per_unit_seconds(lambda: x.add_(1), max(1, int(20000 * args.scale)),
                                                  sync, 5))
            pairs["mm"].append(per_unit_seconds(lambda: torch.mm(a, a), max(1, int(3 * args.scale)),
                                                sync, 3))
        for key, name, target, work, baseline in (
                ("tiny", "pjrt_tiny_op", 0.5, "one x.add_(1) on a 1-element tensor, issued from Python",
                 "the same program called in-process on the plugin"),
                ("mm", "pjrt_matmul_1024", 0.95, "one 1024x1024 float32 matmul",
                 "the same dot called in-process on the plugin")):
            f = figure(name, statistics.median(pairs[key]), statistics.median(pairs["base_" + key]),
                       target, work, baseline)
            ratios = [b / p for b, p in zip(pairs["base_" + key], pairs[key])]
            f["speed_ratio"] = round(statistics.median(ratios), 4)  # median of the pairs' ratios
            f["pair_ratios"] = [round(v, 4) for v in ratios]
            print(json.dumps(f), flush=True)
        step = {dev: torch_bench.small_op_model(torch, dev) for dev in ("cpu", "tpu")}
        units = max(1, int(10 * args.scale))
        t_tpu = per_unit(step["tpu"], units, sync)
        t_cpu = per_unit(step["cpu"], units, lambda: None)
        print(json.dumps(figure("pjrt_train_step", t_tpu, t_cpu, None,
                                "one AdamW step of torch_bench's small-op MLP on --backend=pjrt",
                                "CPU eager PyTorch, same work, same run")), flush=True)
    finally:
        daemon.close()


if __name__ == "__main__":
    main()
