"""Errors ATen raises from arguments, dtypes and shapes raise at the call on
tpu, as ATen's class with ATen's message, and leave nothing behind for the
next call (issue 33). Data-dependent errors stay asynchronous: see
test_torch_tpu.py's test_async_error_surfaces_at_sync_with_op_name.

Each family runs in one child process against one tpud: the call must raise
(the same class as on the CPU), and a later, unrelated synchronising call in
the same process must succeed.
"""
import pytest

from conftest import TpudProcess, bazel_bin, run_py

# Each case: a statement that raises on the CPU, run on `dev`.
CASES = {
    # a dtype check in a CPU kernel (not in the meta kernel torch registers)
    "dtype": "torch.heaviside(torch.ones(3, dtype=torch.int8, device=dev), "
             "torch.ones(3, dtype=torch.float64, device=dev))",
    # an argument value check in a CPU kernel
    "value": "torch.empty(4, device=dev).random_(0, -5)",
    # a scalar argument's type against the tensor's
    "alpha": "torch.add(torch.ones(2, dtype=torch.int64, device=dev), "
             "torch.ones(2, dtype=torch.int64, device=dev), alpha=0.5)",
    # the class of the error: IndexError
    "index_class": "torch.ones(2, 3, device=dev).flip(2)",
    # shapes
    "shape": "torch.ones(2, 3, device=dev) + torch.ones(4, device=dev)",
    # the out= tensor of an op whose result depends on data
    "out_dtype": "torch.nonzero(torch.ones(3, device=dev), "
                 "out=torch.empty(0, device=dev))",
    # out= checks of kernels that build no TensorIterator: exact dtypes
    "out_bool": "torch.isposinf(torch.ones(2, device=dev), out=torch.empty(2, device=dev))",
    "out_indices": "torch.sort(torch.ones(3, device=dev), "
                   "out=(torch.empty(3, device=dev), torch.empty(3, device=dev)))",
    "out_exact": "torch.mm(torch.ones(2, 2, device=dev), torch.ones(2, 2, device=dev), "
                 "out=torch.empty(2, 2, dtype=torch.float64, device=dev))",
    "out_frexp": "torch.frexp(torch.ones(2, device=dev), "
                 "out=(torch.empty(2, device=dev), torch.empty(2, device=dev)))",
    "out_cast_class": "torch.cat([torch.ones(2, device=dev)], "
                      "out=torch.empty(2, dtype=torch.int32, device=dev))",
}

CHILD = r"""
import torch
for name, stmt in CASES.items():
    for d in ("cpu", "tpu"):
        dev = d
        try:
            eval(stmt)
            print(name, d, "returned")
        except Exception as e:
            print(name, d, "raised", type(e).__name__, "|", str(e).splitlines()[0])
        # nothing left for the next call
        try:
            v = torch.ones(2, device=d).sum().item()
            print(name, d, "next", v)
        except Exception as e:
            print(name, d, "next raised", type(e).__name__, str(e).splitlines()[0])
"""


@pytest.fixture(scope="module")
def outcomes(tpud):
    """What each case did on each device, from one child process."""
    r = run_py(tpud, f"CASES = {CASES!r}\n" + CHILD)
    got = {}
    for line in r.stdout.splitlines():
        parts = line.split(" ", 2)
        if len(parts) == 3:
            got.setdefault((parts[0], parts[1]), []).append(parts[2])
    return got, r.stdout + r.stderr


@pytest.mark.parametrize("family", sorted(CASES))
def test_error_raises_at_the_call_as_on_cpu(outcomes, family):
    got, out = outcomes
    cpu, tpu = got[(family, "cpu")], got[(family, "tpu")]
    assert cpu[0].startswith("raised"), out
    cpu_class = cpu[0].split()[1]
    assert tpu[0].startswith("raised " + cpu_class), out
    # ATen's own words (the CPU's message, give or take the op's name).
    cpu_words = cpu[0].split("|", 1)[1].strip()
    assert cpu_words[:40] in tpu[0], out
    assert tpu[1] == "next 2.0", out


