"""Fused eager (TPU_EAGER_MODE=fused, torch.tpu.set_eager_mode): ops held by
the client and run by tpud as one program at the next synchronisation; on
PJRT with device memory, one StableHLO module per run."""
import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from conftest import Daemon, bazel_bin, run_in_child, wait_reclaimed

import xla_plugins.xla_cpu_pjrt as _xla_cpu

PLUGIN = os.path.join(os.path.dirname(_xla_cpu.__file__), "xla_cpu_pjrt.so")
TPUCTL = bazel_bin("tools/tpuctl/tpuctl")


@pytest.fixture(scope="module")
def pjrt_device():
    d = Daemon(hbm="512MiB", extra_flags=["--backend=pjrt", f"--pjrt_plugin={PLUGIN}",
                                          "--pjrt_option=cpu_device_count=4",
                                          "--pjrt_memory=device"])
    yield d
    d.stop()


def executor_compiles(daemon):
    doc = json.loads(subprocess.run([TPUCTL, f"--admin_socket={daemon.admin_socket}", "status",
                                     "--json"], capture_output=True, text=True, timeout=30,
                                    check=True).stdout)
    return sum(c["compiles"] for e in doc["executors"] for c in e.get("compile", []))


def test_fused_training_equals_direct_and_runs_as_programs(pjrt_device):
    run_in_child(pjrt_device, _fused_training_equals_direct, TPUCTL, pjrt_device.admin_socket,
                 timeout=300)


def _fused_training_equals_direct(tpuctl, admin_socket):
    import subprocess
    import torch
    import torch_tpu  # noqa: F401
    nn = torch.nn
    # The default where tpud compiles runs of ops whole.
    assert torch.tpu.get_eager_mode() == "fused"

    def train(mode):
        torch.tpu.set_eager_mode(mode)
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.LayerNorm(32), nn.Dropout(0.0),
                              nn.Linear(32, 4)).to("tpu")
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        g = torch.Generator().manual_seed(1)
        losses = []
        for step in range(8):
            x = torch.randn(8, 16, generator=g).to("tpu")
            y = torch.randint(0, 4, (8,), generator=g).to("tpu")
            loss = nn.functional.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            if step < 5:
                losses.append(loss.item())   # a synchronisation each step
        torch.tpu.synchronize()              # then three steps without one
        losses.append(loss.item())
        return losses, [p.detach().cpu() for p in model.parameters()]

    direct_losses, direct_params = train("direct")
    fused_losses, fused_params = train("fused")
    assert torch.tpu.get_eager_mode() == "fused"
    # XLA may fuse and reassociate a run's elementwise ops: float tolerance.
    for a, b in zip(direct_losses, fused_losses):
        assert abs(a - b) <= 1e-5 * max(1.0, abs(a)), (direct_losses, fused_losses)
    for a, b in zip(direct_params, fused_params):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-6), (a - b).abs().max()
    # The fused runs went to tpud as programs: the session's "eager" entry.
    doc = json.loads(subprocess.run(
        [tpuctl, f"--admin_socket={admin_socket}",
         "sessions", "--json"], capture_output=True, text=True, check=True).stdout)
    eager = [p for s in doc["sessions"] for p in s.get("programs", []) if p["name"] == "eager"]
    assert eager and eager[0]["id"] == 4294967295 and eager[0]["calls"] >= 6, doc["sessions"]
    torch.tpu.set_eager_mode("direct")
    with pytest.raises(ValueError, match="direct.*fused"):
        torch.tpu.set_eager_mode("lazy")


def test_an_error_in_a_fused_run_names_its_op_and_the_session_goes_on(pjrt_device):
    run_in_child(pjrt_device, _an_error_in_a_fused_run_names_its_op)


def _an_error_in_a_fused_run_names_its_op():
    import torch
    import torch_tpu  # noqa: F401
    torch.tpu.set_eager_mode("fused")
    x = torch.arange(6.0, device="tpu")
    good = torch.tensor([0, 5], device="tpu")
    (x * 2)[good].sum().item()           # the signature's first call, checked at once
    bad = torch.tensor([0, 9], device="tpu")
    y = (x * 2)[bad] + 1                 # held: no error yet, as in direct mode
    with pytest.raises(RuntimeError) as e:
        torch.tpu.synchronize()
    message = str(e.value)
    assert "aten::index" in message and "out of bounds" in message, message
    # ... and the line that issued it, this file's.
    assert "[issued at " in message and "test_fused_eager.py:" in message, message
    # What the failed op fed is poisoned; everything else goes on.
    with pytest.raises(RuntimeError, match="failed"):
        y.cpu()
    assert (x + 1).sum().item() == 21.0
    assert torch.equal((x * 2)[good].cpu(), torch.tensor([0.0, 10.0]))


