"""The FP4 dense kernels' weight layout (no Triton here: the CPU path reads it in torch)::

    codes      int32 [K/8, N]   word (j, n): inputs 8j .. 8j+7 of output n, input 8j+i in bits 4i .. 4i+3
    scales     uint8 [K/G, N]   one byte per group of G inputs: NVFP4 e4m3 (G = 16), MXFP4 e8m0 + 14 (G = 32)
    row_scales fp32  [N]        NVFP4's global scale per output row (its shard's); None for MXFP4

A little-endian word of a checkpoint row (``[N, K/2]`` bytes, low nibble first) already holds one
``codes`` word, so the repack is a view and a transpose: a kernel program streams consecutive
words of each K row across ``BLOCK_N`` outputs (``fw_fp4.kernels.fp4_linear``).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from ..formats import FP16_PLACEMENT_EXPONENT, decode_e2m1, folded_scale_values

#: Input features per scale: NVFP4 (e4m3 scales), MXFP4 (e8m0 scales).
GROUP_SIZES = {"nvfp4": 16, "mxfp4": 32}


class Fp4KernelWeight(NamedTuple):
    """One FP4 weight in the kernels' layout (module docstring); ``fmt`` is ``nvfp4`` or ``mxfp4``."""

    codes: Tensor
    scales: Tensor
    row_scales: Tensor | None
    fmt: str

    @property
    def in_features(self) -> int:
        return self.codes.shape[0] * 8

    @property
    def out_features(self) -> int:
        return self.codes.shape[1]


def to_kernel_layout(packed: Tensor, scales: Tensor, row_scales: Tensor | None, fmt: str) -> Fp4KernelWeight:
    """Checkpoint rows -> :class:`Fp4KernelWeight`: ``packed`` uint8 ``[N, K/2]`` (low nibble first),
    ``scales`` ``[N, K/G]`` (float8_e4m3fn for NVFP4; rebased e8m0 bytes, ``fw_fp4.formats.fold_scale_bias``,
    for MXFP4), ``row_scales`` fp32 ``[N]`` in the multiplying convention (NVFP4 only)."""
    if fmt not in GROUP_SIZES:
        raise ValueError(f"FP4 kernel format {fmt!r}; valid: {sorted(GROUP_SIZES)}")
    n, half_k = packed.shape
    assert packed.dtype == torch.uint8 and half_k % 4 == 0, (packed.dtype, packed.shape)
    assert tuple(scales.shape) == (n, 2 * half_k // GROUP_SIZES[fmt]), (scales.shape, packed.shape)
    codes = packed.contiguous().view(torch.int32).t().contiguous()
    scale_bytes = scales.contiguous().view(torch.uint8).t().contiguous()
    rows = None if row_scales is None else row_scales.float().contiguous()
    return Fp4KernelWeight(codes, scale_bytes, rows, fmt)


def dequantize_kernel_weight(weight: Fp4KernelWeight, dtype: torch.dtype) -> Tensor:
    """``W`` ``[N, K]`` in ``dtype`` from the kernel layout (torch; the CPU path and the reference)."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=weight.codes.device)
    codes = ((weight.codes[:, None, :] >> shifts[None, :, None]) & 15).flatten(0, 1)  # [K, N]
    values = decode_e2m1(codes).float()  # times 2^-14
    if weight.fmt == "mxfp4":
        factor = folded_scale_values(weight.scales)
    else:
        factor = weight.scales.view(torch.float8_e4m3fn).float() * 2.0**FP16_PLACEMENT_EXPONENT
        if weight.row_scales is not None:
            factor = factor * weight.row_scales[None, :]
    factor = factor.repeat_interleave(GROUP_SIZES[weight.fmt], dim=0)
    return (values * factor).t().to(dtype)
