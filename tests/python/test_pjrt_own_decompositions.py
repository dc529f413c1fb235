"""torch_tpu's own decompositions (torch_tpu/_own_decomp.py) on the PJRT
backend, against the CPU: ops that tpud does not lower and PyTorch does not
decompose, every output compared (statistics and index outputs included),
gradients where the op has them."""
import pytest

from conftest import Daemon, pjrt_flags, run_in_child

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def pjrt():
    pytest.importorskip("xla_plugins.xla_cpu_pjrt")
    d = Daemon(hbm="512MiB", extra_flags=pjrt_flags() + ["--pjrt_memory=device"])
    yield d
    d.stop()


def _same(name, got, want, atol=1e-4):
    import torch
    if isinstance(want, (tuple, list)):
        assert len(got) == len(want), name
        for i, (g, w) in enumerate(zip(got, want)):
            _same(f"{name}[{i}]", g, w, atol)
        return
    got = got.cpu()
    assert got.shape == want.shape and got.dtype == want.dtype, (name, got.shape, want.shape,
                                                                   got.dtype, want.dtype)
    if want.is_floating_point() or want.is_complex():
        assert torch.allclose(got, want, atol=atol, rtol=1e-4, equal_nan=True), (name, got, want)
    else:
        assert torch.equal(got, want), (name, got, want)


def test_own_decompositions_match_cpu(pjrt):
    run_in_child(pjrt, _own_decompositions_match_cpu)


