"""The Llama family as one implementation with config switches (:class:`LlamaVariant`).

| switch | Llama | Mistral | Qwen2 | Qwen3 | Phi-3 / Phi-4 | StableLM | GLM | GLM-4 (0414) |
| --- | --- | --- | --- | --- | --- | --- | --- | --- |
| bias on q/k/v | ``attention_bias`` | no | yes | ``attention_bias`` | no | ``use_qkv_bias`` | ``attention_bias`` | same |
| QK norm | no | no | no | RMSNorm per head | no | ``qk_layernorm`` (a LayerNorm per head) | no | no |
| norms | RMSNorm | RMSNorm | RMSNorm | RMSNorm | RMSNorm | LayerNorm with bias | RMSNorm | 4 per layer |
| residual | sequential | sequential | sequential | sequential | sequential | ``use_parallel_residual`` | sequential | sequential |
| rotary | full, NeoX | full | full | full | partial, LongRoPE | partial | partial, interleaved | same |
| sliding window | no | every layer | per ``layer_types`` | per ``layer_types`` | every layer | no | no | no |

Phi-3 and GLM checkpoints store fused ``qkv_proj`` / ``gate_up_proj`` tensors, which the fused
layers load whole; the others store ``q_proj`` ... ``up_proj``, folded by ``packed_modules_mapping``.
The mixture-of-experts members (Mixtral, Qwen2-MoE, Qwen3-MoE, ``moe.py``; GLM-4.5, ``glm4_moe.py``)
reuse this decoder (their attention variant comes from their architecture name) and swap its
feed-forward through ``LlamaModel(make_mlp=...)``.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from framework.config import ModelConfig
from framework.distributed import get_tp_size
from framework.layers import (
    LayerNorm,
    QKVParallelLinear,
    RMSNorm,
    RowParallelLinear,
    VocabEmbedding,
    norm_per_head,
    residual_norm,
    set_weight_attrs,
)
from framework.layers.attention import Attention
from framework.layers.causal_lm import CausalLM, DecoderStack
from framework.layers.linear import load_column_shard
from framework.layers.mlp import MLPFactory, dense_mlp
from framework.layers.rotary import get_rope
from framework.quantization import QuantConfig

from .per_head_norm import PER_HEAD_NORM, PerHeadLayerNorm

GLM_ARCHITECTURES = ("GlmForCausalLM", "Glm4ForCausalLM")
#: Architectures whose attention has q/k/v bias regardless of ``attention_bias`` (the MoE ones
#: are served elsewhere but build their attention from :class:`LlamaAttention`).
QKV_BIAS_ARCHITECTURES = ("Qwen2ForCausalLM", "Qwen2MoeForCausalLM")
#: Architectures with Qwen3's QK norm: one RMSNorm over ``head_size`` for all heads of q, one for k
#: (GLM-4.5's MoE: where ``use_qk_norm`` says so).
QK_RMS_NORM_ARCHITECTURES = ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM")
#: GLM-4.5 / 4.6 / 4.7 (``glm4_moe.py``): q/k/v bias per ``attention_bias`` but none on o_proj, and,
#: unlike the dense GLMs, rotary on halves of the first ``partial_rotary_factor`` of each head.
GLM4_MOE = "Glm4MoeForCausalLM"
#: Architectures whose QK norm is one RMSNorm over all of q's features (every head), one over k's.
QK_RMS_NORM_ACROSS_HEADS_ARCHITECTURES = ("MiniMaxM2ForCausalLM",)


@dataclass(frozen=True, slots=True)
class LlamaVariant:
    """What tells one family member from another (the table in the module docstring).

    ``qk_norm``: ``None``, ``"rms"`` (one RMSNorm over ``head_size`` shared by all heads, Qwen3),
    ``"rms_across_heads"`` (one RMSNorm over all ``heads * head_size`` features, MiniMax-M2; not
    shardable) or ``"layer_per_head"`` (a LayerNorm per head, StableLM 2 12B). ``norm``: ``"rms"`` or
    ``"layer"``. ``attention_sinks``: a learned sink logit per head (``self_attn.sinks``, gpt-oss).
    ``branch_norms``: normalise the attention and MLP outputs before each residual
    add (GLM-4). ``parallel_residual``: ``x + attn(norm(x)) + mlp(norm(x))`` (StableLM).
    """

    qkv_bias: bool
    o_proj_bias: bool
    qk_norm: str | None
    norm: str
    eps: float
    branch_norms: bool
    parallel_residual: bool
    is_neox_style: bool
    attention_sinks: bool = False

    @classmethod
    def from_config(cls, config: ModelConfig) -> LlamaVariant:
        arch = config.architecture
        is_stablelm, is_glm = arch == "StableLmForCausalLM", arch in GLM_ARCHITECTURES
        attention_bias = bool(config.get("attention_bias", False))
        act = config.get("hidden_act") or "silu"
        if act != "silu":
            raise ValueError(f"fw_llama supports hidden_act 'silu'; {arch} config has {act!r}")
        return cls(
            qkv_bias=attention_bias
            or arch in QKV_BIAS_ARCHITECTURES
            or (is_stablelm and bool(config.get("use_qkv_bias"))),
            o_proj_bias=attention_bias and not is_glm and arch != GLM4_MOE,
            qk_norm="rms"
            if arch in QK_RMS_NORM_ARCHITECTURES or (arch == GLM4_MOE and config.get("use_qk_norm"))
            else "rms_across_heads"
            if arch in QK_RMS_NORM_ACROSS_HEADS_ARCHITECTURES
            else "layer_per_head"
            if is_stablelm and config.get("qk_layernorm")
            else None,
            norm="layer" if is_stablelm else "rms",
            eps=float(config.get("layer_norm_eps") or 1e-5)
            if is_stablelm
            else float(config.get("rms_norm_eps") or 1e-6),
            branch_norms=arch == "Glm4ForCausalLM",
            parallel_residual=is_stablelm and bool(config.get("use_parallel_residual")),
            is_neox_style=not is_glm,
            attention_sinks=arch == "GptOssForCausalLM",
        )

    def make_norm(self, size: int) -> nn.Module:
        return LayerNorm(size, self.eps) if self.norm == "layer" else RMSNorm(size, self.eps)


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


def rotary_dim(config: ModelConfig) -> int:
    """Features per head that rotate: ``head_size * partial_rotary_factor`` (transformers 5 keeps
    the factor in ``rope_parameters``, older configs at the top level), else ``rotary_dim``
    (MiniMax-M2's own configs), else all of them."""
    factor = config.rope_parameters.get("partial_rotary_factor") or config.get("partial_rotary_factor")
    if factor is None and config.get("rotary_dim"):
        return int(config.get("rotary_dim"))
    return int(config.head_size * float(factor or 1.0))


def rope_scaling(config: ModelConfig) -> dict[str, Any] | None:
    """The config's rope scaling, with Phi-3's LongRoPE completed as transformers reads it.

    Phi-3 configs name LongRoPE ``su`` (or ``yarn``, which ``Phi3Config`` also turns into
    ``longrope``) and keep ``original_max_position_embeddings`` at the top level; the default
    ``factor`` (which sets the attention scaling) is ``max_position_embeddings / original``
    of the checkpoint, not of a shorter ``--max-model-len``.
    """
    scaling = config.rope_scaling
    if scaling is None:
        return None
    kind = scaling["rope_type"]
    if kind == "su" or (kind == "yarn" and config.architecture == "Phi3ForCausalLM"):
        kind = "longrope"
    if kind != "longrope":
        return scaling
    original = scaling.get("original_max_position_embeddings") or config.get("original_max_position_embeddings")
    if not original:
        raise ValueError("longrope rope scaling needs original_max_position_embeddings in the model config")
    factor = scaling.get("factor") or int(config.get("max_position_embeddings") or config.max_model_len) / int(original)
    return {**scaling, "rope_type": "longrope", "original_max_position_embeddings": int(original), "factor": factor}


class LlamaAttention(nn.Module):
    """Fused QKV projection -> optional QK norm -> rotary (full or partial) -> paged attention
    (with gpt-oss's per-head sinks) -> o_proj."""

    def __init__(
        self,
        config: ModelConfig,
        layer_index: int,
        quant_config: QuantConfig | None,
        prefix: str,
        variant: LlamaVariant | None = None,
    ) -> None:
        super().__init__()
        variant = variant or LlamaVariant.from_config(config)
        hidden, head_size = config.hidden_size, config.head_size
        self.head_size = head_size
        self.qkv_proj = QKVParallelLinear(
            hidden,
            head_size,
            config.num_heads,
            config.num_kv_heads,
            bias=variant.qkv_bias,
            quant_config=quant_config,
            prefix=f"{prefix}.qkv_proj",
        )
        # this tensor-parallel rank's heads (all of them on one device)
        num_heads, num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.q_size, self.kv_size = num_heads * head_size, num_kv_heads * head_size
        self.o_proj = RowParallelLinear(
            config.num_heads * head_size,
            hidden,
            bias=variant.o_proj_bias,
            quant_config=quant_config,
            prefix=f"{prefix}.o_proj",
        )
        self.rotary_emb = get_rope(
            head_size,
            rotary_dim(config),
            config.max_model_len,
            config.rope_theta,
            rope_scaling(config),
            is_neox_style=variant.is_neox_style,
        )
        self.attn = Attention(
            layer_index,
            num_heads,
            num_kv_heads,
            head_size,
            head_size**-0.5,
            sliding_window=layer_sliding_window(config, layer_index),
            has_sinks=variant.attention_sinks,
            quant_config=quant_config,
            prefix=f"{prefix}.attn",
        )
        self.sinks = None
        if variant.attention_sinks:  # this rank's heads of the checkpoint's [num_heads] sinks
            self.sinks = nn.Parameter(torch.empty(num_heads), requires_grad=False)
            loader = functools.partial(load_column_shard, tp_rank=self.qkv_proj.tp_rank)
            set_weight_attrs(self.sinks, {"weight_loader": loader, "output_dim": 0})
        self.q_norm = self.k_norm = None
        self.qk_norm_across_heads = variant.qk_norm == "rms_across_heads"
        if variant.qk_norm == "rms":  # Qwen3: checkpoint names q_norm / k_norm
            self.q_norm, self.k_norm = RMSNorm(head_size, variant.eps), RMSNorm(head_size, variant.eps)
        elif self.qk_norm_across_heads:  # MiniMax-M2: the statistics span every head
            if self.qkv_proj.tp_size > 1:
                raise ValueError(f"{config.architecture}: its QK norm spans all heads; run it with --tp 1")
            self.q_norm, self.k_norm = RMSNorm(self.q_size, variant.eps), RMSNorm(self.kv_size, variant.eps)
        elif variant.qk_norm == "layer_per_head":  # StableLM: q_layernorm / k_layernorm, this rank's heads
            qkv = self.qkv_proj
            self.q_layernorm = PerHeadLayerNorm(
                num_heads, head_size, variant.eps, qkv.tp_rank * num_heads, config.num_heads
            )
            self.k_layernorm = PerHeadLayerNorm(
                num_kv_heads, head_size, variant.eps, qkv.first_kv_head, config.num_kv_heads
            )
            self.q_norm, self.k_norm = self.q_layernorm, self.k_layernorm

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv_proj(hidden).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        if self.qk_norm_across_heads:  # MiniMax-M2: q and k normalised whole, then RoPE
            q, k = self.rotary_emb(positions, self.q_norm(q), self.k_norm(k))
        elif isinstance(self.q_norm, RMSNorm):  # Qwen3: per-head RMS norm and RoPE in one op
            q, k = self.rotary_emb.forward_with_qk_norm(positions, q, k, self.q_norm, self.k_norm)
        else:
            if self.q_norm is not None:  # StableLM: per-head LayerNorm, before RoPE
                q, k = norm_per_head(self.q_norm, q, self.head_size), norm_per_head(self.k_norm, k, self.head_size)
            q, k = self.rotary_emb(positions, q, k)
        return self.o_proj(self.attn(q, k, v, self.sinks))


class LlamaDecoderLayer(nn.Module):
    """``x + attn(norm(x))``, then ``+ mlp(norm(.))``; the residual stream travels beside the
    hidden state so each add fuses into the next norm. GLM-4 also normalises each branch's
    output; StableLM's parallel residual feeds one normalised input to both branches.
    ``make_mlp`` swaps the feed-forward (MoE models)."""

    def __init__(
        self,
        config: ModelConfig,
        layer_index: int,
        quant_config: QuantConfig | None,
        prefix: str,
        make_mlp: MLPFactory = dense_mlp,
    ) -> None:
        super().__init__()
        variant = LlamaVariant.from_config(config)
        hidden = config.hidden_size
        self.self_attn = LlamaAttention(config, layer_index, quant_config, f"{prefix}.self_attn", variant)
        self.mlp = make_mlp(config, layer_index, quant_config, f"{prefix}.mlp")
        self.input_layernorm = variant.make_norm(hidden)
        self.parallel_residual = variant.parallel_residual
        if not self.parallel_residual:
            self.post_attention_layernorm = variant.make_norm(hidden)
        self.branch_norms = variant.branch_norms
        if self.branch_norms:  # GLM-4's names
            self.post_self_attn_layernorm = variant.make_norm(hidden)
            self.post_mlp_layernorm = variant.make_norm(hidden)

    @property
    def can_defer_all_reduce(self) -> bool:
        """Whether both branches can leave their tensor-parallel all-reduce to the norm after them:
        a sequential residual, no branch norms, RMSNorms, and an MLP with ``reduce_results``."""
        return (
            not self.parallel_residual
            and not self.branch_norms
            and isinstance(self.input_layernorm, RMSNorm)
            and hasattr(self.mlp, "reduce_results")
        )

    def defer_all_reduce(self) -> None:
        """The attention and the MLP return partial sums; the next norms (this layer's
        post-attention norm, the next layer's input norm, the model's final norm) all-reduce them
        with the residual add and the norm (:func:`framework.distributed.all_reduce_add_rms_norm`)."""
        self.self_attn.o_proj.reduce_results = False
        self.mlp.reduce_results = False
        # the first layer's input norm gets the embeddings and no residual: it does not reduce
        self.input_layernorm.reduces_input = self.post_attention_layernorm.reduces_input = True

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None):
        hidden, residual = residual_norm(self.input_layernorm, hidden, residual)
        if self.parallel_residual:
            return self.self_attn(positions, hidden) + self.mlp(hidden), residual
        hidden = self.self_attn(positions, hidden)
        if self.branch_norms:
            hidden = self.post_self_attn_layernorm(hidden)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        hidden = self.mlp(hidden)
        if self.branch_norms:
            hidden = self.post_mlp_layernorm(hidden)
        return hidden, residual


