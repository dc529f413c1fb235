"""The PJRT backend's compilation cache on disk (--compile_cache_dir): a
restarted tpud loads the programs an earlier one compiled instead of
compiling them again; a torn, corrupt or foreign entry is a miss; a full
disk or a directory others may write leaves tpud serving without it."""
import json
import os
import subprocess
import time

import pytest

from conftest import Daemon, bazel_bin, pjrt_flags, run_in_child
from tpud_process import TpudProcess


def _train_steps():
    """Three AdamW steps of a small MLP on tpu:1; prints the losses and the
    first weight's values (as exact reprs, for comparison across runs)."""
    import torch
    import torch_tpu  # noqa: F401
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 2))
    model = model.to("tpu:1")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(3):
        x = torch.randn(32, 8, generator=g).to("tpu:1")
        y = torch.randint(0, 2, (32,), generator=g).to("tpu:1")
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    print("RESULT", json.dumps({"losses": [repr(v) for v in losses],
                                "weight": [repr(v) for v in model[0].weight.detach().cpu().flatten().tolist()]}))


def _result(run):
    line = next(ln for ln in run.stdout.splitlines() if ln.startswith("RESULT "))
    return json.loads(line[len("RESULT "):])


def _figures(daemon):
    """Compiles, disk hits and disk stores over every chip, and the
    executor's disk cache object, from `tpuctl executors --json`."""
    time.sleep(0.05)  # executors publish their figures every millisecond of activity
    j = subprocess.run([bazel_bin("tools/tpuctl/tpuctl"), f"--admin_socket={daemon.admin_socket}",
                        "executors", "--json"], capture_output=True, text=True, timeout=30)
    assert j.returncode == 0, j.stderr
    (e,) = json.loads(j.stdout)["executors"]  # one executor drives every device
    total = {k: sum(c[k] for c in e["compile"])
             for k in ("compiles", "disk_hits", "disk_stores", "compile_seconds", "compile_seconds_saved")}
    return total, e.get("disk_cache")


def _entries(cache):
    return sorted(n for n in os.listdir(cache) if n.endswith(".xc"))


def _start(cache, extra=()):
    return Daemon(hbm="256MiB", extra_flags=pjrt_flags() + [f"--compile_cache_dir={cache}", *extra])


@pytest.mark.parametrize("memory", ["host", pytest.param("device", marks=pytest.mark.slow)])
def test_a_restarted_tpud_loads_its_programs_instead_of_compiling(tmp_path, memory):
    cache = tmp_path / "cache" / "programs"  # made by tpud, parents and all
    flags = [f"--pjrt_memory={memory}"]
    d = _start(cache, flags)
    try:
        first = _result(run_in_child(d, _train_steps))
        before, disk = _figures(d)
    finally:
        d.stop()
    # (Direct eager compiles a program per op; fused eager, the default with
    # device memory, a few per step: 7 for these three steps.)
    floor = 10 if memory == "host" else 5
    assert before["compiles"] >= floor, before
    assert before["disk_hits"] == 0, before
    # Every program that compiled was kept (a failed compile is not).
    assert floor <= before["disk_stores"] <= before["compiles"], before
    assert disk["entries"] == before["disk_stores"] == len(_entries(cache))
    assert disk["bytes"] > 0 and disk["max_bytes"] == 4 << 30
    assert oct(os.stat(cache).st_mode & 0o777) == "0o700"

    d = _start(cache, flags)
    try:
        again = _result(run_in_child(d, _train_steps))
        after, disk = _figures(d)
        text = subprocess.run([bazel_bin("tools/tpuctl/tpuctl"), f"--admin_socket={d.admin_socket}",
                               "programs"], capture_output=True, text=True, timeout=30).stdout
    finally:
        d.stop()
    assert again == first  # the loaded programs compute what the compiled ones did, bit for bit
    assert after["disk_hits"] == before["disk_stores"], (before, after)
    # Only what failed to compile the first time is compiled again.
    assert after["compiles"] == before["compiles"] - before["disk_stores"], (before, after)
    assert after["disk_stores"] == 0
    assert after["compile_seconds_saved"] > 0
    assert "compilation cache on disk: " in text, text


