"""Decompositions torch_tpu writes itself, for ops the PJRT backend does not
lower and PyTorch gives no decomposition of: each is written in ops that are
lowered (or decomposed in turn) and follows what ATen's CPU kernel returns,
statistics and index outputs included. `_decomp.install` registers them for
the ops outside the daemon's lowered set.

Ops whose result's size depends on the data (repeat_interleave without an
output_size) read that size first, one scalar, as CUDA does.
"""
import torch


def _int_scalars(t):
    return [int(v) for v in t.tolist()]


def linalg_lstsq(self, b, rcond=None, *, driver=None):
    """Least squares through the SVD, with the outputs of the driver asked
    for (CPU's default, gelsy: solution and rank)."""
    torch._check(self.dim() >= 2,
                 lambda: "torch.linalg.lstsq: input must have at least 2 dimensions.")
    torch._check(self.dim() >= b.dim() and self.dim() - b.dim() <= 1,
                 lambda: "torch.linalg.lstsq: input.dim() must be greater or equal to "
                         "other.dim() and (input.dim() - other.dim()) <= 1")
    torch._check(self.dtype == b.dtype,
                 lambda: f"torch.linalg.lstsq: Expected input and other to have the same "
                         f"dtype, but got input's dtype {self.dtype} and other's dtype "
                         f"{b.dtype}")
    driver = driver or "gelsy"
    torch._check(driver in ("gels", "gelsy", "gelsd", "gelss"),
                 lambda: "torch.linalg.lstsq: parameter `driver` should be one of "
                         "(gels, gelsy, gelsd, gelss)")
    vector = b.dim() == self.dim() - 1
    rhs = b.unsqueeze(-1) if vector else b
    m, n = self.shape[-2], self.shape[-1]
    torch._check(rhs.shape[-2] == m,
                 lambda: "torch.linalg.lstsq: input.size(-2) should match other.size(-2)")
    real = self.real.dtype if self.is_complex() else self.dtype
    if rcond is None or rcond < 0:
        rcond = torch.finfo(real).eps * max(m, n)
    u, s, vh = torch.linalg.svd(self, full_matrices=False)
    if driver == "gels":  # QR, no rank revealed: every singular value is used
        inv = s.reciprocal()
    else:
        keep = s > rcond * s[..., :1]
        inv = torch.where(keep, s.reciprocal(), torch.zeros_like(s))
    coeffs = (u.mH @ rhs) * inv.unsqueeze(-1)
    solution = vh.mH @ coeffs
    rank = self.new_empty(0, dtype=torch.int64)
    if driver != "gels":
        rank = keep.sum(-1)
    residuals = self.new_empty(0, dtype=real)
    if m > n and driver != "gelsy" and (
            driver == "gels" or bool((rank == n).all().item())):
        residuals = (self @ solution - rhs).abs().square().sum(-2)
    # (A new empty tensor each: autograd tells outputs apart by identity.)
    singular_values = s if driver in ("gelsd", "gelss") else self.new_empty(0, dtype=real)
    if vector:
        solution = solution.squeeze(-1)
    return solution, residuals, rank, singular_values


def rrelu_with_noise(self, noise, lower=0.125, upper=1.0 / 3.0, training=False,
                     generator=None):
    if not training:
        return torch.nn.functional.leaky_relu(self, (lower + upper) / 2)
    # Training: each element at or below zero gets a slope drawn from
    # U(lower, upper), kept in noise for the backward; the rest keep 1.
    slope = torch.empty_like(self).uniform_(lower, upper, generator=generator)
    below = self <= 0
    noise.copy_(torch.where(below, slope, torch.ones_like(slope)))
    return torch.where(below, self * slope, self)


def repeat_interleave(repeats, *, output_size=None):
    torch._check(repeats.dim() == 1, lambda: "repeat_interleave only accept 1D vector as repeat")
    torch._check(repeats.dtype in (torch.int32, torch.int64),
                 lambda: "repeats has to be Long or Int tensor")
    if repeats.numel() == 0:
        return repeats.new_empty(0)
    if output_size is None:  # (given, it spares the read, as on CUDA)
        total, lowest = _int_scalars(torch.stack([repeats.sum(), repeats.min()]).to(torch.int64))
        torch._check(lowest >= 0, lambda: "repeats can not be negative")
        output_size = total
    ends = repeats.cumsum(0)
    positions = torch.arange(output_size, device=repeats.device, dtype=ends.dtype)
    return torch.searchsorted(ends, positions, right=True).to(repeats.dtype)


