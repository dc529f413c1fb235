"""tpud --backend=pjrt on XLA's CPU plugin (PyPI xla-cpu-pjrt): ops lowered
to StableHLO, compiled by the plugin, run on its devices."""
import json
import os
import subprocess
import sys

import pytest

from conftest import Daemon, bazel_bin, child_argv, run_in_child, wait_reclaimed

import xla_plugins.xla_cpu_pjrt as _xla_cpu

PLUGIN = os.path.join(os.path.dirname(_xla_cpu.__file__), "xla_cpu_pjrt.so")
PJRT_FLAGS = ["--backend=pjrt", f"--pjrt_plugin={PLUGIN}", "--pjrt_option=cpu_device_count=4"]


@pytest.fixture(scope="module", params=["host", pytest.param("device", marks=pytest.mark.slow)])
def pjrt(request):
    """tpud on the CPU plugin, twice: computing on tpud's arena (what a
    plugin whose devices are the host allows), then with every segment in a
    device buffer, the arena only its host copy (what libtpu needs)."""
    d = Daemon(hbm="512MiB", extra_flags=PJRT_FLAGS + [f"--pjrt_memory={request.param}"])
    d.memory = request.param
    yield d
    d.stop()


def test_ops_match_cpu(pjrt):
    run_in_child(pjrt, _ops_match_cpu)


def _ops_match_cpu():
    import torch
    import torch_tpu  # noqa: F401
    torch.manual_seed(0)
    x, y, w = torch.randn(4, 5), torch.randn(4, 5), torch.randn(5, 3)
    a, b = x.to("tpu"), y.to("tpu")
    checks = {
        "add": (a + b, x + y), "sub alpha": (torch.sub(a, b, alpha=3), torch.sub(x, y, alpha=3)),
        "mul scalar": (a * 2.5, x * 2.5), "div": (a / (b.abs() + 1), x / (y.abs() + 1)),
        "broadcast": (a + b[0], x + y[0]), "expanded": (a * b[:, :1], x * y[:, :1]),
        "transposed": (a.t() + 1, x.t() + 1), "relu": (torch.relu(a), torch.relu(x)),
        "exp": (a.exp(), x.exp()), "tanh": (a.tanh(), x.tanh()), "sigmoid": (a.sigmoid(), x.sigmoid()),
        "pow": (a ** 2, x ** 2), "max": (torch.maximum(a, b), torch.maximum(x, y)),
        "mm": (a @ w.to("tpu"), x @ w), "addmm": (torch.addmm(b[:, :3], a, w.to("tpu"), beta=0.5, alpha=2),
                                              torch.addmm(y[:, :3], x, w, beta=0.5, alpha=2)),
        "sum dim": (a.sum(1), x.sum(1)), "sum keepdim": (a.sum(0, keepdim=True), x.sum(0, keepdim=True)),
        "sum all": (a.sum(), x.sum()), "mean": (a.mean(1), x.mean(1)),
        "to double": (a.double(), x.double()), "int to float": (a.long().float(), x.long().float()),
    }
    for name, (got, want) in checks.items():
        assert got.device.type == "tpu", name
        assert got.dtype == want.dtype, (name, got.dtype, want.dtype)
        assert torch.allclose(got.cpu(), want, atol=1e-5), name
    c = a.clone(); c.add_(b, alpha=2); c.mul_(3)
    assert torch.allclose(c.cpu(), (x + 2 * y) * 3, atol=1e-5)
    z = torch.zeros(3, device="tpu"); z.fill_(7)
    assert z.cpu().tolist() == [7.0, 7.0, 7.0]
    assert abs(a.sum().item() - x.sum().item()) < 1e-4


def _train_like_cpu(case):
    """Five steps of a model on the CPU and on tpu, from the same seed and
    batches: the losses agree within 1e-4. `case` names the model, its
    optimizer, its batches (x, y from generator g) and its loss."""
    import torch
    import torch_tpu  # noqa: F401
    nn = torch.nn
    cases = {
        "mlp": (lambda: nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1)),
                lambda model: torch.optim.SGD(model.parameters(), lr=0.1),
                lambda g: (torch.randn(32, 8, generator=g), torch.randn(32, 1, generator=g)),
                lambda model, x, y: ((model(x) - y) ** 2).mean()),
        "cnn": (lambda: nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                                      nn.Conv2d(8, 8, 3, stride=2, dilation=1), nn.GELU(), nn.Flatten(),
                                      nn.Linear(8, 4)),
                lambda model: torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
                lambda g: (torch.randn(6, 3, 8, 8, generator=g), torch.randint(0, 4, (6,), generator=g)),
                lambda model, x, y: torch.nn.functional.cross_entropy(model(x), y)),
    }
    make_model, make_optimizer, make_batch, loss_of = cases[case]

    def run(dev):
        torch.manual_seed(0)
        model = make_model().to(dev)
        opt = make_optimizer(model)
        g = torch.Generator().manual_seed(1)
        losses = []
        for _ in range(5):
            x, y = make_batch(g)
            x, y = x.to(dev), y.to(dev)
            opt.zero_grad()
            loss = loss_of(model, x, y)
            loss.backward()
            opt.step()
            losses.append(loss.item())
        return losses
    cpu, tpu = run("cpu"), run("tpu")
    for c, t in zip(cpu, tpu):
        assert abs(c - t) < 1e-4 * max(1.0, abs(c)), (cpu, tpu)
    print("losses", tpu)


def test_training_reaches_cpu_losses(pjrt):
    r = run_in_child(pjrt, _train_like_cpu, "mlp")
    assert "losses" in r.stdout


def test_an_op_without_lowering_fails_naming_it_and_the_session_goes_on(pjrt):
    run_in_child(pjrt, _an_op_without_lowering_fails_naming_it_and_the_session_goes_on)


def _an_op_without_lowering_fails_naming_it_and_the_session_goes_on():
    import torch
    import torch_tpu  # noqa: F401
    from torch_tpu import _decomp
    a = torch.ones(4, device="tpu")
    try:
        torch.poisson(torch.ones(4, device="tpu")).cpu()  # neither lowered nor decomposable
        raise SystemExit("poisson ran")
    except RuntimeError as e:
        assert "aten::poisson" in str(e) and "no lowering" in str(e), str(e)
    assert (a + 1).cpu().tolist() == [2.0] * 4

    # A decomposition that reaches its own op again (as a reference whose
    # prim is that op would) is stopped, named, and the session goes on.
    def comes_back(x):
        return guarded(x)

    guarded = _decomp._kernel("aten::some_op", comes_back, 1)
    try:
        guarded(a)
        raise SystemExit("the loop ran")
    except NotImplementedError as e:
        assert "aten::some_op" in str(e), str(e)
        assert "decomposition of it comes back to it" in str(e), str(e)
    assert (a * 3).cpu().tolist() == [3.0] * 4


@pytest.mark.slow
def test_ops_without_lowering_run_as_pytorch_decompositions(pjrt):
    run_in_child(pjrt, _ops_without_lowering_run_as_pytorch_decompositions)


def _ops_without_lowering_run_as_pytorch_decompositions():
    import torch
    import torch_tpu._decomp as decomp
    import torch.nn.functional as F
    torch.manual_seed(0)
    x = torch.randn(2, 3, 8)
    a = x.to("tpu")
    props = torch.tpu.get_device_properties(0)
    assert props.backend == "pjrt" and not props.simulated, props
    assert torch.tpu.get_device_name(0).endswith("(PJRT)"), torch.tpu.get_device_name(0)
    names = decomp.installed()
    assert len(names) > 100 and "aten::hardswish" in names, len(names)
    assert not any(n in names for n in ("aten::add.Tensor", "aten::mm", "aten::empty_strided"))
    checks = {
        "hardswish": (F.hardswish(a), F.hardswish(x)), "logsigmoid": (F.logsigmoid(a), F.logsigmoid(x)),
        "pad reflect": (F.pad(a, (2, 1), mode="reflect"), F.pad(x, (2, 1), mode="reflect")),
        "roll": (torch.roll(a, 2, -1), torch.roll(x, 2, -1)), "normalize": (F.normalize(a), F.normalize(x)),
        "smooth_l1": (F.smooth_l1_loss(a, a * 0.3), F.smooth_l1_loss(x, x * 0.3)),
        "std_mean": (torch.std_mean(a, 1)[1], torch.std_mean(x, 1)[1]),
        # sent whole on the simulated backend, decomposed here
        "group_norm": (F.group_norm(a, 1), F.group_norm(x, 1)),
        "addr": (torch.addr(a[0, 0], a[0, 0], a[1, 0]), torch.addr(x[0, 0], x[0, 0], x[1, 0])),
        # decomposed for the functional overload only: its out= overload,
        # which its composite kernel calls, is neither lowered nor decomposed
        "logit_backward": (torch.ops.aten.logit_backward(a, a.sigmoid(), 0.1),
                           torch.ops.aten.logit_backward(x, x.sigmoid(), 0.1)),
    }
    for name, (got, want) in checks.items():
        assert got.device.type == "tpu", name
        assert torch.allclose(got.cpu(), want, atol=1e-5), name
    # backward through a decomposed out= overload that casts its outs (in
    # float32 it takes the caller's tensor, in bfloat16 a functional one)
    for dt in (torch.float32, torch.bfloat16):
        for loss in (F.smooth_l1_loss, F.huber_loss):
            grads = []
            for dev in ("cpu", "tpu"):
                inp = x.to(dt).to(dev).detach().clone().requires_grad_()
                loss(inp, (x * 0.3).to(dt).to(dev)).backward()
                grads.append(inp.grad.cpu())
            assert torch.allclose(grads[1].float(), grads[0].float(), atol=1e-3), (loss, dt)


@pytest.mark.slow
def test_new_lowerings_match_cpu(pjrt):
    run_in_child(pjrt, _new_lowerings_match_cpu)


