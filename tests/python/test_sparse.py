"""Sparse COO tensors on "tpu": the common ops give CPU's results (values,
dtype, shape, coalesced flag), gradients flow through them, and every other
sparse layout or op fails with an error that names it, after which the
process goes on."""
import pathlib

import pytest

from conftest import run_in_child

ROOT = pathlib.Path(__file__).resolve().parents[2]

# Shared by the tests' bodies (each runs in a fresh interpreter, see
# conftest.run_in_child).

def same(got, want, what):
    import torch
    if isinstance(want, torch.Tensor):
        assert got.device.type == "tpu", (what, got.device)
        assert got.layout == want.layout, (what, got.layout, want.layout)
        assert got.dtype == want.dtype, (what, got.dtype, want.dtype)
        assert got.shape == want.shape, (what, got.shape, want.shape)
        if want.layout == torch.sparse_coo:
            assert got.is_coalesced() == want.is_coalesced(), what
            assert got.sparse_dim() == want.sparse_dim(), what
            if want.is_coalesced():
                assert got._indices().cpu().tolist() == want._indices().tolist(), what
            got, want = got.to_dense(), want.to_dense()
        # bfloat16 sums of several entries round at each step on one side and
        # once on the other: allow two units in the last place at these sizes.
        tol = {"atol": 0.07, "rtol": 1.6e-2} if want.dtype == torch.bfloat16 else {}
        torch.testing.assert_close(got.cpu(), want, msg=lambda m: f"{what}: {m}", **tol)
    elif isinstance(want, (tuple, list)):
        for i, (g, w) in enumerate(zip(got, want)):
            same(g, w, f"{what}[{i}]")
    else:
        assert got == want, (what, got, want)


def on_both(what, f, *args):
    import torch
    want = f(*args)
    got = f(*[a.to("tpu") if isinstance(a, torch.Tensor) else a for a in args])
    same(got, want, what)


def compare(daemon, fn, timeout=300):
    run_in_child(daemon, fn, timeout=timeout)


@pytest.mark.slow
def test_coo_ops_equal_cpu_over_dtypes_and_duplicates(tpud):
    compare(tpud, _coo_ops_equal_cpu_over_dtypes_and_duplicates, timeout=600)


def _coo_ops_equal_cpu_over_dtypes_and_duplicates():
    import torch
    import torch_tpu  # noqa: F401
    g = torch.Generator().manual_seed(0)
    def random_coo(shape, nnz, sparse_dim, dtype):
        idx = torch.stack([torch.randint(0, shape[d], (nnz,), generator=g)
                           for d in range(sparse_dim)])
        vals = (torch.randn((nnz,) + tuple(shape[sparse_dim:]), generator=g) * 4)
        vals = vals.to(dtype) if dtype.is_floating_point or dtype.is_complex \
            else vals.round().to(dtype)
        return torch.sparse_coo_tensor(idx, vals, shape)  # duplicates, uncoalesced
    for dtype in (torch.float32, torch.float64, torch.bfloat16, torch.int64,
                  torch.complex64):
        for shape, sd in (((6, 5), 2), ((4, 3, 2), 2), ((7,), 1), ((5, 4, 3), 3)):
            s = random_coo(shape, 9, sd, dtype)
            t = random_coo(shape, 6, sd, dtype)
            dense = (torch.randn(shape, generator=g) * 3).to(dtype)
            tag = f"{dtype} {shape}/{sd}"
            on_both(f"coalesce {tag}", lambda a: a.coalesce(), s)
            on_both(f"indices/values {tag}",
                    lambda a: (a.coalesce().indices(), a.coalesce().values()), s)
            on_both(f"to_dense {tag}", lambda a: a.to_dense(), s)
            on_both(f"to_sparse {tag}", lambda d: d.to_sparse(sd), dense)
            on_both(f"sum {tag}", lambda a: a.sum(), s)
            on_both(f"sparse.sum dim0 {tag}", lambda a: torch.sparse.sum(a, 0), s)
            on_both(f"dense+sparse {tag}", lambda d, a: d + a, dense, s)
            on_both(f"dense.add_ alpha {tag}", lambda d, a: d.clone().add_(a, alpha=2),
                    dense, s)
            on_both(f"sparse+sparse {tag}", lambda a, b: a + b, s, t)
            on_both(f"coalesced+coalesced {tag}", lambda a, b: a.coalesce() + b.coalesce(),
                    s, t)
            on_both(f"sparse-sparse {tag}", lambda a, b: a - b, s, t)
            on_both(f"sparse*dense {tag}", lambda a, d: a * d, s, dense)
            on_both(f"dense*sparse {tag}", lambda d, a: d * a, dense, s)
            on_both(f"sparse*sparse {tag}", lambda a, b: a * b, s, t)
            on_both(f"sparse*scalar {tag}", lambda a: a * 3, s)
            on_both(f"neg {tag}", lambda a: -a, s)
            if dtype.is_floating_point:
                on_both(f"sparse/scalar {tag}", lambda a: a / 2, s)
                on_both(f"sin {tag}", lambda a: torch.sin(a), s)
                on_both(f"pow {tag}", lambda a: a.pow(2), s)
            on_both(f"to cpu {tag}", lambda a: a.cpu() if a.device.type == "cpu" else a,
                    s)
            on_both(f"sparse_mask {tag}", lambda d, a: d.sparse_mask(a.coalesce()), dense, s)
    print("ok")


