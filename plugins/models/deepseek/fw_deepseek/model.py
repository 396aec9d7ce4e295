"""DeepSeek-V2 / V2-Lite: multi-head latent attention (MLA) over a compressed KV cache, then a
dense MLP (the first ``first_k_dense_replace`` layers) or DeepSeek MoE (:mod:`fw_deepseek.moe`).

MLA per token (``H`` heads, ``L = kv_lora_rank``, ``R = qk_rope_head_dim``, ``N = qk_nope_head_dim``,
``V = v_head_dim``)::

    q            = q_proj(x)  or  q_b_proj(q_a_layernorm(q_a_proj(x)))     [H, N + R]  (V2-Lite: no q_lora_rank)
    c_kv, k_pe   = kv_a_proj_with_mqa(x)                                  [L], [R]    (k_pe shared by all heads)
    c_kv         = kv_a_layernorm(c_kv);  q_pe, k_pe = rope(q_pe, k_pe)    (interleaved pairs, YaRN for long context)
    kv_b_proj.weight viewed [H, N + V, L] = [W_UK ; W_UV]

The cache stores ``[c_kv, k_pe]`` (L + R numbers per token and layer, the ``"mla"`` KV layout)
instead of H * (N + R + V) for expanded keys and values. Attention runs absorbed: per head
``q_lat = q_nope @ W_UK`` (so ``q_lat . c_kv = q_nope . k_nope``), scores ``[q_lat, q_pe] .
[c_kv, k_pe]``, the attention-weighted ``c_kv`` goes out through ``W_UV`` and ``o_proj``. The
softmax scale is ``(N + R)^-0.5``, times ``mscale(factor, mscale_all_dim)^2`` under YaRN, as in
transformers' ``yarn_apply_mscale``.

Tensor parallelism: the dense MLPs, the routed experts and the shared experts are split along
their intermediate features (one all-reduce per MLP or MoE block). The attention heads are split:
``q_proj`` / ``q_b_proj`` and ``kv_b_proj`` are column-parallel (a rank computes ``H / tp`` heads)
and ``o_proj`` is row-parallel (one all-reduce); ``q_a_proj`` and ``kv_a_proj_with_mqa`` are
replicated, so every rank caches the full latent (it is shared by all heads). The vocabulary is
split as in every model.
``kv_b_proj``'s weight is absorbed into the attention, never multiplied as a linear layer: a
quantized ``kv_b_proj`` (block-FP8 DeepSeek-V3/R1 checkpoints) is dequantized once after loading
(``init_buffers``), and a quantization method that cannot dequantize is refused at start-up.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from framework import distributed
from framework.attention_backend import MLAConfig
from framework.config import ModelConfig
from framework.distributed.partition import attention_heads_per_rank
from framework.errors import ConfigError
from framework.layers import (
    ColumnParallelLinear,
    LinearMethod,
    ReplicatedLinear,
    RMSNorm,
    RowParallelLinear,
    UnquantizedLinearMethod,
    VocabEmbedding,
    residual_norm,
)
from framework.layers.attention import Attention
from framework.layers.causal_lm import CausalLM, DecoderStack
from framework.layers.fused_moe import map_expert_weight_name
from framework.layers.mlp import MLPFactory, dense_mlp
from framework.layers.rotary import get_rope, yarn_get_mscale
from framework.quantization import QuantConfig
from fw_deepseek.moe import DeepseekV2MoE


def softmax_scale(config: ModelConfig, qk_head_dim: int) -> float:
    """``qk_head_dim^-0.5``, times ``mscale^2`` when rope scaling sets ``mscale_all_dim`` (DeepSeek YaRN)."""
    scale = qk_head_dim**-0.5
    scaling = config.rope_scaling
    if scaling and scaling.get("mscale_all_dim"):
        mscale = yarn_get_mscale(float(scaling["factor"]), float(scaling["mscale_all_dim"]))
        scale *= mscale * mscale
    return scale


class DeepseekV2Attention(nn.Module):
    """Multi-head latent attention with absorbed ``W_UK`` / ``W_UV`` over the ``"mla"`` KV cache."""

    def __init__(
        self,
        config: ModelConfig,
        layer_index: int,
        quant_config: QuantConfig | None,
        prefix: str,
        *,
        is_sparse: bool = False,
        index_head_dim: int = 0,
    ) -> None:
        """``is_sparse`` / ``index_head_dim``: a DeepSeek-Sparse-Attention layer (see :mod:`fw_deepseek.dsa`)."""
        super().__init__()
        # this rank's heads; the latent is one KV "head" that every rank keeps (replicated)
        heads = attention_heads_per_rank(config.num_heads, 1, distributed.get_tp_size())
        hidden, self.num_heads = config.hidden_size, heads.num_heads
        self.q_lora_rank = config.get("q_lora_rank")
        self.kv_lora_rank = int(config.get("kv_lora_rank"))
        self.nope_dim, self.rope_dim = int(config.get("qk_nope_head_dim")), int(config.get("qk_rope_head_dim"))
        self.v_dim = int(config.get("v_head_dim"))
        qk_head_dim = self.nope_dim + self.rope_dim
        bias = bool(config.get("attention_bias", False))
        linear = dict(quant_config=quant_config)
        if self.q_lora_rank:
            self.q_a_proj = ReplicatedLinear(hidden, self.q_lora_rank, bias=bias, prefix=f"{prefix}.q_a_proj", **linear)
            self.q_a_layernorm = RMSNorm(self.q_lora_rank, 1e-6)
            self.q_b_proj = ColumnParallelLinear(
                self.q_lora_rank, config.num_heads * qk_head_dim, bias=False, prefix=f"{prefix}.q_b_proj", **linear
            )
        else:
            self.q_proj = ColumnParallelLinear(
                hidden, config.num_heads * qk_head_dim, bias=False, prefix=f"{prefix}.q_proj", **linear
            )
        self.kv_a_proj_with_mqa = ReplicatedLinear(
            hidden, self.kv_lora_rank + self.rope_dim, bias=bias, prefix=f"{prefix}.kv_a_proj_with_mqa", **linear
        )
        self.kv_a_layernorm = RMSNorm(self.kv_lora_rank, 1e-6)
        self.kv_b_proj = ColumnParallelLinear(
            self.kv_lora_rank,
            config.num_heads * (self.nope_dim + self.v_dim),
            bias=False,
            prefix=f"{prefix}.kv_b_proj",
            **linear,
        )
        self.o_proj = RowParallelLinear(
            config.num_heads * self.v_dim, hidden, bias=bias, prefix=f"{prefix}.o_proj", **linear
        )
        self.rotary_emb = get_rope(
            self.rope_dim,
            self.rope_dim,
            config.max_model_len,
            config.rope_theta,
            config.rope_scaling,
            is_neox_style=not config.get("rope_interleave", True),  # V2 always interleaves
        )
        mla = MLAConfig(self.kv_lora_rank, self.rope_dim, is_sparse, index_head_dim)
        self.attn = Attention(
            layer_index,
            self.num_heads,
            1,
            mla.latent_size,
            softmax_scale(config, qk_head_dim),
            mla=mla,
            quant_config=quant_config,
            prefix=f"{prefix}.attn",
        )
        method = self.kv_b_proj.linear_method
        self.kv_b_is_quantized = not isinstance(method, UnquantizedLinearMethod)
        if self.kv_b_is_quantized and type(method).dequantize is LinearMethod.dequantize:
            raise ConfigError(
                f"{prefix}.kv_b_proj: multi-head latent attention absorbs kv_b_proj's weight, so a quantized "
                f"kv_b_proj must dequantize; {type(method).__name__} cannot: use a checkpoint (or quantization "
                "method) that keeps kv_b_proj unquantized or can dequantize it"
            )
        if self.kv_b_is_quantized:  # filled by init_buffers, once the quant method has processed the weight
            self.register_buffer("kv_b_dequantized", None, persistent=False)

    def init_buffers(self, device: torch.device | str) -> None:
        """A quantized ``kv_b_proj``: its weight dequantized once, in the model dtype (this rank's heads)."""
        if self.kv_b_is_quantized:
            self.kv_b_dequantized = self.kv_b_proj.linear_method.dequantize(self.kv_b_proj).to(device)

    def kv_b_weight(self) -> torch.Tensor:
        """``kv_b_proj``'s weight viewed as ``[H, N + V, L]`` (= ``[W_UK ; W_UV]`` per head; this rank's heads)."""
        weight = self.kv_b_dequantized if self.kv_b_is_quantized else self.kv_b_proj.weight
        return weight.view(self.num_heads, self.nope_dim + self.v_dim, self.kv_lora_rank)

    def select_tokens(
        self, positions: torch.Tensor, hidden: torch.Tensor, q_resid: torch.Tensor | None
    ) -> torch.Tensor | None:
        """The ``topk_indices`` a sparse layer attends to (``q_resid``: ``q_a_layernorm(q_a_proj(x))``);
        ``None``: dense MLA, every earlier token."""
        return None

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        num_tokens = hidden.shape[0]
        q_resid = None
        if self.q_lora_rank:
            q_resid = self.q_a_layernorm(self.q_a_proj(hidden))
            q = self.q_b_proj(q_resid)
        else:
            q = self.q_proj(hidden)
        topk_indices = self.select_tokens(positions, hidden, q_resid)
        q_nope, q_pe = q.view(num_tokens, self.num_heads, -1).split([self.nope_dim, self.rope_dim], dim=-1)
        c_kv, k_pe = self.kv_a_proj_with_mqa(hidden).split([self.kv_lora_rank, self.rope_dim], dim=-1)
        c_kv = self.kv_a_layernorm(c_kv.contiguous())
        q_pe, k_pe = self.rotary_emb(positions, q_pe.contiguous(), k_pe.contiguous().view(num_tokens, 1, self.rope_dim))
        w_uk, w_uv = self.kv_b_weight().split([self.nope_dim, self.v_dim], dim=1)  # [H, N, L], [H, V, L]
        q_latent = torch.einsum("thn,hnl->thl", q_nope, w_uk)
        query = torch.cat((q_latent, q_pe.view(num_tokens, self.num_heads, self.rope_dim)), dim=-1)
        latent = torch.cat((c_kv, k_pe.view(num_tokens, self.rope_dim)), dim=-1)
        out_latent = self.attn(query.flatten(1), latent, None, topk_indices=topk_indices).view(
            num_tokens, self.num_heads, self.kv_lora_rank
        )
        out = torch.einsum("thl,hvl->thv", out_latent, w_uv)
        return self.o_proj(out.flatten(1))


#: ``(config, layer_index, quant_config, prefix) -> attention module`` (``forward(positions, hidden)``)
AttentionFactory = Callable[[ModelConfig, int, "QuantConfig | None", str], nn.Module]


def is_moe_layer(config: ModelConfig, layer_index: int) -> bool:
    """MoE from ``first_k_dense_replace`` on, every ``moe_layer_freq``-th layer (DeepSeek's rule)."""
    if not config.get("n_routed_experts"):
        return False
    first_dense = int(config.get("first_k_dense_replace") or 0)
    return layer_index >= first_dense and layer_index % int(config.get("moe_layer_freq") or 1) == 0


def deepseek_v2_mlp(config: ModelConfig, layer_index: int, quant_config: QuantConfig | None, prefix: str) -> nn.Module:
    """A layer's feed-forward: DeepSeek-V2 MoE on MoE layers (:func:`is_moe_layer`), else a dense SwiGLU."""
    if is_moe_layer(config, layer_index):
        return DeepseekV2MoE(config, quant_config, prefix)
    return dense_mlp(config, layer_index, quant_config, prefix)


class DeepseekV2DecoderLayer(nn.Module):
    """MLA (``make_attention``: dense, or DeepSeek Sparse Attention), then the feed-forward
    ``make_mlp`` builds (the V2 MoE, V3's grouped top-k MoE, or dense)."""

    def __init__(
        self,
        config: ModelConfig,
        layer_index: int,
        quant_config: QuantConfig | None,
        prefix: str,
        make_mlp: MLPFactory = deepseek_v2_mlp,
        make_attention: AttentionFactory = DeepseekV2Attention,
    ) -> None:
        super().__init__()
        eps = float(config.get("rms_norm_eps", 1e-6))
        if (config.get("hidden_act") or "silu") != "silu":
            raise ValueError(f"DeepSeek-V2 with hidden_act {config.get('hidden_act')!r} is unsupported; valid: silu")
        self.self_attn = make_attention(config, layer_index, quant_config, f"{prefix}.self_attn")
        self.mlp = make_mlp(config, layer_index, quant_config, f"{prefix}.mlp")
        self.input_layernorm = RMSNorm(config.hidden_size, eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None):
        hidden, residual = residual_norm(self.input_layernorm, hidden, residual)
        hidden = self.self_attn(positions, hidden)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class DeepseekV2Model(DecoderStack):
    def __init__(
        self,
        config: ModelConfig,
        quant_config: QuantConfig | None,
        prefix: str,
        make_mlp: MLPFactory = deepseek_v2_mlp,
        make_attention: AttentionFactory = DeepseekV2Attention,
    ) -> None:
        super().__init__()
        self.embed_tokens = VocabEmbedding(
            config.vocab_size, config.hidden_size, quant_config=quant_config, prefix=f"{prefix}.embed_tokens"
        )
        self.layers = nn.ModuleList(
            DeepseekV2DecoderLayer(config, i, quant_config, f"{prefix}.layers.{i}", make_mlp, make_attention)
            for i in range(config.num_layers)
        )
        self.norm = RMSNorm(config.hidden_size, float(config.get("rms_norm_eps", 1e-6)))


class DeepseekV2ForCausalLM(CausalLM):
    """``forward(input_ids, positions) -> hidden``; ``compute_logits(hidden) -> logits``."""

    #: Only gate/up fold (dense MLPs, experts, shared experts); q_proj is not part of a fused qkv here.
    packed_modules_mapping = {"gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}

    #: The feed-forward of each layer (DeepSeek-V3 swaps in its router).
    make_mlp: MLPFactory = staticmethod(deepseek_v2_mlp)

    def __init__(self, config: ModelConfig, quant_config: QuantConfig | None = None, prefix: str = "") -> None:
        super().__init__()
        self.config = config
        self.model = DeepseekV2Model(config, quant_config, "model", self.make_mlp, self.attention_factory(config))
        self.init_lm_head(config, quant_config, tie_by_default=False)

    def attention_factory(self, config: ModelConfig) -> AttentionFactory:
        """What builds each layer's attention (DeepSeek-V3.2 and GLM-5 build sparse MLA)."""
        return DeepseekV2Attention

    #: Routed-expert tensors go to the stacked FusedMoE weights; the rest folds through
    #: ``packed_modules_mapping`` (shared experts and dense MLPs included).
    map_weight_name = staticmethod(map_expert_weight_name)