def _own_decompositions_match_cpu():
    import torch
    import torch_tpu  # noqa: F401
    from torch_tpu import _decomp

    tpu = lambda x: x.to("tpu")  # noqa: E731
    tpu(torch.ones(1))  # (the session opens, and the decompositions are installed)
    assert "aten::_embedding_bag" in _decomp.installed()
    torch.manual_seed(0)
    # Batch norm in eval mode: empty saved statistics, as ATen's CPU kernel.
    x, w, rm, rv = torch.randn(3, 2, 4), torch.ones(2), torch.zeros(2), torch.ones(2)
    for op in (torch.ops.aten.native_batch_norm, torch.ops.aten._native_batch_norm_legit):
        _same("batch norm eval", op(tpu(x), tpu(w), None, tpu(rm), tpu(rv), False, 0.1, 1e-5),
              op(x, w, None, rm, rv, False, 0.1, 1e-5))
    # In bfloat16, training normalizes with the statistics rounded to
    # bfloat16, as CPU does (and stores them so); eval's empty ones keep the
    # input's type.
    xb = torch.randn(4, 3, 5).bfloat16()
    wb, bb = torch.randn(3).bfloat16(), torch.randn(3).bfloat16()
    for training in (True, False):
        args = (wb, bb, torch.zeros(3).bfloat16(), torch.ones(3).bfloat16(), training, 0.1, 1e-5)
        _same(f"batch norm bfloat16 training={training}",
              torch.ops.aten.native_batch_norm(tpu(xb), *[tpu(a) if isinstance(a, torch.Tensor)
                                                          else a for a in args]),
              torch.ops.aten.native_batch_norm(xb, *args), atol=0)
    # lstsq: every driver's outputs, over- and under-determined, a vector b.
    for driver in (None, "gels", "gelsd", "gelss"):
        for a_shape, b_shape in (((2, 5, 3), (2, 5, 2)), ((3, 5), (3, 2)), ((5, 3), (5,))):
            a, b = torch.randn(a_shape), torch.randn(b_shape)
            _same(f"lstsq {driver} {a_shape}", torch.linalg.lstsq(tpu(a), tpu(b), driver=driver),
                  torch.linalg.lstsq(a, b, driver=driver))
    a = torch.randn(5, 3, requires_grad=True)
    a_tpu = tpu(a.detach()).requires_grad_()
    out = torch.linalg.lstsq(a_tpu, tpu(torch.ones(5, 2)))
    assert [t.requires_grad for t in out] == [True, True, False, False]
    out.solution.sum().backward()
    torch.linalg.lstsq(a, torch.ones(5, 2)).solution.sum().backward()
    _same("lstsq grad", a_tpu.grad, a.grad)
    with pytest.raises(RuntimeError, match="driver"):
        torch.linalg.lstsq(a_tpu, tpu(torch.ones(5, 2)), driver="lapack")
    # rrelu: eval is leaky_relu at the mean slope; training keeps x > 0 and
    # records each slope it drew in noise, within [lower, upper].
    x = torch.randn(50)
    _same("rrelu eval", torch.nn.functional.rrelu(tpu(x)), torch.nn.functional.rrelu(x))
    noise = torch.empty(50, device="tpu")
    y = torch.ops.aten.rrelu_with_noise(tpu(x), noise, 0.1, 0.3, True).cpu()
    noise = noise.cpu()
    assert torch.equal(y[x > 0], x[x > 0]) and bool((noise[x > 0] == 1).all())
    neg = noise[x <= 0]
    assert bool(((neg >= 0.1) & (neg <= 0.3)).all()) and torch.allclose(y[x <= 0], (x * noise)[x <= 0])
    # Sizes from the data.
    r = torch.tensor([1, 0, 3, 2])
    _same("repeat_interleave", torch.repeat_interleave(tpu(r)), torch.repeat_interleave(r))
    _same("repeat_interleave int32", torch.repeat_interleave(tpu(r.int())),
          torch.repeat_interleave(r.int()))
    with pytest.raises(RuntimeError, match="repeats can not be negative"):
        torch.repeat_interleave(tpu(torch.tensor([1, -1])))
    z = torch.tensor([3, 1, 3, 2])
    _same("_unique", torch._unique(tpu(z), return_inverse=True), torch._unique(z, return_inverse=True))
    y = torch.randint(0, 2, (3, 6, 2)).float()
    for d in (0, 1, 2):
        _same(f"unique dim={d}",
              torch.unique(tpu(y), dim=d, return_inverse=True, return_counts=True),
              torch.unique(y, dim=d, return_inverse=True, return_counts=True))
    v = torch.tensor([1, 4, 4, 0, 7])
    for kw in ({}, {"minlength": 10}, {"weights": torch.rand(5)}, {"weights": torch.arange(5)}):
        _same(f"bincount {kw}", torch.bincount(tpu(v), **{k: tpu(w) if isinstance(w, torch.Tensor)
                                                          else w for k, w in kw.items()}),
              torch.bincount(v, **kw))
    _same("bincount empty", torch.bincount(tpu(v[:0]), minlength=3), torch.bincount(v[:0], minlength=3))
    with pytest.raises(RuntimeError, match="non-negative"):
        torch.bincount(tpu(torch.tensor([1, -2])))
    # hash_tensor: XOR of 64-bit patterns.
    for v in (torch.randn(3, 4), torch.tensor([1, 2, -3]), torch.tensor([True, False, True])):
        _same("hash_tensor", torch.hash_tensor(tpu(v)), torch.hash_tensor(v))
    v = torch.randn(3, 5, 7)
    _same("hash_tensor dims", torch.hash_tensor(tpu(v), [0, 2], keepdim=True),
          torch.hash_tensor(v, [0, 2], keepdim=True))
    # grid_sampler_3d, every mode, values and both gradients.
    inp, grid = torch.randn(2, 3, 4, 5, 6), torch.rand(2, 3, 2, 4, 3) * 2.4 - 1.2
    for mode in (0, 1):
        for padding in (0, 1, 2):
            for align in (False, True):
                i, g = tpu(inp).requires_grad_(), tpu(grid).requires_grad_()
                i2, g2 = inp.clone().requires_grad_(), grid.clone().requires_grad_()
                got = torch.grid_sampler_3d(i, g, mode, padding, align)
                want = torch.grid_sampler_3d(i2, g2, mode, padding, align)
                _same(f"grid_sampler_3d {mode} {padding} {align}", got, want)
                got.square().sum().backward()
                want.square().sum().backward()
                _same("grid_sampler_3d grads", (i.grad, g.grad), (i2.grad, g2.grad), atol=1e-3)
    # In bfloat16: computed in float32 (its flat indices in int64), every
    # index in range.
    got = torch.grid_sampler_3d(tpu(inp).bfloat16(), tpu(grid).bfloat16(), 0, 0, False)
    want = torch.grid_sampler_3d(inp.bfloat16().float(), grid.bfloat16().float(), 0, 0, False)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.cpu().float(), want, rtol=0.02, atol=0.02)
    # embedding_bag: modes, padding_idx, an empty bag, include_last_offset,
    # per-sample weights; the weight's gradient.
    weight, idx = torch.randn(10, 3), torch.tensor([1, 2, 4, 5, 4, 3, 2, 9])
    for mode in ("sum", "mean", "max"):
        for pad in (None, 4):
            for last in (False, True):
                offsets = torch.tensor([0, 4, 4, 8] if last else [0, 4, 4])
                wt, wc = tpu(weight).requires_grad_(), weight.clone().requires_grad_()
                got = torch.nn.functional.embedding_bag(tpu(idx), wt, tpu(offsets), mode=mode,
                                                        padding_idx=pad, include_last_offset=last)
                want = torch.nn.functional.embedding_bag(idx, wc, offsets, mode=mode,
                                                         padding_idx=pad, include_last_offset=last)
                _same(f"embedding_bag {mode} {pad} {last}", got, want)
                got.square().sum().backward()
                want.square().sum().backward()
                _same(f"embedding_bag grad {mode} {pad} {last}", wt.grad, wc.grad)
    psw = torch.randn(8)
    p1, p2 = tpu(psw).requires_grad_(), psw.clone().requires_grad_()
    got = torch.nn.functional.embedding_bag(tpu(idx), tpu(weight), tpu(torch.tensor([0, 3])),
                                            mode="sum", per_sample_weights=p1)
    want = torch.nn.functional.embedding_bag(idx, weight, torch.tensor([0, 3]), mode="sum",
                                             per_sample_weights=p2)
    _same("embedding_bag per_sample_weights", got, want)
    got.sum().backward()
    want.sum().backward()
    _same("embedding_bag per_sample_weights grad", p1.grad, p2.grad)
    # In bfloat16 the rows are weighted and summed in float32 and rounded
    # once: here that is float64's result rounded, where products rounded to
    # bfloat16 first give -2.5781 and 3.5156 for -2.5938 and 3.5.
    gen = torch.Generator().manual_seed(0)
    wb = torch.randn(10, 3, generator=gen).bfloat16()
    pb = torch.randn(8, generator=gen).bfloat16()
    got = torch.nn.functional.embedding_bag(tpu(idx), tpu(wb), tpu(torch.tensor([0])),
                                            mode="sum", per_sample_weights=tpu(pb))
    exact = torch.nn.functional.embedding_bag(idx, wb.double(), torch.tensor([0]), mode="sum",
                                              per_sample_weights=pb.double())
    assert got.dtype == torch.bfloat16
    assert torch.equal(got.cpu(), exact.bfloat16()), (got, exact)
    # max_norm: embedding_renorm_ rescales the rows used, in place, as CPU.
    for norm_type in (2.0, 1.0):
        wt, wc = tpu(weight * 3), weight * 3
        got = torch.nn.functional.embedding_bag(tpu(idx), wt, tpu(torch.tensor([0, 3])),
                                                max_norm=1.5, norm_type=norm_type)
        want = torch.nn.functional.embedding_bag(idx, wc, torch.tensor([0, 3]),
                                                 max_norm=1.5, norm_type=norm_type)
        _same(f"embedding_bag max_norm {norm_type}", got, want)
        _same(f"embedding_renorm_ weight {norm_type}", wt, wc)
        e = torch.nn.functional.embedding(tpu(torch.tensor([[0, 7], [7, 7]])), wt, max_norm=0.5)
        e2 = torch.nn.functional.embedding(torch.tensor([[0, 7], [7, 7]]), wc, max_norm=0.5)
        _same(f"embedding max_norm {norm_type}", (e, wt), (e2, wc))


