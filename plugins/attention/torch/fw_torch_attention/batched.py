"""Paged attention for the CPU: a decode step's requests in one batched SDPA call.

The reference backend (:mod:`fw_torch_attention.backend`) loops over the requests of a step and
runs a dozen small ops for each; on a CPU those per-request Python loops and ops are a sizeable
part of a decode step. Here a decode-only step (every request computes one token) gathers every
request's keys and values from the paged cache at once, padded to the longest sequence, and runs
one ``F.scaled_dot_product_attention`` over ``[requests, heads, 1, head_size]`` queries with a
mask for each request's length (and sliding window or attention chunk); grouped-query heads share their KV head
(``enable_gqa``), nothing is repeated. Steps with prefills, soft-capped logits and the MLA layout
take the reference path, as do layers with attention sinks and steps with bidirectional spans. Computed in float32, as the reference.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from framework import kv_quant
from framework.attention_backend import AttentionLayerConfig, AttentionMetadata
from framework.kv_cache import KVCache

from .backend import TorchAttentionBackend, store_cache


class BatchedTorchAttentionBackend(TorchAttentionBackend):
    """The reference backend with decode-only steps batched into one SDPA call."""

    name = "torch_sdpa"

    def forward(
        self,
        layer: AttentionLayerConfig,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor | None,
        kv_cache: KVCache,
        metadata: AttentionMetadata,
        *,
        sinks: torch.Tensor | None = None,
        topk_indices: torch.Tensor | None = None,
    ) -> torch.Tensor:
        num_reqs = metadata.num_reqs
        is_plain = sinks is None and layer.mla is None and not layer.logits_soft_cap
        if not is_plain or not metadata.is_decode_only or metadata.span_ends is not None or query.shape[0] != num_reqs:
            return super().forward(layer, query, key, value, kv_cache, metadata, sinks=sinks, topk_indices=topk_indices)
        heads, kv_heads, head_size = layer.num_heads, layer.num_kv_heads, layer.head_size
        store_cache(
            key.view(num_reqs, kv_heads, head_size),
            value.view(num_reqs, kv_heads, head_size),
            kv_cache,
            metadata.slot_mapping[:num_reqs],
        )
        block_size, longest = kv_cache.block_size, metadata.max_seq_len
        num_blocks = -(-longest // block_size)
        block_ids = metadata.block_table[:num_reqs, :num_blocks]
        if kv_cache.is_quantized:  # [R, blocks, block_size, H_kv, D] each
            cached = torch.stack(kv_quant.gather_dequantized(kv_cache, block_ids))
        else:
            cached = kv_cache.data[:, block_ids]  # [2, R, blocks, block_size, H_kv, D]
        cached = cached.view(2, num_reqs, num_blocks * block_size, kv_heads, head_size)[:, :, :longest].transpose(2, 3)
        keys, values = cached[0].float(), cached[1].float()  # [R, H_kv, L, D]
        positions = torch.arange(longest, device=query.device)
        seq_lens = metadata.seq_lens[:num_reqs, None]
        allowed = positions < seq_lens  # [R, L]: the query sits at position seq_len - 1
        if layer.sliding_window:
            allowed &= positions > seq_lens - 1 - layer.sliding_window
        if layer.attention_chunk_size:  # keys from the start of the query's chunk on
            chunk = layer.attention_chunk_size
            allowed &= positions >= (seq_lens - 1) // chunk * chunk
        q = (
            kv_quant.query_space(kv_cache, query.view(num_reqs, heads, head_size))
            .view(num_reqs, heads, 1, head_size)
            .float()
        )
        out = F.scaled_dot_product_attention(
            q, keys, values, attn_mask=allowed[:, None, None, :], scale=layer.scale, enable_gqa=heads != kv_heads
        )
        out = kv_quant.output_space(kv_cache, out.to(query.dtype).view(num_reqs, heads, head_size))
        return out.reshape(num_reqs, heads * head_size)
