"""LDL^T of symmetric matrices (LDL^H of Hermitian ones) on the PJRT
backend, as LAPACK's sytf2 and sytrs (hetf2 and hetrs) compute it (the lower
form, which torch.linalg uses): Bunch-Kaufman pivoting with 1x1 and 2x2
blocks, magnitudes compared as |re| + |im|, the same pivots, the same
compact LD.

Which pivot a column takes depends on its values, so each step reads a few
scalars (the column's largest entries) to the host, as LAPACK's own loop
does; the arithmetic runs on the device, step by step.
"""
import math

import torch

_ALPHA = (1 + math.sqrt(17)) / 8  # Bunch-Kaufman's threshold


def _swap_rows(a, i, j):
    if i != j:
        rows = a[[i, j]].clone()
        a[[j, i]] = rows


def _cabs1(x):
    """LAPACK's cabs1: |re| + |im| (|x| of real x)."""
    return x.real.abs() + x.imag.abs() if x.is_complex() else x.abs()


def _conj(x, hermitian):
    return x.conj() if hermitian and x.is_complex() else x


def _real_diagonal(a, lo, hermitian):
    """The diagonal of a[lo:, lo:] made real (hetf2 keeps it so)."""
    if hermitian and a.is_complex() and lo < a.shape[0]:
        d = a[lo:, lo:].diagonal()
        d.copy_(d.real.to(a.dtype))


def _factor_one(a, hermitian):
    """sytf2 / hetf2 (lower) of one n x n matrix, in place: (pivots, info)."""
    n = a.shape[0]
    pivots = [0] * n
    info = 0
    herm = hermitian and a.is_complex()
    # A diagonal entry's magnitude: hetf2 reads only its real part.
    diag_mag = (lambda x: x.real.abs()) if herm else _cabs1
    _real_diagonal(a, 0, herm)
    k = 0
    while k < n:
        step = 1
        below = _cabs1(a[k + 1:, k])
        if k < n - 1:
            col_at = int(below.argmax().item()) + k + 1
            absakk, colmax = (float(v) for v in
                              torch.stack([diag_mag(a[k, k]), _cabs1(a[col_at, k])]).tolist())
        else:
            col_at, absakk, colmax = k, float(diag_mag(a[k, k]).item()), 0.0
        if max(absakk, colmax) == 0 or math.isnan(absakk):
            if info == 0:
                info = k + 1
            kp = k
        else:
            if absakk >= _ALPHA * colmax:
                kp = k
            else:
                imax = col_at
                # The largest off-diagonal entry of row/column imax in the
                # trailing matrix (its row left of the diagonal, its column
                # below).
                parts = [_cabs1(a[imax, k:imax])]
                if imax < n - 1:
                    parts.append(_cabs1(a[imax + 1:, imax]))
                rowmax, diag = (float(v) for v in torch.stack(
                    [torch.cat(parts).max(), diag_mag(a[imax, imax])]).tolist())
                if absakk >= _ALPHA * colmax * (colmax / rowmax):
                    kp = k
                elif diag >= _ALPHA * rowmax:
                    kp = imax
                else:
                    kp = imax
                    step = 2
            kk = k + step - 1
            if kp != kk:
                # Rows and columns kk and kp of the trailing matrix swapped
                # (lower triangle only).
                if kp < n - 1:
                    col = a[kp + 1:, kk].clone()
                    a[kp + 1:, kk] = a[kp + 1:, kp]
                    a[kp + 1:, kp] = col
                if kp > kk + 1:
                    # (Hermitian: the segment crosses the diagonal, so it
                    # is conjugated, and so is the entry where they meet.)
                    col = a[kk + 1:kp, kk].clone()
                    a[kk + 1:kp, kk] = _conj(a[kp, kk + 1:kp], herm)
                    a[kp, kk + 1:kp] = _conj(col, herm)
                if herm:
                    a[kp, kk] = a[kp, kk].conj()
                d = a[kk, kk].clone()
                a[kk, kk] = a[kp, kp]
                a[kp, kp] = d
                if step == 2:
                    v = a[k + 1, k].clone()
                    a[k + 1, k] = a[kp, k]
                    a[kp, k] = v
            if step == 1:
                if k < n - 1:
                    # A(k+1:, k+1:) -= x x^T / d (x x^H), then x /= d.
                    r = 1 / (a[k, k].real if herm else a[k, k])
                    x = a[k + 1:, k].clone()
                    a[k + 1:, k + 1:] += torch.outer(x, -r * _conj(x, herm))
                    a[k + 1:, k] = x * r
                    _real_diagonal(a, k + 1, herm)
            elif k < n - 2 and herm:
                a21 = a[k + 1, k]
                d = a21.abs()
                d11 = a[k + 1, k + 1].real / d
                d22 = a[k, k].real / d
                t = 1 / (d11 * d22 - 1)
                d21 = a21 / d
                d = t / d
                x0, x1 = a[k + 2:, k].clone(), a[k + 2:, k + 1].clone()
                wk = d * (d11 * x0 - d21 * x1)
                wkp1 = d * (d22 * x1 - d21.conj() * x0)
                a[k + 2:, k + 2:] -= torch.outer(x0, wk.conj()) + torch.outer(x1, wkp1.conj())
                a[k + 2:, k] = wk
                a[k + 2:, k + 1] = wkp1
                _real_diagonal(a, k + 2, herm)
            elif k < n - 2:
                d21 = a[k + 1, k]
                d11 = a[k + 1, k + 1] / d21
                d22 = a[k, k] / d21
                t = 1 / (d11 * d22 - 1)
                d21 = t / d21
                x0, x1 = a[k + 2:, k].clone(), a[k + 2:, k + 1].clone()
                wk = d21 * (d11 * x0 - x1)
                wkp1 = d21 * (d22 * x1 - x0)
                a[k + 2:, k + 2:] -= torch.outer(x0, wk) + torch.outer(x1, wkp1)
                a[k + 2:, k] = wk
                a[k + 2:, k + 1] = wkp1
        if step == 1:
            pivots[k] = kp + 1
        else:
            pivots[k] = pivots[k + 1] = -(kp + 1)
        k += step
    return pivots, info


