"""Run TorchTitan 0.3.0's train entry point (torchtitan.train.main) unchanged, with two shims.

1. TT_DEVICE=cpu: TorchTitan has no device option; torchtitan.tools.utils picks the first
   available accelerator (cuda, mps, xpu, mtia, then PrivateUse1, i.e. "tpu" while tpud is
   reachable) and otherwise falls back to "cuda". For cpu this sets device_type="cpu" (process
   group backend gloo) before other torchtitan modules read it, with a stand-in for the few
   torch.cuda-style calls it makes, and FSDP's reduce-scatter made gloo-compatible. Without TT_DEVICE TorchTitan's own choice stands ("tpu").
2. torch.distributed.set_timeout (called after step 1) is newer than torch 2.13; fall back to
   distributed_c10d._set_pg_timeout.
Arguments are TorchTitan's own (--module llama3 --config llama3_debugmodel ...).
"""
import os
import sys
import types

import torch
import torch.distributed as dist
import torchtitan.tools.utils as tt_utils

assert "torchtitan.trainer" not in sys.modules

if not hasattr(dist, "set_timeout"):
    from torch.distributed.distributed_c10d import _set_pg_timeout

    dist.set_timeout = lambda timeout, group=None: _set_pg_timeout(timeout, group)

if os.environ.get("TT_DEVICE") == "cpu":
    cpu = types.SimpleNamespace(
        set_device=lambda *a: None,
        current_device=lambda: 0,
        device_count=lambda: 1,
        synchronize=lambda *a: None,
        empty_cache=lambda: None,
        reset_peak_memory_stats=lambda *a: None,
        memory_stats=lambda *a: {},
        get_device_name=lambda *a: "cpu",
        get_device_properties=lambda *a: types.SimpleNamespace(total_memory=1 << 40),
        is_available=lambda: True,
    )
    tt_utils.device_type, tt_utils.device_module = "cpu", cpu

    # FSDP: TorchTitan sets gradient_divide_factor=1.0, which FSDP2 turns into
    # ReduceOp.PREMUL_SUM(1.0) that gloo lacks; force plain SUM (same result) on cpu only.
    import torchtitan.distributed.fsdp as tt_fsdp

    _disable_div = tt_fsdp.disable_fsdp_gradient_division

    def _disable_div_gloo(model):
        _disable_div(model)
        for m in model.modules():
            if isinstance(m, tt_fsdp.FSDPModule):
                m.set_force_sum_reduction_for_comms(True)

    tt_fsdp.disable_fsdp_gradient_division = _disable_div_gloo
elif os.environ.get("TT_DEVICE"):
    assert tt_utils.device_type == os.environ["TT_DEVICE"], tt_utils.device_type

from torchtitan.train import main  # noqa: E402

main()
