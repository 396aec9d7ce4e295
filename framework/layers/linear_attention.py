"""The ``GatedDeltaNetAttention`` layer: the stateful core of a gated-delta-net (GDN) layer.

What a model's GDN block computes around it (projections, gates, the output norm) stays in the
model; this layer holds the layer constants and runs, per step, the causal short convolution
and the gated delta rule over the step's packed tokens, reading and writing each sequence's
state in the engine's state cache (:mod:`framework.engine.state_cache`) at the slots the forward
context names. Both ops come from the kernel registry (``causal_conv1d``, ``gated_delta_rule``;
torch references in :mod:`framework.ops_linear_attention`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from framework.forward_context import get_forward_context
from framework.kernels import get_kernel

if TYPE_CHECKING:
    from framework.engine.state_cache import StateCacheSpec


class GatedDeltaNetAttention(nn.Module):
    """Linear-attention layer ``state_index`` (0, 1, ... over the model's GDN layers, in order).

    ``forward(mixed_qkv [T, 2 * Hk * Dk + Hv * Dv], conv_weight [conv_dim, K], g [T, Hv], beta [T, Hv])``
    returns ``[T, Hv, Dv]``: the convolved ``mixed_qkv`` is split into q, k (``Hk`` heads of ``Dk``)
    and v (``Hv`` heads of ``Dv``), q and k are L2-normalised, and each sequence runs the gated
    delta rule from its state (zeros on its first step).
    """

    def __init__(
        self, state_index: int, num_k_heads: int, num_v_heads: int, head_k_dim: int, head_v_dim: int, conv_kernel: int
    ) -> None:
        super().__init__()
        if num_v_heads % num_k_heads:
            raise ValueError(
                f"linear attention needs value heads ({num_v_heads}) a multiple of key heads ({num_k_heads})"
            )
        self.state_index = state_index
        self.num_k_heads, self.num_v_heads = num_k_heads, num_v_heads
        self.head_k_dim, self.head_v_dim = head_k_dim, head_v_dim
        self.conv_kernel = conv_kernel
        self.key_dim, self.value_dim = num_k_heads * head_k_dim, num_v_heads * head_v_dim
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self._conv = get_kernel("causal_conv1d")
        self._delta_rule = get_kernel("gated_delta_rule")

    def state_spec(self, dtype: torch.dtype) -> StateCacheSpec:
        """The per-sequence state: conv ``[conv_dim, K - 1]`` in ``dtype``, recurrent ``[Hv, Dk, Dv]`` float32."""
        from framework.engine.state_cache import StateCacheSpec

        return StateCacheSpec(
            (self.conv_dim, self.conv_kernel - 1), (self.num_v_heads, self.head_k_dim, self.head_v_dim), dtype
        )

    def forward(self, mixed_qkv: torch.Tensor, conv_weight: torch.Tensor, g: torch.Tensor, beta: torch.Tensor):
        context = get_forward_context()
        metadata, cache = context.metadata, context.state_caches[self.state_index]
        indices = metadata.linear_attention_indices()
        mixed_qkv = self._conv(mixed_qkv, conv_weight, cache.conv, indices)
        q, k, v = mixed_qkv.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        tokens = mixed_qkv.shape[0]
        return self._delta_rule(
            q.reshape(tokens, self.num_k_heads, self.head_k_dim),
            k.reshape(tokens, self.num_k_heads, self.head_k_dim),
            v.reshape(tokens, self.num_v_heads, self.head_v_dim),
            g,
            beta,
            cache.recurrent,
            indices,
        )

    def extra_repr(self) -> str:
        return (
            f"state_index={self.state_index}, k_heads={self.num_k_heads}x{self.head_k_dim}, "
            f"v_heads={self.num_v_heads}x{self.head_v_dim}, conv_kernel={self.conv_kernel}"
        )
