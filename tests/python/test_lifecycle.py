"""bench/lifecycle_bench.py in its reduced form (issue 32): new processes on
tpu and on the CPU, released together, and the import cost; short jobs started
at once, and a generated pytest suite in sharded workers. Every figure is
present, and the benchmark fails if a job's .item() is not the value the CPU
computes or a test of the suite fails; the ratios are the benchmark's
business."""
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
    assert set(lines) == {"first_ops_1", "first_ops_2", "import_overhead",
                          "short_jobs_4", "test_suite_2", "session_cost"}, lines
    for name in ("first_ops_1", "first_ops_2", "short_jobs_4", "test_suite_2"):
        assert lines[name]["tpu_seconds"] > 0 and lines[name]["cpu_seconds"] > 0, lines[name]
        assert lines[name]["tpu_over_cpu"] > 0, lines[name]
    assert lines["import_overhead"]["rss_with_bytes"] > 0, lines
    # Every job and every test ran (the benchmark exits non-zero otherwise):
    # here, that the figures are of the processes and tests asked for.
    short = lines["short_jobs_4"]
    assert short["processes"] == 4 and short["target"] is None, short
    for dev in ("tpu", "cpu"):
        assert short[f"{dev}_import_median_seconds"] > 0, short
        assert short[f"{dev}_first_ops_median_seconds"] > 0, short
        assert short[f"{dev}_last_done_to_last_exit_seconds"] >= 0, short
    suite = lines["test_suite_2"]
    assert suite["tests"] == 40 and suite["workers"] == 2 and suite["target"] is None, suite
    cost = lines["session_cost"]
    assert cost["sessions"] == 4, cost
    # A session is a connection, rings and their doorbells: it shows.
    assert cost["daemon_fds_per_session"] > 0, cost
    assert cost["daemon_session_memory_bytes_per_session"] > 0, cost
    assert cost["client_fds_added"] > 0 and cost["daemon_cpu_seconds_per_session"] >= 0, cost
