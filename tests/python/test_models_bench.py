"""bench/models_bench.py in its reduced form (tiny configs, one round): every
model produces a figure and generate() gives CPU's tokens. No timing checks."""
import json
import subprocess
import sys

import pytest

from conftest import ROOT, bazel_bin

pytestmark = pytest.mark.slow  # every model of the bench

pytest.importorskip("transformers")


def test_models_bench_quick_runs_every_model():
    tpud = bazel_bin("daemon/tpud")
    r = subprocess.run([sys.executable, str(ROOT / "bench" / "models_bench.py"), "--start-daemon",
                        "--quick", "--rounds", "1", "--hbm", "2GiB", "--tpud", str(tpud)],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    lines = [json.loads(l) for l in r.stdout.splitlines() if l.startswith("{")]
    names = {d["name"] for d in lines}
    for model in ("gpt2_tiny", "llama_tiny", "bert_tiny", "t5_tiny", "vit_tiny", "cnn_bn"):
        assert f"train_step_{model}" in names, names
    for model in ("gpt2_tiny", "llama_tiny"):
        assert f"generate_{model}" in names, names
    for d in lines:
        assert d["speed_ratio"] > 0, d
        if d["name"].startswith("generate_"):
            assert d["same_tokens"], d
