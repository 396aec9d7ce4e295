"""Llama 4 text (``Llama4ForCausalLM``): Llama attention with four per-layer switches and a
top-1 MoE whose router score scales the expert's *input*.

| part | Llama 4 |
| --- | --- |
| RoPE layers (``no_rope_layers[i] == 1``) | interleaved-pair rotary (the complex rotation, ``is_neox_style=False``), then the weightless L2 QK norm (``use_qk_norm``), chunked local attention (``attention_chunk_size``) |
| NoPE layers (every ``no_rope_layer_interval``-th) | no rotary, full causal attention, queries scaled by ``1 + attn_scale * log1p(floor((p + 1) / floor_scale))`` (``attn_temperature_tuning``) |
| feed-forward | ``moe_layers`` (every ``interleave_moe_layer_step``-th layer): :class:`Llama4MoE`; others a SwiGLU of ``intermediate_size_mlp`` |
| MoE | ``router`` -> top-k logits -> ``sigmoid`` -> each chosen expert gets ``score * x``; plus ``shared_expert(x)`` (``intermediate_size``) |

Checkpoints store the experts stacked and transposed against FusedMoE's layout::

    feed_forward.experts.gate_up_proj [E, H, 2I]  (gate columns, then up)  -> w13_weight [E, 2I, H]
    feed_forward.experts.down_proj    [E, I, H]                            -> w2_weight  [E, H, I]

Per-expert tensors (``experts.{e}.gate_proj.weight`` ...) load as in the other MoE models.
``Llama4ForConditionalGeneration`` (the released Scout / Maverick checkpoints, with images) is
:mod:`fw_llama.llama4_vl`.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
from torch import nn

from framework.config import ModelConfig
from framework.layers import (
    GatedMLP,
    QKVParallelLinear,
    ReplicatedLinear,
    RMSNorm,
    RowParallelLinear,
    SiluAndMul,
    VocabEmbedding,
    residual_norm,
)
from framework.layers.attention import Attention
from framework.layers.causal_lm import CausalLM, DecoderStack
from framework.layers.fused_moe import FusedMoE, map_expert_weight_name
from framework.layers.linear import tensor_parallel_all_reduce
from framework.layers.rotary import get_rope
from framework.loader.checkpoint_slice import materialize
from framework.loader.model_loader import load_parameters
from framework.quantization import QuantConfig

from .model import rope_scaling

CHUNKED = "chunked_attention"


def uses_rope(config: ModelConfig, layer_index: int) -> bool:
    """Whether layer ``layer_index`` rotates q and k (``no_rope_layers``: 1 = RoPE, 0 = NoPE;
    absent: every ``no_rope_layer_interval``-th layer is NoPE, transformers' default)."""
    flags = config.get("no_rope_layers")
    if flags:
        return bool(flags[layer_index])
    return (layer_index + 1) % int(config.get("no_rope_layer_interval") or 4) != 0


def attention_chunk(config: ModelConfig, layer_index: int) -> int | None:
    """The attention chunk of a layer, or None for full causal attention: ``layer_types`` says
    ``chunked_attention`` (default: the RoPE layers, when ``attention_chunk_size`` is set)."""
    chunk = config.get("attention_chunk_size")
    types = config.get("layer_types")
    is_chunked = types[layer_index] == CHUNKED if types else uses_rope(config, layer_index)
    return int(chunk) if chunk and is_chunked else None


def is_moe_layer(config: ModelConfig, layer_index: int) -> bool:
    """``moe_layers`` when given, else every ``interleave_moe_layer_step``-th layer (the last of each step)."""
    layers = config.get("moe_layers")
    if layers is not None:
        return layer_index in layers
    step = int(config.get("interleave_moe_layer_step") or 1)
    return (layer_index + 1) % step == 0


def l2_norm(x: torch.Tensor, head_size: int, eps: float) -> torch.Tensor:
    """Llama 4's weightless QK norm: each head of ``x [T, heads * head_size]`` times
    ``rsqrt(mean(x**2) + eps)``, in float32, rounded back to ``x.dtype``."""
    heads = x.unflatten(-1, (-1, head_size)).float()
    return (heads * torch.rsqrt(heads.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype).flatten(-2)


class Llama4Attention(nn.Module):
    """QKV -> (RoPE layers) interleaved rotary + L2 QK norm, or (NoPE layers) temperature-tuned
    queries -> paged attention (chunked on the RoPE layers) -> o_proj."""

    def __init__(self, config: ModelConfig, layer_index: int, quant_config: QuantConfig | None, prefix: str) -> None:
        super().__init__()
        hidden, head_size = config.hidden_size, config.head_size
        bias = bool(config.get("attention_bias", False))
        self.head_size, self.eps = head_size, float(config.get("rms_norm_eps") or 1e-5)
        self.qkv_proj = QKVParallelLinear(
            hidden,
            head_size,
            config.num_heads,
            config.num_kv_heads,
            bias=bias,
            quant_config=quant_config,
            prefix=f"{prefix}.qkv_proj",
        )
        num_heads, num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.q_size, self.kv_size = num_heads * head_size, num_kv_heads * head_size
        self.o_proj = RowParallelLinear(
            config.num_heads * head_size, hidden, bias=bias, quant_config=quant_config, prefix=f"{prefix}.o_proj"
        )
        self.rotary_emb = None
        if uses_rope(config, layer_index):
            self.rotary_emb = get_rope(
                head_size, head_size, config.max_model_len, config.rope_theta, rope_scaling(config), is_neox_style=False
            )
        self.use_qk_norm = self.rotary_emb is not None and bool(config.get("use_qk_norm", True))
        self.temperature_tuning = self.rotary_emb is None and bool(config.get("attn_temperature_tuning", True))
        self.floor_scale = float(config.get("floor_scale") or 8192)
        self.attn_scale = float(config.get("attn_scale") or 0.1)
        self.attn = Attention(
            layer_index,
            num_heads,
            num_kv_heads,
            head_size,
            head_size**-0.5,
            attention_chunk_size=attention_chunk(config, layer_index),
            quant_config=quant_config,
            prefix=f"{prefix}.attn",
        )

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv_proj(hidden).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        if self.rotary_emb is not None:
            q, k = self.rotary_emb(positions, q, k)
            if self.use_qk_norm:  # after the rotation, as transformers does
                q, k = l2_norm(q, self.head_size, self.eps), l2_norm(k, self.head_size, self.eps)
        elif self.temperature_tuning:  # longer contexts sharpen the NoPE layers' softmax
            scale = torch.log1p(torch.floor((positions.float() + 1.0) / self.floor_scale)) * self.attn_scale + 1.0
            q = (q * scale[:, None]).to(q.dtype)
        return self.o_proj(self.attn(q, k, v))


class Llama4MoE(nn.Module):
    """``shared_expert(x) + sum_j expert_{e_j}(sigmoid(l_j) * x)`` over the router's top-k logits
    ``l_j`` (top-1 in every released model).

    FusedMoE weights outputs, so each of the k choices is one FusedMoE call on its own scaled
    input with weight 1. Tensor parallelism: experts and shared expert return partial sums over
    their intermediate features, reduced once (as ``SparseMoeBlock``).
    """

    def __init__(self, config: ModelConfig, quant_config: QuantConfig | None, prefix: str) -> None:
        super().__init__()
        hidden, width = config.hidden_size, int(config.get("intermediate_size"))
        experts = int(config.get("num_local_experts"))
        self.top_k = int(config.get("num_experts_per_tok") or 1)
        self.router = ReplicatedLinear(hidden, experts, quant_config=quant_config, prefix=f"{prefix}.router")
        self.experts = FusedMoE(
            experts,
            self.top_k,
            hidden,
            width,
            renormalize=False,
            quant_config=quant_config,
            prefix=f"{prefix}.experts",
            reduce_results=False,
        )
        self.shared_expert = GatedMLP(
            hidden,
            width,
            SiluAndMul(),
            quant_config=quant_config,
            prefix=f"{prefix}.shared_expert",
            reduce_results=False,
        )
        self.reduce_results = True

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits, ids = torch.topk(self.router(hidden), self.top_k, dim=-1)
        scores = torch.sigmoid(logits.float()).to(hidden.dtype)
        ids = ids.to(torch.int32)
        ones = torch.ones(hidden.shape[0], 1, dtype=torch.float32, device=hidden.device)
        out = self.shared_expert(hidden)
        for j in range(self.top_k):
            out = out + self.experts(hidden * scores[:, j : j + 1], topk_weights=ones, topk_ids=ids[:, j : j + 1])
        if self.experts.tp_size > 1 and self.reduce_results:
            out = tensor_parallel_all_reduce(out)
        return out


class Llama4DecoderLayer(nn.Module):
    """``x + attn(norm(x))``, then ``+ feed_forward(norm(.))`` (the residual add fused into the norms)."""

    def __init__(self, config: ModelConfig, layer_index: int, quant_config: QuantConfig | None, prefix: str) -> None:
        super().__init__()
        hidden, eps = config.hidden_size, float(config.get("rms_norm_eps") or 1e-5)
        self.self_attn = Llama4Attention(config, layer_index, quant_config, f"{prefix}.self_attn")
        if is_moe_layer(config, layer_index):
            self.feed_forward = Llama4MoE(config, quant_config, f"{prefix}.feed_forward")
        else:
            width = int(config.get("intermediate_size_mlp") or config.get("intermediate_size"))
            self.feed_forward = GatedMLP(
                hidden, width, SiluAndMul(), quant_config=quant_config, prefix=f"{prefix}.feed_forward"
            )
        self.input_layernorm = RMSNorm(hidden, eps)
        self.post_attention_layernorm = RMSNorm(hidden, eps)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None):
        hidden, residual = residual_norm(self.input_layernorm, hidden, residual)
        hidden, residual = self.post_attention_layernorm(self.self_attn(positions, hidden), residual)
        return self.feed_forward(hidden), residual


class Llama4Model(DecoderStack):
    def __init__(self, config: ModelConfig, quant_config: QuantConfig | None, prefix: str) -> None:
        super().__init__()
        self.embed_tokens = VocabEmbedding(
            config.vocab_size, config.hidden_size, quant_config=quant_config, prefix=f"{prefix}.embed_tokens"
        )
        self.layers = nn.ModuleList(
            Llama4DecoderLayer(config, i, quant_config, f"{prefix}.layers.{i}") for i in range(config.num_layers)
        )
        self.norm = RMSNorm(config.hidden_size, float(config.get("rms_norm_eps") or 1e-5))


def to_fused_moe_layout(name: str, tensor) -> tuple[str, torch.Tensor]:
    """A stacked ``experts.gate_up_proj`` / ``experts.down_proj`` transposed to FusedMoE's
    ``[E, out, in]``; any other tensor unchanged (still lazy, if it was)."""
    if name.endswith((".experts.gate_up_proj", ".experts.down_proj")):
        return name, materialize(tensor).transpose(1, 2).contiguous()
    return name, tensor


class Llama4ForCausalLM(CausalLM):
    """Llama 4 Scout / Maverick text: ``forward(input_ids, positions) -> hidden``; ``compute_logits``."""

    #: expert stacks are transposed whole; the rest reach the layers' loaders as they came
    reads_checkpoint_slices = True

    def __init__(self, config: ModelConfig, quant_config: QuantConfig | None = None, prefix: str = "") -> None:
        super().__init__()
        if (config.get("hidden_act") or "silu") != "silu":
            raise ValueError(
                f"fw_llama's Llama 4 supports hidden_act 'silu'; the config has {config.get('hidden_act')!r}"
            )
        self.config = config
        self.model = Llama4Model(config, quant_config, "model")
        self.init_lm_head(config, quant_config, tie_by_default=False)

    @staticmethod
    def map_weight_name(name: str) -> tuple[str, tuple | None]:
        return map_expert_weight_name(name)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        def relaid() -> Iterator[tuple[str, torch.Tensor]]:
            for name, tensor in weights:
                yield to_fused_moe_layout(name, tensor)

        return load_parameters(self, relaid())
