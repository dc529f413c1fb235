#!/usr/bin/env python3
"""OpInfo conformance of the "tpu" device against ATen's CPU kernels.

For each OpInfo of torch's `op_db` (torch.testing._internal) and each dtype, the
first --max-samples sample inputs (`op.sample_inputs("cpu", dtype)`) run on the
CPU; those that pass there run again with their tensors moved to "tpu", and the
results, moved back, are compared with torch.testing.assert_close (dtype default
atol/rtol, equal_nan=True; non-tensor results with ==; a result tensor must be
on tpu). As in PyTorch's test_compare_cpu, both sides' results first pass
through the sample's output_process_fn_grad, which for ops whose results are
defined only up to a sign (singular vectors, eigenvectors) takes their abs.
Each sample is one of:

  passed, failed (a mismatch), errored (an exception on tpu: type and first line),
  passed_closer: a float16 or bfloat16 result (or gradient) outside the
      tolerance around CPU's, but at least as close as CPU's to the same op
      computed in float64 on the CPU (largest absolute difference, element by
      element). This is how PyTorch's own test_decomp and test_python_ref judge
      an implementation that rounds in another order than ATen's low-precision
      kernels; it counts as passing, and the strict rate is reported beside it.
  skipped_cpu (it raises on the CPU too; not counted),
  skipped_nondeterministic: random or uninitialised results: ops named like
      rand*, dropout, normal, bernoulli, multinomial, uniform, empty*, ..., and
      any sample whose CPU result changes when run again with another seed (e.g.
      scaled_dot_product_attention with dropout_p > 0); with --backward also the
      gradients of sort, topk, kthvalue, median and mode over inputs with equal
      values, which of the equal values the gradient reaches being unspecified.
      They run on tpu to catch errors; only the structure, shapes and dtypes of
      the results are compared.

Indices that PyTorch leaves unspecified among equal values (sort and argsort
unless stable=True, topk, kthvalue, median, mode) are compared by the values
they point at, as PyTorch's test_sort_and_select checks them. The eigenvalues
of linalg.eig and linalg.eigvals come "not guaranteed to be in any specific
order" (their documentation): tpu's are put in CPU's order (each CPU
eigenvalue takes the nearest tpu one not yet taken, and its eigenvector goes
with it) before they are compared or differentiated.

Backward mode (--backward): for OpInfos that support autograd, and the dtypes
they differentiate on the CPU (default: float32, bfloat16, float16, complex64),
samples are made with requires_grad; the op runs on the CPU and on tpu, and
torch.autograd.grad of the differentiable outputs (after the OpInfo's
output_process_fn_grad), with the same random cotangents, gives the gradients of
every input that requires grad. The tpu inputs are copies of the CPU leaves, so
the whole backward runs on tpu and only the final gradients come back. They are
compared as results are (a missing gradient equals an all-zero one). Samples
without a differentiable output count as skipped_no_grad.

How samples move: tensors keep their storage layout (a view into a larger
storage, an offset, overlapping strides stay so on tpu). The same samples are
also made on the meta device to learn which tensors and devices the OpInfo puts
on its test device: those go to tpu (`device="cpu"` arguments of factory
functions such as arange, ones, full, and of `to`, become "tpu"), while tensors
the sample puts on the CPU whatever the device (tensor_split's indices,
narrow's start, index_put's indices) stay on the CPU, as in PyTorch's own
device-generic tests. Where the meta samples cannot be made, every tensor moves.

Robustness: the ops run in a worker process; a per-op alarm (--timeout) ends a
slow op, and a worker that crashes or hangs inside C++ is replaced (that sample
counts as errored, with what it was doing) so one op cannot stop the run.
Otherwise one worker (one tpud session) runs everything, as a user's process
would: an op's error is caught and the run goes on, so the figure includes any
harm a failed op does to later work. --isolate measures each op apart instead:
after an op fails, a new worker (a new session) takes over. With --start-daemon the tool runs its own tpud
(bazel-bin/daemon/tpud, --hbm_bytes=4GiB; --backend pjrt for the PJRT backend on
XLA's CPU plugin) on sockets in a temporary folder, restarted if it dies; else
it uses the daemon at TPUD_SOCKET.

  .venv/bin/python tools/opinfo_conformance.py --start-daemon --ops add,mm --report r.json
  .venv/bin/python tools/opinfo_conformance.py --start-daemon --max-samples 3 --report all.json

Output: the JSON report (--report: per op and dtype the counts, the first error
and mismatch, the distinct errors; error and mismatch groups; crash events), the
most common error messages (grouped by first line, with numbers, shapes and ATen
op names blanked out; most ops first) with the ops that raise them, and last:
  conformance: P passed, F failed, E errored of N samples that pass on CPU (X.X%)
with N = P + F + E (nondeterministic samples are counted apart; P includes the
passed_closer samples, and the strict rate without them follows).
"""
import argparse
import itertools
import json
import math
import os
import pathlib
import random
import re
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
from tpud_process import TpudProcess  # noqa: E402
DEFAULT_TPUD = ROOT / "bazel-bin" / "daemon" / "tpud"
DEFAULT_DTYPES = ("float32", "bfloat16", "float16", "int64", "bool", "complex64")
BACKWARD_DTYPES = ("float32", "bfloat16", "float16", "complex64")
GRACE_S = 30          # beyond --timeout before a stuck worker is killed
IMPORT_TIMEOUT_S = 300
TOP_ERRORS = 30
TOP_MISMATCHES = 15
STATUSES = ("passed", "passed_closer", "failed", "errored", "skipped_cpu",
            "skipped_nondeterministic", "skipped_no_grad")

# Ops whose values cannot be compared with the CPU's: randomness or
# uninitialised memory. Matched against the last dotted part of op.name.
_NONDET_RE = re.compile(
    r"^(rand|randn|randint|randperm)(_like)?$|dropout|^normal$|^log_normal$|bernoulli|"
    r"multinomial|^uniform$|empty|^cauchy$|^exponential$|^geometric$|^poisson$|rrelu|"
    r"^fractional_max_pool")


def is_nondeterministic(op):
    if getattr(op, "has_nondeterministic_output", False):
        return True
    if op.name.startswith("signal.windows."):  # e.g. windows.exponential: deterministic
        return False
    return bool(_NONDET_RE.search(op.name.split(".")[-1]))


def first_line(text):
    for line in str(text).splitlines():
        if line.strip():
            return line.strip()[:400]
    return ""


def describe(exc):
    msg = first_line(exc)
    return f"{type(exc).__name__}: {msg}" if msg else type(exc).__name__


