"""The vLLM platform of the "tpu" device that tpud serves.

Everything the engine asks of the device goes through torch_tpu: memory
figures from tpud (the session's quota where it has one), streams, events,
pinned host memory, the "tpu" torch.distributed backend. No vllm._C kernel
is on this path: model layers take their plain PyTorch forms (vLLM's
forward_native), attention is vllm_tpud.attention, and the Triton kernels
the model runner launches are replaced by vllm_tpud.kernels.
"""
import os

import torch

from vllm.logger import init_logger
from vllm.platforms.interface import Platform, PlatformEnum

logger = init_logger(__name__)

ATTENTION_BACKEND = "vllm_tpud.attention.TpudAttentionBackend"
WORKER = "vllm_tpud.worker.TpudWorker"
COMPILER = "vllm_tpud.compiler.TpudCompiler"


class TpudPlatform(Platform):
    _enum = PlatformEnum.OOT
    device_name: str = "tpu"
    device_type: str = "tpu"
    dispatch_key: str = "PrivateUse1"
    ray_device_key: str = "TPU"
    dist_backend: str = "tpu"
    device_control_env_var: str = "TPU_VISIBLE_CHIPS"
    simple_compile_backend: str = "tpu"
    supported_quantization: list[str] = []
    additional_env_vars: list[str] = ["TPUD_SOCKET", "TPU_VISIBLE_CHIPS"]

    @property
    def supported_dtypes(self) -> list[torch.dtype]:
        return [torch.bfloat16, torch.float16, torch.float32]

    @classmethod
    def import_kernels(cls) -> None:
        import torch_tpu  # noqa: F401  (the device, its hooks and ops)

    @classmethod
    def register_triton_kernel_overrides(cls) -> None:
        from vllm.triton_utils.dispatcher import register_kernels

        from . import kernels

        register_kernels(kernels.OVERRIDES)

    @classmethod
    def get_attn_backend_cls(cls, selected_backend, attn_selector_config, num_heads=None) -> str:
        from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

        if attn_selector_config.use_mla or attn_selector_config.use_sparse:
            raise NotImplementedError(
                "tpu (vllm_tpud): MLA and sparse attention are not supported; "
                "models with standard multi-head or grouped-query attention are")
        if selected_backend not in (None, AttentionBackendEnum.CUSTOM):
            logger.info("tpu: attention backend %s is not available, using TPUD_SDPA",
                        selected_backend.name)
        register_backend(AttentionBackendEnum.CUSTOM, ATTENTION_BACKEND)
        return AttentionBackendEnum.CUSTOM.get_path()

    @classmethod
    def get_compile_backend(cls) -> str:
        # What vLLM's piecewise compilation hands each piece of the model to
        # (vLLM's small @torch.compile helpers use simple_compile_backend,
        # torch_tpu's Dynamo backend "tpu").
        return COMPILER

    @classmethod
    def get_device_name(cls, device_id: int = 0) -> str:
        return torch.tpu.get_device_name(device_id)

    @classmethod
    def get_device_uuid(cls, device_id: int = 0) -> str:
        p = torch.tpu.get_device_properties(device_id)
        return f"tpud-{p.host}-chip{p.chip}"

    @classmethod
    def get_device_total_memory(cls, device_id: int = 0) -> int:
        return torch.tpu.memory_budget(device_id).budget

    @classmethod
    def set_device(cls, device: torch.device) -> None:
        torch.tpu.set_device(device)

    @classmethod
    def manual_seed_all(cls, seed: int) -> None:
        torch.tpu.manual_seed_all(seed)

    @classmethod
    def is_pin_memory_available(cls) -> bool:
        return True

    @classmethod
    def get_current_memory_usage(cls, device=None) -> float:
        torch.tpu.reset_peak_memory_stats(device)
        return torch.tpu.max_memory_allocated(device)

    @classmethod
    def check_if_supports_dtype(cls, dtype: torch.dtype):
        if dtype not in (torch.bfloat16, torch.float16, torch.float32):
            raise ValueError(f"tpu: dtype {dtype} is not supported for models; "
                             "use bfloat16, float16 or float32")

    @classmethod
    def check_runner_kv_caches_multi_layer(cls) -> None:
        pass

    @classmethod
    def check_and_update_config(cls, vllm_config) -> None:
        from vllm.config import CompilationMode, CUDAGraphMode

        if vllm_config.speculative_config is not None:
            raise ValueError("tpu (vllm_tpud): speculative decoding is not supported; "
                             "leave --speculative-config out")
        parallel_config = vllm_config.parallel_config
        if parallel_config.worker_cls == "auto":
            parallel_config.worker_cls = WORKER
        if parallel_config.enable_dbo:
            logger.warning_once("tpu: dual-batch overlap is not supported, disabled")
            parallel_config.enable_dbo = False
        # Workers are separate processes that open their own tpud sessions:
        # spawn them, never fork a process that holds one.
        os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "spawn"

        cache_config = vllm_config.cache_config
        if not cache_config.user_specified_block_size:
            cache_config.block_size = 16

        compilation_config = vllm_config.compilation_config
        compilation_config.cudagraph_mode = CUDAGraphMode.NONE
        compilation_config.cudagraph_capture_sizes = []
        if compilation_config.mode != CompilationMode.NONE:
            # vLLM's own piecewise compilation: Dynamo traces the model once,
            # the graph is split at the attention ops, and each piece goes to
            # vllm_tpud.compiler (tpud programs per input signature).
            compilation_config.mode = CompilationMode.VLLM_COMPILE
            compilation_config.backend = "tpu"
            # vLLM's ahead-of-time artifacts are Inductor's output code;
            # tpud programs are built again by each process.
            os.environ["VLLM_USE_AOT_COMPILE"] = "0"
            if compilation_config.compile_sizes is None:
                compilation_config.compile_sizes = []
            # vLLM's fusion passes rewrite graphs into CUDA and Inductor
            # kernels: none apply here.
            passes = compilation_config.pass_config
            for name in list(vars(passes)):
                if (name.startswith("fuse_") or name.startswith("enable_")) and \
                        getattr(passes, name) is True:
                    setattr(passes, name, False)

        # Sampled tokens are read back at once; no overlapped scheduling.
        vllm_config.scheduler_config.async_scheduling = False
        vllm_config.profiler_config.torch_profiler_dump_cuda_time_total = False

    @classmethod
    def support_static_graph_mode(cls) -> bool:
        return False

    @classmethod
    def opaque_attention_op(cls) -> bool:
        return True

    @classmethod
    def get_device_communicator_cls(cls) -> str:
        return ("vllm.distributed.device_communicators.base_device_communicator."
                "DeviceCommunicatorBase")
