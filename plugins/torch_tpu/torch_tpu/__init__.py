"""torch_tpu: "tpu" as a native PyTorch device, served by tpud.

Tensors on "tpu" live in the daemon's HBM and every op on them runs in the
daemon (see the project's docs/design.md). `import torch_tpu`, or torch's
backend autoload, sets up `torch.tpu` and makes tpu `torch.accelerator`'s
device. The daemon is found through TPUD_SOCKET; TPU_VISIBLE_CHIPS narrows the
chips this process sees.
"""

_initialized = False


def _init():
    global _initialized
    if _initialized:
        return
    _initialized = True
    import atexit

    import torch

    from . import _C  # registers the allocator, guard, hooks and ops
    from . import tpu as tpu_module

    torch.utils.rename_privateuse1_backend("tpu")
    torch._register_device_module("tpu", tpu_module)
    torch.utils.generate_methods_for_privateuse1_backend(
        for_tensor=True, for_module=True, for_storage=True)
    from . import distributed

    distributed._register()
    from . import _compile, _random

    _compile.install_default_compile()
    _random.install()
    # Before the interpreter finalizes: see DrainAutogradDeviceThreads.
    atexit.register(_C._drain_autograd_device_threads)


def _autoload():
    """Entry point for torch's backend autoload (torch.backends group).

    Defined before anything imports torch: `import torch_tpu` imports torch,
    whose autoload calls back in here while this module is still loading.
    """
    _init()


_init()

from . import tpu  # noqa: E402

__all__ = ["tpu"]