_NORMALISE = [
    (re.compile(r" \(and \d+ later error\(s\) on this stream\)"), ""),
    (re.compile(r"aten::[A-Za-z0-9_]+(\.[A-Za-z0-9_]+)?"), "aten::<op>"),
    (re.compile(r"0x[0-9a-fA-F]+"), "<addr>"),
    (re.compile(r"(?<![A-Za-z_])-?\d+(\.\d+)?(e[-+]?\d+)?"), "N"),
    (re.compile(r"\[(N, )*N,?\]"), "[...]"),
    (re.compile(r"\((N, )*N,?\)"), "(...)"),
    (re.compile(r"tensor\([^)]*\)"), "tensor(...)"),
]


def group_key(message):
    """The first line with the details that vary from op to op blanked out."""
    key = message
    for pattern, repl in _NORMALISE:
        key = pattern.sub(repl, key)
    return key[:300]


# ===================================================================== worker
#
# Runs in a separate interpreter (`--_worker-fd`), reports JSON lines on a pipe.


class OpTimeout(BaseException):
    """Raised by the alarm; a BaseException so generic handlers let it pass."""


class _Moved:
    """A result tensor copied back to the CPU, remembering its device."""

    def __init__(self, tensor, device_type):
        self.tensor = tensor
        self.device_type = device_type


class _Mismatch(Exception):
    pass


# Ops whose indices PyTorch leaves unspecified among equal values (sort and
# argsort unless stable=True; topk; kthvalue, median, nanmedian and mode,
# whose index is "not necessarily the first"; msort, whose gradient goes
# where its unstable sort put each tied value). PyTorch's own tests
# (test_sort_and_select) check such indices by the values they point at.
_TIED_INDEX_OPS = {"sort": 0, "argsort": 0, "topk": 1, "kthvalue": 1,
                   "median": 0, "nanmedian": 0, "mode": 0, "msort": None}


# Ops whose eigenvalues come in no specified order (see the docstring).
_UNORDERED_EIGEN_OPS = {"linalg.eig", "linalg.eigvals"}


def _in_order_of(reference, values):
    """Per matrix, the indices into `values` (eigenvalues, last dimension)
    that put them in `reference`'s order: each reference value in turn takes
    the nearest value not yet taken."""
    import torch
    ref = reference.detach().cpu().reshape(-1, reference.shape[-1])
    got = values.detach().cpu().reshape(-1, values.shape[-1])
    orders = []
    for r, g in zip(ref.tolist(), got.tolist()):
        free = list(range(len(g)))
        order = []
        for x in r:
            j = min(free, key=lambda q: abs(complex(g[q]) - complex(x)))
            free.remove(j)
            order.append(j)
        orders.append(order)
    return torch.tensor(orders, dtype=torch.long).reshape(values.shape)


def _reordered(op, cpu_out):
    """op, its eigenvalues (and eigenvectors' columns) in the order of the CPU
    result `cpu_out` (eigenvalues first, or alone)."""
    import torch
    reference = cpu_out[0] if isinstance(cpu_out, (tuple, list)) else cpu_out

    def run(*a, **kw):
        out = op(*a, **kw)
        values = out[0] if isinstance(out, (tuple, list)) else out
        if values.shape != reference.shape or values.numel() == 0:
            return out
        order = _in_order_of(reference, values).to(values.device)
        values = torch.gather(values, -1, order)
        if not isinstance(out, (tuple, list)):
            return values
        vectors = out[1]
        vectors = torch.gather(vectors, -1, order.unsqueeze(-2).expand(vectors.shape))
        return (values, vectors)
    return run


def _tie_dim(name, sample):
    """The dimension a tie-order op works along, or None where it has no
    indices to resolve (no dim: median of everything; a stable sort)."""
    if name not in _TIED_INDEX_OPS or sample.kwargs.get("stable"):
        return None
    at = _TIED_INDEX_OPS[name]
    if at is None:  # msort: sort along dim 0, values only
        return 0
    if "dim" in sample.kwargs:
        return sample.kwargs["dim"]
    if len(sample.args) > at and isinstance(sample.args[at], int):
        return sample.args[at]
    return None if name in ("median", "nanmedian") else -1


def _has_ties(inp):
    """Whether a tensor holds some value twice (the op's dim aside: a tie
    anywhere is enough to make its gradient's placement unspecified)."""
    import torch
    if not isinstance(inp, torch.Tensor) or inp.numel() < 2:
        return False
    flat = inp.detach().flatten()
    return torch.unique(flat).numel() < flat.numel()


def _values_at(inp, idx, dim):
    """inp's values at indices idx along dim (idx without that dimension where
    the op dropped it)."""
    import torch
    if inp.dim() == 0:
        return inp.expand(idx.shape) if idx.numel() else idx.to(inp.dtype)
    d = dim % inp.dim()
    i = idx if idx.dim() == inp.dim() else idx.unsqueeze(d)
    out = torch.gather(inp, d, i)
    return out if idx.dim() == inp.dim() else out.squeeze(d)


def _distance(a, ref):
    """The largest |a - ref| over the elements, in float64 (complex128 when
    either is complex). Equal values, infinities of one sign and nan against
    nan are 0 apart; a nan against anything else is infinitely far."""
    import torch
    if a.shape != ref.shape:
        return math.inf
    if a.numel() == 0:
        return 0.0
    wide = torch.complex128 if a.is_complex() or ref.is_complex() else torch.float64
    a, ref = a.detach().to(wide), ref.detach().to(wide)
    d = (a - ref).abs()
    same = (a == ref) | (torch.isnan(a) & torch.isnan(ref))
    d = torch.where(same, torch.zeros_like(d), torch.nan_to_num(d, nan=math.inf))
    return d.max().item()


def closer_than_cpu(expected, actual, precise):
    """Whether every result of tpu (`actual`, tensors as _Moved or plain) is at
    least as close to `precise` (the op in float64 on the CPU) as CPU's own
    result (`expected`) is, where it is not within tolerance of CPU's (where
    CPU's is infinitely far, within tolerance of the float64 result). Integer
    and boolean results, shapes, dtypes and non-tensor results must still match
    CPU's exactly."""
    import torch
    if isinstance(expected, torch.Tensor):
        a = actual.tensor if isinstance(actual, _Moved) else actual
        if not isinstance(a, torch.Tensor) or a.shape != expected.shape \
                or a.dtype != expected.dtype:
            return False
        try:
            torch.testing.assert_close(a, expected, equal_nan=True)
            return True
        except AssertionError:
            pass
        if not (expected.is_floating_point() or expected.is_complex()) \
                or not isinstance(precise, torch.Tensor):
            return False
        cpu = _distance(expected, precise)
        if math.isinf(cpu):
            # CPU's result has a nan or inf where the float64 one has not (or
            # the reverse): tpu's must be within tolerance of the float64 one.
            try:
                torch.testing.assert_close(a, precise.to(a.dtype), equal_nan=True)
                return True
            except (AssertionError, RuntimeError, TypeError):
                return False
        return _distance(a, precise) <= cpu
    if isinstance(expected, (list, tuple)):
        return isinstance(actual, (list, tuple)) and isinstance(precise, (list, tuple)) \
            and len(actual) == len(expected) == len(precise) \
            and all(closer_than_cpu(e, a, p) for e, a, p in zip(expected, actual, precise))
    if isinstance(expected, dict):
        return isinstance(actual, dict) and isinstance(precise, dict) \
            and set(actual) == set(expected) <= set(precise) \
            and all(closer_than_cpu(expected[k], actual[k], precise[k]) for k in expected)
    if isinstance(actual, _Moved):
        return False
    if isinstance(expected, float) and isinstance(actual, float) \
            and expected != expected and actual != actual:
        return True
    try:
        return bool(expected == actual)
    except Exception:  # noqa: BLE001
        return repr(expected) == repr(actual)