def bincount(self, weights=None, minlength=0):
    """Counts (or summed weights) of each value; the length, max + 1 or
    minlength, read from the data (one read of the max and the min)."""
    torch._check(minlength >= 0, lambda: "minlength should be >= 0")
    torch._check(self.dim() == 1 and not self.is_floating_point() and not self.is_complex(),
                 lambda: "bincount only supports 1-d non-negative integral inputs.")
    torch._check(weights is None or (weights.dim() == 1 and weights.shape[0] == self.shape[0]),
                 lambda: "weights should be 1-d and have the same length as input")
    dtype = torch.int64 if weights is None else (
        torch.float32 if weights.dtype == torch.float32 else torch.float64)
    length = minlength
    if self.numel() > 0:
        top, lowest = _int_scalars(torch.stack([self.max(), self.min()]).to(torch.int64))
        torch._check(lowest >= 0, lambda: "bincount only supports 1-d non-negative integral "
                                          "inputs.")
        length = max(length, top + 1)
    values = torch.ones_like(self, dtype=dtype) if weights is None else weights.to(dtype)
    return torch.zeros(length, dtype=dtype, device=self.device).index_add(
        0, self.to(torch.int64), values)


def _unique(self, sorted=True, return_inverse=False):
    values, inverse, _ = torch.ops.aten._unique2(self, sorted, return_inverse, False)
    return values, inverse


def unique_dim(self, dim, sorted=True, return_inverse=False, return_counts=False):
    """The distinct slices along dim, in lexicographic order (ATen sorts
    whatever `sorted` says), each slice's group and the groups' sizes; the
    number of groups is read from the data."""
    torch._check(self.dim() > 0, lambda: "unique_dim: expected a tensor with dimensions")
    dim = dim % self.dim()
    n = self.shape[dim]
    if n == 0:
        empty = torch.zeros(0, dtype=torch.int64, device=self.device)
        return self.clone(), empty, empty.clone()
    torch._check(self.numel() > 0, lambda: "There are 0 sized dimensions, and they aren't "
                                           "selected, so unique cannot be applied")
    moved = self.movedim(dim, 0)
    rows = moved.reshape(n, -1)
    keys = rows.to(torch.int64) if rows.dtype == torch.bool else rows
    order = torch.arange(n, device=self.device)
    for c in reversed(range(keys.shape[1])):  # stable sorts, last column first
        column = keys[:, c].index_select(0, order)
        order = order.index_select(0, torch.sort(column, stable=True).indices)
    ordered = keys.index_select(0, order)
    new = torch.ones(n, dtype=torch.bool, device=self.device)
    if n > 1:
        new = torch.cat([new[:1], (ordered[1:] != ordered[:-1]).any(1)])
    group = new.to(torch.int64).cumsum(0) - 1
    count = int(group[-1].item()) + 1
    inverse = torch.empty_like(group).scatter_(0, order, group)
    first = torch.full((count,), n, dtype=torch.int64, device=self.device).scatter_reduce(
        0, group, torch.arange(n, device=self.device), "amin")
    values = moved.index_select(0, order.index_select(0, first)).movedim(0, dim).contiguous()
    counts = torch.zeros(count, dtype=torch.int64, device=self.device).index_add(
        0, group, torch.ones_like(group))
    return values, inverse, counts


