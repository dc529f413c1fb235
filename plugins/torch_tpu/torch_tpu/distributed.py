"""torch.distributed's "tpu" backend (collectives inside tpud).

`dist.init_process_group("tpu")` makes a process group whose collectives
on tpu tensors run in tpud along the host's ICI torus; with no backend
named, torch uses "cpu:gloo,tpu:tpu". Rendezvous goes through c10d's store,
so torchrun works unchanged. See plugins/torch_tpu/csrc/distributed.cc.
"""


def _create_backend(store, rank, size, timeout):
    from . import _C

    return _C._ProcessGroupTPU(store, rank, size, timeout)


def _register():
    import torch.distributed as dist

    if not dist.is_available() or "tpu" in dist.Backend.backend_list:
        return
    from . import _C

    _C._register_distributed()
    dist.Backend.register_backend("tpu", _create_backend, devices=["tpu"])