def _stub_expecttest():
    # common_utils imports expecttest only for its TestCase base class; the
    # project's .venv does not have it. A stand-in is enough for op_db.
    try:
        import expecttest  # noqa: F401
    except ImportError:
        import types
        import unittest
        mod = types.ModuleType("expecttest")
        mod.TestCase = unittest.TestCase
        mod.ACCEPT = False
        sys.modules["expecttest"] = mod


def worker_main(args):
    out = os.fdopen(args._worker_fd, "w", buffering=1)
    state = {"critical": False, "phase": None}

    def send(**msg):
        state["critical"] = True
        try:
            out.write(json.dumps(msg) + "\n")
            out.flush()
        except BrokenPipeError:
            os._exit(3)  # the parent is gone
        finally:
            state["critical"] = False

    def on_alarm(signum, frame):
        if state["critical"]:
            signal.alarm(1)  # never interrupt a message half written
            return
        raise OpTimeout()

    signal.signal(signal.SIGALRM, on_alarm)
    import warnings
    warnings.filterwarnings("ignore")
    _stub_expecttest()
    import torch
    import torch_tpu  # noqa: F401
    from torch.testing._internal.common_methods_invocations import op_db

    if not torch.tpu.is_available():
        send(t="fatal", msg="no tpu device: is tpud running at TPUD_SOCKET="
             f"{os.environ.get('TPUD_SOCKET', '(unset)')}? (or use --start-daemon)")
        return 2

    if not args.all_dtypes:
        bad = [d for d in args.dtypes.split(",")
               if not isinstance(getattr(torch, d, None), torch.dtype)]
        if bad:
            send(t="fatal", msg=f"not torch dtypes: {', '.join(bad)}")
            return 2
    units, unknown = select_units(op_db, args, torch)
    send(t="plan", units=[[op.full_name, str(dt).replace("torch.", ""), nondet, supported]
                          for op, dt, nondet, supported in units], unknown=unknown,
         torch=torch.__version__)

    no_twin = object()

    def is_device(x, kind):
        return (isinstance(x, str) and x.split(":")[0] == kind) or \
            (isinstance(x, torch.device) and x.type == kind)

    def as_tpu_device(x):
        return "tpu" if isinstance(x, str) else torch.device("tpu")

    def full_storage(t):
        """t's whole storage as a 1-D tensor, or None when t is simple to copy."""
        if t.layout != torch.strided or t.is_conj() or t.is_neg() or t.numel() == 0:
            return None
        n = t.untyped_storage().nbytes() // t.element_size()
        if t.storage_offset() == 0 and n == t.numel() and t.is_contiguous():
            return None
        return torch.as_strided(t, (n,), (1,), 0)

    def move(t):
        """t on tpu with the same storage layout (views of a larger storage, offsets,
        overlapping strides), as the sample would be if made on the device."""
        base = full_storage(t)
        if base is None:
            return t.to("tpu")
        return base.to("tpu").as_strided(t.size(), t.stride(), t.storage_offset())

    def clone(t):
        base = full_storage(t)
        if base is None:
            return t.clone()
        return base.clone().as_strided(t.size(), t.stride(), t.storage_offset())

    def to_tpu(x, twin=no_twin, key=None):
        """The sample on tpu. `twin` is the same sample made on the meta device:
        what is on meta there was made on the device and goes to tpu; what is on
        the CPU there the sample puts on the CPU whatever the device (e.g. the
        indices of tensor_split, narrow's start) and stays. Without a twin every
        tensor moves, and device="cpu" keywords become "tpu"."""
        if isinstance(x, torch.Tensor):
            if isinstance(twin, torch.Tensor) and twin.device.type == "cpu":
                return clone(x)
            return move(x)
        if is_device(x, "cpu"):
            if twin is not no_twin:
                return as_tpu_device(x) if is_device(twin, "meta") else x
            return as_tpu_device(x) if key == "device" or isinstance(x, torch.device) else x
        if isinstance(x, (list, tuple)):
            twins = twin if isinstance(twin, (list, tuple)) and len(twin) == len(x) \
                else [no_twin] * len(x)
            items = [to_tpu(v, w) for v, w in zip(x, twins)]
            if isinstance(x, list):
                return items
            if hasattr(x, "_fields"):  # namedtuple
                return type(x)(*items)
            return tuple(items) if type(x) is tuple else type(x)(items)
        if isinstance(x, dict):
            same = isinstance(twin, dict) and set(twin) == set(x)
            return {k: to_tpu(v, twin[k] if same else no_twin, k) for k, v in x.items()}
        return x

    def map_tensors(x, fn):
        """x with fn applied to each tensor, its lists, tuples (namedtuples
        too) and dicts rebuilt around the results."""
        if isinstance(x, torch.Tensor):
            return fn(x)
        if isinstance(x, list):
            return [map_tensors(v, fn) for v in x]
        if isinstance(x, tuple):
            items = [map_tensors(v, fn) for v in x]
            if hasattr(x, "_fields"):
                return type(x)(*items)
            return tuple(items) if type(x) is tuple else type(x)(items)
        if isinstance(x, dict):
            return {k: map_tensors(v, fn) for k, v in x.items()}
        return x

    def clone_tree(x):
        return map_tensors(x, clone)

    def has_conj(x):
        if isinstance(x, torch.Tensor):
            return x.is_conj() or x.is_neg()
        if isinstance(x, (list, tuple)):
            return any(has_conj(v) for v in x)
        if isinstance(x, dict):
            return any(has_conj(v) for v in x.values())
        return False

    def to_cpu(x):
        if isinstance(x, torch.Tensor):
            return _Moved(x.cpu(), x.device.type)
        if isinstance(x, (list, tuple)):
            return [to_cpu(v) for v in x]
        if isinstance(x, dict):
            return {k: to_cpu(v) for k, v in x.items()}
        return x

    def compare(expected, actual, path, values, device=True):
        if isinstance(expected, torch.Tensor):
            if not isinstance(actual, _Moved):
                raise _Mismatch(f"result{path}: expected a tensor, got {type(actual).__name__}")
            if device and expected.device.type == "cpu" and actual.device_type != "tpu":
                raise _Mismatch(f"result{path} is on {actual.device_type}, expected tpu")
            a = actual.tensor
            if not values:
                if a.shape != expected.shape or a.dtype != expected.dtype:
                    raise _Mismatch(f"result{path}: shape/dtype {tuple(a.shape)} {a.dtype}, "
                                    f"expected {tuple(expected.shape)} {expected.dtype}")
                return
            try:
                torch.testing.assert_close(a, expected, equal_nan=True)
            except AssertionError as e:
                lines = [l.strip() for l in str(e).splitlines() if l.strip()]
                raise _Mismatch(f"result{path}: " + "; ".join(lines[:4])[:600]) from None
            return
        if isinstance(expected, (list, tuple)):
            if not isinstance(actual, (list, tuple)) or len(actual) != len(expected):
                got = f"{type(actual).__name__}" + (
                    f" of {len(actual)}" if isinstance(actual, (list, tuple)) else "")
                raise _Mismatch(f"result{path}: expected a sequence of {len(expected)}, got {got}")
            for i, (e, a) in enumerate(zip(expected, actual)):
                compare(e, a, f"{path}[{i}]", values, device)
            return
        if isinstance(expected, dict):
            if not isinstance(actual, dict) or set(actual) != set(expected):
                raise _Mismatch(f"result{path}: dict keys differ")
            for k in expected:
                compare(expected[k], actual[k], f"{path}[{k!r}]", values, device)
            return
        if isinstance(actual, _Moved):
            raise _Mismatch(f"result{path}: expected {type(expected).__name__}, got a tensor")
        if not values:
            return
        if isinstance(expected, float) and isinstance(actual, float) and \
                expected != expected and actual != actual:
            return  # both nan
        try:
            same = bool(expected == actual)
        except Exception:  # noqa: BLE001
            same = repr(expected) == repr(actual)
        if not same:
            raise _Mismatch(f"result{path}: {actual!r} != {expected!r} (cpu)"[:600])

    def drain():
        try:
            torch.tpu.synchronize()
        except Exception:  # noqa: BLE001 - a late error of an earlier sample
            pass

    from torch.testing._utils import freeze_rng_state, wrapper_set_seed

    def other_seed(f, *a, **kw):
        with freeze_rng_state():
            torch.manual_seed(4321)
            return f(*a, **kw)

    # OpInfo ops that draw random numbers call wrapper_set_seed (seed 42) through
    # their module's global; the second CPU run swaps in another seed.
    seeded_modules = [m for name, m in list(sys.modules.items())
                      if name.startswith("torch.testing._internal") and m is not None
                      and getattr(m, "wrapper_set_seed", None) is wrapper_set_seed]

    def differs_between_cpu_runs(op, again, expected):
        """Runs the op on the CPU again with another seed: a sample with
        dropout_p > 0 of an otherwise deterministic op, uninitialised memory, ..."""
        for m in seeded_modules:
            m.wrapper_set_seed = other_seed
        try:
            torch.manual_seed(4321)
            second = to_cpu(op(again[0], *again[1], **again[2]))
            compare(expected, second, "", values=True, device=False)
            return False
        except (_Mismatch, Exception):  # noqa: BLE001
            return True
        finally:
            for m in seeded_modules:
                m.wrapper_set_seed = wrapper_set_seed

    def grad_leaves(x):
        """The tensors of a sample that require grad (CPU leaves), in order."""
        if isinstance(x, torch.Tensor):
            return [x] if x.requires_grad else []
        if isinstance(x, (list, tuple)):
            return [t for v in x for t in grad_leaves(v)]
        if isinstance(x, dict):
            return [t for v in x.values() for t in grad_leaves(v)]
        return []

    def differentiable(out):
        if isinstance(out, torch.Tensor):
            ok = out.requires_grad and (out.is_floating_point() or out.is_complex())
            return [out] if ok else []
        if isinstance(out, (list, tuple)):
            return [t for v in out for t in differentiable(v)]
        if isinstance(out, dict):
            return [t for v in out.values() for t in differentiable(v)]
        return []

    def gradients(op, sample, inp, a, kw, leaves, cotangents=None):
        """d(outputs)/d(leaves) for the given cotangents (made here when None)."""
        out = sample.output_process_fn_grad(op(inp, *a, **kw))
        outs = differentiable(out)
        if not outs:
            return None, None, out
        if cotangents is None:
            g = torch.Generator().manual_seed(97)
            cotangents = [torch.randn(o.shape, generator=g, dtype=o.dtype) for o in outs]
        if len(cotangents) != len(outs):
            raise _Mismatch(f"{len(outs)} differentiable outputs, expected {len(cotangents)}")
        cot = [c.to(device=o.device, dtype=o.dtype) for c, o in zip(cotangents, outs)]
        grads = torch.autograd.grad(outs, leaves, cot, allow_unused=True)
        # A gradient autograd leaves out is zero.
        grads = [torch.zeros_like(l) if gr is None else gr for gr, l in zip(grads, leaves)]
        return grads, cotangents, out

    wide_dtypes = {torch.float16: torch.float64, torch.bfloat16: torch.float64,
                   torch.complex32: torch.complex128}

    def as_double(x):
        """Copies of the sample's tensors, the low-precision ones in float64
        (complex32 in complex128), keeping requires_grad: the input of the
        precise run that judges passed_closer."""
        def widen(t):
            wide = wide_dtypes.get(t.dtype)
            c = t.detach().to(wide) if wide is not None else t.detach().clone()
            return c.requires_grad_() if t.requires_grad else c
        return map_tensors(x, widen)

    def precise_result(op, sample, pristine, cotangents):
        """The op (or its gradients) on the CPU in float64, or None if that fails."""
        try:
            torch.manual_seed(1234)
            inp, a, kw = pristine
            if args.backward:
                grads, _, _ = gradients(op, sample, inp, a, kw, grad_leaves(pristine),
                                        cotangents)
                return grads
            with torch.no_grad():
                return sample.output_process_fn_grad(op(inp, *a, **kw))
        except Exception:  # noqa: BLE001 - no float64 kernel, a dtype check, ...
            return None

    def run_sample(op, sample, twin, k, nondet, low_precision):
        """One sample: its results (or with --backward, its input gradients) on
        the CPU and on tpu, compared."""
        inputs = (sample.input, sample.args, sample.kwargs)
        pristine = None
        if low_precision and not nondet:
            try:
                pristine = as_double(inputs)
            except Exception:  # noqa: BLE001
                pristine = None
        leaves = grad_leaves(inputs) if args.backward else None
        if args.backward and not leaves:
            send(t="sample", sample=k, status="skipped_no_grad")
            return
        try:
            # With --backward: differentiable copies of the CPU leaves.
            moved = to_tpu(inputs, twin)
            move_exc = None
        except Exception as e:  # noqa: BLE001
            moved, move_exc = None, e
        state["phase"] = ("cpu", k)
        try:
            again = None if nondet else clone_tree(inputs)
            torch.manual_seed(1234)
            if args.backward:
                expected, cotangents, out = gradients(op, sample, *inputs, leaves)
            else:
                # As PyTorch's test_compare_cpu: results defined only up to
                # a sign (singular vectors, eigenvectors) are compared
                # through the sample's output_process_fn_grad (their abs).
                out = op(sample.input, *sample.args, **sample.kwargs)
                expected = sample.output_process_fn_grad(out)
        except Exception:  # noqa: BLE001
            state["phase"] = None
            send(t="sample", sample=k, status="skipped_cpu")
            return
        if args.backward and expected is None:  # no differentiable output
            state["phase"] = None
            send(t="sample", sample=k, status="skipped_no_grad")
            return
        detected = False
        if not nondet:
            # A sample whose CPU result changes with the seed (dropout_p > 0);
            # its gradients do too.
            if args.backward:
                def processed(*a, **kw):  # the op as the gradients saw it
                    return sample.output_process_fn_grad(op(*a, **kw))
                with torch.no_grad():
                    first = torch.utils._pytree.tree_map(
                        lambda x: x.detach() if isinstance(x, torch.Tensor) else x, out)
                    detected = differs_between_cpu_runs(processed, again, first)
            else:
                def processed(*a, **kw):
                    return sample.output_process_fn_grad(op(*a, **kw))
                detected = differs_between_cpu_runs(processed, again, expected)
        nondet = nondet or detected
        if args.backward and not nondet and op.name in _TIED_INDEX_OPS \
                and not sample.kwargs.get("stable") and _has_ties(sample.input):
            # Where equal values tie, which of them the gradient flows to is as
            # unspecified as the indices: compared in structure only.
            nondet = True
        state["phase"] = ("tpu", k)
        send(t="tpu", sample=k, step="running the op and its backward on tpu" if args.backward
             else "running the op on tpu")
        on_tpu = _reordered(op, out) if op.name in _UNORDERED_EIGEN_OPS else op
        try:
            if move_exc is not None:
                raise move_exc
            inp, a, kw = moved
            if args.backward:
                torch.manual_seed(1234)
                grads, _, _ = gradients(on_tpu, sample, inp, a, kw, leaves, cotangents)
                if grads is None:
                    raise _Mismatch("no differentiable output on tpu")
                # The gradients are w.r.t. the CPU leaves: computed on tpu,
                # copied back by the backward of the copy to tpu.
                actual = [_Moved(g, g.device.type) for g in grads]
            else:
                result = sample.output_process_fn_grad(on_tpu(inp, *a, **kw))
                send(t="tpu", sample=k, step="copying the results to the CPU" +
                     (" (a result has the conj or neg bit)" if has_conj(result) else ""))
                actual = to_cpu(result)
            torch.tpu.synchronize()
        except _Mismatch as e:
            state["phase"] = None
            send(t="sample", sample=k, status="failed", msg=str(e))
            return
        except Exception as e:  # noqa: BLE001
            state["phase"] = None
            state["errored"] = True
            drain()
            send(t="sample", sample=k, status="errored", msg=describe(e))
            return
        dim = None if args.backward else _tie_dim(op.name, sample)
        if dim is not None and not nondet:
            # Indices compared by the values they point at (see _TIED_INDEX_OPS):
            # the last result of a (values, indices) pair, argsort's only one.
            def at(v):
                t = v.tensor if isinstance(v, _Moved) else v
                g = _values_at(sample.input, t, dim)
                return _Moved(g, v.device_type) if isinstance(v, _Moved) else g

            def resolve(res):
                if isinstance(res, (list, tuple)) and len(res) == 2:
                    return [res[0], at(res[1])]
                return at(res) if op.name == "argsort" else res
            try:
                expected, actual = resolve(expected), resolve(actual)
            except Exception:  # noqa: BLE001 - bad indices: compared as they are
                pass
        try:
            compare(expected, actual, "", values=not nondet, device=not args.backward)
            status, msg = ("skipped_nondeterministic" if nondet else "passed"), None
        except _Mismatch as e:
            status, msg = "failed", ("grad" + str(e)[len("result"):]) if args.backward else str(e)
        except Exception as e:  # noqa: BLE001 - the comparison itself broke
            status, msg = "failed", "comparison raised " + describe(e)
        if status == "failed" and pristine is not None and dim is None and not nondet:
            # Outside CPU's tolerance in float16 / bfloat16: no farther than
            # CPU's result from the float64 one (see passed_closer).
            try:
                compare(expected, actual, "", values=False, device=not args.backward)
                precise = precise_result(op, sample, pristine, cotangents if args.backward
                                         else None)
                if precise is not None and closer_than_cpu(expected, actual, precise):
                    status = "passed_closer"
            except Exception:  # noqa: BLE001 - wrong structure or device: failed
                pass
        state["phase"] = None
        send(t="sample", sample=k, status=status, msg=msg, detected=detected)

    def meta_twins(op, dtype):
        """The first samples made on the meta device, or [] when that fails."""
        try:
            torch.manual_seed(0)
            random.seed(0)
            it = op.sample_inputs("meta", dtype, requires_grad=False)
            return [(s.input, s.args, s.kwargs) for s in itertools.islice(it, args.max_samples)]
        except Exception:  # noqa: BLE001 - e.g. a sample that calls .item()
            return []

    for index in range(args._start, len(units)):
        op, dtype, nondet, supported = units[index]
        send(t="unit", index=index)
        t0 = time.time()
        note = None
        timed_out = False
        if not supported:
            send(t="unit_end", index=index, note="dtype not supported on cpu by the OpInfo",
                 seconds=0.0, timeout=False)
            continue
        state["phase"] = None
        state["errored"] = False
        signal.alarm(args.timeout)
        try:
            twins = meta_twins(op, dtype)
            torch.manual_seed(0)
            random.seed(0)
            try:
                samples = iter(op.sample_inputs("cpu", dtype, requires_grad=args.backward))
            except Exception as e:  # noqa: BLE001
                samples, note = iter(()), "sample_inputs raised " + describe(e)
            k = 0
            while k < args.max_samples:
                try:
                    sample = next(samples)
                except StopIteration:
                    break
                except Exception as e:  # noqa: BLE001
                    note = "sample_inputs raised " + describe(e)
                    break
                run_sample(op, sample, twins[k] if k < len(twins) else no_twin, k, nondet,
                           dtype in wide_dtypes)
                k += 1
        except OpTimeout:
            timed_out = True
            note = f"timed out after {args.timeout}s"
            phase = state["phase"]
            state["phase"] = None
            if phase is not None and phase[0] == "tpu":
                send(t="sample", sample=phase[1], status="errored",
                     msg=f"Timeout: the op took more than {args.timeout}s on tpu")
        except Exception as e:  # noqa: BLE001 - never stop the run
            note = "unexpected " + describe(e)
        finally:
            signal.alarm(0)
        drain()
        send(t="unit_end", index=index, note=note, seconds=round(time.time() - t0, 3),
             timeout=timed_out)
        if args.isolate and (state["errored"] or timed_out) and index + 1 < len(units):
            # The daemon poisons what a failed op wrote; memory this session
            # reuses could carry that into later ops. A new session starts clean.
            send(t="restart")
            return 0
    send(t="done")
    return 0


