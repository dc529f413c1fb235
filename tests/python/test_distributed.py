"""torch.distributed on the "tpu" backend: collectives run inside tpud.

Each test starts ranks as separate processes (tests/python/dist_worker.py)
against a tpud of its own, the way torchrun starts them.
"""
import json
import os
import re
import socket
import subprocess
import sys

import pytest

from conftest import Daemon, bazel_bin

pytestmark = pytest.mark.slow  # every test starts its ranks as processes

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "dist_worker.py")
ROOT = os.path.dirname(os.path.dirname(HERE))


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(daemon, scenario, world, extra=(), env_extra=None, timeout=300):
    """Runs `scenario` on `world` ranks; returns per rank (returncode, result
    dict or None, output)."""
    port = free_port()
    env = daemon.env()
    env.update(env_extra or {})
    procs = [subprocess.Popen([sys.executable, WORKER, scenario, str(r), str(world), str(port),
                               *extra], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True)
             for r in range(world)]
    out = []
    try:
        for p in procs:
            text, _ = p.communicate(timeout=timeout)
            result = None
            for line in reversed(text.strip().splitlines()):
                if line.startswith("{"):
                    result = json.loads(line)
                    break
            out.append((p.returncode, result, text))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    return out


@pytest.fixture
def host():
    d = Daemon(hbm="512MiB")
    yield d
    d.stop()


def test_every_collective_op_and_dtype_matches_cpu(host):
    results = run_ranks(host, "collectives", 4)
    for rank, (rc, result, text) in enumerate(results):
        assert rc == 0 and result and result["ok"], f"rank {rank}:\n{text[-3000:]}"
    assert results[0][1]["checked"] > 100


def test_mismatched_calls_fail_on_every_rank_naming_the_difference(host):
    results = run_ranks(host, "mismatch", 4)
    for rank, (rc, result, text) in enumerate(results):
        assert rc == 0 and result, f"rank {rank}:\n{text[-3000:]}"
        err = result["error"]
        assert "does not match across ranks" in err, err
        assert "1024 elements" in err and "512 elements" in err and "rank 1" in err, err
        assert "float16" in result["dtype_error"] and "float32" in result["dtype_error"], result


def test_a_killed_rank_fails_the_others_naming_it(host):
    results = run_ranks(host, "killed", 4)
    rc, result, text = results[3]
    assert rc == -9, text[-2000:]
    pid = result["pid"]
    for rank in range(3):
        rc, result, text = results[rank]
        assert rc == 0 and result, f"rank {rank}:\n{text[-3000:]}"
        assert result["error"] is not None, "the all_reduce with a dead peer succeeded"
        assert "rank 3" in result["error"] and f"pid {pid}" in result["error"], result["error"]
        assert result["seconds"] < 30, result


@pytest.mark.parametrize("first", [False, True])
def test_a_rank_that_never_comes_times_out_naming_it(host, first):
    results = run_ranks(host, "timeout", 3, extra=("first",) if first else ())
    for rank in (1, 2):
        rc, result, text = results[rank]
        assert rc == 0 and result, f"rank {rank}:\n{text[-3000:]}"
        err = result["error"]
        assert err is not None and "timed out" in err and "rank 0" in err, err
        assert 2.5 < result["seconds"] < 20, result