def hash_tensor(self, dim=(), *, keepdim=False, mode=0):
    """mode 0 (the only one): the XOR of the elements' bits, each element
    first widened to 64 bits (floating ones as float64)."""
    torch._check(mode == 0, lambda: f"Unknown hash_tensor mode: {mode}")
    dims = list(range(self.dim())) if len(dim) == 0 else [d % max(self.dim(), 1) for d in dim]
    if self.numel() == 0 and len(dim) == 0:
        raise RuntimeError("hash_tensor: Expected reduction dim to be specified for "
                           "input.numel() == 0. Specify the reduction dim with the 'dim' "
                           "argument.")
    for d in dims:
        if self.dim() > 0 and self.shape[d] == 0:
            raise IndexError(f"hash_tensor: Expected reduction dim {d} to have non-zero size.")
    if self.is_floating_point():
        bits = self.to(torch.float64).view(torch.int64)
    else:
        bits = self.to(torch.int64)
    if self.dim() == 0:
        out = bits
    else:
        kept = [d for d in range(self.dim()) if d not in dims]
        x = bits.permute(kept + dims).reshape([self.shape[d] for d in kept] + [-1])
        while x.shape[-1] > 1:  # pairwise XOR, halving the length each step
            if x.shape[-1] % 2:
                x = torch.cat([x, x.new_zeros(x.shape[:-1] + (1,))], -1)
            half = x.shape[-1] // 2
            x = torch.bitwise_xor(x[..., :half], x[..., half:])
        out = x.squeeze(-1)
        if keepdim:
            for d in sorted(dims):
                out = out.unsqueeze(d)
    return out.contiguous().view(torch.uint64)


def _unnormalize(coord, size, align_corners):
    if align_corners:
        return (coord + 1) / 2 * (size - 1)
    return ((coord + 1) * size - 1) / 2


def _reflect(coord, twice_low, twice_high):
    if twice_low == twice_high:
        return torch.zeros_like(coord)
    low = twice_low / 2
    span = (twice_high - twice_low) / 2
    coord = (coord - low).abs()
    extra = torch.fmod(coord, span)
    flips = torch.floor(coord / span)
    even = torch.remainder(flips, 2) == 0
    return torch.where(even, extra + low, span - extra + low)


def _source_index(coord, size, padding_mode, align_corners):
    """A grid coordinate in [-1, 1] as a position along a dimension of
    `size` elements, with the padding mode applied (ATen's
    grid_sampler_compute_source_index)."""
    coord = _unnormalize(coord, size, align_corners)
    if padding_mode == 1:  # border
        coord = coord.clamp(0, size - 1)
    elif padding_mode == 2:  # reflection
        if align_corners:
            coord = _reflect(coord, 0, 2 * (size - 1))
        else:
            coord = _reflect(coord, -1, 2 * size - 1)
        coord = coord.clamp(0, size - 1)
    return coord


def _in_float32(fn):
    """fn computed in float32 for float16 / bfloat16 tensors, the result
    rounded once (ATen's opmath type)."""
    def run(*args, **kwargs):
        half = [a.dtype for a in args if isinstance(a, torch.Tensor)
                and a.dtype in (torch.float16, torch.bfloat16)]
        if not half:
            return fn(*args, **kwargs)
        wide = [a.float() if isinstance(a, torch.Tensor) and a.dtype == half[0] else a
                for a in args]
        out = fn(*wide, **kwargs)
        if isinstance(out, torch.Tensor):
            return out.to(half[0])
        return tuple(o.to(half[0]) if isinstance(o, torch.Tensor) else o for o in out)

    return run


@_in_float32
def grid_sampler_3d(input, grid, interpolation_mode, padding_mode, align_corners):
    torch._check(interpolation_mode in (0, 1),
                 lambda: "grid_sampler(): bicubic interpolation only supports 4D input")
    torch._check(input.dim() == 5 and grid.dim() == 5 and grid.shape[-1] == 3,
                 lambda: "grid_sampler(): expected 5D input and grid with last dimension 3")
    n, c, d, h, w = input.shape
    out_shape = grid.shape[1:4]
    flat = input.reshape(n, c, d * h * w)
    x = _source_index(grid[..., 0], w, padding_mode, align_corners).reshape(n, -1)
    y = _source_index(grid[..., 1], h, padding_mode, align_corners).reshape(n, -1)
    z = _source_index(grid[..., 2], d, padding_mode, align_corners).reshape(n, -1)

    def corner(zi, yi, xi):
        """The input at integer positions, 0 outside the volume: (n, c, p)."""
        inside = (xi >= 0) & (xi < w) & (yi >= 0) & (yi < h) & (zi >= 0) & (zi < d)
        # (the flat index in int64: a float loses it past 2^24 elements)
        zl, yl, xl = (v.clamp(0, size - 1).to(torch.int64)
                      for v, size in ((zi, d), (yi, h), (xi, w)))
        index = (zl * h + yl) * w + xl
        index = index.unsqueeze(1).expand(n, c, index.shape[-1])
        values = torch.gather(flat, 2, index)
        return torch.where(inside.unsqueeze(1), values, torch.zeros_like(values))

    if interpolation_mode == 1:  # nearest, ties to even as nearbyint
        out = corner(torch.round(z), torch.round(y), torch.round(x))
        return out.reshape(n, c, *out_shape)
    x0, y0, z0 = torch.floor(x), torch.floor(y), torch.floor(z)
    fx, fy, fz = x - x0, y - y0, z - z0
    out = None
    for dz, wz in ((0, 1 - fz), (1, fz)):
        for dy, wy in ((0, 1 - fy), (1, fy)):
            for dx, wx in ((0, 1 - fx), (1, fx)):
                term = corner(z0 + dz, y0 + dy, x0 + dx) * (wz * wy * wx).unsqueeze(1)
                out = term if out is None else out + term
    return out.reshape(n, c, *out_shape)


