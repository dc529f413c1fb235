"""Ops the daemon's backend does not lower, run as PyTorch's decompositions.

On the PJRT backend tpud lowers a set of ATen ops to StableHLO (the daemon
sends their names when the session opens). An op outside that set that
PyTorch can decompose (torch._decomp's table) gets a PrivateUse1 kernel here
that runs the decomposition: its pieces reach the daemon as ops of their own,
each lowered or decomposed in turn. An op that is neither fails in the
daemon with an error naming it; nothing falls back to the CPU.

The simulated backend runs every ATen op and installs nothing.
"""
import inspect
import threading
import warnings

import torch

_lib = None
_installed = []  # "aten::name.overload" of every op given a kernel here
_depth = threading.local()

# Recursion through the same op (a decomposition that calls itself on smaller
# pieces) is allowed this deep before it is taken for a loop.
_MAX_DEPTH = 8


def _kernel(name, fn, max_depth):
    def run(*args, **kwargs):
        counts = getattr(_depth, "counts", None)
        if counts is None:
            counts = _depth.counts = {}
        n = counts.get(name, 0)
        if n >= max_depth:
            raise NotImplementedError(
                f"tpu: {name} is not lowered on the PJRT backend, and PyTorch's decomposition "
                f"of it comes back to it (tpud --backend=simulated runs every ATen op)")
        counts[name] = n + 1
        try:
            out = fn(*args, **kwargs)
        finally:
            counts[name] = n
        if out is NotImplemented:
            raise NotImplementedError(
                f"tpu: {name} is not lowered on the PJRT backend, and PyTorch's decomposition "
                f"of it does not take these arguments (tpud --backend=simulated runs every "
                f"ATen op)")
        return out

    run.__name__ = f"tpu_decomposed_{name.replace('::', '_').replace('.', '_')}"
    return run


def _candidates():
    """(op, decomposition, how deep it may recurse into op) for everything in
    torch._decomp's table: its own decompositions, written in ATen ops, and
    torch._refs' references, written in prims. A reference's prims run as ATen
    ops in eager mode, sometimes the very op decomposed (lgamma's prim is
    lgamma): a reference reaching its own op again is no decomposition."""
    import torch._decomp
    import torch._refs  # noqa: F401  (the references register themselves)
    import torch._refs.linalg  # noqa: F401
    import torch._refs.nn.functional  # noqa: F401
    import torch._refs.special  # noqa: F401

    for op, fn in torch._decomp.decomposition_table.items():
        own = getattr(fn, "__module__", "").startswith("torch._decomp")
        yield op, fn, (_MAX_DEPTH if own else 1)


# Ops with one of these kernels never reach a backend's kernel (the
# dispatcher prefers them to torch_tpu's fallback).
_COMPOSITE = ("CompositeImplicitAutograd", "CompositeExplicitAutograd",
              "CompositeExplicitAutogradNonFunctional")


def _takes_outs(op, fn):
    """Whether fn accepts op's out= arguments (the table maps some out=
    overloads to a functional decomposition that does not)."""
    outs = [a.name for a in op._schema.arguments if a.is_out]
    if not outs:
        return True
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return True
    return all(n in params for n in outs)


def _casts_every_tensor(fn):
    """Whether fn is wrapped in torch._decomp's type_casts (pw_cast_for_opmath
    and kin): it converts every tensor argument to the computation's type,
    out= ones too, so for a float16 or bfloat16 out= it writes a float32
    copy and never the caller's tensor."""
    code = getattr(fn, "__code__", None)
    return code is not None and getattr(code, "co_qualname", "").startswith("type_casts.")


def _functional_decomposition(op):
    """The decomposition of the functional overload of out= overload op
    (the same arguments but the outs), or None: what an out= decomposition
    that casts its out tensors too (and so writes copies) is made from."""
    import torch._decomp
    names = [a.name for a in op._schema.arguments if not a.is_out]
    packet = op.overloadpacket
    for overload in packet.overloads():
        other = getattr(packet, overload)
        args = other._schema.arguments
        if not any(a.is_out for a in args) and [a.name for a in args] == names:
            return torch._decomp.decomposition_table.get(other)
    return None


