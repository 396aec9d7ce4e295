"""Channel- and tensor-scaled FP8 weights through ``torch._scaled_mm`` (cuBLASLt, sm_89+, bf16 out).

The activations are quantized per token (dynamic: ``max |x[m]| / 448``), or with the checkpoint's
static per-tensor ``input_scale``; the weight scales enter row-wise (one per output feature), so
fused shards with different per-tensor scales need no requantization.
"""

from __future__ import annotations

import torch

from ..quantize import FP8_DTYPE, FP8_MAX
from .layout import Fp8Weight

MIN_AMAX = 1e-10


def quantize_per_token(x: torch.Tensor, input_scale: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q [M, K] fp8, s [M, 1] float32)``: per-token dynamic scales, or ``input_scale`` for every token."""
    if input_scale is None:
        s = x.abs().amax(-1, keepdim=True).float().clamp_min(MIN_AMAX) / FP8_MAX
    else:
        s = input_scale.float().reshape(1, 1).expand(x.shape[0], 1)
    q = (x.float() / s).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q, s.contiguous()


def scaled_mm_linear(x: torch.Tensor, weight: Fp8Weight, input_scale: torch.Tensor | None = None) -> torch.Tensor:
    """``x [M, K] (bf16) @ W.T`` for a one-column ``weight.scale`` ``[N, 1]``."""
    q, s = quantize_per_token(x, input_scale)
    return torch._scaled_mm(q, weight.qweight.t(), scale_a=s, scale_b=weight.scale.view(1, -1), out_dtype=x.dtype)
