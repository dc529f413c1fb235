"""torch.tpu: the device module of "tpu" (mirrors torch.cuda where it can)."""
import contextlib
import types

import torch

from . import _C

__all__ = [
    "device_count", "is_available", "current_device", "set_device", "device",
    "synchronize", "Stream", "Event", "stream", "current_stream", "default_stream",
    "manual_seed", "manual_seed_all", "seed", "initial_seed", "get_rng_state",
    "set_rng_state", "memory_allocated", "max_memory_allocated", "memory_reserved",
    "max_memory_reserved", "memory_stats", "reset_peak_memory_stats", "empty_cache",
    "mem_get_info", "get_device_name", "get_device_properties", "get_amp_supported_dtype",
    "is_initialized", "is_bf16_supported", "set_stream", "memory_budget",
    "set_eager_mode", "get_eager_mode", "programs",
]


def is_available():
    return _C._device_count() > 0


def device_count():
    return _C._device_count()


def is_initialized():
    return True


def _index(device):
    if device is None:
        return _C._current_device()
    if isinstance(device, int):
        return device
    device = torch.device(device)
    if device.type != "tpu":
        raise ValueError(f"expected a tpu device, got {device}")
    return device.index if device.index is not None else _C._current_device()


def current_device():
    return _C._current_device()


def set_device(device):
    _C._set_device(_index(device))


class device:
    """Context manager that makes `idx` the current tpu device."""

    def __init__(self, idx):
        self.idx = _index(idx)
        self.prev = None

    def __enter__(self):
        self.prev = _C._current_device()
        _C._set_device(self.idx)

    def __exit__(self, *exc):
        _C._set_device(self.prev)
        return False


def synchronize(device=None):
    """Waits for all queued work of this process; raises the first op error."""
    _C._synchronize()


def set_eager_mode(mode):
    """How eager ops go to tpud: "direct" (each op as it is issued) or "fused"
    (ops held and sent as one program when a result is needed: a copy to the
    host, .item(), a synchronize, an event, a collective, a compiled graph;
    on the PJRT backend that program is compiled whole). Errors surface at
    the same synchronising calls either way. $TPU_EAGER_MODE sets it at
    start-up (auto, the default: fused where tpud compiles runs of ops
    whole, PJRT with device memory; else direct)."""
    if mode not in ("direct", "fused"):
        raise ValueError(f"eager mode {mode!r}: the modes are 'direct' and 'fused'")
    _C._set_eager_fusion(mode == "fused")


def get_eager_mode():
    return "fused" if _C._eager_fusion() else "direct"


def programs():
    """This process's captured programs (torch.compile) and fused eager runs
    ("eager (fused)", one entry per chip), as `tpuctl programs` shows them,
    after a synchronize: a list of dicts with name, id, chip, records (of
    the latest run), calls, busy_seconds, compiles (runs whose program tpud
    compiled) and last_compile (why the latest compile happened: where its
    ops part from the nearest earlier program's, and what changed)."""
    return _C._programs()


# Streams and events are torch's generic ones on the "tpu" device.
def Stream(device=None, priority=0):
    return torch.Stream(device=torch.device("tpu", _index(device)), priority=priority)


def Event(enable_timing=False, blocking=False, interprocess=False):
    return torch.Event(device="tpu", enable_timing=enable_timing)


def current_stream(device=None):
    return torch.accelerator.current_stream(torch.device("tpu", _index(device)))


def default_stream(device=None):
    s = torch.Stream(device=torch.device("tpu", _index(device)))
    return torch.Stream(stream_id=0, device_index=s.device_index, device_type=s.device_type)


def set_stream(stream):
    """Makes `stream` the current stream of its device (torch.cuda.set_stream)."""
    if stream is None:
        return
    torch.accelerator.set_stream(stream)


@contextlib.contextmanager
def stream(s):
    """Makes `s` the current stream of its device inside the block."""
    if s is None:
        yield
        return
    prev = torch.accelerator.current_stream(s.device)
    torch.accelerator.set_stream(s)
    try:
        yield
    finally:
        torch.accelerator.set_stream(prev)


def _default_gen(index):
    return _C._default_generator(index)


def manual_seed(seed):
    _default_gen(_C._current_device()).manual_seed(int(seed))


def manual_seed_all(seed):
    for i in range(max(device_count(), 1)):
        _default_gen(i).manual_seed(int(seed))


def seed():
    return _default_gen(_C._current_device()).seed()


def initial_seed():
    return _default_gen(_C._current_device()).initial_seed()


def get_rng_state(device="tpu"):
    return _default_gen(_index(device)).get_state()


def set_rng_state(new_state, device="tpu"):
    _default_gen(_index(device)).set_state(new_state)


def memory_stats(device=None):
    return dict(sorted(_C._stats(_index(device)).items()))


def memory_allocated(device=None):
    return _C._stats(_index(device))["allocated_bytes.all.current"]


def max_memory_allocated(device=None):
    return _C._stats(_index(device))["allocated_bytes.all.peak"]


def memory_reserved(device=None):
    return _C._stats(_index(device))["reserved_bytes.all.current"]


def max_memory_reserved(device=None):
    return _C._stats(_index(device))["reserved_bytes.all.peak"]


def reset_peak_memory_stats(device=None):
    _C._reset_peak_stats(_index(device))


def empty_cache():
    _C._empty_cache()


def mem_get_info(device=None):
    return tuple(_C._mem_get_info(_index(device)))


def memory_budget(device=None):
    """What this process may hold on the device's chip, from tpud.

    total: the chip's HBM; quota: the session's per-chip quota (0: none);
    budget: the quota where there is one, else the chip's HBM; held: what the
    session holds on the chip now; available: what it may still allocate
    (what the chip has free, and no more than the quota less what it holds:
    mem_get_info's free figure).
    """
    m = _C._session_memory(_index(device))
    return types.SimpleNamespace(
        total=m["chip_total_bytes"], quota=m["quota_bytes"],
        budget=m["quota_bytes"] or m["chip_total_bytes"], held=m["session_bytes"],
        available=m["available_bytes"])


def get_device_properties(device=None):
    return types.SimpleNamespace(**_C._properties(_index(device)))


def get_device_name(device=None):
    return _C._properties(_index(device))["name"]


def get_amp_supported_dtype():
    return [torch.bfloat16, torch.float16]


def is_bf16_supported():
    return True


def _is_in_bad_fork():
    return False