def test_sparse_matmuls_equal_cpu(tpud):
    compare(tpud, _sparse_matmuls_equal_cpu, timeout=300)


def _sparse_matmuls_equal_cpu():
    import torch
    import torch_tpu  # noqa: F401
    g = torch.Generator().manual_seed(1)
    for dtype in (torch.float32, torch.float64, torch.complex64):
        a = (torch.randn(7, 5, generator=g) * (torch.rand(7, 5, generator=g) < 0.4)).to(dtype)
        b = (torch.randn(5, 6, generator=g) * (torch.rand(5, 6, generator=g) < 0.4)).to(dtype)
        dense = torch.randn(5, 3, generator=g).to(dtype)
        bias = torch.randn(7, 3, generator=g).to(dtype)
        sa, sb = a.to_sparse(), b.to_sparse()
        # An uncoalesced operand: the same entries split in two.
        half = torch.sparse_coo_tensor(torch.cat([sa.indices(), sa.indices()], 1),
                                       torch.cat([sa.values() / 2, sa.values() / 2]),
                                       sa.shape)
        on_both(f"sparse.mm(s, d) {dtype}", torch.sparse.mm, sa, dense)
        on_both(f"mm uncoalesced {dtype}", torch.mm, half, dense)
        on_both(f"s @ d {dtype}", lambda x, y: x @ y, sa, dense)
        on_both(f"addmm {dtype}", lambda c, x, y: torch.addmm(c, x, y, beta=0.5, alpha=2),
                bias, sa, dense)
        on_both(f"sparse.addmm {dtype}", torch.sparse.addmm, bias, sa, dense)
        on_both(f"sparse.mm(s, s) {dtype}", torch.sparse.mm, sa, sb)
        on_both(f"sparse.mm(s, s) uncoalesced {dtype}", torch.sparse.mm, half, sb)
    empty = torch.sparse_coo_tensor(torch.zeros(2, 0, dtype=torch.long), torch.zeros(0),
                                    (4, 5))
    on_both("empty @ dense", torch.sparse.mm, empty, torch.randn(5, 2))
    on_both("empty @ sparse", torch.sparse.mm, empty, torch.randn(5, 2).to_sparse())
    print("ok")


def test_gradients_through_sparse_ops_equal_cpu(tpud):
    compare(tpud, _gradients_through_sparse_ops_equal_cpu, timeout=300)