def test_two_jobs_at_once_on_their_own_chips(host):
    import threading

    out = {}

    def job(name, chips):
        out[name] = run_ranks(host, "job", 2, extra=(chips,),
                              env_extra={"TPU_VISIBLE_CHIPS": chips})

    threads = [threading.Thread(target=job, args=("a", "0,1")),
               threading.Thread(target=job, args=("b", "2,3"))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for name in ("a", "b"):
        for rank, (rc, result, text) in enumerate(out[name]):
            assert rc == 0 and result and result["ok"], f"job {name} rank {rank}:\n{text[-3000:]}"


@pytest.mark.parametrize("scenario,order", [
    ("ddp", "before"), ("ddp", "after"), ("ddp", "device_id"),
    ("fsdp", "before"), ("fsdp", "after"), ("dtensor", "before")])
def test_training_across_chips_matches_one_process(host, scenario, order):
    # DDP, FSDP2 (fully_shard) and DTensor on v6e-4, one rank per chip,
    # against the same steps in one CPU process; the rank's device set
    # before init_process_group, after it, or passed to it as device_id.
    results = run_ranks(host, scenario, 4, env_extra={"TPU_TEST_INIT_ORDER": order},
                        timeout=180)
    for rank, (rc, result, text) in enumerate(results):
        assert rc == 0 and result and result["ok"], f"rank {rank}:\n{text[-3000:]}"


def test_ranks_on_one_chip_fail_at_once_naming_them(host):
    results = run_ranks(host, "shared_chip", 3, timeout=120)
    for rank, (rc, result, text) in enumerate(results):
        assert rc == 0 and result, f"rank {rank}:\n{text[-3000:]}"
        err = result["error"]
        assert err and "ranks 0 (tpu:0), 1 (tpu:0) and 2 (tpu:0)" in err, err
        assert "on chip 0" in err and "torch.tpu.set_device(local_rank)" in err, err
    # Asked for, ranks share the chip.
    results = run_ranks(host, "shared_chip", 2, env_extra={"TPU_DIST_SHARED_CHIPS": "1"})
    for rank, (rc, result, text) in enumerate(results):
        assert rc == 0 and result and result["error"] is None, f"rank {rank}:\n{text[-3000:]}"
        assert result["sum"] == [3.0] * 4, result


def test_a_collective_on_a_second_device_fails_naming_both(host):
    results = run_ranks(host, "other_device", 2, env_extra={"TPU_TEST_INIT_ORDER": "after"})
    for rank, (rc, result, text) in enumerate(results):
        assert rc == 0 and result, f"rank {rank}:\n{text[-3000:]}"
        err = result["error"]
        assert err and f"on tpu:{rank}" in err and f"tensors are on tpu:{(rank + 1) % 4}" in err, err


def test_a_full_communicator_table_names_who_holds_it():
    d = Daemon(hbm="256MiB", extra_flags=["--max_communicators=3"])
    try:
        results = run_ranks(d, "table_full", 2, extra=("3",), timeout=120)
    finally:
        d.stop()
    pids = [r[1]["pid"] for r in results if r[1]]
    for rank, (rc, result, text) in enumerate(results):
        assert rc == 0 and result and result["ok"], f"rank {rank}:\n{text[-3000:]}"
        err = result["error"]
        assert err and "no free communicator slot (3 in use" in err, err
        assert all(f"pid {pid} (3)" in err for pid in pids), (pids, err)


def test_ranks_that_exit_at_different_times_fail_nothing():
    # tpud's log is where a failed communicator shows (a rank that left
    # the group once counted as one that died holding it).
    from tpud_process import TpudProcess

    d = TpudProcess(bazel_bin("daemon/tpud"), hbm="256MiB", prefix="tpud-py.",
                    log_to_file=True)
    d.start()
    try:
        results = run_ranks(d, "staggered_exit", 3, timeout=120)
        for rank, (rc, result, text) in enumerate(results):
            assert rc == 0 and result and result["ok"], f"rank {rank}:\n{text[-3000:]}"
        with open(d.log_path) as f:
            log = f.read()
    finally:
        d.close()
    assert "failed" not in log, log[-3000:]


def test_a_thousand_groups_made_and_destroyed(host):
    # More than tpud's communicator table holds at once, each still
    # referenced after destroy_process_group (as FSDP's and DeviceMesh's are).
    results = run_ranks(host, "many_groups", 2, extra=("1000",), timeout=600)
    for rank, (rc, result, text) in enumerate(results):
        assert rc == 0 and result and result["ok"], f"rank {rank}:\n{text[-3000:]}"
        assert "destroyed" in (result["destroyed_error"] or ""), result


def test_no_backend_named_means_gloo_for_cpu_and_tpu_for_tpu(host):
    results = run_ranks(host, "default_backend", 4)
    for rank, (rc, result, text) in enumerate(results):
        assert rc == 0 and result and result["ok"], f"rank {rank}:\n{text[-3000:]}"


@pytest.mark.parametrize("order", ["before", "after"])
def test_send_recv_as_first_operation_needs_only_its_two_ranks(host, order):
    results = run_ranks(host, "p2p_first", 4, timeout=120,
                        env_extra={"TPU_TEST_INIT_ORDER": order})
    for rank, (rc, result, text) in enumerate(results):
        assert rc == 0 and result and result["ok"], f"rank {rank}:\n{text[-3000:]}"


def test_p2p_batches_coalescing_and_uneven_sizes_match_gloo(host):
    # batch_isend_irecv (first operation, several peers, pairs only),
    # _coalescing_manager, all_reduce_coalesced, all_gather_coalesced,
    # stacked and flat tensor forms, uneven all_gather / reduce_scatter /
    # all_to_all_single: tpu against gloo on the CPU in the same ranks.
    results = run_ranks(host, "c10d_data", 4, timeout=180)
    for rank, (rc, result, text) in enumerate(results):
        assert rc == 0 and result and result["ok"], f"rank {rank}:\n{text[-3000:]}"


def test_wait_timeout_and_monitored_barrier_name_what_never_came(host):
    results = run_ranks(host, "c10d_waits", 4, timeout=180)
    for rank, (rc, result, text) in enumerate(results):
        assert rc == 0 and result and result["ok"], f"rank {rank}:\n{text[-3000:]}"
        # monitored_barrier on the "tpu" backend alone: torch's own error
        assert "only implemented for GLOO" in result["tpu_only_error"], result
    for rank in range(3):
        result = results[rank][1]
        err = result["wait_error"]
        assert "ALLREDUCE" in err and "Work.wait's timeout of 1500 ms" in err, err
        assert 1.4 < result["wait_seconds"] < 10, result
    # on "cpu:gloo,tpu:tpu", as on gloo: rank 0 names the rank that never came
    assert "Ranks 3 failed to pass monitoredBarrier" in results[0][1]["monitored_error"], results[0][1]
    assert all(results[r][1].get("monitored_error") for r in (1, 2)), [r[1] for r in results]


@pytest.mark.parametrize("backend,order", [("tpu", "device_id"), ("default", "device_id"),
                                           ("tpu", "after")])
def test_new_group_split_group_and_device_mesh(host, backend, order):
    # With a device bound to the world group (device_id), new_group splits
    # it (ranks outside the new group take part) and split_group and
    # DeviceMesh's sub-meshes use the backend's split.
    results = run_ranks(host, "c10d_groups", 4, extra=(backend,), timeout=180,
                        env_extra={"TPU_TEST_INIT_ORDER": order})
    for rank, (rc, result, text) in enumerate(results):
        assert rc == 0 and result and result["ok"], f"rank {rank}:\n{text[-3000:]}"


def test_tpuctl_shows_bytes_per_ici_link(host):
    from conftest import bazel_bin

    results = run_ranks(host, "job", 2, extra=("0,1",), env_extra={"TPU_VISIBLE_CHIPS": "0,1"})
    assert all(rc == 0 for rc, _, _ in results), results[0][2][-2000:]
    tpuctl = bazel_bin("tools/tpuctl/tpuctl")
    doc = json.loads(subprocess.run([tpuctl, "status", "--json"], env=host.env(), check=True,
                                    capture_output=True, text=True).stdout)
    links = {(l["a"], l["b"]): l for l in doc["links"]}
    assert set(links) == {(0, 1), (0, 2), (1, 3), (2, 3)}, links  # v6e-4: a 2x2 torus
    # Chips 0 and 1 are neighbours: their ring crosses only the link between them.
    assert links[(0, 1)]["bytes_a_to_b"] > 0 and links[(0, 1)]["bytes_b_to_a"] > 0, links
    assert links[(2, 3)]["bytes_a_to_b"] == 0, links
    assert doc["collectives_run"] >= 50
    topo = json.loads(subprocess.run([tpuctl, "topology", "--json"], env=host.env(), check=True,
                                     capture_output=True, text=True).stdout)
    assert len(topo["links"]) == 4
    text = subprocess.run([tpuctl, "topology"], env=host.env(), check=True, capture_output=True,
                          text=True).stdout
    assert "ICI LINK" in text and "0 - 1" in text, text
    # The drawing: chips 0 and 1 side by side, the link between them labelled
    # with what it carried; chips 2 and 3 below, their link idle.
    rows = text.splitlines()
    (top,) = [r for r in rows if r.startswith("[ 0")]
    (bottom,) = [r for r in rows if r.startswith("[ 2")]
    assert "[ 1" in top and "-0 B-" not in top and re.search(r"-[\d.]+ [KMG]?i?B-", top), text
    assert "[ 3" in bottom and "-0 B-" in bottom, text


def test_two_hosts_under_torchrun_equal_one_host(tmp_path):
    # Two tpuds on this machine are two hosts of v6e-4; torchrun starts two
    # nodes of 4 ranks with the rendezvous on loopback. The "tpu" backend
    # runs each host's part inside its tpud and joins the hosts over gloo.
    hosts = [Daemon(hbm="256MiB"), Daemon(hbm="256MiB")]
    try:
        port = free_port()
        procs = []
        for node, d in enumerate(hosts):
            env = d.env()
            env["OMP_NUM_THREADS"] = "1"
            env["TMPDIR"] = str(tmp_path)  # torchrun's files
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc-per-node=4",
                 f"--node-rank={node}", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}",
                 "--rdzv-id=tpu-two-hosts", "--max-restarts=0", WORKER, "multihost", "0", "8",
                 "0"], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
        outs = []
        try:
            for p in procs:
                outs.append(p.communicate(timeout=600)[0])
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
        for node, (p, text) in enumerate(zip(procs, outs)):
            assert p.returncode == 0, f"node {node}:\n{text[-4000:]}"
            # Four ranks print to one pipe: their lines may run together.
            ranks = sorted(int(m) for m in re.findall(r'\{"ok": true, "rank": (\d+)\}', text))
            assert ranks == [4 * node + i for i in range(4)], text[-2000:]
    finally:
        for d in hosts:
            d.stop()


def test_collectives_bench_runs_in_reduced_form(tmp_path):
    """bench/collectives_bench.py end to end, small sizes: both backends in
    the same ranks, every figure present (its ratios are the benchmark's
    business, not this test's)."""
    out = str(tmp_path / "out.json")
    r = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "collectives_bench.py"),
                        "--start-daemon", "--big-mib", "4", "--small-iters", "10",
                        "--big-iters", "1", "--ddp-steps", "1", "--train-steps", "1",
                        "--train-rounds", "1", "--out", out],
                       capture_output=True, text=True, timeout=600,
                       env={**os.environ, "TMPDIR": str(tmp_path)})  # torchrun's files
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    with open(out) as f:
        doc = json.load(f)
    for key in ("allreduce_small", "allreduce_big", "ddp_step", "fsdp_step_4", "tp_step_2"):
        assert doc[key]["ratio"] > 0, doc
    # The same training on both sides: tpu's losses are CPU's.
    for key in ("fsdp_step_4", "tp_step_2"):
        assert doc[key]["max_loss_rel_diff"] < 1e-4, doc[key]
    assert doc["allreduce_big"]["tpu_busbw_vs_memcpy"] > 0
    assert doc["ddp_step"]["grad_bytes"] > 0
