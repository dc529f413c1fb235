"""torch.compile on "tpu": graphs captured once and run by tpud as programs.

Every check compares against eager CPU PyTorch (or tpu eager) in a fresh
interpreter on a daemon started for this module, and asserts through
torch_tpu._compile.stats/explain() that the graphs really ran as programs
(not eagerly, op by op)."""
import subprocess
import sys

import pytest

from conftest import child_argv, run_in_child

TPUD_HBM = "2GiB"

# Shared by the tests' bodies (which run in a fresh interpreter each, see
# conftest.run_in_child): `same(a, b)` compares outputs; `ran_as_programs()`
# asserts that no graph fell back to eager.

def same(a, b, atol=2e-5, rtol=2e-4, what=""):
    import torch
    torch.testing.assert_close(a.detach().cpu(), b.detach().cpu(), atol=atol, rtol=rtol,
                               msg=lambda m: f"{what}: {m}")


def error_of(fn, what):
    """The message of the RuntimeError fn() raises (AssertionError naming
    `what` if none)."""
    try:
        fn()
    except RuntimeError as e:
        return str(e)
    raise AssertionError(what)


def ran_as_programs(min_captures=1):
    from torch_tpu import _compile
    assert not _compile.explain(), _compile.explain()
    assert _compile.stats["captures"] >= min_captures, _compile.stats
    assert _compile.stats["eager_calls"] == 0, _compile.stats


def fwd_bwd(model_cpu, model_tpu, x, steps=2, **compile_kw):
    import torch
    compile_kw = {"backend": "tpu", **compile_kw}   # backend=None: torch.compile's default
    if compile_kw["backend"] is None:
        del compile_kw["backend"]
    cm = torch.compile(model_tpu, **compile_kw)
    for step in range(steps):
        ref = model_cpu(x)
        out = cm(x.to("tpu"))
        same(out, ref, what=f"step {step} output")
        ref.float().pow(2).mean().backward()
        out.float().pow(2).mean().backward()
        for (name, p), q in zip(model_cpu.named_parameters(), model_tpu.parameters()):
            same(q.grad, p.grad, what=f"step {step} grad {name}")
            p.grad = None
            q.grad = None


@pytest.mark.slow
def test_compiled_equals_eager_for_mlp_cnn_with_batch_norm_and_transformer_block(tpud):
    run_in_child(tpud, _mlp_cnn_and_transformer_block, timeout=600)


def _mlp_cnn_and_transformer_block():
    import torch
    from torch_tpu import _compile
    import copy
    torch.manual_seed(0)
    nn = torch.nn
    mlp = nn.Sequential(nn.Linear(12, 32), nn.GELU(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 3))
    fwd_bwd(mlp, copy.deepcopy(mlp).to("tpu"), torch.randn(5, 12))
    cnn = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.MaxPool2d(2),
                        nn.Conv2d(8, 4, 3), nn.BatchNorm2d(4), nn.Flatten(), nn.Linear(4 * 2 * 2, 5))
    cnn_tpu = copy.deepcopy(cnn).to("tpu")
    fwd_bwd(cnn, cnn_tpu, torch.randn(4, 3, 8, 8))
    # batch norm's running statistics are input mutations the program writes
    same(cnn_tpu[1].running_mean, cnn[1].running_mean, what="running_mean")
    same(cnn_tpu[1].running_var, cnn[1].running_var, what="running_var")
    block = nn.TransformerEncoderLayer(d_model=16, nhead=4, dim_feedforward=32, dropout=0.0,
                                       batch_first=True)
    fwd_bwd(block, copy.deepcopy(block).to("tpu"), torch.randn(2, 7, 16))
    ran_as_programs(min_captures=6)
    print("ok", _compile.stats)


@pytest.mark.slow
def test_hugging_face_models_compiled_equal_cpu(tpud):
    pytest.importorskip("transformers")
    run_in_child(tpud, _hugging_face_models_compiled, timeout=900)