def _new_lowerings_match_cpu():
    import torch
    import torch_tpu  # noqa: F401
    import torch.nn.functional as F
    torch.manual_seed(0)
    x, b = torch.randn(5, 6), torch.randn(2, 3, 4)
    a, tb = x.to("tpu"), b.to("tpu")
    ix, iy = torch.tensor([3, -1, 0]), torch.tensor([[1], [0]])
    g = torch.tensor([[0, 1, 2, 3, 4, 0], [4, 3, 2, 1, 0, 1]])
    checks = {
        "flip": (a.flip(0, 1), x.flip(0, 1)), "tril": (a.tril(1), x.tril(1)), "triu": (a.triu(-1), x.triu(-1)),
        "var": (a.var(1, keepdim=True), x.var(1, keepdim=True)), "std": (a.std(0, correction=0), x.std(0, correction=0)),
        "norm": (torch.linalg.vector_norm(a, 3, dim=0), torch.linalg.vector_norm(x, 3, dim=0)),
        "norm inf": (torch.linalg.vector_norm(a, float("inf")), torch.linalg.vector_norm(x, float("inf"))),
        "cumsum": (a.cumsum(1), x.cumsum(1)), "cumprod": (a.cumprod(0), x.cumprod(0)),
        "arange": (torch.arange(0.5, 3, 0.25, device="tpu"), torch.arange(0.5, 3, 0.25)),
        "prod": (a.prod(1), x.prod(1)), "argmin": (a.argmin(1), x.argmin(1)), "min": (a.min(), x.min()),
        "any": ((a > 1).any(), (x > 1).any()), "all": ((a > -1).all(1), (x > -1).all(1)),
        "asinh": (a.asinh(), x.asinh()), "atanh": (a.clamp(-0.9, 0.9).atanh(), x.clamp(-0.9, 0.9).atanh()),
        "softplus": (F.softplus(a), F.softplus(x)), "gelu tanh": (F.gelu(a, approximate="tanh"), F.gelu(x, approximate="tanh")),
        "index_select": (a.index_select(1, (ix % 6).to("tpu")), x.index_select(1, ix % 6)),
        "embedding": (F.embedding(ix.abs().to("tpu"), a), F.embedding(ix.abs(), x)),
        "gather": (a.gather(0, g.to("tpu")), x.gather(0, g)),
        "index": (tb[iy.to("tpu"), :, ix.to("tpu")], b[iy, :, ix]), "index rows": (a[ix.to("tpu")], x[ix]),
        "div floor": (torch.div(a, 0.7, rounding_mode="floor"), torch.div(x, 0.7, rounding_mode="floor")),
        "signbit": (torch.signbit(a), torch.signbit(x)), "pow scalar": (2.0 ** a, 2.0 ** x),
        "mv": (torch.mv(a, a[0]), torch.mv(x, x[0])), "cross entropy": (F.cross_entropy(a, g[0, :5].to("tpu")), F.cross_entropy(x, g[0, :5])),
    }
    for name, (got, want) in checks.items():
        assert got.device.type == "tpu", name
        assert got.dtype == want.dtype and got.shape == want.shape, (name, got.dtype, got.shape)
        assert torch.allclose(got.cpu().double(), want.double(), atol=1e-5), name
    # convolution forward: 1-d to 3-d, stride, padding, dilation, groups, bias
    cx, cw, cb = torch.randn(2, 4, 9, 9), torch.randn(6, 2, 3, 3), torch.randn(6)
    got = F.conv2d(cx.to("tpu"), cw.to("tpu"), cb.to("tpu"), stride=2, padding=1, dilation=2, groups=2)
    assert torch.allclose(got.cpu(), F.conv2d(cx, cw, cb, stride=2, padding=1, dilation=2, groups=2), atol=1e-4)
    c1, w1 = torch.randn(2, 3, 10), torch.randn(5, 3, 4)
    assert torch.allclose(F.conv1d(c1.to("tpu"), w1.to("tpu"), padding=2).cpu(), F.conv1d(c1, w1, padding=2), atol=1e-4)
    c3, w3 = torch.randn(1, 2, 5, 5, 5), torch.randn(3, 2, 2, 2, 2)
    assert torch.allclose(F.conv3d(c3.to("tpu"), w3.to("tpu")).cpu(), F.conv3d(c3, w3), atol=1e-4)
    # scatter, scatter of a value, scatter_add
    z, src = torch.zeros(3, 5), torch.arange(1., 16).reshape(3, 5)
    si = torch.tensor([[0, 1, 2, 0, 0], [2, 0, 0, 1, 2]])
    zt, st, sit = z.to("tpu"), src.to("tpu"), si.to("tpu")
    assert torch.equal(zt.scatter_add(0, sit, st).cpu(), z.scatter_add(0, si, src))
    assert torch.equal(zt.scatter(1, sit % 5, 2.5).cpu(), z.scatter(1, si % 5, 2.5))
    assert torch.equal(zt.scatter(1, sit, st[:2]).cpu(), z.scatter(1, si, src[:2]))
    # convolution backward with stride, padding and dilation
    cg = []
    for dev in ("cpu", "tpu"):
        xg = cx.detach().clone().to(dev).requires_grad_()
        wg = torch.randn(4, 4, 3, 2, generator=torch.Generator().manual_seed(2)).to(dev).requires_grad_()
        F.conv2d(xg, wg, stride=2, padding=2, dilation=2).pow(2).sum().backward()
        cg.append((xg.grad.cpu(), wg.grad.cpu()))
    assert all(torch.allclose(p, q, atol=1e-3, rtol=1e-4) for p, q in zip(*cg))
    # max / min along a dim (values and first indices); max_pool2d runs decomposed onto them
    for got, want in ((a.max(1), x.max(1)), (a.min(0, keepdim=True), x.min(0, keepdim=True))):
        assert torch.equal(got.values.cpu(), want.values) and torch.equal(got.indices.cpu(), want.indices)
    img = torch.randn(2, 3, 8, 8)
    assert torch.allclose(F.max_pool2d(img.to("tpu"), 2).cpu(), F.max_pool2d(img, 2))
    # integer reductions start from the type's own limits
    xi = torch.tensor([[3, -7, 5], [2, 9, 9]], dtype=torch.int32)
    ti = xi.to("tpu")
    for name, f in {"argmin": lambda v: v.argmin(1), "argmax": lambda v: v.argmax(1),
                    "amin": lambda v: v.amin(0), "min": lambda v: v.min()}.items():
        assert torch.equal(f(ti).cpu(), f(xi)), name
    # index_put, plain and accumulating, and embedding's backward (which uses it)
    for acc in (False, True):
        z, zc = torch.zeros(5, 6, device="tpu"), torch.zeros(5, 6)
        z.index_put_((torch.tensor([0, 2, 0]).to("tpu"),), torch.full((3, 6), 2.0, device="tpu"), accumulate=acc)
        zc.index_put_((torch.tensor([0, 2, 0]),), torch.full((3, 6), 2.0), accumulate=acc)
        assert torch.equal(z.cpu(), zc), acc
    tc = b.clone(); tt = tb.clone()
    tc[:, torch.tensor([1, 0]), torch.tensor([3, 1])] = 7.0
    tt[:, torch.tensor([1, 0]).to("tpu"), torch.tensor([3, 1]).to("tpu")] = 7.0
    assert torch.equal(tt.cpu(), tc)
    grads = []
    for dev in ("cpu", "tpu"):
        torch.manual_seed(0)
        e = torch.nn.Embedding(10, 4).to(dev)
        e(torch.tensor([[1, 2, 1], [9, 0, 1]]).to(dev)).pow(2).sum().backward()
        grads.append(e.weight.grad.cpu())
    assert torch.allclose(grads[0], grads[1], atol=1e-6)
    # gelu's tanh form backward
    w = a.clone().requires_grad_(); v = x.clone().requires_grad_()
    F.gelu(w, approximate="tanh").sum().backward(); F.gelu(v, approximate="tanh").sum().backward()
    assert torch.allclose(w.grad.cpu(), v.grad, atol=1e-5)


def test_a_cnn_trains_like_on_cpu(pjrt):
    r = run_in_child(pjrt, _train_like_cpu, "cnn")
    assert "losses" in r.stdout


def test_writes_into_views_with_gaps_keep_the_gaps(pjrt):
    run_in_child(pjrt, _writes_into_views_with_gaps_keep_the_gaps)


def _writes_into_views_with_gaps_keep_the_gaps():
    import torch
    import torch_tpu  # noqa: F401
    x = torch.arange(16.).reshape(4, 4)
    t = x.to("tpu")
    t.diagonal().copy_(torch.tensor([9., 8, 7, 6]).to("tpu"))
    x.diagonal().copy_(torch.tensor([9., 8, 7, 6]))
    t[:, 1].add_(100); x[:, 1].add_(100)
    t[::2, 1::2].mul_(-1); x[::2, 1::2].mul_(-1)
    assert torch.equal(t.cpu(), x)
    y = torch.randn(3, 5)
    assert torch.equal(torch.diag_embed(y.to("tpu")).cpu(), torch.diag_embed(y))


def test_results_written_in_place_and_inputs_that_overlap_them(pjrt):
    # Dense, aligned results are donated and written where they lie; an
    # input sharing bytes with one must still be read as it was before.
    run_in_child(pjrt, _results_written_in_place_and_inputs_that_overlap_them)


def _results_written_in_place_and_inputs_that_overlap_them():
    import torch
    import torch_tpu  # noqa: F401
    torch.manual_seed(0)
    x = torch.randn(8, 8)
    t = x.to("tpu")
    t.add_(t); x.add_(x)
    torch.add(t, 1, out=t); torch.add(x, 1, out=x)
    t[1:].mul_(t[:-1].clone()); x[1:].mul_(x[:-1].clone())
    r = torch.empty(8, 8, device="tpu")
    torch.mm(t, t, out=r)
    assert torch.allclose(r.cpu(), x @ x, rtol=1e-5, atol=1e-4)
    assert torch.equal(t.cpu(), x)
    u = t.view(-1)[3:].clone(); v = x.view(-1)[3:].clone()  # unaligned offsets, copied back
    t.view(-1)[3:].sub_(u.mul(2)); x.view(-1)[3:].sub_(v.mul(2))
    assert torch.equal(t.cpu(), x)


def test_sort_median_mode_and_special_functions_match_cpu(pjrt):
    run_in_child(pjrt, _sort_median_mode_and_special_functions_match_cpu)