def select_units(op_db, args, torch):
    """(op, dtype, nondeterministic, dtype supported) in op_db order."""
    ops = list(op_db)
    unknown = []
    if args.ops:
        wanted = [w.strip() for w in args.ops.split(",") if w.strip()]
        chosen = set()
        for w in wanted:
            match = [i for i, op in enumerate(ops) if w in (op.name, op.full_name)]
            if not match:  # "relu" for "nn.functional.relu"
                match = [i for i, op in enumerate(ops)
                         if f"nn.functional.{w}" in (op.name, op.full_name)]
            if not match:
                unknown.append(w)
            chosen.update(match)
        ops = [op for i, op in enumerate(ops) if i in chosen]
    if args.limit is not None:
        ops = ops[:args.limit]
    if args.backward:
        ops = [op for op in ops if op.supports_autograd]
    units = []
    for op in ops:
        cpu_dtypes = set(op.supported_backward_dtypes("cpu") if args.backward
                         else op.supported_dtypes("cpu"))
        if args.all_dtypes:
            dtypes = sorted(cpu_dtypes, key=str)
            if not dtypes:
                units.append((op, torch.float32, is_nondeterministic(op), False))
        else:
            dtypes = [getattr(torch, d) for d in args.dtypes.split(",") if d.strip()]
        for dt in dtypes:
            units.append((op, dt, is_nondeterministic(op), dt in cpu_dtypes))
    return units, unknown