def _grid_sampler_backward(forward):
    """A grid sampler's backward as the vector-Jacobian product of the
    forward decomposition `forward()` gives (torch.func.vjp, which runs the
    forward again; its pieces go to the daemon like any other ops)."""
    def backward(grad_output, input, grid, interpolation_mode, padding_mode, align_corners,
                 output_mask):
        with torch.enable_grad():
            _, vjp = torch.func.vjp(
                lambda i, g: forward()(i, g, interpolation_mode, padding_mode, align_corners),
                input, grid)
            grad_input, grad_grid = vjp(grad_output)
        return (grad_input if output_mask[0] else None,
                grad_grid if output_mask[1] else None)

    return backward


def _pytorch_grid_sampler_2d():
    import torch._decomp
    return torch._decomp.decomposition_table[torch.ops.aten.grid_sampler_2d.default]


_SUM, _MEAN, _MAX = 0, 1, 2


def _bags(indices, offsets, include_last_offset, padding_idx):
    """(number of bags, each index's bag, whether each index counts). With
    include_last_offset the last offset only ends the list: the last bag runs
    to the end of indices, as on CPU."""
    bags = offsets.shape[0] - (1 if include_last_offset else 0)
    starts = offsets[:bags]
    positions = torch.arange(indices.shape[0], device=indices.device, dtype=starts.dtype)
    offset2bag = torch.searchsorted(starts, positions, right=True) - 1
    counts = indices != padding_idx if padding_idx >= 0 else torch.ones_like(indices, dtype=torch.bool)
    return bags, offset2bag.to(torch.int64).clamp(min=0), counts


