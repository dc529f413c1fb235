"""torch_tpu against a real tpud: "tpu" as a native PyTorch device."""
import os
import subprocess
import sys
import textwrap

import pytest

from conftest import Daemon, child_argv, run_in_child, run_py


@pytest.fixture(scope="module")
def tpud(any_backend):
    """Every test here runs on both chip backends (the simulated host, and
    PJRT on XLA's CPU plugin)."""
    return any_backend


def test_device_and_accelerator_apis(tpud):
    run_in_child(tpud, _device_and_accelerator_apis)


def _device_and_accelerator_apis():
    import torch
    import torch_tpu  # noqa: F401
    assert torch.tpu.is_available() and torch.tpu.device_count() == 4
    assert torch.accelerator.current_accelerator().type == "tpu"
    assert torch.accelerator.device_count() == 4
    torch.tpu.set_device(2)
    assert torch.tpu.current_device() == 2
    with torch.tpu.device(1):
        assert torch.tpu.current_device() == 1
        x = torch.ones(3, device="tpu")
        assert x.device == torch.device("tpu", 1)
    assert torch.tpu.current_device() == 2
    p = torch.tpu.get_device_properties(0)
    assert p.generation == "v6e" and p.total_memory == 1 << 30 and p.coords == [0, 0]
    assert "v6e" in torch.tpu.get_device_name()
    assert torch.bfloat16 in torch.tpu.get_amp_supported_dtype()
    assert torch.ones(2).to("tpu").is_tpu
    # What the session may hold on a chip, as torch.tpu.memory_budget and
    # mem_get_info see it (no quota here: the budget is the chip's HBM).
    b = torch.tpu.memory_budget(1)
    assert (b.total, b.quota, b.budget) == (1 << 30, 0, 1 << 30)
    assert 0 < b.held and b.available == torch.tpu.mem_get_info(1)[0] <= b.budget - b.held


def test_visible_chips_narrow_the_devices(tpud):
    run_in_child(tpud, _visible_chips_narrow_the_devices, env_extra={"TPU_VISIBLE_CHIPS": "1,3"})


def _visible_chips_narrow_the_devices():
    import torch
    import torch_tpu  # noqa: F401
    assert torch.tpu.device_count() == 2
    assert torch.tpu.get_device_properties(1).chip == 3
    x = torch.ones(4, device="tpu:1") * 3
    assert x.cpu().tolist() == [3.0] * 4


def test_ops_match_cpu(tpud):
    run_in_child(tpud, _ops_match_cpu)


def _ops_match_cpu():
    import torch
    import torch_tpu  # noqa: F401
    torch.manual_seed(0)
    a, b = torch.randn(8, 5), torch.randn(8, 5)
    ta, tb = a.to("tpu"), b.to("tpu")
    def same(t, c, tol=1e-5):
        assert t.device.type == "tpu", t.device
        t = t.cpu()
        assert t.dtype == c.dtype and t.shape == c.shape, (t.dtype, c.dtype, t.shape, c.shape)
        exact = not (c.is_floating_point() or c.is_complex())
        assert (torch.equal(t, c) if exact else torch.allclose(t, c, atol=tol, rtol=tol)), (t, c)
    same(ta + tb * 2, a + b * 2)
    same(ta - 1, a - 1)
    same(ta[:, 1:3], a[:, 1:3])
    same(ta.t().contiguous(), a.t().contiguous())
    same(ta.sum(1), a.sum(1))
    same(ta.mean(), a.mean())
    same(ta.max(dim=0).values, a.max(dim=0).values)
    same(ta.argmax(1), a.argmax(1))
    same(ta @ tb.t(), a @ b.t(), 1e-4)
    same(torch.relu(ta), torch.relu(a))
    same(torch.softmax(ta, 1), torch.softmax(a, 1))
    same(ta[torch.tensor([0, 3, 3]).to("tpu")], a[torch.tensor([0, 3, 3])])
    same(ta[ta > 0], a[a > 0])
    same(torch.nonzero(ta > 0.5), torch.nonzero(a > 0.5))
    same((ta > 0).sum(), (a > 0).sum())
    same(ta.to(torch.bfloat16) * 2, a.to(torch.bfloat16) * 2, 1e-2)
    same(ta.half() + 1, a.half() + 1, 1e-2)
    same(torch.arange(10).to("tpu") * 3, torch.arange(10) * 3)
    c = torch.randn(4, dtype=torch.complex64)
    same(c.to("tpu") * c.to("tpu"), c * c)
    x = torch.randn(2, 3, 8, 8); w = torch.randn(4, 3, 3, 3)
    same(torch.nn.functional.conv2d(x.to("tpu"), w.to("tpu"), padding=1),
         torch.nn.functional.conv2d(x, w, padding=1), 1e-4)
    same(torch.nn.functional.max_pool2d(x.to("tpu"), 2), torch.nn.functional.max_pool2d(x, 2))
    ln = torch.nn.LayerNorm(8)
    same(ln.to("tpu")(x.to("tpu")), ln.cpu()(x), 1e-4)
    y = ta.clone(); y.add_(1); y[0, 0] = 42.0
    z = a.clone(); z.add_(1); z[0, 0] = 42.0
    same(y, z)
    assert abs(ta.sum().item() - a.sum().item()) < 1e-4
    assert str(ta.cpu()) == str(a)
    assert "device='tpu:0'" in repr(ta)


# Regression: a synchronous op that returned one of its arguments used to be
# taken for a new segment (and freed under the caller).
def test_boolean_index_then_more_work(tpud):
    run_in_child(tpud, _boolean_index_then_more_work)


def _boolean_index_then_more_work():
    import torch
    import torch_tpu  # noqa: F401
    a = torch.randn(8, 5)
    ta = a.to("tpu")
    assert torch.equal(ta[ta > 0].cpu(), a[a > 0])
    x = torch.ones(4).to("tpu"); y = torch.ones(4).to("tpu")
    assert torch.equal((x * y).cpu(), torch.ones(4))


def test_autograd_and_optimizer_match_cpu(tpud):
    run_in_child(tpud, _autograd_and_optimizer_match_cpu)


def _autograd_and_optimizer_match_cpu():
    import torch
    import torch_tpu  # noqa: F401
    torch.manual_seed(0)
    def train(device):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3)).to(device)
        opt = torch.optim.Adam(model.parameters(), lr=0.01)
        x = torch.randn(32, 6, generator=torch.Generator().manual_seed(1)).to(device)
        y = torch.randint(0, 3, (32,), generator=torch.Generator().manual_seed(2)).to(device)
        losses = []
        for _ in range(5):
            loss = torch.nn.functional.cross_entropy(model(x), y)
            opt.zero_grad(); loss.backward(); opt.step()
            losses.append(loss.item())
        return losses
    cpu, tpu = train("cpu"), train("tpu")
    assert all(abs(a - b) < 1e-4 for a, b in zip(cpu, tpu)), (cpu, tpu)