def test_torn_corrupt_and_foreign_entries_are_compiled_again(tmp_path):
    cache = tmp_path / "cache"
    d = _start(cache)
    try:
        first = _result(run_in_child(d, _train_steps))
        stored = _figures(d)[0]["disk_stores"]
    finally:
        d.stop()
    names = _entries(cache)
    assert len(names) == stored >= 10
    # One entry cut short (a torn write), one with a flipped byte, one
    # replaced by another entry's bytes (what another plugin build or a
    # hash collision looks like), one emptied.
    paths = [cache / n for n in names]
    data = paths[0].read_bytes()
    paths[0].write_bytes(data[:len(data) // 2])
    data = bytearray(paths[1].read_bytes())
    data[-7] ^= 0x40
    paths[1].write_bytes(bytes(data))
    paths[2].write_bytes(paths[3].read_bytes())
    paths[4].write_bytes(b"")
    d = _start(cache)
    try:
        again = _result(run_in_child(d, _train_steps))
        after, disk = _figures(d)
    finally:
        d.stop()
    assert again == first
    assert disk["rejected"] == 4, disk
    assert after["disk_hits"] == stored - 4, after
    assert after["disk_stores"] == 4, after  # compiled again and kept again
    assert len(_entries(cache)) == stored


def test_programs_compiled_under_other_xla_flags_are_not_loaded(tmp_path, monkeypatch):
    """XLA_FLAGS change the code XLA makes (fast math, for one): a tpud
    started with other flags compiles again instead of loading programs
    compiled under the old ones."""
    cache = tmp_path / "cache"
    runs = []
    for flags in (None, "--xla_cpu_enable_fast_math=true", "--xla_cpu_enable_fast_math=true"):
        if flags is None:
            monkeypatch.delenv("XLA_FLAGS", raising=False)
        else:
            monkeypatch.setenv("XLA_FLAGS", flags)
        d = _start(cache)
        try:
            result = _result(run_in_child(d, _small_job))
            runs.append(_figures(d)[0])
        finally:
            d.stop()
        assert result == {"sum": 35.0 * 49}
    first, other_flags, same_again = runs
    assert first["disk_stores"] >= 1 and first["disk_hits"] == 0, first
    assert other_flags["disk_hits"] == 0, other_flags
    assert other_flags["disk_stores"] == first["disk_stores"], other_flags
    assert same_again["disk_hits"] == other_flags["disk_stores"], same_again
    assert same_again["compiles"] == other_flags["compiles"] - other_flags["disk_stores"]


def _small_job():
    import torch
    import torch_tpu  # noqa: F401
    a = torch.full((5, 7), 2.0, device="tpu:2")
    print("RESULT", json.dumps({"sum": ((a * 3 + 1) ** 2).sum().item()}))


def test_a_bounded_cache_keeps_the_recent_programs(tmp_path):
    cache = tmp_path / "cache"
    bound = ["--compile_cache_bytes=64KiB"]
    d = _start(cache, bound)
    try:
        _result(run_in_child(d, _train_steps))
        small = _result(run_in_child(d, _small_job))  # its programs are the most recent
        figures, disk = _figures(d)
    finally:
        d.stop()
    sizes = [os.path.getsize(cache / n) for n in _entries(cache)]
    assert sum(sizes) <= 64 << 10
    assert disk["bytes"] == sum(sizes) and disk["entries"] == len(sizes)
    assert len(sizes) < figures["disk_stores"], (figures, sizes)  # the older ones were evicted
    d = _start(cache, bound)
    try:
        assert _result(run_in_child(d, _small_job)) == small == {"sum": 1715.0}
        after, _ = _figures(d)
    finally:
        d.stop()
    # The small job's own programs (five: full, mul, add, pow, sum) ran last and
    # stayed; the programs it shares with the training job may have gone
    # during that job, when they had not run for longest.
    assert after["disk_hits"] >= 5 and after["compiles"] <= 3, after


def test_a_full_disk_or_an_open_directory_leaves_tpud_serving(tmp_path):
    # A directory others may write: its entries would be code tpud loads.
    open_dir = tmp_path / "open"
    open_dir.mkdir()
    os.chmod(open_dir, 0o777)
    d = TpudProcess(bazel_bin("daemon/tpud"), "256MiB", pjrt_flags() + [f"--compile_cache_dir={open_dir}"],
                    prefix="tpud-py.", log_to_file=True)
    d.start()
    try:
        first = _result(run_in_child(d, _train_steps))
        figures, disk = _figures(d)
        with open(d.log_path) as f:
            log = f.read()
    finally:
        d.close()
    assert "compile cache off: " in log and "may be written by others (mode 0777)" in log, log[-2000:]
    assert disk is None  # no cache
    assert figures["disk_stores"] == 0
    assert _entries(open_dir) == []

    # A file system that fills up: writes fail, the job does not.
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root")
    full = tmp_path / "full"
    full.mkdir(mode=0o700)
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=96k,mode=0700", "tmpfs", str(full)],
                      capture_output=True).returncode != 0:
        pytest.skip("this machine does not let tests mount a tmpfs")
    try:
        d = _start(full)
        try:
            assert _result(run_in_child(d, _train_steps)) == first
            figures, disk = _figures(d)
        finally:
            d.stop()
        assert disk["write_errors"] >= 1, disk
        assert 0 < figures["disk_stores"] < figures["compiles"], figures
        assert not [n for n in os.listdir(full) if n.startswith(".tmp-")]  # nothing half-written
    finally:
        subprocess.run(["umount", str(full)], check=True)


def test_the_first_steps_benchmark_runs_reduced():
    """bench/pjrt_bench.py's first-step figures, one round (no timing
    asserted: the figures are for a quiet machine)."""
    import sys
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    r = subprocess.run([sys.executable, os.path.join(root, "bench", "pjrt_bench.py"),
                        "--tpud", bazel_bin("daemon/tpud"), "--first-steps-only", "--rounds", "1"],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    figures = {f["name"]: f for f in map(json.loads, r.stdout.strip().splitlines())}
    assert set(figures) == {"pjrt_second_process_first_step", "pjrt_restart_first_step"}
    for f in figures.values():
        assert f["speed_ratio"] > 0 and f["target"] > 0
