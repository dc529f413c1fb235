"""torch_tpu: "tpu" as a native PyTorch device, served by tpud.

Tensors on "tpu" live in the daemon's HBM and every op on them runs in the
daemon (see the project's docs/design.md). `import torch_tpu`, or torch's
backend autoload, sets up `torch.tpu` and makes tpu `torch.accelerator`'s
device. The daemon is found through TPUD_SOCKET; TPU_VISIBLE_CHIPS narrows the
chips this process sees.
"""
import torch

from . import _C  # registers the allocator, guard, hooks and ops
from . import tpu as _tpu_module

__all__ = ["tpu"]

_initialized = False


def _init():
    global _initialized
    if _initialized:
        return
    torch.utils.rename_privateuse1_backend("tpu")
    torch._register_device_module("tpu", _tpu_module)
    torch.utils.generate_methods_for_privateuse1_backend(
        for_tensor=True, for_module=True, for_storage=True)
    _initialized = True


def _autoload():
    """Entry point for torch's backend autoload (torch.backends group)."""
    _init()


_init()
tpu = _tpu_module