def test_histogramdd_matches_cpu(pjrt):
    run_in_child(pjrt, _histogramdd_matches_cpu)


def _histogramdd_matches_cpu():
    import torch
    import torch_tpu  # noqa: F401
    torch.manual_seed(0)
    x, w = torch.randn(50, 3), torch.rand(50)
    edges = [torch.tensor([-3.0, 0.0, 3.0]), torch.tensor([-1.0, 0.0, 0.5, 4.0]),
             torch.tensor([-5.0, 5.0])]
    for kw, kw_tpu in (
            (dict(bins=[2, 3, 4]), dict(bins=[2, 3, 4])),
            (dict(bins=[3, 3, 3], range=[-1.0, 1.0, -2.0, 2.0, 0.0, 1.0]),
             dict(bins=[3, 3, 3], range=[-1.0, 1.0, -2.0, 2.0, 0.0, 1.0])),
            (dict(bins=[2, 2, 2], weight=w, density=True),
             dict(bins=[2, 2, 2], weight=w.to("tpu"), density=True)),
            (dict(bins=edges), dict(bins=[e.to("tpu") for e in edges]))):
        want = torch.histogramdd(x, **kw)
        got = torch.histogramdd(x.to("tpu"), **kw_tpu)
        _same("histogramdd", got.hist, want.hist, atol=1e-6)
        _same("histogramdd edges", list(got.bin_edges), list(want.bin_edges), atol=1e-6)
    with pytest.raises(RuntimeError, match="min should not exceed max"):
        torch.histogramdd(x.to("tpu"), bins=[2, 2, 2], range=[1.0, 0.0, 0.0, 1.0, 0.0, 1.0])