def test_same_argument_class_after_an_error_raises_again(tpud):
    """A failing argument class is not remembered as checked: the same call
    raises at the call every time, and a good call of the same op works."""
    r = run_py(tpud, r"""
import torch
t = torch.empty(4, device="tpu")
for _ in range(3):
    try:
        t.random_(0, -5)
        print("returned")
    except RuntimeError as e:
        print("raised")
t.random_(0, 5)
print("ok", int(t.max().item()) < 5)
""")
    assert r.stdout.split() == ["raised", "raised", "raised", "ok", "True"], r.stdout + r.stderr


def test_default_dtype_is_honoured(tpud):
    r = run_py(tpud, r"""
import torch
torch.set_default_dtype(torch.float64)
x = torch.tensor([1, 2, 3], device="tpu") / 2
y = torch.arange(3, device="tpu") * 0.5
print(x.dtype, x.cpu().tolist(), y.dtype, y.cpu().tolist())
torch.set_default_dtype(torch.float32)
z = torch.tensor([1, 2, 3], device="tpu") / 2
print(z.dtype, z.cpu().tolist())
""")
    assert r.stdout.split("\n")[0] == "torch.float64 [0.5, 1.0, 1.5] torch.float64 [0.0, 0.5, 1.0]", r.stdout + r.stderr
    assert r.stdout.split("\n")[1] == "torch.float32 [0.5, 1.0, 1.5]", r.stdout + r.stderr


def test_cpu_zero_dim_tensor_operand(tpud):
    """A CPU 0-dim tensor (not a Python number) beside a tpu tensor is a
    scalar operand, as on CUDA."""
    r = run_py(tpud, r"""
import torch
x = torch.tensor([1.0, -2.0, 3.0], device="tpu")
print(torch.copysign(x, torch.tensor(-1.0)).cpu().tolist())
print(torch.copysign(x, torch.tensor(-1.0, dtype=torch.float64)).dtype)
""")
    assert r.stdout.split("\n")[:2] == ["[-1.0, -2.0, -3.0]", "torch.float32"], r.stdout + r.stderr


def test_kernel_warnings_reach_the_caller():
    """A warning a kernel raises in tpud (ATen's TORCH_WARN) is raised in the
    client as the CPU raises it, at the call or at the next synchronising
    call, and does not go to tpud's log."""
    d = TpudProcess(bazel_bin("daemon/tpud"), "256MiB", [], prefix="tpud-py.",
                    log_to_file=True)
    d.start()
    try:
        r = run_py(d, WARNINGS)
        log = open(d.log_path, errors="replace").read()
    finally:
        d.close()
    lines = r.stdout.splitlines()
    assert len(lines) == 2 and "degrees of freedom" in lines[0], r.stdout + r.stderr
    assert lines[0][len("cpu"):] == lines[1][len("tpu"):], r.stdout + r.stderr
    assert "degrees of freedom" not in log, log[-2000:]


WARNINGS = r"""
import warnings, torch
for dev in ("cpu", "tpu"):
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        torch.ones(1, device=dev).std().item()
        print(dev, sorted({(x.category.__name__, str(x.message)[:60]) for x in w}))
"""


def test_checks_on_extreme_numbers_raise_at_the_call(tpud):
    """A bound far outside the usual range is another argument class: after
    an ordinary uniform_, uniform_ over more than a double's range still
    raises at the call."""
    r = run_py(tpud, r"""
import torch
t = torch.empty(3, dtype=torch.float64, device="tpu")
t.uniform_(0, 1)
try:
    t.uniform_(-1e308, 1e308)
    print("returned")
except RuntimeError as e:
    print("raised", "uniform_ expects to-from" in str(e))
print(bool(((t >= 0) & (t < 1)).all().item()))
""")
    assert r.stdout.split() == ["raised", "True", "True"], r.stdout + r.stderr