def _embedding_bag(weight, indices, offsets, scale_grad_by_freq=False, mode=0, sparse=False,
                   per_sample_weights=None, include_last_offset=False, padding_idx=-1):
    """EmbeddingBag as ATen's CPU kernel computes it: returns the bags'
    result, each index's bag, each bag's size (indices other than
    padding_idx) and, for max, the row that gave each maximum."""
    torch._check(indices.dim() == 1 and offsets.dim() == 1,
                 lambda: "embedding_bag: expected 1-D indices and offsets")
    torch._check(mode in (_SUM, _MEAN, _MAX), lambda: f"embedding_bag: unknown mode {mode}")
    torch._check(per_sample_weights is None or mode == _SUM,
                 lambda: "embedding_bag: per_sample_weights was not None. per_sample_weights "
                         "is only supported for mode='sum' (got mode='"
                         + ("mean" if mode == _MEAN else "max") + "'). Please open a feature "
                         "request on GitHub.")
    bags, offset2bag, counts = _bags(indices, offsets, include_last_offset, padding_idx)
    dim = weight.shape[1]
    rows = weight.index_select(0, indices)
    keep = counts.unsqueeze(1)
    # float16 / bfloat16 bags are weighted, summed and averaged in float32
    # and rounded once, as ATen's kernel accumulates them.
    acc = torch.float32 if weight.dtype in (torch.float16, torch.bfloat16) else weight.dtype
    if per_sample_weights is not None:
        rows = rows.to(acc) * per_sample_weights.unsqueeze(1).to(acc)
    bag_size = torch.zeros(bags, dtype=torch.int64, device=weight.device).index_add(
        0, offset2bag, counts.to(torch.int64))
    if mode == _MAX:
        target = offset2bag.unsqueeze(1).expand(-1, dim)
        lowest = torch.full_like(rows, float("-inf"))
        best = weight.new_zeros(bags, dim).scatter_reduce(
            0, target, torch.where(keep, rows, lowest), "amax", include_self=False)
        best = torch.where(bag_size.unsqueeze(1) > 0, best, torch.zeros_like(best))
        # The first index (in order) that attains its bag's maximum.
        n = indices.shape[0]
        position = torch.arange(n, device=weight.device).unsqueeze(1).expand(-1, dim)
        hits = keep & (rows == best.index_select(0, offset2bag))
        first = torch.full((bags, dim), n, dtype=torch.int64, device=weight.device).scatter_reduce(
            0, target, torch.where(hits, position, torch.full_like(position, n)), "amin")
        max_indices = torch.zeros_like(first)
        if n > 0:
            rows_of = indices.to(torch.int64).index_select(0, first.clamp(max=n - 1).flatten())
            max_indices = torch.where(first < n, rows_of.reshape(bags, dim), max_indices)
        return best, offset2bag, bag_size, max_indices
    rows = torch.where(keep, rows, torch.zeros_like(rows)).to(acc)
    out = rows.new_zeros(bags, dim).index_add(0, offset2bag, rows)
    if mode == _MEAN:
        out = out / bag_size.clamp(min=1).unsqueeze(1).to(acc)
    max_indices = bag_size.new_zeros(bags)
    return out.to(weight.dtype), offset2bag, bag_size, max_indices


def _embedding_bag_dense_backward(grad, indices, offset2bag, bag_size, maximum_indices,
                                  num_weights, scale_grad_by_freq, mode,
                                  per_sample_weights, padding_idx=-1):
    dim = grad.shape[1]
    result = grad.new_zeros(num_weights, dim)
    if mode == _MAX:
        valid = (bag_size > 0).unsqueeze(1)
        if padding_idx >= 0:
            valid = valid & (maximum_indices != padding_idx)
        return result.index_put_(
            (maximum_indices.flatten(),
             torch.arange(dim, device=grad.device).repeat(maximum_indices.shape[0])),
            torch.where(valid, grad, torch.zeros_like(grad)).flatten(), accumulate=True)
    # float16 / bfloat16 gradients are scaled and summed in float32, rounded once.
    acc = torch.float32 if grad.dtype in (torch.float16, torch.bfloat16) else grad.dtype
    rows = grad.index_select(0, offset2bag).to(acc)
    if mode == _MEAN:
        rows = rows / bag_size.index_select(0, offset2bag).clamp(min=1).unsqueeze(1).to(rows.dtype)
    if per_sample_weights is not None:
        rows = rows * per_sample_weights.unsqueeze(1).to(rows.dtype)
    if scale_grad_by_freq:
        freq = torch.zeros(num_weights, dtype=rows.dtype, device=grad.device).index_add(
            0, indices, torch.ones_like(indices, dtype=rows.dtype))
        rows = rows / freq.index_select(0, indices).unsqueeze(1)
    if padding_idx >= 0:
        rows = torch.where((indices != padding_idx).unsqueeze(1), rows, torch.zeros_like(rows))
    return result.to(acc).index_add(0, indices, rows).to(grad.dtype)


def _embedding_bag_backward(grad, indices, offsets, offset2bag, bag_size, maximum_indices,
                            num_weights, scale_grad_by_freq, mode, sparse, per_sample_weights,
                            padding_idx=-1):
    torch._check(not sparse, lambda: "tpu: embedding_bag with sparse=True gives a sparse "
                                     "gradient, and tpu tensors are strided")
    return _embedding_bag_dense_backward(grad, indices, offset2bag, bag_size, maximum_indices,
                                         num_weights, scale_grad_by_freq, mode,
                                         per_sample_weights, padding_idx)