def test_a_training_loop_compiles_in_its_first_step_what_its_later_steps_run(pjrt_device):
    # The first step of an AdamW loop makes the optimizer's state (zeros_like
    # fills) and meets every op signature for the first time; it still runs
    # as one program with the fills apart, the program every later step runs.
    run_in_child(pjrt_device, _first_step_compiles_the_loop, TPUCTL, pjrt_device.admin_socket,
                 timeout=300)


def _first_step_compiles_the_loop(tpuctl, admin_socket):
    import torch
    import torch_tpu  # noqa: F401
    nn = torch.nn

    def compiles():
        doc = json.loads(subprocess.run([tpuctl, f"--admin_socket={admin_socket}", "status",
                                         "--json"], capture_output=True, text=True,
                                        check=True).stdout)
        return sum(c["compiles"] for e in doc["executors"] for c in e.get("compile", []))

    def train(device, mode=None):
        if mode:
            torch.tpu.set_eager_mode(mode)
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(12, 20), nn.Tanh(), nn.Linear(20, 3)).to(device)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        x = torch.linspace(-1, 1, 60).reshape(5, 12).to(device)
        counts, losses = [], []
        for _ in range(5):
            loss = (model(x) ** 2).mean()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            if device == "tpu":
                torch.tpu.synchronize()
                counts.append(compiles())
            losses.append(loss.detach())
        return counts, [v.item() for v in losses], [p.detach().cpu() for p in model.parameters()]

    _, want_losses, want_params = train("cpu")
    counts, losses, params = train("tpu", "fused")
    assert counts[1:] == [counts[0]] * 4, counts
    for a, b in zip(want_losses, losses):
        assert abs(a - b) <= 1e-5 * max(1.0, abs(a)), (want_losses, losses)
    for a, b in zip(want_params, params):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-6), (a - b).abs().max()


def test_fills_in_a_fused_run_keep_their_order_with_the_ops_around_them(pjrt_device):
    run_in_child(pjrt_device, _fills_keep_their_order)


def _fills_keep_their_order():
    import torch
    import torch_tpu  # noqa: F401
    torch.tpu.set_eager_mode("fused")
    x = torch.arange(6.0).to("tpu")
    torch.tpu.synchronize()
    y = x * 2                          # reads x, then x is filled: in this order
    x.zero_()
    z = x + 1
    fresh = torch.zeros(6, device="tpu")   # a new tensor that outlives the run
    ones = torch.ones(2, 3, device="tpu")
    w = fresh + y
    ones.fill_(4.0)                    # a second fill of a filled tensor
    temp = torch.full((6,), 3.0, device="tpu")  # a temporary: freed inside the run
    v = y + temp
    del temp
    torch.tpu.synchronize()
    assert y.cpu().tolist() == [0.0, 2.0, 4.0, 6.0, 8.0, 10.0]
    assert z.cpu().tolist() == [1.0] * 6 and x.cpu().tolist() == [0.0] * 6
    assert torch.equal(w.cpu(), y.cpu()) and fresh.cpu().tolist() == [0.0] * 6
    assert ones.cpu().tolist() == [[4.0] * 3] * 2
    assert v.cpu().tolist() == [3.0, 5.0, 7.0, 9.0, 11.0, 13.0]


def test_argument_errors_come_at_the_call_in_the_middle_of_a_held_run(pjrt_device):
    # A fill's new argument class is checked on the host by the CPU kernel
    # (HostStandIn), a structured op's by its meta function: raised at the
    # call, in ATen's words, in the middle of a held run that then goes on.
    run_in_child(pjrt_device, _host_checked_errors)


def _host_checked_errors():
    import torch
    import torch_tpu  # noqa: F401
    torch.tpu.set_eager_mode("fused")
    x = torch.arange(4.0, device="tpu")
    held = x * 3
    longs = torch.ones(4, dtype=torch.long, device="tpu")
    for bad, text in (
            (lambda: torch._foreach_sub_([x], [x > 1]),
             "Subtraction, the `-` operator, with a bool tensor is not supported"),
            (lambda: torch.zeros(2, dtype=torch.int8, device="tpu").fill_(1000),
             "value cannot be converted to type int8_t without overflow")):
        with pytest.raises(RuntimeError, match=re.escape(text)):
            bad()
    torch._foreach_mul_([x, held], 2.0)
    assert held.cpu().tolist() == [0.0, 6.0, 12.0, 18.0] and x.sum().item() == 12.0
    assert longs.sum().item() == 4