# ===================================================================== parent


class ManagedDaemon(TpudProcess):
    """tpud for the whole run, restarted when it dies or is rebuilt."""

    def __init__(self, binary, hbm, extra_flags=()):
        super().__init__(binary, hbm, extra_flags, prefix="tpud-conformance.", log_to_file=True)
        self.starts = 0
        self.binary_stamp = None

    def start(self):
        deadline = time.time() + 300  # the binary may be being rebuilt
        while not os.access(self.binary, os.X_OK):
            if time.time() > deadline:
                raise RuntimeError(f"{self.binary} not found; build it first")
            time.sleep(2)
        self.starts += 1
        self.binary_stamp = self.stamp()
        super().start(timeout=20)

    def stamp(self):
        try:
            st = os.stat(self.binary)
            return (st.st_mtime_ns, st.st_size)
        except OSError:
            return None

    def binary_changed(self):
        """True when tpud was rebuilt since it started (torch_tpu likely too: a
        new plugin against an old daemon fails in odd ways)."""
        now = self.stamp()
        return now is not None and now != self.binary_stamp

    def restart(self):
        self.stop_process()
        self.start()


class Worker:
    def __init__(self, args, start, env, log_path):
        r, w = os.pipe()
        cmd = [sys.executable, os.path.abspath(__file__), "--_worker-fd", str(w),
               "--_start", str(start), "--max-samples", str(args.max_samples),
               "--timeout", str(args.timeout), "--dtypes", args.dtypes]
        if args.ops:
            cmd += ["--ops", args.ops]
        if args.limit is not None:
            cmd += ["--limit", str(args.limit)]
        if args.all_dtypes:
            cmd.append("--all-dtypes")
        if args.isolate:
            cmd.append("--isolate")
        if args.backward:
            cmd.append("--backward")
        self.log_path = log_path
        log = open(log_path, "ab")
        self.proc = subprocess.Popen(cmd, pass_fds=(w,), env=env, stdin=subprocess.DEVNULL,
                                     stdout=log, stderr=log)
        log.close()
        os.close(w)
        self.fd = r
        self.buf = b""

    def read(self, timeout):
        """The next message; None on end of stream, "timeout" when none came in time."""
        deadline = time.time() + timeout
        while b"\n" not in self.buf:
            left = deadline - time.time()
            if left <= 0:
                return "timeout"
            ready, _, _ = select.select([self.fd], [], [], left)
            if not ready:
                continue
            chunk = os.read(self.fd, 65536)
            if not chunk:
                return None
            self.buf += chunk
        line, self.buf = self.buf.split(b"\n", 1)
        try:
            return json.loads(line)
        except ValueError:
            return {"t": "garbage", "line": line[:200].decode(errors="replace")}

    def stderr_tail(self):
        try:
            with open(self.log_path, errors="replace") as f:
                lines = [l.strip() for l in f.readlines() if l.strip()]
        except OSError:
            return ""
        return lines[-1][:300] if lines else ""

    def kill(self):
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        os.close(self.fd)

    def exit_reason(self):
        rc = self.proc.wait()
        if rc < 0:
            try:
                return f"killed by {signal.Signals(-rc).name}"
            except ValueError:
                return f"killed by signal {-rc}"
        return f"exited with {rc}"