def _into_outs(op, fn):
    """A functional decomposition made to serve op's out= overload: its
    results are copied into the out tensors (passed as keywords), with the
    checks of PyTorch's out_wrapper (a result that cannot be cast safely to
    its out tensor's dtype is refused)."""
    names = [a.name for a in op._schema.arguments if a.is_out]

    def run(*args, **kwargs):
        from torch._prims_common import can_safe_cast_to
        outs = [kwargs.pop(n) for n in names]
        result = fn(*args, **kwargs)
        results = result if isinstance(result, (tuple, list)) else (result,)
        for out, value in zip(outs, results):
            torch._check(
                can_safe_cast_to(cast_from=value.dtype, cast_to=out.dtype),
                lambda: f"Attempting to cast from {value.dtype} to out tensor with dtype "
                        f"{out.dtype}, but this can't be cast because it is not safe!")
            if out.shape != value.shape:
                out.resize_(value.shape)
            out.copy_(value)
        return outs[0] if len(outs) == 1 else tuple(outs)

    return run


def _out_overload_runs_nowhere(op, lowered, decomposed):
    """Whether op is a functional structured op (its only composite kernel
    is CompositeExplicitAutogradNonFunctional, which calls the out=
    overload) whose out= overloads are neither lowered nor decomposed:
    logit_backward, for one, whose decomposition is registered for the
    functional overload only."""
    has_kernel = torch._C._dispatch_has_kernel_for_dispatch_key
    name = op.name()
    if any(has_kernel(name, k) for k in _COMPOSITE[:2]):
        return False
    schema = op._schema
    if any(a.is_out for a in schema.arguments) or schema.name.endswith("_"):
        return False
    packet = op.overloadpacket
    outs = [getattr(packet, o) for o in packet.overloads()]
    outs = [o for o in outs if any(a.is_out for a in o._schema.arguments)]
    return bool(outs) and not any(o.name() in lowered or o in decomposed for o in outs)


def _like_self(grad_output, self, *args, **kwargs):
    return torch.empty_like(self, memory_format=torch.contiguous_format)


def _histogram_meta(self, bins=100, *, range=None, weight=None, density=False):
    return self.new_empty(bins), self.new_empty(bins + 1)


def _histogram_edges_meta(self, bins, *, weight=None, density=False):
    return self.new_empty(bins.numel() - 1), self.new_empty(bins.numel())


# Lowered ops that PyTorch gives no meta kernel: their outputs' metadata,
# which the PJRT backend needs allocated before it runs them (the CPU
# kernels' backward ops return a contiguous tensor like self).
_METAS = {
    "aten::multi_margin_loss_backward": _like_self,
    "aten::multilabel_margin_loss_backward": _like_self,
    "aten::fractional_max_pool3d_backward": _like_self,
    "aten::histogram.bin_ct": _histogram_meta,
    "aten::histogram.bins_tensor": _histogram_edges_meta,
}
_meta_lib = None


def _install_metas(lowered):
    global _meta_lib
    has_kernel = torch._C._dispatch_has_kernel_for_dispatch_key
    lib = torch.library.Library("aten", "IMPL")
    for name, fn in _METAS.items():
        if name in lowered and not has_kernel(name, "Meta"):
            lib.impl(name.split("::", 1)[1], fn, "Meta")
    _meta_lib = lib


# Batch norm's decompositions model CUDA's kernel; ATen's CPU kernel (and
# so tpud's simulated chip) differs twice: in eval mode its saved mean and
# inverse deviation are empty, not [C]; and in training with half-precision
# input and parameters it stores them in that type and normalizes with the
# rounded values.
# (op -> whether its training flag is an argument; _batch_norm_with_update
# always trains)
_CPU_BATCH_NORM = {"aten::native_batch_norm": True, "aten::_native_batch_norm_legit": True,
                   "aten::_batch_norm_with_update": False}