def test_runs_that_differ_in_where_an_empty_op_lies(pjrt_device):
    run_in_child(pjrt_device, _empty_op_moves)


def _empty_op_moves():
    # The same ops with work, and an op without elements first, then in the
    # middle: two graphs (the second once crashed tpud's executor, taken
    # for the first).
    import torch
    import torch_tpu  # noqa: F401
    torch.tpu.set_eager_mode("fused")
    x = torch.arange(6.0).to("tpu")
    e = torch.empty(0, device="tpu")
    for first in (True, False):
        if first:
            a = e + 1
        b = x * 2
        if not first:
            a = e + 1
        c = b + x
        assert c.cpu().tolist() == [0.0, 3.0, 6.0, 9.0, 12.0, 15.0] and a.numel() == 0


def test_a_changing_shape_compiles_once_per_shape(pjrt_device):
    run_in_child(pjrt_device, _changing_shapes, 1)
    before = executor_compiles(pjrt_device)
    # A new process, the same loop: every run's program is compiled already.
    run_in_child(pjrt_device, _changing_shapes, 2)
    assert executor_compiles(pjrt_device) == before
    # Runs of at most two ops: the same results.
    run_in_child(pjrt_device, _changing_shapes, 1, env_extra={"TPU_EAGER_RUN_OPS": "2"})


def test_tpuctl_and_torch_tpu_say_why_a_fused_run_compiled(pjrt_device):
    r = run_in_child(pjrt_device, _compile_reasons, TPUCTL, pjrt_device.admin_socket)
    assert "Latest compile, and why" in r.stdout and "eager (fused)" in r.stdout, r.stdout


def _compile_reasons(tpuctl, admin_socket):
    import subprocess
    import torch
    import torch_tpu  # noqa: F401
    torch.tpu.set_eager_mode("fused")
    w = torch.linspace(-1, 1, 24).reshape(8, 3).to("tpu")
    for n in (5, 7):          # the same ops; the second with other shapes
        x = torch.linspace(0, 1, n * 8).reshape(n, 8).to("tpu")
        torch.tanh(x @ w * 0.5 + 1).sum(0).cpu()
    eager = [p for p in torch.tpu.programs() if p["name"] == "eager (fused)"]
    assert len(eager) == 1 and eager[0]["id"] is None, eager
    assert eager[0]["compiles"] == 2 and eager[0]["calls"] >= 2, eager
    why = eager[0]["last_compile"]
    # Which op parts from the first run's program, and how.
    assert "parts from it at op 1: aten::mm with other shapes" in why, why
    doc = json.loads(subprocess.run([tpuctl, f"--admin_socket={admin_socket}", "sessions",
                                     "--json"], capture_output=True, text=True,
                                    check=True).stdout)
    mine = [p for s in doc["sessions"] for p in s["programs"] if p["name"] == "eager"]
    assert any(p["compiles"] == 2 and p["last_compile"] == why for p in mine), mine
    print(subprocess.run([tpuctl, f"--admin_socket={admin_socket}", "programs"],
                         capture_output=True, text=True, check=True).stdout)


def _changing_shapes(rounds):
    import torch
    import torch_tpu  # noqa: F401
    torch.tpu.set_eager_mode("fused")
    w = torch.linspace(-1, 1, 24).reshape(8, 3)
    wt = w.to("tpu")
    for _ in range(rounds):
        for n in (4, 16, 4, 16):
            x = torch.linspace(0, 1, n * 8).reshape(n, 8)
            got = torch.tanh(x.to("tpu") @ wt * 0.5 + 1).sum(0)
            want = torch.tanh(x @ w * 0.5 + 1).sum(0)
            assert torch.allclose(got.cpu(), want, atol=1e-5), n


def test_blocks_freed_in_a_run_wait_for_its_end_and_hold_nothing_after(pjrt_device):
    run_in_child(pjrt_device, _block_reuse_rules)
    # Tensors freed inside each run and made again in the next: what a run
    # wrote to a freed block (its temporary) never shows in the next.
    run_in_child(pjrt_device, _frees_what_it_made, 6)


