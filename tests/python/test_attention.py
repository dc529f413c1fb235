"""scaled_dot_product_attention on tpu takes the CPU's fused flash kernel
wherever the CPU takes it (and the math path wherever the CPU does), with
the CPU's values forward and backward; on PJRT, which does not lower the
flash kernel, it keeps the math path.

Each test runs one child process against one tpud (run_in_child).
"""
import pytest

from conftest import Daemon, pjrt_flags, run_in_child

# (name, builder source): q, k, v and the SDPA keyword arguments, on the CPU.
# The builders cover each of the CPU's rules for its flash kernel.
CASES = {
    "plain": "q=r(2,4,16,8); k=r(2,4,12,8); v=r(2,4,12,8); kw={}",
    "causal": "q=r(2,4,16,8); k=r(2,4,16,8); v=r(2,4,16,8); kw=dict(is_causal=True)",
    "bool_mask_2d": "q=r(2,4,16,8); k=r(2,4,12,8); v=r(2,4,12,8); "
                    "kw=dict(attn_mask=torch.rand(16,12)>0.3)",
    "float_mask_4d": "q=r(2,4,16,8); k=r(2,4,12,8); v=r(2,4,12,8); "
                     "kw=dict(attn_mask=r(2,1,16,12))",
    "mask_3d": "q=r(2,4,16,8); k=r(2,4,12,8); v=r(2,4,12,8); kw=dict(attn_mask=r(1,16,12))",
    "mask_needs_grad": "q=r(2,4,16,8); k=r(2,4,12,8); v=r(2,4,12,8); "
                       "kw=dict(attn_mask=r(16,12).requires_grad_())",
    "bfloat16": "q=r(2,4,16,8,dt=torch.bfloat16); k=r(2,4,16,8,dt=torch.bfloat16); "
                "v=r(2,4,16,8,dt=torch.bfloat16); kw=dict(is_causal=True)",
    "float16": "q=r(1,2,8,16,dt=torch.float16); k=r(1,2,8,16,dt=torch.float16); "
               "v=r(1,2,8,16,dt=torch.float16); kw={}",
    "float64": "q=r(1,2,8,4,dt=torch.float64); k=r(1,2,8,4,dt=torch.float64); "
               "v=r(1,2,8,4,dt=torch.float64); kw={}",
    "three_d": "q=r(4,16,8); k=r(4,12,8); v=r(4,12,8); kw={}",
    "gqa": "q=r(2,8,16,8); k=r(2,2,16,8); v=r(2,2,16,8); kw=dict(enable_gqa=True)",
    "value_head_dim": "q=r(2,4,16,8); k=r(2,4,12,8); v=r(2,4,12,4); kw={}",
    "strided_last_dim": "q=r(2,4,8,16).transpose(-1,-2); k=r(2,4,8,16).transpose(-1,-2); "
                        "v=r(2,4,8,16).transpose(-1,-2); kw={}",
    "transposed_heads": "q=r(2,16,4,8).transpose(1,2); k=r(2,16,4,8).transpose(1,2); "
                        "v=r(2,16,4,8).transpose(1,2); kw=dict(is_causal=True)",
    "dropout_eval": "q=r(2,4,16,8); k=r(2,4,16,8); v=r(2,4,16,8); kw=dict(dropout_p=0.0)",
    "scale": "q=r(2,4,16,8); k=r(2,4,16,8); v=r(2,4,16,8); kw=dict(scale=0.3)",
}


def recording(names):
    """A dispatch mode that appends the name of each op it sees to `names`
    (in the child: torch is imported there)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            names.append(func.__name__)
            return func(*args, **(kwargs or {}))

    return Record()


def compare(cases):
    """Per case: the kernel the CPU picks, whether tpu took the fused op,
    and the largest difference from the CPU's output and gradients."""
    import torch
    import torch.nn.functional as F

    gen = torch.Generator().manual_seed(0)

    def r(*shape, dt=torch.float32):
        return torch.randn(*shape, generator=gen).to(dt)

    for name, src in cases.items():
        env = {"torch": torch, "r": r}
        exec(src, env)
        q, k, v, kw = env["q"], env["k"], env["v"], env["kw"]
        if q.dim() == 4:
            cpu_choice = torch._fused_sdp_choice(q, k, v, kw.get("attn_mask"),
                                                 kw.get("dropout_p", 0.0),
                                                 kw.get("is_causal", False),
                                                 scale=kw.get("scale"),
                                                 enable_gqa=kw.get("enable_gqa", False))
        else:
            cpu_choice = 0
        ins = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        out = F.scaled_dot_product_attention(*ins, **kw)
        grad = torch.randn(out.shape, generator=gen).to(out.dtype)
        out.backward(grad)
        tins = [t.detach().to("tpu").requires_grad_() for t in (q, k, v)]
        tkw = {key: (val.detach().to("tpu").requires_grad_(val.requires_grad)
                     if isinstance(val, torch.Tensor) else val) for key, val in kw.items()}
        names = []
        with recording(names):
            tout = F.scaled_dot_product_attention(*tins, **tkw)
        tout.backward(grad.to("tpu"))
        diff = max([(out.double() - tout.cpu().double()).abs().max().item()] +
                   [(a.grad.double() - b.grad.cpu().double()).abs().max().item()
                    for a, b in zip(ins, tins)])
        fused = "_scaled_dot_product_fused_attention_overrideable.default" in names
        print("CASE", name, cpu_choice, int(fused), diff, out.dtype)