def _gradients_through_sparse_ops_equal_cpu():
    import torch
    import torch_tpu  # noqa: F401
    g = torch.Generator().manual_seed(2)
    idx = torch.tensor([[0, 1, 1, 3, 0], [2, 0, 0, 1, 2]])
    vals = torch.randn(5, generator=g)
    w0 = torch.randn(4, 3, generator=g)
    x0 = torch.randn(4, 4, generator=g)
    scale = torch.arange(12.).reshape(4, 3)

    def grads(device):
        v = vals.clone().to(device).requires_grad_()
        w = w0.clone().to(device).requires_grad_()
        x = x0.clone().to(device).requires_grad_()
        s = torch.sparse_coo_tensor(idx.to(device), v, (4, 4))
        loss = (torch.sparse.mm(s, w) * scale.to(device)).sum()
        loss = loss + torch.sparse.sum(s, 1).to_dense().pow(2).sum()
        loss = loss + (s.coalesce() * x).to_dense().sum()
        loss = loss + x.sparse_mask(s.coalesce()).to_dense().mul(3).sum()
        loss.backward()
        return loss.detach(), v.grad, w.grad, x.grad

    want = grads("cpu")
    got = grads("tpu")
    for name, a, b in zip(("loss", "values", "weight", "dense"), got, want):
        same(a, b, name)

    # A sparse-input linear model trains as on the CPU (SGD steps).
    torch.manual_seed(0)
    ref = torch.nn.Linear(6, 2)
    dev = torch.nn.Linear(6, 2).to("tpu")
    dev.load_state_dict(ref.state_dict())
    opt_r = torch.optim.SGD(ref.parameters(), lr=0.1)
    opt_d = torch.optim.SGD(dev.parameters(), lr=0.1)
    for step in range(3):
        feats = (torch.rand(8, 6, generator=g) < 0.3).float().to_sparse()
        target = torch.randn(8, 2, generator=g)
        for model, opt, dv in ((ref, opt_r, "cpu"), (dev, opt_d, "tpu")):
            opt.zero_grad()
            out = torch.sparse.addmm(model.bias.expand(8, 2), feats.to(dv),
                                     model.weight.t())
            torch.nn.functional.mse_loss(out, target.to(dv)).backward()
            opt.step()
        for p, q in zip(ref.parameters(), dev.parameters()):
            same(q.detach(), p.detach(), f"step {step}")
    print("ok")


def test_index_select_and_sparse_softmax_equal_cpu(tpud):
    compare(tpud, _index_select_and_sparse_softmax_equal_cpu)


def _index_select_and_sparse_softmax_equal_cpu():
    import torch
    import torch_tpu  # noqa: F401
    g = torch.Generator().manual_seed(3)
    idx = torch.tensor([[0, 0, 1, 2, 2, 0], [0, 2, 1, 0, 2, 2]])  # (0, 2) twice
    for dense_shape in ((), (3,)):
        vals = torch.randn((6,) + dense_shape, generator=g)
        s = torch.sparse_coo_tensor(idx, vals, (3, 4) + dense_shape)
        for dim in range(s.dim()):
            on_both(f"index_select dim {dim} {dense_shape}",
                    lambda a, i: a.index_select(dim, i), s,
                    torch.tensor([2, 0, 2, 1]) if dim != 1 else torch.tensor([3, 2, 0, 2]))
            on_both(f"softmax dim {dim} {dense_shape}",
                    lambda a: torch.sparse.softmax(a, dim), s)
            on_both(f"log_softmax dim {dim} {dense_shape}",
                    lambda a: torch.sparse.log_softmax(a, dim), s)
    for i in ([], [1], [2, 2]):
        on_both(f"index_select {i}", lambda a, i: a.index_select(0, i), s.coalesce(),
                torch.tensor(i, dtype=torch.long))
    # Gradients through softmax of sparse values (a GAT-style attention).
    scale = torch.randn(3, 4, generator=g)
    def grads(device, log):
        v = torch.randn(6, generator=torch.Generator().manual_seed(5)).to(device)
        v.requires_grad_()
        a = torch.sparse_coo_tensor(idx.to(device), v, (3, 4))
        f = torch.sparse.log_softmax if log else torch.sparse.softmax
        (f(a, 1).to_dense() * scale.to(device)).sum().backward()
        return v.grad
    for log in (False, True):
        same(grads("tpu", log), grads("cpu", log), f"softmax grad log={log}")
    try:
        s.to("tpu").index_select(0, torch.tensor([7], device="tpu"))
        raise AssertionError("no error")
    except IndexError as e:
        assert "out of range" in str(e), e
    print("ok")


