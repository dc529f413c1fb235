"""torch_tpu's re-inplacing pass (torch_tpu/_reinplace.py) on CPU graphs.

Each function is compiled with AOTAutograd as the "tpu" backend does (input
mutations kept in the graph as copy_), the pass is run on every graph, and the
graph then runs on CPU tensors: results and the inputs it mutated must equal
eager PyTorch, and the pass must have rewritten exactly the ops it may. No
daemon is needed: the pass only reads the graph and its fake tensors."""
import collections
import copy

import pytest
import torch
from torch._dynamo.backends.common import aot_autograd
from torch.fx.experimental.proxy_tensor import make_fx

from torch_tpu import _reinplace


class Recorder:
    """A backend that runs the pass and remembers what it did per graph."""

    def __init__(self):
        self.changed = []
        self.ops = []
        comp = self.compile
        self.backend = aot_autograd(fw_compiler=comp, bw_compiler=comp, inference_compiler=comp,
                                    keep_inference_input_mutations=True)

    def compile(self, gm, example_inputs):
        self.changed.append(_reinplace.reinplace(gm))
        self.ops.append(collections.Counter(
            str(n.target) for n in gm.graph.nodes
            if n.op == "call_function" and "getitem" not in str(n.target)))
        return gm


def compiled_equals_eager(fn, *shapes, calls=2):
    torch._dynamo.reset()
    rec = Recorder()
    cfn = torch.compile(fn, backend=rec.backend)
    for call in range(calls):
        args = [torch.randn(*s) for s in shapes]
        mine = [a.clone() for a in args]
        ref = fn(*args)
        out = cfn(*mine)
        torch.testing.assert_close(out, ref, msg=lambda m: f"call {call} result: {m}")
        for i, (a, b) in enumerate(zip(mine, args)):
            torch.testing.assert_close(a, b, msg=lambda m: f"call {call} input {i}: {m}")
    return rec


def test_a_chain_of_mutations_runs_in_place_with_no_copy_back():
    def f(x):
        x.mul_(2)
        z = x.clone()
        x.add_(1)
        return z
    rec = compiled_equals_eager(f, (4, 4))
    assert rec.changed == [2]
    assert "aten.copy_.default" not in rec.ops[0], rec.ops[0]
    assert rec.ops[0]["aten.mul_.Tensor"] == 1 and rec.ops[0]["aten.add_.Tensor"] == 1


def traced_equals_eager(fn, *shapes):
    """fn traced as written (make_fx: in-place ops and copy_ stay where they
    are), re-inplaced, run on fresh tensors against fn itself."""
    gm = make_fx(fn, tracing_mode="fake")(*[torch.randn(*s) for s in shapes])
    changed = _reinplace.reinplace(gm)
    args = [torch.randn(*s) for s in shapes]
    mine = [a.clone() for a in args]
    torch.testing.assert_close(gm(*mine), fn(*args))
    for a, b in zip(mine, args):
        torch.testing.assert_close(a, b)
    return changed, collections.Counter(str(n.target) for n in gm.graph.nodes if n.op == "call_function")


def test_an_input_read_between_the_op_and_its_copy_back_keeps_the_functional_op():
    def reads_old_x(x, y):
        a = torch.ops.aten.add.Tensor(x, 1)
        b = y * x              # x's old value, after the add
        x.copy_(a)
        return b

    def reads_nothing(x, y):
        b = y * x
        a = torch.ops.aten.add.Tensor(x, 1)
        x.copy_(a)
        return b
    assert traced_equals_eager(reads_old_x, (4, 4), (4, 4))[1]["aten.add.Tensor"] == 1
    changed, ops = traced_equals_eager(reads_nothing, (4, 4), (4, 4))
    assert ops["aten.add_.Tensor"] == 1 and "aten.copy_.default" not in ops, ops


def test_a_result_written_after_its_copy_back_is_not_moved_into_the_input():
    def writes_after(x):
        r = torch.ops.aten.mul.Tensor(x, 2)
        x.copy_(r)
        r.add_(1)              # must not reach x
        return r

    def updates_before(x):     # as AOTAutograd writes it: the pass makes the add in place
        r = torch.ops.aten.mul.Tensor(x, 2)
        r2 = torch.ops.aten.add.Tensor(r, 1)
        x.copy_(r2)
        return r2.sum()
    assert traced_equals_eager(writes_after, (4, 4))[1]["aten.mul.Tensor"] == 1
    changed, ops = traced_equals_eager(updates_before, (4, 4))
    assert ops["aten.mul_.Tensor"] == 1 and "aten.copy_.default" not in ops, ops


def test_an_intermediate_read_later_is_not_overwritten():
    def read_later(x):
        t = x * 2
        u = torch.ops.aten.add.Tensor(t, 1)
        return u, t            # t is an output: it must keep its value

    def dead(x):
        t = x * 2
        return torch.ops.aten.add.Tensor(t, 1)
    assert traced_equals_eager(read_later, (4, 4))[1]["aten.add.Tensor"] == 1
    assert traced_equals_eager(dead, (4, 4))[1]["aten.add_.Tensor"] == 1


