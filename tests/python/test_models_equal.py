"""Models on "tpu" behave as on CPU: parameter identity and sharing survive
moves between devices, and a caught error leaves later work clean."""
from conftest import run_in_child


def test_moves_keep_parameter_identity_tied_weights_and_optimizers(tpud):
    run_in_child(tpud, _moves_keep_parameter_identity_tied_weights_and_optimizers)


def _moves_keep_parameter_identity_tied_weights_and_optimizers():
    import torch
    import torch_tpu  # noqa: F401
    from torch import nn

    torch.manual_seed(0)

    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(11, 6)
            self.mid = nn.Linear(6, 6)
            self.head = nn.Linear(6, 11, bias=False)
            self.head.weight = self.emb.weight  # tied, as GPT-2's lm_head

        def forward(self, ids):
            return self.head(torch.tanh(self.mid(self.emb(ids))))

    def step(model, opt, ids, device):
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(ids.to(device)).flatten(0, 1),
                                           ids.to(device).flatten())
        loss.backward()
        opt.step()
        return loss.item()

    ids = torch.randint(0, 11, (3, 5))
    ref = Tied()
    model = Tied()
    model.load_state_dict(ref.state_dict())
    before = [id(p) for p in model.parameters()]
    # Optimizers made before the move keep training the moved model.
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=0.05)
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    assert torch._has_compatible_shallow_copy_type(torch.ones(1), torch.ones(1, device="tpu"))
    model.to("tpu")
    assert model.head.weight is model.emb.weight
    assert [id(p) for p in model.parameters()] == before
    assert all(p.device.type == "tpu" for p in model.parameters())
    for _ in range(3):
        a = step(ref, opt_ref, ids, "cpu")
        b = step(model, opt, ids, "tpu")
        assert abs(a - b) < 1e-5, (a, b)
    for (n, p), q in zip(ref.named_parameters(), model.parameters()):
        assert torch.allclose(p, q.cpu(), atol=1e-5), n
        assert torch.allclose(p.grad, q.grad.cpu(), atol=1e-5), n
    # Between chips and back to CPU, grads included, sharing kept.
    model.to("tpu:1")
    assert model.head.weight is model.emb.weight
    assert model.emb.weight.device == torch.device("tpu", 1)
    assert model.emb.weight.grad.device == torch.device("tpu", 1)
    model.cpu()
    assert model.head.weight is model.emb.weight
    assert [id(p) for p in model.parameters()] == before
    assert model.emb.weight.grad.device.type == "cpu"
    assert torch.allclose(model.emb.weight, ref.emb.weight, atol=1e-5)


def test_a_caught_error_is_reported_once_and_poisons_only_what_it_wrote(tpud):
    run_in_child(tpud, _a_caught_error_is_reported_once_and_poisons_only_what_it_wrote)


def _a_caught_error_is_reported_once_and_poisons_only_what_it_wrote():
    import torch
    import torch_tpu  # noqa: F401

    x = torch.randn(4, device="tpu")
    # The first op of an argument class waits for its result; this one's
    # data-dependent error is then asynchronous, reported at the next sync.
    torch.index_select(x, 0, torch.tensor([1], device="tpu"))
    bad = torch.index_select(x, 0, torch.tensor([10], device="tpu"))
    try:
        bad.sum().item()
    except RuntimeError as e:
        assert "index" in str(e), e
    else:
        raise AssertionError("an out-of-range index_select did not fail")
    # Reported once: the next synchronising calls on other tensors work.
    torch.tpu.synchronize()
    assert (torch.ones(3, device="tpu") * 2).sum().item() == 6.0
    # What the failed op wrote stays poisoned ...
    try:
        bad.cpu()
    except RuntimeError as e:
        assert "failed earlier" in str(e) and "index" in str(e), e
    else:
        raise AssertionError("reading the failed op's output did not fail")
    # ... until memory is reused: fresh tensors made from it (random and
    # constant fills, copies, op outputs) start clean.
    del bad
    for i in range(50):
        a = torch.randn(1, device="tpu")
        b = torch.zeros(1, device="tpu")
        c = torch.full((1,), 3.0, device="tpu")
        d = torch.tensor([float(i)], device="tpu")
        r = torch.relu(a) + b + c + d
        assert abs(r.item() - (max(a.item(), 0.0) + 3.0 + i)) < 1e-5
    m = torch.nn.functional.mse_loss(torch.ones(4, 4, device="tpu"),
                                     torch.zeros(4, 4, device="tpu"))
    assert m.item() == 1.0


def test_results_have_cpu_dtype_shape_and_values(tpud):
    run_in_child(tpud, _results_have_cpu_dtype_shape_and_values)