def test_rng_is_reproducible(tpud):
    run_in_child(tpud, _rng_is_reproducible)


def _rng_is_reproducible():
    import torch
    import torch_tpu  # noqa: F401
    torch.tpu.manual_seed(123)
    a = torch.randn(100, device="tpu").cpu()
    b = torch.rand(10, device="tpu").cpu()
    torch.tpu.manual_seed(123)
    assert torch.equal(a, torch.randn(100, device="tpu").cpu())
    assert torch.equal(b, torch.rand(10, device="tpu").cpu())
    state = torch.tpu.get_rng_state()
    c = torch.randn(5, device="tpu").cpu()
    torch.tpu.set_rng_state(state)
    assert torch.equal(c, torch.randn(5, device="tpu").cpu())
    assert abs(a.mean().item()) < 0.5 and 0.5 < a.std().item() < 1.5


def test_memory_stats_rise_and_fall(tpud):
    run_in_child(tpud, _memory_stats_rise_and_fall)


def _memory_stats_rise_and_fall():
    import torch
    import torch_tpu  # noqa: F401
    base = torch.tpu.memory_allocated()
    x = torch.empty(1 << 20, device="tpu")
    assert torch.tpu.memory_allocated() >= base + (4 << 20)
    assert torch.accelerator.memory_allocated() == torch.tpu.memory_allocated()
    peak = torch.tpu.max_memory_allocated()
    del x
    assert torch.tpu.memory_allocated() == base
    assert torch.tpu.memory_reserved() >= 4 << 20       # cached
    assert torch.tpu.max_memory_allocated() == peak
    torch.tpu.empty_cache()
    assert torch.tpu.memory_reserved() == 0
    torch.tpu.reset_peak_memory_stats()
    assert torch.tpu.max_memory_allocated() == torch.tpu.memory_allocated()
    free, total = torch.tpu.mem_get_info()
    assert total == 1 << 30 and 0 < free <= total
    assert torch.tpu.memory_stats()["num_device_alloc"] >= 1


def test_small_tensors_are_carved_from_pools(tpud):
    # Device buffers hold one tensor each: no pools there.
    pool = 0 if tpud.backend == "pjrt-device" else 2 << 20
    run_in_child(tpud, _small_tensors_are_carved_from_pools, pool)


def test_without_pools_each_small_tensor_is_a_segment():
    d = Daemon(extra_flags=["--small_pool_bytes=0"], hbm="1GiB")
    try:
        run_in_child(d, _small_tensors_are_carved_from_pools, 0)
    finally:
        d.stop()