def test_cpu_index_arguments_and_out_devices(tpud):
    """An integer index argument on the CPU goes to the device, as the CPU
    kernels take it; an out= tensor on another device is refused with
    ATen's words."""
    r = run_py(tpud, r"""
import torch
x = torch.zeros(2, 4, device="tpu")
x.index_fill_(1, torch.tensor([0, 2]), 5.0)
print(x.cpu().tolist())
print(torch.index_select(torch.arange(4.0, device="tpu"), 0, torch.tensor([3, 1])).cpu().tolist())
try:
    torch.nonzero(torch.ones(3, device="tpu"), out=torch.empty(0, dtype=torch.long))
    print("returned")
except RuntimeError as e:
    print("raised", "on the same device" in str(e))
""")
    assert r.stdout.splitlines() == [
        "[[5.0, 0.0, 5.0, 0.0], [5.0, 0.0, 5.0, 0.0]]", "[3.0, 1.0]", "raised True"], \
        r.stdout + r.stderr


def test_resizing_a_nonempty_out_tensor_warns(tpud):
    """ATen warns when an out= tensor that holds elements is resized."""
    r = run_py(tpud, r"""
import warnings, torch
for dev in ("cpu", "tpu"):
    a = torch.ones(2, 3, device=dev)
    for out in (torch.empty(5, device=dev), torch.empty(0, device=dev)):
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            torch.logit(a, out=out)
            torch.nonzero(a, out=torch.empty(1, dtype=torch.long, device=dev))
            print(dev, out.shape == a.shape, [str(x.message)[:40] for x in w])
""")
    lines = r.stdout.splitlines()
    assert len(lines) == 4 and [l[4:] for l in lines[:2]] == [l[4:] for l in lines[2:]], \
        r.stdout + r.stderr
    assert "An output with one or more elements" in lines[0], r.stdout


def test_out_checks_leave_good_out_tensors_alone(tpud):
    """The out= checks refuse only what the CPU refuses: out= tensors of the
    right dtype, misshapen (resized, with one warning), non-contiguous, or of
    a dtype an iterator op casts to, give the CPU's results."""
    r = run_py(tpud, r"""
import warnings, torch
def calls(dev):
    x = torch.tensor([[3.0, -1.0, float("inf")], [0.5, 2.0, -float("inf")]], device=dev)
    i64 = lambda *s: torch.empty(*s, dtype=torch.long, device=dev)
    f32 = lambda *s: torch.empty(*s, device=dev)
    yield torch.isposinf(x, out=torch.empty(2, 3, dtype=torch.bool, device=dev))
    yield torch.signbit(x, out=torch.empty(7, dtype=torch.bool, device=dev))
    yield torch.mm(x, x.t(), out=f32(4, 4)[::2, ::2])
    yield torch.addmm(f32(2, 2).fill_(1), x, x.t(), beta=2, out=f32(2, 2))
    yield torch.sort(x, 1, out=(f32(2, 3), i64(2, 3)))[1]
    yield torch.sort(x, stable=True, descending=True, out=(f32(0), i64(0)))[1]
    yield torch.topk(x, 2, out=(f32(1), i64(1)))[1]
    yield torch.max(x, 0, out=(f32(3), i64(3)))[1]
    yield torch.argmax(x, 1, keepdim=True, out=i64(2, 1))
    yield torch.aminmax(x, dim=0, out=(f32(3), f32(3)))[1]
    m, e = torch.frexp(x[:, :2], out=(f32(2, 2), torch.empty(2, 2, dtype=torch.int32, device=dev)))
    yield e
    yield torch.cat([x, x], 0, out=torch.empty(4, 3, dtype=torch.float64, device=dev))
for dev in ("cpu", "tpu"):
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        got = [(t.dtype, t.shape, t.cpu().tolist()) for t in calls(dev)]
    print(dev, repr(got), len(w))
""")
    lines = r.stdout.splitlines()
    assert len(lines) == 2 and lines[0][4:] == lines[1][4:], r.stdout + r.stderr
    # One warning per resized out= tensor holding elements: signbit's, and
    # topk's two.
    assert lines[0].endswith(" 3"), r.stdout
