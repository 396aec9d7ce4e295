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

KV cache of one layer (``"mla"`` layout, multi-head latent attention, DeepSeek-V2):
``[num_blocks, block_size, kv_lora_rank + qk_rope_head_dim]`` — per token one vector shared by
all heads: the compressed latent ``c_kv`` (after ``kv_a_layernorm``) followed by the roped
``k_pe``. The model absorbs ``W_UK`` into its queries and ``W_UV`` into its output, so the
backend computes multi-query attention over the latent (see :meth:`AttentionBackend.forward`).

DeepSeek Sparse Attention (DeepSeek-V3.2, GLM-5; ``MLAConfig.is_sparse``): the row is widened to ``L + R + index_head_dim``; its tail holds the lightning indexer's key of the token,
written and read by the model's indexer (which picks each query's top-k tokens), never by the
attention itself. The backend stores and reads only the head ``[c_kv, k_pe]`` and attends to the
``topk_indices`` the layer passes (only backends with ``supports_sparse_mla`` are chosen)::

    row of one token   [ c_kv (L) | k_pe (R) | indexer key (index_head_dim) ]
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from framework.kv_cache import KVCache, KVCacheSpec, model_cache_spec, quantized_cache_spec

if TYPE_CHECKING:
    from framework.ops_linear_attention import StateIndices
    from framework.specs import KVCacheDtypeSpec


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
    #: hybrid models: where each request keeps its linear-attention state (:mod:`framework.engine.state_cache`)
    state_indices: StateIndices | None = None
    #: ``[T]`` int32, set when the step computes tokens of a bidirectional span (Gemma 3's image
    #: tokens): one past the last position each query token may attend to, its own position + 1
    #: for a causal token, the end of its span for a token inside one (see ``AttentionBackend.forward``)
    span_ends: torch.Tensor | None = None

    def linear_attention_indices(self) -> StateIndices:
        """:attr:`state_indices`; a ValueError if the step has none (the engine sets them for models
        with linear-attention layers)."""
        if self.state_indices is None:
            raise ValueError(
                "a linear-attention layer ran in a step without state slots (AttentionMetadata.state_indices)"
            )
        return self.state_indices

    def host_block_table(self) -> torch.Tensor:
        """``block_table_cpu``, which the model runner always fills; a ValueError if it is missing
        (copying ``block_table`` back would wait for the device inside a step)."""
        if self.block_table_cpu is None:
            raise ValueError(
                "AttentionMetadata.block_table_cpu is required by backends that plan on the host "
                "(the model runner fills it; build test metadata with framework.testing helpers)"
            )
        return self.block_table_cpu