def _embedding_bag_per_sample_weights_backward(grad, weight, indices, offsets, offset2bag,
                                               mode, padding_idx=-1):
    torch._check(mode == _SUM,
                 lambda: "embedding_bag_backward: per_sample_weights only supported for "
                         "mode='sum'")
    # Each dot product in float32 for float16 / bfloat16, rounded once.
    acc = torch.float32 if grad.dtype in (torch.float16, torch.bfloat16) else grad.dtype
    products = (grad.index_select(0, offset2bag).to(acc)
                * weight.index_select(0, indices).to(acc)).sum(1).to(grad.dtype)
    if padding_idx >= 0:
        products = torch.where(indices != padding_idx, products, torch.zeros_like(products))
    return products


def embedding_renorm_(self, indices, max_norm, norm_type):
    """Rescales, in place, each row of self that indices name whose
    norm_type-norm exceeds max_norm, to max_norm / (norm + 1e-7) times itself
    (embedding's max_norm), as ATen's kernel. A row named twice is written
    twice with the same value."""
    torch._check(self.dim() == 2, lambda: "embedding_renorm_: expected a 2-D weight (rows to "
                                          f"rescale), got a {self.dim()}-D tensor")
    torch._check(indices.dtype in (torch.int32, torch.int64),
                 lambda: "embedding_renorm_: expected indices of type Long or Int, but got "
                         f"{indices.dtype}")
    idx = indices.reshape(-1).to(torch.int64)
    if idx.numel() == 0:
        return self
    rows = self.index_select(0, idx)
    norms = torch.linalg.vector_norm(rows, ord=norm_type, dim=1, keepdim=True).float()
    scaled = rows.float() * (max_norm / (norms + 1e-7))
    self.index_copy_(0, idx, torch.where(norms > max_norm, scaled.to(self.dtype), rows))
    return self


def _histogramdd_bin_edges(self, bins, *, range=None, weight=None, density=False):
    """Each dimension's bins+1 edges, evenly spaced over the range given or
    the data's (one read of every dimension's min and max, as on CPU)."""
    dims = self.shape[-1] if self.dim() > 0 else 0
    torch._check(len(bins) == dims, lambda: "histogramdd: The size of bins must be equal to "
                                            "the innermost dimension of the input.")
    for b in bins:
        torch._check(b > 0, lambda: "histogramdd(): bins must be > 0, but got "
                                    f"{b} for dimension {bins.index(b)}")
    x = self.reshape(-1, dims)
    if range is not None:
        torch._check(len(range) == 2 * dims,
                     lambda: f"histogramdd: for a {dims}-dimensional input, range should have "
                             f"{2 * dims} elements, but got {len(range)}")
        lows, highs = list(range[0::2]), list(range[1::2])
    elif x.shape[0] == 0:
        lows, highs = [0.0] * dims, [1.0] * dims
    else:
        bounds = torch.stack([x.amin(0), x.amax(0)]).to(torch.float64).tolist()
        lows, highs = bounds[0], bounds[1]
    edges = []
    for d, (lo, hi) in enumerate(zip(lows, highs)):
        torch._check(abs(lo) != float("inf") and abs(hi) != float("inf") and lo == lo and hi == hi,
                     lambda: f"torch.histogramdd: dimension {d}'s range [{lo}, {hi}] is not "
                             f"finite")
        torch._check(lo <= hi, lambda: f"torch.histogramdd: min should not exceed max, but got "
                                       f"min {lo:g} max {hi:g} for dimension {d}")
        if lo == hi:
            lo, hi = lo - 0.5, hi + 0.5
        edges.append(torch.linspace(lo, hi, bins[d] + 1, dtype=self.dtype, device=self.device))
    return edges


