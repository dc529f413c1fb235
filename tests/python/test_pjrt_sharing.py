"""Sharing, crash containment and quotas on the PJRT backend (XLA's CPU
plugin). One executor process drives every device there, so an executor
that dies affects every session: with tensors in tpud's arena
(--pjrt_memory=host) the others go on with their data; with tensors in
device buffers (--pjrt_memory=device, as on a TPU) their data died with it,
and tpud ends those sessions with the reason instead of serving stale
bytes. test_sharing.py has the simulated backend's forms."""
import os
import re
import signal
import time

import pytest

from conftest import Daemon, pjrt_flags
from test_sharing import (BYSTANDER, executor_pids, finish, run_py, start_py, tpuctl_json,
                          wait_for, wait_ready)

pytest.importorskip("xla_plugins.xla_cpu_pjrt")


@pytest.fixture(params=["host", pytest.param("device", marks=pytest.mark.slow)])
def pjrt(request):
    d = Daemon(hbm="512MiB", extra_flags=pjrt_flags() + [f"--pjrt_memory={request.param}"])
    d.memory = request.param
    yield d
    d.stop()


HOLDER = """
    import sys, torch
    x = torch.arange(1000., device="tpu:1")
    assert x.sum().item() == 499500.0
    print("ready", flush=True)
    sys.stdin.readline()
    try:
        print("sum", (x * 2).sum().item(), flush=True)
    except RuntimeError as e:
        print("ERROR:", e, flush=True)
"""


def _restarted(daemon, before):
    return wait_for(lambda: executor_pids(daemon)[0] not in (before, 0), 20)


def _serves_a_new_session(daemon):
    again = run_py(daemon, """
        import torch
        assert (torch.arange(5., device="tpu:2") * 2).cpu().tolist() == [0, 2, 4, 6, 8]
    """)
    assert again.returncode == 0, again.stderr


def test_kill_9_of_the_idle_executor_keeps_data_or_says_it_is_lost(pjrt):
    holder = start_py(pjrt, HOLDER)
    wait_ready(holder)
    (pid,) = executor_pids(pjrt).values()  # one executor drives every device
    os.kill(pid, signal.SIGKILL)
    assert _restarted(pjrt, pid)
    rc, out, err = finish(holder, say="go\n")
    assert rc == 0, out + err
    if pjrt.memory == "host":
        # The arena held the tensors: the session goes on with its data.
        assert "sum 999000.0" in out, out + err
    else:
        # The device buffers held them: never the arena's stale bytes.
        assert "sum" not in out, out
        assert "ERROR:" in out and "died (killed by SIGKILL" in out, out
        assert "kept this session's tensors in device memory" in out, out
    restarts = tpuctl_json(pjrt, "executors")["executor_restarts"]
    assert len(restarts) == 1 and "SIGKILL" in restarts[0]["reason"], restarts
    assert restarts[0]["executor"] == 0 and restarts[0]["session_id"] is None
    _serves_a_new_session(pjrt)
    status = tpuctl_json(pjrt, "status")
    assert all(c["hbm_used_bytes"] == 0 for c in status["chips"]), status["chips"]


@pytest.mark.parametrize("sig", ["SIGKILL", "SIGABRT"])
def test_an_executor_dying_mid_op_ends_the_session_whose_op_it_ran(pjrt, sig):
    # The neighbour first: a Python start-up on a loaded machine can take
    # longer than the victim's whole loop (about 15 s of matmuls).
    neighbour = start_py(pjrt, HOLDER)
    wait_ready(neighbour)
    victim = start_py(pjrt, """
        import torch
        # Op by op, so that the executor is inside one of its ops when it
        # dies (fused eager, the default with device memory, would hold
        # them all until .item()).
        torch.tpu.set_eager_mode("direct")
        a = torch.randn(3000, 3000, device="tpu:2")
        a.sum().item()
        print("ready", flush=True)
        try:
            for _ in range(100):
                a = a @ a
                a = a / a.norm()
            a.sum().item()
            print("no error")
        except RuntimeError as e:
            print("ERROR:", e)
    """)
    wait_ready(victim)
    # The victim's matmuls keep the executor inside an op: one 3000x3000
    # matmul takes far longer than the norm and division between them, or
    # than the victim's client needs to queue the next ones, so the executor
    # is almost never between ops.
    time.sleep(0.3)
    (pid,) = executor_pids(pjrt).values()
    os.kill(pid, getattr(signal, sig))
    assert _restarted(pjrt, pid)
    rc, out, err = finish(victim)
    assert "ERROR:" in out and sig in out, out + err
    assert re.search(r"aten::(mm|div|linalg_vector_norm)\b.*crashed its tpud executor", out), out + err
    rc, out, err = finish(neighbour, say="go\n")
    assert rc == 0, out + err
    if pjrt.memory == "host":
        assert "sum 999000.0" in out, out + err
    else:
        assert "ERROR:" in out and "crashed in session" in out, out
        assert "kept this session's tensors in device memory" in out, out
    _serves_a_new_session(pjrt)


def test_bystanders_train_while_a_neighbour_exceeds_its_quota(pjrt):
    """Two processes train on one device while a third asks past its HBM
    quota: it gets the quota error, catches it and goes on; the others
    finish with their own results."""
    import subprocess
    from conftest import bazel_bin
    tpuctl = bazel_bin("tools/tpuctl/tpuctl")
    subprocess.run([tpuctl, f"--admin_socket={pjrt.admin_socket}", "quota", "--default", "64MiB"],
                   check=True, capture_output=True, timeout=30)
    bystanders = [start_py(pjrt, BYSTANDER, 300) for _ in range(2)]
    for b in bystanders:
        wait_ready(b)
    greedy = run_py(pjrt, """
        import torch
        keep = torch.ones(1024, 1024, device="tpu:0")  # 4 MiB
        try:
            big = torch.empty(64 * 1024 * 1024, device="tpu:0")  # 256 MiB
            print("allocated")
        except torch.OutOfMemoryError as e:
            print("OOM:", e)
        print("after", (keep * 2).sum().item())
    """)
    assert greedy.returncode == 0, greedy.stderr
    assert "OOM:" in greedy.stdout and "quota" in greedy.stdout, greedy.stdout
    assert "after 2097152.0" in greedy.stdout, greedy.stdout
    for b in bystanders:
        rc, out, err = finish(b)
        assert rc == 0 and "bystander ok" in out, out + err


@pytest.mark.slow
def test_64_processes_each_finish_a_short_job_on_pjrt():
    """As test_sharing's, with tensors in device buffers (as on a TPU); a
    minute of 64 interpreters starting on these cores, so one memory mode."""
    import test_sharing
    d = Daemon(hbm="512MiB", extra_flags=pjrt_flags() + ["--pjrt_memory=device"])
    try:
        test_sharing.test_64_processes_each_finish_a_short_job(d)
    finally:
        d.stop()
