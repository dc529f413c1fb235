"""Hugging Face Transformers models (tiny configs, random weights) and a
plain CNN train on "tpu" exactly as on CPU: forward, backward, optimizer
steps, greedy generate(), and from_pretrained(device_map="tpu")."""
import os

import pytest

from conftest import run_in_child

pytestmark = pytest.mark.slow  # Hugging Face models trained on CPU and tpu

transformers = pytest.importorskip("transformers")


TPUD_HBM = "2GiB"

# The simulated chip and the PJRT backend with tensors in device buffers (as
# on a TPU). The PJRT backend computing on tpud's arena (--pjrt_memory=host)
# passes them too; TPUD_HF_PJRT_HOST=1 adds it (about a minute, left out of
# CI's time).
BACKENDS = ["simulated", "pjrt-device"] + (
    ["pjrt"] if os.environ.get("TPUD_HF_PJRT_HOST") == "1" else [])


@pytest.fixture(scope="module", params=BACKENDS)
def any_backend(request):
    from conftest import Daemon, pjrt_flags
    flags = {"simulated": [], "pjrt-device": pjrt_flags() + ["--pjrt_memory=device"],
             "pjrt": pjrt_flags()}[request.param]
    d = Daemon(hbm=TPUD_HBM, extra_flags=flags)
    d.backend = request.param
    yield d
    d.stop()


# Shared by the tests' bodies (each runs in a fresh interpreter, see
# conftest.run_in_child).

def to(x, device):
    import torch
    if isinstance(x, torch.Tensor):
        return x.to(device)
    return {k: to(v, device) for k, v in x.items()}


def check_equal(ref, dev, batch, steps=3, atol=2e-5, rtol=2e-4):
    """Runs three AdamW steps on `ref` (CPU) and `dev` (its copy on tpu) with
    the same batches, comparing loss, every gradient and every parameter
    after each step. `batch()` returns the keyword inputs."""
    import torch
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    opt_dev = torch.optim.AdamW(dev.parameters(), lr=1e-3)
    noise = set()
    near_eps = {}  # parameter name -> elements whose gradient was near eps
    for step in range(steps):
        inputs = batch()
        out_ref = ref(**inputs)
        out_dev = dev(**to(inputs, "tpu"))
        torch.testing.assert_close(out_dev.loss.cpu(), out_ref.loss, atol=atol, rtol=rtol)
        torch.testing.assert_close(out_dev.logits.cpu(), out_ref.logits, atol=atol, rtol=rtol)
        for o in (opt_ref, opt_dev):
            o.zero_grad()
        out_ref.loss.backward()
        out_dev.loss.backward()
        for (name, p), q in zip(ref.named_parameters(), dev.parameters()):
            assert q.device.type == "tpu", name
            if p.grad is None:
                assert q.grad is None, name
                continue
            torch.testing.assert_close(q.grad.cpu(), p.grad, atol=atol, rtol=rtol,
                                       msg=lambda m: f"step {step} grad {name}: {m}")
            # A gradient that is zero in exact arithmetic (an attention key's
            # bias: softmax ignores a shift) is rounding noise on both sides,
            # and Adam scales noise up to steps of about lr: such a parameter
            # is held to that bound instead. So is each element whose
            # gradient is near Adam's eps (1e-8), where lr * g / (|g| + eps)
            # turns a rounding difference of 1e-9 into one of 1e-5.
            if p.grad.abs().max() < 1e-6:
                noise.add(name)
            small = p.grad.abs() < 1e-6
            near_eps[name] = small | near_eps.get(name, small)
        opt_ref.step()
        opt_dev.step()
        for (name, p), q in zip(ref.named_parameters(), dev.parameters()):
            got = q.detach().cpu()
            want = p.detach()
            bound = 1e-3 * (step + 1)
            if name in noise:
                torch.testing.assert_close(got, want, atol=bound, rtol=rtol,
                                           msg=lambda m: f"step {step} param {name}: {m}")
                continue
            mask = near_eps.get(name)
            if mask is not None and bool(mask.any()):
                assert (got - want).abs()[mask].max() <= bound, (step, name)
                got, want = got[~mask], want[~mask]
            torch.testing.assert_close(got, want, atol=atol, rtol=rtol,
                                       msg=lambda m: f"step {step} param {name}: {m}")


