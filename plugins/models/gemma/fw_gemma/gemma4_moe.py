"""Gemma 4's mixture-of-experts branch (``enable_moe_block``: gemma-4-26B-A4B), beside the dense MLP
of every layer::

    h = x after attention (the residual stream)
    out = post_ffn_norm( post_ffn_norm_1(mlp(pre_ffn_norm(h))) + post_ffn_norm_2(experts(pre_ffn_norm_2(h))) )

The router reads ``h`` itself: ``rms(h) * scale / sqrt(hidden)`` -> ``proj`` -> softmax -> top-k,
renormalised, each weight times its expert's ``per_expert_scale``. The experts are GeGLU
(``FusedMoE(activation="gelu_tanh")``), stored as transformers 5 stacks them
(``experts.gate_up_proj [E, 2I, H]``, ``experts.down_proj [E, H, I]``).

Checkpoints keep the branch's tensors on the layer (``layers.{i}.router.proj.weight``,
``layers.{i}.experts.gate_up_proj``, ``layers.{i}.pre_feedforward_layernorm_2.weight``, ...);
:func:`moe_weight_name` moves them under the layer's ``moe`` module.
"""

from __future__ import annotations

import re

import torch
from torch import nn

from framework.config import ModelConfig
from framework.layers import FusedMoE, ReplicatedLinear, RMSNorm
from framework.quantization import QuantConfig

#: A layer's MoE-branch tensor in a checkpoint: ``...layers.{i}.<part>...``.
_MOE_TENSOR = re.compile(
    r"^(?P<layer>.*\.layers\.\d+)\.(?P<rest>(?:router|experts|(?:pre|post)_feedforward_layernorm_2)\..*)$"
)


def moe_weight_name(name: str) -> str:
    """``name`` under the layer's ``moe`` module when it is an MoE-branch tensor, else unchanged."""
    match = _MOE_TENSOR.match(name)
    return name if match is None else f"{match['layer']}.moe.{match['rest']}"


def weightless_rms_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """``x * rsqrt(mean(x**2) + eps)`` over the last dimension in float32 (Gemma 4's v and router norms)."""
    return (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


class Gemma4Router(nn.Module):
    """``(topk_weights [T, k] float32, topk_ids [T, k] int32)`` for the hidden states ``[T, H]``."""

    def __init__(self, config: ModelConfig, quant_config: QuantConfig | None, prefix: str) -> None:
        super().__init__()
        hidden, experts = config.hidden_size, int(config.get("num_experts"))
        self.top_k, self.eps = int(config.get("top_k_experts")), float(config.get("rms_norm_eps") or 1e-6)
        self.root_size = hidden**-0.5
        self.proj = ReplicatedLinear(hidden, experts, quant_config=quant_config, prefix=f"{prefix}.proj")
        self.scale = nn.Parameter(torch.ones(hidden), requires_grad=False)
        self.per_expert_scale = nn.Parameter(torch.ones(experts), requires_grad=False)

    def forward(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scores = self.proj(weightless_rms_norm(hidden, self.eps) * self.scale * self.root_size)
        weights, ids = torch.topk(torch.softmax(scores.float(), dim=-1), self.top_k, dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True) * self.per_expert_scale[ids].float()
        return weights, ids.to(torch.int32)


class Gemma4MoE(nn.Module):
    """The router, the GeGLU experts and the branch's two norms (``pre_feedforward_layernorm_2``
    before, ``post_feedforward_layernorm_2`` after); ``forward(h) -> post_ffn_norm_2(experts(...))``."""

    def __init__(self, config: ModelConfig, quant_config: QuantConfig | None, prefix: str) -> None:
        super().__init__()
        hidden, eps = config.hidden_size, float(config.get("rms_norm_eps") or 1e-6)
        self.router = Gemma4Router(config, quant_config, f"{prefix}.router")
        self.experts = FusedMoE(
            int(config.get("num_experts")),
            int(config.get("top_k_experts")),
            hidden,
            int(config.get("moe_intermediate_size")),
            renormalize=True,
            quant_config=quant_config,
            prefix=f"{prefix}.experts",
            activation="gelu_tanh",
        )
        self.pre_feedforward_layernorm_2 = RMSNorm(hidden, eps)
        self.post_feedforward_layernorm_2 = RMSNorm(hidden, eps)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        weights, ids = self.router(hidden)
        routed = self.experts(self.pre_feedforward_layernorm_2(hidden), topk_weights=weights, topk_ids=ids)
        return self.post_feedforward_layernorm_2(routed)
