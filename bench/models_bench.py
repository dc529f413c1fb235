#!/usr/bin/env python3
"""Real models on "tpu" against CPU eager PyTorch, measured in the same run.

Hugging Face Transformers models built from configs (random weights, no hub
access) and a plain torch.nn CNN. For each: the time of one training step
(forward, backward, AdamW step; the step ends when its results are on the
device, torch.tpu.synchronize()), and for the decoder-only models greedy
generate() tokens per second. Rounds alternate CPU and tpu; figures are
medians after warm-up.

    .venv/bin/python bench/models_bench.py --start-daemon     # bazel-bin/daemon/tpud
    TPUD_SOCKET=/path/tpud.sock .venv/bin/python bench/models_bench.py
    .venv/bin/python bench/models_bench.py --start-daemon --quick   # tiny configs only

One JSON object per line: name, speed_ratio (CPU seconds / tpu seconds; higher
is better), target, project_seconds, baseline_seconds, rounds and the work.
"""
import argparse
import copy
import json
import os
import pathlib
import statistics
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
from tpud_process import TpudProcess  # noqa: E402


def configs(transformers, quick):
    """name -> (model class, config, batch maker, target, generate?)."""
    import torch
    out = {}

    def lm_batch(vocab, batch, seq):
        def make(g):
            ids = torch.randint(0, vocab, (batch, seq), generator=g)
            return {"input_ids": ids, "labels": ids}
        return make

    if not quick:
        out["llama_h512_l4_s128_b4"] = (
            transformers.LlamaForCausalLM,
            transformers.LlamaConfig(hidden_size=512, intermediate_size=1376,
                                     num_hidden_layers=4, num_attention_heads=8,
                                     num_key_value_heads=8, vocab_size=32000,
                                     max_position_embeddings=256),
            lm_batch(32000, 4, 128), 0.95, True)
    out["gpt2_tiny"] = (
        transformers.GPT2LMHeadModel,
        transformers.GPT2Config(n_layer=2, n_head=2, n_embd=64, vocab_size=1000, n_positions=128,
                                attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0),
        lm_batch(1000, 4, 32), None, True)
    out["llama_tiny"] = (
        transformers.LlamaForCausalLM,
        transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2, vocab_size=1000,
                                 max_position_embeddings=128),
        lm_batch(1000, 4, 32), None, True)

    def bert_batch(g):
        ids = torch.randint(0, 1000, (4, 32), generator=g)
        return {"input_ids": ids, "labels": ids}
    out["bert_tiny"] = (
        transformers.BertForMaskedLM,
        transformers.BertConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
                                intermediate_size=128, vocab_size=1000,
                                hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0),
        bert_batch, None, False)

    def t5_batch(g):
        return {"input_ids": torch.randint(1, 1000, (4, 32), generator=g),
                "labels": torch.randint(1, 1000, (4, 16), generator=g)}
    out["t5_tiny"] = (
        transformers.T5ForConditionalGeneration,
        transformers.T5Config(d_model=64, d_ff=128, d_kv=16, num_layers=2, num_heads=4,
                              vocab_size=1000, dropout_rate=0.0, decoder_start_token_id=0),
        t5_batch, None, False)

    def vit_batch(g):
        return {"pixel_values": torch.randn(4, 3, 32, 32, generator=g),
                "labels": torch.randint(0, 10, (4,), generator=g)}
    out["vit_tiny"] = (
        transformers.ViTForImageClassification,
        transformers.ViTConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
                               intermediate_size=128, image_size=32, patch_size=8,
                               num_labels=10, hidden_dropout_prob=0.0,
                               attention_probs_dropout_prob=0.0),
        vit_batch, None, False)
    return out