def _histogramdd_from_bin_tensors(self, bins, *, weight=None, density=False):
    """Counts (or summed weights) over the grid of bins: an element falls in
    [edge_i, edge_i+1), the last bin closed; elements outside count
    nowhere."""
    dims = len(bins)
    x = self.reshape(-1, dims)
    flat = torch.zeros(x.shape[0], dtype=torch.int64, device=self.device)
    inside = torch.ones(x.shape[0], dtype=torch.bool, device=self.device)
    sizes = [b.numel() - 1 for b in bins]
    for d, edges in enumerate(bins):
        v = x[:, d].contiguous()
        pos = torch.searchsorted(edges, v, right=True) - 1
        pos = torch.where(v == edges[-1], torch.full_like(pos, sizes[d] - 1), pos)
        inside = inside & (v >= edges[0]) & (v <= edges[-1])
        flat = flat * sizes[d] + pos.clamp(0, max(sizes[d] - 1, 0))
    w = torch.ones(x.shape[0], dtype=self.dtype, device=self.device) if weight is None \
        else weight.reshape(-1).to(self.dtype)
    total = 1
    for n in sizes:
        total *= n
    hist = torch.zeros(total, dtype=self.dtype, device=self.device).index_add(
        0, flat, torch.where(inside, w, torch.zeros_like(w))).reshape(sizes)
    if density:
        hist = hist / hist.sum()
        for d, edges in enumerate(bins):
            shape = [1] * dims
            shape[d] = sizes[d]
            hist = hist / (edges[1:] - edges[:-1]).reshape(shape)
    return hist


def _histogramdd_from_bin_cts(self, bins, *, range=None, weight=None, density=False):
    edges = _histogramdd_bin_edges(self, bins, range=range, weight=weight, density=density)
    return _histogramdd_from_bin_tensors(self, edges, weight=weight, density=density)


def _as_lengths(lengths, like):
    if isinstance(lengths, torch.Tensor):
        return lengths.to(device=like.device, dtype=torch.int64)
    return torch.tensor(list(lengths), dtype=torch.int64, device=like.device)


def _logsumexp0(x):
    """logsumexp over dim 0, -inf where every term is, with a zero (not NaN)
    gradient there: unreachable CTC states must not spoil the gradient of
    the classes they share with reachable ones."""
    top = x.detach().amax(0)
    top = torch.where(top == float("-inf"), torch.zeros_like(top), top)
    total = (x - top).exp().sum(0)
    empty = total == 0
    safe = torch.where(empty, torch.ones_like(total), total)
    return torch.where(empty, torch.full_like(total, float("-inf")), safe.log() + top)


def _ctc_alphas(log_probs, targets, input_lengths, target_lengths, blank):
    """CTC's forward variables in log space, every batch element at once:
    (nll (N,), log_alpha (N, T, 2 S + 1)), S the longest target. An
    element's alphas stop changing after its input length."""
    steps, batch, _ = log_probs.shape
    il = _as_lengths(input_lengths, log_probs)
    tl = _as_lengths(target_lengths, log_probs)
    device = log_probs.device
    if targets.dim() == 1:  # concatenated: padded rows from the offsets
        width = int(tl.max().item()) if batch > 0 else 0
        starts = tl.cumsum(0) - tl
        at = (starts.unsqueeze(1) + torch.arange(width, device=device)).clamp(
            max=max(targets.shape[0] - 1, 0))
        padded = targets.index_select(0, at.flatten()).reshape(batch, width) \
            if targets.shape[0] > 0 else targets.new_zeros(batch, width)
    else:
        padded = targets
    width = padded.shape[1]
    ext_len = 2 * width + 1
    # The extended labels: blank, t1, blank, t2, ..., blank.
    ext = torch.full((batch, ext_len), blank, dtype=torch.int64, device=device)
    if width > 0:
        ext[:, 1::2] = padded.to(torch.int64)
    position = torch.arange(ext_len, device=device)
    # A label may be reached from two back unless it repeats the one there.
    skip = torch.zeros(batch, ext_len, dtype=torch.bool, device=device)
    if ext_len > 2:
        skip[:, 2:] = (position[2:] % 2 == 1) & (ext[:, 2:] != ext[:, :-2])
    valid = position.unsqueeze(0) < (2 * tl + 1).unsqueeze(1)
    lp = log_probs.gather(2, ext.unsqueeze(0).expand(steps, batch, ext_len))
    ninf = torch.full((batch, ext_len), float("-inf"), dtype=log_probs.dtype, device=device)
    first = (position.unsqueeze(0) < 2) & valid
    alpha = torch.where(first, lp[0], ninf) if steps > 0 else ninf
    alphas = [alpha]
    pad1 = ninf[:, :1]
    pad2 = ninf[:, :2]
    for t in range(1, steps):
        one = torch.cat([pad1, alpha[:, :-1]], 1)
        two = torch.where(skip, torch.cat([pad2, alpha[:, :-2]], 1), ninf)
        moved = _logsumexp0(torch.stack([alpha, one, two])) + lp[t]
        moved = torch.where(valid, moved, ninf)
        alpha = torch.where((t < il).unsqueeze(1), moved, alpha)
        alphas.append(alpha)
    log_alpha = torch.stack(alphas, 1) if steps > 0 else ninf.unsqueeze(1)[:, :0]
    last = (2 * tl).unsqueeze(1)
    end = alpha.gather(1, last).squeeze(1)
    before = torch.where(tl > 0, alpha.gather(1, (last - 1).clamp(min=0)).squeeze(1),
                         torch.full_like(end, float("-inf")))
    nll = -_logsumexp0(torch.stack([end, before]))
    return nll, log_alpha