class LlamaModel(DecoderStack):
    def __init__(
        self, config: ModelConfig, quant_config: QuantConfig | None, prefix: str, make_mlp: MLPFactory = dense_mlp
    ) -> None:
        super().__init__()
        self.embed_tokens = VocabEmbedding(
            config.vocab_size, config.hidden_size, quant_config=quant_config, prefix=f"{prefix}.embed_tokens"
        )
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, i, quant_config, f"{prefix}.layers.{i}", make_mlp)
            for i in range(config.num_layers)
        )
        self.norm = LlamaVariant.from_config(config).make_norm(config.hidden_size)
        if get_tp_size() > 1 and all(layer.can_defer_all_reduce for layer in self.layers):
            for layer in self.layers:
                layer.defer_all_reduce()
            self.norm.reduces_input = True  # the last layer's MLP output is a partial sum


class LlamaForCausalLM(CausalLM):
    """``forward(input_ids, positions) -> hidden``; ``compute_logits(hidden) -> logits``."""

    def __init__(self, config: ModelConfig, quant_config: QuantConfig | None = None, prefix: str = "") -> None:
        super().__init__()
        self.config = config
        self.model = LlamaModel(config, quant_config, "model")
        self.init_lm_head(config, quant_config, tie_by_default=False)

    @staticmethod
    def map_weight_name(name: str) -> tuple[str, tuple | None]:
        """StableLM's per-head QK norm weights go to their row of :class:`PerHeadLayerNorm`'s
        stacked ``weight``; the rest folds through ``packed_modules_mapping``."""
        if (match := PER_HEAD_NORM.match(name)) is not None:
            return f"{match['norm']}.weight", (int(match["head"]),)
        return name, None