def check_generate(ref, dev, g, vocab):
    """Greedy decoding from the same prompt gives CPU's tokens."""
    import torch
    ids = torch.randint(0, vocab, (1, 5), generator=g)
    want = ref.generate(ids, max_new_tokens=8, do_sample=False, pad_token_id=0)
    got = dev.generate(ids.to("tpu"), max_new_tokens=8, do_sample=False, pad_token_id=0)
    assert got.cpu().tolist() == want.tolist(), (got, want)


def lm_batches(g, vocab):
    """Causal-LM batches: the labels are the inputs."""
    import torch

    def batch():
        ids = torch.randint(0, vocab, (2, 12), generator=g)
        return {"input_ids": ids, "labels": ids}
    return batch


def pair(model_cls, config):
    """`ref` (CPU) and `dev`, a copy moved to tpu."""
    import copy
    import torch
    torch.manual_seed(0)
    ref = model_cls(config)
    dev = copy.deepcopy(ref).to("tpu")
    return ref, dev


def train(daemon, fn):
    run_in_child(daemon, fn, timeout=600)


def test_gpt2_with_tied_embeddings_trains_and_generates_as_on_cpu(any_backend):
    train(any_backend, _gpt2_with_tied_embeddings_trains_and_generates_as_on_cpu)


def _gpt2_with_tied_embeddings_trains_and_generates_as_on_cpu():
    import torch
    import torch_tpu  # noqa: F401
    import transformers
    cfg = transformers.GPT2Config(n_layer=2, n_head=2, n_embd=32, vocab_size=97,
                                  n_positions=64, attn_pdrop=0.0, resid_pdrop=0.0,
                                  embd_pdrop=0.0)
    ref, dev = pair(transformers.GPT2LMHeadModel, cfg)
    assert dev.lm_head.weight is dev.transformer.wte.weight
    g = torch.Generator().manual_seed(1)
    check_equal(ref, dev, lm_batches(g, 97))
    check_generate(ref, dev, g, 97)


def test_bert_trains_as_on_cpu(any_backend):
    train(any_backend, _bert_trains_as_on_cpu)


def _bert_trains_as_on_cpu():
    import torch
    import torch_tpu  # noqa: F401
    import transformers
    cfg = transformers.BertConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                  intermediate_size=64, vocab_size=97,
                                  max_position_embeddings=64, hidden_dropout_prob=0.0,
                                  attention_probs_dropout_prob=0.0)
    ref, dev = pair(transformers.BertForMaskedLM, cfg)
    g = torch.Generator().manual_seed(2)
    def batch():
        ids = torch.randint(0, 97, (2, 10), generator=g)
        mask = torch.ones_like(ids)
        mask[1, 7:] = 0
        labels = torch.where(torch.rand(ids.shape, generator=g) < 0.3, ids, -100)
        return {"input_ids": ids, "attention_mask": mask, "labels": labels}
    check_equal(ref, dev, batch)


def test_llama_trains_and_generates_as_on_cpu(any_backend):
    train(any_backend, _llama_trains_and_generates_as_on_cpu)


def _llama_trains_and_generates_as_on_cpu():
    import torch
    import torch_tpu  # noqa: F401
    import transformers
    cfg = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2,
                                   vocab_size=97, max_position_embeddings=64)
    ref, dev = pair(transformers.LlamaForCausalLM, cfg)
    g = torch.Generator().manual_seed(3)
    check_equal(ref, dev, lm_batches(g, 97))
    check_generate(ref, dev, g, 97)


def test_t5_encoder_decoder_trains_as_on_cpu(any_backend):
    train(any_backend, _t5_encoder_decoder_trains_as_on_cpu)