def _sort_median_mode_and_special_functions_match_cpu():
    import torch
    import torch_tpu  # noqa: F401
    torch.manual_seed(0)
    x = torch.randn(6, 7)
    x[2, 3] = float("nan")
    a = x.to("tpu")
    for desc in (False, True):
        v, i = torch.sort(a, dim=1, descending=desc, stable=True)
        ev, ei = torch.sort(x, dim=1, descending=desc, stable=True)
        assert torch.allclose(v.cpu(), ev, equal_nan=True)
        assert torch.equal(i.cpu(), ei)
    v, i = a.topk(3, 0); ev, ei = x.topk(3, 0)
    assert torch.allclose(v.cpu(), ev, equal_nan=True) and torch.equal(i.cpu(), ei)
    for f in (torch.median, torch.nanmedian):
        v, i = f(a, 1); ev, ei = f(x, 1)
        assert torch.allclose(v.cpu(), ev, equal_nan=True) and torch.equal(i.cpu(), ei), f
        assert torch.allclose(f(a).cpu(), f(x), equal_nan=True), f
    # mode: the most frequent value (the smallest of a tie) and a position
    # holding it (which one is CPU's unstable sort's choice)
    m = torch.randint(0, 4, (5, 9)).float()
    for dim in (0, 1):
        v, i = torch.mode(m.to("tpu"), dim)
        assert torch.equal(v.cpu(), torch.mode(m, dim).values), (dim, v.cpu())
        assert torch.equal(m.gather(dim, i.cpu().unsqueeze(dim)).squeeze(dim), v.cpu()), dim
    # histogram: bins over the data's span, a range, given edges, weights,
    # density, all-equal data
    h = torch.randn(500)
    for data, args, kw in ((h, (13,), {}), (h, (7,), dict(range=(-1.0, 0.5), density=True)),
                           (h, (torch.tensor([-2.0, -0.5, 0.0, 0.3, 3.0]),),
                            dict(weight=torch.rand(500))),
                           (torch.ones(6), (4,), {})):
        want = torch.histogram(data, *args, **kw)
        got = torch.histogram(data.to("tpu"), *[v.to("tpu") if isinstance(v, torch.Tensor) else v
                                                 for v in args],
                              **{k: v.to("tpu") if isinstance(v, torch.Tensor) else v
                                 for k, v in kw.items()})
        assert torch.allclose(got.hist.cpu(), want.hist, atol=1e-5), (args, kw)
        assert torch.allclose(got.bin_edges.cpu(), want.bin_edges, atol=1e-6), (args, kw)
    s = torch.sort(torch.randn(10))[0]
    q = torch.randn(4, 3)
    assert torch.equal(torch.searchsorted(s.to("tpu"), q.to("tpu")).cpu(), torch.searchsorted(s, q))
    p = torch.rand(20) * 6 + 0.1
    for name, fn in {"lgamma": torch.lgamma, "digamma": torch.digamma, "erfinv": lambda z: torch.erfinv(z / 7),
                     "polygamma 2": lambda z: torch.polygamma(2, z), "hypot": lambda z: torch.hypot(z, z - 3)}.items():
        assert torch.allclose(fn(p.to("tpu")).cpu(), fn(p), rtol=1e-4, atol=1e-5), name
    assert torch.isinf(torch.digamma(torch.zeros(1, device="tpu"))).all()
    # Integers: rounding keeps them, sign of bool and uint8, shifts past the
    # width (and negative) as ATen's kernels.
    for dtype in (torch.int64, torch.int32, torch.uint8, torch.bool):
        k = torch.tensor([0, 1, 5, 200, 3]).to(dtype)
        for fn in (torch.floor, torch.ceil, torch.round, torch.trunc, torch.sign):
            if dtype == torch.bool and fn is not torch.sign:
                continue  # (CPU refuses those for bool)
            assert torch.equal(fn(k.to("tpu")).cpu(), fn(k)), (fn, dtype)
    g, h = torch.tensor([12, -18, 0, 0, 7, 1071, -5]), torch.tensor([18, 12, 0, 9, 0, 462, -15])
    for dtype in (torch.int64, torch.int32, torch.uint8):
        x, y = g.to(dtype), h.to(dtype)
        for fn in (torch.gcd, torch.lcm, lambda u, _: u.abs()):
            assert torch.equal(fn(x.to("tpu"), y.to("tpu")).cpu(), fn(x, y)), (fn, dtype)
    # Empty operands are constants: an empty index_add and a (2, 0) @ (0, 3).
    assert torch.equal(torch.zeros(3, device="tpu").index_add(
        0, torch.zeros(0, dtype=torch.long, device="tpu"), torch.zeros(0, device="tpu")).cpu(),
        torch.zeros(3))
    e = torch.zeros(2, 0, dtype=torch.long, device="tpu") @ torch.zeros(0, 3, dtype=torch.long,
                                                                        device="tpu")
    assert torch.equal(e.cpu(), torch.zeros(2, 3, dtype=torch.long))
    for dtype in (torch.int64, torch.int32, torch.uint8):
        a = torch.tensor([-7, 5, 100, -1, 3, 9]).to(dtype)
        by = torch.tensor([1, 3, 70, 65, -2, 7]).to(dtype)
        for fn in (torch.bitwise_left_shift, torch.bitwise_right_shift):
            assert torch.equal(fn(a.to("tpu"), by.to("tpu")).cpu(), fn(a, by)), (fn, dtype)
        assert torch.equal((a.to("tpu") << 2).cpu(), a << 2) and torch.equal((a.to("tpu") >> 1).cpu(), a >> 1)
    inf = float("inf")
    u, v = torch.tensor([-inf, inf, -inf, 1.0, 3.0]), torch.tensor([-inf, inf, 2.0, -inf, 3.0])
    for fn in (torch.logaddexp, torch.logaddexp2):  # equal infinities give themselves
        assert torch.equal(fn(u.to("tpu"), v.to("tpu")).cpu(), fn(u, v)), fn
    # trigamma near its poles: ATen's float32 algorithm (its rounding of
    # pi x included), so CPU's figures to the last few bits.
    z = torch.tensor([-7.9506, -3.0337, -3.9730, 0.3, 2.5, 40.0])
    assert torch.allclose(torch.polygamma(1, z.to("tpu")).cpu(), torch.polygamma(1, z),
                          rtol=1.3e-6, atol=1e-5)
    # The incomplete gamma functions: each method's region, and the edges.
    a = torch.cat([torch.rand(60) * 10, torch.tensor([0.0, 0.0, 1.0, float("inf"), -1.0, 2.0, 30.0])])
    x = torch.cat([torch.rand(60) * 12, torch.tensor([0.0, 1.0, 0.0, 1.0, 1.0, float("nan"), 31.0])])
    for fn in (torch.igamma, torch.igammac):
        for dtype in (torch.float32, torch.float64):
            got = fn(a.to("tpu", dtype), x.to("tpu", dtype)).cpu()
            assert torch.allclose(got, fn(a.to(dtype), x.to(dtype)), rtol=1.3e-6, atol=1e-6,
                                  equal_nan=True), (fn, dtype)
    n = torch.tensor([1.0, float("nan"), 3.0])
    assert torch.allclose(torch.fmax(n.to("tpu"), n.flip(0).to("tpu")).cpu(), torch.fmax(n, n.flip(0)), equal_nan=True)


@pytest.mark.slow
def test_ffts_linear_algebra_and_polynomials_match_cpu(pjrt):
    # FFTs (complex results), LU / QR / Cholesky and what is built on them
    # (each a while loop in one program), the orthogonal polynomials.
    run_in_child(pjrt, _ffts_linear_algebra_and_polynomials_match_cpu)


def _ffts_linear_algebra_and_polynomials_match_cpu():
    import torch
    import torch_tpu  # noqa: F401
    torch.manual_seed(0)
    x = torch.randn(3, 8)
    a = torch.randn(2, 4, 4) + 4 * torch.eye(4)
    b = torch.randn(2, 4, 3)
    spd = a @ a.mT + torch.eye(4)
    n = torch.randint(0, 9, (3, 8)).float()
    t = lambda v: v.to("tpu")
    checks = {
        "fft": (torch.fft.fft(t(x)), torch.fft.fft(x)),
        "rfft2": (torch.fft.rfft2(t(x)), torch.fft.rfft2(x)),
        "irfft ortho": (torch.fft.irfft(t(x), norm="ortho"), torch.fft.irfft(x, norm="ortho")),
        "ifft of complex": (torch.fft.ifft(torch.fft.fft(t(x))), torch.fft.ifft(torch.fft.fft(x))),
        "solve": (torch.linalg.solve(t(a), t(b)), torch.linalg.solve(a, b)),
        "inv": (torch.linalg.inv(t(a)), torch.linalg.inv(a)),
        "det": (torch.linalg.det(t(a)), torch.linalg.det(a)),
        "slogdet": (torch.linalg.slogdet(t(a))[1], torch.linalg.slogdet(a)[1]),
        "lu_factor": (torch.linalg.lu_factor(t(a))[0], torch.linalg.lu_factor(a)[0]),
        "pivots": (torch.linalg.lu_factor(t(a))[1], torch.linalg.lu_factor(a)[1]),
        "lu_solve right": (torch.linalg.lu_solve(*torch.linalg.lu_factor(t(a)), t(b).mT, left=False),
                           torch.linalg.lu_solve(*torch.linalg.lu_factor(a), b.mT, left=False)),
        "lu_solve right adjoint": (
            torch.linalg.lu_solve(*torch.linalg.lu_factor(t(a)), t(b).mT, left=False, adjoint=True),
            torch.linalg.lu_solve(*torch.linalg.lu_factor(a), b.mT, left=False, adjoint=True)),
        "qr q": (torch.linalg.qr(t(a))[0], torch.linalg.qr(a)[0]),
        "qr r": (torch.linalg.qr(t(a))[1], torch.linalg.qr(a)[1]),
        "cholesky": (torch.linalg.cholesky(t(spd)), torch.linalg.cholesky(spd)),
        "cholesky_solve": (torch.cholesky_solve(t(b), torch.linalg.cholesky(t(spd))),
                           torch.cholesky_solve(b, torch.linalg.cholesky(spd))),
        "triangular": (torch.linalg.solve_triangular(t(a).triu(), t(b), upper=True),
                       torch.linalg.solve_triangular(a.triu(), b, upper=True)),
        "chebyshev_t": (torch.special.chebyshev_polynomial_t(t(x), t(n)), torch.special.chebyshev_polynomial_t(x, n)),
        "hermite_h": (torch.special.hermite_polynomial_h(t(x), t(n)), torch.special.hermite_polynomial_h(x, n)),
        "legendre_p": (torch.special.legendre_polynomial_p(t(x), t(n)), torch.special.legendre_polynomial_p(x, n)),
    }
    for name, (got, want) in checks.items():
        assert got.device.type == "tpu" and got.dtype == want.dtype, (name, got.dtype, want.dtype)
        torch.testing.assert_close(got.cpu(), want, rtol=1e-4, atol=1e-4, msg=name)
    # det and slogdet factor A^T for a row-major A, as ATen does, and their
    # gradients (which solve with that LU) match; so for a column-major A.
    for m in (a, a.mT.contiguous().mT):
        for op in (torch.ops.aten._linalg_det, torch.ops.aten._linalg_slogdet):
            torch.testing.assert_close([r.cpu() for r in op(t(m))], list(op(m)), msg=str(op))
        got, want = t(m).requires_grad_(), m.clone().requires_grad_()
        (torch.linalg.det(got).sum() + torch.linalg.slogdet(got)[1].sum()).backward()
        (torch.linalg.det(want).sum() + torch.linalg.slogdet(want)[1].sum()).backward()
        torch.testing.assert_close(got.grad.cpu(), want.grad, rtol=1e-4, atol=1e-4)
    # matrix_exp: per-matrix scaling (norms from 0.01 to 100), float64 to
    # CPU's digits, float32 within its rounding of the float64 result.
    e = torch.randn(4, 3, 3) * torch.tensor([0.01, 1.0, 5.0, 100.0]).view(4, 1, 1)
    want = torch.linalg.matrix_exp(e.double())
    torch.testing.assert_close(torch.linalg.matrix_exp(t(e.double())).cpu(), want,
                               rtol=1e-12, atol=0)
    got = torch.linalg.matrix_exp(t(e)).cpu().double()
    assert ((got - want).abs().amax((-2, -1)) / want.abs().amax((-2, -1))).max() < 1e-5
    # A singular matrix: info names the first zero pivot, as LAPACK's.
    s = torch.tensor([[1.0, 2.0], [2.0, 4.0]])
    assert torch.linalg.lu_factor_ex(t(s)).info.item() == torch.linalg.lu_factor_ex(s).info.item() == 2


