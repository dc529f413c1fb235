"""Plain PyTorch forms of the Triton kernels vLLM's model runner launches,
run on tpu tensors (vLLM's `register_triton_kernel_overrides` puts them in
the kernels' place).
"""
import torch


def compute_slot_mapping(num_tokens, max_num_tokens, query_start_loc, positions,
                         block_table, block_table_stride, slot_mapping,
                         KV_CACHE_BLOCK_SIZE, TOTAL_CP_WORLD_SIZE=1, TOTAL_CP_RANK=0,
                         CP_KV_CACHE_INTERLEAVE_SIZE=1, PAD_ID=-1, BLOCK_SIZE=1024):
    """slot_mapping[t] = block_table[req(t), pos(t) // bs] * bs + pos(t) % bs
    for the batch's tokens, PAD_ID after them up to max_num_tokens."""
    if TOTAL_CP_WORLD_SIZE != 1:
        raise NotImplementedError("tpu: context parallelism is not supported")
    if num_tokens > 0:
        pos = positions[:num_tokens]
        token = torch.arange(num_tokens, device=pos.device, dtype=torch.int32)
        # The request of each token: how many request ends lie at or before it.
        req = torch.searchsorted(query_start_loc[1:].contiguous(), token, right=True)
        rows = block_table.view(-1, block_table_stride)
        blocks = rows[req, torch.div(pos, KV_CACHE_BLOCK_SIZE, rounding_mode="floor")]
        slot_mapping[:num_tokens] = (blocks.to(torch.int64) * KV_CACHE_BLOCK_SIZE
                                     + torch.remainder(pos, KV_CACHE_BLOCK_SIZE))
    if max_num_tokens > num_tokens:
        slot_mapping[num_tokens:max_num_tokens].fill_(PAD_ID)


OVERRIDES = {
    "vllm.v1.worker.block_table.ComputeSlotMappingKernel.kernel": compute_slot_mapping,
}
