"""Mixture-of-experts members of the Llama family: Mixtral, Qwen2-MoE, Qwen3-MoE and MiniMax-M2.

They are Llama decoders (the same attention, norms and residual stream, see ``model.py``) whose
feed-forward block is, on some or all layers, a sparse MoE block built on
:class:`framework.layers.fused_moe.FusedMoE`:

| switch | Mixtral | Qwen2-MoE | Qwen3-MoE | MiniMax-M2 |
| --- | --- | --- | --- | --- |
| experts / used | ``num_local_experts`` / ``num_experts_per_tok`` | ``num_experts`` / same | ``num_experts`` / same | as Mixtral |
| expert width | ``intermediate_size`` | ``moe_intermediate_size`` | ``moe_intermediate_size`` | ``intermediate_size`` |
| router | softmax, top-k | softmax, top-k | softmax, top-k | sigmoid; top-k of score + ``e_score_correction_bias``, weights the scores |
| renormalise top-k | always | ``norm_topk_prob`` | ``norm_topk_prob`` | always |
| shared expert | no | ``shared_expert`` with a sigmoid gate | no | no |
| sparse layers | all | ``decoder_sparse_step``, minus ``mlp_only_layers`` | same | all |
| attention | Llama | q/k/v bias | per-head QK RMSNorm | QK RMSNorm across all heads, partial rotary (``rotary_dim``) |
| checkpoint names | ``block_sparse_moe.experts.{e}.w1/w3/w2`` | ``mlp.experts.{e}.gate/up/down_proj`` | same as Qwen2-MoE | as Mixtral |

MiniMax-M2's QK norm needs every head's features, so it runs on one device (no tensor parallelism).
"""

from __future__ import annotations

import torch
from torch import nn

from framework.config import ModelConfig
from framework.kernels import get_kernel
from framework.layers import ReplicatedLinear, SiluAndMul
from framework.layers.causal_lm import CausalLM
from framework.layers.fused_moe import FusedMoE, map_expert_weight_name
from framework.layers.linear import tensor_parallel_all_reduce
from framework.layers.mlp import GatedMLP, dense_mlp
from framework.quantization import QuantConfig

from .hooks import MINIMAX_ARCHITECTURES, MOE_ARCHITECTURES
from .model import LlamaModel

#: ``model_type``s whose experts are ``intermediate_size`` wide and on every layer.
EVERY_LAYER_SPARSE = ("mixtral", "minimax_m2")


def num_experts(config: ModelConfig) -> int:
    return int(config.get("num_experts") or config.get("num_local_experts"))


def is_sparse_layer(config: ModelConfig, layer_index: int) -> bool:
    """Whether layer ``layer_index`` has the MoE block (transformers' rule for Qwen-MoE; Mixtral: all)."""
    if config.get("model_type") in EVERY_LAYER_SPARSE:
        return True
    step = int(config.get("decoder_sparse_step") or 1)
    only_dense = config.get("mlp_only_layers") or []
    return layer_index not in only_dense and num_experts(config) > 0 and (layer_index + 1) % step == 0


