"""What the FP4 dense formats share: the kernel-layout buffers of a linear layer, the multiply
(Triton on CUDA and under ``TRITON_INTERPRET=1``, torch on the dequantized weight elsewhere) and
the base config that hands every linear layer but the skipped ones (and the embeddings and the
head) to its format's method, and MoE experts to ``fw_fp4.experts``."""

from __future__ import annotations

import fnmatch
import os
import re
from typing import Any

import torch.nn.functional as F
from torch import Tensor, nn

from framework.errors import ConfigError
from framework.layers.linear import set_weight_attrs
from framework.quantization import LinearMethod, QuantConfig, QuantMethodBase

from .config import ACT_DTYPES
from .kernels.layout import Fp4KernelWeight, dequantize_kernel_weight


def register_checkpoint_param(layer: nn.Module, name: str, tensor: Tensor, **attrs: Any) -> None:
    """A checkpoint tensor's parameter, loaded by the layer's own ``weight_loader``."""
    param = nn.Parameter(tensor, requires_grad=False)
    set_weight_attrs(param, {"weight_loader": layer.weight_loader, **attrs})
    layer.register_parameter(name, param)


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


class Fp4LinearMethodBase(LinearMethod):
    """An FP4 linear layer after loading: the kernel layout's buffers (:func:`register_kernel_weight`)."""

    supported_act_dtypes = ACT_DTYPES

    def dequantize(self, layer: nn.Module) -> Tensor:
        return dequantize_kernel_weight(kernel_weight(layer), layer.params_dtype)

    def apply(self, layer: nn.Module, x: Tensor, bias: Tensor | None = None) -> Tensor:
        return fp4_linear(kernel_weight(layer), x, bias)


class Fp4LinearConfig(QuantConfig):
    """FP4 linear layers; ``skipped`` ones stay 16-bit. Subclasses say which method a layer gets."""

    supported_act_dtypes = ACT_DTYPES

    def __init__(self, skipped: list[str] | None = None) -> None:
        self.skipped = list(skipped or [])

    #: The checkpoint layout of this format's MoE experts (``fw_fp4.experts.FORMATS``).
    experts_layout = ""

    def linear_method(self) -> LinearMethod:
        raise NotImplementedError

    def get_quant_method(self, layer: nn.Module, prefix: str) -> QuantMethodBase | None:
        from framework.layers.embedding import LMHead, VocabEmbedding
        from framework.layers.fused_moe import FusedMoE
        from framework.layers.linear import LinearBase

        if self.is_skipped(prefix):
            return None
        if isinstance(layer, FusedMoE):
            from .experts import Fp4ExpertsMethod

            return Fp4ExpertsMethod(self.experts_layout)
        if not isinstance(layer, LinearBase) or isinstance(layer, VocabEmbedding | LMHead):
            return None
        return self.linear_method()

    def is_skipped(self, prefix: str) -> bool:
        """``prefix`` is listed: by name (``lm_head``), a glob (``model.layers.*.mlp.gate``, a module
        or anything under it) or a regular expression (``re:...``)."""
        for pattern in self.skipped:
            if pattern.startswith("re:"):
                if re.match(pattern[3:], prefix):
                    return True
            elif (
                prefix.endswith(f".{pattern}")
                or fnmatch.fnmatch(prefix, pattern)
                or fnmatch.fnmatch(prefix, f"{pattern}.*")
            ):
                return True
        return prefix in self.skipped


def compressed_tensors_fp4_weights(config: dict[str, Any], name: str) -> dict[str, Any]:
    """The ``weights`` scheme of a compressed-tensors FP4 checkpoint (``name``: ``"compressed-tensors
    nvfp4"`` / ``"... mxfp4"``, for the messages): one config group of 4-bit float weights, else a
    ConfigError. The caller checks its format's group size."""
    groups = list((config.get("config_groups") or {}).values())
    if len(groups) != 1:
        raise ConfigError(f"{name}: {len(groups)} config_groups; fw supports one scheme")
    weights = groups[0].get("weights") or {}
    if weights.get("type") != "float" or weights.get("num_bits") != 4:
        kind = name.split()[-1]
        raise ConfigError(
            f"{name}: weights {weights.get('num_bits')}-bit {weights.get('type')!r}; "
            f"{kind}-pack-quantized stores 4-bit float"
        )
    return weights
