"""``quant_method: mxfp4``: gpt-oss's checkpoints, whose MoE experts are MXFP4 and all else bf16.

``config.json`` says ``{"quant_method": "mxfp4", "modules_to_not_convert": [...]}`` (the attention,
routers, embeddings and head, which stay in 16 bits). Only the FusedMoE experts are MXFP4 here;
MXFP4 dense layers come from compressed-tensors checkpoints (``fw_fp4.mxfp4_linear``). Settings fw
cannot serve (another group size or scale format) are refused before any weight is read.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from framework.errors import ConfigError
from framework.quantization import QuantConfig, QuantMethodBase

from .formats import MXFP4_BLOCK

#: Activations the MXFP4 experts multiply: 16-bit on the GPU's kernel; any float on the CPU reference.
ACT_DTYPES = frozenset({torch.float32, torch.float16, torch.bfloat16})


class Mxfp4Config(QuantConfig):
    """gpt-oss's MXFP4 experts (``*_blocks`` / ``*_scales``); every other layer unquantized."""

    supported_act_dtypes = ACT_DTYPES

    def __init__(self, skipped: list[str] | None = None) -> None:
        self.skipped = list(skipped or [])

    @classmethod
    def get_name(cls) -> str:
        return "mxfp4"

    @classmethod
    def from_config(cls, config: dict[str, Any], model_config: Any = None) -> Mxfp4Config:
        method = config.get("quant_method", "mxfp4")
        if method != "mxfp4":
            raise ConfigError(f"mxfp4: quant_method {method!r} is not this format's; expected 'mxfp4'")
        group_size = config.get("group_size", config.get("block_size", MXFP4_BLOCK))
        if group_size != MXFP4_BLOCK:
            raise ConfigError(
                f"mxfp4: group size {group_size} is not supported; MXFP4 has one e8m0 scale per {MXFP4_BLOCK} values"
            )
        scale_format = config.get("scale_format", "e8m0")
        if scale_format != "e8m0":
            raise ConfigError(f"mxfp4: scale format {scale_format!r} is not supported; supported: e8m0")
        return cls(config.get("modules_to_not_convert"))

    def get_quant_method(self, layer: nn.Module, prefix: str) -> QuantMethodBase | None:
        from framework.layers.fused_moe import FusedMoE

        if isinstance(layer, FusedMoE) and not any(prefix.startswith(p) or p in prefix for p in self.skipped):
            from .moe import Mxfp4FusedMoEMethod

            return Mxfp4FusedMoEMethod()
        return None
