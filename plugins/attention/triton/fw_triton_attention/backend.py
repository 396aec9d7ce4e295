"""The Triton attention backend: the split-KV decode kernel, or store K/V by slot then prefill.

Decode-only steps (every request computes one token, token row ``r`` = request ``r``) go to the
split-KV decode kernel, which also stores the step's new K/V (one launch per layer instead of
two); every other step, decode rows of mixed batches included, stores K/V with ``store_kv`` and
then runs the prefill kernel. Grids are sized
from the metadata's host ints (``num_reqs``, ``max_query_len``, ``max_seq_len``): ``forward``
never reads a device tensor on the host.
"""

from __future__ import annotations

from typing import Any

import torch

from framework.attention_backend import AttentionBackend, AttentionLayerConfig, AttentionMetadata
from fw_triton_attention.decode import decode_attention
from fw_triton_attention.kv_store import store_kv
from fw_triton_attention.prefill import prefill_attention

#: Head sizes are padded to a power of two in the kernels; beyond 256 the tiles no longer fit.
MAX_HEAD_SIZE = 256


class TritonAttentionBackend(AttentionBackend):
    """Paged attention in Triton; standard NHD cache layout, cache dtype = model dtype.

    ``num_sms`` overrides the device's SM count when choosing how many splits a decode uses
    (tests use it to force split-KV on small shapes).
    """

    name = "triton"
    supports_cuda_graphs = True  # no host reads or syncs in forward; grids come from host ints
    supports_sinks = True

    def __init__(self, num_sms: int | None = None) -> None:
        self.num_sms = num_sms

    @classmethod
    def validate(cls, layer_configs: list[AttentionLayerConfig], kv_cache_dtype: str, platform: Any) -> list[str]:
        reasons: list[str] = []
        if kv_cache_dtype != "auto":
            reasons.append(f"kv dtype {kv_cache_dtype} unsupported (only 'auto')")
        for layer in {(c.num_heads, c.num_kv_heads, c.head_size) for c in layer_configs}:
            num_heads, num_kv_heads, head_size = layer
            if head_size > MAX_HEAD_SIZE:
                reasons.append(f"head size {head_size} > {MAX_HEAD_SIZE} unsupported")
            if num_kv_heads < 1 or num_heads % num_kv_heads:
                reasons.append(f"{num_heads} query heads are not a multiple of {num_kv_heads} KV heads")
        return reasons

    def forward(
        self,
        layer: AttentionLayerConfig,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
        *,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        num_tokens = query.shape[0]
        query = query.view(num_tokens, layer.num_heads, layer.head_size)
        key = key.view(num_tokens, layer.num_kv_heads, layer.head_size)
        value = value.view(num_tokens, layer.num_kv_heads, layer.head_size)
        common = dict(
            sm_scale=layer.scale, sliding_window=layer.sliding_window, soft_cap=layer.logits_soft_cap, sinks=sinks
        )
        if metadata.is_decode_only or metadata.max_query_len == 1:
            output = decode_attention(
                query,
                kv_cache,
                metadata.seq_lens,
                metadata.block_table,
                num_reqs=metadata.num_reqs,
                max_seq_len=metadata.max_seq_len,
                num_sms=self.num_sms,
                key=key,
                value=value,
                slot_mapping=metadata.slot_mapping,
                **common,
            )
        else:
            store_kv(key, value, kv_cache, metadata.slot_mapping)
            output = prefill_attention(
                query,
                kv_cache,
                metadata.cu_seqlens_q,
                metadata.seq_lens,
                metadata.block_table,
                num_reqs=metadata.num_reqs,
                max_query_len=metadata.max_query_len,
                **common,
            )
        return output.view(num_tokens, layer.num_heads * layer.head_size)
