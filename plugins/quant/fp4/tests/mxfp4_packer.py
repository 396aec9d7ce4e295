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


def _e2m1_codes(scaled: torch.Tensor) -> torch.Tensor:
    return (scaled.unsqueeze(-1) - E2M1_VALUES).abs().argmin(-1).to(torch.uint8)


def quantize_nvfp4(weight: torch.Tensor, convention: str) -> dict[str, torch.Tensor]:
    """``[N, K]`` -> NVFP4 as modelopt (``convention="multiply"``: ``weight``, ``weight_scale``,
    ``weight_scale_2``) or compressed-tensors (``"divide"``: ``weight_packed``, ``weight_scale``,
    ``weight_global_scale``) writes it: per 16 values an e4m3 scale, one fp32 global per tensor."""
    groups = weight.float().unflatten(-1, (-1, 16))
    amax = weight.abs().max().clamp(min=1e-12)
    global_multiplier = amax / (6.0 * 448.0)  # what the e4m3 scales are multiplied by
    scales = (groups.abs().amax(-1) / 6.0 / global_multiplier).to(torch.float8_e4m3fn)
    step = scales.float() * global_multiplier
    codes = _e2m1_codes(groups / step.clamp(min=1e-30).unsqueeze(-1))
    packed = codes[..., 0::2] | (codes[..., 1::2] << 4)
    packed = packed.flatten(-2)
    if convention == "multiply":
        return {
            "weight": packed,
            "weight_scale": scales,
            "weight_scale_2": global_multiplier.reshape(()),
            "input_scale": torch.tensor(1.0),
        }
    return {
        "weight_packed": packed,
        "weight_scale": scales,
        "weight_global_scale": (1.0 / global_multiplier).reshape(1),
        "input_global_scale": torch.tensor([1.0]),
    }


def dequantize_nvfp4_lut(tensors: dict[str, torch.Tensor]) -> torch.Tensor:
    """The table reading of :func:`quantize_nvfp4`'s tensors, in either convention: ``[N, K]`` float32."""
    packed = tensors.get("weight", tensors.get("weight_packed"))
    codes = torch.stack([packed & 15, packed >> 4], dim=-1).flatten(-2).long().unflatten(-1, (-1, 16))
    if "weight_scale_2" in tensors:
        factor = tensors["weight_scale"].float() * tensors["weight_scale_2"].float()
    else:
        factor = tensors["weight_scale"].float() / tensors["weight_global_scale"].float()
    return (E2M1_VALUES[codes] * factor.unsqueeze(-1)).flatten(-2)
