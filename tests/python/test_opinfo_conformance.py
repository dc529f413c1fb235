"""OpInfo conformance of "tpu", reduced for CI: ~50 common ops, 3 samples each,
forward in float32, bfloat16, float16, int64, bool and complex64, backward in
float32, bfloat16, float16 and complex64.

tools/opinfo_conformance.py runs each op's OpInfo samples on the CPU and on tpu
(through a real tpud) and compares the results, all in one tpud session with
errors caught, as a user's process runs; here it must pass on >= 99.5% of the
samples that pass on the CPU. With --backward it compares the gradients of each
sample's inputs instead: >= 99%. The whole of op_db: see the tool's --help.
"""
import json
import os
import pathlib
import subprocess
import sys

import pytest

from conftest import ROOT, Daemon, bazel_bin

TOOL = ROOT / "tools" / "opinfo_conformance.py"
MIN_PASS_RATE = 0.995
MIN_BACKWARD_PASS_RATE = 0.99

OPS = [
    "add", "sub", "mul", "div", "matmul", "mm", "bmm", "sum", "mean", "amax", "argmax",
    "softmax", "log_softmax", "exp", "log", "sqrt", "nn.functional.relu", "sigmoid", "tanh",
    "nn.functional.gelu", "where", "cat", "stack", "transpose", "permute", "reshape", "view",
    "index_select", "gather", "scatter", "masked_fill", "clamp", "abs", "neg", "pow", "max",
    "min", "sort", "topk", "cumsum", "nn.functional.linear", "nn.functional.conv2d",
    "nn.functional.layer_norm", "nn.functional.cross_entropy", "nonzero", "unique",
]


def _python():
    venv = ROOT / ".venv" / "bin" / "python"
    return str(venv) if venv.exists() else sys.executable


def _run(tmp_path, extra, min_rate, what, flags=()):
    bazel_bin("daemon/tpud")
    report_path = tmp_path / "report.json"
    d = Daemon(hbm="4GiB", extra_flags=list(flags))
    try:
        r = subprocess.run(
            [_python(), str(TOOL), "--ops", ",".join(OPS), "--max-samples", "3",
             "--report", str(report_path)] + extra,
            env=d.env(), capture_output=True, text=True, timeout=600)
    finally:
        d.stop()
    out = r.stdout + r.stderr
    assert r.returncode == 0, out
    report = json.loads(report_path.read_text())
    assert report["complete"], out
    assert not report["unknown_ops"], report["unknown_ops"]
    s = report["summary"]
    assert s["samples_passing_on_cpu"] >= 100, out
    rate = s["pass_rate"]
    assert rate >= min_rate, (
        f"{what}: tpu matched the CPU on {100 * rate:.1f}% of {s['samples_passing_on_cpu']} "
        f"samples ({s['passed']} passed, {s['failed']} failed, {s['errored']} errored), "
        f"below {100 * min_rate:.1f}%\n{out}")
    print(f"opinfo {what} (CI subset): {100 * rate:.1f}% of "
          f"{s['samples_passing_on_cpu']} samples")
    return report


@pytest.mark.slow  # hundreds of samples through a real tpud
def test_common_ops_match_cpu(tmp_path):
    report = _run(tmp_path, [], MIN_PASS_RATE, "forward")
    assert not report["isolated"] and len(report["dtypes"]) == 6, report["dtypes"]
    assert report["mode"] == "forward"
    # Every listed op ran (variants included: div has three, max and min three).
    ran = {u["op"].split(".")[0] if not u["op"].startswith("nn.") else u["op"]
           for u in report["ops"]}
    assert set(OPS) <= ran, set(OPS) - ran


@pytest.mark.slow
def test_common_ops_gradients_match_cpu(tmp_path):
    report = _run(tmp_path, ["--backward"], MIN_BACKWARD_PASS_RATE, "backward")
    assert report["mode"] == "backward" and len(report["dtypes"]) == 4, report["dtypes"]
    # Only differentiable ops take part; most of the list is.
    assert len({u["op"] for u in report["ops"]}) >= 40


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["forward", "backward"])
def test_common_ops_match_cpu_on_pjrt(tmp_path, mode):
    """The same ops on the PJRT backend (XLA's CPU plugin, tensors in device
    buffers as on a TPU), float32 and bfloat16."""
    from conftest import pjrt_flags
    pytest.importorskip("xla_plugins.xla_cpu_pjrt")
    extra = ["--dtypes", "float32,bfloat16"] + (["--backward"] if mode == "backward" else [])
    # Issue 36's bar on PJRT: forward 99%, backward 98%; the subset's forward
    # is held to the simulated chip's 99.5%.
    report = _run(tmp_path, extra, MIN_PASS_RATE if mode == "forward" else 0.98,
                  f"{mode} on PJRT", flags=pjrt_flags() + ["--pjrt_memory=device"])
    assert report["mode"] == mode and report["dtypes"] == ["float32", "bfloat16"], report["dtypes"]


