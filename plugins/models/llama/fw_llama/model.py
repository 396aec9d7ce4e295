"""The Llama family as one implementation with config switches.

| switch | Llama | Mistral | Qwen2 | Yi / SmolLM |
| --- | --- | --- | --- | --- |
| bias on q/k/v | ``attention_bias`` | no | yes | no |
| sliding window | no | ``sliding_window`` on every layer | per ``layer_types`` | no |
| rope scaling | llama3 / linear / dynamic / yarn | default | yarn (long context) | default |

``LlamaAttention(qk_norm=...)`` adds Qwen3's per-head RMSNorm of q and k before RoPE (on by
default for ``model_type`` in :data:`QK_NORM_MODEL_TYPES`). The mixture-of-experts members
(Mixtral, Qwen2-MoE, Qwen3-MoE, ``moe.py``) reuse this decoder and swap its feed-forward through
``LlamaModel(make_mlp=...)``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from framework.config import ModelConfig
from framework.layers import (
    QKVParallelLinear,
    RMSNorm,
    RowParallelLinear,
    SiluAndMul,
    VocabEmbedding,
)
from framework.layers.attention import Attention
from framework.layers.causal_lm import CausalLM, DecoderStack
from framework.layers.mlp import GatedMLP
from framework.layers.rotary import get_rope
from framework.quantization import QuantConfig


def layer_sliding_window(config: ModelConfig, layer_index: int) -> int | None:
    """The sliding window of one layer, or None for full attention."""
    window = config.get("sliding_window")
    layer_types = config.get("layer_types")
    if not window:
        return None
    if layer_types:
        return window if layer_types[layer_index] == "sliding_attention" else None
    if config.get("use_sliding_window") is False:
        return None
    return window


#: ``model_type``s whose attention normalises each query and key head (RMSNorm over head_dim, before RoPE).
QK_NORM_MODEL_TYPES = frozenset({"qwen3", "qwen3_moe"})


def has_qkv_bias(config: ModelConfig) -> bool:
    """Bias on q/k/v: ``attention_bias``; Qwen2 always; Qwen2-MoE per ``qkv_bias`` (default on)."""
    model_type = config.get("model_type")
    if model_type == "qwen2_moe":
        return bool(config.get("qkv_bias", True))
    return bool(config.get("attention_bias", False)) or model_type == "qwen2"


class LlamaAttention(nn.Module):
    """q/k/v projection, optional per-head QK RMSNorm (``qk_norm``: Qwen3), RoPE, attention, o_proj.

    ``qk_norm=None`` decides from ``model_type`` (:data:`QK_NORM_MODEL_TYPES`); the norms are
    ``q_norm`` / ``k_norm`` with ``head_dim`` weights, as in the checkpoints.
    """

    def __init__(self, config: ModelConfig, layer_index: int, quant_config: QuantConfig | None, prefix: str,
                 *, qk_norm: bool | None = None) -> None:
        super().__init__()
        hidden, head_size = config.hidden_size, config.head_size
        self.head_size = head_size
        self.q_size = config.num_heads * head_size
        self.kv_size = config.num_kv_heads * head_size
        qkv_bias = has_qkv_bias(config)
        self.qkv_proj = QKVParallelLinear(hidden, head_size, config.num_heads, config.num_kv_heads, bias=qkv_bias,
                                          quant_config=quant_config, prefix=f"{prefix}.qkv_proj")
        self.o_proj = RowParallelLinear(self.q_size, hidden, bias=bool(config.get("attention_bias", False)),
                                        quant_config=quant_config, prefix=f"{prefix}.o_proj")
        self.rotary_emb = get_rope(head_size, head_size, config.max_model_len, config.rope_theta, config.rope_scaling)
        self.attn = Attention(layer_index, config.num_heads, config.num_kv_heads, head_size, head_size**-0.5,
                              sliding_window=layer_sliding_window(config, layer_index))
        if qk_norm is None:
            qk_norm = config.get("model_type") in QK_NORM_MODEL_TYPES
        if qk_norm:
            eps = float(config.get("rms_norm_eps", 1e-6))
            self.q_norm, self.k_norm = RMSNorm(head_size, eps), RMSNorm(head_size, eps)
        else:
            self.q_norm = self.k_norm = None

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv_proj(hidden).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        if self.q_norm is not None:  # per head, before RoPE
            q = self.q_norm(q.unflatten(-1, (-1, self.head_size))).flatten(-2)
            k = self.k_norm(k.unflatten(-1, (-1, self.head_size))).flatten(-2)
        q, k = self.rotary_emb(positions, q, k)
        return self.o_proj(self.attn(q, k, v))


def dense_mlp(config: ModelConfig, layer_index: int, quant_config: QuantConfig | None, prefix: str) -> nn.Module:
    """The SwiGLU feed-forward block of every Llama-family layer (``intermediate_size`` wide)."""
    return GatedMLP(config.hidden_size, int(config.get("intermediate_size")), SiluAndMul(),
                    bias=bool(config.get("mlp_bias", False)), quant_config=quant_config, prefix=prefix)


#: Builds a layer's feed-forward block: ``make_mlp(config, layer_index, quant_config, prefix)``.
MLPFactory = Callable[[ModelConfig, int, "QuantConfig | None", str], nn.Module]


class LlamaDecoderLayer(nn.Module):
    """Pre-norm attention and feed-forward; ``make_mlp`` swaps the feed-forward (MoE models)."""

    def __init__(self, config: ModelConfig, layer_index: int, quant_config: QuantConfig | None, prefix: str,
                 make_mlp: MLPFactory = dense_mlp) -> None:
        super().__init__()
        eps = float(config.get("rms_norm_eps", 1e-6))
        self.self_attn = LlamaAttention(config, layer_index, quant_config, f"{prefix}.self_attn")
        self.mlp = make_mlp(config, layer_index, quant_config, f"{prefix}.mlp")
        self.input_layernorm = RMSNorm(config.hidden_size, eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None):
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class LlamaModel(DecoderStack):
    def __init__(self, config: ModelConfig, quant_config: QuantConfig | None, prefix: str,
                 make_mlp: MLPFactory = dense_mlp) -> None:
        super().__init__()
        self.embed_tokens = VocabEmbedding(config.vocab_size, config.hidden_size, quant_config=quant_config,
                                           prefix=f"{prefix}.embed_tokens")
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, i, quant_config, f"{prefix}.layers.{i}", make_mlp) for i in range(config.num_layers)
        )
        self.norm = RMSNorm(config.hidden_size, float(config.get("rms_norm_eps", 1e-6)))


class LlamaForCausalLM(CausalLM):
    """``forward(input_ids, positions) -> hidden``; ``compute_logits(hidden) -> logits``."""

    def __init__(self, config: ModelConfig, quant_config: QuantConfig | None = None, prefix: str = "") -> None:
        super().__init__()
        self.config = config
        self.model = LlamaModel(config, quant_config, "model")
        self.init_lm_head(config, quant_config, tie_by_default=False)
