"""Paged attention on tpu from PyTorch ops that tpud runs (vLLM's CUSTOM
attention backend).

The KV cache of a layer is vLLM's paged one: blocks of `block_size` token
slots, each slot holding every KV head's key and value side by side
(`[blocks, heads, slots, 2 * head_size]`, stored slot-major). New keys and
values are written by the slot mapping; attention reads each request's
blocks through its block table row and runs one scaled-dot-product attention
over the whole batch:

- queries are packed into `[requests, longest query]`, keys and values into
  `[requests, longest context]`, gathered from the cache;
- query j of a request whose context before this step holds `c` tokens sees
  keys 0 .. c + j (causal, with the right offset for prefill, chunked
  prefill, prefix-cache hits and decode alike); padding rows see key 0 only
  and are dropped.

The per-step index tensors are built once per step by the metadata builder
(on the host, then copied) and shared by every layer.
"""
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F

from vllm.forward_context import get_forward_context
from vllm.v1.attention.backend import (
    AttentionBackend,
    AttentionImpl,
    AttentionMetadataBuilder,
    AttentionType,
    CommonAttentionMetadata,
    MultipleOf,
)
from vllm.v1.kv_cache_interface import AttentionSpec, KVCacheLayout


class TpudAttentionBackend(AttentionBackend):
    forward_includes_kv_cache_update: bool = False
    supported_dtypes: ClassVar[list[torch.dtype]] = [
        torch.float16, torch.bfloat16, torch.float32]
    supported_kv_cache_dtypes: ClassVar[list[str]] = ["auto", "float16", "bfloat16"]

    @staticmethod
    def get_supported_kernel_block_sizes(kv_cache_spec=None):
        return [MultipleOf(1)]

    @staticmethod
    def get_name() -> str:
        return "CUSTOM"

    @staticmethod
    def get_impl_cls():
        return TpudAttentionImpl

    @staticmethod
    def get_builder_cls():
        return TpudAttentionMetadataBuilder

    @classmethod
    def supported_kv_cache_layouts(cls):
        return (KVCacheLayout.LBNHC,)

    @classmethod
    def supports_attn_type(cls, attn_type: str) -> bool:
        return attn_type == AttentionType.DECODER

    @classmethod
    def supports_non_causal(cls) -> bool:
        return False

    @classmethod
    def supports_sliding_window(cls) -> bool:
        return False


@dataclass
class TpudAttentionMetadata:
    num_reqs: int
    num_tokens: int  # the batch's real tokens (query_start_loc[num_reqs])
    max_query_len: int
    decode_only: bool  # one new token per request: no query packing
    token_dst: torch.Tensor  # [num_tokens] int64: row of each token in the packed queries
    # [num_reqs, 1, max_query_len, blocks * block_size] bool, `blocks` those
    # that cover the longest context
    mask: torch.Tensor
    block_table: torch.Tensor  # [num_reqs, blocks]
    slot_block: torch.Tensor  # [num_tokens]: the cache block of each new token
    slot_offset: torch.Tensor  # [num_tokens]: its slot in the block
    # vLLM's own fields, which other parts of vLLM read.
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    slot_mapping: torch.Tensor
    num_actual_tokens: int
    max_seq_len: int


