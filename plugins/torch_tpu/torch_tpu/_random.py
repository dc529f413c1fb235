"""Random ops whose ATen kernels take no generator argument.

aten::native_dropout (F.dropout, nn.Dropout) draws from the default generator
of the device it runs on; run whole in tpud it would use the daemon's CPU
generator, which torch.tpu.manual_seed does not reach. On tpu it is composed
of bernoulli_, whose seed the tpu generator draws (and a captured program
reseeds at every run), so eager and compiled dropout repeat under
torch.tpu.manual_seed.
"""
import torch

_lib = None


def _native_dropout(input, p, train):
    if train is False or p == 0:  # None (unspecified) trains, as in ATen
        return input.clone(), torch.ones_like(input, dtype=torch.bool)
    if p == 1:
        return torch.zeros_like(input), torch.zeros_like(input, dtype=torch.bool)
    mask = torch.empty_like(input, dtype=torch.float32).bernoulli_(1 - p).to(torch.bool)
    return input * mask * (1.0 / (1 - p)), mask


def install():
    global _lib
    if _lib is not None:
        return
    _lib = torch.library.Library("aten", "IMPL")
    _lib.impl("native_dropout", _native_dropout, "PrivateUse1")