def _hugging_face_models_compiled():
    import torch
    from torch_tpu import _compile
    import copy
    import transformers
    torch.manual_seed(0)
    models = {
        "llama": transformers.LlamaForCausalLM(transformers.LlamaConfig(
            vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)),
        "gpt2": transformers.GPT2LMHeadModel(transformers.GPT2Config(
            vocab_size=128, n_embd=32, n_layer=2, n_head=4, n_positions=64,
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)),
        "bert": transformers.BertForMaskedLM(transformers.BertConfig(
            vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=4, max_position_embeddings=64, hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0)),
    }
    ids = torch.randint(0, 128, (2, 12))
    captured = {}
    for name, ref in models.items():
        before = _compile.stats["captures"]
        ref.eval()
        dev = copy.deepcopy(ref).to("tpu")
        cm = torch.compile(dev, backend="tpu")
        out_ref = ref(input_ids=ids, labels=ids)
        out_dev = cm(input_ids=ids.to("tpu"), labels=ids.to("tpu"))
        same(out_dev.logits, out_ref.logits, what=f"{name} logits")
        same(out_dev.loss, out_ref.loss, what=f"{name} loss")
        out_ref.loss.backward()
        out_dev.loss.backward()
        for (pname, p), q in zip(ref.named_parameters(), dev.parameters()):
            if p.grad is None:
                continue
            same(q.grad, p.grad, atol=1e-4, what=f"{name} grad {pname}")
        captured[name] = _compile.stats["captures"] - before
    # Greedy decoding through a compiled forward gives CPU's tokens.
    ref, dev = models["llama"], copy.deepcopy(models["llama"]).to("tpu")
    dev.forward = torch.compile(dev.forward, backend="tpu", dynamic=True)
    prompt = torch.randint(0, 128, (1, 5))
    want = ref.generate(prompt, max_new_tokens=6, do_sample=False, pad_token_id=0)
    got = dev.generate(prompt.to("tpu"), max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert got.cpu().tolist() == want.tolist(), (got, want)
    # Each model's graphs ran as programs (a graph holding an op the
    # client must run synchronously runs eagerly instead, still equal).
    assert all(n >= 1 for n in captured.values()), (captured, _compile.explain())
    print("ok", captured, _compile.stats, _compile.explain())


@pytest.mark.slow
def test_training_loop_with_compiled_model_and_optimizer_step_reaches_cpu_losses(tpud):
    run_in_child(tpud, _compiled_training_loop, timeout=600)


def _compiled_training_loop():
    import torch
    from torch_tpu import _compile
    import copy
    torch.manual_seed(0)
    nn = torch.nn
    ref = nn.Sequential(nn.Linear(8, 16), nn.SiLU(), nn.Linear(16, 1))
    dev = copy.deepcopy(ref).to("tpu")
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    # capturable: the step count stays on the device (Dynamo sets it for CUDA)
    opt_dev = torch.optim.AdamW(dev.parameters(), lr=1e-2, capturable=True)
    cm = torch.compile(dev, backend="tpu")
    step = torch.compile(opt_dev.step, backend="tpu")
    g = torch.Generator().manual_seed(1)
    for i in range(6):
        x, y = torch.randn(16, 8, generator=g), torch.randn(16, 1, generator=g)
        l_ref = ((ref(x) - y) ** 2).mean()
        l_dev = ((cm(x.to("tpu")) - y.to("tpu")) ** 2).mean()
        same(l_dev, l_ref, atol=1e-5, what=f"loss {i}")
        opt_ref.zero_grad(); opt_dev.zero_grad()
        l_ref.backward(); l_dev.backward()
        opt_ref.step(); step()
    for p, q in zip(ref.parameters(), dev.parameters()):
        same(q, p, atol=1e-5, what="parameters after 6 steps")
    ran_as_programs(min_captures=3)
    # one capture per graph: later steps only ran programs
    assert _compile.stats["runs"] >= 3 * 6, _compile.stats
    print("ok", _compile.stats)


@pytest.mark.slow
def test_a_shape_change_recompiles_and_marked_dynamic_dims_work(tpud):
    run_in_child(tpud, _shape_changes_and_dynamic_dims, timeout=300)


def _shape_changes_and_dynamic_dims():
    import torch
    from torch_tpu import _compile
    f = torch.compile(lambda x: (x * 2 + 1).sum(0), backend="tpu")
    for n in (4, 8, 16, 8, 16):
        x = torch.randn(n, 3)
        same(f(x.to("tpu")), (x * 2 + 1).sum(0), what=f"batch {n}")
    # 3 distinct shapes (Dynamo's static graph for 4, then a dynamic one):
    # each captured once, the repeats only run
    assert _compile.stats["captures"] == 3, _compile.stats
    g = torch.compile(lambda x: torch.relu(x).mean(1), backend="tpu")
    for n in (5, 6, 7):
        x = torch.randn(n, 4)
        xt = x.to("tpu")
        torch._dynamo.mark_dynamic(xt, 0)
        same(g(xt), torch.relu(x).mean(1), what=f"dynamic batch {n}")
    ran_as_programs()
    print("ok", _compile.stats)


def test_a_calls_signature_tells_apart_what_a_capture_depends_on(tpud):
    # _signature (in C++) keys the captures of a graph: what differs here must
    # give another key, what is equal the same one.
    run_in_child(tpud, _call_signatures)


def _call_signatures():
    import torch
    from torch_tpu import _compile
    sig = _compile._signature
    a = torch.zeros(4, 4, device="tpu")
    b = torch.zeros(4, 4, device="tpu")
    assert isinstance(sig([a, b]), bytes)
    assert sig([a, b]) == sig([torch.ones(4, 4, device="tpu"), torch.ones(4, 4, device="tpu")])
    assert sig([a, a]) != sig([a, b]), "shared storage matters"
    assert sig([a, a[1:]]) != sig([a, a]), "offsets"
    assert sig([a.t()]) != sig([a]), "strides"
    assert sig([a]) != sig([a.double()]), "dtypes"
    assert sig([a]) != sig([torch.zeros(2, 8, device="tpu")]), "shapes"
    assert sig([a[:2]]) != sig([torch.zeros(2, 4, device="tpu")]), "storage sizes"
    if torch.tpu.device_count() > 1:
        assert sig([a]) != sig([torch.zeros(4, 4, device="tpu:1")]), "devices"
    # Python scalars: type and value.
    keys = {sig([a, v]) for v in (1, 1.0, True, None, 2, 2.5, -0.0)}
    assert len(keys) == 7, keys
    assert sig([a, 3]) == sig([a, 3]) and sig([a, 1.5]) == sig([a, 1.5])
    # Host scalar tensors by value; other host tensors: eager (None).
    assert sig([a, torch.tensor(2.0)]) == sig([a, torch.tensor(2.0)])
    assert sig([a, torch.tensor(2.0)]) != sig([a, torch.tensor(3.0)])
    assert sig([a, torch.tensor(2)]) != sig([a, torch.tensor(2.0)])
    assert sig([a, torch.zeros(3)]) is None
    # What C++ does not know goes to the Python version: a huge int, a string.
    assert isinstance(sig([a, 1 << 70]), tuple)
    assert sig([a, 1 << 70]) != sig([a, 1 << 71])
    assert sig([a, "text"]) is None
    print("ok")


@pytest.mark.slow
def test_graph_breaks_run_the_pieces_and_the_break_eagerly(tpud):
    run_in_child(tpud, _graph_breaks_run_the_pieces_and_the_break_eagerly, timeout=300)


def _graph_breaks_run_the_pieces_and_the_break_eagerly():
    import torch
    from torch_tpu import _compile
    def f(x):
        y = torch.sin(x) * 3
        if y.sum().item() > 0:        # data-dependent: a graph break
            y = y + 1
        else:
            y = y - 1
        print("between graphs")        # another break
        return torch.cos(y).sum()
    x = torch.randn(6, 5)
    c = torch.compile(f, backend="tpu")
    same(c(x.to("tpu")), f(x), what="graph breaks")
    same(c((-x).to("tpu")), f(-x), what="the other branch")
    ran_as_programs(min_captures=2)
    print("ok", _compile.stats)


def test_in_place_ops_on_inputs_write_the_callers_tensors(tpud):
    run_in_child(tpud, _in_place_ops_on_inputs_write_the_callers_tensors, timeout=300)


def _in_place_ops_on_inputs_write_the_callers_tensors():
    import torch
    from torch_tpu import _compile
    def f(x, y):
        x.add_(1)
        y.mul_(x)
        return x + y
    c = torch.compile(f, backend="tpu")
    for i in range(3):
        x, y = torch.randn(4, 4), torch.randn(4, 4)
        xt, yt = x.to("tpu"), y.to("tpu")
        out_ref = f(x, y)
        out = c(xt, yt)
        same(out, out_ref, what=f"call {i} result")
        same(xt, x, what=f"call {i} x")
        same(yt, y, what=f"call {i} y")
    ran_as_programs()
    print("ok", _compile.stats)


def test_compiled_dropout_repeats_under_manual_seed_and_varies_between_calls(tpud):
    run_in_child(tpud, _compiled_dropout, timeout=300)


def _compiled_dropout():
    import torch
    import torch_tpu  # noqa: F401
    d = torch.compile(lambda t: torch.nn.functional.dropout(t, 0.5, training=True), backend="tpu")
    z = torch.ones(4000, device="tpu")
    torch.tpu.manual_seed(7); a, b = d(z).cpu(), d(z).cpu()
    torch.tpu.manual_seed(7); a2, b2 = d(z).cpu(), d(z).cpu()
    assert torch.equal(a, a2) and torch.equal(b, b2), "not reproducible under manual_seed"
    assert not torch.equal(a, b), "the same mask on every call"
    kept = (a != 0).float().mean().item()
    assert 0.45 < kept < 0.55, kept
    assert set(a.unique().tolist()) <= {0.0, 2.0}
    # eager dropout on tpu repeats too
    torch.tpu.manual_seed(3); e1 = torch.nn.functional.dropout(z, 0.5).cpu()
    torch.tpu.manual_seed(3); e2 = torch.nn.functional.dropout(z, 0.5).cpu()
    assert torch.equal(e1, e2)
    ran_as_programs()
    print("ok")


def test_an_error_inside_a_program_names_the_op_and_the_graph_and_poisons_the_result(tpud):
    run_in_child(tpud, _error_inside_a_program, timeout=300)


def _error_inside_a_program():
    import torch
    import torch_tpu  # noqa: F401
    f = torch.compile(lambda x, i: x.index_select(0, i) * 2, backend="tpu")
    x = torch.randn(5, 3)
    same(f(x.to("tpu"), torch.tensor([0, 4]).to("tpu")), x[[0, 4]] * 2, what="in range")
    bad = f(x.to("tpu"), torch.tensor([0, 9]).to("tpu"))   # the same program, a bad index
    msg = error_of(torch.tpu.synchronize, "no error")
    assert "index_select" in msg and "graph" in msg and "program" in msg, msg
    read = error_of(bad.cpu, "the failed program's output read as data")
    assert "index_select" in read, read
    # the session goes on, and so does the program
    same(f(x.to("tpu"), torch.tensor([2, 1]).to("tpu")), x[[2, 1]] * 2, what="after the error")
    print("ok", msg)


@pytest.mark.slow
def test_the_default_torch_compile_runs_tpu_graphs_as_programs(tpud):
    run_in_child(tpud, _default_torch_compile, timeout=300)


def _default_torch_compile():
    import torch
    import torch_tpu  # noqa: F401
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(6, 6), torch.nn.ReLU())
    x = torch.randn(3, 6)
    ref = m(x)
    out = torch.compile(m.to("tpu"))(x.to("tpu"))   # no backend named: Inductor's default
    same(out, ref, what="default compile")
    ran_as_programs()
    print("ok")