class SparseMoeBlock(nn.Module):
    """Router (``gate``) -> ``experts`` (FusedMoE), plus Qwen2-MoE's gated ``shared_expert``.

    Qwen2-MoE adds ``sigmoid(shared_expert_gate(x)) * shared_expert(x)`` to the routed output.
    Tensor parallelism: the routers are replicated; the experts and the shared expert are split
    along their intermediate features, return partial outputs, and the block all-reduces their sum
    once (the sigmoid gate scales a partial output per token, which commutes with the sum).
    """

    def __init__(self, config: ModelConfig, quant_config: QuantConfig | None, prefix: str) -> None:
        super().__init__()
        hidden, experts = config.hidden_size, num_experts(config)
        is_mixtral = config.get("model_type") in EVERY_LAYER_SPARSE
        width = int(config.get("intermediate_size") if is_mixtral else config.get("moe_intermediate_size"))
        self.gate = ReplicatedLinear(hidden, experts, quant_config=quant_config, prefix=f"{prefix}.gate")
        self.experts = FusedMoE(
            experts,
            int(config.get("num_experts_per_tok")),
            hidden,
            width,
            renormalize=is_mixtral or bool(config.get("norm_topk_prob", False)),
            quant_config=quant_config,
            prefix=f"{prefix}.experts",
            reduce_results=False,
        )
        shared = int(config.get("shared_expert_intermediate_size") or 0)
        if shared:
            self.shared_expert = GatedMLP(
                hidden,
                shared,
                SiluAndMul(),
                quant_config=quant_config,
                prefix=f"{prefix}.shared_expert",
                reduce_results=False,
            )
            self.shared_expert_gate = ReplicatedLinear(
                hidden, 1, quant_config=quant_config, prefix=f"{prefix}.shared_expert_gate"
            )
        else:
            self.shared_expert = self.shared_expert_gate = None
        self._gate_mul = get_kernel("sigmoid_gate_mul")
        self.reduce_results = True  # False: return this rank's partial sum (the next norm all-reduces it)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        out = self.experts(hidden, self.gate(hidden))
        if self.shared_expert is not None:
            out = self._gate_mul(self.shared_expert(hidden), self.shared_expert_gate(hidden), out)
        if self.experts.tp_size > 1 and self.reduce_results:
            out = tensor_parallel_all_reduce(out)
        return out


class BiasCorrectedSigmoidMoeBlock(SparseMoeBlock):
    """MiniMax-M2's router: ``s = sigmoid(gate(x))``; the top-k experts by ``s + e_score_correction_bias``
    (the bias only chooses), weighted by their ``s`` renormalised to sum to one."""

    def __init__(self, config: ModelConfig, quant_config: QuantConfig | None, prefix: str) -> None:
        super().__init__(config, quant_config, prefix)
        self.e_score_correction_bias = nn.Parameter(
            torch.empty(self.experts.num_experts, dtype=torch.float32), requires_grad=False
        )
        self._select_experts = get_kernel("select_experts")

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        weights, ids = self._select_experts(
            self.gate(hidden), self.experts.top_k, True, "sigmoid", self.e_score_correction_bias
        )
        out = self.experts(hidden, topk_weights=weights, topk_ids=ids)
        if self.experts.tp_size > 1 and self.reduce_results:
            out = tensor_parallel_all_reduce(out)
        return out


def moe_or_dense_mlp(config: ModelConfig, layer_index: int, quant_config: QuantConfig | None, prefix: str) -> nn.Module:
    """The feed-forward of a layer: the sparse MoE block, or a dense SwiGLU on ``mlp_only_layers``."""
    if config.architecture in MINIMAX_ARCHITECTURES:
        return BiasCorrectedSigmoidMoeBlock(config, quant_config, prefix)
    if is_sparse_layer(config, layer_index):
        return SparseMoeBlock(config, quant_config, prefix)
    return dense_mlp(config, layer_index, quant_config, prefix)


class LlamaMoeForCausalLM(CausalLM):
    """Mixtral, Qwen2-MoE, Qwen3-MoE, MiniMax-M2: ``forward(input_ids, positions) -> hidden``; ``compute_logits``."""

    def __init__(self, config: ModelConfig, quant_config: QuantConfig | None = None, prefix: str = "") -> None:
        super().__init__()
        served = [*MOE_ARCHITECTURES, *MINIMAX_ARCHITECTURES]
        if config.architecture not in served:
            raise ValueError(f"LlamaMoeForCausalLM serves {', '.join(served)}; got {config.architecture!r}")
        self.config = config
        self.model = LlamaModel(config, quant_config, "model", make_mlp=moe_or_dense_mlp)
        self.init_lm_head(config, quant_config, tie_by_default=False)

    @staticmethod
    def map_weight_name(name: str) -> tuple[str, tuple | None]:
        """Expert tensors go to the stacked FusedMoE weights (see ``framework.layers.fused_moe``);
        Mixtral's and MiniMax-M2's ``block_sparse_moe`` is this model's ``mlp``; the rest folds as in Llama."""
        return map_expert_weight_name(name.replace(".block_sparse_moe.", ".mlp."))
