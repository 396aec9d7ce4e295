"""The one FP8 weight layout every kernel reads, whatever the checkpoint's scale granularity.

::

    qweight  float8_e4m3fn [N, K]          the checkpoint's values, rows of K contiguous bytes
    scale    float32 [ceil(N / scale_rows), ceil(K / scale_cols)]
             block weights:   scale_rows 128 (or 1: one row per output feature, when a fused shard or a
                              rank's slice does not start on a 128-row block), scale_cols 128
             channel / tensor weights: scale_rows 1, one column (scale_cols = K)

so ``W[n, k] = qweight[n, k] * scale[n // scale_rows, k // scale_cols]``. A kernel reading a
``BLOCK_K`` slice that never crosses a scale column (``BLOCK_K`` divides ``scale_cols``) loads one
scale per output feature per slice.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor


class Fp8Weight(NamedTuple):
    qweight: Tensor
    scale: Tensor
    scale_rows: int
    scale_cols: int

    @property
    def out_features(self) -> int:
        return self.qweight.shape[0]

    @property
    def in_features(self) -> int:
        return self.qweight.shape[1]


def dequantize_fp8_weight(weight: Fp8Weight, dtype: torch.dtype) -> Tensor:
    """``W`` ``[..., N, K]`` in ``dtype`` (leading dims: experts): the torch reference of every kernel."""
    return dequantize_fp8(weight.qweight, weight.scale, weight.scale_rows, weight.scale_cols, dtype)


def dequantize_fp8(qweight: Tensor, scale: Tensor, scale_rows: int, scale_cols: int, dtype: torch.dtype) -> Tensor:
    """``qweight [..., N, K] * scale [..., N / scale_rows, K / scale_cols]`` per tile, in ``dtype``."""
    n, k = qweight.shape[-2:]
    full = scale.float().repeat_interleave(scale_rows, -2)[..., :n, :]
    full = full.repeat_interleave(scale_cols, -1)[..., :k] if scale.shape[-1] > 1 else full
    return (qweight.float() * full).to(dtype)


def collapse_row_scales(scale: Tensor, block_rows: int) -> tuple[Tensor, int]:
    """``(scale, scale_rows)``: per-feature rows ``[..., N, C]`` folded into blocks of ``block_rows`` when
    every block's rows agree (exact), else kept per feature (``scale_rows`` 1)."""
    n = scale.shape[-2]
    if n % block_rows:
        return scale.contiguous(), 1
    blocks = scale.unflatten(-2, (n // block_rows, block_rows))
    first = blocks.select(-2, 0)
    if torch.equal(blocks, first.unsqueeze(-2).expand_as(blocks)):
        return first.contiguous(), block_rows
    return scale.contiguous(), 1
