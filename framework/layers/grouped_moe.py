"""DeepSeek-V3's mixture of experts, shared by the families that copied it (DeepSeek-V3/R1,
GLM-4.5/4.6/4.7, GLM-4.7-Flash): a sigmoid router with a score-correction bias and group-limited
top-k, the routed experts (:class:`~framework.layers.fused_moe.FusedMoE`) and always-on shared
experts.

Routing per token (``E`` experts in ``n_group`` groups, :func:`grouped_topk`)::

    scores  = sigmoid(x @ gate.weight.T)                                  float32, [E]
    choice  = scores + gate.e_score_correction_bias                      (chooses; never weights)
    groups  : keep the topk_group groups whose two best ``choice`` values sum highest
    ids     = top-k of ``choice`` within the kept groups
    weights = scores[ids] (/ their sum when norm_topk_prob) * routed_scaling_factor
    out     = sum_k weights_k * expert_{ids_k}(x) + shared_experts(x)

Checkpoint names under a layer's ``mlp``: ``gate.weight`` ``[E, hidden]`` and
``gate.e_score_correction_bias`` ``[E]`` (both kept in float32, as transformers keeps them),
``experts.{e}.gate_proj`` / ``up_proj`` / ``down_proj`` (stacked into the FusedMoE by
:func:`~framework.layers.fused_moe.map_expert_weight_name`) and ``shared_experts.*`` (one SwiGLU
``n_shared_experts`` times an expert's width).

Tensor parallelism: the router is replicated, so every rank picks the same experts; the routed and
the shared experts are split along their intermediate features, and the block all-reduces the sum
of their partial outputs once (or, with ``reduce_results = False``, leaves it to the next norm).
"""

from __future__ import annotations

import torch
from torch import nn

from framework.config import ModelConfig
from framework.layers.activation import SiluAndMul
from framework.layers.fused_moe import FusedMoE, RoutedExperts
from framework.layers.linear import tensor_parallel_all_reduce
from framework.layers.mlp import GatedMLP
from framework.quantization import QuantConfig


def grouped_topk(
    router_logits: torch.Tensor,
    top_k: int,
    *,
    correction_bias: torch.Tensor | None = None,
    num_groups: int = 1,
    topk_groups: int = 1,
    renormalize: bool = True,
    scaling_factor: float = 1.0,
) -> RoutedExperts:
    """Sigmoid routing with a choice-only bias and group-limited top-k (the module docstring).

    ``router_logits`` ``[T, E]`` -> ``(topk_weights [T, k] float32, topk_ids [T, k] int32)``. A
    group's score is the sum of its two best biased scores (its only one, for one-expert groups).
    """
    scores = router_logits.float().sigmoid()
    choice = scores if correction_bias is None else scores + correction_bias.float()
    if num_groups > 1:
        num_tokens, num_experts = choice.shape
        grouped = choice.view(num_tokens, num_groups, num_experts // num_groups)
        group_scores = grouped.topk(min(2, grouped.shape[-1]), dim=-1).values.sum(dim=-1)
        best = group_scores.topk(topk_groups, dim=-1, sorted=False).indices
        keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)
        choice = grouped.masked_fill(~keep.unsqueeze(-1), float("-inf")).view(num_tokens, num_experts)
    topk_ids = choice.topk(top_k, dim=-1, sorted=False).indices
    topk_weights = scores.gather(1, topk_ids)
    if renormalize:
        topk_weights = topk_weights / (topk_weights.sum(dim=-1, keepdim=True) + 1e-20)
    return RoutedExperts(topk_weights * scaling_factor, topk_ids.to(torch.int32))


