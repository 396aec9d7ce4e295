"""The gated feed-forward block of decoder models: ``down(act(gate(x)) * up(x))``."""

from __future__ import annotations

import torch
from torch import nn

from framework.layers.linear import MergedColumnParallelLinear, RowParallelLinear
from framework.quantization import QuantConfig


class GatedMLP(nn.Module):
    """``gate_up_proj`` (fused gate and up) -> ``act_fn`` (e.g. SiluAndMul) -> ``down_proj``.

    ``reduce_results=False`` (tensor parallelism) returns this rank's partial output without the
    all-reduce, for a caller that sums it with another partial output first (a MoE shared expert).
    """

    def __init__(self, hidden_size: int, intermediate_size: int, act_fn: nn.Module, *, bias: bool = False,
                 quant_config: QuantConfig | None = None, prefix: str = "", reduce_results: bool = True) -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(hidden_size, [intermediate_size] * 2, bias=bias,
                                                       quant_config=quant_config, prefix=f"{prefix}.gate_up_proj")
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, bias=bias, quant_config=quant_config,
                                           prefix=f"{prefix}.down_proj", reduce_results=reduce_results)
        self.act_fn = act_fn

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(hidden)))