def test_eigh_and_svd_match_cpu_up_to_the_vectors_signs(pjrt):
    run_in_child(pjrt, _eigh_and_svd_match_cpu_up_to_the_vectors_signs)


def _eigh_and_svd_match_cpu_up_to_the_vectors_signs():
    import torch
    import torch_tpu  # noqa: F401
    torch.manual_seed(0)
    close = torch.testing.assert_close
    for shape in [(4, 4), (2, 5, 5), (0, 3, 3)]:
        a = torch.randn(*shape)
        a = a + a.mT
        for uplo in "LU":
            w, v = torch.linalg.eigh(a, UPLO=uplo)
            wt, vt = torch.linalg.eigh(a.to("tpu"), UPLO=uplo)
            close(wt.cpu(), w)
            close(vt.cpu().abs(), v.abs())  # each eigenvector up to its sign
    for shape in [(3, 3), (5, 3), (2, 3, 4), (0, 2)]:
        a = torch.randn(*shape, dtype=torch.float64)
        for full in (False, True):
            u, s, vh = torch.linalg.svd(a, full_matrices=full)
            ut, st, vht = torch.linalg.svd(a.to("tpu"), full_matrices=full)
            close(st.cpu(), s)
            assert (ut.shape, vht.shape) == (u.shape, vh.shape)
            k = s.shape[-1]
            close(((ut[..., :k] * st.unsqueeze(-2)) @ vht[..., :k, :]).cpu(), a)
            close(ut[..., :k].cpu().abs(), u[..., :k].abs())
    a = torch.randn(4, 3)
    close(torch.linalg.pinv(a.to("tpu")).cpu(), torch.linalg.pinv(a), atol=1e-5, rtol=1e-4)
    close(torch.linalg.matrix_norm(a.to("tpu"), ord="nuc").cpu(), torch.linalg.matrix_norm(a, ord="nuc"))
    x = a.to("tpu").requires_grad_()
    torch.linalg.svdvals(x).sum().backward()
    y = a.clone().requires_grad_()
    torch.linalg.svdvals(y).sum().backward()
    close(x.grad.cpu(), y.grad, atol=1e-5, rtol=1e-4)


def test_bessel_functions_ndtri_and_erfcx_match_cpu(pjrt):
    run_in_child(pjrt, _bessel_functions_ndtri_and_erfcx_match_cpu)


def _bessel_functions_ndtri_and_erfcx_match_cpu():
    import torch
    import torch_tpu  # noqa: F401
    inf, nan = float("inf"), float("nan")
    # (Not 89 < |x| < 94: there float32 ATen overflows exp(|x|) to inf where
    # I0 itself is finite; tpu computes in float64 and gives the value.)
    x = torch.tensor([0.0, 0.3, -1.5, 7.9, 8.1, -20.0, 80.0, 30.0, -30.0, inf, -inf, nan])
    p = torch.tensor([0.0, 1e-7, 0.003, 0.5, 0.97, 1.0, -0.1, 1.5, nan])
    for dt in (torch.float32, torch.float64):
        for f, v in ((torch.i0, x), (torch.special.i0e, x), (torch.special.i1, x),
                     (torch.special.i1e, x), (torch.special.modified_bessel_i0, x),
                     (torch.special.modified_bessel_i1, x), (torch.special.erfcx, x),
                     (torch.special.log_ndtr, x), (torch.special.ndtri, p)):
            v = v.to(dt)
            torch.testing.assert_close(f(v.to("tpu")).cpu(), f(v), equal_nan=True,
                                       msg=lambda m: f"{f.__name__} {dt}: {m}")
    # J0, J1, Y0, Y1, K0, K1 (and scaled K): both sides of where the
    # approximations change (|x| = 5 for J and Y, x = 2 for K), zero (a pole
    # of Y and K), negative x (NaN for Y and K), far out, inf and NaN.
    s = torch.cat([torch.linspace(-40, 40, 161), torch.tensor(
        [0.0, 1e-6, -1e-6, 1.9999, 2.0, 2.0001, 4.9999, 5.0, 5.0001, 700.0, inf, -inf, nan])])
    sp = torch.special
    for dt in (torch.float32, torch.float64):
        v = s.to(dt)
        for f in (sp.bessel_j0, sp.bessel_j1, sp.bessel_y0, sp.bessel_y1, sp.modified_bessel_k0,
                  sp.modified_bessel_k1, sp.scaled_modified_bessel_k0, sp.scaled_modified_bessel_k1):
            torch.testing.assert_close(f(v.to("tpu")).cpu(), f(v), equal_nan=True,
                                       atol=1e-6 if dt == torch.float32 else 1e-12,
                                       rtol=1e-5 if dt == torch.float32 else 1e-10,
                                       msg=lambda m: f"{f.__name__} {dt}: {m}")
        # Airy's Ai: its three forms meet at -2.09 and 2.09; 0 past 103.892.
        # (CPU's float32 rounds the phase of the oscillating form, far out,
        # to a float: 1e-6 off there.)
        a = torch.cat([torch.linspace(-30, 30, 121), torch.tensor(
            [-2.0901, -2.09, 2.0899, 2.09, 104.0, inf, -inf, nan])]).to(dt)
        torch.testing.assert_close(sp.airy_ai(a.to("tpu")).cpu(), sp.airy_ai(a), equal_nan=True,
                                   atol=1e-5 if dt == torch.float32 else 1e-12,
                                   rtol=1e-5 if dt == torch.float32 else 1e-10)


def test_half_precision_results_of_decomposed_ops_reach_their_tensor(pjrt):
    run_in_child(pjrt, _half_precision_results_of_decomposed_ops_reach_their_tensor)


def _half_precision_results_of_decomposed_ops_reach_their_tensor():
    # PyTorch's decompositions of these pads compute in float32 and convert
    # every tensor argument, out= ones too: the result must still reach the
    # bfloat16 / float16 tensor the op returns.
    import torch
    import torch.nn.functional as F
    import torch_tpu  # noqa: F401
    x = torch.randn(2, 3, 6)
    for dt in (torch.bfloat16, torch.float16, torch.float32):
        for mode in ("replicate", "reflect"):
            want = F.pad(x.to(dt), (2, 1), mode=mode)
            got = F.pad(x.to(dt).to("tpu"), (2, 1), mode=mode)
            assert got.dtype == dt and torch.equal(got.cpu(), want), (dt, mode)
        out = torch.empty(0, dtype=dt, device="tpu")
        torch.ops.aten.replication_pad1d.out(x.to(dt).to("tpu"), [1, 2], out=out)
        assert torch.equal(out.cpu(), torch.ops.aten.replication_pad1d(x.to(dt), [1, 2]))


def test_half_precision_convolution_gradients(pjrt):
    run_in_child(pjrt, _half_precision_convolution_gradients)


def _half_precision_convolution_gradients():
    # convolution_backward computes a bfloat16 / float16 gradient in float32
    # like every op (its program once mixed the two types and did not
    # compile); the gradients come within the type's rounding of CPU's.
    import torch
    import torch_tpu  # noqa: F401
    torch.manual_seed(0)
    x, w = torch.randn(2, 3, 6, 6), torch.randn(4, 3, 3, 3)
    for dt in (torch.bfloat16, torch.float16):
        for transposed in (False, True):
            conv = torch.nn.functional.conv_transpose2d if transposed else torch.nn.functional.conv2d
            weight = w.transpose(0, 1).contiguous() if transposed else w
            got = [x.to(dt).to("tpu").requires_grad_(), weight.to(dt).to("tpu").requires_grad_()]
            want = [x.to(dt).requires_grad_(), weight.to(dt).requires_grad_()]
            conv(*got, padding=1).square().sum().backward()
            conv(*want, padding=1).square().sum().backward()
            for g, c in zip(got, want):
                assert g.grad.dtype == dt
                torch.testing.assert_close(g.grad.cpu().float(), c.grad.float(), rtol=0.05, atol=0.5)


def test_half_precision_softmax_is_computed_in_float32(pjrt):
    run_in_child(pjrt, _half_precision_softmax_is_computed_in_float32)


def _half_precision_softmax_is_computed_in_float32():
    # A row led by 8.375 has a sum of exponentials of 1.0038 after the max is
    # taken out: rounded to bfloat16 before the log, that is 1 and the log 0.
    # softmax, log_softmax and their gradients round once, from float32.
    import torch
    import torch_tpu  # noqa: F401
    torch.manual_seed(0)
    x = torch.cat([torch.tensor([[8.375, 2.875, 1.0, -3.0, 0.5]]), torch.randn(3, 5) * 4])
    g = torch.randn(4, 5)
    for dt in (torch.bfloat16, torch.float16):
        for f in (torch.log_softmax, torch.softmax):
            got = x.to(dt).to("tpu").requires_grad_()
            want = x.to(dt).double().requires_grad_()
            y, y64 = f(got, 1), f(want, 1)
            y.backward(g.to(dt).to("tpu"))
            y64.backward(g.double())
            assert y.dtype == dt and got.grad.dtype == dt
            # Within the type's rounding of the float64 result, element by element.
            tol = dict(rtol=2 ** -7 if dt == torch.bfloat16 else 2 ** -10, atol=1e-5)
            torch.testing.assert_close(y.cpu().double(), y64.detach(), **tol)
            torch.testing.assert_close(got.grad.cpu().double(), want.grad, rtol=tol["rtol"] * 2,
                                       atol=1e-3)
        assert torch.log_softmax(x.to(dt).to("tpu"), 1)[0, 0].item() < 0


