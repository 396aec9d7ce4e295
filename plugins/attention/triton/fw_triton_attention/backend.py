"""The Triton attention backend: the split-KV decode kernel, or store K/V by slot then prefill.

Standard layers run :mod:`fw_triton_attention.decode` / :mod:`fw_triton_attention.prefill`; MLA
layers (the ``"mla"`` layout) the same two paths over the latent cache in
:mod:`fw_triton_attention.mla_decode` / :mod:`fw_triton_attention.mla_prefill`.

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

from framework import kv_quant
from framework.attention_backend import AttentionBackend, AttentionLayerConfig, AttentionMetadata
from framework.kv_cache import KVCache
from fw_triton_attention.decode import decode_attention
from fw_triton_attention.kv_store import store_kv
from fw_triton_attention.mla_decode import mla_decode, store_latent
from fw_triton_attention.mla_prefill import mla_prefill
from fw_triton_attention.prefill import prefill_attention
from fw_triton_attention.quant_tiles import quant_store

#: Head sizes are padded to a power of two in the kernels; beyond 256 the tiles no longer fit.
MAX_HEAD_SIZE = 256
#: MLA tiles hold the latent (``kv_lora_rank``, padded to a power of two) and the rope part apart.
MAX_MLA_RANK = 512
MAX_MLA_ROPE = 128


class TritonAttentionBackend(AttentionBackend):
    """Paged attention in Triton; the standard NHD cache layout (model dtype or quantized) and the
    ``"mla"`` latent layout (model dtype).

    ``num_sms`` overrides the device's SM count when choosing how many splits a decode uses
    (tests use it to force split-KV on small shapes).
    """

    name = "triton"
    supports_cuda_graphs = True  # no host reads or syncs in forward; grids come from host ints
    supports_sinks = True
    supports_chunked_attention = True
    #: the prefill kernel's per-token key end; a one-token query never sees past itself
    supports_bidirectional_spans = True

    def __init__(self, num_sms: int | None = None) -> None:
        self.num_sms = num_sms

    @classmethod
    def validate(cls, layer_configs: list[AttentionLayerConfig], kv_cache_dtype: str, platform: Any) -> list[str]:
        reasons = cls._mla_reasons([c for c in layer_configs if c.mla is not None], kv_cache_dtype)
        standard = [c for c in layer_configs if c.mla is None]
        for layer in {(c.num_heads, c.num_kv_heads, c.head_size) for c in standard}:
            num_heads, num_kv_heads, head_size = layer
            if head_size > MAX_HEAD_SIZE:
                reasons.append(f"head size {head_size} > {MAX_HEAD_SIZE} unsupported")
            if num_kv_heads < 1 or num_heads % num_kv_heads:
                reasons.append(f"{num_heads} query heads are not a multiple of {num_kv_heads} KV heads")
            if kv_cache_dtype.startswith("turbo") and head_size & (head_size - 1):
                reasons.append(
                    f"kv dtype {kv_cache_dtype} rotates keys by a Walsh-Hadamard transform: head size "
                    f"{head_size} is not a power of two"
                )
            elif kv_cache_dtype != "auto" and head_size % 8:
                reasons.append(f"kv dtype {kv_cache_dtype} packs rows of 8 elements: head size {head_size}")
        return reasons

    @staticmethod
    def _mla_reasons(layers: list[AttentionLayerConfig], kv_cache_dtype: str) -> list[str]:
        """Why the MLA kernels cannot run these MLA layers (empty: they can)."""
        reasons = []
        for mla in {layer.mla for layer in layers}:
            if mla.kv_lora_rank > MAX_MLA_RANK:
                reasons.append(f"MLA kv_lora_rank {mla.kv_lora_rank} > {MAX_MLA_RANK} unsupported")
            if mla.qk_rope_head_dim > MAX_MLA_ROPE:
                reasons.append(f"MLA qk_rope_head_dim {mla.qk_rope_head_dim} > {MAX_MLA_ROPE} unsupported")
        extras = {
            "a sliding window": any(layer.sliding_window for layer in layers),
            "soft-capped logits": any(layer.logits_soft_cap for layer in layers),
            "attention sinks": any(layer.has_sinks for layer in layers),
            "chunked attention": any(layer.attention_chunk_size for layer in layers),
        }
        reasons += [f"MLA layers with {name} unsupported" for name, present in extras.items() if present]
        if layers and kv_cache_dtype != "auto":
            reasons.append(f"kv dtype {kv_cache_dtype}: the MLA latent cache is read in the model dtype only (auto)")
        return reasons

    def initialize(
        self, layers: list[AttentionLayerConfig], dtype: torch.dtype, block_size: int, device: torch.device
    ) -> None:
        standard = [layer for layer in layers if layer.mla is None]
        for head_size in {layer.head_size for layer in standard if not layer.head_size & (layer.head_size - 1)}:
            kv_quant.hadamard(head_size, device)  # built before any CUDA-graph capture

    def forward(
        self,
        layer: AttentionLayerConfig,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: KVCache,
        metadata: AttentionMetadata,
        *,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if layer.mla is not None:
            return self._forward_mla(layer, query, key, kv_cache, metadata)
        num_tokens = query.shape[0]
        query = query.view(num_tokens, layer.num_heads, layer.head_size)
        key = key.view(num_tokens, layer.num_kv_heads, layer.head_size)
        value = value.view(num_tokens, layer.num_kv_heads, layer.head_size)
        common = dict(
            sm_scale=layer.scale,
            sliding_window=layer.sliding_window,
            soft_cap=layer.logits_soft_cap,
            sinks=sinks,
            chunk_size=layer.attention_chunk_size,
        )
        if kv_cache.is_quantized:
            return self._forward_quantized(layer, query, key, value, kv_cache, metadata, common)
        if metadata.is_decode_only or metadata.max_query_len == 1:
            output = decode_attention(
                query,
                kv_cache.data,
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
            store_kv(key, value, kv_cache.data, metadata.slot_mapping)
            output = prefill_attention(
                query,
                kv_cache.data,
                metadata.cu_seqlens_q,
                metadata.seq_lens,
                metadata.block_table,
                num_reqs=metadata.num_reqs,
                max_query_len=metadata.max_query_len,
                span_ends=metadata.span_ends,
                **common,
            )
        return kv_quant.output_space(kv_cache, output).reshape(num_tokens, layer.num_heads * layer.head_size)

    def _forward_mla(
        self,
        layer: AttentionLayerConfig,
        query: torch.Tensor,
        latent: torch.Tensor,
        kv_cache: KVCache,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        """MLA: decode-only steps in the latent decode kernel (which stores the new latents), others
        store the latents then run the latent prefill kernel; ``[T, H * kv_lora_rank]`` out."""
        num_tokens, rank = query.shape[0], layer.mla.kv_lora_rank
        query = query.view(num_tokens, layer.num_heads, layer.head_size)
        latent = latent.view(num_tokens, layer.head_size)
        if metadata.is_decode_only or metadata.max_query_len == 1:
            output = mla_decode(
                query,
                kv_cache.data,
                metadata.seq_lens,
                metadata.block_table,
                rank=rank,
                num_reqs=metadata.num_reqs,
                max_seq_len=metadata.max_seq_len,
                sm_scale=layer.scale,
                num_sms=self.num_sms,
                latent=latent,
                slot_mapping=metadata.slot_mapping,
            )
        else:
            store_latent(latent, kv_cache.data, metadata.slot_mapping)
            output = mla_prefill(
                query,
                kv_cache.data,
                metadata.cu_seqlens_q,
                metadata.seq_lens,
                metadata.block_table,
                rank=rank,
                num_reqs=metadata.num_reqs,
                max_query_len=metadata.max_query_len,
                sm_scale=layer.scale,
            )
        return output.view(num_tokens, layer.num_heads * rank)

    def _forward_quantized(
        self,
        layer: AttentionLayerConfig,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: KVCache,
        metadata: AttentionMetadata,
        common: dict,
    ) -> torch.Tensor:
        """Store the step's K/V as packed rows, then decode or prefill straight from them (turbo dtypes:
        query, keys and values rotated first, scores and outputs taken in the rotated space, the
        output rotated back)."""
        num_tokens, dtype = query.shape[0], query.dtype
        spec, signs = kv_cache.spec, kv_cache.rotation_signs
        # rotated K/V stay float32 up to the quantizer, as kv_quant.quantize_kv has them: rounded
        # to a bf16 model dtype first, 1-2 % of the stored bytes would differ from the reference's
        key = kv_quant.rotate(key, signs) if spec.rotate_keys else key
        value = kv_quant.rotate(value, signs) if spec.rotate_values else value
        quant_store(key, value, kv_cache, metadata.slot_mapping)
        if metadata.is_decode_only or metadata.max_query_len == 1:
            # the rotated query goes in as float32 and the reduce kernel rotates the output back:
            # no torch ops around the kernel but the query's rotation
            query = kv_quant.rotate(query, signs) if spec.rotate_keys else query
            return decode_attention(
                query,
                kv_cache,
                metadata.seq_lens,
                metadata.block_table,
                num_reqs=metadata.num_reqs,
                max_seq_len=metadata.max_seq_len,
                num_sms=self.num_sms,
                out=torch.empty(query.shape, dtype=dtype, device=query.device),
                fp32_math=dtype == torch.float32,
                output_signs=signs if spec.rotate_values else None,
                **common,
            ).view(num_tokens, layer.num_heads * layer.head_size)
        output = prefill_attention(
            kv_quant.query_space(kv_cache, query),
            kv_cache,
            metadata.cu_seqlens_q,
            metadata.seq_lens,
            metadata.block_table,
            num_reqs=metadata.num_reqs,
            max_query_len=metadata.max_query_len,
            span_ends=metadata.span_ends,
            **common,
        )
        return kv_quant.output_space(kv_cache, output).reshape(num_tokens, layer.num_heads * layer.head_size)
