"""FP8 layouts as framework.testing QuantSchemes, written by :mod:`fp8_reference` (not fw_fp8's quantizer)."""

from __future__ import annotations

import torch
from fp8_reference import dequantize_reference, quantize_reference, random_weight
from fw_fp8.config import CompressedTensorsFp8Config, Fp8Config
from tiny_fp8_checkpoints import HF_BLOCK_CONFIG, compressed_tensors_config


class Fp8FormatScheme:
    block_size = 128

    def __init__(self, granularity: str) -> None:
        self.granularity = granularity

    def __repr__(self) -> str:
        return f"fp8-{self.granularity}"

    def one_weight(self, n: int, k: int, generator: torch.Generator) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        q, scale = quantize_reference(random_weight(n, k, generator), self.granularity)
        name = "weight_scale_inv" if self.granularity == "block" else "weight_scale"
        return {"weight": q, name: scale}, dequantize_reference(q, scale, self.granularity)

    def make_weight(self, name, shape, generator):
        stem = name.removesuffix(".weight")
        if len(shape) == 2:
            tensors, w = self.one_weight(shape[0], shape[1], generator)
            return {f"{stem}.{key}": value for key, value in tensors.items()}, w
        experts = [self.one_weight(shape[1], shape[2], generator) for _ in range(shape[0])]
        stacked = {f"{stem}.{key}": torch.stack([t[key] for t, _ in experts]) for key in experts[0][0]}
        return stacked, torch.stack([w for _, w in experts])

    def quant_config(self, tensors):
        if self.granularity == "block":
            return Fp8Config.from_config(HF_BLOCK_CONFIG)
        return CompressedTensorsFp8Config.from_config(compressed_tensors_config(self.granularity, False))


SCHEMES = [Fp8FormatScheme("block"), Fp8FormatScheme("channel"), Fp8FormatScheme("tensor")]
