"""vLLM's model runner on a tpu device: vLLM's GPU model runner, with the
device's streams and events from torch.tpu (cuda_names) and no CUDA graphs.
Input preparation, sampling and the KV cache tensors all run in tpud.
"""
import torch

from vllm.v1.worker.gpu_model_runner import GPUModelRunner

from . import cuda_names


class TpudModelRunner(GPUModelRunner):
    def __init__(self, vllm_config, device: torch.device):
        cuda_names.install()
        super().__init__(vllm_config, device)
        self.use_cuda_graph = False

    def _to_list(self, sampled_token_ids: torch.Tensor) -> list[list[int]]:
        # One read back of the sampled ids (the GPU runner stages them
        # through pinned memory and an event; a tpu copy to the host already
        # waits for the ops before it).
        return sampled_token_ids.tolist()
