"""An independent MXFP4 packer and reader for the tests: a lookup table of the 16 e2m1 values and
round-to-nearest, as the OCP MX spec describes (not fw's bit manipulation)."""

from __future__ import annotations

import torch

#: e2m1 code -> value (code 8..15: the negatives), the OCP MX table.
E2M1_VALUES = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])


def quantize_mxfp4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``[..., K]`` floats -> ``(blocks uint8 [..., K/32, 16], scales uint8 [..., K/32])``: per 32
    values the power of two putting the largest magnitude at most 6, codes by nearest value."""
    groups = weight.float().unflatten(-1, (-1, 32))
    amax = groups.abs().amax(-1).clamp(min=2.0**-100)
    exponent = torch.ceil(torch.log2(amax / 6.0))
    scaled = groups / torch.exp2(exponent).unsqueeze(-1)
    codes = (scaled.unsqueeze(-1) - E2M1_VALUES).abs().argmin(-1).to(torch.uint8)  # [..., K/32, 32]
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return blocks, (exponent + 127).to(torch.uint8)


def dequantize_mxfp4_lut(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The table reading of ``(blocks, scales)``: ``[..., K]`` float32."""
    codes = torch.stack([blocks & 15, blocks >> 4], dim=-1).flatten(-2).long()  # [..., K/32, 32]
    values = E2M1_VALUES[codes] * torch.exp2(scales.float() - 127).unsqueeze(-1)
    return values.flatten(-2)