def test_low_precision_results_judged_against_float64():
    """passed_closer: a bfloat16 result outside the tolerance around CPU's
    passes only when it is no farther than CPU's from the float64 result."""
    import torch
    from opinfo_conformance import _Moved, closer_than_cpu

    def bf16(*v):
        return torch.tensor(v).bfloat16()

    precise = torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64)
    cpu = bf16(1.0, 2.0, 3.25)
    assert closer_than_cpu(cpu, _Moved(bf16(1.0, 2.0, 3.0), "tpu"), precise)
    assert closer_than_cpu(cpu, bf16(1.0, 2.0, 3.25), precise)  # CPU's own
    assert closer_than_cpu(cpu, bf16(1.0, 2.0, 2.75), precise)  # as far, other side
    assert not closer_than_cpu(cpu, bf16(1.0, 2.0, 2.5), precise)
    assert not closer_than_cpu(cpu, bf16(1.0, 1.5, 3.0), precise)  # another element
    # Shape and dtype must be CPU's.
    assert not closer_than_cpu(cpu, bf16(1.0, 2.0), precise)
    assert not closer_than_cpu(cpu, bf16(1.0, 2.0, 3.0).half(), precise)
    # A nan where float64 is finite is infinitely far...
    assert not closer_than_cpu(cpu, bf16(1.0, 2.0, float("nan")), precise)
    # ...and where CPU's is the nan, tpu's must be within tolerance of float64.
    cpu_nan = bf16(float("nan"), 2.0, 3.0)
    assert closer_than_cpu(cpu_nan, bf16(1.0, 2.0, 3.0), precise)
    assert not closer_than_cpu(cpu_nan, bf16(1.5, 2.0, 3.0), precise)
    assert not closer_than_cpu(cpu_nan, bf16(float("nan"), 2.0, 2.0), precise)
    # Integer results (indices) and non-tensor results must equal CPU's.
    idx = torch.tensor([0, 2])
    assert closer_than_cpu((cpu, idx, 3), (bf16(1.0, 2.0, 3.0), idx.clone(), 3),
                           (precise, idx, 3))
    assert not closer_than_cpu((cpu, idx), (bf16(1.0, 2.0, 3.0), torch.tensor([0, 1])),
                               (precise, idx))
    assert not closer_than_cpu((cpu, 3), (bf16(1.0, 2.0, 3.0), 4), (precise, 3))


def test_eigenvalues_are_compared_in_cpus_order():
    """linalg.eig's eigenvalues come in no documented order: tpu's are put in
    CPU's (nearest first come, first served), eigenvectors with them; values
    that are not CPU's stay unmatched and so fail the comparison after."""
    import torch
    from opinfo_conformance import _in_order_of, _reordered

    cpu = torch.tensor([[1 + 0j, 2 + 1j, 2 - 1j], [0j, 3j, -3j]])
    got = torch.tensor([[2 - 1j + 1e-6, 1 + 0j, 2 + 1j], [-3j, 0j, 3j]])
    assert _in_order_of(cpu, got).tolist() == [[1, 2, 0], [1, 2, 0]]
    vectors = torch.arange(18, dtype=torch.float32).reshape(2, 3, 3).to(torch.complex64)

    def eig(_):
        return got, vectors
    w, v = _reordered(eig, (cpu, None))(None)
    torch.testing.assert_close(w, cpu, atol=1e-5, rtol=0)
    assert torch.equal(v[0, :, 0], vectors[0, :, 1]) and torch.equal(v[1, :, 2], vectors[1, :, 0])
    # eigvals: the values alone; an empty result is left as it is.
    assert torch.equal(_reordered(lambda _: got, cpu)(None), w)
    empty = torch.zeros(0, 0, dtype=torch.complex64)
    assert _reordered(lambda _: empty, empty)(None) is empty
    # A value that is not CPU's still takes a place, so the comparison fails.
    wrong, right = torch.tensor([5j, 1, 2]), torch.tensor([1j, 1, 2])
    w, _ = _reordered(lambda _: (wrong, torch.eye(3)), (right, None))(None)
    assert sorted(w.tolist(), key=abs) == sorted(wrong.tolist(), key=abs)
    assert not torch.allclose(w, right)
