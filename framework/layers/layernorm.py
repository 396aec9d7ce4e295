"""Normalisation layers. :class:`RMSNorm` runs on the kernel registry's ``rms_norm`` ops."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from framework import distributed
from framework.kernels import get_kernel


class RMSNorm(nn.Module):
    """RMS norm with an optional fused residual add.

    ``forward(x)`` returns the normalised ``x``; ``forward(x, residual)`` first adds the
    residual stream and returns ``(normalised, new_residual)`` (one fused kernel where a plugin
    provides it). ``offset=1.0`` gives Gemma's ``x * (1 + weight)`` with its float32 scaling
    (see :func:`framework.ops.rms_norm`); the weight starts at ``1 - offset`` (the identity).
    """

    def __init__(
        self, hidden_size: int, eps: float = 1e-6, offset: float = 0.0, params_dtype: torch.dtype | None = None
    ) -> None:
        super().__init__()
        self.hidden_size, self.eps, self.offset = hidden_size, eps, offset
        self.weight = nn.Parameter(torch.full((hidden_size,), 1.0 - offset, dtype=params_dtype), requires_grad=False)
        self._rms_norm = get_kernel("rms_norm")
        self._fused_add_rms_norm = get_kernel("fused_add_rms_norm")
        #: Under tensor parallelism, ``forward(x, residual)`` receives this rank's partial sum ``x``
        #: (a row-parallel layer that left its all-reduce to the norm) and all-reduces it first, in
        #: one kernel with the add and the norm where :mod:`framework.distributed` has one.
        self.reduces_input = False

    def forward(self, x: Tensor, residual: Tensor | None = None) -> Tensor | tuple[Tensor, Tensor]:
        if residual is None:
            return self._rms_norm(x, self.weight, self.eps, self.offset)
        if self.reduces_input:
            return distributed.all_reduce_add_rms_norm(
                x, residual, self.weight, self.eps, self.offset, self._fused_add_rms_norm
            )
        return self._fused_add_rms_norm(x, residual, self.weight, self.eps, self.offset)

    def extra_repr(self) -> str:
        return f"{self.hidden_size}, eps={self.eps}, offset={self.offset}"


class LayerNorm(nn.LayerNorm):
    """``nn.LayerNorm`` with :class:`RMSNorm`'s ``forward(x, residual=None)`` interface (StableLM, Phi)."""

    def forward(self, x: Tensor, residual: Tensor | None = None) -> Tensor | tuple[Tensor, Tensor]:  # type: ignore[override]
        if residual is None:
            return super().forward(x)
        residual = x + residual
        return super().forward(residual), residual


def residual_norm(norm: nn.Module, hidden: Tensor, residual: Tensor | None) -> tuple[Tensor, Tensor]:
    """A decoder layer's input norm: ``(norm(hidden), hidden)`` in the first layer (no residual
    yet), else ``norm``'s fused residual add: ``(norm(hidden + residual), hidden + residual)``."""
    if residual is None:
        return norm(hidden), hidden
    return norm(hidden, residual)


def norm_per_head(norm: nn.Module, x: Tensor, head_size: int) -> Tensor:
    """``norm`` over each ``head_size`` slice of ``x [T, heads * head_size]`` (QK norms)."""
    return norm(x.unflatten(-1, (-1, head_size))).flatten(-2)
