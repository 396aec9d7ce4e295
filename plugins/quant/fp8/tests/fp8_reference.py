"""An independent FP8 writer for the tests: tile-by-tile loops (not fw_fp8's vectorised quantizer)
that write the exact Hugging Face / compressed-tensors / ModelOpt tensors, and decode them back.

``block``: ``weight_scale_inv [ceil(N/128), ceil(K/128)]``, one scale per 128x128 tile (the last
tiles may be short), ``scale = max |tile| / 448``; ``channel``: ``weight_scale [N, 1]``;
``tensor``: ``weight_scale`` a scalar.
"""

from __future__ import annotations

import torch

E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0


def _scale_of(values: torch.Tensor) -> float:
    amax = float(values.abs().max())
    return amax / E4M3_MAX if amax > 0 else 1.0


def quantize_reference(w: torch.Tensor, granularity: str, block: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q float8_e4m3fn [N, K], scale)`` of ``w [N, K]`` in ``granularity``, tile by tile."""
    n, k = w.shape
    w = w.float()
    q = torch.empty(n, k, dtype=E4M3)
    if granularity == "tensor":
        scale = torch.tensor(_scale_of(w))
        return (w / scale).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3), scale
    if granularity == "channel":
        scale = torch.empty(n, 1)
        for row in range(n):
            scale[row, 0] = _scale_of(w[row])
            q[row] = (w[row] / scale[row, 0]).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3)
        return q, scale
    scale = torch.empty(-(-n // block), -(-k // block))
    for i in range(0, n, block):
        for j in range(0, k, block):
            tile = w[i : i + block, j : j + block]
            scale[i // block, j // block] = _scale_of(tile)
            q[i : i + block, j : j + block] = (tile / scale[i // block, j // block]).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3)
    return q, scale


def dequantize_reference(q: torch.Tensor, scale: torch.Tensor, granularity: str, block: int = 128) -> torch.Tensor:
    """The float32 values ``q`` and ``scale`` stand for."""
    w = q.float()
    if granularity in ("tensor", "channel"):
        return w * scale
    for i in range(0, w.shape[0], block):
        for j in range(0, w.shape[1], block):
            w[i : i + block, j : j + block] *= scale[i // block, j // block]
    return w


def random_weight(n: int, k: int, generator: torch.Generator) -> torch.Tensor:
    """A weight of a trained model's magnitude, with some rows and tiles much larger than others."""
    w = torch.randn(n, k, generator=generator) * 0.02
    return w * torch.logspace(-1, 1, n)[torch.randperm(n, generator=generator)][:, None]
