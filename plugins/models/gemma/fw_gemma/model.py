"""The Gemma family as one implementation with config switches.

| switch | Gemma | Gemma 2 | Gemma 3 (text) |
| --- | --- | --- | --- |
| norms per layer | 2 (pre-attention, pre-MLP) | 4 (+ post-attention, post-MLP) | 4 |
| attention scale | ``head_dim ** -0.5`` | ``query_pre_attn_scalar ** -0.5`` | same as Gemma 2 |
| sliding window | none | every other layer (``layer_types``) | ``layer_types`` / ``sliding_window_pattern`` |
| RoPE | one base | one base | local base on sliding layers, ``rope_theta`` + scaling on global |
| QK norm | no | no | RMSNorm per head on q and k |
| soft-capping | none | attention and final logits | final logits (when set) |

Common to all: GeGLU with tanh GELU, RMSNorm scaling by ``1 + weight`` (``offset=1``), token
embeddings multiplied by ``sqrt(hidden_size)`` rounded to the model dtype, tied LM head.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from framework.config import ModelConfig
from framework.layers import (
    GeluTanhAndMul,
    QKVParallelLinear,
    RMSNorm,
    RowParallelLinear,
    VocabEmbedding,
    residual_norm,
)
from framework.layers.attention import Attention
from framework.layers.causal_lm import CausalLM, DecoderStack
from framework.layers.mlp import GatedMLP
from framework.layers.rotary import get_rope
from framework.quantization import QuantConfig

#: ``architectures[0]`` -> Gemma generation; the switches in the table above key off it.
GENERATIONS = {
    "GemmaForCausalLM": 1,
    "Gemma2ForCausalLM": 2,
    "Gemma3ForCausalLM": 3,
    "Gemma3ForConditionalGeneration": 3,  # its decoder (``gemma3_vl.py``)
}
SLIDING, FULL = "sliding_attention", "full_attention"
TANH_GELUS = ("gelu_pytorch_tanh", "gelu_tanh")


def gemma_generation(config: ModelConfig) -> int:
    if config.architecture not in GENERATIONS:
        raise ValueError(f"fw_gemma serves {', '.join(GENERATIONS)}; got {config.architecture!r}")
    return GENERATIONS[config.architecture]


def layer_types(config: ModelConfig, generation: int) -> list[str]:
    """``sliding_attention`` or ``full_attention`` per layer.

    Configs without ``layer_types`` follow transformers' defaults: Gemma 2 alternates starting
    with a sliding layer; Gemma 3 makes every ``sliding_window_pattern``-th layer (default 6) global.
    """
    num_layers = config.num_layers
    if generation == 1 or not config.get("sliding_window"):
        return [FULL] * num_layers
    if config.get("layer_types"):
        return list(config.get("layer_types"))
    pattern = 2 if generation == 2 else int(config.get("sliding_window_pattern") or 6)
    return [SLIDING if (i + 1) % pattern else FULL for i in range(num_layers)]


def rope_parameters(config: ModelConfig, generation: int, layer_type: str) -> tuple[float, dict[str, Any] | None]:
    """``(base, scaling)`` of the RoPE a layer of ``layer_type`` uses.

    Gemma 3 has two: transformers 5 writes ``rope_parameters = {"full_attention": {...},
    "sliding_attention": {...}}`` (each with its ``rope_theta``); older configs (and GGUF) give
    ``rope_theta`` + ``rope_scaling`` for global layers and ``rope_local_base_freq`` for local ones.
    """
    per_type = config.get("rope_parameters") or {}
    if layer_type in per_type:
        params = per_type[layer_type]
        return float(params.get("rope_theta") or (10_000.0 if layer_type == SLIDING else 1_000_000.0)), params
    if generation == 3 and layer_type == SLIDING:
        return float(config.get("rope_local_base_freq") or 10_000.0), None
    if generation == 3 and config.get("rope_theta") is None and not per_type.get("rope_theta"):
        return 1_000_000.0, config.rope_scaling  # Gemma3TextConfig's default global base
    return config.rope_theta, config.rope_scaling


class GemmaAttention(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        generation: int,
        layer_index: int,
        layer_type: str,
        quant_config: QuantConfig | None,
        prefix: str,
        has_bidirectional_spans: bool = False,
    ) -> None:
        super().__init__()
        hidden, head_size = config.hidden_size, config.head_size
        self.head_size = head_size
        bias = bool(config.get("attention_bias", False))
        self.qkv_proj = QKVParallelLinear(
            hidden,
            head_size,
            config.num_heads,
            config.num_kv_heads,
            bias=bias,
            quant_config=quant_config,
            prefix=f"{prefix}.qkv_proj",
        )
        # this tensor-parallel rank's heads (all of them on one device)
        num_heads, num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.q_size, self.kv_size = num_heads * head_size, num_kv_heads * head_size
        self.o_proj = RowParallelLinear(
            config.num_heads * head_size, hidden, bias=bias, quant_config=quant_config, prefix=f"{prefix}.o_proj"
        )
        base, scaling = rope_parameters(config, generation, layer_type)
        self.rotary_emb = get_rope(head_size, head_size, config.max_model_len, base, scaling)
        scalar = config.get("query_pre_attn_scalar") if generation >= 2 else None
        # transformers' Gemma 3 keeps attn_logit_softcapping in its config but never applies it (QK norm replaced it).
        soft_cap = config.get("attn_logit_softcapping") if generation == 2 else None
        window = config.get("sliding_window") if layer_type == SLIDING else None
        self.attn = Attention(
            layer_index,
            num_heads,
            num_kv_heads,
            head_size,
            float(scalar or head_size) ** -0.5,
            sliding_window=window,
            logits_soft_cap=soft_cap,
            has_bidirectional_spans=has_bidirectional_spans,
            quant_config=quant_config,
            prefix=f"{prefix}.attn",
        )
        if generation >= 3:
            eps = float(config.get("rms_norm_eps", 1e-6))
            self.q_norm = RMSNorm(head_size, eps, offset=1.0)
            self.k_norm = RMSNorm(head_size, eps, offset=1.0)
        else:
            self.q_norm = self.k_norm = None

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv_proj(hidden).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        if self.q_norm is not None:  # Gemma 3: per-head RMS norm, then RoPE, in one op
            q, k = self.rotary_emb.forward_with_qk_norm(positions, q, k, self.q_norm, self.k_norm)
        else:
            q, k = self.rotary_emb(positions, q, k)
        return self.o_proj(self.attn(q, k, v))


class GemmaMLP(GatedMLP):
    """GeGLU (tanh GELU); other activations are refused."""

    def __init__(self, config: ModelConfig, generation: int, quant_config: QuantConfig | None, prefix: str) -> None:
        hidden, inter = config.hidden_size, int(config.get("intermediate_size"))
        # Gemma 1 configs say "gelu" and mean the tanh approximation (transformers rewrites it the same way).
        act = config.get("hidden_activation") or config.get("hidden_act") or TANH_GELUS[0]
        if act not in TANH_GELUS and not (generation == 1 and act == "gelu"):
            raise ValueError(f"fw_gemma supports hidden_activation {' or '.join(TANH_GELUS)}; got {act!r}")
        super().__init__(hidden, inter, GeluTanhAndMul(), quant_config=quant_config, prefix=prefix)


class GemmaDecoderLayer(nn.Module):
    """Gemma 1: ``x + attn(norm(x))``, then ``+ mlp(norm(.))``; Gemma 2/3 also normalise each
    branch's output (``post_attention_layernorm``, ``post_feedforward_layernorm``) before the add.

    The residual stream travels beside the hidden state so each add fuses into the next norm.
    """

    def __init__(
        self,
        config: ModelConfig,
        generation: int,
        layer_index: int,
        layer_type: str,
        quant_config: QuantConfig | None,
        prefix: str,
        has_bidirectional_spans: bool = False,
    ) -> None:
        super().__init__()
        eps, hidden = float(config.get("rms_norm_eps", 1e-6)), config.hidden_size
        self.self_attn = GemmaAttention(
            config, generation, layer_index, layer_type, quant_config, f"{prefix}.self_attn", has_bidirectional_spans
        )
        self.mlp = GemmaMLP(config, generation, quant_config, f"{prefix}.mlp")
        self.input_layernorm = RMSNorm(hidden, eps, offset=1.0)
        self.post_attention_layernorm = RMSNorm(hidden, eps, offset=1.0)  # Gemma 1: the pre-MLP norm
        self.has_branch_norms = generation >= 2
        if self.has_branch_norms:
            self.pre_feedforward_layernorm = RMSNorm(hidden, eps, offset=1.0)
            self.post_feedforward_layernorm = RMSNorm(hidden, eps, offset=1.0)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None):
        hidden, residual = residual_norm(self.input_layernorm, hidden, residual)
        hidden = self.self_attn(positions, hidden)
        if not self.has_branch_norms:
            hidden, residual = self.post_attention_layernorm(hidden, residual)
            return self.mlp(hidden), residual
        hidden, residual = self.pre_feedforward_layernorm(self.post_attention_layernorm(hidden), residual)
        return self.post_feedforward_layernorm(self.mlp(hidden)), residual


class GemmaModel(DecoderStack):
    """``has_bidirectional_spans``: the attention layers take a step's bidirectional spans (Gemma 3's images)."""

    def __init__(
        self,
        config: ModelConfig,
        generation: int,
        quant_config: QuantConfig | None,
        prefix: str,
        has_bidirectional_spans: bool = False,
    ) -> None:
        super().__init__()
        if config.get("use_bidirectional_attention"):
            raise ValueError(
                "fw_gemma serves causal Gemma models; use_bidirectional_attention (EmbeddingGemma) is not supported"
            )
        self.embed_tokens = VocabEmbedding(
            config.vocab_size, config.hidden_size, quant_config=quant_config, prefix=f"{prefix}.embed_tokens"
        )
        # transformers rounds sqrt(hidden_size) to the model dtype first (bf16: sqrt(3072) = 55.43 -> 55.5).
        self.embed_scale = float(torch.tensor(config.hidden_size**0.5, device="cpu").to(torch.get_default_dtype()))
        types = layer_types(config, generation)
        self.layers = nn.ModuleList(
            GemmaDecoderLayer(
                config, generation, i, types[i], quant_config, f"{prefix}.layers.{i}", has_bidirectional_spans
            )
            for i in range(config.num_layers)
        )
        self.norm = RMSNorm(config.hidden_size, float(config.get("rms_norm_eps", 1e-6)), offset=1.0)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids) * self.embed_scale


class GemmaForCausalLM(CausalLM):
    """``forward(input_ids, positions) -> hidden``; ``compute_logits(hidden) -> logits``."""

    #: the image tokens of one image attend to each other (a vision subclass sets it)
    bidirectional_image_attention = False

    def __init__(self, config: ModelConfig, quant_config: QuantConfig | None = None, prefix: str = "") -> None:
        super().__init__()
        self.config = config
        generation = gemma_generation(config)
        self.model = GemmaModel(config, generation, quant_config, "model", self.bidirectional_image_attention)
        self.init_lm_head(config, quant_config, tie_by_default=True)  # every released Gemma ties them
        self.final_logit_softcapping = config.get("final_logit_softcapping") if generation >= 2 else None

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden)
        if self.final_logit_softcapping:
            cap = self.final_logit_softcapping
            logits = torch.tanh(logits / cap) * cap
        return logits