def test_a_view_of_a_value_moved_in_place_still_counts_as_a_reader():
    # tanh goes into t; d views tanh's result, so it views t: the add must
    # not write t while d is still to be returned.
    def f(x):
        t = x * 2
        u = torch.ops.aten.tanh.default(t)
        d = u.detach()
        v = torch.ops.aten.add.Tensor(u, 1.0)
        return v, d
    changed, ops = traced_equals_eager(f, (4, 4))
    assert ops["aten.tanh_.default"] == 1 and ops["aten.add.Tensor"] == 1, ops


@pytest.mark.slow
def test_gpt2_forward_and_backward_match_eager():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    ref = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=128, n_embd=32, n_layer=2, n_head=4, n_positions=64, resid_pdrop=0.0,
        embd_pdrop=0.0, attn_pdrop=0.0)).eval()
    mine = copy.deepcopy(ref)
    torch._dynamo.reset()
    rec = Recorder()
    ids = torch.randint(0, 128, (2, 12))
    out = torch.compile(mine, backend=rec.backend)(input_ids=ids, labels=ids)
    expected = ref(input_ids=ids, labels=ids)
    torch.testing.assert_close(out.logits, expected.logits)
    out.loss.backward()
    expected.loss.backward()
    for (name, p), q in zip(ref.named_parameters(), mine.parameters()):
        torch.testing.assert_close(q.grad, p.grad, atol=1e-4, rtol=2e-4,
                                   msg=lambda m: f"{name} grad: {m}")
    assert sum(rec.changed) > 0, rec.changed


def test_a_returned_result_is_not_moved_into_the_input_it_replaces():
    # The caller gets a tensor of its own, which it may change without changing x.
    def f(x):
        r = torch.ops.aten.mul.Tensor(x, 2)
        x.copy_(r)
        return r
    changed, ops = traced_equals_eager(f, (4, 4))
    assert ops["aten.mul.Tensor"] == 1, ops


def test_inputs_the_graph_does_not_mutate_are_never_written():
    def f(x, y):
        return (x * 2 + y).sigmoid() - x
    rec = compiled_equals_eager(f, (4, 4), (4, 4))
    # Intermediates may be reused; the inputs compare equal above.
    assert rec.changed[0] >= 1


def test_views_and_broadcasts_and_dtype_changes_are_left_alone():
    def f(x, y, z):
        v = x.view(16)
        w = x + 1          # x is read later through v
        s = y.add(z)       # y (1, 4) broadcasts to (4, 4): another shape
        h = x.half() * 3   # a cast: the product has another dtype than x
        return v * 2, w, s, h
    rec = compiled_equals_eager(f, (4, 4), (1, 4), (4, 4))
    assert rec.ops[0]["aten.add.Tensor"] == 2, rec.ops[0]


def test_an_op_reading_its_self_twice_stays_functional():
    def f(x):
        x.mul_(x)
        return x
    rec = compiled_equals_eager(f, (4, 4))
    assert rec.ops[0]["aten.mul.Tensor"] == 1, rec.ops[0]


def test_foreach_ops_write_their_inputs_in_place_and_training_matches_eager():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    mine = copy.deepcopy(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=True)
    my_opt = torch.optim.AdamW(mine.parameters(), lr=1e-2, foreach=True)
    torch._dynamo.reset()
    rec = Recorder()
    cmodel = torch.compile(mine, backend=rec.backend)
    cstep = torch.compile(my_opt.step, backend=rec.backend)
    x = torch.randn(8, 16)
    for _ in range(3):
        model(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        cmodel(x).pow(2).mean().backward()
        cstep()
        my_opt.zero_grad()
    for (name, p), q in zip(model.named_parameters(), mine.parameters()):
        torch.testing.assert_close(q, p, msg=lambda m: f"{name}: {m}")
    step_ops = rec.ops[-1]
    assert "aten.copy_.default" not in step_ops, step_ops
    assert step_ops["aten._foreach_mul_.Scalar"] >= 1, step_ops


def test_the_pass_can_be_turned_off(monkeypatch):
    monkeypatch.setenv("TORCH_TPU_REINPLACE", "0")

    def f(x):
        x.mul_(2)
        return x
    rec = compiled_equals_eager(f, (4, 4))
    assert rec.changed == [0] and rec.ops[0]["aten.copy_.default"] == 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_training_a_model_with_in_place_activations_matches_eager(dtype):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(inplace=True),
                                torch.nn.Linear(8, 8), torch.nn.SiLU(inplace=True)).to(dtype)
    mine = copy.deepcopy(model)
    torch._dynamo.reset()
    rec = Recorder()
    cmodel = torch.compile(mine, backend=rec.backend)
    x = torch.randn(4, 8, dtype=dtype)
    model(x).float().pow(2).sum().backward()
    cmodel(x).float().pow(2).sum().backward()
    for (name, p), q in zip(model.named_parameters(), mine.parameters()):
        torch.testing.assert_close(q.grad, p.grad, msg=lambda m: f"{name} grad: {m}")
