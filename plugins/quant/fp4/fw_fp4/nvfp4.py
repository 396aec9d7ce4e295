"""NVFP4 dense layers (e2m1 values, an fp8 e4m3 scale per 16 inputs, an fp32 global scale per tensor);
the configs here hand MoE experts to ``fw_fp4.experts``.

Two checkpoint layouts, with opposite global-scale conventions::

    modelopt (quant_method modelopt, quant_algo NVFP4)         W = e2m1 * weight_scale * weight_scale_2
        weight uint8 [N, K/2], weight_scale e4m3 [N, K/16], weight_scale_2 f32 [], input_scale f32 []
    compressed-tensors (format nvfp4-pack-quantized)            W = e2m1 * weight_scale / weight_global_scale
        weight_packed uint8 [N, K/2], weight_scale e4m3 [N, K/16], weight_global_scale f32 [1],
        input_global_scale f32 [1]

Fused layers (QKV, gate/up) keep one global scale per shard (``per_shard`` parameters); after
loading they become one float32 factor per output row, and the weight is repacked into the FP4
kernels' layout (``fw_fp4.kernels.layout``). The activations stay 16-bit (W4A16: the input scales
are read and unused). ``apply`` runs the Triton kernels (``fw_fp4.kernels.fp4_linear``) on CUDA and
under ``TRITON_INTERPRET=1``; elsewhere it dequantizes the packed weight in torch and multiplies.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import nn

from framework.errors import ConfigError

from .formats import NVFP4_GROUP, nvfp4_row_scale
from .kernels.layout import to_kernel_layout
from .linear import (
    Fp4LinearConfig,
    Fp4LinearMethodBase,
    compressed_tensors_fp4_weights,
    register_checkpoint_param,
    register_kernel_weight,
)

#: Per layout: the packed tensor's name, the global scale's, the input scale's, and the convention.
LAYOUTS = {
    "modelopt": ("weight", "weight_scale_2", "input_scale", "multiply"),
    "compressed-tensors": ("weight_packed", "weight_global_scale", "input_global_scale", "divide"),
}


class Nvfp4LinearMethod(Fp4LinearMethodBase):
    """One NVFP4 linear layer of ``layout`` (see the module docstring)."""

    def __init__(self, layout: str) -> None:
        self.layout = layout
        self.packed_name, self.global_name, self.input_name, self.convention = LAYOUTS[layout]

    def create_weights(
        self, layer, input_size_per_partition, output_partition_sizes, input_size, output_size, params_dtype
    ) -> None:
        if input_size_per_partition % NVFP4_GROUP:
            raise ConfigError(
                f"{layer.prefix}: NVFP4 needs input features in whole groups of {NVFP4_GROUP}; "
                f"this rank has {input_size_per_partition}"
            )
        rows, shards = sum(output_partition_sizes), len(output_partition_sizes)

        register = functools.partial(register_checkpoint_param, layer)
        register(
            self.packed_name,
            torch.empty(rows, input_size_per_partition // 2, dtype=torch.uint8),
            output_dim=0,
            input_dim=1,
        )
        register(
            "weight_scale",
            torch.empty(rows, input_size_per_partition // NVFP4_GROUP, dtype=torch.float8_e4m3fn),
            output_dim=0,
            input_dim=1,
        )
        register(self.global_name, torch.empty(shards, dtype=torch.float32), per_shard=True)
        register(self.input_name, torch.empty(shards, dtype=torch.float32), per_shard=True)
        layer.nvfp4_shard_rows = list(output_partition_sizes)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        shard_scales = nvfp4_row_scale(getattr(layer, self.global_name).data, self.convention)
        rows = torch.tensor(layer.nvfp4_shard_rows, device=shard_scales.device)
        weight = to_kernel_layout(
            getattr(layer, self.packed_name).data,
            layer.weight_scale.data,
            shard_scales.repeat_interleave(rows),
            "nvfp4",
        )
        for name in (self.packed_name, "weight_scale", self.global_name, self.input_name):
            delattr(layer, name)
        register_kernel_weight(layer, weight)


class Nvfp4Config(Fp4LinearConfig):
    """NVFP4 linear layers of a modelopt or compressed-tensors checkpoint; ``skipped`` stay 16-bit."""

    layout = "modelopt"

    @property
    def experts_layout(self) -> str:
        return self.layout

    def linear_method(self) -> Nvfp4LinearMethod:
        return Nvfp4LinearMethod(self.layout)


def _check_group(method: str, group_size: Any) -> None:
    if group_size != NVFP4_GROUP:
        raise ConfigError(
            f"{method}: NVFP4 group size {group_size} is not supported; NVFP4 has one fp8 e4m3 "
            f"scale per {NVFP4_GROUP} values"
        )


class ModelOptNvfp4Config(Nvfp4Config):
    """``quant_method: modelopt`` with ``quant_algo: NVFP4`` (TensorRT Model Optimizer checkpoints)."""

    layout = "modelopt"

    @classmethod
    def get_name(cls) -> str:
        return "modelopt-nvfp4"

    @classmethod
    def from_config(cls, config: dict[str, Any], model_config: Any = None) -> ModelOptNvfp4Config:
        quant = config.get("quantization", config)  # hf_quant_config.json nests it
        algo = quant.get("quant_algo", "NVFP4")
        if algo != "NVFP4":
            raise ConfigError(f"modelopt: quant_algo {algo!r} is not supported; supported: NVFP4 (W4A16 here)")
        _check_group("modelopt", quant.get("group_size", NVFP4_GROUP))
        return cls(quant.get("exclude_modules") or quant.get("ignore"))


class CompressedTensorsNvfp4Config(Nvfp4Config):
    """compressed-tensors ``format: nvfp4-pack-quantized`` (llm-compressor's NVFP4 / NVFP4A16)."""

    layout = "compressed-tensors"

    @classmethod
    def get_name(cls) -> str:
        return "compressed-tensors-nvfp4"

    @classmethod
    def from_config(cls, config: dict[str, Any], model_config: Any = None) -> CompressedTensorsNvfp4Config:
        weights = compressed_tensors_fp4_weights(config, "compressed-tensors nvfp4")
        _check_group("compressed-tensors nvfp4", weights.get("group_size"))
        return cls(config.get("ignore"))