def new_unit(plan_entry):
    op, dtype, nondet, supported = plan_entry
    u = {"op": op, "dtype": dtype, "nondeterministic": nondet}
    u.update({s: 0 for s in STATUSES})
    u.update(first_error=None, first_mismatch=None, note=None, seconds=None, errors={},
             nondeterministic_samples_detected=0)
    return u


def record(unit, status, msg):
    unit[status] += 1
    if status == "errored":
        unit["first_error"] = unit["first_error"] or msg
        unit["errors"][msg] = unit["errors"].get(msg, 0) + 1
    elif status == "failed":
        unit["first_mismatch"] = unit["first_mismatch"] or msg


def summarise(units):
    s = {k: sum(u[k] for u in units) for k in STATUSES}
    # "passed" counts the passed_closer samples too; strict_pass_rate not.
    s["passed"] += s["passed_closer"]
    n = s["passed"] + s["failed"] + s["errored"]
    s["samples_passing_on_cpu"] = n
    s["pass_rate"] = s["passed"] / n if n else 0.0
    s["strict_pass_rate"] = (s["passed"] - s["passed_closer"]) / n if n else 0.0
    s["units"] = len(units)
    s["units_all_passed"] = sum(1 for u in units if (u["passed"] or u["passed_closer"])
                                and not u["failed"] and not u["errored"])
    s["units_with_errors"] = sum(1 for u in units if u["errored"])
    s["units_with_mismatches"] = sum(1 for u in units if u["failed"])
    return s


