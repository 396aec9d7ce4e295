"""The Llama family as one implementation with config switches.

| switch | Llama | Mistral | Qwen2 | Yi / SmolLM |
| --- | --- | --- | --- | --- |
| bias on q/k/v | ``attention_bias`` | no | yes | no |
| sliding window | no | ``sliding_window`` on every layer | per ``layer_types`` | no |
| rope scaling | llama3 / linear / dynamic / yarn | default | yarn (long context) | default |
"""

from __future__ import annotations

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


class LlamaAttention(nn.Module):
    def __init__(self, config: ModelConfig, layer_index: int, quant_config: QuantConfig | None, prefix: str) -> None:
        super().__init__()
        hidden, head_size = config.hidden_size, config.head_size
        qkv_bias = bool(config.get("attention_bias", False)) or config.get("model_type") == "qwen2"
        self.qkv_proj = QKVParallelLinear(hidden, head_size, config.num_heads, config.num_kv_heads, bias=qkv_bias,
                                          quant_config=quant_config, prefix=f"{prefix}.qkv_proj")
        # this tensor-parallel rank's heads (all of them on one device)
        num_heads, num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.q_size, self.kv_size = num_heads * head_size, num_kv_heads * head_size
        self.o_proj = RowParallelLinear(config.num_heads * head_size, hidden, bias=bool(config.get("attention_bias", False)),
                                        quant_config=quant_config, prefix=f"{prefix}.o_proj")
        self.rotary_emb = get_rope(head_size, head_size, config.max_model_len, config.rope_theta, config.rope_scaling)
        self.attn = Attention(layer_index, num_heads, num_kv_heads, head_size, head_size**-0.5,
                              sliding_window=layer_sliding_window(config, layer_index))

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv_proj(hidden).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, k = self.rotary_emb(positions, q, k)
        return self.o_proj(self.attn(q, k, v))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_index: int, quant_config: QuantConfig | None, prefix: str) -> None:
        super().__init__()
        eps = float(config.get("rms_norm_eps", 1e-6))
        self.self_attn = LlamaAttention(config, layer_index, quant_config, f"{prefix}.self_attn")
        self.mlp = GatedMLP(config.hidden_size, int(config.get("intermediate_size")), SiluAndMul(),
                            bias=bool(config.get("mlp_bias", False)), quant_config=quant_config, prefix=f"{prefix}.mlp")
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
    def __init__(self, config: ModelConfig, quant_config: QuantConfig | None, prefix: str) -> None:
        super().__init__()
        self.embed_tokens = VocabEmbedding(config.vocab_size, config.hidden_size, quant_config=quant_config,
                                           prefix=f"{prefix}.embed_tokens")
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, i, quant_config, f"{prefix}.layers.{i}") for i in range(config.num_layers)
        )
        self.norm = RMSNorm(config.hidden_size, float(config.get("rms_norm_eps", 1e-6)))


class LlamaForCausalLM(CausalLM):
    """``forward(input_ids, positions) -> hidden``; ``compute_logits(hidden) -> logits``."""

    def __init__(self, config: ModelConfig, quant_config: QuantConfig | None = None, prefix: str = "") -> None:
        super().__init__()
        self.config = config
        self.model = LlamaModel(config, quant_config, "model")
        self.init_lm_head(config, quant_config, tie_by_default=False)
