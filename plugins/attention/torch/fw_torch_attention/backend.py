"""Reference paged attention in plain torch: exact, device-agnostic, slow.

It loops over the requests of a step on the host and gathers each sequence's keys and values
from the paged cache, so it is easy to check by eye. It is the oracle every faster backend is
tested against.
"""

from __future__ import annotations

import torch

from framework import kv_quant
from framework.attention_backend import AttentionBackend, AttentionLayerConfig, AttentionMetadata
from framework.kv_cache import KVCache


def store_kv(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Write the step's keys/values ``[T, H_kv, D]`` into their flat slots of the cache."""
    _, num_blocks, block_size, num_kv_heads, head_size = kv_cache.shape
    flat = kv_cache.view(2, num_blocks * block_size, num_kv_heads, head_size)
    flat[0, slot_mapping] = key.to(kv_cache.dtype)
    flat[1, slot_mapping] = value.to(kv_cache.dtype)


def store_cache(key: torch.Tensor, value: torch.Tensor, kv_cache: KVCache, slot_mapping: torch.Tensor) -> None:
    """:func:`store_kv` for a model-dtype cache, else quantize (and rotate) as the KV dtype says."""
    if kv_cache.is_quantized:
        kv_quant.store_quantized(kv_cache, key, value, slot_mapping)
    else:
        store_kv(key, value, kv_cache.data, slot_mapping)


def gather_kv(kv_cache: KVCache, block_ids: torch.Tensor, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence's first ``seq_len`` keys and values, each ``[seq_len, H_kv, D]`` (a quantized
    cache's dequantized in float32, in the rotated space of a turbo dtype)."""
    if kv_cache.is_quantized:
        keys, values = kv_quant.gather_dequantized(kv_cache, block_ids)  # [n, block_size, H, D]
        return keys.flatten(0, 1)[:seq_len], values.flatten(0, 1)[:seq_len]
    blocks = kv_cache.data[:, block_ids]  # [2, n, block_size, H, D]
    flat = blocks.reshape(2, -1, *kv_cache.data.shape[3:])
    return flat[0, :seq_len], flat[1, :seq_len]


def attend(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    layer: AttentionLayerConfig,
    query_start: int,
    sinks: torch.Tensor | None = None,
    selected: torch.Tensor | None = None,
    key_ends: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of queries at absolute positions ``query_start..`` over keys ``0..``.

    ``query`` ``[q, H, D]``, ``key`` ``[k, H_kv, D]``, ``value`` ``[k, H_kv, D_v]`` (``D_v`` may differ
    from ``D``, as in MLA); computed in float32. ``sinks`` ``[H]``: one extra logit per head in the
    softmax, dropped after it. ``selected`` ``[q, k]`` bool (sparse MLA): a query attends only to
    its selected keys (within the causal rule). ``key_ends`` ``[q]`` (bidirectional spans): each
    query attends to keys before its end instead of up to its own position.
    """
    group = layer.num_heads // layer.num_kv_heads
    q = query.float().transpose(0, 1)  # [H, q, D]
    k = key.float().repeat_interleave(group, dim=1).transpose(0, 1)  # [H, k, D]
    v = value.float().repeat_interleave(group, dim=1).transpose(0, 1)
    scores = (q @ k.transpose(1, 2)) * layer.scale  # [H, q, k]
    if layer.logits_soft_cap:
        scores = torch.tanh(scores / layer.logits_soft_cap) * layer.logits_soft_cap
    q_pos = torch.arange(query_start, query_start + q.shape[1], device=q.device)[:, None]
    k_pos = torch.arange(k.shape[1], device=q.device)[None, :]
    allowed = k_pos <= q_pos if key_ends is None else k_pos < key_ends.to(q.device)[:, None]
    if layer.sliding_window:
        allowed &= k_pos > q_pos - layer.sliding_window
    if layer.attention_chunk_size:  # chunked local attention: keys of the query's own chunk only
        allowed &= k_pos // layer.attention_chunk_size == q_pos // layer.attention_chunk_size
    if selected is not None:
        allowed = allowed & selected
    scores = scores.masked_fill(~allowed, float("-inf"))
    if sinks is not None:
        sink_column = sinks.float()[:, None, None].expand(-1, scores.shape[1], 1)
        out = torch.softmax(torch.cat([scores, sink_column], dim=-1), dim=-1)[..., :-1] @ v
    else:
        out = torch.softmax(scores, dim=-1) @ v  # [H, q, D]
    return out.transpose(0, 1)


def store_latent(latent: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Write the step's MLA latents ``[T, L + R]`` into the head of their flat slots' rows of an
    ``"mla"`` cache (a sparse layer's rows are wider; their tail is the indexer's)."""
    num_blocks, block_size, row_size = kv_cache.shape
    rows = kv_cache.view(num_blocks * block_size, row_size)
    rows[slot_mapping, : latent.shape[-1]] = latent.to(kv_cache.dtype)


def gather_latent(kv_cache: torch.Tensor, block_ids: torch.Tensor, seq_len: int, latent_size: int) -> torch.Tensor:
    """One sequence's first ``seq_len`` cached latents, ``[seq_len, latent_size]`` (the rows' heads)."""
    return kv_cache[block_ids].reshape(-1, kv_cache.shape[-1])[:seq_len, :latent_size]


def selected_mask(topk_indices: torch.Tensor, seq_len: int) -> torch.Tensor:
    """``[q, K]`` positions (``-1`` pads) -> ``[q, seq_len]`` bool, True at the chosen positions."""
    valid = (topk_indices >= 0) & (topk_indices < seq_len)
    mask = torch.zeros(topk_indices.shape[0], seq_len + 1, dtype=torch.bool, device=topk_indices.device)
    mask.scatter_(1, torch.where(valid, topk_indices.long(), seq_len), True)  # pads land in the extra column
    return mask[:, :seq_len]


class TorchAttentionBackend(AttentionBackend):
    """Stores K/V by slot mapping, then per request: gather its cache, causal softmax attention.

    Reads both KV layouts: ``"standard"`` and ``"mla"`` (multi-query attention over the cached
    latents, whose first ``kv_lora_rank`` features are also the values), and every KV dtype of
    :mod:`framework.kv_quant` (dequantized per request; scores and values in the rotated space for turbo);
    standard layers may have attention sinks and chunked local attention (Llama 4); sparse MLA
    layers (DeepSeek-V3.2, GLM-5) attend to their ``topk_indices`` only; a step's bidirectional
    spans (``metadata.span_ends``) widen each query's keys to its span's end.
    """

    name = "torch"
    supports_sinks = True
    supports_chunked_attention = True
    supports_sparse_mla = True
    supports_bidirectional_spans = True

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
        if layer.mla is not None:
            return self._forward_mla(layer, query, key, kv_cache.data, metadata, topk_indices)
        num_tokens = query.shape[0]
        query = query.view(num_tokens, layer.num_heads, layer.head_size)
        key = key.view(num_tokens, layer.num_kv_heads, layer.head_size)
        value = value.view(num_tokens, layer.num_kv_heads, layer.head_size)
        store_cache(key, value, kv_cache, metadata.slot_mapping[:num_tokens])
        output = torch.empty_like(query)
        rotated = kv_quant.query_space(kv_cache, query)
        starts = metadata.cu_seqlens_q_cpu.tolist()
        seq_lens = metadata.seq_lens_cpu.tolist()
        block_size = kv_cache.block_size
        for r in range(metadata.num_reqs):
            start, end, seq_len = starts[r], starts[r + 1], seq_lens[r]
            num_blocks = -(-seq_len // block_size)
            keys, values = gather_kv(kv_cache, metadata.block_table[r, :num_blocks], seq_len)
            query_start = seq_len - (end - start)
            key_ends = None if metadata.span_ends is None else metadata.span_ends[start:end]
            out = attend(rotated[start:end], keys, values, layer, query_start, sinks, key_ends=key_ends)
            output[start:end] = out.to(query.dtype)
        return kv_quant.output_space(kv_cache, output).view(num_tokens, layer.num_heads * layer.head_size)

    @staticmethod
    def _forward_mla(
        layer: AttentionLayerConfig,
        query: torch.Tensor,
        latent: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
        topk_indices: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """MLA: store the step's latents, then per request attend over its cached latents (one KV
        head); with ``topk_indices`` (sparse MLA) each query only over its selected tokens."""
        num_tokens, rank = query.shape[0], layer.mla.kv_lora_rank
        query = query.view(num_tokens, layer.num_heads, layer.head_size)
        store_latent(latent.view(num_tokens, layer.head_size), kv_cache, metadata.slot_mapping[:num_tokens])
        output = query.new_empty(num_tokens, layer.num_heads, rank)
        starts = metadata.cu_seqlens_q_cpu.tolist()
        seq_lens = metadata.seq_lens_cpu.tolist()
        block_size = kv_cache.shape[1]
        for r in range(metadata.num_reqs):
            start, end, seq_len = starts[r], starts[r + 1], seq_lens[r]
            block_ids = metadata.block_table[r, : -(-seq_len // block_size)]
            cached = gather_latent(kv_cache, block_ids, seq_len, layer.head_size)[:, None]
            selected = None if topk_indices is None else selected_mask(topk_indices[start:end], seq_len)
            out = attend(query[start:end], cached, cached[..., :rank], layer, seq_len - (end - start), None, selected)
            output[start:end] = out.to(query.dtype)
        return output.view(num_tokens, layer.num_heads * rank)