def _small_tensors_are_carved_from_pools(pool):
    # A new process's small tensors come from pools of the size tpud
    # advertises, one round trip per pool rather than one per tensor; a pool
    # goes back to tpud once every block carved from it is cached.
    import torch
    import torch_tpu  # noqa: F401
    stats = torch.tpu.memory_stats
    free0, _ = torch.tpu.mem_get_info()
    ts = [torch.full((1000 + i,), float(i), device="tpu") for i in range(300)]
    blocks = sum((4 * (1000 + i) + 4095) // 4096 * 4096 for i in range(300))
    assert torch.tpu.memory_allocated() == blocks
    allocs = stats()["num_device_alloc"]
    reserved = torch.tpu.memory_reserved()
    assert free0 - torch.tpu.mem_get_info()[0] == reserved
    if pool:
        pools = -(-blocks // pool) + 1   # at most one pool's tail wasted
        assert allocs <= pools and reserved == allocs * pool
    else:
        assert allocs == 300 and reserved == blocks
    for i in (0, 1, 150, 299):      # no two tensors share bytes
        assert ts[i].sum().item() == i * (1000 + i)
    # Blocks of one pool are distinct storages to the chip's kernels (ATen
    # skips a copy between aliases at equal offsets).
    assert torch.equal(ts[7].pow(1.0).cpu(), torch.full((1007,), 7.0))
    assert not torch.equal(ts[7], ts[7] + 1)
    keep = ts[150]
    del ts
    torch.tpu.empty_cache()
    # The pool holding the survivor stays, and the survivor with it.
    assert torch.tpu.memory_reserved() == (pool or 8192)
    assert keep.sum().item() == 150 * 1150
    y = keep * 2                     # carved from what the cache kept
    assert y.sum().item() == 300 * 1150
    del keep, y
    torch.tpu.empty_cache()
    assert torch.tpu.memory_reserved() == 0
    assert torch.tpu.mem_get_info()[0] == free0
    # Bigger tensors still get segments of their own.
    big = torch.empty(1 << 20, device="tpu")
    assert torch.tpu.memory_reserved() == 4 << 20
    del big


def test_streams_and_events(tpud):
    run_in_child(tpud, _streams_and_events)


def _streams_and_events():
    import torch
    import torch_tpu  # noqa: F401
    a = torch.randn(256, 256, device="tpu")
    s = torch.tpu.Stream()
    start = torch.Event(device="tpu", enable_timing=True)
    end = torch.Event(device="tpu", enable_timing=True)
    start.record()
    with torch.tpu.stream(s):
        b = a @ a
        done = torch.Event(device="tpu"); done.record()
    torch.tpu.current_stream().wait_event(done)
    torch.tpu.set_stream(s)  # torch.cuda.set_stream's counterpart
    assert torch.tpu.current_stream() == s
    torch.tpu.set_stream(torch.tpu.default_stream())
    assert torch.tpu.current_stream() == torch.tpu.default_stream()
    c = b + 1
    end.record(); end.synchronize()
    assert start.elapsed_time(end) >= 0
    assert torch.allclose(c.cpu(), (a.cpu() @ a.cpu()) + 1, atol=1e-3)
    torch.tpu.synchronize()
    torch.accelerator.synchronize()


def test_pin_memory_and_dataloader(tpud):
    run_in_child(tpud, _pin_memory_and_dataloader)


def _pin_memory_and_dataloader():
    import torch
    import torch_tpu  # noqa: F401
    from torch.utils.data import DataLoader, TensorDataset
    p = torch.arange(1000.0).pin_memory()
    assert p.is_pinned()
    assert torch.equal(p.to("tpu").cpu(), torch.arange(1000.0))
    ds = TensorDataset(torch.arange(64.0).reshape(16, 4))
    seen = 0
    for (batch,) in DataLoader(ds, batch_size=4, pin_memory=True):
        assert batch.is_pinned()
        seen += batch.to("tpu").sum().item()
    assert seen == sum(range(64))
    # The device has a host allocator for torch: empty_host_cache (vLLM's
    # shutdown calls it) used to crash the process.
    q = torch.empty(4096, pin_memory=True)
    torch.accelerator.empty_host_cache()
    assert q.is_pinned()
    del q
    torch.accelerator.empty_host_cache()


def test_save_and_load(tpud, tmp_path):
    run_in_child(tpud, _save_and_load, str(tmp_path))


def _save_and_load(tmp_path):
    import torch
    import torch_tpu  # noqa: F401
    m = torch.nn.Linear(3, 2).to("tpu")
    t = torch.randn(4, device="tpu")
    torch.save({"model": m.state_dict(), "t": t}, f"{tmp_path}/ck.pt")
    on_tpu = torch.load(f"{tmp_path}/ck.pt")
    assert on_tpu["t"].device.type == "tpu" and torch.equal(on_tpu["t"].cpu(), t.cpu())
    on_cpu = torch.load(f"{tmp_path}/ck.pt", map_location="cpu")
    assert on_cpu["t"].device.type == "cpu" and torch.equal(on_cpu["t"], t.cpu())
    torch.save(on_cpu, f"{tmp_path}/cpu.pt")
    back = torch.load(f"{tmp_path}/cpu.pt", map_location="tpu")
    assert back["model"]["weight"].device.type == "tpu"
    m2 = torch.nn.Linear(3, 2).to("tpu"); m2.load_state_dict(back["model"])
    assert torch.equal(m2.weight.cpu(), m.weight.cpu())


def test_async_error_surfaces_at_sync_with_op_name(tpud):
    r = run_in_child(tpud, _async_error_surfaces_at_sync_with_op_name)
    assert "ERR" in r.stdout and "index" in r.stdout


def _async_error_surfaces_at_sync_with_op_name():
    import torch
    import torch_tpu  # noqa: F401
    a = torch.randn(3, 4, device="tpu")
    # The first op of an argument class waits for its result (argument
    # errors raise at the call); the ones after it are queued.
    a.index_select(0, torch.tensor([0, 1]).to("tpu"))
    idx = torch.tensor([0, 7]).to("tpu")   # out of range for dim 0
    b = a.index_select(0, idx)             # queued; fails in the daemon
    try:
        b.cpu()
    except RuntimeError as e:
        print("ERR", e)


def test_no_silent_cpu_fallback(tpud):
    r = run_in_child(tpud, _no_silent_cpu_fallback)
    assert "ERR" in r.stdout and "tpu" in r.stdout and "cpu" in r.stdout


def _no_silent_cpu_fallback():
    import torch
    import torch_tpu  # noqa: F401
    try:
        torch.ones(3, device="tpu") + torch.ones(3)
    except RuntimeError as e:
        print("ERR", e)


def test_no_daemon_raises_at_first_use(tmp_path):
    sock = str(tmp_path / "none.sock")
    r = subprocess.run([sys.executable, "-c", textwrap.dedent("""
        import torch, torch_tpu
        assert torch.tpu.device_count() == 0 and not torch.tpu.is_available()
        try:
            torch.ones(2, device="tpu")
        except RuntimeError as e:
            print("ERR", e)
    """)], env={**os.environ, "TPUD_SOCKET": sock}, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert "ERR" in r.stdout and sock in r.stdout and "tpud" in r.stdout


@pytest.mark.slow
def test_daemon_gone_mid_run_is_an_error_not_a_hang():
    d = Daemon(hbm="256MiB")
    try:
        p = subprocess.Popen([sys.executable, "-c", textwrap.dedent("""
            import sys, torch, torch_tpu
            a = torch.ones(4, device="tpu")
            print("ready", flush=True)
            sys.stdin.readline()
            try:
                (a + 1).cpu()
            except RuntimeError as e:
                print("ERR", e, flush=True)
        """)], env=d.env(), stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert p.stdout.readline().strip() == "ready"
    finally:
        d.stop()
    p.stdin.write("\n")
    p.stdin.flush()
    out, _ = p.communicate(timeout=60)
    assert "ERR" in out and "tpud" in out


@pytest.mark.slow
def test_two_training_processes_at_once(tpud):
    env = tpud.env()
    procs = [subprocess.Popen(child_argv(_train_a_linear_model), env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(2)]
    for p in procs:
        out, err = p.communicate(timeout=180)
        assert p.returncode == 0 and "ok" in out, err


def _train_a_linear_model():
    import torch
    import torch_tpu  # noqa: F401
    torch.manual_seed(0)
    m = torch.nn.Linear(32, 1).to("tpu")
    opt = torch.optim.SGD(m.parameters(), lr=0.05)
    x = torch.randn(64, 32).to("tpu"); y = x.sum(1, keepdim=True) * 0.1
    first = None
    for _ in range(60):
        loss = ((m(x) - y) ** 2).mean(); opt.zero_grad(); loss.backward(); opt.step()
        first = first if first is not None else loss.item()
    assert loss.item() < first * 0.5, (first, loss.item())
    print("ok")


def test_backend_autoload_without_import(tpud):
    # torch's backend autoload imports torch_tpu through its entry point.
    run_py(tpud, """
        import torch
        x = torch.ones(3, device="tpu") * 2
        assert x.device.type == "tpu" and x.cpu().tolist() == [2.0, 2.0, 2.0]
        assert torch.tpu.device_count() == 4
    """)


def test_amp_autocast_bfloat16(tpud):
    run_in_child(tpud, _amp_autocast_bfloat16)


def _amp_autocast_bfloat16():
    import torch
    import torch_tpu  # noqa: F401
    torch.manual_seed(0)
    m = torch.nn.Linear(8, 4).to("tpu")
    x = torch.randn(16, 8).to("tpu")
    with torch.autocast("tpu", dtype=torch.bfloat16):
        y = m(x)
        assert y.dtype == torch.bfloat16
        assert (x + x).dtype == torch.float32       # not on the lower-precision list
        loss = y.float().pow(2).mean()
    loss.backward()
    assert m.weight.grad.dtype == torch.float32
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref = torch.nn.functional.linear(x.cpu(), m.weight.cpu(), m.bias.cpu())
    assert torch.allclose(y.float().cpu(), ref.float(), atol=2e-2, rtol=2e-2)


def test_out_ops_pinned_copies_and_recovery_after_errors(tpud):
    # Regressions: out= kernels that use `out` as scratch (mse_loss), out=
    # into strided tensors, pinned sources reused right after a copy, and
    # memory a failed op wrote being fine once rewritten.
    run_in_child(tpud, _out_ops_pinned_copies_and_recovery_after_errors)


def _out_ops_pinned_copies_and_recovery_after_errors():
    import torch
    import torch_tpu  # noqa: F401
    x, y = torch.randn(8, 1), torch.randn(8, 1)
    got = torch.nn.functional.mse_loss(x.to("tpu"), y.to("tpu"))
    assert abs(got.item() - torch.nn.functional.mse_loss(x, y).item()) < 1e-6
    o = torch.empty(6, device="tpu")[::2]
    torch.mul(torch.ones(3, device="tpu"), 5, out=o)
    assert o.cpu().tolist() == [5.0, 5.0, 5.0]
    n = torch.empty(0, dtype=torch.long, device="tpu")
    torch.nonzero(torch.tensor([0.0, 1.0, 2.0]).to("tpu"), out=n)
    assert n.cpu().flatten().tolist() == [1, 2]
    a = torch.randn(512, 512, device="tpu")
    b = a @ a @ a                      # keep the stream busy
    p = torch.ones(128).pin_memory()
    d = p.to("tpu")
    p.fill_(7)
    assert d.cpu().tolist() == [1.0] * 128
    try:
        torch.mm(torch.ones(2, 3, device="tpu"), torch.ones(4, 5, device="tpu")).cpu()
    except RuntimeError:
        pass
    for _ in range(20):
        assert (torch.ones(3).to("tpu") * 2).cpu().tolist() == [2.0] * 3


def test_lazy_conjugate_and_negative_views(tpud):
    # Regression: copying a conjugate view to the host used to recurse
    # through ATen's conjugate fallback until the stack overflowed.
    run_in_child(tpud, _lazy_conjugate_and_negative_views)


def _lazy_conjugate_and_negative_views():
    import torch
    import torch_tpu  # noqa: F401
    c = torch.tensor([1 + 2j, 3 - 1j], dtype=torch.complex64)
    t = c.to("tpu")
    assert torch.equal(t.conj().cpu(), c.conj())
    assert torch.equal(t.conj().resolve_conj().cpu(), c.conj())
    assert torch.allclose(torch.cov(t).cpu(), torch.cov(c))
    m = torch.randn(3, 3, dtype=torch.complex64)
    assert torch.allclose((m.to("tpu").mH @ m.to("tpu")).cpu(), m.mH @ m, atol=1e-5)
    x = torch.randn(3)
    assert torch.equal(x.to("tpu")._neg_view().cpu(), -x)

def test_import_order(tpud):
    run_py(tpud, """
        import torch_tpu, torch
        assert torch.ones(2, device="tpu").cpu().tolist() == [1.0, 1.0]
    """)



def test_host_scalar_values_shape_results(tpud):
    # The per-signature meta cache must tell apart host scalars whose value
    # shapes the result (narrow's start given as a tensor).
    run_in_child(tpud, _host_scalar_values_shape_results)


def _host_scalar_values_shape_results():
    import torch
    import torch_tpu  # noqa: F401
    x = torch.arange(10.0)
    t = x.to("tpu")
    for s in (1, 4, 6):
        assert torch.narrow(t, 0, torch.tensor(s), 3).cpu().tolist() == x[s:s + 3].tolist()


def test_results_live_on_their_tensors_device_not_the_current_one(tpud):
    # Regression: storages that ops resize (out= tensors, e.g. x.sum()) were
    # reallocated on the current device (tpu:0) while claiming tpu:1.
    run_in_child(tpud, _results_live_on_their_tensors_device_not_the_current_one)


def _results_live_on_their_tensors_device_not_the_current_one():
    import torch
    import torch_tpu  # noqa: F401
    assert torch.tpu.current_device() == 0
    x = torch.arange(10., device="tpu:1")
    s = x.sum()
    assert s.device == torch.device("tpu", 1) and s.item() == 45.0
    y = torch.ones(4, device="tpu:1") * 3
    assert y.cpu().tolist() == [3.0] * 4
    z = torch.cat([x, x]).mean()
    assert z.item() == 4.5


def test_zero_tensors_and_transposed_convolution_gradients(tpud):
    # Autograd's ZeroTensors (_efficientzerotensor) take no memory on tpu, as
    # on CUDA; once crashed the daemon's executor when made there. And the
    # bias gradient of a transposed convolution has out_channels entries.
    run_in_child(tpud, _zero_tensors_and_transposed_convolution_gradients)


def _zero_tensors_and_transposed_convolution_gradients():
    import torch
    import torch_tpu  # noqa: F401
    z = torch._efficientzerotensor((2, 3), device="tpu")
    assert z._is_zerotensor() and z.device.type == "tpu"
    assert (z + torch.ones(2, 3, device="tpu")).cpu().tolist() == [[1.0] * 3] * 2
    # Gradients through an op whose backward yields zero tensors.
    a = torch.randn(4, 5, requires_grad=True)
    x = a.detach().to("tpu").requires_grad_()
    torch.view_as_real(torch.complex(x, torch.zeros_like(x))).sum().backward()
    torch.view_as_real(torch.complex(a, torch.zeros_like(a))).sum().backward()
    assert torch.equal(x.grad.cpu(), a.grad)
    for conv in (torch.nn.ConvTranspose1d(4, 6, 3, groups=2),
                 torch.nn.ConvTranspose2d(2, 5, 3, stride=2)):
        dims = 1 if isinstance(conv, torch.nn.ConvTranspose1d) else 2
        inp = torch.randn((2, conv.in_channels) + (7,) * dims)
        dev = torch.nn.ConvTranspose1d(4, 6, 3, groups=2) if dims == 1 \
            else torch.nn.ConvTranspose2d(2, 5, 3, stride=2)
        dev.load_state_dict(conv.state_dict())
        dev = dev.to("tpu")
        conv(inp).square().sum().backward()
        dev(inp.to("tpu")).square().sum().backward()
        for p, q in zip(conv.parameters(), dev.parameters()):
            torch.testing.assert_close(q.grad.cpu(), p.grad, rtol=1e-4, atol=1e-4)


def test_out_and_inplace_results_cast_to_the_out_dtype_as_on_cpu(tpud):
    # ATen lets an out= or in-place tensor have another dtype than the result
    # when the result casts to it (cosine_similarity in bfloat16 clamps with a
    # float32 0-dim eps), and refuses it otherwise.
    run_in_child(tpud, _out_and_inplace_results_cast_to_the_out_dtype_as_on_cpu)


def _out_and_inplace_results_cast_to_the_out_dtype_as_on_cpu():
    import torch
    import torch_tpu  # noqa: F401
    x = torch.tensor([0.3, 2.7], dtype=torch.bfloat16)
    for make in (lambda d: x.to(d).clone().clamp_min_(torch.tensor(1.1)),
                 lambda d: torch.add(x.to(d), 1, out=torch.empty(2, dtype=torch.float64,
                                                                 device=d)),
                 lambda d: torch.nn.functional.cosine_similarity(
                     x[0].to(d), x[1].to(d), dim=0)):
        want, got = make("cpu"), make("tpu")
        assert got.dtype == want.dtype and got.device.type == "tpu", (got.dtype, want.dtype)
        assert torch.equal(got.cpu(), want), (got, want)
    try:
        torch.arange(3, device="tpu").add_(torch.tensor(0.5, device="tpu"))
        raise AssertionError("no error")
    except RuntimeError as e:
        assert "can't be cast to the desired output type Long" in str(e), e


def test_structured_ops_go_to_the_daemon_whole_and_keep_atens_checks(tpud):
    # ATen's default kernel for structured ops on other devices runs the meta
    # function (a TensorIterator) and then the out= op; torch_tpu sends
    # them to its fallback directly, which keeps meta results per signature.
    # In-place ops still check what ATen checks, and their results match
    # the CPU's on views, broadcasts and mixed dtypes.
    run_in_child(tpud, _structured_ops_sent_whole)


def _structured_ops_sent_whole():
    import torch
    import torch_tpu  # noqa: F401
    torch.zeros(1, device="tpu")  # (the session opens at first use)
    whole = set(torch_tpu._C._structured_ops_sent_whole())
    for name in ("aten::add.Tensor", "aten::add_.Tensor", "aten::mul_.Tensor", "aten::div.Tensor"):
        assert name in whole, (name, len(whole))
        assert "registration.cc" in [l for l in torch._C._dispatch_dump_table(name).splitlines()
                            if l.startswith("PrivateUse1:")][0], name
    assert not any("zero_" in n or n == "aten::copy" for n in whole)
    torch.manual_seed(0)
    base = torch.randn(4, 6)
    other = torch.randn(6)
    def run(d):
        a = base.to(d).clone()
        a.t()[1:4].add_(other[:4].to(d), alpha=2)   # in place on a strided view
        b = base.to(d).clone()
        b[:, ::2].mul_(other[:3].to(d))               # broadcast into a view with gaps
        c = torch.arange(12, device=d).reshape(3, 4)
        c.add_(3).mul_(2).sub_(torch.tensor(1, device=d))  # integers, host scalars
        e = base.to(d).clone().clamp_(-0.5, 0.5).sigmoid_()
        f = torch.tensor([1.5, 2.5], device=d, dtype=torch.bfloat16).add_(torch.tensor(0.25))
        g = base.to(d)[torch.tensor([True, False, True, False], device=d)]  # data-dependent meta
        return a, b, c, e, f, g, base.to(d) + other.to(d), torch.maximum(base.to(d), other.to(d))
    for want, got in zip(run("cpu"), run("tpu")):
        assert got.device.type == "tpu" and got.dtype == want.dtype
        torch.testing.assert_close(got.cpu(), want)
    for bad, text in ((lambda: torch.zeros(1, device="tpu").add_(torch.ones(3, device="tpu")),
                       "doesn't match the broadcast shape"),
                      (lambda: torch.zeros(2, device="tpu", dtype=torch.long).mul_(1.5),
                       "can't be cast to the desired output type Long"),
                      (lambda: torch.zeros(2, device="tpu") + torch.ones(3, device="tpu"),
                       "The size of tensor a (2) must match the size of tensor b (3)"),  # the CPU's words
                      (lambda: torch.zeros(1, device="tpu").expand(3).add_(1),
                       "more than one element of the written-to tensor"),
                      (lambda: (lambda a: a[1:].add_(a[:-1]))(torch.arange(6., device="tpu")),
                       "some elements of the input tensor and the written-to tensor")):
        try:
            bad()
            raise AssertionError("no error: " + text)
        except RuntimeError as err:
            assert text in str(err), err
    x = torch.ones(3, device="tpu")
    x.add_(1)
    assert x.cpu().tolist() == [2.0, 2.0, 2.0]  # the session goes on after those errors


def test_foreach_ops_raise_atens_errors_at_the_call(tpud):
    # A foreach op's new argument class is checked by the CPU kernel on host
    # stand-ins (no wait for tpud): ATen's error at the call, nothing written.
    # (On PJRT foreach ops loop over their tensors on the client: mul_.Scalar
    # reaches tpu as mul.out, whose result must cast to `out` as on CPU.)
    run_in_child(tpud, _foreach_errors_at_the_call)


def _foreach_errors_at_the_call():
    import torch
    import torch_tpu  # noqa: F401
    x = torch.arange(4.0, device="tpu")
    longs = torch.ones(4, dtype=torch.long, device="tpu")
    cast = "result type Float can't be cast to the desired output type Long"
    for bad, text in ((lambda: torch._foreach_sub_([x], [x > 1]),
                       "Subtraction, the `-` operator, with a bool tensor is not supported"),
                      (lambda: torch._foreach_lerp_([x], [x.double()], 0.5),
                       "expected dtype float for `end` but got dtype double"),
                      (lambda: torch._foreach_div_([x, x], [2.0]),
                       "Tensor list must have same number of elements as scalar list"),
                      (lambda: torch._foreach_mul_([longs], 0.5), cast),
                      (lambda: longs.mul_(0.5), cast),
                      (lambda: torch.ops.aten.mul_.Scalar(longs, 0.5), cast),
                      (lambda: torch.add(longs, 0.5, out=longs), cast),
                      (lambda: torch.mul(longs, x, out=torch.empty_like(longs)), cast)):
        try:
            bad()
            raise AssertionError("no error: " + text)
        except RuntimeError as err:
            assert text in str(err), err
    torch._foreach_mul_([x, longs], 2)
    assert x.cpu().tolist() == [0.0, 2.0, 4.0, 6.0] and longs.cpu().tolist() == [2] * 4
    # The host check is no op of the program's: a dispatch mode does not see
    # it, nor does CPU autocast change it.
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    class Devices(TorchDispatchMode):
        seen = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.seen += [t.device.type for t in tree_leaves((args, kwargs))
                          if isinstance(t, torch.Tensor)]
            return func(*args, **(kwargs or {}))

    y = torch.ones(3, device="tpu")
    with Devices(), torch.autocast("cpu", dtype=torch.bfloat16):
        torch._foreach_addcmul_([y], [y], [y], 0.5)   # a new class, checked on the host
    assert Devices.seen and set(Devices.seen) == {"tpu"}, Devices.seen
    assert y.cpu().tolist() == [1.5] * 3


def test_cached_blocks_stay_with_their_stream(tpud):
    # A block freed on one stream may still be in use by that stream's queued
    # work; as in CUDA's caching allocator, only that stream reuses it, and a
    # block recorded on another stream comes back once that stream passed
    # the point where it was freed.
    run_in_child(tpud, _cached_blocks_stay_with_their_stream)


def _cached_blocks_stay_with_their_stream():
    import torch
    import torch_tpu  # noqa: F401
    s = torch.tpu.Stream()
    with torch.tpu.stream(s):
        x = torch.empty(1 << 16, device="tpu")
        addr = x.data_ptr()
        del x
    y = torch.empty(1 << 16, device="tpu")
    assert y.data_ptr() != addr, "a block freed on a side stream went to the default stream"
    with torch.tpu.stream(s):
        z = torch.empty(1 << 16, device="tpu")
        assert z.data_ptr() == addr, "the side stream did not reuse its own block"
    a = torch.ones(1 << 16, device="tpu")
    a_addr = a.data_ptr()
    a.record_stream(s)
    with torch.tpu.stream(s):
        (a * 2).sum()
    del a
    # The allocator notes the free on the recorded streams at its next
    # allocation (the deleter may run anywhere); once they pass it, the
    # block is back.
    small = torch.empty(16, device="tpu")
    torch.tpu.synchronize()
    b = torch.empty(1 << 16, device="tpu")
    assert b.data_ptr() == a_addr, "a recorded block never came back after its streams passed"


def test_first_ops_of_a_new_process_import_nothing_heavy(tpud):
    # ATen's meta kernels for most ops are Python (torch._refs and friends,
    # registered at `import torch`); the first reference imported
    # torch._dynamo (~800 modules, about a second) in every tpu process.
    # torch_tpu now asks ATen's C++ meta functions (native_meta.cc), so a
    # short job with scalars, reductions, views and autograd imports what a
    # CPU process imports: nothing.
    # (On the PJRT backend linspace and eye are not lowered: torch._refs'
    # versions run in the client, and their torch._check imports sympy.)
    run_in_child(tpud, _first_ops_import_nothing, tpud.backend == "simulated")


def _first_ops_import_nothing(lowered):
    import sys
    import torch
    import torch_tpu  # noqa: F401
    x = torch.ones(64, 64, device="tpu")
    before = set(sys.modules)
    for _ in range(10):
        x = x * 0.5 + 1
    y = torch.where(x > 1.5, (2 - x) / 3, 0.0)
    w = torch.randn(64, 8).to("tpu").requires_grad_()
    ln = torch.nn.functional.layer_norm(x[:8] @ w, (8,))
    loss = (y.t()[:8] @ w).relu().sum() + x.mean(dim=0).amax() + x.max(dim=1).values.sum()
    loss = loss + ln.square().sum()
    loss.backward()
    assert (x > 0).all().item() and not (x < 0).any().item()
    s = torch.cat([x, y]).sum(dim=1, keepdim=True).view(-1)[::2].sum().item()
    want = torch.ones(64, 64)
    for _ in range(10):
        want = want * 0.5 + 1
    want_y = torch.where(want > 1.5, (2 - want) / 3, 0.0)
    assert abs(s - float(torch.cat([want, want_y]).sum(1)[::2].sum())) < 1e-2, s
    # Factories, a convolution and a loss, forward and backward.
    r = torch.arange(0, 1, 0.25, device="tpu")
    if lowered:
        r = r + torch.linspace(0, 1, 4, device="tpu") + torch.eye(4, device="tpu")[0]
    else:
        r = r + torch.tensor([1, 1 / 3, 2 / 3, 1]).to("tpu")
    r = r.sum() + torch.ones(3, 3, device="tpu").diagonal().sum()
    r = r + torch.arange(4, device="tpu").sum()
    conv = torch.nn.Conv2d(3, 4, 3).to("tpu")
    out = conv(torch.ones(2, 3, 8, 8, device="tpu"))
    loss = torch.nn.functional.mse_loss(out, torch.zeros_like(out))
    loss.backward()
    assert conv.weight.grad.shape == conv.weight.shape and abs(r.item() - 13.5) < 1e-5
    new = sorted(set(sys.modules) - before)
    assert "torch._dynamo" not in sys.modules and "sympy" not in sys.modules, new[:20]
    assert not new, new[:20]


def test_first_use_of_nn_ops_imports_nothing_heavy(tpud):
    # Ops without a C++ meta function in native_meta.cc had their output
    # metadata from a Python meta kernel: torch._refs' pointwise wrappers
    # import torch._dynamo, others sympy, on their first call in a process
    # (1.0-1.6 s and 0.3 s of CPU on the 2-core machine, for leaky_relu,
    # batch norm, hardswish, nonzero, ...). Now structured ops use ATen's C++
    # meta functions through one template, and the first run of a pointwise
    # (or fixed-shape) op's signature says its results' metadata. Each result
    # must also equal the CPU's, and a second call (the cached signature)
    # too.
    if tpud.backend != "simulated":
        pytest.skip("the PJRT backend lowers these ops itself")
    run_in_child(tpud, _first_nn_ops_import_nothing)


def _first_nn_ops_import_nothing():
    import sys
    import warnings
    import torch
    import torch.nn.functional as F
    import torch_tpu  # noqa: F401
    torch.manual_seed(0)
    x0 = torch.randn(2, 4, 8, 8)
    v0 = torch.randn(16)
    w0 = torch.rand(4)
    before = set(sys.modules)

    def run(dev):
        x, v, w = x0.clone().to(dev).requires_grad_(), v0.to(dev), w0.to(dev)
        h = F.leaky_relu(x, 0.1) + F.elu(x) + F.softplus(x) + F.hardswish(x)
        h = h + F.mish(x) + F.hardtanh(x) + F.relu6(x) + torch.hypot(x, x)
        h = F.batch_norm(h, torch.zeros(4, device=dev), torch.ones(4, device=dev),
                         w, training=True)
        h = F.group_norm(h, 2) + F.prelu(h, w)
        h = F.max_pool2d(h, 2) + F.avg_pool2d(h, 2)
        h = F.interpolate(h, scale_factor=2, mode="bilinear") + torch.tril(h.mean(1, True).expand_as(h[:, :, :8, :8]) * 0 + 1).sum()
        loss = F.binary_cross_entropy_with_logits(h.mean((1, 2, 3)), torch.ones(2, device=dev))
        loss = loss + F.huber_loss(v, v.flip(0)) + torch.logaddexp(v, v).sum()
        loss = loss + F.cross_entropy(h.flatten(1)[:, :5], torch.tensor([1, 3], device=dev),
                                      label_smoothing=0.1)
        # reflection_pad2d (and its backward), cosine_similarity's in-place
        # clamp_min_, one_hot's in-place scatter_, randperm, clamp by tensors.
        loss = loss + F.pad(x, (1, 2, 2, 1), mode="reflect").mean()
        loss = loss + F.cosine_similarity(x, x.flip(3)).sum()
        loss.backward()
        sel = v[v > 0].sum() + torch.nonzero(v > 0).sum() + torch.masked_select(v, v < 0).sum()
        hot = F.one_hot(torch.tensor([0, 2, 1], device=dev), 4)
        perm = torch.randperm(5, device=dev).sort().values
        clamped = torch.clamp(v, torch.full_like(v, -0.5), torch.full_like(v, 0.5))
        return [loss.detach(), x.grad, sel, torch.isnan(v).any(), torch.logical_not(v > 0),
                hot, perm, clamped]

    want = run("cpu")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        runs = [[t.cpu() for t in run("tpu")] for _ in range(2)]
    # As on the CPU, no warning: tpud runs huber_loss and other reducing
    # losses through their out= kernels, which resize their out= tensor as
    # scratch; that is no resize of the caller's.
    assert not caught, [str(w.message)[:80] for w in caught]
    new = sorted(set(sys.modules) - before)
    assert "torch._dynamo" not in sys.modules and "sympy" not in sys.modules, new[:20]
    for got in runs:  # (assert_close itself imports torch.distributed.tensor)
        for a, b in zip(want, got):
            torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-4)


def test_exit_after_backward_waits_for_autograd_device_threads(tpud):
    # backward() stashes the caller's contextvars in the graph task; the
    # autograd engine's tpu device thread could drop a finished graph task
    # last, after the process had started to exit, and abort it ("terminate
    # called without an active exception", ~3% of short jobs that ran a
    # backward). torch_tpu's atexit handler makes each used device's thread
    # take one more (Python-free) task, which it can only do once it has
    # dropped the task before: after the drain the context copy is gone.
    run_in_child(tpud, _drain_drops_graph_tasks)


def _drain_drops_graph_tasks():
    import atexit
    import contextvars
    import sys
    import weakref
    import torch
    import torch_tpu
    sys.setswitchinterval(5.0)  # the main thread keeps the GIL meanwhile

    class Held:
        pass
    var = contextvars.ContextVar("held")
    for i in range(200):
        h = Held()
        ref = weakref.ref(h)
        var.set(h)
        del h
        x = torch.ones(4, device="tpu", requires_grad=True)
        (x * 2).sum().backward()
        var.set(None)  # now only the graph task's copy of the context holds it
        torch_tpu._C._drain_autograd_device_threads()
        assert ref() is None, f"iteration {i}: a device thread still holds a graph task"
    assert torch.equal(x.grad.cpu(), torch.full((4,), 2.0))
    # The exit handlers run the drain: its backward allocates on device 0.
    before = torch.tpu.memory_stats()["allocation.all.allocated"]
    atexit._run_exitfuncs()
    assert torch.tpu.memory_stats()["allocation.all.allocated"] > before


def test_item_reads_every_integer_type_to_uint64_max(tpud):
    # A uint64 above INT64_MAX comes back as ATen's unsigned Scalar (it used
    # to fail: "return value 0 is a UInt, which tpud cannot return").
    run_in_child(tpud, _item_reads_every_integer_type)


def _item_reads_every_integer_type():
    import torch
    import torch_tpu  # noqa: F401
    for dtype in (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64,
                  torch.uint16, torch.uint32, torch.uint64):
        info = torch.iinfo(dtype)
        for v in (info.min, info.max, 0, 1, info.max // 3):
            t = torch.tensor([v], dtype=dtype)
            got, want = t.to("tpu").item(), t.item()
            assert got == want and type(got) is type(want), (dtype, v, got, want)
    big = torch.tensor([2 ** 64 - 1, 2 ** 63 + 5], dtype=torch.uint64)
    assert big.to("tpu")[1].item() == 2 ** 63 + 5
    assert big.to("tpu").tolist() == [2 ** 64 - 1, 2 ** 63 + 5]


def test_convolutions_factories_and_losses_match_the_cpu(tpud):
    # Their output metadata now comes from C++ (native_meta.cc): shapes,
    # strides and values as the CPU's, for every kind of convolution.
    run_in_child(tpud, _convolutions_factories_and_losses_match_cpu)


def _convolutions_factories_and_losses_match_cpu():
    import torch
    import torch_tpu  # noqa: F401
    F = torch.nn.functional
    g = torch.Generator().manual_seed(0)
    cases = [  # (input shape, weight shape, keyword arguments, transposed)
        ((2, 4, 9), (6, 2, 3), dict(stride=2, padding=1, groups=2), False),
        ((4, 9), (6, 4, 3), dict(dilation=2), False),                     # unbatched
        ((1, 3, 7, 6), (5, 3, 3, 2), dict(stride=(2, 1), padding=(1, 0)), False),
        ((1, 2, 4, 5, 6), (3, 2, 2, 2, 2), dict(stride=1), False),
        ((2, 4, 5), (4, 3, 3), dict(stride=2, output_padding=1, groups=2), True),
        ((1, 2, 5, 4), (2, 3, 3, 3), dict(padding=1, dilation=2), True),
    ]
    for shape, wshape, kw, transposed in cases:
        for channels_last in (False, True):
            x = torch.randn(shape, generator=g)
            w = torch.randn(wshape, generator=g)
            if channels_last and x.dim() == 4:
                x = x.to(memory_format=torch.channels_last)
            elif channels_last:
                continue
            n = w.dim() - 2
            fn = (F.conv_transpose1d, F.conv_transpose2d, F.conv_transpose3d)[n - 1] \
                if transposed else (F.conv1d, F.conv2d, F.conv3d)[n - 1]
            b = torch.randn(w.shape[1] * kw.get("groups", 1) if transposed else w.shape[0],
                            generator=g)
            outs, grads = [], []
            for dev in ("cpu", "tpu"):
                xi, wi, bi = (t.detach().to(dev).requires_grad_() for t in (x, w, b))
                out = fn(xi, wi, bi, **kw)
                F.mse_loss(out, torch.ones_like(out), reduction="sum").backward()
                outs.append(out)
                grads.append([t.grad for t in (xi, wi, bi)])
            cpu, tpu = outs
            assert tpu.shape == cpu.shape and tpu.stride() == cpu.stride(), \
                (shape, kw, tpu.shape, cpu.shape, tpu.stride(), cpu.stride())
            torch.testing.assert_close(tpu.cpu(), cpu.detach(), rtol=1e-4, atol=1e-4)
            for a, c in zip(grads[1], grads[0]):
                assert a.shape == c.shape
                torch.testing.assert_close(a.cpu(), c, rtol=1e-3, atol=1e-3)
    for make in (lambda d: torch.arange(3, 20, 4, device=d),
                 lambda d: torch.arange(-1, 1, 0.3, dtype=torch.float64, device=d),
                 lambda d: torch.linspace(-2, 2, 7, device=d),
                 lambda d: torch.logspace(0, 2, 3, base=2.0, device=d),
                 lambda d: torch.eye(3, 5, dtype=torch.int32, device=d),
                 lambda d: torch.eye(4, device=d)):
        cpu, tpu = make("cpu"), make("tpu")
        assert tpu.dtype == cpu.dtype and tpu.shape == cpu.shape, (cpu, tpu)
        torch.testing.assert_close(tpu.cpu(), cpu, rtol=1e-6, atol=1e-6)
    a, t = torch.randn(3, 1, 4, generator=g), torch.randn(5, 4, generator=g)
    for reduction in ("none", "mean", "sum"):
        cpu = F.mse_loss(a, t, reduction=reduction)
        tpu = F.mse_loss(a.to("tpu"), t.to("tpu"), reduction=reduction)
        assert tpu.shape == cpu.shape
        torch.testing.assert_close(tpu.cpu(), cpu)


def test_small_float_arithmetic_has_the_cpus_bits(tpud):
    # The simulated chip computes small float32 mul/add/sub itself
    # (small_elementwise.h); every other form goes to ATen. Either way the
    # bits are the CPU's. (XLA's CPU plugin flushes denormals: on PJRT the
    # values are compared, not the bits.)
    run_in_child(tpud, _small_float_arithmetic_has_the_cpus_bits,
                 tpud.backend == "simulated")


def _small_float_arithmetic_has_the_cpus_bits(exact):
    import torch
    import torch_tpu  # noqa: F401
    g = torch.Generator().manual_seed(0)
    x = torch.randn(33, 65, generator=g) * 1e3
    y = torch.randn(33, 65, generator=g).exp()
    x[0, :4] = torch.tensor([float("inf"), float("nan"), -0.0, 1e-42])
    big = torch.randn(300, 300, generator=g)
    cases = [
        lambda a, b: a * b, lambda a, b: a + b, lambda a, b: a - b,
        lambda a, b: a * 0.1, lambda a, b: a + 3, lambda a, b: a - 1e-3,
        lambda a, b: 0.7 * a, lambda a, b: 1 - a, lambda a, b: a * True,
        lambda a, b: torch.add(a, b, alpha=0.3), lambda a, b: torch.sub(a, b, alpha=2),
        lambda a, b: a * b[0], lambda a, b: a[:, ::2] * 2.5, lambda a, b: a.t() + b.t(),
        lambda a, b: a.double() * 0.1, lambda a, b: a.half() + 1,
        lambda a, b: a * torch.tensor(0.1), lambda a, b: a[1:] + a[:-1],
        lambda a, b: a.clone().mul_(b), lambda a, b: a.clone().sub_(0.25),
    ]
    for i, case in enumerate(cases):
        want = case(x, y)
        got = case(x.to("tpu"), y.to("tpu")).cpu()
        assert got.dtype == want.dtype and got.shape == want.shape, i
        assert got.stride() == want.stride(), (i, got.stride(), want.stride())
        if not exact:
            torch.testing.assert_close(got, want, equal_nan=True)
            continue
        same_nans = torch.equal(got.isnan(), want.isnan())
        got, want = got.nan_to_num(), want.nan_to_num()   # NaN payloads aside
        assert same_nans and torch.equal(got.contiguous().view(torch.uint8),
                                         want.contiguous().view(torch.uint8)), i
    tb = big.to("tpu")                     # past the size computed here
    torch.testing.assert_close((tb * 0.1 + 1).cpu(), big * 0.1 + 1, rtol=0, atol=0)
    t = x.to("tpu")
    u = t * 1.5
    t.mul_(1.5)                           # in place: ATen's kernel, same bits
    assert torch.equal(t.cpu().nan_to_num(), u.cpu().nan_to_num())


def test_bad_arguments_raise_at_the_call_in_the_cpus_words(tpud):
    # Output metadata comes from ATen's C++ meta functions (native_meta.cc):
    # an argument they refuse raises at the call with the CPU's message,
    # not later from the daemon, and the process goes on.
    run_in_child(tpud, _bad_arguments_raise_like_cpu)


def _bad_arguments_raise_like_cpu():
    import torch
    import torch_tpu  # noqa: F401
    cases = [
        lambda d: torch.arange(5, device=d).var(),
        lambda d: torch.ones(3, device=d).masked_fill_(torch.ones(3, device=d), 1.0),
        lambda d: torch.ones(3, device=d).masked_fill_(torch.ones(2, 3, dtype=torch.bool, device=d), 1.0),
        lambda d: torch.ones(3, device=d).normal_(0, -1),
        lambda d: torch.ones(3, device=d).uniform_(2, 1),
        lambda d: torch.ones(3, device=d).bernoulli_(1.5),
        lambda d: torch.where(torch.ones(2, device=d), torch.ones(2, device=d), 0.0),
        lambda d: torch.zeros(2, device=d).add_(torch.ones(3, device=d)),
        lambda d: torch.arange(0, 5, -1, device=d),
        lambda d: torch.arange(0, 5, 0, device=d),
        lambda d: torch.linspace(0, 1, -2, device=d),
        lambda d: torch.eye(-1, device=d),
        lambda d: torch.nn.functional.mse_loss(torch.ones(2, 3, device=d),
                                               torch.ones(4, 3, device=d)),
        # Declined by the C++ meta: run at the call, the CPU kernel's error.
        lambda d: torch.nn.functional.conv2d(torch.ones(1, 3, 5, 5, device=d),
                                             torch.ones(4, 2, 3, 3, device=d)),
        lambda d: torch.nn.functional.conv2d(torch.ones(1, 3, 2, 2, device=d),
                                             torch.ones(4, 3, 3, 3, device=d)),
        lambda d: torch.nn.functional.conv1d(torch.ones(1, 4, 5, device=d),
                                             torch.ones(4, 2, 3, device=d), groups=3),
    ]
    for case in cases:
        msgs = []
        for d in ("cpu", "tpu"):
            try:
                case(d)
                msgs.append("no error")
            except RuntimeError as e:
                msgs.append(str(e).split("\n")[0])
        assert msgs[0] != "no error" and msgs[0] == msgs[1], msgs
    x = torch.ones(3, device="tpu")
    assert x.add_(1).cpu().tolist() == [2.0, 2.0, 2.0]  # nothing was poisoned


def test_many_dimensions(tpud):
    """Tensors of up to 64 dimensions, as on the CPU (the record format held
    25 once)."""
    r = run_in_child(tpud, _many_dimensions)
    assert r.stdout.split() == ["ok", "ok"], r.stdout + r.stderr


def _many_dimensions():
    import torch
    import torch_tpu  # noqa: F401
    for ndim in (26, 64):
        shape = [2, 3] + [1] * (ndim - 3) + [2]
        x = torch.arange(12.0).reshape(shape)
        t = x.to("tpu")
        y = (t * 2 + 1).sum(dim=-1, keepdim=True).permute(*reversed(range(ndim)))
        want = (x * 2 + 1).sum(dim=-1, keepdim=True).permute(*reversed(range(ndim)))
        assert y.shape == want.shape and torch.equal(y.cpu(), want), (y.shape, want.shape)
        assert (t.sum() == x.sum()).item()
        print("ok")


def test_out_forms_of_values_and_indices_ops(tpud):
    """mode, sort, max and kthvalue with out=(values, indices) as on the CPU
    (mode's composite out= kernel refused tpu)."""
    if getattr(tpud, "backend", "simulated") != "simulated":
        pytest.skip("mode has no StableHLO lowering on the PJRT backend")
    r = run_in_child(tpud, _out_forms_of_values_and_indices_ops)
    lines = r.stdout.splitlines()
    assert len(lines) == 8 and lines[:4] == lines[4:], r.stdout + r.stderr


def _out_forms_of_values_and_indices_ops():
    import torch
    import torch_tpu  # noqa: F401
    for dev in ("cpu", "tpu"):
        x = torch.tensor([[1., 2., 2., 3.], [4., 4., 5., 5.]], device=dev)

        def outs():
            return (torch.empty(0, device=dev), torch.empty(0, dtype=torch.long, device=dev))
        v, i = outs()
        r = torch.mode(x, 1, out=(v, i))
        assert r[0] is v and r[1] is i
        print(v.cpu().tolist(), i.cpu().tolist())
        v, i = outs()
        torch.sort(x, dim=1, descending=True, stable=True, out=(v, i))
        print(v.cpu().tolist(), i.cpu().tolist())
        v, i = outs()
        torch.max(x, 1, out=(v, i))
        print(v.cpu().tolist(), i.cpu().tolist())
        v, i = outs()
        torch.kthvalue(x, 2, 1, out=(v, i))
        print(v.cpu().tolist(), i.cpu().tolist())
