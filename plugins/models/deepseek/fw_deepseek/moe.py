"""DeepSeek-V2 MoE: softmax routing over ``n_routed_experts`` (optionally group-limited), top-k
routed experts weighted by their scores, plus always-on shared experts.

    scores  = softmax(x @ gate.weight.T)                       (float32)
    greedy:               top-k of all scores
    group_limited_greedy: experts split in n_group groups; keep the topk_group groups with the
                          highest single score, top-k among their experts (others score 0)
    weights = top-k scores (renormalised to sum 1 when norm_topk_prob) * routed_scaling_factor
    out     = sum_k weights_k * expert_{id_k}(x) + shared_experts(x)

Routing (:func:`deepseek_v2_routing`, in :class:`DeepseekV2Router`) is DeepSeek-V2's own; the
block around it is DeepSeek-V3's (:class:`framework.layers.grouped_moe.GroupedTopkMoE`: the
routed experts as a :class:`~framework.layers.fused_moe.FusedMoE`, the shared experts, one
all-reduce under tensor parallelism).
"""

from __future__ import annotations

import torch

from framework.config import ModelConfig
from framework.layers import ReplicatedLinear
from framework.layers.fused_moe import RoutedExperts
from framework.layers.grouped_moe import GroupedTopkMoE
from framework.quantization import QuantConfig

TOPK_METHODS = ("greedy", "group_limited_greedy")


def deepseek_v2_routing(
    router_logits: torch.Tensor,
    top_k: int,
    *,
    topk_method: str = "greedy",
    n_group: int | None = None,
    topk_group: int | None = None,
    norm_topk_prob: bool = False,
    routed_scaling_factor: float = 1.0,
) -> RoutedExperts:
    """DeepSeek-V2 routing: ``router_logits`` ``[T, E]`` -> ``(topk_weights [T, k] float32, topk_ids [T, k] int32)``.

    ``norm_topk_prob`` renormalises the chosen scores to sum 1 before ``routed_scaling_factor``
    (as DeepSeek-V3 and vLLM do; transformers' DeepSeek-V2 ignores the flag, and every released
    V2 checkpoint sets it False).
    """
    scores = router_logits.float().softmax(dim=-1)
    if topk_method == "group_limited_greedy":
        num_tokens, num_experts = scores.shape
        grouped = scores.view(num_tokens, n_group, num_experts // n_group)
        best_groups = grouped.max(dim=-1).values.topk(topk_group, dim=-1, sorted=False).indices
        keep = torch.zeros(num_tokens, n_group, dtype=torch.bool, device=scores.device).scatter_(1, best_groups, True)
        scores = (grouped * keep.unsqueeze(-1)).view(num_tokens, num_experts)
    elif topk_method != "greedy":
        raise ValueError(f"unknown topk_method {topk_method!r}; valid: {', '.join(TOPK_METHODS)}")
    topk_weights, topk_ids = scores.topk(top_k, dim=-1, sorted=False)
    if norm_topk_prob and top_k > 1:
        topk_weights = topk_weights / (topk_weights.sum(dim=-1, keepdim=True) + 1e-20)
    return RoutedExperts(topk_weights * routed_scaling_factor, topk_ids.to(torch.int32))


class DeepseekV2Router(ReplicatedLinear):
    """``gate.weight`` ``[E, hidden]`` (kept and applied in float32, as transformers does), then
    :func:`deepseek_v2_routing`: ``forward(hidden) -> RoutedExperts``."""

    def __init__(self, config: ModelConfig, prefix: str) -> None:
        num_experts = int(config.get("n_routed_experts"))
        super().__init__(config.hidden_size, num_experts, prefix=prefix, params_dtype=torch.float32)
        self.top_k = int(config.get("num_experts_per_tok"))
        self.topk_method = config.get("topk_method") or "greedy"
        self.n_group, self.topk_group = config.get("n_group"), config.get("topk_group")
        if self.topk_method == "group_limited_greedy" and (
            not self.n_group or not self.topk_group or num_experts % self.n_group
        ):
            raise ValueError(
                f"topk_method 'group_limited_greedy' needs n_group dividing {num_experts} experts "
                f"and topk_group; got n_group={self.n_group}, topk_group={self.topk_group}"
            )
        if (config.get("scoring_func") or "softmax") != "softmax":
            raise ValueError(
                f"DeepSeek-V2 MoE with scoring_func {config.get('scoring_func')!r} is unsupported; valid: softmax"
            )
        if self.topk_method not in TOPK_METHODS:
            raise ValueError(f"unknown topk_method {self.topk_method!r}; valid: {', '.join(TOPK_METHODS)}")
        self.norm_topk_prob = bool(config.get("norm_topk_prob", False))
        self.routed_scaling_factor = float(config.get("routed_scaling_factor") or 1.0)

    def forward(self, hidden: torch.Tensor) -> RoutedExperts:
        return deepseek_v2_routing(
            super().forward(hidden.float()),
            self.top_k,
            topk_method=self.topk_method,
            n_group=self.n_group,
            topk_group=self.topk_group,
            norm_topk_prob=self.norm_topk_prob,
            routed_scaling_factor=self.routed_scaling_factor,
        )


class DeepseekV2MoE(GroupedTopkMoE):
    """The MoE feed-forward of a DeepSeek-V2 layer: ``gate`` (:class:`DeepseekV2Router`),
    ``experts``, ``shared_experts`` (one SwiGLU ``n_shared_experts`` times an expert's width).

    Checkpoint names: ``gate.weight``, ``experts.{i}.gate_proj`` / ``up_proj`` / ``down_proj``
    (stacked into the FusedMoE by the model's ``map_weight_name``) and ``shared_experts.*``.
    Tensor parallelism: the router is replicated; the routed experts and the shared experts are
    split along their intermediate features and the block all-reduces their sum once.
    """

    def __init__(self, config: ModelConfig, quant_config: QuantConfig | None, prefix: str) -> None:
        super().__init__(config, quant_config, prefix, gate=DeepseekV2Router(config, f"{prefix}.gate"))
