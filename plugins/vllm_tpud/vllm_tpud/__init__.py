"""vLLM on "tpu" through tpud.

vLLM calls `register` (the `vllm.platform_plugins` entry point) while it
picks its platform. The platform is active whenever torch_tpu can be
imported; `VLLM_TARGET_DEVICE=cpu` still selects vLLM's own CPU platform,
and `VLLM_TPUD=0` turns this one off.
"""
import importlib.util
import os


def register():
    if os.environ.get("VLLM_TPUD", "1") == "0":
        return None
    if importlib.util.find_spec("torch_tpu") is None:
        return None
    return "vllm_tpud.platform.TpudPlatform"