def parse(stdout):
    got = {}
    for line in stdout.splitlines():
        if line.startswith("CASE "):
            _, name, choice, fused, diff, dtype = line.split()
            got[name] = (int(choice), bool(int(fused)), float(diff), dtype)
    return got


TOLERANCE = {"torch.float32": 1e-5, "torch.float64": 1e-12, "torch.bfloat16": 2e-2,
             "torch.float16": 2e-3}


def test_fused_where_the_cpu_fuses_with_its_values(tpud):
    r = run_in_child(tpud, compare, CASES, timeout=300)
    got = parse(r.stdout)
    assert set(got) == set(CASES), r.stdout + r.stderr
    for name, (cpu_choice, fused, diff, dtype) in got.items():
        # 1: the CPU's flash kernel; tpu takes its fused op exactly then.
        assert fused == (cpu_choice == 1), (name, cpu_choice, fused)
        assert diff <= TOLERANCE[dtype], (name, diff)
    # The grid reaches both sides of the rules.
    assert sum(f for _, f, _, _ in got.values()) >= 8
    assert sum(not f for _, f, _, _ in got.values()) >= 5


def math_when_disabled_or_dropout():
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q = torch.randn(2, 4, 16, 8, device="tpu")
    seen = []
    with recording(seen), sdpa_kernel(SDPBackend.MATH):
        F.scaled_dot_product_attention(q, q, q)
    assert not any("overrideable" in n for n in seen), seen
    seen.clear()
    with recording(seen):
        F.scaled_dot_product_attention(q, q, q, dropout_p=0.5)
    assert not any("overrideable" in n for n in seen), seen
    seen.clear()
    with recording(seen), sdpa_kernel(SDPBackend.OVERRIDEABLE):
        F.scaled_dot_product_attention(q, q, q)
    assert any("overrideable" in n for n in seen), seen
    # With every usable kernel switched off: the CPU's errors, at the call.
    for kernels, kwargs in ((SDPBackend.EFFICIENT_ATTENTION, {}),
                            (SDPBackend.FLASH_ATTENTION, {"dropout_p": 0.5})):
        messages = []
        for dev in ("cpu", "tpu"):
            x = q.to(dev)
            try:
                with sdpa_kernel(kernels):
                    F.scaled_dot_product_attention(x, x, x, **kwargs)
                messages.append(None)
            except RuntimeError as e:
                messages.append(str(e).split(".")[0])
        assert messages[0] is not None and messages[0] == messages[1], (kernels, messages)
    # The fused op called directly with dropout: an error at the call, and
    # the process goes on.
    try:
        torch.ops.aten._scaled_dot_product_fused_attention_overrideable(q, q, q, None, 0.5)
        raise AssertionError("dropout accepted")
    except RuntimeError as e:
        assert "no dropout" in str(e), e
    assert torch.ones(2, device="tpu").sum().item() == 2.0


def test_math_path_when_disabled_or_with_dropout(tpud):
    run_in_child(tpud, math_when_disabled_or_dropout)


def test_pjrt_keeps_the_math_path():
    d = Daemon(extra_flags=pjrt_flags(), hbm="512MiB")
    try:
        r = run_in_child(d, compare, {n: CASES[n] for n in ("plain", "causal", "bool_mask_2d")},
                         timeout=300)
    finally:
        d.stop()
    got = parse(r.stdout)
    assert len(got) == 3, r.stdout + r.stderr
    for name, (_, fused, diff, dtype) in got.items():
        assert not fused, name
        assert diff <= 1e-4, (name, diff)


def compiled_block():
    import torch
    import torch.nn.functional as F
    import torch_tpu._compile as tpu_compile

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.qkv = torch.nn.Linear(32, 96)
            self.out = torch.nn.Linear(32, 32)

        def forward(self, x):
            b, n, _ = x.shape
            q, k, v = self.qkv(x).view(b, n, 3, 4, 8).permute(2, 0, 3, 1, 4)
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            return self.out(y.transpose(1, 2).reshape(b, n, 32))

    torch.manual_seed(0)
    cpu = Block()
    x = torch.randn(2, 16, 32)
    ref = cpu(x)
    ref.sum().backward()
    tpu = Block()
    tpu.load_state_dict(cpu.state_dict())
    tpu = tpu.to("tpu")
    compiled = torch.compile(tpu)
    for _ in range(2):
        tpu.zero_grad()
        out = compiled(x.to("tpu"))
        out.sum().backward()
        torch.testing.assert_close(out.cpu(), ref, rtol=0, atol=1e-6)
        torch.testing.assert_close(tpu.qkv.weight.grad.cpu(), cpu.qkv.weight.grad,
                                   rtol=0, atol=1e-6)
    # Forward and backward each captured as one program, none run eagerly.
    assert tpu_compile.explain() == {}, tpu_compile.explain()
    assert tpu_compile.stats["captures"] == 2, tpu_compile.stats


def test_compiled_attention_is_captured(tpud):
    run_in_child(tpud, compiled_block, timeout=300)


def dynamic_shapes():
    import torch
    import torch.nn.functional as F

    def attend(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    # dynamic=True: the kernel choice is traced with symbolic sequence
    # lengths, its checks becoming guards.
    compiled = torch.compile(attend, dynamic=True)
    for n in (16, 24, 40):
        q = torch.randn(2, 4, n, 8)
        t = q.to("tpu")
        torch.testing.assert_close(compiled(t, t, t).cpu(), attend(q, q, q), rtol=0, atol=1e-6)


def test_compiled_attention_with_dynamic_shapes(tpud):
    run_in_child(tpud, dynamic_shapes, timeout=300)