class TpudAttentionMetadataBuilder(AttentionMetadataBuilder[TpudAttentionMetadata]):
    def __init__(self, kv_cache_spec: AttentionSpec, layer_names, vllm_config, device):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self.block_size = kv_cache_spec.block_size

    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata,
              fast_build: bool = False) -> TpudAttentionMetadata:
        m = common_attn_metadata
        if isinstance(m.causal, torch.Tensor) or not m.causal:
            raise NotImplementedError("tpu attention: only causal decoder attention")
        num_reqs = m.num_reqs
        dev = m.query_start_loc.device
        # The step's index tensors are made on the host, from vLLM's host
        # copies of the query starts and sequence lengths, and go to the
        # device in two copies (a few dozen ops less each step).
        qsl = m.query_start_loc_cpu[:num_reqs + 1].to(torch.int64)
        # The host copy is exact without speculative decoding, which the
        # platform refuses.
        if m.seq_lens_cpu_upper_bound is not None:
            seq_lens = m.seq_lens_cpu_upper_bound[:num_reqs].to(torch.int64)
        else:
            seq_lens = m.seq_lens[:num_reqs].to("cpu", torch.int64)
        num_tokens = int(qsl[num_reqs])
        q_lens = qsl[1:] - qsl[:-1]
        max_q = max(int(q_lens.max()) if num_reqs else 1, 1)
        num_blocks = max(-(-int(seq_lens.max() if num_reqs else 1) // self.block_size), 1)
        span = num_blocks * self.block_size

        req = torch.repeat_interleave(torch.arange(num_reqs), q_lens)
        token_dst = req * max_q + (torch.arange(num_tokens) - qsl[:-1][req])
        j = torch.arange(max_q).view(1, max_q, 1)
        s = torch.arange(span).view(1, 1, span)
        context = (seq_lens - q_lens).view(num_reqs, 1, 1)
        real = j < q_lens.view(num_reqs, 1, 1)
        mask = ((s <= context + j) & real) | (~real & (s == 0))

        slots = m.slot_mapping[:num_tokens].to(torch.int64)
        return TpudAttentionMetadata(
            num_reqs=num_reqs, num_tokens=num_tokens, max_query_len=max_q,
            decode_only=max_q == 1 and num_tokens == num_reqs, token_dst=token_dst.to(dev),
            mask=mask.unsqueeze(1).to(dev),
            block_table=m.block_table_tensor[:num_reqs, :num_blocks].to(torch.int64),
            slot_block=torch.div(slots, self.block_size, rounding_mode="floor"),
            slot_offset=torch.remainder(slots, self.block_size),
            query_start_loc=m.query_start_loc, seq_lens=m.seq_lens,
            slot_mapping=m.slot_mapping, num_actual_tokens=m.num_actual_tokens,
            max_seq_len=m.max_seq_len)


def _layer_metadata(layer) -> TpudAttentionMetadata | None:
    md = get_forward_context().attn_metadata
    if isinstance(md, dict):
        md = md.get(layer.layer_name)
    return md


class TpudAttentionImpl(AttentionImpl):
    def __init__(self, num_heads: int, head_size: int, scale: float, num_kv_heads: int,
                 alibi_slopes, sliding_window, kv_cache_dtype: str,
                 logits_soft_cap=None, attn_type: str = AttentionType.DECODER,
                 kv_sharing_target_layer_name=None, sinks=None) -> None:
        unsupported = [name for name, v in (
            ("ALiBi", alibi_slopes), ("a sliding window", sliding_window),
            ("a logits soft cap", logits_soft_cap or None), ("attention sinks", sinks))
            if v is not None]
        if unsupported or attn_type != AttentionType.DECODER:
            raise NotImplementedError(
                "tpu attention supports causal decoder attention without "
                f"{', '.join(unsupported) or attn_type}")
        self.num_heads = num_heads
        self.head_size = head_size
        self.scale = float(scale)
        self.num_kv_heads = num_kv_heads
        self.kv_cache_dtype = kv_cache_dtype
        self.kv_sharing_target_layer_name = kv_sharing_target_layer_name
        self.attn_type = attn_type

    def do_kv_cache_update(self, layer, key: torch.Tensor, value: torch.Tensor,
                           kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        md = _layer_metadata(layer)
        if md is None or md.num_tokens == 0:
            return
        n = md.num_tokens
        kv = torch.cat((key[:n], value[:n]), dim=-1)
        if kv.dtype != kv_cache.dtype:
            kv = kv.to(kv_cache.dtype)
        # kv_cache[block, :, slot in block] = [heads, 2 * head_size]
        kv_cache[md.slot_block, :, md.slot_offset] = kv

    def forward(self, layer, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                kv_cache: torch.Tensor, attn_metadata: TpudAttentionMetadata | None,
                output: torch.Tensor, output_scale=None, output_block_scale=None
                ) -> torch.Tensor:
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError("tpu attention: fused output quantization")
        if attn_metadata is None:  # profiling run
            return output
        md = attn_metadata
        n, r, lq = md.num_tokens, md.num_reqs, md.max_query_len
        h, d, hkv = self.num_heads, self.head_size, self.num_kv_heads

        q = query[:n].view(n, h, d)
        if md.decode_only:  # one query per request, in request order
            packed = q.view(r, 1, h, d).transpose(1, 2)
        else:
            packed = q.new_zeros(r * lq, h, d).index_copy_(0, md.token_dst, q)
            packed = packed.view(r, lq, h, d).transpose(1, 2)

        # [reqs, blocks, heads, slots, 2d] -> [reqs, heads, blocks * slots, 2d]
        kv = kv_cache[md.block_table].permute(0, 2, 1, 3, 4).reshape(r, hkv, -1, 2 * d)
        k, v = kv[..., :d], kv[..., d:]
        if k.dtype != q.dtype:
            k, v = k.to(q.dtype), v.to(q.dtype)
        out = F.scaled_dot_product_attention(packed, k, v, attn_mask=md.mask, scale=self.scale,
                                             enable_gqa=hkv != h)
        out = out.transpose(1, 2).reshape(r * lq, h, d)
        if not md.decode_only:
            out = out.index_select(0, md.token_dst)
        output[:n].copy_(out.reshape(output[:n].shape))
        return output