@pytest.mark.slow
def test_reduce_overhead_mode_trains_as_programs_with_and_without_the_tpu_backend_named(tpud):
    run_in_child(tpud, _reduce_overhead_mode, timeout=300)


def _reduce_overhead_mode():
    import torch
    from torch_tpu import _compile
    import copy
    torch.manual_seed(0)
    ref = torch.nn.Sequential(torch.nn.Linear(6, 12), torch.nn.GELU(), torch.nn.Linear(12, 2))
    for kw in (dict(mode="reduce-overhead"), dict(backend=None, mode="reduce-overhead")):
        torch._dynamo.reset()
        fwd_bwd(ref, copy.deepcopy(ref).to("tpu"), torch.randn(4, 6), steps=3, **kw)
    ran_as_programs(min_captures=4)
    print("ok", _compile.stats)


def _train_compiled_against_cpu(seed):
    import copy
    import torch
    torch.manual_seed(seed)
    nn = torch.nn
    ref = nn.Sequential(nn.Linear(10, 20), nn.Tanh(), nn.Linear(20, 1))
    dev = copy.deepcopy(ref).to("tpu")
    cm = torch.compile(dev, backend="tpu")
    o1, o2 = torch.optim.SGD(ref.parameters(), lr=0.05), torch.optim.SGD(dev.parameters(), lr=0.05)
    for i in range(30):
        x = torch.randn(8, 10)
        l1 = ref(x).pow(2).mean(); l2 = cm(x.to("tpu")).pow(2).mean()
        same(l2, l1, atol=1e-5, what=f"loss {i}")
        o1.zero_grad(); o2.zero_grad(); l1.backward(); l2.backward(); o1.step(); o2.step()
    ran_as_programs(min_captures=2)
    print("ok")