def _ctc_loss(log_probs, targets, input_lengths, target_lengths, blank=0, zero_infinity=False):
    torch._check(log_probs.dim() == 3, lambda: "ctc_loss: expected 3-D log_probs (T, N, C)")
    return _ctc_alphas(log_probs, targets, input_lengths, target_lengths, blank)


def _ctc_loss_backward(grad, log_probs, targets, input_lengths, target_lengths,
                       neg_log_likelihood, log_alpha, blank, zero_infinity=False):
    """The gradient of the loss by the forward's vector-Jacobian product, in
    the form ATen returns: plus exp(log_probs) times the loss's gradient
    over each element's input steps (the gradient as taken through a
    log_softmax, which that term leaves unchanged)."""
    with torch.enable_grad():
        _, vjp = torch.func.vjp(
            lambda lp: _ctc_alphas(lp, targets, input_lengths, target_lengths, blank)[0],
            log_probs)
        g = grad.expand_as(neg_log_likelihood) if grad.dim() == 0 else grad
        (result,) = vjp(g)
    il = _as_lengths(input_lengths, log_probs)
    running = (torch.arange(log_probs.shape[0], device=log_probs.device).unsqueeze(1)
               < il.unsqueeze(0)).unsqueeze(2)
    result = result + torch.where(running, log_probs.exp() * g.view(1, -1, 1),
                                  torch.zeros_like(result))
    if zero_infinity:
        finite = (neg_log_likelihood != float("inf")).view(1, -1, 1)
        result = torch.where(finite, result, torch.zeros_like(result))
    return result


# "aten::op.overload" -> its decomposition.
DECOMPOSITIONS = {
    "aten::linalg_lstsq": linalg_lstsq,
    "aten::rrelu_with_noise": rrelu_with_noise,
    "aten::repeat_interleave.Tensor": repeat_interleave,
    "aten::_unique": _unique,
    "aten::bincount": bincount,
    "aten::unique_dim": unique_dim,
    "aten::hash_tensor": hash_tensor,
    "aten::grid_sampler_3d": grid_sampler_3d,
    "aten::grid_sampler_3d_backward": _grid_sampler_backward(lambda: grid_sampler_3d),
    "aten::grid_sampler_2d_backward": _grid_sampler_backward(_pytorch_grid_sampler_2d),
    "aten::_histogramdd_bin_edges": _histogramdd_bin_edges,
    "aten::_histogramdd_from_bin_cts": _histogramdd_from_bin_cts,
    "aten::_histogramdd_from_bin_tensors": _histogramdd_from_bin_tensors,
    "aten::_ctc_loss": _ctc_loss,
    "aten::_ctc_loss.Tensor": _ctc_loss,
    "aten::_ctc_loss_backward": _ctc_loss_backward,
    "aten::_ctc_loss_backward.Tensor": _ctc_loss_backward,
    "aten::_embedding_bag": _embedding_bag,
    "aten::_embedding_bag_forward_only": _embedding_bag,
    "aten::_embedding_bag_backward": _embedding_bag_backward,
    "aten::_embedding_bag_dense_backward": _embedding_bag_dense_backward,
    "aten::_embedding_bag_per_sample_weights_backward":
        _embedding_bag_per_sample_weights_backward,
    "aten::embedding_renorm_": embedding_renorm_,
}

from ._own_ldl import DECOMPOSITIONS as _LDL  # noqa: E402  (LDL^T: its own module)

DECOMPOSITIONS.update(_LDL)
