"""Round-to-nearest integers of one weight, per group of input features."""

from __future__ import annotations

import torch
from torch import Tensor

from ..packing import IntWeight


def group_params(w: Tensor, bits: int, symmetric: bool) -> tuple[Tensor, Tensor]:
    """``(scale, zero)`` per row of ``w [rows, cols]`` (float32; zero an integer value) so that
    ``round(w / scale) + zero`` spans the ``bits``-bit range; scales are rounded to fp16 (as stored)."""
    if symmetric:
        scale = (w.abs().amax(-1) / (2 ** (bits - 1) - 1)).clamp_min(1e-8).half().float()
        return scale, torch.full_like(scale, 2 ** (bits - 1))
    low, high = w.amin(-1).clamp(max=0), w.amax(-1).clamp(min=0)
    scale = ((high - low) / (2**bits - 1)).clamp_min(1e-8).half().float()
    # zero 0 has no GPTQ v1 encoding: keep zeros in 1..2**bits - 1
    return scale, torch.round(-low / scale).clamp(1, 2**bits - 1)


def quantize_values(w: Tensor, scale: Tensor, zero: Tensor, bits: int) -> Tensor:
    """``clamp(round(w / scale) + zero)`` with ``scale`` / ``zero`` broadcast along ``w``'s rows."""
    return (torch.round(w / scale) + zero).clamp(0, 2**bits - 1)


def round_to_nearest(w: Tensor, bits: int, group_size: int, symmetric: bool) -> IntWeight:
    """RTN of ``w [N, K]`` with groups of ``group_size`` input features (-1: one per output feature)."""
    n, k = w.shape
    group = k if group_size == -1 else group_size
    padded = -(-k // group) * group  # a short last group: zero padding changes neither absmax nor min/max (both hold 0)
    grouped = torch.nn.functional.pad(w.float(), (0, padded - k)).reshape(n, padded // group, group)
    scale, zero = group_params(grouped, bits, symmetric)
    q = quantize_values(grouped, scale[..., None], zero[..., None], bits).reshape(n, padded)[:, :k]
    zeros = None if symmetric else zero.t().to(torch.uint8).contiguous()
    return IntWeight(q.t().to(torch.uint8).contiguous(), scale.t().contiguous(), zeros, None, bits, group)