def test_logcumsumexp_results_feed_later_ops_and_complex_log_ops(pjrt):
    run_in_child(pjrt, _logcumsumexp_results_feed_later_ops_and_complex_log_ops)


def _logcumsumexp_results_feed_later_ops_and_complex_log_ops():
    # _logcumsumexp has no meta kernel: tpud sizes and allocates its result.
    # With device memory that result once stayed behind on the device where
    # the next op did not find it, and read as zeros from then on.
    import torch
    import torch_tpu  # noqa: F401
    torch.manual_seed(0)
    x = torch.randn(5, 3)
    want = torch.logcumsumexp(x, 0)
    r = torch.logcumsumexp(x.to("tpu"), 0)
    torch.testing.assert_close((r * 2).cpu(), want * 2)
    torch.testing.assert_close(r.cpu(), want)
    xt = x.to("tpu").requires_grad_()
    torch.logcumsumexp(xt, 1).sum().backward()
    xc = x.clone().requires_grad_()
    torch.logcumsumexp(xc, 1).sum().backward()
    torch.testing.assert_close(xt.grad.cpu(), xc.grad)
    # Complex asinh (odd, exact near 0), logaddexp and logcumsumexp, as CPU.
    z = torch.complex(torch.randn(4, 6) * 3, torch.randn(4, 6) * 3)
    z[0, 0] = complex(1e-4, -2e-4)
    w = torch.complex(torch.randn(4, 6), torch.randn(4, 6))
    torch.testing.assert_close(torch.asinh(z.to("tpu")).cpu(), torch.asinh(z))
    torch.testing.assert_close(torch.logaddexp(z.to("tpu"), w.to("tpu")).cpu(),
                               torch.logaddexp(z, w))
    torch.testing.assert_close(torch.logcumsumexp(z.to("tpu"), 1).cpu(),
                               torch.logcumsumexp(z, 1))


def test_zeta_at_its_poles_and_below_one_follows_aten(pjrt):
    run_in_child(pjrt, _zeta_at_its_poles_and_below_one_follows_aten)


def _zeta_at_its_poles_and_below_one_follows_aten():
    # x == 1 and a pole (q a non-positive integer) with x > 1 are +inf,
    # x < 1 is NaN, as ATen's kernel; integer and bool inputs promote.
    import torch
    import torch_tpu  # noqa: F401
    x = torch.tensor([1.0, 1.0, 2.0, 3.0, 0.5, 0.0, -2.0, 2.0, 2.0, 3.0])
    q = torch.tensor([0.0, -2.0, -1.0, -2.0, 1.0, -3.0, -1.0, -1.5, 2.0, 0.5])
    for dt in (torch.float32, torch.float64, torch.int64):
        want = torch.special.zeta(x.to(dt), q.to(dt))
        got = torch.special.zeta(x.to(dt).to("tpu"), q.to(dt).to("tpu")).cpu()
        torch.testing.assert_close(got, want, equal_nan=True)
    b = torch.tensor([False, True, False, True])
    c = torch.tensor([False, False, True, True])
    torch.testing.assert_close(torch.special.zeta(b.to("tpu"), c.to("tpu")).cpu(),
                               torch.special.zeta(b, c), equal_nan=True)


def test_data_dependent_results_and_index_errors(pjrt):
    # nonzero, boolean masks and unique size their results from the data (in
    # memory tpud allocates and charges to the session); an index out of
    # range is an error naming the op, and the session goes on.
    run_in_child(pjrt, _data_dependent_results_and_index_errors)


def _data_dependent_results_and_index_errors():
    import torch
    import torch_tpu  # noqa: F401
    torch.manual_seed(0)
    x = torch.randn(5, 6)
    m = x > 0.3
    t, tm = x.to("tpu"), m.to("tpu")
    assert torch.equal(torch.nonzero(t).cpu(), torch.nonzero(x))
    assert torch.equal(t[tm].cpu(), x[m])
    assert torch.equal(t[tm[:, 0]].cpu(), x[m[:, 0]])
    assert torch.equal(torch.masked_select(t, tm).cpu(), torch.masked_select(x, m))
    v = torch.tensor([3, 1, 3, 2, 1, 1])
    for got, want in zip(torch.unique(v.to("tpu"), return_inverse=True, return_counts=True),
                         torch.unique(v, return_inverse=True, return_counts=True)):
        assert torch.equal(got.cpu(), want), (got, want)
    y = t.clone(); y[tm] = 0.0; x2 = x.clone(); x2[m] = 0.0
    assert torch.equal(y.cpu(), x2)
    # An empty index of another rank scatters nothing (gather's backward).
    e = torch.ones(5, device="tpu").scatter_add(0, torch.zeros(2, 0, dtype=torch.long, device="tpu"),
                                                torch.ones(2, 0, device="tpu"))
    assert e.cpu().tolist() == [1.0] * 5
    # x[mask] = values, one value per selected row (or element), and += .
    rows, n = m[:, 0], int(m.sum())
    vr, ve = torch.randn(int(rows.sum()), 6), torch.randn(n)
    for mask, values, acc in ((rows, vr, False), (rows, vr, True), (m, ve, False)):
        y, x2 = t.clone(), x.clone()
        y.index_put_((mask.to("tpu"),), values.to("tpu"), accumulate=acc)
        x2.index_put_((mask,), values, accumulate=acc)
        assert torch.equal(y.cpu(), x2), (mask.shape, acc)
    y = t.clone()
    y[tm] = torch.ones(n + 1, device="tpu")  # one value too many
    try:
        y.cpu()
        raise AssertionError("no error")
    except RuntimeError as e:
        assert "shape mismatch" in str(e), e
    assert torch.nonzero(torch.zeros(3, device="tpu")).shape == (0, 1)
    for bad in (lambda: t.index_select(0, torch.tensor([0, 9], device="tpu")),
                lambda: t[torch.tensor([7], device="tpu")],
                lambda: torch.gather(t, 1, torch.tensor([[6]], device="tpu"))):
        try:
            bad().cpu()
            raise AssertionError("no error")
        except RuntimeError as e:
            assert "out of" in str(e) and "aten::" in str(e), e
    assert (t + 1).sum().item() == (x + 1).sum().item() or abs((t + 1).sum().item() - (x + 1).sum().item()) < 1e-4


def test_random_ops_repeat_under_manual_seed_and_have_their_distribution(pjrt):
    run_in_child(pjrt, _random_ops_repeat_under_manual_seed_and_have_their_distribution)


def _random_ops_repeat_under_manual_seed_and_have_their_distribution():
    import torch
    import torch_tpu  # noqa: F401
    torch.tpu.manual_seed(1)
    u = torch.rand(1000, 100, device="tpu"); n = torch.randn(1000, 100, device="tpu")
    torch.tpu.manual_seed(1)
    assert torch.equal(torch.rand(1000, 100, device="tpu").cpu(), u.cpu())
    assert not torch.equal(torch.rand(1000, 100, device="tpu").cpu(), u.cpu())
    assert 0 <= u.min().item() and u.max().item() < 1 and abs(u.mean().item() - 0.5) < 0.01
    assert abs(n.mean().item()) < 0.01 and abs(n.std().item() - 1) < 0.01
    r = torch.randint(3, 9, (10000,), device="tpu")
    assert r.min().item() == 3 and r.max().item() == 8
    y = torch.nn.functional.dropout(torch.ones(10000, device="tpu"), 0.3)
    assert abs((y == 0).float().mean().item() - 0.3) < 0.03
    assert abs(torch.bernoulli(torch.full((10000,), 0.2, device="tpu")).mean().item() - 0.2) < 0.03
    # multinomial: a zero weight is never drawn; frequencies follow the
    # weights with replacement; without it, k distinct categories
    w = torch.tensor([[0.1, 0.0, 0.6, 0.3], [1.0, 1.0, 1.0, 1.0]], device="tpu")
    draws = torch.multinomial(w, 20000, replacement=True).cpu()
    freq = torch.stack([torch.bincount(r, minlength=4) for r in draws]).float() / 20000
    assert torch.allclose(freq, (w / w.sum(1, keepdim=True)).cpu(), atol=0.02), freq
    picks = torch.multinomial(w, 3).cpu()
    assert all(len(set(r.tolist())) == 3 for r in picks) and 1 not in picks[0].tolist(), picks
    torch.tpu.manual_seed(3)
    first = torch.multinomial(w, 2).cpu()
    torch.tpu.manual_seed(3)
    assert torch.equal(torch.multinomial(w, 2).cpu(), first)