def test_ctc_loss_and_its_gradient_match_cpu(pjrt):
    run_in_child(pjrt, _ctc_loss_and_its_gradient_match_cpu)


def _ctc_loss_and_its_gradient_match_cpu():
    import torch
    import torch_tpu  # noqa: F401
    torch.manual_seed(0)
    steps, batch, classes = 12, 3, 5
    lp = torch.randn(steps, batch, classes, dtype=torch.float64).log_softmax(2)
    targets = torch.tensor([[1, 1, 2, 4], [3, 2, 0, 0], [4, 4, 4, 0]])
    il, tl = [12, 10, 4], [4, 2, 3]  # the last cannot fit: an infinite loss
    flat = torch.cat([targets[n, :tl[n]] for n in range(batch)])
    for zero_infinity in (False, True):
        for reduction in ("none", "mean", "sum"):
            for args, args_tpu in (
                    ((targets, il, tl), (targets.to("tpu"), il, tl)),
                    ((flat, il, tl), (flat.to("tpu"), il, tl)),
                    ((targets, torch.tensor(il), torch.tensor(tl)),
                     (targets.to("tpu"), torch.tensor(il).to("tpu"), torch.tensor(tl).to("tpu")))):
                a, b = lp.clone().requires_grad_(), lp.to("tpu").requires_grad_()
                want = torch.nn.functional.ctc_loss(a, *args, reduction=reduction,
                                                    zero_infinity=zero_infinity)
                got = torch.nn.functional.ctc_loss(b, *args_tpu, reduction=reduction,
                                                   zero_infinity=zero_infinity)
                _same("ctc_loss", got, want, atol=1e-9)
                if zero_infinity:
                    want.sum().backward()
                    got.sum().backward()
                    _same("ctc_loss grad", b.grad, a.grad, atol=1e-9)


def test_ldl_factor_and_solve_match_lapack(pjrt):
    # Every step of a factorization compiles programs of its own shapes
    # (about 100 s of XLA compiles here on 2 cores), hence the longer wait.
    run_in_child(pjrt, _ldl_factor_and_solve_match_lapack, timeout=300)


def _ldl_factor_and_solve_match_lapack():
    # Bunch-Kaufman's pivots as LAPACK's sytf2 / hetf2 pick them (1x1 and
    # 2x2 blocks), LD, info for a zero column, and sytrs's / hetrs's solve:
    # real symmetric, complex symmetric and complex Hermitian matrices.
    import torch
    import torch_tpu  # noqa: F401
    torch.manual_seed(0)
    for dtype, hermitian in ((torch.float64, False), (torch.complex128, False),
                             (torch.complex128, True)):
        # Seeded so that each dtype meets 1x1 and 2x2 pivots, row swaps and a
        # zero column (trial 3); the last two trials add 2x2 pivots of n = 2.
        for trial in range(8):
            n = (1, 2, 3, 5, 8, 0)[trial % 6]
            a = torch.randn(2, n, n, dtype=dtype)
            a = a + (a.mH if hermitian else a.mT)
            if trial == 3:
                a[0, :, 0] = 0
                a[0, 0, :] = 0
            name = f"{dtype} hermitian={hermitian} n={n}"
            want = torch.linalg.ldl_factor_ex(a, hermitian=hermitian)
            got = torch.linalg.ldl_factor_ex(a.to("tpu"), hermitian=hermitian)
            _same(f"ldl_factor {name}", list(got), list(want), atol=1e-12)
            b = torch.randn(2, n, 3, dtype=dtype)
            _same(f"ldl_solve {name}",
                  torch.linalg.ldl_solve(want.LD.to("tpu"), want.pivots.to("tpu"), b.to("tpu"),
                                         hermitian=hermitian),
                  torch.linalg.ldl_solve(want.LD, want.pivots, b, hermitian=hermitian),
                  atol=1e-9)
    with pytest.raises(RuntimeError, match="diagonal of D is zero"):
        torch.linalg.ldl_factor_ex(torch.zeros(3, 3, device="tpu"), check_errors=True)