def groups(units, kind):
    """Messages grouped by normalised first line: samples, ops, an example."""
    g = {}
    for u in units:
        if kind == "errored":
            items = u["errors"].items()
        else:
            items = [(u["first_mismatch"], u["failed"])] if u["failed"] else []
        for msg, count in items:
            line = first_line(msg)
            if kind != "errored":  # "result[i]: Tensor-likes are not close!; details"
                line = line.split("; ")[0]
            key = group_key(line)
            e = g.setdefault(key, {"message": key, "example": first_line(msg), "samples": 0,
                                   "ops": []})
            e["samples"] += count
            name = u["op"] if u["dtype"] == "float32" else f"{u['op']}[{u['dtype']}]"
            if name not in e["ops"]:
                e["ops"].append(name)
    return sorted(g.values(), key=lambda e: (-len(e["ops"]), -e["samples"], e["message"]))


def write_report(path, args, meta, units, events, started, final):
    if not path:
        return
    report = {
        "torch": meta.get("torch"),
        "complete": final,
        "dtypes": "all supported" if args.all_dtypes else args.dtypes.split(","),
        "max_samples": args.max_samples,
        "isolated": args.isolate,
        "mode": "backward" if args.backward else "forward",
        "timeout_s": args.timeout,
        "seconds": round(time.time() - started, 1),
        "summary": summarise(units),
        "unknown_ops": meta.get("unknown", []),
        "isolation_restarts": meta.get("isolation_restarts", 0),
        "events": events,
        "error_groups": groups(units, "errored"),
        "mismatch_groups": groups(units, "failed"),
        "ops": units,
    }
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(report, f, indent=1)
    os.replace(tmp, path)


def backend_flags(backend):
    """tpud flags for --backend."""
    if backend != "pjrt":
        return []
    import xla_plugins.xla_cpu_pjrt as plugin

    path = os.path.join(os.path.dirname(plugin.__file__), "xla_cpu_pjrt.so")
    return ["--backend=pjrt", f"--pjrt_plugin={path}", "--pjrt_option=cpu_device_count=4"]


def run(args):
    started = time.time()
    env = dict(os.environ)
    daemon = None
    if args.start_daemon:
        daemon = ManagedDaemon(args.tpud, args.hbm, backend_flags(args.backend))
        daemon.start()
        daemon.env(env)
    logdir = tempfile.mkdtemp(prefix="opinfo-conformance.", dir="/tmp")
    worker_log = os.path.join(logdir, "worker.log")
    plan, meta, units, events = None, {}, [], []
    start = 0
    last_crash_start = None
    restarts = 0
    startup_failures = 0
    keep_logs = False
    worker = None
    try:
        while True:
            if daemon is not None and daemon.binary_changed():
                events.append({"event": "tpud rebuilt: restarted it", "before_unit": start})
                daemon.restart()
            worker = Worker(args, start, env, worker_log)
            unit, sample, step, unit_t0 = None, None, None, None
            done = False
            trouble = None  # "crash" / "hang"
            while True:
                if unit is not None:
                    wait = max(1.0, unit_t0 + args.timeout + GRACE_S - time.time())
                else:
                    wait = IMPORT_TIMEOUT_S if plan is None else 60
                msg = worker.read(wait)
                if msg == "timeout":
                    trouble = "hang"
                    break
                if msg is None:
                    trouble = "crash"
                    break
                t = msg.get("t")
                if t == "fatal":
                    print(f"opinfo_conformance: {msg['msg']}", file=sys.stderr)
                    worker.kill()
                    return 2
                if t == "plan":
                    if plan is None:
                        plan = msg["units"]
                        meta = {"unknown": msg["unknown"], "torch": msg["torch"]}
                        if msg["unknown"]:
                            print("not in op_db: " + ", ".join(msg["unknown"]), file=sys.stderr)
                elif t == "unit":
                    unit, sample, unit_t0 = new_unit(plan[msg["index"]]), None, time.time()
                    unit["index"] = msg["index"]
                elif t == "tpu":
                    sample, step = msg["sample"], msg.get("step")
                elif t == "sample":
                    record(unit, msg["status"], msg.get("msg"))
                    if msg.get("detected"):
                        unit["nondeterministic_samples_detected"] += 1
                    sample = None
                elif t == "unit_end":
                    unit["note"], unit["seconds"] = msg["note"], msg["seconds"]
                    unit["timeout"] = msg["timeout"]
                    finish_unit(args, unit, units, events, started, meta)
                    start = msg["index"] + 1
                    unit = None
                    if daemon is not None and not daemon.alive():
                        events.append({"event": "daemon died", "after_op": units[-1]["op"],
                                       "returncode": daemon.proc.returncode,
                                       "log": daemon.log_tail()})
                        trouble = "daemon"
                        break
                elif t == "done":
                    done = True
                    break
                elif t == "restart":
                    trouble = "restart"
                    break
            if done:
                worker.kill()
                break
            if trouble == "restart":  # after an op that failed: a fresh session
                worker.kill()
                restarts += 1
                continue
            # The worker crashed, hung or lost its daemon.
            if trouble == "hang":
                worker.kill()
                reason = f"hung for more than {args.timeout + GRACE_S}s (worker killed)"
            elif trouble == "daemon":
                worker.kill()
                reason = None
            else:
                reason = worker.exit_reason()
                tail = "" if worker.proc.returncode < 0 else worker.stderr_tail()
                worker.kill()
                reason = f"worker {reason}" + (f": {tail}" if tail else "")
            if plan is None:
                startup_failures += 1
                if startup_failures < 3:  # e.g. torch_tpu being reinstalled just now
                    time.sleep(5)
                    continue
                print(f"opinfo_conformance: the worker could not start: {reason}\n"
                      f"  see {worker_log}", file=sys.stderr)
                keep_logs = True
                return 2
            daemon_dead = daemon is not None and not daemon.alive()
            if unit is not None:
                if sample is not None:
                    kind = "Hang" if trouble == "hang" else "WorkerCrash"
                    record(unit, "errored", f"{kind}: {reason}" + (f" while {step}" if step else ""))
                unit["note"] = reason
                unit["seconds"] = round(time.time() - unit_t0, 3)
                if daemon_dead:
                    unit["note"] += f"; tpud died ({daemon.proc.returncode})"
                finish_unit(args, unit, units, events, started, meta)
                events.append({"event": trouble, "op": unit["op"], "dtype": unit["dtype"],
                               "reason": reason})
                start = unit["index"] + 1
            elif trouble != "daemon":
                # Between units: retry once from the same place, then skip it.
                events.append({"event": trouble, "op": None, "reason": reason})
                if last_crash_start == start:
                    skipped = new_unit(plan[start])
                    skipped["index"], skipped["note"] = start, f"skipped: {reason}"
                    finish_unit(args, skipped, units, events, started, meta)
                    start += 1
                last_crash_start = start
            if daemon is not None and (daemon_dead or trouble == "hang"):
                if daemon_dead and trouble != "daemon":
                    events.append({"event": "daemon died", "after_op": units[-1]["op"] if units else None,
                                   "returncode": daemon.proc.returncode, "log": daemon.log_tail()})
                daemon.restart()
            if start >= len(plan):
                break
    finally:
        if worker is not None and worker.proc.poll() is None:
            worker.proc.kill()
            worker.proc.wait()
        if daemon is not None:
            daemon.close()
        if not keep_logs:
            shutil.rmtree(logdir, ignore_errors=True)
    meta["isolation_restarts"] = restarts
    write_report(args.report, args, meta, units, events, started, final=True)
    print_summary(units, events, meta)
    rate = summarise(units)["pass_rate"]
    if args.min_pass_rate is not None and rate < args.min_pass_rate:
        return 1
    return 0


