"""torch.distributed's "tpu" backend (collectives inside tpud).

`dist.init_process_group("tpu")` makes a process group whose collectives
on tpu tensors run in tpud along the host's ICI torus; with no backend
named, torch uses "cpu:gloo,tpu:tpu". Rendezvous goes through c10d's store,
so torchrun works unchanged.

A group whose ranks use different tpuds (hosts) is hierarchical: each host
runs its part inside its tpud, and the first rank of each host exchanges
the hosts' results over gloo (TCP); all_to_all, and send/recv between
ranks of different hosts, go over gloo among all the group's ranks. See plugins/torch_tpu/csrc/distributed.cc
and docs/design.md.
"""
import datetime
import os
import socket


def _host_key():
    from . import _C

    # One tpud serves one host: its socket names the host (two tpuds on one
    # machine are two hosts).
    return f"{socket.gethostname()}|{os.path.realpath(_C._socket())}"


def _create_backend(store, rank, size, timeout):
    import torch.distributed as dist

    from . import _C

    store.set(f"tpu_host/{rank}", _host_key())
    keys = [store.get(f"tpu_host/{r}").decode() for r in range(size)]
    hosts = list(dict.fromkeys(keys))  # numbered by their first rank
    host_of = [hosts.index(k) for k in keys]
    cross = world = None
    if len(hosts) > 1:
        leaders = [host_of.index(h) for h in range(len(hosts))]
        if rank in leaders:
            cross = dist.ProcessGroupGloo(dist.PrefixStore("tpu_cross/", store),
                                          leaders.index(rank), len(hosts), timeout)
        # all_to_all and point-to-point between hosts: gloo among all ranks.
        world = dist.ProcessGroupGloo(dist.PrefixStore("tpu_world/", store), rank, size, timeout)
    return _C._ProcessGroupTPU(store, rank, size, timeout, host_of, cross, world)


def _register():
    import torch.distributed as dist

    if not dist.is_available() or "tpu" in dist.Backend.backend_list:
        return
    from . import _C

    _C._register_distributed()
    dist.Backend.register_backend("tpu", _create_backend, devices=["tpu"])
    _default_to_gloo_and_tpu()
    _monitored_barrier_by_gloo()


def _default_to_gloo_and_tpu():
    # init_process_group() (and new_group()) with no backend: torch 2.13
    # makes only the accelerator's backend, so CPU tensors (object
    # collectives, a CPU barrier) would have none. As NCCL users get from
    # "cpu:gloo,cuda:nccl", a group on tpu gets "cpu:gloo,tpu:tpu".
    from torch.distributed import distributed_c10d as c10d

    config = c10d.BackendConfig
    if getattr(config, "_torch_tpu_default", False):
        return
    init = config.__init__

    def __init__(self, backend):
        init(self, backend)
        if str(backend) == c10d.Backend.UNDEFINED and list(self.device_backend_map) == ["tpu"]:
            self.device_backend_map = {"cpu": c10d.Backend(c10d.Backend.GLOO),
                                       "tpu": self.device_backend_map["tpu"]}

    config.__init__ = __init__
    config._torch_tpu_default = True


def _monitored_barrier_by_gloo():
    # torch runs monitored_barrier only on a group whose backend is "gloo"
    # itself, and refuses "cpu:gloo,tpu:tpu" (the default) although its CPU
    # part is gloo, which is what runs it. A group with gloo for the CPU and
    # tpu for tpu gets it; any other group (the "tpu" backend alone) keeps
    # torch's own error.
    import functools

    import torch
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    original = c10d.monitored_barrier
    if getattr(original, "_torch_tpu", False):
        return

    @functools.wraps(original)
    def monitored_barrier(group=None, timeout=None, wait_all_ranks=False):
        pg = group or c10d._get_default_group()
        if c10d._rank_not_in_group(group) or not _gloo_and_tpu(pg):
            return original(group, timeout, wait_all_ranks)
        if timeout is None:
            timeout = c10d._get_default_timeout(c10d.Backend.GLOO)
        elif isinstance(timeout, (int, float)):
            timeout = datetime.timedelta(seconds=timeout)
        c10d._check_valid_timeout(timeout)
        return pg.monitored_barrier(timeout, wait_all_ranks=wait_all_ranks)

    def _gloo_and_tpu(pg):
        try:
            cpu = pg._get_backend(torch.device("cpu"))
            tpu = pg._get_backend(torch.device("tpu"))
        except RuntimeError:  # no backend for one of them
            return False
        return isinstance(cpu, dist.ProcessGroupGloo) and tpu.name() == "tpu"

    monitored_barrier._torch_tpu = True
    c10d.monitored_barrier = monitored_barrier
    dist.monitored_barrier = monitored_barrier
