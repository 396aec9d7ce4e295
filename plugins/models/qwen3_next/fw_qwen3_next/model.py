"""Qwen3-Next, Qwen3.5 and Qwen3.5-MoE: hybrid decoders of Gated DeltaNet and gated attention.

``layer_types`` (or every ``full_attention_interval``-th layer, default 4) says which layers are
full attention; the others are Gated DeltaNet (``gdn.py``), whose per-sequence state lives in the
engine's state cache. Common to all three:

- gated attention: ``q_proj`` yields, per head, the query and an output gate (``2 * head_dim``);
  the attention output is multiplied by ``sigmoid(gate)`` before ``o_proj``;
- per-head QK RMSNorm and every decoder norm zero-centred (``x * (1 + weight)``);
- partial rotary (``partial_rotary_factor``, 0.25), NeoX style on the first features of a head
  (Qwen3.5's multimodal RoPE reduces to it for text, where the three position streams are equal).

| | feed-forward | GDN checkpoint layout |
| --- | --- | --- |
| Qwen3-Next | MoE with a sigmoid-gated shared expert; dense on ``mlp_only_layers`` / off ``decoder_sparse_step`` | fused ``in_proj_qkvz``, ``in_proj_ba`` |
| Qwen3.5 | dense SwiGLU | ``in_proj_qkv``, ``in_proj_z``, ``in_proj_b``, ``in_proj_a`` |
| Qwen3.5-MoE | MoE with a sigmoid-gated shared expert on every layer | as Qwen3.5 |

Tensor parallelism: attention heads, the DeltaNet heads (``gdn.py``), the MLPs and every expert
are split over the ranks; each rank keeps the state of its own DeltaNet heads.

Attention layers are numbered 0, 1, ... among themselves (their KV caches), GDN layers likewise
(their state caches). The multi-token-prediction weights (``mtp.*``) are not used. The Hub's
Qwen3.5 checkpoints are ``*ForConditionalGeneration``: their language model (``model.language_model.*``,
settings in ``text_config``) is this decoder, and ``qwen3_5_vl.py`` adds their vision tower
(``model.visual.*``, which a text-only ``*ForCausalLM`` checkpoint may carry and this class skips).
"""

from __future__ import annotations

import torch
from torch import nn

from framework.config import ModelConfig
from framework.distributed import get_tp_size
from framework.kernels import get_kernel
from framework.layers import (
    FusedMoE,
    GatedMLP,
    QKVParallelLinear,
    ReplicatedLinear,
    RMSNorm,
    RowParallelLinear,
    SiluAndMul,
    VocabEmbedding,
    get_rope,
    residual_norm,
)
from framework.layers.attention import Attention
from framework.layers.causal_lm import CausalLM, DecoderStack
from framework.layers.fused_moe import map_expert_weight_name
from framework.layers.linear import divide
from framework.layers.mlp import dense_mlp
from framework.quantization import QuantConfig

from .gdn import GatedDeltaNet
from .hooks import ARCHITECTURES, VISION_ARCHITECTURES

FUSED_QKVZ_ARCHITECTURES = ("Qwen3NextForCausalLM",)


def layer_types(config: ModelConfig) -> list[str]:
    """``"linear_attention"`` or ``"full_attention"`` per layer."""
    types = config.get("layer_types")
    if types:
        return list(types)
    interval = int(config.get("full_attention_interval") or 4)
    return ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(config.num_layers)]


def rotary_dim(config: ModelConfig) -> int:
    factor = config.rope_parameters.get("partial_rotary_factor") or config.get("partial_rotary_factor") or 1.0
    return int(config.head_size * float(factor))


def is_sparse_layer(config: ModelConfig, layer_index: int) -> bool:
    """Whether a layer's feed-forward is the MoE block (transformers' rule; Qwen3.5 dense has no experts)."""
    if not int(config.get("num_experts") or 0):
        return False
    step = int(config.get("decoder_sparse_step") or 1)
    return layer_index not in (config.get("mlp_only_layers") or []) and (layer_index + 1) % step == 0