@dataclass(frozen=True, slots=True)
class MLAConfig:
    """The latent sizes of a multi-head-latent-attention layer (``"mla"`` KV layout).

    A cached token is ``kv_lora_rank + qk_rope_head_dim`` numbers: the latent ``c_kv`` then the
    roped ``k_pe``. Values are the latent part, so outputs are ``kv_lora_rank`` wide per head.
    """

    kv_lora_rank: int
    qk_rope_head_dim: int
    #: DeepSeek Sparse Attention: the layer attends only to the top-k tokens it is given
    is_sparse: bool = False
    #: the width of the lightning indexer's key kept after the latent in each cached row (0: none;
    #: a GLM-5 "shared" layer is sparse but reuses an earlier layer's choice, so keeps no key)
    index_head_dim: int = 0

    def __post_init__(self) -> None:
        if self.index_head_dim and not self.is_sparse:
            raise ValueError("an MLA layer that caches an indexer key (index_head_dim) must be sparse")

    @property
    def latent_size(self) -> int:
        """Elements of the latent a query attends over: ``kv_lora_rank + qk_rope_head_dim``."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def row_size(self) -> int:
        """Elements per cached token: the latent, then the indexer key of a sparse layer."""
        return self.latent_size + self.index_head_dim


@dataclass(frozen=True, slots=True)
class AttentionLayerConfig:
    """The per-layer constants a backend needs.

    For an MLA layer (``mla`` set) ``num_kv_heads`` is 1 and ``head_size`` is the latent size
    ``kv_lora_rank + qk_rope_head_dim`` (the absorbed query's width per head).
    """

    num_heads: int
    num_kv_heads: int
    head_size: int
    scale: float
    sliding_window: int | None = None  # attend to at most this many most recent keys (incl. self)
    logits_soft_cap: float | None = None  # tanh soft-capping of attention scores (Gemma 2)
    mla: MLAConfig | None = None  # multi-head latent attention: the "mla" KV layout
    #: per-head attention sinks (gpt-oss): ``forward`` gets ``sinks [num_heads]``, one extra logit
    #: per head that joins the softmax's denominator and contributes no value
    has_sinks: bool = False
    #: chunked local attention (Llama 4): a query attends only to keys of its own chunk of this
    #: many positions, ``k // chunk == q // chunk`` (besides ``k <= q``)
    attention_chunk_size: int | None = None
    #: the layer's steps may carry bidirectional spans (``AttentionMetadata.span_ends``: Gemma 3's
    #: image tokens see every token of their image); only backends with ``supports_bidirectional_spans``
    has_bidirectional_spans: bool = False

    @property
    def kv_cache_layout(self) -> str:
        """``"mla"`` for latent attention, else ``"standard"``."""
        return "standard" if self.mla is None else "mla"

    @property
    def kv_elements_per_token(self) -> int:
        """Cache elements one token takes in this layer: ``2 * H_kv * D`` standard, the row size for MLA."""
        return 2 * self.num_kv_heads * self.head_size if self.mla is None else self.mla.row_size

    @property
    def output_size(self) -> int:
        """Width of the backend's output per token: ``H * D``, or ``H * kv_lora_rank`` for MLA."""
        return self.num_heads * (self.head_size if self.mla is None else self.mla.kv_lora_rank)


class AttentionBackend(ABC):
    """One attention implementation; the engine creates one instance per model.

    ``kv_cache_shape`` fixes the per-layer cache layout it reads (``kv_cache_spec`` the whole
    cache, per KV dtype); ``validate`` returns the
    reasons it cannot serve a model (empty list = it can); ``forward`` stores the step's new K/V
    by ``slot_mapping`` and attends over the paged cache.
    """

    name: str = ""
    #: True if ``forward`` reads no host tensors and never syncs, so decode steps can be graphed.
    supports_cuda_graphs: bool = False
    #: True if ``forward`` takes ``sinks`` (layers with ``has_sinks``); others are refused for them.
    supports_sinks: bool = False
    #: True if ``forward`` honours ``attention_chunk_size`` (layers with it are refused otherwise).
    supports_chunked_attention: bool = False
    #: True if ``forward`` takes ``topk_indices`` for sparse MLA layers (``MLAConfig.is_sparse``,
    #: the cache row widened by ``index_head_dim``); others are refused for them.
    supports_sparse_mla: bool = False
    #: True if ``forward`` honours ``metadata.span_ends`` (layers with ``has_bidirectional_spans``
    #: are refused otherwise).
    supports_bidirectional_spans: bool = False

    @staticmethod
    def kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int, head_size: int) -> tuple[int, ...]:
        """Shape of one layer's KV cache (default: NHD, keys then values)."""
        return (2, num_blocks, block_size, num_kv_heads, head_size)

    @staticmethod
    def mla_kv_cache_shape(num_blocks: int, block_size: int, latent_size: int) -> tuple[int, ...]:
        """Shape of one MLA layer's cache: one row (:attr:`MLAConfig.row_size`) per token slot."""
        return (num_blocks, block_size, latent_size)

    def layer_kv_cache_shape(self, layer: AttentionLayerConfig, num_blocks: int, block_size: int) -> tuple[int, ...]:
        """The cache shape of ``layer`` in its layout (what the engine allocates per layer)."""
        if layer.mla is not None:
            return self.mla_kv_cache_shape(num_blocks, block_size, layer.mla.row_size)
        return self.kv_cache_shape(num_blocks, block_size, layer.num_kv_heads, layer.head_size)

    def kv_cache_spec(
        self, layer: AttentionLayerConfig, kv_dtype: KVCacheDtypeSpec, model_dtype: torch.dtype, block_size: int
    ) -> KVCacheSpec:
        """What one layer's cache holds for ``kv_dtype`` (shapes with the block dim ``-1``, storage
        dtypes, side buffers): the engine sizes blocks by its ``bytes_per_block`` and allocates it.
        The default: :meth:`layer_kv_cache_shape` in the model dtype for ``auto`` (and for MLA, whose
        latent cache is never quantized), else :func:`~framework.kv_cache.quantized_cache_spec`."""
        if kv_dtype.name == "auto" or layer.mla is not None:
            return model_cache_spec("auto", self.layer_kv_cache_shape(layer, -1, block_size), model_dtype, block_size)
        return quantized_cache_spec(
            kv_dtype.name,
            kv_dtype.key_format,
            kv_dtype.value_format,
            kv_dtype.rotate_keys,
            layer.num_kv_heads,
            layer.head_size,
            block_size,
            kv_dtype.rotate_values,
        )

    @classmethod
    def validate(cls, layer_configs: list[AttentionLayerConfig], kv_cache_dtype: str, platform: Any) -> list[str]:
        """Reasons this backend cannot run these layers on ``platform``; empty if it can."""
        return []

    def initialize(  # noqa: B027 - an optional hook
        self,
        layers: list[AttentionLayerConfig],
        dtype: torch.dtype,
        block_size: int,
        device: torch.device,
    ) -> None:
        """Called once after selection with the model's attention layers, before any step."""

    def prepare(self, metadata: AttentionMetadata) -> None:  # noqa: B027 - optional hook
        """Called once per step before the forward pass, always outside CUDA-graph capture: a
        decode step replaying a graph is prepared with the graph's padded rows
        (``metadata.graph_batch_size``), so a backend can plan into its static buffers here."""

    @abstractmethod
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
        """Attention for the step's tokens.

        ``kv_cache`` is this layer's :class:`~framework.kv_cache.KVCache` as :meth:`kv_cache_spec`
        declared it (``kv_cache.data`` the cache tensor; ``scales`` and ``rotation_signs`` for quantized
        dtypes, see :mod:`framework.kv_cache`).

        ``query`` is ``[T, num_heads * head_size]``, ``key``/``value`` ``[T, num_kv_heads *
        head_size]``; returns ``[T, num_heads * head_size]``. Stores ``key``/``value`` into
        ``kv_cache`` at ``metadata.slot_mapping`` (first, or within the attention kernel itself, as
        long as the step's tokens attend to the new K/V); token ``j`` of request ``r`` (absolute
        position ``p = seq_len - query_len + j``) attends to positions ``<= p`` of its own
        sequence (and ``> p - sliding_window`` when set; and ``>= p // C * C``, its own chunk, when
        ``attention_chunk_size`` ``C`` is set, for a backend with ``supports_chunked_attention``).

        Bidirectional spans (``metadata.span_ends`` set; a backend with
        ``supports_bidirectional_spans``): query token ``t`` at position ``p`` attends to positions
        ``< span_ends[t]`` instead of ``<= p`` (the sliding window's lower bound stays ``p - window``).
        A token inside a span (Gemma 3: the image tokens of one image) so sees the whole span, later
        tokens of it included; the engine never splits a span across steps, so those keys are this
        step's::

            positions     0  1  2 [3  4  5] 6        span 3..5 (one image)
            span_ends     1  2  3  6  6  6  7        token 3 sees 0..5, token 6 sees 0..6

        ``sinks`` (only for a layer with ``has_sinks``; a backend that cannot use them refuses such
        layers in :meth:`validate`): ``[num_heads]`` float logits, one per head, appended to every
        query's scores before the softmax and dropped after it, so the weights of the real keys sum
        to ``1 - softmax weight of the sink``::

            out = sum_j exp(s_j) v_j / (exp(sink_h) + sum_j exp(s_j))

        MLA layers (``layer.mla`` set, a backend listing ``"mla"`` in its spec's
        ``kv_cache_layouts``): ``query`` is ``[T, num_heads * (L + R)]`` (per head the absorbed
        ``q_nope @ W_UK`` then the roped ``q_pe``), ``key`` ``[T, L + R]`` (the latent ``c_kv``
        then the roped ``k_pe``: what is stored), ``value`` is None; returns ``[T, num_heads * L]``
        = ``softmax(q . k * scale) @ c_kv`` with the same causal rule (``L = kv_lora_rank``,
        ``R = qk_rope_head_dim``).

        Sparse MLA layers (``layer.mla.is_sparse``, a backend with ``supports_sparse_mla``) also get
        ``topk_indices`` ``[T, K]`` int32: for each query, positions within its own sequence that it
        may attend to (``-1`` pads; positions beyond the causal rule are ignored). Only the head
        ``[c_kv, k_pe]`` of each cache row is stored and read; the tail belongs to the indexer.
        """