def test_other_layouts_and_unsupported_ops_fail_clearly_and_work_goes_on(tpud):
    run_in_child(tpud, _other_layouts_and_unsupported_ops_fail_clearly_and_work_goes_on)


def _other_layouts_and_unsupported_ops_fail_clearly_and_work_goes_on():
    import torch
    import torch_tpu  # noqa: F401
    x = torch.tensor([[0., 1.], [2., 0.]])
    xt = x.to("tpu")
    def fails(f, *words):
        try:
            f()
        except (RuntimeError, NotImplementedError) as e:
            msg = str(e)
            for w in words:
                assert w in msg, (w, msg)
            return
        raise AssertionError("no error")
    fails(lambda: xt.to_sparse_csr(), "torch.sparse_csr", "not supported on tpu")
    fails(lambda: xt.to_sparse(layout=torch.sparse_csc), "torch.sparse_csc")
    fails(lambda: xt.to_sparse_bsr((1, 1)), "torch.sparse_bsr")
    fails(lambda: x.to_sparse_csr().to("tpu").to_dense(), "torch.sparse_csr",
          "not supported on tpu")
    s = xt.to_sparse()
    fails(lambda: torch.bmm(torch.stack([s, s]), torch.ones(2, 2, 2, device="tpu")),
          "aten::bmm", "sparse COO", "to_dense")
    fails(lambda: torch.sparse_coo_tensor(torch.tensor([[5], [0]], device="tpu"),
                                          torch.tensor([1.], device="tpu"), (2, 2),
                                          check_invariants=True),
          "index 5")
    fails(lambda: torch.sparse_coo_tensor(
        torch.tensor([[0, 1], [0, 1], [0, 1]], device="tpu"), torch.ones(2, device="tpu"),
        (2**40, 2**40, 2**40)).coalesce(), "overflow")
    # Everything still works afterwards, in the same process.
    assert (s + s).to_dense().cpu().tolist() == [[0., 2.], [4., 0.]]
    assert torch.relu(xt - 1).sum().item() == 1.0
    print("ok")


def test_shared_kernel_list_matches_installed_torch(tpud):
    # Every op whose tpu sparse kernel is ATen's shared one must have the same
    # kernel for SparseCPU and SparseCUDA in the installed torch's
    # native_functions.yaml: that is what makes it device generic.
    r = run_in_child(tpud, _shared_kernel_list_matches_installed_torch)
    lines = r.stdout.splitlines()
    yaml_path = pathlib.Path(lines[0]) / "packaged/ATen/native/native_functions.yaml"
    if not yaml_path.exists():
        pytest.skip("torchgen's native_functions.yaml is not installed")
    yaml = pytest.importorskip("yaml")
    shared = set()
    for entry in yaml.safe_load(yaml_path.read_text()):
        kernels = {}
        for keys, fn in (entry.get("dispatch") or {}).items():
            for k in keys.split(","):
                kernels[k.strip()] = fn
        if "SparseCPU" in kernels and kernels["SparseCPU"] == kernels.get("SparseCUDA"):
            shared.add(entry["func"].split("(")[0])
    listed = lines[1:]
    assert len(listed) > 100
    assert not set(listed) - shared, sorted(set(listed) - shared)


def _shared_kernel_list_matches_installed_torch():
    import os
    import torch_tpu
    import torchgen
    print(os.path.dirname(torchgen.__file__))
    print("\n".join(torch_tpu._C._sparse_shared_kernels()))
