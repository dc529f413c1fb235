"""Linear algebra on the PJRT backend beyond real matrices: complex LU, QR,
Householder products, Cholesky solves, eigh and SVD against the CPU's
LAPACK, and the nonsymmetric eigendecomposition (linalg.eig), whose
eigenvalues PyTorch returns in no specified order."""
import pytest

from conftest import Daemon, pjrt_flags, run_in_child


@pytest.fixture(scope="module", params=["host", pytest.param("device", marks=pytest.mark.slow)])
def pjrt(request):
    pytest.importorskip("xla_plugins.xla_cpu_pjrt")
    d = Daemon(hbm="512MiB", extra_flags=pjrt_flags() + [f"--pjrt_memory={request.param}"])
    yield d
    d.stop()


def test_complex_factorizations_and_solves_match_cpu(pjrt):
    run_in_child(pjrt, _complex_factorizations_and_solves_match_cpu)


def _complex_factorizations_and_solves_match_cpu():
    import torch
    import torch_tpu  # noqa: F401
    torch.manual_seed(0)
    close = torch.testing.assert_close
    lu_factor, lu_solve = torch.linalg.lu_factor, torch.linalg.lu_solve

    def t(*xs):
        return [x.to("tpu") for x in xs]

    for dtype in (torch.complex64, torch.complex128):
        tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.complex64 else {}
        a = torch.randn(3, 4, 4, dtype=dtype)
        b = torch.randn(3, 4, 2, dtype=dtype)
        r = torch.randn(5, 3, dtype=dtype)
        c = torch.randn(5, 2, dtype=dtype)
        h = a @ a.mH + torch.eye(4)
        upper = torch.triu(a) + 3 * torch.eye(4)
        cases = {
            "det": (torch.linalg.det, (a,)),
            "slogdet": (torch.linalg.slogdet, (a,)),
            "inv": (torch.linalg.inv, (a,)),
            "solve": (torch.linalg.solve, (a, b)),
            # pivots as LAPACK's getrf picks them, by |re| + |im|
            "lu_factor": (lu_factor, (a,)),
            "lu": (torch.linalg.lu, (a,)),
            "lu_solve adjoint": (lambda x, y: lu_solve(*lu_factor(x), y, adjoint=True), (a, b)),
            "lu_solve right": (lambda x, y: lu_solve(*lu_factor(x), y.mT, left=False), (a, b)),
            "lu_solve right adjoint": (
                lambda x, y: lu_solve(*lu_factor(x), y.mT, left=False, adjoint=True), (a, b)),
            # reflectors as LAPACK's geqrf makes them (a real beta, R = Q^H A)
            "geqrf": (torch.geqrf, (r,)),
            "qr": (torch.linalg.qr, (r,)),
            "qr complete": (lambda x: torch.linalg.qr(x, mode="complete"), (r,)),
            "householder_product": (lambda x: torch.linalg.householder_product(*torch.geqrf(x)),
                                    (r,)),
            "ormqr": (lambda x, y: torch.ormqr(*torch.geqrf(x), y), (r, c)),
            "ormqr adjoint": (lambda x, y: torch.ormqr(*torch.geqrf(x), y, transpose=True),
                              (r, c)),
            "ormqr right": (lambda x, y: torch.ormqr(*torch.geqrf(x), y.mT, left=False), (r, c)),
            "ormqr right adjoint": (
                lambda x, y: torch.ormqr(*torch.geqrf(x), y.mT, left=False, transpose=True),
                (r, c)),
            "cholesky_solve": (lambda x, y: torch.cholesky_solve(y, torch.linalg.cholesky(x)),
                               (h, b)),
            "cholesky_solve upper": (
                lambda x, y: torch.cholesky_solve(y, torch.linalg.cholesky(x, upper=True),
                                                  upper=True), (h, b)),
            "cholesky_inverse": (lambda x: torch.cholesky_inverse(torch.linalg.cholesky(x[0])),
                                 (h,)),
            # transpose=True is A^T, not A^H, for complex A too
            "triangular_solve transpose": (
                lambda x, y: torch.triangular_solve(y, x, transpose=True).solution, (upper, b)),
            "matrix_exp": (torch.linalg.matrix_exp, (a * 0.5,)),
            "eigvalsh": (torch.linalg.eigvalsh, (h,)),
            "svdvals": (torch.linalg.svdvals, (r,)),
            "pinv": (torch.linalg.pinv, (r,)),
        }
        for name, (f, xs) in cases.items():
            want = f(*xs)
            got = f(*t(*xs))
            if isinstance(want, torch.Tensor):
                want, got = [want], [got]
            for w, g in zip(want, got):
                assert g.device.type == "tpu", name
                close(g.cpu(), w, msg=lambda m: f"{name} {dtype}: {m}", **tol)
        # Eigenvectors and singular vectors up to a phase each.
        w, v = torch.linalg.eigh(h)
        wt, vt = torch.linalg.eigh(h.to("tpu"))
        close(wt.cpu(), w, **tol)
        close(vt.cpu().abs(), v.abs(), **tol)
        for full in (False, True):
            u, s, vh = torch.linalg.svd(r, full_matrices=full)
            ut, st, vht = [x.cpu() for x in torch.linalg.svd(r.to("tpu"), full_matrices=full)]
            close(st, s, **tol)
            close((ut[:, :3] * st.to(dtype)) @ vht[:3], r, **tol)
            close(ut[:, :3].abs(), u[:, :3].abs(), **tol)
    # An empty result of a solve, whatever its strides.
    got = torch.linalg.solve(torch.zeros(2, 0, 0, device="tpu"), torch.zeros(2, 0, 3, device="tpu"))
    assert got.shape == (2, 0, 3)


