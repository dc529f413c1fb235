#!/usr/bin/env python3
"""torch.compile on "tpu" (tpud programs) against tpu eager and CPU eager, in one run.

    TPUD_SOCKET=... .venv/bin/python bench/compile_bench.py [--rounds 5] [--scale 1]

The three small-op steps (compiled, tpu eager, CPU eager) are measured in
interleaved rounds (2 * rounds + 1 of them), medians reported.
    .venv/bin/python bench/compile_bench.py --start-daemon    # its own tpud (bazel-bin)

One JSON object per line (as bench/torch_bench.py):
  compiled_vs_eager_small_op_train_step  torch_bench's small-op AdamW step (4-layer
      width-16 MLP), model and optimizer step compiled with backend="tpu", against
      the same step in tpu eager. Target 2.
  compiled_vs_cpu_small_op_train_step    the compiled tpu step against CPU eager.
      Target 1.0.
  compiled_generate                      tokens/s of a tiny Llama's greedy
      generate() (static KV cache, forward compiled) against eager tpu. No target.

With --backend pjrt (and --start-daemon) the daemon runs the PJRT backend on XLA's
CPU plugin with device memory, where each compiled graph is one StableHLO module;
the figures are then named pjrt_compiled_* and have no target (as pjrt_train_step).
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
sys.path.insert(0, str(ROOT / "bench"))


from pjrt_bench import figure, per_unit_seconds  # noqa: E402  (the benches' shared helpers)


per_unit = per_unit_seconds


def interleaved_per_unit(runs, units, rounds):
    """Median seconds per call of each of `runs` ({name: (fn, sync)}), measured
    in interleaved rounds of `units` calls (the order rotating each round), so
    that a machine whose speed drifts during the run slows every side alike."""
    names = list(runs)
    for fn, sync in runs.values():  # warm-up
        fn()
        sync()
    times = {n: [] for n in names}
    for r in range(rounds):
        for n in names[r % len(names):] + names[:r % len(names)]:
            fn, sync = runs[n]
            t0 = time.perf_counter()
            for _ in range(units):
                fn()
            sync()
            times[n].append((time.perf_counter() - t0) / units)
    return {n: statistics.median(t) for n, t in times.items()}


def compiled_step(torch, torch_bench):
    step = torch_bench.small_op_model(torch, "tpu")
    # The model and the optimizer the eager step closes over, compiled.
    cells = {c.cell_contents.__class__.__name__: c.cell_contents for c in step.__closure__
             if hasattr(c.cell_contents, "parameters") or hasattr(c.cell_contents, "step")}
    model, opt = cells["Sequential"], cells["AdamW"]
    x = [c.cell_contents for c in step.__closure__ if isinstance(c.cell_contents, torch.Tensor)]
    x, y = sorted(x, key=lambda t: -t.shape[1])
    # As Dynamo does for CUDA: the optimizer's step counts on the device, so
    # the compiled step has no host values (set before its state exists).
    for group in opt.param_groups:
        group["capturable"] = True
    cmodel = torch.compile(model, backend="tpu")
    copt_step = torch.compile(opt.step, backend="tpu")

    def run():
        loss = ((cmodel(x) - y) ** 2).mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        copt_step()
    return run


def generate_figure(torch, rounds, scale):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).eval().to("tpu")
    ids = torch.randint(0, 256, (1, 8)).to("tpu")
    new = max(4, int(24 * scale))

    def gen():
        with torch.no_grad():
            return model.generate(ids, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                                  cache_implementation="static")
    eager_out = gen()
    t_eager = per_unit(gen, 1, torch.tpu.synchronize, rounds)
    model.forward = torch.compile(model.forward, backend="tpu")
    compiled_out = gen()
    assert torch.equal(compiled_out.cpu(), eager_out.cpu()), "compiled generate() differs from eager"
    t_comp = per_unit(gen, 1, torch.tpu.synchronize, rounds)
    return figure("compiled_generate", t_comp, t_eager, None,
                  f"greedy generate() of {new} tokens, tiny Llama (2 layers, width 64), static cache",
                  "the same generate() in tpu eager")


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--scale", type=float, default=1.0)
    p.add_argument("--start-daemon", action="store_true")
    p.add_argument("--tpud", default=str(ROOT / "bazel-bin" / "daemon" / "tpud"))
    p.add_argument("--skip-generate", action="store_true")
    p.add_argument("--backend", choices=("simulated", "pjrt"), default="simulated",
                   help="the daemon's backend, with --start-daemon (pjrt: XLA's CPU plugin, device memory)")
    p.add_argument("--daemon-flag", action="append", default=[],
                   help="one more tpud flag, with --start-daemon (e.g. --pjrt_graphs=false)")
    args = p.parse_args()
    daemon = None
    pjrt = args.backend == "pjrt"
    prefix = "pjrt_" if pjrt else ""
    if args.start_daemon:
        from tpud_process import TpudProcess

        flags = []
        if pjrt:
            from pjrt_bench import plugin_path

            flags = ["--backend=pjrt", f"--pjrt_plugin={plugin_path()}", "--pjrt_option=cpu_device_count=4",
                     "--pjrt_memory=device"]
        daemon = TpudProcess(args.tpud, "1GiB", flags + args.daemon_flag, prefix="tpud-compile-bench.")
        daemon.start(timeout=30)
        os.environ["TPUD_SOCKET"] = daemon.socket
    try:
        import torch
        import torch_tpu  # noqa: F401
        import torch_bench

        sync = torch.tpu.synchronize
        units = max(1, int(20 * args.scale))
        eager = torch_bench.small_op_model(torch, "tpu")
        cpu = torch_bench.small_op_model(torch, "cpu")
        comp = compiled_step(torch, torch_bench)
        t = interleaved_per_unit({"compiled": (comp, sync), "eager": (eager, sync),
                                  "cpu": (cpu, lambda: None)}, units, max(3, 2 * args.rounds + 1))
        t_comp, t_eager, t_cpu = t["compiled"], t["eager"], t["cpu"]
        work = "one AdamW step of torch_bench's small-op MLP (4 blocks, width 16, batch 8)"
        print(json.dumps(figure(prefix + "compiled_vs_eager_small_op_train_step", t_comp, t_eager,
                                None if pjrt else 2.0, work, "the same step in tpu eager")), flush=True)
        print(json.dumps(figure(prefix + "compiled_vs_cpu_small_op_train_step", t_comp, t_cpu,
                                None if pjrt else 1.0, work, "the same step in CPU eager PyTorch")), flush=True)
        if not args.skip_generate:
            f = generate_figure(torch, args.rounds, args.scale)
            f["name"] = prefix + f["name"]
            print(json.dumps(f), flush=True)
    finally:
        if daemon is not None:
            daemon.close()


if __name__ == "__main__":
    main()
