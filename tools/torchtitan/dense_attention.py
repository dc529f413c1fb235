"""TorchTitan override: FlexAttention evaluated densely with SDPA (runs on any device).

TorchTitan 0.3.0's llama3 models only offer flex (no backward on CPU, and flex refuses other
devices) or varlen (CUDA flash attention). This keeps flex's BlockMask (same causal +
packed-document mask_mod) but expands it to a dense boolean mask and calls
F.scaled_dot_product_attention, so cpu and tpu run the same math.
Activate with: --override.imports dense_attention.dense_flex_attention (PYTHONPATH=this dir).
"""
from dataclasses import dataclass

import spmd_types as spmd
import torch
import torch.nn.functional as F
from spmd_types.runtime import get_partition_spec
from torch.nn.attention.flex_attention import BlockMask

from torchtitan.config.override import derive, override
from torchtitan.distributed.utils import get_spmd_backend
from torchtitan.models.common.attention import FlexAttention


class DenseFlexAttention(FlexAttention):
    @dataclass(kw_only=True, slots=True)
    class Config(FlexAttention.Config):
        pass

    def forward(self, q_BLNH, k_BLNH, v_BLNH, *, attention_masks: BlockMask,
                score_mod=None, scale=None, enable_gqa=False, out_transform=None, **kwargs):
        assert score_mod is None and out_transform is None
        q, k, v = (t.transpose(1, 2) for t in (q_BLNH, k_BLNH, v_BLNH))  # B, N, L, H
        with spmd.no_typecheck():
            B, L, S = q.shape[0], q.shape[2], k.shape[2]
            dev = q.device
            b = torch.arange(B, device=dev).view(B, 1, 1, 1)
            h = torch.zeros(1, 1, 1, 1, dtype=torch.long, device=dev)
            qi = torch.arange(L, device=dev).view(1, 1, L, 1)
            ki = torch.arange(S, device=dev).view(1, 1, 1, S)
            mask = attention_masks.mask_mod(b, h, qi, ki).expand(B, 1, L, S)
            out = F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, scale=scale, enable_gqa=enable_gqa)
        if get_spmd_backend() == "spmd_types" and spmd.is_type_checking():
            spmd.assert_type(out, spmd.get_local_type(q), get_partition_spec(q))
        return out.transpose(1, 2)


@override(target=FlexAttention.Config, description="flex mask evaluated densely with SDPA")
def dense_flex_attention(cfg: FlexAttention.Config) -> DenseFlexAttention.Config:
    return derive(cfg, DenseFlexAttention.Config)