class Cnn:
    """Plain torch.nn CNN with batch norm, cross-entropy, AdamW."""

    def __init__(self, torch):
        nn = torch.nn
        self.model = nn.Sequential(
            nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(16, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(32, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(),
            nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, 10))


def median_step(step, rounds):
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), times


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--start-daemon", action="store_true")
    p.add_argument("--quick", action="store_true", help="tiny configs, fewer rounds")
    p.add_argument("--rounds", type=int, default=0, help="measured steps per device")
    p.add_argument("--hbm", default="8GiB")
    p.add_argument("--tpud", default=str(ROOT / "bazel-bin" / "daemon" / "tpud"),
                   help="tpud binary for --start-daemon (bench/run.sh builds it with -c opt)")
    args = p.parse_args()
    rounds = args.rounds or (3 if args.quick else 7)

    daemon = None
    if args.start_daemon:
        daemon = TpudProcess(args.tpud, args.hbm,
                             prefix="tpud-models-bench.")
        daemon.start(timeout=30)
        os.environ["TPUD_SOCKET"] = daemon.socket
    try:
        import torch
        import torch_tpu  # noqa: F401
        import transformers
        transformers.logging.set_verbosity_error()
        torch.manual_seed(0)

        def sync(device):
            if device == "tpu":
                torch.tpu.synchronize()

        def to(batch, device):
            return {k: v.to(device) for k, v in batch.items()}

        def emit(name, cpu_s, tpu_s, target, work, cpu_t, tpu_t):
            print(json.dumps({
                "name": name, "speed_ratio": round(cpu_s / tpu_s, 4), "target": target,
                "project_seconds": tpu_s, "baseline_seconds": cpu_s,
                "baseline": "CPU eager, same run", "work": work,
                "cpu_rounds": [round(t, 5) for t in cpu_t],
                "tpu_rounds": [round(t, 5) for t in tpu_t]}), flush=True)

        def bench_train(name, make_model, make_batch, target, work):
            models = {"cpu": make_model()}
            models["tpu"] = copy.deepcopy(models["cpu"]).to("tpu")
            opts = {d: torch.optim.AdamW(m.parameters(), lr=1e-4) for d, m in models.items()}
            g = torch.Generator().manual_seed(1)
            batch = make_batch(g)
            batches = {d: to(batch, d) for d in models}

            def step(device):
                def run():
                    m, o = models[device], opts[device]
                    o.zero_grad()
                    m(**batches[device]).loss.backward()
                    o.step()
                    sync(device)
                return run
            for d in models:  # warm-up: first steps allocate and fill caches
                for _ in range(2):
                    step(d)()
            cpu_t, tpu_t = [], []
            for _ in range(rounds):
                cpu_t.append(median_step(step("cpu"), 1)[0])
                tpu_t.append(median_step(step("tpu"), 1)[0])
            emit(f"train_step_{name}", statistics.median(cpu_t), statistics.median(tpu_t),
                 target, work, cpu_t, tpu_t)
            return models

        def bench_generate(name, models):
            g = torch.Generator().manual_seed(2)
            ids = torch.randint(0, models["cpu"].config.vocab_size, (1, 8), generator=g)
            new = 16
            times = {"cpu": [], "tpu": []}
            outs = {}
            for r in range(rounds + 1):
                for d in ("cpu", "tpu"):
                    models[d].eval()
                    t0 = time.perf_counter()
                    out = models[d].generate(ids.to(d), max_new_tokens=new, min_new_tokens=new,
                                             do_sample=False, pad_token_id=0)
                    outs[d] = out.cpu().tolist()
                    if r > 0:  # the first round warms up
                        times[d].append(new / (time.perf_counter() - t0))
            assert outs["cpu"] == outs["tpu"], f"{name}: generate() tokens differ"
            cpu_tps, tpu_tps = statistics.median(times["cpu"]), statistics.median(times["tpu"])
            print(json.dumps({
                "name": f"generate_{name}", "speed_ratio": round(tpu_tps / cpu_tps, 4),
                "target": None, "tpu_tokens_per_s": round(tpu_tps, 2),
                "cpu_tokens_per_s": round(cpu_tps, 2), "baseline": "CPU eager, same run",
                "work": f"greedy, {new} new tokens after 8, batch 1",
                "same_tokens": True}), flush=True)

        for name, (cls, cfg, make_batch, target, gen) in configs(transformers,
                                                                 args.quick).items():
            torch.manual_seed(0)
            models = bench_train(name, lambda: cls(cfg), make_batch, target,
                                 f"{cls.__name__}, AdamW")
            if gen:
                bench_generate(name, models)

        class Wrap(torch.nn.Module):
            def __init__(self, m):
                super().__init__()
                self.m = m

            def forward(self, pixel_values, labels):
                logits = self.m(pixel_values)
                return type("Out", (), {"loss": torch.nn.functional.cross_entropy(logits, labels)})

        def cnn_batch(g):
            return {"pixel_values": torch.randn(8, 3, 32, 32, generator=g),
                    "labels": torch.randint(0, 10, (8,), generator=g)}
        bench_train("cnn_bn", lambda: Wrap(Cnn(torch).model), cnn_batch, None,
                    "3 conv + batch norm layers, 8x3x32x32, AdamW")
    finally:
        if daemon is not None:
            daemon.close()


if __name__ == "__main__":
    main()
