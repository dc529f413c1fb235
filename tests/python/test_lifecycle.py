"""bench/lifecycle_bench.py in its reduced form (issue 32): new processes on
tpu and on the CPU, released together, and the import cost. Every figure is
present, and the benchmark fails if a job's .item() is not the value the CPU
computes; the ratios are the benchmark's business."""
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.slow
def test_lifecycle_bench_runs_in_reduced_form():
    r = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "lifecycle_bench.py"),
                        "--reduced", "--tpud", os.path.join(ROOT, "bazel-bin", "daemon", "tpud")],
                       capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    lines = {d["name"]: d for d in map(json.loads, r.stdout.strip().splitlines())}
    assert set(lines) == {"first_ops_1", "first_ops_2", "import_overhead"}, lines
    for name in ("first_ops_1", "first_ops_2"):
        assert lines[name]["tpu_seconds"] > 0 and lines[name]["cpu_seconds"] > 0, lines[name]
    assert lines["import_overhead"]["rss_with_bytes"] > 0, lines