@pytest.mark.slow
def test_two_processes_share_the_devices(pjrt):
    procs = [subprocess.Popen(child_argv(_tanh_chain_on_chip, c), env=pjrt.env(),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for c in (0, 1)]
    for c, p in enumerate(procs):
        out, _ = p.communicate(timeout=120)
        assert p.returncode == 0 and f"ok {c}" in out, out[-3000:]


def _tanh_chain_on_chip(chip):
    import torch
    import torch_tpu  # noqa: F401
    torch.manual_seed(chip)
    x = torch.randn(64, 64)
    a = x.to(f"tpu:{chip}")
    for _ in range(20):
        a = torch.tanh(a @ a.t() / 64)
        x = torch.tanh(x @ x.t() / 64)
    assert torch.allclose(a.cpu(), x, atol=1e-4)
    print("ok", chip)


def test_status_shows_the_plugin_and_its_api_version(pjrt):
    tpuctl = bazel_bin("tools/tpuctl/tpuctl")
    text = subprocess.run([tpuctl, f"--admin_socket={pjrt.admin_socket}", "status"],
                          capture_output=True, text=True, timeout=30)
    assert text.returncode == 0, text.stderr
    assert "PJRT API 0." in text.stdout.splitlines()[0], text.stdout
    j = subprocess.run([tpuctl, f"--admin_socket={pjrt.admin_socket}", "status", "--json"],
                       capture_output=True, text=True, timeout=30)
    backend = json.loads(j.stdout)["daemon"]["backend"]
    assert backend["kind"] == "pjrt"
    assert backend["pjrt_api_version"].startswith("0.")
    assert backend["platform"] == "cpu"
    assert backend["plugin_path"] == PLUGIN


@pytest.mark.parametrize("flags,message", [
    (["--pjrt_plugin=/nonexistent/libtpu.so"], "cannot load PJRT plugin /nonexistent/libtpu.so"),
    (["--pjrt_plugin=libm.so.6"], "exports no GetPjrtApi"),
    ([f"--pjrt_plugin={PLUGIN}", "--pjrt_option=cpu_device_count=2"], "has 2 devices"),
    ([f"--pjrt_plugin={PLUGIN}", "--pjrt_option=cpu_device_count=int64:x"], "is not a int64"),
    ([], "needs --pjrt_plugin"),
])
def test_a_bad_plugin_keeps_tpud_from_starting_with_its_message(tmp_path, flags, message):
    r = subprocess.run([bazel_bin("daemon/tpud"), "--backend=pjrt", *flags,
                        f"--socket={tmp_path}/t.sock", f"--admin_socket={tmp_path}/a.sock",
                        "--hbm_bytes=64MiB"], capture_output=True, text=True, timeout=60)
    assert r.returncode != 0
    assert message in r.stderr, r.stderr[-2000:]


def test_libtpu_without_a_tpu_fails_fast_and_leaves_no_lockfile(tmp_path):
    # libtpu (PyPI, installed by the setup step) on a machine without a TPU:
    # with TPU_SKIP_MDS_QUERY=1 client creation fails at once and tpud
    # refuses to start with libtpu's message; without it libtpu waits for
    # the cloud metadata server, and tpud gives up after
    # --pjrt_probe_timeout. Neither leaves libtpu's lockfile behind.
    libtpu = pytest.importorskip("libtpu")
    plugin = os.path.join(os.path.dirname(libtpu.__file__), "libtpu.so")
    lockfile = "/tmp/libtpu_lockfile"
    if os.path.exists(lockfile):
        pytest.skip(f"{lockfile} exists already (another libtpu user on this machine?)")
    for env, flags, message, limit in (
            ({"TPU_SKIP_MDS_QUERY": "1"}, [], "No jellyfish device found", 30),
            ({}, ["--pjrt_probe_timeout=3s"], "did not come up within 3s", 30)):
        cmd = [bazel_bin("daemon/tpud"), f"--socket={tmp_path}/t.sock", f"--admin_socket={tmp_path}/a.sock",
               "--hbm_bytes=1GiB", "--backend=pjrt", f"--pjrt_plugin={plugin}"] + flags
        e = dict(os.environ)
        e.pop("TPU_SKIP_MDS_QUERY", None)
        e.update(env)
        r = subprocess.run(cmd, env=e, capture_output=True, text=True, timeout=limit)
        assert r.returncode != 0, r.stdout + r.stderr
        assert message in r.stderr + r.stdout, r.stderr[-2000:]
        assert not os.path.exists(lockfile), "libtpu's lockfile was left behind"


def test_programs_compile_once_and_tpuctl_counts_them(pjrt):
    tpuctl = bazel_bin("tools/tpuctl/tpuctl")

    def compiles():
        j = subprocess.run([tpuctl, f"--admin_socket={pjrt.admin_socket}", "executors", "--json"],
                           capture_output=True, text=True, timeout=30)
        assert j.returncode == 0, j.stderr
        (e,) = json.loads(j.stdout)["executors"]  # one executor drives every device
        assert e["chips"] == [0, 1, 2, 3]
        chip3 = next(c for c in e["compile"] if c["chip"] == 3)
        return chip3["compiles"], chip3["cache_hits"], e["programs_cached"]

    before = compiles()
    run_in_child(pjrt, _programs_compile_once_and_tpuctl_counts_them)
    import time
    time.sleep(0.05)  # executors publish their figures every millisecond of activity
    after = compiles()
    assert after[0] - before[0] >= 1
    assert after[0] - before[0] <= 3, (before, after)  # full, mul, and at most one more
    assert after[1] - before[1] >= 9, (before, after)
    assert after[2] >= 1
    text = subprocess.run([tpuctl, f"--admin_socket={pjrt.admin_socket}", "executors"],
                          capture_output=True, text=True, timeout=30).stdout
    assert "COMPILES" in text and "compiled programs cached" in text, text


def _programs_compile_once_and_tpuctl_counts_them():
    import torch
    import torch_tpu  # noqa: F401
    # Op by op (fused eager, the default with device memory, would send the
    # ten as one run; test_fused_eager.py covers that).
    torch.tpu.set_eager_mode("direct")
    a = torch.full((17, 3), 2.0, device="tpu:3")
    for i in range(10):
        b = a * (i + 0.5)   # one program: the scalar is a parameter
    assert b.cpu()[0, 0].item() == 19.0


@pytest.mark.slow
def test_example_training_reaches_cpu_losses_on_pjrt(pjrt):
    """examples/train_tpu.py (LayerNorm, GELU, cross-entropy, AdamW's foreach
    step) on the PJRT backend prints CPU's losses."""
    import re
    example = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(
        os.path.abspath(__file__)))), "examples", "train_tpu.py")
    finals = {}
    for device in ("cpu", "tpu"):
        r = subprocess.run([sys.executable, example, "--device", device, "--steps", "30",
                            "--log-every", "10"], env=pjrt.env(), capture_output=True,
                           text=True, timeout=300)
        assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
        finals[device] = [float(x) for x in re.findall(r"loss (\d+\.\d+)", r.stdout)]
    assert len(finals["tpu"]) >= 3
    for c, t in zip(finals["cpu"], finals["tpu"]):
        assert abs(c - t) < 2e-3, finals


def test_more_ops_match_cpu_forward_and_backward(pjrt):
    run_in_child(pjrt, _more_ops_match_cpu_forward_and_backward)


def _more_ops_match_cpu_forward_and_backward():
    import torch
    import torch_tpu  # noqa: F401
    import torch.nn.functional as F
    torch.manual_seed(0)
    x, y = torch.randn(6, 5), torch.randn(6, 5)
    a, b = x.to("tpu"), y.to("tpu")
    checks = {
        "where": (torch.where(a > b, a, b), torch.where(x > y, x, y)),
        "clamp": (a.clamp(-0.5, 0.5), x.clamp(-0.5, 0.5)), "clamp_min": (a.clamp(min=0.1), x.clamp(min=0.1)),
        "eq": (a == b, x == y), "lt scalar": (a < 0.3, x < 0.3), "logical_and": ((a > 0) & (b > 0), (x > 0) & (y > 0)),
        "floor": (a.floor(), x.floor()), "remainder": (a % 0.7, x % 0.7), "atan2": (torch.atan2(a, b), torch.atan2(x, y)),
        "erf": (torch.erf(a), torch.erf(x)), "silu": (F.silu(a), F.silu(x)), "amax": (a.amax(1), x.amax(1)),
        "argmax": (a.argmax(1), x.argmax(1)), "argmax all": (a.argmax(), x.argmax()),
        "log_softmax": (F.log_softmax(a, 1), F.log_softmax(x, 1)), "softmax": (F.softmax(a, 0), F.softmax(x, 0)),
        "layer_norm": (F.layer_norm(a, (5,)), F.layer_norm(x, (5,))), "gelu": (F.gelu(a), F.gelu(x)),
        "masked_fill": (a.masked_fill(a > 0, 2.0), x.masked_fill(x > 0, 2.0)),
        "bmm": (torch.bmm(a.view(2, 3, 5), b.view(2, 5, 3)), torch.bmm(x.view(2, 3, 5), y.view(2, 5, 3))),
    }
    for name, (got, want) in checks.items():
        assert got.dtype == want.dtype, (name, got.dtype, want.dtype)
        assert torch.allclose(got.cpu(), want, atol=1e-5), (name, got.cpu(), want)
    # Backward: cross-entropy through layer norm and GELU, gradients against CPU's.
    target = torch.tensor([0, 4, 2, 1, 3, 0])
    def grads(dev):
        w = torch.randn(5, 5, generator=torch.Generator().manual_seed(3)).to(dev).requires_grad_()
        inp = x.detach().to(dev).requires_grad_()
        loss = F.cross_entropy(F.gelu(F.layer_norm(inp @ w, (5,))), target.to(dev))
        loss.backward()
        return loss.item(), w.grad.cpu(), inp.grad.cpu()
    lc, wc, ic = grads("cpu")
    lt, wt, it = grads("tpu")
    assert abs(lc - lt) < 1e-5 and torch.allclose(wc, wt, atol=1e-5) and torch.allclose(ic, it, atol=1e-5)
    # One unbatched sample (a 1-d input, a 0-d target): nll_loss takes it
    # as one row, with each reduction and a class weight.
    weight = torch.rand(5) + 0.5
    for reduction in ("none", "mean", "sum"):
        for wgt in (None, weight):
            def unbatched(dev):
                inp = x[2].detach().to(dev).requires_grad_()
                w = None if wgt is None else wgt.to(dev)
                loss = F.cross_entropy(inp, torch.tensor(3).to(dev), weight=w, reduction=reduction)
                loss.backward()
                return loss.detach().cpu(), inp.grad.cpu()
            (lc, gc), (lt, gt) = unbatched("cpu"), unbatched("tpu")
            assert lt.shape == lc.shape and torch.allclose(lt, lc, atol=1e-5), (reduction, lt, lc)
            assert torch.allclose(gt, gc, atol=1e-5), (reduction, gt, gc)


def test_complex32_is_copied_and_converted(pjrt):
    run_in_child(pjrt, _complex32_is_copied_and_converted)


def _complex32_is_copied_and_converted():
    # chalf has no StableHLO type: tpud carries its elements raw and
    # converts them in copy_ only, each part rounded to float16.
    import warnings

    import torch
    import torch_tpu  # noqa: F401
    warnings.simplefilter("ignore")  # (torch: ComplexHalf is experimental)
    same = lambda a, b: torch.equal(a.cpu().cfloat(), b.cfloat())  # noqa: E731
    x = torch.randn(3, 4) * 300
    z = torch.complex(torch.randn(5), torch.randn(5)) * 1e3
    c = x.chalf()
    assert x.to("tpu").chalf().dtype == torch.complex32
    assert same(x.to("tpu").chalf(), c)
    assert same(z.to("tpu").chalf(), z.chalf())
    assert same(torch.tensor(2.5, device="tpu").chalf(), torch.tensor(2.5).chalf())
    assert same(c.to("tpu").t().contiguous(), c.t().contiguous())
    for dtype in (torch.complex64, torch.complex128, torch.float32):
        got = c.to("tpu").to(dtype).cpu() if dtype.is_complex else c.to("tpu").real.to(dtype).cpu()
        want = c.to(dtype) if dtype.is_complex else c.real.to(dtype)
        assert torch.equal(got, want), dtype
    a = x.to("tpu").requires_grad_()
    a.chalf().cfloat().real.sum().backward()
    assert torch.equal(a.grad.cpu(), torch.ones(3, 4))
    t = x.to("tpu").chalf()
    try:
        (t + t).cpu()
        raise AssertionError("no error")
    except RuntimeError as e:
        assert "complex32" in str(e), e


