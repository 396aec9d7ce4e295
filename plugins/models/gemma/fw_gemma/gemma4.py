"""Gemma 4 text (``Gemma4ForCausalLM``): Gemma 3's layer with per-layer shapes, shared KV and
per-layer inputs.

| part | Gemma 4 |
| --- | --- |
| layers | ``layer_types``: sliding (``head_dim``, ``num_key_value_heads``, default RoPE) and global (``per_layer_config`` / ``global_head_dim``, proportional RoPE) |
| attention | scale 1; RMSNorm (``x * w``) on q and k per head, a weightless one on v; global layers with ``attention_k_eq_v`` take v from the key projection |
| shared KV | the last ``num_kv_shared_layers`` layers project only q and attend over the K/V of the last earlier layer of their type |
| feed-forward | GeGLU; twice as wide on the shared-KV layers with ``use_double_wide_mlp`` |
| per-layer inputs | ``embed_tokens_per_layer`` (token) + ``per_layer_model_projection`` (context), one ``hidden_size_per_layer_input`` slice per layer, gated into the residual after the MLP |
| layer output | times the checkpoint's ``layer_scalar`` |

A shared-KV layer stores its producer's keys and values in its own cache (the same numbers, so
prefix caching and preemption hold); the memory saving of one cache for both is not taken.
With ``enable_moe_block`` (gemma-4-26B-A4B) every layer adds a routed-experts branch beside its
MLP (``gemma4_moe.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from framework.config import ModelConfig
from framework.layers import (
    ColumnParallelLinear,
    GatedMLP,
    GeluTanhAndMul,
    QKVParallelLinear,
    ReplicatedLinear,
    RMSNorm,
    RowParallelLinear,
    VocabEmbedding,
    norm_per_head,
)
from framework.layers.attention import Attention
from framework.layers.causal_lm import CausalLM
from framework.layers.fused_moe import expert_weight_target
from framework.layers.rotary import get_rope
from framework.quantization import QuantConfig

from .gemma4_moe import Gemma4MoE, moe_weight_name, weightless_rms_norm
from .model import FULL, SLIDING, TANH_GELUS


@dataclass(frozen=True, slots=True)
class Gemma4Layer:
    """One layer's shape: ``kv_mode`` None (own K/V), ``"store"`` (own K/V, read by later
    layers of its type) or ``"reuse"`` (the K/V of ``kv_source``)."""

    layer_type: str
    head_size: int
    num_kv_heads: int
    k_eq_v: bool
    kv_mode: str | None
    kv_source: int | None
    mlp_width: int


def gemma4_layers(config: ModelConfig) -> list[Gemma4Layer]:
    """Every layer's :class:`Gemma4Layer`, as ``Gemma4TextConfig`` derives them."""
    num_layers = config.num_layers
    types = list(config.get("layer_types") or [SLIDING if (i + 1) % 6 else FULL for i in range(num_layers)])
    types[-1] = FULL  # transformers forces the last layer global
    per_layer = {int(k): v for k, v in (config.get("per_layer_config") or {}).items()}
    k_eq_v = bool(config.get("attention_k_eq_v", False))
    num_shared = int(config.get("num_kv_shared_layers") or 0)
    first_shared = num_layers - num_shared
    if num_shared and not set(types[first_shared:]) <= set(types[:first_shared]):
        raise ValueError("Gemma 4: every shared-KV layer needs an earlier layer of its type to share")
    producers = {t: max(i for i in range(first_shared) if types[i] == t) for t in set(types[:first_shared])}
    width = int(config.get("intermediate_size"))
    layers = []
    for i, layer_type in enumerate(types):
        shape = per_layer.get(i, {})
        if layer_type == FULL and i not in per_layer:
            shape = {"head_dim": config.get("global_head_dim") or 512}
            if k_eq_v and config.get("num_global_key_value_heads"):
                shape["num_key_value_heads"] = config.get("num_global_key_value_heads")
        reuse = i >= first_shared
        layers.append(
            Gemma4Layer(
                layer_type,
                int(shape.get("head_dim") or config.head_size),
                int(shape.get("num_key_value_heads") or config.num_kv_heads),
                k_eq_v and layer_type == FULL,
                "reuse" if reuse else "store" if producers.get(layer_type) == i else None,
                producers[layer_type] if reuse else None,
                width * (2 if reuse and config.get("use_double_wide_mlp") else 1),
            )
        )
    return layers