class GatedAttention(nn.Module):
    """QKV (the query doubled into query and gate per head) -> QK norm -> partial RoPE -> paged
    attention -> ``* sigmoid(gate)`` -> o_proj."""

    def __init__(self, config: ModelConfig, attention_index: int, quant_config: QuantConfig | None, prefix: str):
        super().__init__()
        hidden, head_size, eps = config.hidden_size, config.head_size, float(config.get("rms_norm_eps") or 1e-6)
        self.head_size = head_size
        bias = bool(config.get("attention_bias", False))
        # 2 * num_heads "query heads" of head_size: the checkpoint's q_proj holds [query_h, gate_h] per
        # head, so a rank's share (whole heads, an even count) keeps every pair together
        divide(config.num_heads, get_tp_size(), "attention heads")
        self.qkv_proj = QKVParallelLinear(
            hidden,
            head_size,
            2 * config.num_heads,
            config.num_kv_heads,
            bias=bias,
            quant_config=quant_config,
            prefix=f"{prefix}.qkv_proj",
        )
        self.num_heads, num_kv_heads = self.qkv_proj.num_heads // 2, self.qkv_proj.num_kv_heads  # this rank's
        self.q_size, self.kv_size = 2 * self.num_heads * head_size, num_kv_heads * head_size
        self.o_proj = RowParallelLinear(
            config.num_heads * head_size, hidden, bias=bias, quant_config=quant_config, prefix=f"{prefix}.o_proj"
        )
        self.rotary_emb = get_rope(
            head_size, rotary_dim(config), config.max_model_len, config.rope_theta, config.rope_scaling
        )
        self.attn = Attention(
            attention_index,
            self.num_heads,
            num_kv_heads,
            head_size,
            head_size**-0.5,
            quant_config=quant_config,
            prefix=f"{prefix}.attn",
        )
        self.q_norm, self.k_norm = RMSNorm(head_size, eps, offset=1.0), RMSNorm(head_size, eps, offset=1.0)
        self._gate_mul = get_kernel("sigmoid_gate_mul")

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        tokens = hidden.shape[0]
        query_gate, k, v = self.qkv_proj(hidden).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, gate = query_gate.view(tokens, self.num_heads, 2 * self.head_size).chunk(2, dim=-1)
        q, k = self.rotary_emb.forward_with_qk_norm(positions, q.reshape(tokens, -1), k, self.q_norm, self.k_norm)
        return self.o_proj(self._gate_mul(self.attn(q, k, v), gate))  # gate: a [T, H, D] view


class SparseMoeBlock(nn.Module):
    """Softmax top-k router (``gate``) -> ``experts`` (FusedMoE), plus
    ``sigmoid(shared_expert_gate(x)) * shared_expert(x)``."""

    def __init__(self, config: ModelConfig, quant_config: QuantConfig | None, prefix: str) -> None:
        super().__init__()
        hidden, experts = config.hidden_size, int(config.get("num_experts"))
        self.gate = ReplicatedLinear(hidden, experts, quant_config=quant_config, prefix=f"{prefix}.gate")
        self.experts = FusedMoE(
            experts,
            int(config.get("num_experts_per_tok")),
            hidden,
            int(config.get("moe_intermediate_size")),
            renormalize=bool(config.get("norm_topk_prob", True)),  # Qwen3.5-MoE always renormalises
            quant_config=quant_config,
            prefix=f"{prefix}.experts",
        )
        shared = int(config.get("shared_expert_intermediate_size"))
        self.shared_expert = GatedMLP(
            hidden, shared, SiluAndMul(), quant_config=quant_config, prefix=f"{prefix}.shared_expert"
        )
        self.shared_expert_gate = ReplicatedLinear(
            hidden, 1, quant_config=quant_config, prefix=f"{prefix}.shared_expert_gate"
        )
        self._gate_mul = get_kernel("sigmoid_gate_mul")

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        routed = self.experts(hidden, self.gate(hidden))
        return self._gate_mul(self.shared_expert(hidden), self.shared_expert_gate(hidden), routed)