def _block_reuse_rules():
    import torch
    import torch_tpu  # noqa: F401
    n = 1 << 18                                      # 1 MiB of float32
    x = torch.ones(n, device="tpu")
    for mode in ("direct", "fused"):
        torch.tpu.set_eager_mode(mode)
        torch.tpu.synchronize()
        a = x * 2
        freed = a.data_ptr()
        del a
        b = x * 3
        # Fused: a block freed while its run is held is not handed out in that
        # run (which tensors share a segment is part of the run's program).
        assert (b.data_ptr() == freed) == (mode == "direct"), mode
        torch.tpu.synchronize()
        c = x * 4
        if mode == "fused":                          # the run went: it is again
            assert c.data_ptr() == freed
        assert b.sum().item() == 3 * n and c.sum().item() == 4 * n
        del b, c
    # On PJRT a block of 1 MiB or more comes in a size class (a quarter of a
    # power of two) and serves only that class: a step's tensors land in
    # segments of the same sizes whatever the cache held.
    torch.tpu.empty_cache()
    before = torch.tpu.memory_reserved()
    y = torch.empty(n + 1024, device="tpu")          # 1 MiB + 4 KiB
    assert torch.tpu.memory_reserved() - before == 5 << 18   # 1.25 MiB
    del y
    z = torch.empty(n // 2 * 3, device="tpu")         # 1.5 MiB: not the cached 1.25
    assert torch.tpu.memory_reserved() - before == (5 << 18) + (6 << 18)
    del z


def _frees_what_it_made(steps):
    import torch
    import torch_tpu  # noqa: F401
    torch.tpu.set_eager_mode("fused")
    n = 1 << 18                       # 1 MiB of float32
    x = torch.linspace(-1, 1, n)
    w = torch.linspace(0, 2, 3 * n // 2)
    xt, wt = x.to("tpu"), w.to("tpu")
    acc_t, acc = torch.zeros(n, device="tpu"), torch.zeros(n)
    for step in range(steps):
        for src, wgt, out in ((xt, wt, acc_t), (x, w, acc)):
            a = src * (step + 1)                   # freed in the run
            b = torch.cat([a, wgt])[n // 2:] * 0.5  # 1.25 MiB, freed too
            c = torch.tanh(b[:n] + a)
            del a, b
            out.add_(c)
            del c
        assert torch.allclose(acc_t.cpu(), acc, atol=1e-5), step
        assert acc_t.sum().item() == pytest.approx(acc.sum().item(), rel=1e-5)


def test_amp_and_side_streams_fused_equal_direct(pjrt_device):
    run_in_child(pjrt_device, _amp_and_streams)


def _amp_and_streams():
    import torch
    import torch_tpu  # noqa: F401
    nn = torch.nn

    def train(mode):
        torch.tpu.set_eager_mode(mode)
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4)).to("tpu")
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        g = torch.Generator().manual_seed(1)
        side = torch.tpu.Stream()
        losses = []
        for _ in range(4):
            x = torch.randn(8, 16, generator=g).to("tpu")
            # A side stream makes the targets while the default one waits
            # for them by an event: each stream holds its own run.
            with torch.tpu.stream(side):
                y = (x[:, :4] * 2).sin()
                ready = torch.Event(device="tpu")
                ready.record()
            torch.tpu.current_stream().wait_event(ready)
            with torch.autocast("tpu", dtype=torch.bfloat16):
                out = model(x)
                assert out.dtype == torch.bfloat16
                loss = (out.float() - y).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
        return losses, [p.detach().cpu() for p in model.parameters()]

    direct = train("direct")
    fused = train("fused")
    # bfloat16 products, reassociated by XLA: bfloat16's tolerance.
    for a, b in zip(direct[0], fused[0]):
        assert abs(a - b) <= 1e-2 * max(1.0, abs(a)), (direct[0], fused[0])
    for a, b in zip(direct[1], fused[1]):
        assert torch.allclose(a, b, rtol=2e-2, atol=2e-3), (a - b).abs().max()


@pytest.mark.slow
def test_kill_9_in_a_fused_run_ends_only_that_session(pjrt_device):
    victim = subprocess.Popen([sys.executable, "-c", textwrap.dedent("""
        import torch, torch_tpu
        torch.tpu.set_eager_mode("fused")
        a = torch.randn(512, 512, device="tpu")
        torch.tpu.synchronize()
        print("ready", flush=True)
        while True:
            for _ in range(200):
                a = torch.tanh(a @ a)
            torch.tpu.synchronize()
    """)], env=pjrt_device.env(), stdout=subprocess.PIPE, text=True)
    assert victim.stdout.readline().strip() == "ready"
    time.sleep(1.0)
    victim.send_signal(signal.SIGKILL)
    victim.wait()
    doc = wait_reclaimed(pjrt_device, timeout=20)
    assert not doc["sessions"] and all(c["hbm_used_bytes"] == 0 for c in doc["chips"]), doc
    run_in_child(pjrt_device, _changing_shapes, 1)


def test_fused_mode_on_the_simulated_host_runs_op_by_op(daemon):
    r = run_in_child(daemon, _print_eager_mode)
    assert r.stdout.strip() == "direct", r.stdout   # the default there
    run_in_child(daemon, _simulated_fused, env_extra={"TPU_EAGER_MODE": "fused"})
    r = run_in_child(daemon, _simulated_fused, env_extra={"TPU_EAGER_MODE": "lazy"}, check=False)
    assert r.returncode != 0 and "TPU_EAGER_MODE=lazy" in r.stderr, r.stderr
    r = run_in_child(daemon, _simulated_fused,
                     env_extra={"TPU_EAGER_MODE": "fused", "TPU_EAGER_RUN_OPS": "0"}, check=False)
    assert r.returncode != 0 and "TPU_EAGER_RUN_OPS=0" in r.stderr, r.stderr


def _print_eager_mode():
    import torch
    import torch_tpu  # noqa: F401
    print(torch.tpu.get_eager_mode())


def _simulated_fused():
    import torch
    import torch_tpu  # noqa: F401
    assert torch.tpu.get_eager_mode() == "fused"
    torch.manual_seed(0)
    x = torch.randn(5, 7)
    t = x.to("tpu")
    for _ in range(3):
        t = torch.sigmoid(t * 1.5 - 0.25).cumsum(1)
        x = torch.sigmoid(x * 1.5 - 0.25).cumsum(1)
    assert torch.allclose(t.cpu(), x, atol=1e-6)
    assert t.sum().item() == pytest.approx(x.sum().item(), rel=1e-6)


def test_runs_reuse_the_memory_they_free_and_an_idle_executor_gives_it_back():
    """A fused run's scratch (here a 64 MiB product that only its sum reads)
    comes from the executor's heap: later runs find it mapped instead of
    faulting it in afresh, and the executor hands it back once idle for
    --executor_heap_keep."""
    d = Daemon(hbm="512MiB", extra_flags=["--backend=pjrt", f"--pjrt_plugin={PLUGIN}",
                                          "--pjrt_option=cpu_device_count=4",
                                          "--pjrt_memory=device", "--executor_heap_keep=1s"])
    try:
        run_in_child(d, _scratch_is_reused_then_given_back, TPUCTL, d.admin_socket, timeout=180)
    finally:
        d.stop()


def _scratch_is_reused_then_given_back(tpuctl, admin_socket):
    import subprocess
    import time
    import torch
    import torch_tpu  # noqa: F401
    torch.tpu.set_eager_mode("fused")
    x = torch.randn(2048, 64).to("tpu")
    y = torch.randn(64, 8192).to("tpu")
    want = (x.cpu() @ y.cpu()).sum().item()
    torch.tpu.synchronize()
    doc = json.loads(subprocess.run([tpuctl, f"--admin_socket={admin_socket}", "status",
                                     "--json"], capture_output=True, text=True, timeout=30,
                                    check=True).stdout)
    pid = doc["executors"][0]["pid"]

    def faults():
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[7])   # minflt

    def rss_anon_mib():
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("RssAnon:"):
                    return int(line.split()[1]) / 1024
        raise AssertionError("no RssAnon")

    for _ in range(10):   # compiled, and the heap grown to what runs need
        got = (x @ y).sum().item()
    runs_faults = []
    for _ in range(20):
        before = faults()
        got = (x @ y).sum().item()
        runs_faults.append(faults() - before)
    assert abs(got - want) <= 1e-3 * max(1.0, abs(want)), (got, want)
    # Mapped afresh, the product alone is 16,384 pages: every run takes
    # about 17,000 faults with --executor_heap_keep=0. Kept, most runs take
    # none; now and then the heap still grows by one more scratch (a small
    # block took part of a freed one).
    assert sum(f < 1000 for f in runs_faults) >= 10, runs_faults
    busy = rss_anon_mib()
    deadline = time.monotonic() + 20
    while rss_anon_mib() > busy - 48 and time.monotonic() < deadline:
        time.sleep(0.25)
    assert rss_anon_mib() <= busy - 48, (busy, rss_anon_mib())