def test_eig_gives_cpus_eigenvalues_and_true_eigenvectors(pjrt):
    run_in_child(pjrt, _eig_gives_cpus_eigenvalues_and_true_eigenvectors)


def _eig_gives_cpus_eigenvalues_and_true_eigenvectors():
    import torch
    import torch_tpu  # noqa: F401
    torch.manual_seed(0)
    cases = {
        "float32": torch.randn(4, 4), "float32 batch": torch.randn(3, 5, 5),
        "float64": torch.randn(6, 6, dtype=torch.float64),
        "complex64": torch.randn(2, 4, 4, dtype=torch.complex64),
        "rotation": torch.tensor([[0.0, 1.0], [-1.0, 0.0]]),  # +-i
        "cyclic permutation": torch.tensor([[0.0, 1, 0], [0, 0, 1], [1, 0, 0]]),
        "triangular": torch.triu(torch.randn(5, 5)), "identity": torch.eye(3),
        "zeros": torch.zeros(3, 3), "1x1": torch.tensor([[2.5]]), "20x20": torch.randn(20, 20),
    }
    for name, a in cases.items():
        w, v = (x.cpu() for x in torch.linalg.eig(a.to("tpu")))
        cw, cv = torch.linalg.eig(a)
        assert (w.dtype, v.dtype, w.shape, v.shape) == (cw.dtype, cv.dtype, cw.shape, cv.shape)
        eps = 1e-12 if a.dtype == torch.float64 else 1e-5
        scale = max(a.abs().max().item(), 1.0)
        # The CPU's eigenvalues, in some order: each is one of tpu's.
        apart = (w.unsqueeze(-1) - cw.unsqueeze(-2)).abs()
        assert apart.min(-2).values.max() <= 10 * eps * scale * a.shape[-1], name
        # A V = V diag(w), columns of unit length, the largest entry real.
        av = a.to(v.dtype) @ v
        assert (av - v * w.unsqueeze(-2)).abs().max() <= 10 * eps * scale * a.shape[-1], name
        torch.testing.assert_close(v.abs().pow(2).sum(-2), torch.ones(w.shape, dtype=w.real.dtype))
        top = v.abs().argmax(-2, keepdim=True)  # (near ties: rounding may pick another)
        assert v.gather(-2, top).imag.abs().max() <= 1e-6, name
        assert torch.allclose(torch.linalg.eigvals(a.to("tpu")).cpu(), w), name
    assert torch.linalg.eig(torch.zeros(0, 0, device="tpu")).eigenvalues.shape == (0,)
    # The gradient through the eigenvalues (order-free: their sum and the
    # sum of their squares) is the CPU's.
    a = torch.randn(4, 4, dtype=torch.float64)
    x, y = a.clone().requires_grad_(), a.to("tpu").requires_grad_()
    for m in (x, y):
        w = torch.linalg.eigvals(m)
        (w.real.sum() + (w * w).real.sum()).backward()
    torch.testing.assert_close(y.grad.cpu(), x.grad)