@pytest.mark.slow
def test_two_processes_run_compiled_programs_at_once(tpud):
    env = tpud.env()
    procs = [subprocess.Popen(child_argv(_train_compiled_against_cpu, seed), env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for seed in (1, 2)]
    for p in procs:
        out, _ = p.communicate(timeout=600)
        assert p.returncode == 0 and "ok" in out, out[-3000:]


def test_tpuctl_lists_each_sessions_programs_with_calls_and_time(tpud):
    from conftest import bazel_bin

    run_in_child(tpud, _tpuctl_lists_my_programs, bazel_bin("tools/tpuctl/tpuctl"), timeout=300)


def _tpuctl_lists_my_programs(tpuctl_path):
    import json
    import os
    import subprocess
    import torch
    f = torch.compile(lambda x: torch.tanh(x) * 3 + x, backend="tpu")
    x = torch.randn(64, device="tpu")
    for _ in range(5):
        f(x)
    torch.tpu.synchronize()
    def tpuctl(*args):
        r = subprocess.run([tpuctl_path, *args], capture_output=True, text=True, timeout=30)
        assert r.returncode == 0, r.stderr
        return r.stdout
    doc = json.loads(tpuctl("sessions", "--json"))
    (me,) = [s for s in doc["sessions"] if s["pid"] == os.getpid()]
    (p,) = me["programs"]
    assert p["calls"] == 5 and p["records"] >= 3 and p["busy_seconds"] > 0, p
    assert "inference" in p["name"], p
    table = tpuctl("programs")
    assert p["name"] in table and "PER CALL" in table, table
    print("ok", p)


@pytest.mark.slow
def test_compile_bench_runs_in_reduced_form(tpud):
    """bench/compile_bench.py's figures come out (the full run is bench/run.sh's)."""
    import json
    import pathlib

    bench = pathlib.Path(__file__).resolve().parents[2] / "bench" / "compile_bench.py"
    r = subprocess.run([sys.executable, str(bench), "--rounds", "1", "--scale", "0.2"], env=tpud.env(),
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    figures = {d["name"]: d for d in map(json.loads, (l for l in r.stdout.splitlines() if l.startswith("{")))}
    assert set(figures) == {"compiled_vs_eager_small_op_train_step", "compiled_vs_cpu_small_op_train_step",
                            "compiled_generate"}, figures
    assert all(f["speed_ratio"] > 0 for f in figures.values()), figures


# ---------------------------------------------------------------- PJRT: a graph is one module

@pytest.fixture(scope="module")
def pjrt_device():
    """tpud on the PJRT backend (XLA's CPU plugin) with every segment in a
    device buffer, as on a TPU: the mode in which a graph runs as one
    StableHLO module."""
    from conftest import Daemon, pjrt_flags

    pytest.importorskip("xla_plugins.xla_cpu_pjrt")
    d = Daemon(hbm="2GiB", extra_flags=pjrt_flags() + ["--pjrt_memory=device"])
    yield d
    d.stop()


@pytest.mark.slow
def test_on_pjrt_hugging_face_models_compiled_equal_cpu(pjrt_device):
    pytest.importorskip("transformers")
    run_in_child(pjrt_device, _hugging_face_models_compiled, timeout=900)


@pytest.mark.slow
def test_on_pjrt_a_compiled_training_loop_reaches_cpu_losses(pjrt_device):
    run_in_child(pjrt_device, _compiled_training_loop, timeout=600)


def _graph_figures(daemon):
    """(graphs run as one module, programs compiled), summed over chips."""
    import json

    from conftest import bazel_bin

    r = subprocess.run([bazel_bin("tools/tpuctl/tpuctl"), f"--admin_socket={daemon.admin_socket}", "executors",
                        "--json"], capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stderr
    chips = [c for e in json.loads(r.stdout)["executors"] for c in e["compile"]]
    return sum(c["graph_programs"] for c in chips), sum(c["compiles"] for c in chips)


def _runs(out):
    (line,) = [l for l in out.stdout.splitlines() if l.startswith("runs ")]
    return int(line.split()[1])


@pytest.mark.slow
def test_on_pjrt_each_graph_runs_as_one_stablehlo_module_and_matches_cpu(pjrt_device):
    from conftest import bazel_bin

    graphs0, _ = _graph_figures(pjrt_device)
    tpuctl = [bazel_bin("tools/tpuctl/tpuctl"), f"--admin_socket={pjrt_device.admin_socket}", "executors", "--json"]
    out = run_in_child(pjrt_device, _train_and_cnn_as_stablehlo_modules, tpuctl, timeout=900)
    graphs, _ = _graph_figures(pjrt_device)
    # Every run was one module.
    assert graphs - graphs0 >= _runs(out), (graphs - graphs0, _runs(out))


def _train_and_cnn_as_stablehlo_modules(tpuctl):
    import copy
    import json
    import subprocess
    import torch
    from torch_tpu import _compile
    def compiles():
        doc = json.loads(subprocess.run(tpuctl, capture_output=True, text=True, check=True).stdout)
        return sum(c["compiles"] for e in doc["executors"] for c in e["compile"])
    torch.manual_seed(0)
    nn = torch.nn
    ref = nn.Sequential(nn.Linear(8, 16), nn.SiLU(), nn.LayerNorm(16), nn.Linear(16, 1))
    dev = copy.deepcopy(ref).to("tpu")
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    opt_dev = torch.optim.AdamW(dev.parameters(), lr=1e-2, capturable=True)
    cm = torch.compile(dev, backend="tpu")
    step = torch.compile(opt_dev.step, backend="tpu")
    g = torch.Generator().manual_seed(1)
    for i in range(8):
        if i == 3:
            warm = compiles()
        x, y = torch.randn(16, 8, generator=g), torch.randn(16, 1, generator=g)
        l_ref = ((ref(x) - y) ** 2).mean()
        l_dev = ((cm(x.to("tpu")) - y.to("tpu")) ** 2).mean()
        same(l_dev, l_ref, atol=1e-5, what=f"loss {i}")
        opt_ref.zero_grad(); opt_dev.zero_grad()
        l_ref.backward(); l_dev.backward()
        opt_ref.step(); step()
    for p, q in zip(ref.parameters(), dev.parameters()):
        same(q, p, atol=1e-5, what="parameters after 8 steps")
    # Warm, each step reran the graphs' modules: nothing was compiled again
    # (offsets into segments are parameters, not constants).
    assert compiles() == warm, (compiles(), warm)
    # a CNN with batch norm (its running statistics are copies inside the
    # graph), forward and backward
    ref = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(),
                        nn.Linear(4 * 6 * 6, 3))
    dev = copy.deepcopy(ref).to("tpu")
    fwd_bwd(ref, dev, torch.randn(2, 3, 6, 6), steps=3)
    for name, b in ref.named_buffers():
        same(dict(dev.named_buffers())[name], b, what=f"buffer {name}")
    ran_as_programs(min_captures=5)
    print("runs", _compile.stats["runs"])


def test_on_pjrt_an_index_error_inside_a_graph_names_its_op_and_poisons_only_its_results(pjrt_device):
    graphs0, _ = _graph_figures(pjrt_device)
    run_in_child(pjrt_device, _index_error_inside_a_graph, timeout=300)
    graphs, _ = _graph_figures(pjrt_device)
    assert graphs - graphs0 >= 3, graphs - graphs0


def _index_error_inside_a_graph():
    import torch
    import torch_tpu  # noqa: F401
    def f(x, i, w):
        y = (x * w).sum(0)         # before the bad op: valid
        z = x.index_select(0, i)   # the bad op
        return y, z.relu() + 1     # after it
    cf = torch.compile(f, backend="tpu")
    x, w = torch.randn(5, 3), torch.randn(5, 3)
    y, z = cf(x.to("tpu"), torch.tensor([0, 4]).to("tpu"), w.to("tpu"))
    same(y, (x * w).sum(0)); same(z, x[[0, 4]].relu() + 1)
    y, z = cf(x.to("tpu"), torch.tensor([1, 7]).to("tpu"), w.to("tpu"))
    msg = error_of(torch.tpu.synchronize, "no error")
    assert "index_select" in msg and "program" in msg and "out of range" in msg, msg
    read = error_of(z.cpu, "the bad op's result read as data")
    assert "index_select" in read, read
    y2, z2 = cf(x.to("tpu"), torch.tensor([3, 2]).to("tpu"), w.to("tpu"))
    same(z2, x[[3, 2]].relu() + 1, what="after the error")
    same(y2, (x * w).sum(0), what="after the error")
    print("ok", msg)