class GroupedTopkRouter(nn.Module):
    """The router of a layer (``mlp.gate``): ``weight [E, hidden]`` and ``e_score_correction_bias
    [E]``, float32 whatever the model's dtype; ``forward(hidden [T, hidden]) -> RoutedExperts``."""

    def __init__(
        self,
        hidden_size: int,
        num_experts: int,
        top_k: int,
        *,
        num_groups: int = 1,
        topk_groups: int = 1,
        renormalize: bool = True,
        scaling_factor: float = 1.0,
        prefix: str = "",
    ) -> None:
        super().__init__()
        if num_groups < 1 or num_experts % num_groups or not 1 <= topk_groups <= num_groups:
            raise ValueError(
                f"{prefix}: n_group must divide the {num_experts} experts and topk_group be in 1..n_group; "
                f"got n_group={num_groups}, topk_group={topk_groups}"
            )
        if not 0 < top_k <= topk_groups * (num_experts // num_groups):
            raise ValueError(
                f"{prefix}: num_experts_per_tok={top_k} must be in 1..{topk_groups * (num_experts // num_groups)} "
                f"(the experts of topk_group={topk_groups} groups of {num_experts // num_groups})"
            )
        self.top_k, self.num_groups, self.topk_groups = top_k, num_groups, topk_groups
        self.renormalize, self.scaling_factor = renormalize, scaling_factor
        fp32 = dict(dtype=torch.float32)
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size, **fp32), requires_grad=False)
        self.e_score_correction_bias = nn.Parameter(torch.empty(num_experts, **fp32), requires_grad=False)

    def forward(self, hidden: torch.Tensor) -> RoutedExperts:
        return grouped_topk(
            nn.functional.linear(hidden.float(), self.weight),
            self.top_k,
            correction_bias=self.e_score_correction_bias,
            num_groups=self.num_groups,
            topk_groups=self.topk_groups,
            renormalize=self.renormalize,
            scaling_factor=self.scaling_factor,
        )

    def extra_repr(self) -> str:
        experts, hidden = self.weight.shape
        return (
            f"experts={experts}, hidden={hidden}, top_k={self.top_k}, groups={self.topk_groups}/{self.num_groups}, "
            f"renormalize={self.renormalize}, scale={self.scaling_factor}"
        )


class GroupedTopkMoE(nn.Module):
    """``gate`` (:class:`GroupedTopkRouter`) -> ``experts`` (FusedMoE), plus ``shared_experts``.

    Reads the config keys ``n_routed_experts``, ``num_experts_per_tok``, ``moe_intermediate_size``,
    ``n_shared_experts``, ``n_group``, ``topk_group``, ``norm_topk_prob`` and
    ``routed_scaling_factor``; ``scoring_func`` / ``topk_method``, where a checkpoint states them,
    must be DeepSeek-V3's ``sigmoid`` / ``noaux_tc``. Another router (DeepSeek-V2's softmax one)
    comes in as ``gate``: a module the checkpoint names ``gate``, ``gate(hidden) -> RoutedExperts``.
    """

    def __init__(
        self, config: ModelConfig, quant_config: QuantConfig | None, prefix: str, gate: nn.Module | None = None
    ) -> None:
        super().__init__()
        hidden, width = config.hidden_size, int(config.get("moe_intermediate_size"))
        num_experts, top_k = int(config.get("n_routed_experts")), int(config.get("num_experts_per_tok"))
        renormalize = bool(config.get("norm_topk_prob", True))
        if gate is None:
            for key, valid in (("scoring_func", "sigmoid"), ("topk_method", "noaux_tc")):
                if config.get(key) not in (None, valid):
                    raise ValueError(
                        f"{config.architecture} MoE with {key} {config.get(key)!r} is unsupported; valid: {valid}"
                    )
            gate = GroupedTopkRouter(
                hidden,
                num_experts,
                top_k,
                num_groups=int(config.get("n_group") or 1),
                topk_groups=int(config.get("topk_group") or 1),
                renormalize=renormalize,
                scaling_factor=float(config.get("routed_scaling_factor") or 1.0),
                prefix=f"{prefix}.gate",
            )
        self.gate = gate
        self.experts = FusedMoE(
            num_experts,
            top_k,
            hidden,
            width,
            renormalize=renormalize,
            quant_config=quant_config,
            prefix=f"{prefix}.experts",
            reduce_results=False,
        )
        num_shared = int(config.get("n_shared_experts") or 0)
        self.shared_experts = (
            GatedMLP(
                hidden,
                width * num_shared,
                SiluAndMul(),
                quant_config=quant_config,
                prefix=f"{prefix}.shared_experts",
                reduce_results=False,
            )
            if num_shared
            else None
        )
        self.reduce_results = True  # False: return this rank's partial sum (the next norm all-reduces it)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        topk_weights, topk_ids = self.gate(hidden)
        out = self.experts(hidden, topk_weights=topk_weights, topk_ids=topk_ids)
        if self.shared_experts is not None:
            out = out + self.shared_experts(hidden)
        if self.experts.tp_size > 1 and self.reduce_results:
            out = tensor_parallel_all_reduce(out)
        return out
