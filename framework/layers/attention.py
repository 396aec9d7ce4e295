"""The ``Attention`` layer: holds its layer constants, delegates to the step's backend."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from framework.attention_backend import AttentionLayerConfig, MLAConfig
from framework.forward_context import get_forward_context
from framework.quantization import QuantMethodBase, quant_method_for

if TYPE_CHECKING:
    from framework.quantization import QuantConfig


class Attention(nn.Module):
    """Paged attention for layer ``layer_index``; q/k/v are ``[T, heads * head_size]``.

    The backend and this layer's KV cache come from the forward context, so the module holds no
    cache tensor and models stay ``forward(input_ids, positions)``.

    With ``mla`` it is a multi-head-latent-attention layer (``"mla"`` KV layout): build it with
    ``num_kv_heads=1`` and ``head_size = mla.latent_size``, call it with the absorbed query, the
    latent key and ``value=None`` (see :meth:`framework.attention_backend.AttentionBackend.forward`).

    ``quant_method`` is what ``quant_config.get_quant_method(self, prefix)`` returns: a KV-cache
    method of a checkpoint format, ``None`` for every format today. The KV dtype itself is an
    engine option (``--kv-cache-dtype``); checkpoint ``k_scale`` / ``v_scale`` tensors (fp8
    calibrations, per tensor or per KV head) reach :meth:`set_checkpoint_scale` through the loader
    and the engine hands them to this layer's quantized cache.

    A sparse MLA layer (``mla.is_sparse``, DeepSeek-V3.2 / GLM-5) is called with the
    ``topk_indices`` its model's lightning indexer chose (``[T, K]`` positions within each
    query's sequence, ``-1`` pads); only backends with ``supports_sparse_mla`` are chosen for it.

    With ``has_sinks`` (gpt-oss) every call passes the layer's per-head sink logits, which the
    backend adds to the softmax (see :meth:`framework.attention_backend.AttentionBackend.forward`).
    With ``attention_chunk_size`` (Llama 4) a token attends only within its own chunk of that many
    positions; only backends with ``supports_chunked_attention`` are chosen for such layers.
    With ``has_bidirectional_spans`` (Gemma 3 with images) a step's ``span_ends`` let the tokens of one
    image see each other; only backends with ``supports_bidirectional_spans`` are chosen.
    """

    def __init__(
        self,
        layer_index: int,
        num_heads: int,
        num_kv_heads: int,
        head_size: int,
        scale: float,
        sliding_window: int | None = None,
        logits_soft_cap: float | None = None,
        mla: MLAConfig | None = None,
        *,
        has_sinks: bool = False,
        attention_chunk_size: int | None = None,
        has_bidirectional_spans: bool = False,
        quant_config: QuantConfig | None = None,
        prefix: str = "",
    ) -> None:
        super().__init__()
        if mla is not None and (num_kv_heads != 1 or head_size != mla.latent_size):
            raise ValueError(
                f"an MLA layer has one KV head of the latent size {mla.latent_size}, "
                f"got {num_kv_heads} heads of {head_size}"
            )
        self.layer_index = layer_index
        self.config = AttentionLayerConfig(
            num_heads,
            num_kv_heads,
            head_size,
            scale,
            sliding_window,
            logits_soft_cap,
            mla,
            has_sinks,
            attention_chunk_size,
            has_bidirectional_spans,
        )
        self.prefix = prefix
        self.quant_method: QuantMethodBase | None = quant_method_for(
            quant_config, self, prefix, QuantMethodBase, "an attention layer"
        )
        self.checkpoint_scales: dict[str, torch.Tensor] = {}

    def set_checkpoint_scale(self, which: str, scale: torch.Tensor) -> None:
        """Keep a checkpoint's ``k_scale`` or ``v_scale`` (one number, or one per KV head of this rank)."""
        if which not in ("k_scale", "v_scale"):
            raise ValueError(f"an attention layer keeps k_scale and v_scale, not {which!r}")
        scale = scale.detach().float().flatten().cpu()
        if scale.numel() not in (1, self.config.num_kv_heads):
            raise ValueError(
                f"{self.prefix}.{which} has {scale.numel()} values; expected 1 or {self.config.num_kv_heads} (per KV head)"
            )
        self.checkpoint_scales[which] = scale.expand(self.config.num_kv_heads).clone()

    def checkpoint_kv_scales(self, device: torch.device) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The checkpoint's ``(k_scale, v_scale)`` as ``[H_kv]`` float32 on ``device`` (None where absent)."""
        found = [self.checkpoint_scales.get(name) for name in ("k_scale", "v_scale")]
        return tuple(None if scale is None else scale.to(device) for scale in found)

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor | None,
        sinks: torch.Tensor | None = None,
        topk_indices: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``sinks`` (``[num_heads]``, this rank's heads) is required exactly when built with ``has_sinks``;
        ``topk_indices`` exactly for a sparse MLA layer."""
        if (sinks is not None) != self.config.has_sinks:
            raise ValueError(
                f"{self.prefix}: attention sinks given {sinks is not None}, built with has_sinks={self.config.has_sinks}"
            )
        is_sparse = self.config.mla is not None and self.config.mla.is_sparse
        if (topk_indices is not None) != is_sparse:
            raise ValueError(f"{self.prefix}: topk_indices given {topk_indices is not None}, sparse MLA {is_sparse}")
        context = get_forward_context()
        cache = context.kv_caches[self.layer_index]
        extra = {}  # backends without sinks or sparse MLA keep the plain signature
        if sinks is not None:
            extra["sinks"] = sinks
        if topk_indices is not None:
            extra["topk_indices"] = topk_indices
        return context.backend.forward(self.config, query, key, value, cache, context.metadata, **extra)