class Gemma4Attention(nn.Module):
    """q (k, v) projections -> per-head norms -> RoPE -> paged attention (scale 1) -> o_proj."""

    def __init__(
        self, config: ModelConfig, layer_index: int, layer: Gemma4Layer, quant_config: QuantConfig | None, prefix: str
    ) -> None:
        super().__init__()
        hidden, heads, head_size = config.hidden_size, config.num_heads, layer.head_size
        bias = bool(config.get("attention_bias", False))
        self.head_size, self.eps = head_size, float(config.get("rms_norm_eps") or 1e-6)
        self.reuses_kv = layer.kv_mode == "reuse"
        if self.reuses_kv:
            self.q_proj = ColumnParallelLinear(
                hidden, heads * head_size, bias=bias, quant_config=quant_config, prefix=f"{prefix}.q_proj"
            )
            num_heads, num_kv_heads = self.q_proj.output_size_per_partition // head_size, layer.num_kv_heads
        else:
            self.qkv_proj = QKVParallelLinear(
                hidden,
                head_size,
                heads,
                layer.num_kv_heads,
                bias=bias,
                quant_config=quant_config,
                prefix=f"{prefix}.qkv_proj",
            )
            num_heads, num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
            self.k_norm = RMSNorm(head_size, self.eps)
        self.q_size, self.kv_size = num_heads * head_size, num_kv_heads * head_size
        self.q_norm = RMSNorm(head_size, self.eps)
        self.o_proj = RowParallelLinear(
            heads * head_size, hidden, bias=bias, quant_config=quant_config, prefix=f"{prefix}.o_proj"
        )
        params = (config.get("rope_parameters") or {}).get(layer.layer_type) or {}
        is_proportional = params.get("rope_type") == "proportional"
        rotated = 2 * int(float(params.get("partial_rotary_factor") or 1.0) * head_size // 2)
        base = float(params.get("rope_theta") or (10_000.0 if layer.layer_type == SLIDING else 1_000_000.0))
        self.rotary_emb = get_rope(
            head_size, rotated if is_proportional else head_size, config.max_model_len, base, params or None
        )
        self.attn = Attention(
            layer_index,
            num_heads,
            num_kv_heads,
            head_size,
            1.0,
            sliding_window=config.get("sliding_window") if layer.layer_type == SLIDING else None,
            quant_config=quant_config,
            prefix=f"{prefix}.attn",
        )

    def forward(
        self, positions: torch.Tensor, hidden: torch.Tensor, shared_kv: tuple[torch.Tensor, torch.Tensor] | None
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """The attention output and this layer's ``(key, value)`` (a producer's, for a shared-KV layer)."""
        if self.reuses_kv:
            key, value = shared_kv
            unused_key = hidden.new_zeros(hidden.shape[0], self.head_size)  # the rotary op rotates a key too
            query, _ = self.rotary_emb(
                positions, norm_per_head(self.q_norm, self.q_proj(hidden), self.head_size), unused_key
            )
        else:
            query, key, value = self.qkv_proj(hidden).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
            query, key = self.rotary_emb.forward_with_qk_norm(positions, query, key, self.q_norm, self.k_norm)
            value = weightless_rms_norm(value.unflatten(-1, (-1, self.head_size)), self.eps).flatten(-2)
        return self.o_proj(self.attn(query, key, value)), (key, value)


class Gemma4DecoderLayer(nn.Module):
    """Attention and MLP (plus the MoE branch), each normalised before and after, added to the
    residual; then the per-layer input gated in; the whole layer output times ``layer_scalar``."""

    def __init__(
        self,
        config: ModelConfig,
        layer_index: int,
        layer: Gemma4Layer,
        quant_config: QuantConfig | None,
        prefix: str,
    ) -> None:
        super().__init__()
        hidden, eps = config.hidden_size, float(config.get("rms_norm_eps") or 1e-6)
        self.layer = layer
        self.self_attn = Gemma4Attention(config, layer_index, layer, quant_config, f"{prefix}.self_attn")
        self.mlp = GatedMLP(
            hidden, layer.mlp_width, GeluTanhAndMul(), quant_config=quant_config, prefix=f"{prefix}.mlp"
        )
        for name in ("input", "post_attention", "pre_feedforward", "post_feedforward"):
            setattr(self, f"{name}_layernorm", RMSNorm(hidden, eps))
        self.moe = None
        if config.get("enable_moe_block"):
            self.moe = Gemma4MoE(config, quant_config, f"{prefix}.moe")
            self.post_feedforward_layernorm_1 = RMSNorm(hidden, eps)
        self.per_layer_size = int(config.get("hidden_size_per_layer_input") or 0)
        if self.per_layer_size:
            self.per_layer_input_gate = ReplicatedLinear(
                hidden, self.per_layer_size, quant_config=quant_config, prefix=f"{prefix}.per_layer_input_gate"
            )
            self.per_layer_projection = ReplicatedLinear(
                self.per_layer_size, hidden, quant_config=quant_config, prefix=f"{prefix}.per_layer_projection"
            )
            self.post_per_layer_input_norm = RMSNorm(hidden, eps)
            self.gelu = nn.GELU(approximate="tanh")
        self.layer_scalar = nn.Parameter(torch.ones(1), requires_grad=False)

    def forward(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        per_layer_input: torch.Tensor | None,
        shared_kv: dict[str, tuple[torch.Tensor, torch.Tensor]],
    ) -> torch.Tensor:
        attended, kv = self.self_attn(positions, self.input_layernorm(hidden), shared_kv.get(self.layer.layer_type))
        if self.layer.kv_mode == "store":
            shared_kv[self.layer.layer_type] = kv
        hidden = hidden + self.post_attention_layernorm(attended)
        fed = self.mlp(self.pre_feedforward_layernorm(hidden))
        if self.moe is not None:  # the experts read the residual stream itself
            fed = self.post_feedforward_layernorm_1(fed) + self.moe(hidden)
        hidden = hidden + self.post_feedforward_layernorm(fed)
        if self.per_layer_size:
            gated = self.gelu(self.per_layer_input_gate(hidden)) * per_layer_input
            hidden = hidden + self.post_per_layer_input_norm(self.per_layer_projection(gated))
        return hidden * self.layer_scalar


def rounded_scale(value: float) -> float:
    """``value`` rounded to the model dtype, as transformers' scaled embeddings multiply by it."""
    return float(torch.tensor(value, device="cpu").to(torch.get_default_dtype()))


class Gemma4Model(nn.Module):
    def __init__(self, config: ModelConfig, quant_config: QuantConfig | None, prefix: str) -> None:
        super().__init__()
        hidden, num_layers = config.hidden_size, config.num_layers
        self.embed_tokens = VocabEmbedding(
            config.vocab_size, hidden, quant_config=quant_config, prefix=f"{prefix}.embed_tokens"
        )
        self.embed_scale = rounded_scale(hidden**0.5)
        self.layer_shapes = gemma4_layers(config)
        self.layers = nn.ModuleList(
            Gemma4DecoderLayer(config, i, shape, quant_config, f"{prefix}.layers.{i}")
            for i, shape in enumerate(self.layer_shapes)
        )
        self.norm = RMSNorm(hidden, float(config.get("rms_norm_eps") or 1e-6))
        self.per_layer_size = size = int(config.get("hidden_size_per_layer_input") or 0)
        if size:
            vocab = int(config.get("vocab_size_per_layer_input") or config.vocab_size)
            self.embed_tokens_per_layer = VocabEmbedding(
                vocab, num_layers * size, quant_config=quant_config, prefix=f"{prefix}.embed_tokens_per_layer"
            )
            self.per_layer_embed_scale = rounded_scale(size**0.5)
            self.per_layer_model_projection = ReplicatedLinear(
                hidden, num_layers * size, quant_config=quant_config, prefix=f"{prefix}.per_layer_model_projection"
            )
            self.per_layer_projection_norm = RMSNorm(size, float(config.get("rms_norm_eps") or 1e-6))

    def per_layer_inputs(self, input_ids: torch.Tensor, embeds: torch.Tensor) -> torch.Tensor:
        """``[T, layers, size]``: (normalised context projection + token embedding) / sqrt(2)."""
        shape = (input_ids.shape[0], len(self.layers), self.per_layer_size)
        tokens = (self.embed_tokens_per_layer(input_ids) * self.per_layer_embed_scale).view(shape)
        context = self.per_layer_model_projection(embeds) * embeds.shape[-1] ** -0.5
        return (self.per_layer_projection_norm(context.view(shape)) + tokens) * 2.0**-0.5

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids) * self.embed_scale
        per_layer = self.per_layer_inputs(input_ids, hidden) if self.per_layer_size else None
        shared_kv: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        for i, layer in enumerate(self.layers):
            hidden = layer(positions, hidden, None if per_layer is None else per_layer[:, i], shared_kv)
        return self.norm(hidden)


class Gemma4ForCausalLM(CausalLM):
    """Gemma 4 text (E2B / E4B / 31B, 26B-A4B MoE): ``forward(input_ids, positions) -> hidden``; ``compute_logits``."""

    #: tensors reach the layers' loaders as they came (lazy ones read only where used)
    reads_checkpoint_slices = True

    def __init__(self, config: ModelConfig, quant_config: QuantConfig | None = None, prefix: str = "") -> None:
        super().__init__()
        act = config.get("hidden_activation") or TANH_GELUS[0]
        if act not in TANH_GELUS:
            raise ValueError(f"fw_gemma's Gemma 4 supports hidden_activation {' or '.join(TANH_GELUS)}; got {act!r}")
        if config.get("use_bidirectional_attention") == "all":
            raise ValueError("fw_gemma serves causal Gemma 4; use_bidirectional_attention='all' is not supported")
        self.config = config
        self.model = Gemma4Model(config, quant_config, "model")
        self.init_lm_head(config, quant_config, tie_by_default=True)
        self.final_logit_softcapping = config.get("final_logit_softcapping")

    def map_weight_name(self, name: str) -> tuple[str, tuple | None]:
        """Expert stacks go to FusedMoE's parameters; a shared-KV layer's ``q_proj`` is its own
        layer, not a shard of a fused ``qkv_proj``."""
        if (target := expert_weight_target(name)) is not None:
            return target
        parts = name.split(".")
        if len(parts) > 4 and parts[1] == "layers" and parts[4] == "q_proj":
            if self.model.layer_shapes[int(parts[2])].kv_mode == "reuse":
                return name, ()
        return name, None

    def load_weights(self, weights) -> set[str]:
        from framework.loader.model_loader import load_parameters

        return load_parameters(self, gemma4_text_weights(self.model.layer_shapes, weights))

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden)
        if self.final_logit_softcapping:
            cap = self.final_logit_softcapping
            logits = torch.tanh(logits / cap) * cap
        return logits


def gemma4_text_weights(layers: list[Gemma4Layer], weights):
    """The checkpoint's tensors as the model's layers take them: a ``k_eq_v`` layer's key
    projection also fills its value rows; a shared-KV layer's K/V tensors (which some
    checkpoints keep) are dropped; the MoE branch's tensors move under the layer's ``moe``."""
    for name, tensor in weights:
        name = moe_weight_name(name)
        parts = name.split(".")
        if len(parts) > 4 and parts[1] == "layers" and parts[3] == "self_attn":
            layer = layers[int(parts[2])]
            if layer.kv_mode == "reuse" and parts[4] in ("k_proj", "v_proj", "k_norm", "v_norm"):
                continue
            if layer.k_eq_v and parts[4] == "k_proj":
                yield name.replace(".k_proj.", ".v_proj."), tensor
        yield name, tensor