def test_item_reads_every_float_and_complex_type(pjrt):
    # .item() on half, bfloat16 and complex tensors (loss.item() under bf16
    # training): values equal the CPU's, subnormal halves and infinities too.
    run_in_child(pjrt, _item_reads_every_float_and_complex_type)


def _item_reads_every_float_and_complex_type():
    import torch
    import torch_tpu  # noqa: F401
    values = (1.5, -3.0e-7, 65504.0, -2.0 ** -14, float("inf"), 0.0)
    for dtype in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
        for v in values:
            t = torch.tensor(v, dtype=dtype)
            got, want = t.to("tpu").item(), t.item()
            assert got == want, (dtype, v, got, want)
        s = torch.tensor([0.25, 0.5, 1.0], dtype=dtype)
        assert s.to("tpu").sum().item() == s.sum().item(), dtype
    for dtype in (torch.complex64, torch.complex128):
        t = torch.tensor(1.5 - 0.25j, dtype=dtype)
        assert t.to("tpu").item() == t.item(), dtype


def test_complex_scalars_and_moduli_keep_both_parts(pjrt):
    # A Python complex scalar in arithmetic (z * 1j) and the gradient that
    # uses one (polar's angle): both parts of the scalar reach the program.
    run_in_child(pjrt, _complex_scalars_and_moduli_keep_both_parts)


def _complex_scalars_and_moduli_keep_both_parts():
    import torch
    import torch_tpu  # noqa: F401
    for dtype in (torch.complex64, torch.complex128):
        z = torch.tensor([1 + 2j, 3 - 1j, -0.5 + 0.25j], dtype=dtype)
        zt = z.to("tpu")
        for name, f in {"z * 1j": lambda z: z * 1j, "z * (0.5 - 2j)": lambda z: z * (0.5 - 2j),
                        "z + (1 + 1j)": lambda z: z + (1 + 1j),
                        "full": lambda z: torch.full_like(z, 2 - 3j) * z,
                        "mul by a 0-dim tensor": lambda z: z * torch.tensor(-1j)}.items():
            assert torch.equal(f(zt).cpu(), f(z)), (dtype, name, f(zt).cpu(), f(z))
    # what takes a complex tensor to a real result takes its modulus, never
    # its real part; eq and ne compare both parts
    z = torch.randn(4, 6, dtype=torch.complex64)
    zt = z.to("tpu")
    real = {"abs": torch.abs, "vector_norm": torch.linalg.vector_norm,
            "norm inf": lambda v: torch.linalg.vector_norm(v, float("inf"), dim=1),
            "var": lambda v: torch.var(v, 1), "std": torch.std, "softsign": torch.nn.functional.softsign,
            "eq conj": lambda v: v == v.conj(), "ne conj": lambda v: v != v.conj(),
            "eq": lambda v: v == v.clone()}
    for name, f in real.items():
        got, want = f(zt).cpu(), f(z)
        assert got.dtype == want.dtype and torch.allclose(got, want, atol=1e-5), (name, got, want)
    # the gradients of holomorphic functions take the derivative's conjugate
    for name, f in {"tanh": torch.tanh, "sigmoid": torch.sigmoid,
                    "tanhshrink": torch.nn.functional.tanhshrink}.items():
        x, y = z.clone().requires_grad_(), zt.clone().requires_grad_()
        f(x).backward(z.conj())
        f(y).backward(zt.conj())
        assert torch.allclose(y.grad.cpu(), x.grad, atol=1e-5), (name, y.grad.cpu(), x.grad)
    torch.manual_seed(0)
    a, b = torch.rand(5) + 0.1, torch.randn(5)
    g = torch.randn(5, dtype=torch.complex64)
    grads = []
    for dev in ("cpu", "tpu"):
        at, bt = a.to(dev).requires_grad_(), b.to(dev).requires_grad_()
        grads.append([x.cpu() for x in torch.autograd.grad(torch.polar(at, bt), (at, bt), g.to(dev))])
    for want, got in zip(*grads):
        assert torch.allclose(got, want, atol=1e-6), (got, want)


def test_backward_ops_pytorch_cannot_decompose_match_cpu(pjrt):
    # The backward of every interpolation mode, of adaptive average and the
    # max poolings, of replication padding, of the distances and the margin
    # losses (PyTorch has no decomposition of them), and antialiased
    # resizing both ways, against CPU: upscaling, downscaling, odd scale
    # factors, align_corners both ways. The programs are the same in both
    # memory modes, so the device mode does not run them again.
    if pjrt.memory == "device":
        pytest.skip("the same programs as in the host memory mode")
    run_in_child(pjrt, _backward_ops_pytorch_cannot_decompose_match_cpu, timeout=300)


def _backward_ops_pytorch_cannot_decompose_match_cpu():
    import torch
    import torch_tpu  # noqa: F401
    F = torch.nn.functional
    torch.manual_seed(0)

    def both(fn, x, dtype):
        out = []
        for dev in ("cpu", "tpu"):
            xx = x.to(dev).requires_grad_()
            y = fn(xx)
            g = torch.linspace(-1, 1, y.numel(), dtype=dtype).reshape(y.shape).to(dev)
            out.append((y.detach().cpu(), torch.autograd.grad(y, xx, g)[0].cpu()))
        return out

    modes = [("nearest", 1), ("nearest", 3), ("nearest-exact", 2), ("linear", 1),
             ("bilinear", 2), ("trilinear", 3), ("bicubic", 2)]
    for dtype, modes in ((torch.float32, modes), (torch.float64, modes[4:5])):
        for mode, nd in modes:
            for size in (dict(size=[7] * nd), dict(scale_factor=0.6), dict(scale_factor=1.7)):
                for align in ([None] if "nearest" in mode else [False, True]):
                    for aa in ([False, True] if mode in ("bilinear", "bicubic") else [False]):
                        kw = dict(size, mode=mode, antialias=aa)
                        if align is not None:
                            kw["align_corners"] = align
                        x = torch.randn(2, 3, *[5, 6, 4][:nd], dtype=dtype)
                        (yc, gc), (yt, gt) = both(lambda t: F.interpolate(t, **kw), x, dtype)
                        assert torch.allclose(yt, yc, atol=1e-5), (dtype, kw, (yt - yc).abs().max())
                        assert torch.allclose(gt, gc, atol=1e-5), (dtype, kw, (gt - gc).abs().max())
    for pool, x, size in ((F.adaptive_avg_pool2d, torch.randn(2, 3, 5, 6), (3, 4)),
                          (F.adaptive_avg_pool3d, torch.randn(2, 5, 6, 4), (2, 4, 3))):
        (yc, gc), (yt, gt) = both(lambda t: pool(t, size), x, torch.float32)
        assert torch.allclose(yt, yc, atol=1e-6) and torch.allclose(gt, gc, atol=1e-6), pool
    # max poolings' backward adds each gradient at its index; replication
    # padding's adds the edge's copies (a negative pad crops)
    for fn, x in ((lambda t: F.adaptive_max_pool2d(t, (3, 2)), torch.randn(2, 3, 7, 5)),
                  (lambda t: F.adaptive_max_pool3d(t, (2, 3, 2)), torch.randn(2, 4, 5, 6)),
                  (lambda t: F.max_pool3d(t, 2, stride=1, padding=1), torch.randn(2, 3, 4, 5, 3)),
                  (lambda t: F.pad(t, (2, -1, 3, 1), mode="replicate"), torch.randn(2, 3, 4, 5)),
                  (lambda t: F.pad(t, (1, 2, 0, 1, 2, 0), mode="replicate"), torch.randn(1, 2, 3, 4, 2)),
                  (lambda t: F.pad(t, (3, 4), mode="replicate"), torch.randn(2, 3, 5))):
        (yc, gc), (yt, gt) = both(fn, x, torch.float32)
        assert torch.equal(yt, yc) and torch.allclose(gt, gc, atol=1e-6), (x.shape, gt, gc)
    # fractional max pooling (the windows from given samples) and adaptive
    # max pooling, a NaN in a window
    for sp, shape, k, size in ((2, (2, 3, 9, 7), (2, 3), (4, 3)), (2, (3, 8, 8), 2, (5, 5)),
                               (3, (2, 2, 6, 7, 5), (2, 2, 3), (3, 4, 2))):
        x = torch.randn(*shape)
        x.view(-1)[3] = float("nan")
        samples = torch.rand(shape[0] if len(shape) == sp + 2 else 1, shape[-sp - 1], sp)
        fractional = F.fractional_max_pool2d if sp == 2 else F.fractional_max_pool3d
        adaptive = F.adaptive_max_pool2d if sp == 2 else F.adaptive_max_pool3d
        for fn in (lambda t: fractional(t, k, output_size=size, return_indices=True,
                                        _random_samples=samples.to(t.device)),
                   lambda t: adaptive(t, size, return_indices=True)):
            (yc, ic), (yt, it) = fn(x), fn(x.to("tpu"))
            assert torch.equal(it.cpu(), ic) and torch.allclose(yt.cpu(), yc, equal_nan=True), shape
            (yc, gc), (yt, gt) = both(lambda t: fn(t)[0].nan_to_num(), x, torch.float32)
            assert torch.allclose(gt, gc), shape
    # transposed convolutions whose output_padding reaches past the stride
    # (allowed where the dilation is larger)
    w1, w2 = torch.randn(3, 2, 3), torch.randn(3, 2, 2, 3)
    for fn, x in ((lambda t: F.conv_transpose1d(t, w1.to(t.device), stride=1, dilation=2,
                                                output_padding=1), torch.randn(2, 3, 5)),
                  (lambda t: F.conv_transpose2d(t, w2.to(t.device), stride=2, padding=1,
                                                output_padding=1), torch.randn(2, 3, 4, 4))):
        (yc, gc), (yt, gt) = both(fn, x, torch.float32)
        assert torch.allclose(yt, yc, atol=1e-5) and torch.allclose(gt, gc, atol=1e-5), x.shape
    # distances for every kind of p, and the margin losses
    x2 = torch.randn(2, 4, 3)
    for p in (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, float("inf")):
        for fn, x in ((lambda t: torch.cdist(t, x2.to(t.device), p=p), torch.randn(2, 5, 3)),
                      (lambda t: F.pdist(t, p=p), torch.randn(6, 3))):
            (yc, gc), (yt, gt) = both(fn, x, torch.float32)
            assert torch.allclose(yt, yc, atol=1e-5) and torch.allclose(gt, gc, atol=1e-4), (p, gt, gc)
    target = torch.tensor([0, 3, 1, 4])
    labels = torch.tensor([[0, 3, -1, 1, 2], [4, -1, 0, 0, 0], [1, 2, 3, 4, 0], [-1, 1, 1, 1, 1]])
    for red in ("mean", "sum", "none"):
        for p, w in ((1, None), (2, torch.rand(5))):
            fn = lambda t: F.multi_margin_loss(t, target.to(t.device), p=p, margin=0.7, reduction=red,
                                               weight=None if w is None else w.to(t.device))
            (yc, gc), (yt, gt) = both(fn, torch.randn(4, 5), torch.float32)
            assert torch.allclose(yt, yc, atol=1e-6) and torch.allclose(gt, gc, atol=1e-6), (red, p)
        fn = lambda t: F.multilabel_margin_loss(t, labels.to(t.device), reduction=red)
        (yc, gc), (yt, gt) = both(fn, torch.randn(4, 5), torch.float32)
        assert torch.allclose(yt, yc, atol=1e-6) and torch.allclose(gt, gc, atol=1e-6), (red, gt, gc)
    # grid_sample: its backward is the vector-Jacobian product of PyTorch's
    # decomposition of the forward, for the input and the grid
    grid = torch.rand(2, 4, 3, 2) * 2.4 - 1.2
    for mode in ("bilinear", "nearest", "bicubic"):
        for pad in ("zeros", "border", "reflection"):
            res = []
            for dev in ("cpu", "tpu"):
                xx, gg = torch.randn(2, 3, 5, 6, generator=torch.Generator().manual_seed(1)).to(dev), \
                    grid.to(dev)
                xx.requires_grad_(), gg.requires_grad_()
                y = F.grid_sample(xx, gg, mode=mode, padding_mode=pad, align_corners=mode == "bicubic")
                w = torch.linspace(-1, 1, y.numel()).reshape(y.shape).to(dev)
                res.append([y.detach().cpu()] + [t.cpu() for t in torch.autograd.grad((y * w).sum(), (xx, gg))])
            for got, want in zip(res[1], res[0]):
                assert torch.allclose(got, want, atol=1e-4, rtol=1e-4), (mode, pad)
    # segment_reduce by lengths and by offsets, every reduction, an empty
    # segment, zeros (prod) and ties (max, min), with and without initial
    data = torch.tensor([1.0, 0, 2, 0, 0, 3, -1, 3, 3])
    for red in ("sum", "mean", "max", "min", "prod"):
        for init in (None, 2.5):
            for seg in (dict(lengths=torch.tensor([2, 0, 3, 4])),
                        dict(offsets=torch.tensor([0, 2, 2, 5, 9]))):
                fn = lambda t: torch.segment_reduce(  # noqa: E731
                    t, red, initial=init, **{k: v.to(t.device) for k, v in seg.items()})
                (yc, gc), (yt, gt) = both(fn, data, torch.float32)
                assert torch.allclose(yt, yc, equal_nan=True) and torch.allclose(gt, gc), (red, init)
    x, g = torch.randn(40), torch.randn(40)
    for op in (torch.ops.aten.softshrink_backward, torch.ops.aten.hardshrink_backward):
        assert torch.equal(op(g.to("tpu"), x.to("tpu"), 0.5).cpu(), op(g, x, 0.5)), op


