"""DeepSeek MoE: softmax routing over ``n_routed_experts`` (optionally group-limited), top-k
routed experts weighted by their scores, plus always-on shared experts.

    scores  = softmax(x @ gate.weight.T)                       (float32)
    greedy:               top-k of all scores
    group_limited_greedy: experts split in n_group groups; keep the topk_group groups with the
                          highest single score, top-k among their experts (others score 0)
    weights = top-k scores (renormalised to sum 1 when norm_topk_prob) * routed_scaling_factor
    out     = sum_k weights_k * expert_{id_k}(x) + shared_experts(x)

Routing (:func:`deepseek_v2_routing`) is DeepSeek's own; the routed experts are a
:class:`framework.layers.fused_moe.FusedMoE` (stacked weights, the kernel registry's
``fused_moe`` op) given the precomputed ``topk_weights`` / ``topk_ids``.
"""

from __future__ import annotations

import torch
from torch import nn

from framework.config import ModelConfig
from framework.layers import ReplicatedLinear, SiluAndMul
from framework.layers.fused_moe import FusedMoE, RoutedExperts
from framework.layers.linear import tensor_parallel_all_reduce
from framework.layers.mlp import GatedMLP
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


class DeepseekV2MoE(nn.Module):
    """The MoE feed-forward of a DeepSeek-V2 layer: ``gate`` (router), ``experts``, ``shared_experts``.

    Checkpoint names: ``gate.weight`` ``[E, hidden]`` (kept and applied in float32, as
    transformers does), ``experts.{i}.gate_proj`` / ``up_proj`` / ``down_proj`` (stacked into the
    FusedMoE's ``w13_weight`` / ``w2_weight`` by the model's ``map_weight_name``) and
    ``shared_experts.*`` (one SwiGLU ``n_shared_experts`` times an expert's width).

    Tensor parallelism: the router is replicated; the routed experts and the shared experts are
    split along their intermediate features and return partial outputs, which the block sums and
    all-reduces once (as ``fw_llama``'s Qwen2-MoE block does).
    """

    def __init__(self, config: ModelConfig, quant_config: QuantConfig | None, prefix: str) -> None:
        super().__init__()
        hidden, size = config.hidden_size, int(config.get("moe_intermediate_size"))
        self.num_experts = int(config.get("n_routed_experts"))
        self.top_k = int(config.get("num_experts_per_tok"))
        self.topk_method = config.get("topk_method") or "greedy"
        self.n_group, self.topk_group = config.get("n_group"), config.get("topk_group")
        if self.topk_method == "group_limited_greedy" and (
            not self.n_group or not self.topk_group or self.num_experts % self.n_group
        ):
            raise ValueError(
                f"topk_method 'group_limited_greedy' needs n_group dividing {self.num_experts} experts "
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
        self.gate = ReplicatedLinear(hidden, self.num_experts, prefix=f"{prefix}.gate", params_dtype=torch.float32)
        self.experts = FusedMoE(
            self.num_experts,
            self.top_k,
            hidden,
            size,
            renormalize=self.norm_topk_prob,
            quant_config=quant_config,
            prefix=f"{prefix}.experts",
            reduce_results=False,
        )
        num_shared = int(config.get("n_shared_experts") or 0)
        self.shared_experts = (
            GatedMLP(
                hidden,
                size * num_shared,
                SiluAndMul(),
                quant_config=quant_config,
                prefix=f"{prefix}.shared_experts",
                reduce_results=False,
            )
            if num_shared
            else None
        )

    def route(self, hidden: torch.Tensor) -> RoutedExperts:
        """Each token's ``(topk_weights, topk_ids)``; router logits in float32 as transformers."""
        return deepseek_v2_routing(
            self.gate(hidden.float()),
            self.top_k,
            topk_method=self.topk_method,
            n_group=self.n_group,
            topk_group=self.topk_group,
            norm_topk_prob=self.norm_topk_prob,
            routed_scaling_factor=self.routed_scaling_factor,
        )

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        topk_weights, topk_ids = self.route(hidden)
        output = self.experts(hidden, topk_weights=topk_weights, topk_ids=topk_ids)
        if self.shared_experts is not None:
            output = output + self.shared_experts(hidden)
        if self.experts.tp_size > 1:  # one all-reduce of the two partial sums
            output = tensor_parallel_all_reduce(output)
        return output