def finish_unit(args, unit, units, events, started, meta):
    units.append(unit)
    if args.verbose:
        extra = f"  ({unit['note']})" if unit["note"] else ""
        err = f"  {unit['first_error']}" if unit["first_error"] else ""
        print(f"[{len(units)}] {unit['op']} {unit['dtype']}: {unit['passed']} passed, "
              f"{unit['failed']} failed, {unit['errored']} errored, "
              f"{unit['skipped_cpu']} skipped_cpu, {unit['skipped_nondeterministic']} nondet"
              f"{extra}{err}", file=sys.stderr, flush=True)
    if len(units) % 25 == 0:
        write_report(args.report, args, meta, units, events, started, final=False)


def print_summary(units, events, meta):
    s = summarise(units)
    n = s["samples_passing_on_cpu"]
    if events:
        print(f"{len(events)} worker/daemon events (crashes, hangs); see the report's \"events\"")
    groups_e = groups(units, "errored")
    if groups_e:
        print(f"top {min(TOP_ERRORS, len(groups_e))} of {len(groups_e)} error groups "
              "(samples, ops: message; example ops):")
        for e in groups_e[:TOP_ERRORS]:
            ops = ", ".join(e["ops"][:6]) + (f", ... (+{len(e['ops']) - 6})" if len(e["ops"]) > 6 else "")
            print(f"  {e['samples']:5d} samples {len(e['ops']):4d} ops: {e['example']}\n"
                  f"        ops: {ops}")
    groups_m = groups(units, "failed")
    if groups_m:
        print(f"top {min(TOP_MISMATCHES, len(groups_m))} of {len(groups_m)} mismatch groups:")
        for e in groups_m[:TOP_MISMATCHES]:
            ops = ", ".join(e["ops"][:6]) + (f", ... (+{len(e['ops']) - 6})" if len(e["ops"]) > 6 else "")
            print(f"  {e['samples']:5d} samples {len(e['ops']):4d} ops: {e['example']}\n"
                  f"        ops: {ops}")
    print(f"ops x dtypes: {s['units']} ({s['units_all_passed']} all passed, "
          f"{s['units_with_errors']} with errors, {s['units_with_mismatches']} with mismatches); "
          f"samples skipped: {s['skipped_cpu']} fail on CPU, "
          f"{s['skipped_nondeterministic']} nondeterministic (ran on tpu, values not compared)"
          + (f", {s['skipped_no_grad']} without a differentiable output" if s["skipped_no_grad"]
             else ""))
    if s["passed_closer"]:
        print(f"{s['passed_closer']} of the passed samples differ from CPU's float16/bfloat16 "
              "result beyond tolerance but are as close as it to the float64 result; "
              f"without them: {100.0 * s['strict_pass_rate']:.1f}%")
    print(f"conformance: {s['passed']} passed, {s['failed']} failed, {s['errored']} errored "
          f"of {n} samples that pass on CPU ({100.0 * s['pass_rate']:.1f}%)", flush=True)


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ops", help="comma-separated OpInfo names (name, or name.variant); "
                   "default: every op in op_db")
    p.add_argument("--limit", type=int, help="only the first N ops (after --ops)")
    p.add_argument("--dtypes", help="comma-separated dtypes (default: " + ",".join(DEFAULT_DTYPES)
                   + "; with --backward: " + ",".join(BACKWARD_DTYPES) + ")")
    p.add_argument("--backward", action="store_true",
                   help="compare the gradients of each sample's inputs instead of the results")
    p.add_argument("--all-dtypes", action="store_true",
                   help="every dtype each OpInfo supports on the CPU (overrides --dtypes)")
    p.add_argument("--max-samples", type=int, default=5, help="samples per op and dtype (5)")
    p.add_argument("--timeout", type=int, default=20, help="seconds per op and dtype (20)")
    p.add_argument("--report", help="write the JSON report here")
    p.add_argument("--start-daemon", action="store_true",
                   help="run a tpud of our own (--tpud, --hbm) instead of TPUD_SOCKET's")
    p.add_argument("--tpud", default=str(DEFAULT_TPUD), help="the tpud binary for --start-daemon")
    p.add_argument("--hbm", default="4GiB", help="--hbm_bytes of that tpud (4GiB)")
    p.add_argument("--backend", choices=("simulated", "pjrt"), default="simulated",
                   help="that tpud's backend; pjrt runs XLA's CPU plugin from .venv (xla-cpu-pjrt)")
    p.add_argument("--min-pass-rate", type=float,
                   help="exit 1 when the pass rate is below this fraction (e.g. 0.9)")
    p.add_argument("--isolate", action="store_true",
                   help="a new worker (a new tpud session) after each op that fails; by default "
                   "one session runs everything, errors caught, as a user's process would")
    p.add_argument("-v", "--verbose", action="store_true", help="a line per op on stderr")
    p.add_argument("--_worker-fd", type=int, help=argparse.SUPPRESS)
    p.add_argument("--_start", type=int, default=0, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.dtypes is None:
        args.dtypes = ",".join(BACKWARD_DTYPES if args.backward else DEFAULT_DTYPES)
    if args.dtypes:
        args.dtypes = ",".join(d.strip().replace("torch.", "") for d in args.dtypes.split(",")
                               if d.strip())
    return args


def main(argv=None):
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if args._worker_fd is not None:
        return worker_main(args)
    if not args.all_dtypes and not args.dtypes:
        print("opinfo_conformance: --dtypes is empty", file=sys.stderr)
        return 2
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