def linalg_ldl_factor_ex(self, *, hermitian=False, check_errors=False):
    torch._check(self.dim() >= 2 and self.shape[-1] == self.shape[-2],
                 lambda: "torch.linalg.ldl_factor_ex: A must be batches of square matrices, "
                         f"but they are {self.shape[-2]} by {self.shape[-1]} matrices")
    n = self.shape[-1]
    batch = self.shape[:-2]
    count = math.prod(batch)
    flat = self.reshape(count, n, n).clone()
    pivots = torch.zeros(flat.shape[0], n, dtype=torch.int32)
    info = torch.zeros(flat.shape[0], dtype=torch.int32)
    for b in range(flat.shape[0]):
        p, i = _factor_one(flat[b], hermitian)
        pivots[b] = torch.tensor(p, dtype=torch.int32)
        info[b] = i
        if check_errors and i > 0:
            raise RuntimeError(f"torch.linalg.ldl_factor_ex: The factorization could not be "
                               f"completed because the input is not invertible: {i}-th "
                               f"diagonal of D is zero")
    ld = flat.tril().reshape(self.shape)
    return (ld, pivots.reshape(*batch, n).to(self.device),
            info.reshape(batch).to(self.device))


def _solve_one(a, pivots, b, hermitian):
    """sytrs / hetrs (lower): A X = B from A's compact LD and pivots, in
    place on b."""
    n = a.shape[0]
    herm = hermitian and a.is_complex()
    k = 0
    while k < n:  # L D Y = P B
        if pivots[k] > 0:
            _swap_rows(b, k, pivots[k] - 1)
            if k < n - 1:
                b[k + 1:] -= torch.outer(a[k + 1:, k], b[k])
            # (times the reciprocal, as LAPACK scales: 1 / 0 is NaN in complex)
            b[k] = b[k] * (1 / (a[k, k].real if herm else a[k, k]))
            k += 1
        else:
            _swap_rows(b, k + 1, -pivots[k] - 1)
            if k < n - 2:
                b[k + 2:] -= torch.outer(a[k + 2:, k], b[k])
                b[k + 2:] -= torch.outer(a[k + 2:, k + 1], b[k + 1])
            off = a[k + 1, k]
            first, second = a[k, k] / _conj(off, herm), a[k + 1, k + 1] / off
            denom = first * second - 1
            y0, y1 = b[k] / _conj(off, herm), b[k + 1] / off
            b[k], b[k + 1] = (second * y0 - y1) / denom, (first * y1 - y0) / denom
            k += 2
    k = n - 1
    while k >= 0:  # L^T X = Y (L^H X = Y), then the rows put back
        if pivots[k] > 0:
            if k < n - 1:
                b[k] -= _conj(a[k + 1:, k], herm) @ b[k + 1:]
            _swap_rows(b, k, pivots[k] - 1)
            k -= 1
        else:
            if k < n - 1:
                b[k] -= _conj(a[k + 1:, k], herm) @ b[k + 1:]
                b[k - 1] -= _conj(a[k + 1:, k - 1], herm) @ b[k + 1:]
            _swap_rows(b, k, -pivots[k] - 1)
            k -= 2
    return b


def linalg_ldl_solve(LD, pivots, B, *, hermitian=False):
    torch._check(LD.dim() >= 2 and B.dim() >= 2,
                 lambda: "torch.linalg.ldl_solve: LD and B must have at least 2 dimensions")
    torch._check(LD.shape[-1] == LD.shape[-2] == B.shape[-2],
                 lambda: "torch.linalg.ldl_solve: incompatible shapes of LD and B")
    torch._check(pivots.dtype == torch.int32,
                 lambda: "torch.linalg.ldl_solve: Expected pivots to be integers. Got "
                         f"{pivots.dtype}")
    torch._check(LD.dtype == B.dtype,
                 lambda: "torch.linalg.ldl_solve: LD dtype should match B dtype")
    n = LD.shape[-1]
    batch = torch.broadcast_shapes(LD.shape[:-2], B.shape[:-2], pivots.shape[:-1])
    count = math.prod(batch)
    lds = LD.expand(*batch, n, n).reshape(count, n, n)
    out = B.expand(*batch, *B.shape[-2:]).reshape(count, *B.shape[-2:]).clone()
    pivs = pivots.expand(*batch, n).reshape(count, n).cpu().tolist()
    for i in range(out.shape[0]):
        _solve_one(lds[i], pivs[i], out[i], hermitian)
    return out.reshape(*batch, *B.shape[-2:])


DECOMPOSITIONS = {
    "aten::linalg_ldl_factor_ex": linalg_ldl_factor_ex,
    "aten::linalg_ldl_solve": linalg_ldl_solve,
}
