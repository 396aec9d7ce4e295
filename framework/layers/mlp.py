"""The gated feed-forward block of decoder models: ``down(act(gate(x)) * up(x))``, and
:func:`dense_mlp`, the SwiGLU block of a config's ``intermediate_size`` that Llama-style and
DeepSeek dense layers share."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from framework.config import ModelConfig
from framework.layers.activation import SiluAndMul
from framework.layers.linear import MergedColumnParallelLinear, RowParallelLinear
from framework.quantization import QuantConfig

#: Builds a layer's feed-forward block: ``make_mlp(config, layer_index, quant_config, prefix)``
#: (:func:`dense_mlp`, or a MoE model's factory that picks MoE or dense per layer).
MLPFactory = Callable[[ModelConfig, int, "QuantConfig | None", str], nn.Module]


class GatedMLP(nn.Module):
    """``gate_up_proj`` (fused gate and up) -> ``act_fn`` (e.g. SiluAndMul) -> ``down_proj``.

    ``reduce_results=False`` (tensor parallelism) returns this rank's partial output without the
    all-reduce, for a caller that sums it with another partial output first (a MoE shared expert).
    """

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        act_fn: nn.Module,
        *,
        bias: bool = False,
        quant_config: QuantConfig | None = None,
        prefix: str = "",
        reduce_results: bool = True,
    ) -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(
            hidden_size, [intermediate_size] * 2, bias=bias, quant_config=quant_config, prefix=f"{prefix}.gate_up_proj"
        )
        self.down_proj = RowParallelLinear(
            intermediate_size,
            hidden_size,
            bias=bias,
            quant_config=quant_config,
            prefix=f"{prefix}.down_proj",
            reduce_results=reduce_results,
        )
        self.act_fn = act_fn

    @property
    def reduce_results(self) -> bool:
        """Whether the output is all-reduced (False: this rank's partial sum, for the caller)."""
        return self.down_proj.reduce_results

    @reduce_results.setter
    def reduce_results(self, value: bool) -> None:
        self.down_proj.reduce_results = value

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(hidden)))


def dense_mlp(config: ModelConfig, layer_index: int, quant_config: QuantConfig | None, prefix: str) -> GatedMLP:
    """The SwiGLU feed-forward of a dense decoder layer: ``intermediate_size`` wide, bias when
    ``mlp_bias``. The signature is a model's per-layer MLP factory's (``layer_index`` unused here)."""
    return GatedMLP(
        config.hidden_size,
        int(config.get("intermediate_size")),
        SiluAndMul(),
        bias=bool(config.get("mlp_bias", False)),
        quant_config=quant_config,
        prefix=prefix,
    )
