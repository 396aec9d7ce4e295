"""The Gated DeltaNet block (``linear_attn``) of Qwen3-Next and Qwen3.5 decoder layers.

    x -> in_proj -> mixed qkv [T, 2*Hk*Dk + Hv*Dv], z [T, Hv, Dv], b, a [T, Hv]
      -> GatedDeltaNetAttention(mixed qkv, conv1d, g = -exp(A_log) * softplus(a + dt_bias), beta = sigmoid(b))
      -> RMSNorm(o) * silu(z) -> out_proj

The stateful part (short convolution, delta rule, the per-sequence states) is the framework's
:class:`~framework.layers.linear_attention.GatedDeltaNetAttention`; this block owns the weights.
Tensor parallelism splits the heads: rank r keeps key heads ``[r*Hk/tp, (r+1)*Hk/tp)`` and the
value heads they serve, the matching conv channels of q, k and v, and its rows of ``A_log`` and
``dt_bias``; ``out_proj`` is row-parallel (one all-reduce). The two checkpoint layouts:

| | projections | order inside the fused projection |
| --- | --- | --- |
| Qwen3-Next | ``in_proj_qkvz``, ``in_proj_ba`` | per key head: ``q, k, v, z`` (``Hv / Hk`` value heads each), then ``b, a`` |
| Qwen3.5 | ``in_proj_qkv``, ``in_proj_z``, ``in_proj_b``, ``in_proj_a`` | ``q`` of all heads, ``k``, ``v`` |

Unquantized, the input projections of either layout run as one matmul over their concatenated
weights (:meth:`GatedDeltaNet.init_buffers`).
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from framework.config import ModelConfig
from framework.distributed import get_tp_rank, get_tp_size
from framework.kernels import get_kernel
from framework.layers import ColumnParallelLinear, MergedColumnParallelLinear, RowParallelLinear, set_weight_attrs
from framework.layers.linear import (
    KeepsWeightAttrs,
    UnquantizedLinearMethod,
    copy_weight,
    divide,
    load_column_shard,
)
from framework.layers.linear_attention import GatedDeltaNetAttention
from framework.quantization import QuantConfig


class GatedRMSNorm(nn.Module):
    """``rms_norm(x) * weight * silu(gate)`` over the last dim (the norm rounded to ``x.dtype``
    before the gate, as transformers' ``RMSNormGated``)."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(size), requires_grad=False)
        self._rms_norm_gated = get_kernel("rms_norm_gated")

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        return self._rms_norm_gated(x, self.weight, gate, self.eps)


class DepthwiseConvWeight(KeepsWeightAttrs):
    """Holds the short convolution's ``weight [channels, 1, kernel]`` (the checkpoint's ``conv1d``) for
    this rank's channels: of each part ``[q | k | v]`` of the checkpoint's channels (``part_sizes``,
    per rank), the rank's slice."""

    def __init__(self, part_sizes: list[int], kernel: int, tp_rank: int) -> None:
        super().__init__()
        self.part_sizes, self.tp_rank = part_sizes, tp_rank
        self.weight = nn.Parameter(torch.empty(sum(part_sizes), 1, kernel), requires_grad=False)
        set_weight_attrs(self.weight, {"weight_loader": self.weight_loader})

    def weight_loader(self, param: torch.Tensor, loaded_weight: torch.Tensor) -> None:
        full_offset, offset = 0, 0
        for size in self.part_sizes:
            full = size * loaded_weight.shape[0] // sum(self.part_sizes)  # this part's channels over all ranks
            piece = loaded_weight.narrow(0, full_offset + self.tp_rank * size, size)
            copy_weight(param.data.narrow(0, offset, size), piece)
            full_offset, offset = full_offset + full, offset + size


class GatedDeltaNet(KeepsWeightAttrs):
    """``forward(hidden [T, hidden]) -> [T, hidden]`` of linear-attention layer ``state_index``."""

    def __init__(
        self, config: ModelConfig, state_index: int, quant_config: QuantConfig | None, prefix: str, fused_qkvz: bool
    ) -> None:
        super().__init__()
        hidden, tp_size, tp_rank = config.hidden_size, get_tp_size(), get_tp_rank()
        total_k, total_v = int(config.get("linear_num_key_heads")), int(config.get("linear_num_value_heads"))
        num_k = divide(total_k, tp_size, "linear attention key heads")
        num_v = divide(total_v, tp_size, "linear attention value heads")
        dk, dv = int(config.get("linear_key_head_dim")), int(config.get("linear_value_head_dim"))
        self.core = GatedDeltaNetAttention(state_index, num_k, num_v, dk, dv, int(config.get("linear_conv_kernel_dim")))
        self.num_k, self.num_v, self.dk, self.dv = num_k, num_v, dk, dv
        key_dim, value_dim = total_k * dk, total_v * dv  # over all ranks
        self.fused_qkvz = fused_qkvz

        def column(name: str, size: int) -> ColumnParallelLinear:
            return ColumnParallelLinear(hidden, size, quant_config=quant_config, prefix=f"{prefix}.{name}")

        if fused_qkvz:  # grouped by key head: a contiguous split keeps each rank's groups whole
            self.in_proj_qkvz = column("in_proj_qkvz", 2 * key_dim + 2 * value_dim)
            self.in_proj_ba = column("in_proj_ba", 2 * total_v)
        else:
            self.in_proj_qkv = MergedColumnParallelLinear(
                hidden, [key_dim, key_dim, value_dim], quant_config=quant_config, prefix=f"{prefix}.in_proj_qkv"
            )
            self.in_proj_z = column("in_proj_z", value_dim)
            self.in_proj_b = column("in_proj_b", total_v)
            self.in_proj_a = column("in_proj_a", total_v)
        self.conv1d = DepthwiseConvWeight(
            [self.core.key_dim, self.core.key_dim, self.core.value_dim], self.core.conv_kernel, tp_rank
        )
        # the decay parameters stay float32 (transformers computes g in float32 from them); this rank's heads
        loader = functools.partial(load_column_shard, tp_rank=tp_rank)
        self.A_log = nn.Parameter(torch.empty(num_v, dtype=torch.float32), requires_grad=False)
        self.dt_bias = nn.Parameter(torch.empty(num_v, dtype=torch.float32), requires_grad=False)
        for param in (self.A_log, self.dt_bias):
            set_weight_attrs(param, {"weight_loader": loader, "output_dim": 0})
        self.norm = GatedRMSNorm(dv, float(config.get("rms_norm_eps") or 1e-6))
        self.out_proj = RowParallelLinear(value_dim, hidden, quant_config=quant_config, prefix=f"{prefix}.out_proj")
        self._gating = get_kernel("gdn_gating")
        self._in_proj_weight: torch.Tensor | None = None  # the input projections in one (init_buffers)
        self._in_proj_sizes: list[int] = []

    def _in_proj_layers(self) -> tuple[nn.Module, ...]:
        if self.fused_qkvz:
            return self.in_proj_qkvz, self.in_proj_ba
        return self.in_proj_qkv, self.in_proj_z, self.in_proj_b, self.in_proj_a

    def init_buffers(self, device: torch.device) -> None:
        """After loading: the input projections (Qwen3.5's four, Qwen3-Next's two), when all are
        unquantized and unbiased, get one weight (their rows concatenated) and each layer's weight
        becomes its row range of it (a view: no copy is kept), so a step runs one matmul (one GEMV
        at decode) for all of them."""
        layers = self._in_proj_layers()
        if any(type(layer.linear_method) is not UnquantizedLinearMethod or layer.bias is not None for layer in layers):
            return
        weights = [layer.weight for layer in layers]
        if len({(weight.dtype, weight.device) for weight in weights}) != 1:
            return
        merged, start = torch.cat([weight.data for weight in weights]), 0
        for weight in weights:
            weight.data = merged[start : start + weight.shape[0]]
            start += weight.shape[0]
        self._in_proj_weight, self._in_proj_sizes = merged, [weight.shape[0] for weight in weights]
        self._in_proj_linear = layers[0].linear_method.linear

    def _project(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(mixed_qkv [T, conv_dim], z [T, Hv, Dv], b [T, Hv], a [T, Hv])`` from either layout."""
        tokens = hidden.shape[0]
        if self._in_proj_weight is not None:
            outputs = self._in_proj_linear(hidden, self._in_proj_weight).split(self._in_proj_sizes, dim=-1)
        else:
            outputs = [layer(hidden) for layer in self._in_proj_layers()]
        if not self.fused_qkvz:
            mixed, z, b, a = outputs
            return mixed, z.view(tokens, self.num_v, self.dv), b, a
        per_key = self.num_v // self.num_k  # value heads per key head
        qkvz, ba = outputs[0].view(tokens, self.num_k, -1), outputs[1].view(tokens, self.num_k, 2 * per_key)
        q, k, v, z = qkvz.split([self.dk, self.dk, per_key * self.dv, per_key * self.dv], dim=-1)
        mixed = torch.cat([q.reshape(tokens, -1), k.reshape(tokens, -1), v.reshape(tokens, -1)], dim=-1)
        b, a = ba.split([per_key, per_key], dim=-1)
        return mixed, z.reshape(tokens, self.num_v, self.dv), b.reshape(tokens, -1), a.reshape(tokens, -1)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        mixed, z, b, a = self._project(hidden)
        g, beta = self._gating(a, b, self.A_log, self.dt_bias)
        out = self.core(mixed, self.conv1d.weight[:, 0, :], g, beta)
        return self.out_proj(self.norm(out, z).reshape(hidden.shape[0], -1))