def _results_have_cpu_dtype_shape_and_values():
    import torch
    import torch_tpu  # noqa: F401

    def same(name, f, *args):
        want = f(*args)
        got = f(*[a.to("tpu") if isinstance(a, torch.Tensor) else a for a in args])
        if not isinstance(want, (tuple, list)):
            want, got = (want,), (got,)
        for i, (a, b) in enumerate(zip(want, got)):
            assert b.device.type == "tpu", (name, i)
            b = b.cpu()
            assert (a.shape, a.dtype) == (b.shape, b.dtype), (name, i, a.shape, a.dtype,
                                                              b.shape, b.dtype)
            assert a.stride() == b.stride() or a.numel() <= 1, (name, i)
            torch.testing.assert_close(b, a, msg=f"{name}[{i}]")

    bn = lambda *a: torch.native_batch_norm(*a)
    for dt in (torch.float32, torch.bfloat16):
        x = torch.randn(4, 3, 5, dtype=dt)
        w, b = torch.rand(3, dtype=dt) + 0.5, torch.randn(3, dtype=dt)
        rm, rv = torch.randn(3, dtype=dt), torch.rand(3, dtype=dt) + 0.5
        for training in (False, True):
            same(f"native_batch_norm {dt} {training}",
                 lambda x, w, b, rm, rv: torch.native_batch_norm(
                     x, w, b, rm.clone(), rv.clone(), training, 0.1, 1e-5), x, w, b, rm, rv)
            same(f"_native_batch_norm_legit {dt} {training}",
                 lambda x, w, b, rm, rv: torch.ops.aten._native_batch_norm_legit(
                     x, w, b, rm.clone(), rv.clone(), training, 0.1, 1e-5), x, w, b, rm, rv)
        same(f"_batch_norm_with_update {dt}",
             lambda x, w, b, rm, rv: torch.ops.aten._batch_norm_with_update(
                 x, w, b, rm.clone(), rv.clone(), 0.1, 1e-5)[:3], x, w, b, rm, rv)
        same(f"native_layer_norm {dt}",
             lambda x: torch.native_layer_norm(x, [5], None, None, 1e-5), x)
        same(f"native_layer_norm {dt}, float weight",
             lambda x, w: torch.native_layer_norm(x, [5], w, None, 1e-5), x,
             torch.rand(5) + 0.5)
        # Mixed precision batch norm: float parameters, bfloat16 input.
        same(f"native_batch_norm {dt}, float params",
             lambda x, w, b: torch.native_batch_norm(x, w, b, None, None, True, 0.1, 1e-5),
             x, torch.rand(3) + 0.5, torch.randn(3))
    weight = torch.randn(10, 3)
    idx, off = torch.tensor([1, 2, 4, 5, 4, 3]), torch.tensor([0, 2])
    for mode in (0, 1, 2):
        same(f"_embedding_bag mode {mode}",
             lambda w, i, o: torch.ops.aten._embedding_bag(w, i, o, False, mode),
             weight, idx, off)
    base = torch.arange(24.)
    same("as_strided of a partial view",
         lambda b: b[3:].as_strided((3, 2), (2, 1)), base)
    same("as_strided of a partial view, explicit offset before the view",
         lambda b: b[7:15].as_strided((4, 3), (3, 1), 1), base)
    same("as_strided of a 2-d slice",
         lambda b: b.view(4, 6)[1:, 2:].as_strided((2, 3), (6, 2)) * 2, base)


def test_indexing_with_slices_and_backward_with_absent_gradients(tpud):
    run_in_child(tpud, _indexing_with_slices_and_backward_with_absent_gradients)


def _indexing_with_slices_and_backward_with_absent_gradients():
    import torch
    import torch_tpu  # noqa: F401
    x = torch.arange(24.).view(2, 12)
    pos = torch.tensor([0, 3, 5])
    # x[:, pos] passes an index list whose first entry is absent.
    assert x.to("tpu")[:, pos.to("tpu")].cpu().equal(x[:, pos])
    assert x.to("tpu")[1:, pos.to("tpu")].cpu().equal(x[1:, pos])
    # A first layer's input needs no gradient: convolution_backward
    # returns no grad_input, and the slot stays empty.
    conv = torch.nn.Conv2d(3, 4, 3)
    dev = torch.nn.Conv2d(3, 4, 3).to("tpu")
    dev.load_state_dict(conv.state_dict())
    img = torch.randn(2, 3, 6, 6)
    conv(img).sum().backward()
    dev(img.to("tpu")).sum().backward()
    torch.testing.assert_close(dev.weight.grad.cpu(), conv.weight.grad, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(dev.bias.grad.cpu(), conv.bias.grad, atol=1e-5, rtol=1e-5)