def _cpu_batch_norm(fn, flag):
    def run(input, weight, bias, running_mean, running_var, *args, **kwargs):
        out = fn(input, weight, bias, running_mean, running_var, *args, **kwargs)
        training = (kwargs.get("training", args[0] if args else True)) if flag else True
        half = input.dtype in (torch.float16, torch.bfloat16)
        params = [t for t in (weight, bias, running_mean, running_var) if t is not None]
        mixed = half and any(t.dtype == torch.float32 for t in params)
        if not training:
            stats = torch.float32 if mixed else input.dtype
            return out[0], out[1].new_empty(0, dtype=stats), out[2].new_empty(0, dtype=stats)
        if not half or mixed:
            return out
        mean, invstd = out[1].to(input.dtype), out[2].to(input.dtype)
        shape = [1, -1] + [1] * (input.dim() - 2)
        y = (input.float() - mean.float().view(shape)) * invstd.float().view(shape)
        if weight is not None:
            y = y * weight.float().view(shape)
        if bias is not None:
            y = y + bias.float().view(shape)
        return (y.to(input.dtype), mean, invstd) + tuple(out[3:])

    return run


def install(lowered_ops):
    """Gives every decomposable ATen op outside `lowered_ops` a PrivateUse1
    kernel that runs its decomposition. Returns how many; idempotent."""
    global _lib
    if _lib is not None:
        return len(_installed)
    lowered = set(lowered_ops)
    _install_metas(lowered)
    # torch_tpu sends these whole to the daemon (registration.cc: the
    # simulated chip's CPU kernel is more exact than their decompositions); on
    # a backend that does not lower them, their decompositions replace that
    # kernel.
    from . import _C

    sent_whole = set(_C._sent_whole_ops())
    has_kernel = torch._C._dispatch_has_kernel_for_dispatch_key
    lib = torch.library.Library("aten", "IMPL")
    candidates = list(_candidates())
    decomposed = {op for op, _, _ in candidates}
    for op, fn, depth in candidates:
        if not isinstance(op, torch._ops.OpOverload) or op.namespace != "aten":
            continue
        name = op.name()  # "aten::add.Tensor"; "aten::relu" for .default
        if name in lowered:
            continue
        outs = any(a.is_out for a in op._schema.arguments)
        if not _takes_outs(op, fn):
            fn = _into_outs(op, fn)
        elif outs and _casts_every_tensor(fn):
            functional = _functional_decomposition(op)
            if functional is not None:
                fn = _into_outs(op, functional)
        if name in _CPU_BATCH_NORM:
            fn = _cpu_batch_norm(fn, _CPU_BATCH_NORM[name])
        if name in sent_whole:
            with warnings.catch_warnings():  # (torch warns that a kernel is overridden)
                warnings.simplefilter("ignore")
                lib.impl(name.split("::", 1)[1], _kernel(name, fn, depth), "PrivateUse1")
            _installed.append(name)
            continue
        # torch_tpu's own kernels (allocation, views, copies between devices)
        # stay; composite ops never reach a backend kernel, unless their
        # composite kernel only calls an out= overload that runs nowhere.
        if has_kernel(name, "PrivateUse1") or (
                any(has_kernel(name, k) for k in _COMPOSITE)
                and not _out_overload_runs_nowhere(op, lowered, decomposed)):
            continue
        lib.impl(name.split("::", 1)[1], _kernel(name, fn, depth), "PrivateUse1")
        _installed.append(name)
    from . import _own_decomp

    for name, fn in _own_decomp.DECOMPOSITIONS.items():
        if name not in lowered and name not in _installed:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                lib.impl(name.split("::", 1)[1], _kernel(name, fn, 1), "PrivateUse1")
            _installed.append(name)
    _lib = lib
    return len(_installed)


def installed():
    """The ops that run decomposed in this process (empty unless PJRT)."""
    return list(_installed)