def _t5_encoder_decoder_trains_as_on_cpu():
    import torch
    import torch_tpu  # noqa: F401
    import transformers
    cfg = transformers.T5Config(d_model=32, d_ff=64, d_kv=16, num_layers=2, num_heads=2,
                                vocab_size=97, dropout_rate=0.0, decoder_start_token_id=0)
    ref, dev = pair(transformers.T5ForConditionalGeneration, cfg)
    g = torch.Generator().manual_seed(4)
    def batch():
        return {"input_ids": torch.randint(1, 97, (2, 9), generator=g),
                "labels": torch.randint(1, 97, (2, 6), generator=g)}
    check_equal(ref, dev, batch)


def test_vision_transformer_trains_as_on_cpu(any_backend):
    train(any_backend, _vision_transformer_trains_as_on_cpu)


def _vision_transformer_trains_as_on_cpu():
    import torch
    import torch_tpu  # noqa: F401
    import transformers
    cfg = transformers.ViTConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                 intermediate_size=64, image_size=16, patch_size=4,
                                 num_labels=3, hidden_dropout_prob=0.0,
                                 attention_probs_dropout_prob=0.0)
    ref, dev = pair(transformers.ViTForImageClassification, cfg)
    g = torch.Generator().manual_seed(5)
    def batch():
        return {"pixel_values": torch.randn(2, 3, 16, 16, generator=g),
                "labels": torch.randint(0, 3, (2,), generator=g)}
    check_equal(ref, dev, batch)


def test_from_pretrained_with_device_map_tpu(any_backend, tmp_path):
    pytest.importorskip("accelerate")
    run_in_child(any_backend, _from_pretrained_with_device_map_tpu, str(tmp_path), timeout=600)


def _from_pretrained_with_device_map_tpu(path):
    import torch
    import torch_tpu  # noqa: F401
    import transformers
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=1, n_head=2, n_embd=16, vocab_size=50,
                                  n_positions=32)
    transformers.GPT2LMHeadModel(cfg).save_pretrained(path)
    ref = transformers.AutoModelForCausalLM.from_pretrained(path)
    dev = transformers.AutoModelForCausalLM.from_pretrained(path, device_map="tpu")
    assert all(p.device.type == "tpu" for p in dev.parameters())
    assert dev.lm_head.weight is dev.transformer.wte.weight
    ids = torch.tensor([[1, 2, 3, 4]])
    torch.testing.assert_close(dev(ids.to("tpu")).logits.cpu(), ref(ids).logits)


def test_cnn_with_batch_norm_trains_and_evaluates_as_on_cpu(any_backend):
    run_in_child(any_backend, _cnn_with_batch_norm_trains_and_evaluates_as_on_cpu, timeout=600)


def _cnn_with_batch_norm_trains_and_evaluates_as_on_cpu():
    import copy
    import torch
    import torch_tpu  # noqa: F401
    from torch import nn
    torch.manual_seed(0)
    ref = nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 4))
    dev = copy.deepcopy(ref).to("tpu")
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    opt_dev = torch.optim.SGD(dev.parameters(), lr=0.1, momentum=0.9)
    g = torch.Generator().manual_seed(1)
    for step in range(3):
        x = torch.randn(4, 3, 8, 8, generator=g)
        y = torch.randint(0, 4, (4,), generator=g)
        for m, o, d in ((ref, opt_ref, "cpu"), (dev, opt_dev, "tpu")):
            o.zero_grad()
            nn.functional.cross_entropy(m(x.to(d)), y.to(d)).backward()
            o.step()
        for (name, p), q in zip(ref.state_dict().items(), dev.state_dict().values()):
            torch.testing.assert_close(q.cpu(), p, atol=2e-5, rtol=2e-4,
                                       msg=lambda m: f"step {step} {name}: {m}")
    ref.eval()
    dev.eval()
    x = torch.randn(3, 3, 8, 8, generator=g)
    torch.testing.assert_close(dev(x.to("tpu")).cpu(), ref(x), atol=2e-5, rtol=2e-4)