@pytest.mark.slow
def test_quota_oom_and_kill_9_reclaim_on_pjrt(pjrt):
    tpuctl = bazel_bin("tools/tpuctl/tpuctl")
    admin = f"--admin_socket={pjrt.admin_socket}"
    subprocess.run([tpuctl, admin, "quota", "--default", "16MiB"], check=True, timeout=30)
    try:
        run_in_child(pjrt, _quota_error_and_the_session_goes_on)
    finally:
        subprocess.run([tpuctl, admin, "quota", "--default", "none"], check=True, timeout=30)
    # A client killed while its ops run: its memory comes back; the one
    # executor that holds the plugin serves the next job.
    import signal
    import textwrap
    import time
    victim = subprocess.Popen([sys.executable, "-c", textwrap.dedent("""
        import sys, torch, torch_tpu
        a = torch.randn(256, 256, device="tpu:1")
        print("ready", flush=True)
        while True:
            a = torch.tanh(a @ a)
    """)], env=pjrt.env(), stdout=subprocess.PIPE, text=True)
    assert victim.stdout.readline().strip() == "ready"
    time.sleep(0.3)
    victim.send_signal(signal.SIGKILL)
    victim.wait()
    doc = wait_reclaimed(pjrt)
    assert not doc["sessions"], doc["sessions"]
    assert all(c["hbm_used_bytes"] == 0 for c in doc["chips"]), doc["chips"]
    run_in_child(pjrt, _matmul_on_chip_1)


def _quota_error_and_the_session_goes_on():
    import torch
    import torch_tpu  # noqa: F401
    a = torch.ones(1024, 1024, device="tpu")          # 4 MiB
    try:
        torch.ones(8, 1024, 1024, device="tpu")        # 32 MiB: over the quota
        raise SystemExit("no quota error")
    except RuntimeError as e:
        assert "quota" in str(e), str(e)
    assert (a * 2).sum().item() == 2 * 1024 * 1024     # the session goes on


def _matmul_on_chip_1():
    import torch
    import torch_tpu  # noqa: F401
    x = torch.randn(8, 8)
    assert torch.allclose((x.to("tpu:1") @ x.to("tpu:1")).cpu(), x @ x, atol=1e-5)


@pytest.mark.slow
def test_ddp_over_four_chips_matches_one_process_on_pjrt(pjrt):
    """The collectives run on the PJRT backend's chips too (tpud moves the
    bytes; the ops around them are lowered): DDP on 4 ranks, one per device,
    trains like one process."""
    from test_distributed import run_ranks

    results = run_ranks(pjrt, "ddp", 4, timeout=600)
    for rank, (rc, result, text) in enumerate(results):
        assert rc == 0 and result and result["ok"], f"rank {rank}:\n{text[-3000:]}"


def _collective_programs(pjrt):
    """Per chip, the collectives it ran as replicated programs."""
    j = subprocess.run([bazel_bin("tools/tpuctl/tpuctl"), f"--admin_socket={pjrt.admin_socket}", "executors",
                        "--json"], capture_output=True, text=True, timeout=30)
    assert j.returncode == 0, j.stderr
    (e,) = json.loads(j.stdout)["executors"]
    return {c["chip"]: c["collective_programs"] for c in e["compile"]}


@pytest.mark.slow
def test_collectives_run_as_programs_on_the_devices_and_match_cpu(pjrt):
    """Every collective, reduction op and dtype of the simulated host's test,
    on PJRT. all_reduce, reduce, reduce_scatter, all_gather, broadcast and
    even all_to_all run as one replicated program whose stablehlo collective
    spans the ranks' devices (reading and writing device buffers with device
    memory); gather, scatter, uneven all_to_all, send/recv and bool or
    complex reductions move through the arena. tpuctl counts the programs.
    float8 is left out: the backend lowers no op on it (packing a list for
    scatter is a cat)."""
    from test_distributed import run_ranks

    before = _collective_programs(pjrt)
    results = run_ranks(pjrt, "collectives", 4, extra=("float8_e4m3fn",), timeout=600)
    for rank, (rc, result, text) in enumerate(results):
        assert rc == 0 and result and result["ok"], f"rank {rank}:\n{text[-3000:]}"
    after = _collective_programs(pjrt)
    ran = {c: after[c] - before.get(c, 0) for c in after}
    # 9 reducible dtypes x their ops, 11 dtypes x 4 movements, 3 x 3 x 5 reduce/scatter ...
    assert all(ran[c] >= 100 for c in range(4)), ran


def _device_buffer_bytes(pjrt):
    j = subprocess.run([bazel_bin("tools/tpuctl/tpuctl"), f"--admin_socket={pjrt.admin_socket}", "executors",
                        "--json"], capture_output=True, text=True, timeout=30)
    assert j.returncode == 0, j.stderr
    (e,) = json.loads(j.stdout)["executors"]
    return e["device_buffer_bytes"]


@pytest.mark.slow
def test_host_writes_frees_and_reuse_keep_memory_right(pjrt):
    """What the host writes into a tensor the device last wrote joins it;
    memory freed and handed out again reads as zeros, never as its old
    contents; device buffers go with their segments (device memory)."""
    import time
    before = _device_buffer_bytes(pjrt)
    out = run_in_child(pjrt, _host_writes_join_the_device_copy_and_reuse_reads_zeros)
    assert "held" in out.stdout
    # The process ended: tpud reclaimed its segments, and their device
    # buffers went with them.
    if pjrt.memory == "device":
        deadline = time.time() + 5
        while _device_buffer_bytes(pjrt) > before and time.time() < deadline:
            time.sleep(0.05)
        assert _device_buffer_bytes(pjrt) <= before
    # A new session gets zeros where the last one left nines.
    run_in_child(pjrt, _new_memory_reads_zeros)


def _host_writes_join_the_device_copy_and_reuse_reads_zeros():
    import torch
    import torch_tpu  # noqa: F401
    # A segment of its own (1 MiB): smaller tensors share pools, which go
    # back to tpud only once all their blocks are cached.
    n = 1 << 18
    x = torch.ones(n, device="tpu")
    x.mul_(2)                                     # the device's copy is the newest
    x[2:4] = torch.tensor([5.0, 6.0])             # the host writes part of it
    y = x + 0
    want = torch.full((n,), 2.0); want[2:4] = torch.tensor([5.0, 6.0])
    assert torch.equal(y.cpu(), want), y.cpu()[:6]
    # Strided and offset views read out of their segment.
    m = torch.arange(24.0).reshape(4, 6).to("tpu").mul_(3)
    ref = torch.arange(24.0).reshape(4, 6) * 3
    assert torch.equal((m[:, 1::2].t() * 1).cpu(), ref[:, 1::2].t())
    assert torch.equal(m.diagonal().cpu(), ref.diagonal())
    torch.tpu.synchronize()
    print("held", flush=True)
    del x, y
    torch.tpu.empty_cache()                       # the segment goes back to tpud
    z = torch.empty(n, device="tpu")              # and likely comes back here
    assert torch.count_nonzero(z.cpu()).item() == 0, z.cpu()[:6]
    z.fill_(9)
    torch.tpu.synchronize()


def _new_memory_reads_zeros():
    import torch
    import torch_tpu  # noqa: F401
    z = torch.empty(4096, device="tpu")
    assert torch.count_nonzero(z.cpu()).item() == 0
