"""MXFP4 dense layers of compressed-tensors ``format: mxfp4-pack-quantized`` (e2m1 values, an e8m0
scale per 32 inputs, no global scale)::

    weight_packed uint8 [N, K/2] (two codes a byte, the low nibble first)    weight_scale uint8 [N, K/32] (e8m0)
    W = e2m1 * 2^(weight_scale - 127)

After loading the scale bytes are rebased (``fw_fp4.formats.fold_scale_bias``) and the weight is
repacked into the FP4 kernels' layout, the same multiply as NVFP4's (``fw_fp4.kernels.fp4_linear``).
Activation quantization (MXFP4 W4A4 checkpoints) is not applied: W4A16.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import nn

from framework.errors import ConfigError

from .formats import MXFP4_BLOCK, fold_scale_bias
from .kernels.layout import to_kernel_layout
from .linear import (
    Fp4LinearConfig,
    Fp4LinearMethodBase,
    compressed_tensors_fp4_weights,
    register_checkpoint_param,
    register_kernel_weight,
)


class Mxfp4LinearMethod(Fp4LinearMethodBase):
    """One MXFP4 linear layer (module docstring)."""

    def create_weights(
        self, layer, input_size_per_partition, output_partition_sizes, input_size, output_size, params_dtype
    ) -> None:
        if input_size_per_partition % MXFP4_BLOCK:
            raise ConfigError(
                f"{layer.prefix}: MXFP4 needs input features in whole blocks of {MXFP4_BLOCK}; "
                f"this rank has {input_size_per_partition}"
            )
        rows = sum(output_partition_sizes)
        register = functools.partial(register_checkpoint_param, layer)
        register(
            "weight_packed",
            torch.empty(rows, input_size_per_partition // 2, dtype=torch.uint8),
            output_dim=0,
            input_dim=1,
        )
        register(
            "weight_scale",
            torch.empty(rows, input_size_per_partition // MXFP4_BLOCK, dtype=torch.uint8),
            output_dim=0,
            input_dim=1,
        )

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        scales = fold_scale_bias(layer.weight_scale.data, layer.prefix)
        weight = to_kernel_layout(layer.weight_packed.data, scales, None, "mxfp4")
        del layer.weight_packed, layer.weight_scale
        register_kernel_weight(layer, weight)


class CompressedTensorsMxfp4Config(Fp4LinearConfig):
    """compressed-tensors ``format: mxfp4-pack-quantized`` dense layers (llm-compressor's MXFP4 / MXFP4A16)
    and MoE experts (``fw_fp4.experts``)."""

    experts_layout = "compressed-tensors-mxfp4"

    @classmethod
    def get_name(cls) -> str:
        return "compressed-tensors-mxfp4"

    @classmethod
    def from_config(cls, config: dict[str, Any], model_config: Any = None) -> CompressedTensorsMxfp4Config:
        weights = compressed_tensors_fp4_weights(config, "compressed-tensors mxfp4")
        if weights.get("group_size") != MXFP4_BLOCK:
            raise ConfigError(
                f"compressed-tensors mxfp4: MXFP4 group size {weights.get('group_size')} is not "
                f"supported; MXFP4 has one e8m0 scale per {MXFP4_BLOCK} values"
            )
        return cls(config.get("ignore"))

    def linear_method(self) -> Mxfp4LinearMethod:
        return Mxfp4LinearMethod()