class HybridDecoderLayer(nn.Module):
    """``x + mixer(norm(x))`` then ``+ mlp(norm(.))``; the mixer is ``linear_attn`` (Gated DeltaNet)
    or ``self_attn`` (gated attention), numbered ``mixer_index`` among its kind."""

    def __init__(
        self,
        config: ModelConfig,
        layer_index: int,
        mixer_index: int,
        is_linear: bool,
        quant_config: QuantConfig | None,
        prefix: str,
    ) -> None:
        super().__init__()
        hidden, eps = config.hidden_size, float(config.get("rms_norm_eps") or 1e-6)
        self.is_linear = is_linear
        if is_linear:
            fused = config.architecture in FUSED_QKVZ_ARCHITECTURES
            self.linear_attn = GatedDeltaNet(config, mixer_index, quant_config, f"{prefix}.linear_attn", fused)
        else:
            self.self_attn = GatedAttention(config, mixer_index, quant_config, f"{prefix}.self_attn")
        if is_sparse_layer(config, layer_index):
            self.mlp = SparseMoeBlock(config, quant_config, f"{prefix}.mlp")
        else:
            self.mlp = dense_mlp(config, layer_index, quant_config, f"{prefix}.mlp")
        self.input_layernorm = RMSNorm(hidden, eps, offset=1.0)
        self.post_attention_layernorm = RMSNorm(hidden, eps, offset=1.0)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None):
        hidden, residual = residual_norm(self.input_layernorm, hidden, residual)
        hidden = self.linear_attn(hidden) if self.is_linear else self.self_attn(positions, hidden)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class HybridModel(DecoderStack):
    def __init__(self, config: ModelConfig, quant_config: QuantConfig | None, prefix: str) -> None:
        super().__init__()
        self.embed_tokens = VocabEmbedding(
            config.vocab_size, config.hidden_size, quant_config=quant_config, prefix=f"{prefix}.embed_tokens"
        )
        types = layer_types(config)
        unknown = sorted(set(types) - {"linear_attention", "full_attention"})
        if unknown or len(types) != config.num_layers:
            raise ValueError(
                f"layer_types must give linear_attention or full_attention for each of the {config.num_layers} "
                f"layers; got {types}"
            )
        counts = {"linear_attention": 0, "full_attention": 0}
        layers = []
        for index, kind in enumerate(types):
            layers.append(
                HybridDecoderLayer(
                    config,
                    index,
                    counts[kind],
                    kind == "linear_attention",
                    quant_config,
                    f"{prefix}.layers.{index}",
                )
            )
            counts[kind] += 1
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(config.hidden_size, float(config.get("rms_norm_eps") or 1e-6), offset=1.0)


class Qwen3NextForCausalLM(CausalLM):
    """Qwen3-Next, Qwen3.5, Qwen3.5-MoE: ``forward(input_ids, positions) -> hidden``; ``compute_logits``."""

    ignored_weight_patterns = (*CausalLM.ignored_weight_patterns, "mtp.", "model.visual.")

    def __init__(self, config: ModelConfig, quant_config: QuantConfig | None = None, prefix: str = "") -> None:
        super().__init__()
        served = {**ARCHITECTURES, **VISION_ARCHITECTURES}  # the latter through Qwen3_5ForConditionalGeneration
        if config.architecture not in served:
            raise ValueError(f"Qwen3NextForCausalLM serves {', '.join(served)}; got {config.architecture!r}")
        self.config = config
        self.model = HybridModel(config, quant_config, "model")
        self.init_lm_head(config, quant_config, tie_by_default=False)

    @staticmethod
    def map_weight_name(name: str) -> tuple[str, tuple | None]:
        """A multimodal checkpoint's ``model.language_model.`` is this model's ``model.``; expert
        tensors go to the stacked FusedMoE weights; the rest folds through ``packed_modules_mapping``
        (q/k/v into ``qkv_proj``, gate/up into ``gate_up_proj``)."""
        if name.startswith("model.language_model."):
            name = "model." + name.removeprefix("model.language_model.")
        return map_expert_weight_name(name)
