"""MXFP4 as checkpoints store it, and its decoding by bit manipulation (no lookup table).

One MXFP4 block is 32 consecutive input features of one output row: 16 bytes of e2m1 codes (two
per byte, the low nibble first) and one e8m0 scale byte ``s`` (the power ``2^(s - 127)``)::

    blocks  uint8 [..., rows, K / 32, 16]     scales  uint8 [..., rows, K / 32]
    code (4 bits) = sign | exponent (2 bits) | mantissa (1 bit)
    value = (-1)^sign * (exponent ? 2^(exponent - 1) * (1 + mantissa / 2) : mantissa / 2)   in {0, .5, 1, 1.5, 2, 3, 4, 6}

Decoding: the code's low three bits placed as an fp16's exponent low bits and top mantissa bit
(``code << 9``) read as fp16 are the value times ``2^-14`` (subnormal for exponent 0, exact
either way), so ``value = fp16_bits(code) * 2^(s - 127 + 14)``. At load the scale bytes are
rebased once by ``+14`` (:func:`fold_scale_bias`), so a kernel's scale is the fp32 whose exponent
field is the stored byte: ``bitcast_f32(byte << 23)``. No table, two shifts and a multiply.
"""

from __future__ import annotations

import torch
from torch import Tensor

from framework.errors import ConfigError

#: Input features per MXFP4 block (one scale each) and the bytes that hold them.
MXFP4_BLOCK = 32
MXFP4_BLOCK_BYTES = 16
#: What the fp16 placement of a code loses: ``2^14`` (:func:`decode_e2m1`).
FP16_PLACEMENT_EXPONENT = 14
#: The largest stored scale whose rebased byte is still an fp32 exponent below inf/NaN (255).
MAX_SCALE_BYTE = 254 - FP16_PLACEMENT_EXPONENT


def check_mxfp4_tensors(blocks: Tensor, scales: Tensor, where: str) -> None:
    """Refuse tensors that are not MXFP4's layout (uint8 blocks of 16 bytes, one scale per block)."""
    if blocks.dtype != torch.uint8 or blocks.shape[-1] != MXFP4_BLOCK_BYTES:
        raise ConfigError(
            f"{where}: MXFP4 blocks must be uint8 [..., K/32, 16] (32 e2m1 codes per scale), got "
            f"{blocks.dtype} {tuple(blocks.shape)}; other group sizes or scale layouts are not MXFP4"
        )
    if scales.dtype != torch.uint8 or tuple(scales.shape) != tuple(blocks.shape[:-1]):
        raise ConfigError(
            f"{where}: MXFP4 scales must be uint8 e8m0 bytes, one per block {tuple(blocks.shape[:-1])}, got "
            f"{scales.dtype} {tuple(scales.shape)}"
        )


def fold_scale_bias(scales: Tensor, where: str) -> Tensor:
    """The stored e8m0 bytes rebased by ``+14`` for :func:`decode_e2m1`'s fp16 placement (uint8)."""
    if scales.numel() and int(scales.max()) > MAX_SCALE_BYTE:
        raise ConfigError(
            f"{where}: an MXFP4 scale byte is {int(scales.max())} (2^{int(scales.max()) - 127}); "
            f"fw serves scales up to {MAX_SCALE_BYTE} (255 is e8m0's NaN)"
        )
    return (scales.to(torch.int32) + FP16_PLACEMENT_EXPONENT).to(torch.uint8)


def decode_e2m1(codes: Tensor) -> Tensor:
    """4-bit codes (any integer dtype, values 0..15) -> their e2m1 values times ``2^-14``, fp16."""
    codes = codes.to(torch.int16)
    bits = ((codes & 0x8) << 12) | ((codes & 0x7) << 9)
    return bits.view(torch.float16)


def folded_scale_values(folded: Tensor) -> Tensor:
    """Rebased scale bytes -> the fp32 powers of two they stand for (exponent field = the byte)."""
    return (folded.to(torch.int32) << 23).view(torch.float32)


def dequantize_mxfp4(blocks: Tensor, folded_scales: Tensor, dtype: torch.dtype) -> Tensor:
    """``[..., rows, K/32, 16]`` blocks and rebased scales ``[..., rows, K/32]`` -> ``[..., rows, K]`` in ``dtype``."""
    low, high = decode_e2m1(blocks & 0xF), decode_e2m1(blocks >> 4)
    values = torch.stack([low, high], dim=-1).flatten(-2).float()  # [..., K/32, 32]: low nibble first
    values = values * folded_scale_values(folded_scales).unsqueeze(-1)
    return values.flatten(-2).to(dtype)


#: Input features per NVFP4 group (one fp8 e4m3 scale each).
NVFP4_GROUP = 16


def dequantize_nvfp4(packed: Tensor, scales: Tensor, row_scales: Tensor | None, dtype: torch.dtype) -> Tensor:
    """NVFP4 rows -> ``[..., rows, K]`` in ``dtype``: ``packed`` uint8 ``[..., rows, K/2]`` (low nibble
    first), ``scales`` float8_e4m3fn ``[..., rows, K/16]``, ``row_scales`` float32 ``[..., rows]`` (the
    global scale of each row's shard, in the multiplying convention: :func:`nvfp4_row_scale`), or
    None for ``e2m1 * scale`` alone (MoE experts multiply their global scale apart)."""
    codes = torch.stack([packed & 0xF, packed >> 4], dim=-1).flatten(-2)  # [..., rows, K]
    values = decode_e2m1(codes).float().unflatten(-1, (-1, NVFP4_GROUP))  # times 2^-14
    factor = scales.float() * 2.0**FP16_PLACEMENT_EXPONENT
    if row_scales is not None:
        factor = factor * row_scales.float()[..., None]
    return (values * factor.unsqueeze(-1)).flatten(-2).to(dtype)


def nvfp4_row_scale(global_scale: Tensor, convention: str) -> Tensor:
    """The factor a format's global scale contributes: modelopt stores ``weight_scale_2`` to
    multiply by, compressed-tensors ``weight_global_scale`` to divide by."""
    return global_scale.float() if convention == "multiply" else 1.0 / global_scale.float()
