"""vLLM's model runner names torch.cuda's streams and events directly; in a
vLLM worker on tpu those names mean torch.tpu's (vLLM's XPU worker does the
same for torch.xpu). Only vLLM's worker processes call `install`.
"""
import functools

import torch

_installed = False


def _event(*args, blocking=None, **kwargs):
    # torch.cuda.Event takes `blocking`; a tpu event's synchronize() always
    # blocks the calling thread, so it has no meaning here.
    return torch.tpu.Event(*args, **kwargs)


def install() -> None:
    global _installed
    if _installed:
        return
    _installed = True
    # Each a distinct object: Dynamo keys its handlers on these callables.
    torch.cuda.Stream = torch.tpu.Stream
    torch.cuda.Event = _event
    torch.cuda.current_stream = functools.partial(torch.tpu.current_stream)
    torch.cuda.default_stream = functools.partial(torch.tpu.default_stream)
    torch.cuda.stream = functools.partial(torch.tpu.stream)
    torch.cuda.set_stream = functools.partial(torch.tpu.set_stream)
