"""NVFP4 dense layers (e2m1 values, an fp8 e4m3 scale per 16 inputs, an fp32 global scale per tensor).

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

import fnmatch
import os
import re
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from framework.errors import ConfigError
from framework.layers.linear import set_weight_attrs
from framework.quantization import LinearMethod, QuantConfig, QuantMethodBase

from .config import ACT_DTYPES
from .formats import NVFP4_GROUP, nvfp4_row_scale
from .kernels.layout import Fp4KernelWeight, dequantize_kernel_weight, to_kernel_layout

#: Per layout: the packed tensor's name, the global scale's, the input scale's, and the convention.
LAYOUTS = {
    "modelopt": ("weight", "weight_scale_2", "input_scale", "multiply"),
    "compressed-tensors": ("weight_packed", "weight_global_scale", "input_global_scale", "divide"),
}


class Nvfp4LinearMethod(LinearMethod):
    """One NVFP4 linear layer of ``layout`` (see the module docstring)."""

    supported_act_dtypes = ACT_DTYPES

    def __init__(self, layout: str) -> None:
        self.layout = layout
        self.packed_name, self.global_name, self.input_name, self.convention = LAYOUTS[layout]

    def create_weights(self, layer, input_size_per_partition, output_partition_sizes, input_size, output_size,
                       params_dtype) -> None:
        if input_size_per_partition % NVFP4_GROUP:
            raise ConfigError(f"{layer.prefix}: NVFP4 needs input features in whole groups of {NVFP4_GROUP}; "
                              f"this rank has {input_size_per_partition}")
        rows, shards = sum(output_partition_sizes), len(output_partition_sizes)

        def register(name: str, tensor: Tensor, **attrs: Any) -> None:
            param = nn.Parameter(tensor, requires_grad=False)
            set_weight_attrs(param, {"weight_loader": layer.weight_loader, **attrs})
            layer.register_parameter(name, param)

        register(self.packed_name, torch.empty(rows, input_size_per_partition // 2, dtype=torch.uint8),
                 output_dim=0, input_dim=1)
        register("weight_scale", torch.empty(rows, input_size_per_partition // NVFP4_GROUP,
                                             dtype=torch.float8_e4m3fn), output_dim=0, input_dim=1)
        register(self.global_name, torch.empty(shards, dtype=torch.float32), per_shard=True)
        register(self.input_name, torch.empty(shards, dtype=torch.float32), per_shard=True)
        layer.nvfp4_shard_rows = list(output_partition_sizes)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        shard_scales = nvfp4_row_scale(getattr(layer, self.global_name).data, self.convention)
        rows = torch.tensor(layer.nvfp4_shard_rows, device=shard_scales.device)
        weight = to_kernel_layout(getattr(layer, self.packed_name).data, layer.weight_scale.data,
                                  shard_scales.repeat_interleave(rows), "nvfp4")
        for name in (self.packed_name, "weight_scale", self.global_name, self.input_name):
            delattr(layer, name)
        register_kernel_weight(layer, weight)

    def dequantize(self, layer: nn.Module) -> Tensor:
        return dequantize_kernel_weight(kernel_weight(layer), layer.params_dtype)

    def apply(self, layer: nn.Module, x: Tensor, bias: Tensor | None = None) -> Tensor:
        return fp4_linear(kernel_weight(layer), x, bias)


def register_kernel_weight(layer: nn.Module, weight: Fp4KernelWeight) -> None:
    """Keep ``weight``'s tensors as the layer's buffers (``to()`` moves them) and its format beside them."""
    layer.register_buffer("fp4_codes", weight.codes)
    layer.register_buffer("fp4_scales", weight.scales)
    layer.register_buffer("fp4_row_scales", weight.row_scales)
    layer.fp4_format = weight.fmt


def kernel_weight(layer: nn.Module) -> Fp4KernelWeight:
    """The layer's kernel-layout weight (its buffers, wherever they are now)."""
    return Fp4KernelWeight(layer.fp4_codes, layer.fp4_scales, layer.fp4_row_scales, layer.fp4_format)


def fp4_linear(weight: Fp4KernelWeight, x: Tensor, bias: Tensor | None) -> Tensor:
    """``x @ W.T + bias``: the Triton kernels on CUDA and under the interpreter, else torch on the
    dequantized weight."""
    x2d = x.reshape(-1, x.shape[-1])
    if (x2d.is_cuda or os.environ.get("TRITON_INTERPRET") == "1") and x2d.shape[0] > 0:
        from .kernels.fp4_linear import fp4_matmul  # Triton: imported only where kernels run

        out = fp4_matmul(x2d, weight)
        if bias is not None:
            out += bias
    else:
        out = F.linear(x2d, dequantize_kernel_weight(weight, x.dtype), bias)
    return out.view(*x.shape[:-1], out.shape[-1])


class Nvfp4Config(QuantConfig):
    """NVFP4 linear layers of a modelopt or compressed-tensors checkpoint; ``skipped`` stay 16-bit."""

    supported_act_dtypes = ACT_DTYPES
    layout = "modelopt"

    def __init__(self, skipped: list[str] | None = None) -> None:
        self.skipped = list(skipped or [])

    def get_quant_method(self, layer: nn.Module, prefix: str) -> QuantMethodBase | None:
        from framework.layers.embedding import LMHead, VocabEmbedding
        from framework.layers.linear import LinearBase

        if not isinstance(layer, LinearBase) or isinstance(layer, VocabEmbedding | LMHead):
            return None
        return None if self.is_skipped(prefix) else Nvfp4LinearMethod(self.layout)

    def is_skipped(self, prefix: str) -> bool:
        """``prefix`` is listed: by name (``lm_head``), a glob (``model.layers.*.mlp.gate``, a module
        or anything under it) or a regular expression (``re:...``)."""
        for pattern in self.skipped:
            if pattern.startswith("re:"):
                if re.match(pattern[3:], prefix):
                    return True
            elif prefix.endswith(f".{pattern}") or fnmatch.fnmatch(prefix, pattern) or fnmatch.fnmatch(prefix, f"{pattern}.*"):
                return True
        return prefix in self.skipped


def _check_group(method: str, group_size: Any) -> None:
    if group_size != NVFP4_GROUP:
        raise ConfigError(f"{method}: NVFP4 group size {group_size} is not supported; NVFP4 has one fp8 e4m3 "
                          f"scale per {NVFP4_GROUP} values")


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
        groups = list((config.get("config_groups") or {}).values())
        if len(groups) != 1:
            raise ConfigError(f"compressed-tensors nvfp4: {len(groups)} config_groups; fw supports one scheme")
        weights = groups[0].get("weights") or {}
        if weights.get("type") != "float" or weights.get("num_bits") != 4:
            raise ConfigError(f"compressed-tensors nvfp4: weights {weights.get('num_bits')}-bit "
                              f"{weights.get('type')!r}; nvfp4-pack-quantized stores 4-bit float")
        _check_group("compressed-tensors nvfp4", weights.get("group_size"))
        return cls(config.get("ignore"))


