"""gpt-oss (``GptOssForCausalLM``): a Llama decoder with attention sinks and biased, clamped-SwiGLU experts.

What differs from the Llama family (``model.py``), switched on by the architecture name:

| part | gpt-oss |
| --- | --- |
| attention | q/k/v/o biases (``attention_bias``), a learned sink logit per head (``self_attn.sinks``) |
| layers | ``layer_types``: sliding window (``sliding_window``) on alternate layers |
| rotary | YaRN (``rope_parameters``, ``truncate: false``) |
| router | ``mlp.router`` linear with bias; top-k of the logits, softmax over those k |
| experts | ``FusedMoE(bias=True, swiglu_limit=...)``: ``(up + 1) * gate * sigmoid(1.702 gate)`` after clamps |

Checkpoint layouts of the experts (``model.layers.{i}.mlp.experts.``), turned into FusedMoE's
``w13 = [gate rows | up rows]`` / ``w2 = [H, I]`` by :func:`to_fused_moe_layout` while loading::

    bf16      gate_up_proj [E, H, 2I]  (columns interleaved: gate 0, up 0, gate 1, ...)  -> w13_weight [E, 2I, H]
              gate_up_proj_bias [E, 2I] (interleaved)                                   -> w13_bias
              down_proj [E, I, H] -> w2_weight [E, H, I];  down_proj_bias [E, H]         -> w2_bias
    MXFP4     gate_up_proj_blocks [E, 2I, H/32, 16] uint8, gate_up_proj_scales [E, 2I, H/32] (rows
              interleaved)                                                            -> w13_blocks / w13_scales
              down_proj_blocks [E, H, I/32, 16], down_proj_scales [E, H, I/32]         -> w2_blocks / w2_scales

The MXFP4 tensors are served by the ``fp4`` quant plugin's FusedMoE method.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator

import torch
from torch import nn

from framework.config import ModelConfig
from framework.layers import ReplicatedLinear
from framework.layers.causal_lm import CausalLM
from framework.layers.fused_moe import FusedMoE, map_expert_weight_name
from framework.layers.linear import tensor_parallel_all_reduce
from framework.loader.checkpoint_slice import materialize
from framework.loader.model_loader import load_parameters
from framework.quantization import QuantConfig

from .model import LlamaModel

#: ``...experts.<projection>[_<part>]``: the expert tensors of a gpt-oss checkpoint.
_EXPERT_TENSOR = re.compile(
    r"^(?P<prefix>.*\.experts)\.(?P<proj>gate_up_proj|down_proj)(?:_(?P<part>bias|blocks|scales))?$"
)


def deinterleave(tensor: torch.Tensor, dim: int) -> torch.Tensor:
    """Entries ``0, 2, 4, ...`` (gate) then ``1, 3, 5, ...`` (up) along ``dim``."""
    pairs = tensor.unflatten(dim, (-1, 2))
    return torch.cat([pairs.select(dim + 1, 0), pairs.select(dim + 1, 1)], dim)


def to_fused_moe_layout(name: str, tensor) -> tuple[str, torch.Tensor]:
    """A gpt-oss checkpoint tensor under FusedMoE's names and layout (the table in the module
    docstring); any other tensor unchanged (still lazy, if it was)."""
    match = _EXPERT_TENSOR.match(name)
    if match is None:
        return name, tensor
    part, is_gate_up = match["part"], match["proj"] == "gate_up_proj"
    tensor = materialize(tensor)
    if part is None:  # bf16 weights are stored [E, in, out]
        tensor = tensor.transpose(1, 2)
    if is_gate_up:
        tensor = deinterleave(tensor, 1)
    return f"{match['prefix']}.{match['proj']}.{part or 'weight'}", tensor.contiguous()


class GptOssMoE(nn.Module):
    """``router`` (linear with bias) -> top-k logits -> softmax over them -> biased experts."""

    def __init__(self, config: ModelConfig, quant_config: QuantConfig | None, prefix: str) -> None:
        super().__init__()
        experts = int(config.get("num_local_experts"))
        self.top_k = int(config.get("num_experts_per_tok"))
        self.router = ReplicatedLinear(
            config.hidden_size, experts, bias=True, quant_config=quant_config, prefix=f"{prefix}.router"
        )
        self.experts = FusedMoE(
            experts,
            self.top_k,
            config.hidden_size,
            int(config.get("intermediate_size")),
            renormalize=True,
            quant_config=quant_config,
            prefix=f"{prefix}.experts",
            reduce_results=False,
            bias=True,
            swiglu_limit=float(config.get("swiglu_limit") or 7.0),
            swiglu_alpha=float(config.get("swiglu_alpha") or 1.702),
        )
        self.reduce_results = True  # False: return this rank's partial sum (the next norm all-reduces it)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits, ids = torch.topk(self.router(hidden), self.top_k, dim=-1)
        weights = torch.softmax(logits.float(), dim=-1)
        out = self.experts(hidden, topk_weights=weights, topk_ids=ids.to(torch.int32))
        if self.experts.tp_size > 1 and self.reduce_results:
            out = tensor_parallel_all_reduce(out)
        return out


def gpt_oss_mlp(config: ModelConfig, layer_index: int, quant_config: QuantConfig | None, prefix: str) -> nn.Module:
    return GptOssMoE(config, quant_config, prefix)


class GptOssForCausalLM(CausalLM):
    """gpt-oss-20b / gpt-oss-120b: ``forward(input_ids, positions) -> hidden``; ``compute_logits``."""

    #: expert tensors are re-laid out whole; the rest reach the layers' loaders as lazy slices
    reads_checkpoint_slices = True

    def __init__(self, config: ModelConfig, quant_config: QuantConfig | None = None, prefix: str = "") -> None:
        super().__init__()
        self.config = config
        self.model = LlamaModel(config, quant_config, "model", make_mlp=gpt_oss_mlp)
        self.init_lm_head(config, quant_config, tie_by_default=False)

    @staticmethod
    def map_weight_name(name: str) -> tuple[str, tuple | None]:
        return map_expert_weight_name(name)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        def relaid() -> Iterator[tuple[str, torch.Tensor]]:
            for name, tensor in weights:
                yield to_fused_moe_layout(name, tensor)

        return load_parameters(self, relaid())
