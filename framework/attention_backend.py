"""The attention-backend contract and the per-step metadata every backend reads.

The model runner builds one :class:`AttentionMetadata` per step (FlashAttention / FlashInfer
names) and publishes it through the forward context; each ``Attention`` layer calls its
backend's :meth:`AttentionBackend.forward` with its own q/k/v and its slice of the KV cache.

Token layout of a step (``T`` tokens of ``R`` requests, each request's new tokens contiguous)::

    query tokens  [ r0: q q q q | r1: q | r2: q q ]      cu_seqlens_q = [0, 4, 5, 7]
    context       r0 had 8 cached tokens, r1 had 20, r2 had 0
    seq_lens      [12, 21, 2]   (cached + new)

KV cache of one layer (standard layout, NHD): ``[2, num_blocks, block_size, num_kv_heads,
head_size]`` — index 0 keys, 1 values. Token ``i`` of a request lives in block
``block_table[r, i // block_size]`` at offset ``i % block_size``; ``slot_mapping`` gives each
new token's flat slot ``block * block_size + offset``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(slots=True)
class AttentionMetadata:
    """Per-step inputs shared by every attention layer (device tensors unless ``_cpu``)."""

    num_reqs: int
    num_tokens: int
    cu_seqlens_q: torch.Tensor  # [R + 1] int32
    seq_lens: torch.Tensor  # [R] int32: context + new tokens
    block_table: torch.Tensor  # [R, max_blocks] int32
    slot_mapping: torch.Tensor  # [T] int64
    max_query_len: int
    max_seq_len: int
    cu_seqlens_q_cpu: torch.Tensor  # the same on the host, for backends that loop on the CPU
    seq_lens_cpu: torch.Tensor
    is_decode_only: bool = False  # every request computes exactly one token
    block_table_cpu: torch.Tensor | None = None  # the block table on the host, for backends that plan there
    #: set when the step captures or replays the decode CUDA graph of this many (padded) rows
    graph_batch_size: int | None = None


@dataclass(frozen=True, slots=True)
class AttentionLayerConfig:
    """The per-layer constants a backend needs."""

    num_heads: int
    num_kv_heads: int
    head_size: int
    scale: float
    sliding_window: int | None = None  # attend to at most this many most recent keys (incl. self)
    logits_soft_cap: float | None = None  # tanh soft-capping of attention scores (Gemma 2)


class AttentionBackend(ABC):
    """One attention implementation; the engine creates one instance per model.

    ``kv_cache_shape`` fixes the per-layer cache layout it reads; ``validate`` returns the
    reasons it cannot serve a model (empty list = it can); ``forward`` stores the step's new K/V
    by ``slot_mapping`` and attends over the paged cache.
    """

    name: str = ""
    #: True if ``forward`` reads no host tensors and never syncs, so decode steps can be graphed.
    supports_cuda_graphs: bool = False

    @staticmethod
    def kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int, head_size: int) -> tuple[int, ...]:
        """Shape of one layer's KV cache (default: NHD, keys then values)."""
        return (2, num_blocks, block_size, num_kv_heads, head_size)

    @classmethod
    def validate(cls, layer_configs: list[AttentionLayerConfig], kv_cache_dtype: str, platform: Any) -> list[str]:
        """Reasons this backend cannot run these layers on ``platform``; empty if it can."""
        return []

    def initialize(self, layers: list[AttentionLayerConfig], dtype: torch.dtype, block_size: int,  # noqa: B027
                   device: torch.device) -> None:
        """Called once after selection with the model's attention layers, before any step."""

    def prepare(self, metadata: AttentionMetadata) -> None:  # noqa: B027 - optional hook
        """Called once per step before the forward pass, always outside CUDA-graph capture: a
        decode step replaying a graph is prepared with the graph's padded rows
        (``metadata.graph_batch_size``), so a backend can plan into its static buffers here."""

    @abstractmethod
    def forward(self, layer: AttentionLayerConfig, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                kv_cache: torch.Tensor, metadata: AttentionMetadata) -> torch.Tensor:
        """Attention for the step's tokens.

        ``query`` is ``[T, num_heads * head_size]``, ``key``/``value`` ``[T, num_kv_heads *
        head_size]``; returns ``[T, num_heads * head_size]``. Stores ``key``/``value`` into
        ``kv_cache`` at ``metadata.slot_mapping`` first; token ``j`` of request ``r`` (absolute
        position ``p = seq_len - query_len + j``) attends to positions ``<= p`` of its own
        sequence (and ``> p - sliding_window`` when set).
        """
