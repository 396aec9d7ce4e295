"""Round a dense weight to block-scaled FP8 (E4M3), the layout of Hugging Face ``quant_method: fp8``.

``quantize_weight_fp8(weight, block_size=(128, 128))`` is the one quantizer: ``--quantization fp8``
calls it on each weight after loading, and ``--isq`` may call it too. Each ``block_rows x
block_cols`` tile of the weight (the last row and column of tiles may be short) gets the scale
``max |tile| / 448`` and its values ``round(w / scale)`` in float8_e4m3fn; the checkpoint stores
the scale itself, under the name ``weight_scale_inv`` (DeepSeek's name: the inverse of the
quantization multiplier), so ``w ~= q * scale_inv`` per tile.
"""

from __future__ import annotations

import torch
from torch import Tensor

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8_DTYPE).max  # 448
#: The smallest scale a tile gets (an all-zero tile must not divide by zero).
MIN_SCALE = 1e-12


def quantize_weight_fp8(weight: Tensor, block_size: tuple[int, int] = (128, 128)) -> tuple[Tensor, Tensor]:
    """``(qweight float8_e4m3fn [N, K], scale_inv float32 [ceil(N / bn), ceil(K / bk)])`` for a 2-D
    ``weight`` ``[N, K]`` of any float dtype, on its device; ``block_size`` is ``(bn, bk)``."""
    if weight.dim() != 2:
        raise ValueError(f"quantize_weight_fp8 takes a 2-D weight [out, in], got shape {tuple(weight.shape)}")
    block_rows, block_cols = block_size
    n, k = weight.shape
    row_blocks, col_blocks = -(-n // block_rows), -(-k // block_cols)
    padded = torch.zeros(row_blocks * block_rows, col_blocks * block_cols, dtype=torch.float32, device=weight.device)
    padded[:n, :k] = weight.float()
    tiles = padded.view(row_blocks, block_rows, col_blocks, block_cols)
    scale = (tiles.abs().amax(dim=(1, 3)) / FP8_MAX).clamp_min(MIN_SCALE)  # [row_blocks, col_blocks]
    q = (tiles / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q.view(row_blocks * block_rows, col_blocks * block_cols)[:n, :k].contiguous(), scale


def dequantize_block_fp8(
    qweight: Tensor, scale_inv: Tensor, block_size: tuple[int, int] = (128, 128), dtype: torch.dtype = torch.float32
) -> Tensor:
    """``qweight * scale_inv`` per tile: the inverse of :func:`quantize_weight_fp8` (up to rounding)."""
    n, k = qweight.shape
    scale = scale_inv.float().repeat_interleave(block_size[0], 0)[:n].repeat_interleave(block_size[1], 1)[:, :k]
    return (qweight.float() * scale).to(dtype)
