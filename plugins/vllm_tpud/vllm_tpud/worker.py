"""vLLM's worker on a tpu device: vLLM's GPU worker with the device set up
through torch_tpu, and its memory budget taken from tpud.

vLLM sizes the KV cache as `gpu_memory_utilization` of the device's memory.
On tpu that is of what this session may hold on its chip: its per-chip quota
when it has one (`tpuctl quota`, or a device-plugin allocation), else the
chip's HBM. vLLM's memory profiling then reads tpud's figures through
torch.accelerator.
"""
import contextlib
import gc
import math

import torch

from vllm.logger import init_logger
from vllm.platforms import current_platform
from vllm.utils.mem_utils import MemorySnapshot, format_gib
from vllm.utils.torch_utils import set_random_seed
from vllm.v1.worker.gpu_worker import Worker, init_worker_distributed_environment

from . import cuda_names

logger = init_logger(__name__)


class TpudWorker(Worker):
    def init_device(self):
        if self.device_config.device_type != "tpu":
            raise RuntimeError(f"vllm_tpud: unsupported device {self.device_config.device}")
        cuda_names.install()
        count = torch.tpu.device_count()
        if count == 0:
            raise RuntimeError(
                "vllm_tpud: no tpu devices: is tpud running, and does TPUD_SOCKET name "
                "its socket?")
        if self.local_rank >= count:
            raise RuntimeError(
                f"vllm_tpud: worker {self.local_rank} needs tpu:{self.local_rank}, but "
                f"this process sees {count} tpu device(s) (TPU_VISIBLE_CHIPS narrows them)")
        self.device = torch.device(f"tpu:{self.local_rank}")
        torch.accelerator.set_device_index(self.device)
        current_platform.check_if_supports_dtype(self.model_config.dtype)

        init_worker_distributed_environment(
            self.vllm_config, self.rank, self.distributed_init_method, self.local_rank,
            current_platform.dist_backend)
        set_random_seed(self.model_config.seed)
        gc.collect()
        torch.accelerator.empty_cache()

        self.init_snapshot = MemorySnapshot(device=self.device)
        self.requested_memory = self._requested_memory()
        self._init_workspace_and_model_runner()

    def _requested_memory(self) -> int:
        """gpu_memory_utilization of the session's budget on its chip."""
        util = self.cache_config.gpu_memory_utilization
        kv_bytes = self.cache_config.kv_cache_memory_bytes
        b = torch.tpu.memory_budget(self.device)
        requested = math.ceil(b.budget * util)
        if b.quota:
            where = (f"this session's quota on tpu:{self.local_rank} is "
                     f"{format_gib(b.quota)} GiB, {format_gib(b.available)} GiB of it free")
        else:
            where = (f"tpu:{self.local_rank} has {format_gib(b.available)} GiB free of "
                     f"{format_gib(b.total)} GiB (other processes hold the rest)")
        if kv_bytes is not None and kv_bytes > b.available:
            raise ValueError(
                f"tpu: a KV cache of {format_gib(kv_bytes)} GiB (--kv-cache-memory-bytes) "
                f"cannot fit: {where}. Lower --kv-cache-memory-bytes or raise the quota "
                "(tpuctl quota, or a larger device-plugin allocation).")
        if kv_bytes is None and b.available + b.held < requested:
            raise ValueError(
                f"tpu: gpu_memory_utilization={util} asks for {format_gib(requested)} GiB, "
                f"but {where}. Lower --gpu-memory-utilization, set "
                "--kv-cache-memory-bytes, or raise the quota (tpuctl quota, or a larger "
                "device-plugin allocation).")
        logger.info("tpu:%d budget %s GiB (%s), requested %s GiB", self.local_rank,
                    format_gib(b.budget), "quota" if b.quota else "chip HBM",
                    format_gib(requested))
        return requested

    def _make_model_runner(self):
        from .model_runner import TpudModelRunner

        return TpudModelRunner(self.vllm_config, self.device)

    def compile_or_warm_up_model(self):
        """One dummy step at the largest batch and a sampler run, so that the
        first request finds the model (compiled, when it is) and sampling
        buffers ready. vLLM's GPU warm-up also tunes CUDA kernels and
        captures CUDA graphs; tpu has neither."""
        from vllm.config import CUDAGraphMode
        from vllm.v1.worker.worker_base import CompilationTimes

        runner = self.model_runner
        max_num_reqs = min(self.scheduler_config.max_num_seqs,
                           self.scheduler_config.max_num_batched_tokens)
        hidden_states, last_hidden_states = runner._dummy_run(
            num_tokens=max_num_reqs, skip_eplb=True,
            cudagraph_runtime_mode=CUDAGraphMode.NONE)
        if runner.is_pooling_model:
            runner._dummy_pooler_run(hidden_states)
        else:
            runner._dummy_sampler_run(hidden_states=last_hidden_states)
        torch.accelerator.synchronize()
        set_random_seed(self.model_config.seed, self.parallel_config.data_parallel_index)
        return CompilationTimes(language_model=self.compilation_config.compilation_time,
                                encoder=self.compilation_config.encoder_compilation_time)

    def _maybe_get_memory_pool_context(self, tag: str):
        # tpud's own allocator holds every tensor; there is no sleep-mode pool.
        return contextlib.nullcontext()

    def sleep(self, level: int = 1) -> None:
        logger.warning("tpu: sleep mode is not supported; ignored")

    def wake_up(self, tags=None) -> None:
        logger.warning("tpu: sleep mode is not supported; ignored")
